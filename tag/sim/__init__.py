"""Event-driven simulation of one training iteration of a plan (see :mod:`tag.sim.engine`)."""

from __future__ import annotations

from ..parallel import validate_plan
from . import sharded, tensor_parallel  # noqa: F401 - register zero*'s and tp's group costings (tag.sim.strategies)
from .engine import Simulator
from .result import SimEvent, SimResult
from .strategies import costing_of, register_costing, unregister_costing


def simulate(graph, topology, plan, *, costs=None, trace: bool = False, bucket_bytes: int | None = None) -> SimResult:
    """Validate ``plan`` against ``graph`` and ``topology`` (:func:`tag.parallel.validate_plan`),
    then simulate one iteration (``bucket_bytes``: the gradient buckets' cap, default DDP's)."""
    validate_plan(plan, graph, topology, pipelines=True, tensor_parallel=True)
    return Simulator(graph, topology, costs, bucket_bytes).run(plan.groups, trace=trace, pipeline=plan.pipeline)


def lower_bound(graph, topology, costs=None) -> float:
    """Ideal iteration time (s): the whole iteration's compute spread over all devices in proportion
    to their throughput, no communication: ``1 / sum_d (1 / T_d)`` where ``T_d`` is one iteration
    on device ``d`` alone at the full batch."""
    from ..cost.model import CostModel

    costs = costs if costs is not None else CostModel.for_topology(graph, topology)
    return 1.0 / sum(1.0 / max(costs.iteration_time_alone(d), 1e-30) for d in range(topology.num_devices))


__all__ = ["SimEvent", "SimResult", "Simulator", "costing_of", "lower_bound", "register_costing", "simulate",
           "unregister_costing"]
