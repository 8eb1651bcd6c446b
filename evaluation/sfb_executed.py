"""SFB for real: execute a data-parallel plan with and without Sufficient Factor Broadcasting.

    .venv/bin/python -m evaluation.sfb_executed [--model SPEC] [--batch B] [--topology local-cpu2]

Writes ``evaluation/results/sfb-sweep/executed.{md,json}``: per plan, the simulated and the
measured median iteration time (gloo ranks on this machine). Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tag.cost.baselines import data_parallel
    from tag.executor import ExecuteConfig, execute
    from tag.graph import capture
    from tag.io import write_atomic, write_json
    from tag.parallel import apply_sfb
    from tag.sim import simulate
    from tag.topology import load_topology
    from tag.workloads import load_workload

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp:hidden=2048,layers=3,in_dim=512,classes=100")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--topology", default="local-cpu2")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=str(ROOT / "evaluation" / "results" / "sfb-sweep"))
    args = p.parse_args(argv)

    topo = load_topology(args.topology)
    graph = capture(load_workload(args.model, batch=args.batch), num_groups=args.groups).graph
    dp = data_parallel(graph, topo)
    plans = {"dp (all-reduce)": dp, "dp + SFB (MILP)": apply_sfb(graph, topo, dp)}
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, plan in plans.items():
            path = Path(d) / "plan.json"
            plan.save(path)
            sim = simulate(graph, topo, plan).iteration_time_s
            r = execute(ExecuteConfig(model=args.model, topology=args.topology, plan=str(path), batch=args.batch,
                                      groups=args.groups, steps=args.steps, warmup=3, run_dir=str(Path(d) / "run")))
            rows.append({"plan": name, "sfb_ops": sum(len(g.sfb) for g in plan.groups), "simulated_s": sim,
                         "measured_s": r.measured_iteration_time_s, "final_loss": r.losses[-1]})
            print(f"{name:18s} sfb ops {rows[-1]['sfb_ops']:2d}  simulated {sim * 1e3:8.2f} ms  "
                  f"measured {r.measured_iteration_time_s * 1e3:8.2f} ms", flush=True)
    out = Path(args.out)
    write_json(out / "executed.json", {"model": args.model, "batch": args.batch, "topology": args.topology,
                                       "steps": args.steps, "rows": rows})
    lines = [f"# SFB executed on `{args.topology}`", "",
             f"`{args.model}`, global batch {args.batch}, {args.groups} op-groups, even data parallel over "
             f"{topo.num_devices} gloo ranks; median of {args.steps} iterations after 3 warm-up.", "",
             "| plan | SFB ops | simulated ms | measured ms |", "|---|---|---|---|"]
    lines += [f"| {r['plan']} | {r['sfb_ops']} | {r['simulated_s'] * 1e3:.2f} | {r['measured_s'] * 1e3:.2f} |"
              for r in rows]
    write_atomic(out / "executed.md", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
