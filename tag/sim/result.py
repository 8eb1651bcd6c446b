"""The outcome of simulating one training iteration, and its Chrome/Perfetto trace."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace


@dataclass
class SimEvent:
    """One interval of the timeline (seconds)."""

    name: str
    device: int
    stream: str
    """``compute`` or ``comm``."""
    start: float
    end: float
    cat: str
    """``fwd``, ``bwd``, ``opt``, ``transfer``, ``allreduce``, ``ps``, ``allgather`` (SFB factor
    all-gather) or ``sfb`` (SFB recompute)."""


@dataclass
class SimResult:
    """Simulated iteration. Times in seconds, memory in bytes; lists are indexed by device
    (topology order) or by op-group."""

    iteration_time_s: float
    oom: bool
    peak_memory_bytes: list[float]
    """Per device: params + grads + optimizer state + buffers + saved activations of the units
    it holds, plus the largest single-op working set and the largest communication buffer (a
    transfer, a gradient sync, or an SFB group's gathered factors at the global batch)."""
    memory_capacity_bytes: list[float]
    oom_devices: list[tuple[int, float]]
    """(device, bytes over capacity) for every device whose peak exceeds its memory."""
    compute_time_s: list[float]
    """Per device: busy time of its compute stream."""
    comm_time_s: list[float]
    """Per device: busy time of its communication stream (overlaps compute)."""
    idle_time_s: list[float]
    """Per device: iteration time minus compute time (the compute stream waiting)."""
    group_finish_s: list[float]
    """Per op-group: when its backward finished on its last replica/chunk."""
    group_compute_s: list[float]
    """Per op-group: compute seconds (fwd + bwd + opt + SFB recompute) summed over its replicas/chunks."""
    path_fn: Callable[[], list[str]] | None = field(default=None, repr=False, compare=False)
    """Computes :attr:`critical_path` on first access (the search loop rarely reads it)."""
    events: list[SimEvent] | None = None
    """The whole timeline when simulated with ``trace=True``."""
    device_names: list[str] = field(default_factory=list)
    host_memory_bytes: list[float] = field(default_factory=list)
    """Per machine: bytes its host holds for offloaded groups (``GroupPlan.offload``,
    :func:`tag.sim.sharded.host_bytes`); empty when nothing is offloaded."""
    host_oom: list[tuple[int, float, float]] = field(default_factory=list)
    """(machine, bytes needed, host memory) of every machine whose host memory the offloaded
    state exceeds (then :attr:`oom` too)."""
    _path: list[str] | None = field(default=None, repr=False, compare=False)

    @property
    def critical_path(self) -> list[str]:
        """Task names along the critical path, first to last (computed on first access)."""
        if self._path is None:
            self._path = self.path_fn() if self.path_fn is not None else []
            self.path_fn = None  # releases the simulation state it holds
        return self._path

    @property
    def overflow(self) -> float:
        """The most overfull device's peak over its capacity (above 1: out of memory)."""
        return max((n / max(c, 1.0) for n, c in [*zip(self.peak_memory_bytes, self.memory_capacity_bytes),
                                                  *((n, c) for _, n, c in self.host_oom)]), default=0.0)

    def memory_report(self, topology, listed: int = 3) -> str:
        """The devices over capacity (of ``topology``, the one simulated) in one line. Up to
        ``listed`` of them each by name, ``device 1 (local:1) needs 3.20 GiB of 2.00 GiB; ...``; more than that, the worst (largest
        need over capacity) and a count of the rest with the largest need among them:
        ``device 16 (v100-00:0) needs 272 GiB of 16 GiB, and 63 more devices over capacity
        (largest need 392 GiB, device 0 (a100-00:0))``."""
        from ..topology.units import format_bytes

        names = [dev.name for dev in topology.devices]
        need, cap = self.peak_memory_bytes, self.memory_capacity_bytes

        def one(d: int) -> str:
            return f"device {d} ({names[d]}) needs {format_bytes(need[d], digits=3)} of {format_bytes(cap[d], digits=3)}"

        over = [d for d, _ in self.oom_devices]
        hosts = "; ".join(f"host of machine {m} ({topology.machines[m].name}) needs {format_bytes(n, digits=3)} of "
                          f"{format_bytes(c, digits=3)}" for m, n, c in self.host_oom)
        if not over:
            return hosts or "the simulator reports OOM"
        if hosts:
            return f"{self.memory_report(replace(self, host_oom=[]), topology, listed)}; {hosts}"
        if len(over) <= listed:
            return "; ".join(one(d) for d in over)
        worst = max(over, key=lambda d: (need[d] / max(cap[d], 1.0), -d))
        rest = [d for d in over if d != worst]
        big = max(rest, key=lambda d: (need[d], -d))
        largest = format_bytes(need[big], digits=3)  # named only where it prints apart from the worst's
        tail = f" (largest need {largest}, device {big} ({names[big]}))" \
            if largest != format_bytes(need[worst], digits=3) else ""
        return f"{one(worst)}, and {len(rest)} more devices over capacity{tail}"

    def to_dict(self) -> dict:
        """JSON-able summary (no events; see :meth:`chrome_trace`)."""
        n = len(self.peak_memory_bytes)
        names = self.device_names or [str(d) for d in range(n)]
        return {
            "iteration_time_s": self.iteration_time_s,
            "oom": self.oom,
            "oom_devices": [{"device": d, "name": names[d], "over_bytes": over} for d, over in self.oom_devices],
            "devices": [
                {"device": d, "name": names[d], "compute_s": self.compute_time_s[d], "comm_s": self.comm_time_s[d],
                 "idle_s": self.idle_time_s[d], "peak_memory_bytes": self.peak_memory_bytes[d],
                 "memory_capacity_bytes": self.memory_capacity_bytes[d]}
                for d in range(n)
            ],
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "group_finish_s": list(self.group_finish_s),
            "group_compute_s": list(self.group_compute_s),
            "critical_path": list(self.critical_path),
            **({"host_memory_bytes": list(self.host_memory_bytes),
                "host_oom": [{"machine": m, "need_bytes": n, "host_memory_bytes": c} for m, n, c in self.host_oom]}
               if self.host_memory_bytes else {}),
        }

    def chrome_trace(self) -> dict:
        """``{"traceEvents": [...]}``: one process per device, threads ``compute`` (0) / ``comm`` (1);
        timestamps in microseconds. Empty timeline unless simulated with ``trace=True``."""
        n = len(self.peak_memory_bytes)
        names = self.device_names or [f"device {d}" for d in range(n)]
        ev: list[dict] = []
        for d in range(n):
            ev.append({"name": "process_name", "ph": "M", "pid": d, "args": {"name": f"{d}: {names[d]}"}})
            ev.append({"name": "thread_name", "ph": "M", "pid": d, "tid": 0, "args": {"name": "compute"}})
            ev.append({"name": "thread_name", "ph": "M", "pid": d, "tid": 1, "args": {"name": "comm"}})
        for e in self.events or ():
            ev.append({"name": e.name, "cat": e.cat, "ph": "X", "pid": e.device, "tid": 0 if e.stream == "compute" else 1,
                       "ts": e.start * 1e6, "dur": max(0.0, e.end - e.start) * 1e6})
        return {"traceEvents": ev, "displayTimeUnit": "ms"}
