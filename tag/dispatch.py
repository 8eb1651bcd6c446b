"""Independent work items (pairs to label, tuning trials, benchmark cells) over worker processes:
this machine's process pool (the default) or a Ray cluster (``pip install tag-planner[ray]``).

A job is ``fn(context, item)`` for every item, where ``context = setup(shared)`` is built once per
worker process: ``shared`` (the network, the captured graphs, the topologies) is pickled once per
worker of the local pool (the pool's initializer), and on Ray put into the object store once
(``ray.put``) with every task carrying only its ``ObjectRef``; a Ray worker fetches it at its
first task of the job and keeps the context for the job's later tasks. Results come back to the
caller, which writes them where the single-machine run does, so the files of a run are the same
whichever backend ran it and a run interrupted under one resumes under the other.

A task whose worker dies (killed, out of memory, its machine lost) is run again by Ray up to
``max_retries`` times; an exception the task raises is not retried (the items are deterministic:
it would raise again) and is reported as the item's error. The local pool reports a dead worker
as the error of every item it had not finished (the caller's next run does them).

Progress (items done / running / failed and the ETA) goes to a tqdm bar on the terminal and, as
records, to the caller's log.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .errors import TagError

LOCAL_RAY = "local"
"""``Backend.ray`` value that starts a Ray cluster on this machine (``tag ... --ray`` without an address)."""
MAX_RETRIES = 3
"""Times Ray runs a task again after its worker died (Ray's ``max_retries``)."""
LOG_EVERY_S = 10.0
"""Seconds between progress records sent to the log (the last one is always sent)."""


class DispatchError(TagError):
    """A backend cannot be used: Ray not installed, or its cluster not reachable."""


@dataclass(frozen=True)
class Backend:
    """Where the items run."""

    workers: int = 1
    """Processes of the local pool (1: in this process, one item after the other)."""
    ray: str | None = None
    """None: the local pool; :data:`LOCAL_RAY`: a Ray cluster started on this machine; else the
    address of a running cluster (``auto``, ``HOST:6379`` or ``ray://HOST:10001``). On Ray every
    CPU of the cluster runs one item at a time (``workers`` is not used)."""

    def __post_init__(self):
        if self.workers < 1:
            raise DispatchError(f"workers: expected >= 1 processes, got {self.workers}")
        if self.ray is not None and not self.ray.strip():
            raise DispatchError("--ray: expected a cluster address (auto, HOST:PORT, ray://HOST:PORT) or none")

    def connect(self) -> None:
        """Connect to the Ray cluster now (a one-line :class:`DispatchError` before any work if it
        cannot be reached); nothing for the local pool."""
        if self.ray is not None:
            ray_connect(self.ray)

    def describe(self) -> str:
        if self.ray is None:
            return f"local pool of {self.workers} process{'es' if self.workers > 1 else ''}"
        return "Ray cluster on this machine" if self.ray == LOCAL_RAY else f"Ray cluster at {self.ray}"


@dataclass
class Outcome:
    """One item's end: its result, or the one-line error that ended it (``result`` None)."""

    item: Any
    result: Any = None
    error: str | None = None


def run_tasks(fn: Callable[[Any, Any], Any], items: Iterable, *, setup: Callable[[Any], Any], shared: Any,
              backend: Backend, desc: str, progress: bool = True, log: Callable[[dict], None] | None = None,
              done_before: int = 0, total: int | None = None, max_retries: int = MAX_RETRIES) -> Iterator[Outcome]:
    """``fn(setup(shared), item)`` for every item on ``backend``, yielded as each finishes (in no
    set order). ``fn`` and ``setup`` are module-level functions (pickled by name);
    ``done_before``/``total``: items finished by earlier runs and the job's whole size, for the
    progress shown."""
    items = list(items)
    bar = Progress(desc, total if total is not None else done_before + len(items), done_before, progress, log)
    try:
        if not items:
            return
        if backend.ray is not None:
            outcomes = _ray_run(fn, items, setup, shared, backend.ray, bar, max_retries)
        elif backend.workers == 1 or len(items) == 1:
            outcomes = _inline_run(fn, items, setup, shared, bar)
        else:
            outcomes = _pool_run(fn, items, setup, shared, min(backend.workers, len(items)), bar)
        for out in outcomes:
            bar.finished(out.error is not None)
            yield out
    finally:
        bar.close()


class Progress:
    """Items done / running / failed, the ETA: a tqdm bar and records for a log."""

    def __init__(self, desc: str, total: int, done_before: int, show: bool, log):
        self.desc, self.total, self.log = desc, total, log
        self.before, self.done, self.failed, self.running = done_before, 0, 0, 0
        self.t0 = self.last_log = time.perf_counter()
        self.bar = None
        if show:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=done_before, desc=desc, unit="item", dynamic_ncols=True)

    def set_running(self, n: int) -> None:
        if n != self.running:
            self.running = n
            self._show()

    def finished(self, failed: bool) -> None:
        self.done += 1
        self.failed += failed
        if self.bar is not None:
            self.bar.update(1)
        self._show()
        now = time.perf_counter()
        if now - self.last_log >= LOG_EVERY_S:
            self._log()

    def record(self) -> dict:
        elapsed = time.perf_counter() - self.t0
        left = self.total - self.before - self.done
        eta = elapsed / self.done * left if self.done else None
        return {"stage": self.desc, "done": self.before + self.done - self.failed, "failed": self.failed,
                "running": self.running, "total": self.total, "elapsed_s": round(elapsed, 1),
                "eta_s": None if eta is None else round(eta, 1)}

    @staticmethod
    def line(rec: dict) -> str:
        """A progress record as one line of text."""
        p = rec["progress"]
        eta = "?" if p["eta_s"] is None else f"{p['eta_s']:.0f} s"
        return (f"{p['stage']}: {p['done']}/{p['total']} done, {p['running']} running, {p['failed']} failed, "
                f"{p['elapsed_s']:.0f} s elapsed, ETA {eta}")

    def _show(self) -> None:
        if self.bar is not None:
            self.bar.set_postfix(running=self.running, failed=self.failed, refresh=False)

    def _log(self) -> None:
        self.last_log = time.perf_counter()
        if self.log is not None:
            self.log({"progress": self.record()})

    def close(self) -> None:
        self.running = 0
        if self.done:
            self._log()
        if self.bar is not None:
            self.bar.set_postfix(running=0, failed=self.failed)  # the bar's last line: nothing left running
            self.bar.close()


def progress_log(path) -> Callable[[dict], None]:
    """A log for :func:`run_tasks`: each progress record as one line on stderr and appended to the
    JSON-lines file ``path``."""
    import json
    import sys

    def log(rec: dict) -> None:
        print(Progress.line(rec), file=sys.stderr, flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return log


# ------------------------------------------------------------------------------------ local
def _build(setup, shared):
    global CONTEXTS_BUILT
    CONTEXTS_BUILT += 1
    return setup(shared)


def _inline_run(fn, items, setup, shared, bar: Progress) -> Iterator[Outcome]:
    ctx = _build(setup, shared)
    bar.set_running(1)
    for item in items:
        yield _call(fn, ctx, item)


def _call(fn, ctx, item) -> Outcome:
    try:
        return Outcome(item, fn(ctx, item))
    except Exception as e:  # noqa: BLE001 - one item's failure is its result, as on Ray
        return Outcome(item, error=_one_line(e))


_LOCAL: dict = {}
CONTEXTS_BUILT = 0
"""Contexts this process has built (:func:`probe` reports it: one per worker and job)."""


def _pool_init(setup, shared) -> None:
    _LOCAL["ppid"] = os.getppid()
    _LOCAL["ctx"] = _build(setup, shared)


def _pool_call(fn, item) -> Outcome:
    if _LOCAL["ppid"] != os.getppid():  # the parent was killed: do not linger
        os._exit(0)
    return _call(fn, _LOCAL["ctx"], item)


def _pool_run(fn, items, setup, shared, workers: int, bar: Progress) -> Iterator[Outcome]:
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    # spawn: the parent holds torch's threads; a dead worker breaks the pool and ends every
    # unfinished item with an error (multiprocessing.Pool waited for it forever)
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_pool_init,
                             initargs=(setup, shared)) as pool:
        futures = {pool.submit(_pool_call, fn, item): item for item in items}
        left = set(futures)
        while left:
            bar.set_running(min(workers, len(left)))
            done, left = wait(left, return_when=FIRST_COMPLETED)
            for f in done:
                try:
                    yield f.result()
                except Exception as e:  # noqa: BLE001 - a worker died (BrokenProcessPool)
                    yield Outcome(futures[f], error=_one_line(e))


# -------------------------------------------------------------------------------------- Ray
def ray_module():
    """The ``ray`` module, or a one-line :class:`DispatchError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise DispatchError("--ray: the ray package is not installed; expected `pip install 'tag-planner[ray]'` "
                            "(or run without --ray on this machine's process pool)") from None
    return ray


def ray_connect(address: str):
    """Connect to the Ray cluster at ``address`` (:data:`LOCAL_RAY`: start one on this machine,
    bound to 127.0.0.1, no dashboard) unless this process is connected already; the ``ray`` module."""
    if address == LOCAL_RAY:  # read when ray is imported: a node of 127.0.0.1 (Ray made it this host's address)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = ray_module()
    if ray.is_initialized():
        return ray
    check_reachable(address)
    try:
        if address == LOCAL_RAY:
            ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
                     log_to_driver=False, configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise DispatchError(f"--ray {address}: cannot connect to the cluster: {_one_line(e)}; expected the "
                            "address `ray start --head` printed (HOST:6379, or ray://HOST:10001)") from None
    return ray


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ``HOST:PORT`` address that takes no TCP connection within ``timeout_s`` seconds: a one-line
    :class:`DispatchError` now (``ray.init`` retries such an address for minutes)."""
    import socket
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local": Ray finds the cluster itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError, OverflowError) as e:
        raise DispatchError(f"--ray {address}: no Ray cluster answers there ({_one_line(e)}); expected the "
                            "address `ray start --head` printed (HOST:6379, or ray://HOST:10001)") from None


def ray_slots(ray) -> int:
    """Items run at once on the cluster: its CPUs (every task asks for one)."""
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


_RAY_CTX: dict = {}
"""In a Ray worker: the context of the job it last ran, keyed by (shared's ObjectRef, setup)."""


def _context(setup, box: list):
    """The context of ``box[0]`` (an ObjectRef, boxed so that Ray hands the task the reference,
    not the value), built at this worker's first task of the job."""
    key = (box[0].hex(), setup)
    if key not in _RAY_CTX:
        import ray
        _RAY_CTX.clear()  # one job's context at a time: a long-lived worker does not hoard them
        _RAY_CTX[key] = _build(setup, ray.get(box[0]))
    return _RAY_CTX[key]


def _ray_task(fn, setup, box: list, item):
    return fn(_context(setup, box), item)


def _ray_run(fn, items, setup, shared, address: str, bar: Progress, max_retries: int) -> Iterator[Outcome]:
    ray = ray_connect(address)
    task = ray.remote(_ray_task).options(num_cpus=1, max_retries=max_retries, retry_exceptions=False)
    box = [ray.put(shared)]  # once: every task carries the reference
    slots = ray_slots(ray)
    queue = list(reversed(items))
    running: dict = {}
    try:
        while queue or running:
            while queue and len(running) < slots:  # no more in flight than CPUs: in flight = running
                item = queue.pop()
                running[task.remote(fn, setup, box, item)] = item
            bar.set_running(len(running))
            ready, _ = ray.wait(list(running), num_returns=1)
            for ref in ready:
                item = running.pop(ref)
                try:
                    yield Outcome(item, ray.get(ref))
                except ray.exceptions.RayError as e:  # raised by fn, or the worker lost max_retries + 1 times
                    yield Outcome(item, error=_one_line(getattr(e, "cause", None) or e))
    finally:
        for ref in running:  # interrupted: the cluster stops the items nobody waits for
            ray.cancel(ref, force=True)


# ------------------------------------------------------------------------------------ probes
def probe_setup(shared):
    return shared


def probe(ctx, item) -> dict:
    """A task doing nothing: which process ran ``item`` and how many contexts it built (the
    per-task overhead of a backend; shared data reaching each worker once)."""
    return {"item": item, "pid": os.getpid(), "contexts": CONTEXTS_BUILT}


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return (text.splitlines() or [type(e).__name__])[0][:300]
