"""Baseline plans: data parallel over every device, with even or speed-proportional shares."""

from __future__ import annotations

from collections.abc import Sequence

from ..cost.roofline import Roofline, graph_time
from .format import GroupPlan, Plan


def new_plan(graph, topology, groups: list[GroupPlan], **meta) -> Plan:
    """A :class:`Plan` for ``graph`` on ``topology`` with the given group deployments."""
    return Plan(model=graph.model, graph_signature=graph.signature(), topology=topology.name,
                topology_signature=topology.signature(), batch_size=graph.batch_size,
                groups=groups, meta=dict(meta))


def roofline_speeds(graph, topology) -> list[float]:
    """Iterations/second of the whole graph on each device alone, by the datasheet roofline."""
    return [1.0 / graph_time(graph, Roofline.of(d.gpu)) for d in topology.devices]


def proportional_shares(speeds: Sequence[float]) -> list[float]:
    """Batch shares proportional to device speed (equal finish times when compute-bound)."""
    total = float(sum(speeds))
    return [s / total for s in speeds]


def data_parallel(graph, topology, *, proportional: bool = False, speeds: Sequence[float] | None = None,
                  devices: Sequence[int] | None = None) -> Plan:
    """Every group replicated on ``devices`` (default all), gradients all-reduced.

    Args:
        proportional: shares proportional to ``speeds`` (default: :func:`roofline_speeds`)
            instead of even (Horovod-like).
        speeds: per-device speed (any unit; only ratios matter), indexed by global device.
    """
    devs = list(range(topology.num_devices)) if devices is None else list(devices)
    if proportional:
        sp = roofline_speeds(graph, topology) if speeds is None else list(speeds)
        shares = proportional_shares([sp[d] for d in devs])
        name = "dp-prop"
    else:
        shares = [1.0 / len(devs)] * len(devs)
        name = "dp"
    groups = [GroupPlan(devices=list(devs), shares=list(shares), sync="allreduce") for _ in graph.groups]
    return new_plan(graph, topology, groups, baseline=name)
