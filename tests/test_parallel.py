"""The parallelism layer: the strategy registry, plan validation by strategy, the shared move
rules, and new strategies dropping in (a module plus registrations) with the simulator and the
executor untouched: one that only lowers, one with its own simulator costing and execution."""

from __future__ import annotations

import random
import re

import pytest
from test_executor import MLP, B, assert_matches_reference
from test_sim_reference import BATCH, GROUPS, SPEC, _random_group, setup

from tag.cost.baselines import data_parallel
from tag.errors import PlanError
from tag.executor import Execution, RankHook, register_execution, run_virtual, unregister_execution
from tag.executor.equality import assert_params_equal
from tag.executor.virtual import reference_training
from tag.parallel import (
    Collective,
    Replica,
    Strategy,
    Unit,
    build_schedule,
    get_strategy,
    move_pieces,
    register,
    strategy_names,
    unregister,
    validate_group,
    validate_plan,
)
from tag.parallel.data_parallel import DataParallel
from tag.plan import GroupPlan, new_plan
from tag.search import ActionSpace
from tag.search.space import device_subsets
from tag.sim import Simulator, register_costing, unregister_costing
from tag.sim import units as sim_units
from tag.workloads import load_workload


class FirstReplicaServer(DataParallel):
    """A strategy written as a user would: data parallel whose gradients are reduced to the
    first replica and broadcast back (a parameter server chosen by rule, so no ``server``)."""

    name = "ps-first"
    collective_op = "ps"

    def server(self, gp):
        return gp.devices[0]


class Mirror(Strategy):
    """A strategy with a simulator costing and an execution of its own, written as a user would:
    every device of the group runs the whole group on the whole batch (hot standbys). Its
    lowering, the schedule every rank walks, is the first device's alone; the other devices
    replay that device's schedule (:class:`MirrorExecution`), and its costing gives each device
    the first one's compute and memory (:func:`mirror_costing`)."""

    name = "mirror"

    def validate(self, gp, graph, g, num_devices, batch_size, where):
        if any(s != 1.0 for s in gp.shares):
            raise PlanError(f"{where}.shares: every mirror runs the full batch; expected all 1.0")

    def units(self, g, gp, graph, batch_size):
        return [Unit((g, 0), gp.sync, [Replica(gp.devices[0], 0, batch_size)])]

    def search_plan(self, space, g, devices, option):
        """The search's action over ``devices``: a mirror on each (default options: one action per
        subset of two devices or more, after the built-in ones)."""
        return GroupPlan(list(devices), [1.0] * len(devices), self.name)

    def execution_refusal(self, plan):
        first = plan.groups[0]
        for g, gp in enumerate(plan.groups):
            if gp.sync != self.name or gp.devices != first.devices:
                return f"groups[{g}]: mirrors run whole plans; expected sync 'mirror' over {first.devices}"
        return None


COSTED: list[int] = []  # groups mirror_costing costed
STAGES: list[tuple] = []  # (member index, stage key) of the stages MirrorHook saw


def mirror_costing(sim, g, gp, units):
    """Every device computes the group at the first one's batch; no gradient sync."""
    COSTED.append(g)
    devs = tuple(gp.devices)
    batches = (units[0].replicas[0].batch,) * len(devs)
    lay = sim.layout(devs, batches)
    return sim_units.GroupData([sim_units.Unit(g, -1, devs, batches, lay.starts, lay)], "none", 0.0, (), (), 0.0,
                               layout=lay, unit_key=("mirror", devs, batches))


class MirrorHook(RankHook):
    def stage(self, stage):
        STAGES.append((self.index, stage.key))


class MirrorExecution(Execution):
    """The plan's own schedule (the first device's), walked by every device of the mirrors."""

    def __init__(self, plan, graph):
        super().__init__(plan, [list(plan.groups[0].devices)])

    def hook(self, rank):
        devs = self.group_of(rank)
        return MirrorHook(devs.index(rank)) if devs else None


@pytest.fixture()
def mirror():
    s = register(Mirror())
    register_costing(s.name, mirror_costing)
    register_execution(s.name, MirrorExecution)
    COSTED.clear()
    STAGES.clear()
    yield s
    unregister(s.name)
    unregister_costing(s.name)
    unregister_execution(s.name)


@pytest.fixture(scope="module")
def mlp(captured):
    return captured(MLP, batch=B, groups=4).graph


@pytest.fixture()
def ps_first():
    s = register(FirstReplicaServer())
    yield s
    unregister(s.name)


def test_registry():
    assert strategy_names()[:3] == ("allreduce", "ps", "mp")
    with pytest.raises(PlanError, match=r"^groups\[2\]\.sync: expected one of \['allreduce', 'ps', 'mp'"):
        get_strategy("gossip", where="groups[2].sync")


def test_validation_is_the_strategys(mlp, topo4):
    plan = data_parallel(mlp, topo4)
    plan.groups[1] = GroupPlan(["0"], [1.0])
    with pytest.raises(PlanError, match=r"^p: groups\[1\]\.devices: expected integer device indices, got '0'$"):
        validate_plan(plan, mlp, topo4, source="p")
    plan.groups[1] = GroupPlan([0, 1], [0.5, 0.5], "ps")
    with pytest.raises(PlanError, match=r"groups\[1\]\.server: expected a device index in 0\.\.3 for sync 'ps'"):
        validate_plan(plan, mlp, topo4)
    plan.groups[1] = GroupPlan([0, 1], [0.5, 0.5], "allreduce", server=1)
    with pytest.raises(PlanError, match=r"groups\[1\]\.server: only allowed with sync 'ps'"):
        validate_plan(plan, mlp, topo4)
    with pytest.raises(PlanError, match=r"^g\.devices: 4 replicas but batch 3; every replica needs"):
        validate_group(GroupPlan(list(range(4)), [0.25] * 4), mlp, 0, 4, "g", batch_size=3)


def test_move_pieces():
    src = Unit((0, 0), "allreduce", [Replica(0, 0, 3), Replica(1, 3, 8)])
    dst = Unit((1, 0), "allreduce", [Replica(2, 0, 4), Replica(1, 4, 8)])
    same = {0: 0, 1: 0, 2: 0}.__getitem__
    assert move_pieces("rows", src, dst, same) == [(0, 0, "rows", 0, 3), (1, 0, "rows", 3, 4),
                                                   (1, 1, "rows", 4, 8)]
    assert move_pieces("copy", src, dst, same) == [(0, 0, "copy", 0, 0), (1, 1, "copy", 0, 0)]
    # device 0 holds no consumer replica: both partials go to the consumer's first replica
    assert move_pieces("sum", src, dst, same) == [(0, 0, "sum", 0, 0), (1, 0, "sum", 0, 0), (-1, 1, "zeros", 0, 0)]
    both = Unit((1, 0), "allreduce", [Replica(1, 0, 4), Replica(0, 4, 8), Replica(3, 8, 8)])
    assert move_pieces("sum", src, both, same) == [(0, 1, "sum", 0, 0), (1, 0, "sum", 0, 0), (-1, 2, "zeros", 0, 0)]


def test_move_pieces_with_holder_sets():
    """Replicas holding the same samples (a tensor-parallel unit's devices): a tensor leaving them
    moves once per consumer replica, from the holder on its device, else its aligned one (same
    rank) or one on its machine, else the aligned one; one entering them reaches each, from
    another machine 1/size to each device (``shard``); their equal partial sums count once."""
    machine = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}.__getitem__
    tp = Unit((0, 0), "tp", [Replica(0, 0, 4), Replica(1, 0, 4), Replica(2, 4, 8), Replica(3, 4, 8)])
    dp = Unit((1, 0), "allreduce", [Replica(1, 0, 2), Replica(4, 2, 6), Replica(3, 6, 8)])
    # leaving: device 1 holds rows 0-4 itself, device 4 (no holder on its machine) gets them from
    # each set's (1 mod 2)-th holder (replica 1: its consumer index)
    assert move_pieces("rows", tp, dp, machine) == [(1, 0, "rows", 0, 2), (1, 1, "rows", 2, 4),
                                                    (3, 1, "rows", 4, 6), (3, 2, "rows", 6, 8)]
    # tensor parallel on other machines: device k of a group from device k of the producer's
    far_tp = Unit((1, 0), "tp", [Replica(5, 0, 4), Replica(6, 0, 4), Replica(7, 4, 8), Replica(8, 4, 8)])
    farm = {0: 0, 1: 0, 2: 1, 3: 1, 5: 2, 6: 2, 7: 3, 8: 3}.__getitem__
    assert move_pieces("rows", tp, far_tp, farm) == [(0, 0, "shard", 0, 4), (1, 1, "shard", 0, 4),
                                                     (2, 2, "shard", 4, 8), (3, 3, "shard", 4, 8)]
    # ... and on the same machines, the whole rows from the same rank
    near = {0: 0, 1: 0, 2: 1, 3: 1, 5: 0, 6: 0, 7: 1, 8: 1}.__getitem__
    assert move_pieces("rows", tp, far_tp, near) == [(0, 0, "rows", 0, 4), (1, 1, "rows", 0, 4),
                                                     (2, 2, "rows", 4, 8), (3, 3, "rows", 4, 8)]
    # entering: both devices of a tensor-parallel group receive what they compute on; from
    # another machine (device 4's rows) half each, the pair all-gathering the rest
    assert move_pieces("rows", dp, tp, machine) == [(0, 0, "rows", 0, 2), (0, 1, "rows", 0, 2),
                                                    (1, 0, "shard", 2, 4), (1, 1, "shard", 2, 4),
                                                    (1, 2, "shard", 4, 6), (1, 3, "shard", 4, 6),
                                                    (2, 2, "rows", 6, 8), (2, 3, "rows", 6, 8)]
    # the same tensor-parallel groups on both sides: every piece stays on its device
    assert [(i, j) for i, j, *_ in move_pieces("rows", tp, tp, machine)] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    # a copy: from any holder (each computed it), aligned as rows; device 4 from replica 1 mod 4
    assert move_pieces("copy", tp, dp, machine) == [(1, 0, "copy", 0, 0), (1, 1, "copy", 0, 0),
                                                    (3, 2, "copy", 0, 0)]
    assert move_pieces("copy", tp, far_tp, farm) == [(i, i, "shard", 0, 0) for i in range(4)]
    # one partial per holder set: from its holder on a consumer device, staying there
    assert move_pieces("sum", tp, dp, machine) == [(1, 0, "sum", 0, 0), (3, 2, "sum", 0, 0), (-1, 1, "zeros", 0, 0)]
    # a set without a holder on a consumer device: every partial goes to the first replica
    far = Unit((1, 0), "allreduce", [Replica(4, 0, 4), Replica(0, 4, 8)])
    assert move_pieces("sum", tp, far, machine) == [(0, 0, "sum", 0, 0), (2, 0, "sum", 0, 0), (-1, 1, "zeros", 0, 0)]
    # a tensor-parallel consumer: each device of the receiving holder set syncs its own copy
    assert move_pieces("sum", tp, tp, machine) == [(0, 0, "sum", 0, 0), (1, 1, "sum", 0, 0),
                                                   (2, 2, "sum", 0, 0), (3, 3, "sum", 0, 0)]
    # ... and a partial from another machine scattered over the set (half to each, all-gathered
    # there: Megatron-LM's scatter-gather, as the executor sends it since 1805f97)
    assert move_pieces("sum", dp, tp, machine) == [(0, 0, "sum", 0, 0), (0, 1, "sum", 0, 0),
                                                   (1, 0, "shard", 0, 0), (1, 1, "shard", 0, 0),
                                                   (2, 0, "shard", 0, 0), (2, 1, "shard", 0, 0),
                                                   (-1, 2, "zeros", 0, 0), (-1, 3, "zeros", 0, 0)]


def test_a_new_strategy_drops_in(ps_first, mlp, topo4):
    """Registered in this test only: the simulator costs it and the executor runs it exactly like
    the equivalent built-in plan (PS on the first replica), and training equals single-process."""
    k = mlp.num_groups
    mine = new_plan(mlp, topo4, [GroupPlan([1, 2, 3], [0.25, 0.25, 0.5], "ps-first") for _ in range(k)])
    ref = new_plan(mlp, topo4, [GroupPlan([1, 2, 3], [0.25, 0.25, 0.5], "ps", server=1) for _ in range(k)])
    validate_plan(mine, mlp, topo4)
    sim = Simulator(mlp, topo4)
    a, b = sim.run(mine.groups), sim.run(ref.groups)
    assert a.iteration_time_s == b.iteration_time_s > 0 and a.peak_memory_bytes == b.peak_memory_bytes
    s1, s2 = build_schedule(mlp, mine), build_schedule(mlp, ref)
    assert [(s.kind, s.unit, s.phase, s.moves, s.collective) for s in s1.steps] == \
           [(s.kind, s.unit, s.phase, s.moves, s.collective) for s in s2.steps]
    assert any(s.collective == Collective("ps", (1, 2, 3), 1) for s in s1.steps)
    assert [s.kind for s in s1.steps_of(0)] == []  # device 0 takes no part
    assert_matches_reference(mlp, mine, MLP, "adam", {})


def test_a_strategy_with_its_own_costing_and_execution_drops_in(mirror, mlp, topo4):
    """Registered in this test only, through the simulator's and the executor's extension points
    (tag.sim.strategies, tag.executor.strategies): the simulator costs every mirror as the single
    device (its costing; the lowering alone would cost the first device only), and the executor
    runs every mirror, each training equal to single-process training, the loss reported once."""
    k = mlp.num_groups
    plan = new_plan(mlp, topo4, [GroupPlan([1, 2], [1.0, 1.0], "mirror") for _ in range(k)])
    validate_plan(plan, mlp, topo4)  # what the executor accepts
    single = new_plan(mlp, topo4, [GroupPlan([1], [1.0]) for _ in range(k)])
    a, b = Simulator(mlp, topo4).run(plan.groups), Simulator(mlp, topo4).run(single.groups)
    assert sorted(set(COSTED)) == list(range(k))
    assert a.iteration_time_s == b.iteration_time_s > 0
    assert a.peak_memory_bytes[2] == a.peak_memory_bytes[1] == b.peak_memory_bytes[1] > 0
    assert a.peak_memory_bytes[0] == a.peak_memory_bytes[3] == 0
    unregister_costing("mirror")  # the lowering's costing: the first device only
    c = Simulator(mlp, topo4).run(plan.groups)
    assert c.peak_memory_bytes[2] == 0 and c.peak_memory_bytes[1] == b.peak_memory_bytes[1]
    mixed = new_plan(mlp, topo4, [GroupPlan([1, 2], [1.0, 1.0], "mirror")] + single.groups[1:])
    with pytest.raises(PlanError, match=r"groups\[1\]: mirrors run whole plans"):
        validate_plan(mixed, mlp, topo4)

    steps = 2
    rts = run_virtual(mlp, plan, load_workload(MLP, batch=B), "adam", steps)
    assert sorted(rts) == [1, 2] and [rt.rank for rt in rts.values()] == [1, 1]
    assert {i for i, _ in STAGES} == {0, 1} and len(STAGES) == 2 * len({n for _, n in STAGES})
    ref, losses = reference_training(load_workload(MLP, batch=B), "adam", steps)
    for rank, rt in rts.items():
        assert_params_equal({rank: rt.named_params()}, ref, {p.name for p in mlp.params}, exact=True)
    assert rts[1].loss == pytest.approx(losses[-1], rel=1e-5) and rts[2].loss == 0.0


def test_steps_of_a_device_follow_the_global_order(mlp, topo4):
    # (group 0 of the mlp owns no parameter)
    plan = new_plan(mlp, topo4, [GroupPlan([2], [1.0]), GroupPlan([0, 1], [0.5, 0.5], "allreduce"),
                                 GroupPlan([2, 3], [0.5, 0.5], "ps", server=0), GroupPlan([1], [1.0])])
    sched = build_schedule(mlp, plan)
    for d in range(4):
        mine = sched.steps_of(d)
        idx = [sched.steps.index(s) for s in mine]
        assert idx == sorted(idx) and mine
        assert {s.stream for s in mine} <= {"compute", "p2p", "collective", "gather"}
    assert [s.group for s in sched.steps_of(0) if s.kind == "sync"] == [2, 1]  # server of group 2


def test_the_simulator_runs_stages_in_the_schedules_order(captured):
    """On every device, the simulated compute stages (trace) come in the order of the device's
    compute steps in the executor's schedule."""
    graph = captured(SPEC, batch=BATCH, groups=GROUPS).graph
    topo, costs = setup(graph)
    sim = Simulator(graph, topo, costs)
    rng = random.Random(11)
    stage = re.compile(r"^(fwd|bwd) g(\d+)(?:\.(\d+))? @d(\d+)$")
    checked = 0
    for _ in range(6):
        groups = [_random_group(rng, graph, g, topo.num_devices) for g in range(GROUPS)]
        sched = build_schedule(graph, new_plan(graph, topo, groups), topo.machine_of)
        events = sim.run(groups, trace=True).events
        for d in range(topo.num_devices):
            order = [(s.phase, s.unit) for s in sched.steps_of(d) if s.kind == "compute"]
            seen = []
            for e in sorted((e for e in events if e.device == d and e.cat in ("fwd", "bwd")), key=lambda e: e.start):
                m = stage.match(e.name)
                assert m, e.name
                seen.append(order.index((m[1], (int(m[2]), int(m[3] or 0)))))
            assert seen == sorted(seen) and len(set(seen)) == len(seen), (d, seen)
            checked += len(seen)
    assert checked > 50


def test_gradient_buckets_are_ddps():
    """Syncs in readiness order fill a bucket per collective key until it holds at least its cap
    (DDP's: 1 MiB for the first bucket, 25 MiB after); a key's last sync closes its bucket; the
    buckets come in launch order (their last sync's)."""
    from tag.parallel.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, assign_buckets, bucket_caps

    mib = 2**20
    assert (FIRST_BUCKET_BYTES, BUCKET_BYTES) == (mib, 25 * mib) == bucket_caps()
    syncs = [("a", 0.6 * mib), ("a", 0.6 * mib), ("a", 10 * mib), ("b", 5), ("a", 20 * mib), ("a", 1)]
    assert assign_buckets(syncs) == [[0, 1], [3], [2, 4], [5]]
    # an explicit cap holds for the first bucket too (as DDP's bucket_cap_mb)
    assert assign_buckets(syncs, 11 * mib) == [[0, 1, 2], [3], [4], [5]]
    assert assign_buckets(syncs, 1) == [[0], [1], [2], [3], [4], [5]]
    assert assign_buckets([]) == []
    with pytest.raises(ValueError, match="bucket_bytes: 0"):
        bucket_caps(0)


def test_a_registered_strategy_is_offered_by_the_search(mirror, mlp, topo4):
    """Registered from this test, with tag.search untouched: the action space offers one mirror
    action per subset of two devices or more, after every built-in action (whose indices do not
    move), each deploying the strategy's GroupPlan (Mirror.search_plan), valid, its own
    deployment class (no built-in action deploys a group alike), and simulated through the
    strategy's costing."""
    unregister(mirror.name)
    old = ActionSpace(mlp, topo4)
    register(mirror)
    sp = ActionSpace(mlp, topo4)
    assert sp.actions[:old.num_actions] == old.actions and sp.num_base_actions == old.num_base_actions
    new = sp.actions[old.num_actions:]
    subsets = [devs for devs, _ in device_subsets(topo4, sp.costs.device_speed) if len(devs) > 1]
    assert subsets and [a.devices for a in new] == subsets and {a.sync for a in new} == {"mirror"}
    k = mlp.num_groups
    for a in range(old.num_actions, sp.num_actions):
        devs = list(sp.actions[a].devices)
        for g in range(k):
            gp = sp.group_plan(g, a)
            assert (gp.devices, gp.shares, gp.sync) == (devs, [1.0] * len(devs), "mirror")
            validate_group(gp, mlp, g, topo4.num_devices, f"groups[{g}]")
        assert (sp.group_canonical[:, a] == a).all()
        key = sp.resolve([a] + [-1] * (k - 1))  # one decision: every group follows it
        assert key == (a,) * k
        plan = new_plan(mlp, topo4, sp.group_plans(key))
        validate_plan(plan, mlp, topo4)
        COSTED.clear()
        r = Simulator(mlp, topo4).run(plan.groups)
        single = Simulator(mlp, topo4).run([GroupPlan(devs[:1], [1.0]) for _ in range(k)])
        assert sorted(set(COSTED)) == list(range(k)) and r.iteration_time_s == single.iteration_time_s > 0


def test_a_registered_subclass_of_a_built_in_strategy_goes_after_the_built_ins(mlp, topo4):
    """FirstReplicaServer inherits data parallel's search actions (one on every subset, a single
    device included) but not its place among them: its actions follow every built-in one, and
    each is the same deployment as the all-reduce over its subset exactly where normalisation
    says so (one replica, or a group without parameters)."""
    old = ActionSpace(mlp, topo4)
    register(FirstReplicaServer())
    try:
        sp = ActionSpace(mlp, topo4)
        assert sp.actions[:old.num_actions] == old.actions
        new = range(old.num_actions, sp.num_actions)
        subsets = [devs for devs, _ in device_subsets(topo4, sp.costs.device_speed)]
        assert [sp.actions[a].devices for a in new] == subsets and {sp.actions[a].sync for a in new} == {"ps-first"}
        for a in new:
            devs = sp.actions[a].devices
            for g in range(mlp.num_groups):
                validate_group(sp.group_plan(g, a), mlp, g, topo4.num_devices, f"groups[{g}]")
                same = len(devs) == 1 or sp.costs.param_bytes[g] == 0
                assert sp.group_canonical[g, a] == (old.action_index(devs, "allreduce") if same else a)
    finally:
        unregister(FirstReplicaServer.name)
