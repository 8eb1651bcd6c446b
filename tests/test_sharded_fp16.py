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
def test_ranks_agree_on_a_non_finite_gradient(tmp_path, forked):
    """Two gloo ranks: both finite, both step; rank 1's gradients not finite, both skip."""
    out = str(tmp_path / "agree")
    forked(_agree, (str(tmp_path / "store"), [True, False], out), 2)
    assert [torch.load(f"{out}.{r}") for r in range(2)] == [[True, False], [True, False]]


MIXED_OFF = 0.1
"""fp16 against single-process training: per parameter, ``|x - ref| / |ref - init|`` (Frobenius
norms) at most this. Element by element no tolerance both holds and means something: a first
Adam step moves an element by about lr whatever its gradient's size, fp16 rounding over 4 samples
a rank instead of 8 changes tiny gradients, and their elements move by up to 1.7 lr differently
(ZeRO-1, mlp, 2 steps), while no step at all is 2 lr away."""


def _near_reference(params: dict[int, dict[str, torch.Tensor]], ref: dict, init: dict, names: set[str]) -> None:
    seen = set()
    for got in params.values():
        for name, x in got.items():
            moved = float((ref[name] - init[name]).norm())
            assert moved > 0 and float((x - ref[name]).norm()) <= MIXED_OFF * moved, name
            seen.add(name)
    assert names <= seen


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
    training with torch.amp.GradScaler within :data:`MIXED_OFF`."""
    from tag.executor import reference_training
    from tag.executor.equality import assert_params_equal
    from tag.workloads import load_workload

    graph, res, ranks, params = _fp16_run(tmp_path, captured, sync)
    names = {p.name for p in graph.params}
    dp_params = fp16_dp[3]
    assert_params_equal(params, dp_params[0], names)
    assert res.losses == pytest.approx(fp16_dp[1].losses, rel=1e-5)
    ref, ref_losses = reference_training(load_workload("mlp", batch=8), "adam", 2, precision="fp16")
    init = reference_training(load_workload("mlp", batch=8), "adam", 0, precision="fp16")[0]
    _near_reference(params, ref, init, names)
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


@pytest.mark.slow
def test_fp16_sharded_pipeline_stages_train_as_one_process(tmp_path, captured):
    """fp16 ZeRO-3 stages of a 2-stage pipeline over 4 gloo ranks (``dp=2,pp=2,micro=2,zero=3``):
    the found-inf flag agreed by all four ranks (each checks its stage's shards); 2 Adam steps equal
    single-process GradScaler training within :data:`MIXED_OFF`."""
    from tag.cost.model import CostModel
    from tag.executor import ExecuteConfig, execute, reference_training
    from tag.executor.equality import saved_params
    from tag.parallel.layout import layout_plan, parse_layout
    from tag.topology import load_topology
    from tag.workloads import load_workload

    graph = captured("mlp", batch=8, groups=4, precision="fp16").graph
    topo_path = tmp_path / "cpu4.yaml"
    topo_path.write_text('name: test-cpu4\nmachines:\n  - name: local\n    gpu: cpu\n    count: 4\n'
                         '    intra_bandwidth: "5 GB/s"\n')
    topo = load_topology(topo_path)
    plan = layout_plan(graph, topo, parse_layout("dp=2,pp=2,micro=2,zero=3"), CostModel.for_topology(graph, topo))
    assert plan.pipeline is not None and plan.precision == "fp16"
    plan.save(tmp_path / "plan.json")
    cfg = ExecuteConfig("mlp", str(topo_path), str(tmp_path / "plan.json"), steps=2, warmup=0, save_params=True,
                        optimizer="adam", run_dir=str(tmp_path / "run"), timeout_s=90.0)
    res = execute(cfg, graph=graph)
    ref, ref_losses = reference_training(load_workload("mlp", batch=8), "adam", 2, precision="fp16")
    init = reference_training(load_workload("mlp", batch=8), "adam", 0, precision="fp16")[0]
    _near_reference(saved_params(tmp_path / "run", 4), ref, init, {p.name for p in graph.params})
    assert res.losses == pytest.approx(ref_losses, rel=1e-3)
