"""Pipeline parallelism: op-groups cut into stages, the batch into micro-batches (pure, no torch).

A plan with :attr:`Plan.pipeline <tag.plan.Plan.pipeline>` (a :class:`~tag.plan.PipelinePlan`)
cuts its op-groups into ``S`` consecutive **stages** (``stages[s]`` is the first group of stage
``s``), each on its own device set: every group of a stage is deployed on the same devices with
the same shares (data parallel within the stage: ``allreduce`` or ``ps``). The global batch of
``B`` samples is cut into ``M`` **micro-batches** of contiguous samples (:func:`micro_ranges`);
each stage runs its forward and its backward once per micro-batch, in the order its **schedule**
gives, accumulating gradients; the gradient sync of a group starts after its last micro-batch's
backward (one sync per iteration, as without a pipeline).

Schedules (all members of one family, the kFkB schedules of Ada-Grouper, arXiv 2303.01675):

* ``kfkb`` with block size ``k``: micro-batches go in blocks of ``k``; stage ``s`` of ``S`` first
  runs ``min(S - 1 - s, G)`` blocks of forwards (``G = ceil(M / k)`` blocks), then alternates
  one forward block and one backward block, then runs the remaining backward blocks;
* ``1f1b`` (PipeDream-flush, Megatron's default): ``kfkb`` with ``k = 1``;
* ``gpipe`` (all forwards, then all backwards): ``kfkb`` with ``k = M``.

A larger ``k`` keeps more micro-batches' activations alive (:func:`in_flight`) but lets a stage
run ``k`` micro-batches back to back (fewer waits on slow links). :func:`pipeline_order` merges
the stages' sequences into the one global order every rank walks (any order consistent with
each stage's sequence and the data dependencies is deadlock-free under the schedule's rule: the
earliest unfinished step always has all its participants waiting on it).
"""

from __future__ import annotations

import functools
import math
from typing import Literal, NamedTuple

from ..errors import PlanError
from ..plan.format import PIPELINE_SCHEDULES, PipelinePlan, local_batches

Phase = Literal["fwd", "bwd"]


class Task(NamedTuple):
    """One stage running one phase of one micro-batch."""

    stage: int
    phase: Phase
    micro: int


def block_size(pp: PipelinePlan) -> int:
    """Micro-batches per forward / backward block (``k`` of kFkB)."""
    if pp.schedule == "1f1b":
        return 1
    if pp.schedule == "gpipe":
        return pp.micro_batches
    return pp.k


def stage_sequence(stage: int, num_stages: int, micro_batches: int, k: int) -> list[tuple[Phase, int]]:
    """The (phase, micro-batch) sequence stage ``stage`` of ``num_stages`` runs under kFkB with
    blocks of ``k`` micro-batches (``k = 1``: 1F1B; ``k >= micro_batches``: GPipe)."""
    return list(_stage_sequence(stage, num_stages, micro_batches, k))


@functools.lru_cache(maxsize=4096)
def _stage_sequence(stage: int, num_stages: int, micro_batches: int, k: int) -> tuple[tuple[Phase, int], ...]:
    """:func:`stage_sequence` as a tuple, cached (the simulator and its bounds ask for every stage
    of every pipeline they cost: hundreds of layouts share a few shapes)."""
    k = max(1, min(k, micro_batches))
    blocks = [range(lo, min(lo + k, micro_batches)) for lo in range(0, micro_batches, k)]
    warmup = min(num_stages - 1 - stage, len(blocks))
    seq: list[tuple[Phase, int]] = []
    for b in blocks[:warmup]:
        seq += [("fwd", m) for m in b]
    for j in range(len(blocks) - warmup):
        seq += [("fwd", m) for m in blocks[warmup + j]]
        seq += [("bwd", m) for m in blocks[j]]
    for b in blocks[len(blocks) - warmup:]:
        seq += [("bwd", m) for m in b]
    return tuple(seq)


def in_flight(sequence: list[tuple[Phase, int]]) -> int:
    """The most micro-batches whose forward ran and whose backward did not yet (their saved
    activations are alive at once)."""
    live = peak = 0
    for phase, _ in sequence:
        live += 1 if phase == "fwd" else -1
        peak = max(peak, live)
    return peak


def pipeline_order(num_stages: int, micro_batches: int, k: int,
                   fwd_s: float = 1.0, bwd_s: float = 2.0) -> list[Task]:
    """Every stage's :func:`stage_sequence` merged into one global order.

    The order is that of start times when each forward takes ``fwd_s`` and each backward
    ``bwd_s`` (any positive durations give an order consistent with the dependencies:
    forward of stage ``s`` after forward of ``s - 1``, backward of ``s`` after backward of
    ``s + 1`` and after its own forward), ties broken by stage. Raises :class:`PlanError` if the
    sequences cannot all run (a stage waits on a task that waits on it).
    """
    return list(_pipeline_order(num_stages, micro_batches, k, fwd_s, bwd_s))


@functools.lru_cache(maxsize=256)
def _pipeline_order(num_stages: int, micro_batches: int, k: int, fwd_s: float, bwd_s: float) -> tuple[Task, ...]:
    """:func:`pipeline_order` as a tuple, cached (a pure function of its arguments)."""
    seqs = [stage_sequence(s, num_stages, micro_batches, k) for s in range(num_stages)]
    end: dict[Task, float] = {}
    start: dict[Task, float] = {}
    pos = [0] * num_stages
    free = [0.0] * num_stages
    remaining = sum(len(q) for q in seqs)
    while remaining:
        progressed = False
        for s in range(num_stages):
            while pos[s] < len(seqs[s]):
                phase, m = seqs[s][pos[s]]
                if phase == "fwd":
                    deps = [Task(s - 1, "fwd", m)] if s > 0 else []
                else:
                    deps = [Task(s, "fwd", m)] + ([Task(s + 1, "bwd", m)] if s + 1 < num_stages else [])
                if any(d not in end for d in deps):
                    break
                t = Task(s, phase, m)
                start[t] = max([free[s]] + [end[d] for d in deps])
                end[t] = free[s] = start[t] + (fwd_s if phase == "fwd" else bwd_s)
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PlanError(f"pipeline: the stage sequences deadlock ({num_stages} stages, "
                            f"{micro_batches} micro-batches, k={k})")
    # Ties go to the later stage first: a stage's input then moves as soon as it was computed,
    # before its producer goes on with its next task (any tie order respects the dependencies:
    # a task starts strictly after the tasks it needs).
    return tuple(sorted(start, key=lambda t: (start[t], -t.stage, t.phase == "bwd", t.micro)))


def micro_ranges(batch_size: int, micro_batches: int) -> list[tuple[int, int]]:
    """Sample ranges ``[lo, hi)`` of the micro-batches (contiguous, sizes differ by at most one)."""
    out, lo = [], 0
    for n in local_batches(batch_size, [1.0 / micro_batches] * micro_batches):
        out.append((lo, lo + n))
        lo += n
    return out


def stage_of_group(pp: PipelinePlan, num_groups: int) -> list[int]:
    """Stage index of every op-group."""
    bounds = list(pp.stages) + [num_groups]
    return [s for s in range(len(pp.stages)) for _ in range(bounds[s], bounds[s + 1])]


def validate_pipeline(plan, graph, num_devices: int, *, source: str = "plan") -> None:
    """Raise :class:`PlanError` (one line naming the field) unless ``plan.pipeline`` is a valid
    pipeline of ``plan``'s groups (nothing to check without one)."""
    pp: PipelinePlan | None = plan.pipeline
    if pp is None:
        return
    from .strategy import strategy_of  # (strategy.py imports this module)

    where = f"{source}: pipeline"
    G = len(plan.groups)
    st = pp.stages
    if not st or st[0] != 0 or any(b <= a for a, b in zip(st, st[1:])) or st[-1] >= G:
        raise PlanError(f"{where}.stages: expected increasing first groups starting at 0 and below {G}, got {st}")
    if pp.schedule not in PIPELINE_SCHEDULES:
        raise PlanError(f"{where}.schedule: expected one of {list(PIPELINE_SCHEDULES)}, got {pp.schedule!r}")
    if not 1 <= pp.micro_batches <= plan.batch_size:
        raise PlanError(f"{where}.micro_batches: expected 1..{plan.batch_size} (the batch), got {pp.micro_batches}")
    if pp.schedule == "kfkb" and not 1 <= pp.k <= pp.micro_batches:
        raise PlanError(f"{where}.k: expected 1..{pp.micro_batches} (micro-batches per block), got {pp.k}")
    smallest = min(hi - lo for lo, hi in micro_ranges(plan.batch_size, pp.micro_batches))
    seen: dict[int, int] = {}
    bounds = list(st) + [G]
    for s in range(len(st)):
        first = plan.groups[bounds[s]]
        for g in range(bounds[s], bounds[s + 1]):
            gp = plan.groups[g]
            if strategy_of(gp).chunked:
                raise PlanError(f"{source}: groups[{g}].sync: a pipeline stage is data parallel (its groups run "
                                f"whole on each replica), got {gp.sync!r}")
            if gp.sfb:
                raise PlanError(f"{source}: groups[{g}].sfb: SFB is not available in a pipeline plan "
                                "(its factors would be gathered per micro-batch); expected []")
            if gp.devices != first.devices or [round(x, 9) for x in gp.shares] != [round(x, 9) for x in first.shares]:
                raise PlanError(f"{source}: groups[{g}]: every group of pipeline stage {s} must have the devices "
                                f"and shares of groups[{bounds[s]}] ({first.devices}, {first.shares})")
        for d in first.devices:
            if d in seen:
                raise PlanError(f"{where}.stages: device {d} is in stage {seen[d]} and stage {s}; "
                                "each stage needs its own devices")
            seen[d] = s
        # (the devices of a tensor-parallel group share one replica's samples: Strategy.width)
        replicas = max(len(gp.devices) // strategy_of(gp).width(gp) for gp in plan.groups[bounds[s]:bounds[s + 1]])
        if replicas > smallest:
            raise PlanError(f"{where}.micro_batches: stage {s} has {replicas} replicas but the smallest "
                            f"micro-batch has {smallest} samples; every replica needs at least one")


def bubble_fraction(num_stages: int, micro_batches: int) -> float:
    """Idle fraction of a balanced 1F1B / GPipe pipeline, ``(S - 1) / (M + S - 1)`` (a reference
    for tests and reports; the simulator times real, unbalanced stages)."""
    return (num_stages - 1) / (micro_batches + num_stages - 1)


def even_stages(num_groups: int, num_stages: int) -> list[int]:
    """First group of each of ``num_stages`` stages cutting ``num_groups`` groups evenly."""
    if not 1 <= num_stages <= num_groups:
        raise PlanError(f"pipeline: expected 1..{num_groups} stages (one group at least each), got {num_stages}")
    return [math.floor(s * num_groups / num_stages) for s in range(num_stages)]
