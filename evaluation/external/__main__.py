"""``python -m evaluation.external``: cost every published point, write the table, scores and plot."""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import os
import sys
import time
from pathlib import Path

from . import POINTS, RESULTS, DataError, Row, load_points, score, simulate_point


def _fmt(x, spec: str = ".3f") -> str:
    return "" if x is None or x != x else format(x, spec)


def write_results(out: Path, rows: list[Row], command: str, runs: list[dict] | None = None) -> dict:
    """``points.csv``, ``summary.json``, ``sim_vs_measured.png`` and ``README.md`` under ``out``.
    ``runs``: the runs whose rows these are (:func:`merged_runs`); None: this run alone, all rows."""
    from evaluation.report import machine_line, run_fields, runs_table
    from tag.io import write_atomic, write_json

    groups, overall = score(rows)
    out.mkdir(parents=True, exist_ok=True)
    header = run_fields(command, machine_line())
    runs = runs if runs is not None else [{"run": "run", **header, "groups": None}]
    fields = ["group", "id", "source", "runtime", "model", "precision", "global_batch", "layout", "stages",
              "ran", "measured_s", "simulated_s", "ratio", "oom", "peak_gib", "memory_gib", "error"]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(fields)
    for r in rows:
        p = r.point
        w.writerow([p.group, p.id, p.source, p.runtime, p.model, p.precision, p.global_batch, p.layout_text(),
                    "+".join(map(str, p.stages)) if p.stages else "", p.ran, _fmt(p.measured_s, ".4f"),
                    _fmt(r.simulated_s, ".4f"), _fmt(r.ratio), r.oom, _fmt(r.peak_gib, ".2f"),
                    _fmt(p.memory_gib, ".2f"), r.error or ""])
    write_atomic(out / "points.csv", buf.getvalue())
    summary = _finite({**header, "runs": runs, "overall": overall,
                       "groups": [g.__dict__ | {"passes": g.passes()} for g in groups]})
    write_json(out / "summary.json", summary)
    _plot(out / "sim_vs_measured.png", rows)
    lines = [*runs_table(runs), "",
             "# Simulator against published multi-GPU measurements", "",
             "Each point is a published, measured training iteration (sources: `evaluation/external/points/`), "
             "costed by `tag simulate --layout` on its cluster's topology file. Error = simulated / measured - 1. "
             "Nothing is fitted to these iteration times.", "",
             "| group | het. | sources | points | Spearman | median \\|err\\| | worst \\|err\\| | best in sim top 3 | "
             "ran, predicted OOM | failed runs predicted OOM | passes (>= 8 points) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in groups:
        lines.append(f"| {g.group} | {'yes' if g.heterogeneous else 'no'} | {', '.join(g.sources)} | {g.points} | "
                     f"{_fmt(g.spearman, '.2f')} | {_fmt(g.median_abs_error, '.1%')} | {_fmt(g.worst_abs_error, '.1%')} | "
                     f"{'' if g.best_in_top3 is None else ('yes' if g.best_in_top3 else 'no')} | {g.ran_predicted_oom} | "
                     f"{g.failed_predicted_oom} of {g.failed} | "
                     f"{'' if g.passes() is None else ('yes' if g.passes() else 'no')} |")
    o = overall
    lines += ["", f"Overall: {o['points']} points ({o['costed_ran']} ran and costed), {o['groups']} groups "
              f"({o['heterogeneous_groups']} heterogeneous), {o['sources']} sources; median |error| "
              f"{_fmt(o['median_abs_error'], '.1%')}; runs that ran predicted out of memory: {o['ran_predicted_oom']}; "
              f"groups of 8+ points passing (Spearman >= 0.8, best in top 3): {o['groups_passing']} of {o['groups_scored']}.",
              "", "![simulated vs measured](sim_vs_measured.png)", "", "Per point: `points.csv`."]
    write_atomic(out / "README.md", "\n".join(lines) + "\n")
    return summary


def merged_runs(previous: dict, header: dict, only: list[str]) -> list[dict]:
    """The runs of a folder after a run of the groups ``only`` is merged into it: ``previous``'s
    (its ``summary.json``; one written before runs were listed is one run of every group), each
    earlier partial run without the groups this one replaces (gone when none is left), then this
    run, named by its groups. A run's ``groups`` is None where it covers every group not named by
    a later run."""
    runs = previous.get("runs") or [{"run": "run", **{k: previous.get(k, "") for k in
                                                      ("command", "commit", "machine", "date")}, "groups": None}]
    kept = []
    for r in runs:
        if r.get("groups") is None:
            kept.append(r)
        elif rest := [g for g in r["groups"] if g not in only]:
            kept.append({**r, "run": ", ".join(rest), "groups": rest})
    return [*kept, {"run": ", ".join(only), **header, "groups": list(only)}]


def merge_rows(out: Path, points: Path, rows: list[Row], only: list[str]) -> list[Row]:
    """``rows`` (this run's, of the groups ``only``) with ``out``'s ``points.csv`` rows of every
    other group, in the points files' order (a full run's)."""
    order = {(p.group, p.id): i for i, p in enumerate(load_points(points))}
    old = _rows_of(out / "points.csv", points)
    kept = [r for r in old if r.point.group not in only]
    with open(out / "points.csv", newline="") as f:
        gone = sum(1 for r in csv.DictReader(f) if r["group"] not in only) - len(kept)
    print(f"--merge: {len(kept)} rows of other groups kept from {out / 'points.csv'}"
          + (f", {gone} naming no point of {points} left out" if gone else ""), file=sys.stderr)
    return sorted([*kept, *rows], key=lambda r: order[(r.point.group, r.point.id)])


def _finite(x):
    """``x`` with NaN floats as None (JSON has no NaN)."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _plot(path: Path, rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 7))
    colours = plt.get_cmap("tab20").colors + plt.get_cmap("tab20b").colors  # one per group (up to 40)
    by: dict[str, list[Row]] = {}
    for r in rows:
        if r.ratio is not None and r.point.ran:
            by.setdefault(r.point.group, []).append(r)
    lo, hi = float("inf"), 0.0
    for i, (g, rs) in enumerate(by.items()):
        x = [r.point.measured_s for r in rs]
        y = [r.simulated_s for r in rs]
        lo, hi = min(lo, *x, *y), max(hi, *x, *y)
        ax.scatter(x, y, label=f"{g} ({len(rs)})", s=18, color=colours[i % len(colours)],
                   marker="x" if rs[0].point.heterogeneous else "o")
        oom = [(r.point.measured_s, r.simulated_s) for r in rs if r.oom]
        if oom:
            ax.scatter(*zip(*oom), s=80, facecolors="none", edgecolors="red")
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        for f in (0.8, 1.25):
            ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured s / iteration")
    ax.set_ylabel("simulated s / iteration")
    ax.set_title("TAG simulator vs published measurements (x: heterogeneous; red ring: predicted OOM)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def _rows_of(path: Path, points: Path) -> list[Row]:
    """The rows of a written ``points.csv`` (simulated seconds and OOM) on the points they name."""
    by = {(p.group, p.id): p for p in load_points(points)}
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            p = by.get((r["group"], r["id"]))
            if p is not None:
                sim = float(r["simulated_s"]) if r["simulated_s"] else None
                out.append(Row(p, sim, r["oom"] == "True", float(r["peak_gib"]) if r["peak_gib"] else None,
                               r["error"] or None))
    return out


_TOPOLOGIES: dict = {}  # per process: topology file -> Topology


def _cost(p, groups: int) -> Row:
    return simulate_point(p, groups=groups, topologies=_TOPOLOGIES)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(prog="python -m evaluation.external", description=__doc__)
    ap.add_argument("--points", type=Path, default=POINTS, help="folder of points files (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder (default: %(default)s)")
    ap.add_argument("--only", default=None, help="comma-separated group names")
    ap.add_argument("--groups", type=int, default=48, help="op-groups per captured model")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (points in order, results identical)")
    ap.add_argument("--replot", action="store_true", help="redraw --out's plot from its points.csv, simulate nothing")
    ap.add_argument("--merge", action="store_true",
                    help="with --only: keep the other groups' rows of --out's points.csv and rewrite the table, "
                         "summary and plot over all rows; the README's header gets this run's row")
    a = ap.parse_args(argv)
    if a.merge and not a.only:
        ap.error("--merge: merges the groups of --only into --out; expected --only G1[,G2...]")
    previous = None
    if a.merge:
        try:
            previous = json.loads((a.out / "summary.json").read_text())
            (a.out / "points.csv").stat()
        except (OSError, ValueError) as e:
            print(f"error: --merge: {a.out}: expected points.csv and summary.json of an earlier run ({e})",
                  file=sys.stderr)
            return 2
    if a.replot:
        _plot(a.out / "sim_vs_measured.png", _rows_of(a.out / "points.csv", a.points))
        return 0
    try:
        points = load_points(a.points)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    only = a.only.split(",") if a.only else []
    if only:
        unknown = sorted(set(only) - {p.group for p in points})
        if unknown:
            print(f"error: --only: no group {', '.join(unknown)} in {a.points}; expected the name of a group "
                  "of its points files", file=sys.stderr)
            return 2
        points = [p for p in points if p.group in only]
    rows: list[Row] = []
    t0 = time.perf_counter()
    if a.jobs > 1:
        import multiprocessing as mp

        pool = mp.get_context("fork").Pool(a.jobs)
        results = pool.imap(functools.partial(_cost, groups=a.groups), points)
    else:
        pool, results = None, (_cost(p, groups=a.groups) for p in points)
    for i, (p, r) in enumerate(zip(points, results)):
        rows.append(r)
        what = (f"error: {r.error}" if r.error else
                f"sim {r.simulated_s:.3f} s" + (f" / meas {p.measured_s:.3f} s = {r.ratio:.2f}" if r.ratio else "")
                + (" OOM" if r.oom else ""))
        print(f"[{i + 1}/{len(points)} {time.perf_counter() - t0:.0f}s] {p.group} {p.id} {p.layout_text()}: {what}",
              file=sys.stderr, flush=True)
    if pool is not None:
        pool.close()
    command = "python -m evaluation.external" + ("" if argv is None and len(sys.argv) <= 1 else
                                                 " " + " ".join(argv if argv is not None else sys.argv[1:]))
    runs = None
    if previous is not None:
        from evaluation.report import machine_line, run_fields

        rows = merge_rows(a.out, a.points, rows, only)
        runs = merged_runs(previous, run_fields(command, machine_line()), only)
    summary = write_results(a.out, rows, command, runs)
    print((a.out / "README.md").read_text())
    return 0 if summary else 1


if __name__ == "__main__":
    sys.exit(main())
