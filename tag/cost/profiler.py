"""Measure op-group times on the local device: the runnable stages the executor runs.

For each profiled per-replica batch ``b`` the model is exported at ``b`` (one joint graph), cut
into one stage per (op-group, phase) with the reference graph's grouping
(:func:`stage_assignment`), and the whole iteration is run stage by stage ``warmup + repeats``
times: forward stages in group order, backward stages in reverse order, each stage timed on its
own (``perf_counter``; CUDA synchronised). The median over the repeats is stored. The optimizer is
timed as a real ``torch.optim`` step (``foreach=False``) on tensors of every parameter's shape, one
optimizer per group plus one over all parameters, which separates the fixed per-step cost from the
per-group marginal cost (:class:`tag.cost.profile.Profile`).
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
import types
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch.export.graph_signature import InputKind

from ..graph.capture import export_joint
from ..graph.stages import Stage, build_stages
from .profile import Profile, cpu_device_type

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


def _complete_assignment(gm: torch.fx.GraphModule, assign: dict[str, Hashable]) -> dict[str, Hashable]:
    """Restrict ``assign`` to ``gm``'s nodes and place nodes it lacks (an export at another batch
    can decompose slightly differently): with their first assigned input, else their first user."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    out = {n.name: assign[n.name] for n in nodes if n.name in assign}
    pending = [n for n in nodes if n.name not in out and n.users]
    for _ in range(3):  # chains of unassigned nodes resolve in a few passes
        left = []
        for n in pending:
            key = next((out[a.name] for a in n.all_input_nodes if a.name in out), None)
            if key is None:
                key = next((out[u.name] for u in n.users if u.name in out), None)
            if key is None:
                left.append(n)
            else:
                out[n.name] = key
        pending = left
    return out


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

    def run(self, sync: Callable[[], None], times: dict | None = None) -> dict[str, torch.Tensor]:
        """One forward+backward; if ``times`` is given, appends each stage's seconds to it."""
        env = dict(self.env0)
        with torch.no_grad():
            for key, st in self.stages:
                t0 = time.perf_counter()
                outs = st.module(*[env[n] for n in st.inputs])
                sync()
                if times is not None:
                    times.setdefault(key, []).append(time.perf_counter() - t0)
                env.update(zip(st.outputs, outs))
        return env


def build_iteration(graph, model, make_inputs, batch: int, device: torch.device) -> RunnableIteration:
    """Export ``model`` at ``batch`` and cut it with ``graph``'s grouping."""
    with _quiet():
        ep = export_joint(model, make_inputs(batch))
    gm = ep.graph_module
    assign = _complete_assignment(gm, stage_assignment(graph))
    stages = build_stages(types.SimpleNamespace(joint=gm), assign)
    k = graph.num_groups
    order = [(g, "fwd") for g in range(k)] + [(g, "bwd") for g in reversed(range(k))]
    ordered = [(key, stages[key]) for key in order if key in stages]
    if device.type != "cpu":
        for _, st in ordered:
            _retarget(st.module, device)
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


def _retarget(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Tensor-creating ops were traced with device=cpu; point them at ``device``."""
    for n in gm.graph.nodes:
        dev = n.kwargs.get("device") if n.op == "call_function" else None
        if dev is not None and torch.device(dev).type == "cpu":
            n.kwargs = {**n.kwargs, "device": device}
    gm.recompile()


def _quiet():
    from ..graph.capture import _quiet as q

    return q()


def make_optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The executor's optimizers (single-tensor kernels, ``foreach=False``)."""
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=False)
    return torch.optim.SGD(params, lr=1e-2, foreach=False)


def time_optimizer(graph, shapes: dict[str, torch.Size], device: torch.device, sync, repeats: int,
                   warmup: int) -> tuple[list[float], float]:
    """(per-group marginal seconds, fixed per-step seconds) of ``graph.optimizer``'s step."""
    def leaf(shape):
        p = torch.randn(shape, device=device, requires_grad=True)
        p.grad = torch.randn(shape, device=device)
        return p

    def step_time(params: list[torch.Tensor]) -> float:
        if not params:
            return 0.0
        opt = make_optimizer(graph.optimizer, params)
        ts = []
        for i in range(warmup + repeats):
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            if i >= warmup:
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    groups = [[leaf(shapes[graph.params[p].name]) for p in grp.params] for grp in graph.groups]
    per_group = [step_time(ps) for ps in groups]
    total = step_time([p for ps in groups for p in ps])
    nonempty = sum(1 for ps in groups if ps)
    overhead = max(0.0, (sum(per_group) - total) / (nonempty - 1)) if nonempty > 1 else 0.0
    overhead = min(overhead, min((t for t in per_group if t > 0), default=0.0))
    return [max(0.0, t - overhead) if t > 0 else 0.0 for t in per_group], overhead


def profile_model(spec: str, *, batch: int | None = None, device: str = "cpu", batches: list[int] | None = None,
                  repeats: int = 5, warmup: int = 2, optimizer: str = "adam", num_groups: int = 48,
                  seed: int = 0, threads: int | None = None, log: Log = stderr_log, captured=None) -> Profile:
    """Profile zoo model / factory ``spec`` on the local ``device`` (``cpu`` or ``cuda``).

    Args:
        batch: global batch the graph is captured at (default: the workload's).
        batches: per-replica batch sizes to time (default :func:`default_batches`).
        threads: intra-op threads for a CPU (default: torch's current setting).
        captured: an existing capture of the workload (skips capturing again).
    """
    from ..graph.capture import capture
    from ..workloads import load_workload

    if threads is not None:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    wl = load_workload(spec, batch=batch, seed=seed)
    t0 = time.perf_counter()
    cap = captured if captured is not None else capture(wl, optimizer=optimizer, num_groups=num_groups)
    graph = cap.graph
    log(f"profile {graph.model}: captured {len(graph.ops)} ops in {graph.num_groups} groups "
        f"({time.perf_counter() - t0:.1f} s)")
    bs = sorted(set(batches or default_batches(graph.batch_size)))
    k = graph.num_groups
    fwd = [[0.0] * len(bs) for _ in range(k)]
    bwd = [[0.0] * len(bs) for _ in range(k)]
    shapes: dict[str, torch.Size] = {}
    for j, b in enumerate(bs):
        t0 = time.perf_counter()
        it = build_iteration(graph, wl.model, wl.make_inputs, b, dev)
        t_export = time.perf_counter() - t0
        shapes.update({n: p.shape for n, p in it.params.items()})
        times: dict = {}
        t0 = time.perf_counter()
        for r in range(warmup + repeats):
            it.run(sync, times if r >= warmup else None)
        for (g, ph), ts in times.items():
            (fwd if ph == "fwd" else bwd)[g][j] = statistics.median(ts)
        total = sum(fwd[g][j] + bwd[g][j] for g in range(k))
        log(f"  batch {b}: export {t_export:.1f} s, {warmup}+{repeats} iterations "
            f"{time.perf_counter() - t0:.1f} s, fwd+bwd {total * 1e3:.2f} ms")
    opt, overhead = time_optimizer(graph, shapes, dev, sync, repeats=max(repeats, 5), warmup=warmup)
    log(f"  optimizer {graph.optimizer}: {sum(opt) * 1e3:.2f} ms + {overhead * 1e3:.3f} ms per step")
    if dev.type == "cuda":
        dtype = cuda_device_type(dev)
    else:
        dtype = cpu_device_type(torch.get_num_threads())
    meta = {"repeats": repeats, "warmup": warmup, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "host": platform.node(), "date": time.strftime("%Y-%m-%d"), "num_groups_requested": num_groups}
    return Profile(dtype, graph.model, graph.signature(), graph.batch_size, graph.optimizer, bs, fwd, bwd, opt,
                   overhead, meta)


def cuda_device_type(dev: torch.device) -> str:
    """Catalog name of the local GPU (its reported name when not in the catalog)."""
    from ..topology.catalog import match_gpu_name

    name = torch.cuda.get_device_name(dev)
    spec = match_gpu_name(name)
    return spec.name if spec is not None else name.replace(" ", "-")
