"""Ada-Grouper's adaptive kFkB replayed in the simulator over a shared network's background
(:mod:`tag.topology.background`): iterations run back to back, each starting where the last
ended on the background's clock (:attr:`Simulator.time_offset_s`), each measured as the
executor would measure it (the slowest stage's forward / backward seconds per micro-batch, the
seconds of the messages crossing a stage boundary per micro-batch and direction), and the next iteration's block size chosen
by :func:`tag.parallel.adaptive.choose_k` among those that fit the devices' memory."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..parallel.adaptive import choose_k
from ..parallel.pipeline import stage_of_group

_PAIR = re.compile(r" d(\d+)->d(\d+) ")


@dataclass(frozen=True)
class Iteration:
    """One replayed iteration."""

    k: int
    """Its kFkB block size."""
    start_s: float
    """Its start on the background's clock, seconds."""
    time_s: float
    """Its simulated seconds."""
    fwd_s: float
    bwd_s: float
    """The slowest stage's forward / backward seconds per micro-batch."""
    transfer_s: float
    """Seconds of the messages crossing a stage boundary per micro-batch and direction, on
    average (0 without a boundary)."""


def measure(plan, res) -> tuple[float, float, float]:
    """``(fwd_s, bwd_s, transfer_s)`` of a traced run ``res`` of the pipeline ``plan``."""
    pp = plan.pipeline
    stage_of = stage_of_group(pp, len(plan.groups))
    dev_stage = {d: stage_of[g] for g, gp in enumerate(plan.groups) for d in gp.devices}
    M = pp.micro_batches
    fwd, bwd = [0.0] * len(pp.stages), [0.0] * len(pp.stages)
    firsts = {plan.groups[g].devices[0]: s for s, g in enumerate(pp.stages)}
    crossing = []
    for e in res.events:
        if e.cat in ("fwd", "bwd") and e.device in firsts:
            (fwd if e.cat == "fwd" else bwd)[firsts[e.device]] += e.end - e.start
        elif e.cat == "transfer":
            m = _PAIR.search(e.name)
            if m and dev_stage.get(int(m[1])) != dev_stage.get(int(m[2])):
                crossing.append(e.end - e.start)
    # a boundary's messages of one micro-batch and direction go one after the other (one sending
    # machine side): their sum, averaged over the 2 (S - 1) M crossings
    crossings = 2 * (len(pp.stages) - 1) * M
    return max(fwd) / M, max(bwd) / M, (sum(crossing) / crossings if crossings else 0.0)


CANDIDATES = (1, 2, 4, 8)
"""Block sizes adaptive kFkB chooses among (those up to the micro-batches that fit)."""


def fitting_ks(sim, plan, candidates=CANDIDATES) -> list[int]:
    """The ``candidates`` up to ``plan``'s micro-batches whose kFkB iteration ``sim`` does not
    find out of memory (ascending)."""
    pp = plan.pipeline
    return [k for k in sorted(candidates) if k <= pp.micro_batches
            and not sim.run(plan.groups, pipeline=replace(pp, schedule="kfkb", k=k)).oom]


def replay(sim, plan, iterations: int, *, adaptive: bool = True, candidates=CANDIDATES) -> list[Iteration]:
    """``iterations`` iterations of ``plan`` (a pipeline; its schedule run as ``kfkb``) back to
    back over ``sim``'s topology background. ``adaptive``: iteration ``i + 1``'s block size is
    :func:`choose_k` of iteration ``i``'s measurements over the ``candidates`` that fit in memory
    (the first iteration runs the plan's own ``k``); otherwise every iteration runs the plan's."""
    pp = plan.pipeline
    M = pp.micro_batches
    sim.time_offset_s = 0.0
    fits = fitting_ks(sim, plan, candidates)
    out: list[Iteration] = []
    k, clock = pp.k if pp.schedule == "kfkb" else 1, 0.0
    try:
        for _ in range(iterations):
            sim.time_offset_s = clock
            run = replace(pp, schedule="kfkb", k=k)
            res = sim.run(plan.groups, pipeline=run, trace=True)
            f, b, x = measure(replace(plan, pipeline=run), res)
            out.append(Iteration(k, clock, res.iteration_time_s, f, b, x))
            clock += res.iteration_time_s
            if adaptive and fits:
                k = choose_k(len(pp.stages), M, fits, f, b, x).k
    finally:
        sim.time_offset_s = 0.0
    return out
