"""The transfers of one iteration as the event loop reads them: the flows between two groups'
deployments placed at their stages (:class:`PairFlows`), packed into one message per (source
device, destination device) of a stage (:func:`pack_messages`), and the all-gathers completing
pieces scattered into a tensor-parallel group (:class:`GatherSet`, :func:`merge_gathers`).

Stages are flat indices into a run's stage tables (:func:`stage_index`). The flows and messages
the event loop reads are exact tuples in the field order of :class:`StageFlow` and
:class:`Message`, always unpacked, never indexed: an exact tuple of numbers is untracked by the
garbage collector and builds in 0.34 us against a NamedTuple's 0.93 us (2026-11-29, Python 3.11;
a cold-cache simulation builds thousands), so the caches stay cheap. The NamedTuples declare the
one field order and read a tuple by name where speed does not matter (``StageFlow(*t)``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

from .static import BWD, FWD, PARAM
from .units import ENTRY_BYTES, FLOW_BYTES, Flow, PairTemplate, ref_bytes

if TYPE_CHECKING:
    from .engine import Simulator


class StageFlow(NamedTuple):
    """The field order of a flow into a stage (:attr:`PairFlows.stage_flows`)."""

    source_stage: int
    """Flat stage index of the producer (-1: a parameter, ready at the start)."""
    source_replica: int
    src_device: int
    dst_device: int
    src_machine: int
    """Source machine when the flow crosses machines, else -1."""
    dst_machine: int
    seconds: float
    dst_replica: int
    nbytes: float


class Message(NamedTuple):
    """The field order of a message (:func:`pack_messages`, :meth:`Simulator.messages`): every
    flow from one device to another that one stage needs."""

    source_stage: int
    source_replica: int
    more_sources: tuple[tuple[int, int], ...] | None
    """The other flows' ``(source stage, source replica)``, or None: ready once all are produced."""
    src_device: int
    dst_device: int
    src_machine: int
    dst_machine: int
    seconds: float
    dst_replica: int
    nbytes: float
    sender_waits: bool
    """The sender's compute stream waits for the message (a CPU rank, a rank that also receives in
    the step, or blocking sends)."""


class GatherSet(NamedTuple):
    """One consumer holder set's all-gather of the pieces scattered into it (replicas
    ``lo .. hi - 1`` of the stage, on ``devices``)."""

    lo: int
    hi: int
    devices: tuple[int, ...]
    seconds: float
    nbytes: float


class TimedGathers(NamedTuple):
    """A pair's :class:`GatherSet` list for one destination stage and each set's bytes per replica."""

    dst_stage: int
    sets: tuple[GatherSet, ...]
    chunks: tuple[tuple[float, ...], ...]


def stage_index(phase: int, group: int, chunk: int, num_groups: int) -> int:
    """Flat index of stage (phase, group, chunk) in a run's stage tables: ``phase * K + group +
    2K * chunk`` (data-parallel stages first, in group order); -1 for PARAM."""
    return -1 if phase == PARAM else phase * num_groups + group + 2 * num_groups * chunk


class PairFlows:
    """The flows between two groups' deployments (a :class:`PairTemplate` placed at groups ``g1``,
    ``g2``): per destination stage index as :class:`StageFlow` tuples for the event loop
    (``stage_flows``), and as :class:`Flow` objects for the recorder (``by_dst``, built on demand)."""

    __slots__ = ("template", "g1", "g2", "stage_flows", "gathers", "_timed", "_by_dst")

    def __init__(self, template: PairTemplate, g1: int, g2: int, num_groups: int):
        self.template, self.g1, self.g2 = template, g1, g2
        src_base = [phase * num_groups + g1 for phase in (FWD, BWD)]
        k2 = 2 * num_groups
        # Tuples of numbers only: the garbage collector stops tracking them (big caches stay cheap).
        self.stage_flows = tuple([
            (phase * num_groups + g2 + k2 * dst_unit,
             tuple([(src_base[src_phase] + k2 * src_unit if src_phase != PARAM else -1, src_rep, a, b, src_machine,
                     dst_machine, seconds, dst_rep, nbytes)
                    for src_phase, src_unit, src_rep, dst_rep, a, b, src_machine, dst_machine, seconds, nbytes
                    in flows]))
            for (phase, dst_unit), flows in template.by_dst])
        self.gathers = tuple((phase * num_groups + g2 + k2 * dst_unit, sets)
                             for (phase, dst_unit), sets in template.gathers)
        """Per destination stage index: the holder sets all-gathering scattered pieces
        (:attr:`PairTemplate.gathers`)."""
        self._timed = None
        self._by_dst = None

    def timed(self, sim: Simulator) -> tuple[TimedGathers, ...]:
        """:attr:`gathers` with each set's all-gather seconds and total bytes
        (:meth:`Simulator.scatter_gather_time`), made on first use: what a run takes as it is where
        no other pair scatters into the stage."""
        if self._timed is None:
            self._timed = tuple(
                TimedGathers(dst, tuple(GatherSet(s.lo, s.hi, s.devices, sim.scatter_gather_time(s.devices, s.chunks),
                                                  sum(s.chunks)) for s in sets),
                             tuple(s.chunks for s in sets))
                for dst, sets in self.gathers)
            sim.charge(ref_bytes(len(self._timed)) + sum(2 * ref_bytes(len(t.sets)) + ENTRY_BYTES * len(t.sets)
                                                         for t in self._timed))
        return self._timed

    @property
    def nbytes(self) -> int:
        """Approximate bytes of ``stage_flows`` and ``gathers`` (``by_dst``, made for the recorder
        only, not counted)."""
        return (sum(ref_bytes(len(flows)) + FLOW_BYTES * len(flows) for _, flows in self.stage_flows)
                + ref_bytes(len(self.stage_flows)) + ref_bytes(len(self.gathers)))

    @property
    def by_dst(self) -> list[tuple[tuple, list[Flow]]]:
        """``[((phase, g2, chunk), [Flow])]``: ``stage_flows`` with the stages spelled out."""
        if self._by_dst is None:
            g1, g2 = self.g1, self.g2
            self._by_dst = [((phase, g2, dst_unit),
                             [Flow((src_phase, g1, src_unit), src_rep, (phase, g2, dst_unit), dst_rep, a, b, nbytes,
                                   seconds, src_machine, dst_machine)
                              for src_phase, src_unit, src_rep, dst_rep, a, b, src_machine, dst_machine, seconds, nbytes
                              in flows])
                            for (phase, dst_unit), flows in self.template.by_dst]
        return self._by_dst

    @property
    def flows(self) -> list[Flow]:
        return [f for _, flows in self.by_dst for f in flows]


class ShiftedPair:
    """The flows of a :class:`PairFlows` moved to micro-batch ``micro`` (chunk ``micro`` of both
    groups); built for the recorder only (``by_dst``)."""

    __slots__ = ("pair", "micro", "_by_dst")

    def __init__(self, pair: PairFlows, micro: int):
        self.pair, self.micro, self._by_dst = pair, micro, None

    @property
    def by_dst(self) -> list[tuple[tuple, list[Flow]]]:
        if self._by_dst is None:
            m = self.micro
            self._by_dst = [((phase, g2, m), [replace(f, src=(f.src[0], f.src[1], m) if f.src[0] != PARAM else f.src,
                                                      dst=(phase, g2, m)) for f in flows])
                            for (phase, g2, _), flows in self.pair.by_dst]
        return self._by_dst


def pack_messages(flow_lists: list[tuple], p2p, blocking: bool, shared: list[bool]) -> list[tuple]:
    """The flows ``flow_lists`` (tuples of :attr:`PairFlows.stage_flows` entries, in order) into one
    stage as :class:`Message` tuples, one per (source device, destination device) in the order of
    their first flow: every flow from device a to device b this stage needs (the executor's CPU
    ranks send a step's pieces to one peer packed), ready once all are produced; a single flow
    keeps its seconds, several take those of the summed bytes (summed in flow order, ``p2p(a, b,
    bytes)``) and the last flow's machines and destination replica. The sender waits for its
    message where sends block (``blocking``), on a CPU rank (``shared[a]``: its communication
    shares the compute cores) and where it also receives in this step; a GPU rank that only
    sends posts its sends and computes on."""
    first: dict[tuple[int, int], tuple] = {}  # (a, b) -> its first flow, in order
    later: dict[tuple[int, int], list[tuple]] = {}  # (a, b) -> its other flows (few pairs have any)
    for flows in flow_lists:
        for flow in flows:
            _, _, a, b, _, _, _, _, _ = flow
            if (a, b) not in first:
                first[(a, b)] = flow
            elif (a, b) in later:
                later[(a, b)].append(flow)
            else:
                later[(a, b)] = [flow]
    receivers = {b for _, b in first}
    out = []
    for (a, b), flow in first.items():
        src_stage, src_rep, _, _, src_machine, dst_machine, seconds, dst_rep, nbytes = flow
        waits = blocking or shared[a] or a in receivers
        if not later or (a, b) not in later:
            out.append((src_stage, src_rep, None, a, b, src_machine, dst_machine, seconds, dst_rep, nbytes, waits))
            continue
        more = []
        for more_stage, more_rep, _, _, src_machine, dst_machine, _, dst_rep, more_bytes in later[(a, b)]:  # noqa: B007
            more.append((more_stage, more_rep))  # (the machines and replica kept: the last flow's)
            nbytes += more_bytes
        out.append((src_stage, src_rep, tuple(more), a, b, src_machine, dst_machine, p2p(a, b, nbytes), dst_rep,
                    nbytes, waits))
    return out


def merge_gathers(sim: Simulator, entries: list[TimedGathers]) -> list[GatherSet]:
    """The holder sets of one stage into which several pairs scatter (``entries``: their
    :meth:`PairFlows.timed` entries, in placement order): in order of first appearance, each set's
    chunks summed over the pairs in that order (``(0 + first) + second + ...``: the first pair's
    chunks, then the sums) and timed where more than one pair sent to it."""
    sets, chunks = list(entries[0].sets), list(entries[0].chunks)
    where = {(s.lo, s.hi, s.devices): i for i, s in enumerate(sets)}
    summed = set()
    for entry in entries[1:]:
        for s, c in zip(entry.sets, entry.chunks):
            key = (s.lo, s.hi, s.devices)
            i = where.get(key)
            if i is None:
                where[key] = len(sets)
                sets.append(s)
                chunks.append(c)
            else:
                chunks[i] = [y + z for y, z in zip(chunks[i], c)]
                summed.add(i)
    for i in summed:
        s = sets[i]
        sets[i] = GatherSet(s.lo, s.hi, s.devices, sim.scatter_gather_time(s.devices, tuple(chunks[i])), sum(chunks[i]))
    return sets
