"""Measure point-to-point and collective costs on the local process group and fit them.

Two local processes (``torch.multiprocessing.spawn``) join a ``torch.distributed`` group over TCP
on 127.0.0.1 (gloo; NCCL when ``backend="nccl"`` and GPUs are present) and time, for every
message size: a ping-pong (point-to-point time = round trip / 2), ``all_reduce``, ``broadcast``,
``reduce`` and ``all_gather``. Each measurement is the median over ``repeats`` after ``warmup``
calls, started after a barrier; rank 0 reports. ``time = alpha + bytes / beta`` is then fitted
per operation (:func:`tag.cost.comm.fit_latency_bandwidth`).
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

DEFAULT_SIZES = tuple(4096 * 4**k for k in range(7))  # 4 KiB .. 16 MiB


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, sizes: list[int], repeats: int, warmup: int,
            out: str, threads: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

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

    results: dict[str, list[tuple[int, float]]] = {op: [] for op in COMM_OPS}
    try:
        for size in sizes:
            x = torch.ones(size // 4, device=device)
            gathered = [torch.empty_like(x) for _ in range(world)]
            ops = {
                "p2p": lambda x=x: ping(x),
                "all_reduce": lambda x=x: dist.all_reduce(x),
                "broadcast": lambda x=x: dist.broadcast(x, 0),
                "reduce": lambda x=x: dist.reduce(x, 0),
                "all_gather": lambda x=x, g=gathered: dist.all_gather(g, x),
            }
            for name, fn in ops.items():
                ts = []
                for i in range(warmup + repeats):
                    dist.barrier()
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    if i >= warmup:
                        ts.append(time.perf_counter() - t0)
                t = statistics.median(ts)
                results[name].append((size, t / 2 if name == "p2p" else t))
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def profile_comm(device_type: str, *, backend: str = "gloo", sizes=DEFAULT_SIZES, repeats: int = 5,
                 warmup: int = 2, world: int = 2, threads: int = 1) -> CommProfile:
    """Measure and fit the communication costs of ``world`` local processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "comm.json")
        port = _free_port()
        mp.spawn(_worker, args=(world, port, backend, list(sizes), repeats, warmup, out, threads), nprocs=world,
                 join=True)
        samples = {k: [tuple(s) for s in v] for k, v in json.loads(Path(out).read_text()).items()}
    fits = {op: fit_latency_bandwidth([s for s, _ in pts], [t for _, t in pts]) for op, pts in samples.items()}
    meta = {"repeats": repeats, "warmup": warmup, "threads_per_process": threads,
            "date": time.strftime("%Y-%m-%d")}
    return CommProfile(device_type, backend, world, fits, samples, meta)
