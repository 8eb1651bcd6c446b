"""Monte-Carlo tree search with PUCT over per-group decisions (mctx style).

The tree is an explicit set of arrays (:class:`Tree`); search is a handful of small functions
over it (:func:`select`, :func:`expand`, :func:`backup`, :func:`visit_distribution`); the prior /
value model, the plan evaluator and the random generator are passed in.

One *playout*: descend from the root by PUCT

    a* = argmax_a  Q̂(s, a) + c_puct · P(s, a) · sqrt(N(s)) / (1 + N(s, a))

(``Q̂`` min-max normalised over the tree, unvisited children valued at their parent's mean),
add one node, evaluate it, and back its value up the path. A node's state is a partial plan:
the actions on its path, one per op-group in the space's decision order. The leaf's value is
the simulator's reward of the partial plan completed with the defaults (TAG; the completion is a
plan reachable from the node, so it is an achievable reward), or - with a value head and
``value_cut`` - the network's prediction when it says the leaf cannot beat the best plan so far
by a margin, which saves the simulator call. The margin is calibrated on the search itself: every
simulated leaf also measures the value head's error on the (model, topology) at hand, and a leaf
is only cut when its bias-corrected prediction is worse than the best plan by ``value_margin``
plus ``value_z`` standard deviations of that error (a value head that is unreliable here cuts
next to nothing, since under a playout budget a cut playout is a playout spent without learning
the leaf's true reward). Playouts are collected in waves of ``batch``
leaves (virtual loss keeps them apart), and each wave is one batched network call.

The budget counts playouts that propose a plan: the root's own plan is the first, and a leaf
whose completed plan was simulated before (a *repeat*: e.g. a group decided as the action its
default already gave it) takes that plan's reward from the evaluator's cache, costs no simulator
call and is not counted (``SearchStats.repeats``; at most ``MCTSConfig.repeat_limit`` x the
budget of them, so an exhausted space ends). Otherwise two search variants given "50 playouts"
would be given different numbers of simulated plans (15 of GNN-MCTS's first 50 playouts on one
planner-benchmark pair were repeats; `make demo`'s 200-playout search walks 80 more).

Every simulated plan is a complete plan; the search returns the best one seen, which is never
worse than the better data-parallel baseline (the evaluator scores both first). Plans proposed
from outside the tree (the network's one-shot plan) are simulated after it, out of the same
budget (``propose_fn`` of :func:`mcts_search`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .evaluate import Evaluator, Feedback, Outcome
from .space import PLAN_DECISIONS, ActionSpace

NO_PIPELINE_PRIOR = 0.75
"""Prior of "no pipeline" at the stage-count decision (the rest spread evenly over the stage
counts): the per-group decisions below it are most of the space. With 0.5, uniform MCTS @50 on
gpt2-medium bf16 over ``mixed-a100-v100`` first reached the plan it returned (tensor parallel on
the A100 machine) at playout 31, with 0.75 at playout 7."""
PLAN_PRIOR_FLOOR = 0.5
"""Share of the fixed prior (:func:`plan_prior`) kept under a learned one at a plan-level decision
(``plan_fn`` of :func:`mcts_search`): every option keeps some mass, whatever the network says."""
REPEAT_LIMIT = 4.0
"""Default ``repeat_limit`` of every searcher (see :meth:`SearchStats.spent`)."""


@dataclass
class SearchState:
    """What the prior / value model sees: a partial plan and the simulator's latest word on it."""

    assign: np.ndarray
    """[K] action index per op-group, -1 where undecided."""
    group: int
    """The op-group decided next (-1 when every group is decided)."""
    feedback: Feedback
    """Simulator feedback of the nearest simulated ancestor (or the state itself)."""
    resolved: tuple | None = None
    """Full action tuple after defaults (filled on demand)."""
    plan_decision: int = -1
    """Index into :data:`tag.search.space.PLAN_DECISIONS` of the plan-level decision made next
    (-1: none; ``group`` is then the op-group decided next)."""
    pipeline: dict | None = None
    """Plan-level choices made so far when the path chose a pipeline (None: no pipeline)."""


PriorFn = Callable[[ActionSpace, Sequence[SearchState]], tuple[np.ndarray, np.ndarray]]
"""``prior_fn(space, states) -> (priors [n, A], values [n])``; values are predicted rewards."""
PlanPriorFn = Callable[[ActionSpace, SearchState], np.ndarray]
"""``plan_fn(space, state) -> [A]`` prior over the options of ``state``'s plan-level decision
(option ``i`` at action ``i``), e.g. the network's plan head (:meth:`tag.gnn.Predictor.bind_plan`)."""


def uniform_prior(space: ActionSpace, states: Sequence[SearchState]) -> tuple[np.ndarray, np.ndarray]:
    """Uniform prior over the distinct deployments of each state's group (one action per class
    of :attr:`ActionSpace.group_canonical`), or over a plan-level decision's options, no value
    (MCTS without a network)."""
    a = np.arange(space.num_actions)
    p = np.stack([plan_prior(space, st) if st.plan_decision >= 0 else
                  (space.group_canonical[st.group] == a) if st.group >= 0 else np.ones(space.num_actions, bool)
                  for st in states]).astype(np.float64)
    return p / p.sum(axis=1, keepdims=True), np.full(len(states), np.nan)


def plan_prior(space: ActionSpace, state: SearchState) -> np.ndarray:
    """[A] uniform over the options of the state's plan-level decision (action ``i`` is option
    ``i``; a larger index means option ``i mod n``, as an equivalent action does)."""
    n = len(space.options_at(PLAN_DECISIONS[state.plan_decision], state.pipeline))
    p = (np.arange(space.num_actions) < n).astype(np.float64)
    if state.plan_decision == 0 and n > 1:  # no pipeline: TAG's whole space below it
        p[1:n] = (1.0 - NO_PIPELINE_PRIOR) / (n - 1)
        p[0] = NO_PIPELINE_PRIOR
    return p


@dataclass
class Tree:
    """Explicit search tree; node 0 is the root of the whole episode."""

    num_actions: int
    capacity: int = 256
    parent: np.ndarray = field(init=False)
    action: np.ndarray = field(init=False)
    depth: np.ndarray = field(init=False)
    visits: np.ndarray = field(init=False)
    value_sum: np.ndarray = field(init=False)
    best: np.ndarray = field(init=False)
    """Best simulated reward in the node's subtree (-inf if none)."""
    prior: np.ndarray = field(init=False)
    children: np.ndarray = field(init=False)
    expanded: np.ndarray = field(init=False)
    """Whether the node's prior is set (False while its evaluation is pending)."""
    terminal: np.ndarray = field(init=False)
    """Whether the node's plan is complete (nothing left to decide)."""
    feedback: list = field(init=False)
    size: int = 0

    def __post_init__(self):
        c, a = self.capacity, self.num_actions
        self.parent = np.full(c, -1, np.int64)
        self.action = np.full(c, -1, np.int64)
        self.depth = np.zeros(c, np.int64)
        self.visits = np.zeros(c)
        self.value_sum = np.zeros(c)
        self.best = np.full(c, -np.inf)
        self.prior = np.zeros((c, a), np.float32)
        self.children = np.full((c, a), -1, np.int64)
        self.expanded = np.zeros(c, bool)
        self.terminal = np.zeros(c, bool)
        self.feedback = [None] * c

    def _grow(self):
        c = self.capacity
        for name in ("parent", "action", "depth", "visits", "value_sum", "best", "prior", "children", "expanded",
                     "terminal"):
            arr = getattr(self, name)
            fill = {"parent": -1, "action": -1, "best": -np.inf, "children": -1}.get(name, 0)
            new = np.full((2 * c,) + arr.shape[1:], fill, arr.dtype)
            new[:c] = arr
            setattr(self, name, new)
        self.feedback.extend([None] * c)
        self.capacity = 2 * c

    def add(self, parent: int, action: int) -> int:
        if self.size >= self.capacity:
            self._grow()
        n = self.size
        self.size += 1
        self.parent[n] = parent
        self.action[n] = action
        self.depth[n] = 0 if parent < 0 else self.depth[parent] + 1
        if parent >= 0:
            self.children[parent, action] = n
        return n

    def path(self, node: int) -> list[int]:
        """Actions from the root of the tree to ``node``."""
        out, n = [], node
        while self.parent[n] >= 0:
            out.append(int(self.action[n]))
            n = self.parent[n]
        return out[::-1]

    def assign(self, node: int, space: ActionSpace) -> np.ndarray:
        """The op-groups' actions decided on the way to ``node`` (-1: undecided)."""
        return space.decode(self.path(node))[0]

    def state(self, node: int, space: ActionSpace, feedback: Feedback) -> SearchState:
        """What the prior sees at ``node``: its partial plan and what it decides next."""
        path = self.path(node)
        assign, chosen = space.decode(path)
        nxt = space.decision_at(path)
        grp = nxt[1] if nxt is not None and nxt[0] == "group" else -1
        plan = nxt[1] if nxt is not None and nxt[0] == "plan" else -1
        return SearchState(assign, grp, feedback, space.resolve_path(path), plan, chosen)

    def nearest_feedback(self, node: int) -> Feedback | None:
        n = node
        while n >= 0:
            if self.feedback[n] is not None:
                return self.feedback[n]
            n = self.parent[n]
        return None

    def leaf_state(self, node: int, space: ActionSpace) -> SearchState:
        """:meth:`state` of ``node`` with the feedback nearest above it (neutral where none), and
        :attr:`terminal` of ``node`` set from it: how a playout's leaf is read."""
        feedback = self.nearest_feedback(node) or Feedback.neutral(space.num_devices, space.num_groups)
        st = self.state(node, space, feedback)
        self.terminal[node] = st.group < 0 and st.plan_decision < 0
        return st


def new_tree(space: ActionSpace) -> Tree:
    t = Tree(space.num_actions)
    t.add(-1, -1)
    return t


def puct_scores(tree: Tree, node: int, c_puct: float, qmin: float, qmax: float) -> np.ndarray:
    """PUCT score of every action at ``node``."""
    kids = tree.children[node]
    has = kids >= 0
    n_parent = tree.visits[node]
    parent_q = tree.value_sum[node] / n_parent if n_parent > 0 else 0.0
    q = np.full(tree.num_actions, parent_q)
    nk = np.zeros(tree.num_actions)
    idx = kids[has]
    nk[has] = tree.visits[idx]
    vis = has & (nk > 0)
    q[vis] = tree.value_sum[kids[vis]] / nk[vis]
    span = qmax - qmin
    qn = (q - qmin) / span if span > 1e-12 else np.zeros_like(q)
    u = c_puct * tree.prior[node] * math.sqrt(max(n_parent, 1.0)) / (1.0 + nk)
    return qn + u


def select(tree: Tree, root: int, c_puct: float, qrange: tuple[float, float],
           noise: np.ndarray) -> tuple[int, int]:
    """Descend from ``root``; returns ``(node, action)`` to expand, or ``(node, -1)`` when the
    walk ends at a terminal or pending node. ``noise`` [A] breaks ties deterministically."""
    n = root
    while True:
        if tree.terminal[n] or not tree.expanded[n]:
            return n, -1
        s = puct_scores(tree, n, c_puct, *qrange) + noise
        a = int(np.argmax(s))
        child = tree.children[n, a]
        if child < 0:
            return n, a
        n = int(child)


def expand(tree: Tree, node: int, action: int) -> int:
    return tree.add(node, action)


def backup(tree: Tree, node: int, value: float, root: int, sim_reward: float | None = None,
           virtual: float = 0.0) -> None:
    """Add ``value`` (and undo ``virtual`` losses) along the path from ``node`` up to ``root``."""
    n = node
    while n >= 0:
        tree.visits[n] += 1 - virtual
        tree.value_sum[n] += value + virtual * 1.0
        if sim_reward is not None and sim_reward > tree.best[n]:
            tree.best[n] = sim_reward
        if n == root:
            break
        n = int(tree.parent[n])


def add_virtual_loss(tree: Tree, node: int, root: int, loss: float = 1.0) -> None:
    n = node
    while n >= 0:
        tree.visits[n] += 1
        tree.value_sum[n] -= loss
        if n == root:
            break
        n = int(tree.parent[n])


def visit_distribution(tree: Tree, node: int) -> np.ndarray:
    """[A] visit counts of ``node``'s children, normalised (uniform if none)."""
    kids = tree.children[node]
    v = np.zeros(tree.num_actions)
    has = kids >= 0
    v[has] = tree.visits[kids[has]]
    s = v.sum()
    return v / s if s > 0 else np.full(tree.num_actions, 1.0 / tree.num_actions)


@dataclass
class MCTSConfig:
    """Knobs of one search."""

    c_puct: float = 1.25
    """Exploration constant of PUCT."""
    batch: int = 8
    """Leaves per wave (one batched prior/value call per wave)."""
    value_cut: bool = True
    """With a value model: skip the simulator at leaves the value head rates below the best
    reward so far by more than ``value_margin``."""
    value_margin: float = 0.25
    """Margin for ``value_cut``, in log iteration time: a leaf is simulated when its predicted
    time, corrected by the value head's measured bias, is within a factor
    ``exp(value_margin + value_z * sd)`` of the best plan's (``sd``: the standard deviation of the
    value head's error measured in this search, see :meth:`SearchStats.value_error`)."""
    value_z: float = 2.0
    """How many standard deviations of the value head's measured error widen ``value_margin``:
    an accurate value head cuts at ``value_margin``, one that is off on the (model, topology) at
    hand (RMS error ~0.4-1.0 in log time on the planner benchmark's held-out pairs) cuts (almost)
    nothing."""
    min_sims: int = 8
    """Always simulate the first ``min_sims`` leaves the value head predicts: its error is measured
    on them before any leaf is cut."""
    dirichlet: float = 0.0
    """Dirichlet noise weight at the root (data generation only; 0 = none)."""
    dirichlet_alpha: float = 0.3
    repeat_limit: float = REPEAT_LIMIT
    """A playout whose completed plan was simulated before proposes nothing new: it costs no
    simulator call and is not counted against the budget (its node still joins the tree, so the
    next playout through it decides one more group). At most ``repeat_limit`` x the budget of
    such repeats are walked before they count too (so a small, exhausted space ends)."""

    def __post_init__(self):
        if self.c_puct <= 0:
            raise ValueError(f"c_puct: expected > 0, got {self.c_puct}")
        if self.batch < 1:
            raise ValueError(f"batch: expected >= 1, got {self.batch}")
        if self.value_z < 0:
            raise ValueError(f"value_z: expected >= 0, got {self.value_z}")
        if self.repeat_limit < 0:
            raise ValueError(f"repeat_limit: expected >= 0, got {self.repeat_limit}")
        if not 0 <= self.dirichlet < 1:
            raise ValueError(f"dirichlet: expected in [0, 1), got {self.dirichlet}")


@dataclass
class SearchStats:
    playouts: int = 0
    """Playouts that proposed a plan not simulated before (simulated or cut by the value head)."""
    prior_calls: int = 0
    value_cuts: int = 0
    repeats: int = 0
    """Playouts whose completed plan had been simulated before (not counted in ``playouts``)."""
    improvements: list = field(default_factory=list)
    """``[playout, reward]`` each time a proposed plan beat every plan before it, the better
    data-parallel baseline (reward 0) included: the search's progress."""
    value_errors: list = field(default_factory=list)
    """Error of the value head on every simulated leaf it predicted (and that fits in memory):
    ``log(t_sim / t_pred)`` (positive: optimistic)."""

    def count_plan(self, reward: float | None) -> None:
        """Count a proposed plan not simulated before (``reward`` None: cut by the value head)."""
        self.playouts += 1
        if reward is not None and reward > (self.improvements[-1][1] if self.improvements else 1e-9):
            self.improvements.append([self.playouts, reward])

    @property
    def first_beat_dp(self) -> int | None:
        """Playout at which a plan first beat the better data-parallel baseline (None: never)."""
        return self.improvements[0][0] if self.improvements else None

    def spent(self, budget: int | None, repeat_limit: float = REPEAT_LIMIT, start: tuple[int, int] = (0, 0)) -> int:
        """Playouts of a ``budget`` used since ``start`` (``(playouts, repeats)`` then): every
        proposed plan not simulated before, and repeats beyond ``repeat_limit`` x ``budget``
        (``budget`` None: no limit, every repeat free)."""
        if budget is None:
            return self.playouts - start[0]
        repeats = self.repeats - start[1]
        return self.playouts - start[0] + max(0, repeats - int(repeat_limit * budget))

    @staticmethod
    def left(budget: int | None, spent: int) -> int | None:
        """Playouts of ``budget`` left after ``spent`` (None: no limit)."""
        return None if budget is None else budget - spent

    def value_error(self) -> tuple[float, float]:
        """(bias, standard deviation) of :attr:`value_errors` (``(0, inf)`` with fewer than two)."""
        e = self.value_errors
        if len(e) < 2:
            return 0.0, math.inf
        return float(np.mean(e)), float(np.std(e, ddof=1))


def _promising(v: float, best: float, margin: float, bias: float = 0.0) -> bool:
    """Whether a predicted reward ``v``, corrected by the value head's ``bias`` (mean of
    ``log(t_sim / t_pred)``), is within ``margin`` of the best in log-time:
    ``log(t_pred) + bias <= log(t_best) + margin`` (rewards are ``t_ref / t - 1``, so
    ``log1p(r) = log(t_ref / t)``)."""
    if best <= -1.0 or not math.isfinite(margin):
        return True
    if v <= -1.0:
        return False
    return math.log1p(v) - bias >= math.log1p(best) - margin


def _evaluate_nodes(tree: Tree, nodes: list[int], space: ActionSpace, evaluator: Evaluator,
                    prior_fn: PriorFn, cfg: MCTSConfig, stats: SearchStats, root: int,
                    rng: np.random.Generator, plan_fn: PlanPriorFn | None = None) -> list[tuple[float, float | None]]:
    """Set priors of ``nodes`` and return (backup value, simulated reward or None) per node."""
    states, pending = [], []
    for n in nodes:
        st = tree.leaf_state(n, space)
        states.append(st)
        pending.append(not tree.terminal[n] and not tree.expanded[n])
    # The network sees plans without a pipeline (its priors serve op-group decisions; a
    # plan-level decision has the fixed prior over its options, or plan_fn's, a pipeline plan no value).
    asked = [i for i, st in enumerate(states) if st.pipeline is None]
    want = any(pending[i] and states[i].plan_decision < 0 for i in asked) or cfg.value_cut
    priors = values = None
    if asked and want:
        pri, val = prior_fn(space, [states[i] for i in asked])
        priors, values = [None] * len(states), np.full(len(states), np.nan)
        for j, i in enumerate(asked):
            priors[i], values[i] = pri[j], val[j]
        stats.prior_calls += 1
    out = []
    for i, n in enumerate(nodes):
        v = float(values[i]) if values is not None and np.isfinite(values[i]) else None
        acts = states[i].resolved
        seen = evaluator.cache.get(acts)
        if seen is not None:  # a repeat: this plan was simulated before, nothing new is proposed
            stats.repeats += 1
            tree.feedback[n] = seen.feedback
            val, sim = seen.reward, seen.reward
        else:
            simulate = (v is None or not cfg.value_cut or tree.terminal[n]
                        or len(stats.value_errors) < max(cfg.min_sims, 2))
            if not simulate:
                bias, sd = stats.value_error()
                simulate = _promising(v, evaluator.best_reward, cfg.value_margin + cfg.value_z * sd, bias)
            if simulate:
                outc = evaluator.evaluate(acts)
                tree.feedback[n] = outc.feedback
                val, sim = outc.reward, outc.reward
                if v is not None and v > -1.0 and outc.reward > -1.0:
                    stats.value_errors.append(math.log1p(v) - math.log1p(outc.reward))
                stats.count_plan(outc.reward)
            else:
                stats.count_plan(None)
                stats.value_cuts += 1  # back up the bias-corrected prediction
                val, sim = (math.expm1(math.log1p(v) - stats.value_error()[0]) if v > -1.0 else v), None
        if pending[i]:
            st = states[i]
            if st.plan_decision >= 0:
                mask = plan_prior(space, st)
                p = mask / mask.sum()
                if plan_fn is not None:  # the learned prior, over the decision's options only
                    q = np.where(mask > 0, np.nan_to_num(plan_fn(space, st), nan=0.0), 0.0)
                    if q.sum() > 0:
                        p = (1.0 - PLAN_PRIOR_FLOOR) * q / q.sum() + PLAN_PRIOR_FLOOR * p
            else:
                mask = space.group_mask(st.assign)  # None: every action allowed (else: executable ones)
                p = np.asarray(priors[i], dtype=np.float64) if priors is not None else np.zeros(space.num_actions)
                p = np.where(np.isfinite(p) & (p > 0), p, 0.0)
                if mask is not None:
                    p = np.where(mask, p, 0.0)
                ok = mask if mask is not None else np.ones(space.num_actions, bool)
                p = p / p.sum() if p.sum() > 0 else ok / ok.sum()
                p = space.canonical_prior(st.group, p)  # equivalent actions are one action
            first = st.plan_decision < 0 and not (st.assign >= 0).any()
            if first:  # symmetric first decisions are one decision
                p = space.canonical_root_prior(p)
            if n == root and cfg.dirichlet > 0:
                noise = rng.dirichlet(np.full(space.num_actions, cfg.dirichlet_alpha))
                if mask is not None:
                    noise = noise * mask / max((noise * mask).sum(), 1e-300)
                p = (1 - cfg.dirichlet) * p + cfg.dirichlet * noise
                if first:
                    p = space.canonical_root_prior(p)
            tree.prior[n] = p
            tree.expanded[n] = True
        out.append((val, sim))
    return out


def run_playouts(tree: Tree, root: int, space: ActionSpace, evaluator: Evaluator, prior_fn: PriorFn,
                 rng: np.random.Generator, *, playouts: int | None, deadline: float = math.inf,
                 cfg: MCTSConfig | None = None, stats: SearchStats | None = None,
                 plan_fn: PlanPriorFn | None = None) -> SearchStats:
    """Run ``playouts`` more playouts from ``root`` (None: no limit, until ``deadline``; stopping
    early at ``deadline``, but never before the first wave); ``plan_fn``: a learned prior at plan-level decisions (None: the fixed
    :func:`plan_prior`)."""
    cfg = cfg or MCTSConfig()
    stats = stats or SearchStats()
    start, start_repeats = stats.playouts, stats.repeats
    if not tree.expanded[root]:  # the root's own plan is the first playout
        res = _evaluate_nodes(tree, [root], space, evaluator, prior_fn, cfg, stats, root, rng, plan_fn)
        backup(tree, root, res[0][0], root, res[0][1])
    waves = 0
    while True:
        done = stats.spent(playouts, cfg.repeat_limit, (start, start_repeats))
        left = SearchStats.left(playouts, done)
        if (left is not None and left <= 0) or (waves > 0 and time.perf_counter() >= deadline):  # >= 1 wave
            break
        waves += 1
        wave = cfg.batch if left is None else min(cfg.batch, left)
        leaves: list[int] = []
        seen = tree.value_sum[: tree.size][tree.visits[: tree.size] > 0] / np.maximum(
            tree.visits[: tree.size][tree.visits[: tree.size] > 0], 1)
        qrange = (float(seen.min()), float(seen.max())) if seen.size else (0.0, 0.0)
        for _ in range(wave):
            noise = rng.random(space.num_actions) * 1e-6
            node, a = select(tree, root, cfg.c_puct, qrange, noise)
            if a >= 0:
                node = expand(tree, node, a)
            add_virtual_loss(tree, node, root)
            leaves.append(node)
        uniq = list(dict.fromkeys(leaves))
        stats.repeats += len(leaves) - len(uniq)  # a leaf picked twice in one wave
        results = dict(zip(uniq, _evaluate_nodes(tree, uniq, space, evaluator, prior_fn, cfg, stats, root, rng,
                                                 plan_fn)))
        for node in leaves:
            val, sim = results[node]
            backup(tree, node, val, root, sim, virtual=1.0)
    return stats


@dataclass
class SearchResult:
    actions: tuple | None
    """Best action tuple found by search (None when a data-parallel baseline stayed best)."""
    groups: list
    """Group plans of the best plan (a baseline's when search found nothing better)."""
    time_s: float
    oom: bool
    source: str
    stats: SearchStats
    tree: Tree | None = None
    proposals: list = field(default_factory=list)
    """Plans ``propose_fn`` proposed (simulated, or repeats)."""


ProposeFn = Callable[[ActionSpace, SearchState], Sequence[tuple]]
"""``propose_fn(space, root_state) -> complete action tuples`` to simulate after the tree, given
the root's state with its own plan's simulator feedback (e.g. the network's one-shot plan,
:meth:`tag.gnn.Predictor.one_shot`)."""


def propose(stats: SearchStats, evaluator: Evaluator, actions: tuple) -> Outcome:
    """Score a full action tuple proposed outside a tree (its canonical form: see
    :meth:`ActionSpace.canonical`); a plan simulated before is counted as a repeat, any other as a
    playout."""
    actions = evaluator.space.canonical(actions)
    if actions in evaluator.cache:
        stats.repeats += 1
        return evaluator.cache[actions]
    out = evaluator.evaluate(actions)
    stats.count_plan(out.reward)
    return out


def mcts_search(space: ActionSpace, evaluator: Evaluator, prior_fn: PriorFn, rng: np.random.Generator, *,
                playouts: int | None = 200, time_limit: float | None = None, cfg: MCTSConfig | None = None,
                propose_fn: ProposeFn | None = None, reserve: int = 1,
                plan_fn: PlanPriorFn | None = None) -> SearchResult:
    """One search from the empty plan; returns the best plan the evaluator has seen.

    ``plan_fn``: the prior at plan-level decisions (None: the fixed :func:`plan_prior`; see
    :data:`PLAN_PRIOR_FLOOR`).

    ``propose_fn``: called once the tree has used all but ``reserve`` playouts of the budget; at
    most ``reserve`` of the plans it returns are simulated (:func:`propose`), and a plan the tree
    had already simulated gives its playout back to the tree. The tree never sees them, so the
    playout at which the search first beats data parallel is the tree's own."""
    deadline = time.perf_counter() + time_limit if time_limit is not None else math.inf
    tree = new_tree(space)
    if propose_fn is None:
        reserve = 0
    elif playouts is not None:
        reserve = min(reserve, playouts - 1)
    stats = run_playouts(tree, 0, space, evaluator, prior_fn, rng, playouts=SearchStats.left(playouts, reserve),
                         deadline=deadline, cfg=cfg, plan_fn=plan_fn)
    proposals: list[tuple] = []
    if reserve > 0:
        feedback = tree.feedback[0] or Feedback.neutral(space.num_devices, space.num_groups)
        root = SearchState(np.full(space.num_groups, -1, np.int64), space.order[0], feedback)
        proposals = [space.canonical(p) for p in propose_fn(space, root)][:reserve]
        before = stats.playouts
        for acts in proposals:
            propose(stats, evaluator, acts)
        short = reserve - (stats.playouts - before)  # proposals the tree had simulated, or none
        if short > 0 and time.perf_counter() < deadline:
            run_playouts(tree, 0, space, evaluator, prior_fn, rng, playouts=short, deadline=deadline, cfg=cfg,
                         stats=stats, plan_fn=plan_fn)
    return SearchResult(evaluator.best_actions, evaluator.best_plan_groups(), evaluator.best.time_s,
                        evaluator.best.oom, evaluator.best_source, stats, tree, proposals)


def search_actions(space: ActionSpace, assign: np.ndarray) -> np.ndarray:
    """[A] bool: the actions the search tells apart at the op-group decision after ``assign`` ([K],
    -1 undecided): those the space allows there (:meth:`ActionSpace.group_mask`), one per class of
    equivalent deployments of the group decided next (:attr:`ActionSpace.group_canonical`) and, at
    the first decision, one per class of root-equivalent actions (:attr:`ActionSpace.root_canonical`):
    the support of the prior :func:`_evaluate_nodes` gives a node from an everywhere-positive one."""
    path_len = int((np.asarray(assign) >= 0).sum())
    g = space.order[path_len]
    mask = space.group_mask(assign)
    p = np.ones(space.num_actions) if mask is None else mask.astype(np.float64)
    p = space.canonical_prior(g, p)
    if path_len == 0:
        p = space.canonical_root_prior(p)
    return p > 0


def evaluate_children(tree: Tree, node: int, space: ActionSpace, evaluator: Evaluator) -> int:
    """Give every action the search tells apart at the op-group decision ``node``
    (:func:`search_actions`) a child whose own completed plan is simulated, as a playout's leaf
    is (its state's resolved plan, :meth:`Evaluator.evaluate`, cached), and raise the best
    simulated reward (:attr:`Tree.best`) of ``node`` and its ancestors to it. Visits and values
    are untouched: a search continued from the tree is the one it would have been, except that
    the new children's plans are repeats. Returns the simulator calls spent."""
    calls = evaluator.sim_calls
    assign = tree.assign(node, space)
    for a in np.flatnonzero(search_actions(space, assign)):
        child = int(tree.children[node, a])
        if child >= 0 and tree.feedback[child] is not None:
            continue
        if child < 0:
            child = expand(tree, node, int(a))
        out = evaluator.evaluate(tree.leaf_state(child, space).resolved)
        tree.feedback[child] = out.feedback
        n = child
        while n >= 0:
            tree.best[n] = max(tree.best[n], out.reward)
            n = int(tree.parent[n])
    return evaluator.sim_calls - calls


@dataclass
class Decision:
    """One labelled decision of an episode (training data)."""

    assign: np.ndarray
    group: int
    feedback: Feedback
    visits: np.ndarray
    """[A] normalised visit distribution over the actions of ``group``."""
    node: int


def run_episode(space: ActionSpace, evaluator: Evaluator, prior_fn: PriorFn, rng: np.random.Generator, *,
                playouts_per_step: int = 16, cfg: MCTSConfig | None = None, temperature_steps: int = 2,
                max_steps: int | None = None) -> tuple[list[Decision], Tree, SearchStats]:
    """AlphaZero self-play: at each decision run playouts from the current root (reusing the
    tree), record the root's visit distribution, commit to an action (sampled by visits for the
    first ``temperature_steps`` decisions, then the most visited) and move the root down."""
    if space.plan_options:
        raise ValueError("run_episode labels op-group decisions only; expected a space built with pipelines=False")
    tree = new_tree(space)
    stats = SearchStats()
    root = 0
    decisions = []
    steps = space.num_groups if max_steps is None else min(max_steps, space.num_groups)
    for step in range(steps):
        run_playouts(tree, root, space, evaluator, prior_fn, rng, playouts=playouts_per_step, cfg=cfg, stats=stats)
        pi = visit_distribution(tree, root)
        feedback = tree.nearest_feedback(root) or Feedback.neutral(space.num_devices, space.num_groups)
        decisions.append(Decision(tree.assign(root, space), space.order[step], feedback, pi, root))
        if step < temperature_steps:
            a = int(rng.choice(space.num_actions, p=pi))
        else:
            a = int(np.argmax(pi))
        child = tree.children[root, a]
        if child < 0:
            child = expand(tree, root, a)
        root = int(child)
    return decisions, tree, stats
