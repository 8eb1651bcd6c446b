"""Training precision: ``fp32``, or ``torch.autocast`` mixed precision in ``bf16`` / ``fp16``.

Mixed precision follows ``torch.autocast`` semantics: parameters (the master weights), their
gradients and the optimizer state stay FP32; autocast runs the ops on its lower-precision list
(matmuls, convolutions, attention) in the low dtype and keeps numerically sensitive ones
(softmax, norms, losses) in FP32, inserting the casts. ``fp16`` also needs loss scaling
(``torch.amp.GradScaler``); ``bf16`` has FP32's exponent range and does not.

Capture runs the export under :func:`autocast`, so the joint graph holds the casts and every node
its real dtype. The graph is captured on the CPU: CPU autocast's op lists decide which ops run in
the low dtype. They agree with CUDA's on what dominates a training step (``mm``/``addmm``/``bmm``,
convolutions and attention in low precision; softmax, layer/batch norm, losses in FP32); they
differ on a few elementwise ops (the CUDA list keeps e.g. ``exp``, ``pow``, ``sum`` in FP32 more
often), which moves bytes of memory-bound ops by their dtype's size.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import TagError

PRECISIONS = ("fp32", "bf16", "fp16")
"""Accepted ``--precision`` values."""
LOW_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The autocast dtype of each mixed precision."""


FP16_LOSS_SCALE = 2.0**16
"""The executor's static fp16 loss scale: ``torch.amp.GradScaler``'s initial scale. It is not
adjusted (no growth or back-off): a step with a non-finite gradient is skipped."""


def loss_scale(precision: str) -> float:
    """The static loss scale of a precision (1 for fp32 and bf16, which need none)."""
    return FP16_LOSS_SCALE if precision == "fp16" else 1.0


def check_precision(precision: str, where: str = "--precision") -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else a one-line :class:`TagError`."""
    if precision not in PRECISIONS:
        raise TagError(f"{where}: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def autocast(precision: str, device_type: str = "cpu"):
    """``torch.autocast(device_type, dtype)`` for a mixed precision; a null context for fp32."""
    check_precision(precision)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=LOW_DTYPE[precision])


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name an :class:`~tag.graph.ir.Op` records)."""
    return str(dtype).removeprefix("torch.")
