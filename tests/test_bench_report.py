"""Benchmark report: the honesty sections list exactly the cases where TAG loses."""

from __future__ import annotations

from tag.bench.report import executed_losses, markdown, tag_losses
from tag.bench.runner import Cell


def _cell(model, method, t, executed=None):
    return Cell(model, "local-cpu2", method, t, False, 1.0, 1.0, 0.0, 0, executed)


def test_losses_predicted_and_executed():
    cells = [_cell("a", "dp", 2.0, 3.0), _cell("a", "tag-50", 1.9, 3.5), _cell("a", "sa", 1.8, 3.5),
             _cell("b", "dp", 2.0, 3.0), _cell("b", "tag-50", 1.5, 2.5), _cell("b", "sa", 1.6, 2.9)]
    pred = tag_losses(cells)
    assert len(pred) == 1 and pred[0].startswith("- a on local-cpu2: best TAG (tag-50")
    ex = executed_losses(cells)
    assert len(ex) == 1 and "a on local-cpu2: tag-50 measured 3500.0 ms vs data parallel 3000.0 ms" in ex[0]
    md = markdown(cells, "t", {"date": "d"}, None)
    assert ex[0] in md and pred[0] in md


def test_scale_suite_runs_every_method_on_the_topologies_at_scale():
    from tag.bench.suites import METHODS, SUITES
    from tag.topology import load_topology

    cfg = SUITES["scale"]()
    assert cfg.methods == list(METHODS) and cfg.groups == 128 and not cfg.execute_topologies
    assert cfg.precision == "bf16" and [m.spec for m in cfg.models] == ["llama-7b", "gpt2-xl"]
    assert [load_topology(t).num_devices for t in cfg.topologies] == [64, 256, 512]
    quick = SUITES["quick"]()  # unchanged: a few minutes on a 2-core machine
    assert quick.topologies == ["tag-testbed", "cloud-t4", "homogeneous-8xa100"] and quick.groups == 24
    assert quick.search_budget == 500 and len(quick.models) == 2


def test_a_resumed_run_reuses_the_captured_graph(tmp_path, monkeypatch):
    """The first run captures the model into the graph cache; a second run into the same folder
    (its cells removed) plans from that graph without capturing."""
    import tag.graph
    from tag.bench.runner import run_suite
    from tag.bench.suites import ModelCase, SuiteConfig

    monkeypatch.setenv("TAG_CACHE_DIR", str(tmp_path / "cache"))  # this test's own graph cache
    cfg = SuiteConfig(name="t", models=[ModelCase("mlp:layers=2,hidden=32,in_dim=16", 8)], topologies=["tag-testbed"],
                      methods=["dp", "lower-bound"], groups=4)
    first, resumed = run_suite(cfg, tmp_path / "out")
    assert resumed == 0
    assert len(list((tmp_path / "cache" / "graphs").glob("*.json"))) == 1
    (tmp_path / "out" / "cells.jsonl").unlink()

    def no_capture(*a, **k):
        raise AssertionError("captured again")

    monkeypatch.setattr(tag.graph, "capture_graph", no_capture)
    again, _ = run_suite(cfg, tmp_path / "out")
    assert [c.predicted_time_s for c in again] == [c.predicted_time_s for c in first]


def test_bench_budget_must_be_positive_and_bounded(capsys):
    from tag.cli import main

    assert main(["bench", "--suite", "quick", "--budget", "0"]) == 2
    assert "argument --budget: expected an integer between 1 and 1000000, got 0" in capsys.readouterr().err
    assert main(["bench", "--suite", "quick", "--budget", str(10**30)]) == 2
    assert "argument --budget: expected an integer between 1 and 1000000" in capsys.readouterr().err


def test_bench_model_must_be_in_the_suite(capsys, tmp_path):
    from tag.cli import main

    assert main(["bench", "--suite", "scale", "--model", "llama-13b", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--model: 'llama-13b' is not in suite 'scale'; expected one of ['llama-7b', 'gpt2-xl']" in err
    assert not (tmp_path / "o").exists()


def test_a_resumed_report_says_which_cells_it_ran(tmp_path, capsys):
    """The report's wall time is that of the invocation: a second run into the same folder runs no
    cell, and says so (not a wall time of 0.0 min for the whole table)."""
    from tag.cli import main

    argv = ["bench", "--suite", "quick", "--model", "resnet:depth=18,width=24,norm=gn", "--topologies", "cloud-t4",
            "--methods", "dp,lower-bound", "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    first = (tmp_path / "o" / "report.md").read_text()
    assert "Wall time of this run: " in first and "cells run in it" not in first
    assert main(argv) == 0
    again = (tmp_path / "o" / "report.md").read_text()
    assert "(0 of 2 cells run in it, the others read back from cells.jsonl" in again, again[:400]


def test_a_cell_says_when_tag_execute_would_refuse_its_plan(tmp_path, monkeypatch):
    """A cell whose plan the executor refuses (here a layout with sequence parallelism: simulated
    only) says so in its note on every topology, not only where the suite executes plans."""
    from tag.bench.runner import _Case, _run_cell
    from tag.bench.suites import ModelCase, SuiteConfig
    from tag.parallel import execution_refusal
    from tag.planner import layout_plan

    monkeypatch.setenv("TAG_CACHE_DIR", str(tmp_path / "cache"))
    model = ModelCase("gpt2:n_layer=2,n_embd=64,n_head=4,seq=64", 32)
    cfg = SuiteConfig(name="t", models=[model], topologies=["homogeneous-8xa100"], methods=["dp-tp-pp-grid"], groups=8)
    case = _Case(model, "homogeneous-8xa100", cfg, {})
    sp = layout_plan(case.graph, case.topology, "dp=4,tp=2,sp=1", case.costs)
    refusal = execution_refusal(sp)
    assert refusal is not None
    monkeypatch.setattr(case, "make_plan", lambda method, cfg: (sp, 0))  # the planner stands aside: the note is tested
    cell = _run_cell(case, model, "homogeneous-8xa100", "dp-tp-pp-grid", cfg)
    assert cell.note == f"simulated only: {refusal}" and cell.executed_time_s is None
    monkeypatch.setattr(case, "make_plan", lambda method, cfg: (layout_plan(case.graph, case.topology, "dp=8", case.costs), 0))
    assert _run_cell(case, model, "homogeneous-8xa100", "dp-tp-pp-grid", cfg).note == ""
