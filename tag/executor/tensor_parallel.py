"""Tensor-parallel execution (Megatron-LM without sequence parallelism) of TAG's joint graphs.

A plan whose every group is ``tp`` with the same tensor-parallel groups (per pipeline stage on a
pipeline, one degree for all stages) runs as the data-parallel plan (the pipeline of
data-parallel stages) over the groups' first devices
(:func:`tag.parallel.tensor_parallel.executed_plan`), each group's devices at once: device
``D[i]`` of group ``D`` walks ``D[0]``'s schedule with shard ``i`` of the split parameters, its
joint graphs rewritten for that shard (:meth:`TpRank.joint`), and a blocking all-reduce over
``D`` after each row-parallel matmul (forward) and each column-parallel input gradient
(backward) inside its stages (:meth:`TpRank.stage`). The ops outside the Megatron blocks (norms,
embeddings, LM head, loss) run replicated on the group's batch, so their parameters and
gradients stay identical on the group's devices; the split parameters' gradients are per shard;
the gradient syncs sum over the replicas holding the same shard. What ``D[0]`` sends to another
stage's first device ``E[0]``, ``D[i]`` sends to ``E[i]`` (:attr:`tag.executor.comm.DistComm.peers`,
and per member index in :func:`tag.executor.run_virtual`): on one machine the full activation
(replicated outside the blocks, as Megatron-LM's pipeline sends each tensor-parallel rank's to
the same rank of the next stage); between machines Megatron-LM's scatter-gather
(``scatter_gather_tensors_in_pipeline``, :meth:`TpRank.scattered`): slice ``i`` of the flattened
tensor's bytes (:func:`~tag.executor.runtime.scatter_slice`, padded where ``T`` does not divide them), the
receiving group all-gathering the whole (:attr:`TpRank.gather`), so one copy crosses the network,
as the simulator prices it. Flattened, as Megatron-LM's ``split_tensor_into_1d_equal_chunks``:
any tensor (a tied weight, its partial-sum gradient, rows of a pipeline activation) splits the same
way, with no dim needing to divide by ``T``. Within a machine the whole tensor still goes ``D[i] ->
E[i]``: the ``T`` copies share no link but the machine's fabric, and the all-gather would move
the same bytes again after a latency.

**Why not DTensor's ``ColwiseParallel`` / ``RowwiseParallel``.** ``parallelize_module`` swaps the
parameters of eager ``nn.Linear`` / ``nn.Embedding`` modules for DTensors and relies on autograd
and DTensor's dispatch to insert the collectives. TAG runs no modules: its stages are cuts of the
captured joint forward + backward graph (ATen ops, explicit gradient ops, shapes baked into
``view`` / ``split`` arguments), fused per rank (:mod:`tag.executor.fuse`) and shared with the
simulator. Running DTensors through those graphs would need every ``view`` of a head count to
carry a sharding rule and gives up the schedule's explicit ops; the graph is rewritten instead.

**Which elements a shard keeps** is found by running the joint graph (:func:`_nan_pass`) with the
other shards' parameter elements set to NaN: an output element that depends on another shard is
NaN, one that does not is this shard's. GPT-2's fused ``c_attn`` (q, k and v side by side) thus
keeps each of q, k and v's heads of shard ``i`` without a model-specific rule. Three passes:
(A) the rows of each row-parallel weight outside shard ``i`` (contiguous input features) are NaN,
which reaches, through the backward, the gradients of the column-parallel weights and biases:
their NaN elements are the other shards'; (B) those column elements are NaN too, which gives the
row weights' own elements (their gradients); (C) every split parameter's other elements are NaN:
every tensor is then clean (replicated), partly NaN (sharded: the kept elements must form a
sub-grid, one index set per dim, and give its new shape), or NaN everywhere while an input is only
partly NaN: a sum over the split features (the row matmul's output, the column input's gradient),
taken as the all-reduced clean value and marked as a *boundary* where the rank all-reduces.
The rewritten graph is run once on the shard to check every shape (one line naming the op
otherwise).
"""

from __future__ import annotations

import itertools
import math
import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

from ..graph.stages import Stage
from ..parallel.tensor_parallel import TensorParallel, executed_plan, tp_groups
from .equality import ATOL, RTOL
from .runtime import ExecutionError, Joint
from .strategies import Execution, RankHook, register_execution

aten = torch.ops.aten

SHAPE_ARG_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
                 aten.slice_backward.default, aten.select_backward.default, aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}
"""Ops whose second argument is the output shape (rewritten for a sharded output)."""
CREATE_OPS = {aten.empty.memory_format, aten.empty_permuted.default, aten.full.default, aten.zeros.default,
              aten.ones.default}
"""Ops whose first argument is the output shape: a constant combined with a sharded tensor of its
shape (``silu``'s backward subtracts from ``full_like(empty_permuted(shape), 1)``) is sharded too."""
UNINITIALISED = {aten.empty.memory_format, aten.empty_permuted.default, aten.empty_like.default,
                 aten.new_empty.default, aten.empty_strided.default}
"""Ops returning uninitialised memory (zeroed in the analysis, where garbage could read as NaN)."""


def _query_heads(t: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Keys or values with fewer heads than ``query`` (grouped queries) repeated to its heads."""
    h = query.shape[-3]
    return t if t.shape[-3] == h else t.repeat_interleave(h // t.shape[-3], dim=-3)


def _attention_scores(query, key, is_causal, attn_mask, scale):
    """``[B, H, L, S]`` fp32 scores of fused attention (``key`` at the query's heads,
    :func:`_query_heads`) and the ``[L, S]`` (or mask-shaped) positions the kernel reads (None: all)."""
    s = (query.float() @ key.float().transpose(-2, -1)) * (scale or 1 / math.sqrt(query.shape[-1]))
    keep = None
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask if keep is None else keep & attn_mask
    elif attn_mask is not None:
        s = s + attn_mask
    return (s if keep is None else s.masked_fill(~keep, -math.inf)), keep


def _heads_back(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A gradient over the query's heads summed back to ``like``'s (grouped keys and values)."""
    if grad.shape[-3] != like.shape[-3]:
        grad = grad.unflatten(-3, (like.shape[-3], -1)).sum(-3)
    return grad.to(like.dtype)


def _nan_attention(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """``aten._scaled_dot_product_flash_attention_for_cpu`` in plain ops, for the NaN analysis only.

    The fused CPU kernel's AVX-512 build drops NaNs (its vectorised max skips them: a NaN head of
    q gives finite outputs and logsumexp with ATEN_CPU_CAPABILITY=avx512, NaN ones with avx2,
    torch 2.13.0, 2026-11-27), so which elements depend on another shard cannot be read from it.
    Here NaN spreads as through any matmul; within a head it may spread along the sequence where
    the kernel's mask would keep it out, which moves no kept set: the analysis puts whole heads'
    features NaN (parameters), never single positions."""
    s, _ = _attention_scores(query, _query_heads(key, query), is_causal, attn_mask, scale)
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]) @ _query_heads(value, query).float()).to(query.dtype), lse


def _nan_attention_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                            attn_mask=None, scale=None):
    """The backward of :func:`_nan_attention` (``aten._scaled_dot_product_flash_attention_for_cpu_backward``:
    ``(grad_query, grad_key, grad_value)``), in plain ops for the same reason."""
    k, v = _query_heads(key, query), _query_heads(value, query)
    s, keep = _attention_scores(query, k, is_causal, attn_mask, scale)
    p = torch.exp(s - logsumexp.float()[..., None])
    do = grad_out.float()
    ds = p * (do @ v.float().transpose(-2, -1) - (do * out.float()).sum(-1, keepdim=True))
    if keep is not None:  # positions the kernel never reads carry no gradient
        p, ds = p.masked_fill(~keep, 0), ds.masked_fill(~keep, 0)
    scale = scale or 1 / math.sqrt(query.shape[-1])
    return ((ds @ k.float() * scale).to(query.dtype), _heads_back(ds.transpose(-2, -1) @ query.float() * scale, key),
            _heads_back(p.transpose(-2, -1) @ do, value))


NAN_PASS_OPS = {aten._scaled_dot_product_flash_attention_for_cpu.default: _nan_attention,
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _nan_attention_backward}
"""Ops the NaN analysis runs in plain ops instead (kernels that do not propagate NaN)."""

_REDUCERS: dict[int, Callable[[torch.Tensor], None]] = {}
"""Key -> in-place sum over the tensor-parallel group (one per rank; several in one process)."""
_KEYS = itertools.count()


def tp_all_reduce(x: torch.Tensor, key: int) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group of the rank registered as ``key`` (blocking)."""
    _REDUCERS[key](x)
    return x


def tp_shard_random(op, shard: int, *args, **kwargs):
    """``op(*args, **kwargs)``, a random op inside a Megatron block (a dropout of sharded attention
    probabilities), on shard ``shard``'s own random stream, as Megatron-LM's model-parallel RNG
    tracker: each shard holds other heads or features, which single-process training masks
    independently. The stream is seeded by a number drawn from the rank's common stream (every
    member of the group draws the same, so the members' common streams stay in step for the
    replicated ops, and a replayed recomputation draws the same number) plus the shard index; the
    common stream is left as after that one draw."""
    base = int(torch.randint(0, 2**62, (1,)).item())  # the CPU generator: no device sync
    dev = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    cuda = dev.type == "cuda"
    with torch.random.fork_rng(devices=[dev.index if dev.index is not None else torch.cuda.current_device()]
                               if cuda else []):
        torch.random.default_generator.manual_seed(base + shard)
        if cuda:
            torch.cuda.manual_seed(base + shard)  # the rank's device (current)
        return op(*args, **kwargs)


tp_shard_random.draws_random = True  # (tag.graph.gradients.node_draws_random)


@dataclass
class TpSpec:
    """What the rewriting needs from the captured graph (the same on every rank)."""

    rows: tuple[str, ...]
    """Node names of the row-parallel matmuls."""
    split: frozenset[str]
    """State-dict names of the split parameters."""


def tp_spec(graph) -> TpSpec:
    """:class:`TpSpec` of a captured :class:`~tag.graph.ir.OpGraph` (all its Megatron blocks split)."""
    from ..parallel.tensor_parallel import megatron_blocks

    blocks = megatron_blocks(graph)
    return TpSpec(tuple(graph.ops[b.row].name for b in blocks),
                  frozenset(graph.params[p].name for b in blocks for p in b.split_params))


@dataclass
class TpRank(RankHook):
    """Shard ``index`` of ``degree``: rewrites this rank's joint graphs and stages (its
    :class:`~tag.executor.strategies.RankHook`)."""

    index: int
    degree: int
    spec: TpSpec
    reduce: Callable[[torch.Tensor], None] | None = None
    """In-place sum over the tensor-parallel group (blocking); may be set after construction
    (the process group exists once the rank joined it), before the first iteration."""
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    """All-gather over the tensor-parallel group (:attr:`RankHook.gather`); set like :attr:`reduce`."""
    machine_of: Callable[[int], int] | None = None
    """Topology device -> machine (set by the runner; None: one machine, nothing scattered)."""
    key: int = -1
    kept: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """State-dict name of each split parameter -> kept indices per dim (:meth:`shard`)."""
    boundaries: set[str] = field(default_factory=set)
    sharded: set[str] = field(default_factory=set)
    """Values of the joint graph that differ between the group's devices (each holds its shard:
    the split parameters, their gradients and what the blocks compute from them)."""

    def __post_init__(self) -> None:
        self.key = next(_KEYS)
        me = weakref.ref(self)  # the registry keeps no rank alive
        _REDUCERS[self.key] = lambda x: me().reduce(x)

    def scattered(self, src: int, dst: int, name: str | None = None) -> bool:
        """A piece between stages on two machines goes as Megatron-LM's scatter-gather: ``1 /
        degree`` of it from each device of the sending group to the same device of the
        receiving one, which all-gathers the rest on its machine (:func:`scatter_slice`). Not a
        sharded value (:attr:`sharded`): its devices hold different shards, so device ``i``
        sends its own whole to device ``i`` (a split parameter whose gradient is computed in an
        earlier stage than it is read: the SDPA GPT-2's ``c_attn`` weight at ``tp=2,pp=2`` over
        two machines trained wrong with its shards' slices mixed, 2026-11-28)."""
        mo = self.machine_of
        return mo is not None and mo(src) != mo(dst) and name not in self.sharded

    # ---- the joint graph of one local batch ---------------------------------------------------
    def joint(self, joint: Joint, inputs: tuple, param_grad: dict[str, str]) -> Joint:
        """``joint`` rewritten for this shard: split parameters sliced, shapes of sharded tensors
        divided, node metadata updated; the boundaries (all-reduce after) in :attr:`boundaries`.

        ``inputs``: the user inputs at the joint's batch; ``param_grad``: parameter placeholder ->
        its gradient node."""
        gm = joint.module
        nodes = {n.name: n for n in gm.graph.nodes}
        values = _joint_values(joint, inputs)
        clean, _ = _nan_pass(gm, values, {}, {})
        split_ph = {ph for ph, t in joint.state.items() if t in self.spec.split}
        if len(split_ph) != len(self.spec.split):
            raise ExecutionError(f"tensor parallel: split parameters {sorted(self.spec.split)} are not all "
                                 "placeholders of the joint graph")
        # (A) the row weights' other input features -> the column parameters' elements
        operand = {}
        for r in self.spec.rows:
            arg, dim = _row_operand(nodes[r])
            v = clean[arg.name]
            operand[arg.name] = _nan_outside(v, dim, self.index, self.degree, r)
        vals, _ = _nan_pass(gm, values, operand, clean)
        col_masks = {ph: _kept(vals[param_grad[ph]]) for ph in split_ph
                     if _kept(vals[param_grad[ph]]) is not None}
        # (B) the column elements too -> the row weights' elements
        inject = {ph: _with_nan(values[ph], m) for ph, m in col_masks.items()}
        vals, _ = _nan_pass(gm, {**values, **inject}, operand, clean)
        masks = {ph: _kept(vals[param_grad[ph]]) for ph in split_ph}
        missing = sorted(joint.state[ph] for ph, m in masks.items() if m is None)
        if missing:
            raise ExecutionError(f"tensor parallel: parameters {missing} are planned as split but no element of "
                                 "their gradients depends on one shard only")
        # (C) every split parameter's other elements -> every tensor's kind
        inject = {ph: _with_nan(values[ph], m) for ph, m in masks.items()}
        vals, boundaries = _nan_pass(gm, {**values, **inject}, {}, clean)
        for ph, g in param_grad.items():
            if ph not in split_ph and _has_nan(vals[g]):
                raise ExecutionError(f"tensor parallel: the gradient of {joint.state.get(ph, ph)!r}, which is not "
                                     "split, depends on one shard only")
        # (D) this shard's elements NaN instead: which elements depend on this shard (neither: a
        # constant, e.g. the zeros around a slice's gradient)
        inject = {ph: _with_nan(values[ph], ~m) for ph, m in masks.items()}
        mine, _ = _nan_pass(gm, {**values, **inject}, {}, clean)
        grids = {}
        for name, v in vals.items():
            ours = dict(_tensors(mine[name]))
            for k, t in _tensors(v):
                theirs = t.isnan()
                if bool(theirs.any()):
                    grid = _grid(theirs, ours[k].isnan())
                    if grid is None:
                        raise ExecutionError(f"tensor parallel: the elements of {name!r} shard {self.index} keeps "
                                             "are not one index set per dim")
                    grids[(name, k)] = grid
        _constants_follow(gm, grids)
        _integers_follow(gm, grids)
        self.boundaries |= boundaries  # (one joint per local batch size: a pipeline's micro-batches may differ)
        self.sharded |= {name for name, _ in grids}
        self.kept.update({joint.state[ph]: grids[(ph, None)] for ph in split_ph})
        out = _rewrite(gm, grids)
        state_values = dict(joint.state_values)
        for ph in split_ph:
            t = joint.state[ph]
            state_values[t] = select(state_values[t], self.kept[t])
        sharded = Joint(out, joint.user_inputs, joint.state, state_values)
        _check_shapes(sharded, inputs, grids)
        return sharded

    # ---- stages --------------------------------------------------------------------------
    def stage(self, stage: Stage) -> None:
        """All-reduce every boundary of ``stage`` right after it (``addmm``: its bias added after);
        run every random op on sharded values on this shard's own stream (:func:`tp_shard_random`)."""
        from ..graph.gradients import node_draws_random

        g = stage.module.graph
        for n in list(g.nodes):
            if n.op == "call_function" and n.name in self.sharded and node_draws_random(n):
                n.target, n.args = tp_shard_random, (n.target, self.index, *n.args)
                continue
            if n.op != "call_function" or n.name not in self.boundaries:
                continue
            if n.target is aten.addmm.default:
                if n.kwargs:
                    raise ExecutionError(f"tensor parallel: {n.name!r} is an addmm with {dict(n.kwargs)}; expected "
                                         "beta = alpha = 1")
                bias, x, w = n.args
                with g.inserting_before(n):
                    part = g.call_function(aten.mm.default, (x, w))
                    part.meta = dict(n.meta)
                    red = g.call_function(tp_all_reduce, (part, self.key))
                    red.meta = dict(n.meta)
                n.target, n.args = aten.add.Tensor, (red, bias)
            else:
                with g.inserting_after(n):
                    red = g.call_function(tp_all_reduce, (n, self.key))
                red.meta = dict(n.meta)
                n.replace_all_uses_with(red, delete_user_cb=lambda u, r=red: u is not r)
        stage.module.recompile()

    def param_state(self) -> dict[str, list[torch.Tensor]]:
        """:attr:`kept`: where this shard's elements sit in the full parameters."""
        return self.kept

    def full_params(self, gathered: list[tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]]
                    ) -> dict[str, torch.Tensor]:
        """Full parameters from every shard's ``(named_params, kept)`` (in shard order): those the
        rank holds (a pipeline stage's)."""
        full = dict(gathered[0][0])
        # replicated: the same on every member (within the executor's equality tolerance: GPU kernels
        # with atomics, an embedding's backward, need not agree to the bit), or the group diverged
        for name, value in full.items():
            if name in self.kept:
                continue
            for i, (params, _) in enumerate(gathered[1:], 1):
                other = params[name]
                if not torch.allclose(other, value, rtol=RTOL, atol=ATOL):
                    raise ExecutionError(
                        f"tensor parallel: replicated parameter {name!r} differs between members 0 and {i} of the "
                        f"group (max |diff| {float((other - value).abs().max()):.3g}); expected equal: its ops ran "
                        "on the same samples (a random op drawing differently on the members?)")
        for name in (n for n in self.kept if n in full):
            shape = [int(max(int(ix[-1]) for ix in (kept[name][d] for _, kept in gathered)) + 1)
                     for d in range(len(self.kept[name]))]
            value = torch.zeros(shape, dtype=gathered[0][0][name].dtype)
            for params, kept in gathered:
                value[torch.meshgrid(*kept[name], indexing="ij")] = params[name]
            full[name] = value
        return full


def select(t: torch.Tensor, kept: list[torch.Tensor]) -> torch.Tensor:
    """The sub-grid ``kept`` (indices per dim) of ``t``, contiguous."""
    for d, ix in enumerate(kept):
        if len(ix) != t.shape[d]:
            t = t.index_select(d, ix)
    return t.contiguous()


# ---- the analysis ----------------------------------------------------------------------------

def _row_operand(node: fx.Node) -> tuple[fx.Node, int]:
    """The weight operand of a row-parallel matmul and its contraction dim."""
    t = node.target
    if t is aten.addmm.default:
        return node.args[2], 0
    if t in (aten.mm.default, aten.bmm.default, aten.matmul.default):
        return node.args[1], -2
    if t is aten.linear.default:
        return node.args[1], 1
    raise ExecutionError(f"tensor parallel: row-parallel matmul {node.name!r} is {t}; expected addmm, mm, bmm, "
                         "matmul or linear")


def _nan_outside(v: torch.Tensor, dim: int, index: int, degree: int, name: str) -> torch.Tensor:
    """``v`` with NaN outside slice ``index`` of ``degree`` along ``dim``."""
    n = v.shape[dim]
    if n % degree:
        raise ExecutionError(f"tensor parallel: {name!r} contracts {n} features, not divisible by {degree}")
    out = torch.full_like(v, math.nan)
    w = n // degree
    out.narrow(dim, index * w, w).copy_(v.narrow(dim, index * w, w))
    return out


def _with_nan(v: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    return torch.where(kept, v, torch.full_like(v, math.nan))


def _tensors(v) -> list[tuple[int | None, torch.Tensor]]:
    """The float tensors of a node value: ``[(None, v)]``, or ``(i, v[i])`` of a list / tuple."""
    if isinstance(v, torch.Tensor):
        return [(None, v)] if v.is_floating_point() else []
    if isinstance(v, (list, tuple)):
        return [(i, t) for i, t in enumerate(v) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return []


def _has_nan(v) -> bool:
    return any(bool(t.isnan().any()) for _, t in _tensors(v))


def _kept(t: torch.Tensor) -> torch.Tensor | None:
    """Mask of the non-NaN elements of a partly-NaN tensor; None when it has no NaN."""
    if not t.is_floating_point():
        return None
    nan = t.isnan()
    return ~nan if bool(nan.any()) else None


def _grid(theirs: torch.Tensor, mine: torch.Tensor) -> list[torch.Tensor] | None:
    """Indices kept per dim: along each dim, those whose slice holds no element depending on
    another shard only (``theirs`` and not ``mine``); None unless the grid they span holds every
    element of ``mine`` and none of ``theirs``."""
    kept = []
    for d in range(theirs.dim()):
        other = [i for i in range(theirs.dim()) if i != d]
        t, m = (theirs.any(dim=other), mine.any(dim=other)) if other else (theirs, mine)
        kept.append((~(t & ~m)).nonzero().flatten())
    if any(len(ix) == 0 for ix in kept):
        return None
    if bool(select(theirs, kept).any()) or int(select(mine, kept).sum()) != int(mine.sum()):
        return None
    return kept


def _nan_pass(gm: fx.GraphModule, values: dict[str, object], operand: dict[str, torch.Tensor],
              clean: dict[str, object]) -> tuple[dict[str, object], set[str]]:
    """Run the joint graph node by node; ``operand``: values replacing those nodes' own. A float
    result NaN everywhere whose inputs are only partly NaN is a boundary: its ``clean`` value is
    used instead. Returns every node's value and the boundaries."""
    env: dict[str, object] = {}
    boundaries: set[str] = set()

    def load(a):
        return env[a.name] if isinstance(a, fx.Node) else a

    with torch.no_grad():
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                env[n.name] = values[n.name]
            elif n.op == "get_attr":
                env[n.name] = getattr(gm, n.target)
            elif n.op == "call_function":
                v = NAN_PASS_OPS.get(n.target, n.target)(*fx.node.map_arg(n.args, load),
                                                         **fx.node.map_arg(n.kwargs, load))
                if n.target in NAN_PASS_OPS:  # the captured kernel's strides (later views rely on them)
                    v = tuple(torch.empty_strided(t.shape, w.stride(), dtype=t.dtype, device=t.device).copy_(t)
                              for t, w in zip(v, n.meta["val"]))
                if n.target in UNINITIALISED:
                    v = torch.zeros_like(v)
                if clean and isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() \
                        and bool(v.isnan().all()):
                    if any(_kept(env[a.name]) is not None for a in n.all_input_nodes
                           if isinstance(env[a.name], torch.Tensor)):
                        boundaries.add(n.name)
                        v = clean[n.name]
                env[n.name] = operand.get(n.name, v)
            if n.op == "placeholder" and n.name in operand:
                env[n.name] = operand[n.name]
    return env, boundaries


def _constants_follow(gm: fx.GraphModule, grids: dict[tuple[str, int | None], list[torch.Tensor]]) -> None:
    """Give a constant tensor (computed from no placeholder) the grid of a sharded tensor of the same
    shape it is combined with, and the same to the constants it is made from (same shape)."""
    varying: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" or any(a.name in varying for a in n.all_input_nodes):
            varying.add(n.name)

    def shape(n: fx.Node):
        v = n.meta.get("val")
        return tuple(v.shape) if isinstance(v, torch.Tensor) else None

    for n in reversed(list(gm.graph.nodes)):  # consumers first: a chain of constants gets the grid in one walk
        grid = grids.get((n.name, None))
        if grid is None:
            continue
        for a in n.all_input_nodes:
            if a.name not in varying and (a.name, None) not in grids and shape(a) == shape(n):
                grids[(a.name, None)] = grid


def _integers_follow(gm: fx.GraphModule, grids: dict[tuple[str, int | None], list[torch.Tensor]]) -> None:
    """NaN cannot show in a bool or integer tensor (a dropout's mask, a comparison, max-pool
    indices): give such an output the grid of a sharded tensor of its shape among the op's inputs
    or its other outputs (``native_dropout``'s mask that of its output), and a ``getitem`` of a
    tuple element the element's grid. Without it, attention-probability dropout inside a block
    failed the shard's shape check (GPT-2 with dropout 0.1, 2026-11-28)."""
    def val_of(n: fx.Node):
        return n.meta.get("val")

    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        val = val_of(n)
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            grid = grids.get((n.args[0].name, n.args[1]))
            if grid is not None and (n.name, None) not in grids:
                grids[(n.name, None)] = grid
            continue
        outs = [(None, val)] if isinstance(val, torch.Tensor) else \
            list(enumerate(val)) if isinstance(val, (list, tuple)) else []
        by_shape = {}
        for a in n.all_input_nodes:
            if isinstance(val_of(a), torch.Tensor) and (a.name, None) in grids:
                by_shape.setdefault(tuple(val_of(a).shape), grids[(a.name, None)])
        for k, v in outs:
            if isinstance(v, torch.Tensor) and (n.name, k) in grids:
                by_shape.setdefault(tuple(v.shape), grids[(n.name, k)])
        for k, v in outs:
            if (isinstance(v, torch.Tensor) and not v.is_floating_point() and (n.name, k) not in grids
                    and tuple(v.shape) in by_shape):
                grids[(n.name, k)] = by_shape[tuple(v.shape)]


def _rewrite(gm: fx.GraphModule, grids: dict[tuple[str, int | None], list[torch.Tensor]]) -> fx.GraphModule:
    """A copy of ``gm`` whose sharded nodes have their new shapes (arguments and metadata)."""
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))

    def new_shape(name: str, k: int | None, old) -> list[int]:
        grid = grids.get((name, k))
        return list(old) if grid is None else [len(ix) for ix in grid]

    for n in g.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and (n.name, None) in grids:
            n.meta = {**n.meta, "val": torch.empty(new_shape(n.name, None, val.shape), dtype=val.dtype,
                                                   device="meta")}
            shape = new_shape(n.name, None, val.shape)
            if n.op == "call_function" and n.target in SHAPE_ARG_OPS:
                n.args = (n.args[0], [-1 if o == -1 else shape[i] for i, o in enumerate(n.args[1])], *n.args[2:])
            elif n.op == "call_function" and n.target in CREATE_OPS:
                n.args = (shape, *n.args[1:])
        elif isinstance(val, (list, tuple)) and any((n.name, i) in grids for i in range(len(val))):
            shapes = [new_shape(n.name, i, v.shape) for i, v in enumerate(val)]
            n.meta = {**n.meta, "val": [torch.empty(s, dtype=v.dtype, device="meta") for s, v in zip(shapes, val)]}
            if n.target is aten.split_with_sizes.default:
                dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
                n.args = (n.args[0], [s[dim] for s in shapes], *n.args[2:])
            elif n.target is aten.split.Tensor:
                dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
                n.args = (n.args[0], shapes[0][dim], *n.args[2:])
    return fx.GraphModule(gm, g)


def _joint_values(joint: Joint, inputs: tuple) -> dict[str, object]:
    """Placeholder name -> value: the joint graph's state and the user inputs."""
    values: dict[str, object] = {ph: joint.state_values[t] for ph, t in joint.state.items()}
    values.update(zip(joint.user_inputs, inputs))
    return values


def _check_shapes(joint: Joint, inputs: tuple, grids) -> None:
    """Run the rewritten joint graph on the shard (boundaries unreduced: shapes only) and refuse,
    naming the op, a result whose shape is not the one planned."""
    values = _joint_values(joint, inputs)
    env: dict[str, object] = {}

    def load(a):
        return env[a.name] if isinstance(a, fx.Node) else a

    with torch.no_grad():
        for n in joint.module.graph.nodes:
            if n.op == "placeholder":
                env[n.name] = values[n.name]
                continue
            if n.op != "call_function":
                continue
            try:
                v = n.target(*fx.node.map_arg(n.args, load), **fx.node.map_arg(n.kwargs, load))
            except RuntimeError as e:
                raise ExecutionError(f"tensor parallel: op {n.name!r} ({n.target}) fails on the shard: "
                                     f"{str(e).splitlines()[0]}") from None
            env[n.name] = v
            want = n.meta.get("val")
            if isinstance(v, torch.Tensor) and isinstance(want, torch.Tensor) and v.shape != want.shape:
                raise ExecutionError(f"tensor parallel: op {n.name!r} ({n.target}) gives shape {list(v.shape)} on the "
                                     f"shard; expected {list(want.shape)}")


class TpExecution(Execution):
    """How the executor runs a plan of tensor-parallel groups (its registered
    :class:`~tag.executor.strategies.Execution`): the data-parallel plan (or pipeline of
    data-parallel stages) over the groups' first devices
    (:func:`~tag.parallel.tensor_parallel.executed_plan`), every device of a group walking its
    first device's schedule as :class:`TpRank` of its index."""

    def __init__(self, plan, graph) -> None:
        # every stage's tensor-parallel groups (one set without a pipeline), in plan order
        groups = dict.fromkeys(tuple(devs) for gp in plan.groups for devs in tp_groups(gp))
        super().__init__(executed_plan(plan), [list(devs) for devs in groups])
        self.spec = tp_spec(graph)
        # its replicas are tensor-parallel groups: a copy (a tied weight) from the aligned group, as
        # the simulator's holder sets move it (each data-parallel pipeline from its own stage)
        self.aligned_copies = True

    def hook(self, rank: int) -> TpRank | None:
        devs = self.group_of(rank)
        return TpRank(devs.index(rank), len(devs), self.spec) if devs else None


register_execution(TensorParallel.name, TpExecution)

__all__ = ["TpExecution", "TpRank", "TpSpec", "select", "tp_all_reduce", "tp_spec"]
