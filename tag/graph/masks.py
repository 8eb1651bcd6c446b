"""Constant attention masks folded into the fused attention kernel's ``is_causal`` flag, or dropped.

Hugging Face's transformers build their attention mask inside ``forward`` from ``arange``,
comparisons and ``expand``; traced by ``torch.export`` the mask becomes a chain of ops on
constants (no input, parameter or buffer among its ancestors) ending in a ``[B, 1, L, S]``
boolean that ``F.scaled_dot_product_attention`` receives as ``attn_mask``. Eager PyTorch never
builds it when there is no padding: GPT-2 and Llama call the kernel with ``is_causal=True``, BERT
and ViT with no mask. The captured explicit mask costs what eager does not pay:

* the fused kernels cannot skip the masked half of a causal score matrix, and the CUDA
  memory-efficient kernel reads an additive ``[B, H, L, S]`` bias built from the mask in the
  forward and again in the backward (:func:`tag.graph.stages._attention_bias`): GPT-2 small,
  seq 1024, batch 8 on an H200 (2026-11-27, ``evaluation/results/gpu-check/2026-11-27-h200/run2.md``):
  attention kernels 35.2 ms per step executed from the graph against 19.2 ms eager in fp32, 12.1
  against 2.3 ms in bf16;
* the graph's FLOPs and bytes count the masked work and the mask itself.

:func:`fold_attention_masks` evaluates each such mask once, on the CPU with real values (the
capture itself may run on the meta device), and rewrites the attention call when the mask is one
of the two patterns the kernel has a flag for: everything allowed (the mask is dropped) or the
causal lower triangle of a square score matrix, ``tril(ones(L, L))`` in every batch row and head
(``is_causal=True``, top-left aligned as ``F.scaled_dot_product_attention`` defines it). A boolean
mask allows ``True``; an additive one allows ``0`` and masks ``-inf`` or values at or below half
the dtype's most negative number (Hugging Face fills ``torch.finfo(dtype).min``, whose
``exp`` is 0 in every floating dtype). Any other mask (padding, ALiBi biases, a mask read from an
input) stays as it is. The rewrite is exact: same outputs, same gradients.
"""

from __future__ import annotations

import functools
import logging
import operator

import torch
import torch.fx

log = logging.getLogger(__name__)

SDPA = torch.ops.aten.scaled_dot_product_attention.default
MAX_MASK_ELEMENTS = 1 << 28
"""Largest tensor (elements) of a mask's computation that is evaluated; a larger mask stays in
the graph (2**28 booleans: 256 MiB, a [32, 1, 8192, 1024] mask)."""


def fold_attention_masks(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Rewrite, in place, every ``aten.scaled_dot_product_attention`` of ``ep`` whose ``attn_mask``
    is a constant allowing everything (mask dropped) or the causal triangle (``is_causal=True``),
    and erase the ops that computed those masks. Returns ``ep``."""
    graph = ep.graph
    values: dict[torch.fx.Node, torch.Tensor | None] = {}
    rows: dict[torch.fx.Node, torch.Tensor | None] = {}  # one-row values (_one_row), apart from full ones
    folded: list[torch.fx.Node] = []
    index = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        bound = _bound(node)
        mask = bound.get("attn_mask")
        if not isinstance(mask, torch.fx.Node) or bound.get("is_causal"):
            continue
        query, key = node.args[0].meta.get("val"), node.args[1].meta.get("val")
        value = _constant(mask, values, rows, index, _row_batch(query, key))
        kind = None if value is None or query is None or key is None else mask_kind(
            value, query.shape[-2], key.shape[-2])
        if kind is None:
            continue
        node.args, node.kwargs = _rewritten(node, causal=kind == "causal")
        folded.append(mask)
        log.debug("attention %s: constant mask %s folded (%s)", node.name, mask.name, kind)
    if folded:
        _erase_unused(graph, folded, index)
        ep.graph_module.recompile()
    return ep


def mask_kind(mask: torch.Tensor, length: int, source_length: int) -> str | None:
    """``"none"`` if ``mask`` (boolean, or additive float) allows every query-key pair,
    ``"causal"`` if it allows exactly the lower triangle of a square ``[length, length]`` score
    matrix in every leading index, else None."""
    if mask.dim() < 2 or mask.shape[-2] not in (1, length) or mask.shape[-1] not in (1, source_length):
        return None
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        blocked = (mask == float("-inf")) | (mask <= torch.finfo(mask.dtype).min / 2)
        if not bool((allowed | blocked).all()):
            return None  # a bias with other values (ALiBi, relative positions) changes the scores
    else:
        return None
    if bool(allowed.all()):
        return "none"
    if length != source_length or mask.shape[-2:] != (length, length):
        return None
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return "causal" if bool((allowed == causal).all()) else None


_POSITIONAL = [a.name for a in SDPA._schema.arguments if not a.kwarg_only]


@functools.cache
def arg_names(target: torch._ops.OpOverload) -> tuple[str, ...]:
    """The argument names of an ATen overload's schema, in order (read once per overload)."""
    return tuple(a.name for a in target._schema.arguments)


def bind(target: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    """A call of ``target`` as ``{argument name: value}`` (the arguments given)."""
    return {**dict(zip(arg_names(target), args)), **kwargs}


def _bound(node: torch.fx.Node) -> dict:
    """The attention call's arguments by name (those given)."""
    return bind(SDPA, node.args, node.kwargs)


def _rewritten(node: torch.fx.Node, causal: bool) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of the call without its mask, and ``is_causal`` set where ``causal``:
    ``query, key, value, attn_mask, dropout_p, is_causal`` positional, the keyword-only ones
    (``scale``, ``enable_gqa``) as given."""
    bound = _bound(node)
    bound["attn_mask"] = None
    bound["is_causal"] = causal
    bound.setdefault("dropout_p", 0.0)
    args = tuple(bound.pop(name) for name in _POSITIONAL)
    return args, bound


def _pure(node: torch.fx.Node) -> bool:
    """An op whose result depends on its arguments alone: an ATen op that draws no random numbers
    and mutates nothing, or a tuple projection."""
    if node.op != "call_function":
        return False  # a placeholder (input, parameter, buffer) or anything else: not a constant
    if node.target is operator.getitem:
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    schema = target._schema
    return (torch.Tag.nondeterministic_seeded not in target.tags and not schema.is_mutable
            and all(not (a.alias_info and a.alias_info.is_write) for a in schema.arguments))


def _row_batch(query, key) -> int | None:
    """The attention's batch size where a constant mask can be evaluated for one batch row
    (:func:`_one_row`): a 4-d query whose batch differs from 1 and from every other size of the
    query and key (so a size equal to it is the batch, not a length, head count or width)."""
    if query is None or key is None or query.dim() != 4:
        return None
    b = int(query.shape[0])
    others = {int(x) for x in (*query.shape[1:], *key.shape[1:])}
    return b if b > 1 and b not in others else None


SIZE_ARGS = {**{f"aten.{n}.default": 1 for n in ("expand", "view", "reshape", "_unsafe_view", "new_ones",
                                                   "new_zeros", "new_full", "new_empty")},
             **{f"aten.{n}.default": 0 for n in ("ones", "zeros", "full", "empty")},
             "aten.arange.default": 0, "aten.arange.start": 1, "aten.arange.start_step": 1}
"""Ops whose argument at this position is a size (or an ``arange`` end): where it starts with (or
is) the batch, a one-row evaluation makes it 1 (:func:`_one_row`)."""


def _one_row(target, args: tuple, batch: int | None) -> tuple:
    """``args`` of an op with the batch made 1 in its size argument (:data:`SIZE_ARGS`): a mask
    made from constants reads no input, so every batch row of it is the same and one row is
    evaluated in place of ``B`` (Hugging Face's ``index(mask, [arange(B), ...])``,
    ``expand(B, 1, L, S)``), at a memory that does not grow with the batch."""
    i = SIZE_ARGS.get(str(target))
    if not batch or i is None or i >= len(args):
        return args
    a = args[i]
    if isinstance(a, int) and not isinstance(a, bool) and a == batch:
        a = 1
    elif isinstance(a, (list, tuple)) and a and a[0] == batch:
        a = type(a)([1, *a[1:]])
    return (*args[:i], a, *args[i + 1:])


def _too_large(node: torch.fx.Node, batch: int | None = None) -> bool:
    """The node's tensor holds more than :data:`MAX_MASK_ELEMENTS` elements (per batch row where
    ``batch`` is given and leads its shape: :func:`_one_row`)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    n = val.numel()
    if batch and val.dim() and val.shape[0] == batch:
        n //= batch
    return n > MAX_MASK_ELEMENTS


def _constant(node: torch.fx.Node, values: dict, rows: dict, index: dict, batch: int | None) -> torch.Tensor | None:
    """The value of ``node`` computed on the CPU from constants alone, or None when it reads a
    placeholder, an impure op or a tensor above :data:`MAX_MASK_ELEMENTS` (memoised in ``values``).
    ``batch``: where the whole mask is over the limit, evaluate one batch row (:func:`_one_row`,
    memoised in ``rows``); a result whose shape is not the traced one with its batch made 1 is not
    used (None)."""
    val = node.meta.get("val")
    if batch and isinstance(val, torch.Tensor) and val.numel() <= MAX_MASK_ELEMENTS:
        batch = None  # the whole mask fits: evaluated as traced
    if batch:
        out = _evaluate(node, rows, index, batch)
        if out is None or not isinstance(val, torch.Tensor):
            return None
        want = tuple(val.shape)
        want = (1, *want[1:]) if want and want[0] == batch else want
        return out if tuple(out.shape) == want else None
    return _evaluate(node, values, index, None)


def _evaluate(node: torch.fx.Node, values: dict, index: dict, batch: int | None) -> torch.Tensor | None:
    """:func:`_constant`'s evaluation (``batch``: of one row)."""
    order: list[torch.fx.Node] = []
    stack, seen = [node], set()
    while stack:  # the mask's ancestors, each checked once
        n = stack.pop()
        if n in seen or n in values:
            continue
        seen.add(n)
        if not _pure(n) or _too_large(n, batch):
            values[node] = None
            return None
        order.append(n)
        stack.extend(n.all_input_nodes)
    def real(a):
        return values[a] if isinstance(a, torch.fx.Node) else a

    for n in sorted(order, key=index.__getitem__):
        if any(values.get(a) is None for a in n.all_input_nodes):
            values[n] = None
            continue
        args = _one_row(n.target, tuple(torch.fx.node.map_aggregate(n.args, real)), batch)
        kwargs = torch.fx.node.map_aggregate(n.kwargs, real)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}  # the capture may trace on the meta device
        try:
            with torch.no_grad():
                values[n] = n.target(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a mask that cannot be evaluated stays in the graph
            log.debug("attention mask op %s not evaluated: %s", n.name, e)
            values[n] = None
    out = values.get(node)
    return out if isinstance(out, torch.Tensor) else None


def _erase_unused(graph: torch.fx.Graph, roots: list[torch.fx.Node], index: dict) -> None:
    """Erase ``roots`` and their ancestors, latest first, where nothing else uses them."""
    pending, seen = list(roots), set()
    doomed: list[torch.fx.Node] = []
    while pending:
        n = pending.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        doomed.append(n)
        pending.extend(n.all_input_nodes)
    for n in sorted(doomed, key=index.__getitem__, reverse=True):
        if not n.users:
            graph.erase_node(n)
