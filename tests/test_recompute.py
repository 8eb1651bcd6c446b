"""Activation recomputation (``GroupPlan.recompute``): plan format, simulator costs by the rule,
layouts.

Graph (``chain_graph(2, positions=2)``, batch 8): group 0 = f0(x, w0) -> a0, f1(a0) -> a1;
group 1 = f2(a1, w1) -> a2, f3(a2) -> loss (4 B); activations 400 B/sample, the input x
16 B/sample. Backward: each op reads its forward input (and the incoming gradient; the loss
seeds it). So group 0's backward reads x (the batch) and a0 (its own); group 1's reads a1 (group
0's), a2 and the loss (its own). Costs per sample: fwd 1 / 2 ms, bwd 2 / 4 ms; opt 1 ms a group.
"""

from __future__ import annotations

import json

import pytest
from test_sim_tools import chain_graph, hand_costs, topology

from tag.errors import PlanError
from tag.plan import GroupPlan, PipelinePlan, Plan, new_plan
from tag.sim import Simulator

F, BW, OPT = [1e-3, 2e-3], [2e-3, 4e-3], [1e-3, 1e-3]
B = 8
ACT, X, LOSS = 400.0, 16.0, 4.0


def _sim():
    graph = chain_graph(2, positions=2, batch=B)
    topo = topology([("a", 2, 1e9, 0.0)])
    return Simulator(graph, topo, hand_costs(graph, topo, F, BW, OPT)), graph, topo


def _dp(device, recompute=False):
    return GroupPlan([device], [1.0], recompute=recompute)


def test_single_device_time_and_memory_by_the_rule():
    sim, _, _ = _sim()
    base = sim.run([_dp(0), _dp(0)])
    both = sim.run([_dp(0, True), _dp(0, True)])
    # Each recomputed group's backward runs its forward again: + B * (1 + 2) ms on the one device.
    assert both.iteration_time_s == pytest.approx(base.iteration_time_s + B * (F[0] + F[1]))
    assert both.compute_time_s[0] == pytest.approx(base.compute_time_s[0] + B * (F[0] + F[1]))
    # Held: group 0 keeps x only (not a0), group 1 keeps a1 only (not a2, loss): - (a0 + a2 + loss).
    # At a backward the recomputed values are live again: the largest is group 1's a2 + loss,
    # added to the largest single-op working set (8 + 8 B/sample; unchanged).
    held = -(ACT * B + ACT * B + LOSS)
    transient = ACT * B + LOSS
    assert both.peak_memory_bytes[0] == pytest.approx(base.peak_memory_bytes[0] + held + transient)
    # One group alone: its transient peak is what it stopped holding (it is the largest working set).
    one = sim.run([_dp(0), _dp(0, True)])
    assert one.peak_memory_bytes[0] == pytest.approx(base.peak_memory_bytes[0])
    assert one.iteration_time_s == pytest.approx(base.iteration_time_s + B * F[1])


def test_no_flag_unchanged_after_recomputed_runs():
    """The recomputed layouts are cached beside the plain ones: a plan without the flag gives the
    same figures as on a fresh simulator."""
    sim, _, _ = _sim()
    sim.run([_dp(0, True), _dp(0)])
    sim.run([GroupPlan([0, 1], [0.5, 0.5], recompute=True), _dp(0)])
    for plan in ([_dp(0), _dp(0)], [GroupPlan([0, 1], [0.5, 0.5]), _dp(1)]):
        a, b = sim.run(plan), _sim()[0].run(plan)
        assert (a.iteration_time_s, a.peak_memory_bytes) == (b.iteration_time_s, b.peak_memory_bytes)


def test_data_parallel_replicas():
    sim, _, _ = _sim()
    plan = [GroupPlan([0, 1], [0.5, 0.5]), GroupPlan([0, 1], [0.5, 0.5])]
    base = sim.run(plan)
    rc = sim.run([GroupPlan([0, 1], [0.5, 0.5], recompute=True)] * 2)
    # per replica 4 samples; the sync is unchanged, so the time grows by the forwards' seconds
    assert rc.iteration_time_s == pytest.approx(base.iteration_time_s + 4 * (F[0] + F[1]))
    for d in (0, 1):
        assert rc.peak_memory_bytes[d] == pytest.approx(base.peak_memory_bytes[d] - (2 * ACT * 4 + LOSS) + ACT * 4 + LOSS)


def test_model_parallel_chunk():
    """An mp chunk recomputes on its own: chunk 1 of group 0 (position 1) reads a0 from chunk 0, so
    it holds a0 either way; chunk 0's backward reads only x, its input: memory does not change."""
    sim, _, _ = _sim()
    mp = dict(sync="mp", mp_splits=[0, 1])
    base = sim.run([GroupPlan([0, 1], [1.0, 1.0], **mp), _dp(0)])
    rc = sim.run([GroupPlan([0, 1], [1.0, 1.0], recompute=True, **mp), _dp(0)])
    assert sum(rc.compute_time_s) == pytest.approx(sum(base.compute_time_s) + B * F[0])
    assert rc.peak_memory_bytes == pytest.approx(base.peak_memory_bytes)


def test_pipeline_in_flight():
    """1F1B over two stages, 4 micro-batches of 2: stage 0 has 2 in flight, stage 1 one."""
    sim, _, _ = _sim()
    pp = PipelinePlan([0, 1], 4, "1f1b")
    base = sim.run([_dp(0), _dp(1)], pipeline=pp)
    rc = sim.run([_dp(0, True), _dp(1, True)], pipeline=pp)
    m = 2
    # stage 0: per micro-batch in flight x only (a0 dropped); a0 of one micro-batch live at its backward
    assert rc.peak_memory_bytes[0] == pytest.approx(base.peak_memory_bytes[0] - 2 * ACT * m + ACT * m)
    # stage 1: one in flight: a2 + loss dropped and live again at the backward
    assert rc.peak_memory_bytes[1] == pytest.approx(base.peak_memory_bytes[1])
    assert rc.compute_time_s[0] == pytest.approx(base.compute_time_s[0] + B * F[0])
    assert rc.compute_time_s[1] == pytest.approx(base.compute_time_s[1] + B * F[1])


def test_plan_format(tmp_path):
    sim, graph, topo = _sim()
    plan = new_plan(graph, topo, [_dp(0), _dp(0, True)])
    d = plan.to_dict()
    assert "recompute" not in d["groups"][0] and d["groups"][1]["recompute"] is True
    path = tmp_path / "p.json"
    plan.save(path)
    back = Plan.load(path)
    assert [g.recompute for g in back.groups] == [False, True]
    d["groups"][1]["recompute"] = 1
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"groups\[1\]\.recompute: expected true or false, got 1"):
        Plan.load(path)


def test_layout_recompute(captured):
    from test_executor import MLP

    from tag.cost.model import CostModel
    from tag.parallel.layout import Layout, layout_grid, layout_plan, parse_layout
    from tag.topology import load_topology

    assert parse_layout("dp=2,pp=2,micro=2,recompute=1") == Layout(dp=2, pp=2, micro=2, recompute=1)
    for text, message in [("recompute=2", "recompute: expected 0 or 1, got 2"),
                          ("recompute=yes", "recompute: expected 0 or 1, got 'yes'")]:
        with pytest.raises(PlanError, match="^layout: " + message + "$"):
            parse_layout(text)
    graph = captured(MLP, batch=8, groups=4).graph
    topo = load_topology("topologies/local-cpu4.yaml")
    costs = CostModel.for_topology(graph, topo)
    plan = layout_plan(graph, topo, Layout(dp=2, pp=2, micro=2, recompute=1), costs)
    assert all(g.recompute for g in plan.groups) and plan.meta["layout"].endswith(",recompute=1")
    plain = layout_plan(graph, topo, Layout(dp=2, pp=2, micro=2), costs)
    assert not any(g.recompute for g in plain.groups) and [g.devices for g in plain.groups] == \
        [g.devices for g in plan.groups]
    grid = layout_grid(graph, topo)
    assert Layout(dp=4, recompute=1) in grid and len(grid) == 2 * sum(1 for g in grid if not g.recompute)
