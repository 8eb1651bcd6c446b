"""The planner benchmark's progress curves, from a search's recorded improvements."""

import numpy as np
import pytest

from evaluation.planner_bench import _reach, best_so_far, plot_progress, search_row


def test_progress_curve_follows_the_search(captured, tmp_path):
    from tag.topology import load_topology
    graph = captured("gpt2", batch=16, groups=8).graph
    topo = load_topology("topologies/tag-testbed.yaml")
    runs = {"gnn50": dict(prior="uniform", budget=10, compression="off"),
            "uniform2000": dict(prior="uniform", budget=40, compression="off"),
            "sa200": dict(searcher="sa", budget=5, compression="off"),
            "random200": dict(searcher="random", budget=5, compression="off"),
            "tpe": dict(searcher="tpe", budget=5, compression="off")}
    row = search_row(graph, topo, runs, seed=0)
    imp = row["uniform2000"]["improvements"]
    assert imp and all(a[0] < b[0] and a[1] > b[1] for a, b in zip(imp, imp[1:]))  # strictly better
    assert imp[0][0] == row["uniform2000"]["first_beat_dp"]
    curve = best_so_far(row, "uniform2000", 40)
    best_dp = min(row["dp_even_s"], row["dp_prop_s"])
    assert curve[0] <= best_dp and np.all(np.diff(curve) <= 0)
    assert curve[-1] == pytest.approx(row["uniform2000"]["time_s"], rel=1e-9)
    assert np.all(curve[: imp[0][0] - 1] == best_dp)  # data parallel until the first improvement
    # the first playout within 1% of uniform's final plan is where the curve first gets there
    hit = _reach(row, "uniform2000", 1.01)
    first = int(np.argmax(curve <= row["uniform2000"]["time_s"] * 1.01)) + 1
    assert hit == first
    out = tmp_path / "q.png"
    plot_progress([row, row], {k: kw["budget"] for k, kw in runs.items()}, out)
    assert out.stat().st_size > 10_000


def test_reference_run_supplies_the_searchers_without_the_predictor(tmp_path):
    """``--reference``: an earlier run's uniform / SA / random / TPE rows stand in for running them
    again, only when its pipelines, seed and budgets are this run's and it holds the pair."""
    import argparse
    import json

    from evaluation.planner_bench import _reference, _reused
    from tag.errors import TagError
    row = {"model": "m", "batch": 8, "groups": 4, "topology": "t", "gnn50": {"time_s": 2.0},
           "uniform2000": {"time_s": 1.0}}
    path = tmp_path / "ref.json"
    path.write_text(json.dumps({"rows": [row], "budgets": {"gnn50": 50, "uniform2000": 2000},
                                "options": {"pipelines": "auto", "seed": 0}}))
    args = argparse.Namespace(reference=str(path), pipelines="auto", seed=0)
    ref = _reference(args, {"gnn50": 50, "uniform2000": 2000})
    assert _reused(ref, ("m", 8, 4, "t"), path) == {"uniform2000": {"time_s": 1.0}}  # never gnn50
    assert _reused({}, ("m", 8, 4, "t"), None) == {}
    with pytest.raises(TagError, match="no row for"):
        _reused(ref, ("m", 8, 5, "t"), path)
    with pytest.raises(TagError, match=r"options\.pipelines: expected 'off'"):
        _reference(argparse.Namespace(reference=str(path), pipelines="off", seed=0), {"gnn50": 50})
    with pytest.raises(TagError, match=r"budgets\.uniform2000: expected 500, got 2000"):
        _reference(args, {"gnn50": 50, "uniform2000": 500})
