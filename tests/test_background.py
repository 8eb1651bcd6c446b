"""Background traffic on NICs and links (tag.topology.background): parsed and validated from the
topology YAML in one line, round-tripped, and the simulator's cross-machine messages costed
against what it leaves."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from tag.cost.model import CostModel
from tag.errors import TopologyError
from tag.parallel.layout import layout_plan, parse_layout
from tag.sim import Simulator
from tag.topology import load_topology
from tag.topology.background import Background, Profile, expected_topology, path_profile

BASE = {"name": "two", "network": {"bandwidth": "100 Gbit/s", "latency": "10 us"},
        "machines": [{"name": "a", "gpu": "V100-SXM2-16GB", "count": 2, "intra_bandwidth": "150 GB/s"},
                     {"name": "b", "gpu": "V100-SXM2-16GB", "count": 2, "intra_bandwidth": "150 GB/s"}]}


def _topo(tmp_path, machine_bg=None, link_bg=None, name="t.yaml"):
    d = copy.deepcopy(BASE)
    if machine_bg is not None:
        d["machines"][0]["background"] = machine_bg
    if link_bg is not None:
        d["network"]["links"] = [{"between": ["a", "b"], "background": link_bg}]
    path = tmp_path / name
    path.write_text(yaml.safe_dump(d))
    return load_topology(path)


def test_the_three_forms_parse_and_round_trip(tmp_path):
    (tmp_path / "tr.csv").write_text("time_s,busy\n0,0\n0.01,0.8\n0.03,0\n")
    const = _topo(tmp_path, 0.25)
    assert const.background == {"a": Background(busy=0.25)}
    per = _topo(tmp_path, {"busy": 0.6, "period": "2 s", "on": "0.5 s", "start": "1 s"})
    assert per.background["a"] == Background(busy=0.6, period_s=2.0, on_s=0.5, start_s=1.0)
    tr = _topo(tmp_path, None, {"trace": "tr.csv"})
    assert tr.background[frozenset("ab")].trace == ((0.0, 0.0), (0.01, 0.8), (0.03, 0.0))
    # the link keeps the network's bandwidth; the background changes the topology's identity
    assert tr.machine_bandwidth(0, 1) == _topo(tmp_path).machine_bandwidth(0, 1) == 12.5e9
    assert len({t.signature() for t in (const, per, tr, _topo(tmp_path))}) == 4
    for t in (const, per, tr):  # (a trace is written inline)
        back = load_topology(t.to_dict())
        assert back.background == t.background and back.signature() == t.signature()
    # a topology without background keeps its signature: no field written
    assert "background" not in str(_topo(tmp_path).to_dict())


@pytest.mark.parametrize("machine_bg, link_bg, message", [
    (1.0, None, r"machines\[0\]\.background: .*busy fraction 0 <= busy < 1 .*got 1\.0"),
    (-0.1, None, r"machines\[0\]\.background: .*got -0\.1"),
    ({"busy": 0.5, "period": "0 s", "on": "0 s"}, None, r"machines\[0\]\.background: period: expected a positive time"),
    ({"busy": 0.5, "period": "1 s", "on": "2 s"}, None, r"machines\[0\]\.background: on: expected 0 < on <= period"),
    ({"busy": 0.5, "on": "2 s"}, None, r"machines\[0\]\.background: on/start need a period"),
    ({"busy": 0.5, "every": "2 s"}, None, r"machines\[0\]\.background: unknown key 'every'"),
    ("lots", None, r"machines\[0\]\.background: expected a busy fraction 0\.\.1 or a mapping"),
    (None, {"trace": [[0, 0.1], [0, 0.2]]}, r"network\.links\[0\]\.background: trace: expected increasing times"),
    (None, {"trace": "missing.csv"}, r"network\.links\[0\]\.background\.trace: cannot read .*missing\.csv"),
    (None, {"trace": "bad.csv"}, r"network\.links\[0\]\.background\.trace: bad\.csv line 3: expected time_s,busy"),
])
def test_bad_background_is_one_line(tmp_path, machine_bg, link_bg, message):
    (tmp_path / "bad.csv").write_text("time_s,busy\n0,0.1\n1;0.5\n")
    with pytest.raises(TopologyError, match=message) as err:
        _topo(tmp_path, machine_bg, link_bg)
    assert "\n" not in str(err.value) and str(err.value).startswith(str(tmp_path / "t.yaml"))


def test_a_profile_stretches_a_transfer_over_what_is_left():
    # constant: half the bandwidth left takes twice the time
    assert Profile((Background(busy=0.5),)).finish(3.0, 1.0) == pytest.approx(5.0)
    # periodic, 90% busy for the first 1 s of every 2 s: 1 nominal second from 0 goes 0.1 in the
    # first second, 0.9 at full speed by 1.9 s
    per = Profile((Background(busy=0.9, period_s=2.0, on_s=1.0),))
    assert per.finish(0.0, 1.0) == pytest.approx(1.9)
    assert per.finish(1.0, 1.0) == pytest.approx(2.0)  # free from 1 s to 2 s
    assert per.finish(1.5, 1.0) == pytest.approx(3.4)  # 0.5 free, 1 s at 0.1, 0.4 free
    assert per.mean() == pytest.approx(0.55)
    # the least of two parts at every time
    both = Profile((Background(busy=0.5), Background(trace=((1.0, 0.75),))))
    assert both.finish(0.0, 1.0) == pytest.approx(1.0 + 0.5 / 0.25)
    assert both.mean(4.0) == pytest.approx((0.5 + 3 * 0.25) / 4)


def test_the_expected_topology_scales_the_path_by_its_mean(tmp_path):
    t = _topo(tmp_path, {"busy": 0.8, "period": "1 s", "on": "0.5 s"})
    assert path_profile(t, 0, 1).mean() == pytest.approx(0.6)
    e = expected_topology(t)
    assert not e.background and e.machine_bandwidth(0, 1) == pytest.approx(0.6 * t.machine_bandwidth(0, 1))
    assert path_profile(_topo(tmp_path), 0, 1) is None and expected_topology(_topo(tmp_path)).links == {}


@pytest.fixture(scope="module")
def gpt2(captured):
    return captured("gpt2:n_layer=4,n_embd=256,n_head=4,vocab=1024,seq=128", batch=16, groups=8).graph


def test_the_simulator_costs_cross_machine_messages_against_what_is_left(gpt2, tmp_path):
    """dp=2,pp=2 over the two machines: with half of machine a's NIC taken every message between
    the machines takes twice its nominal time (intra-machine ones unchanged); the iteration is
    slower, and the same with no background as the topology without the field; a background
    busy only long after the iteration changes nothing."""
    free = _topo(tmp_path)
    costs = CostModel.for_topology(gpt2, free)

    def run(topo):
        sim = Simulator(gpt2, topo, CostModel(gpt2, topo, costs._dev, costs.comm))
        plan = layout_plan(gpt2, topo, parse_layout("dp=2,pp=2,micro=4"), sim.costs)
        return sim.run(plan.groups, pipeline=plan.pipeline, trace=True)

    def sends(res, cross):  # seconds of the messages between machines (devices 0-1 on a, 2-3 on b), or within
        out = []
        for e in res.events:
            m = re.search(r" d(\d+)->d(\d+) ", e.name) if e.cat == "transfer" else None
            if m and ((int(m[1]) < 2) != (int(m[2]) < 2)) == cross:
                out.append(e.end - e.start)
        return out

    r0, r1 = run(free), run(_topo(tmp_path, 0.5, name="half.yaml"))
    late = run(_topo(tmp_path, {"trace": [[1000.0, 0.9]]}, name="late.yaml"))
    assert late.iteration_time_s == r0.iteration_time_s
    assert r1.iteration_time_s > r0.iteration_time_s
    c0, c1 = sends(r0, True), sends(r1, True)
    assert c0 and len(c0) == len(c1) and all(y == pytest.approx(2 * x) for x, y in zip(sorted(c0), sorted(c1)))
    assert sorted(sends(r0, False)) == pytest.approx(sorted(sends(r1, False)))


def test_gradient_collectives_across_machines_are_slowed(gpt2, tmp_path):
    """With half of machine a's NIC taken every gradient all-reduce over both machines takes twice
    its nominal time (a chain of buckets, each after the last), one within a machine the same:
    dp=4 syncs across the machines; dp=2,pp=2 each stage within its machine, the tied embedding
    over both stages' replicas, across."""
    free, half = _topo(tmp_path), _topo(tmp_path, 0.5, name="half.yaml")
    costs = CostModel.for_topology(gpt2, free)

    def syncs(topo, layout):  # (crossing machines, seconds) of device 0's all-reduces, and the run
        sim = Simulator(gpt2, topo, CostModel(gpt2, topo, costs._dev, costs.comm))
        plan = layout_plan(gpt2, topo, parse_layout(layout), sim.costs)
        res = sim.run(plan.groups, pipeline=plan.pipeline, trace=True)
        devs: dict = {}
        for e in res.events:
            if e.cat == "allreduce":
                devs.setdefault((e.name, e.start), set()).add(e.device)
        return sorted((max(d) >= 2, e.end - e.start) for e in res.events if e.cat == "allreduce" and e.device == 0
                      for d in [devs[(e.name, e.start)]]), res

    for layout, kinds in (("dp=4", {True}), ("dp=2,pp=2", {False, True})):
        (c0, r0), (c1, r1) = syncs(free, layout), syncs(half, layout)
        assert {x for x, _ in c0} == kinds and [x for x, _ in c0] == [x for x, _ in c1], c0
        for (cross, a), (_, b) in zip(c0, c1):
            assert b == pytest.approx(2 * a if cross else a)
        assert r1.iteration_time_s > r0.iteration_time_s


def test_plan_for_the_expected_or_no_background(tmp_path, capsys, gpt2):
    """tag plan --background expected plans on the mean share, none on the free network, stated (the
    default) on the background at every iteration's start: each plan's predicted time is its
    simulation there; the plan is stamped for the topology file either way (tag simulate and tag
    execute take it)."""
    import json

    from tag.cli import main
    from tag.plan import Plan
    from tag.topology.background import planning_topology

    # machine a's NIC free at the iteration's start, 90% taken 1 s of every 2 from 1 s on: a mean
    # share of 0.7 over the profile's 3 s
    busy = _topo(tmp_path, {"busy": 0.9, "period": "2 s", "on": "1 s", "start": "1 s"}, name="busy.yaml")
    assert planning_topology(busy, "stated") is busy
    assert planning_topology(busy, "expected").machine_bandwidth(0, 1) == pytest.approx(
        0.7 * busy.machine_bandwidth(0, 1))
    assert not planning_topology(busy, "none").background
    with pytest.raises(TopologyError, match="^background condition: expected one of stated, expected, none, got 'x'$"):
        planning_topology(busy, "x")
    spec = "gpt2:n_layer=4,n_embd=256,n_head=4,vocab=1024,seq=128"
    graph = gpt2  # (spec at batch 16 in 8 groups)
    topos = {c: planning_topology(busy, c) for c in ("stated", "expected", "none")}
    sims = {c: Simulator(graph, t, CostModel.for_topology(graph, t)) for c, t in topos.items()}
    crossing = []
    for cond in ("expected", "none"):  # (stated: the default, as before the option)
        out = tmp_path / f"{cond}.json"
        assert main(["plan", "--model", spec, "--batch", "16", "--groups", "8", "--topology", str(tmp_path / "busy.yaml"),
                     "--prior", "uniform", "--budget", "16", "--pipelines", "off", "--background", cond,
                     "--out", str(out), "--json"]) == 0
        predicted = json.loads(capsys.readouterr().out)["predicted_iteration_time_s"]
        p = Plan.load(out)
        assert p.topology_signature == busy.signature() and p.meta["background"] == cond
        t = {c: sim.run(p.groups, pipeline=p.pipeline).iteration_time_s for c, sim in sims.items()}
        assert t[cond] == pytest.approx(predicted, rel=1e-9)  # costed for its condition
        if {d // 2 for g in p.groups for d in g.devices} == {0, 1}:
            crossing.append(cond)
            assert t["expected"] > t["stated"] == pytest.approx(t["none"])  # (the iteration ends before 1 s)
    assert crossing, crossing  # (a plan over both machines tells the conditions apart)
