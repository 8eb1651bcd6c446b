"""``attn=eager_fused_softmax`` (tag.workloads.zoo.fused_softmax_attention): attention written out
with Megatron-LM's fused softmax, whose probabilities stay in the training precision (2 bytes an
element kept for the backward) where Hugging Face's ``eager`` keeps autocast's FP32 softmax and its
half-precision cast; and CUDA autocast's rule that a softmax given a ``dtype`` runs in it."""

from __future__ import annotations

import functools

import pytest
import torch

from tag.graph.precision import autocast
from tag.planner import model_graph
from tag.workloads import load_workload

S, H, A = 32, 64, 2
SPEC = f"gpt2:n_layer=1,n_embd={H},n_head={A},vocab=1000,seq={S},attn={{}}"


@functools.cache
def _graph(attn: str, precision: str):
    return model_graph(SPEC.format(attn), 2, precision=precision, num_groups=4)[0]


def _softmaxes(g, phase: str):
    """The attention's softmax ops of ``phase`` (the loss's is a ``_log_softmax``)."""
    name = "aten._softmax.default" if phase == "fwd" else "aten._softmax_backward_data.default"
    return [op for op in g.ops if op.target == name and op.phase == phase]


def _saved(g, t: int) -> bool:
    return any(g.ops[c].phase == "bwd" for c in g.tensors[t].consumers)


def test_autocast_keeps_an_explicit_softmax_dtype():
    x = torch.randn(2, 3, 8).bfloat16()
    with autocast("bf16"):
        assert torch.softmax(x, -1).dtype == torch.float32  # CUDA autocast's fp32 list
        assert x.sum().dtype == torch.float32
        assert torch.softmax(x, -1, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert torch.nn.functional.softmax(x, dim=-1, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert x.softmax(-1, torch.bfloat16).dtype == torch.bfloat16
        assert x.sum(dtype=torch.bfloat16).dtype == torch.bfloat16


def test_fused_softmax_keeps_half_precision_probabilities(precision="bf16"):
    """The probabilities [B, heads, S, S] are one saved tensor of 2 bytes an element, half the FP32
    one eager's backward keeps (besides its 2-byte cast for the product with V); the softmax and its
    backward run in the training precision; the graph's FLOPs are eager's."""
    low = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    fused, eager = _graph("eager_fused_softmax", precision), _graph("eager", precision)
    elements = A * S * S  # a sample's probabilities
    (f_op,), (e_op,) = _softmaxes(fused, "fwd"), _softmaxes(eager, "fwd")
    (f_t,), (e_t,) = f_op.outputs, e_op.outputs
    assert (f_op.dtype, e_op.dtype) == (low, "float32")
    assert _saved(fused, f_t) and _saved(eager, e_t)
    assert fused.tensors[f_t].nbytes.per_sample == 2 * elements
    assert fused.tensors[f_t].nbytes.per_sample == eager.tensors[e_t].nbytes.per_sample / 2
    # eager keeps 4 + 2 bytes an element (FP32 probabilities and their cast), fused 2: the product
    # with V reads the softmax's own output
    assert (eager.activation_bytes(1) - eager.activation_bytes(0)) - (
        fused.activation_bytes(1) - fused.activation_bytes(0)) == 4 * elements
    (f_b,), (e_b,) = _softmaxes(fused, "bwd"), _softmaxes(eager, "bwd")
    assert (f_b.dtype, e_b.dtype) == (low, "float32")
    assert f_op.bytes_written.per_sample == e_op.bytes_written.per_sample / 2
    assert f_op.flops == e_op.flops and f_b.flops == e_b.flops
    for phase in ("fwd", "bwd"):
        assert fused.flops((phase,), 2) == eager.flops((phase,), 2)


@pytest.mark.parametrize("spec", [
    f"gpt2:n_layer=2,n_embd={H},n_head={A},vocab=100,seq={S}",
    f"llama:n_layer=2,n_embd={H},n_head=4,n_kv_head=2,ffn=96,vocab=100,seq={S}",  # grouped-query
    f"bert:n_layer=1,n_embd={H},n_head={A},vocab=100,seq={S}",
])
def test_fused_softmax_in_fp32_computes_eager(spec):
    """In fp32 the variant is eager's attention: same loss and gradients from the same weights."""
    out = {}
    for attn in ("eager", "eager_fused_softmax"):
        w = load_workload(f"{spec},attn={attn}", batch=2, seed=3)
        loss = w.model(*w.inputs)
        loss.backward()
        out[attn] = (loss.detach(), [p.grad for p in w.model.parameters()])
    (le, ge), (lf, gf) = out["eager"], out["eager_fused_softmax"]
    torch.testing.assert_close(lf, le)
    assert len(gf) == len(ge)
    for a, b in zip(gf, ge):
        torch.testing.assert_close(a, b)
