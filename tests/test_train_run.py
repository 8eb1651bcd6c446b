"""``tag run``: training with a plan on gloo ranks, on a factory's data, with checkpoints.

* 60 steps of a 2-rank plan with uneven shares (4 + 2 of 6 samples), 2 global batches per step,
  warm-up + cosine learning rate and clipping at a global norm the gradients exceed, equal
  single-process eager training on the same batches (``torch.nn.utils.clip_grad_norm_``, the
  schedule written out here) within the executor's tolerance; each rank read its share's rows only;
* a rank killed (SIGKILL) while writing the step-30 checkpoint leaves a partial folder; ``--resume``
  ignores it, goes on from step 20, and the loss curve and final parameters equal the
  uninterrupted run's; on one rank (a dataset the run shuffles, across epochs), killed at step 35
  and resumed from 30: equal to the bit;
* the step-60 checkpoint resumed as a pipeline of uneven micro-batches, or tensor parallel,
  trains on equal to eager training (DCP reads by parameter name; a tensor-parallel rank its shard
  of the whole tensors);
* a partial, truncated, altered or code-carrying checkpoint is refused in one line before launch.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tag.cli import main
from tag.errors import WorkloadError
from tag.executor import ExecuteConfig, ExecutionError, run_virtual
from tag.executor import checkpoint as ckpt
from tag.executor.data import DataOrder, RankFeeder, rank_rows, rows_reader
from tag.executor.equality import ATOL, RTOL, assert_params_equal, saved_params
from tag.executor.train import TrainSpec, train
from tag.executor.worker import FAULT_MARK
from tag.graph import capture
from tag.plan import GroupPlan, PipelinePlan, new_plan
from tag.topology import load_topology
from tag.workloads import load_workload

pytestmark = pytest.mark.slow
B, STEPS, ACC, LR, WARMUP, CLIP, MIN_RATIO = 6, 60, 2, 1e-2, 5, 0.3, 0.1

FACTORY = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), y)


def batch(n, size):
    g = torch.Generator().manual_seed(1000 + n)
    return torch.randn(size, 8, generator=g), torch.randint(0, 4, (size,), generator=g)


def make(batch_size=6):
    def data(n, start, stop):  # rows start..stop-1 of global batch n
        x, y = batch(n, batch_size)
        return x[start:stop], y[start:stop]
    return Net(), batch(0, batch_size), data


class Samples(torch.utils.data.Dataset):
    def __init__(self):
        self.x, self.y = batch(-1, 40)

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def make_set(batch_size=6):
    return Net(), batch(0, batch_size), Samples()
'''


def topology(folder: Path, n: int) -> str:
    path = folder / f"cpu{n}.yaml"
    path.write_text(f"name: train-cpu{n}\nmachines:\n  - name: local\n    gpu: cpu\n    count: {n}\n"
                    '    intra_bandwidth: "5 GB/s"\n')
    return str(path)


class Setup:
    """A factory file, a topology and a plan of ``n`` ranks, and the captured graph."""

    def __init__(self, folder: Path, fn: str, shares: list[float], sync: str = "allreduce", shard: int | None = None):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "factory.py").write_text(FACTORY)
        self.folder, self.spec, self.n = folder, f"{folder / 'factory.py'}:{fn}", len(shares)
        self.topology = topology(folder, self.n)
        self.graph = capture(load_workload(self.spec, batch=B), optimizer="adam", num_groups=2).graph
        plan = new_plan(self.graph, load_topology(self.topology), [GroupPlan(list(range(self.n)), shares, sync, shard=shard)] * 2)
        self.plan = folder / "plan.json"
        plan.save(self.plan)

    def run(self, name: str, steps: int = STEPS, fault: str | None = None, resume: str | None = None,
            accumulate: int = ACC, every: int = 10, wandb: str | None = None, compile: bool = False):
        cfg = ExecuteConfig(self.spec, self.topology, str(self.plan), steps=1, warmup=0, save_params=True,
                            run_dir=str(self.folder / name), fault=fault, timeout_s=60.0, compile=compile)
        spec = TrainSpec(steps=steps, accumulate=accumulate, lr=LR, warmup_steps=WARMUP, clip=CLIP,
                         min_lr_ratio=MIN_RATIO, checkpoint_dir=str(self.folder / name / "ckpt"),
                         checkpoint_every=every, resume=resume, wandb=wandb)
        return train(cfg, spec, graph=self.graph)

    def params(self, name: str) -> dict[int, dict[str, torch.Tensor]]:
        return saved_params(self.folder / name, self.n)


def metrics(run) -> list[dict]:
    return [json.loads(ln) for ln in Path(run.metrics).read_text().splitlines()]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """2 ranks, shares 4 + 2 of 6: the uninterrupted 60-step run."""
    s = Setup(tmp_path_factory.mktemp("two"), "make", [4 / 6, 2 / 6])
    s.whole = s.run("whole", every=30)
    return s


def reference(spec: str, steps: int, horizon: dict[int, int] | None = None
              ) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """Eager single-process training on the factory's global batches: (parameters, losses, norms).
    ``horizon``: the step the cosine ends at, from step ``n`` on (default ``steps`` throughout)."""
    wl = load_workload(spec, batch=B)
    params = dict(wl.model.named_parameters())
    opt = torch.optim.Adam(params.values(), lr=LR, foreach=True)
    losses, norms = [], []
    end = steps
    for n in range(steps):
        end = (horizon or {}).get(n, end)
        lr = LR * (n + 1) / WARMUP if n < WARMUP else \
            LR * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * (n - WARMUP) / (end - WARMUP))))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = 0.0
        for k in range(ACC):
            out = wl.model(*wl.data(n * ACC + k, 0, B))
            (out / ACC).backward()
            loss += float(out.detach()) / ACC
        norms.append(float(torch.nn.utils.clip_grad_norm_(params.values(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
    return {k: v.detach() for k, v in params.items()}, losses, norms


def test_sixty_steps_on_uneven_shares_equal_single_process_training(two):
    ref, losses, norms = reference(two.spec, STEPS)
    assert_params_equal(two.params("whole"), ref, {p.name for p in two.graph.params}, exact=True)
    got = metrics(two.whole)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx(losses, rel=1e-4)
    assert [r["grad_norm"] for r in got] == pytest.approx(norms, rel=1e-4)
    assert sum(n > CLIP for n in norms) > STEPS // 2  # the clipping acted
    # each rank read its share's rows of every global batch, and only those
    rows = {r["rank"]: r for r in two.whole.ranks}
    assert rows[0]["data_rows"] == [[0, 4]] and rows[1]["data_rows"] == [[4, 6]]
    assert [rows[r]["rows_read"] for r in (0, 1)] == [4 * STEPS * ACC, 2 * STEPS * ACC]
    # the batches' gradients summed unsynced, each bucket all-reduced once per step (DDP's no_sync)
    assert [rows[r]["syncs"] for r in (0, 1)] == [STEPS * n for n in buckets_of(two)] and min(buckets_of(two)) > 0
    assert all(r["memory_bytes"][0] > 0 and r["samples_per_s"] > 0 and r["mfu"] > 0 for r in got)


def test_rank_killed_while_checkpointing_resumes_to_the_same_run(two):
    # (the line names rank 1, or rank 0 where rank 0 saw the connection close before the agent saw
    # rank 1 die: a SIGKILLed rank ends once its idle-priority gloo thread has run, seconds on a busy host)
    with pytest.raises(ExecutionError, match=r"rank [01] failed: (exit code -9|.*Connection closed by peer)"):
        two.run("killed", fault="1:30:exit-in-checkpoint")
    assert FAULT_MARK in next((two.folder / "killed" / "logs").glob("*/attempt_0/1/stderr.log")).read_text()
    folder = two.folder / "killed" / "ckpt"
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000010", "step-00000020", "step-00000030.partial"]
    resumed = two.run("killed", resume="latest")
    assert resumed.start_step == 20 and resumed.step == STEPS
    assert_params_equal(two.params("killed"), two.params("whole")[0] | two.params("whole")[1])
    assert [r["loss"] for r in metrics(resumed)] == pytest.approx([r["loss"] for r in metrics(two.whole)], rel=1e-6)
    assert [r["step"] for r in metrics(resumed)] == list(range(1, STEPS + 1))
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000040", "step-00000050", "step-00000060"]


@pytest.mark.parametrize("kind", ["pipeline", "tp"])
def test_resumed_under_another_plan_reads_every_parameter_and_its_optimizer_state(two, kind):
    """The data-parallel run's step-60 checkpoint read by a 2-stage pipeline (group 0 on rank 0,
    group 1 on rank 1; 4 micro-batches of 2, 2, 1, 1 samples: each stage reads its micro-batches'
    rows of the inputs it takes) or by a 2-way tensor-parallel plan (the MLP is one Megatron block:
    each rank reads its shard out of the whole parameters and their Adam moments, and writes the
    step-61 checkpoint whole): DCP reads by parameter name; one more step (then ``--time`` is up)
    equals eager training of 61 steps."""
    topo = load_topology(two.topology)
    if kind == "pipeline":
        plan = new_plan(two.graph, topo, [GroupPlan([0], [1.0]), GroupPlan([1], [1.0])])
        plan.pipeline = PipelinePlan([0, 1], 4, "1f1b", 1)
    else:
        plan = new_plan(two.graph, topo, [GroupPlan([0, 1], [0.5, 0.5], sync="tp")] * 2)
    other = two.folder / f"{kind}.json"
    plan.save(other)
    cfg = ExecuteConfig(two.spec, two.topology, str(other), steps=1, warmup=0, save_params=True,
                        run_dir=str(two.folder / kind), timeout_s=60.0)
    # --steps 62 but --time 1 us: the run stops after its first step, with a checkpoint
    spec = TrainSpec(steps=STEPS + 2, time_s=1e-6, accumulate=ACC, lr=LR, warmup_steps=WARMUP, clip=CLIP,
                     min_lr_ratio=MIN_RATIO, resume=two.whole.checkpoint, checkpoint_dir=str(two.folder / kind / "ckpt"),
                     checkpoint_every=10)
    res = train(cfg, spec, graph=two.graph)
    assert res.start_step == STEPS and res.step == STEPS + 1 and res.checkpoint.endswith("step-00000061")
    held = saved_params(two.folder / kind, 2)
    ref, losses, _ = reference(two.spec, STEPS + 1, {0: STEPS, STEPS: STEPS + 2})
    assert_params_equal(held, ref, {p.name for p in two.graph.params}, exact=True)
    assert metrics(res)[-1]["loss"] == pytest.approx(losses[-1], rel=1e-4)
    written = ckpt.SafeReader(res.checkpoint).read_metadata().state_dict_metadata
    assert {k: tuple(written[f"param/{k}"].size) for k in ref} == {k: tuple(v.shape) for k, v in ref.items()}
    if kind == "pipeline":  # each rank its part, read from both ranks' files; inputs on stage 0, labels on stage 1
        assert held[0] and held[1] and not held[0].keys() & held[1].keys()
        assert [r["data_rows"] for r in res.ranks] == [[[0, 6]], [[0, 6]]]
        assert [r["rows_read"] for r in res.ranks] == [2 * B, 2 * B]


def buckets_of(s: Setup) -> list[int]:
    """Per rank, the gradient buckets whose collective it takes part in, an iteration."""
    from tag.executor.strategies import execution_for
    from tag.plan.format import Plan

    sched = execution_for(Plan.load(s.plan), s.graph).schedule(s.graph, load_topology(s.topology).machine_of, None)
    return [sum(r in b.collective.members for b in sched.buckets) for r in range(s.n)]


def test_one_rank_killed_resumes_bitwise(tmp_path):
    s = Setup(tmp_path, "make_set", [1.0])
    whole = s.run("whole", steps=40, accumulate=1, wandb="tag-test")  # (WANDB_MODE=disabled in the tests)
    with pytest.raises(ExecutionError, match=r"rank 0 failed: exit code -9 \(SIGKILL\)"):
        s.run("killed", steps=40, accumulate=1, fault="0:35:exit")
    resumed = s.run("killed", steps=40, accumulate=1, resume="latest")
    assert resumed.start_step == 30
    a, b = s.params("whole")[0], s.params("killed")[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in metrics(resumed)] == [r["loss"] for r in metrics(whole)]


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor on CPU needs a C++ compiler")
def test_compiled_run_trains_as_the_eager_one(tmp_path):
    """``tag run --compile``: each rank's fused segments through torch.compile (as ``tag execute
    --compile``); 3 steps of 2 accumulated batches with clipping equal eager single-process training
    within the executor's tolerance (tests/test_compiled.py: Inductor reorders fp32 reductions)."""
    s = Setup(tmp_path, "make", [1.0])
    run = s.run("compiled", steps=3, compile=True)
    assert run.ranks[0]["compiled_segments"] > 0  # (its segments ran compiled)
    ref, losses, norms = reference(s.spec, 3)
    assert_params_equal(s.params("compiled"), ref, {p.name for p in s.graph.params}, rtol=RTOL, atol=ATOL,
                        exact=True)
    assert [r["loss"] for r in metrics(run)] == pytest.approx(losses, rel=RTOL)
    assert [r["grad_norm"] for r in metrics(run)] == pytest.approx(norms, rel=RTOL)


README_FACTORY = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.body(x), y)


def make(batch_size=32):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(10_000, 32, generator=g), torch.randint(0, 10, (10_000,), generator=g)
    return Net(), (x[:batch_size], y[:batch_size]), torch.utils.data.TensorDataset(x, y)
"""


def test_a_plan_of_a_model_with_fewer_groups_than_asked_runs(tmp_path):
    """``tag plan`` asks for 48 op-groups; README.md's example model has fewer costly ops, so fewer
    groups (8), and asking for 8 groups it otherwise. The launcher, which asks for the plan's count
    by default, groups the model as the plan was (``launch._planned_groups``)."""
    from tag.executor.launch import PLAN_GROUPS, _prepare

    (tmp_path / "mymodels.py").write_text(README_FACTORY)
    spec, topo = f"{tmp_path / 'mymodels.py'}:make", topology(tmp_path, 1)
    graph = capture(load_workload(spec, batch=32), optimizer="adam", num_groups=PLAN_GROUPS).graph
    n = graph.num_groups
    assert n < PLAN_GROUPS
    assert capture(load_workload(spec, batch=32), optimizer="adam", num_groups=n).graph.signature() != graph.signature()
    new_plan(graph, load_topology(topo), [GroupPlan([0], [1.0])] * n).save(tmp_path / "plan.json")
    _prepare(ExecuteConfig(spec, topo, str(tmp_path / "plan.json"), run_dir=str(tmp_path / "run")), None, machines=True)
    assert json.loads((tmp_path / "run" / "args.json").read_text())["groups"] == PLAN_GROUPS


def test_dataset_order_is_a_seeded_permutation_per_epoch():
    order = DataOrder(10, seed=3)
    stream = order.indices(0, 0, 30)
    assert [sorted(stream[e * 10:(e + 1) * 10]) for e in range(3)] == [list(range(10))] * 3
    assert stream[:10] != stream[10:20]
    assert DataOrder(10, seed=3).indices(0, 13, 17) == stream[13:17]  # a resumed run reads on
    assert DataOrder(10, seed=4).indices(0, 0, 10) != stream[:10]


def test_bad_data_is_one_line_naming_the_call():
    class Dicts(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": torch.zeros(8)}

    def failing(n, start, stop):
        raise IndexError(f"no batch {n}")

    with pytest.raises(WorkloadError, match=r"^workload 'f.py:make': data\[\d\] is a dict with keys \['x'\]; expected"):
        rows_reader(Dicts(), 0, "f.py:make")(0, 0, 0, 2)
    with pytest.raises(WorkloadError, match=r"^workload 'f.py:make': data\(3, 0, 2\) raised IndexError: no batch 3$"):
        rows_reader(failing, 0, "f.py:make")(3, 18, 0, 2)
    inputs = (torch.zeros(6, 8), torch.zeros(6, dtype=torch.long))
    feeder = RankFeeder(rows_reader(lambda n, a, b: (torch.ones(b - a, 8), torch.ones(b - a)), 0, "f.py:make"),
                        inputs, [(4, 6)], "f.py:make")
    with pytest.raises(WorkloadError, match=r"data input 1 of rows 4\.\.5 of batch 0 is torch.float32 \(2,\); "
                                            r"expected torch.int64 \(2,\)"):
        feeder.feed(0, 0)
    assert inputs[0][4:].eq(1).all() and inputs[0][:4].eq(0).all()  # its rows only


def test_pipeline_ranks_read_their_micro_batch_rows(captured):
    """Stage 0 (rank 0) reads the inputs, stage 1 (ranks 1 and 2, data parallel) the labels: of each
    micro-batch, each replica its rows."""
    graph = captured("mlp", batch=B, groups=4).graph
    topo = load_topology("topologies/local-cpu4.yaml")
    plan = new_plan(graph, topo, [GroupPlan([0], [1.0])] * 2 + [GroupPlan([1, 2], [0.5, 0.5])] * 2)
    plan.pipeline = PipelinePlan([0, 2], 2, "1f1b", 1)
    rts = run_virtual(graph, plan, load_workload("mlp", batch=B), "sgd", 0)
    assert rank_rows(rts[0]) == [(0, 6)]
    one, two = rank_rows(rts[1]), rank_rows(rts[2])
    assert len(one) == len(two) == 2  # a range per micro-batch
    covered = sorted(i for a, b in one + two for i in range(a, b))
    assert covered == list(range(B))


@pytest.fixture
def complete(two, tmp_path):
    """A copy of the uninterrupted run's step-60 checkpoint."""
    dst = tmp_path / "ckpt" / "step-00000060"
    shutil.copytree(Path(two.whole.checkpoint), dst)
    return dst


def tag_run(two, capsys, *args: str) -> str:
    """``tag run`` refusing ``args``: its one error line (exit 2, nothing launched, nothing on stdout)."""
    code = main(["run", "--model", two.spec, "--topology", two.topology, "--plan", str(two.plan), "--steps", "70",
                 "--run-dir", str(two.folder / "cli"), *args])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
    assert err.startswith("tag run: error: ") and not (two.folder / "cli").exists()
    return err


def test_damaged_checkpoints_are_refused_in_one_line(two, complete, capsys):
    assert ckpt.verify(complete)["step"] == STEPS
    partial = complete.parent / "step-00000070.partial"
    partial.mkdir()
    assert ckpt.latest(complete.parent) == complete  # never read
    assert f"{partial}: partial checkpoint" in tag_run(two, capsys, "--resume", str(partial))
    part = next(complete.glob("__1_*.distcp"))
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    err = tag_run(two, capsys, "--checkpoint-dir", str(complete.parent), "--checkpoint-every", "10", "--resume")
    assert f"{part}: corrupted checkpoint: {len(data) // 2} bytes" in err
    part.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    with pytest.raises(ckpt.CheckpointError, match=r"SHA-256 differs"):
        ckpt.verify(complete)
    other = json.loads(two.plan.read_text())
    other["groups"][1]["sync"] = "mine"  # a strategy tag run does not checkpoint (registered outside TAG)
    (two.folder / "mine.json").write_text(json.dumps(other))
    err = tag_run(two, capsys, "--plan", str(two.folder / "mine.json"), "--checkpoint-dir", str(complete.parent),
                  "--checkpoint-every", "10")
    assert "mine.json: groups[1].sync: tag run does not checkpoint 'mine' groups" in err
    if importlib.util.find_spec("tensorboard") is None:  # not a dependency: asked for, refused before launch
        assert "--tensorboard: the tensorboard package is not installed" in tag_run(two, capsys, "--tensorboard", "tb")


def test_metadata_holding_code_is_not_unpickled(complete):
    evil = pickle.dumps(print)  # a global DCP's metadata never names
    (complete / ".metadata").write_bytes(evil)
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata: not DCP metadata: global builtins.print"):
        ckpt.SafeReader(complete).read_metadata()
