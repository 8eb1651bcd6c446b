"""Pipeline parallelism: op-groups cut into stages, the batch into micro-batches (pure, no torch).

A plan with :attr:`Plan.pipeline <tag.plan.Plan.pipeline>` (a :class:`~tag.plan.PipelinePlan`)
cuts its op-groups into ``S`` consecutive **stages** (``stages[s]`` is the first group of stage
``s``), each on its own device set: every group of a stage is deployed on the same devices with
the same shares (data parallel within the stage: ``allreduce`` or ``ps``). The global batch of
``B`` samples is cut into ``M`` **micro-batches** of contiguous samples (:func:`micro_ranges`);
each stage runs its forward and its backward once per micro-batch, in the order its **schedule**
gives, accumulating gradients; the gradient sync of a group starts after its last micro-batch's
backward (one sync per iteration, as without a pipeline).

A **schedule** is registered by name (:func:`register_schedule`, a :class:`PipelineSchedule`):
a function giving each stage's (phase, micro-batch) sequence. The built-ins are one family, the
kFkB schedules of Ada-Grouper (arXiv 2303.01675, :func:`stage_sequence`):

* ``kfkb`` with block size ``k``: micro-batches go in blocks of ``k``; stage ``s`` of ``S`` first
  runs ``min(S - 1 - s, G)`` blocks of forwards (``G = ceil(M / k)`` blocks), then alternates
  one forward block and one backward block, then runs the remaining backward blocks;
* ``1f1b`` (PipeDream-flush, Megatron's default): ``kfkb`` with ``k = 1``;
* ``gpipe`` (all forwards, then all backwards): ``kfkb`` with ``k = M``;
* ``interleaved`` (Megatron-LM's interleaved 1F1B, :func:`interleaved_sequence`): ``k`` is the
  number of **chunks** per device: the ``S = P k`` stages are virtual, stage ``j`` on the devices
  of stage ``j mod P``, and device ``p`` runs its ``k`` chunks' micro-batches interleaved (warm-up
  ``2 (P - 1 - p) + (k - 1) P`` forwards), so its bubble is ``1 / k`` of 1F1B's.

A larger ``k`` keeps more micro-batches' activations alive (:func:`in_flight`) but lets a stage
run ``k`` micro-batches back to back (fewer waits on slow links). :func:`pipeline_order` merges
the stages' sequences into the one global order every rank walks (any order consistent with
each stage's sequence and the data dependencies is deadlock-free under the schedule's rule: the
earliest unfinished step always has all its participants waiting on it).

:func:`iteration_program` is what every consumer reads (the simulator's event loop and bounds,
:func:`~tag.parallel.schedule.build_schedule`): micro-batch ranges, stage members, the global task
order and each stage's micro-batches in flight, whatever the schedule; none of them names one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, NamedTuple

from ..errors import PlanError
from ..plan.format import PipelinePlan, local_batches
from .registry import Registry

Phase = Literal["fwd", "bwd"]


StageSequence = list[tuple[Phase, int]]
"""A stage's tasks in the order it runs them: ``(phase, micro-batch)``."""


class Task(NamedTuple):
    """One stage running one phase of one micro-batch."""

    stage: int
    phase: Phase
    micro: int


def stage_sequence(stage: int, num_stages: int, micro_batches: int, k: int) -> StageSequence:
    """The (phase, micro-batch) sequence stage ``stage`` of ``num_stages`` runs under kFkB with
    blocks of ``k`` micro-batches (``k = 1``: 1F1B; ``k >= micro_batches``: GPipe)."""
    k = max(1, min(k, micro_batches))
    blocks = [range(lo, min(lo + k, micro_batches)) for lo in range(0, micro_batches, k)]
    warmup = min(num_stages - 1 - stage, len(blocks))
    seq: StageSequence = []
    for b in blocks[:warmup]:
        seq += [("fwd", m) for m in b]
    for j in range(len(blocks) - warmup):
        seq += [("fwd", m) for m in blocks[warmup + j]]
        seq += [("bwd", m) for m in blocks[j]]
    for b in blocks[len(blocks) - warmup:]:
        seq += [("bwd", m) for m in b]
    return seq


def in_flight(sequence: StageSequence) -> int:
    """The most micro-batches whose forward ran and whose backward did not yet (their saved
    activations are alive at once)."""
    live = peak = 0
    for phase, _ in sequence:
        live += 1 if phase == "fwd" else -1
        peak = max(peak, live)
    return peak


@dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule, selected by :attr:`PipelinePlan.schedule <tag.plan.PipelinePlan.schedule>`."""

    name: str
    sequence: Callable[[int, int, PipelinePlan], StageSequence]
    """``(stage, num_stages, pipeline) -> StageSequence``: every micro-batch's forward and backward
    exactly once each, the forward first (:func:`iteration_program` checks it, and that the
    stages' sequences can all run)."""
    blocks: bool = False
    """The schedule reads :attr:`PipelinePlan.k` (validated to ``1..micro_batches``, printed with
    the schedule's name); otherwise ``k`` is ignored."""
    searched: tuple[int, ...] = (1,)
    """Values of ``k`` the plan search tries, one option each (empty: the search never picks the
    schedule; plans and layouts may still name it)."""
    chunks: bool = False
    """``k`` is the number of chunks (virtual stages) per device: the plan's ``P k`` stages
    run on ``P`` device sets, stage ``j`` on stage ``j mod P``'s, and :attr:`sequence` gives
    device set ``p`` of ``P`` its ``(phase, micro-batch, chunk)`` sequence (chunk ``c``: stage
    ``c P + p``)."""


_SCHEDULES: Registry[PipelineSchedule] = Registry("pipeline schedule")
register_schedule = _SCHEDULES.register
unregister_schedule = _SCHEDULES.unregister
schedule_names = _SCHEDULES.names


def get_schedule(name: str, *, where: str = "pipeline.schedule") -> PipelineSchedule:
    """The schedule registered under ``name``; :class:`PlanError` naming ``where`` otherwise."""
    return _SCHEDULES.get(name, where=where)


def searched_schedules() -> list[tuple[str, int]]:
    """``(schedule, k)`` options the plan search tries: each registered schedule's
    :attr:`~PipelineSchedule.searched` values, in registration order."""
    return [(s.name, k) for s in _SCHEDULES.values() for k in s.searched]


def spell_schedule(name: str, k: int, form: str = ",k={k}") -> str:
    """``name``, followed by ``form`` with ``k`` where the schedule reads ``k`` (layouts, reports)."""
    s = _SCHEDULES.find(name)
    return name + (form.format(k=k) if s is not None and s.blocks else "")


register_schedule(PipelineSchedule("1f1b", lambda s, n, pp: stage_sequence(s, n, pp.micro_batches, 1)))
register_schedule(PipelineSchedule("gpipe", lambda s, n, pp: stage_sequence(s, n, pp.micro_batches, pp.micro_batches)))
register_schedule(PipelineSchedule("kfkb", lambda s, n, pp: stage_sequence(s, n, pp.micro_batches, pp.k),
                                   blocks=True, searched=(2,)))


def interleaved_sequence(device: int, num_devices: int, micro_batches: int, chunks: int) -> list[tuple[Phase, int, int]]:
    """The ``(phase, micro-batch, chunk)`` sequence device set ``device`` of ``num_devices`` runs
    under Megatron-LM's interleaved 1F1B with ``chunks`` chunks each
    (``megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving``):
    its ``M k`` forwards in groups of ``P`` micro-batches per chunk (forward ``i``: chunk
    ``(i // P) mod k``, micro-batch ``(i // (P k)) P + i mod P``), the backwards alike with the
    chunks reversed; ``min(2 (P - 1 - p) + (k - 1) P, M k)`` forwards of warm-up (all of them when
    ``M = P``; 1F1B's ``P - 1 - p`` when ``k = 1``), then one forward and one backward
    alternately, then the remaining backwards.
    Needs ``M`` a multiple of ``P`` (:func:`validate_pipeline`)."""
    P, k, M = num_devices, chunks, micro_batches
    total = M * k

    def task(i: int, phase: Phase) -> tuple[Phase, int, int]:
        c = (i % (P * k)) // P
        return phase, (i // (P * k)) * P + i % P, c if phase == "fwd" else k - 1 - c

    if k == 1:  # (1F1B's warm-up: Megatron-LM runs one chunk without this function)
        warm = min(P - 1 - device, total)
    else:
        warm = total if M == P else min(2 * (P - 1 - device) + (k - 1) * P, total)
    seq = [task(i, "fwd") for i in range(warm)]
    for i in range(total - warm):
        seq += [task(warm + i, "fwd"), task(i, "bwd")]
    return seq + [task(i, "bwd") for i in range(total - warm, total)]


register_schedule(PipelineSchedule("interleaved", lambda p, n, pp: interleaved_sequence(p, n, pp.micro_batches, pp.k),
                                   blocks=True, searched=(), chunks=True))


class IterationProgram(NamedTuple):
    """One iteration of a pipeline, as every consumer reads it (:func:`iteration_program`)."""

    ranges: list[tuple[int, int]]
    """Sample range ``[lo, hi)`` of each micro-batch."""
    stage_of: list[int]
    """Stage of every op-group."""
    members: list[range]
    """Op-groups of every stage (consecutive)."""
    sequences: tuple[tuple[tuple[Phase, int], ...], ...]
    """Every stage's (phase, micro-batch) sequence."""
    tasks: tuple[Task, ...]
    """Every stage's sequence merged into the one global order (:func:`pipeline_order`)."""
    flight: tuple[int, ...]
    """Micro-batches in flight on every stage (:func:`in_flight`)."""


def iteration_program(pp: PipelinePlan, batch_size: int, num_groups: int) -> IterationProgram:
    """The :class:`IterationProgram` of pipeline ``pp`` (its schedule looked up in the registry)
    on a batch of ``batch_size`` samples cut into ``num_groups`` op-groups. :class:`PlanError`
    (one line) if the schedule is not registered or its sequences are not a valid schedule."""
    sequences, tasks, flight = _program(get_schedule(pp.schedule), tuple(pp.stages), pp.micro_batches, pp.k)
    bounds = list(pp.stages) + [num_groups]
    return IterationProgram(micro_ranges(batch_size, pp.micro_batches), stage_of_group(pp, num_groups),
                            [range(bounds[s], bounds[s + 1]) for s in range(len(pp.stages))],
                            sequences, tasks, flight)


@lru_cache(maxsize=512)
def _program(schedule: PipelineSchedule, stages: tuple[int, ...], micro_batches: int, k: int):
    """(sequences, global order, in-flight counts) of ``schedule`` (cached: a search simulates
    the same few pipelines many times; a re-registered schedule is another key)."""
    num_stages = len(stages)
    pp = PipelinePlan(list(stages), micro_batches, schedule.name, k)
    where = f"pipeline.schedule: {schedule.name!r}"
    lanes = _lanes(schedule, num_stages, pp, where)
    want = sorted((p, m) for p in ("bwd", "fwd") for m in range(micro_batches))
    sequences = []
    for s in range(num_stages):
        seq = [(t.phase, t.micro) for lane in lanes for t in lane if t.stage == s]
        if sorted(seq) != want:
            raise PlanError(f"{where} gives stage {s} of {num_stages} the sequence {seq}; expected every "
                            f"micro-batch 0..{micro_batches - 1}'s fwd and bwd once each")
        at = {t: i for i, t in enumerate(seq)}
        late = next((m for m in range(micro_batches) if at[("bwd", m)] < at[("fwd", m)]), None)
        if late is not None:
            raise PlanError(f"{where} gives stage {s} of {num_stages} micro-batch {late}'s bwd before its fwd")
        sequences.append(tuple(seq))
    tasks = _order(tuple(tuple(lane) for lane in lanes), where)
    return tuple(sequences), tuple(tasks), tuple(in_flight(q) for q in sequences)


def _lanes(schedule: PipelineSchedule, num_stages: int, pp: PipelinePlan, where: str) -> list[list[Task]]:
    """Every device set's tasks in the order it runs them: one per stage, or with
    :attr:`PipelineSchedule.chunks` one per ``P = S / k`` device sets, its ``k`` stages' tasks
    interleaved."""
    if not schedule.chunks:
        return [[Task(s, p, int(m)) for p, m in schedule.sequence(s, num_stages, pp)] for s in range(num_stages)]
    P = num_stages // pp.k
    lanes = []
    for d in range(P):
        lane = [Task(int(c) * P + d, p, int(m)) for p, m, c in schedule.sequence(d, P, pp)]
        if any(not 0 <= t.stage < num_stages for t in lane):
            raise PlanError(f"{where} gives device set {d} of {P} a chunk outside 0..{pp.k - 1}")
        lanes.append(lane)
    return lanes


@lru_cache(maxsize=512)
def _order(lanes: tuple, where: str) -> tuple[Task, ...]:
    """:func:`lane_order` of ``lanes`` (cached: pipelines cut elsewhere, or of another schedule
    giving the same sequences, share it)."""
    return tuple(lane_order([list(x) for x in lanes], where=where))


def pipeline_order(sequences: list[StageSequence], fwd_s: float = 1.0, bwd_s: float = 2.0, *,
                   where: str = "pipeline") -> list[Task]:
    """Every stage's sequence (``sequences[s]``), each stage on devices of its own, merged into
    one global order (:func:`lane_order`)."""
    return lane_order([[Task(s, p, m) for p, m in q] for s, q in enumerate(sequences)], fwd_s, bwd_s, where=where)


def lane_order(lanes: list[list[Task]], fwd_s: float = 1.0, bwd_s: float = 2.0, *,
               where: str = "pipeline") -> list[Task]:
    """Every device set's tasks (``lanes[d]``, in the order it runs them; a stage's tasks all in
    one lane) merged into one global order.

    The order is that of start times when each forward takes ``fwd_s`` and each backward
    ``bwd_s`` (any positive durations give an order consistent with the dependencies:
    forward of stage ``s`` after forward of ``s - 1``, backward of ``s`` after backward of
    ``s + 1`` and after its own forward), ties broken by stage. Raises :class:`PlanError` if the
    lanes cannot all run (a lane waits on a task that waits on it).
    """
    num_lanes = len(lanes)
    num_stages = 1 + max((t.stage for q in lanes for t in q), default=-1)
    lane_of = {t.stage: d for d, q in enumerate(lanes) for t in q}
    end: dict[Task, float] = {}
    start: dict[Task, float] = {}
    pos = [0] * num_lanes
    free = [0.0] * num_lanes
    remaining = sum(len(q) for q in lanes)
    # A task's start is a function of the tasks it needs (the lane's previous one, its inputs),
    # not of the order lanes are visited in: each lane runs on until it waits, and a lane is
    # visited again only when a neighbour ran a task it may wait on (not all lanes per sweep).
    todo, queued = list(range(num_lanes - 1, -1, -1)), [True] * num_lanes
    while todo:
        d = todo.pop()
        queued[d] = False
        q = lanes[d]
        while pos[d] < len(q):
            t = q[pos[d]]
            s, m = t.stage, t.micro
            if t.phase == "fwd":
                deps = [Task(s - 1, "fwd", m)] if s > 0 else []
            else:
                deps = [Task(s, "fwd", m)] + ([Task(s + 1, "bwd", m)] if s + 1 < num_stages else [])
            if any(x not in end for x in deps):
                break
            start[t] = max([free[d]] + [end[x] for x in deps])
            end[t] = free[d] = start[t] + (fwd_s if t.phase == "fwd" else bwd_s)
            pos[d] += 1
            remaining -= 1
            nxt = lane_of.get(s + 1 if t.phase == "fwd" else s - 1)  # the lane that may wait on this task
            if nxt is not None and not queued[nxt]:
                queued[nxt] = True
                todo.append(nxt)
    if remaining:
        stuck = {d: tuple(lanes[d][pos[d]])[1:] if num_stages == num_lanes else lanes[d][pos[d]]
                 for d in range(num_lanes) if pos[d] < len(lanes[d])}
        raise PlanError(f"{where}: the stage sequences deadlock ({num_stages} stages; the next task "
                        f"of each unfinished stage waits on another: {stuck})")
    # Ties go to the later stage first: a stage's input then moves as soon as it was computed,
    # before its producer goes on with its next task (any tie order respects the dependencies:
    # a task starts strictly after the tasks it needs).
    return sorted(start, key=lambda t: (start[t], -t.stage, t.phase == "bwd", t.micro))


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
    schedule = get_schedule(pp.schedule, where=f"{where}.schedule")
    if not 1 <= pp.micro_batches <= plan.batch_size:
        raise PlanError(f"{where}.micro_batches: expected 1..{plan.batch_size} (the batch), got {pp.micro_batches}")
    if schedule.chunks:
        if not 1 <= pp.k <= len(st) or len(st) % pp.k:
            raise PlanError(f"{where}.k: expected a divisor of the {len(st)} stages (chunks per device), got {pp.k}")
        if pp.micro_batches % (len(st) // pp.k):
            raise PlanError(f"{where}.micro_batches: {pp.schedule} needs a multiple of its {len(st) // pp.k} "
                            f"device sets, got {pp.micro_batches}")
    elif schedule.blocks and not 1 <= pp.k <= pp.micro_batches:
        raise PlanError(f"{where}.k: expected 1..{pp.micro_batches} (micro-batches per block), got {pp.k}")
    try:  # (the schedule's sequences are valid and can run)
        iteration_program(pp, plan.batch_size, G)
    except PlanError as e:
        raise PlanError(f"{source}: {e}") from None
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
        home = s % (len(st) // pp.k) if schedule.chunks else s  # the stage whose devices it runs on
        if home != s and first.devices != plan.groups[bounds[home]].devices:
            raise PlanError(f"{source}: groups[{bounds[s]}]: {pp.schedule} runs stage {s} on the devices of "
                            f"stage {home} ({plan.groups[bounds[home]].devices}), got {first.devices}")
        for d in first.devices if home == s else ():
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
