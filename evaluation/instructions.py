"""Instructions per step, counted by valgrind (callgrind): comparisons a shared host cannot blur.

Wall and CPU time on the 2-core development VM move by 2x between rounds when other jobs run
(``evaluation/results/executor-overhead``); the number of instructions a step executes does not.
Each configuration runs in one process under ``valgrind --tool=callgrind --instr-atstart=no``:
set-up (imports, capture, export) runs uninstrumented; then, per request, instrumentation is
switched on (``callgrind_control -i on``), the counters zeroed, N steps run, and the counters
dumped (``callgrind_control -d``). Instructions are not time (cache misses, memory bandwidth and
BLAS threading are not in them), but a fixed per-step cost shows in them exactly. ``--cache-sim``
adds valgrind's simulated cache misses and its estimate of cycles (instruction-cache misses showed
what instructions did not: 2026-11-26, the executor's ``torch.ops`` calls).

* ``executor``: one iteration of eager PyTorch (``model(*inputs)``, ``backward``,
  ``Adam(foreach=True)``) against one iteration of ``tag execute``'s single-device plan as its
  rank walks it (:class:`tag.executor.runtime.RankRuntime`: fused segments, update), in one process;
* ``sim``: one :meth:`Simulator.run` of the ``evaluation/sim_speed.py`` workloads, in this tree
  and in another one (``--vs``, e.g. a git worktree of an older commit).

    PYTHONPATH=. python -m evaluation.instructions executor [--models mlp gpt2] [--steps 20] [--cache-sim]
    PYTHONPATH=. python -m evaluation.instructions sim --vs ../old-tree [--workloads dp:20 mcts:100]

Needs ``valgrind`` and ``callgrind_control`` on PATH (a minute or more per configuration: the
set-up runs under valgrind too).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ---- the served process (runs under valgrind) -------------------------------------------------
def _serve(steps: dict) -> None:
    """Tell the controller we are ready, then run ``NAME COUNT`` requests; ``done`` after each."""
    print("ready", flush=True)
    for line in sys.stdin:
        name, count = line.split()
        fn = steps[name]
        for _ in range(int(count)):
            fn()
        print("done", flush=True)


def _executor_steps(spec: str, batch: int | None = None, compiled: bool = False) -> dict:
    """Iteration functions of an eager model (``eager``) and of a single-device rank (``tag-1``),
    each warmed up; ``compiled``: also ``torch.compile(model)`` (``eager-compiled``) and the rank
    with its segments compiled (``tag-1-compiled``), each on its own copy of the weights."""
    import torch

    from evaluation.executor_overhead import UNSEEN, one_cpu_topology
    from tag.cost.host import tune_malloc
    from tag.executor.runtime import RankRuntime, export_at
    from tag.graph import capture
    from tag.parallel import build_schedule
    from tag.plan import GroupPlan, new_plan
    from tag.topology import load_topology
    from tag.workloads import load_workload

    tune_malloc()
    torch.set_num_threads(1)
    spec = UNSEEN.get(spec, spec)
    topo = load_topology(one_cpu_topology(Path(tempfile.mkdtemp(prefix="tag-instr-"))))
    wl = load_workload(spec, batch=batch, seed=0)
    graph = capture(wl, optimizer="adam", num_groups=48).graph
    plan = new_plan(graph, topo, [GroupPlan([0], [1.0]) for _ in range(graph.num_groups)])
    sched = build_schedule(graph, plan, topo.machine_of, None)

    def rank(compile_: bool):
        twin = load_workload(spec, batch=batch, seed=0)  # the rank's own copy of the weights
        rt = RankRuntime(0, sched, tuple(twin.inputs), {twin.batch_size: export_at(twin.model, twin.make_inputs,
                                                                                   twin.batch_size)}, "adam",
                         compiled=compile_)

        def tag():  # the worker's walk (tag.executor.worker.run_rank) without its communication
            rt.begin_iteration()
            for i in range(len(sched.steps)):
                if rt.covers(i):
                    rt.run_segment(i)
                else:
                    rt.release(i)
            rt.update()
        return tag

    def model(w, compile_: bool):
        m = torch.compile(w.model) if compile_ else w.model
        opt = torch.optim.Adam(w.model.parameters(), lr=1e-3, foreach=True)

        def eager():
            loss = m(*w.inputs)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            float(loss.detach())
        return eager

    arms = {"eager": model(wl, False), "tag-1": rank(False)}
    if compiled:
        arms |= {"eager-compiled": model(load_workload(spec, batch=batch, seed=0), True), "tag-1-compiled": rank(True)}
    for _ in range(3):
        for fn in arms.values():
            fn()
    return arms


def _sim_steps() -> dict:
    import importlib.util

    # this file's sim_speed (the other tree may predate it), with the tree's tag (PYTHONPATH)
    spec = importlib.util.spec_from_file_location("sim_speed", REPO / "evaluation" / "sim_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    build = mod.build

    args = argparse.Namespace(model="gpt2:n_layer=4", batch=32, groups=64, topology="cluster-16gpu-4m")
    _, _, workloads = build(args)
    for fn in workloads.values():
        fn()
    return workloads


# ---- the controller ----------------------------------------------------------------------------
def count(serve_args: list[str], requests: list[tuple[str, int]], tree: Path = REPO,
          events: dict[str, dict[str, float]] | None = None) -> dict[str, float]:
    """Instructions per call of each request ``(name, count)`` in a served process of ``tree``.

    ``events`` given: valgrind simulates the caches too (``--cache-sim=yes``, its model of the
    host's L1 and last-level caches) and ``events[name]`` receives every counter per call
    (``Ir``, ``I1mr``, ``D1mr``, ``D1mw``, ``ILmr``, ``DLmr``, ``DLmw``: instructions, first-level
    misses of instruction reads, data reads and writes, the same for the last level) and ``est``,
    the estimate of cycles ``callgrind_annotate`` uses: Ir + 10 L1 misses + 100 last-level misses."""
    out = Path(tempfile.mkdtemp(prefix="tag-callgrind-")) / "cg"
    # run as a file: the served process imports ``tag`` (and ``evaluation``) from ``tree`` only
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}.%p",
           *(["--cache-sim=yes"] if events is not None else []),
           sys.executable, str(Path(__file__).resolve()), "--_serve", *serve_args]
    p = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    if p.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the served process ({' '.join(serve_args)}) failed before its first request")

    def ctl(*a: str) -> None:
        subprocess.run(["callgrind_control", *a, str(p.pid)], check=True, capture_output=True)

    res: dict[str, float] = {}
    for name, n in requests:
        ctl("-i", "on")
        ctl("-z")
        p.stdin.write(f"{name} {n}\n")
        p.stdin.flush()
        if p.stdout.readline().strip() != "done":
            raise RuntimeError(f"request {name} {n} failed")
        before = set(glob.glob(f"{out}.*"))
        ctl("-d", f"{name}-{n}")
        ctl("-i", "off")
        for _ in range(50):  # the dump is written by the served process
            new = sorted(set(glob.glob(f"{out}.*")) - before)
            if new:
                break
            time.sleep(0.2)
        text = Path(new[-1]).read_text()
        names = re.search(r"^events:\s*(.*)$", text, re.M).group(1).split()
        values = re.search(r"^(?:summary|totals):\s*(.*)$", text, re.M).group(1).split()
        per_call = {k: int(v) / n / sum(1 for r, _ in requests if r == name) for k, v in zip(names, values)}
        res[name] = res.get(name, 0.0) + per_call["Ir"]
        if events is not None:
            per_call["est"] = per_call["Ir"] + 10 * sum(per_call.get(k, 0.0) for k in ("I1mr", "D1mr", "D1mw")) \
                + 100 * sum(per_call.get(k, 0.0) for k in ("ILmr", "DLmr", "DLmw"))
            acc = events.setdefault(name, {})
            for k, v in per_call.items():
                acc[k] = acc.get(k, 0.0) + v
    p.stdin.close()
    p.wait()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", nargs="?", choices=["executor", "sim"])
    ap.add_argument("--models", nargs="+", default=["mlp", "gpt2"], help="executor: zoo names or mixer / encoder")
    ap.add_argument("--steps", type=int, default=20, help="executor: iterations counted per configuration")
    ap.add_argument("--cache-sim", action="store_true",
                    help="executor: simulate the caches too (misses and estimated cycles; slower)")
    ap.add_argument("--vs", default=None, help="sim: another tree to count too (its tag, this script)")
    ap.add_argument("--workloads", nargs="+", default=["dp:20", "mcts:100", "walk:10"], metavar="NAME:N")
    ap.add_argument("--_serve", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._serve is not None:
        _serve(_executor_steps(a._serve[0]) if a._serve else _sim_steps())
        return 0
    if a.what == "executor":
        ev: dict | None = {} if a.cache_sim else None
        head = "| model | eager instructions / iteration | tag-1 | tag-1 / eager |"
        if a.cache_sim:
            head += (" I1 misses eager, tag-1 | D1 misses eager, tag-1 | last-level misses eager, tag-1 |"
                     " estimated cycles eager, tag-1, ratio |")
        print(head + "\n|---|" + "---:|" * (head.count("|") - 2))
        for m in a.models:
            r = count([m], [("eager", a.steps), ("tag-1", a.steps)], events=ev)
            row = f"| {m} | {r['eager'] / 1e6:.2f}M | {r['tag-1'] / 1e6:.2f}M | {r['tag-1'] / r['eager']:.3f} |"
            if ev is not None:
                e, t = ev.pop("eager"), ev.pop("tag-1")

                def pair(keys, e=e, t=t):
                    return ", ".join(f"{sum(x.get(k, 0.0) for k in keys) / 1e3:.1f}k" for x in (e, t))

                row += (f" {pair(['I1mr'])} | {pair(['D1mr', 'D1mw'])} | {pair(['ILmr', 'DLmr', 'DLmw'])} |"
                        f" {e['est'] / 1e6:.2f}M, {t['est'] / 1e6:.2f}M, {t['est'] / e['est']:.3f} |")
            print(row, flush=True)
    elif a.what == "sim":
        reqs = [(w.split(":")[0], int(w.split(":")[1])) for w in a.workloads]
        trees = {"this tree": REPO} | ({"--vs": Path(a.vs).resolve()} if a.vs else {})
        res = {k: count([], reqs, tree) for k, tree in trees.items()}
        print("| workload | " + " | ".join(f"{k} instructions / run" for k in res) + (" | ratio |" if a.vs else " |"))
        print("|---|" + "---:|" * (len(res) + (1 if a.vs else 0)))
        for w, _ in reqs:
            cells = [f"{r[w] / 1e6:.2f}M" for r in res.values()]
            ratio = [f"{res['this tree'][w] / res['--vs'][w]:.3f}"] if a.vs else []
            print(f"| {w} | " + " | ".join(cells + ratio) + " |")
    else:
        ap.error("expected executor or sim")
    return 0


if __name__ == "__main__":
    sys.exit(main())
