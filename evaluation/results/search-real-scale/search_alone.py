"""The plan search alone (no layout grid, no compression) on real-size bf16 models where memory
binds, GNN-MCTS @200 and uniform MCTS @2000, against the layout grid's best (2026-11-27).

    PYTHONPATH=. HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python evaluation/results/search-real-scale/search_alone.py

Prints one row per (model, topology, searcher): the simulated iteration (ms; "no fit": every plan
the search simulated runs out of memory), the plan, and the wall seconds.
"""

import time

from tag.planner import find_plan, model_graph
from tag.topology import load_topology

CELLS = [("llama-7b", 64, t) for t in ("mixed-a100-v100", "cluster-16gpu-4m", "hetero-64gpu")] + \
        [("gpt2-xl", 64, t) for t in ("tag-testbed", "cloud-t4")]

for model, batch, t in CELLS:
    g = model_graph(model, batch, precision="bf16")[0]
    topo = load_topology(f"topologies/{t}.yaml")
    for prior, budget, grid in [("gnn", 200, False), ("uniform", 2000, False), ("gnn", 200, True)]:
        t0 = time.perf_counter()
        p = find_plan(g, topo, seed=0, budget=budget, prior=prior, layout_grid=grid, compression="off")
        ts = p.predicted_iteration_time_s
        what = p.meta.get("layout") or (p.meta["actions"][0] if p.meta["actions"] and len(p.meta["actions"]) == 1 else
                                        p.meta["source"])
        name = "grid" if grid else f"{prior} @{budget}"
        print(f"| {model} | {t} | {name} | {'no fit' if ts is None else f'{ts * 1e3:.1f}'} | {what} | "
              f"{time.perf_counter() - t0:.0f} |", flush=True)
