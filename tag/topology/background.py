"""Background traffic: the share of a machine's NIC or of a link that other jobs take, over time.

A topology may state, per machine (its NIC, both directions) and per link, a :class:`Background`:
the fraction ``busy`` (0 <= busy < 1) of its bandwidth that traffic of other jobs uses, as a step
function of the iteration's time in seconds:

* constant: ``background: 0.3``;
* periodic: ``background: {busy: 0.6, period: "2 s", on: "0.5 s", start: "0 s"}``: ``busy``
  during ``on`` seconds of every ``period`` from ``start``, nothing otherwise;
* a trace: ``background: {trace: preempt.csv}`` (lines ``time_s,busy``, a header line allowed,
  relative to the topology file) or ``{trace: [[0, 0.0], [1.5, 0.7]]}``: ``busy`` from each time
  on until the next (nothing before the first, the last value for good).

A message between two machines gets what the busiest of the sender's NIC, the receiver's NIC and
their link leaves (:func:`path_profile`), and takes the time in which that much of the nominal
bandwidth carries it (:meth:`Profile.finish`: its nominal seconds, latency included, stretched
over the available share); a gradient collective over several machines gets what the busiest of
their NICs and the links between them leaves (:func:`group_profile`), the same way. :meth:`Profile.mean` is the share left on average over a horizon
(planning for the expected condition, :func:`expected_topology`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass

from tag.errors import TopologyError

Segment = tuple[float, float, float]
"""``(start s, end s, available share of the bandwidth)``."""


@dataclass(frozen=True)
class Background:
    """Busy fraction of a NIC or link over time (module docstring)."""

    busy: float = 0.0
    """Constant or periodic: the fraction taken while busy (0 <= busy < 1)."""
    period_s: float | None = None
    """Periodic: the period in seconds (None: constant, or a trace)."""
    on_s: float = 0.0
    """Periodic: busy seconds at the start of every period (0 < on <= period)."""
    start_s: float = 0.0
    """Periodic: when the first period starts, seconds (>= 0)."""
    trace: tuple[tuple[float, float], ...] = ()
    """A trace: ``(time s, busy)`` steps, times increasing from >= 0."""

    def __post_init__(self) -> None:
        if self.trace:
            times = [t for t, _ in self.trace]
            if any(not _finite(t) or t < 0 for t in times) or any(b <= a for a, b in zip(times, times[1:])):
                raise TopologyError(f"background: trace: expected increasing times >= 0 s, got {times[:6]}")
            for t, b in self.trace:
                _check_busy(b, f"background: trace at {t:g} s")
            return
        _check_busy(self.busy, "background: busy")
        if self.period_s is not None:
            if not (_finite(self.period_s) and self.period_s > 0):
                raise TopologyError(f"background: period: expected a positive time, got {self.period_s!r}")
            if not (_finite(self.on_s) and 0 < self.on_s <= self.period_s):
                raise TopologyError(f"background: on: expected 0 < on <= period ({self.period_s:g} s), "
                                    f"got {self.on_s!r}")
            if not (_finite(self.start_s) and self.start_s >= 0):
                raise TopologyError(f"background: start: expected a time >= 0, got {self.start_s!r}")

    def segments(self, t: float) -> Iterator[Segment]:
        """Consecutive ``(start, end, available)`` from ``t`` on (the last one ends at inf)."""
        if self.trace:
            times = [x for x, _ in self.trace]
            i = bisect.bisect_right(times, t) - 1  # the step holding at t (-1: before the first)
            while True:
                end = times[i + 1] if i + 1 < len(times) else math.inf
                yield t, end, 1.0 - (self.trace[i][1] if i >= 0 else 0.0)
                if end == math.inf:
                    return
                t, i = end, i + 1
        if self.period_s is None:
            yield t, math.inf, 1.0 - self.busy
            return
        if t < self.start_s:
            yield t, self.start_s, 1.0
            t = self.start_s
        p, on = self.period_s, self.on_s
        k = math.floor((t - self.start_s) / p)
        while True:
            base = self.start_s + k * p
            if t < base + on:
                yield t, base + on, 1.0 - self.busy
                t = base + on
            if on < p:
                yield t, base + p, 1.0
            t = base + p
            k += 1

    def to_dict(self) -> float | dict:
        """What :func:`parse_background` reads back (seconds as numbers, a trace inline)."""
        if self.trace:
            return {"trace": [[t, b] for t, b in self.trace]}
        if self.period_s is None:
            return self.busy
        return {"busy": self.busy, "period": self.period_s, "on": self.on_s, "start": self.start_s}

    @property
    def horizon_s(self) -> float:
        """Seconds after which the profile repeats or holds (a period, or a trace's last time)."""
        if self.trace:
            return max(self.trace[-1][0], 1e-9)
        return self.start_s + self.period_s if self.period_s is not None else 1e-9


@dataclass(frozen=True)
class Profile:
    """The share left on a path: the least of its parts' available shares at every time."""

    parts: tuple[Background, ...]

    def segments(self, t: float) -> Iterator[Segment]:
        gens = [p.segments(t) for p in self.parts]
        cur = [next(g) for g in gens]
        while True:
            end = min(c[1] for c in cur)
            yield t, end, min(c[2] for c in cur)
            if end == math.inf:
                return
            t = end
            cur = [next(g) if c[1] <= end else c for g, c in zip(gens, cur)]

    def finish(self, start: float, seconds: float) -> float:
        """When a transfer of ``seconds`` at the nominal bandwidth, started at ``start``, ends."""
        work = seconds
        for t0, t1, a in self.segments(start):
            if a > 0 and (t1 - t0) * a >= work:
                return t0 + work / a
            work -= (t1 - t0) * a
        raise AssertionError("a profile's last segment is endless")  # (busy < 1: available > 0)

    def mean(self, horizon: float | None = None) -> float:
        """The available share averaged over ``[0, horizon]`` (default: the longest part's horizon)."""
        h = max(p.horizon_s for p in self.parts) if horizon is None else horizon
        total = 0.0
        for t0, t1, a in self.segments(0.0):
            total += (min(t1, h) - t0) * a
            if t1 >= h:
                break
        return total / h


def path_profile(topology, ma: int, mb: int) -> Profile | None:
    """The profile of a message from machine ``ma`` to ``mb`` (their NICs' and their link's
    backgrounds), or None when none of them carries any."""
    return group_profile(topology, (ma, mb))


def group_profile(topology, machines) -> Profile | None:
    """The profile of a collective over ``machines`` (indices; a ring or tree through all of them
    goes as fast as its most loaded part): every one's NIC and every link between two of them, or
    None when none carries background."""
    bg = topology.background
    if not bg:
        return None
    names = sorted({topology.machines[m].name for m in machines})
    keys = names + [frozenset((a, b)) for i, a in enumerate(names) for b in names[i + 1:]]
    parts = tuple(bg[k] for k in keys if bg.get(k) is not None)
    return Profile(parts) if parts else None


def expected_topology(topology):
    """``topology`` with every background replaced by its mean: each machine pair whose path
    carries background gets a link of that share of its bandwidth (:meth:`Profile.mean` over the
    longest horizon of the profile's parts), no background (plans for the expected condition)."""
    if not topology.background:
        return topology
    from .model import Topology

    links = dict(topology.links)
    n = topology.num_machines
    for i in range(n):
        for j in range(i + 1, n):
            prof = path_profile(topology, i, j)
            if prof is not None:
                bw, lat = topology.machine_bandwidth(i, j), topology.machine_latency(i, j)
                links[frozenset((topology.machines[i].name, topology.machines[j].name))] = (bw * prof.mean(), lat)
    return Topology(topology.name, topology.machines, topology.network_bandwidth, topology.network_latency, links)


CONDITIONS = ("stated", "expected", "none")
"""The network conditions a plan can be made for (:func:`planning_topology`; ``tag plan --background``)."""


def planning_topology(topology, condition: str):
    """The topology a plan is searched and costed on for the background ``condition``: ``stated``
    (``topology`` as it is: every iteration at time 0 of its backgrounds), ``expected``
    (:func:`expected_topology`: each background's mean share), ``none`` (no other job's traffic)."""
    if condition not in CONDITIONS:
        raise TopologyError(f"background condition: expected one of {', '.join(CONDITIONS)}, got {condition!r}")
    if condition == "stated" or not topology.background:
        return topology
    if condition == "expected":
        return expected_topology(topology)
    from dataclasses import replace

    return replace(topology, background={})


def parse_background(value, where: str, base_dir=None) -> Background:
    """A :class:`Background` from its YAML form (module docstring); :class:`TopologyError`
    naming ``where`` otherwise. ``base_dir``: where a trace file's relative path starts."""
    from .units import parse_time

    def seconds(key: str, spec: dict) -> float:
        try:
            return parse_time(spec[key], positive=False) if isinstance(spec[key], str) else float(spec[key])
        except (ValueError, TypeError, TopologyError):
            raise TopologyError(f"{where}.{key}: expected a time like '2 s', got {spec[key]!r}") from None

    try:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return Background(busy=float(value))
        if not isinstance(value, dict):
            raise TopologyError(f"{where}: expected a busy fraction 0..1 or a mapping with busy/period/on or trace, "
                                f"got {value!r}")
        extra = set(value) - {"busy", "period", "on", "start", "trace"}
        if extra:
            raise TopologyError(f"{where}: unknown key {sorted(extra)[0]!r}; expected busy, period, on, start or trace")
        if "trace" in value:
            if set(value) != {"trace"}:
                raise TopologyError(f"{where}: a trace takes no other key; got {sorted(value)}")
            return Background(trace=_trace(value["trace"], f"{where}.trace", base_dir))
        if "busy" not in value:
            raise TopologyError(f"{where}: missing field; expected busy (a fraction 0..1)")
        if "period" not in value:
            if set(value) != {"busy"}:
                raise TopologyError(f"{where}: on/start need a period; expected period with {sorted(value)}")
            return Background(busy=_number(value["busy"], f"{where}.busy"))
        if "on" not in value:
            raise TopologyError(f"{where}: missing field; expected on (busy seconds of each period)")
        return Background(busy=_number(value["busy"], f"{where}.busy"), period_s=seconds("period", value),
                          on_s=seconds("on", value), start_s=seconds("start", value) if "start" in value else 0.0)
    except TopologyError as e:
        msg = str(e)
        raise TopologyError(msg if msg.startswith(where) else f"{where}: {msg.removeprefix('background: ')}") from None


def _trace(value, where: str, base_dir) -> tuple[tuple[float, float], ...]:
    """``(time s, busy)`` rows of an inline list or a CSV file (``time_s,busy`` lines)."""
    if isinstance(value, str):
        from pathlib import Path

        path = Path(value) if base_dir is None or Path(value).is_absolute() else Path(base_dir) / value
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise TopologyError(f"{where}: cannot read {str(path)!r} ({e.strerror or e}); expected a CSV of "
                                "time_s,busy lines") from None
        rows = []
        for k, line in enumerate(lines, 1):
            cells = [c.strip() for c in line.split(",")]
            if not line.strip() or (k == 1 and not _numeric(cells[0])):
                continue  # (a blank line, or a header)
            if len(cells) != 2 or not all(_numeric(c) for c in cells):
                raise TopologyError(f"{where}: {path.name} line {k}: expected time_s,busy (two numbers), got {line!r}")
            rows.append((float(cells[0]), float(cells[1])))
        value = rows
    if not isinstance(value, (list, tuple)) or not value:
        raise TopologyError(f"{where}: expected a CSV file or a non-empty list of [time_s, busy] pairs, got {value!r}")
    out = []
    for row in value:
        if not isinstance(row, (list, tuple)) or len(row) != 2 or not all(_is_number(x) for x in row):
            raise TopologyError(f"{where}: expected [time_s, busy] pairs of numbers, got {row!r}")
        out.append((float(row[0]), float(row[1])))
    return tuple(out)


def _check_busy(value, where: str) -> None:
    if not (_is_number(value) and 0 <= value < 1):
        raise TopologyError(f"{where}: expected a busy fraction 0 <= busy < 1 (1 leaves nothing), got {value!r}")


def _number(value, where: str) -> float:
    if not _is_number(value):
        raise TopologyError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and _finite(x)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
