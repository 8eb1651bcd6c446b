"""``tag.find_plan(compression=...)``: SFB is kept only where the simulator confirms it pays."""

from __future__ import annotations

from tag.planner import PlannerConfig, find_plan
from tag.sim import simulate
from tag.topology import load_topology


def _two_boxes(inter: str):
    machines = [{"name": f"n{k}", "gpu": "V100-SXM2-16GB", "count": 2, "intra_bandwidth": "150 GB/s"}
                for k in range(2)]
    return load_topology({"name": "2x2-v100", "machines": machines,
                          "network": {"bandwidth": inter, "latency": "20 us"}})


def test_compression_auto_never_slower_and_consistent(captured):
    graph = captured("mlp:hidden=1024,layers=2,in_dim=256,classes=100", batch=8, groups=4).graph
    topo = _two_boxes("1 Gbit/s")
    off = find_plan(graph, topo, PlannerConfig(searcher="random", budget=20, seed=1, compression="off"))
    auto = find_plan(graph, topo, PlannerConfig(searcher="random", budget=20, seed=1, compression="auto"))
    assert auto.predicted_iteration_time_s <= off.predicted_iteration_time_s
    assert auto.meta["compression"].startswith("compression:")
    # the predicted time is the simulator's verdict on the plan as written
    assert simulate(graph, topo, auto).iteration_time_s == auto.predicted_iteration_time_s
    if any(g.sfb for g in auto.groups):
        assert auto.predicted_iteration_time_s < off.predicted_iteration_time_s
        assert auto.meta["sfb_saving_s"] > 0
    assert all(not g.sfb for g in off.groups) and off.meta["compression"] == "off"


def test_compression_on_data_parallel_over_slow_links(captured):
    """Random search over this space keeps all groups on one machine; force the DP case too."""
    from tag.cost.baselines import data_parallel
    from tag.planner import _compress
    from tag.sim import Simulator

    graph = captured("mlp:hidden=1024,layers=2,in_dim=256,classes=100", batch=8, groups=4).graph
    topo = _two_boxes("1 Gbit/s")
    p = data_parallel(graph, topo)
    sim = Simulator(graph, topo)
    p.predicted_iteration_time_s = sim.run(p.groups).iteration_time_s
    before = p.predicted_iteration_time_s
    note = _compress(graph, topo, p, sim)
    assert "saves" in note and any(g.sfb for g in p.groups)
    assert p.predicted_iteration_time_s < 0.5 * before
