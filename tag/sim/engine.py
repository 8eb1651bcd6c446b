"""The event-driven simulator of one training iteration under a plan.

Resources: every device has a **compute stream** and a **communication stream** (so compute
overlaps transfers); every machine has a network link with an outgoing and an incoming side,
shared by all flows and collectives crossing machines (contended: they take turns). Each resource
serves its tasks in the executor's global step order (:mod:`tag.executor.schedule`): for every
unit in forward order the transfers into its forward stage, then the stage; the same for the
backward stages in reverse order; then the gradient synchronisations in reverse group order; then
one optimizer step per device. A task starts when its inputs are ready and every resource it uses
is free, so the iteration is a max-plus system: shorter tasks (faster devices, more bandwidth)
never make any task finish later.

Tasks: compute stages (per replica), point-to-point flows (``latency + bytes / bandwidth``;
occupy both endpoints' comm streams, and both machines' network sides when crossing machines),
synchronisations (one collective over the replica set, or PS push+pull, see
:mod:`tag.cost.comm`; occupy every participant's comm stream and the network sides of the
machines it spans), optimizer steps (after the device's last compute and its last sync).

Sufficient Factor Broadcasting (``GroupPlan.sfb``, :mod:`tag.sim.sfb`): right after an SFB
group's backward stage (once every replica finished it), the all-gathers of its factors, one
after the other over the replicas (comm streams and network sides, served like point-to-point
transfers: before the gradient syncs); then every replica recomputes the SFB gradients on the
global batch on its compute stream (before its next stage); then the group's remaining
gradients are synchronised (the sync waits for the last replica's recompute). The executor's
order, docs/DESIGN.md "Sufficient Factor Broadcasting".

Speed: runs of consecutive stages on one data-parallel layout with no incoming transfer form a
*segment* computed with one numpy expression (cumulative sums over groups).
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError
from .result import SimEvent, SimResult
from .static import BWD, FWD, OPT, PARAM, build_static
from .units import GroupData, Layout, Unit, make_layout, mp_unit, pair_flows, split_batch

PHASE_NAME = {FWD: "fwd", BWD: "bwd", OPT: "opt", PARAM: "param"}
CACHE_LIMIT = 100_000
"""Entries per cache before it is cleared (bounds memory over very long searches)."""


def plan_key(gp) -> tuple:
    """Cache key of a GroupPlan: :meth:`GroupPlan.key` without rounding the shares (20x cheaper;
    shares that differ by float noise merely miss the cache, the derived data is the same)."""
    sp = gp.mp_splits
    return (tuple(gp.devices), tuple(gp.shares), gp.sync, gp.server, tuple(sp) if sp else (), tuple(gp.sfb))


class Simulator:
    """Simulate plans of one graph on one topology; build once, call :meth:`run` many times."""

    def __init__(self, graph, topology, costs=None):
        from ..cost.model import CostModel

        self.graph = graph
        self.topology = topology
        self.costs = costs if costs is not None else CostModel.for_topology(graph, topology)
        self.static = build_static(graph)
        self.comm = self.costs.comm
        tabs: list[np.ndarray] = []
        self.dev_class: list[int] = []
        for d in range(topology.num_devices):
            t = self.costs.table(d)
            k = next((i for i, x in enumerate(tabs) if x is t), None)
            if k is None:
                k = len(tabs)
                tabs.append(t)
            self.dev_class.append(k)
        self.tables = np.stack(tabs)  # [C, K, 3, B+1]
        self.num_devices = topology.num_devices
        self.num_machines = topology.num_machines
        self.capacity = [float(d.gpu.memory_bytes) for d in topology.devices]
        self.step_overhead = [self.costs.step_overhead(d) for d in range(self.num_devices)]
        self.device_names = [f"{d.name} ({d.gpu.name})" for d in topology.devices]
        self._layouts: dict[tuple, Layout] = {}
        self._groups: dict[tuple, GroupData] = {}
        self._pairs: dict[tuple, list] = {}
        # Pairs without non-batch gradients: no flow when both groups share one layout.
        self._local_pairs = {pr for pr, es in self.static.edges.items() if not any(e.grad for e in es)}
        self._names: dict[tuple, str] = {}
        self._sfb = None  # tag.sim.sfb.SfbCosts, built on the first plan using SFB

    # ---- cached plan-derived data -------------------------------------------------------
    def layout(self, devices: tuple[int, ...], batches: tuple[int, ...]) -> Layout:
        key = (devices, batches)
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) > CACHE_LIMIT:
                self._layouts.clear()
            lay = make_layout(self.static, self.tables, self.dev_class, devices, batches)
            self._layouts[key] = lay
        return lay

    def group_data(self, g: int, gp, key=None) -> GroupData:
        """Units and synchronisation of group ``g`` deployed as ``gp`` (cached by its key)."""
        key = (g, plan_key(gp) if key is None else key)
        gd = self._groups.get(key)
        if gd is None:
            if len(self._groups) > CACHE_LIMIT:
                self._groups.clear()
            gd = self._make_group(g, gp)
            self._groups[key] = gd
        return gd

    def _make_group(self, g: int, gp) -> GroupData:
        st, comm = self.static, self.comm
        devs = tuple(gp.devices)
        sbytes = float(st.grad_bytes[g])
        sfb = None
        if gp.sfb:  # validated here (PlanError naming the op); its gradients leave the sync
            if self._sfb is None:
                from .sfb import SfbCosts

                self._sfb = SfbCosts(self)
            sfb = self._sfb.group(g, gp)
            sbytes = max(0.0, sbytes - sfb.saved_bytes)
        if gp.sync == "mp":
            splits = list(gp.mp_splits)
            bounds = splits + [st.hi[g]]
            units = [mp_unit(st, self.costs, g, j, d, bounds[j], bounds[j + 1]) for j, d in enumerate(devs)]
            chunk_of = {p: j for j in range(len(devs)) for p in range(bounds[j], bounds[j + 1])}
            return GroupData(units, "none", 0.0, (), (), 0.0, True, chunk_of)
        batches = split_batch(st.batch_size, gp.shares)
        lay = self.layout(devs, batches)
        unit = Unit(g, -1, devs, batches, lay.starts, lay)
        mo = comm.machine_of
        if gp.sync == "ps":
            members = tuple(sorted(set(devs) | {gp.server}))
            t = comm.ps_time(devs, gp.server, sbytes) if len(members) > 1 and sbytes > 0 else 0.0
        else:
            members = tuple(sorted(devs))
            t = comm.allreduce_time(devs, sbytes) if len(members) > 1 and sbytes > 0 else 0.0
        if len(members) <= 1 or sbytes <= 0:
            return GroupData([unit], "none", 0.0, (), (), 0.0, sfb=sfb)
        machines = tuple(sorted({mo[d] for d in members}))
        return GroupData([unit], gp.sync, t, members, machines if len(machines) > 1 else (), sbytes, sfb=sfb)

    def flows(self, g1: int, k1, g2: int, k2, gds: list[GroupData]) -> list:
        """Flows from group ``g1`` to ``g2`` grouped by destination stage: [(stage, [Flow])]."""
        key = (g1, g2, k1, k2)
        fl = self._pairs.get(key)
        if fl is None:
            if len(self._pairs) > CACHE_LIMIT:
                self._pairs.clear()
            by_dst: dict[tuple, list] = {}
            for f in pair_flows(self.static, self.comm, g1, gds[g1], g2, gds[g2]):
                by_dst.setdefault(f.dst, []).append(f)
            fl = list(by_dst.items())
            self._pairs[key] = fl
        return fl

    # ---- the event loop -------------------------------------------------------------------
    def run(self, groups, *, trace: bool = False) -> SimResult:
        """Simulate one iteration of the deployment ``groups`` (one GroupPlan per op-group)."""
        st = self.static
        k = st.num_groups
        if len(groups) != k:
            raise PlanError(f"plan: groups: expected {k} entries (one per op-group), got {len(groups)}")
        keys = [plan_key(gp) for gp in groups]
        gds = [self.group_data(g, gp, keys[g]) for g, gp in enumerate(groups)]
        incoming: dict[tuple, list] = {}
        local = self._local_pairs
        for g1, g2 in st.pairs:
            gd1, gd2 = gds[g1], gds[g2]
            if g1 == g2:
                if not gd1.mp:
                    continue
            elif (g1, g2) in local and gd1.units[0].layout is not None and \
                    gd1.units[0].layout is gd2.units[0].layout:
                continue  # same replicas, same sample ranges: every move stays on its device
            for dst, fl in self.flows(g1, keys[g1], g2, keys[g2] if g1 != g2 else None, gds):
                lst = incoming.get(dst)
                if lst is None:
                    incoming[dst] = list(fl)
                else:
                    lst.extend(fl)
        return _Run(self, gds, incoming).execute(trace)


class _Run:
    """State of one simulated iteration (see the module docstring)."""

    def __init__(self, sim: Simulator, gds: list[GroupData], incoming: dict):
        self.sim, self.gds, self.incoming = sim, gds, incoming
        n, m = sim.num_devices, sim.num_machines
        self.cfree = [0.0] * n
        self.comp = [0.0] * n
        self.comm_free = [0.0] * n
        self.comm_busy = [0.0] * n
        self.buf = [0.0] * n
        self.nic_out = [0.0] * m
        self.nic_in = [0.0] * m
        self.last_task: list = [None] * n
        self.last_comm: list = [None] * n
        self.last_nout: list = [None] * m
        self.last_nin: list = [None] * m
        self.segs: list[tuple] = []
        self.stage_loc: dict[tuple, tuple[int, int]] = {}
        self.flows: list[tuple] = []  # (flow, start, end, pred)
        self.syncs: list[tuple] = []  # (group, start, end, pred)
        self.group_finish = [0.0] * len(gds)
        self.any_sfb = any(gd.sfb is not None for gd in gds)
        self.gathers: list[tuple] = []  # SFB all-gathers: (group, factor index, start, end, pred)
        self.recomputes: list[tuple] = []  # SFB recomputes: (group, device, start, end, pred)
        self.sfb_ready: dict[int, tuple] = {}  # group -> (last replica's recompute end, its ref)

    # ---- transfers ----------------------------------------------------------------------
    def _transfer(self, inc: list, nrep: int) -> tuple[list[float], list]:
        ready = [0.0] * nrep
        rsrc: list = [None] * nrep
        cf, last, nout, nin = self.comm_free, self.last_comm, self.nic_out, self.nic_in
        lout, lin, busy, buf = self.last_nout, self.last_nin, self.comm_busy, self.buf
        segs, loc, flows = self.segs, self.stage_loc, self.flows
        for f in inc:
            src = f.src
            if src[0] == PARAM:
                s, p = 0.0, None
            else:
                sid, row = loc[src]
                s = segs[sid][8][row][f.src_rep]
                p = ("c", sid, row, f.src_rep)
            a, b, ma = f.a, f.b, f.ma
            if cf[a] > s:
                s, p = cf[a], last[a]
            if cf[b] > s:
                s, p = cf[b], last[b]
            if ma >= 0:
                mb = f.mb
                if nout[ma] > s:
                    s, p = nout[ma], lout[ma]
                if nin[mb] > s:
                    s, p = nin[mb], lin[mb]
            t = f.time
            e = s + t
            ref = ("f", len(flows))
            flows.append((f, s, e, p))
            cf[a] = cf[b] = e
            last[a] = last[b] = ref
            busy[a] += t
            busy[b] += t
            nb = f.nbytes
            if nb > buf[a]:
                buf[a] = nb
            if nb > buf[b]:
                buf[b] = nb
            if ma >= 0:
                nout[ma] = nin[mb] = e
                lout[ma] = lin[mb] = ref
            r = f.dst_rep
            if e > ready[r]:
                ready[r], rsrc[r] = e, ref
        return ready, rsrc

    # ---- compute segments -------------------------------------------------------------------
    def _phase(self, ph: int, order: list[int]) -> None:
        gds, incoming = self.gds, self.incoming
        stages = [(g, j) for g in order for j in (range(len(gds[g].units)) if ph == FWD
                                                   else reversed(range(len(gds[g].units))))]
        k = len(gds)
        sfb = ph == BWD and self.any_sfb  # an SFB group ends a backward segment
        i, n = 0, len(stages)
        while i < n:
            g, j = stages[i]
            unit: Unit = gds[g].units[j]
            key = (ph, g, j)
            inc = incoming.get(key)
            ready = rsrc = None
            if inc:
                ready, rsrc = self._transfer(inc, len(unit.devices))
            lay = unit.layout
            e = i + 1
            if lay is not None and not (sfb and gds[g].sfb is not None):
                while e < n:
                    g2, j2 = stages[e]
                    u2 = gds[g2].units[j2]
                    if u2.layout is not lay or (ph, g2, j2) in incoming:
                        break
                    e += 1
                    if sfb and gds[g2].sfb is not None:
                        break
            length = e - i
            devs = unit.devices
            cfree = self.cfree
            cf = [cfree[d] for d in devs]
            start = [max(x, y) for x, y in zip(cf, ready)] if ready is not None else cf
            if length > 1:  # a run of stages on one layout: cumulative sums over the groups
                if ph == FWD:
                    base, rows = lay.cum_fwd[g], lay.cum_fwd[g + 1:g + length + 1]
                else:
                    i0 = k - 1 - g
                    base, rows = lay.cum_bwd[i0], lay.cum_bwd[i0 + 1:i0 + length + 1]
                fin_a = np.asarray(start) + (rows - base)
                fin = fin_a.tolist()
                mx = fin_a.max(axis=1).tolist() if ph == BWD else None
            else:
                dur = lay.dur_l[ph][g] if lay is not None else (unit.dur[ph],)
                fin = [[x + y for x, y in zip(start, dur)]]
                mx = [max(fin[0])] if ph == BWD else None
            end = fin[-1]
            comp = self.comp
            sid = len(self.segs)
            last = self.last_task
            prev = [last[d] for d in devs]
            for r, d in enumerate(devs):
                cfree[d] = end[r]
                comp[d] += end[r] - start[r]
                last[d] = ("c", sid, length - 1, r)
            seg_stages = stages[i:e]
            self.segs.append((ph, seg_stages, unit, start, cf, ready, rsrc, prev, fin))
            loc = self.stage_loc
            for row, (g2, j2) in enumerate(seg_stages):
                loc[(ph, g2, j2)] = (sid, row)
            if mx is not None:
                gf = self.group_finish
                for row, (g2, _) in enumerate(seg_stages):
                    if mx[row] > gf[g2]:
                        gf[g2] = mx[row]
            if sfb:
                g2 = seg_stages[-1][0]
                if gds[g2].sfb is not None:
                    self._sfb(g2, sid, length - 1)
            i = e

    def _sfb(self, g: int, sid: int, row: int) -> None:
        """SFB of group ``g`` after its backward (segment ``sid``, ``row``): the factor
        all-gathers once every replica finished, then each replica's recompute."""
        sd = self.gds[g].sfb
        fin = self.segs[sid][8][row]
        r0 = max(range(len(fin)), key=fin.__getitem__)
        s, p = fin[r0], ("c", sid, row, r0)
        cf, last, busy, buf = self.comm_free, self.last_comm, self.comm_busy, self.buf
        nout, nin, lout, lin = self.nic_out, self.nic_in, self.last_nout, self.last_nin
        for d in sd.members:
            if cf[d] > s:
                s, p = cf[d], last[d]
        for m in sd.machines:
            if nout[m] > s:
                s, p = nout[m], lout[m]
            if nin[m] > s:
                s, p = nin[m], lin[m]
        for x, t in enumerate(sd.gather_times):  # one collective per factor, back to back
            self.gathers.append((g, x, s, s + t, p))
            s, p = s + t, ("a", len(self.gathers) - 1)
        for d in sd.members:
            cf[d], last[d] = s, p
            busy[d] += sd.gather_total
            if sd.buffer_bytes > buf[d]:
                buf[d] = sd.buffer_bytes
        for m in sd.machines:
            nout[m] = nin[m] = s
            lout[m] = lin[m] = p
        cfree, comp, lt = self.cfree, self.comp, self.last_task
        ready, ready_ref = 0.0, None
        for d, t in zip(sd.devices, sd.recompute):
            st, pr = (s, p) if s >= cfree[d] else (cfree[d], lt[d])
            ref = ("r", len(self.recomputes))
            self.recomputes.append((g, d, st, st + t, pr))
            cfree[d] = st + t
            comp[d] += t
            lt[d] = ref
            if st + t >= ready:
                ready, ready_ref = st + t, ref
        self.sfb_ready[g] = (ready, ready_ref)

    # ---- synchronisation and update ----------------------------------------------------------
    def _syncs(self) -> list[float]:
        """Gradient synchronisations in reverse group order; returns per-device last sync end.

        Only syncs use the comm streams and network sides from here on, so a sync over the same
        members as the previous one finds all of them free at that sync's end: consecutive syncs
        over one member set are chained without per-device work, which is settled once per run.
        """
        n = self.sim.num_devices
        sync_end = [0.0] * n
        self.sync_last: list = [None] * n
        cf, last = self.comm_free, self.last_comm
        cur = None  # member tuple of the current run of syncs
        run_end, run_ref, run_busy, run_bytes = 0.0, None, 0.0, 0.0

        def settle():
            for d in cur.sync_devices:
                cf[d] = run_end
                last[d] = run_ref
                self.comm_busy[d] += run_busy
                if run_bytes > self.buf[d]:
                    self.buf[d] = run_bytes
                sync_end[d], self.sync_last[d] = run_end, run_ref
            for m in cur.sync_machines:
                self.nic_out[m] = self.nic_in[m] = run_end
                self.last_nout[m] = self.last_nin[m] = run_ref

        for g in reversed(range(len(self.gds))):
            gd = self.gds[g]
            if gd.sync == "none":
                continue
            s, p = self.sfb_ready[g] if gd.sfb is not None else (self.group_finish[g], ("b", g))
            if cur is not None and gd.sync_devices == cur.sync_devices:
                if run_end > s:
                    s, p = run_end, run_ref
            else:
                if cur is not None:
                    settle()
                cur, run_busy, run_bytes = gd, 0.0, 0.0
                for d in gd.sync_devices:
                    if cf[d] > s:
                        s, p = cf[d], last[d]
                for m in gd.sync_machines:
                    if self.nic_out[m] > s:
                        s, p = self.nic_out[m], self.last_nout[m]
                    if self.nic_in[m] > s:
                        s, p = self.nic_in[m], self.last_nin[m]
            e = s + gd.sync_time
            run_ref = ("s", len(self.syncs))
            self.syncs.append((g, s, e, p))
            run_end = e
            run_busy += gd.sync_time
            run_bytes = max(run_bytes, gd.sync_bytes)
        if cur is not None:
            settle()
        return sync_end

    def _holdings(self):
        """Per device: optimizer seconds, held bytes, max working set, holds-params flag."""
        sim, gds = self.sim, self.gds
        n = sim.num_devices
        opt, mem, work = np.zeros(n), np.zeros(n), np.zeros(n)
        holds = np.zeros(n, dtype=bool)
        gcomp = [0.0] * len(gds)
        by_layout: dict[int, tuple[Layout, list[int]]] = {}
        for g, gd in enumerate(gds):
            for u in gd.units:
                if u.layout is not None:
                    entry = by_layout.get(id(u.layout))
                    if entry is None:
                        by_layout[id(u.layout)] = (u.layout, [g])
                    else:
                        entry[1].append(g)
                    gcomp[g] += u.layout.gsum[g]
                else:
                    d = u.devices[0]
                    opt[d] += u.dur[OPT]
                    mem[d] += u.mem
                    work[d] = max(work[d], u.work)
                    holds[d] |= u.mem > 0
                    gcomp[g] += sum(u.dur)
            if gd.sfb is not None:
                gcomp[g] += sum(gd.sfb.recompute)
        gb = self.sim.static.grad_bytes
        for lay, gs in by_layout.values():
            if len(gs) >= 4:  # many groups on one layout: numpy over the [groups, replicas] block
                dv = lay.dev_arr
                opt[dv] += lay.dur[OPT][gs].sum(axis=0)
                mem[dv] += lay.mem[gs].sum(axis=0)
                work[dv] = np.maximum(work[dv], lay.work[gs].max(axis=0))
                if gb[gs].sum() > 0:
                    holds[dv] = True
                continue
            dur_o, mem_l, work_l = lay.dur_l[OPT], lay.mem_l, lay.work_l
            for g in gs:
                h = gb[g] > 0
                for r, d in enumerate(lay.devices):
                    opt[d] += dur_o[g][r]
                    mem[d] += mem_l[g][r]
                    if work_l[g][r] > work[d]:
                        work[d] = work_l[g][r]
                    if h:
                        holds[d] = True
        return opt, mem, work, holds, gcomp

    def execute(self, trace: bool) -> SimResult:
        sim = self.sim
        k = len(self.gds)
        self._phase(FWD, list(range(k)))
        self._phase(BWD, list(reversed(range(k))))
        sync_end = self._syncs()
        opt, mem, work, holds, gcomp = self._holdings()
        n = sim.num_devices
        before = list(self.cfree)
        upd_start = [0.0] * n
        final = list(before)
        comp = self.comp
        for d in range(n):
            if holds[d]:
                s = max(before[d], sync_end[d])
                dur = float(opt[d]) + sim.step_overhead[d]
                upd_start[d] = s
                final[d] = s + dur
                comp[d] += dur
        t_iter = max(max(final), max(self.comm_free))
        compute = comp
        peak = (mem + work + np.array(self.buf)).tolist()
        cap = sim.capacity
        oom_devices = [(d, peak[d] - cap[d]) for d in range(n) if peak[d] > cap[d]]
        def path(final=final, before=before, upd_start=upd_start, sync_end=sync_end, holds=holds):
            return self._critical_path(final, before, upd_start, sync_end, holds)

        events = self._events(upd_start, final, holds) if trace else None
        return SimResult(
            iteration_time_s=t_iter, oom=bool(oom_devices), peak_memory_bytes=peak,
            memory_capacity_bytes=list(cap), oom_devices=oom_devices, compute_time_s=compute,
            comm_time_s=list(self.comm_busy), idle_time_s=[t_iter - c for c in compute],
            group_finish_s=list(self.group_finish), group_compute_s=gcomp, path_fn=path,
            events=events, device_names=list(sim.device_names))

    # ---- critical path and timeline -------------------------------------------------------
    def _seg_task(self, sid: int, row: int, r: int) -> tuple[str, float, float, object]:
        ph, stages, unit, start, cf, ready, rsrc, prev, fin = self.segs[sid]
        s = start[r] if row == 0 else fin[row - 1][r]
        if row > 0:
            pred = ("c", sid, row - 1, r)
        elif ready is not None and ready[r] > cf[r]:
            pred = rsrc[r]
        else:
            pred = prev[r] if cf[r] > 0 else None
        g, j = stages[row]
        name = f"{self._stage_name(ph, g, j)} @d{unit.devices[r]}"
        return name, s, fin[row][r], pred

    def _resolve(self, ref):
        """(name, start, end, predecessor ref) of a task reference."""
        kind = ref[0]
        if kind == "c":
            return self._seg_task(*ref[1:])
        if kind == "f":
            f, s, e, p = self.flows[ref[1]]
            name = (f"send {PHASE_NAME[f.src[0]]} g{f.src[1]} -> {PHASE_NAME[f.dst[0]]} g{f.dst[1]} "
                    f"d{f.a}->d{f.b} ({f.nbytes:.0f} B)")
            return name, s, e, p
        if kind == "s":
            g, s, e, p = self.syncs[ref[1]]
            if p is not None and p[0] == "b":
                p = self._bwd_last(p[1])
            return f"{self.gds[g].sync} g{g}", s, e, p
        if kind == "a":
            g, x, s, e, p = self.gathers[ref[1]]
            sd = self.gds[g].sfb
            return f"allgather g{g} {sd.gather_names[x]} ({sd.gather_bytes[x]:.0f} B)", s, e, p
        if kind == "r":
            g, d, s, e, p = self.recomputes[ref[1]]
            return f"sfb g{g} @d{d}", s, e, p
        raise AssertionError(ref)

    def _bwd_last(self, g: int):
        """Reference of the replica of group ``g``'s backward that finished last."""
        sid, row = self.stage_loc[(BWD, g, 0)]
        r = int(np.argmax(self.segs[sid][8][row]))
        return ("c", sid, row, r)

    def _critical_path(self, final, before, upd_start, sync_end, holds) -> list[str]:
        d = int(np.argmax(final))
        names: list[str] = []
        if holds[d]:
            names.append(f"opt @d{d}")
            ref = self.sync_last[d] if sync_end[d] > before[d] else self.last_task[d]
        else:
            ref = self.last_task[d]
        guard = 0
        while ref is not None and guard < 1_000_000:
            guard += 1
            if ref[0] == "c" and ref[2] > 0:
                # Inside a segment the path runs back through the same replica's earlier stages.
                _, sid, row, r = ref
                ph, stages, unit = self.segs[sid][:3]
                suffix = f" @d{unit.devices[r]}"
                names.extend(self._stage_name(ph, g, j) + suffix for g, j in stages[row:0:-1])
                ref = ("c", sid, 0, r)
                continue
            name, _, _, ref = self._resolve(ref)
            names.append(name)
        names.reverse()
        return names

    def _stage_name(self, ph: int, g: int, j: int) -> str:
        chunk = f".{j}" if self.gds[g].units[j].layout is None else ""
        return f"{PHASE_NAME[ph]} g{g}{chunk}"

    def _events(self, upd_start, final, holds) -> list[SimEvent]:
        ev: list[SimEvent] = []
        for sid, seg in enumerate(self.segs):
            ph, stages, unit = seg[0], seg[1], seg[2]
            for row in range(len(stages)):
                for r, d in enumerate(unit.devices):
                    name, s, e, _ = self._seg_task(sid, row, r)
                    if e > s:
                        ev.append(SimEvent(name, d, "compute", s, e, PHASE_NAME[ph]))
        for fid in range(len(self.flows)):
            name, s, e, _ = self._resolve(("f", fid))
            f = self.flows[fid][0]
            ev.append(SimEvent(name, f.a, "comm", s, e, "transfer"))
            ev.append(SimEvent(name, f.b, "comm", s, e, "transfer"))
        for g, s, e, _ in self.syncs:
            gd = self.gds[g]
            for d in gd.sync_devices:
                ev.append(SimEvent(f"{gd.sync} g{g}", d, "comm", s, e, gd.sync))
        for gid in range(len(self.gathers)):
            name, s, e, _ = self._resolve(("a", gid))
            for d in self.gds[self.gathers[gid][0]].sfb.members:
                ev.append(SimEvent(name, d, "comm", s, e, "allgather"))
        for g, d, s, e, _ in self.recomputes:
            if e > s:
                ev.append(SimEvent(f"sfb g{g} @d{d}", d, "compute", s, e, "sfb"))
        for d in range(self.sim.num_devices):
            if holds[d]:
                ev.append(SimEvent(f"opt @d{d}", d, "compute", upd_start[d], final[d], "opt"))
        ev.sort(key=lambda x: (x.start, x.device))
        return ev
