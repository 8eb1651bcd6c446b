"""Host settings shared by every process that times or runs CPU work: the memory allocator, the
cores a rank runs on and the scheduling of gloo's event threads (:func:`pin_cores`,
:func:`demote_threads`).

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
    """False where ``TAG_PIN_CORES=0`` turns :func:`pin_cores` and :func:`demote_threads` off."""
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
    ``--numa-binding``, Intel's launcher); with gloo it goes with :func:`demote_threads`.
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
FALLBACK_NICE = 19
"""Nice value :func:`demote_threads` gives where the ``SCHED_IDLE`` policy is refused."""


def demote_threads(name: str = GLOO_EVENT_THREAD) -> int:
    """Run this process's threads called ``name`` (Linux, ``/proc/self/task/*/comm``; never the
    calling thread) under the ``SCHED_IDLE`` policy (nice :data:`FALLBACK_NICE` where that is
    refused); returns how many were changed (0 where unsupported or ``TAG_PIN_CORES=0``).

    For a CPU rank pinned to its own core (call it only where :func:`pin_cores` pinned). gloo's
    event thread skips a connection whose lock another thread holds, and level-triggered epoll
    hands it the same event again at once: given the core while the rank's main thread is
    inside a gloo call on that connection, it spins on the lock. At the main thread's priority it
    took the core at once (strace on the development VM: 2-4 ms for the main thread's write of a
    48-byte notification). At nice 19 (f2f4fbb) the scheduler still handed it the core at a tick
    once the main thread had used its slice, and it then spun until its own slice ended: two
    ranks exchanging activations right after both computed stalled together for 2-5 ms (``perf
    sched``: both ranks' event threads of one transfer group running 5 ms straight while both main
    threads slept), in a third to half of vit's and vgg's ``mixed`` iterations. Under
    ``SCHED_IDLE`` it runs only when the main thread waits: ``tag execute`` of vit ``mixed`` took
    8.4 ms at the median instead of 11.6-13.4, vgg ``mixed`` 7.8-8.0 instead of 10.2-11.5, the
    plans without those stalls the same (docs/executor.md). gloo's collective worker threads
    keep their priority (demoted too, at nice 19 in f2f4fbb, they starved behind a rank polling
    for its all-reduce: a 4 KiB all-reduce profiled at 1.1 ms instead of 0.15).
    """
    if not _pinning_on() or not os.path.isdir("/proc/self/task"):
        return 0
    idle, n = getattr(os, "SCHED_IDLE", None), 0
    for tid in _threads_named(name):
        try:
            try:
                if idle is None:
                    raise PermissionError("no SCHED_IDLE")
                os.sched_setscheduler(tid, idle, os.sched_param(0))
            except PermissionError:
                os.setpriority(os.PRIO_PROCESS, tid, FALLBACK_NICE)
            n += 1
        except OSError:  # the thread ended meanwhile
            pass
    return n


def _threads_named(name: str):
    """Native ids of this process's threads called ``name`` (``/proc/self/task/*/comm``), never
    the calling thread's."""
    me = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                found = int(tid) != me and f.read().strip() == name
        except OSError:  # the thread ended meanwhile
            continue
        if found:
            yield int(tid)


def restore_threads(name: str = GLOO_EVENT_THREAD) -> int:
    """Undo :func:`demote_threads` (back to ``SCHED_OTHER`` at nice 0, where permitted); returns how
    many threads were changed. For a rank about to exit on a failure: a process ends only once
    every one of its threads has run its exit, and a ``SCHED_IDLE`` thread waits for an idle core.
    On the 2-core development VM under load 11, a rank whose gloo event thread was demoted took
    1.5 s to die after the agent's SIGTERM, 0.15-0.2 s with it at normal priority, and once 28 s
    to exit after raising (its peer waited in an all-reduce meanwhile, near its 30 s timeout)."""
    if not os.path.isdir("/proc/self/task") or not hasattr(os, "sched_getscheduler"):
        return 0
    idle, n = getattr(os, "SCHED_IDLE", None), 0
    for tid in _threads_named(name):
        try:
            if idle is not None and os.sched_getscheduler(tid) == idle:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                n += 1
            elif os.getpriority(os.PRIO_PROCESS, tid) == FALLBACK_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, 0)  # lowering nice may need CAP_SYS_NICE
                n += 1
        except OSError:  # the thread ended meanwhile, or the change was refused
            pass
    return n
