"""Check the GPU cost model (:mod:`tag.cost.gpu`) against eager training steps measured on an H200.

The measurements (``tag/cost/gpu_calib/H200.jsonl``, a copy of the shared H200 calibration run:
torch 2.11.0+cu130, 2026-11-26) hold microbenchmarks and eager training steps (Adam, foreach) of
three workloads in fp32 and bf16 autocast. The graphs are captured here (torch 2.13, CPU) from
the same zoo specs and batches; the GPU machine's graph signatures differ (torch versions
decompose a few ops differently), so workloads are matched by zoo spec, batch and precision,
never by signature.

Every rate comes from the microbenchmarks; one constant, the host seconds per kernel launch in an
eager training step (``host_s``), is fitted to steps. **Leave one workload out**: for each
workload, ``host_s`` is fitted to the other two workloads' steps (both precisions; least squares
on log time over a grid) and the held-out workload's fp32 and bf16 steps are predicted.
``--write`` stores the fit on all three workloads in ``tag/cost/gpu_calib/H200-steps.json``
(what ``tag simulate`` uses) and the report in ``evaluation/results/gpu-cost/``.

    PYTHONPATH=. .venv/bin/python -m evaluation.gpu_cost_check --graphs runs/gpu-cost/graphs --write
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

GPU = "H200"
GROUPS = 48
HOST_GRID_S = [x * 1e-7 for x in range(50, 1001)]  # 5 us .. 100 us in 0.1 us steps (searched by bisection)
OUT_DIR = Path("evaluation/results/gpu-cost")


def steps_measured() -> list[dict]:
    from tag.cost.gpu import load_calibration

    return [r for r in load_calibration(GPU) if r.get("kind") == "step"]


def load_graph(spec: str, batch: int, precision: str, cache: Path):
    """The graph of ``spec`` at ``batch`` in ``precision`` (cached as JSON under ``cache``)."""
    from tag.graph import capture
    from tag.graph.ir import OpGraph
    from tag.io import write_atomic
    from tag.workloads import load_workload

    name = spec.replace(':', '_').replace(',', '_').replace('=', '').replace('/', '_')
    path = cache / f"{name}-b{batch}-{precision}.json"
    if path.exists():
        return OpGraph.from_json(path.read_text())
    t0 = time.perf_counter()
    g = capture(load_workload(spec, batch=batch, seed=0), optimizer="adam", num_groups=GROUPS,
                precision=precision).graph
    print(f"captured {spec} {precision} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    write_atomic(path, g.to_json())
    return g


_FEATURES: dict = {}


def _features(graph):
    """The GPU rule's per-op features of ``graph`` under PyTorch's default numerics (built once)."""
    from tag.cost.gpu import Numerics, OpFeatures

    feat = _FEATURES.get(id(graph))
    if feat is None:
        feat = _FEATURES[id(graph)] = OpFeatures.of(graph, Numerics())
    return feat


def predict(graph, rates) -> float:
    """Simulated single-device step (seconds): every stage in turn plus the optimizer's launches."""
    from tag.cost.gpu import stage_table

    return float(stage_table(graph, _features(graph), rates, [graph.batch_size]).sum()) \
        + rates.step_overhead(graph.optimizer)


def fit_host(cases: list[tuple], rates) -> float:
    """``host_s`` on :data:`HOST_GRID_S` minimising the summed squared log error over ``cases``
    ((graph, measured s)). Every prediction grows with ``host_s``, so the loss is convex in it:
    bisection on the sign of its slope between grid neighbours."""
    import dataclasses

    def loss(i: int) -> float:
        r = dataclasses.replace(rates, host_s=HOST_GRID_S[i])
        return sum(math.log(predict(g, r) / s) ** 2 for g, s in cases)

    lo, hi = 0, len(HOST_GRID_S) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if loss(mid + 1) < loss(mid):
            lo = mid + 1 if mid + 1 <= hi else hi
        else:
            hi = mid
    return HOST_GRID_S[min((lo, hi), key=loss)]


def run(cache: Path) -> dict:
    import dataclasses

    from tag.cost.gpu import fitted_rates

    base = fitted_rates(GPU)
    cases = []
    for r in steps_measured():
        g = load_graph(r["spec"], r["batch"], r["precision"], cache)
        cases.append({"spec": r["spec"], "workload": r["spec"].split(":")[0], "batch": r["batch"],
                      "precision": r["precision"], "measured_s": r["s"], "graph": g,
                      "signature_here": g.signature()})
    workloads = sorted({c["workload"] for c in cases})
    folds = {}
    for held in workloads:
        train = [(c["graph"], c["measured_s"]) for c in cases if c["workload"] != held]
        h = fit_host(train, base)
        folds[held] = h
        for c in cases:
            if c["workload"] == held:
                c["host_s_fold"] = h
                c["predicted_s"] = predict(c["graph"], dataclasses.replace(base, host_s=h))
                c["error"] = c["predicted_s"] / c["measured_s"] - 1
    h_all = fit_host([(c["graph"], c["measured_s"]) for c in cases], base)
    for c in cases:
        c["predicted_all_s"] = predict(c["graph"], dataclasses.replace(base, host_s=h_all))
        c["error_all"] = c["predicted_all_s"] / c["measured_s"] - 1
        c["predicted_microbench_host_s"] = predict(c["graph"], dataclasses.replace(base, host_s=base.launch_s))
    rows = [{k: v for k, v in c.items() if k != "graph"} for c in cases]
    return {"gpu": GPU, "host_s_all": h_all, "host_s_folds": folds, "launch_s_microbench": base.launch_s,
            "rates": {"matmul_flops": base.matmul, "conv_flops": base.conv, "bandwidth": base.bandwidth},
            "cases": rows}


def measured_by_class(top_ops: list) -> dict[str, float]:
    """Device seconds per op class (:func:`tag.cost.gpu.op_class`) of an op table's ``top_ops``
    rows ``[aten name, count, host s, device s]`` (:func:`tag.executor.profiling.op_table`;
    multi-tensor ``_foreach_*`` ops are the optimizer's). Empty for tables without device times."""
    from tag.cost.gpu import op_class

    out: dict[str, float] = {}
    for row in top_ops:
        if len(row) < 4:
            return {}
        name = row[0].split("::", 1)[-1]
        cls = "opt" if name.startswith("_foreach") else op_class(f"aten.{name}.default")
        out[cls] = out.get(cls, 0.0) + float(row[3])
    return out


def predicted_by_class(graph, rates) -> dict[str, float]:
    """The rule's device seconds per op class of one step of ``graph`` (``host_s`` not counted)."""
    import numpy as np

    from tag.cost.gpu import OP_CLASSES, op_seconds

    feat = _features(graph)
    t = op_seconds(feat, rates, [graph.batch_size])[:, 0]
    return {c: float(t[feat.cls == i].sum()) for i, c in enumerate(OP_CLASSES) if np.any(feat.cls == i)}


def held_out(files: list[Path], cache: Path) -> list[dict]:
    """Eager steps of ``gpu_check`` result files (``kind: step`` records, not used by any fit)
    predicted with the stored fit: the step, and the device side alone (``host_s`` = 0, against
    the summed kernel time the profiler measured in one more step, ``ops.kernel_s``)."""
    import dataclasses

    from tag.cost.gpu import fitted_rates

    rates = fitted_rates(GPU)
    rows = []
    for f in files:
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r.get("kind") != "step":
                continue
            g = load_graph(r["spec"], r["batch"], r["precision"], cache)
            row = {"file": f.name, "spec": r["spec"], "batch": r["batch"], "precision": r["precision"],
                   "measured_s": r["s"], "predicted_s": predict(g, rates)}
            row["error"] = row["predicted_s"] / row["measured_s"] - 1
            kernel_s = (r.get("ops") or {}).get("kernel_s")
            if kernel_s:
                row["kernel_s"] = kernel_s
                row["predicted_device_s"] = predict(g, dataclasses.replace(rates, host_s=0.0))
                row["device_error"] = row["predicted_device_s"] / kernel_s - 1
                row["kernels"], row["aten_ops"] = r["ops"]["kernels"], r["ops"]["aten_ops"]
                by_class = measured_by_class(r["ops"].get("top_ops", []))
                if by_class:  # op tables since 32700af: per-class device seconds, measured vs rule
                    row["device_by_class"] = {"measured_s": by_class, "predicted_s": predicted_by_class(g, rates)}
            rows.append(row)
    return rows


def write_report(res: dict, command: str) -> None:
    from tag.cost.gpu import CALIB_DIR
    from tag.io import write_atomic, write_json

    fit = {"gpu": GPU, "host_s": res["host_s_all"],
           "fitted_on": [f"{c['spec']} batch {c['batch']} {c['precision']}" for c in res["cases"]],
           "how": "least squares on log step time over 5..100 us (evaluation/gpu_cost_check.py)",
           "command": command}
    write_json(CALIB_DIR / f"{GPU}-steps.json", fit)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    write_json(OUT_DIR / "results.json", res)
    lines = [
        "# GPU cost model against eager H200 training steps",
        "",
        f"Command: `{command}`",
        "",
        "Measurements: `tag/cost/gpu_calib/H200.jsonl` (one NVIDIA H200, torch 2.11.0+cu130, eager steps with "
        "Adam foreach; bf16 = `torch.autocast`). Graphs captured here with torch 2.13 (CPU) from the same zoo "
        "specs and batches; matched by spec, batch and precision (the GPU machine's graph signatures differ, "
        "e.g. gpt2 `f256a7753778693d` there; the signatures here are listed below).",
        "",
        "Rates from the microbenchmarks (`tag.cost.gpu.fit_microbenchmarks`): matmul "
        + ", ".join(f"{m} {v / 1e12:.1f}" for m, v in res["rates"]["matmul_flops"].items())
        + " TFLOP/s; conv " + ", ".join(f"{m} {v / 1e12:.1f}" for m, v in res["rates"]["conv_flops"].items())
        + f" TFLOP/s; memory {res['rates']['bandwidth'] / 1e12:.2f} TB/s; tiny-kernel launch "
        f"{res['launch_s_microbench'] * 1e6:.2f} us.",
        "",
        "One constant is fitted to steps: `host_s`, the host seconds per kernel launch of an eager training step. "
        "Leave one workload out: `host_s` fitted on the other two workloads (fp32 and bf16), the held-out "
        "workload predicted.",
        "",
        "| workload | precision | measured ms | predicted ms (held out) | error | host_s of the fold (us) | "
        "predicted ms (fit on all) | error | predicted ms (host_s = microbenchmark) | signature here |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["cases"]:
        lines.append(
            f"| {c['spec']} b{c['batch']} | {c['precision']} | {c['measured_s'] * 1e3:.2f} | "
            f"{c['predicted_s'] * 1e3:.2f} | {c['error']:+.1%} | {c['host_s_fold'] * 1e6:.1f} | "
            f"{c['predicted_all_s'] * 1e3:.2f} | {c['error_all']:+.1%} | "
            f"{c['predicted_microbench_host_s'] * 1e3:.2f} | `{c['signature_here']}` |")
    worst = max(abs(c["error"]) for c in res["cases"])
    lines += ["", f"Worst held-out error: {worst:.1%}. `host_s` fitted on all six steps: "
              f"{res['host_s_all'] * 1e6:.1f} us (stored in `tag/cost/gpu_calib/H200-steps.json`).", ""]
    write_atomic(OUT_DIR / "README.md", "\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", default="runs/gpu-cost/graphs", help="graph cache folder")
    ap.add_argument("--write", action="store_true", help="store the fit and the report")
    ap.add_argument("--held-out", nargs="+", type=Path, default=None, metavar="JSONL",
                    help="instead: predict the eager steps of these gpu_check result files with the stored fit")
    args = ap.parse_args(argv)
    cache = Path(args.graphs)
    cache.mkdir(parents=True, exist_ok=True)
    if args.held_out:
        print("| file | workload | batch | precision | measured ms | predicted ms | error | kernel ms (count, aten ops) | "
              "predicted device ms | device error |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in held_out(args.held_out, cache):
            dev = (f"{r['kernel_s'] * 1e3:.2f} ({r['kernels']}, {r['aten_ops']}) | {r['predicted_device_s'] * 1e3:.2f} | "
                   f"{r['device_error']:+.1%}") if "kernel_s" in r else "- | - | -"
            print(f"| {r['file']} | {r['spec']} | {r['batch']} | {r['precision']} | {r['measured_s'] * 1e3:.2f} | "
                  f"{r['predicted_s'] * 1e3:.2f} | {r['error']:+.1%} | {dev} |")
            if "device_by_class" in r:
                m, p = r["device_by_class"]["measured_s"], r["device_by_class"]["predicted_s"]
                print("|  | device ms by class, measured / rule: " + ", ".join(
                    f"{c} {m.get(c, 0) * 1e3:.2f} / {p.get(c, 0) * 1e3:.2f}" for c in sorted(set(m) | set(p)))
                    + " |  |  |  |  |  |  |  |  |")
        return 0
    res = run(cache)
    for c in res["cases"]:
        print(f"{c['workload']:<7} {c['precision']}: measured {c['measured_s'] * 1e3:7.2f} ms, held out "
              f"{c['predicted_s'] * 1e3:7.2f} ms ({c['error']:+.1%}), fit on all {c['error_all']:+.1%}")
    print(f"host_s fitted on all: {res['host_s_all'] * 1e6:.1f} us; folds "
          + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in res["host_s_folds"].items()))
    if args.write:
        write_report(res, "PYTHONPATH=. .venv/bin/python -m evaluation.gpu_cost_check " + " ".join(argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
