"""The op graph of one training iteration (forward + backward + optimizer) and its op-groups.

Every size and cost that depends on the batch is stored as an affine function of the
per-replica batch ``b`` (samples): ``value(b) = fixed + per_sample * b``. Both coefficients
come from capturing the model at two batch sizes (see :mod:`tag.graph.capture`), so the
graph can be costed at any batch share without re-capturing.

Units: FLOPs are floating-point operations, bytes are bytes, batch is samples.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Literal


class Phase(StrEnum):
    """The phase of an op, a schedule step or a pipeline task: one definition for its two
    spellings. Where phases are named (graph files, :class:`tag.parallel.schedule.Step`, pipeline
    tasks, the executor) it is the label, a ``str`` (``Phase.FWD == "fwd"``, the JSON of a graph
    unchanged); where they are counted (the simulator's stage tables ``ph * K + g``, the cost
    tables' phase axis) it is :data:`PHASE_INDEX` of the label, a plain ``int``: an ``IntEnum``
    member compares slower than an ``int`` (0.098 against 0.072 s per million ``==``) and looking a
    member up on its class takes ~0.4 us (0.42 s per million ``Phase.OPT``; CPython 3.11,
    2026-11-29), so loops bind a member to a local first."""

    FWD = "fwd"
    BWD = "bwd"
    OPT = "opt"


TensorKind = Literal["input", "param", "buffer", "const", "activation", "grad", "opt"]
PHASES: tuple[str, ...] = tuple(p.value for p in Phase)
"""The phase labels in index order: ``("fwd", "bwd", "opt")``."""
PHASE_INDEX: dict[str, int] = {p: i for i, p in enumerate(PHASES)}
"""Phase label -> its index (fwd 0, bwd 1, opt 2): the simulator's and the cost tables' phases."""


@dataclass(frozen=True)
class Affine:
    """``fixed + per_sample * b`` for a per-replica batch of ``b`` samples."""

    fixed: float = 0.0
    per_sample: float = 0.0

    def at(self, batch: float) -> float:
        return self.fixed + self.per_sample * batch

    def __add__(self, other: Affine) -> Affine:
        return Affine(self.fixed + other.fixed, self.per_sample + other.per_sample)

    @staticmethod
    def fit(v1: float, b1: int, v2: float, b2: int) -> Affine:
        """The affine function through (b1, v1) and (b2, v2); per-sample slope clamped >= 0."""
        slope = max(0.0, (v2 - v1) / (b2 - b1))
        return Affine(max(0.0, v1 - slope * b1), slope)


ITEMSIZE = {"": 4, "float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
"""Bytes per element of the floating dtypes an :class:`Op` records ("": float32, the dtype of a
graph stored without dtypes)."""


@dataclass
class Op:
    """One node of the joint training graph (or a synthesized optimizer update)."""

    name: str
    """Unique node name in the joint graph (``adam::<param>`` for optimizer updates)."""
    target: str
    """ATen overload, e.g. ``aten.mm.default``; ``optim.adam`` / ``optim.sgd`` for updates."""
    phase: Phase
    """``fwd``, ``bwd`` or ``opt``."""
    flops: Affine
    """Floating-point operations as a function of the per-replica batch."""
    bytes_read: Affine
    """Bytes of tensor inputs read (0 for views/aliases, which move no data)."""
    bytes_written: Affine
    """Bytes of outputs written (0 for views/aliases)."""
    inputs: list[int]
    """Indices into :attr:`OpGraph.tensors` this op reads."""
    outputs: list[int]
    """Indices into :attr:`OpGraph.tensors` this op produces."""
    batch: bool
    """Whether any output carries the batch dimension."""
    group: int = -1
    """Op-group index (set by grouping)."""
    anchor: int = -1
    """Position in forward program order this op is costed/grouped with (fwd: its own)."""
    dtype: str = ""
    """dtype of its (first) output, e.g. ``float32`` / ``bfloat16`` / ``int64``; "" where unknown
    (read as ``float32``: graphs captured in fp32 are stored without it, :meth:`OpGraph.to_dict`)."""
    reads_batch: bool | None = None
    """Whether its non-tensor arguments hold the batch size (they differ between the capture's two
    batches: a ``full`` or ``view`` shape, a scalar); None in graphs captured before it was
    recorded (stored without it, :meth:`OpGraph.to_dict`)."""
    attention: tuple[int, int, bool, float] | None = None
    """``(query length, key length, causal, dropout probability)`` of a fused attention op (forward
    or backward): the fused kernels work in tiles of query-key pairs, so what they compute depends
    on the lengths, not on the FLOPs alone (:func:`tag.cost.gpu.attention_tile_fraction`); and
    such an op draws random numbers only with a dropout probability above 0, though PyTorch tags
    every fused attention overload ``nondeterministic_seeded``. None for every other op and in
    graphs captured before it was recorded (stored without it)."""

    @property
    def itemsize(self) -> int:
        """Bytes per element of :attr:`dtype` (:data:`ITEMSIZE`; 4 for a dtype not listed)."""
        return ITEMSIZE.get(self.dtype, 4)


@dataclass
class Tensor:
    """A value flowing between ops (or a graph input such as a parameter)."""

    name: str
    kind: TensorKind
    nbytes: Affine
    """Size in bytes as a function of the per-replica batch."""
    batch_dim: int | None
    """Dimension that carries the batch (samples are contiguous slices along it), or None."""
    producer: int
    """Index of the producing op, or -1 for graph inputs (params, buffers, user inputs)."""
    consumers: list[int] = field(default_factory=list)


@dataclass
class Param:
    """A trainable parameter with its gradient and optimizer update."""

    name: str
    """Module path, e.g. ``model.transformer.h.0.attn.c_attn.weight``."""
    tensor: int
    """Index of its placeholder tensor."""
    grad: int
    """Index of the tensor holding its full gradient (the joint graph's output)."""
    update: int
    """Index of its optimizer op."""
    numel: int
    nbytes: int
    """Parameter bytes (same for its gradient)."""
    opt_state_bytes: int
    """Optimizer state bytes (Adam: 2x, SGD+momentum: 1x, SGD: 0)."""
    group: int = -1
    """Owner op-group: the group computing its gradient; replicas of it hold and update it."""


@dataclass
class Group:
    """An op-group: the unit every placement decision is made on."""

    index: int
    ops: list[int]
    """Op indices of all phases, in graph order."""
    params: list[int]
    """Indices into :attr:`OpGraph.params` owned by this group."""


@dataclass
class OpGraph:
    """The captured training iteration. JSON-serialisable (no tensors, no pickles)."""

    model: str
    """Workload spec this graph was captured from."""
    batch_size: int
    """Global batch size (samples) the costs are quoted for by default."""
    optimizer: str
    ops: list[Op]
    tensors: list[Tensor]
    params: list[Param]
    groups: list[Group] = field(default_factory=list)
    loss: int = -1
    """Index of the loss tensor."""
    version: int = 1
    precision: str = "fp32"
    """``fp32``, or ``bf16`` / ``fp16`` autocast mixed precision (:mod:`tag.graph.precision`)."""

    # ---- derived views -------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def flops(self, phases: tuple[Phase, ...] = ("fwd", "bwd"), batch: float | None = None) -> float:
        """Total FLOPs of the given phases at ``batch`` samples (default: the global batch)."""
        b = self.batch_size if batch is None else batch
        return sum(op.flops.at(b) for op in self.ops if op.phase in phases)

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    def activation_bytes(self, batch: float | None = None) -> float:
        """Bytes of forward activations saved for the backward pass at ``batch`` samples."""
        b = self.batch_size if batch is None else batch
        total = 0.0
        for t in self.tensors:
            if t.kind == "activation" and any(self.ops[c].phase == "bwd" for c in t.consumers):
                total += t.nbytes.at(b)
        return total

    def signature(self) -> str:
        """Stable short hash of the graph structure and grouping (not the costs' float noise)."""
        h = hashlib.sha256()
        h.update(self.model.encode())
        if self.precision != "fp32":  # fp32 signatures are those of graphs captured before precisions
            h.update(f"|precision={self.precision}".encode())
        for op in self.ops:
            h.update(f"{op.name}|{op.target}|{op.phase}|{op.group};".encode())
        return h.hexdigest()[:16]

    # ---- serialisation -------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-able dict. An fp32 graph is written without ``precision`` and per-op ``dtype``
        (as before precisions existed: a cached graph stays readable by older versions; a missing
        dtype reads as "", i.e. float32); an op's ``reads_batch`` and ``attention`` only where
        they were recorded."""
        d = asdict(self)
        for o in d["ops"]:
            for optional in ("reads_batch", "attention"):
                if o[optional] is None:
                    del o[optional]
        if self.precision == "fp32":
            del d["precision"]
            for o in d["ops"]:
                del o["dtype"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> OpGraph:
        def aff(x):
            return Affine(**x)

        ops = [
            Op(**{**o, "flops": aff(o["flops"]), "bytes_read": aff(o["bytes_read"]),
                  "bytes_written": aff(o["bytes_written"]),
                  "attention": tuple(o["attention"]) if o.get("attention") is not None else None})
            for o in d["ops"]
        ]
        tensors = [Tensor(**{**t, "nbytes": aff(t["nbytes"])}) for t in d["tensors"]]
        return cls(
            model=d["model"], batch_size=d["batch_size"], optimizer=d["optimizer"], ops=ops,
            tensors=tensors, params=[Param(**p) for p in d["params"]],
            groups=[Group(**g) for g in d["groups"]], loss=d["loss"], version=d.get("version", 1),
            precision=d.get("precision", "fp32"),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, s: str) -> OpGraph:
        return cls.from_dict(json.loads(s))
