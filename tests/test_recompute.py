"""Activation recomputation (``GroupPlan.recompute``): plan format, simulator costs by the rule,
layouts.

Graph (``chain_graph(2, positions=2)``, batch 8): group 0 = f0(x, w0) -> a0, f1(a0) -> a1;
group 1 = f2(a1, w1) -> a2, f3(a2) -> loss (4 B); activations 400 B/sample, the input x
16 B/sample. Backward: each op reads its forward input (and the incoming gradient; the loss
seeds it). So group 0's backward reads x (the batch) and a0 (its own); group 1's reads a1 (group
0's), a2 and the loss (its own). Costs per sample: fwd 1 / 2 ms, bwd 2 / 4 ms; opt 1 ms a group.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_sim_tools import chain_graph, hand_costs, topology

from tag.errors import PlanError
from tag.executor.equality import assert_params_equal
from tag.parallel import validate_plan
from tag.plan import GroupPlan, PipelinePlan, Plan, group_positions, new_plan
from tag.sim import Simulator
from tag.topology import load_topology

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


# ---- the executor ------------------------------------------------------------------------------

def _executor_plans(graph):
    """(name, groups, pipeline) of plans with recomputation on some groups, on 1-2 ranks."""
    k = graph.num_groups
    odd = [g % 2 == 1 for g in range(k)]
    lo, hi = group_positions(graph, 1)
    return [
        ("single, all", [GroupPlan([0], [1.0], recompute=True) for _ in range(k)], None),
        ("single, odd", [GroupPlan([0], [1.0], recompute=r) for r in odd], None),
        ("dp uneven", [GroupPlan([0, 1], [0.25, 0.75], recompute=r) for r in odd], None),
        ("mp chunk", [GroupPlan([0, 1], [1.0, 1.0], "mp", mp_splits=[lo, (lo + hi) // 2], recompute=True)
                      if g == 1 else GroupPlan([g % 2], [1.0], recompute=g == 2) for g in range(k)], None),
        ("pipeline", [GroupPlan([0 if g < k // 2 else 1], [1.0], recompute=not r) for g, r in enumerate(odd)],
         PipelinePlan([0, k // 2], 4, "1f1b")),
    ]


@pytest.mark.parametrize("spec, optimizer", [("mlp", "adam"), ("gpt2:n_layer=1,n_embd=32,n_head=2,seq=16", "adam"),
                                             ("gpt2:n_layer=1,n_embd=32,n_head=2,seq=16,attn=sdpa", "sgd")])
def test_executor_recompute_matches_single_process_training(captured, spec, optimizer):
    """Parameters after 2 steps equal single-process training (tests/test_executor.py's check),
    for plans recomputing some or all groups; with fused attention too (its overload is tagged
    random, but without dropout it draws nothing: the recomputed forward is the same). Fused
    attention with SGD: under Adam the pipeline plan misses the tolerance by 1.07x on
    ``c_attn.bias`` with and without recomputation (2026-11-28): Adam's first steps move a
    parameter by about ``lr`` whatever its gradient's size, so the rounding of a near-zero
    gradient summed over 4 micro-batches reaches the parameters; under SGD every plan holds."""
    from test_executor import assert_matches_reference

    graph = captured(spec, batch=8, groups=4).graph
    topo = load_topology("topologies/local-cpu4.yaml")
    joints: dict = {}  # the model's joint graph exported once per batch size, for every plan (as test_executor's)
    for _, groups, pipeline in _executor_plans(graph):
        plan = new_plan(graph, topo, groups)
        plan.pipeline = pipeline
        validate_plan(plan, graph, topo)
        assert_matches_reference(graph, plan, spec, optimizer, joints, steps=2)


def test_executor_recompute_under_tensor_parallelism(captured):
    """2 replicas of 2-way tensor parallelism recomputing every other group: the recomputed
    forward all-reduces again at the block boundaries; the full parameters after 2 SGD steps
    equal single-process training (tests/test_tensor_parallel.py's check)."""

    from tag.executor import reference_training, run_virtual
    from tag.workloads import load_workload

    spec = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab=100,seq=16"
    graph = captured(spec, batch=8, groups=6).graph
    topo = load_topology("homogeneous-2x4-v100")
    plan = new_plan(graph, topo, [GroupPlan([0, 1, 2, 3], [0.25] * 4, sync="tp", tp=2, recompute=g % 2 == 1)
                                  for g in range(graph.num_groups)])
    validate_plan(plan, graph, topo)
    rts = run_virtual(graph, plan, load_workload(spec, batch=8), "sgd", 2)
    assert rts[1].schedule.recompute == {1, 3, 5}  # the executed plan keeps the groups' recomputation
    ref, losses = reference_training(load_workload(spec, batch=8), "sgd", 2)
    for lead in (0, 2):
        pair = [rts[lead], rts[lead + 1]]
        full = pair[0].hook.full_params([(rt.named_params(), rt.hook.kept) for rt in pair])
        assert_params_equal({lead: full}, ref, {p.name for p in graph.params})
    assert sum(rt.loss for rt in rts.values()) == pytest.approx(losses[-1], rel=1e-5)


def test_executor_recomputed_forward_keeps_only_what_others_read(captured):
    """A recomputed unit's forward stage returns only the values other units read; its backward
    stage recomputes the rest from the forward's inputs and is a segment of its own."""
    from tag.executor import build_schedule
    from tag.executor.fuse import plan_program
    from tag.graph.stages import build_stages

    cap = captured("mlp", batch=8, groups=4)
    graph, topo = cap.graph, load_topology("topologies/local-cpu4.yaml")
    plain = new_plan(graph, topo, [GroupPlan([0], [1.0]) for _ in range(4)])
    rc = new_plan(graph, topo, [GroupPlan([0], [1.0], recompute=g == 1) for g in range(4)])
    s_plain, s_rc = build_schedule(graph, plain), build_schedule(graph, rc)
    a = build_stages(cap, s_plain.assign)
    b = build_stages(cap, s_rc.assign, [(1, 0)])
    fwd_a, fwd_b, bwd_a, bwd_b = a[((1, 0), "fwd")], b[((1, 0), "fwd")], a[((1, 0), "bwd")], b[((1, 0), "bwd")]
    read_by_others = {n for (u, ph), st in a.items() if (u, ph) != ((1, 0), "bwd") for n in st.inputs}
    assert set(fwd_b.outputs) == set(fwd_a.outputs) & read_by_others and len(fwd_b.outputs) < len(fwd_a.outputs)
    assert bwd_b.outputs == bwd_a.outputs and set(bwd_b.nodes) == set(fwd_a.nodes) | set(bwd_a.nodes)
    assert not set(bwd_b.inputs) & (set(fwd_a.outputs) - read_by_others)  # nothing of the forward's kept
    stages = {k: v for k, v in b.items()}
    prog = plan_program(s_rc, 0, stages, static=lambda k: False, synced=lambda g: [], sfb_writes=lambda g: [],
                        final_reads=[], cut_at_sync=False)
    starts = [s_rc.steps[i] for i in prog.segments]
    assert any(st.kind == "compute" and st.phase == "bwd" and st.unit == (1, 0) for st in starts)
    assert len(prog.segments) == 2


def test_execution_refusal_of_recompute():
    from tag.parallel import execution_refusal

    sim, graph, topo = _sim()
    plan = new_plan(graph, topo, [_dp(0, True), _dp(0)])
    assert execution_refusal(plan) is None
    plan.groups = [GroupPlan([0, 1], [0.5, 0.5], "tp", tp=2, recompute=g == 1) for g in range(2)]
    assert execution_refusal(plan) is None
    plan.groups = [GroupPlan([0, 1], [0.5, 0.5], sfb=["gw0"], recompute=True), _dp(0)]
    assert execution_refusal(plan).startswith("groups[0].recompute: recomputation with SFB is simulated only")


DROPOUT = "evaluation/models/dropout.py:make"
"""An MLP with two dropouts (the factory's docstring)."""


def _dropout_plans(graph):
    k = graph.num_groups
    odd = [g % 2 == 1 for g in range(k)]
    return [
        ("single, all", [GroupPlan([0], [1.0], recompute=True) for _ in range(k)], None),
        ("dp uneven, odd", [GroupPlan([0, 1], [0.25, 0.75], recompute=r) for r in odd], None),
        ("dp uneven, even", [GroupPlan([0, 1], [0.25, 0.75], recompute=not r) for r in odd], None),
        ("pipeline 1f1b", [GroupPlan([0 if g < k // 2 else 1], [1.0], recompute=True) for g in range(k)],
         PipelinePlan([0, k // 2], 4, "1f1b")),
    ]


def test_executor_recompute_replays_dropout(monkeypatch):
    """A group whose forward draws random numbers (dropout, p > 0) recomputes from the random
    state its forward started from: the same masks, so the parameters after 3 Adam steps equal
    those of the same plan without recomputation (single device, data parallel over two virtual
    ranks, a 1F1B pipeline of 4 micro-batches), and the search and executor accept it. Without
    the replay (the recomputation drawing on from the stream) they do not."""
    from tag.executor import run_virtual
    from tag.executor.equality import compare_params
    from tag.executor.runtime import RankRuntime
    from tag.graph import capture
    from tag.parallel import execution_refusal
    from tag.workloads import load_workload

    graph = capture(load_workload(DROPOUT, batch=8), num_groups=4).graph
    topo = load_topology("topologies/local-cpu4.yaml")
    joints: dict = {}

    def trained(groups, pipeline, recompute):
        plan = new_plan(graph, topo, [dataclasses.replace(gp, recompute=gp.recompute and recompute) for gp in groups])
        plan.pipeline = pipeline
        validate_plan(plan, graph, topo)
        assert execution_refusal(plan) is None
        torch.manual_seed(0)
        rts = run_virtual(graph, plan, load_workload(DROPOUT, batch=8), "adam", 3, joints=joints)
        return {r: rt.named_params() for r, rt in rts.items()}, rts

    replayed = set()
    for name, groups, pipeline in _dropout_plans(graph):
        plain, _ = trained(groups, pipeline, False)
        again, rts = trained(groups, pipeline, True)
        replayed |= {name for rt in rts.values() if rt._rng_modes}
        assert_params_equal(again, plain[0] if pipeline is None else {k: v for p in plain.values() for k, v in p.items()},
                            rtol=1e-6, atol=1e-7)
    assert replayed >= {"single, all", "pipeline 1f1b"} and len(replayed) >= 3  # a replayed unit on some rank
    monkeypatch.setattr(RankRuntime, "_replayed", lambda self, draws: frozenset())
    name, groups, pipeline = _dropout_plans(graph)[0]
    plain, _ = trained(groups, pipeline, False)
    fresh, _ = trained(groups, pipeline, True)
    assert not compare_params(fresh, plain[0], None, 1e-4, 1e-6, False).ok  # new masks: other gradients


def test_fused_attention_draws_random_numbers_only_with_dropout():
    """PyTorch tags every fused attention overload ``nondeterministic_seeded``; what draws is read
    from the call's dropout probability instead, in the captured graph (``Op.attention``) and in
    the exported joint graph the executor replays (``node_draws_random``): the zoo's fused
    attention (dropout 0) draws nothing, the same call with 0.1 does; either way recomputing it runs."""
    import dataclasses

    from tag.executor.runtime import export_at
    from tag.graph import capture
    from tag.graph.gradients import draws_random, node_draws_random
    from tag.parallel import execution_refusal
    from tag.workloads import load_workload

    topo = load_topology("topologies/local-cpu4.yaml")
    wl = load_workload("gpt2:n_layer=1,n_embd=32,n_head=2,seq=16,attn=sdpa", batch=4)
    graph = capture(wl, num_groups=1).graph
    plan = new_plan(graph, topo, [GroupPlan([0], [1.0], recompute=True)])
    i = next(i for i, o in enumerate(graph.ops) if o.attention is not None and o.phase == "fwd")
    assert graph.ops[i].attention == (16, 16, True, 0.0) and not draws_random(graph.ops[i])
    assert draws_random(dataclasses.replace(graph.ops[i], attention=(16, 16, True, 0.1)))
    assert execution_refusal(plan) is None
    joint = export_at(wl.model, wl.make_inputs, 4)
    node = next(n for n in joint.module.graph.nodes if n.name == graph.ops[i].name)
    assert torch.Tag.nondeterministic_seeded in node.target.tags and not node_draws_random(node)
    node.args = (*node.args[:3], 0.1, *node.args[4:])  # (query, key, value, dropout_p, is_causal, ...)
    assert node_draws_random(node)


# ---- the search ---------------------------------------------------------------------------------

def _gpu_pair(memory):
    return load_topology({"name": "pair", "machines": [{
        "name": "m", "gpu": {"name": "G", "tflops": 10.0, "memory": memory, "memory_bandwidth": "100 GB/s"},
        "count": 2, "intra_bandwidth": "10 GB/s", "intra_latency": 1e-5}]})


def test_search_fits_a_plan_by_recomputing_the_fewest_groups(captured):
    """Capacity between data parallelism's peak with and without recomputing every group: the
    search returns a plan that fits, recomputing a shortest prefix of the greedy order."""
    from tag.cost.baselines import data_parallel
    from tag.planner import PlannerConfig, find_plan
    from tag.search.recompute import fit_by_recompute, recompute_order, with_recompute

    graph = captured("gpt2:n_layer=4,n_embd=128,n_head=4,seq=64", batch=8, groups=8).graph
    k = graph.num_groups
    roomy = _gpu_pair("16 GB")
    dp = data_parallel(graph, roomy).groups
    sim = Simulator(graph, roomy)
    plain, every = sim.run(dp), sim.run(with_recompute(dp, range(k)))
    assert max(every.peak_memory_bytes) < max(plain.peak_memory_bytes)
    assert every.iteration_time_s > plain.iteration_time_s
    topo = _gpu_pair(int((max(plain.peak_memory_bytes) + max(every.peak_memory_bytes)) / 2))
    sim = Simulator(graph, topo)
    res = sim.run(dp)
    assert res.oom
    order = recompute_order(sim, dp, [d for d, _ in res.oom_devices])
    groups, fitted, calls = fit_by_recompute(sim, dp, None, res)
    n = sum(g.recompute for g in groups)
    assert not fitted.oom and 0 < n < k and calls >= 2
    assert [g for g in range(k) if groups[g].recompute] == sorted(order[:n])
    assert sim.run(with_recompute(dp, order[:n - 1])).oom  # one group fewer does not fit
    plan = find_plan(graph, topo, PlannerConfig(searcher="mcts", prior="uniform", budget=10, seed=0, pipelines="off"))
    # it fits by recomputing or, since the search's ZeRO-3 / offload actions (e949f47), by sharding
    assert not plan.meta["oom"] and any(g.recompute or g.sync.startswith("zero") for g in plan.groups)
    check = Simulator(graph, topo).run(plan.groups)
    assert not check.oom and check.iteration_time_s == pytest.approx(plan.predicted_iteration_time_s)
    # where memory does not bind, the search is unchanged: no group recomputes
    plan = find_plan(graph, roomy, PlannerConfig(searcher="mcts", prior="uniform", budget=10, seed=0, pipelines="off"))
    assert not any(g.recompute for g in plan.groups)


def test_tensor_parallel_group_costs(captured):
    """Plain Megatron 2-way over one pair: a recomputed group's backward adds its forward's device
    seconds (its block all-reduces included) and its host's launches; the compute streams run at
    least the forwards' seconds longer (here more: the host, launching every forward again, bounds
    these small kernels); memory goes down when every group recomputes."""
    from tag.sim.static import BWD, FWD

    graph = captured("gpt2:n_layer=2,n_embd=64,n_head=4,vocab=100,seq=16", batch=8, groups=6).graph
    topo = load_topology("homogeneous-2x4-v100")
    sim = Simulator(graph, topo)
    for sp in (False, True):
        plain = [GroupPlan([0, 1], [0.5, 0.5], sync="tp", tp=2, sequence_parallel=sp) for _ in range(6)]
        rc = [GroupPlan([0, 1], [0.5, 0.5], sync="tp", tp=2, sequence_parallel=sp, recompute=True) for _ in range(6)]
        a, b = sim.run(plain), sim.run(rc)
        la, lb = sim.deploy(plain)[0].layout, sim.deploy(rc)[0].layout
        assert lb.dur[BWD] == pytest.approx(la.dur[BWD] + la.dur[FWD])
        assert lb.host[BWD] == pytest.approx(la.host[BWD] + la.host[FWD])
        fwd = la.dur[FWD].sum(axis=0)  # [replicas] forward seconds of all groups
        assert all(y >= x + f * (1 - 1e-9) for x, y, f in zip(a.compute_time_s[:2], b.compute_time_s[:2], fwd))
        assert max(b.peak_memory_bytes) < max(a.peak_memory_bytes)


def test_executable_search_recomputes_fused_attention(tmp_path):
    """In the executable space (``tag plan``'s default) a plan of the zoo's fused attention out of
    memory is fitted by recomputation (the baselines too), as in the simulated-only space: before
    the rule read the captured dropout, every SDPA group was refused and the baseline stayed out
    of memory (gpt2-large bf16 on mixed-a100-v100: 781.4 ms searched, 681.4 ms since)."""
    from tag.cost.baselines import data_parallel
    from tag.graph import capture
    from tag.search.evaluate import Evaluator
    from tag.search.space import ActionSpace
    from tag.workloads import load_workload

    graph = capture(load_workload("gpt2:n_layer=2,n_embd=64,n_head=4,vocab=100,seq=32,attn=sdpa", batch=8),
                    num_groups=4).graph
    sized = tmp_path / "two.yaml"

    def topo(mib: float):
        sized.write_text("name: two\nmachines:\n  - {name: a, gpu: {name: g, tflops: 10, memory: "
                         f"{mib:.4f} MiB, memory_bandwidth: 100 GB/s}}, count: 2, intra_bandwidth: 10 GB/s}}\n")
        return load_topology(sized)

    big = topo(1024)
    dp = data_parallel(graph, big).groups
    peak = [max(Simulator(graph, big).run([GroupPlan(g.devices, g.shares, recompute=r) for g in dp]).peak_memory_bytes)
            for r in (False, True)]
    assert peak[1] < peak[0]
    t = topo((peak[0] + peak[1]) / 2 / 2 ** 20)  # fits with recomputation only
    for executable in (True, False):
        ev = Evaluator(ActionSpace(graph, t, executable=executable))
        assert not ev.dp_even_out.oom and any(g.recompute for g in ev.dp_even_out.groups), executable
