"""A machine's host launch cost (topology ``host_launch``): loaded, refused, written back, costed
(:func:`tag.cost.gpu.on_host`), reported by ``tag simulate`` and stated by ``tag profile``."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from tag.cli import main
from tag.cost.gpu import fitted_rates, on_host
from tag.cost.model import CostModel
from tag.cost.profiler import host_launch_of, host_launch_report, time_launches
from tag.errors import TopologyError
from tag.graph import capture
from tag.topology import load_topology
from tag.topology.loader import topology_to_yaml
from tag.workloads import load_workload

TINY = "gpt2:n_layer=2,n_embd=64,n_head=2,vocab=100,seq=16"
FITTED_HOST_S = fitted_rates().host_s  # the H200 host's fitted forward launch: 55 us


def _topo(host: str | None = None, *, second: bool = False, gpu: str = "H200") -> dict:
    machine = {"name": "a", "gpu": gpu, "count": 1}
    if host is not None:
        machine["host_launch"] = host
    machines = [machine] + ([{"name": "b", "gpu": gpu, "count": 1}] if second else [])
    return {"name": "hosts", "machines": machines, "network": {"bandwidth": "100 Gbit/s"}}


def test_host_launch_loads_and_round_trips():
    topo = load_topology(_topo("103 us", second=True))
    assert topo.machines[0].host_launch_s == pytest.approx(103e-6) and topo.machines[1].host_launch_s is None
    back = load_topology(yaml.safe_load(topology_to_yaml(topo)))
    assert back == topo and back.signature() == topo.signature()
    assert load_topology(topo.to_dict()) == topo
    # a topology without it writes no field: its signature is what it was before the field existed
    plain = load_topology(_topo())
    assert "host_launch" not in plain.to_dict()["machines"][0]
    assert "host_launch" not in topology_to_yaml(plain)
    assert plain.signature() != load_topology(_topo("55 us")).signature()


@pytest.mark.parametrize("value, expected", [
    ("0.5 us", "between 1 us and 10 ms"), ("103 ms", "between 1 us and 10 ms"), ("fast", "expected a time"),
    (-3, "positive"), (True, "expected a time"), ([55], "expected a time"), ("55 GB/s", "unknown time unit"),
])
def test_bad_host_launch_is_refused_in_one_line(tmp_path, value, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_topo(value)))
    with pytest.raises(TopologyError) as err:
        load_topology(path)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}: machines[0].host_launch:") and expected in text


def test_host_launch_on_a_cpu_machine_is_refused():
    with pytest.raises(TopologyError, match=r"machines\[0\]\.host_launch: expected on a GPU machine only"):
        load_topology({"name": "c", "machines": [{"name": "a", "gpu": "cpu", "count": 1, "host_launch": "50 us"}]})


def test_on_host_scales_every_host_second_by_one_factor():
    ref = fitted_rates()
    slow = on_host(ref, 2 * ref.host_s)
    assert slow.host_s == 2 * ref.host_s and slow.host_bwd == pytest.approx(2 * ref.host_bwd)
    assert slow.opt_host_s == pytest.approx(2 * ref.opt_host_s) and slow.launch_s == pytest.approx(2 * ref.launch_s)
    assert slow.matmul == ref.matmul and slow.kernel_s == ref.kernel_s and slow.bandwidth == ref.bandwidth
    assert on_host(ref, None) is ref and on_host(ref, ref.host_s) == ref  # the fitted host states nothing new


def _graph(spec: str, batch: int):
    return capture(load_workload(spec, batch=batch, abstract=True), num_groups=4, precision="bf16").graph


def _step_s(graph, host: str | None) -> float:
    return CostModel.for_topology(graph, load_topology(_topo(host)), os.devnull).iteration_time_alone(0)


def test_a_slower_host_slows_host_bound_steps_only():
    """Doubling the host launch doubles a host-bound step (a tiny bf16 gpt2: its kernels are a few
    microseconds, its launches 55 us) and moves a GPU-bound one (a 1024-wide, 1024-token gpt2 at
    batch 64: 77 ms of kernels, 10 ms of launches) by far less: the device seconds are the same, only the host's change."""
    doubled = f"{2 * FITTED_HOST_S * 1e6:g} us"
    small = _graph(TINY, 2)
    fast, slow = _step_s(small, None), _step_s(small, doubled)
    assert 1.85 < slow / fast <= 2.0 + 1e-9
    large = _graph("gpt2:n_layer=2,n_embd=1024,n_head=16,vocab=100,seq=1024", 64)
    fast_l, slow_l = _step_s(large, None), _step_s(large, doubled)
    assert 1.0 < slow_l / fast_l < 1.15
    # the host's share: what the doubled host adds is the fast step's host seconds, never more
    assert slow_l - fast_l <= fast_l and (slow_l - fast_l) / fast_l < (slow - fast) / fast / 5
    # stating the fitted host costs exactly what stating nothing does
    assert _step_s(small, f"{FITTED_HOST_S * 1e6:g} us") == fast


def test_each_machine_costs_its_own_host():
    graph = _graph(TINY, 2)
    topo = load_topology(_topo("110 us", second=True))
    costs = CostModel.for_topology(graph, topo, os.devnull)
    assert costs.device_type(0) == costs.device_type(1) == "H200"
    assert costs.iteration_time_alone(0) > 1.8 * costs.iteration_time_alone(1)
    assert costs.host_launch(0) == (pytest.approx(110e-6), "topology")
    seconds, origin = costs.host_launch(1)
    assert seconds == FITTED_HOST_S and origin.startswith("assumed: fitted to eager steps on an H200 host, 2026-")


def test_simulate_names_the_host_source(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(_topo("110 us", second=True)))
    args = ["simulate", "--model", TINY, "--batch", "4", "--groups", "4", "--precision", "bf16", "--topology",
            str(path), "--baseline", "dp", "--profiles", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("host launch "))
    assert "110 us (topology) on H200 of a" in line and "55 us (assumed: fitted to eager steps on an H200 host" in line
    assert main(args + ["--json"]) == 0
    hosts = json.loads(capsys.readouterr().out)["host_sources"]
    assert [(h["machines"], h["source"]) for h in hosts][0] == (["a"], "topology")
    assert hosts[0]["host_launch_s"] == pytest.approx(110e-6) and hosts[1]["source"].startswith("assumed:")
    # a topology without the field: the same iteration as before, the host labelled an assumption
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump(_topo(second=True)))
    assert main(args[:10] + [str(plain)] + args[11:]) == 0
    assert "host launch 55 us (assumed: fitted to eager steps on an H200 host" in capsys.readouterr().out


def test_profile_states_the_topology_line():
    """The measurement itself runs on CUDA only (``tag profile --device cuda``); its arithmetic and
    the printed line are checked here, on the fitted host's own launch and on this CPU's stream."""
    ref = fitted_rates()
    seconds, line = host_launch_of(ref.launch_s, "H200")
    assert seconds == pytest.approx(ref.host_s) and line == 'host_launch: "55 us"'
    assert host_launch_of(2 * ref.launch_s, "T4")[1] == 'host_launch: "110 us"'  # T4's rule: the H200 host's
    assert load_topology(_topo(yaml.safe_load(line)["host_launch"])).machines[0].host_launch_s == pytest.approx(55e-6)
    report = host_launch_report({"launch_s": ref.launch_s}, "H200")
    assert "9.05 us per launch (measured)" in report and report.endswith('host_launch: "55 us"')
    assert host_launch_report({}, "cpu-2t") is None
    per_kernel = time_launches(torch.device("cpu"), kernels=200, repeats=3, warmup=1)
    assert 0 < per_kernel < 1e-3  # a CPU in-place add of one element: microseconds
