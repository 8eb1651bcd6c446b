"""Plan-independent facts about a graph that the simulator needs, computed once per graph.

Placement rules follow the executor (:mod:`tag.parallel.schedule`): a ``getitem`` runs where the
op producing its tuple runs; a parameter is owned by the unit computing its gradient; tensors
cross units only from an op (or an owned parameter) to an op of another unit; user inputs,
buffers and constants are present everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..graph.gradients import (
    backward_homes,
    batch_independent_tensors,
    deferrable_sums,
    partial_sum_tensors,
    tied_weights,
)
from ..graph.ir import PHASE_INDEX, Affine, Phase
from ..graph.precision import param_cast_values, param_casts
from ..plan.format import group_positions

FWD, BWD, OPT = (PHASE_INDEX[p] for p in (Phase.FWD, Phase.BWD, Phase.OPT))  # plain ints (tag.graph.ir.Phase)
PARAM = -1
"""Source "phase" of a parameter tensor: available from the start of the iteration."""


@dataclass
class TensorEdge:
    """A tensor read by ops of group ``dst_group`` (other unit than its producer, possibly)."""

    tensor: int
    src_group: int
    src_pos: int
    """Forward position of the producer (its anchor; the owner's position for a parameter)."""
    src_phase: int
    """FWD, BWD or PARAM."""
    dst_group: int
    consumers: list[tuple[int, int]]
    """(forward position, phase) of every consuming op in ``dst_group``."""
    batch: bool
    """Re-partitioned by sample ranges (the tensor has a batch dimension)."""
    grad: bool
    """A non-batch gradient that is a partial sum over the replica's samples (e.g. a tied weight's
    gradient): kept in place when every producer replica's device holds a consumer replica, else
    summed over the producer replicas, delivered to the first consumer replica. Other
    non-batch backward tensors (the loss-gradient seed, ``1 / count`` of a mean loss, weight
    transposes) are copied like forward ones (:func:`tag.graph.gradients.partial_sum_tensors`,
    the executor's rule)."""
    fixed: float
    """Bytes: ``fixed + per_sample * b``."""
    per_sample: float
    once: bool = False
    """On a pipeline, moved once per iteration, not once per micro-batch (the executor's rule,
    :mod:`tag.parallel.schedule`): a batch-independent tensor (a tied weight) before its
    consumer's first micro-batch, a deferrable partial sum (its gradient) after the last
    (:func:`tag.graph.gradients.batch_independent_tensors`, :func:`~tag.graph.gradients.deferrable_sums`)."""
    tied: int = -1
    """The parameter tensor of a tied weight (:attr:`GraphStatic.tied`) this edge moves (the weight
    itself, or its partial-sum gradient), else -1: on a pipeline holding both copies, it does not move."""


@dataclass(frozen=True)
class TiedWeight:
    """A weight two pipeline stages may each hold (:func:`tag.graph.gradients.tied_weights`)."""

    tensor: int
    """The parameter tensor."""
    owner: int
    """The group finishing its gradient."""
    groups: frozenset[int]
    """The other groups reading it or making its partial-sum gradient (the holders)."""
    grad_group: int
    """The group making the partial sum."""
    nbytes: float
    """Bytes of the weight (= of its gradient)."""
    opt_state_bytes: float


@dataclass
class GraphStatic:
    """Per-graph tables; positions are forward positions (``Op.anchor``)."""

    num_groups: int
    batch_size: int
    lo: list[int]
    hi: list[int]
    """Forward position range ``[lo, hi)`` of every group."""
    edges: dict[tuple[int, int], list[TensorEdge]]
    """(src group, dst group) -> tensors crossing (src == dst: only between mp chunks)."""
    pairs: list[tuple[int, int]]
    """Keys of ``edges``, sorted."""
    grad_bytes: np.ndarray
    """[K] bytes of the parameters (= gradients) each group owns."""
    grad_bytes_l: list
    """``grad_bytes`` as a list."""
    static_pos: list[np.ndarray]
    """Per group, per position: param + grad + optimizer-state bytes owned there."""
    buffer_pos: list[np.ndarray]
    """Per group, per position: bytes of buffers/constants read there."""
    saved: list[list[tuple[float, float, list[int]]]]
    """Per group: (fixed, per-sample bytes, backward consumer positions) of every storage its
    backward reads that was produced in a forward pass or is a user input (kept from forward): a
    storage once, however many of its views are read (:func:`storages`, :func:`storage_bytes`)."""
    work_pos: list[np.ndarray]
    """Per group: [positions, 2] max (fixed, per-sample) bytes read+written by one op there."""
    mem_fixed: np.ndarray = None
    """[K] bytes a data-parallel replica of the group holds: ``mem_fixed + mem_per_sample * b``."""
    mem_per_sample: np.ndarray = None
    work_fixed: np.ndarray = None
    """[K] largest single-op working set of the group: ``work_fixed + work_per_sample * b`` (0 when
    the group has no op)."""
    work_per_sample: np.ndarray = None
    reads: list = None
    """Per group: ``(fixed, per_sample, producer position or None, forward positions, backward
    positions, tensor index)`` of every storage its ops read that a forward op produced or that is a
    user input (a storage once, :func:`storages`: the base tensor's index and position)
    (producer None: made outside the group, or a user input; positions: of the group's ops
    reading it in that phase). What activation recomputation keeps and re-makes
    (:meth:`recompute_bytes`)."""
    rc_fixed: np.ndarray = None
    """[K] bytes a data-parallel replica of a recomputed group holds: ``rc_fixed + rc_per_sample * b``
    (parameters, buffers and the group's inputs instead of its saved values)."""
    rc_per_sample: np.ndarray = None
    rc_work_fixed: np.ndarray = None
    """[K] the recomputed values live at the group's backward (added to its working set):
    ``rc_work_fixed + rc_work_per_sample * b``."""
    rc_work_per_sample: np.ndarray = None
    tied: tuple[TiedWeight, ...] = ()
    """The tied weights a pipeline may hold on two stages."""
    casts: frozenset[int] = frozenset()
    """Tensors that are parameter casts (:func:`tag.graph.precision.param_casts`): a recomputed
    group holds its forward's copies until its backward (:meth:`recompute_bytes`); without
    recomputation they are in :attr:`saved` (the backward of a matmul reads its cast weight)."""
    saved_casts: np.ndarray = None
    """[K] bytes of the values each group's forward makes from its parameter casts alone
    (:func:`tag.graph.precision.param_cast_values`: the copies, their transposes) among its
    :attr:`saved` values (in ``mem_fixed``): what a group whose casts are made per use (ZeRO-3,
    :mod:`tag.sim.sharded`) does not hold."""
    rc_casts: np.ndarray = None
    """[K] bytes of :attr:`casts` a recomputed group holds (in ``rc_fixed``), likewise: the copies
    its ops read, whose bytes a per-use group has in its working set instead."""
    saved_members: list = None
    """Per group, parallel to :attr:`saved`: the tensors each entry stands for (the saved views of
    one storage, :func:`storages`)."""
    _relayed: dict = None

    def relayed(self, stages: tuple[int, ...]) -> frozenset[tuple[int, int]]:
        """(tensor, consumer group) of the edges a pipeline cut at ``stages`` (first groups) does
        not move: a tensor crosses into a stage once, to the group of the stage needing it first
        (forward before backward, the forward in group order, the backward in reverse), and the
        stage's later groups take that copy over on their devices (the executor's
        :func:`tag.parallel.schedule._relays`); partial sums and tied weights aside. Cached per cut."""
        if self._relayed is None:
            self._relayed = {}
        out = self._relayed.get(stages)
        if out is not None:
            return out
        import bisect

        def stage(g: int) -> int:
            return bisect.bisect_right(stages, g) - 1

        lead: dict[tuple[int, int], tuple[tuple[int, int], int]] = {}  # (tensor, stage) -> (need, group)
        cands = []
        for es in self.edges.values():
            for e in es:
                if e.grad or e.tied >= 0 or stage(e.src_group) == stage(e.dst_group):
                    continue
                ph = min(p for _, p in e.consumers)
                need = (ph, e.dst_group if ph == FWD else -e.dst_group)
                key = (e.tensor, stage(e.dst_group))
                cands.append((key, e.dst_group))
                if key not in lead or need < lead[key][0]:
                    lead[key] = (need, e.dst_group)
        out = self._relayed[stages] = frozenset((key[0], g) for key, g in cands if lead[key][1] != g)
        return out

    def __post_init__(self):
        k = self.num_groups
        self.mem_fixed, self.mem_per_sample = np.zeros(k), np.zeros(k)
        self.work_fixed, self.work_per_sample = np.zeros(k), np.zeros(k)
        for g in range(k):
            sf = sum(f for f, _, _ in self.saved[g])
            self.mem_fixed[g] = self.static_pos[g].sum() + self.buffer_pos[g].sum() + sf
            self.mem_per_sample[g] = sum(p for _, p, _ in self.saved[g])
            w = self.work_pos[g]
            if len(w):
                self.work_fixed[g], self.work_per_sample[g] = w[:, 0].max(), w[:, 1].max()
        self.rc_fixed, self.rc_per_sample = np.zeros(k), np.zeros(k)
        self.rc_work_fixed, self.rc_work_per_sample = np.zeros(k), np.zeros(k)
        if self.reads is None:
            self.reads = [[] for _ in range(k)]
        for g in range(k):
            hf, hp, tf, tp = self.recompute_bytes(g, self.lo[g], self.hi[g])
            self.rc_fixed[g] = self.static_pos[g].sum() + self.buffer_pos[g].sum() + hf
            self.rc_per_sample[g] = hp
            self.rc_work_fixed[g], self.rc_work_per_sample[g] = tf, tp
        if self.saved_casts is None:
            self.saved_casts = np.zeros(k)
        self.rc_casts = np.array([self.recompute_bytes(g, self.lo[g], self.hi[g], only=self.casts)[0]
                                  if self.casts else 0.0 for g in range(k)])

    def recompute_bytes(self, g: int, lo: int, hi: int, only=None) -> tuple[float, float, float, float]:
        """Activation recomputation of the unit computing forward positions ``[lo, hi)`` of group
        ``g`` (the whole group or an ``mp`` chunk): ``(held fixed, held per sample, transient
        fixed, transient per sample)`` bytes. Held from its forward to its backward: every tensor
        made outside the unit (another group or chunk, a user input) that the unit's forward or
        backward reads (its inputs, and what its backward reads from elsewhere), and the
        parameter casts its forward makes (:attr:`casts`: made once, the recompute reads them).
        Transient, at its backward: the values the unit's own forward makes that its backward reads (made again by
        the recompute). Without recomputation the unit holds ``saved`` (what its backward reads).
        ``only``: count only these tensors (indices)."""
        hf = hp = tf = tp = 0.0
        for fixed, per_sample, src, fwd, bwd, t in self.reads[g]:
            if only is not None and t not in only:
                continue
            read_f = any(lo <= x < hi for x in fwd)
            read_b = any(lo <= x < hi for x in bwd)
            if src is not None and lo <= src < hi and t in self.casts:  # a parameter cast: held
                hf += fixed
            elif src is not None and lo <= src < hi:  # made by the unit: re-made before its backward
                if read_b:
                    tf += fixed
                    tp += per_sample
            elif read_f or read_b:
                hf += fixed
                hp += per_sample
        return hf, hp, tf, tp


SHARES_STORAGE = frozenset({"aten._unsafe_view.default"})
"""Ops the graph costs as copies whose output is nonetheless a view of their input's storage
(``_unsafe_view`` reshapes the fresh copy a ``clone`` made: ``aten.reshape`` of a non-contiguous
tensor)."""


def is_alias(op) -> bool:
    """Whether ``op``'s output shares its first input's storage: the capture costs a view (an ATen
    overload whose schema says it aliases: ``view``, ``reshape``, ``expand``, ``permute``,
    ``t``, ``transpose``, ``slice``, ``unsqueeze``, ``split_with_sizes``, ``alias``, ...) and a
    tuple projection ``getitem`` at 0 bytes read and written (:func:`tag.graph.capture._is_alias`);
    an op writing bytes is a copy, :data:`SHARES_STORAGE` aside."""
    if not op.inputs:
        return False
    if op.target in SHARES_STORAGE or op.target == "getitem":
        return True
    zero = (op.bytes_read.fixed, op.bytes_read.per_sample, op.bytes_written.fixed, op.bytes_written.per_sample)
    return not any(zero)


def storages(graph, eff: dict, kept, owner_group: dict) -> dict[tuple[int, int], list[int]]:
    """The tensors of ``kept`` ((tensor, group) pairs: what a group's backward reads from the
    forward, or what its ops read) per storage: ``(storage, group) -> its tensors in kept``.
    PyTorch keeps one storage however many views of it are kept (eager attention's probabilities,
    saved by the softmax's backward and, expanded and reshaped, by the product with V), alive while
    any view is: a view belongs to its base tensor's storage (a view of a received tensor to the
    received copy), up to a tuple projection (``getitem``) of an op that is not a view, unless the
    group keeps the tuple itself (the elements are separate storages: ``native_layer_norm``'s
    output, mean and rstd). A view of a parameter the group owns, or of a buffer or constant, is
    left out (their bytes are counted as such); of another group's parameter (a tied weight read
    by a later stage), it is a storage of its own. ``owner_group``: parameter tensor -> its group."""
    ops, tensors = graph.ops, graph.tensors

    def base(t: int, g: int) -> int | None:
        p = tensors[t].producer
        if p < 0 or eff[p][0] != g or not is_alias(ops[p]):
            return None
        src = ops[p].inputs[0]
        q = tensors[src].producer
        if ops[p].target == "getitem" and not (q >= 0 and is_alias(ops[q])) and (src, g) not in kept:
            return None
        return src

    out: dict[tuple[int, int], list[int]] = {}
    for t, g in kept:
        root = t
        while (b := base(root, g)) is not None:
            root = b
        rt = tensors[root]
        if rt.producer < 0 and rt.kind in ("buffer", "const"):
            continue
        if rt.producer < 0 and rt.kind == "param":
            if owner_group.get(root) == g:
                continue
            root = t
        out.setdefault((root, g), []).append(t)
    return out


def storage_bytes(graph, root: int, kept: list[int]) -> Affine:
    """Bytes of storage ``root`` holding the views ``kept`` (:func:`storages`), compared at the
    graph's batch (an Affine has no order): the largest of the base's and the views' where the base
    itself is kept; else the smaller of the base's and the sum of the views' (``q``, ``k``, ``v``
    of one projection read by a fused attention's backward: the whole projection). A captured
    graph's sizes are PyTorch's: the storage's bytes, a broadcast ``expand`` or a lone kept slice
    aside (counted at the view's bytes: a broadcast is no larger in memory, a slice keeps its whole
    base). A graph whose kept sizes were rewritten
    (:func:`tag.cost.fused_memory.fused_activation_graph`: a dropped intermediate at 0, a
    half-precision copy seen through views at 0) keeps those sizes: never more than the tensors
    counted one by one."""
    b, tensors = graph.batch_size, graph.tensors
    sizes = [tensors[t].nbytes for t in kept]
    if root in kept:
        return max(sizes, key=lambda x: x.at(b))
    views = Affine(sum(x.fixed for x in sizes), sum(x.per_sample for x in sizes))
    return min(tensors[root].nbytes, views, key=lambda x: x.at(b))


def build_static(graph) -> GraphStatic:
    ops, tensors = graph.ops, graph.tensors
    k = graph.num_groups
    eff: dict[int, tuple[int, int, int]] = {}  # op -> (group, pos, phase) where it runs
    homes = backward_homes(graph)
    opt = Phase.OPT  # (an enum member looked up once: ~0.4 us a lookup)
    for i, op in enumerate(ops):
        if op.phase == opt:
            continue
        loc = (*homes.get(i, (op.group, op.anchor)), PHASE_INDEX[op.phase])
        if op.target == "getitem" and op.inputs:
            p = tensors[op.inputs[0]].producer
            if p in eff:
                loc = eff[p]
        eff[i] = loc
    pos = [group_positions(graph, g) for g in range(k)]
    lo, hi = [a for a, _ in pos], [b for _, b in pos]

    def slot(g: int, p: int) -> int:
        return min(max(p - lo[g], 0), hi[g] - lo[g] - 1)

    owner: dict[int, tuple[int, int]] = {}  # param tensor -> (group, pos)
    grad_bytes = np.zeros(k)
    static_pos = [np.zeros(h - lo_) for lo_, h in pos]
    for p in graph.params:
        prod = tensors[p.grad].producer
        g, ps, _ = eff.get(prod, (p.group, lo[p.group], BWD))
        owner[p.tensor] = (g, ps)
        grad_bytes[g] += p.nbytes
        static_pos[g][slot(g, ps)] += 2 * p.nbytes + p.opt_state_bytes
    partial_sums = partial_sum_tensors(graph)
    once = batch_independent_tensors(graph) | deferrable_sums(graph)
    by_tensor = {p.tensor: p for p in graph.params}
    ties = tied_weights(graph)
    tied = tuple(TiedWeight(w, owner[w][0], groups, eff[tensors[x].producer][0], float(by_tensor[w].nbytes),
                            float(by_tensor[w].opt_state_bytes)) for w, (x, groups) in ties.items())
    tied_of = {t: w for w, (x, _) in ties.items() for t in (w, x)}  # weight or partial sum -> the weight

    cons: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (tensor, dst group) -> consumers
    buffer_pos = [np.zeros(h - lo_) for lo_, h in pos]
    work_pos = [np.zeros((h - lo_, 2)) for lo_, h in pos]
    saved_map: dict[tuple[int, int], list[int]] = {}  # (tensor, group) -> bwd consumer positions
    read_map: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # (tensor, group) -> (fwd, bwd) positions
    seen_buf: set[tuple[int, int, int]] = set()
    for i, op in enumerate(ops):
        if op.phase == opt:
            continue
        g, ps, ph = eff[i]
        w = work_pos[g][slot(g, ps)]
        w[0] = max(w[0], op.bytes_read.fixed + op.bytes_written.fixed)
        w[1] = max(w[1], op.bytes_read.per_sample + op.bytes_written.per_sample)
        for t in op.inputs:
            tt = tensors[t]
            if tt.producer < 0 and tt.kind in ("buffer", "const") and (t, g, slot(g, ps)) not in seen_buf:
                seen_buf.add((t, g, slot(g, ps)))
                buffer_pos[g][slot(g, ps)] += tt.nbytes.fixed
            if tt.kind == "input" or (tt.producer >= 0 and eff[tt.producer][2] == FWD):
                read_map.setdefault((t, g), ([], []))[ph == BWD].append(ps)
                if ph == BWD:
                    saved_map.setdefault((t, g), []).append(ps)
            if tt.producer >= 0 or t in owner:
                cons.setdefault((t, g), []).append((ps, ph))

    edges: dict[tuple[int, int], list[TensorEdge]] = {}
    for (t, g_dst), cs in cons.items():
        tt = tensors[t]
        if tt.producer >= 0:
            g_src, p_src, ph_src = eff[tt.producer]
        else:
            (g_src, p_src), ph_src = owner[t], PARAM
        if g_src == g_dst and len({slot(g_dst, p) for p, _ in cs} | {slot(g_src, p_src)}) == 1:
            continue  # never crosses a unit, whatever the plan
        e = TensorEdge(t, g_src, p_src, ph_src, g_dst, cs, tt.batch_dim is not None,
                       tt.batch_dim is None and t in partial_sums, tt.nbytes.fixed, tt.nbytes.per_sample, t in once,
                       tied_of.get(t, -1))
        edges.setdefault((g_src, g_dst), []).append(e)
    saved: list[list[tuple[float, float, list[int]]]] = [[] for _ in range(k)]
    casts = frozenset(ops[i].outputs[0] for i in param_casts(graph))
    of_casts = {t for i in param_cast_values(graph) for t in ops[i].outputs}  # the copies and their views
    saved_casts = np.zeros(k)
    members: list[list[tuple[int, ...]]] = [[] for _ in range(k)]
    owner_group = {w: o[0] for w, o in owner.items()}
    for (t, g), ts in storages(graph, eff, saved_map, owner_group).items():  # a storage once
        nb = storage_bytes(graph, t, ts)
        saved[g].append((nb.fixed, nb.per_sample, sorted({p for x in ts for p in saved_map[(x, g)]})))
        members[g].append(tuple(ts))
        if t in of_casts and tensors[t].producer >= 0 and eff[tensors[t].producer][0] == g:
            saved_casts[g] += nb.fixed
    reads: list[list[tuple]] = [[] for _ in range(k)]
    for (t, g), ts in storages(graph, eff, read_map, owner_group).items():  # a storage once
        tt, nb = tensors[t], storage_bytes(graph, t, ts)
        src = eff[tt.producer] if tt.producer >= 0 else None
        fwd, bwd = ({p for x in ts for p in read_map[(x, g)][j]} for j in (0, 1))
        reads[g].append((nb.fixed, nb.per_sample, src[1] if src is not None and src[0] == g else None,
                         sorted(fwd), sorted(bwd), t))
    return GraphStatic(k, graph.batch_size, lo, hi, edges, sorted(edges), grad_bytes, grad_bytes.tolist(), static_pos,
                       buffer_pos, saved, work_pos, reads=reads, tied=tied, casts=casts, saved_casts=saved_casts,
                       saved_members=members)
