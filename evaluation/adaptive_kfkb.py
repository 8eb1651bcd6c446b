"""Ada-Grouper's claim in simulation: adaptive kFkB (tag.sim.adaptive.replay, the block size
chosen between iterations by tag.parallel.adaptive.choose_k) against fixed 1F1B on cloud-t4 (4
VMs of 2 T4s, 10 Gbit/s) whose every VM NIC carries another job's traffic, per background trace.

    .venv/bin/python evaluation/adaptive_kfkb.py [--model gpt2:n_layer=8,n_embd=768,n_head=12,seq=256]
        [--batch 32] [--layout dp=2,pp=4,micro=8] [--iterations 24]

The traces are stated in units of the free network's 1F1B iteration ``T``: ``const0.8`` (80% of
every NIC taken throughout), ``periodic0.9`` (90% for 2T of every 4T), ``preempt`` (free until 3T,
90% to 10T, 50% to 16T, free to 20T, 95% after). Prints, per trace, the summed seconds of the
iterations run back to back on the trace's clock, fixed 1F1B and adaptive, and the adaptive run's
block sizes.
"""

from __future__ import annotations

import argparse
import copy

import yaml

from tag.cost.model import CostModel
from tag.graph import capture
from tag.parallel.layout import layout_plan, parse_layout
from tag.sim import Simulator
from tag.sim.adaptive import replay
from tag.topology import load_topology
from tag.workloads import load_workload


def traces(T: float) -> dict:
    """Background of every NIC per trace name, times in units of ``T`` seconds."""
    return {"free": None, "const0.8": 0.8,
            "periodic0.9": {"busy": 0.9, "period": f"{4 * T} s", "on": f"{2 * T} s"},
            "preempt": {"trace": [[0, 0.0], [3 * T, 0.9], [10 * T, 0.5], [16 * T, 0.0], [20 * T, 0.95]]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2:n_layer=8,n_embd=768,n_head=12,seq=256")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layout", default="dp=2,pp=4,micro=8")
    ap.add_argument("--iterations", type=int, default=24)
    a = ap.parse_args()
    graph = capture(load_workload(a.model, batch=a.batch), num_groups=16).graph
    raw = yaml.safe_load(open("topologies/cloud-t4.yaml"))
    free = load_topology(raw)
    costs = CostModel.for_topology(graph, free)
    plan = layout_plan(graph, free, parse_layout(a.layout), costs)
    T = Simulator(graph, free, costs).run(plan.groups, pipeline=plan.pipeline).iteration_time_s
    print(f"{a.model} batch {a.batch} {a.layout} on cloud-t4: free 1F1B iteration T = {T * 1e3:.1f} ms")
    for name, bg in traces(T).items():
        d = copy.deepcopy(raw)
        for m in d["machines"]:
            if bg is not None:
                m["background"] = bg
        topo = load_topology(d)
        sim = Simulator(graph, topo, CostModel(graph, topo, costs._dev, costs.comm))
        fixed = sum(i.time_s for i in replay(sim, plan, a.iterations, adaptive=False))
        ada = replay(sim, plan, a.iterations, adaptive=True)
        total = sum(i.time_s for i in ada)
        print(f"{name:12s} 1F1B {fixed:8.3f} s  adaptive {total:8.3f} s  ({total / fixed - 1:+.1%})  "
              f"k {[i.k for i in ada]}")


if __name__ == "__main__":
    main()
