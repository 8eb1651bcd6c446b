"""Sharded data parallelism (ZeRO-1/2/3, hybrid sharding; :mod:`tag.parallel.sharded`): layouts,
the simulator's memory and gathers, and the executor's equality with single-process training."""

from __future__ import annotations

import pytest

from tag.cost.comm import CommModel, ring_allgather_time, ring_reducescatter_time
from tag.cost.model import CostModel
from tag.errors import PlanError
from tag.parallel import validate_plan
from tag.parallel.layout import Layout, layout_plan, parse_layout
from tag.parallel.sharded import sharded_bytes
from tag.sim import Simulator, simulate
from tag.sim.program import build_program
from tag.topology import load_topology

GPT = "gpt2:n_layer=4,n_embd=256,n_head=4,seq=64"


@pytest.fixture(scope="module")
def gpt(captured):
    return captured(GPT, batch=16, groups=8).graph


@pytest.fixture(scope="module")
def a100():
    return load_topology("homogeneous-8xa100")


def test_parse_layout_round_trip_and_refusals():
    assert parse_layout("dp=8,zero=3") == Layout(dp=8, zero=3)
    assert parse_layout("hsdp=4x2") == Layout(dp=8, zero=3, shard=4)
    assert parse_layout("dp=8,hsdp=4x2,pp=2") == Layout(dp=8, pp=2, zero=3, shard=4)
    for text, message in [("dp=8,zero=4", r"zero: expected a ZeRO stage 0\.\.3, got 4"),
                          ("dp=8,zero=3,shard=3", r"shard: expected a divisor of dp=8, got 3"),
                          ("dp=8,shard=4", r"shard: shard groups need sharding"),
                          ("dp=4,tp=2,zero=3", r"zero: sharded data parallelism does not compose with tensor"),
                          ("hsdp=4", r"hsdp: expected SxR"), ("hsdp=4xtwo", r"hsdp: expected SxR"),
                          ("dp=4,hsdp=4x2", r"hsdp: hsdp=4x2 means dp=8, but dp=4 is given"),
                          ("zero=three", r"zero: expected a positive integer")]:
        with pytest.raises(PlanError, match="^layout: " + message) as e:
            parse_layout(text)
        assert "\n" not in str(e.value)


def test_layout_text_round_trips(gpt, a100):
    costs = CostModel.for_topology(gpt, a100)
    for text in ("dp=8,zero=3", "dp=8,zero=1", "hsdp=4x2", "dp=4,pp=2,micro=2,zero=2"):
        plan = layout_plan(gpt, a100, parse_layout(text), costs)
        validate_plan(plan, gpt, a100, pipelines=True, tensor_parallel=True)  # (as the simulator does)
        assert parse_layout(plan.meta["layout"]) == parse_layout(text)
    hsdp = layout_plan(gpt, a100, parse_layout("hsdp=4x2"), costs)
    assert {(g.sync, g.shard) for g in hsdp.groups} == {("zero3", 4)}


def test_ring_collective_formulas():
    assert ring_allgather_time(1, 1e9, 1e9, 1e-5) == 0.0
    assert ring_allgather_time(4, 4e9, 1e9, 1e-5) == pytest.approx(3.0 + 3e-5)
    assert ring_reducescatter_time(8, 8e9, 1e9, 0.0) == pytest.approx(7.0)


def test_sharded_sync_prices_hybrid_as_reduce_scatter_plus_allreduce(a100):
    comm = CommModel.for_topology(a100)
    devs, n = list(range(8)), 2 ** 28
    full = comm.sync_time("reducescatter", devs, n)
    assert full == pytest.approx(comm.reducescatter_time(devs, n)) and 0 < full < comm.allreduce_time(devs, n)
    hybrid = comm.sync_time("reducescatter/4", devs, n)
    assert hybrid == pytest.approx(comm.reducescatter_time(devs[:4], n) + comm.allreduce_time([0, 4], n / 4))
    with pytest.raises(ValueError, match="reducescatter/3"):
        comm.sync_time("reducescatter/3", devs, n)


def _state(graph) -> tuple[float, float]:
    p = float(sum(q.nbytes for q in graph.params))
    o = float(sum(q.opt_state_bytes for q in graph.params))
    return p, o


def test_memory_per_device_drops_as_sharded(gpt, a100):
    """ZeRO-3 on 8 devices holds ~1/8 of parameters, gradients and optimizer state plus the largest
    gathered group; each stage frees what it shards."""
    costs = CostModel.for_topology(gpt, a100)
    sim = Simulator(gpt, a100, costs)
    peak = {}
    for z in (0, 1, 2, 3):
        plan = layout_plan(gpt, a100, Layout(dp=8, zero=z), costs)
        peak[z] = sim.run(plan.groups).peak_memory_bytes[0]
    p, o = _state(gpt)
    assert peak[0] > peak[1] > peak[2] > peak[3]
    assert peak[0] - peak[1] == pytest.approx(o * 7 / 8, rel=0.02)
    # zero2 frees 7/8 of the gradients but holds its largest group's unsharded gradient while it is reduced
    largest = max(float(sum(q.nbytes for q in gpt.params if q.group == g)) for g in range(gpt.num_groups))
    assert peak[1] - peak[2] == pytest.approx(p * 7 / 8 - largest, rel=0.05, abs=largest)
    held = 2 * p + o - sharded_bytes(3, 8, p, o)
    assert peak[0] - peak[3] == pytest.approx(held, rel=0.05, abs=4 * largest)
    assert peak[0] - peak[3] > 0.6 * (2 * p + o)


def test_simulated_time_includes_the_gathers(gpt, a100):
    """The first group's forward gather and the last group's backward gather have nothing to hide
    behind: their whole time is in the stage; on slow links (communication-bound) ZeRO-3's three
    passes over the parameters (reduce-scatter, two all-gathers) take longer than data
    parallelism's all-reduce (two) and ZeRO-2's reduce-scatter plus one gather after the step."""
    import dataclasses

    costs = CostModel.for_topology(gpt, a100)
    sim = Simulator(gpt, a100, costs)
    plain, z3 = (layout_plan(gpt, a100, Layout(dp=8, zero=z), costs) for z in (0, 3))
    k = gpt.num_groups
    # a parameter belongs to the group making its gradient (tag.sim.static.build_static's owner, as
    # build_schedule buckets it): a layer norm whose backward moved to the next group goes with it
    owned = sim.static.grad_bytes
    assert sum(owned) == pytest.approx(sum(q.nbytes for q in gpt.params))
    gather = [sim.comm.shard_gather_time(list(range(8)), 8, float(owned[g])) for g in range(k)]
    d0, d3 = sim.group_data(0, plain.groups[0]).layout.dur, sim.group_data(0, z3.groups[0]).layout.dur
    assert d3[0, 0, 0] - d0[0, 0, 0] == pytest.approx(gather[0])
    assert d3[1, k - 1, 0] - d0[1, k - 1, 0] == pytest.approx(gather[k - 1])
    assert d3[2, 0, 0] == pytest.approx(d0[2, 0, 0] / 8)  # the step updates 1/8 of the parameters
    m = a100.machines[0]
    slow = dataclasses.replace(a100, machines=(dataclasses.replace(m, intra_bandwidth=m.intra_bandwidth / 1000),))
    t = {z: simulate(gpt, slow, layout_plan(gpt, slow, Layout(dp=8, zero=z), CostModel.for_topology(gpt, slow)))
         .iteration_time_s for z in (0, 2, 3)}
    assert t[3] > 1.2 * t[0] and t[3] > 1.2 * t[2]


def test_cpu_devices_expose_every_gather(captured, topo4):
    """On CPU ranks (gloo shares the compute cores) each gather adds its whole time: ZeRO-3's
    forward and backward stages grow by twice the group's gather."""
    mlp = captured("mlp", batch=8, groups=4).graph
    costs = CostModel.for_topology(mlp, topo4)
    sim = Simulator(mlp, topo4, costs)
    plain = layout_plan(mlp, topo4, Layout(dp=4), costs)
    z3 = layout_plan(mlp, topo4, Layout(dp=4, zero=3), costs)
    gd0, gd3 = sim.group_data(1, plain.groups[1]), sim.group_data(1, z3.groups[1])
    pbytes = float(sum(q.nbytes for q in mlp.params if q.group == 1))
    a = sim.comm.shard_gather_time([0, 1, 2, 3], 4, pbytes)
    assert a > 0
    grow = gd3.layout.dur[:2, 1, 0] - gd0.layout.dur[:2, 1, 0]
    assert grow == pytest.approx([a, a])
    assert gd3.sync == "reducescatter" and gd0.sync == "allreduce"


def test_bad_shard_in_a_plan_is_one_line(gpt, a100):
    costs = CostModel.for_topology(gpt, a100)
    plan = layout_plan(gpt, a100, Layout(dp=8, zero=3), costs)
    plan.groups[2].shard = 3
    with pytest.raises(PlanError, match=r"groups\[2\]\.shard: expected a divisor of the group's 8 devices, got 3$"):
        validate_plan(plan, gpt, a100)


# ---- the executor: gloo ranks train equal to one process ------------------------------------------

def _cpu_topology(tmp_path, n: int) -> str:
    path = tmp_path / f"cpu{n}.yaml"
    path.write_text(f"name: test-cpu{n}\nmachines:\n  - name: local\n    gpu: cpu\n    count: {n}\n"
                    '    intra_bandwidth: "5 GB/s"\n')
    return str(path)


def _run(tmp_path, graph, n: int, groups, optimizer="adam", bucket_bytes=None, pipeline=None):
    import json

    from tag.executor import ExecuteConfig, execute
    from tag.plan import new_plan

    topo_path = _cpu_topology(tmp_path, n)
    plan = new_plan(graph, load_topology(topo_path), groups)
    plan.pipeline = pipeline
    plan.save(tmp_path / "plan.json")
    cfg = ExecuteConfig("mlp", topo_path, str(tmp_path / "plan.json"), steps=2, warmup=0, save_params=True,
                        optimizer=optimizer, run_dir=str(tmp_path / "run"), timeout_s=90.0, bucket_bytes=bucket_bytes)
    res = execute(cfg, graph=graph)
    return res, json.loads((tmp_path / "run" / "ranks.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("sync,n,shard", [("zero1", 2, None), ("zero2", 2, None), ("zero3", 3, None),
                                          ("zero3", 4, 2)])
def test_sharded_ranks_train_as_one_process(tmp_path, captured, sync, n, shard):
    """ZeRO-1/2/3 and hybrid sharding (zero3, shard groups of 2 over 4 ranks) on gloo: parameters after
    2 Adam steps equal single-process training (the executor's tolerance); each rank's optimizer state
    is its shard's (Adam: two moments of 1/S of the parameters, padding aside)."""
    from tag.executor import reference_training
    from tag.executor.equality import assert_params_equal, saved_params
    from tag.plan import GroupPlan
    from tag.workloads import load_workload

    graph = captured("mlp", batch=8, groups=4).graph
    groups = [GroupPlan(list(range(n)), [1.0 / n] * n, sync, shard=shard) for _ in range(graph.num_groups)]
    # small buckets: several buckets, each sharded on its own
    res, ranks = _run(tmp_path, graph, n, groups, bucket_bytes=4096)
    ref, ref_losses = reference_training(load_workload("mlp", batch=8), "adam", 2)
    assert_params_equal(saved_params(tmp_path / "run", n), ref, {p.name for p in graph.params})
    assert res.losses == pytest.approx(ref_losses, rel=1e-4)
    p = sum(q.nbytes for q in graph.params)
    s = shard or n
    level = int(sync[-1])
    for r in ranks:
        assert r["optimizer_state_bytes"] == pytest.approx(2 * p / s, rel=0.02)
        # held: the full parameters (ZeRO-1/2, the shard a view of their slice) or the fp32 shard
        # (ZeRO-3, the full parameters freed), and the shard's gradient
        want = (p if level < 3 else p / s) + p / s
        assert r["held_state_bytes"] == pytest.approx(want, rel=0.02)
        if level == 3:  # the simulator's held state: parameter, gradient and optimizer-state shards
            assert r["held_state_bytes"] + r["optimizer_state_bytes"] == \
                pytest.approx(sharded_bytes(3, s, p, 2 * p), rel=0.02)


def test_fsdp_baseline_and_the_search_offer_zero3(gpt, a100):
    from tag.cost.baselines import BASELINES, baseline_plan
    from tag.search.space import ActionSpace

    assert "fsdp" in BASELINES
    costs = CostModel.for_topology(gpt, a100)
    fsdp = baseline_plan("fsdp", gpt, a100, costs)
    assert {(tuple(g.devices), g.sync) for g in fsdp.groups} == {(tuple(range(8)), "zero3")}
    assert fsdp.meta["baseline"] == "fsdp"
    dp = baseline_plan("dp", gpt, a100, costs)
    assert simulate(gpt, a100, fsdp).peak_memory_bytes[0] < 0.6 * simulate(gpt, a100, dp).peak_memory_bytes[0]
    sp = ActionSpace(gpt, a100)
    mine = [a for a, act in enumerate(sp.actions) if act.sync == "zero3"]
    assert mine and min(mine) >= sp.num_base_actions
    plan_groups = sp.group_plans([mine[0]] * sp.num_groups)
    assert {g.sync for g in plan_groups} <= {"zero3", "allreduce"} and any(g.sync == "zero3" for g in plan_groups)
    assert Simulator(gpt, a100, costs).run(plan_groups).iteration_time_s > 0


def test_sharded_pipeline_stages_are_costed_and_executable(captured, topo4):
    """ZeRO-3 inside each stage of a pipeline is costed and accepted by the executor (its runs:
    tests/test_sharded_pipeline.py)."""
    from tag.parallel import execution_refusal

    graph = captured("mlp", batch=8, groups=4).graph
    plan = layout_plan(graph, topo4, parse_layout("dp=2,pp=2,micro=2,zero=3"), CostModel.for_topology(graph, topo4))
    assert {g.sync for g in plan.groups} == {"zero3"} and plan.pipeline is not None
    assert simulate(graph, topo4, plan).iteration_time_s > 0
    assert execution_refusal(plan) is None
    validate_plan(plan, graph, topo4)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_sharded_stages_hold_a_tied_weight_as_the_executor(captured, topo4, zero):
    """GPT-2's tied embedding on ``dp=2,pp=2,micro=2,zero=Z``: the executor's schedule holds it on
    both stages (no transfer carries it, one all-reduce over both stages' replicas) and the
    simulator moves exactly the schedule's bytes and runs its buckets; each rank of both stages
    holds the weight and its gradient whole, its optimizer state over the stage's shard group
    (ZeRO-1: tests/test_sharded_pipeline.py measures it), so the first stage holds that less the
    sharded bytes its layout counted, the last stage all of it; the memory bound stays below."""
    from test_sim_executor import schedule_bytes, sim_bytes

    from tag.executor import build_schedule
    from tag.sim.bounds import static_bound
    from tag.sim.engine import _holdings

    graph = captured("gpt2:n_layer=2,n_embd=32,n_head=2,seq=16,vocab=128", batch=8, groups=4).graph
    plan = layout_plan(graph, topo4, parse_layout(f"dp=2,pp=2,micro=2,zero={zero}"),
                       CostModel.for_topology(graph, topo4))
    sim = Simulator(graph, topo4)
    sched = build_schedule(graph, plan, topo4.machine_of)
    (t,) = sched.tied.values()
    assert t.collective.members == (0, 1, 2, 3)
    assert schedule_bytes(graph, sched) == pytest.approx(sim_bytes(sim, plan.groups, plan.pipeline), rel=1e-12)
    micro, gds = build_program(sim, plan.groups, plan.pipeline), sim.deploy(plan.groups)
    jobs = [(job.sync_devices, job.sync_bytes) for _, job in sim.sync_jobs(gds, micro.tied)]
    assert jobs == [(b.collective.members, b.nbytes) for b in sched.buckets]
    (w,) = [p for p in graph.params if graph.tensors[p.tensor].name == t.param]
    held, moved = (_holdings(sim, gds, m)[1] for m in (micro, micro._replace(tied=frozenset(), tied_shards=())))
    copy = sharded_bytes(1, 2, w.nbytes, w.opt_state_bytes)  # (each stage's: ZeRO-1 over its shard group)
    assert [x - y for x, y in zip(held, moved)] == pytest.approx(
        [copy - sharded_bytes(zero, 2, w.nbytes, w.opt_state_bytes)] * 2 + [copy] * 2)
    res = sim.run(plan.groups, pipeline=plan.pipeline)
    assert all(b <= p for b, p in zip(static_bound(sim, plan.groups, plan.pipeline).peak_bytes,
                                      res.peak_memory_bytes))
