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
