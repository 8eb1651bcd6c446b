"""Layer folding (tag.graph.fold): the graph of n identical blocks unrolled from a 3-block template
is the full capture's, op by op; models whose blocks are not identical are captured in full."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tag.graph import capture, capture_graph
from tag.graph.fold import NoFold, fold_capture
from tag.workloads import LossWrapper, Workload, load_workload

TINY = "n_embd=32,n_head=2"
CASES = [
    (f"gpt2:{TINY},vocab=64,seq=8,n_layer=4", "fp32"),
    (f"bert:{TINY},vocab=64,seq=8,n_layer=4", "fp32"),
    (f"vit:{TINY},image=16,patch=8,n_layer=4", "fp32"),
    (f"llama:{TINY},n_kv_head=1,ffn=48,vocab=64,seq=8,n_layer=4", "fp32"),
    (f"gpt2:{TINY},vocab=64,seq=8,n_layer=5", "bf16"),
    # fused attention (the presets' attn=sdpa): BERT's bidirectional one, Llama's with grouped KV heads in bf16
    (f"bert:{TINY},vocab=64,seq=8,attn=sdpa,n_layer=4", "fp32"),
    (f"llama:{TINY},n_kv_head=1,ffn=48,vocab=64,seq=8,attn=sdpa,n_layer=5", "bf16"),
]
"""The 3-block template unrolled by one block (n_layer=4) and by two (n_layer=5: GPT-2 and Llama once
each)."""


def _op_rows(g):
    """Everything a consumer of the graph reads, op by op (names aside: see the to_dict check)."""
    return [(op.target, op.phase, op.flops, op.bytes_read, op.bytes_written, op.batch, op.dtype, op.group, op.anchor,
             [(g.tensors[t].nbytes, g.tensors[t].batch_dim, g.tensors[t].producer) for t in op.inputs],
             [g.tensors[t].consumers for t in op.outputs]) for op in g.ops]


@pytest.mark.parametrize(("spec", "precision"), CASES)
def test_folded_capture_is_the_full_capture(spec, precision):
    wl = load_workload(spec, batch=3, abstract=True)
    assert wl.blocks == int(spec.rpartition("n_layer=")[2])
    folded, _ = fold_capture(wl, wl.blocks, "adam", precision)  # NoFold here fails the test
    folded.precision = precision
    full = capture(wl, num_groups=6, precision=precision).graph
    from tag.graph import group_ops

    group_ops(folded, 6)
    assert len(folded.ops) == len(full.ops) and len(folded.tensors) == len(full.tensors)
    assert _op_rows(folded) == _op_rows(full)
    assert [(p.name, p.numel, p.nbytes, p.opt_state_bytes, p.group) for p in folded.params] == \
        [(p.name, p.numel, p.nbytes, p.opt_state_bytes, p.group) for p in full.params]
    assert [(g.ops, g.params) for g in folded.groups] == [(g.ops, g.params) for g in full.groups]
    assert folded.flops() == full.flops() and folded.activation_bytes(5) == full.activation_bytes(5)
    assert folded.signature() == full.signature()
    assert folded.to_dict() == full.to_dict()  # names, tensors, everything


class Alternating(nn.Module):
    """Blocks that are not identical: odd blocks add a ReLU."""

    def __init__(self, n: int):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        self.head = nn.Linear(8, 16)

    def forward(self, ids, y):
        h = self.emb(ids)
        for i, b in enumerate(self.blocks):
            h = b(h)
            if i % 2:
                h = torch.relu(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _alternating(n: int, batch: int = 2) -> Workload:
    def make_inputs(b: int) -> tuple:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, 16, (b, 4), generator=g), torch.randint(0, 16, (b, 4), generator=g)

    torch.manual_seed(0)
    return Workload(f"alternating{n}", LossWrapper(Alternating(n)), make_inputs(batch), batch, make_inputs, n,
                    _alternating)


def test_blocks_that_differ_are_not_folded():
    wl = _alternating(6)
    with pytest.raises(NoFold, match="not one of three repeated runs|not the 2-block capture"):
        fold_capture(wl, 6, "adam", "fp32")
    # capture_graph falls back to the full capture: the graph of the model as it is
    assert capture_graph(wl, num_groups=4).to_dict() == capture(_alternating(6), num_groups=4).graph.to_dict()


def test_which_workloads_declare_blocks():
    wl = load_workload("gpt2-small", abstract=True)
    assert wl.blocks == 12
    small = wl.with_blocks(3)
    assert small.blocks == 3 and len(small.model.model.transformer.h) == 3
    assert small.batch_size == wl.batch_size and all(p.is_meta for p in small.model.parameters())
    assert load_workload("llama-7b", abstract=True).blocks == 32
    for spec in ("mlp", "resnet", "vgg"):
        wl = load_workload(spec)
        assert wl.blocks is None and wl.with_blocks is None
