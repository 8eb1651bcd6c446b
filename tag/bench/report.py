"""Markdown report and plots for a benchmark run (``tag bench`` writes them; they read results only)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from ..io import write_atomic
from .runner import Cell
from .suites import METHODS


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _fmt(c: Cell | None) -> str:
    if c is None:
        return "–"
    if c.oom:
        return "OOM"
    return f"{c.speedup_vs_dp:.2f}x"


def _by_case(cells: list[Cell]) -> list[tuple[tuple[str, str], dict[str, Cell]]]:
    """((model, topology), {method: cell}) per case, sorted by case."""
    by_case: dict[tuple, dict[str, Cell]] = defaultdict(dict)
    for c in cells:
        by_case[(c.model, c.topology)][c.method] = c
    return sorted(by_case.items())


def tag_losses(cells: list[Cell]) -> list[str]:
    """Cells where the best TAG variant is slower than the best other method (honesty section)."""
    out = []
    for (model, topo), ms in _by_case(cells):
        tags = [c for m, c in ms.items() if m.startswith("tag-") and not c.oom]
        others = [c for m, c in ms.items() if not m.startswith("tag-") and m != "lower-bound" and not c.oom]
        if not tags or not others:
            continue
        best_tag = min(tags, key=lambda c: c.predicted_time_s)
        best_other = min(others, key=lambda c: c.predicted_time_s)
        if best_tag.predicted_time_s > best_other.predicted_time_s * (1 + 1e-9):
            gap = best_tag.predicted_time_s / best_other.predicted_time_s - 1
            out.append(f"- {model} on {topo}: best TAG ({best_tag.method}, {best_tag.predicted_time_s * 1e3:.2f} ms) "
                       f"is {gap * 100:.1f}% slower than {best_other.method} ({best_other.predicted_time_s * 1e3:.2f} ms)")
    return out


def executed_losses(cells: list[Cell]) -> list[str]:
    """Cases run for real where a TAG plan measured slower than data parallel (even) measured:
    the simulator's ranking did not survive execution."""
    out = []
    for (model, topo), ms in _by_case(cells):
        dp = ms.get("dp")
        if dp is None or not dp.executed_time_s:
            continue
        for m, c in sorted(ms.items()):
            if m.startswith("tag-") and c.executed_time_s and c.executed_time_s > dp.executed_time_s:
                out.append(f"- {model} on {topo}: {m} measured {c.executed_time_s * 1e3:.1f} ms vs data parallel "
                           f"{dp.executed_time_s * 1e3:.1f} ms (predicted {c.predicted_time_s * 1e3:.1f} vs "
                           f"{dp.predicted_time_s * 1e3:.1f} ms)")
    return out


def markdown(cells: list[Cell], suite: str, env: dict, wall_s: float | None, resumed: int = 0) -> str:
    methods = [m for m in METHODS if any(c.method == m for c in cells)]
    topos = list(dict.fromkeys(c.topology for c in cells))
    lines = [f"# TAG benchmark — suite `{suite}`", ""]
    lines += [f"Date {env.get('date')}, torch {env.get('torch')}, {env.get('cpus')} CPUs, {env.get('platform')}."]
    if wall_s is not None:
        lines += [f"Wall time of this run: {wall_s / 60:.1f} min" +
                  (f" ({len(cells) - resumed} of {len(cells)} cells run in it, the others read back from "
                   "cells.jsonl; their search seconds are in the tables)." if resumed else ".")]
    lines += ["", "All predicted times come from the same simulator and cost model; every search method gets the "
              "same seed and the same playout budget (TAG's budget is in its name). Speedup is data parallel "
              "(even shares) time over the method's time: higher is better.", ""]
    lines += ["Methods: " + "; ".join(f"`{m}` {METHODS[m]}" for m in methods), ""]
    for topo in topos:
        sub = [c for c in cells if c.topology == topo]
        models = list(dict.fromkeys(c.model for c in sub))
        lines += [f"## {topo}", "", "| model | " + " | ".join(methods) + " |",
                  "|---|" + "---|" * len(methods)]
        idx = {(c.model, c.method): c for c in sub}
        for m in models:
            lines.append(f"| {m} | " + " | ".join(_fmt(idx.get((m, meth))) for meth in methods) + " |")
        lines.append("")
        lines += ["Predicted iteration time (ms) and search wall time (s):", "",
                  "| model | method | time ms | / lower bound | search s | playouts | executed ms |",
                  "|---|---|---|---|---|---|---|"]
        for c in sub:
            ex = f"{c.executed_time_s * 1e3:.1f}" if c.executed_time_s else ("–" if not c.note else c.note[:60])
            lines.append(f"| {c.model} | {c.method} | {c.predicted_time_s * 1e3:.2f}{' OOM' if c.oom else ''} | "
                         f"{c.ratio_to_lower_bound:.2f} | {c.search_time_s:.2f} | {c.playouts} | {ex} |")
        lines.append("")
    lines += ["## Geometric-mean speedup over data parallel (all cases)", "", "| method | speedup | mean search s |",
              "|---|---|---|"]
    for m in methods:
        cs = [c for c in cells if c.method == m and not c.oom]
        if cs:
            lines.append(f"| {m} | {_geomean([c.speedup_vs_dp for c in cs]):.3f} | "
                         f"{sum(c.search_time_s for c in cs) / len(cs):.2f} |")
    lines += ["", "## Where TAG loses", ""]
    losses = tag_losses(cells)
    lines += losses if losses else ["TAG's best variant was at least as fast as every other method in every case."]
    executed = any(c.executed_time_s for c in cells)
    if executed:
        ex_losses = executed_losses(cells)
        lines += ["", "Executed for real (same plans, this machine):", ""]
        lines += ex_losses if ex_losses else ["Every executed TAG plan was at least as fast as data parallel."]
    lines += ["", "## Plots", "", "![speedup](speedup.png)", "", "![quality vs search time](quality_vs_time.png)", ""]
    if executed:
        lines += ["![predicted vs measured](predicted_vs_measured.png)", ""]
    return "\n".join(lines) + "\n"


def plots(cells: list[Cell], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in METHODS if m != "lower-bound" and any(c.method == m for c in cells)]
    topos = list(dict.fromkeys(c.topology for c in cells))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(topos) * len(methods) / 4), 4))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        ys = [_geomean([c.speedup_vs_dp for c in cells if c.method == m and c.topology == t and not c.oom])
              for t in topos]
        ax.bar([i + j * width for i in range(len(topos))], ys, width, label=m, color=plt.cm.tab20(j % 20))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(topos))], topos, rotation=15)
    ax.set_ylabel("speedup over DP\n(geo-mean over models)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        cs = [c for c in cells if c.method == m and not c.oom]
        ax.scatter([max(c.search_time_s, 1e-4) for c in cs], [c.speedup_vs_dp for c in cs], label=m, s=14,
                   color=plt.cm.tab20(methods.index(m) % 20))
    ax.set_xscale("log")
    ax.set_xlabel("search wall time (s)")
    ax.set_ylabel("speedup over data parallel")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "quality_vs_time.png", dpi=120)
    plt.close(fig)

    ex = [c for c in cells if c.executed_time_s]
    if ex:
        fig, ax = plt.subplots(figsize=(4.5, 4.5))
        xs = [c.predicted_time_s * 1e3 for c in ex]
        ys = [c.executed_time_s * 1e3 for c in ex]
        ax.scatter(xs, ys, s=14)
        lim = [min(xs + ys) * 0.9, max(xs + ys) * 1.1]
        ax.plot(lim, lim, "k--", lw=0.8)
        ax.set_xlabel("predicted (ms)")
        ax.set_ylabel("measured (ms)")
        fig.tight_layout()
        fig.savefig(out / "predicted_vs_measured.png", dpi=120)
        plt.close(fig)


def write_report(cells: list[Cell], out: Path, suite: str, env: dict, wall_s: float | None = None,
                 resumed: int = 0) -> Path:
    plots(cells, out)
    path = out / "report.md"
    write_atomic(path, markdown(cells, suite, env, wall_s, resumed))
    return path
