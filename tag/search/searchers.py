"""The searchers MCTS is compared with, on the same action space, evaluator and budget.

Each is ``searcher(space, evaluator, rng, *, playouts, deadline) -> SearchStats`` (``playouts``
None: no limit, the deadline ends the search) and leaves the best plan in the evaluator (every
one starts from the two data-parallel baselines). A *playout* is one proposed plan not simulated
before (one simulator call); proposing a plan seen before is a repeat, free up to
:data:`tag.search.mcts.REPEAT_LIMIT` x the budget of them, as in MCTS.

* :func:`random_search` - a uniformly random depth ``d`` and random choices for the first ``d``
  decisions (plan-level ones first where the space has them, then groups in decision order), the
  rest completed by the defaults (the distribution of MCTS leaves under a uniform prior, without
  the tree).
* :func:`simulated_annealing` - Metropolis on ``log(time)`` from the proportional
  data-parallel plan; a move re-decides one plan-level choice (probability 0.2, where the space
  has them), else one group or, with probability 0.3, a contiguous block of groups; geometric
  cooling. In an executable space a ``tp`` move deploys the whole plan so, and any other move
  from there puts the other groups data parallel over the same devices.
* :func:`tpe_search` - optuna's TPE sampler, one categorical over the actions per op-group, and
  before them the stage count; a pipeline's other plan-level choices replace the groups' ones.
"""

from __future__ import annotations

import math
import time

import numpy as np

from .evaluate import Evaluator
from .mcts import SearchStats, propose
from .space import PLAN_DECISIONS, ActionSpace


def _more(stats: SearchStats, playouts: int | None, deadline: float) -> bool:
    """Whether budget (``playouts`` None: no limit) and time are left (the first proposal is
    always made)."""
    if stats.playouts + stats.repeats == 0:
        return True
    return (playouts is None or stats.spent(playouts) < playouts) and time.perf_counter() < deadline


def random_search(space: ActionSpace, evaluator: Evaluator, rng: np.random.Generator, *, playouts: int | None,
                  deadline: float = math.inf) -> SearchStats:
    stats = SearchStats()
    while _more(stats, playouts, deadline):
        d = int(rng.integers(1, space.max_depth + 1))
        propose(stats, evaluator, space.resolve_path(space.random_path(rng, d)))
    return stats


def simulated_annealing(space: ActionSpace, evaluator: Evaluator, rng: np.random.Generator, *, playouts: int | None,
                        deadline: float = math.inf, t_start: float = 0.3, t_end: float = 0.003,
                        block_prob: float = 0.3, plan_prob: float = 0.2) -> SearchStats:
    stats = SearchStats()
    k, a = space.num_groups, space.num_actions

    def cost(out):
        return math.log(evaluator.t_ref) + 5.0 if out.reward <= -1 else math.log(out.time_s)

    # The state: per-group actions and the plan-level choices (a stage count > 1 makes it a
    # pipeline, whose plan ignores the group actions).
    cur = tuple([space.default_action] * k)
    plan: dict = {}
    c_cur = cost(propose(stats, evaluator, cur))
    # The temperature falls from t_start to t_end over the budget; with no playout limit (a time
    # limit alone) it stays at t_start.
    span = None if playouts is None else max(playouts, 2) - 1
    while _more(stats, playouts, deadline):
        frac = 0.0 if span is None else min(1.0, stats.spent(playouts) / span)
        temp = t_start * (t_end / t_start) ** frac
        new, new_plan = list(cur), dict(plan)
        if space.plan_options and rng.random() < plan_prob:  # re-decide one plan-level choice
            stages = new_plan.get("stages", 1)  # without a pipeline only its stage count means anything
            name = PLAN_DECISIONS[int(rng.integers(len(PLAN_DECISIONS)))] if stages > 1 else "stages"
            opts = space.options_at(name, new_plan)
            new_plan[name] = opts[int(rng.integers(len(opts)))]
            if name == "stage_sync" and new_plan.get("micro") not in space.options_at("micro", new_plan):
                new_plan.pop("micro", None)  # a tp stage's replica shares its samples: fewer micro-batches fit data parallel
            if name == "stages":  # the other choices' options depend on the stage count
                new_plan = {"stages": new_plan["stages"]}
        else:
            act = int(rng.integers(a))
            if rng.random() < block_prob and k > 1:
                i, j = sorted(rng.integers(0, k, size=2))
                for g in range(i, j + 1):
                    new[g] = act
            else:
                new[int(rng.integers(k))] = act
            if space.executable and space.is_tp[act]:  # tp runs as the whole plan's one deployment
                new = [act] * k
            elif space.executable:  # leaving it: the other groups data parallel over the same devices
                new = [int(space.tp_as_dp[x]) for x in new]
        new_t = tuple(new)
        key = space.pipeline_key(new_plan) if new_plan.get("stages", 1) > 1 else new_t
        out = propose(stats, evaluator, key)
        c_new = cost(out)
        if c_new <= c_cur or rng.random() < math.exp(-(c_new - c_cur) / temp):
            cur, plan, c_cur = new_t, new_plan, c_new
    return stats


def tpe_search(space: ActionSpace, evaluator: Evaluator, rng: np.random.Generator, *, playouts: int | None,
               deadline: float = math.inf) -> SearchStats:
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    stats = SearchStats()
    seed = int(rng.integers(2**31 - 1))
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    choices = list(range(space.num_actions))
    # Seed the study with the proportional data-parallel plan (what the others start from).
    study.enqueue_trial({f"g{g}": space.default_action for g in range(space.num_groups)}
                        | ({"stages": 1} if space.plan_options else {}))
    while _more(stats, playouts, deadline):
        trial = study.ask()
        # define-by-run: a pipeline's choices only under a stage count > 1, group actions otherwise
        stages = trial.suggest_categorical("stages", space.options("stages", 1)) if space.plan_options else 1
        if stages > 1:
            chosen = {"stages": stages}
            for name in PLAN_DECISIONS[1:]:
                opts = space.options_at(name, chosen)
                # (the micro-batch counts depend on the stages' deployment: one parameter per deployment)
                at = f"{name}@{stages}" + (f"/{chosen['stage_sync']}" if name == "micro" else "")
                chosen[name] = opts[trial.suggest_categorical(at, list(range(len(opts))))]
            acts = space.pipeline_key(chosen)
        else:
            acts = tuple(trial.suggest_categorical(f"g{g}", choices) for g in range(space.num_groups))
        out = propose(stats, evaluator, acts)
        study.tell(trial, out.reward)
    return stats


SEARCHERS = ("mcts", "sa", "random", "tpe")
