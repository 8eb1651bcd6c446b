"""Strategies the executor runs in a way of their own, looked up by name.

A plan normally runs as its own schedule (:func:`tag.parallel.build_schedule`), one rank per
device of it. A strategy that runs otherwise registers an **execution** here under its name
(``GroupPlan.sync``): a function of the plan and the captured graph giving an
:class:`Execution`, which says

* which plan's schedule the ranks walk (:attr:`Execution.plan`);
* which ranks run one device of that schedule together (:attr:`Execution.groups`: the first
  member is the schedule's device; each member walks its steps, the gradient syncs summing over
  the members of the same index and the transfers going between them, :attr:`Execution.shards`),
  each group with a process group of
  its own (an in-place sum over it is handed to the member's hook, :attr:`RankHook.reduce`);
* what each member changes in its runtime (:meth:`Execution.hook` -> :class:`RankHook`): its
  joint graphs, its cut stages, whether it reports the loss, how its parameters combine with the
  other members' into the full ones.

The distributed worker (:mod:`tag.executor.worker`) and the in-process runner
(:mod:`tag.executor.virtual`) ask :func:`execution_for` and name no strategy. The built-in one is
``tp`` (:mod:`tag.executor.tensor_parallel`, registered when :mod:`tag.executor` is imported: a
tensor-parallel group's devices run its first device's schedule, each on its shard).
docs/design.md "Adding a strategy".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..parallel.registry import Registry
from ..parallel.schedule import build_schedule

if TYPE_CHECKING:
    from ..graph.ir import OpGraph
    from ..graph.stages import Stage
    from ..parallel.schedule import Schedule
    from ..plan.format import Plan
    from .runtime import Joint


class RankHook:
    """What a strategy changes in one rank's :class:`~tag.executor.runtime.RankRuntime` (its
    ``hook``); this base changes nothing."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        """The rank's index in its group (:attr:`Execution.groups`)."""
        self.reduce: Callable[[torch.Tensor], None] | None = None
        """In-place sum over the rank's group (blocking); set by the runner once the group's
        process group exists, before the first iteration."""
        self.gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        """All-gather over the rank's group (blocking): a 1-D tensor of one length on every member
        -> their concatenation in member order; set by the runner as :attr:`reduce`."""
        self.machine_of: Callable[[int], int] | None = None
        """Topology device -> its machine (set by the runner; None: one machine)."""

    def scattered(self, src: int, dst: int, name: str | None = None) -> bool:
        """Whether the piece ``name`` the schedule moves from device ``src`` to device ``dst``
        goes as one slice per member of the group, all-gathered by the receiving group (this
        base: never)."""
        return False

    @property
    def reports_loss(self) -> bool:
        """Whether this rank's loss counts (one member per group reports it)."""
        return self.index == 0

    def joint(self, joint: Joint, inputs: tuple, param_grad: dict[str, str]) -> Joint:
        """The joint graph this rank runs instead of ``joint`` (``inputs``: the user inputs at its
        batch, on the host; ``param_grad``: parameter placeholder -> its gradient node)."""
        return joint

    def stage(self, stage: Stage) -> None:
        """Edit a stage cut from this rank's joint graph, in place."""

    def param_state(self) -> object:
        """What :meth:`full_params` needs from this member besides its parameters."""
        return None

    def full_params(self, gathered: list[tuple[dict[str, torch.Tensor], object]]) -> dict[str, torch.Tensor]:
        """The full parameters from every member's ``(named_params, param_state())``, in
        member order."""
        return dict(gathered[0][0])

    # ---- gradient buckets and segments run another way (sharded data parallelism) ----------
    def bucket_sync(self, rt, index: int):
        """How schedule bucket ``index``'s collective runs on this rank
        (:class:`tag.executor.comm.DistComm`): a function of the bucket's flat gradients starting
        its own collective (returning a work handle; the runtime's gradients are then left as
        they are), or None (this base) for the schedule's all-reduce / PS."""
        return None

    def synced(self, rt) -> None:
        """Called once every bucket's collective of the iteration completed, before the update."""

    def state_bytes(self, rt) -> dict[str, int]:
        """Extra per-rank memory figures for ``ranks.json`` (a sharded rank's offloaded state:
        ``device_state_bytes`` / ``host_state_bytes``); this base: none."""
        return {}

    def start(self, rt) -> None:
        """Called once by the distributed worker (:mod:`tag.executor.worker`) after its process
        groups exist, before the first iteration; this base: nothing."""

    def begin_iteration(self, rt) -> None:
        """Called by :meth:`RankRuntime.begin_iteration
        <tag.executor.runtime.RankRuntime.begin_iteration>` before any step of an iteration (or of
        a ``tag run`` batch); this base: nothing."""

    def separate_groups(self) -> frozenset[int]:
        """Op-groups each of whose compute steps this rank runs as a fused segment of its own
        (:func:`tag.executor.fuse.plan_program` ``alone``); this base: none."""
        return frozenset()

    def before_segment(self, rt, seg) -> object:
        """Called before a fused segment runs (outside its timed compute); its result is handed to
        :meth:`after_segment`."""
        return None

    def after_segment(self, rt, token: object) -> None:
        """Called after the segment :meth:`before_segment` prepared ran."""


class Execution:
    """How the ranks run ``plan``; this base: its own schedule, one rank per device, no hook."""

    def __init__(self, plan: Plan, groups: list[list[int]] | None = None) -> None:
        self.plan = plan
        """The plan whose schedule every rank walks."""
        self.groups = groups or []
        """Ranks running one schedule device together (the device first); equal sizes."""
        self.lead = {d: devs[0] for devs in self.groups for d in devs}
        """Rank -> the schedule's device it runs as (ranks of no group: themselves)."""
        self.aligned_copies = False
        """Whether the schedule takes a copied tensor from the aligned producer replica rather than
        the first (:func:`tag.parallel.moves.move_pieces` ``aligned``)."""

    def schedule(self, graph: OpGraph, machine_of=None, bucket_bytes: int | None = None) -> Schedule:
        """The schedule every rank walks (:func:`tag.parallel.schedule.build_schedule` of
        :attr:`plan`)."""
        return build_schedule(graph, self.plan, machine_of, bucket_bytes, self.aligned_copies)

    @property
    def shards(self) -> list[dict[int, int]] | None:
        """Per member index ``i``: each group's schedule device -> the group's ``i``-th rank (the
        gradient syncs sum over the ranks of one index, a transfer goes from the sender's rank of
        an index to the receiver's of the same index); None without groups."""
        if not self.groups:
            return None
        return [{devs[0]: devs[i] for devs in self.groups} for i in range(len(self.groups[0]))]

    def ranks(self, devices) -> list[int]:
        """Every rank taking part, from the schedule's ``devices`` (each with its group's other
        members), sorted."""
        members = {devs[0]: devs for devs in self.groups}
        return sorted({r for d in devices for r in members.get(d, [d])})

    def group_of(self, rank: int) -> list[int] | None:
        """The group ``rank`` is a member of, or None."""
        return next((devs for devs in self.groups if rank in devs), None)

    def hook(self, rank: int) -> RankHook | None:
        """Rank ``rank``'s hook (None: it runs its schedule as it is)."""
        return None


ExecutionFactory = Callable[["Plan", "OpGraph"], "Execution | None"]
"""``factory(plan, graph)``: how the executor runs ``plan`` (a valid plan using the strategy), or
None for its own schedule."""

_EXECUTIONS: Registry[ExecutionFactory] = Registry("execution")


def register_execution(name: str, factory: ExecutionFactory) -> ExecutionFactory:
    """Run plans using strategy ``name`` as ``factory`` says (replacing any earlier one)."""
    return _EXECUTIONS.register(factory, name)


unregister_execution = _EXECUTIONS.unregister
"""``unregister_execution(name)``: back to the plan's own schedule for strategy ``name`` (no error
if it had none)."""


def execution_for(plan: Plan, graph: OpGraph) -> Execution:
    """How the executor runs ``plan``: the execution of the first strategy the plan uses (in group
    order) that registered one and returns one, else the plan's own schedule."""
    for name in dict.fromkeys(gp.sync for gp in plan.groups):
        factory = _EXECUTIONS.find(name)
        ex = factory(plan, graph) if factory is not None else None
        if ex is not None:
            return ex
    return Execution(plan)


def _thread_collectives(n: int, combine: Callable[[list[torch.Tensor]], torch.Tensor]
                        ) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """``n`` functions, one per thread of one process, each returning ``combine`` of the ``n``
    tensors the threads handed in (in thread order, blocking until all did)."""
    barrier = threading.Barrier(n)
    slots: list[torch.Tensor] = [torch.empty(0)] * n

    def make(i: int):
        def run(x: torch.Tensor) -> torch.Tensor:
            slots[i] = x.clone()
            barrier.wait()
            out = combine(slots)
            barrier.wait()  # everybody read the slots before anybody writes them again
            return out
        return run

    return [make(i) for i in range(n)]


def _summed(slots: list[torch.Tensor]) -> torch.Tensor:
    total = slots[0]
    for s in slots[1:]:
        total = total + s
    return total


def thread_reducers(n: int) -> list[Callable[[torch.Tensor], None]]:
    """In-place sums over ``n`` threads of one process (a group's ranks in the in-process
    runner): each thread adds the ``n`` tensors in the same order, so all get the same bits."""
    def in_place(run: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], None]:
        def reduce(x: torch.Tensor) -> None:
            x.copy_(run(x))
        return reduce

    return [in_place(run) for run in _thread_collectives(n, _summed)]


def thread_gatherers(n: int) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """All-gathers over ``n`` threads of one process (:attr:`RankHook.gather`): the 1-D tensors
    concatenated in thread order."""
    return _thread_collectives(n, torch.cat)


__all__ = ["Execution", "ExecutionFactory", "RankHook", "execution_for", "register_execution", "thread_gatherers",
           "thread_reducers", "unregister_execution"]
