"""Pipeline stages of tensor-parallel groups on two machines: Megatron-LM's scatter-gather.

Between stages on different machines, device ``i`` of a stage's tensor-parallel group sends slice
``i`` of each flattened boundary tensor to device ``i`` of the next stage's group, which
all-gathers the whole (the boundary gradients likewise, backwards); the simulator prices the
same messages and the all-gather (:mod:`tag.parallel.moves`, ``shard``). A tiny GPT-2 at
``tp=2,pp=2,micro=2`` with each stage on its own machine trains equal to single-process SGD
(the executor's tolerance, rtol 1e-4 / atol 1e-6; SGD for the reason tests/test_tensor_parallel.py
gives), and the bytes the simulator moves between devices and all-gathers are those the executor
sends and gathers, counted by the executor's runtimes (:attr:`RankRuntime.sent_bytes`,
:attr:`RankRuntime.gathered_bytes`)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tag.cost.model import CostModel
from tag.executor.equality import assert_params_equal, saved_params
from tag.parallel import validate_plan
from tag.parallel.layout import Layout, layout_plan
from tag.sim.program import build_program
from tag.topology import load_topology

GPT2 = "gpt2:n_layer=2,n_embd=64,n_head=4,vocab=100,seq=16"
TWO_MACHINES = """name: two-by-two
machines:
  - {name: m0, gpu: V100-SXM2-16GB, count: 2, intra_bandwidth: "150 GB/s"}
  - {name: m1, gpu: V100-SXM2-16GB, count: 2, intra_bandwidth: "150 GB/s"}
network:
  bandwidth: "10 Gbit/s"
  latency: "50 us"
"""


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    path = tmp_path_factory.mktemp("topo") / "two.yaml"
    path.write_text(TWO_MACHINES)
    return str(path)


@pytest.fixture(scope="module")
def setup(captured, two):
    """The captured graph and the ``tp=2,pp=2,micro=2`` plan: stage s on machine s."""
    graph = captured(GPT2, batch=8, groups=6).graph
    topo = load_topology(two)
    plan = layout_plan(graph, topo, Layout(tp=2, pp=2, micro=2), CostModel.for_topology(graph, topo))
    assert [(g.devices, g.tp) for g in plan.groups] == [([0, 1], 2)] * 3 + [([2, 3], 2)] * 3
    validate_plan(plan, graph, topo)  # the executor's check
    return graph, topo, plan


@pytest.fixture(scope="module")
def trained(setup):
    from tag.executor import run_virtual
    from tag.workloads import load_workload

    graph, topo, plan = setup
    return run_virtual(graph, plan, load_workload(GPT2, batch=8), "sgd", 2, machine_of=topo.machine_of)


def _assert_stage_params(rts, ref, graph, degree=2):
    """Every tensor-parallel group's full parameters (``degree`` consecutive ranks) equal ``ref``."""
    ranks = sorted(rts)
    teams = [[rts[r] for r in ranks[lo:lo + degree]] for lo in range(0, len(ranks), degree)]
    assert_params_equal({ranks[i * degree]: team[0].hook.full_params([(rt.named_params(), rt.hook.kept) for rt in team])
                         for i, team in enumerate(teams)}, ref, {p.name for p in graph.params})


def test_scatter_gather_pipeline_trains_as_one_process(setup, trained):
    """Every device receives slices and all-gathers (forward activations into stage 1, their
    gradients into stage 0); after 2 steps each stage's parameters equal single-process SGD."""
    from tag.executor import reference_training
    from tag.workloads import load_workload

    graph, _, _ = setup
    assert all(rt.gathered_bytes > 0 for rt in trained.values())
    ref, losses = reference_training(load_workload(GPT2, batch=8), "sgd", 2)
    _assert_stage_params(trained, ref, graph)
    assert sum(rt.loss for rt in trained.values()) == pytest.approx(losses[-1], rel=1e-5)


def test_simulated_bytes_are_the_executed_ones(setup, trained):
    """Per (sender, receiver) device pair across machines the simulator's message bytes equal what
    the executor's ranks sent in an iteration (each slice ``1 / 2`` of the boundary tensor), and
    per device the all-gathered bytes equal the executor's; on one machine nothing is scattered."""
    from tag.sim import Simulator

    graph, topo, plan = setup
    sim = Simulator(graph, topo, CostModel.for_topology(graph, topo))
    p2p, gathered = sim.moved_bytes(plan.groups, pipeline=plan.pipeline)
    mo = topo.machine_of
    sent: dict[tuple[int, int], int] = {}
    for rank, rt in trained.items():  # (a rank sends to the same member index of the destination's group)
        for dst, nbytes in rt.sent_bytes.items():
            sent[(rank, dst + rank % 2)] = nbytes
    far = {ab: nb for ab, nb in p2p.items() if mo(ab[0]) != mo(ab[1])}
    assert set(far) == {(0, 2), (1, 3), (2, 0), (3, 1)}
    assert far == {ab: pytest.approx(nb, rel=1e-12) for ab, nb in sent.items() if mo(ab[0]) != mo(ab[1])}
    assert gathered == {r: pytest.approx(rt.gathered_bytes, rel=1e-12) for r, rt in trained.items()}
    one = load_topology("topologies/local-cpu4.yaml")
    local = layout_plan(graph, one, Layout(tp=2, pp=2, micro=2), CostModel.for_topology(graph, one))
    assert Simulator(graph, one, CostModel.for_topology(graph, one)).moved_bytes(
        local.groups, pipeline=local.pipeline)[1] == {}


def test_the_plan_bound_counts_the_all_gathers(setup):
    """``plan_bound``'s per-device transfer load (:func:`tag.sim.bounds._transfer_load`) is the
    seconds at bandwidth of the messages the device receives (and sends, on a CPU rank) plus one all-gather of everything scattered
    into its group (the run all-gathers per stage and micro-batch, at least that long), and stays
    below the run's communication time on every device."""
    from tag.sim import Simulator
    from tag.sim.bounds import _transfer_load, plan_bound

    graph, topo, plan = setup
    sim = Simulator(graph, topo, CostModel.for_topology(graph, topo))
    res = sim.run(plan.groups, pipeline=plan.pipeline)
    p2p, gathered = sim.moved_bytes(plan.groups, pipeline=plan.pipeline)
    load = _transfer_load(sim, sim.deploy(plan.groups), build_program(sim, plan.groups, plan.pipeline))[0]
    for d in range(topo.num_devices):
        # on its receiver, and on a sender that waits for its sends (a CPU rank; a GPU rank computes on)
        links = sum(nb / sim.comm.bandwidth[a, b] for (a, b), nb in p2p.items()
                    if d == b or (d == a and sim.shared_stream[a]))
        team = (d - d % 2, d - d % 2 + 1)
        gather = sim.scatter_gather_time(team, (gathered[d] / 2, gathered[d] / 2))
        assert gather > 0 and load[d] == pytest.approx(links + gather, rel=1e-9)
        assert load[d] <= res.comm_time_s[d]
    assert plan_bound(sim, plan.groups, plan.pipeline).time_s <= res.iteration_time_s


@pytest.mark.parametrize("numel,degree,dtype", [(6, 2, torch.float32), (7, 2, torch.float32), (7, 3, torch.float32),
                                                (5, 8, torch.float32), (1, 3, torch.int64), (3, 2, torch.bfloat16),
                                                (5, 3, torch.bool)])
def test_slices_pad_a_size_the_degree_does_not_divide(numel, degree, dtype):
    """Every member's slice has the same number of bytes (the last padded with zero bytes, as
    many as the simulator prices: :func:`tag.sim.units.shard_bytes`); concatenated in member
    order and cut to the size they give the tensor back; where the degree divides the elements,
    slice ``i`` is Megatron-LM's chunk ``i`` of the elements."""
    from tag.executor.runtime import scatter_slice, slice_bytes
    from tag.sim.units import shard_bytes

    x = torch.arange(numel).to(dtype).reshape(1, numel)
    nbytes = numel * x.element_size()
    parts = [scatter_slice(x, i, degree) for i in range(degree)]
    assert {(p.dtype, p.numel()) for p in parts} == {(torch.uint8, slice_bytes(nbytes, degree))}
    assert sum(p.numel() for p in parts) == shard_bytes(nbytes, degree) >= nbytes
    assert torch.equal(torch.cat(parts)[:nbytes].view(dtype).view(1, numel), x)
    if numel % degree == 0:
        assert all(torch.equal(p.view(dtype), c) for p, c in zip(parts, x.reshape(-1).chunk(degree)))


TWO_BY_FOUR = TWO_MACHINES.replace("count: 2", "count: 4")
ONE_BY_EIGHT = """name: one-by-eight
machines:
  - {name: m0, gpu: V100-SXM2-16GB, count: 8, intra_bandwidth: "150 GB/s"}
"""
TWO_BY_THREE = TWO_MACHINES.replace("count: 2", "count: 3")
GPT2_3 = "gpt2:n_layer=2,n_embd=48,n_head=6,vocab=100,seq=16"
"""Heads that 3 divides (``tp=3``)."""


def _pairs_equal(captured, tmp_path, text, spec, layout, degree):
    """``layout`` of ``spec`` (batch 8) on the topology ``text``: trained 2 SGD steps in one
    process, its parameters equal single-process SGD and per (sender, receiver) device pair, on
    one machine or across, the simulator's message bytes equal what the executor's ranks sent
    (each rank's destination: the rank of its own member index in the schedule device's group),
    per device the all-gathered bytes too. Returns (simulator's pair bytes, runtimes, topology)."""
    from tag.executor import reference_training, run_virtual
    from tag.executor.strategies import execution_for
    from tag.sim import Simulator
    from tag.workloads import load_workload

    path = tmp_path / "topo.yaml"
    path.write_text(text)
    graph = captured(spec, batch=8, groups=6).graph
    topo = load_topology(str(path))
    plan = layout_plan(graph, topo, layout, CostModel.for_topology(graph, topo))
    validate_plan(plan, graph, topo)
    rts = run_virtual(graph, plan, load_workload(spec, batch=8), "sgd", 2, machine_of=topo.machine_of)
    ref, _ = reference_training(load_workload(spec, batch=8), "sgd", 2)
    _assert_stage_params(rts, ref, graph, degree)
    p2p, gathered = Simulator(graph, topo, CostModel.for_topology(graph, topo)).moved_bytes(
        plan.groups, pipeline=plan.pipeline)
    shards = execution_for(plan, graph).shards
    sent = {(r, shards[rt.hook.index].get(d, d)): n for r, rt in rts.items() for d, n in rt.sent_bytes.items()}
    assert p2p == {ab: pytest.approx(n, rel=1e-12) for ab, n in sent.items()}
    assert gathered == {r: pytest.approx(rt.gathered_bytes, rel=1e-12) for r, rt in rts.items() if rt.gathered_bytes}
    return p2p, rts, topo


@pytest.mark.parametrize("text", [TWO_BY_FOUR, ONE_BY_EIGHT], ids=["two-machines", "one-machine"])
def test_data_parallel_groups_send_the_tied_weight_from_their_own_stage(captured, tmp_path, text):
    """``dp=2,tp=2,pp=2``: GPT-2's tied embedding crosses from stage 0 to stage 1 (and its summed
    gradient back). Each tensor-parallel group of stage 1 gets it from the devices of the same
    ranks of its own data-parallel replica in stage 0 (Megatron-LM's data-parallel pipelines;
    before 2026-11-27 the executor sent it from the first group to both, the simulator from
    each), so every device of stage 0 sends the same bytes forward; the executor's and the
    simulator's bytes agree per device pair, within a machine too (the summed gradient from
    member ``i`` to member ``i``)."""
    p2p, _, topo = _pairs_equal(captured, tmp_path, text, GPT2, Layout(dp=2, tp=2, pp=2, micro=2), 2)
    forward = {a: sum(nb for (x, b), nb in p2p.items() if x == a) for a in range(4)}
    assert len(set(forward.values())) == 1 and forward[0] > 0
    assert {ab for ab in p2p if ab[0] < 4} == {(0, 4), (1, 5), (2, 6), (3, 7)}
    if topo.num_machines == 1:
        assert {ab for ab in p2p if ab[0] >= 4} == {(4, 0), (5, 1), (6, 0), (7, 1), (6, 2), (7, 3)}


def test_padding_where_the_degree_does_not_divide_a_boundary_tensor(captured, tmp_path):
    """``tp=3,pp=2`` between two machines: some scattered boundary tensor's bytes are not a
    multiple of 3; the executor pads its slices with zero bytes and the simulator prices them,
    so the bytes per device pair and all-gathered still agree (and training is exact)."""
    _, rts, _ = _pairs_equal(captured, tmp_path, TWO_BY_THREE, GPT2_3, Layout(tp=3, pp=2, micro=2), 3)
    sizes = [math.prod(shape) * dtype.itemsize for rt in rts.values() for st in rt.schedule.steps
             if st.kind == "transfer" for m in st.moves
             if m.dst == rt.rank != m.src and rt.hook.scattered(m.src, m.dst)
             for shape, dtype in [rt.piece_spec(st, m)]]
    assert sizes and any(n % 3 for n in sizes)


def _machine_rank(rank: int, envs: list[dict[str, str]], args_path: str) -> None:
    """Rank ``rank`` of :func:`_run_machines`: its torchrun environment, then what
    ``python -m tag.executor.worker ARGS.json`` runs."""
    from tag.executor.worker import main

    os.environ.update(envs[rank])
    assert main([args_path]) == 0


def _run_machines(forked, topo, args_path: Path, timeout_s: float) -> None:
    """Run one worker process per device of ``topo`` as its machines would under torchrun (each
    machine's ranks with their local rank and the machine's rank count), all on this host: the
    store they share is a loopback one hosted here, the collectives on the loopback interface
    (nothing listens on another interface). The ranks are forked from the test suite's fork
    server (``forked``: a fresh interpreter per rank imported torch and transformers, ~4 s of
    CPU each); a rank's failure is raised with its traceback."""
    from tag.executor.loopback import LOOPBACK, loopback_env, loopback_store

    store = loopback_store(timeout_s=timeout_s)
    per_machine = [sum(1 for d in topo.devices if topo.machine_of(d.index) == m) for m in range(topo.num_machines)]
    with loopback_env():  # (the fork server keeps the environment it started with: each rank sets its own)
        env = {k: os.environ[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k in os.environ}
    env |= {"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(store.port), "WORLD_SIZE": str(topo.num_devices),
            "TORCHELASTIC_USE_AGENT_STORE": "True"}
    envs = [{**env, "RANK": str(dev.index), "LOCAL_RANK": str(dev.local_index),
             "GROUP_RANK": str(topo.machine_of(dev.index)), "LOCAL_WORLD_SIZE": str(per_machine[topo.machine_of(dev.index)])}
            for dev in topo.devices]
    forked(_machine_rank, (envs, str(args_path)), topo.num_devices)
    del store  # (held open until every rank has left)


@pytest.mark.slow
def test_scatter_gather_across_two_loopback_machines(setup, two, tmp_path, forked):
    """The same plan on 4 gloo processes, two per "machine" (docs/executor.md's torchrun
    recipe, on one host): the parameters after 2 steps equal single-process SGD, every rank
    all-gathered, and the bytes each rank sent across machines are the simulator's."""
    from tag.executor import reference_training
    from tag.executor.worker import WorkerArgs
    from tag.sim import Simulator
    from tag.workloads import load_workload

    graph, topo, plan = setup
    plan.save(tmp_path / "plan.json")
    (tmp_path / "graph.json").write_text(graph.to_json())
    args = WorkerArgs(model=GPT2, batch=8, optimizer="sgd", seed=0, groups=6, topology=two,
                      plan=str(tmp_path / "plan.json"), out_dir=str(tmp_path), steps=2, warmup=0, backend="gloo",
                      timeout_s=60.0, graph=str(tmp_path / "graph.json"), save_params=True)
    (tmp_path / "args.json").write_text(json.dumps(asdict(args)))
    _run_machines(forked, topo, tmp_path / "args.json", timeout_s=240.0)
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    ref, losses = reference_training(load_workload(GPT2, batch=8), "sgd", 2)
    # each stage's full parameters (rank 1 and 3 saved the same)
    assert_params_equal({r: p for r, p in saved_params(tmp_path, 4).items() if r in (0, 2)}, ref)
    assert sum(rk["iterations"][-1]["loss"] for rk in ranks) == pytest.approx(losses[-1], rel=1e-5)
    p2p, gathered = Simulator(graph, topo, CostModel.for_topology(graph, topo)).moved_bytes(
        plan.groups, pipeline=plan.pipeline)
    mo = topo.machine_of
    sent = {(rk["rank"], int(d)): n for rk in ranks for d, n in rk["sent_bytes"].items()}
    assert {ab: nb for ab, nb in p2p.items() if mo(ab[0]) != mo(ab[1])} == \
        {ab: pytest.approx(n, rel=1e-12) for ab, n in sent.items() if mo(ab[0]) != mo(ab[1])}
    assert gathered == {rk["rank"]: pytest.approx(rk["gathered_bytes"], rel=1e-12) for rk in ranks}


def test_the_executable_layout_grid_has_no_sequence_parallelism(captured, two):
    """``tag plan``'s default (executable) layout grid leaves out the sequence-parallel layouts the
    executor refuses; the unconstrained grid has them (the MCTS's ``tp`` actions never set
    ``sequence_parallel``: tests/test_search.py checks its executable plans)."""
    from tag.parallel.layout import search_layouts
    from tag.sim import Simulator

    graph = captured(GPT2, batch=8, groups=6).graph
    topo = load_topology(two)
    sim = Simulator(graph, topo, CostModel.for_topology(graph, topo))
    found = {e: search_layouts(graph, topo, sim.costs, lambda p: sim.run(p.groups, pipeline=p.pipeline), executable=e)
             for e in (True, False)}
    sp = {e: sum(any(gp.sequence_parallel for gp in p.groups) for p, _ in f.ranked) for e, f in found.items()}
    assert sp[True] == 0 < sp[False] and found[True].layouts < found[False].layouts


def test_a_sharded_value_crossing_machines_is_sent_whole_to_its_shard(captured, two):
    """A value the group's devices hold as different shards is not scattered: with fused attention
    the grouping puts GPT-2's layer-1 ``c_attn`` weight (column-split) in the stage before the
    one reading it, so it crosses the machines every step; sliced and all-gathered like a
    replicated tensor it mixed the two shards and trained wrong (c_attn.bias 6% off after 2
    steps); sent whole from device ``i`` to device ``i`` the parameters equal single-process SGD."""
    from tag.executor import reference_training, run_virtual
    from tag.workloads import load_workload

    spec = GPT2 + ",attn=sdpa"
    graph = captured(spec, batch=8, groups=6).graph
    topo = load_topology(two)
    plan = layout_plan(graph, topo, Layout(tp=2, pp=2, micro=2), CostModel.for_topology(graph, topo))
    validate_plan(plan, graph, topo)
    rts = run_virtual(graph, plan, load_workload(spec, batch=8), "sgd", 2, machine_of=topo.machine_of)
    crossing = "p_model_transformer_h_1_attn_c_attn_weight"
    assert all(crossing in rt.hook.sharded for rt in rts.values())
    ref, losses = reference_training(load_workload(spec, batch=8), "sgd", 2)
    _assert_stage_params(rts, ref, graph)
    assert sum(rt.loss for rt in rts.values()) == pytest.approx(losses[-1], rel=1e-5)
