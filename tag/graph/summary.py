"""Human-readable and JSON summaries of a captured graph (used by ``tag inspect``)."""

from __future__ import annotations

from collections import Counter

from .grouping import op_weight
from .ir import OpGraph


def group_summary(graph: OpGraph, g: int) -> dict:
    """FLOPs (fwd+bwd), parameter bytes, op counts and roofline weight of group ``g``."""
    grp = graph.groups[g]
    b = graph.batch_size
    phases = Counter(graph.ops[i].phase for i in grp.ops)
    return {
        "group": g,
        "ops": len(grp.ops),
        "fwd_ops": phases.get("fwd", 0),
        "bwd_ops": phases.get("bwd", 0),
        "params": len(grp.params),
        "param_bytes": sum(graph.params[p].nbytes for p in grp.params),
        "flops": sum(graph.ops[i].flops.at(b) for i in grp.ops if graph.ops[i].phase != "opt"),
        "weight_s": sum(op_weight(graph, i) for i in grp.ops),
        "first_op": next((graph.ops[i].name for i in grp.ops if graph.ops[i].phase == "fwd"), ""),
    }


def graph_summary(graph: OpGraph, *, top: int = 5) -> dict:
    """Totals plus the ``top`` heaviest groups (by reference roofline time)."""
    groups = [group_summary(graph, g) for g in range(graph.num_groups)]
    heaviest = sorted(groups, key=lambda s: -s["weight_s"])[:top]
    return {
        "model": graph.model,
        "batch_size": graph.batch_size,
        "precision": graph.precision,
        "optimizer": graph.optimizer,
        "num_ops": len(graph.ops),
        "num_ops_by_phase": dict(Counter(op.phase for op in graph.ops)),
        "num_groups": graph.num_groups,
        "num_params": graph.num_params,
        "param_bytes": graph.param_bytes,
        "opt_state_bytes": sum(p.opt_state_bytes for p in graph.params),
        "flops_fwd": graph.flops(("fwd",)),
        "flops_fwd_bwd": graph.flops(("fwd", "bwd")),
        "flops_opt": graph.flops(("opt",)),
        "activation_bytes": graph.activation_bytes(),
        "batch_tensors": sum(1 for t in graph.tensors if t.batch_dim is not None),
        "signature": graph.signature(),
        "heaviest_groups": heaviest,
    }
