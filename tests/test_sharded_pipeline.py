"""Sharded data parallelism inside pipeline stages (FSDP x PP, as torchtitan composes them) on 4
gloo ranks, 2 stages of 2 shards each (``dp=2,pp=2,micro=2,zero=Z``): ``tag execute`` and
``tag run`` train as one process, and each rank holds the state the simulator prices.

The mlp's ``net.2.bias`` belongs to the second stage's op-group but is read by the first stage's
op: a parameter one stage sends to the other every iteration, which a ZeRO-3 stage must gather
first (:meth:`tag.executor.sharded.ShardedRank.begin_iteration`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tag.cost.model import CostModel
from tag.parallel.layout import layout_plan, parse_layout
from tag.parallel.sharded import offloaded_bytes, sharded_bytes
from tag.sim import Simulator
from tag.sim.program import build_program
from tag.topology import load_topology

pytestmark = pytest.mark.slow


def _topology(tmp_path, count: int = 4) -> str:
    path = tmp_path / f"cpu{count}.yaml"
    path.write_text(f'name: test-cpu{count}\nmachines:\n  - name: local\n    gpu: cpu\n    count: {count}\n'
                    '    intra_bandwidth: "5 GB/s"\n')
    return str(path)


def _predicted_state(graph, topology, plan, bytes_of) -> list[float]:
    """Per device, the sum over its groups of ``bytes_of(S, P_g, O_g)`` (:func:`sharded_bytes`,
    :func:`offloaded_bytes`) of the simulator's own per-group parameter and optimizer-state bytes
    (as :func:`tag.sim.sharded.sharded_layout` reads them)."""
    st = Simulator(graph, topology, CostModel.for_topology(graph, topology)).static
    p = np.asarray(st.grad_bytes, dtype=float)
    o = np.array([float(x.sum()) for x in st.static_pos]) - 2 * p
    return [sum(bytes_of(len(gp.devices), p[g], o[g]) for g, gp in enumerate(plan.groups) if d in gp.devices)
            for d in range(topology.num_devices)]


@pytest.mark.parametrize("layout", [f"dp=2,pp=2,micro=2,zero={z}" for z in (1, 2, 3)] +
                         ["dp=2,pp=2,micro=2,zero=3,offload=optimizer", "dp=2,pp=2,micro=4,vpp=2,zero=3"])
def test_sharded_pipeline_stages_train_as_one_process(tmp_path, captured, layout):
    """2 Adam steps of ZeRO-1/2/3 stages (ZeRO-3 also with the optimizer on the host, and
    interleaved: 2 stage chunks a rank, 4 micro-batches):
    parameters and losses equal single-process training (the executor's tolerance); each rank holds
    its stage's state between iterations as the simulator predicts (within 2%; offloaded: on the
    device and on the host), ZeRO-1 but the all-reduced gradient, freed at the step."""
    from tag.executor import ExecuteConfig, execute, reference_training
    from tag.executor.equality import assert_params_equal, saved_params
    from tag.workloads import load_workload

    graph = captured("mlp", batch=8, groups=4).graph
    topo_path = _topology(tmp_path)
    topo = load_topology(topo_path)
    plan = layout_plan(graph, topo, parse_layout(layout), CostModel.for_topology(graph, topo))
    level, offload = int(plan.groups[0].sync[-1]), plan.groups[0].offload
    assert plan.pipeline is not None and {g.sync for g in plan.groups} == {f"zero{level}"}
    assert {tuple(g.devices) for g in plan.groups} == {(0, 1), (2, 3)}
    plan.save(tmp_path / "plan.json")
    cfg = ExecuteConfig("mlp", topo_path, str(tmp_path / "plan.json"), steps=2, warmup=0, save_params=True,
                        optimizer="adam", run_dir=str(tmp_path / "run"), timeout_s=60.0)
    res = execute(cfg, graph=graph)
    ref, ref_losses = reference_training(load_workload("mlp", batch=8), "adam", 2)
    assert_params_equal(saved_params(tmp_path / "run", 4), ref, {p.name for p in graph.params})
    assert res.losses == pytest.approx(ref_losses, rel=1e-4)
    ranks = json.loads((tmp_path / "run" / "ranks.json").read_text())
    want = _predicted_state(graph, topo, plan, lambda s, p, o: sharded_bytes(level, s, p, o))
    got = [r["held_state_bytes"] + r["optimizer_state_bytes"] for r in ranks]
    assert want[0] != pytest.approx(want[2], rel=0.02)  # (the stages hold different groups)
    if offload:
        for i, key in enumerate(("device_state_bytes", "host_state_bytes")):
            want = _predicted_state(graph, topo, plan, lambda s, p, o, i=i: offloaded_bytes(level, s, p, o)[i])
            assert [r[key] for r in ranks] == pytest.approx(want, rel=0.02)
        return
    if level > 1:  # full parameters (ZeRO-2; the shard the optimizer steps a view of them) or their
        # shard (ZeRO-3), the gradient shard, Adam's moments of the shard
        assert got == pytest.approx(want, rel=0.02)
        return
    # ZeRO-1 holds the gradient's shard between iterations; the simulator holds the all-reduced
    # gradient for the whole iteration (it lives until the step): P - P/S more
    p = [sum(q.nbytes for q in graph.params if q.group in stage) for stage in ((0, 1), (2, 3))]
    assert got == pytest.approx([w - p[d // 2] / 2 for d, w in enumerate(want)], rel=0.02)


@pytest.mark.parametrize("level", [1, 3])
def test_tag_run_trains_sharded_pipeline_stages_as_one_process(tmp_path, level):
    """``tag run`` of a 2-stage pipeline (2 micro-batches) whose stages are ZeRO-``level`` over 2
    ranks each: 6 steps of 2 accumulated batches, clipped at a global norm the gradients exceed,
    a checkpoint every 3 steps, equal single-process eager training (tests/test_train_run.py's
    factory and reference)."""
    from test_train_run import CLIP, Setup, metrics, reference

    from tag.executor.equality import assert_params_equal
    from tag.plan import GroupPlan, PipelinePlan, new_plan

    s = Setup(tmp_path, "make", [0.25] * 4)
    plan = new_plan(s.graph, load_topology(s.topology), [GroupPlan([0, 1], [0.5, 0.5], f"zero{level}"),
                                                         GroupPlan([2, 3], [0.5, 0.5], f"zero{level}")])
    plan.pipeline = PipelinePlan([0, 1], 2, "1f1b", 1)
    plan.save(s.plan)
    run = s.run("whole", steps=6, every=3)
    ref, losses, norms = reference(s.spec, 6)
    assert_params_equal(s.params("whole"), ref, {p.name for p in s.graph.params}, exact=True)
    assert [r["loss"] for r in metrics(run)] == pytest.approx(losses, rel=1e-4)
    assert [r["grad_norm"] for r in metrics(run)] == pytest.approx(norms, rel=1e-4)
    assert sum(n > CLIP for n in norms) >= 3  # (the clipping acted)
    assert run.step == 6 and run.checkpoint.endswith("step-00000006")


TIED_GPT2 = "gpt2:n_layer=1,n_embd=64,n_head=2,seq=16,vocab=512"


@pytest.mark.parametrize("level", [0, 3])
def test_a_tied_embedding_is_held_by_both_stages(tmp_path, captured, level):
    """GPT-2's tied embedding / LM head (one layer) on ``dp=2,pp=2,micro=2,zero=3`` over 4 gloo ranks
    (``level`` 3) and on ``pp=2,micro=2`` over 2 (``level`` 0: no shards, one rank a stage), one
    Adam step: both stages' ranks hold the weight whole (Megatron-LM's first and last
    stages likewise), unsharded with its gradient and Adam's moments, and under ZeRO as ZeRO-1
    over its stage's shard group: Adam's moments of half of it a rank, which is each rank's
    optimizer state as the simulator accounts it (its groups' ``O_g / S`` and the copy's
    ``O / S``); the simulator holds on each rank what it holds (within 2%): its per-group state
    (:func:`sharded_bytes`) and the tied copies' state as the engine adds it (the run less the
    run without tied copies). The executor's held state leaves out the gradients live from the
    backward to the step, which the simulator holds for the iteration: the rank's parameters'
    without sharding, under ZeRO the tied weight's all-reduced gradient less its shard's. The
    memory bound stays below the simulated peak."""
    from tag.executor import ExecuteConfig, execute
    from tag.sim.bounds import static_bound
    from tag.sim.engine import _holdings

    graph = captured(TIED_GPT2, batch=8, groups=4).graph
    dp = 2 if level else 1  # (ranks a stage)
    topo_path = _topology(tmp_path, 2 * dp)
    topo = load_topology(topo_path)
    costs = CostModel.for_topology(graph, topo)
    plan = layout_plan(graph, topo, parse_layout(f"dp={dp},pp=2,micro=2" + (f",zero={level}" if level else "")), costs)
    assert {tuple(g.devices) for g in plan.groups} == {tuple(range(dp)), tuple(range(dp, 2 * dp))}
    plan.save(tmp_path / "plan.json")
    cfg = ExecuteConfig(TIED_GPT2, topo_path, str(tmp_path / "plan.json"), steps=1, warmup=0, optimizer="adam",
                        run_dir=str(tmp_path / "run"), timeout_s=120.0)
    execute(cfg, graph=graph)
    ranks = json.loads((tmp_path / "run" / "ranks.json").read_text())
    (w,) = [p for p in graph.params if p.name == "model.lm_head.weight"]
    got = [r["held_state_bytes"] + r["optimizer_state_bytes"] + (w.nbytes / 2 if level else r["held_state_bytes"])
           for r in ranks]

    sim = Simulator(graph, topo, costs)
    micro, gds = build_program(sim, plan.groups, plan.pipeline), sim.deploy(plan.groups)
    (tw,) = sim.static.tied
    assert micro.tied == {tw.tensor}  # held by both stages, not moved
    tied = [x - y for x, y in zip(_holdings(sim, gds, micro)[1],
                                  _holdings(sim, gds, micro._replace(tied=frozenset(), tied_shards=()))[1])]
    per_group = _predicted_state(graph, topo, plan, lambda s, p, o: sharded_bytes(level, s, p, o) if level
                                 else 2 * p + o)
    copy = sharded_bytes(1, 2, w.nbytes, w.opt_state_bytes) if level else 2 * w.nbytes + w.opt_state_bytes
    # the last stage gains its copy; a sharded first stage what its shard left out
    assert tied == pytest.approx([copy - (sharded_bytes(level, 2, w.nbytes, w.opt_state_bytes) if level else copy)
                                  ] * dp + [copy] * dp)
    assert got == pytest.approx([a + b for a, b in zip(per_group, tied)], rel=0.02)
    assert got[dp] != pytest.approx(per_group[dp], rel=0.02)  # (the copy is no small part of the last stage)
    if level:  # the optimizer state: the groups' shards and the copy's, O / S each
        opt = _predicted_state(graph, topo, plan, lambda s, p, o: o / s)
        want = [o + (w.opt_state_bytes / 2 if d >= 2 else 0.0) for d, o in enumerate(opt)]
        assert [r["optimizer_state_bytes"] for r in ranks] == pytest.approx(want, rel=0.02)
        assert [x - 2 * w.nbytes for x in tied[2:]] == pytest.approx([w.opt_state_bytes / 2] * 2)
    res = sim.run(plan.groups, pipeline=plan.pipeline)
    low = static_bound(sim, plan.groups, plan.pipeline)
    assert all(b <= p for b, p in zip(low.peak_bytes, res.peak_memory_bytes))
