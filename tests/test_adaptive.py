"""Ada-Grouper's adaptive kFkB: the choice rule (tag.parallel.adaptive) and its replay in the
simulator over a shared network's background (tag.sim.adaptive)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import yaml

from tag.cost.model import CostModel
from tag.parallel.adaptive import HostSeconds, choose_k, replay_time
from tag.parallel.layout import layout_plan, parse_layout
from tag.sim import Simulator
from tag.sim.adaptive import fitting_ks, host_seconds, measure, replay
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


def test_a_host_bound_stage_keeps_1f1b():
    """Stages whose host launches dominate (2 / 1 s of launches against 0.3 / 0.4 s of kernels a
    micro-batch, 1.5 s a crossing): the host issues M (h_f + h_b) per stage whatever the order and
    1F1B's messages cross meanwhile, so no block pays and the rule keeps k = 1; the same stages
    without the host pick a block. A zero host replays as none; host seconds are checked."""
    f, b, x = 0.3, 0.4, 1.5
    slow = HostSeconds(2.0, 1.0, 1.7, 0.6)
    assert choose_k(4, 8, [1, 2, 4, 8], f, b, x).k > 1
    c = choose_k(4, 8, [1, 2, 4, 8], f, b, x, host=slow)
    assert c.k == 1 and min(c.predicted_s[k] for k in (2, 4, 8)) > c.predicted_s[1]
    assert c.predicted_s[1] >= 8 * (slow.fwd_s + slow.bwd_s)  # the host's own issue time bounds it
    for k in (1, 2, 8):
        assert replay_time(4, 8, k, f, b, x, host=HostSeconds(0.0, 0.0)) == replay_time(4, 8, k, f, b, x)
        assert replay_time(4, 8, k, [f] * 4, [b] * 4, x, host=[slow] * 4) == c.predicted_s[k]
    # a stage of its own: one slow host among fast ones bounds the iteration as well
    assert replay_time(4, 8, 1, f, b, x, host=[slow, *[HostSeconds(0.0, 0.0)] * 3]) >= 8 * 3.0
    with pytest.raises(ValueError, match="HostSeconds.bwd_lag_s"):
        HostSeconds(1.0, 1.0, 0.0, -1.0)
    with pytest.raises(ValueError, match=r"replay_time: fwd_s: expected one value per stage \(4\), got 3"):
        replay_time(4, 8, 1, [f] * 3, b, x)


def _cloud_t4(graph, host_launch: str | None):
    """cloud-t4 (4 VMs of 2 T4s, 10 Gbit/s) with ``host_launch`` per machine (None: the GPU
    rule's default), its cost model and the ``dp=2,pp=4,micro=8`` layout plan of ``graph``."""
    raw = yaml.safe_load(open("topologies/cloud-t4.yaml"))
    for m in raw["machines"]:
        if host_launch is not None:
            m["host_launch"] = host_launch
    topo = load_topology(raw)
    costs = CostModel.for_topology(graph, topo)
    return raw, topo, costs, layout_plan(graph, topo, parse_layout("dp=2,pp=4,micro=8"), costs)


@pytest.mark.parametrize("host_launch", ["55 us", "10 us"])
def test_the_rule_picks_what_the_simulator_finds_fastest(gpt2, host_launch):
    """The 4 x 256 GPT-2 at dp=2,pp=4,micro=8 on cloud-t4, free network. At 55 us a launch
    (host-bound: 2.3 ms of forward launches against 0.3 ms of kernels a stage) the simulator runs
    kFkB's blocks 17-21% slower than 1F1B (29.55 against 34.65-35.72 ms, 2026-11-29) and the rule,
    given the stages' host seconds, keeps k = 1 (without them it picked k = 8); at 10 us the
    network bounds it (k = 8 26.25 against 27.06 ms) and the rule still picks a block. Either way
    the chosen k runs within 1% of the fastest fitting k in the simulator."""
    _, topo, costs, plan = _cloud_t4(gpt2, host_launch)
    sim = Simulator(gpt2, topo, costs)
    S = len(plan.pipeline.stages)
    f, b, host = host_seconds(sim, plan)
    _, _, x = measure(plan, sim.run(plan.groups, pipeline=plan.pipeline, trace=True))
    fits = fitting_ks(sim, plan)
    k = choose_k(S, plan.pipeline.micro_batches, fits, f, b, x, host=host).k
    assert len(f) == len(b) == len(host) == S
    t = {j: sim.run(plan.groups, pipeline=replace(plan.pipeline, schedule="kfkb", k=j)).iteration_time_s for j in fits}
    assert t[k] <= 1.01 * min(t.values())
    if host_launch == "55 us":
        assert all(h.fwd_s > 4 * fs for h, fs in zip(host, f)) and k == 1
        assert min(t[j] for j in fits if j > 1) > 1.1 * t[1]
    else:
        assert k > 1 and t[k] < t[1]


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
    launches a kernel in 10 us, so the network bounds the stages: at the default 55 us they are the
    host's (11.7 ms of launches against 2.2 ms of kernels a one-sample micro-batch), kFkB's blocks
    run 17-21% slower than 1F1B and the rule, given the hosts' seconds, keeps k = 1 throughout
    (562.7 ms both, 2026-11-29; test_the_rule_picks_what_the_simulator_finds_fastest)."""
    raw, free, costs, plan = _cloud_t4(gpt2, "10 us")  # a host that keeps ahead of these small kernels
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
