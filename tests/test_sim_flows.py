"""The simulator's transfer records (tag.sim.flows): the exact tuples the event loop unpacks are in
the field order their NamedTuples declare, and messages pack a stage's flows per device pair."""

from __future__ import annotations

import pytest
from test_sim_tools import chain_graph, hand_costs, topology

from tag.plan import GroupPlan
from tag.sim import Simulator
from tag.sim.event_loop import Run
from tag.sim.flows import Message, StageFlow, pack_messages, stage_index
from tag.sim.units import TemplateFlow

NET, LAT = 1e6, 1e-3  # bytes/s, s


def _sim(graph):
    topo = topology([("a", 2, 1e9, 0.0), ("b", 2, 1e9, 0.0)], net_bw=NET, net_lat=LAT)
    return Simulator(graph, topo, hand_costs(graph, topo, [1e-3] * 3, [2e-3] * 3, [1e-3] * 3))


def _plan():
    # group 0 on devices 0, 1 (machine a), group 1 on 2 (machine b), group 2 on 0, 3: batch rows move
    # across machines and back, one replica set to another
    return [GroupPlan([0, 1], [0.5, 0.5], "allreduce"), GroupPlan([2], [1.0], "allreduce"),
            GroupPlan([0, 3], [0.25, 0.75], "allreduce")]


def test_stage_flows_read_by_name_match_the_recorders_flows():
    graph = chain_graph(3)
    sim = _sim(graph)
    deployments = sim.deploy(_plan())
    pairs = sim.pairs_used(deployments)
    assert pairs
    k, seen = graph.num_groups, 0
    for pair in pairs:
        assert len(pair.stage_flows) == len(pair.by_dst)
        for (dst, flows), (stage, records) in zip(pair.stage_flows, pair.by_dst):
            assert dst == stage_index(*stage, k)
            for t, f in zip(flows, records, strict=True):
                x = StageFlow(*t)
                assert x.source_stage == stage_index(*f.src, k)
                assert (x.source_replica, x.dst_replica) == (f.src_rep, f.dst_rep)
                assert (x.src_device, x.dst_device, x.src_machine, x.dst_machine) == (f.a, f.b, f.src_machine, f.dst_machine)
                assert (x.seconds, x.nbytes) == (f.time, f.nbytes)
                assert (x.src_machine >= 0) == (sim.comm.machine_of[f.a] != sim.comm.machine_of[f.b])
                seen += 1
        for ((phase, dst_unit), flows), (stage, records) in zip(pair.template.by_dst, pair.by_dst, strict=True):
            assert stage == (phase, pair.g2, dst_unit)
            for t, f in zip(flows, records, strict=True):
                x = TemplateFlow(*t)
                assert f.src == (x.src_phase, pair.g1, x.src_unit) and (x.src_device, x.dst_device) == (f.a, f.b)
                assert x.nbytes == f.nbytes > 0 and x.seconds == f.time
    assert seen >= 4


def test_messages_pack_a_stages_flows_per_device_pair():
    p2p = lambda a, b, nbytes: LAT + nbytes / NET  # noqa: E731
    # two flows 0 -> 2 (from stages 5 and 7) and one 1 -> 2 into one stage
    flows = ((5, 0, 0, 2, 0, 1, p2p(0, 2, 100.0), 0, 100.0), (6, 1, 1, 2, 0, 1, p2p(1, 2, 50.0), 0, 50.0))
    more = ((7, 1, 0, 2, 0, 1, p2p(0, 2, 300.0), 0, 300.0),)
    msgs = [Message(*m) for m in pack_messages([flows, more], p2p, False, [False, True, False])]
    assert [(m.src_device, m.dst_device) for m in msgs] == [(0, 2), (1, 2)]
    first, second = msgs
    assert (first.source_stage, first.source_replica, first.more_sources) == (5, 0, ((7, 1),))
    assert first.nbytes == 400.0 and first.seconds == pytest.approx(LAT + 400.0 / NET)
    assert second.more_sources is None and second.seconds == flows[1][6] and second.nbytes == 50.0
    # a GPU rank only sending computes on, a CPU rank (device 1) waits; so does a sender that receives
    assert (first.sender_waits, second.sender_waits) == (False, True)
    back = ((9, 0, 2, 0, 1, 0, p2p(2, 0, 10.0), 0, 10.0),)  # device 2 sends to 0 in the same step
    assert [Message(*m).sender_waits for m in pack_messages([flows, back], p2p, False, [False] * 3)] == \
        [True, False, True]
    assert all(Message(*m).sender_waits for m in pack_messages([flows], p2p, True, [False] * 3))


def test_the_event_loop_moves_every_stage_flows_bytes():
    graph = chain_graph(3)
    sim = _sim(graph)
    run = Run(sim, sim.deploy(_plan()))
    moved = sum(StageFlow(*t).nbytes for _, lists in run.incoming.values() for flows in lists for t in flows)
    p2p, _ = sim.moved_bytes(_plan())
    assert moved > 0 and moved == pytest.approx(sum(p2p.values()))
    res = run.execute()
    assert sum(res.comm_time_s) > 0
