"""Tensor parallelism, Megatron-style (``GroupPlan.sync == "tp"``).

**Detection** (pure functions of the :class:`~tag.graph.ir.OpGraph`): a *weight matmul* is a
forward ``mm`` / ``addmm`` / ``bmm`` / ``linear`` one of whose inputs is a parameter (through views,
transposes and dtype casts only, the parameter used by nothing else). A Megatron block is a
**row-parallel** weight matmul ``R`` (attention output / MLP down projection: weight split by its
input features) and the **column-parallel** weight matmuls ``C`` (QKV / MLP up and gate
projections: weight and bias split by their output features) whose outputs reach ``R`` through
ops that act per feature or per head only (:data:`PER_FEATURE`: element-wise maths, views,
attention's weightless ``bmm`` and ``softmax`` over keys, rotary ``cat``/``slice``), and reach
nothing else. Layer norms, reductions over features and the loss are not per feature: the LM head
and embeddings are never split. The split features (``R``'s input features) come from ``R``'s
weight size and the ratio of its input to output activation bytes; the heads from the attention
scores' bytes where they are materialised (a ``softmax``) or from a fused attention's logsumexp,
else unknown.

**The strategy.** A group's ``T`` devices (``GroupPlan.tp``: ``len(devices) / T`` data-parallel
replicas of ``T`` consecutive devices each, default one replica) on one machine split every block
touching the group ``T`` ways: split parameters (and their gradients and optimizer state) are
``1 / T`` per device, and inside a block (:func:`block_interior`) each device computes ``1 / T``
of the features of the tensor-parallel group's samples. Two variants (``GroupPlan.
sequence_parallel``):

* **plain Megatron-LM** (the default, what the executor runs): outside the blocks every device of
  a tensor-parallel group runs the group's whole batch, the ops replicated; one all-reduce after
  each row-parallel matmul (forward) and one after each column-parallel input gradient
  (backward). The replicated parameters' gradients are identical within a tensor-parallel group,
  so every gradient is all-reduced over the data-parallel replicas holding the same shard only
  (nothing with one replica);
* **sequence parallel** (Megatron-LM's ``--sequence-parallel``): outside a block each device
  holds ``1 / T`` of the tokens of the group's samples; entering a block the shards are all-gathered, leaving it the
  row-parallel partial sums are reduce-scattered (forward), the same pair in reverse for the input
  gradient (backward): per block and direction the bytes of one all-reduce of the block's
  activation, as plain Megatron's. The replicated parameters' gradients are partial over the
  token shards: all-reduced over every device of the group's replicas, the split ones' over the
  replicas holding the same shard.

**Samples.** In plain Megatron the ``T`` devices of a tensor-parallel group compute the same
samples: the group is one sample replica (Megatron-LM's micro-batch of one sample on ``tp=8`` is
one replica of one sample). ``GroupPlan.shares`` keeps one share per device, equal within a
tensor-parallel group (checked, one line otherwise); the group's share is their sum
(:meth:`TensorParallel.replica_shares`), its samples ``local_batches(B, replica shares)``, so a plain
``tp`` group needs a sample per tensor-parallel group, not per device. Its unit
(:meth:`TensorParallel.units`) gives each device its group's sample range (a *holder set* of
:mod:`tag.parallel.moves`: a tensor leaving the group moves once per consumer, from the aligned
device of the group, as Megatron-LM's pipeline sends each tensor-parallel rank's full activation
to the same rank of the next stage; one entering it reaches each device). Plans written when
each device had its own range (``1 / T`` of the group's samples, in device order) keep their
meaning, the group's samples being the union of its devices' ranges, of the same total; with a
batch the group's devices do not divide evenly, the group's count now follows the executor's
rounding (:func:`executed_plan`; the simulator's per-device rounding could give the two
devices of a group 2 and 1 samples). With sequence parallelism each device holds ``1 / T`` of
the tokens of the group's samples outside the blocks, modelled, as before, as its own sample
range (:meth:`TensorParallel.width` 1): a sample per device and micro-batch. The simulator costs both
variants (:mod:`tag.sim.tensor_parallel`).

**What the executor runs** (:mod:`tag.executor.tensor_parallel`): plain Megatron (no sequence
parallelism) in a plan whose every group is ``tp``: without a pipeline, every group over the same
devices with the same degree and shares (the same tensor-parallel groups for the whole plan,
each a data-parallel replica); with a pipeline (Megatron-LM's ``dp x tp x pp``), every group of a
stage over the stage's devices with the same degree and shares and every stage at the same
degree. It runs the data-parallel plan (the pipeline of data-parallel stages) over the
tensor-parallel groups' first devices (:func:`executed_plan`): every device of a group walks its
first device's schedule on its shard, sends what the first device sends to another stage's first
device to the device of its own index there (within a machine the full activation, as the
holder sets above price it; between machines Megatron-LM's scatter-gather, as they price it too:
slice ``i`` of the flattened tensor to device ``i``, then an all-gather inside the receiving
group, :meth:`tag.executor.tensor_parallel.TpRank.scattered`), and sums its gradients with the devices of its index in the stage's other groups. :meth:`TensorParallel.execution_refusal` names the first field of any
other plan with ``tp`` groups (sequence parallelism, stages of different degrees), which the
executor refuses in one line (:func:`tag.parallel.execution_refusal`, raised by
:func:`tag.parallel.validate_plan` ``tensor_parallel=False``). Sequence parallelism is refused:
its ops outside the blocks run on ``1 / T`` of the tokens, which the rewriting of
:mod:`tag.executor.tensor_parallel` (features split inside the blocks, everything else
replicated) does not do; it would need the joint graph cut along the sequence dim outside the
blocks and an all-gather / reduce-scatter pair in place of each all-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from ..errors import PlanError
from ..graph.capture import FUSED_ATTENTION
from ..graph.ir import Affine, OpGraph
from ..plan.format import GroupPlan, device_ranges
from .pipeline import stage_of_group
from .strategy import (
    Collective,
    SearchTable,
    Strategy,
    Unit,
    check_shares,
    execution_refusal,
    no_field,
    sample_replicas,
)

MAX_DEGREE = 8
"""Largest tensor-parallel degree (devices of one machine, as Megatron-LM advises)."""

WEIGHT_MATMULS = frozenset({"mm", "addmm", "bmm", "linear", "matmul"})
"""ATen ops (base names) that are a weight matmul when one input is a parameter."""

WEIGHT_PATH = frozenset({"t", "permute", "transpose", "view", "_unsafe_view", "reshape", "_to_copy", "alias",
                         "expand", "clone", "detach", "contiguous"})
"""Ops between a parameter and the matmul reading it (layout and dtype only)."""

PER_FEATURE = WEIGHT_PATH | frozenset({
    "unsqueeze", "squeeze", "split", "split_with_sizes", "slice", "select", "unbind", "chunk", "getitem",
    "add", "sub", "mul", "div", "neg", "pow", "tanh", "sigmoid", "silu", "gelu", "relu", "erf", "exp",
    "where", "masked_fill", "native_dropout", "dropout", "_softmax", "softmax", "cat", "bmm", "matmul", "baddbmm",
    "scaled_dot_product_attention", *FUSED_ATTENTION, "full_like", "zeros_like", "ones_like", "copy", "fill"})
"""Ops that act per feature or per attention head (on the split features each device holds)."""

LSE_ITEMSIZE = 4
"""Bytes per element of a fused attention's logsumexp (FP32: the kernels' accumulation dtype,
also under bf16/fp16 autocast)."""


def per_graph(fn):
    """``fn(graph, ...)`` computed once per graph (the extra arguments derive from it), for the
    last few graphs: keyed by the graph's identity, checked against the graph itself."""
    cache: dict[int, tuple[object, object]] = {}

    @functools.wraps(fn)
    def get(graph, *args):
        hit = cache.get(id(graph))
        if hit is not None and hit[0] is graph:
            return hit[1]
        if len(cache) > 16:
            cache.clear()
        out = fn(graph, *args)
        cache[id(graph)] = (graph, out)
        return out

    return get


def base_name(target: str) -> str:
    """``aten.addmm.default`` -> ``addmm``; ``getitem`` -> ``getitem``."""
    parts = target.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[-1]


def _heads(graph: OpGraph, op: int, tokens: float) -> float:
    """Attention heads read from the bytes per sample of op ``op``: a softmax's scores are
    ``heads x tokens x tokens``; a fused attention's logsumexp (its smaller output, taken by a
    ``getitem``; the other is ``heads x tokens x head_dim``) is ``heads x tokens`` FP32."""
    o = graph.ops[op]
    if base_name(o.target) in ("_softmax", "softmax"):
        return graph.tensors[o.outputs[0]].nbytes.per_sample / o.itemsize / (tokens * tokens)
    items = [graph.tensors[graph.ops[c].outputs[0]].nbytes.per_sample for c in graph.tensors[o.outputs[0]].consumers
             if graph.ops[c].target == "getitem"]
    return min(items) / LSE_ITEMSIZE / tokens if items else 0.0


@dataclass(frozen=True)
class MegatronBlock:
    """One column-then-row-parallel region of the forward graph."""

    columns: tuple[int, ...]
    """Op indices of the column-parallel matmuls (forward order)."""
    row: int
    """Op index of the row-parallel matmul."""
    split_params: tuple[int, ...]
    """Indices into ``graph.params`` split ``T`` ways: the columns' weights and biases, the row's weight."""
    features: int
    """Split features: the row matmul's input features (= the columns' output features summed
    over the row's input)."""
    heads: int | None
    """Attention heads (from the materialised scores or a fused attention's logsumexp), ``None``
    for an MLP or where unknown."""
    reduce_fwd: Affine
    """Bytes of the forward all-reduce: the row matmul's output (at the replica's batch)."""
    reduce_bwd: Affine
    """Bytes of the backward all-reduce: the gradient of the columns' input."""


def weight_param(graph: OpGraph, op: int, pidx: dict[int, int] | None = None) -> tuple[int, list[int]] | None:
    """``(param index, other param-derived inputs)`` when op ``op`` is a weight matmul: the
    parameter read by its weight input (through :data:`WEIGHT_PATH` ops only, used by this op
    alone), and the input indices of its other parameter inputs (a bias)."""
    o = graph.ops[op]
    if o.phase != "fwd" or base_name(o.target) not in WEIGHT_MATMULS:
        return None
    if pidx is None:
        pidx = {p.tensor: i for i, p in enumerate(graph.params)}
    found = [(i, p) for i, t in enumerate(o.inputs) if (p := _param_of(graph, t, pidx)) is not None]
    if not found:
        return None
    weights = [(i, p) for i, p in found if graph.params[p].numel > 1 and _is_weight_slot(o, i)]
    if len(weights) != 1:
        return None
    return weights[0][1], [p for i, p in found if (i, p) != weights[0]]


def _is_weight_slot(o, i: int) -> bool:
    """``addmm(bias, x, W)``: the weight is its last input; ``mm(x, W)`` / ``linear(x, W, b)``: not the first."""
    name = base_name(o.target)
    return i == 2 if name == "addmm" else (i == 1 if name == "linear" else i >= 1)


def _param_of(graph: OpGraph, t: int, pidx: dict[int, int]) -> int | None:
    """The parameter behind tensor ``t`` (through :data:`WEIGHT_PATH` ops) if nothing else in the
    forward uses it; ``pidx``: param tensor -> param index."""
    chain = [t]
    while True:
        ten = graph.tensors[t]
        if ten.batch_dim is not None:
            return None
        if ten.kind == "param":
            break
        if ten.producer < 0:
            return None
        prod = graph.ops[ten.producer]
        if base_name(prod.target) not in WEIGHT_PATH or not prod.inputs:
            return None
        t = prod.inputs[0]
        chain.append(t)
    p = pidx.get(t)
    if p is None:
        return None
    # Used by nothing else in the forward (a tied weight is not split).
    for x in chain:
        fwd = [c for c in graph.tensors[x].consumers if graph.ops[c].phase == "fwd"]
        if len(fwd) != 1:
            return None
    return p


@per_graph
def megatron_blocks(graph: OpGraph) -> tuple[MegatronBlock, ...]:
    """Every Megatron block of ``graph`` (forward order of their row matmuls); cached per graph."""
    return tuple(_detect(graph))


def _detect(graph: OpGraph) -> list[MegatronBlock]:
    ops, tensors = graph.ops, graph.tensors
    pidx = {p.tensor: i for i, p in enumerate(graph.params)}
    wm = {i: w for i in range(len(ops)) if (w := weight_param(graph, i, pidx)) is not None}
    reach: dict[int, list[int]] = {}  # row op -> column ops reaching it
    softmax_of: dict[int, int] = {}  # row op -> a softmax or fused attention op on the way
    bias_of: dict[int, set[int]] = {}  # column op -> params added to its output on the way (a bias)
    for c in sorted(wm):
        hit, soft, ok, bias = set(), None, True, set()
        seen, todo = set(), list(ops[c].outputs)
        while todo and ok:
            t = todo.pop()
            if t in seen:
                continue
            seen.add(t)
            for u in tensors[t].consumers:
                uo = ops[u]
                if uo.phase != "fwd":
                    continue
                if u in wm:
                    hit.add(u)
                    continue
                name = base_name(uo.target)
                if name not in PER_FEATURE:
                    ok = False
                    break
                if name in ("_softmax", "softmax", *FUSED_ATTENTION):
                    soft = u
                if name == "add":  # a linear layer on a non-contiguous input: mm, then its bias added
                    bias.update(p for x in uo.inputs if (p := _param_of(graph, x, pidx)) is not None)
                todo.extend(uo.outputs)
        if ok and len(hit) == 1:
            r = hit.pop()
            reach.setdefault(r, []).append(c)
            bias_of[c] = bias
            if soft is not None:
                softmax_of[r] = soft
    blocks = []
    used: set[int] = set()  # matmuls already in a block (a chain of MLP layers pairs up 1-2, 3-4, ...)
    for r, cols in sorted(reach.items()):
        cols = [c for c in cols if c not in used]
        if not cols or r in used:
            continue
        ro = ops[r]
        wp, row_other = wm[r]
        act = [t for t in ro.inputs if tensors[t].batch_dim is not None]
        if len(act) != 1 or not ro.outputs:
            continue
        w = graph.params[wp].numel
        out_ps, in_ps = tensors[ro.outputs[0]].nbytes.per_sample, tensors[act[0]].nbytes.per_sample
        if out_ps <= 0 or in_ps <= 0:
            continue
        feats = round(math.sqrt(w * in_ps / out_ps))  # in * out = w, in / out = in_ps / out_ps
        if feats < 1 or w % feats:
            continue
        out_feats = w // feats
        heads = None
        if r in softmax_of:
            tokens = out_ps / (out_feats * ro.itemsize)  # per sample
            h = _heads(graph, softmax_of[r], tokens) if tokens >= 1 else 0
            if h >= 1 and abs(h - round(h)) < 1e-6 and feats % round(h) == 0:
                heads = round(h)
        split = [wp]
        for c in cols:
            cw, cother = wm[c]
            split += [p for p in (cw, *cother, *sorted(bias_of[c])) if p not in split]
        first_in = [t for t in ops[cols[0]].inputs if tensors[t].batch_dim is not None]
        bwd = tensors[first_in[0]].nbytes if first_in else tensors[ro.outputs[0]].nbytes
        used.update(cols)
        used.add(r)
        blocks.append(MegatronBlock(tuple(cols), r, tuple(split), feats, heads, tensors[ro.outputs[0]].nbytes, bwd))
    return blocks


@dataclass(frozen=True)
class Interior:
    """What runs split inside the Megatron blocks (forward and backward), the rest replicated."""

    ops: frozenset[int]
    """Op indices computed on ``1 / T`` of the split features: the forward ops from each block's
    column matmuls to its row matmul, and the backward ops reading a tensor they make (or a split
    weight): the row input's gradient, the per-head ops' gradients, the weight gradients, the
    column input gradients (partial sums over the split features, all-reduced after)."""
    tensors: frozenset[int]
    """Tensors held as ``1 / T`` of their features: the outputs of :attr:`ops` but the row
    matmuls' outputs and the column input gradients (both all-reduced to the full value), and the
    split parameters with what views them."""


@per_graph
def block_interior(graph: OpGraph) -> Interior:
    """:class:`Interior` of every Megatron block of ``graph`` (cached per graph). Backward ops
    follow the forward ones by data: one reading an interior tensor is interior; its outputs are
    interior tensors unless it reads a column weight and its output carries the batch (the column
    input gradient, all-reduced)."""
    ops, tensors = graph.ops, graph.tensors
    blocks = megatron_blocks(graph)
    fwd: set[int] = set()
    for b in blocks:
        fwd.update(b.columns)
        fwd.add(b.row)
        todo, seen = [t for c in b.columns for t in ops[c].outputs], set()
        while todo:
            t = todo.pop()
            if t in seen:
                continue
            seen.add(t)
            for u in tensors[t].consumers:
                if ops[u].phase == "fwd" and u != b.row and u not in fwd:
                    fwd.add(u)
                    todo.extend(ops[u].outputs)
    rows = {b.row for b in blocks}
    split = {graph.params[p].tensor for b in blocks for p in b.split_params}
    column_weights = {graph.params[p].tensor for b in blocks for c in b.columns
                      for p in [weight_param(graph, c)[0]]}
    # the split weights and their views / transposes / casts (forward or backward)
    sharded: set[int] = set(split)
    weight_of: dict[int, int] = {t: t for t in split}  # sharded weight view -> its parameter tensor
    inner: set[int] = set(fwd)
    for i, o in enumerate(ops):  # graph order: producers before consumers
        if o.phase == "opt":
            continue
        reads = [t for t in o.inputs if t in sharded]
        if o.phase == "fwd" and i not in fwd:
            if reads and base_name(o.target) in WEIGHT_PATH and tensors[o.inputs[0]].batch_dim is None:
                for t in o.outputs:
                    sharded.add(t)
                    weight_of[t] = weight_of.get(o.inputs[0], o.inputs[0])
            continue
        if o.phase == "bwd":
            if not reads:
                continue
            inner.add(i)
            if base_name(o.target) in WEIGHT_PATH and all(t in weight_of for t in o.inputs[:1]):
                for t in o.outputs:
                    sharded.add(t)
                    weight_of[t] = weight_of[o.inputs[0]]
                continue
            if any(weight_of.get(t) in column_weights for t in reads) and \
                    any(tensors[t].batch_dim is not None for t in o.outputs):
                continue  # a column input gradient: all-reduced to the full value
        if i not in rows:
            sharded.update(o.outputs)
    return Interior(frozenset(inner), frozenset(sharded))


@dataclass(frozen=True)
class GroupSplit:
    """What tensor parallelism changes in one op-group (all blocks touching it split)."""

    blocks: tuple[int, ...]
    """Indices into :func:`megatron_blocks` of the blocks with an op in this group."""
    split_params: tuple[int, ...]
    """Parameters this group owns that are split."""
    split_bytes: int
    """Their bytes (= their gradients' bytes)."""
    split_state: int
    """Their parameter + gradient + optimizer-state bytes."""
    reduce_fwd: tuple[Affine, ...]
    """Bytes of each forward all-reduce in this group (blocks whose row matmul is here)."""
    reduce_bwd: tuple[Affine, ...]
    """Bytes of each backward all-reduce in this group (blocks whose first column matmul is here)."""


def group_split(graph: OpGraph, g: int) -> GroupSplit:
    """:class:`GroupSplit` of group ``g`` (all groups' computed at once, cached per graph: the
    simulator asks for every group of every tensor-parallel layout it costs)."""
    return _group_splits(graph)[g]


@per_graph
def _group_splits(graph: OpGraph) -> list[GroupSplit]:
    k = graph.num_groups
    mine: list[list[int]] = [[] for _ in range(k)]
    fwd: list[list] = [[] for _ in range(k)]
    bwd: list[list] = [[] for _ in range(k)]
    params: list[list[int]] = [[] for _ in range(k)]
    for i, b in enumerate(megatron_blocks(graph)):
        for g in sorted({graph.ops[c].group for c in b.columns} | {graph.ops[b.row].group}):
            mine[g].append(i)
            if graph.ops[b.row].group == g:
                fwd[g].append(b.reduce_fwd)
            if graph.ops[b.columns[0]].group == g:
                bwd[g].append(b.reduce_bwd)
            params[g] += [p for p in b.split_params if graph.params[p].group == g]
    out = []
    for g in range(k):
        ps = [graph.params[p] for p in params[g]]
        out.append(GroupSplit(tuple(mine[g]), tuple(params[g]), sum(p.nbytes for p in ps),
                              sum(2 * p.nbytes + p.opt_state_bytes for p in ps), tuple(fwd[g]), tuple(bwd[g])))
    return out



def block_groups(graph: OpGraph, block: MegatronBlock) -> tuple[int, ...]:
    """The op-groups holding a block's matmuls (sorted)."""
    return tuple(sorted({graph.ops[c].group for c in block.columns} | {graph.ops[block.row].group}))


def aligned_cuts(graph: OpGraph) -> set[int]:
    """Group indices ``g`` where a stage may start without cutting a Megatron block (``g = 0`` included)."""
    inside = set()
    for b in megatron_blocks(graph):
        gs = block_groups(graph, b)
        inside.update(range(gs[0] + 1, gs[-1] + 1))
    return set(range(graph.num_groups)) - inside


# ---- the strategy -----------------------------------------------------------------------

def tp_degree(gp: GroupPlan) -> int:
    """Devices per tensor-parallel group of ``gp`` (``GroupPlan.tp``, default all its devices)."""
    return gp.tp if gp.tp is not None else len(gp.devices)


def tp_groups(gp: GroupPlan) -> list[list[int]]:
    """The tensor-parallel groups of ``gp``: consecutive runs of :func:`tp_degree` devices."""
    t = tp_degree(gp)
    return [list(gp.devices[i:i + t]) for i in range(0, len(gp.devices), t)]


def _brief(value) -> str:
    """A plan field for a one-line message: a list above 8 items as its first 4 and its length."""
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"[{', '.join(f'{v:.4g}' if isinstance(v, float) else str(v) for v in value[:4])}, ... ({len(value)} items)]"
    return str(value)


class TensorParallel(Strategy):
    name = "tp"

    # ---- the search's actions (see Strategy.search_options), after TAG's
    search_pass = 1
    feature_sync = "tp"
    search_families = ("all", "machines", "machine", "gpu-type")
    """Subset families taking ``tp`` actions: whole machines (a tp group never spans machines),
    and of the families that grow with the machine count only one machine and one GPU kind."""

    def search_options(self, devices: tuple[int, ...], family: str, space) -> list:
        """Each degree of ``space.tp_degrees`` dividing the subset (consecutive devices form one
        tensor-parallel group)."""
        if family not in self.search_families:
            return []
        return [t for t in space.tp_degrees if len(devices) >= t and len(devices) % t == 0]

    def search_plan(self, space, g: int, devices: tuple[int, ...], option) -> GroupPlan:
        """Groups of ``option`` consecutive devices, each group's share proportional to its slowest
        device's speed for the group (executable: for the whole model, ``space.model_time``, so
        every group of the plan has the same shares), equal shares inside a group."""
        import numpy as np

        devs = list(devices)
        t = (space.model_time if space.executable else space.costs.group_time_full[g])[devs]
        t = t.reshape(-1, option).max(axis=1)
        rate = np.repeat(1.0 / np.maximum(t, 1e-15), option)
        shares = (rate / rate.sum()).tolist()
        return GroupPlan(devs, shares, self.name, tp=option)

    def search_key(self, space, g: int, devices: tuple[int, ...], option) -> tuple:
        return (devices, self.name, option)

    def search_estimate(self, space, g: int, devices: tuple[int, ...], option, plan: GroupPlan, bmin: float,
                        lmax: float) -> tuple[float, float, float]:
        """Blocks split ``option`` ways, replicas of ``option`` devices (compute at the summed
        speed times the degree): the gradient all-reduce of a 1/degree shard over the subset plus
        the group's tensor-parallel all-reduces (:func:`group_split`) inside one tp group; the
        state split by the degree, each device its share of the activations."""
        import numpy as np

        from ..cost.comm import ring_allreduce_time

        c, t, n, devs = space.costs, option, len(devices), list(devices)
        p = c.param_bytes[g]
        x = group_split(space.graph, g)  # (cached per graph)
        comp = t / float(np.sum(1.0 / np.maximum(c.group_time[g, devs, 0], 1e-15)))
        inner = space.comm.bandwidth[np.ix_(devs[:t], devs[:t])][~np.eye(t, dtype=bool)]  # one tp group's links
        per_replica = space.graph.batch_size * t / n
        sync = ring_allreduce_time(n, p / t, bmin, lmax) + sum(
            ring_allreduce_time(t, r.at(per_replica), float(inner.min()), lmax) for r in x.reduce_fwd + x.reduce_bwd)
        return comp, sync, (2 * p + c.opt_bytes[g]) / t + c.act_bytes[g] / n

    def search_table(self, space, devices: tuple[int, ...], option, bmin: float, lmax: float) -> SearchTable:
        """:meth:`search_plan` and :meth:`search_estimate` of every group at once (the same operations
        row by row; the tensor-parallel all-reduces' seconds summed left to right as there)."""
        if not self._search_inherited(TensorParallel, ("search_plan", "search_estimate")):
            return super().search_table(space, devices, option, bmin, lmax)
        import numpy as np

        from ..cost.comm import ring_allreduce_time

        c, t, n, devs, k = space.costs, option, len(devices), list(devices), space.num_groups
        if space.executable:  # the whole model's pace: one row of shares for every group
            tm = space.model_time[devs].reshape(-1, t).max(axis=1)
            rate = np.repeat(1.0 / np.maximum(tm, 1e-15), t)
            shares = np.broadcast_to(rate / rate.sum(), (k, n))
        else:
            tm = np.ascontiguousarray(c.group_time_full[:, devs]).reshape(k, -1, t).max(axis=2)
            rate = np.repeat(1.0 / np.maximum(tm, 1e-15), t, axis=1)  # [K, n]
            shares = rate / rate.sum(axis=1, keepdims=True)
        est = np.empty((k, 3))
        est[:, 0] = t / np.sum(1.0 / np.maximum(np.ascontiguousarray(c.group_time[:, devs, 0]), 1e-15), axis=1)
        inner = float(space.comm.bandwidth[np.ix_(devs[:t], devs[:t])][~np.eye(t, dtype=bool)].min())
        per_replica = space.graph.batch_size * t / n
        memo = space.memo.setdefault("tp-reduce", {})  # per_replica -> [K, R] bytes of each group's all-reduces
        red = memo.get(per_replica)
        if red is None:
            xs = [group_split(space.graph, g) for g in range(k)]
            red = np.full((k, max((len(x.reduce_fwd) + len(x.reduce_bwd) for x in xs), default=0)), np.nan)
            for g, x in enumerate(xs):
                for j, r in enumerate(x.reduce_fwd + x.reduce_bwd):
                    red[g, j] = r.at(per_replica)
            memo[per_replica] = red
        terms = np.where(np.isnan(red), 0.0, ring_allreduce_time(t, red, inner, lmax))
        inside = np.cumsum(terms, axis=1)[:, -1] if terms.shape[1] else 0.0  # (sum(): left to right)
        est[:, 1] = ring_allreduce_time(n, c.param_bytes / t, bmin, lmax) + inside
        est[:, 2] = (2 * c.param_bytes + c.opt_bytes) / t + c.act_bytes / n
        return SearchTable(np.broadcast_to(np.asarray(devs, dtype=np.int64), (k, n)), shares,
                           np.full(k, -1, dtype=np.int64), est)

    def validate(self, gp: GroupPlan, graph, g: int, num_devices: int, batch_size: int, where: str) -> None:
        no_field(gp, "mp_splits", where, "mp")
        no_field(gp, "server", where, "ps")
        if gp.sfb:
            raise PlanError(f"{where}.sfb: sync 'tp' has no Sufficient Factor Broadcasting; expected []")
        t = tp_degree(gp)
        if not 2 <= t <= MAX_DEGREE:
            raise PlanError(f"{where}.tp: expected a tensor-parallel degree of 2..{MAX_DEGREE}, got {t}")
        if len(gp.devices) % t:
            raise PlanError(f"{where}.tp: {len(gp.devices)} devices are not groups of {t}")
        check_shares(gp, batch_size, where, self.width(gp))
        for devs in tp_groups(gp):
            shares = [gp.shares[gp.devices.index(d)] for d in devs]
            if max(shares) - min(shares) > 1e-9:
                raise PlanError(f"{where}.shares: the {t} devices of tensor-parallel group {devs} hold equal "
                                f"token shards; expected equal shares, got {shares}")
        for i in group_split(graph, g).blocks:
            b = megatron_blocks(graph)[i]
            name = graph.ops[b.row].name
            if b.features % t:
                raise PlanError(f"{where}.tp: block ending at {name!r} has {b.features} split features, not "
                                f"divisible by {t}")
            if b.heads is not None and b.heads % t:
                raise PlanError(f"{where}.tp: block ending at {name!r} has {b.heads} attention heads, not "
                                f"divisible by {t}")

    def width(self, gp: GroupPlan) -> int:
        """A plain group's tensor-parallel degree (each run of ``GroupPlan.tp`` consecutive devices
        computes the same samples); 1 with sequence parallelism (a device holds its own token
        shard, modelled as its own sample range)."""
        return 1 if gp.sequence_parallel else tp_degree(gp)

    def unheld_state_bytes(self, gp: GroupPlan, graph, groups: list[int]) -> float:
        """A device holds ``1 / tp`` of the split parameters' state (:func:`group_split`)."""
        t = tp_degree(gp)
        return (1.0 - 1.0 / t) * sum(group_split(graph, g).split_state for g in groups)

    def units(self, g: int, gp: GroupPlan, graph, batch_size: int) -> list[Unit]:
        # One unit; the devices of a tensor-parallel group hold its one sample range.
        return [Unit((g, 0), gp.sync, sample_replicas(gp.devices, self.replica_shares(gp), batch_size, self.width(gp)))]

    def collective(self, gp: GroupPlan) -> Collective | None:
        """Replicated parameters' partial gradients (over token shards) summed over every device;
        split ones over the replicas holding the same shard (:mod:`tag.sim.tensor_parallel`)."""
        return Collective("tp", tuple(gp.devices))

    def check_plan(self, plan, graph, topology, source: str) -> None:
        """Each tensor-parallel group on one machine; a block split over op-groups needs all of them
        ``tp`` over the same devices and degree."""
        for g, gp in enumerate(plan.groups):
            if gp.sync != self.name:
                continue
            for devs in tp_groups(gp):
                if len({topology.machine_of(d) for d in devs}) > 1:
                    raise PlanError(f"{source}: groups[{g}].devices: tensor-parallel group {devs} spans machines; "
                                    f"expected the {len(devs)} devices of one group on one machine")
        for b in megatron_blocks(graph):
            gs = block_groups(graph, b)
            gps = [plan.groups[g] for g in gs]
            if len(gs) < 2 or not any(p.sync == self.name for p in gps):
                continue
            first = gps[0]
            for g, p in zip(gs, gps):
                if p.sync != self.name or p.devices != first.devices or tp_degree(p) != tp_degree(first) \
                        or p.sequence_parallel != first.sequence_parallel:
                    raise PlanError(
                        f"{source}: groups[{g}]: the Megatron block ending at {graph.ops[b.row].name!r} spans "
                        f"groups {list(gs)}; expected sync 'tp' over the same devices and degree, with or "
                        "without sequence parallelism alike, in all of them")

    def execution_refusal(self, plan) -> str | None:
        """None when the executor runs ``plan``'s tensor parallelism (or it has none), else one line
        naming the field it does not run: every group ``tp``, plain Megatron (no sequence
        parallelism); without a pipeline every group over the same devices with the same degree and
        shares; with one, the same within each stage (:func:`tag.parallel.pipeline.validate_pipeline`
        gives a stage's groups one device set and shares) and one degree for every stage
        (Megatron-LM's layout). :func:`tag.parallel.strategy.execution_refusal` asks it."""
        tp = [g for g, gp in enumerate(plan.groups) if gp.sync == "tp"]
        if not tp:
            return None
        for g, gp in enumerate(plan.groups):
            if gp.sync != "tp":
                return (f"groups[{g}].sync: the executor runs tensor parallelism only when every group is 'tp' "
                        f"(group {tp[0]} is); expected 'tp', got {gp.sync!r}")
        sp = next((g for g, gp in enumerate(plan.groups) if gp.sequence_parallel), None)
        if sp is not None:
            return (f"groups[{sp}].sequence_parallel: the executor runs plain Megatron (every device of a "
                    "tensor-parallel group on the group's whole batch outside the blocks), not sequence "
                    "parallelism; expected false")
        pp = plan.pipeline
        starts = list(pp.stages) if pp is not None else [0]  # (the whole plan is one stage without a pipeline)
        stage = stage_of_group(pp, len(plan.groups)) if pp is not None else [0] * len(plan.groups)
        whole = "whole plan" if pp is None else "whole pipeline stage"
        for g, gp in enumerate(plan.groups):
            first = plan.groups[starts[stage[g]]]
            if gp.devices != first.devices:
                return (f"groups[{g}].devices: the executor runs the same tensor-parallel groups for the {whole}; "
                        f"expected devices {device_ranges(first.devices)}, got {device_ranges(gp.devices)}")
            for field, want, got in (("tp", tp_degree(first), tp_degree(gp)), ("shares", first.shares, gp.shares)):
                if want != got:
                    return (f"groups[{g}].{field}: the executor runs the same tensor-parallel groups for the "
                            f"{whole}; expected {_brief(want)}, got {_brief(got)}")
            if tp_degree(gp) != tp_degree(plan.groups[0]):
                return (f"groups[{g}].tp: the executor runs one tensor-parallel degree in every pipeline stage "
                        f"(device i of a stage's group sends to device i of the next's); expected "
                        f"{tp_degree(plan.groups[0])}, got {tp_degree(gp)}")
        return None


# ---- what the executor runs ---------------------------------------------------------------

def executed_plan(plan):
    """The plan the devices of tensor-parallel groups execute (see the module doc): every group
    data parallel over the first device of each of its tensor-parallel groups, with that group's
    batch share (its recomputation and the plan's pipeline kept). Device ``i`` of a
    tensor-parallel group runs its first device's schedule on shard ``i`` of the split
    parameters (:mod:`tag.executor.tensor_parallel`): its gradients are summed with those of the
    devices ``i`` of the stage's other groups, a tensor its first device sends to another
    stage's first device goes from device ``i`` to device ``i``. None when ``plan`` has no
    ``tp`` group."""
    if not any(gp.sync == "tp" for gp in plan.groups):
        return None
    why = execution_refusal(plan)
    if why is not None:
        raise PlanError(f"plan: {why}")
    tp = TensorParallel()
    return dataclasses.replace(plan, groups=[GroupPlan([devs[0] for devs in tp_groups(gp)], list(tp.replica_shares(gp)),
                                                       recompute=gp.recompute) for gp in plan.groups])


__all__ = ["MAX_DEGREE", "GroupSplit", "MegatronBlock", "TensorParallel", "aligned_cuts", "block_groups",
           "Interior", "block_interior", "executed_plan", "group_split", "megatron_blocks",
           "tp_degree", "tp_groups", "weight_param"]
