"""How the simulator costs a sharded data-parallel op-group (``zero1`` / ``zero2`` / ``zero3``,
:mod:`tag.parallel.sharded`): :func:`sharded_group`, registered as the strategies' group costing
(:mod:`tag.sim.strategies`).

The group runs as data-parallel replicas on the lowering's layout (:meth:`Simulator.layout`, the
same compute tables); :func:`sharded_layout` derives from it, for every op-group at once (so
consecutive sharded groups stay one vectorised segment), with ``S`` devices per shard group,
``P_g`` the group's parameter bytes, ``O_g`` its optimizer-state bytes and ``A_g`` the seconds of
one all-gather of ``P_g`` over a shard group (:meth:`CommModel.shard_gather_time
<tag.cost.comm.CommModel.shard_gather_time>`: ring or hierarchical, ``(S-1)/S * P_g / bw`` plus
latencies on a ring):

* the optimizer step updates ``1 / S`` of the parameters (its seconds over ``S``); ``zero1`` /
  ``zero2`` then all-gather the updated parameters (``A_g`` added to the step, blocking, as the
  executor runs it);
* ``zero3``: a group's forward waits for the all-gather of its parameters, issued when the
  previous group's forward started (prefetch): ``max(0, A_g - fwd_{g-1})`` more forward seconds
  (the first group's whole ``A_0``); the backward likewise against the next group's backward (the
  last group's whole gather). On a CPU device (:attr:`Simulator.shared_stream`: gloo has no core
  of its own) nothing overlaps: ``A_g`` each time. The prefetch assumes the neighbouring group is
  sharded the same way (a whole model under one layout; a mixed plan's neighbour is priced as if it
  were) and leaves out the gradient reduce-scatters sharing the link during the backward;
* the gradient sync is the strategy's collective (``zero1`` all-reduce, else ``reducescatter`` /
  ``reducescatter/S``, :meth:`CommModel.sharded_sync_time
  <tag.cost.comm.CommModel.sharded_sync_time>`), bucketed and overlapped with the backward by the
  engine like any gradient sync;
* held bytes: a group's ``2 P_g + O_g`` becomes :func:`tag.parallel.sharded.sharded_bytes`
  (``O_g / S``; ``zero2`` + ``P_g / S`` of the gradient; ``zero3`` + ``P_g / S`` of the parameter);
  the working set of the group's largest op grows by what lives only while the group runs:
  ``zero2`` its unsharded gradient ``P_g`` until the reduce-scatter, ``zero3`` that plus its
  gathered parameters ``P^g_g`` and the neighbour's prefetched ones (the larger of ``P^g_{g-1}``,
  ``P^g_{g+1}``; ``P^g = P`` in fp32, below under mixed precision; none for a group without
  parameters, which the search deploys as plain replicas).
  A device's peak adds the largest working set of its groups to what they hold: the
  largest gathered group, as FSDP's. A graph marked with another runtime (:func:`hold_state_as`)
  holds Megatron-LM's ``zero1`` or DeepSpeed's ``zero3`` state instead (:data:`STATE_RUNTIMES`);
* ``zero3`` under mixed precision: the weights every read of which is a bf16 / fp16 cast
  (:func:`tag.graph.precision.low_gathered_params`) are gathered in that dtype, their shard cast
  before the gather (FSDP2's ``param_dtype``; the executor's, :mod:`tag.executor.sharded`):
  ``A_g`` is the gather of ``P^g_g`` bytes, those weights at 2 bytes an element and the rest as
  they are (:func:`low_gathers`), after the shard's cast (their casts' seconds over ``S``, on the
  gather's side of the prefetch); their casts in the graph return the gathered weights
  (:func:`tag.executor.fuse.cast_as_needed`), so the forward loses those casts' seconds (their
  share of the group's cast bytes) and the working set counts ``P^g_g`` once, not a gathered
  fp32 ``P_g`` and its copies. The other casts (a weight read in fp32 too) are made per use,
  from the gathered parameters at each forward and again at each backward (and at every
  micro-batch of a pipeline), and freed with them, as the executor runs them
  (:func:`tag.executor.fuse.share_param_casts`): the group does not hold them from its forward to
  its backward (:attr:`GraphStatic.saved_casts <tag.sim.static.GraphStatic.saved_casts>`,
  recomputed ``rc_casts``, leave its held bytes, those not replaced by gathered weights join its
  working set) and its backward pays their seconds again (:meth:`Simulator.recompute_layout` and
  :meth:`Simulator.warm_layout` charge replicated groups once per iteration). The gradient
  reduce-scatter stays fp32 (``P_g``);
* ``zero1`` / ``zero2`` under mixed precision gather the updated shards by the same rule
  (:func:`tag.graph.precision.param_gather_bytes`: ``A_g`` the gather of ``P^g_g``), as DeepSpeed's
  ZeRO-1/2 and Megatron-LM's distributed optimizer gather their bf16 / fp16 model weights after
  the step (sources in :mod:`tag.executor.sharded`); they hold their full fp32 parameters and cast
  as replicated groups do, and a group with such weights holds its fp32 master shard besides
  (``P_g / S`` more: the executor's shard is then a tensor of its own, the full parameters holding
  the others' shards rounded; offloaded, the shard is the host's and copied to the device for the
  gather only).

Offloaded (``GroupPlan.offload`` ``optimizer``, ZeRO-Offload), with ``k_m`` the group's devices on
machine ``m`` (they step at once, sharing its host link ``H_m`` each direction and its CPU's memory
bandwidth ``C_m``, :mod:`tag.topology.host`) and ``U_g`` the bytes the group's optimizer ops read
and write (the graph's, as the roofline prices them on a device):

* the step is synchronous after the gradient sync, as the executor runs it: the gradient shard
  copied to the host (``k_m P_g / S / H_m``), the optimizer on the host CPU (``k_m U_g / S / C_m``,
  memory bound), the updated parameter shard copied back (``k_m P_g / S / H_m``), replacing the
  device's step; ``zero1`` / ``zero2`` then all-gather as without offload. ZeRO-Offload's
  one-step delayed update (the host step overlapping the next forward) is not modelled;
* the device holds no optimizer state, and with ``zero2`` / ``zero3`` no gradient shard between
  iterations (:func:`tag.parallel.sharded.offloaded_bytes`); its host holds, per device, the
  FP32 parameter shard it updates, the gradient shard and the optimizer state shard,
  ``(2 P_g + O_g) / S`` (:func:`host_bytes`); a machine whose host needs more than its
  ``host_memory`` is out of memory (:func:`check_host`).
"""

from __future__ import annotations

import numpy as np

from ..errors import TagError
from ..graph.gradients import param_groups
from ..graph.ir import Phase
from ..graph.precision import low_gathered_params, param_casts, param_gather_bytes
from ..parallel.sharded import offloaded_bytes, shard_size, sharded_bytes
from ..parallel.strategy import strategy_of
from .static import BWD, FWD, OPT
from .strategies import register_costing
from .units import ENTRY_BYTES, GroupData, Layout, Unit


def sharded_layout(sim, lay: Layout, level: int, shard: int, offload: str | None = None,
                   recompute: bool = False) -> Layout:
    """``lay`` (data-parallel replicas, every group; ``recompute``: under activation
    recomputation, :meth:`Simulator.recompute_layout`) costed as ZeRO stage ``level`` with shard
    groups of ``shard`` consecutive replicas, ``offload`` the state kept on the host (module
    docstring); cached in the simulator's layouts."""
    key = ("zero", lay.uid, level, shard, offload, recompute)
    hit = sim._layouts.get(key)
    if hit is not None:
        return hit
    static = sim.static
    p = np.asarray(static.grad_bytes, dtype=float)  # [K] parameter bytes (= gradient bytes)
    o = np.array([float(x.sum()) for x in static.static_pos]) - 2 * p  # [K] optimizer-state bytes
    gathered, copies, share = low_gathers(sim)  # [K] gathered bytes (every level), the copies ZeRO-3 makes needless
    gather = np.array([sim.comm.shard_gather_time(lay.devices, shard, x) for x in gathered.tolist()])  # [K] s
    dur = lay.dur.copy()
    dur[OPT] = host_step(sim, lay.devices, p, shard) if offload else dur[OPT] / shard
    on_gpu = offloaded_bytes(level, shard, p, o)[0] if offload else sharded_bytes(level, shard, p, o)
    if level < 3 and not offload:  # the fp32 master shard of a group gathered in the low precision: its own
        on_gpu = on_gpu + np.where(gathered < p, p / shard, 0.0)  # (offloaded: on the host, as without)
    rt = held_as(sim, level, offload)
    if rt is not None:  # another runtime's mixed-precision state (:data:`STATE_RUNTIMES`)
        on_gpu = runtime_state_bytes(rt, level, shard, p, o)
    held = (2 * p + o) - on_gpu  # [K] bytes no longer held
    transient = np.zeros_like(p)
    if level < 3:
        dur[OPT] += gather[:, None]
        if level == 2:
            transient += p
        if rt is not None:  # Megatron-LM's bf16 / fp16 weights are read as they are: no casts made or held
            held += static.rc_casts if recompute else static.saved_casts
    else:
        cpu = np.array([sim.shared_stream[d] for d in lay.devices], dtype=bool)[None, :]  # [1, R]
        cast = sim._casts_of(lay)  # [K, R] s of the forward's weight casts (None: none)
        gone = np.zeros_like(dur[FWD]) if cast is None else cast * share[:, None]  # [K, R] the cast-only weights'
        # the gather: its shard cast first (FSDP2's copy-in, on the gather's stream), then the collective
        g = gather[:, None] + gone / shard
        base_f = lay.dur[FWD] - gone  # [K, R] the forward without the casts the gathered weights make needless
        prev_f = np.vstack([np.zeros((1, dur.shape[2])), base_f[:-1]])  # [K, R] previous group's forward
        next_b = np.vstack([lay.dur[BWD][1:], np.zeros((1, dur.shape[2]))])  # [K, R] next group's backward
        dur[FWD] = base_f + np.where(cpu, g, np.maximum(0.0, g - prev_f))
        dur[BWD] += np.where(cpu, g, np.maximum(0.0, g - next_b))
        neighbour = np.maximum(np.concatenate([[0.0], gathered[:-1]]), np.concatenate([gathered[1:], [0.0]]))
        # the unsharded gradient, the gathered parameters and the neighbour's prefetched ones (a
        # group without parameters runs as plain replicas)
        transient += (np.where(p > 0, p + gathered + neighbour, 0.0) if rt is None
                      else deepspeed_zero3_transient(sim, p))
        # the other bf16 / fp16 weight casts per use: made from the gathered parameters at each
        # forward and again at each backward, freed with them (not held from the forward to the backward)
        casts = static.rc_casts if recompute else static.saved_casts  # [K] bytes ``lay`` holds
        held += casts
        if rt is None:  # (DeepSpeed's fp16 model reads its gathered weights as they are: no casts)
            transient += np.maximum(static.rc_casts - copies, 0.0)
        if cast is not None:  # (recompute_layout's backward left them out: the recomputation casts again)
            dur[BWD] += cast - gone
    mem = lay.mem - held[:, None]
    work = lay.work + transient[:, None]
    out = Layout.of(lay.devices, lay.batches, lay.dev_arr, dur, mem, work, lay.starts, saved=lay.saved,
                    compute=lay.compute, host=lay.host, lag=lay.lag)
    out = sim.store_layout(key, out)
    if level == 3:  # every micro-batch of a pipeline casts again: its own warm layout (Simulator.warm_layout)
        sim._layouts[("warm", out.uid)] = out
    return out


STATE_RUNTIMES = ("megatron", "deepspeed")
"""Runtimes whose mixed-precision sharded training state the simulator can hold as they hold it
(:func:`hold_state_as`; TAG's executor, the default, as :func:`tag.parallel.sharded.sharded_bytes`
and the module docstring say), per parameter of ``n`` elements under Adam (``O_g`` = 8 bytes an
element), ``S`` devices a shard group, the graph's parameters fp32 (``P_g / 4`` elements):

* ``megatron``, ``zero1`` (Megatron-LM's ``--use-distributed-optimizer`` under ``--bf16`` /
  ``--fp16``): the model's 2-byte weights, the fp32 main-gradient buffer and the fp32 master
  weights and Adam moments sharded, ``6 + 12 / S`` bytes (NVIDIA/Megatron-LM 50b073c,
  docs/source/api-guide/dist_optimizer.md, "float16 param, fp32 grads": 18 bytes without the
  distributed optimizer, ``6 + 12/d`` with it); the forward reads the 2-byte weights, no cast is
  made or held. Replicated (``zero=0``) groups keep TAG's account (16 bytes and the casts held
  from the forward to the backward);
* ``deepspeed``, ``zero3`` (DeepSpeed's ZeRO-3 under ``fp16`` / ``bf16``): 2-byte parameter and
  gradient partitions, fp32 master and Adam partitions, ``16 / S`` bytes held (as TAG's ZeRO-3);
  while a group runs, its gathered 2-byte parameters, the next ones prefetched up to
  ``prefetch_bucket_size`` elements and its 2-byte gradients up to a ``reduce_bucket_size``
  bucket plus the largest parameter's gradient before its copy into the bucket
  (:func:`deepspeed_zero3_transient`, defaults :data:`DEEPSPEED_BUCKETS`); no casts.

Other levels under these runtimes (Megatron-LM has no ZeRO-2/3; DeepSpeed's ZeRO-1/2), offloaded
groups and fp32 graphs keep TAG's account. Only bytes differ: the costs (gathers, casts' seconds)
are TAG's."""

DEEPSPEED_BUCKETS = (5e8, 5e7)
"""DeepSpeed's ZeRO defaults, elements: ``reduce_bucket_size`` and ``stage3_prefetch_bucket_size``
(microsoft/DeepSpeed 03dc2b9, deepspeed/runtime/zero/config.py ``DeepSpeedZeroConfig``)."""


def hold_state_as(graph, runtime: str):
    """Mark ``graph`` (in place; returned) so that the simulator holds its sharded groups' training
    state as ``runtime`` (:data:`STATE_RUNTIMES`, or ``tag``: TAG's executor) holds it."""
    if runtime not in ("tag", *STATE_RUNTIMES):
        raise TagError(f"state runtime: expected one of {['tag', *STATE_RUNTIMES]}, got {runtime!r}")
    graph.state_runtime = runtime
    return graph


def held_as(sim, level: int, offload) -> str | None:
    """The runtime of :data:`STATE_RUNTIMES` whose account a ``zero{level}`` group of ``sim``'s
    graph takes, or None (TAG's)."""
    rt = getattr(sim.graph, "state_runtime", "tag")
    if offload or sim.graph.precision == "fp32":
        return None
    if (rt, level) in (("megatron", 1), ("deepspeed", 3)):
        return rt
    return None


def runtime_state_bytes(runtime: str, level: int, shard: int, p, o):
    """Bytes one device holds for the whole iteration of a group of ``p`` fp32 parameter bytes and
    ``o`` optimizer-state bytes as ``runtime`` holds them at ZeRO ``level`` (:data:`STATE_RUNTIMES`)."""
    low = p / 2  # the model's 2-byte weights (or gradients)
    if runtime == "megatron" and level == 1:
        return low + p + (p + o) / shard  # weights, fp32 main gradients, (master + Adam) / S
    if runtime == "deepspeed" and level == 3:
        return (low + low + p + o) / shard  # weight, gradient, master, Adam partitions
    raise TagError(f"state runtime: {runtime!r} at zero={level} is held as TAG's (held_as)")


def deepspeed_zero3_transient(sim, p: np.ndarray) -> np.ndarray:
    """[K] bytes a ``zero3`` group holds while it runs as DeepSpeed holds them
    (:data:`STATE_RUNTIMES`): its gathered 2-byte parameters ``P_g / 2``, the neighbour's
    prefetched up to ``prefetch_bucket_size`` elements, its 2-byte gradient up to a
    ``reduce_bucket_size`` bucket plus its largest parameter's (none without parameters)."""
    reduce_elems, prefetch_elems = DEEPSPEED_BUCKETS
    low = p / 2
    neighbour = np.maximum(np.concatenate([[0.0], low[:-1]]), np.concatenate([low[1:], [0.0]]))
    grads = np.minimum(low, 2 * reduce_elems + _largest_param(sim) / 2)
    return np.where(p > 0, low + np.minimum(neighbour, 2 * prefetch_elems) + grads, 0.0)


def _largest_param(sim) -> np.ndarray:
    """[K] bytes of each group's largest parameter (its gradient's group), cached."""
    memo = sim.cache("zero-gather")
    hit = memo.get("largest")
    if hit is None:
        graph = sim.graph
        hit = np.zeros(sim.static.num_groups)
        for param, g in zip(graph.params, param_groups(graph)):
            hit[g] = max(hit[g], param.nbytes)
        memo["largest"] = hit
    return hit


def low_gathers(sim) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[K] arrays, cached: the bytes one gather of each group's parameters moves, at every ZeRO
    level (:func:`tag.graph.precision.param_gather_bytes`: the parameters
    :func:`~tag.graph.precision.low_gathered_params` names at 2 bytes an element, the rest as they
    are), and for ZeRO-3 under mixed precision the bytes of the casts that the gathered copies
    replace (the executor reads them as they are, :func:`tag.executor.fuse.cast_as_needed`) and
    those casts' share of the group's cast bytes (of its cast seconds: a cast is memory bound).
    fp32 graphs: the parameter bytes and zeros."""
    memo = sim.cache("zero-gather")
    hit = memo.get("low")
    if hit is not None:
        return hit
    graph, static = sim.graph, sim.static
    p = np.asarray(static.grad_bytes, dtype=float)
    gathered, copies, total = p.copy(), np.zeros_like(p), np.zeros_like(p)
    low = low_gathered_params(graph)
    if low:
        moved = param_gather_bytes(graph)
        groups = param_groups(graph)
        for k in low:
            gathered[groups[k]] -= graph.params[k].nbytes - moved[k]
        mine = {graph.params[k].tensor for k in low}
        for i in param_casts(graph):
            op = graph.ops[i]
            nb = graph.tensors[op.outputs[0]].nbytes.fixed
            total[op.group] += nb
            if op.inputs[0] in mine:
                copies[op.group] += nb
    share = np.divide(copies, total, out=np.zeros_like(p), where=total > 0)
    hit = memo["low"] = (gathered, copies, share)
    sim.charge(sum(x.nbytes for x in hit))
    return hit


def _update_bytes(sim) -> np.ndarray:
    """[K] bytes the optimizer ops of each group read and write (``U_g``), cached."""
    memo = sim.cache("zero-offload")
    hit = memo.get("update")
    if hit is None:
        hit = np.zeros(sim.static.num_groups)
        opt = Phase.OPT  # (an enum member looked up once: ~0.4 us a lookup)
        for op in sim.graph.ops:
            if op.phase == opt:
                hit[op.group] += op.bytes_read.fixed + op.bytes_written.fixed
        memo["update"] = hit
    return hit


def host_step(sim, devices, p: np.ndarray, shard: int) -> np.ndarray:
    """[K, R] seconds of each group's offloaded step on each of ``devices`` (module docstring):
    gradient shard to the host, the optimizer on the host CPU, parameter shard back, the machine's
    link and CPU shared by its devices among ``devices``."""
    topo = sim.topology
    machine_per_device = [topo.machine_of(d) for d in devices]
    k = np.array([machine_per_device.count(m) for m in machine_per_device], dtype=float)  # [R] devices stepping on each one's host
    link = np.array([topo.machines[m].host_link for m in machine_per_device])
    cpu = np.array([topo.machines[m].host_memory_bw for m in machine_per_device])
    update_bytes = _update_bytes(sim)
    return k[None, :] * ((2 * p / shard)[:, None] / link[None, :] + (update_bytes / shard)[:, None] / cpu[None, :])


def host_bytes(sim, groups) -> list[float]:
    """Per machine: bytes its host holds for the offloaded groups of ``groups`` (a plan's
    GroupPlans), ``(2 P_g + O_g) / S`` per device of such a group on it."""
    static = sim.static
    out = [0.0] * sim.topology.num_machines
    for g, gp in enumerate(groups):
        if not gp.offload:
            continue
        p = float(static.grad_bytes[g])
        o = float(static.static_pos[g].sum()) - 2 * p
        per = offloaded_bytes(int(gp.sync[4:]), shard_size(gp), p, o)[1]
        for d in gp.devices:
            out[sim.topology.machine_of(d)] += per
    return out


def check_host(sim, groups, res):
    """``res`` with the machines whose host memory the offloaded groups exceed
    (:attr:`SimResult.host_oom`, and ``oom``); ``res`` itself when nothing is offloaded."""
    if not any(gp.offload for gp in groups):
        return res
    need = host_bytes(sim, groups)
    machines = sim.topology.machines
    res.host_memory_bytes = need
    res.host_oom = [(m, need[m], machines[m].host_memory) for m in range(len(machines))
                    if need[m] > machines[m].host_memory]
    res.oom = res.oom or bool(res.host_oom)
    return res


def sharded_group(sim, g: int, gp, lowered) -> GroupData:
    """:class:`GroupData` of group ``g`` deployed as ``gp`` (a ``zero*`` plan; ``lowered``: its
    data-parallel unit)."""
    strategy = strategy_of(gp)
    devs, batches = tuple(lowered[0].devices), lowered[0].batches
    lay = sim.layout(devs, batches)
    if gp.recompute:
        lay = sim.recompute_layout(lay)
    lay = sharded_layout(sim, lay, strategy.level, shard_size(gp), gp.offload, bool(gp.recompute))
    unit = Unit(g, -1, devs, batches, lay.starts, lay)
    unit_key = ("dp", devs, batches)
    collective = strategy.collective(gp)
    nbytes = float(sim.static.grad_bytes[g])
    if collective is None or nbytes <= 0:
        return GroupData([unit], "none", 0.0, (), (), 0.0, layout=lay, unit_key=unit_key, recompute=gp.recompute)
    memo = sim.cache("zero-sync")
    t = memo.get((collective.op, devs, nbytes))
    if t is None:
        t = memo[(collective.op, devs, nbytes)] = sim.comm.sync_time(collective.op, devs, nbytes)
        sim.charge(ENTRY_BYTES)
    mo = sim.comm.machine_of
    machines = tuple(sorted({mo[d] for d in devs}))
    return GroupData([unit], collective.op, t, collective.members, machines if len(machines) > 1 else (), nbytes, layout=lay,
                     unit_key=unit_key, bucket=(collective.op, devs, None), recompute=gp.recompute)


for _name in ("zero1", "zero2", "zero3"):
    register_costing(_name, sharded_group)

__all__ = ["DEEPSPEED_BUCKETS", "STATE_RUNTIMES", "check_host", "deepspeed_zero3_transient", "held_as", "hold_state_as",
           "runtime_state_bytes", "host_bytes", "host_step", "low_gathers", "sharded_group", "sharded_layout"]
