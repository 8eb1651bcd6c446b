"""The published-measurement benchmark (evaluation/external): its data files, scores and runner."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from evaluation.external import (
    BLOCKING_SEND_RUNTIMES,
    DataError,
    Point,
    Row,
    load_points,
    runtime_name,
    score,
    score_group,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = "gpt2:n_layer=4,n_embd=64,n_head=2,vocab=100,seq=16"


def _file(tmp_path: Path, points: str, name: str = "src.yaml") -> Path:
    (tmp_path / name).write_text(
        "source: {kind: paper, ref: test, path: table 1, commit: null}\nruntime: megatron-lm\ngroups:\n"
        f"  - name: g\n    topology: {ROOT / 'topologies' / 'homogeneous-2x4-v100.yaml'}\n    points:\n{points}")
    return tmp_path


def _pt(pid: str, layout: str, t: float | None, ran: bool = True) -> str:
    meas = f"{{iteration_s: {t}, from: 'x'}}" if t is not None else "{}"
    return (f"      - {{id: {pid}, model: '{TINY}', precision: fp16, global_batch: 16, layout: {layout}, "
            f"measured: {meas}, ran: {str(ran).lower()}}}\n")


def test_shipped_points_load_and_name_their_sources():
    points = load_points()
    for p in points:
        assert p.topology.is_file(), f"{p.source}/{p.id}: topology {p.topology} missing"
        assert p.runtime
        assert p.measured_s is None or p.measured_s > 0


def test_runtimes_whose_pipeline_sends_block():
    """Each shipped point's runtime is named, and costed with blocking pipeline sends exactly
    where its runtime's sends block (BLOCKING_SEND_RUNTIMES: DeepSpeed, Megatron-LM and their
    forks), not for TAG's eager executor or OneFlow."""
    names = {runtime_name(p.runtime) for p in load_points(expressible_only=False)}
    assert {"deepspeed", "megatron-lm", "megatron-deepspeed", "eager", "oneflow"} <= names, names
    assert {n for n in names if n in BLOCKING_SEND_RUNTIMES} == {"deepspeed", "megatron-lm", "megatron-deepspeed",
                                                               "flagscale"}
    assert runtime_name("other: Megatron-DeepSpeed (data/README.md: ...), DeepSpeed's engine") == "megatron-deepspeed"
    assert runtime_name("tag") == "tag" and "tag" not in BLOCKING_SEND_RUNTIMES


@pytest.mark.parametrize("bad, needle", [
    (_pt("a", "{dp: 0, pp: 1, micro: 1}", 1.0), "layout.dp"),
    (_pt("a", "{dp: 8, micro: 1}", None), "measured.iteration_s"),
    (_pt("a", "{dp: 8, micro: 1}", 1.0).replace("fp16", "fp8"), "precision"),
    (_pt("a", "{dp: 8, micro: 1}", 1.0) + _pt("a", "{dp: 8, micro: 1}", 2.0), "given twice"),
])
def test_malformed_points_are_one_line_naming_the_field(tmp_path, bad, needle):
    root = _file(tmp_path, bad)
    with pytest.raises(DataError) as e:
        load_points(root)
    msg = str(e.value)
    assert needle in msg and "src.yaml" in msg and "\n" not in msg


def _row(pid: str, meas: float, sim: float, oom: bool = False, ran: bool = True) -> Row:
    p = Point(pid, "s", "g", False, Path("t.yaml"), TINY, "fp16", 16, {"dp": 1, "tp": 1, "pp": 1, "micro": 1},
              meas if ran else None, ran, "megatron-lm")
    return Row(p, sim, oom, 1.0)


def test_scores_rank_errors_and_oom():
    rows = [_row(str(i), m, s) for i, (m, s) in enumerate([(1, 1.1), (2, 1.8), (3, 3.3), (4, 4.0), (5, 6.0)])]
    g = score_group(rows)
    assert g.spearman == pytest.approx(1.0)
    assert g.median_abs_error == pytest.approx(0.1)
    assert g.worst_abs_error == pytest.approx(0.2)
    assert g.best_in_top3 is True and g.passes() is None  # fewer than 8 points: not scored against the bar
    # the measured fastest simulated slowest: out of the top 3; a run that ran predicted OOM is counted
    rows[0] = _row("0", 1, 10.0, oom=True)
    rows.append(_row("f", 0, 1.0, oom=True, ran=False))
    g = score_group(rows)
    assert g.best_in_top3 is False and g.ran_predicted_oom == 1
    assert g.failed == 1 and g.failed_predicted_oom == 1
    _, overall = score(rows)
    assert overall["ran_predicted_oom"] == 1 and overall["costed_ran"] == 5
    assert math.isnan(score_group(rows[:2]).spearman)


def test_runner_costs_points_and_writes_results(tmp_path):
    from evaluation.external.__main__ import main

    (tmp_path / "pts").mkdir()
    root = _file(tmp_path / "pts",
                 _pt("dp8", "{dp: 8, micro: 1}", 0.05) + _pt("pp2", "{dp: 4, pp: 2, micro: 4}", 0.06)
                 + _pt("bad", "{dp: 3, pp: 1, micro: 1}", 0.06))
    out = tmp_path / "out"
    assert main(["--points", str(root), "--out", str(out), "--groups", "8"]) == 0
    csv = (out / "points.csv").read_text().splitlines()
    assert len(csv) == 4
    by = {line.split(",")[1]: line for line in csv[1:]}
    assert by["dp8"].split(",")[11] and by["pp2"].split(",")[11]  # simulated seconds written
    assert "expected" in by["bad"] or "device" in by["bad"]  # dp=3 on 8 devices: the planner's one line
    assert (out / "sim_vs_measured.png").stat().st_size > 1000
    (out / "sim_vs_measured.png").unlink()
    assert main(["--points", str(root), "--out", str(out), "--replot"]) == 0  # from points.csv alone
    assert (out / "sim_vs_measured.png").stat().st_size > 1000
    assert (out / "README.md").read_text().startswith("| run | command | commit | machine | date |")
    import json
    assert json.loads((out / "summary.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))


def test_merge_keeps_other_groups_rows_and_names_each_run(tmp_path):
    """``--only h --merge``: group g's rows come from --out's points.csv as they were written (not
    simulated again), h's from this run; the README's header keeps the full run's row and adds one
    naming h; merging h again replaces that row."""
    import csv
    import json

    from evaluation.external.__main__ import main

    topo = ROOT / "topologies" / "homogeneous-2x4-v100.yaml"
    pts = tmp_path / "pts"
    pts.mkdir()
    (pts / "src.yaml").write_text(
        "source: {kind: paper, ref: test, path: table 1, commit: null}\nruntime: megatron-lm\ngroups:\n"
        + "".join(f"  - name: {g}\n    topology: {topo}\n    points:\n" + _pt(f"{g}1", "{dp: 8, micro: 1}", 0.05)
                  for g in ("g", "h")))
    out = tmp_path / "evaluation" / "results" / "external"
    assert main(["--points", str(pts), "--out", str(out), "--groups", "8"]) == 0
    rows = list(csv.DictReader((out / "points.csv").open()))
    rows[0]["simulated_s"] = "123.0000"  # group g's figure, as if from another commit
    with (out / "points.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for _ in range(2):
        assert main(["--points", str(pts), "--out", str(out), "--groups", "8", "--only", "h", "--merge"]) == 0
    merged = {r["group"]: r for r in csv.DictReader((out / "points.csv").open())}
    assert list(merged) == ["g", "h"]
    assert merged["g"]["simulated_s"] == "123.0000"  # kept, not simulated again
    assert merged["h"]["simulated_s"] == rows[1]["simulated_s"]  # simulated again, same figure
    header = (out / "README.md").read_text().split("\n\n")[0].splitlines()
    assert len(header) == 4, header  # title, rule, the full run's row, one row of the partial runs
    assert header[2].startswith("| run | `python -m evaluation.external --points")
    assert header[3].startswith("| h | `") and "--only h --merge" in header[3]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["groups"] for r in summary["runs"]] == [None, ["h"]]
    assert summary["overall"]["points"] == 2 and {g["group"] for g in summary["groups"]} == {"g", "h"}
    from evaluation import report
    block = report.block_external(report.Ctx(tmp_path, Path("docs/benchmarks.md")))  # the docs' section
    assert "\n| all | `python -m evaluation.external --points" in block and "\n| h | `" in block
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--merge"])  # --merge needs --only
    assert main(["--points", str(pts), "--out", str(out), "--only", "nope", "--merge"]) == 2
