"""Simulator regression: a fixed set of mixed plans gives bit-identical results to the reference
values in ``tests/data/sim_reference.json``, and bit-identical timelines (every event of
``trace=True``) and critical paths to the digests in ``tests/data/sim_traces.json``.

The reference was computed by the simulator before its speed work (data-parallel, PS, mp,
MCTS-like playouts, random plans, a random walk and SFB plans on a 16-group GPT-2 on the 16-GPU,
4-machine cluster, roofline costs). Every optimisation of the simulator must leave these floats
unchanged (``==``, not approximately). A deliberate change of the simulator's semantics
regenerates the files (``.venv/bin/python tests/test_sim_reference.py``) and says why in the commit.

The timeline digests were recorded by the simulator of commit 3b5f921, which had two event loops (a
reference loop recording every task, a fast one recording none); the one event loop with its
optional recorder reproduces them.
"""

from __future__ import annotations

import hashlib
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
TRACES = Path(__file__).parent / "data" / "sim_traces.json"
_SLOW = {"name": "slow", "tflops": 0.5, "memory": "16 GB", "memory_bandwidth": "20 GB/s"}
CPU_TOPOLOGY = {"name": "cpu-2x2", "network": {"bandwidth": "1 GB/s", "latency": 1e-4},
                "machines": [{"name": m, "gpu": _SLOW, "count": 2, "intra_bandwidth": "5 GB/s"} for m in "ab"]}
"""Two machines of two slow devices simulated as CPU ranks (:attr:`tag.sim.Simulator.shared_stream`:
syncs after the compute, bucketed by :meth:`tag.sim.Simulator.sync_jobs`). Not named ``cpu``: a
``cpu`` device's roofline depends on the host's core count and torch's threads."""


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


def wake_costs(graph, topo):
    """Roofline costs with a wake penalty on every device: 30% of the fwd/bwd time after a long
    idle gap (gap 50 ms, time constant 10 ms)."""
    from tag.cost.model import CostModel

    costs = CostModel.roofline_only(graph, topo)
    for dc in {id(dc): dc for dc in costs._dev}.values():
        dc.wake = dc.table[:, :2] * 0.3
        dc.wake_gap_s, dc.wake_tau_s = 0.05, 0.01
    return costs


def trace_plans(graph) -> list[tuple[str, object, list]]:
    """(key, simulator, groups) of every plan whose timeline is stored: the reference plans and 20
    random plans on the 16-GPU cluster, 20 random plans on :data:`CPU_TOPOLOGY`, 10 random plans
    with wake penalties on the cluster."""
    from tag.cost.model import CostModel
    from tag.sim import Simulator
    from tag.topology import load_topology

    out = []
    for topology in (TOPOLOGY, CPU_TOPOLOGY):
        topo = load_topology(topology)
        costs = CostModel.roofline_only(graph, topo)
        sim = Simulator(graph, topo, costs)
        if topology is CPU_TOPOLOGY:
            sim.shared_stream = [True] * topo.num_devices  # read when a group is first deployed
        rng = random.Random(99)
        plans = make_plans(graph, topo, costs) if topology == TOPOLOGY else []
        plans += [(f"random-b{i}", [_random_group(rng, graph, g, topo.num_devices) for g in range(graph.num_groups)])
                  for i in range(20)]
        out += [(f"{topo.name}/{label}", sim, groups) for label, groups in plans]
    topo = load_topology(TOPOLOGY)
    sim = Simulator(graph, topo, wake_costs(graph, topo))
    rng = random.Random(7)
    for i in range(10):
        out.append((f"wake/random{i}", sim, [_random_group(rng, graph, g, topo.num_devices)
                                             for g in range(graph.num_groups)]))
    return out


def trace_digest(r) -> str:
    """SHA-256 of a traced result's timeline (every event in order, times as exact float hex) and
    critical path."""
    h = hashlib.sha256()
    for e in r.events:
        h.update(f"{e.name}|{e.device}|{e.stream}|{e.start.hex()}|{e.end.hex()}|{e.cat}\n".encode())
    h.update("\n".join(r.critical_path).encode())
    return h.hexdigest()


def compute_traces(graph) -> dict:
    return {"signature": graph.signature(),
            "traces": {key: trace_digest(sim.run(groups, trace=True)) for key, sim, groups in trace_plans(graph)}}


def test_traces_bit_identical(graph):
    """The traced run gives the stored timeline and critical path (events, times to the bit), and
    the same result as the untraced run, whose critical path is computed by a replay."""
    ref = json.loads(TRACES.read_text())
    assert ref["signature"] == graph.signature(), "captured graph changed: regenerate the reference"
    plans = trace_plans(graph)
    assert sorted(ref["traces"]) == sorted(key for key, _, _ in plans)
    events = 0
    for key, sim, groups in plans:
        traced = sim.run(groups, trace=True)
        assert trace_digest(traced) == ref["traces"][key], key
        plain = sim.run(groups)
        assert plain.events is None
        assert summarise(plain) == summarise(traced), key
        events += len(traced.events)
    assert events > 10_000


def test_pair_templates_match_pair_flows(graph):
    """The cached pair templates (:class:`tag.sim.units.PairTemplate`) give the flows of the old
    per-pair flow builder (:func:`tag.sim.units.pair_flows`) on many random plans."""
    from tag.cost.model import CostModel
    from tag.sim import Simulator
    from tag.sim.units import pair_flows
    from tag.topology import load_topology

    for topology in (TOPOLOGY, "topologies/local-cpu2.yaml"):
        topo = load_topology(topology)
        costs = CostModel.roofline_only(graph, topo)
        sim = Simulator(graph, topo, costs)
        rng = random.Random(99)
        n = topo.num_devices
        plans = [groups for _, groups in make_plans(graph, topo, costs)] if topology == TOPOLOGY else []
        plans += [[_random_group(rng, graph, g, n) for g in range(graph.num_groups)] for _ in range(20)]
        for groups in plans:
            gds = sim.deploy(groups)
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
    TRACES.write_text(json.dumps(compute_traces(g), indent=1) + "\n")
    print(f"wrote {DATA} and {TRACES}", file=sys.stderr)
