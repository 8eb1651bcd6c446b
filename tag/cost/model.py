"""The cost model: seconds of every (op-group, phase) on every device, and its communication model
(:class:`tag.cost.comm.CommModel`, the one place communication is priced).

Where a device's time comes from (``CostModel.source(d)``), best first:

1. ``profile``: a real profile of this graph on this device type (:mod:`tag.cost.profile`);
2. ``scaled``: a profile of this graph on another device type of the same class (CPU->CPU,
   GPU->GPU), scaled group by group by the roofline rule:
   ``t_dev(g, ph, b) = t_prof(g, ph, b) * R_dev(g, ph, b) / R_prof(g, ph, b)``, where
   ``R_x = sum over the group's ops of max(flops / (F_x e_f), bytes / (M_x e_m)) + overhead_x``
   (:func:`tag.cost.roofline.group_phase_table`). The op's arithmetic intensity picks the roof
   (FLOP rate or memory bandwidth) on each device; ``e_f, e_m`` are the per-device efficiency
   factors (:data:`tag.cost.roofline.DEVICE_EFFICIENCY`, default 0.7 / 0.8 of the datasheet);
3. ``roofline``: ``R_dev`` itself (no profile of this graph on a device of that class).

A GPU's ``R`` is not the datasheet roofline but the measured GPU rule of :mod:`tag.cost.gpu`
(rates per op class and dtype, eager launch cost), and its source names where its rates come
from: ``fitted:<type>`` (microbenchmarks and eager steps of that type), ``published:<type>``
(published achieved rates of that type, ``tag/cost/gpu_calib/published.json``) or ``datasheet:<type>``
(the measured type's efficiencies on this type's datasheet); ``scaled:<type>`` scales a GPU
profile with the same rule. The rule's host seconds (per kernel launch, eager PyTorch issuing kernels
one by one) are those of the host its rates were fitted on, unless the device's machine states its
own ``host_launch`` (:func:`tag.cost.gpu.on_host`; :meth:`CostModel.host_launch` says which). ``numerics`` (:class:`tag.cost.gpu.Numerics`) says whether fp32
matmuls / convolutions run on TF32 (PyTorch's defaults: matmuls no, cuDNN convolutions yes).

A CPU device is typed ``cpu-<threads>t``: a topology with ``n`` CPU devices on a machine runs one
rank per device with ``cores // n`` threads each (what the executor does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..graph.ir import PHASES
from ..graph.precision import param_casts
from .comm import CommModel
from .gpu import (
    Numerics,
    OpFeatures,
    gpu_rates,
    host_origin,
    host_seconds,
    on_host,
    op_seconds,
    stage_parts,
    stage_table,
)
from .profile import COMPILED, cpu_device_type, default_profile_dir, find_profile, profiled_device_types
from .roofline import Roofline, group_phase_table, op_overhead, optimizer_step_overhead, roofline_for

PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}


def device_type(topology, d: int) -> str:
    """Profile device type of topology device ``d`` (``cpu-<threads>t`` or the GPU's name)."""
    dev = topology.devices[d]
    if dev.gpu.name == "cpu":
        n = len(topology.devices_of_machine(topology.machine_of(d)))
        return cpu_device_type(max(1, (os.cpu_count() or 1) // n))
    return dev.gpu.name


def _is_cpu(dtype: str) -> bool:
    return dtype.startswith("cpu")


def _threads(dtype: str) -> int:
    return int(dtype[4:-1]) if _is_cpu(dtype) and dtype.endswith("t") and dtype[4:-1].isdigit() else 1


@dataclass
class DeviceCost:
    """Seconds ``table[g, phase, b]`` for per-replica batches ``b = 0..B`` on one device type."""

    device_type: str
    source: str
    """``profile:<type>``, ``scaled:<type>`` or ``roofline``."""
    table: np.ndarray
    """[K, 3, B+1] seconds; phases in ``tag.graph.ir.PHASES`` order (fwd, bwd, opt)."""
    step_overhead_s: float
    """Fixed seconds of one optimizer step per device per iteration."""
    at: object
    """``at(batches) -> [K, 3, len(batches)]`` for batches off the integer grid."""
    wake: np.ndarray | None = None
    """[K, 2, B+1] extra seconds of a fwd/bwd stage started after idling ``wake_gap_s`` (a CPU
    profile's wake penalty, :mod:`tag.cost.profiler`); None: no penalty (GPUs, roofline)."""
    wake_gap_s: float = 0.0
    wake_tau_s: float = 0.0
    host: tuple[float, str] | None = None
    """(host seconds per forward launch, where it comes from: ``topology`` or ``assumed: ...``)
    of a GPU rule's costs (:func:`tag.cost.gpu.on_host`); None: a CPU or a GPU profile's own host."""
    cast: np.ndarray | None = None
    """[K] seconds of each group's forward that are its parameter casts
    (:func:`tag.graph.precision.param_casts`, a bf16 / fp16 copy of each fp32 weight), included in
    ``table``'s forward at every batch: the per-iteration part, which the simulator charges once
    per iteration, at a stage's first micro-batch, not again at later micro-batches or in a
    recomputation (the executor casts once, :func:`tag.executor.fuse.share_param_casts`). A rule's
    costs (:func:`_cast_seconds`); None: none (fp32) or a profile's measured table, whose forwards
    keep their casts at every micro-batch."""
    split: object = None
    """``split(batches, fixed) -> [K, 3, len(batches)]``: ``at`` with each op's fixed FLOPs and
    bytes times ``fixed`` ([n_ops], :meth:`CostModel.split_at`): the rule's own seconds for a rule's
    costs, a profile's scaled by the rule's ratio (as ``scaled:`` scales one); None: not known (a
    compiled profile)."""
    cast_host: np.ndarray | None = None
    """[K] host seconds launching each group's forward parameter casts (with ``parts``; None: none)."""
    parts: object = None
    """``parts(batches, fixed=None) -> StageParts``: a GPU rule's stages apart, device seconds,
    host seconds and the host's lag (:func:`tag.cost.gpu.stage_parts`), for a simulator that runs
    the host and the device as two timelines (:meth:`CostModel.host_parts`); None: the costs
    hold no host apart (a CPU, whose rank issues and computes on one thread; a measured profile)."""


class CostModel:
    """Per-device group costs plus the communication model of one (graph, topology)."""

    def __init__(self, graph, topology, devices: list[DeviceCost], comm: CommModel):
        self.graph = graph
        self.topology = topology
        self.comm = comm
        self._dev = devices  # per topology device (shared objects per device type)
        self._weights: dict[tuple[int, int], np.ndarray] = {}
        self._off_grid: dict[tuple[int, float], np.ndarray] = {}  # (id of DeviceCost, batch) -> [K, 3]
        self._parts: dict[int, object] = {}  # id of DeviceCost -> its StageParts on the batch grid

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def for_topology(cls, graph, topology, profile_dir=None, numerics: Numerics | None = None,
                     runtime: str = "eager", compiled: bool = False) -> CostModel:
        """Profile where one exists for a device type, else scaled profile, else the roofline rule
        (CPU) or the GPU rule (:mod:`tag.cost.gpu`) for the kernels ``runtime`` runs
        (:data:`tag.cost.gpu.RUNTIMES`: ``eager``, TAG's executor, or ``megatron``, Megatron-LM's
        fused kernels; a rule's source then ends in ``+megatron``). ``compiled``: a device type's
        profile measured with compiled stages (``tag profile --compile``, device type
        ``<type>-compiled``, source ``profile:<type>-compiled``) first, as ``tag execute
        --compile`` runs; where none exists, the eager costs above."""
        root = default_profile_dir() if profile_dir is None else profile_dir
        sig = graph.signature()
        found = profiled_device_types(root, sig)
        available = [t for t in found if not t.endswith(COMPILED)]  # (eager profiles)
        grid = np.arange(graph.batch_size + 1, dtype=float)
        by_type: dict[str, DeviceCost] = {}
        devices = []
        feat: list = []  # the graph's GPU op features, built once when a GPU needs them

        def features() -> OpFeatures:
            if not feat:
                feat.append(OpFeatures.of(graph, numerics or Numerics(), runtime))
            return feat[0]

        for d in range(topology.num_devices):
            dt = device_type(topology, d)
            key = (dt, topology.machines[topology.machine_of(d)].host_launch_s)  # a machine's host, if stated
            if key not in by_type:
                by_type[key] = _compiled_cost(graph, dt, root, sig, found, grid) if compiled else None
                by_type[key] = by_type[key] or _device_cost(graph, topology, d, dt, root, sig, available, grid,
                                                            features, runtime)
            devices.append(by_type[key])
        return cls(graph, topology, devices, CommModel.for_topology(topology, root))

    @classmethod
    def roofline_only(cls, graph, topology) -> CostModel:
        """Datasheet roofline for every device, nominal links (no profiles)."""
        return cls.for_topology(graph, topology, profile_dir=os.devnull)

    def restricted(self, topology, devices: list[int]) -> CostModel:
        """This model's costs of ``devices`` (the same device costs, links among them) as the model
        of ``topology``, whose device ``i`` is device ``devices[i]`` here
        (:meth:`tag.topology.Topology.restricted`): plans of a sub-cluster cost what they cost on
        the whole one."""
        return CostModel(self.graph, topology, [self._dev[d] for d in devices], self.comm.restricted(topology, devices))

    # ---- queries ------------------------------------------------------------------------
    def group_time(self, group: int, phase: str, device: int, batch: float) -> float:
        """Seconds of ``phase`` of op-group ``group`` on ``device`` at per-replica ``batch``."""
        dc = self._dev[device]
        ph = PHASE_INDEX[phase]
        b = float(batch)
        if b == int(b) and 0 <= b < dc.table.shape[2]:
            return float(dc.table[group, ph, int(b)])
        key = (id(dc), b)
        tab = self._off_grid.get(key)
        if tab is None:
            tab = self._off_grid[key] = dc.at([b])[:, :, 0]
        return float(tab[group, ph])

    def cast_seconds(self, device: int) -> np.ndarray:
        """[K] seconds of each group's forward parameter casts on ``device``
        (:attr:`DeviceCost.cast`; zeros where there are none or its costs are measured)."""
        c = self._dev[device].cast
        return np.zeros(self.graph.num_groups) if c is None else c

    def cast_host_seconds(self, device: int) -> np.ndarray:
        """[K] host seconds launching each group's forward parameter casts on ``device``, part of
        :meth:`host_parts`' forwards (zeros where its costs hold no host apart or there are no casts)."""
        c = self._dev[device].cast_host
        return np.zeros(self.graph.num_groups) if c is None else c

    def table(self, device: int) -> np.ndarray:
        """``[K, 3, B+1]`` seconds of every group and phase at per-replica batch 0..B (read-only)."""
        return self._dev[device].table

    def host_parts(self, device: int, fixed: np.ndarray | None = None, batches=None):
        """:class:`tag.cost.gpu.StageParts` (``[K, 3, n]`` device seconds, host seconds, host lag) of
        ``device``'s stages at per-replica ``batches`` (None: 0..B, cached), with each op's fixed
        FLOPs and bytes times ``fixed`` where given (:meth:`split_at`); None where its costs hold no
        host apart (:attr:`DeviceCost.parts`)."""
        dc = self._dev[device]
        if dc.parts is None:
            return None
        if fixed is not None or batches is not None:
            grid = np.arange(self.graph.batch_size + 1, dtype=float) if batches is None else batches
            return dc.parts(np.asarray(grid, dtype=float), None if fixed is None else np.asarray(fixed, dtype=float))
        hit = self._parts.get(id(dc))
        if hit is None:
            hit = self._parts[id(dc)] = dc.parts(np.arange(self.graph.batch_size + 1, dtype=float))
        return hit

    def wake_penalty(self, device: int) -> tuple[np.ndarray, float, float] | None:
        """``(table [K, 2, B+1], gap_s, tau_s)`` of ``device``'s wake penalty, or None: a stage
        started after ``gap`` idle seconds takes ``table * (1 - exp(-gap / tau)) /
        (1 - exp(-gap_s / tau))`` more (:mod:`tag.cost.profiler`, "Wake penalty")."""
        dc = self._dev[device]
        return None if dc.wake is None else (dc.wake, dc.wake_gap_s, dc.wake_tau_s)

    def step_overhead(self, device: int) -> float:
        """Fixed seconds of the optimizer step on ``device`` (once per iteration)."""
        return self._dev[device].step_overhead_s

    def source(self, device: int) -> str:
        return self._dev[device].source

    def device_type(self, device: int) -> str:
        return self._dev[device].device_type

    def host_launch(self, device: int) -> tuple[float, str] | None:
        """(host seconds per forward kernel launch, its origin: ``topology`` where ``device``'s
        machine states ``host_launch``, else ``assumed: ...``) of ``device``'s GPU rule; None where
        its costs launch nothing from a modelled host (a CPU, a GPU profile)."""
        return self._dev[device].host

    def split_at(self, device: int, fixed: np.ndarray, batches) -> np.ndarray | None:
        """``[K, 3, len(batches)]`` seconds on ``device`` at per-replica ``batches`` (fractional
        allowed) with each op's fixed (batch-independent) FLOPs and bytes times ``fixed`` ([n_ops]):
        a tensor-parallel rank, whose split ops read, and whose weight-gradient casts write,
        ``1 / T`` of each split weight (:mod:`tag.sim.tensor_parallel`). None where the costs
        cannot say (:attr:`DeviceCost.split`)."""
        split = self._dev[device].split
        return None if split is None else split(np.asarray(batches, dtype=float), np.asarray(fixed, dtype=float))

    def roofline(self, device: int) -> Roofline:
        """Effective roofs of topology device ``device`` (:func:`device_roofline`)."""
        return device_roofline(self.device_type(device), self.topology.devices[device].gpu)

    def device_speeds(self) -> list[float]:
        """Samples/s of each device running the whole iteration alone on the full batch."""
        b = self.graph.batch_size
        out = []
        for d, dc in enumerate(self._dev):
            t = float(dc.table[:, :, b].sum()) + dc.step_overhead_s
            out.append(b / max(t, 1e-15))
            del d
        return out

    def iteration_time_alone(self, device: int) -> float:
        """Seconds of one iteration on ``device`` alone (full batch, no communication)."""
        dc = self._dev[device]
        return float(dc.table[:, :, self.graph.batch_size].sum()) + dc.step_overhead_s

    def position_weights(self, group: int, phase: int) -> np.ndarray:
        """Fraction of group ``group``'s ``phase`` (index) time at each of its forward positions.

        Roofline weights of its ops (:func:`tag.graph.grouping.op_weight`) at the full batch,
        summed per forward anchor; used to apportion a group's time to model-parallel chunks.
        """
        key = (group, phase)
        w = self._weights.get(key)
        if w is None:
            w = _position_weights(self.graph, group, PHASES[phase])
            self._weights[key] = w
        return w


def _position_weights(graph, g: int, phase: str) -> np.ndarray:
    from ..graph.grouping import op_weight
    from ..plan.format import group_positions

    lo, hi = group_positions(graph, g)
    w = np.zeros(hi - lo)
    for i in graph.groups[g].ops:
        op = graph.ops[i]
        if op.phase == phase and lo <= op.anchor < hi:
            w[op.anchor - lo] += op_weight(graph, i)
    total = w.sum()
    if total > 0:
        return w / total
    w[:] = 1.0 / len(w)  # nothing costly: spread evenly
    return w


def _rule(graph, dt: str, spec, features, runtime: str = "eager", host_launch_s: float | None = None):
    """(``R(batches) -> [K, 3, n]``, source name, step overhead s, host) of a device type's rule:
    the roofline for a CPU (host None), the GPU rule of :mod:`tag.cost.gpu` for a GPU on a host of
    ``host_launch_s`` seconds per forward launch (None: the rule's fitted host), host ``(seconds,
    origin)``."""
    if _is_cpu(dt):
        roof, overhead = device_roofline(dt, spec), op_overhead(spec)
        return ((lambda batches, fixed=None: group_phase_table(graph, roof, batches, overhead, fixed=fixed)),
                "roofline", optimizer_step_overhead(graph.optimizer, overhead), None)
    rates = on_host(gpu_rates(spec), host_launch_s)
    source = rates.source if runtime == "eager" else f"{rates.source}+{runtime}"
    host = (rates.host_s, "topology" if host_launch_s is not None else host_origin(rates.gpu))

    def rule(batches, fixed=None):
        feat = features() if fixed is None else features().with_fixed(fixed)
        return stage_table(graph, feat, rates, batches)

    def parts(batches, fixed=None):
        feat = features() if fixed is None else features().with_fixed(fixed)
        return stage_parts(graph, feat, rates, batches)

    def cast_host():  # [K] host seconds launching each group's forward parameter casts
        casts = param_casts(graph)
        out = np.zeros(graph.num_groups)
        np.add.at(out, [graph.ops[i].group for i in casts], host_seconds(graph, features(), rates, [1])[casts, 0])
        return out

    rule.parts, rule.cast_host = parts, cast_host
    return rule, source, rates.step_overhead(graph.optimizer), host


def _device_cost(graph, topology, d: int, dt: str, root, sig: str, available: list[str],
                 grid: np.ndarray, features, runtime: str = "eager") -> DeviceCost:
    spec = topology.devices[d].gpu
    stated = topology.machines[topology.machine_of(d)].host_launch_s
    rtab, rule_source, rule_overhead, host = _rule(graph, dt, spec, features, runtime, stated)

    prof = find_profile(root, dt, sig) if dt in available else None
    if prof is not None and prof.num_groups == graph.num_groups:
        return DeviceCost(dt, f"profile:{dt}", prof.table(grid), prof.opt_step_overhead_s, prof.table,
                          *_wake_of(prof, grid), split=_split_by_rule(prof.table, rtab))
    ref = _reference_type(dt, spec, available)
    prof = find_profile(root, ref, sig) if ref is not None else None
    if prof is not None and prof.num_groups == graph.num_groups:
        ref_spec = spec if _is_cpu(ref) else _catalog(ref)
        ref_tab = _rule(graph, ref, ref_spec, features, runtime)[0]

        def scaled(batches, prof=prof, ref_tab=ref_tab):
            return prof.table(batches) * _ratio(rtab(batches), ref_tab(batches))

        over = prof.opt_step_overhead_s * (_threads(ref) / _threads(dt) if _is_cpu(dt) else 1.0)
        table = scaled(grid)
        wake, gap, tau = _wake_of(prof, grid)
        if wake is not None:  # scaled like the stages it delays
            wake = wake * _ratio(table[:, :2], prof.table(grid)[:, :2])
        return DeviceCost(dt, f"scaled:{ref}", table, over, scaled, wake, gap, tau, host,
                          split=_split_by_rule(scaled, rtab))
    table = rtab(grid)
    return DeviceCost(dt, rule_source, table, rule_overhead, rtab, host=host,
                      cast=(cast := _cast_seconds(graph, dt, spec, features, table)), split=rtab,
                      parts=getattr(rtab, "parts", None),
                      cast_host=None if cast is None or not hasattr(rtab, "cast_host") else rtab.cast_host())


def _split_by_rule(at, rule):
    """:attr:`DeviceCost.split` of measured costs ``at``: scaled by the rule's ratio, the rule with
    the fixed features scaled over the rule as it is."""
    return lambda batches, fixed: at(batches) * _ratio(rule(batches, fixed), rule(batches))


def _cast_seconds(graph, dt: str, spec, features, table: np.ndarray) -> np.ndarray | None:
    """[K] device seconds of each group's forward parameter casts under device type ``dt``'s rule
    (a cast's bytes do not depend on the batch; the GPU rule's :func:`tag.cost.gpu.op_seconds`, a
    CPU's roofline), at most the group's forward at any batch of ``table`` above 0 (None: no cast).
    The host's launches are left in the forward: a forward is device-bound where casts matter
    (llama-70b group 10 on an H100, 2026-11-29: 2.62 ms of casts in 2.86 + 8.69 ms per sample)."""
    casts = param_casts(graph)
    if not casts:
        return None
    only = np.zeros(len(graph.ops), dtype=bool)
    only[casts] = True
    if _is_cpu(dt):
        out = group_phase_table(graph, device_roofline(dt, spec), [1], op_overhead(spec), only=only)[:, 0, 0]
    else:
        t = op_seconds(features(), gpu_rates(spec), [1])[:, 0]
        out = np.zeros(graph.num_groups)
        np.add.at(out, [graph.ops[i].group for i in casts], t[casts])
    return np.minimum(out, table[:, 0, 1:].min(axis=1)) if table.shape[2] > 1 else out


def _compiled_cost(graph, dt: str, root, sig: str, available: list[str], grid: np.ndarray) -> DeviceCost | None:
    """Device type ``dt``'s costs from its profile measured with compiled stages, or None."""
    ct = dt + COMPILED
    prof = find_profile(root, ct, sig) if ct in available else None
    if prof is None or prof.num_groups != graph.num_groups:
        return None
    return DeviceCost(dt, f"profile:{ct}", prof.table(grid), prof.opt_step_overhead_s, prof.table, *_wake_of(prof, grid))


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den`` elementwise, 1 where ``den`` is 0."""
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)


def _wake_of(prof, grid: np.ndarray) -> tuple[np.ndarray | None, float, float]:
    """(wake table on ``grid``, gap, tau) of a profile; (None, 0, 0) without wake data."""
    if not prof.has_wake:
        return None, 0.0, 0.0
    return prof.wake_table(grid), prof.wake_gap_s, prof.wake_tau_s


def _catalog(name: str):
    from ..topology.catalog import match_gpu_name

    return match_gpu_name(name)


def device_roofline(dt: str, spec) -> Roofline:
    """Effective roofs of a device of profile type ``dt`` (:func:`device_type`) with datasheet
    ``spec``: a ``cpu-<threads>t`` device gets its share of the measured CPU's FLOP rate."""
    if _is_cpu(dt):
        import torch

        return roofline_for(spec, _threads(dt) / max(1, torch.get_num_threads()))
    return roofline_for(spec)


def _reference_type(dt: str, spec, available: list[str]) -> str | None:
    """A profiled device type of the same class to scale from (closest in FLOP rate / threads)."""
    if _is_cpu(dt):
        cpus = [a for a in available if _is_cpu(a)]
        return min(cpus, key=lambda a: abs(_threads(a) - _threads(dt)), default=None)
    gpus = [(a, _catalog(a)) for a in available if not _is_cpu(a)]
    gpus = [(a, s) for a, s in gpus if s is not None]
    return min(gpus, key=lambda a: abs(np.log(a[1].fp32_flops / spec.fp32_flops)), default=(None,))[0]
