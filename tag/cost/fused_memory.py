"""Saved activations as a fused mixed-precision trainer holds them (Megatron-LM, DeepSpeed).

TAG's captured graph is what eager PyTorch with ``torch.autocast`` keeps for the backward pass:
every elementwise op's output that its own backward reads, and fp32 copies wherever autocast runs
an op in fp32 (layer norm, ``pow`` in GPT-2's tanh-GELU, the residual stream after it). Trainers
built on fused kernels keep less (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", arXiv 2205.05198, section 4.1: ``s b h (34 + 5 a s / h)`` bytes per
layer in fp16, ``34 s b h`` where the attention is fused and its ``[a, s, s]`` scores never
stored):

* **elementwise fusion**: a chain of elementwise ops runs as one kernel (Megatron-LM's
  bias-GeLU, bias-dropout-add); its backward recomputes the chain's intermediate values from the
  chain's inputs, so an intermediate (an elementwise op's output read in the forward only by
  elementwise ops of its op-group) is not kept;
* **half-precision storage**: activations are stored in the training precision (fp16/bf16, 2
  bytes an element), once: where autocast keeps a value and its half-precision cast (eager
  attention's fp32 probabilities and their fp16 copy for the product with V), a fused kernel
  keeps the half-precision one (Megatron-LM's fused softmax writes fp16); the loss's softmax over the vocabulary stays fp32 (Megatron-LM's
  cross-entropy keeps it in fp32, as eager's ``_log_softmax`` under autocast does).

Parameters, gradients, optimizer state and the weights' half-precision copies are unchanged (the
same 18 bytes a parameter in both: fp32 weight, gradient and two Adam moments plus the 2-byte
copy; Megatron-LM: 2-byte weight, 4-byte master weight, 4-byte main gradient, 8 bytes of Adam).
Only tensor sizes change (what the simulator holds between forward and backward and sends
between devices); op costs are the cost model's (:mod:`tag.cost.gpu`).

**Constants built on every rank** (:func:`rank_local_constants`): what the captured model
computes from constants alone (Hugging Face's ``[B, 1, L, S]`` causal mask from ``arange`` and
``full``, position ids) a fused trainer makes on each rank that reads it, once: Megatron-
DeepSpeed's GPT and OPT pipelines read a ``[1, 1, s, s]`` mask built at startup
(``args.attn_mask``) and send only the hidden states between stages; Megatron-LM's fused
softmax masks the causal triangle itself. TAG's eager graph makes it in the embedding's op-group
and moves it to every layer's devices each micro-batch: 16.8 MB a sample in fp32 at seq 2048,
to each of 8 tensor-parallel ranks per layer (OPT-350 at ``dp=1, tp=8, pp=4`` on Sailor's RTX
cluster: 290 s simulated for 83.8 s measured, 121.6 s of it stage 0's sends, 2026-11-29).
"""

from __future__ import annotations

import copy
from dataclasses import replace

from ..graph.gradients import draws_random
from ..graph.ir import Affine, OpGraph, Tensor
from .gpu import op_class

CASTS = ("aten._to_copy.default",)
"""Targets that only change a tensor's dtype."""
VIEWS = tuple(f"aten.{n}.default" for n in ("view", "_unsafe_view", "expand", "reshape", "clone", "permute",
                                           "transpose", "t", "contiguous")) + ("aten.transpose.int",)
"""Targets that only change how a tensor's elements are laid out or addressed."""
LOSS_SOFTMAX = ("aten._log_softmax.default", "aten._softmax.default")
"""Targets whose output feeding the loss (``nll_loss``) stays fp32."""


def fused_activation_graph(graph: OpGraph) -> OpGraph:
    """A copy of ``graph`` whose saved activations are sized as a fused mixed-precision trainer
    keeps them (module docstring); an fp32 graph's activations are only fused, not halved.

    A fused chain keeps its inputs instead of its intermediates: the bytes of the chain's inputs
    that nothing else keeps are carried by one of its dropped intermediates (freed when that one
    is, at the chain's backward), the others count zero. Constants are built on every rank
    (:func:`rank_local_constants`)."""
    graph = rank_local_constants(graph)
    ops, tensors = graph.ops, graph.tensors
    half = graph.precision in ("fp16", "bf16")

    def saved(t) -> bool:
        return (t.kind == "activation" and t.producer >= 0 and t.batch_dim is not None
                and ops[t.producer].phase == "fwd" and any(ops[c].phase == "bwd" for c in t.consumers))

    def elementwise(i: int) -> bool:
        return ops[i].phase == "fwd" and op_class(ops[i].target) == "memory"

    def internal(t) -> bool:
        fwd = [c for c in t.consumers if ops[c].phase == "fwd"]
        return (t.kind == "activation" and t.producer >= 0 and t.batch_dim is not None and elementwise(t.producer)
                and bool(fwd) and all(elementwise(c) and ops[c].group == ops[t.producer].group for c in fwd))

    def stored(t_idx: int) -> float:
        t, prod = tensors[t_idx], ops[tensors[t_idx].producer]
        wide = prod.dtype in ("", "float32")
        return 0.5 if half and wide and not _loss_softmax(graph, t) else 1.0

    # fused chains: elementwise ops joined by internal tensors (union-find over op indices)
    root: dict[int, int] = {}

    def find(i: int) -> int:
        while root.setdefault(i, i) != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    inner = {i for i, t in enumerate(tensors) if internal(t)}
    for i in inner:
        for c in tensors[i].consumers:
            if ops[c].phase == "fwd":
                root[find(c)] = find(tensors[i].producer)
    dropped: dict[int, list[int]] = {}  # chain -> its saved intermediates
    for i in inner:
        if saved(tensors[i]):
            dropped.setdefault(find(tensors[i].producer), []).append(i)
    members: dict[int, list[int]] = {}  # chain -> its ops
    for o in list(root):
        members.setdefault(find(o), []).append(o)
    scale: dict[int, Affine] = {}
    for chain, ts in dropped.items():
        keep = Affine()
        seen: set[int] = set()
        for o in members[chain]:
            for t_idx in ops[o].inputs:
                t = tensors[t_idx]
                if t_idx in inner or t_idx in seen or t.kind != "activation" or t.batch_dim is None or saved(t):
                    continue
                seen.add(t_idx)
                f = stored(t_idx)
                keep = keep + Affine(t.nbytes.fixed * f, t.nbytes.per_sample * f)
        for k, t_idx in enumerate(sorted(ts)):
            scale[t_idx] = keep if k == 0 else Affine()
    for t_idx, t in enumerate(tensors):
        if t_idx not in scale and saved(t) and half and _cast_of(graph, t, saved):
            scale[t_idx] = Affine()  # a cast of a kept value: the runtime keeps one copy, in half precision
        elif t_idx not in scale and saved(t) and stored(t_idx) != 1.0:
            scale[t_idx] = Affine(t.nbytes.fixed * 0.5, t.nbytes.per_sample * 0.5)
    out = copy.copy(graph)
    out.tensors = list(tensors)
    for t_idx, nbytes in scale.items():
        t = copy.copy(tensors[t_idx])
        t.nbytes = nbytes
        out.tensors[t_idx] = t
    return out


def rank_local_constants(graph: OpGraph) -> OpGraph:
    """``graph`` with every tensor computed from constants alone (buffers, graph constants and
    ops without inputs, ``arange`` and ``full``; no parameter, user input or random draw among
    its ancestors) built on each rank that reads it, as fused trainers do (module docstring): an
    op reading one from outside that computation reads instead a graph constant of one batch row
    (the batch dimension of such a tensor is an ``expand``: every row is the same), which the
    simulator holds with each op-group reading it and never moves; the forward ops that made it,
    left unread, read nothing and cost nothing (built once, at startup). A copy; ``graph`` itself when there is no
    such tensor."""
    ops, tensors = graph.ops, graph.tensors
    const = {i for i, t in enumerate(tensors) if t.producer < 0 and t.kind in ("buffer", "const")}
    made: set[int] = set()  # ops computing from constants alone (graph order is topological)
    for i, op in enumerate(ops):
        if op.phase == "fwd" and op.outputs and all(t in const for t in op.inputs) and not draws_random(op):
            made.add(i)
            const.update(op.outputs)
    read = {t: sorted({c for c in tensors[t].consumers if c not in made}) for t in const if tensors[t].producer >= 0}
    read = {t: cs for t, cs in read.items() if cs}
    if not read:
        return graph
    out = copy.copy(graph)
    out.ops, out.tensors = list(ops), list(tensors)
    for t, readers in sorted(read.items()):
        src = tensors[t]
        row = src.nbytes.at(1) if src.batch_dim is not None else src.nbytes.fixed
        local = len(out.tensors)
        out.tensors.append(Tensor(f"{src.name}.rank_local", "const", Affine(row), None, -1, readers))
        out.tensors[t] = replace(src, consumers=[c for c in src.consumers if c in made])
        for c in readers:
            out.ops[c] = replace(out.ops[c], inputs=[local if x == t else x for x in out.ops[c].inputs])
    for i in sorted(made, reverse=True):  # unread now: no cost (consumers come after producers)
        if not any(out.tensors[t].consumers for t in ops[i].outputs):
            out.ops[i] = replace(ops[i], inputs=[], flops=Affine(), bytes_read=Affine(), bytes_written=Affine())
            for t in ops[i].inputs:
                if tensors[t].producer >= 0:
                    out.tensors[t] = replace(out.tensors[t], consumers=[c for c in out.tensors[t].consumers if c != i])
    return out


def _cast_of(graph: OpGraph, t, saved) -> bool:
    """``t`` is a half-precision cast of another kept value, seen through views (a cast, then
    ``expand``/``view``/...: eager attention's probabilities as the product with V reads them)."""
    ops, tensors = graph.ops, graph.tensors
    cast, cur = False, t
    while cur.producer >= 0 and ops[cur.producer].inputs and ops[cur.producer].target in CASTS + VIEWS:
        cast |= ops[cur.producer].target in CASTS
        cur = tensors[ops[cur.producer].inputs[0]]
        if cast and saved(cur):
            return True
    return False


def _loss_softmax(graph: OpGraph, t) -> bool:
    """``t`` is the vocabulary softmax the loss reads."""
    prod = graph.ops[t.producer]
    return prod.target in LOSS_SOFTMAX and any("nll_loss" in graph.ops[c].target for c in t.consumers)


def saved_bytes(graph: OpGraph, batch: float) -> float:
    """Bytes of batch-carrying forward activations the backward reads, at ``batch`` samples."""
    ops = graph.ops
    return sum(t.nbytes.at(batch) - t.nbytes.at(0) for t in graph.tensors
               if t.kind == "activation" and t.producer >= 0 and t.batch_dim is not None
               and any(ops[c].phase == "bwd" for c in t.consumers))
