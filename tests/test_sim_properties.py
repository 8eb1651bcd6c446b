"""Simulator properties (hypothesis): monotone in bandwidth, device speed and batch; all-reduce
time equals its formula."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_sim_tools import chain_graph, hand_costs, topology

from tag.cost.comm import hierarchical_allreduce_time, ring_allreduce_time
from tag.plan import GroupPlan, local_batches
from tag.sim import Simulator

K, POS, NDEV = 3, 2, 4
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def group_plans(draw, g: int):
    sync = draw(st.sampled_from(["allreduce", "ps", "mp"]))
    if sync == "mp":
        n = draw(st.integers(1, POS))
        devs = draw(st.permutations(range(NDEV)))[:n]
        return GroupPlan(list(devs), [1.0] * n, "mp", None, [g * POS + j for j in range(n)])
    n = draw(st.integers(1, NDEV))
    devs = draw(st.permutations(range(NDEV)))[:n]
    w = draw(st.lists(st.integers(1, 8), min_size=n, max_size=n))
    shares = [x / sum(w) for x in w]
    shares[-1] = 1.0 - sum(shares[:-1])
    server = draw(st.integers(0, NDEV - 1)) if sync == "ps" else None
    return GroupPlan(list(devs), shares, sync, server)


plans = st.tuples(*[group_plans(g) for g in range(K)]).map(list)
costs_st = st.tuples(st.lists(st.floats(1e-4, 1e-2), min_size=K, max_size=K),
                     st.lists(st.floats(1e-4, 1e-2), min_size=K, max_size=K),
                     st.lists(st.floats(0.0, 1e-2), min_size=K, max_size=K))


def _topo(scale: float = 1.0):
    return topology([("a", 2, 2e7 * scale, 1e-5), ("b", 2, 1e7 * scale, 1e-5)], net_bw=1e6 * scale, net_lat=1e-4)


def _run(plan, costs, topo=None, speed=None, batch=16):
    graph = chain_graph(K, positions=POS, batch=batch)
    topo = topo or _topo()
    return Simulator(graph, topo, hand_costs(graph, topo, *costs, speed=speed)).run(plan)


@SETTINGS
@given(plans, costs_st, st.floats(1.0, 100.0))
def test_more_bandwidth_never_slower(plan, costs, scale):
    slow = _run(plan, costs)
    fast = _run(plan, costs, topo=_topo(scale))
    assert fast.iteration_time_s <= slow.iteration_time_s * (1 + 1e-12)


@SETTINGS
@given(plans, costs_st, st.integers(0, NDEV - 1), st.floats(1.0, 10.0))
def test_faster_device_never_slower(plan, costs, device, factor):
    base = _run(plan, costs)
    speed = [1.0] * NDEV
    speed[device] = factor
    fast = _run(plan, costs, speed=speed)
    assert fast.iteration_time_s <= base.iteration_time_s * (1 + 1e-12)


@SETTINGS
@given(plans, costs_st, st.integers(4, 16), st.integers(1, 16))
def test_memory_grows_with_batch(plan, costs, b1, extra):
    b2 = b1 + extra
    for gp in plan:  # largest-remainder rounding can take a sample away (Alabama paradox)
        if gp.sync != "mp":
            assume(all(y >= x for x, y in zip(local_batches(b1, gp.shares), local_batches(b2, gp.shares))))
    small = _run(plan, costs, batch=b1)
    large = _run(plan, costs, batch=b2)
    for a, b in zip(small.peak_memory_bytes, large.peak_memory_bytes):
        assert b >= a


@SETTINGS
@given(st.lists(st.integers(1, 3), min_size=1, max_size=4), st.floats(1e8, 1e11), st.floats(1e-6, 1e-4),
       st.floats(1e8, 1e10), st.floats(1e-6, 1e-4), st.floats(1e3, 1e9), st.data())
def test_allreduce_time_matches_formula(counts, intra_bw, intra_lat, net_bw, net_lat, nbytes, data):
    topo = topology([(f"m{i}", c, intra_bw if c > 1 else None, intra_lat) for i, c in enumerate(counts)],
                    net_bw=net_bw, net_lat=net_lat)
    graph = chain_graph(1)
    comm = hand_costs(graph, topo, [0.0], [0.0], [0.0]).comm
    n = topo.num_devices
    devs = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
    per = {}
    for d in devs:
        per.setdefault(topo.machine_of(d), []).append(d)
    if len(per) == 1:
        k = len(devs)
        expect = 2 * (k - 1) / k * nbytes / intra_bw + 2 * (k - 1) * intra_lat if k > 1 else 0.0
        assert ring_allreduce_time(k, nbytes, intra_bw, intra_lat) == pytest.approx(expect)
    else:
        m = len(per)
        kmax = max(len(v) for v in per.values())
        intra = (kmax - 1) / kmax * nbytes / intra_bw + (kmax - 1) * intra_lat
        expect = 2 * intra + 2 * (m - 1) / m * nbytes / net_bw + 2 * (m - 1) * net_lat
        got = hierarchical_allreduce_time([(len(v), intra_bw, intra_lat) for v in per.values()], nbytes, net_bw,
                                          net_lat)
        assert got == pytest.approx(expect)
    assert comm.allreduce_time(devs, nbytes) == pytest.approx(expect, rel=1e-9)
    # ... and the simulator charges exactly that for a group whose compute is free.
    sim_graph = chain_graph(1, param_bytes=int(nbytes))
    sim = Simulator(sim_graph, topo, hand_costs(sim_graph, topo, [0.0], [0.0], [0.0]))
    r = sim.run([GroupPlan(devs, [1 / len(devs)] * len(devs))])
    assert r.iteration_time_s == pytest.approx(comm.allreduce_time(devs, int(nbytes)), rel=1e-9, abs=1e-15)
