"""TAG: topology-aware deployment of PyTorch training on heterogeneous GPUs and links.

Public API (imported lazily so ``import tag`` stays cheap)::

    wl = tag.load_workload("gpt2:n_layer=4", batch=16)
    cap = tag.capture(wl)                       # cap.graph is the OpGraph
    topo = tag.load_topology("tag-testbed")     # a shipped topology, or a YAML/JSON path
    plan = tag.find_plan(cap.graph, topo)       # GNN-guided MCTS -> tag.Plan
    quick = tag.find_plan(cap.graph, topo, tag.PlannerConfig(prior="uniform", budget=50, seed=0))
    tag.PlannerResult.of(plan).source           # the planner's meta, typed
    result = tag.simulate(cap.graph, topo, plan)
    hand = tag.simulate(cap.graph, topo, tag.layout_plan(cap.graph, topo, "dp=8,pp=2,micro=2"))
    published = tag.Layout(dp=8, pp=2, micro=2, stages=(3, 1), order=("gtx0", "gtx1", "gtx2", "gtx3", "v100",
                                                                      "p100-0", "p100-1"))  # layers 0-2 on GTXs
    tag.align_groups(cap.graph, published)      # op-groups starting at each stage's first layer (in place)
    costed = tag.simulate(cap.graph, topo, tag.layout_plan(cap.graph, topo, published))
    measured = tag.execute(tag.ExecuteConfig(spec, topology_path, plan_path))  # one machine
    tag.train_run(tag.ExecuteConfig(spec, topology_path, plan_path, run_dir="run1"),  # tag run: train with it
                  tag.TrainSpec(steps=1000, checkpoint_dir="ckpt", checkpoint_every=100, resume="latest"))
    tag.export_plan(plan, cap.graph, topo, "megatron").write("megatron-args.txt")  # or torchtitan, deepspeed
"""

from __future__ import annotations

import importlib

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
    "data_parallel": ("tag.cost.baselines", "data_parallel"),
    "find_plan": ("tag.planner", "find_plan"),
    "PlannerConfig": ("tag.planner", "PlannerConfig"),
    "PlannerResult": ("tag.planner", "PlannerResult"),
    "layout_plan": ("tag.planner", "layout_plan"),
    "export_plan": ("tag.planner", "export_plan"),
    "Layout": ("tag.parallel.layout", "Layout"),
    "align_groups": ("tag.parallel.layout", "align_groups"),
    "validate_plan": ("tag.parallel", "validate_plan"),
    "execution_refusal": ("tag.parallel", "execution_refusal"),
    "build_schedule": ("tag.parallel", "build_schedule"),
    "Strategy": ("tag.parallel", "Strategy"),
    "register_strategy": ("tag.parallel", "register"),
    "simulate": ("tag.sim", "simulate"),
    "Simulator": ("tag.sim", "Simulator"),
    "execute": ("tag.executor", "execute"),
    "ExecuteConfig": ("tag.executor", "ExecuteConfig"),
    "prepare_torchrun": ("tag.executor", "prepare_torchrun"),
    "report_torchrun": ("tag.executor", "report_torchrun"),
    "train_run": ("tag.executor.train", "train"),
    "TrainSpec": ("tag.executor.train", "TrainSpec"),
    "apply_sfb": ("tag.parallel", "apply_sfb"),
    "TagError": ("tag.errors", "TagError"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        mod, attr = _EXPORTS[name]
        return getattr(importlib.import_module(mod), attr)
    try:  # a subpackage not imported yet, e.g. ``tag.plan.local_batches`` after ``import tag``
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'tag' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
