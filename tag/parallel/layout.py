"""Megatron-style layouts: ``dp=D,tp=T,pp=P,micro=M[,schedule=S][,k=K][,sp=1][,recompute=1]`` as a TAG plan.

Users of Megatron-style trainers describe a run by its degrees: ``D`` data-parallel replicas,
``T``-way tensor parallelism, ``P`` pipeline stages, ``M`` micro-batches. :func:`layout_plan`
builds that plan so it can be simulated and compared with TAG's:

* stages cut the op-groups into ``P`` contiguous runs minimising the slowest stage's compute (a
  group costed on the stage's own devices, its slowest replica, all micro-batches: AMP's
  heterogeneity-aware cut; on one device kind, the balanced layer cuts a Megatron user makes by
  hand), :func:`balanced_cuts`;
* stage ``s`` runs on devices ``s * D * T .. (s + 1) * D * T - 1`` of the topology's order
  (machine-major: a stage fills machines before the next begins), ``D`` replicas with even
  shares, gradients all-reduced; with ``T > 1`` each replica is ``T`` consecutive devices (tensor
  parallel innermost, as Megatron places it; each group on one machine) and every op-group of
  the stage is ``tp`` (:mod:`tag.parallel.tensor_parallel`), the stage cuts falling between
  Megatron blocks; plain Megatron, or with ``sp=1`` Megatron-LM's ``--sequence-parallel``;
* ``M`` micro-batches on a registered schedule (:mod:`tag.parallel.pipeline`: ``1f1b``, the
  default, ``gpipe``, ``kfkb`` with ``k``, ...); each of
  the ``D`` replicas needs a sample per micro-batch (``M * D <= B``), its ``T`` tensor-parallel
  devices computing the same samples (Megatron-LM runs ``tp=8`` on micro-batches of one sample);
  with ``sp=1`` every device needs one (``M * D * T <= B``: token shards modelled as samples);
* ``cut=memory`` balances the stages' parameters, gradients and optimizer state instead;
  ``stages=7+6+6+5`` states the transformer layers of each stage instead, as a published
  Megatron-LM or DeepSpeed plan cuts them (:func:`stage_starts`; :func:`align_groups` finds an
  op-group count whose groups start at those layers);
* ``order=m1:0-3+m0:0-3`` states the device of each rank (stage-major, then replica, tensor
  parallel innermost) instead of the machine-major default, as a published plan placed them,
  ``dp * tp * pp`` devices of the topology, the others idle (:func:`layout_devices`);
* ``recompute=1``: Megatron-LM's ``--recompute-granularity full`` (every op-group recomputes its
  activations, ``GroupPlan.recompute``).

``D * T * P`` must equal the topology's device count, as in Megatron (with ``order``: the
devices it names).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import PlanError
from ..graph.grouping import group_ops
from ..limits import MAX_GROUPS
from ..plan.format import GroupPlan, PipelinePlan, Plan, new_plan
from .layers import layer_starts, model_layers
from .pipeline import get_schedule, spell_schedule
from .sharded import OFFLOADS
from .strategy import execution_refusal
from .tensor_parallel import MAX_DEGREE, aligned_cuts, block_groups, megatron_blocks

CUTS = ("time", "memory")
"""Stage cuts a layout may ask for (:attr:`Layout.cut`)."""


@dataclass(frozen=True)
class Layout:
    """Degrees of a Megatron-style layout (see the module docstring)."""

    dp: int = 1
    """Data-parallel replicas per stage."""
    tp: int = 1
    """Tensor-parallel degree (devices of one machine per replica)."""
    pp: int = 1
    """Pipeline stages."""
    micro: int = 1
    """Micro-batches per iteration."""
    schedule: str = "1f1b"
    """Pipeline schedule: a registered name (``1f1b``, ``gpipe``, ``kfkb``, ...)."""
    k: int = 1
    """Micro-batches per block (a schedule that reads it: ``kfkb``)."""
    sp: int = 0
    """1: tensor parallelism with sequence parallelism (``GroupPlan.sequence_parallel``); 0: plain."""
    cut: str = "time"
    """How stages are cut: ``time`` (the slowest stage's compute minimised) or ``memory`` (the
    largest stage's parameters, gradients and optimizer state minimised: what a model too large
    for its devices needs)."""
    recompute: int = 0
    """1: every op-group recomputes its activations (Megatron-LM's full recompute); 0: none."""
    vocab: int = 0
    """1: with ``tp > 1``, the op-groups before the first Megatron block and after the last
    (:func:`outside_blocks`: embedding, LM head, loss) run data parallel over the stage's devices,
    each ``1 / (dp * tp)`` of the samples, as Megatron-LM's vocabulary-parallel head and
    cross-entropy split their work over the tensor-parallel ranks (costed for runs of Megatron-LM:
    TAG's executor refuses tensor parallelism mixed with other groups where group 0 is ``tp``,
    :func:`~tag.parallel.strategy.execution_refusal`); 0: those groups are replicated on every
    tensor-parallel rank, as TAG executes them. (The published Megatron-LM runs of
    ``evaluation.external`` then deploy the embedding and the head tensor parallel, vocabulary
    split, with ``evaluation.external.vocab_parallel_plan``.)"""
    prop: int = 0
    """1: a stage's replicas get batch shares proportional to their devices' speed (the cost
    model's, :meth:`~tag.cost.CostModel.device_speeds`; a tensor-parallel replica at its slowest
    device's), as ``dp-prop`` does over all devices; 0: even shares (Megatron's)."""
    stages: tuple[int, ...] | None = None
    """Transformer layers per pipeline stage, as Megatron-LM and DeepSpeed cut by hand (text
    ``stages=7+6+6+5``): stage ``s`` holds layers ``sum(stages[:s]) .. sum(stages[:s+1]) - 1``,
    the first stage also the embedding, the last the final norm, the LM head and the loss
    (:func:`stage_starts`); ``pp`` counts, summing to the model's layer count. None: the cut of
    :attr:`cut`."""
    order: tuple[int | str, ...] | None = None
    """Topology device of each rank of the layout, in TAG's rank order (stage-major, then
    replica, tensor parallel innermost): entries a global device index, a device name
    ``machine:index``, a run ``machine:first-last`` or ``first-last`` (global indices), or a
    machine name (its devices in order); text ``order=m1:0-3+m0:0-3``. ``dp * tp * pp``
    distinct devices of the topology, the others idle (:func:`layout_devices`). None: devices
    ``0 .. dp*tp*pp - 1``, machine-major (all of the topology's)."""

    zero: int = 0
    """ZeRO stage of every op-group's data parallelism (:mod:`tag.parallel.sharded`, ``sync``
    ``zero1`` .. ``zero3``): 1 optimizer state, 2 + gradients, 3 + parameters sharded over a
    stage's ``dp`` replicas; 0: plain all-reduce. Not with ``tp > 1``."""
    shard: int = 0
    """Replicas per shard group (``GroupPlan.shard``, dividing ``dp``): fewer than ``dp`` is
    hybrid sharding (sharded within, replicated across); 0: all ``dp``. Text ``hsdp=SxR``: ZeRO-3
    with ``S``-way shard groups and ``R`` of them (``dp = S * R``)."""
    offload: str = ""
    """``optimizer``: every sharded op-group keeps its optimizer state in host memory and steps
    it on the host CPU (``GroupPlan.offload``, ZeRO-Offload; needs ``zero``, also with ``dp=1``);
    empty: none."""
    vpp: int = 1
    """Chunks (virtual stages) per pipeline stage's devices, Megatron-LM's
    ``--num-layers-per-virtual-pipeline-stage``: ``vpp > 1`` cuts the op-groups into ``pp * vpp``
    stages, stage ``j`` on the devices of stage ``j mod pp``, run by the ``interleaved`` schedule
    with ``k = vpp`` (:func:`tag.parallel.pipeline.interleaved_sequence`; ``micro`` a multiple of
    ``pp``); text ``vpp=2``, the same as ``schedule=interleaved,k=2``."""

    def __post_init__(self):
        for name in ("stages", "order"):  # (a list from the API: the layout is hashed)
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("dp", "tp", "pp", "micro", "k", "vpp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"layout: {name}: expected a positive integer, got {v!r}")
        get_schedule(self.schedule, where="layout: schedule")
        _interleave(self)
        if self.cut not in CUTS:
            raise PlanError(f"layout: cut: expected one of {list(CUTS)}, got {self.cut!r}")
        for name in ("sp", "recompute", "prop", "vocab"):
            v = getattr(self, name)
            if v not in (0, 1) or isinstance(v, bool):
                raise PlanError(f"layout: {name}: expected 0 or 1, got {v!r}")
        if self.sp and self.tp == 1:
            raise PlanError("layout: sp: sequence parallelism needs tensor parallelism; expected tp > 1 or sp=0")
        if self.tp > MAX_DEGREE:
            raise PlanError(f"layout: tp: expected a tensor-parallel degree of 1..{MAX_DEGREE}, got {self.tp}")
        if not (isinstance(self.zero, int) and not isinstance(self.zero, bool) and 0 <= self.zero <= 3):
            raise PlanError(f"layout: zero: expected a ZeRO stage 0..3, got {self.zero!r}")
        if isinstance(self.shard, bool) or not isinstance(self.shard, int) or self.shard < 0 or \
                (self.shard and self.dp % self.shard):
            raise PlanError(f"layout: shard: expected a divisor of dp={self.dp}, got {self.shard!r}")
        if self.shard and not self.zero:
            raise PlanError("layout: shard: shard groups need sharding; expected zero=1..3 (or hsdp=SxR)")
        if self.offload not in ("", *OFFLOADS):
            raise PlanError(f"layout: offload: expected one of {list(OFFLOADS)}, got {self.offload!r}")
        if self.offload and not self.zero:
            raise PlanError(f"layout: offload: offload={self.offload} offloads sharded state; expected zero=1..3 "
                            "with it")
        if self.zero and self.tp > 1:
            raise PlanError(f"layout: zero: sharded data parallelism does not compose with tensor parallelism; "
                            f"expected tp=1 or zero=0, got tp={self.tp}")
        if self.stages is not None:
            _check_stages(self)
        if self.order is not None:
            _check_order(self.order)

    @property
    def devices(self) -> int:
        """Devices the layout occupies."""
        return self.dp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """Sample ranges per stage, each needing a sample per micro-batch: the ``dp`` replicas (a
        replica's ``tp`` devices compute the same samples), or with sequence parallelism every
        device (its token shard modelled as its own samples, :mod:`tag.parallel.tensor_parallel`)."""
        return self.dp * self.tp if self.sp else self.dp


def _interleave(layout: Layout) -> None:
    """``vpp > 1`` as the ``interleaved`` schedule with ``k = vpp`` (and that schedule's ``k`` as
    ``vpp``); one-line :class:`PlanError` where the layout names another schedule, fixed stages or
    a micro-batch count that is not a multiple of ``pp``."""
    if layout.vpp > 1 and layout.schedule not in ("1f1b", "interleaved"):
        raise PlanError(f"layout: vpp: virtual stages run the interleaved 1F1B schedule; expected no "
                        f"schedule={layout.schedule} with vpp={layout.vpp}")
    if layout.schedule == "interleaved":
        if layout.vpp not in (1, layout.k) and layout.k != 1:
            raise PlanError(f"layout: vpp: {layout.vpp} chunks per device, schedule=interleaved,k={layout.k}; "
                            "expected one of them, or equal")
        object.__setattr__(layout, "vpp", max(layout.vpp, layout.k))
    if layout.vpp == 1:
        return
    object.__setattr__(layout, "schedule", "interleaved")
    object.__setattr__(layout, "k", layout.vpp)
    if layout.stages is not None:
        raise PlanError(f"layout: stages: virtual stages are cut by time; expected no stages= with vpp={layout.vpp}")
    if layout.micro % layout.pp:
        raise PlanError(f"layout: micro: interleaved stages need a multiple of pp={layout.pp} micro-batches, "
                        f"got {layout.micro}")


def _check_stages(layout: Layout) -> None:
    """One-line :class:`PlanError` unless :attr:`Layout.stages` is ``pp`` positive layer counts
    (their sum is checked against the model's layers where the graph is known)."""
    st = layout.stages
    if not isinstance(st, tuple) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in st):
        raise PlanError(f"layout: stages: expected positive layer counts (e.g. stages=7+6+6+5), got {st!r}")
    if len(st) != layout.pp:
        raise PlanError(f"layout: stages: {spell_stages(st)} is {len(st)} stages, pp is {layout.pp}; "
                        f"expected {layout.pp} layer counts")
    if layout.cut != "time":
        raise PlanError(f"layout: cut: stages={spell_stages(st)} fixes the cut; expected no cut={layout.cut}")


def _check_order(order) -> None:
    """One-line :class:`PlanError` unless :attr:`Layout.order` is a non-empty tuple of device
    indices and non-empty names (resolved against a topology by :func:`layout_devices`)."""
    if not isinstance(order, tuple) or not order:
        raise PlanError(f"layout: order: expected device indices or names (e.g. order=m1:0-3+m0:0-3), got {order!r}")
    for e in order:
        if isinstance(e, bool) or not isinstance(e, (int, str)) or (isinstance(e, int) and e < 0) or \
                (isinstance(e, str) and (not e.strip() or any(c in e for c in "+, "))):
            raise PlanError(f"layout: order: {e!r}: expected a device index, machine:index, machine:first-last, "
                            "first-last or a machine name")


def spell_stages(stages) -> str:
    """``(7, 6, 6, 5)`` -> ``"7+6+6+5"`` (the layout text's spelling)."""
    return "+".join(map(str, stages))


def parse_layout(text: str) -> Layout:
    """``"dp=4,pp=2,micro=8,schedule=1f1b"`` -> :class:`Layout` (one-line :class:`PlanError`)."""
    fields: dict[str, object] = {}
    known = Layout.__dataclass_fields__
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not key:
            raise PlanError(f"layout: {part.strip()!r}: expected key=value (e.g. dp=4,pp=2,micro=8)")
        if key not in known and key != "hsdp":
            raise PlanError(f"layout: {key}: unknown key; expected one of {[*known, 'hsdp']}")
        if key in fields:
            raise PlanError(f"layout: {key}: given twice")
        if key == "hsdp":
            fields.update(_hsdp(value, fields))
            fields[key] = value
        elif key in ("schedule", "cut", "offload"):
            fields[key] = value
        elif key == "order":
            fields[key] = tuple(e.strip() for e in value.split("+"))
        elif key == "stages":
            try:
                fields[key] = tuple(int(n) for n in value.split("+"))
            except ValueError:
                raise PlanError(f"layout: stages: expected layer counts joined by '+' (e.g. stages=7+6+6+5), "
                                f"got {value!r}") from None
        else:
            try:
                fields[key] = int(value)
            except ValueError:
                what = "0 or 1" if key in ("sp", "recompute", "prop", "vocab") else "a positive integer"
                raise PlanError(f"layout: {key}: expected {what}, got {value!r}") from None
    fields.pop("hsdp", None)
    return Layout(**fields)


def _hsdp(value: str, fields: dict) -> dict:
    """The fields of ``hsdp=SxR`` (ZeRO-3, shard groups of ``S``, ``dp = S * R``); one line naming
    the value, or a ``dp`` / ``zero`` / ``shard`` given before that disagrees."""
    s, sep, r = value.partition("x")
    if not sep or not s.isdigit() or not r.isdigit() or int(s) < 1 or int(r) < 1:
        raise PlanError(f"layout: hsdp: expected SxR (shard group size x replica groups, e.g. hsdp=8x2), got {value!r}")
    out = {"dp": int(s) * int(r), "zero": 3, "shard": int(s)}
    for k, v in out.items():
        if k in fields and fields[k] != v:
            raise PlanError(f"layout: hsdp: hsdp={value} means {k}={v}, but {k}={fields[k]} is given")
    return out


def balanced_cuts(seconds, parts: int | None = None, allowed: set[int] | None = None) -> list[int]:
    """First group of each stage of the contiguous cut minimising the slowest stage (exact, by
    dynamic programming over cut points, ``O(parts x K^2)``).

    ``seconds``: one list of per-group seconds shared by every stage, with ``parts`` stages; or
    one list per stage (``seconds[s][g]``: group ``g``'s seconds if stage ``s`` runs it; stages
    on different devices cost a group differently: AMP's heterogeneity-aware cut). Every stage
    gets at least one group; ties go to the earliest cut. ``allowed``: the groups a stage may
    start at (default any)."""
    per_stage = [list(x) for x in seconds] if parts is None else [list(seconds)] * parts
    P = len(per_stage)
    n = len(per_stage[0]) if P else 0
    if not 1 <= P <= n:
        raise PlanError(f"layout: pp: expected 1..{n} stages (one op-group at least each), got {P}")
    prefix = [np.concatenate([[0.0], np.cumsum(np.asarray(row, dtype=float))]) for row in per_stage]
    INF = float("inf")
    # best[s][j]: the slowest of stages 0..s when they cover groups [0, j); cut[s][j]: stage s's start
    best = np.full((P, n + 1), INF)
    cut = np.zeros((P, n + 1), dtype=np.int64)
    best[0, 1:n - P + 2] = prefix[0][1:n - P + 2]
    ok = np.ones(n + 1, dtype=bool) if allowed is None else np.isin(np.arange(n + 1), sorted(allowed))
    for s in range(1, P):
        ps = prefix[s]
        ends = np.arange(s + 1, n - (P - 1 - s) + 1)  # where stages 0..s end
        starts = np.arange(s, ends[-1])  # where stage s may start
        # [ends, starts]: the slowest of the stages before and of stage s itself, if stage s starts before it ends
        v = np.maximum(best[s - 1, starts][None, :], ps[ends][:, None] - ps[starts][None, :])
        v[(starts[None, :] >= ends[:, None]) | ~ok[starts][None, :]] = INF
        i = np.argmin(v, axis=1)  # the first minimum: ties go to the earliest cut
        low = v[np.arange(len(ends)), i]
        best[s, ends] = low
        cut[s, ends] = np.where(low < INF, starts[i], s)
    if best[P - 1][n] == INF:
        raise PlanError(f"layout: pp: no cut of the op-groups into {P} stages between Megatron blocks; "
                        "expected fewer stages or more op-groups")
    cuts, j = [], n
    for s in range(P - 1, 0, -1):
        j = int(cut[s][j])
        cuts.append(j)
    return [0] + cuts[::-1]


def check_devices(layout: Layout, topology) -> None:
    """One-line :class:`PlanError` unless the layout occupies exactly the topology's devices."""
    n = topology.num_devices
    if layout.devices != n:
        raise PlanError(f"layout: dp*tp*pp = {layout.dp}*{layout.tp}*{layout.pp} = {layout.devices} devices, "
                        f"but topology {topology.name!r} has {n}; expected a product of {n}")


def layout_devices(layout: Layout, topology) -> list[int]:
    """Topology device of each rank of ``layout`` (TAG's rank order: stage-major, then replica,
    tensor parallel innermost): :attr:`Layout.order` resolved, or without it devices
    ``0 .. n - 1`` of a topology of exactly ``n = dp*tp*pp`` devices. One-line
    :class:`PlanError` naming an unknown machine or device, a device given twice, or a count
    other than ``dp*tp*pp``."""
    if layout.order is None:
        check_devices(layout, topology)
        return list(range(layout.devices))
    devs = [d for entry in layout.order for d in _order_entry(entry, topology)]
    seen: set[int] = set()
    for d in devs:
        if d in seen:
            raise PlanError(f"layout: order: device {topology.devices[d].name} (index {d}) given twice; "
                            "expected distinct devices")
        seen.add(d)
    if len(devs) != layout.devices:
        raise PlanError(f"layout: order: names {len(devs)} devices, dp*tp*pp = {layout.dp}*{layout.tp}*{layout.pp} "
                        f"= {layout.devices}; expected {layout.devices}")
    return devs


def _order_entry(entry: int | str, topology) -> list[int]:
    """Devices of one entry of :attr:`Layout.order` (a machine name before a number: a machine
    may be called ``0``)."""
    machines = [m.name for m in topology.machines]
    if isinstance(entry, str) and entry in machines:
        return topology.devices_of_machine(topology.machine_index(entry))
    name, sep, run = entry.rpartition(":") if isinstance(entry, str) else ("", "", str(entry))
    if (sep and name not in machines) or not (sep or run[:1].isdigit()):
        raise PlanError(f"layout: order: {entry!r}: no machine {name or run!r} in topology {topology.name!r}; "
                        f"expected one of {', '.join(machines[:8])}{', ...' if len(machines) > 8 else ''}")
    pool = topology.devices_of_machine(topology.machine_index(name)) if sep else list(range(topology.num_devices))
    first, dash, last = run.partition("-")
    try:
        a, b = int(first), int(last if dash else first)
    except ValueError:
        a, b = -1, -1
    if not 0 <= a <= b < len(pool):
        where = f"machine {name!r} has {len(pool)} devices" if sep else f"topology {topology.name!r} has {len(pool)}"
        raise PlanError(f"layout: order: {entry!r}: expected a device index, machine:index, machine:first-last, "
                        f"first-last or a machine name, indices from 0 ({where})")
    return pool[a:b + 1]


def spell_order(devices: list[int], topology) -> str:
    """Devices as the layout text spells them: runs of consecutive devices of one machine,
    ``m1:0-3+m0:0-3`` (:func:`parse_layout` reads it back)."""
    runs: list[list] = []  # [machine name, first local index, last local index]
    for d in devices:
        dev = topology.devices[d]
        if runs and runs[-1][0] == dev.machine and dev.local_index == runs[-1][2] + 1:
            runs[-1][2] = dev.local_index
        else:
            runs.append([dev.machine, dev.local_index, dev.local_index])
    return "+".join(f"{m}:{a}" if a == b else f"{m}:{a}-{b}" for m, a, b in runs)


def stage_starts(graph, layout: Layout) -> list[int]:
    """First op-group of each stage of :attr:`Layout.stages`: where its first layer begins
    (:mod:`tag.parallel.layers`). One-line :class:`PlanError` when the counts do not sum to the
    model's layers, or a stage's first layer begins inside an op-group (with ``tp > 1``: inside
    a Megatron block's groups), naming a group count whose groups start there.

    Why a group count and not a grouping cut at the layers: a plan names op-groups, and
    ``tag execute`` (like ``tag simulate --plan``) rebuilds the graph's grouping from the plan's
    group count alone (:func:`tag.graph.grouping.group_ops`, checked by the graph signature).
    :func:`align_groups` finds the count whose grouping starts a group at every stage's first
    layer, so the stages hold exactly the stated layers, and the plan saved from it runs as it
    was costed."""
    layers = model_layers(graph)
    n, st = len(layers), layout.stages
    if not n:
        raise PlanError(f"layout: stages: model {graph.model!r} has no numbered layers (parameter paths like "
                        "h.0.); expected no stages")
    if sum(st) != n:
        raise PlanError(f"layout: stages: {spell_stages(st)} = {sum(st)} layers, model {graph.model!r} has {n} "
                        f"({layers.name(0)} .. {layers.name(n - 1)}); expected counts summing to {n}")
    starts = _stage_groups(graph, layout, layers)
    bad = next((s for s, g in enumerate(starts) if g is None), None)
    if bad is None:
        return starts
    first = sum(st[:bad])
    trial = copy.deepcopy(graph)
    try:
        hint = f"expected --groups {align_groups(trial, layout)} (or tag.align_groups: op-groups that start at " \
            "every stage's first layer)"
    except PlanError:
        hint = "expected other stages (no op-group count up to twice this one starts at all of them)"
    raise PlanError(f"layout: stages: stage {bad}'s first layer ({layers.name(first)}) begins inside one of "
                    f"the {graph.num_groups} op-groups{' (or splits a Megatron block)' if layout.tp > 1 else ''}; {hint}")


def _stage_groups(graph, layout: Layout, layers) -> list[int | None]:
    """First op-group of each stage of :attr:`Layout.stages`, None where it falls inside a group
    (or, ``tp > 1``, inside a Megatron block's groups)."""
    starts = layer_starts(graph, layers)
    allowed = aligned_cuts(graph) if layout.tp > 1 else None
    out: list[int | None] = [0]
    for first in np.cumsum(layout.stages)[:-1].tolist():
        g = starts[first]
        out.append(g if g is not None and (allowed is None or g in allowed) else None)
    return out


def align_groups(graph, layout: Layout, near: int | None = None) -> int:
    """Regroup ``graph`` in place (:func:`tag.graph.grouping.group_ops`) into the op-group count
    nearest ``near`` (default its own; from 1 to ``2 * near``, the smaller on a tie) whose groups
    start at every stage's first layer of :attr:`Layout.stages` (:func:`stage_starts`); return
    that count. Call it before anything costs or simulates the graph (they keep per-group
    figures). One-line :class:`PlanError` when no count does (the graph then regrouped into
    ``near``) or the counts do not sum to the model's layers."""
    near = graph.num_groups if near is None else near
    layers = model_layers(graph)
    if not layers or sum(layout.stages) != len(layers):
        return len(stage_starts(graph, layout))  # (raises the error that names why)
    for k in sorted(range(max(1, layout.pp), min(2 * near, MAX_GROUPS) + 1), key=lambda k: (abs(k - near), k)):
        group_ops(graph, k)
        if graph.num_groups == k and None not in _stage_groups(graph, layout, layers):
            return k
    group_ops(graph, near)
    raise PlanError(f"layout: stages: no grouping of 1..{min(2 * near, MAX_GROUPS)} op-groups starts a group at "
                    f"every stage's first layer of {spell_stages(layout.stages)}; expected other stages")


def stage_table(graph, plan: Plan) -> list[dict]:
    """What each pipeline stage of ``plan`` holds (one stage without a pipeline): ``groups``
    (first and last op-group), ``layers`` (first and last of the layers whose forward ops all
    lie in the stage, :mod:`tag.parallel.layers`; None if none does) and ``devices`` (its
    first group's)."""
    bounds = (plan.pipeline.stages if plan.pipeline else [0]) + [len(plan.groups)]
    layers = model_layers(graph)
    out = []
    for a, b in zip(bounds, bounds[1:]):
        inside = [i for i, ops in enumerate(layers.ops) if all(a <= graph.ops[o].group < b for o in ops)]
        out.append({"groups": [a, b - 1], "layers": [inside[0], inside[-1]] if inside else None,
                    "devices": list(plan.groups[a].devices)})
    return out


def layout_plan(graph, topology, layout: Layout, costs, *, template: Plan | None = None) -> Plan:
    """The plan of ``layout`` for ``graph`` on ``topology`` (module docstring); ``costs``: the
    :class:`~tag.cost.CostModel` that balances the stages. ``template``: a plan of this layer for
    the same graph and topology whose identity fields are copied (the grid builds hundreds)."""
    ranks = layout_devices(layout, topology)
    width = layout.dp * layout.tp
    replicas = layout.replicas
    if layout.micro > graph.batch_size or replicas > graph.batch_size // layout.micro:
        over = f"dp*tp = {replicas} token shards" if layout.sp else f"dp = {replicas} replicas"
        raise PlanError(f"layout: micro: {layout.micro} micro-batches over {over} need at least "
                        f"{layout.micro * replicas} samples, batch is {graph.batch_size}")
    if layout.tp > 1 and not megatron_blocks(graph):
        raise PlanError(f"layout: tp: model {graph.model!r} has no Megatron block (column- then row-parallel "
                        "matmuls) to split; expected tp=1")
    k = graph.num_groups
    stage_devices = [ranks[s * width:(s + 1) * width] for s in range(layout.pp)] * layout.vpp  # (virtual: round robin)
    if len(stage_devices) > k:
        raise PlanError(f"layout: vpp: {len(stage_devices)} stages of {k} op-groups; expected fewer stages or "
                        "more op-groups (--groups)")
    stages = stage_starts(graph, layout) if layout.stages is not None else \
        _stage_cuts(graph, layout, costs, stage_devices)
    bounds = stages + [k]
    groups: list[GroupPlan] = []
    tp = dict(sync="tp", tp=layout.tp, sequence_parallel=bool(layout.sp)) if layout.tp > 1 else {}
    if layout.zero and (layout.dp > 1 or layout.offload):  # (one replica per stage: nothing to shard, unless offloaded)
        tp = dict(sync=f"zero{layout.zero}", shard=layout.shard if layout.shard not in (0, layout.dp) else None,
                  offload=layout.offload or None)
    speeds = costs.device_speeds() if layout.prop else None
    outer = outside_blocks(graph) if layout.tp > 1 and layout.vocab and not layout.sp else frozenset()
    for s, devs in enumerate(stage_devices):
        shares = _shares(devs, layout.tp if layout.tp > 1 and not layout.sp else 1, speeds)
        groups += [GroupPlan(devs, list(shares), recompute=bool(layout.recompute), **({} if g in outer else tp))
                   for g in range(bounds[s], bounds[s + 1])]
    if template is None:
        plan = new_plan(graph, topology, groups, searcher="layout", layout=_spell(layout, ranks, topology))
    else:
        plan = copy.copy(template)
        plan.groups, plan.predicted_iteration_time_s = groups, None
        plan.meta = {"searcher": "layout", "layout": _spell(layout, ranks, topology)}
    plan.pipeline = PipelinePlan(stages, layout.micro, layout.schedule, layout.k) \
        if layout.pp > 1 or layout.micro > 1 else None
    return plan


def outside_blocks(graph) -> frozenset[int]:
    """Op-groups before the first Megatron block's and after the last one's (the embedding; the
    final norm, LM head and loss): in a tensor-parallel layout they run data parallel over the
    stage's devices, each device ``1 / (dp * tp)`` of the samples with the whole weight, as
    Megatron-LM splits their work over the tensor-parallel ranks (a vocabulary-parallel head and
    cross-entropy: ``1 / tp`` of the vocabulary each), where a replicated group would compute the
    whole replica's head on every rank (``tp`` times the work; GPT-2 with 50257 tokens at hidden
    1536: 40% of a 4-layer model's FLOPs). The weight is held whole on every device and its
    gradient all-reduced with the stage's data-parallel gradients."""
    blocks = megatron_blocks(graph)
    if not blocks:
        return frozenset()
    spans = [block_groups(graph, b) for b in blocks]
    first, last = min(s[0] for s in spans), max(s[-1] for s in spans)
    return frozenset(g for g in range(graph.num_groups) if g < first or g > last)


def _shares(devs: list[int], width: int, speeds) -> list[float]:
    """Batch shares of a stage's devices: even, or (``speeds``: per device of the topology)
    proportional to each run of ``width`` devices' slowest (a tensor-parallel replica holds one
    sample range: its devices' shares sum to its share, split evenly)."""
    if speeds is None:
        return [1.0 / len(devs)] * len(devs)
    runs = [min(speeds[d] for d in devs[i:i + width]) for i in range(0, len(devs), width)]
    total = float(sum(runs))
    return [r / total / width for r in runs for _ in range(width)]


_CUTS: dict[tuple, tuple[object, object, list[int]]] = {}
"""(graph, cost model, degrees, micro-batches, cut kind) -> the stages' first groups: layouts that
differ in the schedule, sequence parallelism, recomputation or shares share their cut."""


def _stage_cuts(graph, layout: Layout, costs, stage_devices: list[list[int]]) -> list[int]:
    """First group of each stage (the module docstring's cut, by time or by memory; cached)."""
    key = (id(graph), id(costs), tuple(map(tuple, stage_devices)), layout.tp, layout.micro, layout.cut)
    hit = _CUTS.get(key)
    if hit is not None and hit[0] is graph and hit[1] is costs:
        return list(hit[2])
    k = graph.num_groups
    allowed = aligned_cuts(graph) if layout.tp > 1 else None
    if layout.cut == "memory":  # bytes held for good per group, the same on every stage
        held = [0.0] * k
        for p in graph.params:
            held[p.group] += 2 * p.nbytes + p.opt_state_bytes
        stages = balanced_cuts(held, layout.pp, allowed)
    else:  # a device costed at ceil(B / (micro * dp * tp)) samples per micro-batch (a tp device computes
        # 1/tp of its replica's B / (micro * dp) samples in the blocks; at least one: a balancing proxy);
        # per group, the stage's slowest device, all micro-batches (one device per cost table: the same seconds)
        b = -(-graph.batch_size // (layout.micro * layout.dp * layout.tp))
        rows = []
        for devs in stage_devices:
            tabs = list({id(costs.table(d)): costs.table(d) for d in devs}.values())
            rows.append((layout.micro * np.max([(t[:, 0, b] + t[:, 1, b]) + t[:, 2, b] / layout.micro
                                                for t in tabs], axis=0)).tolist())
        stages = balanced_cuts(rows, allowed=allowed)
    if len(_CUTS) > 4096:
        _CUTS.clear()
    _CUTS[key] = (graph, costs, stages)
    return list(stages)


def _spell(layout: Layout, ranks: list[int], topology) -> str:
    """The layout's text (:func:`parse_layout` reads it back), its order resolved to device names."""
    text = f"dp={layout.dp},tp={layout.tp},pp={layout.pp},micro={layout.micro},schedule="
    return text + spell_schedule(layout.schedule, layout.k) + (",sp=1" if layout.sp else "") + \
        (f",cut={layout.cut}" if layout.cut != "time" else "") + (",recompute=1" if layout.recompute else "") + \
        (",prop=1" if layout.prop else "") + (",vocab=1" if layout.vocab else "") + \
        (f",stages={spell_stages(layout.stages)}" if layout.stages is not None else "") + \
        (f",order={spell_order(ranks, topology)}" if layout.order is not None else "") + \
        (f",zero={layout.zero}" if layout.zero else "") + (f",shard={layout.shard}" if layout.shard else "") + \
        (f",offload={layout.offload}" if layout.offload else "")


MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
"""Micro-batch counts the layout grid and the searches' pipeline decision offer (as Megatron users
do: powers of two), where every replica gets a sample: 64 is Megatron-LM's micro-batch of one
sample on ``dp=8,tp=8`` over a batch of 512, and the only way llama-7b (bf16, batch 64) fits
``mixed-a100-v100`` (``dp=1,tp=2,pp=4,micro=64``; before 2026-11-27 the search stopped at 32 and
found no plan that fits, only the grid did)."""


def tp_degrees(graph, topology) -> list[int]:
    """Tensor-parallel degrees a layout may use: 1, and each of 2, 4, 8 dividing every machine's
    device count (so that consecutive groups of ``T`` devices stay on one machine) and every
    Megatron block's split features and heads."""
    blocks = megatron_blocks(graph)
    sizes = [len(topology.devices_of_machine(m)) for m in range(topology.num_machines)]
    return [1] + [t for t in (2, 4, 8) if t <= MAX_DEGREE and blocks and all(s % t == 0 for s in sizes)
                  and all(b.features % t == 0 and (b.heads is None or b.heads % t == 0) for b in blocks)]


def layout_grid(graph, topology, *, sharded: bool = True) -> list[Layout]:
    """Every layout a Megatron/AMP user would search by hand on ``topology``: ``dp * tp * pp`` =
    the device count, ``tp`` of :func:`tp_degrees`, ``pp`` up to the op-group count (stage cuts
    between Megatron blocks when ``tp > 1``), 1F1B with each micro-batch count of
    :data:`MICRO_BATCHES` that gives every replica a sample (one micro-batch without a pipeline),
    and interleaved 1F1B with two chunks per device (``vpp=2``, stages cut by time) where the
    micro-batches are a multiple of ``pp``,
    stages cut by time and by memory, tensor parallelism with and without sequence parallelism,
    each without and with full activation recomputation; then (``sharded``) :func:`sharded_layouts`
    and :func:`offload_layouts`."""
    n, out = topology.num_devices, []
    aligned = len(aligned_cuts(graph))
    for tp in tp_degrees(graph, topology):
        for pp in range(1, min(n, graph.num_groups if tp == 1 else aligned) + 1):
            if n % (pp * tp):
                continue
            dp = n // (pp * tp)
            for micro in MICRO_BATCHES if pp > 1 else (1,):
                for sp in (0, 1) if tp > 1 else (0,):
                    lay = [Layout(dp=dp, tp=tp, pp=pp, micro=micro, cut=c, sp=sp, recompute=rc)
                           for c in (CUTS if pp > 1 else CUTS[:1]) for rc in (0, 1)]
                    if pp > 1 and micro % pp == 0 and 2 * pp <= (graph.num_groups if tp == 1 else aligned):
                        lay += [Layout(dp=dp, tp=tp, pp=pp, micro=micro, sp=sp, recompute=rc, vpp=2) for rc in (0, 1)]
                    if micro * lay[0].replicas <= graph.batch_size:
                        out += lay
    return out + (sharded_layouts(graph, topology) + offload_layouts(graph, topology) if sharded else [])


def sharded_layouts(graph, topology) -> list[Layout]:
    """The sharded data-parallel layouts of the grid (:attr:`Layout.zero`), at most 8: data
    parallel over every device (``dp`` = the device count, at least 2 and at most the batch) with
    ZeRO-1, ZeRO-2 and ZeRO-3, and hybrid ZeRO-3 (``hsdp=SxR``) with ``S`` the largest device count
    dividing every machine's (a shard group inside a machine, replicated across them) where the
    devices span machines (``1 < S < dp``), each without and with full recomputation. Not with
    ``tp > 1`` (sharding does not compose with it) nor in pipelines: there the search's ``zero3``
    actions cover sharded stages (and :func:`offload_layouts` offloaded ones)."""
    n = topology.num_devices
    if n < 2 or n > graph.batch_size:
        return []
    per_machine = math.gcd(*(len(topology.devices_of_machine(m)) for m in range(topology.num_machines)))
    kinds = [dict(zero=z) for z in (1, 2, 3)] + ([dict(zero=3, shard=per_machine)] if 1 < per_machine < n else [])
    return [Layout(dp=n, recompute=rc, **kw) for kw in kinds for rc in (0, 1)]


def offload_layouts(graph, topology) -> list[Layout]:
    """The grid's optimizer-offload layouts (:attr:`Layout.offload` ``optimizer``, ZeRO-Offload):
    each data x pipeline shape of the grid without tensor parallelism (``dp * pp`` = the device
    count, ``pp`` up to the op-group count, 1F1B at each micro-batch count of
    :data:`MICRO_BATCHES` that gives every replica a sample, stages cut by time), its op-groups
    sharded over a stage's replicas with ZeRO-3 (one replica a stage: ZeRO-2, the same state held
    without the gathers), without and with full recomputation. A model whose training state no
    GPU set holds fits so (a 13B model on 4 x 24 GB, ``evaluation/results/offload``); the branch
    and bound's second bound (:func:`tag.sim.bounds.plan_bound`: the host step in the optimizer's
    seconds) prunes them where a plan without offload is faster; with ``executable``,
    :func:`search_layouts` keeps those :func:`tag.parallel.execution_refusal` accepts, as for
    every layout. No cut by memory nor ZeRO-2 over several replicas: 42 layouts instead of 164 on
    512 GPUs (llama-7b bf16 batch 512 on ``h100-512gpu-8nic``, 48 op-groups: the planner's grid took
    8.5 s without offload layouts, 15.5 s with the 164, 13.2 s with these 42; 2026-11-29);
    a pipeline that nearly fits gets its stage boundaries moved by the planner
    (:func:`tag.search.layouts.rebalance`)."""
    n, out = topology.num_devices, []
    for pp in range(1, min(n, graph.num_groups) + 1):
        if n % pp:
            continue
        dp = n // pp
        for micro in MICRO_BATCHES if pp > 1 else (1,):
            if micro * dp > graph.batch_size:
                continue
            out += [Layout(dp=dp, pp=pp, micro=micro, zero=3 if dp > 1 else 2, offload="optimizer", recompute=rc)
                    for rc in (0, 1)]
    return out


@dataclass
class GridSearch:
    """What :func:`search_layouts` found."""

    best: Plan | None
    """The fastest layout's plan (one that fits if any does; ``predicted_iteration_time_s`` None
    if it does not), or None when every layout is bounded out by ``incumbent``."""
    ranked: list[tuple[Plan, object]]
    """Every simulated layout's plan and :class:`~tag.sim.SimResult`, fastest first (those that
    fit before those that do not)."""
    layouts: int
    """Layouts of the grid (those the executor runs, with ``executable``)."""
    simulated: int
    """Layouts simulated; the others were bounded out (they cannot fit or cannot be faster)."""
    bounded: int
    """Second (costlier) bounds computed."""
    cut: bool = False
    """True when the deadline stopped the search before the bounds did (``best`` is then the
    fastest of the layouts simulated, not necessarily the grid's)."""
    shared: int = 0
    """Layouts of ``simulated`` whose plan is an earlier layout's (stages cut by memory where the
    time cut is the same): that layout's bounds and simulation reused, not computed again."""
    unfit: list[tuple[Plan, object]] = field(default_factory=list)
    """Pipeline layouts not simulated, a bound of which shows they cannot fit, with that bound (the
    planner moves the stage boundaries of the fastest that nearly fit:
    :func:`tag.search.layouts.rebalance`)."""


def search_layouts(graph, topology, costs, simulate, *, executable: bool = False, bounds=(),
                   incumbent: float | None = None, deadline: float = math.inf, sharded: bool = True) -> GridSearch:
    """The fastest plan of :func:`layout_grid` by branch and bound: the same plan as simulating
    every layout (ties to the first in grid order), fewer simulated.

    ``simulate(plan)`` returns its :class:`~tag.sim.SimResult` (passed in: this layer does not
    import the simulator). ``bounds``: functions of a plan returning lower bounds of its
    simulation (``.time_s``: seconds it takes at least; ``.oom``: True if it cannot fit;
    :mod:`tag.sim.bounds`), cheapest first. Layouts are taken in the order of the first bound
    (those that may fit first, then by time); a layout is simulated unless its bounds show it
    cannot beat the best simulated so far (out of memory when one fits, or not faster), and the
    search stops at the first layout whose first bound cannot. A layout whose plan is an earlier
    layout's (:attr:`GridSearch.shared`) takes that layout's bounds and simulation. Without ``bounds`` every layout is
    simulated. ``incumbent``: seconds of a plan that fits found elsewhere: only layouts strictly
    faster matter (``best`` None if none is). ``executable``: only the layouts the executor runs
    (:func:`tag.parallel.execution_refusal`: no sequence parallelism).
    ``deadline``: a :func:`time.perf_counter` time after which no further layout is simulated (at
    least one is; :attr:`GridSearch.cut` says it stopped early). ``sharded``: False leaves out the
    grid's sharded layouts (the dp x tp x pp grid alone)."""
    plans, template = [], None
    # a layout whose plan is an earlier one's: they differ in the cut kind only and the cuts agree
    # (layout_plan reads the kind for the cuts alone), so bounds and simulation are the same
    twin_of: dict[int, int] = {}
    first_of: dict[tuple, int] = {}
    for lay in layout_grid(graph, topology, sharded=sharded):
        plan = layout_plan(graph, topology, lay, costs, template=template)
        template = template or plan
        if executable and execution_refusal(plan) is not None:
            continue
        i = first_of.setdefault((replace(lay, cut=CUTS[0]), plan.pipeline and tuple(plan.pipeline.stages)), len(plans))
        if i != len(plans):
            twin_of[len(plans)] = i
        plans.append(plan)
    if not plans:
        raise PlanError(f"layout: no layout of {topology.num_devices} devices fits batch {graph.batch_size}")
    # (oom, seconds, grid index): the order layouts are compared in (the full grid's, ties to the first)
    inc = None if incumbent is None else (False, incumbent, -1)
    ranked: list[tuple[tuple, Plan, object]] = []
    bounded, cut, shared = 0, False, 0
    done: dict[int, object] = {}  # layout index -> its simulation
    later: dict[tuple[int, int], object] = {}  # (layout index, bound index) -> that bound
    unfit: dict[int, object] = {}  # layout index -> a bound showing it cannot fit
    if bounds:
        first = [None] * len(plans)
        for i, p in enumerate(plans):
            first[i] = first[twin_of[i]] if i in twin_of else bounds[0](p)
        order = sorted(range(len(plans)), key=lambda i: (first[i].oom, first[i].time_s, i))
    else:
        first, order = None, range(len(plans))
    for i in order:
        if ranked and time.perf_counter() >= deadline:
            cut = True
            break
        j = twin_of.get(i, i)  # (ahead of i in the order: same bounds, smaller index)
        if first is not None:
            low = (bool(first[i].oom), first[i].time_s, i)  # no more than the layout's own key
            if inc is not None and low > inc:
                break  # nor any layout after it
            for x, more in enumerate(bounds[1:]):
                b = later.get((j, x))
                if b is None:
                    b = later[(j, x)] = more(plans[i])
                    bounded += 1
                low = (low[0] or bool(b.oom), max(low[1], b.time_s), i)
                if b.oom:
                    unfit.setdefault(i, b)
                if inc is not None and low > inc:
                    break
            if inc is not None and low > inc:
                continue
        res = done.get(j)
        if res is None:
            res = done[i] = simulate(plans[i])
        else:
            shared += 1
        key = (bool(res.oom), res.iteration_time_s, i)
        ranked.append((key, plans[i], res))
        if inc is None or key < inc:
            inc = key
    ranked.sort(key=lambda x: x[0])
    best = None
    if ranked and (incumbent is None or ranked[0][0] < (False, incumbent, -1)):
        key, best, _ = ranked[0]
        best.predicted_iteration_time_s = None if key[0] else key[1]  # None: out of memory
        best.meta["searcher"] = "dp-tp-pp-grid"
    if first is not None:  # (the first bound's verdict where no later bound gave one)
        for i in range(len(plans)):
            if first[i].oom:
                unfit.setdefault(i, first[i])
    unfit_list = [(plans[i], b) for i, b in sorted(unfit.items())
                  if plans[i].pipeline is not None and i not in done and twin_of.get(i, i) not in done]
    return GridSearch(best, [(p, r) for _, p, r in ranked], len(plans), len(ranked), bounded, cut, shared,
                      unfit_list)


def best_layout(graph, topology, costs, simulate, *, executable: bool = False, bounds=()) -> tuple[Plan, int]:
    """The fastest plan of :func:`layout_grid` (one that fits in memory if any does; its
    ``predicted_iteration_time_s`` is None if none does) and the number of layouts simulated:
    :func:`search_layouts` (``bounds``: what it prunes with; none: every layout simulated)."""
    found = search_layouts(graph, topology, costs, simulate, executable=executable, bounds=bounds)
    return found.best, found.simulated
