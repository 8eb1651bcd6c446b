"""GPU compute cost: achieved rates per op class and dtype, fitted from measurements on real GPUs.

Every op of the joint graph falls in one **class** (:func:`op_class`): ``matmul`` (``mm``,
``addmm``, ``bmm``, ...), ``conv`` (convolutions and their backward), ``attention`` (fused
scaled-dot-product kernels), ``opt`` (the optimizer update of one parameter) or ``memory``
(everything else: elementwise ops, reductions, norms, copies, casts). Its seconds on a GPU:

* ``matmul`` / ``attention``: ``max(flops / R_mm[mode] + c_mm, bytes / BW)``
* ``conv``: ``max(flops / R_conv[mode], bytes / BW)``
* ``memory``: ``bytes / BW``
* ``opt``: ``bytes * sweeps / BW`` (PyTorch's multi-tensor Adam/SGD passes over its tensors more
  often than the capture's single-kernel count, :data:`FOREACH_SWEEPS`); its launches are paid
  once per step (:meth:`GpuRates.step_overhead`)

and every op that moves or computes anything costs at least ``L``, the launch floor: eager PyTorch
dispatches kernels one by one, so a stream of small kernels runs at one per ``L`` seconds however
little each does. ``mode`` is the op's dtype as the hardware runs it: ``low`` (bf16/fp16 tensor
cores) for a bf16/fp16 op; for an fp32 op ``tf32`` where PyTorch enables TF32 (:class:`Numerics`:
cuDNN convolutions by default, matmuls only when ``torch.backends.cuda.matmul.allow_tf32`` is
set), else ``fp32``.

Where the constants come from (``GpuRates.source``):

* ``fitted:<type>``: a GPU type with microbenchmarks in ``gpu_calib/<type>.jsonl``
  (:func:`fit_microbenchmarks`): ``R_mm[mode]`` is the slope of time over FLOPs between the two
  largest square matmuls (the per-call overhead of an isolated, synchronised call is the
  intercept, not part of the rate); ``R_conv[tf32]`` / ``R_conv[low]`` the measured 3x3
  convolution (an "fp32" convolution runs on TF32 by cuDNN's default); ``BW`` the large
  elementwise kernel; ``L`` the per-kernel time of a stream of tiny kernels. ``c_mm``, the
  extra seconds of a matmul inside a training step, is fitted to measured eager training steps
  (``gpu_calib/<type>-steps.json``, written by ``evaluation/gpu_cost_check.py``).
* ``datasheet:<type>``: any other catalog GPU. The achieved-to-datasheet ratios measured on the
  fitted type (H200) are applied to this type's datasheet peaks (FP32, TF32 :data:`TF32_TFLOPS`,
  FP16/BF16 tensor, memory bandwidth); ``L`` and ``c_mm`` are kept in seconds (host- and
  driver-bound, not GPU-bound). Without TF32 (before Ampere) a tf32 op runs at the FP32 rate.

Not measured anywhere, assumed: an fp32 convolution with TF32 off reaches the same fraction of
the FP32 matmul rate as the TF32 convolution reaches of the TF32 matmul rate; fp16 runs at the
bf16 rates (equal in every datasheet of the catalog's tensor-core GPUs); convolution backward
runs at the forward convolution's rate; fused attention kernels at the matmul rate.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CALIB_DIR = Path(__file__).resolve().parent / "gpu_calib"
"""Microbenchmarks (``<type>.jsonl``) and step-fitted constants (``<type>-steps.json``)."""
REFERENCE_GPU = "H200"
"""The measured type whose efficiencies derive the others."""

OP_CLASSES = ("matmul", "conv", "attention", "memory", "opt")
MODES = ("fp32", "tf32", "low")

# ATen overload packets by class (the joint graph's targets are ``aten.<name>.<overload>``).
_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot", "_int_mm"}
_CONV = {"convolution", "convolution_backward", "_convolution", "cudnn_convolution", "conv2d", "conv1d",
         "conv3d", "conv_transpose2d", "_slow_conv2d_forward", "_slow_conv2d_backward"}
_ATTENTION_PREFIX = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "scaled_dot_product")

FOREACH_SWEEPS = {"adam": 18, "sgd": 8, "sgd-plain": 3}
"""Tensor passes (reads + writes, each one parameter's size) of ``torch.optim``'s multi-tensor
(``foreach``) step, counted from ``torch/optim/adam.py`` ``_multi_tensor_adam`` (lerp_ 2r1w,
mul_ 1r1w, addcmul_ 2r1w, sqrt 1r1w, div_ 1r1w, add_ 1r1w, addcdiv_ 3r1w) and ``sgd.py``
``_multi_tensor_sgd`` (momentum: mul_ 1r1w, add_ 2r1w, add_ 2r1w; plain: add_ 2r1w)."""
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
    """mode -> achieved FLOP/s of large matmuls."""
    conv: dict = field(hash=False)
    """mode -> achieved FLOP/s of convolutions."""
    bandwidth: float
    """Achieved bytes/s of memory-bound kernels."""
    launch_s: float
    """Seconds per kernel of a stream of tiny kernels (the microbenchmark): a lower bound on
    ``host_s``."""
    host_s: float
    """Host seconds per kernel launch in an eager training step (Python, autograd, dispatch,
    launch), fitted to eager steps where they were measured, else ``launch_s``."""

    def step_overhead(self, optimizer: str) -> float:
        """Seconds of one optimizer step's multi-tensor launches (paid once per step)."""
        return FOREACH_KERNELS.get(optimizer, 0) * self.launch_s


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
    return "memory"


def op_mode(cls: str, dtype: str, numerics: Numerics) -> str:
    """The hardware mode an op of class ``cls`` and output ``dtype`` runs in."""
    if dtype in ("bfloat16", "float16"):
        return "low"
    if cls == "conv":
        return "tf32" if numerics.conv_tf32 else "fp32"
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


def load_step_fit(gpu: str, root: Path = CALIB_DIR) -> dict:
    """Constants fitted to eager training steps of ``gpu`` (``{}`` when none are shipped)."""
    path = Path(root) / f"{gpu}-steps.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def tf32_peak(spec) -> float:
    """Datasheet dense TF32 FLOP/s of a catalog GPU (its FP32 peak where it has no TF32)."""
    t = TF32_TFLOPS.get(spec.name)
    return t * 1e12 if t is not None else spec.fp32_flops


def _peaks(spec) -> dict:
    return {"fp32": spec.fp32_flops, "tf32": tf32_peak(spec), "low": spec.fp16_flops}


@functools.cache
def fitted_rates(gpu: str = REFERENCE_GPU) -> GpuRates | None:
    """Rates of a GPU type with shipped microbenchmarks, or None."""
    records = load_calibration(gpu)
    if not records:
        return None
    fit = fit_microbenchmarks(records)
    steps = load_step_fit(gpu)
    return GpuRates(gpu, f"fitted:{gpu}", dict(fit["matmul"]), dict(fit["conv"]), fit["bandwidth"], fit["launch_s"],
                    float(steps.get("host_s", fit["launch_s"])))


def gpu_rates(spec) -> GpuRates:
    """Rates of the catalog GPU ``spec``: fitted where measured, else derived from its datasheet."""
    own = fitted_rates(spec.name)
    if own is not None:
        return own
    ref = fitted_rates(REFERENCE_GPU)
    from ..topology.catalog import match_gpu_name

    ref_spec = match_gpu_name(REFERENCE_GPU)
    rp, sp = _peaks(ref_spec), _peaks(spec)
    mm = {m: ref.matmul[m] / rp[m] * sp[m] for m in MODES}
    conv = {m: ref.conv[m] / rp[m] * sp[m] for m in MODES}
    if spec.name not in TF32_TFLOPS:  # no TF32 tensor cores: a "tf32" op runs as fp32
        mm["tf32"], conv["tf32"] = mm["fp32"], conv["fp32"]
    bw = ref.bandwidth / ref_spec.memory_bandwidth * spec.memory_bandwidth
    return GpuRates(spec.name, f"datasheet:{spec.name}", mm, conv, bw, ref.launch_s, ref.host_s)


# ------------------------------------------------------------------------------ per-op seconds
@dataclass
class OpFeatures:
    """Per-op arrays of a graph that the GPU rule needs (batch-affine FLOPs and bytes)."""

    cls: np.ndarray
    """[n] class index into :data:`OP_CLASSES`."""
    mode: np.ndarray
    """[n] mode index into :data:`MODES`."""
    flops: np.ndarray
    """[n, 2] (fixed, per-sample) FLOPs."""
    nbytes: np.ndarray
    """[n, 2] (fixed, per-sample) bytes read + written."""
    sweeps: float
    """Multiplier of an ``opt`` op's bytes (:data:`FOREACH_SWEEPS` over the capture's count)."""
    kernel: np.ndarray
    """[n] bool: the op launches a kernel of its own (False inside a fused backward region but
    its first op, :func:`backward_regions`)."""

    @classmethod
    def of(cls, graph, numerics: Numerics) -> OpFeatures:
        from ..graph.capture import OPTIMIZER_COSTS

        ops = graph.ops
        klass = [op_class(o.target) for o in ops]
        _, n_read, n_written, _ = OPTIMIZER_COSTS.get(graph.optimizer, (0, 1, 0, 0))
        sweeps = FOREACH_SWEEPS.get(graph.optimizer, n_read + n_written) / max(1, n_read + n_written)
        nbytes = np.array([(o.bytes_read.fixed + o.bytes_written.fixed, o.bytes_read.per_sample + o.bytes_written.per_sample)
                           for o in ops], dtype=float).reshape(-1, 2)
        kernel = np.ones(len(ops), dtype=bool)
        for region, rb in backward_regions(graph, klass):
            nbytes[region] = 0.0
            kernel[region] = False
            nbytes[region[0]] = rb
            kernel[region[0]] = True
        return cls(
            np.array([OP_CLASSES.index(k) for k in klass], dtype=np.int64),
            np.array([MODES.index(op_mode(k, o.dtype, numerics)) for k, o in zip(klass, ops)], dtype=np.int64),
            np.array([(o.flops.fixed, o.flops.per_sample) for o in ops], dtype=float).reshape(-1, 2),
            nbytes, sweeps, kernel)


def _moves(op) -> bool:
    return (op.bytes_read.fixed + op.bytes_read.per_sample + op.bytes_written.fixed + op.bytes_written.per_sample
            + op.flops.fixed + op.flops.per_sample) > 0


def backward_regions(graph, klass: list[str]) -> list[tuple[list[int], tuple[float, float]]]:
    """The fused kernels eager PyTorch runs where the joint graph has a decomposition.

    The export decomposes backward formulas eager runs as one kernel (batch norm, layer norm,
    softmax, ReLU/GELU backward, ...) into elementwise ops and reductions. A **region** is a
    maximal run of consecutive backward ``memory`` ops (views in between do not break it) with
    the same forward anchor (:attr:`tag.graph.ir.Op.anchor`: the forward position whose backward
    they compute); a region of two or more costly ops is costed as one kernel that reads each
    tensor entering it once and writes each tensor leaving it once (its intermediates stay on
    chip). Returns ``(op indices, (fixed, per-sample) bytes)`` per region.
    """
    ops, tensors = graph.ops, graph.tensors
    out = []
    run: list[int] = []

    def close() -> None:
        costly = [i for i in run if _moves(ops[i])]
        if len(costly) >= 2:
            out.append((costly, _region_bytes(ops, tensors, set(run))))
        run.clear()

    for i, op in enumerate(ops):
        if op.phase != "bwd":
            close()
            continue
        if not _moves(op):  # a view / projection: part of whatever run surrounds it
            if run:
                run.append(i)
            continue
        if klass[i] != "memory" or (run and ops[run[0]].anchor != op.anchor):
            close()
            if klass[i] != "memory":
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
    rule, without the host's launch cost: :func:`stage_table` adds it)."""
    b = np.asarray(batches, dtype=float)[None, :]
    f = feat.flops[:, :1] + feat.flops[:, 1:] * b
    m = feat.nbytes[:, :1] + feat.nbytes[:, 1:] * b
    cls = feat.cls[:, None]
    mm_rate = np.array([rates.matmul[x] for x in MODES])[feat.mode][:, None]
    conv_rate = np.array([rates.conv[x] for x in MODES])[feat.mode][:, None]
    mem = m / rates.bandwidth
    is_mm = (cls == OP_CLASSES.index("matmul")) | (cls == OP_CLASSES.index("attention"))
    is_conv = cls == OP_CLASSES.index("conv")
    is_opt = cls == OP_CLASSES.index("opt")
    t = np.where(is_mm, np.maximum(f / mm_rate, mem), mem)
    t = np.where(is_conv, np.maximum(f / conv_rate, mem), t)
    t = np.where(is_opt, mem * feat.sweeps, t)
    return np.where(feat.kernel[:, None], t, 0.0)


def launches(feat: OpFeatures, batches) -> np.ndarray:
    """``[n_ops, len(batches)]`` 1 where an op launches a kernel from the host (it moves or
    computes something at that batch and is not inside a fused region), else 0. Optimizer
    updates launch nothing of their own (multi-tensor kernels, :meth:`GpuRates.step_overhead`)."""
    b = np.asarray(batches, dtype=float)[None, :]
    work = feat.flops[:, :1] + feat.flops[:, 1:] * b + feat.nbytes[:, :1] + feat.nbytes[:, 1:] * b
    own = feat.kernel & (feat.cls != OP_CLASSES.index("opt"))
    return ((work > 0) & own[:, None]).astype(float)


def stage_table(graph, feat: OpFeatures, rates: GpuRates, batches) -> np.ndarray:
    """Seconds ``[K, 3, len(batches)]`` of every (group, phase) stage run eagerly on the GPU.

    The host issues the stage's kernels in graph order, ``host_s`` each; the GPU runs them in
    order, each once issued and once the previous one finished. Kernel ``j`` is issued at
    ``H_j = host_s * (launches up to and including j)``, so the stage ends at
    ``max_j (H_j + sum_{i >= j} t_i)`` (``t``: :func:`op_seconds`): host-bound stages of many small
    kernels cost ``host_s`` per kernel, GPU-bound ones the sum of their kernels.
    """
    from ..graph.ir import PHASES

    t = op_seconds(feat, rates, batches)
    h = launches(feat, batches) * rates.host_s
    row = np.array([o.group * 3 + PHASES.index(o.phase) for o in graph.ops], dtype=np.int64)
    order = np.lexsort((np.arange(len(row)), row))  # by row, graph order within a row
    row_s, t_s, h_s = row[order], t[order], h[order]
    starts = np.flatnonzero(np.r_[True, row_s[1:] != row_s[:-1]]) if len(row_s) else np.array([], dtype=np.int64)
    ch = np.cumsum(h_s, axis=0)
    ct = np.cumsum(t_s, axis=0)
    seg_of = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(row_s)]))
    h0 = (ch - h_s)[starts][seg_of]  # host time before the row's first op
    t_before = (ct - t_s)  # GPU time of the ops before j (all rows)
    t_end = ct[np.r_[starts[1:] - 1, len(row_s) - 1]][seg_of] if len(row_s) else ct
    value = (ch - h0) + (t_end - t_before)  # H_j within the row + GPU time of j..end of the row
    out = np.zeros((graph.num_groups * 3, t.shape[1]))
    if len(row_s):
        out[row_s[starts]] = np.maximum.reduceat(value, starts, axis=0)
    return out.reshape(graph.num_groups, 3, t.shape[1])
