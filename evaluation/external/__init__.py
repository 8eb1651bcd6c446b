"""The simulator against published, measured multi-GPU training runs.

    .venv/bin/python -m evaluation.external [--only GROUP[,GROUP] [--merge]] [--out DIR] [--groups 48]

Every point of ``evaluation/external/points/*.yaml`` is a training run someone measured on a real
cluster (its source, cluster, model, precision, batches, data x tensor x pipeline layout, stage
cut and device order where published, measured iteration seconds, memory where published, and
whether it ran or failed). Each is costed as TAG's simulator costs ``tag simulate --layout``: the
model captured at the global batch in its precision, the layout on a topology file of its cluster
(``evaluation/external/topologies/``), out-of-memory reported, not refused. Written to ``--out``
(default ``evaluation/results/external/``): ``points.csv`` (one row per point: simulated,
measured, error, OOM), ``summary.json`` (per cluster group: points, Spearman rank correlation of
simulated against measured, median and worst ``|simulated / measured - 1|``, whether the measured
fastest layout is among the simulator's three fastest, runs that ran but are predicted out of
memory), ``sim_vs_measured.png`` (log-log, one colour per group) and ``README.md`` (the table,
the command, commit, machine and date). ``--only G1,G2 --merge`` costs those groups and keeps
every other group's rows of ``--out``'s ``points.csv``; the table, summary and plot cover all
rows, and the README's header has a row per run (``summary.json`` ``runs``: the full run's, then
one naming the groups of each partial run), so each group's figures name their commit.

Nothing here is fitted to these measurements: the simulator's constants come from per-op
microbenchmarks and the profiled single-GPU steps (``tag/cost/gpu_calib/``), so the
leave-one-group-out condition holds by construction (no group's iteration times are read by
any fit).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
POINTS = HERE / "points"
TOPOLOGIES = HERE / "topologies"
RESULTS = ROOT / "evaluation" / "results" / "external"
PRECISIONS = ("fp32", "fp16", "bf16")
EAGER_RUNTIMES = ("tag", "eager", "torchtitan")
"""Runtimes that run the captured eager kernels (TAG's executor; torchtitan without
``torch.compile``, its only rows costed: eager PyTorch ops, SDPA attention); any other runtime is costed as
Megatron-LM runs: its fused kernels (``CostModel`` ``runtime="megatron"``), activations as a fused
trainer holds them (:mod:`tag.cost.fused_memory`), one op-group a layer (Megatron-LM's unit of
activation recomputation and of tensor parallelism: :func:`tag.parallel.layers.group_by_layers`)
and, with tensor parallelism, the vocabulary split over the tensor-parallel ranks: the embedding's
and head's weights, the embedding's rows and the head's logits, their work and their collectives,
every rank on its replica's whole micro-batch (:func:`tag.parallel.layers.vocab_parallel_graph`,
:func:`vocab_parallel_plan`), the tied embedding held by a pipeline's first and last stages."""

BLOCK_UNIT_RUNTIMES = ("torchtitan",)
"""Eager runtimes costed one op-group a transformer block (:func:`tag.parallel.layers.group_by_layers`)
as the non-eager ones are: torchtitan applies FSDP2's ``fully_shard`` and activation checkpointing
to each ``TransformerBlock`` (its ``apply_fsdp`` and ``apply_ac``), so a block is what it gathers,
frees and recomputes as a unit."""


BLOCKING_SEND_RUNTIMES = ("deepspeed", "megatron-lm", "megatron-deepspeed", "flagscale")
"""Runtimes (:func:`runtime_name`) whose pipeline sends block the sender's compute until they
complete, costed with ``Simulator(blocking_sends=True)``:

- DeepSpeed's pipeline engine: ``deepspeed/runtime/pipe/p2p.py`` ``send`` asserts
  ``async_op == False`` and calls ``dist.send`` (microsoft/DeepSpeed f4079d7).
- Megatron-LM's schedules: ``megatron/core/pipeline_parallel/p2p_communication.py``
  ``_communicate`` posts ``batch_isend_irecv`` / ``isend`` and, with ``wait_on_reqs=True`` (the
  default, which ``send_forward`` and ``send_backward`` use), ``req.wait()`` on every request in
  the same call (NVIDIA/Megatron-LM 2fd6e2b; only the interleaved schedule's
  ``overlap_p2p_comm`` returns the handles unwaited). FlagScale is a Megatron-LM fork.
- Megatron-DeepSpeed: ``pretrain_gpt.py`` builds ``GPTModelPipe`` under ``--deepspeed``
  (DeepSpeed's pipeline engine, above), else Megatron-LM's ``GPTModel`` and schedules
  (microsoft/Megatron-DeepSpeed 0782d75).

Every other runtime (TAG's executor and ``eager``: asynchronous sends; OneFlow, llm-foundry,
torchtitan: no citation of blocking sends) keeps the default, senders computing on."""


STATE_RUNTIMES = {"megatron-lm": "megatron", "flagscale": "megatron", "deepspeed": "deepspeed"}
"""Runtimes (:func:`runtime_name`) whose sharded mixed-precision training state the simulator holds
as they hold it (:data:`tag.sim.sharded.STATE_RUNTIMES`: Megatron-LM's distributed optimizer,
FlagScale a fork of it; DeepSpeed's ZeRO-3); every other runtime's as TAG's executor holds it."""


def runtime_name(runtime: str) -> str:
    """The runtime's name in a points file's ``runtime`` text, lower case: ``deepspeed`` of
    ``deepspeed``, ``megatron-deepspeed`` of ``other: Megatron-DeepSpeed (data/README.md ...)``."""
    text = runtime.removeprefix("other:").strip()
    return text.split()[0].rstrip(",").lower() if text else ""


class DataError(ValueError):
    """A malformed points file: one line naming the file, point and field."""


@dataclass(frozen=True)
class Point:
    """One published, measured training run (``evaluation/external/points/*.yaml``)."""

    id: str
    source: str
    """Points file stem (one source per file)."""
    group: str
    """Cluster group: points scored together (one cluster, one model family)."""
    heterogeneous: bool
    topology: Path
    model: str
    """A TAG workload spec (zoo or factory)."""
    precision: str
    global_batch: int
    """Samples per iteration."""
    layout: dict
    """``dp``, ``tp``, ``pp``, ``micro`` (micro-batches per iteration) and optional keys of
    :class:`tag.parallel.layout.Layout` (``schedule``, ``k``, ``sp``, ``recompute``)."""
    measured_s: float | None
    """Measured seconds per iteration (None where it did not run)."""
    ran: bool
    """False: the source reports this run failed (out of memory)."""
    runtime: str
    """What ran (``megatron-lm``, ``deepspeed``, ...)."""
    stages: tuple[int, ...] | None = None
    """Transformer layers per pipeline stage, as published (None: TAG's balanced cut)."""
    devices: tuple[str, ...] | None = None
    """Device order of the layout's ranks (``machine:index``), as published."""
    memory_gib: float | None = None
    matmul_tf32: bool = False
    """fp32 matmuls ran as TF32 (NVIDIA's NGC PyTorch containers set
    ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1``); set per file, group or point."""
    raw: str = ""
    """The published figure, verbatim."""

    def layout_text(self) -> str:
        """``dp=..,tp=..,pp=..,micro=..[,...]`` (:func:`tag.parallel.layout.parse_layout`)."""
        return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.layout.items())


def _need(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise DataError(f"{where}: {msg}")


def _positive_int(v, where: str) -> int:
    _need(isinstance(v, int) and not isinstance(v, bool) and v > 0, where, f"expected a positive integer, got {v!r}")
    return v


def _point(doc: dict, src: str, group: dict, runtime: str, where: str, tf32: bool = False) -> Point:
    _need(isinstance(doc, dict), where, "expected a mapping")
    pid = doc.get("id")
    _need(isinstance(pid, str) and pid, where, "id: expected a non-empty string")
    where = f"{where} ({pid})"
    model = doc.get("model")
    _need(isinstance(model, str) and model, where, f"model: expected a workload spec, got {model!r}")
    prec = doc.get("precision")
    _need(prec in PRECISIONS, where, f"precision: expected one of {list(PRECISIONS)}, got {prec!r}")
    gb = _positive_int(doc.get("global_batch"), f"{where}: global_batch")
    lay = doc.get("layout")
    _need(isinstance(lay, dict), where, "layout: expected a mapping with dp, tp, pp, micro")
    layout = {}
    for k in ("dp", "tp", "pp", "micro"):
        layout[k] = _positive_int(lay.get(k, 1), f"{where}: layout.{k}")
    for k, v in lay.items():
        if k not in layout:
            layout[k] = v
    if doc.get("schedule") is not None:
        layout["schedule"] = doc["schedule"]
    if doc.get("recompute"):
        layout["recompute"] = 1
    stages = doc.get("stages")
    if stages is not None:
        _need(isinstance(stages, list) and len(stages) == layout["pp"], where,
              f"stages: expected {layout['pp']} layer counts, got {stages!r}")
        stages = tuple(_positive_int(s, f"{where}: stages") for s in stages)
    devices = doc.get("devices")
    if devices is not None:
        _need(isinstance(devices, list) and all(isinstance(d, str) for d in devices), where,
              "devices: expected a list of machine:index strings")
        devices = tuple(devices)
    meas = doc.get("measured") or {}
    _need(isinstance(meas, dict), where, "measured: expected a mapping")
    ran = doc.get("ran", True)
    _need(isinstance(ran, bool), where, f"ran: expected true or false, got {ran!r}")
    t = meas.get("iteration_s")
    if ran:
        _need(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < math.inf, where,
              f"measured.iteration_s: expected positive seconds for a run that ran, got {t!r}")
    mem = meas.get("memory_gib")
    topo = group.get("topology")
    _need(isinstance(topo, str) and topo, where, "group topology: expected a file name")
    tf32 = doc.get("matmul_tf32", group.get("matmul_tf32", tf32))
    _need(isinstance(tf32, bool), where, f"matmul_tf32: expected true or false, got {tf32!r}")
    return Point(pid, src, group["name"], bool(group.get("heterogeneous", False)), TOPOLOGIES / topo, model, prec,
                 gb, layout, float(t) if t is not None else None, ran, runtime, stages, devices,
                 float(mem) if isinstance(mem, (int, float)) else None, tf32, str(meas.get("from", "")))


def load_points(root: Path = POINTS, *, expressible_only: bool = True) -> list[Point]:
    """Every point of every ``*.yaml`` under ``root`` (sorted by file), validated (:class:`DataError`).
    Points marked ``expressible: false`` are left out unless ``expressible_only`` is False."""
    out: list[Point] = []
    seen: set[tuple[str, str]] = set()
    for path in sorted(Path(root).glob("*.yaml")):
        where = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        try:
            doc = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise DataError(f"{where}: not YAML ({str(e).splitlines()[0]})") from None
        _need(isinstance(doc, dict), where, "expected a mapping with source, runtime, groups")
        runtime = doc.get("runtime")
        _need(isinstance(runtime, str) and runtime, where, "runtime: expected what ran (e.g. megatron-lm)")
        groups = doc.get("groups") or []
        _need(isinstance(groups, list), where, "groups: expected a list")
        for gi, group in enumerate(groups):
            gw = f"{where}: groups[{gi}]"
            _need(isinstance(group, dict) and isinstance(group.get("name"), str), gw, "expected a mapping with a name")
            for pi, doc_p in enumerate(group.get("points") or []):
                if expressible_only and not (doc_p or {}).get("expressible", True):
                    continue
                p = _point(doc_p, path.stem, group, group.get("runtime", runtime),
                           f"{gw}.points[{pi}]", doc.get("matmul_tf32", False))
                _need((p.group, p.id) not in seen, gw, f"point id {p.id!r} given twice")
                seen.add((p.group, p.id))
                out.append(p)
    return out


# ------------------------------------------------------------------------------------- simulate
@dataclass
class Row:
    """A point as the simulator costs it."""

    point: Point
    simulated_s: float | None
    oom: bool
    peak_gib: float | None
    """Largest simulated peak memory of a device (GiB)."""
    error: str | None = None
    """Why it could not be costed (one line), else None."""

    @property
    def ratio(self) -> float | None:
        """Simulated over measured seconds."""
        if self.simulated_s is None or self.point.measured_s is None:
            return None
        return self.simulated_s / self.point.measured_s


def simulate_point(p: Point, *, groups: int = 48, topologies: dict | None = None) -> Row:
    """Cost one point (:class:`Row`; a point TAG refuses gives a row with ``error``)."""
    from tag.cost.fused_memory import fused_activation_graph
    from tag.cost.gpu import Numerics
    from tag.cost.model import CostModel
    from tag.errors import TagError
    from tag.parallel.layers import group_by_layers, vocab_parallel_graph
    from tag.parallel.layout import align_groups, parse_layout
    from tag.planner import layout_plan, model_graph
    from tag.sim import Simulator
    from tag.sim.sharded import hold_state_as
    from tag.topology import load_topology

    topologies = {} if topologies is None else topologies
    try:
        topo = topologies.get(p.topology)
        if topo is None:
            topo = topologies[p.topology] = load_topology(str(p.topology))
        graph, _, _ = model_graph(p.model, p.global_batch, precision=p.precision, num_groups=groups)
        lay = replace(parse_layout(p.layout_text()), stages=p.stages, order=p.devices,
                      vocab=int(p.runtime not in EAGER_RUNTIMES and p.layout["tp"] > 1))
        if p.runtime not in EAGER_RUNTIMES or p.runtime in BLOCK_UNIT_RUNTIMES:  # one op-group a layer:
            group_by_layers(graph)  # Megatron-LM's recompute and tp unit, torchtitan's FSDP and AC unit
        elif lay.stages is not None:  # op-groups that start at every stage's first layer
            try:
                align_groups(graph, lay)
            except TagError:  # (many layers, e.g. 96 cut 6 by 6: about two groups a layer)
                align_groups(graph, lay, near=2 * sum(lay.stages))
        if p.runtime not in EAGER_RUNTIMES:
            graph = vocab_parallel_graph(fused_activation_graph(graph), lay.tp)
        hold_state_as(graph, STATE_RUNTIMES.get(runtime_name(p.runtime), "tag"))
        costs = CostModel.for_topology(graph, topo, numerics=Numerics(matmul_tf32=p.matmul_tf32),
                                       runtime="eager" if p.runtime in EAGER_RUNTIMES else "megatron")
        plan = layout_plan(graph, topo, lay, costs)
        if lay.vocab:
            vocab_parallel_plan(graph, plan, lay.tp)
        sim = Simulator(graph, topo, costs, blocking_sends=runtime_name(p.runtime) in BLOCKING_SEND_RUNTIMES)
        res = sim.run(plan.groups, pipeline=plan.pipeline)
    except TagError as e:
        return Row(p, None, False, None, str(e).splitlines()[0])
    peak = max(res.peak_memory_bytes) / 2**30
    return Row(p, float(res.iteration_time_s), bool(res.oom), float(peak))


def vocab_parallel_plan(graph, plan, tp: int) -> None:
    """Deploy, in place, ``plan``'s groups outside the Megatron blocks (``Layout.vocab=1``,
    :func:`tag.parallel.layout.outside_blocks`: the embedding, and the final norm, LM head and
    loss) as Megatron-LM runs its vocabulary-parallel embedding and head: tensor parallel of
    degree ``tp``, every rank on its replica's whole micro-batch, ``graph`` costing its ``V / tp``
    rows of the embedding and ``h x V / tp`` logits of the head and their collectives
    (:func:`tag.parallel.layers.vocab_parallel_graph`). On a pipeline the first and last stages
    each hold the tied embedding's shards and all-reduce their gradients
    (:func:`tag.sim.program.tied_weights`)."""
    from tag.parallel.layout import outside_blocks

    for g in sorted(outside_blocks(graph)):
        gp = plan.groups[g]
        n = len(gp.devices)
        plan.groups[g] = replace(gp, shares=[1.0 / n] * n, sync="tp", tp=tp, sequence_parallel=False)


# --------------------------------------------------------------------------------------- scores
def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (ties share their mean rank); NaN below 3 points."""
    if len(a) < 3:
        return float("nan")
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


@dataclass
class GroupScore:
    """Figures of one cluster group (points that ran and were costed)."""

    group: str
    heterogeneous: bool
    sources: list[str]
    points: int
    spearman: float
    median_abs_error: float
    worst_abs_error: float
    best_in_top3: bool | None
    """The measured fastest layout among the simulator's three fastest (None below 4 points)."""
    ran_predicted_oom: int
    failed_predicted_oom: int
    failed: int
    uncosted: int

    def passes(self) -> bool | None:
        """The issue's bar for a group of 8 or more points: Spearman >= 0.8 and the measured best
        in the simulated top 3 (None for smaller groups)."""
        if self.points < 8:
            return None
        return self.spearman >= 0.8 and bool(self.best_in_top3)


def score_group(rows: list[Row]) -> GroupScore:
    """:class:`GroupScore` of one group's rows."""
    ok = [r for r in rows if r.point.ran and r.ratio is not None]
    sim = [r.simulated_s for r in ok]
    meas = [r.point.measured_s for r in ok]
    errs = sorted(abs(r.ratio - 1) for r in ok)
    top3 = None
    if len(ok) >= 4:
        best = min(range(len(ok)), key=lambda i: meas[i])
        top3 = best in sorted(range(len(ok)), key=lambda i: sim[i])[:3]
    failed = [r for r in rows if not r.point.ran]
    return GroupScore(rows[0].point.group, rows[0].point.heterogeneous, sorted({r.point.source for r in rows}), len(ok),
                      spearman(sim, meas), median(errs),
                      errs[-1] if errs else float("nan"), top3, sum(r.oom for r in ok),
                      sum(r.oom for r in failed), len(failed), sum(r.error is not None for r in rows))


def median(xs: list[float]) -> float:
    """:func:`statistics.median`, NaN for no values."""
    return statistics.median(xs) if xs else float("nan")


def score(rows: list[Row]) -> tuple[list[GroupScore], dict]:
    """Per-group scores (in order of first appearance) and the overall figures."""
    by: dict[str, list[Row]] = {}
    for r in rows:
        by.setdefault(r.point.group, []).append(r)
    groups = [score_group(rs) for rs in by.values()]
    ok = [r for r in rows if r.point.ran and r.ratio is not None]
    overall = {
        "points": len(rows), "costed_ran": len(ok), "groups": len(groups),
        "sources": len({r.point.source for r in rows}),
        "heterogeneous_groups": sum(g.heterogeneous for g in groups),
        "median_abs_error": median([abs(r.ratio - 1) for r in ok]),
        "ran_predicted_oom": sum(r.oom for r in ok),
        "groups_passing": sum(bool(g.passes()) for g in groups),
        "groups_scored": sum(g.passes() is not None for g in groups),
    }
    return groups, overall
