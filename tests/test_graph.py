"""Capture, FLOP cross-check, batch-dimension probing, grouping invariants and stages."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tag.errors import WorkloadError
from tag.graph import OpGraph, capture
from tag.graph.stages import build_stages, group_phase_assignment
from tag.workloads import list_zoo, load_workload

ZOO = sorted(list_zoo())


def reference_flops(wl) -> float:
    """FLOPs of one forward+backward measured by PyTorch's own counter in eager mode."""
    model = wl.model
    with FlopCounterMode(display=False) as fc:
        model(*wl.inputs).backward()
    model.zero_grad(set_to_none=True)
    return float(fc.get_total_flops())


@pytest.mark.parametrize("spec", ZOO)
def test_zoo_flops_match_flop_counter(spec, captured):
    cap = captured(spec)
    ref = reference_flops(load_workload(spec))
    assert ref > 0
    assert cap.graph.flops(("fwd", "bwd")) == pytest.approx(ref, rel=0.05)


FACTORY = textwrap.dedent('''
    import torch
    from torch import nn

    class Odd(nn.Module):
        """A model TAG has never seen: embedding, GRU, conv1d, a tied projection."""
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 24)
            self.rnn = nn.GRU(24, 32, batch_first=True)
            self.conv = nn.Conv1d(32, 24, 3, padding=1)
            self.unused = nn.Linear(3, 3)  # never reaches the loss

        def forward(self, ids, target):
            h, _ = self.rnn(self.emb(ids))
            h = self.conv(h.transpose(1, 2)).transpose(1, 2)
            logits = h @ self.emb.weight.t()  # tied with the embedding
            return nn.functional.cross_entropy(logits.reshape(-1, 50), target.reshape(-1))

    def make(batch_size=4):
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 50, (batch_size, 10), generator=g)
        return Odd(), (ids, torch.randint(0, 50, (batch_size, 10), generator=g))
''')


def test_unseen_factory_model(tmp_path):
    path = tmp_path / "odd_model.py"
    path.write_text(FACTORY)
    wl = load_workload(f"{path}:make", batch=6)
    cap = capture(wl, num_groups=6)
    g = cap.graph
    assert g.flops(("fwd", "bwd")) == pytest.approx(reference_flops(load_workload(f"{path}:make", batch=6)), rel=0.05)
    names = {p.name for p in g.params}
    assert not any("unused" in n for n in names)  # pruned: it gets no gradient
    assert any("emb.weight" in n for n in names)
    inputs = [t for t in g.tensors if t.kind == "input"]
    assert [t.batch_dim for t in inputs] == [0, 0]


CONSTANTS = textwrap.dedent('''
    import torch
    from torch import nn

    class Constants(nn.Module):
        """Non-batch tensors made inside the forward: a table from ``arange`` and a buffer, noise
        from ``rand``, a scalar holding the batch size."""
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("inv", torch.arange(1.0, 9.0))

        def forward(self, x, y):
            table = torch.cos(torch.arange(8.0) * self.inv)
            noisy = self.lin.weight + torch.rand(8, 8)
            count = torch.full((), float(x.shape[0]))
            return (((x * table) @ noisy.t() + self.lin.bias.exp() - y) ** 2).sum() / count

    def make(batch_size=4):
        g = torch.Generator().manual_seed(1)
        return Constants(), (torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 8, generator=g))
''')


def test_batch_independent_tensors(tmp_path):
    """What a pipeline may move once per iteration: non-batch tensors computed from parameters,
    buffers and constants (``arange`` included), not those below a random op or an op whose
    arguments hold the batch size (recorded by the capture: they differ at its two batches). A
    graph without that record takes every op without inputs to hold it."""
    from tag.graph.gradients import batch_independent_tensors

    path = tmp_path / "constants_model.py"
    path.write_text(CONSTANTS)
    g = capture(load_workload(f"{path}:make", batch=4), num_groups=2).graph
    by_target = {}
    for op in g.ops:
        by_target.setdefault(op.target.split(".")[1], []).append(op)
    assert [op.reads_batch for op in by_target["arange"] + by_target["full"]] == [False, True]
    fixed = {g.tensors[t].name for t in batch_independent_tensors(g)}
    out = lambda kind: g.tensors[by_target[kind][0].outputs[0]].name  # noqa: E731
    assert {out("arange"), out("cos"), out("exp")} <= fixed  # the table, a function of the bias
    assert not {out("rand"), out("add"), out("permute"), out("full")} & fixed  # noise, weight + noise, the count
    g2 = OpGraph.from_json(g.to_json())
    assert [op.reads_batch for op in g2.ops] == [op.reads_batch for op in g.ops]
    for op in g2.ops:  # as stored before the capture recorded it
        op.reads_batch = None
    old = {g.tensors[t].name for t in batch_independent_tensors(g2)}
    assert out("exp") in old and out("cos") not in old and old < fixed
    assert "reads_batch" not in g2.to_dict()["ops"][0]


FIXED_ATTENTION = textwrap.dedent('''
    import torch
    from torch import nn
    from torch.nn import functional as F

    class FixedAttention(nn.Module):
        """Fused attention over parameters only (the same in every micro-batch without dropout)."""
        def __init__(self, dropout_p):
            super().__init__()
            self.q = nn.Parameter(torch.randn(1, 2, 4, 8))
            self.k = nn.Parameter(torch.randn(1, 2, 4, 8))
            self.dropout_p = dropout_p

        def forward(self, x):
            table = F.scaled_dot_product_attention(self.q, self.k, self.k, dropout_p=self.dropout_p)
            return ((x * table.flatten()) ** 2).sum()

    def make(batch_size=4, dropout_p=0.0):
        return FixedAttention(dropout_p), (torch.randn(batch_size, 64, generator=torch.Generator().manual_seed(1)),)

    def make_dropout(batch_size=4):
        return make(batch_size, 0.5)
''')


@pytest.mark.parametrize("dropout_p", [0.0, 0.5])
def test_fused_attention_is_batch_independent_unless_it_drops_out(tmp_path, dropout_p):
    """PyTorch tags every fused attention overload ``nondeterministic_seeded``; the capture's
    record of its dropout (``Op.attention``) decides instead: over parameters only, its output is
    moved once per pipeline iteration without dropout, never with (each micro-batch draws its own
    mask)."""
    from tag.graph.gradients import batch_independent_tensors, draws_random

    path = tmp_path / "fixed_attention.py"
    path.write_text(FIXED_ATTENTION)
    g = capture(load_workload(f"{path}:{'make' if dropout_p == 0.0 else 'make_dropout'}", batch=4), num_groups=2).graph
    fixed = batch_independent_tensors(g)
    if dropout_p == 0.0:  # the fused kernel, recorded without dropout: its output is fixed
        att = [op for op in g.ops if op.attention is not None and op.phase == "fwd"]
        assert len(att) == 1 and att[0].attention[3] == 0.0 and att[0].outputs[0] in fixed
    else:  # whatever kernel the CPU runs it on, what draws the mask and what follows it are not
        drawing = [op for op in g.ops if op.phase == "fwd" and draws_random(op)]
        assert drawing and not any(t in fixed for op in drawing for t in op.outputs)


def test_batch_probe_and_affine_costs(captured):
    cap = captured("gpt2:n_layer=1,n_embd=64,n_head=2,seq=16", batch=4)
    g = cap.graph
    loss = g.tensors[g.loss]
    assert loss.batch_dim is None
    assert all(g.tensors[p.tensor].batch_dim is None for p in g.params)
    assert any(t.batch_dim == 0 for t in g.tensors if t.kind == "activation")
    # the affine fit from batches 4 and 5 predicts a capture at batch 9
    big = capture(load_workload("gpt2:n_layer=1,n_embd=64,n_head=2,seq=16", batch=9), num_groups=16).graph
    assert g.flops(("fwd", "bwd"), batch=9) == pytest.approx(big.flops(("fwd", "bwd")), rel=1e-6)
    assert g.activation_bytes(9) == pytest.approx(big.activation_bytes(), rel=1e-6)


@pytest.mark.parametrize("spec", ["gpt2", "resnet", "mlp"])
def test_grouping_invariants(spec, captured):
    g = captured(spec).graph
    seen = [0] * len(g.ops)
    for grp in g.groups:
        assert grp.ops, "no empty groups"
        for i in grp.ops:
            seen[i] += 1
            assert g.ops[i].group == grp.index
    assert seen == [1] * len(g.ops)
    assert 1 <= g.num_groups <= 16
    for p in g.params:
        upd = g.ops[p.update]
        grad_op = g.ops[g.tensors[p.grad].producer]
        assert upd.group == p.group == grad_op.group
    # acyclic group graph: forward data flows to the same or later groups, backward data to
    # the same or earlier groups
    for t in g.tensors:
        if t.producer < 0:
            continue
        src = g.ops[t.producer]
        for c in t.consumers:
            dst = g.ops[c]
            if src.phase == "fwd" and dst.phase == "fwd":
                assert dst.group >= src.group
            if src.phase == "bwd" and dst.phase == "bwd":
                assert dst.group <= src.group


def test_groups_balance_compute(captured):
    from tag.graph.grouping import op_weight

    g = captured("gpt2:n_layer=4", groups=8).graph
    w = [sum(op_weight(g, i) for i in grp.ops) for grp in g.groups]
    assert g.num_groups == 8
    assert max(w) < 4 * (sum(w) / len(w))


def test_graph_json_round_trip(captured):
    g = captured("mlp").graph
    g2 = OpGraph.from_json(g.to_json())
    assert g2.signature() == g.signature()
    assert g2.flops() == g.flops()
    assert g2.to_dict() == g.to_dict()


def test_stages_reproduce_joint_graph(captured):
    cap = captured("gpt2:n_layer=1,n_embd=64,n_head=2,seq=16", batch=4)
    wl = load_workload("gpt2:n_layer=1,n_embd=64,n_head=2,seq=16", batch=4)
    stages = build_stages(cap, group_phase_assignment(cap))
    env = {n: cap.state[t] for n, kind, t in cap.placeholders if kind != "input"}
    user = [n for n, kind, _ in cap.placeholders if kind == "input"]
    env.update(dict(zip(user, wl.inputs)))
    g = cap.graph
    order = [(i, "fwd") for i in range(g.num_groups)] + [(i, "bwd") for i in reversed(range(g.num_groups))]
    for key in order:
        if key in stages:
            env.update(stages[key](env))
    full = cap.joint(*[env[n] for n, _, _ in cap.placeholders])
    outs = [a.name for a in next(n for n in cap.joint.graph.nodes if n.op == "output").all_input_nodes]
    for name, ref in zip(outs, full):
        assert torch.equal(env[name], ref), name


def test_untraceable_model_is_one_line_error(tmp_path):
    (tmp_path / "branchy.py").write_text(textwrap.dedent('''
        import torch
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__(); self.l = torch.nn.Linear(4, 4)
            def forward(self, x):
                y = self.l(x)
                if y.sum() > 0:          # data-dependent Python control flow
                    return y.mean()
                return (y * 2).mean()
        def make(batch_size=4):
            return M(), (torch.randn(batch_size, 4),)
    '''))
    with pytest.raises(WorkloadError) as e:
        capture(load_workload(f"{tmp_path / 'branchy.py'}:make"))
    assert "\n" not in str(e.value)
    assert "capture" in str(e.value)


def test_optimizer_choice_changes_state_bytes(captured):
    adam = captured("mlp").graph
    sgd = captured("mlp", optimizer="sgd-plain").graph
    assert sum(p.opt_state_bytes for p in adam.params) == 2 * adam.param_bytes
    assert sum(p.opt_state_bytes for p in sgd.params) == 0
    assert {op.target for op in sgd.ops if op.phase == "opt"} == {"optim.sgd-plain"}
    with pytest.raises(WorkloadError):
        capture(load_workload("mlp"), optimizer="lamb")


@pytest.mark.parametrize("spec", ["gpt2:n_layer=1,n_embd=32,n_head=2,seq=8,vocab=64", "resnet:width=4,image=16",
                                  "odd"])
def test_joint_graph_copy_is_the_retrace(spec, tmp_path, monkeypatch):
    """The joint graph copied node by node (capture._no_joint_retrace) is the one aot_export_module's
    make_fx retrace records: names, targets, arguments, values and strides (tied and unused weights,
    a GRU's multi-output ops, BatchNorm's buffer mutations)."""
    import contextlib
    import sys

    from tag.graph.fold import same_graph

    cap = sys.modules["tag.graph.capture"]
    if spec == "odd":
        (tmp_path / "odd.py").write_text(FACTORY)
        spec = f"{tmp_path / 'odd.py'}:make"
    wl = load_workload(spec, batch=2)
    copies = []
    flat = cap._flat_joint
    monkeypatch.setattr(cap, "_flat_joint", lambda *a: copies.append(flat(*a)) or copies[-1])
    ep = cap.export_joint(wl.model, wl.inputs)
    assert copies and all(c is not None for c in copies)  # the copy was made, not the retrace
    monkeypatch.setattr(cap, "_no_joint_retrace", contextlib.nullcontext)
    ref = cap.export_joint(wl.model, wl.inputs)
    assert same_graph(ep.graph, ep.graph_signature, ref.graph, ref.graph_signature) is None
    for a, b in zip(ep.graph.nodes, ref.graph.nodes):
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(va, torch.Tensor):
            assert va.stride() == vb.stride(), a.name


def test_fused_attention_stages_on_a_gpu_device_keep_shapes(captured):
    """The CPU flash attention kernels of a captured graph (CUDA has none) run as memory-efficient
    attention on a GPU stage: on the meta device (the CUDA kernels' shape functions) the retargeted
    stages give every value the shape and dtype the CPU run gives, the logsumexp included."""
    import copy

    from tag.graph.stages import efficient_attention, retarget_devices

    spec = "tests/data/attention_model.py:make"
    cap = captured(spec, batch=4)
    wl = load_workload(spec, batch=4)
    args = [cap.state[t] if kind != "input" else None for _, kind, t in cap.placeholders]
    user = iter(wl.inputs)
    args = [a if a is not None else next(user) for a in args]
    meta = copy.deepcopy(cap.joint)
    retarget_devices(meta, torch.device("meta"))
    targets = [n.target for n in meta.graph.nodes if n.op == "call_function"]
    assert efficient_attention in targets and not any("for_cpu" in str(t) for t in targets)

    def shapes(gm, inputs):
        env = {}
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                env[n.name] = inputs.pop(0)
            elif n.op == "call_function":
                a, kw = torch.fx.node.map_arg((n.args, n.kwargs), lambda x: env[x.name])
                env[n.name] = n.target(*a, **kw)
        return {k: (tuple(v.shape), v.dtype, v.stride()) for k, v in env.items() if isinstance(v, torch.Tensor)}

    cpu = shapes(cap.joint, list(args))
    assert shapes(meta, [a.to("meta") for a in args]) == cpu


def test_fused_attention_results_take_the_captured_strides():
    """A retargeted attention result whose strides differ from the captured ones (CUDA's backward
    returns slices of one packed gradient when q, k, v are slices of one projection) is copied into
    the captured strides, values unchanged; results already so strided are not copied."""
    from tag.graph.stages import _restrided

    packed = torch.randn(2, 8, 3, 4, 5)  # [B, L, 3, H, D]: gradients of q, k, v in one tensor
    grads = tuple(packed[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, L, D], not contiguous
    want = ((160, 40, 5, 1),) * 3  # what the CPU kernel returns: contiguous [B, H, L, D]
    out = _restrided(grads, want)
    assert [t.stride() for t in out] == list(want)
    assert all(torch.equal(a, b) for a, b in zip(out, grads))
    same = _restrided(out, want)
    assert all(a is b for a, b in zip(same, out))


def test_joint_graph_code_is_generated_when_first_run():
    """export_joint builds its graph modules without generating their code (capture._lazy_codegen):
    the returned joint module generates the same code a plain GraphModule does when it is first
    run or read, runs as the model does, and GraphModule is left as it was."""
    import sys

    from torch.fx._lazy_graph_module import _LazyGraphModule

    cap = sys.modules["tag.graph.capture"]
    new_before = torch.fx.GraphModule.__dict__["__new__"]
    wl = load_workload("gpt2:n_layer=1,n_embd=32,n_head=2,seq=8,vocab=64", batch=2)
    ep = cap.export_joint(wl.model, wl.inputs)
    gm = ep.graph_module
    assert isinstance(gm, _LazyGraphModule) and gm._needs_recompile()  # no code generated yet
    assert torch.fx.GraphModule.__dict__["__new__"] is new_before
    assert not isinstance(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), _LazyGraphModule)
    plain = torch.fx.GraphModule(gm, gm.graph)
    state = {**ep.state_dict, **ep.constants}
    args = [state[s.target] if s.target is not None else None for s in ep.graph_signature.input_specs]
    user = iter(wl.inputs)
    args = [next(user) if a is None else a for a in args]
    loss = gm(*args)[0]
    assert not gm._needs_recompile() and gm.code == plain.code
    assert torch.equal(loss, plain(*args)[0])
    assert torch.allclose(loss, wl.model(*wl.inputs))


@pytest.mark.parametrize("length", [197, 1024])
def test_attention_bias_is_what_the_memory_efficient_kernel_checks(length):
    """The captured ``[B, 1, L, S]`` mask of the HF zoo becomes the bias the memory-efficient CUDA
    kernel accepts (what ``F.scaled_dot_product_attention`` prepares): ``[B, H, L, S]`` of the
    query's dtype, rows contiguous and 16-element aligned, values those of the broadcast mask;
    a boolean mask becomes 0 / -inf."""
    from tag.graph.stages import _attention_bias

    q = torch.zeros(2, 3, length, 8, dtype=torch.bfloat16)
    k = torch.zeros(2, 3, length, 8, dtype=torch.bfloat16)
    mask = torch.randn(2, 1, length, length).to(torch.bfloat16)
    bias = _attention_bias(mask, q, k)
    assert bias.shape == (2, 3, length, length) and bias.dtype == torch.bfloat16
    assert bias.stride(-1) == 1 and all(st % 16 == 0 and st > 0 for st in bias.stride()[:3])
    assert torch.equal(bias, mask.expand(2, 3, length, length))
    keep = torch.rand(length, length) > 0.5
    b = _attention_bias(keep, q, k)
    assert torch.equal(b[1, 2], torch.where(keep, 0.0, float("-inf")).to(torch.bfloat16))
    assert _attention_bias(None, q, k) is None


def test_mixed_precision_follows_cuda_autocasts_lists():
    """bf16 capture (and the single-process reference) run CUDA autocast's FP32 ops in FP32 on the
    CPU too: ``pow`` (GPT-2's tanh GELU), softmax, sums; autocast's own low-precision ops stay
    bf16, ops on neither list keep their input's dtype, and nothing changes outside the context."""
    from tag.graph.capture import capture
    from tag.graph.precision import autocast

    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with autocast("bf16"):
        assert torch.pow(x, 3.0).dtype == torch.float32 and (x**2).dtype == torch.float32
        assert torch.nn.functional.softmax(x, -1).dtype == torch.float32 and x.sum().dtype == torch.float32
        assert torch.tanh(x).dtype == torch.bfloat16
        assert torch.mm(x.float(), x.float().T).dtype == torch.bfloat16
    assert torch.pow(x, 3.0).dtype == torch.bfloat16
    graph = capture(load_workload("gpt2", batch=2), num_groups=2, precision="bf16").graph
    pows = [o for o in graph.ops if o.target.startswith("aten.pow") and o.phase == "fwd"]
    assert pows and all(o.dtype == "float32" for o in pows)
    assert any(o.target == "aten.addmm.default" and o.dtype == "bfloat16" for o in graph.ops)


def test_attention_bias_is_prepared_once_per_mask():
    """A mask every layer reads (forward and backward) is prepared into a bias once: the same
    tensor comes back while the mask lives unwritten, for the same query and key shapes; a write
    to the mask, another shape or another mask prepares anew; a bias that is only a view of its
    mask is not kept, and nothing is left behind once a mask is gone."""
    import gc

    from tag.graph import stages

    q = torch.zeros(2, 3, 197, 8, dtype=torch.bfloat16)
    mask = torch.rand(2, 1, 197, 197) > 0.5  # padding-like: converted, expanded, padded: a new tensor
    first = stages._attention_bias(mask, q, q)
    assert stages._attention_bias(mask, q, q) is first
    assert stages._attention_bias(mask, q[:, :2], q[:, :2]) is not first  # other heads
    again = stages._attention_bias(mask, q, q)
    mask[0, 0, 0, 0] = True  # written: its version moves
    fresh = stages._attention_bias(mask, q, q)
    assert fresh is not again and torch.equal(fresh[0, 0, 0, 0], torch.tensor(0.0, dtype=torch.bfloat16))
    q16 = torch.zeros(2, 3, 208, 8, dtype=torch.bfloat16)
    ready = torch.zeros(2, 3, 208, 208, dtype=torch.bfloat16)  # already the kernel's layout
    assert stages._attention_bias(ready, q16, q16)._base is ready  # handed back as a view, not kept
    assert id(ready) not in stages._BIASES
    n = len(stages._BIASES)
    del mask, first, again, fresh
    gc.collect()
    assert len(stages._BIASES) == n - 1
