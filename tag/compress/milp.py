"""Which gradient ops to synchronise by SFB: a small 0/1 program solved with HiGHS.

Variables: ``x_i`` (op ``i`` uses SFB), ``b_k`` (factor ``k`` is all-gathered), ``z`` (any
factor is gathered) and ``u`` (every op is converted, so the group's gradient sync disappears).
Minimise the change in seconds against plain all-reduce::

    sum_i x_i * op_cost[i] + sum_k b_k * factor_cost[k] + z * gather_latency - u * sync_latency
    s.t. b_k >= x_i  for every factor k of op i;   z >= b_k;   u <= x_i

where ``op_cost[i] = extra compute_i - saved sync_i`` (usually negative) and ``factor_cost[k]``
is the all-gather time of factor ``k`` (>= 0). A factor shared by several ops (the same ``X``
feeding q/k/v, the same ``dY`` feeding a weight and its bias) is paid once. The two latency
terms model bucketed collectives (one gradient sync and one factor gather per group, whose
fixed latency is paid once); with both 0 this is exactly TAG's per-op formulation, a closure
(project-selection) problem whose LP relaxation is already integral. Instances are one
op-group, so HiGHS answers in milliseconds.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix


@dataclass(frozen=True)
class SfbProblem:
    """One selection instance (seconds)."""

    op_cost: tuple[float, ...]
    """Per op: extra compute minus the sync time saved by not all-reducing its gradient."""
    factor_cost: tuple[float, ...]
    """Per factor: all-gather time."""
    op_factors: tuple[tuple[int, ...], ...]
    """Per op: indices of the factors it needs."""
    gather_latency: float = 0.0
    """Fixed cost paid once when any factor is gathered."""
    sync_latency: float = 0.0
    """Fixed cost saved when every op is converted (0 when other gradients keep the sync alive)."""


@dataclass(frozen=True)
class SfbSolution:
    """Chosen ops and factors, and the objective (seconds; <= 0, the negated saving)."""

    ops: tuple[int, ...]
    factors: tuple[int, ...]
    objective: float


def objective(problem: SfbProblem, ops: Sequence[int]) -> tuple[float, tuple[int, ...]]:
    """Objective of converting exactly ``ops`` (their factors broadcast once each)."""
    facs = sorted({k for i in ops for k in problem.op_factors[i]})
    value = sum(problem.op_cost[i] for i in ops) + sum(problem.factor_cost[k] for k in facs)
    if facs:
        value += problem.gather_latency
    if ops and len(set(ops)) == len(problem.op_cost):
        value -= problem.sync_latency
    return value, tuple(facs)


def solve_milp(problem: SfbProblem) -> SfbSolution:
    """Optimal selection by ``scipy.optimize.milp`` (HiGHS branch and bound)."""
    n, m = len(problem.op_cost), len(problem.factor_cost)
    if n == 0:
        return SfbSolution((), (), 0.0)
    z, u = n + m, n + m + 1  # variable layout: x_0..x_{n-1}, b_0..b_{m-1}, z, u
    c = np.concatenate([np.asarray(problem.op_cost, float), np.asarray(problem.factor_cost, float),
                        [problem.gather_latency, -problem.sync_latency]])
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []

    def leq(a: int, b: int) -> None:  # one row: var_a - var_b <= 0
        r = len(rows) // 2
        rows.extend((r, r))
        cols.extend((a, b))
        vals.extend((1.0, -1.0))

    for i, facs in enumerate(problem.op_factors):
        for k in facs:
            leq(i, n + k)  # x_i <= b_k
        leq(u, i)  # u <= x_i
    for k in range(m):
        leq(n + k, z)  # b_k <= z
    a = coo_matrix((vals, (rows, cols)), shape=(len(rows) // 2, n + m + 2)).tocsr()
    scale = float(np.max(np.abs(c)))  # costs are seconds (often microseconds): solve in units of the largest
    if scale == 0.0:
        return SfbSolution((), (), 0.0)
    # HiGHS's default tolerances (dual feasibility 1e-7, absolute MIP gap 1e-6; here in units of
    # the largest cost) let it call "nothing" optimal where smaller savings exist: hypothesis found
    # op costs (1, -6e-8, -6e-8) with a free shared factor solved as 0 instead of -1.2e-7. scipy
    # hands options it does not know to HiGHS verbatim, with a warning.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Unrecognized options", RuntimeWarning)
        res = milp(c / scale, constraints=[LinearConstraint(a, -np.inf, 0.0)], integrality=np.ones(n + m + 2),
                   bounds=Bounds(0, 1), options={"mip_rel_gap": 1e-9, "mip_abs_gap": 0.0,
                                                     "dual_feasibility_tolerance": 1e-10})
    if res.x is None:  # cannot happen for this always-feasible bounded problem
        raise RuntimeError(f"HiGHS failed on the SFB selection problem: {res.message}")
    x = np.round(res.x).astype(int)
    ops = tuple(i for i in range(n) if x[i])
    value, facs = objective(problem, ops)
    if value > 0:  # numerical safety: doing nothing is always feasible
        return SfbSolution((), (), 0.0)
    return SfbSolution(ops, facs, value)


def solve_exhaustive(problem: SfbProblem) -> SfbSolution:
    """Reference: try every subset of ops (only for small instances, ``2**n`` subsets)."""
    n = len(problem.op_cost)
    best = SfbSolution((), (), 0.0)
    for size in range(1, n + 1):
        for ops in itertools.combinations(range(n), size):
            value, facs = objective(problem, ops)
            if value < best.objective:
                best = SfbSolution(ops, facs, value)
    return best
