"""Measure point-to-point and collective costs on the local process group and fit them.

Two local processes (``torch.multiprocessing.spawn``) join a ``torch.distributed`` group over TCP
on 127.0.0.1 (gloo; NCCL when ``backend="nccl"`` and GPUs are present) and time, for every
message size: a ping-pong (point-to-point time = round trip / 2), ``all_reduce``, ``broadcast``,
``reduce`` and ``all_gather``. Each measurement is the *mean* over ``repeats`` after ``warmup``
calls, each started after a barrier and, on CPU, :data:`CPU_BUSY_S` of compute on every rank (as
an executor rank hands over from a stage to a transfer or its syncs); rank 0 reports. The mean, not the median: gloo's latency on
a small VM has a heavy tail (on the 2-core development VM a 8.5 KiB send took 0.12 ms at the
median and 3-3.8 ms at the 90th percentile, 50 timed calls each), and an iteration pays the tail
of each of its tens of transfers, so the expected time of a sum of transfers is the sum of the
means (a simulated vit plan with 21 transfers per iteration priced them at 0.17-0.2 ms each
while the executor's transfer steps took 0.15-5.6 ms, waits for the peer included). A collective is timed as the executor issues it:
``all_reduce``, ``reduce`` and ``broadcast`` one call after a barrier (a CPU rank's gradient syncs
are coalesced into one bucket per replica set, docs/DESIGN.md), waited for by polling on CPU
(:func:`tag.cost.host.poll_wait`, as the executor's CPU ranks wait), ``all_gather`` (SFB factors,
gathered one after the other) as a burst of :data:`BURST` calls on distinct buffers back to back,
per call (on the 2-core development VM seven back-to-back 512 KiB gloo all-reduces took 2.2-2.5
ms each, one after a barrier 0.9-1.3 ms). ``time = alpha + bytes / beta`` is then fitted per operation
(:func:`tag.cost.comm.fit_latency_bandwidth`). CPU ranks run as the executor's do: pinned to a
core each, gloo's event threads reniced (:func:`tag.cost.host.pin_cores`, :func:`renice_threads`).

The ping's receive is posted when the call starts, unlike the executor's, which are posted a step
ahead on a process group per direction. A ping done that way (session 9) fitted 45 us +
5.45 GB/s, and the six zoo models' executions costed with it were under-predicted on every
transfer-heavy plan (median errors 8-28%, Spearman 0.60-0.93); costed with this ping (370 us +
4.22 GB/s), 3-30% and 0.73-0.98 (evaluation/results/validate-zoo-local-cpu2/README.md): an
executor transfer costs more than a clean message (packing, assembling, the event thread
reading the data only once the rank waits), and this ping's latency stands in for that.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

from .comm import COMM_OPS, CommProfile, fit_latency_bandwidth
from .host import pin_cores, poll_wait, renice_threads

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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _busy(seconds: float, a, b) -> None:
    """Compute (matmuls) for ``seconds``: the state a rank is in when a stage hands over to comm."""
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        a @ b


def _worker(rank: int, world: int, port: int, backend: str, sizes: list[int], repeats: int, warmup: int,
            out: str, threads: int, busy_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    pinned = None
    if backend != "nccl":  # as an executor's CPU ranks run (tag.executor.worker)
        pinned = pin_cores(rank, world, threads)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if pinned:
        renice_threads()

    wait = poll_wait if device.type == "cpu" else (lambda work: work.wait())  # as the executor waits

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
    try:
        for size in sizes:
            xs = [torch.ones(size // 4, device=device) for _ in range(BURST)]
            gathered = [[torch.empty_like(x) for _ in range(world)] for x in xs]
            ops = {  # (call, calls per timing)
                "p2p": (lambda xs=xs: ping(xs[0]), 1),
                "all_reduce": (lambda xs=xs: wait(dist.all_reduce(xs[0], async_op=True)), 1),
                "broadcast": (lambda xs=xs: wait(dist.broadcast(xs[0], 0, async_op=True)), 1),
                "reduce": (lambda xs=xs: wait(dist.reduce(xs[0], 0, async_op=True)), 1),
                "all_gather": (lambda xs=xs, gs=gathered: [dist.all_gather(g, x) for g, x in zip(gs, xs)], BURST),
            }
            for name, (fn, calls) in ops.items():
                ts = []
                for i in range(warmup + repeats_for(size, repeats)):
                    dist.barrier()
                    if busy_s > 0:
                        _busy(busy_s, a, b)
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    if i >= warmup:
                        ts.append((time.perf_counter() - t0) / calls)
                t = statistics.fmean(ts)
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
        port = _free_port()
        mp.spawn(_worker, args=(world, port, backend, list(sizes), repeats, warmup, out, threads, busy_s), nprocs=world,
                 join=True)
        samples = {k: [tuple(s) for s in v] for k, v in json.loads(Path(out).read_text()).items()}
    fits = {op: fit_latency_bandwidth([s for s, _ in pts], [t for _, t in pts]) for op, pts in samples.items()}
    meta = {"repeats": repeats, "warmup": warmup, "threads_per_process": threads, "statistic": "mean", "busy_s": busy_s,
            "date": time.strftime("%Y-%m-%d")}
    return CommProfile(device_type, backend, world, fits, samples, meta)
