"""Simulator speed: simulated iterations per second for a 64-group graph on a 16-GPU, 4-machine
topology (``topologies/cluster-16gpu-4m.yaml``), one core, plus a cProfile of where time goes.

Workloads of :meth:`Simulator.run`:

* ``dp`` / ``dp-prop`` / ``mp``: one baseline plan simulated over and over (warm caches);
* ``mcts``: MCTS-like playouts: from the ``dp-prop`` plan, a random contiguous run of 1-16 groups
  gets one action (all devices, one machine, two machines or one device; all-reduce or PS;
  speed-proportional shares) -- TAG's actions place groups on device sets, so a plan has few
  layout boundaries;
* ``walk``: a random walk, each plan differing from the previous in one group that gets an
  arbitrary random deployment (random subset, random shares, all-reduce / PS / mp): nearly every
  group boundary re-partitions, ~1,300 point-to-point transfers per iteration (worst case);
* ``random``: independent random plans for every group (cold caches).

    .venv/bin/python evaluation/sim_speed.py [--model gpt2:n_layer=4] [--batch 32] [--seconds 3]
    .venv/bin/python evaluation/sim_speed.py --vs ../other-worktree [--rounds 20] [--seconds 6]
    .venv/bin/python evaluation/sim_speed.py --scale [--budgets 50,200] [--out FILE.json]

``--scale``: the 128-group graph of a 12-layer GPT-2 (width 768, sequence 128, batch 512; captured
once into ``--graphs``) on the shipped topologies at scale (``hetero-64gpu``,
``cloud-256gpu-3zones``, ``h100-512gpu``): set-up times, simulations per second of the baselines
and of search-like plans (a random run of 1-16 groups given a random action of the planner's own
action space), then the planner's wall time on 128 groups x 512 GPUs (:func:`tag.find_plan`,
set-up + search + compression, capture excluded) per ``--budgets``. Results:
``evaluation/results/sim-speed/scale.md``.

``--vs`` times this tree against another one (the previous commit, say) in two worker processes,
alternating short rounds, so the load of a shared machine falls on both alike.

Simulated iterations/s, best of 3 alternating rounds on a shared 2-core machine (details and where
the time goes: ``evaluation/results/sim-speed/sim_speed.md`` at 6f39a32); results bit-identical:

    workload   before (84a59ac)   after (fast loop, pair templates)
    dp                    2,084   3,063
    dp-prop               2,054   3,157
    mp                      872   3,112
    mcts                    780   1,722
    walk                    181     533
    random                   13      56
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import sys
import time
from pathlib import Path


def random_group(rng: random.Random, graph, g: int, n: int):
    from tag.plan import GroupPlan, group_positions

    r = rng.random()
    if r < 0.15:
        lo, hi = group_positions(graph, g)
        k = rng.randint(1, min(3, hi - lo, n))
        devs = rng.sample(range(n), k)
        return GroupPlan(devs, [1.0] * k, "mp", None, [lo] + sorted(rng.sample(range(lo + 1, hi), k - 1)))
    k = rng.choice([x for x in (1, 2, 4, 8, 16) if x <= n])
    devs = sorted(rng.sample(range(n), k))
    w = [rng.randint(1, 4) for _ in devs]
    shares = [x / sum(w) for x in w]
    shares[-1] = 1.0 - sum(shares[:-1])
    if r < 0.3:
        return GroupPlan(devs, shares, "ps", rng.randrange(n))
    return GroupPlan(devs, shares, "allreduce")


def mcts_actions(topo, speeds):
    """Device sets (all, each machine, each pair of machines, each device) x (all-reduce, PS)."""
    from itertools import combinations

    from tag.plan import GroupPlan

    machines = [topo.devices_of_machine(m) for m in range(topo.num_machines)]
    sets = [list(range(topo.num_devices))] + machines + [a + b for a, b in combinations(machines, 2)]
    sets += [[d] for d in range(topo.num_devices)]
    out = []
    for devs in sets:
        tot = sum(speeds[d] for d in devs)
        shares = [speeds[d] / tot for d in devs]
        out.append(GroupPlan(devs, shares, "allreduce"))
        if len(devs) > 1:
            out.append(GroupPlan(devs, shares, "ps", devs[0]))
    return out


def rate(fn, seconds: float) -> tuple[float, int]:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0), n


def build(args):
    """(header line, Simulator, {name: one simulation of that workload}), deterministic."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        from tag.cost.baselines import baseline_plan
    except ImportError:  # a tree before 2026-11-26 (--vs 3b5f921): the baselines were in tag.plan
        from tag.plan.baselines import baseline_plan
    from tag.graph import capture
    from tag.sim import Simulator
    from tag.topology import load_topology
    from tag.workloads import load_workload

    graph = capture(load_workload(args.model, batch=args.batch), num_groups=args.groups).graph
    topo = load_topology(args.topology)
    t0 = time.perf_counter()
    sim = Simulator(graph, topo)
    build_s = time.perf_counter() - t0
    n = topo.num_devices
    head = (f"{graph.model} batch {graph.batch_size}: {graph.num_groups} groups, {len(graph.ops)} ops, "
            f"{len(sim.static.pairs)} group pairs with tensors; {topo.name}: {n} devices, {topo.num_machines} "
            f"machines; Simulator built in {build_s * 1e3:.0f} ms")
    rng = random.Random(0)
    workloads = {}
    for name in ("dp", "dp-prop", "mp"):
        plan = baseline_plan(name, graph, topo, sim.costs)
        workloads[name] = (lambda p=plan: sim.run(p.groups))
    walk = [random_group(rng, graph, g, n) for g in range(graph.num_groups)]
    base = baseline_plan("dp-prop", graph, topo, sim.costs).groups
    actions = mcts_actions(topo, sim.costs.device_speeds())

    def playout():
        g0 = rng.randrange(graph.num_groups)
        g1 = min(graph.num_groups, g0 + rng.randint(1, 16))
        act = rng.choice(actions)
        sim.run(base[:g0] + [act] * (g1 - g0) + base[g1:])

    def walk_step():
        g = rng.randrange(graph.num_groups)
        walk[g] = random_group(rng, graph, g, n)
        sim.run(walk)

    def random_plan():
        sim.run([random_group(rng, graph, g, n) for g in range(graph.num_groups)])

    workloads["mcts"] = playout
    workloads["walk"] = walk_step
    workloads["random"] = random_plan
    workloads["grid"] = grid_plans(graph, topo, sim)
    workloads["layout"] = grid_plans(graph, topo, sim, repeat=True)
    return head, sim, workloads


def grid_plans(graph, topo, sim, repeat: bool = False):
    """One simulation of the Megatron-style layout grid's plans (:func:`tag.parallel.layout.layout_grid`,
    built on the first call): the next layout in grid order each call, new deployments as the
    planner's grid meets them (``grid``), or the middle layout of the grid again and again (``layout``)."""
    from tag.parallel.layout import layout_grid, layout_plan

    state: dict = {}

    def run():
        if "plans" not in state:
            lays = layout_grid(graph, topo)
            state["plans"] = [lays[len(lays) // 2]] if repeat else lays
            state["i"] = 0
        lays = state["plans"]
        lay = lays[state["i"] % len(lays)]
        state["i"] += 1
        p = state.get(lay)
        if p is None:
            p = layout_plan(graph, topo, lay, sim.costs)
            if repeat:
                state[lay] = p
        sim.run(p.groups, pipeline=p.pipeline)

    return run


def worker(args) -> int:
    """Serve ``NAME COUNT`` lines on stdin: run workload NAME COUNT times, print the seconds."""
    _, _, workloads = build(args)
    print("ready", flush=True)
    for line in sys.stdin:
        name, count = line.split()
        fn = workloads[name]
        t0 = time.perf_counter()
        for _ in range(int(count)):
            fn()
        print(time.perf_counter() - t0, flush=True)
    return 0


def paired(args) -> int:
    """This tree (A) against the tree ``args.vs`` (B): two worker processes with the same graph and
    workloads, each running this script with its own tree's ``tag``; per workload, ``--rounds``
    chunks of about ``--seconds / --rounds`` seconds each, A and B in turn (A B, B A, ...), so a
    change of the machine's load hits both alike. Prints every round and the medians."""
    import statistics
    import subprocess

    here = Path(__file__).resolve().parent.parent
    trees = {"A": here, "B": Path(args.vs).resolve()}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model, "--batch",
           str(args.batch), "--groups", str(args.groups), "--topology", args.topology]
    procs = {}
    for key, tree in trees.items():
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        procs[key] = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
    for p in procs.values():
        assert p.stdout.readline().strip() == "ready"

    def ask(key: str, name: str, count: int) -> float:
        p = procs[key]
        p.stdin.write(f"{name} {count}\n")
        p.stdin.flush()
        return float(p.stdout.readline())

    print(f"A: {trees['A']}  B: {trees['B']}  ({args.rounds} rounds of ~{args.seconds / args.rounds:.2f} s "
          f"per workload and tree, alternating)")
    for name in args.workloads.split(","):
        per = max(ask("A", name, 3), ask("B", name, 3)) / 3  # warm-up and calibration
        count = max(1, round(args.seconds / args.rounds / per))
        rates: dict[str, list[float]] = {"A": [], "B": []}
        for r in range(args.rounds):
            for key in ("AB" if r % 2 == 0 else "BA"):
                rates[key].append(count / ask(key, name, count))
        ratio = [a / b for a, b in zip(rates["A"], rates["B"])]
        print(f"  {name:<8} A {statistics.median(rates['A']):8.0f}  B {statistics.median(rates['B']):8.0f} sims/s "
              f"(medians, {count} runs a round)  A/B median {statistics.median(ratio):.3f} "
              f"[{min(ratio):.3f} .. {max(ratio):.3f}]")
        print("           A " + " ".join(f"{x:.0f}" for x in rates["A"]))
        print("           B " + " ".join(f"{x:.0f}" for x in rates["B"]))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    return 0


SCALE_MODEL = ("gpt2:n_layer=12,n_embd=768,n_head=12,seq=128", 512, 128)
"""(spec, global batch, op-groups) of ``--scale``."""
SCALE_TOPOLOGIES = ("hetero-64gpu", "cloud-256gpu-3zones", "h100-512gpu")


def _scale_topology(graph, name: str, seconds: float) -> dict:
    """Set-up seconds and simulations per second of one shipped topology (``--scale``)."""
    import numpy as np

    from tag.cost import CostModel
    from tag.cost.baselines import baseline_plan
    from tag.search.space import ActionSpace
    from tag.sim import Simulator
    from tag.topology import load_topology

    t0 = time.perf_counter()
    topo = load_topology(name)
    t_topo = time.perf_counter() - t0
    t0 = time.perf_counter()
    costs = CostModel.for_topology(graph, topo)
    t_cost = time.perf_counter() - t0
    t0 = time.perf_counter()
    sim = Simulator(graph, topo, costs)
    t_sim = time.perf_counter() - t0
    t0 = time.perf_counter()
    space = ActionSpace(graph, topo, cost_model=costs)
    _ = space.group_canonical
    t_space = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    plans = {n: baseline_plan(n, graph, topo, costs).groups for n in ("dp", "dp-prop")}
    base = plans["dp-prop"]

    def playout():
        g0 = int(rng.integers(graph.num_groups))
        g1 = min(graph.num_groups, g0 + int(rng.integers(1, 17)))
        a = int(rng.integers(space.num_actions))
        sim.run(base[:g0] + [space.group_plan(g, a) for g in range(g0, g1)] + base[g1:])

    row = {"devices": topo.num_devices, "machines": topo.num_machines, "actions": space.num_actions,
           "load_topology_s": t_topo, "cost_model_s": t_cost, "simulator_s": t_sim, "action_space_s": t_space,
           "sims_per_s": {}}
    print(f"{name}: {topo.num_devices} devices / {topo.num_machines} machines, {space.num_actions} actions; "
          f"set-up s: topology {t_topo:.2f}, cost model {t_cost:.2f}, simulator {t_sim:.2f}, "
          f"action space {t_space:.2f}", flush=True)
    for wname, fn in (("dp", lambda: sim.run(plans["dp"])), ("dp-prop", lambda: sim.run(plans["dp-prop"])),
                      ("search", playout)):
        fn()  # warm
        r, count = rate(fn, seconds)
        row["sims_per_s"][wname] = r
        print(f"  {wname:<8} {r:8.2f} sims/s  ({count} runs)", flush=True)
    return row


def scale(args) -> dict:
    """Set-up, simulations per second and plan time at 64-512 GPUs (see the module docstring)."""
    import torch

    torch.set_num_threads(1)
    from tag.data.generate import load_graph
    from tag.planner import PlannerConfig, find_plan
    from tag.topology import load_topology

    spec, batch, groups = SCALE_MODEL
    graph = load_graph(args.graphs, spec, batch, groups)
    out: dict = {"model": spec, "batch": batch, "groups": graph.num_groups, "ops": len(graph.ops), "topologies": {}}
    print(f"{spec} batch {batch}: {graph.num_groups} groups, {len(graph.ops)} ops")
    budgets = [int(b) for b in args.budgets.split(",") if b]
    for name in SCALE_TOPOLOGIES:
        out["topologies"][name] = _scale_topology(graph, name, args.seconds)
    topo = load_topology(SCALE_TOPOLOGIES[-1])
    out["plan"] = []
    for budget in budgets:
        t0 = time.perf_counter()
        p = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=budget, seed=0))
        wall = time.perf_counter() - t0
        m = p.meta
        out["plan"].append({"topology": topo.name, "prior": "uniform", "budget": budget, "wall_s": wall,
                            "search_time_s": m["search_time_s"], "sim_calls": m["sim_calls"],
                            "iteration_s": p.predicted_iteration_time_s, "dp_even_s": m["dp_even_time_s"],
                            "compression": m["compression"]})
        print(f"find_plan {graph.num_groups} groups x {topo.num_devices} GPUs, uniform prior, {budget} playouts: "
              f"{wall:.1f} s wall (set-up + search {m['search_time_s']:.1f} s, {m['sim_calls']} simulations); "
              f"plan {p.predicted_iteration_time_s * 1e3:.2f} ms vs dp {m['dp_even_time_s'] * 1e3:.2f} ms; "
              f"{m['compression']}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2:n_layer=4")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--topology", default="cluster-16gpu-4m")
    ap.add_argument("--seconds", type=float, default=3.0, help="per workload (with --vs: per workload and tree)")
    ap.add_argument("--profile", default="mcts", help="workload to cProfile (dp, dp-prop, mp, mcts, walk, random)")
    ap.add_argument("--vs", metavar="TREE", help="compare with the source tree TREE (e.g. a git worktree of the "
                    "previous commit), alternating: see paired()")
    ap.add_argument("--rounds", type=int, default=20, help="with --vs: alternations per workload")
    ap.add_argument("--workloads", default="dp,dp-prop,mp,mcts,walk,random",
                    help="with --vs: the workloads to time (also grid: the layout grid's plans in turn, "
                    "layout: its middle layout again and again)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scale", action="store_true", help="64-512 GPU topologies and the planner's time at 512 GPUs")
    ap.add_argument("--budgets", default="50,200", help="with --scale: playout budgets of the planner runs")
    ap.add_argument("--graphs", default="runs/scale/graphs", help="with --scale: captured-graph cache folder")
    ap.add_argument("--out", help="with --scale: write the numbers as JSON here")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.scale:
        res = scale(args)
        if args.out:
            from tag.io import write_json
            write_json(args.out, res)
        return 0
    if args.vs:
        return paired(args)
    head, _, workloads = build(args)
    print(head)
    for name, fn in workloads.items():
        if name in ("grid", "layout"):  # (--vs --workloads grid,layout)
            continue
        r, count = rate(fn, args.seconds)
        print(f"  {name:<8} {r:8.0f} sims/s  ({count} runs)")
    prof = cProfile.Profile()
    fn = workloads[args.profile]
    prof.enable()
    for _ in range(300):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    print(f"cProfile of 300 '{args.profile}' runs (by own time):")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
