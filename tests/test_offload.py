"""Optimizer offload (ZeRO-Offload, ``GroupPlan.offload``): the topology's host fields, the layout
key and plan field, the simulator's host step, memory and host memory."""

from __future__ import annotations

import dataclasses

import pytest

from tag.cost.model import CostModel
from tag.errors import PlanError, TopologyError
from tag.parallel import validate_plan
from tag.parallel.layout import Layout, layout_plan, parse_layout
from tag.plan import Plan
from tag.sim import Simulator
from tag.topology import load_topology
from tag.topology.host import HOST_LINK, PCIE3_X16, PCIE4_X16

GPT = "gpt2:n_layer=4,n_embd=256,n_head=4,seq=64"
BOX = {"name": "a10x4", "machines": [{"name": "box", "gpu": "A10", "count": 4, "intra_bandwidth": "25 GB/s",
                                      "host_memory": "256 GB", "host_bandwidth": "25 GB/s"}]}


@pytest.fixture(scope="module")
def gpt(captured):
    return captured(GPT, batch=16, groups=8).graph


def _box(**fields):
    return load_topology({**BOX, "machines": [{**BOX["machines"][0], **fields}]})


def test_topology_host_fields_defaults_and_round_trip():
    t = _box()
    m = t.machines[0]
    assert (m.host_memory, m.host_link, m.host_memory_bw) == (256e9, 25e9, 100e9)
    assert load_topology(t.to_dict()) == t
    v100 = load_topology("homogeneous-2x4-v100").machines[0]  # 4 x V100-SXM2-16GB, nothing stated
    assert v100.host_memory == 2 * 4 * v100.gpu.memory_bytes
    assert v100.host_link == 2 * PCIE3_X16 and HOST_LINK["A10"] == PCIE4_X16
    assert "host_memory" not in load_topology("homogeneous-2x4-v100").to_dict()["machines"][0]  # (signatures kept)


@pytest.mark.parametrize("field, value, message", [
    ("host_memory", "-3 GB", r"machines\[0\]\.host_memory: expected a positive size"),
    ("host_memory", 0, r"machines\[0\]\.host_memory: expected a positive size"),
    ("host_bandwidth", "fast", r"machines\[0\]\.host_bandwidth: expected a bandwidth"),
    ("host_memory_bandwidth", "0 GB/s", r"machines\[0\]\.host_memory_bandwidth: expected a positive bandwidth"),
    ("host_memry", "3 GB", r"machines\[0\]\.host_memry: unknown field \(did you mean 'host_memory'\?\)"),
])
def test_topology_host_fields_refused_in_one_line(field, value, message):
    with pytest.raises(TopologyError, match=message) as e:
        _box(**{field: value})
    assert "\n" not in str(e.value)


def test_layout_and_plan_field(gpt):
    t = _box()
    assert parse_layout("dp=4,zero=3,offload=optimizer") == Layout(dp=4, zero=3, offload="optimizer")
    for text, message in [("dp=4,offload=optimizer", r"offload: offload=optimizer offloads sharded state"),
                          ("dp=4,zero=3,offload=params", r"offload: expected one of \['optimizer'\], got 'params'")]:
        with pytest.raises(PlanError, match="^layout: " + message):
            parse_layout(text)
    costs = CostModel.for_topology(gpt, t)
    plan = layout_plan(gpt, t, parse_layout("dp=4,zero=2,offload=optimizer"), costs)
    assert {(g.sync, g.offload) for g in plan.groups} == {("zero2", "optimizer")}
    assert parse_layout(plan.meta["layout"]).offload == "optimizer"
    back = Plan.from_dict(plan.to_dict())
    validate_plan(back, gpt, t)
    assert back.groups == plan.groups
    t1 = _box(count=1)
    one = layout_plan(gpt, t1, parse_layout("dp=1,zero=3,offload=optimizer"), costs)  # one GPU, state on the host
    validate_plan(one, gpt, t1)
    assert {(g.sync, g.offload, len(g.devices)) for g in one.groups} == {("zero3", "optimizer", 1)}
    assert "offload" not in layout_plan(gpt, t, parse_layout("dp=4,zero=3"), costs).to_dict()["groups"][0]
    for sync, value, message in [("allreduce", "optimizer", r"offload: only with sharded data parallelism"),
                                 ("zero3", "params", r"offload: expected one of \['optimizer'\] or null")]:
        bad = dataclasses.replace(plan, groups=[dataclasses.replace(plan.groups[0], sync=sync, offload=value),
                                                *plan.groups[1:]])
        with pytest.raises(PlanError, match=r"^plan: groups\[0\]\." + message):
            validate_plan(bad, gpt, t)


def test_simulated_step_memory_and_host(gpt):
    """The offloaded step is the gradient and parameter shards over the shared host link plus the
    optimizer's bytes over the host CPU's memory; the device holds no optimizer state, the host
    ``(2P + O) / S`` per device; a host too small is out of memory, named in the report."""
    t = _box()
    costs = CostModel.for_topology(gpt, t)
    sim = Simulator(gpt, t, costs)
    plain, off = (layout_plan(gpt, t, Layout(dp=4, zero=3, offload=o), costs) for o in ("", "optimizer"))
    p = float(sum(q.nbytes for q in gpt.params))
    o = float(sum(q.opt_state_bytes for q in gpt.params))
    u = sum(op.bytes_read.fixed + op.bytes_written.fixed for op in gpt.ops if op.phase == "opt")
    step = sum(sim.group_data(g, off.groups[g]).layout.dur[2, g, 0] for g in range(gpt.num_groups))
    assert step == pytest.approx(4 * (2 * p / 4 / 25e9 + u / 4 / 100e9))  # 4 GPUs share the link and the CPU
    r0, r1 = sim.run(plain.groups), sim.run(off.groups)
    assert r0.peak_memory_bytes[0] - r1.peak_memory_bytes[0] == pytest.approx((o + p) / 4)  # moments, gradient
    assert r1.host_memory_bytes == [pytest.approx(2 * p + o)] and not r1.oom and r0.host_memory_bytes == []
    assert r1.iteration_time_s > r0.iteration_time_s
    small = _box(host_memory=f"{int((2 * p + o) / 2)} B")
    r2 = Simulator(gpt, small, CostModel.for_topology(gpt, small)).run(off.groups)
    assert r2.oom and r2.host_oom[0][0] == 0 and r2.overflow == pytest.approx(2.0, rel=1e-6)
    assert r2.memory_report(small).startswith("host of machine 0 (box) needs ")


@pytest.mark.slow
@pytest.mark.parametrize("sync,n", [("zero3", 2), ("zero2", 2), ("zero3", 1)])
def test_offloaded_ranks_train_as_one_process(tmp_path, captured, sync, n):
    """Offloaded ZeRO-2/3 on gloo: the host shards stepped by the optimizer, copied to the device
    shards the gathers read; parameters after 2 Adam steps equal single-process training. Each
    rank's host holds its FP32 shard, gradient shard and Adam moments, ``(2P + O) / S`` as the
    simulator's host; the device the simulator's device bytes: ZeRO-3's its parameter shard (the
    gradient shard offloaded at the sync), ZeRO-2's the full parameters, whose slice is the copy
    of its host shard the gathers read."""
    from test_sharded import _run

    from tag.executor import reference_training
    from tag.executor.equality import assert_params_equal, saved_params
    from tag.parallel.sharded import offloaded_bytes
    from tag.plan import GroupPlan
    from tag.workloads import load_workload

    graph = captured("mlp", batch=8, groups=4).graph
    groups = [GroupPlan(list(range(n)), [1.0 / n] * n, sync, offload="optimizer") for _ in range(graph.num_groups)]
    res, ranks = _run(tmp_path, graph, n, groups, bucket_bytes=4096)
    ref, ref_losses = reference_training(load_workload("mlp", batch=8), "adam", 2)
    assert_params_equal(saved_params(tmp_path / "run", n), ref, {p.name for p in graph.params})
    assert res.losses == pytest.approx(ref_losses, rel=1e-4)
    p = float(sum(q.nbytes for q in graph.params))
    level = int(sync[-1])
    device, host = offloaded_bytes(level, n, p, 2 * p)
    for r in ranks:
        assert r["host_state_bytes"] == pytest.approx(host, rel=0.02)
        assert r["optimizer_state_bytes"] == pytest.approx(2 * p / n, rel=0.02)
        assert r["device_state_bytes"] == pytest.approx(device, rel=0.02)


def test_export_names_the_offload_it_drops(gpt):
    """A trainer's file is written without the offload, and the export says so (not exact)."""
    from tag.planner import export_plan

    t = _box()
    plan = layout_plan(gpt, t, parse_layout("dp=4,zero=3,offload=optimizer"), CostModel.for_topology(gpt, t))
    ex = export_plan(plan, gpt, t, "deepspeed")
    assert not ex.exact and ex.problems == ["optimizer offload on 8 of 8 op-groups (offload=optimizer)"]
    assert ex.layout == Layout(dp=4, zero=3)
