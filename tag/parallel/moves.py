"""Which replica sends what to which when a tensor crosses from one unit to another.

One implementation of docs/DESIGN.md's rules, used by the executor (per tensor,
:func:`tag.parallel.schedule.build_schedule`) and by the simulator (per bundle of tensors of one
kind, :class:`tag.sim.units.PairTemplate`). Units are anything with ``devices``, ``starts`` and
``batches`` (replicas in plan order; sample ranges contiguous and increasing).

* ``rows`` (a batch-carrying tensor): every consumer replica receives the rows of every producer
  replica whose sample range overlaps its own.
* ``copy`` (a non-batch forward tensor): every consumer replica receives the whole tensor from
  one producer replica: the one on its device, else on its machine, else the first.
* ``sum`` (a non-batch partial sum over a replica's samples, e.g. a tied weight's gradient):
  when every producer replica's device also holds a consumer replica each partial stays there
  (the consumer's replicas then hold partials that sum to the whole); else all go to the
  consumer's first replica. Consumer replicas fed nothing get zeros (``zeros``, no data moves).
"""

from __future__ import annotations

from collections.abc import Callable

Piece = tuple[int, int, str, int, int]
"""(producer replica, consumer replica, mode, first sample, one past the last sample): replica
indices in plan order; the sample range is set for ``rows`` only; a ``zeros`` piece has producer
replica -1."""


def move_pieces(kind: str, src, dst, machine_of: Callable[[int], int]) -> list[Piece]:
    """The pieces of one tensor of ``kind`` (``rows``, ``copy`` or ``sum``) from ``src`` to ``dst``."""
    if kind == "rows":  # both sample partitions in order: merge them (pieces in sample order)
        out: list[Piece] = []
        i, j, ni, nj = 0, 0, len(src.batches), len(dst.batches)
        ps, pb, cs, cb = src.starts, src.batches, dst.starts, dst.batches
        while i < ni and j < nj:
            pe, ce = ps[i] + pb[i], cs[j] + cb[j]
            lo, hi = max(cs[j], ps[i]), min(ce, pe)
            if hi > lo:
                out.append((i, j, "rows", lo, hi))
            if pe <= ce:
                i += 1
            if ce <= pe:
                j += 1
        return out
    if kind == "sum":
        at = {d: j for j, d in enumerate(dst.devices)}
        local = all(d in at for d in src.devices)
        out = [(i, at[d] if local else 0, "sum", 0, 0) for i, d in enumerate(src.devices)]
        fed = {j for _, j, _, _, _ in out}
        return out + [(-1, j, "zeros", 0, 0) for j in range(len(dst.devices)) if j not in fed]
    if kind != "copy":
        raise ValueError(f"move kind: expected rows, copy or sum, got {kind!r}")
    # From the first producer replica on the consumer's device, else on its machine, else the
    # first replica (one pass over the producers: O(n), not O(n^2) on 512 replicas).
    on_device: dict[int, int] = {}
    on_machine: dict[int, int] = {}
    for i, s in enumerate(src.devices):
        on_device.setdefault(s, i)
        on_machine.setdefault(machine_of(s), i)
    return [(on_device[d] if d in on_device else on_machine.get(machine_of(d), 0), j, "copy", 0, 0)
            for j, d in enumerate(dst.devices)]


def move_kind(batch_dim: int | None, partial_sum: bool) -> str:
    """The move rule of a tensor: ``rows`` if it carries the batch, ``sum`` if it is a partial
    sum over the samples, else ``copy``."""
    return "rows" if batch_dim is not None else ("sum" if partial_sum else "copy")
