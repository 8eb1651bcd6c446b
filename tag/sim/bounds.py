"""Static lower bounds of what :meth:`Simulator.run <tag.sim.engine.Simulator.run>` reports for a
plan, without running the event loop: what the layout grid's branch and bound
(:func:`tag.parallel.layout.best_layout`) prunes with.

:func:`static_bound` reads the plan and the simulator's per-graph tables only (no deployment
costed: milliseconds at 512 devices); :func:`plan_bound` reads the simulator's own deployment of the plan (:meth:`Simulator.deploy`, and for a
pipeline :func:`tag.sim.program.build_program`: every group at each micro-batch's size, cached and reused by
the run that may follow), so they hold by construction of the event loop
(:mod:`tag.sim.engine`):

* **memory**: a device's peak is ``held + working set + transfer buffers``
  (``holdings.iteration_result``); ``held`` and the working set are what ``holdings.holdings`` computes from
  the deployment (parameters, gradients, optimizer state, buffers, saved activations, a pipeline's
  in-flight micro-batches), the buffers are at least 0. ``held + working set`` above a device's
  capacity: the run reports the plan out of memory.
* **time**: a device's compute tasks never overlap (each starts at or after the device's
  ``compute_free_at`` and moves it to its end, ``Run._phase``) and last at least their seconds (a wake
  penalty only adds), and its optimizer step (its held groups' optimizer seconds plus the step
  overhead) starts after them (``holdings.iteration_result``). So the iteration takes at least, on every
  device, the forward and backward seconds of every run (micro-batch) of every unit on it, plus
  its optimizer step; in a pipeline, a stage's devices start no earlier than micro-batch 0 went
  forward through the stages before it, and the iteration ends no earlier than micro-batch
  M - 1 went backward through them after a replica of the stage finished (where the stage
  boundaries provably carry that tensor: :func:`_pipeline_waits`), and a stage's micro-batch
  M - 1 backward starts no earlier than the stage after it finished that backward on a replica
  (the drain: its gradient is sent once the sender finished); a device's gradient
  collectives run one after another on its links (``Run._syncs``), each after its groups' last
  backward, which ends no earlier than the device's tasks up to it nor than the drain into its
  stage plus the last backwards from the group on (:func:`_sync_chain`), and its
  optimizer step after the last; a transfer is a rendezvous holding both ends' compute streams
  (``Run._transfer``), so a device's compute, transfers and optimizer step add up, a transfer
  taking at least its bytes over the link's bandwidth (packed messages pay one latency), as do
  the all-gathers of pieces scattered into a tensor-parallel group (``Run._scatter_gather``,
  at least one all-gather of all of a group's chunks: :func:`_transfer_load`); and a
  machine's outgoing (incoming) network side serves its transfers out (in), then the syncs
  spanning it (:func:`_transfer_load`). Latencies, other waits and the rest of the bubbles are
  left out (>= 0).

:func:`static_bound` counts a subset of the same terms, each as the simulator computes it from
its tables (:mod:`tag.sim.units`, :mod:`tag.sim.tensor_parallel`): per device, the forward and
backward seconds of its groups' cost tables at its batch of each micro-batch (a tensor-parallel
device's at ``1 / T`` of its replica's samples, or its token shard; the forward again under
recomputation), without the tensor-parallel collectives and the plain variant's outside ops at
the group's batch, the optimizer step or the wake penalty; and the bytes a group holds for good
(parameters, gradients, optimizer state, buffers, the saved or, recomputed, input tensors' fixed
bytes; less the ``1 - 1/T`` of the split parameters' state a tensor-parallel device drops) plus
its per-sample saved bytes at its first micro-batch's samples times the stage's micro-batches in
flight, and the largest single-op working set, without what the plain variant holds at the
group's batch beyond ``1 / T`` of it, the recomputed values' working set and the transfer buffers.
Groups split into position chunks (``mp``) count nothing. A pipeline's fill and drain (micro-batch
0's forward through the stages before a stage, M - 1's backward back through them) at these
seconds, where :func:`plan_bound` counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..graph.ir import Phase
from .holdings import holdings
from .program import build_program
from .sharded import low_gathers
from .static import BWD, FWD
from .tensor_parallel import outside_work
from .units import ARRAY_BYTES, ENTRY_BYTES, TemplateFlow


@dataclass(frozen=True)
class PlanBound:
    """Lower bounds of one plan's simulation."""

    time_s: float
    """The iteration takes at least this (seconds)."""
    peak_bytes: list[float]
    """Per device, its peak memory is at least this."""
    oom: bool
    """True: some device's ``peak_bytes`` exceeds its capacity, so the simulator reports the plan
    out of memory (False says nothing)."""


def static_bound(sim, groups, pipeline=None) -> PlanBound:
    """:class:`PlanBound` of the deployment ``groups`` (and ``pipeline``) on ``sim`` from its
    tables alone (module docstring); at most :func:`plan_bound`'s."""
    from ..parallel.pipeline import iteration_program
    from ..parallel.strategy import strategy_of

    st, graph, n = sim.static, sim.graph, sim.num_devices
    state_graph = _state_graph(sim)
    prog = None if pipeline is None else iteration_program(pipeline, st.batch_size, len(groups))
    sizes = [st.batch_size] if prog is None else [hi - lo for lo, hi in prog.ranges]
    runs = {x: sizes.count(x) for x in sizes}  # micro-batch samples -> micro-batches of that size (first size first)
    flight = [1] * len(groups) if prog is None else [prog.flight[s] for s in prog.stage_of]
    stage_of = [0] * len(groups) if prog is None else prog.stage_of
    busy, held, work = np.zeros(n), np.zeros(n), np.zeros(n)
    launch = np.zeros(n)  # a device's host seconds issuing its stages (Simulator.hosts): the host issues them in turn
    # per stage: its devices' forward seconds at the first micro-batch, backward (and recomputed
    # forward) at the last, and whether every group of it was counted on the same replicas
    fwd0, bwd1 = {}, {}
    whole = [True] * (1 if prog is None else len(prog.members))
    # groups deployed alike (devices, shares, strategy, degree, variant, recomputation, stage): lowered once
    alike: dict[tuple, list[int]] = {}
    kinds = sim.cache("bound-kinds")  # (devices, samples per device) -> np.unique's rows of them
    for g, gp in enumerate(groups):
        alike.setdefault((tuple(gp.devices), tuple(gp.shares), gp.sync, gp.tp, gp.sequence_parallel, gp.recompute,
                          flight[g], stage_of[g]), []).append(g)
    for (devs, _, _, _, _, rc, fl, stage), gs in alike.items():
        gp = groups[gs[0]]
        strategy = strategy_of(gp)
        if strategy.chunked:
            whole[stage] = False
            continue
        w = strategy.width(gp)  # devices computing one sample range (plain tensor parallel: its degree)
        dev = np.asarray(devs, dtype=np.int64)
        cls = np.asarray([sim.dev_class[d] for d in devs], dtype=np.int64)
        gi = np.asarray(gs, dtype=np.int64)
        fixed = (st.rc_fixed if rc else st.mem_fixed)[gi].sum()
        fixed -= strategy.unheld_state_bytes(gp, state_graph, gs)  # e.g. tensor parallel's split state
        if strategy.casts_per_use:  # ZeRO-3's weight copies: made per use, not held (tag.sim.sharded)
            fixed -= (st.rc_casts if rc else st.saved_casts)[gi].sum()
        ps = (st.rc_per_sample if rc else st.mem_per_sample)[gi].sum()
        for m, (size, times) in enumerate(runs.items()):
            b = np.asarray(strategy.units(gs[0], gp, graph, size)[0].batches, dtype=float)  # per device
            if w > 1:  # a device computes 1 / w of its replica's samples
                small, big = b / w, b
            else:
                small = big = b
            # one row per distinct (device class, samples): [U] then back to the devices (a function
            # of the devices and their samples: cached, the grid and the plan head ask for few)
            samples_key = (devs, small.tobytes())
            hit = kinds.get(samples_key)
            if hit is None:
                pairs, back = np.unique(np.stack([cls.astype(float), small]), axis=1, return_inverse=True)
                hit = kinds[samples_key] = (pairs[0].astype(np.int64), pairs[1], np.ravel(back))
                sim.charge(sum(x.nbytes + ARRAY_BYTES for x in hit) + small.nbytes + 8 * len(devs) + ENTRY_BYTES)
            ucls, ux, back = hit
            lo = np.floor(ux).astype(np.int64)
            f = (ux - lo)[:, None]
            hi = np.minimum(lo + 1, sim.tables.shape[-1] - 1)  # (the last batch column)
            c, g2 = ucls[:, None], gi[None, :]
            fwd = (1.0 - f) * sim.tables[c, g2, FWD, lo[:, None]] + f * sim.tables[c, g2, FWD, hi[:, None]]
            bwd = (1.0 - f) * sim.tables[c, g2, BWD, lo[:, None]] + f * sim.tables[c, g2, BWD, hi[:, None]]
            fs, bs = fwd.sum(axis=1), bwd.sum(axis=1)
            if sim.hosts is not None:  # every micro-batch's launches but the forwards' casts (twice recomputed)
                hs = sim.hosts[0]
                hf = ((1.0 - f) * hs[c, g2, FWD, lo[:, None]] + f * hs[c, g2, FWD, hi[:, None]]).sum(axis=1)
                hb = ((1.0 - f) * hs[c, g2, BWD, lo[:, None]] + f * hs[c, g2, BWD, hi[:, None]]).sum(axis=1)
                if sim.cast_hosts is not None:
                    hf = hf - sim.cast_hosts[c, g2].sum(axis=1)
                np.add.at(launch, dev, (hf * (2.0 if rc else 1.0) + hb)[back] * times)
            # the forwards' parameter casts: once per iteration, at the first micro-batch, not recomputed
            cs = sim.casts[c, g2].sum(axis=1) if sim.any_casts else np.zeros(len(ucls))
            secs = fs * (2.0 if rc else 1.0) + bs - (cs if rc else 0.0)  # [U]: fwd + bwd (+ fwd again)
            if strategy.casts_per_use and sim.any_casts:  # ZeRO-3: the casts its low-precision gathers make needless
                secs = secs - (sim.casts[c, g2] * low_gathers(sim)[2][g2]).sum(axis=1)
            secs = secs[back]  # [R]
            np.add.at(busy, dev, secs * times - cs[back] * (times - (m == 0)))
            if prog is not None:
                unit = strategy.units(gs[0], gp, graph, size)[0]
                if list(unit.devices) != list(devs) or min(unit.batches) < 1:
                    whole[stage] = False
                if size == sizes[0]:
                    np.add.at(fwd0.setdefault(stage, np.zeros(n)), dev, fs[back])
                if size == sizes[-1]:
                    np.add.at(bwd1.setdefault(stage, np.zeros(n)), dev, (bs + fs - cs if rc else bs)[back])
            if m == 0:  # held at the first micro-batch's samples (the simulator's rule)
                np.add.at(held, dev, fixed + ps * small * fl)
                # the largest op's working set at the device's samples; plain tensor parallelism's
                # ops outside the Megatron blocks at its group's (tag.sim.tensor_parallel.tp_layout)
                ws = (st.work_fixed[gi][None, :] + st.work_per_sample[gi][None, :] * small[:, None]).max(axis=1)
                if w > 1 and not gp.sequence_parallel:
                    out_w = outside_work(graph)[gi]  # [G, 2] (fixed, per-sample) bytes
                    ws = np.maximum(ws, (out_w[None, :, 0] + out_w[None, :, 1] * big[:, None]).max(axis=1))
                np.maximum.at(work, dev, ws)  # (not w: the width the later micro-batch sizes read)
    peak = (held + work).tolist()
    # a stage ends no earlier than its host issued it (tag.cost.gpu.StageParts.lag >= its host seconds),
    # and the host issues a device's stages one after the other from the start (not after the fill)
    low = max(float(busy.max()), float(launch.max()))
    if prog is not None:  # the fill and drain of the pipeline (_pipeline_waits), at these seconds
        lows = []  # per stage, per replica: forward, backward seconds, devices (None: not counted)
        for s, gs in enumerate(prog.members):
            devs = np.asarray(groups[gs[0]].devices, dtype=np.int64)
            same = all(groups[g].devices == groups[gs[0]].devices for g in gs)
            lows.append((fwd0[s][devs], bwd1[s][devs], devs) if whole[s] and same else None)
        for devs, before, after in _chain(st, pipeline, prog.sequences, lows):
            low = max(low, before + float(busy[devs].min()) + after)
    return PlanBound(low * (1.0 - 1e-9), peak, any(p > c * (1.0 + 1e-9) for p, c in zip(peak, sim.capacity)))


def _state_graph(sim):
    """``sim.graph`` with each parameter in the op-group whose state the simulator counts it in
    (the group whose backward makes its gradient, :attr:`GraphStatic.static_pos
    <tag.sim.static.GraphStatic.static_pos>`: a layer norm's parameters may sit with the group
    before theirs), for :meth:`Strategy.unheld_state_bytes <tag.parallel.Strategy.unheld_state_bytes>`
    to take from :func:`static_bound`'s held bytes the state they were counted in (one of GPT-2's
    sharded pipeline stages was bounded 256 bytes of state above its simulated peak); cached.
    The graph itself where no parameter moves."""
    import copy
    from dataclasses import replace

    from ..graph.gradients import param_groups

    memo = sim.cache("bound-state-graph")
    hit = memo.get("graph")
    if hit is None:
        graph = sim.graph
        moved = [p if g == p.group else replace(p, group=g) for p, g in zip(graph.params, param_groups(graph))]
        hit = graph
        if any(a is not b for a, b in zip(moved, graph.params)):
            hit = copy.copy(graph)
            hit.params = moved
        memo["graph"] = hit
    return hit


def plan_bound(sim, groups, pipeline=None) -> PlanBound:
    """:class:`PlanBound` of the deployment ``groups`` (and ``pipeline``) on ``sim`` (a
    :class:`~tag.sim.Simulator`), in the simulator's units."""
    sim.fit_caches()
    program = None if pipeline is None else build_program(sim, groups, pipeline)
    deployments = sim.deploy(groups)  # (a pipeline's gradient syncs: at the full batch's deployment)
    # (the optimizer step as the run computes it: a pipeline's at its first micro-batch's deployment)
    opt, mem, work, holds, _ = holdings(sim, deployments, program)
    n = sim.num_devices
    busy = _busy(sim, deployments, program)
    step = np.asarray(opt) + np.where(holds, sim.step_overhead, 0.0)
    low = busy + step
    first = np.zeros(n)  # per device: its first task starts no earlier (seconds)
    arrive = np.zeros(n)  # per device: its last micro-batch's backward starts no earlier (seconds)
    if program is not None:  # the pipeline's fill before a stage and drain after it
        for devs, before, after, into in _pipeline_waits(sim, program, pipeline, busy):
            first[devs] = before
            arrive[devs] = into
            low[devs] += before
            # the stage before runs micro-batch M - 1's backward after a replica of this one ran
            # all its tasks (its last is that backward)
            low[devs] = np.maximum(low[devs], before + busy[devs].min() + after)
    # a device's gradient collectives run one after another on its links (Run._syncs), each after
    # its groups' last backward; the optimizer step after the last
    comm = _sync_chain(sim, deployments, program, first + busy, arrive)
    low = np.maximum(low, comm + step)
    # a transfer holds both ends' compute streams (a rendezvous, Run._transfer): a device's
    # compute, its transfers and its optimizer step one after another; a machine's network side
    # serves its transfers, then the syncs spanning it (Run._syncs starts them after it is free)
    load, out, into = _transfer_load(sim, deployments, program)
    nic = np.maximum(out, into)
    for _, job in sim.sync_jobs(deployments, frozenset() if program is None else program.tied):
        nic[list(job.sync_machines)] += job.sync_time
    low = np.maximum(low, busy + load + step)
    if sim.hosts is not None:  # the host issues a device's stages one after another, each ending no earlier
        low = np.maximum(low, _busy(sim, deployments, program, host=True) + step)
    peak = [m + w for m, w in zip(mem, work)]
    # (1 - 1e-9): the event loop sums the same seconds in another order (running sums), so a
    # bound equal to the run's time may differ from it in the last bits
    return PlanBound(max(float(low.max()), float(comm.max()), float(nic.max(initial=0.0))) * (1.0 - 1e-9), peak,
                     any(p > c * (1.0 + 1e-9) for p, c in zip(peak, sim.capacity)))


def _busy(sim, deployments, program, host: bool = False) -> np.ndarray:
    """Per device: the seconds of its compute tasks (every run's forward and backward of every
    unit on it; a pipeline's micro-batches of one size share one deployment: counted once, times
    their number); ``host``: its host's seconds issuing them (:attr:`Layout.host
    <tag.sim.units.Layout.host>`, 0 where none is held apart)."""
    busy = np.zeros(sim.num_devices)
    runs: dict[int, list] = {}
    for per_micro in (deployments,) if program is None else program.deployments:
        runs.setdefault(id(per_micro), [per_micro, 0])[1] += 1
    for run, times in runs.values():
        alike: dict[int, tuple] = {}  # groups on one layout: summed over them at once
        for g, deployment in enumerate(run):
            lay = deployment.layout
            if lay is not None:  # every replica runs the group's forward and backward once
                alike.setdefault(id(lay), (lay, []))[1].append(g)
            else:  # position chunks, one device each
                for u in deployment.units:
                    x = u.dur if not host else u.host or (0.0, 0.0)
                    busy[u.devices[0]] += (x[FWD] + x[BWD]) * times
        for lay, gs in alike.values():
            x = lay.dur if not host else lay.host
            if x is not None:
                np.add.at(busy, lay.dev_arr, (x[FWD, gs] + x[BWD, gs]).sum(axis=0) * times)
    return busy


def _transfer_load(sim, deployments, program) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per device, per machine's outgoing and incoming network side: seconds of the run's
    transfers at least. The run moves the flows of the pairs :class:`~tag.sim.event_loop.Run` takes
    (per micro-batch; those moving once at the first and last), a stage's flows from one device to
    another packed into one message of ``latency + bytes / bandwidth`` (:func:`tag.sim.flows.pack_messages`):
    at least each flow's ``bytes / bandwidth``, on its receiver and on a CPU sender (a GPU rank
    sending in a step where it receives nothing computes on). A device's load also counts the all-gathers
    completing pieces scattered into its tensor-parallel group (``Run._scatter_gather``, which
    holds its compute stream as a transfer does): the run all-gathers a set's chunks once per
    stage and micro-batch, at least as long as one all-gather of all of them summed (the
    all-gather time, :meth:`tag.cost.comm.CommModel.allgather_time` on one machine, ring or
    fitted, is subadditive: a sum of ``max`` or ``sum - min`` of chunks plus a latency term
    paid once; 2026-11-27)."""
    n, m = sim.num_devices, sim.num_machines
    load, out, into = np.zeros(n), np.zeros(m), np.zeros(m)
    gathered: dict[tuple[int, ...], np.ndarray] = {}  # a holder set's devices -> its chunks, summed
    if program is None:
        pairs = [(template, 1) for template in sim.templates_used(deployments)]
    elif len(program.deployments) == 1:
        pairs = [(template, 1) for template in sim.templates_used(program.deployments[0], program.select("all"))]
    else:  # micro-batches of one size share one deployment (one list): its pairs once, times their count
        runs: dict[int, list] = {}
        for per_micro in program.deployments:
            runs.setdefault(id(per_micro), [per_micro, 0])[1] += 1
        pairs = [(template, c) for per_micro, c in runs.values() for template in sim.templates_used(per_micro, program.select("micro"))]
        pairs += [(template, 1) for template in sim.templates_used(program.deployments[0], program.select("first"))]
        pairs += [(template, 1) for template in sim.templates_used(program.deployments[-1], program.select("last"))]
    cache = sim.cache("transfer-load")
    shared = np.asarray(sim.shared_stream, dtype=float)
    for template, c in pairs:
        hit = cache.get(id(template))
        if hit is None or hit.template is not template:
            hit = cache[id(template)] = _transfer_arrays(sim, template)
            sim.charge(hit.nbytes + ENTRY_BYTES)
        a, b, secs, ma, mb, xs = hit.src, hit.dst, hit.seconds, hit.out_machines, hit.in_machines, hit.crossing_seconds
        # (a GPU sender may compute on while its sends go: only a CPU sender's stream is held)
        np.add.at(load, a, secs * c * shared[a])
        np.add.at(load, b, secs * c)
        np.add.at(out, ma, xs * c)
        np.add.at(into, mb, xs * c)
        for _, sets in template.gathers:
            for _lo, _hi, devs, chunks in sets:
                acc = gathered.get(devs)
                gathered[devs] = np.asarray(chunks) * c if acc is None else acc + np.asarray(chunks) * c
    for devs, chunks in gathered.items():
        load[list(devs)] += sim.scatter_gather_time(devs, tuple(chunks.tolist()))
    return load, out, into


class _TransferArrays(NamedTuple):
    """A pair template's flows as arrays (:func:`_transfer_load`): per flow its source and
    destination devices and ``bytes / bandwidth`` seconds; per flow crossing machines its source's
    and destination's machines and those seconds."""

    template: object
    src: np.ndarray
    dst: np.ndarray
    seconds: np.ndarray
    out_machines: np.ndarray
    in_machines: np.ndarray
    crossing_seconds: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays and their headers."""
        arrays = (self.src, self.dst, self.seconds, self.out_machines, self.in_machines, self.crossing_seconds)
        return sum(x.nbytes + ARRAY_BYTES for x in arrays)


def _transfer_arrays(sim, template) -> _TransferArrays:
    flows = TemplateFlow._make(np.asarray(column) for column in zip(*(f for _, fl in template.by_dst for f in fl)))
    a, b = flows.src_device.astype(np.int64), flows.dst_device.astype(np.int64)
    secs = flows.nbytes.astype(float) / sim.comm.bandwidth[a, b]
    ma, mb = flows.src_machine.astype(np.int64), flows.dst_machine.astype(np.int64)
    cross = ma >= 0
    return _TransferArrays(template, a, b, secs, ma[cross], mb[cross], secs[cross])


def _sync_chain(sim, deployments, program, done: np.ndarray, arrive: np.ndarray | None = None) -> np.ndarray:
    """Per device: its gradient collectives end no earlier than this (seconds). ``done``: per
    device, its compute tasks start no earlier than its ``first`` and last their seconds at least,
    so the tasks up to one of them end no earlier than ``first`` plus their seconds (``done`` is
    ``first`` plus all of them). ``arrive``: per device, its last micro-batch's backward starts no
    earlier (a pipeline's drain, :func:`_pipeline_waits`; 0 where not counted).

    A device runs its groups' last backward (a pipeline's last micro-batch: its stage's sequence
    ends with it) in reverse group order after every other task of its, so group ``g``'s ends no
    earlier than ``done`` less the last backwards of the device's groups before ``g``, nor than
    ``arrive`` plus the last backwards of its groups from ``g`` on (they run one after another on
    its compute stream once the first started); its
    ``group_finish`` (the latest replica's) no earlier than the latest of its devices'. A sync
    starts after its groups' ``group_finish`` and after the device's previous sync
    (``Run._syncs``: one collective stream per device; a run of syncs over one member set chained)
    and lasts its seconds. Counted only where every group runs on a layout (no position chunks)
    and, in a pipeline, every device runs one stage whose sequence ends with its last micro-batch's
    backward; elsewhere the syncs' seconds summed per device."""
    n, k = sim.num_devices, len(deployments)
    last = deployments if program is None else program.deployments[-1]
    ready = np.zeros(k)  # per group: its last backward ends no earlier (seconds)
    if all(deployment.layout is not None for deployment in last) and (program is None or _one_stage_each(program, last, n)):
        before = np.zeros(n)  # per device: the last backwards of its groups before g
        for g, deployment in enumerate(last):
            lay = deployment.layout
            ready[g] = float((done[lay.dev_arr] - before[lay.dev_arr]).max())
            np.add.at(before, lay.dev_arr, lay.dur[BWD, g])
        if arrive is not None and arrive.any():
            since = arrive.copy()  # per device: arrive plus the last backwards of its groups from g on
            for g in range(k - 1, -1, -1):
                lay = last[g].layout
                np.add.at(since, lay.dev_arr, lay.dur[BWD, g])
                ready[g] = max(ready[g], float(since[lay.dev_arr].max()))
    end = np.zeros(n)
    for gs, job in sim.sync_jobs(deployments, frozenset() if program is None else program.tied):
        devs = list(job.sync_devices)
        end[devs] = np.maximum(end[devs], max(ready[g] for g in gs)) + job.sync_time
    return end


def _one_stage_each(program, last, n: int) -> bool:
    """True when every device runs the groups of one pipeline stage only and every stage's last
    task is its last micro-batch's backward."""
    stage = np.full(n, -1)
    for s, gs in enumerate(program.members):
        for g in gs:
            devs = last[g].layout.dev_arr
            if ((stage[devs] != -1) & (stage[devs] != s)).any():
                return False
            stage[devs] = s
    ends: dict[int, tuple[int, int]] = {}
    for s, ph, m in program.tasks:
        ends[s] = (ph, m)
    return all(x == (BWD, len(program.deployments) - 1) for x in ends.values())


def _pipeline_waits(sim, program, pipeline, busy: np.ndarray) -> list[tuple[np.ndarray, float, float, float]]:
    """Per stage ``(devices, before, after, into)``: a device of the stage starts its first task no
    earlier than ``before`` seconds (micro-batch 0's forward of the stages before it, each at its
    fastest replica), the iteration ends no earlier than ``after`` seconds (micro-batch
    M - 1's backward of those stages) after a replica of the stage finished its last, and the
    stage's micro-batch M - 1 backward starts no earlier than ``into`` seconds: the stage after
    it sends its gradient once the sender finished that backward, which is no earlier than the
    sender stage's ``into`` plus its backward's seconds (its fastest replica's) nor than its
    ``before`` plus its fewest compute seconds (``busy``: per device; the backward is its last task). Counted
    across a stage boundary only between disjoint devices where the boundary's groups exchange a per-micro-batch tensor both ways (the last group of the stage before feeds
    the first group of the stage after in the forward, and that group's backward feeds it back),
    every replica of both runs samples of those micro-batches, each stage's groups share one set
    of replicas and its sequence starts with micro-batch 0's forward and ends with micro-batch
    M - 1's backward; 0 across other boundaries."""
    from ..parallel.pipeline import iteration_program

    st = sim.static
    S = len(pipeline.stages)
    sequences = iteration_program(pipeline, st.batch_size, st.num_groups).sequences
    bounds = list(pipeline.stages) + [st.num_groups]
    first, last = program.deployments[0], program.deployments[-1]
    lows = []
    for s in range(S):
        gs = range(bounds[s], bounds[s + 1])
        lays = [first[g].layout for g in gs] + [last[g].layout for g in gs]
        if any(x is None or x.devices != lays[0].devices or min(x.batches) < 1 for x in lays):
            lows.append(None)
            continue
        lows.append((np.sum([first[g].layout.dur[FWD, g] for g in gs], axis=0),
                     np.sum([last[g].layout.dur[BWD, g] for g in gs], axis=0), lays[0].dev_arr))
    fwd = [None if x is None else float(x[0].min()) for x in lows]
    bwd = [None if x is None else float(x[1].min()) for x in lows]
    devs = [None if x is None else x[2] for x in lows]
    joined = _joined(st, pipeline, sequences, lows)
    befores = [0.0] * S
    before = 0.0
    for s in range(S):
        before = before + fwd[s - 1] if joined[s] else 0.0
        befores[s] = before
    into = [0.0] * S
    for s in range(S - 2, -1, -1):  # the drain, from the last stage back
        if joined[s + 1]:
            into[s] = max(into[s + 1] + bwd[s + 1], befores[s + 1] + float(busy[devs[s + 1]].min()))
    at = [s for s in range(S) if lows[s] is not None]
    return [(d, before, after, into[s]) for s, (d, before, after) in zip(at, _chain(st, pipeline, sequences, lows))]


def _linked(st, a: int, b: int) -> bool:
    """Group ``a``'s forward feeds ``b``'s with a per-micro-batch tensor and ``b``'s backward feeds
    ``a``'s back."""
    there = any(e.batch and not e.once and e.src_phase == FWD and any(ph == FWD for _, ph in e.consumers)
                for e in st.edges.get((a, b), ()))
    back = any(e.batch and not e.once and e.src_phase == BWD and any(ph == BWD for _, ph in e.consumers)
               for e in st.edges.get((b, a), ()))
    return there and back


def _joined(st, pipeline, sequences, lows: list) -> list[bool]:
    """Per stage: whether its boundary with the stage before it is counted (:func:`_pipeline_waits`):
    ``lows[s]`` (None: the stage's groups do not share one set of replicas all running samples, or
    ``(forward at micro-batch 0, backward at M - 1, devices)`` per replica) set for both, each
    sequence starting with micro-batch 0's forward and ending with M - 1's backward, its devices
    running no other stage, the groups on each side linked (:func:`_linked`) and the devices
    disjoint."""
    S, M = len(pipeline.stages), pipeline.micro_batches
    ok = [x is not None and seq[0] == (Phase.FWD, 0) and seq[-1] == (Phase.BWD, M - 1) for x, seq in zip(lows, sequences)]
    held = [set() if x is None else set(x[2].tolist()) for x in lows]
    for s in range(S):  # (a device running another stage too, interleaved, may end on that one's task)
        ok[s] = ok[s] and not any(held[s] & held[t] for t in range(S) if t != s)
    joined = [False] * S
    for s in range(1, S):
        b = pipeline.stages[s]
        joined[s] = ok[s - 1] and ok[s] and _linked(st, b - 1, b) and \
            not set(lows[s - 1][2].tolist()) & set(lows[s][2].tolist())
    return joined


def _chain(st, pipeline, sequences, lows: list) -> list[tuple[np.ndarray, float, float]]:
    """Per stage with ``lows`` (:func:`_joined`): ``(devices, before, after)`` of
    :func:`_pipeline_waits`."""
    joined = _joined(st, pipeline, sequences, lows)
    out, before, after = [], 0.0, 0.0
    for s, x in enumerate(lows):
        if joined[s]:
            before += float(lows[s - 1][0].min())
            after += float(lows[s - 1][1].min())
        else:
            before = after = 0.0
        if x is not None:
            out.append((x[2], before, after))
    return out


def layout_bounds(sim, failures: list[str] | None = None) -> tuple:
    """The bounds :func:`tag.parallel.layout.search_layouts` prunes with on ``sim``, cheapest
    first: :func:`static_bound`, then :func:`plan_bound` (whose deployment a simulation reuses),
    each :func:`fallible` (``failures``: where a bound that fails says why)."""
    n = sim.num_devices
    failures = [] if failures is None else failures
    return (fallible(lambda p: static_bound(sim, p.groups, p.pipeline), n, failures),
            fallible(lambda p: plan_bound(sim, p.groups, p.pipeline), n, failures))


def fallible(bound, num_devices: int, failures: list[str]):
    """``bound`` (a function of a plan returning a :class:`PlanBound`), or, once any bound of
    ``failures`` raised, the bound that prunes nothing (0 s, 0 bytes, fits): the rule the bounds
    replace, every layout simulated. A failure appends one line to ``failures`` (the planner puts
    it in the plan's ``meta``); the branch and bound stays exact, 0 being a lower bound of
    everything. Out of memory (MemoryError) is not a case a bound meets: it propagates."""
    nothing = PlanBound(0.0, [0.0] * num_devices, False)

    def run(plan) -> PlanBound:
        if failures:
            return nothing
        try:
            return bound(plan)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - any case a bound cannot handle: the full grid instead
            what = " ".join(str(exc).split())[:200]
            failures.append(f"bounds failed on {plan.meta.get('layout', 'a layout')} ({type(exc).__name__}: {what}); "
                            "every layout simulated instead")
            return nothing
    return run


__all__ = ["PlanBound", "fallible", "layout_bounds", "plan_bound", "static_bound"]
