"""Tests for tag.workloads: zoo models, overrides, user factories and error messages."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tag.errors import WorkloadError
from tag.workloads import LossWrapper, Workload, list_zoo, load_workload, resample

ZOO = ["mlp", "gpt2", "bert", "vit", "llama", "resnet", "vgg"]


@pytest.fixture(scope="module")
def zoo() -> dict[str, Workload]:
    return {name: load_workload(name) for name in ZOO}


def _nparams(w: Workload) -> int:
    return sum(p.numel() for p in w.model.parameters())


def test_list_zoo() -> None:
    z = list_zoo()
    assert sorted(z) == sorted(ZOO)
    assert all(isinstance(v, str) and "\n" not in v and "defaults" in v for v in z.values())


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_loss_and_grads(zoo: dict[str, Workload], name: str) -> None:
    w = zoo[name]
    assert w.name == name
    assert isinstance(w.model, LossWrapper)
    assert all(k.startswith("model.") for k, _ in w.model.named_parameters())
    assert all(isinstance(t, torch.Tensor) and t.shape[0] == w.batch_size for t in w.inputs)
    w.model.zero_grad(set_to_none=True)
    loss = w.model(*w.inputs)
    assert loss.dim() == 0 and loss.is_floating_point() and torch.isfinite(loss)
    loss.backward()
    missing = [k for k, p in w.model.named_parameters() if p.grad is None]
    assert not missing


@pytest.mark.parametrize("name", ZOO)
def test_zoo_export_non_strict(zoo: dict[str, Workload], name: str) -> None:
    w = zoo[name]
    ep = torch.export.export(w.model, w.inputs, strict=False)
    assert ep.graph_signature.user_outputs


@pytest.mark.parametrize("name", ["mlp", "gpt2", "resnet"])
def test_deterministic_under_seed(zoo: dict[str, Workload], name: str) -> None:
    a, b = zoo[name], load_workload(name, seed=0)
    # Compare parameters only: earlier tests ran the shared model (BatchNorm running stats moved).
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    assert all(torch.equal(x, y) for x, y in zip(a.inputs, b.inputs))
    c = load_workload(name, seed=1)
    assert not torch.equal(next(a.model.parameters()), next(c.model.parameters()))
    assert not torch.equal(a.inputs[0], c.inputs[0])


def test_seed_does_not_touch_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_workload("mlp", seed=5)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", ZOO)
def test_make_inputs_batch(zoo: dict[str, Workload], name: str) -> None:
    w = zoo[name]
    for b in (1, 3, 2 * w.batch_size):
        inputs = w.make_inputs(b)
        assert len(inputs) == len(w.inputs)
        for t, ref in zip(inputs, w.inputs):
            assert t.shape == (b, *ref.shape[1:]) and t.dtype == ref.dtype
    assert all(torch.equal(x, y) for x, y in zip(w.make_inputs(w.batch_size), w.inputs))
    with pytest.raises(WorkloadError):
        w.make_inputs(0)


def test_batch_argument() -> None:
    w = load_workload("gpt2", batch=3)
    assert w.batch_size == 3 and w.inputs[0].shape == (3, 64)
    assert load_workload("resnet", batch=5).inputs[0].shape == (5, 3, 32, 32)


@pytest.mark.parametrize(
    ("name", "override"),
    [("mlp", "hidden=64"), ("gpt2", "n_layer=3"), ("gpt2", "seq=32"), ("bert", "n_embd=64"),
     ("vit", "image=64"), ("resnet", "depth=34"), ("resnet", "width=8"), ("vgg", "depth=13"),
     ("vgg", "image=64")],
)
def test_overrides_change_param_count(zoo: dict[str, Workload], name: str, override: str) -> None:
    w = load_workload(f"{name}:{override}")
    assert w.name == f"{name}:{override}"
    assert _nparams(w) != _nparams(zoo[name])


def test_sizes_and_canonical_name() -> None:
    w = load_workload("gpt2:seq=16, n_embd=64 ,n_layer=1")
    assert w.name == "gpt2:n_layer=1,n_embd=64,seq=16"
    assert w.inputs[0].shape == (8, 16)
    assert load_workload("gpt2:n_layer=2").name == "gpt2"
    w = load_workload("resnet:depth=50,norm=gn,image=16")
    assert w.inputs[0].shape == (8, 3, 16, 16)
    assert torch.isfinite(w.model(*w.inputs))
    w = load_workload("vgg:bn=true,width=8")
    assert w.name == "vgg:width=8,bn=true"
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in w.model.modules())


@pytest.mark.parametrize("spec", ["resnet:norm=gn", "vgg", "gpt2", "mlp"])
def test_split_batch_equals_full_batch(spec: str) -> None:
    w = load_workload(spec, batch=4)
    full = w.model(*w.inputs)
    halves = [w.model(*(t[i:i + 2] for t in w.inputs)) for i in (0, 2)]
    torch.testing.assert_close(full, (halves[0] + halves[1]) / 2, rtol=1e-5, atol=1e-5)


FACTORY_SRC = textwrap.dedent('''
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)
        def forward(self, x, y):
            return nn.functional.cross_entropy(self.lin(x), y)

    class HFStyle(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
        def forward(self, x):
            return {"loss": self.lin(x).pow(2).mean(), "logits": self.lin(x)}

    class Out:
        def __init__(self, loss):
            self.loss = loss

    class AttrStyle(HFStyle):
        def forward(self, x):
            return (Out(self.lin(x).sum()), 1)

    class TensorOut(HFStyle):
        def forward(self, x):
            return self.lin(x)

    class NoLoss(HFStyle):
        def forward(self, x):
            return {"logits": self.lin(x)}

    def build():
        return Net(), (torch.randn(6, 4), torch.randint(0, 2, (6,)))

    def build_batched(batch_size=4):
        return Net(), (torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,)))

    def hf_style():
        return HFStyle(), (torch.randn(5, 4),)

    def attr_style():
        return AttrStyle(), [torch.randn(5, 4)]

    def tensor_out():
        return TensorOut(), torch.randn(5, 4)

    def no_loss():
        return NoLoss(), (torch.randn(5, 4),)

    def raises():
        raise RuntimeError("boom\\nsecond line")

    def not_a_pair():
        return Net()

    def bad_inputs():
        return Net(), (torch.randn(3, 4), torch.randint(0, 2, (5,)))

    NOT_CALLABLE = 3
''')


@pytest.fixture()
def user_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "tag_test_user_factories.py").write_text(FACTORY_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tag_test_user_factories"


def test_factory_module_function(user_module: str) -> None:
    w = load_workload(f"{user_module}:build")
    assert w.name == f"{user_module}:build"
    assert w.batch_size == 6
    assert sorted(k for k, _ in w.model.named_parameters()) == ["model.lin.bias", "model.lin.weight"]
    loss = w.model(*w.inputs)
    assert loss.dim() == 0
    loss.backward()
    # Without a batch_size parameter, other batches slice / cyclically repeat the given inputs.
    small, big = w.make_inputs(2), w.make_inputs(9)
    assert torch.equal(small[0], w.inputs[0][:2])
    assert big[0].shape == (9, 4) and torch.equal(big[0][6:], w.inputs[0][:3])
    w3 = load_workload(f"{user_module}:build", batch=3)
    assert w3.batch_size == 3 and torch.equal(w3.inputs[0], w.inputs[0][:3])
    assert torch.equal(w3.make_inputs(6)[0], w.inputs[0])
    torch.export.export(w.model, w.inputs, strict=False)


def test_factory_batch_size_parameter(user_module: str) -> None:
    assert load_workload(f"{user_module}:build_batched").batch_size == 4
    w = load_workload(f"{user_module}:build_batched", batch=7, seed=3)
    assert w.batch_size == 7 and w.inputs[0].shape == (7, 4)
    assert w.make_inputs(2)[0].shape == (2, 4)
    again = load_workload(f"{user_module}:build_batched", batch=7, seed=3)
    assert torch.equal(again.inputs[0], w.inputs[0])
    assert torch.equal(again.model.model.lin.weight, w.model.model.lin.weight)


@pytest.mark.parametrize("fn", ["hf_style", "attr_style", "tensor_out"])
def test_factory_output_styles(user_module: str, fn: str) -> None:
    w = load_workload(f"{user_module}:{fn}")
    loss = w.model(*w.inputs)
    assert loss.dim() == 0 and loss.is_floating_point()


def test_factory_from_file(tmp_path) -> None:
    path = tmp_path / "sub" / "my_model.py"
    path.parent.mkdir()
    path.write_text(FACTORY_SRC)
    w = load_workload(f"{path}:build")
    assert w.batch_size == 6 and torch.isfinite(w.model(*w.inputs))


def test_check_loss_restores_buffers(tmp_path) -> None:
    path = tmp_path / "bn_model.py"
    path.write_text(textwrap.dedent('''
        import torch
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.bn = nn.BatchNorm1d(4)
            def forward(self, x):
                return self.bn(x).pow(2).mean()
        def build():
            return M(), (torch.randn(8, 4) + 5,)
    '''))
    w = load_workload(f"{path}:build")
    assert torch.equal(w.model.model.bn.running_mean, torch.zeros(4))
    assert int(w.model.model.bn.num_batches_tracked) == 0


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("gtp2", "did you mean gpt2"),
        ("resnett:depth=50", "unknown zoo model"),
        ("gpt2:n_layers=3", "valid keys: n_layer"),
        ("gpt2:n_layer=two", "expected int"),
        ("gpt2:n_layer", "expected key=value"),
        ("gpt2:n_layer=2,n_layer=3", "given twice"),
        ("vgg:bn=maybe", "expected bool"),
        ("resnet:norm=ln", "expected one of bn, gn, none"),
        ("resnet:depth=20", "depth must be one of"),
        ("gpt2:n_embd=130", "divisible by n_head"),
        ("vgg:image=40", "multiple of 32"),
        ("mlp:hidden=0", "hidden must be > 0"),
        ("gpt2:dropout=1", "dropout must be a probability in [0, 1), got 1.0"),
        ("llama:dropout=-0.1", "dropout must be a probability in [0, 1), got -0.1"),
        ("bert:dropout=nan", "dropout must be a probability in [0, 1), got nan"),
        ("vit:dropout=high", "bad value 'high' for 'dropout'; expected float"),
        ("no_such_pkg_xyz.models:build", "cannot import module 'no_such_pkg_xyz.models'"),
        ("{mod}:missing_fn", "has no attribute 'missing_fn'"),
        ("{mod}:NOT_CALLABLE", "expected a callable"),
        ("{mod}:raises", "factory raised RuntimeError: boom second line"),
        ("{mod}:not_a_pair", "expected the factory to return (model"),
        ("{mod}:bad_inputs", "disagree on the batch size"),
        ("{mod}:no_loss", "dict with keys ['logits']"),
        ("/nonexistent/dir/f.py:build", "does not exist"),
    ],
)
def test_bad_specs_raise_one_line(user_module: str, spec: str, needle: str) -> None:
    spec = spec.format(mod=user_module)
    with pytest.raises(WorkloadError) as info:
        load_workload(spec)
    msg = str(info.value)
    assert "\n" not in msg
    assert repr(spec) in msg
    assert needle in msg


def test_bad_batch() -> None:
    with pytest.raises(WorkloadError, match="an integer between 1 and 65536, got 0"):
        load_workload("mlp", batch=0)
    with pytest.raises(WorkloadError, match="an integer between 1 and 65536, got 1000000000000"):
        load_workload("mlp", batch=10**12)  # (every input is materialised: 256 TB, 2026-11-27)
    wl = load_workload("mlp", batch=2)
    with pytest.raises(WorkloadError, match="got 65537"):
        wl.make_inputs(2**16 + 1)


def test_inputs_beyond_the_machine_are_refused_before_they_are_made(monkeypatch) -> None:
    """Example inputs are sized on the meta device first: a batch larger than half the machine's
    memory is one WorkloadError naming the spec and the sizes, nothing allocated; abstract inputs
    are never made for real and have the real ones' shapes and dtypes."""
    import tag.workloads.zoo as zoo
    monkeypatch.setattr(zoo, "total_ram_bytes", lambda: 2**30)  # a 1 GiB machine
    with pytest.raises(WorkloadError, match=r"'mlp:in_dim=4096': a batch of 65536 is 1\.0 GiB of example inputs; "
                                            r"expected at most 0\.5 of this machine's 1\.0 GiB"):
        load_workload("mlp:in_dim=4096", batch=65536)
    wl = load_workload("mlp:in_dim=4096", batch=8)  # 128 KiB: made
    with pytest.raises(WorkloadError, match="GiB of example inputs"):
        wl.make_inputs(65536)
    for spec in ("gpt2", "vit", "resnet"):
        real, meta = load_workload(spec, batch=3).inputs, load_workload(spec, batch=3, abstract=True).inputs
        assert [(t.shape, t.dtype) for t in real] == [(t.shape, t.dtype) for t in meta]
        assert all(t.device.type == "meta" for t in meta)
    huge = load_workload("gpt2:seq=100000000", batch=8, abstract=True).inputs  # 12 GiB if made for real
    assert huge[0].shape == (8, 100000000) and huge[0].device.type == "meta"


def test_resample() -> None:
    x = torch.arange(3)
    y, c = resample((x, "const"), 5)
    assert y.tolist() == [0, 1, 2, 0, 1] and c == "const"
    assert resample((x,), 2)[0].tolist() == [0, 1]
