"""Plain-text rendering of a topology: a machine table and the inter-machine bandwidth matrix."""

from __future__ import annotations

from tag.topology.model import Topology
from tag.topology.units import format_bandwidth, format_bytes, format_time

__all__ = ["format_topology", "render_table"]


def render_table(header: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    """Columns padded to their widest cell; ``right`` = column indices aligned right."""
    right = right or set()
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        parts = [str(v).rjust(w) if c in right else str(v).ljust(w) for c, (v, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def format_topology(topo: Topology) -> str:
    """Readable summary: machines (gpu, count, FP32 TFLOP/s, memory, memory and intra bandwidth,
    intra latency), then the machine x machine network bandwidth (and latency when not uniform)."""
    title = (
        f"Topology {topo.name!r}: {topo.num_machines} machine(s), {topo.num_devices} device(s), "
        f"signature {topo.signature()}"
    )
    header = ["machine", "gpu", "count", "fp32 TFLOP/s", "memory", "mem bw", "intra bw", "intra lat"]
    rows = [
        [
            m.name,
            m.gpu.name,
            str(m.count),
            f"{m.gpu.fp32_flops / 1e12:.3g}",
            format_bytes(m.gpu.memory_bytes, digits=4),
            format_bandwidth(m.gpu.memory_bandwidth, digits=4),
            "-" if m.intra_bandwidth is None else format_bandwidth(m.intra_bandwidth, digits=4),
            format_time(m.intra_latency, digits=4),
        ]
        for m in topo.machines
    ]
    parts = [title, "", render_table(header, rows, right={2, 3})]
    if topo.num_machines > 1:
        names = [m.name for m in topo.machines]
        count = topo.num_machines
        bw_rows = [
            [a] + ["-" if i == j else format_bandwidth(topo.machine_bandwidth(i, j), bits=True, digits=4) for j in range(count)]
            for i, a in enumerate(names)
        ]
        parts += ["", "Inter-machine bandwidth:", render_table(["", *names], bw_rows, right=set(range(1, count + 1)))]
        latencies = {topo.machine_latency(i, j) for i in range(count) for j in range(count) if i != j}
        if len(latencies) == 1:
            parts += ["", f"Inter-machine latency: {format_time(latencies.pop(), digits=4)}"]
        else:
            lat_rows = [
                [a] + ["-" if i == j else format_time(topo.machine_latency(i, j), digits=4) for j in range(count)]
                for i, a in enumerate(names)
            ]
            parts += ["", "Inter-machine latency:", render_table(["", *names], lat_rows, right=set(range(1, count + 1)))]
    return "\n".join(parts)
