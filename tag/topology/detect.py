"""Describe the local machine as a :class:`Topology` (and write topologies as YAML).

With CUDA: one machine holding the visible GPUs (catalog spec when ``get_device_name`` matches,
else a spec measured on the device); intra-machine bandwidth measured by a device-to-device copy
when there are >= 2 GPUs. GPUs of different kinds become one machine per kind (the model assumes
identical devices per machine), named ``<host>-<k>``. Without CUDA: one machine with one ``cpu``
device (:func:`local_cpu_spec`).

A single-machine topology never uses its network, but the model needs a valid one: we use the
machine's intra bandwidth (or, with a single device, its memory bandwidth).
"""

from __future__ import annotations

import re
import socket
import time

from tag.topology.catalog import GPUSpec, _round_sig, local_cpu_spec, match_gpu_name
from tag.topology.loader import DEFAULT_INTRA_LATENCY, DEFAULT_NETWORK_LATENCY, dump_topology
from tag.topology.model import Machine, Topology

__all__ = ["detect_topology", "dump_topology"]


def _host_name() -> str:
    return re.sub(r"[\s:]+", "-", socket.gethostname()) or "localhost"


def _best_seconds(fn, sync, repeats: int = 5) -> float:
    fn()  # warm-up
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _measure_cuda_spec(ordinal: int, name: str) -> GPUSpec:
    """Spec of an uncatalogued GPU: memory from device properties, rates from short benchmarks."""
    import torch

    device = torch.device("cuda", ordinal)
    props = torch.cuda.get_device_properties(ordinal)

    def sync() -> None:
        torch.cuda.synchronize(device)

    n = 4096  # 2 * n^3 = 137 GFLOP: milliseconds on any recent GPU
    rates = {}
    for dtype in (torch.float32, torch.float16):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        rates[dtype] = 2.0 * n**3 / _best_seconds(lambda a=a, b=b: torch.mm(a, b), sync)
        del a, b
    elements = 64 * 2**20  # 256 MiB of float32, far larger than L2
    src = torch.ones(elements, device=device)
    dst = torch.empty_like(src)
    # A copy reads and writes each byte: 2x the tensor size moved.
    bandwidth = 2.0 * elements * 4 / _best_seconds(lambda: dst.copy_(src), sync)
    return GPUSpec(
        name,
        _round_sig(rates[torch.float32]),
        _round_sig(rates[torch.float16]),
        int(props.total_memory),
        _round_sig(bandwidth),
    )


def _measure_p2p_bandwidth(src_ordinal: int, dst_ordinal: int) -> float:
    """One-direction device-to-device copy bandwidth, bytes/s."""
    import torch

    elements = 64 * 2**20  # 256 MiB of float32
    src = torch.ones(elements, device=torch.device("cuda", src_ordinal))
    dst = torch.empty(elements, device=torch.device("cuda", dst_ordinal))

    def sync() -> None:
        torch.cuda.synchronize(src_ordinal)
        torch.cuda.synchronize(dst_ordinal)

    seconds = _best_seconds(lambda: dst.copy_(src), sync)
    return _round_sig(elements * 4 / seconds)


def detect_topology(name: str | None = None) -> Topology:
    """Topology of this machine (see module docstring); ``name`` defaults to ``local-<host>``."""
    import torch

    host = _host_name()
    topo_name = name or f"local-{host}"
    if not (torch.cuda.is_available() and torch.cuda.device_count() > 0):
        cpu = local_cpu_spec()
        machine = Machine(host, cpu, 1, None, DEFAULT_INTRA_LATENCY)
        return Topology(topo_name, (machine,), cpu.memory_bandwidth, DEFAULT_NETWORK_LATENCY)

    groups: dict[str, list[int]] = {}
    for ordinal in range(torch.cuda.device_count()):
        groups.setdefault(torch.cuda.get_device_name(ordinal), []).append(ordinal)
    machines = []
    for k, (gpu_name, ordinals) in enumerate(groups.items()):
        spec = match_gpu_name(gpu_name) or _measure_cuda_spec(ordinals[0], gpu_name)
        intra = _measure_p2p_bandwidth(ordinals[0], ordinals[1]) if len(ordinals) > 1 else None
        machine_name = host if len(groups) == 1 else f"{host}-{k}"
        machines.append(Machine(machine_name, spec, len(ordinals), intra, DEFAULT_INTRA_LATENCY))
    firsts = [ordinals[0] for ordinals in groups.values()]
    if len(firsts) > 1:  # the "machines" share one host: measure a copy between two kinds
        network, latency = _measure_p2p_bandwidth(firsts[0], firsts[1]), DEFAULT_INTRA_LATENCY
    else:
        only = machines[0]
        network = only.intra_bandwidth if only.intra_bandwidth is not None else only.gpu.memory_bandwidth
        latency = DEFAULT_NETWORK_LATENCY
    return Topology(topo_name, tuple(machines), network, latency)
