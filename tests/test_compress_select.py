"""SFB cost model on real topologies, MILP == exhaustive search, and plan application."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tag.compress import (
    SfbError,
    SfbProblem,
    allgather_time,
    allreduce_time,
    apply_sfb,
    eligible,
    find_candidates,
    plan_sfb,
    select_sfb,
    sfb_cost,
    sfb_work,
    solve_exhaustive,
    solve_milp,
)
from tag.compress.milp import objective
from tag.cost.baselines import data_parallel
from tag.graph.ir import Affine
from tag.parallel import DataParallel, ParameterServer, register, sfb_syncs, unregister, validate_plan
from tag.plan.format import GroupPlan
from tag.topology import load_topology

GB = 1e9
SYNCS = sfb_syncs()  # the registered strategies taking SFB (Strategy.sfb_op)


def topo(machines: int, per: int, intra: str = "100 GB/s", inter: str = "8 Gbit/s", links=(), lat="0 us"):
    """``machines`` V100 boxes of ``per`` devices; zero latencies unless asked."""
    ms = [{"name": f"m{k}", "gpu": "V100-SXM2-16GB", "count": per, "intra_bandwidth": intra, "intra_latency": lat}
          for k in range(machines)]
    net = {"bandwidth": inter, "latency": lat}
    if links:
        net["links"] = [{"between": list(p), "bandwidth": bw, "latency": lat} for p, bw in links]
    return load_topology({"name": f"t{machines}x{per}", "machines": ms, "network": net})


# ------------------------------------------------------------------------------ cost model
def test_allreduce_ring_and_hierarchical_formulas():
    one = topo(1, 4)
    s = 64e6
    assert allreduce_time(s, [0, 1, 2, 3], one) == pytest.approx(2 * 3 / 4 * s / (100 * GB))
    two = topo(2, 2)  # inter 1 GB/s
    flat = 2 * 3 / 4 * s / GB
    hier = 2 * 1 / 2 * s / (100 * GB) + 2 * 1 / 2 * s / GB  # inside each box, then a ring of 2 boxes
    assert allreduce_time(s, [0, 1, 2, 3], two) == pytest.approx(hier)  # what the simulator charges
    assert allreduce_time(s, [0, 1, 2, 3], two, algorithm="flat") == pytest.approx(flat)
    assert allreduce_time(s, [0, 1, 2, 3], two, algorithm="best") == pytest.approx(min(flat, hier))
    assert allreduce_time(s, [0], two) == 0.0
    lat = topo(1, 4, lat="10 us")
    assert allreduce_time(1.0, [0, 1, 2, 3], lat) == pytest.approx(2 * 3 * 10e-6, rel=1e-3)


def test_collectives_use_the_real_bandwidth_matrix():
    slow = topo(3, 1, inter="8 Gbit/s", links=[(("m0", "m2"), "800 Mbit/s")])
    s = 10e6
    # devices on m0 and m1 never touch the slow m0-m2 link; a ring over all three must
    assert allreduce_time(s, [0, 1], slow) == pytest.approx(s / GB)
    assert allreduce_time(s, [0, 1, 2], slow) == pytest.approx(2 * 2 / 3 * s / (0.1 * GB))
    # all-gather: the link into device s carries everything but s's own chunk
    assert allgather_time([1e6, 3e6], [0, 1], slow) == pytest.approx(3e6 / GB)
    assert allgather_time([1e6, 3e6, 2e6], [0, 1, 2], slow) == pytest.approx(5e6 / (0.1 * GB))


def test_sfb_time_counts_gathers_and_extra_compute():
    from tag.compress.detect import Candidate, Factor

    t = topo(1, 2)  # 100 GB/s
    fx = Factor(0, "x", 0, 1000.0, "fwd")
    fdy = Factor(1, "dy", 0, 500.0, "bwd")
    c = Candidate(2, "mm", "mm", "w", "mm", 0, (fx, fdy), 4_000_000, Affine(0, 1e9), Affine(0, 0), 8e9)
    cost = sfb_cost(c, [0, 1], [2, 6], t, compute_rate=[1e12, 4e12])
    # replica 0 receives 6 rows of each factor, replica 1 receives 2: the slower direction counts
    assert cost.gather_s == pytest.approx(6 * 1000 / (100 * GB) + 6 * 500 / (100 * GB))
    assert cost.compute_s == pytest.approx(max(6 * 1e9 / 1e12, 2 * 1e9 / 4e12))
    with pytest.raises(SfbError, match="compute_rate"):
        sfb_cost(c, [0, 1], [2, 6], t, compute_rate=[1e12])


# ------------------------------------------------------------------------------ MILP
@st.composite
def problems(draw):
    m = draw(st.integers(1, 5))
    n = draw(st.integers(1, 8))
    facs = [tuple(sorted(set(draw(st.lists(st.integers(0, m - 1), min_size=1, max_size=2))))) for _ in range(n)]
    cost = st.floats(-5, 3, allow_nan=False)
    return SfbProblem(
        op_cost=tuple(draw(cost) for _ in range(n)),
        factor_cost=tuple(draw(st.floats(0, 4)) for _ in range(m)),
        op_factors=tuple(facs),
        gather_latency=draw(st.sampled_from([0.0, 0.3, 1.5])),
        sync_latency=draw(st.sampled_from([0.0, 0.5, 2.0])),
    )


@settings(max_examples=300, deadline=None)
@given(problems())
@example(SfbProblem(op_cost=(1.0, -5.96e-08, -5.96e-08), factor_cost=(0.0,), op_factors=((0,), (0,), (0,))))
def test_milp_optimum_equals_exhaustive_optimum(p):
    got, ref = solve_milp(p), solve_exhaustive(p)
    scale = max(map(abs, (*p.op_cost, *p.factor_cost, p.gather_latency, p.sync_latency)))
    assert got.objective == pytest.approx(ref.objective, abs=1e-7 * scale)
    assert objective(p, got.ops) == (pytest.approx(got.objective), got.factors)
    assert got.objective <= 0.0


def test_shared_factor_is_paid_once():
    # q/k/v: each saves 2 s but needs the shared X (2 s) and its own dY (0.5 s)
    p = SfbProblem(op_cost=(-2.0, -2.0, -2.0), factor_cost=(2.0, 0.5, 0.5, 0.5),
                   op_factors=((0, 1), (0, 2), (0, 3)))
    assert solve_exhaustive(SfbProblem((-2.0,), (2.0, 0.5), ((0, 1),))).ops == ()  # alone: not worth it
    sol = solve_milp(p)
    assert sol.ops == (0, 1, 2) and sol.factors == (0, 1, 2, 3)
    assert sol.objective == pytest.approx(-6 + 2 + 1.5)


# ------------------------------------------------------------------------------ selection on graphs
def test_selection_depends_on_links_and_batch(captured):
    small = captured("mlp").graph  # batch 32, 256x256 weights (256 KiB)
    large = captured("mlp", batch=2048).graph
    slow, fast = topo(4, 1, inter="1 Gbit/s", lat="20 us"), topo(1, 4, intra="300 GB/s", lat="5 us")
    weights = {c.op_name for c in find_candidates(small) if c.kind == "mm" and c.grad_bytes == 256 * 256 * 4}
    picked = {op for ops in select_sfb(small, slow, data_parallel(small, slow), syncs=SYNCS).values() for op in ops}
    assert weights <= picked  # few rows, slow network: gather 32 rows instead of 256 KiB
    big = {c.op_name for c in find_candidates(large) if c.kind == "mm" and c.grad_bytes == 256 * 256 * 4}
    picked = {op for ops in select_sfb(large, fast, data_parallel(large, fast), syncs=SYNCS).values() for op in ops}
    assert not big & picked  # 2048 rows of X and dY are 8x the weight: all-reduce wins
    for sel in plan_sfb(large, fast, data_parallel(large, fast), syncs=SYNCS):
        for d in sel.decisions:
            if d.candidate.op_name in big:
                assert d.sfb_s > d.sync_s


def test_apply_sfb_fills_eligible_groups_only(captured):
    g = captured("mlp").graph
    t = topo(2, 2, inter="1 Gbit/s")
    plan = data_parallel(g, t)
    plan.groups[0] = GroupPlan(devices=[3], shares=[1.0])  # single replica: left alone
    new = apply_sfb(g, t, plan, compute_rate=[1e13] * 4, syncs=SYNCS)
    validate_plan(new, g, t)
    assert new is not plan and plan.groups[1].sfb == []
    assert new.groups[0].sfb == []
    chosen = {i: gp.sfb for i, gp in enumerate(new.groups) if gp.sfb}
    assert chosen and new.meta["sfb_saving_s"] > 0
    cands = {c.op_name: c for c in find_candidates(g)}
    for gi, ops in chosen.items():
        work = sfb_work(g, new, gi, syncs=SYNCS)
        assert work.saved_grad_bytes == sum(cands[o].grad_bytes for o in ops)
        names = {f.name for o in ops for f in cands[o].factors}
        assert sorted(x.factor.name for x in work.gathers) == sorted(names)  # each factor once
        assert all(math.isclose(sum(x.chunks), 32 * x.factor.bytes_per_sample) for x in work.gathers)
        assert len(work.extra_flops) == 4 and work.extra_flops[0] > 0
    bad = apply_sfb(g, t, plan, syncs=SYNCS)
    gi = next(iter(chosen))
    bad.groups[gi].sfb = ["not_an_op"]
    with pytest.raises(SfbError, match=rf"groups\[{gi}\]\.sfb: op 'not_an_op'"):
        sfb_work(g, bad, gi, syncs=SYNCS)


def test_microsecond_costs_are_solved_exactly():
    p = SfbProblem(op_cost=(-6e-8, -6e-8), factor_cost=(0.0,), op_factors=((0,), (0,)))
    assert solve_milp(p).ops == (0, 1) and solve_milp(p).objective == pytest.approx(-1.2e-7)


def test_sfb_eligibility_is_declared_by_the_strategies():
    """Which groups take SFB is each strategy's :meth:`Strategy.sfb_op`: the built-in data-parallel
    ones (by their own collective) and a strategy registered later that says so; compress names none."""
    assert SYNCS == {"allreduce": "allreduce", "ps": "ps"}
    two = GroupPlan([0, 1], [0.5, 0.5], "allreduce")
    assert eligible(two, SYNCS) and not eligible(GroupPlan([0], [1.0]), SYNCS)
    assert not eligible(GroupPlan([0, 1], [1.0, 1.0], "mp", mp_splits=[0, 1]), SYNCS)

    class Ps2(ParameterServer):
        name = "ps2"

    register(Ps2())
    try:
        assert sfb_syncs() == {**SYNCS, "ps2": "ps"}
        assert eligible(GroupPlan([0, 1], [0.5, 0.5], "ps2", server=0), sfb_syncs())
    finally:
        unregister("ps2")
    assert sfb_syncs() == SYNCS and DataParallel().sfb_op() == "allreduce"
