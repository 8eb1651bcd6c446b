"""Ada-Grouper's adaptive kFkB (arXiv 2303.01675): the block size ``k`` of a pipeline's kFkB
schedule chosen between iterations from the stage-to-stage transfer times just measured (pure,
no torch).

**The choice rule** (:func:`choose_k`). Given the pipeline's ``S`` stages and ``M`` micro-batches,
the slowest stage's forward and backward seconds per micro-batch ``f``, ``b`` and the mean
seconds ``x`` one micro-batch's tensor took to cross a stage boundary in the last iteration,
every allowed ``k`` (those whose in-flight activations fit the devices' memory, ascending) is
timed by :func:`replay_time`: the kFkB schedule's global order (:func:`~tag.parallel.pipeline.
iteration_program`) replayed with every stage taking ``f`` / ``b`` and every cross-stage input
arriving ``x`` after it left, which is once its producer ended and the sending stage's outgoing
side and the receiving stage's incoming side are free (a stage's machine NIC, one message at a
time each way, as the simulator's network sides; each stage one lane, tasks in their order). The
smallest ``k`` whose time is within ``tolerance`` of the best is chosen: a larger block holds
``k`` times 1F1B's activations (:func:`~tag.parallel.pipeline.in_flight`) and is taken only where
it pays. With ``x = 0`` that is ``k = 1`` (1F1B's order has no more waits than any other); as ``x``
grows past a stage's compute, blocks of ``k`` micro-batches pay the boundary wait once per block
instead of once per micro-batch.

**A host that launches the kernels** (:class:`HostSeconds`; an eager GPU rank, whose stage the
simulator runs on two timelines, :class:`tag.cost.gpu.StageParts`): ``f`` / ``b`` are then the
device's seconds (each stage's own where given, as :func:`tag.sim.adaptive.replay` passes them),
and each stage also has a host that issues its tasks in the stage's order
without waiting for anything, ``h`` seconds each; a task ends at ``max(R + f, H + f + lag)`` (``R``:
its device free and its input arrived, ``H``: when its host started issuing it), the host moving
on to ``H + h``; the same per-stage model as the simulator's (``tag.sim.engine._Run._hosted``).
The replay then foresees where grouping cannot help. A host-bound stage (its launches per
micro-batch, ``h_f + h_b``, longer than its kernels and its boundary's messages) issues for
``M (h_f + h_b)`` seconds whatever the order, and under 1F1B each message crosses while the host
launches the next micro-batch, hidden; a block runs its ``k`` tasks back to back on a device the
host has run ahead of and queues their ``k`` messages on the link at once, so the block's last
message, and the next stage's work behind it, comes later than 1F1B's. On cloud-t4 (10 Gbit/s VMs, 55 us a launch) the 4 x 256
GPT-2 at ``dp=2,pp=4,micro=8`` (forward host 1.8-2.3 ms against 0.2-0.3 ms of kernels a stage,
0.73 ms a crossing) simulates at 29.55 ms for 1F1B and 34.65-35.72 ms for k = 2, 4, 8; the
replay without the host picks k = 8, with it k = 1 (``tests/test_adaptive.py``, 2026-11-29).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..plan.format import PipelinePlan
from .pipeline import Task, iteration_program


@dataclass(frozen=True)
class HostSeconds:
    """The host side of a stage whose host launches the device's kernels (seconds per
    micro-batch; the simulator's :class:`tag.cost.gpu.StageParts` summed over the stage's groups,
    :func:`tag.sim.adaptive.host_seconds`)."""

    fwd_s: float
    """Host seconds issuing one micro-batch's forward of the stage."""
    bwd_s: float
    """Host seconds issuing one micro-batch's backward of the stage."""
    fwd_lag_s: float = 0.0
    """Seconds the stage's forward lasts beyond its device seconds when host and device start it
    together (the host's issue of its last kernels trailing the device)."""
    bwd_lag_s: float = 0.0
    """The same for the backward."""

    def __post_init__(self):
        for name in ("fwd_s", "bwd_s", "fwd_lag_s", "bwd_lag_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"HostSeconds.{name}: expected finite seconds >= 0, got {v!r}")


def _per_stage(name: str, v, S: int) -> list:
    """``v`` (one value for every stage, or a sequence of ``S``) as a list of ``S``."""
    if not isinstance(v, (list, tuple)):
        return [v] * S
    if len(v) != S:
        raise ValueError(f"replay_time: {name}: expected one value per stage ({S}), got {len(v)}")
    return list(v)


def replay_time(num_stages: int, micro_batches: int, k: int, fwd_s, bwd_s, transfer_s: float,
                schedule: str = "kfkb", host=None) -> float:
    """Seconds of one iteration of kFkB (block ``k``) on ``num_stages`` stages of ``fwd_s`` /
    ``bwd_s`` per micro-batch (one value for all stages, or one per stage) whose inputs from
    another stage take ``transfer_s`` on the sender's outgoing and the receiver's incoming side,
    each stage's tasks issued by a host of ``host``'s seconds (a :class:`HostSeconds` for all
    stages, one per stage, or None: no host apart; the module docstring's replay)."""
    S, M = num_stages, micro_batches
    pp = PipelinePlan(list(range(S)), M, schedule, k)
    prog = iteration_program(pp, M, S)
    end: dict[Task, float] = {}
    free = [0.0] * S
    issued = [0.0] * S  # when each stage's host has issued its last task
    out, into = [0.0] * S, [0.0] * S  # when each stage's sending / receiving side is free
    hs = _per_stage("host", host or HostSeconds(0.0, 0.0), S)
    cost = {"fwd": [(f, h.fwd_s, h.fwd_lag_s) for f, h in zip(_per_stage("fwd_s", fwd_s, S), hs)],
            "bwd": [(b, h.bwd_s, h.bwd_lag_s) for b, h in zip(_per_stage("bwd_s", bwd_s, S), hs)]}

    def cross(src: int, made: float) -> float:  # the message from stage src into t.stage
        start = max(made, out[src], into[t.stage])
        out[src] = into[t.stage] = start + transfer_s
        return start + transfer_s

    for t in prog.tasks:
        ready = free[t.stage]
        if t.phase == "fwd":
            if t.stage:
                ready = max(ready, cross(t.stage - 1, end[Task(t.stage - 1, "fwd", t.micro)]))
        else:
            ready = max(ready, end[Task(t.stage, "fwd", t.micro)])
            if t.stage + 1 < S:
                ready = max(ready, cross(t.stage + 1, end[Task(t.stage + 1, "bwd", t.micro)]))
        dur, launch, lag = cost[t.phase][t.stage]
        end[t] = free[t.stage] = max(ready + dur, issued[t.stage] + dur + lag)
        issued[t.stage] += launch
    return max(end.values())


@dataclass(frozen=True)
class Choice:
    """What :func:`choose_k` chose and why."""

    k: int
    """The block size for the next iteration."""
    predicted_s: dict[int, float]
    """:func:`replay_time` of every allowed ``k``."""


def choose_k(num_stages: int, micro_batches: int, allowed: list[int], fwd_s, bwd_s,
             transfer_s: float, tolerance: float = 0.01, host=None) -> Choice:
    """The rule of the module docstring: of ``allowed`` (block sizes that fit, 1..M), the smallest
    whose :func:`replay_time` (stage seconds and ``host`` as there) is within ``tolerance`` (a
    fraction) of the fastest."""
    ks = sorted({k for k in allowed if 1 <= k <= micro_batches}) or [1]
    t = {k: replay_time(num_stages, micro_batches, k, fwd_s, bwd_s, transfer_s, host=host) for k in ks}
    best = min(t.values())
    return Choice(next(k for k in ks if t[k] <= best * (1 + tolerance)), t)
