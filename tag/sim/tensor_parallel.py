"""How the simulator costs a tensor-parallel op-group (``sync == "tp"``,
:mod:`tag.parallel.tensor_parallel`).

The group's devices hold token shards (sample ranges, :meth:`TensorParallel.units`), so its unit
is a data-parallel :class:`~tag.sim.units.Layout` over them, costed at each device's shard: the
split matmuls' FLOPs are the block's FLOPs over ``T`` (what a ``1 / T`` batch costs), the
non-matmul ops sequence-parallel. On that layout, for every group ``g`` as tensor parallel
(:func:`tp_layout`, all groups at once so consecutive ``tp`` groups stay one vectorised segment):

* forward / backward seconds grow by the blocking collectives of the blocks in ``g``
  (:meth:`CommModel.tensor_parallel_time <tag.cost.comm.CommModel.tensor_parallel_time>` at the
  tensor-parallel group's batch; they sit between the block's matmuls, so nothing overlaps them);
* held bytes shrink by ``(1 - 1/T)`` of the split parameters' parameter, gradient and optimizer
  bytes, and the optimizer seconds by the same fraction of the group's parameter bytes;
* the gradient sync (:meth:`CommModel.tensor_parallel_sync_time`) is issued like a data-parallel
  one, not coalesced with other groups'.

This is the sequence-parallel variant. The executor runs plain Megatron (:mod:`tag.parallel.
tensor_parallel`, "What the executor runs"): the same collective bytes per block, but the ops
outside the blocks on the tensor-parallel group's whole batch on every device, and every gradient
all-reduced over the replicas holding the same shard only.
"""

from __future__ import annotations

import numpy as np

from ..parallel.tensor_parallel import group_split, tp_degree, tp_groups
from .static import BWD, FWD, OPT
from .units import GroupData, Layout, Unit


def tp_layout(sim, devices: tuple[int, ...], batches: tuple[int, ...], t: int) -> Layout:
    """The data-parallel layout of ``devices`` / ``batches`` with every group costed as tensor
    parallel of degree ``t`` (cached in the simulator's layouts)."""
    key = ("tp", t, devices, batches)
    lay = sim._layouts.get(key)
    if lay is not None:
        return lay
    base = sim.layout(devices, batches)
    graph, comm, static = sim.graph, sim.comm, sim.static
    dur, mem = base.dur.copy(), base.mem.copy()
    r = len(devices)
    groups = [list(range(i, i + t)) for i in range(0, r, t)]  # replica indices per tp group
    keep = 1.0 - 1.0 / t
    for g in range(static.num_groups):
        sp = group_split(graph, g)
        if not sp.blocks:
            continue
        for reps in groups:
            devs = [devices[i] for i in reps]
            b = sum(batches[i] for i in reps)
            fwd = comm.tensor_parallel_time(devs, [a.at(b) for a in sp.reduce_fwd])
            bwd = comm.tensor_parallel_time(devs, [a.at(b) for a in sp.reduce_bwd])
            dur[FWD, g, reps] += fwd
            dur[BWD, g, reps] += bwd
        gb = float(static.grad_bytes[g])
        if gb > 0:
            dur[OPT, g, :] *= 1.0 - keep * sp.split_bytes / gb
        mem[g, :] -= keep * sp.split_state
    k = static.num_groups
    cum_f = np.zeros((k + 1, r))
    np.cumsum(dur[FWD], axis=0, out=cum_f[1:])
    cum_b = np.zeros((k + 1, r))
    np.cumsum(dur[BWD][::-1], axis=0, out=cum_b[1:])
    gsum = dur.sum(axis=(0, 2))
    lay = Layout(base.devices, base.batches, base.dev_arr, dur, cum_f, cum_b, mem, base.work, base.starts, gsum,
                 gsum.tolist(), rows=[None] * k)
    sim._serial += 1
    lay.uid = sim._serial
    sim._layouts[key] = lay
    return lay


def tp_group(sim, g: int, gp, lowered) -> GroupData:
    """:class:`GroupData` of group ``g`` deployed tensor parallel as ``gp`` (``lowered``: its units)."""
    devs, batches = tuple(gp.devices), lowered[0].batches
    lay = tp_layout(sim, devs, batches, tp_degree(gp))
    unit = Unit(g, -1, devs, batches, lay.starts, lay)
    split = group_split(sim.graph, g).split_bytes
    total = float(sim.static.grad_bytes[g])
    t = sim.comm.tensor_parallel_sync_time(tp_groups(gp), split, max(0.0, total - split))
    if t <= 0:
        return GroupData([unit], "none", 0.0, (), (), 0.0, layout=lay, ukey=("dp", devs, batches))
    mo = sim.comm.machine_of
    machines = tuple(sorted({mo[d] for d in devs}))
    return GroupData([unit], "tp", t, tuple(sorted(devs)), machines if len(machines) > 1 else (), total,
                     layout=lay, ukey=("dp", devs, batches))
