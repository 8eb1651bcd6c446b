"""Local fidelity: measured single-process training iterations on this CPU vs the simulator.

For every zoo model (default size and batch): the iteration is run for real the way the executor
runs it on one device -- the joint graph exported at the batch, cut into (group, phase) stages,
forward stages in group order, backward stages in reverse, then one ``torch.optim`` step over all
parameters -- and timed end to end (median of ``--iters`` after warm-up). The prediction is the
simulator's iteration time for the single-device plan on a one-CPU topology, from the profile
database (``--profiles``, default data/profiles; ``--fresh`` profiles each model first into a
temporary folder, right before measuring it, which is more robust on a shared machine).

A second column checks interpolation: the measured iteration at an unprofiled per-replica batch
(``3B/4`` rounded, when it is not a profiled size) against the cost model's interpolated times.

Times are taken with the profiler's clock (:func:`tag.cost.profiler.timing_clock`): with one
thread (the default here) the thread's CPU time, so other jobs on a shared machine do not
inflate either side.

    .venv/bin/python evaluation/fidelity.py [--models mlp,gpt2] [--fresh] [--iters 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

ZOO = ["mlp", "gpt2", "bert", "vit", "resnet", "vgg"]


def measure(graph, wl, batch: int, iters: int, warmup: int, reference=None) -> float:
    """Median seconds of one real iteration (stages + optimizer step) at ``batch`` samples."""
    import torch

    from tag.cost.profiler import build_iteration, make_optimizer, timing_clock

    it = build_iteration(graph, wl.model, wl.make_inputs, batch, torch.device("cpu"), reference)
    grad_node = {p.name: graph.tensors[p.grad].name for p in graph.params}
    params = {n: torch.nn.Parameter(v.clone()) for n, v in it.params.items() if n in grad_node}
    opt = make_optimizer(graph.optimizer, list(params.values()))
    clock = timing_clock(torch.device("cpu"))
    times = []
    for i in range(warmup + iters):
        t0 = clock()
        env = it.run(lambda: None)
        for n, p in params.items():
            p.grad = env[grad_node[n]].reshape(p.shape)
        opt.step()
        for p in params.values():
            p.grad = None
        if i >= warmup:
            times.append(clock() - t0)
    return statistics.median(times)


def cpu_topology(threads: int):
    """Local CPU devices of ``threads`` threads each (the device type is ``cpu-<threads>t``)."""
    import os

    from tag.topology import load_topology

    n = max(1, (os.cpu_count() or 1) // threads)
    m = {"name": "local", "gpu": "cpu", "count": n}
    if n > 1:
        m["intra_bandwidth"] = "5 GB/s"
    return load_topology({"name": f"local-cpu{n}", "machines": [m]})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--profiles", default=None, help="profile database root (default data/profiles)")
    ap.add_argument("--fresh", action="store_true", help="profile each model first (temporary database)")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (default 1: robust on a shared machine; device type cpu-<threads>t)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the table as JSON here")
    args = ap.parse_args(argv)

    import torch

    from tag.cost.baselines import best_single_device
    from tag.cost.model import CostModel
    from tag.cost.profiler import StructureMismatch, profile_model, structure
    from tag.graph import capture
    from tag.sim import Simulator
    from tag.workloads import load_workload

    torch.set_num_threads(args.threads)
    topo = cpu_topology(args.threads)
    tmp = tempfile.TemporaryDirectory() if args.fresh else None
    root = tmp.name if tmp else args.profiles
    rows = []
    for name in args.models.split(","):
        wl = load_workload(name)
        cap = capture(wl)
        graph = cap.graph
        if args.fresh:
            profile_model(name, captured=cap, log=lambda m: None).save(root)
        costs = CostModel.for_topology(graph, topo, root)
        if not costs.source(0).startswith("profile"):
            print(f"{name}: no profile for {costs.device_type(0)} in {root or 'data/profiles'}; "
                  f"run `tag profile --model {name}` first", file=sys.stderr)
            continue
        pred = Simulator(graph, topo, costs).run(best_single_device(graph, topo, costs).groups).iteration_time_s
        meas = measure(graph, wl, graph.batch_size, args.iters, args.warmup)
        row = {"model": name, "batch": graph.batch_size, "measured_s": meas, "predicted_s": pred,
               "error": (pred - meas) / meas}
        bi = max(1, round(graph.batch_size * 3 / 4))
        prof_batches = _profiled_batches(root, costs.device_type(0), graph.signature())
        if bi not in prof_batches and bi != graph.batch_size:
            pi = sum(costs.group_time(g, ph, 0, bi) for g in range(graph.num_groups) for ph in ("fwd", "bwd", "opt"))
            pi += costs.step_overhead(0)
            try:
                mi = measure(graph, wl, bi, args.iters, args.warmup, structure(cap.joint))
            except StructureMismatch:
                mi = float("nan")
            row.update({"interp_batch": bi, "interp_measured_s": mi, "interp_predicted_s": pi,
                        "interp_error": (pi - mi) / mi})
        rows.append(row)
        print(_fmt(row), flush=True)
    if rows:
        errs = [abs(r["error"]) for r in rows]
        print(f"median |error| {statistics.median(errs) * 100:.1f}%, max {max(errs) * 100:.1f}% "
              f"over {len(rows)} models")
    if args.json:
        from tag.io import write_json

        write_json(args.json, rows)
    if tmp:
        tmp.cleanup()
    return 0


def _profiled_batches(root, dtype, sig) -> list[int]:
    from tag.cost.profile import default_profile_dir, find_profile

    p = find_profile(root or default_profile_dir(), dtype, sig)
    return p.batches if p else []


def _fmt(r: dict) -> str:
    s = (f"{r['model']:<7} batch {r['batch']:>3}: measured {r['measured_s'] * 1e3:8.2f} ms, "
         f"predicted {r['predicted_s'] * 1e3:8.2f} ms, error {r['error'] * 100:+6.1f}%")
    if "interp_batch" in r:
        s += (f" | batch {r['interp_batch']} (interpolated): measured {r['interp_measured_s'] * 1e3:.2f} ms, "
              f"predicted {r['interp_predicted_s'] * 1e3:.2f} ms, error {r['interp_error'] * 100:+.1f}%")
    return s


if __name__ == "__main__":
    sys.exit(main())
