"""How the simulator costs a tensor-parallel op-group (``sync == "tp"``,
:mod:`tag.parallel.tensor_parallel`), in either variant (``GroupPlan.sequence_parallel``):
:func:`tp_group`, registered as the strategy's group costing (:mod:`tag.sim.strategies`).

The group's unit (:meth:`TensorParallel.units`) gives plain Megatron's devices their
tensor-parallel group's ``B`` samples (one range per group) and sequence-parallel devices their
token shard of ``b = B / T`` samples each (own ranges, as data-parallel replicas);
:func:`tp_layout` costs it for every group ``g`` as tensor parallel (all groups at once so
consecutive ``tp`` groups stay one vectorised segment). With ``b = B / T``, fractional when a
group has fewer samples than devices (``1 / T`` of one sample's block features is ``1 / T`` of
its FLOPs and activation bytes):

* compute: the Megatron blocks' ops (:func:`~tag.parallel.tensor_parallel.block_interior`: the
  split matmuls, the per-head ops between them, their gradients) cost what ``b`` samples cost
  (``1 / T`` of the features of ``B`` samples) on ``1 / T`` of each split weight: a rank's
  seconds ``t(x)`` are the cost model's with the fixed (batch-independent) FLOPs and bytes of
  those ops, and of the forward's casts of the split weights, divided by ``T``
  (:meth:`CostModel.split_at <tag.cost.CostModel.split_at>`, :func:`_rank_seconds`; the rule
  evaluated at ``x`` itself, fractional or not), and its casts, charged once an iteration
  (:attr:`Layout.casts <tag.sim.units.Layout.casts>`), ``1 / T`` of the split weights'. Whole,
  the weights' bytes made a rank's per-micro-batch floor ``T`` times too large: llama-70b bf16 at
  ``dp=8,tp=8,pp=8,micro=32`` on h100-512gpu, each layer's weight-gradient casts 2.2 ms a
  micro-batch where a rank's are 0.27 ms (2026-11-29). The other ops cost ``b`` samples with sequence
  parallelism, ``B`` without (plain Megatron: every device of the group runs them on the group's
  whole batch). A group's seconds ``t(x)`` at a batch are split between the two by the roofline
  share ``s(x)`` of the block ops in it (:func:`tag.cost.roofline.group_phase_table` over those
  ops / over all): plain Megatron costs ``t(b) + max(0, (1 - s(B)) t(B) - (1 - s(b)) t(b))``,
  the shard's seconds plus what the outside ops take more at ``B`` (never less: a cost rule
  other than the roofline, a GPU's, can make ``t`` grow slower than the roofline share falls);
* forward / backward seconds grow by the blocking collectives of the blocks in ``g``
  (:meth:`CommModel.tensor_parallel_time <tag.cost.comm.CommModel.tensor_parallel_time>` at the
  tensor-parallel group's batch; all-gather + reduce-scatter, or one all-reduce: the same bytes;
  they sit between the block's matmuls, so nothing overlaps them), and by a vocabulary-parallel
  head's (``vocab_reduces`` of a graph costed as Megatron-LM runs its head,
  :func:`tag.parallel.layers.vocab_parallel_graph`);
* held bytes shrink by ``(1 - 1/T)`` of the split parameters' parameter, gradient and optimizer
  bytes, and the optimizer seconds by the same fraction of the group's parameter bytes; plain
  Megatron holds the activations saved for the backward outside the blocks at ``B`` samples
  (those inside at ``b``), and as its working set the largest of its ops' outside the blocks at
  ``B`` and of all its ops' at ``b`` (:func:`outside_work`: an attention's per-head
  probabilities are split);
* the gradient sync (:meth:`CommModel.tensor_parallel_sync_time`, per variant) is issued like a
  data-parallel one, not coalesced with other groups'; the buffer it holds on a device is that
  device's gradients (``1 / T`` of the split ones, the others whole);
* a pipeline holds, per micro-batch in flight, a device's saved activations at ``b`` inside the
  blocks and (plain) at ``B`` outside (:attr:`Layout.saved <tag.sim.units.Layout.saved>`).

Tensors crossing between a ``tp`` group and another unit (mixed plans, simulated only; pipelines
of ``tp`` stages, executed too) move by :func:`tag.parallel.move_pieces`: out of a plain group
from one of its devices (the consumer's aligned rank), into it to each device (from another
machine ``1 / T`` to each, each tensor padded to a multiple of ``T`` bytes as the executor pads
it (:func:`tag.sim.units.shard_bytes`), then the group's all-gather of the whole, costed by the event loop:
:meth:`tag.sim.engine._Run._scatter_gather`); per token shard with sequence parallelism. The
executor does the same (:func:`tag.parallel.tensor_parallel.executed_plan`): device ``i`` to
device ``i``, the whole tensor within a machine, slice ``i`` of it between machines followed by
the all-gather (:meth:`tag.executor.tensor_parallel.TpRank.scattered`).
"""

from __future__ import annotations

import numpy as np

from ..graph.precision import param_casts
from ..parallel.tensor_parallel import (
    TensorParallel,
    block_interior,
    group_split,
    per_graph,
    tp_degree,
    tp_groups,
)
from .static import BWD, FWD, OPT
from .strategies import register_costing
from .units import ENTRY_BYTES, GroupData, Layout, Unit, at_batch, ref_bytes


def tp_layout(sim, devices: tuple[int, ...], batches: tuple[int, ...], starts: tuple[int, ...], t: int,
              sequence_parallel: bool = False) -> Layout:
    """The layout of ``devices`` with every group costed as tensor parallel of degree ``t``
    (cached in the simulator's layouts); ``batches`` / ``starts``: the unit's replicas
    (:meth:`TensorParallel.units`: plain, each device its group's samples, one range per run of
    ``t`` devices; sequence parallel, each device its token shard as its own range)."""
    key = ("tp", t, sequence_parallel, devices, batches)
    lay = sim._layouts.get(key)
    if lay is not None:
        return lay
    graph, comm, static = sim.graph, sim.comm, sim.static
    k, r = static.num_groups, len(devices)
    dur, mem, work, saved = np.empty((3, k, r)), np.empty((k, r)), np.empty((k, r)), np.empty((k, r))
    keep = 1.0 - 1.0 / t
    outside = None if sequence_parallel else _outside_saved_per_sample(graph, static)
    compute = []
    # devices alike (cost class, shard samples, group samples) get the same columns: costed once
    # (a 512-device stage has a handful of kinds), in device order (the first costs _block_share)
    alike: dict[tuple, tuple[int, list[int]]] = {}
    for i, (d, b) in enumerate(zip(devices, batches)):
        if sequence_parallel:  # b: the device's token shard, as a sample range; big: its group's
            small, big = b, sum(batches[i - i % t:i - i % t + t])
        else:  # b: the group's samples; 1 / t of their block features (fractional below t samples)
            small, big = b / t, b
        compute.append(small)
        alike.setdefault((sim.dev_class[d], small, big), (d, []))[1].append(i)
    casts = np.zeros((k, r)) if sim.any_casts else None
    host = lag = None  # a GPU rule's host apart (Layout.host): the shard's launches, at its samples
    if sim.hosts is not None:
        host, lag = np.zeros((2, k, r)), np.zeros((2, k, r))
    for (c, small, big), (d, ids) in alike.items():
        rank_secs = _rank_seconds(sim, c, d, t, small)  # [K, 3]; None: the whole weights' table
        split = rank_secs is not None
        rank_secs = rank_secs if split else at_batch(sim.tables[c], small)
        if host is not None:
            rank_host = _rank_host(sim, c, d, t, small) if split else None
            for out, j, h in zip((host, lag), (0, 1), rank_host or (None, None)):
                out[:, :, ids] = (h if h is not None else at_batch(sim.hosts[j][c], small)).transpose(1, 0)[:, :, None]
        if casts is not None:
            casts[:, ids] = (_rank_casts(sim, c, t) if split else sim.casts[c])[:, None]
        d_col = rank_secs.T.copy()  # [3, K]
        s_col = static.mem_per_sample * small
        m_col = static.mem_fixed + s_col
        if sequence_parallel:  # every op on 1 / t of the tokens
            w_col = static.work_fixed + static.work_per_sample * small
        else:
            share = _block_share(sim, d, (small, big), t if split else 1)  # [K, 2 phases, 2 batches]
            big_secs = _rank_seconds(sim, c, d, t, big) if split else sim.tables[c][:, :, big]
            for ph in (FWD, BWD):  # the shard's seconds + the outside ops' extra ones at the group's batch
                extra = (1.0 - share[:, ph, 1]) * big_secs[:, ph] - (1.0 - share[:, ph, 0]) * rank_secs[:, ph]
                d_col[ph] = rank_secs[:, ph] + np.maximum(extra, 0.0)
            s_col = s_col + outside * (big - small)
            m_col = m_col + outside * (big - small)
            # the largest op's working set: a block's ops at the shard's samples, the others' at the group's
            out_w = outside_work(graph)
            w_col = np.maximum(static.work_fixed + static.work_per_sample * small, out_w[:, 0] + out_w[:, 1] * big)
        dur[:, :, ids] = d_col[:, :, None]
        saved[:, ids] = s_col[:, None]
        mem[:, ids] = m_col[:, None]
        work[:, ids] = w_col[:, None]
    splits = [group_split(graph, g) for g in range(k)]
    # the blocking collectives per tensor-parallel group: [K] seconds per (ring, batch), priced once
    # per simulator (CommModel.ring_key: groups with equal keys take equal seconds); 0 for a group
    # without blocks
    priced = sim.cache("tp-collectives")
    rings: dict[tuple, tuple] = {}  # (ring, batch) -> (its seconds, the devices' columns)
    for i in range(0, r, t):
        devs = list(devices[i:i + t])
        b = sum(batches[i:i + t]) if sequence_parallel else batches[i]
        ring = (comm.ring_key(devs), b)
        hit = rings.get(ring)
        if hit is not None:
            hit[1].extend(range(i, i + t))
            continue
        col = priced.get(ring)
        if col is None:
            fwd, bwd = np.zeros(k), np.zeros(k)
            vocab = getattr(graph, "vocab_reduces", {})  # a vocabulary-parallel head's (Megatron costing)
            for g, split_plan in enumerate(splits):
                vocab_fwd, vocab_bwd = vocab.get(g, ((), ()))
                if split_plan.blocks or vocab_fwd or vocab_bwd:
                    fwd[g] = comm.tensor_parallel_time(devs, [a.at(b) for a in split_plan.reduce_fwd + vocab_fwd])
                    bwd[g] = comm.tensor_parallel_time(devs, [a.at(b) for a in split_plan.reduce_bwd + vocab_bwd])
            col = priced[ring] = (fwd[:, None], bwd[:, None])
            sim.charge(fwd.nbytes + bwd.nbytes + ref_bytes(len(devs)) + ENTRY_BYTES)
        rings[ring] = (col, list(range(i, i + t)))
    net, spans = None, [()] * r  # the rings across machines: their collectives meet other jobs' traffic
    for col, cols in rings.values():
        dur[FWD][:, cols] += col[0]
        dur[BWD][:, cols] += col[1]
        for j in range(0, len(cols), t):  # (rings priced alike: one ring of t columns at a time)
            ring = cols[j:j + t]
            span = tuple(sorted({comm.machine_of[devices[i]] for i in ring}))
            if len(span) > 1:
                net = np.zeros((2, k, r)) if net is None else net
                net[FWD][:, ring], net[BWD][:, ring] = col[0], col[1]
                for i in ring:
                    spans[i] = span
    for g, split_plan in enumerate(splits):
        if not split_plan.blocks:
            continue
        grad_bytes = float(static.grad_bytes[g])
        if grad_bytes > 0:
            dur[OPT, g, :] *= 1.0 - keep * split_plan.split_bytes / grad_bytes
        mem[g, :] -= keep * split_plan.split_state
    mem -= keep * _split_casts(graph)[:, None]  # a device holds its shard's bf16 / fp16 weight copies
    lay = Layout.of(devices, batches, np.array(devices, dtype=np.int64), dur, mem, work, starts, saved=saved,
                    compute=None if sequence_parallel else tuple(compute), casts=casts, net=net,
                    net_machines=None if net is None else tuple(spans), host=host, lag=lag)
    return sim.store_layout(key, lay)


def _rank_seconds(sim, c: int, device: int, t: int, x: float) -> np.ndarray | None:
    """``[K, 3]`` seconds of a rank of degree ``t`` on ``x`` samples (a block's features of ``x``
    samples, fractional below 1), device class ``c`` (``device`` one of them): the cost model's
    :meth:`~tag.cost.CostModel.split_at` with the fixed FLOPs and bytes of the blocks' ops and of
    the split weights' casts ``1 / t`` (:func:`_interior_fixed`: a rank's matmuls read, its casts
    and weight-gradient casts write, ``1 / t`` of each split weight). None where the costs cannot
    split (a compiled profile, a cost model without ``split_at``): the caller reads the device's
    table, every weight whole. Cached per (class, degree, samples)."""
    return _rank_costs(sim, c, device, t, x)[0]


def _rank_host(sim, c: int, device: int, t: int, x: float) -> tuple[np.ndarray, np.ndarray] | None:
    """``([K, 2] host seconds, [K, 2] lags)`` of the forward and backward stages of
    :func:`_rank_seconds`' rank where its class holds the host apart (:attr:`Simulator.hosts`),
    else None."""
    return _rank_costs(sim, c, device, t, x)[1]


def _rank_costs(sim, c: int, device: int, t: int, x: float) -> tuple:
    """(:func:`_rank_seconds`, :func:`_rank_host`), cached per (class, degree, samples): where the
    class holds its host apart, the forward and backward seconds are the device's alone
    (:meth:`~tag.cost.CostModel.host_parts` with the same fixed factors)."""
    cache = sim.cache("tp-rank")
    key = (c, t, x)
    if key not in cache:
        split_at = getattr(sim.costs, "split_at", None)
        fixed = _interior_fixed(sim.graph, t)
        got = None if split_at is None else split_at(device, fixed, [x])
        secs, host = (None if got is None else got[:, :, 0]), None
        if secs is not None and sim.hosts is not None and sim.hosts[2][c]:
            p = sim.costs.host_parts(device, fixed, [x])
            secs = secs.copy()
            secs[:, :2] = p.device[:, :2, 0]
            host = (p.host[:, :2, 0], p.lag[:, :2, 0])
        cache[key] = (secs, host)
        sim.charge((0 if got is None else 2 * got.nbytes) + ENTRY_BYTES)
    return cache[key]


def _interior_fixed(graph, t: int) -> np.ndarray:
    """``[n_ops]`` factor on each op's fixed FLOPs and bytes on a rank of degree ``t``: ``1 / t``
    for the Megatron blocks' ops (:func:`block_interior`; their fixed bytes are the split weights'
    and the weights' gradients', plus small per-head tables read whole, overstated by ``t``) and
    for the forward's casts of split weights (:func:`_split_casts`), 1 for the others."""
    return np.where(_interior_mask(graph) | _split_cast_mask(graph), 1.0 / t, 1.0)


@per_graph
def _interior_mask(graph) -> np.ndarray:
    inner = np.zeros(len(graph.ops), dtype=bool)
    inner[list(block_interior(graph).ops)] = True
    return inner


@per_graph
def _split_cast_mask(graph) -> np.ndarray:
    """``[n_ops]`` bool: a forward parameter cast (:func:`tag.graph.precision.param_casts`) of a
    split weight."""
    split = {graph.params[p].tensor for split_plan in (group_split(graph, g) for g in range(graph.num_groups))
             for p in split_plan.split_params}
    out = np.zeros(len(graph.ops), dtype=bool)
    out[[i for i in param_casts(graph) if graph.ops[i].inputs[0] in split]] = True
    return out


def _rank_casts(sim, c: int, t: int) -> np.ndarray:
    """``[K]`` seconds of a rank's forward parameter casts (part of :func:`_rank_seconds`'
    forwards, charged once an iteration as the device class ``c``'s :attr:`Simulator.casts`):
    the class's cast seconds times the rank's share of the cast bytes (``1 / t`` of the split
    weights', the others whole; the per-kernel floors scaled with them, microseconds a cast)."""
    split = _split_casts(graph := sim.graph)
    whole = _all_casts(graph)
    share = np.divide(whole - split * (1.0 - 1.0 / t), whole, out=np.ones_like(whole), where=whole > 0)
    return sim.casts[c] * share


@per_graph
def _all_casts(graph) -> np.ndarray:
    """``[K]`` bytes of every forward parameter cast's output per group."""
    out = np.zeros(graph.num_groups)
    for i in param_casts(graph):
        out[graph.ops[i].group] += graph.tensors[graph.ops[i].outputs[0]].nbytes.fixed
    return out


def _block_share(sim, device: int, batches: tuple[float, int], t: int) -> np.ndarray:
    """``[K, 2, 2]``: the fraction of each group's forward / backward seconds spent in the
    Megatron blocks' ops at ``batches`` = (a rank's samples, its group's), by the roofline of
    ``device`` (0 where a group has no cost), the split ops' fixed features ``1 / t``
    (:func:`_interior_fixed`, as :func:`_rank_seconds` costs them; ``t`` = 1: whole); cached per
    device class, batches and degree."""
    from ..cost.roofline import group_phase_table, op_overhead, roofline_for

    spec = sim.topology.devices[device].gpu
    key = (sim.dev_class[device], batches, t)
    shares = sim.cache("tp-shares")
    share = shares.get(key)
    if share is None:
        graph = sim.graph
        roofline = getattr(sim.costs, "roofline", None)  # (a cost model without one: the datasheet's)
        roof = roofline(device) if roofline is not None else roofline_for(spec)
        overhead = op_overhead(spec)
        inner = _interior_mask(graph)
        fixed = _interior_fixed(graph, t)
        part = group_phase_table(graph, roof, batches, overhead, only=inner, fixed=fixed)[:, :2]
        whole = group_phase_table(graph, roof, batches, overhead, fixed=fixed)[:, :2]
        share = shares[key] = np.divide(part, whole, out=np.zeros_like(part), where=whole > 0)
        sim.charge(share.nbytes + ENTRY_BYTES)
    return share


@per_graph
def _split_casts(graph) -> np.ndarray:
    """``[K]`` bytes of the parameter casts (:func:`tag.graph.precision.param_casts`) of split
    weights in each group's forward: the whole copies, of which a tensor-parallel device holds
    ``1 / T`` (held with the saved values, or, recomputed, until the backward: :mod:`tag.sim.static`)."""
    split = {graph.params[p].tensor for split_plan in (group_split(graph, g) for g in range(graph.num_groups))
             for p in split_plan.split_params}
    out = np.zeros(graph.num_groups)
    for i in param_casts(graph):
        op = graph.ops[i]
        if op.inputs[0] in split:
            out[op.group] += graph.tensors[op.outputs[0]].nbytes.fixed
    return out


@per_graph
def outside_work(graph) -> np.ndarray:
    """``[K, 2]`` (fixed, per-sample) bytes read and written by the largest op of each group
    outside the Megatron blocks (each part's largest, as :attr:`GraphStatic.work_fixed`): plain
    Megatron runs those ops on its tensor-parallel group's whole batch, the blocks' ops (an
    attention's per-head probabilities) on its shard."""
    interior = set(block_interior(graph).ops)
    out = np.zeros((graph.num_groups, 2))
    for i, o in enumerate(graph.ops):
        if o.phase in ("fwd", "bwd") and i not in interior:
            w = out[o.group]
            w[0] = max(w[0], o.bytes_read.fixed + o.bytes_written.fixed)
            w[1] = max(w[1], o.bytes_read.per_sample + o.bytes_written.per_sample)
    return out


@per_graph
def _outside_saved_per_sample(graph, static) -> np.ndarray:
    """``[K]`` per-sample bytes of the storages each group's backward reads from the forward (or
    the user inputs; :attr:`GraphStatic.saved <tag.sim.static.GraphStatic.saved>`, ``static`` the
    graph's: a storage once, however many of its views are read) that no Megatron block holds
    split: none of its saved views is a block's interior tensor."""
    interior = block_interior(graph).tensors
    return np.array([sum(p for (_, p, _), ts in zip(rows, members) if not any(t in interior for t in ts))
                     for rows, members in zip(static.saved, static.saved_members)], dtype=float)


@per_graph
def _outside_recompute_per_sample(graph, static) -> tuple[np.ndarray, np.ndarray]:
    """``([K], [K])`` per-sample bytes a recomputed group holds and has live again at its backward
    (:meth:`GraphStatic.recompute_bytes`; ``static`` is the graph's) of the tensors outside the
    Megatron blocks."""
    interior = block_interior(graph).tensors
    outside = {t for rows in static.reads for *_, t in rows if t not in interior}
    k = static.num_groups
    held, live = np.zeros(k), np.zeros(k)
    for g in range(k):
        _, held[g], _, live[g] = static.recompute_bytes(g, static.lo[g], static.hi[g], only=outside)
    return held, live


def tp_group(sim, g: int, gp, lowered) -> GroupData:
    """:class:`GroupData` of group ``g`` deployed tensor parallel as ``gp`` (``lowered``: its units).
    What does not depend on the group (the layout, the machines, the sync's devices; a stage's
    groups share them) is costed once per deployment and batch (:func:`_tp_deployment`), the
    sync once per deployment and bytes."""
    replicas = lowered[0].replicas
    batches = tuple([r.stop - r.start for r in replicas])
    deployment = _tp_deployment(sim, gp, batches, replicas)
    lay, devs, starts, unit_key, members, machines, memo = deployment
    unit = Unit(g, -1, devs, batches, starts, lay)
    split = group_split(sim.graph, g).split_bytes
    total = float(sim.static.grad_bytes[g])
    ts = memo.get((split, total))
    if ts is None:
        ts = memo[(split, total)] = sim.comm.tensor_parallel_sync_time(tp_groups(gp), split, max(0.0, total - split),
                                                                     gp.sequence_parallel)
        sim.charge(ENTRY_BYTES)
    if ts <= 0:
        return GroupData([unit], "none", 0.0, (), (), 0.0, layout=lay, unit_key=unit_key, recompute=gp.recompute,
                         tp=tp_degree(gp))
    # the buffer a device's sync holds: its shard of the split gradients and the others whole
    own = total - (1.0 - 1.0 / tp_degree(gp)) * split

    def resync(less: float) -> float:  # without ``less`` bytes of the replicated gradients
        return sim.comm.tensor_parallel_sync_time(tp_groups(gp), split, max(0.0, total - split - less),
                                                  gp.sequence_parallel)

    return GroupData([unit], "tp", ts, members, machines, own, layout=lay, unit_key=unit_key, recompute=gp.recompute,
                     tp=tp_degree(gp), resync=resync)


def _tp_deployment(sim, gp, batches: tuple[int, ...], replicas) -> tuple:
    """``(layout, devices, starts, unit key, sync devices, sync machines, sync seconds by bytes)`` of
    the tensor-parallel deployment ``gp`` at the unit's ``batches`` (cached per simulator)."""
    cache = sim.cache("tp-deployments")
    devs = tuple(gp.devices)
    key = (devs, batches, tp_degree(gp), gp.sequence_parallel, gp.recompute)
    hit = cache.get(key)
    if hit is not None:
        return hit
    starts = tuple([r.start for r in replicas])
    t = tp_degree(gp)
    lay = tp_layout(sim, devs, batches, starts, t, gp.sequence_parallel)
    if gp.recompute:
        if gp.sequence_parallel:
            lay = sim.recompute_layout(lay)
        else:  # plain: what is outside the blocks (inputs, recomputed values, the saved values no
            # longer held) at the tensor-parallel group's samples, what is inside at the device's 1 / T
            more = (np.asarray(batches, dtype=float) - np.asarray(lay.compute, dtype=float))[None, :]
            held, live = _outside_recompute_per_sample(sim.graph, sim.static)
            saved = _outside_saved_per_sample(sim.graph, sim.static)
            lay = sim.recompute_layout(lay, held[:, None] * more, live[:, None] * more, saved[:, None] * more)
    machine_of = sim.comm.machine_of
    machines = tuple(sorted({machine_of[d] for d in devs}))
    hit = cache[key] = (lay, devs, starts, ("tp", devs, starts, batches), tuple(sorted(devs)),
                        machines if len(machines) > 1 else (), {})
    sim.charge(2 * ref_bytes(len(devs)) + 3 * ref_bytes(len(batches)) + ref_bytes(len(machines)) + 2 * ENTRY_BYTES)
    return hit


register_costing(TensorParallel.name, tp_group)
