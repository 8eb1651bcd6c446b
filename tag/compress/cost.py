"""Time of synchronising one weight gradient by all-reduce / parameter server vs by SFB.

Collectives run over the replica devices of one op-group, on the topology's real per-pair
bandwidths and latencies (``Topology.bandwidth(i, j)``, ``latency(i, j)``):

* ring all-reduce of ``S`` bytes over ``n`` devices (ring in device-index order, i.e. machine
  by machine): ``2(n-1)/n * S / (slowest ring link) + 2(n-1) * (largest ring latency)``;
* hierarchical all-reduce across machines: ring all-reduce inside every machine plus a ring
  all-reduce of ``S`` over the machines, on the slowest inter-machine ring link;
  ``allreduce_time`` takes the faster of the two (what NCCL's algorithm choice does);
* parameter server: every other replica pushes ``S`` to the server and pulls ``S`` back, the
  copies serialised on the server's links;
* SFB all-gather of a factor whose replica ``r`` holds ``c_r`` bytes (``b_r`` rows): ring
  all-gather, the link into device ``s`` carrying every chunk but ``s``'s own
  (``sum(c) - c_s`` bytes) at that link's bandwidth, plus ``(n-1)`` latencies; or hierarchically
  (ring over machines, each machine link carrying the other machines' rows once, then inside
  every machine); the faster of the two;
* SFB extra compute: replica ``r`` recomputes ``dW`` on the whole global batch instead of its
  ``b_r`` samples: ``flops_per_sample * (B - b_r) / compute_rate[device]`` (plus the memory
  term when memory bandwidths are given); the slowest replica counts.

Every collective is costed as its own operation (one per gradient / factor), which makes the
selection problem linear (see :mod:`tag.compress.milp`).
Units: bytes, seconds, FLOP/s, bytes/s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import TagError
from .detect import Candidate


class SfbError(TagError):
    """Bad arguments to the SFB cost model or selection (one line naming the value)."""


def _ring(devices: Sequence[int]) -> list[int]:
    """Ring order: by global index, i.e. machine by machine (fewest inter-machine hops)."""
    return sorted(devices)


def _by_machine(devices: Sequence[int], topology) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in sorted(devices):
        out.setdefault(topology.machine_of(d), []).append(d)
    return out


def _ring_links(ring: list[int]) -> list[tuple[int, int]]:
    return [(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]


def flat_allreduce_time(nbytes: float, devices: Sequence[int], topology) -> float:
    """Ring all-reduce of ``nbytes`` over ``devices`` (seconds)."""
    ring = _ring(devices)
    n = len(ring)
    if n < 2 or nbytes <= 0:
        return 0.0
    links = _ring_links(ring)
    bw = min(topology.bandwidth(a, b) for a, b in links)  # bytes/s of the slowest hop
    lat = max(topology.latency(a, b) for a, b in links)  # s
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def hierarchical_allreduce_time(nbytes: float, devices: Sequence[int], topology) -> float:
    """Ring all-reduce inside every machine, then a ring of ``nbytes`` over the machines (s)."""
    per = _by_machine(devices, topology)
    if len(per) < 2:
        return flat_allreduce_time(nbytes, devices, topology)
    intra = max(flat_allreduce_time(nbytes, ds, topology) for ds in per.values())
    machines = sorted(per)
    m = len(machines)
    links = _ring_links(machines)
    bw = min(topology.machine_bandwidth(a, b) for a, b in links)
    lat = max(topology.machine_latency(a, b) for a, b in links)
    return intra + 2 * (m - 1) / m * nbytes / bw + 2 * (m - 1) * lat


def allreduce_time(nbytes: float, devices: Sequence[int], topology) -> float:
    """Seconds to all-reduce ``nbytes`` over ``devices``: the faster of flat and hierarchical ring."""
    return min(flat_allreduce_time(nbytes, devices, topology),
               hierarchical_allreduce_time(nbytes, devices, topology))


def ps_time(nbytes: float, devices: Sequence[int], server: int, topology) -> float:
    """Seconds to sum ``nbytes`` at ``server`` and send the sum back to every replica."""
    others = [d for d in devices if d != server]
    if not others or nbytes <= 0:
        return 0.0
    one_way = sum(nbytes / topology.bandwidth(d, server) for d in others)  # serialised at the server
    lat = max(topology.latency(d, server) for d in others)
    return 2 * (one_way + lat)


def sync_time(nbytes: float, devices: Sequence[int], topology, sync: str = "allreduce",
              server: int | None = None) -> float:
    """Gradient sync of ``nbytes`` the way a group plan does it (``allreduce`` or ``ps``)."""
    if sync == "ps":
        if server is None:
            raise SfbError("sync_time: server: expected a device index for sync 'ps', got None")
        return ps_time(nbytes, devices, server, topology)
    if sync == "allreduce":
        return allreduce_time(nbytes, devices, topology)
    raise SfbError(f"sync_time: sync: expected 'allreduce' or 'ps', got {sync!r}")


def flat_allgather_time(chunks: Sequence[float], devices: Sequence[int], topology) -> float:
    """Ring all-gather where device ``devices[r]`` contributes ``chunks[r]`` bytes (s)."""
    own = dict(zip(devices, chunks))
    ring = _ring(devices)
    if len(ring) < 2:
        return 0.0
    total = float(sum(chunks))
    links = _ring_links(ring)
    # the link a -> b carries every chunk except b's own
    t = max((total - own[b]) / topology.bandwidth(a, b) for a, b in links)
    return t + (len(ring) - 1) * max(topology.latency(a, b) for a, b in links)


def hierarchical_allgather_time(chunks: Sequence[float], devices: Sequence[int], topology) -> float:
    """All-gather over a ring of machines (machine chunk = its replicas' rows), then inside each."""
    own = dict(zip(devices, chunks))
    per = _by_machine(devices, topology)
    if len(per) < 2:
        return flat_allgather_time(chunks, devices, topology)
    total = float(sum(chunks))
    mchunk = {m: sum(own[d] for d in ds) for m, ds in per.items()}
    machines = sorted(per)
    links = _ring_links(machines)
    inter = max((total - mchunk[b]) / topology.machine_bandwidth(a, b) for a, b in links)
    inter += (len(machines) - 1) * max(topology.machine_latency(a, b) for a, b in links)
    intra = 0.0
    for ds in per.values():  # every local device receives everything but its own rows
        if len(ds) > 1:
            ring = _ring_links(ds)
            t = max((total - own[b]) / topology.bandwidth(a, b) for a, b in ring)
            intra = max(intra, t + (len(ds) - 1) * max(topology.latency(a, b) for a, b in ring))
    return inter + intra


def allgather_time(chunks: Sequence[float], devices: Sequence[int], topology) -> float:
    """Seconds to all-gather ``chunks[r]`` bytes from each ``devices[r]``: flat or hierarchical."""
    if len(chunks) != len(devices):
        raise SfbError(f"allgather_time: chunks: expected {len(devices)} sizes (one per device), got {len(chunks)}")
    return min(flat_allgather_time(chunks, devices, topology),
               hierarchical_allgather_time(chunks, devices, topology))


@dataclass(frozen=True)
class SfbCost:
    """Standalone cost of synchronising one candidate by SFB on a replica set (seconds)."""

    gather_s: float
    """All-gather time of its factors (each factor its own collective)."""
    compute_s: float
    """Extra compute of recomputing dW on the global batch, slowest replica."""

    @property
    def total_s(self) -> float:
        return self.gather_s + self.compute_s


def extra_compute_time(cand: Candidate, devices: Sequence[int], local_batches: Sequence[int],
                       compute_rate: Sequence[float], memory_rate: Sequence[float] | None = None) -> float:
    """Seconds the slowest replica spends recomputing ``cand``'s dW on the other replicas' rows.

    ``compute_rate`` (FLOP/s) and ``memory_rate`` (bytes/s) are indexed by global device.
    """
    total = sum(local_batches)
    worst = 0.0
    for d, b in zip(devices, local_batches):
        extra = total - b  # samples this replica did not compute locally
        t = cand.flops.per_sample * extra / compute_rate[d]
        if memory_rate is not None:
            t = max(t, cand.bytes_moved.per_sample * extra / memory_rate[d])
        worst = max(worst, t)
    return worst


def factor_gather_time(bytes_per_sample: float, devices: Sequence[int], local_batches: Sequence[int],
                       topology) -> float:
    """All-gather of one factor: replica ``r`` holds ``local_batches[r] * bytes_per_sample`` bytes."""
    return allgather_time([b * bytes_per_sample for b in local_batches], devices, topology)


def _check(devices: Sequence[int], local_batches: Sequence[int], topology,
           compute_rate: Sequence[float]) -> None:
    if len(local_batches) != len(devices):
        raise SfbError(f"local_batches: expected {len(devices)} sample counts (one per device), "
                       f"got {len(local_batches)}")
    if len(compute_rate) != topology.num_devices:
        raise SfbError(f"compute_rate: expected {topology.num_devices} FLOP/s values (one per topology "
                       f"device), got {len(compute_rate)}")
    bad = [r for r in compute_rate if not r > 0]
    if bad:
        raise SfbError(f"compute_rate: expected positive FLOP/s, got {bad[0]!r}")


def sfb_cost(cand: Candidate, devices: Sequence[int], local_batches: Sequence[int], topology,
             compute_rate: Sequence[float], memory_rate: Sequence[float] | None = None) -> SfbCost:
    """Breakdown of :func:`sfb_time` (all its factors gathered for it alone)."""
    _check(devices, local_batches, topology, compute_rate)
    gather = sum(factor_gather_time(f.bytes_per_sample, devices, local_batches, topology) for f in cand.factors)
    return SfbCost(gather, extra_compute_time(cand, devices, local_batches, compute_rate, memory_rate))


def sfb_time(cand: Candidate, devices: Sequence[int], local_batches: Sequence[int], topology,
             compute_rate: Sequence[float], memory_rate: Sequence[float] | None = None) -> float:
    """Seconds to synchronise ``cand``'s gradient by SFB: gather its factors + recompute dW.

    Args:
        devices: replica devices (global indices) of the candidate's group.
        local_batches: samples per replica, aligned with ``devices``.
        compute_rate: achieved FLOP/s per topology device (indexed by global device).
        memory_rate: optional achieved bytes/s per topology device (memory-bound ops like sums).
    """
    return sfb_cost(cand, devices, local_batches, topology, compute_rate, memory_rate).total_s
