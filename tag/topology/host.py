"""A machine's host: its memory, its GPUs' link to it and its CPU's memory bandwidth, what
offloading training state to the host (:mod:`tag.parallel.sharded`'s ``offload``) is costed by.

A topology machine may state (units as strings, :mod:`tag.topology.units`):

* ``host_memory`` (``"256 GB"``): the host's memory for training state. Default
  :func:`default_host_memory`: twice the machine's GPU memory, DGX-1's ratio (512 GB of DDR4 for
  8 x V100-32GB, NVIDIA DGX-1 with Tesla V100 system architecture whitepaper, WP-08437-002), the
  lowest of NVIDIA's DGX systems (DGX A100: 1 TB or 2 TB for 320 GB or 640 GB of GPU memory,
  3.2x; DGX H100: 2 TB for 640 GB, 3.2x).
* ``host_bandwidth`` (``"25 GB/s"``): host <-> GPU bandwidth of the whole machine, each direction,
  shared by its GPUs (the simulator's host link, one per machine). Default
  :func:`default_host_bandwidth`: one PCIe x16 link of the GPU kind's generation (:data:`HOST_LINK`,
  typical measured pinned-memory copy rates) for every two GPUs: DGX-1, DGX A100 and HGX boards
  put GPUs in pairs behind a PCIe switch with one x16 uplink to a CPU (DGX-1 whitepaper above,
  figure 6; NVIDIA DGX A100 system architecture whitepaper, WP-10083-001, figure 7). A box whose
  GPUs share fewer lanes (a workstation's 4 GPUs on one x16 root port) states its own.
* ``host_memory_bandwidth`` (``"100 GB/s"``): the host CPU's memory bandwidth, the roof of its
  optimizer step (Adam on the host reads and writes every state element once: memory bound, as
  DeepSpeed's CPU-Adam). Default :data:`DEFAULT_HOST_MEMORY_BANDWIDTH`.

A CPU machine (gpu ``cpu``) is its own host: its link and its memory bandwidth are the CPU's
measured memory bandwidth, its host memory the CPU's memory.
"""

from __future__ import annotations

import math

from .catalog import CPU_NAME

GB = 1e9

PCIE3_X16 = 12 * GB
"""Bytes/s each direction of a PCIe 3.0 x16 link as copies measure it (pinned host memory,
cuda-samples ``bandwidthTest``: 12-13 GB/s of the link's 15.75 GB/s)."""
PCIE4_X16 = 25 * GB
"""PCIe 4.0 x16: 24-26 GB/s measured of 31.5 GB/s."""
PCIE5_X16 = 50 * GB
"""PCIe 5.0 x16: ~50 GB/s measured of 63 GB/s."""
NVLINK_C2C = 450 * GB
"""GH200's NVLink-C2C between Grace and Hopper: 900 GB/s both directions (GH200 datasheet), 450 each."""

HOST_LINK: dict[str, float] = {
    **{n: PCIE3_X16 for n in ("P100-SXM2-16GB", "P100-PCIe-16GB", "V100-PCIe-16GB", "V100-PCIe-32GB",
                              "V100-SXM2-16GB", "V100-SXM2-32GB", "GTX-1080Ti", "RTX-2080Ti", "T4", "Titan-RTX")},
    **{n: PCIE4_X16 for n in ("RTX-3090", "A10", "A100-40GB", "A100-80GB", "A100-PCIe-80GB", "L4", "L40S")},
    **{n: PCIE5_X16 for n in ("H100-SXM", "H100-PCIe", "H200")},
    "GH200-96GB": NVLINK_C2C,
}
"""Catalog GPU -> bytes/s each direction of its host link (its PCIe generation's x16 link)."""
DEFAULT_HOST_LINK = PCIE4_X16
"""An inline or unknown GPU's host link."""
DEFAULT_HOST_MEMORY_BANDWIDTH = 100 * GB
"""Bytes/s of the host CPU's memory: a STREAM-triad order of one socket of a 2019-2023 server
(6-8 channels of DDR4-2933/3200: 141-205 GB/s peak), rounded down: a host's optimizer step is not
priced faster than it likely runs."""
HOST_MEMORY_PER_GPU_MEMORY = 2.0
"""Default host memory over the machine's GPU memory (DGX-1's ratio, module docstring)."""


def default_host_memory(gpu, count: int) -> float:
    """Bytes of host memory of a machine of ``count`` ``gpu`` devices stating none."""
    if gpu.name == CPU_NAME:
        return float(gpu.memory_bytes)
    return HOST_MEMORY_PER_GPU_MEMORY * count * float(gpu.memory_bytes)


def default_host_bandwidth(gpu, count: int) -> float:
    """Bytes/s each direction of the host link of a machine of ``count`` ``gpu`` devices stating none."""
    if gpu.name == CPU_NAME:
        return float(gpu.memory_bandwidth)
    return math.ceil(count / 2) * HOST_LINK.get(gpu.name, DEFAULT_HOST_LINK)


def default_host_memory_bandwidth(gpu) -> float:
    """Bytes/s of the host CPU's memory of a machine of ``gpu`` devices stating none."""
    return float(gpu.memory_bandwidth) if gpu.name == CPU_NAME else DEFAULT_HOST_MEMORY_BANDWIDTH


__all__ = ["DEFAULT_HOST_LINK", "DEFAULT_HOST_MEMORY_BANDWIDTH", "HOST_LINK", "HOST_MEMORY_PER_GPU_MEMORY",
           "default_host_bandwidth", "default_host_memory", "default_host_memory_bandwidth"]
