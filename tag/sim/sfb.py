"""What a group's ``GroupPlan.sfb`` costs in the simulator (see :class:`tag.sim.units.SfbData`).

* **All-gathers**: one per distinct factor of the group's SFB ops (:func:`tag.compress.sfb_work`),
  replica ``r`` contributing ``b_r * bytes_per_sample`` bytes, priced by the cost model's
  :meth:`tag.cost.comm.CommModel.allgather_time` (the measured gloo all-gather fit between CPU
  devices of one machine with a communication profile, else the faster of the ring and the
  hierarchical all-gather on the links), as the SFB selection prices them.
* **Recompute**: replica ``r`` runs every SFB op on the global batch ``B`` instead of its ``b_r``
  samples: ``sum_op t(op, B) - t(op, b_r)`` seconds on its device, where ``t(op, b)`` is the op's
  roofline share of its group's backward in the cost model, ``table[g, bwd, b] * roof(op, b) /
  roof(group g's backward, b)`` -- the cost model's (profiled, scaled or roofline) time of the
  group, apportioned to its ops the way ``mp`` chunks are. On a roofline device this is exactly
  ``max(flops(b) / flop_rate, bytes(b) / mem_bandwidth)`` of the op.
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError
from ..parallel import sfb_syncs
from ..plan.format import local_batches
from .units import SfbData


class SfbCosts:
    """Per-simulator SFB helper: candidates (found once), per-device op timing."""

    def __init__(self, sim):
        from ..compress import find_candidates

        self.sim = sim
        self.graph = sim.graph
        self.candidates = find_candidates(sim.graph)
        self._roof: dict[int, tuple] = {}  # device class -> (Roofline, overhead, [K, 3, B+1] roofline table)

    def _device_roof(self, d: int):
        cls = self.sim.dev_class[d]
        r = self._roof.get(cls)
        if r is None:
            from ..cost.roofline import group_phase_table, op_overhead

            spec = self.sim.topology.devices[d].gpu
            roof = self.sim.costs.roofline(d)
            over = op_overhead(spec)
            grid = np.arange(self.graph.batch_size + 1, dtype=float)
            r = self._roof[cls] = (roof, over, group_phase_table(self.graph, roof, grid, over))
        return r

    def op_seconds(self, d: int, g: int, op_idx: int, batch: int) -> float:
        """Cost-model seconds of backward op ``op_idx`` of group ``g`` at ``batch`` samples on ``d``."""
        roof, over, rtab = self._device_roof(d)
        op = self.graph.ops[op_idx]
        mine = roof.time(op.flops.at(batch), op.bytes_read.at(batch) + op.bytes_written.at(batch)) + over
        total = rtab[g, 1, batch]
        if total <= 0:
            return mine
        return float(self.sim.tables[self.sim.dev_class[d], g, 1, batch]) * mine / float(total)

    def group(self, g: int, gp) -> SfbData:
        """The SFB data of group ``g`` deployed as ``gp`` (``gp.sfb`` non-empty)."""
        from ..compress import SfbError, group_sfb_work

        bsz = self.graph.batch_size
        try:
            w = group_sfb_work(self.graph, gp, g, bsz, self.candidates, syncs=sfb_syncs())
        except SfbError as e:
            raise PlanError(str(e)) from None
        devs = tuple(gp.devices)
        lb = local_batches(bsz, list(gp.shares))
        times, sizes = [], []
        comm = self.sim.comm
        for x in w.gathers:
            times.append(comm.allgather_time(list(x.chunks), list(devs)))
            sizes.append(float(sum(x.chunks)))
        rec = []
        for d, b in zip(devs, lb):
            rec.append(sum(max(0.0, self.op_seconds(d, g, i, bsz) - self.op_seconds(d, g, i, b)) for i in w.ops))
        mo = self.sim.comm.machine_of
        machines = tuple(sorted({mo[d] for d in devs}))
        return SfbData(tuple(w.ops), tuple(x.factor.name for x in w.gathers), tuple(times), tuple(sizes),
                       float(sum(times)), float(sum(sizes)), devs, tuple(sorted(devs)),
                       machines if len(machines) > 1 else (), tuple(rec), float(w.saved_grad_bytes))
