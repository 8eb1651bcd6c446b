"""Ada-Grouper's claim in simulation: adaptive kFkB (tag.sim.adaptive.replay, the block size
chosen between iterations by tag.parallel.adaptive.choose_k) against fixed 1F1B on cloud-t4 (4
VMs of 2 T4s, 10 Gbit/s) whose every VM NIC carries another job's traffic, per background trace.

    .venv/bin/python evaluation/adaptive_kfkb.py [--model gpt2:n_layer=8,n_embd=768,n_head=12,seq=256]
        [--batch 32] [--layout dp=2,pp=4,micro=8] [--iterations 24] [--host-launch 55us] [--out simulated]

The traces are stated in units of the free network's 1F1B iteration ``T``: ``const0.8`` (80% of
every NIC taken throughout), ``periodic0.9`` (90% for 2T of every 4T), ``preempt`` (free until 3T,
90% to 10T, 50% to 16T, free to 20T, 95% after). Prints, per trace, the summed seconds of the
iterations run back to back on the trace's clock, fixed 1F1B and adaptive, and the adaptive run's
block sizes, and writes them to ``evaluation/results/adaptive-kfkb/<--out: simulated>/{README.md,results.json}``.
The machines keep cloud-t4's host (the GPU rule's default launch seconds); ``--host-launch 10us``
states a faster one.

    PYTHONPATH=. python -m evaluation.adaptive_kfkb --gloo [--model mlp:in_dim=512,hidden=2048,layers=4]
        [--batch 64] [--stages 2] [--micro 4] [--delays 0 20] [--throttled 0] [--rounds 3] [--steps 8]
        [--warmup 2]

measures the same on gloo (``tag execute``, one CPU rank per stage, the op-groups cut evenly): per
delay, the ``--throttled`` ranks' links holding each message they send that many ms (the hidden
``--inject-delay``),
fixed 1F1B against ``--adaptive-k``, in interleaved rounds (the arms' order alternating), and writes
``evaluation/results/adaptive-kfkb/{README.md,results.json}``: per delay and arm the median over
rounds of each run's median iteration time (the slowest rank's, barrier to barrier, after the
warm-up), the median over rounds of adaptive / 1F1B within a round (the two runs next to each
other: a shared machine's load drifts less between them), every run's figures and the adaptive
runs' block sizes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from dataclasses import replace
from pathlib import Path

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


def gloo_run(a, tmp: Path, delay_ms: float, adaptive: bool) -> dict:
    """One ``tag execute`` of the even ``a.stages``-stage 1F1B pipeline, rank 0's link delayed."""
    from tag.executor import ExecuteConfig, execute

    cfg = ExecuteConfig(a.model, str(tmp / "topology.yaml"), str(tmp / "plan.json"), batch=a.batch,
                        optimizer="sgd", steps=a.steps, warmup=a.warmup, timeout_s=120.0,
                        adaptive_k=adaptive, delay=f"{a.throttled}:{delay_ms:g}" if delay_ms else None)
    res = execute(cfg, graph=a.graph)
    its = res.ranks[0]["iterations"][a.warmup:]
    return {"delay_ms": delay_ms, "arm": "adaptive" if adaptive else "1f1b",
            "median_s": res.measured_iteration_time_s,
            "mean_s": statistics.mean(max(r["iterations"][a.warmup + i]["time_s"] for r in res.ranks)
                                      for i in range(len(its))),
            "k": [it.get("k", 1) for it in res.ranks[0]["iterations"]],
            "transfer_s": [it["next_k"]["transfer_s"] for it in res.ranks[0]["iterations"] if "next_k" in it],
            "rule": [it["next_k"] for it in res.ranks[0]["iterations"] if "next_k" in it]}


def gloo(a) -> None:
    """The ``--gloo`` measurement of the module docstring."""
    import sys
    import tempfile

    from evaluation.report import header_lines, machine_line
    from tag.graph import capture
    from tag.io import write_atomic, write_json
    from tag.plan import GroupPlan, PipelinePlan, new_plan
    from tag.workloads import load_workload

    out = Path(__file__).resolve().parents[0] / "results" / "adaptive-kfkb"
    out = out if a.throttled == "0" else out / f"throttled-{a.throttled.replace(',', '-')}"
    tmp = Path(tempfile.mkdtemp(prefix="adaptive-kfkb-"))
    (tmp / "topology.yaml").write_text(f"name: gloo-cpu{a.stages}\nmachines:\n  - name: local\n    gpu: cpu\n"
                                       f"    count: {a.stages}\n    intra_bandwidth: \"5 GB/s\"\n")
    a.graph = capture(load_workload(a.model, batch=a.batch), optimizer="sgd", num_groups=2 * a.stages).graph
    topo = load_topology(str(tmp / "topology.yaml"))
    per = a.graph.num_groups // a.stages
    plan = new_plan(a.graph, topo, [GroupPlan([min(g // per, a.stages - 1)], [1.0]) for g in range(a.graph.num_groups)])
    plan.pipeline = PipelinePlan([s * per for s in range(a.stages)], a.micro)
    plan.save(tmp / "plan.json")
    runs = []
    for r in range(a.rounds):
        for d in a.delays:
            for adaptive in ((False, True) if r % 2 == 0 else (True, False)):
                runs.append({"round": r, **gloo_run(a, tmp, d, adaptive)})
                x = runs[-1]
                print(f"round {r} delay {d:g} ms {x['arm']:8s} median {x['median_s'] * 1e3:8.1f} ms  "
                      f"mean {x['mean_s'] * 1e3:8.1f} ms  k {x['k']}", flush=True)
    rows = []
    summary = {}
    for d in a.delays:
        med = {arm: statistics.median(x["median_s"] for x in runs if x["delay_ms"] == d and x["arm"] == arm)
               for arm in ("1f1b", "adaptive")}
        ks = sorted({k for x in runs if x["delay_ms"] == d and x["arm"] == "adaptive" for k in x["k"][a.warmup:]})
        of = {(x["round"], x["arm"]): x["median_s"] for x in runs if x["delay_ms"] == d}
        paired = statistics.median(of[(r, "adaptive")] / of[(r, "1f1b")] for r in range(a.rounds))
        summary[str(d)] = {**med, "paired_ratio": paired, "adaptive_k_after_warmup": ks}
        rows.append(f"| {d:g} | {med['1f1b'] * 1e3:.1f} | {med['adaptive'] * 1e3:.1f} | "
                    f"{med['adaptive'] / med['1f1b'] - 1:+.1%} | {paired - 1:+.1%} | {ks} |")
    command = " ".join(["PYTHONPATH=. python -m evaluation.adaptive_kfkb", *sys.argv[1:]])
    lines = ["# Adaptive kFkB on gloo: a throttled link, fixed 1F1B against `tag execute --adaptive-k`", "",
             *header_lines(command, machine_line()), "",
             f"{a.model}, batch {a.batch}, {a.stages} stages on {a.stages} gloo CPU ranks (one op-group cut "
             f"of {per} of {a.graph.num_groups} each), {a.micro} micro-batches, SGD; {a.rounds} interleaved "
             f"rounds of {a.warmup} warm-up + {a.steps} timed iterations per arm; the links of rank(s) {a.throttled} "
             f"hold each message sent the stated ms (`--inject-delay {a.throttled}:MS`). Median over rounds of each "
             "run's median iteration time (the slowest rank's), and of adaptive / 1F1B within a round; block sizes "
             "the adaptive runs chose after the warm-up (`results.json`: every run).", "",
             "| delay ms | 1F1B ms | adaptive ms | adaptive vs 1F1B | paired per round | adaptive k |",
             "|---|---|---|---|---|---|", *rows]
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", {"command": command, "model": a.model, "batch": a.batch, "stages": a.stages,
                                      "throttled": a.throttled,
                                      "micro_batches": a.micro, "summary": summary, "runs": runs})
    write_atomic(out / "README.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: GPT-2 8 x 768 (simulator), the wide MLP (--gloo)")
    ap.add_argument("--batch", type=int, default=None, help="default: 32 (simulator), 64 (--gloo)")
    ap.add_argument("--layout", default="dp=2,pp=4,micro=8")
    ap.add_argument("--iterations", type=int, default=24)
    ap.add_argument("--host-launch", default=None, help="every VM's host_launch (default: the GPU rule's)")
    ap.add_argument("--out", default="simulated", help="the simulator's results folder under results/adaptive-kfkb")
    ap.add_argument("--gloo", action="store_true", help="measure on gloo ranks instead (module docstring)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 20.0], help="ms per message of --throttled")
    ap.add_argument("--throttled", default="0", help="the ranks whose links are throttled (comma-separated)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    if a.gloo:
        a.model, a.batch = a.model or "mlp:in_dim=512,hidden=2048,layers=4", a.batch or 64
        gloo(a)
        return
    a.model, a.batch = a.model or "gpt2:n_layer=8,n_embd=768,n_head=12,seq=256", a.batch or 32
    simulated(a)


def simulated(a) -> None:
    """The simulator's measurement of the module docstring."""
    import sys

    from evaluation.report import header_lines, machine_line
    from tag.io import write_atomic, write_json
    from tag.sim.adaptive import host_seconds

    graph = capture(load_workload(a.model, batch=a.batch), num_groups=16).graph
    raw = yaml.safe_load(open("topologies/cloud-t4.yaml"))
    for m in raw["machines"]:
        if a.host_launch:
            m["host_launch"] = a.host_launch
    free = load_topology(raw)
    costs = CostModel.for_topology(graph, free)
    plan = layout_plan(graph, free, parse_layout(a.layout), costs)
    sim = Simulator(graph, free, costs)
    T = sim.run(plan.groups, pipeline=plan.pipeline).iteration_time_s
    hosted = host_seconds(sim, plan)
    free_k = {k: sim.run(plan.groups, pipeline=replace(plan.pipeline, schedule="kfkb", k=k)).iteration_time_s
              for k in (1, 2, 4, 8) if k <= plan.pipeline.micro_batches}
    print(f"{a.model} batch {a.batch} {a.layout} on cloud-t4: free 1F1B iteration T = {T * 1e3:.1f} ms; "
          f"free kFkB ms {({k: round(t * 1e3, 2) for k, t in free_k.items()})}; stage seconds {hosted}", flush=True)
    rows, out = [], {}
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
        ks = [i.k for i in ada]
        out[name] = {"background": bg, "1f1b_s": fixed, "adaptive_s": total, "k": ks,
                     "transfer_s": [i.transfer_s for i in ada]}
        print(f"{name:12s} 1F1B {fixed:8.3f} s  adaptive {total:8.3f} s  ({total / fixed - 1:+.1%})  k {ks}", flush=True)
        rows.append(f"| {name} | {fixed:.3f} | {total:.3f} | {total / fixed - 1:+.1%} | {' '.join(map(str, ks))} |")
    host = raw["machines"][0].get("host_launch", "the GPU rule's default")
    command = " ".join(["PYTHONPATH=. python -m evaluation.adaptive_kfkb", *sys.argv[1:]])
    lines = ["# Adaptive kFkB in the simulator: cloud-t4 with a shared inter-VM network", "",
             *header_lines(command, machine_line()), "",
             f"{a.model}, batch {a.batch}, `{a.layout}` on cloud-t4 (4 VMs of 2 T4s, 10 Gbit/s; host launch: {host}), "
             f"{a.iterations} iterations back to back on each background trace's clock (`tag.sim.adaptive.replay`), "
             "every VM NIC carrying the trace's share of other traffic (the gradient all-reduces across VMs slowed "
             f"as the pipeline's messages). Free network: 1F1B iteration T = {T * 1e3:.1f} ms; fixed kFkB per k "
             + ", ".join(f"k={k} {t * 1e3:.1f} ms" for k, t in free_k.items()) + ". Traces in units of T: `const0.8` 80% "
             "of every NIC taken throughout, `periodic0.9` 90% for 2T of every 4T, `preempt` free until 3T, 90% to "
             "10T, 50% to 16T, free to 20T, 95% after. Summed seconds of the iterations, fixed 1F1B and adaptive "
             "(the block sizes per iteration; `results.json`: the rule's measured crossing seconds too).", "",
             "| trace | 1F1B s | adaptive s | adaptive vs 1F1B | adaptive k per iteration |", "|---|---|---|---|---|", *rows]
    dest = Path(__file__).resolve().parents[0] / "results" / "adaptive-kfkb" / a.out
    dest.mkdir(parents=True, exist_ok=True)
    write_json(dest / "results.json", {"command": command, "model": a.model, "batch": a.batch, "layout": a.layout,
                                       "host_launch": host, "free_1f1b_s": T, "free_kfkb_s": free_k,
                                       "stage_seconds": None if hosted is None else
                                       {"fwd_s": hosted[0], "bwd_s": hosted[1], "host": [vars(h) for h in hosted[2]]},
                                       "traces": out})
    write_atomic(dest / "README.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
