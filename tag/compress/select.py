"""Choose SFB ops per op-group of a plan (MILP on the cost model) and describe the work SFB adds.

``plan_sfb`` costs every candidate of every eligible group (:func:`eligible`), solves the
group's MILP and returns the decisions with their numbers; ``select_sfb`` / ``apply_sfb`` are
thin views of it. ``sfb_work`` turns a plan's ``GroupPlan.sfb`` lists into what the simulator
has to model (gradient bytes removed from the sync, factor all-gathers, extra FLOPs).

Which strategies take SFB is theirs to say (:meth:`tag.parallel.Strategy.sfb_op`); this layer sits
below the strategies and names none, so every function here that looks at a group's strategy takes
``syncs``: the strategy name (``GroupPlan.sync``) -> the collective op its gradients sync by
(:data:`tag.cost.comm.SYNC_OPS`), of every strategy that takes SFB, as
:func:`tag.parallel.sfb_syncs` gives it (``{"allreduce": "allreduce", "ps": "ps"}`` with the
built-in ones).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..cost.comm import CommModel
from ..cost.roofline import Roofline
from ..plan.format import GroupPlan, Plan, local_batches
from .cost import SYNC_ALGORITHM, SfbError, extra_compute_time, factor_gather_time, sfb_cost, sync_time
from .detect import Candidate, Factor, find_candidates
from .milp import SfbProblem, solve_milp


def default_compute_rate(topology) -> list[float]:
    """Achieved FLOP/s per device: datasheet fp32 peak x the roofline's GEMM efficiency (0.7,
    :meth:`tag.cost.roofline.Roofline.of`)."""
    return [Roofline.of(d.gpu).flop_rate for d in topology.devices]


def default_memory_rate(topology) -> list[float]:
    """Achieved memory bytes/s per device: datasheet bandwidth x streaming efficiency (0.8,
    :meth:`tag.cost.roofline.Roofline.of`)."""
    return [Roofline.of(d.gpu).mem_bandwidth for d in topology.devices]


def default_comm(topology) -> CommModel:
    """The communication model the selection prices collectives with when none is given: the one
    the simulator's cost model holds (:meth:`tag.cost.comm.CommModel.for_topology`, measured
    fits where profiled)."""
    return CommModel.for_topology(topology)


def eligible(gp: GroupPlan, syncs: Mapping[str, str]) -> bool:
    """SFB applies to groups of a strategy in ``syncs`` (strategy name -> the collective op of its
    gradient sync, :func:`tag.parallel.sfb_syncs`) with at least two replicas."""
    return gp.sync in syncs and len(gp.devices) >= 2


@dataclass(frozen=True)
class OpDecision:
    """One candidate of one group, costed on the group's replicas (seconds)."""

    candidate: Candidate
    sync_s: float
    """All-reduce (or parameter-server) time of its gradient alone."""
    sfb_gather_s: float
    """All-gather time of its factors alone (shared factors are paid once in the MILP)."""
    sfb_compute_s: float
    """Extra compute of recomputing dW on the global batch (slowest replica)."""
    chosen: bool

    @property
    def sfb_s(self) -> float:
        return self.sfb_gather_s + self.sfb_compute_s


@dataclass(frozen=True)
class GroupSelection:
    """The MILP's answer for one group."""

    group: int
    devices: tuple[int, ...]
    local_batches: tuple[int, ...]
    """Samples per replica (aligned with ``devices``)."""
    decisions: tuple[OpDecision, ...]
    factors: tuple[Factor, ...]
    """Factors all-gathered for the chosen ops (each once)."""
    saving_s: float
    """Predicted seconds saved (``-objective``; 0 when nothing is chosen)."""

    @property
    def ops(self) -> list[str]:
        return [d.candidate.op_name for d in self.decisions if d.chosen]


def plan_sfb(graph, topology, plan: Plan, compute_rate: Sequence[float] | None = None,
             memory_rate: Sequence[float] | None = None,
             candidates: Sequence[Candidate] | None = None, bucketed: bool = True,
             comm: CommModel | None = None, algorithm: str = SYNC_ALGORITHM, *,
             syncs: Mapping[str, str]) -> list[GroupSelection]:
    """Cost and select SFB ops for every eligible group of ``plan`` (see :func:`eligible`).

    With ``bucketed`` (default) a group syncs its gradients in one collective and gathers its
    factors in one collective, so each op saves only its bandwidth term and the fixed latencies
    enter the MILP once (the sync latency is saved only if no gradient of the group is left);
    without it every gradient and factor is its own collective (TAG's per-op formulation).

    Args:
        compute_rate: achieved FLOP/s per topology device (default :func:`default_compute_rate`).
        memory_rate: achieved bytes/s per topology device (default :func:`default_memory_rate`).
        candidates: precomputed :func:`find_candidates` of ``graph`` (computed when None).
        comm: the communication model pricing syncs and gathers (default
            :func:`default_comm`).
        algorithm: all-reduce algorithm of the gradient syncs (:data:`tag.cost.comm.ALGORITHMS`).
        syncs: the strategies taking SFB and their gradient collective ops (:func:`eligible`).
    """
    rate = default_compute_rate(topology) if compute_rate is None else list(compute_rate)
    mem = default_memory_rate(topology) if memory_rate is None else list(memory_rate)
    cands = find_candidates(graph) if candidates is None else list(candidates)
    links = default_comm(topology) if comm is None else comm
    by_group: dict[int, list[Candidate]] = {}
    for c in cands:
        by_group.setdefault(c.group, []).append(c)
    out = []
    for g, gp in enumerate(plan.groups):
        if eligible(gp, syncs) and by_group.get(g):
            keeps_sync = any(p.group == g for p in graph.params if p.name not in {c.param for c in by_group[g]})
            out.append(_select_group(g, gp, syncs[gp.sync], by_group[g], plan.batch_size, links, algorithm, rate,
                                     mem, bucketed, keeps_sync))
    return out


def _select_group(g: int, gp: GroupPlan, op: str, cands: list[Candidate], batch: int, comm: CommModel,
                  algorithm: str, rate: list[float], mem: list[float], bucketed: bool,
                  keeps_sync: bool) -> GroupSelection:
    """The MILP of group ``g`` deployed as ``gp``, its gradients synchronised by collective ``op``."""
    lb = local_batches(batch, gp.shares)
    facs: dict[int, Factor] = {}  # tensor index -> factor, in first-seen order
    for c in cands:
        for f in c.factors:
            facs.setdefault(f.tensor, f)
    fidx = {t: k for k, t in enumerate(facs)}
    sync = [sync_time(c.grad_bytes, gp.devices, comm, op, gp.server, algorithm) for c in cands]
    compute = [extra_compute_time(c, gp.devices, lb, rate, mem) for c in cands]
    gather = [factor_gather_time(f.bytes_per_sample, gp.devices, lb, comm) for f in facs.values()]
    # fixed latencies of one collective (1-byte message), paid once per group when bucketed
    l_sync = sync_time(1.0, gp.devices, comm, op, gp.server, algorithm) if bucketed else 0.0
    l_gather = factor_gather_time(1.0 / batch, gp.devices, lb, comm) if bucketed else 0.0
    problem = SfbProblem(
        op_cost=tuple(cm - (s - l_sync) for cm, s in zip(compute, sync)),
        factor_cost=tuple(t - l_gather for t in gather),
        op_factors=tuple(tuple(fidx[f.tensor] for f in c.factors) for c in cands),
        gather_latency=l_gather,
        sync_latency=0.0 if keeps_sync else l_sync,
    )
    sol = solve_milp(problem)
    chosen = set(sol.ops)
    decisions = []
    for i, c in enumerate(cands):
        cost = sfb_cost(c, gp.devices, lb, comm, rate, mem)
        decisions.append(OpDecision(c, sync[i], cost.gather_s, cost.compute_s, i in chosen))
    all_f = list(facs.values())
    return GroupSelection(g, tuple(gp.devices), tuple(lb), tuple(decisions),
                         tuple(all_f[k] for k in sol.factors), -sol.objective)


def select_sfb(graph, topology, plan: Plan, compute_rate: Sequence[float] | None = None,
               comm: CommModel | None = None, *, syncs: Mapping[str, str]) -> dict[int, list[str]]:
    """``group -> gradient op names`` the MILP converts to SFB (groups with a non-empty choice)."""
    return {s.group: s.ops for s in plan_sfb(graph, topology, plan, compute_rate, comm=comm, syncs=syncs) if s.ops}


def apply_sfb(graph, topology, plan: Plan, compute_rate: Sequence[float] | None = None,
              comm: CommModel | None = None, *, syncs: Mapping[str, str]) -> Plan:
    """A copy of ``plan`` with ``GroupPlan.sfb`` set for every eligible group (may be ``[]``;
    :func:`tag.parallel.apply_sfb` passes the registered strategies' ``syncs``).

    Groups of a strategy without SFB (``mp``, ``tp``) and single-replica groups keep their ``sfb``
    untouched. ``meta["sfb_saving_s"]`` records the predicted seconds saved (cost-model sum over
    groups, no overlap assumed).
    """
    new = copy.deepcopy(plan)
    sels = plan_sfb(graph, topology, plan, compute_rate, comm=comm, syncs=syncs)
    chosen = {s.group: s.ops for s in sels}
    for g, gp in enumerate(new.groups):
        if eligible(gp, syncs):
            gp.sfb = list(chosen.get(g, []))
    new.meta["sfb_saving_s"] = sum(s.saving_s for s in sels)
    return new


# ------------------------------------------------------------------------------ simulator hook
@dataclass(frozen=True)
class FactorGather:
    """One all-gather SFB adds to a group: every replica receives all rows of one factor."""

    factor: Factor
    chunks: tuple[float, ...]
    """Bytes each replica contributes (``b_r * bytes_per_sample``), aligned with the group's devices."""
    after_op: int
    """Op index producing the factor (-1: a graph input): the gather may start when it has run."""


@dataclass(frozen=True)
class GroupSfbWork:
    """What ``GroupPlan.sfb`` changes in one group's iteration."""

    group: int
    ops: tuple[int, ...]
    """Op indices of the SFB gradient ops: each now runs on the global batch on every replica."""
    params: tuple[str, ...]
    """Parameters whose gradients are left out of the group's all-reduce / ps sync."""
    saved_grad_bytes: int
    """Bytes removed from the group's gradient sync."""
    gathers: tuple[FactorGather, ...]
    """One all-gather per distinct factor of ``ops``."""
    extra_flops: tuple[float, ...]
    """Per replica: FLOPs added by running ``ops`` on the other replicas' samples too."""
    extra_bytes: tuple[float, ...]
    """Per replica: memory bytes read+written added likewise."""


def sfb_work(graph, plan: Plan, group: int, candidates: Sequence[Candidate] | None = None, *,
             syncs: Mapping[str, str]) -> GroupSfbWork:
    """The work ``plan.groups[group].sfb`` implies; empty when the list is empty.

    Raises :class:`SfbError` when a listed op is not an SFB candidate of that group or the
    group is not eligible (:func:`eligible`: a strategy without SFB, or one replica).
    """
    return group_sfb_work(graph, plan.groups[group], group, plan.batch_size, candidates, syncs=syncs)


def group_sfb_work(graph, gp: GroupPlan, group: int, batch_size: int,
                   candidates: Sequence[Candidate] | None = None, *, syncs: Mapping[str, str]) -> GroupSfbWork:
    """:func:`sfb_work` of one :class:`GroupPlan` ``gp`` deployed as op-group ``group``."""
    if not gp.sfb:
        return GroupSfbWork(group, (), (), 0, (), tuple(0.0 for _ in gp.devices), tuple(0.0 for _ in gp.devices))
    where = f"plan: groups[{group}].sfb"
    if not eligible(gp, syncs):
        raise SfbError(f"{where}: SFB needs sync {' or '.join(map(repr, syncs))} with >= 2 devices, got sync "
                       f"{gp.sync!r} on {len(gp.devices)} device(s)")
    cands = find_candidates(graph) if candidates is None else candidates
    by_name = {c.op_name: c for c in cands if c.group == group}
    chosen = []
    for name in gp.sfb:
        if name not in by_name:
            raise SfbError(f"{where}: op {name!r} is not an SFB candidate of this group")
        if by_name[name] in chosen:
            raise SfbError(f"{where}: op {name!r} is listed twice")
        chosen.append(by_name[name])
    lb = local_batches(batch_size, gp.shares)
    facs: dict[int, Factor] = {}
    for c in chosen:
        for f in c.factors:
            facs.setdefault(f.tensor, f)
    gathers = tuple(FactorGather(f, tuple(b * f.bytes_per_sample for b in lb), graph.tensors[f.tensor].producer)
                    for f in facs.values())
    total = sum(lb)
    extra_f = tuple(sum(c.flops.per_sample for c in chosen) * (total - b) for b in lb)
    extra_b = tuple(sum(c.bytes_moved.per_sample for c in chosen) * (total - b) for b in lb)
    return GroupSfbWork(group, tuple(c.op for c in chosen), tuple(c.param for c in chosen),
                        sum(c.grad_bytes for c in chosen), gathers, extra_f, extra_b)
