"""Roofline cost of ops on a device known only from its datasheet.

``time = max(flops / (peak_flops * flop_efficiency), bytes / (memory_bandwidth * mem_efficiency))``

The op's arithmetic intensity (FLOPs per byte moved) decides which roof applies. Datasheet
peaks are never reached; the efficiency factors say what fraction is. Defaults below are
typical fractions of peak that dense fp32 GEMMs and streaming elementwise kernels reach on
recent NVIDIA GPUs; a device with a real profile uses calibrated factors instead
(:mod:`tag.cost.profile`), and a real per-op profile always wins over this rule.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_FLOP_EFFICIENCY = 0.7  # fraction of datasheet FP32 FLOP/s reached by large GEMMs
DEFAULT_MEM_EFFICIENCY = 0.8  # fraction of datasheet memory bandwidth reached by streaming ops


@dataclass(frozen=True)
class Roofline:
    """Effective roofs of one device."""

    flop_rate: float
    """Achieved FLOP/s (peak x efficiency)."""
    mem_bandwidth: float
    """Achieved bytes/s (peak x efficiency)."""

    @classmethod
    def of(cls, gpu, flop_efficiency: float = DEFAULT_FLOP_EFFICIENCY,
           mem_efficiency: float = DEFAULT_MEM_EFFICIENCY) -> Roofline:
        """From a :class:`tag.topology.GPUSpec` (fp32 FLOP/s, memory bandwidth)."""
        return cls(gpu.fp32_flops * flop_efficiency, gpu.memory_bandwidth * mem_efficiency)

    def time(self, flops: float, nbytes: float) -> float:
        """Seconds for an op doing ``flops`` FLOPs and moving ``nbytes`` bytes."""
        return max(flops / self.flop_rate, nbytes / self.mem_bandwidth)


def graph_time(graph, roof: Roofline, batch: float | None = None, phases=("fwd", "bwd", "opt")) -> float:
    """Seconds of one iteration of ``graph`` at ``batch`` samples on one device (no overlap)."""
    b = graph.batch_size if batch is None else batch
    return sum(roof.time(op.flops.at(b), op.bytes_read.at(b) + op.bytes_written.at(b))
               for op in graph.ops if op.phase in phases)


# ---------------------------------------------------------------------------------------------
# Vectorised per-op / per-group roofline tables (used by the cost model and the simulator).
# ---------------------------------------------------------------------------------------------
# Fixed cost of launching one (non-view) op: a CUDA kernel launch plus the PyTorch dispatcher is
# ~5 us; on a CPU the dispatcher + fx interpreter overhead of one ATen call is of the same order.
GPU_OP_OVERHEAD_S = 5e-6
CPU_OP_OVERHEAD_S = 5e-6
# Per-device efficiency factors (fraction of the datasheet roofs reached): name -> (flop, mem).
# The ``cpu`` spec is *measured* (best large matmul / large copy), so its peaks are achieved ones.
DEVICE_EFFICIENCY: dict[str, tuple[float, float]] = {"cpu": (1.0, 1.0)}


def roofline_for(gpu, threads_scale: float = 1.0) -> Roofline:
    """Effective roofs of a :class:`GPUSpec` with its per-device efficiency factors.

    ``threads_scale`` multiplies the FLOP rate (a CPU device using a fraction of the cores the
    spec was measured with).
    """
    fe, me = DEVICE_EFFICIENCY.get(gpu.name, (DEFAULT_FLOP_EFFICIENCY, DEFAULT_MEM_EFFICIENCY))
    r = Roofline.of(gpu, fe, me)
    return Roofline(r.flop_rate * threads_scale, r.mem_bandwidth)


def op_overhead(gpu) -> float:
    """Seconds of fixed launch/dispatch cost per non-view op on this device."""
    return CPU_OP_OVERHEAD_S if gpu.name == "cpu" else GPU_OP_OVERHEAD_S


def optimizer_step_overhead(optimizer: str, overhead: float) -> float:
    """Fixed seconds of one multi-tensor optimizer step on a device with ``overhead`` seconds per
    launched op: one per foreach op of the step (:data:`tag.cost.optim.STEP_OPS`)."""
    from .optim import STEP_OPS

    return overhead * STEP_OPS.get(optimizer, 1)


def group_phase_table(graph, roof: Roofline, batches, overhead: float = 0.0, only=None, fixed=None):
    """Roofline seconds per (group, phase, batch): ``ndarray [K, 3, len(batches)]``; ``only``: a
    boolean mask over the ops, counting those alone (default all); ``fixed``: a factor per op on
    its fixed (batch-independent) FLOPs and bytes (default 1: a tensor-parallel rank's ``1 / T``
    of a split weight, :meth:`tag.cost.CostModel.split_at`).

    Per op: ``max(flops(b) / flop_rate, bytes(b) / mem_bandwidth) + overhead`` (the overhead only
    for forward/backward ops that move or compute anything; views are free); phases in ``PHASES``
    order. An optimizer update op is charged no overhead: the executor updates all of a device's
    parameters in one multi-tensor step (:mod:`tag.cost.optim`), whose launches are a fixed cost
    per step (:func:`optimizer_step_overhead`), not one per parameter.
    """
    import numpy as np

    from ..graph.ir import PHASES

    b = np.asarray(batches, dtype=float)[None, :]
    ops = graph.ops
    ff = np.array([o.flops.fixed for o in ops])[:, None]
    fs = np.array([o.flops.per_sample for o in ops])[:, None]
    bf = np.array([o.bytes_read.fixed + o.bytes_written.fixed for o in ops])[:, None]
    bs = np.array([o.bytes_read.per_sample + o.bytes_written.per_sample for o in ops])[:, None]
    if fixed is not None:
        ff, bf = ff * np.asarray(fixed, dtype=float)[:, None], bf * np.asarray(fixed, dtype=float)[:, None]
    t = np.maximum((ff + fs * b) / roof.flop_rate, (bf + bs * b) / roof.mem_bandwidth)
    launched = np.array([o.phase != "opt" for o in ops])[:, None]
    t = t + overhead * (((ff + fs + bf + bs) > 0) & launched)
    if only is not None:
        t = t * np.asarray(only, dtype=bool)[:, None]
    row = np.array([o.group * 3 + PHASES.index(o.phase) for o in ops], dtype=np.int64)
    out = np.zeros((graph.num_groups * 3, b.shape[1]))
    np.add.at(out, row, t)
    return out.reshape(graph.num_groups, 3, b.shape[1])
