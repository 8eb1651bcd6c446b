"""Hostile and careless input (issue "Hardening"): every case ends in ONE line and exit 2, quickly,
without allocating without bound; the commands run in-process (``tag.cli.main``) to stay fast."""

from __future__ import annotations

import contextlib
import json
import logging
import time

import pytest

from tag.cli import main
from tag.errors import TopologyError, WorkloadError
from tag.topology import load_topology
from tag.topology.model import MAX_DEVICES, MAX_DEVICES_PER_MACHINE


def run_tag(capsys, *argv: str) -> tuple[int, str, str]:
    """``tag ARGV`` in this process: (exit code, stdout, stderr); argparse exits become codes."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(capsys, *argv: str) -> str:
    rc, _, err = run_tag(capsys, *argv)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def machines_yaml(count: int, machines: int = 1) -> str:
    rows = "".join(f"  - {{name: m{k}, gpu: V100-SXM2-16GB, count: {count}, intra_bandwidth: 150 GB/s}}\n"
                   for k in range(machines))
    return f"name: big\nmachines:\n{rows}network: {{bandwidth: 25 Gbit/s}}\n"


# ----------------------------------------------------------------------------------- topology sizes


@pytest.mark.parametrize("count, machines, field, limit", [
    (1_000_000_000, 1, "machines[0].count", MAX_DEVICES_PER_MACHINE),  # used to grow ~50 MB/s forever
    (100_000, 1, "machines[0].count", MAX_DEVICES_PER_MACHINE),  # used to die allocating 74.5 GiB
    (256, 5, "machines[4].count", MAX_DEVICES),
    (1, MAX_DEVICES + 1, "machines", MAX_DEVICES),
])
def test_topology_size_limits(tmp_path, capsys, count, machines, field, limit):
    path = tmp_path / "big.yaml"
    path.write_text(machines_yaml(count, machines))
    t0 = time.perf_counter()
    line = one_line_error(capsys, "topology", "show", str(path))
    assert f"{field}: at most {limit} devices" in line
    assert time.perf_counter() - t0 < 30  # not a timing test: "answers at all" (it used to hang)


def test_topology_limits_hold_for_the_api_too():
    from tag.topology import Machine, Topology, get_gpu
    v100 = get_gpu("V100-SXM2-16GB")
    with pytest.raises(TopologyError, match="at most 256 devices per machine"):
        Machine("a", v100, MAX_DEVICES_PER_MACHINE + 1, 1e9, 0.0)
    many = tuple(Machine(f"m{k}", v100, MAX_DEVICES_PER_MACHINE, 1e9, 0.0) for k in range(5))
    with pytest.raises(TopologyError, match=f"at most {MAX_DEVICES} devices in a topology, got 1280"):
        Topology("x", many, 1e9, 0.0)


def test_512_devices_hold_no_device_by_device_state(tmp_path):
    """64 machines x 8 GPUs: links are answered from the machine matrices; the [D, D] matrices
    exist only once a consumer asks for them, with the values they always had."""
    import math

    import numpy as np

    from tag.topology import format_topology

    path = tmp_path / "t512.yaml"
    path.write_text(machines_yaml(8, 64))
    topo = load_topology(path)
    format_topology(topo)
    assert topo.num_devices == 512 and topo.bandwidth(0, 1) == 150e9 and topo.bandwidth(0, 8) == 25e9 / 8
    assert topo.bandwidth(3, 3) == math.inf and topo.latency(3, 3) == 0.0
    dense = [k for k, v in vars(topo).items() if isinstance(v, np.ndarray) and v.size >= 512 * 512]
    dense += [k for k, v in vars(topo).items() if isinstance(v, list) and len(v) == 512 and isinstance(v[0], list)]
    assert not dense, dense
    bw, lat = topo.bandwidth_matrix, topo.latency_matrix  # built now, on first use
    assert bw.shape == (512, 512) and not bw.flags.writeable
    mo = np.repeat(np.arange(64), 8)
    expect = topo.machine_bandwidth_matrix[np.ix_(mo, mo)]
    np.fill_diagonal(expect, np.inf)
    assert np.array_equal(bw, expect)
    assert all(bw[i, j] == topo.bandwidth(i, j) and lat[i, j] == topo.latency(i, j)
               for i in range(0, 512, 37) for j in range(0, 512, 29))


def test_yaml_alias_bomb_under_a_known_key(tmp_path, capsys):
    """9 levels of 9 aliases: 9**9 strings once expanded, under ``description:`` (an unknown key
    was already refused at once). Refused in one short line: the error path no longer repr()s
    the expanded value (that took 1.2 GB and never answered)."""
    path = tmp_path / "bomb.yaml"
    path.write_text("name: x\ndescription: " + _nest(9) + "\nmachines: [{name: a, gpu: T4, count: 1}]\n")
    line = one_line_error(capsys, "topology", "show", str(path))
    assert "description: expected a string" in line and len(line) < 300


def _nest(depth: int) -> str:
    """A YAML flow value whose expansion has 9**depth leaves, built from anchors and aliases."""
    text = '&a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]'
    for k in range(1, depth):
        text = f"&a{k} [{text}, " + ", ".join([f"*a{k - 1}"] * 8) + "]"
    return text


def test_yaml_alias_count_is_bounded(tmp_path, capsys):
    path = tmp_path / "aliases.yaml"
    gpus = ", ".join(["*g"] * 1001)
    path.write_text(f"name: x\ndescription: [&g T4, {gpus}]\nmachines: [{{name: a, gpu: T4, count: 1}}]\n")
    assert "more than 1000 aliases" in one_line_error(capsys, "topology", "show", str(path))


def test_topology_file_size_is_bounded(tmp_path, capsys):
    path = tmp_path / "huge.yaml"
    path.write_text("name: x\ndescription: '" + "x" * (5 * 2**20) + "'\n")
    assert "file larger than 4 MiB" in one_line_error(capsys, "topology", "show", str(path))


@pytest.mark.parametrize("value", ["1e400 GB/s", "1e999999999 GB/s", 10**400, "9" * 500 + " GB/s"])
def test_huge_quantities_are_one_line(tmp_path, capsys, value):
    path = tmp_path / "ovf.json"
    path.write_text('{"name": "x", "machines": [{"name": "a", "gpu": "T4", "count": 2, "intra_bandwidth": '
                    + (json.dumps(value) if isinstance(value, str) else str(value)) + "}]}")
    t0 = time.perf_counter()
    line = one_line_error(capsys, "topology", "show", str(path))
    assert "machines[0].intra_bandwidth" in line and len(line) < 300
    assert time.perf_counter() - t0 < 30


def test_huge_inline_tflops(capsys):
    gpu = {"name": "g", "tflops": 10**400, "memory": "1 GB", "memory_bandwidth": "1 GB/s"}
    with pytest.raises(TopologyError, match="tflops: expected a positive finite number"):
        load_topology({"name": "x", "machines": [{"name": "a", "gpu": gpu, "count": 1}]})


# --------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("argv, needle", [
    (["inspect", "--model", "mlp", "--batch", "1000000000"], "--batch: expected an integer between 1 and 65536"),
    (["plan", "--model", "mlp", "--topology", "local-cpu2", "--batch", "1000000000"], "--batch"),
    (["inspect", "--model", "mlp", "--groups", "0"], "--groups: expected an integer between 1 and 4096"),
    (["plan", "--model", "mlp", "--topology", "local-cpu2", "--groups", "-1"], "--groups"),
    (["plan", "--model", "mlp", "--topology", "local-cpu2", "--time", "inf"], "--time: expected a positive, finite"),
    (["plan", "--model", "mlp", "--topology", "local-cpu2", "--time", "nan"], "--time"),
    (["plan", "--model", "mlp", "--topology", "local-cpu2", "--budget", "0"], "--budget"),
    (["execute", "--model", "mlp", "--topology", "local-cpu2", "--plan", "p.json", "--timeout", "0"],
     "--timeout: expected a positive, finite"),
    (["execute", "--model", "mlp", "--topology", "local-cpu2", "--plan", "p.json", "--steps", "0"], "--steps"),
    (["profile", "--model", "mlp", "--repeats", "0"], "--repeats"),
])
def test_arguments_are_checked_before_any_work(capsys, argv, needle):
    t0 = time.perf_counter()
    assert needle in one_line_error(capsys, *argv)
    assert time.perf_counter() - t0 < 5  # refused by argparse: no capture ran (it took 14 s)


def test_execute_api_refuses_a_zero_timeout():
    from tag.errors import TagError
    from tag.executor import ExecuteConfig, execute
    with pytest.raises(TagError, match="--timeout"):
        execute(ExecuteConfig(model="mlp", topology="local-cpu2", plan="missing.json", timeout_s=0))


# ------------------------------------------------------------------------------------------- models


DATA_DEPENDENT = '''
import torch

class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            y = y * 2
        return y.sum()

def make(batch=None):
    return Branchy(), (torch.randn(batch or 4, 4),)
'''


def test_data_dependent_control_flow_is_one_line(tmp_path, capsys):
    path = tmp_path / "branchy.py"
    path.write_text(DATA_DEPENDENT)
    line = one_line_error(capsys, "inspect", "--model", f"{path}:make")
    assert f"{path}:make: data-dependent control flow at branchy.py:11 in forward (if y.sum() > 0:)" in line
    assert "def forward" not in line
    tag_log = logging.getLogger("tag")
    try:
        with pytest.raises(WorkloadError):  # --debug: the traceback, and torch's partial graph dump
            main(["--debug", "inspect", "--model", f"{path}:make"])
    finally:
        tag_log.setLevel(logging.NOTSET)
    assert "def forward" in capsys.readouterr().err


# --------------------------------------------------------------------------------------- plan files


@pytest.mark.parametrize("field, value, message", [
    ("batch_size", -3, "p.json: batch_size: expected a positive integer, got -3"),
    ("batch_size", "8", 'p.json: batch_size: expected an integer, got "8"'),
    ("devices", ["0"], 'p.json: groups[0].devices[0]: expected an integer, got "0"'),
    ("shares", [True], "p.json: groups[0].shares[0]: expected a number, got true"),
    ("server", "1", 'p.json: groups[0].server: expected an integer, got "1"'),
    ("meta", [], "p.json: meta: expected an object, got []"),
])
def test_plan_file_errors_name_the_field(tmp_path, capsys, field, value, message):
    plan = {"model": "mlp", "graph_signature": "x", "topology": "local-cpu2", "topology_signature": "y",
            "batch_size": 8, "groups": [{"devices": [0, 1], "shares": [0.5, 0.5]}]}
    if field in plan or field == "meta":
        plan[field] = value
    else:
        plan["groups"][0][field] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(plan))
    line = one_line_error(capsys, "simulate", "--model", "mlp", "--topology", "local-cpu2", "--plan", str(path))
    assert line.endswith(str(tmp_path / message)), line
    assert "--batch" not in line


TINY = """name: tiny
machines:
  - {name: a, gpu: {name: tiny, tflops: 1, memory: 1 KB, memory_bandwidth: 1 GB/s}, count: 2, intra_bandwidth: 1 GB/s}
"""


def test_plan_where_everything_runs_out_of_memory(tmp_path, capsys):
    topo = tmp_path / "tiny.yaml"
    topo.write_text(TINY)
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "mlp", "--batch", "8", "--groups", "2", "--topology", str(topo),
            "--searcher", "random", "--budget", "2", "--compression", "off", "--out", str(out)]
    line = one_line_error(capsys, *argv)  # the model needs more than both devices hold: refused before searching
    assert "error: model mlp (batch 8) needs at least " in line and "than the 1.95 KiB of all 2 devices" in line, line
    assert "(largest device 0.977 KiB)" in line and "no plan fits" in line and not out.exists()
    rc, stdout, _ = run_tag(capsys, *argv, "--allow-oom")
    assert rc == 0 and "OUT OF MEMORY" in stdout and out.exists()


def test_simulate_a_layout_that_runs_out_of_memory(tmp_path, capsys):
    """``tag simulate --layout``: a layout that does not fit is a one-line error naming the device
    over its memory, nothing written; ``--allow-oom`` reports it (and writes the plan); a layout
    that fits, and a plan file that does not, are reported as before."""
    topo = tmp_path / "small.yaml"
    topo.write_text("name: small\nmachines:\n  - {name: a, gpu: {name: small, tflops: 1, memory: 2 MB, "
                    "memory_bandwidth: 1 GB/s}, count: 2, intra_bandwidth: 1 GB/s}\n")
    saved, trace = tmp_path / "lay.json", tmp_path / "trace.json"
    base = ["simulate", "--model", "mlp", "--batch", "8", "--groups", "4", "--topology", str(topo)]
    line = one_line_error(capsys, *base, "--layout", "dp=2", "--save-plan", str(saved), "--trace", str(trace))
    assert line.startswith("tag simulate: error: layout dp=2 runs out of memory (recompute=1, more pipeline stages") \
        and "device 0 (a:0) needs 3.15 MiB of 1.91 MiB" in line and "nothing written" in line, line
    assert not saved.exists() and not trace.exists()
    rc, out, _ = run_tag(capsys, *base, "--layout", "dp=2", "--save-plan", str(saved), "--allow-oom")
    assert rc == 0 and "OOM: yes" in out and saved.exists()
    rc, out, _ = run_tag(capsys, *base, "--plan", str(saved))  # a plan file is costed, fitting or not
    assert rc == 0 and "OOM: yes" in out
    rc, out, _ = run_tag(capsys, *base, "--layout", "pp=2,micro=2")
    assert rc == 0 and "OOM: no" in out


# ------------------------------------------------------------------------------------- data safety


@pytest.fixture
def topo_copy(tmp_path):
    from tag.topology.loader import shipped_topologies
    path = tmp_path / "topo.yaml"
    path.write_text(shipped_topologies()["local-cpu2"].read_text())
    return path


def test_outputs_never_overwrite_an_input(tmp_path, capsys, topo_copy):
    before = topo_copy.read_text()
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    factory = tmp_path / "branchy.py"
    factory.write_text(DATA_DEPENDENT)
    cases = [
        (["plan", "--model", "mlp", "--topology", str(topo_copy), "--out", str(topo_copy)], "--out"),
        (["plan", "--model", "mlp", "--topology", str(topo_copy), "--trace", str(topo_copy), "--force"], "--trace"),
        (["simulate", "--model", "mlp", "--topology", str(topo_copy), "--plan", str(plan), "--trace", str(plan),
          "--force"], "--trace"),
        (["execute", "--model", "mlp", "--topology", str(topo_copy), "--plan", str(plan), "--out", str(plan),
          "--force"], "--out"),
        (["inspect", "--model", f"{factory}:make", "--save", str(factory), "--force"], "--save"),
    ]
    for argv, flag in cases:
        line = one_line_error(capsys, *argv)
        assert f"{flag}: " in line and "is an input of this command" in line, line
    assert topo_copy.read_text() == before and plan.read_text() == "{}"
    assert factory.read_text() == DATA_DEPENDENT


def test_existing_outputs_need_force(tmp_path, capsys, topo_copy):
    out = tmp_path / "out.json"
    out.write_text("keep")
    for argv in (["plan", "--model", "mlp", "--topology", str(topo_copy), "--out", str(out)],
                 ["inspect", "--model", "mlp", "--save", str(out)],
                 ["topology", "detect", "--out", str(out)]):
        assert f"{out} exists; pass --force" in one_line_error(capsys, *argv)
    twice = ["plan", "--model", "mlp", "--topology", str(topo_copy), "--out", str(tmp_path / "a"),
             "--trace", str(tmp_path / "a")]
    assert "is also the --out file" in one_line_error(capsys, *twice)
    assert out.read_text() == "keep"
    detected = tmp_path / "here.yaml"
    detected.write_text("keep")
    assert "exists; pass --force" in one_line_error(capsys, "topology", "detect", "--out", str(detected))
    rc, _, _ = run_tag(capsys, "topology", "detect", "--out", str(detected), "--force")
    assert rc == 0 and load_topology(detected).num_devices >= 1


def test_atomic_write_keeps_the_file_mode(tmp_path):
    import os
    import stat

    from tag.io import write_atomic
    from tag.topology import dump_topology

    old = tmp_path / "old.json"
    old.write_text("x")
    old.chmod(0o644)
    write_atomic(old, "y")
    assert stat.S_IMODE(old.stat().st_mode) == 0o644 and old.read_text() == "y"  # it became 0o600
    old.chmod(0o640)
    dump_topology(load_topology("local-cpu2"), old)
    assert stat.S_IMODE(old.stat().st_mode) == 0o640
    mask = os.umask(0o027)
    try:
        write_atomic(tmp_path / "new.json", "z")
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o640


def test_gnn_leaves_no_template_files_in_the_temp_folder(tmp_path):
    """torch_geometric writes each message-passing class's rendered propagate() into the temp
    folder, once per process: a fresh process shows it."""
    import os
    import subprocess
    import sys

    code = ("import inspect, torch_geometric.nn as g; from tag.gnn.layers import JointConv; "
            "JointConv([('a', 'to', 'b')], ['b'], 8, {('a', 'to', 'b'): 2}, heads=2); "
            "print(inspect.getsource(g.GATv2Conv.propagate).splitlines()[0])")
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True, text=True,
                       check=True)
    assert r.stdout.strip() == "def propagate("  # the source is still there for inspect / TorchScript
    assert [f for f in os.listdir(tmp_path) if f.startswith(("torch_geometric", "tag-"))] == []


# ---------------------------------------------------------------------------------------- processes


# A launcher (A) starts a child (B) that starts a grandchild (C); B and C call die_with(A). A is
# then killed with SIGKILL: B goes by its parent-death signal, C (whose parent B is not A) by the
# pidfd watchdog. `tag execute`'s ranks (forkserver children) and `tag profile`'s workers use it.
_LEVEL = """
import os, subprocess, sys, time
from tag.lifetime import die_with
die_with(int(sys.argv[1]))
if sys.argv[2] == "spawn":
    subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[1], "leaf", sys.argv[3]])
open(os.path.join(os.environ["READY_DIR"], str(os.getpid())), "w").close()
time.sleep(120)
"""


def test_helpers_die_with_the_launcher(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from test_executor_cli import _alive, _descendants

    launcher_code = ("import subprocess, sys, os; p = subprocess.Popen([sys.executable, '-c', sys.argv[1], "
                     "str(os.getpid()), 'spawn', sys.argv[1]]); p.wait()")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "READY_DIR": str(tmp_path)}
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code, _LEVEL], env=env, start_new_session=True)
    helpers: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(os.listdir(tmp_path)) < 2:
            time.sleep(0.1)  # both armed: each writes its pid after die_with
        helpers = {int(p) for p in os.listdir(tmp_path)}
        assert len(helpers) == 2 and helpers == _descendants(launcher.pid), helpers
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(map(_alive, helpers)):
            time.sleep(0.1)
        assert not [p for p in helpers if _alive(p)]
    finally:
        for p in helpers:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("where, field", [("machine", "machines[0].name"), ("gpu", "machines[0].gpu.name"),
                                          ("topology", "name")])
def test_names_with_control_characters_are_refused(where, field):
    """Names reach the terminal (tables, plans, errors): an escape sequence in one is refused at load,
    shown escaped in the one-line error."""
    evil = "a\x1b[2J\x07b"
    gpu = {"name": evil, "tflops": 10, "memory": "16 GB", "memory_bandwidth": "900 GB/s"} if where == "gpu" else "V100-SXM2-16GB"
    topo = {"name": evil if where == "topology" else "t",
            "machines": [{"name": evil if where == "machine" else "m", "gpu": gpu, "count": 1}]}
    with pytest.raises(TopologyError) as e:
        load_topology(topo)
    msg = str(e.value)
    assert field in msg and "control characters" in msg and "\x1b" not in msg and "\n" not in msg


# ------------------------------------------------------------------------------ files that run code


class _Payload:
    """Unpickling this creates ``marker`` (``open(marker, "w")``): a stand-in for any code a crafted
    ``.pt`` file runs, e.g. ``subprocess.call``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path, marker, fmt: str) -> None:
    """A malicious file at ``path``: a plain pickle or torch.save's zip format."""
    import pickle

    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "pickle":
        path.write_bytes(pickle.dumps({"data": _Payload(marker)}))
    else:
        torch.save({"format": "tag-dataset", "data": _Payload(marker)}, path)


@pytest.mark.parametrize("fmt", ["pickle", "torch"])
def test_dataset_folders_never_run_code(tmp_path, capsys, fmt):
    """`tag tune --data DIR` (and the datasets of `tag train`'s rounds): every .pt file PyG or TAG
    ever read from processed/ (the data file under its old and new names, PyG's pre_transform.pt and
    pre_filter.pt) holds a payload; none runs, and the refusal is one line."""
    from types import SimpleNamespace

    from tag.data.dataset import PlanDataset, PolicyTarget
    from tag.gnn.features import COARSE_ABOVE

    data, marker = tmp_path / "data", tmp_path / "ran"
    (data / "raw").mkdir(parents=True)
    ns = SimpleNamespace(_raw=[], target=PolicyTarget(), coarse_above=COARSE_ABOVE)  # what `tag tune` reads
    name = PlanDataset.processed_file_names.fget(ns)[0]
    for f in (name, name.replace("tensors_", "decisions_"), "pre_transform.pt", "pre_filter.pt"):
        _plant(data / "processed" / f, marker, fmt)
    rc, _, err = run_tag(capsys, "tune", "--data", str(data), "--study-dir", str(tmp_path / "study"))
    assert not marker.exists()
    line = err.strip()
    assert rc == 2 and "\n" not in line and "Traceback" not in line, err
    assert name in line and "refused to unpickle" in line, line


@pytest.mark.parametrize("which", ["predictor", "training"])
def test_checkpoints_never_run_code(tmp_path, which):
    """The other .pt files TAG reads (--checkpoint, a resumed round's last.pt / best.pt) go through
    the same weights_only loader, refused in one line."""
    from tag.gnn import NetConfig, TagNet, load_net
    from tag.gnn.predictor import CheckpointError
    from tag.training.config import TrainConfig
    from tag.training.train import fit

    marker = tmp_path / "ran"
    path = tmp_path / ("evil.pt" if which == "predictor" else "last.pt")
    _plant(path, marker, "torch")
    with pytest.raises(CheckpointError) as e:
        if which == "predictor":
            load_net(path)
        else:
            fit(TagNet(NetConfig(hidden=8, layers=1, heads=1)), [], None, TrainConfig(epochs=1), tmp_path, tag="t")
    assert not marker.exists()
    assert str(path) in str(e.value) and "refused to unpickle" in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------- what listens where


@contextlib.contextmanager
def listening_sockets():
    """Yields a set that fills, while the block runs, with ``(pid, ip, port)`` of every TCP socket
    in LISTEN state owned by this process or any of its descendants (polled every 20 ms)."""
    import threading

    psutil = pytest.importorskip("psutil")
    seen: set[tuple[int, str, int]] = set()
    stop = threading.Event()

    def poll():
        me = psutil.Process()
        while not stop.is_set():
            with contextlib.suppress(psutil.Error):
                for proc in [me, *me.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        seen.update((proc.pid, c.laddr.ip, c.laddr.port) for c in proc.net_connections("inet")
                                    if c.status == psutil.CONN_LISTEN)
            stop.wait(0.02)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()


@pytest.mark.slow
def test_execute_listens_on_loopback_only(tmp_path, captured):
    """`tag execute` on one machine: the rendezvous store, the store the ranks share and gloo's
    sockets listen on 127.0.0.1, never on every interface (``*`` / ``::``)."""
    import os

    from test_executor_dist import cpu_topology, run_plan

    from tag.plan import GroupPlan

    graph = captured("mlp", batch=8, groups=4).graph
    with listening_sockets() as seen:
        run_plan(tmp_path, graph, cpu_topology(tmp_path, 2), [GroupPlan((0, 1), (0.5, 0.5), "allreduce")] * 4)
    launcher = {s for s in seen if s[0] == os.getpid()}
    assert len(launcher) >= 2 and len(seen - launcher) >= 2, seen  # both stores; the ranks' gloo sockets
    assert {ip for _, ip, _ in seen} == {"127.0.0.1"}, seen


@pytest.mark.slow
def test_profile_comm_listens_on_loopback_only():
    from tag.executor.commprof import profile_comm

    with listening_sockets() as seen:
        profile_comm("cpu-test", sizes=[4096], repeats=1, warmup=0)
    assert seen and {ip for _, ip, _ in seen} == {"127.0.0.1"}, seen


# ------------------------------------------------------------------------------ default output folders


def _defaults() -> dict[str, str]:
    """Where each command writes when not told (profile, train, tune, validate, bench share one rule)."""
    from dataclasses import fields

    from tag.cost.profile import default_profile_dir
    from tag.io import output_dir
    from tag.training.config import LoopConfig
    from tag.training.tune import TuneConfig

    return {"profile": str(default_profile_dir()), "train": LoopConfig().run_dir,
            "tune": next(f for f in fields(TuneConfig) if f.name == "study_dir").default_factory(), "validate/bench": str(output_dir("evaluation/results"))}


def test_defaults_inside_a_checkout_are_the_repository_folders(monkeypatch):
    from pathlib import Path

    from tag.io import checkout_root

    monkeypatch.delenv("TAG_PROFILE_DIR", raising=False)
    root = Path(__file__).resolve().parents[1]
    assert checkout_root() == root
    assert _defaults() == {"profile": str(root / "data/profiles"), "train": str(root / "runs/predictor"),
                           "tune": str(root / "runs/tune"), "validate/bench": str(root / "evaluation/results")}


def test_an_installed_package_writes_into_the_user_data_folder(tmp_path):
    """The tag package alone (as a wheel installs it: no pyproject.toml beside it), run from an
    empty folder: every default lies under $XDG_DATA_HOME/tag, and `tag tune`, which writes its
    study folder before reading the data, writes there and nothing into the current folder."""
    import inspect
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "tag", tmp_path / "site" / "tag", ignore=shutil.ignore_patterns("__pycache__"))
    work, xdg, data = tmp_path / "work", tmp_path / "xdg", tmp_path / "data"
    for d in (work, data / "raw"):
        d.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TAG_", "XDG_"))}
    env.update(PYTHONPATH=str(tmp_path / "site"), XDG_DATA_HOME=str(xdg), HOME=str(tmp_path / "home"))
    # One process (torch is imported once): the defaults, then `tag tune --data DATA`'s exit code.
    code = (inspect.getsource(_defaults) + "import json, sys, tag.io, tag.cli\n"
            "print(json.dumps([str(tag.io.checkout_root()), _defaults()]), flush=True)\n"
            "sys.exit(tag.cli.main(['tune', '--data', sys.argv[1]]))")
    r = subprocess.run([sys.executable, "-c", code, str(data)], cwd=work, env=env, capture_output=True, text=True)
    checkout, defaults = json.loads(r.stdout)
    assert checkout == "None"
    assert defaults == {"profile": str(xdg / "tag/data/profiles"), "train": str(xdg / "tag/runs/predictor"),
                        "tune": str(xdg / "tag/runs/tune"), "validate/bench": str(xdg / "tag/evaluation/results")}
    assert r.returncode == 2 and "no labelled decisions" in r.stderr, r.stderr
    assert (xdg / "tag/runs/tune/tune_config.json").is_file() and not list(work.iterdir())


# ------------------------------------------------------------------------------- output at scale

BIG_MLP = "mlp:hidden=32768"
"""3.2e9 parameters: 48 GiB of fp32 parameters, gradients and Adam state on every data-parallel
replica, more than any device of hetero-64gpu holds (A100-40GB, V100-SXM2-16GB, T4)."""


def _device_rows(stdout: str) -> list[str]:
    """The per-device table's body: the lines between the table's rule and the next line that
    does not start with a device index or range."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line and set(line) <= {"-", " "}) + 1
    body = []
    for line in lines[start:]:
        if not line.strip()[:1].isdigit():
            break
        body.append(line)
    return body


def test_simulate_at_64_devices_folds_alike_devices(capsys):
    argv = ["simulate", "--model", BIG_MLP, "--batch", "64", "--groups", "2", "--topology", "hetero-64gpu",
            "--baseline", "dp-prop"]
    rc, out, _ = run_tag(capsys, *argv)
    rows = _device_rows(out)
    # shares proportional to speed: one row per device kind, each device over capacity
    assert rc == 0 and len(rows) == 3, out
    assert rows[0].split()[:4] == ["0-15", "16", "x", "A100-40GB"] and rows[0].endswith("OOM"), rows
    assert rows[1].split()[:4] == ["16-47", "32", "x", "V100-SXM2-16GB"], rows
    assert rows[2].split()[:4] == ["48-63", "16", "x", "T4"], rows
    oom = [line for line in out.splitlines() if line.startswith("out of memory")]
    # the worst device (need over capacity) named, the rest counted, in one line
    assert oom == ["out of memory: device 16 (v100-00:0) needs 40 GiB of 16 GiB, and 63 more devices over "
                   "capacity"], oom
    rc, out, _ = run_tag(capsys, *argv, "--all-devices")
    assert rc == 0 and len(_device_rows(out)) == 64
    assert sum(line.startswith("out of memory on device ") for line in out.splitlines()) == 64
    rc, out, _ = run_tag(capsys, *argv, "--json")
    res = json.loads(out)  # JSON keeps every device
    assert rc == 0 and len(res["devices"]) == 64 and len(res["oom_devices"]) == 64
    assert [d["name"] for d in res["devices"][:2]] == ["a100-00:0 (A100-40GB)", "a100-00:1 (A100-40GB)"]


def test_fold_rows_groups_alike_devices():
    from tag.cli.simulate import fold_rows
    from tag.plan.format import device_ranges

    assert device_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and device_ranges([3]) == "3"
    rows = [[str(d), f"h{d}", "1.0", "OOM" if d in (3, 9) else ""] for d in range(12)]
    kinds = ["H100"] * 10 + ["A100"] * 2
    assert fold_rows(rows, kinds) == [["0-2,4-8", "8 x H100", "1.0", ""], ["3,9", "2 x H100", "1.0", "OOM"],
                                      ["10-11", "2 x A100", "1.0", ""]]
    assert fold_rows(rows[:2], ["a", "b"]) == rows[:2]  # a device alike with no other keeps its row


def test_simulate_at_512_devices(capsys):
    rc, out, _ = run_tag(capsys, "simulate", "--model", "mlp", "--batch", "512", "--groups", "4",
                         "--topology", "h100-512gpu", "--baseline", "dp")
    assert rc == 0 and [r.split()[:4] for r in _device_rows(out)] == [["0-511", "512", "x", "H100-SXM"]], out


def test_memory_report_names_the_worst_device_and_counts_the_rest():
    from tag.sim.result import SimResult
    from tag.topology import load_topology

    topo = load_topology("hetero-64gpu")  # 0-15 A100-40GB, 16-47 V100-SXM2-16GB, 48-63 T4 (16 GiB)
    cap = [float(d.gpu.memory_bytes) for d in topo.devices]
    gib = 2.0 ** 30

    def report(need: list[float]) -> str:
        over = [(d, n - c) for d, (n, c) in enumerate(zip(need, cap)) if n > c]
        res = SimResult(1.0, bool(over), need, cap, over, [0.0] * 64, [0.0] * 64, [0.0] * 64, [], [])
        return res.memory_report(topo)

    need = [392 * gib] * 16 + [272 * gib] * 48
    assert report(need) == ("device 16 (v100-00:0) needs 272 GiB of 16 GiB, and 63 more devices over capacity "
                            "(largest need 392 GiB, device 0 (a100-00:0))")
    few = [gib] * 64
    few[20], few[50] = 20 * gib, 17 * gib
    assert report(few) == "device 20 (v100-00:4) needs 20 GiB of 16 GiB; device 50 (t4-00:2) needs 17 GiB of 16 GiB"


def test_plan_out_of_memory_on_64_devices_is_one_line(tmp_path, capsys):
    kinds = [("a", "tinya", "120 KB")] + [(m, "tinyb", "60 KB") for m in "bcdefgh"]
    rows = "".join(f"  - {{name: {m}, gpu: {{name: {g}, tflops: 1, memory: {mem}, memory_bandwidth: 1 GB/s}}, "
                   f"count: 8, intra_bandwidth: 1 GB/s}}\n" for m, g, mem in kinds)
    topo = tmp_path / "tiny64.yaml"
    topo.write_text(f"name: tiny64\nmachines:\n{rows}network: {{bandwidth: 1 GB/s}}\n")
    line = one_line_error(capsys, "plan", "--model", "mlp", "--batch", "64", "--groups", "2", "--topology",
                          str(topo), "--searcher", "random", "--budget", "2", "--compression", "off")
    # all 64 devices fit the model's memory together, none alone: every plan searched replicates it
    # (the grid: its 64 executable dp x tp x pp layouts, pipelines of tensor-parallel stages among them,
    # 8 sharded ones, tag.parallel.layout.sharded_layouts: zero=1/2/3 and hsdp, each with and
    # without recomputation, and the optimizer-offload ones, offload_layouts, that the executor runs;
    # the hosts, twice the GPUs' memory, hold no offloaded state either)
    from tag.cost.model import CostModel
    from tag.parallel import execution_refusal
    from tag.parallel.layout import layout_grid, layout_plan, offload_layouts
    from tag.planner import model_graph
    from tag.topology import load_topology

    g2, t64 = model_graph("mlp", 64, num_groups=2)[0], load_topology(str(topo))
    costs = CostModel.for_topology(g2, t64)
    grid = [lay for lay in layout_grid(g2, t64) if execution_refusal(layout_plan(g2, t64, lay, costs)) is None]
    assert len(grid) - len(set(offload_layouts(g2, t64)) & set(grid)) == 72
    assert line.startswith("tag plan: error: every plan searched runs out of memory, also with activation "
                           f"recomputation where the search may use it, so do the {len(grid)} Megatron-style layouts "
                           "of the grid ("), line
    assert " simulated, the others bounded out of memory or slower); the closest to fitting: device 8 (b:0) needs " in line, line
    assert "of 58.6 KiB, and 63 more devices over capacity; no plan written" in line, line
    # the plan reported (and written with --allow-oom) is the one closest to fitting, not data parallel
    from tag.cost.baselines import data_parallel
    from tag.planner import PlannerConfig, find_plan
    from tag.sim import Simulator

    graph = g2
    sim = Simulator(graph, t64)
    p = find_plan(graph, t64, PlannerConfig(searcher="random", budget=2, compression="off"), simulator=sim)
    got = sim.run(p.groups, pipeline=p.pipeline).overflow
    assert p.meta["oom"] and 1 < got < sim.run(data_parallel(graph, t64).groups).overflow / 2


def test_plan_op_group_lines_at_512_devices():
    """An op-group over many machines is described by their range and count, many unequal
    shares by runs of equal ones or their range: one short line either way."""
    from tag.cli.plan import _describe
    from tag.plan import GroupPlan

    h100 = load_topology("h100-512gpu")  # 64 machines of 8
    assert _describe(h100, GroupPlan(list(range(512)), [1 / 512] * 512)) == \
        "allreduce on h100-00..h100-63 (64 machines) (shares 0.002 x512)"
    assert _describe(h100, GroupPlan(list(range(0, 512, 2)), [1 / 256] * 256)) == \
        "allreduce on h100-00..h100-63 (256 devices of 64 machines) (shares 0.004 x256)"
    assert _describe(h100, GroupPlan([0, 8, 48, 49], [0.25] * 4)) == \
        "allreduce on h100-00[0]+h100-01[0]+h100-06[0, 1] (shares 0.250 x4)"  # a few machines: each named
    hetero = load_topology("hetero-64gpu")  # 16 A100, 32 V100, 16 T4 on 10 machines
    speed = [4.0] * 16 + [2.0] * 32 + [1.0] * 16
    line = _describe(hetero, GroupPlan(list(range(64)), [s / 144 for s in speed]))
    assert line == "allreduce on a100-00..t4-03 (10 machines) (shares 0.028 x16, 0.014 x32, 0.007 x16)"
    ramp = [d + 1.0 for d in range(64)]
    line = _describe(hetero, GroupPlan(list(range(64)), [s / sum(ramp) for s in ramp]))
    assert line.endswith("(shares 0.000-0.031 over 64 devices)"), line


def test_topology_show_at_512_devices(capsys):
    """Alike machines share one row of the machine table above 8 machines, and a uniform network
    is one line (as a uniform latency was): h100-512gpu in 9 lines, not 64 rows and a 64 x 64
    matrix; one line more says which host figures are defaults."""
    rc, out, _ = run_tag(capsys, "topology", "show", "h100-512gpu")
    lines = out.strip().splitlines()
    assert rc == 0 and len(lines) == 10 and lines[5].startswith("* default (tag.topology.host)"), out
    assert lines[4].split()[:4] == ["h100-00..h100-63", "(64", "machines)", "H100-SXM"], lines
    assert "Inter-machine bandwidth: 400 Gbit/s" in lines and "Inter-machine latency: 10 us" in lines
    rc, out, _ = run_tag(capsys, "topology", "show", "hetero-64gpu")
    rows = [line.split()[0] for line in out.splitlines()[4:7]]
    assert rc == 0 and rows == ["a100-00..a100-01", "v100-00..v100-03", "t4-00..t4-03"], out
    assert "Inter-machine bandwidth:\n" in out  # not uniform (100 and 25 Gbit/s): the matrix


# ------------------------------------------------------------ bad-input sweep (2026-11-27)
# Each case used to end in a traceback, a hang or a silent acceptance; now one line and exit 2,
# before any capture or search.


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--model", "mlp", "--topology", "local-cpu2", "--seed", "-1"],
     "argument --seed: expected an integer between 0 and 4294967295, got -1"),  # numpy's ValueError
    (["plan", "--model", "mlp", "--topology", "local-cpu2", "--seed", str(2**70)], "argument --seed"),  # torch int64
    (["plan", "--model", "mlp", "--topology", "local-cpu2", "--budget", str(10**30)],
     "argument --budget: expected an integer between 1 and 1000000"),  # searched forever
    (["train", "--seed", "-1"], "argument --seed"),
    (["tune", "--data", "d", "--timeout", "-1"], "argument --timeout: expected a positive, finite"),
    (["profile", "--model", "mlp", "--batches", str(10**12)], "--batches: expected comma-separated integers between "
     "1 and 65536"),  # allocated 256 TB
    (["simulate", "--model", "mlp", "--topology", "local-cpu2", "--layout", ""],
     "layout: '': expected key=value"),  # used to blame --baseline
    (["plan", "--model", "mlp", "--topology", "local-cpu2", "--profiles", "no/such/folder"],
     "argument --profiles: expected an existing folder, got 'no/such/folder' (no such folder)"),  # roofline silently
])
def test_sweep_arguments_are_one_line(capsys, argv, needle):
    t0 = time.perf_counter()
    assert needle in one_line_error(capsys, *argv)
    assert time.perf_counter() - t0 < 10


SLOW_LINK = "name: x\nmachines: [{name: a, gpu: T4, count: 2, intra_bandwidth: 1e-300 GB/s}]\n"


@pytest.mark.parametrize("text, field, detail", [
    ("[" * 100_000 + "]" * 100_000, "deep.json: ", "nested too deeply"),  # RecursionError
    (SLOW_LINK, "machines[0].intra_bandwidth", "at least 1 B/s"),  # overflowed the predictor's float32 features
    (SLOW_LINK.replace("1e-300 GB/s", "1 GB/s, intra_latency: 1e300 s"), "machines[0].intra_latency",
     "at most 3600 s"),
])
def test_sweep_topology_files(tmp_path, capsys, text, field, detail):
    path = tmp_path / ("deep.json" if text.startswith("[") else "t.yaml")
    path.write_text(text)
    line = one_line_error(capsys, "topology", "show", str(path))
    assert str(path) in line and field in line and detail in line, line


def test_sweep_plan_files(tmp_path, capsys):
    plan = {"model": "mlp", "graph_signature": "x", "topology": "local-cpu2", "topology_signature": "y",
            "batch_size": 8, "groups": [{"devices": [0, 1], "shares": [0.5, 0.5]}]}
    cases = [({**plan, "groups": []}, "groups: expected 1 to 4096 op-groups, got 0"),  # ValueError in grouping
             ({**plan, "batch_size": 10**12}, "batch_size: expected at most 65536 samples"),  # allocated 256 TB
             (None, "cannot read plan: not UTF-8 text")]  # UnicodeDecodeError
    for i, (d, message) in enumerate(cases):
        path = tmp_path / f"p{i}.json"
        path.write_bytes(bytes(range(256)) if d is None else json.dumps(d).encode())
        line = one_line_error(capsys, "simulate", "--model", "mlp", "--topology", "local-cpu2", "--plan", str(path))
        assert f"{path}: {message}" in line, line


def test_sweep_huge_model_sizes_are_one_line(capsys):
    line = one_line_error(capsys, "inspect", "--model", "mlp:hidden=100000000000")
    assert "workload 'mlp:hidden=100000000000': building the model failed (RuntimeError" in line, line


def test_sweep_output_folders_that_are_files(tmp_path, capsys, topo_copy):
    keep = tmp_path / "keep.json"
    keep.write_text("keep")
    cases = [
        (["plan", "--model", "mlp", "--topology", str(topo_copy), "--out", f"{keep}/p.json"], "--out"),
        (["execute", "--model", "mlp", "--topology", str(topo_copy), "--plan", "p.json", "--run-dir", str(keep)],
         "--run-dir"),
        (["validate", "--model", "mlp", "--topology", str(topo_copy), "--out", str(keep)], "--out"),
        (["profile", "--model", "mlp", "--no-comm", "--out", str(keep)], "--out"),
        (["train", "--run-dir", str(keep)], "run_dir"),
        (["bench", "--out", str(keep)], "--out"),
    ]
    for argv, flag in cases:  # each used to raise FileExistsError / NotADirectoryError, some after the work
        line = one_line_error(capsys, *argv)
        assert f"{flag}: " in line and "is not a folder" in line and str(keep) in line, line
    assert keep.read_text() == "keep"


def test_sweep_train_configs(tmp_path, capsys):
    run = tmp_path / "run"
    cases = [("[]", "expected a JSON object of LoopConfig fields, got list"),  # ran the defaults
             ('{"rounds": "three"}', "rounds: expected an integer, got string 'three'"),  # TypeError
             ('{"rounds": true}', "rounds: expected an integer, got boolean True"),  # ran one round
             ('{"train": null}', "train: expected a JSON object of TrainConfig fields, got null"),
             ('{"train": {"lr": "fast"}}', "train.lr: expected a number, got string 'fast'"),  # TypeError
             ('{"samples_per_round": "x"}', "samples_per_round: expected a list of integers"),
             ('{"gen": {"workers": 1000000000}}', "workers: expected 1..256 processes")]  # a process bomb
    for i, (text, message) in enumerate(cases):
        cfg = tmp_path / f"c{i}.json"
        cfg.write_text(text)
        assert f"{cfg}: {message}" in one_line_error(capsys, "train", "--config", str(cfg), "--run-dir", str(run))
    assert not run.exists()
    # a flag's error names the flag, once (it read "tag train: error: tag train: workers: ...")
    for argv, message in ((["--workers", str(10**9)], "--workers: expected 1..256 processes"),
                          (["--samples", "0"], "--samples: expected a non-empty list of positive integers"),
                          (["--epochs", "0"], "--epochs: expected >= 1, got 0")):
        line = one_line_error(capsys, "train", *argv, "--run-dir", str(run))
        assert message in line and line.count("tag train") == 1, line
    run.mkdir()
    (run / "config.json").write_text("{ damaged")
    line = one_line_error(capsys, "train", "--run-dir", str(run))  # used to overwrite it blind and resume
    assert f"{run / 'config.json'}: line 1: not valid JSON" in line and "repair or remove it" in line, line
    assert (run / "config.json").read_text() == "{ damaged"


def test_a_run_resumes_only_under_the_config_it_was_started_with(tmp_path, capsys, monkeypatch):
    """`tag train --run-dir R` alone resumes R as it was started (it used to take the defaults, so
    later rounds were labelled and fitted otherwise); a config that changes what the run computes is
    refused with one line naming the fields, config.json untouched; --allow-config-change continues under it."""
    import tag.training.loop as loop_mod
    from tag.cli import main
    from tag.training.config import LoopConfig
    seen = []

    class Stop(Exception):
        pass

    def stop(run_dir, cfg):  # the run's logger: made after the checks and the saved config, before round 0
        seen.append(cfg)
        raise Stop
    monkeypatch.setattr(loop_mod, "Logger", stop)
    real = loop_mod.run_loop

    def run_loop(cfg, **kw):
        with pytest.raises(Stop):
            real(cfg, **kw)
        return tmp_path / "none.pt"
    monkeypatch.setattr(loop_mod, "run_loop", run_loop)
    run = tmp_path / "run"
    run.mkdir()
    started = LoopConfig(run_dir=str(tmp_path / "elsewhere"), samples_per_round=[360, 120], wandb="disabled")
    started.train.lr = 1e-3
    started.save(run / "config.json")
    assert main(["train", "--run-dir", str(run), "--no-progress", "--rounds", "4", "--workers", "1"]) == 0
    assert seen[-1].samples_per_round == [360, 120] and seen[-1].train.lr == 1e-3 and seen[-1].rounds == 4
    assert seen[-1].run_dir == str(run)  # where the folder is now, not where it was started
    before = (run / "config.json").read_text()
    line = one_line_error(capsys, "train", "--run-dir", str(run), "--samples", "240", "80", "--epochs", "2")
    assert f"{run / 'config.json'}: the run was started with another config" in line, line
    assert "samples_per_round [360, 120] -> [240, 80]" in line and "train.epochs 6 -> 2" in line, line
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"train": {"lr": 0.002}}))
    line = one_line_error(capsys, "train", "--run-dir", str(run), "--config", str(cfg))
    assert "train.lr 0.001 -> 0.002" in line and "samples_per_round" in line, line
    assert (run / "config.json").read_text() == before
    assert main(["train", "--run-dir", str(run), "--config", str(cfg), "--allow-config-change", "--no-progress"]) == 0
    assert seen[-1].train.lr == 0.002
