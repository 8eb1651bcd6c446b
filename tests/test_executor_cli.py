"""The executor from the command line and end to end: one-line CLI errors, ``tag validate``, a
killed launcher or rank (gloo processes on CPU; helpers shared with tests/test_executor_dist.py).

Kept apart from tests/test_executor_dist.py so that ``--dist loadfile`` runs the two files'
multi-process launches on different workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_executor_dist import MLP, REPO, B, cpu_topology

from tag.plan import GroupPlan, new_plan
from tag.topology import load_topology

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mlp(captured):
    return captured(MLP, batch=B, groups=4).graph


def test_cli_errors_are_one_line(tmp_path, mlp, capsys):
    """In this process (``tag.cli.main``: what ``python -m tag`` runs; a separate interpreter per
    case cost seconds of imports): refused before launch, exit status 2, one line."""
    from tag.cli import main

    groups = [GroupPlan([0, 1], [0.5, 0.5]) for _ in range(mlp.num_groups)]
    topo = cpu_topology(tmp_path, 2)
    new_plan(mlp, load_topology(topo), groups).save(tmp_path / "plan.json")
    cases = [
        (["--model", "gpt2:n_layer=1", "--topology", topo], "model: plan is for 'mlp'"),
        (["--model", MLP, "--topology", topo, "--backend", "nccl"], "one GPU per rank is needed"),
    ]
    for extra, expect in cases:
        rc = main(["execute", "--plan", str(tmp_path / "plan.json"), *extra])
        err = capsys.readouterr().err
        assert rc == 2, err
        lines = [ln for ln in err.splitlines() if ln.startswith("tag execute: error:")]
        assert len(lines) == 1 and expect in lines[0], err


def test_validate_interleaves_rounds_and_reports(tmp_path, monkeypatch, mlp):
    """``tag validate`` end to end: profiles into its own folder (under load: the other rank's
    share) afresh every round, replacing the profiles an earlier run left there, executes every
    plan ``rounds`` times (each round in its own order) and reports the medians of the rounds."""
    import functools

    from tag.cost import profiler
    from tag.cost.comm import CommProfile, LinkFit
    from tag.cost.model import device_type
    from tag.cost.profile import Profile
    from tag.executor import commprof
    from tag.executor import validate as validate_mod
    from tag.executor.validate import validate

    # Real profiles, smaller: 3 message sizes x 4 timed calls (the default 7 x 160 takes ~18 s per
    # round on an idle 2-core machine and many minutes under load: the ranks' gloo event threads
    # run under SCHED_IDLE); 3 timed repeats per stage at the two per-replica batches the plans run
    # (4 and 8 samples), on an idle host (no co-running process: its spawn and model build took
    # ~10 s a round) and without the wake penalty (50 ms sleeps before every stage, ~5 s a round).
    # The profilers have tests of their own (tests/test_profile.py: co-runners, wake penalty).
    # What is checked here is validate's rounds, files and report.
    monkeypatch.setattr(commprof, "profile_comm",
                        functools.partial(commprof.profile_comm, sizes=(4096, 65536, 262144), repeats=4))
    monkeypatch.setattr(validate_mod, "PROFILE_REPEATS", 3)
    monkeypatch.setattr(profiler, "profile_model",
                        functools.partial(profiler.profile_model, batches=[B // 2, B], corun=0, wake_gap_s=0.0))

    topo = cpu_topology(tmp_path, 2)
    # an earlier run's round-0 profiles (10 s a stage, 10 s a message) in the same folder: replaced
    dt, k = device_type(load_topology(topo), 0), mlp.num_groups
    stale = tmp_path / "v" / "profiles" / "round-0"
    Profile(dt, mlp.model, mlp.signature(), B, "adam", [1, B], [[10.0, 10.0]] * k, [[10.0, 10.0]] * k, [0.0] * k,
            meta={"stale": True}).save(stale)
    CommProfile(dt, "gloo", 2, {"p2p": LinkFit(10.0, 1e9)}, meta={"stale": True}).save(stale)
    report = validate(MLP, topo, tmp_path / "v", n_plans=3, batch=B, groups=4, steps=2, warmup=1, rounds=2,
                      log_fn=lambda m: None)
    assert [r.name for r in report.rows] == ["dp-even", "dp-prop", "single-0"]
    for r in report.rows:
        assert len(r.rounds_s) == 2 and r.measured_s == pytest.approx(sum(r.rounds_s) / 2)
        assert len(r.predicted_rounds_s) == 2 and r.predicted_s == pytest.approx(sum(r.predicted_rounds_s) / 2)
        assert r.predicted_s > 0 and r.error >= 0
    for k in range(2):  # stages and links profiled afresh every round
        profiles = list((tmp_path / "v" / "profiles" / f"round-{k}").glob("cpu-*/*.json"))
        assert any(p.name == "comm.json" for p in profiles) and len(profiles) == 2
        assert not any(json.loads(p.read_text())["meta"].get("stale") for p in profiles)
    assert max(report.rows[0].predicted_rounds_s) < 10.0  # not costed with the stale profile
    assert report.meta["profile_per_round"] is True
    # re-costing the stored runs with the same simulator gives the same predictions, measurements kept
    from tag.executor.validate import repredict

    again = repredict(tmp_path / "v", log_fn=lambda m: None)
    assert [r.predicted_rounds_s for r in again.rows] == [r.predicted_rounds_s for r in report.rows]
    assert [r.rounds_s for r in again.rows] == [r.rounds_s for r in report.rows]
    assert again.meta["repredicted"] is True
    assert -1.0 <= report.round_spearman <= 1.0 and again.round_spearman == report.round_spearman
    assert (tmp_path / "v" / "runs" / "single-0" / "round-1" / "result.json").is_file()
    assert (tmp_path / "v" / "validation.json").is_file() and (tmp_path / "v" / "scatter.png").is_file()


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, grandchildren: forkserver, ranks, helpers)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parent[int(d.name)] = int(fields[1])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo.extend(kids)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_kill_9_of_the_launcher_leaves_no_rank(tmp_path, mlp):
    """The forkserver and both ranks used to train on for minutes, reparented to pid 1."""
    import signal

    groups = [GroupPlan([0, 1], [0.5, 0.5]) for _ in range(mlp.num_groups)]
    topo = cpu_topology(tmp_path, 2)
    new_plan(mlp, load_topology(topo), groups).save(tmp_path / "plan.json")
    run = tmp_path / "run"
    helpers: set[int] = set()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tag", "execute", "--model", MLP, "--topology", topo, "--plan",
         str(tmp_path / "plan.json"), "--steps", "100000", "--run-dir", str(run)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(list(run.glob("logs/**/*.log"))) < 2:
            time.sleep(0.2)  # both ranks started (torchelastic opened their log files)
        assert launcher.poll() is None, "the run ended before it could be killed"
        time.sleep(1.0)  # ranks past rendezvous, training
        helpers = _descendants(launcher.pid)
        assert len(helpers) >= 2, helpers
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(map(_alive, helpers)):
            time.sleep(0.1)
        assert not [p for p in helpers if _alive(p)], "processes outlived the launcher"
    finally:
        for p in helpers | _descendants(launcher.pid) | {launcher.pid}:
            with contextlib.suppress(OSError):
                os.kill(p, 9)


def test_killed_rank_is_one_line_without_torch_warnings(tmp_path, mlp):
    """torch's "Terminating process N via signal SIGTERM" and the resource tracker's "leaked
    semaphore objects" warning used to surround the error line (kept under --debug)."""
    groups = [GroupPlan([0, 1], [0.5, 0.5]) for _ in range(mlp.num_groups)]
    topo = cpu_topology(tmp_path, 2)
    new_plan(mlp, load_topology(topo), groups).save(tmp_path / "plan.json")
    p = subprocess.run([sys.executable, "-m", "tag", "execute", "--model", MLP, "--topology", topo, "--plan",
                        str(tmp_path / "plan.json"), "--steps", "3", "--warmup", "0", "--inject-fault", "0:1:exit",
                        "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tag execute: error: rank 0 failed"), p.stderr
