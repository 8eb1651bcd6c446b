"""The simulator's saved activations (:attr:`tag.sim.static.GraphStatic.saved`) count a storage
once, as PyTorch holds it: eager attention's probabilities, saved by the softmax's backward and,
expanded and reshaped, by the product with V, are one tensor; a weight's transpose saved by a
matmul's backward is the parameter's storage. Checked against what autograd itself keeps when the
model trains on the CPU (``torch.autograd.graph.saved_tensors_hooks``, unique storages)."""

from __future__ import annotations

import pytest
import torch

from tag.planner import model_graph
from tag.sim.static import build_static
from tag.workloads import load_workload

B = 4
LOSS_SCALARS = 4
"""Bytes TAG keeps that eager autograd does not: the captured mean loss keeps two 0-d float32
scalars (the count's cast, the divided loss), eager's ``nll_loss`` one (its ``total_weight``)."""


def _autograd_saved_bytes(spec: str) -> int:
    """Bytes of the distinct storages autograd saves for the backward of one forward at ``B``
    samples, parameters and buffers left out (TAG counts them as such)."""
    w = load_workload(spec, batch=B, seed=0)
    held = {t.untyped_storage().data_ptr() for t in [*w.model.parameters(), *w.model.buffers()]}
    found: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in held:
            found[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        w.model(*w.inputs)
    return sum(found.values())


@pytest.mark.parametrize("spec", [
    "gpt2:n_layer=1,n_embd=64,n_head=2,vocab=1000,seq=32,attn=eager",  # written-out attention
    "llama:n_layer=2,n_embd=64,n_head=4,n_kv_head=2,ffn=96,vocab=100,seq=32",  # fused attention
    "mlp",  # weight transposes only
])
def test_saved_bytes_are_the_storages_autograd_keeps(spec):
    graph = model_graph(spec, B, precision="fp32", num_groups=1)[0]
    static = build_static(graph)
    account = sum(f + p * B for f, p, _ in static.saved[0])
    measured = _autograd_saved_bytes(spec)
    assert account - measured == LOSS_SCALARS
    # each tensor the backward reads, counted one by one, is more than PyTorch holds
    ops = graph.ops
    one_by_one = sum(t.nbytes.at(B) for t in graph.tensors
                     if (t.kind == "input" or (t.producer >= 0 and ops[t.producer].phase == "fwd"))
                     and any(ops[c].phase == "bwd" for c in t.consumers))
    assert one_by_one > 1.2 * measured



def test_eager_attention_probabilities_are_held_once():
    """The softmax's output [B, heads, S, S] and the view the product with V reads are one entry
    of its group's saved storages, of the probabilities' bytes."""
    graph = model_graph("gpt2:n_layer=1,n_embd=64,n_head=2,vocab=1000,seq=32,attn=eager", B,
                        precision="fp32", num_groups=1)[0]
    static = build_static(graph)
    (soft,) = [op.outputs[0] for op in graph.ops if op.target == "aten._softmax.default" and op.phase == "fwd"]
    (entry,) = [i for i, ts in enumerate(static.saved_members[0]) if soft in ts]
    assert len(static.saved_members[0][entry]) == 2
    assert static.saved[0][entry][1] == graph.tensors[soft].nbytes.per_sample == 2 * 32 * 32 * 4
