"""Tests for tag.topology: units, catalog, model, loader, detection, table."""

from __future__ import annotations

import copy
import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tag.errors import TagError, TopologyError
from tag.topology import (
    GPU_CATALOG,
    Device,
    GPUSpec,
    Machine,
    Topology,
    detect_topology,
    dump_topology,
    format_bandwidth,
    format_bytes,
    format_time,
    format_topology,
    get_gpu,
    load_topology,
    local_cpu_spec,
    parse_bandwidth,
    parse_bytes,
    parse_time,
)
from tag.topology import catalog as catalog_module
from tag.topology.loader import DEFAULT_INTRA_LATENCY, SHIPPED_DIR, shipped_topologies, topology_to_yaml
from tag.topology.units import format_flops, parse_flops

EXAMPLE = """\
name: lab-mixed
machines:
  - name: a
    gpu: V100-SXM2-16GB        # catalog name, or inline: {name: X, tflops: 14, memory: "16 GB", memory_bandwidth: "900 GB/s"}
    count: 4
    intra_bandwidth: "150 GB/s" # between two GPUs of this machine
  - name: b
    gpu: GTX-1080Ti
    count: 2
    intra_bandwidth: "10 GB/s"
network:
  bandwidth: "25 Gbit/s"        # default between two machines
  latency: "20 us"
  links:                         # optional per-pair overrides
    - {between: [a, b], bandwidth: "10 Gbit/s"}
"""


def example_dict() -> dict:
    return yaml.safe_load(EXAMPLE)


def three_machines() -> dict:
    return {
        "name": "t3",
        "machines": [
            {"name": "a", "gpu": "A100-40GB", "count": 2, "intra_bandwidth": "300 GB/s"},
            {"name": "b", "gpu": "T4", "count": 1},
            {
                "name": "c",
                "gpu": {"name": "X", "tflops": 14, "memory": "16 GB", "memory_bandwidth": "900 GB/s"},
                "count": 3,
                "intra_bandwidth": "10 GB/s",
                "intra_latency": "8 us",
            },
        ],
        "network": {
            "bandwidth": "25 Gbit/s",
            "latency": "20 us",
            "links": [{"between": ["c", "a"], "bandwidth": "10 Gbit/s", "latency": "50 us"}],
        },
    }


@pytest.fixture(autouse=True, scope="module")
def _cache_dir(tmp_path_factory):
    """Every test touching the CPU spec uses a private cache dir (measured at most once here)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TAG_CACHE_DIR", str(tmp_path_factory.mktemp("tag-cache")))
    yield
    mp.undo()


# ------------------------------------------------------------------------------------------- units


def test_parse_units_exact():
    assert parse_bandwidth("25 Gbit/s") == 3.125e9
    assert parse_bandwidth("25Gbps") == 3.125e9
    assert parse_bandwidth("150 GB/s") == 150e9
    assert parse_bandwidth("1 GiB/s") == 2**30
    assert parse_bandwidth("8 bit/s") == 1.0
    assert parse_bandwidth("10 Mbit/s") == 1.25e6
    assert parse_bandwidth("1 TB/s") == 1e12
    assert parse_bandwidth("1 tbit/s") == 1.25e11  # prefix case-insensitive, b = bit
    assert parse_bandwidth("2 kib/s") == 2 * 1024 / 8
    assert parse_bandwidth(1234) == 1234.0
    assert parse_time("20 us") == 2e-05
    assert parse_time("20 µs") == 2e-05
    assert parse_time("1.5 ms") == 0.0015
    assert parse_time("3 ns") == 3e-9
    assert parse_time("2 S") == 2.0
    assert parse_time(0, positive=False) == 0.0
    assert parse_bytes("16 GB") == 16 * 10**9
    assert parse_bytes("16 GiB") == 16 * 2**30
    assert parse_bytes("1.5 kB") == 1500
    assert parse_bytes("2 TiB") == 2 * 2**40
    assert parse_bytes(4096) == 4096
    assert parse_flops("15.7 TFLOPS") == 15.7e12
    assert parse_flops("312 TFLOP/s") == 312e12
    assert parse_flops("5 GFLOP/s") == 5e9


@pytest.mark.parametrize(
    "fn, value",
    [
        (parse_bandwidth, "25 Gbt/s"),
        (parse_bandwidth, "25 GB"),
        (parse_bandwidth, ""),
        (parse_bandwidth, "   "),
        (parse_bandwidth, "fast"),
        (parse_bandwidth, "-1 GB/s"),
        (parse_bandwidth, "0 GB/s"),
        (parse_bandwidth, 0),
        (parse_bandwidth, float("nan")),
        (parse_bandwidth, float("inf")),
        (parse_bandwidth, True),
        (parse_bandwidth, None),
        (parse_bandwidth, [1]),
        (parse_bytes, "16 gb"),  # lower-case b is bits: ambiguous for a size
        (parse_bytes, "16 GiBs"),
        (parse_bytes, "0.1 B"),
        (parse_time, "20 uss"),
        (parse_time, "-1 s"),
        (parse_flops, "15 TFLOP"),
    ],
)
def test_parse_rejects(fn, value):
    with pytest.raises(ValueError) as info:
        fn(value)
    assert "\n" not in str(info.value) and str(info.value)


def test_format_units():
    assert format_bandwidth(3.125e9, bits=True) == "25 Gbit/s"
    assert format_bandwidth(1.5e11) == "150 GB/s"
    assert format_bytes(16 * 10**9) == "16 GB"
    assert format_bytes(16 * 2**30) == "16 GiB"
    assert format_time(2e-5) == "20 us"
    assert format_time(0) == "0 s"
    assert format_flops(15.7e12) == "15.7 TFLOP/s"
    assert format_bytes(25276063744, digits=4) == "23.54 GiB"  # display: binary prefixes only


_BW_UNITS = {
    "B/s": 1, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12, "KiB/s": 2**10, "MiB/s": 2**20,
    "GiB/s": 2**30, "bit/s": 1 / 8, "Kbit/s": 1e3 / 8, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8,
    "Tbit/s": 1e12 / 8, "Gbps": 1e9 / 8, "gb/s": 1e9 / 8, "gB/S": 1e9, "mib/s": 2**20 / 8,
}
_SIZE_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20,
               "GiB": 2**30, "TiB": 2**40, "gB": 1e9, "giB": 2**30}
_TIME_UNITS = {"s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9, "MS": 1e-3}
_FLOP_UNITS = {"FLOP/s": 1, "GFLOP/s": 1e9, "TFLOP/s": 1e12, "TFLOPS": 1e12, "tflops": 1e12}

_numbers = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(st.floats(min_value=1e-6, max_value=1e18), st.booleans())
def test_bandwidth_format_roundtrip(value, bits):
    assert math.isclose(parse_bandwidth(format_bandwidth(value, bits=bits)), value, rel_tol=1e-9)


@given(st.integers(min_value=1, max_value=10**18))
def test_bytes_format_roundtrip(value):
    assert parse_bytes(format_bytes(value)) == value


@given(st.floats(min_value=1e-12, max_value=1e6))
def test_time_and_flops_format_roundtrip(value):
    assert math.isclose(parse_time(format_time(value)), value, rel_tol=1e-9)
    assert math.isclose(parse_flops(format_flops(value * 1e6)), value * 1e6, rel_tol=1e-9)


@given(_numbers, st.sampled_from(sorted(_BW_UNITS)), st.sampled_from(["", " ", "  "]))
def test_bandwidth_units_multiply(number, unit, space):
    text = f"{number!r}{space}{unit}"
    assert math.isclose(parse_bandwidth(text), number * _BW_UNITS[unit], rel_tol=1e-12)


@given(_numbers, st.sampled_from(sorted(_SIZE_UNITS)))
def test_size_units_multiply(number, unit):
    expected = round(Fraction(repr(number)) * Fraction(_SIZE_UNITS[unit]))  # exact integer bytes
    if expected < 1:
        return
    assert parse_bytes(f"{number!r} {unit}") == expected


@given(_numbers, st.sampled_from(sorted(_TIME_UNITS)), st.sampled_from(sorted(_FLOP_UNITS)))
def test_time_and_flop_units_multiply(number, time_unit, flop_unit):
    assert math.isclose(parse_time(f"{number!r} {time_unit}"), number * _TIME_UNITS[time_unit], rel_tol=1e-12)
    assert math.isclose(parse_flops(f"{number!r}{flop_unit}"), number * _FLOP_UNITS[flop_unit], rel_tol=1e-12)


# ----------------------------------------------------------------------------------------- catalog


REQUIRED_GPUS = [
    "P100-SXM2-16GB", "P100-PCIe-16GB", "V100-PCIe-16GB", "V100-PCIe-32GB", "V100-SXM2-16GB",
    "V100-SXM2-32GB", "GTX-1080Ti", "RTX-2080Ti", "T4", "RTX-3090", "A10", "A100-40GB", "A100-80GB",
    "L4", "L40S", "H100-SXM", "H100-PCIe", "H200",
]


def test_catalog_contents():
    for name in REQUIRED_GPUS:
        spec = GPU_CATALOG[name]
        assert spec.name == name
        assert spec.fp32_flops > 1e12 and spec.fp16_flops > 0
        assert spec.memory_bytes >= 8 * 2**30 and spec.memory_bandwidth > 1e11
    assert GPU_CATALOG["V100-SXM2-16GB"].fp32_flops == 15.7e12
    assert GPU_CATALOG["A100-80GB"].memory_bytes == 80 * 2**30
    assert GPU_CATALOG["H100-SXM"].memory_bandwidth == 3.35e12
    with pytest.raises(TypeError):
        GPU_CATALOG["new"] = GPU_CATALOG["T4"]  # read-only mapping


@pytest.mark.parametrize(
    "spelling, expected",
    [
        ("v100_sxm2_16gb", "V100-SXM2-16GB"),
        ("V100 SXM2 16GB", "V100-SXM2-16GB"),
        ("Tesla V100-SXM2-16GB", "V100-SXM2-16GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA GeForce RTX 3090", "RTX-3090"),
        ("gtx1080ti", "GTX-1080Ti"),
        ("t4", "T4"),
    ],
)
def test_get_gpu_tolerant(spelling, expected):
    assert get_gpu(spelling) is GPU_CATALOG[expected]


def test_get_gpu_unknown_suggests():
    with pytest.raises(KeyError) as info:
        get_gpu("V100-SXM2-64GB")
    message = info.value.args[0]
    assert "V100-SXM2-16GB" in message and "\n" not in message


def test_local_cpu_spec_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TAG_CACHE_DIR", str(tmp_path))
    spec = local_cpu_spec()
    assert spec.name == "cpu" and spec.fp32_flops > 1e8 and spec.memory_bandwidth > 1e8
    assert spec.memory_bytes > 2**28
    cache = tmp_path / "cpu_spec.json"
    assert cache.exists() and json.loads(cache.read_text())

    def fail():
        raise AssertionError("should have used the cache")

    monkeypatch.setattr(catalog_module, "_measure_cpu", fail)
    assert local_cpu_spec() == spec
    assert get_gpu("cpu") == spec


def test_local_cpu_spec_corrupt_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TAG_CACHE_DIR", str(tmp_path))
    (tmp_path / "cpu_spec.json").write_text("{not json")
    fake = GPUSpec("cpu", 1e9, 1e9, 2**30, 1e9)
    monkeypatch.setattr(catalog_module, "_measure_cpu", lambda: fake)
    assert local_cpu_spec() == fake
    assert local_cpu_spec() == fake  # now read from the rewritten cache
    assert not list(tmp_path.glob("*.tmp"))


def test_cache_dir_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("TAG_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert catalog_module.cache_dir() == tmp_path / "tag"


# ------------------------------------------------------------------------------------- model/loader


def test_example_schema_exact(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(EXAMPLE)
    topo = load_topology(path)
    assert topo.name == "lab-mixed"
    assert topo.num_devices == 6
    assert [m.name for m in topo.machines] == ["a", "b"]
    assert topo.network_bandwidth == 3.125e9
    assert topo.network_latency == 2e-05
    assert topo.machines[0].intra_bandwidth == 150e9
    assert topo.machines[0].intra_latency == DEFAULT_INTRA_LATENCY
    assert topo.machines[0].gpu is GPU_CATALOG["V100-SXM2-16GB"]
    assert topo.bandwidth(0, 1) == 150e9  # intra a
    assert topo.bandwidth(4, 5) == 10e9  # intra b
    assert topo.bandwidth(0, 4) == 1.25e9  # override a-b: 10 Gbit/s
    assert topo.latency(0, 4) == 2e-05  # link latency defaults to the network latency
    assert topo.bandwidth(3, 3) == math.inf and topo.latency(3, 3) == 0.0
    assert topo.machine_of(5) == 1 and topo.devices_of_machine(1) == [4, 5]
    assert topo.devices[5] == Device(5, "b", 1, GPU_CATALOG["GTX-1080Ti"]) and topo.devices[5].name == "b:1"
    assert load_topology(example_dict()) == topo


def test_inline_gpu_and_links():
    topo = load_topology(three_machines())
    assert topo.num_devices == 6
    x = topo.machines[2].gpu
    assert x == GPUSpec("X", 14e12, 14e12, 16 * 10**9, 900e9)
    assert topo.machines[1].intra_bandwidth is None
    assert topo.bandwidth(0, 1) == 300e9
    assert topo.bandwidth(0, 2) == 3.125e9 and topo.latency(0, 2) == 2e-5
    assert topo.bandwidth(1, 3) == 1.25e9 and topo.latency(3, 1) == 5e-5  # c-a override
    assert topo.bandwidth(2, 3) == 3.125e9  # b-c default
    assert topo.latency(3, 4) == 8e-6
    assert topo.machine_bandwidth(0, 2) == 1.25e9 and topo.machine_latency(2, 0) == 5e-5
    assert topo.machine_bandwidth(2, 2) == 10e9
    bw = topo.bandwidth_matrix
    assert bw.shape == (6, 6) and np.array_equal(bw, bw.T)
    assert np.all(np.diag(bw) == np.inf) and np.all(np.diag(topo.latency_matrix) == 0)
    assert not bw.flags.writeable


def test_graph():
    topo = load_topology(three_machines())
    g = topo.graph
    assert g.number_of_nodes() == 6 and g.number_of_edges() == 15
    assert g.nodes[3]["machine"] == "c" and g.nodes[3]["fp32_flops"] == 14e12 and g.nodes[3]["name"] == "c:0"
    assert g.edges[1, 3]["bandwidth"] == 1.25e9 and g.edges[0, 1]["latency"] == DEFAULT_INTRA_LATENCY
    assert topo.graph is g


def test_to_dict_roundtrip_and_signature(tmp_path):
    topo = load_topology(three_machines())
    data = topo.to_dict()
    json.dumps(data)  # plain JSON-able
    again = load_topology(copy.deepcopy(data))
    assert again == topo and again.to_dict() == data
    assert again.signature() == topo.signature() and len(topo.signature()) == 16
    assert hash(again) == hash(topo)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    assert load_topology(path) == topo
    out = dump_topology(topo, tmp_path / "sub" / "t.yaml")
    text = out.read_text()
    assert "25 Gbit/s" in text and "300 GB/s" in text
    assert load_topology(out) == topo
    changed = three_machines()
    changed["network"]["bandwidth"] = "26 Gbit/s"
    assert load_topology(changed).signature() != topo.signature()


def test_shipped_topologies_load():
    shipped = shipped_topologies()
    expected = {
        "tag-testbed", "mixed-a100-v100", "cloud-t4", "homogeneous-8xa100", "homogeneous-2x4-v100",
        "cluster-16gpu-4m", "local-cpu2", "local-cpu4",
    }
    assert expected <= set(shipped)
    for name, path in shipped.items():
        topo = load_topology(path)
        assert topo.name == name
        assert load_topology(topo.to_dict()) == topo
    testbed = load_topology(SHIPPED_DIR / "tag-testbed.yaml")
    assert testbed.num_devices == 16 and testbed.num_machines == 7
    assert math.isclose(testbed.network_bandwidth, 2.8e9)
    assert load_topology("local-cpu4").num_devices == 4  # by shipped name
    cluster = load_topology("cluster-16gpu-4m")
    assert len({m.gpu.name for m in cluster.machines}) == 4 and cluster.links


# The shipped topologies at scale: name -> (devices, machines, GPU kinds).
SCALE = {"hetero-64gpu": (64, 10, 3), "hetero-128gpu": (128, 16, 3), "cloud-256gpu-3zones": (256, 40, 3), "h100-512gpu": (512, 64, 1),
         "h100-512gpu-8nic": (512, 64, 1)}


def test_eight_nics_sum_to_eight_ports():
    """h100-512gpu-8nic is h100-512gpu's machines with 8 x 400 Gbit/s NICs a machine, summed."""
    one, eight = load_topology("h100-512gpu"), load_topology("h100-512gpu-8nic")
    assert eight.network_bandwidth == 8 * one.network_bandwidth == 3200e9 / 8
    assert [m.gpu for m in eight.machines] == [m.gpu for m in one.machines]
    assert "nics: 8 x 400 Gbit/s" in (SHIPPED_DIR / "h100-512gpu-8nic.yaml").read_text()


@pytest.mark.parametrize("name", sorted(SCALE))
def test_scale_topologies(name):
    devices, machines, kinds = SCALE[name]
    topo = load_topology(name)
    assert (topo.num_devices, topo.num_machines) == (devices, machines)
    assert len({m.gpu.name for m in topo.machines}) == kinds
    # Loading holds machine-level state only: the [D, D] matrices are built on first use.
    assert "bandwidth_matrix" not in topo.__dict__ and "latency_matrix" not in topo.__dict__
    assert topo.machine_bandwidth_matrix.shape == (machines, machines)
    assert load_topology(yaml.safe_load(topology_to_yaml(topo))) == topo  # zones dumped as links


def test_zones_expand_to_links():
    cloud = load_topology("cloud-256gpu-3zones")
    gbit = 1e9 / 8
    a100, v100, t4 = (cloud.devices_of_machine(cloud.machine_index(n))[0] for n in ("a100-00", "v100-00", "t4-00"))
    a100b = cloud.devices_of_machine(cloud.machine_index("a100-11"))[0]
    t4b = cloud.devices_of_machine(cloud.machine_index("t4-15"))[0]
    assert cloud.bandwidth(a100, a100b) == 400 * gbit and cloud.latency(a100, a100b) == 15e-6  # zone-a
    assert cloud.bandwidth(t4, t4b) == 50 * gbit  # zone-c
    assert cloud.bandwidth(a100, v100) == cloud.bandwidth(v100, t4) == 10 * gbit  # across zones
    assert cloud.latency(a100, t4) == 1e-3
    lab = load_topology("hetero-64gpu")  # a zone of two GPU kinds; machines without a zone
    assert lab.machine_bandwidth(lab.machine_index("a100-00"), lab.machine_index("v100-03")) == 100 * gbit
    assert lab.machine_bandwidth(lab.machine_index("v100-00"), lab.machine_index("t4-00")) == 25 * gbit
    # an explicit link overrides a zone's; a zone giving only a latency keeps the default bandwidth
    data = example_dict()
    data["machines"].append({"name": "c", "gpu": "T4", "count": 1, "zone": "z"})
    data["machines"][0]["zone"] = data["machines"][1]["zone"] = "z"
    data["network"]["zones"] = [{"name": "z", "latency": "2 us"}]
    topo = load_topology(data)
    assert topo.links[frozenset("ab")] == (10 * gbit, 20e-6)  # the example's link
    assert topo.links[frozenset("ac")] == (25 * gbit, 2e-6)
    with pytest.raises(TopologyError, match="machines.0..zone: a zone needs network.zones"):
        load_topology({"name": "x", "machines": [{"name": "a", "gpu": "T4", "count": 1, "zone": "z"}]})


def test_format_topology():
    text = format_topology(load_topology("cluster-16gpu-4m"))
    for token in ("a100", "A100-40GB", "19.5", "40 GiB", "300 GB/s", "25 Gbit/s", "10 Gbit/s", "40 us"):
        assert token in text
    assert "lab-mixed" in format_topology(load_topology(example_dict()))


def test_detect_topology_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    topo = detect_topology("here")
    assert topo.name == "here" and topo.num_devices == 1
    assert topo.machines[0].gpu.name == "cpu"
    assert load_topology(topo.to_dict()) == topo


def test_detect_topology_cuda_mocked(monkeypatch):
    """The CUDA path without a GPU: catalog matching, grouping by kind, measured p2p stubbed."""
    import torch

    from tag.topology import detect as detect_module

    names = ["NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", "Tesla T4"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    monkeypatch.setattr(detect_module, "_measure_p2p_bandwidth", lambda a, b: 2e11 if b == 1 else 1e10)
    topo = detect_topology()
    assert [m.gpu.name for m in topo.machines] == ["A100-40GB", "T4"]
    assert [m.count for m in topo.machines] == [2, 1]
    assert topo.bandwidth(0, 1) == 2e11 and topo.bandwidth(0, 2) == 1e10
    names[:] = names[:2]
    single = detect_topology("x")
    assert single.num_machines == 1 and single.network_bandwidth == 2e11


def test_model_validation():
    t4 = GPU_CATALOG["T4"]
    with pytest.raises(TopologyError):
        Machine("m", t4, 0, 1e9, 0.0)
    with pytest.raises(TopologyError):
        Machine("m", t4, 2, None, 0.0)
    with pytest.raises(TopologyError):
        Machine("m", t4, 2, -1.0, 0.0)
    ok = Machine("m", t4, 2, 1e9, 0.0)
    with pytest.raises(TopologyError):
        Topology("t", (ok, ok), 1e9, 0.0)
    with pytest.raises(TopologyError):
        Topology("t", (), 1e9, 0.0)
    with pytest.raises(TopologyError):
        Topology("t", (ok,), 0.0, 0.0)
    with pytest.raises(TopologyError):
        Topology("t", (ok,), 1e9, 0.0, {frozenset({"m", "zz"}): (1e9, 0.0)})
    with pytest.raises(TopologyError):
        GPUSpec("g", -1.0, 1.0, 1, 1.0)
    assert issubclass(TopologyError, TagError)


# --------------------------------------------------------------------------------------- bad inputs


def _set(path, value):
    def mutate(root):
        *parents, last = path
        d = root
        for p in parents:
            d = d[p]
        if value is _DELETE:
            del d[last]
        elif isinstance(d, list) and last == len(d):
            d.append(value)
        else:
            d[last] = value
        return root

    return mutate


_DELETE = object()

BAD = [
    # (mutation of the example dict, substring naming the field, substring naming the value/expectation)
    (_set(["name"], _DELETE), "name", "missing field"),
    (_set(["machines"], _DELETE), "machines", "missing field"),
    (_set(["machines"], []), "machines", "non-empty list"),
    (_set(["machines"], {"a": 1}), "machines", "non-empty list"),
    (_set(["machines", 1, "gpu"], _DELETE), "machines[1].gpu", "missing field"),
    (_set(["machines", 1, "count"], _DELETE), "machines[1].count", "missing field"),
    (_set(["machines", 1, "name"], _DELETE), "machines[1].name", "missing field"),
    (_set(["machines", 1, "count"], -2), "machines[1].count", "got -2"),
    (_set(["machines", 1, "count"], 0), "machines[1].count", "positive integer"),
    (_set(["machines", 1, "count"], "2"), "machines[1].count", "got '2'"),
    (_set(["machines", 1, "count"], 2.5), "machines[1].count", "got 2.5"),
    (_set(["machines", 1, "count"], True), "machines[1].count", "got True"),
    (_set(["machines", 0, "intra_bandwidth"], _DELETE), "machines[0].intra_bandwidth", "missing field"),
    (_set(["machines", 0, "intra_bandwidth"], "0 GB/s"), "machines[0].intra_bandwidth", "positive"),
    (_set(["machines", 0, "intra_bandwidth"], "-5 GB/s"), "machines[0].intra_bandwidth", "'-5 GB/s'"),
    (_set(["machines", 0, "intra_bandwidth"], "150 GBs"), "machines[0].intra_bandwidth", "'GBs'"),
    (_set(["machines", 0, "intra_latency"], "5 uss"), "machines[0].intra_latency", "unknown time unit"),
    (_set(["machines", 0, "gpu"], "V100-SXM3-16GB"), "machines[0].gpu", "V100-SXM2-16GB"),
    (_set(["machines", 0, "gpu"], 7), "machines[0].gpu", "got 7"),
    (_set(["machines", 0, "gpu"], {"name": "X", "tflops": 14, "memory": "0 GB", "memory_bandwidth": "1 GB/s"}),
     "machines[0].gpu.memory", "positive"),
    (_set(["machines", 0, "gpu"], {"name": "X", "tflops": -1, "memory": "1 GB", "memory_bandwidth": "1 GB/s"}),
     "machines[0].gpu.tflops", "got -1"),
    (_set(["machines", 0, "gpu"], {"name": "X", "memory": "1 GB", "memory_bandwidth": "1 GB/s"}),
     "machines[0].gpu.tflops", "missing field"),
    (_set(["machines", 0, "gpu"], {"name": "X", "tflops": 1, "memory_bandwidth": "1 GB/s"}),
     "machines[0].gpu.memory", "missing field"),
    (_set(["machines", 0, "gpu"], {"name": "X", "tflops": 1, "memory": "1 GB", "memory_bandwith": "1 GB/s"}),
     "machines[0].gpu.memory_bandwith", "unknown field"),
    (_set(["machines", 1, "name"], "a"), "machines[1].name", "duplicate machine name 'a'"),
    (_set(["machines", 1, "name"], ""), "machines[1].name", "non-empty"),
    (_set(["machines", 1, "cont"], 2), "machines[1].cont", "unknown field"),
    (_set(["machines", 0], "a"), "machines[0]", "expected a mapping"),
    (_set(["network", "bandwith"], "1 GB/s"), "network.bandwith", "unknown field"),
    (_set(["network", "bandwidth"], _DELETE), "network.bandwidth", "missing field"),
    (_set(["network"], _DELETE), "network", "missing field"),
    (_set(["network", "bandwidth"], "25 Gbt/s"), "network.bandwidth", "'Gbt/s'"),
    (_set(["network", "bandwidth"], 0), "network.bandwidth", "positive"),
    (_set(["network", "latency"], "-1 us"), "network.latency", "non-negative"),
    (_set(["network", "links", 0, "between"], ["a", "zz"]), "network.links[0].between", "unknown machine 'zz'"),
    (_set(["network", "links", 0, "between"], ["a", "a"]), "network.links[0].between", "two different"),
    (_set(["network", "links", 0, "between"], ["a"]), "network.links[0].between", "two machine names"),
    (_set(["network", "links", 0, "between"], _DELETE), "network.links[0].between", "missing field"),
    (_set(["network", "links", 0, "bandwidth"], "-1 Gbit/s"), "network.links[0].bandwidth", "positive"),
    (_set(["network", "links", 0, "latency"], "x"), "network.links[0].latency", "'x'"),
    (_set(["network", "links", 0, "speed"], 1), "network.links[0].speed", "unknown field"),
    (_set(["network", "links"], "a-b"), "network.links", "list"),
    (_set(["network", "links", 1], {"between": ["b", "a"], "bandwidth": 1}), "network.links[1].between",
     "duplicate link"),
    (_set(["nmae"], "x"), "nmae", "did you mean 'name'"),
    (_set(["machines", 0, "zone"], "z9"), "machines[0].zone", "unknown zone 'z9'"),
    (_set(["machines", 0, "zone"], ""), "machines[0].zone", "non-empty name"),
    (_set(["network", "zones"], [{"name": "z1", "bandwidth": "1 Gbit/s"}]), "network.zones", "'z1' has no machine"),
    (_set(["network", "zones"], "z1"), "network.zones", "list of zones"),
    (_set(["network", "zones"], [{"name": "z1"}]), "network.zones[0]", "bandwidth and/or latency"),
    (_set(["network", "zones"], [{"name": "z1", "bandwidth": "x"}]), "network.zones[0].bandwidth", "'x'"),
    (_set(["network", "zones"], [{"name": "z1", "bw": 1}]), "network.zones[0].bw", "unknown field"),
    (_set(["network", "zones"], [{"bandwidth": 1}]), "network.zones[0].name", "missing field"),
]


@pytest.mark.parametrize("mutate, field, detail", BAD, ids=[f"{b[1]}-{b[2]}" for b in BAD])
def test_bad_inputs(mutate, field, detail, tmp_path):
    data = example_dict()
    mutate(data)
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    assert f" {field}: " in message or f" {field} " in message or f"{field}:" in message
    assert detail in message
    with pytest.raises(TopologyError, match="^my-source: "):
        load_topology(mutate(example_dict()), source="my-source")


def test_file_errors(tmp_path):
    with pytest.raises(TopologyError, match="missing.yaml: file not found"):
        load_topology(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmachines: [\n  - {name: a\n")
    with pytest.raises(TopologyError, match=r"bad.yaml: line \d+: invalid YAML") as info:
        load_topology(bad)
    assert "\n" not in str(info.value)
    dup = tmp_path / "dup.yaml"
    dup.write_text("name: x\nname: y\nmachines: []\n")
    with pytest.raises(TopologyError, match=r"dup.yaml: line 2: invalid YAML: duplicate key 'name'"):
        load_topology(dup)
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    with pytest.raises(TopologyError, match="list.yaml: expected a mapping at the top level"):
        load_topology(top)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(TopologyError, match="empty.yaml: expected a mapping"):
        load_topology(empty)
    js = tmp_path / "bad.json"
    js.write_text('{"name": "x",\n "machines": [}')
    with pytest.raises(TopologyError, match=r"bad.json: line 2: invalid JSON"):
        load_topology(js)
    with pytest.raises(TopologyError):
        load_topology(42)


def test_single_device_machine_needs_no_intra_or_network():
    topo = load_topology({"name": "one", "machines": [{"name": "m", "gpu": "T4", "count": 1}]})
    assert topo.num_devices == 1 and topo.network_bandwidth > 0
    assert load_topology(topo.to_dict()) == topo


def test_cpu_topology_loads():
    topo = load_topology(SHIPPED_DIR / "local-cpu2.yaml")
    assert topo.machines[0].gpu == local_cpu_spec()
    assert topo.bandwidth(0, 1) == 5e9


# ---------------------------------------------------------------------------- random topology dicts

_bw_text = st.builds(
    lambda x, unit: f"{x:.6g} {unit}",
    st.floats(min_value=0.01, max_value=999),
    st.sampled_from(["MB/s", "GB/s", "Gbit/s", "Mbit/s", "GiB/s", "Gbps"]),
)
_gpu = st.one_of(
    st.sampled_from(sorted(GPU_CATALOG)),
    st.builds(
        # (one name per set of figures: costs are kept per GPU name, the loader refuses a clash)
        lambda t, m, b: {"name": f"custom-{t!r}-{m}-{b}", "tflops": t, "memory": f"{m} GiB", "memory_bandwidth": f"{b} GB/s"},
        st.floats(min_value=0.1, max_value=1000),
        st.integers(min_value=1, max_value=256),
        st.integers(min_value=1, max_value=5000),
    ),
)


@st.composite
def topology_dicts(draw):
    num_machines = draw(st.integers(min_value=1, max_value=5))
    names = [f"m{k}" for k in range(num_machines)]
    machines = []
    for name in names:
        count = draw(st.integers(min_value=1, max_value=6))
        entry = {"name": name, "gpu": draw(_gpu), "count": count}
        if count > 1 or draw(st.booleans()):
            entry["intra_bandwidth"] = draw(_bw_text)
        if draw(st.booleans()):
            entry["intra_latency"] = f"{draw(st.integers(min_value=0, max_value=100))} us"
        machines.append(entry)
    network = {"bandwidth": draw(_bw_text)}
    if draw(st.booleans()):
        network["latency"] = f"{draw(st.floats(min_value=0, max_value=1000)):.4g} us"
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs))) if pairs else []
    if chosen:
        network["links"] = [{"between": list(p), "bandwidth": draw(_bw_text)} for p in chosen]
    return {"name": "random", "machines": machines, "network": network}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology_dicts())
def test_random_topologies(data):
    topo = load_topology(data)
    assert topo.num_devices == sum(m["count"] for m in data["machines"])
    bw, lat = topo.bandwidth_matrix, topo.latency_matrix
    assert np.array_equal(bw, bw.T) and np.array_equal(lat, lat.T)
    assert np.all(bw > 0) and np.all(lat >= 0)
    for i in range(topo.num_devices):
        for j in range(topo.num_devices):
            assert topo.bandwidth(i, j) == bw[i, j]
            if i != j and topo.machine_of(i) == topo.machine_of(j):
                assert bw[i, j] == topo.machines[topo.machine_of(i)].intra_bandwidth
    for link in data["network"].get("links", []):
        a, b = (topo.machine_index(n) for n in link["between"])
        assert topo.machine_bandwidth(a, b) == parse_bandwidth(link["bandwidth"])
    assert load_topology(topo.to_dict()) == topo


def test_dump_is_atomic_and_readable(tmp_path):
    topo = load_topology("tag-testbed")
    target = tmp_path / "out.yaml"
    target.write_text("old")
    dump_topology(topo, target)
    assert not list(tmp_path.glob(".out.yaml.*"))
    text = target.read_text()
    assert text.startswith("# TAG topology") and "22.4 Gbit/s" in text and "GTX-1080Ti" in text
    assert load_topology(target) == topo
    assert Path(SHIPPED_DIR).is_dir()


def test_local_cpu_signature_does_not_depend_on_the_measurement(tmp_path, monkeypatch):
    """A plan made for local-cpu2 on one host must match the same file on another host."""
    sigs = []
    for flops in (1e9, 3e10):
        monkeypatch.setenv("TAG_CACHE_DIR", str(tmp_path / str(flops)))
        monkeypatch.setattr(catalog_module, "_measure_cpu", lambda f=flops: GPUSpec("cpu", f, f, 2**31, 1e10))
        topo = load_topology(SHIPPED_DIR / "local-cpu2.yaml")
        assert topo.machines[0].gpu.fp32_flops == flops
        sigs.append(topo.signature())
    assert sigs[0] == sigs[1]
    three = {"name": "local-cpu2", "machines": [{"name": "local", "gpu": "cpu", "count": 3,
                                                   "intra_bandwidth": "5 GB/s"}]}
    changed = load_topology(three)
    assert changed.signature() != sigs[0]  # the declared shape still counts


def test_restricted_keeps_machines_links_and_device_order():
    """A sub-topology of whole machines: their devices in this topology's order, the links between
    them (a per-pair override included), the device map back; out-of-range machines are one line."""
    from tag.errors import TopologyError

    topo = load_topology("topologies/cloud-256gpu-3zones.yaml")
    a, b, c = 0, 1, topo.num_machines - 1  # a, b: one zone (a per-pair link), c: another zone
    assert topo.machine_bandwidth(a, b) != topo.network_bandwidth
    sub, devices = topo.restricted([c, b, a])
    assert [m.name for m in sub.machines] == [topo.machines[k].name for k in (a, b, c)]
    assert devices == topo.devices_of_machine(a) + topo.devices_of_machine(b) + topo.devices_of_machine(c)
    for i, j in [(0, 1), (0, 2), (1, 2)]:
        x, y = (a, b, c)[i], (a, b, c)[j]
        assert sub.machine_bandwidth(i, j) == topo.machine_bandwidth(x, y)
        assert sub.machine_latency(i, j) == topo.machine_latency(x, y)
    assert all(sub.devices[i].gpu == topo.devices[d].gpu for i, d in enumerate(devices))
    with pytest.raises(TopologyError, match=r"restricted: expected machine indices in 0\.\."):
        topo.restricted([topo.num_machines])
