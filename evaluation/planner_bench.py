"""Planner benchmark on models and topologies kept out of training.

Claims checked (see the module's output table):

1. GNN-guided MCTS with 50 playouts reaches at least the plan quality of uniform-prior MCTS with
   2,000 playouts (ratio of iteration times <= 1, per pair and as a geometric mean).
2. Playouts needed to first beat the better data-parallel baseline: far fewer with the GNN.
3. Never worse than the better data-parallel baseline (every searcher, every pair).
4. Plan time for a 64-group model on ``topologies/cluster-16gpu-4m.yaml`` under 10 s.

Also runs simulated annealing and random search (200 playouts) and optuna TPE (``--tpe``, default
100 trials: TPE's own cost per trial grows with the number of groups) as references, and with
``--random N`` claim 1 on N pairs drawn like the training pairs but never labelled.

Every search records its improvements (``[playout, seconds]`` at each new best plan), so the
summary also gives the median playout at which each searcher first came within 1% of uniform
MCTS @2000's final plan, and ``quality_vs_playouts.png`` beside the results plots the best plan
against playouts for every searcher.

    .venv/bin/python -m evaluation.planner_bench [--quick] [--out runs/planner_bench/results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

# (model spec, batch, groups): none of these models is in tag.data.pairs.TRAIN_MODELS.
MODELS = [
    ("gpt2:n_layer=4,n_embd=256", 32, 64),
    ("bert:n_layer=4,n_embd=256", 32, 32),
    ("vgg:depth=16,width=32", 64, 32),
    ("resnet:depth=34,width=16,norm=gn", 64, 32),
    ("vit:n_layer=4,n_embd=256", 64, 32),
]
# Shipped topologies: never generated for training (training topologies are random).
TOPOLOGIES = ["topologies/cluster-16gpu-4m.yaml", "topologies/tag-testbed.yaml",
              "topologies/mixed-a100-v100.yaml", "topologies/cloud-t4.yaml",
              "topologies/homogeneous-2x4-v100.yaml"]
# ``--scale``: held-out pairs at scale (the 12-layer GPT-2 of evaluation/sim_speed.py --scale, batch
# 512, on the 64-GPU shipped topology; the predictor is not run beyond GNN_MAX_DEVICES = 128).
SCALE_MODELS = [("gpt2:n_layer=12,n_embd=768,n_head=12,seq=128", 512, 128),
                ("gpt2:n_layer=12,n_embd=768,n_head=12,seq=128", 512, 64)]
SCALE_TOPOLOGIES = ["hetero-64gpu"]
RANDOM_SEED = 7777
"""Seed of the ``--random`` pairs' stream (training uses ``GenConfig.seed``, 0 by default)."""


def _load(spec, batch, groups, cache_dir: Path):
    from tag.data.generate import load_graph
    return load_graph(cache_dir, spec, batch, groups)


def run(args) -> dict:
    import torch
    torch.set_num_threads(1)
    from tag.gnn.predictor import Predictor
    from tag.planner import find_plan
    from tag.topology import load_topology

    pred = Predictor.load(args.checkpoint)
    if args.gnn_max_devices is not None:  # run the predictor on larger clusters than find_plan does
        import tag.planner
        tag.planner.GNN_MAX_DEVICES = args.gnn_max_devices
    models = MODELS[:2] if args.quick else MODELS
    topos = TOPOLOGIES[:2] if args.quick else TOPOLOGIES
    if args.scale:
        models, topos = SCALE_MODELS, SCALE_TOPOLOGIES
    if args.topologies:
        topos = [t.strip() for t in args.topologies.split(",") if t.strip()]
    if args.groups:
        models = [m for m in models if m[2] == args.groups]
    cache = Path(args.graphs)
    runs = {
        "gnn50": dict(searcher="mcts", prior="gnn", budget=50),
        "uniform50": dict(searcher="mcts", prior="uniform", budget=50),
        "uniform2000": dict(searcher="mcts", prior="uniform", budget=args.big),
        "sa200": dict(searcher="sa", budget=args.others),
        "random200": dict(searcher="random", budget=args.others),
        "tpe": dict(searcher="tpe", budget=args.tpe),
    }
    if args.tpe == 0:
        del runs["tpe"]
    if args.only:
        keep = {"gnn50", "uniform2000", *(n.strip() for n in args.only.split(","))}  # claim 1 needs both
        runs = {n: kw for n, kw in runs.items() if n in keep}
    budgets = {name: kw["budget"] for name, kw in runs.items()}
    reference = _reference(args, budgets) if args.reference else {}
    rows = []
    for spec, batch, groups in models:
        graph = _load(spec, batch, groups, cache)
        for tpath in topos:
            topo = load_topology(tpath)
            reused = _reused(reference, (spec, batch, graph.num_groups, topo.name), args.reference)
            row = {"model": spec, "batch": batch, "groups": graph.num_groups, "topology": topo.name,
                   **search_row(graph, topo, {n: kw for n, kw in runs.items() if n not in reused},
                                seed=args.seed, predictor=pred, pipelines=args.pipelines), **reused}
            best_dp = _best_dp(row)
            row["never_worse_than_dp"] = all(row[n]["time_s"] <= best_dp * (1 + 1e-9) for n in runs)
            row["gnn50_over_uniform2000"] = row["gnn50"]["time_s"] / row["uniform2000"]["time_s"]
            rows.append(row)
            cols = " | ".join(f"{n} {row[n]['time_s'] * 1e3:9.3f} (beat@{row[n]['first_beat_dp']}, "
                              f"{row[n]['wall_s']:.0f} s)" for n in runs)
            print(f"{spec:36s} {topo.name:22s} dp {best_dp * 1e3:9.3f} ms | {cols} | "
                  f"ratio {row['gnn50_over_uniform2000']:.3f}", flush=True)
    # plan time: 64-group model on the 16-GPU, 4-machine cluster, default budget and 50 playouts
    timing = {}
    for budget in (() if args.scale else (50, 200)):
        graph = _load("gpt2:n_layer=4,n_embd=256", 32, 64, cache)
        topo = load_topology("topologies/cluster-16gpu-4m.yaml")
        t0 = time.perf_counter()
        find_plan(graph, topo, seed=0, predictor=pred, budget=budget)
        timing[f"gnn{budget}_wall_s"] = time.perf_counter() - t0
    ratios = [r["gnn50_over_uniform2000"] for r in rows]
    random_rows = _random_pairs(args, pred, cache) if args.random else []

    def firsts(name):
        return [r[name]["first_beat_dp"] for r in rows]

    def med(xs):  # None: never (more than half the pairs never got there)
        m = float(np.median([x if x is not None else math.inf for x in xs]))
        return m if math.isfinite(m) else None

    summary = {
        **_claim1(ratios),
        "first_beat_dp_median": {n: med(firsts(n)) for n in ("gnn50", "uniform50", "uniform2000") if n in runs},
        "within_1pct_of_uniform2000_median": {
            n: med([_reach(r, n, 1.01) for r in rows]) for n in runs if n != "uniform50"},
        "never_worse_than_dp": all(r["never_worse_than_dp"] for r in rows),
        "plan_time_64groups_16gpu": timing,
    }
    if random_rows:
        summary["random_pairs"] = {**_claim1([r["gnn50_over_uniform2000"] for r in random_rows]),
                                   "seed": RANDOM_SEED}
    print(json.dumps(summary, indent=1))
    return {"rows": rows, "random_rows": random_rows, "summary": summary, "budgets": budgets,
            "options": {"pipelines": args.pipelines, "seed": args.seed, "checkpoint": args.checkpoint}}


def search_row(graph, topo, runs: dict[str, dict], *, seed: int, predictor=None, pipelines: str = "off") -> dict:
    """One benchmark row: every searcher of ``runs`` (name -> :func:`tag.planner.find_plan` keywords) on
    one (graph, topology), with the data-parallel baselines and the lower bound. ``pipelines``:
    ``off`` compares searchers over TAG's per-group actions, ``auto`` over the space with
    tensor-parallel actions and pipeline decisions."""
    from tag.planner import find_plan
    row: dict = {}
    for name, kw in runs.items():
        t0 = time.perf_counter()
        # executable=False: the searchers compared on the simulated space (as recorded)
        p = find_plan(graph, topo, seed=seed, predictor=predictor if kw.get("prior") == "gnn" else None,
                      pipelines=pipelines, executable=False, **kw)
        m = p.meta
        row[name] = {"time_s": p.predicted_iteration_time_s, "first_beat_dp": m["first_beat_dp_playout"],
                     "sim_calls": m["sim_calls"], "wall_s": time.perf_counter() - t0,
                     "source": m["source"], "improvements": m["improvements"]}
        row["dp_even_s"], row["dp_prop_s"] = m["dp_even_time_s"], m["dp_prop_time_s"]
        row["lower_bound_s"] = m["lower_bound_s"]
    return row


def _best_dp(row: dict) -> float:
    """Seconds of the better data-parallel baseline of a row (one that fits in memory)."""
    return min(x for x in (row["dp_even_s"], row["dp_prop_s"]) if x is not None)


def best_so_far(row: dict, name: str, playouts: int) -> np.ndarray:
    """[playouts] seconds of the best plan searcher ``name`` had after each playout of a benchmark
    row (the better data-parallel baseline before its first improvement; flat after its budget)."""
    out = np.full(playouts, _best_dp(row))
    for n, t in row[name]["improvements"]:
        if n <= playouts:
            out[n - 1:] = np.minimum(out[n - 1:], t)
    return out


def _reach(row: dict, name: str, factor: float) -> float | None:
    """First playout at which ``name`` had a plan within ``factor`` of uniform @2000's final plan
    (0: data parallel already was; None: never)."""
    target = row["uniform2000"]["time_s"] * factor
    hits = [n for n, t in row[name]["improvements"] if t <= target * (1 + 1e-12)]
    return 0.0 if _best_dp(row) <= target else (float(hits[0]) if hits else None)


def plot_progress(rows: list[dict], budgets: dict[str, int], path: Path) -> None:
    """Plan quality against playouts, geometric mean over ``rows``, relative to the final plan of
    uniform MCTS with the big budget (left), and the share of pairs whose best plan is at least as
    good as that (right). ``budgets``: playouts of each searcher."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    big = budgets["uniform2000"]
    curves = {"gnn50": "GNN-MCTS", "uniform2000": "uniform MCTS", "sa200": "simulated annealing",
              "random200": "random search", "tpe": "optuna TPE"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ref = np.array([r["uniform2000"]["time_s"] for r in rows])
    for name, label in ((n, x) for n, x in curves.items() if n in budgets):
        budget = budgets[name]
        x = np.arange(1, budget + 1)
        ratio = np.stack([best_so_far(r, name, budget) for r in rows]) / ref[:, None]  # [pairs, playouts]
        ax1.plot(x, np.exp(np.log(ratio).mean(0)), label=label)
        ax2.plot(x, (ratio <= 1 + 1e-9).mean(0), label=label)
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("playouts (plans proposed)")
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax1.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax1.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
    ax1.set_ylabel(f"best iteration time / uniform MCTS @{big} (geomean)")
    ax2.set_ylabel(f"share of pairs at least as good as uniform @{big}")
    ax1.legend()
    fig.suptitle(f"Planner search progress on {len(rows)} held-out (model, topology) pairs")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _claim1(ratios: list[float]) -> dict:
    """Claim 1 over pairs' GNN @50 / uniform @2000 iteration-time ratios."""
    return {"pairs": len(ratios), "gnn50_vs_uniform2000_geomean": float(np.exp(np.mean(np.log(ratios)))),
            "gnn50_at_least_as_good_pairs": sum(r <= 1 + 1e-9 for r in ratios)}


REUSED = ("uniform50", "uniform2000", "sa200", "random200", "tpe")
"""Searchers whose rows ``--reference`` takes from an earlier run: none of them runs the predictor."""


def _reference(args, budgets: dict[str, int]) -> dict[tuple, dict]:
    """Rows of the earlier results file ``args.reference`` by (model, batch, groups, topology): the
    runs of the searchers that do not use the predictor, to compare another checkpoint against
    (the simulator is deterministic). It must have been run with the same pipelines, seed and
    budgets."""
    from tag.errors import TagError
    from tag.io import read_json
    ref = read_json(args.reference, TagError, "reference results")
    opts = ref.get("options", {})
    for key, want in (("pipelines", args.pipelines), ("seed", args.seed)):
        if opts.get(key) != want:
            raise TagError(f"{args.reference}: options.{key}: expected {want!r} (this run's), got {opts.get(key)!r}")
    for name in REUSED:
        if name in budgets and ref.get("budgets", {}).get(name) != budgets[name]:
            raise TagError(f"{args.reference}: budgets.{name}: expected {budgets[name]}, got {ref.get('budgets', {}).get(name)!r}")
    return {(r["model"], r["batch"], r["groups"], r["topology"]): {n: r[n] for n in REUSED if n in budgets}
            for r in ref["rows"]}


def _reused(reference: dict, key: tuple, path) -> dict:
    """The reference's runs for one pair (empty without ``--reference``)."""
    if not reference:
        return {}
    if key not in reference:
        from tag.errors import TagError
        raise TagError(f"{path}: rows: no row for {key} (run the reference with the same pairs)")
    return reference[key]


def _random_pairs(args, pred, cache: Path) -> list[dict]:
    """GNN-MCTS @50 vs uniform-prior MCTS @``args.big`` on ``args.random`` pairs drawn like the
    training pairs (training models, random clusters) from a stream training never labels."""
    from tag.data.pairs import sample_pair
    from tag.planner import find_plan
    from tag.topology import load_topology
    out = []
    for i in range(args.random):
        spec = sample_pair(RANDOM_SEED, i, max_groups=32)
        graph = _load(spec.model, spec.batch, spec.groups, cache)
        topo = load_topology(spec.topology)
        t = {name: find_plan(graph, topo, seed=args.seed, prior=prior, predictor=pred, budget=budget,
                             compression="off", pipelines=args.pipelines).predicted_iteration_time_s
             for name, prior, budget in (("gnn50", "gnn", 50), ("uniform2000", "uniform", args.big))}
        row = {"index": i, "model": spec.model, "batch": spec.batch, "groups": graph.num_groups,
               "devices": topo.num_devices, "machines": topo.num_machines, **{f"{k}_s": v for k, v in t.items()},
               "gnn50_over_uniform2000": t["gnn50"] / t["uniform2000"]}
        out.append(row)
        print(f"random pair {i:3d} {spec.model:36s} {topo.num_devices:2d} GPUs / {topo.num_machines} machines"
              f" | gnn50 {t['gnn50'] * 1e3:9.3f} ms | uni{args.big} {t['uniform2000'] * 1e3:9.3f} ms"
              f" | ratio {row['gnn50_over_uniform2000']:.3f}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="predictor checkpoint (default: shipped)")
    ap.add_argument("--big", type=int, default=2000, help="uniform-prior MCTS budget (default 2000)")
    ap.add_argument("--tpe", type=int, default=100, help="optuna TPE budget (default 100; slow per trial)")
    ap.add_argument("--others", type=int, default=200, metavar="N",
                    help="simulated annealing and random search budget (default 200; their rows keep the names "
                         "sa200 / random200, the budgets are in the output's 'budgets')")
    ap.add_argument("--topologies", default=None,
                    help="comma-separated topology names or paths replacing the chosen set's (e.g. hetero-128gpu)")
    ap.add_argument("--only", default=None, metavar="NAMES",
                    help="comma-separated searchers to run besides gnn50 and uniform2000 (of uniform50, sa200, "
                         "random200, tpe; default: all)")
    ap.add_argument("--gnn-max-devices", type=int, default=None, metavar="N",
                    help="run the predictor up to N devices (default: tag.planner.GNN_MAX_DEVICES); beyond "
                         "tag.gnn.features.COARSE_ABOVE it sees one device node per machine")
    ap.add_argument("--groups", type=int, default=None, help="only the chosen set's models cut into this many groups")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pipelines", choices=["off", "auto"], default="off",
                    help="off: searchers over TAG's per-group actions (default); auto: with tensor-parallel "
                         "actions and pipeline decisions (find_plan's default space)")
    ap.add_argument("--quick", action="store_true", help="2 models x 2 topologies")
    ap.add_argument("--scale", action="store_true", help="the held-out pairs at scale (SCALE_MODELS x "
                    "SCALE_TOPOLOGIES; use --graphs runs/scale/graphs)")
    ap.add_argument("--random", type=int, default=0, metavar="N",
                    help="also compare GNN @50 with uniform @--big on N pairs drawn like the training pairs "
                         f"(training models on random clusters, seed {RANDOM_SEED}, never labelled)")
    ap.add_argument("--graphs", default="runs/predictor/graphs", help="captured-graph cache folder")
    ap.add_argument("--reference", default=None, metavar="RESULTS.json",
                    help="take the searchers that do not use the predictor (uniform MCTS, SA, random, TPE) from "
                         "this earlier run of the same pairs, options and budgets instead of running them "
                         "(to compare checkpoints: the simulator is deterministic)")
    ap.add_argument("--out", default="runs/planner_bench/results.json")
    args = ap.parse_args(argv)
    res = run(args)
    from tag.io import write_json
    write_json(args.out, res)
    png = Path(args.out).with_name("quality_vs_playouts.png")
    plot_progress(res["rows"], res["budgets"], png)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
