"""What the shipped predictor costs on a large cluster: building its context for one (graph,
topology), encoding + running one state and one 8-state wave (what MCTS asks per wave), and the
one-shot plan's 32-state call (``tag.planner.ONE_SHOT_GROUPS``), with the process's peak memory.

    PYTHONPATH=. .venv/bin/python -m evaluation.gnn_cost --topology hetero-64gpu

Graph: the 128-group 12-layer GPT-2 of ``evaluation/sim_speed.py --scale`` (cached in
``--graphs``). Results: ``evaluation/results/sim-speed/scale.md``.
"""

from __future__ import annotations

import argparse
import resource
import time


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # Linux: KiB -> ~MB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", required=True)
    ap.add_argument("--graphs", default="runs/scale/graphs")
    args = ap.parse_args(argv)
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from evaluation.sim_speed import SCALE_MODEL
    from tag.data.generate import load_graph
    from tag.gnn.predictor import Predictor
    from tag.search.evaluate import Feedback
    from tag.search.mcts import SearchState
    from tag.search.space import ActionSpace
    from tag.topology import load_topology

    spec, batch, groups = SCALE_MODEL
    graph = load_graph(args.graphs, spec, batch, groups)
    topo = load_topology(args.topology)
    space = ActionSpace(graph, topo)
    _ = space.group_canonical
    pred = Predictor.load()
    t0 = time.perf_counter()
    ctx = pred.context(space, 0.1)
    print(f"{topo.name}: {topo.num_devices} devices, {space.num_actions} actions, {graph.num_groups} groups; "
          f"context {time.perf_counter() - t0:.2f} s, peak {_rss_mb():.0f} MB", flush=True)
    none = np.full(space.num_groups, -1, dtype=np.int64)
    fb = Feedback.neutral(space.num_devices, space.num_groups)
    for n in (1, 8):
        states = [SearchState(none, space.order[i], fb) for i in range(n)]
        t0 = time.perf_counter()
        pred.predict(ctx, states)
        print(f"  {n} state(s): {time.perf_counter() - t0:.2f} s, peak {_rss_mb():.0f} MB", flush=True)
    t0 = time.perf_counter()
    pred.one_shot(space, 0.1, fb, max_groups=32)
    print(f"  one-shot plan (32 states): {time.perf_counter() - t0:.2f} s, peak {_rss_mb():.0f} MB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
