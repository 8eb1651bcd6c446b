"""Run a plan's schedule for every rank inside ONE process (no torch.distributed).

Same runtimes, same schedule as the distributed worker; transfers and gradient syncs are
done by handing tensors between the in-process runtimes. Used to test the semantics of any
plan quickly, and as the single-process reference of training (:func:`reference_training`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from ..graph.ir import OpGraph
from ..graph.precision import autocast, loss_scale
from ..parallel.schedule import Schedule
from ..plan.format import Plan
from .optim import make_optimizer
from .runtime import Joint, RankRuntime, export_at
from .strategies import RankHook, execution_for, thread_gatherers, thread_reducers


def local_batch_sizes(schedule: Schedule, rank: int) -> set[int]:
    """Local batch sizes at which ``rank`` runs some unit (one joint export each; on a pipeline,
    those of every micro-batch)."""
    return {schedule.unit_at(u.key, m).replica_on(rank).batch for u in schedule.units_of(rank)
            for m in range(len(schedule.micro_ranges))}


def needs_global_joint(schedule: Schedule, rank: int) -> bool:
    """Whether ``rank`` replicates an SFB group (its kernels need the joint graph at the global batch)."""
    return any(schedule.units[sg.unit].replica_on(rank) is not None for sg in schedule.sfb.values())


def run_virtual(graph: OpGraph, plan: Plan, workload, optimizer: str, steps: int,
                machine_of=None, joints: dict[int, Joint] | None = None,
                cut_at_sync: bool = False, bucket_bytes: int | None = None, seed: int = 0,
                compiled: bool = False) -> dict[int, RankRuntime]:
    # the joints are exported in ``graph.precision`` (a ``joints`` cache must hold that precision's)
    """Train ``steps`` iterations of ``plan`` with all ranks in this process; returns the runtimes.

    ``joints``: cache of joint graphs by local batch (filled as needed; reuse it across calls
    for the same workload to save exports). ``cut_at_sync``: segments end where a gradient bucket
    is launched, as on a GPU rank (:attr:`RankRuntime.cut_at_sync`). ``bucket_bytes``: the gradient
    buckets' cap (:func:`tag.parallel.buckets.bucket_caps`). ``seed``: every rank's random stream
    (:attr:`RankRuntime.seed`; ``tag execute``'s ``--seed``, so a virtual run draws the dropout
    masks of a real one). ``compiled``: segments run through ``torch.compile``
    (:attr:`RankRuntime.compiled`).
    """
    ex = execution_for(plan, graph)  # a strategy may run it otherwise (tag.executor.strategies)
    sched = ex.schedule(graph, machine_of, bucket_bytes)
    ranks = ex.ranks({r.device for u in sched.units.values() for r in u.replicas}
                     | {m for st in sched.steps if st.collective is not None for m in st.collective.members})
    hooks: dict[int, RankHook | None] = {d: ex.hook(d) for d in ranks}
    for devs in ex.groups:  # a group's ranks sum inside their segments: one thread each
        for d, red, gat in zip(devs, thread_reducers(len(devs)), thread_gatherers(len(devs))):
            if hooks[d] is not None:
                hooks[d].reduce, hooks[d].gather, hooks[d].machine_of = red, gat, machine_of
    shards = ex.shards  # per member index: the schedule's device -> the rank of that index
    joints = {} if joints is None else joints
    runtimes: dict[int, RankRuntime] = {}
    for actual in ranks:
        r = ex.lead.get(actual, actual)
        for b in local_batch_sizes(sched, r):
            if b not in joints:
                joints[b] = export_at(workload.model, workload.make_inputs, b, graph.precision)
        mine = {b: joints[b] for b in local_batch_sizes(sched, r)}
        full = None
        if needs_global_joint(sched, r):
            if sched.batch_size not in joints:
                joints[sched.batch_size] = export_at(workload.model, workload.make_inputs, sched.batch_size,
                                                     graph.precision)
            full = joints[sched.batch_size]
        runtimes[actual] = RankRuntime(r, sched, tuple(workload.inputs), mine, optimizer, global_joint=full,
                                       loss_scale=loss_scale(graph.precision), cut_at_sync=cut_at_sync,
                                       hook=hooks[actual], seed=seed, compiled=compiled)
    pool = ThreadPoolExecutor(len(ranks)) if ex.groups else None  # a group's ranks sum inside their segments
    for _ in range(steps):
        for rt in runtimes.values():
            rt.begin_iteration()
        for i, st in enumerate(sched.steps):
            fused = [rt for rt in runtimes.values() if rt.covers(i)]
            if pool is not None:
                for f in [pool.submit(rt.run_segment, i) for rt in fused]:
                    f.result()
            else:
                for rt in fused:
                    rt.run_segment(i)
            others = {r: rt for r, rt in runtimes.items() if not rt.covers(i)}
            if st.kind == "transfer":  # between the ranks of one member index (each moves its own copy)
                got = []
                for team in ([[others[r] for r in shard.values() if r in others] for shard in shards]
                             if shards else [list(others.values())]):
                    sent = {k: t for rt in team for k, _dst, t in rt.outgoing(st)}
                    got += [(rt, {k: sent[k].clone() for k, _src, _buf in rt.incoming(st)}) for rt in team]
                if pool is not None:  # a group's ranks all-gather scattered pieces: one thread each
                    for f in [pool.submit(rt.assemble, st, pieces) for rt, pieces in got]:
                        f.result()
                else:
                    for rt, pieces in got:
                        rt.assemble(st, pieces)
            elif st.kind == "sfb":  # all-gather = concatenation in sample (plan device) order
                sg = sched.sfb[st.group]
                local = {d: runtimes[d].sfb_local(st.group) for d in sg.devices}
                full = {f.name: torch.cat([local[d][f.name] for d in sg.devices], dim=f.batch_dim)
                        for f in sg.factors}
                for d in sg.devices:
                    runtimes[d].sfb_recompute(st.group, {k: v.clone() for k, v in full.items()})
            elif st.kind == "sync" and (b := sched.launched_at(st)) is not None:  # a bucket's last group
                for shard in shards or [{m: m for m in b.collective.members}]:  # over one member index
                    members = [shard[m] for m in b.collective.members]
                    total = sum(runtimes[m].bucket_flat(b) for m in members)
                    for m in members:
                        runtimes[m].set_bucket_flat(b, total.clone())
            for rt in others.values():
                rt.release(i)
        for rt in runtimes.values():
            rt.update()
    if pool is not None:
        pool.shutdown()
    return runtimes


def reference_training(workload, optimizer: str, steps: int,
                       precision: str = "fp32") -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain single-process eager training on the full batch: (final params, losses).

    ``precision`` bf16 / fp16: the forward runs under ``torch.autocast`` (FP32 parameters and
    optimizer state); fp16 runs ``torch.amp.GradScaler`` from the executor's initial scale
    (:data:`tag.graph.precision.FP16_LOSS_SCALE`; its defaults otherwise, as
    :mod:`tag.executor.scaling`): loss scaled, gradients unscaled before the step, a step with a
    non-finite gradient skipped and the scale halved."""
    model = workload.model
    named = dict(model.named_parameters())
    opt = make_optimizer(optimizer, named.values())
    scale = loss_scale(precision)
    scaler = None if scale == 1.0 else \
        torch.amp.GradScaler(next(iter(named.values())).device.type, init_scale=scale)
    losses = []
    for _ in range(steps):
        with autocast(precision):
            loss = model(*workload.inputs)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    # state_dict also names tied aliases (e.g. GPT-2's lm_head.weight = wte.weight).
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses
