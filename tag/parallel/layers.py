"""Transformer layers of a captured graph, and the op-groups where each begins.

A published pipeline plan is stated in layers: Megatron-LM's and DeepSpeed's stage ``s`` holds
layers ``sum(stages[:s]) .. sum(stages[:s+1]) - 1``, the first stage also the embedding, the last
the final norm, the LM head and the loss. TAG's plans are stated in op-groups (contiguous runs of
forward program order, :mod:`tag.graph.grouping`), so costing such a plan needs the op-group
where each of its stages' first layers begins.

**Layers.** The captured graph keeps no module tree, but its parameters keep their paths
(``model.transformer.h.3.attn.c_attn.weight``): the layers are the numbered modules of the
module list that holds the most of them (GPT-2's ``transformer.h``, Llama's ``model.layers``,
BERT's ``encoder.layer``, ViT's ``layers``), in the order of their numbers. A layer's *forward
ops* are those computing on the batch with one of its parameters, read directly or through ops
without a batch dimension: its norms and matmuls. Those weight-only ops (a transpose or an
autocast copy of a weight) run where program order puts them, and a group never starts at one
(:func:`tag.graph.grouping.group_ops` cuts only before an op that costs time): BERT's layer
begins with its query weight's transpose, which thus stays with the previous layer's last norm,
and a stage cut there sends that transposed weight along with the activation, as any TAG cut
before that matmul does.

**Where a layer begins.** The cut before layer ``L`` may fall at op-group ``g`` when every
forward op of layers ``< L`` is in a group before ``g`` and every forward op of layers ``>= L``
in ``g`` or after. Of those groups it is the one holding layer ``L``'s first forward op: the ops
between the two layers' parameter reads (the previous layer's last bias add, dropout and residual
add) stay with the previous layer, as in Megatron-LM, and only the residual stream crosses the
cut. Where no group qualifies, layer ``L`` begins inside an op-group and no plan of this grouping
cuts there (:func:`layer_starts` says None).

The embedding's and the head's ops (their parameters are not in the list) fall before the first
layer and after the last by program order. A parameter is held by the group computing its
gradient (:mod:`tag.graph.grouping`): a bias whose gradient only sums the output gradient (GPT-2's
``mlp.c_proj.bias``) is held by the next layer's first group, and so by the next stage when a cut
falls there; its bytes, not its layer's compute, move.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

from ..graph.ir import Affine, OpGraph, Param

NUMBERED = re.compile(r"^(.*?)\.(\d+)\.")
"""A parameter path's first numbered module: ``(list path, number)``."""


@dataclass(frozen=True)
class Layers:
    """The numbered layers of a graph (module docstring)."""

    path: str
    """Module path of the list holding them, e.g. ``model.transformer.h``; "" when none."""
    numbers: tuple[int, ...]
    """Each layer's number in its path (``h.3.``: 3), ascending."""
    ops: tuple[tuple[int, ...], ...]
    """Forward op indices of each layer (those computing on the batch), in layer order."""

    def name(self, layer: int) -> str:
        """Module path of layer ``layer`` (its position, from 0), e.g. ``model.transformer.h.3``."""
        return f"{self.path}.{self.numbers[layer]}"

    def __len__(self) -> int:
        return len(self.ops)


def model_layers(graph: OpGraph) -> Layers:
    """:class:`Layers` of ``graph`` (no layers, ``path`` "", when no parameter path is numbered)."""
    lists: dict[str, dict[int, list[int]]] = {}
    for p in graph.params:
        m = NUMBERED.match(p.name)
        if m:
            lists.setdefault(m.group(1), {}).setdefault(int(m.group(2)), []).append(p.tensor)
    if not lists:
        return Layers("", (), ())
    path = max(lists, key=lambda k: (len(lists[k]), -list(lists).index(k)))  # most layers; ties: the first
    numbers = sorted(lists[path])
    layer_of = {t: i for i, n in enumerate(numbers) for t in lists[path][n]}
    ops: list[list[int]] = [[] for _ in lists[path]]
    for i, o in enumerate(graph.ops):  # program order: a tensor's producer before its readers
        if o.phase != "fwd":
            continue
        read = {layer_of[t] for t in o.inputs if t in layer_of}
        if read and not o.batch:  # a weight's view or cast: still the layer's parameter
            layer_of.update((t, min(read)) for t in o.outputs)
            continue
        for layer in read:
            ops[layer].append(i)
    return Layers(path, tuple(numbers), tuple(tuple(x) for x in ops))


def layer_starts(graph: OpGraph, layers: Layers) -> list[int | None]:
    """Op-group where each layer begins (module docstring; layer 0: its first forward op's
    group), None where the layer begins inside an op-group."""
    first = [min(graph.ops[i].group for i in x) for x in layers.ops]
    last = [max(graph.ops[i].group for i in x) for x in layers.ops]
    out: list[int | None] = [first[0]] if first else []
    before = last[0] if last else -1  # the last group of the layers so far
    for layer in range(1, len(layers)):
        after = min(first[layer:])
        out.append(after if before < after else None)
        before = max(before, last[layer])
    return out


def outside_params(graph: OpGraph, layers: Layers) -> list[Param]:
    """The parameters of ``graph`` outside its numbered ``layers`` (embeddings, final norm, head)."""
    return [p for p in graph.params if not ((m := NUMBERED.match(p.name)) and m.group(1) == layers.path)]


def group_by_layers(graph: OpGraph) -> int:
    """Regroup ``graph`` in place (:func:`tag.graph.grouping.group_at`) into one op-group per
    layer, the embedding's ops before the first and the head's (from the first op after the last
    layer reading a parameter of none: GPT-2's final norm) after the last; return the count.
    Megatron-LM's full activation recomputation checkpoints each layer's input
    (``--recompute-granularity full --recompute-method uniform``, one layer a chunk; Megatron-
    DeepSpeed's ``--checkpoint-activations``, ``--checkpoint-num-layers 1``), and its tensor
    parallelism splits the blocks inside a layer: a TAG op-group recomputes and splits as a
    unit, so this grouping costs a layer as Megatron-LM runs it. Not a plan's grouping (``tag
    execute`` rebuilds a plan's by its count, :func:`tag.graph.grouping.group_ops`). A graph
    without numbered layers keeps its grouping (returns its count)."""
    from ..graph.grouping import group_at

    layers = model_layers(graph)
    if not len(layers):
        return graph.num_groups
    pos: dict[int, int] = {}  # forward op index -> forward position
    for i, o in enumerate(graph.ops):
        if o.phase == "fwd":
            pos[i] = len(pos)
    cuts = [pos[min(ops)] for ops in layers.ops]
    params = {p.tensor for p in outside_params(graph, layers)}
    last = max(layers.ops[-1])
    head = next((pos[i] for i in range(last + 1, len(graph.ops))
                 if graph.ops[i].phase == "fwd" and graph.ops[i].batch and params & set(graph.ops[i].inputs)), None)
    if head is not None:
        cuts.append(head)
    cuts = [c for c in cuts if c > 0]
    group_at(graph, cuts)
    return graph.num_groups


def vocab_parallel_graph(graph: OpGraph, tp: int) -> OpGraph:
    """A copy of ``graph`` costed as Megatron-LM's vocabulary-parallel embedding and head run on
    ``tp`` ranks (a costing of Megatron-LM's runtime: TAG's executor runs no such head). The
    vocabulary parameters: those outside the numbered layers (:func:`model_layers`) of at least
    half the largest such one's elements (GPT-2's token embedding, tied to its head, but not its
    2048-row position embedding or final norm; Llama's embedding and head); their bytes, their
    gradient tensors' and optimizer state scale by ``1 / tp`` (each rank ``1 / tp`` of the rows),
    and so do their optimizer updates' FLOPs and bytes.
    The head (:func:`_head_vocab`): each rank computes ``h x (V / tp)`` logits for all of its
    replica's tokens, so the head group's ops on a tensor of the vocabulary's width (the logits,
    their softmax and gradients, the weight's cast copy) have their FLOPs, bytes and those
    tensors' bytes scaled by ``1 / tp``, every rank at the replica's whole micro-batch when the
    head group is deployed tensor parallel (the simulator's plain tensor-parallel costing of a
    group without blocks; ``evaluation.external.vocab_parallel_plan``).
    The embedding (:func:`_embedding_vocab`): each rank looks up every token of its replica in
    its ``V / tp`` rows (Megatron-LM's ``VocabParallelEmbedding``, masked), so the embedding
    group's ops on a tensor of the weight's size (its gradient, the tied sum) have their
    batch-independent FLOPs and bytes and those tensors scaled by ``1 / tp``.
    Their collectives over the tensor-parallel group (:attr:`vocab_reduces` on the copy, ``{group:
    (forward, backward) all-reduce bytes}``, priced by :func:`tag.sim.tensor_parallel.tp_layout`):
    forward, the embedding's output (``2 s h`` bytes a sample in fp16: the rows a rank does not
    hold are zeros) and the vocab-parallel cross-entropy's all-reduces of the logits' max, sum of
    exponentials and target logit (4 bytes a token each); backward, the head input's gradient
    (Megatron's column-parallel linear, ``2 s h`` bytes a sample in fp16). :attr:`vocab_parallel`
    on the copy is ``tp``: a pipeline holds the tied embedding on its first and last stages, one
    ``V / tp`` shard a rank, as Megatron-LM does (:func:`tag.sim.program.tied_weights`)."""
    if tp <= 1:
        return graph
    outside = outside_params(graph, model_layers(graph))
    if not outside:
        return graph
    big = max(p.numel for p in outside)
    vocab = [i for i, p in enumerate(graph.params) if p in outside and 2 * p.numel >= big]
    out = copy.copy(graph)
    out.params, out.tensors, out.ops = list(graph.params), list(graph.tensors), list(graph.ops)
    wide = set()
    weights = {graph.params[i].tensor for i in vocab}
    for i in vocab:
        p = copy.copy(graph.params[i])
        p.nbytes, p.opt_state_bytes = p.nbytes // tp, p.opt_state_bytes // tp
        out.params[i] = p
        wide |= {p.tensor, p.grad}
    updates = [i for i, o in enumerate(graph.ops) if o.phase == "opt" and weights & set(o.inputs)]
    _scale_ops(out, updates, tp)
    head = _head_vocab(graph, weights)
    out.vocab_reduces = {}
    out.vocab_parallel = tp
    if head is not None:
        ops, tensors, reduces = head
        wide |= tensors
        _scale_ops(out, ops, tp)
        out.vocab_reduces = dict(reduces)
        (g_head, (_, hidden)), = reduces.items()  # the head input's bytes: the embedding output's
        emb = _embedding_vocab(graph, weights, {graph.params[i].numel for i in vocab})
        if emb is not None and emb[0] != g_head:
            g, e_ops, e_tensors = emb
            wide |= e_tensors
            _scale_ops(out, e_ops, tp, per_sample=False)
            out.vocab_reduces[g] = (hidden, ())
    for t_idx in wide:
        t = copy.copy(graph.tensors[t_idx])
        t.nbytes = _scaled(t.nbytes, tp)
        out.tensors[t_idx] = t
    return out


def _scale_ops(graph: OpGraph, ops, tp: int, per_sample: bool = True) -> None:
    """Replace ``graph``'s ops ``ops`` (in its own op list) by copies whose FLOPs and bytes are
    ``1 / tp`` (``per_sample`` False: their batch-independent parts only)."""
    for i in ops:
        o = copy.copy(graph.ops[i])
        o.flops, o.bytes_read, o.bytes_written = (_scaled(a, tp, per_sample)
                                                  for a in (o.flops, o.bytes_read, o.bytes_written))
        graph.ops[i] = o


def _embedding_vocab(graph: OpGraph, weights: set[int], numels: set[int]) -> tuple[int, set[int], set[int]] | None:
    """``(group, ops, tensors)`` of the input embedding's work over the vocabulary: the group of
    the first forward op computing on the batch with a vocabulary weight (``weights``: tensor
    indices; the lookup), the tensors of that group holding a whole multiple of a vocabulary
    weight's elements (``numels``) and none a sample (the weight, its gradient, the tied sum),
    and the forward and backward ops reading or writing one. None without such an op."""
    first = next((o for o in graph.ops if o.phase == "fwd" and o.batch and weights & set(o.inputs)), None)
    if first is None:
        return None
    g = first.group
    mine = [i for i, o in enumerate(graph.ops) if o.group == g and o.phase in ("fwd", "bwd")]

    def is_wide(t: int) -> bool:
        n = graph.tensors[t].nbytes
        return n.per_sample == 0 and n.fixed > 0 and any(n.fixed % e == 0 for e in numels)

    tensors = {t for i in mine for t in graph.ops[i].inputs + graph.ops[i].outputs if is_wide(t)}
    return g, {i for i in mine if tensors & set(graph.ops[i].inputs + graph.ops[i].outputs)}, tensors


def _scaled(a: Affine, tp: int, per_sample: bool = True) -> Affine:
    return Affine(a.fixed / tp, a.per_sample / tp if per_sample else a.per_sample)


def _head_vocab(graph: OpGraph, weights: set[int]) -> tuple[set[int], set[int], dict] | None:
    """``(ops, tensors, {group: (forward, backward) all-reduce bytes})`` of the LM head's work
    over the vocabulary: in the group of the last forward matmul reading a vocabulary weight
    (``weights``: tensor indices, directly or through weight-only ops: its cast, its transpose),
    of ``(M, h, V)`` (:func:`tag.cost.gpu.gemm_dims` at one sample: ``M`` tokens a sample), the
    tensors holding a whole multiple of ``M x V`` bytes a sample (the logits in any precision;
    a hidden state's ``M x h x 4`` bytes is not one while ``4 h < V``) or of ``h x V`` bytes and
    none a sample (the weight, its copies and gradient), and the forward and backward ops reading
    or writing one. None without such a matmul (a model without an LM head)."""
    from ..cost.gpu import gemm_dims

    derived = set(weights)  # the weights and what weight-only ops make of them
    head = None
    for i, o in enumerate(graph.ops):
        if o.phase != "fwd":
            continue
        if not o.batch and derived & set(o.inputs):
            derived |= set(o.outputs)
        elif o.batch and derived & set(o.inputs) and o.flops.per_sample > 0:
            head = i
    dims = gemm_dims(graph, graph.ops[head], 1) if head is not None else None
    if dims is None:
        return None
    m, h, v = dims
    g = graph.ops[head].group
    mine = [i for i, o in enumerate(graph.ops) if o.group == g and o.phase in ("fwd", "bwd")]

    def is_wide(t: int) -> bool:
        n = graph.tensors[t].nbytes
        if n.per_sample > 0:
            return n.fixed == 0 and n.per_sample % (m * v) == 0
        return n.fixed > 0 and n.fixed % (h * v) == 0

    tensors = {t for i in mine for t in graph.ops[i].inputs + graph.ops[i].outputs if is_wide(t)}
    ops = {i for i in mine if tensors & set(graph.ops[i].inputs + graph.ops[i].outputs)}
    hidden = graph.tensors[graph.ops[head].inputs[-2]].nbytes
    token = Affine(0.0, 4.0 * m)
    return ops, tensors, {g: ((token, token, token), (Affine(0.0, hidden.per_sample),))}
