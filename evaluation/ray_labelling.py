"""Labelling on Ray against this machine's process pool: pairs per minute with 1 and 2 workers,
the per-task overhead of each backend, and from them the expected wall time of the shipped
predictor's recipe (``tag train`` defaults) on N machines.

    PYTHONPATH=. .venv/bin/python -m evaluation.ray_labelling [--pairs 6] [--tasks 200]
        [--out evaluation/results/ray-labelling]

* Throughput: the first ``--pairs`` pairs of the recipe's round-0 stream (seed 0, a quarter at
  scale, full inputs, every action of 8 decisions simulated) labelled by the local pool and by a
  Ray cluster on this machine (127.0.0.1), each with 1 and 2 workers (Ray: ``num_cpus``), from
  the same captured graphs (capture excluded, timed once); the four runs' labels must be equal.
* Overhead: ``--tasks`` empty tasks (:func:`tag.dispatch.probe`) per backend and worker count,
  after a warm-up job that starts the workers: wall seconds per task.
* Expected wall time on N machines of C cores: the recipe's own log at 8db091a (2026-11-27,
  2 local workers on this VM: labelling 485 s, fitting 229 s, plan head 371 s; both of the last
  run in the driver) with the labelling's work (485 s x 2 workers) spread over N x C workers,
  plus the overhead per pair and a Ray job's start per round, no round shorter than the slowest
  measured pair.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported: a 127.0.0.1 node
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

RECIPE_LOG = {"commit": "8db091a", "label_s": 212.2 + 158.7 + 113.6, "fit_s": 55.9 + 77.5 + 96.1,
              "plan_head_s": 371.4, "pairs": 400, "rounds": 3, "workers": 2}
"""The shipped recipe's run (evaluation/results/planner-bench-planhead/refit-2026-11-27/train-log.jsonl
at 8db091a): seconds of its three labelling jobs, its three fits and its plan head."""
MACHINES = (1, 2, 4, 8, 16)
CORES = 16
"""Cores per machine of the projection (a worker per core)."""


def _ray_init(cpus: int):
    import ray
    ray.shutdown()
    ray.init(address="local", include_dashboard=False, num_cpus=cpus, _node_ip_address="127.0.0.1",
             log_to_driver=False, configure_logging=False)


def _backends():
    from tag.dispatch import LOCAL_RAY, Backend
    for name, workers in (("local", 1), ("local", 2), ("ray", 1), ("ray", 2)):
        yield name, workers, (Backend(workers=workers) if name == "local" else Backend(ray=LOCAL_RAY))


def label_runs(pairs: int, work: Path) -> tuple[list[dict], float]:
    from tag.data.generate import (
        GenConfig,
        _graph_texts,  # generate's capture job alone, timed apart
        generate,
    )
    from tag.dispatch import Backend
    from tag.training.config import RECIPE_GEN

    graphs = work / "capture" / "graphs"
    cfg = GenConfig(**{**RECIPE_GEN, "samples": pairs, "seed": 0})
    t0 = time.perf_counter()
    _graph_texts(work / "capture", cfg, list(range(pairs)), Backend(), False, None)
    capture_s = time.perf_counter() - t0
    rows, labels = [], {}
    for name, workers, backend in _backends():
        if name == "ray":
            _ray_init(workers)
        root = work / f"{name}{workers}"
        t0 = time.perf_counter()
        stats = generate(root, GenConfig(**{**cfg.__dict__, "workers": workers}), graphs=graphs, progress=False,
                         backend=backend)
        wall = time.perf_counter() - t0
        recs = {p.name: json.loads(p.read_text()) for p in sorted((root / "raw").glob("*.json"))}
        labels[(name, workers)] = {k: {f: v for f, v in r.items() if f not in ("seconds", "label_seconds")}
                                   for k, r in recs.items()}
        secs = [r["seconds"] for r in recs.values()]
        rows.append({"backend": name, "workers": workers, "pairs": stats["samples"], "errors": stats["errors"],
                     "wall_s": round(wall, 2), "pairs_per_min": round(60 * stats["samples"] / wall, 2),
                     "pair_s_sum": round(sum(secs), 2), "pair_s_max": round(max(secs), 2)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    first = next(iter(labels.values()))
    for row, lab in zip(rows, labels.values()):
        row["labels_equal"] = lab == first
    return rows, capture_s


def overhead_runs(tasks: int) -> list[dict]:
    from tag.dispatch import probe, probe_setup, run_tasks
    rows = []
    for name, workers, backend in _backends():
        if name == "ray":
            _ray_init(workers)
        t0 = time.perf_counter()
        list(run_tasks(probe, range(2 * workers), setup=probe_setup, shared=None, backend=backend, desc="warm",
                       progress=False))
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = list(run_tasks(probe, range(tasks), setup=probe_setup, shared=None, backend=backend, desc="probe",
                              progress=False))
        wall = time.perf_counter() - t0
        assert len(outs) == tasks and all(o.error is None for o in outs)
        rows.append({"backend": name, "workers": workers, "tasks": tasks, "start_s": round(start_s, 2),
                     "wall_s": round(wall, 4), "ms_per_task": round(1e3 * wall / tasks, 3)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def projection(label_rows: list[dict], over_rows: list[dict]) -> dict:
    """Expected wall seconds of the recipe on N machines of :data:`CORES` cores (see the module docstring)."""
    by = {(r["backend"], r["workers"]): r for r in label_rows}
    work_1 = RECIPE_LOG["label_s"] * RECIPE_LOG["workers"]  # worker-seconds: both busy throughout (an upper bound)
    task_s = by_backend(over_rows, "ray", 1)["ms_per_task"] / 1e3
    one = by[("ray", 1)]
    slowest = max(by[(b, 1)]["pair_s_max"] for b in ("local", "ray"))  # the least contended runs
    job_start = max(0.0, one["wall_s"] - one["pair_s_sum"])  # a Ray job's start: workers import tag, torch
    serial = RECIPE_LOG["fit_s"] + RECIPE_LOG["plan_head_s"]
    rows = []
    for n in MACHINES:
        slots = n * CORES
        # no round ends before its slowest pair; every round's jobs start their workers
        label = max((work_1 + RECIPE_LOG["pairs"] * task_s) / slots, RECIPE_LOG["rounds"] * slowest)
        label += RECIPE_LOG["rounds"] * job_start
        label_10x = max(10 * (work_1 + RECIPE_LOG["pairs"] * task_s) / slots, RECIPE_LOG["rounds"] * slowest)
        rows.append({"machines": n, "workers": slots, "label_s": round(label, 1), "serial_s": round(serial, 1),
                     "total_s": round(label + serial, 1),
                     "label_10x_s": round(label_10x + RECIPE_LOG["rounds"] * job_start, 1)})
    return {"ratio_2_to_1": {b: round(by[(b, 2)]["pairs_per_min"] / by[(b, 1)]["pairs_per_min"], 3)
                             for b in ("local", "ray")},
            "label_work_1_worker_s": round(work_1, 1), "task_overhead_s": task_s, "slowest_pair_s": slowest,
            "job_start_s": round(job_start, 1), "rows": rows}


def by_backend(rows: list[dict], backend: str, workers: int) -> dict:
    return next(r for r in rows if (r["backend"], r["workers"]) == (backend, workers))


def _name(row: dict) -> str:
    return "local (in process)" if (row["backend"], row["workers"]) == ("local", 1) else row["backend"]


def write(out: Path, res: dict, command: str) -> None:
    from evaluation.report import _table, header_table, machine_line, run_fields
    from tag.io import write_atomic, write_json

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", res)
    machine = (f"{machine_line()}, shared with other jobs (load {res['load_before']:.1f} before the run, "
               f"{res['load_after']:.1f} after)")
    lab = [[_name(r), str(r["workers"]), str(r["pairs"]), f"{r['wall_s']:.1f}", f"{r['pairs_per_min']:.2f}",
            f"{r['pair_s_max']:.1f}", "yes" if r["labels_equal"] else "NO"] for r in res["labelling"]]
    ovh = [[_name(r), str(r["workers"]), str(r["tasks"]), f"{r['start_s']:.2f}", f"{r['ms_per_task']:.3f}"]
           for r in res["overhead"]]
    p = res["projection"]
    proj = [[str(r["machines"]), str(r["workers"]), f"{r['label_s']:.0f}", f"{r['serial_s']:.0f}",
             f"{r['total_s'] / 60:.1f}", f"{r['label_10x_s']:.0f}"] for r in p["rows"]]
    lines = ["# Labelling on Ray and on the local pool", "", *header_table(run_fields(command, machine)), "",
             f"The first {res['pairs']} pairs of the shipped recipe's round-0 stream (seed 0; graphs captured "
             f"once beforehand, {res['capture_s']:.0f} s), labelled on each backend (Ray: a cluster on this "
             "machine, 127.0.0.1; local with 2 workers: a spawned pool, its start included). This VM has 2 "
             "cores shared with other jobs, so 2 workers are not 2x one; the figures are wall seconds of one run "
             "each.", "",
             _table(["backend", "workers", "pairs", "wall s", "pairs/min", "slowest pair s", "labels equal"], lab),
             "", f"Per-task overhead: {res['tasks']} empty tasks after a warm-up job (start s: the warm-up, "
             "workers started and their first tasks run).", "",
             _table(["backend", "workers", "tasks", "start s", "ms per task"], ovh), "",
             "## Expected wall time of the shipped recipe on N machines", "",
             f"The recipe's own run at {RECIPE_LOG['commit']} (2026-11-27, 2 local workers on this VM): "
             f"labelling {RECIPE_LOG['label_s']:.0f} s, fitting {RECIPE_LOG['fit_s']:.0f} s, plan head "
             f"{RECIPE_LOG['plan_head_s']:.0f} s (fitting and plan head run in the driver, not distributed). "
             f"Labelling work: {RECIPE_LOG['label_s']:.0f} s x 2 workers = {p['label_work_1_worker_s']:.0f} "
             f"worker-seconds (both busy throughout: an upper bound), spread over N x {CORES} workers, plus "
             f"{1e3 * p['task_overhead_s']:.1f} ms per pair (Ray, above), no round shorter than the slowest "
             f"measured pair ({p['slowest_pair_s']:.0f} s, 1 worker), plus {p['job_start_s']:.0f} s per round "
             "for a Ray job's start (the 1-worker Ray run's wall less its pairs' seconds). Measured 2-worker / "
             f"1-worker throughput on this VM: local {p['ratio_2_to_1']['local']:.2f}, Ray "
             f"{p['ratio_2_to_1']['ray']:.2f} (the 2 cores were shared with other jobs: below 2 by contention, "
             "not by the backend).", "",
             _table(["machines", "workers", "labelling s", "fit + plan head s", "total min",
                     "labelling s, 10x pairs"], proj), "",
             "From one 16-core machine on, the recipe's fitting and plan head (in the driver) are most of its "
             "wall time; more machines pay for recipes of thousands of pairs (last column: labelling alone, "
             "fitting grows with the data too).", ""]
    write_atomic(out / "README.md", "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--out", default="evaluation/results/ray-labelling")
    args = ap.parse_args(argv)
    command = "python -m evaluation.ray_labelling " + " ".join(argv if argv is not None else sys.argv[1:])
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        label_rows, capture_s = label_runs(args.pairs, Path(d))
    over_rows = overhead_runs(args.tasks)
    import ray
    ray.shutdown()
    res = {"pairs": args.pairs, "tasks": args.tasks, "capture_s": round(capture_s, 1), "load_before": load,
           "load_after": os.getloadavg()[0],
           "labelling": label_rows, "overhead": over_rows, "projection": projection(label_rows, over_rows),
           "recipe_log": RECIPE_LOG}
    write(Path(args.out), res, command.strip())
    print(Path(args.out) / "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
