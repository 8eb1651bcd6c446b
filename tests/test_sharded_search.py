"""Sharded data parallelism in the search: the estimates the GNN predictor reads
(:meth:`tag.parallel.Sharded.search_estimate`) gather by the simulator's dtype rule
(:func:`tag.graph.precision.param_gather_bytes`), and MCTS's factored action space offers ZeRO-3
with the optimizer offloaded (:class:`tag.parallel.sharded.ZeroOption`)."""

from __future__ import annotations

import numpy as np
import pytest
from test_param_casts import LLAMA

from tag.parallel import get_strategy
from tag.parallel.sharded import ZeroOption
from tag.search.space import ActionSpace
from tag.sim import Simulator
from tag.topology import load_topology

MLP = "mlp:layers=8,hidden=512,in_dim=256"


def _topology(machines: int, count: int, memory: str = "80 GB", network: str = "100 Gbit/s"):
    gpu = {"name": "g", "tflops": 100, "memory": memory, "memory_bandwidth": "2000 GB/s"}
    return load_topology({"name": f"t{machines}x{count}", "network": {"bandwidth": network},
                          "machines": [{"name": f"m{i}", "gpu": gpu, "count": count, "intra_bandwidth": "100 GB/s"}
                                       for i in range(machines)]})


def _estimate(space, level: int, devices: tuple[int, ...], option=None) -> float:
    """Seconds the search estimates for the whole model as ZeRO ``level`` over ``devices``:
    compute and sync summed over the groups."""
    comm = space.comm
    sub = np.array(comm.bandwidth[np.ix_(devices, devices)])
    np.fill_diagonal(sub, np.inf)
    bmin, lmax = float(sub.min()), float(comm.latency[np.ix_(devices, devices)].max())
    s = get_strategy(f"zero{level}")
    return sum(sum(s.search_estimate(space, g, devices, option, None, bmin, lmax)[:2])
               for g in range(space.num_groups))


def test_the_estimate_gathers_what_the_simulator_gathers(captured):
    """bf16 on a slow network, 4 devices over 2 machines: the search's gathered bytes are the
    simulator's (the projections in bf16, the norms and the embedding table in fp32; fp32: the
    parameters), and the estimate orders the ZeRO levels as the simulated iterations where the
    gathers decide it: ZeRO-3 (a reduce-scatter and two gathers of the bf16 weights) and ZeRO-2
    before ZeRO-1 (an all-reduce and one gather). fp32 gathers tied ZeRO-3 with ZeRO-1 there.
    (ZeRO-2 against ZeRO-3 is the simulator's prefetch, which the estimate leaves out.)"""
    from tag.sim.sharded import low_gathers

    topo = _topology(2, 2, network="0.1 Gbit/s")
    graph = captured(LLAMA, batch=8, groups=4, precision="bf16").graph
    space, sim = ActionSpace(graph, topo), Simulator(graph, topo)
    pg = low_gathers(sim)[0]
    assert space.costs.gather_bytes.sum() == pytest.approx(pg.sum())
    assert space.costs.gather_bytes.sum() < 0.6 * space.costs.param_bytes.sum()
    fp32 = ActionSpace(captured(LLAMA, batch=8, groups=4).graph, topo)
    assert np.array_equal(fp32.costs.gather_bytes, fp32.costs.param_bytes)
    devices = tuple(range(4))
    est, run = {}, {}
    for level in (1, 2, 3):
        est[level] = _estimate(space, level, devices)
        plan = [get_strategy(f"zero{level}").search_plan(space, g, devices, None) for g in range(graph.num_groups)]
        for gp in plan:
            gp.sync = f"zero{level}"
        run[level] = sim.run(plan).iteration_time_s
    for fast in (2, 3):
        assert est[fast] < est[1] and run[fast] < run[1], (fast, est, run)


def test_the_search_offers_offload_and_keeps_hybrid_shards():
    """ZeRO-3 actions over every device: full, hybrid (a machine's devices a shard group) and full
    with the optimizer offloaded; a group's plan keeps the option's shard size and offload."""
    topo = _topology(2, 2)
    from tag.graph import capture
    from tag.workloads import load_workload

    graph = capture(load_workload("mlp:layers=2,hidden=64,in_dim=32", batch=8), num_groups=2).graph
    space = ActionSpace(graph, topo)
    every = [act.tp for act in space.actions if act.sync == "zero3" and act.devices == (0, 1, 2, 3)]
    assert every == [None, 2, ZeroOption(None, "optimizer")]
    for option, shard, offload in ((2, 2, None), (ZeroOption(None, "optimizer"), None, "optimizer")):
        a = space.action_index((0, 1, 2, 3), "zero3", option)
        gp = space.group_plan(0, a)
        assert (gp.sync, gp.shard, gp.offload) == ("zero3", shard, offload)
        assert "zero3" in space.actions[a].describe(topo)


def test_mcts_offloads_where_only_offload_fits():
    """One machine of 2 GPUs, each holding 0.56 of the mlp's parameters, gradients and Adam state
    (tensor parallelism left out: its 2-way split peaks at 0.57): neither data parallelism, a
    model-parallel split nor ZeRO-3 over both fits (half the state each, the gathered layers and the
    unsharded gradients); uniform MCTS finds a plan that fits by offloading optimizers, and the
    simulator agrees."""
    from tag.graph import capture
    from tag.search.evaluate import Evaluator
    from tag.search.mcts import mcts_search, uniform_prior
    from tag.workloads import load_workload

    graph = capture(load_workload(MLP, batch=64), num_groups=8).graph
    state = sum(p.nbytes for p in graph.params) * 4  # weights, gradients, two Adam moments
    topo = _topology(1, 2, memory=f"{int(0.56 * state)} B")
    space = ActionSpace(graph, topo, tensor_parallel=False)
    sim = Simulator(graph, topo)
    k = graph.num_groups
    for sync, option in (("allreduce", None), ("mp", None), ("zero3", None)):
        a = space.action_index((0, 1), sync, option)
        assert sim.run(space.group_plans([a] * k)).oom, sync
    res = mcts_search(space, Evaluator(space), uniform_prior, np.random.default_rng(0), playouts=30)
    assert not res.oom
    assert any(gp.offload == "optimizer" for gp in res.groups)
    run = sim.run(res.groups)
    assert not run.oom and run.iteration_time_s == pytest.approx(res.time_s)
