"""Pipeline plans executed: micro-batches, per-micro-batch values, gradient accumulation, one sync.

After K=2 steps the parameters of a 2-stage pipeline (1F1B, GPipe, kFkB; uneven micro-batches;
a stage that is itself data parallel; GPT-2's tied embedding and Llama's rotary tables crossing
the stages) equal
single-process training on the full batch, fp32, with the executor's tolerance (rtol 1e-4,
atol 1e-6: tests/test_executor.py). In one process (:func:`tag.executor.run_virtual`, the same
schedule and rank runtimes) and on gloo ranks (:func:`tag.executor.execute`).

The batch-6 cases train with SGD (momentum): with Adam one weight of the MLP gets a full-batch
gradient of -1.5e-10 in the first step (cancellation over the samples), which Adam normalises to a
full-size step whose sign depends on the summation order; any split of the batch (data parallel
too) moves that one element by ~5e-6. SGD checks the accumulation exactly (7e-9 here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_executor import GPT2, MLP
from test_executor_dist import cpu_topology

from tag.errors import PlanError
from tag.executor import ExecuteConfig, build_schedule, execute, reference_training, run_virtual
from tag.executor.equality import assert_params_equal, saved_params
from tag.executor.fuse import accumulation
from tag.graph.gradients import batch_independent_tensors
from tag.parallel import validate_plan
from tag.parallel.pipeline import PipelineSchedule, iteration_program, register_schedule, unregister_schedule
from tag.plan import GroupPlan, PipelinePlan, new_plan
from tag.sim import Simulator
from tag.sim.bounds import plan_bound, static_bound
from tag.sim.engine import _holdings
from tag.sim.program import build_program
from tag.topology import load_topology
from tag.workloads import load_workload

LLAMA = "llama:n_layer=2,n_embd=32,n_head=4,n_kv_head=2,ffn=48,seq=16,vocab=64"


def two_stages(graph, topo, first, second, micro, schedule="1f1b", k=1):
    """Groups 0..K/2-1 on devices ``first`` (even shares), the rest on ``second``, pipelined."""
    half = graph.num_groups // 2
    stage = [GroupPlan(list(d), [1 / len(d)] * len(d)) for d in (first, second)]
    plan = new_plan(graph, topo, [stage[0]] * half + [stage[1]] * (graph.num_groups - half))
    plan.pipeline = PipelinePlan([0, half], micro, schedule, k)
    return plan


def assert_equal_params(params_by_rank, ref, graph):
    assert_params_equal(params_by_rank, ref, {p.name for p in graph.params}, exact=True)


@pytest.fixture(scope="module")
def joints():
    return {}


CASES = {  # name: (spec, batch, micro-batches, schedule, k, stage devices, optimizer)
    "1f1b-uneven": (MLP, 6, 4, "1f1b", 1, ([0], [1]), "sgd"),
    "gpipe-uneven": (MLP, 6, 4, "gpipe", 1, ([0], [1]), "sgd"),
    "kfkb-dp-stage": (MLP, 8, 4, "kfkb", 2, ([2], [0, 1]), "adam"),
    "gpt2-tied": (GPT2, 4, 2, "1f1b", 1, ([1], [0]), "adam"),
    "llama-rotary": (LLAMA, 8, 3, "1f1b", 1, ([0], [1]), "adam"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipelines_match_single_process_training(captured, topo4, joints, case):
    spec, B, M, schedule, k, devices, optimizer = CASES[case]
    graph = captured(spec, batch=B, groups=4).graph
    plan = two_stages(graph, topo4, *devices, M, schedule, k)
    validate_plan(plan, graph, topo4)
    steps = 2
    rts = run_virtual(graph, plan, load_workload(spec, batch=B), optimizer, steps,
                      joints=joints.setdefault(spec, {}), cut_at_sync=case == "kfkb-dp-stage")
    ref, losses = reference_training(load_workload(spec, batch=B), optimizer, steps)
    assert_equal_params({r: rt.named_params() for r, rt in rts.items()}, ref, graph)
    # the loss of the last step: each micro-batch's mean weighted by its share of the batch
    assert sum(rt.loss for rt in rts.values()) == pytest.approx(losses[-1], rel=1e-5)


def eager_1f1b(stage: int, num_stages: int, pp: PipelinePlan) -> list[tuple[str, int]]:
    """Eager 1F1B: stage ``s`` runs ``min(2 (S - 1 - s), M)`` forwards before its first backward
    (1F1B: ``S - 1 - s``), so a stage has work queued while a micro-batch makes its round trip
    through the stages after it; then one forward and one backward, then the remaining backwards."""
    M = pp.micro_batches
    w = min(2 * (num_stages - 1 - stage), M)
    seq = [("fwd", m) for m in range(w)]
    for m in range(M - w):
        seq += [("fwd", w + m), ("bwd", m)]
    return seq + [("bwd", m) for m in range(M - w, M)]


@pytest.fixture
def eager():
    register_schedule(PipelineSchedule("eager-1f1b", eager_1f1b, searched=()))
    yield "eager-1f1b"
    unregister_schedule("eager-1f1b")


def test_a_new_schedule_drops_in(captured, topo4, joints, eager):
    """A schedule registered from this test only (no edit of the simulator, the executor or the
    schedule builder): the plan validates, the simulator runs its order (the heavier first stage
    fills 1F1B's wait for micro-batch 0's backward, so the iteration is shorter; one more
    micro-batch in flight on stage 0: its activations held once more), the bounds stay below the
    simulation, and the executor trains equal to single-process training. Unregistered, a plan
    naming it is refused in one line."""
    graph = captured(MLP, batch=6, groups=4).graph
    stages = [GroupPlan([0], [1.0])] * 3 + [GroupPlan([1], [1.0])]  # groups 0-2 on device 0, 3 on 1
    plan = new_plan(graph, topo4, stages)
    plan.pipeline = PipelinePlan([0, 3], 4, eager)
    validate_plan(plan, graph, topo4)
    prog = iteration_program(plan.pipeline, 6, 4)
    assert prog.sequences[0] == (("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 0), ("fwd", 3), ("bwd", 1), ("bwd", 2),
                                 ("bwd", 3))
    assert prog.flight == (3, 1)
    computes = [(s.unit[0], s.phase, s.micro) for s in build_schedule(graph, plan).steps if s.kind == "compute"]
    assert tuple((p, m) for g, p, m in computes if g == 2) == prog.sequences[0]  # what the ranks walk

    sim = Simulator(graph, topo4)
    mine = sim.run(plan.groups, pipeline=plan.pipeline)
    f1b1, gpipe = (sim.run(plan.groups, pipeline=PipelinePlan([0, 3], 4, s)) for s in ("1f1b", "gpipe"))
    assert mine.iteration_time_s < f1b1.iteration_time_s
    # stage 0 holds 3 micro-batches' activations (1F1B 2, GPipe 4); stage 1 one, as under 1F1B
    extra = mine.peak_memory_bytes[0] - f1b1.peak_memory_bytes[0]
    assert extra > 0 and extra == pytest.approx((gpipe.peak_memory_bytes[0] - f1b1.peak_memory_bytes[0]) / 2)
    assert mine.peak_memory_bytes[1] == f1b1.peak_memory_bytes[1]
    lo, mid = static_bound(sim, plan.groups, plan.pipeline), plan_bound(sim, plan.groups, plan.pipeline)
    assert lo.time_s <= mid.time_s <= mine.iteration_time_s

    steps = 2
    rts = run_virtual(graph, plan, load_workload(MLP, batch=6), "sgd", steps, joints=joints.setdefault(MLP, {}))
    ref, losses = reference_training(load_workload(MLP, batch=6), "sgd", steps)
    assert_equal_params({r: rt.named_params() for r, rt in rts.items()}, ref, graph)
    assert sum(rt.loss for rt in rts.values()) == pytest.approx(losses[-1], rel=1e-5)

    unregister_schedule(eager)
    refused = r"pipeline\.schedule: expected one of \['1f1b', 'gpipe', 'kfkb', 'interleaved'\], got 'eager-1f1b'$"
    with pytest.raises(PlanError, match=r"^plan: " + refused):
        validate_plan(plan, graph, topo4)
    with pytest.raises(PlanError, match=refused):
        sim.run(plan.groups, pipeline=plan.pipeline)
    with pytest.raises(PlanError, match=refused):
        build_schedule(graph, plan)


def test_gradients_are_summed_over_micro_batches_once(captured, topo4):
    """Every unit's parameter gradients: written by its first backward micro-batch, added to by the
    others, synchronised once after its last; per-micro-batch values never share a key."""
    graph = captured(MLP, batch=6, groups=4).graph
    plan = two_stages(graph, topo4, [0], [1, 2], 3, "1f1b")
    sched = build_schedule(graph, plan)
    acc = accumulation(sched)
    assert set(acc) == set(sched.param_owner.values()) and all(first == 0 for first, _ in acc.values())
    assert all(names == {sched.param_grad[ph] for ph, u in sched.param_owner.items() if u == key}
               for key, (_, names) in acc.items())
    syncs = [i for i, st in enumerate(sched.steps) if st.kind == "sync"]
    synced = [sched.steps[i].group for i in syncs]  # once per group of the data-parallel stage
    assert sorted(synced) == [g for g in range(graph.num_groups) if g >= 2 and sched.sync_params[g]] != []
    for i in syncs:
        g = sched.steps[i].group
        bwd = [j for j, st in enumerate(sched.steps) if st.kind == "compute" and st.phase == "bwd" and st.unit[0] == g]
        assert i > max(bwd) and len(bwd) == 3
    assert accumulation(build_schedule(graph, new_plan(graph, topo4, plan.groups))) == {}


def test_tied_weight_is_held_by_both_stages(captured, topo4):
    """GPT-2's tied embedding / LM-head weight, owned by the first stage and read by the last, is
    held by both (Megatron-LM's tied embeddings): it never moves, the last stage's partial sum of
    its gradient stays there (summed over its micro-batches; the first stage's ``add`` gets zeros
    at every micro-batch), and one all-reduce of the weight's bytes over both stages' replicas, a
    bucket of its own launched after both stages' last backward, sums the copies' gradients
    (the first stage's own bucket leaves it out). The simulator moves the schedule's bytes and
    runs the schedule's buckets, tied one included, whatever the number of micro-batches; the
    last stage's replicas hold the weight, its gradient and its optimizer state."""
    from test_sim_executor import schedule_bytes, sim_bytes

    spec, B, *_ = CASES["gpt2-tied"]
    graph = captured(spec, batch=B, groups=4).graph
    sim = Simulator(graph, topo4)
    tied = "p_model_lm_head_weight"
    w = next(p for p in graph.params if graph.tensors[p.tensor].name == tied)
    for first, second, micro in (([0], [1, 2], (1, 2)), ([1], [0], (1, 2, 4))):
        for m in micro:
            plan = two_stages(graph, topo4, first, second, m)
            sched = build_schedule(graph, plan, topo4.machine_of)
            t = sched.tied[tied]
            assert t.owner == sched.param_owner[tied] and t.collective.members == tuple(sorted(first + second))
            steps = [(st, mv) for st in sched.steps if st.kind == "transfer" for mv in st.moves]
            assert not [mv for _, mv in steps if mv.name == tied]
            assert [(st.micro, mv.mode, mv.src, mv.dst) for st, mv in steps if mv.name == t.grad] == \
                [(mb, "zeros", first[0], first[0]) for mb in range(m)]
            assert t.grad in sched.summed[t.grad_unit]
            assert tied not in sched.sync_params[t.owner[0]] and sched.sync_params[t.group] == [tied]
            (i,) = [k for k, st in enumerate(sched.steps) if st.kind == "sync" and st.group == t.group]
            assert i > max(k for k, st in enumerate(sched.steps) if st.kind == "compute")  # after both stages
            assert sched.launched_at(sched.steps[i]).nbytes == w.nbytes
            want = schedule_bytes(graph, sched)
            got = sim_bytes(sim, plan.groups, plan.pipeline)
            assert set(got) == set(want) and all(got[key] == pytest.approx(v, rel=1e-12) for key, v in want.items())
            micro_run = build_program(sim, plan.groups, plan.pipeline)
            jobs = [(job.sync_devices, job.sync_bytes) for _, job in sim.sync_jobs(sim.deploy(plan.groups),
                                                                                micro_run.tied)]
            assert jobs == [(b.collective.members, b.nbytes) for b in sched.buckets]
            # memory held: the second stage's replicas hold the weight, its gradient and Adam's two
            # moments besides what they held when it crossed; the first stage's hold the same
            gds = sim.deploy(plan.groups)
            held, moved = (_holdings(sim, gds, run)[1] for run in (micro_run, micro_run._replace(tied=frozenset())))
            assert w.opt_state_bytes == 2 * w.nbytes
            assert [x - y for x, y in zip(held, moved)] == pytest.approx(
                [2 * w.nbytes + w.opt_state_bytes if d in second else 0.0 for d in range(topo4.num_devices)])


def _below_arange(graph, t: int) -> bool:
    """Whether tensor ``t`` is computed from an ``arange`` (an op without inputs)."""
    todo, seen = [t], set()
    while todo:
        p = graph.tensors[todo.pop()].producer
        if p < 0 or p in seen:
            continue
        seen.add(p)
        if graph.ops[p].target.startswith("aten.arange"):
            return True
        todo += graph.ops[p].inputs
    return False


def test_rotary_tables_move_once_per_iteration(captured, topo4):
    """Llama's rotary cos/sin tables, computed in the first stage from ``arange`` and a buffer,
    are read by the second stage's attention: on a pipeline they cross once per iteration, at the
    first micro-batch, to every replica of the second stage, and the simulator moves exactly the
    bytes counted here by hand from the graph: rows of each batch-carrying tensor per sample, a
    batch-independent tensor's bytes once, any other non-batch tensor's once per micro-batch."""
    from test_sim_executor import schedule_bytes, sim_bytes

    from tag.sim import Simulator

    graph = captured(LLAMA, batch=6, groups=4).graph
    sim = Simulator(graph, topo4)
    once = batch_independent_tensors(graph)
    stage_of = [int(op.group >= graph.num_groups // 2) for op in graph.ops]
    first_owned = {p.tensor for p in graph.params if p.group < graph.num_groups // 2}
    crossing = {t for t, tt in enumerate(graph.tensors)  # made (or owned) by stage 0, read by stage 1
                if ((tt.producer >= 0 and stage_of[tt.producer] == 0) or t in first_owned)
                and any(stage_of[c] == 1 and graph.ops[c].phase != "opt" for c in tt.consumers)}
    tables = {t for t in crossing & once if graph.tensors[t].kind == "activation"}
    assert tables and all(_below_arange(graph, t) for t in tables), tables  # the rotary cos and sin
    names = {graph.tensors[t].name for t in tables}
    for second in ([1], [1, 2]):
        for m in (1, 2, 3):
            plan = two_stages(graph, topo4, [0], second, m)
            sched = build_schedule(graph, plan, topo4.machine_of)
            moves = [(st.phase, st.micro, mv.name, mv.src, mv.dst) for st in sched.steps
                     if st.kind == "transfer" for mv in st.moves if mv.name in names]
            assert sorted(moves) == sorted(("fwd", 0, n, 0, d) for n in names for d in second)
            got = sim_bytes(sim, plan.groups, plan.pipeline if m > 1 else None)
            want = schedule_bytes(graph, sched)
            assert set(got) == set(want) and all(got[k] == pytest.approx(v, rel=1e-12) for k, v in want.items())
            for d in second:  # by hand: the stage-1 replica on device d
                samples = sum(sched.unit_at(sched.units_of(d)[0].key, mb).replica_on(d).batch for mb in range(m))
                hand = sum(graph.tensors[t].nbytes.per_sample * samples if graph.tensors[t].batch_dim is not None
                           else graph.tensors[t].nbytes.fixed * (1 if t in once else m) for t in crossing)
                assert got[(0, d)] == pytest.approx(hand, rel=1e-12)
                assert schedule_bytes(graph, sched, names)[(0, d)] == sum(graph.tensors[t].nbytes.fixed for t in tables)


def test_a_tensor_crosses_into_a_stage_once_per_micro_batch(captured, topo4, joints):
    """A tensor made by one stage and read by several groups of a later one (Llama's causal mask
    and rotary-rotated values, made in the first layers, read by every layer) crosses once per
    (tensor, destination device, micro-batch), before the stage's first group reading it, and the
    stage's later groups take that copy over on their device (no transfer); the simulator moves the
    schedule's bytes, and training equals single-process training."""
    from test_sim_executor import schedule_bytes, sim_bytes

    spec = "llama:n_layer=4,n_embd=32,n_head=4,n_kv_head=2,ffn=48,seq=16,vocab=64"
    graph = captured(spec, batch=8, groups=8).graph
    plan = two_stages(graph, topo4, [0], [1, 2], 2)
    sched = build_schedule(graph, plan, topo4.machine_of)
    remote = [(st.micro, mv.name, mv.src, mv.dst, mv.start) for st in sched.steps if st.kind == "transfer"
              for mv in st.moves if mv.src != mv.dst and mv.mode != "zeros"]
    assert len(remote) == len(set(remote))  # once per (micro-batch, tensor, piece, destination device)
    half = graph.num_groups // 2
    names = [t.name for t in graph.tensors]
    shared = {names[t] for t, tt in enumerate(graph.tensors)  # made by stage 0, read by 2+ groups of stage 1
              if tt.producer >= 0 and graph.ops[tt.producer].group < half
              and len({graph.ops[c].group for c in tt.consumers if graph.ops[c].group >= half
                       and graph.ops[c].phase != "opt"}) >= 2}
    assert shared
    relayed = set()
    for st in sched.steps:
        for mv in st.moves:
            if st.kind == "transfer" and mv.name in shared and mv.src == mv.dst and mv.dst_unit[0] >= half:
                assert mv.src_unit[0] >= half and mv.src_unit != mv.dst_unit  # from the stage's first reader
                relayed.add(mv.name)
    assert relayed == shared
    for name in shared:  # from device 0 to each of stage 1's, once per micro-batch, or once if it does not change
        for d in (1, 2):
            micros = [x[0] for x in remote if x[1:4] == (name, 0, d)]
            assert micros in ([0, 1], [0]), (name, d, micros)
    got = sim_bytes(Simulator(graph, topo4), plan.groups, plan.pipeline)
    want = schedule_bytes(graph, sched)
    assert set(got) == set(want) and all(got[k] == pytest.approx(v, rel=1e-12) for k, v in want.items())
    rts = run_virtual(graph, plan, load_workload(spec, batch=8), "sgd", 2, joints=joints.setdefault(spec, {}))
    ref, losses = reference_training(load_workload(spec, batch=8), "sgd", 2)
    assert_equal_params({r: rt.named_params() for r, rt in rts.items()}, ref, graph)


def test_a_gpu_rank_computes_on_while_its_sends_go(captured, topo4):
    """A GPU rank posts the sends of a step in which it receives nothing and computes on (the
    executor does not wait for them, tag.executor.comm.DistComm._exchange): in the simulated
    timeline its sends overlap its compute; a CPU rank (gloo, packed, blocking) waits for them."""
    graph = captured(GPT2, batch=8, groups=4).graph
    overlaps = {}
    for topo in (topo4, load_topology("homogeneous-8xa100")):
        plan = two_stages(graph, topo, [0], [1], 4)
        events = Simulator(graph, topo).run(plan.groups, pipeline=plan.pipeline, trace=True).events
        sends = [e for e in events if e.cat == "transfer" and "d0->d1" in e.name]
        computes = [e for e in events if e.device == 0 and e.cat in ("fwd", "bwd")]
        assert sends and computes
        overlaps[topo.name] = sum(min(s.end, c.end) > max(s.start, c.start) for s in sends for c in computes)
    assert overlaps[topo4.name] == 0 and overlaps["homogeneous-8xa100"] > 0, overlaps


def test_blocking_sends_make_the_gpu_sender_wait(captured, topo4):
    """Simulator(blocking_sends=True) models a runtime whose pipeline sends block (DeepSpeed's
    p2p.send, Megatron-LM's schedules): on two V100 machines over 1 Gbit/s, stage 0's compute
    never overlaps its sends and starts after every send it posted before ended, and the
    iteration is longer; off (the default), stage 0 computes while its sends go. CPU ranks already
    wait for their sends: the same iteration either way. Each host launches a kernel in 1 us, so
    the stages are the devices' (at the default 55 us this small GPT-2's stages are its hosts',
    which run ahead of the devices and hide the senders' waits: the same iteration either way)."""
    graph = captured(GPT2, batch=8, groups=4).graph
    slow = load_topology({"name": "2x1-v100-1gbit", "network": {"bandwidth": "1 Gbit/s", "latency": "10 us"},
                          "machines": [{"name": f"node{i}", "gpu": "V100-SXM2-16GB", "count": 1,
                                        "host_launch": "1 us"} for i in (0, 1)]})
    plan = two_stages(graph, slow, [0], [1], 4)
    runs = {on: Simulator(graph, slow, blocking_sends=on).run(plan.groups, pipeline=plan.pipeline, trace=True)
            for on in (False, True)}
    timeline = {}
    for on, res in runs.items():
        sends = [e for e in res.events if e.cat == "transfer" and "d0->d1" in e.name]
        computes = [e for e in res.events if e.device == 0 and e.cat in ("fwd", "bwd")]
        assert sends and computes
        overlap = sum(min(s.end, c.end) > max(s.start, c.start) for s in sends for c in computes)
        waited = all(c.start >= s.end for s in sends for c in computes if c.start > s.start)
        timeline[on] = (overlap, waited, sum(s.end - s.start for s in sends))
    assert timeline[False][0] > 0, timeline
    assert timeline[True][0] == 0 and timeline[True][1], timeline
    t_off, t_on = runs[False].iteration_time_s, runs[True].iteration_time_s
    assert t_on > t_off, (t_off, t_on)
    cpu = two_stages(graph, topo4, [0], [1], 4)
    assert [Simulator(graph, topo4, blocking_sends=on).run(cpu.groups, pipeline=cpu.pipeline).iteration_time_s
            for on in (False, True)] == [pytest.approx(Simulator(graph, topo4).run(
                cpu.groups, pipeline=cpu.pipeline).iteration_time_s, rel=1e-12)] * 2
    with pytest.raises(ValueError, match="blocking_sends: expected True or False, got 'yes'"):
        Simulator(graph, slow, blocking_sends="yes")


def _stage_plan(graph, topo, num_stages: int, micro: int):
    """Groups cut into ``num_stages`` even stages, stage ``s`` on device ``s``."""
    g = graph.num_groups
    stages = [round(i * g / num_stages) for i in range(num_stages)]
    bounds = stages + [g]
    plan = new_plan(graph, topo, [GroupPlan([s], [1.0]) for s in range(num_stages)
                                  for _ in range(bounds[s], bounds[s + 1])])
    plan.pipeline = PipelinePlan(stages, micro, "1f1b", 1)
    return plan


@pytest.mark.parametrize("num_stages", [2, 4])
def test_a_boundary_carries_back_the_gradient_of_what_crossed_it(captured, topo4, num_stages):
    """Per pair of stages, the backward carries no more activation-gradient bytes than the
    forward carried batch-carrying bytes the other way (a boundary carries the gradient of what
    crossed it; a mask crossing has none), on a GPT-2 of 4 layers in 8 groups at pp=2 and pp=4,
    one stage cut inside the MLP (its tanh GELU's backward made three partial terms of the input's
    gradient, which crossed separately: 212992 bytes back for 90112 forward at pp=2 before
    tag.graph.gradients.backward_homes). The simulator moves the schedule's bytes per device pair."""
    from test_sim_executor import schedule_bytes, sim_bytes

    graph = captured("gpt2:n_layer=4,n_embd=32,n_head=2,seq=16", batch=8, groups=8).graph
    plan = _stage_plan(graph, topo4, num_stages, 2)
    sched = build_schedule(graph, plan, topo4.machine_of)
    rows = _boundary_rows(graph, sched)
    pairs = {(a, b) for a, b, ph in rows if ph == "fwd"}
    assert pairs and all(rows.get((b, a, "bwd"), 0) <= rows[(a, b, "fwd")] for a, b in pairs), rows
    assert all((b, a) in pairs for a, b, ph in rows if ph == "bwd")  # nothing back where nothing came
    assert all(rows.get((b, a, "bwd"), 0) > 0 for a, b in pairs if b == a + 1)
    got = sim_bytes(Simulator(graph, topo4), plan.groups, plan.pipeline)
    want = schedule_bytes(graph, sched)
    assert set(got) == set(want) and all(got[k] == pytest.approx(v, rel=1e-12) for k, v in want.items())


def _boundary_rows(graph, sched) -> dict:
    """(source device, destination device, phase) -> bytes of the remote row moves of activations
    and their gradients of at least one hidden state a sample (GPT-2, n_embd 32, seq 16, fp32; the
    graph marks layer-norm weight-gradient partials, 64 bytes a sample, batch-carrying: left out)."""
    by_name = {t.name: t for t in graph.tensors}
    rows: dict = {}
    for st in sched.steps:
        for mv in st.moves:
            if (st.kind == "transfer" and mv.mode == "rows" and mv.src != mv.dst
                    and by_name[mv.name].nbytes.per_sample >= 16 * 32 * 4):
                key = (mv.src, mv.dst, st.phase)
                rows[key] = rows.get(key, 0) + by_name[mv.name].nbytes.per_sample * (mv.stop - mv.start)
    return rows


def test_a_stage_cut_at_a_layer_norm_carries_back_one_gradient(captured, topo4, joints):
    """A stage cut at a transformer layer's first op, a pre-LN block's layer norm (one op-group a
    layer, tag.parallel.layers.group_by_layers, as published plans cut), carries back the hidden
    state's gradient alone: the norm's backward returns a tuple (input, weight and bias
    gradients) and moves to the later stage with its projections (tag.graph.gradients.
    backward_homes), its parameters' owner with it; before, the norm's input gradient and the
    residual's crossed separately, 2x the forward bytes. The simulator moves the schedule's
    bytes, and training equals single-process training."""
    import copy

    from test_sim_executor import schedule_bytes, sim_bytes

    from tag.parallel.layers import group_by_layers

    spec = "gpt2:n_layer=4,n_embd=32,n_head=2,seq=16"
    graph = copy.deepcopy(captured(spec, batch=8, groups=8).graph)
    assert group_by_layers(graph) == 6  # embedding, 4 layers, head
    plan = two_stages(graph, topo4, [0], [1], 2)  # stage 1 from layer 2's ln_1
    sched = build_schedule(graph, plan, topo4.machine_of)
    rows = _boundary_rows(graph, sched)
    assert 0 < rows[(1, 0, "bwd")] <= rows[(0, 1, "fwd")], rows
    ln_1 = next(p for p in graph.params if p.name.endswith("h.2.ln_1.weight"))
    assert ln_1.group == 2 and sched.param_owner[graph.tensors[ln_1.tensor].name][0] == 3
    got = sim_bytes(Simulator(graph, topo4), plan.groups, plan.pipeline)
    want = schedule_bytes(graph, sched)
    assert set(got) == set(want) and all(got[k] == pytest.approx(v, rel=1e-12) for k, v in want.items())
    rts = run_virtual(graph, plan, load_workload(spec, batch=8), "sgd", 2, joints=joints.setdefault(spec, {}))
    ref, _ = reference_training(load_workload(spec, batch=8), "sgd", 2)
    assert_equal_params({r: rt.named_params() for r, rt in rts.items()}, ref, graph)


@pytest.mark.parametrize("spec, groups", [
    ("gpt2:n_layer=4,n_embd=32,n_head=2,seq=16", 8),
    ("llama:n_layer=2,n_embd=32,n_head=2,n_kv_head=1,ffn=64,vocab=64,seq=16", 6),
    (LLAMA, 4)])
def test_moved_backward_ops_keep_backward_data_flowing_to_earlier_positions(captured, spec, groups):
    """After tag.graph.gradients.backward_homes every backward op is at or before the position of
    every backward op it reads (an mp group's chunks run their backward in reverse order; a moved
    op at a later position than an input's maker read it before it was made: the simulator failed
    on `tag plan --model llama:n_layer=2,... --batch 3 --topology local-cpu4 --seed 112 --groups 6`),
    and a moved op reads from one later group and is read in its own group only."""
    from tag.graph.gradients import backward_homes

    graph = captured(spec, batch=3, groups=groups).graph
    homes = backward_homes(graph)
    assert homes
    where = {i: homes.get(i, (op.group, op.anchor)) for i, op in enumerate(graph.ops)}
    for i, op in enumerate(graph.ops):
        if op.phase != "bwd":
            continue
        for t in op.inputs:
            p = graph.tensors[t].producer
            if p >= 0 and graph.ops[p].phase == "bwd":
                assert where[i][1] <= where[p][1] and where[i][0] <= where[p][0], (op.name, graph.ops[p].name)
    for i, (g, _) in homes.items():
        assert g > graph.ops[i].group
        assert all(where[c][0] in (g, graph.ops[i].group) for t in graph.ops[i].outputs
                   for c in graph.tensors[t].consumers if graph.ops[c].phase != "opt")


def _execute(tmp_path: Path, graph, topo_path: str, plan, spec: str, optimizer: str, steps: int = 2):
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    cfg = ExecuteConfig(spec, topo_path, str(plan_path), steps=steps, warmup=0, save_params=True, optimizer=optimizer,
                        run_dir=str(tmp_path / "run"), timeout_s=60.0)
    res = execute(cfg, graph=graph)
    return res, saved_params(tmp_path / "run", res.world_size)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b"])
def test_two_gloo_ranks_run_a_pipeline(tmp_path, captured, schedule):
    """2 stages on 2 ranks, B=6 in 4 micro-batches (2, 2, 1, 1 samples). (GPipe runs on gloo in
    the three-rank test; every schedule in one process above.)"""
    graph = captured(MLP, batch=6, groups=4).graph
    topo_path = cpu_topology(tmp_path, 2)
    plan = two_stages(graph, load_topology(topo_path), [0], [1], 4, schedule)
    res, params = _execute(tmp_path, graph, topo_path, plan, MLP, "sgd")
    ref, losses = reference_training(load_workload(MLP, batch=6), "sgd", 2)
    assert_equal_params(params, ref, graph)
    assert res.losses == pytest.approx(losses, rel=1e-5)
    # the rank timelines name the micro-batches (fused segments: "fwd g0-g1 m0", ...)
    words = {w for e in res.ranks[0]["timeline"] for w in e[0].split()}
    assert {f"m{m}" for m in range(4)} <= words, words


@pytest.mark.slow
def test_two_gloo_ranks_hold_gpt2s_tied_embedding(tmp_path, captured):
    """GPT-2's tied embedding on a 2-stage pipeline of 2 gloo ranks (B=4 in 2 micro-batches): each
    rank holds a copy, the copies' gradients are all-reduced (no transfer carries the weight or its
    gradient), and after 2 steps both copies equal single-process training's weight. SGD: the
    attention's key bias has a zero gradient in exact arithmetic (softmax is shift invariant), which
    Adam normalises from rounding noise to a full-size step (1.8x the tolerance on this split, with
    the weight moved between the stages as before, 2026-11-29)."""
    from test_sim_executor import schedule_bytes

    spec, B, M, *_ = CASES["gpt2-tied"]
    graph = captured(spec, batch=B, groups=4).graph
    topo_path = cpu_topology(tmp_path, 2)
    plan = two_stages(graph, load_topology(topo_path), [0], [1], M)
    res, params = _execute(tmp_path, graph, topo_path, plan, spec, "sgd")
    ref, losses = reference_training(load_workload(spec, batch=B), "sgd", 2)
    assert_equal_params(params, ref, graph)
    assert all("model.lm_head.weight" in params[r] for r in (0, 1))  # a copy on each rank
    assert res.losses == pytest.approx(losses, rel=1e-5)
    sched = build_schedule(graph, plan)
    w = next(p for p in graph.params if p.name == "model.lm_head.weight")
    sent = sum(n for rk in res.ranks for n in rk["sent_bytes"].values())
    assert sent == sum(schedule_bytes(graph, sched).values()) and sent < w.nbytes  # the weight never moves


@pytest.mark.slow
def test_three_gloo_ranks_with_a_data_parallel_stage(tmp_path, captured):
    """Stage 0 on rank 0, stage 1 data parallel on ranks 1 and 2 (a gradient all-reduce once per
    iteration, after the last micro-batch); B=8 in 2 micro-batches, GPipe, Adam."""
    graph = captured(MLP, batch=8, groups=4).graph
    topo_path = cpu_topology(tmp_path, 3)
    plan = two_stages(graph, load_topology(topo_path), [0], [1, 2], 2, "gpipe")
    res, params = _execute(tmp_path, graph, topo_path, plan, MLP, "adam")
    ref, losses = reference_training(load_workload(MLP, batch=8), "adam", 2)
    assert_equal_params(params, ref, graph)
    assert res.losses == pytest.approx(losses, rel=1e-5)


@pytest.mark.slow
def test_a_pipeline_on_a_sub_cluster_leaves_a_rank_idle(tmp_path, captured):
    """A plan of the grid on a sub-cluster (tag.search.layouts.subcluster_search) keeps the dropped
    devices idle: 2 stages on ranks 0 and 2 of three, rank 1 with no op-group, runs on gloo and
    trains as one process does."""
    graph = captured(MLP, batch=6, groups=4).graph
    topo_path = cpu_topology(tmp_path, 3)
    plan = two_stages(graph, load_topology(topo_path), [0], [2], 2, "1f1b")
    res, params = _execute(tmp_path, graph, topo_path, plan, MLP, "sgd")
    ref, losses = reference_training(load_workload(MLP, batch=6), "sgd", 2)
    assert_equal_params(params, ref, graph)
    assert res.losses == pytest.approx(losses, rel=1e-5)


def test_validation_plans_include_pipelines(tmp_path, captured, topo4):
    """``tag validate`` executes two pipelined plans (2 stages x 4 micro-batches, 1F1B and GPipe)
    beside the inter-op model-parallel one; none where a replica would get < 2 samples."""
    from tag.executor.validate import validation_plans

    graph = captured(MLP, batch=8, groups=4).graph
    topo = load_topology(cpu_topology(tmp_path, 2))
    plans = dict(validation_plans(graph, topo, 11))
    assert plans["inter-op"].pipeline is None and "pipeline" not in plans
    for schedule in ("1f1b", "gpipe"):
        plan = plans[f"pp2-{schedule}-m4"]
        validate_plan(plan, graph, topo)
        assert (plan.pipeline.stages, plan.pipeline.micro_batches, plan.pipeline.schedule) == ([0, 2], 4, schedule)
        assert [gp.devices for gp in plan.groups] == [[0], [0], [1], [1]]
    # 4 devices: stages of 2 replicas, but micro-batches of 2 samples would give them 1 each
    assert not any(name.startswith("pp2") for name, _ in validation_plans(graph, topo4, 20))
