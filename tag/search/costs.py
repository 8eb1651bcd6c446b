"""Per-group cost tables the action space and the GNN encoder share.

Group compute times come from the simulator's cost model (:class:`tag.cost.CostModel`, which
uses profiles where it has them) when it is available, else from its datasheet roofline rule
(:mod:`tag.cost.roofline`). Devices with the same GPU spec are costed once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..plan.format import group_positions

BATCH_FRACTIONS = (1.0, 0.5, 0.25, 0.125)
"""Per-replica batch fractions at which group times are tabulated (TAG: B, B/2, B/4, B/8)."""


def _roofline_table(graph, topology, batches) -> dict[str, np.ndarray]:
    """gpu name -> [K, len(batches)] seconds (fwd+bwd+opt) by the cost model's rule without
    profiles (:meth:`tag.cost.CostModel.roofline_only`: the GPU rule of :mod:`tag.cost.gpu` or the
    CPU roofline): one table of rules, whoever asks."""
    from ..cost.model import CostModel

    return _costmodel_table(graph, topology, batches, CostModel.roofline_only(graph, topology))


def default_cost_model(graph, topology):
    """The simulator's cost model for ``topology`` (None if :mod:`tag.cost` has none)."""
    try:
        from ..cost import CostModel  # type: ignore[attr-defined]
    except ImportError:
        return None
    return CostModel.for_topology(graph, topology)


def _costmodel_table(graph, topology, batches, costs) -> dict[str, np.ndarray] | None:
    """Same table from the simulator's cost model, or None when it is unavailable."""
    try:
        if costs is None:
            return None
        out = {}
        for d in topology.devices:
            if d.gpu.name in out:
                continue
            tab = np.zeros((graph.num_groups, len(batches)))
            for g in range(graph.num_groups):
                for j, b in enumerate(batches):
                    tab[g, j] = sum(float(costs.group_time(g, ph, d.index, b)) for ph in ("fwd", "bwd", "opt"))
            out[d.gpu.name] = tab
        return out
    except (ImportError, AttributeError, TypeError, NotImplementedError):
        return None


@dataclass
class GroupCosts:
    """Static per-group / per-device numbers of one (graph, topology)."""

    group_time: np.ndarray
    """[K, D, 4] seconds of fwd+bwd+opt of group k on device d at per-replica batch B*f."""
    device_speed: np.ndarray
    """[D] whole-graph iterations per second on each device alone."""
    param_bytes: np.ndarray
    """[K] bytes of parameters owned by each group."""
    opt_bytes: np.ndarray
    """[K] optimizer-state bytes of each group."""
    gather_bytes: np.ndarray
    """[K] bytes one all-gather of each group's parameters moves under sharded data parallelism
    (:func:`tag.graph.precision.param_gather_bytes`: the cast-only weights at 2 bytes an element
    under mixed precision; the simulator's rule, :func:`tag.sim.sharded.low_gathers`)."""
    act_bytes: np.ndarray
    """[K] bytes of forward activations produced by each group at the full batch."""
    flow: dict[tuple[int, int], float]
    """(producer group, consumer group) -> bytes crossing at the full batch (g1 != g2)."""
    positions: list[tuple[int, int]]
    """Forward position range of each group."""
    pos_weight: list[np.ndarray]
    """Per group: roofline weight of each forward position (for model-parallel splits)."""

    @property
    def group_time_full(self) -> np.ndarray:
        """[K, D] seconds at the full batch."""
        return self.group_time[:, :, 0]

    def position_weights(self, g: int) -> np.ndarray:
        return self.pos_weight[g]

    @classmethod
    def compute(cls, graph, topology, costs=None) -> GroupCosts:
        b = graph.batch_size
        batches = [b * f for f in BATCH_FRACTIONS]
        table = _costmodel_table(graph, topology, batches, costs)
        if table is None:
            table = _roofline_table(graph, topology, batches)
        gt = np.stack([table[d.gpu.name] for d in topology.devices], axis=1)  # [K, D, 4]
        speed = 1.0 / np.maximum(gt[:, :, 0].sum(axis=0), 1e-15)
        k = graph.num_groups
        pb = np.zeros(k)
        ob = np.zeros(k)
        gb = np.zeros(k)
        from ..graph.gradients import param_groups
        from ..graph.precision import param_gather_bytes
        for p, g, moved in zip(graph.params, param_groups(graph), param_gather_bytes(graph)):
            pb[g] += p.nbytes  # (where the simulator and executor own it)
            ob[g] += p.opt_state_bytes
            gb[g] += moved
        act = np.zeros(k)
        flow: dict[tuple[int, int], float] = {}
        for t in graph.tensors:
            if t.producer < 0:
                continue
            g1 = graph.ops[t.producer].group
            nb = t.nbytes.at(b)
            if graph.ops[t.producer].phase == "fwd" and t.kind == "activation":
                act[g1] += nb
            for g2 in {graph.ops[c].group for c in t.consumers}:
                if g2 != g1 and g2 >= 0:
                    flow[(g1, g2)] = flow.get((g1, g2), 0.0) + nb
        positions = [group_positions(graph, g) for g in range(k)]
        from ..graph.grouping import op_weight
        pw = [np.zeros(hi - lo) for lo, hi in positions]
        for i, op in enumerate(graph.ops):
            if op.phase == "opt" or op.group < 0:
                continue
            lo, hi = positions[op.group]
            if lo <= op.anchor < hi:
                pw[op.group][op.anchor - lo] += op_weight(graph, i)
        return cls(gt, speed, pb, ob, gb, act, flow, positions, pw)
