"""The one place that prices communication: point to point and every collective.

Every reader of communication cost goes through :class:`CommModel` (the simulator through its
cost model, the SFB selection :mod:`tag.compress`, the GNN features :mod:`tag.gnn.features`, the
search heuristics :mod:`tag.search.space`): built with the measured fits of a communication
profile by :meth:`CommModel.for_topology` (what :class:`tag.cost.CostModel` holds), or on the
topology's nominal links alone by :meth:`CommModel.nominal`. Units: bytes, seconds, bytes/s.

**Links.** ``bandwidth[a, b]`` / ``latency[a, b]`` of every ordered device pair are the
topology's, except between CPU devices of one machine whose device type has a communication
profile (``comm.json``, :mod:`tag.executor.commprof`): there the measured gloo point-to-point fit
``alpha + bytes / beta`` replaces them (those devices are *fitted*).

**Formulas** over ``n`` devices synchronising ``S`` bytes (``bw``: bytes/s, ``lat``: s):

* point to point: ``lat(a, b) + S / bw(a, b)`` (:meth:`CommModel.p2p_time`);
* ring all-reduce (``algorithm="flat"``): ``2 (n-1)/n * S / bw_min + 2 (n-1) * lat_max`` over the
  ring's slowest link, the ring in device-index order (machine by machine)
  (:func:`ring_allreduce_time`);
* hierarchical all-reduce (``algorithm="hierarchical"``, the default; the group spans machines,
  ``k_m`` devices on machine ``m``, ``M`` machines): reduce-scatter inside every machine, ring
  all-reduce of the machines' shards across the network between the machines' first devices,
  all-gather inside every machine: ``2 * max_m[(k_m-1)/k_m * S / bw_m + (k_m-1) lat_m] +
  2 (M-1)/M * S / bw_net_min + 2 (M-1) * lat_net_max`` (:func:`hierarchical_allreduce_time`).
  Every machine's network link carries ``S`` in total per direction (its ``k_m`` shards), as
  with ``k_m = 1``. On one machine it is the ring;
* ``algorithm="best"``: the faster of ring and hierarchical (what NCCL's algorithm choice does).
  The simulator charges ``hierarchical`` for all-reduce and ``best`` for all-gather;
* reduce to / broadcast from a root ``s``: every other device ``w`` sends ``S`` bytes to ``s``
  (receives them from ``s``), the root's link shared by all those flows:
  ``max_w lat(w, s) + sum_w S / bw(w, s)`` (:meth:`CommModel.reduce_time`,
  :meth:`CommModel.broadcast_time`);
* parameter server on device ``s``: reduce to ``s`` then broadcast the sum back
  (:meth:`CommModel.ps_time`); on links all equal to ``(bw, lat)`` with ``w`` workers this is
  ``2 (lat + w * S / bw)`` (:func:`uniform_ps_time`);
* tensor parallelism (:meth:`CommModel.tensor_parallel_time`, ``..._sync_time``): per Megatron
  block and direction the flat ring all-reduce of its activation over the group's devices (an
  all-gather plus a reduce-scatter with sequence parallelism: the same bytes); the gradient sync
  a hierarchical all-reduce of the replicated parameters over every device plus one of the split
  parameters over the data-parallel replicas' first devices (sequence parallel), or only rings
  over the replicas holding the same shard (plain Megatron);
* all-gather of ``c_r`` bytes from each device ``r`` (SFB factors, :meth:`CommModel.allgather_time`):
  flat ring, the link into device ``s`` carrying every chunk but ``s``'s own
  (``max_(a->s) (sum(c) - c_s) / bw(a, s) + (n-1) * lat_max``); hierarchical: the same ring over
  the machines (machine chunk: its devices' rows) then inside every machine; ``best`` of the two.

**Measured fits** (CPU devices talking through gloo, all of one machine and fitted):
all-reduce from the 2-process fit ``t2 = alpha + S / beta`` generalised to ``n`` processes as
``2 (n-1)/n * S / beta + (n-1) * alpha`` (equal to ``t2`` at ``n = 2``,
:func:`fitted_allreduce_time`); all-gather from the 2-process all-gather fit (``S``: bytes each
process contributes) generalised to a ring as ``max_r (sum(c) - c_r) / beta + (n-1) * alpha``
(every process receives all chunks but its own; :func:`fitted_allgather_time`); reduce,
broadcast and the parameter-server sync (reduce then broadcast back, one measured call) as
``alpha + w * S / beta`` for ``w`` workers (each worker's bytes through the root in turn); a
profile without the ``ps`` fit adds the reduce and broadcast fits.

**Slowest-link bounds.** Where a caller wants one number per device *set* without its
structure, it passes the set's slowest bandwidth and largest latency to the uniform forms
(:func:`ring_allreduce_time`, :func:`uniform_ps_time`, :meth:`LinkFit.time`): the GNN's action
features (:mod:`tag.gnn.features`) and the toy simulator's activation transfers
(:mod:`tag.search.toy`) do.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..io import read_json, write_json
from .profile import ProfileError

COMM_OPS = ("p2p", "all_reduce", "broadcast", "reduce", "all_gather", "ps")
SYNC_OPS = ("allreduce", "ps", "reducescatter")
"""Gradient collectives :meth:`CommModel.sync_time` prices (:class:`tag.parallel.Collective`'s ``op``);
``reducescatter`` may carry a shard size, ``reducescatter/S`` (hybrid sharding, :func:`shard_of_op`)."""


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
    return CommProfile.from_dict(read_json(path, ProfileError, "communication profile"), source=str(Path(path)))


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
# formulas on uniform links (pure; CommModel applies them to a device set's links)
# ---------------------------------------------------------------------------------------------
ALGORITHMS = ("hierarchical", "flat", "best")
"""All-reduce / all-gather algorithms (see the module docstring)."""


def ring_allreduce_time(n: int, nbytes: float, bw_min: float, lat_max: float) -> float:
    """``2 (n-1)/n * S / bw_min + 2 (n-1) lat_max``; 0 for ``n <= 1``."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bw_min + 2.0 * (n - 1) * lat_max


def ring_allgather_time(n: int, nbytes: float, bw_min: float, lat_max: float) -> float:
    """Ring all-gather of ``nbytes`` (the gathered tensor; each of the ``n`` members holds
    ``nbytes / n``): ``(n-1)/n * S / bw_min + (n-1) lat_max``; 0 for ``n <= 1``."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bw_min + (n - 1) * lat_max


def ring_reducescatter_time(n: int, nbytes: float, bw_min: float, lat_max: float) -> float:
    """Ring reduce-scatter of ``nbytes`` (each member's input; each ends with the sum of its
    ``nbytes / n``): the all-gather's traffic in reverse, ``(n-1)/n * S / bw_min + (n-1) lat_max``
    (with it, :func:`ring_allreduce_time`)."""
    return ring_allgather_time(n, nbytes, bw_min, lat_max)


def shard_of_op(op: str, n: int) -> int | None:
    """Devices per shard group of a ``reducescatter`` collective over ``n`` replicas: ``n`` for
    ``reducescatter``, ``S`` for ``reducescatter/S`` (hybrid sharding: ``n / S`` groups of ``S``
    consecutive replicas); None for another op."""
    if op == "reducescatter":
        return n
    head, sep, tail = op.partition("/")
    if head != "reducescatter" or not sep or not tail.isdigit() or int(tail) < 1 or n % int(tail):
        return None
    return int(tail)


def hierarchical_allreduce_time(per_machine: list[tuple[int, float, float]], nbytes: float,
                                net_bw_min: float, net_lat_max: float) -> float:
    """``per_machine``: (devices k_m, intra bandwidth, intra latency) of every machine involved."""
    m = len(per_machine)
    intra = max(((k - 1) / k * nbytes / bw + (k - 1) * lat) if k > 1 else 0.0 for k, bw, lat in per_machine)
    inter = ring_allreduce_time(m, nbytes, net_bw_min, net_lat_max) if m > 1 else 0.0
    return 2.0 * intra + inter


def uniform_ps_time(workers: float, nbytes: float, bw: float, lat: float) -> float:
    """Parameter-server sync (push then pull) of ``workers`` replicas other than the server on
    links all equal to ``(bw, lat)``: ``2 * (lat + workers * S / bw)``; 0 without workers (like
    :func:`ring_allreduce_time`, latencies count even for 0 bytes)."""
    if workers <= 0:
        return 0.0
    return 2 * (lat + workers * nbytes / bw)


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


def _ring_links(ring: list[int]) -> list[tuple[int, int]]:
    """``(ring[i], ring[i+1])`` around the ring (the last back to the first)."""
    return list(zip(ring, ring[1:] + ring[:1]))


# ---------------------------------------------------------------------------------------------
# the communication model of one topology
# ---------------------------------------------------------------------------------------------
class CommModel:
    """Links between the devices of one topology (measured where profiled) and the cost of every
    communication on them (see the module docstring).

    Args:
        bandwidth: [D, D] bytes/s (diagonal inf); latency: [D, D] seconds (diagonal 0).
        *_fit: measured gloo fits (2 processes) of the fitted devices, each ``None`` where the
            profile lacks it; fitted_devices: devices whose links are measured.
    """

    def __init__(self, topology, bandwidth: np.ndarray, latency: np.ndarray,
                 allreduce_fit: LinkFit | None = None, fitted_devices: frozenset = frozenset(),
                 allgather_fit: LinkFit | None = None, reduce_fit: LinkFit | None = None,
                 broadcast_fit: LinkFit | None = None, ps_fit: LinkFit | None = None):
        self.topology = topology
        self.bandwidth = bandwidth
        """[D, D] bytes/s (diagonal inf)."""
        self.latency = latency
        """[D, D] seconds (diagonal 0)."""
        self._bw = bandwidth.tolist()
        self._lat = latency.tolist()
        self.allreduce_fit = allreduce_fit
        self.allgather_fit = allgather_fit
        self.reduce_fit = reduce_fit
        self.broadcast_fit = broadcast_fit
        self.ps_fit = ps_fit
        """Measured parameter-server sync (reduce then broadcast back, one call; None in older
        profiles: :meth:`ps_time` then adds the reduce and broadcast fits)."""
        self._fitted = fitted_devices
        self._hier_cache: dict[tuple[int, ...], tuple[list, float, float]] = {}
        self._gather_cache: dict[tuple[int, ...], _GatherLinks] = {}
        self._root_cache: dict[tuple, tuple[float, list[float]]] = {}
        self._ring_cache: dict[tuple[int, ...], tuple] = {}
        self.machine_of = [topology.machine_of(d) for d in range(topology.num_devices)]
        """Machine index of every device (a list, indexed by device)."""

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def build(cls, topology, profiles: dict[str, CommProfile | None]) -> CommModel:
        """Topology links, with the measured gloo fit replacing the links between CPU devices of one
        machine whose device type (:func:`tag.cost.model.device_type`) has a profile in
        ``profiles``."""
        from .model import device_type

        bw = np.array(topology.bandwidth_matrix, dtype=float)
        lat = np.array(topology.latency_matrix, dtype=float)
        fitted: set[int] = set()
        ar_fit = ag_fit = rd_fit = bc_fit = ps_fit = None
        for m in range(topology.num_machines):
            devs = topology.devices_of_machine(m)
            prof = profiles.get(device_type(topology, devs[0]))
            if prof is None or "p2p" not in prof.fits:
                continue
            f = prof.fits["p2p"]
            for a in devs:
                for b in devs:
                    if a != b:
                        bw[a, b], lat[a, b] = f.beta, f.alpha
            fitted.update(devs)
            ar_fit = prof.fits.get("all_reduce", ar_fit)
            ag_fit = prof.fits.get("all_gather", ag_fit)
            rd_fit = prof.fits.get("reduce", rd_fit)
            bc_fit = prof.fits.get("broadcast", bc_fit)
            ps_fit = prof.fits.get("ps", ps_fit)
        return cls(topology, bw, lat, ar_fit, frozenset(fitted), ag_fit, rd_fit, bc_fit, ps_fit)

    def restricted(self, topology, devices: list[int]) -> CommModel:
        """This model's links among ``devices`` (measured fits kept) as the model of ``topology``,
        whose device ``i`` is device ``devices[i]`` here (:meth:`tag.topology.Topology.restricted`)."""
        ix = np.ix_(devices, devices)
        fitted = frozenset(i for i, d in enumerate(devices) if d in self._fitted)
        return CommModel(topology, self.bandwidth[ix], self.latency[ix], self.allreduce_fit, fitted,
                         self.allgather_fit, self.reduce_fit, self.broadcast_fit, self.ps_fit)

    @classmethod
    def for_topology(cls, topology, profile_dir=None) -> CommModel:
        """With the communication profiles found under ``profile_dir`` (default
        :func:`tag.cost.profile.default_profile_dir`) for the topology's CPU device types: the
        model :meth:`tag.cost.CostModel.for_topology` holds."""
        from .model import device_type
        from .profile import default_profile_dir

        root = default_profile_dir() if profile_dir is None else profile_dir
        profiles: dict[str, CommProfile | None] = {}
        for d in range(topology.num_devices):
            dt = device_type(topology, d)
            if dt not in profiles:
                profiles[dt] = find_comm_profile(root, dt) if dt.startswith("cpu") else None
        return cls.build(topology, profiles)

    @classmethod
    def nominal(cls, topology) -> CommModel:
        """The topology's datasheet links, no measured fit (one shared model per topology)."""
        hit = _NOMINAL.get(id(topology))
        if hit is not None and hit[0] is topology:
            return hit[1]
        if len(_NOMINAL) > 64:
            _NOMINAL.clear()
        model = cls.build(topology, {})
        _NOMINAL[id(topology)] = (topology, model)
        return model

    # ---- links ---------------------------------------------------------------------------
    def machine_bandwidth(self, m1: int, m2: int) -> float:
        """Bytes/s between machines ``m1`` and ``m2``; ``m1 == m2``: between two devices of the
        machine (the measured fit where fitted; a one-device machine: the topology's figure)."""
        a, b = self.topology.devices_of_machine(m1), self.topology.devices_of_machine(m2)
        if m1 != m2:
            return self._bw[a[0]][b[0]]
        return self._bw[a[0]][a[1]] if len(a) > 1 else self.topology.machine_bandwidth(m1, m1)

    def machine_latency(self, m1: int, m2: int) -> float:
        """Seconds between machines ``m1`` and ``m2`` (``m1 == m2``: inside the machine, as
        :meth:`machine_bandwidth`)."""
        a, b = self.topology.devices_of_machine(m1), self.topology.devices_of_machine(m2)
        if m1 != m2:
            return self._lat[a[0]][b[0]]
        return self._lat[a[0]][a[1]] if len(a) > 1 else self.topology.machine_latency(m1, m1)

    def _fit(self, fit: LinkFit | None, devices) -> LinkFit | None:
        """``fit`` when it applies to ``devices``: all fitted and all on one machine."""
        if fit is None or not all(d in self._fitted for d in devices):
            return None
        mo = self.machine_of
        return fit if len({mo[d] for d in devices}) == 1 else None

    # ---- point to point ------------------------------------------------------------------
    def p2p_time(self, a: int, b: int, nbytes: float) -> float:
        """Seconds to move ``nbytes`` from device ``a`` to ``b`` (0 when ``a == b``)."""
        if a == b:
            return 0.0
        return self._lat[a][b] + nbytes / self._bw[a][b]

    # ---- all-reduce ----------------------------------------------------------------------
    def allreduce_time(self, devices, nbytes: float, algorithm: str = "hierarchical") -> float:
        """Seconds to all-reduce ``nbytes`` over ``devices`` by ``algorithm`` (:data:`ALGORITHMS`):
        the measured fit among fitted devices of one machine, else the ring on one machine and
        ``algorithm`` across machines."""
        devs = sorted(devices)
        n = len(devs)
        if n <= 1 or nbytes <= 0:
            return 0.0
        mo = self.machine_of
        machines = sorted({mo[d] for d in devs})
        if len(machines) == 1 or algorithm == "flat":
            return self._ring_allreduce(devs, nbytes)
        if algorithm == "hierarchical":
            return self._hierarchical_allreduce(devs, machines, nbytes)
        if algorithm == "best":
            return min(self._ring_allreduce(devs, nbytes), self._hierarchical_allreduce(devs, machines, nbytes))
        raise ValueError(f"allreduce_time: algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")

    def _ring_allreduce(self, devs: list[int], nbytes: float) -> float:
        fit = self._fit(self.allreduce_fit, devs)
        if fit is not None:
            return fitted_allreduce_time(len(devs), nbytes, fit)
        ring = _ring_links(devs)
        return ring_allreduce_time(len(devs), nbytes, min(self._bw[a][b] for a, b in ring),
                                   max(self._lat[a][b] for a, b in ring))

    def _hierarchical_allreduce(self, devs: list[int], machines: list[int], nbytes: float) -> float:
        per_machine, bw, lat = self._hierarchical_links(devs, machines)
        return hierarchical_allreduce_time(per_machine, nbytes, bw, lat)

    def _hierarchical_links(self, devs: list[int], machines: list[int]) -> tuple[list, float, float]:
        """``(per_machine, net_bw_min, net_lat_max)`` of :func:`hierarchical_allreduce_time` for the
        device set ``devs`` on ``machines`` (sorted): a function of the set alone, cached (a search on
        512 GPUs prices the same sets for every group, each an O(devices) walk of its rings)."""
        key = tuple(devs)
        hit = self._hier_cache.get(key)
        if hit is None:
            hit = _remember(self._hier_cache, key, self._walk_hierarchical(devs, machines))
        return hit

    def _walk_hierarchical(self, devs: list[int], machines: list[int]) -> tuple[list, float, float]:
        mo = self.machine_of
        on: dict[int, list[int]] = {}  # machine -> its devices of devs, ascending (one pass: O(n))
        for d in devs:
            on.setdefault(mo[d], []).append(d)
        per_machine = []
        for m in machines:
            ds = on[m]
            ring = _ring_links(ds)
            bw = min((self._bw[a][b] for a, b in ring if a != b), default=float("inf"))
            lat = max((self._lat[a][b] for a, b in ring if a != b), default=0.0)
            per_machine.append((len(ds), bw, lat))
        ring = _ring_links([on[m][0] for m in machines])  # first device each
        return per_machine, min(self._bw[a][b] for a, b in ring), max(self._lat[a][b] for a, b in ring)

    # ---- reduce, broadcast, parameter server -----------------------------------------------
    def reduce_time(self, devices, root: int, nbytes: float) -> float:
        """Every device of ``devices`` but ``root`` sends ``nbytes`` to ``root`` (summed there), the
        root's link shared by all flows; the measured reduce fit among fitted devices of one machine."""
        return self._to_or_from_root(devices, root, nbytes, self.reduce_fit, to_root=True)

    def broadcast_time(self, devices, root: int, nbytes: float) -> float:
        """``root`` sends ``nbytes`` to every other device of ``devices``, its link shared by all
        flows; the measured broadcast fit among fitted devices of one machine."""
        return self._to_or_from_root(devices, root, nbytes, self.broadcast_fit, to_root=False)

    def _to_or_from_root(self, devices, root: int, nbytes: float, fit: LinkFit | None, to_root: bool) -> float:
        workers = [w for w in devices if w != root]
        if not workers or nbytes <= 0:
            return 0.0
        f = self._fit(fit, workers + [root])
        if f is not None:
            return f.alpha + len(workers) * nbytes / f.beta
        key = (tuple(workers), root, to_root)
        hit = self._root_cache.get(key)  # (largest latency, the workers' bandwidths) of a set
        if hit is None:
            if to_root:
                hit = (max(self._lat[w][root] for w in workers), [self._bw[w][root] for w in workers])
            else:
                hit = (max(self._lat[root][w] for w in workers), [self._bw[root][w] for w in workers])
            _remember(self._root_cache, key, hit)
        return hit[0] + sum(nbytes / bw for bw in hit[1])

    def sync_time(self, op: str, devices, nbytes: float, server: int | None = None,
                  algorithm: str = "hierarchical") -> float:
        """Seconds of one gradient collective ``op`` of ``nbytes`` (a
        :class:`tag.parallel.Collective`'s: ``allreduce`` over ``devices`` by ``algorithm``,
        ``ps`` over ``devices`` via ``server``); ValueError naming ``op`` otherwise."""
        if op == "allreduce":
            return self.allreduce_time(devices, nbytes, algorithm)
        if op == "ps":
            if server is None:
                raise ValueError("server: expected a device index for collective 'ps', got None")
            return self.ps_time(devices, server, nbytes)
        shard = shard_of_op(op, len(devices))
        if shard is not None:
            return self.sharded_sync_time(devices, shard, nbytes)
        raise ValueError(f"collective {op!r}: expected one of {list(SYNC_OPS)} (reducescatter/S: S dividing "
                         f"the {len(devices)} replicas)")

    def shard_groups(self, devices, shard: int) -> list[list[int]]:
        """``devices`` (plan order) cut into groups of ``shard`` consecutive ones."""
        devs = list(devices)
        return [devs[i:i + shard] for i in range(0, len(devs), shard)]

    def reducescatter_time(self, devices, nbytes: float) -> float:
        """Seconds of a reduce-scatter of ``nbytes`` per member over ``devices`` (each keeps the
        sum of its ``1 / n``): priced as the all-gather of ``n`` chunks of ``nbytes / n``
        (:meth:`allgather_time`, ring or hierarchical, the faster; a ring reduce-scatter moves the
        same bytes over the same links in reverse)."""
        n = len(devices)
        if n <= 1 or nbytes <= 0:
            return 0.0
        return self.allgather_time([nbytes / n] * n, list(devices))

    def shard_gather_time(self, devices, shard: int, nbytes: float) -> float:
        """Seconds of the all-gather of ``nbytes`` sharded over each group of ``shard`` consecutive
        ``devices`` (the groups at once, on disjoint devices: the slowest)."""
        if shard <= 1 or nbytes <= 0:
            return 0.0
        return max(self.allgather_time([nbytes / shard] * shard, grp) for grp in self.shard_groups(devices, shard))

    def sharded_sync_time(self, devices, shard: int, nbytes: float) -> float:
        """Sharded data parallelism's gradient sync of ``nbytes``: a reduce-scatter inside each group
        of ``shard`` consecutive ``devices`` (at once, the slowest), then, hybrid sharding
        (``shard < n``), an all-reduce of each ``nbytes / shard`` shard across the groups (the
        ``shard`` rings at once: priced as the one over the groups' first devices)."""
        groups = self.shard_groups(devices, shard)
        t = max(self.reducescatter_time(grp, nbytes) for grp in groups)
        if len(groups) > 1:
            t += self.allreduce_time([grp[0] for grp in groups], nbytes / shard)
        return t

    def ps_time(self, devices, server: int, nbytes: float) -> float:
        """Parameter-server sync: reduce to ``server`` then broadcast the sum back (what the
        executor runs); the measured PS sync fit among fitted devices of one machine where the
        profile has one."""
        workers = [w for w in devices if w != server]
        if not workers or nbytes <= 0:
            return 0.0
        f = self._fit(self.ps_fit, workers + [server])
        if f is not None:
            return f.alpha + len(workers) * nbytes / f.beta
        return self.reduce_time(devices, server, nbytes) + self.broadcast_time(devices, server, nbytes)

    def ring_key(self, devices) -> tuple:
        """What :meth:`allreduce_time` with ``algorithm="flat"`` (and so :meth:`tensor_parallel_time`)
        reads of the device set ``devices``: two sets with equal keys take equal seconds for every
        byte count (the count, whether the measured fit applies, else the ring's slowest bandwidth
        and largest latency); cached per set (a 512-device layout prices one per tensor-parallel
        group, most of them alike)."""
        key = tuple(devices)
        hit = self._ring_cache.get(key)
        if hit is None:
            devs = sorted(key)
            if len(devs) <= 1:
                hit = (len(devs),)
            elif self._fit(self.allreduce_fit, devs) is not None:
                hit = (len(devs), "fit")
            else:
                ring = _ring_links(devs)
                hit = (len(devs), min(self._bw[a][b] for a, b in ring), max(self._lat[a][b] for a, b in ring))
            _remember(self._ring_cache, key, hit)
        return hit

    # ---- tensor parallelism ------------------------------------------------------------------
    def tensor_parallel_time(self, devices, nbytes: list[float]) -> float:
        """Seconds of a tensor-parallel group's blocking collectives in one pass: per Megatron
        block an all-gather of the token shards entering it and a reduce-scatter leaving it, the
        bytes of one ring all-reduce of ``nbytes[i]`` (the block's full activation) over
        ``devices`` (one machine)."""
        return sum(self.allreduce_time(devices, b, "flat") for b in nbytes if b > 0)

    def tensor_parallel_sync_time(self, tp_groups, split_bytes: float, rest_bytes: float,
                                  sequence_parallel: bool = True) -> float:
        """Gradient sync of a tensor-parallel op-group with data-parallel replicas ``tp_groups``
        (each a list of ``T`` devices of one machine). The split parameters' gradients
        (``split_bytes`` in all, ``1 / T`` per device) are all-reduced over the replicas holding
        the same shard: the ``T`` shard rings run at once over the same machines' links, priced
        as one ring of all ``split_bytes`` over the replicas' first devices. The replicated
        parameters' gradients (``rest_bytes``): with ``sequence_parallel`` partial over the token
        shards, all-reduced over every device first; without it (plain Megatron) identical within
        a tensor-parallel group, so summed over the replicas only, in the same ``T`` shard rings
        (each carrying ``rest_bytes``: ``T * rest_bytes`` more in the priced ring); nothing with
        one replica."""
        if not sequence_parallel:
            n = len(tp_groups[0]) if tp_groups else 1
            total = split_bytes + n * rest_bytes
            if len(tp_groups) < 2 or total <= 0:
                return 0.0
            return self.allreduce_time([grp[0] for grp in tp_groups], total)
        devs = [d for grp in tp_groups for d in grp]
        t = self.allreduce_time(devs, rest_bytes) if rest_bytes > 0 else 0.0
        if len(tp_groups) > 1 and split_bytes > 0:
            t += self.allreduce_time([grp[0] for grp in tp_groups], split_bytes)
        return t

    # ---- all-gather ----------------------------------------------------------------------
    def allgather_time(self, chunks, devices, algorithm: str = "best") -> float:
        """Seconds to all-gather ``chunks[r]`` bytes from each ``devices[r]`` (aligned): the
        measured fit among fitted devices of one machine, else the ring or hierarchical form
        (``algorithm``, :data:`ALGORITHMS`) on the links."""
        t = self.fitted_allgather_time(chunks, devices)
        if t is not None:
            return t
        if algorithm == "flat":
            return self._ring_allgather(chunks, devices)
        if algorithm == "hierarchical":
            return self._hierarchical_allgather(chunks, devices)
        if algorithm == "best":
            return min(self._ring_allgather(chunks, devices), self._hierarchical_allgather(chunks, devices))
        raise ValueError(f"allgather_time: algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")

    def fitted_allgather_time(self, chunks, devices) -> float | None:
        """The measured gloo all-gather fit (:func:`fitted_allgather_time`) when every device is
        fitted and all are on one machine; ``None`` otherwise."""
        fit = self._fit(self.allgather_fit, devices)
        return None if fit is None else fitted_allgather_time(list(chunks), fit)

    def _ring_allgather(self, chunks, devices) -> float:
        if len(devices) < 2:
            return 0.0
        lk = self._gather_links(devices)
        total = float(sum(chunks))
        c = np.asarray(chunks, dtype=np.float64)
        # the link a -> b carries every chunk except b's own
        t = float(np.max((total - c[lk.ring_to]) / lk.ring_bw))
        return t + (len(devices) - 1) * lk.ring_lat

    def _hierarchical_allgather(self, chunks, devices) -> float:
        lk = self._gather_links(devices)
        if len(lk.machines) < 2:
            return self._ring_allgather(chunks, devices)
        total = float(sum(chunks))
        c = np.asarray(chunks, dtype=np.float64)
        mchunk = np.array([sum(chunks[i] for i in pos) for pos in lk.machine_pos], dtype=np.float64)
        inter = float(np.max((total - mchunk[lk.inter_to]) / lk.inter_bw))
        inter += (len(lk.machines) - 1) * lk.inter_lat
        intra = 0.0
        if len(lk.intra_bw):  # every local device receives everything but its own rows
            t = np.maximum.reduceat((total - c[lk.intra_to]) / lk.intra_bw, lk.intra_start) + lk.intra_lat
            intra = max(intra, float(np.max(t)))
        return inter + intra

    def _gather_links(self, devices) -> _GatherLinks:
        """The links of the ring and hierarchical all-gathers over ``devices`` (aligned with the
        chunks), cached per device sequence: what the formulas walk, as arrays (an SFB selection
        on 512 GPUs prices every factor of every group over the same sets)."""
        key = tuple(devices)
        hit = self._gather_cache.get(key)
        return hit if hit is not None else _remember(self._gather_cache, key, self._walk_gather(key))

    def _walk_gather(self, key: tuple[int, ...]) -> _GatherLinks:
        at = {d: i for i, d in enumerate(key)}  # device -> its chunk
        bw, lat = self._bw, self._lat
        ring = _ring_links(sorted(key))
        per: dict[int, list[int]] = {}
        for d in sorted(key):
            per.setdefault(self.machine_of[d], []).append(d)
        machines = sorted(per)
        lead = {m: per[m][0] for m in machines}  # machine links: between the machines' devices
        inter = _ring_links(list(range(len(machines))))
        intra = [(m, _ring_links(per[m])) for m in machines if len(per[m]) > 1]
        starts = np.cumsum([0] + [len(r) for _, r in intra[:-1]]).astype(np.int64)
        return _GatherLinks(
            ring_to=np.array([at[b] for _, b in ring], dtype=np.int64),
            ring_bw=np.array([bw[a][b] for a, b in ring], dtype=np.float64),
            ring_lat=max((lat[a][b] for a, b in ring), default=0.0),
            machines=machines,
            machine_pos=[[at[d] for d in per[m]] for m in machines],
            inter_to=np.array([j for _, j in inter], dtype=np.int64),
            inter_bw=np.array([bw[lead[machines[i]]][lead[machines[j]]] for i, j in inter], dtype=np.float64),
            inter_lat=max((lat[lead[machines[i]]][lead[machines[j]]] for i, j in inter), default=0.0),
            intra_to=np.array([at[b] for _, r in intra for _, b in r], dtype=np.int64),
            intra_bw=np.array([bw[a][b] for _, r in intra for a, b in r], dtype=np.float64),
            intra_start=starts,
            intra_lat=np.array([(len(per[m]) - 1) * max(lat[a][b] for a, b in r) for m, r in intra],
                               dtype=np.float64),
        )


CACHE_SETS = 1024
"""Device sets a :class:`CommModel` remembers per cache before it starts over (a search meets a
few hundred: its action space's subsets; at 512 GPUs an entry holds up to ~20 KB)."""


def _remember(cache: dict, key, value):
    """``cache[key] = value`` (the cache cleared first once it holds :data:`CACHE_SETS`); ``value``."""
    if len(cache) >= CACHE_SETS:
        cache.clear()
    cache[key] = value
    return value


@dataclass(frozen=True)
class _GatherLinks:
    """The links the all-gather formulas walk over one device sequence (:meth:`CommModel._gather_links`);
    ``*_to``: index of the chunk (or machine) each link delivers to."""

    ring_to: np.ndarray
    ring_bw: np.ndarray
    """[n] bytes/s of the flat ring's links (ascending device order)."""
    ring_lat: float
    """Largest latency on the flat ring, seconds."""
    machines: list[int]
    machine_pos: list[list[int]]
    """Per machine (ascending), the chunk indices of its devices (ascending device order)."""
    inter_to: np.ndarray
    inter_bw: np.ndarray
    """Bytes/s of the ring over the machines' first devices."""
    inter_lat: float
    intra_to: np.ndarray
    intra_bw: np.ndarray
    """Bytes/s of every machine's own ring (machines with 2+ devices), concatenated."""
    intra_start: np.ndarray
    """Where each machine's ring starts in ``intra_*``."""
    intra_lat: np.ndarray
    """Per such machine: (devices - 1) x its ring's largest latency, seconds."""


_NOMINAL: dict[int, tuple[object, CommModel]] = {}
"""id(topology) -> (topology, its nominal CommModel) (:meth:`CommModel.nominal`)."""
