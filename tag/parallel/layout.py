"""Megatron-style layouts: ``dp=D,tp=T,pp=P,micro=M[,schedule=S][,k=K]`` as a TAG plan.

Users of Megatron-style trainers describe a run by its degrees: ``D`` data-parallel replicas,
``T``-way tensor parallelism, ``P`` pipeline stages, ``M`` micro-batches. :func:`layout_plan`
builds that plan so it can be simulated and compared with TAG's:

* stages cut the op-groups into ``P`` contiguous runs of about equal compute (the groups' summed
  forward + backward + update seconds on the first device at the full batch; the layer cuts a
  Megatron user balances by hand);
* stage ``s`` runs on devices ``s * D * T .. (s + 1) * D * T - 1`` of the topology's order
  (machine-major: a stage fills machines before the next begins), ``D`` replicas with even
  shares, gradients all-reduced;
* ``M`` micro-batches on schedule ``1f1b`` (default), ``gpipe`` or ``kfkb`` with ``k``.

``D * T * P`` must equal the topology's device count, as in Megatron. Tensor parallelism is not
an action of this version: ``tp`` other than 1 is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError
from ..plan.format import PIPELINE_SCHEDULES, GroupPlan, PipelinePlan, Plan, new_plan


@dataclass(frozen=True)
class Layout:
    """Degrees of a Megatron-style layout (see the module docstring)."""

    dp: int = 1
    """Data-parallel replicas per stage."""
    tp: int = 1
    """Tensor-parallel degree (only 1 in this version)."""
    pp: int = 1
    """Pipeline stages."""
    micro: int = 1
    """Micro-batches per iteration."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``1f1b``, ``gpipe`` or ``kfkb``."""
    k: int = 1
    """Micro-batches per block (``kfkb``)."""

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "micro", "k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"layout: {name}: expected a positive integer, got {v!r}")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise PlanError(f"layout: schedule: expected one of {list(PIPELINE_SCHEDULES)}, got {self.schedule!r}")
        if self.tp != 1:
            raise PlanError(f"layout: tp: tensor parallelism is not an action of this version; expected 1, got {self.tp}")

    @property
    def devices(self) -> int:
        """Devices the layout occupies."""
        return self.dp * self.tp * self.pp


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
        if key == "schedule":
            fields[key] = value
        else:
            try:
                fields[key] = int(value)
            except ValueError:
                raise PlanError(f"layout: {key}: expected a positive integer, got {value!r}") from None
    return Layout(**fields)


def balanced_cuts(seconds: list[float], parts: int) -> list[int]:
    """First index of each of ``parts`` contiguous runs of ``seconds`` with about equal sums
    (each cut where the running sum first reaches ``s / parts`` of the total; every run non-empty)."""
    n = len(seconds)
    if not 1 <= parts <= n:
        raise PlanError(f"layout: pp: expected 1..{n} stages (one op-group at least each), got {parts}")
    total = sum(seconds) or 1.0
    cuts, acc, i = [0], 0.0, 0
    for s in range(1, parts):
        target = total * s / parts
        while i < n and acc + seconds[i] / 2 < target:
            acc += seconds[i]
            i += 1
        lo, hi = cuts[-1] + 1, n - (parts - s)  # leave a group for every later stage
        cuts.append(min(max(i, lo), hi))
        while i < cuts[-1]:
            acc += seconds[i]
            i += 1
    return cuts


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
    if layout.micro > graph.batch_size or layout.dp > graph.batch_size // layout.micro:
        raise PlanError(f"layout: micro: {layout.micro} micro-batches of {layout.dp} replicas need at least "
                        f"{layout.micro * layout.dp} samples, batch is {graph.batch_size}")
    k = graph.num_groups
    seconds = [sum(costs.group_time(g, ph, 0, graph.batch_size) for ph in ("fwd", "bwd", "opt")) for g in range(k)]
    stages = balanced_cuts(seconds, layout.pp)
    bounds = stages + [k]
    groups: list[GroupPlan] = []
    width = layout.dp * layout.tp
    for s in range(layout.pp):
        devs = list(range(s * width, (s + 1) * width))
        groups += [GroupPlan(devs, [1.0 / len(devs)] * len(devs)) for _ in range(bounds[s], bounds[s + 1])]
    plan = new_plan(graph, topology, groups, searcher="layout", layout=_spell(layout))
    if layout.pp > 1 or layout.micro > 1:
        plan.pipeline = PipelinePlan(stages, layout.micro, layout.schedule, layout.k)
    return plan


def _spell(layout: Layout) -> str:
    text = f"dp={layout.dp},tp={layout.tp},pp={layout.pp},micro={layout.micro},schedule={layout.schedule}"
    return text + (f",k={layout.k}" if layout.schedule == "kfkb" else "")


MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
"""Micro-batch counts the layout grid tries (as Megatron users do: powers of two)."""


def layout_grid(graph, topology) -> list[Layout]:
    """Every layout a Megatron/AMP user would search by hand on ``topology``: ``dp * pp`` = the
    device count (``tp`` 1 in this version), ``pp`` up to the op-group count, 1F1B with each
    micro-batch count of :data:`MICRO_BATCHES` that gives every replica a sample (one micro-batch
    without a pipeline)."""
    n, out = topology.num_devices, []
    for pp in range(1, min(n, graph.num_groups) + 1):
        if n % pp:
            continue
        dp = n // pp
        for micro in MICRO_BATCHES if pp > 1 else (1,):
            if micro * dp <= graph.batch_size:
                out.append(Layout(dp=dp, pp=pp, micro=micro))
    return out


def best_layout(graph, topology, costs, simulate) -> tuple[Plan, int]:
    """The fastest plan of :func:`layout_grid` (one that fits in memory if any does; its
    ``predicted_iteration_time_s`` is None if none does) and the number of layouts simulated. ``simulate(plan)`` returns its :class:`~tag.sim.SimResult` (passed in:
    this layer does not import the simulator)."""
    best, best_key, tried = None, None, 0
    for lay in layout_grid(graph, topology):
        plan = layout_plan(graph, topology, lay, costs)
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
