"""Work items as Ray tasks (tag.dispatch) on a Ray cluster of this machine bound to 127.0.0.1: the
labels and the trained network equal the local pool's, a run resumes across backends, a worker
killed mid-task is retried with the result unchanged, shared data reaches each worker once, and
nothing listens beyond the loopback interface. One cluster (2 CPUs) for the module."""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

# read when ray is imported: a local node of 127.0.0.1 (Ray otherwise takes this host's outward
# address and listens on every interface)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'tag-planner[ray]'; make install does)")

from tag import dispatch  # noqa: E402
from tag.data.generate import GenConfig, generate, label_setup, label_task  # noqa: E402
from tag.dispatch import Backend, run_tasks  # noqa: E402

TINY = ["mlp:layers=2,hidden=64@16"]
RAY = Backend(ray=dispatch.LOCAL_RAY)
TIMING = ("seconds", "label_seconds")


def _gen_cfg(**kw) -> GenConfig:
    base = {"samples": 3, "workers": 1, "simulator": "toy", "playouts_per_step": 4, "max_steps": 3,
            "max_groups": 8, "models": TINY}
    return GenConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", include_dashboard=False, num_cpus=2, _node_ip_address="127.0.0.1",
             log_to_driver=False, configure_logging=False)
    # the tasks below are this module's functions: pickled by value, workers cannot import tests/
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray
    ray.shutdown()


def _labels(root: Path) -> dict[str, dict]:
    """Every record of ``root/raw`` but its wall seconds."""
    out = {}
    for p in sorted((root / "raw").glob("*.json")):
        rec = json.loads(p.read_text())
        out[p.name] = {k: v for k, v in rec.items() if k not in TIMING}
    return out


def _die_once(marker: str, ctx, index):
    """Label ``index``; at pair 1's first attempt, kill this worker mid-task instead."""
    if index == 1 and not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return label_task(ctx, index)


def test_labels_equal_the_local_runs_and_a_run_resumes_across_backends(cluster, tmp_path):
    local, mixed = tmp_path / "local", tmp_path / "mixed"
    generate(local, _gen_cfg(), progress=False)
    generate(mixed, _gen_cfg(samples=2), progress=False)  # interrupted after two pairs, locally
    stamps = {p.name: p.stat().st_mtime_ns for p in (mixed / "raw").glob("*.json")}
    records = []
    stats = generate(mixed, _gen_cfg(), progress=False, backend=RAY, log=records.append)  # resumed on Ray
    assert stats["samples"] == 3 and stats["errors"] == 0
    assert {p.name: p.stat().st_mtime_ns for p in (mixed / "raw").glob("*.json") if p.name in stamps} == stamps
    assert _labels(mixed) == _labels(local) and len(_labels(local)) == 3
    last = records[-1]["progress"]  # the run's log gets done / running / failed / ETA
    assert (last["stage"], last["done"], last["failed"], last["running"], last["total"]) == ("label mixed", 3, 0, 0, 3)


def test_a_worker_killed_mid_task_is_retried_and_the_label_is_unchanged(cluster, tmp_path):
    local = tmp_path / "local"
    generate(local, _gen_cfg(), progress=False)
    cfg = _gen_cfg()
    graphs = {p.stem: p.read_text() for p in (local / "graphs").glob("*.json")}
    shared = {"cfg": cfg.__dict__, "graphs": graphs, "capture_errors": {}, "prior": None}
    marker = tmp_path / "killed-once"
    outs = list(run_tasks(functools.partial(_die_once, str(marker)), [0, 1, 2], setup=label_setup, shared=shared,
                          backend=RAY, desc="label", progress=False))
    assert marker.exists()  # pair 1's first worker was killed: its record comes from the retry
    assert all(o.error is None for o in outs)
    got = {f"{o.item:05d}.json": {k: v for k, v in o.result["record"].items() if k not in TIMING} for o in outs}
    assert got == _labels(local)


def test_tag_train_on_ray_trains_the_local_network_and_plan_head_bit_for_bit(cluster, tmp_path, capsys):
    from tag.cli import main
    from tag.gnn import load_net

    def train(name: str, *flags: str) -> dict:
        cfg = {"run_dir": str(tmp_path / name), "rounds": 1, "samples_per_round": [3], "wandb": "disabled",
               "plan_head": True, "net": {"hidden": 16, "layers": 1, "heads": 2}, "gen": _gen_cfg().__dict__,
               "train": {"epochs": 1, "batch_size": 4, "max_steps": 3}}
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
        assert main(["train", "--config", str(tmp_path / f"{name}.json"), "--no-progress", *flags]) == 0
        net, meta = load_net(tmp_path / name / "predictor.pt")
        assert meta["plan_head"]["pairs"] >= 1  # the plan head's pair labels ran on the backend too
        return net.state_dict()

    a, b = train("local"), train("ray", "--ray")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    plan = lambda name: sorted((p.name, p.read_bytes()) for p in (tmp_path / name / "round0" / "plan").glob("*"))  # noqa: E731
    assert plan("ray") == plan("local") and len(plan("local")) == 3
    log = [json.loads(line) for line in (tmp_path / "ray" / "log.jsonl").read_text().splitlines()]
    assert any(r.get("backend") == "Ray cluster on this machine" for r in log)
    assert any(r.get("progress", {}).get("done") == 3 for r in log)


def test_shared_data_reaches_each_worker_once(cluster):
    shared = {"blob": b"x" * 1_000_000}
    outs = list(run_tasks(dispatch.probe, range(24), setup=dispatch.probe_setup, shared=shared, backend=RAY,
                          desc="probe", progress=False))
    assert sorted(o.item for o in outs) == list(range(24)) and all(o.error is None for o in outs)
    per_pid: dict[int, set[int]] = {}
    for o in outs:
        per_pid.setdefault(o.result["pid"], set()).add(o.result["contexts"])
    assert 1 <= len(per_pid) <= 2  # two CPUs: two workers at most
    assert all(len(counts) == 1 for counts in per_pid.values())  # no worker built a second context


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_loopback or (addr.version == 6 and addr.ipv4_mapped is not None and addr.ipv4_mapped.is_loopback)


def test_nothing_listens_beyond_the_loopback_interface(cluster):
    import psutil
    list(run_tasks(dispatch.probe, range(4), setup=dispatch.probe_setup, shared=None, backend=RAY, desc="probe",
                   progress=False))  # workers up
    ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    listening = [(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in ours]
    assert len(listening) >= 3  # GCS, raylet, workers: the test looks at Ray's sockets
    assert [s for s in listening if not _loopback(s[0])] == []


def test_bench_cells_on_ray_equal_the_local_ones_and_resume(cluster, tmp_path, monkeypatch):
    from tag.bench.runner import run_suite
    from tag.bench.suites import ModelCase, SuiteConfig

    monkeypatch.setenv("TAG_CACHE_DIR", str(tmp_path / "cache"))
    cfg = SuiteConfig(name="t", models=[ModelCase("mlp:layers=2,hidden=32,in_dim=16", 8)],
                      topologies=["tag-testbed"], methods=["dp", "lower-bound", "random"], groups=4,
                      search_budget=4)
    local, _ = run_suite(cfg, tmp_path / "local")
    lines = (tmp_path / "local" / "cells.jsonl").read_text().splitlines()
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "cells.jsonl").write_text(lines[1] + "\n")  # a run killed after one cell
    on_ray, resumed = run_suite(cfg, tmp_path / "ray", RAY)
    assert resumed == 1 and len(on_ray) == len(local) == 3
    key = lambda c: (c.key(), c.predicted_time_s, c.oom, c.speedup_vs_dp, c.playouts)  # noqa: E731
    assert [key(c) for c in on_ray] == [key(c) for c in local]  # the suite's order, the same results
    last = json.loads((tmp_path / "ray" / "log.jsonl").read_text().splitlines()[-1])["progress"]
    assert (last["done"], last["failed"], last["running"], last["total"]) == (3, 0, 0, 3)


def test_a_tuning_study_on_ray_is_the_local_one(cluster, tmp_path, monkeypatch):
    from tag.gnn import NetConfig
    from tag.training import tune as tune_mod

    data = tmp_path / "data"
    generate(data, _gen_cfg(), progress=False)
    monkeypatch.setattr(tune_mod, "suggest", lambda trial: (  # called where the trials are asked
        NetConfig(hidden=8, layers=1, heads=2), {"lr": trial.suggest_float("lr", 1e-3, 1e-2, log=True)}))

    def study(name: str, backend: Backend) -> dict:
        cfg = tune_mod.TuneConfig(data=[str(data)], study_dir=str(tmp_path / name), trials=2, epochs=1,
                                  wandb="disabled", parallel=2)
        return tune_mod.tune(cfg, backend, log=lambda rec: None)

    here, there = study("here", Backend()), study("ray", RAY)  # two trials asked together
    assert here == there and here["trials"] == 2


def test_an_address_without_a_cluster_is_one_line_at_once():
    import time
    t0 = time.perf_counter()
    with pytest.raises(dispatch.DispatchError) as e:
        dispatch.check_reachable("127.0.0.1:1")
    assert str(e.value).startswith("--ray 127.0.0.1:1: no Ray cluster answers there") and "\n" not in str(e.value)
    assert time.perf_counter() - t0 < 10
    dispatch.check_reachable("auto")  # Ray finds that cluster itself
