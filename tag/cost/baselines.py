"""Baseline plans: data parallel over every device (even shares, or proportional to the datasheet
roofline or to the cost model's device speeds), the best single device and greedy model parallel.
They sit on the cost model (device speeds), so here in :mod:`tag.cost`, above the plan format."""

from __future__ import annotations

from collections.abc import Sequence

from ..plan.format import GroupPlan, Plan, new_plan
from .roofline import Roofline, graph_time


def roofline_speeds(graph, topology) -> list[float]:
    """Iterations/second of the whole graph on each device alone, by the datasheet roofline."""
    return [1.0 / graph_time(graph, Roofline.of(d.gpu)) for d in topology.devices]


def proportional_shares(speeds: Sequence[float]) -> list[float]:
    """Batch shares proportional to device speed (equal finish times when compute-bound)."""
    total = float(sum(speeds))
    return [s / total for s in speeds]


def data_parallel(graph, topology, *, proportional: bool = False, speeds: Sequence[float] | None = None,
                  devices: Sequence[int] | None = None) -> Plan:
    """Every group replicated on ``devices`` (default all; with fewer samples than devices, the
    fastest by ``speeds`` one per sample, in device order: a replica needs a sample, and the plan
    ``tag plan`` reports as its baseline is the one ``tag simulate --baseline dp`` costs),
    gradients all-reduced.

    Args:
        proportional: shares proportional to ``speeds`` (default: :func:`roofline_speeds`)
            instead of even (Horovod-like).
        speeds: per-device speed (any unit; only ratios matter), indexed by global device.
    """
    n = topology.num_devices
    devs = list(range(n)) if devices is None else list(devices)
    sp = None
    if devices is None and graph.batch_size < n:
        sp = roofline_speeds(graph, topology) if speeds is None else list(speeds)
        devs = sorted(sorted(devs, key=lambda d: (-sp[d], d))[:graph.batch_size])
    if proportional:
        sp = sp or (roofline_speeds(graph, topology) if speeds is None else list(speeds))
        shares = proportional_shares([sp[d] for d in devs])
        name = "dp-prop"
    else:
        shares = [1.0 / len(devs)] * len(devs)
        name = "dp"
    groups = [GroupPlan(devices=list(devs), shares=list(shares), sync="allreduce") for _ in graph.groups]
    return new_plan(graph, topology, groups, baseline=name)


# ---------------------------------------------------------------------------------------------
# Baselines built on the cost model's device speeds.
# ---------------------------------------------------------------------------------------------
BASELINES = ("dp", "dp-prop", "single", "mp", "fsdp")


def _costs(graph, topology, costs):
    if costs is not None:
        return costs
    from .model import CostModel

    return CostModel.for_topology(graph, topology)


def cost_model_speeds(graph, topology, costs=None) -> list[float]:
    """Samples/s of each device alone, from the cost model (profiles where present, else roofline)."""
    return _costs(graph, topology, costs).device_speeds()


def group_footprints(graph, batch: int | None = None) -> list[float]:
    """Bytes a device holding group ``g`` on ``batch`` samples (default: the full batch) needs:
    parameters, gradients, optimizer state and the forward activations the backward reads."""
    b = graph.batch_size if batch is None else batch
    out = [0.0] * graph.num_groups
    for p in graph.params:
        out[p.group] += 2 * p.nbytes + p.opt_state_bytes
    for t in graph.tensors:
        if t.producer >= 0 and graph.ops[t.producer].phase == "fwd" and \
                any(graph.ops[c].phase == "bwd" for c in t.consumers):
            out[graph.ops[t.producer].group] += t.nbytes.at(b)
    return out


def check_fits(graph, topology) -> None:
    """Refuse (one-line :class:`OutOfMemoryError`) a model no plan can fit on ``topology``.

    Every plan holds the parameters, gradients and optimizer state somewhere, and the forward
    activations the backward reads of at least one sample at a time (a pipeline of one-sample
    micro-batches keeps no more alive; data and model parallel keep the whole batch's):
    ``sum(group_footprints(graph, 1))``. A model needing more than all the devices' memory
    together fits nowhere; the message names the model's memory and the largest device's, the
    capacity a user most often compares it with. With optimizer offload the devices need only the
    parameters of that state and one group's activations of a sample (recomputation), when the
    machines' host memory holds the state itself.
    """
    from ..errors import OutOfMemoryError
    from ..topology.units import format_bytes

    need = sum(group_footprints(graph, 1))
    caps = [d.gpu.memory_bytes for d in topology.devices]
    if need <= sum(caps):
        return
    state = sum(2 * p.nbytes + p.opt_state_bytes for p in graph.params)
    # optimizer offload (tag.parallel.sharded.offloaded_bytes): the devices keep the parameters
    # (ZeRO-3: sharded), the hosts a copy of them, the gradients and the optimizer state; with
    # recomputation one group's activations of one sample at least
    held = [0.0] * graph.num_groups
    for p in graph.params:
        held[p.group] += 2 * p.nbytes + p.opt_state_bytes
    act = max(f - h for f, h in zip(group_footprints(graph, 1), held))
    params = sum(p.nbytes for p in graph.params)
    if params + act <= sum(caps) and state <= sum(m.host_memory for m in topology.machines):
        return
    # enough digits that the need reads larger than the total (not "at least 128 GiB, more than the 128 GiB")
    digits = next((d for d in range(3, 8) if format_bytes(need, digits=d) != format_bytes(sum(caps), digits=d)), 8)
    raise OutOfMemoryError(
        f"model {graph.model} (batch {graph.batch_size}) needs at least {format_bytes(need, digits=digits)} "
        f"({format_bytes(state, digits=3)} of parameters, gradients and {graph.optimizer} state, the rest the saved "
        f"activations of one sample), more than the {format_bytes(sum(caps), digits=digits)} of all {len(caps)} devices of "
        f"{topology.name} together (largest device {format_bytes(max(caps), digits=3)}), nor does it with the "
        f"optimizer offloaded to the {format_bytes(sum(m.host_memory for m in topology.machines), digits=3)} of host "
        f"memory; no plan fits: use more or larger devices")


def data_parallel_proportional(graph, topology, costs=None) -> Plan:
    """Data parallel over every device, shares proportional to the cost model's device speeds."""
    plan = data_parallel(graph, topology, proportional=True, speeds=cost_model_speeds(graph, topology, costs))
    plan.meta["speeds"] = "cost-model"
    return plan


def best_single_device(graph, topology, costs=None) -> Plan:
    """Everything on the fastest device (by the cost model) whose memory holds the whole model;
    the device with the most memory when none does."""
    c = _costs(graph, topology, costs)
    need = sum(group_footprints(graph))
    n = topology.num_devices
    fits = [d for d in range(n) if topology.devices[d].gpu.memory_bytes >= need]
    pool = fits or [max(range(n), key=lambda d: topology.devices[d].gpu.memory_bytes)]
    best = min(pool, key=lambda d: (c.iteration_time_alone(d), d))
    groups = [GroupPlan([best], [1.0], "allreduce") for _ in graph.groups]
    return new_plan(graph, topology, groups, baseline="single", device=best)


def greedy_model_parallel(graph, topology, costs=None) -> Plan:
    """Groups in topological order fill the devices in index order, each device taking a share of
    the model's memory footprint proportional to its capacity (never more than its capacity when
    avoidable), so every device holds a contiguous slice of the model (no replication)."""
    from ..plan.format import group_positions

    del costs  # placement by memory only
    foot = group_footprints(graph)
    caps = [float(d.gpu.memory_bytes) for d in topology.devices]
    total, cap_total = sum(foot), sum(caps)
    k, n = graph.num_groups, topology.num_devices
    groups: list[GroupPlan] = []
    d, used = 0, 0.0
    for g in range(k):
        target = min(caps[d], total * caps[d] / cap_total)
        left_groups, left_devs = k - g, n - d
        if d < n - 1 and used > 0 and (used + foot[g] > target or left_groups <= left_devs - 1):
            d, used = d + 1, 0.0
        used += foot[g]
        groups.append(GroupPlan([d], [1.0], "mp", None, [group_positions(graph, g)[0]]))
    return new_plan(graph, topology, groups, baseline="mp")


def fully_sharded(graph, topology) -> Plan:
    """FSDP over every device: :func:`data_parallel`'s replicas and even shares, every group ZeRO-3
    (``sync`` ``zero3``, :mod:`tag.parallel.sharded`: parameters, gradients and optimizer state
    sharded over all devices), the recipe most users of PyTorch FSDP2 start from."""
    plan = data_parallel(graph, topology)
    if len(plan.groups[0].devices) > 1:
        for gp in plan.groups:
            gp.sync = "zero3"
    plan.meta["baseline"] = "fsdp"
    return plan


def baseline_plan(name: str, graph, topology, costs=None) -> Plan:
    """``dp`` (even shares), ``dp-prop`` (cost-model speeds), ``single``, ``mp`` or ``fsdp``."""
    if name == "dp":
        return data_parallel(graph, topology)
    if name == "dp-prop":
        return data_parallel_proportional(graph, topology, costs)
    if name == "single":
        return best_single_device(graph, topology, costs)
    if name == "mp":
        return greedy_model_parallel(graph, topology, costs)
    if name == "fsdp":
        return fully_sharded(graph, topology)
    from ..errors import PlanError

    raise PlanError(f"--baseline: expected one of {', '.join(BASELINES)}, got {name!r}")
