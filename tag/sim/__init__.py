"""Event-driven simulation of one training iteration of a plan (see :mod:`tag.sim.engine`)."""

from __future__ import annotations

from .engine import Simulator
from .result import SimEvent, SimResult


def check_batches(plan, *, source: str = "plan") -> None:
    """Raise :class:`PlanError` when a data-parallel group has more replicas than samples (the
    executor refuses such plans; the simulator alone would give the extra replicas no work)."""
    from ..errors import PlanError

    for g, gp in enumerate(plan.groups):
        if gp.sync != "mp" and len(gp.devices) > plan.batch_size:
            raise PlanError(f"{source}: groups[{g}].devices: {len(gp.devices)} replicas but batch "
                            f"{plan.batch_size}; every replica needs at least one sample")


def simulate(graph, topology, plan, *, costs=None, trace: bool = False) -> SimResult:
    """Validate ``plan`` against ``graph`` and ``topology``, then simulate one iteration."""
    plan.validate(graph, topology)
    check_batches(plan)
    return Simulator(graph, topology, costs).run(plan.groups, trace=trace)


def lower_bound(graph, topology, costs=None) -> float:
    """Ideal iteration time (s): the whole iteration's compute spread over all devices in proportion
    to their throughput, no communication: ``1 / sum_d (1 / T_d)`` where ``T_d`` is one iteration
    on device ``d`` alone at the full batch."""
    from ..cost.model import CostModel

    costs = costs if costs is not None else CostModel.for_topology(graph, topology)
    return 1.0 / sum(1.0 / max(costs.iteration_time_alone(d), 1e-30) for d in range(topology.num_devices))


__all__ = ["SimEvent", "SimResult", "Simulator", "check_batches", "lower_bound", "simulate"]
