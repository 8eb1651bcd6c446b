"""Deployment strategies: how one op-group's :class:`~tag.plan.GroupPlan` runs.

A strategy *lowers* a group's plan into the pieces every consumer of a plan shares:

* its **units** (:class:`Unit`): the devices computing the group, each replica with the sample
  range ``[start, stop)`` of the global batch it runs; a unit covers the whole group (data
  parallel: replicas of it) or the forward positions ``[lo, hi)`` of it (a model-parallel chunk);
* the **collective** (:class:`Collective`) that synchronises the group's parameter gradients
  after its backward, if any.

The executor's global schedule (:func:`tag.parallel.schedule.build_schedule`) and the
simulator's per-group deployment (:meth:`tag.sim.Simulator.group_data`) are both built from
this lowering, so what runs and what is costed are one thing. A strategy is registered under the
name a plan writes in ``GroupPlan.sync`` (:func:`register`); docs/design.md "Adding a strategy"
lists the files a new one touches.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np

from ..cost.comm import uniform_ps_time
from ..errors import PlanError
from ..plan.format import GroupPlan, group_positions, local_batches
from .pipeline import validate_pipeline
from .registry import Registry

UnitKey = tuple[int, int]
"""(group, unit index); the index is 0 for a group run as one unit."""


class Replica(NamedTuple):
    """One device running a unit on the samples ``[start, stop)`` of the global batch (a named
    tuple: the simulator lowers every new deployment it meets, so this is built often)."""

    device: int
    start: int
    stop: int

    @property
    def batch(self) -> int:
        """Samples this replica runs."""
        return self.stop - self.start


@dataclass
class Unit:
    """The devices computing one op-group, or one chunk of it (one stage of the schedule)."""

    key: UnitKey
    sync: str
    """Name of the group's strategy (``GroupPlan.sync``)."""
    replicas: list[Replica]
    server: int | None = None
    positions: tuple[int, int] | None = None
    """Forward positions ``[lo, hi)`` this unit computes (with the backward ops anchored there
    and the updates of the parameters owned there); ``None``: the whole group."""

    @property
    def devices(self) -> list[int]:
        return [r.device for r in self.replicas]

    @property
    def batches(self) -> tuple[int, ...]:
        """Samples per replica (plan order)."""
        return tuple([r.stop - r.start for r in self.replicas])

    @property
    def starts(self) -> tuple[int, ...]:
        """First global sample per replica (plan order)."""
        return tuple(r.start for r in self.replicas)

    def replica_on(self, device: int) -> Replica | None:
        return next((r for r in self.replicas if r.device == device), None)


class Collective(NamedTuple):
    """A gradient collective over a device group, started after the group's backward.

    ``op``: ``allreduce`` (sum over ``devices``, every member gets it) or ``ps`` (reduce to
    ``server``, broadcast back). Costed by :mod:`tag.cost.comm` (``allreduce_time``,
    ``ps_time``), run by :class:`tag.executor.comm.DistComm`."""

    op: str
    devices: tuple[int, ...]
    """The replicas (plan order)."""
    server: int | None = None

    @property
    def members(self) -> tuple[int, ...]:
        """Every rank taking part, sorted (the process group's ranks)."""
        return tuple(sorted(set(self.devices) | ({self.server} if self.server is not None else set())))


class Strategy:
    """Base class of a deployment strategy; subclasses set :attr:`name` and lower a group."""

    name: ClassVar[str] = ""
    """The value of ``GroupPlan.sync`` selecting this strategy."""
    chunked: ClassVar[bool] = False
    """Units are chunks of the group's forward positions, each on the full batch (else every
    unit runs the whole group on a share of the batch)."""
    casts_per_use: bool = False
    """The group's low-precision weight copies (:func:`tag.graph.precision.param_casts`) are made
    at each use and freed after it, not held for the iteration (:attr:`Schedule.recast
    <tag.parallel.Schedule.recast>`): a ZeRO-3 group, whose parameters exist only while it runs."""

    def validate(self, gp: GroupPlan, graph, g: int, num_devices: int, batch_size: int, where: str) -> None:
        """Raise :class:`PlanError` naming ``where`` unless ``gp`` is a valid plan of this kind
        (devices, shares and sfb are checked generically before)."""
        raise NotImplementedError

    def units(self, g: int, gp: GroupPlan, graph, batch_size: int) -> list[Unit]:
        """The group's units, in execution order."""
        raise NotImplementedError

    def width(self, gp: GroupPlan) -> int:
        """Devices holding one sample range (consecutive devices computing the same samples): 1,
        each device its own (:meth:`TensorParallel.width <tag.parallel.TensorParallel.width>`:
        a plain tensor-parallel group's degree)."""
        return 1

    def unheld_state_bytes(self, gp: GroupPlan, graph, groups: list[int]) -> float:
        """Bytes of the fixed state (parameters, gradients, optimizer state) of op-groups
        ``groups``, all deployed as ``gp``, that a device of the deployment does not hold (sharded
        over its devices): what a lower bound of a device's memory may leave out
        (:func:`tag.sim.bounds.static_bound`). Default 0: every device holds all of it."""
        return 0.0

    def replica_shares(self, gp: GroupPlan) -> list[float]:
        """The batch fraction of each sample replica (plan order): each run of :meth:`width`
        devices' shares summed (the run holds one range)."""
        w = self.width(gp)
        return list(gp.shares) if w == 1 else [sum(gp.shares[i:i + w]) for i in range(0, len(gp.shares), w)]

    def unit_of(self, gp: GroupPlan, anchor: int) -> int:
        """Index (in :meth:`units`) of the unit computing forward position ``anchor``."""
        return 0

    def collective(self, gp: GroupPlan) -> Collective | None:
        """The collective synchronising the group's gradients (``None``: none needed)."""
        return None

    def check_plan(self, plan, graph, topology, source: str) -> None:
        """Checks across the groups of a plan using this strategy (raise :class:`PlanError`
        naming ``source``); called once per strategy a plan uses, after every group's checks."""

    def execution_refusal(self, plan) -> str | None:
        """Why the executor does not run ``plan`` as far as this strategy's groups go (one line
        naming the field), None when it runs them; called once per strategy the plan uses, by
        :func:`execution_refusal`. The default: every deployment of the strategy runs."""
        return None

    def sfb_op(self) -> str | None:
        """The collective op (:data:`tag.cost.comm.SYNC_OPS`: ``allreduce`` or ``ps``) of this
        strategy's gradient sync when its groups may take Sufficient Factor Broadcasting, None (the
        default) when they may not. SFB fits replicas each running the whole group on a share of
        the batch, their weight gradients summed by that collective: the replicas all-gather the
        gradient's factors instead (:mod:`tag.compress`, which costs the sync by this op; a group
        also needs two replicas, :func:`tag.compress.eligible`). :func:`tag.parallel.sfb_syncs`
        hands the registered strategies' answers to :mod:`tag.compress`."""
        return None

    def normalise(self, gp: GroupPlan, has_params: bool) -> GroupPlan:
        """``gp`` (a copy, changed in place) in the canonical form of the deployments that run the
        same (searches count such actions once); ``has_params``: the group owns parameters."""
        return gp

    # ---- what the search offers (:class:`tag.search.space.ActionSpace`) ------------------------
    # ``space`` below is the search's action space (duck-typed: this layer imports no search):
    # ``graph``, ``topology``, ``costs`` (:class:`tag.search.costs.GroupCosts`), ``executable``,
    # ``tp_degrees``, ``memo`` (a dict strategies may cache in), ``server_of(devices)``,
    # ``model_time``.

    search_pass: ClassVar[int] = 3
    """Where the search's action list puts this strategy's actions: every action of pass 0 over
    every device subset (within a subset, the strategies in registration order), then pass 1's,
    and so on. TAG's (``allreduce``, ``ps``, ``mp``) are pass 0, ``tp``'s pass 1, ZeRO-3's
    (:mod:`tag.parallel.sharded`) pass 2, a strategy registered later pass 3 unless its own class says otherwise (not inherited: a subclass of a
    built-in one goes after them too, :meth:`__init_subclass__`), so that existing action indices
    (the shipped GNN predictor's outputs) never move."""

    feature_sync: ClassVar[str | None] = None
    """Which sync flag of the GNN predictor's features (:data:`tag.gnn.features.SYNC_FLAGS`:
    ``allreduce``, ``ps``, ``mp``, ``tp``, the columns the shipped predictor was trained on) the
    search's actions of this strategy and the groups it deploys set. Each built-in strategy sets
    its own; a strategy registered later sets none (all four flags 0: the predictor reads it by
    its other features, devices, batch shares, compute, sync and memory estimates) unless its
    own class names the flag of the built-in one it should be read as. Not inherited
    (:meth:`__init_subclass__`), as :attr:`search_pass`."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "search_pass" not in cls.__dict__:  # each class states its own pass, or goes last
            cls.search_pass = Strategy.search_pass
        if "feature_sync" not in cls.__dict__:  # each class states its own flag, or none
            cls.feature_sync = Strategy.feature_sync

    def search_options(self, devices: tuple[int, ...], family: str, space) -> list:
        """The options of the search's actions of this strategy over device subset ``devices``
        (produced by subset family ``family``): one action per option (an option is the
        strategy's parameter, e.g. ``tp``'s degree, stored as ``Action.tp``; None for none).
        Default: one action on subsets of two devices or more."""
        return [None] if len(devices) > 1 else []

    def search_group_size(self, option) -> int | None:
        """Devices per group that a search option names (``tp``'s degree, a hybrid shard group's
        size; the GNN predictor's ``tp_frac`` feature); None for none. Default: the option."""
        return option

    def search_devices(self, space, g: int, devices: tuple[int, ...], option) -> tuple[int, ...]:
        """The devices the action over ``devices`` deploys op-group ``g`` on (default: all of them)."""
        return devices

    def search_server(self, space, devices: tuple[int, ...], option) -> int | None:
        """The parameter server of the action's plans (the same for every group), None for none."""
        return None

    def search_plan(self, space, g: int, devices: tuple[int, ...], option) -> GroupPlan:
        """The :class:`GroupPlan` the search's action (this strategy over ``devices`` with
        ``option``) deploys op-group ``g`` with (a valid plan of the group)."""
        raise NotImplementedError(f"strategy {self.name!r} offers search actions but no search_plan")

    def search_key(self, space, g: int, devices: tuple[int, ...], option) -> tuple | None:
        """A key with the equivalence classes of the action's plan for group ``g`` after
        :meth:`normalise` (equal keys: the same deployment; the search simulates one of them),
        computed without building the plan; None (the default): the search keys the normalised
        plan itself (:meth:`GroupPlan.key <tag.plan.GroupPlan.key>`)."""
        return None

    def search_estimate(self, space, g: int, devices: tuple[int, ...], option, plan: GroupPlan, bmin: float,
                        lmax: float) -> tuple[float, float, float]:
        """``(compute s, sync s, memory bytes)`` of the search's action over ``devices`` with
        ``option`` (deploying group ``g`` as ``plan``) by static slowest-link bounds (the GNN
        predictor's action features, :mod:`tag.gnn.features`: what the shipped predictor was
        trained on); ``bmin`` bytes/s and ``lmax`` s: the smallest
        bandwidth and the largest latency between two devices of the action's subset. Default:
        replicas on ``devices`` at their summed speed, synchronised as by a parameter server
        counting every replica as a worker (:func:`tag.cost.comm.uniform_ps_time`)."""
        sync = 0.0 if len(devices) == 1 else uniform_ps_time(len(devices), space.costs.param_bytes[g], bmin, lmax)
        return self.replicated_estimate(space, g, devices, sync)

    @staticmethod
    def replicated_estimate(space, g: int, devices: tuple[int, ...], sync_s: float) -> tuple[float, float, float]:
        """:meth:`search_estimate` of replicas of the whole group on ``devices`` with gradient
        sync ``sync_s`` seconds: their summed speed, each holding parameters, gradients,
        optimizer state and its share of the activations."""
        c, n = space.costs, len(devices)
        tg = c.group_time[g, list(devices), 0]
        comp = 1.0 / float(np.sum(1.0 / np.maximum(tg, 1e-15)))
        return comp, sync_s, 2 * c.param_bytes[g] + c.opt_bytes[g] + c.act_bytes[g] / n

    @staticmethod
    def replicated_estimates(space, devices: tuple[int, ...], sync_s) -> np.ndarray:
        """[K, 3] :meth:`replicated_estimate` of every op-group at once (``sync_s``: [K] seconds or
        one number), the same floating-point operations row by row."""
        c, n = space.costs, len(devices)
        tg = np.ascontiguousarray(c.group_time[:, list(devices), 0])  # [K, n]: each row summed as one vector
        out = np.empty((space.num_groups, 3))
        out[:, 0] = 1.0 / np.sum(1.0 / np.maximum(tg, 1e-15), axis=1)
        out[:, 1] = sync_s
        out[:, 2] = 2 * c.param_bytes + c.opt_bytes + c.act_bytes / n
        return out

    def search_table(self, space, devices: tuple[int, ...], option, bmin: float, lmax: float) -> SearchTable:
        """:class:`SearchTable` of the search's action over ``devices`` with ``option`` for every
        op-group of ``space``: what the GNN predictor's features read of it (placement, batch shares,
        parameter server and :meth:`search_estimate`; ``bmin``, ``lmax`` as there). The default
        builds each group's plan (:meth:`search_plan`) and asks :meth:`search_estimate`; the built-in
        strategies compute the same numbers for all groups at once (on 512 GPUs, 128 groups x 786
        actions: no 100,000 plans of up to 512 shares), where their class's search methods are
        their own (:meth:`_search_inherited`), else through this loop."""
        plans = [self.search_plan(space, g, devices, option) for g in range(space.num_groups)]
        k, n = len(plans), max((len(gp.devices) for gp in plans), default=0)
        devs = np.full((k, n), -1, dtype=np.int64)
        shares = np.zeros((k, n))
        for g, gp in enumerate(plans):
            devs[g, :len(gp.devices)] = gp.devices
            shares[g, :len(gp.shares)] = gp.shares
        server = np.array([-1 if gp.server is None else gp.server for gp in plans], dtype=np.int64)
        est = np.array([self.search_estimate(space, g, devices, option, gp, bmin, lmax) for g, gp in enumerate(plans)],
                       dtype=np.float64).reshape(k, 3)
        return SearchTable(devs, shares, server, est)

    def _search_inherited(self, owner: type, names: tuple[str, ...]) -> bool:
        """Whether this strategy's class takes each method of ``names`` from ``owner`` (a subclass
        redefining one gets :meth:`Strategy.search_table`'s loop over its own methods)."""
        return all(getattr(type(self), name) is getattr(owner, name) for name in names)


class SearchTable(NamedTuple):
    """What the GNN predictor's features read of one search action for every op-group
    (:meth:`Strategy.search_table`; rows: op-groups)."""

    devices: np.ndarray
    """[K, n] int64: each group's ``GroupPlan.devices`` (plan order), -1 after its last."""
    shares: np.ndarray
    """[K, n] float64: each group's ``GroupPlan.shares``, 0 after its last."""
    server: np.ndarray
    """[K] int64: each group's ``GroupPlan.server``, -1 for none."""
    estimate: np.ndarray
    """[K, 3]: :meth:`Strategy.search_estimate` of each group (compute s, sync s, memory bytes)."""


_REGISTRY: Registry[Strategy] = Registry("strategy")


def register(strategy: Strategy) -> Strategy:
    """Make ``strategy`` available under ``strategy.name`` (plans select it by ``GroupPlan.sync``)."""
    return _REGISTRY.register(strategy)


unregister = _REGISTRY.unregister
strategy_names = _REGISTRY.names


def get_strategy(name: str, *, where: str = "sync") -> Strategy:
    """The strategy registered under ``name``; :class:`PlanError` naming ``where`` otherwise."""
    return _REGISTRY.get(name, where=where)


def sfb_syncs() -> dict[str, str]:
    """Registered strategy name -> the collective op of its gradient sync, of every strategy whose
    groups may take SFB (:meth:`Strategy.sfb_op`), in registration order: the ``syncs`` of
    :mod:`tag.compress` (a layer below this one, which names no strategy)."""
    return {s.name: op for s in _REGISTRY.values() if (op := s.sfb_op()) is not None}


def apply_sfb(graph, topology, plan, compute_rate=None, comm=None):
    """:func:`tag.compress.apply_sfb` over the registered strategies that take SFB
    (:func:`sfb_syncs`): a copy of ``plan`` with ``GroupPlan.sfb`` chosen by the MILP for every
    eligible group (``tag.apply_sfb``)."""
    from ..compress import apply_sfb as apply

    return apply(graph, topology, plan, compute_rate, comm, syncs=sfb_syncs())


def strategy_of(gp: GroupPlan) -> Strategy:
    """The strategy of one group's plan (``gp.sync``)."""
    s = _REGISTRY.find(gp.sync)
    return s if s is not None else get_strategy(gp.sync)


def validate_group(gp: GroupPlan, graph, g: int, num_devices: int, where: str, batch_size: int | None = None) -> None:
    """Check one group's deployment (generic fields, then its strategy's); raises
    :class:`PlanError` naming ``where``. ``batch_size`` (default: the graph's) bounds replicas."""
    s = get_strategy(gp.sync, where=f"{where}.sync")
    if not gp.devices:
        raise PlanError(f"{where}.devices: expected at least one device")
    for d in gp.devices:
        if isinstance(d, bool) or not isinstance(d, int):
            raise PlanError(f"{where}.devices: expected integer device indices, got {d!r}")
        if not 0 <= d < num_devices:
            raise PlanError(f"{where}.devices: device {d!r} out of range; topology has {num_devices} devices")
    if len(set(gp.devices)) != len(gp.devices):
        raise PlanError(f"{where}.devices: duplicate device in {gp.devices}")
    if len(gp.shares) != len(gp.devices):
        raise PlanError(f"{where}.shares: expected {len(gp.devices)} shares (one per device), got {len(gp.shares)}")
    if not isinstance(gp.recompute, bool):
        raise PlanError(f"{where}.recompute: expected true or false, got {gp.recompute!r}")
    if gp.offload is not None and not gp.sync.startswith("zero"):
        raise PlanError(f"{where}.offload: only with sharded data parallelism (sync zero1/zero2/zero3); expected "
                        f"null, got {gp.offload!r}")
    if gp.sequence_parallel and gp.sync != "tp":
        raise PlanError(f"{where}.sequence_parallel: only allowed with sync 'tp'; expected false, got true")
    if gp.sfb:
        names = {graph.ops[i].name for i in graph.groups[g].ops}
        for op in gp.sfb:
            if op not in names:
                raise PlanError(f"{where}.sfb: op {op!r} is not in this group")
    s.validate(gp, graph, g, num_devices, graph.batch_size if batch_size is None else batch_size, where)


def validate_plan(plan, graph, topology, *, source: str = "plan", pipelines: bool = True,
                  tensor_parallel: bool = False) -> None:
    """Raise :class:`PlanError` (one line) unless ``plan`` fits ``graph`` and ``topology`` and
    every group is a valid deployment of its strategy.

    ``pipelines``: accept a :attr:`Plan.pipeline <tag.plan.Plan.pipeline>` (the simulator and the
    executor run micro-batches); False for a caller that does not, so that it refuses such a plan
    in one line instead of running it as if it had none. ``tensor_parallel``: accept groups of
    sync ``tp`` of any form, i.e. any plan the simulator costs; without it only those the executor
    runs (:func:`execution_refusal`, raised as the :class:`PlanError`)."""
    plan.validate(graph, topology, source=source)
    for g, gp in enumerate(plan.groups):
        validate_group(gp, graph, g, topology.num_devices, f"{source}: groups[{g}]", plan.batch_size)
    for name in dict.fromkeys(gp.sync for gp in plan.groups):
        get_strategy(name).check_plan(plan, graph, topology, source)
    if not tensor_parallel:
        why = execution_refusal(plan)
        if why is not None:
            raise PlanError(f"{source}: {why}")
    validate_pipeline(plan, graph, topology.num_devices, source=source)
    if plan.pipeline is not None and not pipelines:
        raise PlanError(f"{source}: pipeline: this caller runs no micro-batches; expected no pipeline field")


def execution_refusal(plan) -> str | None:
    """The one rule of what the executor runs: None when ``tag execute`` runs ``plan`` (anything
    with ``groups`` and ``pipeline``, already valid for the simulator), else one line naming the
    first field it does not run. Each strategy the plan uses judges its groups
    (:meth:`Strategy.execution_refusal`); of the built-in ones only ``tp`` refuses forms
    (:meth:`tag.parallel.TensorParallel.execution_refusal`: ``tp`` beside other groups, over other
    devices, degrees or shares, sequence parallelism, pipelines of ``tp`` stages).

    The executor refuses through :func:`validate_plan` (``tensor_parallel=False``); the search's
    ``executable`` constraint (:class:`tag.search.space.ActionSpace`) and ``tag plan``'s
    "simulated only" line call it too.

    Activation recomputation (``GroupPlan.recompute``) runs on every strategy (on ``tp`` the
    recomputed forward all-reduces again, as Megatron-LM's), without SFB; a group whose forward
    draws random numbers (dropout) recomputes from the random state its forward started from, so
    it draws the same masks (:meth:`tag.executor.runtime.RankRuntime.run_segment`)."""
    for name in dict.fromkeys(gp.sync for gp in plan.groups):
        why = get_strategy(name).execution_refusal(plan)
        if why is not None:
            return why
    for g, gp in enumerate(plan.groups):
        if not gp.recompute:
            continue
        if gp.sfb:
            return (f"groups[{g}].recompute: recomputation with SFB is simulated only (the SFB factors are "
                    "forward values the recomputation drops); expected false or no sfb")
    return None


# ---- helpers shared by the built-in strategies ---------------------------------------------------

def check_shares(gp: GroupPlan, batch_size: int, where: str, width: int = 1) -> None:
    """Replicas of a batch split: positive shares summing to 1, at least one sample per sample
    replica (``width`` devices each, :meth:`Strategy.width`)."""
    if any((not isinstance(s, (int, float))) or not s > 0 or math.isnan(s) for s in gp.shares):
        raise PlanError(f"{where}.shares: expected positive fractions, got {gp.shares}")
    if abs(sum(gp.shares) - 1.0) > 1e-6:
        raise PlanError(f"{where}.shares: must sum to 1, got {sum(gp.shares):.6g}")
    replicas = len(gp.devices) // width
    if replicas > batch_size:
        raise PlanError(f"{where}.devices: {replicas} replicas but batch {batch_size}; "
                        "every replica needs at least one sample")


def no_field(gp: GroupPlan, field: str, where: str, owner: str) -> None:
    """``gp.<field>`` must be unset (it belongs to strategy ``owner``)."""
    if getattr(gp, field) is not None:
        raise PlanError(f"{where}.{field}: only allowed with sync {owner!r}")


def sample_replicas(devices, shares, batch_size: int, width: int = 1) -> list[Replica]:
    """Replicas on ``devices`` with contiguous sample ranges of ``local_batches(batch_size,
    shares)`` sizes, one share per range; with ``width > 1`` each run of ``width`` consecutive
    devices holds one range (:meth:`Strategy.replica_shares`: a tensor-parallel group's devices
    computing the same samples)."""
    key = (tuple(devices), tuple(shares), batch_size, width)
    reps = _REPLICAS.get(key)
    if reps is None:
        sizes = local_batches(batch_size, list(shares))
        stops = list(itertools.accumulate(sizes))
        starts = [0] + stops[:-1]
        if width > 1:
            starts, stops = ([x for x in xs for _ in range(width)] for xs in (starts, stops))
        reps = tuple(map(Replica, devices, starts, stops))
        if len(_REPLICAS) > 512:  # bounded: ~20 MB of replicas at 512 per split
            _REPLICAS.clear()
        _REPLICAS[key] = reps
    return list(reps)


_REPLICAS: dict[tuple, tuple[Replica, ...]] = {}
"""(devices, shares, batch) -> replicas (immutable): a search on a homogeneous 512-GPU cluster
lowers the same batch split for every group (512 replicas each)."""


__all__ = ["Collective", "Replica", "SearchTable", "Strategy", "Unit", "UnitKey", "apply_sfb", "execution_refusal", "get_strategy",
           "group_positions", "register", "sfb_syncs",
           "strategy_names", "strategy_of", "unregister", "validate_group", "validate_plan"]
