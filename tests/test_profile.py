"""Profiler (op-group stages, optimizer), gloo communication fits, and the profile / simulate CLI."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tag.cli import main
from tag.cost.model import CostModel, device_type
from tag.cost.profiler import default_batches, profile_model, stage_assignment
from tag.topology import load_topology


def _cpu_topology(threads: int):
    n = max(1, (os.cpu_count() or 1) // threads)
    m = {"name": "local", "gpu": "cpu", "count": n}
    if n > 1:
        m["intra_bandwidth"] = "5 GB/s"
    return load_topology({"name": "local", "machines": [m]})


def test_default_batches():
    assert default_batches(8) == [1, 2, 4, 8]
    assert default_batches(1) == [1]
    assert default_batches(32) == [1, 8, 16, 32]


def test_profile_mlp_feeds_the_cost_model(captured, tmp_path):
    cap = captured("mlp", groups=4)
    logs: list[str] = []
    prof = profile_model("mlp", batches=[1, 4], repeats=2, warmup=1, captured=cap, log=logs.append)
    g = cap.graph
    assert prof.graph_signature == g.signature() and prof.batches == [1, 4]
    assert prof.device_type == f"cpu-{torch.get_num_threads()}t"
    assert len(prof.fwd) == g.num_groups and all(len(r) == 2 for r in prof.fwd)
    assert all(t > 0 for row in prof.fwd for t in row) and all(t >= 0 for row in prof.bwd for t in row)
    assert sum(map(sum, prof.bwd)) > 0
    assert sum(prof.opt) > 0 and prof.opt_step_overhead_s >= 0
    assert any("batch 4" in m for m in logs)
    prof.save(tmp_path)
    topo = _cpu_topology(torch.get_num_threads())
    assert device_type(topo, 0) == prof.device_type
    cm = CostModel.for_topology(g, topo, tmp_path)
    assert cm.source(0) == f"profile:{prof.device_type}"
    assert cm.group_time(0, "fwd", 0, 4) == pytest.approx(prof.fwd[0][1], rel=1e-3)
    # the wake penalty: measured per stage on a CPU, carried into the cost model
    assert prof.has_wake and prof.wake_gap_s == pytest.approx(0.05) and prof.wake_tau_s > 0
    assert len(prof.fwd_wake) == g.num_groups and all(len(r) == 2 and min(r) >= 0 for r in prof.fwd_wake)
    table, gap, tau = cm.wake_penalty(0)
    assert table.shape == (g.num_groups, 2, g.batch_size + 1) and (gap, tau) == (prof.wake_gap_s, prof.wake_tau_s)
    assert table[0, 1, 4] == pytest.approx(prof.bwd_wake[0][1], abs=1e-6)
    assert profile_model("mlp", batches=[1], repeats=1, warmup=0, captured=cap, log=lambda m: None,
                         wake_gap_s=0).has_wake is False


def test_profile_under_background_load(captured):
    """A CPU type is timed while the executor's other ranks would be computing: the background
    process runs the profiled batch before timing starts and is gone afterwards."""
    import multiprocessing as mp

    from tag.cost.profiler import CoRunners

    with CoRunners(1, "mlp", 0, 1) as load:
        load.set_batch(3)  # returns once the background finished an iteration at batch 3
        assert list(load._done) == [3]
        procs = list(load._procs)
        assert all(p.is_alive() for p in procs)
    assert not any(p.is_alive() for p in procs) and not mp.active_children()
    cap = captured("mlp", groups=4)
    prof = profile_model("mlp", batches=[2], repeats=1, warmup=0, captured=cap, log=lambda m: None, corun=1,
                         wake_gap_s=0)
    assert prof.meta["corun"] == 1 and all(t > 0 for row in prof.fwd for t in row)


_KILLED_PROFILER = """
import os
from tag.cost.profiler import CoRunners
if __name__ == "__main__":
    load = CoRunners(1, "mlp", 0, 1).__enter__()
    load.set_batch(2)
    print(load._procs[0].pid, flush=True)
    os._exit(0)  # killed mid-profile: no __exit__, the stop event is never set
"""


def test_background_load_ends_with_a_killed_profiler(tmp_path):
    """A profiler killed while it times (Ctrl-C twice, an OOM kill, a cancelled job) leaves no
    background process computing on: the load notices that its parent is gone."""
    import subprocess
    import sys
    import time

    script = tmp_path / "killed.py"
    script.write_text(_KILLED_PROFILER)
    with subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True) as proc:
        pid = int(proc.stdout.readline())  # (the orphan would hold the pipe open: no read to EOF)
        assert proc.wait(timeout=120) == 0
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        pytest.fail(f"background load {pid} outlived its profiler by 30 s")


def test_stage_assignment_keeps_tuples_together(captured):
    g = captured("resnet").graph
    assign = stage_assignment(g)
    for op in g.ops:
        if op.target == "getitem" and op.phase != "opt":
            p = g.tensors[op.inputs[0]].producer
            assert assign[op.name] == assign[g.ops[p].name]


@pytest.mark.slow
def test_comm_profile_gloo_two_processes(tmp_path):
    from tag.executor.commprof import CPU_BUSY_S, profile_comm

    cp = profile_comm("cpu-test", sizes=[4096, 65536, 262144], repeats=2, warmup=1)
    assert set(cp.fits) == {"p2p", "all_reduce", "broadcast", "reduce", "all_gather", "ps"}
    for f in cp.fits.values():
        assert f.alpha >= 0 and f.beta > 0
    assert all(len(v) == 3 for v in cp.samples.values())
    path = cp.save(tmp_path)
    saved = json.loads(path.read_text())
    assert saved["backend"] == "gloo" and saved["meta"]["busy_s"] == CPU_BUSY_S > 0


def test_cli_simulate_json_and_trace(tmp_path, capsys):
    trace = tmp_path / "t.json"
    rc = main(["simulate", "--model", "mlp", "--groups", "4", "--topology", "local-cpu2", "--baseline", "dp",
               "--json", "--trace", str(trace)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["iteration_time_s"] > 0 and out["oom"] is False
    assert len(out["peak_memory_bytes"]) == 2 and len(out["devices"]) == 2
    assert out["lower_bound_s"] <= out["iteration_time_s"]
    tr = json.loads(trace.read_text())
    assert any(e.get("ph") == "X" for e in tr["traceEvents"])


def test_cli_simulate_summary_and_plan_errors(tmp_path, capsys):
    assert main(["simulate", "--model", "mlp", "--groups", "4", "--topology", "local-cpu2",
                 "--baseline", "mp"]) == 0
    out = capsys.readouterr().out
    assert "iteration time" in out and "critical path" in out and "peak memory" in out
    bad = tmp_path / "plan.json"
    bad.write_text("[1, 2]")
    assert main(["simulate", "--model", "mlp", "--topology", "local-cpu2", "--plan", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plan.json" in err[0]


def test_cli_profile_rejects_bad_batches(capsys):
    assert main(["profile", "--model", "mlp", "--batches", "0,x", "--no-comm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batches" in err[0]


def test_tune_malloc(monkeypatch):
    """glibc's thresholds are pinned (so profiles and ranks reuse freed memory alike); the switch
    turns it off."""
    import platform

    from tag.cost.host import tune_malloc

    assert tune_malloc() is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
    monkeypatch.setenv("TAG_MALLOC_TUNE", "0")
    assert tune_malloc() is False


def test_pin_cores_and_demote_threads():
    """In a child process (affinity and priorities are process state): a slot gets its own cores,
    slots that do not fit change nothing; only threads of the given name are demoted (SCHED_IDLE,
    or nice 19 where refused), never the caller; restore_threads undoes SCHED_IDLE (a failing
    rank's exit)."""
    import subprocess
    import sys

    code = r"""
import os, threading, time
from tag.cost.host import pin_cores, demote_threads, restore_threads
cores = sorted(os.sched_getaffinity(0))
assert pin_cores(0, len(cores) + 1, 1) is None and sorted(os.sched_getaffinity(0)) == cores
mine = pin_cores(len(cores) - 1, len(cores), 1)
assert mine == {cores[-1]} and os.sched_getaffinity(0) == mine
me = threading.get_native_id()
main_policy, main_nice = os.sched_getscheduler(me), os.getpriority(os.PRIO_PROCESS, me)
stop = threading.Event()
t = threading.Thread(target=stop.wait)
t.start()
time.sleep(0.05)
with open(f"/proc/self/task/{t.native_id}/comm") as f:
    name = f.read().strip()
assert demote_threads("no-such-thread") == 0
assert demote_threads(name) >= 1
assert (os.sched_getscheduler(t.native_id) == os.SCHED_IDLE
        or os.getpriority(os.PRIO_PROCESS, t.native_id) == 19)
assert os.sched_getscheduler(me) == main_policy and os.getpriority(os.PRIO_PROCESS, me) == main_nice
if os.sched_getscheduler(t.native_id) == os.SCHED_IDLE:
    assert restore_threads("no-such-thread") == 0 and restore_threads(name) >= 1
    assert os.sched_getscheduler(t.native_id) == os.SCHED_OTHER
    assert restore_threads(name) == 0  # nothing left to restore
stop.set()
t.join()
print("ok")
"""
    if sys.platform != "linux":
        return
    env = {k: v for k, v in os.environ.items() if k != "TAG_PIN_CORES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    env["TAG_PIN_CORES"] = "0"
    off = subprocess.run([sys.executable, "-c", "from tag.cost.host import pin_cores, demote_threads;"
                          "print(pin_cores(0, 1, 1), demote_threads('python'))"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert off.stdout.split() == ["None", "0"], off.stderr
