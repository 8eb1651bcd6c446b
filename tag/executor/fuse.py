"""Fuse a rank's consecutive stages into one generated fx module per segment, freeing every value
at its last use.

A rank's part of the global schedule (:meth:`tag.parallel.schedule.Schedule.steps_of`) is a list
of compute steps (one stage each), transfers, SFB steps and gradient syncs. A **segment** is a
maximal run of the rank's steps that need no other rank: compute steps and transfer steps whose
moves into / out of this rank are all local hand-overs (``src == dst``). It is cut where a remote
transfer, an SFB all-gather or (when syncs are issued as they come, GPU ranks) the launch of a
gradient bucket must happen. The segment's stages are inlined into one ``fx.Graph``; local
hand-overs become graph ops (a row range is a ``narrow``, several pieces a ``cat``, partial sums
an ``add``, a single whole piece is the producer's tensor itself: no copy). fx's code generation frees every intermediate at
its last use, and the module is called with the boxed convention (the argument list is cleared
once unpacked), so an input value whose last use is in the segment dies there too, not when the
iteration ends.

Values cross segments in the runtime's ``env`` by ``(unit, node name)``; :func:`plan_program`
computes, for every action of the rank (a segment or another step, in execution order), which
``env`` keys it reads and which die after it, so ``env`` holds only what is still needed.

Before (issue 26): one generated module per (unit, phase) stage made a gpt2 iteration (48 groups)
94-96 module calls and 73+ local transfer steps, and kept every activation alive until the next
iteration. Now a single-device plan, and a data-parallel CPU rank, is one module; the
iterations need 0.70-0.72x the memory of eager PyTorch above parameters and optimizer state
(``evaluation/results/executor-overhead``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..graph.stages import Stage
from ..parallel.schedule import Move, Schedule, Step, UnitKey

Key = tuple[UnitKey, str]


@dataclass
class Segment:
    """Consecutive local steps of one rank run as one generated module."""

    start: int
    """Schedule index of its first step (where it runs)."""
    steps: list[int]
    """Schedule indices of the steps it covers (compute and local transfers)."""
    stages: list[tuple[UnitKey, str]]
    """(unit, phase) of the stages inlined, in order."""
    module: fx.GraphModule | None = None
    static: list[torch.Tensor] = field(default_factory=list)
    """Values of the first placeholders (parameters, buffers, constants, user-input slices)."""
    inputs: list[Key] = field(default_factory=list)
    """``env`` keys of the remaining placeholders, in order."""
    outputs: list[Key] = field(default_factory=list)
    """``env`` keys the module returns (values later actions read)."""
    drop: list[Key] = field(default_factory=list)
    """Of :attr:`inputs`, those whose last use is this segment (popped from ``env`` before the call)."""
    boxed: bool = True

    @property
    def name(self) -> str:
        """E.g. ``fwd g0-g3 + bwd g3-g0`` (timelines)."""
        parts: list[tuple[str, list[str]]] = []
        for (g, j), ph in self.stages:
            label = f"g{g}" + (f".{j}" if j else "")
            if parts and parts[-1][0] == ph:
                parts[-1][1].append(label)
            else:
                parts.append((ph, [label]))
        return " + ".join(f"{ph} {ls[0]}" + (f"-{ls[-1]}" if len(ls) > 1 else "") for ph, ls in parts)

    def __call__(self, env: dict[Key, torch.Tensor]) -> None:
        args = list(self.static)
        args += [env[k] for k in self.inputs]
        for k in self.drop:
            del env[k]
        # boxed: the module clears ``args``, so inputs die at their last use inside
        outs = self.module(args) if self.boxed else self.module(*args)
        env.update(zip(self.outputs, outs))


def takes_part(schedule: Schedule, rank: int, st: Step, stages) -> bool:
    """Whether ``rank`` has something to do in step ``st`` (``stages``: its (unit, phase) stages)."""
    if st.kind == "compute":
        return (st.unit, st.phase) in stages
    if st.kind == "transfer":
        return any(rank in (m.src, m.dst) for m in st.moves)
    if st.kind == "sfb":
        return rank in schedule.sfb[st.group].devices
    return rank in st.collective.members


def is_local(rank: int, st: Step) -> bool:
    """A transfer step whose moves touching ``rank`` are all hand-overs inside it."""
    return all(m.src == m.dst for m in st.moves if rank in (m.src, m.dst))


def step_reads_writes(schedule: Schedule, rank: int, st: Step, stages, synced: Callable[[int], list[Key]],
                      sfb_writes: Callable[[int], list[Key]]) -> tuple[list[Key], list[Key]]:
    """``env`` keys step ``st`` reads and writes on ``rank``."""
    if st.kind == "compute":
        stage = stages[(st.unit, st.phase)]
        return [(st.unit, n) for n in stage.inputs], [(st.unit, n) for n in stage.outputs]
    if st.kind == "transfer":
        reads = [(m.src_unit, m.name) for m in st.moves if m.src == rank and m.mode != "zeros"]
        writes = list(dict.fromkeys((m.dst_unit, m.name) for m in st.moves if m.dst == rank))
        return reads, writes
    if st.kind == "sfb":
        sg = schedule.sfb[st.group]
        return [(sg.unit, f.name) for f in sg.factors], sfb_writes(st.group)
    return synced(st.group), []


@dataclass
class Program:
    """What a rank runs per iteration, in order (see the module docstring)."""

    segments: dict[int, Segment]
    """Schedule index of a segment's first step -> the segment."""
    covered: frozenset[int]
    """Schedule indices run inside a segment (not by the transport)."""
    free_after: dict[int, list[Key]]
    """Schedule index of a step run outside segments -> ``env`` keys that die after it."""


def plan_program(schedule: Schedule, rank: int, stages: dict, static: Callable[[Key], bool],
                 synced: Callable[[int], list[Key]], sfb_writes: Callable[[int], list[Key]],
                 final_reads: list[Key], cut_at_sync: bool) -> Program:
    """Segments of ``rank`` and the liveness of its ``env`` values.

    ``static(key)``: the value is not in ``env`` (a parameter, buffer, constant or user-input slice
    the runtime holds anyway). ``final_reads``: keys read after the last step (gradients by the
    update, the loss). ``cut_at_sync``: the sync that launches a gradient bucket ends a segment (the
    bucket's collective is issued as soon as its gradients exist); otherwise syncs are only queued
    and a segment runs on across them. A sync that launches nothing never cuts.
    """
    mine = [(i, st) for i, st in enumerate(schedule.steps) if takes_part(schedule, rank, st, stages)]
    # Actions in execution order: ("seg", Segment) or ("step", index); a segment runs at its first step.
    actions: list[tuple[str, object]] = []
    current: Segment | None = None
    for i, st in mine:
        fusable = st.kind == "compute" or (st.kind == "transfer" and is_local(rank, st))
        if fusable:
            if current is None:
                current = Segment(i, [], [])
                actions.append(("seg", current))
            current.steps.append(i)
            if st.kind == "compute":
                current.stages.append((st.unit, st.phase))
            continue
        if st.kind in ("transfer", "sfb") or (cut_at_sync and schedule.launched_at(st) is not None):
            current = None
        actions.append(("step", i))
    rw = {i: step_reads_writes(schedule, rank, st, stages, synced, sfb_writes) for i, st in mine}
    reads_of: list[list[Key]] = []
    for kind, a in actions:
        if kind == "seg":
            produced: set[Key] = set()
            reads: list[Key] = []
            for i in a.steps:
                r, w = rw[i]
                reads += [k for k in r if k not in produced]
                produced.update(w)
            reads_of.append(reads)
        else:
            reads_of.append(rw[a][0])
    last: dict[Key, int] = {}
    for pos, reads in enumerate(reads_of):
        for k in reads:
            last[k] = pos
    for k in final_reads:
        last[k] = len(actions)
    segments, covered, free_after = {}, set(), {}
    for pos, (kind, a) in enumerate(actions):
        if kind == "seg":
            later = {k for k, p in last.items() if p > pos}
            a.inputs = [k for k in dict.fromkeys(reads_of[pos]) if not static(k)]
            a.drop = [k for k in a.inputs if last[k] == pos]
            produced_keys = [k for i in a.steps for k in rw[i][1]]
            a.outputs = [k for k in dict.fromkeys(produced_keys) if k in later]
            segments[a.start] = a
            covered.update(a.steps)
        else:
            written = rw[a][1]
            free_after[a] = sorted({k for k in reads_of[pos] if last.get(k) == pos and not static(k)}
                                   | {k for k in written if k not in last or last[k] < pos}, key=str)
    return Program(segments, frozenset(covered), free_after)


def build_module(seg: Segment, schedule: Schedule, rank: int, stages: dict, static_value: Callable[[Key], object],
                 meta: Callable[[Key], object], local_rows: Callable[[Move], tuple[int, int] | None],
                 device: torch.device) -> None:
    """Generate ``seg.module`` (boxed calling convention) and ``seg.static``.

    ``static_value(key)``: the held tensor of a static key, else None. ``meta(key)``: the fake
    tensor (``node.meta["val"]``) of a value. ``local_rows(m)``: for a local ``rows`` move,
    ``(start, length)`` along its batch dim in the producer's tensor, or None for all of it.
    """
    g = fx.Graph()
    node_of: dict[Key, fx.Node] = {}
    static_keys: list[Key] = []
    reads: list[Key] = []
    produced: set[Key] = set()
    for i in seg.steps:  # which keys come from outside, in first-use order
        st = schedule.steps[i]
        r, w = step_reads_writes(schedule, rank, st, stages, lambda g_: [], lambda g_: [])
        reads += [k for k in r if k not in produced]
        produced.update(w)
    for k in dict.fromkeys(reads):
        if static_value(k) is not None:
            static_keys.append(k)
    for k in static_keys + seg.inputs:
        ph = g.placeholder(_ident(k[1]))
        val = meta(k)
        if val is not None:
            ph.meta["val"] = val
        node_of[k] = ph
    seg.static = [static_value(k) for k in static_keys]
    attrs: dict[str, object] = {}
    for i in seg.steps:
        st = schedule.steps[i]
        if st.kind == "compute":
            stage: Stage = stages[(st.unit, st.phase)]
            local: dict[fx.Node, fx.Node] = {}
            phs = [n for n in stage.module.graph.nodes if n.op == "placeholder"]
            for n, name in zip(phs, stage.inputs):
                local[n] = node_of[(st.unit, name)]
            for n in stage.module.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    for name, v in zip(stage.outputs, n.args[0]):
                        node_of[(st.unit, name)] = local[v]
                    continue
                if n.op == "get_attr":
                    attrs[n.target] = getattr(stage.module, n.target)
                local[n] = g.node_copy(n, lambda a, local=local: local[a])
        else:
            _local_transfer(g, st, rank, node_of, local_rows, meta, device)
    g.output(tuple(node_of[k] for k in seg.outputs))
    root = torch.nn.Module()
    for name, v in attrs.items():
        setattr(root, name, v)
    codegen = _boxed_codegen()
    seg.boxed = codegen is not None
    if seg.boxed:
        g.set_codegen(codegen)
    seg.module = fx.GraphModule(root, g, class_name="Segment")


def _local_transfer(g: fx.Graph, st: Step, rank: int, node_of: dict, local_rows, meta, device) -> None:
    """Local hand-overs of step ``st`` as graph ops (no copies where a view or the tensor does)."""
    pieces: dict[Key, list[Move]] = {}
    for m in st.moves:
        if m.dst == rank:
            pieces.setdefault((m.dst_unit, m.name), []).append(m)
    for key, ms in pieces.items():
        m0 = ms[0]
        if m0.mode == "zeros":
            val = meta(key)
            node_of[key] = g.call_function(torch.zeros, (list(val.shape),), {"dtype": val.dtype, "device": device})
        elif m0.mode == "rows":
            parts = []
            for m in sorted(ms, key=lambda m: m.start):
                v = node_of[(m.src_unit, m.name)]
                rng = local_rows(m)
                if rng is not None:
                    v = g.call_function(torch.narrow, (v, m.batch_dim, *rng))
                    if m.batch_dim != 0:  # a row range along an inner dim is strided; stages may view it
                        v = g.call_method("contiguous", (v,))
                parts.append(v)
            node_of[key] = parts[0] if len(parts) == 1 else g.call_function(torch.cat, (parts, m0.batch_dim))
        elif m0.mode == "sum":
            total = node_of[(m0.src_unit, m0.name)]
            for m in ms[1:]:
                total = g.call_function(torch.add, (total, node_of[(m.src_unit, m.name)]))
            node_of[key] = total
        else:  # copy: the producer's tensor itself
            node_of[key] = node_of[(m0.src_unit, m0.name)]


def _ident(name: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return out if out and not out[0].isdigit() else f"v_{out}"


def _boxed_codegen():
    """fx's boxed calling convention (``forward(self, args)``, the list cleared once unpacked), so
    that the caller holds no reference to the inputs while the module runs; None where this torch
    lacks it (private: ``torch.fx.graph._BoxedCodeGen``, used by AOTAutograd), and the module is
    called with positional arguments instead (inputs then live until the call returns)."""
    try:
        from torch.fx.graph import _BoxedCodeGen
    except ImportError:  # pragma: no cover - depends on the torch version
        return None
    return _BoxedCodeGen()
