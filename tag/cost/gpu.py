"""GPU compute cost: achieved rates per op class and dtype, fitted from measurements on real GPUs.

Every op of the joint graph falls in one **class** (:func:`op_class`): ``matmul`` (``mm``,
``addmm``, ``bmm``, ...), ``conv`` (convolutions and their backward), ``attention`` (fused
scaled-dot-product kernels), ``norm`` (normalisations, softmaxes, reductions), ``opt`` (the
optimizer update of one parameter) or ``memory`` (everything else: elementwise ops, copies,
casts). CUDA kernels fall in the same classes by name (:func:`kernel_class`), which is how the
constants are fitted. An op's seconds on a GPU (:func:`op_seconds`):

* ``matmul``: ``C_mm[mode] + flops / R_mm[mode]``; ``conv``: ``K + flops / R_conv[mode]``. A bf16/fp16
  matmul with a leading dimension that is not a multiple of 8 elements (a vocabulary of 50257 or
  30522, a sequence of 197) runs on kernels that load ``a`` elements per access instead of 8 (16
  bytes; ``a`` = 1, 2 or 4, :func:`gemm_alignment`, from the dimensions its FLOPs and operand
  sizes give): ``C_mm[low] + flops / (a * R_mm[low] / 8)``. Measured on the H200 (eager steps of
  2026-11-26): GPT-2's LM head (50257, 1 element) 119 TFLOP/s, BERT's (30522, 2) 240, aligned
  GEMMs 780. fp32 (FFMA) GEMMs need no 16-byte access; TF32 ones would, unmeasured: not modelled
* ``attention``: ``K + flops / (e_att[mode] * R_ref[mode])``, ``flops`` those of the query-key
  pairs the kernel computes: whole tiles of :data:`ATTENTION_TILES` pairs, so a sequence of 197
  runs as 256 and a causal attention skips the tiles above the diagonal only
  (:func:`attention_tile_fraction`); fp32 attention is ``fp32`` mode whatever the TF32 flag says
  (:func:`op_mode`)
* ``norm``: ``K + bytes / BW_norm`` (batch norm's extra passes: :data:`NORM_PASSES`); a batch
  norm in bf16 ``2 K + bytes / BW_bn_bf16`` (:data:`BN_BF16_KERNELS`);
  ``memory``: ``K + bytes / BW``
* ``opt``: ``bytes * sweeps / BW_opt`` (PyTorch's multi-tensor Adam/SGD passes over its tensors
  more often than the capture's single-kernel count, :data:`FOREACH_SWEEPS`); its launches are
  paid once per step (:meth:`GpuRates.step_overhead`)

``K`` (``kernel_s``) is the per-kernel floor: the device seconds a kernel costs beyond its work
(small kernels do not fill the GPU). A matmul's floor is its own, ``C_mm[mode]``
(``matmul_call_s``): small and unaligned GEMMs run below the large-matmul rate, and the seconds they
lose are charged per call, so a large matmul runs at ``R_mm``, the rate the steps' large GEMMs
reach (fitted since 2026-11-28; the microbenchmark's marginal rate between n=1024 and n=4096
square matmuls before, and for TF32, which no step runs) whatever small ones the fit saw. The host issues one launch per op, ``host_s`` each
in the forward and ``host_backward_s`` in the backward (autograd's C++ engine, no Python:
:func:`host_seconds`), walks every parameter once per multi-tensor kernel of the optimizer step,
``opt_host_s`` each (measured in the profiled steps' op tables), and spends ``step_host_s`` once per step: eager PyTorch dispatches kernels one by one, so a stream of small kernels
runs at the host's pace. Those seconds are the host's the rates were fitted on; a machine whose topology
entry states ``host_launch`` has them scaled to it (:func:`on_host`). ``mode`` is the op's dtype as the hardware runs it: ``low`` (bf16/fp16
tensor cores) for a bf16/fp16 op; for an fp32 op ``tf32`` where PyTorch enables TF32
(:class:`Numerics`: cuDNN convolutions by default, matmuls only when
``torch.backends.cuda.matmul.allow_tf32`` is set), else ``fp32``.

Where the constants come from (``GpuRates.source``):

* ``fitted:<type>``: a GPU type with microbenchmarks in ``gpu_calib/<type>.jsonl``
  (:func:`fit_microbenchmarks`, :func:`microbenchmark_rates`): ``R_mm[mode]`` is the slope of time
  over FLOPs between the two largest square matmuls, ``R_conv`` the measured 3x3 convolution,
  ``BW`` the large elementwise kernel, ``launch_s`` the per-kernel time of a stream of tiny
  kernels; ``R_ref`` = ``R_mm`` of the microbenchmarks. Where eager training steps were
  profiled (``gpu_calib/<type>-fit.json``, written by ``evaluation/gpu_cost_check.py``) the
  constants of :data:`FIT_PARAMS` (``K``, ``C_mm``, ``R_conv``, ``BW``, ``BW_norm``, ``BW_opt``;
  ``e_att[mode]`` only where the steps' attention kernels in that mode take long enough to identify it) are fitted to
  the per-class kernel seconds of those steps (:func:`fit_device`) and ``host_s`` (``step_host_s``
  where the fit file sets it) to their step times; ``R_mm[tf32]`` stays the microbenchmark's (:data:`FIXED_PARAMS`),
  and a constant no profiled step identifies keeps the microbenchmark's (``e_att`` = 1: fused
  attention at the matmul rate of its mode, an assumption).
* ``published:<type>``: a catalog GPU with published achieved rates in ``gpu_calib/published.json``
  (:data:`PUBLISHED`, each rate with its source: Aceso's per-op profiles of a Megatron-LM OPT-350M
  layer in eth-easl/sailor for V100, RTX 2080 Ti, Titan RTX, RTX 3090, A100-40GB and GH200; the
  maximum achievable matmul table of stas00/ml-engineering for A100-80GB, A100 PCIe and H100 SXM;
  a cuBLAS run and a bandwidthTest for the T4). The ``datasheet:<type>`` rates with the published
  ones in place (:func:`with_published`): ``R_mm[mode]`` and ``BW`` (a large-GEMM rate: a matmul
  costs ``C_mm + max(F / R_mm, bytes / BW)``, :attr:`GpuRates.matmul_bytes_floor`); the rates derived from them
  keep their H200 ratios (``R_conv``, fused attention, the unaligned bf16 rate per mode; ``BW_norm``,
  ``BW_opt``, ``BW_bn_bf16``); every constant in seconds stays the H200's.
* ``datasheet:<type>``: any other catalog GPU. The achieved-to-datasheet ratios of the fitted
  type (H200) are applied to this type's datasheet peaks (FP32, TF32 :data:`TF32_TFLOPS`,
  FP16/BF16 tensor, memory bandwidth); ``K``, ``C_mm``, ``host_s``, ``step_host_s`` and ``launch_s`` are kept in seconds,
  ``e_att`` as a ratio. Without TF32 (before Ampere) a tf32 op runs at the FP32 rate.

Checked against published per-layer times (``published.json`` ``layers``, :func:`layer_check`,
``gpu_calib/published-check.md``): against Sailor's Megatron-DeepSpeed OPT-350M layers (fp32, TF32
on Ampere and Hopper; micro-batches 1-32) on seven GPU types TAG's forward is 0.73-1.14x the
published (median error 6.0%) with the ``megatron`` runtime (:data:`RUNTIMES`), which those runs
used, and 0.97-1.51x (30%) as TAG's executor runs the layer; the published backward is 1.3-2.0x
TAG's (timed by module hooks, not used). Micro-batch: the rule's per-sample seconds fall as the
per-kernel floors and host launches spread over more samples (non-increasing, to the large-batch
rate): flat where the GPU bounds micro-batch 1, as published (V100, RTX 2080 Ti, Titan RTX, RTX
3090: 1.01 predicted, 0.98-1.02 published at 1 over the largest), falling where the host does
(GH200: 1.19 eager / 1.08 megatron against 1.40 published at 1 over 8: the host's share is
under-predicted), and not the A100s' fall (1.03 predicted, 1.14 and 1.57 published; whether host
or device fill is not identified: the A100-80GB's micro-batch 1 is slower than the A100-40GB's). A
GEMM's rate below the large-matmul rate by its shape (tile waves over the SMs) is not modelled.

Not measured anywhere, assumed: an fp32 convolution with TF32 off reaches the same fraction of
the FP32 matmul rate as the TF32 convolution reaches of the TF32 matmul rate; fp16 runs at the
bf16 rates (equal in every datasheet of the catalog's tensor-core GPUs); convolution backward
runs at the forward convolution's rate; an unaligned GEMM's rate scales with its access width
(``a / 8`` of the aligned rate: the H200's LM heads above ran 1.2x faster than that). Not modelled: a matmul's shape beyond its FLOPs, its
per-call ``C_mm`` and its alignment.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

CALIB_DIR = Path(__file__).resolve().parent / "gpu_calib"
"""Microbenchmarks (``<type>.jsonl``) and step-fitted constants (``<type>-steps.json``)."""
REFERENCE_GPU = "H200"
"""The measured type whose efficiencies derive the others."""

OP_CLASSES = ("matmul", "conv", "attention", "norm", "memory", "opt")
MODES = ("fp32", "tf32", "low")

# ATen overload packets by class (the joint graph's targets are ``aten.<name>.<overload>``).
_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot", "_int_mm"}
_CONV = {"convolution", "convolution_backward", "_convolution", "cudnn_convolution", "conv2d", "conv1d",
         "conv3d", "conv_transpose2d", "_slow_conv2d_forward", "_slow_conv2d_backward"}
_ATTENTION_PREFIX = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "scaled_dot_product")
# Normalisations, softmaxes and reductions: one kernel that reads its input (often twice) and
# writes a smaller or equal output, slower per byte than a plain elementwise kernel.
_NORM = {"native_layer_norm", "native_layer_norm_backward", "layer_norm", "native_batch_norm",
         "native_batch_norm_backward", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
         "_native_batch_norm_legit_no_training", "batch_norm", "cudnn_batch_norm", "cudnn_batch_norm_backward",
         "native_group_norm", "native_group_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
         "_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data", "softmax", "log_softmax",
         "sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "prod", "logsumexp", "norm",
         "linalg_vector_norm", "nll_loss_forward", "nll_loss_backward", "nll_loss", "nll_loss2d_forward",
         "nll_loss2d_backward"}

NORM_PASSES = {"_native_batch_norm_legit_functional": 1.5, "_native_batch_norm_legit": 1.5, "native_batch_norm": 1.5,
               "native_batch_norm_backward": 5 / 3}
"""Batch norm's tensor passes over the bytes the capture counts: training forward reads its input
twice (statistics, then normalisation: 3 passes for 2 counted), backward reads input and gradient
twice (reduction, then the elementwise pass: 5 for 3), as PyTorch's and cuDNN's batch-norm kernels
do (``batch_norm_collect_statistics`` + ``batch_norm_transform_input``; ``batch_norm_backward_reduce``
+ ``batch_norm_backward_elemt``). Layer norm and softmax keep a row on chip: counted once."""

BN_BF16_KERNELS = 2
"""Kernels of one batch norm (forward or backward) in bf16. Measured on the H200
(2026-11-27, eager ResNet-50/101/152 at 224): in bf16 autocast the batch norms run on PyTorch's
native kernels (``aten::native_batch_norm_backward``; ``batch_norm_collect_statistics`` +
``batch_norm_transform_input`` forward, ``batch_norm_backward_reduce`` + ``batch_norm_backward_elemt``
backward: ResNet-152 launches 626 norm kernels per step) where fp32 runs cuDNN's one kernel per
direction (``cudnn_batch_norm_backward``: 316), and they took 2.3-2.7x the time of the norm rule.
An fp16 batch norm is costed as an fp32 one: PyTorch sends a half input with fp32 weights (autocast's)
to cuDNN and only bf16 to its native kernels (``use_cudnn`` in ``_batch_norm_impl_index``,
``aten/src/ATen/native/Normalization.cpp``); not measured."""

ATTENTION_TILES = {"fp32": {"fwd": (64, 64), "bwd": (64, 64)}, "low": {"fwd": (64, 128), "bwd": (64, 64)}}
"""mode -> phase -> (query rows, key columns) of the tile a fused attention kernel computes at
once, read from the kernels eager PyTorch 2.11 launched on the H200 (2026-11-27,
``evaluation/results/gpu-check/2026-11-27-h200/run1.jsonl``): fp32 runs the memory-efficient
kernels ``fmha_cutlassF_f32_aligned_64x64_rf_sm80`` / ``fmha_cutlassB_f32_aligned_64x64_k64_sm80``,
bf16 cuDNN's ``..._flash_fprop_wgmma_f16_knob_7_64x128x64_...`` / ``..._flash_bprop_..._64x64x64_...``
(every SDPA preset, head width 64). Other GPU types are assumed to tile as these do."""

FOREACH_SWEEPS = {"adam": 18, "sgd": 8, "sgd-plain": 3}
"""Tensor passes (reads + writes, each one parameter's size) of ``torch.optim``'s multi-tensor
(``foreach``) step, counted from ``torch/optim/adam.py`` ``_multi_tensor_adam`` (lerp_ 2r1w,
mul_ 1r1w, addcmul_ 2r1w, sqrt 1r1w, div_ 1r1w, add_ 1r1w, addcdiv_ 3r1w) and ``sgd.py``
``_multi_tensor_sgd`` (momentum: mul_ 1r1w, add_ 2r1w, add_ 2r1w; plain: add_ 2r1w)."""
ALIGN_ELEMENTS = 8
"""Elements of a 16-byte access in bf16/fp16: a GEMM whose dimensions are multiples of it runs on
the aligned tensor-core kernels (cuBLAS' TMA and vectorised-load paths)."""

FOREACH_KERNELS = {"adam": 7, "sgd": 3, "sgd-plain": 1}
"""Multi-tensor kernels of one optimizer step (the same source): launched once per step."""

# Datasheet dense TF32 tensor-core peaks (TFLOP/s; the datasheets quote 2x with sparsity). Types
# not listed have no TF32 (pre-Ampere): PyTorch's TF32 switches change nothing there.
TF32_TFLOPS = {
    "A10": 62.5,  # NVIDIA A10 datasheet: 125 TF32 with sparsity
    "A100-40GB": 156.0, "A100-80GB": 156.0, "A100-PCIe-80GB": 156.0,  # A100 datasheet: 156 TF32
    "L4": 60.0,  # L4 datasheet: 120 TF32 with sparsity
    "L40S": 183.0,  # L40S datasheet: 366 TF32 with sparsity
    "RTX-3090": 35.6,  # GA102 whitepaper: 35.6 TF32 tensor (71 with sparsity)
    "H100-SXM": 494.5, "H100-PCIe": 378.0,  # H100 datasheet: 989 / 756 TF32 with sparsity
    "H200": 494.5,  # H200 datasheet: 989 TF32 with sparsity
    "GH200-96GB": 494.5,  # GH200 datasheet: 989 TF32 with sparsity
}


@dataclass(frozen=True)
class Numerics:
    """PyTorch's TF32 switches for fp32 ops (defaults as PyTorch ships them)."""

    matmul_tf32: bool = False
    """``torch.backends.cuda.matmul.allow_tf32`` (PyTorch default False)."""
    conv_tf32: bool = True
    """``torch.backends.cudnn.allow_tf32`` (PyTorch default True)."""


@dataclass(frozen=True)
class GpuRates:
    """Achieved rates of one GPU type. FLOP/s, bytes/s, seconds."""

    gpu: str
    source: str
    """``fitted:<type>`` or ``datasheet:<type>`` (module docstring)."""
    matmul: dict = field(hash=False)
    """mode -> achieved FLOP/s of matmuls in an eager step (beyond their per-kernel floor)."""
    conv: dict = field(hash=False)
    """mode -> achieved FLOP/s of convolutions (cuDNN's layout transforms included)."""
    bandwidth: float
    """Achieved bytes/s of elementwise and copy kernels (class ``memory``)."""
    launch_s: float
    """Seconds per kernel of a stream of tiny kernels (the microbenchmark): a lower bound on
    ``host_s``."""
    host_s: float
    """Host seconds per kernel launch in an eager training step (Python, autograd, dispatch,
    launch), fitted to eager steps where they were measured, else ``launch_s``."""
    step_host_s: float = 0.0
    """Host seconds of an eager step beyond its launches (``optimizer.step``'s and the backward
    engine's Python, ``zero_grad``), paid once per step (:meth:`step_overhead`)."""
    kernel_s: float = 0.0
    """Device seconds every launched kernel costs beyond its FLOPs or bytes (the per-kernel floor;
    optimizer updates excluded: their multi-tensor kernels are few per step)."""
    norm_bandwidth: float | None = None
    """Achieved bytes/s of normalisations, softmaxes and reductions (class ``norm``); None: ``bandwidth``."""
    opt_bandwidth: float | None = None
    """Achieved bytes/s of the multi-tensor optimizer update over its :data:`FOREACH_SWEEPS`
    passes (class ``opt``); None: ``bandwidth``."""
    attention_eff: dict | None = field(default=None, hash=False)
    """mode -> fused attention's achieved FLOP/s as a fraction of ``attention_ref`` (the matmul
    microbenchmark rate of its mode); None or a mode not given: 1."""
    attention_ref: dict | None = field(default=None, hash=False)
    """mode -> FLOP/s that ``attention_eff`` scales; None: ``matmul``."""
    matmul_call_s: dict | None = field(default=None, hash=False)
    """mode -> device seconds of a matmul kernel beyond ``flops / matmul[mode]`` (its floor in
    place of ``kernel_s``); None: ``kernel_s``."""

    matmul_unaligned: float | None = None
    """Achieved FLOP/s of a bf16/fp16 matmul per element of its alignment below
    :data:`ALIGN_ELEMENTS` (:func:`gemm_alignment`): such a GEMM runs at ``a * matmul_unaligned``
    (``a`` = 1, 2 or 4 elements); None: ``matmul["low"] / ALIGN_ELEMENTS``, the load-width bound
    (module docstring)."""

    opt_host_s: float = 0.0
    """Host seconds per parameter tensor and multi-tensor kernel of the optimizer step
    (:data:`FOREACH_KERNELS` per step): each ``torch._foreach_*`` call walks its list of tensors on
    the host, and Adam reads each parameter's step count twice; measured, not fitted, from the
    profiled steps' op tables (``evaluation/gpu_cost_check.py``), 0 where none were profiled."""
    bn_bf16_bandwidth: float | None = None
    """Achieved bytes/s of a batch norm in bf16 (its :data:`NORM_PASSES` included, over
    :data:`BN_BF16_KERNELS` kernels); None: ``norm_bandwidth``."""
    host_backward_s: float | None = None
    """Host seconds per kernel launch of the backward pass: autograd's C++ engine issues those ops
    with no Python frame or module call around them, where ``host_s`` (the forward's) pays both;
    fitted with ``host_s`` where eager steps were measured; None: ``host_s``."""
    matmul_bytes_floor: bool = False
    """A matmul costs at least its bytes at ``bandwidth`` (the roofline: ``C_mm + max(F / R_mm,
    bytes / BW)``). Set for published rates (:func:`with_published`), which are large-GEMM rates:
    an attention score or context product (inner dimension 64, an s x s operand) is memory-bound
    (Aceso's OPT-350M profiles: A100 TF32 36 TFLOP/s against 131 for the large GEMMs, the floor
    gives 37; GH200 fp16 218 against 669, floor 185). False for the fitted type, whose ``R_mm`` and
    ``C_mm`` were fitted to its steps' matmul kernels, memory-bound ones included (a rule linear in
    the constants, :func:`design`), and for the datasheet types derived from it."""

    def unaligned_rate(self, align) -> np.ndarray:
        """FLOP/s of bf16/fp16 matmuls whose alignment is ``align`` elements (array) below
        :data:`ALIGN_ELEMENTS`."""
        per = self.matmul_unaligned if self.matmul_unaligned is not None else self.matmul["low"] / ALIGN_ELEMENTS
        return np.asarray(align, dtype=float) * per

    def matmul_floor(self, mode: str) -> float:
        """Device seconds a matmul kernel in ``mode`` costs beyond its FLOPs."""
        return self.kernel_s if self.matmul_call_s is None else self.matmul_call_s[mode]

    def step_overhead(self, optimizer: str) -> float:
        """Seconds paid once per step: the optimizer's multi-tensor launches and ``step_host_s``."""
        return FOREACH_KERNELS.get(optimizer, 0) * self.launch_s + self.step_host_s

    @property
    def host_bwd(self) -> float:
        """Host seconds per backward launch: ``host_backward_s``, else ``host_s``."""
        return self.host_s if self.host_backward_s is None else self.host_backward_s

    @property
    def norm_bw(self) -> float:
        """Bytes/s of class ``norm``: ``norm_bandwidth``, else ``bandwidth``."""
        return self.norm_bandwidth or self.bandwidth

    @property
    def opt_bw(self) -> float:
        """Bytes/s of the optimizer update: ``opt_bandwidth``, else ``bandwidth``."""
        return self.opt_bandwidth or self.bandwidth

    @property
    def bn_bf16_bw(self) -> float:
        """Bytes/s of a bf16 batch norm: ``bn_bf16_bandwidth``, else :attr:`norm_bw`."""
        return self.bn_bf16_bandwidth or self.norm_bw

    @property
    def attention_base(self) -> dict:
        """mode -> FLOP/s that ``attention_eff`` scales: ``attention_ref``, else ``matmul``."""
        return self.attention_ref or self.matmul

    def attention_rate(self, mode: str) -> float:
        """Achieved FLOP/s of a fused attention kernel in ``mode``."""
        return self.attention_base[mode] * (self.attention_eff or {}).get(mode, 1.0)


def op_class(target: str) -> str:
    """Class of an op target (``aten.mm.default``, ``optim.adam``, ...): one of :data:`OP_CLASSES`."""
    if target.startswith("optim."):
        return "opt"
    parts = target.split(".")
    name = parts[1] if len(parts) >= 2 and parts[0] == "aten" else target
    if name in _MATMUL:
        return "matmul"
    if name in _CONV:
        return "conv"
    if name.startswith(_ATTENTION_PREFIX):
        return "attention"
    if name in _NORM:
        return "norm"
    return "memory"


# CUDA kernel names (``torch.profiler`` device events) by class, tried in order: the first match
# wins (cuDNN's implicit-GEMM convolutions contain "gemm", its batch norms "cudnn").
_KERNEL_PATTERNS = (
    (None, re.compile(r"^[\w.]+#|^ProfilerStep")),  # profiler annotations on the device timeline, not kernels
    ("opt", re.compile(r"multi_tensor_apply|fused_adam|FusedAdam|fused_sgd")),
    ("attention", re.compile(r"fmha|flash|sdpa|[Aa]ttention|cudnn::fusion::")),
    ("norm", re.compile(r"batch_norm|bn_fw|bn_bw|layer_norm|GammaBeta|rms_norm|[Ss]oft[Mm]ax|native::reduce_kernel"
                        r"|nll_loss|group_norm|welford|cross_entropy")),
    ("conv", re.compile(r"conv(?!ert)|fprop|dgrad|wgrad|nchwToNhwc|nhwcToNchw|nhwckrsc|nchwkcrs")),
    ("matmul", re.compile(r"gemm|gemv|nvjet|cublas|splitKreduce|scal_kernel|_ampere_|_hopper_")),
)


def kernel_class(name: str) -> str | None:
    """Class (:data:`OP_CLASSES`) of a CUDA kernel by its profiler name, or None for a profiler
    annotation (``Optimizer.step#Adam.step``: a range on the device timeline that overlaps the
    kernels inside it). cuDNN's NCHW<->NHWC layout transforms count as ``conv``: the graph's
    convolution launches them; everything not matched (elementwise, copies, memsets, gathers,
    ``cat``, sorts) is ``memory``."""
    for cls, pattern in _KERNEL_PATTERNS:
        if pattern.search(name):
            return cls
    return "memory"


def op_mode(cls: str, dtype: str, numerics: Numerics) -> str:
    """The hardware mode an op of class ``cls`` and output ``dtype`` runs in. Fused attention in
    fp32 is ``fp32`` whatever ``allow_tf32`` says: the flag is cuBLAS's, and the fused kernels
    (PyTorch's own) are not cuBLAS calls; not measured with TF32 on."""
    if dtype in ("bfloat16", "float16"):
        return "low"
    if cls == "conv":
        return "tf32" if numerics.conv_tf32 else "fp32"
    if cls == "attention":
        return "fp32"
    return "tf32" if numerics.matmul_tf32 else "fp32"


# ------------------------------------------------------------------------------ measurements
def load_calibration(gpu: str, root: Path = CALIB_DIR) -> list[dict]:
    """The microbenchmark records of GPU type ``gpu`` (empty when none are shipped)."""
    path = Path(root) / f"{gpu}.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _matmul_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(rate FLOP/s, intercept s) of ``t = c + F / R`` through the two largest (F, t) points."""
    (f1, t1), (f2, t2) = sorted(points)[-2:]
    rate = (f2 - f1) / (t2 - t1)
    return rate, t1 - f1 / rate


def fit_microbenchmarks(records: list[dict]) -> dict:
    """Rates from one GPU's microbenchmarks (``kind`` matmul / conv3x3 / elementwise / launch).

    Returns ``{"matmul": {mode: FLOP/s}, "matmul_call_s": {mode: s}, "conv": {mode: FLOP/s},
    "bandwidth": B/s, "launch_s": s}``; ``matmul_call_s`` is the intercept of an isolated call.
    """
    mm: dict[str, list] = {}
    conv: dict[str, float] = {}
    out: dict = {"bandwidth": None, "launch_s": None}
    for r in records:
        kind = r.get("kind")
        low = r.get("dtype") in ("torch.bfloat16", "torch.float16")
        if kind == "matmul":
            mode = "low" if low else ("tf32" if r.get("tf32") else "fp32")
            mm.setdefault(mode, []).append((2.0 * r["n"] ** 3, r["s"]))  # n x n @ n x n: 2 n^3 FLOPs
        elif kind == "conv3x3":
            # cuDNN runs an "fp32" convolution on TF32 by default (torch.backends.cudnn.allow_tf32)
            n, c, h, w = r["shape"]  # 3x3, stride 1, padding 1, c -> c channels: 2 * 9 c^2 h w n FLOPs
            conv["low" if low else "tf32"] = (2.0 * 9 * c * c * h * w * n, r["s"])
        elif kind == "elementwise":
            out["bandwidth"] = r["bytes"] / r["s"]
        elif kind == "launch":
            out["launch_s"] = r["s_per_kernel"]
    fits = {m: _matmul_fit(p) for m, p in mm.items() if len(p) >= 2}
    out["matmul"] = {m: f[0] for m, f in fits.items()}
    out["matmul_call_s"] = {m: f[1] for m, f in fits.items()}
    # The convolution is one isolated call of the same harness: its time holds the same per-call
    # intercept as the matmuls of its mode (28-40 us on the H200), which is not part of the rate.
    conv = {m: f / (s - out["matmul_call_s"].get(m, 0.0)) for m, (f, s) in conv.items()}
    if "tf32" in conv and "fp32" in out["matmul"] and "tf32" in out["matmul"]:
        conv["fp32"] = conv["tf32"] * out["matmul"]["fp32"] / out["matmul"]["tf32"]  # assumption (docstring)
    out["conv"] = conv
    return out


FIT_PARAMS = {
    "kernel_s": ("s", "device seconds every launched kernel costs beyond its work (the per-kernel floor)"),
    "matmul:fp32": ("FLOP/s", "matmuls on fp32 (FFMA) kernels beyond their per-call seconds (the steps' "
                              "large GEMMs identify it: GPT-2 XL, Llama 1.1B)"),
    "matmul:tf32": ("FLOP/s", "matmuls on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32): the "
                              "microbenchmark's marginal rate, not fitted (no step runs one)"),
    "matmul:low": ("FLOP/s", "matmuls on bf16/fp16 tensor cores beyond their per-call seconds"),
    "conv:fp32": ("FLOP/s", "convolutions with TF32 off"),
    "conv:tf32": ("FLOP/s", "fp32 convolutions (cuDNN runs them on TF32 by default), layout transforms included"),
    "conv:low": ("FLOP/s", "bf16/fp16 convolutions, layout transforms included"),
    "attention_eff:fp32": ("1", "fp32 fused attention's FLOP/s over the fp32 matmul microbenchmark rate"),
    "attention_eff:low": ("1", "bf16/fp16 fused attention's FLOP/s over the bf16 matmul microbenchmark rate"),
    "memory_bw": ("B/s", "elementwise, copy and cast kernels (bytes read + written)"),
    "norm_bw": ("B/s", "normalisation, softmax and reduction kernels (bytes read + written)"),
    "opt_bw": ("B/s", "the multi-tensor optimizer update (bytes of its FOREACH_SWEEPS passes)"),
    "bn_bf16_bw": ("B/s", "batch norm in bf16 (PyTorch's native kernels, BN_BF16_KERNELS per direction; bytes "
                         "with NORM_PASSES)"),
    "matmul_call:fp32": ("s", "device seconds per fp32 matmul kernel beyond FLOPs / matmul:fp32"),
    "matmul_call:tf32": ("s", "device seconds per TF32 matmul kernel beyond FLOPs / matmul:tf32"),
    "matmul_call:low": ("s", "device seconds per bf16/fp16 matmul kernel beyond FLOPs / matmul:low"),
    "matmul_unaligned:low": ("FLOP/s", "bf16/fp16 matmuls with a leading dimension not a multiple of 8, per "
                                       "element of alignment (a GEMM aligned to a = 1, 2, 4 elements runs at a "
                                       "times it): matmul:low / 8, not fitted"),
}
"""The device constants of the GPU rule, fitted per GPU type to the per-class kernel seconds of
eager training steps (:func:`fit_device`): name -> (unit, what it times). The fit is linear in
their inverses (a kernel's seconds: ``kernel_s`` + FLOPs / rate or bytes / bandwidth), so each
is one column of :func:`design`, except the seconds (``kernel_s``, ``matmul_call:<mode>``), which
enter as they are. ``host_s`` (s per launch) and ``step_host_s`` (s per step) are fitted to step
times afterwards."""
COLUMNS = tuple(FIT_PARAMS)
FIXED_PARAMS = ("matmul:tf32", "matmul_unaligned:low")
"""Columns never fitted: the TF32 matmul rate (TF32 matmuls are off by default, so no profiled
step runs one: the microbenchmark's marginal rate) and the unaligned bf16 rate (the fitted bf16
rate over :data:`ALIGN_ELEMENTS` per element of alignment, :attr:`GpuRates.matmul_unaligned`). The fp32 and bf16 rates were held at the microbenchmark's
until 2026-11-28, when the steps were small and a flat fitted rate charged their small GEMMs'
shortfall to every FLOP; with ``matmul_call:<mode>`` per call and the real-size zoo's large GEMMs
in the fit they are fitted: 46.9 fp32 and 765 bf16 TFLOP/s on the H200 against the
microbenchmark's 50.6 and 780."""
SECONDS = tuple(n for n, (unit, _) in FIT_PARAMS.items() if unit == "s")
"""Columns in seconds (the others are inverse rates in theta)."""


def load_fit(gpu: str, root: Path = CALIB_DIR) -> dict:
    """The constants fitted to eager training steps of ``gpu`` (``<type>-fit.json``; ``{}`` when
    none are shipped): ``{"params": {name: value}, "host_s": s, "step_host_s": s, ...}``."""
    path = Path(root) / f"{gpu}-fit.json"
    return json.loads(path.read_text()) if path.is_file() else {}


ATTENTION_MODES = ("fp32", "low")
"""Modes fused attention runs in (:func:`op_mode`), one ``attention_eff:<mode>`` each."""


def theta_of(rates: GpuRates) -> np.ndarray:
    """The fit's unknowns for ``rates`` (:data:`COLUMNS` order): the seconds (:data:`SECONDS`) as
    they are, every other one the inverse of its rate (s/FLOP, s/B, or 1 / ``attention_eff``)."""
    value = {"kernel_s": rates.kernel_s, "memory_bw": rates.bandwidth,
             "norm_bw": rates.norm_bw, "opt_bw": rates.opt_bw, "bn_bf16_bw": rates.bn_bf16_bw,
             "matmul_unaligned:low": float(rates.unaligned_rate(1))}
    for m in MODES:
        value[f"matmul:{m}"], value[f"conv:{m}"] = rates.matmul[m], rates.conv[m]
        value[f"matmul_call:{m}"] = rates.matmul_floor(m)
    for m in ATTENTION_MODES:
        value[f"attention_eff:{m}"] = (rates.attention_eff or {}).get(m, 1.0)
    return np.array([value[n] if n in SECONDS else 1.0 / value[n] for n in COLUMNS])


def with_theta(rates: GpuRates, theta, source: str | None = None) -> GpuRates:
    """``rates`` with the constants of ``theta`` (:func:`theta_of`'s layout)."""
    import dataclasses

    v = {n: float(x) if n in SECONDS else 1.0 / float(x) for n, x in zip(COLUMNS, theta)}
    return dataclasses.replace(
        rates, source=source or rates.source, kernel_s=v["kernel_s"],
        matmul={m: v[f"matmul:{m}"] for m in MODES}, conv={m: v[f"conv:{m}"] for m in MODES},
        attention_eff={m: v[f"attention_eff:{m}"] for m in ATTENTION_MODES}, bandwidth=v["memory_bw"],
        norm_bandwidth=v["norm_bw"], opt_bandwidth=v["opt_bw"], bn_bf16_bandwidth=v["bn_bf16_bw"],
        attention_ref=dict(rates.attention_base),
        matmul_call_s={m: v[f"matmul_call:{m}"] for m in MODES}, matmul_unaligned=v["matmul_unaligned:low"])


def fit_device(X: np.ndarray, T: np.ndarray, prior: np.ndarray, fixed=()) -> np.ndarray:
    """Non-negative least squares for the unknowns ``theta`` of ``X @ theta ~= T``, each row
    weighted by ``1 / T`` (relative errors: a 50 us class counts as much as a 50 ms one).

    ``X``: ``[rows, len(COLUMNS)]``, the summed :func:`design` of the ops of one measured group of
    kernels (a class of one workload's step); ``T``: ``[rows]`` their measured seconds. A column
    no row exercises (no convolution among the workloads, say) and the columns named in ``fixed``
    keep ``prior``'s value (their share of each row is taken off its measured seconds)."""
    from scipy.optimize import nnls

    X, T, prior = np.asarray(X, float), np.asarray(T, float), np.asarray(prior, float)
    used = (np.abs(X).sum(axis=0) > 0) & ~np.isin(np.array(COLUMNS), list(fixed))
    A = X / T[:, None]
    b = np.ones(len(T)) - A[:, ~used] @ prior[~used]
    scale = np.where(used, np.abs(A).max(axis=0), 1.0)  # columns of FLOPs, bytes and counts differ by 1e12
    sol, _ = nnls(A[:, used] / scale[used], b)
    theta = prior.copy()
    theta[used] = sol / scale[used]
    return theta


def tf32_peak(spec) -> float:
    """Datasheet dense TF32 FLOP/s of a catalog GPU (its FP32 peak where it has no TF32)."""
    t = TF32_TFLOPS.get(spec.name)
    return t * 1e12 if t is not None else spec.fp32_flops


def _peaks(spec) -> dict:
    return {"fp32": spec.fp32_flops, "tf32": tf32_peak(spec), "low": spec.fp16_flops}


def microbenchmark_rates(gpu: str = REFERENCE_GPU) -> GpuRates | None:
    """Rates of a GPU type from its microbenchmarks alone (no per-kernel floor, one bandwidth,
    ``host_s`` = ``launch_s``): the prior of :func:`fit_device`, or None without measurements."""
    records = load_calibration(gpu)
    if not records:
        return None
    fit = fit_microbenchmarks(records)
    return GpuRates(gpu, f"fitted:{gpu}", dict(fit["matmul"]), dict(fit["conv"]), fit["bandwidth"], fit["launch_s"],
                    fit["launch_s"], attention_ref=dict(fit["matmul"]))


@functools.cache
def fitted_rates(gpu: str = REFERENCE_GPU) -> GpuRates | None:
    """Rates of a GPU type with shipped microbenchmarks, or None; where eager steps were fitted
    (``<type>-fit.json``) their per-class constants and ``host_s`` replace the microbenchmarks'."""
    base = microbenchmark_rates(gpu)
    if base is None:
        return None
    fit = load_fit(gpu)
    if not fit:
        return base
    import dataclasses

    theta = theta_of(base)
    for i, name in enumerate(COLUMNS):
        if name in fit["params"]:
            v = float(fit["params"][name])
            theta[i] = v if name in SECONDS else 1.0 / v
    bwd = fit.get("host_backward_s")
    # the unaligned bf16 rate is the (fitted) aligned one over ALIGN_ELEMENTS, unless the fit stored its own
    unaligned = float(fit["params"]["matmul_unaligned:low"]) if "matmul_unaligned:low" in fit["params"] else None
    return dataclasses.replace(with_theta(base, theta), matmul_unaligned=unaligned, host_s=float(fit["host_s"]),
                               host_backward_s=None if bwd is None else float(bwd),
                               step_host_s=float(fit.get("step_host_s", 0.0)),
                               opt_host_s=float(fit.get("opt_host_s", 0.0)))


PUBLISHED = CALIB_DIR / "published.json"
"""Published achieved rates per GPU type and published per-layer times, each with its source."""
PUBLISHED_RATES = ("matmul:fp32", "matmul:tf32", "matmul:low", "memory_bw")
"""The constants a published rate replaces (:func:`published_rates`); every other one of a
published type comes from :func:`datasheet_rates` (module docstring)."""


@functools.cache
def load_published(path: Path = PUBLISHED) -> dict:
    """``published.json``: ``{"sources": {id: {...}}, "rates": {type: {name: entry}}, "layers": [...]}``;
    an entry holds ``source`` (a key of ``sources``) and either ``value`` (FLOP/s or B/s) or
    ``points`` (``[label, work, seconds]``: FLOPs or bytes of one measured kernel and its seconds);
    a type given as ``{"same_as": other, "why": ...}`` has ``other``'s rates (the same chip and clocks)."""
    from ..errors import TopologyError

    data = json.loads(Path(path).read_text())
    for gpu, entry in data["rates"].items():
        if "same_as" in entry:  # another part of the same chip at the same clocks
            if not isinstance(data["rates"].get(entry["same_as"]), dict) or "same_as" in data["rates"][entry["same_as"]]:
                raise TopologyError(f"{path}: rates.{gpu}.same_as: expected a type with rates of its own, "
                                    f"got {entry['same_as']!r}")
            continue
        for name, e in entry.items():
            where = f"{path}: rates.{gpu}.{name}"
            if e.get("source") not in data["sources"]:
                raise TopologyError(f"{where}.source: expected one of {sorted(data['sources'])}, got {e.get('source')!r}")
            if not ("value" in e or e.get("points")) or published_value(e) <= 0:
                raise TopologyError(f"{where}: expected a positive 'value' or non-empty 'points' [label, work, seconds]")
    return data


def published_value(entry: dict) -> float:
    """An entry's rate: its ``value``, else the best ``work / seconds`` among its ``points`` (an
    achieved rate of a real kernel, its per-call seconds included: a lower bound on the large-op rate)."""
    if "value" in entry:
        return float(entry["value"])
    return max(work / s for _, work, s in entry["points"])


def published_rates(gpu: str) -> dict[str, tuple[float, str]]:
    """``name -> (rate, source id)`` of the published rates of GPU type ``gpu`` among
    :data:`PUBLISHED_RATES` (empty where none are published)."""
    rates = load_published()["rates"]
    entry = rates.get(gpu, {})
    entry = rates[entry["same_as"]] if "same_as" in entry else entry
    return {n: (published_value(e), e["source"]) for n, e in entry.items() if n in PUBLISHED_RATES}


def datasheet_rates(spec) -> GpuRates:
    """The fitted type's (:data:`REFERENCE_GPU`) rates carried to catalog GPU ``spec`` by datasheet
    ratios (module docstring, ``datasheet:<type>``)."""
    ref = fitted_rates(REFERENCE_GPU)
    from ..topology.catalog import match_gpu_name

    ref_spec = match_gpu_name(REFERENCE_GPU)
    rp, sp = _peaks(ref_spec), _peaks(spec)
    mm = {m: ref.matmul[m] / rp[m] * sp[m] for m in MODES}
    conv = {m: ref.conv[m] / rp[m] * sp[m] for m in MODES}
    if spec.name not in TF32_TFLOPS:  # no TF32 tensor cores: a "tf32" op runs as fp32
        mm["tf32"], conv["tf32"] = mm["fp32"], conv["fp32"]
    bw_ratio = spec.memory_bandwidth / ref_spec.memory_bandwidth
    return GpuRates(spec.name, f"datasheet:{spec.name}", mm, conv, ref.bandwidth * bw_ratio, ref.launch_s, ref.host_s,
                    ref.step_host_s, ref.kernel_s, ref.norm_bw * bw_ratio, ref.opt_bw * bw_ratio,
                    ref.attention_eff and dict(ref.attention_eff),
                    {m: ref.attention_base[m] / rp[m] * sp[m] for m in MODES},
                    None if ref.matmul_call_s is None else dict(ref.matmul_call_s),
                    float(ref.unaligned_rate(1)) / rp["low"] * sp["low"], opt_host_s=ref.opt_host_s,
                    bn_bf16_bandwidth=ref.bn_bf16_bw * bw_ratio, host_backward_s=ref.host_backward_s)


def with_published(base: GpuRates, pub: dict[str, tuple[float, str]]) -> GpuRates:
    """``base`` (:func:`datasheet_rates`) with the published rates ``pub`` (:func:`published_rates`):
    a published matmul rate replaces its mode's, and the rates derived from it move with it
    (the convolution and fused-attention rates of that mode keep their ratio to the matmul rate,
    the unaligned bf16 rate follows ``matmul:low``); without TF32 a tf32 op runs at the fp32 rate;
    a published ``memory_bw`` replaces the elementwise bandwidth and scales the norm, optimizer and
    bf16 batch-norm bandwidths by the same factor. Seconds (host, per-kernel floors) stay. A
    published matmul rate is a large-GEMM rate: matmuls are floored by their bytes
    (:attr:`GpuRates.matmul_bytes_floor`)."""
    import dataclasses

    mm, conv, att = dict(base.matmul), dict(base.conv), dict(base.attention_base)
    for m in MODES:
        if f"matmul:{m}" in pub:
            f = pub[f"matmul:{m}"][0] / base.matmul[m]
            mm[m], conv[m], att[m] = mm[m] * f, conv[m] * f, att[m] * f
    if base.gpu not in TF32_TFLOPS:
        mm["tf32"], conv["tf32"], att["tf32"] = mm["fp32"], conv["fp32"], att["fp32"]
    bw = pub["memory_bw"][0] / base.bandwidth if "memory_bw" in pub else 1.0
    return dataclasses.replace(
        base, source=f"published:{base.gpu}", matmul=mm, conv=conv, attention_ref=att, matmul_bytes_floor=True,
        matmul_unaligned=float(base.unaligned_rate(1)) * mm["low"] / base.matmul["low"],
        bandwidth=base.bandwidth * bw, norm_bandwidth=base.norm_bw * bw, opt_bandwidth=base.opt_bw * bw,
        bn_bf16_bandwidth=base.bn_bf16_bw * bw)


def gpu_rates(spec) -> GpuRates:
    """Rates of the catalog GPU ``spec``: fitted where measured (``fitted:<type>``), else its
    datasheet's (``datasheet:<type>``) with the published rates of :data:`PUBLISHED` in place of
    theirs where any are published (``published:<type>``)."""
    own = fitted_rates(spec.name)
    if own is not None:
        return own
    base = datasheet_rates(spec)
    pub = published_rates(spec.name)
    return with_published(base, pub) if pub else base


def on_host(rates: GpuRates, host_launch_s: float | None) -> GpuRates:
    """``rates`` on a host whose forward kernel launch costs ``host_launch_s`` seconds (a
    topology machine's ``host_launch``); None: ``rates`` as they are.

    Rule: every host second scales by one factor ``f = host_launch_s / rates.host_s``, the stated
    launch over the host the rates were fitted on (the H200 host's 55 us, ``H200-fit.json``, for
    every type without a step fit of its own): ``host_s := host_launch_s``, and ``host_backward_s``,
    ``opt_host_s``, ``step_host_s`` and ``launch_s`` (the optimizer's multi-tensor launches) are
    multiplied by ``f``. The device seconds (rates, per-kernel floors) stay: a slower host slows
    host-bound steps (small kernels, :func:`eager_stages`) and leaves GPU-bound ones nearly as they
    were. One factor, because the host constants were fitted on one host only: how a CPU's speed
    splits between the forward's Python and the backward's C++ engine is not measured."""
    if host_launch_s is None:
        return rates
    import dataclasses

    f = host_launch_s / rates.host_s
    return dataclasses.replace(rates, host_s=float(host_launch_s), host_backward_s=rates.host_bwd * f,
                               opt_host_s=rates.opt_host_s * f, step_host_s=rates.step_host_s * f,
                               launch_s=rates.launch_s * f)


def host_origin(gpu: str) -> str:
    """Where the host constants of GPU type ``gpu``'s rule come from when no topology states them:
    ``assumed: fitted to eager steps on an H200 host, 2026-11-26..2026-11-27`` (the type's own
    step fit, else the reference type's; the dates of the steps its fit file names)."""
    own = gpu if load_fit(gpu) or microbenchmark_rates(gpu) is not None else REFERENCE_GPU
    fit = load_fit(own)
    if not fit:
        return f"assumed: tiny-kernel launches measured on a {own} host"
    dates = sorted({d for entry in fit.get("fitted_on", []) for d in re.findall(r"\d{4}-\d{2}-\d{2}", entry)})
    when = "" if not dates else f", {dates[0]}" if len(dates) == 1 else f", {dates[0]}..{dates[-1]}"
    return f"assumed: fitted to eager steps on an {own} host{when}"


@functools.cache
def _layer_graphs(spec: str, precision: str) -> tuple:
    """The graphs of ``spec`` (``{L}`` in it: the layer count) with 1 and 2 layers, one group each."""
    from ..graph import capture
    from ..workloads import load_workload

    return tuple(capture(load_workload(spec.format(L=n), batch=2, abstract=True), optimizer="adam", num_groups=1,
                         precision="bf16" if precision == "fp16" else precision).graph for n in (1, 2))


def layer_seconds(spec: str, precision: str, rates: GpuRates, numerics: Numerics, batches,
                  runtime: str = "eager") -> np.ndarray:
    """``[2, len(batches)]`` (forward, backward) seconds of one layer of zoo ``spec`` (``{L}``: its
    layer count) at micro-batches ``batches`` under ``rates`` as ``runtime`` (:data:`RUNTIMES`) runs
    it, host launches included (:func:`stage_table`): the step of two layers less that of one."""
    t = [stage_table(g, OpFeatures.of(g, numerics, runtime), rates, batches)[0, :2]
         for g in _layer_graphs(spec, precision)]
    return t[1] - t[0]


def layer_check(gpus=None, runtime: str = "eager") -> list[dict]:
    """TAG's per-layer seconds against every published per-layer time of :data:`PUBLISHED`
    (``layers``) on GPU types in ``gpus`` (None: all), as ``runtime`` runs the layer: one row per
    (GPU, model, micro-batch) with the published and predicted forward / backward seconds and the
    rates' source."""
    from ..topology.catalog import match_gpu_name

    rows = []
    for r in load_published()["layers"]:
        spec = match_gpu_name(r["gpu"])
        if spec is None or (gpus is not None and r["gpu"] not in gpus):
            continue
        rates = gpu_rates(spec)
        pred = layer_seconds(r["spec"], r["precision"], rates, Numerics(matmul_tf32=r["tf32"]), [r["micro_batch"]],
                             runtime)
        rows.append({**r, "source_rates": rates.source, "pred_forward_s": float(pred[0, 0]),
                     "pred_backward_s": float(pred[1, 0])})
    return rows


def layer_table() -> str:
    """:func:`layer_check` under every runtime as a markdown table, milliseconds and predicted /
    published (committed as ``gpu_calib/published-check.md``)."""
    checks = {rt: layer_check(runtime=rt) for rt in RUNTIMES}
    head = "| GPU | source | micro-batch | forward published | " + " | ".join(
        f"{rt} | ratio" for rt in RUNTIMES) + " | backward published | eager | ratio |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, r in enumerate(checks["eager"]):
        cells = [r["gpu"], r["source"], str(r["micro_batch"]), f"{r['forward_s'] * 1e3:.2f}"]
        for rt in RUNTIMES:
            p = checks[rt][i]["pred_forward_s"]
            cells += [f"{p * 1e3:.2f}", f"{p / r['forward_s']:.2f}"]
        b = r["backward_s"]
        cells += [f"{b * 1e3:.2f}", f"{r['pred_backward_s'] * 1e3:.2f}", f"{r['pred_backward_s'] / b:.2f}"] if b \
            else ["-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ per-op seconds
def tile_pairs(length: int, source_length: int, causal: bool, tile: tuple[int, int]) -> int:
    """Query-key pairs a fused attention over ``[length, source_length]`` computes in whole
    ``(rows, columns)`` tiles: every tile of query rows, padded, against the key tiles it needs
    (all of them; causal, top-left aligned: those up to its last row's key)."""
    rows, cols = tile
    pairs = 0
    for first in range(0, length, rows):
        keys = min(first + rows, length, source_length) if causal else source_length
        pairs += rows * -(-keys // cols) * cols
    return pairs


def attention_tile_fraction(attention: tuple | None, mode: str, phase: str) -> float:
    """Pairs a fused attention (``(L, S, causal, ...)``, :attr:`tag.graph.ir.Op.attention`) computes in
    the tiles of :data:`ATTENTION_TILES` over the pairs its captured FLOPs count (``L S``, times
    :func:`tag.graph.capture.causal_fraction` if causal): 1 where the lengths are multiples of
    the tile and not causal; ``(256 / 197)^2`` = 1.69 for ViT's 197 tokens; 1.06 for a causal
    1024. 1 where ``attention`` is None (not recorded)."""
    from ..graph.capture import causal_fraction

    if attention is None:
        return 1.0
    length, source, causal = attention[:3]
    if length <= 0 or source <= 0:
        return 1.0
    tile = ATTENTION_TILES["low" if mode == "low" else "fp32"]["bwd" if phase == "bwd" else "fwd"]
    counted = length * source * (causal_fraction(length, source) if causal else 1.0)
    return tile_pairs(length, source, causal, tile) / counted


RUNTIMES = {
    "eager": ("TAG's executor and eager PyTorch: one kernel per op of the joint graph, except the "
              "backward formulas eager runs as one kernel (backward_regions)"),
    "megatron": ("Megatron-LM's fused kernels: besides eager's backward regions, every run of consecutive "
                 "forward elementwise ops between two other kernels is one kernel that reads the run's "
                 "inputs once and writes its outputs once, one launch, in every dtype (bias-GeLU: "
                 "megatron/model/fused_bias_gelu.py; bias-dropout-add: megatron/model/transformer.py "
                 "bias_dropout_add_fused_train; both TorchScript-fused); in a bf16/fp16 graph the run takes in "
                 "normalisations and softmaxes too (scale-mask-softmax, megatron/model/fused_softmax.py, whose "
                 "CUDA kernel is_kernel_available only for fp16/bf16 inputs; apex's fused layer norm). A run "
                 "holding a layer norm and the residual add before it is one kernel here where Megatron-LM "
                 "runs two (an assumption: it saves one pass over the residual). Matmul, attention and "
                 "optimizer kernels and every rate are eager's"),
}
"""Runtimes the GPU rule costs (:meth:`OpFeatures.of`, ``CostModel.for_topology(runtime=)``): name ->
what it fuses. ``eager`` is TAG's own executor; a published run says which runtime it used."""


@dataclass
class OpFeatures:
    """Per-op arrays of a graph that the GPU rule needs (batch-affine FLOPs and bytes)."""

    cls: np.ndarray
    """[n] class index into :data:`OP_CLASSES`."""
    mode: np.ndarray
    """[n] mode index into :data:`MODES`."""
    flops: np.ndarray
    """[n, 2] (fixed, per-sample) FLOPs the kernels compute (a fused attention's in whole tiles,
    :func:`attention_tile_fraction`)."""
    nbytes: np.ndarray
    """[n, 2] (fixed, per-sample) bytes read + written."""
    sweeps: float
    """Multiplier of an ``opt`` op's bytes (:data:`FOREACH_SWEEPS` over the capture's count)."""
    kernel: np.ndarray
    """[n] bool: the op launches a kernel of its own (False inside a fused backward region but
    its first op, :func:`backward_regions`)."""
    align: np.ndarray | None = None
    """[n] elements every leading dimension of a bf16/fp16 matmul is a multiple of, up to
    :data:`ALIGN_ELEMENTS` (:func:`gemm_alignment`; ``ALIGN_ELEMENTS`` for every other op); None: all aligned."""
    bn_bf16: np.ndarray | None = None
    """[n] bool: a batch norm (forward or backward) in bf16 (``bn_bf16_bw``,
    :data:`BN_BF16_KERNELS`); None: none."""
    head: np.ndarray | None = None
    """[n] the op whose kernel carries each op's bytes: the first op of its fused region
    (:func:`backward_regions`), else itself; None: every op itself."""

    @classmethod
    def of(cls, graph, numerics: Numerics, runtime: str = "eager") -> OpFeatures:
        """The features of ``graph`` as ``runtime`` (:data:`RUNTIMES`) runs it."""
        from ..graph.capture import OPTIMIZER_COSTS

        if runtime not in RUNTIMES:
            from ..errors import TagError

            raise TagError(f"runtime: expected one of {sorted(RUNTIMES)}, got {runtime!r}")

        ops = graph.ops
        klass = [op_class(o.target) for o in ops]
        _, n_read, n_written, _ = OPTIMIZER_COSTS.get(graph.optimizer, (0, 1, 0, 0))
        sweeps = FOREACH_SWEEPS.get(graph.optimizer, n_read + n_written) / max(1, n_read + n_written)
        nbytes = np.array([(o.bytes_read.fixed + o.bytes_written.fixed, o.bytes_read.per_sample + o.bytes_written.per_sample)
                           for o in ops], dtype=float).reshape(-1, 2)
        names = [o.target.split(".")[1] if o.target.startswith("aten.") else "" for o in ops]
        passes = np.array([NORM_PASSES.get(n, 1.0) for n in names])
        nbytes = nbytes * passes[:, None]
        kernel = np.ones(len(ops), dtype=bool)
        head = np.arange(len(ops))
        for region, rb in backward_regions(graph, klass, forward=runtime == "megatron"):
            nbytes[region] = 0.0
            kernel[region] = False
            nbytes[region[0]] = rb
            kernel[region[0]] = True
            head[region] = region[0]
        modes = [op_mode(k, o.dtype, numerics) for k, o in zip(klass, ops)]
        tiles = np.array([attention_tile_fraction(o.attention, m, o.phase) if k == "attention" else 1.0
                          for k, o, m in zip(klass, ops, modes)])
        return cls(
            np.array([OP_CLASSES.index(k) for k in klass], dtype=np.int64),
            np.array([MODES.index(m) for m in modes], dtype=np.int64),
            np.array([(o.flops.fixed, o.flops.per_sample) for o in ops], dtype=float).reshape(-1, 2) * tiles[:, None],
            nbytes, sweeps, kernel,
            np.array([gemm_alignment(graph, o) if k == "matmul" and o.dtype in ("bfloat16", "float16")
                      else ALIGN_ELEMENTS for k, o in zip(klass, ops)], dtype=np.int64),
            np.array([n in NORM_PASSES and o.dtype == "bfloat16" for n, o in zip(names, ops)]), head)

    def with_fixed(self, scale: np.ndarray) -> OpFeatures:
        """These features with each op's fixed (batch-independent) FLOPs and bytes times
        ``scale`` ([n]): a tensor-parallel rank's ops on ``1 / T`` of a split weight (its matmuls
        read, its weight-gradient casts write, ``1 / T`` of the weight bytes). A fused region's
        kernel takes the smallest factor of its ops (its fixed bytes are the scaled op's: a weight
        gradient's cast fused with the views around it)."""
        s = np.asarray(scale, dtype=float).copy()
        if self.head is not None:
            np.minimum.at(s, self.head, s[np.arange(len(s))])
        flops, nbytes = self.flops.copy(), self.nbytes.copy()
        flops[:, 0] *= s
        nbytes[:, 0] *= s
        return dataclasses.replace(self, flops=flops, nbytes=nbytes)

    def unaligned(self) -> np.ndarray:
        """[n] bool: a bf16/fp16 matmul below :data:`ALIGN_ELEMENTS` (its FLOPs run at
        :meth:`GpuRates.unaligned_rate`)."""
        if self.align is None:
            return np.zeros(len(self.cls), dtype=bool)
        return (self.align < ALIGN_ELEMENTS) & (self.cls == OP_CLASSES.index("matmul")) \
            & (self.mode == MODES.index("low"))

    def bn_bf16_mask(self) -> np.ndarray:
        """[n] bool: :attr:`bn_bf16` (all False where not given)."""
        return np.zeros(len(self.cls), dtype=bool) if self.bn_bf16 is None else self.bn_bf16

    def kernels(self) -> np.ndarray:
        """[n] device kernels per launch: :data:`BN_BF16_KERNELS` for a bf16 batch norm, else 1."""
        return np.where(self.bn_bf16_mask(), BN_BF16_KERNELS, 1)


_GEMMS = ("mm", "addmm", "bmm", "baddbmm")
"""ATen matmuls whose last two inputs are the matrix operands and whose output is their product
(with ``addmm``'s and ``baddbmm``'s addend first)."""


def gemm_dims(graph, op, batch: float) -> tuple[float, float, float] | None:
    """(M, K, N) of a matmul op at ``batch`` from its FLOPs and the sizes of its two matrix
    operands (its last two inputs) and its output: ``FLOPs = 2 B M K N`` and the operands hold
    ``B M K``, ``B K N`` and ``B M N`` elements (``B``: a bmm's batch of matrices), so ``M =
    FLOPs / (2 |B|)``, ``K = FLOPs / (2 |C|)``, ``N = FLOPs / (2 |A|)``. None where the op does
    not have that form (not one of :data:`_GEMMS`, one tensor used twice, no FLOPs counted)."""
    name = op.target.split(".")[1] if op.target.startswith("aten.") else ""
    if name not in _GEMMS or len(op.inputs) < 2 or op.inputs[-1] == op.inputs[-2] or not op.outputs:
        return None
    size = op.itemsize
    a, b = (graph.tensors[t].nbytes.at(batch) / size for t in op.inputs[-2:])
    c = graph.tensors[op.outputs[0]].nbytes.at(batch) / size
    f = op.flops.at(batch)
    if min(a, b, c, f) <= 0:
        return None
    dims = (f / (2 * b), f / (2 * c), f / (2 * a))
    if any(abs(d - round(d)) > 1e-6 * max(1.0, d) or round(d) < 1 for d in dims):
        return None
    return tuple(float(round(d)) for d in dims)


def gemm_alignment(graph, op) -> int:
    """Elements (1, 2, 4 or :data:`ALIGN_ELEMENTS`) that every leading dimension of matmul ``op``
    is a multiple of: the largest power of two up to ``ALIGN_ELEMENTS`` dividing each of its
    dimensions that do not scale with the batch (:func:`gemm_dims` at the graph's batch and one
    sample more). A linear layer's leading dimensions are its feature widths (input, output;
    an LM head's vocabulary), an attention product's the sequence and the head width; the
    token count (batch x sequence) is never one: in ``X W^T``, its input gradient and its
    weight gradient the rows of ``X`` and of the output gradient are the dimension no stride
    steps over. Unknown dimensions count as aligned."""
    b = graph.batch_size
    d0, d1 = gemm_dims(graph, op, b), gemm_dims(graph, op, b + 1)
    if d0 is None or d1 is None:
        return ALIGN_ELEMENTS
    align = ALIGN_ELEMENTS
    for x, y in zip(d0, d1):
        if x == y:
            while align > 1 and int(x) % align:
                align //= 2
    return align


def _moves(op) -> bool:
    return (op.bytes_read.fixed + op.bytes_read.per_sample + op.bytes_written.fixed + op.bytes_written.per_sample
            + op.flops.fixed + op.flops.per_sample) > 0


_FUSABLE = ("memory", "norm")


def backward_regions(graph, klass: list[str], forward: bool = False) -> list[tuple[list[int], tuple[float, float]]]:
    """The fused kernels eager PyTorch runs where the joint graph has a decomposition.

    The export decomposes backward formulas eager runs as one kernel (batch norm, layer norm,
    softmax, ReLU/GELU backward, ...) into elementwise ops and reductions. A **region** is a
    maximal run of consecutive backward ``memory`` or ``norm`` ops (views in between do not break it) with
    the same forward anchor (:attr:`tag.graph.ir.Op.anchor`: the forward position whose backward
    they compute); a region of two or more costly ops is costed as one kernel that reads each
    tensor entering it once and writes each tensor leaving it once (its intermediates stay on
    chip). With ``forward`` (a fused runtime, :data:`RUNTIMES`) a maximal run of consecutive
    forward ``memory`` ops, and ``norm`` ops in a bf16/fp16 graph (autocast runs the softmax itself
    in fp32), whatever their anchors, is a region too. Returns ``(op indices, (fixed, per-sample) bytes)`` per region.
    """
    ops, tensors = graph.ops, graph.tensors
    low = getattr(graph, "precision", "fp32") in ("bf16", "fp16")  # mixed precision: fused softmax / norms
    out = []
    run: list[int] = []

    def close() -> None:
        costly = [i for i in run if _moves(ops[i])]
        if len(costly) >= 2:
            out.append((costly, _region_bytes(ops, tensors, set(run))))
        run.clear()

    for i, op in enumerate(ops):
        fwd = op.phase == "fwd"
        if not (op.phase == "bwd" or (forward and fwd)) or (run and ops[run[0]].phase != op.phase):
            close()
            if not (op.phase == "bwd" or (forward and fwd)):
                continue
        if not _moves(op):  # a view / projection: part of whatever run surrounds it
            if run:
                run.append(i)
            continue
        fusable = klass[i] == "memory" or (klass[i] == "norm" and (not fwd or low))
        if not fusable or (run and not fwd and ops[run[0]].anchor != op.anchor):
            close()
            if not fusable:
                continue
        run.append(i)
    close()
    return out


def _region_bytes(ops, tensors, region: set[int]) -> tuple[float, float]:
    """(fixed, per-sample) bytes a fused ``region`` reads from outside and writes to outside."""
    fixed = per = 0.0
    seen: set[int] = set()
    for i in sorted(region):
        for t in ops[i].inputs:
            if tensors[t].producer not in region and t not in seen:
                seen.add(t)
                fixed += tensors[t].nbytes.fixed
                per += tensors[t].nbytes.per_sample
        if not _moves(ops[i]):
            continue
        for t in ops[i].outputs:
            if _escapes(ops, tensors, t, region):
                fixed += tensors[t].nbytes.fixed
                per += tensors[t].nbytes.per_sample
    return fixed, per


def _escapes(ops, tensors, t: int, region: set[int]) -> bool:
    """Whether tensor ``t`` (made in ``region``) is read outside it, directly or through views."""
    cons = tensors[t].consumers
    if not cons:
        return True
    for c in cons:
        if c not in region:
            return True
        if not _moves(ops[c]) and any(_escapes(ops, tensors, u, region) for u in ops[c].outputs):
            return True
    return False


def op_seconds(feat: OpFeatures, rates: GpuRates, batches) -> np.ndarray:
    """GPU seconds ``[n_ops, len(batches)]`` of every op at the per-replica ``batches`` (module
    rule, without the host's launch cost: :func:`stage_table` adds it); equal to
    ``design(feat, rates, b) @ theta_of(rates)`` at every batch ``b`` where
    :attr:`GpuRates.matmul_bytes_floor` is off (the fitted types)."""
    b = np.asarray(batches, dtype=float)[None, :]
    f = feat.flops[:, :1] + feat.flops[:, 1:] * b
    m = feat.nbytes[:, :1] + feat.nbytes[:, 1:] * b
    cls = feat.cls[:, None]
    mm_rate = np.array([rates.matmul[x] for x in MODES])[feat.mode][:, None]
    conv_rate = np.array([rates.conv[x] for x in MODES])[feat.mode][:, None]
    att_rate = np.array([rates.attention_rate(x) for x in MODES])[feat.mode][:, None]
    bw = np.array([rates.norm_bw if c == "norm" else rates.bandwidth for c in OP_CLASSES])
    t = m / bw[feat.cls][:, None]
    t = np.where(feat.bn_bf16_mask()[:, None], m / rates.bn_bf16_bw, t)
    mm_rate = np.where(feat.unaligned()[:, None], rates.unaligned_rate(_align(feat))[:, None], mm_rate)
    mm_t = np.maximum(f / mm_rate, m / rates.bandwidth) if rates.matmul_bytes_floor else f / mm_rate
    t = np.where(cls == OP_CLASSES.index("matmul"), mm_t, t)
    t = np.where(cls == OP_CLASSES.index("conv"), f / conv_rate, t)
    t = np.where(cls == OP_CLASSES.index("attention"), f / att_rate, t)
    t = np.where(cls == OP_CLASSES.index("opt"), m * feat.sweeps / rates.opt_bw, t)
    floor = np.where(feat.cls == OP_CLASSES.index("matmul"),
                     np.array([rates.matmul_floor(x) for x in MODES])[feat.mode], rates.kernel_s)
    t = t + (floor * feat.kernels())[:, None] * launches(feat, batches)
    return np.where(feat.kernel[:, None], t, 0.0)


def design(feat: OpFeatures, rates: GpuRates, batch: float) -> np.ndarray:
    """``[n_ops, len(COLUMNS)]``: each op's seconds at ``batch`` as a linear function of the
    unknowns :func:`theta_of` (a launch counts its kernels in ``kernel_s``; FLOPs go to their class and
    mode's rate, bytes to their class's bandwidth; attention FLOPs over ``attention_ref``; a
    matmul's launch to ``matmul_call:<mode>``; an unaligned bf16/fp16 matmul's FLOPs over its
    alignment to ``matmul_unaligned:low``)."""
    f = feat.flops[:, 0] + feat.flops[:, 1] * batch
    m = feat.nbytes[:, 0] + feat.nbytes[:, 1] * batch
    ref = rates.attention_base
    X = np.zeros((len(f), len(COLUMNS)))
    rows = np.arange(len(f))
    n_launch = launches(feat, [batch])[:, 0]
    X[:, 0] = n_launch * feat.kernels()
    unaligned, align, bn_bf16 = feat.unaligned(), _align(feat), feat.bn_bf16_mask()
    for k, c in enumerate(feat.cls):
        cls = OP_CLASSES[c]
        if cls == "matmul":  # its floor is the per-call constant of its mode, not kernel_s
            X[k, 0] = 0.0
            X[k, COLUMNS.index(f"matmul_call:{MODES[feat.mode[k]]}")] = n_launch[k]
        if cls == "matmul" and unaligned[k]:  # FLOPs at a times the per-element rate
            X[k, COLUMNS.index("matmul_unaligned:low")] = f[k] / align[k]
        elif cls in ("matmul", "conv"):
            X[k, COLUMNS.index(f"{cls}:{MODES[feat.mode[k]]}")] = f[k]
        elif cls == "attention":
            X[k, COLUMNS.index(f"attention_eff:{MODES[feat.mode[k]]}")] = f[k] / ref[MODES[feat.mode[k]]]
        elif cls == "opt":
            X[k, COLUMNS.index("opt_bw")] = m[k] * feat.sweeps
        elif bn_bf16[k]:
            X[k, COLUMNS.index("bn_bf16_bw")] = m[k]
        else:
            X[k, COLUMNS.index(f"{cls}_bw")] = m[k]
    X[rows[~feat.kernel]] = 0.0
    return X


def _align(feat: OpFeatures) -> np.ndarray:
    return np.full(len(feat.cls), ALIGN_ELEMENTS) if feat.align is None else feat.align


def launches(feat: OpFeatures, batches) -> np.ndarray:
    """``[n_ops, len(batches)]`` 1 where an op launches a kernel from the host (it moves or
    computes something at that batch and is not inside a fused region), else 0. Optimizer
    updates launch nothing of their own (multi-tensor kernels, :meth:`GpuRates.step_overhead`)."""
    b = np.asarray(batches, dtype=float)[None, :]
    work = feat.flops[:, :1] + feat.flops[:, 1:] * b + feat.nbytes[:, :1] + feat.nbytes[:, 1:] * b
    own = feat.kernel & (feat.cls != OP_CLASSES.index("opt"))
    return ((work > 0) & own[:, None]).astype(float)


def host_seconds(graph, feat: OpFeatures, rates: GpuRates, batches) -> np.ndarray:
    """Host seconds ``[n_ops, len(batches)]`` to issue each op of an eager step: ``host_s`` per
    launch (:func:`launches`) in the forward, ``host_bwd`` per launch in the backward, and an
    optimizer update (one per parameter) ``FOREACH_KERNELS[optimizer] * opt_host_s``. Linear in
    (``host_s``, ``host_backward_s``, ``opt_host_s``)."""
    from ..graph.ir import PHASES

    bwd = np.array([o.phase == PHASES[1] for o in graph.ops], dtype=bool)
    per_launch = np.where(bwd, rates.host_bwd, rates.host_s)[:, None]
    opt = (feat.cls == OP_CLASSES.index("opt"))[:, None] * FOREACH_KERNELS.get(graph.optimizer, 0) * rates.opt_host_s
    return launches(feat, batches) * per_launch + opt


def stage_table(graph, feat: OpFeatures, rates: GpuRates, batches) -> np.ndarray:
    """Seconds ``[K, 3, len(batches)]`` of every (group, phase) stage of an eager step on the GPU.

    Eager order: forward of groups 0..K-1, backward of K-1..0, then the updates of 0..K-1. The
    host issues the kernels in that order, ``host_s`` each, without waiting for the GPU; the GPU
    runs them in order, each once issued and once the previous one finished. Kernel ``j`` is
    issued at ``H_j = host_s * (launches up to and including j)`` and finishes at
    ``F_j = max(F_{j-1}, H_j) + t_j = T_j + max_{i <= j} (H_i - T_{i-1})`` (``t``:
    :func:`op_seconds`, ``T`` its running sum). A stage lasts from the previous stage's last
    finish to its own: the stages add up to the eager step (host-bound stretches cost ``host_s``
    per kernel, GPU-bound ones the sum of their kernels, and a host that ran ahead during a
    GPU-bound stage shortens the next). The host's seconds per op: :func:`host_seconds`.
    """
    return eager_stages(graph, op_seconds(feat, rates, batches), host_seconds(graph, feat, rates, batches))


def eager_stages(graph, t: np.ndarray, h: np.ndarray) -> np.ndarray:
    """:func:`stage_table` from per-op device seconds ``t`` and host seconds ``h`` (both
    ``[n_ops, n]``, any ``n`` columns: batches, or host constants being fitted)."""
    from ..graph.ir import PHASES

    K = graph.num_groups
    phase = np.array([PHASES.index(o.phase) for o in graph.ops], dtype=np.int64)
    group = np.array([o.group for o in graph.ops], dtype=np.int64)
    rank = np.where(phase == 0, group, np.where(phase == 1, 2 * K - 1 - group, 2 * K + group))  # eager position
    order = np.lexsort((np.arange(len(rank)), rank))  # by stage in eager order, graph order within it
    out = np.zeros((K * 3, t.shape[1]))
    if not len(order):
        return out.reshape(K, 3, t.shape[1])
    t_s, h_s, rank_s = t[order], h[order], rank[order]
    ct = np.cumsum(t_s, axis=0)
    finish = ct + np.maximum.accumulate(np.cumsum(h_s, axis=0) - (ct - t_s), axis=0)  # F_j
    last = np.r_[np.flatnonzero(rank_s[1:] != rank_s[:-1]), len(rank_s) - 1]  # each stage's last op
    end = finish[last]
    dur = np.diff(np.vstack([np.zeros((1, t.shape[1])), end]), axis=0)
    r = rank_s[last]
    row = np.where(r < K, r * 3, np.where(r < 2 * K, (2 * K - 1 - r) * 3 + 1, (r - 2 * K) * 3 + 2))
    out[row] = dur
    return out.reshape(K, 3, t.shape[1])


class StageParts(NamedTuple):
    """Each (group, phase) stage of an eager step apart from the others, ``[K, 3, n]`` seconds
    (:func:`stage_parts`): what a simulator needs to run the host and the device as two timelines
    (:meth:`tag.sim.event_loop.Run._phase`)."""

    device: np.ndarray
    """The stage's kernels' seconds on the device (:func:`op_seconds` summed)."""
    host: np.ndarray
    """The host's seconds to issue them (:func:`host_seconds` summed)."""
    lag: np.ndarray
    """Seconds the stage lasts beyond ``device`` when host and device start it together: its
    finish is ``max(S + device, H + device + lag)`` for a device free at ``S`` and a host that
    starts issuing it at ``H`` (kernel ``i`` issued ``host_i`` into the stage, the stage's kernels
    from ``i`` on taking ``tail_i``: ``lag = max_i(host_i + tail_i) - device``, >= 0). Composed in
    eager order from ``S = H = 0`` these give :func:`eager_stages`' ends exactly."""


def stage_parts(graph, feat: OpFeatures, rates: GpuRates, batches) -> StageParts:
    """:class:`StageParts` of ``graph`` under ``rates`` at per-replica ``batches``."""
    return eager_parts(graph, op_seconds(feat, rates, batches), host_seconds(graph, feat, rates, batches))


def eager_parts(graph, t: np.ndarray, h: np.ndarray) -> StageParts:
    """:func:`stage_parts` from per-op device seconds ``t`` and host seconds ``h`` (both
    ``[n_ops, n]``); a stage's ops in graph order, as :func:`eager_stages` issues them."""
    from ..graph.ir import PHASES

    K, n = graph.num_groups, t.shape[1]
    group = np.array([o.group for o in graph.ops], dtype=np.int64)
    phase = np.array([PHASES.index(o.phase) for o in graph.ops], dtype=np.int64)
    stage = group * 3 + phase
    order = np.lexsort((np.arange(len(stage)), stage))
    dev, host, lag = np.zeros((K * 3, n)), np.zeros((K * 3, n)), np.zeros((K * 3, n))
    if len(order):
        t_s, h_s, st = t[order], h[order], stage[order]
        first = np.r_[0, np.flatnonzero(st[1:] != st[:-1]) + 1]  # each stage's first op
        rows = st[first]
        dev[rows] = np.add.reduceat(t_s, first, axis=0)
        host[rows] = np.add.reduceat(h_s, first, axis=0)
        ch, ct = np.cumsum(h_s, axis=0), np.cumsum(t_s, axis=0)
        # host_i + tail_i = (CH_i - CH_before) + (CT_end - CT_i + t_i), less device = CT_end - CT_before
        before = np.vstack([np.zeros((1, n)), (ch - ct)[first[1:] - 1]])  # CH_before - CT_before
        lag[rows] = np.maximum.reduceat(ch - ct + t_s, first, axis=0) - before
        np.maximum(lag, 0.0, out=lag)  # (rounding)
    return StageParts(dev.reshape(K, 3, n), host.reshape(K, 3, n), lag.reshape(K, 3, n))
