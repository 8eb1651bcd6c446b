"""`tag plan` over TAG's action space against the space with tensor-parallel actions and pipeline
decisions, and against the by-hand layout grid, on one model over several topologies.

Per topology: MCTS with the uniform prior over TAG's per-group actions (``pipelines="off"``), over
the new space (``pipelines="auto"``) at 50 and 200 playouts, GNN-guided at 50, and the best
``dp-tp-pp-grid`` layout (``pipelines="grid"``, one playout). Every plan is checked with
``validate_plan``; the simulated iteration times are deterministic, the wall seconds depend on the
machine's load.

    PYTHONPATH=. python -m evaluation.plan_space --model gpt2-medium --topologies cloud-t4 mixed-a100-v100

writes ``evaluation/results/pipeline-gain/plan-space-<model>.{json,md}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "evaluation" / "results" / "pipeline-gain-search"
RUNS = {
    "tag-space uniform@50": dict(prior="uniform", budget=50, pipelines="off"),
    "new-space uniform@50": dict(prior="uniform", budget=50),
    "new-space uniform@200": dict(prior="uniform", budget=200),
    "new-space gnn@50": dict(prior="gnn", budget=50),
    "grid": dict(prior="uniform", budget=1, pipelines="grid"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--groups", type=int, default=48)
    ap.add_argument("--topologies", nargs="*", default=["cloud-t4", "mixed-a100-v100", "tag-testbed",
                                                         "homogeneous-2x4-v100"])
    ap.add_argument("--checkpoint", default=None, help="predictor checkpoint (default: the shipped one)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    from tag.io import write_atomic, write_json
    from tag.parallel import execution_refusal, validate_plan
    from tag.planner import PlannerConfig, find_plan, model_graph
    from tag.topology import load_topology

    graph = model_graph(a.model, a.batch, precision=a.precision, num_groups=a.groups)[0]
    rows = []
    for name in a.topologies:
        topo = load_topology(name)
        for run, kw in RUNS.items():
            t0 = time.perf_counter()
            # executable=False: the space as recorded; the "executed" column says which plans run
            cfg = PlannerConfig(compression="off", checkpoint=a.checkpoint, executable=False, **kw)
            p = find_plan(graph, topo, cfg)
            wall = time.perf_counter() - t0
            validate_plan(p, graph, topo, pipelines=True, tensor_parallel=True)
            m = p.meta
            rows.append({"topology": name, "run": run, "time_s": p.predicted_iteration_time_s, "wall_s": wall,
                         "plan": m.get("layout") if m["source"] == "layout-grid" else (m["actions"] or [None])[0],
                         "source": m["source"], "executed": execution_refusal(p) is None,
                         "dp_even_s": m["dp_even_time_s"], "dp_prop_s": m["dp_prop_time_s"],
                         "lower_bound_s": m["lower_bound_s"], "space": m.get("space")})
            print(rows[-1], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "PYTHONPATH=. python -m evaluation.plan_space " + " ".join(argv if argv is not None else sys.argv[1:])
    stem = f"plan-space-{a.model.replace(':', '_')}"
    write_json(out / f"{stem}.json", {"command": command, "rows": rows})

    def ms(t):
        return "OOM" if t is None else f"{t * 1e3:.1f}"

    lines = [f"# `tag plan` on {a.model} ({a.precision}, batch {a.batch}, {a.groups} op-groups)", "",
             f"Command: `{command}`", "",
             "Simulated iteration time (ms); OOM: the plan returned does not fit (every plan tried ran out of "
             "memory); wall: seconds of `find_plan` on this machine (load-dependent); executed: `tag execute` "
             "runs the plan (a pipeline of tensor-parallel stages is simulated only).", "",
             "| topology | run | iteration ms | plan (first action or layout) | wall s | executed | x lower bound |",
             "|---|---|---:|---|---:|---|---:|"]
    for r in rows:
        lb = f"{r['time_s'] / r['lower_bound_s']:.2f}" if r["time_s"] else "-"
        lines.append(f"| {r['topology']} | {r['run']} | {ms(r['time_s'])} | {r['plan'] or 'data parallel'} | "
                     f"{r['wall_s']:.1f} | {'yes' if r['executed'] else 'no'} | {lb} |")
    write_atomic(out / f"{stem}.md", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
