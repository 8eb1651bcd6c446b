"""Sharded data parallelism: ZeRO-1/2/3 (FSDP) and hybrid sharding (``sync`` ``zero1`` /
``zero2`` / ``zero3``, :class:`Sharded`).

Every device of ``GroupPlan.devices`` is a replica running the whole op-group on its share of the
batch, as :class:`~tag.parallel.DataParallel`'s; what differs is which training state a device
holds and how the gradients are summed. The devices form shard groups of ``S = GroupPlan.shard``
consecutive devices (default all of them); a group's parameters, concatenated in the order of the
gradient buckets (:mod:`tag.parallel.buckets`) and padded to a multiple of ``S``, are cut into
``S`` equal shards, member ``i`` of a shard group owning shard ``i``:

* ``zero1`` (ZeRO stage 1, DeepSpeed's ``stage=1``, Megatron-LM's distributed optimizer): the
  optimizer state is sharded. Gradients are all-reduced over all replicas (as ``allreduce``);
  each device applies the optimizer to its shard of the parameters, then the shard group
  all-gathers the updated parameters.
* ``zero2`` (+ gradients): the gradient sync is a reduce-scatter (collective ``reducescatter``,
  :func:`tag.cost.comm.shard_of_op`): each device keeps the sum of its shard only, the optimizer
  step and the all-gather of the parameters follow as in ``zero1``.
* ``zero3`` (+ parameters, FSDP's ``FULL_SHARD``): a device holds its parameter shard only; the
  shard group all-gathers a group's parameters before its forward and again before its backward
  (the next group's gather prefetched while the group computes), and frees them after use; the
  gradients are reduce-scattered; the optimizer step updates the shard, nothing is gathered
  after it. Under bf16 / fp16 the weights autocast reads only through a cast are gathered in
  that dtype, cast on the shard before the gather (FSDP2's ``param_dtype``), the gradients
  reduce-scattered in fp32 (:mod:`tag.executor.sharded`).
* hybrid sharding (``shard < len(devices)``, FSDP's ``HYBRID_SHARD``, torchtitan's HSDP): the
  state is sharded within each shard group and replicated across the ``len(devices) / shard``
  groups; the gradient sync reduce-scatters inside each shard group and all-reduces each shard
  across the groups (``reducescatter/S``); the gathers stay inside the shard group. With
  ``zero1`` the gradients are all-reduced over all devices, as without hybrid sharding.

Costed by :mod:`tag.sim.sharded` (gathers inside the compute stream, overlapped by prefetch on
GPUs; sharded bytes), run by :mod:`tag.executor.sharded` (flat buckets sharded as FSDP2's, on
torch.distributed's ``reduce_scatter_tensor`` / ``all_gather_into_tensor``). Composes with pipelines (each stage's groups sharded over the stage's replicas,
FSDP x PP as torchtitan composes them; run on gloo, tests/test_sharded_pipeline.py); not with tensor parallelism (a group is ``tp`` or sharded; ``zero`` and ``tp > 1`` in one layout
are refused) nor with SFB (``GroupPlan.sfb`` is refused: the gradients are reduce-scattered).
"""

from __future__ import annotations

from typing import NamedTuple

from ..cost.comm import ring_allgather_time, ring_allreduce_time, ring_reducescatter_time
from ..errors import PlanError
from ..plan.format import GroupPlan
from .data_parallel import DataParallel
from .strategy import Collective, check_shares, no_field

LEVELS = (1, 2, 3)
"""ZeRO stages: 1 optimizer state, 2 + gradients, 3 + parameters sharded."""
OFFLOADS = ("optimizer",)
"""``GroupPlan.offload`` values: ``optimizer`` (ZeRO-Offload). Parameters stay in GPU memory:
offloading them too (ZeRO-Infinity's ``offload_param``, PatrickStar's chunks) is not modelled."""


class ZeroOption(NamedTuple):
    """A sharded search action's option (``Action.tp``) where it offloads: devices per shard group
    (None: all) and the ``GroupPlan.offload``. An action without offload keeps the plain shard size
    (None or an int) as its option."""

    shard: int | None
    offload: str

    def __str__(self) -> str:
        return f"{self.shard or ''}+{self.offload}"


def sync_name(level: int) -> str:
    """The ``GroupPlan.sync`` of ZeRO stage ``level``."""
    return f"zero{level}"


def shard_size(gp: GroupPlan) -> int:
    """Devices per shard group of a sharded group's plan (``GroupPlan.shard``, default all)."""
    return gp.shard if gp.shard else len(gp.devices)


def shard_groups(gp: GroupPlan) -> list[list[int]]:
    """The shard groups of ``gp``: runs of :func:`shard_size` consecutive devices (plan order)."""
    s = shard_size(gp)
    return [list(gp.devices[i:i + s]) for i in range(0, len(gp.devices), s)]


def sharded_bytes(level: int, shard: int, param_bytes, opt_bytes):
    """Bytes of a group's parameters, gradients and optimizer state one device holds for the
    whole iteration (numbers or arrays): the optimizer state over ``shard``, with ``level >= 2``
    the gradients, with ``level == 3`` the parameters too (the gathered copies are transient)."""
    p, o = param_bytes, opt_bytes
    return (p if level < 3 else p / shard) + (p if level < 2 else p / shard) + o / shard


def offloaded_bytes(level: int, shard: int, param_bytes, opt_bytes):
    """``(device, host)`` bytes of a group offloaded (``offload`` ``optimizer``) that one device
    holds for the whole iteration, and its host for it. The device: its parameters (``P``;
    ``zero3``: the shard ``P / S``), with ``zero1`` the all-reduced gradient ``P`` (``zero2`` /
    ``zero3``: the gradient shard goes to the host at the sync; until then it is transient). The
    host: the FP32 parameter shard it updates, the gradient shard and the optimizer state shard,
    ``(2 P + O) / S``."""
    p, o = param_bytes, opt_bytes
    return (p if level < 3 else p / shard) + (p if level == 1 else 0 * p), (2 * p + o) / shard


class Sharded(DataParallel):
    """ZeRO stage :attr:`level` over the replicas of a data-parallel group (module docstring)."""

    collective_op = "allreduce"
    search_pass = 2
    """After ``tp``'s actions (pass 1): the shipped predictor's action indices stay."""
    feature_sync = "allreduce"
    """Read by the GNN predictor as data parallel (its sync and memory estimates tell it apart)."""

    def __init__(self, level: int):
        if level not in LEVELS:
            raise ValueError(f"level: expected one of {LEVELS}, got {level!r}")
        self.level = level
        self.name = sync_name(level)
        self.casts_per_use = level == 3  # (cast from the gathered parameters, freed with them)

    def validate(self, gp: GroupPlan, graph, g: int, num_devices: int, batch_size: int, where: str) -> None:
        check_shares(gp, batch_size, where)
        no_field(gp, "mp_splits", where, "mp")
        no_field(gp, "tp", where, "tp")
        no_field(gp, "server", where, "ps")
        if gp.sfb:
            raise PlanError(f"{where}.sfb: not with sharded data parallelism (its gradients are reduce-scattered); "
                            "expected []")
        if gp.offload is not None and gp.offload not in OFFLOADS:
            raise PlanError(f"{where}.offload: expected one of {list(OFFLOADS)} or null, got {gp.offload!r}")
        s = gp.shard
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1 or len(gp.devices) % s):
            raise PlanError(f"{where}.shard: expected a divisor of the group's {len(gp.devices)} devices, got {s!r}")

    def execution_refusal(self, plan) -> str | None:
        """Sharded groups beside ``tp`` groups are simulated only (each runs by an execution of its
        own, :mod:`tag.executor.strategies`)."""
        g = next((g for g, gp in enumerate(plan.groups) if gp.sync == "tp"), None)
        if g is not None:
            return (f"groups[{g}].sync: tensor parallelism beside sharded data parallelism ({self.name}) is "
                    "simulated only; expected one of them")
        return None

    def normalise(self, gp: GroupPlan, has_params: bool) -> GroupPlan:
        """One replica or no parameters: a plain all-reduce plan (nothing to shard); a shard group
        of every device: ``shard`` unset."""
        if (len(gp.devices) == 1 and gp.offload is None) or not has_params:  # (offloaded: one replica too)
            gp.sync, gp.shard, gp.offload = DataParallel.name, None, None
        elif gp.shard == len(gp.devices):
            gp.shard = None
        return gp

    def sfb_op(self) -> str | None:
        return None

    def sync_op(self, gp: GroupPlan) -> str:
        """The gradient collective's op: ``allreduce`` (``zero1``), ``reducescatter`` (the shard
        group of every device) or ``reducescatter/S`` (hybrid)."""
        s = shard_size(gp)
        if self.level == 1:
            return "allreduce"
        return "reducescatter" if s == len(gp.devices) else f"reducescatter/{s}"

    def collective(self, gp: GroupPlan) -> Collective | None:
        c = Collective(self.sync_op(gp), tuple(gp.devices))
        return c if len(c.members) > 1 else None

    def unheld_state_bytes(self, gp: GroupPlan, graph, groups: list[int]) -> float:
        mine = [q for q in graph.params if q.group in set(groups)]
        p, o = float(sum(q.nbytes for q in mine)), float(sum(q.opt_state_bytes for q in mine))
        held = offloaded_bytes(self.level, shard_size(gp), p, o)[0] if gp.offload else \
            sharded_bytes(self.level, shard_size(gp), p, o)
        return 2 * p + o - held

    # ---- the search's actions: ZeRO-3 only (FSDP, the recipe users start from), full or hybrid,
    # and full with its optimizer offloaded
    def search_options(self, devices: tuple[int, ...], family: str, space) -> list:
        """``zero3``: full sharding over every device or one machine (:attr:`search_families`),
        hybrid sharding over one machine's devices where the subset spans several machines holding
        equally many of them (the option: the shard size), and over every device full sharding
        with the optimizer offloaded (:class:`ZeroOption`: ZeRO-Offload, the ``fsdp-offload``
        recipe; one action more, not one a machine); ``zero1`` / ``zero2``: none (the layouts
        offer them)."""
        if self.level != 3 or len(devices) < 2 or family not in self.search_families:
            return []
        offload = [ZeroOption(None, OFFLOADS[0])] if family == "all" else []
        machines = [space.topology.machine_of(d) for d in devices]
        runs = 1 + sum(a != b for a, b in zip(machines, machines[1:]))  # (a machine's devices consecutive)
        s = len(devices) // len(set(machines))
        hybrid = runs == len(set(machines)) > 1 and s > 1 and all(machines.count(m) == s for m in set(machines))
        return [None, s, *offload] if hybrid else [None, *offload]

    @staticmethod
    def search_option_parts(option) -> tuple[int | None, str | None]:
        """``(shard, offload)`` of a search option (:meth:`search_options`)."""
        return (option.shard, option.offload) if isinstance(option, ZeroOption) else (option, None)

    def search_group_size(self, option) -> int | None:
        return self.search_option_parts(option)[0]

    search_families = ("all", "machine")
    """Device-subset families (:func:`tag.search.space.device_subsets`) offered ZeRO-3: every device
    (FSDP's recipe) and one machine (the action space stays tractable on large clusters)."""

    def search_plan(self, space, g: int, devices: tuple[int, ...], option) -> GroupPlan:
        gp = super().search_plan(space, g, devices, option)
        shard, offload = self.search_option_parts(option)
        if len(devices) > 1 or offload:
            gp.sync, gp.shard, gp.offload = self.name, shard, offload
        return gp

    def search_key(self, space, g: int, devices: tuple[int, ...], option) -> tuple:
        offload = self.search_option_parts(option)[1]
        if (len(devices) == 1 and not offload) or space.costs.param_bytes[g] == 0:
            return (devices, DataParallel.name)
        return (devices, self.name, option)

    def search_estimate(self, space, g: int, devices: tuple[int, ...], option, plan: GroupPlan, bmin: float,
                        lmax: float) -> tuple[float, float, float]:
        """Replicas at their summed speed over the slowest link: the sync a ring reduce-scatter
        (``zero1``: all-reduce) plus the parameter all-gathers (two for ``zero3``, one after the
        step otherwise) of the bytes the simulator gathers (``GroupCosts.gather_bytes``: the
        cast-only weights in bf16 / fp16, :func:`tag.graph.precision.param_gather_bytes`), and
        offloaded the host step (:meth:`host_step_estimate`); memory the sharded state (offloaded:
        the device's part) plus the gathered parameters (``zero3``)."""
        n, c = len(devices), space.costs
        shard, offload = self.search_option_parts(option)
        if n == 1 and not offload:
            return self.replicated_estimate(space, g, devices, 0.0)
        s = shard or n
        p, o, pg = float(c.param_bytes[g]), float(c.opt_bytes[g]), float(c.gather_bytes[g])
        sync = 0.0
        if n > 1:
            sync = ring_allreduce_time(n, p, bmin, lmax) if self.level == 1 else ring_reducescatter_time(n, p, bmin, lmax)
            sync += (2 if self.level == 3 else 1) * ring_allgather_time(s, pg, bmin, lmax)
        held = sharded_bytes(self.level, s, p, o)
        if offload:
            sync += self.host_step_estimate(space, devices, p, o, s)
            held = offloaded_bytes(self.level, s, p, o)[0]
        comp, _, _ = self.replicated_estimate(space, g, devices, sync)
        return comp, sync, held + (pg if self.level == 3 else 0.0) + float(c.act_bytes[g]) / n

    @staticmethod
    def host_step_estimate(space, devices: tuple[int, ...], p: float, o: float, s: int) -> float:
        """Seconds of an offloaded step (:func:`tag.sim.sharded.host_step`'s rule at the subset's
        busiest machine): the gradient shard down and the parameter shard up its host link, shared
        by its devices of the subset, and the Adam update on its CPU reading and writing the
        parameter, gradient and optimizer-state shards (``2 (2 P + O) / S`` bytes)."""
        topo = space.topology
        machines = [topo.machine_of(d) for d in devices]
        return max(machines.count(m) * (2 * p / s / topo.machines[m].host_link
                                        + 2 * (2 * p + o) / s / topo.machines[m].host_memory_bw)
                   for m in set(machines))

    def search_table(self, space, devices: tuple[int, ...], option, bmin: float, lmax: float):
        """:meth:`Strategy.search_table`'s loop over this class's own methods."""
        from .strategy import Strategy

        return Strategy.search_table(self, space, devices, option, bmin, lmax)


SHARDED = tuple(Sharded(level) for level in LEVELS)
"""The registered instances, ``zero1`` .. ``zero3`` (:func:`tag.parallel.register`)."""


__all__ = ["LEVELS", "OFFLOADS", "SHARDED", "Sharded", "ZeroOption", "offloaded_bytes", "shard_groups", "shard_size", "sharded_bytes",
           "sync_name"]
