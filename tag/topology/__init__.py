"""Cluster topologies: GPU catalog, machines/links model, YAML/JSON loading, local detection."""

from tag.topology.catalog import GPU_CATALOG, GPUSpec, get_gpu, local_cpu_spec
from tag.topology.detect import detect_topology
from tag.topology.loader import dump_topology, load_topology
from tag.topology.model import Device, Machine, Topology
from tag.topology.table import format_topology
from tag.topology.units import (
    format_bandwidth,
    format_bytes,
    format_flops,
    format_time,
    parse_bandwidth,
    parse_bytes,
    parse_flops,
    parse_time,
)

__all__ = [
    "Topology",
    "Machine",
    "Device",
    "GPUSpec",
    "load_topology",
    "dump_topology",
    "detect_topology",
    "get_gpu",
    "GPU_CATALOG",
    "local_cpu_spec",
    "format_topology",
    "parse_bandwidth",
    "parse_bytes",
    "parse_time",
    "format_bandwidth",
    "format_bytes",
    "format_time",
    "parse_flops",
    "format_flops",
]
