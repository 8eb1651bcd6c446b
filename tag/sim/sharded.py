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
  gathered parameters ``P_g`` and the neighbour's prefetched ones (the larger of ``P_{g-1}``,
  ``P_{g+1}``; none for a group without parameters, which the search deploys as plain replicas).
  A device's peak adds the largest working set of its groups to what they hold: the
  largest gathered group, as FSDP's.
"""

from __future__ import annotations

import numpy as np

from ..parallel.sharded import shard_size, sharded_bytes
from ..parallel.strategy import strategy_of
from .static import BWD, FWD, OPT
from .strategies import register_costing
from .units import ENTRY_BYTES, GroupData, Layout, Unit


def sharded_layout(sim, lay: Layout, level: int, shard: int) -> Layout:
    """``lay`` (data-parallel replicas, every group) costed as ZeRO stage ``level`` with shard
    groups of ``shard`` consecutive replicas (module docstring); cached in the simulator's layouts."""
    key = ("zero", lay.uid, level, shard)
    hit = sim._layouts.get(key)
    if hit is not None:
        return hit
    st = sim.static
    p = np.asarray(st.grad_bytes, dtype=float)  # [K] parameter bytes (= gradient bytes)
    o = np.array([float(x.sum()) for x in st.static_pos]) - 2 * p  # [K] optimizer-state bytes
    gather = np.array([sim.comm.shard_gather_time(lay.devices, shard, x) for x in p.tolist()])  # [K] s
    dur = lay.dur.copy()
    dur[OPT] /= shard
    held = (2 * p + o) - sharded_bytes(level, shard, p, o)  # [K] bytes no longer held
    transient = np.zeros_like(p)
    if level < 3:
        dur[OPT] += gather[:, None]
        if level == 2:
            transient += p
    else:
        cpu = np.array([sim.shared_stream[d] for d in lay.devices], dtype=bool)[None, :]  # [1, R]
        prev_f = np.vstack([np.zeros((1, dur.shape[2])), lay.dur[FWD][:-1]])  # [K, R] previous group's forward
        next_b = np.vstack([lay.dur[BWD][1:], np.zeros((1, dur.shape[2]))])  # [K, R] next group's backward
        g = gather[:, None]
        dur[FWD] += np.where(cpu, g, np.maximum(0.0, g - prev_f))
        dur[BWD] += np.where(cpu, g, np.maximum(0.0, g - next_b))
        neighbour = np.maximum(np.concatenate([[0.0], p[:-1]]), np.concatenate([p[1:], [0.0]]))
        transient += np.where(p > 0, 2 * p + neighbour, 0.0)  # (a group without parameters runs as plain replicas)
    mem = lay.mem - held[:, None]
    work = lay.work + transient[:, None]
    out = Layout.of(lay.devices, lay.batches, lay.dev_arr, dur, mem, work, lay.starts, saved=lay.saved,
                    compute=lay.compute)
    return sim.store_layout(key, out)


def sharded_group(sim, g: int, gp, lowered) -> GroupData:
    """:class:`GroupData` of group ``g`` deployed as ``gp`` (a ``zero*`` plan; ``lowered``: its
    data-parallel unit)."""
    strategy = strategy_of(gp)
    devs, batches = tuple(lowered[0].devices), lowered[0].batches
    lay = sim.layout(devs, batches)
    if gp.recompute:
        lay = sim.recompute_layout(lay)
    lay = sharded_layout(sim, lay, strategy.level, shard_size(gp))
    unit = Unit(g, -1, devs, batches, lay.starts, lay)
    ukey = ("dp", devs, batches)
    coll = strategy.collective(gp)
    nbytes = float(sim.static.grad_bytes[g])
    if coll is None or nbytes <= 0:
        return GroupData([unit], "none", 0.0, (), (), 0.0, layout=lay, ukey=ukey, recompute=gp.recompute)
    memo = sim.cache("zero-sync")
    t = memo.get((coll.op, devs, nbytes))
    if t is None:
        t = memo[(coll.op, devs, nbytes)] = sim.comm.sync_time(coll.op, devs, nbytes)
        sim.charge(ENTRY_BYTES)
    mo = sim.comm.machine_of
    machines = tuple(sorted({mo[d] for d in devs}))
    return GroupData([unit], coll.op, t, coll.members, machines if len(machines) > 1 else (), nbytes, layout=lay,
                     ukey=ukey, bucket=(coll.op, devs, None), recompute=gp.recompute)


for _name in ("zero1", "zero2", "zero3"):
    register_costing(_name, sharded_group)

__all__ = ["sharded_group", "sharded_layout"]
