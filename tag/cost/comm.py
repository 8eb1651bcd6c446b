"""Communication costs: latency-bandwidth fits and collective formulas.

Point to point: ``latency + bytes / bandwidth`` on the link between the two devices.

Collectives over ``n`` devices synchronising ``S`` bytes (``bw``: bytes/s, ``lat``: s):

* ring all-reduce (one machine, or one device per machine):
  ``2 (n-1)/n * S / bw_min + 2 (n-1) * lat_max`` over the ring's slowest link;
* hierarchical all-reduce (the group spans machines; ``k_m`` devices on machine ``m``, ``M``
  machines): reduce-scatter inside every machine, ring all-reduce of the machines' shards
  across the network, all-gather inside every machine:
  ``2 * max_m[(k_m-1)/k_m * S / bw_m + (k_m-1) lat_m] + 2 (M-1)/M * S / bw_net_min
  + 2 (M-1) * lat_net_max``. Every machine's network link carries ``S`` in total per
  direction (its ``k_m`` shards), as with ``k_m = 1``;
* parameter server on device ``s``: every replica ``w != s`` pushes ``S`` bytes to ``s``, then
  ``s`` sends the sum back; the server's link is shared by all those flows, so
  ``push = max_w lat(w, s) + sum_w S / bw(w, s)`` and the pull is the same.

For CPU devices talking through gloo, a measured fit (``comm.json``, :func:`profile_comm`)
replaces the topology's nominal figures: point-to-point ``alpha + bytes / beta``; all-reduce
from the 2-process all-reduce fit ``t2 = alpha + S / beta`` generalised to ``n`` processes as
``2 (n-1)/n * S / beta + (n-1) * alpha`` (equal to ``t2`` at ``n = 2``); all-gather (SFB
factors) from the 2-process all-gather fit ``t2 = alpha + S / beta`` (``S``: bytes each process
contributes) generalised to a ring over ``n`` processes contributing ``c_r`` bytes each as
``max_r (sum(c) - c_r) / beta + (n-1) * alpha`` (every process receives all chunks but its own;
equal to ``t2`` at ``n = 2`` with equal chunks).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..io import write_json
from .profile import ProfileError

COMM_OPS = ("p2p", "all_reduce", "broadcast", "reduce", "all_gather", "ps")


@dataclass(frozen=True)
class LinkFit:
    """``time = alpha + bytes / beta``."""

    alpha: float
    """Latency, seconds."""
    beta: float
    """Bandwidth, bytes/s."""

    def time(self, nbytes: float) -> float:
        return self.alpha + nbytes / self.beta


def fit_latency_bandwidth(nbytes, seconds) -> LinkFit:
    """Least-squares ``seconds = alpha + nbytes / beta`` with ``alpha >= 0`` and ``beta > 0``."""
    from scipy.optimize import nnls

    x = np.asarray(nbytes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    # Relative errors matter across 4 orders of magnitude of sizes: weight rows by 1/y.
    w = 1.0 / np.maximum(y, 1e-9)
    a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (alpha, inv_beta), _ = nnls(a, y * w)
    inv_beta = max(inv_beta, 1e-15)
    return LinkFit(float(alpha), float(1.0 / inv_beta))


@dataclass
class CommProfile:
    """Measured communication costs of one device type on one backend."""

    device_type: str
    backend: str
    world_size: int
    fits: dict[str, LinkFit]
    """op (``p2p``, ``all_reduce``, ``broadcast``, ``reduce``, ``all_gather``, ``ps``: a parameter
    server's reduce then broadcast back, as one sync; older profiles lack it) -> fit."""
    samples: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """op -> (bytes, median seconds) measurements the fits come from."""
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fits"] = {k: asdict(v) for k, v in self.fits.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "comm.json") -> CommProfile:
        try:
            fits = {k: LinkFit(float(v["alpha"]), float(v["beta"])) for k, v in d["fits"].items()}
            return cls(d["device_type"], d["backend"], int(d["world_size"]), fits,
                       {k: [tuple(s) for s in v] for k, v in d.get("samples", {}).items()}, d.get("meta", {}))
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{source}: malformed communication profile: {e}") from e

    def save(self, root: str | os.PathLike) -> Path:
        path = Path(root) / self.device_type / "comm.json"
        write_json(path, self.to_dict())
        return path


def load_comm_profile(path: str | os.PathLike) -> CommProfile:
    p = Path(path)
    try:
        return CommProfile.from_dict(json.loads(p.read_text()), source=str(p))
    except OSError as e:
        raise ProfileError(f"{p}: cannot read communication profile: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ProfileError(f"{p}: line {e.lineno}: not valid JSON: {e.msg}") from e


def find_comm_profile(root: str | os.PathLike, device_type: str) -> CommProfile | None:
    """``<root>/<device_type>/comm.json``, else any ``<root>/cpu-*/comm.json`` for a CPU type."""
    r = Path(root)
    exact = r / device_type / "comm.json"
    if exact.is_file():
        return load_comm_profile(exact)
    if device_type.startswith("cpu"):
        for p in sorted(r.glob("cpu-*/comm.json")):
            return load_comm_profile(p)
    return None


# ---------------------------------------------------------------------------------------------
# formulas (pure; the simulator calls them once per device set and caches the result)
# ---------------------------------------------------------------------------------------------
def ring_allreduce_time(n: int, nbytes: float, bw_min: float, lat_max: float) -> float:
    """``2 (n-1)/n * S / bw_min + 2 (n-1) lat_max``; 0 for ``n <= 1``."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bw_min + 2.0 * (n - 1) * lat_max


def hierarchical_allreduce_time(per_machine: list[tuple[int, float, float]], nbytes: float,
                                net_bw_min: float, net_lat_max: float) -> float:
    """``per_machine``: (devices k_m, intra bandwidth, intra latency) of every machine involved."""
    m = len(per_machine)
    intra = max(((k - 1) / k * nbytes / bw + (k - 1) * lat) if k > 1 else 0.0 for k, bw, lat in per_machine)
    inter = ring_allreduce_time(m, nbytes, net_bw_min, net_lat_max) if m > 1 else 0.0
    return 2.0 * intra + inter


def fitted_allreduce_time(n: int, nbytes: float, fit: LinkFit) -> float:
    """All-reduce over ``n`` processes from a 2-process fit (see the module docstring)."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / fit.beta + (n - 1) * fit.alpha


def fitted_allgather_time(chunks, fit: LinkFit) -> float:
    """Ring all-gather of ``chunks[r]`` bytes from each of ``n`` processes from a 2-process fit
    (see the module docstring); 0 for ``n <= 1``."""
    n = len(chunks)
    if n <= 1:
        return 0.0
    return (float(sum(chunks)) - min(chunks)) / fit.beta + (n - 1) * fit.alpha
