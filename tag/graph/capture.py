"""Capture one training iteration of a PyTorch model as an :class:`~tag.graph.ir.OpGraph`.

Route: ``torch.export.export(strict=False)`` gives the forward in ATen IR; the (private)
``torch.export.experimental._export_forward_backward`` (its steps, with fewer decompositions:
:func:`joint_decompositions`) turns it into one joint graph whose outputs are the loss and one
gradient per parameter. A model or inputs on the meta device are captured on fake CPU tensors
(:func:`to_fake`). ``torch.fx.symbolic_trace`` cannot trace
transformers models, and ``aot_export_module`` refuses non-tuple outputs, so this route is the
one that works on arbitrary models (see shared/README.md).

Batch dimensions are found by capturing at two batch sizes ``B`` and ``B + 1`` and comparing
every node's FakeTensor shape: the dimension that changed carries the batch. The same pair
gives every FLOP and byte count as an affine function of the per-replica batch.

The optimizer update is not part of the joint graph; one update op per parameter is added
with the FLOP/byte counts of PyTorch's single-tensor Adam / SGD kernels.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputKind
from torch.utils.flop_counter import flop_registry

from ..errors import WorkloadError
from .ir import Affine, Op, OpGraph, Param, Tensor
from .masks import arg_names, bind, fold_attention_masks
from .precision import autocast, check_precision, dtype_name

log = logging.getLogger(__name__)


def register_attention_flops() -> None:
    """Count the CPU flash attention kernels in ``torch.utils.flop_counter`` (its own CUDA
    kernels are counted; ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward
    are not, so ``FlopCounterMode`` would count an SDPA model's attention as 0 on the CPU, where
    the graphs are captured). Same formulas as the CUDA flash kernels: forward two ``bmm``,
    backward five (scores recomputed). Idempotent; leaves a registration torch ships alone."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    for packet, formula in ((aten._scaled_dot_product_flash_attention_for_cpu, fc.sdpa_flop),
                            (aten._scaled_dot_product_flash_attention_for_cpu_backward, fc.sdpa_backward_flop)):
        flop_registry.setdefault(packet, formula)


register_attention_flops()

# Per-element cost of one optimizer update: (FLOPs, tensors read, tensors written), counted
# from torch.optim's single-tensor kernels (Adam: lerp_, mul_/addcmul_, sqrt/div/add_, addcdiv_;
# SGD+momentum: mul_/add_, add_; SGD: add_).
OPTIMIZER_COSTS: dict[str, tuple[int, int, int, int]] = {
    # name: (flops/elem, tensors read, tensors written, state tensors)
    "adam": (13, 5, 4, 2),
    "sgd": (4, 3, 2, 1),  # SGD with momentum
    "sgd-plain": (2, 2, 1, 0),
}


@dataclass
class Captured:
    """An op graph plus the runnable joint graph it came from (in memory only)."""

    graph: OpGraph
    joint: torch.fx.GraphModule
    """Joint forward+backward graph at ``graph.batch_size``; returns (loss, *grads, ...)."""
    placeholders: list[tuple[str, str, str | None]]
    """(node name, kind, state-dict target) for each placeholder of ``joint``, in call order."""
    state: dict[str, torch.Tensor]
    """Parameters, buffers and constants by target name."""
    grad_outputs: dict[str, str]
    """Parameter target -> name of the joint-graph node holding its gradient."""
    loss_node: str
    export_seconds: float


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _lazy_codegen():
    """Every ``torch.fx.GraphModule`` built for the duration is a ``_LazyGraphModule``: it
    generates and compiles its Python code when it is first run or its ``code`` is read, not at
    each ``recompile()``.

    A joint export builds 18 graph modules and recompiles them after each pass (torch.export's
    naming, autocast and runtime-assertion passes, the ExportedProgram copies, aot_autograd's
    joint graph, the passes here) and runs none of them: tracing interprets the graphs node by
    node. Generating that code was ~15% of an export's CPU time (GPT-2 small, 3 layers). torch
    itself builds lazy graph modules inside ``torch.compile``
    (``torch.fx._lazy_graph_module._use_lazy_graph_module``); that switch reaches only the modules
    made through ``_make_graph_module``, so ``GraphModule(...)`` called directly is redirected
    here too. The graphs are unchanged; a module returned from here compiles on its first call.
    """
    from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module

    gm_cls = torch.fx.GraphModule
    saved = gm_cls.__dict__["__new__"]  # restored as it was (a staticmethod)
    real = gm_cls.__new__  # the function: real(cls, *args, **kwargs)

    def new(cls, *args, **kwargs):
        return real(_LazyGraphModule if cls is gm_cls else cls, *args, **kwargs)

    gm_cls.__new__ = new
    try:
        with _use_lazy_graph_module(True):
            yield
    finally:
        gm_cls.__new__ = saved


def _ancestors(graph: torch.fx.Graph, roots: list[torch.fx.Node]) -> set[str]:
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        stack.extend(n.all_input_nodes)
    return seen


def _output_node(graph: torch.fx.Graph) -> torch.fx.Node:
    return next(n for n in reversed(graph.nodes) if n.op == "output")


def _loss_index(sig) -> int:
    """Position of the loss among the graph's outputs (marked by :func:`export_joint`)."""
    return next(i for i, s in enumerate(sig.output_specs) if s.kind == OutputKind.LOSS_OUTPUT)


def _prune_params(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Drop parameter placeholders the loss does not reach (tied aliases, unused weights).

    ``_export_forward_backward`` raises "Found a parameter that did not receive a gradient"
    for them. Unused placeholders are removed; used-but-not-differentiated ones (e.g.
    ``requires_grad=False``) become buffers.
    """
    sig = ep.graph_signature
    graph = ep.graph_module.graph
    out = _output_node(graph)
    loss_arg = out.args[0][_loss_index(sig)]
    reach = _ancestors(graph, [loss_arg])
    nodes = {n.name: n for n in graph.nodes}
    state = dict(ep.state_dict)
    specs, removed = [], False
    for s in sig.input_specs:
        if s.kind == InputKind.PARAMETER and s.arg.name not in reach:
            node = nodes[s.arg.name]
            removed = True
            if not node.users:
                graph.erase_node(node)
                state.pop(s.target, None)
                continue
            s = InputSpec(kind=InputKind.BUFFER, arg=s.arg, target=s.target, persistent=True)
        elif s.kind == InputKind.PARAMETER and not ep.state_dict[s.target].requires_grad:
            s = InputSpec(kind=InputKind.BUFFER, arg=s.arg, target=s.target, persistent=True)
            removed = True
        specs.append(s)
    if not removed:
        return ep
    graph.lint()
    ep.graph_module.recompile()
    new_sig = ExportGraphSignature(input_specs=specs, output_specs=sig.output_specs)
    return ep._update(ep.graph_module, new_sig, state_dict=state)


def _views_to_reshapes(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Replace ``aten.view`` by ``aten.reshape`` (a view whenever a view is possible).

    The joint-graph decompositions can give a tensor other strides than eager did (seen with
    GPT-2's SDPA attention without dropout), and a ``view`` that was legal in eager then fails.
    """
    for n in ep.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.view.default:
            n.target = torch.ops.aten.reshape.default
    ep.graph_module.recompile()
    return ep


@_lazy_codegen()
def export_joint(model: torch.nn.Module, inputs: tuple, name: str = "the model",
                 precision: str = "fp32") -> torch.export.ExportedProgram:
    """Export ``model(*inputs) -> scalar loss`` as a joint forward+backward ExportedProgram
    (``name``: how error messages call the model). ``precision`` bf16/fp16: the forward is
    exported under ``torch.autocast`` (:mod:`tag.graph.precision`), so the graph holds its casts
    and runs as mixed precision without an autocast context.

    No node records its stack trace (``torch.fx.config.do_not_emit_stack_traces``): nothing here
    reads them (an export failure names the user's line from its own traceback), and extracting
    one per node costs ~10% of a trace. No graph module generates its Python code before it is
    run or read (:func:`_lazy_codegen`)."""
    try:
        with _quiet(), autocast(precision), _fx_config(do_not_emit_stack_traces=True):
            ep = torch.export.export(model, tuple(inputs), strict=False)
    except Exception as e:  # noqa: BLE001 - any export failure is a model the user must fix
        raise WorkloadError(_export_failure(name, e)) from e
    _check_static_shapes(ep, name)
    out_specs = ep.graph_signature.output_specs
    # Buffer mutations (e.g. BatchNorm's running statistics) come before the model's own outputs.
    li = next((i for i, s in enumerate(out_specs) if s.kind == OutputKind.USER_OUTPUT), None)
    if li is None:
        raise WorkloadError("model returned no output; expected a scalar loss")
    loss_val = _output_node(ep.graph).args[0][li].meta.get("val")
    if not isinstance(loss_val, torch.Tensor) or loss_val.numel() != 1:
        raise WorkloadError(f"model output must be a scalar loss, got {_describe(loss_val)}")
    # Mark the model's first output as the loss (export has no notion of it).
    specs = list(out_specs)
    specs[li] = type(specs[li])(kind=OutputKind.LOSS_OUTPUT, arg=specs[li].arg, target=None)
    ep = ep._update(ep.graph_module, ExportGraphSignature(ep.graph_signature.input_specs, specs))
    ep = _prune_params(_views_to_reshapes(_drop_noop_dropout(fold_attention_masks(ep))))
    try:
        # its decomposition re-traces the autocast regions
        with _quiet(), autocast(precision), _fx_config(do_not_emit_stack_traces=True):
            return _forward_backward(ep)
    except Exception as e:  # noqa: BLE001
        raise WorkloadError(f"could not build the backward graph: {type(e).__name__}: {_first_line(e)}") from e


def _check_static_shapes(ep: torch.export.ExportedProgram, name: str) -> None:
    """One-line WorkloadError where an op of ``ep`` gives a tensor whose size depends on tensor
    values (``torch.nonzero``, indexing by a boolean mask: a symbolic size in an export at static
    input shapes), instead of the 73 lines of GuardOnDataDependentSymNode its costing raised."""
    for node in ep.graph.nodes:
        for t in _tensors_of(node.meta.get("val")):
            if any(isinstance(d, torch.SymInt) for d in t.shape):
                entry = next(reversed((node.meta.get("nn_module_stack") or {"": ("", "")}).values()))
                path, kind = str(entry[0]), entry[1]  # (module path, its class or the class's dotted name)
                kind = getattr(kind, "__qualname__", str(kind)).rsplit(".", 1)[-1]
                where = f" in {kind}" + (f" ({path.removeprefix('model.')})" if path not in ("", "model") else "") \
                    if kind else ""
                raise WorkloadError(f"{name}: data-dependent shape: op {node.target}{where} gives a tensor of shape "
                                    f"{tuple(t.shape)}, whose size depends on tensor values, which a capture (and "
                                    "a meta-device model) does not have; use operations of fixed output size "
                                    "(torch.where, masked arithmetic) instead of torch.nonzero or boolean-mask "
                                    "indexing")


def _base_name(op) -> str:
    """An ATen overload's base name: ``aten::native_layer_norm_backward.default`` -> ``native_layer_norm_backward``."""
    return op.name().split("::")[-1].split(".")[0]


def _is_backward_kernel(op) -> bool:
    """Whether ``op`` (an ATen overload) is a backward kernel, e.g. ``aten.native_layer_norm_backward``."""
    return _base_name(op).endswith(("_backward", "_backward_data"))


FUSED_ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
"""The fused attention forwards ``F.scaled_dot_product_attention`` dispatches to (ATen base
names): CPU flash, CUDA flash, memory-efficient, cuDNN. Their backwards are backward kernels."""


def _is_fused_attention(op) -> bool:
    """Whether ``op`` (an ATen overload) is a fused attention forward (:data:`FUSED_ATTENTION`)."""
    return _base_name(op) in FUSED_ATTENTION


@functools.cache
def joint_decompositions() -> dict:
    """Core-ATen decompositions minus the backward kernels (LayerNorm, BatchNorm, softmax, GELU,
    NLL, embedding, ... backwards) and the fused attention forwards (:data:`FUSED_ATTENTION`),
    which stay single ops as eager runs them.

    Decomposed, LayerNorm's backward is ~10 elementwise ops and reductions, each writing a full
    activation: the graph then has 1.2-1.3x the ops of eager (gpt2, resnet; evaluation/results/
    capture-scale) and the byte counts price intermediates eager never writes. Decomposed, the CPU
    flash attention forward becomes the math path (two ``bmm``, a softmax, NaN masking with
    ``any``/``where``) feeding a fused backward that recomputes the scores anyway. FLOP counts
    are unchanged: ``torch.utils.flop_counter`` counts the fused attention as the two ``bmm`` it
    replaces (:func:`register_attention_flops` adds the CPU flash kernels).
    ``aten.scaled_dot_product_attention`` itself stays decomposed: its decomposition is the
    dispatch to a fused kernel (or to the math path where no fused kernel applies).
    """
    from torch._decomp import core_aten_decompositions

    return {op: fn for op, fn in core_aten_decompositions().items()
            if not _is_backward_kernel(op) and not _is_fused_attention(op)}


def _forward_backward(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``torch.export.experimental._export_forward_backward`` with :func:`joint_decompositions`
    instead of the full core-ATen table (private API: this one place and :func:`_no_joint_retrace`)."""
    from torch.export.experimental import _remove_detach_pass
    from torch.export.exported_program import _decompose_exported_program

    with _no_joint_retrace():
        ep = _decompose_exported_program(ep, cia_to_decomp={}, python_decomp_table=joint_decompositions(),
                                         joint_loss_index=0, decompose_custom_triton_ops=False)
    # _export_forward_backward copies the graph first (_copy_graph_module_and_signature) to keep
    # the decomposed program intact; nothing else holds this one.
    _remove_detach_pass(ep.graph_module, ep.graph_signature)
    return ep._update(ep.graph_module, ep.graph_signature)


@contextlib.contextmanager
def _fx_config(**values):
    """Set ``torch.fx.config`` attributes for the duration; those this torch lacks are skipped
    (``do_not_emit_stack_traces`` is absent from torch 2.11, whose graphs then record their stack
    traces: slower capture, the same graph)."""
    import torch.fx.config as cfg

    values = {k: v for k, v in values.items() if hasattr(cfg, k)}
    old = {k: getattr(cfg, k) for k in values}
    for k, v in values.items():
        setattr(cfg, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(cfg, k, v)


@contextlib.contextmanager
def _no_joint_retrace():
    """Inside ``aot_export_module(trace_joint=True)``, build the flattened joint graph by copying
    the traced joint graph node by node instead of tracing it a second time with ``make_fx``.

    ``aot_export_module`` traces the joint graph ``fx_g(primals, tangents) -> (fw_outs,
    grads)`` and then retraces ``flattened_joint`` (calls ``fx_g`` and keeps the gradients of
    the inputs that require one) only to drop the unused tangents and flatten the outputs: a
    third of the joint export's time. :func:`_flat_joint` builds what that retrace records: the
    same ops in the same order, named by ``torch.fx``'s namespace as ``make_fx`` names them
    (``make_fx`` creates a ``getitem`` node for every element of a multi-output op at once, so
    the copy does too), with the joint trace's FakeTensor values. Anything unexpected (another
    ``torch`` whose closure differs, a tangent in use) runs the real retrace.
    ``tests/test_graph.py`` checks the copy against the retrace node by node.
    """
    import torch._functorch.aot_autograd as aot

    real = aot.make_fx

    def make_fx(fn, *args, **kwargs):
        import inspect

        try:
            closure = inspect.getclosurevars(fn).nonlocals
        except (TypeError, ValueError):
            closure = {}
        fx_g = closure.get("fx_g")
        if args or set(kwargs) != {"record_module_stack"} or not isinstance(fx_g, torch.fx.GraphModule):
            return real(fn, *args, **kwargs)

        def trace(*full_args):
            flat = _flat_joint(fx_g, full_args)
            return flat if flat is not None else real(fn, *args, **kwargs)(*full_args)

        return trace

    aot.make_fx = make_fx
    try:
        yield
    finally:
        aot.make_fx = real


def _flat_joint(fx_g: torch.fx.GraphModule, full_args: tuple) -> torch.fx.GraphModule | None:
    """The graph ``make_fx(flattened_joint)(*full_args)`` records (see :func:`_no_joint_retrace`),
    or None when ``fx_g`` is not the joint graph expected."""
    import torch.utils._pytree as pytree

    codegen = fx_g.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    if info is None or info.in_spec is None or info.out_spec is None:
        return None
    placeholders = [n for n in fx_g.graph.nodes if n.op == "placeholder"]
    try:
        primals, tangents = pytree.tree_unflatten(placeholders, info.in_spec)
    except Exception:  # noqa: BLE001 - another layout: retrace
        return None
    if len(primals) != len(full_args) or any(t.users for t in tangents):
        return None
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {t: None for t in tangents}
    for i, (node, arg) in enumerate(zip(primals, full_args)):
        env[node] = new = graph.placeholder(f"arg{i}_1")
        new.meta = dict(node.meta)
        if isinstance(arg, torch.Tensor):
            new.meta["val"] = arg
    items: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # multi-output op -> its getitem nodes
    for node in fx_g.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_function":
            return None
        if node.target is operator.getitem:
            src, idx = node.args
            if src not in items or not isinstance(idx, int):
                return None
            env[node] = items[src][idx]
            env[node].meta = dict(node.meta)
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            return None
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
        name = graph._target_to_str(node.target.overloadpacket.__name__)
        env[node] = new = graph.create_node("call_function", node.target, args, kwargs, name=name)
        new.meta = dict(node.meta)
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            items[node] = []
            for k, v in enumerate(val):
                item = graph.create_node("call_function", operator.getitem, (new, k), {}, name="getitem")
                item.meta = {"val": v}
                items[node].append(item)
    out_args = fx_g.graph.output_node().args[0]
    try:
        fw_outs, grads = codegen.process_outputs([env[a] if isinstance(a, torch.fx.Node) else a for a in out_args])
    except Exception:  # noqa: BLE001 - another layout: retrace
        return None
    if len(grads) != len(full_args):
        return None
    result = list(fw_outs)
    for a, g in zip(full_args, grads):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            if g is None:
                return None
            result.append(g)
        elif g is not None:
            return None
    graph.output(tuple(result))
    return torch.fx.GraphModule(fx_g, graph)


def _drop_noop_dropout(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Remove ``aten.dropout(x, p=0)`` (the identity; eager returns ``x`` itself), which the
    joint graph would otherwise turn into a ``clone`` saved for backward."""
    changed = False
    for n in list(ep.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.dropout.default and len(n.args) == 3:
            x, p, train = n.args  # export passes aten.dropout(input, p, train) positionally
            if p == 0 or train is False:
                n.replace_all_uses_with(x)
                ep.graph.erase_node(n)
                changed = True
    if changed:
        ep.graph_module.recompile()
    return ep


# torch.export names the user's line that raised in its message:
#   The following call raised this error:\n  File "/x/model.py", line 10, in forward\n    if y.sum() > 0:
_RAISED_AT = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s+(.+)')


def _user_frame(e: BaseException) -> str:
    """`` at file.py:LINE in fn (source)`` of the innermost frame outside torch that raised ``e``
    (a data-dependent guard raised while tracing: torch's message abbreviates the path)."""
    import traceback

    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(torch_dir) and f.filename != __file__]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {os.path.basename(f.filename)}:{f.lineno} in {f.name} ({(f.line or '').strip()[:120]})"


def _export_failure(name: str, e: BaseException) -> str:
    """One line: the model, the user's operation that failed (file:line and source) and why."""
    where = ""
    match = _RAISED_AT.search(str(e))
    if match is not None:
        path, line, fn, code = match.groups()
        where = f" at {os.path.basename(path)}:{line} in {fn} ({code.strip()[:120]})"
    if "DataDependent" in type(e).__name__:
        where = where or _user_frame(e)
        # The op that needs a value: named by DataDependentOutputException, else the guard's condition.
        op = getattr(e, "func", None)
        cond = re.search(r"data-dependent expression (.+?) \(unhinted", str(e))
        what = (f"op {op}" if op is not None
                else f"the branch on {cond.group(1)[:120]}" if cond is not None else "a branch on a tensor value")
        return (f"{name}: data-dependent control flow{where}: {what} reads tensor values, which a capture "
                f"(and a meta-device model) does not have; use operations that do not branch on tensor "
                f"values ({type(e).__name__}; --debug shows the details)")
    return f"{name}: torch.export could not capture the model{where}: {type(e).__name__}: {_first_line(e)}"


@contextlib.contextmanager
def _quiet():
    """Silence torch.export's chatty loggers and warnings for the duration, and what it prints
    to stderr itself (the partial graph dump of a failed export: shown under ``--debug`` only,
    i.e. when the ``tag`` logger is at DEBUG). What the model prints while traced goes to stderr
    (stdout carries ``--json`` output, which a model's print() broke)."""
    import io
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prev = logging.getLogger("torch").level
        logging.getLogger("torch").setLevel(logging.ERROR)
        printed, err = io.StringIO(), sys.stderr
        try:
            with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(err):
                yield
        finally:
            logging.getLogger("torch").setLevel(prev)
            if printed.getvalue().strip() and logging.getLogger("tag").isEnabledFor(logging.DEBUG):
                sys.stderr.write(printed.getvalue())


def _first_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0][:300] if s else ""


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    return type(v).__name__


# --------------------------------------------------------------------------------------------
# per-node analysis
# --------------------------------------------------------------------------------------------
def _tensors_of(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors_of(v)]
    return []


def _nbytes(val: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors_of(val))


def _is_alias(node: torch.fx.Node) -> bool:
    """Views and tuple projections move no data."""
    if node.target is operator.getitem:
        return True
    return bool(getattr(node.target, "is_view", False))


def _meta_args(node: torch.fx.Node) -> tuple[tuple, dict]:
    """The node's ``(args, kwargs)`` with each input node replaced by its traced value."""
    def meta(a):
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    return torch.fx.node.map_aggregate(node.args, meta), torch.fx.node.map_aggregate(node.kwargs, meta)


def _attention_dims(node: torch.fx.Node) -> tuple[int, int, bool, float] | None:
    """``(query length, key length, causal, dropout probability)`` of a fused attention call
    (forward or backward: the ATen overloads that take ``is_causal``), else None."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or "is_causal" not in arg_names(target):
        return None
    bound = bind(target, *_meta_args(node))
    q, k = bound.get("query"), bound.get("key")
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)):
        return None
    return int(q.shape[-2]), int(k.shape[-2]), bool(bound.get("is_causal")), float(bound.get("dropout_p") or 0.0)


def _node_flops(node: torch.fx.Node, attention: tuple | None = None) -> float:
    """FLOPs of ``node`` by ``torch.utils.flop_counter``'s formulas; a causal fused attention
    (``attention``: :func:`_attention_dims`) counts the pairs it computes."""
    packet = getattr(node.target, "overloadpacket", None)
    fn = flop_registry.get(packet) if packet is not None else None
    if fn is None:
        return 0.0
    args, kwargs = _meta_args(node)
    try:
        flops = float(fn(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that cannot read these args counts 0, logged
        log.debug("no FLOP formula applied to %s", node.name)
        return 0.0
    if attention is not None and attention[2]:
        flops *= causal_fraction(attention[0], attention[1])
    return flops


def causal_fraction(length: int, source_length: int) -> float:
    """Fraction of the ``[length, source_length]`` query-key pairs a causal (top-left aligned)
    attention computes: the fused kernels skip the masked ones, so a causal attention's FLOPs are
    those of the full score products times this (``(L + 1) / 2L`` for a square one).
    ``torch.utils.flop_counter`` counts every pair."""
    if length <= 0 or source_length <= 0:
        return 1.0
    n = min(length, source_length)  # rows i < n see i + 1 keys, the rest all of them
    return (n * (n + 1) / 2 + (length - n) * source_length) / (length * source_length)


@dataclass
class _NodeInfo:
    flops: float
    read: int
    written: int
    out_bytes: int
    shape: tuple | None
    dtype: str = ""
    attention: tuple[int, int, bool, float] | None = None


def _analyse(gm: torch.fx.GraphModule) -> dict[str, _NodeInfo]:
    info: dict[str, _NodeInfo] = {}
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "call_function"):
            continue
        val = n.meta.get("val")
        out_b = _nbytes(val)
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        outs = _tensors_of(val)
        dtype = dtype_name(outs[0].dtype) if outs else ""
        if n.op == "placeholder" or _is_alias(n):
            info[n.name] = _NodeInfo(0.0, 0, 0, out_b, shape, dtype)
            continue
        read = sum(_nbytes(a.meta.get("val")) for a in n.all_input_nodes)
        attention = _attention_dims(n)
        info[n.name] = _NodeInfo(_node_flops(n, attention), read, out_b, out_b, shape, dtype, attention)
    return info


def _batch_dim(s1: tuple | None, s2: tuple | None) -> int | None:
    if s1 is None or s2 is None or len(s1) != len(s2):
        return None
    for d, (a, b) in enumerate(zip(s1, s2)):
        if a != b:
            return d
    return None


# --------------------------------------------------------------------------------------------
# models without weights: the meta device, captured as fake CPU tensors
# --------------------------------------------------------------------------------------------
def is_abstract(model: torch.nn.Module, inputs: tuple = ()) -> bool:
    """Whether ``model`` or ``inputs`` hold tensors without data (meta device or fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensor

    tensors = [*model.parameters(), *model.buffers(), *(t for t in inputs if isinstance(t, torch.Tensor))]
    return any(t.is_meta or isinstance(t, FakeTensor) for t in tensors)


def to_fake(model: torch.nn.Module, inputs: tuple,
            make_inputs: Callable[[int], tuple]) -> tuple[tuple, Callable[[int], tuple]]:
    """Move a model whose tensors have no data onto fake CPU tensors, in place; returns the
    inputs and an input builder on the same fake tensors.

    A meta-device model cannot be captured as it is (autograd on meta tensors gives parameters
    no gradient), and nothing of it may be allocated (a 7B model is 28 GB in fp32). A
    ``FakeTensor`` is a meta tensor that reports another device: every parameter, buffer and
    input becomes one on the CPU, under one ``FakeTensorMode`` that ``torch.export`` then traces
    with. Sizes, dtypes and strides are kept; values are not (there are none).
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode()
    cpu = torch.device("cpu")

    def fake(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if isinstance(t, FakeTensor):
            if t.fake_mode is mode:
                return t
            t = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        meta = t if t.is_meta else t.detach().to("meta")
        return FakeTensor(mode, meta, cpu)

    made: dict[int, torch.Tensor] = {}  # id of a tensor -> its fake: tied weights stay tied
    for mod in model.modules():
        for k, p in mod._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(fake(p), requires_grad=p.requires_grad)
                mod._parameters[k] = made[id(p)]
        for k, b in mod._buffers.items():
            if b is not None:
                mod._buffers[k] = made.setdefault(id(b), fake(b))

    def make_fake_inputs(b: int) -> tuple:
        return tuple(fake(t) for t in make_inputs(b))

    return tuple(fake(t) for t in inputs), make_fake_inputs


# --------------------------------------------------------------------------------------------
# capture
# --------------------------------------------------------------------------------------------
def _workload_parts(workload: Any) -> tuple[str, torch.nn.Module, tuple, int, Callable[[int], tuple]]:
    name = getattr(workload, "name", type(workload).__name__)
    model, inputs = workload.model, tuple(workload.inputs)
    batch = int(workload.batch_size)
    make_inputs = workload.make_inputs
    if is_abstract(model, inputs):
        inputs, make_inputs = to_fake(model, inputs, make_inputs)
    return name, model, inputs, batch, make_inputs


def capture(workload: Any, *, optimizer: str = "adam", num_groups: int = 48, precision: str = "fp32") -> Captured:
    """Capture ``workload`` (anything with ``name, model, inputs, batch_size, make_inputs``).

    Args:
        workload: a :class:`tag.workloads.Workload` or compatible object.
        optimizer: ``adam`` (default), ``sgd`` (momentum) or ``sgd-plain``.
        num_groups: op-groups to form (fewer if the model has fewer costly ops).
        precision: ``fp32``, or ``bf16`` / ``fp16`` autocast (:mod:`tag.graph.precision`).
    """
    from .grouping import group_ops  # grouping depends on ir only; imported here to keep order

    if optimizer not in OPTIMIZER_COSTS:
        raise WorkloadError(f"optimizer {optimizer!r}: expected one of {sorted(OPTIMIZER_COSTS)}")
    check_precision(precision)
    name, model, inputs, b1, make_inputs = _workload_parts(workload)
    t0 = time.perf_counter()
    ep1, ep2, b2 = export_pair(name, model, inputs, make_inputs, b1, precision)
    seconds = time.perf_counter() - t0
    with _quiet():
        graph, grad_outputs, loss_node = _build_graph(name, ep1, ep2, b1, b2, optimizer)
    graph.precision = precision
    group_ops(graph, num_groups)
    sig = ep1.graph_signature
    kinds = {
        InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer",
        InputKind.CONSTANT_TENSOR: "const", InputKind.USER_INPUT: "input",
    }
    placeholders = [(s.arg.name, kinds.get(s.kind, "other"), s.target) for s in sig.input_specs]
    state = {**ep1.state_dict, **ep1.constants}
    return Captured(graph, ep1.graph_module, placeholders, state, grad_outputs, loss_node, seconds)


def export_pair(name: str, model: torch.nn.Module, inputs: tuple, make_inputs: Callable[[int], tuple], b1: int,
                precision: str) -> tuple[torch.export.ExportedProgram, torch.export.ExportedProgram, int]:
    """The joint graphs at batch ``b1`` (``inputs``) and ``b2 = b1 + 1``; returns ``(ep1, ep2, b2)``."""
    b2 = b1 + 1
    with _quiet():
        ep1 = export_joint(model, inputs, name, precision)
        ep2 = export_joint(model, make_inputs(b2), name, precision)
    return ep1, ep2, b2


def capture_graph(workload: Any, *, optimizer: str = "adam", num_groups: int = 48, precision: str = "fp32",
                  fold: bool = True) -> OpGraph:
    """The :class:`OpGraph` of ``workload`` alone (what ``tag inspect`` and ``tag plan`` need; the
    runnable joint graph of :func:`capture` is not kept).

    A workload of identical blocks (``workload.blocks``, ``workload.with_blocks(k)``: the zoo's
    transformers, a factory's model with a list of identical blocks) is captured by layer folding
    (:mod:`tag.graph.fold`): the same graph from a 3-block and a 2-block capture, proven against
    each other; anything else, a fold that fails its checks (or whose smaller captures fail: the
    full one then says why) or ``fold=False``, by the full :func:`capture`.
    """
    from .fold import MIN_BLOCKS, NoFold, fold_capture
    from .grouping import group_ops

    blocks = getattr(workload, "blocks", None)
    if fold and blocks is not None and blocks >= MIN_BLOCKS and getattr(workload, "with_blocks", None) is not None:
        if optimizer not in OPTIMIZER_COSTS:
            raise WorkloadError(f"optimizer {optimizer!r}: expected one of {sorted(OPTIMIZER_COSTS)}")
        check_precision(precision)
        try:
            graph, _ = fold_capture(workload, blocks, optimizer, precision)
        except (NoFold, WorkloadError) as e:  # (a user's model with fewer blocks may not run: the full capture says)
            log.info("%s: layer folding not used (%s); capturing all %d blocks", workload.name, e, blocks)
        else:
            graph.precision = precision
            group_ops(graph, num_groups)
            return graph
    return capture(workload, optimizer=optimizer, num_groups=num_groups, precision=precision).graph


def _build_graph(name, ep1, ep2, b1, b2, optimizer) -> tuple[OpGraph, dict[str, str], str]:
    gm1, gm2 = ep1.graph_module, ep2.graph_module
    sig = ep1.graph_signature
    info1, info2 = _analyse(gm1), _analyse(gm2)
    if set(info1) != set(info2):
        missing = sorted(set(info1) ^ set(info2))[:3]
        log.warning("graphs at batch %d and %d differ (%s...); batch dims there assumed absent", b1, b2, missing)

    out = _output_node(gm1.graph)
    outs = list(out.args[0])
    loss_node = outs[_loss_index(sig)]
    grad_outputs: dict[str, str] = {}
    fwd_roots = [loss_node]
    for spec, arg in zip(sig.output_specs, outs):
        if spec.kind == OutputKind.GRADIENT_TO_PARAMETER and isinstance(arg, torch.fx.Node):
            grad_outputs[spec.target] = arg.name
        elif spec.kind in (OutputKind.BUFFER_MUTATION, OutputKind.USER_OUTPUT) and isinstance(arg, torch.fx.Node):
            fwd_roots.append(arg)
    forward = _ancestors(gm1.graph, fwd_roots)
    live = _ancestors(gm1.graph, [a for a in outs if isinstance(a, torch.fx.Node)])

    kind_of = {}
    for s in sig.input_specs:
        kind_of[s.arg.name] = {
            InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer",
            InputKind.CONSTANT_TENSOR: "const",
        }.get(s.kind, "input")

    def aff(attr: str, n: str) -> Affine:
        v1 = getattr(info1[n], attr)
        v2 = getattr(info2[n], attr) if n in info2 else v1
        return Affine.fit(float(v1), b1, float(v2), b2)

    nodes2 = {n.name: n for n in gm2.graph.nodes}

    def reads_batch(n: torch.fx.Node) -> bool:
        """The node's non-tensor arguments differ at the two batches (inputs named by node)."""
        n2 = nodes2.get(n.name)
        return n2 is None or _plain_args(n) != _plain_args(n2)

    tensors: list[Tensor] = []
    tensor_of: dict[str, int] = {}
    ops: list[Op] = []
    for n in gm1.graph.nodes:
        if n.name not in live or n.op not in ("placeholder", "call_function"):
            continue
        s2 = info2[n.name].shape if n.name in info2 else None
        bdim = _batch_dim(info1[n.name].shape, s2)
        if n.op == "placeholder":
            kind = kind_of.get(n.name, "input")
            tensor_of[n.name] = len(tensors)
            tensors.append(Tensor(n.name, kind, aff("out_bytes", n.name), bdim, -1))
            continue
        phase = "fwd" if n.name in forward else "bwd"
        ins = [tensor_of[a.name] for a in n.all_input_nodes if a.name in tensor_of]
        idx = len(ops)
        t_idx = len(tensors)
        tensors.append(Tensor(n.name, "activation" if phase == "fwd" else "grad", aff("out_bytes", n.name), bdim, idx))
        tensor_of[n.name] = t_idx
        for i in ins:
            tensors[i].consumers.append(idx)
        # a multi-output op carries the batch if any of its outputs does
        batch = bdim is not None or _any_batch(info1[n.name], info2.get(n.name))
        ops.append(Op(n.name, str(n.target) if n.target is not operator.getitem else "getitem", phase,
                      aff("flops", n.name), aff("read", n.name), aff("written", n.name), ins, [t_idx], batch,
                      dtype=info1[n.name].dtype, reads_batch=reads_batch(n), attention=info1[n.name].attention))

    # optimizer updates, one per parameter
    flops_el, n_read, n_written, n_state = OPTIMIZER_COSTS[optimizer]
    params: list[Param] = []
    p_node = {s.target: s.arg.name for s in sig.input_specs if s.kind == InputKind.PARAMETER}
    for target, node_name in p_node.items():
        if target not in grad_outputs:
            continue
        t = tensors[tensor_of[node_name]]
        nbytes = int(t.nbytes.fixed)
        val = gm1.graph.find_nodes(op="placeholder", target=node_name)
        numel = val[0].meta["val"].numel() if val else nbytes // 4
        t_dtype = val[0].meta["val"].dtype if val else torch.float32  # master weights: fp32 under autocast
        es = nbytes // max(numel, 1)
        g_idx = tensor_of[grad_outputs[target]]
        idx = len(ops)
        upd_out = len(tensors)
        tensors.append(Tensor(f"{optimizer}::{target}", "opt", Affine(nbytes, 0), None, idx))
        ops.append(Op(f"{optimizer}::{target}", f"optim.{optimizer}", "opt", Affine(flops_el * numel, 0),
                      Affine(n_read * numel * es, 0), Affine(n_written * numel * es, 0),
                      [tensor_of[node_name], g_idx], [upd_out], False, dtype=dtype_name(t_dtype),
                      reads_batch=False))
        tensors[tensor_of[node_name]].consumers.append(idx)
        tensors[g_idx].consumers.append(idx)
        params.append(Param(target, tensor_of[node_name], g_idx, idx, numel, nbytes, n_state * nbytes))
    graph = OpGraph(name, b1, optimizer, ops, tensors, params, loss=tensor_of[loss_node.name])
    return graph, grad_outputs, loss_node.name


def _plain_args(n: torch.fx.Node) -> str:
    """A node's arguments with every input node replaced by its name (shapes, scalars, dtypes
    compared as written)."""
    return repr(torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.name))


def _any_batch(i1: _NodeInfo, i2: _NodeInfo | None) -> bool:
    return i2 is not None and i1.out_bytes != i2.out_bytes
