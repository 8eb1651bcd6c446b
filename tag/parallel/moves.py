"""Which replica sends what to which when a tensor crosses from one unit to another.

One implementation of docs/design.md's rules, used by the executor (per tensor,
:func:`tag.parallel.schedule.build_schedule`) and by the simulator (per bundle of tensors of one
kind, :class:`tag.sim.units.PairTemplate`). Units are anything with ``devices``, ``starts`` and
``batches`` (replicas in plan order; sample ranges contiguous and non-decreasing). Consecutive
replicas with the same range form one *holder set*: they hold the same samples (the devices of a
tensor-parallel group, :mod:`tag.parallel.tensor_parallel`: the same batch-carrying values
outside the Megatron blocks, the same partial sums of replicated parameters); in a data-parallel
unit every replica is a holder set of its own, and the rules below reduce to one replica each.

* ``rows`` (a batch-carrying tensor): every consumer replica receives the rows of every producer
  holder set whose sample range overlaps its own, from one holder of the set: the one on its
  device, else its *aligned* one (for consumer replica ``j`` the set's ``j mod size``-th: the
  devices of a tensor-parallel consumer from the same ranks of the producer's, each sending once)
  if on its machine, else the first on its machine, else the aligned one (into a set of several
  devices as ``shard`` pieces). So a tensor-parallel unit's output (or, in the backward, the
  gradient of its input, equal on its devices after the block's all-reduce) is sent once per
  consumer replica, never once per holder; every device of a consumer holder set receives what
  it computes on.
* ``shard``: rows, a copy or a partial sum entering a consumer holder set of ``size`` devices
  from another machine are scattered: each of its devices receives ``1 / size`` of them from its
  aligned producer and the set all-gathers the whole on its machine (Megatron-LM's scatter-gather
  of pipeline tensors: one copy of the tensor crosses the network, not ``size``). The simulator
  costs the all-gather, one per consumer holder set and stage over all its scattered pieces
  (:class:`tag.sim.units.PairTemplate`); the executor, which runs a tensor-parallel plan as the
  data-parallel plan over each group's first device, does the same between machines: device
  ``i`` of a group sends slice ``i`` of the flattened piece to device ``i`` of the consumer's,
  which all-gathers (:meth:`tag.executor.tensor_parallel.TpRank.scattered`).
* ``copy`` (a non-batch forward tensor): every consumer replica receives the whole tensor from
  one producer replica: the one on its device, else on its machine, else the first. With a
  tensor-parallel side (a holder set of several replicas) the producer replicas are taken as one
  set and chosen as for ``rows`` (the aligned one, ``j mod`` their count, else the ``j mod k``-th
  of the ``k`` on its machine; ``shard`` pieces, with no sample range, into a set of several
  devices on another machine), so that consumers on other machines do not all draw from the
  first replica: with data-parallel tensor-parallel groups, each group's devices from the same
  ranks of its aligned group (Megatron-LM's data-parallel pipelines, each passing a tied weight
  from its own stage; the executor's schedule of such a plan moves copies so too,
  :func:`move_pieces` ``aligned``, 2026-11-27).
* ``sum`` (a non-batch partial sum over a holder set's samples, e.g. a tied weight's gradient):
  one partial per producer holder set (its holders' partials are equal: counted once). When
  every producer set has a holder on a device of the consumer, the partial goes to the consumer
  holder set there (the consumer's sets then hold partials that sum to the whole); else all go to
  the consumer's first set. Every replica of the receiving set gets it (the one on a producer
  holder's device from that holder, the others from their aligned holder: member ``i`` from
  member ``i``, as the executor's ranks of one index exchange, 2026-11-27), as each device of a
  tensor-parallel group syncs its own copy; into a set of several devices on another machine as
  ``shard`` pieces from the aligned holder. Consumer replicas fed nothing get zeros (``zeros``, no data moves).
"""

from __future__ import annotations

from collections.abc import Callable

Piece = tuple[int, int, str, int, int]
"""(producer replica, consumer replica, mode, first sample, one past the last sample): replica
indices in plan order; the sample range is set for ``rows`` and ``shard`` only; a ``zeros`` piece
has producer replica -1."""


def holder_sets(unit) -> list[tuple[int, int]]:
    """``[first, stop)`` replica index runs of ``unit`` holding the same sample range (plan order)."""
    starts, batches = unit.starts, unit.batches
    out, n, i = [], len(starts), 0
    while i < n:
        j = i + 1
        while j < n and starts[j] == starts[i] and batches[j] == batches[i]:
            j += 1
        out.append((i, j))
        i = j
    return out


def move_pieces(kind: str, src, dst, machine_of: Callable[[int], int], aligned: bool = False) -> list[Piece]:
    """The pieces of one tensor of ``kind`` (``rows``, ``copy`` or ``sum``) from ``src`` to ``dst``.

    ``aligned``: a ``copy`` between two data-parallel units comes from the aligned producer
    replica (consumer ``j`` from producer ``j mod`` their count) rather than the first, as between
    tensor-parallel units: the executor's schedule of a tensor-parallel plan, whose replicas are
    the tensor-parallel groups run as their first devices
    (:func:`tag.parallel.tensor_parallel.executed_plan`), so that it moves what the simulator
    prices for the tensor-parallel plan itself (Megatron-LM's data-parallel pipelines, each
    passing a tied weight from its own stage to its own next stage; 2026-11-27)."""
    if kind == "rows":  # both partitions into holder sets in order: merge them (pieces in sample order)
        out: list[Piece] = []
        sets_s, sets_d = holder_sets(src), holder_sets(dst)
        i, j, ni, nj = 0, 0, len(sets_s), len(sets_d)
        ps, pb, cs, cb = src.starts, src.batches, dst.starts, dst.batches
        while i < ni and j < nj:
            a, c = sets_s[i][0], sets_d[j][0]
            pe, ce = ps[a] + pb[a], cs[c] + cb[c]
            lo, hi = max(cs[c], ps[a]), min(ce, pe)
            if hi > lo:
                if sets_s[i][1] - a == 1 and sets_d[j][1] - c == 1:  # data parallel on both sides
                    out.append((a, c, "rows", lo, hi))
                else:
                    pick = _holder(src.devices, sets_s[i], machine_of, spread=True)
                    out += _from_set(pick, src.devices, dst.devices, sets_d[j], machine_of, "rows", lo, hi)
            if pe <= ce:
                i += 1
            if ce <= pe:
                j += 1
        return out
    if kind == "sum":
        return _sum_pieces(src, dst, machine_of)
    if kind != "copy":
        raise ValueError(f"move kind: expected rows, copy or sum, got {kind!r}")
    run = (0, len(src.devices))
    sets_s, sets_d = holder_sets(src), holder_sets(dst)
    if len(sets_s) == run[1] and len(sets_d) == len(dst.devices):  # data parallel on both sides
        pick = _holder(src.devices, run, machine_of, spread=aligned)
        return [(pick(d, j), j, "copy", 0, 0) for j, d in enumerate(dst.devices)]
    # a tensor-parallel side: every producer replica holds the tensor; as rows, from the aligned one
    pick = _holder(src.devices, run, machine_of, spread=True)
    return [p for c in sets_d for p in _from_set(pick, src.devices, dst.devices, c, machine_of, "copy", 0, 0)]


def _from_set(pick, devices, dst_devices, dst_run: tuple[int, int], machine_of, mode: str,
              lo: int, hi: int) -> list[Piece]:
    """Pieces of ``mode`` for every replica of consumer holder set ``dst_run`` from the producer
    replica ``pick`` chooses (:func:`_holder`); ``shard`` instead where the set has several
    devices and that replica is on another machine (1/size to each, the rest all-gathered
    there)."""
    size = dst_run[1] - dst_run[0]
    out = []
    for r in range(*dst_run):
        d = dst_devices[r]
        i = pick(d, r)
        far = size > 1 and machine_of(devices[i]) != machine_of(d)
        out.append((i, r, "shard" if far else mode, lo, hi))
    return out


def _holder(devices, run: tuple[int, int], machine_of: Callable[[int], int],
            spread: bool = False) -> Callable[[int, int], int]:
    """For consumer replica ``j`` on device ``d``: the replica of ``devices[run[0]:run[1]]`` on
    ``d``, else the *aligned* one if on ``d``'s machine, else the first on that machine, else the
    aligned one; aligned: the run's first, or with ``spread`` its ``j mod len(run)``-th (consumer
    ``j`` of a tensor-parallel group from the same rank of the producer's: each of its devices
    sends once), and with ``spread`` "the first on that machine" is the ``j mod k``-th of the
    ``k`` there (a tensor-parallel consumer's devices from the same ranks of one group there,
    as the executor's ranks of one index exchange: 2026-11-27). One pass over the run: O(n), not
    O(n^2) on 512 replicas."""
    on_device: dict[int, int] = {}
    on_machine: dict[int, list[int]] = {}
    for i in range(*run):
        s = devices[i]
        on_device.setdefault(s, i)
        on_machine.setdefault(machine_of(s), []).append(i)
    first, size = run[0], run[1] - run[0]

    def pick(d: int, j: int) -> int:
        if d in on_device:
            return on_device[d]
        aligned = first + (j % size if spread else 0)
        m = machine_of(d)
        if machine_of(devices[aligned]) == m:
            return aligned
        there = on_machine.get(m)
        if there is None:
            return aligned
        return there[j % len(there)] if spread else there[0]
    return pick


def _sum_pieces(src, dst, machine_of: Callable[[int], int]) -> list[Piece]:
    at = {d: j for j, d in enumerate(dst.devices)}
    sets_d = holder_sets(dst)
    set_of = [0] * len(dst.devices)  # consumer replica -> its holder set
    for k, (a, b) in enumerate(sets_d):
        set_of[a:b] = [k] * (b - a)
    sets_s = holder_sets(src)
    # per producer set: its representative, the first holder on a consumer device (else its first)
    reps = [next((i for i in range(a, b) if src.devices[i] in at), a) for a, b in sets_s]
    local = all(src.devices[r] in at for r in reps)
    out: list[Piece] = []
    for (a, b), r in zip(sets_s, reps):
        k = set_of[at[src.devices[r]]] if local else 0
        mine = {src.devices[i]: i for i in range(a, b)}
        c0, c1 = sets_d[k]
        for j in range(c0, c1):
            aligned = a + (j - c0) % (b - a)  # consumer member i from producer member i
            i = mine.get(dst.devices[j], aligned)
            if c1 - c0 > 1 and machine_of(src.devices[i]) != machine_of(dst.devices[j]):
                out.append((aligned, j, "shard", 0, 0))  # from the aligned holder, scattered
            else:
                out.append((i, j, "sum", 0, 0))
    fed = {j for _, j, _, _, _ in out}
    return out + [(-1, j, "zeros", 0, 0) for j in range(len(dst.devices)) if j not in fed]


def move_kind(batch_dim: int | None, partial_sum: bool) -> str:
    """The move rule of a tensor: ``rows`` if it carries the batch, ``sum`` if it is a partial
    sum over the samples, else ``copy``."""
    return "rows" if batch_dim is not None else ("sum" if partial_sum else "copy")
