"""The memory account and the optimizer steps of one simulated iteration: what every device holds
and steps (:func:`holdings`, the tied weights' second copies :func:`hold_tied`), and the
:class:`~tag.sim.result.SimResult` of a finished run (:func:`iteration_result`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..parallel.sharded import sharded_bytes
from .program import PipelineProgram
from .result import SimResult
from .static import OPT
from .units import GroupData, Layout

if TYPE_CHECKING:
    from .engine import Simulator


class Holdings(NamedTuple):
    """Per device and per group, what the iteration holds and steps (:func:`holdings`)."""

    optimizer_s: list[float]
    """Per device: seconds of its optimizer step (its groups' updates)."""
    held_bytes: list[float]
    """Per device: bytes held for the whole iteration."""
    working_bytes: list[float]
    """Per device: the largest single op's working set (bytes)."""
    holds_params: list[bool]
    """Per device: it holds parameters (so it runs an optimizer step)."""
    group_compute_s: list[float]
    """Per group: compute seconds (summed over the replicas and a pipeline's micro-batches)."""


class IterationEnd(NamedTuple):
    """The end of a run (:func:`iteration_result`): per device its optimizer step's end
    (``final``), its compute stream's end before the step (``before``), the step's start, whether
    it holds parameters; and the result."""

    final: list[float]
    before: list[float]
    update_start: list[float]
    holds_params: list[bool]
    result: SimResult


def holdings(sim: Simulator, deployments: list[GroupData], program: PipelineProgram | None = None) -> Holdings:
    """The :class:`Holdings` of ``deployments`` (and the pipeline ``program``). A pipeline replica
    holds its stage's in-flight micro-batches' saved activations (the first, largest,
    micro-batch's size each; ``mem_per_sample``, a recomputed group's inputs: ``rc_per_sample``)
    besides what one run of the group holds."""
    if program is not None:
        return _pipeline_holdings(sim, program)
    n = sim.num_devices
    opt, mem, work = [0.0] * n, [0.0] * n, [0.0] * n
    holds = [False] * n
    group_compute = [0.0] * len(deployments)
    by_layout: dict[int, tuple[Layout, list[int]]] = {}
    for g, deployment in enumerate(deployments):
        lay = deployment.layout
        if lay is not None:
            entry = by_layout.get(id(lay))
            if entry is None:
                by_layout[id(lay)] = (lay, [g])
            else:
                entry[1].append(g)
            group_compute[g] += lay.gsum_l[g]
        else:
            for u in deployment.units:
                d = u.devices[0]
                opt[d] += u.dur[OPT]
                mem[d] += u.mem
                work[d] = max(work[d], u.work)
                holds[d] |= u.mem > 0
                group_compute[g] += sum(u.dur)
        if deployment.sfb is not None:
            group_compute[g] += sum(deployment.sfb.recompute)
    _hold_layouts(sim, by_layout.values(), opt, mem, work, holds)
    return Holdings(opt, mem, work, holds, group_compute)


def _hold_layouts(sim: Simulator, layouts, opt: list[float], mem: list[float], work: list[float],
                  holds: list[bool]) -> None:
    """Add the groups on each layout of ``layouts`` (``(layout, its groups)``) to the per-device
    optimizer seconds, held bytes, working sets and holds-parameters flags (in place)."""
    grad_bytes, grad_bytes_l = sim.static.grad_bytes, sim.static.grad_bytes_l
    add, maximum = np.add.reduce, np.maximum.reduce
    for lay, gs in layouts:
        devs = lay.devices
        if len(gs) >= 4:  # many groups on one layout: numpy over the [groups, replicas] block
            # (the ufuncs' reduce: what .sum() / .max() call, without their Python wrappers)
            o = add(lay.dur[OPT][gs], axis=0).tolist()
            m = add(lay.mem[gs], axis=0).tolist()
            w = maximum(lay.work[gs], axis=0).tolist()
            h = add(grad_bytes[gs]) > 0
            for r, d in enumerate(devs):
                opt[d] += o[r]
                mem[d] += m[r]
                if w[r] > work[d]:
                    work[d] = w[r]
                if h:
                    holds[d] = True
            continue
        for g in gs:
            h = grad_bytes_l[g] > 0
            _, _, o, m, w = lay.row(g)
            for r, d in enumerate(devs):
                opt[d] += o[r]
                mem[d] += m[r]
                if w[r] > work[d]:
                    work[d] = w[r]
                if h:
                    holds[d] = True


def _pipeline_holdings(sim: Simulator, program: PipelineProgram) -> Holdings:
    """:func:`holdings` of a pipeline: its first micro-batch's deployment, every micro-batch's
    compute, the in-flight micro-batches' saved activations and the tied weights' copies."""
    opt, mem, work, holds, _ = holdings(sim, program.deployments[0])
    # micro-batches of one size share one deployment (one list): its compute seconds once
    per_run: dict[int, list[float]] = {}
    for deployments in program.deployments:
        if id(deployments) not in per_run:
            per_run[id(deployments)] = holdings(sim, deployments).group_compute_s
    group_compute = [sum(x) for x in zip(*(per_run[id(d)] for d in program.deployments))]
    per_sample, rc_per_sample = sim.static.mem_per_sample, sim.static.rc_per_sample
    for stage, gs in enumerate(program.members):
        extra = program.flight[stage] - 1
        for g in gs:
            deployment = program.deployments[0][g]
            lay = deployment.layout
            if lay.saved is not None:  # (a tensor-parallel layout's, recomputed or not)
                for d, b in zip(lay.devices, lay.saved[g].tolist()):
                    mem[d] += extra * b
                continue
            ps = float(rc_per_sample[g] if deployment.recompute else per_sample[g])
            for d, b in zip(lay.devices, lay.batches):
                mem[d] += extra * ps * b
    hold_tied(sim, program, opt, mem, holds)
    return Holdings(opt, mem, work, holds, group_compute)


def hold_tied(sim: Simulator, program: PipelineProgram, opt: list[float], mem: list[float],
              holds: list[bool]) -> None:
    """The second copy of each tied weight (:attr:`PipelineProgram.tied`) on the replicas of its
    partial sum's group: the weight, its gradient and its optimizer state held, and its update,
    the owner group's update seconds on that device per parameter byte (in place). Where a
    stage's group is sharded (:attr:`PipelineProgram.tied_shards`) its copy is ZeRO-1 over the
    group's shard groups, as the executor holds it (:meth:`tag.executor.sharded.ShardedRank`) and
    Megatron-LM's distributed optimizer shards each stage's embedding over its data-parallel
    group: the weight and its all-reduced gradient whole (both stages read it, the all-reduce
    spans both), the optimizer state and the step over ``S``, then an all-gather of the updated
    weight (:func:`tag.parallel.sharded.sharded_bytes` at level 1). The owner's layout priced it
    as its own level's shards (1 / S of its step, ZeRO-1/2 its gather after it)."""
    deployments = program.deployments[0]
    shards = {s.tensor: s for s in program.tied_shards}
    comm = sim.comm
    for tw in sim.static.tied:
        if tw.tensor not in program.tied:
            continue
        g = tw.owner
        per_byte = tw.nbytes / float(sim.static.grad_bytes[g])
        p, o = tw.nbytes, tw.opt_state_bytes
        shard = shards.get(tw.tensor)
        level, s_own, s_read = (0, 1, 1) if shard is None else (shard.owner_level, shard.owner_shard,
                                                                  shard.reader_shard)
        readers = list(deployments[tw.grad_group].units[0].devices)
        gather = comm.shard_gather_time(readers, s_read, p) if s_read > 1 else 0.0
        for d in readers:
            mem[d] += sharded_bytes(1, s_read, p, o)
            opt[d] += float(sim.tables[sim.dev_class[d], g, OPT, 1]) * per_byte / s_read + gather
            holds[d] = True
        if level:
            owners = list(deployments[g].units[0].devices)
            gather = comm.shard_gather_time(owners, s_own, p) if level == 3 else 0.0  # (ZeRO-3's layout: none)
            for d in owners:
                mem[d] += sharded_bytes(1, s_own, p, o) - sharded_bytes(level, s_own, p, o)
                opt[d] += gather


def iteration_result(sim: Simulator, run, sync_end: list[float], held: Holdings) -> IterationEnd:
    """The optimizer step of every device holding parameters, then the :class:`SimResult` of the
    run's state (``compute_free_at``, ``compute_seconds``, ``comm_free_at``, ``comm_seconds``,
    ``buffer_bytes``, ``group_finish``; :class:`tag.sim.event_loop.Run`)."""
    opt, mem, work, holds, group_compute = held
    n = sim.num_devices
    before = list(run.compute_free_at)
    upd_start = [0.0] * n
    final = list(before)
    comp = run.compute_seconds
    for d in range(n):
        if holds[d]:
            s = max(before[d], sync_end[d])
            dur = opt[d] + sim.step_overhead[d]
            upd_start[d] = s
            final[d] = s + dur
            comp[d] += dur
    t_iter = max(max(final), max(run.comm_free_at))
    peak = [x + y + z for x, y, z in zip(mem, work, run.buffer_bytes)]
    cap = sim.capacity
    oom_devices = [(d, peak[d] - cap[d]) for d in range(n) if peak[d] > cap[d]]
    res = SimResult(
        iteration_time_s=t_iter, oom=bool(oom_devices), peak_memory_bytes=peak,
        memory_capacity_bytes=list(cap), oom_devices=oom_devices, compute_time_s=comp,
        comm_time_s=list(run.comm_seconds), idle_time_s=[t_iter - c for c in comp],
        group_finish_s=list(run.group_finish), group_compute_s=group_compute, device_names=list(sim.device_names))
    return IterationEnd(final, before, upd_start, holds, res)
