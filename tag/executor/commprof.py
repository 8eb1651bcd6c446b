"""Measure point-to-point and collective costs on the local process group and fit them.

Two local processes (``torch.multiprocessing.spawn``) join a ``torch.distributed`` group over TCP
on 127.0.0.1 only (:mod:`tag.executor.loopback`) (gloo; NCCL when ``backend="nccl"`` and GPUs are present) and time, for every
message size, each operation the way the executor performs it (``tag.executor.comm``), every
call from the later of the ranks' arrivals to the later of their completions on the host's one
clock (:func:`_rendezvous_mean`, as the simulator prices a transfer or a collective: a parameter
server's sync ends on the server when its broadcast back is queued, on a replica only when the
sums have arrived), and reports the *mean* over ``repeats`` timed calls after ``warmup``. The
mean, not the median: gloo's latency on a small VM has a heavy tail, and an iteration pays the
tail of each of its tens of transfers, so the expected time of a sum of transfers is the sum of
the means. Before every timed call each CPU rank computes :data:`CPU_BUSY_S` (an executor rank
hands over from a stage).

* ``p2p`` on CPU (:func:`_transfer_step`): a transfer step. The receiver posts its receive on a
  two-rank process group of its own (the executor's ``DistComm.links``) a step ahead, in the
  previous call, and both ranks compute; the sender packs two pieces into one message and sends
  it, the receiver waits and assembles it. The time is from the later of the two ranks' arrival
  to the later of their completions (one host clock), as the simulator's rendezvous prices a
  transfer. There is no barrier between the calls, as there is none between an iteration's steps.
  With NCCL: a ping-pong (round trip / 2).
* ``all_reduce``, ``reduce``, ``broadcast``: one gradient sync as a CPU rank runs it
  (:func:`_bucketed`): per-group flattening into one bucket, the collective, the sums copied back
  (a parameter server's reduce carries the first copies, its broadcast back the last; ``ps`` times
  the two as one sync, the way the executor runs it), one call after a barrier (the executor
  coalesces a CPU rank's syncs into one bucket per replica set, docs/design.md).
* ``all_gather`` (SFB factors, gathered one after the other): a burst of :data:`BURST` calls on
  distinct buffers back to back, per call.

``time = alpha + bytes / beta`` is then fitted per operation
(:func:`tag.cost.comm.fit_latency_bandwidth`). CPU ranks run as the executor's do: pinned to a
core each, gloo's event threads under ``SCHED_IDLE`` (:func:`tag.cost.host.pin_cores`,
:func:`tag.cost.host.demote_threads`).

Why as the executor performs them: a clean ping (the receive posted when the call starts) costs a
fraction of an executor transfer step, which packs, posts the next receive and assembles, and
whose receiver's event thread reads only once the rank waits; a collective timed without the
executor's flattening and copying back costs less than its sync step.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from ..cost.comm import COMM_OPS, CommProfile, fit_latency_bandwidth
from ..cost.host import demote_threads, pin_cores
from .loopback import LOOPBACK, loopback_env, loopback_store

DEFAULT_SIZES = tuple(4096 * 4**k for k in range(7))  # 4 KiB .. 16 MiB
BURST = 4
"""All-gathers per timed burst (distinct buffers, back to back, as the executor's SFB gathers)."""
DEFAULT_REPEATS = 160
"""Timed calls per (operation, size) up to :data:`FULL_REPEATS_BYTES`: enough for the mean of a
heavy-tailed latency to settle. With 40, the fitted point-to-point latency of three profiles made
within an hour on the 2-core development VM was 0.09, 0.11 and 0.46 ms; with 160, two profiles
gave 0.41 and 0.45 ms (the profile takes ~18 s instead of ~7 s)."""
CPU_BUSY_S = 1e-3
"""Seconds of compute before each timed gloo call (a typical CPU stage). On the 2-core
development VM a 4 KiB one-way gloo transfer took 0.12 ms at the median and 0.31 ms on average
right after a barrier, but 0.16 / 1.2 ms after both ranks computed for 0.5 ms: a rank that was
computing pays more to hand over to the communication threads."""
FULL_REPEATS_BYTES = 1 << 20
"""Above this size the repeats shrink in proportion (at least 5): the tail is a latency, small
beside a large message's transfer time, and a 16 MiB all-gather takes ~50 ms on the dev VM."""


def repeats_for(nbytes: int, repeats: int) -> int:
    """Timed calls for messages of ``nbytes`` (the same on every rank: collectives must match)."""
    return max(min(5, repeats), min(repeats, repeats * FULL_REPEATS_BYTES // max(1, nbytes)))


def _busy(seconds: float, a, b) -> None:
    """Compute (matmuls) for ``seconds``: the state a rank is in when a stage hands over to comm."""
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        a @ b


def _transfer_step(rank: int, x, link, repeats: int, warmup: int, busy_s: float, a, b):
    """A CPU transfer step as the executor makes one (``tag.executor.comm``),
    ``x``'s bytes from rank 0 to rank 1 on the two-rank ``link`` group: rank 1 posts the receive
    of the next call just before it waits for this one (``DistComm.prepost``), both
    ranks compute ``busy_s``, rank 0 packs ``x`` (two pieces copied into one message) and sends
    it, rank 1 waits and assembles it. A call lasts from the later of the two ranks' arrivals to
    the later of their completions (both ranks read one host clock): every rank returns its
    ``[call, (arrival, completion)]`` marks after the warm-up for :func:`_rendezvous_mean` (zeros
    on ranks other than 0 and 1)."""
    import torch
    import torch.distributed as dist

    from .comm import pack

    marks = torch.zeros(warmup + repeats, 2, dtype=torch.float64)  # [call, (arrival, completion)] s
    if rank > 1:
        dist.barrier()
        return marks[warmup:]
    half = x.numel() // 2
    pieces = [x[:half], x[half:]]

    def post(i):  # the receive of call i, into a fresh packed buffer (as DistComm.prepost)
        buf = torch.empty(x.numel() * x.element_size(), dtype=torch.uint8)
        return buf, dist.irecv(buf, 0, group=link, tag=i)

    nxt = post(0) if rank == 1 else None
    dist.barrier()
    for i in range(warmup + repeats):
        _busy(busy_s, a, b)
        t0 = time.perf_counter()
        if rank == 0:
            dist.isend(pack(pieces), 1, group=link, tag=i).wait()
        else:
            (buf, work), nxt = nxt, (post(i + 1) if i + 1 < warmup + repeats else None)
            work.wait()
            torch.cat([buf[: half * x.element_size()], buf[half * x.element_size():]])  # assembled
        marks[i] = torch.tensor([t0, time.perf_counter()], dtype=torch.float64)
    return marks[warmup:]


def _rendezvous_mean(marks, world: int) -> float:
    """Mean seconds from the later arrival to the later completion over the ``world`` ranks
    (``marks``: this rank's ``[call, (arrival, completion)]`` on the host clock), the way the
    simulator prices a collective: a parameter server's broadcast back is done on the server when
    its send is queued, but on a replica only once the sums have arrived. Every rank returns it."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else marks.device
    every = [torch.empty_like(marks, device=device) for _ in range(world)]
    dist.all_gather(every, marks.to(device))
    both = torch.stack(every).cpu()  # [rank, call, 2]
    return float((both[..., 1].amax(0) - both[..., 0].amax(0)).mean())


BUCKET_GROUPS = 4
"""Op-groups whose gradients a timed gradient collective carries (:func:`_bucketed`)."""


def _bucketed(x, collective, flatten: bool, scatter: bool) -> None:
    """One gradient sync of ``x``'s bytes as a CPU executor rank runs it (``DistComm.sync`` /
    ``finish_syncs``): with ``flatten``, the gradients of :data:`BUCKET_GROUPS` groups (two tensors
    each, views of ``x``) are flattened per group and concatenated into one bucket; ``collective``
    runs on it; with ``scatter``, the sums are copied back into the gradients. An all-reduce does
    both, a parameter server's reduce the first half and its broadcast back the second."""
    import torch

    parts = x.chunk(2 * BUCKET_GROUPS)
    flat = torch.cat([torch.cat(parts[i:i + 2]) for i in range(0, len(parts), 2)]) if flatten else x
    collective(flat)
    if scatter:  # (without flatten the bucket is x itself: its parts are copied onto themselves)
        for dst, src in zip(parts, flat.split([p.numel() for p in parts])):
            dst.copy_(src)


def _worker(rank: int, world: int, port: int, backend: str, sizes: list[int], repeats: int, warmup: int,
            out: str, threads: int, busy_s: float) -> None:
    import multiprocessing

    import torch
    import torch.distributed as dist

    from ..lifetime import die_with

    die_with(multiprocessing.parent_process().pid)  # no orphan after a kill -9 of `tag profile`
    torch.set_num_threads(threads)
    pinned = None
    if backend != "nccl":  # as an executor's CPU ranks run (tag.executor.worker)
        pinned = pin_cores(rank, world, threads)
    # A client of the launcher's store, which listens on 127.0.0.1 only (tag.executor.loopback).
    store = dist.TCPStore(LOOPBACK, port, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if pinned:
        demote_threads()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def ping(x):
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)

    a = torch.randn(128, 128, device=device)
    b = torch.randn(128, 128, device=device)
    results: dict[str, list[tuple[int, float]]] = {op: [] for op in COMM_OPS}
    link = dist.new_group([0, 1]) if device.type == "cpu" else None  # as the executor's DistComm.links
    try:
        for size in sizes:
            xs = [torch.ones(size // 4, device=device) for _ in range(BURST)]
            gathered = [[torch.empty_like(x) for _ in range(world)] for x in xs]
            if link is not None:
                n = repeats_for(size, repeats)
                marks = _transfer_step(rank, xs[0], link, n, warmup, busy_s, a, b)
                results["p2p"].append((size, _rendezvous_mean(marks, world)))
            # (call, calls per timing); on CPU p2p is the transfer step timed above
            ops = {} if link is not None else {"p2p": (lambda xs=xs: ping(xs[0]), 1)}
            ops |= {
                "all_reduce": (lambda xs=xs: _bucketed(xs[0], dist.all_reduce, True, True), 1),
                "broadcast": (lambda xs=xs: _bucketed(xs[0], lambda f: dist.broadcast(f, 0), False, True), 1),
                "reduce": (lambda xs=xs: _bucketed(xs[0], lambda f: dist.reduce(f, 0), True, False), 1),
                "ps": (lambda xs=xs: _bucketed(xs[0], lambda f: (dist.reduce(f, 0), dist.broadcast(f, 0)), True, True),
                       1),
                "all_gather": (lambda xs=xs, gs=gathered: [dist.all_gather(g, x) for g, x in zip(gs, xs)], BURST),
            }
            for name, (fn, calls) in ops.items():
                total = warmup + repeats_for(size, repeats)
                marks = torch.zeros(total, 2, dtype=torch.float64)  # [call, (arrival, completion)] s
                for i in range(total):
                    dist.barrier()
                    if busy_s > 0:
                        _busy(busy_s, a, b)
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    marks[i] = torch.tensor([t0, time.perf_counter()], dtype=torch.float64)
                t = _rendezvous_mean(marks[warmup:], world) / calls
                results[name].append((size, t / 2 if name == "p2p" else t))
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def profile_comm(device_type: str, *, backend: str = "gloo", sizes=DEFAULT_SIZES, repeats: int = DEFAULT_REPEATS,
                 warmup: int = 2, world: int = 2, threads: int = 1, busy_s: float | None = None) -> CommProfile:
    """Measure and fit the communication costs of ``world`` local processes.

    ``busy_s``: seconds every rank computes (matmuls) right before each timed call, as an executor
    rank finishes a stage right before a transfer or its syncs (default :data:`CPU_BUSY_S` on
    CPU, 0 with NCCL, whose copy engines do not share the compute)."""
    if busy_s is None:
        busy_s = 0.0 if backend == "nccl" else CPU_BUSY_S
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        store = loopback_store()  # held open until every worker has joined and left
        with loopback_env():
            mp.spawn(_worker, args=(world, store.port, backend, list(sizes), repeats, warmup, out, threads, busy_s),
                     nprocs=world, join=True)
        del store
        samples = {k: [tuple(s) for s in v] for k, v in json.loads(Path(out).read_text()).items()}
    fits = {op: fit_latency_bandwidth([s for s, _ in pts], [t for _, t in pts]) for op, pts in samples.items()}
    meta = {"repeats": repeats, "warmup": warmup, "threads_per_process": threads, "statistic": "mean", "busy_s": busy_s,
            "date": time.strftime("%Y-%m-%d")}
    return CommProfile(device_type, backend, world, fits, samples, meta)
