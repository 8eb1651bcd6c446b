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
(:class:`_Run`) computes every time; it records nothing unless given a :class:`_Recorder`, which
it calls with each task's times (the critical path, replayed on first access, and the timeline of
``trace=True``). The flows between two groups' deployments are cached by what they depend on
(:class:`PairTemplate`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from ..errors import PlanError
from ..graph.ir import PHASE_INDEX
from ..parallel.buckets import assign_buckets, bucket_caps
from ..parallel.sharded import shard_size, sharded_bytes
from ..parallel.strategy import strategy_of
from .result import SimEvent, SimResult
from .static import BWD, FWD, OPT, PARAM, build_static
from .strategies import costing_of
from .units import (
    ENTRY_BYTES,
    FLOW_BYTES,
    CacheMeter,
    Flow,
    GroupData,
    Layout,
    PairTemplate,
    SyncJob,
    Unit,
    at_batch,
    make_layout,
    mp_unit,
    pair_kinds,
    recompute_layout,
    ref_bytes,
    seq_bytes,
)

PHASE_NAME = {**{i: p for p, i in PHASE_INDEX.items()}, PARAM: "param"}
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
    sp = gp.mp_splits
    return (tuple(gp.devices), tuple(gp.shares), gp.sync, gp.server, tuple(sp) if sp else (), tuple(gp.sfb), gp.tp,
            gp.sequence_parallel, gp.recompute, gp.shard, gp.offload)


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
        sends go (:meth:`_messages`)."""

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
        self._paths: dict = {}  # machines (a message's pair, a collective's) -> background profile or None (_Run._slowed)
        self.time_offset_s = 0.0
        """Seconds of a background profile (:mod:`tag.topology.background`) at which the iteration
        starts (the iterations before it, when replaying a run over a trace)."""
        self.costs = costs if costs is not None else CostModel.for_topology(graph, topology)
        self.static = build_static(graph)
        self.comm = self.costs.comm
        tabs: list[np.ndarray] = []
        self.dev_class: list[int] = []
        for d in range(topology.num_devices):
            t = self.costs.table(d)
            k = next((i for i, x in enumerate(tabs) if x is t), None)
            if k is None:
                k = len(tabs)
                tabs.append(t)
            self.dev_class.append(k)
        self.tables = np.stack(tabs)  # [C, K, 3, B+1]
        self.hosts = self._host_tables()
        ch = getattr(self.costs, "cast_host_seconds", None)
        self.cast_hosts = None if self.hosts is None or ch is None else \
            np.stack([ch(self.dev_class.index(c)) for c in range(len(tabs))])
        """[C, K] host seconds launching each group's forward parameter casts per device class, part of
        :attr:`hosts`' forwards (None: no host apart): a pipeline's later micro-batches launch none."""
        """(host seconds, lags) [C, K, 2, B+1] of the forward and backward stages and per class whether
        its costs hold the host apart (:meth:`tag.cost.CostModel.host_parts`; ``tables``' forwards and
        backwards are then the device's seconds, the host a timeline of its own: :meth:`_Run._phase`),
        or None where no class does."""
        cast_of = getattr(self.costs, "cast_seconds", None)  # (a cost model without parameter casts: none)
        self.casts = np.stack([cast_of(self.dev_class.index(c)) if cast_of is not None
                               else np.zeros(graph.num_groups) for c in range(len(tabs))])
        """[C, K] seconds of each group's forward parameter casts per device class
        (:meth:`tag.cost.CostModel.cast_seconds`), part of ``tables``' forwards: charged once per
        iteration (a pipeline's first micro-batch, :meth:`warm_layout`; not in a recomputation)."""
        self.any_casts = bool(self.casts.any())
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
        # Pairs without non-batch gradients: no flow when both groups share one layout.
        local = {pr for pr, es in self.static.edges.items() if not any(e.grad for e in es)}
        self._pair_list = [(g1, g2, (g1, g2) in local) for g1, g2 in self.static.pairs]
        self._pair_src = np.array([g1 for g1, _ in self.static.pairs], dtype=np.int64)
        self._pair_dst = np.array([g2 for _, g2 in self.static.pairs], dtype=np.int64)
        self._pair_self = self._pair_src == self._pair_dst
        self._pair_nonlocal = np.array([not loc for _, _, loc in self._pair_list], dtype=bool)
        self._sfb = None  # tag.sim.sfb.SfbCosts, built on the first plan using SFB
        self.wake: list[tuple | None] = []
        """Per device: ``(table [K, 2, B+1], tau_s, 1 / (1 - exp(-gap_s / tau_s)))`` of its wake
        penalty (:meth:`tag.cost.CostModel.wake_penalty`), or None."""
        pen = getattr(self.costs, "wake_penalty", None)
        for d in range(topology.num_devices):
            w = pen(d) if pen is not None else None
            self.wake.append(None if w is None else (w[0], w[2], 1.0 / (1.0 - math.exp(-w[1] / w[2]))))
        self.any_wake = any(w is not None for w in self.wake)

    def _host_tables(self):
        """:attr:`hosts`, putting the device seconds of each class holding its host apart in
        :attr:`tables` (their optimizer steps as they were: after the iteration's syncs)."""
        parts_of = getattr(self.costs, "host_parts", None)
        shape = self.tables.shape
        host, lag, apart = np.zeros((shape[0], shape[1], 2, shape[3])), np.zeros((shape[0], shape[1], 2, shape[3])), []
        for c in range(shape[0]):
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
        self._pairs: dict[tuple, _Pair] = {}
        self._kinds: dict[tuple[int, int], tuple] = {}  # dp -> dp group pair -> (kinds id, kinds)
        self._kind_ids: dict[tuple, tuple] = {}  # pair_kinds -> (id, kinds)
        self._templates: dict[tuple, PairTemplate] = {}
        self._msgs: dict[tuple, tuple] = {}  # ids of flow tuples -> (those tuples, their messages)
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
        gd = self._groups.get(key)
        if gd is None:
            gd = self._make_group(g, gp, batch)
            self._serial += 1
            gd.serial = self._serial
            gd.lid = gd.layout.uid if gd.layout is not None else -gd.serial
            self._groups[key] = gd
            # the key's devices and shares; each unit's devices, batches and starts
            self._meter.bytes += (ref_bytes(len(gp.devices)) + seq_bytes(len(gp.shares)) + ENTRY_BYTES
                                  + sum(3 * ref_bytes(len(u.devices)) + ENTRY_BYTES for u in gd.units))
        return gd

    def _make_group(self, g: int, gp, batch: int | None = None) -> GroupData:
        """Cost the lowering of ``gp`` by its strategy (:mod:`tag.parallel`): a unit running the
        whole group on a batch split (a vectorised :class:`Layout`) or position chunks on one
        device each (:func:`mp_unit`), and the gradient collective; or the strategy's own group
        costing where one is registered (:mod:`tag.sim.strategies`). ``batch``: samples per run
        (a pipeline's micro-batch; default the graph's batch)."""
        st, comm = self.static, self.comm
        strategy = strategy_of(gp)
        lowered = strategy.units(g, gp, self.graph, st.batch_size if batch is None else batch)
        costing = costing_of(gp.sync)
        if costing is not None:  # a strategy costed its own way (tag.sim.strategies; tp's: tag.sim.tensor_parallel)
            return costing(self, g, gp, lowered)
        devs = tuple(gp.devices)
        sbytes = float(st.grad_bytes[g])
        sfb = None
        if gp.sfb:  # validated here (PlanError naming the op); its gradients leave the sync
            if self._sfb is None:
                from .sfb import SfbCosts

                self._sfb = SfbCosts(self)
            sfb = self._sfb.group(g, gp)
            sbytes = max(0.0, sbytes - sfb.saved_bytes)
        if strategy.chunked:  # full-batch chunks of the group's positions, one device each
            if any(len(u.replicas) != 1 or u.positions is None for u in lowered):
                raise PlanError(f"plan: groups[{g}]: strategy {gp.sync!r}: the simulator costs position chunks "
                                "on one device each")
            units = [mp_unit(st, self.costs, g, j, u.replicas[0].device, *u.positions, recompute=gp.recompute)
                     for j, u in enumerate(lowered)]
            chunk_of = {p: j for j, u in enumerate(lowered) for p in range(*u.positions)}
            return GroupData(units, "none", 0.0, (), (), 0.0, True, chunk_of, ukey=("mp", devs), recompute=gp.recompute)
        if len(lowered) != 1 or lowered[0].positions is not None:
            raise PlanError(f"plan: groups[{g}]: strategy {gp.sync!r}: the simulator costs one unit over the "
                            "whole group or position chunks")
        # the lowering's replicas (a strategy may compute on part of gp.devices)
        devs, batches = tuple(lowered[0].devices), lowered[0].batches
        lay = self.layout(devs, batches)
        if gp.recompute:
            lay = self.recompute_layout(lay)
        unit = Unit(g, -1, devs, batches, lay.starts, lay)
        coll = strategy.collective(gp)
        if coll is None or sbytes <= 0:
            return GroupData([unit], "none", 0.0, (), (), 0.0, sfb=sfb, layout=lay,
                             ukey=("dp", devs, batches), recompute=gp.recompute)
        server, members = coll.server, coll.members
        t = self._bucket_time((coll.op, coll.devices, server), sbytes)  # groups of equal bytes: one pricing
        machines = tuple(sorted({comm.machine_of[d] for d in members}))
        return GroupData([unit], coll.op, t, members, machines if len(machines) > 1 else (), sbytes, sfb=sfb,
                         layout=lay, ukey=("dp", devs, batches), bucket=(coll.op, devs, server),
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
            host, ch = lay.host, self._cast_hosts_of(lay)
            if ch is not None:  # (nor are their launches issued)
                host = host.copy()
                host[FWD] = np.maximum(host[FWD] - ch, 0.0)
            out = self.store_layout(key, Layout.of(lay.devices, lay.batches, lay.dev_arr, dur, lay.mem, lay.work,
                                                   lay.starts, saved=lay.saved, compute=lay.compute, net=lay.net,
                                                   net_machines=lay.net_machines, host=host, lag=lay.lag))
        return out

    def _warm(self, gds: list[GroupData]) -> list[GroupData]:
        """``gds`` on their :meth:`warm_layout` (the same serials: the same flows and syncs)."""
        out = []
        for gd in gds:
            lay = gd.layout
            if lay is None:
                out.append(gd)
                continue
            w = self.warm_layout(lay)
            out.append(replace(gd, layout=w, units=[replace(u, layout=w) if u.layout is lay else u for u in gd.units]))
        return out

    def _sync_seconds(self, op: str, devs: tuple[int, ...], server: int | None, nbytes: float) -> float:
        """One gradient collective ``op`` (:class:`tag.parallel.Collective`) of ``nbytes`` over the
        replicas ``devs`` (``ps``: via ``server``; :meth:`tag.cost.comm.CommModel.sync_time`)."""
        try:
            return self.comm.sync_time(op, devs, nbytes, server)
        except ValueError as e:
            raise PlanError(f"simulator: {e}") from None

    def sync_jobs(self, gds: list[GroupData], tied: frozenset[int] = frozenset()) -> list[tuple[tuple[int, ...], object]]:
        """The iteration's gradient collectives in launch order, one per bucket
        (:func:`tag.parallel.buckets.assign_buckets` over the syncs in reverse group order, as the
        executor's schedule buckets them): ``(groups, job)``, ``groups`` in the bucket's order,
        ``job`` the group's :class:`GroupData` for a bucket of one group, else a :class:`SyncJob`
        over the concatenated gradients. ``tied``: the tied weights (parameter tensors,
        :attr:`_Micro.tied`) a pipeline holds on two stages: each leaves its owner's sync and is
        all-reduced over both stages' replicas, a bucket of its own launched once both groups' last
        backward ran (:meth:`_tied_jobs`). Cached by the groups' deployments (a serial is never reused)."""
        key = (tuple(gd.serial for gd in gds), tied)
        jobs = self._sync_jobs.get(key)
        if jobs is None:
            jobs = self._sync_jobs[key] = self._bucketed(gds, tied)
            self._meter.bytes += seq_bytes(len(key[0])) + sum(seq_bytes(len(gs)) + ENTRY_BYTES for gs, _ in jobs)
        return jobs

    def _bucketed(self, gds: list[GroupData], tied: frozenset[int] = frozenset()) -> list[tuple[tuple[int, ...], object]]:
        ties = [tw for tw in self.static.tied if tw.tensor in tied]
        less: dict[int, float] = {}  # owner group -> bytes of its tied weights (synced apart)
        for tw in ties:
            less[tw.owner] = less.get(tw.owner, 0.0) + tw.nbytes
        sbytes = [gd.sync_bytes - less.get(g, 0.0) for g, gd in enumerate(gds)]
        order = [g for g in range(len(gds) - 1, -1, -1) if gds[g].sync != "none" and sbytes[g] > 0]
        jobs: list = []
        # A group without a bucket key (a tensor-parallel group's own sync) is a bucket of its own.
        keys = [gds[g].bucket if gds[g].bucket is not None else ("alone", g) for g in order]
        for b in assign_buckets([(k, sbytes[g]) for k, g in zip(keys, order)], self.bucket_bytes):
            gs = tuple(order[i] for i in b)
            gd = gds[gs[0]]
            if len(gs) == 1 and gs[0] not in less:
                jobs.append((gs, gd))
                continue
            nbytes = sum(sbytes[g] for g in gs)
            # (a tensor-parallel group, a bucket of its own: its sync less the tied weights)
            secs = gd.resync(less[gs[0]]) if gd.resync is not None else self._bucket_time(gd.bucket, nbytes)
            jobs.append((gs, SyncJob(gs, gd.sync, secs, gd.sync_devices, gd.sync_machines, nbytes)))
        return self._tied_jobs(gds, ties, jobs)

    def _tied_jobs(self, gds: list[GroupData], ties: list, jobs: list) -> list:
        """``jobs`` with the all-reduce of each tied weight of ``ties`` over its owner's replicas and
        its partial sum's maker's, at the executor's launch: after the buckets launched at or
        before the later of the two groups' last backward (the earlier group: its stage ends
        later; :func:`tag.parallel.schedule.build_schedule`). Tensor-parallel groups (Megatron-LM's
        vocabulary-parallel embedding, :meth:`_tied`): each rank's shard over the same rank of
        every replica of both stages, the ``tp`` shard rings at once
        (:meth:`tag.cost.comm.CommModel.tensor_parallel_sync_time`)."""
        for tw in ties:
            g_o, g_x = tw.owner, tw.grad_group
            devs = tuple(gds[g_o].units[0].devices) + tuple(gds[g_x].units[0].devices)
            members = tuple(sorted(set(devs)))
            machines = tuple(sorted({self.comm.machine_of[d] for d in members}))
            t = gds[g_o].tp
            secs = self.comm.tensor_parallel_sync_time([devs[i:i + t] for i in range(0, len(devs), t)], 0.0,
                                                       tw.nbytes, False) if t \
                else self._bucket_time(("allreduce", devs, None), tw.nbytes)
            job = SyncJob((g_x, g_o), "allreduce", secs, members, machines if len(machines) > 1 else (), tw.nbytes)
            at = sum(1 for gs, _ in jobs if gs[-1] >= min(g_o, g_x))
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

    def pair(self, g1: int, gd1: GroupData, g2: int, gd2: GroupData, select: str | None = None) -> _Pair:
        """Flows from group ``g1`` deployed as ``gd1`` to ``g2`` deployed as ``gd2`` (cached, and
        their :class:`PairTemplate` cached by what it depends on: the tensors crossing and the
        two replica sets, :meth:`template`); ``select``: a pipeline's part of them (:func:`pair_kinds`)."""
        key = (gd1.serial, gd2.serial) if select is None else (gd1.serial, gd2.serial, select)
        pr = self._pairs.get(key)
        if pr is None:
            pr = self._pairs[key] = _Pair(self.template(g1, gd1, g2, gd2, select), g1, g2, self.static.num_groups)
            self._meter.bytes += pr.nbytes + ENTRY_BYTES
        return pr

    def template(self, g1: int, gd1: GroupData, g2: int, gd2: GroupData, select: str | None = None) -> PairTemplate:
        """The :class:`PairTemplate` of the flows from group ``g1`` deployed as ``gd1`` to ``g2``
        deployed as ``gd2`` (``select``: :meth:`pair`'s), cached by the tensors crossing and the two
        replica sets."""
        kid = self._kinds.get((g1, g2, select)) if not (gd1.mp or gd2.mp) else None
        if kid is None:
            kinds = pair_kinds(self.static, g1, gd1, g2, gd2, select)
            kid = self._kind_ids.get(kinds)
            if kid is None:
                kid = self._kind_ids[kinds] = (len(self._kind_ids), kinds)
                self._meter.bytes += seq_bytes(4 * len(kinds)) + ENTRY_BYTES
            if not (gd1.mp or gd2.mp):
                self._kinds[(g1, g2, select)] = kid
        tkey = (kid[0], gd1.ukey, gd2.ukey)
        tpl = self._templates.get(tkey)
        if tpl is None:
            tpl = self._templates[tkey] = PairTemplate(kid[1], gd1.units, gd2.units, self.comm, self._pieces,
                                                       (gd1.ukey, gd2.ukey))
            self._meter.bytes += tpl.nbytes + ENTRY_BYTES
        return tpl

    def _messages(self, fls: list[tuple]) -> list[tuple]:
        """:func:`_messages` of the flows ``fls`` (cached by the flow tuples, which the cached
        pairs hold: a pipeline's micro-batches of one size, and the runs after, reuse them)."""
        key = tuple([id(fl) for fl in fls])
        hit = self._msgs.get(key)
        if hit is None:  # (an entry holds its flow tuples: while it lives, no other object has their ids)
            msgs = _messages(fls, self.comm.p2p_time)
            into = {m[4] for m in msgs}  # devices receiving in this step
            shared = self.shared_stream
            # (a GPU sender that receives nothing in the step posts its sends and computes on,
            # unless sends block: blocking_sends)
            block = self.blocking_sends
            hit = self._msgs[key] = (tuple(fls), [(*m, block or shared[m[3]] or m[3] in into) for m in msgs])
            self._meter.bytes += seq_bytes(len(fls)) + ref_bytes(len(fls)) + FLOW_BYTES * len(hit[1]) + ENTRY_BYTES
        return hit[1]

    def _stage_index(self, stage: tuple[int, int, int]) -> int:
        """Flat index of stage (phase, group, chunk) in a run's stage tables: ``ph * K + g + 2K * j``
        (data-parallel stages first, in group order); -1 for PARAM."""
        ph, g, j = stage
        k = self.static.num_groups
        return -1 if ph == PARAM else ph * k + g + 2 * k * j

    def _pairs_used(self, gds: list[GroupData], select: str | None = None) -> list[_Pair]:
        """The pairs of groups whose deployments move tensors between them, in pair order: all but
        those within one group (only mp chunks exchange) and those between two groups on one
        layout (same replicas and sample ranges: only non-batch gradients move); ``select``: a
        pipeline's part of their flows (:func:`pair_kinds`)."""
        if select is not None:
            parts = (self.pair(g1, gds[g1], g2, gds[g2], select) for g1, g2 in self._groups_used(gds))
            return [pr for pr in parts if pr.fast]
        return [self.pair(g1, gds[g1], g2, gds[g2]) for g1, g2 in self._groups_used(gds)]

    def _templates_used(self, gds: list[GroupData], select: str | None = None) -> list[PairTemplate]:
        """The :class:`PairTemplate` of each pair of :meth:`_pairs_used` (no :class:`_Pair` built)."""
        parts = (self.template(g1, gds[g1], g2, gds[g2], select) for g1, g2 in self._groups_used(gds))
        return [tpl for tpl in parts if tpl.by_dst]

    def _groups_used(self, gds: list[GroupData]) -> list[tuple[int, int]]:
        """``(g1, g2)`` of :meth:`_pairs_used` without ``select``: the pairs moving tensors."""
        lid = np.array([gd.lid for gd in gds])
        l1, l2 = lid[self._pair_src], lid[self._pair_dst]
        used = np.where(self._pair_self, l1 < 0, self._pair_nonlocal | (l1 != l2))
        plist, pairs, out = self._pair_list, self._pairs, []
        for p in np.flatnonzero(used).tolist():
            g1, g2, _ = plist[p]
            gd1, gd2 = gds[g1], gds[g2]
            pr = pairs.get((gd1.serial, gd2.serial))
            if pr is not None:
                if pr.fast:
                    out.append((g1, g2))
            elif self.template(g1, gd1, g2, gd2).by_dst:
                out.append((g1, g2))
        return out

    def deploy(self, groups) -> list[GroupData]:
        """The cached :class:`GroupData` of every group of the deployment ``groups``."""
        k = self.static.num_groups
        if len(groups) != k:
            raise PlanError(f"plan: groups: expected {k} entries (one per op-group), got {len(groups)}")
        get, out = self._groups.get, []
        for g, gp in enumerate(groups):
            gd = get((g, plan_key(gp)))
            out.append(gd if gd is not None else self.group_data(g, gp))
        return out

    # ---- the event loop -------------------------------------------------------------------
    def run(self, groups, *, trace: bool = False, pipeline=None) -> SimResult:
        """Simulate one iteration of the deployment ``groups`` (one GroupPlan per op-group) and,
        if given, its :class:`~tag.plan.PipelinePlan` (validated by the caller:
        :func:`tag.parallel.validate_plan`).

        The event loop (:class:`_Run`) records no task; the critical path is computed on first
        access by replaying the iteration with a :class:`_Recorder`. With ``trace`` the recorder
        runs at once and :attr:`SimResult.events` holds the timeline."""
        self.fit_caches()
        gds = self.deploy(groups)
        micro = None if pipeline is None else self._micro(groups, pipeline)
        from .sharded import check_host  # (offloaded groups: their hosts' memory)

        if not trace:
            return check_host(self, groups, _Run(self, gds, None, micro).execute())
        rec = _Recorder()
        res = _Run(self, gds, rec, micro).execute()
        res.events = rec.events()
        return check_host(self, groups, res)

    def moved_bytes(self, groups, *, pipeline=None) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
        """What one iteration of ``groups`` (and ``pipeline``) moves: bytes per (source device,
        destination device) of its point-to-point messages, and per device the bytes of the
        all-gathers completing pieces scattered into its tensor-parallel group (the whole
        pieces, :attr:`tag.sim.units.PairTemplate.gathers`)."""
        self.fit_caches()
        run = _Run(self, self.deploy(groups), None, None if pipeline is None else self._micro(groups, pipeline))
        p2p: dict[tuple[int, int], float] = {}
        for _off, fls in run.incoming.values():
            for fl in fls:
                for *_, a, b, _ma, _mb, _t, _r, nb in fl:
                    p2p[(a, b)] = p2p.get((a, b), 0.0) + nb
        gathered: dict[int, float] = {}
        for sets in run.gathers.values():
            for _lo, _hi, devs, _t, nb in sets:
                for d in devs:
                    gathered[d] = gathered.get(d, 0.0) + nb
        return p2p, gathered

    def _micro(self, groups, pp) -> _Micro:
        """What the event loop needs to run ``groups`` as the pipeline ``pp``
        (:mod:`tag.parallel.pipeline`): every group deployed at each micro-batch size, the tasks
        in the schedule's global order, each stage's groups and micro-batches in flight."""
        from ..parallel.pipeline import iteration_program

        prog = iteration_program(pp, self.static.batch_size, len(groups))
        by_size: dict[tuple[int, bool], list[GroupData]] = {}
        mgds = []
        for m, (lo, hi) in enumerate(prog.ranges):
            # micro-batch 0 (every stage's first forward) casts the parameters, the later ones reuse them
            key = (hi - lo, m > 0 and self.any_casts)
            if key not in by_size:
                gds = [self.group_data(g, gp, batch=hi - lo) for g, gp in enumerate(groups)]
                by_size[key] = self._warm(gds) if key[1] else gds
            mgds.append(by_size[key])
        members = [list(r) for r in prog.members]
        tasks = [(t.stage, PHASE_INDEX[t.phase], t.micro) for t in prog.tasks]
        flight = list(prog.flight)
        tied = self._tied(groups, pp)
        # a tied weight under sharded groups: each stage's copy ZeRO-1 over its group's shard groups (_hold_tied)
        shards = tuple((tw.tensor, _zero(groups[tw.owner])[0], _zero(groups[tw.owner])[1],
                        _zero(groups[tw.grad_group])[1]) for tw in self.static.tied
                       if tw.tensor in tied and (_zero(groups[tw.owner])[0] or _zero(groups[tw.grad_group])[0]))
        return _Micro(mgds, tasks, members, flight, tied, self.static.relayed(tuple(pp.stages)), shards)

    def _tied(self, groups, pp) -> frozenset[int]:
        """The tied weights of :attr:`_Micro.tied`: readers in one stage, owner in another (the
        executor's :func:`tag.parallel.schedule.build_schedule`), in a plan of groups without a
        costing of their own or sharded (ZeRO, not offloaded: the executor keeps the weight whole
        on both stages, its optimizer state over each stage's shard groups, :func:`_hold_tied`; a
        tensor-parallel plan's executor moves it), or,
        in a graph costed as Megatron-LM's vocabulary-parallel run (``vocab_parallel``,
        :func:`tag.parallel.layers.vocab_parallel_graph`), whose groups are tensor parallel of
        that degree over as many devices each (each rank holds its ``V / tp`` shard on both stages)."""
        if not self.static.tied:
            return frozenset()
        from ..parallel.pipeline import stage_of_group
        from ..parallel.tensor_parallel import tp_degree

        held_whole = ("zero1", "zero2", "zero3")  # (whole on both stages, not offloaded)
        plain = not any(costing_of(gp.sync) is not None and (gp.sync not in held_whole or gp.offload)
                        for gp in groups)
        t = getattr(self.graph, "vocab_parallel", 0)

        def holds(tw) -> bool:
            if plain:
                return True
            gps = [groups[g] for g in tw.groups | {tw.owner}]
            return t > 1 and all(gp.sync == "tp" and tp_degree(gp) == t and not gp.sequence_parallel
                                 and len(gp.devices) == len(gps[0].devices) for gp in gps)

        stage = stage_of_group(pp, len(groups))
        return frozenset(tw.tensor for tw in self.static.tied
                         if len({stage[g] for g in tw.groups}) == 1 and stage[tw.owner] != stage[tw.grad_group]
                         and not set(groups[tw.owner].devices) & set(groups[tw.grad_group].devices) and holds(tw))


def wake_extra(sim: Simulator, unit: Unit, g: int, ph: int, start: list[float], cend: list[float]) -> list[float] | None:
    """Extra seconds per replica of ``unit``'s stage (group ``g``, phase ``ph``) starting at ``start``
    on devices whose last compute ended at ``cend`` (None: no penalty anywhere). An mp chunk pays
    its share (by time) of its group's penalty at the full batch."""
    out = None
    for r, d in enumerate(unit.devices):
        w = sim.wake[d]
        if w is None:
            continue
        gap = start[r] - cend[d]
        if gap <= 0.0:
            continue
        if unit.layout is not None:
            comp = unit.layout.compute
            x = w[0][g, ph, unit.batches[r]] if comp is None else at_batch(w[0][g, ph], comp[r])
        else:
            b = sim.graph.batch_size
            full = sim.tables[sim.dev_class[d]][g, ph, b]
            x = w[0][g, ph, b] * (unit.dur[ph] / full) if full > 0 else 0.0
        if x <= 0.0:
            continue
        if out is None:
            out = [0.0] * len(unit.devices)
        out[r] = float(x) * (1.0 - math.exp(-gap / w[1])) * w[2]
    return out


def _messages(fls: list[tuple], p2p) -> list[tuple]:
    """The flows ``fls`` (tuples of :attr:`_Pair.fast` entries, in order) into one stage as
    messages ``(source stage, source replica, more sources, a, b, ma, mb, seconds, destination
    replica, bytes)``, one per (a, b) in the order of their first flow: every flow from device a
    to device b this stage needs (the executor's CPU ranks send a step's pieces to one peer
    packed), ready once all are produced (``more``: the other flows' ``(source stage, source
    replica)``, or None); a single flow keeps its seconds, several take those of the summed bytes
    (summed in flow order)."""
    acc: dict[tuple[int, int], list] = {}
    for fl in fls:
        for si, sr, a, b, ma, mb, t, r, nb in fl:
            x = acc.get((a, b))
            if x is None:
                acc[(a, b)] = [si, sr, None, a, b, ma, mb, t, r, nb]
            else:
                if x[2] is None:
                    x[2] = []
                x[2].append((si, sr))
                x[5], x[6], x[7], x[8], x[9] = ma, mb, -1.0, r, x[9] + nb
    out = []
    for x in acc.values():
        if x[2] is not None:
            x[2] = tuple(x[2])
            x[7] = p2p(x[3], x[4], x[9])
        out.append(tuple(x))
    return out


class _Pair:
    """The flows between two groups' deployments (a :class:`PairTemplate` placed at groups ``g1``,
    ``g2``): per destination stage index as plain tuples ``(source stage index, source replica, a,
    b, source machine, destination machine, seconds, destination replica, bytes)`` for the event
    loop (``fast``), and as :class:`Flow` objects for the recorder (``by_dst``, built on demand)."""

    __slots__ = ("tpl", "g1", "g2", "fast", "gathers", "_timed", "_by_dst")

    def __init__(self, tpl: PairTemplate, g1: int, g2: int, k: int):
        self.tpl, self.g1, self.g2 = tpl, g1, g2
        src_base = [ph * k + g1 for ph in (FWD, BWD)]
        k2 = 2 * k
        # Tuples of numbers only: the garbage collector stops tracking them (big caches stay cheap).
        self.fast = tuple([(ph * k + g2 + k2 * du,
                            tuple([(src_base[sp] + k2 * su if sp != PARAM else -1, ri, a, b, ma, mb, t, rj, nb)
                                   for sp, su, ri, rj, a, b, ma, mb, t, nb in fl]))
                           for (ph, du), fl in tpl.by_dst])
        self.gathers = tuple((ph * k + g2 + k2 * du, sets) for (ph, du), sets in tpl.gathers)
        """Per destination stage index: the holder sets all-gathering scattered pieces
        (:attr:`PairTemplate.gathers`)."""
        self._timed = None
        self._by_dst = None

    def timed(self, sim: Simulator) -> tuple:
        """:attr:`gathers` with each set's all-gather seconds and total bytes: ``(dst, ((lo, hi,
        devices, seconds, bytes), ...), (chunks, ...))`` (:meth:`Simulator.scatter_gather_time`),
        made on first use: what a run takes as it is where no other pair scatters into the stage."""
        if self._timed is None:
            self._timed = tuple((dst, tuple((lo, hi, devs, sim.scatter_gather_time(devs, c), sum(c))
                                            for lo, hi, devs, c in sets), tuple(c for *_, c in sets))
                                for dst, sets in self.gathers)
            sim._meter.bytes += ref_bytes(len(self._timed)) + sum(2 * ref_bytes(len(sets)) + ENTRY_BYTES * len(sets)
                                                                for _, sets, _ in self._timed)
        return self._timed

    @property
    def nbytes(self) -> int:
        """Approximate bytes of ``fast`` and ``gathers`` (``by_dst``, made for the recorder only, not counted)."""
        return (sum(ref_bytes(len(fl)) + FLOW_BYTES * len(fl) for _, fl in self.fast) + ref_bytes(len(self.fast))
                + ref_bytes(len(self.gathers)))

    @property
    def by_dst(self) -> list[tuple[tuple, list[Flow]]]:
        """``[((phase, g2, chunk), [Flow])]``: ``fast`` with the stages spelled out."""
        if self._by_dst is None:
            g1, g2 = self.g1, self.g2
            self._by_dst = [((ph, g2, du), [Flow((sp, g1, su), ri, (ph, g2, du), rj, a, b, nb, t, ma, mb)
                                            for sp, su, ri, rj, a, b, ma, mb, t, nb in fl])
                            for (ph, du), fl in self.tpl.by_dst]
        return self._by_dst

    @property
    def flows(self) -> list[Flow]:
        return [f for _, fl in self.by_dst for f in fl]


def _merge_gathers(sim: Simulator, ents: list[tuple]) -> list[tuple]:
    """The holder sets of one stage into which several pairs scatter (``ents``: their
    :meth:`_Pair.timed` entries, in placement order): in order of first appearance, each set's
    chunks summed over the pairs in that order (``(0 + first) + second + ...``: the first pair's
    chunks, then the sums) and timed where more than one pair sent to it."""
    sets, chunks = list(ents[0][1]), list(ents[0][2])
    where = {st[:3]: i for i, st in enumerate(sets)}
    summed = set()
    for _, more, more_chunks in ents[1:]:
        for st, c in zip(more, more_chunks):
            i = where.get(st[:3])
            if i is None:
                where[st[:3]] = len(sets)
                sets.append(st)
                chunks.append(c)
            else:
                chunks[i] = [y + z for y, z in zip(chunks[i], c)]
                summed.add(i)
    for i in summed:
        lo, hi, devs = sets[i][:3]
        sets[i] = (lo, hi, devs, sim.scatter_gather_time(devs, tuple(chunks[i])), sum(chunks[i]))
    return sets


class _Micro(NamedTuple):
    """A pipeline run (:meth:`Simulator._micro`). Micro-batch ``m`` of a stage is addressed as
    chunk ``m`` of its groups (pipeline groups are data parallel: they have no position chunks),
    so stage indices, flows and the recorder's stage keys carry the micro-batch unchanged."""

    gds: list[list[GroupData]]
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

    tied_shards: tuple[tuple[int, int, int, int], ...] = ()
    """(tensor, the owner's ZeRO level (0: not sharded), the owner's shard size, the reading group's
    shard size) of each tied weight of :attr:`tied` one of whose groups is sharded (a shard size 1:
    not sharded): its owner's layout prices the weight's state as its level's, the executor holds it
    as ZeRO-1 on each stage (:func:`_hold_tied`)."""

    def select(self, part: str) -> tuple:
        """:func:`tag.sim.units.pair_kinds`'s ``select`` of ``part`` (``micro``, ``first``,
        ``last``, ``all``) leaving out :attr:`tied` and :attr:`relayed`."""
        return part, self.tied, self.relayed


class _Shifted:
    """The flows of a :class:`_Pair` moved to micro-batch ``m`` (chunk ``m`` of both groups)."""

    __slots__ = ("fast", "gathers", "pr", "m", "_by_dst")

    def __init__(self, pr: _Pair, m: int, k: int):
        off = 2 * k * m
        self.pr, self.m, self._by_dst = pr, m, None
        self.fast = tuple((dst + off, tuple((si + off if si >= 0 else si, *rest) for si, *rest in fl))
                          for dst, fl in pr.fast)
        self.gathers = tuple((dst + off, sets) for dst, sets in pr.gathers)

    @property
    def by_dst(self) -> list[tuple[tuple, list[Flow]]]:
        if self._by_dst is None:
            m = self.m
            self._by_dst = [((ph, g2, m), [replace(f, src=(f.src[0], f.src[1], m) if f.src[0] != PARAM else f.src,
                                                   dst=(ph, g2, m)) for f in fl])
                            for (ph, g2, _), fl in self.pr.by_dst]
        return self._by_dst


class _Run:
    """The event loop: one simulated iteration (see the module docstring). Stages are flat indices
    (:meth:`Simulator._stage_index`), transfers plain tuples (:class:`_Pair`).

    ``rec``: a :class:`_Recorder` that records every task with its predecessor (critical path,
    timeline), or None (the search's hot path). The loop calls it, when present, after computing
    a task's times and before updating the resources' state; it computes no time."""

    def __init__(self, sim: Simulator, gds: list[GroupData], rec: _Recorder | None = None,
                 micro: _Micro | None = None):
        self.sim, self.gds, self.rec, self.micro = sim, gds, rec, micro
        n, m = sim.num_devices, sim.num_machines
        # stage index -> (offset, flows): the flows of pr.fast lists into it, their source stage
        # indices less the offset (a pipeline's micro-batch m: 2 K m, the same for all)
        incoming: dict[int, tuple[int, list]] = {}
        if micro is None:
            placed = [(pr, 0) for pr in sim._pairs_used(gds)]
        elif len(micro.gds) == 1:  # one micro-batch: the flows of the plan without a pipeline
            placed = [(pr, 0) for pr in sim._pairs_used(micro.gds[0], micro.select("all"))]
        else:  # every micro-batch's flows, at its chunk index; what moves once per iteration at
            # the first micro-batch (batch-independent tensors) or the last (deferred partial sums)
            k, last = len(gds), len(micro.gds) - 1
            used: dict[int, list] = {}  # micro-batches of one size share one deployment: its pairs once
            placed = []
            for j, mg in enumerate(micro.gds):
                prs = used.get(id(mg))
                if prs is None:
                    prs = used[id(mg)] = sim._pairs_used(mg, micro.select("micro"))
                placed += [(pr, 2 * k * j) for pr in prs]
            placed += [(pr, 0) for pr in sim._pairs_used(micro.gds[0], micro.select("first"))]
            placed += [(pr, 2 * k * last) for pr in sim._pairs_used(micro.gds[last], micro.select("last"))]
        scattered: dict[int, list] = {}  # stage -> the timed gathers (_Pair.timed) of the pairs scattering into it
        for pr, off in placed:
            for dst, fl in pr.fast:
                x = incoming.get(dst + off)
                if x is None:
                    incoming[dst + off] = (off, [fl])
                else:
                    x[1].append(fl)
            if pr.gathers:
                for ent in pr.timed(sim):
                    x = scattered.get(ent[0] + off)
                    if x is None:
                        scattered[ent[0] + off] = [ent]
                    else:
                        x.append(ent)
        self.incoming = incoming
        # one pair's sets as it timed them; several pairs' merged (a pipeline's micro-batches merge
        # the same pairs' sets at every offset: once per run, keyed by the entries, which the pairs hold)
        merged: dict[tuple, list] = {}
        gathers = {}
        for dst, ents in scattered.items():
            if len(ents) == 1:
                gathers[dst] = ents[0][1]
                continue
            key = tuple([id(e) for e in ents])
            out = merged.get(key)
            if out is None:
                out = merged[key] = _merge_gathers(sim, ents)
            gathers[dst] = out
        self.gathers = gathers
        """Stage index -> ``(lo, hi, devices, seconds, bytes)`` of each consumer holder set that
        all-gathers the pieces scattered into it (:meth:`_scatter_gather`)."""
        self.buf = [0.0] * n
        self.cfree = [0.0] * n
        self.cend = [0.0] * n  # end of each device's last compute (wake penalty)
        self.hfree = [0.0] * n  # when each device's host has issued its last stage (Layout.host)
        self.comp = [0.0] * n
        self.comm_free = [0.0] * n
        self.comm_busy = [0.0] * n
        self.nic_out = [0.0] * m
        self.nic_in = [0.0] * m
        chunks = max([len(gd.units) for gd in gds]) if micro is None else len(micro.gds)
        self.sfin: list = [None] * (2 * len(gds) * chunks)  # stage index -> finish per replica
        self.group_finish = [0.0] * len(gds)
        sfb = [gd.sfb for gd in gds]
        self.any_sfb = sfb.count(None) < len(sfb)
        self.sfb_ready: dict[int, float] = {}
        self.shared_net = sim.topology.background or None  # other jobs' traffic (tag.topology.background)
        if rec is not None:
            rec.bind(self, [pr if micro is None else _Shifted(pr, off // (2 * len(gds)), len(gds))
                            for pr, off in placed])

    # ---- transfers ----------------------------------------------------------------------
    def _transfer(self, inc: tuple[int, list], nrep: int, idx: int) -> list[float]:
        """The messages into stage ``idx`` (``inc``: the offset and flows of ``incoming``;
        :func:`_messages`), in order; per replica of the stage, when its last message arrives."""
        ready = [0.0] * nrep
        cf, nout, nin, busy, sfin = self.comm_free, self.nic_out, self.nic_in, self.comm_busy, self.sfin
        cfree, buf, rec = self.cfree, self.buf, self.rec
        off, fls = inc
        msgs = self.sim._messages(fls)
        for si, sr, more, a, b, ma, mb, t, r, nb, waits in msgs:
            s = sfin[si + off][sr] if si >= 0 else 0.0
            if more is not None:  # ready once every flow of the message is
                for si, sr in more:
                    x = sfin[si + off][sr] if si >= 0 else 0.0
                    if x > s:
                        s = x
            if nb > buf[a]:
                buf[a] = nb
            if nb > buf[b]:
                buf[b] = nb
            # A rendezvous, as in the executor: it starts once the data is ready, both comm
            # streams are free and the receiver's compute stream reached this step of the
            # schedule, the sender's too where it waits (a GPU sender that receives nothing in
            # the step posts its sends on a stream waiting for their data alone,
            # DistComm._send_when_made)
            x = cf[a]
            if x > s:
                s = x
            x = cf[b]
            if x > s:
                s = x
            if waits:
                x = cfree[a]
                if x > s:
                    s = x
            x = cfree[b]
            if x > s:
                s = x
            if ma >= 0:  # crossing machines: the source's outgoing and destination's incoming side
                x = nout[ma]
                if x > s:
                    s = x
                x = nin[mb]
                if x > s:
                    s = x
                e = s + t if self.shared_net is None else self._slowed((ma, mb), s, t)
                if rec is not None:
                    rec.flow(idx, a, b, ma, mb, s, e, r, nb, waits)
                nout[ma] = nin[mb] = e
            else:
                e = s + t
                if rec is not None:
                    rec.flow(idx, a, b, ma, mb, s, e, r, nb, waits)
            cf[a] = cf[b] = cfree[b] = e  # the receiver waits for the transfer
            if waits:  # and the sender, unless it is a GPU rank receiving nothing in the step
                cfree[a] = e
            busy[a] += t
            busy[b] += t
            if e > ready[r]:
                ready[r] = e
        return ready

    def _slowed(self, machines: tuple[int, ...], s: float, t: float) -> float:
        """When a message (two machines, sender first) or a collective over ``machines`` of ``t``
        nominal seconds, started at ``s``, ends on what other jobs leave of their NICs and links
        (:func:`tag.topology.background.group_profile`)."""
        from ..topology.background import group_profile

        prof = self.sim._paths.get(machines, False)
        if prof is False:
            prof = self.sim._paths[machines] = group_profile(self.sim.topology, machines)
        off = self.sim.time_offset_s
        return s + t if prof is None else prof.finish(s + off, t) - off

    def _net_slowed(self, lay: Layout, ph: int, g: int, end: list[float]) -> list[float]:
        """``end`` (per replica, stage ``(ph, g)`` on ``lay`` at nominal speed) with the stage's
        tensor-parallel collectives across machines (:attr:`Layout.net`, their nominal seconds at
        the stage's end) on what other jobs leave of their machines' NICs and links."""
        out = list(end)
        for r, c in enumerate(lay.net[ph, g].tolist()):
            if c > 0.0:
                out[r] = self._slowed(lay.net_machines[r], end[r] - c, c)
        return out

    def _scatter_gather(self, idx: int, ready: list[float]) -> None:
        """The all-gathers of stage ``idx``'s consumer holder sets that received scattered pieces
        (``ready``: per replica, when its last message arrived; updated in place): each starts
        once every replica of its set received its slices and its devices' streams are free (a
        blocking collective in the executor's transfer step) and lasts the all-gather of the
        received bytes over the set's devices (one machine)."""
        cf, cfree, busy, buf, rec = self.comm_free, self.cfree, self.comm_busy, self.buf, self.rec
        for lo, hi, devs, t, nb in self.gathers[idx]:
            s = ready[lo]  # the latest of the set's arrivals and its devices' streams
            for x in ready[lo + 1:hi]:
                if x > s:
                    s = x
            for d in devs:
                x = cf[d]
                if x > s:
                    s = x
            for d in devs:
                x = cfree[d]
                if x > s:
                    s = x
            e = s + t
            if rec is not None:
                rec.scatter_gather(idx, lo, hi, devs, s, e, nb)
            for d in devs:
                cf[d] = cfree[d] = e
                busy[d] += t
                if nb > buf[d]:
                    buf[d] = nb
            ready[lo:hi] = [e] * (hi - lo)

    # ---- compute segments -------------------------------------------------------------------
    def _phase(self, ph: int, order: list[int], m: int = 0) -> None:
        """The stages of phase ``ph`` of the groups in ``order``: segments of consecutive stages
        on one layout with no transfer in (cumulative sums), an mp chunk alone. ``m``: the
        micro-batch (a pipeline's; its stages are chunk ``m`` of their groups)."""
        gds, incoming, rec = self.gds if self.micro is None else self.micro.gds[m], self.incoming, self.rec
        k = len(gds)
        k2 = 2 * k
        base = ph * k + k2 * m
        sfb = ph == BWD and self.any_sfb  # an SFB group ends a backward segment
        fwd = ph == FWD
        cfree, comp, sfin, gf, cend = self.cfree, self.comp, self.sfin, self.group_finish, self.cend
        wake = self.sim.any_wake
        i, n = 0, len(order)
        while i < n:
            g = order[i]
            gd = gds[g]
            lay = gd.layout
            if lay is None:  # mp: one single-device stage per chunk
                units = gd.units
                nu = len(units)
                for j in (range(nu) if fwd else range(nu - 1, -1, -1)):
                    unit = units[j]
                    idx = base + g + k2 * j
                    d = unit.devices[0]
                    inc = incoming.get(idx)
                    if inc:
                        y = self._transfer(inc, 1, idx)[0]
                        c = cfree[d]
                        st = y if y > c else c
                    else:
                        st = cfree[d]
                    pen = wake_extra(self.sim, unit, g, ph, [st], cend) if wake else None
                    x = (st if pen is None else st + pen[0]) + unit.dur[ph]
                    if unit.host is not None:  # its host issues it from where it is (_hosted)
                        h = self.hfree[d]
                        y = h + unit.dur[ph] + unit.lag[ph]
                        if y > x:
                            x = y
                        self.hfree[d] = h + unit.host[ph]
                    sfin[idx] = [x]
                    if not fwd and x > gf[g]:
                        gf[g] = x
                    if rec is not None:
                        rec.segment(ph, [(g, j)], unit, [st], [y] if inc else None)
                    cfree[d] = cend[d] = x
                    comp[d] += x - st
                i += 1
                continue
            idx = base + g
            devs = lay.devices
            inc = incoming.get(idx)
            if inc:
                ready = self._transfer(inc, len(devs), idx)
                if idx in self.gathers:
                    self._scatter_gather(idx, ready)
                start = [y if y > cfree[d] else cfree[d] for d, y in zip(devs, ready)]
            else:
                start = [cfree[d] for d in devs]
            pen = wake_extra(self.sim, gd.units[0], g, ph, start, cend) if wake else None
            go = start if pen is None else [x + y for x, y in zip(start, pen)]
            e = i + 1
            net = lay.net if self.shared_net is not None else None  # tp collectives across machines
            if not (sfb and gd.sfb is not None) and net is None:  # (slowed group by group)
                while e < n:
                    g2 = order[e]
                    gd2 = gds[g2]
                    if gd2.layout is not lay or base + g2 in incoming:
                        break
                    e += 1
                    if sfb and gd2.sfb is not None:
                        break
            length = e - i
            if length > 1:  # a run of stages on one layout: cumulative sums over the groups
                if fwd:
                    b0, rows = lay.cum_fwd[g], lay.cum_fwd[g + 1:g + length + 1]
                else:
                    i0 = k - 1 - g
                    b0, rows = lay.cum_bwd[i0], lay.cum_bwd[i0 + 1:i0 + length + 1]
                if lay.hosts is None:
                    fin_a = np.asarray(go) + (rows - b0)
                else:  # the host issues the run's stages one after the other, from where it is
                    fin_a = self._hosted(lay, fwd, g if fwd else k - 1 - g, length, devs, go) + (rows - b0)
                fin = fin_a.tolist()
                end = fin[-1]
                if fwd:  # groups g .. g + length - 1
                    sfin[idx:idx + length] = fin
                else:  # groups g, g - 1, ..., g - length + 1; each its first and only stage
                    fin.reverse()
                    sfin[idx - length + 1:idx + 1] = fin
                    mx = fin_a.max(axis=1).tolist()
                    mx.reverse()
                    gf[g - length + 1:g + 1] = mx
            else:
                r = lay.rows[g]
                end = [x + y for x, y in zip(go, r[ph] if r is not None else lay.row(g)[ph])]
                if lay.hosts is not None:
                    end = self._hosted_one(lay, ph, g, devs, end)
                if net is not None:
                    end = self._net_slowed(lay, ph, g, end)
                sfin[idx] = end
                if not fwd:
                    x = max(end)
                    if x > gf[g]:
                        gf[g] = x
            if rec is not None:
                rec.segment(ph, [(g2, m) for g2 in order[i:e]], gd.units[0], start, ready if inc else None)
            for r, d in enumerate(devs):
                x = end[r]
                cfree[d] = cend[d] = x
                comp[d] += x - start[r]
            if sfb:
                g2 = order[e - 1]
                if gds[g2].sfb is not None:
                    self._sfb(g2, end)
            i = e

    def _hosted(self, lay: Layout, fwd: bool, p0: int, length: int, devs: tuple[int, ...],
                go: list[float]) -> np.ndarray:
        """[length, R] when each stage of a run of ``length`` stages on ``lay`` (positions ``p0 ..``
        of the phase's order, :attr:`Layout.hosts`) finishes less the run's device seconds up to
        it, the device free at ``go``: stage ``k`` ends at ``F_k = max(F_(k-1) + g_k, H_k + g_k +
        lag_k)``, ``H_k`` when the host starts issuing it (the device's host free at the run's
        start, then each stage's host seconds after the other), so ``F_k - G_k = max(go, H +
        max_(j <= k)(H_j - H - G_(j-1) + lag_j))`` (``G`` the run's device seconds). The host
        moves on to the end of its launches: it waits for nothing (NCCL's sends and receives
        order the streams, not the host)."""
        cum_h, base, peak = lay.hosts[0 if fwd else 1]
        hfree = self.hfree
        h0 = np.array([hfree[d] for d in devs])
        lead = np.maximum(np.asarray(go), h0 + (np.maximum.accumulate(peak[p0:p0 + length], axis=0) - base[p0]))
        for d, x in zip(devs, (h0 + (cum_h[p0 + length] - cum_h[p0])).tolist()):
            hfree[d] = x
        return lead

    def _hosted_one(self, lay: Layout, ph: int, g: int, devs: tuple[int, ...], end: list[float]) -> list[float]:
        """``end`` (per replica, stage ``(ph, g)`` on ``lay`` run on the device from its start) no
        earlier than the host allows: its host starts issuing it at ``H`` (when it issued its last
        stage) and the stage ends no earlier than ``H + dur + lag`` (:meth:`_hosted`)."""
        hfree, dur, host, lag = self.hfree, lay.dur[ph, g].tolist(), lay.host[ph, g].tolist(), lay.lag[ph, g].tolist()
        out = []
        for r, d in enumerate(devs):
            h = hfree[d]
            x = h + dur[r] + lag[r]
            out.append(x if x > end[r] else end[r])
            hfree[d] = h + host[r]
        return out

    def _sfb(self, g: int, fin: list[float]) -> None:
        """SFB of group ``g`` after its backward, which ended at ``fin`` (per replica): the factor
        all-gathers once every replica finished, then each replica's recompute."""
        sd = self.gds[g].sfb
        rec = self.rec
        s = max(fin)
        cf, busy, buf, nout, nin = self.comm_free, self.comm_busy, self.buf, self.nic_out, self.nic_in
        for d in sd.members:
            if cf[d] > s:
                s = cf[d]
        for m in sd.machines:
            if nout[m] > s:
                s = nout[m]
            if nin[m] > s:
                s = nin[m]
        for x, t in enumerate(sd.gather_times):  # one collective per factor, back to back
            e = s + t
            if rec is not None:
                rec.gather(g, x, s, e)
            s = e
        for d in sd.members:
            cf[d] = s
            busy[d] += sd.gather_total
            if sd.buffer_bytes > buf[d]:
                buf[d] = sd.buffer_bytes
        for m in sd.machines:
            nout[m] = nin[m] = s
        cfree, comp = self.cfree, self.comp
        ready = 0.0
        for d, t in zip(sd.devices, sd.recompute):
            st = s if s >= cfree[d] else cfree[d]
            if rec is not None:
                rec.recompute(g, d, s, st, st + t)
            cfree[d] = self.cend[d] = st + t
            comp[d] += t
            if st + t >= ready:
                ready = st + t
        self.sfb_ready[g] = ready

    # ---- synchronisation and update ----------------------------------------------------------
    def _syncs(self) -> list[float]:
        """Gradient synchronisations (:meth:`Simulator.sync_jobs`); returns per-device last sync end.

        Only syncs use the comm streams and network sides from here on, so a sync over the same
        members as the previous one finds all of them free at that sync's end: consecutive syncs
        over one member set are chained without per-device work, which is settled once per run.
        """
        n = self.sim.num_devices
        sync_end = [0.0] * n
        cf, busy, buf, nout, nin = self.comm_free, self.comm_busy, self.buf, self.nic_out, self.nic_in
        gds, gf, sfb_ready, rec = self.gds, self.group_finish, self.sfb_ready, self.rec
        cfree, shared = self.cfree, self.sim.shared_stream

        def close_run(gd, end: float, run_busy: float, run_bytes: float) -> None:
            """A run of syncs over ``gd``'s members ends at ``end`` (seconds): their links are
            busy until then and hold the run's largest buffer (bytes)."""
            if rec is not None:
                rec.close_syncs(gd)
            for d in gd.sync_devices:
                cf[d] = sync_end[d] = end
                busy[d] += run_busy
                if run_bytes > buf[d]:
                    buf[d] = run_bytes
            for m in gd.sync_machines:
                nout[m] = nin[m] = end

        cur = None  # GroupData starting the current run of syncs over one member set
        run_end, run_busy, run_bytes = 0.0, 0.0, 0.0
        for gs, gd in self.sim.sync_jobs(gds, frozenset() if self.micro is None else self.micro.tied):
            s = -math.inf
            for g in gs:
                sg = sfb_ready[g] if gds[g].sfb is not None else gf[g]
                if sg > s:
                    s = sg
            if cur is not None and gd.sync_devices == cur.sync_devices:
                if run_end > s:
                    s = run_end
            else:
                if cur is not None:
                    close_run(cur, run_end, run_busy, run_bytes)
                cur, run_busy, run_bytes = gd, 0.0, 0.0
                for d in gd.sync_devices:
                    if cf[d] > s:
                        s = cf[d]
                    if shared[d] and cfree[d] > s:  # a CPU rank: after its compute
                        s = cfree[d]
                for m in gd.sync_machines:
                    if nout[m] > s:
                        s = nout[m]
                    if nin[m] > s:
                        s = nin[m]
            run_end = s + gd.sync_time
            if self.shared_net is not None and gd.sync_machines:  # crossing machines: other jobs' traffic
                run_end = self._slowed(gd.sync_machines, s, gd.sync_time)
            if rec is not None:
                rec.sync(gs, gd, s, run_end)
            run_busy += gd.sync_time
            run_bytes = max(run_bytes, gd.sync_bytes)
        if cur is not None:
            close_run(cur, run_end, run_busy, run_bytes)
        return sync_end

    def execute(self) -> SimResult:
        """Run the iteration. Without a recorder the critical path is computed on first access by
        replaying the iteration with one."""
        sim, gds, rec, micro = self.sim, self.gds, self.rec, self.micro
        k = len(gds)
        if micro is None:
            self._phase(FWD, list(range(k)))
            self._phase(BWD, list(range(k - 1, -1, -1)))
        else:  # the pipeline's tasks in the schedule's order (tag.parallel.pipeline)
            for stage, ph, m in micro.tasks:
                gs = micro.members[stage]
                self._phase(ph, gs if ph == FWD else gs[::-1], m)
        sync_end = self._syncs()
        final, before, upd_start, holds, res = _result(sim, self, sync_end, _holdings(sim, gds, micro))
        if rec is None:
            res.path_fn = lambda: _Run(sim, gds, _Recorder(), micro).execute().critical_path
        else:
            rec.close(final, before, upd_start, sync_end, holds)
            res.path_fn = rec.critical_path
        return res


def _binding(s: float, waits) -> object:
    """The predecessor of a task that started at ``s``: of its ``waits`` ``(time, task ref)``, in
    the order the event loop takes their maximum (``if x > s: s = x``, which keeps the first
    maximum), the first whose time is ``s``."""
    for x, ref in waits:
        if x == s:
            return ref
    raise AssertionError(f"the recorder's waits miss the task's start {s!r}")


class _Recorder:
    """Records one :class:`_Run`: every task with its start, end and predecessor (the task that
    released what it waited for last), for :attr:`SimResult.critical_path` and the timeline.
    Task references: ``("c", segment, row, replica)`` a compute stage, ``("f", i)`` a message,
    ``("s", i)`` a sync, ``("a", i)`` an SFB all-gather, ``("r", i)`` an SFB recompute,
    ``("b", g)`` the replica of group ``g``'s backward that finished last, ``("g", i)`` the
    all-gather of pieces scattered into a tensor-parallel group.

    The hooks get the times the loop computed and read the loop's resource state before the loop
    updates it; the recorder keeps, per resource, the task that last released it."""

    def bind(self, run: _Run, pairs: list[_Pair]) -> None:
        """Record ``run``, whose transfers are those of ``pairs`` (:meth:`Simulator._pairs_used`)."""
        sim = run.sim
        n, m = sim.num_devices, sim.num_machines
        self.run, self.sim, self.gds = run, sim, run.gds
        self.last_task: list = [None] * n  # per device: last task on its compute stream
        self.last_comm: list = [None] * n  # per device: last task on its comm stream
        self.last_nout: list = [None] * m
        self.last_nin: list = [None] * m
        self.sync_last: list = [None] * n  # per device: its last sync
        self.incoming: dict[int, list[Flow]] = {}  # stage index -> flows, as the loop's incoming
        self.segs: list[tuple] = []  # (ph, stages, unit, start, cf, ready, rsrc, prev, fin)
        self.stage_loc: dict[tuple, tuple[int, int]] = {}  # (ph, g, j) -> (segment, row)
        self.flows: list[tuple] = []  # messages: (first flow, flows, bytes, start, end, pred)
        self.syncs: list[tuple] = []  # (groups, job, start, end, pred)
        self.gathers: list[tuple] = []  # SFB all-gathers: (group, factor index, start, end, pred)
        self.scatters: list[tuple] = []  # scatter-gathers: (first flow in, devices, bytes, start, end, pred)
        self.recomputes: list[tuple] = []  # SFB recomputes: (group, device, start, end, pred)
        self.sfb_ref: dict[int, tuple] = {}  # group -> (last replica's recompute end, its ref)
        self._msgs: dict = {}  # (a, b) -> [flows, source ready, its ref] of the stage self._idx
        self._idx = -1
        self._rsrc: dict[int, tuple] = {}  # destination replica -> (last arrival, its ref)
        self._open = False  # a run of syncs over one member set is open (the next sync chains)
        inc = self.incoming
        for pr in pairs:
            for dst, fl in pr.by_dst:
                inc.setdefault(sim._stage_index(dst), []).extend(fl)

    # ---- hooks ----------------------------------------------------------------------------
    def flow(self, idx: int, a: int, b: int, ma: int, mb: int, s: float, e: float, r: int, nb: float,
             waits: bool = True) -> None:
        if idx != self._idx:  # the first message into stage idx: its flows grouped as the loop's
            self._idx, self._rsrc, msgs = idx, {}, {}
            loc, segs = self.stage_loc, self.segs
            for f in self.incoming[idx]:
                if f.src[0] == PARAM:
                    s0, p0 = 0.0, None
                else:
                    sid, row = loc[f.src]
                    s0, p0 = segs[sid][8][row][f.src_rep], ("c", sid, row, f.src_rep)
                m = msgs.get((f.a, f.b))
                if m is None:
                    msgs[(f.a, f.b)] = [[f], s0, p0]
                else:
                    m[0].append(f)
                    if s0 > m[1]:
                        m[1], m[2] = s0, p0
            self._msgs = msgs
        parts, s0, p0 = self._msgs[(a, b)]
        run, lc, lt = self.run, self.last_comm, self.last_task
        held = [(s0, p0), (run.comm_free[a], lc[a]), (run.comm_free[b], lc[b])]
        held += [(run.cfree[a], lt[a]), (run.cfree[b], lt[b])] if waits else [(run.cfree[b], lt[b])]
        if ma >= 0:
            held += [(run.nic_out[ma], self.last_nout[ma]), (run.nic_in[mb], self.last_nin[mb])]
        ref = ("f", len(self.flows))
        self.flows.append((parts[0], len(parts), nb, s, e, _binding(s, held)))
        lc[a] = lc[b] = lt[b] = ref
        if waits:
            lt[a] = ref
        if ma >= 0:
            self.last_nout[ma] = self.last_nin[mb] = ref
        x = self._rsrc.get(r)
        if e > (x[0] if x is not None else 0.0):
            self._rsrc[r] = (e, ref)

    def scatter_gather(self, idx: int, lo: int, hi: int, devs: tuple[int, ...], s: float, e: float,
                       nb: float) -> None:
        """The all-gather over ``devs`` (replicas ``lo .. hi - 1`` of stage ``idx``) of the pieces
        scattered into them: after their last arrivals and their devices' streams."""
        run, got = self.run, self._rsrc
        waits = [got.get(r, (0.0, None)) for r in range(lo, hi)]
        waits = [max(waits, key=lambda w: w[0])]  # (the first maximum, as the loop's max())
        for d in devs:
            waits += [(run.comm_free[d], self.last_comm[d]), (run.cfree[d], self.last_task[d])]
        ref = ("g", len(self.scatters))
        self.scatters.append((self.incoming[idx][0], devs, nb, s, e, _binding(s, waits)))
        for d in devs:
            self.last_comm[d] = self.last_task[d] = ref
        for r in range(lo, hi):
            got[r] = (e, ref)

    def segment(self, ph: int, stages: list[tuple[int, int]], unit: Unit, start: list[float],
                ready: list[float] | None) -> None:
        """Stages ``stages`` ((group, chunk), in order) of phase ``ph`` on ``unit``'s replicas,
        the first starting at ``start``; ``ready``: when its last transfer in arrived (or None)."""
        run, devs, lt = self.run, unit.devices, self.last_task
        cf = [run.cfree[d] for d in devs]
        rsrc = None
        if ready is not None:
            got = self._rsrc
            rsrc = [got[r][1] if r in got else None for r in range(len(devs))]
        index = self.sim._stage_index
        fin = [run.sfin[index((ph, g, j))] for g, j in stages]
        sid = len(self.segs)
        self.segs.append((ph, stages, unit, start, cf, ready, rsrc, [lt[d] for d in devs], fin))
        loc = self.stage_loc
        for row, (g, j) in enumerate(stages):
            loc[(ph, g, j)] = (sid, row)
        last = len(stages) - 1
        for r, d in enumerate(devs):
            lt[d] = ("c", sid, last, r)

    def gather(self, g: int, x: int, s: float, e: float) -> None:
        """The all-gather of factor ``x`` of SFB group ``g``; the first waits for the group's
        backward on every replica, the members' comm streams and the machines' network sides."""
        sd = self.gds[g].sfb
        run = self.run
        if x == 0:
            sid, row = self.stage_loc[(BWD, g, 0)]
            fin = self.segs[sid][8][row]
            r0 = max(range(len(fin)), key=fin.__getitem__)
            waits = [(fin[r0], ("c", sid, row, r0))]
            waits += [(run.comm_free[d], self.last_comm[d]) for d in sd.members]
            for m in sd.machines:
                waits += [(run.nic_out[m], self.last_nout[m]), (run.nic_in[m], self.last_nin[m])]
            p = _binding(s, waits)
        else:
            p = ("a", len(self.gathers) - 1)
        ref = ("a", len(self.gathers))
        self.gathers.append((g, x, s, e, p))
        if x == len(sd.gather_times) - 1:
            for d in sd.members:
                self.last_comm[d] = ref
            for m in sd.machines:
                self.last_nout[m] = self.last_nin[m] = ref

    def recompute(self, g: int, d: int, s: float, st: float, e: float) -> None:
        """SFB group ``g``'s recompute on device ``d`` from ``st`` to ``e``, its all-gathers having
        ended at ``s``."""
        p = _binding(st, [(s, ("a", len(self.gathers) - 1)), (self.run.cfree[d], self.last_task[d])])
        ref = ("r", len(self.recomputes))
        self.recomputes.append((g, d, st, e, p))
        self.last_task[d] = ref
        x = self.sfb_ref.get(g)
        if x is None or e >= x[0]:
            self.sfb_ref[g] = (e, ref)

    def sync(self, gs: tuple[int, ...], gd, s: float, e: float) -> None:
        """The sync ``gd`` of groups ``gs``: after the previous sync when it continues a run of syncs
        over one member set, else after the members' streams and the machines' network sides."""
        run = self.run
        waits = [(run.sfb_ready[g], self.sfb_ref[g][1]) if self.gds[g].sfb is not None
                 else (run.group_finish[g], ("b", g)) for g in gs]
        if self._open:
            waits.append((self.syncs[-1][3], ("s", len(self.syncs) - 1)))
        else:
            shared = self.sim.shared_stream
            for d in gd.sync_devices:
                waits.append((run.comm_free[d], self.last_comm[d]))
                if shared[d]:
                    waits.append((run.cfree[d], self.last_task[d]))
            for m in gd.sync_machines:
                waits += [(run.nic_out[m], self.last_nout[m]), (run.nic_in[m], self.last_nin[m])]
        self.syncs.append((gs, gd, s, e, _binding(s, waits)))
        self._open = True

    def close_syncs(self, gd) -> None:
        """A run of syncs over ``gd``'s members ended with the last recorded sync."""
        self._open = False
        ref = ("s", len(self.syncs) - 1)
        for d in gd.sync_devices:
            self.last_comm[d] = self.sync_last[d] = ref
        for m in gd.sync_machines:
            self.last_nout[m] = self.last_nin[m] = ref

    def close(self, final, before, upd_start, sync_end, holds) -> None:
        """The optimizer steps (per device: start, end; whether it holds parameters), the compute
        streams' ends before them and the last syncs' ends."""
        self._end = (final, before, upd_start, sync_end, holds)

    # ---- critical path and timeline -------------------------------------------------------
    def _seg_task(self, sid: int, row: int, r: int) -> tuple[str, float, float, object]:
        ph, stages, unit, start, cf, ready, rsrc, prev, fin = self.segs[sid]
        s = start[r] if row == 0 else fin[row - 1][r]
        if row > 0:
            pred = ("c", sid, row - 1, r)
        elif ready is not None and ready[r] > cf[r]:
            pred = rsrc[r]
        else:
            pred = prev[r] if cf[r] > 0 else None
        g, j = stages[row]
        name = f"{self._stage_name(ph, g, j)} @d{unit.devices[r]}"
        return name, s, fin[row][r], pred

    def _resolve(self, ref):
        """(name, start, end, predecessor ref) of a task reference."""
        kind = ref[0]
        if kind == "c":
            return self._seg_task(*ref[1:])
        if kind == "f":
            f, parts, nbytes, s, e, p = self.flows[ref[1]]
            more = f" +{parts - 1}" if parts > 1 else ""
            name = (f"send {PHASE_NAME[f.src[0]]} g{f.src[1]}{more} -> {PHASE_NAME[f.dst[0]]} g{f.dst[1]} "
                    f"d{f.a}->d{f.b} ({nbytes:.0f} B)")
            return name, s, e, p
        if kind == "s":
            gs, gd, s, e, p = self.syncs[ref[1]]
            if p is not None and p[0] == "b":
                p = self._bwd_last(p[1])
            return _sync_name(gd, gs), s, e, p
        if kind == "a":
            g, x, s, e, p = self.gathers[ref[1]]
            sd = self.gds[g].sfb
            return f"allgather g{g} {sd.gather_names[x]} ({sd.gather_bytes[x]:.0f} B)", s, e, p
        if kind == "r":
            g, d, s, e, p = self.recomputes[ref[1]]
            return f"sfb g{g} @d{d}", s, e, p
        if kind == "g":
            f, devs, nbytes, s, e, p = self.scatters[ref[1]]
            name = (f"allgather {PHASE_NAME[f.dst[0]]} g{f.dst[1]} scattered in "
                    f"@d{'+'.join(map(str, devs))} ({nbytes:.0f} B)")
            return name, s, e, p
        raise AssertionError(ref)

    def _bwd_last(self, g: int):
        """Reference of the replica of group ``g``'s (last micro-batch's) backward that finished
        last."""
        micro = self.run.micro
        last = 0 if micro is None else next(m for _, ph, m in reversed(micro.tasks) if ph == BWD)
        sid, row = self.stage_loc[(BWD, g, last)]
        r = int(np.argmax(self.segs[sid][8][row]))
        return ("c", sid, row, r)

    def critical_path(self) -> list[str]:
        final, before, _, sync_end, holds = self._end
        d = int(np.argmax(final))
        names: list[str] = []
        if holds[d]:
            names.append(f"opt @d{d}")
            ref = self.sync_last[d] if sync_end[d] > before[d] else self.last_task[d]
        else:
            ref = self.last_task[d]
        guard = 0
        while ref is not None and guard < 1_000_000:
            guard += 1
            if ref[0] == "c" and ref[2] > 0:
                # Inside a segment the path runs back through the same replica's earlier stages.
                _, sid, row, r = ref
                ph, stages, unit = self.segs[sid][:3]
                suffix = f" @d{unit.devices[r]}"
                names.extend(self._stage_name(ph, g, j) + suffix for g, j in stages[row:0:-1])
                ref = ("c", sid, 0, r)
                continue
            name, _, _, ref = self._resolve(ref)
            names.append(name)
        names.reverse()
        return names

    def _stage_name(self, ph: int, g: int, j: int) -> str:
        if self.run.micro is not None:
            return f"{PHASE_NAME[ph]} g{g} mb{j}"
        chunk = f".{j}" if self.gds[g].units[j].layout is None else ""
        return f"{PHASE_NAME[ph]} g{g}{chunk}"

    def events(self) -> list[SimEvent]:
        """The timeline: every task on every device it occupies, by start time."""
        final, _, upd_start, _, holds = self._end
        ev: list[SimEvent] = []
        for sid, seg in enumerate(self.segs):
            ph, stages, unit = seg[0], seg[1], seg[2]
            for row in range(len(stages)):
                for r, d in enumerate(unit.devices):
                    name, s, e, _ = self._seg_task(sid, row, r)
                    if e > s:
                        ev.append(SimEvent(name, d, "compute", s, e, PHASE_NAME[ph]))
        for fid in range(len(self.flows)):
            name, s, e, _ = self._resolve(("f", fid))
            f = self.flows[fid][0]
            ev.append(SimEvent(name, f.a, "comm", s, e, "transfer"))
            ev.append(SimEvent(name, f.b, "comm", s, e, "transfer"))
        for gs, gd, s, e, _ in self.syncs:
            for d in gd.sync_devices:
                ev.append(SimEvent(_sync_name(gd, gs), d, "comm", s, e, gd.sync))
        for gid in range(len(self.gathers)):
            name, s, e, _ = self._resolve(("a", gid))
            for d in self.gds[self.gathers[gid][0]].sfb.members:
                ev.append(SimEvent(name, d, "comm", s, e, "allgather"))
        for sid in range(len(self.scatters)):
            name, s, e, _ = self._resolve(("g", sid))
            for d in self.scatters[sid][1]:
                ev.append(SimEvent(name, d, "comm", s, e, "transfer"))
        for g, d, s, e, _ in self.recomputes:
            if e > s:
                ev.append(SimEvent(f"sfb g{g} @d{d}", d, "compute", s, e, "sfb"))
        for d in range(self.sim.num_devices):
            if holds[d]:
                ev.append(SimEvent(f"opt @d{d}", d, "compute", upd_start[d], final[d], "opt"))
        ev.sort(key=lambda x: (x.start, x.device))
        return ev


def _sync_name(gd, groups: tuple[int, ...]) -> str:
    return f"{gd.sync} " + "+".join(f"g{g}" for g in groups)


def _holdings(sim, gds, micro: _Micro | None = None):
    """Per device: optimizer seconds, held bytes, max working set, holds-params flag (lists);
    per group: compute seconds (summed over a pipeline's micro-batches). A pipeline replica holds
    its stage's in-flight micro-batches' saved activations (the first, largest, micro-batch's
    size each; ``mem_per_sample``, a recomputed group's inputs: ``rc_per_sample``) besides what
    one run of the group holds."""
    if micro is not None:
        opt, mem, work, holds, _ = _holdings(sim, micro.gds[0])
        # micro-batches of one size share one deployment (one list): its compute seconds once
        per_run: dict[int, list[float]] = {}
        for mg in micro.gds:
            if id(mg) not in per_run:
                per_run[id(mg)] = _holdings(sim, mg)[4]
        gcomp = [sum(x) for x in zip(*(per_run[id(mg)] for mg in micro.gds))]
        per_sample, rc_per_sample = sim.static.mem_per_sample, sim.static.rc_per_sample
        for stage, gs in enumerate(micro.members):
            extra = micro.flight[stage] - 1
            for g in gs:
                gd = micro.gds[0][g]
                lay = gd.layout
                if lay.saved is not None:  # (a tensor-parallel layout's, recomputed or not)
                    for d, b in zip(lay.devices, lay.saved[g].tolist()):
                        mem[d] += extra * b
                    continue
                ps = float(rc_per_sample[g] if gd.recompute else per_sample[g])
                for d, b in zip(lay.devices, lay.batches):
                    mem[d] += extra * ps * b
        _hold_tied(sim, micro, opt, mem, holds)
        return opt, mem, work, holds, gcomp
    n = sim.num_devices
    opt, mem, work = [0.0] * n, [0.0] * n, [0.0] * n
    holds = [False] * n
    gcomp = [0.0] * len(gds)
    by_layout: dict[int, tuple[Layout, list[int]]] = {}
    for g, gd in enumerate(gds):
        lay = gd.layout
        if lay is not None:
            entry = by_layout.get(id(lay))
            if entry is None:
                by_layout[id(lay)] = (lay, [g])
            else:
                entry[1].append(g)
            gcomp[g] += lay.gsum_l[g]
        else:
            for u in gd.units:
                d = u.devices[0]
                opt[d] += u.dur[OPT]
                mem[d] += u.mem
                work[d] = max(work[d], u.work)
                holds[d] |= u.mem > 0
                gcomp[g] += sum(u.dur)
        if gd.sfb is not None:
            gcomp[g] += sum(gd.sfb.recompute)
    gb = sim.static.grad_bytes
    gbl = sim.static.grad_bytes_l
    add, maximum = np.add.reduce, np.maximum.reduce
    for lay, gs in by_layout.values():
        devs = lay.devices
        if len(gs) >= 4:  # many groups on one layout: numpy over the [groups, replicas] block
            # (the ufuncs' reduce: what .sum() / .max() call, without their Python wrappers)
            o = add(lay.dur[OPT][gs], axis=0).tolist()
            m = add(lay.mem[gs], axis=0).tolist()
            w = maximum(lay.work[gs], axis=0).tolist()
            h = add(gb[gs]) > 0
            for r, d in enumerate(devs):
                opt[d] += o[r]
                mem[d] += m[r]
                if w[r] > work[d]:
                    work[d] = w[r]
                if h:
                    holds[d] = True
            continue
        for g in gs:
            h = gbl[g] > 0
            _, _, o, m, w = lay.row(g)
            for r, d in enumerate(devs):
                opt[d] += o[r]
                mem[d] += m[r]
                if w[r] > work[d]:
                    work[d] = w[r]
                if h:
                    holds[d] = True
    return opt, mem, work, holds, gcomp


def _zero(gp) -> tuple[int, int]:
    """(ZeRO level, shard size) of a group's plan whose ranks hold a tied weight's copy sharded
    (:class:`tag.executor.sharded.ShardedRank`): ``zero*`` over several devices, not offloaded;
    else ``(0, 1)``."""
    if gp.sync.startswith("zero") and not gp.offload and len(gp.devices) > 1:
        return int(gp.sync[4:]), shard_size(gp)
    return 0, 1


def _hold_tied(sim, micro: _Micro, opt: list[float], mem: list[float], holds: list[bool]) -> None:
    """The second copy of each tied weight (:attr:`_Micro.tied`) on the replicas of its partial
    sum's group: the weight, its gradient and its optimizer state held, and its update, the
    owner group's update seconds on that device per parameter byte (in place). Where a stage's
    group is sharded (:attr:`_Micro.tied_shards`) its copy is ZeRO-1 over the group's shard groups,
    as the executor holds it (:meth:`tag.executor.sharded.ShardedRank`) and Megatron-LM's
    distributed optimizer shards each stage's embedding over its data-parallel group: the weight
    and its all-reduced gradient whole (both stages read it, the all-reduce spans both), the
    optimizer state and the step over ``S``, then an all-gather of the updated weight
    (:func:`tag.parallel.sharded.sharded_bytes` at level 1). The owner's layout priced it as its
    own level's shards (1 / S of its step, ZeRO-1/2 its gather after it)."""
    gds = micro.gds[0]
    shards = {t: rest for t, *rest in micro.tied_shards}
    comm = sim.comm
    for tw in sim.static.tied:
        if tw.tensor not in micro.tied:
            continue
        g = tw.owner
        per_byte = tw.nbytes / float(sim.static.grad_bytes[g])
        p, o = tw.nbytes, tw.opt_state_bytes
        level, s_own, s_read = shards.get(tw.tensor, (0, 1, 1))
        readers = list(gds[tw.grad_group].units[0].devices)
        gather = comm.shard_gather_time(readers, s_read, p) if s_read > 1 else 0.0
        for d in readers:
            mem[d] += sharded_bytes(1, s_read, p, o)
            opt[d] += float(sim.tables[sim.dev_class[d], g, OPT, 1]) * per_byte / s_read + gather
            holds[d] = True
        if level:
            owners = list(gds[g].units[0].devices)
            gather = comm.shard_gather_time(owners, s_own, p) if level == 3 else 0.0  # (ZeRO-3's layout: none)
            for d in owners:
                mem[d] += sharded_bytes(1, s_own, p, o) - sharded_bytes(level, s_own, p, o)
                opt[d] += gather


def _result(sim, run, sync_end: list[float], holdings):
    """The optimizer step of every device holding parameters, then the :class:`SimResult` of the
    run's state (``cfree``, ``comp``, ``comm_free``, ``comm_busy``, ``buf``, ``group_finish``)."""
    opt, mem, work, holds, gcomp = holdings
    n = sim.num_devices
    before = list(run.cfree)
    upd_start = [0.0] * n
    final = list(before)
    comp = run.comp
    for d in range(n):
        if holds[d]:
            s = max(before[d], sync_end[d])
            dur = opt[d] + sim.step_overhead[d]
            upd_start[d] = s
            final[d] = s + dur
            comp[d] += dur
    t_iter = max(max(final), max(run.comm_free))
    peak = [x + y + z for x, y, z in zip(mem, work, run.buf)]
    cap = sim.capacity
    oom_devices = [(d, peak[d] - cap[d]) for d in range(n) if peak[d] > cap[d]]
    res = SimResult(
        iteration_time_s=t_iter, oom=bool(oom_devices), peak_memory_bytes=peak,
        memory_capacity_bytes=list(cap), oom_devices=oom_devices, compute_time_s=comp,
        comm_time_s=list(run.comm_busy), idle_time_s=[t_iter - c for c in comp],
        group_finish_s=list(run.group_finish), group_compute_s=gcomp, device_names=list(sim.device_names))
    return final, before, upd_start, holds, res
