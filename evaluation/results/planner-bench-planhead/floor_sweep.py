"""GNN-MCTS @50 with the plan head under several ``PLAN_PRIOR_FLOOR`` values, against uniform MCTS
@2000, on the planner benchmark's ``--random`` stream (the first 30 pairs drawn like training
pairs, never labelled: the set the floor was chosen on) and on its 25 small held-out pairs.

    PYTHONPATH=. OMP_NUM_THREADS=1 python evaluation/results/planner-bench-planhead/floor_sweep.py \
        CHECKPOINT runs/predictor/graphs 0.1 0.3 0.5 0.75 0.9 1.0

``RANDOM_PAIRS=100`` (environment) takes the first 100 pairs of the stream instead of 30;
``SETS=random`` skips the held-out pairs. ``REFS=FILE`` computes uniform @2000 on both sets with
the current cost model (cached in FILE, resumable) instead of reading the stored times: after a
change of the costs, the stored times are of another simulator.

Uniform @2000's plans: held-out pairs from ../planner-bench-relabel/final-97c315f/pb-old-auto/;
random pairs computed once into ``runs/tune/ref.json`` (same space: pipelines auto, search alone).
"""

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

import evaluation.planner_bench as pb
import tag.search.mcts as mcts
from tag.data.generate import load_graph
from tag.data.pairs import sample_pair
from tag.gnn.predictor import Predictor
from tag.io import write_atomic
from tag.planner import find_plan
from tag.topology import load_topology

HERE = Path(__file__).resolve().parent


def search(graph, topo, **kw):
    return find_plan(graph, topo, seed=0, budget=kw.pop("budget"), pipelines="auto", executable=False,
                     layout_grid=False, compression="off", **kw).predicted_iteration_time_s


def main(checkpoint: str, graphs: str, *floors: str) -> None:
    torch.set_num_threads(1)
    pred, gdir = Predictor.load(checkpoint), Path(graphs)
    rows = json.loads((HERE.parent / "planner-bench-relabel/final-97c315f/pb-old-auto/results.json").read_text())["rows"]
    held_ref = {(r["model"], r["topology"]): r["uniform2000"]["time_s"] for r in rows}
    ref_path = Path(os.environ.get("REFS", "runs/tune/ref.json"))
    refs = json.loads(ref_path.read_text()) if ref_path.exists() else {}

    def uniform(key: str, graph, topo) -> float:  # uniform @2000, cached in ref_path
        if key not in refs:
            refs[key] = {"u2000": search(graph, topo, prior="uniform", budget=2000)}
            ref_path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(ref_path, json.dumps(refs, indent=1))  # a kill mid-write keeps the references so far
        return refs[key]["u2000"]

    sets = {"random": [], "held-out": []}
    for i in range(int(os.environ.get("RANDOM_PAIRS", 30))):
        s = sample_pair(pb.RANDOM_SEED, i, max_groups=32)
        graph, topo = load_graph(gdir, s.model, s.batch, s.groups), load_topology(s.topology)
        sets["random"].append((graph, topo, uniform(str(i), graph, topo)))
    for spec, batch, groups in pb.MODELS if os.environ.get("SETS", "random,held-out") != "random" else []:
        for t in pb.TOPOLOGIES:
            topo = load_topology(t)
            graph = load_graph(gdir, spec, batch, groups)
            ref = uniform(f"{spec}@{topo.name}", graph, topo) if "REFS" in os.environ else held_ref[(spec, topo.name)]
            sets["held-out"].append((graph, topo, ref))
    for floor in map(float, floors):
        mcts.PLAN_PRIOR_FLOOR = floor
        for name, pairs in sets.items():
            if not pairs:
                continue
            t0 = time.perf_counter()
            r = np.array([search(g, t, prior="gnn", predictor=pred, budget=50) / u for g, t, u in pairs])
            print(f"floor {floor}: {name:8s} geomean {math.exp(np.log(r).mean()):.4f}, at least as good "
                  f"{int((r <= 1 + 1e-9).sum())}/{len(r)}, worst {r.max():.3f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
