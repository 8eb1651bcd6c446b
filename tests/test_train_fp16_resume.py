"""``tag run`` in fp16: the dynamic loss scaler's state is checkpointed (``scaler/*``,
:mod:`tag.executor.scaling`) and read back, so a run killed and resumed scales, skips and steps
as the uninterrupted run, to the bit."""

from __future__ import annotations

import pytest
import test_train_run as train_run
import torch
from test_train_run import metrics, topology

from tag.executor import ExecuteConfig, ExecutionError
from tag.executor import checkpoint as ckpt
from tag.executor.equality import saved_params
from tag.executor.train import TrainSpec, train
from tag.graph import capture
from tag.plan import GroupPlan, new_plan
from tag.topology import load_topology
from tag.workloads import load_workload

pytestmark = pytest.mark.slow
B, STEPS, EVERY = 6, 14, 4

# test_train_run's MLP with the loss times 1000: its gradient overflows fp16 at the first scales
# (2^16 down to about 2^6), so the run's first steps back off, and a resume that started again
# from 2^16 would skip more.
FACTORY = train_run.FACTORY.replace("return nn.functional.cross_entropy(", "return 1000.0 * nn.functional.cross_entropy(")


def test_fp16_run_killed_resumes_with_its_loss_scale(tmp_path):
    assert FACTORY != train_run.FACTORY
    (tmp_path / "factory.py").write_text(FACTORY)
    spec = f"{tmp_path / 'factory.py'}:make"
    topo = topology(tmp_path, 1)
    graph = capture(load_workload(spec, batch=B), optimizer="adam", num_groups=2, precision="fp16").graph
    new_plan(graph, load_topology(topo), [GroupPlan([0], [1.0])] * 2).save(tmp_path / "plan.json")

    def run(name: str, fault: str | None = None, resume: str | None = None):
        cfg = ExecuteConfig(spec, topo, str(tmp_path / "plan.json"), steps=1, warmup=0, save_params=True,
                            precision="fp16", run_dir=str(tmp_path / name), fault=fault, timeout_s=60.0)
        return train(cfg, TrainSpec(steps=STEPS, lr=1e-2, checkpoint_dir=str(tmp_path / name / "ckpt"),
                                    checkpoint_every=EVERY, keep=10, resume=resume), graph=graph)

    whole = run("whole")
    scales = [r["loss_scale"] for r in metrics(whole)]
    # backed off at the first step and still at step EVERY + 1, then stepping at a steady scale
    assert scales[0] == 2.0**15 and scales[EVERY] < scales[EVERY - 1] and scales[-1] == scales[-2] < 2.0**10
    saved = ckpt.SafeReader(tmp_path / "whole" / "ckpt" / "step-00000004").read_metadata().state_dict_metadata
    assert {"scaler/scale", "scaler/good_steps", "scaler/skipped"} <= set(saved)
    with pytest.raises(ExecutionError, match=r"rank 0 failed: exit code -9 \(SIGKILL\)"):
        run("killed", fault="0:6:exit")
    resumed = run("killed", resume="latest")
    assert resumed.start_step == EVERY and resumed.step == STEPS
    assert [r["loss_scale"] for r in metrics(resumed)] == scales
    assert [r["loss"] for r in metrics(resumed)] == [r["loss"] for r in metrics(whole)]
    a, b = saved_params(tmp_path / "whole", 1)[0], saved_params(tmp_path / "killed", 1)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
