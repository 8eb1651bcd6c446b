"""The public API from ``import tag``: every exported name resolves, and the pipeline runs end to end."""

from __future__ import annotations

import pytest

import tag
from tag.parallel import validate_plan


def test_every_export_resolves():
    for name in tag.__all__:
        assert getattr(tag, name) is not None, name
    with pytest.raises(AttributeError):
        tag.no_such_name  # noqa: B018


def test_plan_is_the_format_package_and_find_plan_the_planner():
    """No module-class swapping: ``tag.plan`` is a plain subpackage (plan format), the planner is
    ``tag.find_plan``."""
    import types

    assert type(tag.plan) is types.ModuleType and not callable(tag.plan)
    assert tag.plan.Plan is tag.Plan
    from tag.planner import PlannerConfig, PlannerResult, find_plan

    assert tag.find_plan is find_plan and tag.PlannerConfig is PlannerConfig and tag.PlannerResult is PlannerResult


def test_pipeline_end_to_end(tmp_path):
    wl = tag.load_workload("mlp:layers=2,hidden=64", batch=16)
    graph = tag.capture(wl, num_groups=3).graph
    topo = tag.load_topology("cloud-t4")
    plan = tag.find_plan(graph, topo, tag.PlannerConfig(searcher="mcts", prior="uniform", budget=20, seed=3))
    validate_plan(plan, graph, topo)
    res = tag.simulate(graph, topo, plan)
    assert res.iteration_time_s == pytest.approx(plan.predicted_iteration_time_s)
    dp = tag.simulate(graph, topo, tag.data_parallel(graph, topo)).iteration_time_s
    assert res.iteration_time_s <= dp  # never worse than data parallel
    path = tmp_path / "plan.json"
    plan.save(path)
    assert tag.Plan.load(path) == plan
    # same seed, same plan
    again = tag.find_plan(graph, topo, tag.PlannerConfig(searcher="mcts", prior="uniform", budget=20, seed=3))
    assert [g.key() for g in again.groups] == [g.key() for g in plan.groups]


def test_layout_plan_from_a_string():
    """`tag.layout_plan(graph, topo, "dp=..,pp=..")`: what `tag simulate --layout` costs, from Python;
    a layout the topology cannot hold is one PlanError line."""
    from tag.cost.model import CostModel
    from tag.errors import PlanError
    from tag.parallel.layout import layout_plan, parse_layout

    graph = tag.capture(tag.load_workload("mlp", batch=16), num_groups=4).graph
    topo = tag.load_topology("cloud-t4")  # 8 T4s on 4 machines
    plan = tag.layout_plan(graph, topo, "dp=4,pp=2,micro=2")
    ref = layout_plan(graph, topo, parse_layout("dp=4,pp=2,micro=2"), CostModel.for_topology(graph, topo))
    assert plan.to_dict() == ref.to_dict() and plan.pipeline is not None and len(plan.pipeline.stages) == 2
    assert tag.simulate(graph, topo, plan).iteration_time_s > 0
    with pytest.raises(PlanError, match=r"dp\*tp\*pp = 3\*1\*1 = 3 devices, but topology 'cloud-t4' has 8"):
        tag.layout_plan(graph, topo, "dp=3")
    with pytest.raises(PlanError, match="layout: foo: unknown key"):
        tag.layout_plan(graph, topo, "foo=2")


def test_find_plan_collects_young_objects_less_often_and_puts_the_threshold_back():
    """While the search runs the collector's youngest generation waits for GC_YOUNG_OBJECTS
    allocations (the planner's objects live until it returns); after it, and after a refused call,
    the caller's thresholds are back."""
    import gc

    from tag.errors import TagError
    from tag.planner import GC_YOUNG_OBJECTS, PlannerConfig, find_plan

    wl = tag.load_workload("mlp:layers=2,hidden=64", batch=16)
    graph = tag.capture(wl, num_groups=3).graph
    topo = tag.load_topology("cloud-t4")
    old = gc.get_threshold()
    seen = []
    try:
        gc.set_threshold(700, 11, 12)
        find_plan(graph, topo, PlannerConfig(prior="uniform", budget=3, compression="off"), progress=lambda stage, *_: seen.append(gc.get_threshold()))
        assert seen and all(t == (GC_YOUNG_OBJECTS, 11, 12) for t in seen)
        assert gc.get_threshold() == (700, 11, 12)
        with pytest.raises(TagError, match="budget"):
            find_plan(graph, topo, PlannerConfig(prior="uniform", budget=0))
        assert gc.get_threshold() == (700, 11, 12)
    finally:
        gc.set_threshold(*old)
