"""The executor for real: gloo processes launched by elastic_launch (2-3 ranks on CPU).

After K=2 steps every rank's parameters equal single-process full-batch training (rtol 1e-4);
a failing rank ends the run quickly with one line naming it; bad input is refused before launch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tag.errors import OutOfMemoryError, PlanError
from tag.executor import ExecuteConfig, ExecutionError, execute, reference_training
from tag.executor.equality import assert_params_equal, saved_params
from tag.plan import GroupPlan, group_positions, new_plan
from tag.topology import load_topology
from tag.workloads import load_workload

pytestmark = pytest.mark.slow
MLP = "mlp"
B = 8
REPO = Path(__file__).resolve().parents[1]


def cpu_topology(tmp_path: Path, n: int, memory: str | None = None) -> str:
    gpu = "cpu" if memory is None else f'{{name: tiny, tflops: 1, memory: "{memory}", memory_bandwidth: "10 GB/s"}}'
    path = tmp_path / f"cpu{n}.yaml"
    path.write_text(f"name: test-cpu{n}\nmachines:\n  - name: local\n    gpu: {gpu}\n    count: {n}\n"
                    '    intra_bandwidth: "5 GB/s"\n')
    return str(path)


@pytest.fixture(scope="module")
def mlp(captured):
    return captured(MLP, batch=B, groups=4).graph


def run_plan(tmp_path, graph, topo_path, groups, *, fault=None, timeout=60.0, steps=2, spec=MLP, optimizer="adam"):
    topo = load_topology(topo_path)
    plan = new_plan(graph, topo, groups)
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    cfg = ExecuteConfig(spec, topo_path, str(plan_path), steps=steps, warmup=0, save_params=True, optimizer=optimizer,
                        run_dir=str(tmp_path / "run"), fault=fault, timeout_s=timeout, check_memory=True)
    return execute(cfg, graph=graph)


def assert_params_match(tmp_path, graph, world, spec=MLP, optimizer="adam"):
    ref, ref_losses = reference_training(load_workload(spec, batch=B), optimizer, 2)
    assert_params_equal(saved_params(tmp_path / "run", world), ref, {p.name for p in graph.params}, exact=True)
    return ref_losses


def children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            # multiprocessing's resource tracker and fork server are per-parent helpers, not workers
            helper = "resource_tracker" in cmd or "forkserver" in cmd
            if int(fields[1]) == pid and fields[0] != "Z" and not helper:
                out.append(int(d.name))
    return out


@pytest.mark.parametrize("kind", ["dp-even", "dp-uneven", "mp"])
def test_two_ranks_match_single_process_training(tmp_path, mlp, kind, monkeypatch):
    if kind == "dp-even":  # and each rank writes the op table of one extra, uncounted iteration
        monkeypatch.setenv("TAG_PROFILE_KERNELS", str(tmp_path / "ops"))
    K = mlp.num_groups
    if kind == "mp":
        groups = []
        for g in range(K):
            lo, hi = group_positions(mlp, g)
            groups.append(GroupPlan([g % 2, 1 - g % 2], [1.0, 1.0], "mp", mp_splits=[lo, (lo + hi) // 2])
                          if hi - lo >= 2 else GroupPlan([g % 2], [1.0]))
    else:
        shares = [0.5, 0.5] if kind == "dp-even" else [0.625, 0.375]
        groups = [GroupPlan([0, 1], shares) for _ in range(K)]
    res = run_plan(tmp_path, mlp, cpu_topology(tmp_path, 2), groups)
    ref_losses = assert_params_match(tmp_path, mlp, 2)
    assert res.losses == pytest.approx(ref_losses, rel=1e-4)
    assert res.measured_iteration_time_s > 0 and len(res.per_rank_median_s) == 2
    if kind == "dp-even":
        import json

        assert len(res.losses) == 2  # the profiled iteration is not among the timed ones
        for r in range(2):
            table = json.loads((tmp_path / f"ops-rank{r}.json").read_text())
            ops = {name for name, *_ in table["top_ops"]}
            assert all(len(row) == 4 and row[3] == 0.0 for row in table["top_ops"])  # no device on CPU
            assert table["rank"] == r and table["aten_ops"] > 0 and "aten::_foreach_addcdiv_" in ops, table


def test_two_ranks_with_sfb_match_single_process_training(tmp_path, captured):
    """SFB on wide layers: all-gathers over uneven replicas listed [1, 0] (sample order differs
    from group rank order), one group all-SFB (no sync left), one partly; another without."""
    from tag.compress import find_candidates

    spec = "mlp:hidden=512"
    graph = captured(spec, batch=B, groups=4).graph
    ops: dict[int, list[str]] = {}
    for c in find_candidates(graph):
        ops.setdefault(c.group, []).append(c.op_name)
    groups = [GroupPlan([0, 1], [0.625, 0.375]),
              GroupPlan([1, 0], [0.625, 0.375], sfb=ops[1]),
              GroupPlan([0, 1], [0.75, 0.25], sfb=ops[2][-1:]),
              GroupPlan([0, 1], [0.625, 0.375])]
    res = run_plan(tmp_path, graph, cpu_topology(tmp_path, 2), groups, spec=spec, optimizer="sgd")
    ref_losses = assert_params_match(tmp_path, graph, 2, spec=spec, optimizer="sgd")
    assert res.losses == pytest.approx(ref_losses, rel=1e-4)
    for r in res.ranks:  # the breakdown reports the all-gathers under sync, the recompute under compute
        it = r["iterations"][-1]
        assert 0 < it["sfb_gather"] <= it["sync"] and 0 < it["sfb_recompute"] <= it["compute"]


def test_parameter_server_outside_the_replicas(tmp_path, mlp):
    groups = [GroupPlan([0, 1], [0.5, 0.5], "ps", server=2) for _ in range(mlp.num_groups)]
    run_plan(tmp_path, mlp, cpu_topology(tmp_path, 3), groups)
    assert_params_match(tmp_path, mlp, 3)


def test_mixed_plan_neighbours_on_different_device_sets(tmp_path, mlp):
    groups = [GroupPlan([0, 1], [0.5, 0.5]) if g % 2 == 0 else GroupPlan([1, 2], [0.75, 0.25], "ps", server=0)
              for g in range(mlp.num_groups)]
    run_plan(tmp_path, mlp, cpu_topology(tmp_path, 3), groups)
    assert_params_match(tmp_path, mlp, 3)


@pytest.mark.parametrize("fault, expect", [("1:1:raise", r"rank 1 failed: RuntimeError: injected fault"),
                                           ("0:0:exit", r"rank 0 failed: exit code -9 \(SIGKILL\)")])
def test_failing_rank_stops_everyone_with_one_line(tmp_path, mlp, fault, expect):
    """The failure, not gloo's timeout, ends the run: from the fault (the time the failing rank
    logged) to the error takes less than the timeout every blocked peer would otherwise wait out.
    (Not from the call: starting the fork server and the ranks takes ~5 s on an idle machine and
    over a minute under load, and says nothing about the failure. A rank killed by SIGKILL dies
    only once its SCHED_IDLE gloo thread has run its exit: 35 s after the fault under load 11.)"""
    from tag.executor.worker import FAULT_MARK

    groups = [GroupPlan([0, 1], [0.5, 0.5]) for _ in range(mlp.num_groups)]
    timeout = 60
    with pytest.raises(ExecutionError, match=expect) as info:
        run_plan(tmp_path, mlp, cpu_topology(tmp_path, 2), groups, fault=fault, timeout=timeout, steps=3)
    ended = time.time()
    assert "\n" not in str(info.value)
    rank = fault.split(":")[0]
    log = next((tmp_path / "run" / "logs").glob(f"*/attempt_0/{rank}/stderr.log")).read_text()
    marks = [float(ln.rsplit(" at ", 1)[1]) for ln in log.splitlines() if ln.startswith(FAULT_MARK)]
    assert len(marks) == 1 and ended - marks[0] < timeout, (ended - marks[0], timeout)
    assert children_of(os.getpid()) == [], "worker processes left behind"


def test_plan_that_does_not_fit_is_refused_before_launch(tmp_path, mlp):
    groups = [GroupPlan([0, 1], [0.5, 0.5]) for _ in range(mlp.num_groups)]
    with pytest.raises(OutOfMemoryError, match=r"device 0 \(local:0\) needs [0-9.]+ [KMG]iB of 97.7 KiB"):
        run_plan(tmp_path, mlp, cpu_topology(tmp_path, 2, memory="100 KB"), groups)
    assert not (tmp_path / "run").exists()


def test_plan_for_another_topology_is_refused(tmp_path, mlp):
    groups = [GroupPlan([0, 1], [0.5, 0.5]) for _ in range(mlp.num_groups)]
    plan = new_plan(mlp, load_topology(cpu_topology(tmp_path, 2)), groups)
    plan.save(tmp_path / "plan.json")
    cfg = ExecuteConfig(MLP, cpu_topology(tmp_path, 3), str(tmp_path / "plan.json"))
    with pytest.raises(PlanError, match=r"plan.json: topology: plan is for topology 'test-cpu2'"):
        execute(cfg, graph=mlp)


DROPOUT = f"{REPO / 'evaluation/models/dropout.py'}:make"
"""A model with dropout (the executor's ranks must seed their random streams)."""


def test_dropout_recomputed_on_gloo_ranks_draws_the_forward_masks(tmp_path, captured):
    """Two gloo processes, data parallel, a model with dropout: every rank seeds its random stream
    (``--seed``), so the run is the same twice and the same as ``run_virtual``'s; recomputing
    every group (the forward's masks replayed) leaves the parameters after 3 steps bitwise equal."""
    import torch

    from tag.executor import run_virtual

    spec = DROPOUT
    graph = captured(spec, batch=B, groups=4).graph
    topo_path = cpu_topology(tmp_path, 2)
    runs = {}
    for rc in (False, True):
        d = tmp_path / f"rc{int(rc)}"
        d.mkdir()
        res = run_plan(d, graph, topo_path, [GroupPlan([0, 1], [0.25, 0.75], recompute=rc) for _ in range(4)],
                       steps=3, spec=spec)
        runs[rc] = (res.losses, saved_params(d / "run", 2))
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(runs[True][1][r][k], v) for r, p in runs[False][1].items() for k, v in p.items())
    plan = new_plan(graph, load_topology(topo_path), [GroupPlan([0, 1], [0.25, 0.75]) for _ in range(4)])
    virtual = {r: rt.named_params() for r, rt in run_virtual(graph, plan, load_workload(spec, batch=B), "adam", 3).items()}
    assert_params_equal(virtual, {k: v for p in runs[False][1].values() for k, v in p.items()}, rtol=1e-6, atol=1e-7)


def test_tag_execute_with_dropout_is_the_same_run_twice(tmp_path, captured, capsys):
    """``tag execute`` of a model with dropout, twice: every rank's random stream is seeded by
    ``--seed`` (default 0), so the losses agree to the bit; ``--seed 1`` draws other masks. The
    first run is ``python -m tag`` in a process of its own (its own fork server, hash seed and
    generators), the others ``tag.cli.main`` in this one.
    (Before 2026-11-28 the ranks drew from the generator as the process found it: two runs of one
    plan gave losses 0.0547, 0.0927, 0.0592 and 0.0573, 0.0467, 0.0797.)"""
    import json
    import subprocess
    import sys

    from tag.cli import main

    graph = captured(DROPOUT, batch=B, groups=4).graph
    topo_path = cpu_topology(tmp_path, 2)
    new_plan(graph, load_topology(topo_path), [GroupPlan([0, 1], [0.5, 0.5]) for _ in range(4)]).save(tmp_path / "p.json")
    argv = ["execute", "--model", DROPOUT, "--batch", str(B), "--groups", "4", "--topology", topo_path,
            "--plan", str(tmp_path / "p.json"), "--steps", "3", "--warmup", "0", "--json"]
    out = subprocess.run([sys.executable, "-m", "tag", *argv], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    first = json.loads(out.stdout)["losses"]

    def losses(*extra):
        assert main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out)["losses"]

    assert len(first) == 3 and losses() == first and losses("--seed", "1") != first
