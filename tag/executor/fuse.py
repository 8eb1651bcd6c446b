"""Fuse a rank's consecutive stages into one generated fx module per segment, freeing every value
at its last use.

A rank's part of the global schedule (:meth:`tag.parallel.schedule.Schedule.steps_of`) is a list
of compute steps (one stage each), transfers, SFB steps and gradient syncs. A **segment** is a
maximal run of the rank's steps that need no other rank: compute steps and transfer steps whose
moves into / out of this rank are all local hand-overs (``src == dst``). It is cut where a remote
transfer, an SFB all-gather or (when syncs are issued as they come, GPU ranks) the launch of a
gradient bucket must happen, and before the backward of a unit that recomputes its activations
(``Schedule.recompute``). The segment's stages are inlined into one ``fx.Graph``; local
hand-overs become graph ops (a row range is a ``narrow``, several pieces a ``cat``, partial sums
an ``add``, a single whole piece is the producer's tensor itself: no copy). fx's code generation frees every intermediate at
its last use, and the module is called with the boxed convention (the argument list is cleared
once unpacked), so an input value whose last use is in the segment dies there too, not when the
iteration ends. Its ops are called through torch's Python bindings where these dispatch the same
overload (:func:`bind_fast`), not through ``torch.ops``, whose argument conversion cost a CPU rank
more per op than the op itself for small tensors.

Values cross segments in the runtime's ``env`` by ``(unit, node name)`` (on a pipeline by
``((group, chunk, micro-batch), node name)``, :func:`env_unit`, except the accumulated parameter
gradients and partial sums, :func:`accumulation`, and the batch-independent tensors a unit
receives once per iteration, :func:`value_key`); :func:`plan_program`
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
from torch.utils._python_dispatch import TorchDispatchMode

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
        """E.g. ``fwd g0-g3 + bwd g3-g0`` (timelines; on a pipeline ``fwd g0-g1 m2 + ...``)."""
        parts: list[tuple[tuple, list[str]]] = []
        for (g, j), ph, *micro in self.stages:
            label = f"g{g}" + (f".{j}" if j else "")
            if parts and parts[-1][0] == (ph, micro):
                parts[-1][1].append(label)
            else:
                parts.append(((ph, micro), [label]))
        return " + ".join(f"{ph} {ls[0]}" + (f"-{ls[-1]}" if len(ls) > 1 else "") + "".join(f" m{m}" for m in micro)
                          for (ph, micro), ls in parts)

    def __call__(self, env: dict[Key, torch.Tensor]) -> None:
        args = list(self.static)
        args += [env[k] for k in self.inputs]
        for k in self.drop:
            del env[k]
        # boxed: the module clears ``args``, so inputs die at their last use inside
        outs = self.module(args) if self.boxed else self.module(*args)
        env.update(zip(self.outputs, outs))


def env_unit(schedule: Schedule, unit: UnitKey, micro: int) -> tuple:
    """The unit part of the ``env`` key of a value ``unit`` computes or receives on micro-batch
    ``micro``: ``unit`` itself, or on a pipeline ``(group, chunk, micro)``, so that the values of
    micro-batches in flight at once do not overwrite one another."""
    return (*unit, micro) if schedule.micro_units else unit


def value_key(schedule: Schedule, unit: UnitKey, name: str, micro: int) -> Key:
    """The ``env`` key of value ``name`` that ``unit`` computes or receives on micro-batch ``micro``:
    ``(env_unit, name)``, except, on a pipeline, a value the unit holds once per iteration for all
    its micro-batches, keyed ``(unit, name)``: a batch-independent tensor it receives
    (:attr:`Schedule.shared`), a partial sum it sums over the micro-batches before sending it
    (:attr:`Schedule.summed`), or a parameter cast its first forward makes (:attr:`Schedule.casts`)."""
    if schedule.micro_units and (name in schedule.shared.get(unit, ()) or name in schedule.summed.get(unit, ())
                                 or name in schedule.casts.get(unit, ())):
        return unit, name
    return env_unit(schedule, unit, micro), name


def stage_key(schedule: Schedule, st: Step) -> tuple:
    """The key of the stage compute step ``st`` runs in a rank's ``stages``: ``(unit, phase)``, or
    on a pipeline ``(unit, phase, micro)`` (a micro-batch's stage is cut from the joint graph at
    that micro-batch's local batch)."""
    return (st.unit, st.phase, st.micro) if schedule.micro_units else (st.unit, st.phase)


def accumulation(schedule: Schedule) -> dict[UnitKey, tuple[int, frozenset[str]]]:
    """Pipeline plans: unit -> (the micro-batch of its first backward in the schedule, the
    parameter-gradient node names its backward computes and the partial sums it sends once per
    iteration, :attr:`Schedule.summed`); empty without a pipeline.

    A unit's backward of micro-batch ``m`` computes its parameters' gradients over ``m``'s samples;
    they are summed over the micro-batches into ``env[(unit, gradient name)]`` (no micro-batch in
    the key: the key the gradient sync and the optimizer read without a pipeline). The first
    backward writes it, every later one adds to it (:func:`step_reads_writes`,
    :func:`build_module`)."""
    if not schedule.micro_units:
        return {}
    grads: dict[UnitKey, set[str]] = {u: set(names) for u, names in schedule.summed.items()}
    for ph, owner in schedule.param_owner.items():
        grads.setdefault(owner, set()).add(schedule.param_grad[ph])
    first: dict[UnitKey, int] = {}
    for st in schedule.steps:
        if st.kind == "compute" and st.phase == "bwd":
            first.setdefault(st.unit, st.micro)
    return {u: (first[u], frozenset(names)) for u, names in grads.items() if u in first}


def share_param_casts(schedule: Schedule, stages: dict) -> dict:
    """``stages`` (by :func:`stage_key`) with each unit's parameter casts (:attr:`Schedule.casts`)
    computed once per iteration: the unit's first forward in the schedule returns them (keyed
    ``(unit, name)``, :func:`value_key`), and its later micro-batches' forwards and its
    recomputing backward read them instead of casting again. A cast's value changes only at the
    optimizer step, so this computes the same values (the tests compare parameters to the bit).
    Stages shared by several micro-batches stay shared (one edited copy per role). The units of
    :attr:`Schedule.recast` (ZeRO-3) make theirs per use instead (:func:`recast_per_use`)."""
    stages = recast_per_use(schedule, stages)
    if not schedule.casts:
        return stages
    first: dict[UnitKey, int] = {}
    for st in schedule.steps:
        if st.kind == "compute" and st.phase == "fwd":
            first.setdefault(st.unit, st.micro)
    edited: dict[tuple[int, bool], Stage] = {}
    out = {}
    for key, stage in stages.items():
        unit, phase, *micro = key
        mine = schedule.casts.get(unit, frozenset())
        names = [n for n in stage.nodes if n in mine]
        if not names:
            out[key] = stage
            continue
        makes = phase == "fwd" and (not micro or micro[0] == first.get(unit))
        k = (id(stage), makes)
        if k not in edited:
            edited[k] = _returning(stage, names) if makes else _reading(stage, names)
        out[key] = edited[k]
    return out


def recast_per_use(schedule: Schedule, stages: dict) -> dict:
    """``stages`` with the units of :attr:`Schedule.recast` (ZeRO-3 groups) making their
    parameter casts per use: the forward no longer returns the values made from the casts alone
    (the copies, their transposes; read only inside the unit), and the backward makes the ones it
    reads again from the parameters (gathered before it, :mod:`tag.executor.sharded`) instead of
    reading the forward's, so no copy lives from the forward to the backward, as FSDP frees a
    unit's gathered bf16 parameters after its forward. A recomputed unit's backward makes them
    already (:func:`tag.graph.stages.build_stages`). The same values: parameters equal to the bit
    (tests/test_sharded_casts.py). The units' casts of parameters are :func:`cast_as_needed`: a
    weight gathered in the low precision is read as it is."""
    if not schedule.recast:
        return stages
    edited: dict[int, Stage] = {}
    out = {}
    for key, stage in stages.items():
        unit, phase, *micro = key
        names = schedule.recast.get(unit, frozenset())
        if phase == "fwd" and any(n in names for n in stage.outputs):
            if id(stage) not in edited:
                edited[id(stage)] = _dropping(stage, names)
        elif phase == "bwd" and any(n in names for n in stage.inputs):
            if id(stage) not in edited:
                edited[id(stage)] = _remaking(stage, stages[(unit, "fwd", *micro)], names)
        out[key] = edited.get(id(stage), stage)
    lazy: dict[int, Stage] = {}
    for key, stage in out.items():
        if key[0] in schedule.recast:
            if id(stage) not in lazy:
                lazy[id(stage)] = _casting_as_needed(stage, schedule.param_owner)
            out[key] = lazy[id(stage)]
    return out


_TO_COPY = torch.ops.aten._to_copy.default


def cast_as_needed(x: torch.Tensor, **kwargs) -> torch.Tensor:
    """``aten._to_copy(x, **kwargs)``, or ``x`` itself where it already has the dtype: a ZeRO-3
    weight gathered in the low precision (:mod:`tag.executor.sharded`) is read as it is, as
    autocast reads FSDP2's ``param_dtype`` parameters (no copy)."""
    dev = kwargs.get("device")
    here = dev is None or torch.device(dev) == x.device or (torch.device(dev).index is None
                                                           and torch.device(dev).type == x.device.type)
    if x.dtype == kwargs.get("dtype") and set(kwargs) <= {"dtype", "layout", "device"} and here:
        return x
    return _TO_COPY(x, **kwargs)


def _casting_as_needed(stage: Stage, params) -> Stage:
    """``stage``, or a copy whose low-precision casts of parameters (placeholders named in
    ``params``) are :func:`cast_as_needed`."""
    low = (torch.bfloat16, torch.float16)
    hits = [n.name for n in stage.module.graph.nodes
            if n.op == "call_function" and n.target is _TO_COPY and n.kwargs.get("dtype") in low
            and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder" and n.args[0].name in params]
    if not hits:
        return stage
    g, env = fx.Graph(), {}
    for n in stage.module.graph.nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
        if n.name in hits:
            env[n].target = cast_as_needed
    return Stage(stage.key, fx.GraphModule(stage.module, g), list(stage.inputs), list(stage.outputs),
                 list(stage.nodes))


def _dropping(stage: Stage, names: frozenset[str]) -> Stage:
    """A copy of ``stage`` that does not return the nodes ``names``."""
    g, env = fx.Graph(), {}
    keep = [i for i, n in enumerate(stage.outputs) if n not in names]
    for n in stage.module.graph.nodes:
        if n.op == "output":
            g.output(tuple(env[n.args[0][i]] for i in keep))
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    return Stage(stage.key, fx.GraphModule(stage.module, g), list(stage.inputs), [stage.outputs[i] for i in keep],
                 list(stage.nodes))


def _remaking(stage: Stage, fwd: Stage, names: frozenset[str]) -> Stage:
    """A copy of ``stage`` (a backward) that computes its inputs among ``names`` from the
    parameters with the forward ``fwd``'s nodes making them (placeholders after the others)."""
    defs = {n.name: n for n in fwd.module.graph.nodes}
    need: set[str] = set()
    todo = [n for n in stage.inputs if n in names]
    while todo:
        name = todo.pop()
        if name not in need:
            need.add(name)
            todo += [a.name for a in defs[name].all_input_nodes if a.op != "placeholder"]
    params = [a.name for n in need for a in defs[n].all_input_nodes if a.op == "placeholder"]
    params = [p for p in dict.fromkeys(params) if p not in stage.inputs]
    g, env, made = fx.Graph(), {}, {}
    old = list(stage.module.graph.nodes)
    phs = {n.name: n for n in old if n.op == "placeholder"}
    for n in old:
        if n.op == "placeholder" and n.name not in need:
            env[n] = made[n.name] = g.node_copy(n, lambda a: env[a])
    for p in params:
        made[p] = g.placeholder(p)
        made[p].meta = dict(defs[p].meta)
    for n in fwd.module.graph.nodes:  # (in the forward's order)
        if n.name in need:
            made[n.name] = g.node_copy(n, lambda a: made[a.name])
            if n.name in phs:
                env[phs[n.name]] = made[n.name]
    for n in old:
        if n.op != "placeholder":
            env[n] = g.node_copy(n, lambda a: env[a])
    inputs = [n for n in stage.inputs if n not in need] + params
    return Stage(stage.key, fx.GraphModule(stage.module, g), inputs, list(stage.outputs),
                 [n for n in defs if n in need] + list(stage.nodes))


def _returning(stage: Stage, names: list[str]) -> Stage:
    """A copy of ``stage`` that also returns the nodes ``names``."""
    add = [n for n in names if n not in stage.outputs]
    g, env = fx.Graph(), {}
    for n in stage.module.graph.nodes:
        if n.op == "output":
            made = {m.name: env[m] for m in stage.module.graph.nodes if m.name in add}
            g.output(tuple(env[a] for a in n.args[0]) + tuple(made[a] for a in add))
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    return Stage(stage.key, fx.GraphModule(stage.module, g), list(stage.inputs), stage.outputs + add, list(stage.nodes))


def _reading(stage: Stage, names: list[str]) -> Stage:
    """A copy of ``stage`` whose nodes ``names`` are inputs (placeholders after the others)
    instead of being computed."""
    old = list(stage.module.graph.nodes)
    phs = [n for n in old if n.op == "placeholder"]
    by_name = {n.name: n for n in old}
    g, env = fx.Graph(), {}
    for n in phs:
        env[n] = g.node_copy(n, lambda a: env[a])
    for name in names:
        ph = env[by_name[name]] = g.placeholder(name)
        ph.meta = dict(by_name[name].meta)
    for n in old:
        if n.op != "placeholder" and n not in env:
            env[n] = g.node_copy(n, lambda a: env[a])
    return Stage(stage.key, fx.GraphModule(stage.module, g), stage.inputs + names, list(stage.outputs),
                 [n for n in stage.nodes if n not in names])


def takes_part(schedule: Schedule, rank: int, st: Step, stages) -> bool:
    """Whether ``rank`` has something to do in step ``st`` (``stages``: its stages, by
    :func:`stage_key`)."""
    if st.kind == "compute":
        return stage_key(schedule, st) in stages
    if st.kind == "transfer":
        return any(rank in (m.src, m.dst) for m in st.moves)
    if st.kind == "sfb":
        return rank in schedule.sfb[st.group].devices
    return rank in st.collective.members


def is_local(rank: int, st: Step) -> bool:
    """A transfer step whose moves touching ``rank`` are all hand-overs inside it."""
    return all(m.src == m.dst for m in st.moves if rank in (m.src, m.dst))


def step_reads_writes(schedule: Schedule, rank: int, st: Step, stages, synced: Callable[[int], list[Key]],
                      sfb_writes: Callable[[int], list[Key]],
                      accum: dict[UnitKey, tuple[int, frozenset[str]]] | None = None) -> tuple[list[Key], list[Key]]:
    """``env`` keys step ``st`` reads and writes on ``rank`` (``accum``: :func:`accumulation`)."""
    if st.kind == "compute":
        stage = stages[stage_key(schedule, st)]
        u = env_unit(schedule, st.unit, st.micro)
        reads = [value_key(schedule, st.unit, n, st.micro) for n in stage.inputs]
        acc = accum.get(st.unit) if accum and st.phase == "bwd" else None
        if acc is None:
            return reads, [value_key(schedule, st.unit, n, st.micro) for n in stage.outputs]
        first, grads = acc  # the parameter gradients go to (unit, name), summed over the micro-batches
        summed = [(st.unit, n) for n in stage.outputs if n in grads]
        return (reads + (summed if st.micro != first else []),
                [(st.unit, n) if n in grads else (u, n) for n in stage.outputs])
    if st.kind == "transfer":
        reads = [value_key(schedule, m.src_unit, m.name, st.micro) for m in st.moves
                 if m.src == rank and m.mode != "zeros"]
        writes = list(dict.fromkeys(value_key(schedule, m.dst_unit, m.name, st.micro) for m in st.moves
                                    if m.dst == rank))
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
                 final_reads: list[Key], cut_at_sync: bool, replayed: frozenset[int] = frozenset(),
                 alone: frozenset[int] = frozenset()) -> Program:
    """Segments of ``rank`` and the liveness of its ``env`` values (``stages`` by :func:`stage_key`).

    ``replayed``: recomputed op-groups whose forward draws random numbers; each unit's forward
    starts a segment (the runtime saves the random generator's state there) and its recomputing
    backward is a segment of its own (run from that state, the generator put back after it:
    :meth:`tag.executor.runtime.RankRuntime.run_segment`).

    ``alone``: op-groups each of whose compute steps is a segment of its own (ZeRO-3's groups,
    whose parameters are gathered before their segment and freed after it,
    :mod:`tag.executor.sharded`).

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
        recomputed = st.kind == "compute" and st.unit[0] in schedule.recompute
        if recomputed and (st.phase == "bwd" or st.unit[0] in replayed):
            # A recomputed unit's backward starts a segment: within one module the common-value
            # pass (simplify) would merge its forward's recomputed values with the forward's own
            # and keep those alive from the forward on. A replayed unit's forward starts one too.
            current = None
        by_itself = st.kind == "compute" and st.unit[0] in alone
        if by_itself:
            current = None
        if fusable:
            if current is None:
                current = Segment(i, [], [])
                actions.append(("seg", current))
            current.steps.append(i)
            if st.kind == "compute":
                current.stages.append(stage_key(schedule, st))
                if (recomputed and st.phase == "bwd" and st.unit[0] in replayed) or by_itself:
                    current = None  # the generator is put back before anything else draws (or: alone)
            continue
        if st.kind in ("transfer", "sfb") or (cut_at_sync and schedule.launched_at(st) is not None):
            current = None
        actions.append(("step", i))
    accum = accumulation(schedule)
    rw = {i: step_reads_writes(schedule, rank, st, stages, synced, sfb_writes, accum) for i, st in mine}
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
            produced_keys = [k for i in a.steps for k in rw[i][1]]
            # an input the segment overwrites (a gradient summed over micro-batches) is dead once read
            a.drop = [k for k in a.inputs if last[k] == pos or k in produced_keys]
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
    tensor (``node.meta["val"]``) of a value. ``local_rows(m, micro)``: for a local ``rows`` move
    of micro-batch ``micro``, ``(start, length)`` along its batch dim in the producer's tensor, or
    None for all of it.
    """
    accum = accumulation(schedule)
    g = fx.Graph()
    node_of: dict[Key, fx.Node] = {}
    static_keys: list[Key] = []
    reads: list[Key] = []
    produced: set[Key] = set()
    for i in seg.steps:  # which keys come from outside, in first-use order
        st = schedule.steps[i]
        r, w = step_reads_writes(schedule, rank, st, stages, lambda g_: [], lambda g_: [], accum)
        reads += [k for k in r if k not in produced]
        produced.update(w)
    for k in dict.fromkeys(reads):
        if static_value(k) is not None:
            static_keys.append(k)
    used: set[str] = set()
    for k in static_keys + seg.inputs:
        # One name per placeholder: the generated code unpacks the arguments by target name, and two
        # keys may share a node name (a user input's rows for two units or micro-batches).
        name, n = _ident(k[1]), 0
        while name in used:
            n += 1
            name = f"{_ident(k[1])}_arg{n}"
        used.add(name)
        ph = g.placeholder(name)
        val = meta(k)
        if val is not None:
            ph.meta["val"] = val
        node_of[k] = ph
    seg.static = [static_value(k) for k in static_keys]
    attrs: dict[str, object] = {}
    for i in seg.steps:
        st = schedule.steps[i]
        if st.kind == "compute":
            stage: Stage = stages[stage_key(schedule, st)]
            first, grads = accum.get(st.unit, (st.micro, frozenset())) if st.phase == "bwd" else (0, frozenset())
            local: dict[fx.Node, fx.Node] = {}
            phs = [n for n in stage.module.graph.nodes if n.op == "placeholder"]
            for n, name in zip(phs, stage.inputs):
                local[n] = node_of[value_key(schedule, st.unit, name, st.micro)]
            for n in stage.module.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    for name, v in zip(stage.outputs, n.args[0]):
                        if name not in grads:
                            node_of[value_key(schedule, st.unit, name, st.micro)] = local[v]
                        elif st.micro == first:  # a gradient summed over the micro-batches (accumulation)
                            node_of[(st.unit, name)] = local[v]
                        else:
                            node_of[(st.unit, name)] = g.call_function(torch.add, (node_of[(st.unit, name)], local[v]))
                    continue
                new = g.node_copy(n, lambda a, local=local: local[a])
                if n.op == "get_attr":  # stages cut from joint graphs at two batch sizes may share a name
                    val = getattr(stage.module, n.target)
                    if attrs.get(n.target, val) is not val:
                        new.target = f"{n.target}_{i}"
                    attrs[new.target] = val
                local[n] = new
        else:
            _local_transfer(g, st, schedule, rank, node_of, local_rows, meta, device)
    g.output(tuple(node_of[k] for k in seg.outputs))
    simplify(g)
    bind_fast(g)
    root = torch.nn.Module()
    for name, v in attrs.items():
        setattr(root, name, v)
    codegen = _boxed_codegen()
    seg.boxed = codegen is not None
    if seg.boxed:
        g.set_codegen(codegen)
    seg.module = fx.GraphModule(root, g, class_name="Segment")


def _local_transfer(g: fx.Graph, st: Step, schedule: Schedule, rank: int, node_of: dict, local_rows, meta,
                    device) -> None:
    """Local hand-overs of step ``st`` as graph ops (no copies where a view or the tensor does)."""
    pieces: dict[Key, list[Move]] = {}

    def src(m: Move) -> Key:
        return value_key(schedule, m.src_unit, m.name, st.micro)

    for m in st.moves:
        if m.dst == rank:
            pieces.setdefault(value_key(schedule, m.dst_unit, m.name, st.micro), []).append(m)
    for key, ms in pieces.items():
        m0 = ms[0]
        if m0.mode == "zeros":
            val = meta(key)
            node_of[key] = g.call_function(torch.zeros, (list(val.shape),), {"dtype": val.dtype, "device": device})
        elif m0.mode == "rows":
            parts = []
            for m in sorted(ms, key=lambda m: m.start):
                v = node_of[src(m)]
                rng = local_rows(m, st.micro)
                if rng is not None:
                    v = g.call_function(torch.narrow, (v, m.batch_dim, *rng))
                    if m.batch_dim != 0:  # a row range along an inner dim is strided; stages may view it
                        v = g.call_method("contiguous", (v,))
                parts.append(v)
            node_of[key] = parts[0] if len(parts) == 1 else g.call_function(torch.cat, (parts, m0.batch_dim))
        elif m0.mode == "sum":
            total = node_of[src(m0)]
            for m in ms[1:]:
                total = g.call_function(torch.add, (total, node_of[src(m)]))
            node_of[key] = total
        else:  # copy: the producer's tensor itself
            node_of[key] = node_of[src(m0)]


_ALIAS = torch.ops.aten.alias.default
_PERMUTE = torch.ops.aten.permute.default


def _pure(n: fx.Node) -> bool:
    """Whether ``n`` is an ATen op whose result depends only on its arguments (no RNG, no
    mutation, no uninitialised memory): two such nodes with equal arguments are one value."""
    t = n.target
    if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    return (not t._schema.is_mutable and torch.Tag.nondeterministic_seeded not in t.tags
            and t.overloadpacket not in (torch.ops.aten.empty, torch.ops.aten.empty_like,
                                         torch.ops.aten.empty_strided, torch.ops.aten.new_empty))


def simplify(g: fx.Graph) -> int:
    """Drop the ops of a fused segment that only cost a dispatch, in place; returns how many.

    The captured joint graph is functional ATen, so: ``aten.alias`` is its input; ``permute`` of a
    ``permute`` that composes to the identity is the inner input (the ``W.t().t()`` of a linear
    layer's backward); and a pure op repeated with the same arguments (the loss's ``labels != -100``
    three times) is computed once. Values returned by the segment are never replaced by one of
    its inputs (the caller may hold them as distinct tensors). On a small MLP this removes 21 of
    71 op calls per iteration, each ~1-2 us of Python dispatch on a CPU rank.
    """
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    removed = 0
    seen: dict[tuple, fx.Node] = {}
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        repl = None
        if n.target is _ALIAS:
            repl = n.args[0]
        elif n.target is _PERMUTE and isinstance(n.args[0], fx.Node) and n.args[0].target is _PERMUTE:
            p, q = n.args[0].args[1], n.args[1]
            if [p[i] for i in q] == list(range(len(q))):
                repl = n.args[0].args[0]
        elif _pure(n):
            key = (n.target, _hashable(n.args), _hashable(n.kwargs))
            if key[1] is not None and key[2] is not None:
                repl = seen.setdefault(key, n)
                repl = None if repl is n else repl
        if repl is None or (out in n.users and (repl.op == "placeholder" or out in repl.users)):
            continue  # an output would become an input, or two outputs one tensor
        n.replace_all_uses_with(repl)
        g.erase_node(n)
        removed += 1
    for n in reversed(list(g.nodes)):  # what only the removed ops read (users before producers)
        if n.op == "call_function" and not n.users and _pure(n):
            g.erase_node(n)
            removed += 1
    return removed


_BINDINGS = (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase)
"""Where torch's generated Python bindings live (``torch.*``, ``torch._C._nn.*``, Tensor methods)."""


class _Record(TorchDispatchMode):
    """The ATen ops dispatched while it is active (top-level calls only: a handler runs with the
    mode off)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _meta_arg(x):
    """A node argument as a ``meta`` tensor of its recorded shape and strides (``node.meta["val"]``),
    a device as the ``meta`` device (nothing is allocated or computed); raises ``LookupError`` where
    a node has no tensor value recorded."""
    if isinstance(x, torch.device):
        return torch.device("meta")
    if isinstance(x, fx.Node):
        v = x.meta.get("val")
        if not isinstance(v, torch.Tensor):
            raise LookupError(x.name)
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_meta_arg(a) for a in x)
    if isinstance(x, dict):
        return {k: _meta_arg(v) for k, v in x.items()}
    return x


def bind_fast(g: fx.Graph) -> int:
    """Call each ATen op of a fused segment through torch's generated Python binding of the same
    overload (``torch.permute`` for ``aten.permute.default``), in place; returns how many.

    ``torch.ops.aten.X.overload(...)`` converts its arguments by the operator's schema in generic
    code, 2-6 us more per call than the binding's parser on the 2-core development VM (permute
    7.8 against 1.8 us): with 50 ops a zoo ``mlp`` iteration paid ~0.2 ms (7% of its step) over
    eager PyTorch, whose ops are called from C++. The binding resolves the overload itself, so it
    is used only for an op with a kernel of its own (not composite: the binding passes the
    arguments it parsed to the dispatcher as they are) where, called with the node's arguments
    (``meta`` tensors of the recorded shapes and strides), it dispatches exactly the node's overload
    and nothing else: the same kernel with the same arguments, the same result bit for bit. Other
    nodes keep their ``OpOverload``.
    """
    checked: dict[tuple, object] = {}
    n_bound = 0
    for n in g.nodes:
        t = n.target
        if (n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t.namespace != "aten"
                or torch.Tag.nondeterministic_seeded in t.tags  # (random: left as captured)
                # a composite op's binding runs its decomposition, which may call the op itself
                # with other arguments (only a binding that dispatches what it parsed is taken)
                or torch._C._dispatch_has_kernel_for_dispatch_key(t.name(), "CompositeImplicitAutograd")):
            continue
        name = t.overloadpacket.__name__
        for where in _BINDINGS:
            fast = getattr(where, name, None)
            if fast is None:
                continue
            try:
                args, kwargs = _meta_arg(n.args), _meta_arg(n.kwargs)
            except LookupError:
                break
            key = (t, fast, _signature(args), _signature(kwargs))
            if key not in checked:
                rec = _Record()
                try:
                    with rec, torch.no_grad():
                        fast(*args, **kwargs)
                    checked[key] = rec.ops == [t]
                except Exception:  # noqa: BLE001 - any refusal: the binding does not take these arguments
                    checked[key] = False
            if checked[key]:
                n.target = fast
                n_bound += 1
                break
    return n_bound


def _signature(x):
    """Types, shapes, dtypes and values of call arguments (meta tensors by their metadata)."""
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.stride(), x.dtype)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_signature(a) for a in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _signature(v)) for k, v in x.items()))
    return (type(x).__name__, repr(x))


def _hashable(x):
    """``x`` (node arguments) as a hashable key, nodes by identity; None if it holds something else."""
    if isinstance(x, fx.Node):
        return ("n", x)
    if isinstance(x, float):  # by repr: -0.0 and 0.0 differ, nan equals nan
        return ("float", repr(x))
    if x is None or isinstance(x, (int, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(x).__name__, x)
    if isinstance(x, (list, tuple)):
        items = tuple(_hashable(v) for v in x)
        return None if any(i is None for i in items) else (type(x).__name__, items)
    if isinstance(x, dict):
        items = tuple((k, _hashable(v)) for k, v in x.items())
        return None if any(v is None for _, v in items) else ("dict", items)
    return None


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
