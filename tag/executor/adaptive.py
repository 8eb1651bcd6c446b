"""Ada-Grouper's adaptive kFkB on the executor (``tag execute --adaptive-k``): between iterations
every rank changes the block size ``k`` of its pipeline's kFkB schedule to the one
:func:`tag.parallel.adaptive.choose_k` (the simulator's replay rule, :mod:`tag.sim.adaptive`)
takes from the iteration just run, among the block sizes that fit the devices' memory (the
launcher's simulation, :func:`tag.sim.adaptive.fitting_ks`).

What an iteration measures, on each rank (host clock: CPU ranks): the seconds of its fused segments
running forward and backward stages (a segment holding both split 1 : 2 per forward and backward
stage, their usual FLOP ratio), and the seconds of every message it sent to a rank of another
stage (:attr:`tag.executor.comm.DistComm.sent_s`: from the post to the completion of the send).
The ranks all-gather the three sums; as :func:`tag.sim.adaptive.measure` does, the slowest rank's
forward / backward seconds per micro-batch and the messages' seconds summed over the ranks per one
of the ``2 (S - 1) M`` boundary crossings feed the rule, so every rank computes the same ``k``.
Switching ``k`` swaps the schedule every rank walks (the same steps in another order) and its
rank program (:meth:`RankRuntime.use_schedule <tag.executor.runtime.RankRuntime.use_schedule>`),
built once per ``k``.

:class:`Throttle` (``--inject-delay``, hidden; testing and evaluation): some ranks' links hold
each message they send a stated number of seconds, one message at a time, in stated iterations
(a slow or preempted network; the rank's compute goes on meanwhile).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from ..errors import TagError
from ..parallel.adaptive import choose_k
from ..parallel.pipeline import stage_of_group
from .runtime import ExecutionError


@dataclass(frozen=True)
class Throttle:
    """The :attr:`ranks` delay each message they send by :attr:`delay_s` in iterations
    ``start <= it < stop`` (warm-up ones counted)."""

    ranks: frozenset[int]
    delay_s: float
    start: int = 0
    stop: int | None = None

    @classmethod
    def parse(cls, spec: str | None) -> Throttle | None:
        """``RANKS:MS[:FROM[:TO]]`` (ranks comma-separated, milliseconds; iterations ``FROM`` to
        ``TO`` exclusive), or None."""
        if not spec:
            return None
        try:
            parts = spec.split(":")
            if not 2 <= len(parts) <= 4:
                raise ValueError
            t = cls(frozenset(int(r) for r in parts[0].split(",")), float(parts[1]) / 1e3, int(parts[2]) if len(parts) > 2 else 0,
                    int(parts[3]) if len(parts) > 3 else None)
        except ValueError:
            t = None
        if t is None or min(t.ranks) < 0 or not 0 <= t.delay_s < 3600 or t.start < 0:
            raise TagError(f"--inject-delay: expected RANKS:MS[:FROM[:TO]] (ranks >= 0, 0 <= MS, iterations >= 0), "
                           f"got {spec!r}")
        return t

    def delay_at(self, rank: int, it: int) -> float:
        """Seconds rank ``rank``'s link holds each message in iteration ``it``."""
        on = rank in self.ranks and it >= self.start and (self.stop is None or it < self.stop)
        return self.delay_s if on else 0.0


class AdaptiveK:
    """One rank's controller: :meth:`step_done` after each schedule step it walks (to measure),
    :meth:`next_k` between iterations (every rank at once: an all-gather)."""

    def __init__(self, allowed: list[int], ex, graph, machine_of, bucket_bytes: int | None, rt, comm) -> None:
        plan = ex.plan
        pp = plan.pipeline
        if pp is None or pp.schedule not in ("1f1b", "kfkb", "gpipe") or ex.groups or rt.hook is not None:
            raise ExecutionError("--adaptive-k: expected a plan pipelined with 1f1b, kfkb or gpipe and no "
                                 f"tensor-parallel or sharded group, got {pp.schedule if pp else 'no pipeline'}")
        if rt.device.type != "cpu":
            raise ExecutionError("--adaptive-k measures on the host clock: CPU (gloo) ranks only")
        self.allowed, self.rt, self.comm = list(allowed), rt, comm
        self._plan, self._graph, self._machine_of, self._bucket_bytes = plan, graph, machine_of, bucket_bytes
        stage_of = stage_of_group(pp, len(plan.groups))
        self.stage_of_rank = {d: stage_of[g] for g, gp in enumerate(plan.groups) for d in gp.devices}
        self.k = {"1f1b": 1, "gpipe": pp.micro_batches}.get(pp.schedule, pp.k)
        self._schedules = {self.k: rt.schedule}
        comm.sent_s = []
        self.fwd_s = self.bwd_s = 0.0
        self.last: dict = {}
        """The last choice's inputs (seconds per micro-batch and crossing) and :func:`choose_k`'s
        predicted seconds per block size."""

    def step_done(self, st, index: int, t0: float) -> None:
        """After schedule step ``index`` (started at ``t0``, perf_counter seconds): a segment's
        seconds into :attr:`fwd_s` / :attr:`bwd_s`."""
        seg = self.rt.program.segments.get(index) if self.rt.covers(index) else None
        if seg is None or not seg.stages:
            return
        dt = time.perf_counter() - t0
        nf = sum(1 for _, ph, *_ in seg.stages if ph == "fwd")
        nb = len(seg.stages) - nf
        self.fwd_s += dt * nf / (nf + 2 * nb)
        self.bwd_s += dt * 2 * nb / (nf + 2 * nb)

    def measured(self) -> tuple[float, float, float]:
        """This rank's iteration: (forward s, backward s, seconds of its messages to other stages);
        the counters restart."""
        mine = self.stage_of_rank.get(self.rt.rank)
        x = sum(s for dst, s in self.comm.sent_s if self.stage_of_rank.get(dst, mine) != mine)
        out = (self.fwd_s, self.bwd_s, x)
        self.fwd_s = self.bwd_s = 0.0
        self.comm.sent_s.clear()
        return out

    def next_k(self, iterations: int = 1) -> int:
        """All-gather the measurements of the ``iterations`` just run (``tag run``: a step's
        accumulated batches), choose the next ``k`` (the same on every rank) and switch to it."""
        import torch.distributed as dist

        mine = torch.tensor(self.measured(), dtype=torch.float64) / iterations
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        m = torch.stack(every)
        pp = self._plan.pipeline
        S, M = len(pp.stages), pp.micro_batches
        x = float(m[:, 2].sum()) / (2 * (S - 1) * M) if S > 1 else 0.0
        c = choose_k(S, M, self.allowed, float(m[:, 0].max()) / M, float(m[:, 1].max()) / M, x)
        self.last = {"fwd_s": float(m[:, 0].max()) / M, "bwd_s": float(m[:, 1].max()) / M, "transfer_s": x,
                     "predicted_s": {str(j): t for j, t in c.predicted_s.items()}}
        k = c.k
        if k != self.k:
            self.k = k
            self.rt.use_schedule(self._schedule(k))
            self.comm.use_schedule(self.rt.schedule, self.rt.rank)
        return k

    def _schedule(self, k: int):
        """The schedule of the plan run as kFkB with block ``k`` (built once)."""
        if k not in self._schedules:
            from .strategies import execution_for

            plan = replace(self._plan, pipeline=replace(self._plan.pipeline, schedule="kfkb", k=k))
            self._schedules[k] = execution_for(plan, self._graph).schedule(self._graph, self._machine_of,
                                                                           self._bucket_bytes)
        return self._schedules[k]


def allowed_ks(graph, topology, plan, *, profile_dir: str | None = None, compiled: bool = False,
               bucket_bytes: int | None = None, check_memory: bool = True) -> list[int]:
    """The block sizes ``--adaptive-k`` chooses among: :data:`tag.sim.adaptive.CANDIDATES` up to
    the plan's micro-batches, those the simulator (costed as the launcher's prediction) finds out
    of memory left out (``check_memory``)."""
    from ..cost.model import CostModel
    from ..sim import Simulator
    from ..sim.adaptive import CANDIDATES, fitting_ks

    pp = plan.pipeline
    if pp is None or pp.schedule not in ("1f1b", "kfkb", "gpipe"):
        raise TagError(f"--adaptive-k: expected a plan pipelined with 1f1b, kfkb or gpipe, got "
                       f"{pp.schedule if pp else 'no pipeline'}")
    if not check_memory:
        return [k for k in CANDIDATES if k <= pp.micro_batches]
    costs = CostModel.for_topology(graph, topology, profile_dir=profile_dir, compiled=compiled)
    return fitting_ks(Simulator(graph, topology, costs, bucket_bytes), plan) or [1]
