"""Training precision: ``fp32``, or ``torch.autocast`` mixed precision in ``bf16`` / ``fp16``.

Mixed precision follows ``torch.autocast`` semantics: parameters (the master weights), their
gradients and the optimizer state stay FP32; autocast runs the ops on its lower-precision list
(matmuls, convolutions, attention) in the low dtype and keeps numerically sensitive ones
(softmax, norms, losses) in FP32, inserting the casts. ``fp16`` also needs loss scaling
(``torch.amp.GradScaler``); ``bf16`` has FP32's exponent range and does not.

Capture runs the export under :func:`autocast`, so the joint graph holds the casts and every node
its real dtype. The graph is captured on the CPU, but mixed precision is what GPUs train in, so
:func:`autocast` follows CUDA autocast's op lists: CPU autocast's own lists agree with CUDA's on the
low-precision ops (``mm``/``addmm``/``bmm``, convolutions, attention) and on the losses, but run
CUDA's FP32 ops ``pow``, ``exp``, ``log``, ``rsqrt``, ``softmax``, ``sum``, ``layer_norm``, ... in the
dtype of their input. :class:`CudaFp32Ops` casts those ops' low-precision inputs to FP32, as CUDA
autocast does. Measured on an H200 (2026-11-27): GPT-2's tanh GELU (``pow(x, 3.0)``) ran in FP32 in
eager CUDA autocast, its bf16 elementwise kernels took 162 ms per GPT-2 XL step where the graph
captured with CPU autocast's lists gave 78 ms.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils import _pytree

from ..errors import TagError

PRECISIONS = ("fp32", "bf16", "fp16")
"""Accepted ``--precision`` values."""
LOW_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The autocast dtype of each mixed precision."""


FP16_LOSS_SCALE = 2.0**16
"""The executor's initial fp16 loss scale, ``torch.amp.GradScaler``'s; then dynamic as
GradScaler's (:mod:`tag.executor.scaling`: halved after a step with a non-finite gradient, which
is skipped, doubled after 2000 finite steps)."""


def loss_scale(precision: str) -> float:
    """The initial loss scale of a precision (1 for fp32 and bf16, which need none)."""
    return FP16_LOSS_SCALE if precision == "fp16" else 1.0


def check_precision(precision: str, where: str = "--precision") -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else a one-line :class:`TagError`."""
    if precision not in PRECISIONS:
        raise TagError(f"{where}: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


OPT_DTYPE_OPS = frozenset({"prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "vector_norm"})
"""CUDA autocast's ``fp32_set_opt_dtype`` ops: run in FP32 (here: on inputs cast to it) only when
their ``dtype`` argument is unset; a call that sets it runs as it is (ATen/autocast_mode.h,
``set_opt_dtype``: ``dtype.has_value() ? dtype : to_type``; torch 2.13), so
``torch.softmax(x, -1, dtype=x.dtype)`` on a bf16 ``x`` runs and returns bf16 (its CUDA kernel
accumulates in FP32)."""
CUDA_FP32_OPS = frozenset({
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "softplus", "layer_norm", "group_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp",
}) | OPT_DTYPE_OPS
"""Names of the ops CUDA autocast runs in FP32 (``autocast_mode.cpp``'s ``KERNEL_CUDA(..., fp32)``
and ``fp32_set_opt_dtype`` lists, as torch functions, methods and operators are named); in-place
variants are not autocast."""


class CudaFp32Ops(torch.overrides.TorchFunctionMode):
    """Inside CPU autocast, cast the bf16/fp16 tensor inputs of :data:`CUDA_FP32_OPS` to FP32
    before the op runs (CUDA autocast's ``cached_cast(kFloat)``): the op and the elementwise ops
    after it then run in FP32, as in an eager CUDA step."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name in CUDA_FP32_OPS and torch.is_autocast_enabled("cpu")
                and not (name in OPT_DTYPE_OPS and _sets_dtype(args, kwargs))):
            args, kwargs = _pytree.tree_map_only(torch.Tensor, _fp32, (args, kwargs))
        return func(*args, **kwargs)


def _sets_dtype(args: tuple, kwargs: dict) -> bool:
    """A call's ``dtype`` argument is set: a ``dtype=`` keyword or a positional ``torch.dtype`` (the
    only ``torch.dtype`` parameter of :data:`OPT_DTYPE_OPS`' signatures)."""
    return kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def autocast(precision: str):
    """CPU ``torch.autocast`` in a mixed precision with CUDA autocast's op lists
    (:class:`CudaFp32Ops`); a null context for fp32."""
    check_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cpu", dtype=LOW_DTYPE[precision]))
    stack.enter_context(CudaFp32Ops())
    return stack


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name an :class:`~tag.graph.ir.Op` records)."""
    return str(dtype).removeprefix("torch.")


CAST_TARGETS = frozenset({"aten._to_copy.default"})
"""The ATen overload autocast casts a tensor with in the exported graph (``Op.target``)."""


def param_casts(graph) -> list[int]:
    """Indices of the forward ops of ``graph`` (an :class:`~tag.graph.ir.OpGraph`) that cast a
    parameter to the low precision: under autocast each forward starts by casting every fp32
    weight it reads (``aten._to_copy(W, dtype=bfloat16)``). Their value changes only at the
    optimizer step, so the executor computes each once per iteration, at its unit's first
    forward, and every later micro-batch and recomputation reads that copy (Megatron-LM holds
    bf16 weights and casts once per step); the cost model charges them so
    (:attr:`tag.cost.model.DeviceCost.cast`). Empty for an fp32 graph."""
    if graph.precision == "fp32":
        return []
    tensors = graph.tensors
    return [i for i, op in enumerate(graph.ops)
            if op.phase == "fwd" and op.target in CAST_TARGETS and len(op.inputs) == 1
            and tensors[op.inputs[0]].kind == "param" and op.dtype in ("bfloat16", "float16")]


def param_cast_values(graph) -> list[int]:
    """Indices of the forward ops of ``graph`` that compute from the parameters' low-precision
    copies alone: the casts (:func:`param_casts`) and, in graph order, every forward op all of
    whose inputs such ops made (a transpose or view of a copy, which a matmul's backward reads in
    its place). A ZeRO-3 group makes them per use, from its gathered parameters, at its forward
    and again at its backward (:attr:`tag.parallel.Schedule.recast`, :mod:`tag.sim.sharded`)."""
    casts = param_casts(graph)
    if not casts:
        return []
    made = {t for i in casts for t in graph.ops[i].outputs}
    out = set(casts)
    for i, op in enumerate(graph.ops):
        if op.phase == "fwd" and i not in out and op.inputs and all(t in made for t in op.inputs):
            out.add(i)
            made.update(op.outputs)
    return sorted(out)


def low_gathered_params(graph) -> frozenset[int]:
    """Indices into ``graph.params`` of the parameters a ZeRO-3 group gathers in the low precision:
    those every forward and backward read of which is a cast to it (:func:`param_casts`; the
    optimizer reads the FP32 master shard). FSDP2 under ``MixedPrecisionPolicy(param_dtype=bf16)``
    casts every local shard to ``param_dtype`` before the all-gather
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, ``FSDPParam.all_gather_inputs``:
    ``_to_dtype_if_needed(sharded_param_data, self.param_dtype)``; torch 2.13), so the gather
    moves 2 bytes an element and the unsharded parameter is held in bf16, which autocast reads
    without casting again. Cast element by element, the shard's cast gathered is the gathered
    parameter's cast, bit for bit. A parameter read in FP32 anywhere (a norm weight, an embedding
    table, a tied weight's lookup) stays FP32 here, where FSDP2 would round it to ``param_dtype``:
    TAG's graph reads it in FP32. Empty for an fp32 graph."""
    casts = param_casts(graph)
    if not casts:
        return frozenset()
    cast_set = set(casts)
    tensors, ops = graph.tensors, graph.ops
    return frozenset(k for k, p in enumerate(graph.params)
                     if any(c in cast_set for c in tensors[p.tensor].consumers)
                     and all(c in cast_set for c in tensors[p.tensor].consumers if ops[c].phase != "opt"))


def param_gather_bytes(graph) -> list[float]:
    """Bytes one all-gather of each of ``graph.params`` moves under sharded data parallelism
    (same order): a parameter of :func:`low_gathered_params` at the low precision's bytes an
    element (its shard cast before the gather), any other as it is (fp32). The one rule for ZeRO-3's
    gathers before use (FSDP2's ``param_dtype``) and ZeRO-1/2's gather of the updated shards after
    the step (DeepSpeed's and Megatron-LM's gather of their bf16 / fp16 model weights), which the
    simulator charges (:func:`tag.sim.sharded.low_gathers`), the executor moves
    (:mod:`tag.executor.sharded`) and the search estimates (:class:`tag.search.costs.GroupCosts`)."""
    low = low_gathered_params(graph)
    size = LOW_DTYPE[graph.precision].itemsize if low else 0  # bytes an element
    return [float(p.numel * size if k in low else p.nbytes) for k, p in enumerate(graph.params)]
