"""The event-driven simulator of one training iteration under a plan.

Resources: every device has a **compute stream** and a **communication stream** (so compute
overlaps transfers); every machine has a network link with an outgoing and an incoming side,
shared by all flows and collectives crossing machines (contended: they take turns). Each resource
serves its tasks in the executor's global step order (:mod:`tag.parallel.schedule`): for every
unit in forward order the transfers into its forward stage, then the stage; the same for the
backward stages in reverse order; then the gradient synchronisations in reverse group order; then
one optimizer step per device. A task starts when its inputs are ready and every resource it uses
is free, so the iteration is a max-plus system: shorter tasks (faster devices, more bandwidth)
never make any task finish later.

Tasks: compute stages (per replica), point-to-point messages (``latency + bytes / bandwidth``;
the flows from one device to another that one stage needs are one message, as the executor's CPU
ranks pack them; occupy both endpoints' comm streams, and both machines' network sides when crossing machines;
a flow is a rendezvous, as in the executor, where sender and receiver post their halves at the
step of the schedule and wait for them: it starts once both endpoints' compute streams reached
that step, and both compute streams wait for it to finish),
synchronisations (one collective over the replica set, or PS push+pull, see
:mod:`tag.cost.comm`; occupy every participant's comm stream and the network sides of the
machines it spans; on a CPU device, whose rank computes on every core it has, a sync also waits
for the device's compute: :attr:`Simulator.shared_stream`, and syncs of one kind over one replica set
are coalesced into one collective: :meth:`Simulator.sync_jobs`), optimizer steps (after the device's last compute and its last sync).

Sufficient Factor Broadcasting (``GroupPlan.sfb``, :mod:`tag.sim.sfb`): right after an SFB
group's backward stage (once every replica finished it), the all-gathers of its factors, one
after the other over the replicas (comm streams and network sides, served like point-to-point
transfers: before the gradient syncs); then every replica recomputes the SFB gradients on the
global batch on its compute stream (before its next stage); then the group's remaining
gradients are synchronised (the sync waits for the last replica's recompute). The executor's
order, docs/DESIGN.md "Sufficient Factor Broadcasting".

Wake penalty (CPU devices with a profiled one, :mod:`tag.cost.profiler`): the first stage of a
segment on a device that idled ``gap`` seconds since its last compute (blocked on transfers)
takes ``wake * (1 - exp(-gap / tau)) / (1 - exp(-gap_s / tau))`` longer (:func:`wake_extra`).

Speed: runs of consecutive stages on one data-parallel layout with no incoming transfer form a
*segment* computed with one numpy expression (cumulative sums over groups). :meth:`Simulator.run`
uses the fast loop (:class:`_FastRun`: no task records); the reference loop (:class:`_Run`)
records every task and its predecessor, for the critical path (replayed on first access) and the
timeline (``trace=True``); both give the same floats (``tests/test_sim_reference.py``). The flows
between two groups' deployments are cached by what they depend on (:class:`PairTemplate`).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import PlanError
from ..parallel.strategy import strategy_of
from .result import SimEvent, SimResult
from .static import BWD, FWD, OPT, PARAM, build_static
from .units import (
    Flow,
    GroupData,
    Layout,
    PairTemplate,
    SyncJob,
    Unit,
    make_layout,
    mp_unit,
    pair_kinds,
)

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
        self.shared_stream = [d.gpu.name == "cpu" for d in topology.devices]
        """Per device: communication shares the compute cores (a CPU rank uses every core it has
        for compute, so gloo has no spare core to progress a collective: syncs start after the
        device's compute). GPUs have copy engines: their syncs overlap compute."""
        self._buckets: dict[tuple, float] = {}  # (bucket key, bytes) -> seconds
        self._layouts: dict[tuple, Layout] = {}
        self._groups: dict[tuple, GroupData] = {}
        self._pairs: dict[tuple, _Pair] = {}
        self._kinds: dict[tuple[int, int], tuple] = {}  # dp -> dp group pair -> (kinds id, kinds)
        self._kind_ids: dict[tuple, tuple] = {}  # pair_kinds -> (id, kinds)
        self._templates: dict[tuple, PairTemplate] = {}
        self._serial = 0
        # Pairs without non-batch gradients: no flow when both groups share one layout.
        local = {pr for pr, es in self.static.edges.items() if not any(e.grad for e in es)}
        self._pair_list = [(g1, g2, (g1, g2) in local) for g1, g2 in self.static.pairs]
        self._pair_src = np.array([g1 for g1, _ in self.static.pairs], dtype=np.int64)
        self._pair_dst = np.array([g2 for _, g2 in self.static.pairs], dtype=np.int64)
        self._pair_self = self._pair_src == self._pair_dst
        self._pair_nonlocal = np.array([not loc for _, _, loc in self._pair_list], dtype=bool)
        self._names: dict[tuple, str] = {}
        self._sfb = None  # tag.sim.sfb.SfbCosts, built on the first plan using SFB
        self.wake: list[tuple | None] = []
        """Per device: ``(table [K, 2, B+1], tau_s, 1 / (1 - exp(-gap_s / tau_s)))`` of its wake
        penalty (:meth:`tag.cost.CostModel.wake_penalty`), or None."""
        pen = getattr(self.costs, "wake_penalty", None)
        for d in range(topology.num_devices):
            w = pen(d) if pen is not None else None
            self.wake.append(None if w is None else (w[0], w[2], 1.0 / (1.0 - math.exp(-w[1] / w[2]))))
        self.any_wake = any(w is not None for w in self.wake)

    # ---- cached plan-derived data -------------------------------------------------------
    def layout(self, devices: tuple[int, ...], batches: tuple[int, ...]) -> Layout:
        key = (devices, batches)
        lay = self._layouts.get(key)
        if lay is None:
            if len(self._layouts) > CACHE_LIMIT:
                self._layouts.clear()
            lay = make_layout(self.static, self.tables, self.dev_class, devices, batches)
            self._serial += 1
            lay.uid = self._serial
            self._layouts[key] = lay
        return lay

    def group_data(self, g: int, gp, key=None) -> GroupData:
        """Units and synchronisation of group ``g`` deployed as ``gp`` (cached by its key)."""
        key = (g, plan_key(gp) if key is None else key)
        gd = self._groups.get(key)
        if gd is None:
            if len(self._groups) > CACHE_LIMIT:
                self._groups.clear()
                self._pairs.clear()  # keyed by the serials of the cleared entries
            gd = self._make_group(g, gp)
            self._serial += 1
            gd.serial = self._serial
            gd.lid = gd.layout.uid if gd.layout is not None else -gd.serial
            self._groups[key] = gd
        return gd

    def _make_group(self, g: int, gp) -> GroupData:
        """Cost the lowering of ``gp`` by its strategy (:mod:`tag.parallel`): a unit running the
        whole group on a batch split (a vectorised :class:`Layout`) or position chunks on one
        device each (:func:`mp_unit`), and the gradient collective."""
        st, comm = self.static, self.comm
        strategy = strategy_of(gp)
        lowered = strategy.units(g, gp, self.graph, st.batch_size)
        devs = tuple(gp.devices)
        sbytes = float(st.grad_bytes[g])
        sfb = None
        if gp.sfb:  # validated here (PlanError naming the op); its gradients leave the sync
            if self._sfb is None:
                from .sfb import SfbCosts

                self._sfb = SfbCosts(self)
            sfb = self._sfb.group(g, gp)
            sbytes = max(0.0, sbytes - sfb.saved_bytes)
        if strategy.chunked:  # full-batch chunks of the group's positions, one device each
            if any(len(u.replicas) != 1 or u.positions is None for u in lowered):
                raise PlanError(f"plan: groups[{g}]: strategy {gp.sync!r}: the simulator costs position chunks "
                                "on one device each")
            units = [mp_unit(st, self.costs, g, j, u.replicas[0].device, *u.positions) for j, u in enumerate(lowered)]
            chunk_of = {p: j for j, u in enumerate(lowered) for p in range(*u.positions)}
            return GroupData(units, "none", 0.0, (), (), 0.0, True, chunk_of, ukey=("mp", devs))
        if len(lowered) != 1 or lowered[0].positions is not None:
            raise PlanError(f"plan: groups[{g}]: strategy {gp.sync!r}: the simulator costs one unit over the "
                            "whole group or position chunks")
        batches = lowered[0].batches
        lay = self.layout(devs, batches)
        unit = Unit(g, -1, devs, batches, lay.starts, lay)
        coll = strategy.collective(gp)
        if coll is None or sbytes <= 0:
            return GroupData([unit], "none", 0.0, (), (), 0.0, sfb=sfb, layout=lay,
                             ukey=("dp", devs, batches))
        server, members = coll.server, coll.members
        t = self._sync_seconds(coll.op, coll.devices, server, sbytes)
        machines = tuple(sorted({comm.machine_of[d] for d in members}))
        deferred = all(self.shared_stream[d] for d in members)
        return GroupData([unit], coll.op, t, members, machines if len(machines) > 1 else (), sbytes, sfb=sfb,
                         layout=lay, ukey=("dp", devs, batches), bucket=(coll.op, devs, server) if deferred else None)

    def _sync_seconds(self, op: str, devs: tuple[int, ...], server: int | None, nbytes: float) -> float:
        """One gradient collective ``op`` (:class:`tag.parallel.Collective`) of ``nbytes`` over the
        replicas ``devs`` (``ps``: via ``server``)."""
        if op == "ps":
            return self.comm.ps_time(devs, server, nbytes)
        if op == "allreduce":
            return self.comm.allreduce_time(devs, nbytes)
        raise PlanError(f"collective {op!r}: the simulator costs 'allreduce' and 'ps'")

    def sync_jobs(self, gds: list[GroupData]) -> list[tuple[tuple[int, ...], object]]:
        """The iteration's gradient collectives in issue order: ``(groups, job)`` with ``job`` the
        group's :class:`GroupData` or, for deferred syncs of equal :attr:`GroupData.bucket`, one
        :class:`SyncJob` over the concatenated gradients (the executor's buckets,
        ``tag/executor/comm.py``), placed at its first group in reverse group order."""
        jobs: list = []
        open_: dict[tuple, int] = {}
        for g in range(len(gds) - 1, -1, -1):
            gd = gds[g]
            if gd.sync == "none":
                continue
            j = open_.get(gd.bucket) if gd.bucket is not None else None
            if j is None:
                if gd.bucket is not None:
                    open_[gd.bucket] = len(jobs)
                jobs.append(((g,), gd))
            else:
                jobs[j] = (jobs[j][0] + (g,), jobs[j][1])
        for i, (gs, gd) in enumerate(jobs):
            if len(gs) > 1:
                nbytes = sum(gds[g].sync_bytes for g in gs)
                jobs[i] = (gs, SyncJob(gs, gd.sync, self._bucket_time(gd.bucket, nbytes), gd.sync_devices,
                                       gd.sync_machines, nbytes))
        return jobs

    def _bucket_time(self, key: tuple, nbytes: float) -> float:
        t = self._buckets.get((key, nbytes))
        if t is None:
            t = self._sync_seconds(*key, nbytes)
            if len(self._buckets) > CACHE_LIMIT:
                self._buckets.clear()
            self._buckets[(key, nbytes)] = t
        return t

    def pair(self, g1: int, gd1: GroupData, g2: int, gd2: GroupData) -> _Pair:
        """Flows from group ``g1`` deployed as ``gd1`` to ``g2`` deployed as ``gd2`` (cached, and
        their :class:`PairTemplate` cached by what it depends on: the tensors crossing and the
        two replica sets)."""
        key = (gd1.serial, gd2.serial)
        pr = self._pairs.get(key)
        if pr is None:
            if len(self._pairs) > CACHE_LIMIT:
                self._pairs.clear()
            kid = self._kinds.get((g1, g2)) if not (gd1.mp or gd2.mp) else None
            if kid is None:
                kinds = pair_kinds(self.static, g1, gd1, g2, gd2)
                kid = self._kind_ids.setdefault(kinds, (len(self._kind_ids), kinds))
                if not (gd1.mp or gd2.mp):
                    self._kinds[(g1, g2)] = kid
            tkey = (kid[0], gd1.ukey, gd2.ukey)
            tpl = self._templates.get(tkey)
            if tpl is None:
                if len(self._templates) > CACHE_LIMIT:
                    self._templates.clear()
                tpl = self._templates[tkey] = PairTemplate(kid[1], gd1.units, gd2.units, self.comm)
            pr = self._pairs[key] = _Pair(tpl, g1, g2, self.static.num_groups)
        return pr

    def _stage_index(self, stage: tuple[int, int, int]) -> int:
        """Flat index of stage (phase, group, chunk) in a run's stage tables: ``ph * K + g + 2K * j``
        (data-parallel stages first, in group order); -1 for PARAM."""
        ph, g, j = stage
        k = self.static.num_groups
        return -1 if ph == PARAM else ph * k + g + 2 * k * j

    def _pairs_used(self, gds: list[GroupData]):
        """The pairs of groups whose deployments move tensors between them, in pair order."""
        for g1, g2, local in self._pair_list:
            gd1, gd2 = gds[g1], gds[g2]
            if g1 == g2:
                if not gd1.mp:
                    continue
            elif local and gd1.layout is not None and gd1.layout is gd2.layout:
                continue  # same replicas, same sample ranges: every move stays on its device
            pr = self._pairs.get((gd1.serial, gd2.serial))
            if pr is None:
                pr = self.pair(g1, gd1, g2, gd2)
            if pr.fast:
                yield pr

    def deploy(self, groups) -> list[GroupData]:
        """The cached :class:`GroupData` of every group of the deployment ``groups``."""
        k = self.static.num_groups
        if len(groups) != k:
            raise PlanError(f"plan: groups: expected {k} entries (one per op-group), got {len(groups)}")
        get, out = self._groups.get, []
        for g, gp in enumerate(groups):
            gd = get((g, plan_key(gp)))
            out.append(gd if gd is not None else self.group_data(g, gp))
        return out

    # ---- the event loop -------------------------------------------------------------------
    def run(self, groups, *, trace: bool = False) -> SimResult:
        """Simulate one iteration of the deployment ``groups`` (one GroupPlan per op-group).

        Without ``trace`` the fast event loop (:class:`_FastRun`) computes the result and the
        critical path is computed on first access by replaying the iteration with the reference
        event loop (:class:`_Run`, which records every task's predecessor); with ``trace`` the
        reference loop runs directly and records the timeline."""
        gds = self.deploy(groups)
        if trace:
            return self.run_reference(gds, trace=True)
        return _FastRun(self, gds).execute()

    def run_reference(self, gds: list[GroupData], *, trace: bool = False) -> SimResult:
        """Simulate with the reference event loop (every task recorded; slow)."""
        incoming: dict[tuple, list] = {}
        for pr in self._pairs_used(gds):
            for dst, fl in pr.by_dst:
                lst = incoming.get(dst)
                if lst is None:
                    incoming[dst] = list(fl)
                else:
                    lst.extend(fl)
        return _Run(self, gds, incoming).execute(trace)


def wake_extra(sim: Simulator, unit: Unit, g: int, ph: int, start: list[float], cend: list[float]) -> list[float] | None:
    """Extra seconds per replica of ``unit``'s stage (group ``g``, phase ``ph``) starting at ``start``
    on devices whose last compute ended at ``cend`` (None: no penalty anywhere). An mp chunk pays
    its share (by time) of its group's penalty at the full batch."""
    out = None
    for r, d in enumerate(unit.devices):
        w = sim.wake[d]
        if w is None:
            continue
        gap = start[r] - cend[d]
        if gap <= 0.0:
            continue
        if unit.layout is not None:
            x = w[0][g, ph, unit.batches[r]]
        else:
            b = sim.graph.batch_size
            full = sim.tables[sim.dev_class[d]][g, ph, b]
            x = w[0][g, ph, b] * (unit.dur[ph] / full) if full > 0 else 0.0
        if x <= 0.0:
            continue
        if out is None:
            out = [0.0] * len(unit.devices)
        out[r] = float(x) * (1.0 - math.exp(-gap / w[1])) * w[2]
    return out


def _message(parts: list[Flow], comm) -> Flow:
    """The flows ``parts`` (one source and destination device, one destination stage) as one
    message: their bytes in one transfer, named after the first flow."""
    f = parts[0]
    nbytes = sum(x.nbytes for x in parts)
    return Flow(f.src, f.src_rep, f.dst, f.dst_rep, f.a, f.b, nbytes, comm.p2p_time(f.a, f.b, nbytes), f.ma, f.mb,
                len(parts))


def _merge_fast(inc, sfin, p2p) -> list[tuple]:
    """The fast loop's flows into one stage as messages ``(source ready, a, b, ma, mb, seconds,
    destination replica, bytes)``, one per (a, b) (:func:`_message`, the same floats)."""
    acc: dict[tuple[int, int], tuple] = {}
    merged = False
    for si, sr, a, b, ma, mb, t, r, nb in inc:
        s = sfin[si][sr] if si >= 0 else 0.0
        x = acc.get((a, b))
        if x is None:
            acc[(a, b)] = (s, a, b, ma, mb, t, r, nb)
        else:
            acc[(a, b)] = (s if s > x[0] else x[0], a, b, ma, mb, -1.0, r, x[7] + nb)
            merged = True
    if not merged:
        return list(acc.values())
    return [m if m[5] >= 0.0 else (*m[:5], p2p(m[1], m[2], m[7]), *m[6:]) for m in acc.values()]


class _Pair:
    """The flows between two groups' deployments (a :class:`PairTemplate` placed at groups ``g1``,
    ``g2``): per destination stage as plain tuples ``(source stage index, source replica, a, b,
    source machine, destination machine, seconds, destination replica, bytes)`` for the fast loop
    (``fast``), and as :class:`Flow` objects for the reference loop (``by_dst``, built on demand)."""

    __slots__ = ("tpl", "g1", "g2", "fast", "_by_dst")

    def __init__(self, tpl: PairTemplate, g1: int, g2: int, k: int):
        self.tpl, self.g1, self.g2 = tpl, g1, g2
        src_base = [ph * k + g1 for ph in (FWD, BWD)]
        k2 = 2 * k
        # Tuples of numbers only: the garbage collector stops tracking them (big caches stay cheap).
        self.fast = tuple([(ph * k + g2 + k2 * du,
                            tuple([(src_base[sp] + k2 * su if sp != PARAM else -1, ri, a, b, ma, mb, t, rj, nb)
                                   for sp, su, ri, rj, a, b, ma, mb, t, nb in fl]))
                           for (ph, du), fl in tpl.by_dst])
        self._by_dst = None

    @property
    def by_dst(self) -> list[tuple[tuple, list[Flow]]]:
        if self._by_dst is None:
            g1, g2 = self.g1, self.g2
            self._by_dst = [((ph, g2, du), [Flow((sp, g1, su), ri, (ph, g2, du), rj, a, b, nb, t, ma, mb)
                                            for sp, su, ri, rj, a, b, ma, mb, t, nb in fl])
                            for (ph, du), fl in self.tpl.by_dst]
        return self._by_dst

    @property
    def flows(self) -> list[Flow]:
        return [f for _, fl in self.by_dst for f in fl]


class _Run:
    """State of one simulated iteration (see the module docstring)."""

    def __init__(self, sim: Simulator, gds: list[GroupData], incoming: dict):
        self.sim, self.gds, self.incoming = sim, gds, incoming
        n, m = sim.num_devices, sim.num_machines
        self.cfree = [0.0] * n
        self.cend = [0.0] * n  # end of each device's last compute (wake penalty)
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
        self.syncs: list[tuple] = []  # (groups, job, start, end, pred)
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
        cfree, ltask = self.cfree, self.last_task
        # One message per (a, b): every flow from device a to device b this stage needs (the
        # executor's CPU ranks send a step's pieces to one peer packed), once all are produced.
        msgs: dict[tuple[int, int], list] = {}  # (a, b) -> [flows, source ready, its ref]
        for f in inc:
            src = f.src
            if src[0] == PARAM:
                s, p = 0.0, None
            else:
                sid, row = loc[src]
                s = segs[sid][8][row][f.src_rep]
                p = ("c", sid, row, f.src_rep)
            m = msgs.get((f.a, f.b))
            if m is None:
                msgs[(f.a, f.b)] = [[f], s, p]
            else:
                m[0].append(f)
                if s > m[1]:
                    m[1], m[2] = s, p
        for parts, s, p in msgs.values():
            f = parts[0] if len(parts) == 1 else _message(parts, self.sim.comm)
            a, b, ma = f.a, f.b, f.ma
            if cf[a] > s:
                s, p = cf[a], last[a]
            if cf[b] > s:
                s, p = cf[b], last[b]
            if cfree[a] > s:  # rendezvous: both ends reached this step of the schedule
                s, p = cfree[a], ltask[a]
            if cfree[b] > s:
                s, p = cfree[b], ltask[b]
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
            cf[a] = cf[b] = cfree[a] = cfree[b] = e  # both ends wait for the transfer
            last[a] = last[b] = ltask[a] = ltask[b] = ref
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
            pen = wake_extra(self.sim, unit, g, ph, start, self.cend) if self.sim.any_wake else None
            go = start if pen is None else [x + y for x, y in zip(start, pen)]
            if length > 1:  # a run of stages on one layout: cumulative sums over the groups
                if ph == FWD:
                    base, rows = lay.cum_fwd[g], lay.cum_fwd[g + 1:g + length + 1]
                else:
                    i0 = k - 1 - g
                    base, rows = lay.cum_bwd[i0], lay.cum_bwd[i0 + 1:i0 + length + 1]
                fin_a = np.asarray(go) + (rows - base)
                fin = fin_a.tolist()
                mx = fin_a.max(axis=1).tolist() if ph == BWD else None
            else:
                dur = lay.row(g)[ph] if lay is not None else (unit.dur[ph],)
                fin = [[x + y for x, y in zip(go, dur)]]
                mx = [max(fin[0])] if ph == BWD else None
            end = fin[-1]
            comp = self.comp
            sid = len(self.segs)
            last = self.last_task
            prev = [last[d] for d in devs]
            cend = self.cend
            for r, d in enumerate(devs):
                cfree[d] = cend[d] = end[r]
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
            cfree[d] = self.cend[d] = st + t
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
        cf, last, shared = self.comm_free, self.last_comm, self.sim.shared_stream
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

        for gs, gd in self.sim.sync_jobs(self.gds):
            s, p = -math.inf, None
            for g in gs:
                sg, pg = self.sfb_ready[g] if self.gds[g].sfb is not None else (self.group_finish[g], ("b", g))
                if sg > s:
                    s, p = sg, pg
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
                    if shared[d] and self.cfree[d] > s:
                        s, p = self.cfree[d], self.last_task[d]
                for m in gd.sync_machines:
                    if self.nic_out[m] > s:
                        s, p = self.nic_out[m], self.last_nout[m]
                    if self.nic_in[m] > s:
                        s, p = self.nic_in[m], self.last_nin[m]
            e = s + gd.sync_time
            run_ref = ("s", len(self.syncs))
            self.syncs.append((gs, gd, s, e, p))
            run_end = e
            run_busy += gd.sync_time
            run_bytes = max(run_bytes, gd.sync_bytes)
        if cur is not None:
            settle()
        return sync_end

    def execute(self, trace: bool) -> SimResult:
        k = len(self.gds)
        self._phase(FWD, list(range(k)))
        self._phase(BWD, list(reversed(range(k))))
        sync_end = self._syncs()
        holds_etc = _holdings(self.sim, self.gds)
        final, before, upd_start, holds, res = _result(self.sim, self, sync_end, holds_etc)

        def path(final=final, before=before, upd_start=upd_start, sync_end=sync_end, holds=holds):
            return self._critical_path(final, before, upd_start, sync_end, holds)

        res.path_fn = path
        if trace:
            res.events = self._events(upd_start, final, holds)
        return res

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
            more = f" +{f.parts - 1}" if f.parts > 1 else ""
            name = (f"send {PHASE_NAME[f.src[0]]} g{f.src[1]}{more} -> {PHASE_NAME[f.dst[0]]} g{f.dst[1]} "
                    f"d{f.a}->d{f.b} ({f.nbytes:.0f} B)")
            return name, s, e, p
        if kind == "s":
            gs, gd, s, e, p = self.syncs[ref[1]]
            if p is not None and p[0] == "b":
                p = self._bwd_last(p[1])
            return _sync_name(gd, gs), s, e, p
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
        for gs, gd, s, e, _ in self.syncs:
            for d in gd.sync_devices:
                ev.append(SimEvent(_sync_name(gd, gs), d, "comm", s, e, gd.sync))
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


class _FastRun:
    """The event loop of :class:`_Run` without its bookkeeping (task records, predecessors): the
    same tasks in the same order with the same floating-point operations, so the same times to
    the bit (``tests/test_sim_reference.py``). Stages are flat indices (``Simulator._stage_index``),
    transfers plain tuples (:class:`_Pair`)."""

    def __init__(self, sim: Simulator, gds: list[GroupData]):
        self.sim, self.gds = sim, gds
        n, m = sim.num_devices, sim.num_machines
        incoming: dict[int, tuple] = {}
        buf = [0.0] * n
        pairs = sim._pairs
        # Simulator._pairs_used with numpy: a pair moves tensors unless it is within one group
        # (only mp chunks exchange) or between two groups on one layout (only non-batch gradients).
        lid = np.array([gd.lid for gd in gds])
        l1, l2 = lid[sim._pair_src], lid[sim._pair_dst]
        used = np.where(sim._pair_self, l1 < 0, sim._pair_nonlocal | (l1 != l2))
        plist = sim._pair_list
        for p in np.flatnonzero(used).tolist():
            g1, g2, _ = plist[p]
            gd1, gd2 = gds[g1], gds[g2]
            pr = pairs.get((gd1.serial, gd2.serial))
            if pr is None:
                pr = sim.pair(g1, gd1, g2, gd2)
            if not pr.fast:
                continue
            for dst, fl in pr.fast:
                lst = incoming.get(dst)
                incoming[dst] = fl if lst is None else lst + fl
        self.incoming = incoming
        self.buf = buf
        self.cfree = [0.0] * n
        self.cend = [0.0] * n  # end of each device's last compute (wake penalty)
        self.comp = [0.0] * n
        self.comm_free = [0.0] * n
        self.comm_busy = [0.0] * n
        self.nic_out = [0.0] * m
        self.nic_in = [0.0] * m
        chunks = max([len(gd.units) for gd in gds])
        self.sfin: list = [None] * (2 * len(gds) * chunks)  # stage index -> finish per replica
        self.group_finish = [0.0] * len(gds)
        self.any_sfb = any(gd.sfb is not None for gd in gds)
        self.sfb_ready: dict[int, float] = {}

    def _transfer(self, inc: list, nrep: int) -> list[float]:
        ready = [0.0] * nrep
        cf, nout, nin, busy, sfin = self.comm_free, self.nic_out, self.nic_in, self.comm_busy, self.sfin
        cfree, buf = self.cfree, self.buf
        if len(inc) == 1:
            si, sr, a, b, ma, mb, t, r, nb = inc[0]
            msgs = ((sfin[si][sr] if si >= 0 else 0.0, a, b, ma, mb, t, r, nb),)
        else:  # one message per (a, b), as _Run._transfer
            msgs = _merge_fast(inc, sfin, self.sim.comm.p2p_time)
        for s, a, b, ma, mb, t, r, nb in msgs:
            if nb > buf[a]:
                buf[a] = nb
            if nb > buf[b]:
                buf[b] = nb
            x = cf[a]
            if x > s:
                s = x
            x = cf[b]
            if x > s:
                s = x
            x = cfree[a]
            if x > s:
                s = x
            x = cfree[b]
            if x > s:
                s = x
            if ma >= 0:
                x = nout[ma]
                if x > s:
                    s = x
                x = nin[mb]
                if x > s:
                    s = x
                e = s + t
                nout[ma] = nin[mb] = e
            else:
                e = s + t
            cf[a] = cf[b] = cfree[a] = cfree[b] = e
            busy[a] += t
            busy[b] += t
            if e > ready[r]:
                ready[r] = e
        return ready

    def _phase(self, ph: int, order: list[int]) -> None:
        """:meth:`_Run._phase`: segments of consecutive stages on one layout with no transfer in."""
        gds, incoming = self.gds, self.incoming
        k = len(gds)
        k2 = 2 * k
        base = ph * k
        sfb = ph == BWD and self.any_sfb
        fwd = ph == FWD
        cfree, comp, sfin, gf, cend = self.cfree, self.comp, self.sfin, self.group_finish, self.cend
        wake = self.sim.any_wake
        i, n = 0, len(order)
        while i < n:
            g = order[i]
            gd = gds[g]
            lay = gd.layout
            if lay is None:  # mp: one single-device stage per chunk
                units = gd.units
                nu = len(units)
                for j in (range(nu) if fwd else range(nu - 1, -1, -1)):
                    unit = units[j]
                    idx = base + g + k2 * j
                    d = unit.devices[0]
                    inc = incoming.get(idx)
                    if inc:
                        y = self._transfer(inc, 1)[0]
                        c = cfree[d]
                        st = y if y > c else c
                    else:
                        st = cfree[d]
                    pen = wake_extra(self.sim, unit, g, ph, [st], cend) if wake else None
                    x = (st if pen is None else st + pen[0]) + unit.dur[ph]
                    sfin[idx] = [x]
                    if not fwd and x > gf[g]:
                        gf[g] = x
                    cfree[d] = cend[d] = x
                    comp[d] += x - st
                i += 1
                continue
            idx = base + g
            devs = lay.devices
            inc = incoming.get(idx)
            if inc:
                ready = self._transfer(inc, len(devs))
                start = [y if y > cfree[d] else cfree[d] for d, y in zip(devs, ready)]
            else:
                start = [cfree[d] for d in devs]
            pen = wake_extra(self.sim, gd.units[0], g, ph, start, cend) if wake else None
            go = start if pen is None else [x + y for x, y in zip(start, pen)]
            e = i + 1
            if not (sfb and gd.sfb is not None):
                while e < n:
                    g2 = order[e]
                    gd2 = gds[g2]
                    if gd2.layout is not lay or base + g2 in incoming:
                        break
                    e += 1
                    if sfb and gd2.sfb is not None:
                        break
            length = e - i
            if length > 1:  # a run of stages on one layout: cumulative sums over the groups
                if fwd:
                    b0, rows = lay.cum_fwd[g], lay.cum_fwd[g + 1:g + length + 1]
                else:
                    i0 = k - 1 - g
                    b0, rows = lay.cum_bwd[i0], lay.cum_bwd[i0 + 1:i0 + length + 1]
                fin_a = np.asarray(go) + (rows - b0)
                fin = fin_a.tolist()
                end = fin[-1]
                if fwd:  # groups g .. g + length - 1
                    sfin[idx:idx + length] = fin
                else:  # groups g, g - 1, ..., g - length + 1; each its first and only stage
                    fin.reverse()
                    sfin[idx - length + 1:idx + 1] = fin
                    mx = fin_a.max(axis=1).tolist()
                    mx.reverse()
                    gf[g - length + 1:g + 1] = mx
            else:
                r = lay.rows[g]
                end = [x + y for x, y in zip(go, r[ph] if r is not None else lay.row(g)[ph])]
                sfin[idx] = end
                if not fwd:
                    x = max(end)
                    if x > gf[g]:
                        gf[g] = x
            for r, d in enumerate(devs):
                x = end[r]
                cfree[d] = cend[d] = x
                comp[d] += x - start[r]
            if sfb:
                g2 = order[e - 1]
                if gds[g2].sfb is not None:
                    self._sfb(g2, end)
            i = e

    def _sfb(self, g: int, fin: list[float]) -> None:
        """:meth:`_Run._sfb` without the task records."""
        sd = self.gds[g].sfb
        s = max(fin)
        cf, busy, buf, nout, nin = self.comm_free, self.comm_busy, self.buf, self.nic_out, self.nic_in
        for d in sd.members:
            if cf[d] > s:
                s = cf[d]
        for m in sd.machines:
            if nout[m] > s:
                s = nout[m]
            if nin[m] > s:
                s = nin[m]
        for t in sd.gather_times:
            s = s + t
        for d in sd.members:
            cf[d] = s
            busy[d] += sd.gather_total
            if sd.buffer_bytes > buf[d]:
                buf[d] = sd.buffer_bytes
        for m in sd.machines:
            nout[m] = nin[m] = s
        cfree, comp = self.cfree, self.comp
        ready = 0.0
        for d, t in zip(sd.devices, sd.recompute):
            st = s if s >= cfree[d] else cfree[d]
            cfree[d] = self.cend[d] = st + t
            comp[d] += t
            if st + t >= ready:
                ready = st + t
        self.sfb_ready[g] = ready

    def _syncs(self) -> list[float]:
        """:meth:`_Run._syncs` without the task records."""
        n = self.sim.num_devices
        sync_end = [0.0] * n
        cf, busy, buf, nout, nin = self.comm_free, self.comm_busy, self.buf, self.nic_out, self.nic_in
        gds, gf, sfb_ready = self.gds, self.group_finish, self.sfb_ready
        cfree, shared = self.cfree, self.sim.shared_stream

        def close_run(gd, end: float, run_busy: float, run_bytes: float) -> None:
            """A run of syncs over ``gd``'s members ends at ``end`` (seconds): their links are
            busy until then and hold the run's largest buffer (bytes)."""
            for d in gd.sync_devices:
                cf[d] = sync_end[d] = end
                busy[d] += run_busy
                if run_bytes > buf[d]:
                    buf[d] = run_bytes
            for m in gd.sync_machines:
                nout[m] = nin[m] = end

        cur = None  # GroupData starting the current run of syncs over one member set
        run_end, run_busy, run_bytes = 0.0, 0.0, 0.0
        for gs, gd in self.sim.sync_jobs(gds):
            s = -math.inf
            for g in gs:
                sg = sfb_ready[g] if gds[g].sfb is not None else gf[g]
                if sg > s:
                    s = sg
            if cur is not None and gd.sync_devices == cur.sync_devices:
                if run_end > s:
                    s = run_end
            else:
                if cur is not None:
                    close_run(cur, run_end, run_busy, run_bytes)
                cur, run_busy, run_bytes = gd, 0.0, 0.0
                for d in gd.sync_devices:
                    if cf[d] > s:
                        s = cf[d]
                    if shared[d] and cfree[d] > s:
                        s = cfree[d]
                for m in gd.sync_machines:
                    if nout[m] > s:
                        s = nout[m]
                    if nin[m] > s:
                        s = nin[m]
            run_end = s + gd.sync_time
            run_busy += gd.sync_time
            run_bytes = max(run_bytes, gd.sync_bytes)
        if cur is not None:
            close_run(cur, run_end, run_busy, run_bytes)
        return sync_end

    def execute(self) -> SimResult:
        sim, gds = self.sim, self.gds
        k = len(gds)
        self._phase(FWD, list(range(k)))
        self._phase(BWD, list(range(k - 1, -1, -1)))
        sync_end = self._syncs()
        res = _result(sim, self, sync_end, _holdings(sim, gds))[-1]
        res.path_fn = lambda: sim.run_reference(gds).critical_path
        return res


def _sync_name(gd, groups: tuple[int, ...]) -> str:
    return f"{gd.sync} " + "+".join(f"g{g}" for g in groups)


def _holdings(sim, gds):
    """Per device: optimizer seconds, held bytes, max working set, holds-params flag (lists);
    per group: compute seconds."""
    n = sim.num_devices
    opt, mem, work = [0.0] * n, [0.0] * n, [0.0] * n
    holds = [False] * n
    gcomp = [0.0] * len(gds)
    by_layout: dict[int, tuple[Layout, list[int]]] = {}
    for g, gd in enumerate(gds):
        lay = gd.layout
        if lay is not None:
            entry = by_layout.get(id(lay))
            if entry is None:
                by_layout[id(lay)] = (lay, [g])
            else:
                entry[1].append(g)
            gcomp[g] += lay.gsum_l[g]
        else:
            for u in gd.units:
                d = u.devices[0]
                opt[d] += u.dur[OPT]
                mem[d] += u.mem
                work[d] = max(work[d], u.work)
                holds[d] |= u.mem > 0
                gcomp[g] += sum(u.dur)
        if gd.sfb is not None:
            gcomp[g] += sum(gd.sfb.recompute)
    gb = sim.static.grad_bytes
    gbl = sim.static.grad_bytes_l
    for lay, gs in by_layout.values():
        devs = lay.devices
        if len(gs) >= 4:  # many groups on one layout: numpy over the [groups, replicas] block
            o = lay.dur[OPT][gs].sum(axis=0).tolist()
            m = lay.mem[gs].sum(axis=0).tolist()
            w = lay.work[gs].max(axis=0).tolist()
            h = gb[gs].sum() > 0
            for r, d in enumerate(devs):
                opt[d] += o[r]
                mem[d] += m[r]
                if w[r] > work[d]:
                    work[d] = w[r]
                if h:
                    holds[d] = True
            continue
        for g in gs:
            h = gbl[g] > 0
            _, _, o, m, w = lay.row(g)
            for r, d in enumerate(devs):
                opt[d] += o[r]
                mem[d] += m[r]
                if w[r] > work[d]:
                    work[d] = w[r]
                if h:
                    holds[d] = True
    return opt, mem, work, holds, gcomp


def _result(sim, run, sync_end: list[float], holdings):
    """The optimizer step of every device holding parameters, then the :class:`SimResult` of the
    run's state (``cfree``, ``comp``, ``comm_free``, ``comm_busy``, ``buf``, ``group_finish``)."""
    opt, mem, work, holds, gcomp = holdings
    n = sim.num_devices
    before = list(run.cfree)
    upd_start = [0.0] * n
    final = list(before)
    comp = run.comp
    for d in range(n):
        if holds[d]:
            s = max(before[d], sync_end[d])
            dur = opt[d] + sim.step_overhead[d]
            upd_start[d] = s
            final[d] = s + dur
            comp[d] += dur
    t_iter = max(max(final), max(run.comm_free))
    peak = [x + y + z for x, y, z in zip(mem, work, run.buf)]
    cap = sim.capacity
    oom_devices = [(d, peak[d] - cap[d]) for d in range(n) if peak[d] > cap[d]]
    res = SimResult(
        iteration_time_s=t_iter, oom=bool(oom_devices), peak_memory_bytes=peak,
        memory_capacity_bytes=list(cap), oom_devices=oom_devices, compute_time_s=comp,
        comm_time_s=list(run.comm_busy), idle_time_s=[t_iter - c for c in comp],
        group_finish_s=list(run.group_finish), group_compute_s=gcomp, device_names=list(sim.device_names))
    return final, before, upd_start, holds, res
