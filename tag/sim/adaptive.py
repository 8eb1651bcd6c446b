"""Ada-Grouper's adaptive kFkB replayed in the simulator over a shared network's background
(:mod:`tag.topology.background`): iterations run back to back, each starting where the last
ended on the background's clock (:attr:`Simulator.time_offset_s`), each measured as the
executor would measure it (the slowest stage's forward / backward seconds per micro-batch, the
seconds of the messages crossing a stage boundary per micro-batch and direction), and the next iteration's block size chosen
by :func:`tag.parallel.adaptive.choose_k` among those that fit the devices' memory. Where the
devices' costs hold an eager host apart (a GPU rule, :meth:`tag.cost.CostModel.host_parts`) the
rule also gets the stages' host seconds (:func:`host_seconds`), so it foresees host-bound stages,
whose kFkB blocks the simulator runs slower than 1F1B."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np

from ..parallel.adaptive import HostSeconds, choose_k
from ..parallel.pipeline import micro_ranges, stage_of_group
from .static import BWD, FWD

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
    fwd_s: float | list[float]
    bwd_s: float | list[float]
    """The slowest stage's forward / backward seconds per micro-batch (per stage, the device's
    seconds, where a host is apart: :func:`host_seconds`)."""
    transfer_s: float
    """Seconds of the messages crossing a stage boundary per micro-batch and direction, on
    average (0 without a boundary)."""
    host: list[HostSeconds] | None = None
    """Each stage's host seconds (:func:`host_seconds`), None where no host is apart."""


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
            m = _PAIR.search(e.name)  # (the trace holds a message on its sender and its receiver: once)
            if m and e.device == int(m[1]) and dev_stage.get(int(m[1])) != dev_stage.get(int(m[2])):
                crossing.append(e.end - e.start)
    # a boundary's messages of one micro-batch and direction go one after the other (one sending
    # machine side): their sum, averaged over the 2 (S - 1) M crossings
    crossings = 2 * (len(pp.stages) - 1) * M
    return max(fwd) / M, max(bwd) / M, (sum(crossing) / crossings if crossings else 0.0)


def host_seconds(sim, plan) -> tuple[list[float], list[float], list[HostSeconds]] | None:
    """``(fwd_s, bwd_s, host)`` per stage of the pipeline ``plan`` where ``sim``'s costs hold the
    eager host apart: per micro-batch, the device's forward / backward seconds and the host's
    (:class:`HostSeconds`), the largest over the stage's replicas, each phase's groups composed in
    the order the host issues them (group ``j`` of a phase ending at ``max(F + g_j, H + g_j +
    lag_j)``, so the stage's lag is ``max_j(H_<j - G_<j + lag_j)`` over its host and device seconds
    before ``j``, as :meth:`tag.sim.engine._Run._hosted`). These come from the cost model, not the
    trace: a traced stage's span holds its wait on its host. A micro-batch after the first (no
    parameter casts: :meth:`Simulator.warm_layout`). None where a stage's layout holds no host
    (CPU ranks, measured profiles) or a group runs position chunks (``mp``)."""
    pp = plan.pipeline
    lo, hi = micro_ranges(sim.static.batch_size, pp.micro_batches)[min(1, pp.micro_batches - 1)]
    bounds = [*pp.stages, len(plan.groups)]
    fwd, bwd, host = [], [], []
    for s in range(len(pp.stages)):
        lays = [sim.group_data(g, plan.groups[g], batch=hi - lo).layout for g in range(bounds[s], bounds[s + 1])]
        if any(lay is None or lay.host is None for lay in lays):
            return None
        if sim.any_casts and pp.micro_batches > 1:
            lays = [sim.warm_layout(lay) for lay in lays]
        parts = []  # (device, host, lag) seconds of the forward, then the backward
        for ph in (FWD, BWD):
            order = range(len(lays)) if ph == FWD else range(len(lays) - 1, -1, -1)
            dev = hst = 0.0
            lag = None
            for j in order:
                g = bounds[s] + j
                d, h, la = lays[j].dur[ph, g], lays[j].host[ph, g], lays[j].lag[ph, g]  # [R] each
                lag = hst - dev + la if lag is None else np.maximum(lag, hst - dev + la)
                dev, hst = dev + d, hst + h
            parts.append([float(np.max(v)) for v in (dev, hst, lag)])
        (f, hf, lf), (b, hb, lb) = parts
        fwd.append(f)
        bwd.append(b)
        host.append(HostSeconds(hf, hb, max(lf, 0.0), max(lb, 0.0)))
    return fwd, bwd, host


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
    hosted = host_seconds(sim, plan)
    try:
        for _ in range(iterations):
            sim.time_offset_s = clock
            run = replace(pp, schedule="kfkb", k=k)
            res = sim.run(plan.groups, pipeline=run, trace=True)
            f, b, x = measure(replace(plan, pipeline=run), res)
            host = None
            if hosted is not None:
                f, b, host = hosted
            out.append(Iteration(k, clock, res.iteration_time_s, f, b, x, host))
            clock += res.iteration_time_s
            if adaptive and fits:
                k = choose_k(len(pp.stages), M, fits, f, b, x, host=host).k
    finally:
        sim.time_offset_s = 0.0
    return out
