"""Measure op-group times on the local device: the runnable stages the executor runs.

For each profiled per-replica batch ``b`` the model is exported at ``b`` (one joint graph), cut
into one stage per (op-group, phase) with the reference graph's grouping
(:func:`stage_assignment`), and the whole iteration is run stage by stage ``warmup + repeats``
times (each followed by an untimed optimizer step, :class:`OptimizerStep`, so the first stages
find the caches a real iteration leaves): forward stages in group order, backward stages in
reverse order, each stage timed on its own (:func:`timing_clock`: thread CPU time for a single-threaded CPU, else wall clock; CUDA
synchronised). A CPU device type ``cpu-<t>t`` means the executor runs ``n = cores // t`` ranks on
the host at once, all computing: their cores share caches and memory bandwidth, so each stage
takes longer than on an idle host (measured +10-20% for 2 ranks on this project's 2-core machine).
The profiler therefore times a CPU type under that load: ``n - 1`` background processes run the
same model's forward + backward (at the middle profiled batch) while the stages are timed
(:class:`CoRunners`; ``corun=0`` measures an idle host instead). The repeats go round-robin over
the profiled batch sizes: a virtual machine's speed swings by 20-30% within seconds, and timing
the batches one after the other would bend the batch curve with it. Per-stage medians over the
repeats are stored, rescaled so that they sum to the median time of the whole iteration (stalls
land in random stages, so the per-stage medians alone under-count a real iteration). The optimizer is
timed as an executor rank runs it (:mod:`tag.cost.optim`: one multi-tensor ``torch.optim`` step over
the rank's parameters, foreach on a CPU, fused on CUDA), fed the gradients a real backward just
produced, over nested subsets of the parameters (all, about half and a quarter of the bytes): a
least-squares line gives a fixed cost per step plus seconds per parameter byte
(:func:`time_optimizer`; :class:`tag.cost.profile.Profile` stores the fixed part as
``opt_step_overhead_s`` and each group's bytes times the slope as its ``opt``).

**Wake penalty (CPU).** A stage that starts right after its rank idled (blocked on a peer's
transfer) runs slower than back to back: measured on this project's 2-core VM, a 3-5 ms gpt2
stage takes +20-50% after 10-20 ms idle, growing with the gap as ``1 - exp(-gap / ~10 ms)``
(caches refilled, clocks back up). The profiler measures it per stage: every stage is also
timed after sleeping ``wake_gap_s`` (default 50 ms, near saturation) and the extra seconds over
back-to-back are stored (``fwd_wake``/``bwd_wake``); the time constant is fitted from a second
pass at ``wake_gap_s / 5`` (:func:`fit_wake_tau`). The simulator charges a stage
``wake * (1 - exp(-gap / tau)) / (1 - exp(-wake_gap_s / tau))`` for the idle ``gap`` before it.

**Host launch cost (CUDA).** A GPU profile also times the host's stream of tiny kernels
(:func:`time_launches`, the launch microbenchmark of ``evaluation/gpu_check.py``) and states the
machine's ``host_launch`` for a topology (:func:`host_launch_of`): the GPU rule's forward host
seconds per launch scaled by the measured launch over the rule's (``meta.launch_s``,
``meta.host_launch_s``), so a topology of this machine costs its host as measured
(:func:`tag.cost.gpu.on_host`).
"""

from __future__ import annotations

import contextlib
import math
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.export.graph_signature import InputKind

from ..graph.capture import export_joint
from ..graph.stages import Stage, build_stages, retarget_devices
from .host import tune_malloc
from .optim import make_optimizer
from .profile import COMPILED, Profile, cpu_device_type

Log = Callable[[str], None]


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_batches(batch: int) -> list[int]:
    """Per-replica batch sizes to profile: {1, B/4, B/2, B} (distinct, >= 1)."""
    return sorted({max(1, batch // 4), max(1, batch // 2), batch, 1})


def stage_assignment(graph) -> dict[str, tuple[int, str]]:
    """Joint-graph node name -> (group, phase) of every fwd/bwd op.

    A tuple projection (``getitem``) stays with the op producing its tuple, so tuples never cross
    stages (the executor's rule).
    """
    out: dict[str, tuple[int, str]] = {}
    by_index: dict[int, tuple[int, str]] = {}
    for i, op in enumerate(graph.ops):
        if op.phase == "opt":
            continue
        key = (op.group, op.phase)
        if op.target == "getitem" and op.inputs:
            p = graph.tensors[op.inputs[0]].producer
            if p in by_index:
                key = by_index[p]
        by_index[i] = key
        out[op.name] = key
    return out


class StructureMismatch(Exception):
    """The joint graph exported at another batch is not the reference graph with other shapes."""


def structure(gm: torch.fx.GraphModule) -> list[tuple[str, str, tuple[str, ...]]]:
    """(name, target, input names) of every live call_function node, in graph order."""
    return [(n.name, str(n.target), tuple(a.name for a in n.all_input_nodes))
            for n in gm.graph.nodes if n.op == "call_function" and n.users]


@dataclass
class RunnableIteration:
    """The joint graph at one batch, cut into (group, phase) stages, with its inputs."""

    batch: int
    stages: list[tuple[tuple[int, str], Stage]]
    """In execution order: forward stages by group, then backward stages in reverse."""
    env0: dict[str, torch.Tensor]
    """Placeholder name -> value (parameters, buffers, constants, user inputs)."""
    params: dict[str, torch.Tensor]
    """State-dict name -> parameter value."""

    def run(self, sync: Callable[[], None], times: dict | None = None,
            clock: Callable[[], float] = time.perf_counter, idle_s: float = 0.0) -> dict[str, torch.Tensor]:
        """One forward+backward; if ``times`` is given, appends each stage's seconds to it.
        ``idle_s``: sleep that long before each stage (untimed), as a rank waiting on a peer."""
        env = dict(self.env0)
        with torch.no_grad():
            for key, st in self.stages:
                if idle_s > 0:
                    time.sleep(idle_s)
                t0 = clock()
                outs = st.module(*[env[n] for n in st.inputs])
                sync()
                if times is not None:
                    times.setdefault(key, []).append(clock() - t0)
                env.update(zip(st.outputs, outs))
        return env


def build_iteration(graph, model, make_inputs, batch: int, device: torch.device,
                    reference: list | None = None, compiled: bool = False) -> RunnableIteration:
    """Export ``model`` at ``batch`` and cut it with ``graph``'s grouping; ``compiled``: each
    stage runs through ``torch.compile`` (Inductor, static shapes; compiled at its first run,
    in the warm-up), as ``tag execute --compile`` runs its segments.

    Raises :class:`StructureMismatch` when ``reference`` (a :func:`structure`) is given and the
    export differs from it (e.g. transformers at batch 1 drop a few copies, which renumbers the
    nodes: names would then designate other ops).
    """
    with _quiet():
        ep = export_joint(model, make_inputs(batch), precision=getattr(graph, "precision", "fp32"))
    gm = ep.graph_module
    if reference is not None and structure(gm) != reference:
        raise StructureMismatch(f"the joint graph at batch {batch} differs from the captured one")
    assign = stage_assignment(graph)
    stages = build_stages(types.SimpleNamespace(joint=gm), assign)
    k = graph.num_groups
    order = [(g, "fwd") for g in range(k)] + [(g, "bwd") for g in reversed(range(k))]
    ordered = [(key, stages[key]) for key in order if key in stages]
    if device.type != "cpu":
        for _, st in ordered:
            retarget_devices(st.module, device)
    if compiled:
        for _, st in ordered:
            st.module = torch.compile(st.module, backend="inductor", dynamic=False)
    state = {**ep.state_dict, **ep.constants}
    inputs = [x for x in make_inputs(batch)]
    env0: dict[str, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    ui = 0
    for s in ep.graph_signature.input_specs:
        if s.kind == InputKind.USER_INPUT:
            env0[s.arg.name] = inputs[ui].to(device)
            ui += 1
        else:
            env0[s.arg.name] = state[s.target].detach().to(device)
            if s.kind == InputKind.PARAMETER:
                params[s.target] = env0[s.arg.name]
    return RunnableIteration(batch, ordered, env0, params)


def _quiet():
    from ..graph.capture import _quiet as q

    return q()


def optimizer_step(device: torch.device) -> str:
    """How the optimizer step was timed (``meta.optimizer_step``): ``foreach`` or ``fused``, the
    multi-tensor step the executor runs on ``device`` (profiles without it timed one
    single-tensor step per parameter, ``foreach=False``)."""
    from .optim import implementation

    return next(iter(implementation(device)))


def timing_clock(device: torch.device) -> Callable[[], float]:
    """The clock stage times are taken with: the thread's CPU time for a single-threaded CPU (what
    a dedicated core would take, immune to other jobs preempting this one on a shared machine),
    else the wall clock (``perf_counter``)."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


class OptimizerStep:
    """An untimed optimizer step after each profiled iteration, on copies of its parameters fed
    the gradients it produced: the next iteration's first stages then start with the caches an
    optimizer step leaves behind, as every executor iteration does."""

    def __init__(self, graph, it: RunnableIteration):
        self._grad = {p.name: graph.tensors[p.grad].name for p in graph.params}
        self.params = {n: torch.nn.Parameter(v.detach().clone()) for n, v in it.params.items() if n in self._grad}
        """State-dict name -> a copy of the parameter (the iteration's own values stay as they are)."""
        self._opt = make_optimizer(graph.optimizer, list(self.params.values())) if self.params else None

    def step(self, opt: torch.optim.Optimizer, names: list[str], env: dict[str, torch.Tensor]) -> None:
        """What an executor rank's update does (:meth:`tag.executor.runtime.RankRuntime.update`):
        give the parameter copies ``names`` the gradients the iteration ``env`` holds for them,
        ``opt.step()``, drop the gradients."""
        params = [self.params[n] for n in names]
        for n, p in zip(names, params):
            p.grad = env[self._grad[n]].detach().reshape(p.shape)
        opt.step()
        for p in params:
            p.grad = None

    def __call__(self, env: dict[str, torch.Tensor]) -> None:
        if self._opt is not None:
            self.step(self._opt, list(self.params), env)


OPT_FRACTIONS = (1.0, 0.5, 0.25)
"""Fractions of the parameter bytes the optimizer step is timed over (nested subsets)."""


def time_optimizer(graph, it: RunnableIteration, sync, clock, repeats: int,
                   warmup: int) -> tuple[list[float], float]:
    """(per-group seconds, fixed per-step seconds) of ``graph.optimizer``'s step, as fixed + per byte.

    The executor runs one multi-tensor step over all the parameters a rank holds
    (:func:`tag.cost.optim.make_optimizer`), whose time is a launch/dispatch cost plus a cost per
    byte of parameters (each byte is read and written with its gradient and state), not a cost per
    parameter. It is timed in context, right after a real forward+backward of ``it`` and on the
    gradients it produced, over nested subsets of the parameters holding about
    :data:`OPT_FRACTIONS` of their bytes (whole groups, in reverse group order as a rank's
    backward finishes them), repeats interleaved; ``t = fixed + per_byte * bytes`` is fitted to the
    per-subset medians. A group's cost is ``per_byte * (its parameter bytes)``. Each timing covers
    what an executor rank's update does (:meth:`OptimizerStep.step`): hand the gradients to the
    parameters, step, drop them.
    """
    copies = OptimizerStep(graph, it)
    params = copies.params
    groups = [[graph.params[p].name for p in grp.params if graph.params[p].name in params] for grp in graph.groups]
    nbytes = [sum(params[n].numel() * params[n].element_size() for n in ns) for ns in groups]
    total = sum(nbytes)
    if total == 0:
        return [0.0] * len(groups), 0.0
    subsets: list[list[str]] = []
    for frac in OPT_FRACTIONS:
        names, acc = [], 0
        for g in reversed(range(len(groups))):
            if acc >= frac * total and names:
                break
            names += groups[g]
            acc += nbytes[g]
        if not subsets or len(names) != len(subsets[-1]):
            subsets.append(names)
    opts = [make_optimizer(graph.optimizer, [params[n] for n in ns]) for ns in subsets]
    size = [sum(params[n].numel() * params[n].element_size() for n in ns) for ns in subsets]
    times: list[list[float]] = [[] for _ in subsets]
    for r in range(warmup + repeats):
        for k, (opt, names) in enumerate(zip(opts, subsets)):
            env = it.run(sync)
            t0 = clock()
            copies.step(opt, names, env)
            sync()
            if r >= warmup:
                times[k].append(clock() - t0)
    med = [statistics.median(ts) for ts in times]
    fixed, per_byte = fit_fixed_per_byte(size, med)
    return [per_byte * b for b in nbytes], fixed


def fit_fixed_per_byte(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares ``seconds = fixed + per_byte * sizes`` with both terms >= 0. Where noise makes
    the line fall with the bytes or cross below the origin (or there is one size), the line
    through the origin instead (all per byte: a step over more bytes never costs less)."""
    def origin() -> tuple[float, float]:
        sxx = sum(x * x for x in sizes)
        return 0.0, max(0.0, sum(x * y for x, y in zip(sizes, seconds)) / sxx) if sxx else 0.0

    if len(sizes) < 2 or max(sizes) == min(sizes):
        return origin()
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / sxx
    fixed = my - slope * mx
    if slope <= 0 or fixed < 0:
        return origin()
    return fixed, slope


def _corun_worker(spec: str, seed: int, threads: int, batch, stop, done, slot: int, parent: int) -> None:
    """Background load of :class:`CoRunners`: eager forward + backward of ``spec`` at the batch in
    the shared value ``batch`` (0: idle) until ``stop`` is set or the profiling process
    ``parent`` is gone (killed, it cannot set ``stop``: the load would spin on, an orphan);
    ``done[slot]`` is the batch of the last finished iteration."""
    import os

    from ..lifetime import die_with

    die_with(parent)  # at once on a kill -9 of the profiler (the loop below checks between iterations)
    torch.set_num_threads(threads)
    from ..workloads import load_workload

    tune_malloc()
    wl = load_workload(spec, seed=seed)
    inputs: dict[int, tuple] = {}
    while not stop.is_set() and os.getppid() == parent:
        b = batch.value
        if b <= 0:
            time.sleep(0.005)
            continue
        if b not in inputs:
            inputs[b] = wl.make_inputs(b)
        wl.model.zero_grad(set_to_none=True)
        wl.model(*inputs[b]).backward()
        done[slot] = b


class CoRunners:
    """``n`` background processes loading the host as the executor's other ranks would.

    Use as a context manager; :meth:`set_batch` switches the per-replica batch they run (0 pauses
    them). Each process runs ``threads`` intra-op threads.
    """

    def __init__(self, n: int, spec: str, seed: int, threads: int):
        import multiprocessing as mp
        import os

        ctx = mp.get_context("spawn")
        self._batch = ctx.Value("i", 0)
        self._done = ctx.Array("i", n)
        self._stop = ctx.Event()
        self._procs = [ctx.Process(target=_corun_worker, daemon=True,
                                   args=(spec, seed, threads, self._batch, self._stop, self._done, i, os.getpid()))
                       for i in range(n)]

    def set_batch(self, b: int, timeout_s: float = 300.0) -> None:
        """Switch to batch ``b`` and wait until every process finished an iteration at it (so
        timing starts under the load, not while the background is still starting)."""
        self._batch.value = int(b)
        if b <= 0:  # paused: nothing to wait for
            return
        end = time.monotonic() + timeout_s
        while any(x != b for x in self._done[:]):
            if not all(p.is_alive() for p in self._procs):
                raise RuntimeError("a background load process of the profiler died")
            if time.monotonic() > end:
                raise RuntimeError(f"background load processes did not reach batch {b} in {timeout_s:.0f} s")
            time.sleep(0.01)

    def __enter__(self) -> CoRunners:
        for p in self._procs:
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


def default_corun(device: torch.device) -> int:
    """Background processes for a CPU profile: the executor's other ranks on this host
    (``cores // threads - 1``); none for a GPU."""
    import os

    if device.type != "cpu":
        return 0
    return max(0, (os.cpu_count() or 1) // torch.get_num_threads() - 1)


def profile_model(spec: str, *, batch: int | None = None, device: str = "cpu", batches: list[int] | None = None,
                  repeats: int = 5, warmup: int = 2, optimizer: str = "adam", num_groups: int = 48,
                  seed: int = 0, threads: int | None = None, log: Log = stderr_log, captured=None,
                  corun: int | None = None, wake_gap_s: float | None = None, precision: str = "fp32",
                  compiled: bool = False) -> Profile:
    """Profile zoo model / factory ``spec`` on the local ``device`` (``cpu`` or ``cuda``).

    Args:
        batch: global batch the graph is captured at (default: the workload's).
        batches: per-replica batch sizes to time (default :func:`default_batches`).
        threads: intra-op threads for a CPU (default: torch's current setting).
        captured: an existing capture of the workload (skips capturing again).
        corun: background processes loading the host while timing (default
            :func:`default_corun`: the executor's other ranks of this device type; 0: idle host).
        wake_gap_s: idle seconds before each stage for the wake penalty (default
            :data:`WAKE_GAP_S` on a CPU, 0 = not measured; never on a GPU).
        precision: fp32, or bf16 / fp16 autocast (:mod:`tag.graph.precision`): the graph and
            every timed stage carry its casts; recorded in the graph signature and ``meta``.
        compiled: every stage through ``torch.compile`` (:func:`build_iteration`); the device
            type gets :data:`tag.cost.profile.COMPILED` appended.
    """
    from ..graph.capture import capture
    from ..workloads import load_workload

    if threads is not None:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    tune_malloc()  # as every executor rank does (tag.cost.host)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    wl = load_workload(spec, batch=batch, seed=seed)
    t0 = time.perf_counter()
    cap = captured if captured is not None else capture(wl, optimizer=optimizer, num_groups=num_groups,
                                                        precision=precision)
    graph = cap.graph
    log(f"profile {graph.model}: captured {len(graph.ops)} ops in {graph.num_groups} groups "
        f"({time.perf_counter() - t0:.1f} s)")
    bs = sorted(set(batches or default_batches(graph.batch_size)))
    scales: list[float] = []
    clock = timing_clock(dev)
    ref = structure(cap.joint)
    its: list[RunnableIteration] = []
    todo = list(bs)
    while todo:
        b = todo.pop(0)
        t0 = time.perf_counter()
        try:
            its.append(build_iteration(graph, wl.model, wl.make_inputs, b, dev, ref, compiled))  # graph.precision
            log(f"  batch {b}: exported in {time.perf_counter() - t0:.1f} s")
        except StructureMismatch:
            log(f"  batch {b}: the joint graph differs from the captured one (node renumbering); skipped")
            if b + 1 <= graph.batch_size and b + 1 not in bs:
                bs.append(b + 1)
                todo.insert(0, b + 1)
    its.sort(key=lambda it: it.batch)
    bs = [it.batch for it in its]
    k = graph.num_groups
    fwd = [[0.0] * len(bs) for _ in range(k)]
    bwd = [[0.0] * len(bs) for _ in range(k)]
    n_bg = default_corun(dev) if corun is None else corun
    if n_bg:
        log(f"  timing under load: {n_bg} background process(es) running the same model")
    gap = (WAKE_GAP_S if dev.type == "cpu" else 0.0) if wake_gap_s is None else float(wake_gap_s)
    wake: dict = {}
    with CoRunners(n_bg, spec, seed, torch.get_num_threads()) if n_bg else contextlib.nullcontext() as load:
        opt, overhead = _time_all(graph, its, bs, fwd, bwd, scales, sync, clock, repeats, warmup, load, log,
                                  gap, wake)
    log(f"  optimizer {graph.optimizer}: {sum(opt) * 1e3:.2f} ms + {overhead * 1e3:.3f} ms per step")
    host: dict = {}
    if dev.type == "cuda":
        dtype = cuda_device_type(dev)
        launch = time_launches(dev)
        host = {"launch_s": launch, "host_launch_s": host_launch_of(launch, dtype)[0]}
    else:
        dtype = cpu_device_type(torch.get_num_threads())
    dtype += COMPILED if compiled else ""
    meta = {**host, "compiled": compiled, "repeats": repeats, "warmup": warmup, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "num_groups_requested": num_groups,
            "stage_scale": scales, "corun": n_bg, "precision": graph.precision,
            "clock": "thread_time" if clock is time.thread_time else "perf_counter",
            "optimizer_step": optimizer_step(dev)}
    if wake:
        log(f"  wake penalty after {gap * 1e3:.0f} ms idle: +{wake['total'] * 1e3:.2f} ms per iteration at "
            f"batch {bs[-1]} if every stage started cold; time constant {wake['tau'] * 1e3:.1f} ms")
    return Profile(dtype, graph.model, graph.signature(), graph.batch_size, graph.optimizer, bs, fwd, bwd, opt,
                   overhead, meta, fwd_wake=wake.get("fwd", []), bwd_wake=wake.get("bwd", []),
                   wake_gap_s=gap if wake else 0.0, wake_tau_s=wake.get("tau", 0.0))


LAUNCH_KERNELS = 1000
"""Tiny kernels per timed stream of :func:`time_launches` (``evaluation/gpu_check.py``'s count)."""


def time_launches(dev: torch.device, kernels: int = LAUNCH_KERNELS, repeats: int = 5, warmup: int = 3) -> float:
    """Seconds per kernel of ``kernels`` tiny kernels issued back to back (an in-place add on a
    one-element tensor: no work, so the host's issue rate bounds the stream), the median of
    ``repeats`` timed streams, synchronised before and after each; the microbenchmark behind the
    GPU rule's ``launch_s`` (``gpu_calib/<type>.jsonl``, kind ``launch``: 9.05 us on the H200 host)."""
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    tiny = torch.zeros(1, device=dev)
    times = []
    for k in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(kernels):
            tiny.add_(1.0)
        sync()
        if k >= warmup:
            times.append((time.perf_counter() - t0) / kernels)
    return statistics.median(times)


def host_launch_of(launch_s: float, gpu: str) -> tuple[float, str]:
    """(``host_launch`` seconds, the topology line ``host_launch: "NN us"``) of a host whose tiny
    kernels launch in ``launch_s`` seconds each, for GPU type ``gpu`` (a catalog name; the
    reference type's rule otherwise): the rule's ``host_s`` times ``launch_s`` over the rule's
    ``launch_s`` (the ratio of the host it was fitted on: 55 us / 9.05 us on the H200's), so
    :func:`tag.cost.gpu.on_host` sets the rule's ``launch_s`` to the measured one."""
    from ..topology.catalog import match_gpu_name
    from .gpu import REFERENCE_GPU, gpu_rates

    spec = match_gpu_name(gpu) or match_gpu_name(REFERENCE_GPU)
    rates = gpu_rates(spec)
    host = launch_s * rates.host_s / rates.launch_s
    return host, f'host_launch: "{host * 1e6:.3g} us"'


def host_launch_report(meta: dict, gpu: str) -> str | None:
    """The line ``tag profile`` prints for a profile's ``meta`` measured on GPU type ``gpu``:
    the measured tiny-kernel launch and the topology line of this machine; None without
    ``meta.launch_s`` (a CPU profile, or one made before the launch was timed)."""
    if meta.get("launch_s") is None:
        return None
    launch = float(meta["launch_s"])
    return (f"host of {gpu}: tiny kernels {launch * 1e6:.3g} us per launch (measured); add to its machine in a "
            f"topology: {host_launch_of(launch, gpu)[1]}")


WAKE_GAP_S = 0.05
"""Idle seconds before each stage when the CPU wake penalty is measured (near saturation)."""
DEFAULT_WAKE_TAU_S = 0.01
"""Time constant used when the two-gap fit is not identifiable (noise)."""


def fit_wake_tau(short_s: float, long_s: float, ratio: float) -> float:
    """Time constant ``tau`` with ``(1 - exp(-short/tau)) / (1 - exp(-long/tau)) = ratio``: the
    measured penalty after ``short_s`` idle over the one after ``long_s``. The ratio falls from 1
    (tau -> 0) to ``short/long`` (tau -> inf); outside that range (noise) the default is used."""
    lo_r = short_s / long_s
    if not (lo_r < ratio < 1.0):
        return DEFAULT_WAKE_TAU_S if ratio <= lo_r else short_s / 10.0

    def f(tau: float) -> float:
        return (1.0 - math.exp(-short_s / tau)) / (1.0 - math.exp(-long_s / tau)) - ratio

    a, b = short_s / 50.0, long_s * 50.0  # f(a) > 0 > f(b)
    for _ in range(60):
        m = math.sqrt(a * b)
        a, b = (m, b) if f(m) > 0 else (a, m)
    return math.sqrt(a * b)


def _time_wake(its, bs, raw, sync, clock, repeats, gap, log) -> dict:
    """Per-stage extra seconds after ``gap`` idle over back-to-back (``raw`` medians), and the
    fitted time constant from a second pass at ``gap / 5`` on the largest batch. Repeats go
    round-robin over the batches (and the two gaps), so slow phases of a noisy host hit all alike."""
    k = len(raw[0]["fwd"]) if raw else 0
    out = {"fwd": [[0.0] * len(bs) for _ in range(k)], "bwd": [[0.0] * len(bs) for _ in range(k)]}
    times: list[dict] = [{} for _ in bs]
    short: dict = {}
    for _ in range(repeats):
        for j, it in enumerate(its):
            it.run(sync, times[j], clock, idle_s=gap)
        its[-1].run(sync, short, clock, idle_s=gap / 5.0)

    def extra(ts: dict, j: int, dest: dict | None) -> float:
        total = 0.0
        for (g, ph), xs in ts.items():
            x = max(0.0, statistics.median(xs) - raw[j][ph][g])
            total += x
            if dest is not None:
                dest[ph][g][j] = x
        return total

    totals = [extra(times[j], j, out) for j in range(len(bs))]
    for b, t in zip(bs, totals):
        log(f"  batch {b}: wake penalty after {gap * 1e3:.0f} ms idle +{t * 1e3:.2f} ms over all stages")
    long_total = totals[-1]
    short_total = extra(short, len(bs) - 1, None)
    out["total"] = long_total
    out["tau"] = fit_wake_tau(gap / 5.0, gap, short_total / long_total) if long_total > 0 else DEFAULT_WAKE_TAU_S
    return out


def _time_all(graph, its, bs, fwd, bwd, scales, sync, clock, repeats, warmup, load, log, wake_gap_s=0.0,
              wake=None):
    """Fill ``fwd``/``bwd`` [group][batch index] and ``scales``; return the optimizer timing.

    Repeats go round-robin over the batch sizes (one iteration of each in turn), so a slow phase
    of a noisy host hits every batch alike instead of bending the batch curve. ``load``:
    :class:`CoRunners` running at the middle profiled batch meanwhile (or None).
    ``wake_gap_s > 0``: also measure the wake penalty into ``wake`` (:func:`_time_wake`)."""
    k = graph.num_groups
    if load is not None:
        load.set_batch(bs[len(bs) // 2])
    times: list[dict] = [{} for _ in bs]
    totals: list[list[float]] = [[] for _ in bs]
    steps = [OptimizerStep(graph, it) for it in its]
    t0 = time.perf_counter()
    for r in range(warmup + repeats):
        for j, it in enumerate(its):
            t1 = clock()
            env = it.run(sync, times[j] if r >= warmup else None, clock)
            if r >= warmup:
                totals[j].append(clock() - t1)
            steps[j](env)
            del env
    raw: list[dict] = []  # per batch: unscaled per-stage medians {"fwd": [g], "bwd": [g]}
    for j, b in enumerate(bs):
        raw.append({"fwd": [0.0] * k, "bwd": [0.0] * k})
        for (g, ph), ts in times[j].items():
            (fwd if ph == "fwd" else bwd)[g][j] = raw[j][ph][g] = statistics.median(ts)
        # Per-stage medians miss the stalls (preemption, page faults) every real iteration suffers
        # in *some* stage: rescale them to sum to the median whole-iteration time.
        total = sum(fwd[g][j] + bwd[g][j] for g in range(k))
        scale = statistics.median(totals[j]) / total if total > 0 else 1.0
        scales.append(round(scale, 4))
        for g in range(k):
            fwd[g][j] *= scale
            bwd[g][j] *= scale
        log(f"  batch {b}: fwd+bwd {total * scale * 1e3:.2f} ms (stage sum x {scale:.3f})")
    log(f"  {warmup}+{repeats} iterations of each batch in {time.perf_counter() - t0:.1f} s")
    if wake_gap_s > 0 and wake is not None:
        wake.update(_time_wake(its, bs, raw, sync, clock, max(3, repeats // 2 + 1), wake_gap_s, log))
    return time_optimizer(graph, its[-1], sync, clock, repeats=max(repeats, 5), warmup=max(warmup, 1))


def cuda_device_type(dev: torch.device) -> str:
    """Catalog name of the local GPU (its reported name when not in the catalog)."""
    from ..topology.catalog import match_gpu_name

    name = torch.cuda.get_device_name(dev)
    spec = match_gpu_name(name)
    return spec.name if spec is not None else name.replace(" ", "-")


def retime_optimizer(path, spec: str, *, repeats: int = 9, warmup: int = 2, threads: int | None = None,
                     log: Log = stderr_log) -> Profile:
    """Re-time only the optimizer step of the profile at ``path`` (of zoo model / factory ``spec``)
    as :func:`time_optimizer` does, keeping its stage times; writes it back and returns it.

    For profiles whose optimizer was timed another way (``meta.optimizer_step`` absent: one
    single-tensor step per parameter, which the executor no longer runs). CPU profiles only (a
    GPU profile is re-made on its GPU with ``tag profile``)."""
    from ..graph.capture import capture
    from ..io import write_json
    from ..workloads import load_workload
    from .profile import _rounded, load_profile

    prof = load_profile(path)
    if not prof.device_type.startswith("cpu"):
        raise ValueError(f"{path}: device type {prof.device_type}: re-time a GPU profile on its GPU")
    torch.set_num_threads(threads or int(prof.meta.get("threads", 1)))
    tune_malloc()
    dev = torch.device("cpu")
    wl = load_workload(spec, batch=prof.batch_size, seed=0)
    cap = capture(wl, optimizer=prof.optimizer, num_groups=int(prof.meta.get("num_groups_requested", prof.num_groups)))
    if cap.graph.signature() != prof.graph_signature:
        raise ValueError(f"{path}: graph signature {prof.graph_signature}, but {spec} captures as "
                         f"{cap.graph.signature()}")
    it = build_iteration(cap.graph, wl.model, wl.make_inputs, prof.batches[-1], dev, structure(cap.joint))
    clock = timing_clock(dev)
    opt, overhead = time_optimizer(cap.graph, it, lambda: None, clock, repeats=repeats, warmup=warmup)
    log(f"{prof.model}: optimizer {sum(prof.opt) * 1e3:.2f} ms + {prof.opt_step_overhead_s * 1e3:.3f} ms -> "
        f"{sum(opt) * 1e3:.2f} ms + {overhead * 1e3:.3f} ms per step")
    prof.opt, prof.opt_step_overhead_s = opt, overhead
    prof.meta = {**prof.meta, "optimizer_step": optimizer_step(dev),
                 "optimizer_timed": time.strftime("%Y-%m-%d"), "optimizer_torch": torch.__version__}
    write_json(path, _rounded(prof.to_dict()), indent=None)
    return prof
