"""Plan-derived data the simulator caches: layouts, per-group units and cross-unit flows.

* A **layout** is a data-parallel replica set: devices and their integer local batches. Its
  cost arrays cover *every* group (``[K, R]``), so consecutive groups with the same layout run as
  one vectorised segment (cumulative sums give each stage's finish time).
* A **group's units**: one data-parallel unit (a layout), or one single-device unit per ``mp``
  chunk, plus the group's gradient synchronisation.
* A group's **SFB** data (``GroupPlan.sfb``): its factor all-gathers and the per-replica
  recompute seconds (see :class:`SfbData`).
* **Flows** between two groups' units: the tensors crossing, re-partitioned per the executor's
  rules (``rows`` by sample-range overlap, ``copy`` from the nearest producer replica, ``sum``
  kept on each producer replica's device when a consumer replica is there, else from every
  producer replica to the first consumer replica; into a tensor-parallel group from another
  machine scattered, ``1 / T`` to each device, which then all-gather), aggregated per (source
  stage, source replica, destination stage, destination replica); moves within one device are
  free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..parallel.moves import holder_sets, move_pieces
from .static import BWD, FWD, PARAM, GraphStatic

NUMBER_BYTES = 32
"""Approximate bytes of one number in a tuple or list: its 8-byte slot and the float or int object
(24 or 28 bytes; small ints are shared, so this over-counts them)."""


ENTRY_BYTES = 250
"""Approximate bytes of one cache entry besides what is counted by size: its dict slot, key tuple
and value object."""
INSTANCE_BYTES = 352
"""Bytes of a dataclass instance of about 16 fields besides what they hold: the object and its
``__dict__`` (``sys.getsizeof``: 56 + 296 on a :class:`Layout`, 2026-11-27)."""
ARRAY_BYTES = 112
"""Bytes of a numpy array object besides its data (``sys.getsizeof`` of an array that owns its data
minus ``nbytes``, and of a view: 112 on numpy 2.4, 2026-11-27)."""
FLOW_BYTES = 200
"""Approximate bytes of one flow of a :class:`PairTemplate` or :class:`tag.sim.flows.PairFlows`, one message
(:meth:`tag.sim.Simulator.messages`), one piece of :func:`_pieces`: a tuple of 5-10 numbers
(recursive ``sys.getsizeof`` of those caches after random search on GPT-2 medium / h100-512gpu,
2026-11-27: 196, 126, 158 and 107 bytes each)."""


def seq_bytes(n: int) -> int:
    """Approximate bytes of a tuple or list of ``n`` numbers of its own (:data:`NUMBER_BYTES` each)."""
    return 56 + NUMBER_BYTES * n


def ref_bytes(n: int) -> int:
    """Approximate bytes of a tuple or list of ``n`` objects held elsewhere too (8-byte slots)."""
    return 56 + 8 * n


class CacheMeter:
    """Approximate bytes held by a simulator's caches (:attr:`tag.sim.Simulator.cached_bytes`):
    each entry adds its estimate when it is made, a :class:`Layout` its :meth:`Layout.row` lists
    when they are made."""

    __slots__ = ("bytes",)

    def __init__(self):
        self.bytes = 0


@dataclass
class Layout:
    """Data-parallel replicas ``devices`` with ``batches`` samples each; arrays over all groups."""

    devices: tuple[int, ...]
    batches: tuple[int, ...]
    dev_arr: np.ndarray
    """[R] int device indices."""
    dur: np.ndarray
    """[3, K, R] seconds per phase (fwd, bwd, opt), group and replica."""
    cum_fwd: np.ndarray
    """[K+1, R]: forward seconds of groups < g."""
    cum_bwd: np.ndarray
    """[K+1, R]: backward seconds of the first i groups in backward order (K-1, K-2, ...)."""
    mem: np.ndarray
    """[K, R] bytes held for the whole iteration: params, grads, optimizer state, buffers, saved
    activations at the replica's batch."""
    work: np.ndarray
    """[K, R] bytes of the largest single op's working set."""
    starts: tuple[int, ...]
    """First global sample of each replica."""
    gsum: np.ndarray
    """[K] compute seconds (fwd + bwd + opt) summed over the replicas."""
    gsum_l: list
    """``gsum`` as a list."""
    uid: int = 0
    """Unique per simulator."""
    rows: list = field(default_factory=list)
    """Per group, made on first use by :meth:`row` (scalar access in the event loop):
    ``[fwd, bwd, opt, mem, work]`` lists over the replicas."""
    saved: np.ndarray | None = None
    """[K, R] bytes of the activations one run (a pipeline's micro-batch) saves for the backward,
    where they are not ``mem_per_sample x batches`` (a tensor-parallel device's: part of its
    replica's samples at ``1 / T`` of the features, :mod:`tag.sim.tensor_parallel`)."""
    compute: tuple[float, ...] | None = None
    """Per replica, the samples its per-batch cost tables are read at where that is not its batch
    (a tensor-parallel device: ``1 / T`` of its replica's samples, possibly fractional)."""
    casts: np.ndarray | None = None
    """[K, R] seconds of the forward's parameter casts in ``dur`` where they are not the device
    class's (:attr:`Simulator.casts`; a tensor-parallel device's: ``1 / T`` of its split weights')."""
    net: np.ndarray | None = None
    """[2, K, R] nominal seconds, within ``dur``'s forward and backward, of blocking collectives
    over several machines (a tensor-parallel group's across machines): on a network with other
    jobs' traffic the simulator stretches them over what is left of ``net_machines``' NICs and
    links (:meth:`tag.sim.event_loop.Run._net_slowed`); None: none."""
    net_machines: tuple[tuple[int, ...], ...] | None = None
    """Per replica, the machines its ``net`` collectives span."""
    meter: CacheMeter | None = None
    """The cache this layout is held in: :meth:`row` adds the bytes of the lists it makes."""
    host: np.ndarray | None = None
    """[2, K, R] host seconds issuing each forward and backward stage where the device's costs hold
    the host apart (:meth:`tag.cost.CostModel.host_parts`: a GPU rule's eager launches; ``dur``'s
    forward and backward are then the device's seconds alone): the event loop runs the host as a
    timeline of its own (:meth:`tag.sim.event_loop.Run._phase`); None: none (``dur`` is all)."""
    lag: np.ndarray | None = None
    """[2, K, R] seconds a stage lasts beyond its ``dur`` when host and device start it together
    (:attr:`tag.cost.gpu.StageParts.lag`); with ``host``."""
    hosts: tuple | None = None
    """With ``host``, what the event loop reads per phase (forward order, backward order):
    ``(cum_host [K+1, R], base [K+1, R] = cum_host - cum_dur, peak [K, R] = base[:-1] + lag)``."""

    @property
    def nbytes(self) -> int:
        """Approximate bytes of this layout as made (its arrays, tuples and lists; the rows
        :meth:`row` makes later are counted then, in :attr:`meter`)."""
        arrays = (self.dev_arr, self.dur, self.cum_fwd, self.cum_bwd, self.mem, self.work, self.gsum, self.saved,
                  self.casts, self.net, self.host, self.lag) + (() if self.hosts is None else sum(self.hosts, ()))
        n = 3 * ref_bytes(len(self.devices)) + seq_bytes(len(self.gsum_l)) + ref_bytes(len(self.rows))
        n += INSTANCE_BYTES
        if self.compute is not None:
            n += seq_bytes(len(self.compute))
        return n + sum(a.nbytes + ARRAY_BYTES for a in arrays if a is not None)  # data and header

    @classmethod
    def of(cls, devices, batches, dev_arr: np.ndarray, dur: np.ndarray, mem: np.ndarray, work: np.ndarray,
           starts, **kw) -> Layout:
        """A layout of ``dur`` [3, K, R] with what derives from it: the forward and backward
        running sums and the per-group totals."""
        k, r = dur.shape[1], dur.shape[2]
        cum_f = np.zeros((k + 1, r))
        np.cumsum(dur[FWD], axis=0, out=cum_f[1:])
        cum_b = np.zeros((k + 1, r))
        np.cumsum(dur[BWD][::-1], axis=0, out=cum_b[1:])
        gsum = dur.sum(axis=(0, 2))
        if kw.get("host") is not None:
            kw["hosts"] = (_host_sums(kw["host"][FWD], kw["lag"][FWD], cum_f),
                           _host_sums(kw["host"][BWD][::-1], kw["lag"][BWD][::-1], cum_b))
        return cls(tuple(devices), tuple(batches), dev_arr, dur, cum_f, cum_b, mem, work, tuple(starts), gsum,
                   gsum.tolist(), rows=[None] * k, **kw)

    def row(self, g: int) -> list:
        r = self.rows[g]
        if r is None:
            r = self.rows[g] = self.dur[:, g].tolist() + [self.mem[g].tolist(), self.work[g].tolist()]
            if self.meter is not None:
                self.meter.bytes += 5 * seq_bytes(len(self.devices)) + 96
        return r


def _host_sums(host: np.ndarray, lag: np.ndarray, cum: np.ndarray) -> tuple:
    """:attr:`Layout.hosts` of one phase from its host seconds and lags [K, R] in the phase's
    order and its running device seconds ``cum`` [K+1, R]."""
    cum_h = np.zeros_like(cum)
    np.cumsum(host, axis=0, out=cum_h[1:])
    base = cum_h - cum
    return cum_h, base, base[:-1] + lag


@dataclass
class Unit:
    """A unit of the group's lowering (:class:`tag.parallel.Unit`) with its costs: the whole
    group (``chunk`` -1, costed by ``layout``) or one position chunk on one device."""

    group: int
    chunk: int
    devices: tuple[int, ...]
    batches: tuple[int, ...]
    starts: tuple[int, ...]
    layout: Layout | None = None
    dur: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """mp chunk: seconds of fwd, bwd, opt (its single device)."""
    mem: float = 0.0
    work: float = 0.0
    lo: int = 0
    hi: int = 0
    """mp chunk: forward positions [lo, hi)."""
    host: tuple[float, float] | None = None
    """mp chunk: host seconds issuing its forward and backward where its device's costs hold the
    host apart (:attr:`Layout.host`; ``dur``'s are then the device's), else None."""
    lag: tuple[float, float] | None = None
    """mp chunk: with ``host``, :attr:`Layout.lag` of its forward and backward."""


@dataclass
class SfbData:
    """Sufficient Factor Broadcasting of one data-parallel group (``GroupPlan.sfb``).

    Right after the group's backward stage: one ring all-gather per distinct factor over the
    replicas (in order, on their comm streams and the network sides of the machines spanned),
    then every replica recomputes the SFB ops' gradients on the gathered global batch (compute
    stream); the group's remaining gradients are synchronised after that.
    """

    ops: tuple[int, ...]
    """Op indices of the SFB gradient ops."""
    gather_names: tuple[str, ...]
    """Per factor: its joint-graph node name."""
    gather_times: tuple[float, ...]
    """Per factor: seconds of its all-gather."""
    gather_bytes: tuple[float, ...]
    """Per factor: bytes of the gathered tensor (global batch) every replica receives."""
    gather_total: float
    buffer_bytes: float
    """Communication buffer on every replica: all gathered factors (live together until the recompute)."""
    devices: tuple[int, ...]
    """The replicas (plan order; ``recompute`` is aligned with it)."""
    members: tuple[int, ...]
    """Sorted replicas."""
    machines: tuple[int, ...]
    """Machines whose network link the all-gathers use (empty within one machine)."""
    recompute: tuple[float, ...]
    """Per replica: extra compute seconds (the SFB ops at the global batch minus at its local batch)."""
    saved_bytes: float
    """Gradient bytes left out of the group's all-reduce / PS sync."""


@dataclass
class GroupData:
    """Everything the event loop needs about one group's deployment."""

    units: list[Unit]
    sync: str
    """``allreduce``, ``ps`` or ``none``."""
    sync_time: float
    sync_devices: tuple[int, ...]
    sync_machines: tuple[int, ...]
    """Machines whose network link the synchronisation uses (empty within one machine)."""
    sync_bytes: float
    mp: bool = False
    chunk_of: dict[int, int] = field(default_factory=dict)
    """mp: forward position -> chunk index."""
    sfb: SfbData | None = None
    """Set when ``GroupPlan.sfb`` is non-empty."""
    serial: int = 0
    """Unique per simulator (cache key of the flows between two groups' deployments)."""
    layout: Layout | None = None
    """The data-parallel layout (``None`` for ``mp``)."""
    layout_id: int = 0
    """``layout.uid``, or ``-serial`` for ``mp`` (no two groups share it)."""
    recompute: bool = False
    """``GroupPlan.recompute``: the units' costs are those of activation recomputation."""
    unit_key: tuple = ()
    """What the replica-level moves into and out of the group depend on: ``("dp", devices,
    batches)`` or ``("mp", devices)`` (every chunk holds the full batch)."""
    bucket: tuple | None = None
    """``(sync, replica devices, server)``: syncs of equal key may share a gradient bucket
    (:mod:`tag.parallel.buckets`); ``None``: never bucketed with another group (no sync, or a
    sync of its own such as a tensor-parallel group's; :meth:`Simulator.sync_jobs`)."""
    tp: int = 0
    """Devices per tensor-parallel group of a ``tp`` deployment (its unit's devices in runs of
    ``tp``, :func:`tag.parallel.tensor_parallel.tp_groups`); 0 for any other."""
    resync: Callable[[float], float] | None = None
    """A ``tp`` deployment's sync seconds without ``x`` bytes of its replicated gradients (a tied
    weight all-reduced apart, :meth:`Simulator.sync_jobs`); None for any other."""


@dataclass(slots=True)
class SyncJob:
    """A gradient bucket of several groups: one collective over their concatenated gradients."""

    groups: tuple[int, ...]
    sync: str
    sync_time: float
    sync_devices: tuple[int, ...]
    sync_machines: tuple[int, ...]
    sync_bytes: float


@dataclass(slots=True)
class Flow:
    """One point-to-point transfer of the iteration."""

    src: tuple[int, int, int]
    """Source stage (phase or PARAM, group, chunk index)."""
    src_rep: int
    dst: tuple[int, int, int]
    dst_rep: int
    a: int
    b: int
    nbytes: float
    time: float
    src_machine: int
    """Source machine when the flow crosses machines, else -1."""
    dst_machine: int
    parts: int = 1
    """Flows this one stands for (a message of several flows between the same two devices)."""


def at_batch(table: np.ndarray, x: float) -> np.ndarray:
    """``table[..., x]`` for a batch ``x`` that may be fractional: linear between the integer
    batches around it (the exact entry at an integer)."""
    lo = int(x)
    f = x - lo
    if f == 0.0:
        return table[..., lo]
    return (1.0 - f) * table[..., lo] + f * table[..., lo + 1]


def make_layout(static: GraphStatic, tables: np.ndarray, dev_class: list[int], devices: tuple[int, ...],
                batches: tuple[int, ...], hosts: tuple[np.ndarray, np.ndarray, list[bool]] | None = None) -> Layout:
    """``tables``: [C, K, 3, B+1] seconds per device class; ``hosts``: (host seconds, lags) [C, K, 2,
    B+1] per device class and whether a class holds its host apart (:attr:`Layout.host`), or None."""
    dev = np.array(devices, dtype=np.int64)
    cls = np.array([dev_class[d] for d in devices], dtype=np.int64)
    b = np.array(batches, dtype=np.int64)
    dur = np.ascontiguousarray(tables[cls, :, :, b].transpose(2, 1, 0))  # [R, K, 3] -> [3, K, R]
    bf = b.astype(float)[None, :]
    mem = static.mem_fixed[:, None] + static.mem_per_sample[:, None] * bf
    work = static.work_fixed[:, None] + static.work_per_sample[:, None] * bf
    starts = tuple(int(s) for s in np.concatenate([[0], np.cumsum(b)[:-1]]))
    kw = {}
    if hosts is not None and any(hosts[2][c] for c in cls.tolist()):
        kw = {"host": np.ascontiguousarray(hosts[0][cls, :, :, b].transpose(2, 1, 0)),
              "lag": np.ascontiguousarray(hosts[1][cls, :, :, b].transpose(2, 1, 0))}
    return Layout.of(devices, batches, dev, dur, mem, work, starts, **kw)


def host_after(first: tuple[np.ndarray, np.ndarray, np.ndarray], host: np.ndarray, lag: np.ndarray):
    """(host, lag) [K, R] of ``first`` (device seconds, host seconds, lag [K, R]: a recomputation's
    forward) and a stage of ``host`` and ``lag`` after it, as one stage. Started together, ``first``
    ends at ``g1 + l1`` and the host starts the second at ``h1``, so the two end at
    ``max(g1 + l1 + g2, h1 + g2 + l2)``: lag ``max(l1, h1 + l2 - g1)``."""
    g1, h1, l1 = first
    return h1 + host, np.maximum(l1, h1 + lag - g1)


def recompute_layout(static: GraphStatic, lay: Layout, held=None, live=None, saved=None, cast=None,
                     cast_host=None) -> Layout:
    """``lay`` with every group under activation recomputation (``GroupPlan.recompute``): backward
    seconds = forward + backward seconds; held bytes = ``lay``'s less the saved activations plus
    the group's inputs (:meth:`GraphStatic.recompute_bytes`, at each replica's batch); working set
    + the recomputed values. ``held`` / ``live`` / ``saved``: [K, R] bytes held, live at the
    backward, and saved bytes ``lay`` holds, beyond those at the replica's batch (plain tensor
    parallelism: what is outside the Megatron blocks is at the tensor-parallel group's batch, the
    rest at ``lay.compute``, its devices' ``1 / T`` of it); ``lay.saved``, where set, becomes what a
    run keeps for its backward under recomputation. ``cast``: [K, R] seconds of the forward's
    parameter casts, which the recomputation does not make again (it reads the forward's copies,
    :attr:`tag.cost.model.DeviceCost.cast`); ``cast_host``: [K, R] host seconds launching them, which
    it does not launch (with :attr:`Layout.host`)."""
    dur = lay.dur.copy()
    again = dur[FWD] if cast is None else np.maximum(dur[FWD] - cast, 0.0)  # the recomputed forward
    dur[BWD] += again
    host = lag = None
    if lay.host is not None:
        host, lag = lay.host.copy(), lay.lag.copy()
        h_again = lay.host[FWD] if cast_host is None else np.maximum(lay.host[FWD] - cast_host, 0.0)
        host[BWD], lag[BWD] = host_after((again, h_again, lay.lag[FWD]), lay.host[BWD], lay.lag[BWD])
    b = np.asarray(lay.batches if lay.compute is None else lay.compute, dtype=float)[None, :]
    per_sample = (static.rc_per_sample - static.mem_per_sample)[:, None] * b
    mem = lay.mem + (static.rc_fixed - static.mem_fixed)[:, None] + per_sample
    kept = None if lay.saved is None else lay.saved + per_sample  # what one run keeps for its backward
    work = lay.work + static.rc_work_fixed[:, None] + static.rc_work_per_sample[:, None] * b
    for extra, sign in ((held, 1.0), (saved, -1.0)):
        if extra is not None:
            mem = mem + sign * extra
            kept = None if kept is None else kept + sign * extra
    if live is not None:
        work = work + live
    net = None if lay.net is None else np.stack([lay.net[FWD], lay.net[BWD] + lay.net[FWD]])  # (recomputed too)
    return Layout.of(lay.devices, lay.batches, lay.dev_arr, dur, mem, work, lay.starts, saved=kept, compute=lay.compute,
                     casts=lay.casts, net=net, net_machines=lay.net_machines, host=host, lag=lag)


def mp_unit(static: GraphStatic, costs, g: int, j: int, device: int, lo: int, hi: int,
            recompute: bool = False) -> Unit:
    """Chunk ``j`` (positions [lo, hi)) of mp group ``g`` on ``device``, full batch; ``recompute``:
    under activation recomputation (backward seconds + forward seconds; its inputs held instead
    of its saved values, which are live again at its backward: :meth:`GraphStatic.recompute_bytes`)."""
    batch = static.batch_size
    table = costs.table(device)
    a, z = lo - static.lo[g], hi - static.lo[g]
    share = [float(costs.position_weights(g, ph)[a:z].sum()) for ph in range(3)]
    dur = tuple(float(table[g, ph, batch]) * share[ph] for ph in range(3))
    parts = costs.host_parts(device) if hasattr(costs, "host_parts") else None
    host = lag = None
    if parts is not None:  # the device's seconds, the host's apart (Layout.host), the chunk's share of each
        dur = (*(float(parts.device[g, ph, batch]) * share[ph] for ph in range(2)), dur[2])
        host, lag = (tuple(float(x[g, ph, batch]) * share[ph] for ph in range(2)) for x in (parts.host, parts.lag))
    w = static.work_pos[g][a:z]
    work = float(w[:, 0].max() + w[:, 1].max() * batch) if len(w) else 0.0
    if recompute:
        hf, hp, tf, tp = static.recompute_bytes(g, lo, hi)
        held = hf + hp * batch
        work += tf + tp * batch
        if host is not None:
            h, lb = host_after((np.array(dur[0]), np.array(host[0]), np.array(lag[0])), np.array(host[1]),
                               np.array(lag[1]))
            host, lag = (host[0], float(h)), (lag[0], float(lb))
        dur = (dur[0], dur[1] + dur[0], dur[2])
    else:
        held = sum(f + p * batch for f, p, ps in static.saved[g] if any(lo <= x < hi for x in ps))
    mem = float(static.static_pos[g][a:z].sum() + static.buffer_pos[g][a:z].sum() + held)
    return Unit(g, j, (device,), (batch,), (0,), None, dur, mem, work, lo, hi, host, lag)


def pair_flows(static: GraphStatic, comm, g1: int, src_deployment: GroupData, g2: int, dst_deployment: GroupData) -> list[Flow]:
    """Flows from group ``g1``'s units to group ``g2``'s units (``g1 == g2``: between mp chunks)."""
    # The tensors crossing, summed per move kind: replica-level moves are computed once per kind.
    kinds = pair_kinds(static, g1, src_deployment, g2, dst_deployment)
    moves: dict[tuple, float] = {}
    machine_of = comm.machine_of
    for (src_unit, src_phase, dst_unit, ph, kind), fixed, per_sample, sizes in kinds:
        src, dst = src_deployment.units[src_unit], dst_deployment.units[dst_unit]
        piece_list = _pieces(kind, src, dst, machine_of)
        for src_rep, dst_rep, nbytes, _ in _piece_bytes(piece_list, fixed, per_sample, sizes, src.batches):
            if nbytes <= 0:
                continue
            key = ((src_phase, g1, src_unit), src_rep, (ph, g2, dst_unit), dst_rep)
            moves[key] = moves.get(key, 0.0) + nbytes
    flows = []
    for (s, src_rep, d, dst_rep), nbytes in moves.items():
        a = src_deployment.units[s[2]].devices[src_rep]
        b = dst_deployment.units[d[2]].devices[dst_rep]
        cross = machine_of[a] != machine_of[b]
        flows.append(Flow(s, src_rep, d, dst_rep, a, b, nbytes, comm.p2p_time(a, b, nbytes),
                          machine_of[a] if cross else -1, machine_of[b] if cross else -1))
    return flows


def pair_kinds(static: GraphStatic, g1: int, src_deployment: GroupData, g2: int, dst_deployment: GroupData,
               select: str | tuple | None = None) -> tuple:
    """The tensors crossing from group ``g1``'s units to ``g2``'s, summed per (source unit and
    phase, destination unit and first-need phase, move kind): ``((su, sphase, du, ph, kind),
    fixed, per_sample, sizes)`` in :func:`pair_flows` order, ``sizes`` each tensor's ``(fixed,
    per_sample)`` (a scattered piece pads each tensor's slices: :func:`shard_bytes`). Depends on
    the deployments only through the mp chunks of the two groups.

    ``select`` (pipelines, :attr:`TensorEdge.once`): ``"micro"`` only the tensors moved once per
    micro-batch, ``"first"`` only the batch-independent ones moved before the first, ``"last"``
    only the partial sums moved after the last, ``"all"`` all of them; None: all of them. A triple
    ``(select, tied, relayed)`` (a pipeline's, :meth:`tag.sim.program.PipelineProgram.select`) leaves out the
    edges of the tied weights ``tied`` (parameter tensors, :attr:`TensorEdge.tied`), which a
    pipeline holding both copies does not move, and the ``(tensor, consumer group)`` edges of
    ``relayed`` (:meth:`GraphStatic.relayed`: another group of the stage received the tensor)."""
    kinds: dict[tuple, list[float]] = {}
    tied: frozenset = frozenset()
    relayed: frozenset = frozenset()
    if isinstance(select, tuple):
        select, tied, relayed = select
    for e in static.edges.get((g1, g2), ()):
        if select not in (None, "all") and select != ("micro" if not e.once else "last" if e.grad else "first"):
            continue
        if e.tied in tied or (e.tensor, g2) in relayed:
            continue
        src_unit = src_deployment.chunk_of.get(e.src_pos, 0) if src_deployment.mp else 0
        need: dict[int, int] = {}  # dst unit -> first phase needing it
        for p, ph in e.consumers:
            dst_unit = dst_deployment.chunk_of.get(p, 0) if dst_deployment.mp else 0
            need[dst_unit] = min(need.get(dst_unit, ph), ph)
        kind = "rows" if e.batch else ("sum" if e.grad else "copy")
        for dst_unit, ph in need.items():
            if g1 == g2 and dst_unit == src_unit:
                continue
            acc = kinds.setdefault((src_unit, e.src_phase, dst_unit, ph, kind), [0.0, 0.0, []])
            acc[0] += e.fixed
            acc[1] += e.per_sample
            acc[2].append((e.fixed, e.per_sample))
    return tuple((k, f, p, tuple(ts)) for k, (f, p, ts) in kinds.items())


class TemplateFlow(NamedTuple):
    """The field order of a flow of :attr:`PairTemplate.by_dst` (exact tuples in the caches, always
    unpacked: :mod:`tag.sim.flows` says why)."""

    src_phase: int
    """FWD, BWD or PARAM."""
    src_unit: int
    src_replica: int
    dst_replica: int
    src_device: int
    dst_device: int
    src_machine: int
    """Source machine when the flow crosses machines, else -1."""
    dst_machine: int
    seconds: float
    nbytes: float


class HolderChunks(NamedTuple):
    """A consumer holder set (replicas ``lo .. hi - 1`` on ``devices``) that received ``shard``
    pieces, and the bytes each of its replicas received so (``chunks``)."""

    lo: int
    hi: int
    devices: tuple[int, ...]
    chunks: tuple[float, ...]


class PairTemplate:
    """The flows of one :func:`pair_kinds` bundle between two deployments (``GroupData.unit_key``),
    independent of the two groups' indices: :func:`pair_flows` with stages written ``(phase,
    unit)``. ``by_dst``: ``[((ph, du), [TemplateFlow tuple])]`` in flow order. ``gathers``:
    ``[((ph, du), (HolderChunks, ...))]``, per destination stage the consumer holder sets that
    received ``shard`` pieces (Megatron-LM's scatter-gather between machines,
    :mod:`tag.parallel.moves`), which the set then all-gathers
    (:meth:`tag.sim.event_loop.Run._scatter_gather`)."""

    __slots__ = ("by_dst", "gathers", "nbytes")

    def __init__(self, kinds: tuple, units1: list[Unit], units2: list[Unit], comm, pieces: dict | None = None,
                 unit_keys: tuple = ()):
        """``pieces``: a cache of :func:`_pieces` shared by templates (keyed with ``unit_keys``, what
        the two unit lists depend on: :attr:`GroupData.unit_key`)."""
        moves: dict[tuple, float] = {}
        machine_of = comm.machine_of
        gathered: dict[tuple, dict[tuple[int, int], list[float]]] = {}  # (ph, dst_unit) -> set -> bytes per replica
        if pieces is None:  # (src_unit, dst_unit, kind) -> [(src_rep, dst_rep, samples or -1)]: bundles share them
            pieces, unit_keys = {}, ()
        made = 0  # bytes of the entries made in pieces
        for (src_unit, src_phase, dst_unit, ph, kind), fixed, per_sample, sizes in kinds:
            src = units1[src_unit]
            piece_list = pieces.get((src_unit, dst_unit, kind, unit_keys))
            if piece_list is None:
                piece_list = _pieces(kind, src, units2[dst_unit], machine_of)
                pieces[(src_unit, dst_unit, kind, unit_keys)] = piece_list
                made += ENTRY_BYTES + FLOW_BYTES * len(piece_list)
            for src_rep, dst_rep, nbytes, holder_set in _piece_bytes(piece_list, fixed, per_sample, sizes, src.batches):
                if nbytes <= 0:
                    continue
                key = (ph, dst_unit, src_phase, src_unit, src_rep, dst_rep)
                moves[key] = moves.get(key, 0.0) + nbytes
                if holder_set is not None:
                    lo, hi = holder_set
                    acc = gathered.setdefault((ph, dst_unit), {}).setdefault(holder_set, [0.0] * (hi - lo))
                    acc[dst_rep - lo] += nbytes
        by_dst: dict[tuple, list] = {}
        p2p = comm.p2p_time
        for (ph, dst_unit, src_phase, src_unit, src_rep, dst_rep), nbytes in moves.items():
            a = units1[src_unit].devices[src_rep]
            b = units2[dst_unit].devices[dst_rep]
            cross = machine_of[a] != machine_of[b]
            by_dst.setdefault((ph, dst_unit), []).append(
                (src_phase, src_unit, src_rep, dst_rep, a, b, machine_of[a] if cross else -1,
                 machine_of[b] if cross else -1, p2p(a, b, nbytes), nbytes))
        self.by_dst = list(by_dst.items())
        self.gathers = [(dst, tuple(HolderChunks(lo, hi, tuple(units2[dst[1]].devices[lo:hi]), tuple(c))
                                    for (lo, hi), c in sets.items())) for dst, sets in gathered.items()]
        self.nbytes = made + FLOW_BYTES * len(moves) + ref_bytes(len(self.by_dst)) + gathers_bytes(self.gathers)
        """Approximate bytes of this template and of the entries its construction made in ``pieces``."""


def gathers_bytes(gathers) -> int:
    """Approximate bytes of :attr:`PairTemplate.gathers` (or a :class:`tag.sim.flows.PairFlows`', which
    shares its sets)."""
    return sum(ref_bytes(len(sets)) + sum(ENTRY_BYTES + 2 * seq_bytes(hi - lo) for lo, hi, _, _ in sets)
               for _, sets in gathers)


def _pieces(kind: str, src: Unit, dst: Unit, machine_of) -> list[tuple[int, int, int, float, tuple[int, int] | None]]:
    """(producer replica, consumer replica, samples of a ``rows`` piece or -1, fraction moved: 1,
    or ``1 / size`` of a ``shard`` piece into a consumer holder set of ``size``, that set's replica
    range ``(lo, hi)`` for a ``shard`` piece else None) of the pieces that cross devices, per the
    move rules (:func:`tag.parallel.move_pieces`)."""
    src_devices, dst_devices = src.devices, dst.devices
    out = []
    sets = None
    for i, j, mode, lo, hi in move_pieces(kind, src, dst, machine_of.__getitem__):
        if mode == "zeros" or src_devices[i] == dst_devices[j]:
            continue
        frac, holder_set = 1.0, None
        if mode == "shard":
            if sets is None:
                sets = [(0, 0)] * len(dst_devices)
                for a, b in holder_sets(dst):
                    sets[a:b] = [(a, b)] * (b - a)
            holder_set = sets[j]
            frac = 1.0 / (holder_set[1] - holder_set[0])
        out.append((i, j, hi - lo if kind == "rows" else -1, frac, holder_set))
    return out


def shard_bytes(nbytes: float, size: int) -> float:
    """Bytes a holder set of ``size`` devices receives, all slices together, when a tensor of
    ``nbytes`` is scattered into it: ``nbytes`` padded to a multiple of ``size`` (each slice
    :func:`tag.executor.runtime.slice_bytes`, the executor's zero bytes where ``size`` does not
    divide ``nbytes``; 2026-11-27)."""
    r = nbytes % size
    return nbytes if r == 0 else nbytes + (size - r)


def _piece_bytes(pieces: list, fixed: float, per_sample: float, sizes: tuple, batches
                 ) -> list[tuple[int, int, float, tuple | None]]:
    """(producer replica, consumer replica, bytes, scattered into holder set or None) of ``pieces``
    of a tensor bundle of ``fixed + per_sample * b`` bytes (``sizes``: each tensor's ``(fixed,
    per_sample)``): rows by overlap, a copy or a partial sum at the producer's batch (times the
    fraction moved; a ``shard`` piece's tensors each padded to a multiple of the set's size,
    :func:`shard_bytes`)."""
    out = []
    for i, j, n, f, holder_set in pieces:
        if holder_set is None:
            out.append((i, j, (per_sample * n if n >= 0 else fixed + per_sample * batches[i]) * f, holder_set))
            continue
        size, b = holder_set[1] - holder_set[0], batches[i]
        padded = sum(shard_bytes(p * n if n >= 0 else x + p * b, size) for x, p in sizes)
        out.append((i, j, padded * f, holder_set))
    return out


__all__ = ["BWD", "FWD", "PARAM", "Flow", "GroupData", "HolderChunks", "Layout", "SfbData", "TemplateFlow", "Unit",
           "at_batch", "make_layout", "mp_unit", "recompute_layout", "pair_flows", "pair_kinds", "PairTemplate",
           "shard_bytes"]
