"""Hold the simulator to account: execute a set of plans, compare measured and predicted times.

``validate(...)`` builds baselines and varied plans (:func:`validation_plans`), executes each
(:func:`tag.executor.execute`), and reports the median absolute percentage error and the
Spearman rank correlation of prediction vs measurement, with a scatter plot.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..cost.baselines import data_parallel
from ..errors import TagError
from ..io import check_folder, write_json
from ..plan import GroupPlan, PipelinePlan, Plan, group_positions, new_plan
from .launch import ExecuteConfig, execute

log = logging.getLogger(__name__)


def validation_plans(graph, topology, n: int, seed: int = 0) -> list[tuple[str, Plan]]:
    """Up to ``n`` named plans: data-parallel baselines first, then varied placements."""
    D, K = topology.num_devices, graph.num_groups
    all_devs = list(range(D))
    plans: list[tuple[str, Plan]] = [("dp-even", data_parallel(graph, topology))]
    plans.append(("dp-prop", data_parallel(graph, topology, proportional=True)))
    for d in all_devs:
        plans.append((f"single-{d}", new_plan(graph, topology, [GroupPlan([d], [1.0]) for _ in range(K)])))
    if D >= 2:
        uneven = [0.7] + [0.3 / (D - 1)] * (D - 1)
        plans.append(("dp-uneven", new_plan(graph, topology, [GroupPlan(all_devs, uneven) for _ in range(K)])))
        plans.append(("ps-0", new_plan(graph, topology,
                                       [GroupPlan(all_devs, [1 / D] * D, "ps", server=0) for _ in range(K)])))
        # inter-op model parallel: consecutive groups on consecutive devices, the whole batch stage
        # after stage (no micro-batches: the devices take turns)
        plans.append(("inter-op", new_plan(graph, topology, [GroupPlan([g * D // K], [1.0]) for g in range(K)])))
        plans += pipeline_plans(graph, topology)
        plans += tensor_parallel_plans(graph, topology)
        plans.append(("mixed", new_plan(graph, topology, [GroupPlan(all_devs, [1 / D] * D) if g % 2 == 0
                                                          else GroupPlan([g % D], [1.0]) for g in range(K)])))
        mp = []
        for g in range(K):
            lo, hi = group_positions(graph, g)
            mp.append(GroupPlan([0, 1], [1.0, 1.0], "mp", mp_splits=[lo, (lo + hi) // 2]) if hi - lo >= 2
                      else GroupPlan([0], [1.0]))
        plans.append(("mp-halves", new_plan(graph, topology, mp)))
    rng = random.Random(seed)
    k = 0
    while len(plans) < n:
        groups = []
        for _g in range(K):
            devs = sorted(rng.sample(all_devs, rng.randint(1, D)))
            w = [rng.uniform(0.3, 1.0) for _ in devs]
            shares = [x / sum(w) for x in w]
            shares[-1] = 1.0 - sum(shares[:-1])
            sync = rng.choice(["allreduce", "ps"]) if len(devs) > 1 else "allreduce"
            groups.append(GroupPlan(devs, shares, sync, server=rng.choice(all_devs) if sync == "ps" else None))
        plans.append((f"random-{k}", new_plan(graph, topology, groups)))
        k += 1
    for name, p in plans:
        p.meta["validation_name"] = name
    return plans[:n]


PIPELINE_MICRO_BATCHES = 4
"""Micro-batches of the validation's pipelined plans."""


def pipeline_plans(graph, topology) -> list[tuple[str, Plan]]:
    """Two pipeline stages (even group cut) on the two halves of the devices (each half data parallel,
    even shares), :data:`PIPELINE_MICRO_BATCHES` micro-batches, 1F1B and GPipe; none where the
    devices do not halve or a replica would get fewer than 2 samples of a micro-batch (transformers
    exported at batch 1 change their graph)."""
    from ..parallel.pipeline import even_stages, micro_ranges

    D, K, M = topology.num_devices, graph.num_groups, PIPELINE_MICRO_BATCHES
    if D < 2 or D % 2 or K < 2 or graph.batch_size < M:
        return []
    half = D // 2
    if min(hi - lo for lo, hi in micro_ranges(graph.batch_size, M)) < 2 * half:
        return []
    cut = even_stages(K, 2)
    stage = [GroupPlan(list(range(s * half, (s + 1) * half)), [1 / half] * half) for s in range(2)]
    out = []
    for schedule in ("1f1b", "gpipe"):
        plan = new_plan(graph, topology, [stage[0] if g < cut[1] else stage[1] for g in range(K)])
        plan.pipeline = PipelinePlan(cut, M, schedule)
        out.append((f"pp2-{schedule}-m{M}", plan))
    return out


def tensor_parallel_plans(graph, topology) -> list[tuple[str, Plan]]:
    """Every op-group tensor parallel over all devices, in groups of ``T`` consecutive devices
    (``D / T`` data-parallel replicas, even shares), for each degree ``T`` a layout may use
    (:func:`tag.parallel.layout.tp_degrees`: dividing every machine's device count and every
    Megatron block's features and heads); plain Megatron, what the executor runs. None for a
    graph without Megatron blocks."""
    from ..parallel.layout import tp_degrees

    D, K = topology.num_devices, graph.num_groups
    out = []
    for t in tp_degrees(graph, topology)[1:]:
        if D % t or D > graph.batch_size:
            continue
        plan = new_plan(graph, topology, [GroupPlan(list(range(D)), [1 / D] * D, "tp", tp=t) for _ in range(K)])
        out.append((f"tp{t}" if t == D else f"dp{D // t}-tp{t}", plan))
    return out


def select_plans(plans: list[tuple[str, Plan]], only: list[str] | None) -> list[tuple[str, Plan]]:
    """The plans whose name is, or starts with, one of ``only`` (``pp2`` selects both pipelines,
    ``tp`` every tensor-parallel plan); all of them when ``only`` is None. A prefix matching none
    is a one-line :class:`~tag.errors.TagError` listing the names."""
    if only is None:
        return plans
    from ..errors import TagError

    if not only:
        raise TagError("--only: expected at least one plan name or prefix")

    names = [name for name, _ in plans]
    for prefix in only:
        if not any(n.startswith(prefix) for n in names):
            raise TagError(f"--only: {prefix!r} names none of the plans {names}; expected a name or its prefix")
    return [(n, p) for n, p in plans if any(n.startswith(x) for x in only)]


@dataclass
class ValidationRow:
    name: str
    predicted_s: float
    measured_s: float
    """Median over the rounds of the per-run median iteration time, seconds."""
    per_rank_s: list[float]
    rounds_s: list[float] = field(default_factory=list)
    """Each round's measured iteration time, seconds (spread = the machine's noise)."""
    predicted_rounds_s: list[float] = field(default_factory=list)
    """Each round's prediction (from that round's own profile), seconds."""

    @property
    def error(self) -> float:
        """Absolute percentage error of the prediction, in percent."""
        return abs(self.predicted_s - self.measured_s) / self.measured_s * 100


@dataclass
class ValidationReport:
    model: str
    topology: str
    rows: list[ValidationRow]
    mape_median_pct: float
    spearman: float
    meta: dict = field(default_factory=dict)
    round_spearman: float = math.nan
    """The measurement's own reproducibility: median over every pair of rounds of the Spearman
    correlation between their measured times (NaN with one round). A simulator cannot rank the
    plans against one round better than another round of the same executions does; on a noisy
    host it says how many rounds a rank correlation needs."""

    def to_dict(self) -> dict:
        d = asdict(self)
        for r, row in zip(d["rows"], self.rows):
            r["error_pct"] = row.error
        return d

    def table(self) -> str:
        from ..topology.table import render_table

        lines = [render_table(["plan", "predicted ms", "measured ms", "error %"],
                              [[r.name, f"{r.predicted_s * 1e3:.2f}", f"{r.measured_s * 1e3:.2f}", f"{r.error:.1f}"]
                               for r in self.rows])]
        lines.append(f"median |error| {self.mape_median_pct:.1f}%   Spearman {self.spearman:.3f}   "
                     f"({len(self.rows)} plans)")
        if math.isfinite(self.round_spearman):
            lines.append(f"round-to-round Spearman of the measurements (median over pairs of rounds) "
                         f"{self.round_spearman:.3f}")
        return "\n".join(lines)


def summarize_rows(model: str, topology: str, rows: list[ValidationRow], meta: dict) -> ValidationReport:
    from scipy.stats import spearmanr

    mape = statistics.median(r.error for r in rows) if rows else math.nan
    rho = float(spearmanr([r.predicted_s for r in rows], [r.measured_s for r in rows]).statistic) \
        if len(rows) >= 3 else math.nan
    n = min((len(r.rounds_s) for r in rows), default=0)
    pairs = [float(spearmanr([r.rounds_s[i] for r in rows], [r.rounds_s[j] for r in rows]).statistic)
             for i in range(n) for j in range(i + 1, n)] if len(rows) >= 3 else []
    return ValidationReport(model, topology, rows, mape, rho, meta,
                            round_spearman=statistics.median(pairs) if pairs else math.nan)


def scatter_plot(report: ValidationReport, path: str | Path) -> None:
    """Predicted vs measured (ms), log-log, with the y = x line and the +-15% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.measured_s * 1e3 for r in report.rows]
    ys = [r.predicted_s * 1e3 for r in report.rows]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.25
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="0.9", label="±15%")
    ax.scatter(xs, ys, zorder=3)
    for r, x, y in zip(report.rows, xs, ys):
        ax.annotate(r.name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured iteration time (ms, median)")
    ax.set_ylabel("simulated iteration time (ms)")
    ax.set_title(f"{report.model} on {report.topology}\nmedian |err| {report.mape_median_pct:.1f}%, "
                 f"Spearman {report.spearman:.2f}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def validate(model: str, topology_path: str, out_dir: str | Path, *, n_plans: int = 12, batch: int | None = None,
             groups: int = 8, optimizer: str = "adam", steps: int = 10, warmup: int = 3, seed: int = 0,
             profile: bool = True, profile_dir: str | Path | None = None, rounds: int = 1,
             log_fn=print, precision: str = "fp32", only: list[str] | None = None) -> ValidationReport:
    """Execute ``n_plans`` plans of ``model`` on ``topology_path``; write JSON + PNG into ``out_dir``.

    ``profile_dir``: the profile database predictions are costed with; default
    ``<out_dir>/profiles``, measured afresh by this call, so prediction and measurement come
    from the same machine in the same state (a CPU profile from another machine, or from this
    one under another load, says nothing about this run). ``profile``: measure op-group and
    communication costs first where ``profile_dir`` has none for this graph and device type (the
    simulator otherwise falls back to the datasheet roofline). ``rounds``: executions of every
    plan, interleaved (the median is reported). With several rounds and no ``profile_dir``, every
    round first profiles the graph and gloo afresh into ``<out_dir>/profiles/round-<r>`` and
    predicts its executions from that: this VM's speed drifts by 20-30% over minutes, and a
    profile taken once at the start says little about executions ten minutes later. (Links too:
    four gloo profiles taken within minutes priced vgg's 2.6 MiB all-reduce at 1.61 to 2.06 ms,
    which moves every synchronising plan alike against the single-device ones.) Each round runs
    the plans in its own shuffled order (seeded), so no plan always runs at the same point of a
    drift. ``only``: run the plans of :func:`validation_plans` (``n_plans`` of them) whose names
    start with one of these (:func:`select_plans`).
    """
    if rounds < 1:
        raise ValueError(f"rounds: expected a positive integer, got {rounds}")
    from ..graph import capture
    from ..topology import load_topology
    from ..workloads import load_workload

    out = Path(out_dir)
    check_folder(out, TagError, "--out")
    out.mkdir(parents=True, exist_ok=True)
    topology = load_topology(topology_path)
    cap = capture(load_workload(model, batch=batch), optimizer=optimizer, num_groups=groups, precision=precision)
    graph = cap.graph
    root = Path(profile_dir) if profile_dir is not None else out / "profiles"
    per_round = profile and profile_dir is None and rounds > 1
    # validate's own database (no --profile-dir) is measured by this call, replacing whatever an
    # earlier run into the same folder left there; a given database is only completed
    fresh = profile_dir is None
    if profile and not per_round:
        ensure_profiles(model, cap, topology, log_fn, root, fresh=fresh)
    plans = select_plans(validation_plans(graph, topology, n_plans, seed), only)
    for name, plan in plans:
        plan_path = out / "plans" / f"{name}.json"
        plan_path.parent.mkdir(parents=True, exist_ok=True)
        plan.save(plan_path)
    # Round-robin over the plans, ``rounds`` times: a shared machine's speed drifts over minutes,
    # and interleaving gives every plan the same share of fast and slow periods (the median of
    # its rounds is reported; every round's figure is kept in the row).
    measured: dict[str, list] = {name: [] for name, _ in plans}
    predicted: dict[str, list[float]] = {name: [] for name, _ in plans}
    for r in range(rounds):
        proot = _profile_root(root, r, per_round)
        if per_round:  # stages and links: one profile's noise would shift every plan of its kind alike
            log_fn(f"round {r + 1}/{rounds}: profiling afresh")
            ensure_profiles(model, cap, topology, log_fn, proot, fresh=True)
        order = list(plans)
        if rounds > 1:
            random.Random(seed + r).shuffle(order)
        for name, _plan in order:
            run_dir = _run_dir(out, name, r, rounds)
            cfg = ExecuteConfig(model=model, topology=topology_path, plan=str(out / "plans" / f"{name}.json"),
                                batch=graph.batch_size, optimizer=optimizer, groups=groups, steps=steps,
                                warmup=warmup, run_dir=str(run_dir), profile_dir=str(proot), precision=precision)
            res = execute(cfg, graph=graph)
            write_json(run_dir / "result.json", res.to_dict())
            predicted[name].append(float(res.predicted_iteration_time_s or math.nan))
            measured[name].append((res.measured_iteration_time_s, res.per_rank_median_s))
            log_fn(f"  {name:<12} predicted {predicted[name][-1] * 1e3:8.2f} ms  measured "
                   f"{res.measured_iteration_time_s * 1e3:8.2f} ms" + (f"  (round {r + 1}/{rounds})" if rounds > 1 else ""))
    rows = []
    for name, _plan in plans:
        ms = measured[name]
        med = statistics.median(m for m, _ in ms)
        per_rank = [statistics.median(ranks_s[i] for _, ranks_s in ms) for i in range(len(ms[0][1]))]
        rows.append(ValidationRow(name, statistics.median(predicted[name]), med, per_rank,
                                  rounds_s=[m for m, _ in ms], predicted_rounds_s=predicted[name]))
    meta = {"batch": graph.batch_size, "groups": graph.num_groups, "only": only, "optimizer": optimizer, "steps": steps,
            "warmup": warmup, "rounds": rounds, "graph_signature": graph.signature(), "profile_dir": str(root),
            "profile_per_round": per_round}
    report = summarize_rows(model, topology.name, rows, meta)
    write_json(out / "validation.json", report.to_dict())
    scatter_plot(report, out / "scatter.png")
    return report


def _run_dir(out: Path, name: str, r: int, rounds: int) -> Path:
    """Where execution round ``r`` of plan ``name`` keeps its files."""
    return out / "runs" / name / (f"round-{r}" if rounds > 1 else "")


def _profile_root(root: Path, r: int, per_round: bool) -> Path:
    """The profile database round ``r`` is costed with."""
    return root / f"round-{r}" if per_round else root


def repredict(out_dir: str | Path, log_fn=print) -> ValidationReport:
    """Re-cost a finished validation with the current simulator: every execution's prediction is
    recomputed from its stored plan, graph, topology and its round's profile database (the
    measurements are kept as they are); ``validation.json`` and the plot are rewritten. For a
    change of the cost model or simulator, without executing anything again."""
    import json

    from ..graph.ir import OpGraph
    from ..plan import Plan
    from ..topology import load_topology
    from .launch import _predict

    out = Path(out_dir)
    old = json.loads((out / "validation.json").read_text())
    meta = old["meta"]
    per_round = bool(meta.get("profile_per_round"))
    rows = []
    for row in old["rows"]:
        name, rounds = row["name"], len(row["rounds_s"])
        plan = Plan.load(out / "plans" / f"{name}.json")
        preds = []
        for r in range(rounds):
            run_dir = _run_dir(out, name, r, rounds)
            graph = OpGraph.from_json((run_dir / "graph.json").read_text())
            topology = load_topology(str(run_dir / "topology.json"))
            root = _profile_root(Path(meta["profile_dir"]), r, per_round)
            if not root.is_dir():  # the folder moved with the results: use the copy beside them
                root = _profile_root(out / "profiles", r, per_round)
            preds.append(float(_predict(graph, topology, plan, False, str(root)).iteration_time_s))
        log_fn(f"  {name:<12} predicted {statistics.median(row['predicted_rounds_s'] or [row['predicted_s']]) * 1e3:8.2f}"
               f" -> {statistics.median(preds) * 1e3:8.2f} ms  measured {row['measured_s'] * 1e3:8.2f} ms")
        rows.append(ValidationRow(name, statistics.median(preds), row["measured_s"], row["per_rank_s"],
                                  rounds_s=row["rounds_s"], predicted_rounds_s=preds))
    report = summarize_rows(old["model"], old["topology"], rows, {**meta, "repredicted": True})
    write_json(out / "validation.json", report.to_dict())
    scatter_plot(report, out / "scatter.png")
    return report


PROFILE_REPEATS = 25
"""Timed repeats per batch size of a validation's own profile (round-robin over the batches: the
medians must hold against the host's swings in speed, which the executions see too)."""


def ensure_profiles(model: str, cap, topology, log_fn, root: Path, fresh: bool = False) -> None:
    """Profile this graph (and gloo communication) into ``root`` for the topology's CPU device
    types where missing; with ``fresh``, also where ``root`` holds them already (they are replaced).

    A validation's own database must be ``fresh``: on 2026-11-26 a three-round run into a folder
    an earlier run had used costed its first two rounds with stage profiles measured an hour
    before under load 8.5 (1.38x the stage times of its own third round, which it did measure),
    and missed both targets (evaluation/results/validate-tp-local-cpu2/README.md at ee4430b)."""
    from ..cost.comm import find_comm_profile
    from ..cost.model import device_type
    from ..cost.profile import profile_files

    sig = cap.graph.signature()
    for dt in sorted({device_type(topology, d) for d in range(topology.num_devices)}):
        if not dt.startswith("cpu-"):
            continue
        threads = int(dt[4:-1])
        stale = profile_files(root, dt, sig)
        if fresh or not stale:
            import torch

            from ..cost.profiler import profile_model

            for path in stale:  # (Profile.save would merge their batch sizes into the new one)
                path.unlink()
            before = torch.get_num_threads()
            log_fn(f"profiling {cap.graph.model} on {dt} " + (f"afresh (replacing {stale[0]})" if stale else
                                                              "(no profile yet)") + " ...")
            try:
                profile_model(model, batch=cap.graph.batch_size, optimizer=cap.graph.optimizer,
                              num_groups=cap.graph.num_groups, threads=threads, captured=cap,
                              repeats=PROFILE_REPEATS, log=log_fn).save(root)
            finally:
                torch.set_num_threads(before)
        if fresh or find_comm_profile(root, dt) is None:
            from .commprof import profile_comm

            log_fn(f"profiling gloo communication for {dt} ...")  # (save replaces comm.json)
            profile_comm(dt, backend="gloo", threads=threads).save(root)
