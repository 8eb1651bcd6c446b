"""Pipeline parallelism, the pure parts: the kFkB family of stage sequences (1F1B, GPipe), their
merge into one deadlock-free global order, micro-batch ranges, and the plan field's validation."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_executor import MLP, B

from tag.cost.baselines import data_parallel
from tag.errors import PlanError
from tag.parallel import build_schedule, validate_plan
from tag.parallel.layout import parse_layout
from tag.parallel.pipeline import (
    PipelineSchedule,
    Task,
    bubble_fraction,
    even_stages,
    in_flight,
    iteration_program,
    micro_ranges,
    pipeline_order,
    register_schedule,
    schedule_names,
    searched_schedules,
    spell_schedule,
    stage_of_group,
    stage_sequence,
    unregister_schedule,
)
from tag.plan import GroupPlan, PipelinePlan, Plan, new_plan


def test_1f1b_and_gpipe_sequences():
    # 1F1B, 4 stages, 6 micro-batches: stage 0 warms up with 3 forwards, the last stage with none
    assert stage_sequence(0, 4, 6, 1) == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("fwd", 3), ("bwd", 0), ("fwd", 4),
                                          ("bwd", 1), ("fwd", 5), ("bwd", 2), ("bwd", 3), ("bwd", 4), ("bwd", 5)]
    assert stage_sequence(3, 4, 6, 1) == [(p, m) for m in range(6) for p in ("fwd", "bwd")]
    # GPipe = kFkB with one block of all micro-batches, on every stage
    for s in range(4):
        assert stage_sequence(s, 4, 6, 6) == [("fwd", m) for m in range(6)] + [("bwd", m) for m in range(6)]
    # kFkB, k = 2, last stage: forward block, backward block
    assert stage_sequence(1, 2, 4, 2) == [("fwd", 0), ("fwd", 1), ("bwd", 0), ("bwd", 1),
                                          ("fwd", 2), ("fwd", 3), ("bwd", 2), ("bwd", 3)]


def test_in_flight_micro_batches():
    # 1F1B keeps S - s micro-batches alive on stage s; GPipe all of them; kFkB k times 1F1B's
    assert [in_flight(stage_sequence(s, 4, 8, 1)) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(stage_sequence(s, 4, 8, 8)) for s in range(4)] == [8, 8, 8, 8]
    assert [in_flight(stage_sequence(s, 2, 8, 2)) for s in range(2)] == [4, 2]


@settings(max_examples=60, deadline=None)
@given(S=st.integers(1, 6), M=st.integers(1, 12), k=st.integers(1, 12),
       f=st.floats(0.1, 5), b=st.floats(0.1, 5))
def test_global_order_is_consistent(S, M, k, f, b):
    """Every task once; each stage's tasks in its sequence's order; every task after the tasks
    whose data it needs (so walking the order with blocking transfers cannot deadlock)."""
    order = pipeline_order([stage_sequence(s, S, M, k) for s in range(S)], f, b)
    assert sorted(order) == sorted(Task(s, p, m) for s in range(S) for p in ("fwd", "bwd") for m in range(M))
    at = {t: i for i, t in enumerate(order)}
    for s in range(S):
        assert [(t.phase, t.micro) for t in order if t.stage == s] == stage_sequence(s, S, M, k)
        for m in range(M):
            assert at[Task(s, "fwd", m)] < at[Task(s, "bwd", m)]
            if s:
                assert at[Task(s - 1, "fwd", m)] < at[Task(s, "fwd", m)]
                assert at[Task(s, "bwd", m)] < at[Task(s - 1, "bwd", m)]


def _sweep_order(sequences, fwd_s, bwd_s):
    """A reference for :func:`pipeline_order` (2026-11-27): sweep over the stages, one task per
    stage and sweep, until none can run; its tasks by start time, or where each unfinished stage is
    stuck."""
    n, pos, ends, starts = len(sequences), [0] * len(sequences), {}, {}
    changed = True
    while changed:
        changed = False
        for s, q in enumerate(sequences):
            if pos[s] == len(q):
                continue
            phase, m = q[pos[s]]
            need = [(s - 1, "fwd", m)] if phase == "fwd" and s > 0 else []
            if phase == "bwd":
                need = [(s, "fwd", m)] + ([(s + 1, "bwd", m)] if s + 1 < n else [])
            if all(x in ends for x in need):
                t0 = max([ends[(s, *q[pos[s] - 1])] if pos[s] else 0.0] + [ends[x] for x in need])
                starts[Task(s, phase, m)] = t0
                ends[(s, phase, m)] = t0 + (fwd_s if phase == "fwd" else bwd_s)
                pos[s] += 1
                changed = True
    if any(pos[s] < len(q) for s, q in enumerate(sequences)):
        return {s: q[pos[s]] for s, q in enumerate(sequences) if pos[s] < len(q)}
    return sorted(starts, key=lambda t: (starts[t], -t.stage, t.phase == "bwd", t.micro))


@settings(max_examples=80, deadline=None)
@given(S=st.integers(1, 7), M=st.integers(1, 10), k=st.integers(1, 10), f=st.floats(0.1, 5), b=st.floats(0.1, 5),
       swaps=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 19), st.integers(0, 19)), max_size=3))
def test_global_order_equals_the_sweeping_reference(S, M, k, f, b, swaps):
    """The order (and, for sequences whose tasks wait on each other, the deadlock and where each
    stage is stuck) is the sweep's exactly: kFkB sequences, some with two tasks swapped."""
    seqs = [stage_sequence(s, S, M, k) for s in range(S)]
    for s, i, j in swaps:
        q = seqs[s % S]
        i, j = i % len(q), j % len(q)
        q[i], q[j] = q[j], q[i]
    want = _sweep_order(seqs, f, b)
    if isinstance(want, dict):
        with pytest.raises(PlanError, match="deadlock") as err:
            pipeline_order(seqs, f, b)
        assert str(want) in str(err.value)
    else:
        assert pipeline_order(seqs, f, b) == want


def test_pipelining_overlaps_stages():
    """With unit forward and backward times the 1F1B order keeps the stages busy as the textbook
    says: the makespan is (M + S - 1) (f + b), i.e. the bubble fraction (S - 1) / (M + S - 1)."""
    S, M = 4, 8
    order = pipeline_order([stage_sequence(s, S, M, 1) for s in range(S)], 1.0, 2.0)
    # replay the order: every task starts when its stage is free and its inputs are ready
    end, free = {}, [0.0] * S
    for t in order:
        deps = [Task(t.stage - 1, "fwd", t.micro)] if t.phase == "fwd" and t.stage else []
        if t.phase == "bwd":
            deps = [Task(t.stage, "fwd", t.micro)] + ([Task(t.stage + 1, "bwd", t.micro)] if t.stage + 1 < S else [])
        start = max([free[t.stage]] + [end[d] for d in deps])
        end[t] = free[t.stage] = start + (1.0 if t.phase == "fwd" else 2.0)
    makespan = max(end.values())
    assert makespan == pytest.approx((M + S - 1) * 3.0)
    assert 1 - M * 3.0 / makespan == pytest.approx(bubble_fraction(S, M))


def test_the_built_in_schedules_are_registered_kfkb_members():
    """1F1B, GPipe and kFkB are registered schedules, in the order the search offers them (its
    determinism depends on it); their programs are the kFkB sequences at k = 1, M and k."""
    assert schedule_names()[:3] == ("1f1b", "gpipe", "kfkb")
    assert searched_schedules()[:3] == [("1f1b", 1), ("gpipe", 1), ("kfkb", 2)]
    for name, k in (("1f1b", 1), ("gpipe", 6), ("kfkb", 2)):
        prog = iteration_program(PipelinePlan([0, 1, 3], 6, name, 2), 12, 5)
        assert prog.sequences == tuple(tuple(stage_sequence(s, 3, 6, k)) for s in range(3))
        assert list(prog.tasks) == pipeline_order([stage_sequence(s, 3, 6, k) for s in range(3)])
        assert prog.flight == tuple(in_flight(q) for q in prog.sequences)
        assert prog.ranges == micro_ranges(12, 6) and prog.stage_of == [0, 1, 1, 2, 2]
        assert [list(r) for r in prog.members] == [[0], [1, 2], [3, 4]]
    assert [spell_schedule(n, 3) for n in ("1f1b", "gpipe", "kfkb")] == ["1f1b", "gpipe", "kfkb,k=3"]


def _reversed_drain(stage, num_stages, pp):
    """GPipe with the backwards in reverse micro-batch order (not a kFkB member)."""
    M = pp.micro_batches
    return [("fwd", m) for m in range(M)] + [("bwd", m) for m in reversed(range(M))]


def test_a_registered_schedule_is_offered_and_spelled():
    register_schedule(PipelineSchedule("rev", _reversed_drain, searched=(1,)))
    try:
        assert searched_schedules()[-1] == ("rev", 1) and schedule_names()[-1] == "rev"
        assert parse_layout("pp=2,micro=4,schedule=rev,k=3").schedule == "rev"
        assert spell_schedule("rev", 3) == "rev"  # (it does not read k)
        prog = iteration_program(PipelinePlan([0, 1], 3, "rev"), 6, 2)
        assert prog.flight == (3, 3) and prog.tasks[-1] == Task(0, "bwd", 0)
    finally:
        unregister_schedule("rev")
    assert "rev" not in schedule_names()
    with pytest.raises(PlanError, match=r"^layout: schedule: expected one of \['1f1b', 'gpipe', 'kfkb', 'interleaved'\], "
                                         r"got 'rev'$"):
        parse_layout("pp=2,micro=4,schedule=rev")


@pytest.mark.parametrize("sequence, message", [
    (lambda s, n, pp: [("bwd", 0), ("fwd", 0), ("fwd", 1), ("bwd", 1)], r"gives stage 0 of 2 micro-batch 0's bwd before its fwd"),
    (lambda s, n, pp: [("fwd", 0), ("bwd", 0)], r"gives stage 0 of 2 the sequence \[.*\]; expected every micro-batch 0\.\.1's fwd and bwd once each"),
    # stage 0 waits for micro-batch 0's backward before micro-batch 1's forward, stage 1 the reverse
    (lambda s, n, pp: [("fwd", 0), ("bwd", 0), ("fwd", 1), ("bwd", 1)] if s == 0 else stage_sequence(s, n, 2, 2),
     r"the stage sequences deadlock \(2 stages; the next task of each unfinished stage waits on another"),
])
def test_an_invalid_registered_schedule_is_refused_in_one_line(mlp, topo4, sequence, message):
    register_schedule(PipelineSchedule("bad", sequence))
    try:
        plan = _pipelined(mlp, topo4)
        plan.pipeline = PipelinePlan([0, 2], 2, "bad")
        with pytest.raises(PlanError, match=r"^plan: pipeline\.schedule: 'bad'.*" + message) as e:
            validate_plan(plan, mlp, topo4)
        assert "\n" not in str(e.value)
    finally:
        unregister_schedule("bad")


def test_micro_ranges_and_stage_cuts():
    assert micro_ranges(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert micro_ranges(8, 1) == [(0, 8)]
    assert even_stages(10, 3) == [0, 3, 6]
    with pytest.raises(PlanError, match=r"expected 1\.\.4 stages"):
        even_stages(4, 5)


@pytest.fixture(scope="module")
def mlp(captured):
    return captured(MLP, batch=B, groups=4).graph


def _pipelined(graph, topo):
    groups = [GroupPlan([0, 1], [0.5, 0.5]) for _ in range(2)] + [GroupPlan([2], [1.0]) for _ in range(2)]
    return new_plan(graph, topo, groups)


def test_plan_field_round_trip(mlp, topo4, tmp_path):
    plan = _pipelined(mlp, topo4)
    plan.pipeline = PipelinePlan([0, 2], 4, "kfkb", 2)
    validate_plan(plan, mlp, topo4, pipelines=True)
    # a caller that runs no micro-batches refuses it, in one line
    with pytest.raises(PlanError, match=r"^p: pipeline: this caller runs no micro-batches; expected no pipeline field$"):
        validate_plan(plan, mlp, topo4, source="p", pipelines=False)
    assert stage_of_group(plan.pipeline, 4) == [0, 0, 1, 1]
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back.pipeline == plan.pipeline and back.groups == plan.groups
    # a plan without a pipeline keeps the file format it always had
    plain = data_parallel(mlp, topo4)
    assert "pipeline" not in plain.to_dict() and Plan.from_dict(json.loads(plain.to_json())).pipeline is None


@pytest.mark.parametrize("change, message", [
    (dict(stages=[1, 2]), r"pipeline\.stages: expected increasing first groups starting at 0 and below 4, got \[1, 2\]"),
    (dict(stages=[0, 4]), r"pipeline\.stages: expected increasing first groups starting at 0 and below 4"),
    (dict(schedule="zb"), r"pipeline\.schedule: expected one of \['1f1b', 'gpipe', 'kfkb', 'interleaved'\], got 'zb'"),
    (dict(micro_batches=0), r"pipeline\.micro_batches: expected 1\.\.\d+ \(the batch\), got 0"),
    (dict(schedule="kfkb", k=5), r"pipeline\.k: expected 1\.\.4 \(micro-batches per block\), got 5"),
    (dict(stages=[0, 1]), r"groups\[2\]: every group of pipeline stage 1 must have the devices and shares of groups\[1\]"),
])
def test_invalid_pipelines_are_one_line(mlp, topo4, change, message):
    plan = _pipelined(mlp, topo4)
    plan.pipeline = PipelinePlan(**{**dict(stages=[0, 2], micro_batches=4), **change})
    with pytest.raises(PlanError, match=message):
        validate_plan(plan, mlp, topo4, pipelines=True)


def test_stages_need_their_own_devices_and_data_parallel_groups(mlp, topo4):
    plan = _pipelined(mlp, topo4)
    plan.groups[2] = plan.groups[3] = GroupPlan([1], [1.0])
    plan.pipeline = PipelinePlan([0, 2], 2)
    with pytest.raises(PlanError, match=r"pipeline\.stages: device 1 is in stage 0 and stage 1"):
        validate_plan(plan, mlp, topo4, pipelines=True)
    plan = _pipelined(mlp, topo4)
    plan.groups[2] = plan.groups[3] = GroupPlan([2, 3], [1.0, 1.0], "mp", mp_splits=None)
    plan.pipeline = PipelinePlan([0, 2], 2)
    with pytest.raises(PlanError, match=r"groups\[2\]"):
        validate_plan(plan, mlp, topo4, pipelines=True)


def test_plan_file_type_errors(tmp_path):
    d = {"model": "m", "graph_signature": "s", "topology": "t", "topology_signature": "x", "batch_size": 8,
         "groups": [{"devices": [0], "shares": [1.0], "sync": "allreduce"}],
         "pipeline": {"stages": [0], "micro_batches": "4"}}
    with pytest.raises(PlanError, match=r"^p: pipeline\.micro_batches: expected an integer, got \"4\"$"):
        Plan.from_dict(d, source="p")
    d["pipeline"] = {"stages": [0], "micro_batches": 4, "depth": 2}
    with pytest.raises(PlanError, match=r"^p: pipeline\.depth: unknown field"):
        Plan.from_dict(d, source="p")


def test_schedule_of_a_pipeline(mlp, topo4):
    """The executor's schedule runs every unit once per micro-batch in the pipeline's order, moves
    each micro-batch's rows only, and syncs a group's gradients once, after its last backward."""
    plan = _pipelined(mlp, topo4)
    plan.pipeline = PipelinePlan([0, 2], 4, "1f1b")
    sched = build_schedule(mlp, plan)
    ranges = micro_ranges(plan.batch_size, 4)
    assert sched.micro_ranges == ranges
    computes = [(s.unit[0], s.phase, s.micro) for s in sched.steps if s.kind == "compute"]
    assert sorted(computes) == sorted((g, p, m) for g in range(4) for p in ("fwd", "bwd") for m in range(4))
    # stage 0 (groups 0, 1) runs 1F1B: two forwards in flight before its first backward
    stage0 = [(p, m) for g, p, m in computes if g == 1]
    assert stage0 == stage_sequence(0, 2, 4, 1)
    for s in sched.steps:
        if s.kind == "transfer":
            lo, hi = ranges[s.micro]
            assert all(lo <= mv.start and mv.stop <= hi for mv in s.moves if mv.mode == "rows")
    syncs = [i for i, s in enumerate(sched.steps) if s.kind == "sync"]
    assert [sched.steps[i].group for i in syncs] == [g for g in (1, 0) if sched.group_params[g]]
    last_bwd = max(i for i, s in enumerate(sched.steps) if s.kind == "compute" and s.unit[0] == 1)
    assert all(i > last_bwd for i in syncs)
    # a micro-batch's replicas split its samples in the stage's shares
    assert ranges[1] == (2, 4) and [(r.start, r.stop) for r in sched.unit_at((0, 0), 1).replicas] == [(2, 3), (3, 4)]
    # without a pipeline the schedule is the one it always was
    plain = build_schedule(mlp, _pipelined(mlp, topo4))
    assert all(s.micro == 0 for s in plain.steps) and plain.micro_ranges == [(0, plan.batch_size)]


def _two_stage(graph, topo, micro, schedule="1f1b", k=1):
    half = graph.num_groups // 2
    groups = [GroupPlan([0], [1.0]) for _ in range(half)] + [GroupPlan([1], [1.0]) for _ in range(graph.num_groups - half)]
    plan = new_plan(graph, topo, groups)
    plan.pipeline = PipelinePlan([0, half], micro, schedule, k)
    return plan


def test_simulated_pipeline(captured, topo4):
    """One micro-batch is the plan without a pipeline, to the last bit (Llama: no tied weight,
    which a pipeline holds on both stages and a plain plan moves); more micro-batches overlap
    the two stages (faster here: compute-bound on the roofline, per-op overheads small); GPipe keeps every micro-batch's
    activations alive on every stage, 1F1B S - s of them; the timeline names every micro-batch."""
    from tag.sim import simulate

    llama = captured("llama:n_layer=2,n_embd=64,n_head=4,n_kv_head=2,ffn=96,seq=32,vocab=256", batch=16, groups=4).graph
    one = _two_stage(llama, topo4, 1)
    plain = simulate(llama, topo4, new_plan(llama, topo4, one.groups))
    r1 = simulate(llama, topo4, one)
    assert r1.iteration_time_s == plain.iteration_time_s and r1.peak_memory_bytes == plain.peak_memory_bytes
    graph = captured("gpt2:n_layer=2,n_embd=256,n_head=4,vocab=1024,seq=64", batch=16, groups=4).graph
    r1 = simulate(graph, topo4, _two_stage(graph, topo4, 1))
    r4 = simulate(graph, topo4, _two_stage(graph, topo4, 4))
    assert r4.iteration_time_s < r1.iteration_time_s
    gp = simulate(graph, topo4, _two_stage(graph, topo4, 4, "gpipe"))
    assert gp.peak_memory_bytes[0] > r4.peak_memory_bytes[0] and gp.peak_memory_bytes[1] > r4.peak_memory_bytes[1]
    tr = simulate(graph, topo4, _two_stage(graph, topo4, 4), trace=True)
    names = {e.name.split(" @")[0] for e in tr.events if e.cat in ("fwd", "bwd")}
    assert {f"fwd g0 mb{m}" for m in range(4)} <= names and {f"bwd g3 mb{m}" for m in range(4)} <= names
    assert tr.iteration_time_s == r4.iteration_time_s and tr.critical_path


@pytest.mark.parametrize("schedule, k", [("1f1b", 1), ("kfkb", 2), ("gpipe", 1)])
def test_simulator_runs_the_schedules_micro_batches_in_its_order(mlp, topo4, schedule, k):
    """Per device, the simulated compute stages come in the order of the device's compute steps
    in the executor's schedule, micro-batch by micro-batch."""
    from tag.sim import simulate

    plan = _pipelined(mlp, topo4)
    plan.pipeline = PipelinePlan([0, 2], 4, schedule, k)
    sched = build_schedule(mlp, plan)
    events = simulate(mlp, topo4, plan, trace=True).events
    for d in range(3):
        want = [f"{s.phase} g{s.unit[0]} mb{s.micro}" for s in sched.steps_of(d) if s.kind == "compute"]
        got = [e.name.split(" @")[0] for e in sorted((e for e in events if e.device == d and e.cat in ("fwd", "bwd")),
                                                    key=lambda e: e.start)]
        # (stages that take no time, e.g. the backward of a group without parameters, are not events)
        assert got == [w for w in want if w in set(got)] and len(got) >= len(want) // 2
