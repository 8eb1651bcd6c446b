"""Group ops into op-groups: contiguous, compute-balanced chunks of forward program order.

TAG partitions with METIS. METIS partitions can be cyclic (group A feeds B feeds A), and a
cyclic quotient graph cannot be executed group by group. We therefore cut the *forward*
program order into ``K`` contiguous chunks, choosing each cut near ``k/K`` of the total
compute where the fewest bytes are live across it; every backward op joins the chunk of the
forward position it is *anchored* to, and every optimizer update joins the group computing its
parameter's gradient. The result is acyclic by construction:

* forward tasks run in group order 0..K-1, backward tasks in order K-1..0;
* a backward op's anchor is ``min(max anchor of its forward inputs, min anchor of its backward
  inputs)``, so backward data only flows from a group to itself or to an earlier group.

A parameter is owned by the group that computes its gradient (for tied weights: where the
contributions are summed); the replicas of that group hold it and update it.
"""

from __future__ import annotations

import numpy as np

from .ir import Group, OpGraph

# Reference device for balancing (the roofline of a V100: 15.7 TFLOP/s FP32, 900 GB/s). Only
# the *ratio* matters for balancing; real costs come from the profiler.
REF_FLOP_RATE = 15.7e12  # FLOP/s
REF_MEM_BANDWIDTH = 900e9  # bytes/s


def _anchors(graph: OpGraph) -> np.ndarray:
    """Forward position each op is anchored to (opt ops: -1, set later)."""
    ops = graph.ops
    anchor = np.full(len(ops), -1, dtype=np.int64)
    pos = 0
    for i, op in enumerate(ops):
        if op.phase == "fwd":
            anchor[i] = pos
            pos += 1
    n_fwd = pos
    unresolved = []
    for i, op in enumerate(ops):
        if op.phase != "bwd":
            continue
        fwd_in, bwd_in = [], []
        for t in op.inputs:
            p = graph.tensors[t].producer
            if p < 0:
                continue
            if ops[p].phase == "fwd":
                fwd_in.append(anchor[p])
            elif anchor[p] >= 0:
                bwd_in.append(anchor[p])
        if fwd_in and bwd_in:
            anchor[i] = min(max(fwd_in), min(bwd_in))
        elif fwd_in:
            anchor[i] = max(fwd_in)
        elif bwd_in:
            anchor[i] = min(bwd_in)
        else:
            unresolved.append(i)
    # Ops fed only by graph inputs (e.g. a transposed weight): as late as all their consumers
    # allow, so backward data still flows towards earlier groups only.
    for i in reversed(unresolved):
        cons = [anchor[c] for t in ops[i].outputs for c in graph.tensors[t].consumers if anchor[c] >= 0]
        anchor[i] = max(cons) if cons else n_fwd - 1
    # A consumer resolved above may have been anchored before this op's anchor was known;
    # re-impose the backward monotonicity (consumer <= producer) in topological order.
    for i, op in enumerate(ops):
        if op.phase != "bwd":
            continue
        for t in op.inputs:
            p = graph.tensors[t].producer
            if p >= 0 and ops[p].phase == "bwd" and anchor[p] < anchor[i]:
                anchor[i] = anchor[p]
    return anchor


def op_weight(graph: OpGraph, i: int, batch: float | None = None) -> float:
    """Roofline time (seconds) of op ``i`` on the reference device; used only to balance."""
    op = graph.ops[i]
    b = graph.batch_size if batch is None else batch
    return max(op.flops.at(b) / REF_FLOP_RATE, (op.bytes_read.at(b) + op.bytes_written.at(b)) / REF_MEM_BANDWIDTH)


def _cut_bytes(graph: OpGraph, anchor: np.ndarray, n_fwd: int) -> np.ndarray:
    """cut[c] = bytes live across the boundary before forward position c."""
    diff = np.zeros(n_fwd + 1)
    b = graph.batch_size
    for t in graph.tensors:
        cons = [anchor[c] for c in t.consumers if graph.ops[c].phase != "opt"]
        if not cons:
            continue
        if t.producer >= 0:
            start = anchor[t.producer]
        elif t.kind in ("param", "buffer", "const"):
            start = min(cons)
        else:
            continue  # user inputs are fed to whoever needs them
        end = max(cons)
        if end > start:
            diff[start + 1] += t.nbytes.at(b)
            diff[end + 1] -= t.nbytes.at(b)
    return np.cumsum(diff)[:n_fwd]


def group_ops(graph: OpGraph, num_groups: int, *, balance_weight: float = 2.0) -> None:
    """Assign ``op.group``, ``op.anchor``, ``param.group`` and ``graph.groups`` in place.

    Args:
        graph: the captured graph.
        num_groups: target number of groups ``K`` (fewer when there are fewer costly ops).
        balance_weight: cost of missing the compute target by one group's worth, relative to
            the cost of cutting the average number of live bytes.
    """
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    anchor = _anchors(graph)
    fwd = [i for i, op in enumerate(graph.ops) if op.phase == "fwd"]
    n_fwd = len(fwd)
    w = np.zeros(n_fwd)
    for i, op in enumerate(graph.ops):
        if op.phase != "opt":
            w[anchor[i]] += op_weight(graph, i)
    cuttable = [c for c in range(1, n_fwd) if op_weight(graph, fwd[c]) > 0]
    k = max(1, min(num_groups, len(cuttable) + 1))
    cum = np.concatenate([[0.0], np.cumsum(w)])  # cum[c] = weight before position c
    total = cum[-1] if cum[-1] > 0 else 1.0
    per = total / k
    cut = _cut_bytes(graph, anchor, n_fwd)
    mean_cut = float(np.mean(cut[cuttable])) if cuttable else 1.0
    mean_cut = mean_cut if mean_cut > 0 else 1.0
    cand = np.array(cuttable, dtype=np.int64)
    cuts: list[int] = []
    prev = 0
    for j in range(1, k):
        target = j * per
        ok = cand[(cand > prev) & (cand <= n_fwd - (k - j))] if len(cand) else cand
        if len(ok) == 0:
            break
        score = cut[ok] / mean_cut + balance_weight * np.abs(cum[ok] - target) / per
        c = int(ok[int(np.argmin(score))])
        cuts.append(c)
        prev = c
    _assign(graph, anchor, cuts, n_fwd)


def group_at(graph: OpGraph, cuts: list[int]) -> None:
    """Assign groups in place as :func:`group_ops` does, cut at the given forward positions
    (ascending, each in ``1 .. forward ops - 1``: where every group after the first begins)
    instead of compute-balanced ones. ``ValueError`` naming the first cut out of order."""
    anchor = _anchors(graph)
    n_fwd = sum(op.phase == "fwd" for op in graph.ops)
    for a, b in zip([0, *cuts], [*cuts, n_fwd]):
        if not a < b:
            raise ValueError(f"group cuts: expected ascending forward positions in 1..{n_fwd - 1}, got {cuts}")
    _assign(graph, anchor, list(cuts), n_fwd)


def _assign(graph: OpGraph, anchor: np.ndarray, cuts: list[int], n_fwd: int) -> None:
    """``op.group``, ``op.anchor``, ``param.group`` and ``graph.groups`` of the groups cut
    before forward positions ``cuts``."""
    group_of_pos = np.searchsorted(np.array(cuts, dtype=np.int64), np.arange(n_fwd), side="right")
    for i, op in enumerate(graph.ops):
        if op.phase != "opt":
            op.anchor = int(anchor[i])
            op.group = int(group_of_pos[anchor[i]])
    for p in graph.params:
        producer = graph.tensors[p.grad].producer
        p.group = graph.ops[producer].group if producer >= 0 else 0
        upd = graph.ops[p.update]
        upd.group, upd.anchor = p.group, graph.ops[producer].anchor if producer >= 0 else 0
    groups = [Group(g, [], []) for g in range(len(cuts) + 1)]
    for i, op in enumerate(graph.ops):
        groups[op.group].ops.append(i)
    for pi, p in enumerate(graph.params):
        groups[p.group].params.append(pi)
    graph.groups = groups
