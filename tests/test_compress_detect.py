"""SFB candidate detection: linear layers (mm / GPT-2 Conv1D addmm) found, convolutions not claimed."""

from __future__ import annotations

from tag.compress import find_candidates
from tag.graph import capture
from tag.workloads import load_workload

GPT2 = "gpt2:n_layer=1,n_embd=64,n_head=2,seq=16"  # the spec test_graph captures too (session cache)
CONVNET = """
import torch
class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 1, bias=False)
        self.fc = torch.nn.Linear(8 * 8 * 8, 10)
    def forward(self, x, y):
        h = torch.relu(self.conv2(torch.relu(self.conv1(x)))).flatten(1)
        return torch.nn.functional.cross_entropy(self.fc(h), y)
def make(batch_size=4):
    return ConvNet(), (torch.randn(batch_size, 3, 8, 8), torch.randint(0, 10, (batch_size,)))
"""


def _by_param(cands):
    return {c.param: c for c in cands}


def test_mlp_linear_layers_are_candidates(captured):
    cap = captured("mlp")  # 64 -> 256 -> 256 -> 256 -> 10, batch 32
    g = cap.graph
    cands = _by_param(find_candidates(g))
    dims = [(64, 256), (256, 256), (256, 256), (256, 10)]
    for k, (fan_in, fan_out) in enumerate(dims):
        w = cands[f"model.net.{2 * k}.weight"]
        assert w.kind == "mm"
        assert w.grad_bytes == fan_in * fan_out * 4
        assert w.recompute_flops == 2 * fan_in * fan_out * g.batch_size
        x, dy = sorted(w.factors, key=lambda f: f.phase != "bwd")[::-1]  # (fwd/input X, bwd dY)
        assert dy.phase == "bwd" and dy.bytes_per_sample == fan_out * 4
        assert x.phase in ("fwd", "input") and x.bytes_per_sample == fan_in * 4
        assert all(f.batch_dim == 0 for f in w.factors)
        b = cands[f"model.net.{2 * k}.bias"]
        assert b.kind == "sum" and b.factors == (dy,)  # the bias shares the weight's dY
        assert w.op_name in {g.ops[i].name for i in g.groups[w.group].ops}
    assert len(cands) == 8
    assert {c.param for c in find_candidates(g)} == {p.name for p in g.params}


def test_gpt2_conv1d_addmm_layers_are_candidates(captured):
    cap = captured(GPT2, batch=4)
    g = cap.graph
    cands = _by_param(find_candidates(g))
    seq, e = 16, 64
    per_sample_x = seq * e * 4  # one sequence of hidden states, fp32
    for layer in range(1):
        for mod, fan_in, fan_out in (("attn.c_attn", e, 3 * e), ("attn.c_proj", e, e),
                                     ("mlp.c_fc", e, 4 * e), ("mlp.c_proj", 4 * e, e)):
            c = cands[f"model.transformer.h.{layer}.{mod}.weight"]
            assert c.kind == "mm"
            assert c.grad_bytes == fan_in * fan_out * 4
            assert sorted(f.bytes_per_sample for f in c.factors) == sorted(
                [seq * fan_in * 4, seq * fan_out * 4])
            assert c.recompute_flops == 2 * seq * g.batch_size * fan_in * fan_out
            assert any(f.bytes_per_sample == per_sample_x for f in c.factors)
            assert cands[f"model.transformer.h.{layer}.{mod}.bias"].kind == "sum"
    # tied token embedding / lm_head: its gradient is a sum of two contributions -> not SFB
    assert "model.transformer.wte.weight" not in cands
    assert "model.transformer.wpe.weight" not in cands


def test_bert_qkv_share_their_input_factor(captured):
    cap = captured("bert:n_layer=1,n_embd=64,n_head=2,seq=16", batch=4, groups=8)
    cands = _by_param(find_candidates(cap.graph))
    pre = "model.bert.encoder.layer.0.attention.self."
    xs = [{f.tensor for f in cands[pre + m + ".weight"].factors if f.phase == "fwd"} for m in ("query", "key", "value")]
    assert len(xs[0]) == 1 and xs[0] == xs[1] == xs[2]


def test_convolutions_are_not_claimed(tmp_path):
    (tmp_path / "convnet.py").write_text(CONVNET)
    cap = capture(load_workload(f"{tmp_path / 'convnet.py'}:make"), num_groups=4)
    g = cap.graph
    cands = _by_param(find_candidates(g))
    conv_weights = {t for t, v in cap.state.items() if v.dim() == 4}
    assert len(conv_weights) == 2
    assert not conv_weights & set(cands)
    assert all("convolution" not in g.ops[c.op].target for c in cands.values())
    assert cands["model.fc.weight"].kind == "mm"  # the classifier head still is
    assert "model.conv1.bias" not in cands  # convolution_backward computes it internally too


def test_candidates_need_batch_on_both_factors():
    """An mm whose operands do not both carry the batch along the contraction is ignored."""
    from tag.graph.ir import Affine, Op, OpGraph, Param, Tensor

    t = [Tensor("w", "param", Affine(64, 0), None, -1),
         Tensor("x", "input", Affine(0, 16), 0, -1),
         Tensor("const", "const", Affine(64, 0), None, -1),
         Tensor("xt", "grad", Affine(0, 16), 1, 0),
         Tensor("mm", "grad", Affine(64, 0), None, 1)]
    ops = [Op("xt", "aten.permute.default", "bwd", Affine(), Affine(), Affine(), [1], [3], True),
           Op("mm", "aten.mm.default", "bwd", Affine(0, 32), Affine(), Affine(), [3, 2], [4], False)]
    g = OpGraph("toy", 4, "sgd", ops, t, [Param("w", 0, 4, -1, 16, 64, 0)])
    assert find_candidates(g) == []  # right operand has no batch dim
    t[2] = Tensor("dy", "grad", Affine(0, 16), 0, -1)
    (c,) = find_candidates(g)
    assert c.op_name == "mm" and {f.name for f in c.factors} == {"x", "dy"}
