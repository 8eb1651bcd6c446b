"""The real torch.optim optimizers the executor (and its single-process reference) applies, and
the profiler times (:mod:`tag.cost.profiler`): one definition for both.

Names match :data:`tag.graph.capture.OPTIMIZER_COSTS`. One multi-tensor update over all the
parameters a rank holds, as an eager loop does: ``foreach`` kernels on a CPU (torch's default
there), the ``fused`` kernels on CUDA. Per element both compute what the single-tensor update
computes (equality tests hold at rtol 1e-4), but a step costs a fixed launch overhead plus time
per byte instead of ~8 kernels per parameter: the profiler times it the same way and the cost
model prices it as fixed + per byte (:func:`tag.cost.profiler.time_optimizer`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import TagError

# Hyper-parameters (fixed; the executor measures speed and checks equivalence, it does not tune).
ADAM_LR = 1e-3
SGD_LR = 1e-2
SGD_MOMENTUM = 0.9


STEP_OPS = {"adam": 8, "sgd": 3, "sgd-plain": 1}
"""``torch._foreach_*`` ops one foreach step runs, whatever the number of parameters (counted with
``torch.profiler`` on torch 2.13: Adam add, lerp, mul, addcmul, sqrt, div, add, addcdiv; SGD with
momentum mul, add, add; plain SGD add). The roofline's fixed cost of a step
(:func:`tag.cost.roofline.optimizer_step_overhead`); measured devices use their profile's."""


def implementation(device: torch.device | str | None) -> dict[str, bool]:
    """``{"fused": True}`` on CUDA, else ``{"foreach": True}``."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return {"fused": True} if dev.type == "cuda" else {"foreach": True}


def make_optimizer(name: str, params: Iterable[torch.Tensor],
                   device: torch.device | str | None = None) -> torch.optim.Optimizer | None:
    """``adam`` / ``sgd`` (momentum 0.9) / ``sgd-plain`` over ``params`` (all on ``device``, default
    the first parameter's); None if there are none."""
    params = list(params)
    if not params:
        return None
    how = implementation(device if device is not None else params[0].device)
    if name == "adam":
        return torch.optim.Adam(params, lr=ADAM_LR, **how)
    if name == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR, momentum=SGD_MOMENTUM, **how)
    if name == "sgd-plain":
        return torch.optim.SGD(params, lr=SGD_LR, **how)
    raise TagError(f"--optimizer: expected adam, sgd or sgd-plain, got {name!r}")
