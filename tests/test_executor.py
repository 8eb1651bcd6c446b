"""Executor semantics in one process: every plan kind reproduces single-process training.

The same schedule and rank runtimes as the distributed executor, with transfers and syncs done
in-process (:func:`tag.executor.run_virtual`), so many plans are cheap to check.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from tag.errors import PlanError
from tag.executor import build_schedule, partial_sum_tensors, reference_training, run_virtual
from tag.executor.equality import assert_params_equal
from tag.parallel import validate_plan
from tag.parallel.tensor_parallel import base_name
from tag.plan import GroupPlan, group_positions, new_plan
from tag.workloads import load_workload

MLP = "mlp"
GPT2 = "gpt2:n_layer=1,n_embd=32,n_head=2,seq=16"
ATTENTION = "tests/data/attention_model.py:make"
"""A model outside the zoo calling F.scaled_dot_product_attention (the zoo's transformers use
the eager attention implementation, matmul, softmax, matmul, unless built with ``attn=sdpa``)."""
B = 8


@pytest.fixture(scope="module")
def mlp(captured):
    return captured(MLP, batch=B, groups=4).graph


@pytest.fixture(scope="module")
def joints():
    return {}  # shared export cache per spec: {spec: {batch: Joint}}


def assert_matches_reference(graph, plan, spec, optimizer, joints, steps=2, atol=1e-6, cut_at_sync=False,
                             bucket_bytes=None):
    rts = run_virtual(graph, plan, load_workload(spec, batch=B), optimizer, steps,
                      joints=joints.setdefault(spec, {}), cut_at_sync=cut_at_sync, bucket_bytes=bucket_bytes)
    ref, _ = reference_training(load_workload(spec, batch=B), optimizer, steps)
    assert_params_equal({r: rt.named_params() for r, rt in rts.items()}, ref, {p.name for p in graph.params},
                        atol=atol, exact=True)


def mp_groups(graph, devices_of):
    out = []
    for g in range(graph.num_groups):
        lo, hi = group_positions(graph, g)
        devs = devices_of(g)
        if hi - lo >= len(devs):
            step = (hi - lo) // len(devs)
            out.append(GroupPlan(devs, [1.0] * len(devs), "mp", mp_splits=[lo + i * step for i in range(len(devs))]))
        else:
            out.append(GroupPlan([devs[0]], [1.0]))
    return out


@pytest.mark.parametrize("kind", ["single", "dp-even", "dp-uneven", "ps-inside", "ps-outside", "mp", "mixed"])
def test_mlp_plans_match_single_process_training(mlp, topo4, joints, kind):
    K = mlp.num_groups
    groups = {
        "single": lambda: [GroupPlan([2], [1.0]) for _ in range(K)],
        "dp-even": lambda: [GroupPlan([0, 1, 2, 3], [0.25] * 4) for _ in range(K)],
        "dp-uneven": lambda: [GroupPlan([0, 1, 2], [0.5, 0.3, 0.2]) for _ in range(K)],
        "ps-inside": lambda: [GroupPlan([0, 1], [0.5, 0.5], "ps", server=1) for _ in range(K)],
        "ps-outside": lambda: [GroupPlan([0, 1], [0.625, 0.375], "ps", server=3) for _ in range(K)],
        "mp": lambda: mp_groups(mlp, lambda g: [g % 4, (g + 1) % 4]),
        "mixed": lambda: [GroupPlan([0, 1], [0.5, 0.5]) if g % 2 == 0 else GroupPlan([1, 2, 3], [0.25, 0.25, 0.5])
                          for g in range(K)],
    }[kind]()
    plan = new_plan(mlp, topo4, groups)
    validate_plan(plan, mlp, topo4)
    assert_matches_reference(mlp, plan, MLP, "adam", joints)


@pytest.mark.parametrize("kind", ["mixed", "ps-outside", "mp"])
def test_segments_cut_at_syncs_match_single_process_training(mlp, topo4, joints, kind):
    """A GPU rank issues each gradient bucket as soon as its gradients exist: its fused segments end
    at every bucket's launch (``cut_at_sync``; one group per bucket here), and training is
    unchanged."""
    K = mlp.num_groups
    groups = {
        "mixed": lambda: [GroupPlan([0, 1], [0.5, 0.5]) if g % 2 == 0 else GroupPlan([1, 2, 3], [0.25, 0.25, 0.5])
                          for g in range(K)],
        "ps-outside": lambda: [GroupPlan([0, 1], [0.625, 0.375], "ps", server=3) for _ in range(K)],
        "mp": lambda: mp_groups(mlp, lambda g: [g % 4, (g + 1) % 4]),
    }[kind]()
    plan = new_plan(mlp, topo4, groups)
    assert_matches_reference(mlp, plan, MLP, "adam", joints, cut_at_sync=True, bucket_bytes=1)
    rts = run_virtual(mlp, plan, load_workload(MLP, batch=B), "adam", 0, joints=joints.setdefault(MLP, {}),
                      cut_at_sync=True, bucket_bytes=1)
    sched = next(iter(rts.values())).schedule
    for r, rt in rts.items():
        syncs = [i for i, st in enumerate(sched.steps) if st.kind == "sync" and r in st.collective.members]
        for seg in rt.program.segments.values():  # no segment spans one of its rank's syncs
            assert not any(seg.steps[0] < i < seg.steps[-1] for i in syncs)


@pytest.mark.parametrize("cap", [1, "half", None])
def test_gradient_buckets_launch_at_their_last_group(mlp, topo4, joints, cap):
    """Buckets of one group each (cap 1 B), of about half the gradients, and DDP's (one bucket for
    this 0.6 MiB model): a GPU-like rank cuts its segments only where a bucket is launched (at its
    last group's sync), and training is unchanged, mixed replica sets and a parameter server
    included."""
    K = mlp.num_groups
    plans = {
        "dp": [GroupPlan([0, 1, 2], [0.5, 0.25, 0.25]) for _ in range(K)],
        "mixed": [GroupPlan([0, 1], [0.5, 0.5]) if g % 3 else GroupPlan([1, 2], [0.5, 0.5], "ps", server=3)
                  for g in range(K)],
    }
    if cap == "half":
        cap = sum(p.nbytes for p in mlp.params) // 2
    for groups in plans.values():
        plan = new_plan(mlp, topo4, groups)
        assert_matches_reference(mlp, plan, MLP, "adam", joints, cut_at_sync=True, bucket_bytes=cap)
        rts = run_virtual(mlp, plan, load_workload(MLP, batch=B), "adam", 0, joints=joints.setdefault(MLP, {}),
                          cut_at_sync=True, bucket_bytes=cap)
        sched = next(iter(rts.values())).schedule
        synced = [st.group for st in sched.steps if st.kind == "sync"]
        assert [g for b in sched.buckets for g in b.groups] == synced  # reverse group order, each once
        if cap == 1:
            assert len(sched.buckets) == len(synced)
        elif cap is None and groups is plans["dp"]:
            assert [b.groups for b in sched.buckets] == [tuple(synced)]
        for r, rt in rts.items():
            launches = [i for i, st in enumerate(sched.steps) if (b := sched.launched_at(st)) is not None
                        and r in b.collective.members]
            for seg in rt.program.segments.values():  # no segment spans a launch
                assert not any(seg.steps[0] < i < seg.steps[-1] for i in launches)
            if cap is None and groups is plans["dp"]:  # the syncs launching nothing cut nothing
                assert len(rt.program.segments) == 1


def test_single_device_plan_runs_as_one_segment_keeping_only_gradients(mlp, topo4, joints):
    """Every stage of a one-device plan is one generated module; once it ran, the rank holds only
    what the update and the loss need (no activation survives the backward)."""
    plan = new_plan(mlp, topo4, [GroupPlan([1], [1.0]) for _ in range(mlp.num_groups)])
    rt = run_virtual(mlp, plan, load_workload(MLP, batch=B), "adam", 1, joints=joints.setdefault(MLP, {}))[1]
    s = rt.schedule
    assert len(rt.program.segments) == 1
    seg = next(iter(rt.program.segments.values()))
    assert [(s.steps[i].unit, s.steps[i].phase) for i in seg.steps if s.steps[i].kind == "compute"] == \
        [(st.unit, st.phase) for st in s.steps if st.kind == "compute" and (st.unit, st.phase) in rt.stages]
    assert seg.name.startswith("fwd g0-") and " + bwd " in seg.name
    rt.begin_iteration()
    rt.run_segment(seg.start)
    grads = {(s.param_owner[ph], s.param_grad[ph]) for ph in rt.params}
    assert set(rt.env) == grads | {(s.loss_unit, s.loss)}
    rt.update()
    assert not rt.env and rt.loss > 0


def test_data_parallel_cpu_rank_is_one_segment_across_its_queued_syncs(mlp, topo4, joints):
    """A CPU rank only queues its syncs (they are issued after its compute): nothing to cut at."""
    plan = new_plan(mlp, topo4, [GroupPlan([0, 1], [0.5, 0.5]) for _ in range(mlp.num_groups)])
    rts = run_virtual(mlp, plan, load_workload(MLP, batch=B), "adam", 0, joints=joints.setdefault(MLP, {}))
    assert [len(rt.program.segments) for rt in rts.values()] == [1, 1]


def test_launch_arguments_are_detected_by_signature():
    """torch 2.11's LaunchConfig has no ``shutdown_timeout`` (``tag execute`` failed there with
    'unexpected keyword argument'): optional arguments the installed class lacks are left out."""
    from dataclasses import dataclass

    from torch.distributed.launcher.api import LaunchConfig

    from tag.executor.launch import supported_kwargs

    @dataclass
    class Old:  # the fields of torch 2.11's LaunchConfig that tag passes, without shutdown_timeout
        min_nodes: int
        max_nodes: int
        nproc_per_node: int
        run_id: str = ""

    required = {"min_nodes": 1, "max_nodes": 1, "nproc_per_node": 2, "run_id": "x"}
    assert supported_kwargs(Old, required, {"shutdown_timeout": 5}) == required
    Old(**supported_kwargs(Old, required, {"shutdown_timeout": 5}))
    assert supported_kwargs(lambda **kw: None, required, {"shutdown_timeout": 5})["shutdown_timeout"] == 5
    got = supported_kwargs(LaunchConfig, required, {"shutdown_timeout": 5, "no_such_argument": 1})
    assert "no_such_argument" not in got
    cfg = LaunchConfig(**got)  # the installed torch accepts what is detected
    import inspect

    if "shutdown_timeout" in inspect.signature(LaunchConfig).parameters:
        assert cfg.shutdown_timeout == 5


def test_random_plans_match_single_process_training(mlp, topo4, joints):
    """Random mixes of replica sets, shares, PS servers and mp splits, group by group."""
    rng = random.Random(7)
    for _ in range(6):
        groups = []
        for g in range(mlp.num_groups):
            kind = rng.choice(["allreduce", "ps", "mp"])
            lo, hi = group_positions(mlp, g)
            if kind == "mp" and hi - lo >= 2:
                devs = rng.sample(range(4), 2)
                cut = rng.randrange(lo + 1, hi)
                groups.append(GroupPlan(devs, [1.0, 1.0], "mp", mp_splits=[lo, cut]))
                continue
            devs = rng.sample(range(4), rng.randint(1, 4))
            w = [rng.uniform(0.2, 1.0) for _ in devs]
            shares = [x / sum(w) for x in w]
            shares[-1] = 1.0 - sum(shares[:-1])
            server = rng.randrange(4) if kind == "ps" else None
            groups.append(GroupPlan(devs, shares, "ps" if kind == "ps" else "allreduce", server=server))
        plan = new_plan(mlp, topo4, groups)
        validate_plan(plan, mlp, topo4)
        assert_matches_reference(mlp, plan, MLP, "sgd", joints)


@pytest.mark.parametrize("kind", ["dp-uneven", "ps", "mp"])
def test_gpt2_plans_match_single_process_training(captured, topo4, joints, kind):
    """Tied embeddings (a non-batch gradient crossing groups) and the mean loss's 1/count."""
    graph = captured(GPT2, batch=B, groups=4).graph
    K = graph.num_groups
    groups = {
        "dp-uneven": lambda: [GroupPlan([0, 1], [0.75, 0.25]) for _ in range(K)],
        "ps": lambda: [GroupPlan([1, 2], [0.5, 0.5], "ps", server=0) for _ in range(K)],
        "mp": lambda: mp_groups(graph, lambda g: [g % 2, 2 + g % 2]),
    }[kind]()
    plan = new_plan(graph, topo4, groups)
    assert_matches_reference(graph, plan, GPT2, "sgd", joints)


def test_batchnorm_model_finds_its_loss_and_trains_on_one_device(captured, topo4, joints):
    """BatchNorm's running-statistics updates are exported as outputs ahead of the model's own:
    the loss must still be the model's output (it was taken to be a running mean, and every plan
    of a BatchNorm model failed with 'the loss unit's backward does not read the loss')."""
    spec = "vgg:bn=true,width=8"
    graph = captured(spec, batch=B, groups=4).graph
    loss = graph.tensors[graph.loss]
    assert loss.batch_dim is None and loss.nbytes.at(B) == 4  # one fp32 scalar
    plan = new_plan(graph, topo4, [GroupPlan([1], [1.0]) for _ in range(graph.num_groups)])
    assert_matches_reference(graph, plan, spec, "sgd", joints)


def test_data_parallel_keeps_tied_gradient_partials_in_place(captured, topo4):
    """Tied embeddings: with every group on the same replicas, each replica keeps its partial of
    the tied weight's gradient (the sync sums them), so nothing crosses devices; when the
    consumer lives elsewhere, the partials are sent."""
    graph = captured(GPT2, batch=B, groups=4).graph
    K = graph.num_groups
    sched = build_schedule(graph, new_plan(graph, topo4, [GroupPlan([0, 1], [0.75, 0.25]) for _ in range(K)]))
    moves = [m for s in sched.steps for m in s.moves]
    assert [m for m in moves if m.mode == "sum"], "gpt2's tied weight gradient is a partial sum"
    assert all(m.src == m.dst for m in moves)
    groups = [GroupPlan([0, 1], [0.5, 0.5]) for _ in range(K)]
    groups[0] = GroupPlan([2], [1.0])  # the embedding's group elsewhere: the partials must travel
    sched = build_schedule(graph, new_plan(graph, topo4, groups))
    assert {(m.src, m.dst) for s in sched.steps for m in s.moves if m.mode == "sum"} == {(0, 2), (1, 2)}


def test_schedule_moves_cover_every_sample_once(mlp, topo4):
    groups = [GroupPlan([0, 1], [0.5, 0.5]) if g % 2 == 0 else GroupPlan([1, 2, 3], [0.25, 0.25, 0.5])
              for g in range(mlp.num_groups)]
    sched = build_schedule(mlp, new_plan(mlp, topo4, groups))
    transfers = [s for s in sched.steps if s.kind == "transfer"]
    assert transfers, "neighbouring groups on different device sets must exchange tensors"
    for st in transfers:
        by_dst: dict = {}
        for m in st.moves:
            if m.mode == "rows":
                by_dst.setdefault((m.name, m.dst), []).append((m.start, m.stop))
        for (_name, dst), ranges in by_dst.items():
            rep = sched.units[st.unit].replica_on(dst)
            ranges.sort()
            assert ranges[0][0] == rep.start and ranges[-1][1] == rep.stop
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    # Backward compute runs in reverse unit order after every forward.
    computes = [(s.unit, s.phase) for s in sched.steps if s.kind == "compute"]
    fwd = [u for u, p in computes if p == "fwd"]
    assert [u for u, p in computes if p == "bwd"] == fwd[::-1]


def test_partial_sums_are_weight_gradients_not_the_seed(captured):
    graph = captured(GPT2, batch=B, groups=4).graph
    sums = {graph.tensors[t].name for t in partial_sum_tensors(graph)}
    grads = {graph.tensors[p.grad].name for p in graph.params}
    assert grads & sums, "parameter gradients are sums over samples"
    seed = next(op for op in graph.ops if op.phase == "bwd" and graph.loss in op.inputs)
    assert graph.tensors[seed.outputs[0]].name not in sums


def test_too_few_samples_for_replicas_is_a_one_line_plan_error(mlp, topo4):
    plan = new_plan(mlp, topo4, [GroupPlan([0, 1, 2, 3], [0.25] * 4) for _ in range(mlp.num_groups)])
    plan.batch_size = 3
    with pytest.raises(PlanError, match=r"groups\[0\].devices: 4 replicas but batch 3"):
        build_schedule(mlp, plan)


# ------------------------------------------------------------------------------ SFB
WIDE = "mlp:hidden=512"  # 512x512 weights, 8 samples: the regime SFB is for


@pytest.fixture(scope="module")
def wide(captured):
    return captured(WIDE, batch=B, groups=4).graph


def sfb_plan(graph, topo, sfb: bool):
    """Uneven shares everywhere; group 1 all-SFB on 3 replicas (no sync left), group 2 on [2, 0]
    (sample order != group rank order) with one SFB op, group 3 PS with all but one SFB op."""
    from tag.compress import find_candidates

    ops: dict[int, list[str]] = {}
    for c in find_candidates(graph):
        ops.setdefault(c.group, []).append(c.op_name)
    assert len(ops.get(1, [])) >= 2 and len(ops.get(2, [])) >= 2 and len(ops.get(3, [])) >= 2, ops
    groups = [GroupPlan([0, 1, 2], [0.5, 0.3, 0.2]),
              GroupPlan([0, 1, 2], [0.5, 0.3, 0.2], sfb=ops[1] if sfb else []),
              GroupPlan([2, 0], [0.625, 0.375], sfb=ops[2][-1:] if sfb else []),
              GroupPlan([3, 1], [0.75, 0.25], "ps", server=1, sfb=ops[3][:-1] if sfb else [])]
    plan = new_plan(graph, topo, groups)
    validate_plan(plan, graph, topo)
    return plan


def test_sfb_plan_matches_single_process_training_and_the_plan_without_sfb(wide, topo4, joints):
    cache = joints.setdefault(WIDE, {})
    with_sfb = run_virtual(wide, sfb_plan(wide, topo4, True), load_workload(WIDE, batch=B), "sgd", 2, joints=cache)
    without = run_virtual(wide, sfb_plan(wide, topo4, False), load_workload(WIDE, batch=B), "sgd", 2, joints=cache)
    ref, _ = reference_training(load_workload(WIDE, batch=B), "sgd", 2)
    params = {rank: rt.named_params() for rank, rt in with_sfb.items()}
    assert_params_equal(params, ref, {p.name for p in wide.params}, exact=True)
    for rank, rt in with_sfb.items():
        assert_params_equal({rank: params[rank]}, without[rank].named_params())
        assert rt.timer.sfb_recompute > 0 and rt.timer.compute >= rt.timer.sfb_recompute


def test_sfb_schedule_gathers_after_the_backward_and_syncs_only_the_rest(wide, topo4):
    sched = build_schedule(wide, sfb_plan(wide, topo4, True))
    order = [(s.kind, s.unit[0]) for s in sched.steps if s.kind != "transfer"]
    for g in (1, 2, 3):
        i = order.index(("sfb", g))
        assert order[i - 1] == ("compute", g)  # right after the group's backward
        assert ("sync", g) not in order[:i]
    assert ("sync", 1) not in order, "every gradient of group 1 is SFB: nothing left to sync"
    assert order.index(("sync", 2)) == order.index(("sfb", 2)) + 1
    for g, sg in sched.sfb.items():
        assert set(sched.sync_params[g]) == set(sched.group_params[g]) - sg.params
        assert len({f.name for f in sg.factors}) == len(sg.factors)
    assert sched.gather_groups == [(0, 1, 2), (0, 2), (1, 3)]


def test_sfb_op_of_another_group_is_a_plan_error(wide, topo4):
    from tag.compress import find_candidates

    plan = sfb_plan(wide, topo4, False)
    plan.groups[2].sfb = [next(c.op_name for c in find_candidates(wide) if c.group == 3)]
    with pytest.raises(PlanError, match=r"groups\[2\].sfb: op .* is not an SFB candidate of this group"):
        build_schedule(wide, plan)


def test_local_batch_changing_the_graph_structure_is_refused(captured, topo4):
    """GPT-2 exported at batch 1 drops a few ops and renumbers the rest."""
    from tag.executor import ExecutionError, RankRuntime
    from tag.executor.runtime import export_at

    graph = captured(GPT2, batch=B, groups=4).graph
    groups = [GroupPlan([0], [1.0]) for _ in range(graph.num_groups - 1)] + [GroupPlan([0, 1], [0.875, 0.125])]
    sched = build_schedule(graph, new_plan(graph, topo4, groups))
    wl = load_workload(GPT2, batch=B)
    with pytest.raises(ExecutionError, match=r"^local batch 1 of group 3 changes the graph structure of gpt2.*; "
                                             r"give each replica at least 2 samples$") as info:
        RankRuntime(1, sched, tuple(wl.inputs), {1: export_at(wl.model, wl.make_inputs, 1)}, "sgd")
    assert "\n" not in str(info.value)


def test_packed_message_roundtrip():
    """Pieces of several dtypes and shapes (an empty one and a scalar included) packed into one
    message come back bit-identical as views of the receive buffer."""
    from tag.executor.comm import PACK_ALIGN, pack, packed_buffer

    g = torch.Generator().manual_seed(0)
    pieces = [torch.randn(3, 5, generator=g), torch.randint(0, 9, (7,), generator=g),
              torch.rand(2, 3, generator=g) > 0.5, torch.empty(0, 4), torch.tensor(2.5, dtype=torch.float64),
              torch.randn(4, 1, 3, generator=g).half()]
    flat = pack(pieces)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    buf, views = packed_buffer([(list(p.shape), p.dtype) for p in pieces], torch.device("cpu"))
    assert buf.numel() == flat.numel()
    buf.copy_(flat)  # what the transport does
    for p, v in zip(pieces, views):
        assert v.dtype == p.dtype and v.shape == p.shape
        assert torch.equal(v, p)
        assert (v.data_ptr() - buf.data_ptr()) % PACK_ALIGN == 0
    one = torch.arange(6.0)
    assert pack([one]) is one  # a single piece is sent as it is
    b1, (v1,) = packed_buffer([([6], torch.float32)], torch.device("cpu"))
    assert b1 is v1 and b1.shape == (6,)


def test_validation_report_measures_its_own_reproducibility():
    """The round-to-round Spearman is the median over pairs of rounds of the rank correlation
    between their measured times: rounds 0 and 1 agree (1), round 2 reverses both (-1, -1)."""
    from tag.executor.validate import ValidationRow, summarize_rows

    rounds = [[1.0, 1.1, 3.0], [2.0, 2.1, 2.0], [3.0, 3.2, 1.0], [4.0, 4.3, 0.5]]
    rows = [ValidationRow(f"p{i}", 1.0 + i, statistics.median(r), [], rounds_s=r) for i, r in enumerate(rounds)]
    report = summarize_rows("m", "t", rows, {})
    assert report.spearman == pytest.approx(1.0)
    assert report.round_spearman == pytest.approx(-1.0)
    assert "round-to-round Spearman" in report.table()
    single = summarize_rows("m", "t", [ValidationRow(r.name, r.predicted_s, r.measured_s, [], rounds_s=r.rounds_s[:1])
                                       for r in rows], {})
    assert math.isnan(single.round_spearman) and "round-to-round" not in single.table()



@pytest.mark.parametrize("kind", ["single", "dp-uneven"])
def test_fused_attention_is_one_op_and_trains_like_eager(topo4, kind):
    """F.scaled_dot_product_attention is captured as the fused kernel eager runs on this CPU
    (forward and backward, the backward reading the forward's output and logsumexp), not as the
    math path (bmm, softmax, NaN masking), and a plan of it trains as eager does."""
    from tag.graph import capture

    spec = ATTENTION
    graph = capture(load_workload(spec, batch=B), num_groups=4).graph
    targets = [o.target for o in graph.ops]
    fwd = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert targets.count(fwd) == 1
    assert targets.count("aten._scaled_dot_product_flash_attention_for_cpu_backward.default") == 1
    assert not [t for t in targets if base_name(t) in ("bmm", "_softmax", "any", "_safe_softmax")]
    op = next(o for o in graph.ops if o.target == fwd)
    # FLOPs: two bmm of [B * heads, 12, 8] x [.., 8, 12] (torch's SDPA formula), counted per
    # sample, over the 78 of 144 query-key pairs a causal attention computes
    assert op.flops.at(B) == pytest.approx(2 * (2 * B * 4 * 12 * 12 * 8) * 78 / 144)
    bwd = next(o for o in graph.ops if o.target.endswith("for_cpu_backward.default"))

    def reaches(t: int) -> set[int]:  # t and the aliases of it
        return {t} | {r for c in graph.tensors[t].consumers if graph.ops[c].target == "aten.alias.default"
                      for r in reaches(graph.ops[c].outputs[0])}

    items = [graph.ops[c].outputs[0] for c in graph.tensors[op.outputs[0]].consumers]  # output, logsumexp
    assert len(items) == 2 and all(reaches(t) & set(bwd.inputs) for t in items)
    groups = {"single": lambda: [GroupPlan([1], [1.0])] * graph.num_groups,
              "dp-uneven": lambda: [GroupPlan([0, 1], [0.75, 0.25])] * graph.num_groups}[kind]()
    plan = new_plan(graph, topo4, groups)
    validate_plan(plan, graph, topo4)
    # SGD: the key bias's gradient is zero in exact arithmetic, and Adam would turn the rounding
    # noise of a split batch into a full-size step
    assert_matches_reference(graph, plan, spec, "sgd", {})


@pytest.mark.parametrize(("spec", "heads", "head_dim"), [
    ("gpt2:n_layer=2,n_embd=32,n_head=2,seq=16,vocab=64", 2, 16),
    ("llama:n_layer=2,n_embd=32,n_head=4,n_kv_head=2,ffn=48,seq=16,vocab=64", 4, 8),
])
def test_zoo_sdpa_is_one_fused_op_per_layer_and_trains_like_eager(topo4, spec, heads, head_dim):
    """``attn=sdpa`` (Hugging Face's default attention): one fused attention forward and one
    backward per layer, causal (the constant mask folded into ``is_causal``, :mod:`tag.graph.masks`);
    the forward FLOPs are the eager attention's (its two bmm) less the masked half of the score
    matrix the fused kernel skips, the backward one score product more per layer (the fused
    backward recomputes the scores); a data-parallel plan of it trains as single-process
    autograd, which trains as the eager attention does."""
    from tag.executor import reference_training
    from tag.graph import capture

    sdpa, eager = f"{spec},attn=sdpa", f"{spec},attn=eager"
    graph = capture(load_workload(sdpa, batch=B), num_groups=4).graph
    ref_graph = capture(load_workload(eager, batch=B), num_groups=4).graph
    targets = [base_name(o.target) for o in graph.ops]
    assert targets.count("_scaled_dot_product_flash_attention_for_cpu") == 2
    assert targets.count("_scaled_dot_product_flash_attention_for_cpu_backward") == 2
    assert not [t for t in targets if t in ("bmm", "_softmax", "_safe_softmax")]
    attention = [o for o in graph.ops if base_name(o.target).startswith("_scaled_dot_product")]
    assert sorted(len(o.inputs) for o in attention) == [3, 3, 6, 6]  # q, k, v (+ grad, out, lse): no mask
    scores = 2 * B * heads * 16 * 16 * head_dim  # one [16, head_dim] x [head_dim, 16] product per head
    skipped = (1 - 17 / 32) * scores  # per product: the causal 16 x 16 triangle keeps 136 of 256 pairs
    assert graph.flops(("fwd",)) == ref_graph.flops(("fwd",)) - 2 * 2 * skipped  # 2 layers x 2 products
    assert graph.flops(("bwd",)) == ref_graph.flops(("bwd",)) + 2 * scores - 2 * 5 * skipped  # 5 products
    plan = new_plan(graph, topo4, [GroupPlan([0, 1], [0.75, 0.25])] * graph.num_groups)
    validate_plan(plan, graph, topo4)
    assert_matches_reference(graph, plan, sdpa, "sgd", {})
    fused, _ = reference_training(load_workload(sdpa, batch=B), "sgd", 2)
    ref, _ = reference_training(load_workload(eager, batch=B), "sgd", 2)
    assert_params_equal({0: fused}, ref)


def test_values_received_keep_the_layout_they_were_traced_with(captured, topo4, joints):
    """A fused attention's output is ``[B, H, L, D]`` laid out as ``[B, L, H, D]``; sent to another
    device it arrives contiguous, and GPT-2's ``transpose`` + ``view`` after it were traced on the
    producer's layout. Every group split in halves over two devices (``tag validate``'s
    ``mp-halves``, which failed there with "view size is not compatible") and data parallel with
    uneven rows train like one process; the layout helper copies only where the orders differ."""
    from tag.executor.runtime import in_layout

    spec = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab=100,seq=32,attn=sdpa"
    graph = captured(spec, batch=B, groups=8).graph
    for groups in (mp_groups(graph, lambda g: [0, 1]),
                   [GroupPlan([0, 1], [0.25, 0.75]) if g % 2 else GroupPlan([1], [1.0]) for g in range(8)]):
        assert_matches_reference(graph, new_plan(graph, topo4, groups), spec, "sgd", joints)
    like = torch.empty(2, 5, 3, 4).transpose(1, 2)  # [2, 3, 5, 4] laid out as [2, 5, 3, 4]
    t = torch.randn(2, 3, 5, 4)
    out = in_layout(t, like)
    assert torch.equal(out, t) and out.stride() == like.stride()
    assert in_layout(out, like) is out and in_layout(t, torch.empty(2, 3, 5, 4)) is t


def test_rank_runtime_declares_what_it_holds(captured, topo4):
    """Every attribute a rank's runtime keeps is a declared field (built by the builders of
    :mod:`tag.executor.runtime`), after it is made and after an iteration; one rank running the
    whole mlp steps its parameters and reads a finite loss."""
    from dataclasses import fields

    from tag.executor import RankRuntime
    from tag.executor.runtime import export_at

    graph = captured(MLP, batch=B, groups=4).graph
    sched = build_schedule(graph, new_plan(graph, topo4, [GroupPlan([0], [1.0]) for _ in range(graph.num_groups)]))
    wl = load_workload(MLP, batch=B)
    rt = RankRuntime(0, sched, tuple(wl.inputs), {B: export_at(wl.model, wl.make_inputs, B)}, "sgd")
    declared = {f.name for f in fields(rt)}
    assert set(vars(rt)) <= declared, set(vars(rt)) - declared
    before = {k: p.detach().clone() for k, p in rt.params.items()}
    rt.begin_iteration()
    for i, _ in enumerate(sched.steps):  # one rank: every step it runs is inside a segment
        rt.run_segment(i)
    rt.update()
    assert set(vars(rt)) <= declared, set(vars(rt)) - declared
    assert math.isfinite(rt.loss) and rt.loss > 0
    assert before and all(not torch.equal(before[k], p) for k, p in rt.params.items())
