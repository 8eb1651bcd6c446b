"""Tensor parallelism (Megatron-style, ``sync == "tp"``): block detection on the zoo's
transformers, plan checks, the simulator's costs, layouts with ``tp > 1``, and execution: after
2 steps the parameters of a tiny GPT-2 run 2-way tensor parallel equal single-process training on
the full batch (fp32, the executor's tolerance, rtol 1e-4 / atol 1e-6), in one process and on 2
gloo ranks.

The execution tests train with SGD (momentum): the gradient of attention's key bias is zero in
exact arithmetic (softmax over the keys ignores a constant added to every score of a query), so
its computed value is rounding noise that Adam normalises to a full-size step whose sign depends
on the summation order, which splitting the features changes (1e-5 differences); SGD checks
the rest exactly (4e-9 here)."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch

from tag.cli import main
from tag.cost.model import CostModel
from tag.errors import PlanError
from tag.executor.equality import assert_params_equal
from tag.parallel import execution_refusal, validate_plan
from tag.parallel.layout import Layout, layout_grid, layout_plan, parse_layout
from tag.parallel.tensor_parallel import (
    aligned_cuts,
    block_groups,
    group_split,
    megatron_blocks,
    weight_param,
)
from tag.plan import GroupPlan, PipelinePlan, Plan, new_plan
from tag.sim import simulate
from tag.topology import load_topology

GPT2 = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab=100,seq=16"
BERT = "bert:n_layer=2,n_embd=64,n_head=4,vocab=100,seq=16"
LLAMA = "llama:n_layer=2,n_embd=64,n_head=4,vocab=100,seq=16"


def _names(graph, block):
    """Module paths of a block's column and row weights (``...attn.c_attn``)."""
    def mod(op):
        for p in graph.params:
            if p.name.endswith("weight") and any(graph.tensors[t].kind == "param" and t == p.tensor
                                                 for t in _param_inputs(graph, op)):
                return p.name.rsplit(".", 1)[0].split("model.", 1)[-1]
        return None
    return [mod(c) for c in block.columns], mod(block.row)


def _param_inputs(graph, op):
    """Param tensors behind an op's inputs (through single-input producers)."""
    out = []
    for t in graph.ops[op].inputs:
        while graph.tensors[t].kind != "param" and graph.tensors[t].producer >= 0 and \
                graph.tensors[t].batch_dim is None:
            t = graph.ops[graph.tensors[t].producer].inputs[0]
        out.append(t)
    return out


BLOCK_NAMES = [
    (GPT2, (["transformer.h.{i}.attn.c_attn"], "transformer.h.{i}.attn.c_proj"),
     (["transformer.h.{i}.mlp.c_fc"], "transformer.h.{i}.mlp.c_proj")),
    (BERT, ([f"bert.encoder.layer.{{i}}.attention.self.{x}" for x in ("query", "key", "value")],
            "bert.encoder.layer.{i}.attention.output.dense"),
     (["bert.encoder.layer.{i}.intermediate.dense"], "bert.encoder.layer.{i}.output.dense")),
    (LLAMA, ([f"model.layers.{{i}}.self_attn.{x}_proj" for x in "qkv"], "model.layers.{i}.self_attn.o_proj"),
     ([f"model.layers.{{i}}.mlp.{x}_proj" for x in ("gate", "up")], "model.layers.{i}.mlp.down_proj")),
]
"""(spec, (attention's column weights, its row weight), (the MLP's column weights, its row weight))."""


@pytest.mark.parametrize("spec,attn,mlp", BLOCK_NAMES + [(f"{s},attn=sdpa", a, m) for s, a, m in BLOCK_NAMES])
def test_detects_the_megatron_blocks(captured, spec, attn, mlp):
    """Per layer an attention block (QKV column-parallel, output row-parallel, heads found from
    the scores, or with ``attn=sdpa`` from the fused kernel's logsumexp) and an MLP block (up /
    gate column-parallel, down row-parallel); the LM head, the embeddings and the norms are never
    split."""
    graph = captured(spec, batch=2, groups=4).graph
    blocks = megatron_blocks(graph)
    assert len(blocks) == 4
    for i in range(2):
        a, m = blocks[2 * i], blocks[2 * i + 1]
        cols, row = _names(graph, a)
        assert [c.split("model.", 1)[-1] for c in cols] == [c.format(i=i).split("model.", 1)[-1] for c in attn[0]]
        assert row.endswith(attn[1].format(i=i).split("model.", 1)[-1])
        cols, row = _names(graph, m)
        assert [c.split("model.", 1)[-1] for c in cols] == [c.format(i=i).split("model.", 1)[-1] for c in mlp[0]]
        assert row.endswith(mlp[1].format(i=i).split("model.", 1)[-1])
        assert a.features == 64 and a.heads == 4
        assert m.heads is None and m.features > 64
        # the all-reduces carry the block's activation: seq * hidden * 4 bytes per sample
        assert a.reduce_fwd.per_sample == m.reduce_fwd.per_sample == 16 * 64 * 4
    split = {graph.params[p].name for b in blocks for p in b.split_params}
    assert not any(("wte" in n or "embed" in n or "norm" in n or "ln_" in n or "lm_head" in n or "LayerNorm" in n)
                   for n in split)
    # every split parameter is in exactly one block; every owned one in its group's split
    assert len(split) == sum(len(b.split_params) for b in blocks)
    assert sum(group_split(graph, g).split_bytes for g in range(graph.num_groups)) == \
        sum(graph.params[p].nbytes for b in blocks for p in b.split_params)


def test_detection_in_bf16_and_on_a_plain_mlp(captured):
    graph = captured(GPT2, batch=2, groups=4, precision="bf16").graph
    blocks = megatron_blocks(graph)
    assert len(blocks) == 4 and blocks[0].reduce_fwd.per_sample == 16 * 64 * 2  # bf16 activations
    # a chain of Linear-ReLU layers pairs up (1, 2), (3, 4), ...: no weight both row and column split
    mlp = captured("mlp:layers=5,hidden=64,in_dim=32", batch=8, groups=4).graph
    bl = megatron_blocks(mlp)
    linears = [i for i in range(len(mlp.ops)) if weight_param(mlp, i) is not None]
    assert [op for b in bl for op in (*b.columns, b.row)] == linears[:2 * (len(linears) // 2)]
    assert len(bl) == len(linears) // 2 >= 2


@pytest.fixture(scope="module")
def gpt2(captured):
    return captured(GPT2, batch=8, groups=6).graph


@pytest.fixture(scope="module")
def v100():
    return load_topology("homogeneous-2x4-v100")


def _tp_plan(graph, topo, devices, tp=None, **kw):
    return new_plan(graph, topo, [GroupPlan(list(devices), [1 / len(devices)] * len(devices), sync="tp", tp=tp, **kw)
                                  for _ in range(graph.num_groups)])


def test_plan_checks(gpt2, v100):
    ok = _tp_plan(gpt2, v100, [0, 1, 2, 3])
    validate_plan(ok, gpt2, v100, tensor_parallel=True)
    validate_plan(_tp_plan(gpt2, v100, [0, 1, 4, 5], tp=2), gpt2, v100, tensor_parallel=True)
    # the executor runs the same tensor-parallel groups for the whole plan; any other: one line naming the field
    validate_plan(ok, gpt2, v100)
    validate_plan(_tp_plan(gpt2, v100, [0, 1, 2, 3], tp=2), gpt2, v100)
    shares = _tp_plan(gpt2, v100, [0, 1, 2, 3], tp=2)  # (its shares)
    shares.groups[1] = GroupPlan([0, 1, 2, 3], [0.3, 0.3, 0.2, 0.2], sync="tp", tp=2)
    refused = [(shares, r"groups\[1\]\.shares: the executor runs the same tensor-parallel groups for the whole "
                         r"plan; expected \[0\.25, 0\.25, 0\.25, 0\.25\], got \[0\.3, 0\.3, 0\.2, 0\.2\]"),
               (new_plan(gpt2, v100, ok.groups[:-1] + [GroupPlan([0, 1, 2, 3], [0.25] * 4)]),
                rf"groups\[{gpt2.num_groups - 1}\]\.sync: the executor runs tensor parallelism only when every group "
                r"is 'tp' \(group 0 is\); expected 'tp', got 'allreduce'")]
    other = _tp_plan(gpt2, v100, [0, 1])
    other.groups[0] = GroupPlan([2, 3], [0.5, 0.5], sync="tp")
    refused.append((other, r"groups\[1\]\.devices: the executor runs the same tensor-parallel groups for the whole "
                           r"plan; expected devices 2-3, got 0-1"))
    # a pipeline: one degree for every stage (device i of a stage's group sends to device i of the next's)
    piped = _tp_plan(gpt2, v100, [0, 1])
    piped.groups[3:] = [GroupPlan([4, 5, 6, 7], [0.25] * 4, sync="tp", tp=4) for _ in piped.groups[3:]]
    piped.pipeline = PipelinePlan([0, 3], 2)
    refused.append((piped, r"groups\[3\]\.tp: the executor runs one tensor-parallel degree in every pipeline stage "
                           r"\(device i of a stage's group sends to device i of the next's\); expected 2, got 4"))
    refused.append((_tp_plan(gpt2, v100, [0, 1], sequence_parallel=True),
                    r"groups\[0\]\.sequence_parallel: the executor runs plain Megatron \(every device of a "
                    r"tensor-parallel group on the group's whole batch outside the blocks\), not sequence "
                    r"parallelism; expected false"))
    degree = _tp_plan(gpt2, v100, [0, 1, 2, 3], tp=2)
    cut = max(aligned_cuts(gpt2))  # (a Megatron block's groups share one degree: validated before)
    degree.groups[cut:] = [GroupPlan([0, 1, 2, 3], [0.25] * 4, sync="tp", tp=4) for _ in degree.groups[cut:]]
    refused.append((degree, rf"groups\[{cut}\]\.tp: the executor runs the same tensor-parallel groups for the "
                            r"whole plan; expected 2, got 4"))
    mixed_stage = layout_plan(gpt2, v100, Layout(dp=1, tp=4, pp=2, micro=2), CostModel.for_topology(gpt2, v100))
    mixed_stage.groups[-1] = dataclasses.replace(mixed_stage.groups[-1], tp=2)
    assert execution_refusal(mixed_stage) == (
        f"groups[{gpt2.num_groups - 1}].tp: the executor runs the same tensor-parallel groups for the whole "
        "pipeline stage; expected 4, got 2")
    for plan, message in refused:  # the one predicate, and the executor's check raising it
        assert re.fullmatch(message, execution_refusal(plan))
        with pytest.raises(PlanError, match="^plan: " + message + "$"):
            validate_plan(plan, gpt2, v100)
    dp_pipe = new_plan(gpt2, v100, [GroupPlan([0, 1], [0.5, 0.5]) for _ in range(3)]
                       + [GroupPlan([2, 3], [0.5, 0.5], "ps", server=2) for _ in range(3)])
    dp_pipe.pipeline = PipelinePlan([0, 3], 2)
    tp_pipe = layout_plan(gpt2, v100, Layout(dp=2, tp=2, pp=2, micro=2), CostModel.for_topology(gpt2, v100))
    for plan in (ok, _tp_plan(gpt2, v100, [0, 1, 4, 5], tp=2), dp_pipe, tp_pipe):  # what the executor runs
        assert execution_refusal(plan) is None
        validate_plan(plan, gpt2, v100)
    validate_plan(_tp_plan(gpt2, v100, [0, 1], sequence_parallel=True), gpt2, v100, tensor_parallel=True)
    bad = [
        (_tp_plan(gpt2, v100, [0]), r"groups\[0\]\.tp: expected a tensor-parallel degree of 2\.\.8, got 1"),
        (_tp_plan(gpt2, v100, [0, 1, 2], tp=2), r"groups\[0\]\.tp: 3 devices are not groups of 2"),
        (_tp_plan(gpt2, v100, [2, 3, 4, 5]), r"groups\[0\]\.devices: tensor-parallel group \[2, 3, 4, 5\] spans "
                                             r"machines"),
        (_tp_plan(gpt2, v100, list(range(8))), r"groups\[0\]\.tp: block ending at '.*' has 4 attention heads, not "
                                               r"divisible by 8"),
        (_tp_plan(gpt2, v100, [0, 1, 2], tp=3), r"groups\[\d\]\.tp: block ending at '.*' has 64 split features, not "
                                                r"divisible by 3"),
        (_tp_plan(gpt2, v100, [0, 1, 2, 3], mp_splits=[0, 1, 2, 3]), r"groups\[0\]\.mp_splits: only allowed with "
                                                                        r"sync 'mp'"),
    ]
    uneven = _tp_plan(gpt2, v100, [0, 1, 2, 3], tp=2)
    uneven.groups[0].shares = [0.3, 0.2, 0.25, 0.25]
    bad.append((uneven, r"groups\[0\]\.shares: the 2 devices of tensor-parallel group \[0, 1\] hold equal"))
    on_dp = new_plan(gpt2, v100, [GroupPlan([0, 1], [0.5, 0.5], tp=2) for _ in range(gpt2.num_groups)])
    bad.append((on_dp, r"groups\[0\]\.tp: only allowed with sync 'tp'"))
    sp_dp = new_plan(gpt2, v100, [GroupPlan([0, 1], [0.5, 0.5], sequence_parallel=True)
                                  for _ in range(gpt2.num_groups)])
    bad.append((sp_dp, r"groups\[0\]\.sequence_parallel: only allowed with sync 'tp'; expected false, got true$"))
    # a block split over two op-groups: both tensor parallel over the same devices
    straddle = next(b for b in megatron_blocks(gpt2) if len(block_groups(gpt2, b)) > 1)
    mixed = _tp_plan(gpt2, v100, [0, 1])
    g2 = block_groups(gpt2, straddle)[-1]
    mixed.groups[g2] = GroupPlan([0, 1], [0.5, 0.5])
    bad.append((mixed, rf"groups\[{g2}\]: the Megatron block ending at .* spans groups .*; expected sync 'tp' over "
                       "the same devices"))
    variants = _tp_plan(gpt2, v100, [0, 1])
    variants.groups[g2] = GroupPlan([0, 1], [0.5, 0.5], sync="tp", sequence_parallel=True)
    bad.append((variants, rf"groups\[{g2}\]: the Megatron block ending at .* spans groups .*; expected sync 'tp' "
                          "over the same devices and degree, with or without sequence parallelism alike"))
    for plan, message in bad:
        with pytest.raises(PlanError, match="^plan: " + message):
            validate_plan(plan, gpt2, v100, tensor_parallel=True)


def test_plan_files_keep_their_format(gpt2, v100, tmp_path):
    """Plans without tensor parallelism are written as before (no ``tp`` key); ``tp`` round-trips."""
    from tag.cost.baselines import data_parallel

    dp = data_parallel(gpt2, v100)
    assert all("tp" not in g for g in json.loads(dp.to_json())["groups"])
    plan = _tp_plan(gpt2, v100, [0, 1, 2, 3], tp=2)
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back.groups[0].tp == 2 and back.groups[0].sync == "tp" and back.to_dict() == plan.to_dict()
    assert all("sequence_parallel" not in g for g in json.loads(plan.to_json())["groups"])  # plain: the default
    seq = _tp_plan(gpt2, v100, [0, 1, 2, 3], tp=2, sequence_parallel=True)
    seq.save(tmp_path / "sp.json")
    back = Plan.load(tmp_path / "sp.json")
    assert back.groups[0].sequence_parallel is True and back.to_dict() == seq.to_dict()
    assert back.groups[0].key() != plan.groups[0].key()
    d = plan.to_dict()
    d["groups"][0]["tp"] = "two"
    with pytest.raises(PlanError, match=r"groups\[0\]\.tp: expected an integer"):
        Plan.from_dict(d)
    d = seq.to_dict()
    d["groups"][1]["sequence_parallel"] = 1
    with pytest.raises(PlanError, match=r"groups\[1\]\.sequence_parallel: expected true or false, got 1$"):
        Plan.from_dict(d)


def test_simulated_costs(gpt2, v100):
    """Sequence-parallel tensor parallelism over T devices of one machine against data parallel
    over the same devices: the same token shards (compute, less the split weights' bytes: a rank
    reads 1 / T of each), the split parameters' bytes divided by T on every device, per block a
    blocking all-reduce in forward and in backward (zero on infinitely fast links)."""
    from tag.sim import Simulator
    from tag.sim.tensor_parallel import _interior_fixed

    devs = [0, 1, 2, 3]
    dp = new_plan(gpt2, v100, [GroupPlan(devs, [0.25] * 4) for _ in range(gpt2.num_groups)])
    tp = _tp_plan(gpt2, v100, devs, sequence_parallel=True)
    costs = CostModel.for_topology(gpt2, v100)
    # One bucket per group (bucket_bytes=1): a tensor-parallel group's sync is never bucketed, so
    # the plans differ in the split parameters' state and in their largest sync buffer: a group's
    # gradients, a tensor-parallel device's its shard of the split ones.
    rd = simulate(gpt2, v100, dp, costs=costs, bucket_bytes=1)
    rt = simulate(gpt2, v100, tp, costs=costs, bucket_bytes=1)
    split = sum(group_split(gpt2, g).split_state for g in range(gpt2.num_groups))
    assert split > 0
    sim = Simulator(gpt2, v100, costs)
    gd_dp, gd_tp = sim.deploy(dp.groups), sim.deploy(tp.groups)
    grads = sim.static.grad_bytes
    shard = [grads[g] - 0.75 * group_split(gpt2, g).split_bytes for g in range(gpt2.num_groups)]
    assert [gd.sync_bytes for gd in gd_tp if gd.sync == "tp"] == pytest.approx(
        [b for gd, b in zip(gd_tp, shard) if gd.sync == "tp"])
    saved = rd.peak_memory_bytes[0] - rt.peak_memory_bytes[0]
    assert saved == pytest.approx(0.75 * split + max(grads) - max(gd.sync_bytes for gd in gd_tp), rel=1e-6)
    comm = costs.comm
    # [K] a rank's forward on the device (its launches are the host's: CostModel.host_parts), its 2 samples
    rank = costs.host_parts(0, _interior_fixed(gpt2, 4), [2]).device[:, 0, 0]
    whole = costs.host_parts(0).device
    lesses = []
    for g in range(gpt2.num_groups):
        s = group_split(gpt2, g)
        extra_f = gd_tp[g].layout.dur[0, g] - gd_dp[g].layout.dur[0, g]
        want = sum(comm.allreduce_time(devs, a.at(8), "flat") for a in s.reduce_fwd)
        less = whole[g, 0, 2] - rank[g]  # the split weights' bytes a rank does not read
        assert extra_f == pytest.approx([want - less] * 4, abs=1e-12)
        assert abs(less) < 1e-12 or s.blocks
        lesses.append(less)
        assert (want > 0) == bool(s.reduce_fwd)
        # only the replicated parameters' partial gradients are all-reduced
        rest = float(sim.static.grad_bytes[g]) - s.split_bytes
        assert gd_tp[g].sync_time == pytest.approx(comm.allreduce_time(devs, rest) if rest > 0 else 0.0)
    assert sum(lesses) > 0
    assert rt.iteration_time_s > 0 and not rt.oom
    # two data-parallel replicas of 2-way tensor parallelism, one per machine: the split
    # parameters' gradients also cross the network, between the replicas holding the same shard
    both = sim.deploy(_tp_plan(gpt2, v100, [0, 1, 4, 5], tp=2, sequence_parallel=True).groups)
    for g in range(gpt2.num_groups):
        s = group_split(gpt2, g)
        rest = float(sim.static.grad_bytes[g]) - s.split_bytes
        want = (comm.allreduce_time([0, 1, 4, 5], rest) if rest > 0 else 0.0) + \
            (comm.allreduce_time([0, 4], s.split_bytes) if s.split_bytes > 0 else 0.0)
        assert both[g].sync_time == pytest.approx(want) and (want > 0) == (both[g].sync == "tp")
        assert both[g].sync_machines == ((0, 1) if want > 0 else ())


def test_plain_megatron_against_sequence_parallel(gpt2, v100):
    """The variant the executor runs (plain Megatron, the default) against the sequence-parallel one
    on the same devices: the same block collectives and split state; outside the blocks every
    device computes, and holds activations for, its tensor-parallel group's whole batch (more
    compute and memory); replicated parameters' gradients are identical within a group, so only
    the replicas holding the same shard sum gradients (no sync with one replica)."""
    from tag.parallel.tensor_parallel import base_name, block_interior
    from tag.sim import Simulator
    from tag.sim.tensor_parallel import _interior_fixed

    blocks = megatron_blocks(gpt2)
    inner = block_interior(gpt2)
    kinds = {"fwd": set(), "bwd": set()}
    for i in inner.ops:
        kinds[gpt2.ops[i].phase].add(base_name(gpt2.ops[i].target))
    assert all({*b.columns, b.row} <= inner.ops for b in blocks)
    assert {"addmm", "bmm", "_softmax"} <= kinds["fwd"] and {"mm", "bmm", "_softmax_backward_data"} <= kinds["bwd"]
    assert not any("layer_norm" in k or "embedding" in k or "log_softmax" in k for k in kinds["fwd"] | kinds["bwd"])
    assert sum(gpt2.ops[i].target == "aten.mm.default" for i in inner.ops) == 4 * len(blocks)  # 2 grads x 2 matmuls
    assert {gpt2.params[p].tensor for b in blocks for p in b.split_params} <= inner.tensors
    assert not {gpt2.ops[b.row].outputs[0] for b in blocks} & inner.tensors  # all-reduced: full

    # four CPU devices costed by the roofline (the datasheet V100's tiny-model stages are launch-bound:
    # the same seconds at 2 and 8 samples)
    cpu4 = load_topology("local-cpu4")
    costs = CostModel.roofline_only(gpt2, cpu4)
    sim = Simulator(gpt2, cpu4, costs)
    comm = costs.comm
    devs = [0, 1, 2, 3]  # one group of 4: 2 samples per device's shard, 8 for the group
    plain = sim.deploy(_tp_plan(gpt2, cpu4, devs).groups)
    seq = sim.deploy(_tp_plan(gpt2, cpu4, devs, sequence_parallel=True).groups)
    more = 0.0
    rank = costs.split_at(0, _interior_fixed(gpt2, 4), [2])[:, :, 0]  # a rank's 2 samples, 1 / 4 of the split weights
    for g in range(gpt2.num_groups):
        lp, ls = plain[g].layout, seq[g].layout
        s = group_split(gpt2, g)
        for ph, name in ((0, "fwd"), (1, "bwd")):
            comm_s = sum(comm.allreduce_time(devs, a.at(8), "flat") for a in (s.reduce_fwd if ph == 0 else s.reduce_bwd))
            small, big = rank[g, ph], costs.group_time(g, name, 0, 8)
            compute = lp.dur[ph, g] - comm_s
            assert (compute >= ls.dur[ph, g] - comm_s - 1e-12).all()
            if s.blocks:  # block ops at the shard's cost, the rest at the group's
                assert (compute >= small - 1e-12).all() and (compute <= big + 1e-12).all()
            else:
                assert compute == pytest.approx([big] * 4)
            more += float((compute - (ls.dur[ph, g] - comm_s)).sum())
        assert lp.dur[2, g] == pytest.approx(ls.dur[2, g])  # the same split optimizer state
        assert (lp.mem[g] >= ls.mem[g]).all()
        assert plain[g].sync == "none" and plain[g].sync_time == 0.0
        rest = float(sim.static.grad_bytes[g]) - s.split_bytes
        assert (seq[g].sync_time > 0) == (rest > 0)
    assert more > 0
    rp = simulate(gpt2, cpu4, _tp_plan(gpt2, cpu4, devs), costs=costs)
    rs = simulate(gpt2, cpu4, _tp_plan(gpt2, cpu4, devs, sequence_parallel=True), costs=costs)
    assert rp.peak_memory_bytes[0] > rs.peak_memory_bytes[0]
    costs = CostModel.for_topology(gpt2, v100)
    sim, comm = Simulator(gpt2, v100, costs), costs.comm
    # two replicas of 2-way groups: each shard's gradients (split part and the whole replicated
    # part) summed over the 2 replicas holding it, the 2 rings priced as one over the replicas' leads
    both = sim.deploy(_tp_plan(gpt2, v100, [0, 1, 4, 5], tp=2).groups)
    for g in range(gpt2.num_groups):
        s = group_split(gpt2, g)
        rest = float(sim.static.grad_bytes[g]) - s.split_bytes
        want = comm.allreduce_time([0, 4], s.split_bytes + 2 * rest) if s.split_bytes + rest > 0 else 0.0
        assert both[g].sync_time == pytest.approx(want) and both[g].sync_machines == ((0, 1) if want > 0 else ())


def test_layouts_with_tensor_parallelism(gpt2, v100):
    assert parse_layout("dp=2,tp=4") == Layout(dp=2, tp=4)
    assert parse_layout("dp=2,tp=4,sp=1") == Layout(dp=2, tp=4, sp=1)
    with pytest.raises(PlanError, match=r"^layout: sp: sequence parallelism needs tensor parallelism; expected tp > 1"):
        parse_layout("dp=8,sp=1")
    with pytest.raises(PlanError, match=r"^layout: tp: expected a tensor-parallel degree of 1\.\.8, got 16$"):
        parse_layout("tp=16")
    costs = CostModel.for_topology(gpt2, v100)
    plan = layout_plan(gpt2, v100, Layout(dp=2, tp=2, pp=2, micro=2), costs)
    validate_plan(plan, gpt2, v100, pipelines=True, tensor_parallel=True)
    assert all(g.sync == "tp" and g.tp == 2 and len(g.devices) == 4 and not g.sequence_parallel for g in plan.groups)
    sp = layout_plan(gpt2, v100, Layout(dp=2, tp=2, pp=2, micro=2, sp=1), costs)
    assert all(g.sequence_parallel for g in sp.groups) and sp.meta["layout"].endswith(",sp=1")
    cut = plan.pipeline.stages[1]
    assert cut in aligned_cuts(gpt2)  # no Megatron block cut by the stages
    assert plan.groups[0].devices == [0, 1, 2, 3] and plan.groups[-1].devices == [4, 5, 6, 7]
    assert simulate(gpt2, v100, plan).iteration_time_s > 0
    grid = layout_grid(gpt2, v100)
    assert {g.tp for g in grid} == {1, 2, 4}  # 8 would span the 4-GPU machines
    assert {(g.tp > 1, g.sp) for g in grid} == {(False, 0), (True, 0), (True, 1)}  # both variants of tp
    # a sample per replica and micro-batch, its tensor-parallel devices computing the same ones
    assert all(g.dp * g.tp * g.pp == 8 and g.micro * g.dp <= 8 for g in grid)
    assert Layout(dp=2, tp=2, pp=2, micro=4) in grid and Layout(dp=1, tp=4, pp=2, micro=8) in grid
    with pytest.raises(PlanError, match=r"^layout: micro: 8 micro-batches over dp = 2 replicas need at least 16 "
                                        r"samples, batch is 8$"):
        layout_plan(gpt2, v100, Layout(dp=2, tp=2, pp=2, micro=8), costs)


def test_replicas_of_one_sample(gpt2, v100):
    """Micro-batches smaller than the tensor-parallel degree (plain Megatron): each
    tensor-parallel group is one sample replica (its devices hold the same range), costed on
    1 / T of its samples inside the blocks (fractional: the cost rule at that batch, the split
    weights' bytes 1 / T) and the whole of them outside; a pipeline holds its in-flight
    micro-batches' activations likewise. Sequence parallelism keeps a token shard per device: a
    sample each."""
    from tag.parallel.strategy import strategy_of, validate_group
    from tag.parallel.tensor_parallel import executed_plan
    from tag.sim import Simulator
    from tag.sim.tensor_parallel import _interior_fixed, _outside_saved_per_sample

    costs = CostModel.for_topology(gpt2, v100)
    plan = layout_plan(gpt2, v100, Layout(dp=2, tp=2, pp=2, micro=4), costs)  # 2 samples per micro-batch
    validate_plan(plan, gpt2, v100, pipelines=True, tensor_parallel=True)
    gp = plan.groups[0]
    (unit,) = strategy_of(gp).units(0, gp, gpt2, 2)
    assert [tuple(r) for r in unit.replicas] == [(0, 0, 1), (1, 0, 1), (2, 1, 2), (3, 1, 2)]
    res = simulate(gpt2, v100, plan, costs=costs)
    assert res.iteration_time_s > 0 and not res.oom
    with pytest.raises(PlanError, match=r"^layout: micro: 4 micro-batches over dp\*tp = 4 token shards need at least "
                                        r"16 samples, batch is 8$"):
        layout_plan(gpt2, v100, Layout(dp=2, tp=2, pp=2, micro=4, sp=1), costs)
    # a replica's share is the sum of its devices' shares, rounded per replica as the executor
    # runs it (per device, 6 samples over 4 devices were 2, 2, 1, 1: groups of 4 and 2)
    four = GroupPlan([0, 1, 2, 3], [0.25] * 4, sync="tp", tp=2)
    (unit,) = strategy_of(four).units(0, four, gpt2, 6)
    assert [tuple(r) for r in unit.replicas] == [(0, 0, 3), (1, 0, 3), (2, 3, 6), (3, 3, 6)]
    assert executed_plan(new_plan(gpt2, v100, [four] * gpt2.num_groups)).groups[0].shares == [0.5, 0.5]
    # more replicas than samples: one line
    eight = GroupPlan(list(range(8)), [1 / 8] * 8, sync="tp", tp=2)
    validate_group(eight, gpt2, 0, 8, "g", batch_size=4)
    with pytest.raises(PlanError, match=r"^g\.devices: 4 replicas but batch 3; every replica needs at least one "
                                        r"sample$"):
        validate_group(eight, gpt2, 0, 8, "g", batch_size=3)
    eight.sequence_parallel = True
    with pytest.raises(PlanError, match=r"^g\.devices: 8 replicas but batch 4; "):
        validate_group(eight, gpt2, 0, 8, "g", batch_size=4)
    sim = Simulator(gpt2, v100, costs)
    static, k = sim.static, gpt2.num_groups
    tab = sim.tables[sim.dev_class[0]]
    outside = _outside_saved_per_sample(gpt2, static)
    gds = [sim.group_data(g, GroupPlan([0, 1], [0.5, 0.5], sync="tp"), batch=1) for g in range(k)]
    lay = gds[0].layout
    assert lay.batches == (1, 1) and lay.starts == (0, 0) and lay.compute == (0.5, 0.5)
    # half a sample, 1 / 2 of the split weights, on the device (sim.tables: the device's seconds)
    rank = costs.host_parts(0, _interior_fixed(gpt2, 2), [0.5]).device[:, :2, 0]
    below = []
    for g in range(k):
        s = group_split(gpt2, g)
        comm = [sum(costs.comm.tensor_parallel_time([0, 1], [a.at(1)]) for a in x) for x in (s.reduce_fwd, s.reduce_bwd)]
        compute = lay.dur[:2, g, 0] - comm
        if s.blocks:
            assert (compute >= rank[g] - 1e-12).all() and (compute <= tab[g, :2, 1] * (1 + 1e-12)).all()
            below.append(bool((compute < tab[g, :2, 1] * (1 - 1e-4)).any()))
        else:
            assert compute == pytest.approx(tab[g, :2, 1], rel=1e-12)
        assert lay.saved[g] == pytest.approx([(static.mem_per_sample[g] + outside[g]) * 0.5] * 2)
    assert any(below)
    # one stage on 8 micro-batches of 1 sample: GPipe holds 7 micro-batches' saved activations
    # more than 1F1B (one in flight), each at half a sample inside the blocks, a sample outside
    groups = [GroupPlan([0, 1], [0.5, 0.5], sync="tp") for _ in range(k)]
    gpipe, f1b1 = (sim.run(groups, pipeline=PipelinePlan([0], 8, s)) for s in ("gpipe", "1f1b"))
    assert gpipe.peak_memory_bytes[0] - f1b1.peak_memory_bytes[0] == pytest.approx(7 * lay.saved[:, 0].sum())


def test_simulate_a_tensor_parallel_layout(capsys):
    args = ["simulate", "--model", GPT2, "--batch", "8", "--groups", "6", "--topology", "homogeneous-2x4-v100"]
    assert main(args + ["--layout", "dp=2,tp=4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"] == "layout:dp=2,tp=4" and out["iteration_time_s"] > 0
    assert main(args + ["--layout", "tp=8"]) == 2  # 4 heads, 8 devices
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4 attention heads, not divisible by 8" in err[0]


def test_the_planner_proposes_tensor_parallelism_where_it_pays(captured, tmp_path, capsys):
    """One machine of four small GPUs on fast links, too small for the model's state on one
    device: data parallel does not fit, a pipeline idles in its bubble, splitting every layer
    pair four ways fits and keeps every GPU busy. ``find_plan`` (``pipelines="auto"``: ``tp``
    actions in the search space) finds a tensor-parallel plan, faster than TAG's action space
    alone, than every layout without tensor parallelism, and as fast as the best plain tensor-parallel
    layout, unconstrained (``executable=False``) or by default (``tag plan`` too: the whole-plan
    ``tp`` plan the executor runs). ``tag plan --allow-unexecutable --pipelines grid`` returns the
    grid's sequence-parallel layout and says the executor refuses it."""
    import yaml

    from tag.planner import PlannerConfig, find_plan
    from tag.sim import Simulator

    graph = captured("mlp:layers=4,hidden=2048,in_dim=2048", batch=512, groups=8).graph
    state = sum(p.nbytes for p in graph.params) * 4  # weights, gradients, two Adam moments
    gpu = {"name": "small", "tflops": 14, "memory": f"{int(state * 0.75)} B", "memory_bandwidth": "900 GB/s"}
    path = tmp_path / "one-by-four.yaml"
    path.write_text(yaml.safe_dump({"name": "one-by-four", "network": {"bandwidth": "10 Gbit/s"}, "machines": [
        {"name": "m", "gpu": gpu, "count": 4, "intra_bandwidth": "300 GB/s"}]}))
    topo = load_topology(path)
    searched = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=100, pipelines="off", compression="off"))
    best = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=100, compression="off", executable=False))
    # every group tensor parallel: data parallel over the same devices beside the tp groups (faster
    # at fcbba72) pays an all-gather entering each tp group, whose devices compute the same samples
    # (unconstrained, the grid after the search may return its faster sequence-parallel layout)
    assert best.meta["source"] in ("search", "layout-grid") and sum(g.sync == "tp" for g in best.groups) >= 4
    validate_plan(best, graph, topo, pipelines=True, tensor_parallel=True)
    assert searched.predicted_iteration_time_s is None or \
        best.predicted_iteration_time_s < searched.predicted_iteration_time_s
    res = simulate(graph, topo, best)
    assert not res.oom and res.iteration_time_s == pytest.approx(best.predicted_iteration_time_s)
    # the best layout without tensor parallelism is slower
    sim = Simulator(graph, topo)
    no_tp = [lay for lay in layout_grid(graph, topo) if lay.tp == 1]
    costs = CostModel.for_topology(graph, topo)
    times = [sim.run(p.groups, pipeline=p.pipeline) for p in (layout_plan(graph, topo, lay, costs) for lay in no_tp)]
    assert min(r.iteration_time_s for r in times if not r.oom) > best.predicted_iteration_time_s
    # as fast as the best plain tensor-parallel layout (the variant the search proposes and the
    # executor runs; the grid's sequence-parallel layouts are simulated only)
    plain = [lay for lay in layout_grid(graph, topo) if lay.tp > 1 and not lay.sp]
    runs = [sim.run(p.groups, pipeline=p.pipeline) for p in (layout_plan(graph, topo, lay, costs) for lay in plain)]
    grid = min(r.iteration_time_s for r in runs if not r.oom)
    assert best.predicted_iteration_time_s <= grid
    # by default only what the executor runs: every group tp alike, as fast as the plain layouts
    runs_ = find_plan(graph, topo, PlannerConfig(prior="uniform", budget=100, compression="off"))
    assert execution_refusal(runs_) is None and {g.sync for g in runs_.groups} == {"tp"}
    validate_plan(runs_, graph, topo)  # tag execute's check
    assert runs_.predicted_iteration_time_s <= grid
    # tag plan: the executable plan by default; --allow-unexecutable with the grid: its faster
    # sequence-parallel layout, and it says it is simulated only
    argv = ["plan", "--model", "mlp:layers=4,hidden=2048,in_dim=2048", "--batch", "512", "--groups", "8",
            "--topology", str(path), "--prior", "uniform", "--budget", "100", "--compression", "off"]
    out = tmp_path / "plan.json"
    assert main(argv + ["--out", str(out)]) == 0
    assert execution_refusal(Plan.load(out)) is None and "simulated only" not in capsys.readouterr().out
    assert main(argv + ["--out", str(out), "--force", "--allow-unexecutable", "--pipelines", "grid"]) == 0
    printed = capsys.readouterr().out
    why = execution_refusal(Plan.load(out))
    assert why is not None and f"simulated only: tag execute refuses this plan ({why})" in printed


# ---- execution ---------------------------------------------------------------------------------

def _assert_full_params(params, ref, graph):
    assert_params_equal({0: params}, ref, {p.name for p in graph.params})


@pytest.mark.parametrize("spec,batch,groups,devices", [(GPT2, 8, 6, [0, 1, 2, 3]), (LLAMA, 2, 4, [0, 1]),
                                                        (LLAMA, 1, 4, [0, 1])])
def test_tensor_parallel_training_in_one_process(captured, v100, spec, batch, groups, devices):
    """Every device in one process (threads all-reduce): shards of half the split parameters, an
    all-reduce after each row matmul and each column input gradient (Llama: q, k, v and gate, up
    each have theirs), the loss reported once per tensor-parallel group. GPT-2: fused QKV, blocks
    straddling op-groups, 2 data-parallel replicas of 2-way tensor parallelism (gradients summed
    over the devices holding the same shard); Llama: rotary embeddings (a slice's gradient padded
    with zeros), SiLU's backward constants; at a batch of one sample, which both devices compute
    (a tensor-parallel group is one sample replica)."""
    from tag.executor import reference_training, run_virtual
    from tag.workloads import load_workload

    graph = captured(spec, batch=batch, groups=groups).graph
    plan = _tp_plan(graph, v100, devices, tp=2)
    rts = run_virtual(graph, plan, load_workload(spec, batch=batch), "sgd", 2)
    assert sorted(rts) == devices and [rt.rank for rt in rts.values()] == [d - d % 2 for d in devices]
    blocks = megatron_blocks(graph)
    split = {graph.params[p].name for b in blocks for p in b.split_params}
    for rt in rts.values():
        assert set(rt.hook.kept) == split
        assert len(rt.hook.boundaries) == sum(1 + len(b.columns) for b in blocks)
        for p in graph.params:
            held = rt.named_params()[p.name].numel()
            assert held == (p.numel // 2 if p.name in split else p.numel), p.name
    if spec == GPT2:  # the fused c_attn: each shard keeps the same heads of q, k and v
        cols = rts[1].hook.kept["model.transformer.h.0.attn.c_attn.weight"][1].tolist()
        assert cols == [*range(32, 64), *range(96, 128), *range(160, 192)]
    ref, losses = reference_training(load_workload(spec, batch=batch), "sgd", 2)
    for lead in devices[::2]:  # each tensor-parallel group holds the full parameters
        pair = [rts[lead], rts[lead + 1]]
        _assert_full_params(pair[0].hook.full_params([(rt.named_params(), rt.hook.kept) for rt in pair]), ref, graph)
        assert pair[1].loss == 0.0
    assert sum(rt.loss for rt in rts.values()) == pytest.approx(losses[-1], rel=1e-5)


def _assert_pipeline_params(full_by_group, ref, graph):
    """Each tensor-parallel group's full parameters (its stage's) equal ``ref``; every parameter held."""
    assert_params_equal(dict(enumerate(full_by_group)), ref, {p.name for p in graph.params})


def test_pipeline_of_tensor_parallel_stages_in_one_process(captured, topo4):
    """``tp=2,pp=2,micro=2`` (Megatron's layout) on 4 devices: each stage's 2 devices split its
    blocks, device i of stage 0 sends its full activations to device i of stage 1 (and the
    gradients back), gradients accumulated over the micro-batches; after 2 steps each stage's
    parameters, gathered from its shards, equal single-process training, the loss reported once."""
    from tag.executor import reference_training, run_virtual
    from tag.workloads import load_workload

    graph = captured(GPT2, batch=8, groups=6).graph
    plan = layout_plan(graph, topo4, Layout(tp=2, pp=2, micro=2), CostModel.for_topology(graph, topo4))
    assert [(g.devices, g.tp) for g in plan.groups] == [([0, 1], 2)] * 3 + [([2, 3], 2)] * 3
    validate_plan(plan, graph, topo4)  # the executor's check
    rts = run_virtual(graph, plan, load_workload(GPT2, batch=8), "sgd", 2)
    assert {d: rt.rank for d, rt in rts.items()} == {0: 0, 1: 0, 2: 2, 3: 2}
    ref, losses = reference_training(load_workload(GPT2, batch=8), "sgd", 2)
    pairs = [[rts[0], rts[1]], [rts[2], rts[3]]]
    _assert_pipeline_params([p[0].hook.full_params([(rt.named_params(), rt.hook.kept) for rt in p]) for p in pairs],
                            ref, graph)
    assert [rt.loss for rt in rts.values()].count(0.0) == 3
    assert sum(rt.loss for rt in rts.values()) == pytest.approx(losses[-1], rel=1e-5)


@pytest.mark.slow
def test_pipeline_of_tensor_parallel_stages_on_four_gloo_ranks(captured, tmp_path):
    """The same layout on 4 gloo ranks (``tag execute``'s path): the activations cross between
    ranks 0 -> 2 and 1 -> 3."""
    from test_executor_dist import cpu_topology

    from tag.executor import ExecuteConfig, execute, reference_training
    from tag.workloads import load_workload

    graph = captured(GPT2, batch=8, groups=6).graph
    topo_path = cpu_topology(tmp_path, 4)
    topo = load_topology(topo_path)
    plan = layout_plan(graph, topo, Layout(tp=2, pp=2, micro=2), CostModel.for_topology(graph, topo))
    plan.save(tmp_path / "plan.json")
    cfg = ExecuteConfig(GPT2, topo_path, str(tmp_path / "plan.json"), steps=2, warmup=0, save_params=True,
                        optimizer="sgd", run_dir=str(tmp_path / "run"), timeout_s=60.0)
    res = execute(cfg, graph=graph)
    ref, losses = reference_training(load_workload(GPT2, batch=8), "sgd", 2)
    _assert_pipeline_params([torch.load(tmp_path / "run" / f"params-rank{r}.pt") for r in range(4)], ref, graph)
    assert res.losses == pytest.approx(losses, rel=1e-5)


@pytest.mark.slow
def test_tensor_parallel_training_on_two_gloo_ranks(gpt2, tmp_path):
    from test_executor_dist import cpu_topology

    from tag.executor import ExecuteConfig, execute, reference_training
    from tag.workloads import load_workload

    topo_path = cpu_topology(tmp_path, 2)
    plan = _tp_plan(gpt2, load_topology(topo_path), [0, 1])
    plan.save(tmp_path / "plan.json")
    cfg = ExecuteConfig(GPT2, topo_path, str(tmp_path / "plan.json"), steps=2, warmup=0, save_params=True,
                        optimizer="sgd", run_dir=str(tmp_path / "run"), timeout_s=60.0)
    res = execute(cfg, graph=gpt2)
    ref, losses = reference_training(load_workload(GPT2, batch=8), "sgd", 2)
    for r in range(2):
        _assert_full_params(torch.load(tmp_path / "run" / f"params-rank{r}.pt"), ref, gpt2)
    assert res.losses == pytest.approx(losses, rel=1e-5)


@pytest.mark.parametrize("spec,qkv,blocks", [
    ("tests/data/attention_model.py:make", "qkv.weight", [(32, 4), (128, None)]),
    # nn.TransformerEncoder: MultiheadAttention's in_proj is an mm on a transposed input with its
    # bias added after (split with it), 2 layers
    ("evaluation.models.unseen:encoder", "encoder.layers.0.self_attn.in_proj_weight", [(64, 4), (256, None)] * 2),
])
def test_tensor_parallel_through_fused_attention(v100, spec, qkv, blocks):
    """Models calling F.scaled_dot_product_attention: the attention block is found through the
    fused CPU flash kernel (heads from its logsumexp), and 2-way tensor parallel training, whose
    shards are found by NaNs propagated through the fused forward and backward, equals
    single-process training."""
    from tag.executor import reference_training, run_virtual
    from tag.graph import capture
    from tag.workloads import load_workload

    batch = 4
    graph = capture(load_workload(spec, batch=batch), num_groups=4).graph
    assert any(o.target == "aten._scaled_dot_product_flash_attention_for_cpu.default" for o in graph.ops)
    assert [(b.features, b.heads) for b in megatron_blocks(graph)] == blocks
    if spec.startswith("tests"):
        # under bf16 autocast the kernel runs in bf16, its logsumexp stays FP32: the same heads
        bf16 = capture(load_workload(spec, batch=batch), num_groups=4, precision="bf16").graph
        assert [(b.features, b.heads) for b in megatron_blocks(bf16)] == blocks
    plan = _tp_plan(graph, v100, [0, 1], tp=2)
    rts = run_virtual(graph, plan, load_workload(spec, batch=batch), "sgd", 2)
    # each shard keeps the same 2 of the 4 heads of q, k and v
    f = blocks[0][0]
    assert rts[1].hook.kept[f"model.{qkv}"][0].tolist() == [*range(f // 2, f), *range(3 * f // 2, 2 * f),
                                                          *range(5 * f // 2, 3 * f)]
    ref, _ = reference_training(load_workload(spec, batch=batch), "sgd", 2)
    _assert_full_params(rts[0].hook.full_params([(rt.named_params(), rt.hook.kept) for rt in rts.values()]), ref, graph)


def test_validate_runs_tensor_parallel_plans(gpt2):
    """``tag validate``'s plan set has every op-group tensor parallel over all devices for each
    degree a layout may use (plain Megatron: the executor runs it); ``--only`` picks plans by name
    prefix, and a prefix naming none is one line."""
    from tag.errors import TagError
    from tag.executor.validate import select_plans, validation_plans

    cpu2, cpu4 = load_topology("local-cpu2"), load_topology("local-cpu4")
    plans = validation_plans(gpt2, cpu2, 20)
    tp = dict(select_plans(plans, ["tp"]))
    assert list(tp) == ["tp2"]
    validate_plan(tp["tp2"], gpt2, cpu2)  # what the executor accepts
    assert all(g.sync == "tp" and g.tp == 2 and not g.sequence_parallel for g in tp["tp2"].groups)
    assert [n for n, _ in select_plans(validation_plans(gpt2, cpu4, 20), ["tp", "dp2"])] == ["dp2-tp2", "tp4"]
    assert [n for n, _ in select_plans(plans, ["dp-even", "pp2"])] == ["dp-even", "pp2-1f1b-m4", "pp2-gpipe-m4"]
    with pytest.raises(TagError, match=r"^--only: 'tp8' names none of the plans \['dp-even', .*\]; expected a name"):
        select_plans(plans, ["tp8"])


@pytest.mark.parametrize("causal", [False, True])
def test_nan_analysis_attention_propagates_nan_per_head(causal):
    """The NaN analysis runs fused CPU attention in plain ops: equal values to the kernel (forward
    and backward), and a NaN feature of one head's query makes that head's outputs, logsumexp and
    key/value gradients NaN and no other head's (the AVX-512 kernel drops such NaNs)."""
    from tag.executor.tensor_parallel import NAN_PASS_OPS

    aten = torch.ops.aten
    fwd, bwd = aten._scaled_dot_product_flash_attention_for_cpu.default, \
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 4, 12, 8, generator=g) for _ in range(4))
    out, lse = fwd(q, k, v, 0.0, causal)
    mine = NAN_PASS_OPS[fwd](q, k, v, 0.0, causal)
    for a, b in zip((out, lse, *bwd(do, q, k, v, out, lse, 0.0, causal)),
                    (*mine, *NAN_PASS_OPS[bwd](do, q, k, v, out, lse, 0.0, causal))):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    q[:, 2, :, 3] = math.nan
    out, lse = NAN_PASS_OPS[fwd](q, k, v, 0.0, causal)
    gq, gk, gv = NAN_PASS_OPS[bwd](do, q, k, v, out, lse, 0.0, causal)
    for t in (out, lse[..., None], gk, gv):
        assert t.isnan().any(-1).any(-1).any(0).tolist() == [False, False, True, False]


GPT2_DROPOUT = f'''
import torch
from tag.workloads import load_workload

def make(batch_size=8):
    wl = load_workload("{GPT2}", batch=batch_size)
    for m in wl.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    return wl.model, tuple(wl.inputs)
'''


@pytest.mark.slow
def test_tensor_parallel_with_dropout_on_two_gloo_ranks(tmp_path):
    """GPT-2 with dropout 0.1 on 2 gloo ranks, 2-way tensor parallel. Outside the blocks both ranks
    run the same ops on the same samples and must draw the same masks, or their replicated
    parameters drift apart: the ranks assembling the full parameters to save check that they
    agree (``TpRank.full_params``). The attention-probability dropout inside the blocks keeps its
    bool mask sharded with its output (``_integers_follow``; before, the shard's shape check
    refused the plan). After 2 steps every parameter moved."""
    from test_executor_dist import cpu_topology

    from tag.executor import ExecuteConfig, execute, reference_training
    from tag.graph import capture
    from tag.workloads import load_workload

    f = tmp_path / "gpt2_dropout.py"
    f.write_text(GPT2_DROPOUT)
    spec = f"{f}:make"
    graph = capture(load_workload(spec, batch=8), num_groups=4).graph
    assert any(o.target == "aten.native_dropout.default" for o in graph.ops)
    topo_path = cpu_topology(tmp_path, 2)
    _tp_plan(graph, load_topology(topo_path), [0, 1]).save(tmp_path / "plan.json")
    cfg = ExecuteConfig(spec, topo_path, str(tmp_path / "plan.json"), steps=2, warmup=0, save_params=True,
                        optimizer="sgd", groups=4, run_dir=str(tmp_path / "run"), timeout_s=60.0)
    execute(cfg, graph=graph)
    p0, p1 = (torch.load(tmp_path / "run" / f"params-rank{r}.pt") for r in range(2))
    start, _ = reference_training(load_workload(spec, batch=8), "sgd", 0)  # the initial parameters
    assert set(p0) == set(p1) == {p.name for p in graph.params}  # each rank saves the full parameters
    assert all(torch.equal(p0[n], p1[n]) and not torch.equal(p0[n], start[n]) for n in p0)


def test_full_params_refuse_a_diverged_replica():
    """A replicated parameter that differs between the members of a tensor-parallel group (beyond
    the executor's equality tolerance) is one line naming it, not a silently chosen copy."""
    from tag.executor import ExecutionError
    from tag.executor.tensor_parallel import TpRank, TpSpec

    rank = TpRank(0, 2, TpSpec((), frozenset()))
    w = torch.ones(3)
    assert torch.equal(rank.full_params([({"ln.weight": w}, {}), ({"ln.weight": w + 1e-8}, {})])["ln.weight"], w)
    with pytest.raises(ExecutionError, match=r"replicated parameter 'ln.weight' differs between members 0 and 1"):
        rank.full_params([({"ln.weight": w}, {}), ({"ln.weight": w * 1.01}, {})])


def test_random_ops_on_shards_draw_their_own_masks(tmp_path):
    """A dropout inside a Megatron block (attention probabilities, sharded by head) runs on its
    shard's own stream (tp_shard_random, Megatron-LM's model-parallel RNG tracker): from one
    common state the two shards draw different masks, a shard drawing again from that state the
    same (what a replayed recomputation does), and both leave the common stream in the same
    state (the replicated ops' masks stay equal). In GPT-2 with dropout under 2-way tensor
    parallelism every such op is wrapped, and only those."""
    from tag.executor import run_virtual
    from tag.executor.tensor_parallel import tp_shard_random
    from tag.graph import capture
    from tag.graph.gradients import node_draws_random
    from tag.workloads import load_workload

    x = torch.ones(4, 64)
    drop = torch.ops.aten.native_dropout.default
    torch.manual_seed(0)
    state = torch.get_rng_state()
    masks, after = [], []
    for shard in (0, 1, 0):
        torch.set_rng_state(state)
        masks.append(tp_shard_random(drop, shard, x, 0.5, True)[1])
        after.append(torch.get_rng_state())
    assert not torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])
    assert torch.equal(after[0], after[1]) and torch.equal(after[0], after[2]) and not torch.equal(after[0], state)

    f = tmp_path / "gpt2_dropout.py"
    f.write_text(GPT2_DROPOUT)
    spec = f"{f}:make"
    graph = capture(load_workload(spec, batch=8), num_groups=4).graph
    from test_executor_dist import cpu_topology

    rts = run_virtual(graph, _tp_plan(graph, load_topology(cpu_topology(tmp_path, 2)), [0, 1]),
                      load_workload(spec, batch=8), "sgd", 0)
    for rt in rts.values():
        nodes = [n for st in rt.stages.values() for n in st.module.graph.nodes if n.op == "call_function"]
        wrapped = [n for n in nodes if n.target is tp_shard_random]
        assert wrapped and all(n.name in rt.hook.sharded for n in wrapped)
        assert all(n.target is tp_shard_random or n.name not in rt.hook.sharded for n in nodes if node_draws_random(n))
        assert any(node_draws_random(n) and n.target is not tp_shard_random for n in nodes)  # replicated dropouts
