"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages): the schedule's sequences, its
validation, its bubble, and its execution equal to single-process training (in one process and
on two gloo ranks)."""

from __future__ import annotations

import pytest
from test_executor import GPT2, MLP
from test_executor_dist import cpu_topology
from test_pipeline_exec import LLAMA, _execute, assert_equal_params
from test_pipeline_scaling import linear_costs

from tag.errors import PlanError
from tag.executor import reference_training, run_virtual
from tag.parallel import validate_plan
from tag.parallel.layout import layout_plan, parse_layout
from tag.parallel.pipeline import (
    Task,
    interleaved_sequence,
    iteration_program,
    lane_order,
)
from tag.plan import GroupPlan, PipelinePlan, new_plan
from tag.sim import Simulator
from tag.topology import load_topology
from tag.workloads import load_workload


def test_megatrons_interleaved_order():
    """2 devices, 2 chunks, 4 micro-batches: device 0 warms up with 2 (P - 1) + (k - 1) P = 4
    forwards (both chunks of micro-batches 0 and 1), device 1 with 2; backwards take the chunks
    in reverse (megatron.core's forward_backward_pipelining_with_interleaving)."""
    assert interleaved_sequence(0, 2, 4, 2) == [
        ("fwd", 0, 0), ("fwd", 1, 0), ("fwd", 0, 1), ("fwd", 1, 1), ("fwd", 2, 0), ("bwd", 0, 1), ("fwd", 3, 0),
        ("bwd", 1, 1), ("fwd", 2, 1), ("bwd", 0, 0), ("fwd", 3, 1), ("bwd", 1, 0), ("bwd", 2, 1), ("bwd", 3, 1),
        ("bwd", 2, 0), ("bwd", 3, 0)]
    assert interleaved_sequence(1, 2, 4, 2)[:6] == [("fwd", 0, 0), ("fwd", 1, 0), ("fwd", 0, 1), ("bwd", 0, 1),
                                                     ("fwd", 1, 1), ("bwd", 1, 1)]
    # k = 1 is 1F1B's sequence on every device
    from tag.parallel.pipeline import stage_sequence
    for p in range(4):
        assert [(ph, m) for ph, m, _ in interleaved_sequence(p, 4, 8, 1)] == stage_sequence(p, 4, 8, 1)


@pytest.mark.parametrize("P, k, M", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 6), (2, 4, 2)])
def test_the_interleaved_bubble_is_a_kth_of_1f1bs(P, k, M):
    """Unit times per chunk (forward 1 / k, backward 2 / k of a stage's): the global order replayed
    takes M (f + b) + (P - 1) (f + b) / k, the textbook interleaved makespan (1F1B: (M + P - 1) (f + b))."""
    pp = PipelinePlan(list(range(P * k)), M, "interleaved", k)
    prog = iteration_program(pp, M, P * k)
    f, b = 1.0 / k, 2.0 / k
    lane = {s: s % P for s in range(P * k)}
    end, free = {}, [0.0] * P
    for t in prog.tasks:
        deps = [Task(t.stage - 1, "fwd", t.micro)] if t.phase == "fwd" and t.stage else []
        if t.phase == "bwd":
            deps = [Task(t.stage, "fwd", t.micro)] + ([Task(t.stage + 1, "bwd", t.micro)] if t.stage + 1 < P * k else [])
        start = max([free[lane[t.stage]]] + [end[d] for d in deps])
        end[t] = free[lane[t.stage]] = start + (f if t.phase == "fwd" else b)
    assert max(end.values()) == pytest.approx(M * 3.0 + (P - 1) * 3.0 / k)
    # every device's order is its schedule's sequence
    for p in range(P):
        assert [t for t in prog.tasks if lane[t.stage] == p] == \
            [Task(c * P + p, ph, m) for ph, m, c in interleaved_sequence(p, P, M, k)]
    assert list(prog.tasks) == lane_order([[Task(c * P + p, ph, m) for ph, m, c in interleaved_sequence(p, P, M, k)]
                                           for p in range(P)])


def _interleaved(graph, topo, devices, micro, k=2):
    plan = new_plan(graph, topo, [GroupPlan([d], [1.0]) for d in devices])
    plan.pipeline = PipelinePlan(list(range(len(devices))), micro, "interleaved", k)
    return plan


@pytest.mark.parametrize("devices, micro, k, message", [
    ((0, 1, 0, 1), 3, 2, r"pipeline\.micro_batches: interleaved needs a multiple of its 2 device sets, got 3"),
    ((0, 1, 0, 1), 4, 3, r"pipeline\.k: expected a divisor of the 4 stages \(chunks per device\), got 3"),
    ((0, 1, 1, 0), 4, 2, r"groups\[2\]: interleaved runs stage 2 on the devices of stage 0 \(\[0\]\), got \[1\]"),
    ((0, 0, 1, 1), 4, 2, r"groups\[1\]: interleaved runs stage 1 on the devices of stage 1 .*|device 0 is in stage 0"),
])
def test_invalid_interleaved_plans_are_one_line(captured, topo4, devices, micro, k, message):
    graph = captured(MLP, batch=8, groups=4).graph
    with pytest.raises(PlanError, match=message) as err:
        validate_plan(_interleaved(graph, topo4, devices, micro, k), graph, topo4)
    assert "\n" not in str(err.value)


def test_layout_key():
    """``vpp=2`` is ``schedule=interleaved,k=2``; refused in one line with another schedule, fixed
    stages or micro-batches that are not a multiple of pp."""
    a, b = parse_layout("pp=4,micro=8,vpp=2"), parse_layout("pp=4,micro=8,schedule=interleaved,k=2")
    assert a == b and (a.schedule, a.k, a.vpp) == ("interleaved", 2, 2)
    for text, message in (("pp=4,micro=8,vpp=2,schedule=gpipe", "layout: vpp: virtual stages run the interleaved"),
                          ("pp=4,micro=6,vpp=2", r"layout: micro: interleaved stages need a multiple of pp=4"),
                          ("pp=2,micro=4,vpp=2,stages=1+1", "layout: stages: virtual stages are cut by time")):
        with pytest.raises(PlanError, match=message):
            parse_layout(text)


@pytest.mark.parametrize("spec, batch, micro, optimizer", [
    (MLP, 8, 4, "sgd"),
    (GPT2, 4, 2, "adam"),  # the tied LM head lands on the embedding's device: held once, no tied sync
    (LLAMA, 8, 4, "adam"),
])
def test_interleaved_matches_single_process_training(captured, topo4, spec, batch, micro, optimizer):
    """4 op-groups as 4 virtual stages on 2 devices (stages 0, 2 on device 0; 1, 3 on device 1),
    2 steps: parameters equal single-process training (the executor's tolerance)."""
    graph = captured(spec, batch=batch, groups=4, optimizer=optimizer).graph
    plan = _interleaved(graph, topo4, (0, 1, 0, 1), micro)
    validate_plan(plan, graph, topo4)
    rts = run_virtual(graph, plan, load_workload(spec, batch=batch), optimizer, 2)
    ref, losses = reference_training(load_workload(spec, batch=batch), optimizer, 2)
    assert_equal_params({r: rt.named_params() for r, rt in rts.items()}, ref, graph)
    assert sum(rt.loss for rt in rts.values()) == pytest.approx(losses[-1], rel=1e-5)


@pytest.mark.slow
def test_two_gloo_ranks_run_interleaved_stages(tmp_path, captured):
    """The MLP's 4 groups as 2 chunks on each of 2 gloo ranks, 4 micro-batches, 2 SGD steps."""
    graph = captured(MLP, batch=8, groups=4, optimizer="sgd").graph
    topo_path = cpu_topology(tmp_path, 2)
    plan = _interleaved(graph, load_topology(topo_path), (0, 1, 0, 1), 4)
    res, params = _execute(tmp_path, graph, topo_path, plan, MLP, "sgd")
    ref, losses = reference_training(load_workload(MLP, batch=8), "sgd", 2)
    assert_equal_params(params, ref, graph)
    assert res.losses == pytest.approx(losses, rel=1e-5)


def test_interleaving_shrinks_the_simulated_bubble():
    """With costs linear in the samples, Llama 8 x 512 at ``dp=2,pp=4,micro=4`` on 8 A100s (16
    op-groups: 8 virtual stages of 2): two chunks per device make the iteration faster than 1F1B,
    by at least half the textbook gain ((M + (P - 1) / k) / (M + P - 1) = 5.5 / 7; 26.32 ->
    22.17 ms, 0.842x, 2026-11-29: the cut into 8 is less even than into 4). The graph is
    ``tag plan``'s: folded from a 3-layer template, without weights (:func:`tag.planner.model_graph`;
    to_dict equal to the full capture's, which takes 9.2 s of CPU against 5.9, imports done, 2026-11-29)."""
    from tag.planner import model_graph

    graph = model_graph("llama:n_layer=8,n_embd=512,n_head=8,n_kv_head=4,ffn=1408,seq=256,vocab=512", 32,
                        num_groups=16)[0]
    topo = load_topology("topologies/homogeneous-8xa100.yaml")
    costs = linear_costs(graph, topo)
    sim = Simulator(graph, topo, costs)
    t = {}
    for text in ("dp=2,pp=4,micro=4", "dp=2,pp=4,micro=4,vpp=2"):
        plan = layout_plan(graph, topo, parse_layout(text), costs)
        validate_plan(plan, graph, topo)
        t[text] = sim.run(plan.groups, pipeline=plan.pipeline).iteration_time_s
    ratio = t["dp=2,pp=4,micro=4,vpp=2"] / t["dp=2,pp=4,micro=4"]
    assert ratio < 1 - 0.5 * (1 - 5.5 / 7), t
