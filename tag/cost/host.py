"""Host settings shared by every process that times or runs CPU work: the memory allocator, the
cores a rank runs on and the priority of gloo's event threads (:func:`pin_cores`,
:func:`renice_threads`), and how a CPU rank waits for a collective (:func:`poll_wait`).

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
import threading

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


def _pinning_on() -> bool:
    """False where ``TAG_PIN_CORES=0`` turns :func:`pin_cores` and :func:`renice_threads` off."""
    return os.environ.get("TAG_PIN_CORES", "1") != "0"


def pin_cores(slot: int, slots: int, threads: int) -> set[int] | None:
    """Bind this process (and the threads it starts later, gloo's included) to cores
    ``[slot * threads, (slot + 1) * threads)`` of the ones it may use; returns them, or None
    (nothing changed) where the slots do not fit the cores, affinity is unsupported, or
    ``TAG_PIN_CORES=0``.

    Ranks sharing a host otherwise have their communication threads woken on whichever core
    woke them, often one another rank is computing on: on this project's 2-core VM a 16 KiB gloo
    message to a rank that had posted its receive, from a rank that went on computing, took
    0.21-0.44 ms on average (90th percentile 2.1 ms), 0.005-0.05 ms with each rank on its own
    core. Pinning ranks to cores is the usual practice for CPU training (torchrun's
    ``--numa-binding``, Intel's launcher); with gloo it goes with :func:`renice_threads`.
    """
    if not _pinning_on() or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if slots * threads > len(cores) or not 0 <= slot < slots:
        return None
    mine = set(cores[slot * threads:(slot + 1) * threads])
    os.sched_setaffinity(0, mine)
    return mine


GLOO_EVENT_THREAD = "gloo_tcp_loop"
"""Name of gloo's TCP event thread (one per process group)."""
HELPER_NICE = 19
"""Nice value :func:`renice_threads` gives a pinned CPU rank's gloo event threads."""


def renice_threads(name: str = GLOO_EVENT_THREAD, nice: int = HELPER_NICE) -> int:
    """Give this process's threads called ``name`` (Linux, ``/proc/self/task/*/comm``; never the
    calling thread) the nice value ``nice``; returns how many were changed (0 where unsupported
    or ``TAG_PIN_CORES=0``).

    For a CPU rank pinned to its own core (call it only where :func:`pin_cores` pinned). gloo's event thread skips a
    connection whose lock another thread holds, and epoll hands it the same event again at once:
    woken by a peer's message while the rank's main thread is inside a gloo call on that
    connection, it took the core and spun until its time slice ended (strace on the development
    VM: 2-4 ms for the main thread's write of a 48-byte notification). At nice 19 it runs when the
    main thread waits. gloo's collective worker threads keep their priority: niced too, they
    starved behind a rank polling for its all-reduce (:func:`poll_wait`; a 4 KiB all-reduce
    profiled at 1.1 ms instead of 0.15). ``tag execute`` of mlp, vit, vgg and resnet plans with
    pinned ranks, reniced event threads and one process group per transfer direction
    (:class:`tag.executor.comm.DistComm`) ran 8-65% faster than before (tag/executor/README.md).
    """
    if not _pinning_on() or not os.path.isdir("/proc/self/task"):
        return 0
    me, n = threading.get_native_id(), 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if int(tid) == me or f.read().strip() != name:
                    continue
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            n += 1
        except OSError:  # the thread ended meanwhile
            pass
    return n


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
