"""Layer folding: capture a model of ``n`` identical blocks (transformer layers) from a 3-block and
a 2-block capture of the same model, and unroll the repeated block to ``n`` copies.

Most of a capture's time goes into tracing the joint forward+backward graph, node by node
(:func:`tag.graph.capture.export_joint`: 89% of ``tag inspect --no-cache`` of GPT-2 small,
cProfile, 2026-11-26), and the nodes of a transformer are almost all inside its ``n`` layers. TAP (the seed
paper) folds repeated subgraphs for the same reason. Here the fold is *exact*: the unrolled joint
graph is the one a capture of all ``n`` blocks gives, node by node (names, targets, arguments,
FakeTensor values), so :func:`~tag.graph.capture._build_graph` turns it into the same
:class:`~tag.graph.ir.OpGraph` (same ops, costs, tensors, parameters, groups, signature).

How: the joint graphs ``G2`` and ``G3`` of the model with 2 and 3 blocks (at the batch ``B``)
differ by insertions only (:mod:`difflib` on node signatures: op, target, constant arguments,
output shapes and dtypes). Each insertion of ``m`` nodes sits in a *region* of ``G3``: three
consecutive runs of ``m`` nodes with equal signatures, one run per block (the parameter
placeholders, the forward of each layer, the backward of each layer in reverse). The runs need
not start at a module boundary; they only need to repeat. A region before the loss is ascending
(run ``c`` is block ``c``), one after it descending (run ``c`` is block ``2 - c``). Unrolling to
``n`` blocks emits, for each region, the first run for block 0, the middle run for blocks
``1..n-2`` and the last run for block ``n - 1``; an argument that pointed ``d`` blocks away in
the template points ``d`` blocks away in the copy, an argument outside every region points to
the same (shared) node. Placeholder names and parameter targets get the block index in place of
the template's (``h.1.`` -> ``h.7.``); other nodes are renamed by ``torch.fx``'s own namespace
in graph order, as tracing names them.

When it is not used (the full capture runs instead, :func:`capture_graph`): a workload that
does not declare a block count (CNNs, MLPs: the zoo's GPT-2, BERT, ViT and Llama do, by
rebuilding themselves with another ``n_layer``, and a factory's model holding an ``nn.ModuleList``
or ``nn.Sequential`` of identical blocks, by a copy with the list cut,
:func:`tag.workloads.factory.find_blocks`), fewer than :data:`MIN_BLOCKS` blocks, captures of
the cut model that fail,
or any check failing: an edit other than insertions, a region whose three runs differ, an
argument that cannot be mapped (a shared node reading the middle block, a reference more than
one block away), the graphs at ``B`` and ``B + 1`` named differently, and above all *the proof*:
the 3-block template unrolled to 2 blocks must reproduce the captured 2-block graph exactly
(names, targets, arguments, values, signature). A failed check is logged (``--debug``) with
its reason. ``tests/test_fold.py`` compares folded and full captures of 4- and 5-block
GPT-2, BERT, ViT and Llama op by op.
"""

from __future__ import annotations

import difflib
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch.export.graph_signature import ExportGraphSignature, InputSpec, OutputSpec, TensorArgument

from .ir import OpGraph

log = logging.getLogger(__name__)

TEMPLATE_BLOCKS = 3
"""Blocks of the template capture (first, middle and last block: each behaves as in any ``n``)."""
MIN_BLOCKS = 6
"""Fewest blocks worth folding: the fold traces the model twice with 3 blocks and once with 2, a
full capture twice with ``n`` (a trace costs about one block's worth per block, plus about as
much again for the embedding, head and loss)."""


class NoFold(Exception):
    """Folding is not proven safe for this model; the message says why."""


# --------------------------------------------------------------------------------------------
# regions of repeated runs
# --------------------------------------------------------------------------------------------
_DIGITS = re.compile(r"(\d+)")


def _val_sig(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), str(v.dtype))
    if isinstance(v, (list, tuple)):
        return tuple(_val_sig(x) for x in v)
    return type(v).__name__


def _node_sig(n: torch.fx.Node) -> tuple:
    """What must be equal for two nodes to be copies of each other (arguments' identity aside)."""
    if n.op == "output":  # its arguments (loss, one gradient per parameter) grow with the blocks
        return ("output",)
    consts = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: None)
    # a placeholder is its name with the numbers blanked: blocks' parameters match each other,
    # not a shared parameter of the same shape (BERT's embedding LayerNorm and a layer's)
    target = n.target if n.op != "placeholder" else _DIGITS.sub("#", n.name)
    return (n.op, str(target), repr(consts), _val_sig(n.meta.get("val")))


@dataclass(frozen=True)
class Region:
    """Three consecutive runs of ``period`` nodes each, one per template block."""

    start: int
    """Index of the first node of run 0 in the template graph's node list."""
    period: int
    descending: bool
    """After the loss (backward): run 0 is the last block."""

    def layer(self, run: int) -> int:
        """Template block of run ``run`` (0..2)."""
        return TEMPLATE_BLOCKS - 1 - run if self.descending else run

    def instance(self, layer: int, n: int) -> int:
        """Position (0..n-1) of block ``layer`` among the region's ``n`` unrolled runs."""
        return n - 1 - layer if self.descending else layer


def find_regions(g2: torch.fx.Graph, g3: torch.fx.Graph, loss: str) -> list[Region]:
    """The repeated regions of ``g3`` (3 blocks, loss node ``loss``), found by diffing it against
    ``g2`` (2 blocks)."""
    n2, n3 = list(g2.nodes), list(g3.nodes)
    s2, s3 = [_node_sig(n) for n in n2], [_node_sig(n) for n in n3]
    loss_pos = next(i for i, n in enumerate(n3) if n.name == loss)
    regions: list[Region] = []
    for tag, _i1, _i2, j1, j2 in difflib.SequenceMatcher(None, s2, s3, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if tag != "insert":
            raise NoFold(f"the 2- and 3-block graphs differ by more than inserted nodes ({tag} at node {j1})")
        m = j2 - j1
        # Slide the inserted run until the runs before and after it are copies of it.
        for shift in sorted(range(-m, m + 1), key=abs):
            a = j1 + shift - m
            if a >= 0 and a + 3 * m <= len(s3) and s3[a:a + m] == s3[a + m:a + 2 * m] == s3[a + 2 * m:a + 3 * m]:
                break
        else:
            raise NoFold(f"the {m} nodes inserted at node {j1} are not one of three repeated runs")
        if a <= loss_pos < a + 3 * m:
            raise NoFold(f"a repeated region ({n3[a].name}..) contains the loss")
        if regions and a < regions[-1].start + 3 * regions[-1].period:
            raise NoFold(f"repeated regions overlap at node {n3[a].name}")
        regions.append(Region(a, m, a > loss_pos))
    if not regions:
        raise NoFold("the 2- and 3-block graphs are the same")
    return regions


# --------------------------------------------------------------------------------------------
# unrolling
# --------------------------------------------------------------------------------------------
def _renamer(names: list[str], layers: list[int]) -> Any:
    """``f(layer) -> name`` for names of the same thing in blocks ``layers`` (e.g. targets
    ``model.h.0.w``, ``model.h.1.w``, ``model.h.2.w``): the numbers equal to the block change."""
    parts = [_DIGITS.split(s) for s in names]
    if len({len(p) for p in parts}) != 1:
        raise NoFold(f"names {names} do not differ by a block index")
    slots = []
    for i, tokens in enumerate(zip(*parts)):
        if len(set(tokens)) == 1:
            continue
        if i % 2 == 1 and all(t == str(u) for t, u in zip(tokens, layers)):
            slots.append(i)
        else:
            raise NoFold(f"names {names} do not differ by a block index")
    template = parts[0]

    def name(layer: int) -> str:
        return "".join(str(layer) if i in slots else t for i, t in enumerate(template))

    return name


def unroll(gm: Any, sig: ExportGraphSignature, regions: list[Region], n: int) -> tuple[torch.fx.Graph, ExportGraphSignature]:
    """The joint graph and signature of ``n`` blocks from the 3-block template ``gm`` / ``sig``."""
    if n < 2:
        raise NoFold(f"cannot unroll to {n} blocks")
    nodes = list(gm.graph.nodes)
    home: dict[torch.fx.Node, tuple[int, int, int]] = {}  # node -> (region, run, offset)
    for ri, r in enumerate(regions):
        for run in range(TEMPLATE_BLOCKS):
            for off in range(r.period):
                home[nodes[r.start + run * r.period + off]] = (ri, run, off)

    def run_of(k: int) -> int:  # template run of the k-th unrolled run
        return 0 if k == 0 else TEMPLATE_BLOCKS - 1 if k == n - 1 else 1

    new = torch.fx.Graph()
    copies: dict[tuple[int, int, int], torch.fx.Node] = {}  # (region, instance, offset) -> node
    shared: dict[torch.fx.Node, torch.fx.Node] = {}

    def resolve(ref: torch.fx.Node, ctx: tuple[int, int] | None) -> torch.fx.Node:
        """``ref`` as seen from block ``ctx = (layer, template layer)`` (None: a shared node)."""
        where = home.get(ref)
        if where is None:
            return shared[ref]
        rj, run, off = where
        u = regions[rj].layer(run)
        if ctx is None:
            if u == 1:
                raise NoFold(f"a node outside the blocks reads {ref.name} of the middle block")
            layer = 0 if u == 0 else n - 1
        else:
            layer = ctx[0] + u - ctx[1]
            if not 0 <= layer < n:
                raise NoFold(f"{ref.name} is read from {abs(u - ctx[1])} blocks away")
        key = (rj, regions[rj].instance(layer, n), off)
        if key not in copies:
            raise NoFold(f"{ref.name} would be read before it is computed")
        return copies[key]

    per_block = [_numbers_per_block(nodes, r) for r in regions]
    ri_of = {node: where[0] for node, where in home.items()}
    specs_in = {s.arg.name: s for s in sig.input_specs}
    new_inputs: list[InputSpec] = []
    targets: dict[str, Any] = {}  # template target -> renamer, for the gradients' output specs

    shifted: Counter[str] = Counter()  # name base -> numbers the unrolled blocks add before here

    def emit(node: torch.fx.Node, ctx: tuple[int, int] | None, names: Any = None, step: int = 0) -> torch.fx.Node:
        """``step``: blocks between this copy and its template run (names move by that many
        blocks' worth of numbers)."""
        layer = ctx[0] if ctx is not None else None
        if node.op == "placeholder":
            name = names[0](layer) if names else node.name
            out = new.placeholder(name)
            spec = specs_in[node.name]
            target = names[1](layer) if names and names[1] is not None else spec.target
            new_inputs.append(InputSpec(spec.kind, TensorArgument(name), target, spec.persistent))
        elif node.op == "call_function":
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: resolve(a, ctx))
            base, k = _split_name(node.name)
            k += shifted[base] + step * per_block[ri_of[node]].get(base, 0) if node in ri_of else shifted[base]
            out = new.create_node("call_function", node.target, args, kwargs, name=f"{base}_{k}" if k else base)
            if out.name != (f"{base}_{k}" if k else base):
                raise NoFold(f"name {out.name} where {base}_{k} was meant")
        else:
            raise NoFold(f"node {node.name} is a {node.op}")
        out.meta = dict(node.meta)
        return out

    i = 0
    starts = {r.start: ri for ri, r in enumerate(regions)}
    while i < len(nodes):
        node = nodes[i]
        if node.op == "output":
            break
        ri = starts.get(i)
        if ri is None:
            shared[node] = emit(node, None)
            i += 1
            continue
        r = regions[ri]
        renamers = _placeholder_renamers(nodes, r, specs_in, targets)
        for k in range(n):
            run = run_of(k)
            layer = n - 1 - k if r.descending else k
            for off in range(r.period):
                t = nodes[r.start + run * r.period + off]
                copies[(ri, k, off)] = emit(t, (layer, r.layer(run)), renamers.get(off), k - run)
        for base, d in per_block[ri].items():  # nodes after the region: n - 3 more blocks' numbers
            shifted[base] += (n - TEMPLATE_BLOCKS) * d
        i = r.start + TEMPLATE_BLOCKS * r.period

    outs, out_specs = _unroll_outputs(nodes[-1], sig, home, regions, n, lambda ref, ctx: resolve(ref, ctx), targets)
    new.output(tuple(outs))
    new.lint()
    return new, ExportGraphSignature(new_inputs, out_specs)


def _split_name(name: str) -> tuple[str, int]:
    """``mm_12`` -> ``("mm", 12)``, ``mm`` -> ``("mm", 0)``: torch.fx numbers the nodes of a
    name base in creation order (with gaps where it erased nodes)."""
    m = re.fullmatch(r"(.*)_(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _numbers_per_block(nodes: list[torch.fx.Node], r: Region) -> dict[str, int]:
    """name base -> how far its numbers move from one run of region ``r`` to the next (the
    block's nodes of that base, erased ones included); the same for every node and both steps."""
    step: dict[str, int] = {}
    for off in range(r.period):
        trio = [nodes[r.start + run * r.period + off] for run in range(TEMPLATE_BLOCKS)]
        if trio[0].op != "call_function":
            continue
        (b0, k0), (b1, k1), (b2, k2) = (_split_name(t.name) for t in trio)
        if not b0 == b1 == b2 or k1 - k0 != k2 - k1 or step.setdefault(b0, k1 - k0) != k1 - k0:
            raise NoFold(f"names {[t.name for t in trio]} are not numbered block by block")
    return step


def _placeholder_renamers(nodes, r: Region, specs_in, targets) -> dict[int, tuple]:
    """offset -> (name renamer, target renamer) for the placeholders of region ``r``."""
    out = {}
    layers = [r.layer(run) for run in range(TEMPLATE_BLOCKS)]
    for off in range(r.period):
        trio = [nodes[r.start + run * r.period + off] for run in range(TEMPLATE_BLOCKS)]
        if trio[0].op != "placeholder":
            continue
        name = _renamer([t.name for t in trio], layers)
        tgts = [specs_in[t.name].target for t in trio]
        target = _renamer(tgts, layers) if tgts[0] is not None else None
        if target is not None:
            for t, u in zip(tgts, layers):
                targets[t] = (target, u)
        out[off] = (name, target)
    return out


def _unroll_outputs(out: torch.fx.Node, sig, home, regions, n, resolve, targets) -> tuple[list, list[OutputSpec]]:
    """The output tuple (loss, gradients, ...) for ``n`` blocks: each stretch of outputs of the
    blocks (gradients of their parameters, ``targets``: template target -> (renamer, block)) is
    three equal runs, one per block, unrolled like a region."""
    vals, specs = list(out.args[0]), list(sig.output_specs)

    def block_of(i: int) -> int | None:
        """Block of output ``i``: its parameter's, else where its value is computed."""
        if specs[i].target in targets:
            return targets[specs[i].target][1]
        if specs[i].target is None and isinstance(vals[i], torch.fx.Node) and vals[i] in home:
            return regions[home[vals[i]][0]].layer(home[vals[i]][1])
        return None

    res_vals: list = []
    res_specs: list[OutputSpec] = []
    i = 0
    while i < len(vals):
        if block_of(i) is None:
            v = resolve(vals[i], None) if isinstance(vals[i], torch.fx.Node) else vals[i]
            res_vals.append(v)
            s = specs[i]
            res_specs.append(OutputSpec(s.kind, TensorArgument(v.name), s.target) if isinstance(v, torch.fx.Node) else s)
            i += 1
            continue
        j = i
        while j < len(vals) and block_of(j) is not None:
            j += 1
        if (j - i) % TEMPLATE_BLOCKS:
            raise NoFold("the outputs computed in the blocks are not three equal runs")
        m = (j - i) // TEMPLATE_BLOCKS
        runs = [vals[i + c * m:i + (c + 1) * m] for c in range(TEMPLATE_BLOCKS)]
        layer_of = [{block_of(i + c * m + off) for off in range(m)} for c in range(TEMPLATE_BLOCKS)]
        if any(len(s) != 1 for s in layer_of):
            raise NoFold("a run of outputs mixes blocks")
        order = [s.pop() for s in layer_of]
        if order not in ([0, 1, 2], [2, 1, 0]):
            raise NoFold(f"outputs of blocks in order {order}")
        for k in range(n):
            run = 0 if k == 0 else TEMPLATE_BLOCKS - 1 if k == n - 1 else 1
            layer = k if order[0] == 0 else n - 1 - k
            for off in range(m):
                v = runs[run][off]
                res_vals.append(resolve(v, (layer, order[run])))
                s = specs[i + run * m + off]
                target = targets[s.target][0](layer) if s.target in targets else s.target
                res_specs.append(OutputSpec(s.kind, TensorArgument(res_vals[-1].name), target))
        i = j
    return res_vals, res_specs


# --------------------------------------------------------------------------------------------
# the proof
# --------------------------------------------------------------------------------------------
def _describe_node(n: torch.fx.Node) -> tuple:
    args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.name)
    target = n.target if n.op != "placeholder" else ""
    return (n.name, n.op, str(target), repr(args), _val_sig(n.meta.get("val")))


def same_graph(a: torch.fx.Graph, sa: ExportGraphSignature, b: torch.fx.Graph, sb: ExportGraphSignature) -> str | None:
    """None when the two joint graphs are the same node by node, else the first difference."""
    na, nb = list(a.nodes), list(b.nodes)
    if len(na) != len(nb):
        return f"{len(na)} nodes against {len(nb)}"
    for x, y in zip(na, nb):
        dx, dy = _describe_node(x), _describe_node(y)
        if dx != dy:
            return f"node {dx[:3]} against {dy[:3]}"

    def spec(s):
        return (str(s.kind), s.arg.name, s.target)

    for what, xs, ys in (("input", sa.input_specs, sb.input_specs), ("output", sa.output_specs, sb.output_specs)):
        if [spec(s) for s in xs] != [spec(s) for s in ys]:
            return f"{what} specs differ"
    return None


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------
def fold_capture(workload: Any, blocks: int, optimizer: str, precision: str) -> tuple[OpGraph, float]:
    """The OpGraph of ``workload`` (``blocks`` identical blocks) from 3- and 2-block captures;
    raises :class:`NoFold` when the fold is not proven. Returns ``(graph, export seconds)``."""
    from .capture import _build_graph, _loss_index, _quiet, _workload_parts, export_joint, export_pair

    t0 = time.perf_counter()
    name = getattr(workload, "name", type(workload).__name__)
    small = workload.with_blocks(TEMPLATE_BLOCKS)
    _, model, inputs, b1, make_inputs = _workload_parts(small)
    ep1, ep2, b2 = export_pair(name, model, inputs, make_inputs, b1, precision)
    two = workload.with_blocks(TEMPLATE_BLOCKS - 1)
    _, model2, inputs2, _, _ = _workload_parts(two)
    with _quiet():
        check = export_joint(model2, inputs2, name, precision)
    seconds = time.perf_counter() - t0
    if [(n.name, str(n.target)) for n in ep1.graph.nodes] != [(n.name, str(n.target)) for n in ep2.graph.nodes]:
        raise NoFold(f"the graphs at batch {b1} and {b2} differ")
    loss = ep1.graph_signature.output_specs[_loss_index(ep1.graph_signature)].arg.name
    regions = find_regions(check.graph, ep1.graph, loss)
    g, s = unroll(ep1.graph_module, ep1.graph_signature, regions, TEMPLATE_BLOCKS - 1)
    diff = same_graph(g, s, check.graph, check.graph_signature)
    if diff is not None:
        raise NoFold(f"the 3-block template unrolled to 2 blocks is not the 2-block capture: {diff}")
    full = []
    for ep in (ep1, ep2):
        g, s = unroll(ep.graph_module, ep.graph_signature, regions, blocks)
        full.append(SimpleNamespace(graph_module=SimpleNamespace(graph=g), graph_signature=s))
    with _quiet():
        graph, _, _ = _build_graph(name, full[0], full[1], b1, b2, optimizer)
    return graph, seconds
