"""Host settings shared by every process that times or runs CPU work: the memory allocator, and
how a CPU rank waits for a collective (:func:`poll_wait`).

glibc's malloc serves large blocks with ``mmap`` and gives freed heap tops back to the kernel
(``trim``), with a threshold it moves as blocks come and go. A training iteration allocates and
frees the same large activations every step, so depending on the order of sizes (one batch size
after another, two ranks' stages interleaved) fresh pages keep being faulted in and zeroed: on
this project's 2-core VM a gpt2 iteration at batch 16 took 107 ms instead of 80 ms when batch
sizes alternated, while batch 8 did not change. That made profiles and executions disagree for
reasons no cost model should carry. :func:`tune_malloc` pins the thresholds (the usual advice for
PyTorch on CPU, short of preloading jemalloc or tcmalloc) so that freed memory is reused: the
profiler, its background load and every executor rank call it first. ``TAG_MALLOC_TUNE=0`` turns
it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 30
"""Blocks below 1 GiB come from the heap (reused), not from fresh ``mmap`` pages."""
TRIM_THRESHOLD_BYTES = (1 << 31) - 1
"""Freed heap tops are kept (the process holds its peak, as a training process does anyway)."""


def tune_malloc() -> bool:
    """Fix glibc malloc's mmap and trim thresholds for this process; False where not applicable
    (another C library, or ``TAG_MALLOC_TUNE=0``)."""
    if os.environ.get("TAG_MALLOC_TUNE", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        return libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    except (OSError, AttributeError):
        return False


def poll_wait(work) -> None:
    """Wait for a ``torch.distributed`` collective by polling it, yielding the core between polls,
    instead of sleeping in ``wait()``: a sleeping CPU rank's idle vCPU can take milliseconds to be
    woken when the data arrives. On this project's 2-core VM (a microVM whose idle vCPUs halt at
    once) a gloo all-reduce of 200 KB after 3 ms of compute on the peer took 1.77 ms on average
    blocking, 0.89 ms polling; executions of vit and gpt2 plans ran 7-13% faster (data-parallel,
    PS, mixed; two A/B pairs each). The executor's CPU ranks and the communication profiler both
    wait this way. gloo's point-to-point works never report completion before ``wait()``, so
    transfers still block. ``wait()`` then raises what the collective raised (a peer's failure or
    the timeout)."""
    while not work.is_completed():
        os.sched_yield()
    work.wait()
