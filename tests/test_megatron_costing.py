"""How another runtime's Megatron-LM run is costed (docs/design.md, "Costing another runtime's
run"): one op-group a layer (tag.parallel.layers.group_by_layers), the vocabulary parameters
split over the tensor-parallel ranks (vocab_parallel_graph), a tensor-parallel group's gradient
buffer its device's shard. Figures against Korthikanti et al. 2022 (arXiv 2205.05198): full
recomputation keeps each layer's input, ``2 s b h`` bytes in fp16, and a tensor-parallel rank
holds ``1 / t`` of a layer's matmul weights."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest

from tag.cost.fused_memory import fused_activation_graph
from tag.cost.model import CostModel
from tag.graph.grouping import group_at, group_ops
from tag.parallel.layers import group_by_layers, model_layers, vocab_parallel_graph
from tag.parallel.layout import layout_plan, parse_layout
from tag.parallel.tensor_parallel import block_groups, group_split, megatron_blocks
from tag.planner import model_graph
from tag.sim import Simulator
from tag.sim.program import build_program
from tag.sim.static import build_static
from tag.topology import load_topology

S, H, A, L, V = 32, 64, 4, 4, 1000
SPEC = f"gpt2:n_layer={L},n_embd={H},n_head={A},vocab={V},seq={S},attn=sdpa"
A100X8 = Path(__file__).resolve().parents[1] / "evaluation" / "external" / "topologies" / "vtrain-a100-1x8.yaml"


def _graph(groups: int = 6):
    g, _, _ = model_graph(SPEC, 8, precision="fp16", num_groups=groups)
    return g


def test_one_group_a_layer_between_embedding_and_head():
    g = _graph(5)
    assert group_by_layers(g) == L + 2
    layers = model_layers(g)
    for i, ops in enumerate(layers.ops):  # layer i's forward ops all in group i + 1
        assert {g.ops[o].group for o in ops} == {i + 1}
    first = [g.ops[o].group for o in range(len(g.ops)) if g.ops[o].phase == "fwd"]
    assert first[0] == 0 and first[-1] == L + 1  # embedding first, head (and loss) last
    blocks = megatron_blocks(g)
    assert len(blocks) == 2 * L and all(len(block_groups(g, b)) == 1 for b in blocks)


def test_layer_groups_recompute_hold_one_layer_input():
    """Recomputed, a layer group holds its input only: 2 s h bytes a sample in fp16, Megatron-LM's
    full recomputation (the residual stream at the layer boundary; the next layer's first norm's
    backward runs in that layer's group, tag.graph.gradients.backward_homes, so its saved mean and
    rstd stay there); a grouping cut inside the layers holds more (a residual and a branch at a
    cut inside a layer)."""
    g = _graph()
    group_by_layers(g)
    st = build_static(fused_activation_graph(g))
    for layer in range(1, L + 1):
        assert st.rc_per_sample[layer] == 2 * S * H
    g2 = _graph()
    group_ops(g2, 2 * L + 2)
    st2 = build_static(fused_activation_graph(g2))
    assert sum(st2.rc_per_sample) > 1.2 * sum(st.rc_per_sample)


def test_group_at_refuses_cuts_out_of_order():
    g = _graph()
    with pytest.raises(ValueError, match="ascending"):
        group_at(g, [5, 3])
    group_at(g, [3, 5])
    assert g.num_groups == 3


def test_vocab_parallel_graph_splits_the_token_embedding_only():
    g = _graph()
    v = vocab_parallel_graph(g, 4)
    changed = {p.name: (a.nbytes, p.nbytes) for a, p in zip(g.params, v.params) if a.nbytes != p.nbytes}
    assert list(changed) == ["model.lm_head.weight"]  # GPT-2's tied token embedding
    before, after = changed["model.lm_head.weight"]
    assert before == V * H * 4 and after == before // 4
    p = next(p for p in v.params if p.name == "model.lm_head.weight")
    assert v.tensors[p.tensor].nbytes.fixed == after and v.tensors[p.grad].nbytes.fixed == after
    assert vocab_parallel_graph(g, 1) is g
    assert all(a.nbytes == b.nbytes for a, b in zip(g.params, _graph().params))  # input unchanged


def test_tensor_parallel_sync_buffer_is_the_devices_shard():
    g = _graph()
    group_by_layers(g)
    topo = load_topology(str(A100X8))
    costs = CostModel.for_topology(g, topo)
    lay = replace(parse_layout("dp=2,tp=4,pp=1,micro=1"))
    plan = layout_plan(g, topo, lay, costs)
    from tag.sim import Simulator

    sim = Simulator(g, topo, costs)
    gds = sim.deploy(plan.groups)
    layer = 2
    sp = group_split(g, layer)
    total = float(sim.static.grad_bytes[layer])
    assert sp.split_bytes > 0.9 * total  # a layer's matmul weights: nearly all its bytes
    assert gds[layer].sync_bytes == pytest.approx(total - 0.75 * sp.split_bytes)


def test_vocab_parallel_head_costs_a_vocabulary_slice_of_every_token():
    """Megatron-LM's vocabulary-parallel head on 8 ranks: each rank computes ``h x V / 8``
    logits for all of its replica's 2 samples, so the head group's costed seconds at 2 samples
    are 1/8 of one rank's whole head plus at most the rule's fixed floors (its seconds at 0
    samples: per-kernel and host launch costs, the weight cast), its logits 1/8 of the bytes,
    and the simulated tp=8 head adds the cross-entropy's 3 all-reduces of 4 bytes a token
    (forward) and the head input's gradient all-reduce (backward) over the group."""
    s, h, v, tp = 1024, 1024, 32768, 8
    g, _, _ = model_graph(f"gpt2:n_layer=1,n_embd={h},n_head=16,vocab={v},seq={s},attn=sdpa", 2,
                          precision="fp16", num_groups=3)
    group_by_layers(g)
    g = fused_activation_graph(g)
    vp = vocab_parallel_graph(g, tp)
    head = g.num_groups - 1
    topo = load_topology(str(A100X8))
    c1 = CostModel.for_topology(g, topo, runtime="megatron")
    c8 = CostModel.for_topology(vp, topo, runtime="megatron")
    t1 = c1.table(0)[head, :2].sum(axis=0)  # [batch 0..2] forward + backward seconds
    t8 = c8.table(0)[head, :2].sum(axis=0)
    assert t1[2] / tp <= t8[2] <= t1[2] / tp + t8[0]
    assert t8[2] < t1[1] / 3  # the sample split: a rank computed one sample's whole head, t1[1]
    logits = [i for i, t in enumerate(g.tensors) if t.nbytes.per_sample and t.nbytes.per_sample % (s * v) == 0]
    assert logits and all(vp.tensors[i].nbytes.per_sample * tp == g.tensors[i].nbytes.per_sample for i in logits)
    hidden = [i for i, t in enumerate(g.tensors) if t.nbytes.per_sample == 2 * s * h]
    assert hidden and all(vp.tensors[i].nbytes == g.tensors[i].nbytes for i in hidden)
    assert build_static(vp).mem_per_sample[head] < build_static(g).mem_per_sample[head] / 4
    from tag.sim import Simulator

    sim = Simulator(vp, topo, c8)
    from evaluation.external import vocab_parallel_plan

    plan = layout_plan(vp, topo, replace(parse_layout("dp=1,tp=8,pp=1,micro=1"), vocab=1), c8)
    vocab_parallel_plan(vp, plan, tp)
    assert plan.groups[head].sync == "tp" and plan.groups[0].sync == "tp"
    lay = sim.deploy(plan.groups)[head].units[0].layout
    devs = plan.groups[head].devices
    ce = sim.comm.tensor_parallel_time(devs, [4.0 * s * 2] * 3)
    grad = sim.comm.tensor_parallel_time(devs, [2.0 * s * h * 2])
    assert ce > 0 and grad > 0
    # the head's device seconds at its replica's 2 samples, or, where longer, a rank's at its 1/8 of
    # them (its launches are the host's: CostModel.host_parts)
    from tag.sim.tensor_parallel import _interior_fixed

    rank = c8.host_parts(0, _interior_fixed(vp, tp), [2 / tp]).device[head, :2, 0]
    whole = c8.host_parts(0).device
    assert lay.dur[0, head, 0] == pytest.approx(max(whole[head, 0, 2], rank[0]) + ce)
    assert lay.dur[1, head, 0] == pytest.approx(max(whole[head, 1, 2], rank[1]) + grad)


def _vocab_plan(layout: str, strip: bool = False):
    """The test GPT (batch 8, fp16) costed as Megatron-LM runs it on the 8 x A100 machine with
    ``layout`` (``vocab=1``): graph, plan, simulator. ``strip``: the copy without its
    ``vocab_parallel`` mark (a tensor-parallel plan as TAG's executor runs it)."""
    from evaluation.external import vocab_parallel_plan

    g = _graph()
    group_by_layers(g)
    lay = replace(parse_layout(layout), vocab=1)
    vp = vocab_parallel_graph(fused_activation_graph(g), lay.tp)
    if strip:
        del vp.vocab_parallel
    topo = load_topology(str(A100X8))
    costs = CostModel.for_topology(vp, topo, runtime="megatron")
    plan = layout_plan(vp, topo, lay, costs)
    vocab_parallel_plan(vp, plan, lay.tp)
    return vp, plan, Simulator(vp, topo, costs)


def test_vocab_parallel_embedding_holds_its_rows_and_all_reduces_its_output():
    """Megatron-LM's VocabParallelEmbedding on 4 ranks: each rank looks up every token of its
    replica in its V / 4 rows, so the embedding group's weight-sized tensors (the lookup's weight
    gradient, the tied sum) are 1/4 of the bytes while the looked-up activations stay whole, and
    its forward all-reduces the output over the group (2 s h bytes a sample in fp16: the rows a
    rank does not hold are zeros); its backward has no collective."""
    g = _graph()
    group_by_layers(g)
    g = fused_activation_graph(g)
    vp = vocab_parallel_graph(g, 4)
    assert vp.vocab_parallel == 4 and vocab_parallel_graph(g, 1) is g
    emb = [i for i, o in enumerate(g.ops) if o.group == 0 and o.phase == "bwd" and "embedding" in o.target]
    weight = [i for i in emb if g.tensors[g.ops[i].outputs[0]].nbytes.fixed == V * H * 4]
    assert len(weight) == 1  # the token embedding's gradient (the position embedding's is 1024 rows)
    out = g.ops[weight[0]].outputs[0]
    assert vp.tensors[out].nbytes.fixed == V * H  # 1/4 of V h fp32
    assert vp.ops[weight[0]].bytes_read.per_sample == g.ops[weight[0]].bytes_read.per_sample
    assert vp.ops[weight[0]].bytes_written.fixed == pytest.approx(g.ops[weight[0]].bytes_written.fixed / 4)
    lookup = next(o for o in g.ops if o.group == 0 and o.phase == "fwd" and o.batch and "embedding" in o.target)
    assert vp.tensors[lookup.outputs[0]].nbytes == g.tensors[lookup.outputs[0]].nbytes
    (fwd,), bwd = vp.vocab_reduces[0]
    assert fwd.at(1) == 2 * S * H and bwd == ()
    vp, plan, sim = _vocab_plan("dp=2,tp=4,pp=1,micro=1")
    assert plan.groups[0].sync == "tp" and plan.groups[0].tp == 4
    silent = copy.copy(vp)  # the same graph without the embedding's collective
    silent.vocab_reduces = {k: r for k, r in vp.vocab_reduces.items() if k != 0}
    quiet = Simulator(silent, sim.topology, sim.costs).deploy(plan.groups)[0].layout.dur[:, 0, 0]
    dur = sim.deploy(plan.groups)[0].layout.dur[:, 0, 0]
    ar = sim.comm.tensor_parallel_time(plan.groups[0].devices[:4], [2.0 * S * H * 4])  # the replica's 4 samples
    assert ar > 0 and dur[0] == pytest.approx(quiet[0] + ar) and dur[1] == pytest.approx(quiet[1])


def test_pipeline_holds_the_tied_vocab_shards_on_both_stages():
    """On a pipeline, Megatron-LM's first and last stages each hold their V / tp shard of the tied
    embedding (its weight, gradient and Adam state on the last stage's devices too) and all-reduce
    its gradient over rank i of every replica of both stages, the tp shard rings at once: no
    weight or gradient of the vocabulary crosses the cut, and the owner's own sync leaves it out.
    The same plan without the vocabulary-parallel mark is TAG's executor's tensor-parallel
    pipeline: the weight moves to the last stage and its partial sums back."""
    vp, plan, sim = _vocab_plan("dp=2,tp=2,pp=2,micro=2")
    pp = plan.pipeline
    (tw,) = sim.static.tied
    assert tw.nbytes == V * H * 4 / 2
    assert build_program(sim, plan.groups, pp).tied == frozenset({tw.tensor})
    p2p, _ = sim.moved_bytes(plan.groups, pipeline=pp)
    assert p2p and max(p2p.values()) < tw.nbytes  # the stage boundary's activations only
    gds = sim.deploy(plan.groups)
    jobs = dict(sim.sync_jobs(gds, frozenset({tw.tensor})))
    tie = jobs[(tw.grad_group, tw.owner)]
    first, last = plan.groups[tw.owner].devices, plan.groups[tw.grad_group].devices
    assert tie.sync_devices == tuple(sorted(first + last))
    rings = [first[:2], first[2:], last[:2], last[2:]]
    assert tie.sync_time == pytest.approx(sim.comm.allreduce_time([r[0] for r in rings], 2 * tw.nbytes))
    own = jobs[(tw.owner,)]
    rest = gds[tw.owner].sync_bytes - tw.nbytes  # the position embedding's gradient
    assert own.sync_bytes == pytest.approx(rest)
    assert own.sync_time == pytest.approx(sim.comm.allreduce_time([first[0], first[2]], 2 * rest))
    res = sim.run(plan.groups, pipeline=pp)
    _, _, stripped = _vocab_plan("dp=2,tp=2,pp=2,micro=2", strip=True)
    assert build_program(stripped, plan.groups, pp).tied == frozenset()
    p2p_exec, _ = stripped.moved_bytes(plan.groups, pipeline=pp)
    assert max(p2p_exec.values()) >= tw.nbytes
    res_exec = stripped.run(plan.groups, pipeline=pp)
    held = 2 * tw.nbytes + tw.opt_state_bytes  # the last stage's copy
    for d in last:
        assert res.peak_memory_bytes[d] >= res_exec.peak_memory_bytes[d] + 0.9 * held


def test_tensor_parallel_working_set_splits_the_attention_probabilities():
    """Plain Megatron runs a block's per-head ops on its rank's heads: with eager attention a
    layer's largest op (the probabilities' softmax, ``[B, heads, s, s]``) works on ``1 / T`` of
    the heads, so a ``tp=4`` device's working set in a layer is that of its rank's quarter of the
    replica's samples, not the whole micro-batch's; the ops outside the blocks (the LM head's
    logits) keep theirs at the replica's micro-batch (vTrain's GPT 18.4B at ``tp=8, dp=32``,
    micro-batch 16, eager attention: 104 -> 73 GiB, 2026-11-29)."""
    g, _, _ = model_graph(f"gpt2:n_layer=2,n_embd={H},n_head={A},vocab={V},seq=128,attn=eager", 8,
                          precision="fp16", num_groups=4)
    group_by_layers(g)
    vp = vocab_parallel_graph(fused_activation_graph(g), 4)
    topo = load_topology(str(A100X8))
    costs = CostModel.for_topology(vp, topo, runtime="megatron")
    plan = layout_plan(vp, topo, replace(parse_layout("dp=2,tp=4,pp=1,micro=1"), vocab=1), costs)
    sim = Simulator(vp, topo, costs)
    work = sim.deploy(plan.groups)[1].layout.work[:, 0]  # a device of the first replica (4 samples)
    st = sim.static
    layer, head = 1, vp.num_groups - 1
    assert work[layer] == pytest.approx(st.work_fixed[layer] + st.work_per_sample[layer] * 1)  # 4 samples / 4
    assert work[head] == pytest.approx(st.work_fixed[head] + st.work_per_sample[head] * 4)  # no blocks
