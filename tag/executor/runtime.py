"""What one rank holds and does: its stages, values, parameters and optimizer.

The runtime is transport-agnostic: a transfer step is split into :meth:`RankRuntime.outgoing`
(pieces this rank sends), :meth:`RankRuntime.incoming` (buffers it receives into) and
:meth:`RankRuntime.assemble` (combine pieces into the consumer's input). The distributed
worker moves the pieces with torch.distributed; :mod:`tag.executor.virtual` moves them inside
one process (fast semantic tests). A piece its hook scatters (a tensor-parallel group's, between
machines: :meth:`RankHook.scattered <tag.executor.strategies.RankHook.scattered>`) goes as this
member's slice (:func:`scatter_slice`), and :meth:`RankRuntime.assemble` all-gathers the slices
over the group (:attr:`RankHook.gather <tag.executor.strategies.RankHook.gather>`) before
combining.

Values live in ``env[(unit, node name)]``: a rank may serve several units with different
sample ranges, so the same node name can hold different rows for different units. On a pipeline
(``Plan.pipeline``) the unit part carries the micro-batch, ``(group, chunk, micro)``
(:func:`tag.executor.fuse.env_unit`), so micro-batches in flight at once keep their own values;
each micro-batch runs the stages cut from the joint graph at its local batch (the loss-gradient
seed of micro-batch ``m`` scaled by ``b_{i,m} / B``), and the parameter gradients are summed over
the micro-batches into ``env[(unit, gradient name)]`` (:func:`tag.executor.fuse.accumulation`),
which the one gradient sync per group and the one optimizer step read as without a pipeline.
What crosses units once per iteration (a tied weight and its summed gradient,
:attr:`Schedule.shared` / :attr:`Schedule.summed`) is keyed without the micro-batch
(:func:`tag.executor.fuse.value_key`).

Why not ``torch.distributed.pipelining``: its schedules (``ScheduleGPipe``, ``Schedule1F1B``, ...)
drive ``PipelineStage`` objects that wrap ``nn.Module`` pieces and run their backward through
autograd, one rank (or an FSDP/DDP group) per stage, exchanging only the stage outputs and their
gradients with the neighbouring stages. TAG's stages are cuts of the captured *joint* forward +
backward graph (explicit gradient ops, no autograd), a stage may be data parallel over uneven
replicas whose rows are re-partitioned between stages, tensors other than the stage outputs cross
stages (a tied weight and its partial-sum gradient, the loss seed), and the schedule (kFkB, the
global order every rank walks, the packed transfers of :mod:`tag.executor.comm`) is shared with
the simulator. The pipeline runs on the executor's own schedule walk instead. A rank runs its
consecutive local steps (stages and local hand-overs) as one generated module per segment
(:mod:`tag.executor.fuse`), and ``env`` keeps a value only until its last reader ran.

Nothing waits for the device inside an iteration: on CUDA the activities are timed with events,
resolved after the one synchronisation per iteration (:meth:`RankRuntime.update`, which also reads
the loss).

Every joint graph a rank runs (one per local batch, plus the global batch for SFB) must have the
captured graph's structure (:func:`joint_structure`), or its node names would designate other
ops: otherwise the rank refuses with one line naming the group and the batch.

SFB (``GroupPlan.sfb``): :meth:`RankRuntime.sfb_local` gives this replica's rows of the group's
factors (its stages are edited to output them, and to no longer compute the local gradients
SFB replaces); :meth:`RankRuntime.sfb_recompute` evaluates ``tag.compress.sfb_kernel`` on the
gathered factors (the joint graph at the global batch) to get the full gradients.
"""

from __future__ import annotations

import contextlib
import math
import operator
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.export.graph_signature import InputKind

from ..errors import TagError
from ..graph.capture import export_joint
from ..graph.stages import Stage, build_stages, retarget_devices
from ..parallel.schedule import Bucket, Move, Schedule, SfbGroup, Step, Unit, UnitKey
from .fuse import Key, Program, build_module, env_unit, plan_program, share_param_casts, value_key
from .optim import make_optimizer
from .scaling import SCALE_INPUT, LossScaler

if TYPE_CHECKING:
    from .strategies import RankHook


class ExecutionError(TagError):
    """The plan could not be executed (a rank failed, the model cannot be split as planned)."""


@dataclass
class Joint:
    """The joint graph exported at one local batch size, with its placeholders."""

    module: torch.fx.GraphModule
    user_inputs: list[str]
    """Placeholder names of the user inputs, in call order."""
    state: dict[str, str]
    """Placeholder name -> state-dict / constant name, for params, buffers and constants."""
    state_values: dict[str, torch.Tensor]


def export_at(model: torch.nn.Module, make_inputs, batch: int, precision: str = "fp32") -> Joint:
    """Export the joint graph of ``model`` at local batch ``batch`` (one torch.export); bf16 / fp16:
    exported under autocast, so the graph runs mixed precision as it is (:mod:`tag.graph.precision`)."""
    ep = export_joint(model, make_inputs(batch), precision=precision)
    users, state = [], {}
    for s in ep.graph_signature.input_specs:
        if s.kind == InputKind.USER_INPUT:
            users.append(s.arg.name)
        else:
            state[s.arg.name] = s.target
    return Joint(ep.graph_module, users, state, {**ep.state_dict, **ep.constants})


@dataclass
class Timer:
    """Seconds spent per activity in the current iteration.

    :meth:`span` times a block: the host clock on a CPU; CUDA events on a GPU (no
    synchronisation: :meth:`resolve` reads them once the iteration's work is done)."""

    compute: float = 0.0
    comm: float = 0.0
    sync: float = 0.0
    update: float = 0.0
    sfb_gather: float = 0.0
    """SFB factor all-gathers (included in ``sync``)."""
    sfb_recompute: float = 0.0
    """SFB gradient recompute on the gathered factors (included in ``compute``)."""
    cuda: bool = field(default=False, repr=False)
    _events: list = field(default_factory=list, repr=False)

    @contextlib.contextmanager
    def span(self, *activities: str):
        """Add the block's duration to each of ``activities``."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((activities, start, end))
            return
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        for a in activities:
            setattr(self, a, getattr(self, a) + dt)

    def resolve(self) -> None:
        """Add the CUDA-event spans (call after the device finished them)."""
        for activities, start, end in self._events:
            dt = start.elapsed_time(end) / 1e3  # ms -> s
            for a in activities:
                setattr(self, a, getattr(self, a) + dt)
        self._events.clear()

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("compute", "comm", "sync", "update", "sfb_gather", "sfb_recompute")}


@dataclass
class RankRuntime:
    """State and actions of rank ``rank`` (= topology device ``rank``)."""

    rank: int
    schedule: Schedule
    inputs: tuple
    """Full-batch user inputs (identical on every rank); sliced by sample range per unit."""
    joints: dict[int, Joint]
    """Local batch -> joint graph exported at it."""
    optimizer_name: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    slowdown: float = 1.0
    """Emulated speed: each stage takes ``slowdown`` x its real time (sleeps the rest)."""
    global_joint: Joint | None = None
    """The joint graph at the global batch: needed when a unit of this rank uses SFB."""
    loss_scale: float = 1.0
    """fp16's initial loss scale (:data:`tag.graph.precision.FP16_LOSS_SCALE`; 1 otherwise: no
    scaling), then dynamic (:class:`tag.executor.scaling.LossScaler`, ``torch.amp.GradScaler``'s
    rule): the loss-gradient seed is multiplied by the scale and the gradients divided by it before
    the update, which is skipped when one of them is not finite; the scale halves then, and
    doubles after 2000 finite steps."""
    hook: RankHook | None = None
    """What the plan's strategy changes in this rank (:mod:`tag.executor.strategies`; a
    tensor-parallel shard's: its joint graphs rewritten for the shard, its stages all-reducing at
    the block boundaries)."""
    cut_at_sync: bool = False
    """A gradient bucket's launch ends a fused segment (a rank that issues its buckets as their
    gradients become final, on GPUs); otherwise segments run on across the syncs, which are only
    queued (CPU ranks)."""
    seed: int | None = None
    """Seed of this rank's random stream (dropout masks; every rank alike, as Megatron-LM seeds
    its data-parallel ranks, and as the replicated ops of a tensor-parallel group need); None:
    the generators' state when the runtime is made."""
    before_step: Callable[[bool], bool] | None = None
    """Called by :meth:`update` with the parameters' gradients set (unscaled) and whether they are
    finite, on every rank; returns whether to step (``tag run``'s clipping and gradient
    accumulation, :mod:`tag.executor.train`)."""
    agree_finite: Callable[[bool], bool] | None = None
    """fp16: whether every rank's gradients are finite, from this rank's (a distributed run's
    one all-reduce of the found-inf flag, :mod:`tag.executor.scaling`); None: this rank's alone."""
    compiled: bool = False
    """Each fused segment (a stage's forward or backward with the local steps around it) runs
    through ``torch.compile`` (Inductor), compiled at its first call (``tag execute --compile``;
    :func:`compile_segment`)."""

    # ---- what the builders below make (not arguments) ------------------------------------
    my_units: dict[UnitKey, Unit] = field(init=False, repr=False)
    """Unit key -> the schedule's unit, for every unit with a replica on this rank."""
    micros: range = field(init=False, repr=False)
    """Micro-batch indices (``range(1)``, the whole batch, without a pipeline)."""
    stages: dict[tuple, Stage] = field(init=False, repr=False)
    """Stage key (:func:`tag.executor.fuse.stage_key`: ``(unit, phase)``, on a pipeline
    ``(unit, phase, micro)``) -> the cut of the joint graph this rank runs (:func:`cut_stages`;
    the micro-batches of one local batch share one)."""
    scaler: LossScaler | None = field(init=False, repr=False)
    """fp16's dynamic loss scale (None: no loss scaling, :attr:`loss_scale` 1)."""
    user_inputs: list[str] = field(init=False, repr=False)
    """Placeholder names of the joint graphs' user inputs, in call order (dim 0 of each is the
    batch)."""
    state: dict[str, torch.Tensor] = field(init=False, repr=False)
    """Placeholder name -> buffer or constant every stage may read, on :attr:`device`
    (:func:`load_state`; fp16's 0-dim loss scale under :data:`SCALE_INPUT`)."""
    params: dict[str, torch.nn.Parameter] = field(init=False, repr=False)
    """Placeholder name -> this rank's copy of a parameter of its units, on :attr:`device`
    (a tied weight's second copy too; a tensor-parallel shard's part of it)."""
    optimizer: torch.optim.Optimizer | None = field(init=False, repr=False)
    """Steps :attr:`params` (a sharded rank's: its shards and its unsharded groups' parameters,
    :meth:`hold_shards`); None: the rank holds no parameter."""
    _grad_keys: list[tuple[torch.nn.Parameter, Key]] = field(init=False, repr=False)
    """(parameter, ``env`` key of its gradient) for :meth:`update` to set (a sharded parameter's
    gradient reaches the optimizer through its bucket's shard instead)."""
    kernels: dict[int, list] = field(init=False, repr=False)
    """Op-group -> its SFB kernels (:class:`tag.compress.SfbKernel`), for this rank's SFB units
    (:func:`prepare_sfb`)."""
    input_rows: dict[Key, torch.Tensor] = field(init=False, repr=False)
    """``env`` key of a user input of a unit and micro-batch -> this rank's rows of it
    ([rows, ...] views of :attr:`inputs`, the same every iteration; :func:`input_rows`)."""
    program: Program = field(init=False, repr=False)
    """The fused segments this rank runs per iteration and when its values die
    (:meth:`_build_program`)."""
    _rng: tuple = field(init=False, repr=False)
    """This rank's random stream between segments: the generators' states (CPU, and the GPU's on
    one), carried from segment to segment (:meth:`_random_stream`; saved by checkpoints)."""
    _rng_saved: dict[tuple, tuple] = field(default_factory=dict, init=False, repr=False)
    """(unit, micro) -> the stream's state before its forward (for its replayed recomputation)."""
    _rng_modes: dict[int, tuple] = field(default_factory=dict, init=False, repr=False)
    """Segment start -> ``("save" | "replay", (unit, micro))`` (units whose recomputation draws)."""
    _draws: bool = field(default=False, init=False, repr=False)
    """Some stage of this rank draws random numbers (:meth:`_build_program`)."""
    _placeholder_vals: dict[tuple, dict] = field(default_factory=dict, init=False, repr=False)
    """Stage key -> placeholder name -> its traced value (:meth:`_captured`)."""
    _programs: dict[int, tuple] = field(default_factory=dict, init=False, repr=False)
    """``id`` of a schedule walked before -> (schedule, program, rng modes) (:meth:`use_schedule`)."""
    # ---- the current iteration's values and counts (reset by begin_iteration) -------------
    env: dict[Key, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    """``(unit, node name)`` -> value, each kept until its last reader ran."""
    made: dict[Key, object] = field(default_factory=dict, init=False, repr=False)
    """``env`` key -> CUDA event recorded after the segment making it (GPU ranks)."""
    timer: Timer = field(default_factory=Timer, init=False, repr=False)
    """Seconds per activity in the iteration."""
    loss: float = field(default=0.0, init=False)
    """The iteration's loss (the batch mean), read by :meth:`update` on the loss unit's ranks."""
    sent_bytes: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    """Bytes this rank handed out to send in the current iteration, per destination (the
    schedule's device; :meth:`outgoing`)."""
    gathered_bytes: int = field(default=0, init=False, repr=False)
    """Bytes of the scattered pieces this rank all-gathered in the current iteration (whole
    pieces, padding included; :meth:`_gather_scattered`)."""

    def __post_init__(self) -> None:
        s = self.schedule
        self.my_units = {u.key: u for u in s.units_of(self.rank)}
        self.micros = range(len(s.micro_ranges))
        self.scaler = LossScaler(self.device, self.loss_scale) if self.loss_scale != 1.0 else None
        self._rng = _seeded_rng(self.seed, self.device)
        cut = cut_stages(s, self.rank, self.micros, self.joints, self.inputs, self.hook, self.device,
                         scaled=self.scaler is not None)
        self.joints.update(cut.joints)
        self.stages = cut.stages
        held = load_state(s, self.my_units, self.joints, self.device, self.scaler)
        self.user_inputs, self.state, self.params = held.user_inputs, held.state, held.params
        self.optimizer = make_optimizer(self.optimizer_name, self.params.values(), self.device)
        self._grad_keys = [(p, s.grad_key(ph, self.my_units)) for ph, p in self.params.items()]
        self.kernels = prepare_sfb(s, self.rank, self.my_units, self.stages, self.joints, self.global_joint,
                                   self.device)
        self.input_rows = input_rows(s, self.rank, self.my_units, self.micros, self.user_inputs, self.inputs)
        self.stages = share_param_casts(s, self.stages)  # bf16 / fp16 weight casts: once per iteration
        self._build_program()
        self.timer = Timer(cuda=self.device.type == "cuda")

    def hold_shards(self, optimizer: torch.optim.Optimizer | None, sharded: set[int]) -> None:
        """A sharded rank's optimizer (:mod:`tag.executor.sharded`): ``optimizer`` steps its shards
        and its unsharded parameters; the parameters whose ``id`` is in ``sharded`` no longer get
        their gradient from :meth:`update` (their bucket's shard carries it)."""
        self.optimizer = optimizer
        self._grad_keys = [(p, k) for p, k in self._grad_keys if id(p) not in sharded]

    # ---- the rank's program -------------------------------------------------------------
    def _build_program(self) -> None:
        """Segments of fused local steps and the liveness of ``env`` values (:mod:`tag.executor.fuse`):
        sets :attr:`program`, :attr:`_rng_modes` and :attr:`_draws`."""
        s = self.schedule
        written = {value_key(s, m.dst_unit, m.name, st.micro) for st in s.steps if st.kind == "transfer"
                   for m in st.moves if m.dst == self.rank}
        final = [s.grad_key(ph, self.my_units) for ph in self.params]
        if s.loss_unit in self.my_units:
            final += [(env_unit(s, s.loss_unit, m), s.loss) for m in self.micros]
        from ..graph.gradients import node_draws_random

        draws = {key: [n.name for n in st.module.graph.nodes if n.op == "call_function" and node_draws_random(n)]
                 for key, st in self.stages.items()}  # stage key -> its ops drawing random numbers, in order
        self._draws = any(draws.values())
        replayed = self._replayed(draws)
        self.program = plan_program(
            s, self.rank, self.stages, static=lambda k: k not in written and self._static(k) is not None,
            synced=self._synced_keys, sfb_writes=self._sfb_writes, final_reads=final,
            cut_at_sync=self.cut_at_sync, replayed=replayed,
            alone=self.hook.separate_groups() if self.hook is not None else frozenset())
        self._rng_modes = {}
        for start, seg in self.program.segments.items():
            unit, phase, *micro = seg.stages[0] if seg.stages else (None, None)
            if unit is not None and unit[0] in replayed:
                self._rng_modes[start] = ("save" if phase == "fwd" else "replay", (unit, tuple(micro)))
        metas = {b: {n.name: n.meta.get("val") for n in j.module.graph.nodes} for b, j in self.joints.items()}

        def meta(key: Key):
            return metas[self._replica(key[0]).batch].get(key[1])

        for seg in self.program.segments.values():
            build_module(seg, s, self.rank, self.stages,
                         static_value=lambda k: None if k in written else self._static(k),
                         meta=meta, local_rows=self._row_range, device=self.device)
            if self.compiled:
                compile_segment(seg)

    def use_schedule(self, schedule: Schedule) -> None:
        """Walk ``schedule`` from the next iteration on: the same units, micro-batches and stages
        in another order (another kFkB block size, :mod:`tag.executor.adaptive`); the program is
        built once per schedule and kept."""
        built = self._programs
        built[id(self.schedule)] = (self.schedule, self.program, self._rng_modes)
        if id(schedule) in built:
            self.schedule, self.program, self._rng_modes = built[id(schedule)]
        else:
            self.schedule = schedule
            self._build_program()

    def _replayed(self, draws: dict[tuple, list[str]]) -> frozenset[int]:
        """Recomputed op-groups of this rank whose forward draws random numbers (dropout): their
        recomputation replays the forward's draws (:meth:`run_segment`). Each recomputing stage
        must draw exactly where its forward did, in the same order (one line naming the stage
        otherwise). ``draws``: stage key -> the names of its ops drawing random numbers, in order."""
        out = set()
        for key, mine in draws.items():
            unit, phase, *micro = key
            if phase != "fwd" or unit[0] not in self.schedule.recompute or not mine:
                continue
            again = draws[(unit, "bwd", *micro)]
            if again != mine:
                raise ExecutionError(f"rank {self.rank}: the recomputation of unit {unit} draws random numbers at "
                                     f"{again}, its forward at {mine}; expected the same ops in the same order "
                                     f"(set groups[{unit[0]}].recompute to false)")
            out.add(unit[0])
        return frozenset(out)

    def _replica(self, unit: tuple):
        """This rank's replica of the unit part of an ``env`` key: on a pipeline, the unit at the
        key's micro-batch (a summed gradient's key has none: micro-batch 0, its shape has no batch)."""
        return self.schedule.unit_at(unit[:2], unit[2] if len(unit) > 2 else 0).replica_on(self.rank)

    def _static(self, key: Key) -> torch.Tensor | None:
        """The value of ``key`` if the runtime holds it for good (parameter, buffer, constant, input rows)."""
        unit, name = key
        v = self.input_rows.get(key)
        if v is not None:
            return v
        if name in self.params and self.schedule.holds(name, unit[:2]):
            return self.params[name]
        return self.state.get(name)

    def _synced_keys(self, group: int) -> list[Key]:
        """The gradients the ``sync`` step of ``group`` reads on this rank: those of its bucket's
        groups at the bucket's last group (the collective starts there), none at the others."""
        s = self.schedule
        b = s.buckets[s.bucket_of[group]]
        if b.groups[-1] != group:
            return []
        keys = (s.grad_key(ph, self.my_units) for g in b.groups for ph in self._synced(g))
        return [k for k in keys if k is not None]

    def _sfb_writes(self, group: int) -> list[Key]:
        sg = self.schedule.sfb[group]
        return [(sg.unit, k.grad_node) for k in self.kernels.get(group, ())]

    def _row_range(self, m: Move, micro: int = 0) -> tuple[int, int] | None:
        """(start, length) along ``m.batch_dim`` of the rows ``m`` (of micro-batch ``micro``) takes
        from its producer's tensor; None when it takes all of them."""
        rep = self.schedule.unit_at(m.src_unit, micro).replica_on(m.src)
        if (m.start, m.stop) == (rep.start, rep.stop):
            return None
        joint = self.joints[rep.batch]
        val = next(n for n in joint.module.graph.nodes if n.name == m.name).meta["val"]
        rows = val.shape[m.batch_dim] // rep.batch  # rows per sample along the batch dim
        return (m.start - rep.start) * rows, (m.stop - m.start) * rows

    def covers(self, index: int) -> bool:
        """Whether schedule step ``index`` runs inside one of this rank's segments."""
        return index in self.program.covered

    def segment_name(self, index: int) -> str | None:
        seg = self.program.segments.get(index)
        return None if seg is None else seg.name

    # ---- values ------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        self.env.clear()
        self.made = {}
        self._rng_saved.clear()
        self.sent_bytes = {}
        self.gathered_bytes = 0
        self.timer = Timer(cuda=self.device.type == "cuda")
        self.loss = 0.0
        if self.hook is not None:  # (a sharded rank's parameters gathered before anything is sent)
            self.hook.begin_iteration(self)

    def value(self, unit: UnitKey, name: str) -> torch.Tensor:
        v = self.env.get((unit, name))
        if v is not None:
            return v
        v = self._static((unit, name))
        if v is not None:
            return v
        raise ExecutionError(f"rank {self.rank}: unit {unit} has no value for {name!r} (schedule bug)")

    def release(self, index: int) -> None:
        """Drop the values whose last reader was step ``index`` (run outside a segment)."""
        for k in self.program.free_after.get(index, ()):
            self.env.pop(k, None)

    # ---- compute -------------------------------------------------------------------------
    def run_segment(self, index: int) -> None:
        """Run the segment starting at schedule step ``index`` (nothing at its other steps)."""
        seg = self.program.segments.get(index)
        if seg is None:
            return
        token = self.hook.before_segment(self, seg) if self.hook is not None else None  # (ZeRO-3's gathers)
        with self.timer.span("compute"), self._emulated(), torch.no_grad(), self._random_stream(index):
            seg(self.env)
        if self.hook is not None:
            self.hook.after_segment(self, token)
        if self.device.type == "cuda":  # when its values are made: a send waits for that alone
            made = torch.cuda.Event()
            made.record()
            self.made.update((k, made) for k in seg.outputs)

    def made_events(self, step: Step) -> list | None:
        """The CUDA events after which every piece this rank sends in ``step`` is made (recorded
        after the segments making them, :meth:`run_segment`), or None if one was not made by a
        segment of this iteration (a parameter, a received value) or the rank sends nothing."""
        out = []
        for m in step.moves:
            if m.src == self.rank and m.dst != self.rank:
                ev = self.made.get(value_key(self.schedule, m.src_unit, m.name, step.micro))
                if ev is None:
                    return None
                out.append(ev)
        return out or None

    @contextlib.contextmanager
    def _random_stream(self, index: int):
        """Run a segment on this rank's own random stream (from :attr:`seed`, carried from
        segment to segment: ranks sharing a process,
        :func:`tag.executor.run_virtual`, draw as separate processes would, whatever the order
        they run in; not the threads of a tensor-parallel group there, which run at once and share
        the generator). Only a rank whose stages draw random numbers does this. At the forward of a unit whose
        recomputation draws random numbers (:meth:`_replayed`), the state is saved; its
        recomputing backward runs from that state, so it draws the forward's dropout masks again
        (as ``torch.utils.checkpoint`` with ``preserve_rng_state``), and the stream goes on after
        it as if nothing had been recomputed."""
        if not self._draws:  # nothing to keep apart (and no state copied per segment)
            yield
            return
        dev = self.device
        _set_rng(self._rng, dev)
        mode, key = self._rng_modes.get(index, (None, None))
        here = None
        if mode == "save":
            self._rng_saved[key] = _get_rng(dev)
        elif mode == "replay":
            here = _get_rng(dev)
            _set_rng(self._rng_saved.pop(key), dev)
        try:
            yield
        finally:
            if here is not None:
                _set_rng(here, dev)
            self._rng = _get_rng(dev)

    @contextlib.contextmanager
    def _emulated(self):
        """``--emulate-speed``: sleep so that the block takes ``slowdown`` x its real time (waits for
        the device only then)."""
        if self.slowdown <= 1.0:
            yield
            return
        t0 = time.perf_counter()
        yield
        self._synchronize()
        time.sleep((self.slowdown - 1.0) * (time.perf_counter() - t0))

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- transfers -----------------------------------------------------------------------
    def _scattered(self, m: Move) -> bool:
        """Whether ``m`` goes as this rank's slice, all-gathered by the receiving group
        (:meth:`RankHook.scattered <tag.executor.strategies.RankHook.scattered>`)."""
        return self.hook is not None and self.hook.scattered(m.src, m.dst, m.name)

    def outgoing(self, step: Step) -> list[tuple[int, int, torch.Tensor]]:
        """(tag, destination rank, piece) for every piece this rank sends in ``step``: the piece,
        or its slice where it is scattered (:func:`scatter_slice`); counted in :attr:`sent_bytes`."""
        out = []
        for k, m in enumerate(step.moves):
            if m.src == self.rank and m.dst != self.rank:
                piece = self.piece(m, micro=step.micro)
                if self._scattered(m):
                    piece = scatter_slice(piece, self.hook.index, self.hook.degree)
                self.sent_bytes[m.dst] = self.sent_bytes.get(m.dst, 0) + piece.numel() * piece.element_size()
                out.append((k, m.dst, piece))
        return out

    def incoming_specs(self, step: Step) -> list[tuple[int, int, list[int], torch.dtype]]:
        """(tag, source rank, shape, dtype) of every piece this rank receives in ``step`` (a
        scattered piece: its slice, 1-D bytes)."""
        out = []
        for k, m in enumerate(step.moves):
            if m.dst == self.rank and m.src != self.rank:
                shape, dtype = self.piece_spec(step, m)
                if self._scattered(m):
                    shape, dtype = [slice_bytes(math.prod(shape) * dtype.itemsize, self.hook.degree)], torch.uint8
                out.append((k, m.src, shape, dtype))
        return out

    def incoming(self, step: Step) -> list[tuple[int, int, torch.Tensor]]:
        """(tag, source rank, empty buffer) for every piece this rank receives in ``step``."""
        return [(k, src, torch.empty(shape, dtype=dtype, device=self.device))
                for k, src, shape, dtype in self.incoming_specs(step)]

    def piece(self, m: Move, send: bool = True, micro: int = 0) -> torch.Tensor:
        """The part of the producer's value that ``m`` (of micro-batch ``micro``) moves: contiguous
        to be sent, else (a local hand-over) a view where it is one."""
        v = self.value(*value_key(self.schedule, m.src_unit, m.name, micro))
        if m.mode == "rows":
            rng = self._row_range(m, micro)
            if rng is not None:  # a view costs microseconds: only if needed
                v = v.narrow(m.batch_dim, *rng)
        v = v.detach() if v.requires_grad else v
        return v.contiguous() if send or m.batch_dim else v

    def _captured(self, step: Step, m: Move):
        """The traced value (``meta["val"]``) of the consumer stage's placeholder ``m`` fills
        (looked up once per stage and name: the graphs of real models have thousands of nodes)."""
        s = self.schedule
        key = (m.dst_unit, step.phase, step.micro) if s.micro_units else (m.dst_unit, step.phase)
        vals = self._placeholder_vals
        if key not in vals:
            vals[key] = {n.name: n.meta.get("val") for n in self.stages[key].module.graph.nodes if n.op == "placeholder"}
        return vals[key][m.name]

    def piece_spec(self, step: Step, m: Move) -> tuple[list[int], torch.dtype]:
        """Shape and dtype of the piece ``m`` delivers to this rank (from the stage's metadata)."""
        s = self.schedule
        val = self._captured(step, m)
        shape = list(val.shape)
        if m.mode == "rows":
            rep = s.unit_at(m.dst_unit, step.micro).replica_on(self.rank)
            rows = shape[m.batch_dim] // rep.batch
            shape[m.batch_dim] = rows * (m.stop - m.start)
        return shape, val.dtype

    def assemble(self, step: Step, received: dict[int, torch.Tensor]) -> None:
        """Combine local and received pieces into ``env[(consumer unit, name)]`` (the scattered
        ones all-gathered first, :meth:`_gather_scattered`)."""
        pieces: dict[Key, list[tuple[Move, torch.Tensor | None]]] = {}
        s, mb = self.schedule, step.micro
        scattered = [k for k, m in enumerate(step.moves) if m.dst == self.rank and m.src != self.rank
                     and self._scattered(m)]
        if scattered:
            received = {**received, **self._gather_scattered(step, scattered, received)}
        for k, m in enumerate(step.moves):
            if m.dst != self.rank:
                continue
            if m.mode == "zeros":
                piece = None
            elif m.src == self.rank:
                piece = self.piece(m, send=False, micro=mb) if m.mode == "rows" else \
                    self.value(*value_key(s, m.src_unit, m.name, mb))
            else:
                piece = received[k]
            pieces.setdefault(value_key(s, m.dst_unit, m.name, mb), []).append((m, piece))
        for key, ps in pieces.items():
            m0 = ps[0][0]
            if m0.mode == "rows":
                ps.sort(key=lambda mp: mp[0].start)
                self.env[key] = torch.cat([p for _, p in ps], dim=m0.batch_dim) if len(ps) > 1 else ps[0][1]
            elif m0.mode == "sum":
                total = ps[0][1]
                for _, p in ps[1:]:
                    total = total + p  # not in place: the first piece may be this rank's own value
                self.env[key] = total
            elif m0.mode == "zeros":
                shape, dtype = self.piece_spec(step, m0)
                self.env[key] = torch.zeros(shape, dtype=dtype, device=self.device)
            else:
                self.env[key] = ps[0][1]
            if m0.mode != "zeros" and any(m.src != self.rank or m.mode == "rows" for m, _ in ps):
                self.env[key] = in_layout(self.env[key], self._captured(step, m0))

    def _gather_scattered(self, step: Step, tags: list[int], received: dict[int, torch.Tensor]
                          ) -> dict[int, torch.Tensor]:
        """The whole pieces of the scattered moves ``tags`` of ``step``, from this rank's slices
        (``received``): one all-gather over the group (:attr:`RankHook.gather`) of their bytes
        concatenated, each member's slices then side by side; counted in :attr:`gathered_bytes`."""
        slices = [received[k].reshape(-1) for k in tags]  # bytes (scatter_slice)
        mine = torch.cat(slices) if len(slices) > 1 else slices[0]
        members = self.hook.gather(mine).view(self.hook.degree, -1)  # row i: member i's slices
        self.gathered_bytes += members.numel()
        out, off = {}, 0
        for k, part in zip(tags, slices):
            shape, dtype = self.piece_spec(step, step.moves[k])
            whole = members[:, off:off + part.numel()].reshape(-1)[:math.prod(shape) * dtype.itemsize]
            out[k] = whole.view(dtype).view(shape)
            off += part.numel()
        return out

    # ---- SFB -------------------------------------------------------------------------------
    def sfb_local(self, group: int) -> dict[str, torch.Tensor]:
        """Factor node name -> this replica's rows of it (in full-batch units), for ``group``'s SFB."""
        sg = self.schedule.sfb[group]
        return {f.name: self.value(sg.unit, f.name).detach().contiguous() for f in sg.factors}

    def sfb_recompute(self, group: int, full: dict[str, torch.Tensor]) -> None:
        """Set the SFB ops' gradients from the gathered (global-batch) factors ``full``."""
        sg = self.schedule.sfb[group]
        with self.timer.span("compute", "sfb_recompute"), self._emulated(), torch.no_grad():
            for k in self.kernels[group]:
                self.env[(sg.unit, k.grad_node)] = k({f.name: full[f.name] for f in k.candidate.factors})

    def sfb_counts(self, group: int, name: str, local: torch.Tensor) -> list[int]:
        """Rows of factor ``name`` each replica holds, in :attr:`SfbGroup.members` order."""
        sg = self.schedule.sfb[group]
        f = next(f for f in sg.factors if f.name == name)
        unit = self.schedule.units[sg.unit]
        rows = local.shape[f.batch_dim] // unit.replica_on(self.rank).batch  # rows per sample
        return [unit.replica_on(d).batch * rows for d in sg.members]

    # ---- gradients and update --------------------------------------------------------------
    def _synced(self, group: int) -> list[str]:
        s = self.schedule
        return s.sync_params[group] if group in s.sync_params else s.group_params[group]

    def bucket_flat(self, bucket: Bucket) -> torch.Tensor:
        """This rank's gradients of ``bucket``'s groups, concatenated in its order into one new
        buffer (zeros on a mere PS server), as DDP flattens a bucket.

        SFB params (their gradients are recomputed in full) are left out."""
        s = self.schedule
        parts = []
        for g in bucket.groups:
            for ph in self._synced(g):
                key = s.grad_key(ph, self.my_units)
                if key is not None:  # (a tied copy's partial sum may be fp16 / bf16: as its parameter)
                    flat = self.env[key].reshape(-1)
                    parts.append(flat if g >= 0 else flat.to(self.params[ph].dtype))
                else:
                    parts.append(torch.zeros(s.param_numel[ph], device=self.device))
        return torch.cat(parts) if parts else torch.zeros(0, device=self.device)

    def set_bucket_flat(self, bucket: Bucket, flat: torch.Tensor) -> None:
        """Replace this rank's gradients of ``bucket``'s groups by views of the summed ``flat``."""
        s = self.schedule
        off = 0
        for g in bucket.groups:
            for ph in self._synced(g):
                key = s.grad_key(ph, self.my_units)
                n = self.params[ph].numel() if ph in self.params else s.param_numel[ph]  # (a hook's rank may hold part: a tp shard 1/T)
                if key is not None:  # (a PS server outside the replica set keeps nothing)
                    self.env[key] = flat[off:off + n]
                off += n

    def update(self) -> None:
        """Apply the optimizer to every parameter this rank holds, then read the loss (this waits
        for the device: the iteration's one synchronisation) and drop the iteration's values."""
        s = self.schedule
        if self.optimizer is not None:
            with self.timer.span("update"):
                # The gradients are used in place, without a copy: with no weight decay neither
                # Adam nor SGD writes into ``grad``, and ``env`` is cleared below.
                # (each call only where needed: detach + reshape cost ~5 us a parameter on the
                # development VM, 1-4% of the zoo mlp's step; segments run under no_grad, and only a
                # bucket's flat slices differ in shape)
                for p, key in self._grad_keys:
                    g = self.env[key]
                    if g.requires_grad:
                        g = g.detach()
                    p.grad = g if g.shape == p.shape else g.reshape(p.shape)
                ok = self._unscale()
                if self.before_step is not None:
                    ok = self.before_step(ok)
                if ok:
                    self.optimizer.step()
                for p in self.params.values():
                    p.grad = None
        else:  # (a rank holding no parameter still takes part in its collectives)
            ok = self._unscale()
            if self.before_step is not None:
                self.before_step(ok)
        if s.loss_unit in self.my_units and (self.hook is None or self.hook.reports_loss):  # each micro-batch's mean over its b samples, weighted b / B
            self.loss = sum(float(self.env[(env_unit(s, s.loss_unit, m), s.loss)])
                            * s.unit_at(s.loss_unit, m).replica_on(self.rank).batch for m in self.micros) / s.batch_size
        self._synchronize()
        self.timer.resolve()
        self.env.clear()

    def _unscale(self) -> bool:
        """fp16: divide the gradients the optimizer steps (a sharded rank's: its shards') by the
        loss scale, agree with the other ranks whether all are finite, update the scale; returns
        whether to step. True without loss scaling."""
        if self.scaler is None:
            return True
        held = [] if self.optimizer is None else self.optimizer.param_groups
        ok = self.scaler.unscale([p.grad for grp in held for p in grp["params"] if p.grad is not None])
        if self.agree_finite is not None:
            ok = self.agree_finite(ok)
        self.scaler.update(ok)
        return ok

    def named_params(self) -> dict[str, torch.Tensor]:
        """State-dict name -> current value of the parameters this rank holds."""
        return {self.schedule.param_target[ph]: p.detach().cpu() for ph, p in self.params.items()}


# ---- what a rank builds once (RankRuntime.__post_init__) --------------------------------------
class RankStages(NamedTuple):
    """A rank's stages (:func:`cut_stages`)."""

    stages: dict[tuple, Stage]
    """Stage key (:func:`tag.executor.fuse.stage_key`) -> the cut of the joint graph at the unit's
    local batch on this rank (the micro-batches of one local batch share it)."""
    joints: dict[int, Joint]
    """Local batch -> the joint graph as this rank runs it (a hook's rewrite, e.g. a
    tensor-parallel shard's; the given one otherwise)."""


def cut_stages(schedule: Schedule, rank: int, micros: range, joints: dict[int, Joint], inputs: tuple,
               hook: RankHook | None, device: torch.device, scaled: bool) -> RankStages:
    """Cut the forward and backward stage of every unit ``rank`` runs from the joint graph at its
    local batch (one cut per local batch, shared by the micro-batches of that size): each joint
    graph checked against the captured one (:func:`check_structure`), rewritten by ``hook``, the
    stages moved to ``device`` and the loss unit's backward seed scaled by ``b / B`` (and by
    fp16's loss scale where ``scaled``, :func:`_scale_seed`)."""
    s = schedule
    runs: dict[int, list[tuple[UnitKey, int]]] = {}  # local batch -> (unit, micro-batch) run at it
    for u in s.units_of(rank):
        for m in micros:
            runs.setdefault(s.unit_at(u.key, m).replica_on(rank).batch, []).append((u.key, m))
    stages: dict[tuple, Stage] = {}
    out = dict(joints)
    for b, joint in joints.items():
        if b not in runs:
            continue
        keys = {k for k, _ in runs[b]}
        check_structure(s, joint, b, min(k[0] for k in keys), pipeline=bool(s.micro_units))
        if hook is not None:
            # (the analysis runs on the host, where the exported joint graph's state lives)
            rows = tuple(x[:b].cpu() if isinstance(x, torch.Tensor) else x for x in inputs)
            joint = out[b] = hook.joint(joint, rows, s.param_grad)
        assign = {n: up for n, up in s.assign.items() if up[0] in keys}
        again = [k for k in keys if k[0] in s.recompute]  # units recomputing their activations
        for (key, phase), stage in build_stages(types.SimpleNamespace(joint=joint.module), assign, again).items():
            if device.type != "cpu":
                retarget_devices(stage.module, device)
            if hook is not None:
                hook.stage(stage)
            if (key, phase) == (s.loss_unit, "bwd"):  # the loss is a mean over the stage's b samples
                _scale_seed(stage, s.loss, b / s.batch_size, SCALE_INPUT if scaled else None)
            for k, m in runs[b]:
                if k == key:
                    stages[(key, phase, m) if s.micro_units else (key, phase)] = stage
    return RankStages(stages, out)


class HeldState(NamedTuple):
    """What a rank holds for good besides its stages (:func:`load_state`)."""

    user_inputs: list[str]
    """Placeholder names of the user inputs, in call order."""
    state: dict[str, torch.Tensor]
    """Placeholder name -> buffer or constant (every placeholder that is not a parameter), on the
    rank's device; fp16's loss scale under :data:`SCALE_INPUT`."""
    params: dict[str, torch.nn.Parameter]
    """Placeholder name -> a copy of the initial value of each parameter the rank's units
    update, on the rank's device."""


def load_state(schedule: Schedule, my_units: dict, joints: dict[int, Joint], device: torch.device,
               scaler: LossScaler | None) -> HeldState:
    """The parameters of the units in ``my_units`` (a tied weight's second copy too: the same
    initial value on every rank) and the buffers and constants every placeholder reads, from any
    of ``joints`` (all hold the same values)."""
    s = schedule
    any_joint = next(iter(joints.values())) if joints else None
    state: dict[str, torch.Tensor] = {}
    user_inputs: list[str] = []
    if any_joint is not None:
        user_inputs = any_joint.user_inputs
        for ph, target in any_joint.state.items():
            if ph not in s.param_owner:
                state[ph] = any_joint.state_values[target].detach().to(device)
    if scaler is not None:  # (read by the loss unit's backward: _scale_seed)
        state[SCALE_INPUT] = scaler.scale
    params: dict[str, torch.nn.Parameter] = {}
    for ph in s.param_owner:
        if s.grad_key(ph, my_units) is not None:
            value = any_joint.state_values[s.param_target[ph]]
            params[ph] = torch.nn.Parameter(value.detach().clone().to(device))
    return HeldState(user_inputs, state, params)


def input_rows(schedule: Schedule, rank: int, my_units: dict, micros: range, user_inputs: list[str],
               inputs: tuple) -> dict[Key, torch.Tensor]:
    """``env`` key -> ``rank``'s rows of each user input for each of its units and micro-batches
    (views of the full-batch ``inputs``, whose dim 0 is the batch)."""
    out: dict[Key, torch.Tensor] = {}
    for key in my_units:
        for m in micros:
            r = schedule.unit_at(key, m).replica_on(rank)
            for name, x in zip(user_inputs, inputs):
                out[(env_unit(schedule, key, m), name)] = x[r.start:r.stop]
    return out


def prepare_sfb(schedule: Schedule, rank: int, my_units: dict, stages: dict[tuple, Stage],
                joints: dict[int, Joint], global_joint: Joint | None, device: torch.device) -> dict[int, list]:
    """Op-group -> the SFB kernels (:class:`tag.compress.SfbKernel`) of each SFB group whose unit
    ``rank`` runs, one per SFB op on the joint graph at the global batch; that unit's ``stages``
    are edited to output the factors and no longer compute the local gradients SFB replaces."""
    kernels = {}
    for sg in schedule.sfb.values():
        if sg.unit in my_units:
            if global_joint is None:
                raise ExecutionError(f"rank {rank}: group {sg.group} uses SFB but no joint graph at the global "
                                     f"batch {schedule.batch_size} was given")
            check_structure(schedule, global_joint, schedule.batch_size, sg.group, local=False)
            _sfb_stages(sg, stages, joints[my_units[sg.unit].replica_on(rank).batch])
            kernels[sg.group] = _sfb_kernels(sg, global_joint, device)
    return kernels


def _sfb_stages(sg: SfbGroup, stages: dict[tuple, Stage], joint: Joint) -> None:
    """Make ``sg``'s unit's stages output its factors, and its backward no longer compute the
    gradients SFB replaces (those only returned, not read by other ops)."""
    nodes = {n.name: n for n in joint.module.graph.nodes}
    for phase in ("fwd", "bwd"):
        stage = stages.get((sg.unit, phase))
        if stage is None:
            continue
        computed = {n.name for n in stage.module.graph.nodes if n.op == "call_function"}
        add = [f.name for f in sg.factors if f.name in computed and f.name not in stage.outputs]
        drop = set()
        if phase == "bwd":
            drop = {c.grad_node for c in sg.candidates
                    if c.grad_node in computed and all(u.op == "output" for u in nodes[c.grad_node].users)}
        if add or drop:
            _edit_outputs(stage, add, drop)


def _sfb_kernels(sg: SfbGroup, global_joint: Joint, device: torch.device) -> list:
    """One SFB kernel per candidate op of ``sg``, on the joint graph at the global batch."""
    from ..compress import SfbError, sfb_kernel

    kernels = []
    for c in sg.candidates:
        try:
            k = sfb_kernel(global_joint.module, c)
        except SfbError as e:
            raise ExecutionError(str(e)) from None
        if device.type != "cpu":
            retarget_devices(k.stage.module, device)
        kernels.append(k)
    return kernels


def compile_segment(seg) -> None:
    """Have ``seg`` (a :class:`tag.executor.fuse.Segment`) run its generated module through
    ``torch.compile`` (Inductor, static shapes: a segment always sees the same shapes), called
    with its arguments unpacked (the boxed convention clears its argument list inside, which
    compiled code would replay as a side effect)."""
    gm = seg.module
    if seg.boxed:
        gm.graph.set_codegen(torch.fx.graph.CodeGen())
        gm.recompile()
        seg.boxed = False
    seg.module = torch.compile(gm, backend="inductor", dynamic=False)


def _get_rng(device: torch.device) -> tuple:
    """The random generators' state a rank on ``device`` draws from (the CPU's, and the GPU's)."""
    cpu = torch.get_rng_state()
    return (cpu, torch.cuda.get_rng_state(device)) if device.type == "cuda" else (cpu,)


def _seeded_rng(seed: int | None, device: torch.device) -> tuple:
    """The generators' state after ``torch.manual_seed(seed)`` (the current one where ``seed`` is
    None), leaving the current state as it was."""
    if seed is None:
        return _get_rng(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return _get_rng(device)


def _set_rng(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)


def joint_structure(gm: torch.fx.GraphModule) -> list[tuple[str, str, tuple[str, ...]]]:
    """(name, target, input names) of every live op of a joint graph, in graph order: the list
    :func:`tag.parallel.schedule.graph_structure` gives for the captured graph."""
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    live: set[str] = set()
    stack = [out_node]
    while stack:
        n = stack.pop()
        if n.name not in live:
            live.add(n.name)
            stack.extend(n.all_input_nodes)
    return [(n.name, "getitem" if n.target is operator.getitem else str(n.target),
             tuple(a.name for a in n.all_input_nodes if a.op in ("placeholder", "call_function")))
            for n in gm.graph.nodes if n.op == "call_function" and n.name in live]


def check_structure(schedule: Schedule, joint: Joint, batch: int, group: int, local: bool = True,
                    pipeline: bool = False) -> None:
    """Refuse (one line) a joint graph whose ops differ from the captured graph's.

    Transformers (GPT-2, BERT, ViT) exported at batch 1 lose a few ``expand`` / copy ops, which
    renumbers the later nodes: a node name would then designate another op. Mapping the names
    between the two graphs is not done (ops vanish, so the stage cuts would differ too); a local
    batch whose export differs is refused instead.
    """
    ref = schedule.structure
    if not ref:
        return
    got = joint_structure(joint.module)
    if got == ref:
        return
    i = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    was = ref[i][0] if i < len(ref) else "<end>"
    now = got[i][0] if i < len(got) else "<end>"
    where = f"{len(got)} ops instead of {len(ref)}, node {was!r} is {now!r}"
    if not local:
        raise ExecutionError(f"the joint graph of {schedule.model} at the global batch {batch} differs from the "
                             f"captured graph ({where}); capture with the plan's batch size")
    fix = ("give each replica at least 2 samples" if batch == 1
           else f"choose shares that give no replica {batch} samples")
    if pipeline:
        fix += " (of a micro-batch: fewer micro-batches give more)"
    raise ExecutionError(f"local batch {batch} of group {group} changes the graph structure of {schedule.model} "
                         f"({where}); {fix}")


def slice_bytes(nbytes: int, degree: int) -> int:
    """Bytes of each of ``degree`` slices of a tensor of ``nbytes`` (the last padded with zero
    bytes); the simulator prices the same (:func:`tag.sim.units.shard_bytes`)."""
    return -(-nbytes // degree)


def in_layout(t: torch.Tensor, like) -> torch.Tensor:
    """``t`` with the dim order in memory of ``like`` (a traced value; ``t`` as is when ``like``
    is contiguous or the orders agree), copied where they differ. A value sent between ranks (or
    concatenated from rows) arrives contiguous, but the ops after it were traced on the
    producer's layout: a fused attention's output is ``[B, H, L, D]`` laid out as
    ``[B, L, H, D]``, and GPT-2's ``transpose(1, 2)`` then ``view(B, L, H * D)`` after it fail on
    a contiguous copy ("view size is not compatible with input tensor's size and stride": the
    ``mp-halves`` plan of ``tag validate`` on an SDPA GPT-2, 2026-11-28)."""
    if not isinstance(like, torch.Tensor) or like.dim() != t.dim() or like.is_contiguous():
        return t
    order = sorted(range(like.dim()), key=lambda d: (-like.stride(d), d))  # outermost first
    strides = torch.empty_permuted(t.shape, order, device="meta").stride()  # t's shape in like's dim order
    if all(a == b for a, b, n in zip(t.stride(), strides, t.shape) if n > 1):
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def scatter_slice(piece: torch.Tensor, index: int, degree: int) -> torch.Tensor:
    """Slice ``index`` of ``degree`` of ``piece``'s bytes, flattened (1-D ``uint8``): Megatron-LM's
    ``split_tensor_into_1d_equal_chunks`` where ``degree`` divides its element count (byte slice
    ``i`` is then element slice ``i``), padded with zero bytes to :func:`slice_bytes` where
    ``degree`` does not divide its bytes (Megatron-LM asserts it does; padding bytes, not
    elements, sends less than ``degree`` extra bytes per tensor, a size the simulator knows from
    the graph's byte sizes, 2026-11-27): the receiving group concatenates the slices in member
    order and drops the padding (:meth:`RankRuntime._gather_scattered`)."""
    flat = piece.reshape(-1).view(torch.uint8)
    n = slice_bytes(flat.numel(), degree)
    lo = min(index * n, flat.numel())
    part = flat[lo:lo + n]
    return part if part.numel() == n else torch.cat([part, part.new_zeros(n - part.numel())])


def _edit_outputs(stage: Stage, add: list[str], drop: set[str]) -> None:
    """Make ``stage`` also return the nodes ``add`` and no longer return ``drop``; the nodes that
    only fed ``drop`` are removed (not computed any more)."""
    g = stage.module.graph
    out = next(n for n in g.nodes if n.op == "output")
    by_name = dict(zip(stage.outputs, out.args[0]))
    inside = {n.name: n for n in g.nodes if n.op == "call_function"}
    names = [o for o in stage.outputs if o not in drop] + add
    out.args = (tuple(by_name[o] if o in by_name else inside[o] for o in names),)
    for n in reversed(list(g.nodes)):
        if n.op == "call_function" and not n.users:
            g.erase_node(n)
    stage.outputs = names
    alive = {n.name for n in g.nodes}
    stage.nodes = [n for n in stage.nodes if n in alive]
    stage.module.recompile()


def _scale_seed(stage: Stage, loss: str, scale: float, loss_scale: str | None = None) -> None:
    """Multiply the loss-gradient seed by ``scale`` (= b_i / B) inside the loss unit's backward,
    and with ``loss_scale`` by the stage's new last input of that name (fp16's dynamic loss scale,
    a 0-dim tensor the rank holds: :mod:`tag.executor.scaling`; a new scale needs no new program).

    Every gradient leaving that backward is linear in the seed, so this is docs/design.md's
    "scale every gradient leaving the loss unit by b_i / B", done once at the source.
    """
    g = stage.module.graph
    # (a unit recomputing its activations computes the loss again inside its backward stage)
    ph = next((n for n in g.nodes if n.op in ("placeholder", "call_function") and n.name == loss), None)
    if ph is None or not ph.users:
        raise ExecutionError(f"loss {loss!r}: the loss unit's backward does not read the loss; "
                             "cannot find the loss-gradient seed to scale")
    if scale == 1.0 and loss_scale is None:
        return
    factor = None
    if loss_scale is not None:  # (after the stage's inputs: the placeholders in the order of Stage.inputs)
        with g.inserting_after([n for n in g.nodes if n.op == "placeholder"][-1]):
            factor = g.placeholder(loss_scale)
        stage.inputs.append(loss_scale)
    for seed in list(ph.users):
        with g.inserting_after(seed):
            first = scaled = g.call_function(torch.ops.aten.mul.Tensor, (seed, factor if scale == 1.0 else scale))
        if factor is not None and scale != 1.0:
            with g.inserting_after(first):
                scaled = g.call_function(torch.ops.aten.mul.Tensor, (first, factor))
        first.meta, scaled.meta = dict(seed.meta), dict(seed.meta)
        seed.replace_all_uses_with(scaled, delete_user_cb=lambda n, f=first: n is not f)
    stage.module.recompile()


