"""Executed training equals single-process training: the parameter comparison and the layout check.

:func:`compare_params` holds every rank's parameters after ``K`` steps against
:func:`tag.executor.reference_training` (plain eager training on the full batch) with the
executor's tolerance, :data:`RTOL` / :data:`ATOL` (``torch.testing.assert_close``'s rule
``|x - ref| <= ATOL + RTOL * |ref|`` per element); :func:`assert_params_equal` is its assertion,
used by the executor's tests.

:func:`check_layouts` runs ``tag execute --save-params`` (the library's :func:`execute`) of the
Megatron-style layouts of :data:`LAYOUTS` (:mod:`tag.parallel.layout`: data, pipeline and tensor
parallel) on a one-machine topology of their device count, for a given backend, and returns one
record per layout: the largest parameter differences, pass / fail, seconds. On gloo it runs in
the tests (tests/test_equality_check.py); on NCCL it is ``evaluation/gpu_check.py``'s multi-GPU
part (``--only-multi-gpu``), which needs one GPU per rank; on ``gloo-cuda`` (:data:`SHARED_GPU_LAYOUTS`)
the same script's two ranks on one GPU.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import TagError
from ..io import load_tensors

RTOL = 1e-4
"""Relative tolerance of executed against single-process parameters (fp32; tests/test_executor.py)."""
ATOL = 1e-6
"""Absolute tolerance of the same comparison."""
LOSS_RTOL = 1e-4
"""Relative tolerance of the executed full-batch losses against the reference's (tests/test_executor_dist.py)."""

GPT2 = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab=100,seq=16"
"""The tiny GPT-2 of the tensor-parallel tests (Megatron blocks for ``tp``; 2+ samples per replica)."""
MLP = "mlp"
"""The zoo MLP of the pipeline tests."""
WORKLOADS = {GPT2: (8, 6), MLP: (8, 4)}
"""Spec: (global batch, op-groups) of the check's models."""
LAYOUTS = [
    (MLP, "dp=2"),
    (MLP, "pp=2,micro=2,schedule=1f1b"),
    (GPT2, "dp=2"),
    (GPT2, "pp=2,micro=2,schedule=1f1b"),
    (GPT2, "pp=2,micro=4,schedule=gpipe"),
    (GPT2, "pp=2,micro=4,schedule=kfkb,k=2"),
    (GPT2, "tp=2"),
    (GPT2, "dp=2,tp=2"),
    (GPT2, "dp=2,pp=2,micro=2,schedule=1f1b"),
    (GPT2, "tp=2,pp=2,micro=2,schedule=1f1b"),
]
"""(model spec, layout) pairs :func:`check_layouts` runs by default, in order; a layout needs
``dp * tp * pp`` devices (those above the available count are left out)."""
SHARED_GPU_LAYOUTS = [
    (MLP, "dp=2"),
    (GPT2, "pp=2,micro=2,schedule=1f1b"),
    (GPT2, "tp=2"),
    (GPT2, "dp=2,zero=3"),
    (MLP, "dp=2,zero=2,offload=optimizer"),
]
"""The 2-rank layouts of the GPU check's ranks on one GPU over gloo (``backend="gloo-cuda"``):
data parallel, a 1F1B pipeline (activations staged through pinned host memory), tensor parallel,
ZeRO-3 (all-gathers and reduce-scatters of CUDA shards) and ZeRO-2 with the optimizer offloaded
(the shard's copies to and from pinned host memory on a stream of their own). On 2 gloo CPU ranks
(``check_layouts("gloo", 2, layouts=SHARED_GPU_LAYOUTS)``, 2026-11-29) all five pass, at most
0.0014 x the tolerance."""
OPTIMIZER = "sgd"
"""SGD with momentum: Adam normalises the rounding noise of a gradient that is zero in exact
arithmetic (attention's key bias; one MLP weight) to a full-size step whose sign depends on the
summation order, which any split of the batch or the features changes (tests/test_tensor_parallel.py)."""


@dataclass
class ParamDiff:
    """How far executed parameters are from the reference (:func:`compare_params`)."""

    max_abs: float = 0.0
    """Largest ``|x - ref|`` over every element of every rank's parameters."""
    max_rel: float = 0.0
    """Largest ``|x - ref| / |ref|`` over the elements with ``|ref| >= ATOL / RTOL`` (0.01), where
    the relative term of the tolerance dominates (nearer zero a relative difference says nothing:
    a weight of 1e-8 off by 7e-9 is 0.7)."""
    tol_ratio: float = 0.0
    """Largest ``|x - ref| / (ATOL + RTOL * |ref|)``: at most 1 where every element is within tolerance."""
    worst: str = ""
    """``rank R NAME`` of the element with the largest ``tol_ratio``."""
    problems: list[str] = field(default_factory=list)
    """Parameters missing from every rank, unknown to the reference, or of another shape."""
    rtol: float = RTOL
    atol: float = ATOL

    @property
    def ok(self) -> bool:
        return not self.problems and self.tol_ratio <= 1.0

    def message(self) -> str:
        return (f"max |x - ref| {self.max_abs:.3g}, max relative {self.max_rel:.3g}, "
                f"{self.tol_ratio:.3g} x the tolerance (rtol {self.rtol:g}, atol {self.atol:g}) at {self.worst or '-'}"
                + (f"; {'; '.join(self.problems)}" if self.problems else ""))


def compare_params(params_by_rank: dict[int, dict[str, torch.Tensor]], ref: dict[str, torch.Tensor],
                   expected: set[str] | None = None, rtol: float = RTOL, atol: float = ATOL,
                   exact: bool = False) -> ParamDiff:
    """Every parameter each rank holds against ``ref`` (name -> tensor), and the union of the
    ranks' names against ``expected`` (the graph's parameter names; a tensor-parallel rank saves
    its group's full parameters, a pipeline rank its stage's): each must be held, and with
    ``exact`` nothing else. NaN counts as infinitely far."""
    d = ParamDiff(rtol=rtol, atol=atol)
    held: set[str] = set()
    for rank, params in sorted(params_by_rank.items()):
        for name, value in params.items():
            held.add(name)
            if name not in ref:
                d.problems.append(f"rank {rank} {name}: not a parameter of the reference")
                continue
            want = ref[name].detach().to("cpu", torch.float64)
            got = value.detach().to("cpu", torch.float64)
            if got.shape != want.shape:
                d.problems.append(f"rank {rank} {name}: shape {tuple(got.shape)}, reference {tuple(want.shape)}")
                continue
            if got.numel() == 0:
                continue
            diff = (got - want).abs().nan_to_num(nan=math.inf)
            ratio = float((diff / (atol + rtol * want.abs())).max())
            d.max_abs = max(d.max_abs, float(diff.max()))
            large = want.abs() >= atol / rtol
            if bool(large.any()):
                d.max_rel = max(d.max_rel, float((diff[large] / want[large].abs()).max()))
            if ratio > d.tol_ratio or not d.worst:
                d.tol_ratio, d.worst = max(ratio, d.tol_ratio), f"rank {rank} {name}"
    missing = sorted((expected or set()) - held)
    if missing:
        d.problems.append(f"held by no rank: {_some(missing)}")
    extra = sorted(held - expected) if exact and expected is not None else []
    if extra:
        d.problems.append(f"held but not expected: {_some(extra)}")
    return d


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")


def assert_params_equal(params_by_rank: dict[int, dict[str, torch.Tensor]], ref: dict[str, torch.Tensor],
                        expected: set[str] | None = None, *, rtol: float = RTOL, atol: float = ATOL,
                        exact: bool = False) -> ParamDiff:
    """:func:`compare_params`, raising an :class:`AssertionError` with its one-line message unless
    every parameter is within tolerance and every ``expected`` name is held (with ``exact``: and
    no other)."""
    d = compare_params(params_by_rank, ref, expected, rtol, atol, exact)
    assert d.ok, d.message()
    return d


def saved_params(run_dir: str | Path, world_size: int) -> dict[int, dict[str, torch.Tensor]]:
    """Each rank's ``params-rank<R>.pt`` of a ``tag execute --save-params`` run folder (on the CPU),
    read as every ``.pt`` file is (:func:`tag.io.load_tensors`: tensors and plain containers only;
    anything else is a one-line :class:`~tag.errors.TagError` naming the file)."""
    return {r: load_tensors(Path(run_dir) / f"params-rank{r}.pt", TagError, "parameter file")
            for r in range(world_size)}


def one_machine_topology(folder: Path, devices: int, device: str) -> Path:
    """A topology file of one machine with ``devices`` devices of catalog type ``device`` (``cpu``:
    this machine's measured CPU) linked at 5 GB/s (CPU) or 150 GB/s (GPU; only the prediction and
    the stage cuts read it)."""
    path = folder / f"one-machine-{device}-{devices}.yaml"
    link = "5 GB/s" if device == "cpu" else "150 GB/s"
    path.write_text(f"name: one-machine-{device}-{devices}\nmachines:\n  - name: local\n    gpu: {device}\n"
                    f"    count: {devices}\n    intra_bandwidth: \"{link}\"\n")
    return path


def check_layouts(backend: str, devices: int, *, layouts: list[tuple[str, str]] | None = None, steps: int = 2,
                  device: str | None = None, deadline: float = math.inf, timeout_s: float = 120.0,
                  log_fn=None) -> list[dict]:
    """Execute each (model spec, layout) of ``layouts`` (default :data:`LAYOUTS`, those of at most
    ``devices`` devices) for ``steps`` steps, fp32, :data:`OPTIMIZER`, on ``backend`` (``gloo``;
    ``nccl``: one GPU per rank; ``gloo-cuda``: every rank on this machine's GPUs over gloo, two
    to a GPU on one, :data:`tag.executor.comm.GLOO_CUDA`) over a one-machine topology of the
    layout's ``dp * tp * pp`` devices of type ``device`` (default: ``cpu`` on gloo, else the
    catalog type of ``cuda:0``, else H100), and compare every rank's saved parameters with
    single-process training.

    Returns one record per layout: ``layout``, ``model``, ``batch``, ``backend``, ``world_size``,
    ``steps``, ``optimizer``, ``max_abs_diff``, ``max_rel_diff``, ``tol_ratio`` (difference over
    tolerance, at most 1 to pass), ``worst``, ``loss_rel_diff`` (largest relative difference of
    the full-batch losses), ``pass``, ``seconds`` (wall, the launch included), ``rtol``, ``atol``;
    a failed run has ``pass`` False and ``note`` ``failed: ...``; one not started by ``deadline``
    (:func:`time.perf_counter` seconds) ``note`` ``skipped: time budget`` and ``pass`` None.
    ``log_fn(record)``: called with each record once it is final. ``timeout_s``: the bound on any
    blocked communication and on the ranks' rendezvous (:class:`ExecuteConfig`)."""
    from ..cost.model import CostModel
    from ..graph import capture
    from ..parallel.layout import layout_plan, parse_layout
    from ..topology import load_topology
    from ..workloads import load_workload
    from .launch import ExecuteConfig, execute
    from .virtual import reference_training

    if backend not in ("gloo", "nccl", "gloo-cuda"):
        raise ValueError(f"backend: expected gloo, nccl or gloo-cuda, got {backend!r}")
    if device is None:
        device = "cpu" if backend == "gloo" else _cuda_type()
    todo = [(spec, text, parse_layout(text)) for spec, text in (LAYOUTS if layouts is None else layouts)]
    todo = [(spec, text, lay) for spec, text, lay in todo if lay.devices <= devices]
    graphs: dict[str, object] = {}
    refs: dict[str, tuple] = {}
    records = []
    with tempfile.TemporaryDirectory(prefix="tag-equality-") as tmp:
        for i, (spec, text, lay) in enumerate(todo):
            batch, groups = WORKLOADS.get(spec, (8, 4))
            rec = {"kind": "equality", "layout": text, "model": spec, "batch": batch, "backend": backend,
                   "world_size": lay.devices, "steps": steps, "optimizer": OPTIMIZER, "rtol": RTOL, "atol": ATOL}
            records.append(rec)
            t0 = time.perf_counter()
            if t0 >= deadline:
                rec.update({"pass": None, "note": "skipped: time budget"})
                if log_fn is not None:
                    log_fn(rec)
                continue
            try:
                if spec not in graphs:
                    graphs[spec] = capture(load_workload(spec, batch=batch), optimizer=OPTIMIZER,
                                           num_groups=groups).graph
                    refs[spec] = reference_training(load_workload(spec, batch=batch), OPTIMIZER, steps)
                graph = graphs[spec]
                topo_path = one_machine_topology(Path(tmp), lay.devices, device)
                topo = load_topology(str(topo_path))
                plan_path = Path(tmp) / f"plan-{i}.json"
                layout_plan(graph, topo, lay, CostModel.for_topology(graph, topo)).save(plan_path)
                run_dir = Path(tmp) / f"run-{i}"
                res = execute(ExecuteConfig(spec, str(topo_path), str(plan_path), batch=batch, optimizer=OPTIMIZER,
                                            groups=groups, steps=steps, warmup=0, backend=backend,
                                            save_params=True, run_dir=str(run_dir), timeout_s=timeout_s),
                              graph=graph)
                ref, losses = refs[spec]
                d = compare_params(saved_params(run_dir, res.world_size), ref, {p.name for p in graph.params})
                loss_rel = max((abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(res.losses, losses)),
                               default=math.inf)
                rec.update({"max_abs_diff": d.max_abs, "max_rel_diff": d.max_rel, "tol_ratio": d.tol_ratio,
                            "worst": d.worst, "loss_rel_diff": loss_rel,
                            "pass": d.ok and loss_rel <= LOSS_RTOL and len(res.losses) == steps})
                if d.problems:
                    rec["note"] = "; ".join(d.problems)[:300]
            except Exception as e:  # noqa: BLE001 - one failed layout is a result; the others still run
                msg = str(e).splitlines()[0][:300] if str(e) else ""
                rec.update({"pass": False, "note": f"failed: {type(e).__name__}: {msg}"})
            rec["seconds"] = time.perf_counter() - t0
            if log_fn is not None:
                log_fn(rec)
    return records


def _cuda_type() -> str:
    """The catalog type of ``cuda:0`` (H100 without a GPU or when the catalog does not know it:
    only the memory check and the stage cuts read it; without a GPU the launch refuses)."""
    from ..topology.catalog import match_gpu_name

    if not torch.cuda.is_available():
        return "H100"
    spec = match_gpu_name(torch.cuda.get_device_name(0))
    return spec.name if spec is not None else "H100"


__all__ = ["ATOL", "LAYOUTS", "RTOL", "SHARED_GPU_LAYOUTS", "ParamDiff", "assert_params_equal", "check_layouts",
           "compare_params", "one_machine_topology", "saved_params"]
