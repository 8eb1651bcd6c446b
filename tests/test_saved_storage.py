"""The simulator's saved activations (:attr:`tag.sim.static.GraphStatic.saved`) count a storage
once, as PyTorch holds it: eager attention's probabilities, saved by the softmax's backward and,
expanded and reshaped, by the product with V, are one tensor; a weight's transpose saved by a
matmul's backward is the parameter's storage. Checked against what autograd itself keeps when the
model trains on the CPU (``torch.autograd.graph.saved_tensors_hooks``, unique storages)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tag.planner import model_graph
from tag.sim.static import build_static
from tag.workloads import load_workload

B = 4
LOSS_SCALARS = 4
"""Bytes TAG keeps that eager autograd does not: the captured mean loss keeps two 0-d float32
scalars (the count's cast, the divided loss), eager's ``nll_loss`` one (its ``total_weight``)."""


class _NativeDropout(TorchFunctionMode):
    """Runs ``F.dropout`` with ``0 < p < 1`` in training as ``torch.native_dropout``, the kernel
    CUDA runs (ATen's ``is_fused_kernel_acceptable``) and the captured graph holds: its backward
    keeps a 1-byte bool mask. On the CPU eager ``F.dropout`` multiplies by a noise tensor of the
    input's dtype instead, saving 4 bytes an element in fp32. At ``p = 0`` both return the input."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.apply_defaults()
            x, p, train = bound.arguments["input"], bound.arguments["p"], bound.arguments["training"]
            if train and 0 < p < 1:
                return torch.native_dropout(x, p, train)[0]
        return func(*args, **kwargs)


def _autograd_saved_bytes(spec: str) -> int:
    """Bytes of the distinct storages autograd saves for the backward of one forward at ``B``
    samples, parameters and buffers left out (TAG counts them as such); dropout as CUDA runs it
    (:class:`_NativeDropout`)."""
    w = load_workload(spec, batch=B, seed=0)
    held = {t.untyped_storage().data_ptr() for t in [*w.model.parameters(), *w.model.buffers()]}
    found: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in held:
            found[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _NativeDropout():
        w.model(*w.inputs)
    return sum(found.values())


def _account(graph) -> float:
    """Bytes the simulator counts as saved for the backward of the graph's one group at ``B``."""
    return sum(f + p * B for f, p, _ in build_static(graph).saved[0])


@pytest.mark.parametrize("spec", [
    "gpt2:n_layer=1,n_embd=64,n_head=2,vocab=1000,seq=32,attn=eager",  # written-out attention
    "llama:n_layer=2,n_embd=64,n_head=4,n_kv_head=2,ffn=96,vocab=100,seq=32",  # fused attention
    "mlp",  # weight transposes only
])
def test_saved_bytes_are_the_storages_autograd_keeps(spec):
    graph = model_graph(spec, B, precision="fp32", num_groups=1)[0]
    account = _account(graph)
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


DROPOUT_SPEC = "gpt2:n_layer=1,n_embd=64,n_head=2,vocab=1000,seq=32,attn=eager"


def test_dropout_adds_its_masks_and_dropped_copies_as_autograd_keeps_them():
    """``dropout=0.1`` keeps the dropouts in training mode in the captured graph (embeddings,
    probabilities, attention and MLP outputs: 4 ``native_dropout`` forwards, each with a backward)
    and adds to the saved bytes what it adds to autograd's distinct storages (a bool mask each, the
    dropped probabilities the product with V reads): the account still equals autograd's."""
    graph = model_graph(DROPOUT_SPEC + ",dropout=0.1", B, precision="fp32", num_groups=1)[0]
    targets = [(op.phase, op.target) for op in graph.ops if "dropout" in op.target]
    assert targets.count(("fwd", "aten.native_dropout.default")) == 4
    assert targets.count(("bwd", "aten.native_dropout_backward.default")) == 4
    plain = model_graph(DROPOUT_SPEC, B, precision="fp32", num_groups=1)[0]
    added = _account(graph) - _account(plain)
    assert added > 0
    assert added == _autograd_saved_bytes(DROPOUT_SPEC + ",dropout=0.1") - _autograd_saved_bytes(DROPOUT_SPEC)
    assert _account(graph) - _autograd_saved_bytes(DROPOUT_SPEC + ",dropout=0.1") == LOSS_SCALARS
