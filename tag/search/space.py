"""The planner's action space: per op-group, which devices replicate it and how it synchronises.

**Decision order.** Op-groups are decided one at a time, largest *stake* first (ties by group
index): the group's compute time (fwd + bwd + opt at the full batch on the fastest device, TAG's
order) plus the all-reduce time of its gradients over every device (:func:`decision_stake`). The
first decisions are the ones that matter most, and a search with a small budget spends it
there; a group with large weights and little compute (VGG's classifier) decides where a large
all-reduce goes, so it comes early too. (Compute alone put VGG-16's classifier behind its
convolutions, and GNN-guided MCTS with 50 playouts missed a two-machine split on the planner
benchmark by 2.2%.)

**Actions.** An action is a pair (device subset, synchronisation) shared by every group of a
(graph, topology); what it means for one group is :meth:`ActionSpace.group_plan`:

* ``allreduce`` / ``ps``: every device of the subset holds a replica. Batch shares are
  proportional to the *group's* speed on each device (``1 / t_group(device)``), not even as in
  TAG; ``ps`` reduces to the subset device with the most bandwidth to the other members.
* ``mp``: the group's forward positions are cut into up to ``SEARCH_MAX_DEVICES`` contiguous
  chunks (:mod:`tag.parallel.model_parallel`) balanced by compute, one per device, taking the
  subset's fastest devices first.

TAG enumerates every subset of machines (``3 * (2^T - 1)`` actions). That explodes beyond a few
machines, so subsets are drawn from structured families whose size grows linearly with the
number of machines ``M`` (see :func:`device_subsets`): all devices; each machine; the fastest
``k`` machines for every ``k``; all but one machine; all machines of one GPU type; one device
of each machine. With ``M <= ENUMERATE_MACHINES`` every machine subset is enumerated as in TAG.
For 32 GPUs over 8 machines this is ~35 subsets and ~90 actions instead of 765.

**Symmetry.** Before any decision, actions that an automorphism of the cluster (swapping
identical machines with identical links) maps onto each other give plans of identical cost; MCTS
keeps one representative per class at the root (:attr:`ActionSpace.root_canonical`), e.g. 13
instead of 49 first decisions on four identical 2-GPU machines.

**Equivalent actions.** Two actions can deploy one group identically: ``ps`` and
``allreduce`` on a group without parameters (half of GPT-2's groups: nothing to synchronise) or
on a single device, ``mp`` cut into one chunk and a single replica, ``mp`` over subsets whose
fastest devices coincide. :attr:`ActionSpace.group_canonical` maps each to its lowest-index
equivalent; completed plans are keyed by those representatives (:meth:`ActionSpace.canonical`),
so no searcher simulates one deployment twice, and MCTS moves their prior mass onto the
representative (:meth:`ActionSpace.canonical_prior`). On gpt2 (64 groups) over
``cluster-16gpu-4m`` a group has 29 distinct actions of 49 on average, on VGG-16 over
``mixed-a100-v100`` 7 of 11.

**Tensor-parallel actions** (``tensor_parallel=True``, the default; none for a model without
Megatron blocks, :mod:`tag.parallel.tensor_parallel`): ``tp`` over the subsets of whole machines
(families :data:`TP_FAMILIES`) at each degree of :attr:`ActionSpace.tp_degrees` (2, 4, 8 dividing
every machine's devices and every block's features and heads), consecutive devices forming one
tensor-parallel group, groups' shares proportional to their slowest device's speed. They are
appended after TAG's actions, whose indices (and the default) do not move. A block split over
several op-groups needs all of them ``tp`` alike: :meth:`ActionSpace.canonical` gives every group
of such a run the ``tp`` action of the first of them in decision order. Through the completion
rule a ``tp`` first decision deploys the whole model that way, the one tensor-parallel plan the
executor runs (every group ``tp`` over the same devices); the simulator costs any mix. On
gpt2-medium over ``cloud-t4`` 15 ``tp`` actions join TAG's 49, on ``mixed-a100-v100`` 6 join 11.

**Executable plans** (``executable=True``; :func:`tag.planner.find_plan` asks for them unless
told otherwise): only plans :func:`tag.parallel.execution_refusal` accepts, i.e. plain ``tp`` as the
one deployment of the whole plan, or of every pipeline stage at one degree (the plan-level
``stage_sync`` decision deploys every stage so: nothing to constrain there). The space says so
up front rather than scoring refused plans after simulating them: a ``tp`` first decision ends the
path (the completion rule gives every group that action; :meth:`ActionSpace.decision_at`), after
any other first decision ``tp`` actions are masked (:meth:`ActionSpace.group_mask`: MCTS's prior
puts no mass on them, random paths never draw them), and ``tp`` actions give every group the
shares of the whole model's pace (per group, on mixed GPUs, the shares would differ and the
executor refuses that).
:meth:`ActionSpace.canonical` maps the tuples the other searchers propose (SA, TPE, the network's
one-shot plan) onto executable ones; the evaluator checks every plan with the predicate before
simulating it (a refused one scores as not fitting, never simulated).

**Plan-level decisions** (``pipelines=True``; :func:`tag.planner.find_plan` asks for them):
before any op-group, the stage count (:data:`PLAN_DECISIONS`; 1 = no pipeline, the default, then
the per-group decisions exactly as without them); more stages go on with four small decisions
instead: how stages are cut (``time``: the slowest stage's compute balanced by
:func:`tag.parallel.layout.balanced_cuts`, heterogeneity-aware; ``memory``: the largest stage's
state balanced), each stage data parallel or tensor parallel at a degree, the micro-batch count
(default ``2 x stages``), the schedule (1F1B, GPipe, kFkB with k = 2; default 1F1B), after which
the plan is complete (stages machine-major, :func:`tag.parallel.layout.layout_plan`). The product
is never enumerated: on gpt2-medium over ``cloud-t4`` 144 pipelines (2, 4 or 8 stages) sit below a
4-way first decision and at most 6-way decisions after it. Cut, stage deployment and micro-batch
count left open take the first of (time, data parallel, 2 x stages micro-batches, then more, then
fewer), (time, tp 2, ...), ..., (memory, data parallel, ...), ... whose memory a static estimate
says fits (:meth:`ActionSpace.pipeline_key`): on gpt2-medium over ``tag-testbed``
(32 groups) the 4-stage data-parallel default ran out of memory (1.29 x a device) and MCTS left
the stage count, whose 2 x 2 tensor-parallel stages are the best layout. A plan-level decision's prior is uniform
over its options (action ``i`` is option ``i``; a larger index is option ``i mod n``, an
equivalent action), except "no pipeline", which gets
:data:`tag.search.mcts.NO_PIPELINE_PRIOR` of the stage-count decision; with a trained plan head
(:mod:`tag.gnn.plan_head`) the network's prior over the options is mixed in and the choices a
path leaves open follow the network (:attr:`ActionSpace.pipeline_completion`). Plans are keyed by their
action tuple, or by a pipeline key, a :class:`PipelineChoice` ``(stages, micro, tp, schedule, k,
cut)`` (:meth:`ActionSpace.resolve_path`, :meth:`ActionSpace.plan_of`).

**Defaults.** Before any decision every group takes :attr:`ActionSpace.default_action` (all
devices, all-reduce, proportional shares). After, a partial plan is completed along program
order: undecided groups before the first decided group follow it, those after the last follow
that one, and a run of undecided groups between two decided groups with different actions is cut
in two where the fewest bytes cross (:attr:`ActionSpace.boundary_bytes`; cuts within ``CUT_TIE``
of the fewest count as equal, the one nearest the midpoint wins), each side following its
decided neighbour. Moving a network's tail to other devices thus moves the undecided groups
beside it with it up to the cheapest cut, not a fixed midpoint. (With the midpoint rule, VGG-16's
classifier moved to the V100 machine of ``mixed-a100-v100`` took its last convolution with it,
across the largest activation, and the completed plan got 3% slower until a fifth decision put
that convolution back: a dip no 50-playout search crossed.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

import numpy as np

from ..cost.baselines import group_footprints
from ..cost.comm import CommModel
from ..errors import PlanError
from ..parallel import DataParallel, TensorParallel, get_strategy, strategy_names, strategy_of
from ..parallel.layout import MICRO_BATCHES, Layout, layout_plan, tp_degrees
from ..parallel.pipeline import iteration_program, searched_schedules, spell_schedule
from ..parallel.tensor_parallel import aligned_cuts, block_groups, megatron_blocks
from ..plan.format import GroupPlan, PipelinePlan, new_plan
from .costs import GroupCosts, default_cost_model

TP_FAMILIES = TensorParallel.search_families
"""Subset families that take tensor-parallel actions (32 GPUs over 8 machines: 26 tp actions at
degrees 2 and 4 next to TAG's 79, not 54; :meth:`tag.parallel.TensorParallel.search_options`)."""
PLAN_DECISIONS = ("stages", "cut", "stage_sync", "micro", "schedule")
"""The plan-level decisions, in the order they are made (see the module docstring)."""
ENUMERATE_MACHINES = 4
"""Up to this many machines, every non-empty machine subset is a candidate (as in TAG)."""
CUT_TIE = 0.05
"""Completion: cuts carrying within this fraction of the fewest bytes count as equally cheap."""


@dataclass(frozen=True)
class Action:
    """A candidate decision for one op-group."""

    devices: tuple[int, ...]
    """Device subset (global indices, ascending)."""
    sync: str
    """The strategy's name (``GroupPlan.sync``: ``allreduce``, ``ps``, ``mp``, ``tp``, or one
    registered later)."""
    family: str
    """Which subset family produced it (``all``, ``machine``, ``prefix``, ...); for display."""
    tp: int | None = None
    """The strategy's option (:meth:`tag.parallel.Strategy.search_options`); ``tp``: devices per
    tensor-parallel group (consecutive devices of one machine); None for none."""

    def describe(self, topology) -> str:
        machines: dict[int, int] = {}
        for d in self.devices:
            m = topology.machine_of(d)
            machines[m] = machines.get(m, 0) + 1
        parts = []
        for m, c in machines.items():
            mach = topology.machines[m]
            parts.append(mach.name if c == mach.count else f"{mach.name}[{c}]")
        name = self.sync if self.tp is None else f"{self.sync}{self.tp}"
        return f"{name}({'+'.join(parts)})"


def device_subsets(topology, speeds: np.ndarray) -> list[tuple[tuple[int, ...], str]]:
    """Candidate device subsets (see the module docstring), deduplicated, in a fixed order."""
    m_count = topology.num_machines
    per_machine = [tuple(topology.devices_of_machine(m)) for m in range(m_count)]
    m_speed = np.array([sum(speeds[d] for d in per_machine[m]) for m in range(m_count)])
    order = sorted(range(m_count), key=lambda m: (-m_speed[m], m))
    out: list[tuple[tuple[int, ...], str]] = []
    seen: set[tuple[int, ...]] = set()

    def add(ms, family, devs=None):
        d = tuple(sorted(devs if devs is not None else [x for m in ms for x in per_machine[m]]))
        if d and d not in seen:
            seen.add(d)
            out.append((d, family))

    add(range(m_count), "all")
    if m_count <= ENUMERATE_MACHINES:
        for mask in range(1, 2 ** m_count):
            add([m for m in range(m_count) if mask >> m & 1], "machines")
    for m in order:
        add([m], "machine")
    for k in range(2, m_count):
        add(order[:k], "fastest")
    if m_count >= 3:
        for m in order:
            add([x for x in range(m_count) if x != m], "all-but-one")
    types: dict[str, list[int]] = {}
    for m in range(m_count):
        types.setdefault(topology.machines[m].gpu.name, []).append(m)
    if len(types) > 1:
        for ms in types.values():
            add(ms, "gpu-type")
    for m in order[:8]:
        if len(per_machine[m]) > 1:
            add([], "single", devs=[per_machine[m][0]])
    return out


def decision_stake(costs: GroupCosts, comm) -> np.ndarray:
    """[K] seconds: a group's compute (fwd + bwd + opt, full batch, fastest device) plus the
    all-reduce of its gradients over every device (the default action's sync).

    What one decision can move: a group with little compute but large weights (VGG's
    classifier, GPT-2's embedding) decides where a large all-reduce goes, and that is as much a
    first decision as a large convolution.

    ``comm``: the :class:`tag.cost.comm.CommModel` pricing the all-reduce
    (:attr:`ActionSpace.comm`)."""
    fastest = int(np.argmax(costs.device_speed))
    t = costs.group_time_full[:, fastest].astype(np.float64).copy()
    devices = list(range(comm.topology.num_devices))
    if len(devices) > 1:
        t += np.array([comm.allreduce_time(devices, float(b)) for b in costs.param_bytes])
    return t


class ActionSpace:
    """Actions, decision order and partial-plan completion for one (graph, topology).

    Args:
        graph: the :class:`tag.graph.OpGraph` (grouped).
        topology: the :class:`tag.topology.Topology`.
        costs: a :class:`GroupCosts` (computed from ``cost_model`` when omitted).
        cost_model: the simulator's :class:`tag.cost.CostModel` (built for the topology when
            omitted and available); shared with the evaluator's simulator.
    """

    def __init__(self, graph, topology, costs: GroupCosts | None = None, cost_model=None, *,
                 tensor_parallel: bool = True, pipelines: bool = False, executable: bool = False):
        self.graph = graph
        self.topology = topology
        self.executable = executable
        """Only plans the executor runs (:func:`tag.parallel.execution_refusal`; see the module
        docstring, "Executable plans"); False: every plan the simulator costs."""
        if cost_model is None and costs is None:
            cost_model = default_cost_model(graph, topology)
        self.cost_model = cost_model
        self.costs = costs if costs is not None else GroupCosts.compute(graph, topology, cost_model)
        self.comm = cost_model.comm if cost_model is not None else CommModel.nominal(topology)
        """The :class:`tag.cost.comm.CommModel` pricing communication: the cost model's (measured
        fits where profiled), else the topology's nominal links."""
        self.num_groups = graph.num_groups
        self.num_devices = topology.num_devices
        self.memo: dict = {}
        """What strategies cache while building the space's plans (:mod:`tag.parallel`)."""
        self._servers: dict[tuple[int, ...], int] = {}  # subset -> its parameter server
        self.tp_degrees = [t for t in tp_degrees(graph, topology)[1:]] if tensor_parallel else []
        """Tensor-parallel degrees of the ``tp`` actions (2, 4, 8 dividing every machine's devices
        and every Megatron block's features and heads; none for a model without blocks)."""
        subsets = device_subsets(topology, self.costs.device_speed)
        strategies = [get_strategy(name) for name in strategy_names()]
        actions: list[Action] = []
        self.num_base_actions = 0
        """Actions of pass 0 (TAG's space: replicas and model-parallel splits); those of later
        passes (tensor parallel, then strategies registered later) follow."""
        for p in sorted({s.search_pass for s in strategies}):  # later passes appended: indices stay
            for devs, fam in subsets:
                for s in strategies:
                    if s.search_pass == p:
                        actions += [Action(devs, s.name, fam, o) for o in s.search_options(devs, fam, self)]
            if p == 0:
                self.num_base_actions = len(actions)
        self.actions = actions
        self.num_actions = len(actions)
        self.is_tp = np.array([a.sync == TensorParallel.name for a in actions], dtype=bool)
        """[A] whether an action is tensor parallel."""
        base = {(act.devices, act.sync): a for a, act in enumerate(actions[:self.num_base_actions])}
        self.tp_as_dp = np.array([base[(act.devices, DataParallel.name)] if self.is_tp[a] else a
                                  for a, act in enumerate(actions)], dtype=np.int64)
        """[A] the data-parallel action over the same devices of a ``tp`` action (others: itself):
        where an executable plan cannot keep a group ``tp`` (:meth:`canonical`)."""
        self.stake_s = decision_stake(self.costs, self.comm)
        """[K] seconds a group's decision can move (see :func:`decision_stake`)."""
        self.order: list[int] = sorted(range(self.num_groups), key=lambda g: (-self.stake_s[g], g))
        """Groups in decision order: largest stake first."""
        self.rank = np.empty(self.num_groups, dtype=np.int64)
        self.rank[self.order] = np.arange(self.num_groups)
        self.default_action = 0  # "all" subset, allreduce
        self._cache: dict[tuple[int, int], GroupPlan] = {}
        self._components = _block_components(graph) if self.tp_degrees else []
        self.plan_options: dict[str, list] = self._plan_options() if pipelines else {}
        """Options of each plan-level decision (:data:`PLAN_DECISIONS`); empty: no pipelines."""
        self._pipe_plans: dict[tuple, tuple] = {}  # pipeline key -> (groups, PipelinePlan) or None
        self._plan_template = None  # a Plan of this graph and topology (layout_plan copies its identity)
        self._fits: dict[tuple, bool] = {}  # pipeline key -> _estimated_fit
        self._footprints: dict[int, np.ndarray] = {}  # samples per device -> [K] bytes (group_footprints)
        self.pipeline_completion = None
        """None: undecided plan-level choices take the defaults of :meth:`pipeline_key`. Else
        ``completion(chosen) -> chosen`` with every :data:`PLAN_DECISIONS` choice made (the
        network's plan head's most likely options: :meth:`tag.gnn.Predictor.bind_plan`), which the
        search's completed plans then follow; a deterministic function of ``chosen``."""

    # ------------------------------------------------------------------ symmetry
    @cached_property
    def machine_classes(self) -> list[int]:
        """Class of each machine: machines ``i`` and ``j`` share a class when they have the same
        GPU, count and intra-machine link and swapping them leaves every machine-to-machine
        bandwidth and latency unchanged (an automorphism of the cluster)."""
        topo = self.topology
        m = topo.num_machines
        bw, lat = topo.machine_bandwidth_matrix, topo.machine_latency_matrix

        def swappable(i, j):
            a, b = topo.machines[i], topo.machines[j]
            if (a.gpu, a.count, a.intra_bandwidth, a.intra_latency) != (b.gpu, b.count, b.intra_bandwidth,
                                                                       b.intra_latency):
                return False
            perm = list(range(m))
            perm[i], perm[j] = j, i
            return bool(np.array_equal(bw[np.ix_(perm, perm)], bw) and np.array_equal(lat[np.ix_(perm, perm)], lat))

        cls = list(range(m))
        for j in range(m):
            for i in range(j):
                if cls[i] == i and swappable(i, j):
                    cls[j] = i
                    break
        return cls

    @cached_property
    def root_canonical(self) -> np.ndarray:
        """[A] index of the canonical representative of each action *before any decision*.

        With nothing decided every undecided group runs on all devices, so two actions that a
        machine automorphism maps onto each other give plans of identical cost; the search keeps
        one of them at the root (their prior mass is summed onto it)."""
        cls = self.machine_classes
        topo = self.topology
        first: dict = {}
        out = np.arange(self.num_actions)
        for a, act in enumerate(self.actions):
            per: dict[int, int] = {}
            for d in act.devices:
                m = topo.machine_of(d)
                per[m] = per.get(m, 0) + 1
            key = (act.sync, act.tp, tuple(sorted((cls[m], c) for m, c in per.items())))
            out[a] = first.setdefault(key, a)
        return out

    def canonical_root_prior(self, prior: np.ndarray) -> np.ndarray:
        """``prior`` with the mass of root-equivalent actions moved onto their representative."""
        return np.bincount(self.root_canonical, weights=prior, minlength=self.num_actions)

    @cached_property
    def group_canonical(self) -> np.ndarray:
        """[K, A] the lowest-index action that deploys group ``g`` exactly as action ``a`` does.

        Different actions can mean the same deployment of one group: ``ps`` and ``allreduce`` on a
        group without parameters (nothing to synchronise; half of GPT-2's 64 groups) or on one
        device, ``mp`` cut into one chunk and a single replica on that device, and ``mp`` over two
        subsets whose fastest devices are the same. Searching both would simulate one deployment
        twice; the simulator gives such pairs identical times and peak memory (tested).

        Keyed by :meth:`_fast_deployment_key`, which gives the classes of
        :meth:`_deployment_key` (the strategy-normalised plan) without materialising K x A plans
        (74,000 of 512 shares each on 512 GPUs; equal classes are tested)."""
        k, a = self.num_groups, self.num_actions
        out = np.empty((k, a), dtype=np.int64)
        for g in range(k):
            first: dict = {}
            for x in range(a):
                out[g, x] = first.setdefault(self._fast_deployment_key(g, x), x)
        return out

    def _deployment_key(self, g: int, a: int) -> tuple:
        """The key of action ``a``'s plan for group ``g`` as the simulator's caches key it, after its
        strategy's normalisation (the reference :meth:`_fast_deployment_key` is tested against)."""
        gp = self.group_plan(g, a)  # a copy: normalised by its strategy, then keyed as the caches key it
        return strategy_of(gp).normalise(gp, self.costs.param_bytes[g] != 0).key()

    def normalised(self, groups: list[GroupPlan]) -> list[GroupPlan]:
        """Copies of a plan's ``groups`` in their strategies' canonical forms (``mp`` in one chunk
        -> one replica, ``ps`` with nothing to synchronise -> ``allreduce``): the deployments the
        search simulates as one (:attr:`group_canonical`), spelled as a user reads them."""
        return [strategy_of(gp).normalise(replace(gp), self.costs.param_bytes[g] != 0)
                for g, gp in enumerate(groups)]

    def _fast_deployment_key(self, g: int, a: int) -> tuple:
        """A key with the classes of :meth:`_deployment_key`, from what the plan depends on
        (:meth:`tag.parallel.Strategy.search_key`: a replicated action's subset and normalised
        sync, an ``mp`` action's chosen devices, ...); a strategy without one: the plan's key."""
        act = self.actions[a]
        key = get_strategy(act.sync).search_key(self, g, act.devices, act.tp)
        return key if key is not None else self._deployment_key(g, a)

    def _mp_devices(self, g: int, act: Action) -> tuple[int, ...]:
        """The devices action ``act`` deploys group ``g`` on (``mp``: its chunks' devices, the
        subset's fastest for the group; :meth:`tag.parallel.Strategy.search_devices`)."""
        return get_strategy(act.sync).search_devices(self, g, act.devices, act.tp)

    def canonical_prior(self, g: int, prior: np.ndarray) -> np.ndarray:
        """``prior`` over group ``g``'s actions with the mass of equivalent actions moved onto
        their representative (see :attr:`group_canonical`)."""
        return np.bincount(self.group_canonical[g], weights=prior, minlength=self.num_actions)

    # ------------------------------------------------------------------ masks
    @cached_property
    def membership(self) -> np.ndarray:
        """[A, D] 1.0 where the action's subset contains the device."""
        m = np.zeros((self.num_actions, self.num_devices), dtype=np.float32)
        for a, act in enumerate(self.actions):
            m[a, list(act.devices)] = 1.0
        return m

    def action_index(self, devices, sync: str, tp: int | None = None) -> int | None:
        key = (tuple(sorted(devices)), sync, tp)
        for a, act in enumerate(self.actions):
            if (act.devices, act.sync, act.tp) == key:
                return a
        return None

    # ------------------------------------------------------------------ completion
    @cached_property
    def boundary_bytes(self) -> np.ndarray:
        """[K-1] bytes crossing between groups ``<= b`` and groups ``> b`` (either direction,
        full batch): what a cut after group ``b`` in program order costs in transfers."""
        cut = np.zeros(max(self.num_groups - 1, 0))
        for (g1, g2), nb in self.costs.flow.items():
            lo, hi = min(g1, g2), max(g1, g2)
            cut[lo:hi] += nb
        return cut

    def resolve(self, assign) -> tuple[int, ...]:
        """Full action tuple for a partial assignment (``-1`` = undecided; see module docs)."""
        k = self.num_groups
        decided = [g for g in range(k) if assign[g] >= 0]
        if not decided:
            return (self.default_action,) * k
        if len(decided) == k:
            return self.canonical(assign)
        out = [int(assign[decided[0]])] * k  # groups before the first decided one follow it
        for left, right in zip(decided, decided[1:] + [k]):
            out[left:right] = [int(assign[left])] * (right - left)  # after the last one too
            if right < k and assign[right] != assign[left] and right - left > 1:
                b = self._gap_cut(left, right)
                out[b + 1:right] = [int(assign[right])] * (right - b - 1)
        return self.canonical(out)

    def canonical(self, actions) -> tuple:
        """``actions`` with each group's action replaced by the representative of its
        equivalents (:attr:`group_canonical`): the key under which a plan is simulated once.

        A Megatron block split over several op-groups needs every one of them ``tp`` over the same
        devices and degree (:meth:`tag.parallel.TensorParallel.check_plan`): where any group of such
        a run of block-linked groups is ``tp``, all of them take the ``tp`` action of the first of
        them in decision order (a decided tp group carries its block with it, as an undecided group
        follows its neighbour). A pipeline key (:meth:`pipeline_key`) is its own canonical form.

        Executable (:attr:`executable`): a tuple mixing ``tp`` with other actions, or several ``tp``
        actions, becomes the plan the executor runs that the first group in decision order asks
        for: its ``tp`` action everywhere, or, when it is not ``tp``, the data-parallel action over
        the same devices in place of every ``tp`` one (:attr:`tp_as_dp`)."""
        if is_pipeline_key(actions):
            return actions
        acts = [int(a) for a in actions]
        if self.executable and self.is_tp[acts].any() and len(set(acts)) > 1:
            # the executor runs tp as the whole plan's one deployment: the first group in decision
            # order decides (as MCTS's first decision does); tp elsewhere -> data parallel, same devices
            first = acts[self.order[0]]
            acts = [first] * len(acts) if self.is_tp[first] else [int(self.tp_as_dp[a]) for a in acts]
        for comp in self._components:
            tp = [g for g in comp if self.is_tp[acts[g]]]
            if tp and len(tp) < len(comp) or len({acts[g] for g in tp}) > 1:
                first = acts[min(tp, key=lambda g: self.rank[g])]
                for g in comp:
                    acts[g] = first
        return tuple(int(a) for a in self.group_canonical[np.arange(self.num_groups), np.asarray(acts)])

    def _gap_cut(self, left: int, right: int) -> int:
        """Cut ``b`` (``left <= b < right``) between two decided groups with different actions:
        groups ``left+1..b`` follow ``left``, ``b+1..right-1`` follow ``right``. The cut carrying
        the fewest bytes; cuts within ``CUT_TIE`` of it count as equal and the one nearest the
        midpoint is taken."""
        cut = self.boundary_bytes[left:right]
        ok = np.flatnonzero(cut <= cut.min() * (1 + CUT_TIE))
        mid = (right - left) // 2  # the midpoint rule: g follows left iff g - left <= right - g
        return left + int(ok[np.argmin(np.abs(ok - mid))])

    def group_plan(self, g: int, a: int) -> GroupPlan:
        """The :class:`GroupPlan` of action ``a`` for group ``g`` (cached)."""
        key = (g, a)
        gp = self._cache.get(key)
        if gp is None:
            gp = self._materialise(g, self.actions[a])
            self._cache[key] = gp
        return replace(gp, devices=list(gp.devices), shares=list(gp.shares), sfb=list(gp.sfb),
                       mp_splits=None if gp.mp_splits is None else list(gp.mp_splits))  # (shard, offload kept)

    def group_plans(self, actions) -> list[GroupPlan]:
        """Group plans of a full action tuple."""
        return [self.group_plan(g, int(a)) for g, a in enumerate(actions)]

    def _materialise(self, g: int, act: Action) -> GroupPlan:
        return get_strategy(act.sync).search_plan(self, g, act.devices, act.tp)

    @cached_property
    def model_time(self) -> np.ndarray:
        """[D] seconds of every group (fwd + bwd + opt, full batch) on each device."""
        return self.costs.group_time_full.sum(axis=0)

    # ------------------------------------------------------------------ plan-level decisions
    def _plan_options(self) -> dict[str, list]:
        """Stage counts of the ``stages`` decision (1: no pipeline, the per-group decisions
        follow); empty when no pipeline fits (one device, one op-group, no cost model)."""
        n, k, b = self.num_devices, self.num_groups, self.graph.batch_size
        if self.cost_model is None or n < 2 or k < 2:
            return {}
        stages = [1] + [p for p in range(2, min(n, k) + 1) if n % p == 0 and n // p <= b]
        return {"stages": stages[: self.num_actions]} if len(stages) > 1 else {}

    def options(self, name: str, stages: int, stage_sync: int = 1) -> list:
        """Options of plan-level decision ``name`` for a pipeline of ``stages`` stages (placed
        machine-major, ``D / stages`` devices each, as :func:`tag.parallel.layout.layout_plan`
        places them) whose stages are deployed as ``stage_sync`` (1: data parallel, else the
        tensor-parallel degree; decided before the micro-batch count). ``micro``: counts of
        :data:`~tag.parallel.layout.MICRO_BATCHES` giving every replica a sample (a replica of a
        tensor-parallel stage is ``stage_sync`` devices sharing its samples, as in the layout grid:
        ``dp=4,tp=4,pp=4,micro=16`` on 64 devices with a batch of 64); ``stage_sync``: 1 (data parallel) or a tensor-parallel degree dividing a
        stage's devices, where enough stage cuts fall between Megatron blocks; ``schedule``:
        every registered schedule's searched ``(schedule, k)``
        (:func:`~tag.parallel.pipeline.searched_schedules`); ``cut``: ``time`` or ``memory``. At most :attr:`num_actions`
        options each (the tree's width)."""
        if name == "stages":
            return self.plan_options.get("stages", [1])
        w = self.num_devices // stages
        if name == "micro":
            out = [m for m in MICRO_BATCHES if m * (w // stage_sync) <= self.graph.batch_size]
        elif name == "stage_sync":  # (every stage at one degree: executed too, tag.parallel.execution_refusal)
            out = [1] + [t for t in self.tp_degrees if w % t == 0 and len(self._aligned) >= stages]
        elif name == "schedule":
            out = searched_schedules()
        elif name == "cut":
            out = ["time", "memory"]
        else:
            raise ValueError(f"plan decision: expected one of {PLAN_DECISIONS}, got {name!r}")
        return out[: self.num_actions]

    def options_at(self, name: str, chosen: dict | None) -> list:
        """:meth:`options` of decision ``name`` after the plan-level ``chosen`` so far."""
        chosen = chosen or {}
        return self.options(name, chosen.get("stages", 1), chosen.get("stage_sync", 1))

    @cached_property
    def _aligned(self) -> set[int]:
        return aligned_cuts(self.graph)

    def default_option(self, name: str, stages: int, stage_sync: int = 1) -> int:
        """Index of a plan-level decision's default where nothing else decides it: no pipeline;
        ``2 x stages`` micro-batches (or the most that fit); 1F1B; the cut and each stage's
        deployment are chosen together by :meth:`pipeline_key` (the first of time-cut data parallel,
        time-cut tensor parallel at rising degrees, then the same cut by memory, whose estimated
        memory fits), index 0 here."""
        if name != "micro":
            return 0
        opts = self.options("micro", stages, stage_sync)
        fit = [i for i, m in enumerate(opts) if m <= 2 * stages]
        return fit[-1] if fit else 0

    def _estimated_fit(self, key: tuple) -> bool:
        """Whether every device of a pipeline key's plan holds its stage's state and in-flight
        activations by a static estimate (:func:`tag.cost.baselines.group_footprints` at a
        device's samples per micro-batch, times the micro-batches the schedule keeps alive on the
        stage, :func:`tag.parallel.pipeline.iteration_program`'s ``flight``: GPipe all of them;
        the state of tensor-parallel stages divided by the degree): a guess for the defaults, the
        simulator decides. A function of the key (cached: the plan head's option features ask
        again for the keys the search's paths complete to)."""
        fit = self._fits.get(key)
        if fit is None:
            fit = self._fits[key] = self._estimate_fit(key)
        return fit

    def _estimate_fit(self, key: tuple) -> bool:
        plan = self.pipeline_plan(key, copy=False)
        if plan is None:
            return False
        groups, pipe = plan
        p, m, t = key.stages, key.micro, key.tp
        b = -(-self.graph.batch_size // (m * (self.num_devices // p)))  # samples per device per micro-batch
        if b not in self._footprints:
            self._footprints[b] = np.array(group_footprints(self.graph, b))
        total = self._footprints[b]
        held = self._held
        bounds = list(pipe.stages) + [self.num_groups]
        flight = iteration_program(pipe, self.graph.batch_size, self.num_groups).flight
        for s, lo in enumerate(pipe.stages):
            hi = bounds[s + 1]
            need = held[lo:hi].sum() / t + flight[s] * (total[lo:hi] - held[lo:hi]).sum()
            if need > min(self.topology.devices[d].gpu.memory_bytes for d in groups[lo].devices):
                return False
        return True

    @cached_property
    def _held(self) -> np.ndarray:
        """[K] parameter, gradient and optimizer-state bytes of each group."""
        return np.array(group_footprints(self.graph, 0))

    def decision_at(self, path) -> tuple[str, int] | None:
        """What a node reached by ``path`` (action indices from the root) decides next:
        ``("plan", i)`` for plan-level decision ``PLAN_DECISIONS[i]``, ``("group", g)`` for op-group
        ``g``, None when nothing is left (a complete plan).

        Without plan-level decisions (:attr:`plan_options` empty) the path decides op-groups in
        :attr:`order`, as TAG does. With them the first decision is the stage count; one stage
        (no pipeline, the default) goes on with the op-groups, more stages with the other
        plan-level decisions and nothing after them (each stage data or tensor parallel as a
        whole, stages cut by :func:`tag.parallel.layout.balanced_cuts`)."""
        d = len(path)
        first = 1 if self.plan_options else 0  # index of the first op-group decision on a path
        if self.executable and d > first and self.is_tp[int(path[first])] and self.stages_of(path) == 1:
            return None  # a tp first decision deploys the whole model (the plan the executor runs)
        if not self.plan_options:
            return ("group", self.order[d]) if d < self.num_groups else None
        if d == 0:
            return ("plan", 0)
        if self.stages_of(path) == 1:
            return ("group", self.order[d - 1]) if d - 1 < self.num_groups else None
        return ("plan", d) if d < len(PLAN_DECISIONS) else None

    def group_mask(self, assign) -> np.ndarray | None:
        """[A] bool: the actions an op-group may take after the decisions of ``assign`` ([K], -1
        undecided), None where every action may. Executable: after a first decision that is not
        ``tp`` no group is ``tp`` (a ``tp`` first decision ends the path, :meth:`decision_at`)."""
        if not self.executable or not self.is_tp.any() or not (np.asarray(assign) >= 0).any():
            return None  # (no tp action: nothing to mask, the searches draw as without the constraint)
        return ~self.is_tp

    def stages_of(self, path) -> int:
        """Stage count chosen on ``path`` (1 while undecided)."""
        if not self.plan_options or not len(path):
            return 1
        opts = self.plan_options["stages"]
        return opts[int(path[0]) % len(opts)]

    def decode(self, path) -> tuple[np.ndarray, dict | None]:
        """``(assign [K], pipeline choices)`` of a path: the op-groups' actions (-1 undecided), and
        for a pipeline the value of each plan-level decision made (None: no pipeline)."""
        assign = np.full(self.num_groups, -1, np.int64)
        p = self.stages_of(path)
        if p == 1:
            groups = path[1:] if self.plan_options else path
            for i, a in enumerate(groups):
                assign[self.order[i]] = a
            return assign, None
        chosen = {"stages": p}
        for i, a in enumerate(path[1:len(PLAN_DECISIONS)], start=1):
            opts = self.options_at(PLAN_DECISIONS[i], chosen)
            chosen[PLAN_DECISIONS[i]] = opts[int(a) % len(opts)]
        return assign, chosen

    def resolve_path(self, path) -> tuple:
        """The key of the complete plan a path leads to (undecided choices take their defaults):
        an action tuple (:meth:`resolve`) or a pipeline key (:meth:`pipeline_key`)."""
        assign, chosen = self.decode(path)
        return self.resolve(assign) if chosen is None else self.pipeline_key(chosen)

    def pipeline_key(self, chosen: dict) -> PipelineChoice:
        """The :class:`PipelineChoice` of plan-level choices, the undecided ones
        from :attr:`pipeline_completion` where set, else defaults filled (:meth:`default_option`; the undecided of cut, stage deployment and micro-batch count: the
        first candidate whose estimated memory fits, :meth:`_estimated_fit`, else the first;
        micro-batch counts from the default up, then down)."""
        if self.pipeline_completion is not None and any(n not in chosen for n in PLAN_DECISIONS):
            chosen = self.pipeline_completion(dict(chosen))
        return self.default_pipeline_key(chosen)

    def default_pipeline_key(self, chosen: dict) -> PipelineChoice:
        """:meth:`pipeline_key` with the fixed defaults whatever :attr:`pipeline_completion` says
        (what the plan head's option features describe: :mod:`tag.gnn.plan_head`)."""
        p = chosen["stages"]
        sched, k = chosen.get("schedule", self.options("schedule", p)[self.default_option("schedule", p)])
        cuts = [chosen["cut"]] if "cut" in chosen else self.options("cut", p)
        syncs = [chosen["stage_sync"]] if "stage_sync" in chosen else self.options("stage_sync", p)

        def micros(t: int) -> list[int]:  # the default, then more (fewer activations at once), then fewer
            if "micro" in chosen:
                return [chosen["micro"]]
            opts = self.options("micro", p, t)
            m0 = opts[self.default_option("micro", p, t)]
            return [m0] + [m for m in opts if m > m0] + [m for m in opts[::-1] if m < m0]

        cands = [PipelineChoice(p, m, t, sched, k, c) for c in cuts for t in syncs for m in micros(t)]
        return next((key for key in cands if self._estimated_fit(key)), cands[0])

    def pipeline_plan(self, key: PipelineChoice, copy: bool = True) -> tuple[list[GroupPlan], PipelinePlan | None] | None:
        """Group plans and pipeline of a pipeline key (:func:`tag.parallel.layout.layout_plan`:
        stages machine-major, cut to balance the slowest stage), None if no such plan exists.
        ``copy=False``: the cached group plans themselves, for a caller that only reads them (on
        512 GPUs a copy is 128 plans of 512 devices and shares)."""
        out = self._pipe_plans.get(key, False)
        if out is False:
            p, m, t, sched, k, cut = key
            w = self.num_devices // p
            if self._plan_template is None:  # the identity fields (graph and topology signatures) once
                self._plan_template = new_plan(self.graph, self.topology, [])
            try:
                plan = layout_plan(self.graph, self.topology,
                                   Layout(dp=w // t, tp=t, pp=p, micro=m, schedule=sched, k=min(k, m), cut=cut),
                                   self.cost_model, template=self._plan_template)
                out = (plan.groups, plan.pipeline)
            except PlanError:
                out = None
            self._pipe_plans[key] = out
        if out is None or not copy:
            return out
        return [GroupPlan(list(g.devices), list(g.shares), g.sync, tp=g.tp) for g in out[0]], out[1]

    def plan_of(self, key: tuple) -> tuple[list[GroupPlan], PipelinePlan | None] | None:
        """Group plans and pipeline (None: no pipeline) of a key; None if it names no plan."""
        if is_pipeline_key(key):
            return self.pipeline_plan(key)
        return self.group_plans(key), None

    def describe_key(self, key: tuple) -> list[str]:
        """Each group's action in words, or the pipeline's layout for a pipeline key."""
        if is_pipeline_key(key):
            p, m, t, sched, k, cut = key
            w = self.num_devices // p
            text = f"dp={w // t},tp={t},pp={p},micro={m},schedule={spell_schedule(sched, k)}"
            return [text + (f",cut={cut}" if cut != "time" else "")]
        return [self.actions[a].describe(self.topology) for a in key]

    def random_path(self, rng: np.random.Generator, depth: int) -> list[int]:
        """A path of up to ``depth`` uniformly random decisions (each among its distinct options:
        plan-level options, or a group's distinct deployments)."""
        path: list[int] = []
        while len(path) < depth:
            nxt = self.decision_at(path)
            if nxt is None:
                break
            kind, i = nxt
            if kind == "plan":
                n = len(self.options_at(PLAN_DECISIONS[i], self.decode(path)[1]))
                path.append(int(rng.integers(n)))
            else:  # equivalent actions collapse in resolve
                mask = self.group_mask(self.decode(path)[0]) if self.executable else None
                path.append(int(rng.integers(self.num_actions)) if mask is None
                            else int(rng.choice(np.flatnonzero(mask))))
        return path

    @property
    def max_depth(self) -> int:
        """Most decisions on a path."""
        return self.num_groups + (1 if self.plan_options else 0)

    def server_of(self, devices: tuple[int, ...]) -> int:
        """The parameter server of a subset: its device with the most bandwidth to the others (the
        first of equals); a function of the subset alone, so computed once per subset."""
        server = self._servers.get(devices)
        if server is None:
            devs = list(devices)
            sub = np.array(self.comm.bandwidth[np.ix_(devs, devs)])  # [n, n] bytes/s
            np.fill_diagonal(sub, 0.0)
            score = sub.sum(axis=1)
            server = self._servers[devices] = devs[int(np.argmax(score - 1e-12 * np.arange(len(devs))))]
        return server


class PipelineChoice(NamedTuple):
    """The plan-level pipeline decisions of a searched plan: its key (:meth:`ActionSpace.pipeline_key`;
    any other plan is keyed by its action tuple), realised by :meth:`ActionSpace.pipeline_plan` as the
    layout ``dp=devices/(stages*tp),tp,pp=stages,micro,schedule,k,cut``."""

    stages: int
    """Pipeline stages (>= 2), each on ``devices / stages`` devices."""
    micro: int
    """Micro-batches an iteration."""
    tp: int
    """Tensor-parallel degree inside every stage (1: each stage data parallel)."""
    schedule: str
    """Pipeline schedule (:func:`tag.parallel.pipeline.searched_schedules`: ``1f1b``, ``gpipe``, ``kfkb``)."""
    k: int
    """Micro-batches a ``kfkb`` step runs forward then backward (capped at ``micro``)."""
    cut: str
    """How stage boundaries are placed: ``time`` (balance the slowest stage) or ``memory``."""


def is_pipeline_key(key) -> bool:
    """Whether a plan key is a pipeline's (:class:`PipelineChoice`), not an action tuple."""
    return isinstance(key, PipelineChoice)


def _block_components(graph) -> list[list[int]]:
    """Runs of op-groups linked by Megatron blocks split over several groups (each of >= 2 groups):
    the groups that must share one ``tp`` deployment when any of them is ``tp``."""
    parent = list(range(graph.num_groups))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for b in megatron_blocks(graph):
        gs = block_groups(graph, b)
        for g in gs[1:]:
            parent[find(g)] = find(gs[0])
    comps: dict[int, list[int]] = {}
    for g in range(graph.num_groups):
        comps.setdefault(find(g), []).append(g)
    return [c for c in comps.values() if len(c) > 1]
