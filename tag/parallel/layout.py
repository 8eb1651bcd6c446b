"""Megatron-style layouts: ``dp=D,tp=T,pp=P,micro=M[,schedule=S][,k=K][,sp=1][,recompute=1]`` as a TAG plan.

Users of Megatron-style trainers describe a run by its degrees: ``D`` data-parallel replicas,
``T``-way tensor parallelism, ``P`` pipeline stages, ``M`` micro-batches. :func:`layout_plan`
builds that plan so it can be simulated and compared with TAG's:

* stages cut the op-groups into ``P`` contiguous runs minimising the slowest stage's compute (a
  group costed on the stage's own devices, its slowest replica, all micro-batches: AMP's
  heterogeneity-aware cut; on one device kind, the balanced layer cuts a Megatron user makes by
  hand), :func:`balanced_cuts`;
* stage ``s`` runs on devices ``s * D * T .. (s + 1) * D * T - 1`` of the topology's order
  (machine-major: a stage fills machines before the next begins), ``D`` replicas with even
  shares, gradients all-reduced; with ``T > 1`` each replica is ``T`` consecutive devices (tensor
  parallel innermost, as Megatron places it; each group on one machine) and every op-group of
  the stage is ``tp`` (:mod:`tag.parallel.tensor_parallel`), the stage cuts falling between
  Megatron blocks; plain Megatron, or with ``sp=1`` Megatron-LM's ``--sequence-parallel``;
* ``M`` micro-batches on schedule ``1f1b`` (default), ``gpipe`` or ``kfkb`` with ``k``; each of
  the ``D`` replicas needs a sample per micro-batch (``M * D <= B``), its ``T`` tensor-parallel
  devices computing the same samples (Megatron-LM runs ``tp=8`` on micro-batches of one sample);
  with ``sp=1`` every device needs one (``M * D * T <= B``: token shards modelled as samples);
* ``cut=memory`` balances the stages' parameters, gradients and optimizer state instead;
* ``recompute=1``: Megatron-LM's ``--recompute-granularity full`` (every op-group recomputes its
  activations, ``GroupPlan.recompute``).

``D * T * P`` must equal the topology's device count, as in Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError
from ..plan.format import PIPELINE_SCHEDULES, GroupPlan, PipelinePlan, Plan, new_plan
from .strategy import execution_refusal
from .tensor_parallel import MAX_DEGREE, aligned_cuts, megatron_blocks

CUTS = ("time", "memory")
"""Stage cuts a layout may ask for (:attr:`Layout.cut`)."""


@dataclass(frozen=True)
class Layout:
    """Degrees of a Megatron-style layout (see the module docstring)."""

    dp: int = 1
    """Data-parallel replicas per stage."""
    tp: int = 1
    """Tensor-parallel degree (devices of one machine per replica)."""
    pp: int = 1
    """Pipeline stages."""
    micro: int = 1
    """Micro-batches per iteration."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``1f1b``, ``gpipe`` or ``kfkb``."""
    k: int = 1
    """Micro-batches per block (``kfkb``)."""
    sp: int = 0
    """1: tensor parallelism with sequence parallelism (``GroupPlan.sequence_parallel``); 0: plain."""
    cut: str = "time"
    """How stages are cut: ``time`` (the slowest stage's compute minimised) or ``memory`` (the
    largest stage's parameters, gradients and optimizer state minimised: what a model too large
    for its devices needs)."""
    recompute: int = 0
    """1: every op-group recomputes its activations (Megatron-LM's full recompute); 0: none."""

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "micro", "k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"layout: {name}: expected a positive integer, got {v!r}")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise PlanError(f"layout: schedule: expected one of {list(PIPELINE_SCHEDULES)}, got {self.schedule!r}")
        if self.cut not in CUTS:
            raise PlanError(f"layout: cut: expected one of {list(CUTS)}, got {self.cut!r}")
        for name in ("sp", "recompute"):
            v = getattr(self, name)
            if v not in (0, 1) or isinstance(v, bool):
                raise PlanError(f"layout: {name}: expected 0 or 1, got {v!r}")
        if self.sp and self.tp == 1:
            raise PlanError("layout: sp: sequence parallelism needs tensor parallelism; expected tp > 1 or sp=0")
        if self.tp > MAX_DEGREE:
            raise PlanError(f"layout: tp: expected a tensor-parallel degree of 1..{MAX_DEGREE}, got {self.tp}")

    @property
    def devices(self) -> int:
        """Devices the layout occupies."""
        return self.dp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """Sample ranges per stage, each needing a sample per micro-batch: the ``dp`` replicas (a
        replica's ``tp`` devices compute the same samples), or with sequence parallelism every
        device (its token shard modelled as its own samples, :mod:`tag.parallel.tensor_parallel`)."""
        return self.dp * self.tp if self.sp else self.dp


def parse_layout(text: str) -> Layout:
    """``"dp=4,pp=2,micro=8,schedule=1f1b"`` -> :class:`Layout` (one-line :class:`PlanError`)."""
    fields: dict[str, object] = {}
    known = Layout.__dataclass_fields__
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not key:
            raise PlanError(f"layout: {part.strip()!r}: expected key=value (e.g. dp=4,pp=2,micro=8)")
        if key not in known:
            raise PlanError(f"layout: {key}: unknown key; expected one of {list(known)}")
        if key in fields:
            raise PlanError(f"layout: {key}: given twice")
        if key in ("schedule", "cut"):
            fields[key] = value
        else:
            try:
                fields[key] = int(value)
            except ValueError:
                what = "0 or 1" if key in ("sp", "recompute") else "a positive integer"
                raise PlanError(f"layout: {key}: expected {what}, got {value!r}") from None
    return Layout(**fields)


def balanced_cuts(seconds, parts: int | None = None, allowed: set[int] | None = None) -> list[int]:
    """First group of each stage of the contiguous cut minimising the slowest stage (exact, by
    dynamic programming over cut points, ``O(parts x K^2)``).

    ``seconds``: one list of per-group seconds shared by every stage, with ``parts`` stages; or
    one list per stage (``seconds[s][g]``: group ``g``'s seconds if stage ``s`` runs it; stages
    on different devices cost a group differently: AMP's heterogeneity-aware cut). Every stage
    gets at least one group; ties go to the earliest cut. ``allowed``: the groups a stage may
    start at (default any)."""
    per_stage = [list(x) for x in seconds] if parts is None else [list(seconds)] * parts
    P = len(per_stage)
    n = len(per_stage[0]) if P else 0
    if not 1 <= P <= n:
        raise PlanError(f"layout: pp: expected 1..{n} stages (one op-group at least each), got {P}")
    prefix = []
    for row in per_stage:
        acc = [0.0]
        for x in row:
            acc.append(acc[-1] + x)
        prefix.append(acc)
    INF = float("inf")
    # best[s][j]: the slowest of stages 0..s when they cover groups [0, j); cut[s][j]: stage s's start
    best = [[INF] * (n + 1) for _ in range(P)]
    cut = [[0] * (n + 1) for _ in range(P)]
    for j in range(1, n - P + 2):
        best[0][j] = prefix[0][j]
    for s in range(1, P):
        ps = prefix[s]
        for j in range(s + 1, n - (P - 1 - s) + 1):
            b, c = INF, s
            for i in range(s, j):
                if allowed is not None and i not in allowed:
                    continue
                v = best[s - 1][i]
                w = ps[j] - ps[i]
                if w > v:
                    v = w
                if v < b:
                    b, c = v, i
            best[s][j], cut[s][j] = b, c
    if best[P - 1][n] == INF:
        raise PlanError(f"layout: pp: no cut of the op-groups into {P} stages between Megatron blocks; "
                        "expected fewer stages or more op-groups")
    cuts, j = [], n
    for s in range(P - 1, 0, -1):
        j = cut[s][j]
        cuts.append(j)
    return [0] + cuts[::-1]


def check_devices(layout: Layout, topology) -> None:
    """One-line :class:`PlanError` unless the layout occupies exactly the topology's devices."""
    n = topology.num_devices
    if layout.devices != n:
        raise PlanError(f"layout: dp*tp*pp = {layout.dp}*{layout.tp}*{layout.pp} = {layout.devices} devices, "
                        f"but topology {topology.name!r} has {n}; expected a product of {n}")


def layout_plan(graph, topology, layout: Layout, costs) -> Plan:
    """The plan of ``layout`` for ``graph`` on ``topology`` (module docstring); ``costs``: the
    :class:`~tag.cost.CostModel` that balances the stages."""
    check_devices(layout, topology)
    width = layout.dp * layout.tp
    replicas = layout.replicas
    if layout.micro > graph.batch_size or replicas > graph.batch_size // layout.micro:
        over = f"dp*tp = {replicas} token shards" if layout.sp else f"dp = {replicas} replicas"
        raise PlanError(f"layout: micro: {layout.micro} micro-batches over {over} need at least "
                        f"{layout.micro * replicas} samples, batch is {graph.batch_size}")
    if layout.tp > 1 and not megatron_blocks(graph):
        raise PlanError(f"layout: tp: model {graph.model!r} has no Megatron block (column- then row-parallel "
                        "matmuls) to split; expected tp=1")
    k = graph.num_groups
    stage_devices = [list(range(s * width, (s + 1) * width)) for s in range(layout.pp)]
    allowed = aligned_cuts(graph) if layout.tp > 1 else None
    if layout.cut == "memory":  # bytes held for good per group, the same on every stage
        held = [0.0] * k
        for p in graph.params:
            held[p.group] += 2 * p.nbytes + p.opt_state_bytes
        stages = balanced_cuts(held, layout.pp, allowed)
    else:  # a device costed at ceil(B / (micro * dp * tp)) samples per micro-batch (a tp device computes
        # 1/tp of its replica's B / (micro * dp) samples in the blocks; at least one: a balancing proxy)
        per_replica = -(-graph.batch_size // (layout.micro * width))
        stages = balanced_cuts([[layout.micro * max(sum(costs.group_time(g, ph, d, per_replica) for ph in ("fwd", "bwd"))
                                                    + costs.group_time(g, "opt", d, per_replica) / layout.micro
                                                    for d in devs)
                                 for g in range(k)] for devs in stage_devices], allowed=allowed)
    bounds = stages + [k]
    groups: list[GroupPlan] = []
    tp = dict(sync="tp", tp=layout.tp, sequence_parallel=bool(layout.sp)) if layout.tp > 1 else {}
    for s, devs in enumerate(stage_devices):
        groups += [GroupPlan(devs, [1.0 / len(devs)] * len(devs), recompute=bool(layout.recompute), **tp)
                   for _ in range(bounds[s], bounds[s + 1])]
    plan = new_plan(graph, topology, groups, searcher="layout", layout=_spell(layout))
    if layout.pp > 1 or layout.micro > 1:
        plan.pipeline = PipelinePlan(stages, layout.micro, layout.schedule, layout.k)
    return plan


def _spell(layout: Layout) -> str:
    text = f"dp={layout.dp},tp={layout.tp},pp={layout.pp},micro={layout.micro},schedule={layout.schedule}"
    return text + (f",k={layout.k}" if layout.schedule == "kfkb" else "") + (",sp=1" if layout.sp else "") + \
        (f",cut={layout.cut}" if layout.cut != "time" else "") + (",recompute=1" if layout.recompute else "")


MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
"""Micro-batch counts the searches' pipeline decision offers (as Megatron users do: powers of two)."""

GRID_MICRO_BATCHES = MICRO_BATCHES + (64,)
"""Micro-batch counts the layout grid tries: also 64, Megatron-LM's micro-batch of one sample on
``dp=8,tp=8`` over a batch of 512 (a tensor-parallel replica needs one sample, not ``tp``)."""


def tp_degrees(graph, topology) -> list[int]:
    """Tensor-parallel degrees a layout may use: 1, and each of 2, 4, 8 dividing every machine's
    device count (so that consecutive groups of ``T`` devices stay on one machine) and every
    Megatron block's split features and heads."""
    blocks = megatron_blocks(graph)
    sizes = [len(topology.devices_of_machine(m)) for m in range(topology.num_machines)]
    return [1] + [t for t in (2, 4, 8) if t <= MAX_DEGREE and blocks and all(s % t == 0 for s in sizes)
                  and all(b.features % t == 0 and (b.heads is None or b.heads % t == 0) for b in blocks)]


def layout_grid(graph, topology) -> list[Layout]:
    """Every layout a Megatron/AMP user would search by hand on ``topology``: ``dp * tp * pp`` =
    the device count, ``tp`` of :func:`tp_degrees`, ``pp`` up to the op-group count (stage cuts
    between Megatron blocks when ``tp > 1``), 1F1B with each micro-batch count of
    :data:`GRID_MICRO_BATCHES` that gives every replica a sample (one micro-batch without a pipeline),
    stages cut by time and by memory, tensor parallelism with and without sequence parallelism,
    each without and with full activation recomputation."""
    n, out = topology.num_devices, []
    aligned = len(aligned_cuts(graph))
    for tp in tp_degrees(graph, topology):
        for pp in range(1, min(n, graph.num_groups if tp == 1 else aligned) + 1):
            if n % (pp * tp):
                continue
            dp = n // (pp * tp)
            for micro in GRID_MICRO_BATCHES if pp > 1 else (1,):
                for sp in (0, 1) if tp > 1 else (0,):
                    lay = [Layout(dp=dp, tp=tp, pp=pp, micro=micro, cut=c, sp=sp, recompute=rc)
                           for c in (CUTS if pp > 1 else CUTS[:1]) for rc in (0, 1)]
                    if micro * lay[0].replicas <= graph.batch_size:
                        out += lay
    return out


def best_layout(graph, topology, costs, simulate, *, executable: bool = False) -> tuple[Plan, int]:
    """The fastest plan of :func:`layout_grid` (one that fits in memory if any does; its
    ``predicted_iteration_time_s`` is None if none does) and the number of layouts simulated.
    ``simulate(plan)`` returns its :class:`~tag.sim.SimResult` (passed in: this layer does not
    import the simulator). ``executable``: only the layouts the executor runs
    (:func:`tag.parallel.execution_refusal`: no sequence parallelism, no pipeline of ``tp`` stages)."""
    best, best_key, tried = None, None, 0
    for lay in layout_grid(graph, topology):
        plan = layout_plan(graph, topology, lay, costs)
        if executable and execution_refusal(plan, graph) is not None:
            continue
        res = simulate(plan)
        tried += 1
        key = (bool(res.oom), res.iteration_time_s)
        if best_key is None or key < best_key:
            best, best_key = plan, key
    if best is None:
        raise PlanError(f"layout: no layout of {topology.num_devices} devices fits batch {graph.batch_size}")
    best.predicted_iteration_time_s = None if best_key[0] else best_key[1]  # None: out of memory
    best.meta["searcher"] = "dp-tp-pp-grid"
    return best, tried
