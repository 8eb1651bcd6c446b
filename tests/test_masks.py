"""Constant attention masks folded into ``is_causal`` or dropped (:mod:`tag.graph.masks`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tag.graph.capture import capture, causal_fraction
from tag.graph.ir import OpGraph
from tag.graph.masks import SDPA, fold_attention_masks, mask_kind
from tag.parallel.tensor_parallel import base_name
from tag.workloads import load_workload

L = 6


def _tril(n: int = L) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


@pytest.mark.parametrize(("mask", "kind"), [
    (torch.ones(2, 1, L, L, dtype=torch.bool), "none"),
    (torch.zeros(1, 1, 1, L), "none"),  # additive, broadcast over the queries
    (_tril().expand(2, 1, L, L), "causal"),
    (torch.zeros(L, L).masked_fill(~_tril(), float("-inf")), "causal"),
    (torch.zeros(L, L).masked_fill(~_tril(), torch.finfo(torch.float32).min), "causal"),  # Hugging Face's fill
    (torch.zeros(L, L, dtype=torch.bfloat16).masked_fill(~_tril(), torch.finfo(torch.bfloat16).min), "causal"),
    (_tril().logical_and(torch.tensor([True] * (L - 1) + [False])), None),  # causal and a padded key
    (_tril().tril(-1), None),  # strictly below the diagonal
    (torch.ones(L, L).tril() - 1.0, None),  # -1: a bias, not a mask
    (torch.arange(L, dtype=torch.float32)[None, :].expand(L, L) * -0.5, None),  # ALiBi-like
    (torch.ones(L, L + 2, dtype=torch.bool).tril(), None),  # not square: no causal flag
    (torch.ones(L, L, dtype=torch.int64), None),
])
def test_mask_kind(mask, kind):
    assert mask_kind(mask, L, mask.shape[-1]) == kind


class _Attention(nn.Module):
    """SDPA with a mask built in ``forward`` from constants (as Hugging Face builds it), or from
    the input (a padding mask), or with a dropout and scale to keep."""

    def __init__(self, mask: str):
        super().__init__()
        self.mask, self.proj = mask, nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        pos = torch.arange(x.shape[1])
        if self.mask == "causal":
            m = (pos[None, :] <= pos[:, None])[None, None].expand(x.shape[0], 1, -1, -1)
        elif self.mask == "full":
            m = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool)
        else:  # padding read from the input: not a constant
            m = (x.sum(-1) > -1e9)[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3).sum()


@pytest.mark.parametrize(("mask", "causal", "kept"), [("causal", True, False), ("full", False, False),
                                                      ("input", False, True)])
def test_fold_rewrites_constant_masks_exactly(mask, causal, kept):
    torch.manual_seed(0)
    model, x = _Attention(mask), torch.randn(2, L, 8)
    ep = torch.export.export(model, (x,), strict=False)
    before = len(ep.graph.nodes)
    want = ep.module()(x)
    fold_attention_masks(ep)
    (node,) = [n for n in ep.graph.nodes if n.target is SDPA]
    assert (node.args[3] is not None) == kept
    assert node.kwargs["scale"] == 0.3  # keyword-only arguments survive
    assert (node.args[5] if len(node.args) > 5 else False) == causal
    assert (len(ep.graph.nodes) < before) == (not kept)  # the mask's ops are erased with it
    torch.testing.assert_close(ep.module()(x), want, rtol=1e-6, atol=1e-6)


def test_zoo_masks_folded_on_the_meta_device():
    """The real-size presets are captured on the meta device, where a mask has no values: the fold
    evaluates it on the CPU. GPT-2 and Llama attend causally, BERT to everything; no attention op
    reads a mask and the causal ones count the triangle's FLOPs."""
    for spec, causal in (("gpt2:n_layer=2,n_embd=32,n_head=2,seq=16,vocab=64,attn=sdpa", True),
                         ("bert:n_layer=2,n_embd=32,n_head=2,seq=16,vocab=64,attn=sdpa", False)):
        eager = capture(load_workload(spec.replace("sdpa", "eager"), batch=2), num_groups=4).graph
        graph = capture(load_workload(spec, batch=2, abstract=True), num_groups=4).graph
        fwd = [o for o in graph.ops if base_name(o.target) == "_scaled_dot_product_flash_attention_for_cpu"]
        assert len(fwd) == 2 and all(len(o.inputs) == 3 for o in fwd)
        products = sum(o.flops.at(2) for o in eager.ops if base_name(o.target) == "bmm" and o.phase == "fwd")
        ratio = sum(o.flops.at(2) for o in fwd) / products
        assert ratio == pytest.approx(causal_fraction(16, 16) if causal else 1.0)
        att = [o for o in graph.ops if o.attention is not None]  # forward and backward kernels, lengths recorded
        assert sorted(base_name(o.target) for o in att) == sorted(
            ["_scaled_dot_product_flash_attention_for_cpu"] * 2 + ["_scaled_dot_product_flash_attention_for_cpu_backward"] * 2)
        assert {o.attention for o in att} == {(16, 16, causal, 0.0)}
        assert [o.attention for o in OpGraph.from_json(graph.to_json()).ops] == [o.attention for o in graph.ops]
        assert not any(o.attention for o in eager.ops)


def test_causal_fraction():
    assert causal_fraction(4, 4) == 10 / 16
    assert causal_fraction(2, 4) == 3 / 8  # rows see 1 and 2 of 4 keys
    assert causal_fraction(4, 2) == 7 / 8  # rows see 1, 2, 2, 2 of 2 keys


def test_mask_above_the_limit_at_the_batch_is_folded_from_one_row(monkeypatch, caplog):
    """A constant mask reads no input, so each of its batch rows is the same: it is evaluated for
    one row, and a mask whose whole [B, 1, L, S] is over the limit (GPT-2 at seq 2048 from batch 65
    on) is folded all the same. Before, batch 64 fitted and 65 did not: the two captures differed
    and the graph cost 47x its batch-63 one."""
    import tag.graph.masks as masks

    spec = "gpt2:n_layer=1,n_embd=32,n_head=2,seq=16,vocab=64,attn=sdpa"
    monkeypatch.setattr(masks, "MAX_MASK_ELEMENTS", 16 * 16 * 3)  # 3 rows fit, not 4 or 5
    graphs = {}
    with caplog.at_level("WARNING", logger="tag.graph.capture"):
        for b in (3, 4, 5):
            graphs[b] = capture(load_workload(spec, batch=b, abstract=True), num_groups=2).graph
    assert "differ" not in caplog.text
    for g in graphs.values():
        att = [o for o in g.ops if o.attention is not None and o.phase == "fwd"]
        assert att and all(o.attention[2] for o in att) and all(len(o.inputs) == 3 for o in att)  # causal, no mask
    per_sample = [graphs[b].flops(batch=b) / b for b in (3, 4, 5)]
    assert per_sample[1] == pytest.approx(per_sample[0], rel=1e-6) and per_sample[2] == pytest.approx(per_sample[0], rel=1e-6)
