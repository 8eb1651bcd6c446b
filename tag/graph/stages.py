"""Cut the joint graph into runnable pieces ("stages"): one fx ``GraphModule`` per set of ops.

The profiler times each (group, phase) stage; the executor runs each rank's stages and moves
the tensors between them. A stage takes the joint-graph values it reads from outside (by node
name) and returns the values other stages, the loss or the gradients need (by node name).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch
import torch.fx as fx

from .capture import Captured


@dataclass
class Stage:
    """A runnable piece of the joint graph."""

    key: Hashable
    """Caller's identity for the stage, e.g. ``(group, "fwd")``."""
    module: fx.GraphModule
    inputs: list[str]
    """Joint-graph node names fed as positional arguments, in order."""
    outputs: list[str]
    """Joint-graph node names returned (a tuple), in order."""
    nodes: list[str]
    """Joint-graph node names computed inside."""

    def __call__(self, env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run on values looked up in ``env`` by name; returns the outputs by name."""
        outs = self.module(*[env[n] for n in self.inputs])
        return dict(zip(self.outputs, outs))


def build_stages(captured: Captured, assign: dict[str, Hashable], recompute: Iterable[Hashable] = ()) -> dict[Hashable, Stage]:
    """Split ``captured.joint`` by ``assign`` (call_function node name -> stage key).

    Nodes not named in ``assign`` (placeholders, dead code) are not computed by any stage.
    Stages are returned in the order their first node appears in the joint graph.

    ``recompute``: units whose stages are keyed ``(unit, "fwd")`` and ``(unit, "bwd")`` and that
    recompute their activations (``GroupPlan.recompute``): the forward stage returns only what
    other stages than the unit's backward read, and the backward stage computes the forward's
    nodes again from their inputs before the backward's own (returning only what the backward's
    nodes make).
    """
    graph = captured.joint.graph
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    graph_outputs = {a.name for a in out_node.all_input_nodes}
    members: dict[Hashable, list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.name in assign:
            members.setdefault(assign[n.name], []).append(n)
    stages = {k: _extract(k, nodes, assign, graph_outputs, captured.joint) for k, nodes in members.items()}
    for unit in recompute:
        fwd, bwd = members.get((unit, "fwd"), []), members.get((unit, "bwd"), [])
        if not fwd or not bwd:
            continue
        own = {n.name for n in fwd + bwd}
        stages[(unit, "fwd")] = _extract((unit, "fwd"), fwd, assign, graph_outputs, captured.joint, own=own)
        stages[(unit, "bwd")] = _extract((unit, "bwd"), fwd + bwd, assign, graph_outputs, captured.joint,
                                         returns={n.name for n in bwd})
    return stages


def _extract(key: Hashable, nodes: list[fx.Node], assign: dict[str, Hashable], graph_outputs: set[str],
             root: fx.GraphModule, own: set[str] | None = None, returns: set[str] | None = None) -> Stage:
    """The stage computing ``nodes``; it returns those read outside it (or graph outputs): with
    ``own``, outside ``own`` (a recomputed unit's forward: not for its backward); with
    ``returns``, only those of ``returns`` (a recomputed unit's backward: not its forward's)."""
    inside = {n.name for n in nodes}
    reach = inside if own is None else own
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    inputs: list[str] = []

    def lookup(a: fx.Node) -> fx.Node:
        if a.name not in env:
            if a.name in inside:
                raise RuntimeError(f"stage {key}: node {a.name} used before it is computed")
            ph = g.placeholder(a.name)
            ph.meta = dict(a.meta)
            env[a.name] = ph
            inputs.append(a.name)
        return env[a.name]

    for n in nodes:
        for a in n.all_input_nodes:
            lookup(a)
        new = g.node_copy(n, lambda a: env[a.name])
        env[n.name] = new
    outputs = [n.name for n in nodes if (returns is None or n.name in returns)
               and (n.name in graph_outputs or any(u.name not in reach for u in n.users))]
    g.output(tuple(env[o] for o in outputs))
    gm = fx.GraphModule(root, g, class_name=f"Stage_{_ident(key)}")
    return Stage(key, gm, inputs, outputs, [n.name for n in nodes])


def _ident(key: Hashable) -> str:
    return "".join(c if c.isalnum() else "_" for c in str(key))[:40]


def group_phase_assignment(captured: Captured, groups: Iterable[int] | None = None) -> dict[str, tuple[int, str]]:
    """``node name -> (group, phase)`` for the fwd/bwd ops of ``groups`` (default all)."""
    wanted = None if groups is None else set(groups)
    return {op.name: (op.group, op.phase) for op in captured.graph.ops
            if op.phase in ("fwd", "bwd") and (wanted is None or op.group in wanted)}


def retarget_devices(gm: fx.GraphModule, device: torch.device) -> None:
    """Point the ops that create tensors (``full_like``, ``scalar_tensor``, ``_to_copy``), traced
    with ``device=cpu``, at ``device`` (a stage run on a GPU); on a CUDA (or meta) device, run the
    CPU flash attention kernels the capture recorded as :func:`efficient_attention` and
    :func:`efficient_attention_backward`."""
    moved = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: efficient_attention,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: efficient_attention_backward}
    for n in gm.graph.nodes:
        dev = n.kwargs.get("device") if n.op == "call_function" else None
        if dev is not None and torch.device(dev).type == "cpu":
            n.kwargs = {**n.kwargs, "device": device}
        if n.op == "call_function" and n.target in moved and torch.device(device).type in ("cuda", "meta"):
            n.target = moved[n.target]
            vals = n.meta.get("val")
            if isinstance(vals, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in vals):
                n.kwargs = {**n.kwargs, "strides": tuple(tuple(v.stride()) for v in vals)}
    gm.recompile()


# CUDA has no kernel of the CPU flash attention the graphs are captured with (on fake CPU
# tensors); memory-efficient attention is the fused CUDA kernel for every dtype and GPU that
# F.scaled_dot_product_attention dispatches to in fp32 (flash needs fp16/bf16 and sm80+). Its
# logsumexp is [B, H, L] padded to a multiple of 32 along L, the CPU kernel's [B, H, L]: the
# graph keeps the CPU shape (stage boundaries and messages are sized by it), these pad and cut.
# The ops after them were traced with the CPU kernel's output strides (a ``view`` of a transposed
# gradient, say); the CUDA backward returns other strides when q, k and v are slices of one packed
# projection (it allocates one packed gradient), and that ``view`` fails ("view size is not
# compatible with input tensor's size and stride": the SDPA encoder of evaluation/models/unseen.py
# on an H200, 2026-11-26), so results whose strides differ from the captured ones are copied into
# them (``strides``: each result's captured strides, set by retarget_devices).
_LSE_ALIGN = 32
"""Alignment of memory-efficient attention's logsumexp length (PyTorch's ``kAlignLSE``)."""
_BIAS_ALIGN = 16
"""Alignment (elements) of memory-efficient attention's bias rows (PyTorch's ``mem_eff_alignment``)."""


_BIASES: dict = {}
"""``id(attn_mask)`` -> ``(version, key, bias)``: the bias last prepared from a mask that is still
alive (dropped with it, :func:`_attention_bias`)."""


def _attention_bias(attn_mask, query, key):
    """:func:`_prepare_bias`, once per mask: a captured mask that cannot be folded (padding, read
    from the inputs) is one tensor every layer's attention reads, forward and backward (Hugging
    Face passes the same mask to each layer); its bias is prepared on the first call and handed
    to the others while the mask lives and is not written (its version), for queries of the same
    batch, heads, length, dtype and device and the same key length. Eager autograd instead keeps
    one bias per layer, from the forward to the backward."""
    if attn_mask is None:
        return None
    sig = (tuple(query.shape[:3]), key.shape[2], query.dtype, query.device)
    hit = _BIASES.get(id(attn_mask))
    if hit is not None and hit[0] == attn_mask._version and hit[1] == sig:
        return hit[2]
    bias = _prepare_bias(attn_mask, query, key)
    if _root(bias) is _root(attn_mask):  # a view of the mask: free to make, and kept it would keep the mask
        return bias
    if id(attn_mask) not in _BIASES:
        weakref.finalize(attn_mask, _BIASES.pop, id(attn_mask), None)
    _BIASES[id(attn_mask)] = (attn_mask._version, sig, bias)
    return bias


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor owning ``t``'s storage (``t`` itself unless it is a view)."""
    return t._base if t._base is not None else t


def _prepare_bias(attn_mask, query, key):
    """``attn_mask`` as the memory-efficient kernel takes it, which
    ``F.scaled_dot_product_attention`` prepares before dispatching to it
    (``preprocess_mask`` in ``aten/src/ATen/native/transformers/attention.cpp``): an additive
    mask of the query's dtype, expanded to ``[B, H, L, S]`` (the kernel checks every dimension:
    "attn_bias: wrong shape (head dimension)" from the captured ``[B, 1, L, S]`` masks of the
    HF zoo, H200, 2026-11-27) with rows 16-element aligned (padded, then sliced back to ``S``)."""
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device).masked_fill_(
            ~attn_mask, float("-inf"))
    bias = attn_mask.to(query.dtype).expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    length = bias.shape[-1]
    if bias.stride(-1) != 1 or length % _BIAS_ALIGN:
        return torch.nn.functional.pad(bias, (0, _BIAS_ALIGN - length % _BIAS_ALIGN))[..., :length]
    if any(st % _BIAS_ALIGN or st == 0 for st in bias.stride()[:3]):
        return bias.contiguous()
    return bias


def _no_dropout(dropout_p: float) -> None:
    if dropout_p:
        raise NotImplementedError(f"fused attention with dropout_p={dropout_p} on a GPU: the graph was captured with "
                                  "the CPU kernel, whose random numbers the CUDA kernel cannot reproduce; set the "
                                  "attention dropout to 0")


def _restrided(tensors: tuple, strides) -> tuple:
    """``tensors``, each with ``strides[i]`` (a copy where it has other strides); as is if None."""
    if strides is None:
        return tuple(tensors)
    out = []
    for t, st in zip(tensors, strides):
        if tuple(t.stride()) != tuple(st) and t.numel() > 1:
            t = torch.empty_strided(t.shape, st, dtype=t.dtype, device=t.device).copy_(t)
        out.append(t)
    return tuple(out)


def efficient_attention(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None,
                        strides=None):
    """``aten._scaled_dot_product_flash_attention_for_cpu`` (same arguments and results:
    ``(output [B, H, L, Dv], logsumexp [B, H, L] fp32)``) by the memory-efficient CUDA kernel."""
    _no_dropout(dropout_p)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, _attention_bias(attn_mask, query, key), True, dropout_p, is_causal, scale=scale)
    return _restrided((out, lse[..., :query.shape[-2]]), strides)


def efficient_attention_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                                 attn_mask=None, scale=None, strides=None):
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward`` (same arguments, results
    ``(grad_query, grad_key, grad_value)``) by the memory-efficient CUDA kernel's backward."""
    _no_dropout(dropout_p)
    # a fresh contiguous [B, H, L padded] buffer: the kernel wants its H stride aligned too ("LSE is
    # not correctly aligned (strideH)" from the captured CPU layout [B, L, H], H200, 2026-11-26)
    length = logsumexp.shape[-1]
    lse = logsumexp.new_zeros(*logsumexp.shape[:-1], length + (-length % _LSE_ALIGN))
    lse[..., :length] = logsumexp
    seed = offset = torch.empty((), dtype=torch.int64, device=query.device)  # read only with dropout
    gq, gk, gv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, query, key, value, _attention_bias(attn_mask, query, key), out, lse, seed, offset, dropout_p,
        [True, True, True, False],
        is_causal, scale=scale)
    return _restrided((gq, gk, gv), strides)
