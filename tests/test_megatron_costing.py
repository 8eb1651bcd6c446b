"""How another runtime's Megatron-LM run is costed (docs/design.md, "Costing another runtime's
run"): one op-group a layer (tag.parallel.layers.group_by_layers), the vocabulary parameters
split over the tensor-parallel ranks (vocab_parallel_graph), a tensor-parallel group's gradient
buffer its device's shard. Figures against Korthikanti et al. 2022 (arXiv 2205.05198): full
recomputation keeps each layer's input, ``2 s b h`` bytes in fp16, and a tensor-parallel rank
holds ``1 / t`` of a layer's matmul weights."""

from __future__ import annotations

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
    assert plan.groups[head].sync == "tp" and plan.groups[0].sync != "tp"  # the embedding: sample shares
    lay = sim.deploy(plan.groups)[head].units[0].layout
    devs = plan.groups[head].devices
    ce = sim.comm.tensor_parallel_time(devs, [4.0 * s * 2] * 3)
    grad = sim.comm.tensor_parallel_time(devs, [2.0 * s * h * 2])
    assert ce > 0 and grad > 0
    # the head's seconds at its replica's 2 samples, or, where longer, a rank's at its 1/8 of them
    # (tag.sim.tensor_parallel: the eager host, behind after the layer's launches, delays the head)
    from tag.sim.tensor_parallel import _interior_fixed

    rank = c8.split_at(0, _interior_fixed(vp, tp), [2 / tp])[head, :2, 0]
    assert lay.dur[0, head, 0] == pytest.approx(max(c8.table(0)[head, 0, 2], rank[0]) + ce)
    assert lay.dur[1, head, 0] == pytest.approx(max(c8.table(0)[head, 1, 2], rank[1]) + grad)


def test_vocab_shares_keep_each_replicas_samples_on_its_group():
    """A vocabulary-parallel head's rows stay on their tensor-parallel group: 8 samples over
    4 groups of 8 devices land on each group's first two ranks (the replica's own two samples),
    as many samples as devices one each."""
    from evaluation.external import vocab_shares
    from tag.plan.format import local_batches

    shares = vocab_shares(32, 8)
    assert sum(shares) == pytest.approx(1.0)
    assert local_batches(8, shares) == [1, 1, 0, 0, 0, 0, 0, 0] * 4
    assert local_batches(32, shares) == [1] * 32 and local_batches(256, shares) == [8] * 32
