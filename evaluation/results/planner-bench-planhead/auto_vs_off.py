import math

import evaluation.planner_bench as pb
from tag.data.generate import load_graph
from tag.planner import find_plan
from tag.topology import load_topology

rows = []
for spec, batch, groups in pb.MODELS:
    g = load_graph("runs/predictor/graphs", spec, batch, groups)
    for tp in pb.TOPOLOGIES:
        topo = load_topology(tp)
        t = {}
        for pipes in ("auto", "off"):
            p = find_plan(g, topo, seed=0, budget=200, pipelines=pipes, executable=True, compression="off")
            t[pipes] = p.predicted_iteration_time_s
        rows.append((spec.split(':')[0], topo.name, t["auto"], t["off"]))
        print(f"{spec.split(':')[0]:6s} {topo.name:22s} auto {t['auto']*1e3:8.3f} off {t['off']*1e3:8.3f} auto/off {t['auto']/t['off']:.4f}", flush=True)
r = [a / o for _, _, a, o in rows]
print("auto worse on", sum(x > 1 + 1e-9 for x in r), "geomean", math.exp(sum(map(math.log, r)) / len(r)))
