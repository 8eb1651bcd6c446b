"""Cost model: profile interpolation and storage, latency-bandwidth fits, source resolution
(profile > scaled profile > roofline), communication model with measured gloo fits."""

from __future__ import annotations

import numpy as np
import pytest
from test_sim_tools import chain_graph, topology

from tag.cost.baselines import baseline_plan, cost_model_speeds
from tag.cost.comm import (
    CommProfile,
    LinkFit,
    find_comm_profile,
    fit_latency_bandwidth,
    fitted_allgather_time,
    fitted_allreduce_time,
)
from tag.cost.gpu import Numerics
from tag.cost.model import CostModel, device_type
from tag.cost.profile import Profile, ProfileError, find_profile, load_profile
from tag.cost.roofline import Roofline, group_phase_table
from tag.parallel import validate_plan
from tag.topology import load_topology


def _profile(graph, dtype: str, scale: float = 1.0) -> Profile:
    k = graph.num_groups
    # fwd(b) = 1 ms + 0.5 ms * b, bwd = 2x fwd, opt 0.3 ms per group.
    fwd = [[scale * (1e-3 + 5e-4 * b) for b in (1, 4, 8)] for _ in range(k)]
    bwd = [[2 * x for x in row] for row in fwd]
    return Profile(dtype, graph.model, graph.signature(), graph.batch_size, graph.optimizer, [1, 4, 8], fwd, bwd,
                   [scale * 3e-4] * k, 1e-4)


def test_interpolation_and_extrapolation():
    p = _profile(chain_graph(2), "cpu-1t")
    t = p.table([0, 1, 2, 4, 6, 8, 12])
    expect = [0.0] + [1e-3 + 5e-4 * b for b in (1, 2, 4, 6, 8, 12)]
    assert t[0, 0] == pytest.approx(expect)
    assert t[1, 1] == pytest.approx([2 * x for x in expect])
    assert t[0, 2, 1:] == pytest.approx([3e-4] * 6) and t[0, 2, 0] == 0.0
    # below the smallest profiled batch: linear, never faster than proportional
    q = Profile("c", "m", "s", 8, "adam", [2, 4], [[4e-3, 5e-3]], [[0, 0]], [0]).table([1])
    assert q[0, 0, 0] == pytest.approx(3.5e-3)


def test_profile_roundtrip_merge_and_errors(tmp_path):
    g = chain_graph(2)
    p = _profile(g, "cpu-1t")
    path = p.save(tmp_path)
    assert path.parent.name == "cpu-1t" and path.name.endswith(f"-{g.signature()}.json")
    q = load_profile(path)
    assert q.batches == [1, 4, 8] and q.fwd[0] == pytest.approx(p.fwd[0])
    more = Profile("cpu-1t", g.model, g.signature(), 8, "adam", [2, 8], [[9.0, 9.0]] * 2, [[9.0, 9.0]] * 2,
                   [1.0, 1.0], 0.0)
    more.save(tmp_path)
    merged = find_profile(tmp_path, "cpu-1t", g.signature())
    assert merged.batches == [1, 2, 4, 8] and merged.fwd[0][1] == 9.0 and merged.fwd[0][0] == p.fwd[0][0]
    path.write_text("{not json")
    with pytest.raises(ProfileError, match=r"line 1: not valid JSON"):
        load_profile(path)
    path.write_text('{"version": 1}')
    with pytest.raises(ProfileError, match="malformed profile"):
        load_profile(path)


def test_fit_latency_bandwidth_recovers_line():
    sizes = [4096 * 4**k for k in range(7)]
    fit = fit_latency_bandwidth(sizes, [50e-6 + s / 2e9 for s in sizes])
    assert fit.alpha == pytest.approx(50e-6, rel=1e-6) and fit.beta == pytest.approx(2e9, rel=1e-6)
    assert fit.time(1e6) == pytest.approx(50e-6 + 1e6 / 2e9)


def test_roofline_table_picks_the_binding_roof():
    g = chain_graph(1)  # every op: 1 FLOP/sample, 16 bytes/sample
    t = group_phase_table(g, Roofline(flop_rate=1.0, mem_bandwidth=1e9), [0, 2], overhead=0.0)
    fwd_ops = sum(1 for o in g.ops if o.phase == "fwd")
    assert t[0, 0, 1] == pytest.approx(fwd_ops * 2.0)  # compute-bound at 1 FLOP/s
    t = group_phase_table(g, Roofline(flop_rate=1e12, mem_bandwidth=16.0), [2], overhead=1.0)
    assert t[0, 0, 0] == pytest.approx(fwd_ops * (2.0 + 1.0))  # memory-bound + per-op overhead


def test_optimizer_is_costed_per_byte_plus_a_fixed_step():
    """One multi-tensor step per device: the roofline charges update ops their bytes, no launch
    each (per parameter), and the step a fixed cost; the profiler's fit recovers fixed + per byte."""
    from tag.cost.optim import STEP_OPS
    from tag.cost.profiler import fit_fixed_per_byte
    from tag.cost.roofline import optimizer_step_overhead

    g = chain_graph(2)
    roof = Roofline(flop_rate=1e12, mem_bandwidth=1e9)
    bare = group_phase_table(g, roof, [2], overhead=0.0)
    over = group_phase_table(g, roof, [2], overhead=1.0)
    assert (over[:, 2] == bare[:, 2]).all() and (bare[:, 2] > 0).any()
    assert optimizer_step_overhead("adam", 1e-6) == pytest.approx(STEP_OPS["adam"] * 1e-6)
    sizes = [1 << 20, 1 << 19, 1 << 18]
    fixed, per_byte = fit_fixed_per_byte(sizes, [2e-4 + s * 3e-9 for s in sizes])
    assert fixed == pytest.approx(2e-4) and per_byte == pytest.approx(3e-9)
    assert fit_fixed_per_byte(sizes, [s * 3e-9 - 1e-5 for s in sizes])[0] == 0.0  # never a negative fixed part
    fixed, per_byte = fit_fixed_per_byte(sizes, [1e-3, 1.1e-3, 1.2e-3])  # noise: falls with the bytes
    assert fixed == 0.0 and per_byte > 0


def test_cost_model_sources(tmp_path):
    g = chain_graph(2)
    topo = load_topology({"name": "c", "machines": [{"name": "m", "gpu": "cpu", "count": 1}]})
    dt = device_type(topo, 0)
    assert dt.startswith("cpu-") and dt.endswith("t")
    assert CostModel.for_topology(g, topo, tmp_path).source(0) == "roofline"
    other = "cpu-1t" if dt != "cpu-1t" else "cpu-3t"
    _profile(g, other).save(tmp_path)
    scaled = CostModel.for_topology(g, topo, tmp_path)
    assert scaled.source(0) == f"scaled:{other}"
    _profile(g, dt).save(tmp_path)
    cm = CostModel.for_topology(g, topo, tmp_path)  # a real profile of the type always wins
    assert cm.source(0) == f"profile:{dt}"
    assert cm.group_time(0, "fwd", 0, 4) == pytest.approx(3e-3)
    assert cm.group_time(1, "bwd", 0, 6) == pytest.approx(2 * (1e-3 + 5e-4 * 6))
    assert cm.group_time(0, "fwd", 0, 2.5) == pytest.approx(1e-3 + 5e-4 * 2.5)
    assert cm.step_overhead(0) == pytest.approx(1e-4)
    alone = 2 * (3 * (1e-3 + 5e-4 * 8) + 3e-4) + 1e-4
    assert cm.iteration_time_alone(0) == pytest.approx(alone)
    assert cm.device_speeds() == pytest.approx([8 / alone])
    assert cost_model_speeds(g, topo, cm) == pytest.approx([8 / alone])


def test_scaled_gpu_profile_by_roofline(tmp_path):
    from tag.graph.ir import Affine

    g = chain_graph(2)
    for op in g.ops:  # 10 GFLOP a sample: compute-bound (a 1-FLOP op costs every GPU the same
        op.flops = Affine(0.0, 1e10)  # per-kernel and host seconds: ratio 1)
    topo = load_topology({"name": "g", "machines": [{"name": "a", "gpu": "A100-40GB", "count": 1},
                                                    {"name": "v", "gpu": "V100-SXM2-16GB", "count": 1}],
                          "network": {"bandwidth": "10 Gbit/s"}})
    _profile(g, "V100-SXM2-16GB").save(tmp_path)
    # TF32 matmuls: both rates published (A100 131, V100 14.5 TFLOP/s as FP32). The A100's FP32 (FFMA)
    # rate is not published: the H200's efficiency on its datasheet gives 13.6, below the V100's 14.5
    cm = CostModel.for_topology(g, topo, tmp_path, numerics=Numerics(matmul_tf32=True))
    assert cm.source(1) == "profile:V100-SXM2-16GB" and cm.source(0) == "scaled:V100-SXM2-16GB"
    ratio = cm.table(0)[:, :2, 1:] / cm.table(1)[:, :2, 1:]
    assert np.all(ratio < 1.0)  # the A100 is faster on every group


def test_comm_model_uses_gloo_fit(tmp_path):
    topo = load_topology({"name": "c", "machines": [{"name": "m", "gpu": "cpu", "count": 2,
                                                      "intra_bandwidth": "5 GB/s"}]})
    dt = device_type(topo, 0)
    fits = {"p2p": LinkFit(1e-4, 1e9), "all_reduce": LinkFit(3e-4, 5e8)}
    CommProfile(dt, "gloo", 2, fits).save(tmp_path)
    assert find_comm_profile(tmp_path, dt).fits["p2p"] == fits["p2p"]
    g = chain_graph(2)
    cm = CostModel.for_topology(g, topo, tmp_path)
    assert cm.comm.p2p_time(0, 1, 1e6) == pytest.approx(1e-4 + 1e6 / 1e9)
    assert cm.comm.allreduce_time([0, 1], 1e6) == pytest.approx(3e-4 + 1e6 / 5e8)
    assert fitted_allreduce_time(4, 1e6, fits["all_reduce"]) == pytest.approx(1.5e6 / 5e8 + 3 * 3e-4)
    nominal = CostModel.for_topology(g, topo, tmp_path / "none").comm
    assert nominal.p2p_time(0, 1, 1e6) == pytest.approx(topo.latency(0, 1) + 1e6 / 5e9)
    # a parameter server: the links without reduce/broadcast fits, the fits once measured
    assert cm.comm.ps_time([0, 1], 0, 1e6) == pytest.approx(2 * (1e-4 + 1e6 / 1e9))
    fits |= {"reduce": LinkFit(4e-4, 8e8), "broadcast": LinkFit(2e-4, 2e9)}
    CommProfile(dt, "gloo", 2, fits).save(tmp_path)
    ps = CostModel.for_topology(g, topo, tmp_path).comm.ps_time([0, 1], 0, 1e6)
    assert ps == pytest.approx(4e-4 + 1e6 / 8e8 + 2e-4 + 1e6 / 2e9)
    fits["ps"] = LinkFit(9e-4, 4e8)  # the PS sync measured as one call wins over the pair
    CommProfile(dt, "gloo", 2, fits).save(tmp_path)
    assert CostModel.for_topology(g, topo, tmp_path).comm.ps_time([0, 1], 0, 1e6) == pytest.approx(9e-4 + 1e6 / 4e8)


def test_comm_model_keeps_gloo_allgather_fit(tmp_path):
    topo = load_topology({"name": "c2", "machines": [{"name": n, "gpu": "cpu", "count": 2, "intra_bandwidth": "5 GB/s"}
                                                     for n in ("m0", "m1")],
                           "network": {"bandwidth": "1 GB/s", "latency": "50 us"}})
    dt = device_type(topo, 0)
    fits = {"p2p": LinkFit(1e-4, 1e9), "all_reduce": LinkFit(3e-4, 5e8), "all_gather": LinkFit(2e-4, 4e8)}
    CommProfile(dt, "gloo", 2, fits).save(tmp_path)
    comm = CostModel.for_topology(chain_graph(2), topo, tmp_path).comm
    assert comm.allgather_fit == fits["all_gather"]
    # 2 processes, equal chunks: the measured fit itself; n processes: every one receives all
    # chunks but its own over the ring, n-1 latencies
    assert comm.fitted_allgather_time([1e6, 1e6], [0, 1]) == pytest.approx(2e-4 + 1e6 / 4e8)
    assert fitted_allgather_time([1e6, 2e6, 3e6], fits["all_gather"]) == pytest.approx(5e6 / 4e8 + 2 * 2e-4)
    assert fitted_allgather_time([5.0], fits["all_gather"]) == 0.0
    assert comm.fitted_allgather_time([1e6, 1e6], [0, 2]) is None  # across machines: on the links
    nominal = CostModel.for_topology(chain_graph(2), topo, tmp_path / "none").comm
    assert nominal.allgather_fit is None and nominal.fitted_allgather_time([1e6, 1e6], [0, 1]) is None


def test_device_roofline_is_public():
    from tag.cost import device_roofline

    topo = load_topology("topologies/cluster-16gpu-4m.yaml")
    cm = CostModel.roofline_only(chain_graph(2), topo)
    spec = topo.devices[0].gpu
    assert cm.roofline(0) == device_roofline(cm.device_type(0), spec)
    assert cm.roofline(0).flop_rate == pytest.approx(spec.fp32_flops * 0.7)


def test_baselines_are_valid_plans():
    g = chain_graph(4, positions=2)
    topo = topology([("a", 2, 1e9, 1e-5), ("b", 2, 1e9, 1e-5)], memory=10**9)
    for name in ("dp", "dp-prop", "single", "mp"):
        plan = baseline_plan(name, g, topo)
        validate_plan(plan, g, topo)
    mp = baseline_plan("mp", g, topo)
    assert [gp.devices for gp in mp.groups] == [[0], [1], [2], [3]]  # equal memory: one slice each
    single = baseline_plan("single", g, topo)
    assert {tuple(gp.devices) for gp in single.groups} == {(0,)}


def test_wake_tau_fit_recovers_the_time_constant():
    import math

    from tag.cost.profiler import DEFAULT_WAKE_TAU_S, fit_wake_tau

    for tau in (0.003, 0.01, 0.04):
        ratio = (1 - math.exp(-0.01 / tau)) / (1 - math.exp(-0.05 / tau))
        assert fit_wake_tau(0.01, 0.05, ratio) == pytest.approx(tau, rel=1e-6)
    assert fit_wake_tau(0.01, 0.05, 0.1) == DEFAULT_WAKE_TAU_S  # below short/long: noise
    assert fit_wake_tau(0.01, 0.05, 1.5) == pytest.approx(0.001)  # saturated already at the short gap


def test_profile_wake_roundtrip_merge_and_cost_model(tmp_path):
    g = chain_graph(2)
    topo = load_topology({"name": "c", "machines": [{"name": "m", "gpu": "cpu", "count": 1}]})
    dt = device_type(topo, 0)
    p = _profile(g, dt)
    assert not p.has_wake and p.wake_table([1, 4]).sum() == 0.0
    p.fwd_wake = [[1e-3, 2e-3, 2e-3]] * 2
    p.bwd_wake = [[0.0, 1e-3, 3e-3]] * 2
    p.wake_gap_s, p.wake_tau_s = 0.05, 0.01
    w = p.wake_table([0, 1, 2, 4, 8])
    assert w[0, 0] == pytest.approx([0.0, 1e-3, 1e-3 + 1e-3 / 3, 2e-3, 2e-3])
    assert w[1, 1] == pytest.approx([0.0, 0.0, 1e-3 / 3, 1e-3, 3e-3])
    p.save(tmp_path)
    q = find_profile(tmp_path, dt, g.signature())
    assert q.has_wake and q.fwd_wake == p.fwd_wake and (q.wake_gap_s, q.wake_tau_s) == (0.05, 0.01)
    table, gap, tau = CostModel.for_topology(g, topo, tmp_path).wake_penalty(0)
    assert (gap, tau) == (0.05, 0.01) and table[1, 1, 8] == pytest.approx(3e-3)
    # a new measurement at other batches without wake data: the merged profile drops it (it would
    # not cover every batch) rather than mix batches with and without
    Profile(dt, g.model, g.signature(), 8, "adam", [2], [[9e-3]] * 2, [[9e-3]] * 2, [1e-4] * 2).save(tmp_path)
    m = find_profile(tmp_path, dt, g.signature())
    assert m.batches == [1, 2, 4, 8] and not m.has_wake
    assert CostModel.for_topology(g, topo, tmp_path).wake_penalty(0) is None
    bad = p.to_dict()
    bad["bwd_wake"] = [[0.0]]
    with pytest.raises(ProfileError, match="bwd_wake: expected 2 rows of 3 times"):
        Profile.from_dict(bad)
    bad = p.to_dict()
    bad["wake_tau_s"] = 0.0
    with pytest.raises(ProfileError, match="wake_gap_s, wake_tau_s"):
        Profile.from_dict(bad)
