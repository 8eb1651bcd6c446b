"""Features of the plan head: the options of a plan-level pipeline decision.

The search's plan-level decisions (:data:`tag.search.space.PLAN_DECISIONS`: stage count, then for
a pipeline its cut, each stage's deployment, the micro-batch count and the schedule) are made
before any op-group. :class:`tag.gnn.TagNet`'s plan head scores each option ``o`` of such a
decision from the pooled graph embedding ``z`` and the option's features ``x_o``
(:func:`plan_option_features`, one row per option, :data:`PLAN_FEATURES` columns):

====  ==========================================================================================
col   meaning
====  ==========================================================================================
0     1 for "no pipeline" (the stage count 1: TAG's per-group decisions follow), else 0
1     ``log2(stages) / log2(devices)`` of the option's completed pipeline
2     1 when its stages are cut by memory (else by time)
3     ``log2(tp) / 3``: each stage's tensor-parallel degree (0: data parallel)
4     ``log2(micro-batches / stages) / 4``
5-7   the schedule, one-hot over :func:`tag.parallel.pipeline.searched_schedules` (first three)
8     ``log(t_ref / bound) / 5``, clipped to [-1, 1]: the completed pipeline's static lower bound
      (:func:`tag.sim.bounds.static_bound`) against the better data-parallel baseline ``t_ref``
9     1 when that bound already says the pipeline runs out of memory
10-14 the decision being made, one-hot over :data:`~tag.search.space.PLAN_DECISIONS`
15    ``log2(devices) / 9``
16    ``log(t_ref / lower bound) / 5``: the whole cluster's compute bound (:func:`tag.sim.lower_bound`),
      the same for every row: how far any plan could go below data parallel
====  ==========================================================================================

"Completed": an option fixes one decision; the later ones take the search's fixed defaults
(:meth:`tag.search.space.ActionSpace.default_pipeline_key`), the same in training and in a search
whose open choices follow the head (features of the head's own completion would make each row a
chain of head calls, and differ from the rows it was trained on). No simulation is needed: the bound comes from the
simulator's tables alone (~1-2 ms per option on 2-178 GPUs, 2026-11-27).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..search.space import PLAN_DECISIONS, ActionSpace

PLAN_FEATURES = 17
"""Columns of :func:`plan_option_features`."""
SCHEDULE_COLUMNS = 3
"""Schedules with a column of their own (the rest share none: all three columns zero)."""


def plan_option_features(space: ActionSpace, chosen: dict | None, decision: int,
                         bound_s: Callable[[tuple], tuple[float, bool]], t_ref: float,
                         lower_bound_s: float) -> np.ndarray:
    """[O, PLAN_FEATURES] features of the options of plan decision ``PLAN_DECISIONS[decision]``
    after the plan-level ``chosen`` so far (None or ``{}`` at the stage count), in option order.

    Args:
        space: an :class:`ActionSpace` built with ``pipelines=True``.
        chosen: plan-level choices made (``{"stages": p, "cut": ..., ...}``).
        decision: index into :data:`PLAN_DECISIONS` of the decision made.
        bound_s: ``bound_s(pipeline_key) -> (seconds, oom)``: a lower bound of that pipeline's
            iteration (:func:`tag.sim.bounds.static_bound` on the simulator).
        t_ref: the better data-parallel baseline's iteration (s).
        lower_bound_s: the whole cluster's compute bound (s)."""
    name = PLAN_DECISIONS[decision]
    base = dict(chosen or {})
    opts = space.options_at(name, base)
    sched = [s for s in space.options("schedule", 2)][:SCHEDULE_COLUMNS] if space.plan_options else []
    n_dev = space.num_devices
    out = np.zeros((len(opts), PLAN_FEATURES))
    out[:, 10 + decision] = 1.0
    out[:, 15] = math.log2(max(n_dev, 1)) / 9.0
    out[:, 16] = _log_ratio(t_ref, lower_bound_s)
    for i, o in enumerate(opts):
        c = {**base, name: o}
        if c.get("stages", 1) == 1:
            out[i, 0] = 1.0
            continue
        key = space.default_pipeline_key(c)  # a tag.search.space.PipelineChoice
        p, m, t, s, k, cut = key
        out[i, 1] = math.log2(p) / math.log2(max(n_dev, 2))
        out[i, 2] = float(cut == "memory")
        out[i, 3] = math.log2(t) / 3.0
        out[i, 4] = math.log2(m / p) / 4.0
        if (s, k) in sched:
            out[i, 5 + sched.index((s, k))] = 1.0
        b, oom = bound_s(key)
        out[i, 8] = _log_ratio(t_ref, b)
        out[i, 9] = float(oom)
    return out


def _log_ratio(t_ref: float, t: float) -> float:
    """``log(t_ref / t) / 5`` clipped to [-1, 1] (0 where either is not a positive number)."""
    if not (t_ref > 0 and t > 0 and math.isfinite(t_ref) and math.isfinite(t)):
        return 0.0
    return max(-1.0, min(1.0, math.log(t_ref / t) / 5.0))


def simulator_bound(space: ActionSpace, simulator) -> Callable[[tuple], tuple[float, bool]]:
    """``bound_s`` of :func:`plan_option_features` on a :class:`tag.sim.Simulator` (cached per key;
    ``(inf, True)`` for a key that names no plan)."""
    from ..sim.bounds import static_bound
    memo: dict[tuple, tuple[float, bool]] = {}

    def bound_s(key: tuple) -> tuple[float, bool]:
        got = memo.get(key)
        if got is None:
            plan = space.pipeline_plan(key, copy=False)  # (static_bound only reads it)
            if plan is None:
                got = (math.inf, True)
            else:
                b = static_bound(simulator, plan[0], plan[1])
                got = (float(b.time_s), bool(b.oom))
            memo[key] = got
        return got
    return bound_s


__all__ = ["PLAN_FEATURES", "plan_option_features", "simulator_bound"]
