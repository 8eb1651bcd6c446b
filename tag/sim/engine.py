"""The event-driven simulator of one training iteration under a plan.

Resources: every device has a **compute stream** and a **communication stream** (so compute
overlaps transfers); every machine has a network link with an outgoing and an incoming side,
shared by all flows and collectives crossing machines (contended: they take turns). Each resource
serves its tasks in the executor's global step order (:mod:`tag.parallel.schedule`): for every
unit in forward order the transfers into its forward stage, then the stage; the same for the
backward stages in reverse order; then the gradient buckets in launch order; then
one optimizer step per device. A task starts when its inputs are ready and every resource it uses
is free, so the iteration is a max-plus system: shorter tasks (faster devices, more bandwidth)
never make any task finish later.

Tasks: compute stages (per replica), point-to-point messages (``latency + bytes / bandwidth``;
the flows from one device to another that one stage needs are one message, as the executor's CPU
ranks pack them; occupy both endpoints' comm streams, and both machines' network sides when crossing machines;
a flow is a rendezvous, as in the executor, where sender and receiver post their halves at the
step of the schedule and wait for them: it starts once both endpoints' compute streams reached
that step, and the receiver's compute stream waits for it to finish, the sender's too on a CPU
device or in a step where it also receives: a GPU rank posting only sends computes on, its sends
waiting for their data alone (the sender's compute need not reach the step), as the executor's
:meth:`tag.executor.comm.DistComm._exchange`; every sender waits under
:attr:`Simulator.blocking_sends`, as runtimes whose pipeline sends block),
all-gathers completing the pieces scattered into a tensor-parallel group from another machine
(Megatron-LM's scatter-gather, :mod:`tag.parallel.moves` ``shard``; one per group and stage after
the last of its messages, holding the group's comm and compute streams, as the executor's
blocking all-gather in its transfer step),
gradient buckets (:meth:`Simulator.sync_jobs`: the groups' syncs bucketed as the executor's
schedule buckets them, :mod:`tag.parallel.buckets`, about 25 MiB as DDP; each one collective over
the replica set, or PS push+pull, over its groups' concatenated gradients, see
:mod:`tag.cost.comm`), each starting once the backward of its last group ended (and the previous
collective over its members: one collective stream per device), so on a GPU it overlaps the
backward of the earlier groups; it occupies every participant's comm stream and the network sides
of the machines it spans; on a CPU device, whose rank computes on every core it has, a bucket also
waits for the device's compute (:attr:`Simulator.shared_stream`)), optimizer steps (after the
device's last compute and its last bucket).

Sufficient Factor Broadcasting (``GroupPlan.sfb``, :mod:`tag.sim.sfb`): right after an SFB
group's backward stage (once every replica finished it), the all-gathers of its factors, one
after the other over the replicas (comm streams and network sides, served like point-to-point
transfers: before the gradient syncs); then every replica recomputes the SFB gradients on the
global batch on its compute stream (before its next stage); then the group's remaining
gradients are synchronised (the sync waits for the last replica's recompute). The executor's
order, docs/design.md "Sufficient Factor Broadcasting".

Wake penalty (CPU devices with a profiled one, :mod:`tag.cost.profiler`): the first stage of a
segment on a device that idled ``gap`` seconds since its last compute (blocked on transfers)
takes ``wake * (1 - exp(-gap / tau)) / (1 - exp(-gap_s / tau))`` longer (:func:`wake_extra`).

Speed: runs of consecutive stages on one data-parallel layout with no incoming transfer form a
*segment* computed with one numpy expression (cumulative sums over groups). One event loop
(:class:`tag.sim.event_loop.Run`) computes every time; it records nothing unless given a
:class:`tag.sim.recorder.Recorder`, which it calls with each task's times (the critical path,
replayed on first access, and the timeline of ``trace=True``). The flows between two groups'
deployments are cached by what they depend on (:class:`PairTemplate`).

Modules, each importing only those after it: this one (the :class:`Simulator`: deployments,
caches, syncs, pairs), :mod:`tag.sim.event_loop` (the loop), :mod:`tag.sim.recorder`,
:mod:`tag.sim.holdings` (memory account, optimizer steps, the result), :mod:`tag.sim.program`
(a pipeline's program), :mod:`tag.sim.flows` (transfers between deployments), then
:mod:`tag.sim.units` and :mod:`tag.sim.static`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..errors import PlanError
from ..parallel.buckets import assign_buckets, bucket_caps
from ..parallel.strategy import strategy_of
from .event_loop import Run, WakePenalty
from .flows import PairFlows, pack_messages
from .holdings import holdings
from .program import build_program
from .recorder import PHASE_NAME, Recorder
from .result import SimResult
from .static import FWD, build_static
from .strategies import costing_of
from .units import (
    ENTRY_BYTES,
    FLOW_BYTES,
    CacheMeter,
    GroupData,
    Layout,
    PairTemplate,
    SyncJob,
    Unit,
    make_layout,
    mp_unit,
    pair_kinds,
    recompute_layout,
    ref_bytes,
    seq_bytes,
)

_Run = Run  # (the names this module had for them: tests and tools import them from here)
_Recorder = Recorder
_holdings = holdings
__all__ = ["CACHE_BYTES", "PHASE_NAME", "Simulator", "check_cache_bytes", "plan_key"]

CACHE_BYTES = 2 * 1024**3
"""Default :attr:`Simulator.cache_bytes`: 2 GiB of plan-derived data. Measured 2026-11-27 on GPT-2
medium (bf16, 64 groups) on h100-512gpu: random search derives about 8.5 MB per plan (200 plans:
1.7 GB accounted, 1.2 GB by recursive ``sys.getsizeof``), so its 2000 playouts peaked at 14.0 GB
RSS before this limit and 3.1 GB under it (``evaluation.planner_bench --scale --pairs 6``);
uniform MCTS's 2000 playouts there hold 534 MB and never reach it."""


def check_cache_bytes(value) -> int:
    """``value`` as :attr:`Simulator.cache_bytes` (None: :data:`CACHE_BYTES`); anything but a
    positive whole number of bytes is refused with a :class:`ValueError` naming it."""
    if value is None:
        return CACHE_BYTES
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"cache_bytes: expected a positive whole number of bytes, got {value!r}")
    return int(value)


def plan_key(gp) -> tuple:
    """Cache key of a GroupPlan: :meth:`GroupPlan.key` without rounding the shares (20x cheaper;
    shares that differ by float noise merely miss the cache, the derived data is the same)."""
    splits = gp.mp_splits
    return (tuple(gp.devices), tuple(gp.shares), gp.sync, gp.server, tuple(splits) if splits else (), tuple(gp.sfb),
            gp.tp, gp.sequence_parallel, gp.recompute, gp.shard, gp.offload)


class Simulator:
    """Simulate plans of one graph on one topology; build once, call :meth:`run` many times."""

    runs_pipelines = True
    """Capability read by :func:`tag.planner.runs_pipelines`: :meth:`run` costs pipelined plans
    (``pipeline=``), so the planner searches them."""

    def __init__(self, graph, topology, costs=None, bucket_bytes: int | None = None, cache_bytes: int | None = None,
                 *, blocking_sends: bool = False):
        from ..cost.model import CostModel

        if not isinstance(blocking_sends, bool):
            raise ValueError(f"blocking_sends: expected True or False, got {blocking_sends!r}")
        self.blocking_sends = blocking_sends
        """Every pipeline sender's compute stream waits for its sends to complete, as a runtime
        whose stage sends block does (DeepSpeed's pipeline engine, Megatron-LM's schedules:
        ``evaluation.external.BLOCKING_SEND_RUNTIMES``): each send is then a rendezvous at its
        step of TAG's schedule, as a CPU rank's, which can run a sender's next compute before a
        send that Megatron-LM's 1F1B pairs with its receive (``send_backward_recv_forward``):
        GPT-2 1 x 32, 4 micro-batches on 2 V100 over 1 Gbit/s, 17.14 -> 20.01 ms an iteration
        for 0.35 ms of stage 0's sends (tests/test_pipeline_exec.py). False (TAG's executor,
        asynchronous sends): a GPU rank that receives nothing in a step computes on while its
        sends go (:meth:`messages`)."""

        self.bucket_bytes = bucket_bytes
        """Cap of the gradient buckets (:func:`tag.parallel.buckets.bucket_caps`; None: DDP's)."""
        bucket_caps(bucket_bytes)  # a bad cap is refused here, not at the first plan
        self.cache_bytes = check_cache_bytes(cache_bytes)
        """Bytes (approximate, :attr:`cached_bytes`) the plan-derived caches may hold before a
        simulation: past it, they are all emptied before the simulation starts (None:
        :data:`CACHE_BYTES`). They hold derived data only: the results are the same under any
        limit, a smaller one only re-derives more."""
        self.cache_clears = 0
        """How many times the caches were emptied for :attr:`cache_bytes`."""
        self.graph = graph
        self.topology = topology
        self.background_paths: dict = {}
        """Machines (a message's pair, a collective's) -> background profile or None
        (:meth:`tag.sim.event_loop.Run._slowed`)."""
        self.time_offset_s = 0.0
        """Seconds of a background profile (:mod:`tag.topology.background`) at which the iteration
        starts (the iterations before it, when replaying a run over a trace)."""
        self.costs = costs if costs is not None else CostModel.for_topology(graph, topology)
        self.static = build_static(graph)
        self.comm = self.costs.comm
        self._device_tables()
        self.num_devices = topology.num_devices
        self.num_machines = topology.num_machines
        self.capacity = [float(d.gpu.memory_bytes) for d in topology.devices]
        self.step_overhead = [self.costs.step_overhead(d) for d in range(self.num_devices)]
        self.device_names = [f"{d.name} ({d.gpu.name})" for d in topology.devices]
        self.shared_stream = [d.gpu.name == "cpu" for d in topology.devices]
        """Per device: communication shares the compute cores (a CPU rank uses every core it has
        for compute, so gloo has no spare core to progress a collective: gradient buckets start
        after the device's compute). GPUs have copy engines: their buckets overlap compute."""
        self._serial = 0
        self._empty_caches()
        self._pair_tables()
        self._sfb = None  # tag.sim.sfb.SfbCosts, built on the first plan using SFB
        self.wake = self._wake_penalties()
        """Per device: its wake penalty (:meth:`tag.cost.CostModel.wake_penalty`), or None."""
        self.any_wake = any(w is not None for w in self.wake)

    def _device_tables(self) -> None:
        """The cost tables per device class (devices sharing one table object share a class)."""
        class_tables: list[np.ndarray] = []
        self.dev_class: list[int] = []
        for d in range(self.topology.num_devices):
            t = self.costs.table(d)
            k = next((i for i, x in enumerate(class_tables) if x is t), None)
            if k is None:
                k = len(class_tables)
                class_tables.append(t)
            self.dev_class.append(k)
        self.tables = np.stack(class_tables)  # [C, K, 3, B+1]
        self.hosts = self._host_tables()
        """(host seconds, lags) [C, K, 2, B+1] of the forward and backward stages and per class whether
        its costs hold the host apart (:meth:`tag.cost.CostModel.host_parts`; ``tables``' forwards and
        backwards are then the device's seconds, the host a timeline of its own:
        :meth:`tag.sim.event_loop.Run._phase`), or None where no class does."""
        cast_host_of = getattr(self.costs, "cast_host_seconds", None)
        self.cast_hosts = None if self.hosts is None or cast_host_of is None else \
            np.stack([cast_host_of(self.dev_class.index(c)) for c in range(len(class_tables))])
        """[C, K] host seconds launching each group's forward parameter casts per device class, part of
        :attr:`hosts`' forwards (None: no host apart): a pipeline's later micro-batches launch none."""
        cast_of = getattr(self.costs, "cast_seconds", None)  # (a cost model without parameter casts: none)
        self.casts = np.stack([cast_of(self.dev_class.index(c)) if cast_of is not None
                               else np.zeros(self.graph.num_groups) for c in range(len(class_tables))])
        """[C, K] seconds of each group's forward parameter casts per device class
        (:meth:`tag.cost.CostModel.cast_seconds`), part of ``tables``' forwards: charged once per
        iteration (a pipeline's first micro-batch, :meth:`warm_layout`; not in a recomputation)."""
        self.any_casts = bool(self.casts.any())

    def _pair_tables(self) -> None:
        """The graph's group pairs as arrays (:meth:`_groups_moving`)."""
        # Pairs without non-batch gradients: no flow when both groups share one layout.
        local = {pair for pair, edges in self.static.edges.items() if not any(e.grad for e in edges)}
        self._pair_list = [(g1, g2, (g1, g2) in local) for g1, g2 in self.static.pairs]
        self._pair_src = np.array([g1 for g1, _ in self.static.pairs], dtype=np.int64)
        self._pair_dst = np.array([g2 for _, g2 in self.static.pairs], dtype=np.int64)
        self._pair_self = self._pair_src == self._pair_dst
        self._pair_nonlocal = np.array([not loc for _, _, loc in self._pair_list], dtype=bool)

    def _wake_penalties(self) -> list[WakePenalty | None]:
        penalty = getattr(self.costs, "wake_penalty", None)
        out: list[WakePenalty | None] = []
        for d in range(self.topology.num_devices):
            w = penalty(d) if penalty is not None else None
            out.append(None if w is None else WakePenalty(w[0], w[2], 1.0 / (1.0 - math.exp(-w[1] / w[2]))))
        return out

    def _host_tables(self):
        """:attr:`hosts`, putting the device seconds of each class holding its host apart in
        :attr:`tables` (their optimizer steps as they were: after the iteration's syncs)."""
        parts_of = getattr(self.costs, "host_parts", None)
        classes, groups, _, batches = self.tables.shape
        host, lag, apart = np.zeros((classes, groups, 2, batches)), np.zeros((classes, groups, 2, batches)), []
        for c in range(classes):
            p = None if parts_of is None else parts_of(self.dev_class.index(c))
            apart.append(p is not None)
            if p is not None:
                self.tables[c, :, :2] = p.device[:, :2]
                host[c], lag[c] = p.host[:, :2], p.lag[:, :2]
        return (host, lag, apart) if any(apart) else None

    # ---- cached plan-derived data -------------------------------------------------------
    def _empty_caches(self) -> None:
        """Start every plan-derived cache afresh (what a new simulator holds)."""
        self._meter = CacheMeter()
        self._buckets: dict[tuple, float] = {}  # ((op, devices, server), bytes) -> seconds of a sync
        self._sync_jobs: dict[tuple[int, ...], list] = {}  # the groups' serials -> sync_jobs (read-only)
        self._layouts: dict[tuple, Layout] = {}
        self._caches: dict[str, dict] = {}  # a group costing's own caches (cache())
        self._groups: dict[tuple, GroupData] = {}
        self._pairs: dict[tuple, PairFlows] = {}
        self._kinds: dict[tuple[int, int], tuple] = {}  # dp -> dp group pair -> (kinds id, kinds)
        self._kind_ids: dict[tuple, tuple] = {}  # pair_kinds -> (id, kinds)
        self._templates: dict[tuple, PairTemplate] = {}
        self._messages: dict[tuple, tuple] = {}  # ids of flow tuples -> (those tuples, their messages)
        self._pieces: dict[tuple, list] = {}  # the pair templates' pieces (PairTemplate)

    @property
    def cached_bytes(self) -> int:
        """Approximate bytes the plan-derived caches hold: each entry's estimate (arrays by their
        ``nbytes``, tuples of numbers by :func:`tag.sim.units.seq_bytes`, flows by
        :data:`FLOW_BYTES`) added when it is made (:meth:`charge`)."""
        return self._meter.bytes

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` (approximate) more in the caches: whoever stores an entry in them
        (:meth:`cache`, :meth:`store_layout`) charges its estimate."""
        self._meter.bytes += nbytes

    def fit_caches(self) -> None:
        """Empty every cache if they hold more than :attr:`cache_bytes`. Called before a
        simulation (:meth:`run`, :meth:`moved_bytes`, :func:`tag.sim.bounds.plan_bound`), never
        within one: the groups of one run share their layouts (one object per replica set, what
        its vectorised segments and transfers are decided by), and a fresh set of caches gives
        the same results as a new simulator. All of them at once: a layout dropped while a kept
        group holds it would give later groups on those replicas another layout object, other
        segments, and times differing in the last bits (the entry-count limits before 2026-11-27
        dropped ``_layouts`` alone so)."""
        if self._meter.bytes > self.cache_bytes:
            self.cache_clears += 1
            self._empty_caches()

    def cache(self, name: str) -> dict:
        """A dict for a group costing's own derived data (:mod:`tag.sim.strategies`; ``name``: its
        owner, e.g. ``"tp-shares"``), emptied with the others (:meth:`fit_caches`); whoever stores
        an entry in it counts its bytes (:meth:`charge`)."""
        c = self._caches.get(name)
        if c is None:
            c = self._caches[name] = {}
        return c

    def store_layout(self, key: tuple, lay: Layout) -> Layout:
        """Keep ``lay`` as the layout of ``key`` (a unique :attr:`Layout.uid`; its bytes counted)."""
        self._serial += 1
        lay.uid = self._serial
        lay.meter = self._meter
        self._meter.bytes += lay.nbytes + ENTRY_BYTES
        self._layouts[key] = lay
        return lay

    def layout(self, devices: tuple[int, ...], batches: tuple[int, ...]) -> Layout:
        key = (devices, batches)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self.store_layout(key, make_layout(self.static, self.tables, self.dev_class, devices, batches,
                                                     self.hosts))
        return lay

    def group_data(self, g: int, gp, key=None, batch: int | None = None) -> GroupData:
        """Units and synchronisation of group ``g`` deployed as ``gp`` (cached by its key);
        ``batch``: the samples it runs at once (a micro-batch; default the graph's batch)."""
        key = (g, plan_key(gp) if key is None else key) if batch is None else (g, plan_key(gp), batch)
        deployment = self._groups.get(key)
        if deployment is None:
            deployment = self._make_group(g, gp, batch)
            self._serial += 1
            deployment.serial = self._serial
            deployment.layout_id = deployment.layout.uid if deployment.layout is not None else -deployment.serial
            self._groups[key] = deployment
            # the key's devices and shares; each unit's devices, batches and starts
            self._meter.bytes += (ref_bytes(len(gp.devices)) + seq_bytes(len(gp.shares)) + ENTRY_BYTES
                                  + sum(3 * ref_bytes(len(u.devices)) + ENTRY_BYTES for u in deployment.units))
        return deployment

    def _make_group(self, g: int, gp, batch: int | None = None) -> GroupData:
        """Cost the lowering of ``gp`` by its strategy (:mod:`tag.parallel`): a unit running the
        whole group on a batch split (a vectorised :class:`Layout`) or position chunks on one
        device each (:func:`mp_unit`), and the gradient collective; or the strategy's own group
        costing where one is registered (:mod:`tag.sim.strategies`). ``batch``: samples per run
        (a pipeline's micro-batch; default the graph's batch)."""
        static, comm = self.static, self.comm
        strategy = strategy_of(gp)
        lowered = strategy.units(g, gp, self.graph, static.batch_size if batch is None else batch)
        costing = costing_of(gp.sync)
        if costing is not None:  # a strategy costed its own way (tag.sim.strategies; tp's: tag.sim.tensor_parallel)
            return costing(self, g, gp, lowered)
        devs = tuple(gp.devices)
        sync_bytes = float(static.grad_bytes[g])
        sfb = None
        if gp.sfb:  # validated here (PlanError naming the op); its gradients leave the sync
            if self._sfb is None:
                from .sfb import SfbCosts

                self._sfb = SfbCosts(self)
            sfb = self._sfb.group(g, gp)
            sync_bytes = max(0.0, sync_bytes - sfb.saved_bytes)
        if strategy.chunked:  # full-batch chunks of the group's positions, one device each
            if any(len(u.replicas) != 1 or u.positions is None for u in lowered):
                raise PlanError(f"plan: groups[{g}]: strategy {gp.sync!r}: the simulator costs position chunks "
                                "on one device each")
            units = [mp_unit(static, self.costs, g, j, u.replicas[0].device, *u.positions, recompute=gp.recompute)
                     for j, u in enumerate(lowered)]
            chunk_of = {p: j for j, u in enumerate(lowered) for p in range(*u.positions)}
            return GroupData(units, "none", 0.0, (), (), 0.0, True, chunk_of, unit_key=("mp", devs),
                             recompute=gp.recompute)
        if len(lowered) != 1 or lowered[0].positions is not None:
            raise PlanError(f"plan: groups[{g}]: strategy {gp.sync!r}: the simulator costs one unit over the "
                            "whole group or position chunks")
        # the lowering's replicas (a strategy may compute on part of gp.devices)
        devs, batches = tuple(lowered[0].devices), lowered[0].batches
        lay = self.layout(devs, batches)
        if gp.recompute:
            lay = self.recompute_layout(lay)
        unit = Unit(g, -1, devs, batches, lay.starts, lay)
        collective = strategy.collective(gp)
        if collective is None or sync_bytes <= 0:
            return GroupData([unit], "none", 0.0, (), (), 0.0, sfb=sfb, layout=lay,
                             unit_key=("dp", devs, batches), recompute=gp.recompute)
        server, members = collective.server, collective.members
        # groups of equal bytes: one pricing
        t = self._bucket_time((collective.op, collective.devices, server), sync_bytes)
        machines = tuple(sorted({comm.machine_of[d] for d in members}))
        return GroupData([unit], collective.op, t, members, machines if len(machines) > 1 else (), sync_bytes, sfb=sfb,
                         layout=lay, unit_key=("dp", devs, batches), bucket=(collective.op, devs, server),
                         recompute=gp.recompute)

    def recompute_layout(self, lay: Layout, held=None, live=None, saved=None) -> Layout:
        """``lay`` with every group costed under activation recomputation
        (:func:`tag.sim.units.recompute_layout`; cached per layout). A recomputed group runs on
        this layout: a layout of its own, so consecutive recomputed groups still form one
        vectorised segment; between it and a group on ``lay`` (the same replicas and sample
        ranges) no tensor moves."""
        key = ("rc", lay.uid)
        out = self._layouts.get(key)
        if out is None:
            out = self.store_layout(key, recompute_layout(self.static, lay, held, live, saved, self._casts_of(lay),
                                                          self._cast_hosts_of(lay)))
        return out

    def _casts_of(self, lay: Layout) -> np.ndarray | None:
        """[K, R] seconds of every group's forward parameter casts on ``lay``'s replicas (None: none)."""
        if not self.any_casts:
            return None
        if lay.casts is not None:  # (a tensor-parallel device's share)
            return lay.casts
        return self.casts[[self.dev_class[d] for d in lay.devices]].T

    def _cast_hosts_of(self, lay: Layout) -> np.ndarray | None:
        """[K, R] host seconds launching every group's forward parameter casts on ``lay``'s replicas
        (None: no host apart or no casts; a tensor-parallel rank launches as many, on its shards)."""
        if self.cast_hosts is None or lay.host is None or not self.any_casts:
            return None
        return self.cast_hosts[[self.dev_class[d] for d in lay.devices]].T

    def warm_layout(self, lay: Layout) -> Layout:
        """``lay`` with forwards that do not cast the parameters (a pipeline's micro-batches after
        its first: the executor casts each weight once per iteration and reuses the copy,
        :func:`tag.executor.fuse.share_param_casts`); cached per layout, so groups sharing a
        layout share its warm one."""
        key = ("warm", lay.uid)
        out = self._layouts.get(key)
        if out is None:
            dur = lay.dur.copy()
            dur[FWD] = np.maximum(dur[FWD] - self._casts_of(lay), 0.0)
            host, cast_host_of = lay.host, self._cast_hosts_of(lay)
            if cast_host_of is not None:  # (nor are their launches issued)
                host = host.copy()
                host[FWD] = np.maximum(host[FWD] - cast_host_of, 0.0)
            out = self.store_layout(key, Layout.of(lay.devices, lay.batches, lay.dev_arr, dur, lay.mem, lay.work,
                                                   lay.starts, saved=lay.saved, compute=lay.compute, net=lay.net,
                                                   net_machines=lay.net_machines, host=host, lag=lay.lag))
        return out

    def warm_deployments(self, deployments: list[GroupData]) -> list[GroupData]:
        """``deployments`` on their :meth:`warm_layout` (the same serials: the same flows and syncs)."""
        out = []
        for deployment in deployments:
            lay = deployment.layout
            if lay is None:
                out.append(deployment)
                continue
            w = self.warm_layout(lay)
            units = [replace(u, layout=w) if u.layout is lay else u for u in deployment.units]
            out.append(replace(deployment, layout=w, units=units))
        return out

    def _sync_seconds(self, op: str, devs: tuple[int, ...], server: int | None, nbytes: float) -> float:
        """One gradient collective ``op`` (:class:`tag.parallel.Collective`) of ``nbytes`` over the
        replicas ``devs`` (``ps``: via ``server``; :meth:`tag.cost.comm.CommModel.sync_time`)."""
        try:
            return self.comm.sync_time(op, devs, nbytes, server)
        except ValueError as e:
            raise PlanError(f"simulator: {e}") from None

    def sync_jobs(self, deployments: list[GroupData],
                  tied: frozenset[int] = frozenset()) -> list[tuple[tuple[int, ...], object]]:
        """The iteration's gradient collectives in launch order, one per bucket
        (:func:`tag.parallel.buckets.assign_buckets` over the syncs in reverse group order, as the
        executor's schedule buckets them): ``(groups, job)``, ``groups`` in the bucket's order,
        ``job`` the group's :class:`GroupData` for a bucket of one group, else a :class:`SyncJob`
        over the concatenated gradients. ``tied``: the tied weights (parameter tensors,
        :attr:`tag.sim.program.PipelineProgram.tied`) a pipeline holds on two stages: each leaves
        its owner's sync and is all-reduced over both stages' replicas, a bucket of its own launched
        once both groups' last backward ran (:meth:`_tied_jobs`). Cached by the groups'
        deployments (a serial is never reused)."""
        key = (tuple(deployment.serial for deployment in deployments), tied)
        jobs = self._sync_jobs.get(key)
        if jobs is None:
            jobs = self._sync_jobs[key] = self._bucketed(deployments, tied)
            self._meter.bytes += seq_bytes(len(key[0])) + sum(seq_bytes(len(gs)) + ENTRY_BYTES for gs, _ in jobs)
        return jobs

    def _bucketed(self, deployments: list[GroupData],
                  tied: frozenset[int] = frozenset()) -> list[tuple[tuple[int, ...], object]]:
        ties = [tw for tw in self.static.tied if tw.tensor in tied]
        less: dict[int, float] = {}  # owner group -> bytes of its tied weights (synced apart)
        for tw in ties:
            less[tw.owner] = less.get(tw.owner, 0.0) + tw.nbytes
        sync_bytes = [deployment.sync_bytes - less.get(g, 0.0) for g, deployment in enumerate(deployments)]
        order = [g for g in range(len(deployments) - 1, -1, -1)
                 if deployments[g].sync != "none" and sync_bytes[g] > 0]
        jobs: list = []
        # A group without a bucket key (a tensor-parallel group's own sync) is a bucket of its own.
        keys = [deployments[g].bucket if deployments[g].bucket is not None else ("alone", g) for g in order]
        for b in assign_buckets([(k, sync_bytes[g]) for k, g in zip(keys, order)], self.bucket_bytes):
            gs = tuple(order[i] for i in b)
            deployment = deployments[gs[0]]
            if len(gs) == 1 and gs[0] not in less:
                jobs.append((gs, deployment))
                continue
            nbytes = sum(sync_bytes[g] for g in gs)
            # (a tensor-parallel group, a bucket of its own: its sync less the tied weights)
            secs = (deployment.resync(less[gs[0]]) if deployment.resync is not None
                    else self._bucket_time(deployment.bucket, nbytes))
            jobs.append((gs, SyncJob(gs, deployment.sync, secs, deployment.sync_devices, deployment.sync_machines,
                                     nbytes)))
        return self._tied_jobs(deployments, ties, jobs)

    def _tied_jobs(self, deployments: list[GroupData], ties: list, jobs: list) -> list:
        """``jobs`` with the all-reduce of each tied weight of ``ties`` over its owner's replicas and
        its partial sum's maker's, at the executor's launch: after the buckets launched at or
        before the later of the two groups' last backward (the earlier group: its stage ends
        later; :func:`tag.parallel.schedule.build_schedule`). Tensor-parallel groups (Megatron-LM's
        vocabulary-parallel embedding, :func:`tag.sim.program.tied_weights`): each rank's shard over
        the same rank of every replica of both stages, the ``tp`` shard rings at once
        (:meth:`tag.cost.comm.CommModel.tensor_parallel_sync_time`)."""
        for tw in ties:
            owner, reader = tw.owner, tw.grad_group
            devs = tuple(deployments[owner].units[0].devices) + tuple(deployments[reader].units[0].devices)
            members = tuple(sorted(set(devs)))
            machines = tuple(sorted({self.comm.machine_of[d] for d in members}))
            t = deployments[owner].tp
            secs = self.comm.tensor_parallel_sync_time([devs[i:i + t] for i in range(0, len(devs), t)], 0.0,
                                                       tw.nbytes, False) if t \
                else self._bucket_time(("allreduce", devs, None), tw.nbytes)
            job = SyncJob((reader, owner), "allreduce", secs, members, machines if len(machines) > 1 else (), tw.nbytes)
            at = sum(1 for gs, _ in jobs if gs[-1] >= min(owner, reader))
            jobs = jobs[:at] + [(job.groups, job)] + jobs[at:]
        return jobs

    def _bucket_time(self, key: tuple, nbytes: float) -> float:
        t = self._buckets.get((key, nbytes))
        if t is None:
            t = self._sync_seconds(*key, nbytes)
            self._buckets[(key, nbytes)] = t
            self._meter.bytes += ENTRY_BYTES
        return t

    def scatter_gather_time(self, devices: tuple[int, ...], chunks: tuple[float, ...]) -> float:
        """Seconds of the all-gather of ``chunks[r]`` bytes from each ``devices[r]`` that
        completes scattered pieces (:attr:`tag.sim.units.PairTemplate.gathers`; cached)."""
        cache = self.cache("scatter-gather")
        t = cache.get((devices, chunks))
        if t is None:
            t = cache[(devices, chunks)] = self.comm.allgather_time(list(chunks), list(devices))
            self._meter.bytes += seq_bytes(len(devices)) + seq_bytes(len(chunks)) + ENTRY_BYTES
        return t

    def pair(self, g1: int, src_deployment: GroupData, g2: int, dst_deployment: GroupData,
             select: str | None = None) -> PairFlows:
        """Flows from group ``g1`` deployed as ``src_deployment`` to ``g2`` deployed as
        ``dst_deployment`` (cached, and their :class:`PairTemplate` cached by what it depends on:
        the tensors crossing and the two replica sets, :meth:`template`); ``select``: a pipeline's
        part of them (:func:`pair_kinds`)."""
        key = (src_deployment.serial, dst_deployment.serial) if select is None else \
            (src_deployment.serial, dst_deployment.serial, select)
        pair = self._pairs.get(key)
        if pair is None:
            template = self.template(g1, src_deployment, g2, dst_deployment, select)
            pair = self._pairs[key] = PairFlows(template, g1, g2, self.static.num_groups)
            self._meter.bytes += pair.nbytes + ENTRY_BYTES
        return pair

    def template(self, g1: int, src_deployment: GroupData, g2: int, dst_deployment: GroupData,
                 select: str | None = None) -> PairTemplate:
        """The :class:`PairTemplate` of the flows from group ``g1`` deployed as ``src_deployment`` to
        ``g2`` deployed as ``dst_deployment`` (``select``: :meth:`pair`'s), cached by the tensors
        crossing and the two replica sets."""
        kinds_id = self._kinds.get((g1, g2, select)) if not (src_deployment.mp or dst_deployment.mp) else None
        if kinds_id is None:
            kinds = pair_kinds(self.static, g1, src_deployment, g2, dst_deployment, select)
            kinds_id = self._kind_ids.get(kinds)
            if kinds_id is None:
                kinds_id = self._kind_ids[kinds] = (len(self._kind_ids), kinds)
                self._meter.bytes += seq_bytes(4 * len(kinds)) + ENTRY_BYTES
            if not (src_deployment.mp or dst_deployment.mp):
                self._kinds[(g1, g2, select)] = kinds_id
        template_key = (kinds_id[0], src_deployment.unit_key, dst_deployment.unit_key)
        template = self._templates.get(template_key)
        if template is None:
            template = self._templates[template_key] = PairTemplate(
                kinds_id[1], src_deployment.units, dst_deployment.units, self.comm, self._pieces,
                (src_deployment.unit_key, dst_deployment.unit_key))
            self._meter.bytes += template.nbytes + ENTRY_BYTES
        return template

    def messages(self, flow_lists: list[tuple]) -> list[tuple]:
        """The :class:`tag.sim.flows.Message` tuples of the flow lists ``flow_lists`` into one stage
        (:func:`tag.sim.flows.pack_messages`; cached by the flow tuples, which the cached pairs
        hold: a pipeline's micro-batches of one size, and the runs after, reuse them)."""
        key = tuple([id(flows) for flows in flow_lists])
        hit = self._messages.get(key)
        if hit is None:  # (an entry holds its flow tuples: while it lives, no other object has their ids)
            msgs = pack_messages(flow_lists, self.comm.p2p_time, self.blocking_sends, self.shared_stream)
            hit = self._messages[key] = (tuple(flow_lists), msgs)
            self._meter.bytes += (seq_bytes(len(flow_lists)) + ref_bytes(len(flow_lists)) + FLOW_BYTES * len(msgs)
                                  + ENTRY_BYTES)
        return hit[1]

    def pairs_used(self, deployments: list[GroupData], select: str | None = None) -> list[PairFlows]:
        """The pairs of groups whose deployments move tensors between them, in pair order: all but
        those within one group (only mp chunks exchange) and those between two groups on one
        layout (same replicas and sample ranges: only non-batch gradients move); ``select``: a
        pipeline's part of their flows (:func:`pair_kinds`)."""
        moving = self._groups_moving(deployments)
        if select is not None:
            parts = (self.pair(g1, deployments[g1], g2, deployments[g2], select) for g1, g2 in moving)
            return [pair for pair in parts if pair.stage_flows]
        return [self.pair(g1, deployments[g1], g2, deployments[g2]) for g1, g2 in moving]

    def templates_used(self, deployments: list[GroupData], select: str | None = None) -> list[PairTemplate]:
        """The :class:`PairTemplate` of each pair of :meth:`pairs_used` (no :class:`PairFlows` built)."""
        parts = (self.template(g1, deployments[g1], g2, deployments[g2], select)
                 for g1, g2 in self._groups_moving(deployments))
        return [template for template in parts if template.by_dst]

    def _groups_moving(self, deployments: list[GroupData]) -> list[tuple[int, int]]:
        """``(g1, g2)`` of :meth:`pairs_used` without ``select``: the pairs moving tensors."""
        layout_ids = np.array([deployment.layout_id for deployment in deployments])
        src_layout, dst_layout = layout_ids[self._pair_src], layout_ids[self._pair_dst]
        used = np.where(self._pair_self, src_layout < 0, self._pair_nonlocal | (src_layout != dst_layout))
        pair_list, pairs, out = self._pair_list, self._pairs, []
        for p in np.flatnonzero(used).tolist():
            g1, g2, _ = pair_list[p]
            src_deployment, dst_deployment = deployments[g1], deployments[g2]
            pair = pairs.get((src_deployment.serial, dst_deployment.serial))
            if pair is not None:
                if pair.stage_flows:
                    out.append((g1, g2))
            elif self.template(g1, src_deployment, g2, dst_deployment).by_dst:
                out.append((g1, g2))
        return out

    def deploy(self, groups) -> list[GroupData]:
        """The cached :class:`GroupData` of every group of the deployment ``groups``."""
        k = self.static.num_groups
        if len(groups) != k:
            raise PlanError(f"plan: groups: expected {k} entries (one per op-group), got {len(groups)}")
        get, out = self._groups.get, []
        for g, gp in enumerate(groups):
            deployment = get((g, plan_key(gp)))
            out.append(deployment if deployment is not None else self.group_data(g, gp))
        return out

    # ---- the event loop -------------------------------------------------------------------
    def run(self, groups, *, trace: bool = False, pipeline=None) -> SimResult:
        """Simulate one iteration of the deployment ``groups`` (one GroupPlan per op-group) and,
        if given, its :class:`~tag.plan.PipelinePlan` (validated by the caller:
        :func:`tag.parallel.validate_plan`).

        The event loop (:class:`tag.sim.event_loop.Run`) records no task; the critical path is
        computed on first access by replaying the iteration with a :class:`Recorder`. With
        ``trace`` the recorder runs at once and :attr:`SimResult.events` holds the timeline."""
        self.fit_caches()
        deployments = self.deploy(groups)
        program = None if pipeline is None else build_program(self, groups, pipeline)
        from .sharded import check_host  # (offloaded groups: their hosts' memory)

        if not trace:
            return check_host(self, groups, Run(self, deployments, None, program).execute())
        rec = Recorder()
        res = Run(self, deployments, rec, program).execute()
        res.events = rec.events()
        return check_host(self, groups, res)

    def moved_bytes(self, groups, *, pipeline=None) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
        """What one iteration of ``groups`` (and ``pipeline``) moves: bytes per (source device,
        destination device) of its point-to-point messages, and per device the bytes of the
        all-gathers completing pieces scattered into its tensor-parallel group (the whole
        pieces, :attr:`tag.sim.units.PairTemplate.gathers`)."""
        self.fit_caches()
        program = None if pipeline is None else build_program(self, groups, pipeline)
        run = Run(self, self.deploy(groups), None, program)
        p2p: dict[tuple[int, int], float] = {}
        for _off, flow_lists in run.incoming.values():
            for flows in flow_lists:
                for _, _, a, b, _, _, _, _, nbytes in flows:
                    p2p[(a, b)] = p2p.get((a, b), 0.0) + nbytes
        gathered: dict[int, float] = {}
        for sets in run.gathers.values():
            for gather in sets:
                for d in gather.devices:
                    gathered[d] = gathered.get(d, 0.0) + gather.nbytes
        return p2p, gathered

