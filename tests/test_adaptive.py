"""Ada-Grouper's adaptive kFkB: the choice rule (tag.parallel.adaptive) and its replay in the
simulator over a shared network's background (tag.sim.adaptive)."""

from __future__ import annotations

import copy

import pytest
import yaml

from tag.cost.model import CostModel
from tag.parallel.adaptive import choose_k, replay_time
from tag.parallel.layout import layout_plan, parse_layout
from tag.sim import Simulator
from tag.sim.adaptive import replay
from tag.topology import load_topology


def test_replay_time_is_the_textbook_pipeline_without_transfers():
    """No transfer time: every kFkB block size takes (M + S - 1)(f + b), 1F1B's makespan."""
    for k in (1, 2, 4, 8):
        assert replay_time(4, 8, k, 1.0, 2.0, 0.0) == pytest.approx(11 * 3.0)
    # a transfer on every boundary: 1F1B pays it per micro-batch, GPipe once per direction and stage
    assert replay_time(4, 8, 1, 1.0, 2.0, 1.0) > replay_time(4, 8, 8, 1.0, 2.0, 1.0)


def test_the_rule_grows_k_with_the_transfer_time_within_what_fits():
    """Free network: k = 1 (1F1B: no larger block pays, and the smallest within 1% wins); k grows
    with the boundary's transfer seconds; never outside ``allowed`` (what fits in memory)."""
    ks = [choose_k(4, 8, [1, 2, 4, 8], 1.0, 2.0, x).k for x in (0.0, 0.2, 0.5, 1.0)]
    assert ks[0] == 1 and ks == sorted(ks) and ks[-1] > 1
    assert choose_k(4, 8, [1, 2], 1.0, 2.0, 1.0).k == 2
    c = choose_k(4, 8, [1, 2, 4, 8], 1.0, 2.0, 1.0)
    assert set(c.predicted_s) == {1, 2, 4, 8} and c.predicted_s[c.k] <= min(c.predicted_s.values()) * 1.01


@pytest.fixture(scope="module")
def gpt2(captured):
    return captured("gpt2:n_layer=4,n_embd=256,n_head=4,vocab=1024,seq=128", batch=16, groups=8).graph


def test_replay_over_a_preempted_network(gpt2):
    """cloud-t4 (4 VMs of 2 T4s, 10 Gbit/s), dp=2,pp=4,micro=8, every VM's NIC 90% busy in the
    second half of each period of 4 free iterations: iterations run back to back on the
    background's clock (a preempted one is slower), the adaptive run changes k and takes within 1%
    of fixed 1F1B in all (510.3 against 517.5 ms, 2026-11-29; the gradient all-reduces over both
    VMs, slowed by the background as the pipeline's messages, are outside the rule;
    evaluation/adaptive_kfkb.py measures the claim). Each VM's host
    launches a kernel in 10 us: at the default 55 us this model's stages are the host's (11.7 ms of
    launches against 2.2 ms of kernels a one-sample micro-batch), the host runs ahead of the
    in-order streams and kFkB's blocks run 17-21% slower than 1F1B on the free network, which the
    rule, reading stage seconds, does not foresee (adaptive 718 ms against fixed 563 ms in all,
    2026-11-29)."""
    raw = yaml.safe_load(open("topologies/cloud-t4.yaml"))
    for m in raw["machines"]:  # a host that keeps ahead of these small kernels (below)
        m["host_launch"] = "10 us"
    free = load_topology(raw)
    costs = CostModel.for_topology(gpt2, free)
    plan = layout_plan(gpt2, free, parse_layout("dp=2,pp=4,micro=8"), costs)
    T = Simulator(gpt2, free, costs).run(plan.groups, pipeline=plan.pipeline).iteration_time_s
    busy = copy.deepcopy(raw)
    for m in busy["machines"]:
        m["background"] = {"busy": 0.9, "period": f"{8 * T} s", "on": f"{4 * T} s", "start": f"{4 * T} s"}
    topo = load_topology(busy)
    sim = Simulator(gpt2, topo, CostModel(gpt2, topo, costs._dev, costs.comm))
    fixed = replay(sim, plan, 12, adaptive=False)
    ada = replay(sim, plan, 12, adaptive=True)
    assert [i.k for i in fixed] == [1] * 12 and fixed[0].time_s == pytest.approx(T)
    assert all(b.start_s == pytest.approx(a.start_s + a.time_s) for a, b in zip(ada, ada[1:]))
    assert max(i.time_s for i in fixed) > 1.2 * T  # the preempted iterations
    assert len({i.k for i in ada}) > 1
    assert sum(i.time_s for i in ada) <= 1.01 * sum(i.time_s for i in fixed)
