"""Simulator: exact hand-computed expectations on tiny hand-built graphs and topologies.

Graph (``chain_graph(2)``, batch 8): group 0 = f0(x, w0) -> a0 (400 B/sample); group 1 =
f1(a0, w1) -> loss; backward: group 1 reads a0 and makes ga0 (400 B/sample), group 0 reads ga0.
Costs: fwd 1 / 2 ms per sample, bwd 2 / 4 ms per sample, opt 1 ms per group; params 1000 B.
"""

from __future__ import annotations

import json

import pytest
from test_sim_tools import chain_graph, hand_costs, topology

from tag.errors import PlanError
from tag.plan import GroupPlan, new_plan
from tag.sim import Simulator, lower_bound, simulate

F, BW, OPT = [1e-3, 2e-3], [2e-3, 4e-3], [1e-3, 1e-3]
NET = 1e6  # bytes/s
LAT = 1e-3  # s


def _sim(topo, graph=None, bucket_bytes=None, **kw):
    graph = graph or chain_graph(2)
    return Simulator(graph, topo, hand_costs(graph, topo, F, BW, OPT, **kw), bucket_bytes), graph


def _two_machines(memory="16 GB"):
    return topology([("a", 1, None, 0.0), ("b", 1, None, 0.0)], net_bw=NET, net_lat=LAT, memory=memory)


def dp(devices, shares=None, sync="allreduce", server=None):
    return GroupPlan(list(devices), shares or [1 / len(devices)] * len(devices), sync, server)


def test_compute_only_single_device():
    sim, _ = _sim(_two_machines())
    r = sim.run([dp([0]), dp([0])])
    assert r.iteration_time_s == pytest.approx(8 * (1e-3 + 2e-3 + 2e-3 + 4e-3) + 2e-3)
    assert r.compute_time_s[0] == pytest.approx(r.iteration_time_s)
    assert r.comm_time_s == [0.0, 0.0] and r.compute_time_s[1] == 0.0
    assert r.idle_time_s[1] == pytest.approx(r.iteration_time_s)
    assert r.group_compute_s == pytest.approx([8 * 3e-3 + 1e-3, 8 * 6e-3 + 1e-3])
    assert not r.oom
    assert r.critical_path == ["fwd g0 @d0", "fwd g1 @d0", "bwd g1 @d0", "bwd g0 @d0", "opt @d0"]


def test_transfer_between_devices():
    sim, _ = _sim(_two_machines())
    r = sim.run([dp([0]), dp([1])])
    x = LAT + 400 * 8 / NET  # a0 forward, ga0 backward: 3200 B each over the network
    t = 8 * (1e-3 + 2e-3 + 4e-3 + 2e-3) + 2 * x + 1e-3
    assert r.iteration_time_s == pytest.approx(t)
    assert r.comm_time_s == pytest.approx([2 * x, 2 * x])
    assert r.group_finish_s == pytest.approx([t - 1e-3, 8 * 7e-3 + x])
    assert [n.split(" ")[0] for n in r.critical_path] == ["fwd", "send", "fwd", "bwd", "send", "bwd", "opt"]


def test_ring_allreduce_two_machines():
    """Buckets of 1000 B (one group each): g1's all-reduce starts when g1's backward ends and
    overlaps g0's backward; g0's starts when g0's ends."""
    sim, _ = _sim(_two_machines(), bucket_bytes=1000)
    r = sim.run([dp([0, 1]), dp([0, 1])])
    ar = 2 * (2 - 1) / 2 * 1000 / NET + 2 * (2 - 1) * LAT  # 2(n-1)/n S/bw + 2(n-1) lat
    g1_ready = 4 * (1e-3 + 2e-3 + 4e-3)
    g0_ready = g1_ready + 4 * 2e-3
    assert g0_ready > g1_ready + ar  # g0's sync does not wait for g1's
    assert r.iteration_time_s == pytest.approx(g0_ready + ar + 2e-3)
    assert r.comm_time_s == pytest.approx([2 * ar, 2 * ar])
    assert r.critical_path[-2:] == ["allreduce g0", "opt @d0"]
    ev = [e for e in sim.run([dp([0, 1]), dp([0, 1])], trace=True).events if e.cat == "allreduce" and e.device == 0]
    assert [(e.name, e.start) for e in ev] == [("allreduce g1", pytest.approx(g1_ready)),
                                               ("allreduce g0", pytest.approx(g0_ready))]


def test_gradient_buckets_as_ddp():
    """With DDP's caps (first bucket 1 MiB, then 25 MiB) the two 1000 B syncs are one bucket,
    launched when its last group's (g0's) backward ends: one all-reduce of 2000 B, nothing
    overlapped. Groups of 1.5 MiB fill the first bucket alone: g1's all-reduce starts when its
    backward ends, overlapping g0's."""
    sim, _ = _sim(_two_machines())
    ar2 = 2000 / NET + 2 * LAT
    g0_ready = 4 * (1e-3 + 2e-3 + 4e-3) + 4 * 2e-3
    r = sim.run([dp([0, 1]), dp([0, 1])], trace=True)
    assert r.iteration_time_s == pytest.approx(g0_ready + ar2 + 2e-3)
    assert r.critical_path[-2:] == ["allreduce g1+g0", "opt @d0"]
    big = 3 * 2**19  # 1.5 MiB of parameters per group
    graph = chain_graph(2, param_bytes=big)
    sim = Simulator(graph, _two_machines(), hand_costs(graph, _two_machines(), F, BW, OPT))
    jobs = sim.sync_jobs(sim.deploy([dp([0, 1]), dp([0, 1])]))
    assert [(gs, j.sync_bytes) for gs, j in jobs] == [((1,), big), ((0,), big)]


def test_cpu_syncs_wait_for_compute():
    """A CPU rank computes on every core it has: its syncs cannot overlap its compute (the GPU
    case above overlaps g1's sync with g0's backward)."""
    topo = topology([("a", 1, None, 0.0), ("b", 1, None, 0.0)], net_bw=NET, net_lat=LAT, gpu="cpu")
    sim, _ = _sim(topo)
    assert sim.shared_stream == [True, True]
    r = sim.run([dp([0, 1]), dp([0, 1])])
    # Both groups' syncs (1000 B each) are one bucketed all-reduce of 2000 B after the compute.
    ar2 = 2 * (2 - 1) / 2 * 2000 / NET + 2 * (2 - 1) * LAT
    g0_ready = 4 * (1e-3 + 2e-3 + 4e-3) + 4 * 2e-3
    assert r.iteration_time_s == pytest.approx(g0_ready + ar2 + 2e-3)
    assert r.comm_time_s == pytest.approx([ar2, ar2])
    ref = sim.run([dp([0, 1]), dp([0, 1])], trace=True)
    assert ref.iteration_time_s == r.iteration_time_s
    assert ref.critical_path[-2:] == ["allreduce g1+g0", "opt @d0"]


def test_cpu_sync_buckets():
    """Syncs of one kind, replica set and server share a bucket (CPU and GPU alike), launched at its
    last group in reverse group order: the PS bucket of group 1 comes before the all-reduce bucket
    of groups 2 and 0."""
    cpu = topology([("a", 1, None, 0.0), ("b", 1, None, 0.0)], net_bw=NET, net_lat=LAT, gpu="cpu")
    graph = chain_graph(3)
    plans = [dp([0, 1]), dp([0, 1], sync="ps", server=0), dp([0, 1])]
    jobs = {}
    for name, topo in (("cpu", cpu), ("gpu", _two_machines())):
        sim = Simulator(graph, topo, hand_costs(graph, topo, [1e-3] * 3, [2e-3] * 3, [1e-3] * 3))
        jobs[name] = sim.sync_jobs(sim.deploy(plans))
    assert [(gs, j.sync) for gs, j in jobs["cpu"]] == [((1,), "ps"), ((2, 0), "allreduce")]
    assert [(gs, j.sync) for gs, j in jobs["gpu"]] == [((1,), "ps"), ((2, 0), "allreduce")]
    jobs = jobs["cpu"]
    assert jobs[1][1].sync_bytes == 2000 and jobs[1][1].sync_time == pytest.approx(2000 / NET + 2 * LAT)


def test_wake_penalty_after_idle():
    """A stage started after its device idled pays ``W (1 - exp(-gap/tau)) / (1 - exp(-G/tau))``;
    back-to-back stages pay nothing, and the traced run (which records every task) agrees to the bit."""
    import math

    W, G, TAU = 2e-3, 0.05, 0.01
    topo = _two_machines()
    graph = chain_graph(2)
    sim = Simulator(graph, topo, hand_costs(graph, topo, F, BW, OPT, wake=(W, G, TAU)))

    def pen(gap):
        return W * (1 - math.exp(-gap / TAU)) / (1 - math.exp(-G / TAU))

    x = LAT + 400 * 8 / NET
    f0 = 8 * 1e-3  # d0 starts at 0: no idle gap, no penalty
    s1 = f0 + x  # d1 idled since the iteration began
    b1_end = s1 + pen(s1) + 8 * 2e-3 + 8 * 4e-3  # its backward follows at once: no penalty
    s0 = b1_end + x  # d0 idled since its forward
    t = s0 + pen(s0 - f0) + 8 * 2e-3 + 1e-3
    r = sim.run([dp([0]), dp([1])])
    assert r.iteration_time_s == pytest.approx(t)
    assert r.compute_time_s[1] == pytest.approx(pen(s1) + 8 * 6e-3 + 1e-3)
    ref = sim.run([dp([0]), dp([1])], trace=True)
    assert ref.iteration_time_s == r.iteration_time_s
    # one device throughout: never idle, so exactly the plain costs
    assert sim.run([dp([0]), dp([0])]).iteration_time_s == pytest.approx(8 * (1e-3 + 2e-3 + 2e-3 + 4e-3) + 2e-3)


def test_wake_penalty_traced_run_matches(captured):
    """With a wake penalty on every device, the untraced and the traced run (which records every
    task) agree to the bit on random plans (data parallel, PS, mp chunks), each device's compute
    events add up to its compute time, and the penalty changes some times."""
    import random

    from evaluation.sim_speed import random_group
    from tag.cost.model import CostModel
    from tag.topology import load_topology

    graph = captured("gpt2:n_layer=1,n_embd=32,n_head=2,seq=16", batch=16, groups=16).graph
    topo = load_topology("topologies/cluster-16gpu-4m.yaml")
    plain = Simulator(graph, topo, CostModel.roofline_only(graph, topo))
    costs = CostModel.roofline_only(graph, topo)
    for dc in {id(dc): dc for dc in costs._dev}.values():
        dc.wake = dc.table[:, :2] * 0.3
        dc.wake_gap_s, dc.wake_tau_s = 0.05, 0.01
    sim = Simulator(graph, topo, costs)
    assert sim.any_wake and not plain.any_wake
    rng = random.Random(7)
    changed = 0
    for _ in range(25):
        groups = [random_group(rng, graph, g, topo.num_devices) for g in range(graph.num_groups)]
        fast = sim.run(groups)
        ref = sim.run(groups, trace=True)
        assert fast.iteration_time_s == ref.iteration_time_s
        assert fast.compute_time_s == ref.compute_time_s and fast.group_finish_s == ref.group_finish_s
        busy = [0.0] * topo.num_devices
        for e in ref.events:
            if e.stream == "compute":
                busy[e.device] += e.end - e.start
        assert busy == pytest.approx(ref.compute_time_s, rel=1e-9)
        base = plain.run(groups).iteration_time_s
        assert fast.iteration_time_s >= base
        changed += fast.iteration_time_s > base
    assert changed > 0


def test_parameter_server_contended_link():
    topo = topology([("a", 2, 1e7, 1e-4), ("s", 1, None, 0.0)], net_bw=NET, net_lat=LAT)
    sim, _ = _sim(topo, bucket_bytes=1000)  # one bucket per group
    r = sim.run([dp([0, 1], sync="ps", server=2), dp([0, 1], sync="ps", server=2)])
    push = LAT + 2 * 1000 / NET  # both workers' gradients through the server's link
    ps = 2 * push
    g1_ready = 4 * 7e-3
    g0_ready = g1_ready + 4 * 2e-3
    assert r.iteration_time_s == pytest.approx(max(g0_ready, g1_ready + ps) + ps + 2e-3)
    assert r.comm_time_s == pytest.approx([2 * ps] * 3)
    assert r.compute_time_s[2] == 0.0  # a pure server holds no replica


def test_parameter_server_on_a_replica():
    topo = _two_machines()
    sim, _ = _sim(topo, bucket_bytes=1000)  # one bucket per group
    r = sim.run([dp([0, 1], sync="ps", server=1), dp([0, 1], sync="ps", server=1)])
    ps = 2 * (LAT + 1000 / NET)  # only d0 pushes and pulls
    assert r.iteration_time_s == pytest.approx(4 * 9e-3 + ps + 2e-3)


def test_repartition_uneven_shares():
    topo = topology([("m", 2, NET, LAT)])
    sim, _ = _sim(topo, bucket_bytes=1000)  # one bucket per group
    r = sim.run([dp([0, 1], [0.5, 0.5]), dp([0, 1], [0.25, 0.75])])  # batches [4, 4] then [2, 6]
    x = LAT + 2 * 400 / NET  # samples 2..3 move d0 -> d1 (forward) and d1 -> d0 (backward)
    f1_d1 = 4e-3 + x  # d1's fwd of group 1 waits for the rows
    b1_d1 = f1_d1 + 6 * 2e-3 + 6 * 4e-3
    b0_d0 = b1_d1 + x + 4 * 2e-3  # d0's bwd of group 0 waits for d1's gradient rows
    ar = 1000 / NET + 2 * LAT
    sync_g1 = max(b1_d1, b1_d1 + x) + ar  # after the backward transfer on the comm stream
    assert sync_g1 <= b0_d0
    t = b0_d0 + ar + 2e-3
    assert r.iteration_time_s == pytest.approx(t)
    assert r.comm_time_s == pytest.approx([2 * x + 2 * ar] * 2)


def test_memory_and_oom():
    graph = chain_graph(2)
    topo = topology([("a", 1, None, 0.0)], memory=10_000)
    sim = Simulator(graph, topo, hand_costs(graph, topo, F, BW, OPT))
    r = sim.run([dp([0]), dp([0])])
    # params+grads+Adam state 2 x (2*1000 + 2000); saved a0 (400*8) + loss (4) + input x (16*8);
    # largest op working set: 8+8 bytes/sample read+written at batch 8.
    peak = 2 * 4000 + 3200 + 4 + 128 + 16 * 8
    assert r.peak_memory_bytes == [pytest.approx(peak)]
    assert r.oom and r.oom_devices == [(0, pytest.approx(peak - 10_000))]
    assert r.memory_capacity_bytes == [10_000]


def test_model_parallel_chunks():
    graph = chain_graph(1, positions=2)  # one group, forward positions 0 and 1
    topo = _two_machines()
    sim = Simulator(graph, topo, hand_costs(graph, topo, [1e-3], [2e-3], [1e-3]))
    whole = sim.run([dp([0])])
    split = sim.run([GroupPlan([0, 1], [1.0, 1.0], "mp", None, [0, 1])])
    assert split.iteration_time_s > whole.iteration_time_s  # same compute plus two transfers
    assert sum(split.compute_time_s) == pytest.approx(whole.compute_time_s[0])
    assert split.comm_time_s[0] == pytest.approx(2 * (LAT + 400 * 8 / NET))


def test_trace_and_json(tmp_path):
    graph = chain_graph(2)
    topo = _two_machines()
    plan = new_plan(graph, topo, [dp([0, 1]), dp([1])])
    r = simulate(graph, topo, plan, costs=hand_costs(graph, topo, F, BW, OPT), trace=True)
    tr = r.chrome_trace()
    xs = [e for e in tr["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1} and {e["tid"] for e in xs} == {0, 1}
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(r.iteration_time_s * 1e6)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["iteration_time_s"] == r.iteration_time_s and d["oom"] is False
    assert len(d["peak_memory_bytes"]) == 2


def test_simulate_validates_plan():
    graph = chain_graph(2)
    topo = _two_machines()
    plan = new_plan(graph, topo, [dp([0]), dp([5])])
    with pytest.raises(PlanError, match=r"groups\[1\]\.devices"):
        simulate(graph, topo, plan, costs=hand_costs(graph, topo, F, BW, OPT))


def test_lower_bound():
    graph = chain_graph(2)
    topo = _two_machines()
    costs = hand_costs(graph, topo, F, BW, OPT, speed=[1.0, 3.0])
    alone = 8 * 9e-3 + 2e-3
    assert lower_bound(graph, topo, costs) == pytest.approx(1 / (1 / alone + 3 / alone))
    best = Simulator(graph, topo, costs).run([dp([1]), dp([1])]).iteration_time_s
    assert lower_bound(graph, topo, costs) < best
