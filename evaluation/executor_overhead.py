"""`tag execute` against plain PyTorch, side by side in one run: step time and peak memory.

Per model and round, interleaved (eager, tag single-device, DDP, tag data-parallel, then the next
round), each a fresh set of processes running ``--steps`` timed iterations after ``--warmup``:

* ``eager``: one process, ``model(*inputs)``, ``loss.backward()``, ``torch.optim.Adam(foreach=True)``
  (the multi-tensor update ``tag execute`` runs; torch's default on CPU is the slower per-tensor
  loop, which would flatter ``tag execute``), ``zero_grad(set_to_none=True)``; the loss read after
  the step;
* ``tag-1``: ``tag execute`` of the plan putting every group on the one device of a one-CPU
  topology; its rank and the eager process run one thread pinned to the first core (on the shared
  2-core development VM two threads made both far noisier: mlp eager 66 ms with two threads,
  11-20 ms with one);
* ``ddp``: ``DistributedDataParallel`` (25 MB buckets, its default; Adam as for eager) on two gloo ranks, each with half
  the batch and one thread, the malloc thresholds of ``tag execute``'s ranks (tag.cost.host), not
  pinned: with tag's pinning and gloo's event threads under ``SCHED_IDLE`` DDP's all-reduces,
  which run during the backward, starved on a loaded host (mlp: 2.04 s per iteration instead of
  9.8 ms unpinned, 2026-11-26, load average 12 on the 2-core VM);
* ``tag-dp``: ``tag execute`` of the even all-reduce plan on ``topologies/local-cpu2.yaml``;
* ``eager-compiled``, ``tag-1-compiled`` (only when named in ``--configs``): ``torch.compile(model)``
  (Inductor) in the eager process, and ``tag execute --compile`` of the tag-1 plan (each fused
  segment compiled); the warm-up iterations hold the compilation. With ``--interleaved`` the
  in-process A/B then alternates all four arms.

An iteration's time runs from a barrier (all ranks) to the end of the optimizer step (the slowest
rank's); a run's figure is the median over its iterations, a configuration's the median over the
rounds, and a ratio the median of the per-round ratios. CPU time: the same for the main thread's
CPU seconds per iteration (``time.thread_time``; a rank reports it per iteration as ``cpu_s``),
which a shared host's other jobs inflate far less than the step time. Memory: the growth of the process's
resident-set high-water mark over the timed run minus the optimizer state it created (what the
iterations need above parameters and optimizer state; the largest rank's; allocator thresholds
pinned so freed memory stays with the process: ``tag.executor.worker.host_memory``).

In-process A/B (``--interleaved ROUNDS``): one more process per model, one thread pinned to the
first core, holds both an eager model and a single-device rank's runtime
(:func:`evaluation.instructions._executor_steps`: the rank's walk without ``tag execute``'s
launcher and barrier) and alternates blocks of ``--block`` iterations of each, in an order
shuffled per round (seed 0), ROUNDS times; the ratio is the median of the per-round ratios (time
and thread CPU time). Alternating blocks of a few iterations cancels what moves the separate
processes' figures (another job's burst, the VM's speed between blocks of seconds): on the 2-core
development VM the per-round ``tag-1 / eager`` ratio of separate 20-step processes ranged over
0.54-1.39 for the 2-4 ms mlp step (``evaluation/results/executor-overhead/mlp-7-rounds-2026-11-26`` at 2ba6bfb).

    PYTHONPATH=. python -m evaluation.executor_overhead [--models mlp gpt2] [--rounds 5] [--steps 20]
        [--configs eager tag-1] [--interleaved 100 --block 10]

writes ``evaluation/results/executor-overhead/{results.json,README.md,plot.png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from evaluation.report import header_lines, machine_line

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "evaluation" / "results" / "executor-overhead"
MODELS = ["mlp", "gpt2", "bert", "vit", "llama", "resnet", "vgg", "mixer", "encoder"]
UNSEEN = {name: f"{REPO / 'evaluation' / 'models' / 'unseen.py'}:{name}" for name in ("mixer", "encoder")}
"""Models outside the zoo (user factories in ``evaluation/models/unseen.py``), by short name."""
CONFIGS = ["eager", "tag-1", "ddp", "tag-dp"]
COMPILED = ["eager-compiled", "tag-1-compiled"]
"""``torch.compile(model)`` (Inductor) in the eager process, and ``tag execute --compile`` of the
tag-1 plan (each fused segment compiled); the warm-up iterations hold the compilation."""


# ---- baselines (run in subprocesses: ``python -m evaluation.executor_overhead --_run JSON``) -----
def _setup(threads: int, slot: int | None = None, slots: int = 1) -> bool:
    import torch

    from tag.cost.host import pin_cores, tune_malloc

    tune_malloc()
    pinned = pin_cores(slot, slots, threads) if slot is not None else None
    torch.set_num_threads(threads)
    return pinned is not None


def _train(model, inputs, opt, steps: int, warmup: int, barrier=None) -> dict:
    """Timed eager iterations; memory growth over them above the optimizer state."""
    from tag.executor.worker import host_memory, optimizer_state_bytes

    rss0 = host_memory(reset_peak=True)
    times, cpu = [], []
    for _ in range(warmup + steps):
        if barrier is not None:
            barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return {"times": times[warmup:], "cpu": cpu[warmup:],
            "peak_above_bytes": host_memory(peak=True) - rss0 - optimizer_state_bytes(opt)}


def run_eager(spec: str, batch: int, steps: int, warmup: int, compiled: bool = False) -> dict:
    import torch

    from tag.workloads import load_workload

    _setup(1, 0, 1)  # as tag-1's rank: one thread on the first core
    wl = load_workload(spec, batch=batch, seed=0)
    opt = torch.optim.Adam(wl.model.parameters(), lr=1e-3, foreach=True)  # as tag execute (CPU default: per tensor)
    model = torch.compile(wl.model) if compiled else wl.model  # (Inductor; compiled in the first iteration)
    return _train(model, wl.inputs, opt, steps, warmup)


def run_ddp(spec: str, batch: int, steps: int, warmup: int, rank: int, world: int, port: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tag.workloads import load_workload

    _setup(1)
    wl = load_workload(spec, batch=batch, seed=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = DistributedDataParallel(wl.model)  # bucket_cap_mb=25
    b = batch // world
    inputs = tuple(x[rank * b:(rank + 1) * b] for x in wl.inputs)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)  # the update tag execute runs
    zero = torch.zeros(1)
    out = _train(model, inputs, opt, steps, warmup, barrier=lambda: dist.all_reduce(zero))
    dist.destroy_process_group()
    return out


def run_interleaved(spec: str, batch: int, rounds: int, block: int, compiled: bool = False) -> dict:
    """Eager and the single-device rank's iteration in this process, in alternating blocks (module
    docstring): per round and configuration, seconds and thread CPU seconds per iteration."""
    import random

    from evaluation.instructions import _executor_steps

    _setup(1, 0, 1)
    steps = _executor_steps(spec, batch, compiled)  # (a few warm-up iterations of each included)
    out = {c: {"times": [], "cpu": []} for c in steps}
    order = list(steps)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for c in order:
            fn = steps[c]
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(block):
                fn()
            out[c]["times"].append((time.perf_counter() - t0) / block)
            out[c]["cpu"].append((time.thread_time() - c0) / block)
    return out


def interleaved(spec: str, batch: int, rounds: int, block: int, compiled: bool = False) -> dict:
    r = _result(_subprocess("interleaved", spec=spec, batch=batch, rounds=rounds, block=block, compiled=compiled))

    def ratio(key, a="tag-1", b="eager"):
        return statistics.median(t / e for e, t in zip(r[b][key], r[a][key]))

    pairs = (("tag-1-compiled", "eager-compiled"), ("eager-compiled", "eager"), ("tag-1-compiled", "tag-1"))
    return {"rounds": rounds, "block": block, "time_ratio": ratio("times"), "cpu_ratio": ratio("cpu"),
            "compiled_time_ratio": {f"{a}/{b}": ratio("times", a, b) for a, b in pairs} if compiled else None,
            "median_time_s": {c: statistics.median(x["times"]) for c, x in r.items()},
            "median_cpu_s": {c: statistics.median(x["cpu"]) for c, x in r.items()}, "runs": r}


def _subprocess(kind: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "evaluation.executor_overhead", "--_run",
                             json.dumps({"kind": kind, **kw})], env=env, stdout=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen) -> dict:
    out, _ = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"baseline process failed with exit code {p.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def eager(spec, batch, steps, warmup, compiled: bool = False) -> dict:
    r = _result(_subprocess("eager", spec=spec, batch=batch, steps=steps, warmup=warmup, compiled=compiled))
    return {"time_s": statistics.median(r["times"]), "cpu_s": statistics.median(r["cpu"]),
            "peak_above_bytes": r["peak_above_bytes"]}


def ddp(spec, batch, steps, warmup) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps = [_subprocess("ddp", spec=spec, batch=batch, steps=steps, warmup=warmup, rank=r, world=2, port=port)
          for r in range(2)]
    rs = [_result(p) for p in ps]
    per_iter = [max(x) for x in zip(*(r["times"] for r in rs))]
    cpu = [max(x) for x in zip(*(r["cpu"] for r in rs))]
    return {"time_s": statistics.median(per_iter), "cpu_s": statistics.median(cpu),
            "peak_above_bytes": max(r["peak_above_bytes"] for r in rs)}


# ---- tag execute -------------------------------------------------------------------------------
def tag_execute(graph, topo_path: str, plan_path: str, spec: str, steps: int, warmup: int, run_dir: Path,
                compile: bool = False) -> dict:
    from tag.executor import ExecuteConfig, execute

    res = execute(ExecuteConfig(spec, topo_path, plan_path, steps=steps, warmup=warmup, run_dir=str(run_dir),
                                threads=1, compile=compile), graph=graph)
    peak = max((r["host_peak_growth_bytes"] or 0) - r["optimizer_state_bytes"] for r in res.ranks)
    cpu = [max(x["cpu_s"] for x in its) for its in zip(*(r["iterations"][warmup:] for r in res.ranks))]
    return {"time_s": res.measured_iteration_time_s, "cpu_s": statistics.median(cpu), "peak_above_bytes": peak,
            "predicted_s": res.predicted_iteration_time_s}


def one_cpu_topology(folder: Path) -> str:
    path = folder / "local-cpu1.yaml"
    path.write_text("# One CPU device: a single-device plan runs one rank on all cores.\n"
                    "name: local-cpu1\nmachines:\n  - name: local\n    gpu: cpu\n    count: 1\n"
                    '    intra_bandwidth: "5 GB/s"\n')
    return str(path)


def plans(graph, folder: Path, name: str) -> dict[str, tuple[str, str]]:
    """config -> (topology path, plan path)."""
    from tag.plan import GroupPlan, new_plan
    from tag.topology import load_topology

    out = {}
    t1 = one_cpu_topology(folder)
    t2 = str(REPO / "topologies" / "local-cpu2.yaml")
    model = name
    for name, topo, devs in (("tag-1", t1, [0]), ("tag-dp", t2, [0, 1])):
        plan = new_plan(graph, load_topology(topo), [GroupPlan(devs, [1.0 / len(devs)] * len(devs)) for _ in range(graph.num_groups)])
        path = folder / f"{model}-{name}.json"
        plan.save(path)
        out[name] = (topo, str(path))
    return out


def measure(models: list[str], batches: dict[str, int], rounds: int, steps: int, warmup: int, groups: int,
            log=print, configs: list[str] = CONFIGS, interleave: int = 0, block: int = 10) -> dict:
    """Per model: the ``configs`` in separate processes, ``rounds`` times (module docstring), and with
    ``interleave`` > 0 the in-process A/B of eager and tag-1 over that many rounds of ``block``
    iterations each."""
    from tag.graph import capture
    from tag.workloads import load_workload

    tmp = Path(tempfile.mkdtemp(prefix="tag-overhead-"))
    setups = {}
    for name in models:
        spec = UNSEEN.get(name, name)
        wl = load_workload(spec, batch=batches.get(name))
        graph = capture(wl, optimizer="adam", num_groups=groups).graph
        setups[name] = (spec, graph, wl.batch_size, plans(graph, tmp, name))
        params = sum(p.nbytes for p in graph.params)
        log(f"{name}: batch {wl.batch_size}, {len(graph.params)} parameters ({params / 2**20:.1f} MiB), "
            f"{graph.num_groups} groups")
    runs: dict[str, dict[str, list[dict]]] = {s: {c: [] for c in configs} for s in models}
    for r in range(rounds):
        for name in models:
            spec, graph, batch, pl = setups[name]
            for c in configs:
                if c in ("eager", "eager-compiled"):
                    x = eager(spec, batch, steps, warmup, compiled=c in COMPILED)
                elif c == "ddp":
                    x = ddp(spec, batch, steps, warmup)
                else:
                    x = tag_execute(graph, *pl[c.removesuffix("-compiled")], spec, steps, warmup, tmp / f"run-{c}",
                                    compile=c in COMPILED)
                runs[name][c].append(x)
                log(f"round {r} {name} {c}: {x['time_s'] * 1e3:.2f} ms, peak above params+state "
                    f"{x['peak_above_bytes'] / 2**20:.1f} MiB")
    out = {}
    for name in models:
        rr = runs[name]

        def ratio(a, b, key="time_s", rr=rr):
            vals = [x[key] / y[key] for x, y in zip(rr.get(a, ()), rr.get(b, ())) if y[key] > 0]
            return statistics.median(vals) if vals else None

        def med(key, rr=rr):
            return {c: statistics.median(x[key] for x in rr[c]) if rr[c] else None for c in configs}

        out[name] = {
            "spec": setups[name][0],
            "batch": setups[name][2],
            "median_time_s": med("time_s"),
            "median_peak_above_bytes": med("peak_above_bytes"),
            "median_cpu_s": med("cpu_s"),
            "time_ratio": {"tag-1/eager": ratio("tag-1", "eager"), "tag-dp/ddp": ratio("tag-dp", "ddp"),
                           "tag-1-compiled/eager-compiled": ratio("tag-1-compiled", "eager-compiled"),
                           "eager-compiled/eager": ratio("eager-compiled", "eager"),
                           "tag-1-compiled/tag-1": ratio("tag-1-compiled", "tag-1")},
            "cpu_ratio": {"tag-1/eager": ratio("tag-1", "eager", "cpu_s"), "tag-dp/ddp": ratio("tag-dp", "ddp", "cpu_s")},
            "memory_ratio": {"tag-1/eager": ratio("tag-1", "eager", "peak_above_bytes"),
                             "tag-dp/ddp": ratio("tag-dp", "ddp", "peak_above_bytes")},
            "runs": rr,
        }
    for name in models if interleave > 0 else ():
        x = out[name]["interleaved"] = interleaved(setups[name][0], setups[name][2], interleave, block,
                                                   compiled=any(c in COMPILED for c in configs))
        log(f"{name} in-process A/B, {interleave} rounds of {block} iterations: tag-1 / eager "
            f"{x['time_ratio']:.3f} (CPU time {x['cpu_ratio']:.3f})")
    return out


def write(results: dict, meta: dict, out: Path) -> None:
    from tag.io import write_json

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", {"meta": meta, "models": results})
    lines = [
        "# `tag execute` against eager PyTorch and DDP (CPU)", "",
        *header_lines(meta["command"], machine_line()), "",
        f"{meta['date']}, commit {meta['commit']}, torch {meta['torch']}, {meta['cpus']} CPUs (shared with "
        "other jobs: interleaved rounds, medians). Eager and `tag-1` run one process, one thread pinned to "
        "core 0; DDP and `tag-dp` two gloo ranks with one core each. Module docstring of `evaluation/executor_overhead.py`: "
        "what is timed and how memory is read.", "",
        "| model (batch) | eager ms | tag-1 ms | tag-1 / eager | DDP ms | tag-dp ms | tag-dp / DDP | "
        "CPU-time ratios tag-1 / eager, tag-dp / DDP | memory above params+state, MiB: eager / tag-1 / DDP / tag-dp |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    def f(x, scale=1.0, fmt=".3f"):
        return "-" if x is None else f"{x * scale:{fmt}}"

    for spec, r in results.items():
        t, m, q, c = r["median_time_s"], r["median_peak_above_bytes"], r["time_ratio"], r["cpu_ratio"]
        lines.append(f"| {spec} ({r['batch']}) | {f(t.get('eager'), 1e3, '.2f')} | {f(t.get('tag-1'), 1e3, '.2f')} | "
                     f"{f(q['tag-1/eager'])} | {f(t.get('ddp'), 1e3, '.2f')} | {f(t.get('tag-dp'), 1e3, '.2f')} | "
                     f"{f(q['tag-dp/ddp'])} | {f(c['tag-1/eager'])}, {f(c['tag-dp/ddp'])} | "
                     + " / ".join(f(m.get(c), 2**-20, ".1f") for c in CONFIGS) + " |")
    if any(r["median_time_s"].get(c) for r in results.values() for c in COMPILED):
        lines += ["", "Compiled (`torch.compile(model)` in the eager process; `tag execute --compile` of the tag-1 "
                  "plan; the warm-up iterations hold the compilation):", "",
                  "| model (batch) | eager ms | compiled eager ms | tag-1 ms | tag-1 --compile ms | "
                  "tag-1 --compile / compiled eager | compiled / eager: eager, tag-1 |", "|---|---|---|---|---|---|---|"]
        for spec, r in results.items():
            t, q = r["median_time_s"], r["time_ratio"]
            lines.append(f"| {spec} ({r['batch']}) | {f(t.get('eager'), 1e3, '.2f')} | "
                         f"{f(t.get('eager-compiled'), 1e3, '.2f')} | {f(t.get('tag-1'), 1e3, '.2f')} | "
                         f"{f(t.get('tag-1-compiled'), 1e3, '.2f')} | {f(q.get('tag-1-compiled/eager-compiled'))} | "
                         f"{f(q.get('eager-compiled/eager'))}, {f(q.get('tag-1-compiled/tag-1'))} |")
    ab = {spec: r["interleaved"] for spec, r in results.items() if "interleaved" in r}
    if ab:
        lines += ["", "In-process A/B (eager and the rank's iteration alternating in one process; module docstring):", "",
                  "| model | rounds x iterations | eager ms | tag-1 ms | tag-1 / eager | CPU time: eager ms, tag-1 ms, ratio |",
                  "|---|---|---|---|---|---|"]
        for spec, x in ab.items():
            t, c = x["median_time_s"], x["median_cpu_s"]
            lines.append(f"| {spec} | {x['rounds']} x {x['block']} | {t['eager'] * 1e3:.3f} | {t['tag-1'] * 1e3:.3f} | "
                         f"{x['time_ratio']:.3f} | {c['eager'] * 1e3:.3f}, {c['tag-1'] * 1e3:.3f}, {x['cpu_ratio']:.3f} |")
        abc = {spec: x for spec, x in ab.items() if x.get("compiled_time_ratio")}
        if abc:
            lines += ["", "In-process A/B with the compiled arms (`torch.compile(model)`, the rank with "
                      "`compiled=True`; the same rounds and blocks, compiled before the first round):", "",
                      "| model | compiled eager ms | tag-1 --compile ms | tag-1 --compile / compiled eager | "
                      "compiled eager / eager | tag-1 --compile / tag-1 |", "|---|---|---|---|---|---|"]
            for spec, x in abc.items():
                t, q = x["median_time_s"], x["compiled_time_ratio"]
                lines.append(f"| {spec} | {t['eager-compiled'] * 1e3:.3f} | {t['tag-1-compiled'] * 1e3:.3f} | "
                             f"{q['tag-1-compiled/eager-compiled']:.3f} | {q['eager-compiled/eager']:.3f} | "
                             f"{q['tag-1-compiled/tag-1']:.3f} |")
    lines += ["", "CPU time: the main thread's CPU seconds per iteration (`time.thread_time`; the slowest rank's), "
              "medians and ratios as for the step time: what each configuration computes, apart from waits and "
              "from the time other jobs on a shared host take from it.", "",
              f"Load average (1 min) at the start / end of the run: {meta.get('load', '?')}.", "",
              "Targets (issue 26): tag-1 <= 1.10x eager in time and memory, tag-dp <= 1.10x DDP.", ""]
    (out / "README.md").write_text("\n".join(lines))
    _plot(results, out / "plot.png")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, title in ((axes[0], "time_ratio", "step time"), (axes[1], "memory_ratio", "peak memory above params+state")):
        xs = range(len(specs))
        a = [results[s][key]["tag-1/eager"] or 0 for s in specs]
        b = [results[s][key]["tag-dp/ddp"] or 0 for s in specs]
        ax.bar([x - 0.2 for x in xs], a, 0.4, label="tag-1 / eager")
        ax.bar([x + 0.2 for x in xs], b, 0.4, label="tag-dp / DDP")
        ax.axhline(1.10, color="k", ls="--", lw=1, label="target 1.10")
        ax.set_xticks(list(xs), specs)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=MODELS,
                   help="zoo names, or " + " / ".join(UNSEEN) + " (user factories outside the zoo)")
    p.add_argument("--batch", nargs="*", default=[], metavar="MODEL=B", help="global batch per model (default: the zoo's)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--groups", type=int, default=48)
    p.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS + COMPILED,
                   help="configurations run in separate processes (default: all)")
    p.add_argument("--interleaved", type=int, default=0, metavar="ROUNDS",
                   help="also the in-process A/B of eager and tag-1, this many rounds (0: not run)")
    p.add_argument("--block", type=int, default=10, help="iterations per block of the in-process A/B")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--_run", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._run:
        kw = json.loads(a._run)
        kind = kw.pop("kind")
        run = {"eager": run_eager, "ddp": run_ddp, "interleaved": run_interleaved}[kind]
        print(json.dumps(run(**kw)))
        return 0
    import torch

    batches = {k: int(v) for k, v in (x.split("=", 1) for x in a.batch)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    meta = {"command": "PYTHONPATH=. python -m evaluation.executor_overhead " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": time.strftime("%Y-%m-%d"), "commit": commit, "torch": torch.__version__, "cpus": os.cpu_count(),
            "rounds": a.rounds, "steps": a.steps, "warmup": a.warmup, "groups": a.groups,
            "configs": a.configs, "interleaved": a.interleaved, "block": a.block}
    load0 = os.getloadavg()[0]
    results = measure(a.models, batches, a.rounds, a.steps, a.warmup, a.groups,
                      log=lambda m: print(m, file=sys.stderr, flush=True), configs=a.configs,
                      interleave=a.interleaved, block=a.block)
    meta["load"] = f"{load0:.1f} / {os.getloadavg()[0]:.1f}"
    write(results, meta, Path(a.out))
    print((Path(a.out) / "README.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
