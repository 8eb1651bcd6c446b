"""What pipelines add to TAG's action space: speedup over even data parallel with and without them.

Per (model, topology): even data parallel; TAG (GNN-guided MCTS, 50 playouts) over its per-group
actions only (``pipelines="off"``); the by-hand layout grid alone (``dp-tp-pp-grid``: data x pipeline
degrees, balanced stages, 1F1B); TAG over the space with tensor-parallel actions and the
plan-level pipeline decisions (``pipelines="auto"``, :mod:`tag.search.space`), GNN-guided and with
the uniform prior, 50 playouts each; and the compute lower bound.

    PYTHONPATH=. python -m evaluation.pipeline_gain [--models ...] [--topologies ...] [--precision bf16]

writes ``evaluation/results/pipeline-gain/{results.json,README.md,speedup.png}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from evaluation.report import header_lines, machine_line

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "evaluation" / "results" / "pipeline-gain"
MODELS = [("gpt2:n_layer=24,n_embd=1024,n_head=16,seq=1024", 32),   # GPT-2 medium (355M)
          ("gpt2:n_layer=36,n_embd=1280,n_head=20,seq=1024", 32),   # GPT-2 large (774M)
          ("bert:n_layer=24,n_embd=1024,n_head=16,seq=512", 32)]    # BERT-large (335M)
TOPOLOGIES = ["tag-testbed", "mixed-a100-v100", "cloud-t4"]
METHODS = ["dp", "tag-50", "dp-tp-pp-grid", "tag-50+pipelines", "uniform-50+pipelines", "lower-bound"]


def describe(plan) -> str:
    """The plan in a few words: the grid's layout (and the GPU kinds a sub-cluster's layout leaves
    idle) where the layout grid gave it, else the searched plan's first action or pipeline."""
    m = plan.meta
    if m.get("source") == "layout-grid":
        return m["layout"] + (f", {m['idle_kinds']} idle" if m.get("idle_kinds") else "")
    return (m.get("actions") or ["dp"])[0]


def cell(graph, topo, costs, sim, predictor) -> dict:
    """Every method's simulated iteration time (seconds; None: out of memory) on one pair."""
    from dataclasses import replace

    from tag.cost.baselines import data_parallel
    from tag.parallel.layout import best_layout
    from tag.planner import PlannerConfig, find_plan
    from tag.sim import lower_bound

    def t(plan):
        r = sim.run(plan.groups, pipeline=plan.pipeline)
        return None if r.oom else r.iteration_time_s

    out: dict = {}
    t0 = time.perf_counter()
    out["dp"] = t(data_parallel(graph, topo))
    kw = dict(costs=costs, simulator=sim, predictor=predictor)
    cfg = PlannerConfig(prior="gnn", budget=50, seed=0, compression="off")
    p = find_plan(graph, topo, replace(cfg, pipelines="off"), **kw)
    out["tag-50"] = p.predicted_iteration_time_s
    lay, tried = best_layout(graph, topo, costs, lambda q: sim.run(q.groups, pipeline=q.pipeline))
    out["dp-tp-pp-grid"] = lay.predicted_iteration_time_s
    out["grid_layout"] = lay.meta["layout"]
    q = find_plan(graph, topo, replace(cfg, executable=False), **kw)  # as recorded: simulated plans
    out["tag-50+pipelines"] = q.predicted_iteration_time_s
    out["tag_source"] = q.meta["source"]
    out["tag_plan"] = describe(q)
    u = find_plan(graph, topo, replace(cfg, executable=False, prior="uniform"), **{**kw, "predictor": None})
    out["uniform-50+pipelines"] = u.predicted_iteration_time_s
    out["uniform_plan"] = describe(u)
    out["lower-bound"] = lower_bound(graph, topo, costs)
    out["seconds"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=None, help="spec@batch (default: MODELS)")
    ap.add_argument("--topologies", nargs="*", default=TOPOLOGIES)
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--checkpoint", default=None, help="predictor checkpoint (default: the shipped one)")
    a = ap.parse_args(argv)
    from tag.cost.model import CostModel
    from tag.gnn.predictor import Predictor
    from tag.planner import model_graph
    from tag.sim import Simulator
    from tag.topology import load_topology

    models = MODELS if a.models is None else [(m.rsplit("@", 1)[0], int(m.rsplit("@", 1)[1])) for m in a.models]
    pred = Predictor.load(a.checkpoint)
    rows = []
    for spec, batch in models:
        t0 = time.perf_counter()
        graph = model_graph(spec, batch, precision=a.precision, num_groups=a.groups)[0]  # graph cache, folded
        print(f"{spec} b{batch} {a.precision}: captured in {time.perf_counter() - t0:.0f} s", flush=True)
        for name in a.topologies:
            topo = load_topology(name)
            costs = CostModel.for_topology(graph, topo)
            r = cell(graph, topo, costs, Simulator(graph, topo, costs), pred)
            rows.append({"model": spec, "batch": batch, "precision": a.precision, "topology": name, **r})
            print(json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from tag.io import write_json

    command = "PYTHONPATH=. python -m evaluation.pipeline_gain " + " ".join(argv if argv is not None else sys.argv[1:])
    write_json(out / "results.json", {"command": command, "rows": rows})
    write_report(rows, out, command)
    return 0


def _speedup(r: dict, m: str) -> float | None:
    return r["dp"] / r[m] if r.get("dp") and r.get(m) else None


def _short(spec: str) -> str:
    """``gpt2:n_layer=24,...`` -> ``gpt2-24L``; a zoo preset (``gpt2-medium``) as it is."""
    return f"{spec.split(':')[0]}-{spec.split('n_layer=')[1].split(',')[0]}L" if "n_layer=" in spec else spec


def write_report(rows: list[dict], out: Path, command: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def cell(r: dict, m: str) -> str:
        t = r.get(m)
        if not t:
            return "OOM"
        sp = _speedup(r, m)
        return f"{t * 1e3:.1f}" + (f" ({sp:.2f}x)" if sp else "")

    lines = ["# Pipelines in TAG's action space", "", *header_lines(command, machine_line()), "",
             "Simulated iteration time in ms (speedup over even data parallel when that fits): `tag-50`: "
             "GNN-guided MCTS, 50 playouts, over TAG's per-group actions; `grid`: the best by-hand dp x pp layout "
             "(`dp-tp-pp-grid`); `tag-50+pipelines` / `uniform-50+pipelines`: MCTS (GNN prior / uniform prior, "
             "50 playouts) over the space with tensor-parallel actions and pipeline decisions "
             "(`PlannerConfig(pipelines='auto')`), with the plan's first action or layout (a layout of the grid on a sub-cluster: the GPU kinds it leaves idle); last column: the "
             "GNN-guided plan over the compute lower bound. "
             "OOM: every plan of the method runs out of memory.", "",
             "| model | topology | dp | tag-50 | grid (layout) | tag-50+pipelines (plan) | uniform-50+pipelines (plan) "
             "| x lower bound |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        best = r["tag-50+pipelines"]
        lb = f"{best / r['lower-bound']:.2f}" if best else "-"
        lines.append(f"| {r['model']} | {r['topology']} | {cell(r, 'dp')} | {cell(r, 'tag-50')} | "
                     f"{cell(r, 'dp-tp-pp-grid')} ({r['grid_layout']}) | {cell(r, 'tag-50+pipelines')} "
                     f"({r['tag_plan']}) | {cell(r, 'uniform-50+pipelines')} ({r['uniform_plan']}) | {lb} |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    width = 0.2
    shown = ["tag-50", "dp-tp-pp-grid", "tag-50+pipelines", "uniform-50+pipelines"]
    for k, m in enumerate(shown):
        # iteration time relative to the fastest method of the cell (1 = best; 0 = out of memory)
        ax.bar([i + (k - 1.5) * width for i in range(len(rows))],
               [min((r[x] for x in shown if r.get(x)), default=0) / r[m] if r.get(m) else 0
                for r in rows], width, label=m)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{_short(r['model'])}\n{r['topology']}" for r in rows], fontsize=7)
    ax.set_ylabel("speed relative to the best (0: out of memory)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
