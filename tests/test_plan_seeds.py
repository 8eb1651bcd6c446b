"""find_plan's seeds: the fsdp baseline and the layout grid's sharded layouts, so that the plan is
never worse than either (tag.planner.find_plan, tag.parallel.layout.sharded_layouts)."""

from __future__ import annotations

import pytest
import yaml


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):
    """Two machines of two GPUs, each GPU holding 0.9x the mlp's parameters, gradients and Adam
    state: plain data parallel cannot fit, ZeRO-3 over the four (a quarter of the state) can."""
    from tag.graph import capture
    from tag.topology import load_topology
    from tag.workloads import load_workload

    graph = capture(load_workload("mlp:layers=8,hidden=512,in_dim=256", batch=64), num_groups=8).graph
    state = sum(p.nbytes for p in graph.params) * 4  # weights, gradients, two Adam moments
    gpu = {"name": "small", "tflops": 14, "memory": f"{int(state * 0.9)} B", "memory_bandwidth": "900 GB/s"}
    path = tmp_path_factory.mktemp("topo") / "two-by-two.yaml"
    path.write_text(yaml.safe_dump({"name": "two-by-two", "network": {"bandwidth": "10 Gbit/s"},
                                    "machines": [{"name": f"m{i}", "gpu": gpu, "count": 2, "intra_bandwidth": "100 GB/s"}
                                                 for i in range(2)]}))
    return graph, load_topology(path)


def test_the_grid_has_the_sharded_layouts(small_cluster):
    from tag.parallel.layout import Layout, layout_grid, parse_layout

    graph, topo = small_cluster
    sharded = [lay for lay in layout_grid(graph, topo) if lay.zero and not lay.offload]  # (offload: test_plan_offload)
    # zero 1/2/3 over all 4 devices, hybrid ZeRO-3 in shard groups of a machine's 2, each with and without recompute
    assert sorted((lay.zero, lay.shard, lay.recompute) for lay in sharded) == \
        sorted((z, s, rc) for z, s in ((1, 0), (2, 0), (3, 0), (3, 2)) for rc in (0, 1))
    assert all(lay.dp == 4 and lay.pp == 1 and lay.tp == 1 for lay in sharded)
    assert parse_layout("hsdp=2x2") == Layout(dp=4, zero=3, shard=2)


def test_find_plan_is_never_worse_than_fsdp_or_the_best_layout(small_cluster):
    from tag.cli.plan import summary
    from tag.cost.baselines import data_parallel, fully_sharded
    from tag.planner import PlannerConfig, find_plan
    from tag.sim import Simulator

    graph, topo = small_cluster
    sim = Simulator(graph, topo)
    assert sim.run(data_parallel(graph, topo).groups).oom  # the state does not fit replicated
    fsdp = sim.run(fully_sharded(graph, topo).groups)
    assert not fsdp.oom
    # one playout, no grid: the search alone cannot beat the seed, the fsdp baseline is the plan
    alone = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=1, pipelines="off", compression="off"))
    assert alone.meta["fsdp_time_s"] == pytest.approx(fsdp.iteration_time_s)
    assert alone.predicted_iteration_time_s <= fsdp.iteration_time_s
    assert alone.meta["source"] == "fsdp" and {g.sync for g in alone.groups} == {"zero3"}
    shown = summary(alone)  # what tag plan prints and writes with --json
    assert shown["fsdp_time_s"] == alone.meta["fsdp_time_s"] and shown["speedup_vs_fsdp"] == pytest.approx(1.0)
    # with the grid unpruned by the search: its best layout is reported, the plan no slower
    full = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=20, pipelines="grid", compression="off"))
    assert full.meta["best_layout_time_s"] is not None and not full.meta["oom"]
    assert full.predicted_iteration_time_s <= min(full.meta["best_layout_time_s"], fsdp.iteration_time_s)
    res = sim.run(full.groups, pipeline=full.pipeline)
    assert not res.oom and res.iteration_time_s == pytest.approx(full.predicted_iteration_time_s)
