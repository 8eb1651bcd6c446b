"""The figures of README.md and docs/benchmarks.md, generated from the committed results files.

Each generated block sits between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->`` in its
document; everything outside the markers is prose kept by hand. One command rewrites every block:

    python -m evaluation.report            # or: make docs
    python -m evaluation.report --check    # exit 1 naming each block that differs from the files

A block reads only files under ``evaluation/results/`` and names the file each figure comes from,
so a table regenerates byte-identical from the committed results. Each results folder's README
opens with one header table (``| run | command | commit | machine | date |``), copied here.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tag.errors import TagError
from tag.io import read_json, write_atomic

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("evaluation/results")
HEADER = "| run | command | commit | machine | date |"
WITHIN = 0.20  # the GPU rule's accuracy target: |predicted / measured - 1| <= 20%


class ReportError(TagError):
    """A results file lacks what a generated block reads from it."""


@dataclass(frozen=True)
class Ctx:
    """The repository root the results are read from, and the document being written (links are
    made relative to its folder)."""

    root: Path
    doc: Path

    def json(self, rel: str):
        return read_json(self.root / RESULTS / rel, ReportError, "results")

    def link(self, rel: str, text: str | None = None) -> str:
        """A Markdown link from the document to ``evaluation/results/<rel>``."""
        target = "../" * len(self.doc.parent.parts) + (RESULTS / rel).as_posix() + ("/" if rel.endswith("/") else "")
        return f"[{text or rel}]({target})"


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def _spread(gains: list[float]) -> str:
    return f"{min(gains):#.3g}x-{max(gains):#.3g}x, geomean {_geomean(gains):#.3g}x over {len(gains)} cases"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def run_fields(command: str, machine: str) -> dict[str, str]:
    """``command``, the checkout's ``commit`` (``+changes`` when ``tag/`` differs from it),
    ``machine`` and today's UTC ``date``: what a results folder's header states of its run."""
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    commit += "+changes" if git("status", "--porcelain", "--", "tag") else ""
    date = datetime.datetime.now(datetime.UTC).date().isoformat()
    return {"command": command, "commit": commit, "machine": machine, "date": date}


def header_table(fields: dict[str, str], run: str = "run") -> list[str]:
    """The header table of :func:`run_fields` a script writes at the top of its results folder's README."""
    return runs_table([{**fields, "run": run}])


def runs_table(runs: list[dict[str, str]]) -> list[str]:
    """The header table with one row per run (:func:`run_fields` and its name, ``run``)."""
    return [HEADER, "|---|---|---|---|---|",
            *(f"| {r['run']} | `{r['command']}` | {r['commit']} | {r['machine']} | {r['date']} |" for r in runs)]


def header_lines(command: str, machine: str, run: str = "run") -> list[str]:
    """:func:`header_table` of this checkout's run of ``command`` on ``machine``."""
    return header_table(run_fields(command, machine), run)


def machine_line() -> str:
    """This machine in a few words: CPU count and torch version (a GPU's name when one is visible)."""
    import torch

    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{os.cpu_count()} CPUs{gpu}, torch {torch.__version__}"


def header_rows(ctx: Ctx, folder: str) -> list[str]:
    """The header table's rows of ``evaluation/results/<folder>/README.md``."""
    path = ctx.root / RESULTS / folder / "README.md"
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    if HEADER not in lines:
        raise ReportError(f"{path}: no header table; expected a line '{HEADER}' after the title")
    rows = []
    for line in lines[lines.index(HEADER) + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def run_dates(ctx: Ctx, folder: str) -> str:
    """The dates of the folder's runs, from its header: one date, or the first and the last."""
    dates = sorted({row.rstrip(" |").rsplit("|", 1)[-1].strip() for row in header_rows(ctx, folder)})
    return dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"


def provenance(ctx: Ctx, folder: str) -> str:
    """The folder's header, linked: what ran, at which commit, on what, when."""
    return "\n".join([f"Results: {ctx.link(folder + '/')}", "", HEADER, "|---|---|---|---|---|",
                      *header_rows(ctx, folder)])


# --- TAG against the baselines (tag bench) --------------------------------------------------------

def _cells(ctx: Ctx, folder: str) -> list[dict]:
    return [c for c in ctx.json(f"{folder}/results.json") if c["method"] != "lower-bound"]


HAND = ("dp", "dp-prop", "single", "mp", "fsdp", "dp-tp-pp-grid")  # plans a user writes without a search
SEARCH = ("random", "sa", "tpe", "mcts-uniform")  # other searchers over TAG's space, the suite's budget


HAND_NAMES = {"dp": "data parallel", "dp-prop": "proportional data parallel", "single": "one device",
              "mp": "greedy model parallel", "fsdp": "FSDP (ZeRO-3 over every device)",
              "dp-tp-pp-grid": "the dp x tp x pp grid"}


def hand_names(ctx: Ctx, folder: str) -> str:
    """The by-hand methods a suite's run holds, in words."""
    ran = {c["method"] for c in _cells(ctx, folder)}
    return ", ".join(HAND_NAMES[m] for m in HAND if m in ran)


def _best(cells: list[dict], model: str, topo: str, methods: tuple[str, ...]) -> dict | None:
    """The fastest plan that fits among ``methods``, for one (model, topology)."""
    fit = [c for c in cells if c["model"] == model and c["topology"] == topo and c["method"] in methods
           and not c["oom"]]
    return min(fit, key=lambda c: c["predicted_time_s"], default=None)


def _tag_cell(cells: list[dict], model: str, topo: str, method: str) -> dict:
    return next(c for c in cells if c["model"] == model and c["topology"] == topo and c["method"] == method)


def _secs(cell: dict | None) -> str:
    if cell is None:
        return "none fits"
    return "OOM" if cell["oom"] else f"{cell['predicted_time_s']:.4g} s (`{cell['method']}`)"


def _gain(tag: dict, base: dict | None) -> float | None:
    """``base``'s time over TAG's: above 1 when TAG's plan is faster; None when one does not fit."""
    return None if base is None or tag["oom"] else base["predicted_time_s"] / tag["predicted_time_s"]


def bench_cases(ctx: Ctx, folder: str, method: str) -> list[tuple[str, str, dict, dict | None, dict | None]]:
    """Per (model, topology): TAG's cell, the best by-hand plan and the best other search's plan."""
    cells = _cells(ctx, folder)
    return [(m, t, _tag_cell(cells, m, t, method), _best(cells, m, t, HAND), _best(cells, m, t, SEARCH))
            for m, t in dict.fromkeys((c["model"], c["topology"]) for c in cells)]


def bench_rows(ctx: Ctx, folder: str, method: str) -> list[list[str]]:
    def x(g: float | None) -> str:
        return "-" if g is None else f"{g:.2f}x"

    searched = searchers_ran(ctx, folder)
    return [[f"`{m}`", t, _secs(tag), _secs(hand), x(_gain(tag, hand))]
            + ([_secs(search), x(_gain(tag, search))] if searched else [])
            for m, t, tag, hand, search in bench_cases(ctx, folder, method)]


def searchers_ran(ctx: Ctx, folder: str) -> bool:
    """Whether the run holds any of the other searchers (a run may take a subset of the methods)."""
    return any(c["method"] in SEARCH for c in _cells(ctx, folder))


def bench_gains(ctx: Ctx, folder: str, method: str, against: int) -> list[float]:
    """TAG's speedups over the best by-hand plan (``against`` 3) or the best other search (4), over
    the cases where both fit."""
    gains = [_gain(case[2], case[against]) for case in bench_cases(ctx, folder, method)]
    return [g for g in gains if g is not None]


def suite_title(ctx: Ctx, folder: str) -> str:
    """The suite's name, models and clusters, from the run's config.json."""
    s = ctx.json(f"{folder}/config.json")["suite"]
    models = ", ".join(f"`{m['spec']}`" for m in s["models"])
    return (f"Suite `{s['name']}`: {models} at global batch {'/'.join(str(m['batch']) for m in s['models'])}, "
            f"{s.get('precision', 'fp32')}, on {', '.join(s['topologies'])}")


def block_bench(ctx: Ctx) -> str:
    out = []
    for folder, method in (("bench-scale", "tag-50"), ("bench-quick", "tag-200")):
        out += [f"#### {suite_title(ctx, folder)}", "", provenance(ctx, folder), "",
                _table(["model", "topology", method, "best by-hand plan", "speedup"]
                       + (["best other search", "speedup"] if searchers_ran(ctx, folder) else []),
                       bench_rows(ctx, folder, method)), "",
                f"Plots: {ctx.link(folder + '/speedup.png', 'speedup')}, "
                f"{ctx.link(folder + '/quality_vs_time.png', 'quality against search time')}; "
                f"every method's figure: {ctx.link(folder + '/report.md')}.", ""]
    return "\n".join(out).rstrip()


# --- simulator against real execution -------------------------------------------------------------

VALIDATE = "validate-local-cpu2"


def validate_runs(ctx: Ctx) -> list[tuple[str, dict]]:
    """(relative path, validation.json) of every run under the validate folder, sorted by path."""
    base = ctx.root / RESULTS / VALIDATE
    return [(p.parent.relative_to(base).as_posix(), ctx.json(p.relative_to(ctx.root / RESULTS).as_posix()))
            for p in sorted(base.rglob("validation.json"))]


def block_validate(ctx: Ctx) -> str:
    def plot(rel: str) -> str:
        return ctx.link(f"{VALIDATE}/{rel}/scatter.png", "scatter") if (ctx.root / RESULTS / VALIDATE / rel / "scatter.png").exists() else "-"

    rows = [[ctx.link(f"{VALIDATE}/{rel}/validation.json", rel), f"`{v['model']}`", str(len(v["rows"])),
             f"{v['mape_median_pct']:.1f}%", f"{v['spearman']:.3f}", plot(rel)] for rel, v in validate_runs(ctx)]
    return "\n".join([provenance(ctx, VALIDATE), "",
                      _table(["run", "model", "plans", "median abs. error", "Spearman", "plot"], rows)])


def gpu_cases(ctx: Ctx, precision: str) -> list[dict]:
    """The real-size zoo's eager H200 steps, each predicted with its workload left out of the fit."""
    res = ctx.json("gpu-cost/results.json")
    return [c for c in res["cases"] if c["file"].startswith("2026-11-27-h200/") and c["precision"] == precision]


def block_gpu(ctx: Ctx) -> str:
    by = {p: {c["spec"]: c for c in gpu_cases(ctx, p)} for p in ("fp32", "bf16")}
    rows = []
    for spec in by["fp32"]:
        cells = [by[p].get(spec) for p in ("fp32", "bf16")]
        rows.append([f"`{spec}`"] + [f"{c['measured_s'] * 1e3:.1f} ms, {c['loo']['error'] * 100:+.1f}%" if c else "-"
                                     for c in cells])
    return "\n".join([provenance(ctx, "gpu-cost"), "",
                      "Eager step on one H200 and the simulator's error with the workload left out of the fit "
                      f"(from {ctx.link('gpu-cost/results.json')}, `cases`):", "",
                      _table(["preset", "fp32: eager, error", "bf16: eager, error"], rows)])


def gpu_within(ctx: Ctx, precision: str) -> tuple[int, int]:
    cases = gpu_cases(ctx, precision)
    return sum(abs(c["loo"]["error"]) <= WITHIN for c in cases), len(cases)


# --- planner benchmark ----------------------------------------------------------------------------

PLANNER = ("results.json", "scale.json")  # small held-out pairs; held-out pairs at scale


def planner_title(ctx: Ctx, name: str) -> str:
    devices = [r["devices"] for r in ctx.json(f"planner-bench/{name}")["rows"]]
    return f"{len(devices)} held-out pairs, {min(devices)}-{max(devices)} GPUs"


def planner_summary(ctx: Ctx, name: str) -> str:
    s = ctx.json(f"planner-bench/{name}")["summary"]
    return (f"{s['gnn50_at_least_as_good_pairs']} of {s['pairs']} at least as good, "
            f"geomean {s['gnn50_vs_uniform2000_geomean']:.4f}")


def _best_dp_ms(row: dict) -> str:
    """The faster of even and proportional data parallel; a missing time is a plan that does not fit."""
    fits = [x for x in (row["dp_even_s"], row["dp_prop_s"]) if x is not None]
    return f"{min(fits) * 1e3:.4g}" if fits else "OOM"


def planner_date(ctx: Ctx, name: str) -> str:
    """The date of the header row that wrote ``name`` (the row whose command names the file)."""
    row = next(r for r in header_rows(ctx, "planner-bench") if f"planner-bench/{name}" in r)
    return row.rstrip(" |").rsplit("|", 1)[-1].strip()


def block_planner(ctx: Ctx) -> str:
    out = [provenance(ctx, "planner-bench"), ""]
    for name in PLANNER:
        res, title = ctx.json(f"planner-bench/{name}"), planner_title(ctx, name)
        rows = [[f"`{r['model']}`", r["topology"], f"{r['gnn50']['time_s'] * 1e3:.4g}",
                 f"{r['uniform2000']['time_s'] * 1e3:.4g}", f"{r['gnn50_over_uniform2000']:.3f}",
                 _best_dp_ms(r)] for r in res["rows"]]
        s = res["summary"]
        out += [f"#### {title} ({ctx.link('planner-bench/' + name, name)})", "",
                _table(["model", "topology", "GNN-MCTS @50 ms", "uniform MCTS @2000 ms", "ratio",
                        "best data parallel ms"], rows), "",
                f"GNN @50 {planner_summary(ctx, name)}; never worse than data parallel: "
                f"{'yes' if s['never_worse_than_dp'] else 'no'}.", ""]
    out.append(f"Search progress: {ctx.link('planner-bench/quality_vs_playouts.png', 'quality against playouts')} "
               "(held-out pairs).")
    return "\n".join(out)


# --- executor overhead, pipelines, capture, SFB ---------------------------------------------------

def block_executor(ctx: Ctx) -> str:
    res = ctx.json("executor-overhead/results.json")
    rows = []
    for name, m in res["models"].items():
        t, ab = m["median_time_s"], m["interleaved"]
        rows.append([f"{name} ({m['batch']})", f"{ab['median_time_s']['eager'] * 1e3:.2f}",
                     f"{ab['median_time_s']['tag-1'] * 1e3:.2f}", f"{ab['time_ratio']:.3f}",
                     f"{t['ddp'] * 1e3:.2f}", f"{t['tag-dp'] * 1e3:.2f}", f"{m['time_ratio']['tag-dp/ddp']:.3f}"])
    return "\n".join([provenance(ctx, "executor-overhead"), "",
                      _table(["model (batch)", "eager ms", "tag-1 ms", "tag-1 / eager", "DDP ms", "tag-dp ms",
                              "tag-dp / DDP"], rows), "",
                      "`tag-1` against eager: one pinned process alternating eager and the rank's iteration "
                      "(in-process A/B, `interleaved` in the results); `tag-dp` against DDP: two gloo ranks, "
                      f"separate processes, interleaved rounds. Plot: {ctx.link('executor-overhead/plot.png', 'plot')}."])


def block_pipeline(ctx: Ctx) -> str:
    res = ctx.json("pipeline-gain/results.json")

    def ms(x: float | None) -> str:
        return "OOM" if x is None else f"{x * 1e3:.1f}"

    rows = [[f"`{r['model']}` b{r['batch']} {r['precision']}", r["topology"], ms(r["dp"]), ms(r["tag-50"]),
             ms(r["dp-tp-pp-grid"]), ms(r["tag-50+pipelines"])] for r in res["rows"]]
    return "\n".join([provenance(ctx, "pipeline-gain"), "",
                      _table(["model", "topology", "dp ms", "tag-50 (per-group actions) ms", "best dp x tp x pp layout ms",
                              "tag-50 with pipelines ms"], rows), "",
                      f"Plot: {ctx.link('pipeline-gain/speedup.png', 'speedup')}."])


CAPTURE = "capture-scale/summary-2026-11-27-avx512.txt"


def capture_rows(ctx: Ctx) -> list[dict]:
    """One dict per preset of the capture summary (``name key=value ...`` lines)."""
    path = ctx.root / RESULTS / CAPTURE
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        name, *fields = line.split()
        kv = dict(f.split("=", 1) for f in fields)
        if not {"user", "sys", "rss_kb"} <= kv.keys():
            raise ReportError(f"{path}: line '{line}': expected user=, sys= and rss_kb= fields")
        rows.append({"preset": name, "cpu_s": float(kv["user"]) + float(kv["sys"]), "rss_mb": int(kv["rss_kb"]) / 1024})
    return rows


def block_capture(ctx: Ctx) -> str:
    rows = [[r["preset"], f"{r['cpu_s']:.1f}", f"{r['rss_mb']:.0f}"] for r in capture_rows(ctx)]
    return "\n".join([provenance(ctx, "capture-scale"), "",
                      _table(["preset", "CPU s (user + sys)", "peak RSS MB"], rows)])


def block_sfb(ctx: Ctx) -> str:
    res = ctx.json("sfb-sweep/sfb_sweep.json")
    rows = [[r["model"], r["topology"], str(r["batch_per_device"]), f"{r['iter_dp_ms']:.1f}", f"{r['iter_sfb_ms']:.1f}",
             f"{r['iter_dp_ms'] / r['iter_sfb_ms']:.2f}x"] for r in res]
    return "\n".join([provenance(ctx, "sfb-sweep"), "",
                      _table(["model", "topology", "samples / device", "dp ms", "dp + SFB ms", "gain"], rows)])


def block_speed(ctx: Ctx) -> str:
    res = ctx.json("sim-speed/scale.json")
    rows = [[name, str(x["devices"]), str(x["actions"]), f"{x['load_topology_s']:.2f}",
             f"{x['sims_per_s']['dp']:.0f}", f"{x['sims_per_s']['search']:.0f}"] for name, x in res["topologies"].items()]
    plans = [[p["topology"], f"{p['prior']} @{p['budget']}", f"{p['wall_s']:.1f}", f"{p['search_time_s']:.1f}",
              f"{p['iteration_s'] * 1e3:.2f}", f"{p['dp_even_s'] * 1e3:.2f}"] for p in res["plan"]]
    return "\n".join([provenance(ctx, "sim-speed"), "",
                      f"`{res['model']}`, batch {res['batch']}, {res['groups']} op-groups ({res['ops']} ops):", "",
                      _table(["topology", "devices", "actions", "load s", "simulations / s, data parallel",
                              "simulations / s, search plans"], rows), "",
                      _table(["topology", "search", "`find_plan` wall s", "set-up + search s", "plan ms (simulated)",
                              "even data parallel ms"], plans)])


EXTERNAL = "external/summary.json"  # written by python -m evaluation.external


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def block_external(ctx: Ctx) -> str:
    """The simulator against published measurements, from ``evaluation/results/external/summary.json``
    when it exists (its header fields, overall figures and groups); a note otherwise."""
    if not (ctx.root / RESULTS / EXTERNAL).exists():
        return "(no results yet: `evaluation/results/external/summary.json` is absent)"
    s = ctx.json(EXTERNAL)
    runs = s.get("runs") or [{**s, "groups": None}]  # one a run: the full run's, then each partial run's
    head = runs_table([{**r, "run": "all" if r["groups"] is None else r["run"]} for r in runs])
    rows = [[g["group"], str(g["points"]), "-" if g.get("spearman") is None else f"{g['spearman']:.2f}",
             _pct(g.get("median_abs_error")), _pct(g.get("worst_abs_error"))] for g in s["groups"]]
    o = s["overall"]
    return "\n".join([f"Results: {ctx.link('external/')}", "", *head, "",
                      _table(["group", "points", "Spearman", "median abs. error", "worst abs. error"], rows), "",
                      f"{o['points']} points in {o['groups']} groups; median abs. error {_pct(o['median_abs_error'])} "
                      f"({ctx.link(EXTERNAL, 'summary.json')}; per point: {ctx.link('external/points.csv', 'points.csv')})."])


# --- the README's headline table ------------------------------------------------------------------

def block_headline(ctx: Ctx) -> str:
    scale, quick = bench_gains(ctx, "bench-scale", "tag-50", 3), bench_gains(ctx, "bench-quick", "tag-200", 3)
    searched = bench_gains(ctx, "bench-quick", "tag-200", 4)
    runs = validate_runs(ctx)
    errs, rhos = [v["mape_median_pct"] for _, v in runs], [v["spearman"] for _, v in runs]
    plans = [len(v["rows"]) for _, v in runs]
    eo = ctx.json("executor-overhead/results.json")["models"]
    t1 = [m["interleaved"]["time_ratio"] for m in eo.values()]
    tdp = [m["time_ratio"]["tag-dp/ddp"] for m in eo.values()]
    cap = {r["preset"]: r for r in capture_rows(ctx)}
    (f32, n32), (b16, n16) = gpu_within(ctx, "fp32"), gpu_within(ctx, "bf16")
    rows = [
        [f"TAG's plan against the best by-hand plan ({hand_names(ctx, 'bench-scale')}), 64-512 GPUs, "
         "Llama-2 7B and GPT-2 XL in bf16", _spread(scale), ctx.link("bench-scale/results.json"),
         run_dates(ctx, "bench-scale")],
        [f"The same ({hand_names(ctx, 'bench-quick')}), small models on "
         f"{len(ctx.json('bench-quick/config.json')['suite']['topologies'])} clusters (quick suite)", _spread(quick), ctx.link("bench-quick/results.json"),
         run_dates(ctx, "bench-quick")],
        ["TAG's plan against the best of random search, annealing, TPE and uniform MCTS at "
         f"{ctx.json('bench-quick/config.json')['suite']['search_budget']} playouts (quick suite)",
         _spread(searched), ctx.link("bench-quick/results.json"), run_dates(ctx, "bench-quick")],
        ["Simulated H200 step within 20% of the eager one, real-size zoo, workload held out of the fit",
         f"fp32 {f32} of {n32}, bf16 {b16} of {n16}", ctx.link("gpu-cost/results.json"),
         run_dates(ctx, "gpu-check/2026-11-27-h200")],
        [f"Simulator against real execution on 2 CPU ranks, {len(runs)} runs of {min(plans)}-{max(plans)} plans "
         "(median abs. error; Spearman)",
         f"{min(errs):.1f}-{max(errs):.1f}% (median {statistics.median(errs):.1f}%); "
         f"{min(rhos):.3f}-{max(rhos):.3f}",
         ctx.link(f"{VALIDATE}/"), run_dates(ctx, VALIDATE)],
        *([f"GNN-guided MCTS @50 playouts against uniform MCTS @2000 (iteration time), {planner_title(ctx, name)}",
           planner_summary(ctx, name), ctx.link(f"planner-bench/{name}"), planner_date(ctx, name)]
          for name in PLANNER),
        [f"`tag execute`'s step time against eager PyTorch (one device) and DDP (two ranks), CPU, {len(eo)} models",
         f"{min(t1):.3f}-{max(t1):.3f}x eager; {min(tdp):.3f}-{max(tdp):.3f}x DDP", ctx.link("executor-overhead/results.json"),
         run_dates(ctx, "executor-overhead")],
        ["Capture of Llama-2 7B (6.7B parameters), no weights allocated",
         f"{cap['llama-7b']['cpu_s']:.1f} CPU s, {cap['llama-7b']['rss_mb']:.0f} MB", ctx.link(CAPTURE), run_dates(ctx, "capture-scale")],
    ]
    if (ctx.root / RESULTS / EXTERNAL).exists():
        o = ctx.json(EXTERNAL)["overall"]
        rows.append([f"Simulator against published multi-GPU measurements, {o['points']} points in {o['groups']} groups "
                     "(median abs. error)", _pct(o["median_abs_error"]), ctx.link(EXTERNAL), str(ctx.json(EXTERNAL)["date"])])
    return _table(["claim", "figure", "results file", "measured"], rows)


BLOCKS: dict[str, Callable[[Ctx], str]] = {
    "headline": block_headline, "bench": block_bench, "validate": block_validate, "gpu": block_gpu,
    "planner": block_planner, "executor": block_executor, "pipeline": block_pipeline,
    "capture": block_capture, "sfb": block_sfb, "speed": block_speed, "external": block_external,
}
DOCS = ("README.md", "docs/benchmarks.md")
MARK = re.compile(r"(<!-- report:(?P<name>[a-z]+) -->\n)(?P<body>.*?)(<!-- /report:(?P=name) -->)", re.S)


def render(root: Path, doc: str) -> str:
    """``doc`` (relative to ``root``) with every generated block rewritten from the results files."""
    path = root / doc
    text = path.read_text(encoding="utf-8")
    ctx = Ctx(root, Path(doc))

    def fill(m: re.Match) -> str:
        name = m["name"]
        if name not in BLOCKS:
            raise ReportError(f"{path}: unknown block 'report:{name}'; expected one of {', '.join(BLOCKS)}")
        try:
            body = BLOCKS[name](ctx)
        except KeyError as e:  # a results file of another shape
            raise ReportError(f"{path}: block 'report:{name}': a results file lacks the field {e}") from e
        return m.group(1) + body + "\n" + m.group(4)

    return MARK.sub(fill, text)


def stale(root: Path) -> list[str]:
    """The documents whose generated blocks differ from what the results files give."""
    return [doc for doc in DOCS if render(root, doc) != (root / doc).read_text(encoding="utf-8")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.report", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a document is stale")
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    a = ap.parse_args(argv)
    try:
        if a.check:
            out = stale(a.root)
            for doc in out:
                print(f"{doc}: generated blocks differ from evaluation/results (run python -m evaluation.report)")
            return 1 if out else 0
        for doc in DOCS:
            new = render(a.root, doc)
            if new != (a.root / doc).read_text(encoding="utf-8"):
                write_atomic(a.root / doc, new)
                print(f"wrote {doc}")
        return 0
    except TagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
