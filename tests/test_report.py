"""The generated tables of README.md and docs/benchmarks.md (evaluation/report.py) against the
committed results files."""

import datetime
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from evaluation import report

REPO = Path(__file__).resolve().parent.parent


def test_docs_regenerate_byte_identical():
    """`make docs` on the committed results changes nothing: every figure in the generated blocks
    comes from a results file as committed."""
    assert report.stale(REPO) == []


def _copy(tmp_path: Path) -> Path:
    for doc in report.DOCS:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / doc, tmp_path / doc)
    shutil.copytree(REPO / report.RESULTS, tmp_path / report.RESULTS)
    return tmp_path


def test_a_changed_result_makes_the_docs_stale(tmp_path):
    """A new figure in a results file shows in the headline table, and --check fails until regenerated."""
    root = _copy(tmp_path)
    path = root / report.RESULTS / "planner-bench/scale.json"
    res = json.loads(path.read_text())
    res["summary"]["gnn50_at_least_as_good_pairs"] = 3
    path.write_text(json.dumps(res))
    assert report.main(["--check", "--root", str(root)]) == 1
    assert report.main(["--root", str(root)]) == 0
    assert "| 3 of 9 at least as good" in (root / "README.md").read_text()
    assert report.main(["--check", "--root", str(root)]) == 0


def test_a_results_folder_without_header_is_one_line_error(tmp_path, capsys):
    root = _copy(tmp_path)
    readme = root / report.RESULTS / "sfb-sweep/README.md"
    readme.write_text("# SFB sweep\n\nno header\n")
    assert report.main(["--root", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "sfb-sweep/README.md: no header table" in err


@pytest.mark.parametrize("doc", report.DOCS)
def test_every_block_links_its_results(doc):
    """Each generated block names at least one file under evaluation/results, and each such link
    resolves to a committed file or folder."""
    text = (REPO / doc).read_text()
    for m in report.MARK.finditer(text):
        links = [t for t in re.findall(r"\]\(([^)]+)\)", m["body"]) if "evaluation/results" in t]
        assert links or m["name"] == "external", f"block {m['name']} of {doc} names no results file"
        for target in links:
            assert ((REPO / doc).parent / target).resolve().exists(), f"{doc}: {target} does not exist"


def test_external_results_appear_when_their_summary_exists(tmp_path):
    """The external benchmark's row and section come from its summary.json alone, once it exists."""
    root = _copy(tmp_path)
    ext = root / report.RESULTS / "external"
    ext.mkdir(exist_ok=True)
    (ext / "summary.json").write_text(json.dumps({
        "command": "python -m evaluation.external", "commit": "abc1234", "machine": "test VM", "date": "2026-11-29",
        "overall": {"points": 12, "groups": 2, "median_abs_error": 0.125},
        "groups": [{"group": "g1", "points": 8, "spearman": 0.9, "median_abs_error": 0.1, "worst_abs_error": 0.3},
                   {"group": "g2", "points": 4, "spearman": None, "median_abs_error": 0.2, "worst_abs_error": 0.4}]}))
    assert report.main(["--root", str(root)]) == 0
    assert "12 points in 2 groups (median abs. error) | 12.5% |" in (root / "README.md").read_text()
    bench = (root / "docs/benchmarks.md").read_text()
    assert "| all | `python -m evaluation.external` | abc1234 | test VM | 2026-11-29 |" in bench
    assert "| g2 | 4 | - | 20.0% | 40.0% |" in bench


def test_a_scripts_header_is_what_the_report_reads(tmp_path):
    """The header a benchmark script writes (header_lines) is the one header_rows parses: the run's
    command, this checkout's commit and today's date."""
    folder = tmp_path / report.RESULTS / "x"
    folder.mkdir(parents=True)
    lines = report.header_lines("python -m evaluation.x --out DIR", "test VM")
    (folder / "README.md").write_text("\n".join(["# X", "", *lines, "", "Figures."]) + "\n")
    rows = report.header_rows(report.Ctx(tmp_path, Path("docs/benchmarks.md")), "x")
    assert len(rows) == 1 and rows[0].startswith("| run | `python -m evaluation.x --out DIR` | ")
    assert rows[0].endswith(f" | test VM | {datetime.datetime.now(datetime.UTC).date().isoformat()} |")


def test_results_tree_holds_current_results_only():
    """evaluation/results/ is one current folder per benchmark: at most 150 files and 5 MB committed,
    no scripts (they live in evaluation/), and a header in every folder the docs read."""
    out = subprocess.run(["git", "ls-files", "-z", str(report.RESULTS)], cwd=REPO, capture_output=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    files = [f for f in out.stdout.decode().split("\0") if f]
    assert len(files) <= 150
    assert sum((REPO / f).stat().st_size for f in files if (REPO / f).exists()) <= 5_000_000
    assert not [f for f in files if f.endswith((".py", ".sh"))]
    ctx = report.Ctx(REPO, Path("docs/benchmarks.md"))
    # gpu-check holds one folder per machine, each with its header; external's header is its summary.json
    folders = {Path(f).relative_to(report.RESULTS).parts[0] for f in files} - {"gpu-check", "external"}
    folders |= {str(Path(f).parent.relative_to(report.RESULTS)) for f in files if f.startswith(f"{report.RESULTS}/gpu-check/")}
    for folder in folders:
        assert report.header_rows(ctx, folder), folder
