"""The simulator moves what the executor moves: for many plans, the bytes every (source device,
destination device) pair transfers in one iteration equal those of the executor's schedule
(:func:`tag.parallel.schedule.build_schedule`), including which non-batch backward tensors are
summed over the producer replicas (partial sums, e.g. a tied weight's gradient) and which are
copied (the loss-gradient seed, ``1 / count`` of a mean loss, weight transposes)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from test_sim_reference import BATCH, GROUPS, SPEC, _random_group, make_plans, setup

from tag.graph.gradients import gradient_tensors, partial_sum_tensors
from tag.parallel.schedule import build_schedule
from tag.plan import new_plan
from tag.sim import Simulator
from tag.sim.engine import _Run
from tag.sim.program import build_program


@pytest.fixture(scope="module")
def graph(captured):
    return captured(SPEC, batch=BATCH, groups=GROUPS).graph


def sim_bytes(sim, groups, pipeline=None) -> Counter:
    """(source device, destination device) -> bytes the simulated iteration moves (every
    micro-batch's flows on a pipeline)."""
    out: Counter = Counter()
    micro = None if pipeline is None else build_program(sim, groups, pipeline)
    for _, lists in _Run(sim, sim.deploy(groups), None, micro).incoming.values():  # (offset, flow lists)
        for flows in lists:
            for *_, a, b, _ma, _mb, _t, _r, nbytes in flows:
                out[(a, b)] += nbytes
    return out


def schedule_bytes(graph, sched, names=None) -> Counter:
    """(source device, destination device) -> bytes the executor's schedule moves (of the tensors
    ``names`` only, if given)."""
    by_name = {t.name: t for t in graph.tensors}
    out: Counter = Counter()
    for step in sched.steps:
        for m in step.moves:
            if m.src == m.dst or m.mode == "zeros" or (names is not None and m.name not in names):
                continue
            nb = by_name[m.name].nbytes
            if m.mode == "rows":
                out[(m.src, m.dst)] += nb.per_sample * (m.stop - m.start)
            else:
                batch = sched.unit_at(m.src_unit, step.micro).replica_on(m.src).batch
                out[(m.src, m.dst)] += nb.fixed + nb.per_sample * batch
    return out


def _executor_bytes(graph, topo, groups) -> Counter:
    return schedule_bytes(graph, build_schedule(graph, new_plan(graph, topo, groups), topo.machine_of))


def test_seed_is_copied_tied_weight_gradient_summed(graph):
    sim = Simulator(graph, *setup(graph))
    names = {graph.tensors[e.tensor].name: e.grad for es in sim.static.edges.values() for e in es
             if e.tensor in gradient_tensors(graph) and not e.batch}
    assert names.get("full_like") is False  # the seed crosses from the loss group: copied
    sums = partial_sum_tensors(graph)
    assert {n for n, grad in names.items() if grad} == {graph.tensors[t].name for t in sums} & set(names)


def test_transfers_match_the_executor(graph):
    topo, costs = setup(graph)
    sim = Simulator(graph, topo, costs)
    rng = random.Random(5)
    plans = [groups for _, groups in make_plans(graph, topo, costs)]
    plans += [[_random_group(rng, graph, g, topo.num_devices) for g in range(GROUPS)] for _ in range(10)]
    for groups in plans:
        got, want = sim_bytes(sim, groups), _executor_bytes(graph, topo, groups)
        assert set(got) == set(want)
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-12), k


def test_gradient_buckets_match_the_executor(graph):
    """The simulator's gradient collectives are the executor's buckets: the same groups, in the same
    launch order, carrying the same bytes, for many plans and bucket caps (a cap below every
    group's bytes: one bucket per group; DDP's default; one between)."""
    topo, costs = setup(graph)
    rng = random.Random(7)
    plans = [groups for _, groups in make_plans(graph, topo, costs)]
    plans += [[_random_group(rng, graph, g, topo.num_devices) for g in range(GROUPS)] for _ in range(10)]
    grad_bytes = sum(p.nbytes for p in graph.params)
    seen_multi = False
    for cap in (1, None, grad_bytes // 5):
        sim = Simulator(graph, topo, costs, cap)
        for groups in plans:
            sched = build_schedule(graph, new_plan(graph, topo, groups), topo.machine_of, cap)
            want = [(b.groups, b.nbytes) for b in sched.buckets]
            got = [(gs, job.sync_bytes) for gs, job in sim.sync_jobs(sim.deploy(groups))]
            assert got == want
            launches = [i for i, st in enumerate(sched.steps) if sched.launched_at(st) is not None]
            assert [sched.steps[i].group for i in launches] == [b.groups[-1] for b in sched.buckets]
            seen_multi |= any(len(b.groups) > 1 for b in sched.buckets)
            if cap == 1:
                assert all(len(b.groups) == 1 for b in sched.buckets)
    assert seen_multi
