"""Megatron-style layouts (``dp=D,pp=P,micro=M``) as TAG plans: parsing, balanced stage cuts,
placement, and ``tag simulate --layout``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_executor import MLP, B

from tag.cli import main
from tag.cost.baselines import data_parallel
from tag.cost.model import CostModel
from tag.errors import PlanError
from tag.parallel import validate_plan
from tag.parallel.layout import Layout, balanced_cuts, layout_plan, outside_blocks, parse_layout
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

    from tag.planner import PlannerConfig, find_plan
    from tag.topology import load_topology

    graph = captured("mlp:layers=8,hidden=512,in_dim=256", batch=128, groups=8).graph
    state = sum(p.nbytes for p in graph.params) * 4  # weights, gradients, two Adam moments
    gpu = {"name": "small", "tflops": 14, "memory": f"{int(state * 0.6)} B", "memory_bandwidth": "900 GB/s"}
    path = tmp_path / "four-small.yaml"
    path.write_text(yaml.safe_dump({"name": "four-small", "network": {"bandwidth": "10 Gbit/s"},
                                    "machines": [{"name": f"m{i}", "gpu": gpu, "count": 1} for i in range(4)]}))
    topo = load_topology(path)
    searched = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=100, pipelines="off", compression="off"))
    alone = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=100, compression="off", layout_grid=False))
    assert alone.pipeline is not None and alone.meta["source"] == "search"
    # with the grid: its 4-stage pipeline cut by time, which fits with the optimizer offloaded
    # (tag.parallel.layout.offload_layouts) and not without, is faster than the searched one
    best = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=100, compression="off"))
    assert best.pipeline is not None and best.predicted_iteration_time_s <= alone.predicted_iteration_time_s
    validate_plan(best, graph, topo, pipelines=True)
    grid = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=1, pipelines="grid", compression="off"))
    assert best.predicted_iteration_time_s <= grid.meta["best_layout_time_s"]
    assert searched.predicted_iteration_time_s is None or \
        alone.predicted_iteration_time_s < searched.predicted_iteration_time_s
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

    def two(each: float, host: str = "1 kB"):
        gpu = {"name": "g", "tflops": 10, "memory": f"{int(each)} B", "memory_bandwidth": "900 GB/s"}
        return load_topology({"name": "two", "machines": [{"name": "m", "gpu": gpu, "count": 2,
                                                           "intra_bandwidth": "10 GB/s", "host_memory": host}]})

    check_fits(graph, two((low + full) / 4))  # between one sample's need and the full batch's
    with pytest.raises(OutOfMemoryError, match=r"needs at least .* of all 2 devices .* nor does it with the optimizer "
                                               r"offloaded to the 0.977 KiB of host memory"):
        check_fits(graph, two(low / 4))
    check_fits(graph, two(low / 4, host="1 GB"))  # the devices hold the parameters, the host the state


def test_the_planner_falls_back_to_the_grid_when_nothing_searched_fits(captured, tmp_path):
    """Four devices whose memory holds the best Megatron-style layout (a 2-stage pipeline of
    2-way tensor-parallel stages) but no data-parallel replica: a one-playout search finds only
    plans out of memory, so ``pipelines="auto"`` returns the grid's layout, which fits, instead of
    an out-of-memory plan (tag plan would refuse it)."""
    import yaml

    from tag.cost.model import CostModel
    from tag.parallel.layout import best_layout
    from tag.planner import PlannerConfig, find_plan
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
    plan = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=1, compression="off", executable=False))
    assert plan.meta["source"] == "layout-grid" and plan.meta["grid_because"] == "every searched plan runs out of memory"
    res = simulate(graph, topo, plan)
    assert not res.oom and res.iteration_time_s == pytest.approx(plan.predicted_iteration_time_s)
    off = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=1, compression="off", pipelines="off"))
    assert off.meta["oom"] and "grid_because" not in off.meta  # TAG's action space alone: no fallback


def test_layouts_on_a_sub_cluster_leave_the_slowest_kind_idle(captured, tmp_path, capsys):
    """Four single-GPU machines too small for the model, two of them 200x slower: every layout over
    all four has a stage on a slow GPU, so the grid runs again without them
    (:func:`tag.search.layouts.subcluster_search`); its plan keeps the slow machines idle, is what
    it costs on the whole cluster, beats the grid over all four (4.5 against 8.7 ms), and the planner returns a plan at
    least that fast. The restricted cost model is the whole one's on the kept devices."""
    import yaml

    from tag.planner import PlannerConfig, find_plan
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
    best = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=50, compression="off"))
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


# ---- published plans: stated layers per stage and a device order ------------------------------

TINY_GPT2 = "gpt2:n_layer=4,n_embd=64,n_head=2,vocab=100,seq=16"


@pytest.fixture(scope="module")
def gpt2_16():
    """A 4-layer GPT-2 at batch 8 in 16 op-groups, its own (tests regroup it in place)."""
    from tag.graph import capture
    from tag.workloads import load_workload

    return capture(load_workload(TINY_GPT2, batch=8), num_groups=16).graph


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """Two machines ``m0``, ``m1`` of two CPU devices each."""
    from tag.topology import load_topology

    path = tmp_path_factory.mktemp("topo") / "two-by-two.yaml"
    path.write_text("name: two-by-two\nnetwork: {bandwidth: 10 Gbit/s}\nmachines:\n"
                    + "".join(f"  - {{name: m{i}, gpu: cpu, count: 2, intra_bandwidth: 5 GB/s}}\n" for i in range(2)))
    return load_topology(path)


def _stage_of_layer_ops(graph, plan) -> dict[int, set[int]]:
    """Layer -> the stages holding the forward ops computing on the batch with its parameters
    (read directly; by the parameters' names, ``transformer.h.<layer>.``, ``layers.<layer>.``,
    ``layer.<layer>.``), independent of :mod:`tag.parallel.layers`."""
    import re

    from tag.parallel.pipeline import stage_of_group

    stage = stage_of_group(plan.pipeline, graph.num_groups)
    out: dict[int, set[int]] = {}
    for p in graph.params:
        if m := re.search(r"\.(?:h|layers|layer)\.(\d+)\.", p.name):
            for c in graph.tensors[p.tensor].consumers:
                if graph.ops[c].phase == "fwd" and graph.ops[c].batch:
                    out.setdefault(int(m.group(1)), set()).add(stage[graph.ops[c].group])
    return out


def test_parse_stages_and_order():
    lay = parse_layout("pp=4,micro=4,stages=7+6+6+5,order=m1:0-3+m0:0-3")
    assert lay.stages == (7, 6, 6, 5) and lay.order == ("m1:0-3", "m0:0-3")
    assert Layout(pp=2, stages=[3, 1], order=[2, 3]) == Layout(pp=2, stages=(3, 1), order=(2, 3))  # lists: tuples
    for text, message in [("pp=2,stages=3+x", r"stages: expected layer counts joined by '\+'"),
                          ("pp=2,stages=4", r"stages: 4 is 1 stages, pp is 2; expected 2 layer counts"),
                          ("pp=2,stages=4+0", r"stages: expected positive layer counts"),
                          ("pp=2,stages=3+1,cut=memory", r"cut: stages=3\+1 fixes the cut; expected no cut=memory"),
                          ("dp=2,order=m0:0+", r"order: '': expected a device index")]:
        with pytest.raises(PlanError, match="^layout: " + message):
            parse_layout(text)


def test_uneven_stages_hold_exactly_the_stated_layers(gpt2_16, topo4):
    """``stages=3+1``: layers 0-2 (and the embedding) on stage 0, layer 3 (and the head and loss)
    on stage 1; ``1+2+1`` on three stages; every forward op reading a layer's parameters lies in
    its stage, with tensor parallelism too (the cut between Megatron blocks)."""
    from tag.parallel.layout import align_groups, stage_table
    from tag.parallel.pipeline import stage_of_group

    graph = gpt2_16
    k = align_groups(graph, Layout(pp=2, stages=(3, 1)))
    assert graph.num_groups == k and abs(k - 16) <= 16
    plan = layout_plan(graph, topo4, Layout(dp=2, pp=2, micro=2, stages=(3, 1)), CostModel.for_topology(graph, topo4))
    validate_plan(plan, graph, topo4, pipelines=True)
    assert _stage_of_layer_ops(graph, plan) == {0: {0}, 1: {0}, 2: {0}, 3: {1}}
    stage = stage_of_group(plan.pipeline, graph.num_groups)

    def reads(name):  # stages of the forward ops reading parameter ``name``
        p = next(p for p in graph.params if p.name.endswith(name))
        return sorted(stage[graph.ops[c].group] for c in graph.tensors[p.tensor].consumers if graph.ops[c].phase == "fwd")

    # the embeddings on the first stage, the final norm and the head (tied to the token embedding) on the last
    assert reads("wpe.weight") == [0] and reads("lm_head.weight") == [0, 1] and set(reads("ln_f.weight")) == {1}
    assert stage[graph.ops[graph.tensors[graph.loss].producer].group] == 1
    assert [r["layers"] for r in stage_table(graph, plan)] == [[0, 2], [3, 3]]
    assert plan.meta["layout"] == "dp=2,tp=1,pp=2,micro=2,schedule=1f1b,stages=3+1"
    assert simulate(graph, topo4, plan).iteration_time_s > 0
    # three stages on three of the four devices (order): 1+2+1
    three = Layout(pp=3, micro=3, stages=(1, 2, 1), order=(3, 1, 0))
    align_groups(graph, three)
    plan = layout_plan(graph, topo4, three, CostModel.for_topology(graph, topo4))
    validate_plan(plan, graph, topo4, pipelines=True)
    assert _stage_of_layer_ops(graph, plan) == {0: {0}, 1: {1}, 2: {1}, 3: {2}}
    assert [r["devices"] for r in stage_table(graph, plan)] == [[3], [1], [0]]
    # tensor parallel: dp=1,tp=2,pp=2, each stage's cut between Megatron blocks
    tp = Layout(tp=2, pp=2, micro=2, stages=(1, 3))
    align_groups(graph, tp)
    plan = layout_plan(graph, topo4, tp, CostModel.for_topology(graph, topo4))
    validate_plan(plan, graph, topo4, pipelines=True, tensor_parallel=True)
    assert _stage_of_layer_ops(graph, plan) == {0: {0}, 1: {1}, 2: {1}, 3: {1}}
    assert all(g.sync == "tp" and g.tp == 2 for g in plan.groups)
    # vocab=1: the groups before the first block and after the last run data parallel over the stage
    # (each device half the samples, as Megatron-LM's vocabulary-parallel head halves their work);
    # costed for Megatron-LM's runs
    plan = layout_plan(graph, topo4, replace(tp, vocab=1), CostModel.for_topology(graph, topo4))
    outer = outside_blocks(graph)
    assert len(plan.groups) - 1 in outer  # (the embedding shares group 0 with the first block here)
    assert all((g.sync == "tp" and g.tp == 2) == (i not in outer) for i, g in enumerate(plan.groups))
    assert all(g.shares == plan.groups[1].shares for g in plan.groups)  # each device its half of the samples
    assert simulate(graph, topo4, plan).iteration_time_s > 0


@pytest.mark.parametrize("spec", ["llama:n_layer=4,n_embd=64,n_head=4,vocab=100,seq=16",
                                  "bert:n_layer=4,n_embd=64,n_head=2,vocab=100,seq=16"])
def test_stated_stages_in_other_zoo_transformers(spec, topo4):
    """Llama (pre-norm, weights transposed by ``t`` ops) and BERT (post-norm: a layer begins with
    its query weight's transpose, which no group starts at) hold the stated layers too, plain and
    tensor parallel."""
    from tag.graph import capture
    from tag.parallel.layout import align_groups
    from tag.workloads import load_workload

    graph = capture(load_workload(spec, batch=8), num_groups=16).graph
    for lay, want in [(Layout(dp=2, pp=2, micro=2, stages=(3, 1)), {0: {0}, 1: {0}, 2: {0}, 3: {1}}),
                      (Layout(tp=2, pp=2, micro=2, stages=(1, 3)), {0: {0}, 1: {1}, 2: {1}, 3: {1}})]:
        align_groups(graph, lay)
        plan = layout_plan(graph, topo4, lay, CostModel.for_topology(graph, topo4))
        validate_plan(plan, graph, topo4, pipelines=True, tensor_parallel=True)
        assert _stage_of_layer_ops(graph, plan) == want, lay


def test_stated_stages_agree_with_a_cut_that_falls_on_layers(gpt2_16, topo4):
    """A default cut that falls between layers, stated as layer counts, gives the same plan."""
    from tag.parallel.layout import stage_table

    graph = gpt2_16
    costs = CostModel.for_topology(graph, topo4)
    for pp in (2, 4):
        cut = layout_plan(graph, topo4, Layout(dp=4 // pp, pp=pp, micro=2), costs)
        rows = stage_table(graph, cut)
        layers = [r["layers"] for r in rows]
        if None in layers or any(b[0] != a[1] + 1 for a, b in zip(layers, layers[1:])):
            continue  # (this grouping's cut splits a layer)
        stated = layout_plan(graph, topo4, Layout(dp=4 // pp, pp=pp, micro=2,
                                                  stages=tuple(b - a + 1 for a, b in layers)), costs)
        assert stated.pipeline == cut.pipeline and [g.key() for g in stated.groups] == [g.key() for g in cut.groups]


def test_an_order_places_the_ranks(gpt2_16, two_by_two):
    """``order=m1:0-1+m0:0-1``: stage 0 on machine m1, stage 1 on m0 (replicas in the stated
    order); the identity order is the default plan; device names, ranges, machines and indices
    spell the same order."""
    graph = gpt2_16
    costs = CostModel.for_topology(graph, two_by_two)
    default = layout_plan(graph, two_by_two, Layout(dp=2, pp=2, micro=2), costs)
    same = layout_plan(graph, two_by_two, Layout(dp=2, pp=2, micro=2, order=(0, 1, 2, 3)), costs)
    assert [g.key() for g in same.groups] == [g.key() for g in default.groups] and same.pipeline == default.pipeline
    assert "order" not in default.meta["layout"] and same.meta["layout"].endswith(",order=m0:0-1+m1:0-1")
    swapped = [layout_plan(graph, two_by_two, parse_layout(f"dp=2,pp=2,micro=2,order={o}"), costs)
               for o in ("m1:0-1+m0:0-1", "m1+m0", "m1:0+m1:1+0-1", "2+3+0+1")]
    for plan in swapped:
        validate_plan(plan, graph, two_by_two, pipelines=True)
        s1 = plan.pipeline.stages[1]
        assert all(g.devices == [2, 3] for g in plan.groups[:s1]) and all(g.devices == [0, 1] for g in plan.groups[s1:])
        assert plan.meta["layout"].endswith(",order=m1:0-1+m0:0-1")
    reversed_ = layout_plan(graph, two_by_two, Layout(dp=2, pp=2, micro=2, order=("m1:1", "m1:0", "m0:1", "m0:0")), costs)
    assert reversed_.groups[0].devices == [3, 2] and reversed_.groups[-1].devices == [1, 0]
    assert simulate(graph, two_by_two, swapped[0]).iteration_time_s > 0


@pytest.mark.parametrize("order, message", [
    ("m0:0-1+m1:0", r"order: names 3 devices, dp\*tp\*pp = 2\*1\*2 = 4; expected 4"),
    ("m0+m0:1+m1:0", r"order: device m0:1 \(index 1\) given twice; expected distinct devices"),
    ("m0+m2", r"order: 'm2': no machine 'm2' in topology 'two-by-two'; expected one of m0, m1"),
    ("m0+m7:0-1", r"order: 'm7:0-1': no machine 'm7' in topology"),
    ("m0+m1:1-2", r"order: 'm1:1-2': expected a device index, .*machine 'm1' has 2 devices"),
    ("0-4", r"order: '0-4': expected .*topology 'two-by-two' has 4"),
])
def test_a_bad_order_is_one_line(two_by_two, order, message):
    from tag.parallel.layout import layout_devices

    with pytest.raises(PlanError, match=f"^layout: {message}") as e:
        layout_devices(parse_layout(f"dp=2,pp=2,order={order}"), two_by_two)
    assert "\n" not in str(e.value)


def test_bad_stages_name_the_value_and_a_grouping_that_works(gpt2_16, mlp):
    from tag.graph.grouping import group_ops
    from tag.parallel.layout import align_groups, stage_starts

    graph = gpt2_16
    with pytest.raises(PlanError, match=r"^layout: stages: 3\+2 = 5 layers, model 'gpt2:n_layer=4,.*' has 4 "
                                        r"\(model\.transformer\.h\.0 \.\. model\.transformer\.h\.3\); expected counts summing to 4$"):
        stage_starts(graph, Layout(pp=2, stages=(3, 2)))
    # an MLP's layers: its Sequential's numbered modules (Linear layers; the ReLUs hold no parameters)
    with pytest.raises(PlanError, match=r"^layout: stages: 1\+1 = 2 layers, model 'mlp' has \d+ \(model\.net\.0 \.\. "
                                        r"model\.net\.\d+\); expected counts summing to \d+$"):
        stage_starts(mlp, Layout(pp=2, stages=(1, 1)))
    # 5 groups: layer 3 begins inside one; the count suggested works
    group_ops(graph, 5)
    with pytest.raises(PlanError, match=r"^layout: stages: stage 1's first layer \(model\.transformer\.h\.3\) begins "
                                        r"inside one of the 5 op-groups; expected --groups (\d+) ") as e:
        stage_starts(graph, Layout(pp=2, stages=(3, 1)))
    assert graph.num_groups == 5  # (the suggestion regrouped a copy)
    k = int(str(e.value).split("--groups ")[1].split()[0])
    assert align_groups(graph, Layout(pp=2, stages=(3, 1)), 5) == k == graph.num_groups
    assert len(stage_starts(graph, Layout(pp=2, stages=(3, 1)))) == 2


def test_simulate_a_published_layout(tmp_path, capsys):
    """``tag simulate --layout ...,stages=3+1,order=...``: the op-group count aligned without
    ``--groups``, the layout that ran printed and in the JSON, ``--save-plan`` writes it;
    ``--machines`` with an order of other machines' devices is refused in one line."""
    from tag.topology import load_topology

    topo = tmp_path / "two.yaml"
    topo.write_text("name: two-by-two\nnetwork: {bandwidth: 10 Gbit/s}\nmachines:\n"
                    + "".join(f"  - {{name: m{i}, gpu: cpu, count: 2, intra_bandwidth: 5 GB/s}}\n" for i in range(2)))
    argv = ["simulate", "--model", TINY_GPT2, "--batch", "8", "--topology", str(topo),
            "--layout", "dp=2,pp=2,micro=2,stages=3+1,order=m1+m0"]
    assert main([*argv, "--save-plan", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "layout ran: dp=2,tp=1,pp=2,micro=2,schedule=1f1b,stages=3+1,order=m1:0-1+m0:0-1" in out
    assert "  stage 0: layers 0-2, op-groups 0-" in out and ", devices m1:0-1" in out
    assert "  stage 1: layer 3, op-groups " in out and ", devices m0:0-1" in out
    plan = Plan.load(tmp_path / "p.json")
    assert plan.meta["layout"].endswith("stages=3+1,order=m1:0-1+m0:0-1") and plan.groups[0].devices == [2, 3]
    assert main([*argv, "--groups", str(len(plan.groups)), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["layout"] == plan.meta["layout"] and [s["layers"] for s in got["stages"]] == [[0, 2], [3, 3]]
    assert got["iteration_time_s"] == pytest.approx(plan.predicted_iteration_time_s)
    assert main([*argv, "--machines", "m0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "but topology 'two-by-two[m0]' has 2" in err[0]
    assert main([*argv[:-1], "dp=1,pp=2,micro=2,stages=3+1,order=m1:0+m0:0", "--machines", "m0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "layout: order: device m1:0 is not on machines m0; expected their devices only" in err[0]
    assert main([*argv[:-1], "dp=1,pp=2,micro=2,stages=3+1,order=m1:1+m1:0", "--machines", "m1"]) == 0
    assert "devices m1:1" in capsys.readouterr().out
    assert load_topology(topo).num_devices == 4


def test_an_uneven_published_layout_trains_as_one_process(topo4):
    """The plan of ``dp=2,pp=2,micro=2,stages=2+1,order=2+3+0+1`` (stage 0 on devices 2 and 3)
    on a 3-layer GPT-2 trains, in one process with every rank's runtime, to the parameters of
    single-process training."""
    from tag.executor import reference_training, run_virtual
    from tag.executor.equality import assert_params_equal
    from tag.graph import capture
    from tag.parallel.layout import align_groups
    from tag.workloads import load_workload

    spec = "gpt2:n_layer=3,n_embd=32,n_head=2,seq=16,vocab=64"
    graph = capture(load_workload(spec, batch=8), num_groups=8).graph
    lay = Layout(dp=2, pp=2, micro=2, stages=(2, 1), order=(2, 3, 0, 1))
    align_groups(graph, lay)
    plan = layout_plan(graph, topo4, lay, CostModel.for_topology(graph, topo4))
    validate_plan(plan, graph, topo4, pipelines=True)
    assert _stage_of_layer_ops(graph, plan) == {0: {0}, 1: {0}, 2: {1}} and plan.groups[0].devices == [2, 3]
    rts = run_virtual(graph, plan, load_workload(spec, batch=8), "adam", 2)
    ref, losses = reference_training(load_workload(spec, batch=8), "adam", 2)
    assert_params_equal({r: rt.named_params() for r, rt in rts.items()}, ref, {p.name for p in graph.params}, exact=True)
    assert sum(rt.loss for rt in rts.values()) == pytest.approx(losses[-1], rel=1e-5)


@pytest.mark.slow
def test_a_saved_published_layout_runs_on_gloo_ranks(tmp_path, capsys):
    """``tag simulate --layout pp=2,micro=2,stages=2+1,order=1+0 --save-plan``: the executor
    captures the graph again from the plan's op-group count alone (the count aligned to the
    stated layers), runs it on two gloo ranks, stage 0 on rank 1, and trains as one process does."""
    from tag.executor import ExecuteConfig, execute, reference_training
    from tag.executor.equality import assert_params_equal, saved_params
    from tag.planner import model_graph
    from tag.workloads import load_workload

    spec = "gpt2:n_layer=3,n_embd=32,n_head=2,seq=16,vocab=64"
    topo = tmp_path / "cpu2.yaml"
    topo.write_text("name: cpu2\nmachines:\n  - {name: local, gpu: cpu, count: 2, intra_bandwidth: 5 GB/s}\n")
    plan_path = tmp_path / "plan.json"
    assert main(["simulate", "--model", spec, "--batch", "4", "--topology", str(topo), "--layout",
                 "pp=2,micro=2,stages=2+1,order=1+0", "--save-plan", str(plan_path)]) == 0
    assert "  stage 0: layers 0-1, op-groups 0-" in capsys.readouterr().out
    plan = Plan.load(plan_path)
    assert plan.groups[0].devices == [1] and plan.groups[-1].devices == [0]
    cfg = ExecuteConfig(spec, str(topo), str(plan_path), steps=2, warmup=0, save_params=True, optimizer="adam",
                        run_dir=str(tmp_path / "run"), timeout_s=120.0)
    res = execute(cfg)
    ref, losses = reference_training(load_workload(spec, batch=4), "adam", 2)
    names = {p.name for p in model_graph(spec, 4, num_groups=len(plan.groups))[0].params}  # (tied: one name)
    assert_params_equal(saved_params(tmp_path / "run", res.world_size), ref, names, exact=True)
    assert res.losses == pytest.approx(losses, rel=1e-5)
