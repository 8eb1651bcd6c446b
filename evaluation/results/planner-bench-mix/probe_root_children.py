"""Probe of 2026-11-27: for the first N pairs at scale of the training stream (seed 0,
``large_fraction=0.25``), simulate every root action's own completed plan once
(:func:`tag.search.mcts.evaluate_children` at the root, no search) and say whether the best spans
several machines. Variants: ``A`` the stream as it is; ``B`` A with the default inter-machine
bandwidth redrawn log-uniform 25-400 Gbit/s; ``C`` ``large_inputs="full"``; ``D`` B and C.

    PYTHONPATH=. python evaluation/results/planner-bench-mix/probe_root_children.py A 20 GRAPHS_DIR

One JSON line per pair, then the count."""

import json
import sys
import time

import numpy as np

from tag.data.generate import load_graph
from tag.data.pairs import sample_pair
from tag.search.evaluate import Evaluator
from tag.search.mcts import evaluate_children, new_tree
from tag.search.space import ActionSpace
from tag.topology import load_topology


def _machines(space, tp, a: int) -> int:
    return len({tp.machine_of(d) for d in space.actions[a].devices})


def main(variant: str, n: int, gdir: str) -> None:
    rows, idx = [], 0
    while len(rows) < n:
        i, idx = idx, idx + 1
        if not np.random.default_rng([0, i, 3]).random() < 0.25:  # sample_pair's draw of "at scale"
            continue
        spec = sample_pair(0, i, max_groups=32, large_fraction=0.25,
                           large_inputs="full" if variant in ("C", "D") else "zoo")
        topo = spec.topology
        if variant in ("B", "D"):
            gbit = float(np.exp(np.random.default_rng([i, 99]).uniform(np.log(25), np.log(400))))
            topo = {**topo, "network": {**topo["network"], "bandwidth": f"{gbit:.2f} Gbit/s"}}
        t0 = time.time()
        graph = load_graph(gdir, spec.model, spec.batch, spec.groups)
        tp = load_topology(topo)
        space = ActionSpace(graph, tp)
        ev = Evaluator(space, None)
        tree = new_tree(space)
        evaluate_children(tree, 0, space, ev)
        rewards = sorted(((ev.reward(tree.feedback[c].iteration_time_s, tree.feedback[c].oom), a)
                          for a, c in enumerate(tree.children[0]) if c >= 0 and tree.feedback[c] is not None),
                         reverse=True)
        r, a = rewards[0]
        multi = [x for x, b in rewards if _machines(space, tp, b) > 1]
        row = {"i": i, "model": spec.model, "batch": spec.batch, "devices": tp.num_devices,
               "net": topo["network"]["bandwidth"], "zones": len(topo["network"].get("zones", [])),
               "best": space.actions[a].describe(tp)[:60], "machines": _machines(space, tp, a),
               "best_devices": len(space.actions[a].devices), "log1p_best": round(float(np.log1p(r)), 3),
               "log1p_best_multi": round(float(np.log1p(multi[0])), 3) if multi else None,
               "actions": len(rewards), "seconds": round(time.time() - t0, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"VARIANT {variant}: best root action spans several machines in "
          f"{sum(r['machines'] > 1 for r in rows)}/{len(rows)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
