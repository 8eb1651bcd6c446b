"""Gradient buckets: which groups' gradient syncs share one collective (pure, no torch).

As ``DistributedDataParallel`` buckets parameters, the schedule buckets the gradient syncs of
its groups: walking the syncs in the order their gradients become final (reverse group order,
the order of the ``sync`` steps), consecutive syncs of one kind over one replica set and server
(one :class:`~tag.parallel.Collective` key) fill a bucket until it holds at least its cap; the
first bucket of a key is capped lower, so that the first collective starts early. A bucket is
**launched** at the sync of its last group (when every gradient in it is final): one collective
over the concatenation of its groups' gradients. A key's last bucket closes at the key's last
sync, however full.

Caps are DDP's: ``bucket_cap_mb=25`` (25 MiB) and, with the default cap, a first bucket of
``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB); a cap given explicitly applies to the
first bucket too, as in DDP (``torch.nn.parallel.distributed._BucketCapacityConfig``). A group is
never split across buckets: its gradients become final together (at the end of its backward
stage), so splitting it would only add collectives.

The executor's schedule (:func:`tag.parallel.schedule.build_schedule`) and the simulator
(:meth:`tag.sim.Simulator.sync_jobs`) both call :func:`assign_buckets`, with the same bytes (each
parameter's ``nbytes`` in the captured graph), so what runs and what is costed are one thing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

BUCKET_BYTES = 25 * 2**20
"""DDP's default ``bucket_cap_mb=25``, in bytes."""
FIRST_BUCKET_BYTES = 2**20
"""DDP's first bucket with the default cap (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)."""


def bucket_caps(bucket_bytes: int | None = None) -> tuple[int, int]:
    """(first bucket's cap, other buckets' cap) in bytes: DDP's defaults, or ``bucket_bytes`` for both."""
    if bucket_bytes is None:
        return FIRST_BUCKET_BYTES, BUCKET_BYTES
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: {bucket_bytes}; expected a positive number of bytes")
    return bucket_bytes, bucket_bytes


def assign_buckets(syncs: Sequence[tuple[Hashable, float]], bucket_bytes: int | None = None) -> list[list[int]]:
    """Buckets of ``syncs`` (``(key, bytes)`` per sync, in the order their gradients become final).

    Returns each bucket as the indices of its syncs (ascending), the buckets in launch order
    (the order of their last index). Syncs of different keys never share a bucket.
    """
    first, cap = bucket_caps(bucket_bytes)
    last_of = {k: i for i, (k, _) in enumerate(syncs)}
    open_: dict[Hashable, tuple[list[int], list[float]]] = {}
    closed: set[Hashable] = set()  # keys whose first bucket was launched
    out: list[list[int]] = []
    for i, (k, nbytes) in enumerate(syncs):
        members, size = open_.setdefault(k, ([], [0.0]))
        members.append(i)
        size[0] += nbytes
        if size[0] >= (cap if k in closed else first) or last_of[k] == i:
            out.append(members)
            del open_[k]
            closed.add(k)
    return out
