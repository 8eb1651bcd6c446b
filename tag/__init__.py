"""TAG: topology-aware deployment of PyTorch training on heterogeneous GPUs and links.

Public API (imported lazily so ``import tag`` stays cheap)::

    wl = tag.load_workload("gpt2:n_layer=4", batch=16)
    cap = tag.capture(wl)                       # cap.graph is the OpGraph
    topo = tag.load_topology("topologies/tag-testbed.yaml")
    plan = tag.plan(cap.graph, topo)            # GNN-guided MCTS
    result = tag.simulate(cap.graph, topo, plan)
"""

from __future__ import annotations

import importlib
import types

__version__ = "0.1.0"

# public name -> (module, attribute)
_EXPORTS = {
    "load_workload": ("tag.workloads", "load_workload"),
    "Workload": ("tag.workloads", "Workload"),
    "capture": ("tag.graph", "capture"),
    "OpGraph": ("tag.graph", "OpGraph"),
    "load_topology": ("tag.topology", "load_topology"),
    "Topology": ("tag.topology", "Topology"),
    "Plan": ("tag.plan", "Plan"),
    "GroupPlan": ("tag.plan", "GroupPlan"),
    "data_parallel": ("tag.plan", "data_parallel"),
    "simulate": ("tag.sim", "simulate"),
    "Simulator": ("tag.sim", "Simulator"),
    "execute": ("tag.executor", "execute"),
    "apply_sfb": ("tag.compress", "apply_sfb"),
    "TagError": ("tag.errors", "TagError"),
}

__all__ = sorted([*_EXPORTS, "plan"])


class _PlanPackage(types.ModuleType):
    """``tag.plan`` is both the plan-format subpackage (``tag.plan.Plan``) and the planner entry
    point (``tag.plan(graph, topology, ...)``, i.e. :func:`tag.search.plan`)."""

    def __call__(self, graph, topology, **kwargs):
        from .search import plan as search_plan

        return search_plan(graph, topology, **kwargs)


from . import plan as _plan_package  # noqa: E402 - after the class it becomes

_plan_package.__class__ = _PlanPackage


def __getattr__(name: str):
    if name in _EXPORTS:
        mod, attr = _EXPORTS[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'tag' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
