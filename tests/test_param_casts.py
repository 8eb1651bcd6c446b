"""bf16 / fp16 weight casts once per iteration (:func:`tag.graph.precision.param_casts`): the
executor casts each fp32 weight at its unit's first forward and every later micro-batch and the
recomputation read that copy (:func:`tag.executor.fuse.share_param_casts`); the simulator charges
the casts' seconds once per stage and iteration (:attr:`tag.cost.model.DeviceCost.cast`) and holds
a recomputed group's copies until its backward."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tag.cost.model import CostModel
from tag.executor import reference_training, run_virtual
from tag.graph.precision import param_casts
from tag.plan import GroupPlan, PipelinePlan, new_plan
from tag.sim import Simulator
from tag.sim.bounds import static_bound
from tag.topology import load_topology
from tag.workloads import load_workload

LLAMA = "llama:n_layer=2,n_embd=32,n_head=4,n_kv_head=2,ffn=48,seq=16,vocab=64"
B, M = 8, 4


def pipeline(graph, topo, micro: int, recompute: bool):
    """Groups 0-1 on device 0, 2-3 on device 1, 1F1B over ``micro`` micro-batches."""
    st = [GroupPlan([d], [1.0], recompute=recompute) for d in (0, 1)]
    plan = new_plan(graph, topo, [st[0], st[0], st[1], st[1]])
    plan.pipeline = PipelinePlan([0, 2], micro, "1f1b", 1)
    return plan


class ParamCasts(TorchDispatchMode):
    """Counts the dtype casts (``aten._to_copy``) whose input is a parameter, as they run."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.nn.Parameter):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_executor_casts_each_weight_once_per_iteration(captured, topo4):
    """2 stages, 4 micro-batches, 2 Adam steps in bf16: the runs cast each of the graph's 15
    weights once per iteration (each rank its own: 30 casts; per micro-batch they were 120, and
    240 with recomputation), with and without recomputation, whose parameters are equal to the
    bit (a cast is deterministic); and within bf16's rounding of single-process autocast training
    (tolerance: tests/test_gpu_cost.py's bf16 data-parallel test)."""
    graph = captured(LLAMA, batch=B, groups=4, precision="bf16").graph
    n = len(param_casts(graph))
    assert n == 15  # 2 layers x 7 projections + the LM head
    joints: dict = {}
    run_virtual(graph, pipeline(graph, topo4, M, False), load_workload(LLAMA, batch=B), "adam", 1, joints=joints)
    params = []
    for recompute in (False, True):
        counter = ParamCasts()
        with counter:  # (the joint graphs are exported already)
            rts = run_virtual(graph, pipeline(graph, topo4, M, recompute), load_workload(LLAMA, batch=B), "adam", 2,
                              joints=joints)
        assert counter.count == 2 * n, recompute
        params.append({k: v for rt in rts.values() for k, v in rt.named_params().items()})
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    ref, losses = reference_training(load_workload(LLAMA, batch=B), "adam", 2, precision="bf16")
    for k, v in params[1].items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=5e-3)


@pytest.fixture(scope="module")
def gpu_case(captured):
    """The GPU rule's costs with no host held apart (each stage its eager seconds, host launches
    included, as ``table`` says): the stages' simulated seconds are the table's."""
    graph = captured(LLAMA, batch=B, groups=4, precision="bf16").graph
    topo = load_topology("topologies/h100-8gpu.yaml")
    costs = CostModel.for_topology(graph, topo)
    return graph, topo, CostModel(graph, topo, [replace(dc, parts=None) for dc in costs._dev], costs.comm)


@pytest.mark.parametrize("recompute", [False, True])
def test_the_simulator_charges_the_casts_once_per_stage_and_iteration(gpu_case, recompute):
    """The GPU rule's cast seconds of a group are its cast ops' seconds (positive, within its
    forward); a stage's simulated forward compute over M micro-batches is every micro-batch's
    forward less the casts at all but the first, its backward under recomputation the backward
    plus the forward less the casts at every micro-batch; the static bound stays below the run."""
    graph, topo, costs = gpu_case
    cast = costs.cast_seconds(0)
    tab = costs.table(0)
    assert (cast > 0).all() and (cast <= tab[:, 0, 1:].min(axis=1)).all()
    sim = Simulator(graph, topo, costs)
    for micro in (2, M):
        plan = pipeline(graph, topo, micro, recompute)
        res = sim.run(plan.groups, pipeline=plan.pipeline, trace=True)
        b = B // micro
        for d, gs in ((0, [0, 1]), (1, [2, 3])):
            fwd = sum(e.end - e.start for e in res.events if e.device == d and e.cat == "fwd")
            bwd = sum(e.end - e.start for e in res.events if e.device == d and e.cat == "bwd")
            f, c, bk = tab[gs, 0, b].sum(), cast[gs].sum(), tab[gs, 1, b].sum()
            assert fwd == pytest.approx(micro * f - (micro - 1) * c, rel=1e-9)
            assert bwd == pytest.approx(micro * (bk + (f - c if recompute else 0.0)), rel=1e-9)
        assert static_bound(sim, plan.groups, plan.pipeline).time_s <= res.iteration_time_s


def test_a_recomputed_group_holds_its_weight_copies(gpu_case):
    """Under recomputation a group holds its forward's bf16 weight copies until its backward (2
    bytes a weight element), not re-made (transient) at its backward."""
    graph, _, _ = gpu_case
    sim = Simulator(graph, load_topology("topologies/h100-8gpu.yaml"), CostModel.for_topology(
        graph, load_topology("topologies/h100-8gpu.yaml")))
    st = sim.static
    for g in range(graph.num_groups):
        mine = {graph.ops[i].outputs[0] for i in param_casts(graph) if graph.ops[i].group == g}
        elements = sum(p.numel for p in graph.params
                       if any(graph.ops[i].inputs[0] == p.tensor and graph.ops[i].group == g for i in param_casts(graph)))
        held, _, transient, _ = st.recompute_bytes(g, st.lo[g], st.hi[g], only=mine)
        assert (held, transient) == (2.0 * elements, 0.0)
    assert np.all(st.rc_fixed > 0)
