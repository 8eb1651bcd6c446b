"""``tag run`` with sharded data parallelism (ZeRO-1/2/3, hybrid sharding) on gloo ranks:
clipping by the global norm over sharded gradients, gradient accumulation synced once per step,
checkpoints of the shards (whole tensors under their FQNs) resumed to the same run and under a
plain data-parallel plan. The factory, plan and reference helpers: tests/test_train_run.py."""

from __future__ import annotations

import pytest
from test_train_run import ACC, CLIP, LR, MIN_RATIO, WARMUP, Setup, buckets_of, metrics, reference

from tag.executor import ExecuteConfig, ExecutionError
from tag.executor import checkpoint as ckpt
from tag.executor.equality import assert_params_equal, saved_params
from tag.executor.train import TrainSpec, train
from tag.plan import GroupPlan, new_plan
from tag.topology import load_topology

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def zero(tmp_path_factory):
    """2 ranks of ZeRO-3 (each group's parameters, gradients and Adam moments sharded), 30 steps."""
    s = Setup(tmp_path_factory.mktemp("zero"), "make", [0.5, 0.5], sync="zero3")
    s.whole = s.run("whole", steps=ZERO_STEPS)
    return s


ZERO_STEPS = 30


def test_zero3_with_clipping_and_accumulation_equals_single_process_training(zero):
    """The global norm over sharded gradients counts each shard once; accumulation sums the
    batches' gradients unsynced and reduce-scatters once per step."""
    ref, losses, norms = reference(zero.spec, ZERO_STEPS)
    assert_params_equal(zero.params("whole"), ref, {p.name for p in zero.graph.params}, exact=True)
    got = metrics(zero.whole)
    assert [r["loss"] for r in got] == pytest.approx(losses, rel=1e-4)
    assert [r["grad_norm"] for r in got] == pytest.approx(norms, rel=1e-4)
    assert sum(n > CLIP for n in norms) > ZERO_STEPS // 2  # the clipping acted
    per_iteration = buckets_of(zero)
    assert min(per_iteration) > 0
    assert [r["syncs"] for r in zero.whole.ranks] == [ZERO_STEPS * n for n in per_iteration]  # once per step


@pytest.mark.parametrize("sync,shares,shard", [("zero1", [0.5, 0.5], None), ("zero3", [2 / 6, 2 / 6, 1 / 6, 1 / 6], 2)])
def test_zero1_and_hybrid_zero3_clip_and_accumulate_as_single_process_training(tmp_path, sync, shares, shard):
    """ZeRO-1 (the all-reduced bucket's slice stepped), and hybrid ZeRO-3 over 4 ranks (shard groups
    {0, 1} and {2, 3}, uneven shares: each slice's norm counted by its first shard group only),
    6 steps of 2 accumulated batches with clipping, equal single-process training."""
    s = Setup(tmp_path, "make", shares, sync=sync, shard=shard)
    run = s.run("whole", steps=6, every=3)
    ref, losses, norms = reference(s.spec, 6)
    assert_params_equal(s.params("whole"), ref, {p.name for p in s.graph.params}, exact=True)
    assert [r["grad_norm"] for r in metrics(run)] == pytest.approx(norms, rel=1e-4)
    assert [r["loss"] for r in metrics(run)] == pytest.approx(losses, rel=1e-4)
    assert sum(n > CLIP for n in norms) >= 3 and [r["syncs"] for r in run.ranks] == [6 * n for n in buckets_of(s)]


def test_zero3_killed_resumes_to_the_same_run_and_as_data_parallel(zero):
    """Rank 1 killed while writing checkpoint 20: --resume goes on from 10 and ends with the
    uninterrupted run's losses and parameters. The step-30 checkpoint (whole tensors under their
    FQNs) resumed by a plain data-parallel plan, one step, equals eager training of 31 steps."""
    with pytest.raises(ExecutionError, match=r"rank [01] failed"):
        zero.run("killed", steps=ZERO_STEPS, fault="1:20:exit-in-checkpoint")
    resumed = zero.run("killed", steps=ZERO_STEPS, resume="latest")
    assert resumed.start_step == 10 and resumed.step == ZERO_STEPS
    assert_params_equal(zero.params("killed"), zero.params("whole")[0] | zero.params("whole")[1])
    assert [r["loss"] for r in metrics(resumed)] == pytest.approx([r["loss"] for r in metrics(zero.whole)], rel=1e-6)
    written = ckpt.SafeReader(zero.whole.checkpoint).read_metadata().state_dict_metadata
    ref, losses, _ = reference(zero.spec, ZERO_STEPS + 1, {0: ZERO_STEPS, ZERO_STEPS: ZERO_STEPS + 2})
    assert {k: tuple(written[f"param/{k}"].size) for k in ref} == {k: tuple(v.shape) for k, v in ref.items()}
    plan = new_plan(zero.graph, load_topology(zero.topology), [GroupPlan([0, 1], [0.5, 0.5])] * 2)
    other = zero.folder / "dp.json"
    plan.save(other)
    cfg = ExecuteConfig(zero.spec, zero.topology, str(other), steps=1, warmup=0, save_params=True,
                        run_dir=str(zero.folder / "dp"), timeout_s=60.0)
    spec = TrainSpec(steps=ZERO_STEPS + 2, time_s=1e-6, accumulate=ACC, lr=LR, warmup_steps=WARMUP, clip=CLIP,
                     min_lr_ratio=MIN_RATIO, resume=zero.whole.checkpoint, checkpoint_dir=str(zero.folder / "dp" / "ckpt"))
    res = train(cfg, spec, graph=zero.graph)
    assert res.start_step == ZERO_STEPS and res.step == ZERO_STEPS + 1
    assert_params_equal(saved_params(zero.folder / "dp", 2), ref, {p.name for p in zero.graph.params}, exact=True)
    assert metrics(res)[-1]["loss"] == pytest.approx(losses[-1], rel=1e-4)
