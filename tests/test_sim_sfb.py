"""Simulator: Sufficient Factor Broadcasting (``GroupPlan.sfb``) costed as the executor runs it.

After the group's backward: one all-gather per factor over the replicas, then every replica
recomputes the SFB gradients on the global batch, then the remaining gradients are synced.
"""

from __future__ import annotations

import pytest

from tag.compress import find_candidates
from tag.cost.baselines import data_parallel
from tag.cost.model import CostModel
from tag.cost.roofline import Roofline, group_phase_table, op_overhead
from tag.errors import PlanError
from tag.graph import capture
from tag.parallel import apply_sfb
from tag.plan import GroupPlan, new_plan
from tag.sim import Simulator, simulate
from tag.topology import load_topology
from tag.workloads import load_workload

NET = 1e8  # bytes/s between the two machines
LAT = 1e-5  # s
FLOPS, MEMBW = 1e12, 1e12  # datasheet; the roofline reaches 0.7 / 0.8 of them

ONE_LINEAR = '''
import torch
from torch import nn


class One(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(512, 256, bias=False)

    def forward(self, x):
        return (self.fc(x) ** 2).mean()


def make(batch_size=8):
    torch.manual_seed(0)
    return One(), (torch.randn(batch_size, 512),)
'''


@pytest.fixture(scope="module")
def one_linear(tmp_path_factory):
    path = tmp_path_factory.mktemp("wl") / "one_linear.py"
    path.write_text(ONE_LINEAR)
    return capture(load_workload(f"{path}:make", batch=8), num_groups=1).graph


def two_boxes():
    """Two machines with one 1 TFLOP/s, 1 TB/s device each, NET bytes/s between them."""
    return load_topology({
        "name": "two-boxes",
        "machines": [{"name": n, "gpu": {"name": "G", "tflops": FLOPS / 1e12, "memory": "16 GB",
                                         "memory_bandwidth": MEMBW}, "count": 1} for n in ("a", "b")],
        "network": {"bandwidth": NET, "latency": LAT},
    })


def test_one_linear_layer_by_hand(one_linear):
    graph, topo = one_linear, two_boxes()
    costs = CostModel.roofline_only(graph, topo)
    sim = Simulator(graph, topo, costs)
    (cand,) = find_candidates(graph)  # dW = X^T dY of fc.weight (no bias)
    assert cand.op_name == "mm_1" and {f.name for f in cand.factors} == {"inputs_0", "mul_1"}
    dp = GroupPlan([0, 1], [0.5, 0.5], "allreduce")
    sfb = GroupPlan([0, 1], [0.5, 0.5], "allreduce", sfb=["mm_1"])
    plain, r = sim.run([dp], trace=True), sim.run([sfb], trace=True)

    b, B = 4, 8
    bwd_end = float(costs.table(0)[0, 0, b] + costs.table(0)[0, 1, b])
    assert r.group_finish_s == [pytest.approx(bwd_end)]
    # ring all-gather of two devices on two machines: each link carries the other's rows once
    gather_x = b * 512 * 4 / NET + LAT  # inputs_0: 512 floats per sample
    gather_dy = b * 256 * 4 / NET + LAT  # mul_1 (dY): 256 floats per sample
    # the op's roofline share of the group's backward in the cost model (tag/sim/sfb.py): the
    # device's rule (here the GPU rule, datasheet-derived) apportioned by the roofline
    roof, over = Roofline(FLOPS * 0.7, MEMBW * 0.8), op_overhead(topo.devices[0].gpu)
    rule = group_phase_table(graph, roof, [b, B], over)[0, 1]  # roofline seconds of the backward

    def op(n, j):  # (of the backward's device seconds: the host issues the recompute's launches apart)
        mine = roof.time(2 * 512 * 256 * n, 512 * 256 * 4 + n * (512 + 256 + 256) * 4) + over
        return float(costs.host_parts(0).device[0, 1, n]) * mine / rule[j]

    recompute = op(B, 1) - op(b, 0)
    assert recompute > 0
    opt = float(costs.table(0)[0, 2, b]) + costs.step_overhead(0)
    assert r.iteration_time_s == pytest.approx(bwd_end + gather_x + gather_dy + recompute + opt, rel=1e-9)
    assert r.comm_time_s == pytest.approx([gather_x + gather_dy] * 2)
    cats = sorted({e.cat for e in r.events})
    assert "allreduce" not in cats and "allgather" in cats and "sfb" in cats
    assert [e.cat for e in r.events if e.device == 0 and e.stream == "comm"] == ["allgather", "allgather"]
    assert r.compute_time_s == pytest.approx([bwd_end + recompute + opt] * 2)
    assert r.critical_path[-4:] == ["allgather g0 mul_1 (8192 B)", "allgather g0 inputs_0 (16384 B)",
                                    "sfb g0 @d0", "opt @d0"]
    # without SFB: the gradient is all-reduced (2 devices: S/bw + 2 latencies) instead
    ar = 524288 / NET + 2 * LAT
    assert plain.iteration_time_s == pytest.approx(bwd_end + ar + opt, rel=1e-9)
    # communication buffers: the gathered factors (global batch) instead of the gradient
    assert [p - q for p, q in zip(plain.peak_memory_bytes, r.peak_memory_bytes)] == \
        pytest.approx([524288 - B * (512 + 256) * 4] * 2)


def test_cpu_allgathers_use_the_measured_gloo_fit(one_linear, tmp_path):
    """SFB all-gathers between CPU devices of one machine: the measured gloo all-gather fit
    (ring generalisation), not the point-to-point links."""
    from tag.cost.comm import CommProfile, LinkFit
    from tag.cost.model import device_type

    topo = load_topology({"name": "cpu2", "machines": [{"name": "m", "gpu": "cpu", "count": 2,
                                                         "intra_bandwidth": "5 GB/s"}]})
    fit = LinkFit(3e-4, 7.5e8)
    CommProfile(device_type(topo, 0), "gloo", 2, {"p2p": LinkFit(1e-4, 4e9), "all_gather": fit}).save(tmp_path)
    sim = Simulator(one_linear, topo, CostModel.for_topology(one_linear, topo, tmp_path))
    (cand,) = find_candidates(one_linear)
    gd = sim.group_data(0, GroupPlan([0, 1], [0.5, 0.5], "allreduce", sfb=[cand.op_name]))
    b = 4  # rows per replica; every replica receives the other's rows
    want = sorted([fit.alpha + b * 512 * 4 / fit.beta, fit.alpha + b * 256 * 4 / fit.beta])
    assert sorted(gd.sfb.gather_times) == pytest.approx(want, rel=1e-12)


@pytest.fixture(scope="module")
def mlp(captured):
    def get(batch):
        return captured("mlp:hidden=1024,layers=2,in_dim=256,classes=100", batch=batch, groups=4).graph

    return get


def _boxes(inter: str):
    machines = [{"name": f"n{k}", "gpu": "V100-SXM2-16GB", "count": 2, "intra_bandwidth": "150 GB/s"}
                for k in range(2)]
    return load_topology({"name": "2x2-v100", "machines": machines,
                          "network": {"bandwidth": inter, "latency": "20 us"}})


def test_sfb_pays_on_slow_links_small_batch(mlp):
    graph, topo = mlp(4 * 2), _boxes("1 Gbit/s")
    plan = data_parallel(graph, topo)
    with_sfb = apply_sfb(graph, topo, plan)
    assert any(gp.sfb for gp in with_sfb.groups)
    t_dp = simulate(graph, topo, plan).iteration_time_s
    t_sfb = simulate(graph, topo, with_sfb).iteration_time_s
    assert t_sfb < 0.5 * t_dp


def test_no_sfb_on_fast_links_large_batch(mlp):
    graph, topo = mlp(8 * 256), load_topology("homogeneous-8xa100")
    plan = data_parallel(graph, topo)
    with_sfb = apply_sfb(graph, topo, plan)
    assert not any(gp.sfb for gp in with_sfb.groups)
    assert simulate(graph, topo, with_sfb).iteration_time_s == simulate(graph, topo, plan).iteration_time_s


def test_sfb_on_a_non_candidate_is_a_plan_error(one_linear):
    graph, topo = one_linear, two_boxes()
    plan = new_plan(graph, topo, [GroupPlan([0, 1], [0.5, 0.5], "allreduce", sfb=["mm"])])  # the forward mm
    with pytest.raises(PlanError, match=r"^plan: groups\[0\]\.sfb: op 'mm' is not an SFB candidate[^\n]*$"):
        simulate(graph, topo, plan)
    one = new_plan(graph, topo, [GroupPlan([0], [1.0], "allreduce", sfb=["mm_1"])])
    with pytest.raises(PlanError, match=r"groups\[0\]\.sfb: SFB needs"):
        simulate(graph, topo, one)
