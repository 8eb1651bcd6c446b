"""The planner and optimizer offload: the layout grid's offload layouts
(tag.parallel.layout.offload_layouts), find_plan's fsdp-offload seed, and the stage moves that
make a pipeline closest to fitting fit (tag.search.layouts.rebalance)."""

from __future__ import annotations

from dataclasses import replace

import pytest

MLP = "mlp:layers=8,hidden=512,in_dim=256"


@pytest.fixture(scope="module")
def mlp():
    from tag.graph import capture
    from tag.workloads import load_workload

    return capture(load_workload(MLP, batch=64), num_groups=8).graph


def _cluster(graph, fraction: float, machines: int = 2, count: int = 2):
    """``machines`` machines of ``count`` GPUs, each holding ``fraction`` of the graph's
    parameters, gradients and Adam state (host memory: the default, twice the GPUs')."""
    from tag.topology import load_topology

    state = sum(p.nbytes for p in graph.params) * 4  # weights, gradients, two Adam moments
    gpu = {"name": "small", "tflops": 14, "memory": f"{int(state * fraction)} B", "memory_bandwidth": "900 GB/s"}
    return load_topology({"name": f"small-{machines}x{count}", "network": {"bandwidth": "10 Gbit/s"},
                          "machines": [{"name": f"m{i}", "gpu": gpu, "count": count, "intra_bandwidth": "100 GB/s"}
                                       for i in range(machines)]})


def _tight(graph):
    """One machine of 2 GPUs holding 0.93x the peak of the first stage of the 2-stage 1F1B pipeline
    of 8 micro-batches cut by time (``dp=1,pp=2,micro=8``, 6 + 2 groups)."""
    from tag.cost.model import CostModel
    from tag.parallel.layout import layout_plan, parse_layout
    from tag.sim import Simulator
    from tag.topology import load_topology

    big = _cluster(graph, 100.0, machines=1)
    costs = CostModel.for_topology(graph, big)
    plan = layout_plan(graph, big, parse_layout("dp=1,pp=2,micro=8"), costs)
    peak = Simulator(graph, big, costs).run(plan.groups, pipeline=plan.pipeline).peak_memory_bytes[0]
    gpu = {"name": "small", "tflops": 14, "memory": f"{int(0.93 * peak)} B", "memory_bandwidth": "900 GB/s"}
    return load_topology({"name": "tight", "machines": [{"name": "m0", "gpu": gpu, "count": 2,
                                                         "intra_bandwidth": "100 GB/s"}]})


def test_the_grid_has_offload_layouts(mlp):
    from tag.parallel.layout import MICRO_BATCHES, layout_grid, offload_layouts, parse_layout

    topo = _cluster(mlp, 0.6)
    lays = offload_layouts(mlp, topo)
    assert set(lays) <= set(layout_grid(mlp, topo))
    assert all(lay.offload == "optimizer" and lay.tp == 1 and lay.cut == "time" for lay in lays)
    micro = {dp: sum(m * dp <= 64 for m in MICRO_BATCHES) for dp in (2, 1)}
    # pp=1: dp=4; pp=2: dp=2, each micro-batch count; pp=4: dp=1, each; each with and without recompute
    assert len(lays) == 2 + micro[2] * 2 + micro[1] * 2
    assert {(lay.dp, lay.pp) for lay in lays} == {(4, 1), (2, 2), (1, 4)}
    assert all(lay.zero == (2 if lay.dp == 1 else 3) for lay in lays)  # (one replica: nothing to gather)
    plan_text = "dp=2,pp=2,micro=4,zero=3,offload=optimizer,recompute=1"
    assert parse_layout(plan_text) in lays


def test_find_plan_seeds_fsdp_offload_where_fsdp_does_not_fit(mlp):
    """GPUs of 0.6x the state: ZeRO-3 over 4 (its shards, the gathered groups, the activations)
    does not fit, also recomputed; with the optimizer on the host (and recomputation on some groups,
    as the search fits any plan) it does, and that seed is the plan."""
    from tag.cli.plan import _describe
    from tag.cost.baselines import fully_sharded
    from tag.planner import PlannerConfig, find_plan
    from tag.sim import Simulator

    topo = _cluster(mlp, 0.6)
    sim = Simulator(mlp, topo)
    fsdp = fully_sharded(mlp, topo)
    assert sim.run([replace(g, recompute=True) for g in fsdp.groups]).oom
    p = find_plan(mlp, topo, PlannerConfig(prior="uniform", budget=1, pipelines="off", compression="off"), simulator=sim)
    assert p.meta["fsdp_oom"] and p.meta["source"] == "fsdp-offload" and not p.meta["oom"]
    assert {(g.sync, g.offload) for g in p.groups} == {("zero3", "optimizer")}
    res = sim.run(p.groups)
    assert not res.oom and res.iteration_time_s == pytest.approx(p.predicted_iteration_time_s)
    assert sum(res.host_memory_bytes) > 0
    assert "optimizer offloaded" in _describe(topo, p.groups[0])  # what tag plan prints


def test_offload_is_not_chosen_where_it_is_slower(mlp):
    """GPUs of 0.9x the state: ZeRO-3 fits without offload; offloaded, the host step makes it slower,
    so neither the seeds nor the grid's offload layouts give the plan."""
    from tag.cost.baselines import fully_sharded
    from tag.planner import PlannerConfig, find_plan
    from tag.sim import Simulator

    topo = _cluster(mlp, 0.9)
    sim = Simulator(mlp, topo)
    fsdp = fully_sharded(mlp, topo)
    plain, off = (sim.run([replace(g, offload=o) for g in fsdp.groups]) for o in (None, "optimizer"))
    assert not plain.oom and off.iteration_time_s > plain.iteration_time_s
    p = find_plan(mlp, topo, PlannerConfig(prior="uniform", budget=4, pipelines="grid", compression="off"), simulator=sim)
    assert not p.meta["oom"] and not any(g.offload for g in p.groups)
    assert p.predicted_iteration_time_s <= plain.iteration_time_s


def test_rebalance_moves_stage_boundaries_until_the_pipeline_fits(mlp):
    """A 2-stage 1F1B pipeline of 8 micro-batches cut by time (6 + 2 groups): stage 0 holds two
    micro-batches in flight and peaks above a GPU's memory; one group moved to stage 1 fits."""
    from tag.cost.model import CostModel
    from tag.parallel.layout import layout_plan, parse_layout
    from tag.search.layouts import rebalance
    from tag.sim import Simulator

    big = _cluster(mlp, 100.0, machines=1)
    costs = CostModel.for_topology(mlp, big)
    plan = layout_plan(mlp, big, parse_layout("dp=1,pp=2,micro=8"), costs)
    peaks = Simulator(mlp, big, costs).run(plan.groups, pipeline=plan.pipeline).peak_memory_bytes
    assert plan.pipeline.stages == [0, 6] and peaks[0] > 2 * peaks[1]
    topo = _tight(mlp)
    sim = Simulator(mlp, topo, CostModel.for_topology(mlp, topo))
    res = sim.run(plan.groups, pipeline=plan.pipeline)
    assert res.oom
    got, sims, note = rebalance(sim, plan, res)
    assert got is not None and sims >= 1 and "fits with group 5 to stage 1" in note
    assert got.pipeline.stages == [0, 5] and got.groups[5].devices == [1]
    again = sim.run(got.groups, pipeline=got.pipeline)
    assert not again.oom and again.iteration_time_s == pytest.approx(got.predicted_iteration_time_s)
    assert rebalance(sim, got, again)[0] is None  # a plan that fits is left alone


def test_the_planner_moves_stage_boundaries_of_pipelines_the_grid_bounded_out(mlp):
    """The same tight GPUs, the grid bounded by the memory cut's time (3 + 5 groups, 8
    micro-batches: fits): the time cut, faster, is bounded out of memory and not simulated; the
    planner simulates the fastest such pipelines that nearly fit and returns one made to fit by
    moving a stage boundary, faster than the memory cut (tag.planner._rebalanced)."""
    import math

    from tag.cost.model import CostModel
    from tag.parallel.layout import layout_plan, parse_layout
    from tag.planner import _rebalanced
    from tag.search.layouts import grid_search
    from tag.sim import Simulator

    topo = _tight(mlp)
    costs = CostModel.for_topology(mlp, topo)
    sim = Simulator(mlp, topo, costs)
    by_memory = layout_plan(mlp, topo, parse_layout("dp=1,pp=2,micro=8,cut=memory"), costs)
    fits = sim.run(by_memory.groups, pipeline=by_memory.pipeline)
    assert by_memory.pipeline.stages == [0, 3] and not fits.oom
    found = grid_search(mlp, topo, costs, sim, incumbent=fits.iteration_time_s)
    assert "dp=1,tp=1,pp=2,micro=8,schedule=1f1b" in [q.meta["layout"] for q, _ in found.unfit]
    assert all(q.pipeline is not None for q, _ in found.unfit)
    meta = {"rebalanced": []}
    got = _rebalanced(sim, found, type("P", (), {"meta": meta})(), False, math.inf, fits.iteration_time_s)
    assert got is not None and got.meta["refinement"].startswith("stages moved to fit")
    assert got.predicted_iteration_time_s < fits.iteration_time_s and meta["rebalanced"]
    res = sim.run(got.groups, pipeline=got.pipeline)
    assert not res.oom and res.iteration_time_s == pytest.approx(got.predicted_iteration_time_s)
