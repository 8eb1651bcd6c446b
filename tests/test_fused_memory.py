"""Saved activations of a fused mixed-precision trainer (tag.cost.fused_memory) against
Korthikanti et al. 2022 (arXiv 2205.05198, section 4.1): a transformer layer keeps
``s b h (34 + 5 a s / h)`` bytes in fp16, ``34 s b h`` with fused attention; without dropout
its two ``s b h`` masks go, leaving ``32 s b h``."""

from __future__ import annotations

import functools

import pytest

from tag.cost.fused_memory import fused_activation_graph, saved_bytes
from tag.planner import model_graph

S, H, A = 32, 64, 2


@functools.cache
def _per_layer(precision: str, attn: str, fused: bool) -> float:
    """Saved bytes per layer and sample over ``s h`` (two depths differenced: embeddings and the
    loss cancel)."""
    v = []
    for layers in (1, 2):
        g, _, _ = model_graph(f"gpt2:n_layer={layers},n_embd={H},n_head={A},vocab=1000,seq={S},attn={attn}", 2,
                              precision=precision, num_groups=1)
        v.append(saved_bytes(fused_activation_graph(g) if fused else g, 1))
    return (v[1] - v[0]) / (S * H)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_fused_layer_keeps_megatron_activation_bytes(precision):
    assert _per_layer(precision, "sdpa", True) == pytest.approx(32.0, rel=0.02)
    # eager attention keeps its [a, s, s] probabilities in fp16 (2 a s^2 b bytes; Megatron's 5 counts the
    # dropout mask and output too)
    assert _per_layer(precision, "eager", True) == pytest.approx(32.0 + 2 * A * S / H, rel=0.05)


def test_eager_autocast_keeps_more_and_fp32_is_only_fused():
    eager = _per_layer("fp16", "sdpa", False)
    assert eager > 2 * _per_layer("fp16", "sdpa", True)  # fp32 GELU chain and residual copies under autocast
    assert _per_layer("fp32", "sdpa", True) == pytest.approx(64.0, rel=0.02)  # 4-byte storage, same tensors


def test_fused_graph_changes_activations_only():
    g, _, _ = model_graph(f"gpt2:n_layer=1,n_embd={H},n_head={A},vocab=1000,seq={S},attn=sdpa", 2,
                          precision="bf16", num_groups=4)
    f = fused_activation_graph(g)
    assert f.param_bytes == g.param_bytes and f.signature() == g.signature()
    changed = [i for i, (a, b) in enumerate(zip(g.tensors, f.tensors)) if a.nbytes != b.nbytes]
    assert changed and all(g.tensors[i].kind == "activation" and g.tensors[i].batch_dim is not None for i in changed)
    assert all(a.nbytes == b.nbytes for a, b in zip(g.tensors, model_graph(
        f"gpt2:n_layer=1,n_embd={H},n_head={A},vocab=1000,seq={S},attn=sdpa", 2, precision="bf16",
        num_groups=4)[0].tensors))  # the input graph is not modified


def test_constants_are_built_on_every_rank(topo4):
    """A tensor computed from constants alone (GPT-2's eager ``[B, 1, L, S]`` causal mask, from
    ``arange`` and ``full``) is built on every rank that reads it, as Megatron-DeepSpeed's
    pipelines read a mask made at startup: the fused graph's readers read a graph constant of one
    batch row, the ops that made it cost nothing, and a pipeline cut at a layer carries the hidden
    state alone forward (the eager graph also moves the mask, ``S x S x 4`` bytes a sample)."""
    from test_sim_executor import sim_bytes

    from tag.parallel.layers import group_by_layers
    from tag.plan import GroupPlan, PipelinePlan, new_plan
    from tag.sim import Simulator

    spec = f"gpt2:n_layer=2,n_embd={H},n_head={A},vocab=1000,seq={S},attn=eager"
    g, _, _ = model_graph(spec, 4, num_groups=4)
    assert group_by_layers(g) == 4  # embedding, 2 layers, head
    f = fused_activation_graph(g)
    local = f.tensors[len(g.tensors):]
    mask = [t for t in local if t.nbytes.fixed == S * S * 4]
    assert mask and all(t.kind == "const" and t.producer < 0 and t.batch_dim is None for t in local)
    assert len({f.ops[c].group for c in mask[0].consumers}) == 2  # read by both layers' attention
    made = [i for i, (a, b) in enumerate(zip(g.ops, f.ops)) if a.flops != b.flops or a.bytes_written != b.bytes_written]
    assert made and all(f.ops[i].flops.at(4) == f.ops[i].bytes_written.at(4) == 0 for i in made)
    assert any(g.ops[i].group == 0 and g.ops[i].bytes_written.per_sample >= S * S * 4 for i in made)  # the mask's
    forward = {}
    for name, graph in (("eager", g), ("fused", f)):
        plan = new_plan(graph, topo4, [GroupPlan([0], [1.0])] * 2 + [GroupPlan([1], [1.0])] * 2)
        plan.pipeline = PipelinePlan([0, 2], 2, "1f1b", 1)  # stage 1 from layer 1
        forward[name] = sim_bytes(Simulator(graph, topo4), plan.groups, plan.pipeline)[(0, 1)]
    assert forward["fused"] == 4 * S * H * 4  # 4 samples' hidden states
    assert forward["eager"] >= forward["fused"] + 4 * S * S * 4
