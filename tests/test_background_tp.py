"""Tensor-parallel collectives across machines on a network shared with other jobs
(tag.topology.background): the blocking all-reduces of a tensor-parallel group spanning two
machines take what other jobs leave of their NICs, as pipeline messages and gradient collectives
do; a group within one machine is untouched."""

from __future__ import annotations

import copy

import pytest
import yaml

from tag.cost.model import CostModel
from tag.parallel.tensor_parallel import group_split
from tag.plan import GroupPlan, new_plan
from tag.sim import Simulator
from tag.topology import load_topology

BASE = {"name": "two", "network": {"bandwidth": "100 Gbit/s", "latency": "10 us"},
        "machines": [{"name": m, "gpu": "V100-SXM2-16GB", "count": 2, "intra_bandwidth": "150 GB/s",
                      "host_launch": "1 us"} for m in "ab"]}
"""Hosts far ahead of the devices (1 us a launch): each stage lasts its device's seconds, so a
slower collective lengthens its stage by what it loses (the eager host at 55 us a launch, as
``tag.sim.engine._Run._hosted`` times it, would bound these small kernels' stages)."""
BATCH = 16


@pytest.fixture(scope="module")
def gpt2(captured):
    return captured("gpt2:n_layer=2,n_embd=256,n_head=4,vocab=1024,seq=128", batch=BATCH, groups=4).graph


def _topo(tmp_path, busy=None, name="t.yaml"):
    d = copy.deepcopy(BASE)
    if busy is not None:
        d["machines"][0]["background"] = busy
    path = tmp_path / name
    path.write_text(yaml.safe_dump(d))
    return load_topology(path)


def _stages(graph, topo, costs, devices, tp, recompute=False):
    """{(phase, event name): seconds} of device 0's forward and backward stages, and the result,
    for every group tensor parallel of degree ``tp`` over ``devices`` (one replica group)."""
    sim = Simulator(graph, topo, CostModel(graph, topo, costs._dev, costs.comm))
    n = len(devices)
    plan = new_plan(graph, topo, [GroupPlan(list(devices), [1 / n] * n, sync="tp", tp=tp, recompute=recompute)
                                  for _ in range(graph.num_groups)])
    res = sim.run(plan.groups, trace=True)
    return {(e.cat, e.name): e.end - e.start for e in res.events
            if e.device == devices[0] and e.cat in ("fwd", "bwd")}, res


@pytest.mark.parametrize("recompute", [False, True])
def test_cross_machine_tp_collectives_take_what_other_jobs_leave(gpt2, tmp_path, recompute):
    """tp=4 over both machines (2 + 2 devices), half of machine a's NIC taken by other jobs:
    each stage with Megatron blocks lasts its collectives' nominal seconds longer (they take
    twice as long on half the bandwidth; recomputed, the backward redoes the forward's); the
    stages without blocks and every stage of tp=2 within machine a are unchanged, and a
    background busy long after the iteration changes nothing."""
    free, half = _topo(tmp_path), _topo(tmp_path, 0.5, name="half.yaml")
    late = _topo(tmp_path, {"trace": [[1000.0, 0.9]]}, name="late.yaml")
    costs = CostModel.for_topology(gpt2, free)
    devs = [0, 1, 2, 3]
    s0, r0 = _stages(gpt2, free, costs, devs, 4, recompute)
    s1, r1 = _stages(gpt2, half, costs, devs, 4, recompute)
    s2, r2 = _stages(gpt2, late, costs, devs, 4, recompute)
    # (group by group on a shared network, a run of stages by running sums on a free one: equal to rounding)
    assert s2 == pytest.approx(s0, rel=1e-12) and r2.iteration_time_s == pytest.approx(r0.iteration_time_s, rel=1e-12)
    assert r1.iteration_time_s > r0.iteration_time_s and s0.keys() == s1.keys()
    comm, slowed = costs.comm, 0
    for (cat, name), t in s0.items():
        g = int(name.split()[1][1:])  # "fwd g3", "bwd g3"
        sp = group_split(gpt2, g)
        fwd = comm.tensor_parallel_time(devs, [a.at(BATCH) for a in sp.reduce_fwd]) if sp.blocks else 0.0
        bwd = comm.tensor_parallel_time(devs, [a.at(BATCH) for a in sp.reduce_bwd]) if sp.blocks else 0.0
        want = fwd if cat == "fwd" else bwd + (fwd if recompute else 0.0)
        assert s1[(cat, name)] - t == pytest.approx(want, rel=1e-9, abs=1e-12), (cat, name)
        slowed += want > 0
    assert slowed >= 2  # both blocks' forward and backward
    w0, _ = _stages(gpt2, free, costs, [0, 1], 2, recompute)
    w1, _ = _stages(gpt2, half, costs, [0, 1], 2, recompute)
    assert w0 == w1
