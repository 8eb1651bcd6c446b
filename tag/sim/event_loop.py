"""The event loop of one simulated iteration (:class:`Run`; the model: :mod:`tag.sim.engine`'s
docstring). Resources are per device a compute stream (free at ``compute_free_at``) and a
communication stream (``comm_free_at``), per machine an outgoing and an incoming network side;
stages are flat indices (:func:`tag.sim.flows.stage_index`), transfers exact tuples
(:class:`tag.sim.flows.StageFlow`, :class:`tag.sim.flows.Message`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .flows import GatherSet, PairFlows, ShiftedPair, TimedGathers, merge_gathers
from .holdings import holdings, iteration_result
from .program import PipelineProgram
from .recorder import Recorder, RunEnd
from .result import SimResult
from .static import BWD, FWD
from .units import GroupData, Layout, Unit, at_batch

if TYPE_CHECKING:
    from .engine import Simulator


class WakePenalty(NamedTuple):
    """A device's wake penalty (:meth:`tag.cost.CostModel.wake_penalty`, :func:`wake_extra`)."""

    table: np.ndarray
    """[K, 2, B+1] seconds of a stage's penalty after a long idle gap."""
    tau_s: float
    """Time constant of the penalty's growth with the gap (seconds)."""
    scale: float
    """``1 / (1 - exp(-gap_s / tau_s))``: the profiled gap's penalty is the table's."""


def wake_extra(sim: Simulator, unit: Unit, g: int, ph: int, start: list[float],
               compute_end: list[float]) -> list[float] | None:
    """Extra seconds per replica of ``unit``'s stage (group ``g``, phase ``ph``) starting at ``start``
    on devices whose last compute ended at ``compute_end`` (None: no penalty anywhere). An mp chunk
    pays its share (by time) of its group's penalty at the full batch."""
    out = None
    for r, d in enumerate(unit.devices):
        w = sim.wake[d]
        if w is None:
            continue
        gap = start[r] - compute_end[d]
        if gap <= 0.0:
            continue
        if unit.layout is not None:
            comp = unit.layout.compute
            x = w.table[g, ph, unit.batches[r]] if comp is None else at_batch(w.table[g, ph], comp[r])
        else:
            b = sim.graph.batch_size
            full = sim.tables[sim.dev_class[d]][g, ph, b]
            x = w.table[g, ph, b] * (unit.dur[ph] / full) if full > 0 else 0.0
        if x <= 0.0:
            continue
        if out is None:
            out = [0.0] * len(unit.devices)
        out[r] = float(x) * (1.0 - math.exp(-gap / w.tau_s)) * w.scale
    return out


def place_pairs(sim: Simulator, deployments: list[GroupData],
                program: PipelineProgram | None) -> list[tuple[PairFlows, int]]:
    """The pairs whose flows a run moves, each with the offset of its stage indices (a pipeline's
    micro-batch ``m``: ``2 K m``): a pipeline's every micro-batch's flows at its chunk index, and
    what moves once per iteration at the first micro-batch (batch-independent tensors) or the
    last (deferred partial sums)."""
    if program is None:
        return [(pair, 0) for pair in sim.pairs_used(deployments)]
    if len(program.deployments) == 1:  # one micro-batch: the flows of the plan without a pipeline
        return [(pair, 0) for pair in sim.pairs_used(program.deployments[0], program.select("all"))]
    k, last = len(deployments), len(program.deployments) - 1
    used: dict[int, list] = {}  # micro-batches of one size share one deployment: its pairs once
    placed = []
    for j, per_micro in enumerate(program.deployments):
        pairs = used.get(id(per_micro))
        if pairs is None:
            pairs = used[id(per_micro)] = sim.pairs_used(per_micro, program.select("micro"))
        placed += [(pair, 2 * k * j) for pair in pairs]
    placed += [(pair, 0) for pair in sim.pairs_used(program.deployments[0], program.select("first"))]
    placed += [(pair, 2 * k * last) for pair in sim.pairs_used(program.deployments[last], program.select("last"))]
    return placed


def _incoming(sim: Simulator, placed: list[tuple[PairFlows, int]]
              ) -> tuple[dict[int, tuple[int, list]], dict[int, list[TimedGathers]]]:
    """Stage index -> ``(offset, flow lists)``: the :attr:`PairFlows.stage_flows` lists into it,
    their source stage indices less the offset; and stage index -> the timed gathers
    (:meth:`PairFlows.timed`) of the pairs scattering into it."""
    incoming: dict[int, tuple[int, list]] = {}
    scattered: dict[int, list[TimedGathers]] = {}
    for pair, off in placed:
        for dst, flows in pair.stage_flows:
            x = incoming.get(dst + off)
            if x is None:
                incoming[dst + off] = (off, [flows])
            else:
                x[1].append(flows)
        if pair.gathers:
            for entry in pair.timed(sim):
                x = scattered.get(entry.dst_stage + off)
                if x is None:
                    scattered[entry.dst_stage + off] = [entry]
                else:
                    x.append(entry)
    return incoming, scattered


def _gathers(sim: Simulator, scattered: dict[int, list[TimedGathers]]) -> dict[int, list[GatherSet]]:
    """Stage index -> its :class:`GatherSet` list: one pair's sets as it timed them, several
    pairs' merged (a pipeline's micro-batches merge the same pairs' sets at every offset: once per
    run, keyed by the entries, which the pairs hold)."""
    merged: dict[tuple, list] = {}
    gathers = {}
    for dst, entries in scattered.items():
        if len(entries) == 1:
            gathers[dst] = entries[0].sets
            continue
        key = tuple([id(e) for e in entries])
        out = merged.get(key)
        if out is None:
            out = merged[key] = merge_gathers(sim, entries)
        gathers[dst] = out
    return gathers


class Run:
    """The event loop: one simulated iteration of ``deployments`` (and the pipeline ``program``).

    ``recorder``: a :class:`Recorder` that records every task with its predecessor (critical path,
    timeline), or None (the search's hot path). The loop calls it, when present, after computing
    a task's times and before updating the resources' state; it computes no time."""

    def __init__(self, sim: Simulator, deployments: list[GroupData], recorder: Recorder | None = None,
                 program: PipelineProgram | None = None):
        self.sim, self.deployments, self.recorder, self.program = sim, deployments, recorder, program
        n, m = sim.num_devices, sim.num_machines
        placed = place_pairs(sim, deployments, program)
        self.incoming, scattered = _incoming(sim, placed)
        self.gathers = _gathers(sim, scattered)
        """Stage index -> each consumer holder set that all-gathers the pieces scattered into it
        (:meth:`_scatter_gather`)."""
        self.buffer_bytes = [0.0] * n  # per device: its largest communication buffer
        self.compute_free_at = [0.0] * n
        self.compute_end = [0.0] * n  # end of each device's last compute (wake penalty)
        self.host_free_at = [0.0] * n  # when each device's host has issued its last stage (Layout.host)
        self.compute_seconds = [0.0] * n
        self.comm_free_at = [0.0] * n
        self.comm_seconds = [0.0] * n
        self.nic_out_free_at = [0.0] * m
        self.nic_in_free_at = [0.0] * m
        chunks = max([len(d.units) for d in deployments]) if program is None else len(program.deployments)
        self.stage_finish: list = [None] * (2 * len(deployments) * chunks)  # stage index -> finish per replica
        self.group_finish = [0.0] * len(deployments)
        sfb = [d.sfb for d in deployments]
        self.any_sfb = sfb.count(None) < len(sfb)
        self.sfb_ready: dict[int, float] = {}
        self.shared_net = sim.topology.background or None  # other jobs' traffic (tag.topology.background)
        if recorder is not None:
            k2 = 2 * len(deployments)
            recorder.bind(self, [pair if program is None else ShiftedPair(pair, off // k2) for pair, off in placed])

    # ---- transfers ----------------------------------------------------------------------
    def _transfer(self, inbound: tuple[int, list], nrep: int, idx: int) -> list[float]:
        """The messages into stage ``idx`` (``inc``: the offset and flow lists of ``incoming``;
        :meth:`Simulator.messages`), in order; per replica of the stage, when its last message
        arrives. A rendezvous, as in the executor: a message starts once its data is ready, both
        comm streams are free and the receiver's compute stream reached this step of the schedule,
        the sender's too where it waits (a GPU sender that receives nothing in the step posts its
        sends on a stream waiting for their data alone, ``DistComm._send_when_made``)."""
        ready = [0.0] * nrep
        comm_free, nic_out, nic_in, finish = self.comm_free_at, self.nic_out_free_at, self.nic_in_free_at, self.stage_finish
        free, buffer_bytes, rec, comm_seconds = self.compute_free_at, self.buffer_bytes, self.recorder, self.comm_seconds
        off, flow_lists = inbound
        for src_stage, src_rep, more, a, b, ma, mb, t, r, nb, waits in self.sim.messages(flow_lists):
            s = finish[src_stage + off][src_rep] if src_stage >= 0 else 0.0
            if more is not None:  # ready once every flow of the message is
                for src_stage, src_rep in more:
                    x = finish[src_stage + off][src_rep] if src_stage >= 0 else 0.0
                    if x > s:
                        s = x
            if nb > buffer_bytes[a]:
                buffer_bytes[a] = nb
            if nb > buffer_bytes[b]:
                buffer_bytes[b] = nb
            x = comm_free[a]
            if x > s:
                s = x
            x = comm_free[b]
            if x > s:
                s = x
            if waits:
                x = free[a]
                if x > s:
                    s = x
            x = free[b]
            if x > s:
                s = x
            if ma >= 0:  # crossing machines: the source's outgoing and destination's incoming side
                x = nic_out[ma]
                if x > s:
                    s = x
                x = nic_in[mb]
                if x > s:
                    s = x
                e = s + t if self.shared_net is None else self._slowed((ma, mb), s, t)
                if rec is not None:
                    rec.flow(idx, a, b, ma, mb, s, e, r, nb, waits)
                nic_out[ma] = nic_in[mb] = e
            else:
                e = s + t
                if rec is not None:
                    rec.flow(idx, a, b, ma, mb, s, e, r, nb, waits)
            comm_free[a] = comm_free[b] = free[b] = e  # the receiver waits for the transfer
            if waits:  # and the sender, unless it is a GPU rank receiving nothing in the step
                free[a] = e
            comm_seconds[a] += t
            comm_seconds[b] += t
            if e > ready[r]:
                ready[r] = e
        return ready

    def _slowed(self, machines: tuple[int, ...], s: float, t: float) -> float:
        """When a message (two machines, sender first) or a collective over ``machines`` of ``t``
        nominal seconds, started at ``s``, ends on what other jobs leave of their NICs and links
        (:func:`tag.topology.background.group_profile`)."""
        from ..topology.background import group_profile

        sim = self.sim
        profile = sim.background_paths.get(machines, False)
        if profile is False:
            profile = sim.background_paths[machines] = group_profile(sim.topology, machines)
        off = sim.time_offset_s
        return s + t if profile is None else profile.finish(s + off, t) - off

    def _net_slowed(self, lay: Layout, ph: int, g: int, end: list[float]) -> list[float]:
        """``end`` (per replica, stage ``(ph, g)`` on ``lay`` at nominal speed) with the stage's
        tensor-parallel collectives across machines (:attr:`Layout.net`, their nominal seconds at
        the stage's end) on what other jobs leave of their machines' NICs and links."""
        out = list(end)
        for r, c in enumerate(lay.net[ph, g].tolist()):
            if c > 0.0:
                out[r] = self._slowed(lay.net_machines[r], end[r] - c, c)
        return out

    def _scatter_gather(self, idx: int, ready: list[float]) -> None:
        """The all-gathers of stage ``idx``'s consumer holder sets that received scattered pieces
        (``ready``: per replica, when its last message arrived; updated in place): each starts
        once every replica of its set received its slices and its devices' streams are free (a
        blocking collective in the executor's transfer step) and lasts the all-gather of the
        received bytes over the set's devices (one machine)."""
        comm_free, free, comm_seconds, buffer_bytes, rec = (self.comm_free_at, self.compute_free_at, self.comm_seconds,
                                           self.buffer_bytes, self.recorder)
        for lo, hi, devs, t, nb in self.gathers[idx]:
            s = ready[lo]  # the latest of the set's arrivals and its devices' streams
            for x in ready[lo + 1:hi]:
                if x > s:
                    s = x
            for d in devs:
                x = comm_free[d]
                if x > s:
                    s = x
            for d in devs:
                x = free[d]
                if x > s:
                    s = x
            e = s + t
            if rec is not None:
                rec.scatter_gather(idx, lo, hi, devs, s, e, nb)
            for d in devs:
                comm_free[d] = free[d] = e
                comm_seconds[d] += t
                if nb > buffer_bytes[d]:
                    buffer_bytes[d] = nb
            ready[lo:hi] = [e] * (hi - lo)

    # ---- compute segments -------------------------------------------------------------------
    def _phase(self, ph: int, order: list[int], m: int = 0) -> None:
        """The stages of phase ``ph`` of the groups in ``order`` (of micro-batch ``m``, a pipeline's):
        segments of consecutive stages on one layout with no transfer in, an mp chunk alone."""
        deployments = self.deployments if self.program is None else self.program.deployments[m]
        incoming, rec, wake = self.incoming, self.recorder, self.sim.any_wake
        k = len(deployments)
        base = ph * k + 2 * k * m
        sfb, fwd = ph == BWD and self.any_sfb, ph == FWD  # (an SFB group ends a backward segment)
        free, compute_end, compute_seconds = self.compute_free_at, self.compute_end, self.compute_seconds
        stage_finish, group_finish = self.stage_finish, self.group_finish
        i, n = 0, len(order)
        while i < n:
            g = order[i]
            deployment = deployments[g]
            lay = deployment.layout
            if lay is None:  # mp: one single-device stage per chunk, for this group and the mp groups after it
                i = self._chunk_stages(ph, order, i, n, deployments, base, 2 * k)
                continue
            idx, devs = base + g, lay.devices
            inbound = incoming.get(idx)
            if inbound:
                ready = self._transfer(inbound, len(devs), idx)
                if idx in self.gathers:
                    self._scatter_gather(idx, ready)
                start = [y if y > free[d] else free[d] for d, y in zip(devs, ready)]
            else:
                start = [free[d] for d in devs]
            penalty = wake_extra(self.sim, deployment.units[0], g, ph, start, compute_end) if wake else None
            go = start if penalty is None else [x + y for x, y in zip(start, penalty)]
            e = i + 1
            net = lay.net if self.shared_net is not None else None  # tp collectives across machines
            if not (sfb and deployment.sfb is not None) and net is None:  # (slowed group by group)
                while e < n:
                    next_deployment = deployments[order[e]]
                    if next_deployment.layout is not lay or base + order[e] in incoming:
                        break
                    e += 1
                    if sfb and next_deployment.sfb is not None:
                        break
            if e - i > 1:
                end = self._run_end(ph, g, e - i, lay, go, idx, k)
            else:  # one stage alone (inline: the common case of a plan whose groups differ)
                r = lay.rows[g]
                end = [x + y for x, y in zip(go, r[ph] if r is not None else lay.row(g)[ph])]
                if lay.hosts is not None:
                    end = self._hosted_one(lay, ph, g, devs, end)
                if net is not None:
                    end = self._net_slowed(lay, ph, g, end)
                stage_finish[idx] = end
                if not fwd and (x := max(end)) > group_finish[g]:
                    group_finish[g] = x
            if rec is not None:
                rec.segment(ph, [(g2, m) for g2 in order[i:e]], deployment.units[0], start, ready if inbound else None)
            for r, d in enumerate(devs):
                x = end[r]
                free[d] = compute_end[d] = x
                compute_seconds[d] += x - start[r]
            if sfb and deployments[order[e - 1]].sfb is not None:
                self._sfb(order[e - 1], end)
            i = e

    def _run_end(self, ph: int, g: int, length: int, lay: Layout, go: list[float], idx: int, k: int) -> list[float]:
        """A run of ``length`` stages of phase ``ph`` on ``lay`` from group ``g`` (stage index
        ``idx``; ``k`` groups), its devices free at ``go``: cumulative sums over the groups. Sets
        every stage's finish (and the backward's group finish); returns the last stage's."""
        fwd = ph == FWD
        if fwd:
            b0, rows = lay.cum_fwd[g], lay.cum_fwd[g + 1:g + length + 1]
        else:
            i0 = k - 1 - g
            b0, rows = lay.cum_bwd[i0], lay.cum_bwd[i0 + 1:i0 + length + 1]
        if lay.hosts is None:
            finish_array = np.asarray(go) + (rows - b0)
        else:  # the host issues the run's stages one after the other, from where it is
            finish_array = self._hosted(lay, fwd, g if fwd else k - 1 - g, length, lay.devices, go) + (rows - b0)
        fin = finish_array.tolist()
        end = fin[-1]
        if fwd:  # groups g .. g + length - 1
            self.stage_finish[idx:idx + length] = fin
        else:  # groups g, g - 1, ..., g - length + 1; each its first and only stage
            fin.reverse()
            self.stage_finish[idx - length + 1:idx + 1] = fin
            group_max = finish_array.max(axis=1).tolist()
            group_max.reverse()
            self.group_finish[g - length + 1:g + 1] = group_max
        return end

    def _chunk_stages(self, ph: int, order: list[int], i: int, n: int, deployments: list[GroupData], base: int,
                      k2: int) -> int:
        """The stages of phase ``ph`` of the mp groups at ``order[i]`` and after it up to the next
        group with a layout: each group's chunks in the phase's order, one device each (chunk ``j``
        of group ``g``: stage index ``base + g + k2 * j``). Returns the position after them."""
        fwd = ph == FWD
        free, compute_end, finish, rec = self.compute_free_at, self.compute_end, self.stage_finish, self.recorder
        incoming, sim, group_finish, compute_seconds = self.incoming, self.sim, self.group_finish, self.compute_seconds
        wake, host_free = sim.any_wake, self.host_free_at
        while i < n and deployments[order[i]].layout is None:
            g = order[i]
            units = deployments[g].units
            for j in (range(len(units)) if fwd else range(len(units) - 1, -1, -1)):
                unit = units[j]
                idx = base + g + k2 * j
                d = unit.devices[0]
                inbound = incoming.get(idx)
                if inbound:
                    arrived = self._transfer(inbound, 1, idx)[0]
                    c = free[d]
                    st = arrived if arrived > c else c
                else:
                    st = free[d]
                penalty = wake_extra(sim, unit, g, ph, [st], compute_end) if wake else None
                x = (st if penalty is None else st + penalty[0]) + unit.dur[ph]
                if unit.host is not None:  # its host issues it from where it is (_hosted)
                    h = host_free[d]
                    y = h + unit.dur[ph] + unit.lag[ph]
                    if y > x:
                        x = y
                    host_free[d] = h + unit.host[ph]
                finish[idx] = [x]
                if not fwd and x > group_finish[g]:
                    group_finish[g] = x
                if rec is not None:
                    rec.segment(ph, [(g, j)], unit, [st], [arrived] if inbound else None)
                free[d] = compute_end[d] = x
                compute_seconds[d] += x - st
            i += 1
        return i

    def _hosted(self, lay: Layout, fwd: bool, p0: int, length: int, devs: tuple[int, ...],
                go: list[float]) -> np.ndarray:
        """[length, R] when each stage of a run of ``length`` stages on ``lay`` (positions ``p0 ..``
        of the phase's order, :attr:`Layout.hosts`) finishes less the run's device seconds up to
        it, the device free at ``go``: stage ``k`` ends at ``F_k = max(F_(k-1) + g_k, H_k + g_k +
        lag_k)``, ``H_k`` when the host starts issuing it (the device's host free at the run's
        start, then each stage's host seconds after the other), so ``F_k - G_k = max(go, H +
        max_(j <= k)(H_j - H - G_(j-1) + lag_j))`` (``G`` the run's device seconds). The host
        moves on to the end of its launches: it waits for nothing (NCCL's sends and receives
        order the streams, not the host)."""
        cum_h, base, peak = lay.hosts[0 if fwd else 1]
        host_free = self.host_free_at
        h0 = np.array([host_free[d] for d in devs])
        lead = np.maximum(np.asarray(go), h0 + (np.maximum.accumulate(peak[p0:p0 + length], axis=0) - base[p0]))
        for d, x in zip(devs, (h0 + (cum_h[p0 + length] - cum_h[p0])).tolist()):
            host_free[d] = x
        return lead

    def _hosted_one(self, lay: Layout, ph: int, g: int, devs: tuple[int, ...], end: list[float]) -> list[float]:
        """``end`` (per replica, stage ``(ph, g)`` on ``lay`` run on the device from its start) no
        earlier than the host allows: its host starts issuing it at ``H`` (when it issued its last
        stage) and the stage ends no earlier than ``H + dur + lag`` (:meth:`_hosted`)."""
        host_free = self.host_free_at
        dur, host, lag = lay.dur[ph, g].tolist(), lay.host[ph, g].tolist(), lay.lag[ph, g].tolist()
        out = []
        for r, d in enumerate(devs):
            h = host_free[d]
            x = h + dur[r] + lag[r]
            out.append(x if x > end[r] else end[r])
            host_free[d] = h + host[r]
        return out

    def _sfb(self, g: int, fin: list[float]) -> None:
        """SFB of group ``g`` after its backward, which ended at ``fin`` (per replica): the factor
        all-gathers once every replica finished, then each replica's recompute."""
        sfb_data = self.deployments[g].sfb
        rec = self.recorder
        s = max(fin)
        comm_free, comm_seconds, buffer_bytes = self.comm_free_at, self.comm_seconds, self.buffer_bytes
        nic_out, nic_in = self.nic_out_free_at, self.nic_in_free_at
        for d in sfb_data.members:
            if comm_free[d] > s:
                s = comm_free[d]
        for m in sfb_data.machines:
            if nic_out[m] > s:
                s = nic_out[m]
            if nic_in[m] > s:
                s = nic_in[m]
        for x, t in enumerate(sfb_data.gather_times):  # one collective per factor, back to back
            e = s + t
            if rec is not None:
                rec.gather(g, x, s, e)
            s = e
        for d in sfb_data.members:
            comm_free[d] = s
            comm_seconds[d] += sfb_data.gather_total
            if sfb_data.buffer_bytes > buffer_bytes[d]:
                buffer_bytes[d] = sfb_data.buffer_bytes
        for m in sfb_data.machines:
            nic_out[m] = nic_in[m] = s
        free, compute_seconds = self.compute_free_at, self.compute_seconds
        ready = 0.0
        for d, t in zip(sfb_data.devices, sfb_data.recompute):
            st = s if s >= free[d] else free[d]
            if rec is not None:
                rec.recompute(g, d, s, st, st + t)
            free[d] = self.compute_end[d] = st + t
            compute_seconds[d] += t
            if st + t >= ready:
                ready = st + t
        self.sfb_ready[g] = ready

    # ---- synchronisation and update ----------------------------------------------------------
    def _syncs(self) -> list[float]:
        """Gradient synchronisations (:meth:`Simulator.sync_jobs`); returns per-device last sync end.

        Only syncs use the comm streams and network sides from here on, so a sync over the same
        members as the previous one finds all of them free at that sync's end: consecutive syncs
        over one member set are chained without per-device work, which is settled once per run
        (:meth:`_close_syncs`)."""
        sync_end = [0.0] * self.sim.num_devices
        comm_free, nic_out, nic_in = self.comm_free_at, self.nic_out_free_at, self.nic_in_free_at
        deployments, group_finish, sfb_ready, rec = self.deployments, self.group_finish, self.sfb_ready, self.recorder
        free, shared = self.compute_free_at, self.sim.shared_stream
        cur = None  # the job starting the current run of syncs over one member set
        run_end, run_busy, run_bytes = 0.0, 0.0, 0.0
        for gs, job in self.sim.sync_jobs(deployments, frozenset() if self.program is None else self.program.tied):
            s = -math.inf
            for g in gs:
                ready_at = sfb_ready[g] if deployments[g].sfb is not None else group_finish[g]
                if ready_at > s:
                    s = ready_at
            if cur is not None and job.sync_devices == cur.sync_devices:
                if run_end > s:
                    s = run_end
            else:
                if cur is not None:
                    self._close_syncs(cur, sync_end, run_end, run_busy, run_bytes)
                cur, run_busy, run_bytes = job, 0.0, 0.0
                for d in job.sync_devices:
                    if comm_free[d] > s:
                        s = comm_free[d]
                    if shared[d] and free[d] > s:  # a CPU rank: after its compute
                        s = free[d]
                for m in job.sync_machines:
                    if nic_out[m] > s:
                        s = nic_out[m]
                    if nic_in[m] > s:
                        s = nic_in[m]
            run_end = s + job.sync_time
            if self.shared_net is not None and job.sync_machines:  # crossing machines: other jobs' traffic
                run_end = self._slowed(job.sync_machines, s, job.sync_time)
            if rec is not None:
                rec.sync(gs, job, s, run_end)
            run_busy += job.sync_time
            run_bytes = max(run_bytes, job.sync_bytes)
        if cur is not None:
            self._close_syncs(cur, sync_end, run_end, run_busy, run_bytes)
        return sync_end

    def _close_syncs(self, job, sync_end: list[float], end: float, run_busy: float, run_bytes: float) -> None:
        """A run of syncs over ``job``'s members ends at ``end`` (seconds): their links are busy
        ``run_busy`` seconds more, until then, and hold the run's largest buffer (bytes)."""
        if self.recorder is not None:
            self.recorder.close_syncs(job)
        comm_free, comm_seconds, buffer_bytes = self.comm_free_at, self.comm_seconds, self.buffer_bytes
        for d in job.sync_devices:
            comm_free[d] = sync_end[d] = end
            comm_seconds[d] += run_busy
            if run_bytes > buffer_bytes[d]:
                buffer_bytes[d] = run_bytes
        for m in job.sync_machines:
            self.nic_out_free_at[m] = self.nic_in_free_at[m] = end

    def execute(self) -> SimResult:
        """Run the iteration. Without a recorder the critical path is computed on first access by
        replaying the iteration with one."""
        sim, deployments, rec, program = self.sim, self.deployments, self.recorder, self.program
        k = len(deployments)
        if program is None:
            self._phase(FWD, list(range(k)))
            self._phase(BWD, list(range(k - 1, -1, -1)))
        else:  # the pipeline's tasks in the schedule's order (tag.parallel.pipeline)
            for stage, ph, m in program.tasks:
                gs = program.members[stage]
                self._phase(ph, gs if ph == FWD else gs[::-1], m)
        sync_end = self._syncs()
        end = iteration_result(sim, self, sync_end, holdings(sim, deployments, program))
        res = end.result
        if rec is None:
            res.path_fn = lambda: Run(sim, deployments, Recorder(), program).execute().critical_path
        else:
            rec.close(RunEnd(end.final, end.before, end.update_start, sync_end, end.holds_params))
            res.path_fn = rec.critical_path
        return res
