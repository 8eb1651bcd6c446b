"""Topology data model: machines of identical devices joined by a network.

Device indices are global and follow machine order (machine 0's devices first). Per-pair
queries are O(1) lookups into the machine x machine matrices precomputed in ``__post_init__``
(two devices' link is their machines' link): a topology holds O(machines^2 + devices) state.
The device x device matrices (:attr:`Topology.bandwidth_matrix`, ``latency_matrix``) are built
on first use only, for the cost model and the searches that index them by device.
Units: bytes/s for bandwidths, seconds for latencies.

Size limits (checked before anything is allocated): at most :data:`MAX_DEVICES_PER_MACHINE`
devices on one machine and :data:`MAX_DEVICES` devices (hence machines) in a topology.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import networkx as nx
import numpy as np

from tag.errors import TopologyError
from tag.topology.catalog import CPU_NAME, GPUSpec

__all__ = ["Device", "Machine", "Topology", "LinkKey", "MAX_DEVICES", "MAX_DEVICES_PER_MACHINE", "MIN_HOST_LAUNCH_S",
           "MAX_HOST_LAUNCH_S"]

# Stated limits. A machine of 256 devices is beyond any NVLink/NVSwitch domain sold today (NVL72:
# 72 GPUs); 1024 devices in all keeps the [D, D] matrices the cost model builds at 8 MB each.
# Past them a topology is refused with a one-line error instead of allocating without bound.
MAX_DEVICES_PER_MACHINE = 256
MAX_DEVICES = 1024

# Bounds of a machine's host launch cost (seconds per forward kernel launch of an eager step): a
# CUDA launch alone costs the driver a few microseconds (the H200 host's stream of tiny kernels ran
# at 9.1 us each, tag/cost/gpu_calib/H200.jsonl), and 10 ms is 180x the fitted H200 host's 55 us:
# past either bound the value is a misplaced unit ("103 ms" for "103 us").
MIN_HOST_LAUNCH_S = 1e-6
MAX_HOST_LAUNCH_S = 1e-2

LinkKey = frozenset  # frozenset({machine_name_1, machine_name_2})


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf


def _non_negative(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < math.inf


@dataclass(frozen=True)
class Device:
    """One accelerator of a topology."""

    index: int
    """Global device index (0 .. num_devices-1), machine-major."""
    machine: str
    """Name of the machine hosting it."""
    local_index: int
    """Index within its machine (e.g. the CUDA ordinal / gloo local rank)."""
    gpu: GPUSpec
    """Its capabilities."""

    @property
    def name(self) -> str:
        """``"machine:local_index"``."""
        return f"{self.machine}:{self.local_index}"


@dataclass(frozen=True)
class Machine:
    """A host with ``count`` identical devices."""

    name: str
    """Unique machine name."""
    gpu: GPUSpec
    """Spec of each of its devices."""
    count: int
    """Number of devices (>= 1)."""
    intra_bandwidth: float | None
    """Bandwidth between two devices of this machine, bytes/s (None only when count == 1)."""
    intra_latency: float
    """Latency between two devices of this machine, seconds."""
    host_launch_s: float | None = None
    """Host seconds per forward kernel launch of an eager step on this machine (the topology's
    ``host_launch``: its CPU's speed at issuing kernels, :func:`tag.cost.gpu.on_host`); None: the
    GPU rule's fitted host. GPU machines only."""
    host_memory_bytes: float | None = None
    """Bytes of host memory for training state (``host_memory``); None: the default,
    :func:`tag.topology.host.default_host_memory` (:attr:`host_memory`)."""
    host_bandwidth: float | None = None
    """Bytes/s each direction between the host and the machine's GPUs, shared by them
    (``host_bandwidth``); None: :func:`tag.topology.host.default_host_bandwidth` (:attr:`host_link`)."""
    host_memory_bandwidth: float | None = None
    """Bytes/s of the host CPU's memory, the roof of an optimizer step on the host
    (``host_memory_bandwidth``); None: the default (:attr:`host_memory_bw`)."""

    @property
    def host_memory(self) -> float:
        """Bytes of host memory (stated or default, :mod:`tag.topology.host`)."""
        from .host import default_host_memory

        return self.host_memory_bytes if self.host_memory_bytes is not None else \
            default_host_memory(self.gpu, self.count)

    @property
    def host_link(self) -> float:
        """Bytes/s each direction of the host link its GPUs share (stated or default)."""
        from .host import default_host_bandwidth

        return self.host_bandwidth if self.host_bandwidth is not None else default_host_bandwidth(self.gpu, self.count)

    @property
    def host_memory_bw(self) -> float:
        """Bytes/s of the host CPU's memory (stated or default)."""
        from .host import default_host_memory_bandwidth

        return self.host_memory_bandwidth if self.host_memory_bandwidth is not None else \
            default_host_memory_bandwidth(self.gpu)

    def __post_init__(self) -> None:
        where = f"machine {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise TopologyError(f"Machine.name: expected a non-empty string, got {self.name!r}")
        if not isinstance(self.gpu, GPUSpec):
            raise TopologyError(f"{where}: gpu: expected a GPUSpec, got {self.gpu!r}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise TopologyError(f"{where}: count: expected a positive integer, got {self.count!r}")
        if self.count > MAX_DEVICES_PER_MACHINE:
            raise TopologyError(
                f"{where}: count: at most {MAX_DEVICES_PER_MACHINE} devices per machine, got {self.count}"
            )
        if self.intra_bandwidth is None:
            if self.count > 1:
                raise TopologyError(f"{where}: intra_bandwidth: required when count > 1, got None")
        elif not _positive(self.intra_bandwidth):
            raise TopologyError(
                f"{where}: intra_bandwidth: expected a positive bandwidth in bytes/s, got {self.intra_bandwidth!r}"
            )
        if not _non_negative(self.intra_latency):
            raise TopologyError(
                f"{where}: intra_latency: expected a non-negative time in seconds, got {self.intra_latency!r}"
            )
        if self.host_launch_s is not None:
            if not (_positive(self.host_launch_s) and MIN_HOST_LAUNCH_S <= self.host_launch_s <= MAX_HOST_LAUNCH_S):
                raise TopologyError(f"{where}: host_launch: expected seconds per launch between {MIN_HOST_LAUNCH_S:g} "
                                    f"and {MAX_HOST_LAUNCH_S:g}, got {self.host_launch_s!r}")
            if self.gpu.name == CPU_NAME:
                raise TopologyError(f"{where}: host_launch: expected on a GPU machine only (the CPU rule launches "
                                    f"no kernels), got {self.host_launch_s!r} on gpu {CPU_NAME!r}")
        for key, value, what in (("host_memory", self.host_memory_bytes, "size in bytes"),
                                 ("host_bandwidth", self.host_bandwidth, "bandwidth in bytes/s"),
                                 ("host_memory_bandwidth", self.host_memory_bandwidth, "bandwidth in bytes/s")):
            if value is not None and not _positive(value):
                raise TopologyError(f"{where}: {key}: expected a positive {what}, got {value!r}")


@dataclass(frozen=True)
class Topology:
    """Machines joined by a network with a default bandwidth/latency and per-pair overrides."""

    name: str
    """Topology name."""
    machines: tuple[Machine, ...]
    """Machines in device-index order."""
    network_bandwidth: float
    """Default bandwidth between two machines, bytes/s."""
    network_latency: float
    """Default latency between two machines, seconds."""
    links: dict[frozenset, tuple[float, float]] = field(default_factory=dict)
    """Overrides: frozenset({m1, m2}) -> (bandwidth bytes/s, latency seconds)."""
    background: dict = field(default_factory=dict)
    """Traffic of other jobs (:mod:`tag.topology.background`): a machine name (its NIC) or
    frozenset({m1, m2}) (their link) -> :class:`~tag.topology.background.Background`."""

    # Derived, precomputed in __post_init__ (not compared, not part of the constructor).
    devices: list[Device] = field(init=False, repr=False, compare=False)
    """All devices, indexed by global index."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "machines", tuple(self.machines))
        object.__setattr__(self, "links", dict(self.links))
        object.__setattr__(self, "background", dict(self.background))
        self._validate()
        names = [m.name for m in self.machines]
        index_of = {n: k for k, n in enumerate(names)}
        num_m = len(self.machines)
        m_bw = np.full((num_m, num_m), float(self.network_bandwidth))
        m_lat = np.full((num_m, num_m), float(self.network_latency))
        for pair, (bw, lat) in self.links.items():
            a, b = (index_of[n] for n in sorted(pair))
            m_bw[a, b] = m_bw[b, a] = bw
            m_lat[a, b] = m_lat[b, a] = lat
        devices: list[Device] = []
        machine_of: list[int] = []
        for k, m in enumerate(self.machines):
            m_bw[k, k] = math.inf if m.intra_bandwidth is None else m.intra_bandwidth
            m_lat[k, k] = m.intra_latency
            for local in range(m.count):
                devices.append(Device(len(devices), m.name, local, m.gpu))
                machine_of.append(k)
        for arr in (m_bw, m_lat):
            arr.setflags(write=False)
        per_machine: list[list[int]] = [[] for _ in self.machines]
        for d, k in enumerate(machine_of):
            per_machine[k].append(d)
        derived = {
            "devices": devices,
            "_machine_of": tuple(machine_of),
            "_per_machine": tuple(tuple(ds) for ds in per_machine),
            "_machine_index": index_of,
            "_m_bw": m_bw,
            "_m_lat": m_lat,
            # Nested Python lists: scalar lookups are ~5x faster than numpy item access.
            "_m_bw_rows": m_bw.tolist(),
            "_m_lat_rows": m_lat.tolist(),
        }
        for key, value in derived.items():
            object.__setattr__(self, key, value)

    def _validate(self) -> None:
        where = f"topology {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise TopologyError(f"Topology.name: expected a non-empty string, got {self.name!r}")
        if not self.machines:
            raise TopologyError(f"{where}: machines: expected at least one machine, got none")
        seen: set[str] = set()
        for k, m in enumerate(self.machines):
            if not isinstance(m, Machine):
                raise TopologyError(f"{where}: machines[{k}]: expected a Machine, got {m!r}")
            if m.name in seen:
                raise TopologyError(f"{where}: machines[{k}].name: duplicate machine name {m.name!r}")
            seen.add(m.name)
        total = sum(m.count for m in self.machines)
        if total > MAX_DEVICES:
            raise TopologyError(f"{where}: machines: at most {MAX_DEVICES} devices in a topology, got {total}")
        if not _positive(self.network_bandwidth):
            raise TopologyError(
                f"{where}: network.bandwidth: expected a positive bandwidth in bytes/s, got {self.network_bandwidth!r}"
            )
        if not _non_negative(self.network_latency):
            raise TopologyError(
                f"{where}: network.latency: expected a non-negative time in seconds, got {self.network_latency!r}"
            )
        for pair, value in self.links.items():
            if not isinstance(pair, frozenset) or len(pair) != 2 or not pair <= seen:
                raise TopologyError(
                    f"{where}: network.links: expected a key frozenset of two distinct known machine names, got {pair!r}"
                )
            if not (isinstance(value, tuple) and len(value) == 2 and _positive(value[0]) and _non_negative(value[1])):
                raise TopologyError(
                    f"{where}: network.links[{sorted(pair)}]: expected (bandwidth > 0, latency >= 0), got {value!r}"
                )

        from .background import Background

        names = {m.name for m in self.machines}
        for key, bg in self.background.items():
            if not (key in names or (isinstance(key, frozenset) and len(key) == 2 and key <= names)) or \
                    not isinstance(bg, Background):
                raise TopologyError(f"{where}: background: expected a known machine name or a frozenset of two -> "
                                    f"Background, got {key!r}: {bg!r}")

    def __hash__(self) -> int:
        return hash(self.signature())

    # ------------------------------------------------------------------------------ queries

    @property
    def num_devices(self) -> int:
        """Total number of devices."""
        return len(self.devices)

    @property
    def num_machines(self) -> int:
        return len(self.machines)

    def machine_of(self, device: int) -> int:
        """Index of the machine hosting global device ``device``."""
        return self._machine_of[device]

    def devices_of_machine(self, machine: int) -> list[int]:
        """Global device indices of machine index ``machine``."""
        return list(self._per_machine[machine])

    def machine_index(self, name: str) -> int:
        """Index of the machine called ``name`` (KeyError if unknown)."""
        return self._machine_index[name]

    def restricted(self, machines) -> tuple[Topology, list[int]]:
        """``(sub-topology, devices)``: the machines of indices ``machines`` (kept in this
        topology's order) with the links between them, and the global device index here of each
        device of the sub-topology (its device ``i`` is device ``devices[i]`` of this one)."""
        keep = sorted(set(int(m) for m in machines))
        if not keep or keep[0] < 0 or keep[-1] >= self.num_machines:
            raise TopologyError(f"topology {self.name!r}: restricted: expected machine indices in "
                                f"0..{self.num_machines - 1}, got {list(machines)!r}")
        names = {self.machines[m].name for m in keep}
        sub = Topology(f"{self.name}[{','.join(self.machines[m].name for m in keep)}]",
                       tuple(self.machines[m] for m in keep), self.network_bandwidth, self.network_latency,
                       {pair: v for pair, v in self.links.items() if pair <= names},
                       {k: v for k, v in self.background.items() if (k <= names if isinstance(k, frozenset) else k in names)})
        return sub, [d for m in keep for d in self._per_machine[m]]

    def bandwidth(self, i: int, j: int) -> float:
        """Bandwidth between devices ``i`` and ``j``, bytes/s (inf when i == j)."""
        if i == j:
            return math.inf
        mo = self._machine_of
        return self._m_bw_rows[mo[i]][mo[j]]

    def latency(self, i: int, j: int) -> float:
        """Latency between devices ``i`` and ``j``, seconds (0 when i == j)."""
        if i == j:
            return 0.0
        mo = self._machine_of
        return self._m_lat_rows[mo[i]][mo[j]]

    def _device_matrix(self, per_machine: np.ndarray, diagonal: float) -> np.ndarray:
        """[D, D] read-only expansion of a [M, M] machine matrix, ``diagonal`` on the diagonal."""
        mo = np.asarray(self._machine_of, dtype=np.int64)
        out = per_machine[np.ix_(mo, mo)]
        np.fill_diagonal(out, diagonal)
        out.setflags(write=False)
        return out

    @cached_property
    def bandwidth_matrix(self) -> np.ndarray:
        """[D, D] bytes/s between devices (read-only; diagonal inf), built on first use."""
        return self._device_matrix(self._m_bw, math.inf)

    @cached_property
    def latency_matrix(self) -> np.ndarray:
        """[D, D] seconds between devices (read-only; diagonal 0), built on first use."""
        return self._device_matrix(self._m_lat, 0.0)

    def machine_bandwidth(self, m1: int, m2: int) -> float:
        """Bandwidth between machine indices (``m1 == m2``: the intra-machine bandwidth), bytes/s."""
        return self._m_bw_rows[m1][m2]

    def machine_latency(self, m1: int, m2: int) -> float:
        """Latency between machine indices (``m1 == m2``: the intra-machine latency), seconds."""
        return self._m_lat_rows[m1][m2]

    @property
    def machine_bandwidth_matrix(self) -> np.ndarray:
        """[M, M] bytes/s; the diagonal holds intra-machine bandwidths."""
        return self._m_bw

    @property
    def machine_latency_matrix(self) -> np.ndarray:
        """[M, M] seconds; the diagonal holds intra-machine latencies."""
        return self._m_lat

    @cached_property
    def graph(self) -> nx.Graph:
        """Complete graph of devices (frozen: shared between callers, copy it to modify).

        Nodes: global device index with attrs ``name``, ``machine``, ``machine_index``,
        ``local_index``, ``gpu`` (spec name), ``fp32_flops``, ``fp16_flops``, ``memory_bytes``,
        ``memory_bandwidth``. Edges: ``bandwidth`` (bytes/s), ``latency`` (s)."""
        g = nx.Graph(name=self.name)
        for d in self.devices:
            g.add_node(
                d.index,
                name=d.name,
                machine=d.machine,
                machine_index=self._machine_of[d.index],
                local_index=d.local_index,
                gpu=d.gpu.name,
                fp32_flops=d.gpu.fp32_flops,
                fp16_flops=d.gpu.fp16_flops,
                memory_bytes=d.gpu.memory_bytes,
                memory_bandwidth=d.gpu.memory_bandwidth,
            )
        n = self.num_devices
        for i in range(n):
            for j in range(i + 1, n):
                g.add_edge(i, j, bandwidth=self.bandwidth(i, j), latency=self.latency(i, j))
        return nx.freeze(g)

    # ------------------------------------------------------------------------------ serialization

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (base units: bytes, bytes/s, s, FLOP/s) accepted by ``load_topology``."""
        machines = []
        for m in self.machines:
            entry: dict[str, Any] = {
                "name": m.name,
                "gpu": {
                    "name": m.gpu.name,
                    "fp32_flops": m.gpu.fp32_flops,
                    "fp16_flops": m.gpu.fp16_flops,
                    "memory": m.gpu.memory_bytes,
                    "memory_bandwidth": m.gpu.memory_bandwidth,
                },
                "count": m.count,
            }
            if m.intra_bandwidth is not None:
                entry["intra_bandwidth"] = m.intra_bandwidth
            entry["intra_latency"] = m.intra_latency
            if m.host_launch_s is not None:  # (absent otherwise: older topologies keep their signature)
                entry["host_launch"] = m.host_launch_s
            for key, value in (("host_memory", m.host_memory_bytes), ("host_bandwidth", m.host_bandwidth),
                               ("host_memory_bandwidth", m.host_memory_bandwidth)):
                if value is not None:  # (likewise)
                    entry[key] = value
            if m.name in self.background:  # (likewise)
                entry["background"] = self.background[m.name].to_dict()
            machines.append(entry)
        network: dict[str, Any] = {"bandwidth": self.network_bandwidth, "latency": self.network_latency}
        order = self._machine_index
        links = []
        for pair, (bw, lat) in self.links.items():
            a, b = sorted(pair, key=order.__getitem__)
            links.append({"between": [a, b], "bandwidth": bw, "latency": lat})
            if pair in self.background:
                links[-1]["background"] = self.background[pair].to_dict()
        if links:
            network["links"] = sorted(links, key=lambda e: (order[e["between"][0]], order[e["between"][1]]))
        return {"name": self.name, "machines": machines, "network": network}

    def signature(self) -> str:
        """Stable 16-hex-digit hash of :meth:`to_dict` (same topology -> same signature).

        Devices named ``cpu`` (the local CPU, whose figures are measured on the host that loads
        the file, :func:`tag.topology.catalog.local_cpu_spec`) are hashed by that name alone: a
        plan made for ``topologies/local-cpu2.yaml`` on one host still matches the same file on
        another host, or after the measurement cache was refreshed."""
        d = self.to_dict()
        for m in d["machines"]:
            if m["gpu"]["name"] == CPU_NAME:
                m["gpu"] = CPU_NAME
        text = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]
