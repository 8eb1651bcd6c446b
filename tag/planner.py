"""``find_plan(graph, topology, ...)``: the planner's Python entry point (``tag.find_plan``): the
searches of :mod:`tag.search`, guided by the predictor of :mod:`tag.gnn`, then SFB compression
where the simulator confirms it pays."""

from __future__ import annotations

import functools
import gc
import math
import os
import threading
import time
from dataclasses import dataclass, fields, replace

import numpy as np

from .errors import PlanError, TagError
from .plan.format import Plan, new_plan
from .search.evaluate import Evaluator
from .search.mcts import MCTSConfig, SearchStats, mcts_search, uniform_prior
from .search.searchers import SEARCHERS, random_search, simulated_annealing, tpe_search
from .search.space import ActionSpace

DEFAULT_PLAYOUTS = 200
"""Playouts when neither a playout budget nor a time limit is given."""

ONE_SHOT_GROUPS = 32
"""The network's one-shot plan asks for this many groups (the largest stakes) and completes the
rest by rule: its one batched call costs ~K x (K x D) cross edges, 4.3 s for all 128 groups of
an 8-layer gpt2 on 32 GPUs against 1.4 s for the whole 50-playout search. 16 lost a held-out
pair of the planner benchmark, 32 gives the same plans as all groups there."""

GNN_MAX_DEVICES = 512
"""Largest cluster the predictor runs on. Above :data:`tag.gnn.features.COARSE_ABOVE` devices (or
the checkpoint's ``meta["coarse_above"]``) it encodes one device node per machine, so its cost
follows the machines, not the GPUs (an 8-state wave 11.6 s and 1.8 GB at 512 GPUs on the machine
graph; with one node per device 88 s and, for the one-shot call, 14.5 GB:
``evaluation/results/sim-speed/scale.md``). Beyond it :func:`find_plan` searches with the uniform
prior and says so in ``meta["prior_note"]``. 128 until 2026-11-27, when the shipped network was
27fed77's, trained with one node per device on at most 32 GPUs (27% behind uniform MCTS @500 on
``cloud-256gpu-3zones``, ``evaluation/results/planner-bench/scale-256gpu-machine-graph/`` at d54a868); the
network shipped since (e444807) is trained with clusters of 48-256 GPUs on the machine graph, and
on the planner benchmark's two held-out pairs above 128 GPUs it beats the uniform prior at 50
playouts (ResNet-50 on ``cloud-256gpu-3zones`` 32.1 against 302.2 ms, GPT-2 medium on
``h100-512gpu`` 131.7 against 133.9 ms; ``evaluation/results/planner-bench-relabel/`` at d43ad12)."""

PIPELINE_MODES = ("auto", "grid", "off")
"""``find_plan(pipelines=...)``: search pipelines and tp then the hand-written layout grid (bounded by
the searched plan, or not), or neither."""

GC_YOUNG_OBJECTS = 50_000
"""While :func:`find_plan` runs, the cyclic garbage collector's youngest generation is collected
after this many net allocations of container objects (Python's default: 700; the older
generations' thresholds are kept). The planner allocates millions of small containers that live
until it returns (simulator caches, the tree, plans); at the default the collector ran ~5,900
times in one 512-GPU plan (llama-7b, 128 groups, ``h100-512gpu``, 50 playouts) and took 3.5 s of
its 23 s, at 50,000 ~700 times and 1.2 s, peak memory the same (2026-11-27). Changes no number."""

_GC_STATE = {"depth": 0, "saved": None}
_GC_LOCK = threading.Lock()


def _young_gc(f):
    """``f`` run with :data:`GC_YOUNG_OBJECTS` as the youngest generation's threshold (the
    outermost of nested or concurrent calls sets it and puts the previous one back)."""
    @functools.wraps(f)
    def run(*args, **kwargs):
        with _GC_LOCK:
            if _GC_STATE["depth"] == 0:
                old = _GC_STATE["saved"] = gc.get_threshold()
                gc.set_threshold(max(old[0], GC_YOUNG_OBJECTS), *old[1:])
            _GC_STATE["depth"] += 1
        try:
            return f(*args, **kwargs)
        finally:
            with _GC_LOCK:
                _GC_STATE["depth"] -= 1
                if _GC_STATE["depth"] == 0:
                    gc.set_threshold(*_GC_STATE["saved"])

    return run


_PREDICTORS: dict = {}


def _predictor(checkpoint):
    from .gnn.predictor import DEFAULT_CHECKPOINT, Predictor
    key = str(checkpoint or DEFAULT_CHECKPOINT)
    if key not in _PREDICTORS:
        _PREDICTORS[key] = Predictor.load(checkpoint)
    return _PREDICTORS[key]


class PlannerConfigError(TagError):
    """A :class:`PlannerConfig` value is invalid."""


def _check(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise PlannerConfigError(f"{name}: expected {expected}, got {value!r}")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


@dataclass(frozen=True)
class PlannerConfig:
    """What :func:`find_plan` searches and how long (``tag plan``'s options): validated on
    construction, one :class:`PlannerConfigError` line naming the field and what was expected."""

    searcher: str = "mcts"
    """``mcts`` (default), ``sa`` (simulated annealing), ``random`` or ``tpe`` (optuna)."""
    prior: str = "gnn"
    """MCTS prior: ``gnn`` (the trained predictor; also its value head at leaves) or ``uniform``.
    Beyond :data:`GNN_MAX_DEVICES` devices ``gnn`` searches with the uniform prior
    (``meta["prior"]`` says which ran, ``meta["prior_note"]`` why)."""
    budget: int | None = None
    """Playouts: proposed plans not simulated before (a plan proposed again is a free repeat; see
    :mod:`tag.search.mcts`). None: :data:`DEFAULT_PLAYOUTS` without ``time_limit``, no limit with
    it."""
    time_limit: float | None = None
    """Wall-clock seconds for the search and the layout grid after set-up (with ``budget``:
    whichever ends first); where the grid runs the search gets the first half and the grid the rest
    (``meta["grid_cut"]``: it stopped before its bounds did); at least one wave of playouts and one
    layout run. None: no limit."""
    seed: int = 0
    """Seeds the searcher's ``numpy.random.Generator``; same seed -> same plan."""
    checkpoint: str | os.PathLike | None = None
    """Predictor checkpoint (None: the shipped ``tag/gnn/predictor.pt``); ``find_plan(predictor=)``
    overrides it."""
    mcts: MCTSConfig | None = None
    """MCTS knobs (None: :class:`MCTSConfig`'s defaults)."""
    compression: str = "auto"
    """``auto`` runs the Sufficient Factor Broadcasting selection (MILP) on the searched plan and
    keeps it only if the simulator says the iteration gets faster; ``off`` skips it."""
    one_shot: bool = True
    """With ``prior="gnn"``, simulate the network's one-shot plan (:meth:`tag.gnn.Predictor.one_shot`,
    for the first :data:`ONE_SHOT_GROUPS` groups in decision order) as the last playout of the
    budget."""
    pipelines: str = "auto"
    """``auto`` searches pipelines and tensor parallelism with the rest: per-group ``tp`` actions
    and the plan-level decisions (stage count, micro-batches, each stage data or tensor parallel,
    schedule, cut) of :class:`tag.search.space.ActionSpace` (``pipelines=True``; not where the
    simulator runs no pipelines, :func:`runs_pipelines`), then goes through the Megatron-style
    layouts a user would try by hand by branch and bound (:func:`tag.search.layouts.grid_search`:
    only layouts that may fit and beat the searched plan are simulated), refines the best few
    (:func:`tag.search.layouts.refine`) and returns the fastest plan that fits
    (``meta["source"] == "layout-grid"`` when a layout wins; ``meta["layouts"]``,
    ``"layouts_tried"``, ``"layouts_pruned"``, ``"refinements"`` say what ran); ``grid`` the same
    without bounding the grid by the searched plan (``meta["best_layout"]`` is then the grid's
    best); ``off`` searches TAG's action space alone (no ``tp`` actions, no pipelines, no grid)."""
    executable: bool = True
    """Search only plans ``tag execute`` runs (:func:`tag.parallel.execution_refusal`: plain ``tp``
    as the whole plan's or every pipeline stage's deployment, one degree; masked in the search
    space, :class:`tag.search.space.ActionSpace`, and the ``grid`` layouts filtered alike). False
    searches every plan the simulator costs (``tp`` beside other groups, stages of several ``tp``
    degrees, sequence-parallel layouts): faster plans, some of them simulated only. TAG's own
    actions (``pipelines="off"``) are all executed."""
    layout_grid: bool = True
    """False skips the layout grid after the search (``pipelines="auto"``: the search alone over its
    space; ``evaluation/planner_bench.py`` compares searchers so, the grid being the same for every
    searcher)."""

    def __post_init__(self):
        _check(self.searcher in SEARCHERS, "searcher", self.searcher, f"one of {', '.join(SEARCHERS)}")
        _check(self.prior in ("gnn", "uniform"), "prior", self.prior, "'gnn' or 'uniform'")
        _check(self.budget is None or _is_int(self.budget) and self.budget >= 1, "budget", self.budget,
               "a positive number of playouts or None")
        _check(self.time_limit is None or isinstance(self.time_limit, (int, float)) and self.time_limit > 0,
               "time_limit", self.time_limit, "a positive number of seconds or None")
        _check(_is_int(self.seed) and self.seed >= 0, "seed", self.seed, "an integer >= 0")
        _check(self.checkpoint is None or isinstance(self.checkpoint, (str, os.PathLike)), "checkpoint",
               self.checkpoint, "a path or None")
        _check(self.mcts is None or isinstance(self.mcts, MCTSConfig), "mcts", self.mcts, "an MCTSConfig or None")
        _check(self.compression in ("auto", "off"), "compression", self.compression, "'auto' or 'off'")
        _check(self.pipelines in PIPELINE_MODES, "pipelines", self.pipelines, f"one of {', '.join(PIPELINE_MODES)}")
        for name in ("one_shot", "executable", "layout_grid"):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "True or False")

    @property
    def playouts(self) -> int | None:
        """The playout budget the searcher gets: ``budget``, else :data:`DEFAULT_PLAYOUTS` without a
        time limit; None: no limit (the time limit ends the search)."""
        if self.budget is not None:
            return self.budget
        return None if self.time_limit is not None else DEFAULT_PLAYOUTS


def runs_pipelines(simulator) -> bool:
    """Whether ``simulator`` (None: the default :class:`tag.sim.Simulator`) costs pipelined plans:
    its ``runs_pipelines`` attribute (:attr:`tag.sim.Simulator.runs_pipelines`; absent: it does not,
    e.g. :class:`tag.search.toy.ToySimulator`, whose ``run`` takes the groups alone)."""
    return simulator is None or bool(getattr(simulator, "runs_pipelines", False))


@dataclass(frozen=True)
class PlannerResult:
    """What :func:`find_plan` says of its search, typed: the keys of ``plan.meta`` it writes, read by
    :meth:`of` (a plan file's ``meta`` is the same JSON object; a key an older plan lacks is None).
    Times in seconds, None where that plan does not fit in memory or did not run."""

    searcher: str | None = None
    """The searcher that ran (:attr:`PlannerConfig.searcher`)."""
    prior: str | None = None
    """The MCTS prior that ran (``gnn``, ``uniform``; None: not MCTS)."""
    prior_note: str | None = None
    """Why the prior that ran is not the one asked for."""
    seed: int | None = None
    playouts: int | None = None
    """Playouts the search made (plans proposed and not simulated before)."""
    sim_calls: int | None = None
    """Simulations the search made (baselines and seeds included)."""
    value_cuts: int | None = None
    repeats: int | None = None
    """Playouts that proposed a plan simulated before."""
    search_time_s: float | None = None
    """Wall seconds from the call to the end of the search (set-up and baselines included)."""
    first_beat_dp_playout: int | None = None
    improvements: list | None = None
    """``[playout, seconds]`` at each new best plan of the search."""
    source: str | None = None
    """Where the plan comes from: a baseline (``dp-even``, ``dp-prop``, ``fsdp``, ``fsdp-offload``),
    the search, or ``layout-grid``."""
    oom: bool | None = None
    """The plan does not fit in memory (the one closest to fitting)."""
    executable: bool | None = None
    dp_even_time_s: float | None = None
    dp_prop_time_s: float | None = None
    dp_even_oom: bool | None = None
    dp_prop_oom: bool | None = None
    fsdp_time_s: float | None = None
    fsdp_oom: bool | None = None
    """None: the fsdp baseline was not seeded (plain data parallel, or not executable)."""
    lower_bound_s: float | None = None
    one_shot_time_s: float | None = None
    actions: str | None = None
    plan_prior: str | None = None
    """Who chose the pipeline decisions: ``network`` (the plan head) or ``fixed``; None: none."""
    plan_head_fallback: str | None = None
    space: dict | None = None
    """The search space: ``{"actions", "tp_actions", "stages"}``."""
    grid_because: str | None = None
    layouts: int | None = None
    """Layouts of the grid (with ``layouts_tried`` simulated, ``layouts_pruned`` bounded)."""
    layouts_tried: int | None = None
    layouts_pruned: int | None = None
    best_layout: str | None = None
    best_layout_time_s: float | None = None
    refinements: list | None = None
    refinement_simulations: int | None = None
    grid_cut: bool | None = None
    subclusters: list | None = None
    bounds_fallback: str | None = None
    rebalanced: list | None = None
    grid_time_s: float | None = None
    """Wall seconds of the grid, its refinements and the sub-clusters."""
    pipelines: str | None = None
    """Set where the grid was skipped: why."""
    layout: str | None = None
    """The winning layout (``source == "layout-grid"``)."""
    refinement: str | None = None
    machines: list | None = None
    idle_kinds: list | None = None
    compression: str | None = None
    """What SFB compression did (one line), or ``off``."""
    sfb_saving_s: float | None = None

    @classmethod
    def of(cls, plan: Plan) -> PlannerResult:
        """``plan.meta``'s planner keys, typed (other keys, e.g. ``tag plan``'s ``capture_s``, left out)."""
        meta = plan.meta or {}
        return cls(**{f.name: meta.get(f.name) for f in fields(cls)})


@_young_gc
def find_plan(graph, topology, config: PlannerConfig | None = None, *, predictor=None, costs=None,
              simulator=None, progress=None) -> Plan:
    """Search a deployment of ``graph`` on ``topology`` as ``config`` says (None: the defaults of
    :class:`PlannerConfig`).

    Seeds: both data-parallel baselines (even and speed-proportional shares) and the ``fsdp``
    baseline (ZeRO-3 over every device, :func:`tag.cost.baselines.fully_sharded`; recomputation
    on the fewest groups where it runs out of memory; where it still does not fit, the same with
    its optimizer offloaded, ``fsdp-offload``) are simulated first, the best of them the
    plan the search must beat; where the layout grid runs, its best layout (and refinements) is
    searched against the best plan so far. The plan returned is the fastest that fits of the
    seeds, the search and the grid: never worse than any of them (the grid's best up to a time
    limit that cuts it, ``meta["grid_cut"]``).

    Args:
        graph: a grouped :class:`tag.graph.OpGraph`.
        topology: a :class:`tag.topology.Topology`.
        config: a :class:`PlannerConfig`.
        predictor: an already loaded :class:`tag.gnn.Predictor` (overrides ``config.checkpoint``).
        costs: the simulator's cost model (built for the topology when omitted).
        simulator: anything with ``run(groups) -> SimResult`` (default :class:`tag.sim.Simulator`);
            pipelines are searched only where :func:`runs_pipelines` says it costs them.
        progress: called as ``progress(stage)`` when a stage starts (``"baselines"``, ``"search"``,
            ``"layout grid"``, ``"compression"``) and ``progress("search", done, total)`` after each
            plan the search simulates (``total``: the playout budget, None under a time limit alone).

    Returns:
        A :class:`Plan` with ``predicted_iteration_time_s`` and ``meta`` holding the searcher,
        playouts, simulator calls, search time, both baselines' times and the lower bound
        (:meth:`PlannerResult.of` reads it typed).
    """
    config = PlannerConfig() if config is None else config
    if not isinstance(config, PlannerConfig):
        raise PlannerConfigError(f"config: expected a PlannerConfig, got {type(config).__name__}")
    if graph.num_groups < 1:
        raise TagError(f"graph {graph.model!r}: has no op-groups")
    searcher, prior, time_limit, pipelines = config.searcher, config.prior, config.time_limit, config.pipelines
    executable = config.executable
    note = progress or (lambda stage, done=None, total=None: None)
    t0 = time.perf_counter()
    playouts = config.playouts  # None: no limit (the time limit ends the search)
    note("baselines")
    new_actions = pipelines != "off"
    space = ActionSpace(graph, topology, cost_model=costs, tensor_parallel=new_actions,
                        pipelines=new_actions and runs_pipelines(simulator), executable=executable)
    ev = Evaluator(space, simulator)
    fsdp_out = _seed_fsdp(graph, topology, ev, executable)
    note("search", 0, playouts)
    ev.on_simulate = lambda e, base=ev.sim_calls: note("search", e.sim_calls - base, playouts)
    rng = np.random.default_rng(config.seed)
    stats, proposals = SearchStats(), []
    prior_fn = uniform_prior
    propose_fn = plan_fn = None
    prior_note = None
    if searcher == "mcts" and prior == "gnn" and topology.num_devices > GNN_MAX_DEVICES:
        prior, prior_note = "uniform", f"uniform prior: {topology.num_devices} devices > GNN_MAX_DEVICES ({GNN_MAX_DEVICES})"
    if searcher == "mcts" and prior == "gnn":
        pred = predictor if predictor is not None else _predictor(config.checkpoint)
        prior_fn = pred.bind(space, ev.t_ref)
        plan_fn = pred.bind_plan(space, ev.t_ref, ev.simulator)  # None: untrained plan head, no pipelines
        if plan_fn is not None:  # pipelines left open are completed as the head would choose
            space.pipeline_completion = plan_fn.complete
        if config.one_shot:
            def propose_fn(sp, root):  # after the tree: the root's feedback is the simulator's
                return [pred.one_shot(sp, ev.t_ref, root.feedback, max_groups=ONE_SHOT_GROUPS)]
    # The time limit covers the search and the layout grid after it (set-up above: cost tables,
    # both baselines, loading the predictor): where the grid runs, the search gets the first half
    # of it (at least one wave of playouts always runs) and the grid what is left (at least one
    # layout always simulated).
    grid_runs = config.layout_grid and (pipelines == "grid" or (pipelines == "auto" and bool(space.plan_options)))
    t_start = time.perf_counter()
    deadline = t_start + time_limit if time_limit is not None else math.inf
    search_deadline = t_start + time_limit / 2 if time_limit is not None and grid_runs else deadline
    if searcher == "mcts":
        res = mcts_search(space, ev, prior_fn, rng, playouts=playouts,
                          time_limit=None if time_limit is None else max(0.0, search_deadline - time.perf_counter()),
                          cfg=config.mcts, propose_fn=propose_fn, plan_fn=plan_fn)
        stats, proposals = res.stats, res.proposals
    elif searcher == "sa":
        stats = simulated_annealing(space, ev, rng, playouts=playouts, deadline=search_deadline)
    elif searcher == "random":
        stats = random_search(space, ev, rng, playouts=playouts, deadline=search_deadline)
    else:
        stats = tpe_search(space, ev, rng, playouts=playouts, deadline=search_deadline)
    search_s = time.perf_counter() - t0
    try:
        from .sim import lower_bound
        lb = float(lower_bound(graph, topology, space.cost_model))
    except ImportError:  # pragma: no cover - simulator absent
        lb = math.nan
    one_shot_out = ev.cache.get(proposals[0]) if proposals else None
    groups = space.normalised(ev.best_plan_groups())  # as simulated: normalising changes no time (tested)
    best = ev.best
    p = new_plan(graph, topology, groups)
    p.pipeline = ev.best_pipeline()
    p.predicted_iteration_time_s = None if best.oom else best.time_s
    p.meta = {
        "searcher": searcher, "prior": prior if searcher == "mcts" else None, "prior_note": prior_note, "seed": config.seed,
        "playouts": stats.playouts, "sim_calls": ev.sim_calls, "value_cuts": stats.value_cuts, "repeats": stats.repeats,
        "search_time_s": search_s, "first_beat_dp_playout": stats.first_beat_dp,
        # [playout, seconds] at each new best plan: the search's progress (1e-9 keeps 6+ digits)
        "improvements": [[n, round(ev.t_ref / (1.0 + r), 12)] for n, r in stats.improvements],
        "source": ev.best_source, "oom": best.oom, "executable": executable,
        "dp_even_time_s": None if ev.dp_even_out.oom else ev.dp_even_out.time_s,
        "dp_prop_time_s": None if ev.dp_prop_out.oom else ev.dp_prop_out.time_s,
        "dp_even_oom": ev.dp_even_out.oom, "dp_prop_oom": ev.dp_prop_out.oom,
        "fsdp_time_s": None if fsdp_out is None or fsdp_out.oom else fsdp_out.time_s,
        "fsdp_oom": None if fsdp_out is None else fsdp_out.oom,  # None: not seeded (plain data parallel)
        "lower_bound_s": lb,
        # the network's one-shot plan (None: not simulated, e.g. prior uniform, or out of memory)
        "one_shot_time_s": one_shot_out.time_s if one_shot_out is not None and not one_shot_out.oom else None,
        "actions": space.describe_key(ev.best_actions) if ev.best_actions else None,
        # who chose at the plan-level pipeline decisions: the network's plan head, or the fixed prior
        "plan_prior": None if not space.plan_options or searcher != "mcts" else
                      ("network" if plan_fn is not None and plan_fn.fallback is None else "fixed"),
        # why the plan head stopped (a case it cannot handle: the fixed prior took over), else None
        "plan_head_fallback": getattr(plan_fn, "fallback", None),
        "space": {"actions": space.num_actions, "tp_actions": int(space.is_tp.sum()),
                  "stages": space.options("stages", 1) if space.plan_options else None},
    }
    if grid_runs:
        note("layout grid")
        if best.oom:
            p.meta["grid_because"] = "every searched plan runs out of memory"
        p = _pipelined(graph, topology, p, space.cost_model, ev.simulator, executable,
                       against_search=pipelines == "auto", deadline=deadline)
    if config.compression != "off":
        note("compression")
    p.meta["compression"] = "off" if config.compression == "off" else _compress(graph, topology, p, ev.simulator)
    return p


def layout_plan(graph, topology, layout, costs=None, machines=None) -> Plan:
    """The plan of a Megatron-style layout, as ``tag simulate --layout`` costs it: ``layout`` a
    string ``"dp=D,tp=T,pp=P,micro=M[,schedule=1f1b|gpipe|kfkb,k=K][,stages=7+6+6+5][,order=m1:0-3+m0:0-3]"``
    or a parsed :class:`tag.parallel.layout.Layout`; even layer cuts balanced by ``costs``
    (default: the topology's :class:`~tag.cost.CostModel`), or with ``stages`` the layers stated
    per stage (the graph's op-groups must start at each stage's first layer:
    :func:`tag.parallel.layout.align_groups` regroups a graph so that they do); stages placed
    machine-major in the topology's device order, or on the devices ``order`` states.
    ``machines``: names of the machines the layout occupies (``dp*tp*pp`` their device count),
    the others idle, as the planner's sub-cluster layouts
    (:func:`tag.search.layouts.subcluster_search`; ``tag simulate --machines``); default all.
    ``order`` subsumes ``machines``: given both, the order must name exactly the machines'
    devices (:func:`layout_machines`). A layout the topology, the graph or the batch cannot
    hold, or an unknown machine or device, is one :class:`~tag.errors.PlanError` line; whether it
    fits in memory is the simulation's ``oom``."""
    from .cost.model import CostModel
    from .parallel.layout import layout_plan as _layout_plan
    from .parallel.layout import parse_layout

    lay = parse_layout(layout) if isinstance(layout, str) else layout
    costs = costs if costs is not None else CostModel.for_topology(graph, topology)
    if machines is None:
        return _layout_plan(graph, topology, lay, costs)
    sub, devices = layout_machines(topology, lay, machines)
    if lay.order is not None:  # (the order names the devices on the whole topology)
        return _layout_plan(graph, topology, lay, costs)
    return _layout_plan(graph, sub, lay, costs.restricted(sub, devices)).on_topology(topology, devices)


def layout_machines(topology, layout, machines) -> tuple:
    """``(sub-topology, device map)`` of the machines named ``machines`` (in the topology's order)
    for ``layout`` (a :class:`tag.parallel.layout.Layout`): one :class:`~tag.errors.PlanError`
    line for an unknown name, a device count the layout does not occupy exactly, or a device of
    the layout's ``order`` on another machine."""
    from .parallel.layout import check_devices, layout_devices

    names = [m.name for m in topology.machines]
    unknown = [m for m in machines if m not in names]
    if unknown or not machines:
        raise PlanError(f"machines: no machine {unknown[0] if unknown else ''!r} in topology {topology.name!r}; "
                        f"expected some of {', '.join(names)}")
    sub, devices = topology.restricted([topology.machine_index(m) for m in machines])
    check_devices(layout, sub)
    if layout.order is not None:
        kept = set(devices)
        stray = [d for d in layout_devices(layout, topology) if d not in kept]
        if stray:
            raise PlanError(f"layout: order: device {topology.devices[stray[0]].name} is not on machines "
                            f"{','.join(machines)}; expected their devices only (or no machines: the order "
                            "names the devices)")
    return sub, devices


def _pipelined(graph, topology, p: Plan, costs, simulator, executable: bool, against_search: bool = False,
               deadline: float = math.inf) -> Plan:
    """``p``, or the best hand-written layout (:func:`tag.search.layouts.grid_search`, pruned by
    the simulator's lower bounds; with ``executable`` of those the executor runs) or a refinement
    of the best few (:func:`tag.search.layouts.refine`) when the simulator says it is strictly
    faster (and fits); the outcome goes into ``meta``. ``against_search``: prune the grid against
    ``p``'s time too (only layouts faster than the searched plan matter; ``best_layout`` is then
    None when none is); ``deadline``: a :func:`time.perf_counter` time after which no layout or
    refinement is started (``meta["grid_cut"]``). Then the same on sub-clusters without the
    slowest device kinds (:func:`tag.search.layouts.subcluster_search`, pruned by the best plan so
    far; ``meta["subclusters"]`` says what each gave, ``meta["machines"]`` the machines a winning
    layout runs on, ``meta["idle_kinds"]`` the GPU kinds it leaves idle)."""
    from .search.layouts import grid_search, refine, subcluster_search

    if not runs_pipelines(simulator):
        p.meta["pipelines"] = "skipped (the simulator runs no pipelines)"
        return p
    t_plan = p.predicted_iteration_time_s
    t0 = time.perf_counter()
    failures: list[str] = []  # a bound that meets a case it cannot handle: the grid simulated whole
    found = grid_search(graph, topology, costs, simulator, executable=executable,
                        incumbent=t_plan if against_search and t_plan is not None else None, deadline=deadline,
                        failures=failures)
    better = refine(graph, topology, costs, simulator, found, executable=executable, deadline=deadline)
    lay = found.best
    p.meta.update(layouts=found.layouts, layouts_tried=found.simulated, layouts_pruned=found.layouts - found.simulated,
                  best_layout=None if lay is None else lay.meta["layout"],
                  best_layout_time_s=None if lay is None else lay.predicted_iteration_time_s,
                  refinements=better.notes, refinement_simulations=better.simulations, grid_cut=found.cut)
    if better.plan is not None and (lay is None or lay.predicted_iteration_time_s is None
                                    or better.plan.predicted_iteration_time_s < lay.predicted_iteration_time_s):
        lay = better.plan
    # the grid again without the slowest device kinds (their devices left idle), pruned by the best so far
    times = [t for t in (t_plan if against_search and not p.meta.get("oom") else None,
                         None if lay is None else lay.predicted_iteration_time_s) if t is not None]
    sub, p.meta["subclusters"] = subcluster_search(graph, topology, costs, simulator, executable=executable,
                                                   incumbent=min(times, default=None), deadline=deadline,
                                                   failures=failures)
    p.meta["bounds_fallback"] = failures[0] if failures else None
    if sub is not None:
        lay = sub
    # the pipelines closest to fitting that may beat the best plan, with their stage boundaries moved
    times = [t for t in (None if p.meta.get("oom") else t_plan, None if lay is None else lay.predicted_iteration_time_s)
             if t is not None]
    lay = _rebalanced(simulator, found, p, executable, deadline, min(times, default=math.inf)) or lay
    p.meta["grid_time_s"] = time.perf_counter() - t0  # the grid, its refinements and the sub-clusters
    if p.meta.get("oom") and (lay is None or lay.predicted_iteration_time_s is None) and found.ranked:
        # nothing fits: the plan closest to fitting, the searched one or a layout the grid simulated
        grid_p, grid_r = min(found.ranked, key=lambda x: x[1].overflow)
        if grid_r.overflow < simulator.run(p.groups, pipeline=p.pipeline).overflow:
            grid_p.meta = {**p.meta, "source": "layout-grid", "layout": grid_p.meta["layout"], "oom": True}
            return grid_p
    if lay is None:
        return p
    t_lay = lay.predicted_iteration_time_s
    # the faster of the two (a layout that fits replaces a plan that does not); ties to the searched plan
    if t_lay is None or (not p.meta.get("oom") and t_plan is not None and t_lay >= t_plan):
        return p
    lay.meta = {**p.meta, "source": "layout-grid", "layout": lay.meta["layout"], "oom": False,
                "refinement": lay.meta.get("refinement"), "machines": lay.meta.get("machines"),
                "idle_kinds": lay.meta.get("idle_kinds")}
    return lay


REBALANCED_LAYOUTS = 2
"""The grid's fastest pipelines out of memory that :func:`_rebalanced` moves stage boundaries of."""
REBALANCE_OVERFLOW = 1.1
"""Only pipelines whose fullest device needs at most this much of its memory are rebalanced (a
moved op-group shifts a few percent of a stage's memory)."""


def _rebalanced(simulator, found, p: Plan, executable: bool, deadline: float, best_s: float):
    """The first of the :data:`REBALANCED_LAYOUTS` fastest pipeline layouts of the grid (``found``,
    a :class:`~tag.parallel.layout.GridSearch`) out of memory by at most
    :data:`REBALANCE_OVERFLOW` and faster than ``best_s`` seconds (the best plan so far; inf: none
    fits) that :func:`tag.search.layouts.rebalance` makes fit, still faster, or None.
    Candidates: the simulated layouts out of memory, and the fastest :data:`REBALANCED_LAYOUTS` of
    those the grid's first bound kept from simulation as unable to fit (by that bound's time and
    memory; simulated here); what each gave goes into ``p.meta["rebalanced"]``."""
    from .search.layouts import rebalance

    cap = getattr(simulator, "capacity", None)  # (a simulator of another kind: the simulated layouts alone)
    near, seen = [], set()
    for q, bd in found.unfit if cap is not None else ():
        pl = q.pipeline  # (a twin, cut by memory where the time cut is the same: the same plan)
        key = (tuple(pl.stages), pl.micro_batches, pl.schedule, pl.k, tuple(g.key() for g in q.groups))
        over = max(b / max(c, 1.0) for b, c in zip(bd.peak_bytes, cap))
        if bd.time_s < best_s and over <= REBALANCE_OVERFLOW and key not in seen:
            seen.add(key)
            near.append((bd.time_s, q))
    near.sort(key=lambda x: x[0])
    cands = [(q, r) for q, r in found.ranked if q.pipeline is not None and r.oom]
    cands += [(q, simulator.run(q.groups, pipeline=q.pipeline)) for _, q in near[:REBALANCED_LAYOUTS]]
    cands = sorted([(q, r) for q, r in cands if r.oom and r.overflow <= REBALANCE_OVERFLOW
                    and r.iteration_time_s < best_s], key=lambda x: x[1].iteration_time_s)
    notes = p.meta.setdefault("rebalanced", [])
    for q, r in cands[:REBALANCED_LAYOUTS]:
        got, sims, note = rebalance(simulator, q, r, executable=executable, deadline=deadline)
        notes.append(f"{note} ({sims} simulations)")
        if got is not None and got.predicted_iteration_time_s < best_s:
            return got
    return None


def _seed_fsdp(graph, topology, ev: Evaluator, executable: bool):
    """Seed ``ev`` with the ``fsdp`` baseline (:meth:`Evaluator.seed`) and return its outcome;
    None where it is plain data parallel (one device a group: a baseline already) or, with
    ``executable``, the executor refuses it. Where it does not fit (recomputation included), the
    same plan with its optimizer offloaded (``offload`` ``optimizer``: ZeRO-Offload's recipe,
    source ``fsdp-offload``) is seeded too: one more simulation, made only where it may matter."""
    from .cost.baselines import fully_sharded
    from .parallel import execution_refusal

    plan = fully_sharded(graph, topology)
    if all(g.sync != "zero3" for g in plan.groups) or (executable and execution_refusal(plan) is not None):
        return None
    out = ev.seed(plan.groups, "fsdp")
    if out.oom:  # the same with every sharded group's optimizer on the host (ZeRO-Offload)
        offloaded = [replace(g, offload="optimizer") if g.sync == "zero3" else g for g in plan.groups]
        ev.seed(offloaded, "fsdp-offload")
    return out


def _compress(graph, topology, p: Plan, simulator) -> str:
    """Add SFB to ``p`` in place where the MILP says it pays AND the simulator confirms it.

    The MILP assumes no overlap; the simulator knows that the all-reduce SFB removes may have been
    hidden behind earlier groups' backward, so its verdict decides. Returns a one-line note.
    """
    from .parallel import apply_sfb

    if p.predicted_iteration_time_s is None:
        return "compression: skipped (plan does not fit in memory)"
    if p.pipeline is not None:
        return "compression: skipped (SFB is not available in a pipeline plan)"
    cand = apply_sfb(graph, topology, p)
    # a group that recomputes its activations keeps its all-reduce (the executor runs no SFB on it)
    cand.groups = [replace(g, sfb=[]) if g.recompute and g.sfb else g for g in cand.groups]
    n = sum(len(g.sfb) for g in cand.groups)
    if n == 0:
        return "compression: no op-group benefits from SFB"
    res = simulator.run(cand.groups)
    before = p.predicted_iteration_time_s
    if res.oom or res.iteration_time_s >= before:
        return (f"compression: SFB on {n} weight gradients rejected by the simulator "
                f"({res.iteration_time_s * 1e3:.3f} ms vs {before * 1e3:.3f} ms without)")
    p.groups = cand.groups
    p.predicted_iteration_time_s = float(res.iteration_time_s)
    p.meta["sfb_saving_s"] = before - res.iteration_time_s
    return f"compression: SFB on {n} weight gradients saves {(before - res.iteration_time_s) * 1e3:.3f} ms"


def model_graph(spec: str, batch: int | None = None, *, optimizer: str = "adam", precision: str = "fp32",
                seed: int = 0, num_groups: int = 48, use_cache: bool = True):
    """``(OpGraph grouped into num_groups, seconds, from_cache)`` of workload ``spec``: what
    ``tag inspect`` / ``plan`` / ``simulate`` and ``tag bench`` capture.

    The model is built without weights (meta device: a model larger than this machine's memory is
    captured all the same), a model of identical blocks (a zoo transformer, a factory's list of
    blocks) is captured by layer folding (:mod:`tag.graph.fold`),
    and the graph is read from / written to the graph cache
    (:mod:`tag.graph.cache`, keyed by spec, batch, optimizer, precision and library versions)
    unless ``use_cache`` is False.
    """
    from .graph import capture_graph
    from .graph.cache import cached_graph, graph_key
    from .workloads import is_zoo, load_workload

    key = graph_key(spec, batch, optimizer, precision=precision, seed=seed, zoo=is_zoo(spec))

    def fresh():
        wl = load_workload(spec, batch=batch, seed=seed, abstract=True)
        return capture_graph(wl, optimizer=optimizer, num_groups=1, precision=precision)

    return cached_graph(key, fresh, num_groups, use_cache=use_cache)


def export_plan(plan, graph, topology, trainer: str, *, costs=None, profiles=None, numerics=None):
    """``plan`` as ``trainer``'s configuration (``torchtitan``, ``megatron``, ``deepspeed``;
    :mod:`tag.parallel.export`): a :class:`~tag.parallel.export.Export` whose ``text`` is the file,
    ``layout`` the layout the trainer runs, ``problems`` what of the plan it cannot express (the
    layout is then the nearest it can: the plan's degrees with even shares, uniform actions,
    stages cut between layers and a schedule it runs; or, where the plan has no such shape, the
    fastest layout of the grid it runs), ``layout_time_s`` that layout simulated beside the
    plan's ``plan_time_s``. ``costs`` (default the topology's :class:`~tag.cost.CostModel`, with
    ``profiles`` and ``numerics``) balances and costs the layouts."""
    from .cost.model import CostModel
    from .parallel.export import Export, for_trainer, kinds_note, order_note, plan_layout, spell, write_config
    from .parallel.layers import model_layers
    from .sim import Simulator

    plan.validate(graph, topology)
    costs = costs if costs is not None else CostModel.for_topology(graph, topology, profiles, numerics=numerics)
    sim = Simulator(graph, topology, costs)
    plan_t = plan.predicted_iteration_time_s
    if plan_t is None:
        res = sim.run(plan.groups, pipeline=plan.pipeline)
        plan_t = None if res.oom else res.iteration_time_s
    lay, problems = plan_layout(plan, graph, topology, costs)
    run, more, notes = for_trainer(lay, trainer, graph.batch_size, plan.precision) if lay else (None, [], [])
    problems += more
    notes += [x for x in (lay and order_note(lay, topology), lay and kinds_note(lay, topology)) if x]
    n = len(model_layers(graph))
    if run is not None and run.pp > 1 and run.stages is None and n:  # no layer cut holds the stages
        run = None
    if run is not None:
        run_t = plan_t if not problems and run == replace(lay, order=None) else \
            _layout_time(graph, topology, replace(run, order=lay.order), sim, profiles, numerics)
    if run is None or run_t is False:
        run, run_t = _fastest_layout(graph, topology, costs, sim, trainer, plan.precision)
        notes = for_trainer(run, trainer, graph.batch_size, plan.precision)[2]
        problems.append(f"no layout of the plan's own degrees runs on {trainer}")
    header = (f"tag plan --export {trainer}: {graph.model}, batch {graph.batch_size}, {plan.precision}, on "
              f"{topology.name}: layout {spell(run)}",) + tuple(f"not expressed: {p}" for p in problems) + \
        tuple(f"note: {x}" for x in notes)
    text = write_config(trainer, run, graph.batch_size, plan.precision, n or None, header)
    return Export(trainer, text, run, problems, notes, plan_t, None if run_t is None else run_t)


def _layout_time(graph, topology, layout, sim, profiles, numerics):
    """Simulated seconds of ``layout`` (None: out of memory; False: it has no plan on this
    topology). A layout stating stages whose first layers begin inside op-groups is costed on a
    regrouped copy of the graph (:func:`tag.parallel.layout.align_groups`)."""
    import copy

    from .cost.model import CostModel
    from .parallel.layout import align_groups
    from .parallel.layout import layout_plan as _layout_plan
    from .sim import Simulator

    try:
        p = _layout_plan(graph, topology, layout, sim.costs)
    except PlanError:
        if layout.stages is None:
            return False
        g = copy.deepcopy(graph)
        try:
            align_groups(g, layout)
            costs = CostModel.for_topology(g, topology, profiles, numerics=numerics)
            p, sim = _layout_plan(g, topology, layout, costs), Simulator(g, topology, costs)
        except PlanError:
            return False
    res = sim.run(p.groups, pipeline=p.pipeline)
    return None if res.oom else res.iteration_time_s


def _fastest_layout(graph, topology, costs, sim, trainer: str, precision: str):
    """``(layout, seconds or None)``: the fastest layout of the grid (one that fits if any does)
    that ``trainer`` runs as it is, stages by time cut where they fall between layers; branch
    and bound on :func:`tag.sim.bounds.static_bound`."""
    from .parallel.export import for_trainer, plan_layout
    from .parallel.layout import layout_grid
    from .parallel.layout import layout_plan as _layout_plan
    from .sim.bounds import static_bound

    cands = {}
    for lay in layout_grid(graph, topology):
        run, problems, _ = for_trainer(lay, trainer, graph.batch_size, precision)
        if problems or run is None or run in cands:
            continue
        try:
            p = _layout_plan(graph, topology, run, costs)
        except PlanError:
            continue
        seen, dropped = plan_layout(p, graph, topology, costs)
        if seen is not None and not dropped:
            cands[seen] = p
    if not cands:
        raise PlanError(f"export: no layout of {topology.num_devices} devices at batch {graph.batch_size} runs on "
                        f"{trainer}")
    lows = {lay: static_bound(sim, p.groups, p.pipeline) for lay, p in cands.items()}
    best, key = None, None
    for lay in sorted(cands, key=lambda x: (bool(lows[x].oom), lows[x].time_s)):
        if key is not None and (bool(lows[lay].oom), lows[lay].time_s) > key:
            break
        res = sim.run(cands[lay].groups, pipeline=cands[lay].pipeline)
        if key is None or (bool(res.oom), res.iteration_time_s) < key:
            best, key = lay, (bool(res.oom), res.iteration_time_s)
    return best, None if key[0] else key[1]
