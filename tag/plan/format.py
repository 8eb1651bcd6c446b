"""The plan: how every op-group of a graph is deployed on a topology. Versioned JSON.

Per op-group (see :class:`GroupPlan`):

What each ``sync`` value means is defined by the strategy registered under that name
(:mod:`tag.parallel`); the built-in ones:

* ``allreduce`` / ``ps``: data parallel. Every device in ``devices`` holds a replica and runs
  the group on its ``shares`` of the global batch (uneven shares allowed); gradients of the
  group's parameters are summed by ring / hierarchical all-reduce, or by a parameter server
  (``server``: reduce to it, broadcast back).
* ``mp``: model parallel. The group's forward program positions are split into contiguous
  chunks, chunk ``j`` (positions ``mp_splits[j] .. mp_splits[j+1]-1``) running on
  ``devices[j]`` on the full batch. Its backward ops follow their forward anchor; its
  parameters live on one device each; no gradient synchronisation.
* ``tp``: tensor parallel (Megatron-style), ``devices`` in groups of ``tp`` devices of one
  machine (:mod:`tag.parallel.tensor_parallel`); ``sequence_parallel`` picks Megatron-LM's
  sequence-parallel variant (default: plain Megatron, what the executor runs).
* ``sfb``: names of weight-gradient ops whose gradient is obtained by Sufficient Factor
  Broadcasting instead of all-reduce (see :mod:`tag.compress`).
* ``recompute``: activation recomputation (Megatron-LM's full recompute, ``torch.utils.checkpoint``)
  of every unit of the group: its forward keeps only the unit's inputs (the tensors entering it
  from other units or the batch) instead of the values its backward reads; right before its
  backward the unit re-runs its forward from those inputs. Omitted from the file when false.

Semantics shared by the simulator and the executor: the global batch is split into integer
sample counts with :func:`local_batches`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import PlanError
from ..io import read_json, write_atomic
from ..limits import MAX_BATCH, MAX_GROUPS

PLAN_VERSION = 1
Sync = str
"""Name of a deployment strategy registered in :mod:`tag.parallel` (``allreduce``, ``ps``, ``mp``)."""


@dataclass
class GroupPlan:
    """Deployment of one op-group."""

    devices: list[int]
    """Global device indices (topology order) holding a replica / a model-parallel chunk."""
    shares: list[float]
    """Fraction of the global batch per device (sum 1). ``mp``: the full batch, ``[1.0, ...]``.
    ``tp``: the devices of a tensor-parallel group have equal shares; plain Megatron's group holds
    their sum as one sample range computed by all of them (:meth:`tag.parallel.Strategy.replica_shares`)."""
    sync: Sync = "allreduce"
    """Deployment strategy (:mod:`tag.parallel`): ``allreduce``, ``ps`` or ``mp`` (model-parallel split)."""
    server: int | None = None
    """Parameter-server device (``ps`` only); any device of the topology."""
    mp_splits: list[int] | None = None
    """``mp`` only: first forward position of each device's chunk (absolute, increasing)."""
    sfb: list[str] = field(default_factory=list)
    """Weight-gradient op names synchronised by Sufficient Factor Broadcasting."""
    tp: int | None = None
    """``tp`` only: devices per tensor-parallel group (consecutive devices; default all of them);
    omitted from the file when unset."""
    sequence_parallel: bool = False
    """``tp`` only: the sequence-parallel variant (ops outside the Megatron blocks on ``1 / tp`` of
    the tensor-parallel group's samples, all-gather / reduce-scatter at the blocks' edges) instead
    of plain Megatron (every device of a tensor-parallel group runs the group's whole batch outside
    the blocks); omitted from the file when false (:mod:`tag.parallel.tensor_parallel`)."""
    recompute: bool = False
    """Activation recomputation of the group's units: the forward keeps only each unit's inputs,
    the backward first re-runs the unit's forward (docs/design.md, "Activation recomputation");
    omitted from the file when false."""
    shard: int | None = None
    """``zero1`` / ``zero2`` / ``zero3`` only: devices per shard group (consecutive devices,
    dividing ``len(devices)``; default all of them); fewer is hybrid sharding, the state sharded
    within each group and replicated across (:mod:`tag.parallel.sharded`); omitted from the file
    when unset."""
    offload: str | None = None
    """``zero1`` / ``zero2`` / ``zero3`` only: training state kept in host memory, ``"optimizer"``
    (ZeRO-Offload: the optimizer state and the step on the host CPU, gradient shards copied to the
    host after their reduction, updated parameter shards copied back; :mod:`tag.parallel.sharded`);
    omitted from the file when unset."""

    def key(self) -> tuple:
        """Hashable identity (used by caches)."""
        return (tuple(self.devices), tuple(round(s, 9) for s in self.shares), self.sync, self.server,
                tuple(self.mp_splits or ()), tuple(self.sfb), self.tp, self.sequence_parallel,
                self.recompute, self.shard, self.offload)

    def named_devices(self) -> list:
        """Every device index the group names: its replicas, then its parameter server if any."""
        return [*self.devices, *([] if self.server is None else [self.server])]


@dataclass
class PipelinePlan:
    """Op-groups cut into pipeline stages run on micro-batches (:mod:`tag.parallel.pipeline`)."""

    stages: list[int]
    """First op-group of each stage (increasing, starting at 0); every group of a stage has the
    stage's devices and shares."""
    micro_batches: int
    """Micro-batches per iteration (contiguous sample ranges of the global batch)."""
    schedule: str = "1f1b"
    """A schedule registered in :mod:`tag.parallel.pipeline` (checked there, by
    ``validate_pipeline``): ``1f1b``, ``gpipe``, ``kfkb`` (blocks of :attr:`k` forwards then ``k``
    backwards), or one registered by user code."""
    k: int = 1
    """Micro-batches per block, for a schedule that reads it (``kfkb``)."""


@dataclass
class Plan:
    """A deployment of every op-group, plus what it was made for."""

    model: str
    """Workload spec of the graph."""
    graph_signature: str
    """:meth:`OpGraph.signature` of the graph the plan was made for."""
    topology: str
    """Topology name."""
    topology_signature: str
    """:meth:`Topology.signature` of the topology the plan was made for."""
    batch_size: int
    """Global batch size (samples)."""
    groups: list[GroupPlan]
    predicted_iteration_time_s: float | None = None
    """Simulated iteration time in seconds, if known."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form provenance (searcher, playouts, seed, ...)."""
    version: int = PLAN_VERSION
    precision: str = "fp32"
    """Training precision of the graph (``fp32``, ``bf16``, ``fp16``; files without it: fp32)."""
    pipeline: PipelinePlan | None = None
    """Pipeline stages and micro-batches; ``None``: every unit runs the whole batch at once."""

    def on_topology(self, topology, device_of) -> Plan:
        """This plan moved onto ``topology``: every device index ``d`` (replicas and parameter
        servers) becomes ``device_of[d]`` (a list or a dict), the topology's name and signature
        replace this one's; the rest is shared. For a cluster and a sub-cluster of it
        (:meth:`tag.topology.Topology.restricted`): a sub-cluster's layout onto the cluster, a
        plan that leaves machines idle onto the machines it uses."""
        groups = [replace(g, devices=[device_of[d] for d in g.devices],
                          server=None if g.server is None else device_of[g.server]) for g in self.groups]
        return replace(self, topology=topology.name, topology_signature=topology.signature(), groups=groups)

    def used_machines(self, topology) -> list[int]:
        """Indices of the machines of ``topology`` holding a device of the plan, ascending."""
        return sorted({topology.machine_of(d) for g in self.groups for d in g.named_devices()})

    # ---- validation ------------------------------------------------------------------
    def validate(self, graph, topology, *, source: str = "plan") -> None:
        """Raise :class:`PlanError` (one line) unless the plan is made for ``graph`` and ``topology``
        (version, signatures, batch, one entry per group). Each group's deployment is checked by
        its strategy: :func:`tag.parallel.validate_plan` does both."""
        if self.version != PLAN_VERSION:
            raise PlanError(f"{source}: version: expected {PLAN_VERSION}, got {self.version}")
        if self.precision != getattr(graph, "precision", "fp32"):
            raise PlanError(f"{source}: precision: plan is for {self.precision}, the graph was captured in "
                            f"{graph.precision}; pass --precision {self.precision}")
        # What differs, named field by field (the signature alone says only "something").
        differs = [(f, text) for f, same, text in (
            ("model", self.model == graph.model, f"model {self.model!r} in the plan, {graph.model!r} given"),
            ("batch_size", self.batch_size == graph.batch_size,
             f"batch {self.batch_size} in the plan, {graph.batch_size} given"),
            ("groups", len(self.groups) == graph.num_groups,
             f"{len(self.groups)} op-groups in the plan, {graph.num_groups} given"),
        ) if not same]
        if self.graph_signature == graph.signature():  # the same ops and grouping: only the batch can differ
            differs = [d for d in differs if d[0] == "batch_size"]
        if differs or self.graph_signature != graph.signature():
            what = ", ".join(text for _, text in differs) or (
                f"same model, batch and op-group count, but other ops or grouping (graph signature "
                f"{self.graph_signature} in the plan, {graph.signature()} given: another --optimizer, or "
                "another version of the model or of torch)")
            field = differs[0][0] if differs else "graph_signature"
            raise PlanError(f"{source}: {field}: plan was made for another graph: {what}; re-plan for this one")
        if self.topology_signature != topology.signature():
            same = self.topology == topology.name
            what = (f"topology {self.topology!r} with other contents (signature {self.topology_signature} in "
                    f"the plan, {topology.signature()} given)") if same else \
                f"topology {self.topology!r}, not {topology.name!r}"
            raise PlanError(f"{source}: topology_signature: plan was made for {what}; re-plan for this one")
        if len(self.groups) != graph.num_groups:  # the plan's own list is short or long
            raise PlanError(f"{source}: groups: expected {graph.num_groups} entries (one per op-group), "
                            f"got {len(self.groups)}")

    # ---- I/O -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        if self.pipeline is None:  # plans without a pipeline keep the format they always had
            del d["pipeline"]
        for g in d["groups"]:  # and groups without tensor parallelism or recomputation
            if g["tp"] is None:
                del g["tp"]
            if not g["sequence_parallel"]:
                del g["sequence_parallel"]
            if not g["recompute"]:
                del g["recompute"]
            if g["shard"] is None:
                del g["shard"]
            if g["offload"] is None:
                del g["offload"]
        return d

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "plan") -> Plan:
        if not isinstance(d, dict):
            raise PlanError(f"{source}: expected a JSON object, got {type(d).__name__}")
        required = ("model", "graph_signature", "topology", "topology_signature", "batch_size", "groups")
        for k in required:
            if k not in d:
                raise PlanError(f"{source}: {k}: missing field")
        known = {f for f in cls.__dataclass_fields__}
        extra = sorted(set(d) - known)
        if extra:
            raise PlanError(f"{source}: {extra[0]}: unknown field; expected one of {sorted(known)}")
        for k, kind in _PLAN_TYPES.items():
            if k in d:
                _check_type(d[k], kind, f"{source}: {k}")
        if d.get("precision", "fp32") not in ("fp32", "bf16", "fp16"):
            raise PlanError(f"{source}: precision: expected fp32, bf16 or fp16, got {d['precision']!r}")
        if d["batch_size"] < 1:
            raise PlanError(f"{source}: batch_size: expected a positive integer, got {d['batch_size']}")
        if d["batch_size"] > MAX_BATCH:
            raise PlanError(f"{source}: batch_size: expected at most {MAX_BATCH} samples, got {d['batch_size']}")
        if not 1 <= len(d["groups"]) <= MAX_GROUPS:
            raise PlanError(f"{source}: groups: expected 1 to {MAX_GROUPS} op-groups, got {len(d['groups'])}")
        groups = []
        for i, g in enumerate(d["groups"]):
            if not isinstance(g, dict):
                raise PlanError(f"{source}: groups[{i}]: expected an object")
            groups.append(_typed(GroupPlan, g, ("devices", "shares"), _GROUP_TYPES, f"{source}: groups[{i}]"))
        pipeline = d.get("pipeline")
        if pipeline is not None:
            pipeline = _typed(PipelinePlan, pipeline, ("stages", "micro_batches"), _PIPELINE_TYPES,
                              f"{source}: pipeline")
        return cls(**{**d, "groups": groups, "pipeline": pipeline})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (temp file + rename): a crash never leaves a half-written plan."""
        write_atomic(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        p = Path(path)
        d = read_json(p, PlanError, "plan")
        try:
            return cls.from_dict(d, source=str(p))
        except TypeError as e:
            raise PlanError(f"{p}: malformed plan: {e}") from e


# JSON types of the plan's fields, checked on load so that every later message (ranges, sums)
# can assume them: "int", "number", "str", "list[int]", ..., a trailing "?" allows null.
_PLAN_TYPES = {"model": "str", "graph_signature": "str", "topology": "str", "topology_signature": "str",
               "batch_size": "int", "groups": "list", "predicted_iteration_time_s": "number?", "meta": "dict",
               "version": "int", "pipeline": "dict?", "precision": "str"}
_GROUP_TYPES = {"devices": "list[int]", "shares": "list[number]", "sync": "str", "server": "int?",
                "mp_splits": "list[int]?", "sfb": "list[str]", "tp": "int?",
                "sequence_parallel": "bool", "recompute": "bool", "shard": "int?",
                "offload": "str?"}
_PIPELINE_TYPES = {"stages": "list[int]", "micro_batches": "int", "schedule": "str", "k": "int"}
_JSON_TYPES = {"bool": "true or false", "int": "an integer", "number": "a number", "str": "a string", "list": "a list",
               "dict": "an object"}


def _typed(cls, d: dict, required: tuple[str, ...], types: dict[str, str], where: str):
    """``cls(**d)`` once ``d`` has no unknown field, every ``required`` one, and the JSON types
    ``types`` (errors name ``<where>.<field>``)."""
    known = set(cls.__dataclass_fields__)
    bad = sorted(set(d) - known)
    if bad:
        raise PlanError(f"{where}.{bad[0]}: unknown field; expected one of {sorted(known)}")
    for k in required:
        if k not in d:
            raise PlanError(f"{where}.{k}: missing field")
    for k, kind in types.items():
        if k in d:
            _check_type(d[k], kind, f"{where}.{k}")
    return cls(**d)


def _is(value: Any, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {"str": str, "list": list, "dict": dict}[kind])


def _check_type(value: Any, kind: str, where: str) -> None:
    """Raise PlanError ``<where>: expected <kind>, got <value>`` unless ``value`` has JSON type ``kind``."""
    if kind.endswith("?"):
        if value is None:
            return
        kind = kind[:-1]
    if kind.startswith("list["):
        item = kind[5:-1]
        if not isinstance(value, list):
            raise PlanError(f"{where}: expected a list, got {_short(value)}")
        for j, v in enumerate(value):
            if not _is(v, item):
                raise PlanError(f"{where}[{j}]: expected {_JSON_TYPES[item]}, got {_short(v)}")
        return
    if not _is(value, kind):
        raise PlanError(f"{where}: expected {_JSON_TYPES[kind]}, got {_short(value)}")


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def group_positions(graph, g: int) -> tuple[int, int]:
    """First and one-past-last forward position of group ``g``."""
    anchors = [graph.ops[i].anchor for i in graph.groups[g].ops if graph.ops[i].phase == "fwd"]
    if not anchors:
        a = [graph.ops[i].anchor for i in graph.groups[g].ops]
        return min(a), min(a) + 1
    return min(anchors), max(anchors) + 1


def local_batches(batch_size: int, shares: list[float]) -> list[int]:
    """Integer samples per replica: largest-remainder rounding of ``shares * batch_size``.

    Every replica gets at least one sample when ``batch_size >= len(shares)``.
    """
    raw = np.asarray(shares, dtype=np.float64) * batch_size
    floor = np.floor(raw)
    base = floor.astype(np.int64)
    rest = batch_size - int(base.sum())
    # Largest remainders first, replicas without a sample before the others, ties in replica order
    # (a stable descending sort on (base == 0, raw - base)): np.lexsort's last key is the first.
    order = np.lexsort((np.arange(len(shares)), -(raw - floor), -(base == 0).astype(np.int64)))
    base[order[:rest]] += 1  # (a negative rest, from shares summing past 1, slices as a list does)
    base = base.tolist()
    if batch_size >= len(shares):
        for i in range(len(base)):
            while base[i] == 0:
                j = max(range(len(base)), key=lambda k: base[k])
                base[j] -= 1
                base[i] += 1
    return base


def new_plan(graph, topology, groups: list[GroupPlan], **meta) -> Plan:
    """A :class:`Plan` for ``graph`` on ``topology`` with the given group deployments."""
    return Plan(model=graph.model, graph_signature=graph.signature(), topology=topology.name,
                topology_signature=topology.signature(), batch_size=graph.batch_size,
                groups=groups, meta=dict(meta), precision=getattr(graph, "precision", "fp32"))


def device_ranges(devs: list[int]) -> str:
    """Ascending device indices as ranges: ``[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"``."""
    runs: list[list[int]] = []
    for d in devs:
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
