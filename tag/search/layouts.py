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
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from ..parallel import execution_refusal
from ..parallel.layout import GridSearch, layout_plan, parse_layout, search_layouts
from .recompute import fit_by_recompute

REFINED_LAYOUTS = 2
"""The grid's fastest layouts that fit which :func:`refine` tries to improve."""


@dataclass
class Refined:
    """The best refinement :func:`refine` found (or None) and what it tried."""

    plan: object | None
    """A plan faster than every refined layout (``meta["refinement"]`` says how), or None."""
    simulations: int
    notes: list[str]
    """One line per refinement tried: what it gave."""


def grid_search(graph, topology, costs, simulator, *, executable: bool = False,
                incumbent: float | None = None, deadline: float = math.inf) -> GridSearch:
    """:func:`tag.parallel.layout.search_layouts` on ``simulator``, pruned by its bounds where it
    is a :class:`tag.sim.Simulator` (the full grid otherwise), stopped at ``deadline``
    (:func:`time.perf_counter` seconds)."""
    bounds = ()
    if hasattr(simulator, "static") and hasattr(simulator, "deploy"):
        from ..sim.bounds import layout_bounds

        bounds = layout_bounds(simulator)
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
        return not executable or execution_refusal(q, graph) is None

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


__all__ = ["REFINED_LAYOUTS", "Refined", "grid_search", "refine"]
