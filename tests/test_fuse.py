"""The fused segment's graph clean-up (tag.executor.fuse.simplify): what it drops, what it keeps."""

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
