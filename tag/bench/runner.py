"""``tag bench``: every method on the same simulator, models, topologies, seeds and budgets.

Each (model, topology, method) cell records the predicted iteration time, the speedup over data
parallel with even shares, the ratio to the ideal lower bound, out-of-memory, search wall time and
playouts. On the suite's local CPU topologies the plans are also executed for real.

Cells run in this process, in a local process pool or as Ray tasks (:mod:`tag.dispatch`) and are
appended to ``cells.jsonl`` as they finish; a rerun with the same ``--out`` skips the cells already
there, so a killed benchmark resumes (under any of them). Graphs come from the graph cache
(:func:`tag.planner.model_graph`), so a resumed run does not capture again (minutes for a
real-size model).
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..dispatch import Backend, progress_log, run_tasks
from ..errors import TagError
from ..io import check_folder, write_atomic, write_json
from ..parallel import execution_refusal
from .suites import SuiteConfig


@dataclass
class Cell:
    """One benchmark result."""

    model: str
    topology: str
    method: str
    predicted_time_s: float
    """Simulated iteration time (seconds); inf when no plan."""
    oom: bool
    speedup_vs_dp: float
    """dp's predicted time / this method's (higher is better)."""
    ratio_to_lower_bound: float
    """This method's predicted time / the ideal lower bound (>= 1, lower is better)."""
    search_time_s: float
    """Wall time spent producing the plan (seconds)."""
    playouts: int
    """Simulator calls spent by the search (0 for fixed baselines)."""
    executed_time_s: float | None = None
    """Measured median iteration time when executed for real (seconds), else None."""
    note: str = ""

    def key(self) -> tuple[str, str, str]:
        return (self.model, self.topology, self.method)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def case_graph(model, cfg: SuiteConfig, graph_cache: dict):
    """``model``'s graph at the suite's precision, from ``graph_cache`` or captured into it."""
    from ..planner import model_graph

    key = (model.spec, model.batch, cfg.precision)
    if key not in graph_cache:
        _progress(f"{cfg.name} {model.spec} b{model.batch} {cfg.precision}: capturing")
        graph, secs, hit = model_graph(model.spec, model.batch, precision=cfg.precision, seed=cfg.seed,
                                       num_groups=cfg.groups)
        _progress(f"{cfg.name} {model.spec}: {len(graph.ops)} ops, {secs:.1f} s{' (graph cache)' if hit else ''}")
        graph_cache[key] = graph
    return graph_cache[key]


class _Case:
    """One (model, topology): captured graph, simulator and the two reference times."""

    def __init__(self, model, topology, cfg: SuiteConfig, graph_cache: dict, predictor=None):
        """``topology``: a name or a loaded topology; ``graph_cache``: ``{(spec, batch,
        precision): graph}``, filled by :func:`case_graph` where the model is missing;
        ``predictor``: the tag-* methods' (default: the shipped one)."""
        from ..cost import CostModel
        from ..cost.baselines import data_parallel
        from ..sim import Simulator, lower_bound
        from ..topology import load_topology

        self.graph = case_graph(model, cfg, graph_cache)
        self.topology = load_topology(topology) if isinstance(topology, str) else topology
        self.predictor = predictor
        self.costs = CostModel.for_topology(self.graph, self.topology)
        self.sim = Simulator(self.graph, self.topology, self.costs)
        self.lower_bound = lower_bound(self.graph, self.topology, self.costs)
        self.dp_time = self.sim.run(data_parallel(self.graph, self.topology).groups).iteration_time_s
        self.executed: dict[tuple, tuple[float | None, str]] = {}
        """Measured time per distinct plan (many methods find the same plan: run it once)."""

    def simulate(self, plan):
        """:class:`~tag.sim.SimResult` of ``plan`` (its pipeline, if any, included)."""
        return self.sim.run(plan.groups, pipeline=plan.pipeline)

    def make_plan(self, method: str, cfg: SuiteConfig):
        """(plan, playouts) for ``method``."""
        from ..cost import baselines

        g, topo = self.graph, self.topology
        if method in baselines.BASELINES:
            return baselines.baseline_plan(method, g, topo, self.costs), 0
        if method == "dp-tp-pp-grid":
            from ..parallel.layout import best_layout
            from ..sim.bounds import layout_bounds

            # branch and bound: the full grid's best layout; "playouts": the layouts simulated
            return best_layout(g, topo, self.costs, self.simulate, bounds=layout_bounds(self.sim))
        from ..planner import PlannerConfig, find_plan

        if method in ("random", "sa", "tpe", "mcts-uniform"):
            searcher = "mcts" if method == "mcts-uniform" else method
            search = PlannerConfig(searcher=searcher, prior="uniform", budget=cfg.search_budget, seed=cfg.seed,
                                   compression="off", pipelines="off")
            # the searchers over TAG's space; TAG's method adds pp/tp
            p = find_plan(g, topo, search, costs=self.costs, simulator=self.sim)
        else:  # tag-50, tag-200, with or without +sfb
            budget = int(method.split("-")[1].split("+")[0])
            # executable=False: the simulated plans the benchmark's claims were made on (pipelines
            # and tp unconstrained); a plan the executor refuses says so in the cell's note
            search = PlannerConfig(searcher="mcts", prior="gnn", budget=budget, seed=cfg.seed, executable=False,
                                   compression="auto" if method.endswith("+sfb") else "off")
            p = find_plan(g, topo, search, predictor=self.predictor, costs=self.costs, simulator=self.sim)
        return p, int(p.meta.get("playouts", 0))


def run_suite(cfg: SuiteConfig, out: Path, backend: Backend | None = None) -> tuple[list[Cell], int]:
    """Run (or resume) every cell of ``cfg`` on ``backend`` (default: one after the other in this
    process); results go under ``out``. Returns the cells, in the suite's order, and how many of
    them were read back from ``out/cells.jsonl`` (an earlier run's) rather than run.

    The graphs are captured here (graph cache); each worker gets them, the topologies and the
    predictor once and builds a model's simulator once per topology for the cells it runs."""
    check_folder(out, TagError, "--out")
    out.mkdir(parents=True, exist_ok=True)
    log = out / "cells.jsonl"
    done: dict[tuple, Cell] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            if line.strip():
                c = Cell(**json.loads(line))
                done[c.key()] = c
    write_json(out / "config.json", {"suite": asdict(cfg), "environment": environment()})
    keys = [(m, t, method) for m in cfg.models for t in cfg.topologies + cfg.execute_topologies
            for method in cfg.methods]
    todo = [k for k in keys if (k[0].spec, k[1], k[2]) not in done]
    resumed = len(keys) - len(todo)
    shared = _shared(cfg, todo)
    t_start = time.perf_counter()
    n = resumed
    for res in run_tasks(cell_task, todo, setup=cell_setup, shared=shared,
                         backend=backend or Backend(), desc=f"bench {cfg.name}", progress=False,
                         log=progress_log(out / "log.jsonl"), done_before=resumed,
                         total=len(keys)):
        model, topo_name, method = res.item
        n += 1
        if res.error is not None:  # its worker lost (more than Ray's retries): run by the next run
            _progress(f"[{n}/{len(keys)}] {model.spec} on {topo_name}: {method}: not run: {res.error}")
            continue
        cell = Cell(**res.result)
        done[cell.key()] = cell
        with log.open("a") as f:  # one line per finished cell: resumable
            f.write(json.dumps(asdict(cell)) + "\n")
        _progress(f"[{n}/{len(keys)} {time.perf_counter() - t_start:6.0f}s] {model.spec} on {topo_name}: "
                  f"{method:12s} {cell.predicted_time_s * 1e3:9.2f} ms  x{cell.speedup_vs_dp:.2f} vs dp"
                  f"{'  OOM' if cell.oom else ''}")
    cells = [done[(m.spec, t, method)] for m, t, method in keys if (m.spec, t, method) in done]
    return cells, resumed


def _shared(cfg: SuiteConfig, todo: list[tuple]) -> dict:
    """What every worker needs once: the suite, the graphs and topologies of the cells ``todo``,
    the predictor of the tag-* methods."""
    from ..topology import load_topology

    graphs: dict = {}
    for model in dict.fromkeys(m for m, _, _ in todo):
        case_graph(model, cfg, graphs)
    topologies = {t: load_topology(t) for t in dict.fromkeys(t for _, t, _ in todo)}
    predictor = None
    if any(method.startswith("tag-") for _, _, method in todo):
        from ..gnn.predictor import Predictor
        predictor = Predictor.load()
    return {"cfg": cfg, "graphs": graphs, "topologies": topologies, "predictor": predictor}


def cell_setup(shared: dict) -> dict:
    """A benchmark worker's context: the shared data and its cases (one per model and topology)."""
    return {**shared, "cases": {}}


def cell_task(ctx: dict, key: tuple) -> dict:
    """Run cell ``(model, topology name, method)``; the :class:`Cell` as a dict."""
    model, topo_name, method = key
    case_key = (model.spec, model.batch, topo_name)
    if case_key not in ctx["cases"]:
        ctx["cases"].clear()  # the cells of a case come one after the other: keep one case's simulator
        ctx["cases"][case_key] = _Case(model, ctx["topologies"][topo_name], ctx["cfg"], ctx["graphs"],
                                       ctx["predictor"])
    return asdict(_run_cell(ctx["cases"][case_key], model, topo_name, method, ctx["cfg"]))


def _run_cell(case: _Case, model, topo_name: str, method: str, cfg: SuiteConfig) -> Cell:
    if method == "lower-bound":
        lb = case.lower_bound
        return Cell(model.spec, topo_name, method, lb, False, case.dp_time / lb, 1.0, 0.0, 0)
    t0 = time.perf_counter()
    plan, playouts = case.make_plan(method, cfg)
    search_s = time.perf_counter() - t0
    res = case.simulate(plan)
    t = res.iteration_time_s
    cell = Cell(model.spec, topo_name, method, t, bool(res.oom), case.dp_time / t if t > 0 else 0.0,
                t / case.lower_bound if case.lower_bound > 0 else math.inf, search_s, playouts,
                note=plan.meta.get("prior_note") or "")  # e.g. the gnn prior skipped on 512 GPUs
    # every cell says when tag execute would refuse its plan (tag-* search executable=False: e.g.
    # recomputation of groups with dropout, tp beside other groups): simulated only
    refusal = execution_refusal(plan)
    if refusal is not None:
        where = "not executed" if topo_name in cfg.execute_topologies else "simulated only"
        cell.note = "; ".join(filter(None, [cell.note, f"{where}: {refusal}"]))
    elif topo_name in cfg.execute_topologies and not res.oom:
        pp = plan.pipeline
        key = (tuple(g.key() for g in plan.groups),
               None if pp is None else (tuple(pp.stages), pp.micro_batches, pp.schedule, pp.k))
        if key not in case.executed:
            case.executed[key] = _execute(model, topo_name, plan, cfg)
        cell.executed_time_s, cell.note = case.executed[key]
    return cell


def _execute(model, topo_name: str, plan, cfg: SuiteConfig) -> tuple[float | None, str]:
    """Run ``plan`` for real on the local CPU topology; (median seconds, note)."""
    import tempfile

    from ..executor import ExecuteConfig, execute

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "plan.json"
        plan.save(path)
        try:
            r = execute(ExecuteConfig(model=model.spec, topology=topo_name, plan=str(path), batch=model.batch,
                                      seed=cfg.seed, groups=cfg.groups, steps=cfg.execute_steps, warmup=1,
                                      run_dir=str(Path(d) / "run")))
        except Exception as e:  # noqa: BLE001 - a failed run is a result to report, not a crash
            return None, f"execution failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return float(r.measured_iteration_time_s), ""


def environment() -> dict:
    """Library versions and machine facts for the report."""
    import numpy
    import scipy
    import torch
    import torch_geometric

    from .. import __version__

    return {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
            "torch_geometric": torch_geometric.__version__, "numpy": numpy.__version__, "scipy": scipy.__version__,
            "tag": __version__, "cpus": __import__("os").cpu_count(), "date": time.strftime("%Y-%m-%d")}


def save_results(cells: list[Cell], out: Path) -> None:
    """``results.json`` and ``results.csv`` (atomic)."""
    import csv
    import io

    rows = [asdict(c) for c in cells]
    write_json(out / "results.json", rows)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["model"])
    w.writeheader()
    w.writerows(rows)
    write_atomic(out / "results.csv", buf.getvalue())
