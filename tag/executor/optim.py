"""The real torch.optim optimizers the executor (and its single-process reference) applies.

Names match :data:`tag.graph.capture.OPTIMIZER_COSTS`. ``foreach=False``: the single-tensor
kernels whose FLOP/byte counts the capture assumed, and per-parameter updates that do not
depend on which other parameters a rank happens to hold.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import TagError

# Hyper-parameters (fixed; the executor measures speed and checks equivalence, it does not tune).
ADAM_LR = 1e-3
SGD_LR = 1e-2
SGD_MOMENTUM = 0.9


def make_optimizer(name: str, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer | None:
    """``adam`` / ``sgd`` (momentum 0.9) / ``sgd-plain`` over ``params``; None if there are none."""
    params = list(params)
    if not params:
        return None
    if name == "adam":
        return torch.optim.Adam(params, lr=ADAM_LR, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR, momentum=SGD_MOMENTUM, foreach=False)
    if name == "sgd-plain":
        return torch.optim.SGD(params, lr=SGD_LR, foreach=False)
    raise TagError(f"--optimizer: expected adam, sgd or sgd-plain, got {name!r}")
