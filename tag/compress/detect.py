"""Find Sufficient Factor Broadcasting (SFB) candidates in a captured :class:`~tag.graph.ir.OpGraph`.

A parameter gradient is an SFB candidate when it is (up to layout ops: views, permutes,
reshapes, ...) either

* ``mm``: the output of an ``aten.mm``/``addmm``/``bmm`` whose two matrix operands both carry the
  batch along the *contracted* dimension, i.e. ``dW = sum_over_samples(X_s^T dY_s)`` (linear
  layers, GPT-2's ``Conv1D`` addmm, q/k/v projections); or
* ``sum``: an ``aten.sum`` that reduces a batch-carrying tensor over its batch dimension
  (biases: ``db = sum_over_samples(dY_s)``; LayerNorm weights: ``sum(dY * x_hat)``).

Replicas then exchange the *factors* (the batch-carrying operands, found by walking back through
layout ops to the op that materialises them) instead of all-reducing ``dW``, and every replica
recomputes the full ``dW`` on the gathered global batch. Detection is purely structural: op
targets and the tensors' ``batch_dim`` (found by two-batch capture), never module names.
Convolutions (``convolution_backward`` computes ``dW`` internally) are not claimed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..graph.ir import Affine, OpGraph

# ATen ops that only relabel or copy data without changing the element count.
LAYOUT_OPS = frozenset({
    "aten.view", "aten.reshape", "aten._unsafe_view", "aten.permute", "aten.transpose", "aten.t",
    "aten.alias", "aten.unsqueeze", "aten.squeeze", "aten.clone", "aten.contiguous",
    "aten._reshape_alias", "aten.detach",
})
# target -> (index of the left operand among the op's inputs, contracted dim of left, of right)
MATMUL_OPS = {"aten.mm": (0, 1, 0), "aten.addmm": (1, 1, 0), "aten.bmm": (0, 2, 1)}
SUM_OPS = frozenset({"aten.sum"})

Kind = Literal["mm", "sum"]


def _packet(target: str) -> str:
    """``aten.permute.default`` -> ``aten.permute``."""
    parts = target.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else target


@dataclass(frozen=True)
class Factor:
    """A batch-carrying tensor that replicas all-gather (by sample rows) for SFB."""

    tensor: int
    """Index into :attr:`OpGraph.tensors` of the materialised tensor (after walking back views)."""
    name: str
    """Its joint-graph node name."""
    batch_dim: int
    """Dimension carrying the samples: the all-gather concatenates along it."""
    bytes_per_sample: float
    """Bytes per sample (a replica with ``b`` samples contributes ``b * bytes_per_sample``)."""
    phase: str
    """Phase of its producer (``fwd`` activation, ``bwd`` gradient, ``input`` graph input)."""


@dataclass(frozen=True)
class Candidate:
    """One weight-gradient op whose gradient can be synchronised by SFB."""

    op: int
    """Index into :attr:`OpGraph.ops` of the gradient op (the ``mm``/``bmm``/``sum``)."""
    op_name: str
    """Its joint-graph node name: what :attr:`GroupPlan.sfb` lists."""
    kind: Kind
    """``mm`` (product of two factors) or ``sum`` (batch reduction of one factor)."""
    param: str
    """Parameter name whose gradient this op produces."""
    grad_node: str
    """Joint-graph node name of the parameter's gradient (the gradient op, or a view of it)."""
    group: int
    """Op-group of the gradient op (the replicas of that group exchange the factors)."""
    factors: tuple[Factor, ...]
    """The factors to all-gather: ``(X, dY)`` for ``mm``, ``(dY,)`` for ``sum``."""
    grad_bytes: int
    """Bytes of the parameter gradient the all-reduce would otherwise move."""
    flops: Affine
    """FLOPs of the gradient op as a function of the batch it runs on (samples)."""
    bytes_moved: Affine
    """Memory bytes read + written by the gradient op as a function of its batch."""
    recompute_flops: float
    """FLOPs of recomputing ``dW`` at the full global batch (``flops.at(graph.batch_size)``)."""


def find_candidates(graph: OpGraph) -> list[Candidate]:
    """All SFB candidates of ``graph``, in parameter order (at most one per parameter)."""
    out = []
    for p in graph.params:
        c = _candidate(graph, p.grad, p.name, p.nbytes)
        if c is not None:
            out.append(c)
    return out


def _through_layout(graph: OpGraph, t: int) -> int:
    """Walk back from tensor ``t`` through single-input, size-preserving layout ops."""
    while True:
        prod = graph.tensors[t].producer
        if prod < 0:
            return t
        op = graph.ops[prod]
        if _packet(op.target) not in LAYOUT_OPS or len(op.inputs) != 1:
            return t
        src = op.inputs[0]
        if graph.tensors[src].nbytes != graph.tensors[t].nbytes:
            return t
        t = src


def _factor(graph: OpGraph, t: int) -> Factor | None:
    """The materialised batch-carrying tensor behind operand ``t``, or None."""
    src = _through_layout(graph, t)
    ten = graph.tensors[src]
    if ten.batch_dim is None or ten.nbytes.per_sample <= 0:
        return None
    phase = "input" if ten.producer < 0 else graph.ops[ten.producer].phase
    return Factor(src, ten.name, ten.batch_dim, ten.nbytes.per_sample, phase)


def _candidate(graph: OpGraph, grad: int, param: str, grad_bytes: int) -> Candidate | None:
    t = _through_layout(graph, grad)
    if graph.tensors[t].batch_dim is not None or graph.tensors[t].producer < 0:
        return None
    i = graph.tensors[t].producer
    op = graph.ops[i]
    if op.phase != "bwd":
        return None
    packet = _packet(op.target)
    if packet in MATMUL_OPS:
        left, dim_l, dim_r = MATMUL_OPS[packet]
        if len(op.inputs) < left + 2:
            return None  # the same tensor on both sides (deduplicated inputs): not X^T dY
        a, b = op.inputs[left], op.inputs[left + 1]
        if graph.tensors[a].batch_dim != dim_l or graph.tensors[b].batch_dim != dim_r:
            return None
        fa, fb = _factor(graph, a), _factor(graph, b)
        if fa is None or fb is None or fa.tensor == fb.tensor:
            return None
        factors: tuple[Factor, ...] = (fa, fb)
        kind: Kind = "mm"
    elif packet in SUM_OPS:
        if len(op.inputs) != 1 or graph.tensors[op.inputs[0]].batch_dim is None:
            return None  # the output has no batch dim, so the reduction covered it
        f = _factor(graph, op.inputs[0])
        if f is None:
            return None
        factors, kind = (f,), "sum"
    else:
        return None
    return Candidate(i, op.name, kind, param, graph.tensors[grad].name, op.group, factors, int(grad_bytes),
                     op.flops, op.bytes_read + op.bytes_written, op.flops.at(graph.batch_size))
