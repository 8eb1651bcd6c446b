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
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan.format import PipelinePlan
from .pipeline import Task, iteration_program


def replay_time(num_stages: int, micro_batches: int, k: int, fwd_s: float, bwd_s: float, transfer_s: float,
                schedule: str = "kfkb") -> float:
    """Seconds of one iteration of kFkB (block ``k``) on ``num_stages`` stages of ``fwd_s`` /
    ``bwd_s`` per micro-batch whose inputs from another stage take ``transfer_s`` on the sender's
    outgoing and the receiver's incoming side (the module docstring's replay)."""
    S, M = num_stages, micro_batches
    pp = PipelinePlan(list(range(S)), M, schedule, k)
    prog = iteration_program(pp, M, S)
    end: dict[Task, float] = {}
    free = [0.0] * S
    out, into = [0.0] * S, [0.0] * S  # when each stage's sending / receiving side is free

    def cross(src: int, made: float) -> float:  # the message from stage src into t.stage
        start = max(made, out[src], into[t.stage])
        out[src] = into[t.stage] = start + transfer_s
        return start + transfer_s

    for t in prog.tasks:
        ready = free[t.stage]
        if t.phase == "fwd":
            if t.stage:
                ready = max(ready, cross(t.stage - 1, end[Task(t.stage - 1, "fwd", t.micro)]))
            dur = fwd_s
        else:
            ready = max(ready, end[Task(t.stage, "fwd", t.micro)])
            if t.stage + 1 < S:
                ready = max(ready, cross(t.stage + 1, end[Task(t.stage + 1, "bwd", t.micro)]))
            dur = bwd_s
        end[t] = free[t.stage] = ready + dur
    return max(end.values())


@dataclass(frozen=True)
class Choice:
    """What :func:`choose_k` chose and why."""

    k: int
    """The block size for the next iteration."""
    predicted_s: dict[int, float]
    """:func:`replay_time` of every allowed ``k``."""


def choose_k(num_stages: int, micro_batches: int, allowed: list[int], fwd_s: float, bwd_s: float,
             transfer_s: float, tolerance: float = 0.01) -> Choice:
    """The rule of the module docstring: of ``allowed`` (block sizes that fit, 1..M), the smallest
    whose replayed time is within ``tolerance`` (a fraction) of the fastest."""
    ks = sorted({k for k in allowed if 1 <= k <= micro_batches}) or [1]
    t = {k: replay_time(num_stages, micro_batches, k, fwd_s, bwd_s, transfer_s) for k in ks}
    best = min(t.values())
    return Choice(next(k for k in ks if t[k] <= best * (1 + tolerance)), t)
