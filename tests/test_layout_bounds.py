"""The layout grid's branch and bound (:func:`tag.parallel.layout.search_layouts` with the bounds
of :mod:`tag.sim.bounds`): every bound is at most what the simulator reports, and the pruned grid
returns the full grid's plan (same layout, same time) on homogeneous, heterogeneous and
memory-bound pairs."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from test_executor import GPT2

from tag.cost.model import CostModel
from tag.parallel.layout import search_layouts
from tag.sim import Simulator
from tag.sim.bounds import layout_bounds, plan_bound, static_bound
from tag.sim.program import build_program
from tag.topology import load_topology


def _tight(tmp_path, graph, name: str, fraction: float):
    """``homogeneous-2x4-v100`` with every GPU's memory cut to ``fraction`` of the way from the
    smallest to the largest peak of the grid's layouts (some fit, some do not)."""
    big = load_topology("homogeneous-2x4-v100")
    sim = Simulator(graph, big, CostModel.for_topology(graph, big))
    full = search_layouts(graph, big, sim.costs, lambda p: sim.run(p.groups, pipeline=p.pipeline))
    peaks = sorted(max(r.peak_memory_bytes) for _, r in full.ranked)
    cap = int(peaks[0] + fraction * (peaks[-1] - peaks[0]))
    gpu = {"name": "v100-small", "tflops": 15.7, "memory": f"{cap} B", "memory_bandwidth": "900 GB/s"}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "network": {"bandwidth": "25 Gbit/s"}, "machines": [
        {"name": f"m{i}", "gpu": gpu, "count": 4, "intra_bandwidth": "150 GB/s"} for i in range(2)]}))
    return load_topology(path)


@pytest.fixture(scope="module")
def gpt2(captured):
    return captured(GPT2, batch=16, groups=6).graph


CASES = [("homogeneous-2x4-v100", None), ("mixed-a100-v100", None), ("cluster-16gpu-4m", None),
         ("tight", 0.05), ("tight", 0.4)]


@pytest.mark.parametrize("name,fraction", CASES)
def test_the_pruned_grid_returns_the_full_grids_plan(gpt2, tmp_path, name, fraction):
    topo = _tight(tmp_path, gpt2, f"{name}-{fraction}", fraction) if fraction is not None else load_topology(name)
    costs = CostModel.for_topology(gpt2, topo)
    sim = Simulator(gpt2, topo, costs)
    runs = {}

    def simulate(p):
        runs[p.meta["layout"]] = res = sim.run(p.groups, pipeline=p.pipeline)
        return res

    full = search_layouts(gpt2, topo, costs, simulate)
    # a layout cut by memory where the time cut is the same has the same plan: simulated once
    assert full.simulated == full.layouts == len(runs) + full.shared > 20 and full.shared > 0
    for p, res in full.ranked:
        twin = p.meta["layout"].replace(",cut=memory", "")
        if p.meta["layout"] not in runs:
            assert twin in runs and runs[twin] is res and p.groups == next(q for q, _ in full.ranked
                                                                            if q.meta["layout"] == twin).groups
    # every bound is a lower bound of the simulation, the static one of the deployment's
    for p, res in full.ranked:
        lo, mid = static_bound(sim, p.groups, p.pipeline), plan_bound(sim, p.groups, p.pipeline)
        assert lo.time_s <= mid.time_s * (1 + 1e-9) and mid.time_s <= res.iteration_time_s, p.meta["layout"]
        for a, b, c in zip(lo.peak_bytes, mid.peak_bytes, res.peak_memory_bytes):
            assert a <= b * (1 + 1e-9) and b <= c * (1 + 1e-9), p.meta["layout"]
        assert res.oom or not (lo.oom or mid.oom), p.meta["layout"]
    fits = [r for _, r in full.ranked if not r.oom]
    if fraction is not None:  # memory binds: some layouts fit, some do not
        assert fits and len(fits) < full.layouts
    pruned = search_layouts(gpt2, topo, costs, lambda p: sim.run(p.groups, pipeline=p.pipeline),
                            bounds=layout_bounds(sim))
    assert pruned.best.meta["layout"] == full.best.meta["layout"]
    assert pruned.best.predicted_iteration_time_s == full.best.predicted_iteration_time_s
    assert pruned.best.groups == full.best.groups and pruned.best.pipeline == full.best.pipeline
    assert pruned.layouts == full.layouts and pruned.simulated < full.simulated
    # an incumbent as fast as the best layout leaves nothing to return; a slower one, the same layout
    if full.best.predicted_iteration_time_s is not None:
        t = full.best.predicted_iteration_time_s
        same = search_layouts(gpt2, topo, costs, lambda p: sim.run(p.groups, pipeline=p.pipeline),
                              bounds=layout_bounds(sim), incumbent=t)
        assert same.best is None
        slower = search_layouts(gpt2, topo, costs, lambda p: sim.run(p.groups, pipeline=p.pipeline),
                                bounds=layout_bounds(sim), incumbent=t * 1.5)
        assert slower.best.meta["layout"] == full.best.meta["layout"]


def _machine(tmp_path, name: str, gpus: list[tuple[str, int]], memory: str | None = None):
    """One machine of the given (GPU, count) kinds; ``memory``: every GPU's, instead of its datasheet's."""
    machines = []
    for i, (gpu, count) in enumerate(gpus):
        spec = gpu if memory is None else {"name": f"{gpu}-cut", "tflops": 15.7, "memory": memory,
                                           "memory_bandwidth": "900 GB/s"}
        machines.append({"name": f"m{i}", "gpu": spec, "count": count, "intra_bandwidth": "150 GB/s"})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "network": {"bandwidth": "100 Gbit/s"}, "machines": machines}))
    return load_topology(path)


def test_speed_proportional_shares_refine_a_mixed_stage(captured, tmp_path):
    """Two A100s and two T4s as one data-parallel stage: even shares leave the A100s waiting for
    the T4s; ``prop=1`` gives each replica a share proportional to its device's speed, and the
    refinement keeps it because the simulator says it is faster (batch 2048: 13.5 against 15.9 ms
    on 2026-11-27; at batch 256 the step is the all-reduce and the shares changed it by 0.01%, which
    the optimizer's host time per parameter, the same on both GPUs, turned into a 0.09% loss)."""
    from tag.parallel.layout import GridSearch, Layout, layout_plan, parse_layout
    from tag.search.layouts import refine

    graph = captured("mlp:layers=4,hidden=2048,in_dim=1024", batch=2048, groups=4).graph
    topo = _machine(tmp_path, "a100-t4", [("A100-40GB", 2), ("T4", 2)])
    costs = CostModel.for_topology(graph, topo)
    sim = Simulator(graph, topo, costs)
    even = layout_plan(graph, topo, Layout(dp=4), costs)
    prop = layout_plan(graph, topo, Layout(dp=4, prop=1), costs)
    speeds = costs.device_speeds()
    assert speeds[0] > 1.5 * speeds[2]  # 2.6x: the per-kernel and host seconds are the same on both GPUs
    assert prop.groups[0].shares == pytest.approx([s / sum(speeds) for s in speeds])
    assert parse_layout(prop.meta["layout"]) == Layout(dp=4, prop=1) and prop.meta["layout"].endswith(",prop=1")
    res = sim.run(even.groups)
    got = refine(graph, topo, costs, sim, GridSearch(even, [(even, res)], 1, 1, 0))
    assert got.plan is not None and got.plan.meta["refinement"] == "speed-proportional shares"
    assert got.plan.groups == prop.groups and got.simulations == 1
    assert got.plan.predicted_iteration_time_s == sim.run(prop.groups).iteration_time_s < res.iteration_time_s
    # one device kind: nothing to refine (even shares are proportional), nothing simulated
    same = _machine(tmp_path, "a100", [("A100-40GB", 4)])
    c2 = CostModel.for_topology(graph, same)
    p2 = layout_plan(graph, same, Layout(dp=4), c2)
    s2 = Simulator(graph, same, c2)
    none = refine(graph, same, c2, s2, GridSearch(p2, [(p2, s2.run(p2.groups))], 1, 1, 0))
    assert none.plan is None and none.simulations == 0


def test_selective_recomputation_refines_a_pipeline(captured, tmp_path):
    """A two-stage 1F1B pipeline: the first stage holds two micro-batches' activations, the last
    one. With memory between what the last stage needs without recomputation and what the first
    needs with it, full recomputation fits; the refinement recomputes only groups of the first
    stage, and is faster."""
    from tag.parallel.layout import GridSearch, Layout, layout_plan
    from tag.search.layouts import refine

    graph = captured("mlp:layers=8,hidden=512,in_dim=256", batch=64, groups=8).graph
    big = _machine(tmp_path, "big", [("V100-SXM2-16GB", 2)])
    costs = CostModel.for_topology(graph, big)
    lay = Layout(dp=1, pp=2, micro=4)
    bare = layout_plan(graph, big, lay, costs)
    full = layout_plan(graph, big, Layout(dp=1, pp=2, micro=4, recompute=1), costs)
    sim = Simulator(graph, big, costs)
    p0, p1 = sim.run(bare.groups, pipeline=bare.pipeline).peak_memory_bytes
    r0, r1 = sim.run(full.groups, pipeline=full.pipeline).peak_memory_bytes
    cap = int(max(p1, r0, r1) * 1.001) + 1
    assert cap < p0  # the first stage does not fit without recomputation, the last does
    topo = _machine(tmp_path, "cut", [("V100-SXM2-16GB", 2)], memory=f"{cap} B")
    costs = CostModel.for_topology(graph, topo)
    sim = Simulator(graph, topo, costs)
    full = layout_plan(graph, topo, Layout(dp=1, pp=2, micro=4, recompute=1), costs)
    res = sim.run(full.groups, pipeline=full.pipeline)
    assert not res.oom and sim.run(bare.groups, pipeline=bare.pipeline).oom
    got = refine(graph, topo, costs, sim, GridSearch(full, [(full, res)], 1, 1, 0))
    assert got.plan is not None and got.plan.meta["refinement"].startswith("recomputation on ")
    first = range(full.pipeline.stages[1])
    on = [g for g, gp in enumerate(got.plan.groups) if gp.recompute]
    assert on and set(on) <= set(first)
    again = sim.run(got.plan.groups, pipeline=got.plan.pipeline)
    assert not again.oom and again.iteration_time_s == got.plan.predicted_iteration_time_s < res.iteration_time_s


def test_find_plan_returns_the_best_of_search_grid_and_refinements(gpt2, tmp_path):
    """``pipelines="auto"`` runs the pruned grid after the search and returns the faster plan (here,
    memory binding, a layout at least as fast as the grid's best); ``off`` runs no grid."""
    from tag.planner import PlannerConfig, find_plan

    topo = _tight(tmp_path, gpt2, "tight-plan", 0.05)
    costs = CostModel.for_topology(gpt2, topo)
    sim = Simulator(gpt2, topo, costs)
    grid = search_layouts(gpt2, topo, costs, lambda p: sim.run(p.groups, pipeline=p.pipeline),
                          bounds=layout_bounds(sim))
    plan = find_plan(gpt2, topo, PlannerConfig(prior="uniform", budget=5, compression="off", executable=False))
    m = plan.meta
    assert m["layouts"] == grid.layouts and 0 < m["layouts_tried"] < m["layouts"]
    assert m["layouts_pruned"] == m["layouts"] - m["layouts_tried"] and isinstance(m["refinements"], list)
    assert plan.predicted_iteration_time_s <= grid.best.predicted_iteration_time_s
    res = sim.run(plan.groups, pipeline=plan.pipeline)
    assert not res.oom and res.iteration_time_s == pytest.approx(plan.predicted_iteration_time_s)
    if m["source"] == "layout-grid":
        assert m["layout"] and "refinement" in m
    off = find_plan(gpt2, topo, PlannerConfig(prior="uniform", budget=5, compression="off", executable=False, pipelines="off"))
    assert "layouts" not in off.meta


def test_a_deadline_stops_the_grid_after_one_layout(gpt2):
    """A deadline already passed: the grid simulates one layout (the first in bound order) and
    says it was cut; ``find_plan``'s time limit reaches the grid the same way."""
    from tag.planner import PlannerConfig, find_plan

    topo = load_topology("homogeneous-2x4-v100")
    costs = CostModel.for_topology(gpt2, topo)
    sim = Simulator(gpt2, topo, costs)
    run = lambda p: sim.run(p.groups, pipeline=p.pipeline)  # noqa: E731
    whole = search_layouts(gpt2, topo, costs, run, bounds=layout_bounds(sim))
    cut = search_layouts(gpt2, topo, costs, run, bounds=layout_bounds(sim), deadline=0.0)
    assert not whole.cut and whole.simulated > 1
    assert cut.cut and cut.simulated == 1 and cut.best is not None
    assert cut.best.predicted_iteration_time_s >= whole.best.predicted_iteration_time_s
    plan = find_plan(gpt2, topo, PlannerConfig(prior="uniform", time_limit=1e-6, compression="off", executable=False))
    assert plan.meta["grid_cut"] and plan.meta["layouts_tried"] == 1
    assert plan.meta["refinements"] in ([], ["stopped at the time limit"])
    assert plan.predicted_iteration_time_s is not None


def test_the_pipeline_drain_holds_in_the_event_loop(gpt2):
    """:func:`tag.sim.bounds._pipeline_waits`'s drain: on every replica of a stage, the last
    micro-batch's backward starts (traced simulation) no earlier than the stage's ``into``; the
    gradient syncs it delays (:func:`tag.sim.bounds._sync_chain`) end later than without it on
    some layout, and the plan bound stays below the simulation. The static bound's fill and drain
    raise it above every device's compute seconds on some layout."""
    from tag.parallel.layout import layout_grid, layout_plan
    from tag.sim.bounds import _busy, _pipeline_waits, _sync_chain

    topo = load_topology("cluster-16gpu-4m")
    costs = CostModel.for_topology(gpt2, topo)
    sim = Simulator(gpt2, topo, costs)
    checked = raised = filled = 0
    for lay in layout_grid(gpt2, topo):
        if lay.pp == 1 or lay.cut != "time" or lay.recompute:
            continue
        p = layout_plan(gpt2, topo, lay, costs)
        res = sim.run(p.groups, pipeline=p.pipeline, trace=True)
        start = {e.name: e.start for e in res.events}
        gds, micro = sim.deploy(p.groups), build_program(sim, p.groups, p.pipeline)
        busy = _busy(sim, gds, micro)
        filled += static_bound(sim, p.groups, p.pipeline).time_s > busy.max() * (1 + 1e-9)
        first, arrive = np.zeros(sim.num_devices), np.zeros(sim.num_devices)
        ends = list(p.pipeline.stages[1:]) + [gpt2.num_groups]
        m = p.pipeline.micro_batches - 1
        for devs, before, _, into in _pipeline_waits(sim, micro, p.pipeline, busy):
            first[devs], arrive[devs] = before, into
            g = next(e - 1 for s, e in zip(p.pipeline.stages, ends) if p.groups[s].devices[0] == devs[0])
            for d in devs.tolist():  # the stage's last group runs first in the backward
                assert start[f"bwd g{g} mb{m} @d{d}"] >= into * (1 - 1e-9), (p.meta["layout"], d)
                checked += 1
        if _sync_chain(sim, gds, micro, first + busy, arrive).max() > \
                _sync_chain(sim, gds, micro, first + busy).max() * (1 + 1e-9):
            raised += 1
        assert plan_bound(sim, p.groups, p.pipeline).time_s <= res.iteration_time_s, p.meta["layout"]
    assert checked > 50 and raised > 0 and filled > 0
