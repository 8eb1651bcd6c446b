"""torch.distributed transport for one rank: process groups, p2p batches, gradient syncs."""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..parallel.schedule import Bucket, Schedule, Step
from .runtime import RankRuntime

GLOO_CUDA = "gloo-cuda"
"""The backend of ranks on this machine's GPUs that talk over gloo (several ranks may share one
GPU, which NCCL refuses): the GPU check's CUDA paths of multi-rank plans on one GPU
(``evaluation/gpu_check.py``). Process groups are gloo's; activations are staged through pinned
host memory (:attr:`DistComm.stage_p2p`)."""


@dataclass
class DistComm:
    """The rank's process groups; created once, in the same order on every rank."""

    rank: int
    world: int
    backend: str
    groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    gather_groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    """SFB all-gathers: process groups of their own (not queued behind the gradient syncs)."""
    pending: list[_Pending] = field(default_factory=list)
    accumulating: bool = False
    """``tag run``'s gradient accumulation, a batch before a step's last: no bucket is synced, its
    gradients are added to :attr:`carried` instead (DDP's ``no_sync``), and the step's last batch
    syncs the sum once (:meth:`sync`)."""
    carried: dict[int, torch.Tensor] = field(default_factory=dict)
    """Schedule bucket index -> this rank's flat gradients of the bucket summed over the step's
    batches so far (unsynced)."""
    started: int = 0
    """Bucket collectives this rank has issued (``tag run`` reports it)."""
    defer_syncs: bool = False
    """Queue gradient buckets until :meth:`finish_syncs` (CPU ranks, see :meth:`sync`)."""
    pack_p2p: bool = False
    """Send one message per peer and step, receives posted a step ahead (CPU ranks, see
    :meth:`transfer`)."""
    recv_steps: list[int] = field(default_factory=list)
    """Schedule indices of the transfer steps in which this rank receives."""
    posted: dict[int, tuple] = field(default_factory=dict)
    """Receives posted ahead: schedule index -> (works, pieces by move tag)."""
    sends: list = field(default_factory=list)
    """Works of sends in flight (GPU ranks: a step in which the rank only sends is not waited
    for, its compute goes on; waited for before the iteration's update, :meth:`finish_syncs`)."""
    send_stream: object = None
    """CUDA ranks: the stream the sends of a step without receives go on (:meth:`_send_when_made`)."""
    remote_steps: frozenset[int] = frozenset()
    """Schedule indices of the transfer steps in which this rank sends or receives (the others
    only assemble local pieces: no process-group call)."""
    links: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    """CPU ranks: (source rank, destination rank) -> the two-rank process group that carries that
    direction's transfers (see :meth:`init`)."""
    peers: dict[int, int] = field(default_factory=dict)
    """The schedule's device -> the rank this rank exchanges its activations with in its place (a
    rank running another's schedule device: the member of the same index, :attr:`Execution.shards
    <tag.executor.strategies.Execution.shards>`); absent: the device itself."""
    sent_s: list[tuple[int, float]] | None = None
    """CPU ranks, when a list: (destination rank, seconds) of each message sent is appended, from
    its post (on a throttled link: from when the link takes it up) to its completion; emptied by
    its reader (:mod:`tag.executor.adaptive`)."""
    link_delay_s: float = 0.0
    """Testing: seconds this CPU rank's link holds each message it sends, one message at a time, its
    compute going on meanwhile (:class:`tag.executor.adaptive.Throttle`); 0: none."""
    stage_p2p: bool = False
    """CUDA ranks over gloo (:data:`GLOO_CUDA`): every message copied to pinned host memory before
    its send and received there, then copied to the device. gloo's send and receive hand the
    tensor's data pointer to its TCP transport as host memory (torch's ProcessGroupGloo::send:
    ``createUnboundBuffer(tensor.const_data_ptr(), size)``), where its collectives copy CUDA
    tensors through pinned host memory themselves (AsyncAllreduceCUDAWork)."""
    _link: object = None

    @classmethod
    def init(cls, rank: int, world: int, backend: str, timeout_s: float, schedule: Schedule,
             device: torch.device, shards: list[dict[int, int]] | None = None, me: int | None = None) -> DistComm:
        """``init_process_group`` (env:// from the launcher) plus one subgroup per synced device set.

        ``timeout_s`` bounds every blocked collective / receive (gloo), so a stuck peer turns
        into an error instead of a hang.

        ``shards`` (ranks running one schedule device together, :attr:`Execution.shards
        <tag.executor.strategies.Execution.shards>`; whole-plan tensor parallelism's shards): per
        member index, the schedule's device -> the rank of that index running it; every synced
        device set then gets one process group per index, and this rank's gradients go to its own;
        ``me``: the schedule's device this rank runs as (default ``rank``), whose activations it
        exchanges with the ranks of its own index (:attr:`peers`).

        CPU ranks also get a two-rank process group of its own per direction of every pair that
        exchanges activations (:attr:`links`). gloo's event thread skips a connection whose lock
        another thread holds and is handed the same event again at once, so a rank posting a
        receive (or a send) on the connection its peer is writing to made that thread spin,
        on the development microVM for milliseconds at a time; one connection per direction
        keeps a rank's posts and its peer's data apart (docs/executor.md has the
        measurements).
        """
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group("gloo" if backend == GLOO_CUDA else backend, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
        cpu = device.type == "cpu"
        staged = backend == GLOO_CUDA and not cpu
        me = rank if me is None else me
        transfers = [(i, st) for i, st in enumerate(schedule.steps) if st.kind == "transfer"]
        comm = cls(rank, world, backend, defer_syncs=cpu, pack_p2p=cpu or staged, stage_p2p=staged,
                   peers=next((shard for shard in shards or [] if shard.get(me) == rank), {}))
        comm.use_schedule(schedule, me)
        for members in schedule.comm_groups:  # every rank calls new_group for every set, same order
            for shard in shards or [{m: m for m in members}]:
                ranks = [shard[m] for m in members]
                pg = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
                if shards is None or rank in ranks:
                    comm.groups[members] = pg
        for members in schedule.gather_groups:
            comm.gather_groups[members] = dist.new_group(list(members), timeout=timedelta(seconds=timeout_s))
        if comm.pack_p2p:
            pairs = {(m.src, m.dst) for _, st in transfers for m in st.moves if m.src != m.dst}
            for a, b in sorted({(shard.get(a, a), shard.get(b, b)) for shard in shards or [{}] for a, b in pairs}):
                comm.links[(a, b)] = dist.new_group(sorted((a, b)), timeout=timedelta(seconds=timeout_s))
        # One collective over everybody first: NCCL wants every rank in the first p2p batch's group.
        comm.barrier(device)
        return comm

    def use_schedule(self, schedule: Schedule, me: int) -> None:
        """Take the transfer steps of ``schedule`` (walked as its device ``me``): the same
        process groups serve another order of the same transfers (another kFkB block size)."""
        transfers = [(i, st) for i, st in enumerate(schedule.steps) if st.kind == "transfer"]
        self.recv_steps = [i for i, st in transfers if any(m.dst == me and m.src != me for m in st.moves)]
        self.remote_steps = frozenset(i for i, st in transfers
                                      if any(m.src != m.dst and me in (m.src, m.dst) for m in st.moves))

    def barrier(self, device: torch.device) -> None:
        """Every rank of the world reaches this point (nothing to wait for with one rank: a gloo
        all-reduce of world size 1 still costs ~47 us, 2.4% of the mlp step of the executor benchmark)."""
        if dist.get_world_size() == 1:
            return
        t = torch.zeros(1, device=device)
        dist.all_reduce(t)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- steps -----------------------------------------------------------------------------
    def transfer(self, rt: RankRuntime, step: Step, index: int) -> None:
        """Post every send/receive of this rank in ``step`` (``index`` in the schedule) at once, wait,
        then assemble.

        A CPU rank (:attr:`pack_p2p`) packs the pieces it sends to one peer in a step into one
        message, received as one buffer whose views are the pieces, and posts the receives of its
        next receiving step before it computes on (:meth:`prepost`). On the 2-core development VM,
        six gloo sends or receives posted at once took 1.2 ms on average (post + wait; the post
        alone 3.4 ms at the 90th percentile), one packed message 0.45 ms; a 100 KB message between
        two ranks that both just computed 0.6 ms, with the receive posted only then, 0.52-0.61 ms
        on average (90th percentile 1.4-2.3 ms), with the receive posted before the compute
        0.10-0.13 ms (docs/executor.md). The simulator prices a step's pieces between two
        devices as one message too (:meth:`tag.sim.event_loop.Run._transfer`)."""
        t0 = time.perf_counter()
        received: dict[int, torch.Tensor] = {}
        if index in self.remote_steps:  # else only local pieces (or nothing): no process-group call
            received = self._exchange_packed(rt, step, index) if self.pack_p2p else self._exchange(rt, step)
        rt.assemble(step, received)
        rt.timer.comm += time.perf_counter() - t0

    def _exchange(self, rt: RankRuntime, step: Step) -> dict[int, torch.Tensor]:
        """One message per piece, posted as one ``batch_isend_irecv`` (GPU ranks); the received
        pieces by move tag. A step in which this rank only sends is not waited for (NCCL orders the
        compute stream after a work only when it is waited for): the rank computes on while its
        sends go (:attr:`sends`, as the simulator's :meth:`tag.sim.event_loop.Run._transfer`); one in
        which it receives is (NCCL runs the step's sends and receives as one group)."""
        ops, received = [], {}
        if rt.device.type == "cuda" and self._send_when_made(rt, step):
            return received
        for tag, dst, piece in rt.outgoing(step):
            ops.append(dist.P2POp(dist.isend, piece, self.peers.get(dst, dst), tag=tag))
        for tag, src, buf in rt.incoming(step):
            ops.append(dist.P2POp(dist.irecv, buf, self.peers.get(src, src), tag=tag))
            received[tag] = buf
        if ops:
            works = dist.batch_isend_irecv(ops)
            if not received:  # (the works hold the pieces until they are waited for)
                self.sends += works
                return received
            for req in works:
                req.wait()
        return received

    def _send_when_made(self, rt: RankRuntime, step: Step) -> bool:
        """Post the sends of a step in which this CUDA rank only sends on a stream of their own
        that waits for the segments making their pieces alone, not for the compute enqueued since
        (the next stage's forward, say): NCCL orders a work after the stream current when it is
        posted. False (nothing posted) if the rank receives in the step or a piece was not made by
        a segment of this iteration (:meth:`RankRuntime.made_events`)."""
        if any(m.dst == rt.rank and m.src != rt.rank for m in step.moves):
            return False
        made = rt.made_events(step)
        if made is None:
            return False
        if self.send_stream is None:
            self.send_stream = torch.cuda.Stream(rt.device)
        for ev in made:
            self.send_stream.wait_event(ev)
        with torch.cuda.stream(self.send_stream):  # (a scattered piece's slice is copied there too)
            ops = [dist.P2POp(dist.isend, piece, self.peers.get(dst, dst), tag=tag)
                   for tag, dst, piece in rt.outgoing(step)]
            self.sends += dist.batch_isend_irecv(ops)
        return True

    def _exchange_packed(self, rt: RankRuntime, step: Step, index: int) -> dict[int, torch.Tensor]:
        """One packed message per peer (CPU ranks), receives posted ahead (:meth:`prepost`); the
        received pieces (views of the packed buffers) by move tag."""
        recvs, received = self.posted.pop(index, None) or self._post_receives(rt, step, index)
        by_dst: dict[int, list] = {}
        for _tag, dst, piece in rt.outgoing(step):
            by_dst.setdefault(self.peers.get(dst, dst), []).append(piece)
        sends = [self._isend(pack(pieces), dst, index) for dst, pieces in by_dst.items()]
        self.prepost(rt, index)
        for w in sends + recvs:
            if w is not None:
                w.wait()
        return received

    def _isend(self, msg: torch.Tensor, dst: int, index: int):
        """Send ``msg`` to rank ``dst`` (tag ``index``) on their link; a work to wait for, or None
        on a throttled link (its send goes on a thread of its own after :attr:`link_delay_s`,
        waited for with the iteration's other sends, :meth:`finish_syncs`). Timed into :attr:`sent_s`."""
        pg = self.links[(self.rank, dst)]
        if self.stage_p2p:
            msg = to_pinned_host(msg)
        if self.link_delay_s <= 0:
            return _TimedSend(dist.isend(msg, dst, tag=index, group=pg), dst, self.sent_s)
        if self._link is None:
            from concurrent.futures import ThreadPoolExecutor

            self._link = ThreadPoolExecutor(1, thread_name_prefix="tag-throttled-link")
        self.sends.append(_Delayed(self._link.submit(_delayed_send, msg, dst, index, pg, self.link_delay_s,
                                                     self.sent_s)))
        return None

    def _post_receives(self, rt: RankRuntime, step: Step, index: int) -> tuple[list, dict]:
        """Post this rank's receives of ``step``: one packed message per source rank, tagged with
        the step's ``index``; returns the works and the pieces (views of the buffers) by move tag."""
        by_src: dict[int, list] = {}
        for tag, src, shape, dtype in rt.incoming_specs(step):
            by_src.setdefault(self.peers.get(src, src), []).append((tag, shape, dtype))
        works, received = [], {}
        for src, parts in by_src.items():
            flat, views = packed_buffer([(shape, dtype) for _, shape, dtype in parts], rt.device)
            if self.stage_p2p:
                host = to_pinned_host(flat, copy=False)
                works.append(StagedRecv(dist.irecv(host, src, tag=index, group=self.links[(src, self.rank)]),
                                        host, flat))
            else:
                works.append(dist.irecv(flat, src, tag=index, group=self.links[(src, self.rank)]))
            received.update((tag, v) for (tag, _, _), v in zip(parts, views))
        return works, received

    def prepost(self, rt: RankRuntime, after: int = -1) -> None:
        """Post the receives of this rank's first receiving step after schedule index ``after``
        (CPU ranks; ``-1``: the iteration's first), so that they are posted while the rank
        computes on, before the peer sends."""
        k = bisect.bisect_right(self.recv_steps, after)
        if k < len(self.recv_steps) and self.recv_steps[k] not in self.posted:
            i = self.recv_steps[k]
            self.posted[i] = self._post_receives(rt, rt.schedule.steps[i], i)

    def sfb(self, rt: RankRuntime, step: Step) -> None:
        """SFB of ``step.group``: all-gather each factor over the replicas (blocking, one after the
        other), then recompute the SFB gradients (:meth:`RankRuntime.sfb_recompute`)."""
        from ..compress.runtime import gather_rows

        sg = rt.schedule.sfb[step.group]
        if self.rank not in sg.devices:
            return
        t0 = time.perf_counter()
        members = sg.members
        order = [members.index(d) for d in sg.devices]  # group ranks in sample order
        pg = self.gather_groups[members]
        full = {}
        for name, local in rt.sfb_local(step.group).items():
            f = next(f for f in sg.factors if f.name == name)
            counts = rt.sfb_counts(step.group, name, local)
            full[name] = gather_rows(local, f.batch_dim, counts, group=pg, sample_order=order)
        dt = time.perf_counter() - t0
        rt.timer.sync += dt
        rt.timer.sfb_gather += dt
        rt.sfb_recompute(step.group, full)

    def sync(self, rt: RankRuntime, step: Step) -> None:
        """At the sync of a gradient bucket's last group (:meth:`Schedule.launched_at`): flatten the
        bucket's gradients into one buffer and start summing it over its members (async; see
        :meth:`finish_syncs`). At the other syncs nothing happens: their gradients wait in ``env``
        for their bucket's last group. While :attr:`accumulating`, the flat gradients are kept in
        :attr:`carried` and not synced; the next synced batch adds them to its own.

        All-reduce, or PS: reduce to the server now, broadcast back in :meth:`finish_syncs`
        (after every reduce of the iteration was issued), so every member issues the collectives
        of one process group in the same order and no rank blocks mid-backward on a peer's reduce.

        On a CPU rank the collective is only queued here and issued by :meth:`finish_syncs`, after
        the rank's last compute (docs/design.md: a CPU rank computes on every core it has; gloo's
        threads would otherwise time-slice with the compute and stretch both), bucket after
        bucket in launch order (the simulator's :meth:`tag.sim.Simulator.sync_jobs`).
        """
        b = rt.schedule.launched_at(step)
        if b is None or rt.rank not in b.collective.members:  # (rt.rank: the schedule's device this rank runs as)
            return
        t0 = time.perf_counter()
        c = b.collective
        index = rt.schedule.buckets.index(b)
        flat, held = rt.bucket_flat(b), self.carried.pop(index, None)
        flat = flat if held is None else held.add_(flat)
        if self.accumulating:  # (synced with the step's last batch)
            self.carried[index] = flat
            rt.timer.sync += time.perf_counter() - t0
            return
        own = rt.hook.bucket_sync(rt, index) if rt.hook is not None else None
        p = _Pending(b, flat, None, self.groups[c.members], c.server, own=own)
        self.started += 1
        if not self.defer_syncs:
            p.start()
        self.pending.append(p)
        rt.timer.sync += time.perf_counter() - t0

    def _broadcast_reduced(self) -> None:
        """For every PS reduce started so far: wait for it and start its broadcast back."""
        for p in self.pending:
            if p.server is not None and not p.broadcast:
                p.work.wait()
                p.work = dist.broadcast(p.flat, src=p.server, group=p.pg, async_op=True)
                p.broadcast = True

    def finish_syncs(self, rt: RankRuntime) -> None:
        """Wait for every gradient bucket of the iteration and hand the sums to the runtime."""
        t0 = time.perf_counter()
        for w in self.sends:
            w.wait()
        self.sends.clear()
        for p in self.pending:
            if p.work is None:
                p.start()
        self._broadcast_reduced()
        for p in self.pending:
            p.work.wait()
            if p.own is None:  # (a hook's own collective leaves the runtime's gradients as they are)
                rt.set_bucket_flat(p.bucket, p.flat)
        self.pending.clear()
        if rt.hook is not None and not self.accumulating:
            rt.hook.synced(rt)
        rt.timer.sync += time.perf_counter() - t0


def all_gather_flat(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """The 1-D tensors ``x`` of the ``size`` members of ``group`` concatenated in member order
    (blocking; :attr:`RankHook.gather <tag.executor.strategies.RankHook.gather>`); into one tensor
    on NCCL, as a list elsewhere (gloo gathers CUDA tensors as lists: AsyncAllgatherCUDAWork)."""
    if x.is_cuda and dist.get_backend(group) == "nccl":
        out = x.new_empty(size * x.numel())
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts)


PACK_ALIGN = 16
"""Byte alignment of every piece in a packed message (any dtype's view of it is aligned)."""


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offset of each piece (``sizes`` in bytes, in order) and the message's total bytes."""
    offs, pos = [], 0
    for n in sizes:
        offs.append(pos)
        pos += -(-n // PACK_ALIGN) * PACK_ALIGN
    return offs, pos


def pack(pieces: list[torch.Tensor]) -> torch.Tensor:
    """One flat ``uint8`` message holding contiguous ``pieces`` (any dtypes and shapes) in order;
    a single piece is sent as it is. :func:`packed_buffer` gives the receiving side's views."""
    if len(pieces) == 1:
        return pieces[0]
    sizes = [p.numel() * p.element_size() for p in pieces]
    offs, total = _offsets(sizes)
    flat = torch.empty(total, dtype=torch.uint8, device=pieces[0].device)
    for p, o, n in zip(pieces, offs, sizes):
        flat[o:o + n].copy_(p.reshape(-1).view(torch.uint8))
    return flat


def packed_buffer(specs: list[tuple[list[int], torch.dtype]], device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Receive buffer for a message :func:`pack` made from pieces of ``specs`` (shape, dtype), and
    each piece as a view of it."""
    if len(specs) == 1:
        buf = torch.empty(specs[0][0], dtype=specs[0][1], device=device)
        return buf, [buf]
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    offs, total = _offsets(sizes)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    views = [flat[o:o + n].view(dtype).view(shape) for (shape, dtype), o, n in zip(specs, offs, sizes)]
    return flat, views


def to_pinned_host(x: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """A host tensor of ``x``'s shape and dtype, page-locked where ``x`` is a CUDA tensor (its
    copies to and from the GPU then run by DMA), holding ``x``'s values when ``copy`` (the copy
    waits for the work queued on ``x``'s stream)."""
    host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.is_cuda)
    return host.copy_(x) if copy else host


@dataclass
class StagedRecv:
    """A receive into host memory whose wait also copies the message to its device buffer
    (:attr:`DistComm.stage_p2p`); the copy is queued on the current stream, ahead of the compute
    that reads the pieces (views of ``device``)."""

    work: object
    host: torch.Tensor
    device: torch.Tensor

    def wait(self) -> None:
        self.work.wait()
        self.device.copy_(self.host, non_blocking=True)


@dataclass
class _Pending:
    """A gradient bucket's collective in flight (or queued: ``work`` None)."""

    bucket: Bucket
    flat: torch.Tensor
    """The bucket's gradients, concatenated (summed in place)."""
    work: object
    pg: object
    server: int | None
    broadcast: bool = False
    own: object = None
    """The rank hook's own collective of the bucket (:meth:`RankHook.bucket_sync
    <tag.executor.strategies.RankHook.bucket_sync>`: a reduce-scatter), None for the schedule's."""

    def start(self) -> None:
        """Issue the all-reduce, or the PS reduce to the server, or the hook's own (async)."""
        if self.own is not None:
            self.work = self.own(self.flat)
        elif self.server is not None:
            self.work = dist.reduce(self.flat, dst=self.server, group=self.pg, async_op=True)
        else:
            self.work = dist.all_reduce(self.flat, group=self.pg, async_op=True)


@dataclass
class _TimedSend:
    """A send's work whose wait records its seconds since the post in ``into`` (once)."""

    work: object
    dst: int
    into: list
    posted: float = field(default_factory=time.perf_counter)

    def wait(self) -> None:
        self.work.wait()
        if self.into is not None:
            self.into.append((self.dst, time.perf_counter() - self.posted))
            self.into = None


def _delayed_send(msg: torch.Tensor, dst: int, index: int, pg, delay_s: float, into: list) -> None:
    """A throttled link's send: held ``delay_s`` seconds, then sent and waited for (on the link's
    thread; the seconds from taking it up to its completion into ``into``)."""
    t0 = time.perf_counter()
    time.sleep(delay_s)
    dist.isend(msg, dst, tag=index, group=pg).wait()
    if into is not None:
        into.append((dst, time.perf_counter() - t0))


@dataclass
class _Delayed:
    """A throttled send in flight (a future of :func:`_delayed_send`), waited for like a work."""

    future: object

    def wait(self) -> None:
        self.future.result()
