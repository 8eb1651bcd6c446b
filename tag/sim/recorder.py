"""The recorder of one simulated iteration (:class:`Recorder`): every task with its start, end and
predecessor, for :attr:`SimResult.critical_path <tag.sim.result.SimResult.critical_path>` and the
timeline (``trace=True``). The event loop (:class:`tag.sim.event_loop.Run`) calls its hooks with
the times it computed; the recorder computes no time."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..graph.ir import PHASE_INDEX
from .flows import stage_index
from .result import SimEvent
from .static import BWD, PARAM
from .units import Flow, Unit

if TYPE_CHECKING:
    from .event_loop import Run

PHASE_NAME = {**{i: p for p, i in PHASE_INDEX.items()}, PARAM: "param"}
"""Integer phase (:data:`tag.sim.static.FWD` ...) -> its label in task names."""


class TaskRef(NamedTuple):
    """A recorded task: ``kind`` ``"c"`` a compute stage (``index`` its segment, ``row`` the stage
    in it, ``replica``), ``"f"`` a message, ``"s"`` a sync, ``"a"`` an SFB all-gather, ``"r"`` an
    SFB recompute, ``"b"`` the replica of group ``index``'s backward that finished last, ``"g"`` the
    all-gather of pieces scattered into a tensor-parallel group (each ``index`` into its list)."""

    kind: str
    index: int
    row: int = 0
    replica: int = 0


class Segment(NamedTuple):
    """A run of compute stages on one unit's replicas (:meth:`Recorder.segment`)."""

    phase: int
    stages: list[tuple[int, int]]
    """(group, chunk) of each stage, in order."""
    unit: Unit
    start: list[float]
    """Per replica: when the first stage started."""
    compute_free: list[float]
    """Per replica: when its device's compute stream was free before it."""
    ready: list[float] | None
    """Per replica: when its last transfer in arrived (None: no transfer in)."""
    ready_refs: list[TaskRef | None] | None
    """Per replica: the transfer that arrived last."""
    previous: list[TaskRef | None]
    """Per replica: the last task on its device's compute stream before it."""
    finish: list[list[float]]
    """Per stage, per replica: its end."""


class MessageRecord(NamedTuple):
    first_flow: Flow
    parts: int
    """Flows packed in the message."""
    nbytes: float
    start: float
    end: float
    pred: TaskRef | None


class SyncRecord(NamedTuple):
    groups: tuple[int, ...]
    job: object
    """The group's :class:`~tag.sim.units.GroupData` or a :class:`~tag.sim.units.SyncJob`."""
    start: float
    end: float
    pred: TaskRef | None


class GatherRecord(NamedTuple):
    group: int
    factor: int
    start: float
    end: float
    pred: TaskRef | None


class ScatterRecord(NamedTuple):
    first_flow: Flow
    """The first flow into the stage."""
    devices: tuple[int, ...]
    nbytes: float
    start: float
    end: float
    pred: TaskRef | None


class RecomputeRecord(NamedTuple):
    group: int
    device: int
    start: float
    end: float
    pred: TaskRef | None


class RunEnd(NamedTuple):
    """Per device: the optimizer step's end and start, the compute stream's end before it, the
    last sync's end, whether it holds parameters (:meth:`Recorder.close`)."""

    final: list[float]
    before: list[float]
    update_start: list[float]
    sync_end: list[float]
    holds: list[bool]


def binding(s: float, waits) -> TaskRef | None:
    """The predecessor of a task that started at ``s``: of its ``waits`` ``(time, task ref)``, in
    the order the event loop takes their maximum (``if x > s: s = x``, which keeps the first
    maximum), the first whose time is ``s``."""
    for x, ref in waits:
        if x == s:
            return ref
    raise AssertionError(f"the recorder's waits miss the task's start {s!r}")


def sync_name(job, groups: tuple[int, ...]) -> str:
    return f"{job.sync} " + "+".join(f"g{g}" for g in groups)


class Recorder:
    """Records one :class:`~tag.sim.event_loop.Run`: every task with its start, end and predecessor
    (the task that released what it waited for last). The hooks get the times the loop computed
    and read the loop's resource state before the loop updates it; the recorder keeps, per
    resource, the task that last released it."""

    def bind(self, run: Run, pairs: list) -> None:
        """Record ``run``, whose transfers are those of ``pairs`` (:class:`~tag.sim.flows.PairFlows`
        or :class:`~tag.sim.flows.ShiftedPair`, :meth:`Simulator.pairs_used`)."""
        sim = run.sim
        n, m = sim.num_devices, sim.num_machines
        self.run, self.sim, self.deployments = run, sim, run.deployments
        self.last_task: list = [None] * n  # per device: last task on its compute stream
        self.last_comm: list = [None] * n  # per device: last task on its comm stream
        self.last_nic_out: list = [None] * m
        self.last_nic_in: list = [None] * m
        self.sync_last: list = [None] * n  # per device: its last sync
        self.incoming: dict[int, list[Flow]] = {}  # stage index -> flows, as the loop's incoming
        self.segments: list[Segment] = []
        self.stage_loc: dict[tuple, tuple[int, int]] = {}  # (ph, g, j) -> (segment, row)
        self.messages: list[MessageRecord] = []
        self.syncs: list[SyncRecord] = []
        self.gathers: list[GatherRecord] = []  # SFB all-gathers
        self.scatters: list[ScatterRecord] = []  # scatter-gathers
        self.recomputes: list[RecomputeRecord] = []  # SFB recomputes
        self.sfb_ref: dict[int, tuple] = {}  # group -> (last replica's recompute end, its ref)
        self._stage_messages: dict = {}  # (a, b) -> [flows, source ready, its ref] of the stage self._idx
        self._idx = -1
        self._arrived: dict[int, tuple] = {}  # destination replica -> (last arrival, its ref)
        self._open = False  # a run of syncs over one member set is open (the next sync chains)
        k = sim.static.num_groups
        for pair in pairs:
            for dst, flows in pair.by_dst:
                self.incoming.setdefault(stage_index(*dst, k), []).extend(flows)

    # ---- hooks ----------------------------------------------------------------------------
    def _group_stage(self, idx: int) -> None:
        """The flows into stage ``idx`` grouped as the loop's messages, each with its source's
        readiness (the latest of its flows' sources)."""
        self._idx, self._arrived, msgs = idx, {}, {}
        loc, segs = self.stage_loc, self.segments
        for f in self.incoming[idx]:
            if f.src[0] == PARAM:
                s0, p0 = 0.0, None
            else:
                sid, row = loc[f.src]
                s0, p0 = segs[sid].finish[row][f.src_rep], TaskRef("c", sid, row, f.src_rep)
            m = msgs.get((f.a, f.b))
            if m is None:
                msgs[(f.a, f.b)] = [[f], s0, p0]
            else:
                m[0].append(f)
                if s0 > m[1]:
                    m[1], m[2] = s0, p0
        self._stage_messages = msgs

    def flow(self, idx: int, a: int, b: int, ma: int, mb: int, s: float, e: float, r: int, nb: float,
             waits: bool = True) -> None:
        """The message from device ``a`` to ``b`` into stage ``idx`` (machines ``ma``, ``mb`` or
        -1; destination replica ``r``, ``nb`` bytes) from ``s`` to ``e``; ``waits``: its sender's
        compute stream waited for it."""
        if idx != self._idx:  # the first message into stage idx
            self._group_stage(idx)
        parts, s0, p0 = self._stage_messages[(a, b)]
        run, lc, lt = self.run, self.last_comm, self.last_task
        held = [(s0, p0), (run.comm_free_at[a], lc[a]), (run.comm_free_at[b], lc[b])]
        held += ([(run.compute_free_at[a], lt[a]), (run.compute_free_at[b], lt[b])] if waits
                 else [(run.compute_free_at[b], lt[b])])
        if ma >= 0:
            held += [(run.nic_out_free_at[ma], self.last_nic_out[ma]), (run.nic_in_free_at[mb], self.last_nic_in[mb])]
        ref = TaskRef("f", len(self.messages))
        self.messages.append(MessageRecord(parts[0], len(parts), nb, s, e, binding(s, held)))
        lc[a] = lc[b] = lt[b] = ref
        if waits:
            lt[a] = ref
        if ma >= 0:
            self.last_nic_out[ma] = self.last_nic_in[mb] = ref
        x = self._arrived.get(r)
        if e > (x[0] if x is not None else 0.0):
            self._arrived[r] = (e, ref)

    def scatter_gather(self, idx: int, lo: int, hi: int, devs: tuple[int, ...], s: float, e: float,
                       nb: float) -> None:
        """The all-gather over ``devs`` (replicas ``lo .. hi - 1`` of stage ``idx``) of the pieces
        scattered into them: after their last arrivals and their devices' streams."""
        run, got = self.run, self._arrived
        waits = [got.get(r, (0.0, None)) for r in range(lo, hi)]
        waits = [max(waits, key=lambda w: w[0])]  # (the first maximum, as the loop's max())
        for d in devs:
            waits += [(run.comm_free_at[d], self.last_comm[d]), (run.compute_free_at[d], self.last_task[d])]
        ref = TaskRef("g", len(self.scatters))
        self.scatters.append(ScatterRecord(self.incoming[idx][0], devs, nb, s, e, binding(s, waits)))
        for d in devs:
            self.last_comm[d] = self.last_task[d] = ref
        for r in range(lo, hi):
            got[r] = (e, ref)

    def segment(self, ph: int, stages: list[tuple[int, int]], unit: Unit, start: list[float],
                ready: list[float] | None) -> None:
        """Stages ``stages`` ((group, chunk), in order) of phase ``ph`` on ``unit``'s replicas,
        the first starting at ``start``; ``ready``: when its last transfer in arrived (or None)."""
        run, devs, lt = self.run, unit.devices, self.last_task
        free = [run.compute_free_at[d] for d in devs]
        ready_refs = None
        if ready is not None:
            got = self._arrived
            ready_refs = [got[r][1] if r in got else None for r in range(len(devs))]
        k = self.sim.static.num_groups
        finish = [run.stage_finish[stage_index(ph, g, j, k)] for g, j in stages]
        sid = len(self.segments)
        self.segments.append(Segment(ph, stages, unit, start, free, ready, ready_refs, [lt[d] for d in devs], finish))
        loc = self.stage_loc
        for row, (g, j) in enumerate(stages):
            loc[(ph, g, j)] = (sid, row)
        last = len(stages) - 1
        for r, d in enumerate(devs):
            lt[d] = TaskRef("c", sid, last, r)

    def gather(self, g: int, x: int, s: float, e: float) -> None:
        """The all-gather of factor ``x`` of SFB group ``g``; the first waits for the group's
        backward on every replica, the members' comm streams and the machines' network sides."""
        sd = self.deployments[g].sfb
        run = self.run
        if x == 0:
            sid, row = self.stage_loc[(BWD, g, 0)]
            fin = self.segments[sid].finish[row]
            r0 = max(range(len(fin)), key=fin.__getitem__)
            waits = [(fin[r0], TaskRef("c", sid, row, r0))]
            waits += [(run.comm_free_at[d], self.last_comm[d]) for d in sd.members]
            for m in sd.machines:
                waits += [(run.nic_out_free_at[m], self.last_nic_out[m]), (run.nic_in_free_at[m], self.last_nic_in[m])]
            p = binding(s, waits)
        else:
            p = TaskRef("a", len(self.gathers) - 1)
        ref = TaskRef("a", len(self.gathers))
        self.gathers.append(GatherRecord(g, x, s, e, p))
        if x == len(sd.gather_times) - 1:
            for d in sd.members:
                self.last_comm[d] = ref
            for m in sd.machines:
                self.last_nic_out[m] = self.last_nic_in[m] = ref

    def recompute(self, g: int, d: int, s: float, st: float, e: float) -> None:
        """SFB group ``g``'s recompute on device ``d`` from ``st`` to ``e``, its all-gathers having
        ended at ``s``."""
        p = binding(st, [(s, TaskRef("a", len(self.gathers) - 1)), (self.run.compute_free_at[d], self.last_task[d])])
        ref = TaskRef("r", len(self.recomputes))
        self.recomputes.append(RecomputeRecord(g, d, st, e, p))
        self.last_task[d] = ref
        x = self.sfb_ref.get(g)
        if x is None or e >= x[0]:
            self.sfb_ref[g] = (e, ref)

    def sync(self, gs: tuple[int, ...], job, s: float, e: float) -> None:
        """The sync ``job`` of groups ``gs``: after the previous sync when it continues a run of
        syncs over one member set, else after the members' streams and the machines' network sides."""
        run = self.run
        waits = [(run.sfb_ready[g], self.sfb_ref[g][1]) if self.deployments[g].sfb is not None
                 else (run.group_finish[g], TaskRef("b", g)) for g in gs]
        if self._open:
            waits.append((self.syncs[-1].end, TaskRef("s", len(self.syncs) - 1)))
        else:
            shared = self.sim.shared_stream
            for d in job.sync_devices:
                waits.append((run.comm_free_at[d], self.last_comm[d]))
                if shared[d]:
                    waits.append((run.compute_free_at[d], self.last_task[d]))
            for m in job.sync_machines:
                waits += [(run.nic_out_free_at[m], self.last_nic_out[m]), (run.nic_in_free_at[m], self.last_nic_in[m])]
        self.syncs.append(SyncRecord(gs, job, s, e, binding(s, waits)))
        self._open = True

    def close_syncs(self, job) -> None:
        """A run of syncs over ``job``'s members ended with the last recorded sync."""
        self._open = False
        ref = TaskRef("s", len(self.syncs) - 1)
        for d in job.sync_devices:
            self.last_comm[d] = self.sync_last[d] = ref
        for m in job.sync_machines:
            self.last_nic_out[m] = self.last_nic_in[m] = ref

    def close(self, end: RunEnd) -> None:
        """The optimizer steps, the compute streams' ends before them and the last syncs' ends."""
        self._end = end

    # ---- critical path and timeline -------------------------------------------------------
    def _seg_task(self, sid: int, row: int, r: int) -> tuple[str, float, float, TaskRef | None]:
        seg = self.segments[sid]
        s = seg.start[r] if row == 0 else seg.finish[row - 1][r]
        if row > 0:
            pred = TaskRef("c", sid, row - 1, r)
        elif seg.ready is not None and seg.ready[r] > seg.compute_free[r]:
            pred = seg.ready_refs[r]
        else:
            pred = seg.previous[r] if seg.compute_free[r] > 0 else None
        g, j = seg.stages[row]
        name = f"{self._stage_name(seg.phase, g, j)} @d{seg.unit.devices[r]}"
        return name, s, seg.finish[row][r], pred

    def _resolve(self, ref: TaskRef) -> tuple[str, float, float, TaskRef | None]:
        """(name, start, end, predecessor ref) of a task reference."""
        kind = ref.kind
        if kind == "c":
            return self._seg_task(ref.index, ref.row, ref.replica)
        if kind == "f":
            msg = self.messages[ref.index]
            f = msg.first_flow
            more = f" +{msg.parts - 1}" if msg.parts > 1 else ""
            name = (f"send {PHASE_NAME[f.src[0]]} g{f.src[1]}{more} -> {PHASE_NAME[f.dst[0]]} g{f.dst[1]} "
                    f"d{f.a}->d{f.b} ({msg.nbytes:.0f} B)")
            return name, msg.start, msg.end, msg.pred
        if kind == "s":
            sy = self.syncs[ref.index]
            p = sy.pred
            if p is not None and p.kind == "b":
                p = self._bwd_last(p.index)
            return sync_name(sy.job, sy.groups), sy.start, sy.end, p
        if kind == "a":
            ga = self.gathers[ref.index]
            sd = self.deployments[ga.group].sfb
            return (f"allgather g{ga.group} {sd.gather_names[ga.factor]} ({sd.gather_bytes[ga.factor]:.0f} B)",
                    ga.start, ga.end, ga.pred)
        if kind == "r":
            rc = self.recomputes[ref.index]
            return f"sfb g{rc.group} @d{rc.device}", rc.start, rc.end, rc.pred
        if kind == "g":
            sc = self.scatters[ref.index]
            f = sc.first_flow
            name = (f"allgather {PHASE_NAME[f.dst[0]]} g{f.dst[1]} scattered in "
                    f"@d{'+'.join(map(str, sc.devices))} ({sc.nbytes:.0f} B)")
            return name, sc.start, sc.end, sc.pred
        raise AssertionError(ref)

    def _bwd_last(self, g: int) -> TaskRef:
        """Reference of the replica of group ``g``'s (last micro-batch's) backward that finished
        last."""
        program = self.run.program
        last = 0 if program is None else next(m for _, ph, m in reversed(program.tasks) if ph == BWD)
        sid, row = self.stage_loc[(BWD, g, last)]
        r = int(np.argmax(self.segments[sid].finish[row]))
        return TaskRef("c", sid, row, r)

    def critical_path(self) -> list[str]:
        end = self._end
        d = int(np.argmax(end.final))
        names: list[str] = []
        if end.holds[d]:
            names.append(f"opt @d{d}")
            ref = self.sync_last[d] if end.sync_end[d] > end.before[d] else self.last_task[d]
        else:
            ref = self.last_task[d]
        guard = 0
        while ref is not None and guard < 1_000_000:
            guard += 1
            if ref.kind == "c" and ref.row > 0:
                # Inside a segment the path runs back through the same replica's earlier stages.
                seg = self.segments[ref.index]
                suffix = f" @d{seg.unit.devices[ref.replica]}"
                names.extend(self._stage_name(seg.phase, g, j) + suffix for g, j in seg.stages[ref.row:0:-1])
                ref = TaskRef("c", ref.index, 0, ref.replica)
                continue
            name, _, _, ref = self._resolve(ref)
            names.append(name)
        names.reverse()
        return names

    def _stage_name(self, ph: int, g: int, j: int) -> str:
        if self.run.program is not None:
            return f"{PHASE_NAME[ph]} g{g} mb{j}"
        chunk = f".{j}" if self.deployments[g].units[j].layout is None else ""
        return f"{PHASE_NAME[ph]} g{g}{chunk}"

    def events(self) -> list[SimEvent]:
        """The timeline: every task on every device it occupies, by start time."""
        end = self._end
        ev: list[SimEvent] = []
        for sid, seg in enumerate(self.segments):
            for row in range(len(seg.stages)):
                for r, d in enumerate(seg.unit.devices):
                    name, s, e, _ = self._seg_task(sid, row, r)
                    if e > s:
                        ev.append(SimEvent(name, d, "compute", s, e, PHASE_NAME[seg.phase]))
        for fid, msg in enumerate(self.messages):
            name, s, e, _ = self._resolve(TaskRef("f", fid))
            ev.append(SimEvent(name, msg.first_flow.a, "comm", s, e, "transfer"))
            ev.append(SimEvent(name, msg.first_flow.b, "comm", s, e, "transfer"))
        for sy in self.syncs:
            for d in sy.job.sync_devices:
                ev.append(SimEvent(sync_name(sy.job, sy.groups), d, "comm", sy.start, sy.end, sy.job.sync))
        for gid, ga in enumerate(self.gathers):
            name, s, e, _ = self._resolve(TaskRef("a", gid))
            for d in self.deployments[ga.group].sfb.members:
                ev.append(SimEvent(name, d, "comm", s, e, "allgather"))
        for sid, sc in enumerate(self.scatters):
            name, s, e, _ = self._resolve(TaskRef("g", sid))
            for d in sc.devices:
                ev.append(SimEvent(name, d, "comm", s, e, "transfer"))
        for rc in self.recomputes:
            if rc.end > rc.start:
                ev.append(SimEvent(f"sfb g{rc.group} @d{rc.device}", rc.device, "compute", rc.start, rc.end, "sfb"))
        for d in range(self.sim.num_devices):
            if end.holds[d]:
                ev.append(SimEvent(f"opt @d{d}", d, "compute", end.update_start[d], end.final[d], "opt"))
        ev.sort(key=lambda x: (x.start, x.device))
        return ev
