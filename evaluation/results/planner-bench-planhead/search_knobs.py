"""Search knobs for GNN-MCTS @50 against uniform MCTS @2000 (issue 28), measured 2026-11-27 on the
first 30 pairs of the planner benchmark's ``--random`` stream (where the knobs were chosen) and on
its 25 small held-out pairs (confirmation only); results in ``search-knobs.md`` beside this file.

    PYTHONPATH=. HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python \
        evaluation/results/planner-bench-planhead/search_knobs.py tag/gnn/predictor.pt runs/predictor/graphs \
        base refine=10,center=1,score=ratio T=0.5 topk=3 eps=10 budget=200,prior=uniform

A configuration is ``key=value`` pairs joined by commas (``base``: the shipped search):

* ``refine=R``: the tree gets ``budget - R`` playouts (with the one-shot plan as today unless
  ``one_shot=0``), then ``R`` playouts go to plans one decision away from a tree node's plan: for
  each of the first ``groups`` (default 32) op-groups in decision order, the node's path with that
  group decided (or re-decided) as another action, completed by the search's rule
  (:meth:`tag.search.space.ActionSpace.resolve`), ranked by the network's prior at that state
  (``score=p``: the alternative's prior; ``ratio``: its prior over the prior of the group's action
  in the node's plan; ``diff``: the difference); plans simulated before are skipped; playouts it
  cannot spend go back to the tree. The node: the one whose plan is the search's best (none when
  that is a pipeline or a data-parallel baseline), or with ``center=1`` the best op-group plan in
  the tree. ``rounds=N`` re-ranks N times (the node is a tree node, so this repeats round one);
  ``climb=1``: each proposal that beats the best plan becomes the centre and the list is re-ranked
  around it (one more network call per improvement).
* ``T``: prior temperature, ``p^(1/T)`` renormalised; ``topk=K``: the prior's top K actions only;
  ``eps=E``: ``(1 - E/100) p + E/100`` uniform over the actions.
* ``budget=N``, ``prior=uniform|gnn``: the search's budget and prior (reference points).

Uniform @2000's times: ``runs/tune/ref.json`` (random pairs, written by ``floor_sweep.py``) and
``../planner-bench-relabel/final-97c315f/pb-old-auto/results.json`` (held-out pairs).
"""

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

import evaluation.planner_bench as pb
import tag.planner as planner
import tag.search.mcts as mcts
from tag.data.generate import load_graph
from tag.data.pairs import sample_pair
from tag.gnn.predictor import Predictor
from tag.search.space import is_pipeline_key
from tag.topology import load_topology

HERE = Path(__file__).resolve().parent
HELD = HERE.parent / "planner-bench-relabel/final-97c315f/pb-old-auto/results.json"
SHIPPED_SEARCH = mcts.mcts_search
CFG: dict = {}


def centre(tree, space, ev) -> int | None:
    """Tree node whose own plan is the best op-group plan the tree simulated (shallowest on ties)."""
    best, reward = None, -math.inf
    for n in range(tree.size):
        if tree.feedback[n] is None:
            continue
        key = space.resolve_path(tree.path(n))
        if is_pipeline_key(key):
            continue
        r = ev.cache[key].reward
        if r > reward + 1e-12 or (abs(r - reward) <= 1e-12 and tree.depth[n] < tree.depth[best]):
            best, reward = n, r
    return best


def neighbours(tree, space, ev, prior_fn, at=None) -> tuple[list[tuple], list]:
    """Plans one decision away from the centre node's (or ``at``: ``(assign, feedback)``), best-ranked
    first, and the partial assignment of each (see the module docstring)."""
    if at is None:
        if not CFG.get("center") and (ev.best_actions is None or is_pipeline_key(ev.best_actions)):
            return [], []
        n = centre(tree, space, ev)
        if n is None:
            return [], []
        at = (space.decode(tree.path(n))[0], tree.feedback[n])
    assign, feedback = at
    full = np.asarray(space.resolve(assign))
    groups = space.order[: CFG.get("groups", 32)]
    states = []
    for g in groups:
        a = assign.copy()
        a[g] = -1
        states.append(mcts.SearchState(a, g, feedback))
    pri, _ = prior_fn(space, states)
    cands = []
    for g, p, st in zip(groups, pri, states):
        mask = space.group_mask(st.assign)
        p = np.where(np.isfinite(p) & (p > 0), p, 0.0)
        if mask is not None:
            p = np.where(mask, p, 0.0)
        p = space.canonical_prior(g, p / max(p.sum(), 1e-300))
        cur = int(space.group_canonical[g, full[g]])
        for a in np.flatnonzero(p > 0):
            if a != cur:
                moved = assign.copy()
                moved[g] = a
                s = {"p": p[a], "diff": p[a] - p[cur], "ratio": p[a] / max(p[cur], 1e-12)}[CFG.get("score", "p")]
                cands.append((-s, int(space.rank[g]), space.resolve(moved), moved))
    out: list[tuple] = []
    moves: list = []
    for _, _, key, moved in sorted(cands, key=lambda c: c[:2]):
        if key not in out and key not in ev.cache:
            out.append(key)
            moves.append(moved)
    return out, moves


def search_with_refinement(space, evaluator, prior_fn, rng, *, playouts=200, time_limit=None, cfg=None,
                           propose_fn=None, reserve=1, plan_fn=None):
    """:func:`tag.search.mcts.mcts_search`, then ``refine`` playouts on neighbours (uniform prior: as shipped)."""
    refine = CFG.get("refine", 0) if prior_fn is not mcts.uniform_prior else 0
    propose_fn = propose_fn if CFG.get("one_shot", 1) else None
    res = SHIPPED_SEARCH(space, evaluator, prior_fn, rng, playouts=playouts - refine, time_limit=time_limit,
                         cfg=cfg, propose_fn=propose_fn, reserve=reserve, plan_fn=plan_fn)
    stats, tree, left = res.stats, res.tree, refine
    for _ in range(CFG.get("rounds", 1) if refine else 0):
        before, at = stats.playouts, None
        while stats.playouts - before < left:
            keys, moves = neighbours(tree, space, evaluator, prior_fn, at)
            at = None
            for key, moved in zip(keys, moves):
                if stats.playouts - before >= left:
                    break
                best = evaluator.best_reward
                out = mcts.propose(stats, evaluator, key)
                if CFG.get("climb") and out.reward > best:  # re-centre on the better plan
                    at = (moved, out.feedback)
                    break
            if at is None:
                break
        left -= stats.playouts - before
    if left > 0:
        mcts.run_playouts(tree, 0, space, evaluator, prior_fn, rng, playouts=left, cfg=cfg, stats=stats,
                          plan_fn=plan_fn)
    return mcts.SearchResult(evaluator.best_actions, evaluator.best_plan_groups(), evaluator.best.time_s,
                             evaluator.best.oom, evaluator.best_source, stats, tree, res.proposals)


def shaped_bind(shipped_bind):
    """``Predictor.bind`` with the prior reshaped by ``T``, ``topk`` and ``eps``."""
    def bind(self, space, t_ref):
        prior_fn = shipped_bind(self, space, t_ref)
        temp, k, eps = CFG.get("T", 1.0), CFG.get("topk", 0), CFG.get("eps", 0) / 100

        def shaped(sp, states):
            p, v = prior_fn(sp, states)
            if temp != 1.0:
                p = p ** (1.0 / temp)
            if k:
                kk = min(k, p.shape[1])
                p = np.where(p >= -np.sort(-p, axis=1)[:, kk - 1:kk], p, 0.0)
            p = p / p.sum(axis=1, keepdims=True)
            return (1 - eps) * p + eps / p.shape[1], v
        return shaped if (temp != 1.0 or k or eps) else prior_fn
    return bind


def parse(conf: str) -> dict:
    out: dict = {}
    for kv in conf.split(","):
        if kv != "base":
            k, v = kv.split("=")
            out[k] = v if k in ("score", "prior") else float(v) if k == "T" else int(v)
    return out


def main(checkpoint: str, graphs: str, *confs: str) -> None:
    torch.set_num_threads(1)
    planner.mcts_search = search_with_refinement
    Predictor.bind = shaped_bind(Predictor.bind)
    pred, gdir = Predictor.load(checkpoint), Path(graphs)
    held_ref = {(r["model"], r["topology"]): r["uniform2000"]["time_s"] for r in json.loads(HELD.read_text())["rows"]}
    refs = json.loads(Path("runs/tune/ref.json").read_text())
    sets: dict = {"random": [], "held-out": []}
    for i in range(30):
        s = sample_pair(pb.RANDOM_SEED, i, max_groups=32)
        sets["random"].append((f"r{i}", load_graph(gdir, s.model, s.batch, s.groups), load_topology(s.topology),
                               refs[str(i)]["u2000"]))
    for spec, batch, groups in pb.MODELS:
        for t in pb.TOPOLOGIES:
            topo = load_topology(t)
            sets["held-out"].append((f"{spec.split(':')[0]}/{topo.name}", load_graph(gdir, spec, batch, groups), topo,
                                     held_ref[(spec, topo.name)]))
    for conf in confs:
        CFG.clear()
        CFG.update(parse(conf))
        for name, pairs in sets.items():
            t0, ratios, misses, plan_s = time.perf_counter(), [], [], []
            for label, graph, topo, u in pairs:
                t1 = time.perf_counter()
                p = planner.find_plan(graph, topo, seed=0, budget=CFG.get("budget", 50), pipelines="auto",
                                      executable=False, layout_grid=False, compression="off",
                                      prior=CFG.get("prior", "gnn"), predictor=pred)
                plan_s.append(time.perf_counter() - t1)
                ratios.append(p.predicted_iteration_time_s / u)
                if ratios[-1] > 1 + 1e-9:
                    misses.append(f"{label}:{ratios[-1]:.3f}")
            r = np.array(ratios)
            print(f"{conf:40s} {name:8s} geomean {math.exp(np.log(r).mean()):.4f} ok {int((r <= 1 + 1e-9).sum())}/"
                  f"{len(r)} worst {r.max():.3f} maxplan {max(plan_s):.2f}s ({time.perf_counter() - t0:.0f} s) "
                  f"miss {' '.join(misses)}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
