"""ZeRO-3's bf16 weight copies are made per use (:attr:`tag.parallel.Schedule.recast`): a sharded
group casts its gathered parameters at its forward and again at its backward and holds no copy in
between (FSDP2's ``MixedPrecisionPolicy`` frees them with the gathered parameters); replicated
groups keep casting once per iteration (tests/test_param_casts.py). The simulator costs it so
(:mod:`tag.sim.sharded`), the executor runs it so (:func:`tag.executor.fuse.recast_per_use`)."""

from __future__ import annotations

import pytest
import torch
from test_param_casts import LLAMA, ParamCasts

from tag.cost.model import CostModel
from tag.executor import run_virtual
from tag.graph.precision import param_cast_values, param_casts
from tag.plan import GroupPlan, new_plan
from tag.sim import Simulator
from tag.sim.bounds import static_bound
from tag.topology import load_topology
from tag.workloads import load_workload

B = 8


@pytest.fixture(scope="module")
def llama(captured):
    return captured(LLAMA, batch=B, groups=4, precision="bf16").graph


def _plan(graph, topo, sync: str, recompute: bool, n: int = 2):
    return new_plan(graph, topo, [GroupPlan(list(range(n)), [1.0 / n] * n, sync, recompute=recompute)
                                  for _ in range(graph.num_groups)])


def test_the_copies_and_their_transposes_are_the_cast_values(llama):
    """Every cast's value (2 bytes a weight element) and the transposes a matmul's backward reads
    in its place; each group's saved ones weigh what its recomputation holds (one view each)."""
    from tag.sim.static import build_static

    casts = param_casts(llama)
    values = param_cast_values(llama)
    assert set(casts) < set(values)
    assert {llama.ops[i].target for i in values if i not in casts} <= {"aten.t.default", "aten.view.default",
                                                                       "aten.permute.default"}
    st = build_static(llama)
    elements = sum(p.numel for p in llama.params if any(llama.ops[i].inputs[0] == p.tensor for i in casts))
    assert st.rc_casts.sum() == pytest.approx(2.0 * elements)
    assert st.saved_casts == pytest.approx(st.rc_casts)


@pytest.mark.parametrize("recompute", [False, True])
def test_the_simulator_makes_zero3_copies_per_use(llama, recompute):
    """Against ZeRO-2 on the same replicas (full parameters held, copies held for the iteration):
    a ZeRO-3 group holds its parameter shard and no copy (its held bytes less the gathered state
    and the copies); it gathers its cast-only weights in bf16 (2 bytes an element; the norms and
    the embedding table in fp32), whose gathered copies replace their casts (in its working set
    while it runs; their cast seconds become a cast of the shard before each gather), and its
    backward pays the other casts again beside the gather; the static bound stays below the run,
    its memory below the peak."""
    from tag.sim.sharded import low_gathers

    topo = load_topology("topologies/h100-8gpu.yaml")
    costs = CostModel.for_topology(llama, topo)
    sim = Simulator(llama, topo, costs)
    st = sim.static
    z2, z3 = (_plan(llama, topo, s, recompute, 8) for s in ("zero2", "zero3"))
    cast = costs.cast_seconds(0)
    p = st.grad_bytes
    pg, made, share = low_gathers(sim)
    # the 15 projection weights and the head in bf16, the embedding table and the norms in fp32
    fp32 = sum(q.nbytes for q in llama.params if "norm" in q.name or "embed" in q.name)
    assert pg.sum() == pytest.approx(fp32 + (p.sum() - fp32) / 2)
    assert made.sum() == pytest.approx((p.sum() - fp32) / 2)  # (one cast a weight: its bf16 copy)
    copies = st.rc_casts if recompute else st.saved_casts
    for g in range(llama.num_groups):
        l2, l3 = sim.group_data(g, z2.groups[g]).layout, sim.group_data(g, z3.groups[g]).layout
        gather = sim.comm.shard_gather_time(list(range(8)), 8, float(pg[g])) + share[g] * cast[g] / 8
        # (ZeRO-2 gathers its bf16 weights too: it holds its fp32 master shard, p / 8, besides)
        assert l2.mem[g, 0] - l3.mem[g, 0] == pytest.approx(p[g] * 7 / 8 + p[g] / 8 + copies[g])
        neighbour = max(pg[g - 1] if g else 0.0, pg[g + 1] if g + 1 < len(pg) else 0.0)
        # ZeRO-2's transient: the unsharded gradient; ZeRO-3's: that, the gathered parameters (bf16
        # where cast-only), the neighbour's prefetched ones and the casts the gathers do not replace
        assert l3.work[g, 0] - l2.work[g, 0] == pytest.approx(pg[g] + neighbour + st.rc_casts[g] - made[g])
        assert pg[g] < p[g] and share[g] > 0
        back = l3.dur[1, g, 0] - l2.dur[1, g, 0]
        other = cast[g] * (1 - share[g])  # (the casts of weights read in fp32 too: none here)
        assert other * (1 - 1e-9) <= back <= other + gather + 1e-12
        fwd = l3.dur[0, g, 0] - l2.dur[0, g, 0]
        assert -share[g] * cast[g] * (1 + 1e-9) <= fwd <= -share[g] * cast[g] + gather + 1e-12
        # a pipeline's later micro-batches: ZeRO-2 reuses its copies, ZeRO-3 gathers again
        assert sim.warm_layout(l3) is l3 and sim.warm_layout(l2).dur[0, g, 0] == pytest.approx(l2.dur[0, g, 0] - cast[g])
    res = sim.run(z3.groups)
    bound = static_bound(sim, z3.groups)
    assert bound.time_s <= res.iteration_time_s and max(bound.peak_bytes) <= max(res.peak_memory_bytes)


def test_the_executor_casts_zero3_weights_at_each_use(llama, topo4):
    """In-process (the shards' hook inactive: plain data parallelism on the same stages): a ZeRO-3
    plan casts each weight at its forward and again at its backward (2 x 15 casts a replica an
    iteration, with and without recomputation), a ZeRO-2 plan once (its copies held); all three
    train to the same parameters, to the bit."""
    n = len(param_casts(llama))
    wl = load_workload(LLAMA, batch=B)
    joints: dict = {}
    run_virtual(llama, _plan(llama, topo4, "zero2", False), wl, "adam", 1, joints=joints)
    params = {}
    for sync, recompute, per_iteration in (("zero2", False, n), ("zero3", False, 2 * n), ("zero3", True, 2 * n)):
        counter = ParamCasts()
        with counter:
            rts = run_virtual(llama, _plan(llama, topo4, sync, recompute), wl, "adam", 2, joints=joints)
        assert counter.count == 2 * 2 * per_iteration, (sync, recompute)  # 2 replicas, 2 iterations
        params[(sync, recompute)] = rts[0].named_params()
        # what crosses from a unit's forward to its backward: ZeRO-2 its copies (or their
        # transposes), ZeRO-3 none of them
        s, stages = rts[0].schedule, rts[0].stages
        values = {llama.ops[i].name for i in param_cast_values(llama)}
        crossing = {n for (unit, phase), st in stages.items() if phase == "bwd" for n in st.inputs if n in values}
        assert bool(crossing) == (sync == "zero2") and not (sync == "zero3" and s.casts), (sync, recompute)
    ref = params[("zero2", False)]
    for key, got in params.items():
        assert all(torch.equal(got[k], ref[k]) for k in ref), key


@pytest.mark.slow
def test_zero3_bf16_on_gloo_trains_as_one_process(tmp_path, captured):
    """2 gloo ranks, ZeRO-3 in bf16 on the mlp (the shards gathered before each forward and
    backward, the copies made from them each time): the parameters after 2 Adam steps are within
    bf16's rounding of single-process autocast training (tests/test_param_casts.py's tolerance);
    each rank holds its parameter, gradient and optimizer-state shards as the simulator's sharded
    bytes."""
    import json

    from tag.executor import ExecuteConfig, execute, reference_training
    from tag.executor.equality import saved_params
    from tag.parallel.sharded import sharded_bytes

    graph = captured("mlp", batch=B, groups=4, precision="bf16").graph
    assert any(u for u in _schedule_recast(graph))  # (the mlp's weights are cast: per use here)
    topo = tmp_path / "cpu2.yaml"
    topo.write_text('name: test-cpu2\nmachines:\n  - name: local\n    gpu: cpu\n    count: 2\n'
                    '    intra_bandwidth: "5 GB/s"\n')
    plan = _plan(graph, load_topology(str(topo)), "zero3", False)
    plan.save(tmp_path / "plan.json")
    cfg = ExecuteConfig("mlp", str(topo), str(tmp_path / "plan.json"), batch=B, groups=4, steps=2, warmup=0,
                        save_params=True, precision="bf16", run_dir=str(tmp_path / "run"), timeout_s=120.0,
                        bucket_bytes=4096)
    execute(cfg, graph=graph)
    ref, _ = reference_training(load_workload("mlp", batch=B), "adam", 2, precision="bf16")
    for rank, params in saved_params(tmp_path / "run", 2).items():
        assert set(params) == set(ref), rank
        for k, v in params.items():
            torch.testing.assert_close(v, ref[k], rtol=0, atol=5e-3)
    p = sum(q.nbytes for q in graph.params)
    for r in json.loads((tmp_path / "run" / "ranks.json").read_text()):
        assert r["held_state_bytes"] + r["optimizer_state_bytes"] == pytest.approx(sharded_bytes(3, 2, p, 2 * p),
                                                                                   rel=0.05)


def _schedule_recast(graph) -> list:
    """The units of a 2-device ZeRO-3 plan's schedule that cast per use."""
    from tag.parallel.schedule import build_schedule

    plan = _plan(graph, load_topology("topologies/local-cpu4.yaml"), "zero3", False)
    return list(build_schedule(graph, plan).recast)


@pytest.mark.slow
def test_zero3_gathers_cast_only_weights_in_bf16_on_gloo(tmp_path, captured):
    """2 gloo ranks, the small llama in bf16 (buckets holding projections and norms): ZeRO-3
    gathers the projection weights in bf16 and the norms and the embedding table in fp32 (one
    byte all-gather a bucket) before use, ZeRO-1 and ZeRO-2 so after the step (the fp32 master
    shard stepped, the full fp32 parameters holding the gathered values; offloaded, the master shard
    on the host and the device holding the parameters alone); what each gather returns
    is the simulator's gathered bytes (padding aside), and all train to the same parameters
    (saved from the master shards), to the bit: the graph reads those weights only through their
    bf16 casts."""
    import json

    from tag.executor import ExecuteConfig, execute
    from tag.executor.equality import saved_params
    from tag.parallel.sharded import sharded_bytes
    from tag.sim.sharded import low_gathers

    graph = captured(LLAMA, batch=B, groups=4, precision="bf16").graph
    topo = tmp_path / "cpu2.yaml"
    topo.write_text('name: test-cpu2\nmachines:\n  - name: local\n    gpu: cpu\n    count: 2\n'
                    '    intra_bandwidth: "5 GB/s"\n')
    got, ranks = {}, {}
    for sync in ("zero1", "zero2", "zero3", "zero2+offload"):
        plan = _plan(graph, load_topology(str(topo)), sync.split("+")[0], False)
        for gp in plan.groups:
            gp.offload = "optimizer" if sync.endswith("offload") else None
        plan.save(tmp_path / f"{sync}.json")
        run = tmp_path / sync
        cfg = ExecuteConfig(LLAMA, str(topo), str(tmp_path / f"{sync}.json"), batch=B, groups=4, steps=2, warmup=0,
                            save_params=True, precision="bf16", run_dir=str(run), timeout_s=120.0, bucket_bytes=8192)
        execute(cfg, graph=graph)
        got[sync] = saved_params(run, 2)[0]
        ranks[sync] = json.loads((run / "ranks.json").read_text())
    sim = Simulator(graph, load_topology(str(topo)))
    pg = low_gathers(sim)[0]
    p = sum(q.nbytes for q in graph.params)
    # ZeRO-2's held state as the simulator counts it: the sharded bytes and, where a group gathers
    # in bf16, its fp32 master shard besides the full parameters
    pgr = sim.static.grad_bytes
    held = sum(sharded_bytes(2, 2, x, 2 * x) + (x / 2 if y < x else 0.0) for x, y in zip(pgr, pg))
    for r in ranks["zero2"]:
        assert r["held_state_bytes"] + r["optimizer_state_bytes"] == pytest.approx(held, rel=0.05)
    for r in ranks["zero2+offload"]:  # (the master shard on the host, copied to the device for the gather only)
        assert r["device_state_bytes"] == pytest.approx(p, rel=0.02)
    for sync, key in (("zero1", "step_gather_bytes"), ("zero2", "step_gather_bytes"), ("zero3", "zero3_gather_bytes"),
                      ("zero2+offload", "step_gather_bytes")):
        for r in ranks[sync]:
            assert r[key] == pytest.approx(pg.sum(), rel=0.02), sync
            assert r[key] < 0.6 * p
    for sync in ("zero1", "zero2", "zero2+offload"):
        assert set(got["zero3"]) == set(got[sync])
        assert all(torch.equal(got["zero3"][k], got[sync][k]) for k in got[sync]), sync
