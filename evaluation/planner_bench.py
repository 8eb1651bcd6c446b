"""Planner benchmark on models and topologies kept out of training.

``--scale`` runs the held-out pairs at 64-512 GPUs (``SCALE_PAIRS``: GPT-2 small / medium,
BERT-large, VGG-16 and ResNet-50 in bf16; evaluation/results/planner-bench-scale/README.md at 095e355).

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
MCTS @2000's final plan, ``quality_vs_playouts.png`` beside the results plots the best plan
against playouts for every searcher and ``tables.md`` gives the per-pair and per-method tables.
``results.json`` is rewritten after every pair; ``--reuse`` takes stored methods from earlier
results (keyed by :func:`pair_key` and method name), so a new predictor is compared with
``--only gnn50 --checkpoint X --reuse old/results.json`` without rerunning the references.
With ``--pipelines auto`` the searchers are compared over find_plan's default space, the search
alone (``layout_grid=False``: the layout grid after it is the same for every searcher).

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
# ``--scale``: held-out pairs at 64-512 GPUs, (model spec, batch, groups, precision, topology); bf16
# captures come from ``tag plan``'s graph cache ($TAG_CACHE_DIR). None of these models or clusters
# is a training one (training: <= 32 GPUs, small models, fp32). Group counts and batches are sized
# so that uniform MCTS @2000 fits a loaded 2-core machine (evaluation/results/planner-bench-scale/ at 095e355).
SCALE_PAIRS = [
    ("gpt2-medium", 256, 64, "bf16", "hetero-64gpu"),
    ("bert-large", 256, 64, "bf16", "hetero-64gpu"),
    ("vgg16", 1024, 32, "bf16", "hetero-64gpu"),
    ("gpt2-small", 512, 64, "bf16", "hetero-128gpu"),
    ("vgg16", 1024, 32, "bf16", "hetero-128gpu"),
    ("resnet50", 1024, 32, "bf16", "cloud-256gpu-3zones"),
    ("gpt2-medium", 256, 64, "bf16", "h100-512gpu"),
    ("resnet50", 1024, 32, "bf16", "hetero-64gpu"),
    ("bert-large", 256, 64, "bf16", "hetero-128gpu"),
]
RANDOM_SEED = 7777
"""Seed of the ``--random`` pairs' stream (training uses ``GenConfig.seed``, 0 by default)."""


def _load(spec, batch, groups, cache_dir: Path, precision: str | None = None):
    """The grouped graph of a pair: fp32 pairs from ``cache_dir`` (the training data's cache),
    ``precision`` pairs through :func:`tag.planner.model_graph` (``tag plan``'s cache)."""
    if precision is not None:
        from tag.planner import model_graph
        return model_graph(spec, batch, precision=precision, num_groups=groups)[0]
    from tag.data.generate import load_graph
    return load_graph(cache_dir, spec, batch, groups)


def _pairs(args) -> list[tuple]:
    """(spec, batch, groups, precision or None, topology) of the chosen set, after ``--topologies``
    and ``--groups``."""
    if args.scale:
        pairs = list(SCALE_PAIRS)
        if args.topologies:  # the scale models on the named clusters instead
            models = list(dict.fromkeys(p[:4] for p in pairs))
            pairs = [(*m, t) for m in models for t in _names(args.topologies)]
    else:
        models = MODELS[:2] if args.quick else MODELS
        topos = _names(args.topologies) if args.topologies else (TOPOLOGIES[:2] if args.quick else TOPOLOGIES)
        pairs = [(spec, batch, groups, None, t) for spec, batch, groups in models for t in topos]
    pairs = [p for p in pairs if not args.groups or p[2] == args.groups]
    if args.pairs:
        try:
            return [pairs[int(i)] for i in _names(args.pairs)]
        except (ValueError, IndexError):
            raise SystemExit(f"--pairs {args.pairs}: expected comma-separated indices below {len(pairs)}") from None
    return pairs


def _names(csv: str) -> list[str]:
    return [t.strip() for t in csv.split(",") if t.strip()]


def pair_key(model: str, batch: int, groups: int, precision: str | None, topology: str, pipelines: str,
             seed: int) -> str:
    """What a stored method result is reused under (with the method's name): the pair and the space."""
    return f"{model}|b{batch}|g{groups}|{precision or 'fp32'}|{topology}|pipelines={pipelines}|seed={seed}"


def load_reuse(paths: str | None) -> dict[str, dict]:
    """Rows of earlier ``results.json`` files (comma-separated) by :func:`pair_key`; a later file's
    methods override an earlier one's."""
    out: dict[str, dict] = {}
    for path in _names(paths or ""):
        try:
            rows = json.loads(Path(path).read_text())["rows"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"--reuse {path}: expected a planner_bench results.json with 'rows' ({e})") from None
        for r in rows:
            if "key" not in r:
                raise SystemExit(f"--reuse {path}: row {r.get('model')!r} on {r.get('topology')!r} has no 'key' "
                                 "(written before 2026-11-27's reuse option)")
            out.setdefault(r["key"], {}).update(r)
    return out


def run(args) -> dict:
    import torch
    torch.set_num_threads(1)
    from tag.gnn.predictor import Predictor
    from tag.planner import PlannerConfig, find_plan
    from tag.topology import load_topology

    pred = Predictor.load(args.checkpoint)
    if args.gnn_max_devices is not None:  # run the predictor on larger clusters than find_plan does
        import tag.planner
        tag.planner.GNN_MAX_DEVICES = args.gnn_max_devices
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
    named = set(_names(args.only or ""))
    if args.only:
        keep = {"gnn50", "uniform2000", *named}  # claim 1 needs both
        runs = {n: kw for n, kw in runs.items() if n in keep}
    reuse = load_reuse(args.reuse)
    rows, res = [], {}
    for spec, batch, groups, precision, tname in _pairs(args):
        graph = _load(spec, batch, groups, cache, precision)
        topo = load_topology(tname)
        key = pair_key(spec, batch, graph.num_groups, precision, topo.name, args.pipelines, args.seed)
        old = reuse.get(key, {})
        # a method named in --only is recomputed; any other stored one is taken as it was
        todo = {n: kw for n, kw in runs.items() if n in named or n not in old}
        row = {"key": key, "model": spec, "batch": batch, "groups": graph.num_groups, "precision": precision or "fp32",
               "topology": topo.name, "devices": topo.num_devices, "pipelines": args.pipelines,
               **search_row(graph, topo, todo, seed=args.seed, predictor=pred, pipelines=args.pipelines,
                            checkpoint=args.checkpoint)}
        _merge_reused(row, old, todo, key)
        _finish_row(row)
        rows.append(row)
        print(_row_line(row), flush=True)
        res = _result(args, rows, [], {})
        if args.out:  # after every pair: a cut run keeps what it did (and --reuse can take it up)
            from tag.io import write_json
            write_json(args.out, res)
    # plan time: 64-group model on the 16-GPU, 4-machine cluster, default budget and 50 playouts
    timing = {}
    for budget in (() if args.scale else (50, 200)):
        graph = _load("gpt2:n_layer=4,n_embd=256", 32, 64, cache)
        topo = load_topology("topologies/cluster-16gpu-4m.yaml")
        t0 = time.perf_counter()
        find_plan(graph, topo, PlannerConfig(seed=0, budget=budget), predictor=pred)
        timing[f"gnn{budget}_wall_s"] = time.perf_counter() - t0
    random_rows = _random_pairs(args, pred, cache) if args.random else []
    res = _result(args, rows, random_rows, timing)
    print(json.dumps(res["summary"], indent=1))
    return res


def _merge_reused(row: dict, old: dict, todo: dict, key: str) -> None:
    """Add to ``row`` the stored methods of ``old`` it did not compute (marked ``reused``). The
    simulator is deterministic, so a pair's data-parallel baselines recomputed now must equal the
    stored ones: where they differ the stored results are of another cost model and are refused."""
    names = [n for n in old if isinstance(old[n], dict) and "improvements" in old[n] and n not in todo]
    if not names:
        return
    if todo:
        for f in ("dp_even_s", "dp_prop_s"):
            a, b = row.get(f), old.get(f)
            if (a is None) != (b is None) or (a is not None and not math.isclose(a, b, rel_tol=1e-9)):
                raise SystemExit(f"--reuse: pair {key}: {f} is {a} now but {b} in the stored results "
                                 "(another simulator or cost model); recompute those methods")
    else:
        row.update({f: old[f] for f in ("dp_even_s", "dp_prop_s", "lower_bound_s")})
    for n in names:
        row[n] = {**old[n], "reused": True}


def _finish_row(row: dict) -> None:
    """The row's per-pair claims (over every method it holds)."""
    best_dp = _best_dp(row)
    row["never_worse_than_dp"] = all(_t(row[n]) <= best_dp * (1 + 1e-9) for n in _methods(row))
    if "gnn50" in row and "uniform2000" in row:
        row["gnn50_over_uniform2000"] = _t(row["gnn50"]) / _t(row["uniform2000"])


def _methods(row: dict) -> list[str]:
    return [n for n, v in row.items() if isinstance(v, dict) and "improvements" in v]


def _t(entry: dict) -> float:
    """A method's plan seconds (inf: out of memory)."""
    return math.inf if entry["time_s"] is None else entry["time_s"]


def _row_line(row: dict) -> str:
    cols = " | ".join(f"{n} {_t(row[n]) * 1e3:9.3f} (beat@{row[n]['first_beat_dp']}, {row[n]['wall_s']:.0f} s"
                      f"{', reused' if row[n].get('reused') else ''})" for n in _methods(row))
    ratio = row.get("gnn50_over_uniform2000")
    return (f"{row['model']:36s} {row['topology']:22s} dp {_best_dp(row) * 1e3:9.3f} ms | {cols} | "
            f"ratio {'-' if ratio is None else f'{ratio:.3f}'}")


def _med(xs):
    """Median with None as never (None: more than half the pairs never got there)."""
    if not xs:
        return None
    m = float(np.median([x if x is not None else math.inf for x in xs]))
    return m if math.isfinite(m) else None


def _result(args, rows: list[dict], random_rows: list[dict], timing: dict) -> dict:
    """results.json's object: rows, summary and each method's budget (the largest over rows)."""
    budgets: dict[str, int] = {}
    for r in rows:
        for n in _methods(r):
            budgets[n] = max(budgets.get(n, 0), r[n].get("budget") or 0)
    both = [r for r in rows if "gnn50_over_uniform2000" in r]
    summary = {
        **_claim1([r["gnn50_over_uniform2000"] for r in both]),
        "first_beat_dp_median": {n: _med([r[n]["first_beat_dp"] for r in rows if n in r])
                                 for n in ("gnn50", "uniform50", "uniform2000") if n in budgets},
        "within_1pct_of_uniform2000_median": {
            n: _med([_reach(r, n, 1.01) for r in rows if n in r and "uniform2000" in r])
            for n in budgets if n != "uniform50"},
        "never_worse_than_dp": all(r["never_worse_than_dp"] for r in rows),
        "plan_time_64groups_16gpu": timing,
    }
    if random_rows:
        summary["random_pairs"] = {**_claim1([r["gnn50_over_uniform2000"] for r in random_rows]),
                                   "seed": RANDOM_SEED}
    return {"rows": rows, "random_rows": random_rows, "summary": summary, "budgets": budgets,
            "checkpoint": args.checkpoint, "pipelines": args.pipelines}


def search_row(graph, topo, runs: dict[str, dict], *, seed: int, predictor=None, pipelines: str = "off",
               checkpoint: str | None = None) -> dict:
    """One benchmark row: every searcher of ``runs`` (name -> :func:`tag.planner.find_plan` keywords) on
    one (graph, topology), with the data-parallel baselines and the lower bound. ``pipelines``:
    ``off`` compares searchers over TAG's per-group actions, ``auto`` over the space with
    tensor-parallel actions and pipeline decisions (the search alone: find_plan's layout grid,
    the same for every searcher, is not run). Each method records the prior that actually ran
    (``prior``, ``prior_note``: beyond ``tag.planner.GNN_MAX_DEVICES`` a ``gnn`` run is uniform),
    its search, wall and CPU seconds, and ``checkpoint`` where the predictor ran."""
    from tag.planner import PlannerConfig, find_plan
    row: dict = {}
    for name, kw in runs.items():
        t0, c0 = time.perf_counter(), time.process_time()
        # executable=False: the searchers compared on the simulated space (as recorded)
        cfg = PlannerConfig(seed=seed, pipelines=pipelines, executable=False, layout_grid=False, **kw)
        p = find_plan(graph, topo, cfg, predictor=predictor if kw.get("prior") == "gnn" else None)
        m = p.meta
        row[name] = {"time_s": p.predicted_iteration_time_s, "first_beat_dp": m["first_beat_dp_playout"],
                     "budget": kw.get("budget"), "searcher": m["searcher"], "prior": m["prior"],
                     "prior_note": m["prior_note"], "checkpoint": checkpoint if m["prior"] == "gnn" else None,
                     "sim_calls": m["sim_calls"], "playouts": m["playouts"], "repeats": m["repeats"],
                     "search_s": m["search_time_s"],
                     "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                     "source": m["source"], "improvements": m["improvements"]}
        row["dp_even_s"], row["dp_prop_s"] = m["dp_even_time_s"], m["dp_prop_time_s"]
        row["lower_bound_s"] = m["lower_bound_s"]
    return row


def _best_dp(row: dict) -> float:
    """Seconds of the better data-parallel baseline of a row that fits in memory (inf: neither)."""
    return min((x for x in (row["dp_even_s"], row["dp_prop_s"]) if x is not None), default=math.inf)


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
    target = _t(row["uniform2000"]) * factor
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
    for name, label in ((n, x) for n, x in curves.items() if n in budgets):
        budget = budgets[name]
        x = np.arange(1, budget + 1)
        have = [r for r in rows if name in r]
        ref = np.array([_t(r["uniform2000"]) for r in have])
        ratio = np.stack([best_so_far(r, name, budget) for r in have]) / ref[:, None]  # [pairs, playouts]
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


LABELS = {"gnn50": "GNN-MCTS", "uniform50": "uniform MCTS", "uniform2000": "uniform MCTS", "sa200": "SA",
          "random200": "random", "tpe": "TPE"}


def report_md(res: dict) -> str:
    """Markdown tables of a result: per pair (plans, which prior ran, the claims), playouts to
    within 1% of uniform @2000's final plan per pair and method, and per method (median over pairs)."""
    rows, budgets = res["rows"], res["budgets"]
    names = [n for n in LABELS if n in budgets]

    def budget(n):  # the method's budget, or its range where pairs ran different ones
        b = sorted({r[n].get("budget") or 0 for r in rows if n in r}) or [budgets[n]]
        return f"{b[0]}" if len(b) == 1 else f"{b[0]}-{b[-1]}"

    head = [f"{LABELS[n]} @{budget(n)}" for n in names]

    def pair(r):
        return f"{r['model']} {r.get('precision', 'fp32')} b{r['batch']} g{r['groups']} / {r['topology']}"

    def ms(r, n):
        if n not in r:
            return "not run"
        return "OOM" if r[n]["time_s"] is None else f"{r[n]['time_s'] * 1e3:.2f}"

    def prior(r):
        g = r.get("gnn50")
        return "-" if g is None else ("GNN" if g.get("prior") == "gnn" else "uniform (> GNN_MAX_DEVICES)")

    out = ["Simulated iteration time, ms; best dp: the better data-parallel baseline that fits.", "",
           "| pair | GNN prior ran | best dp | " + " | ".join(head) + " | GNN @50 / uniform @2000 | never worse than dp |",
           "|---|---|---:|" + "---:|" * len(names) + "---:|---|"]
    for r in rows:
        ratio = r.get("gnn50_over_uniform2000")
        dp = _best_dp(r)
        out.append(f"| {pair(r)} | {prior(r)} | {'OOM' if math.isinf(dp) else f'{dp * 1e3:.2f}'} | "
                   + " | ".join(ms(r, n) for n in names)
                   + f" | {'-' if ratio is None else f'{ratio:.4f}'} | {'yes' if r['never_worse_than_dp'] else 'NO'} |")
    reach = [n for n in names if n != "uniform50"]
    out += ["", "Playouts to reach within 1% of uniform @2000's final plan (0: data parallel already is; "
            "never: not within the method's budget):", "",
            "| pair | " + " | ".join(f"{LABELS[n]} @{budget(n)}" for n in reach) + " |",
            "|---|" + "---:|" * len(reach)]
    for r in rows:
        cells = []
        for n in reach:
            x = _reach(r, n, 1.01) if n in r and "uniform2000" in r else "not run"
            cells.append(x if isinstance(x, str) else ("never" if x is None else f"{x:.0f}"))
        out.append(f"| {pair(r)} | " + " | ".join(cells) + " |")
    out += ["", "Search seconds, wall (CPU; the machine's load makes wall seconds larger):", "",
            "| pair | " + " | ".join(head) + " |", "|---|" + "---:|" * len(names)]
    for r in rows:
        out.append(f"| {pair(r)} | " + " | ".join(
            "not run" if n not in r else f"{r[n]['search_s']:.1f} ({r[n]['cpu_s']:.1f})" for n in names) + " |")
    out += ["", "| method | budget | playouts to within 1% (median over pairs) | pairs within 1% | "
            "search s (median) | CPU s (median) |", "|---|---:|---:|---:|---:|---:|"]
    for n in reach:
        have = [r for r in rows if n in r and "uniform2000" in r]
        hits = [_reach(r, n, 1.01) for r in have]
        med = _med(hits)
        out.append(f"| {LABELS[n]} | {budget(n)} | {'never' if med is None else f'{med:.0f}'} | "
                   f"{sum(h is not None for h in hits)} / {len(have)} | "
                   f"{np.median([r[n]['search_s'] for r in have]):.1f} | {np.median([r[n]['cpu_s'] for r in have]):.1f} |")
    return "\n".join(out) + "\n"


def _claim1(ratios: list[float]) -> dict:
    """Claim 1 over pairs' GNN @50 / uniform @2000 iteration-time ratios."""
    return {"pairs": len(ratios), "gnn50_vs_uniform2000_geomean": float(np.exp(np.mean(np.log(ratios)))),
            "gnn50_at_least_as_good_pairs": sum(r <= 1 + 1e-9 for r in ratios)}


def _random_pairs(args, pred, cache: Path) -> list[dict]:
    """GNN-MCTS @50 vs uniform-prior MCTS @``args.big`` on ``args.random`` pairs drawn like the
    training pairs (training models, random clusters) from a stream training never labels."""
    from tag.data.pairs import sample_pair
    from tag.planner import PlannerConfig, find_plan
    from tag.topology import load_topology
    out = []
    for i in range(args.random):
        spec = sample_pair(RANDOM_SEED, i, max_groups=32)
        graph = _load(spec.model, spec.batch, spec.groups, cache)
        topo = load_topology(spec.topology)
        t = {name: find_plan(graph, topo, PlannerConfig(seed=args.seed, prior=prior, budget=budget, compression="off",
                                                        pipelines=args.pipelines),
                             predictor=pred).predicted_iteration_time_s
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
                         "random200, tpe; default: all); with --reuse the ones named are recomputed")
    ap.add_argument("--reuse", default=None, metavar="JSONS",
                    help="comma-separated results.json of earlier runs: a method stored for the same pair, "
                         "space and seed (row 'key') is taken from there instead of run, unless --only names "
                         "it (e.g. --only gnn50 --checkpoint X --reuse old.json runs the GNN alone); refused "
                         "where the pair's data-parallel baselines differ now")
    ap.add_argument("--gnn-max-devices", type=int, default=None, metavar="N",
                    help="run the predictor up to N devices (default: tag.planner.GNN_MAX_DEVICES); beyond "
                         "tag.gnn.features.COARSE_ABOVE it sees one device node per machine")
    ap.add_argument("--pairs", default=None, metavar="I,J",
                    help="only these pairs of the chosen set (0-based indices, e.g. of SCALE_PAIRS)")
    ap.add_argument("--groups", type=int, default=None, help="only the chosen set's models cut into this many groups")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pipelines", choices=["off", "auto"], default="off",
                    help="off: searchers over TAG's per-group actions (default); auto: with tensor-parallel "
                         "actions and pipeline decisions (find_plan's default space)")
    ap.add_argument("--quick", action="store_true", help="2 models x 2 topologies")
    ap.add_argument("--scale", action="store_true", help="the held-out pairs at 64-512 GPUs (SCALE_PAIRS, bf16 "
                    "graphs from tag plan's cache; --topologies puts their models on other clusters)")
    ap.add_argument("--random", type=int, default=0, metavar="N",
                    help="also compare GNN @50 with uniform @--big on N pairs drawn like the training pairs "
                         f"(training models on random clusters, seed {RANDOM_SEED}, never labelled)")
    ap.add_argument("--graphs", default="runs/predictor/graphs", help="captured-graph cache folder")
    ap.add_argument("--out", default="runs/planner_bench/results.json")
    args = ap.parse_args(argv)
    res = run(args)
    from tag.io import write_json
    write_json(args.out, res)
    png = Path(args.out).with_name("quality_vs_playouts.png")
    md = Path(args.out).with_name("tables.md")
    from tag.io import write_atomic
    write_atomic(md, report_md(res))
    plot_progress(res["rows"], res["budgets"], png)
    print(f"wrote {args.out}, {md} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
