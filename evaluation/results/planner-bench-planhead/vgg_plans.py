import sys

from tag.data.generate import load_graph
from tag.plan.format import device_ranges
from tag.planner import find_plan
from tag.topology import load_topology

g = load_graph("runs/predictor/graphs", "vgg:depth=16,width=32", 64, 32)
topo = load_topology("topologies/" + sys.argv[1] + ".yaml")
for pipes, prior, budget in [("off", "uniform", 2000), ("off", "gnn", 50), ("auto", "gnn", 50), ("auto", "uniform", 2000)]:
    p = find_plan(g, topo, seed=0, budget=budget, pipelines=pipes, prior=prior, executable=False, layout_grid=False, compression="off")
    print(pipes, prior, budget, round(p.predicted_iteration_time_s * 1e3, 3), "ms", p.meta["actions"] if len(str(p.meta["actions"]))<300 else "", "pipe", p.pipeline)
    for i, gp in enumerate(p.groups):
        print(f"   g{i:2d} {gp.sync:9s} d={device_ranges(sorted(gp.devices))} sh={[round(s,2) for s in gp.shares][:8]} tp={gp.tp} mp={gp.mp_splits}")
