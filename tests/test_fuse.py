"""The fused segment's graph clean-up (tag.executor.fuse.simplify) and its calls through torch's Python bindings
(bind_fast): what they change, what they keep."""

import torch
import torch.fx as fx

from tag.executor.fuse import simplify

aten = torch.ops.aten


def _graph():
    g = fx.Graph()
    w, x, y = g.placeholder("w"), g.placeholder("x"), g.placeholder("y")
    wt = g.call_function(aten.permute.default, (w, [1, 0]))
    a = g.call_function(aten.mm.default, (x, wt))
    wtt = g.call_function(aten.permute.default, (wt, [1, 0]))  # W.t().t() = W
    b = g.call_function(aten.mm.default, (a, wtt))
    al = g.call_function(aten.alias.default, (b,))
    m1 = g.call_function(aten.ne.Scalar, (y, -100))
    m2 = g.call_function(aten.ne.Scalar, (y, -100))  # the same op again
    m3 = g.call_function(aten.ne.Scalar, (y, -100.0))  # another argument type: kept
    r1 = g.call_function(aten.rand_like.default, (b,))
    r2 = g.call_function(aten.rand_like.default, (b,))  # random: never merged
    s = g.call_function(aten.add.Tensor, (al, r1))
    s = g.call_function(aten.add.Tensor, (s, r2))
    keep = g.call_function(aten.alias.default, (x,))  # an output: must not become the input x
    c = g.call_function(aten.logical_and.default, (m1, m2))
    g.output((s, c, m3, keep, m1, al))  # m1, al: outputs other ops read too
    return g


def test_simplify_drops_dispatch_only_ops_and_keeps_semantics():
    g = _graph()
    w, x, y = torch.randn(3, 4), torch.randn(2, 4), torch.tensor([1, -100, 3])
    before = fx.GraphModule(torch.nn.Module(), _graph())
    torch.manual_seed(0)
    ref = before(w, x, y)
    removed = simplify(g)
    after = fx.GraphModule(torch.nn.Module(), g)
    ops = [n.target for n in g.nodes if n.op == "call_function"]
    # the alias of b (returned: b is returned in its place), one permute pair's outer permute, the
    # repeated ne (m1 is returned and read: it stays, m2 goes)
    assert removed == 3
    assert ops.count(aten.permute.default) == 1 and ops.count(aten.ne.Scalar) == 2
    assert ops.count(aten.rand_like.default) == 2
    assert ops.count(aten.alias.default) == 1  # the returned alias of an input stays
    torch.manual_seed(0)
    out = after(w, x, y)
    for a, b in zip(ref, out):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert out[3] is not x and out[5] is not out[0]



class _Record(fx.Interpreter):
    """Runs a module, recording each node's value as ``meta["val"]`` (as export does)."""

    def run_node(self, n):
        n.meta["val"] = out = super().run_node(n)
        return out


def test_bind_fast_calls_the_same_overloads_through_torchs_bindings():
    from tag.executor.fuse import bind_fast

    g = fx.Graph()
    x, w, y = g.placeholder("x"), g.placeholder("w"), g.placeholder("y")
    h = g.call_function(aten.relu.default, (g.call_function(aten.mm.default, (x, g.call_function(
        aten.permute.default, (w, [1, 0]))),),))
    s = g.call_function(aten.sum.dim_IntList, (h, [0], True))  # torch.sum(h, [0], True): the same overload
    lin = g.call_function(aten.linear.default, (x, w))  # composite: torch.nn.functional.linear dispatches t + addmm
    gr = g.call_function(aten.threshold_backward.default, (h, h, 0))  # no Python binding
    z = g.call_function(aten.scalar_tensor.default, (0,), {"dtype": torch.float32, "device": torch.device("cpu")})
    # torch.mul(x, 2.0) dispatches aten.mul.Tensor (the number wrapped in a tensor): kept
    m = g.call_function(aten.mul.Scalar, (x, 2.0))
    g.output((s, lin, gr, g.call_function(aten.ne.Scalar, (y, -100)), z, m))
    args = (torch.randn(5, 4), torch.randn(3, 4), torch.tensor([1, -100, 3]))
    gm = fx.GraphModule(torch.nn.Module(), g)
    _Record(gm).run(*args)
    ref = gm(*args)
    assert bind_fast(g) == 6
    gm.recompile()
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert {torch.permute, torch.mm, torch.relu, torch.sum, torch.ne, torch.scalar_tensor} <= set(targets)
    assert {aten.linear.default, aten.threshold_backward.default, aten.mul.Scalar} <= set(targets)
    for a, b in zip(ref, gm(*args)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    g = fx.Graph()  # no recorded values: nothing can be checked, nothing is bound
    x = g.placeholder("x")
    g.output((g.call_function(aten.relu.default, (x,)),))
    assert bind_fast(g) == 0
