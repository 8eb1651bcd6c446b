"""Training data for ``tag run``: every rank reads only its own rows of each global batch.

A workload factory may return training data besides ``(model, inputs)``
(:func:`tag.workloads.factory.check_data`):

* a map-style dataset (``len(data)`` samples; ``data[i]`` one sample, a tensor or a tuple of
  tensors shaped as one row of each input): global batch ``n`` (0-based) of size ``B`` is samples
  ``n * B .. n * B + B - 1`` of an endless stream of epochs, epoch ``e`` a permutation of the
  dataset drawn from ``(seed, e)`` (:class:`DataOrder`); no sample is dropped, an epoch's last
  batch runs on into the next epoch;
* a callable ``data(step, start, stop)``: rows ``start..stop-1`` of global batch ``step``, a tuple
  of tensors (dim 0 = ``stop - start``); the user decides the order.

Both are functions of the step, so the order is the same on every rank and on every run under a
seed, and a resumed run reads on from its checkpoint's step without replaying anything. A rank
reads the rows its stages take as user inputs (:func:`rank_rows`: the plan's batch shares, per
micro-batch on a pipeline; a pipeline stage without the inputs and labels reads none) into the
full-batch input tensors its runtime's stages hold views of (:class:`RankFeeder`); the other rows
stay as they were and are never read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..errors import WorkloadError

Rows = Callable[[int, int, int, int], tuple]
"""``rows(batch, offset, start, stop)``: rows ``start..stop-1`` of the ``batch``-th global batch
(0-based), which begins at sample ``offset`` of the stream; one tensor per input."""


def is_dataset(data) -> bool:
    """A map-style dataset (``len`` and indexing), as opposed to a ``data(step, start, stop)`` callable."""
    return hasattr(data, "__len__") and hasattr(data, "__getitem__")


def epoch_seed(seed: int, epoch: int) -> int:
    """The 32-bit seed of epoch ``epoch``'s permutation: the first 4 bytes of SHA-256 of
    ``"seed:epoch"`` (torch's CPU generator keeps only the low 32 bits of a seed, so ``seed *
    2**32 + epoch`` gave every seed the same order)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:4], "little")


@dataclass
class DataOrder:
    """Which sample of a dataset of ``size`` samples is at position ``k`` of the stream: epoch
    ``k // size``, the epoch's permutation (``torch.randperm`` under :func:`epoch_seed`) at
    ``k % size``. Row ``j`` of a global batch beginning at stream position ``offset`` is position
    ``offset + j`` (``offset = batches before it x global batch``, counted in samples so that a
    run resumed at another global batch reads on)."""

    size: int
    seed: int
    _perms: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def epoch(self, e: int) -> torch.Tensor:
        """The permutation of epoch ``e`` (the two latest kept)."""
        if e not in self._perms:
            g = torch.Generator().manual_seed(epoch_seed(self.seed, e))
            self._perms[e] = torch.randperm(self.size, generator=g)
            for old in sorted(self._perms)[:-2]:
                del self._perms[old]
        return self._perms[e]

    def indices(self, offset: int, start: int, stop: int) -> list[int]:
        """Dataset indices of rows ``start..stop-1`` of the global batch beginning at ``offset``."""
        out = []
        for k in range(offset + start, offset + stop):
            out.append(int(self.epoch(k // self.size)[k % self.size]))
        return out


def as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _read(spec: str, what: str, fn):
    """``fn()``, the user's data code: what it raises is a WorkloadError naming ``what`` (one line)."""
    try:
        return fn()
    except WorkloadError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's dataset may raise anything
        raise WorkloadError(f"workload {spec!r}: {what} raised {type(e).__name__}: {' '.join(str(e).split())[:200]}"
                            ) from e


def _sample(spec: str, data, i: int) -> tuple:
    """Sample ``i`` of a dataset as a tuple of tensors (one per input)."""
    x = _read(spec, f"data[{i}]", lambda: data[i])
    if isinstance(x, Mapping):
        raise WorkloadError(f"workload {spec!r}: data[{i}] is a {type(x).__name__} with keys {sorted(map(str, x))}; "
                            "expected a tensor or a tuple of tensors in the order of the model's inputs")
    return tuple(torch.as_tensor(v) for v in as_tuple(x))


def rows_reader(data, seed: int, spec: str) -> Rows:
    """:data:`Rows` of ``data``: a dataset in :class:`DataOrder`, or the user's callable
    ``data(batch, start, stop)``."""
    if not is_dataset(data):
        return lambda batch, offset, start, stop: as_tuple(
            _read(spec, f"data({batch}, {start}, {stop})", lambda: data(batch, start, stop)))
    n = len(data)
    if n < 1:
        raise WorkloadError(f"workload {spec!r}: the factory's dataset is empty; expected at least one sample")
    order = DataOrder(n, seed)

    def rows(batch: int, offset: int, start: int, stop: int) -> tuple:
        samples = [_sample(spec, data, i) for i in order.indices(offset, start, stop)]
        if any(len(x) != len(samples[0]) for x in samples):
            raise WorkloadError(f"workload {spec!r}: the dataset's samples hold different numbers of tensors "
                                f"({sorted({len(x) for x in samples})}); expected one per input")
        return tuple(_read(spec, f"stacking input {c} of the dataset's samples",
                           lambda c=c: torch.stack([x[c] for x in samples])) for c in range(len(samples[0])))
    return rows


def merge(ranges) -> list[tuple[int, int]]:
    """Sorted, disjoint ``[start, stop)`` ranges covering ``ranges``."""
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def rank_rows(rt) -> list[tuple[int, int]]:
    """Rows ``[start, stop)`` of the global batch that the stages of runtime ``rt``
    (:class:`tag.executor.runtime.RankRuntime`) take as user inputs: its replicas' rows of the units
    reading an input, per micro-batch."""
    s, names = rt.schedule, set(rt.user_inputs)
    ranges = set()
    for key, stage in rt.stages.items():
        unit, micro = key[0], (key[2] if len(key) > 2 else 0)
        if names & set(stage.inputs):
            r = s.unit_at(unit, micro).replica_on(rt.rank)
            ranges.add((r.start, r.stop))
    return merge(ranges)


@dataclass
class RankFeeder:
    """Writes this rank's rows of global batch ``step`` into ``inputs`` (the full-batch tensors the
    runtime's stages read views of) in place."""

    rows: Rows
    inputs: tuple
    ranges: list[tuple[int, int]]
    spec: str
    read: int = 0
    """Rows read so far."""

    def feed(self, step: int, offset: int) -> None:
        """Rows of the ``step``-th global batch (0-based), beginning at stream sample ``offset``."""
        for a, b in self.ranges:
            got = self.rows(step, offset, a, b)
            if len(got) != len(self.inputs):
                raise WorkloadError(f"workload {self.spec!r}: data rows {a}..{b - 1} of batch {step} hold {len(got)} "
                                    f"tensors; expected {len(self.inputs)}, one per input")
            for i, (dst, src) in enumerate(zip(self.inputs, got)):
                want = (b - a, *dst.shape[1:])
                if not isinstance(src, torch.Tensor) or tuple(src.shape) != want or src.dtype != dst.dtype:
                    what = f"{src.dtype} {tuple(src.shape)}" if isinstance(src, torch.Tensor) else type(src).__name__
                    raise WorkloadError(f"workload {self.spec!r}: data input {i} of rows {a}..{b - 1} of batch {step} "
                                        f"is {what}; expected {dst.dtype} {want} (as the factory's inputs)")
                dst[a:b].copy_(src)
            self.read += b - a
