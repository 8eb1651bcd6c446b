"""Plain-text rendering of a topology: a machine table and the inter-machine bandwidth matrix."""

from __future__ import annotations

import re

from tag.topology.host import DEFAULT_HOST_MEMORY_BANDWIDTH
from tag.topology.model import Topology
from tag.topology.units import format_bandwidth, format_bytes, format_count, format_time

__all__ = ["format_topology", "render_table"]


_NUMERIC = re.compile(r"^([-+]?\d|-$|n/a$)")


def render_table(header: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    """Columns padded to their widest cell; ``right`` = column indices aligned right (default:
    every column whose cells are all numbers or quantities, e.g. ``16 GiB``, or ``-``)."""
    if right is None:
        right = {c for c in range(len(header))
                 if rows and all(_NUMERIC.match(str(r[c])) for r in rows) and any(str(r[c]) != "-" for r in rows)}
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        parts = [str(v).rjust(w) if c in right else str(v).ljust(w) for c, (v, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths).rstrip()
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


FOLD_MACHINES = 8
"""Machines above which consecutive machines with alike rows share one row of the machine table."""


def format_topology(topo: Topology) -> str:
    """Readable summary: machines (gpu, count, FP32 TFLOP/s, memory, memory and intra bandwidth,
    intra latency), then the machine x machine network bandwidth (and latency when not uniform)."""
    title = (
        f"Topology {topo.name!r}: {format_count(topo.num_machines, 'machine')}, "
        f"{format_count(topo.num_devices, 'device')}, "
        f"signature {topo.signature()}"
    )
    header = ["machine", "gpu", "count", "fp32 TFLOP/s", "memory", "mem bw", "intra bw", "intra lat", "host mem",
              "host link"]
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
            format_bytes(m.host_memory, digits=4) + ("" if m.host_memory_bytes is not None else "*"),
            format_bandwidth(m.host_link, digits=4) + ("" if m.host_bandwidth is not None else "*"),
        ]
        for m in topo.machines
    ]
    if topo.num_machines > FOLD_MACHINES:  # runs of alike machines: h100-00..h100-63 (64 machines)
        runs: list[list] = []
        for r in rows:
            if runs and runs[-1][0][1:] == r[1:]:
                runs[-1].append(r)
            else:
                runs.append([r])
        rows = [run[0] if len(run) == 1 else [f"{run[0][0]}..{run[-1][0]} ({len(run)} machines)", *run[0][1:]]
                for run in runs]
    parts = [title, "", render_table(header, rows)]
    if any(m.host_memory_bytes is None or m.host_bandwidth is None for m in topo.machines):
        parts.append("* default (tag.topology.host): host memory 2x the machine's GPU memory; host link (each "
                     "direction, shared by its GPUs) one PCIe x16 of the GPU's generation per 2 GPUs; host CPU memory bandwidth "
                     f"{format_bandwidth(DEFAULT_HOST_MEMORY_BANDWIDTH)} unless stated")
    if topo.num_machines > 1:
        names = [m.name for m in topo.machines]
        count = topo.num_machines
        bandwidths = {topo.machine_bandwidth(i, j) for i in range(count) for j in range(count) if i != j}
        if len(bandwidths) == 1:
            parts += ["", f"Inter-machine bandwidth: {format_bandwidth(bandwidths.pop(), bits=True, digits=4)}"]
        else:
            bw_rows = [
                [a] + ["-" if i == j else format_bandwidth(topo.machine_bandwidth(i, j), bits=True, digits=4)
                       for j in range(count)]
                for i, a in enumerate(names)
            ]
            parts += ["", "Inter-machine bandwidth:", render_table(["", *names], bw_rows)]
        latencies = {topo.machine_latency(i, j) for i in range(count) for j in range(count) if i != j}
        if len(latencies) == 1:
            parts += ["", f"Inter-machine latency: {format_time(latencies.pop(), digits=4)}"]
        else:
            lat_rows = [
                [a] + ["-" if i == j else format_time(topo.machine_latency(i, j), digits=4) for j in range(count)]
                for i, a in enumerate(names)
            ]
            parts += ["", "Inter-machine latency:", render_table(["", *names], lat_rows)]
    return "\n".join(parts)
