"""Load / validate / dump topology files (YAML or JSON).

Schema (quantities are strings with units or plain numbers in base units)::

    name: lab-mixed
    machines:
      - name: a
        gpu: V100-SXM2-16GB          # catalog name, "cpu", or inline mapping (see _INLINE_GPU_KEYS)
        count: 4
        intra_bandwidth: "150 GB/s"  # may be omitted only when count == 1
        intra_latency: "5 us"        # optional
        zone: rack-1                 # optional: a network domain named in network.zones
        host_launch: "103 us"        # optional (GPU machines): host seconds per forward kernel launch,
                                     # as `tag profile --device cuda` prints it (tag.cost.gpu.on_host)
        host_memory: "256 GB"        # optional: host memory for offloaded state (tag.topology.host: defaults)
        host_bandwidth: "25 GB/s"    # optional: host <-> GPU bandwidth per direction, shared by the GPUs
        host_memory_bandwidth: "100 GB/s"  # optional: the host CPU's memory bandwidth (its optimizer step)
    network:                         # may be omitted only for a single machine
      bandwidth: "25 Gbit/s"         # between machines of different (or no) zones
      latency: "20 us"               # optional
      zones:                         # optional: between two machines of one zone
        - {name: rack-1, bandwidth: "100 Gbit/s", latency: "5 us"}
      links:                         # optional per-pair overrides (of zones too)
        - {between: [a, b], bandwidth: "10 Gbit/s", latency: "50 us"}

A zone is shorthand for the links between every two of its machines (a switch, a placement
group, a cloud availability zone): a 40-machine cloud over three zones names three zones instead
of ~250 links. It is expanded at load time into :attr:`Topology.links` (the model knows only
pairs), so a dumped topology lists those links explicitly and loads back equal.

Every problem raises :class:`TopologyError` with a one-line message
``<file>: <field path>: <what is wrong>, got <value>``.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import reprlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tag.errors import TopologyError
from tag.io import huge_integer, write_atomic
from tag.topology.catalog import CPU_NAME, GPU_CATALOG, GPUSpec, get_gpu
from tag.topology.model import (
    MAX_DEVICES,
    MAX_DEVICES_PER_MACHINE,
    MAX_HOST_LAUNCH_S,
    MIN_HOST_LAUNCH_S,
    Machine,
    Topology,
)
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
    "load_topology",
    "dump_topology",
    "topology_to_yaml",
    "shipped_topologies",
    "SHIPPED_DIR",
    "DEFAULT_INTRA_LATENCY",
    "DEFAULT_NETWORK_LATENCY",
]

# "5 us": a typical small-message NCCL point-to-point latency between two GPUs of one node
# (NVLink or PCIe, kernel launch + proxy handshake); used when a machine gives no intra_latency.
DEFAULT_INTRA_LATENCY = 5e-6  # seconds
# "20 us": order of a small-message NCCL latency across a datacenter Ethernet/RoCE hop;
# used when the network section gives no latency.
DEFAULT_NETWORK_LATENCY = 20e-6  # seconds

# The shipped example topologies: package data (installed with the wheel), also reachable as
# ``topologies/`` (a link to this folder) in a checkout of the repository.
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"

_TOP_KEYS = ("name", "description", "machines", "network")
_MACHINE_KEYS = ("name", "gpu", "count", "intra_bandwidth", "intra_latency", "zone", "host_launch", "background",
                 "host_memory", "host_bandwidth", "host_memory_bandwidth")
_INLINE_GPU_KEYS = ("name", "tflops", "fp32_flops", "fp16_tflops", "fp16_flops", "memory", "memory_bandwidth")
_NETWORK_KEYS = ("bandwidth", "latency", "zones", "links")
_ZONE_KEYS = ("name", "bandwidth", "latency")
_LINK_KEYS = ("between", "bandwidth", "latency", "background")


# Physical bounds of a link, beyond "positive and finite": 1e-300 GB/s or a latency of 1e300 s
# made every time 1e300 s and beyond and overflowed the predictor's float32 features (`tag plan`,
# 2026-11-27). The slowest link of any cluster is far above 1 B/s, the longest latency far below an hour.
MIN_BANDWIDTH = 1.0  # bytes/s
MAX_LATENCY = 3600.0  # seconds

# What is read is bounded: a topology file of 1024 machines is ~100 KB, and a YAML alias names a
# node already built (an inline GPU spec reused by several machines); a file past either limit
# is refused before it is walked. The "billion laughs" bomb (aliases of lists of aliases) is
# cheap to build but exponential to print or walk, hence also the bounded _show below.
MAX_FILE_BYTES = 4 * 2**20
MAX_YAML_ALIASES = 1000

# repr() of a value in an error message, bounded in depth, items and characters whatever the
# value's size (a nested alias bomb would take minutes and gigabytes to repr() in full).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 60, 60, 40
_REPR.maxtuple = _REPR.maxlist = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 4


def _show(value: Any) -> str:
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Context:
    """Builds one-line errors ``<source>: <path>: <message>``."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.base_dir = None  # where a background trace file's relative path starts (the topology file's folder)

    def error(self, path: str, message: str) -> TopologyError:
        line = f"{self.source}: {path}: {message}" if path else f"{self.source}: {message}"
        return TopologyError(" ".join(line.split()))  # guarantee a single line

    def mapping(self, value: Any, path: str, allowed: tuple[str, ...], what: str) -> Mapping:
        if not isinstance(value, Mapping):
            raise self.error(path, f"expected a mapping ({what}), got {_show(value)}")
        for key in value:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                sub = f"{path}.{key}" if path else str(key)
                raise self.error(sub, f"unknown field{hint}; expected one of {', '.join(allowed)}")
        return value

    def require(self, mapping: Mapping, key: str, path: str, expected: str) -> Any:
        if key not in mapping or mapping[key] is None:
            sub = f"{path}.{key}" if path else key
            raise self.error(sub, f"missing field; expected {expected}")
        return mapping[key]

    def name(self, value: Any, path: str) -> str:
        if (not isinstance(value, str) or not value.strip() or ":" in value or value != value.strip()
                or not value.isprintable()):
            raise self.error(path, "expected a non-empty name without ':', control characters or surrounding spaces, "
                             f"got {_show(value)}")
        return value

    def quantity(self, parser, value: Any, path: str, *, positive: bool = True):
        try:
            result = parser(value, positive=positive)
        except ValueError as exc:
            raise self.error(path, str(exc)) from None
        if parser is parse_bandwidth and result < MIN_BANDWIDTH:
            raise self.error(path, f"expected a bandwidth of at least {MIN_BANDWIDTH:g} B/s, got {_show(value)}")
        if parser is parse_time and result > MAX_LATENCY:
            raise self.error(path, f"expected a latency of at most {MAX_LATENCY:g} s, got {_show(value)}")
        return result


def _parse_gpu(ctx: _Context, value: Any, path: str) -> GPUSpec:
    if isinstance(value, str):
        try:
            return get_gpu(value)
        except KeyError as exc:
            raise ctx.error(path, f"{exc.args[0]}; expected a catalog name, 'cpu' or an inline mapping") from None
    spec = ctx.mapping(value, path, _INLINE_GPU_KEYS, "a GPU catalog name or an inline spec")
    name = ctx.require(spec, "name", path, "a display name for the inline GPU")
    if not isinstance(name, str) or not name or not name.isprintable():
        raise ctx.error(f"{path}.name", f"expected a non-empty string without control characters, got {_show(name)}")

    def flops(tflops_key: str, flops_key: str) -> float | None:
        if tflops_key in spec and flops_key in spec:
            raise ctx.error(f"{path}.{flops_key}", f"give either {tflops_key} or {flops_key}, not both")
        if spec.get(tflops_key) is not None:
            raw = spec[tflops_key]
            # 1e300 and 10**400 would overflow to inf (or OverflowError) once scaled to FLOP/s.
            if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 < raw < 1e290:
                raise ctx.error(f"{path}.{tflops_key}", f"expected a positive finite number of TFLOP/s, got {_show(raw)}")
            return float(raw) * 1e12
        if spec.get(flops_key) is not None:
            return ctx.quantity(parse_flops, spec[flops_key], f"{path}.{flops_key}")
        return None

    fp32 = flops("tflops", "fp32_flops")
    if fp32 is None:
        raise ctx.error(f"{path}.tflops", "missing field; expected FP32 TFLOP/s (a number) or fp32_flops with units")
    fp16 = flops("fp16_tflops", "fp16_flops")
    memory = ctx.quantity(parse_bytes, ctx.require(spec, "memory", path, "a size like '16 GB'"), f"{path}.memory")
    mem_bw = ctx.quantity(
        parse_bandwidth,
        ctx.require(spec, "memory_bandwidth", path, "a bandwidth like '900 GB/s'"),
        f"{path}.memory_bandwidth",
    )
    return GPUSpec(name, fp32, fp16 if fp16 is not None else fp32, memory, mem_bw)


def _parse_machine(ctx: _Context, value: Any, path: str) -> tuple[Machine, str | None]:
    """The machine and its zone name (None: none given)."""
    raw = ctx.mapping(value, path, _MACHINE_KEYS, "a machine")
    name = ctx.name(ctx.require(raw, "name", path, "a machine name"), f"{path}.name")
    gpu = _parse_gpu(ctx, ctx.require(raw, "gpu", path, "a GPU catalog name or inline spec"), f"{path}.gpu")
    count = ctx.require(raw, "count", path, "a positive integer")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ctx.error(f"{path}.count", f"expected a positive integer, got {_show(count)}")
    if count > MAX_DEVICES_PER_MACHINE:
        raise ctx.error(f"{path}.count", f"at most {MAX_DEVICES_PER_MACHINE} devices per machine, got {_show(count)}")
    intra_bw = raw.get("intra_bandwidth")
    if intra_bw is None:
        if count > 1:
            raise ctx.error(
                f"{path}.intra_bandwidth", f"missing field; expected a bandwidth like '150 GB/s' (count is {count})"
            )
    else:
        intra_bw = ctx.quantity(parse_bandwidth, intra_bw, f"{path}.intra_bandwidth")
    intra_lat = DEFAULT_INTRA_LATENCY
    if raw.get("intra_latency") is not None:
        intra_lat = ctx.quantity(parse_time, raw["intra_latency"], f"{path}.intra_latency", positive=False)
    zone = None if raw.get("zone") is None else ctx.name(raw["zone"], f"{path}.zone")
    host = None if raw.get("host_launch") is None else _host_launch(ctx, raw["host_launch"], f"{path}.host_launch", gpu)
    stated = {key: None if raw.get(key) is None else ctx.quantity(parser, raw[key], f"{path}.{key}")
              for key, parser in (("host_memory", parse_bytes), ("host_bandwidth", parse_bandwidth),
                                  ("host_memory_bandwidth", parse_bandwidth))}  # (tag.topology.host: defaults)
    return Machine(name, gpu, count, intra_bw, intra_lat, host, stated["host_memory"], stated["host_bandwidth"],
                   stated["host_memory_bandwidth"]), zone


def _host_launch(ctx: _Context, value: Any, path: str, gpu: GPUSpec) -> float:
    """Seconds per forward launch of a machine's ``host_launch`` (a time like ``"103 us"``),
    within :data:`MIN_HOST_LAUNCH_S` .. :data:`MAX_HOST_LAUNCH_S`, on a GPU machine."""
    try:
        seconds = parse_time(value, positive=True)
    except ValueError as exc:
        raise ctx.error(path, f"{exc} (seconds per kernel launch)") from None
    if not MIN_HOST_LAUNCH_S <= seconds <= MAX_HOST_LAUNCH_S:
        raise ctx.error(path, f"expected a time per kernel launch between {MIN_HOST_LAUNCH_S * 1e6:g} us and "
                        f"{MAX_HOST_LAUNCH_S * 1e3:g} ms, got {_show(value)}")
    if gpu.name == CPU_NAME:
        raise ctx.error(path, f"expected on a GPU machine only (the CPU rule launches no kernels), got {_show(value)} "
                        f"on gpu {CPU_NAME!r}")
    return seconds


def _parse_zones(ctx: _Context, net: Mapping, zone_of: list[str | None], machines: list[Machine],
                 default: tuple[float, float]) -> dict[frozenset, tuple[float, float]]:
    """The links between every two machines of one zone (``network.zones``; see the module
    docstring), in machine order. Every machine's zone must be listed, every listed zone used."""
    raw_zones = net.get("zones") or []
    if not isinstance(raw_zones, list):
        raise ctx.error("network.zones", f"expected a list of zones, got {_show(raw_zones)}")
    zones: dict[str, tuple[float, float]] = {}
    for k, entry in enumerate(raw_zones):
        path = f"network.zones[{k}]"
        zone = ctx.mapping(entry, path, _ZONE_KEYS, "a zone")
        name = ctx.name(ctx.require(zone, "name", path, "a zone name"), f"{path}.name")
        if name in zones:
            raise ctx.error(f"{path}.name", f"duplicate zone {name!r}")
        if zone.get("bandwidth") is None and zone.get("latency") is None:
            raise ctx.error(path, "missing field; expected bandwidth and/or latency")
        bw, lat = default
        if zone.get("bandwidth") is not None:
            bw = ctx.quantity(parse_bandwidth, zone["bandwidth"], f"{path}.bandwidth")
        if zone.get("latency") is not None:
            lat = ctx.quantity(parse_time, zone["latency"], f"{path}.latency", positive=False)
        zones[name] = (bw, lat)
    members: dict[str, list[int]] = {name: [] for name in zones}
    for k, zone in enumerate(zone_of):
        if zone is None:
            continue
        if zone not in zones:
            close = difflib.get_close_matches(zone, sorted(zones), n=3)
            hint = f" (close: {', '.join(close)})" if close else ""
            raise ctx.error(f"machines[{k}].zone", f"unknown zone {zone!r}{hint}; expected one named in network.zones"
                            + (f" ({', '.join(zones)})" if zones else ""))
        members[zone].append(k)
    unused = [name for name, ms in members.items() if not ms]
    if unused:
        raise ctx.error("network.zones", f"zone {unused[0]!r} has no machine; expected every zone named by a "
                        "machine's zone field")
    links: dict[frozenset, tuple[float, float]] = {}
    for name, ms in members.items():
        for i, a in enumerate(ms):
            for b in ms[i + 1:]:
                links[frozenset((machines[a].name, machines[b].name))] = zones[name]
    return links


def _parse_network(ctx: _Context, raw: Mapping, machines: list[Machine],
                   zone_of: list[str | None]) -> tuple[float, float, dict]:
    if raw.get("network") is None:
        if any(z is not None for z in zone_of):
            raise ctx.error("machines[0].zone", "a zone needs network.zones naming it; expected no zone on a "
                            "single machine without a network section")
        if len(machines) > 1:
            raise ctx.error("network", "missing field; expected a mapping with bandwidth (required for >1 machine)")
        # A single machine never uses the network: any valid value will do; use its own link.
        only = machines[0]
        bw = only.intra_bandwidth if only.intra_bandwidth is not None else only.gpu.memory_bandwidth
        return bw, DEFAULT_NETWORK_LATENCY, {}
    net = ctx.mapping(raw["network"], "network", _NETWORK_KEYS, "the network between machines")
    bandwidth = ctx.quantity(
        parse_bandwidth, ctx.require(net, "bandwidth", "network", "a bandwidth like '25 Gbit/s'"), "network.bandwidth"
    )
    latency = DEFAULT_NETWORK_LATENCY
    if net.get("latency") is not None:
        latency = ctx.quantity(parse_time, net["latency"], "network.latency", positive=False)
    links = _parse_zones(ctx, net, zone_of, machines, (bandwidth, latency))
    zoned = set(links)  # an explicit link may override a zone's
    raw_links = net.get("links") or []
    if not isinstance(raw_links, list):
        raise ctx.error("network.links", f"expected a list of links, got {_show(raw_links)}")
    known = {m.name for m in machines}
    for k, entry in enumerate(raw_links):
        path = f"network.links[{k}]"
        link = ctx.mapping(entry, path, _LINK_KEYS, "a link override")
        between = ctx.require(link, "between", path, "a list of two machine names")
        if not isinstance(between, list) or len(between) != 2:
            raise ctx.error(f"{path}.between", f"expected a list of two machine names, got {_show(between)}")
        for name in between:
            if not isinstance(name, str) or name not in known:
                close = difflib.get_close_matches(str(name), sorted(known), n=3)
                hint = f" (close: {', '.join(close)})" if close else ""
                raise ctx.error(
                    f"{path}.between", f"unknown machine {_show(name)}{hint}; expected one of {', '.join(sorted(known))}"
                )
        if between[0] == between[1]:
            raise ctx.error(
                f"{path}.between", f"a link joins two different machines, got {_show(between)} (use intra_bandwidth)"
            )
        if link.get("bandwidth") is None and link.get("latency") is None and link.get("background") is None:
            raise ctx.error(path, "missing field; expected bandwidth, latency and/or background")
        pair = frozenset(between)
        if pair in links and pair not in zoned:
            raise ctx.error(f"{path}.between", f"duplicate link between {between[0]} and {between[1]}")
        if link.get("bandwidth") is None and link.get("latency") is None:  # (background only: the pair's own)
            links.setdefault(pair, (bandwidth, latency))
            zoned.discard(pair)
            continue
        bw = bandwidth
        if link.get("bandwidth") is not None:
            bw = ctx.quantity(parse_bandwidth, link["bandwidth"], f"{path}.bandwidth")
        lat = latency
        if link.get("latency") is not None:
            lat = ctx.quantity(parse_time, link["latency"], f"{path}.latency", positive=False)
        links[pair] = (bw, lat)
        zoned.discard(pair)
    return bandwidth, latency, links


def _backgrounds(ctx: _Context, machine_list: list, raw: Mapping) -> dict:
    """Machine name or frozenset of two -> :class:`~tag.topology.background.Background` of the
    machines' and links' ``background`` fields (:mod:`tag.topology.background`)."""
    from .background import parse_background

    def parse(value, path: str):
        try:
            return parse_background(value, path, ctx.base_dir)
        except TopologyError as e:  # (its message names the field, from path on)
            raise ctx.error("", str(e)) from None

    out: dict = {}
    for k, entry in enumerate(machine_list):
        if entry.get("background") is not None:
            out[entry["name"]] = parse(entry["background"], f"machines[{k}].background")
    for k, link in enumerate((raw.get("network") or {}).get("links") or []):
        if link.get("background") is not None:
            out[frozenset(link["between"])] = parse(link["background"], f"network.links[{k}].background")
    return out


def _check_gpu_name(ctx: _Context, gpu: GPUSpec, k: int, before: list[Machine]) -> None:
    """One GPU name, one set of figures in a topology: costs are kept per GPU name (the cost
    model's device type), so an inline ``gpu: {name: T4, tflops: 999, ...}`` on one machine
    silently re-costed another machine's catalog ``gpu: T4``. A GPU named like an earlier
    machine's with other figures is refused (:meth:`Topology.to_dict` writes every GPU inline
    under its own name: equal figures load)."""
    for j, m in enumerate(before):
        if m.gpu.name == gpu.name and m.gpu != gpu:
            raise ctx.error(f"machines[{k}].gpu.name", f"GPU {gpu.name!r} has other figures than machines[{j}]'s "
                            f"({_figures(gpu)} vs {_figures(m.gpu)}); expected one name per set of figures (costs "
                            "are kept per GPU name)")


def _figures(gpu: GPUSpec) -> str:
    return (f"{format_flops(gpu.fp32_flops)} fp32, {format_flops(gpu.fp16_flops)} fp16, "
            f"{format_bytes(gpu.memory_bytes)}, {format_bandwidth(gpu.memory_bandwidth)}")


def _from_dict(ctx: _Context, raw: Any) -> Topology:
    raw = ctx.mapping(raw, "", _TOP_KEYS, "a topology with name, machines, network")
    name = ctx.require(raw, "name", "", "a topology name")
    if not isinstance(name, str) or not name.strip() or not name.isprintable():
        raise ctx.error("name", f"expected a non-empty string without control characters, got {_show(name)}")
    if raw.get("description") is not None and not isinstance(raw["description"], str):
        raise ctx.error("description", f"expected a string, got {_show(raw['description'])}")
    machine_list = ctx.require(raw, "machines", "", "a non-empty list of machines")
    if not isinstance(machine_list, list) or not machine_list:
        raise ctx.error("machines", f"expected a non-empty list of machines, got {_show(machine_list)}")
    if len(machine_list) > MAX_DEVICES:
        raise ctx.error("machines", f"at most {MAX_DEVICES} devices (so machines) in a topology, got {len(machine_list)} machines")
    machines: list[Machine] = []
    zone_of: list[str | None] = []
    seen: dict[str, int] = {}
    total = 0
    for k, entry in enumerate(machine_list):
        machine, zone = _parse_machine(ctx, entry, f"machines[{k}]")
        zone_of.append(zone)
        total += machine.count
        if total > MAX_DEVICES:
            raise ctx.error(f"machines[{k}].count", f"at most {MAX_DEVICES} devices in a topology, got {total} so far")
        if machine.name in seen:
            raise ctx.error(
                f"machines[{k}].name", f"duplicate machine name {machine.name!r} (also machines[{seen[machine.name]}])"
            )
        seen[machine.name] = k
        _check_gpu_name(ctx, machine.gpu, k, machines)
        machines.append(machine)
    bandwidth, latency, links = _parse_network(ctx, raw, machines, zone_of)
    background = _backgrounds(ctx, machine_list, raw)
    try:
        return Topology(name, tuple(machines), bandwidth, latency, links, background)
    except TopologyError as exc:  # defensive: the checks above should already have caught it
        raise ctx.error("", str(exc)) from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (a silent override would hide typos) and
    more than :data:`MAX_YAML_ALIASES` aliases (a nested alias bomb)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            self._aliases = getattr(self, "_aliases", 0) + 1
            if self._aliases > MAX_YAML_ALIASES:
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None, None, f"more than {MAX_YAML_ALIASES} aliases (*name); refusing a possible alias bomb",
                    event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            with contextlib.suppress(TypeError):
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError as exc:  # an integer of 5,000 digits (beyond int()'s limit): a YAML error at its line
            raise yaml.constructor.ConstructorError(None, None, huge_integer(exc), node.start_mark) from None


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _StrictLoader.construct_yaml_int)


def _read_file(ctx: _Context, path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        if len(raw) > MAX_FILE_BYTES:
            raise ctx.error("", f"file larger than {MAX_FILE_BYTES // 2**20} MiB; expected a topology file")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise ctx.error("", "file not found; expected a YAML or JSON topology file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ctx.error("", f"cannot read file: {exc}") from None
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ctx.error(f"line {exc.lineno}", f"invalid JSON: {exc.msg}") from None
        except RecursionError:  # '[' * 100000: deeper than the parser's recursion
            raise ctx.error("", "invalid JSON: nested too deeply; expected a topology file") from None
        except ValueError as exc:  # an integer of 5,000 digits (beyond int()'s limit)
            raise ctx.error("", f"invalid JSON: {huge_integer(exc)}; expected a topology file") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except RecursionError:
        raise ctx.error("", "invalid YAML: nested too deeply; expected a topology file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ctx.error(where, f"invalid YAML: {problem}") from None


def _closest(name: str, shipped: Mapping[str, Path]) -> str:
    """"did you mean 'local-cpu2', 'local-cpu4'?" (difflib), else the list of shipped names."""
    close = difflib.get_close_matches(name, list(shipped), n=3, cutoff=0.6)
    close += [s for s in shipped if name and s.startswith(name) and s not in close]  # 'local-cpu' -> local-cpu2, 4
    if close:
        return "did you mean " + ", ".join(repr(c) for c in sorted(set(close))) + "?"
    return "shipped: " + ", ".join(shipped)


def shipped_topologies() -> dict[str, Path]:
    """Name (file stem) -> path of the shipped topologies (:data:`SHIPPED_DIR`)."""
    if not SHIPPED_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.yaml"))}


def load_topology(path_or_dict: str | os.PathLike | Mapping | Topology, *, source: str | None = None) -> Topology:
    """Load a topology from a YAML/JSON file, a shipped topology name (e.g. ``"tag-testbed"``) or a
    dict; ``source`` names the origin in error messages (default: the path, or ``<dict>``)."""
    if isinstance(path_or_dict, Topology):
        return path_or_dict
    if isinstance(path_or_dict, Mapping):
        return _from_dict(_Context(source or "<dict>"), path_or_dict)
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise TopologyError(
            f"{source or '<topology>'}: expected a file path or a mapping, got {_show(path_or_dict)}"
        )
    path = Path(path_or_dict)
    ctx = _Context(source or str(path_or_dict))
    if (not path.exists() and isinstance(path_or_dict, str) and os.sep not in path_or_dict
            and path.suffix.lower() not in (".yaml", ".yml", ".json")):
        shipped = shipped_topologies()
        if path_or_dict not in shipped:
            raise ctx.error("", f"no such file nor shipped topology; {_closest(path_or_dict, shipped)}")
        path = shipped[path_or_dict]
    ctx.base_dir = path.parent
    data = _read_file(ctx, path)
    if not isinstance(data, Mapping):
        raise ctx.error("", f"expected a mapping at the top level (name, machines, network), got {_show(data)}")
    return _from_dict(ctx, data)


# ------------------------------------------------------------------------------------------ dumping


def _gpu_entry(gpu: GPUSpec) -> str | dict[str, Any]:
    if GPU_CATALOG.get(gpu.name) == gpu:
        return gpu.name
    return {
        "name": gpu.name,
        "fp32_flops": format_flops(gpu.fp32_flops),
        "fp16_flops": format_flops(gpu.fp16_flops),
        "memory": format_bytes(gpu.memory_bytes),
        "memory_bandwidth": format_bandwidth(gpu.memory_bandwidth),
    }


def topology_to_yaml(topo: Topology) -> str:
    """Human-readable YAML (units as strings) that loads back to an equal topology."""
    machines = []
    for m in topo.machines:
        entry: dict[str, Any] = {"name": m.name, "gpu": _gpu_entry(m.gpu), "count": m.count}
        if m.intra_bandwidth is not None:
            entry["intra_bandwidth"] = format_bandwidth(m.intra_bandwidth)
        entry["intra_latency"] = format_time(m.intra_latency)
        if m.host_launch_s is not None:
            entry["host_launch"] = format_time(m.host_launch_s)
        if m.host_memory_bytes is not None:
            entry["host_memory"] = format_bytes(m.host_memory_bytes)
        for key in ("host_bandwidth", "host_memory_bandwidth"):
            if getattr(m, key) is not None:
                entry[key] = format_bandwidth(getattr(m, key))
        machines.append(entry)
    network: dict[str, Any] = {
        "bandwidth": format_bandwidth(topo.network_bandwidth, bits=True),
        "latency": format_time(topo.network_latency),
    }
    links = topo.to_dict()["network"].get("links", [])
    if links:
        network["links"] = [
            {
                "between": link["between"],
                "bandwidth": format_bandwidth(link["bandwidth"], bits=True),
                "latency": format_time(link["latency"]),
            }
            for link in links
        ]
    doc = {"name": topo.name, "machines": machines, "network": network}
    header = f"# TAG topology {topo.name!r} ({topo.num_devices} devices), signature {topo.signature()}\n"
    return header + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, allow_unicode=True, width=100)


def dump_topology(topo: Topology, path: str | os.PathLike) -> Path:
    """Write ``topo`` as human-readable YAML to ``path`` atomically (:func:`tag.io.write_atomic`)."""
    path = Path(path)
    write_atomic(path, topology_to_yaml(topo))
    return path
