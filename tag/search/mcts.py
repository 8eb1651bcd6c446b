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
from .space import ActionSpace

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


PriorFn = Callable[[ActionSpace, Sequence[SearchState]], tuple[np.ndarray, np.ndarray]]
"""``prior_fn(space, states) -> (priors [n, A], values [n])``; values are predicted rewards."""


def uniform_prior(space: ActionSpace, states: Sequence[SearchState]) -> tuple[np.ndarray, np.ndarray]:
    """Uniform prior over the distinct deployments of each state's group (one action per class
    of :attr:`ActionSpace.group_canonical`), no value (MCTS without a network)."""
    a = np.arange(space.num_actions)
    p = np.stack([(space.group_canonical[st.group] == a) if st.group >= 0 else np.ones(space.num_actions, bool)
                  for st in states]).astype(np.float64)
    return p / p.sum(axis=1, keepdims=True), np.full(len(states), np.nan)


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
        self.feedback = [None] * c

    def _grow(self):
        c = self.capacity
        for name in ("parent", "action", "depth", "visits", "value_sum", "best", "prior", "children", "expanded"):
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

    def assign(self, node: int, space: ActionSpace) -> np.ndarray:
        """The partial plan of ``node``."""
        a = np.full(space.num_groups, -1, np.int64)
        n = node
        while self.parent[n] >= 0:
            a[space.order[self.depth[n] - 1]] = self.action[n]
            n = self.parent[n]
        return a

    def nearest_feedback(self, node: int) -> Feedback | None:
        n = node
        while n >= 0:
            if self.feedback[n] is not None:
                return self.feedback[n]
            n = self.parent[n]
        return None


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


def select(tree: Tree, root: int, num_groups: int, c_puct: float, qrange: tuple[float, float],
           noise: np.ndarray) -> tuple[int, int]:
    """Descend from ``root``; returns ``(node, action)`` to expand, or ``(node, -1)`` when the
    walk ends at a terminal or pending node. ``noise`` [A] breaks ties deterministically."""
    n = root
    while True:
        if tree.depth[n] >= num_groups or not tree.expanded[n]:
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

    def spent(self, budget: int, repeat_limit: float = REPEAT_LIMIT, start: tuple[int, int] = (0, 0)) -> int:
        """Playouts of a ``budget`` used since ``start`` (``(playouts, repeats)`` then): every
        proposed plan not simulated before, and repeats beyond ``repeat_limit`` x ``budget``."""
        repeats = self.repeats - start[1]
        return self.playouts - start[0] + max(0, repeats - int(repeat_limit * budget))

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
                    rng: np.random.Generator) -> list[tuple[float, float | None]]:
    """Set priors of ``nodes`` and return (backup value, simulated reward or None) per node."""
    k = space.num_groups
    states, pending = [], []
    for n in nodes:
        fb = tree.nearest_feedback(n) or Feedback.neutral(space.num_devices, k)
        d = tree.depth[n]
        grp = space.order[d] if d < k else -1
        states.append(SearchState(tree.assign(n, space), grp, fb))
        pending.append(d < k and not tree.expanded[n])
    priors, values = prior_fn(space, states) if any(pending) or cfg.value_cut else (None, None)
    if priors is not None:
        stats.prior_calls += 1
    out = []
    for i, n in enumerate(nodes):
        v = float(values[i]) if values is not None and np.isfinite(values[i]) else None
        acts = space.resolve(states[i].assign)
        seen = evaluator.cache.get(acts)
        if seen is not None:  # a repeat: this plan was simulated before, nothing new is proposed
            stats.repeats += 1
            tree.feedback[n] = seen.feedback
            val, sim = seen.reward, seen.reward
        else:
            simulate = (v is None or not cfg.value_cut or tree.depth[n] >= k
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
            p = np.asarray(priors[i], dtype=np.float64)
            p = np.where(np.isfinite(p) & (p > 0), p, 0.0)
            p = p / p.sum() if p.sum() > 0 else np.full(space.num_actions, 1.0 / space.num_actions)
            p = space.canonical_prior(states[i].group, p)  # equivalent actions are one action
            if tree.depth[n] == 0:  # symmetric first decisions are one decision
                p = space.canonical_root_prior(p)
            if n == root and cfg.dirichlet > 0:
                p = (1 - cfg.dirichlet) * p + cfg.dirichlet * rng.dirichlet(
                    np.full(space.num_actions, cfg.dirichlet_alpha))
                if tree.depth[n] == 0:
                    p = space.canonical_root_prior(p)
            tree.prior[n] = p
            tree.expanded[n] = True
        out.append((val, sim))
    return out


def run_playouts(tree: Tree, root: int, space: ActionSpace, evaluator: Evaluator, prior_fn: PriorFn,
                 rng: np.random.Generator, *, playouts: int, deadline: float = math.inf,
                 cfg: MCTSConfig | None = None, stats: SearchStats | None = None) -> SearchStats:
    """Run ``playouts`` more playouts from ``root`` (stopping early at ``deadline``, but never
    before the first wave)."""
    cfg = cfg or MCTSConfig()
    stats = stats or SearchStats()
    k = space.num_groups
    start, start_repeats = stats.playouts, stats.repeats
    if not tree.expanded[root]:  # the root's own plan is the first playout
        res = _evaluate_nodes(tree, [root], space, evaluator, prior_fn, cfg, stats, root, rng)
        backup(tree, root, res[0][0], root, res[0][1])
    waves = 0
    while True:
        done = stats.spent(playouts, cfg.repeat_limit, (start, start_repeats))
        if done >= playouts or (waves > 0 and time.perf_counter() >= deadline):  # >= 1 wave
            break
        waves += 1
        wave = min(cfg.batch, playouts - done)
        leaves: list[int] = []
        seen = tree.value_sum[: tree.size][tree.visits[: tree.size] > 0] / np.maximum(
            tree.visits[: tree.size][tree.visits[: tree.size] > 0], 1)
        qrange = (float(seen.min()), float(seen.max())) if seen.size else (0.0, 0.0)
        for _ in range(wave):
            noise = rng.random(space.num_actions) * 1e-6
            node, a = select(tree, root, k, cfg.c_puct, qrange, noise)
            if a >= 0:
                node = expand(tree, node, a)
            add_virtual_loss(tree, node, root)
            leaves.append(node)
        uniq = list(dict.fromkeys(leaves))
        stats.repeats += len(leaves) - len(uniq)  # a leaf picked twice in one wave
        results = dict(zip(uniq, _evaluate_nodes(tree, uniq, space, evaluator, prior_fn, cfg, stats, root, rng)))
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
                playouts: int = 200, time_limit: float | None = None, cfg: MCTSConfig | None = None,
                propose_fn: ProposeFn | None = None, reserve: int = 1) -> SearchResult:
    """One search from the empty plan; returns the best plan the evaluator has seen.

    ``propose_fn``: called once the tree has used all but ``reserve`` playouts of the budget; at
    most ``reserve`` of the plans it returns are simulated (:func:`propose`), and a plan the tree
    had already simulated gives its playout back to the tree. The tree never sees them, so the
    playout at which the search first beats data parallel is the tree's own."""
    deadline = time.perf_counter() + time_limit if time_limit is not None else math.inf
    tree = new_tree(space)
    reserve = min(reserve, playouts - 1) if propose_fn is not None else 0
    stats = run_playouts(tree, 0, space, evaluator, prior_fn, rng, playouts=playouts - reserve,
                         deadline=deadline, cfg=cfg)
    proposals: list[tuple] = []
    if reserve > 0:
        root = SearchState(tree.assign(0, space), space.order[0],
                           tree.feedback[0] or Feedback.neutral(space.num_devices, space.num_groups))
        proposals = [space.canonical(p) for p in propose_fn(space, root)][:reserve]
        before = stats.playouts
        for acts in proposals:
            propose(stats, evaluator, acts)
        short = reserve - (stats.playouts - before)  # proposals the tree had simulated, or none
        if short > 0 and time.perf_counter() < deadline:
            run_playouts(tree, 0, space, evaluator, prior_fn, rng, playouts=short, deadline=deadline, cfg=cfg,
                         stats=stats)
    return SearchResult(evaluator.best_actions, evaluator.best_plan_groups(), evaluator.best.time_s,
                        evaluator.best.oom, evaluator.best_source, stats, tree, proposals)


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
    tree = new_tree(space)
    stats = SearchStats()
    root = 0
    decisions = []
    steps = space.num_groups if max_steps is None else min(max_steps, space.num_groups)
    for step in range(steps):
        run_playouts(tree, root, space, evaluator, prior_fn, rng, playouts=playouts_per_step, cfg=cfg, stats=stats)
        pi = visit_distribution(tree, root)
        fb = tree.nearest_feedback(root) or Feedback.neutral(space.num_devices, space.num_groups)
        decisions.append(Decision(tree.assign(root, space), space.order[step], fb, pi, root))
        if step < temperature_steps:
            a = int(rng.choice(space.num_actions, p=pi))
        else:
            a = int(np.argmax(pi))
        child = tree.children[root, a]
        if child < 0:
            child = expand(tree, root, a)
        root = int(child)
    return decisions, tree, stats
