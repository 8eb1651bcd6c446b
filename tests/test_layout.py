"""Megatron-style layouts (``dp=D,pp=P,micro=M``) as TAG plans: parsing, balanced stage cuts,
placement, and ``tag simulate --layout``."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_executor import MLP, B

from tag.cli import main
from tag.cost.baselines import data_parallel
from tag.cost.model import CostModel
from tag.errors import PlanError
from tag.parallel import validate_plan
from tag.parallel.layout import Layout, balanced_cuts, layout_plan, parse_layout
from tag.plan import Plan
from tag.sim import simulate


def test_parse_layout():
    assert parse_layout("dp=2,pp=2,micro=8") == Layout(dp=2, pp=2, micro=8)
    assert parse_layout(" dp=1 , pp=4, micro=4, schedule=kfkb, k=2") == Layout(1, 1, 4, 4, "kfkb", 2)
    assert parse_layout("pp=4,cut=memory") == Layout(pp=4, cut="memory")
    for text, message in [("dp=2,pp", r"'pp': expected key=value"), ("dq=2", r"dq: unknown key; expected one of"),
                          ("dp=two", r"dp: expected a positive integer, got 'two'"), ("dp=0", r"dp: expected a positive"),
                          ("dp=1,dp=2", r"dp: given twice"), ("schedule=zb", r"schedule: expected one of"),
                          ("tp=9", r"tp: expected a tensor-parallel degree of 1\.\.8, got 9"),
                          ("cut=even", r"cut: expected one of \['time', 'memory'\]")]:
        with pytest.raises(PlanError, match="^layout: .*" + message):
            parse_layout(text)


def test_balanced_cuts():
    assert balanced_cuts([1, 1, 1, 1], 2) == [0, 2]
    assert balanced_cuts([3, 1, 1, 1], 2) == [0, 1]
    assert balanced_cuts([1, 1, 1, 1, 4], 2) == [0, 4]
    assert balanced_cuts([0, 0, 0, 9], 4) == [0, 1, 2, 3]  # every stage keeps a group
    assert balanced_cuts([5.0], 1) == [0]
    with pytest.raises(PlanError, match=r"pp: expected 1\.\.3 stages"):
        balanced_cuts([1, 1, 1], 4)
    # heterogeneous stages: the second runs every group 3x slower, so it gets fewer groups
    assert balanced_cuts([[1] * 8, [3] * 8]) == [0, 6]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=6, max_size=6), min_size=1, max_size=4))
def test_balanced_cuts_are_optimal(seconds):
    """The cut minimises the slowest stage: no other cut (brute force) has a faster slowest stage."""
    import itertools

    P, n = len(seconds), 6

    def slowest(cuts):
        b = list(cuts) + [n]
        return max(sum(seconds[s][b[s]:b[s + 1]]) for s in range(P))

    got = balanced_cuts(seconds)
    assert got[0] == 0 and all(b > a for a, b in zip(got, got[1:])) and got[-1] < n
    assert slowest(got) == min(slowest((0, *c)) for c in itertools.combinations(range(1, n), P - 1))


@pytest.fixture(scope="module")
def mlp(captured):
    return captured(MLP, batch=B, groups=4).graph


def test_layout_plans(mlp, topo4):
    costs = CostModel.for_topology(mlp, topo4)
    dp = layout_plan(mlp, topo4, Layout(dp=4), costs)
    assert dp.pipeline is None and [(g.devices, g.shares) for g in dp.groups] == \
        [(g.devices, g.shares) for g in data_parallel(mlp, topo4).groups]
    pp = layout_plan(mlp, topo4, Layout(dp=2, pp=2, micro=2), costs)
    validate_plan(pp, mlp, topo4, pipelines=True)
    cut = pp.pipeline.stages[1]
    assert pp.pipeline.stages[0] == 0 and 0 < cut < mlp.num_groups
    assert all(g.devices == [0, 1] for g in pp.groups[:cut]) and all(g.devices == [2, 3] for g in pp.groups[cut:])
    assert simulate(mlp, topo4, pp).iteration_time_s > 0
    with pytest.raises(PlanError, match=r"^layout: dp\*tp\*pp = 2\*1\*1 = 2 devices, but topology 'local-cpu4' has 4"):
        layout_plan(mlp, topo4, Layout(dp=2), costs)
    with pytest.raises(PlanError, match=r"^layout: micro: 8 micro-batches over dp = 2 replicas need at least 16 samples"):
        layout_plan(mlp, topo4, Layout(dp=2, pp=2, micro=8), costs)


def test_simulate_a_layout(capsys):
    assert main(["simulate", "--model", MLP, "--batch", str(B), "--groups", "4", "--topology", "local-cpu4",
                 "--layout", "dp=2,pp=2,micro=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"] == "layout:dp=2,pp=2,micro=2" and out["iteration_time_s"] > 0
    # a layout that does not fit the topology fails before any capture, in one line
    assert main(["simulate", "--model", MLP, "--topology", "local-cpu4", "--layout", "dp=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dp*tp*pp = 3*1*1 = 3 devices" in err[0]


def test_layout_grid_and_its_best(mlp, topo4):
    from tag.parallel.layout import best_layout, layout_grid
    from tag.sim import Simulator

    grid = layout_grid(mlp, topo4)
    assert Layout(dp=4) in grid and Layout(dp=2, pp=2, micro=4) in grid and Layout(dp=1, pp=4, micro=8) in grid
    assert Layout(dp=2, pp=2, micro=4, cut="memory") in grid
    assert all(g.devices == 4 and g.micro * g.replicas <= B for g in grid)
    assert not any(g.pp == 1 and g.micro > 1 for g in grid)
    sim = Simulator(mlp, topo4)
    runs = []

    def simulate_(plan):
        runs.append(sim.run(plan.groups, pipeline=plan.pipeline))
        return runs[-1]

    plan, tried = best_layout(mlp, topo4, CostModel.for_topology(mlp, topo4), simulate_)
    assert tried == len(grid) > len(runs)  # (a memory cut equal to the time cut: one simulation)
    assert plan.predicted_iteration_time_s == min(r.iteration_time_s for r in runs if not r.oom)
    assert plan.meta["searcher"] == "dp-tp-pp-grid"


def test_the_planner_proposes_a_pipeline_where_it_pays(captured, tmp_path):
    """Four single-GPU machines too small for the model (parameters, gradients and Adam state do
    not fit on one): TAG's per-group actions can only run the groups one device after another
    (model parallel on the full batch); a pipeline overlaps them. The planner's search (its
    plan-level decisions) returns a pipeline, faster than TAG's action space alone and as fast as
    the best hand-written layout, and the plan file carries it."""
    import yaml

    from tag.planner import find_plan
    from tag.topology import load_topology

    graph = captured("mlp:layers=8,hidden=512,in_dim=256", batch=128, groups=8).graph
    state = sum(p.nbytes for p in graph.params) * 4  # weights, gradients, two Adam moments
    gpu = {"name": "small", "tflops": 14, "memory": f"{int(state * 0.6)} B", "memory_bandwidth": "900 GB/s"}
    path = tmp_path / "four-small.yaml"
    path.write_text(yaml.safe_dump({"name": "four-small", "network": {"bandwidth": "10 Gbit/s"},
                                    "machines": [{"name": f"m{i}", "gpu": gpu, "count": 1} for i in range(4)]}))
    topo = load_topology(path)
    searched = find_plan(graph, topo, prior="uniform", budget=100, pipelines="off", compression="off")
    best = find_plan(graph, topo, prior="uniform", budget=100, compression="off")
    assert best.pipeline is not None and best.meta["source"] == "search"
    validate_plan(best, graph, topo, pipelines=True)
    grid = find_plan(graph, topo, prior="uniform", budget=1, pipelines="grid", compression="off")
    assert best.predicted_iteration_time_s <= grid.meta["best_layout_time_s"]
    assert searched.predicted_iteration_time_s is None or \
        best.predicted_iteration_time_s < searched.predicted_iteration_time_s
    res = simulate(graph, topo, best)
    assert not res.oom and res.iteration_time_s == pytest.approx(best.predicted_iteration_time_s)
    best.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").pipeline == best.pipeline


def test_check_fits_counts_one_sample_of_activations(captured, tmp_path):
    """A model whose full batch's activations exceed the cluster but whose state and one sample's
    do not may still run (as a pipeline of small micro-batches): it is not refused up front."""
    from tag.cost.baselines import check_fits, group_footprints
    from tag.errors import OutOfMemoryError
    from tag.topology import load_topology

    graph = captured("mlp:layers=4,hidden=512,in_dim=256", batch=4096, groups=4).graph
    low, full = sum(group_footprints(graph, 1)), sum(group_footprints(graph))
    assert full > 2 * low

    def two(each: float):
        gpu = {"name": "g", "tflops": 10, "memory": f"{int(each)} B", "memory_bandwidth": "900 GB/s"}
        return load_topology({"name": "two", "machines": [{"name": "m", "gpu": gpu, "count": 2,
                                                           "intra_bandwidth": "10 GB/s"}]})

    check_fits(graph, two((low + full) / 4))  # between one sample's need and the full batch's
    with pytest.raises(OutOfMemoryError, match=r"needs at least .* of all 2 devices"):
        check_fits(graph, two(low / 4))


def test_the_planner_falls_back_to_the_grid_when_nothing_searched_fits(captured, tmp_path):
    """Four devices whose memory holds the best Megatron-style layout (a 2-stage pipeline of
    2-way tensor-parallel stages) but no data-parallel replica: a one-playout search finds only
    plans out of memory, so ``pipelines="auto"`` returns the grid's layout, which fits, instead of
    an out-of-memory plan (tag plan would refuse it)."""
    import yaml

    from tag.cost.model import CostModel
    from tag.parallel.layout import best_layout
    from tag.planner import find_plan
    from tag.sim import Simulator
    from tag.topology import load_topology

    graph = captured("mlp:layers=4,hidden=256,in_dim=64", batch=16, groups=4).graph
    path = tmp_path / "four.yaml"

    def topology(capacity: int):
        gpu = {"name": "g", "tflops": 1, "memory": f"{capacity} B", "memory_bandwidth": "100 GB/s"}
        path.write_text(yaml.safe_dump({"name": "four", "network": {"bandwidth": "1 GB/s"}, "machines": [
            {"name": "m", "gpu": gpu, "count": 4, "intra_bandwidth": "10 GB/s"}]}))
        return load_topology(path)

    big = topology(2**30)
    sim = Simulator(graph, big, CostModel.for_topology(graph, big))
    dp = max(sim.run(data_parallel(graph, big).groups).peak_memory_bytes)
    lay, _ = best_layout(graph, big, sim.costs, lambda q: sim.run(q.groups, pipeline=q.pipeline))
    fits = max(sim.run(lay.groups, pipeline=lay.pipeline).peak_memory_bytes)
    assert fits < dp / 2
    topo = topology(int(1.25 * fits))
    plan = find_plan(graph, topo, prior="uniform", budget=1, compression="off", executable=False)
    assert plan.meta["source"] == "layout-grid" and plan.meta["grid_because"] == "every searched plan runs out of memory"
    res = simulate(graph, topo, plan)
    assert not res.oom and res.iteration_time_s == pytest.approx(plan.predicted_iteration_time_s)
    off = find_plan(graph, topo, prior="uniform", budget=1, compression="off", pipelines="off")
    assert off.meta["oom"] and "grid_because" not in off.meta  # TAG's action space alone: no fallback


def test_layouts_on_a_sub_cluster_leave_the_slowest_kind_idle(captured, tmp_path, capsys):
    """Four single-GPU machines too small for the model, two of them 200x slower: every layout over
    all four has a stage on a slow GPU, so the grid runs again without them
    (:func:`tag.search.layouts.subcluster_search`); its plan keeps the slow machines idle, is what
    it costs on the whole cluster, beats the grid over all four (4.5 against 8.7 ms), and the planner returns a plan at
    least that fast. The restricted cost model is the whole one's on the kept devices."""
    import yaml

    from tag.planner import find_plan
    from tag.search.layouts import grid_search, subcluster_search, subclusters
    from tag.sim import Simulator
    from tag.topology import load_topology

    graph = captured("mlp:layers=8,hidden=512,in_dim=256", batch=128, groups=8).graph
    state = sum(p.nbytes for p in graph.params) * 4  # weights, gradients, two Adam moments

    def gpu(name, tflops):
        return {"name": name, "tflops": tflops, "memory": f"{int(state * 0.9)} B", "memory_bandwidth": "900 GB/s"}

    kinds = [gpu("fast", 14), gpu("slow", 0.07), gpu("fast", 14), gpu("slow", 0.07)]
    path = tmp_path / "mixed-small.yaml"
    path.write_text(yaml.safe_dump({"name": "mixed-small", "network": {"bandwidth": "10 Gbit/s"},
                                    "machines": [{"name": f"m{i}", "gpu": g, "count": 1} for i, g in enumerate(kinds)]}))
    topo = load_topology(path)
    costs = CostModel.for_topology(graph, topo)
    sim = Simulator(graph, topo, costs)
    assert subclusters(topo, costs) == [[0, 2]]
    sub, devices = topo.restricted([0, 2])
    assert devices == [0, 2] and sub.num_devices == 2 and [m.name for m in sub.machines] == ["m0", "m2"]
    sub_costs = costs.restricted(sub, devices)
    assert sub_costs.table(1) is costs.table(2) and sub_costs.comm.bandwidth[0, 1] == costs.comm.bandwidth[0, 2]
    whole = grid_search(graph, topo, costs, sim, executable=True).best
    plan, notes = subcluster_search(graph, topo, costs, sim, executable=True)
    assert plan is not None and len(notes) == 1 and notes[0].startswith("without slow: ")
    assert {d for g in plan.groups for d in g.devices} <= {0, 2} and plan.meta["machines"] == ["m0", "m2"]
    validate_plan(plan, graph, topo, pipelines=True)
    res = sim.run(plan.groups, pipeline=plan.pipeline)
    assert not res.oom and res.iteration_time_s == plan.predicted_iteration_time_s
    assert whole is None or whole.predicted_iteration_time_s is None or \
        plan.predicted_iteration_time_s < 0.75 * whole.predicted_iteration_time_s
    # pruned against a plan it cannot beat: nothing
    assert subcluster_search(graph, topo, costs, sim, incumbent=plan.predicted_iteration_time_s / 10)[0] is None
    best = find_plan(graph, topo, prior="uniform", budget=50, compression="off")
    assert best.predicted_iteration_time_s <= plan.predicted_iteration_time_s and best.meta["subclusters"]
    rc = main(["plan", "--model", "mlp:layers=8,hidden=512,in_dim=256", "--batch", "128", "--groups", "8",
               "--topology", str(path), "--prior", "uniform", "--budget", "50"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "sub-cluster without slow: dp=1,tp=1,pp=2" in out, out
    # data parallel does not fit on these devices: the progress line does not measure against it
    assert "(data parallel does not)" in out or "(nor does data parallel)" in out, out
    # the same layout by hand: tag.layout_plan / tag simulate --layout ... --machines m0,m2
    from tag.planner import layout_plan as api_layout_plan
    by_hand = api_layout_plan(graph, topo, plan.meta["layout"], costs, machines=["m0", "m2"])
    assert [g.key() for g in by_hand.groups] == [g.key() for g in plan.groups] and by_hand.pipeline == plan.pipeline
    sim_argv = ["simulate", "--model", "mlp:layers=8,hidden=512,in_dim=256", "--batch", "128", "--groups", "8",
                "--topology", str(path), "--layout", plan.meta["layout"]]
    assert main([*sim_argv, "--machines", "m0,m2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_time_s"] == pytest.approx(plan.predicted_iteration_time_s)
    assert main([*sim_argv, "--machines", "m0,m9"]) == 2
    assert "machines: no machine 'm9' in topology 'mixed-small'; expected some of m0, m1, m2, m3" in capsys.readouterr().err
    assert main([*sim_argv, "--machines", "m0"]) == 2  # dp*tp*pp = 2 devices on one
    assert "but topology 'mixed-small[m0]' has 1" in capsys.readouterr().err
