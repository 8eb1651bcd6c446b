"""Activation recomputation as a post-pass of the search: make a plan that runs out of memory fit.

The search's actions say where each op-group runs; whether a group recomputes its activations
(``GroupPlan.recompute``, docs/design.md "Activation recomputation") is not one of them (the
GNN's action features have no such field, and a second variant of every action would double the
space for a choice that only matters when memory binds). Instead the evaluator
(:class:`tag.search.evaluate.Evaluator`) hands every plan the simulator finds out of memory to
:func:`fit_by_recompute`, which turns recomputation on for the fewest groups it needs, by a
greedy order: the groups on a device out of memory, most activation bytes freed per second of
forward recomputed first (ties in group order), the shortest prefix of that order that fits found
by bisection (``1 + ceil(log2 n)`` simulations for ``n`` candidates). A plan that fits is never
changed, so plans on models whose memory does not bind are searched and scored as before.
"""

from __future__ import annotations

from dataclasses import replace

from ..sim.static import FWD


def recompute_order(simulator, groups, oom_devices) -> list[int]:
    """Groups of ``groups`` (a deployment of ``simulator``'s graph) worth recomputing to relieve
    ``oom_devices``: not yet recomputed, on one of those devices, freeing bytes; most bytes freed
    per forward second first (per replica at its largest batch; ties in group order)."""
    static = simulator.static
    over = set(oom_devices)
    deployments = simulator.deploy(groups)
    scored = []
    for g, (gp, deployment) in enumerate(zip(groups, deployments)):
        if gp.recompute or not over.intersection(gp.devices):
            continue
        batch = max(max(u.batches) for u in deployment.units)  # its largest replica's samples
        freed = (static.mem_fixed[g] - static.rc_fixed[g]) + (static.mem_per_sample[g] - static.rc_per_sample[g]) * batch
        if freed <= 0:
            continue
        if deployment.layout is not None:
            fwd_s = float(deployment.layout.dur[FWD, g].max())
        else:
            fwd_s = sum(u.dur[FWD] for u in deployment.units)
        scored.append((-freed / max(fwd_s, 1e-12), g))
    scored.sort()
    return [g for _, g in scored]


def with_recompute(groups, chosen) -> list:
    """``groups`` with recomputation on for the groups in ``chosen``."""
    on = set(chosen)
    return [replace(gp, recompute=True) if g in on else gp for g, gp in enumerate(groups)]


def fit_by_recompute(simulator, groups, pipeline, res, accept=None):
    """``(groups, result, simulations)`` of the plan ``groups`` / ``pipeline`` (simulated as ``res``, out of
    memory) with recomputation on for the shortest prefix of :func:`recompute_order` that fits, or
    with all of it if none does; None when there is no candidate (or ``simulator`` is not a
    :class:`tag.sim.Simulator`). ``accept(groups)``: False refuses a recomputed plan (e.g. one the
    executor does not run)."""
    if not hasattr(simulator, "static") or not hasattr(simulator, "deploy"):
        return None
    order = recompute_order(simulator, groups, [d for d, _ in res.oom_devices])
    if not order:
        return None

    def run(n: int):
        recomputed = with_recompute(groups, order[:n])
        return recomputed, (simulator.run(recomputed, pipeline=pipeline) if pipeline is not None
                            else simulator.run(recomputed))

    if accept is not None and not accept(with_recompute(groups, order)):
        return None
    full = run(len(order))
    calls = 1
    if full[1].oom:
        return (*full, calls)
    lo, hi, best = 1, len(order), full  # the prefix of hi groups fits
    while lo < hi:
        mid = (lo + hi) // 2
        got = run(mid)
        calls += 1
        if got[1].oom:
            lo = mid + 1
        else:
            hi, best = mid, got
    return (*best, calls)


__all__ = ["fit_by_recompute", "recompute_order", "with_recompute"]
