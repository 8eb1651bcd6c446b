"""Time of synchronising one weight gradient by all-reduce / parameter server vs by SFB.

Every communication is priced by :class:`tag.cost.comm.CommModel` (the one place that prices
communication; its module docstring states the formulas), the same model the simulator charges:
the functions below take ``links``, either a :class:`tag.cost.comm.CommModel` (measured fits
where profiled) or a :class:`tag.topology.Topology` (its nominal links,
:meth:`CommModel.nominal`).

* gradient sync (:func:`sync_time`): all-reduce (``algorithm``, by default
  :data:`SYNC_ALGORITHM`, the simulator's) or parameter server;
* SFB all-gather of a factor whose replica ``r`` holds ``c_r`` bytes (``b_r`` rows): the faster
  of the ring and the hierarchical all-gather (:meth:`CommModel.allgather_time`);
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

from ..cost.comm import CommModel
from ..errors import TagError
from .detect import Candidate


class SfbError(TagError):
    """Bad arguments to the SFB cost model or selection (one line naming the value)."""


SYNC_ALGORITHM = "hierarchical"
"""All-reduce algorithm the selection prices gradient syncs with: the one the simulator charges
(:meth:`tag.cost.comm.CommModel.allreduce_time`; ``"best"``, the faster of ring and
hierarchical, priced them until 2026-11 and chose the same ops on every shipped topology)."""


def comm_model(links) -> CommModel:
    """``links`` itself when it is a :class:`CommModel`, else the nominal model of the topology."""
    return links if isinstance(links, CommModel) else CommModel.nominal(links)


def allreduce_time(nbytes: float, devices: Sequence[int], links, algorithm: str = SYNC_ALGORITHM) -> float:
    """Seconds to all-reduce ``nbytes`` over ``devices`` (:meth:`CommModel.allreduce_time`)."""
    return comm_model(links).allreduce_time(devices, nbytes, algorithm)


def ps_time(nbytes: float, devices: Sequence[int], server: int, links) -> float:
    """Seconds to sum ``nbytes`` at ``server`` and send the sum back (:meth:`CommModel.ps_time`)."""
    return comm_model(links).ps_time(devices, server, nbytes)


def sync_time(nbytes: float, devices: Sequence[int], links, sync: str = "allreduce",
              server: int | None = None, algorithm: str = SYNC_ALGORITHM) -> float:
    """Gradient sync of ``nbytes`` the way a group plan does it (``allreduce`` or ``ps``,
    :meth:`CommModel.sync_time`)."""
    try:
        return comm_model(links).sync_time(sync, devices, nbytes, server, algorithm)
    except ValueError as e:
        raise SfbError(f"sync_time: {e}") from None


def allgather_time(chunks: Sequence[float], devices: Sequence[int], links) -> float:
    """Seconds to all-gather ``chunks[r]`` bytes from each ``devices[r]``: the faster of ring and
    hierarchical (:meth:`CommModel.allgather_time`)."""
    if len(chunks) != len(devices):
        raise SfbError(f"allgather_time: chunks: expected {len(devices)} sizes (one per device), got {len(chunks)}")
    return comm_model(links).allgather_time(list(chunks), list(devices))


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
                       links) -> float:
    """All-gather of one factor: replica ``r`` holds ``local_batches[r] * bytes_per_sample`` bytes."""
    return allgather_time([b * bytes_per_sample for b in local_batches], devices, links)


def _check(devices: Sequence[int], local_batches: Sequence[int], links,
           compute_rate: Sequence[float]) -> None:
    if len(local_batches) != len(devices):
        raise SfbError(f"local_batches: expected {len(devices)} sample counts (one per device), "
                       f"got {len(local_batches)}")
    num_devices = comm_model(links).topology.num_devices
    if len(compute_rate) != num_devices:
        raise SfbError(f"compute_rate: expected {num_devices} FLOP/s values (one per topology "
                       f"device), got {len(compute_rate)}")
    bad = [r for r in compute_rate if not r > 0]
    if bad:
        raise SfbError(f"compute_rate: expected positive FLOP/s, got {bad[0]!r}")


def sfb_cost(cand: Candidate, devices: Sequence[int], local_batches: Sequence[int], links,
             compute_rate: Sequence[float], memory_rate: Sequence[float] | None = None) -> SfbCost:
    """Breakdown of :func:`sfb_time` (all its factors gathered for it alone)."""
    _check(devices, local_batches, links, compute_rate)
    gather = sum(factor_gather_time(f.bytes_per_sample, devices, local_batches, links) for f in cand.factors)
    return SfbCost(gather, extra_compute_time(cand, devices, local_batches, compute_rate, memory_rate))


def sfb_time(cand: Candidate, devices: Sequence[int], local_batches: Sequence[int], links,
             compute_rate: Sequence[float], memory_rate: Sequence[float] | None = None) -> float:
    """Seconds to synchronise ``cand``'s gradient by SFB: gather its factors + recompute dW.

    Args:
        devices: replica devices (global indices) of the candidate's group.
        links: a :class:`CommModel` or a topology (its nominal links).
        local_batches: samples per replica, aligned with ``devices``.
        compute_rate: achieved FLOP/s per topology device (indexed by global device).
        memory_rate: optional achieved bytes/s per topology device (memory-bound ops like sums).
    """
    return sfb_cost(cand, devices, local_batches, links, compute_rate, memory_rate).total_s
