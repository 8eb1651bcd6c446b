"""A deliberately crude stand-in simulator for unit tests of the search mechanics.

It costs compute from :class:`GroupCosts`, and communication with the topology's nominal
:class:`tag.cost.comm.CommModel`: gradient sync by all-reduce or parameter server over the
group's devices, activations crossing groups placed on different device sets (and between
model-parallel chunks) as transfers on the slowest link involved, all added up serially. It is
*not* the simulator (:mod:`tag.sim`); it exists so the searchers can be tested in isolation
quickly and deterministically.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cost.comm import SYNC_OPS, CommModel, LinkFit
from ..parallel import strategy_of
from .costs import GroupCosts


@dataclass
class ToyResult:
    iteration_time_s: float
    oom: bool
    peak_memory_bytes: list
    memory_capacity_bytes: list
    compute_time_s: list
    comm_time_s: list
    group_finish_s: list


class ToySimulator:
    def __init__(self, graph, topology, costs: GroupCosts | None = None):
        self.graph = graph
        self.topology = topology
        self.costs = costs or GroupCosts.compute(graph, topology)
        self.calls = 0

    def run(self, groups) -> ToyResult:
        self.calls += 1
        c, topo = self.costs, self.topology
        n = topo.num_devices
        load = np.zeros(n)
        mem = np.zeros(n)
        comm = np.zeros(n)
        finish = []
        cm = CommModel.nominal(topo)
        bw = cm.bandwidth

        def slowest(pairs) -> LinkFit:  # the slowest (bandwidth, latency) link of ``pairs``
            a, b = min(pairs, key=lambda ab: bw[ab[0], ab[1]])
            return LinkFit(float(cm.latency[a, b]), float(bw[a, b]))

        t_comm = 0.0
        for g, gp in enumerate(groups):
            devs = gp.devices
            if strategy_of(gp).chunked:
                for d in devs:
                    load[d] += c.group_time_full[g, d] / len(devs)
                    mem[d] += (2 * c.param_bytes[g] + c.opt_bytes[g]) / len(devs) + c.act_bytes[g] / len(devs)
                if len(devs) > 1:
                    t_comm += slowest([(a, b) for a in devs for b in devs if a != b]).time(c.act_bytes[g])
            else:
                for d, s in zip(devs, gp.shares):
                    load[d] += c.group_time_full[g, d] * (0.1 + 0.9 * s)
                    mem[d] += 2 * c.param_bytes[g] + c.opt_bytes[g] + c.act_bytes[g] * s
                coll = strategy_of(gp).collective(gp) if len(devs) > 1 else None
                if coll is not None:
                    p = float(c.param_bytes[g])
                    # (a collective of another kind, e.g. a tp group's: crudely, one all-reduce)
                    t = cm.sync_time(coll.op if coll.op in SYNC_OPS else "allreduce", devs, p, coll.server)
                    t_comm += t
                    for d in devs:
                        comm[d] += t
            if g > 0 and set(groups[g - 1].devices) != set(devs):
                pairs = [(a, b) for a in groups[g - 1].devices for b in devs if a != b]
                if pairs:
                    t_comm += 2 * slowest(pairs).time(c.act_bytes[g - 1])
            finish.append(float(load.max() + t_comm))
        cap = np.array([d.gpu.memory_bytes for d in topo.devices], dtype=float)
        it = float(load.max() + t_comm)
        return ToyResult(it, bool((mem > cap).any()), mem.tolist(), cap.tolist(), load.tolist(), comm.tolist(),
                         finish)
