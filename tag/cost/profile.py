"""The profile database: measured op-group times, one JSON file per (device type, graph).

Layout: ``<root>/<device-type>/<model>-<graph signature>.json`` where ``device-type`` is
``cpu-<threads>t`` for a CPU running ``threads`` intra-op threads, or the catalog name of a GPU
(e.g. ``A100-40GB``); ``root`` defaults to the repository's ``data/profiles``
(:func:`default_profile_dir`; ``$TAG_PROFILE_DIR`` overrides). The communication fit of that device type lives next to it in
``comm.json`` (:mod:`tag.cost.comm`).

A profile holds, per op-group and phase, the median seconds measured at a few per-replica batch
sizes (``fwd``/``bwd``) and the batch-independent optimizer time (``opt``; the optimizer's fixed
per-step cost is stored once as ``opt_step_overhead_s``). Between profiled batch sizes times are
interpolated linearly; outside the profiled range they are extrapolated with the end segment's
slope (below the smallest never faster than proportional; a replica with a batch of 0 costs
nothing).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import TagError
from ..io import output_dir, read_json, write_json

PROFILE_VERSION = 1


class ProfileError(TagError):
    """A profile file is unreadable or malformed."""


def default_profile_dir() -> Path:
    """``$TAG_PROFILE_DIR``; else the repository's ``data/profiles`` when TAG runs from a checkout;
    else ``data/profiles`` in the user's data folder (``~/.local/share/tag``,
    :func:`tag.io.output_dir`). An installed wheel ships no profiles (they are measurements of
    particular machines): devices without one are costed by the roofline rule, and ``tag profile``
    writes there, never into the installed package nor the current folder."""
    env = os.environ.get("TAG_PROFILE_DIR")
    if env:
        return Path(env)
    return output_dir("data/profiles")


COMPILED = "-compiled"
"""Suffix of the device type of a profile whose stages ran through ``torch.compile`` (``tag profile
--compile``), e.g. ``cpu-1t-compiled``: what ``tag execute --compile`` runs, costed by
:meth:`tag.cost.CostModel.for_topology` with ``compiled``; eager costing never reads it (nor
scales another device type's from it)."""


def cpu_device_type(threads: int) -> str:
    """Device-type name of a CPU running ``threads`` intra-op threads."""
    return f"cpu-{int(threads)}t"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=,-]+", "_", text)[:60]


@dataclass
class Profile:
    """Measured times of one graph on one device type. Seconds; batches are per-replica samples."""

    device_type: str
    model: str
    graph_signature: str
    batch_size: int
    """Global batch the graph was captured at."""
    optimizer: str
    batches: list[int]
    """Profiled per-replica batch sizes, increasing."""
    fwd: list[list[float]]
    """[group][batch index] median seconds of the group's forward stage."""
    bwd: list[list[float]]
    """[group][batch index] median seconds of the group's backward stage."""
    opt: list[float]
    """[group] seconds of the optimizer update of the group's parameters (marginal)."""
    opt_step_overhead_s: float = 0.0
    """Fixed seconds of one ``optimizer.step()`` call, paid once per device per iteration."""
    meta: dict = field(default_factory=dict)
    """Provenance: repeats, warm-up, threads, torch version, host, date."""
    version: int = PROFILE_VERSION
    fwd_wake: list[list[float]] = field(default_factory=list)
    """[group][batch index] extra seconds the forward stage takes when its device starts it after
    idling ``wake_gap_s`` (cold caches, clocks down: measured on CPUs; empty = none)."""
    bwd_wake: list[list[float]] = field(default_factory=list)
    """[group][batch index] the same for the backward stage."""
    wake_gap_s: float = 0.0
    """Idle seconds before each stage when ``fwd_wake``/``bwd_wake`` were measured."""
    wake_tau_s: float = 0.0
    """Time constant (seconds) of the wake penalty's growth with the idle gap:
    ``extra(gap) = wake * (1 - exp(-gap / tau)) / (1 - exp(-wake_gap_s / tau))``."""

    @property
    def num_groups(self) -> int:
        return len(self.opt)

    def table(self, batches) -> np.ndarray:
        """Seconds ``[K, 3, len(batches)]`` (phases fwd, bwd, opt) at the given per-replica batches."""
        q = np.asarray(batches, dtype=float)
        xs = np.asarray(self.batches, dtype=float)
        out = np.zeros((self.num_groups, 3, len(q)))
        for ph, rows in ((0, self.fwd), (1, self.bwd)):
            y = np.asarray(rows, dtype=float)  # [K, nb]
            out[:, ph, :] = _interp_rows(q, xs, y)
        out[:, 2, :] = np.asarray(self.opt, dtype=float)[:, None]
        out[:, :, q <= 0] = 0.0
        return out

    @property
    def has_wake(self) -> bool:
        return bool(self.fwd_wake) and self.wake_gap_s > 0 and self.wake_tau_s > 0

    def wake_table(self, batches) -> np.ndarray:
        """Extra seconds ``[K, 2, len(batches)]`` (fwd, bwd) of a stage started after an idle gap of
        ``wake_gap_s``, interpolated like :meth:`table` (zeros without wake data)."""
        q = np.asarray(batches, dtype=float)
        out = np.zeros((self.num_groups, 2, len(q)))
        if self.has_wake:
            xs = np.asarray(self.batches, dtype=float)
            for ph, rows in ((0, self.fwd_wake), (1, self.bwd_wake)):
                out[:, ph, :] = np.maximum(_interp_rows(q, xs, np.asarray(rows, dtype=float)), 0.0)
            out[:, :, q <= 0] = 0.0
        return out

    # ---- I/O ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "profile") -> Profile:
        try:
            p = cls(**d)
        except TypeError as e:
            raise ProfileError(f"{source}: malformed profile: {e}") from e
        if p.version != PROFILE_VERSION:
            raise ProfileError(f"{source}: version: expected {PROFILE_VERSION}, got {p.version}")
        k = len(p.opt)
        if not p.batches or sorted(set(p.batches)) != list(p.batches):
            raise ProfileError(f"{source}: batches: expected increasing distinct sizes, got {p.batches}")
        for name in ("fwd", "bwd") + (("fwd_wake", "bwd_wake") if p.fwd_wake or p.bwd_wake else ()):
            rows = getattr(p, name)
            if len(rows) != k or any(len(r) != len(p.batches) for r in rows):
                raise ProfileError(f"{source}: {name}: expected {k} rows of {len(p.batches)} times")
        if p.fwd_wake and not (p.wake_gap_s > 0 and p.wake_tau_s > 0):
            raise ProfileError(f"{source}: wake_gap_s, wake_tau_s: expected positive seconds with wake times, "
                               f"got {p.wake_gap_s}, {p.wake_tau_s}")
        return p

    def path(self, root: str | os.PathLike) -> Path:
        return profile_path(root, self.device_type, self.model, self.graph_signature)

    def save(self, root: str | os.PathLike) -> Path:
        """Write under ``root`` (atomically), merging batch sizes with an existing profile."""
        path = self.path(root)
        merged = self
        if path.exists():
            try:
                old = load_profile(path)
            except ProfileError:
                old = None
            if old is not None and old.num_groups == self.num_groups and old.optimizer == self.optimizer:
                merged = _merge(old, self)
        write_json(path, _rounded(merged.to_dict()), indent=None)
        return path


def _interp_rows(q: np.ndarray, xs: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Piecewise-linear interpolation of every row of ``y`` (at ``xs``) at ``q``; outside
    ``[xs[0], xs[-1]]`` linear extrapolation with the end segment's slope (clamped >= 0), and
    below ``xs[0]`` never under ``y[0] * q / xs[0]`` (no faster than perfectly proportional)."""
    out = np.empty((y.shape[0], len(q)))
    for i in range(y.shape[0]):
        out[i] = np.interp(q, xs, y[i])
    if len(xs) >= 2:
        hi = q > xs[-1]
        if hi.any():
            slope = np.maximum((y[:, -1] - y[:, -2]) / (xs[-1] - xs[-2]), 0.0)
            out[:, hi] = y[:, -1:] + slope[:, None] * (q[hi] - xs[-1])[None, :]
        lo = q < xs[0]
        if lo.any():
            slope = np.maximum((y[:, 1] - y[:, 0]) / (xs[1] - xs[0]), 0.0)
            lin = y[:, :1] - slope[:, None] * (xs[0] - q[lo])[None, :]
            out[:, lo] = np.maximum(lin, y[:, :1] * (q[lo] / xs[0])[None, :])
    return out


def _merge(old: Profile, new: Profile) -> Profile:
    """Union of batch sizes; ``new`` wins where both measured. Wake data is kept when every merged
    batch size has some, measured with the same gap and time constant."""
    names = ("fwd", "bwd", "fwd_wake", "bwd_wake")
    cols: dict[int, list[list[float]]] = {}
    for p in (old, new):
        for j, b in enumerate(p.batches):
            cols[b] = [[r[j] for r in getattr(p, n)] if getattr(p, n) else [] for n in names]
    bs = sorted(cols)
    same = not old.has_wake or (old.wake_gap_s, old.wake_tau_s) == (new.wake_gap_s, new.wake_tau_s)
    wake = new.has_wake and same and all(cols[b][2] for b in bs)
    rows = [[[cols[b][i][g] for b in bs] for g in range(new.num_groups)] if i < 2 or wake else []
            for i in range(4)]
    return Profile(new.device_type, new.model, new.graph_signature, new.batch_size, new.optimizer, bs, rows[0],
                   rows[1], new.opt, new.opt_step_overhead_s, new.meta, fwd_wake=rows[2], bwd_wake=rows[3],
                   wake_gap_s=new.wake_gap_s if wake else 0.0, wake_tau_s=new.wake_tau_s if wake else 0.0)


def _rounded(d: dict) -> dict:
    """Times to 4 significant digits (measurement noise is far larger): small files."""
    def r(x):
        return float(f"{x:.4g}")
    d = dict(d)
    for name in ("fwd", "bwd", "fwd_wake", "bwd_wake"):
        d[name] = [[r(x) for x in row] for row in d[name]]
    d["opt"] = [r(x) for x in d["opt"]]
    d["opt_step_overhead_s"] = r(d["opt_step_overhead_s"])
    return d


def profile_path(root: str | os.PathLike, device_type: str, model: str, signature: str) -> Path:
    return Path(root) / _slug(device_type) / f"{_slug(model)}-{signature}.json"


def load_profile(path: str | os.PathLike) -> Profile:
    p = Path(path)
    d = read_json(p, ProfileError, "profile")
    if not isinstance(d, dict):
        raise ProfileError(f"{p}: expected a JSON object")
    return Profile.from_dict(d, source=str(p))


def profile_files(root: str | os.PathLike, device_type: str, signature: str) -> list[Path]:
    """The files under ``root`` holding a profile of graph ``signature`` on ``device_type``, sorted
    (:func:`find_profile` reads the first)."""
    folder = Path(root) / _slug(device_type)
    return sorted(folder.glob(f"*-{signature}.json")) if folder.is_dir() else []


def find_profile(root: str | os.PathLike, device_type: str, signature: str) -> Profile | None:
    """The profile of graph ``signature`` on ``device_type`` under ``root``, or None."""
    paths = profile_files(root, device_type, signature)
    return load_profile(paths[0]) if paths else None


def profiled_device_types(root: str | os.PathLike, signature: str) -> list[str]:
    """Device types under ``root`` holding a profile of graph ``signature`` (sorted)."""
    r = Path(root)
    if not r.is_dir():
        return []
    return sorted(d.name for d in r.iterdir() if d.is_dir() and any(d.glob(f"*-{signature}.json")))
