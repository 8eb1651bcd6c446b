"""Sufficient Factor Broadcasting (SFB), chosen per op-group by a MILP on the real topology.

For a weight gradient ``dW = X^T dY`` summed over samples, the replicas of a data-parallel group
can all-gather the factors ``X`` and ``dY`` (``b_r`` rows each) and each compute the full ``dW``
instead of all-reducing ``dW``: lossless up to float rounding, and cheaper when the batch rows
are few compared with the weight and the links are slow.

* :func:`find_candidates` -- structural detection in an :class:`~tag.graph.ir.OpGraph`.
* :func:`allreduce_time`, :func:`sfb_time` -- SFB costs (:mod:`tag.compress.cost`; every collective
  priced by :class:`tag.cost.comm.CommModel`).
* :func:`select_sfb`, :func:`apply_sfb`, :func:`plan_sfb` -- MILP selection per group.
* :func:`sfb_work` -- what a plan's ``GroupPlan.sfb`` adds/removes (simulator hook).
* :func:`gather_rows`, :func:`sfb_kernel` -- running it (executor hook, :mod:`tag.compress.runtime`).
"""

from .cost import SfbCost, SfbError, allgather_time, allreduce_time, ps_time, sfb_cost, sfb_time, sync_time
from .detect import Candidate, Factor, find_candidates
from .milp import SfbProblem, SfbSolution, solve_exhaustive, solve_milp
from .runtime import SfbKernel, gather_rows, sfb_kernel
from .select import (
    FactorGather,
    GroupSelection,
    GroupSfbWork,
    OpDecision,
    apply_sfb,
    default_compute_rate,
    eligible,
    group_sfb_work,
    plan_sfb,
    select_sfb,
    sfb_work,
)

__all__ = [
    "Candidate", "Factor", "find_candidates",
    "SfbCost", "SfbError", "allgather_time", "allreduce_time", "ps_time", "sfb_cost", "sfb_time", "sync_time",
    "SfbProblem", "SfbSolution", "solve_exhaustive", "solve_milp",
    "FactorGather", "GroupSelection", "GroupSfbWork", "OpDecision", "apply_sfb", "default_compute_rate",
    "eligible", "group_sfb_work", "plan_sfb", "select_sfb", "sfb_work",
    "SfbKernel", "gather_rows", "sfb_kernel",
]
