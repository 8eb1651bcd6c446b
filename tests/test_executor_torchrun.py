"""A plan over two machines, run as torchrun runs it: `tag execute --torchrun` writes the run folder
and each machine's command, two real torchrun agents ("machines" on the loopback interface) run
them, `tag execute --report` reads the result; the parameters equal single-process training."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from tag.cli import main
from tag.cost.model import CostModel
from tag.errors import TagError
from tag.executor import ExecuteConfig, prepare_torchrun, reference_training, report_torchrun
from tag.executor.equality import LOSS_RTOL, OPTIMIZER, assert_params_equal, saved_params
from tag.graph import capture
from tag.parallel.layout import layout_plan, parse_layout
from tag.topology import load_topology
from tag.workloads import load_workload

TWO_MACHINES = """name: two-cpu-machines
machines:
  - {name: m0, gpu: cpu, count: 1}
  - {name: m1, gpu: cpu, count: 1}
network: {bandwidth: "5 GB/s"}
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchrun")
    topo_path = tmp / "two.yaml"
    topo_path.write_text(TWO_MACHINES)
    graph = capture(load_workload("mlp", batch=8), optimizer=OPTIMIZER, num_groups=4).graph
    topo = load_topology(str(topo_path))
    plan_path = tmp / "plan.json"
    layout_plan(graph, topo, parse_layout("dp=2"), CostModel.for_topology(graph, topo)).save(plan_path)
    return tmp, topo_path, plan_path, graph


def test_two_torchrun_machines_train_as_one_process(setup, capsys, free_port):
    tmp, topo_path, plan_path, graph = setup
    run_dir = tmp / "run"
    cfg = ExecuteConfig("mlp", str(topo_path), str(plan_path), optimizer=OPTIMIZER, groups=4, steps=2, warmup=0,
                        save_params=True, run_dir=str(run_dir), timeout_s=60)
    launch = prepare_torchrun(cfg, f"127.0.0.1:{free_port}", graph=graph)
    assert launch.backend == "gloo" and [m for m, _ in launch.commands] == ["m0", "m1"]
    assert {"args.json", "graph.json", "plan.json", "topology.json"} <= {p.name for p in run_dir.iterdir()}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = []
    for k, (_, cmd) in enumerate(launch.commands):
        argv = shlex.split(cmd)
        assert argv[0] == "torchrun" and f"--node-rank={k}" in argv and f"--master-port={free_port}" in argv
        procs.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv[1:]], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out[-2000:]
    res = report_torchrun(cfg)
    assert res.world_size == 2 and len(res.losses) == 2 and res.predicted_iteration_time_s > 0
    assert [r["device"] for r in res.ranks] == ["m0:0", "m1:0"]  # node rank k is the topology's machine k
    assert (run_dir / "trace.json").exists()
    ref, losses = reference_training(load_workload("mlp", batch=8), OPTIMIZER, 2)
    assert_params_equal(saved_params(run_dir, 2), ref, {p.name for p in graph.params})
    assert all(abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(res.losses, losses))
    # the CLI: the same, as a user types it
    assert main(["execute", "--model", "mlp", "--topology", str(topo_path), "--plan", str(plan_path),
                 "--optimizer", OPTIMIZER, "--run-dir", str(run_dir), "--report"]) == 0
    assert "mlp on" in capsys.readouterr().out


def test_torchrun_bad_input_is_one_line(setup, tmp_path, capsys):
    _, topo_path, plan_path, _ = setup
    base = ["execute", "--model", "mlp", "--topology", str(topo_path), "--plan", str(plan_path), "--optimizer",
            OPTIMIZER, "--groups", "4"]

    def error(*argv: str) -> str:
        assert main([*base, *argv]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert "spans 2 machines" in error() and "--torchrun" in error()  # a local launch is refused
    assert "expected --run-dir too" in error("--torchrun", "127.0.0.1:29500")
    assert "expected HOST:PORT" in error("--run-dir", str(tmp_path / "r"), "--torchrun", "nohost")
    assert "expected HOST:PORT" in error("--run-dir", str(tmp_path / "r"), "--torchrun", "h:99999")
    assert not (tmp_path / "r").exists()  # nothing written for a refused endpoint
    assert "expected the folder of a run prepared with --torchrun" in error("--run-dir", str(tmp_path), "--report")
    assert "expected one of them" in error("--run-dir", str(tmp_path), "--report", "--torchrun", "h:1")
    (tmp_path / "args.json").write_text("{ damaged")
    assert "args.json: line 1: not valid JSON" in error("--run-dir", str(tmp_path), "--report")
    (tmp_path / "args.json").write_text("[]")
    assert "expected the run arguments --torchrun writes" in error("--run-dir", str(tmp_path), "--report")
    (tmp_path / "args.json").unlink()
    assert main([*base, "--run-dir", str(tmp_path / "r"), "--torchrun", "10.0.0.1:29500"]) == 0
    out = capsys.readouterr().out
    assert "--node-rank=0" in out and "--node-rank=1" in out and "--master-addr=10.0.0.1" in out
    with pytest.raises(TagError, match="ran another plan or topology"):  # report with another plan
        other = tmp_path / "other.json"
        graph = capture(load_workload("mlp", batch=8), optimizer=OPTIMIZER, num_groups=4).graph
        topo = load_topology(str(topo_path))
        layout_plan(graph, topo, parse_layout("pp=2,micro=2"), CostModel.for_topology(graph, topo)).save(other)
        report_torchrun(ExecuteConfig("mlp", str(topo_path), str(other), run_dir=str(tmp_path / "r")))


def test_a_plan_on_one_machine_runs_there_alone(setup, tmp_path, capsys, free_port):
    """A plan whose devices are all on machine m1 (a sub-cluster's layout leaves m0 idle) runs on
    m1 alone: `tag execute` launches it locally (a two-machine topology otherwise needs torchrun),
    trains as one process does and names m0 as idle; --torchrun prints m1's command alone, as node
    0 of one; the prediction is the whole cluster's."""
    from tag.executor import execute
    from tag.plan import GroupPlan, Plan, new_plan
    from tag.sim import simulate

    _, topo_path, _, graph = setup
    topo = load_topology(str(topo_path))
    plan = new_plan(graph, topo, [GroupPlan([1], [1.0]) for _ in range(graph.num_groups)])
    path = tmp_path / "on-m1.json"
    plan.save(path)
    cfg = ExecuteConfig("mlp", str(topo_path), str(path), optimizer=OPTIMIZER, groups=4, steps=2, warmup=0,
                        save_params=True, run_dir=str(tmp_path / "run"), timeout_s=60)
    res = execute(cfg, graph=graph)
    assert res.world_size == 1 and res.idle_machines == ["m0"] and [r["device"] for r in res.ranks] == ["m1:0"]
    assert res.predicted_iteration_time_s == pytest.approx(simulate(graph, topo, plan).iteration_time_s, rel=1e-12)
    ref, _ = reference_training(load_workload("mlp", batch=8), OPTIMIZER, 2)
    assert_params_equal(saved_params(tmp_path / "run", 1), ref, {p.name for p in graph.params})
    assert Plan.load(path).to_dict() == plan.to_dict()  # the user's file is left as it was
    cfg = ExecuteConfig("mlp", str(topo_path), str(path), optimizer=OPTIMIZER, groups=4, run_dir=str(tmp_path / "tr"))
    launch = prepare_torchrun(cfg, f"127.0.0.1:{free_port}", graph=graph)
    assert [m for m, _ in launch.commands] == ["m1"] and launch.idle_machines == ["m0"]
    assert "--nnodes=1 --node-rank=0 --nproc-per-node=1" in launch.commands[0][1]
    assert main(["execute", "--model", "mlp", "--topology", str(topo_path), "--plan", str(path), "--optimizer",
                 OPTIMIZER, "--groups", "4", "--steps", "1", "--warmup", "0"]) == 0
    assert "not launched on m0: the plan leaves them idle" in capsys.readouterr().out
    assert main(["execute", "--model", "mlp", "--topology", str(topo_path), "--plan", str(path), "--optimizer",
                 OPTIMIZER, "--groups", "4", "--run-dir", str(tmp_path / "tr2"), "--torchrun", f"127.0.0.1:{free_port}"]) == 0
    out = capsys.readouterr().out
    assert "on m1:  torchrun --nnodes=1" in out and "on m0:  " not in out
    assert f"nothing on m0: the plan leaves them idle; 127.0.0.1:{free_port} must be m1's address" in out, out
