"""Score plans with the simulator: cached, counted, relative to the data-parallel baselines.

Reward (as TAG): ``r = t_ref / t - 1`` where ``t_ref`` is the better of the two data-parallel
baselines (even and speed-proportional shares), so ``r > 0`` means beating both; a plan that does
not fit in memory gets ``r = -1``, the worst possible reward, and so does, in an executable space
(:attr:`ActionSpace.executable`), a plan the executor refuses (:func:`tag.parallel.execution_refusal`;
not simulated: the space proposes none, this is the rule's last word).

A plan out of memory is first given activation recomputation on the fewest groups that make it
fit (:func:`tag.search.recompute.fit_by_recompute`; ``Evaluator.recompute``), and scored as that
plan (:attr:`Outcome.groups`); a plan that fits is scored as it is.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..cost.baselines import data_parallel
from ..parallel import execution_refusal
from .recompute import fit_by_recompute
from .space import ActionSpace

OOM_REWARD = -1.0


def _dp_prop(space):
    """Data parallel with shares proportional to device speed (the cost model's when known)."""
    if space.cost_model is not None:
        try:
            from ..cost.baselines import data_parallel_proportional
            return data_parallel_proportional(space.graph, space.topology, space.cost_model)
        except ImportError:
            pass
    return data_parallel(space.graph, space.topology, proportional=True,
                         speeds=list(space.costs.device_speed))


def _closer_to_fit(out: Outcome, best: Outcome) -> bool:
    """Both out of memory and ``out``'s most overfull device less so than ``best``'s (peak over
    capacity): while nothing fits, the best plan is the one closest to fitting (what ``tag plan``
    reports and ``--allow-oom`` writes), not the first data-parallel baseline."""
    return (out.oom and best.oom and math.isfinite(out.time_s)
            and float(np.max(out.feedback.device_mem, initial=0.0)) < float(np.max(best.feedback.device_mem, initial=0.0)))


class _Plan(NamedTuple):
    """What :func:`tag.parallel.execution_refusal` reads of a plan."""

    groups: list
    pipeline: object


@dataclass
class Feedback:
    """What the simulator said about one plan, normalised by its iteration time."""

    iteration_time_s: float
    oom: bool
    device_util: np.ndarray
    """[D] compute time / iteration time."""
    device_mem: np.ndarray
    """[D] peak memory / capacity."""
    device_comm: np.ndarray
    """[D] communication time / iteration time."""
    group_finish: np.ndarray
    """[K] finish time of each op-group / iteration time."""

    @classmethod
    def neutral(cls, num_devices: int, num_groups: int) -> Feedback:
        z = np.zeros(num_devices)
        return cls(math.nan, False, z, z, z, np.zeros(num_groups))

    @classmethod
    def from_result(cls, res, num_devices: int, num_groups: int) -> Feedback:
        t = float(res.iteration_time_s)
        scale = 1.0 / t if t > 0 and math.isfinite(t) else 0.0

        def vec(name, n, div=None):
            v = getattr(res, name, None)
            if v is None:
                return np.zeros(n)
            a = np.asarray(v, dtype=np.float64).reshape(-1)
            if a.size != n:
                return np.zeros(n)
            return a * scale if div is None else a / div

        cap = getattr(res, "memory_capacity_bytes", None)
        if cap is None:
            capv = np.ones(num_devices) * np.inf
        else:
            capv = np.broadcast_to(np.asarray(cap, dtype=np.float64), (num_devices,))
        mem = vec("peak_memory_bytes", num_devices, np.maximum(capv, 1.0))
        return cls(t, bool(getattr(res, "oom", False)), np.nan_to_num(vec("compute_time_s", num_devices)),
                   np.nan_to_num(mem), np.nan_to_num(vec("comm_time_s", num_devices)),
                   np.nan_to_num(vec("group_finish_s", num_groups)))


@dataclass
class Outcome:
    time_s: float
    oom: bool
    reward: float
    feedback: Feedback
    groups: list | None = None
    """The deployment simulated when it is not the plan asked for: the plan with activation
    recomputation on some groups (:func:`tag.search.recompute.fit_by_recompute`); None otherwise."""


@dataclass
class Evaluator:
    """Simulates resolved action tuples, caches them and keeps the best plan seen.

    Args:
        space: the action space.
        simulator: anything with ``run(list[GroupPlan]) -> SimResult`` (default: a
            :class:`tag.sim.Simulator` on the space's graph and topology).
        costs: cost model passed to the default simulator.
    """

    space: ActionSpace
    simulator: object = None
    costs: object = None
    cache: dict = field(default_factory=dict)
    sim_calls: int = 0
    sim_seconds: float = 0.0
    history: list = field(default_factory=list)
    """(sim call number, best time so far) after every simulator call."""
    on_simulate: object = None
    """Called as ``on_simulate(evaluator)`` after every plan the search has simulated (not the
    baselines, not cache hits): progress display."""
    recompute: bool = True
    """Give a plan out of memory activation recomputation on the fewest groups that make it fit
    (in an executable space only where the executor runs it); False: score it as it is."""

    def __post_init__(self):
        if self.simulator is None:
            from ..sim import Simulator
            self.simulator = Simulator(self.space.graph, self.space.topology,
                                       self.costs if self.costs is not None else self.space.cost_model)
        sp = self.space
        self.dp_even = data_parallel(sp.graph, sp.topology, proportional=False)
        self.dp_prop = _dp_prop(sp)
        self.dp_even_out = self._run_groups(self.dp_even.groups)
        self.dp_prop_out = self._run_groups(self.dp_prop.groups)
        cands = [o.time_s for o in (self.dp_even_out, self.dp_prop_out) if not o.oom and math.isfinite(o.time_s)]
        if cands:
            self.t_ref = min(cands)
        else:  # both baselines OOM: any sensible scale will do
            self.t_ref = float(np.sum(sp.costs.group_time_full.min(axis=1))) or 1.0
        for o in (self.dp_even_out, self.dp_prop_out):
            o.reward = self.reward(o.time_s, o.oom)
        # Best so far: the better baseline (never return anything worse).
        if (self.dp_prop_out.oom, self.dp_prop_out.time_s) <= (self.dp_even_out.oom, self.dp_even_out.time_s):
            self.best_groups, self.best = self.dp_prop_out.groups or self.dp_prop.groups, self.dp_prop_out
            self.best_source = "dp-prop"
        else:
            self.best_groups, self.best = self.dp_even_out.groups or self.dp_even.groups, self.dp_even_out
            self.best_source = "dp-even"
        self.best_actions: tuple | None = None
        self.history = [(self.sim_calls, self.best_time)]

    def seed(self, groups, source: str) -> Outcome:
        """Simulate a plan found outside the search (``groups`` of a baseline, no pipeline; made to
        fit by recomputation as any plan) and make it the best so far, ``best_source`` ``source``,
        when it beats the best (or fits where the best does not, or comes closer to fitting): the
        search then has to beat it, and the plan returned is never worse."""
        out = self._run_groups(groups)
        out.reward = self.reward(out.time_s, out.oom)
        if out.reward > self.best.reward or (self.best.oom and not out.oom) or _closer_to_fit(out, self.best):
            self.best, self.best_actions, self.best_groups = out, None, out.groups or list(groups)
            self.best_source = source
        self.history.append((self.sim_calls, self.best_time))
        return out

    @property
    def best_time(self) -> float:
        return math.inf if self.best.oom else self.best.time_s

    @property
    def best_reward(self) -> float:
        return self.best.reward

    def reward(self, t: float, oom: bool) -> float:
        if oom or not math.isfinite(t) or t <= 0:
            return OOM_REWARD
        return self.t_ref / t - 1.0

    def _run_groups(self, groups, pipeline=None) -> Outcome:
        t0 = time.perf_counter()
        res = self.simulator.run(groups) if pipeline is None else self.simulator.run(groups, pipeline=pipeline)
        self.sim_calls += 1
        fitted = None
        if res.oom and self.recompute:
            accept = None
            if self.space.executable:
                def accept(gs):
                    return execution_refusal(_Plan(gs, pipeline)) is None
            fitted = fit_by_recompute(self.simulator, groups, pipeline, res, accept)
            if fitted is not None:
                res = fitted[1]
                self.sim_calls += fitted[2]
        self.sim_seconds += time.perf_counter() - t0
        fb = Feedback.from_result(res, self.space.num_devices, self.space.num_groups)
        return Outcome(fb.iteration_time_s, fb.oom, 0.0, fb, None if fitted is None else fitted[0])

    def evaluate(self, actions: tuple) -> Outcome:
        """Simulate a full action tuple (cached)."""
        out = self.cache.get(actions)
        if out is not None:
            return out
        plan = self.space.plan_of(actions)
        if plan is not None and self.space.executable and execution_refusal(_Plan(*plan)) is not None:
            plan = None  # the executor would refuse it (the space proposes none such: a safety net)
        if plan is None:  # a pipeline no stage cut realises: scored as not fitting, never simulated
            sp = self.space
            out = Outcome(math.inf, True, OOM_REWARD, Feedback.neutral(sp.num_devices, sp.num_groups))
            self.cache[actions] = out
            return out
        out = self._run_groups(*plan)
        out.reward = self.reward(out.time_s, out.oom)
        self.cache[actions] = out
        if out.reward > self.best.reward or (self.best.oom and not out.oom) or _closer_to_fit(out, self.best):
            self.best, self.best_actions = out, actions
            self.best_groups = out.groups  # None: the action tuple's own plan
            self.best_source = "search"
        self.history.append((self.sim_calls, self.best_time))
        if self.on_simulate is not None:
            self.on_simulate(self)
        return out

    def evaluate_partial(self, assign) -> tuple[tuple, Outcome]:
        acts = self.space.resolve(assign)
        return acts, self.evaluate(acts)

    def best_plan_groups(self):
        if self.best_actions is not None and self.best_groups is None:
            return self.space.plan_of(self.best_actions)[0]
        return [g for g in self.best_groups]

    def best_pipeline(self):
        """The best plan's :class:`~tag.plan.PipelinePlan` (None: no pipeline)."""
        return None if self.best_actions is None else self.space.plan_of(self.best_actions)[1]
