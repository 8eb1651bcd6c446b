"""GPU catalog: datasheet compute / memory figures, plus a measured spec for the local CPU.

All figures are the vendor's published peak numbers (dense, i.e. without 2:4 sparsity). Memory
sizes marketed as "16 GB" on GPUs are 16 GiB of physical memory (HBM/GDDR parts come in powers
of two), so they are stored as GiB; memory bandwidths are decimal (GB/s = 1e9 bytes/s) as in the
datasheets.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import platform
import re
import time
from dataclasses import asdict, dataclass
from types import MappingProxyType

from tag.errors import TopologyError

from ..io import cache_dir, total_ram_bytes, write_atomic

__all__ = ["GPUSpec", "GPU_CATALOG", "get_gpu", "match_gpu_name", "local_cpu_spec", "cache_dir"]

GiB = 2**30  # bytes
GB = 10**9  # bytes (and GB/s = 1e9 bytes/s)
TFLOPS = 1e12  # FLOP/s


@dataclass(frozen=True)
class GPUSpec:
    """Peak capabilities of one accelerator (or of the local CPU, measured)."""

    name: str
    """Catalog / display name, e.g. ``"V100-SXM2-16GB"``."""
    fp32_flops: float
    """Dense FP32 peak, FLOP/s."""
    fp16_flops: float
    """Dense FP16/BF16 peak (tensor cores where present, FP32 accumulate), FLOP/s."""
    memory_bytes: int
    """Device memory capacity, bytes."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TopologyError(f"GPUSpec.name: expected a non-empty string, got {self.name!r}")
        for field_name in ("fp32_flops", "fp16_flops", "memory_bandwidth"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise TopologyError(
                    f"GPUSpec({self.name}).{field_name}: expected a positive finite number, got {value!r}"
                )
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes <= 0:
            raise TopologyError(
                f"GPUSpec({self.name}).memory_bytes: expected a positive integer, got {self.memory_bytes!r}"
            )


def _spec(name: str, fp32_tflops: float, fp16_tflops: float, memory_gib: int, bandwidth_gbs: float) -> GPUSpec:
    return GPUSpec(name, fp32_tflops * TFLOPS, fp16_tflops * TFLOPS, memory_gib * GiB, float(bandwidth_gbs * GB))


GPU_CATALOG: MappingProxyType[str, GPUSpec] = MappingProxyType({
    spec.name: spec
    for spec in (
        # NVIDIA Tesla P100 datasheet (2016): SXM2 10.6 FP32 / 21.2 FP16 TFLOPS, 16 GB HBM2 at 732 GB/s.
        _spec("P100-SXM2-16GB", 10.6, 21.2, 16, 732),
        # Same datasheet, PCIe 16 GB: 9.3 FP32 / 18.7 FP16 TFLOPS, 732 GB/s.
        _spec("P100-PCIe-16GB", 9.3, 18.7, 16, 732),
        # NVIDIA Tesla V100 datasheet (2018): PCIe 14 FP32 / 112 tensor TFLOPS, 16|32 GB HBM2, 900 GB/s.
        _spec("V100-PCIe-16GB", 14.0, 112.0, 16, 900),
        _spec("V100-PCIe-32GB", 14.0, 112.0, 32, 900),
        # Same datasheet, SXM2 (NVLink): 15.7 FP32 / 125 tensor TFLOPS, 900 GB/s.
        _spec("V100-SXM2-16GB", 15.7, 125.0, 16, 900),
        _spec("V100-SXM2-32GB", 15.7, 125.0, 32, 900),
        # NVIDIA GeForce GTX 1080 Ti specifications: 3584 cores x 1582 MHz boost x 2 = 11.34 TFLOPS FP32,
        # 11 GB GDDR5X, 11 Gbps x 352 bit = 484 GB/s. GP102 has no tensor cores and runs FP16 math at
        # 1/64 of the FP32 rate (Pascal tuning guide), hence 11.34 / 64.
        _spec("GTX-1080Ti", 11.34, 11.34 / 64, 11, 484),
        # NVIDIA Turing architecture whitepaper (WP-09183-001), table 1, reference RTX 2080 Ti:
        # 13.4 TFLOPS FP32, 53.8 TFLOPS FP16 tensor with FP32 accumulate, 11 GB GDDR6, 616 GB/s.
        _spec("RTX-2080Ti", 13.4, 53.8, 11, 616),
        # NVIDIA T4 datasheet: 8.1 TFLOPS FP32, 65 TFLOPS mixed FP16/FP32, 16 GB GDDR6, 320 GB/s.
        _spec("T4", 8.1, 65.0, 16, 320),
        # NVIDIA Ampere GA102 whitepaper, RTX 3090: 35.6 TFLOPS FP32, 71 TFLOPS FP16 tensor with FP32
        # accumulate (dense), 24 GB GDDR6X, 936 GB/s.
        _spec("RTX-3090", 35.6, 71.0, 24, 936),
        # NVIDIA A10 datasheet: 31.2 TFLOPS FP32, 125 TFLOPS BF16/FP16 tensor (dense), 24 GB GDDR6, 600 GB/s.
        _spec("A10", 31.2, 125.0, 24, 600),
        # NVIDIA A100 datasheet: 19.5 TFLOPS FP32, 312 TFLOPS BF16/FP16 tensor (dense);
        # 40 GB HBM2 at 1,555 GB/s; 80 GB HBM2e at 2,039 GB/s (SXM) and 1,935 GB/s (PCIe).
        _spec("A100-40GB", 19.5, 312.0, 40, 1555),
        _spec("A100-80GB", 19.5, 312.0, 80, 2039),
        _spec("A100-PCIe-80GB", 19.5, 312.0, 80, 1935),
        # NVIDIA L4 datasheet: 30.3 TFLOPS FP32, 242 TFLOPS FP16 tensor with sparsity (121 dense),
        # 24 GB GDDR6, 300 GB/s.
        _spec("L4", 30.3, 121.0, 24, 300),
        # NVIDIA L40S datasheet: 91.6 TFLOPS FP32, 733 TFLOPS BF16 tensor with sparsity (362.05 dense),
        # 48 GB GDDR6, 864 GB/s.
        _spec("L40S", 91.6, 362.05, 48, 864),
        # NVIDIA H100 datasheet: SXM 67 TFLOPS FP32, 1,979 TFLOPS BF16 with sparsity (989.5 dense),
        # 80 GB HBM3 at 3.35 TB/s.
        _spec("H100-SXM", 67.0, 989.5, 80, 3350),
        # Same datasheet, PCIe: 51 TFLOPS FP32, 1,513 BF16 with sparsity (756.5 dense), 80 GB at 2 TB/s.
        _spec("H100-PCIe", 51.0, 756.5, 80, 2000),
        # NVIDIA H200 datasheet: SXM 67 TFLOPS FP32, 1,979 TFLOPS BF16 with sparsity (989.5 dense),
        # 141 GB HBM3e at 4.8 TB/s.
        _spec("H200", 67.0, 989.5, 141, 4800),
        # NVIDIA GH200 Grace Hopper Superchip datasheet (2023), its Hopper GPU: 67 TFLOPS FP32, 1,979
        # TFLOPS BF16/FP16 with sparsity (989.5 dense), 96 GB HBM3 at 4 TB/s (the 144 GB HBM3e part: 4.9
        # TB/s). The Alps (CSCS) GH200 nodes hold four of the 96 GB parts.
        _spec("GH200-96GB", 67.0, 989.5, 96, 4000),
        # NVIDIA TITAN RTX specifications (TU102, 2018): 4608 CUDA cores x 1770 MHz boost x 2 = 16.3 TFLOPS
        # FP32, 130 TFLOPS FP16 tensor (full-rate FP32 accumulate, unlike the GeForce RTX 2080 Ti's
        # half rate), 24 GB GDDR6, 14 Gbps x 384 bit = 672 GB/s.
        _spec("Titan-RTX", 16.3, 130.0, 24, 672),
    )
})

# Extra spellings (e.g. what ``torch.cuda.get_device_name`` reports) -> catalog name.
_ALIASES = MappingProxyType({
    "P100": "P100-PCIe-16GB",
    "A100-SXM4-40GB": "A100-40GB",
    "A100-PCIe-40GB": "A100-40GB",  # same compute and memory bandwidth as the SXM4 part
    "A100-SXM4-80GB": "A100-80GB",
    "A100-80GB-PCIe": "A100-PCIe-80GB",
    "H100": "H100-SXM",
    "H100-80GB-HBM3": "H100-SXM",
    "H100-SXM5-80GB": "H100-SXM",
    "H200-SXM": "H200",
    "H200-141GB": "H200",
    "H200-SXM-141GB": "H200",
})

CPU_NAME = "cpu"
_VENDOR_PREFIX = re.compile(r"^(nvidia|tesla|geforce|quadro)+")


def _normalize(name: str) -> str:
    """Lower-case and drop '-', '_', spaces and vendor words: 'Tesla V100-SXM2-16GB' -> 'v100sxm216gb'."""
    return _VENDOR_PREFIX.sub("", re.sub(r"[\s_\-]+", "", name.lower()))


def _lookup_table() -> dict[str, str]:
    table = {_normalize(name): name for name in GPU_CATALOG}
    table.update({_normalize(alias): target for alias, target in _ALIASES.items()})
    return table


def match_gpu_name(name: str) -> GPUSpec | None:
    """Catalog entry for ``name`` (tolerant of case, '-', '_', spaces, 'NVIDIA'/'Tesla' prefixes), or None."""
    target = _lookup_table().get(_normalize(name))
    return GPU_CATALOG[target] if target is not None else None


def get_gpu(name: str) -> GPUSpec:
    """Catalog entry for ``name``; ``"cpu"`` gives the measured :func:`local_cpu_spec`.

    Raises KeyError (one-line message with close matches) for an unknown name."""
    if _normalize(name) == CPU_NAME:
        return local_cpu_spec()
    spec = match_gpu_name(name)
    if spec is not None:
        return spec
    table = _lookup_table()
    close = difflib.get_close_matches(_normalize(name), list(table), n=4, cutoff=0.5)
    names = list(dict.fromkeys(table[c] for c in close))
    hint = f"close matches: {', '.join(names)}" if names else f"known: {', '.join(GPU_CATALOG)}, cpu"
    raise KeyError(f"unknown GPU {name!r} ({hint})")


# ------------------------------------------------------------------------------------- local CPU


def _round_sig(value: float, digits: int = 3) -> float:
    """Round a measurement to a few significant digits (noise is larger than that anyway)."""
    return float(f"{value:.{digits - 1}e}")


def _best_rate(fn, work: float, budget_s: float) -> float:
    """Best observed ``work / seconds`` of ``fn`` over roughly ``budget_s`` seconds."""
    fn()  # warm-up (allocations, thread pool start)
    best = 0.0
    deadline = time.perf_counter() + budget_s
    while True:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best = max(best, work / max(elapsed, 1e-9))
        if time.perf_counter() > deadline:
            return best


def _measure_cpu() -> GPUSpec:
    import torch

    n = 512  # 2 * n^3 = 268 MFLOP per matmul: a few ms on a laptop core, far below the budget
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = _best_rate(lambda: torch.mm(a, b), 2.0 * n**3, budget_s=0.35)
    elements = 16 * 2**20  # 64 MiB of float32: larger than any last-level cache
    src, dst = torch.ones(elements), torch.empty(elements)
    # A copy reads and writes every byte, hence 2x the tensor size moved per call.
    bandwidth = _best_rate(lambda: dst.copy_(src), 2.0 * elements * 4, budget_s=0.35)
    flops = _round_sig(flops)
    # CPU autocast matmuls are not faster than FP32 on typical CPUs: use the FP32 rate for both.
    return GPUSpec(CPU_NAME, flops, flops, total_ram_bytes(), _round_sig(bandwidth))


def local_cpu_spec(*, refresh: bool = False) -> GPUSpec:
    """Measured spec of this machine's CPU as a device (< 1.5 s the first time, then cached).

    The cache (``cache_dir()/cpu_spec.json``) is keyed by host name, ``torch.get_num_threads()``
    and torch version, so changing the thread count re-measures."""
    import torch

    key = f"{platform.node()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
    path = cache_dir() / "cpu_spec.json"
    entries: dict = {}
    with contextlib.suppress(OSError, ValueError):
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict):
            entries = {}
    if not refresh and isinstance(entries.get(key), dict):
        with contextlib.suppress(Exception):  # a corrupt entry is re-measured
            return GPUSpec(**entries[key])
    spec = _measure_cpu()
    entries[key] = asdict(spec)
    with contextlib.suppress(OSError):  # an unwritable cache only costs a re-measurement
        write_atomic(path, json.dumps(entries, indent=1, sort_keys=True))
    return spec


