"""SFB is exact: gathered factors give the all-reduced gradient (one process and 2-rank gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tag.compress import find_candidates, gather_rows, sfb_kernel


def _split(t: torch.Tensor, counts: list[int], dim: int = 0) -> list[torch.Tensor]:
    return list(torch.split(t, counts, dim=dim))


@pytest.mark.parametrize("counts", [[13], [6, 7], [1, 5, 7], [2, 2, 2, 7], [1, 1, 1, 1, 9]])
def test_sum_of_local_products_equals_product_of_gathered_factors(counts):
    g = torch.Generator().manual_seed(len(counts))
    b = sum(counts)
    x, dy = torch.randn(b, 37, generator=g), torch.randn(b, 23, generator=g)  # [B, in], [B, out]
    allreduced = sum(xr.T @ dyr for xr, dyr in zip(_split(x, counts), _split(dy, counts)))  # [in, out]
    sfb = torch.cat(_split(x, counts)).T @ torch.cat(_split(dy, counts))
    torch.testing.assert_close(sfb, allreduced, rtol=1e-5, atol=1e-5)
    # sequence models: [B, T, C] factors flattened to [B*T, C] rows, as GPT-2's Conv1D does
    xs, dys = torch.randn(b, 5, 11, generator=g), torch.randn(b, 5, 3, generator=g)
    local = sum(xr.reshape(-1, 11).T @ dr.reshape(-1, 3) for xr, dr in zip(_split(xs, counts), _split(dys, counts)))
    torch.testing.assert_close(xs.reshape(-1, 11).T @ dys.reshape(-1, 3), local, rtol=1e-5, atol=1e-5)
    # bias: the batch reduction of dY
    torch.testing.assert_close(dy.sum(0), sum(d.sum(0) for d in _split(dy, counts)), rtol=1e-5, atol=1e-5)


class _Recorder(torch.fx.Interpreter):
    """Runs the joint graph and keeps every node's value."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict[str, object] = {}

    def run_node(self, n):
        v = super().run_node(n)
        self.values[n.name] = v
        return v


def test_sfb_kernel_recomputes_real_gradients_and_splits_sum_up(captured):
    from tag.workloads import load_workload

    cap = captured("mlp")
    wl = load_workload("mlp")
    env = {n: cap.state[t] for n, kind, t in cap.placeholders if kind != "input"}
    user = [n for n, kind, _ in cap.placeholders if kind == "input"]
    env.update(dict(zip(user, wl.inputs)))
    rec = _Recorder(cap.joint)
    rec.run(*[env[n] for n, _, _ in cap.placeholders])
    vals = {**env, **rec.values}
    g = cap.graph
    counts = [5, 11, 16]  # uneven replicas of the 32-sample batch
    cands = find_candidates(g)
    assert cands
    for c in cands:
        kernel = sfb_kernel(cap if c.kind == "mm" else cap.joint, c)  # Captured or a bare joint graph
        got = kernel({f.name: vals[f.name] for f in c.factors})
        assert c.grad_node == cap.grad_outputs[c.param]
        torch.testing.assert_close(got, vals[c.grad_node], rtol=0, atol=0)
        op = g.ops[c.op]
        if c.kind == "mm":  # split the real operands along their contracted batch dims
            a, b = (g.tensors[i] for i in op.inputs[-2:])
            parts = zip(_split(vals[a.name], counts, a.batch_dim), _split(vals[b.name], counts, b.batch_dim))
            torch.testing.assert_close(sum(pa @ pb for pa, pb in parts), vals[op.name], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ 2-rank gloo
def _worker(rank: int, port: int, counts: list[int]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(counts))
    try:
        g = torch.Generator().manual_seed(0)  # every rank draws the same global batch
        b = sum(counts)
        x, dy = torch.randn(b, 48, generator=g), torch.randn(b, 24, generator=g)
        seq = torch.randn(4, b, 6, generator=g)  # a factor whose batch dim is 1
        lo = sum(counts[:rank])
        x_r, dy_r = x[lo:lo + counts[rank]], dy[lo:lo + counts[rank]]
        # all-reduce path
        dw_ar = x_r.T @ dy_r
        dist.all_reduce(dw_ar)
        # SFB path: gather both factors (uneven rows), recompute the whole dW locally
        x_full, dy_full = gather_rows(x_r, 0, counts), gather_rows(dy_r, 0, counts)
        assert torch.equal(x_full, x) and torch.equal(dy_full, dy)
        torch.testing.assert_close(x_full.T @ dy_full, dw_ar, rtol=1e-5, atol=1e-5)
        got = gather_rows(seq[:, lo:lo + counts[rank]].contiguous(), 1, counts)
        assert torch.equal(got, seq)
        # devices listed as [rank 1, rank 0]: rank 1 holds the first samples
        first = 0 if rank == 1 else counts[1]
        mine = x[first:first + counts[rank]]
        assert torch.equal(gather_rows(mine, 0, counts, sample_order=[1, 0]), x)
    finally:
        dist.destroy_process_group()


def test_two_rank_gloo_allgather_matches_allreduce(free_port, forked):
    forked(_worker, (free_port, [3, 5]), 2)
