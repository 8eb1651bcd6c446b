"""The global execution schedule of one training iteration under a plan (pure, no torch).

Every rank computes the same :class:`Schedule` from the op graph and the plan, then walks its
steps in order, doing only the parts it takes part in. Because every rank follows the *one*
global order, the earliest unfinished communication always has all of its participants
waiting on it, so the schedule cannot deadlock (p2p batches and collectives alike).

Order of one iteration (see docs/design.md, "How a plan runs"):

1. for each unit in forward order (group 0..K-1, chunk 0..): the transfers into its forward
   stage, then its forward stage on every replica;
2. for each unit in reverse order: the transfers into its backward stage, then the stage;
   right after a data-parallel group's backward comes its ``sync`` step: its gradients are final.
   The syncs are bucketed as DDP buckets gradients (:mod:`tag.parallel.buckets`, about 25 MiB,
   :attr:`Schedule.buckets`); at the sync of a bucket's last group the bucket's collective starts
   (all-reduce over the replica set, or reduce to the server + broadcast back) over its groups'
   concatenated gradients, asynchronously: it overlaps the backward of the earlier groups;
3. the optimizer update of every parameter on its owner unit's replicas (local, no comm).

Sufficient Factor Broadcasting (``GroupPlan.sfb``, docs/design.md): right after an SFB group's
backward stage comes its ``sfb`` step -- one all-gather per distinct factor of its SFB ops over
the replicas (on a process group of their own, so it does not queue behind earlier groups'
asynchronous syncs), then every replica recomputes the full gradient of each SFB op from the
gathered factors -- and only then the ``sync`` step of the group's remaining gradients (none
when every gradient of the group is SFB).

Tensors crossing units follow docs/design.md: batch tensors are re-partitioned by sample ranges
(``rows``); non-batch forward tensors are copied from one producer replica (``copy``);
non-batch backward *gradients* are partial sums: each stays on its device when every producer
replica's device also holds a consumer replica (``sum`` in place; consumer replicas without a
partial get ``zeros``), else they are summed over the producer replicas at the consumer's first
replica (``sum``) and the other replicas get zeros (``zeros``). A non-batch
backward tensor that is not such a partial sum is copied like a forward tensor -- summing it
would count it once per replica: a transposed weight computed in the backward phase, or the
loss-gradient seed and ``seed / count`` of a mean loss (the same on every replica in
full-batch units). See :func:`partial_sum_tensors` (:mod:`tag.graph.gradients`, shared with the
simulator).

Pipelines (``Plan.pipeline``): every unit runs once per micro-batch and a tensor crossing units
moves once per micro-batch, except what does not depend on the micro-batch, which moves once
per iteration (:attr:`Schedule.shared`, :attr:`Schedule.summed`): a batch-independent tensor (a
tied weight read by another stage, a rotary table) in the transfer before its consumer's first
micro-batch, and
a deferrable partial sum (that weight's gradient) summed over the micro-batches at its producer
and moved in the transfer before its consumer's last micro-batch (zeros before: the consumer is
linear in it). The simulator moves the same (:func:`tag.sim.units.pair_kinds`).

A tied weight read by a stage other than its owner's (:func:`tag.graph.gradients.tied_weights`:
GPT-2's embedding and LM head) is not moved at all on a pipeline (:attr:`Schedule.tied`): both
stages hold a copy, the reading stage's partial sum of its gradient stays there, and one
all-reduce over both stages' replicas (a bucket of its own) sums the copies' gradients, as
Megatron-LM and DeepSpeed do; a tensor-parallel plan's schedule (``aligned_copies``) moves them
as above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..errors import PlanError
from ..graph.gradients import (  # noqa: F401 (gradient_tensors, partial_sum_tensors re-exported by tag.executor)
    backward_homes,
    batch_independent_tensors,
    deferrable_sums,
    gradient_tensors,
    partial_sum_tensors,
    tied_weights,
)
from ..graph.ir import OpGraph
from ..graph.precision import param_cast_values, param_casts
from ..plan.format import Plan
from .buckets import assign_buckets
from .moves import move_kind, move_pieces
from .pipeline import IterationProgram, iteration_program, stage_of_group
from .strategy import Collective, Replica, Unit, UnitKey, sfb_syncs, strategy_of  # noqa: F401 (Replica re-exported)

if TYPE_CHECKING:  # tag.compress (scipy) is imported only for plans using SFB
    from ..compress.detect import Candidate, Factor

MoveMode = Literal["rows", "copy", "sum", "zeros"]
StepKind = Literal["transfer", "compute", "sfb", "sync"]
STREAM: dict[str, str] = {"transfer": "p2p", "compute": "compute", "sfb": "gather", "sync": "collective"}
"""The stream each kind of step runs on: compute; point-to-point (blocking, both endpoints);
the SFB all-gathers (a process group of their own); gradient collectives (asynchronous)."""


@dataclass(frozen=True)
class Move:
    """One piece of tensor ``name`` going from a producer replica to a consumer replica.

    ``rows``: samples ``[start, stop)`` (global sample indices) along the tensor's batch dim;
    ``copy``: the whole tensor; ``sum``: the producer's partial sum, added up at ``dst``;
    ``zeros``: ``dst`` gets zeros (no data moves; ``src == dst``).
    A move with ``src == dst`` is a local hand-over, no communication.
    """

    name: str
    src_unit: UnitKey
    dst_unit: UnitKey
    src: int
    dst: int
    mode: MoveMode
    start: int = 0
    stop: int = 0
    batch_dim: int | None = None


@dataclass
class Step:
    """One entry of the global order: a task on every device it involves.

    ``compute``: the unit's ``phase`` stage on each of its replicas (its sample range);
    ``transfer``: the point-to-point ``moves`` into that stage; ``sfb``: the group's factor
    all-gathers and gradient recompute; ``sync``: the group's gradients are final, to be summed by
    ``collective`` in its bucket, which starts at the sync of its last group
    (:meth:`Schedule.launched_at`). Dependencies
    follow the global order: a step runs once every earlier step it shares a device with
    has been issued (transfers and compute block; syncs are asynchronous and waited for before
    the optimizer update of their group, which ends every device's list)."""

    kind: StepKind
    unit: UnitKey | None = None
    phase: str = ""
    moves: list[Move] = field(default_factory=list)
    group: int = -1
    """``sync`` / ``sfb``: the op-group whose parameter gradients are synchronised."""
    collective: Collective | None = None
    """``sync``: the collective (op, replicas, server)."""
    micro: int = 0
    """``compute`` / ``transfer``: the micro-batch (always 0 without a pipeline)."""

    @property
    def stream(self) -> str:
        """The stream this step runs on (:data:`STREAM`)."""
        return STREAM[self.kind]


@dataclass(frozen=True)
class SfbGroup:
    """What ``GroupPlan.sfb`` makes one data-parallel group do after its backward stage."""

    group: int
    unit: UnitKey
    candidates: tuple[Candidate, ...]
    """The SFB ops, in ``GroupPlan.sfb`` order."""
    factors: tuple[Factor, ...]
    """Distinct factors, in all-gather order (that of :func:`tag.compress.group_sfb_work`)."""
    params: frozenset[str]
    """Param placeholder names whose gradient is recomputed (left out of the gradient sync)."""
    devices: tuple[int, ...]
    """The replicas, in plan order (= sample order)."""

    @property
    def members(self) -> tuple[int, ...]:
        """The replicas sorted: the process group's ranks (``new_group`` numbers them so)."""
        return tuple(sorted(self.devices))


@dataclass(frozen=True)
class Tied:
    """A weight held by two pipeline stages (:func:`tag.graph.gradients.tied_weights`: GPT-2's
    input embedding and LM head), as Megatron-LM and DeepSpeed hold it: its owner's stage and the
    stage reading it each hold a copy (equal at start-up: every rank loads the same initial
    weights), the reading stage's partial sum of its gradient stays there (summed over its
    micro-batches; the owner's ``add`` gets zeros in its place), and one all-reduce over both
    stages' replicas (:attr:`collective`, its own gradient bucket, launched once both stages'
    last backward ran) gives every copy the whole gradient, which both update alike."""

    param: str
    """Param placeholder name."""
    owner: UnitKey
    holders: frozenset[UnitKey]
    """Units of the other stage reading the weight (or making its partial sum): they read their copy."""
    grad_unit: UnitKey
    """The unit making the partial sum."""
    grad: str
    """The partial sum's node name: on ``grad_unit``'s replicas the gradient of their copy."""
    collective: Collective
    """``allreduce`` over the owner's replicas and the holders' (plan order)."""
    group: int
    """The (negative) group number of its ``sync`` step: ``-1 - i`` for the ``i``-th tied weight."""


@dataclass(frozen=True)
class Bucket:
    """Groups whose gradients one collective sums (:mod:`tag.parallel.buckets`)."""

    groups: tuple[int, ...]
    """In the order their gradients become final; launched at the sync of the last."""
    collective: Collective
    nbytes: int
    """Gradient bytes it carries."""


@dataclass
class Schedule:
    """Everything every rank needs to know about the plan, identical on all ranks."""

    batch_size: int
    units: dict[UnitKey, Unit]
    """In forward order."""
    assign: dict[str, tuple[UnitKey, str]]
    """Joint-graph node name -> (unit, phase) computing it (``fwd`` / ``bwd``)."""
    param_owner: dict[str, UnitKey]
    """Param placeholder node name -> unit holding and updating it."""
    param_target: dict[str, str]
    """Param placeholder node name -> state-dict name (``model.<...>``)."""
    param_grad: dict[str, str]
    """Param placeholder node name -> node holding its (per-replica) gradient."""
    group_params: dict[int, list[str]]
    """Op-group -> param placeholder names it owns, in graph order."""
    param_numel: dict[str, int]
    """Param placeholder node name -> number of elements."""
    loss: str
    loss_unit: UnitKey
    steps: list[Step]
    comm_groups: list[tuple[int, ...]]
    """Device sets that need a process subgroup (created once, in this order, on every rank)."""
    sync_params: dict[int, list[str]] = field(default_factory=dict)
    """Op-group -> param placeholder names whose gradients its ``sync`` step sums (the group's
    params minus its SFB params)."""
    sfb: dict[int, SfbGroup] = field(default_factory=dict)
    """Op-group -> its SFB work (groups with a non-empty ``GroupPlan.sfb`` only)."""
    gather_groups: list[tuple[int, ...]] = field(default_factory=list)
    """Device sets of the SFB all-gathers: process subgroups of their own, created after
    :attr:`comm_groups`."""
    model: str = ""
    structure: list[tuple[str, str, tuple[str, ...]]] = field(default_factory=list, repr=False)
    """:func:`graph_structure` of the captured graph: every joint graph a rank runs must match it."""
    micro_ranges: list[tuple[int, int]] = field(default_factory=list)
    """Sample ranges ``[lo, hi)`` of the micro-batches (one, the whole batch, without a pipeline)."""
    micro_units: dict[tuple[UnitKey, int], Unit] = field(default_factory=dict)
    """(unit, micro-batch) -> the unit lowered at that micro-batch (pipeline plans only)."""
    buckets: list[Bucket] = field(default_factory=list)
    """The gradient buckets, in launch order (the order of their last group's ``sync`` step)."""
    bucket_of: dict[int, int] = field(default_factory=dict)
    """Op-group -> index of its bucket in :attr:`buckets`."""
    shared: dict[UnitKey, frozenset[str]] = field(default_factory=dict)
    """Pipeline plans: unit -> names of the batch-independent tensors it receives once per
    iteration, before its first micro-batch needs them, and holds for all of them
    (:func:`tag.graph.gradients.batch_independent_tensors`: a tied weight)."""
    summed: dict[UnitKey, frozenset[str]] = field(default_factory=dict)
    """Pipeline plans: unit -> names of the partial sums it produces, sums over its micro-batches
    and sends once, at its consumer's last micro-batch (zeros at the earlier ones;
    :func:`tag.graph.gradients.deferrable_sums`: a tied weight's gradient)."""
    recompute: frozenset[int] = frozenset()
    """Op-groups that recompute their activations (``GroupPlan.recompute``): each of their units'
    backward stages runs the unit's forward again first (:func:`tag.graph.stages.build_stages`)."""
    tied: dict[str, Tied] = field(default_factory=dict)
    """Pipeline plans: param placeholder name -> the weight's :class:`Tied` copies (a weight two
    stages read, held by both); its ``sync`` step has group :attr:`Tied.group`, whose
    :attr:`sync_params` entry is the weight alone."""
    casts: dict[UnitKey, frozenset[str]] = field(default_factory=dict)
    """Unit -> names of its forward's parameter casts (:func:`tag.graph.precision.param_casts`:
    a bf16 / fp16 copy of an fp32 weight): computed once per iteration, at the unit's first
    forward, and held (keyed without the micro-batch, :func:`tag.executor.fuse.value_key`) for
    its later micro-batches and its recomputation, until the optimizer step."""
    recast: dict[UnitKey, frozenset[str]] = field(default_factory=dict)
    """Units of groups whose casts are made per use (:attr:`Strategy.casts_per_use
    <tag.parallel.strategy.Strategy.casts_per_use>`: ZeRO-3) -> names of the forward values made
    from their parameter casts alone and read only inside the unit
    (:func:`tag.graph.precision.param_cast_values`: the copies, their transposes): not in
    :attr:`casts`; the forward makes them from the gathered parameters and drops them, the
    backward makes them again (:func:`tag.executor.fuse.share_param_casts`)."""

    def grad_key(self, ph: str, units) -> tuple[UnitKey, str] | None:
        """The ``env`` key of the gradient of param ``ph`` a rank computing ``units`` holds: the
        owner's, or a tied copy's partial sum (:attr:`tied`); None: it holds no copy."""
        owner = self.param_owner[ph]
        if owner in units:
            return owner, self.param_grad[ph]
        t = self.tied.get(ph)
        if t is not None and t.grad_unit in units:
            return t.grad_unit, t.grad
        return None

    def holds(self, ph: str, unit: UnitKey) -> bool:
        """Whether ``unit`` reads param ``ph`` from its own replicas' copy (its owner, or a
        holder of a tied copy)."""
        t = self.tied.get(ph)
        return self.param_owner[ph] == unit or (t is not None and unit in t.holders)

    def launched_at(self, step: Step) -> Bucket | None:
        """The bucket whose collective starts at ``step`` (the ``sync`` of its last group), else None."""
        if step.kind != "sync":
            return None
        b = self.buckets[self.bucket_of[step.group]]
        return b if b.groups[-1] == step.group else None

    def unit_at(self, key: UnitKey, micro: int) -> Unit:
        """Unit ``key`` on micro-batch ``micro``: its strategy's lowering at the micro-batch's size,
        sample ranges from the micro-batch's start (the unit itself without a pipeline)."""
        return self.micro_units.get((key, micro)) or self.units[key]

    def steps_of(self, device: int) -> list[Step]:
        """The ordered steps ``device`` takes part in (its task list)."""
        out = []
        for st in self.steps:
            if st.kind == "transfer":
                mine = any(device in (m.src, m.dst) for m in st.moves)
            elif st.kind == "sync":
                mine = device in st.collective.members
            else:
                mine = self.units[st.unit].replica_on(device) is not None
            if mine:
                out.append(st)
        return out

    def units_of(self, device: int) -> list[Unit]:
        return [u for u in self.units.values() if u.replica_on(device) is not None]

    def needs(self, unit: UnitKey, phase: str) -> list[Move]:
        """Moves into (unit, phase) (transfer step right before its compute step)."""
        return [m for s in self.steps if s.kind == "transfer" and s.unit == unit and s.phase == phase
                for m in s.moves]


def graph_structure(graph: OpGraph) -> list[tuple[str, str, tuple[str, ...]]]:
    """(name, target, input names) of every forward/backward op, in graph order.

    The same list as :func:`tag.executor.runtime.joint_structure` of the joint graph exported
    at the capture's batch. An export at another batch must give the same list, or node names
    would designate other ops (transformers exported at batch 1 drop a few ``expand`` / copies
    and renumber the rest; cf. :func:`tag.cost.profiler.structure`).
    """
    names = [t.name for t in graph.tensors]
    return [(op.name, op.target, tuple(names[t] for t in op.inputs)) for op in graph.ops if op.phase != "opt"]


def build_schedule(graph: OpGraph, plan: Plan, machine_of=None, bucket_bytes: int | None = None,
                   aligned_copies: bool = False) -> Schedule:
    """The global schedule of ``plan`` on ``graph``.

    Args:
        machine_of: ``device -> machine index`` (prefer same-machine sources for copies);
            default: all devices on one machine.
        bucket_bytes: cap of the gradient buckets (:func:`tag.parallel.buckets.bucket_caps`;
            default DDP's).
        aligned_copies: copies from the aligned producer replica, not the first
            (:func:`tag.parallel.moves.move_pieces` ``aligned``; a tensor-parallel plan's
            :func:`~tag.parallel.tensor_parallel.executed_plan`).
    """
    machine_of = machine_of or (lambda d: 0)
    B = plan.batch_size
    strategies = [strategy_of(gp) for gp in plan.groups]
    units: dict[UnitKey, Unit] = {}
    for g, gp in enumerate(plan.groups):
        if not strategies[g].chunked and B < len(gp.devices):
            raise PlanError(f"plan: groups[{g}].devices: {len(gp.devices)} replicas but batch {B}; "
                            "every replica needs at least one sample")
        for u in strategies[g].units(g, gp, graph, B):
            units[u.key] = u

    # ---- which unit computes each node ------------------------------------------------
    assign: dict[str, tuple[UnitKey, str]] = {}
    unit_of_op: dict[int, UnitKey] = {}
    phase_of_op: dict[int, str] = {}
    homes = backward_homes(graph)
    for i, op in enumerate(graph.ops):
        if op.phase == "opt":
            continue
        group, anchor = homes.get(i, (op.group, op.anchor))
        key = (group, strategies[group].unit_of(plan.groups[group], anchor))
        phase = op.phase
        if op.target == "getitem" and op.inputs:
            # A tuple projection stays with its tuple (so tuples never cross units).
            p = graph.tensors[op.inputs[0]].producer
            if p >= 0 and p in unit_of_op:
                key, phase = unit_of_op[p], phase_of_op[p]
        unit_of_op[i], phase_of_op[i] = key, phase
        assign[op.name] = (key, phase)

    param_owner: dict[str, UnitKey] = {}
    param_target: dict[str, str] = {}
    param_grad: dict[str, str] = {}
    param_numel: dict[str, int] = {}
    param_bytes: dict[str, int] = {}
    group_params: dict[int, list[str]] = {g: [] for g in range(len(plan.groups))}
    owner_of_tensor: dict[int, UnitKey] = {}
    for p in graph.params:
        ph = graph.tensors[p.tensor].name
        gnode = graph.tensors[p.grad]
        owner = unit_of_op[gnode.producer] if gnode.producer >= 0 else (p.group, 0)
        param_owner[ph], param_target[ph], param_grad[ph] = owner, p.name, gnode.name
        param_numel[ph] = p.numel
        param_bytes[ph] = p.nbytes
        group_params[owner[0]].append(ph)
        owner_of_tensor[p.tensor] = owner

    loss_t = graph.tensors[graph.loss]
    loss_unit = unit_of_op[loss_t.producer]
    partial_sums = partial_sum_tensors(graph)
    sfb = _sfb_groups(graph, plan, param_owner, param_target)
    tied = _tied(graph, plan, units, unit_of_op, param_owner) if not aligned_copies else {}
    untied = {t.param for t in tied.values()}
    sync_params = {g: [ph for ph in phs if (g not in sfb or ph not in sfb[g].params) and ph not in untied]
                   for g, phs in group_params.items()}
    sync_params.update({t.group: [t.param] for t in tied.values()})
    tied_of = {tn: t for t in tied.values() for tn in (t.param, t.grad)}  # weight / partial sum name -> Tied

    # ---- order of steps and which tensors cross into each (unit, phase) -------------------
    order = list(units)
    phase_steps = [(u, "fwd") for u in order] + [(u, "bwd") for u in reversed(order)]
    position = {s: k for k, s in enumerate(phase_steps)}
    program = None if plan.pipeline is None else iteration_program(plan.pipeline, B, len(plan.groups))
    ranges = [(0, B)] if program is None else program.ranges
    # (unit, phase, micro-batch) in the order they run: each stage's pipeline schedule merged
    # (tag.parallel.pipeline), a unit's forward in group order and backward in reverse within it.
    tasks = [(u, ph, 0) for u, ph in phase_steps] if program is None else _pipeline_tasks(program, order)
    first_need: dict[tuple[int, UnitKey], int] = {}  # (tensor, consumer unit) -> earliest step
    for i, op in enumerate(graph.ops):
        if op.phase == "opt":
            continue
        dst = (unit_of_op[i], phase_of_op[i])
        for t in op.inputs:
            tensor = graph.tensors[t]
            if tensor.producer >= 0:
                src_unit, src_phase = unit_of_op[tensor.producer], phase_of_op[tensor.producer]
            elif t in owner_of_tensor:
                src_unit, src_phase = owner_of_tensor[t], "fwd"
            else:
                continue  # user inputs, buffers, constants: every rank has them
            if src_unit == dst[0]:
                continue
            if tensor.producer >= 0 and position[(src_unit, src_phase)] >= position[dst]:
                raise PlanError(f"plan: tensor {tensor.name} flows from unit {src_unit} {src_phase} to "
                                f"{dst[0]} {dst[1]}, which runs earlier; the grouping is not acyclic")
            k = (t, dst[0])
            first_need[k] = min(first_need.get(k, position[dst]), position[dst])
    # SFB factors (materialised tensors behind the gradient op's operands) may come from another
    # unit even when the operand itself (a view of it) was computed there: bring them along.
    for sg in sfb.values():
        for f in sg.factors:
            tensor = graph.tensors[f.tensor]
            if tensor.producer < 0 or unit_of_op[tensor.producer] == sg.unit:
                continue  # user inputs: every rank has them
            k = (f.tensor, sg.unit)
            first_need[k] = min(first_need.get(k, position[(sg.unit, "bwd")]), position[(sg.unit, "bwd")])
    # A tensor a unit needs in both phases moves once, before the first (stored for both).
    needed: dict[tuple[UnitKey, str], list[int]] = {s: [] for s in phase_steps}
    for (t, _u), pos in sorted(first_need.items(), key=lambda kv: (kv[1], kv[0][0])):
        needed[phase_steps[pos]].append(t)

    # Which groups synchronise gradients, with which collective (over the replicas, plus a server).
    collective_of: dict[int, Collective] = {}
    for g, gp in enumerate(plan.groups):
        c = strategies[g].collective(gp) if sync_params[g] else None
        if c is not None:
            collective_of[g] = c

    # Each micro-batch's units, lowered by their strategy at its size (as the simulator costs them).
    micro_units: dict[tuple[UnitKey, int], Unit] = {}
    if plan.pipeline is not None:
        for m, (lo, hi) in enumerate(ranges):
            for g, gp in enumerate(plan.groups):
                for u in strategies[g].units(g, gp, graph, hi - lo):
                    micro_units[(u.key, m)] = Unit(u.key, u.sync, [Replica(r.device, lo + r.start, lo + r.stop)
                                                                   for r in u.replicas], u.server, u.positions)
    # On a pipeline, what does not change with the micro-batch moves once per iteration (a tied
    # weight read by another stage, and its partial-sum gradient), not once per micro-batch:
    # a batch-independent tensor before its consumer's first micro-batch (held by the consumer
    # without a micro-batch in its key, read by all of them); a deferrable partial sum summed
    # over the micro-batches at its producer, moved after its consumer's last micro-batch (the
    # producer's last ran before it), the consumer getting zeros at the earlier ones.
    once = batch_independent_tensors(graph) if plan.pipeline is not None else set()
    deferred = deferrable_sums(graph) if plan.pipeline is not None else set()
    first_task: dict[tuple[UnitKey, str], int] = {}  # (unit, phase) -> its first micro-batch
    last_task: dict[tuple[UnitKey, str], int] = {}  # (unit, phase) -> its last micro-batch
    for u, ph, m in tasks:
        first_task.setdefault((u, ph), m)
        last_task[(u, ph)] = m
    shared: dict[UnitKey, set[str]] = {}
    summed: dict[UnitKey, set[str]] = {}
    relay = _relays(graph, program, first_need, owner_of_tensor, unit_of_op, partial_sums, tied_of)
    steps: list[Step] = []
    for u, ph, m in tasks:
        moves: list[Move] = []
        for t in needed[(u, ph)]:
            tensor = graph.tensors[t]
            src_unit = relay.get((t, u)) or (owner_of_tensor[t] if tensor.producer < 0 else unit_of_op[tensor.producer])
            dst = micro_units.get((u, m), units[u])
            tie = tied_of.get(tensor.name)
            if tie is not None and u in tie.holders | {tie.owner}:
                if tensor.producer < 0:
                    continue  # the weight: the holder's stage reads its own copy
                # the partial sum stays with its maker, summed over its micro-batches, for the
                # tied all-reduce; the owner's add gets zeros in its place
                summed.setdefault(src_unit, set()).add(tensor.name)
                moves += [Move(tensor.name, src_unit, u, r.device, r.device, "zeros") for r in dst.replicas]
                continue
            if t in once:
                if m != first_task[(u, ph)]:
                    continue
                shared.setdefault(u, set()).add(tensor.name)
            elif t in deferred:
                summed.setdefault(src_unit, set()).add(tensor.name)
                if m != last_task[(u, ph)]:
                    moves += [Move(tensor.name, src_unit, u, r.device, r.device, "zeros") for r in dst.replicas]
                    continue
            moves += _moves(tensor.name, micro_units.get((src_unit, m), units[src_unit]),
                            dst, tensor.batch_dim, t in partial_sums, machine_of, aligned_copies)
        if moves:
            steps.append(Step("transfer", u, ph, moves, micro=m))
        steps.append(Step("compute", u, ph, micro=m))
        if ph == "bwd" and u[0] in sfb:
            steps.append(Step("sfb", u, group=u[0]))
        if ph == "bwd" and u[0] in collective_of and m == last_task[(u, "bwd")]:
            # The group's gradients are final once its (last micro-batch's) backward ran
            # (contributions from later groups arrived before it): start its sync now, overlapping
            # the earlier groups' backward (as the simulator does); the update waits for it.
            steps.append(Step("sync", u, group=u[0], collective=collective_of[u[0]]))
    steps = _with_tied_syncs(steps, tied)
    comm = sorted({c.members for c in collective_of.values()} | {t.collective.members for t in tied.values()})
    gathers = sorted({sg.members for sg in sfb.values()})
    syncs = [(st.group, st.collective, sum(param_bytes[ph] for ph in sync_params[st.group]), i)
             for i, st in enumerate(steps) if st.kind == "sync" and st.group >= 0]
    launch = [(syncs[b[-1]][3], Bucket(tuple(syncs[i][0] for i in b), syncs[b[0]][1], sum(syncs[i][2] for i in b)))
              for b in assign_buckets([(c, n) for _, c, n, _ in syncs], bucket_bytes)]
    # a tied weight's all-reduce is a bucket of its own, launched at its sync step
    launch += [(i, Bucket((st.group,), st.collective, param_bytes[sync_params[st.group][0]]))
               for i, st in enumerate(steps) if st.kind == "sync" and st.group < 0]
    buckets = [b for _, b in sorted(launch, key=lambda x: x[0])]
    return Schedule(B, units, assign, param_owner, param_target, param_grad, group_params, param_numel,
                    loss_t.name, loss_unit, steps, comm, sync_params, sfb, gathers, graph.model,
                    graph_structure(graph), ranges, micro_units, buckets,
                    {g: k for k, b in enumerate(buckets) for g in b.groups},
                    {u: frozenset(n) for u, n in shared.items()}, {u: frozenset(n) for u, n in summed.items()},
                    frozenset(g for g, gp in enumerate(plan.groups) if gp.recompute), tied,
                    *_casts(graph, unit_of_op, frozenset(g for g, s in enumerate(strategies) if s.casts_per_use)))


def _casts(graph: OpGraph, unit_of_op: dict[int, UnitKey], per_use: frozenset[int]) -> tuple[dict, dict]:
    """:attr:`Schedule.casts` and :attr:`Schedule.recast` (the units of the groups ``per_use``), by node name."""
    out: dict[UnitKey, set[str]] = {}
    for i in param_casts(graph):
        if graph.ops[i].group not in per_use:
            out.setdefault(unit_of_op[i], set()).add(graph.ops[i].name)
    again: dict[UnitKey, set[str]] = {}
    ops, tensors = graph.ops, graph.tensors
    for i in param_cast_values(graph) if per_use else ():
        u = unit_of_op[i]
        if ops[i].group in per_use and all(unit_of_op.get(c) == u for t in ops[i].outputs for c in tensors[t].consumers) \
                and all(ops[tensors[t].producer].name in again.get(u, ()) for t in ops[i].inputs
                        if tensors[t].kind != "param"):
            again.setdefault(u, set()).add(ops[i].name)
    return {u: frozenset(n) for u, n in out.items()}, {u: frozenset(n) for u, n in again.items()}


def _relays(graph: OpGraph, program: IterationProgram | None, first_need: dict[tuple[int, UnitKey], int],
            owner_of_tensor: dict[int, UnitKey], unit_of_op: dict[int, UnitKey], partial_sums: set[int],
            tied_of: dict[str, Tied]) -> dict[tuple[int, UnitKey], UnitKey]:
    """Pipeline plans: (tensor, consumer unit) -> the unit of the consumer's stage that receives the
    tensor from another stage first (its first need, :func:`build_schedule`'s ``first_need``, is the
    earliest of the stage's units), for every other unit of that stage reading it: the tensor
    crosses to a stage's devices once per micro-batch (or iteration), before its first consumer
    there, and the later ones take that copy over locally (a stage's units share its devices and
    sample ranges). Partial sums and tied weights move by their own rules."""
    if program is None:
        return {}
    stage_of = program.stage_of
    lead: dict[tuple[int, int], tuple[int, UnitKey]] = {}  # (tensor, stage) -> (first need, unit)
    for (t, u), pos in first_need.items():
        tensor = graph.tensors[t]
        if t in partial_sums or tensor.name in tied_of:
            continue
        src = owner_of_tensor[t] if tensor.producer < 0 else unit_of_op[tensor.producer]
        if stage_of[src[0]] == stage_of[u[0]]:
            continue
        key = (t, stage_of[u[0]])
        if key not in lead or pos < lead[key][0]:
            lead[key] = (pos, u)
    out = {}
    for t, u in first_need:
        x = lead.get((t, stage_of[u[0]]))
        if x is not None and x[1] != u:
            out[(t, u)] = x[1]
    return out


def _tied(graph: OpGraph, plan: Plan, units: dict[UnitKey, Unit], unit_of_op: dict[int, UnitKey],
          param_owner: dict[str, UnitKey]) -> dict[str, Tied]:
    """The tied weights of a pipeline plan (:func:`tag.graph.gradients.tied_weights`) whose
    reading groups are in one stage and whose owner is in another: param name -> :class:`Tied`."""
    if plan.pipeline is None:
        return {}
    stage_of = stage_of_group(plan.pipeline, len(plan.groups))
    out: dict[str, Tied] = {}
    for t, (x, groups) in tied_weights(graph).items():
        ph = graph.tensors[t].name
        owner = param_owner[ph]
        stages = {stage_of[g] for g in groups}
        if len(stages) != 1 or stage_of[owner[0]] in stages:
            continue
        holders = frozenset(u for u in units if u[0] in groups)  # (pipeline groups are one unit each)
        grad_unit = unit_of_op[graph.tensors[x].producer]
        if set(units[owner].devices) & set(units[grad_unit].devices):  # (interleaved chunks of one device set)
            continue
        devices = tuple(units[owner].devices) + tuple(units[grad_unit].devices)
        out[ph] = Tied(ph, owner, holders, grad_unit, graph.tensors[x].name, Collective("allreduce", devices),
                       -1 - len(out))
    return out


def _with_tied_syncs(steps: list[Step], tied: dict[str, Tied]) -> list[Step]:
    """``steps`` with each tied weight's ``sync`` step after the later of its owner's and its
    partial sum's maker's last backward (and the syncs and SFB right after that backward)."""
    if not tied:
        return steps
    at: dict[int, list[Step]] = {}
    for t in tied.values():
        i = max(k for k, st in enumerate(steps)
                if st.kind == "compute" and st.phase == "bwd" and st.unit in (t.owner, t.grad_unit))
        while i + 1 < len(steps) and steps[i + 1].kind in ("sync", "sfb") and steps[i + 1].unit == steps[i].unit:
            i += 1
        at.setdefault(i, []).append(Step("sync", t.owner, group=t.group, collective=t.collective))
    return [x for k, st in enumerate(steps) for x in [st, *at.get(k, [])]]


def _pipeline_tasks(program: IterationProgram, order: list[UnitKey]) -> list[tuple[UnitKey, str, int]]:
    """(unit, phase, micro-batch) in pipeline order: every stage task of the program's global
    order runs its stage's units (forward: in order; backward: reversed)."""
    members: list[list[UnitKey]] = [[] for _ in program.members]
    for u in order:
        members[program.stage_of[u[0]]].append(u)
    out = []
    for t in program.tasks:
        us = members[t.stage] if t.phase == "fwd" else list(reversed(members[t.stage]))
        out += [(u, t.phase, t.micro) for u in us]
    return out


def _sfb_groups(graph: OpGraph, plan: Plan, param_owner: dict[str, UnitKey],
                param_target: dict[str, str]) -> dict[int, SfbGroup]:
    """Validated :class:`SfbGroup` of every group with a non-empty ``GroupPlan.sfb``."""
    if not any(gp.sfb for gp in plan.groups):
        return {}
    from ..compress import SfbError, find_candidates, group_sfb_work

    cands = find_candidates(graph)
    by_op = {c.op: c for c in cands}
    placeholder_of = {target: ph for ph, target in param_target.items()}
    out: dict[int, SfbGroup] = {}
    for g, gp in enumerate(plan.groups):
        if not gp.sfb:
            continue
        try:
            work = group_sfb_work(graph, gp, g, plan.batch_size, cands, syncs=sfb_syncs())
        except SfbError as e:
            raise PlanError(str(e)) from None
        chosen = tuple(by_op[i] for i in work.ops)
        params = set()
        for c in chosen:
            ph = placeholder_of[c.param]
            if param_owner[ph] != (g, 0):
                raise PlanError(f"plan: groups[{g}].sfb: op {c.op_name!r}: the gradient of {c.param} is "
                                f"finished by unit {param_owner[ph]}, not by group {g}; drop the op from the list")
            params.add(ph)
        out[g] = SfbGroup(g, (g, 0), chosen, tuple(x.factor for x in work.gathers), frozenset(params),
                          tuple(gp.devices))
    return out


def _moves(name: str, src: Unit, dst: Unit, batch_dim: int | None, partial_sum: bool, machine_of,
           aligned: bool = False) -> list[Move]:
    """The moves of tensor ``name`` from ``src`` to ``dst`` (:func:`tag.parallel.moves.move_pieces`)."""
    out = []
    for i, j, mode, lo, hi in move_pieces(move_kind(batch_dim, partial_sum), src, dst, machine_of, aligned):
        c = dst.replicas[j].device
        if mode == "rows":
            out.append(Move(name, src.key, dst.key, src.replicas[i].device, c, mode, lo, hi, batch_dim))
        elif mode == "sum":  # each partial to the device of its consumer replica
            out.append(Move(name, src.key, dst.key, src.replicas[i].device, c, mode))
        elif mode == "shard":  # (tensor-parallel units run as data parallel: tensor_parallel.executed_plan,
            # whose ranks scatter between machines themselves: tag.executor.tensor_parallel.TpRank.scattered)
            raise PlanError(f"plan: {name}: a scattered move into tensor-parallel unit {dst.key}; schedule the "
                            "plan tensor_parallel.executed_plan gives")
        else:
            out.append(Move(name, src.key, dst.key, c if mode == "zeros" else src.replicas[i].device, c, mode))
    return out
