"""Inter-op model parallel (``GroupPlan.sync == "mp"``).

The op-group's forward positions are cut at ``GroupPlan.mp_splits``: chunk ``j`` is forward
positions ``mp_splits[j] .. mp_splits[j+1]-1`` plus the backward ops anchored there and the
updates of the parameters owned there, on ``devices[j]``, on the full batch. Each parameter lives
on one device: no gradient collective.
"""

from __future__ import annotations

from ..errors import PlanError
from ..plan.format import GroupPlan, group_positions
from .strategy import Replica, Strategy, Unit, no_field


class ModelParallel(Strategy):
    name = "mp"
    chunked = True

    def validate(self, gp: GroupPlan, graph, g: int, num_devices: int, batch_size: int, where: str) -> None:
        no_field(gp, "server", where, "ps")
        no_field(gp, "tp", where, "tp")
        if any(s != 1.0 for s in gp.shares):
            raise PlanError(f"{where}.shares: sync 'mp' runs every chunk on the full batch; expected all 1.0")
        lo, hi = group_positions(graph, g)
        sp = gp.mp_splits
        if sp is None or len(sp) != len(gp.devices):
            raise PlanError(f"{where}.mp_splits: expected {len(gp.devices)} split positions for sync 'mp', got {sp}")
        if sp[0] != lo or any(b <= a for a, b in zip(sp, sp[1:])) or sp[-1] >= hi:
            raise PlanError(f"{where}.mp_splits: expected increasing positions starting at {lo} and below {hi}, "
                            f"got {sp}")

    def units(self, g: int, gp: GroupPlan, graph, batch_size: int) -> list[Unit]:
        bounds = list(gp.mp_splits) + [group_positions(graph, g)[1]]
        return [Unit((g, c), gp.sync, [Replica(d, 0, batch_size)], positions=(bounds[c], bounds[c + 1]))
                for c, d in enumerate(gp.devices)]

    def normalise(self, gp: GroupPlan, has_params: bool) -> GroupPlan:
        """One chunk on one device is a single data-parallel replica."""
        if len(gp.devices) == 1:
            gp.sync, gp.mp_splits, gp.server = "allreduce", None, None
        return gp

    def unit_of(self, gp: GroupPlan, anchor: int) -> int:
        """The last chunk starting at or before ``anchor``."""
        c = 0
        for j, s in enumerate(gp.mp_splits or [anchor]):
            if anchor >= s:
                c = j
        return c

