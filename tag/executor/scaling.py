"""Dynamic fp16 loss scaling on the executor (:class:`LossScaler`), ``torch.amp.GradScaler``'s
rule: the loss-gradient seed is multiplied by the scale ``s`` (a 0-dim FP32 tensor every rank
holds, read by the loss unit's backward as an input, so a new scale needs no new program:
:func:`tag.executor.runtime._scale_seed`); before the step the gradients are multiplied by ``1 /
s`` and checked; a step with a non-finite gradient is skipped and ``s`` halves, and after
:data:`GROWTH_INTERVAL` finite steps in a row it doubles. Ranks agree on the check before they
act on it (:attr:`tag.executor.runtime.RankRuntime.agree_finite`: one all-reduce of the found-inf
flag over the ranks, as FSDP's ``ShardedGradScaler`` all-reduces it over the shard group): each
rank checks only the gradients it holds (a ZeRO shard, a pipeline stage's), and a rank that skipped
while another stepped would leave the replicas apart and the scales different.

The scaler's state (:meth:`LossScaler.state`: the scale, the finite steps since it last changed,
the steps skipped) is saved with ``tag run``'s checkpoints as 0-dim tensors under ``scaler/``
(:mod:`tag.executor.checkpoint`, read back with ``weights_only=True`` as every tensor), so a
resumed fp16 run backs off and grows when the uninterrupted one would (``GradScaler``'s
``state_dict`` likewise holds the scale and its growth tracker).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..graph.precision import FP16_LOSS_SCALE

GROWTH_FACTOR = 2.0
"""The scale's factor after :data:`GROWTH_INTERVAL` finite steps (``GradScaler``'s default)."""
BACKOFF_FACTOR = 0.5
"""The scale's factor after a step with a non-finite gradient (``GradScaler``'s default)."""
GROWTH_INTERVAL = 2000
"""Finite steps in a row after which the scale grows (``GradScaler``'s default)."""
SCALE_INPUT = "tag_loss_scale"
"""Name of the loss unit backward's input holding the scale (a rank's ``state`` entry)."""


class LossScaler:
    """One rank's dynamic loss scale (module docstring); ``init`` the first scale."""

    def __init__(self, device: torch.device, init: float = FP16_LOSS_SCALE, growth_interval: int = GROWTH_INTERVAL):
        if not init > 0 or growth_interval < 1:
            raise ValueError(f"loss scale: expected a positive scale and growth interval, got {init}, "
                             f"{growth_interval}")
        self.scale = torch.tensor(float(init), dtype=torch.float32, device=device)
        """The scale (0-dim FP32), updated in place."""
        self.growth_interval = growth_interval
        self.good_steps = 0
        """Finite steps since the scale last changed."""
        self.skipped = 0
        """Steps skipped for a non-finite gradient."""

    def unscale(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; False if one of them is not finite."""
        if not grads:
            return True
        torch._foreach_mul_(grads, 1.0 / float(self.scale))
        return all(bool(torch.isfinite(g).all()) for g in grads)

    def state(self) -> dict[str, torch.Tensor]:
        """The scaler's state as 0-dim tensors (on the host): ``scale`` (FP32), ``good_steps`` and
        ``skipped`` (int64)."""
        return {"scale": self.scale.detach().cpu().clone(), "good_steps": torch.tensor(self.good_steps),
                "skipped": torch.tensor(self.skipped)}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Take :meth:`state`'s values (the scale in place: the loss unit's backward reads this tensor)."""
        self.scale.copy_(state["scale"].to(self.scale.device, self.scale.dtype))
        self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])

    def update(self, finite: bool) -> None:
        """After a step (``finite``: every rank's gradients were): back off or count towards growth."""
        if not finite:
            self.scale.mul_(BACKOFF_FACTOR)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale.mul_(GROWTH_FACTOR)
            self.good_steps = 0


def all_finite(ok: bool, device: torch.device, group=None) -> bool:
    """Whether every rank's gradients are finite, from this rank's ``ok``: one all-reduce (max) of
    the found-inf flag over ``group`` (default: every rank)."""
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return float(flag) == 0.0


__all__ = ["BACKOFF_FACTOR", "GROWTH_FACTOR", "GROWTH_INTERVAL", "SCALE_INPUT", "LossScaler", "all_finite"]
