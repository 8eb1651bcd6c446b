"""Which backward tensors are gradients, and which of those are partial sums over a replica's
samples (shared by the executor's move rules and the simulator's costing of them)."""

from __future__ import annotations

import functools

import torch

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


def batch_independent_tensors(graph: OpGraph) -> set[int]:
    """Non-batch tensors computed from parameters, buffers and constants only (the parameters
    included): the same in every micro-batch of a pipeline (a tied weight, its bf16 cast or
    transpose, a rotary table from ``arange``, a causal mask from ``full``).

    A tensor with a user input or the loss among its ancestors is not, nor one below an op drawing
    random numbers (each micro-batch draws its own) or below an op whose arguments hold the batch
    size (:attr:`Op.reads_batch`: a pipeline's micro-batches run graphs exported at their own
    sizes). In a graph that does not record ``reads_batch``, an op without inputs (``full``,
    ``arange``) is taken to hold it.
    """
    tensors = graph.tensors
    fixed = {i for i, t in enumerate(tensors) if t.producer < 0 and t.kind in ("param", "buffer", "const")}
    for op in graph.ops:  # topological order
        if (op.phase != "opt" and all(t in fixed for t in op.inputs) and not draws_random(op)
                and (not op.reads_batch if op.reads_batch is not None else bool(op.inputs))):
            fixed.update(op.outputs)
    return {t for t in fixed if tensors[t].batch_dim is None}


@functools.cache
def is_random(target: str) -> bool:
    """Whether the ATen overload named ``target`` (``aten.native_dropout.default``) draws random
    numbers (PyTorch tags it ``nondeterministic_seeded``: ``rand``, ``bernoulli``, dropout, ...)."""
    ns, _, rest = target.partition(".")
    name, _, overload = rest.partition(".")
    try:
        op = getattr(getattr(getattr(torch.ops, ns), name), overload or "default")
    except (AttributeError, RuntimeError):
        return False  # not an ATen overload (``getitem``, an optimizer update)
    return torch.Tag.nondeterministic_seeded in op.tags


def draws_random(op) -> bool:
    """Whether :class:`~tag.graph.ir.Op` ``op`` draws random numbers: a fused attention by its
    recorded dropout probability (:attr:`~tag.graph.ir.Op.attention`; PyTorch tags every fused
    attention overload ``nondeterministic_seeded``, dropout or not), any other op by
    :func:`is_random`."""
    if op.attention is not None:
        return op.attention[3] > 0
    return is_random(op.target)


def node_draws_random(node) -> bool:
    """:func:`draws_random` for a node of an exported joint graph (``torch.fx.Node``): an ATen
    overload tagged ``nondeterministic_seeded``, a fused attention only with ``dropout_p`` above 0
    (every fused attention overload carries the tag), or a target with a true ``draws_random``
    attribute (a wrapper around such an op)."""
    from .masks import arg_names, bind

    target = node.target
    if getattr(target, "draws_random", False):  # a wrapper that says so (tag.executor.tensor_parallel)
        return True
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    if "dropout_p" in arg_names(target):
        return float(bind(target, node.args, node.kwargs).get("dropout_p") or 0.0) > 0
    return True


def deferrable_sums(graph: OpGraph) -> set[int]:
    """Partial sums (:func:`partial_sum_tensors`) that a pipeline may sum over its micro-batches
    at their producer and move once, after the last micro-batch, the consumer getting zeros at
    the earlier ones.

    That is exact when whatever the consumer computes from the tensor is linear in it with
    coefficients the same in every micro-batch: every backward op reading it, or reading what is
    computed from it, reads only gradients (linear in the seed, summed over the micro-batches
    like it) and batch-independent tensors (:func:`batch_independent_tensors`), and writes no
    batch-carrying tensor. A tied weight's gradient summed into the weight's gradient is one; a
    gradient flowing back into activations (a batch norm's statistics) or scaled by a saved
    activation is not.
    """
    grads = gradient_tensors(graph)
    linear = grads | batch_independent_tensors(graph)
    tensors, ops = graph.tensors, graph.ops
    ok_op = [True] * len(ops)
    for i in range(len(ops) - 1, -1, -1):  # consumers come after their inputs: reverse order
        op = ops[i]
        if op.phase == "opt":  # the optimizer reads the final gradients once, after the sync
            continue
        ok_op[i] = all(t in linear for t in op.inputs) and all(
            tensors[t].batch_dim is None and all(ok_op[c] for c in tensors[t].consumers) for t in op.outputs)
    return {t for t in partial_sum_tensors(graph) if all(ok_op[c] for c in tensors[t].consumers)}


def tied_weights(graph: OpGraph) -> dict[int, tuple[int, frozenset[int]]]:
    """Parameters read by the forward of op-groups other than the one finishing their gradient,
    whose contribution from there is one partial sum added into the gradient: parameter tensor ->
    (that partial sum, the other groups reading the parameter or making the partial sum). GPT-2's
    input embedding and LM head: the LM head's weight gradient (in fp16 its cast back to fp32),
    summed into the embedding's by the final ``add``.

    On a pipeline where those groups are in one stage and the owner in another, each of the two
    stages holds its own copy of the weight (Megatron-LM's and DeepSpeed's tied embeddings): the
    reading stage keeps its partial sum, summed over its micro-batches, and the two copies'
    gradients are all-reduced over both stages' replicas (:func:`tag.parallel.schedule.build_schedule`,
    :mod:`tag.sim.engine`).

    The conditions: the parameter's gradient is made by ``aten.add.Tensor`` of two distinct
    tensors, one made in its owner group, the other (the partial sum) a deferrable sum
    (:func:`deferrable_sums`) of the parameter's bytes, made in another group and read by that
    ``add`` only; no backward op outside those groups reads the parameter.
    """
    tensors, ops = graph.tensors, graph.ops
    deferred = None
    out: dict[int, tuple[int, frozenset[int]]] = {}
    for p in graph.params:
        fin = tensors[p.grad].producer
        if fin < 0 or ops[fin].target != "aten.add.Tensor" or len(set(ops[fin].inputs)) != 2:
            continue
        owner = ops[fin].group
        far = [t for t in ops[fin].inputs if tensors[t].producer >= 0 and ops[tensors[t].producer].group != owner]
        if len(far) != 1:
            continue
        x = far[0]
        xt = tensors[x]
        if xt.consumers != [fin] or xt.nbytes.fixed != p.nbytes or xt.nbytes.per_sample:
            continue
        readers = {ops[c].group for c in tensors[p.tensor].consumers if ops[c].phase == "fwd"} - {owner}
        holders = frozenset(readers | {ops[xt.producer].group})
        if not readers or any(ops[c].phase == "bwd" and ops[c].group not in holders | {owner}
                              for c in tensors[p.tensor].consumers):
            continue
        if deferred is None:
            deferred = deferrable_sums(graph)
        if x in deferred:
            out[p.tensor] = (x, holders)
    return out


def backward_homes(graph: OpGraph) -> dict[int, tuple[int, int]]:
    """Backward ops that run in a later op-group than the one they were grouped with: op index ->
    (group, forward position).

    The grouping anchors a backward op at ``min(max forward input, min backward input)``, and one
    reading forward values only (``3 x**2`` of the backward of ``x**3`` in GPT-2's tanh GELU) at
    its latest forward input: when a group boundary falls between a forward tensor ``x`` and the
    ops reading it, the ops summing the partial terms of ``x``'s gradient (and that ``3 x**2``)
    land in ``x``'s group, and each term crossed the boundary backwards where ``x``'s gradient
    alone should (GPT-2's GELU: three terms, 3x the forward bytes). Here, in graph order, a
    backward op of group ``A`` moves to a later group ``B`` when it makes a batch-carrying tensor,
    read in ``A`` only, no larger than the inputs it reads from ``B``'s backward that nothing else outside ``B``
    reads (which then stop crossing), and every other input is there already: made by ``B``, a forward value ``B``'s forward reads, a graph input or buffer, or the
    output of an op of ``A`` reading such values only, which moves with it (when it feeds nothing
    else). An op returning a tuple (``native_layer_norm_backward``: the input's gradient and the
    weight's and bias's) is judged by its projections' results: the batch-carrying ones as above,
    the others parameter gradients the optimizer alone reads (the parameter's owner then moves
    with it, as the placements take the owner from its gradient's producer); its projections
    follow it. A transformer layer cut at its first op, a pre-LN block's layer norm, had that
    norm's backward in the earlier group: the boundary carried back the norm's output gradient
    and the residual's, 2x the forward bytes (GPT-2, 2026-11-29). The executor's placement
    (:func:`tag.parallel.schedule.build_schedule`) and the simulator's
    (:func:`tag.sim.static.build_static`) read it; the ops' costs stay with their groups."""
    ops, tensors = graph.ops, graph.tensors
    home = [op.group for op in ops]
    where = [op.anchor for op in ops]
    fwd_reads: dict[int, set[int]] = {}  # group -> forward tensors its forward ops read
    for op in ops:
        if op.phase == "fwd":
            fwd_reads.setdefault(op.group, set()).update(op.inputs)
    out: dict[int, tuple[int, int]] = {}

    def there(t: int, b: int) -> bool:  # tensor t is on group b's devices in its backward
        p = tensors[t].producer
        if p < 0:  # a graph input, buffer or constant is everywhere; a parameter where it is read
            return tensors[t].kind != "param" or t in fwd_reads.get(b, ())
        return home[p] == b or (ops[p].phase == "fwd" and t in fwd_reads.get(b, ()))

    grads_of = {p.grad for p in graph.params}
    for i, op in enumerate(ops):
        if op.phase != "bwd" or not op.outputs:
            continue
        results, projections = _results(i, ops, tensors, grads_of)
        if results is None:
            continue
        a = home[i]
        later = {home[tensors[t].producer] for t in op.inputs if tensors[t].producer >= 0
                 and ops[tensors[t].producer].phase == "bwd" and home[tensors[t].producer] > a}
        if len(later) != 1:
            continue
        (b,) = later
        # the inputs from b's backward that stop crossing (no other reader outside b)
        freed = sum(tensors[t].nbytes.per_sample for t in set(op.inputs) if tensors[t].producer >= 0
                    and ops[tensors[t].producer].phase == "bwd" and home[tensors[t].producer] == b
                    and all(c == i or home[c] == b or ops[c].phase == "opt" for c in tensors[t].consumers))
        if not freed or sum(tensors[t].nbytes.per_sample for t in results) > freed or any(
                home[c] != a for t in results if tensors[t].batch_dim is not None for c in tensors[t].consumers):
            continue  # (its result crosses back to a, and to a alone)
        pulled: list[int] = []
        if not all(there(t, b) or _pull(t, i, a, b, ops, tensors, home, there, pulled) for t in op.inputs):
            continue
        # at the earliest backward input of b of the ops that move (backward data flows to the same
        # or an earlier position: an mp group's chunks run their backward in reverse order)
        anchor = min(where[tensors[t].producer] for j in [*pulled, i] for t in ops[j].inputs
                     if tensors[t].producer >= 0 and ops[tensors[t].producer].phase == "bwd"
                     and home[tensors[t].producer] == b)
        for j in [*pulled, i, *projections]:
            home[j], where[j] = b, anchor
            out[j] = (b, anchor)
    return out


def param_groups(graph: OpGraph) -> list[int]:
    """The op-group owning each of ``graph.params`` (same order): the group whose backward makes its
    gradient where :func:`backward_homes` runs it (a layer norm's weight goes with its backward when
    that moves to the next group), else the parameter's own group. The executor's schedule
    (:func:`tag.parallel.schedule.build_schedule`), the simulator (:func:`tag.sim.static.build_static`)
    and the search's per-group sizes (:class:`tag.search.costs.GroupCosts`) all bucket, sync, shard
    and step a parameter in this group."""
    ops, tensors, homes = graph.ops, graph.tensors, backward_homes(graph)
    out = []
    for p in graph.params:
        i = tensors[p.grad].producer
        while i >= 0 and ops[i].target == "getitem" and ops[i].inputs:  # (where its producer runs)
            i = tensors[ops[i].inputs[0]].producer
        out.append(homes.get(i, (ops[i].group, 0))[0] if i >= 0 and ops[i].phase != "opt" else p.group)
    return out


def _results(i: int, ops, tensors, grads_of: set[int]) -> tuple[list[int] | None, list[int]]:
    """What backward op ``i`` makes for :func:`backward_homes`, and the tuple projections that
    move with it: its outputs when all carry the batch; for an op returning a tuple (an output
    without a batch dimension read by ``getitem`` ops alone), its projections' results, each
    batch-carrying or a parameter's gradient (``grads_of``) read by the optimizer alone, at least
    one batch-carrying; else None (it stays)."""
    op = ops[i]
    if all(tensors[t].batch_dim is not None for t in op.outputs):
        return list(op.outputs), []
    projections = [c for t in op.outputs for c in tensors[t].consumers]
    if not projections or any(tensors[t].batch_dim is not None for t in op.outputs) or any(
            ops[c].target != "getitem" for c in projections):
        return None, []
    results = [t for c in projections for t in ops[c].outputs]
    for t in results:
        if tensors[t].batch_dim is None and not (
                t in grads_of and all(ops[c].phase == "opt" for c in tensors[t].consumers)):
            return None, []
    if not any(tensors[t].batch_dim is not None for t in results):
        return None, []
    return results, projections


def _pull(t: int, reader: int, a: int, b: int, ops, tensors, home, there, pulled: list[int], depth: int = 8) -> bool:
    """Whether tensor ``t``, read by op ``reader`` only, is made by a backward op of group ``a``
    that can move to group ``b`` with it (its inputs there, or made so in turn, up to ``depth``
    ops deep); the ops that move are appended to ``pulled`` (inputs first)."""
    p = tensors[t].producer
    if depth == 0 or p < 0 or ops[p].phase != "bwd" or home[p] != a or tensors[t].consumers != [reader]:
        return False
    if len(ops[p].outputs) != 1:
        return False
    if all(there(x, b) or _pull(x, p, a, b, ops, tensors, home, there, pulled, depth - 1) for x in ops[p].inputs):
        pulled.append(p)
        return True
    return False
