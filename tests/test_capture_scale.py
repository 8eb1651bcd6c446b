"""Capture at scale: meta-device models, the graph cache, zoo presets, backward kernels kept whole,
and the one-line refusals (a model no topology device set can hold, data-dependent control flow)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from test_hardening import one_line_error, run_tag

from tag.errors import WorkloadError
from tag.graph import capture
from tag.graph.capture import export_joint
from tag.workloads import load_workload
from tag.workloads.zoo import zoo_entries, zoo_params

TINY_GPT2 = "gpt2:n_layer=1,n_embd=32,n_head=2,vocab=64,seq=8"

META_FACTORY = textwrap.dedent('''
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 16)
            self.l1 = nn.Linear(16, 32)
            self.out = nn.Linear(32, 20)

        def forward(self, ids, y):
            h = torch.relu(self.l1(self.emb(ids)))
            return nn.functional.cross_entropy(self.out(h).flatten(0, 1), y.flatten())

    class Branchy(Net):
        def forward(self, ids, y):
            h = self.l1(self.emb(ids))
            if h.sum().item() > 0:  # reads a value: a meta tensor has none
                h = h * 2
            return nn.functional.cross_entropy(self.out(h).flatten(0, 1), y.flatten())

    def _make(cls, batch_size):
        with torch.device("meta"):
            return cls(), (torch.randint(0, 20, (batch_size, 5)), torch.randint(0, 20, (batch_size, 5)))

    def make(batch_size=4):
        return _make(Net, batch_size)

    def branchy(batch_size=4):
        return _make(Branchy, batch_size)
''')


def test_abstract_zoo_capture_equals_the_real_one():
    """A zoo model built on the meta device (no weights) gives the very graph of the real model,
    tied embedding/LM-head weight included."""
    real = capture(load_workload(TINY_GPT2, batch=3), num_groups=4).graph
    wl = load_workload(TINY_GPT2, batch=3, abstract=True)
    assert all(p.is_meta for p in wl.model.parameters()) and wl.inputs[0].is_meta
    abstract = capture(wl, num_groups=4).graph
    assert abstract.to_dict() == real.to_dict()
    assert len(abstract.params) == len(list(wl.model.parameters()))  # the tied weight is one parameter


def test_meta_factory_is_captured_without_running_it(tmp_path):
    path = tmp_path / "meta_model.py"
    path.write_text(META_FACTORY)
    wl = load_workload(f"{path}:make", batch=4)  # no eager check: a meta model cannot run
    g = capture(wl, num_groups=2).graph
    # fwd: l1 and out matmuls, 2*B*5*(16*32 + 32*20) FLOPs; bwd twice that (the input grad of l1 too)
    assert g.flops(("fwd",)) == 2 * 4 * 5 * (16 * 32 + 32 * 20)
    assert g.flops(("fwd",), batch=7) == 2 * 7 * 5 * (16 * 32 + 32 * 20)
    assert g.num_params == 20 * 16 + 16 * 32 + 32 + 20 * 32 + 20


def test_meta_model_with_data_dependent_control_flow_is_one_line(tmp_path):
    path = tmp_path / "meta_branchy.py"
    path.write_text(META_FACTORY)
    with pytest.raises(WorkloadError) as e:
        capture(load_workload(f"{path}:branchy", batch=4))
    msg = str(e.value)
    assert "\n" not in msg
    assert "data-dependent control flow at meta_branchy.py:" in msg and "(if h.sum().item() > 0:" in msg, msg
    assert "the branch on zuf0 > 0.0 reads tensor values" in msg


def test_backward_kernels_stay_single_ops_and_zero_dropout_is_gone(captured):
    """LayerNorm's and BatchNorm's backward are one op each (as eager's kernels), p=0 dropout is
    not a saved clone."""
    gpt2 = capture(load_workload(TINY_GPT2, batch=2), num_groups=2).graph
    targets = [op.target for op in gpt2.ops]
    assert targets.count("aten.native_layer_norm_backward.default") == targets.count("aten.native_layer_norm.default")
    assert "aten._softmax_backward_data.default" in targets
    assert not any("dropout" in t for t in targets)
    wl = load_workload(TINY_GPT2, batch=2)
    joint = export_joint(wl.model, wl.inputs).graph_module.graph
    assert not any(n.target is torch.ops.aten.dropout.default for n in joint.nodes)
    resnet = captured("resnet").graph
    assert any(op.target == "aten.native_batch_norm_backward.default" for op in resnet.ops)


def test_graph_cache_hit_miss_and_no_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TAG_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["inspect", "--model", "mlp:layers=1", "--batch", "4", "--groups", "2", "--json"]

    def inspect(*extra):
        rc, out, err = run_tag(capsys, *argv, *extra)
        assert rc == 0, err
        return json.loads(out)

    first = inspect()
    stored = list((tmp_path / "cache" / "graphs").glob("*.json"))
    assert not first["from_cache"] and len(stored) == 1
    second = inspect()
    assert second["from_cache"] and second["signature"] == first["signature"]
    assert second["flops_fwd_bwd"] == first["flops_fwd_bwd"] and second["activation_bytes"] == first["activation_bytes"]
    assert not inspect("--no-cache")["from_cache"]
    other = inspect("--optimizer", "sgd")  # another key: a miss, stored beside the first
    assert not other["from_cache"] and len(list((tmp_path / "cache" / "graphs").glob("*.json"))) == 2
    stored[0].write_text("{not json")  # a damaged entry is a miss, and replaced
    assert not inspect()["from_cache"] and inspect()["from_cache"]


def test_graph_key_covers_what_the_graph_depends_on(tmp_path):
    from tag.graph.cache import graph_key

    base = graph_key("gpt2", 8, "adam")
    assert base == graph_key(" gpt2 ", 8, "adam")
    assert len({base, graph_key("gpt2", 9, "adam"), graph_key("gpt2", 8, "sgd"),
                graph_key("gpt2", 8, "adam", precision="bf16"), graph_key("gpt2:n_layer=3", 8, "adam")}) == 5
    f = tmp_path / "m.py"
    f.write_text("def make(): pass\n")
    k1 = graph_key(f"{f}:make", 8, "adam", zoo=False)
    f.write_text("def make(): return 1\n")  # edited factory: another key
    assert graph_key(f"{f}:make", 8, "adam", zoo=False) != k1


TINY_TOPOLOGY = """name: tiny
machines:
  - {name: a, gpu: {name: tiny, tflops: 1, memory: 1 MB, memory_bandwidth: 1 GB/s}, count: 2, intra_bandwidth: 1 GB/s,
     host_memory: 1 MB}
"""


def test_model_larger_than_all_devices_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TAG_CACHE_DIR", str(tmp_path / "cache"))
    topo = tmp_path / "tiny.yaml"
    topo.write_text(TINY_TOPOLOGY)
    line = one_line_error(capsys, "simulate", "--model", "mlp", "--topology", str(topo), "--groups", "2",
                          "--baseline", "dp")
    assert "error: model mlp (batch 32) needs at least " in line and "of parameters, gradients and adam state" in line, line
    assert "than the 1.91 MiB of all 2 devices of tiny together (largest device 977 KiB), nor does it with the " \
        "optimizer offloaded to the 977 KiB of host memory; no plan fits" in line, line


def test_presets_are_listed_and_built_without_weights(capsys):
    table = zoo_entries()
    for name in ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "bert-base", "bert-large", "vit-b16",
                 "vit-l16", "resnet50", "resnet101", "resnet152", "vgg16", "vgg19", "llama-1b", "llama-7b",
                 "llama-13b", "llama-70b"):
        assert name in table
    assert zoo_params("gpt2-small") == 124_439_808  # the published GPT-2 small count (tied LM head)
    assert zoo_params("resnet50") == 25_557_032  # torchvision's resnet50
    assert zoo_params("llama-70b") == 68_976_648_192  # Llama-2 70B (grouped-query attention, untied head)
    wl = load_workload("llama-7b", abstract=True)  # 6.7e9 parameters, none allocated
    assert sum(p.numel() for p in wl.model.parameters()) == 6_738_415_616
    assert all(p.is_meta for p in wl.model.parameters()) and wl.inputs[0].shape == (4, 2048)
    rc, out, _ = run_tag(capsys, "inspect", "--list")
    assert rc == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert rows["llama-7b"][1:6] == ["6.74B", "4", "seq", "2048", "sdpa"], rows["llama-7b"]
    # the real-size transformers use fused attention, the plain zoo names the eager one
    assert {rows[n][5] for n in ("gpt2-small", "gpt2-xl", "bert-base", "bert-large", "vit-b16", "vit-l16",
                                 "llama-1b", "llama-13b")} == {"sdpa"}
    assert [rows[n][5] for n in ("gpt2", "bert", "vit", "llama", "resnet50")] == ["eager"] * 4 + ["-"]
