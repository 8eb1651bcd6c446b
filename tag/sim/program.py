"""What the event loop needs to run a deployment as a pipeline (:mod:`tag.parallel.pipeline`):
every group deployed at each micro-batch's size, the tasks in the schedule's global order, each
stage's groups and micro-batches in flight, and the tied weights both stages hold
(:func:`build_program`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..graph.ir import PHASE_INDEX
from ..parallel.sharded import shard_size
from .strategies import costing_of
from .units import GroupData

if TYPE_CHECKING:
    from .engine import Simulator


class TiedShard(NamedTuple):
    """A tied weight of :attr:`PipelineProgram.tied` one of whose groups is sharded."""

    tensor: int
    owner_level: int
    """The owner's ZeRO level (0: not sharded)."""
    owner_shard: int
    """The owner's shard size (1: not sharded)."""
    reader_shard: int
    """The reading group's shard size (1: not sharded)."""


class PipelineProgram(NamedTuple):
    """A pipeline run (:func:`build_program`). Micro-batch ``m`` of a stage is addressed as chunk
    ``m`` of its groups (pipeline groups are data parallel: they have no position chunks), so
    stage indices, flows and the recorder's stage keys carry the micro-batch unchanged."""

    deployments: list[list[GroupData]]
    """Per micro-batch: every group's deployment at that micro-batch's size."""
    tasks: list[tuple[int, int, int]]
    """(stage, phase, micro-batch) in the schedule's global order."""
    members: list[list[int]]
    """Per stage: its groups, in order."""
    flight: list[int]
    """Per stage: the most micro-batches whose activations are alive at once."""
    tied: frozenset[int] = frozenset()
    """Tied weights (parameter tensors, :attr:`tag.sim.static.GraphStatic.tied`) both of whose
    stages hold a copy: they do not move, their gradients are all-reduced over both stages
    (:meth:`Simulator.sync_jobs`); not under a strategy costed its own way (tensor parallelism),
    whose executor moves them as before."""

    relayed: frozenset[tuple[int, int]] = frozenset()
    """(tensor, consumer group) edges another group of the consumer's stage receives for it
    (:meth:`tag.sim.static.GraphStatic.relayed`)."""

    tied_shards: tuple[TiedShard, ...] = ()
    """Each tied weight of :attr:`tied` one of whose groups is sharded: its owner's layout prices
    the weight's state as its level's, the executor holds it as ZeRO-1 on each stage
    (:func:`tag.sim.holdings.hold_tied`)."""

    def select(self, part: str) -> tuple:
        """:func:`tag.sim.units.pair_kinds`'s ``select`` of ``part`` (``micro``, ``first``,
        ``last``, ``all``) leaving out :attr:`tied` and :attr:`relayed`."""
        return part, self.tied, self.relayed


def zero_of(gp) -> tuple[int, int]:
    """(ZeRO level, shard size) of a group's plan whose ranks hold a tied weight's copy sharded
    (:class:`tag.executor.sharded.ShardedRank`): ``zero*`` over several devices, not offloaded;
    else ``(0, 1)``."""
    if gp.sync.startswith("zero") and not gp.offload and len(gp.devices) > 1:
        return int(gp.sync[4:]), shard_size(gp)
    return 0, 1


def build_program(sim: Simulator, groups, pp) -> PipelineProgram:
    """The :class:`PipelineProgram` of ``groups`` run as the pipeline ``pp`` on ``sim``."""
    from ..parallel.pipeline import iteration_program

    prog = iteration_program(pp, sim.static.batch_size, len(groups))
    by_size: dict[tuple[int, bool], list[GroupData]] = {}
    per_micro = []
    for m, (lo, hi) in enumerate(prog.ranges):
        # micro-batch 0 (every stage's first forward) casts the parameters, the later ones reuse them
        key = (hi - lo, m > 0 and sim.any_casts)
        if key not in by_size:
            deployments = [sim.group_data(g, gp, batch=hi - lo) for g, gp in enumerate(groups)]
            by_size[key] = sim.warm_deployments(deployments) if key[1] else deployments
        per_micro.append(by_size[key])
    members = [list(r) for r in prog.members]
    tasks = [(t.stage, PHASE_INDEX[t.phase], t.micro) for t in prog.tasks]
    tied = tied_weights(sim, groups, pp)
    # a tied weight under sharded groups: each stage's copy ZeRO-1 over its group's shard groups (hold_tied)
    shards = []
    for tw in sim.static.tied:
        owner, reader = zero_of(groups[tw.owner]), zero_of(groups[tw.grad_group])
        if tw.tensor in tied and (owner[0] or reader[0]):
            shards.append(TiedShard(tw.tensor, owner[0], owner[1], reader[1]))
    return PipelineProgram(per_micro, tasks, members, list(prog.flight), tied, sim.static.relayed(tuple(pp.stages)),
                           tuple(shards))


def tied_weights(sim: Simulator, groups, pp) -> frozenset[int]:
    """The tied weights of :attr:`PipelineProgram.tied`: readers in one stage, owner in another
    (the executor's :func:`tag.parallel.schedule.build_schedule`), in a plan of groups without a
    costing of their own or sharded (ZeRO, not offloaded: the executor keeps the weight whole on
    both stages, its optimizer state over each stage's shard groups,
    :func:`tag.sim.holdings.hold_tied`; a tensor-parallel plan's executor moves it), or, in a graph
    costed as Megatron-LM's vocabulary-parallel run (``vocab_parallel``,
    :func:`tag.parallel.layers.vocab_parallel_graph`), whose groups are tensor parallel of that
    degree over as many devices each (each rank holds its ``V / tp`` shard on both stages)."""
    if not sim.static.tied:
        return frozenset()
    from ..parallel.pipeline import stage_of_group
    from ..parallel.tensor_parallel import tp_degree

    held_whole = ("zero1", "zero2", "zero3")  # (whole on both stages, not offloaded)
    plain = not any(costing_of(gp.sync) is not None and (gp.sync not in held_whole or gp.offload)
                    for gp in groups)
    t = getattr(sim.graph, "vocab_parallel", 0)

    def holds(tw) -> bool:
        if plain:
            return True
        gps = [groups[g] for g in tw.groups | {tw.owner}]
        return t > 1 and all(gp.sync == "tp" and tp_degree(gp) == t and not gp.sequence_parallel
                             and len(gp.devices) == len(gps[0].devices) for gp in gps)

    stage = stage_of_group(pp, len(groups))
    return frozenset(tw.tensor for tw in sim.static.tied
                     if len({stage[g] for g in tw.groups}) == 1 and stage[tw.owner] != stage[tw.grad_group]
                     and not set(groups[tw.owner].devices) & set(groups[tw.grad_group].devices) and holds(tw))
