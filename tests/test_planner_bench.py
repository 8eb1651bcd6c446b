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


def test_reuse_takes_stored_methods_and_refuses_another_cost_model(captured, tmp_path):
    """A run computing only some methods of a pair takes the others from stored results (same
    key), and refuses them when the pair's data-parallel baselines differ now."""
    import json

    from evaluation.planner_bench import _finish_row, _merge_reused, load_reuse, pair_key, report_md
    from tag.topology import load_topology
    graph = captured("gpt2", batch=16, groups=8).graph
    topo = load_topology("topologies/tag-testbed.yaml")
    key = pair_key("gpt2", 16, 8, None, topo.name, "off", 0)
    runs = {"gnn50": dict(prior="uniform", budget=4, compression="off"),
            "uniform2000": dict(prior="uniform", budget=30, compression="off"),
            "random200": dict(searcher="random", budget=6, compression="off")}
    ident = {"key": key, "model": "gpt2", "batch": 16, "groups": 8, "topology": topo.name}
    stored = {**ident, **search_row(graph, topo, runs, seed=0)}
    _finish_row(stored)
    assert stored["gnn50"]["prior"] == "uniform" and stored["gnn50"]["budget"] == 4
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"rows": [stored]}))
    old = load_reuse(str(path))[key]
    # recompute gnn50 alone (another budget: it must be this run's, not the stored one)
    todo = {"gnn50": dict(prior="uniform", budget=2, compression="off")}
    row = {**ident, **search_row(graph, topo, todo, seed=0)}
    _merge_reused(row, old, todo, key)
    _finish_row(row)
    assert row["gnn50"]["budget"] == 2 and not row["gnn50"].get("reused")
    for n in ("uniform2000", "random200"):
        assert row[n]["reused"] and row[n]["improvements"] == stored[n]["improvements"]
    assert row["gnn50_over_uniform2000"] == row["gnn50"]["time_s"] / stored["uniform2000"]["time_s"]
    md = report_md({"rows": [row], "budgets": {"gnn50": 2, "uniform2000": 30, "random200": 6}})
    assert "| random | 6 |" in md and f"{stored['random200']['time_s'] * 1e3:.2f}" in md
    bad = {**old, "dp_even_s": old["dp_even_s"] * 1.5}
    row2 = {"key": key, **search_row(graph, topo, todo, seed=0)}
    with pytest.raises(SystemExit, match="dp_even_s"):
        _merge_reused(row2, bad, todo, key)


def test_layout_grid_off_returns_the_search_alone(captured):
    """find_plan(layout_grid=False) over the default space: no layout grid ran, the plan is the
    search's own (what the benchmark compares searchers on)."""
    from tag.planner import PlannerConfig, find_plan
    from tag.topology import load_topology
    graph = captured("gpt2", batch=16, groups=8).graph
    topo = load_topology("topologies/tag-testbed.yaml")
    kw = dict(prior="uniform", budget=6, compression="off", executable=False, pipelines="auto")
    alone = find_plan(graph, topo, PlannerConfig(layout_grid=False, **kw))
    assert "layouts" not in alone.meta and alone.meta["source"] != "layout-grid"
    assert alone.meta["space"]["tp_actions"] > 0  # the default space, not pipelines="off"'s
    full = find_plan(graph, topo, PlannerConfig(**kw))
    assert full.meta["layouts"] >= 1
    assert full.predicted_iteration_time_s <= alone.predicted_iteration_time_s
