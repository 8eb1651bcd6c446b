"""Which backward tensors are gradients, and which of those are partial sums over a replica's
samples (shared by the executor's move rules and the simulator's costing of them)."""

from __future__ import annotations

from .ir import OpGraph


def gradient_tensors(graph: OpGraph) -> set[int]:
    """Indices of tensors that depend on the loss-gradient seed (linear in it).

    The seed is the backward op reading the loss (``full_like(loss, 1)``); gradients are its
    backward descendants. Backward tensors outside this set (weight transposes, masks of the
    labels) are identical on every replica of a unit.
    """
    grads: set[int] = set()
    for op in graph.ops:  # ops are in topological (graph) order
        if op.phase == "bwd" and any(t == graph.loss or t in grads for t in op.inputs):
            grads.update(op.outputs)
    return grads


def partial_sum_tensors(graph: OpGraph) -> set[int]:
    """Non-batch gradients that are sums over the replica's samples (e.g. a weight gradient).

    They descend from a batch-carrying gradient. The other non-batch gradients (the seed and
    what is computed from it before it meets the batch: ``1 / count`` of a mean loss) are,
    in full-batch units, the same on every replica, so they are copied, not summed.
    """
    grads = gradient_tensors(graph)
    tensors = graph.tensors
    below_batch: set[int] = set()  # gradients with a batch-carrying gradient among their ancestors
    for op in graph.ops:
        if op.phase != "bwd" or not any(t in grads for t in op.outputs):
            continue
        if any(t in grads and (tensors[t].batch_dim is not None or t in below_batch) for t in op.inputs):
            below_batch.update(op.outputs)
    return {t for t in below_batch if tensors[t].batch_dim is None}
