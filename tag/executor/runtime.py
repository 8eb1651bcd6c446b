"""What one rank holds and does: its stages, values, parameters and optimizer.

The runtime is transport-agnostic: a transfer step is split into :meth:`RankRuntime.outgoing`
(pieces this rank sends), :meth:`RankRuntime.incoming` (buffers it receives into) and
:meth:`RankRuntime.assemble` (combine pieces into the consumer's input). The distributed
worker moves the pieces with torch.distributed; :mod:`tag.executor.virtual` moves them inside
one process (fast semantic tests).

Values live in ``env[(unit, node name)]``: a rank may serve several units with different
sample ranges, so the same node name can hold different rows for different units.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind

from ..errors import TagError
from ..graph.capture import export_joint
from ..graph.stages import Stage, build_stages
from .optim import make_optimizer
from .schedule import Move, Schedule, Step, UnitKey


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


def export_at(model: torch.nn.Module, make_inputs, batch: int) -> Joint:
    """Export the joint graph of ``model`` at local batch ``batch`` (one torch.export)."""
    ep = export_joint(model, make_inputs(batch))
    users, state = [], {}
    for s in ep.graph_signature.input_specs:
        if s.kind == InputKind.USER_INPUT:
            users.append(s.arg.name)
        else:
            state[s.arg.name] = s.target
    return Joint(ep.graph_module, users, state, {**ep.state_dict, **ep.constants})


@dataclass
class Timer:
    """Seconds spent per activity in the current iteration."""

    compute: float = 0.0
    comm: float = 0.0
    sync: float = 0.0
    update: float = 0.0


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

    def __post_init__(self) -> None:
        s = self.schedule
        self.my_units = {u.key: u for u in s.units_of(self.rank)}
        self.stages: dict[tuple[UnitKey, str], Stage] = {}
        for b, joint in self.joints.items():
            keys = {k for k, u in self.my_units.items() if u.replica_on(self.rank).batch == b}
            assign = {n: up for n, up in s.assign.items() if up[0] in keys}
            names = {n.name for n in joint.module.graph.nodes}
            missing = sorted(set(assign) - names)
            if missing:
                raise ExecutionError(f"the joint graph exported at local batch {b} lacks node {missing[0]!r} "
                                     f"of the graph captured at batch {s.batch_size}; choose shares giving "
                                     "other local batch sizes")
            self.stages.update(build_stages(types.SimpleNamespace(joint=joint.module), assign))
        for key, stage in self.stages.items():
            if self.device.type != "cpu":
                _retarget_devices(stage.module, self.device)
            if key == (s.loss_unit, "bwd"):
                rep = self.my_units[s.loss_unit].replica_on(self.rank)
                _scale_seed(stage, s.loss, rep.batch / s.batch_size)
        # Parameters of the units this rank replicates; buffers/constants for every placeholder.
        any_joint = next(iter(self.joints.values())) if self.joints else None
        self.state: dict[str, torch.Tensor] = {}
        self.user_inputs: list[str] = []
        if any_joint is not None:
            self.user_inputs = any_joint.user_inputs
            for ph, target in any_joint.state.items():
                if ph not in s.param_owner:
                    self.state[ph] = any_joint.state_values[target].detach().to(self.device)
        self.params: dict[str, torch.nn.Parameter] = {}
        for ph, owner in s.param_owner.items():
            if owner in self.my_units:
                value = any_joint.state_values[s.param_target[ph]]
                self.params[ph] = torch.nn.Parameter(value.detach().clone().to(self.device))
        self.optimizer = make_optimizer(self.optimizer_name, self.params.values())
        self.env: dict[tuple[UnitKey, str], torch.Tensor] = {}
        self.timer = Timer()
        self.loss = 0.0

    # ---- values ------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        self.env.clear()
        self.timer = Timer()
        self.loss = 0.0
        for key, u in self.my_units.items():
            r = u.replica_on(self.rank)
            for name, x in zip(self.user_inputs, self.inputs):
                self.env[(key, name)] = x[r.start:r.stop]  # dim 0 of every user input is the batch

    def value(self, unit: UnitKey, name: str) -> torch.Tensor:
        v = self.env.get((unit, name))
        if v is not None:
            return v
        if name in self.params and self.schedule.param_owner[name] == unit:
            return self.params[name]
        if name in self.state:
            return self.state[name]
        raise ExecutionError(f"rank {self.rank}: unit {unit} has no value for {name!r} (schedule bug)")

    # ---- compute -------------------------------------------------------------------------
    def compute(self, unit: UnitKey, phase: str) -> None:
        stage = self.stages.get((unit, phase))
        if stage is None or unit not in self.my_units:
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            outs = stage.module(*[self.value(unit, n) for n in stage.inputs])
        for name, v in zip(stage.outputs, outs):
            self.env[(unit, name)] = v
        if phase == "fwd" and self.schedule.loss in stage.outputs:
            rep = self.my_units[unit].replica_on(self.rank)
            self.loss = float(self.env[(unit, self.schedule.loss)]) * rep.batch / self.schedule.batch_size
        self._synchronize()
        dt = time.perf_counter() - t0
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * dt)
        self.timer.compute += time.perf_counter() - t0

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- transfers -----------------------------------------------------------------------
    def outgoing(self, step: Step) -> list[tuple[int, int, torch.Tensor]]:
        """(tag, destination rank, piece) for every piece this rank sends in ``step``."""
        out = []
        for k, m in enumerate(step.moves):
            if m.src == self.rank and m.dst != self.rank:
                out.append((k, m.dst, self.piece(m)))
        return out

    def incoming(self, step: Step) -> list[tuple[int, int, torch.Tensor]]:
        """(tag, source rank, empty buffer) for every piece this rank receives in ``step``."""
        out = []
        for k, m in enumerate(step.moves):
            if m.dst == self.rank and m.src != self.rank:
                shape, dtype = self.piece_spec(step, m)
                out.append((k, m.src, torch.empty(shape, dtype=dtype, device=self.device)))
        return out

    def piece(self, m: Move) -> torch.Tensor:
        """The part of the producer's value that ``m`` moves (contiguous, ready to send)."""
        v = self.value(m.src_unit, m.name)
        if m.mode == "rows":
            rep = self.schedule.units[m.src_unit].replica_on(m.src)
            rows = v.shape[m.batch_dim] // rep.batch  # rows per sample along the batch dim
            v = v.narrow(m.batch_dim, (m.start - rep.start) * rows, (m.stop - m.start) * rows)
        return v.detach().contiguous()

    def piece_spec(self, step: Step, m: Move) -> tuple[list[int], torch.dtype]:
        """Shape and dtype of the piece ``m`` delivers to this rank (from the stage's metadata)."""
        stage = self.stages[(m.dst_unit, step.phase)]
        ph = next(n for n in stage.module.graph.nodes if n.op == "placeholder" and n.name == m.name)
        val = ph.meta["val"]
        shape = list(val.shape)
        if m.mode == "rows":
            rep = self.my_units[m.dst_unit].replica_on(self.rank)
            rows = shape[m.batch_dim] // rep.batch
            shape[m.batch_dim] = rows * (m.stop - m.start)
        return shape, val.dtype

    def assemble(self, step: Step, received: dict[int, torch.Tensor]) -> None:
        """Combine local and received pieces into ``env[(consumer unit, name)]``."""
        pieces: dict[tuple[UnitKey, str], list[tuple[Move, torch.Tensor | None]]] = {}
        for k, m in enumerate(step.moves):
            if m.dst != self.rank:
                continue
            if m.mode == "zeros":
                piece = None
            elif m.src == self.rank:
                piece = self.piece(m) if m.mode == "rows" else self.value(m.src_unit, m.name)
            else:
                piece = received[k]
            pieces.setdefault((m.dst_unit, m.name), []).append((m, piece))
        for key, ps in pieces.items():
            m0 = ps[0][0]
            if m0.mode == "rows":
                ps.sort(key=lambda mp: mp[0].start)
                self.env[key] = torch.cat([p for _, p in ps], dim=m0.batch_dim) if len(ps) > 1 else ps[0][1]
            elif m0.mode == "sum":
                total = ps[0][1].clone()
                for _, p in ps[1:]:
                    total += p
                self.env[key] = total
            elif m0.mode == "zeros":
                shape, dtype = self.piece_spec(step, m0)
                self.env[key] = torch.zeros(shape, dtype=dtype, device=self.device)
            else:
                self.env[key] = ps[0][1]

    # ---- gradients and update --------------------------------------------------------------
    def grad_flat(self, group: int) -> torch.Tensor:
        """This rank's gradients of ``group``'s params, flattened (zeros on a mere PS server)."""
        s = self.schedule
        parts = []
        for ph in s.group_params[group]:
            owner = s.param_owner[ph]
            if owner in self.my_units:
                parts.append(self.env[(owner, s.param_grad[ph])].reshape(-1))
            else:
                parts.append(torch.zeros(s.param_numel[ph], device=self.device))
        return torch.cat(parts) if parts else torch.zeros(0, device=self.device)

    def set_grad_flat(self, group: int, flat: torch.Tensor) -> None:
        """Replace this rank's gradients of ``group`` by the synchronised ``flat``."""
        s = self.schedule
        off = 0
        for ph in s.group_params[group]:
            owner = s.param_owner[ph]
            if owner not in self.my_units:
                return  # a PS server outside the replica set keeps nothing
            n = self.params[ph].numel()
            self.env[(owner, s.param_grad[ph])] = flat[off:off + n]
            off += n

    def update(self) -> None:
        """Apply the optimizer to every parameter this rank holds."""
        if self.optimizer is None:
            return
        t0 = time.perf_counter()
        s = self.schedule
        for ph, p in self.params.items():
            p.grad = self.env[(s.param_owner[ph], s.param_grad[ph])].detach().reshape(p.shape).clone()
        self.optimizer.step()
        for p in self.params.values():
            p.grad = None
        self._synchronize()
        self.timer.update += time.perf_counter() - t0

    def named_params(self) -> dict[str, torch.Tensor]:
        """State-dict name -> current value of the parameters this rank holds."""
        return {self.schedule.param_target[ph]: p.detach().cpu() for ph, p in self.params.items()}


def _scale_seed(stage: Stage, loss: str, scale: float) -> None:
    """Multiply the loss-gradient seed by ``scale`` (= b_i / B) inside the loss unit's backward.

    Every gradient leaving that backward is linear in the seed, so this is DESIGN.md's
    "scale every gradient leaving the loss unit by b_i / B", done once at the source.
    """
    g = stage.module.graph
    ph = next((n for n in g.nodes if n.op == "placeholder" and n.name == loss), None)
    if ph is None or not ph.users:
        raise ExecutionError(f"loss {loss!r}: the loss unit's backward does not read the loss; "
                             "cannot find the loss-gradient seed to scale")
    if scale == 1.0:
        return
    for seed in list(ph.users):
        with g.inserting_after(seed):
            scaled = g.call_function(torch.ops.aten.mul.Tensor, (seed, scale))
        scaled.meta = dict(seed.meta)
        seed.replace_all_uses_with(scaled, delete_user_cb=lambda n, s=scaled: n is not s)
    stage.module.recompile()


def _retarget_devices(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Ops that create tensors (full_like, scalar_tensor, _to_copy) were traced with device=cpu."""
    for n in gm.graph.nodes:
        dev = n.kwargs.get("device") if n.op == "call_function" else None
        if dev is not None and torch.device(dev).type == "cpu":
            n.kwargs = {**n.kwargs, "device": device}
    gm.recompile()
