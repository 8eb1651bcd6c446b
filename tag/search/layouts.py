"""The Megatron-style layout grid as the planner runs it: branch and bound over the grid
(:func:`tag.parallel.layout.search_layouts`, pruned by the lower bounds of :mod:`tag.sim.bounds`:
the same best layout as simulating all of them), then what a heterogeneity-aware planner adds to
the grid's best layouts, kept only where the simulator says the plan fits and is faster:

* **speed-proportional shares** (``prop=1``, :class:`tag.parallel.layout.Layout`): a stage whose
  replicas run on devices of different speeds gives each a batch share proportional to its speed
  (as ``dp-prop`` does for data parallel over all devices); the stage cuts stay the grid's;
* **selective recomputation**: a layout with full recomputation (``recompute=1``) taken without
  it and made to fit by the search's post-pass (:func:`tag.search.recompute.fit_by_recompute`:
  the shortest prefix of the groups on devices out of memory, most bytes freed per second of
  forward first), so that stages with memory to spare (a 1F1B pipeline's last stages hold fewer
  micro-batches in flight) skip the recompute.

Each refinement of a layout costs one simulation (proportional shares) or ``2 + ceil(log2 n)``
(selective recomputation over ``n`` candidate groups); :data:`REFINED_LAYOUTS` layouts are
refined.

**Sub-clusters** (:func:`subcluster_search`): a layout occupies every device, so on a mixed
cluster a device kind far slower than the rest slows every stage it holds. The grid runs again on
the machines left after dropping the slowest device kind, then the two slowest, ... (kinds ranked
by :meth:`tag.cost.CostModel.device_speeds`), each pruned against the best plan so far, with the
whole cluster's costs restricted to those machines (:meth:`tag.cost.CostModel.restricted`); the
plan keeps the dropped devices idle. On gpt2-xl (bf16, batch 64) over ``tag-testbed`` the GTX
1080 Ti, with no bf16 tensor rate, made every layout over all 16 GPUs 420.5 s or more; over the
V100 and P100 machines alone ``dp=2,pp=4,micro=32`` takes 17.15 s, over the four V100s
``dp=1,pp=4,micro=32,cut=memory`` 6.20 s (2026-11-27).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from ..parallel import execution_refusal
from ..parallel.layout import GridSearch, layout_grid, layout_plan, parse_layout, search_layouts
from .recompute import fit_by_recompute

REFINED_LAYOUTS = 2
"""The grid's fastest layouts that fit which :func:`refine` tries to improve."""
REBALANCE_MOVES = 8
"""Stage-boundary moves :func:`rebalance` tries at most (one simulation each)."""


@dataclass
class Refined:
    """The best refinement :func:`refine` found (or None) and what it tried."""

    plan: object | None
    """A plan faster than every refined layout (``meta["refinement"]`` says how), or None."""
    simulations: int
    notes: list[str]
    """One line per refinement tried: what it gave."""


def grid_search(graph, topology, costs, simulator, *, executable: bool = False,
                incumbent: float | None = None, deadline: float = math.inf,
                failures: list[str] | None = None) -> GridSearch:
    """:func:`tag.parallel.layout.search_layouts` on ``simulator``, pruned by its bounds where it
    is a :class:`tag.sim.Simulator` (the full grid otherwise), stopped at ``deadline``
    (:func:`time.perf_counter` seconds). ``failures``: where a bound that meets a case it cannot
    handle says why (one line; the grid is then simulated whole, :func:`tag.sim.bounds.fallible`)."""
    bounds = ()
    if hasattr(simulator, "static") and hasattr(simulator, "deploy"):
        from ..sim.bounds import layout_bounds

        bounds = layout_bounds(simulator, failures)
    if not layout_grid(graph, topology):  # fewer samples than any layout's replicas (batch 3 on 16
        return GridSearch(None, [], 0, 0, 0)  # devices): nothing to search; the searched plan stands
    return search_layouts(graph, topology, costs, lambda q: simulator.run(q.groups, pipeline=q.pipeline),
                          executable=executable, bounds=bounds, incumbent=incumbent, deadline=deadline)


def refine(graph, topology, costs, simulator, found: GridSearch, *, executable: bool = False,
           top: int = REFINED_LAYOUTS, deadline: float = math.inf) -> Refined:
    """Try the refinements of the module docstring on the ``top`` fastest layouts of ``found``
    that fit; ``executable``: only plans the executor runs; none is started after ``deadline``
    (:func:`time.perf_counter` seconds)."""
    best, best_t, sims, notes = None, None, 0, []

    def run(q):
        nonlocal sims
        sims += 1
        return simulator.run(q.groups, pipeline=q.pipeline)

    def runs(q) -> bool:
        return not executable or execution_refusal(q) is None

    def offer(q, t: float, note: str) -> None:
        nonlocal best, best_t
        notes.append(note)
        if best_t is None or t < best_t:
            best, best_t = q, t

    simulated = {p.meta["layout"]: r for p, r in found.ranked}  # what the grid already ran
    for plan, res in [(p, r) for p, r in found.ranked if not r.oom][:top]:
        if time.perf_counter() >= deadline:
            notes.append("stopped at the time limit")
            break
        lay = parse_layout(plan.meta["layout"])
        base_t = res.iteration_time_s
        # speed-proportional shares (a stage of one device kind keeps its even shares: skipped)
        prop = layout_plan(graph, topology, replace(lay, prop=1), costs, template=plan)
        if [g.key() for g in prop.groups] != [g.key() for g in plan.groups] and runs(prop):
            r = run(prop)
            if not r.oom and r.iteration_time_s < base_t:
                prop.predicted_iteration_time_s = r.iteration_time_s
                prop.meta.update(searcher="dp-tp-pp-grid", refinement="speed-proportional shares")
                offer(prop, r.iteration_time_s, f"{prop.meta['layout']}: {r.iteration_time_s:.6g} s "
                                                f"(even shares {base_t:.6g} s)")
                lay, plan, base_t = replace(lay, prop=1), prop, r.iteration_time_s
            else:
                notes.append(f"{prop.meta['layout']}: {'out of memory' if r.oom else f'{r.iteration_time_s:.6g} s'}, "
                             f"not kept ({base_t:.6g} s)")
        # selective recomputation: the layout without it, made to fit by the fewest groups recomputed
        if lay.recompute and time.perf_counter() < deadline:
            bare = layout_plan(graph, topology, replace(lay, recompute=0), costs, template=plan)
            r = simulated.get(bare.meta["layout"])
            if r is None:
                r = run(bare)
            if not r.oom:  # (a grid layout: already weighed by the grid)
                continue
            got = fit_by_recompute(simulator, bare.groups, bare.pipeline, r,
                                   accept=lambda gs, q=bare: runs(replace(q, groups=gs)))
            if got is None:
                continue
            groups, r, calls = got
            sims += calls
            n = sum(g.recompute for g in groups)
            if r.oom or r.iteration_time_s >= base_t:
                notes.append(f"{bare.meta['layout']} recomputing {n} of {len(groups)} groups: "
                             f"{'out of memory' if r.oom else f'{r.iteration_time_s:.6g} s'}, not kept ({base_t:.6g} s)")
                continue
            bare.groups, bare.predicted_iteration_time_s = groups, r.iteration_time_s
            what = f"recomputation on {n} of {len(groups)} groups"
            bare.meta.update(searcher="dp-tp-pp-grid", refinement=what if not lay.prop else
                             f"speed-proportional shares, {what}")
            offer(bare, r.iteration_time_s, f"{bare.meta['layout']} with {what}: {r.iteration_time_s:.6g} s "
                                            f"(all groups {base_t:.6g} s)")
    return Refined(best, sims, notes)


def rebalance(simulator, plan, res, *, executable: bool = False, moves: int = REBALANCE_MOVES,
              deadline: float = math.inf) -> tuple[object | None, int, str]:
    """``(plan, simulations, note)``: pipeline ``plan`` (simulated as ``res``, out of memory on
    its devices) made to fit by moving its stage boundaries, or None for the plan. A layout cuts
    stages by time or by the state they hold (:func:`tag.parallel.layout.balanced_cuts`); neither
    counts the micro-batches a 1F1B stage holds in flight (stage ``s`` of ``P``: ``P - s``), so the
    first stages peak highest. Up to ``moves`` times, the stage whose device is fullest (peak
    over capacity) gives its first op-group to the stage before it or its last to the stage
    after it, the emptier neighbour first (the group takes that stage's devices and shares),
    kept when the simulated fullest device gets emptier; it stops once the plan fits, or when
    neither move helps, or at ``deadline`` (:func:`time.perf_counter` seconds). Plans with
    tensor-parallel groups (whose cuts sit between Megatron blocks) are left alone; with
    ``executable`` only plans the executor runs are simulated. One simulation a move tried.
    (Llama-2 13B bf16 on 4 x A10 24 GB, ``dp=1,pp=4,micro=8,recompute=1,zero=2,offload=optimizer``:
    stages of 12 op-groups peak at 24.6 GiB on stage 0's device; ``evaluation/results/offload``.)"""
    if plan.pipeline is None or not res.oom or any(g.sync == "tp" for g in plan.groups):
        return None, 0, ""
    cap = res.memory_capacity_bytes
    groups, stages, sims, moved = list(plan.groups), list(plan.pipeline.stages), 0, []

    def fullness(r) -> list[float]:
        return [max(r.peak_memory_bytes[d] / max(cap[d], 1.0) for d in groups[first].devices) for first in stages]

    best, full = res, fullness(res)
    for _ in range(moves):
        if max(full) <= 1.0 or time.perf_counter() >= deadline:
            break
        s = int(np.argmax(full))
        ends = stages + [len(groups)]
        tries = [t for t in (s - 1, s + 1) if 0 <= t < len(stages) and ends[s + 1] - ends[s] > 1]
        for t in sorted(tries, key=lambda t: full[t]):
            g = ends[s] if t < s else ends[s + 1] - 1  # the group next to stage t
            donor = groups[stages[t]]
            cand = groups[:g] + [replace(groups[g], devices=list(donor.devices), shares=list(donor.shares))] + \
                groups[g + 1:]
            cut = stages[:s] + [stages[s] + 1] + stages[s + 1:] if t < s else stages[:t] + [stages[t] - 1] + stages[t + 1:]
            q = replace(plan, groups=cand, pipeline=replace(plan.pipeline, stages=cut))
            if executable and execution_refusal(q) is not None:
                continue
            r = simulator.run(cand, pipeline=q.pipeline)
            sims += 1
            if r.overflow < best.overflow:
                groups, stages, best = cand, cut, r
                full = fullness(r)
                moved.append(f"group {g} to stage {t}")
                break
        else:
            break
    if best.oom or not moved:
        return None, sims, f"{plan.meta['layout']}: stages moved ({', '.join(moved) or 'none helped'}): " \
                           f"still out of memory ({best.overflow:.3f} x a device)"
    out = replace(plan, groups=groups, pipeline=replace(plan.pipeline, stages=stages),
                  meta={**plan.meta, "refinement": f"stages moved to fit ({', '.join(moved)})"})
    out.predicted_iteration_time_s = best.iteration_time_s
    return out, sims, f"{plan.meta['layout']}: fits with {', '.join(moved)}: {best.iteration_time_s:.6g} s"


def subclusters(topology, costs) -> list[list[int]]:
    """Machine indices of each sub-cluster :func:`subcluster_search` tries: the machines left after
    dropping the slowest device kind, then the two slowest, ... (a kind: a GPU type, ranked by its
    devices' speed on the whole iteration, :meth:`tag.cost.CostModel.device_speeds`); none on a
    cluster of one kind."""
    speed = costs.device_speeds()
    kind_speed: dict[str, float] = {}
    for d, dev in enumerate(topology.devices):
        kind_speed[dev.gpu.name] = max(kind_speed.get(dev.gpu.name, 0.0), speed[d])
    slow_first = sorted(kind_speed, key=lambda k: kind_speed[k])
    return [[m for m, mach in enumerate(topology.machines) if mach.gpu.name not in slow_first[:n]]
            for n in range(1, len(slow_first))]


def subcluster_search(graph, topology, costs, simulator, *, executable: bool = False,
                      incumbent: float | None = None, deadline: float = math.inf,
                      failures: list[str] | None = None) -> tuple[object | None, list[str]]:
    """``(plan, notes)``: the fastest layout (grid, then :func:`refine`) on any of
    :func:`subclusters`, its devices mapped back onto ``topology`` and simulated on ``simulator``,
    when it fits and beats ``incumbent`` (seconds; None: any that fits); else None. ``notes``: one
    line per sub-cluster tried; ``failures``: :func:`grid_search`'s."""
    from ..sim import Simulator

    best, best_t, notes = None, incumbent, []
    for machines in subclusters(topology, costs):
        if time.perf_counter() >= deadline:
            notes.append("stopped at the time limit")
            break
        sub, devices = topology.restricted(machines)
        sub_costs = costs.restricted(sub, devices)
        sub_sim = Simulator(graph, sub, sub_costs)  # (one for the grid and the refinements: its caches shared)
        found = grid_search(graph, sub, sub_costs, sub_sim, executable=executable, incumbent=best_t, deadline=deadline,
                            failures=failures)
        better = refine(graph, sub, sub_costs, sub_sim, found, executable=executable, deadline=deadline)
        cands = [q for q in (better.plan, found.best) if q is not None and q.predicted_iteration_time_s is not None]
        idle = ", ".join(sorted({d.gpu.name for d in topology.devices} - {topology.machines[m].gpu.name for m in machines}))
        names = f"without {idle}"
        if not cands:
            notes.append(f"{names}: no layout fits and beats {'nothing' if best_t is None else f'{best_t:.6g} s'} "
                         f"({found.simulated} of {found.layouts} simulated)")
            continue
        q = min(cands, key=lambda c: c.predicted_iteration_time_s)
        plan = q.on_topology(topology, devices)
        res = simulator.run(plan.groups, pipeline=plan.pipeline)  # on the whole cluster: the same time
        notes.append(f"{names}: {q.meta['layout']} {'out of memory' if res.oom else f'{res.iteration_time_s:.6g} s'}")
        if res.oom or (best_t is not None and res.iteration_time_s >= best_t):
            continue
        plan.predicted_iteration_time_s = res.iteration_time_s
        plan.meta = {**q.meta, "machines": [topology.machines[m].name for m in machines], "idle_kinds": idle}
        best, best_t = plan, res.iteration_time_s
    return best, notes


__all__ = ["REBALANCE_MOVES", "REFINED_LAYOUTS", "Refined", "grid_search", "rebalance", "refine", "subcluster_search",
           "subclusters"]
