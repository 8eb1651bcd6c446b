"""Golden figures of the simulator and the planners, to hold a refactor to "nothing moved".

Records, for every cell of ``tag bench --suite quick`` (every method on every topology, the
local CPU topology simulated only) and for every searcher of the planner benchmark on its
held-out pairs (plus ``--random N`` random pairs, GNN @50 and uniform @50 only): the plan found
(its groups, as JSON), the simulated iteration time, the peak memory per device and the OOM flag.

``--check FILE`` recomputes everything and compares with FILE: plans must be equal and the
figures equal to ``--rtol`` (default 1e-9, relative). It also re-simulates FILE's stored plans
with the current simulator, so a difference in the simulator shows apart from a difference in
what the searches found.

    .venv/bin/python -m evaluation.golden --out evaluation/golden.json
    .venv/bin/python -m evaluation.golden --check evaluation/golden.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def _figures(res) -> dict:
    return {"time_s": res.iteration_time_s, "oom": bool(res.oom), "peak_bytes": list(res.peak_memory_bytes)}


def _plan_json(plan) -> list:
    return plan.to_dict()["groups"]  # fields at their defaults left out, as in the plan file


def _quick_cells(log) -> list[dict]:
    from tag.bench.runner import _Case
    from tag.bench.suites import quick_suite

    cfg = quick_suite()
    graphs: dict = {}
    out = []
    for model in cfg.models:
        for topo in cfg.topologies + cfg.execute_topologies:
            case = _Case(model, topo, cfg, graphs)
            for method in cfg.methods:
                if method == "lower-bound":
                    out.append({"suite": "quick", "model": model.spec, "topology": topo, "method": method,
                                "time_s": case.lower_bound})
                    continue
                plan, _ = case.make_plan(method, cfg)
                res = case.sim.run(plan.groups)
                out.append({"suite": "quick", "model": model.spec, "batch": model.batch, "groups": cfg.groups,
                            "topology": topo, "method": method, "plan": _plan_json(plan), **_figures(res)})
                log(f"quick {model.spec} {topo} {method}: {res.iteration_time_s * 1e3:.4f} ms")
    return out


def _planner_cells(random_pairs: int, log) -> list[dict]:
    import torch

    from evaluation.planner_bench import MODELS, RANDOM_SEED, TOPOLOGIES, _load
    from tag.gnn.predictor import Predictor
    from tag.planner import PlannerConfig, find_plan
    from tag.topology import load_topology

    torch.set_num_threads(1)
    pred = Predictor.load(None)
    cache = Path("runs/planner_bench/graphs")
    runs = {
        "gnn50": dict(searcher="mcts", prior="gnn", budget=50),
        "uniform50": dict(searcher="mcts", prior="uniform", budget=50),
        "uniform2000": dict(searcher="mcts", prior="uniform", budget=2000),
        "sa200": dict(searcher="sa", budget=200),
        "random200": dict(searcher="random", budget=200),
        "tpe": dict(searcher="tpe", budget=100),
    }
    pairs = [(spec, batch, groups, t, runs) for spec, batch, groups in MODELS for t in TOPOLOGIES]
    if random_pairs:
        from tag.data.pairs import sample_pair
        few = {k: dict(v, compression="off") for k, v in runs.items() if k in ("gnn50", "uniform50")}
        for i in range(random_pairs):
            s = sample_pair(RANDOM_SEED, i, max_groups=32)
            pairs.append((s.model, s.batch, s.groups, s.topology, few))
    out = []
    for spec, batch, groups, tpath, rs in pairs:
        graph = _load(spec, batch, groups, cache)
        topo = load_topology(tpath)
        for name, kw in rs.items():
            p = find_plan(graph, topo, PlannerConfig(seed=0, pipelines="off", **kw),  # as recorded (no pipelines)
                          predictor=pred if kw.get("prior") == "gnn" else None)
            from tag.sim import Simulator
            res = Simulator(graph, topo).run(p.groups)
            out.append({"suite": "planner", "model": spec, "batch": batch, "groups": groups,
                        "topology": tpath if isinstance(tpath, str) else json.dumps(tpath, sort_keys=True),
                        "method": name, "plan": _plan_json(p), **_figures(res)})
            log(f"planner {spec} {topo.name} {name}: {res.iteration_time_s * 1e3:.4f} ms")
    return out


def compute(random_pairs: int, log) -> list[dict]:
    return _quick_cells(log) + _planner_cells(random_pairs, log)


def _close(a: float, b: float, rtol: float) -> bool:
    if a == b or (math.isinf(a) and math.isinf(b)):
        return True
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def compare(old: dict, new: dict, rtol: float) -> list[str]:
    """Differences between two cells (empty when equal)."""
    diffs = []
    if old.get("plan") != new.get("plan"):
        diffs.append("plan differs")
    if not _close(old["time_s"], new["time_s"], rtol):
        diffs.append(f"time {old['time_s']!r} -> {new['time_s']!r}")
    if "oom" in old and old["oom"] != new["oom"]:
        diffs.append(f"oom {old['oom']} -> {new['oom']}")
    if "peak_bytes" in old:
        bad = [d for d, (a, b) in enumerate(zip(old["peak_bytes"], new["peak_bytes"])) if not _close(a, b, rtol)]
        if bad or len(old["peak_bytes"]) != len(new["peak_bytes"]):
            diffs.append(f"peak memory differs on devices {bad[:8]}")
    return diffs


def report(tag: str, what: str, old: list[dict], new: list[dict], rtol: float) -> int:
    """Print every cell of ``new`` that differs from ``old`` and a summary line; the count."""
    bad = 0
    for o, n in zip(old, new):
        d = compare(o, n, rtol)
        if d:
            bad += 1
            print(f"{tag} {o['suite']} {o['model']} {o['topology'][:40]} {o['method']}: {'; '.join(d)}")
    print(f"{what}: {len(old) - bad}/{len(old)} identical")
    return bad


def resimulate(cells: list[dict], log) -> list[dict]:
    """The stored plans of ``cells`` simulated with the current code."""
    from evaluation.planner_bench import _load
    from tag.graph import capture
    from tag.plan import GroupPlan
    from tag.sim import Simulator
    from tag.topology import load_topology
    from tag.workloads import load_workload

    graphs: dict = {}
    sims: dict = {}
    out = []
    for c in cells:
        if "plan" not in c:
            out.append(c)
            continue
        key = (c["suite"], c["model"], c["batch"], c["groups"])
        if key not in graphs:
            if c["suite"] == "quick":
                graphs[key] = capture(load_workload(c["model"], batch=c["batch"], seed=0), num_groups=c["groups"]).graph
            else:
                graphs[key] = _load(c["model"], c["batch"], c["groups"], Path("runs/planner_bench/graphs"))
        t = c["topology"]
        skey = key + (t,)
        if skey not in sims:
            from tag.cost import CostModel
            topo = load_topology(json.loads(t) if t.startswith("{") else t)
            sims[skey] = Simulator(graphs[key], topo, CostModel.for_topology(graphs[key], topo))
        res = sims[skey].run([GroupPlan(**g) for g in c["plan"]])
        out.append({**c, **_figures(res)})
    log(f"re-simulated {len(out)} stored plans")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the golden figures here")
    ap.add_argument("--check", help="compare with this golden file")
    ap.add_argument("--random", type=int, default=30, help="random planner pairs (default 30)")
    ap.add_argument("--rtol", type=float, default=1e-9)
    ap.add_argument("--resim-only", action="store_true", help="with --check: only re-simulate the stored plans")
    args = ap.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    if args.check:
        old = json.loads(Path(args.check).read_text())["cells"]
        bad = report("RESIM", "re-simulated stored plans", old, resimulate(old, log), args.rtol)
        if not args.resim_only:
            bad += report("SEARCH", "searched again", old, compute(args.random, log), args.rtol)
        print(f"{time.perf_counter() - t0:.0f} s")
        return 1 if bad else 0
    cells = compute(args.random, log)
    from tag.io import write_json
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out), {"command": "python -m evaluation.golden " + " ".join(argv or sys.argv[1:]),
                                "cells": cells})
    print(f"{len(cells)} cells, {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
