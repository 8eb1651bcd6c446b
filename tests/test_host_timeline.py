"""The eager host as a timeline of its own (tag.sim.engine._Run._phase): a GPU rank's host issues
each stage's kernels, ``host_launch`` a forward launch, while its device runs the stages before, so
the launches hide behind the device's work where the device bounds a stage and show where the host
does (small kernels). A 4-layer Llama (bf16, 16 groups, batch 32) as 4 pipeline stages of one layer
at 16 and 32 micro-batches of one and two samples."""

from __future__ import annotations

import pytest

from tag.cost.model import CostModel
from tag.parallel.layout import layout_plan, parse_layout
from tag.sim import Simulator
from tag.topology import load_topology

SPEC = "llama:n_layer=4,n_embd=512,n_head=8,n_kv_head=4,ffn=1408,seq=256,vocab=512"
SLOW = {"name": "slow", "tflops": 2.0, "memory": "80 GB", "memory_bandwidth": "40 GB/s"}
"""A GPU slow enough that a one-sample micro-batch's forward and backward on it outlast their
launches at 55 us a forward launch, while the forward alone does not."""


@pytest.fixture(scope="module")
def graph(captured):
    return captured(SPEC, batch=32, groups=16, precision="bf16").graph


def _run(graph, gpu, host_launch: str, micro: int):
    """(iteration seconds, cost model, plan) of ``dp=1,pp=4`` at ``micro`` micro-batches, one layer
    a stage, on 4 ``gpu`` whose machine's host takes ``host_launch`` a forward launch."""
    topo = load_topology({"name": "four", "machines": [{"name": "m", "gpu": gpu, "count": 4,
                                                        "intra_bandwidth": "300 GB/s", "host_launch": host_launch}]})
    costs = CostModel.for_topology(graph, topo)
    plan = layout_plan(graph, topo, parse_layout(f"dp=1,pp=4,micro={micro},stages=1+1+1+1"), costs)
    return Simulator(graph, topo, costs).run(plan.groups, pipeline=plan.pipeline).iteration_time_s, costs, plan


def test_launches_hide_behind_the_devices_work(graph):
    """On the slow GPU at 32 micro-batches of one sample, stage 0's forward is host-bound (5.2 ms of
    launches, 4.0 ms of kernels) but its forward and backward are not (7.2 against 8.8 ms): the
    host issues the next stage while the device runs this one, so the iteration takes what the
    device's work takes (the same pipeline on a 1 us host) within 1%, and no longer at 32
    micro-batches than at 16 (307.96 / 307.99 ms; 305.63 on the 1 us host). Charged with the
    device's work (each stage's seconds of the eager step, before 2026-11-29), the forward's
    launches added up: 316.77 ms at 16, 362.22 at 32."""
    t16, _, _ = _run(graph, SLOW, "55 us", 16)
    t32, costs, plan = _run(graph, SLOW, "55 us", 32)
    fast32 = _run(graph, SLOW, "1 us", 32)[0]
    parts = costs.host_parts(0)
    s0 = slice(0, plan.pipeline.stages[1])  # stage 0's groups at one sample
    host, dev = parts.host[s0, :2, 1].sum(axis=0), parts.device[s0, :2, 1].sum(axis=0)
    assert host[0] > 1.2 * dev[0] and host.sum() < 0.85 * dev.sum(), (host, dev)
    assert t32 <= 1.01 * fast32, (t32, fast32)
    assert t32 <= 1.001 * t16, (t16, t32)


def test_launches_show_where_the_host_bounds_the_stages(graph):
    """On an A100 stage 0's one-sample forward and backward take 0.7 ms of kernels each against 5.2
    and 2.0 ms of launches: the iteration is the host's, at least stage 0's launches of every
    micro-batch (its forwards after the first launch no parameter casts), and doubles with the
    micro-batches (109.37 / 218.06 ms at 16 / 32)."""
    t16, _, _ = _run(graph, "A100-80GB", "55 us", 16)
    t32, costs, plan = _run(graph, "A100-80GB", "55 us", 32)
    parts = costs.host_parts(0)
    s0 = slice(0, plan.pipeline.stages[1])
    launches = 32 * parts.host[s0, :2, 1].sum() - 31 * costs.cast_host_seconds(0)[s0].sum()
    work = 32 * parts.device[s0, :2, 1].sum()
    assert launches > 3 * work
    assert launches <= t32 <= 1.15 * launches, (launches, t32)
    assert 1.8 < t32 / t16 < 2.1, (t16, t32)


def test_cpu_ranks_hold_no_host_apart(topo4, captured):
    """A CPU rank issues and computes on one thread: its costs hold no host apart, so its layouts
    run on the device timeline alone, as before."""
    g = captured("mlp", batch=8, groups=4).graph
    sim = Simulator(g, topo4)
    assert sim.hosts is None and sim.costs.host_parts(0) is None
    assert sim.layout((0, 1), (4, 4)).host is None


def test_a_chunk_records_when_its_transfer_arrived(captured):
    """An mp chunk whose host is apart: the recorder gets, as the chunk's arrival, when its last
    message arrived (before 2026-11-29 it got the host's end of the stage, so a chunk could be
    recorded as receiving its input after it started, and the critical path went through the
    transfer). On two A100 with a 5 ms forward launch, every recorded stage starts no earlier than
    its input arrived."""
    from tag.plan import GroupPlan, group_positions
    from tag.sim.event_loop import Run
    from tag.sim.recorder import Recorder

    g = captured("mlp", batch=8, groups=4).graph
    topo = load_topology({"name": "two", "machines": [{"name": "m", "gpu": "A100-80GB", "count": 2,
                                                       "intra_bandwidth": "300 GB/s", "host_launch": "5 ms"}]})
    sim = Simulator(g, topo, CostModel.for_topology(g, topo))
    groups = []
    for k in range(g.num_groups):
        lo, hi = group_positions(g, k)
        groups.append(GroupPlan([0, 1], [0.5, 0.5], "mp", None, [lo, lo + (hi - lo) // 2]) if hi - lo > 1
                      else GroupPlan([k % 2], [1.0], "allreduce"))
    assert any(gp.sync == "mp" for gp in groups)
    rec = Recorder()
    Run(sim, sim.deploy(groups), rec).execute()
    received = [seg for seg in rec.segments if seg.ready is not None]
    assert received and any(seg.unit.host is not None for seg in received)
    for seg in received:
        assert all(r <= s for r, s in zip(seg.ready, seg.start)), (seg.ready, seg.start)
