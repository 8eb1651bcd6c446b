"""Inter-op model parallel (``GroupPlan.sync == "mp"``).

The op-group's forward positions are cut at ``GroupPlan.mp_splits``: chunk ``j`` is forward
positions ``mp_splits[j] .. mp_splits[j+1]-1`` plus the backward ops anchored there and the
updates of the parameters owned there, on ``devices[j]``, on the full batch. Each parameter lives
on one device: no gradient collective.
"""

from __future__ import annotations

import numpy as np

from ..cost.comm import LinkFit
from ..errors import PlanError
from ..plan.format import GroupPlan, group_positions
from .data_parallel import DataParallel
from .strategy import Replica, SearchTable, Strategy, Unit, no_field

SEARCH_MAX_DEVICES = 4
"""Most devices the search's model-parallel actions split a group over."""


class ModelParallel(Strategy):
    name = "mp"
    chunked = True
    search_pass = 0
    feature_sync = "mp"

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

    # ---- the search's actions (see Strategy.search_options): one per subset of >= 2 devices
    def search_devices(self, space, g: int, devices: tuple[int, ...], option) -> tuple[int, ...]:
        """The chunks' devices for group ``g``: the subset's fastest for the group (ties: lower
        index first), as many as chunks (at most :data:`SEARCH_MAX_DEVICES` and the group's
        forward positions)."""
        lo, hi = space.costs.positions[g]
        n = max(1, min(len(devices), hi - lo, SEARCH_MAX_DEVICES))
        memo = space.memo.setdefault("mp", {})  # (ranking, subset, chunks) -> devices
        key = (_speed_order(space)[g], devices, n)  # groups ranking devices alike choose alike
        chosen = memo.get(key)
        if chosen is None:
            devs = np.asarray(devices)
            order = np.lexsort((devs, space.costs.group_time_full[g][devs]))  # by (time, index)
            chosen = memo[key] = tuple(int(x) for x in devs[order[:n]])
        return chosen

    def search_plan(self, space, g: int, devices: tuple[int, ...], option) -> GroupPlan:
        """The group's forward positions cut into chunks balanced by compute, one per chosen
        device (:meth:`search_devices`)."""
        lo, _ = group_positions(space.graph, g)
        chosen = list(self.search_devices(space, g, devices, option))
        splits = balanced_splits(space.costs.position_weights(g), len(chosen), lo)
        n = len(splits)
        return GroupPlan(chosen[:n], [1.0] * n, self.name, None, splits)

    def search_key(self, space, g: int, devices: tuple[int, ...], option) -> tuple:
        """The chosen devices (the cuts follow from their number); one chunk is a single replica."""
        chosen = self.search_devices(space, g, devices, option)
        return (chosen, DataParallel.name) if len(chosen) == 1 else (chosen, self.name)

    def search_estimate(self, space, g: int, devices: tuple[int, ...], option, plan: GroupPlan, bmin: float,
                        lmax: float) -> tuple[float, float, float]:
        """Chunks one after the other on the full batch (the subset's fastest device's time), the
        activations crossing each cut twice without latency, the group's state spread over the
        chunks."""
        c, n = space.costs, len(plan.devices)
        comp = float(c.group_time[g, list(devices), 0].min())
        sync = 0.0 if n == 1 else 2 * LinkFit(0.0, bmin).time(c.act_bytes[g] / n)
        return comp, sync, (2 * c.param_bytes[g] + c.opt_bytes[g] + c.act_bytes[g]) / n

    def search_table(self, space, devices: tuple[int, ...], option, bmin: float, lmax: float) -> SearchTable:
        """:meth:`search_plan` and :meth:`search_estimate` of every group at once: a plan's devices
        are the chosen ones (:meth:`search_devices`; :func:`balanced_splits` cuts one chunk per
        chosen device, no more than the group's positions, which bound the choice), each on the
        full batch."""
        if not self._search_inherited(ModelParallel, ("search_plan", "search_estimate", "search_devices")):
            return super().search_table(space, devices, option, bmin, lmax)
        c, k = space.costs, space.num_groups
        chosen = [self.search_devices(space, g, devices, option) for g in range(k)]
        n = np.array([len(x) for x in chosen])
        devs = np.full((k, int(n.max())), -1, dtype=np.int64)
        for g, x in enumerate(chosen):
            devs[g, :len(x)] = x
        shares = np.where(devs >= 0, 1.0, 0.0)
        est = np.empty((k, 3))
        est[:, 0] = c.group_time[:, list(devices), 0].min(axis=1)
        est[:, 1] = np.where(n == 1, 0.0, 2 * (0.0 + c.act_bytes / n / bmin))  # LinkFit(0, bmin).time
        est[:, 2] = (2 * c.param_bytes + c.opt_bytes + c.act_bytes) / n
        return SearchTable(devs, shares, np.full(k, -1, dtype=np.int64), est)


def _speed_order(space) -> list[int]:
    """[K] an id per distinct ranking of the devices by a group's time (ties: lower index first);
    on a cluster of a few GPU kinds, a few rankings serve every group (kept in ``space.memo``)."""
    out = space.memo.get("mp-speed-order")
    if out is None:
        ids: dict[bytes, int] = {}
        t = space.costs.group_time_full
        idx = np.arange(t.shape[1])
        out = space.memo["mp-speed-order"] = [ids.setdefault(np.lexsort((idx, t[g])).tobytes(), len(ids))
                                              for g in range(t.shape[0])]
    return out


def balanced_splits(weights: np.ndarray, n: int, lo: int) -> list[int]:
    """First absolute position of each of ``<= n`` contiguous chunks with balanced weight."""
    p = len(weights)
    n = max(1, min(n, p))
    if n == 1:
        return [lo]
    cum = np.concatenate([[0.0], np.cumsum(np.maximum(weights, 0) + 1e-12)])
    total = cum[-1]
    splits = [0]
    for j in range(1, n):
        c = int(np.searchsorted(cum, total * j / n))
        c = min(max(c, splits[-1] + 1), p - (n - j))
        splits.append(c)
    return [lo + s for s in splits]
