"""Simulator regression: a fixed set of mixed plans gives bit-identical results to the reference
values in ``tests/data/sim_reference.json``.

The reference was computed by the simulator before its speed work (data-parallel, PS, mp,
MCTS-like playouts, random plans, a random walk and SFB plans on a 16-group GPT-2 on the 16-GPU,
4-machine cluster, roofline costs). Every optimisation of the simulator must leave these floats
unchanged (``==``, not approximately). A deliberate change of the simulator's semantics
regenerates the file (``.venv/bin/python tests/test_sim_reference.py``) and says why in the commit.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from evaluation.sim_speed import mcts_actions, random_group

SPEC = "gpt2:n_layer=1,n_embd=32,n_head=2,seq=16"
BATCH, GROUPS = 16, 16
TOPOLOGY = "topologies/cluster-16gpu-4m.yaml"
DATA = Path(__file__).parent / "data" / "sim_reference.json"


# The plan generators are the speed benchmark's own, so the reference covers what is timed.
_random_group, _actions = random_group, mcts_actions


def make_plans(graph, topo, costs) -> list[tuple[str, list]]:
    """(label, groups) of every reference plan, deterministic."""
    from tag.compress import find_candidates
    from tag.cost.baselines import baseline_plan
    from tag.plan import GroupPlan

    rng = random.Random(1234)
    k, n = graph.num_groups, topo.num_devices
    out = [(name, baseline_plan(name, graph, topo, costs).groups) for name in ("dp", "dp-prop", "mp", "single")]
    base = baseline_plan("dp-prop", graph, topo, costs).groups
    actions = _actions(topo, costs.device_speeds())
    for i in range(10):
        g0 = rng.randrange(k)
        g1 = min(k, g0 + rng.randint(1, 8))
        out.append((f"mcts{i}", base[:g0] + [rng.choice(actions)] * (g1 - g0) + base[g1:]))
    for i in range(8):
        out.append((f"random{i}", [_random_group(rng, graph, g, n) for g in range(k)]))
    walk = [_random_group(rng, graph, g, n) for g in range(k)]
    for i in range(6):
        g = rng.randrange(k)
        walk[g] = _random_group(rng, graph, g, n)
        out.append((f"walk{i}", list(walk)))
    by_group: dict[int, list[str]] = {}
    for c in find_candidates(graph):
        by_group.setdefault(c.group, []).append(c.op_name)
    for i, (devs, sync) in enumerate([([0, 1, 4, 5], "allreduce"), ([8, 12], "ps"), (list(range(16)), "allreduce")]):
        groups = list(base)
        for g, names in by_group.items():
            shares = [1.0 / len(devs)] * len(devs)
            groups[g] = GroupPlan(list(devs), shares, sync, devs[-1] if sync == "ps" else None,
                                  sfb=names[: 1 + (i + g) % len(names)])
        out.append((f"sfb{i}", groups))
    return out


def summarise(r) -> dict:
    return {"iteration_time_s": r.iteration_time_s, "peak_memory_bytes": list(r.peak_memory_bytes),
            "compute_time_s": list(r.compute_time_s), "comm_time_s": list(r.comm_time_s),
            "group_finish_s": list(r.group_finish_s), "group_compute_s": list(r.group_compute_s),
            "oom": r.oom, "critical_path": list(r.critical_path)}


def setup(graph):
    from tag.cost.model import CostModel
    from tag.topology import load_topology

    topo = load_topology(TOPOLOGY)
    return topo, CostModel.roofline_only(graph, topo)


def compute(graph) -> dict:
    from tag.sim import Simulator

    topo, costs = setup(graph)
    sim = Simulator(graph, topo, costs)
    return {"signature": graph.signature(),
            "results": {label: summarise(sim.run(groups)) for label, groups in make_plans(graph, topo, costs)}}


@pytest.fixture(scope="module")
def graph(captured):
    return captured(SPEC, batch=BATCH, groups=GROUPS).graph


def test_reference_results_bit_identical(graph):
    from tag.sim import Simulator

    ref = json.loads(DATA.read_text())
    assert ref["signature"] == graph.signature(), "captured graph changed: regenerate the reference"
    topo, costs = setup(graph)
    plans = make_plans(graph, topo, costs)
    assert sorted(ref["results"]) == sorted(label for label, _ in plans)
    sim = Simulator(graph, topo, costs)
    for label, groups in plans:  # cold caches, plan after plan
        assert summarise(sim.run(groups)) == ref["results"][label], label
    for label, groups in reversed(plans):  # warm caches
        assert summarise(sim.run(groups)) == ref["results"][label], label
    fresh = Simulator(graph, topo, costs)
    for label, groups in plans[::7]:
        assert summarise(fresh.run(groups)) == ref["results"][label], label


@pytest.mark.parametrize("topology", [TOPOLOGY, "topologies/local-cpu2.yaml"])
def test_fast_loop_matches_reference_loop(graph, topology):
    """The fast event loop, the reference loop (which records every task) and the old per-pair
    flow builder (:func:`tag.sim.units.pair_flows`) agree exactly on many random plans (on CPU
    devices too, whose syncs are deferred and bucketed)."""
    from tag.cost.model import CostModel
    from tag.sim import Simulator
    from tag.sim.units import pair_flows
    from tag.topology import load_topology

    topo = load_topology(topology)
    costs = CostModel.roofline_only(graph, topo)
    sim = Simulator(graph, topo, costs)
    rng = random.Random(99)
    n = topo.num_devices
    plans = [groups for _, groups in make_plans(graph, topo, costs)] if topology == TOPOLOGY else []
    plans += [[_random_group(rng, graph, g, n) for g in range(graph.num_groups)] for _ in range(20)]
    for groups in plans:
        fast = sim.run(groups)
        gds = sim.deploy(groups)
        ref = sim.run_reference(gds)
        assert summarise(fast) == summarise(ref)
        assert fast.critical_path == ref.critical_path
        for (g1, g2), _ in sim.static.edges.items():
            if g1 == g2 and not gds[g1].mp:
                continue
            got = sim.pair(g1, gds[g1], g2, gds[g2]).flows
            assert got == pair_flows(sim.static, sim.comm, g1, gds[g1], g2, gds[g2]), (g1, g2)


if __name__ == "__main__":  # regenerate the reference (only for a deliberate change of semantics)
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tag.graph import capture
    from tag.workloads import load_workload

    g = capture(load_workload(SPEC, batch=BATCH), num_groups=GROUPS).graph
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(compute(g), indent=1) + "\n")
    print(f"wrote {DATA}", file=sys.stderr)
