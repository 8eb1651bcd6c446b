"""fp16 with dynamic loss scaling (tag.executor.scaling), under ZeRO-1/2/3 on gloo: the scale
follows torch.amp.GradScaler, the ranks agree on a non-finite gradient by one all-reduce, and
sharded ranks train as single-process fp16 training does."""

from __future__ import annotations

import math

import pytest
import torch

from tag.executor.scaling import LossScaler, all_finite


def test_the_scale_follows_grad_scaler():
    """The same scaled gradients, some of them not finite, through LossScaler and through
    torch.amp.GradScaler (growth interval 3): the same steps skipped, parameters and scales."""
    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(5))
    theirs = torch.nn.Parameter(ours.detach().clone())
    opt_a, opt_b = torch.optim.SGD([ours], lr=0.1), torch.optim.SGD([theirs], lr=0.1)
    mine = LossScaler(torch.device("cpu"), init=1024.0, growth_interval=3)
    ref = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    for step in range(10):
        g = torch.randn(5)
        if step in (2, 3, 7):
            g[step % 5] = math.inf if step != 3 else math.nan
        scale = float(mine.scale)
        assert scale == ref.get_scale()
        ours.grad, theirs.grad = g * scale, ref.scale(g)
        ok = mine.unscale([ours.grad])
        if ok:
            opt_a.step()
        mine.update(ok)
        ref.step(opt_b)
        ref.update()
        assert torch.equal(ours.detach(), theirs.detach()), step
    assert float(mine.scale) == ref.get_scale() and mine.skipped == 3
    # 1024: steps 2, 3 and 7 halve it, the finite run of steps 4-6 doubles it (0-1 and 8-9: two only)
    assert float(mine.scale) == 1024.0 / 8 * 2


def _agree(rank: int, path: str, flags: list[bool], out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    got = [all_finite(ok, torch.device("cpu")) for ok in (True, flags[rank])]
    torch.save(got, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_agree_on_a_non_finite_gradient(tmp_path):
    """Two gloo ranks: both finite, both step; rank 1's gradients not finite, both skip."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "agree")
    mp.spawn(_agree, args=(str(tmp_path / "store"), [True, False], out), nprocs=2, join=True)
    assert [torch.load(f"{out}.{r}") for r in range(2)] == [[True, False], [True, False]]


MIXED_ATOL = 5e-3
"""Mixed precision against single-process training (with the executor's rtol): after 2 Adam
steps of lr 1e-3 (a first Adam step moves an element by about lr, and fp16 rounding over 4
samples a rank instead of 8 can move the tiny ones differently); test_param_casts compares bf16
pipelines so."""


def _fp16_run(tmp_path, captured, sync: str):
    from test_sharded import _run

    from tag.executor.equality import saved_params
    from tag.plan import GroupPlan

    graph = captured("mlp", batch=8, groups=4, precision="fp16").graph
    groups = [GroupPlan([0, 1], [0.5, 0.5], sync) for _ in range(graph.num_groups)]
    res, ranks = _run(tmp_path, graph, 2, groups, bucket_bytes=4096)
    return graph, res, ranks, saved_params(tmp_path / "run", 2)


@pytest.fixture(scope="module")
def fp16_dp(tmp_path_factory, captured):
    """Plain data parallelism over the same 2 gloo ranks in fp16: the sharded runs' twin."""
    return _fp16_run(tmp_path_factory.mktemp("dp"), captured, "allreduce")


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["zero1", "zero2", "zero3"])
def test_fp16_sharded_ranks_train_as_one_process(tmp_path, captured, fp16_dp, sync):
    """ZeRO-1/2/3 over 2 gloo ranks in fp16 (the mlp, 2 Adam steps, small buckets): the parameters
    equal plain data parallelism over the same ranks within the executor's tolerance (the same fp16
    arithmetic a rank, the gradients unscaled and checked on the shards), and single-process fp16
    training with torch.amp.GradScaler within :data:`MIXED_ATOL`."""
    from tag.executor import reference_training
    from tag.executor.equality import assert_params_equal
    from tag.workloads import load_workload

    graph, res, ranks, params = _fp16_run(tmp_path, captured, sync)
    names = {p.name for p in graph.params}
    dp_params = fp16_dp[3]
    assert_params_equal(params, dp_params[0], names)
    assert res.losses == pytest.approx(fp16_dp[1].losses, rel=1e-5)
    ref, ref_losses = reference_training(load_workload("mlp", batch=8), "adam", 2, precision="fp16")
    assert_params_equal(params, ref, names, atol=MIXED_ATOL)
    assert res.losses == pytest.approx(ref_losses, rel=1e-3)
    p = sum(q.nbytes for q in graph.params)
    assert all(r["optimizer_state_bytes"] == pytest.approx(p, rel=0.02) for r in ranks)  # (Adam: 2 P / 2 ranks)


def test_overflow_backs_off_as_grad_scaler(captured, topo4, monkeypatch):
    """A first scale of 2^40 overflows fp16 in the backward: the executor (one rank, in process)
    skips those steps and halves the scale, as GradScaler does from the same scale; then trains
    alike."""
    from tag.executor import reference_training, run_virtual, virtual
    from tag.plan import GroupPlan, new_plan
    from tag.workloads import load_workload

    monkeypatch.setattr(virtual, "loss_scale", lambda precision: 2.0**40 if precision == "fp16" else 1.0)
    graph = captured("mlp", batch=8, groups=4, precision="fp16").graph
    plan = new_plan(graph, topo4, [GroupPlan([0], [1.0], "allreduce") for _ in range(graph.num_groups)])
    rt = run_virtual(graph, plan, load_workload("mlp", batch=8), "adam", 30)[0]
    ref, _ = reference_training(load_workload("mlp", batch=8), "adam", 30, precision="fp16")
    assert rt.scaler.skipped > 0 and float(rt.scaler.scale) == 2.0**40 / 2**rt.scaler.skipped
    got = rt.named_params()
    for name, want in ref.items():
        if name in got:
            assert torch.allclose(got[name], want, rtol=1e-4, atol=1e-6), name
