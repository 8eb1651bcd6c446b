"""One rank of an execution: ``python -m tag.executor.worker ARGS.json`` under torchrun, or
:func:`worker_entry` under :func:`torch.distributed.launcher.api.elastic_launch`.

Rank ``i`` is device ``i`` of the topology (machine-major). Every rank rebuilds the workload
from its spec and seed (identical weights and full-batch inputs everywhere), exports the joint
graph at each local batch size it runs, cuts its stages, and walks the global schedule.
Arguments are plain JSON (paths and specs), never pickled models.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from ..io import write_json
from ..parallel import validate_plan
from .profiling import op_table, profiled, table_path
from .runtime import ExecutionError, RankRuntime, export_at
from .strategies import execution_for
from .virtual import local_batch_sizes, needs_global_joint

SECONDARY_EXIT_DELAY_S = 2.0  # seconds a rank that saw a peer vanish waits before exiting


@dataclass
class WorkerArgs:
    """Everything a rank needs; JSON-serialisable."""

    model: str
    batch: int
    optimizer: str
    seed: int
    groups: int
    topology: str
    """Topology file path."""
    plan: str
    """Plan file path."""
    out_dir: str
    """Rank 0 writes ``result.json`` here (and each rank ``params-rank{r}.pt`` if asked)."""
    steps: int = 10
    warmup: int = 3
    backend: str = "gloo"
    """``gloo`` (CPU ranks), ``nccl`` (a GPU a rank) or ``gloo-cuda`` (GPU ranks over gloo,
    :data:`tag.executor.comm.GLOO_CUDA`)."""
    emulate_speed: bool = False
    timeout_s: float = 120.0
    graph: str | None = None
    """Optional pre-captured graph JSON (saves two exports per rank on one machine)."""
    save_params: bool = False
    compile: bool = False
    """Fused segments through ``torch.compile`` (:attr:`tag.executor.runtime.RankRuntime.compiled`)."""
    fault: str | None = None
    """Testing only: ``"RANK:ITER:raise|exit|hang"`` makes that rank fail at that iteration."""
    precision: str = "fp32"
    """fp32, or bf16 / fp16 autocast: every joint graph is exported with its casts."""
    threads: int | None = None
    """Intra-op threads per rank (default: the machine's cores over its ranks)."""
    launcher_pid: int | None = None
    """``tag execute``'s process: the rank exits when it does (:func:`tag.lifetime.die_with`);
    None under torchrun (the rank dies with its parent, the torchrun agent)."""
    bucket_bytes: int | None = None
    """Cap of the gradient buckets (:func:`tag.parallel.buckets.bucket_caps`; None: DDP's)."""
    profile_ops: str | None = None
    """Path prefix of the op tables of one extra iteration (:mod:`tag.executor.profiling`; the
    launcher's ``$TAG_PROFILE_KERNELS``); None: the rank's own environment decides."""
    train: dict | None = None
    """``tag run``: the training run's settings (:class:`tag.executor.train.TrainSpec` as a dict);
    None: ``tag execute``'s timed iterations."""
    adaptive_k: list[int] | None = None
    """``tag execute --adaptive-k``: the kFkB block sizes the ranks choose among between iterations
    (:mod:`tag.executor.adaptive`); None: the plan's schedule throughout."""
    delay: str | None = None
    """Testing only: ``"RANKS:MS[:FROM[:TO]]"`` throttles those ranks' sends
    (:class:`tag.executor.adaptive.Throttle`)."""

    @classmethod
    def load(cls, path: str) -> WorkerArgs:
        return cls(**json.loads(Path(path).read_text()))


def slowdown_factors(topology) -> list[float]:
    """Per-device emulated slowdown: fastest device's FP32 FLOP/s over this device's (>= 1)."""
    flops = [d.gpu.fp32_flops for d in topology.devices]
    return [max(flops) / f for f in flops]


def _load_graph(a: WorkerArgs):
    from ..graph.ir import OpGraph

    if a.graph:
        return OpGraph.from_json(Path(a.graph).read_text())
    from ..graph import capture
    from ..workloads import load_workload

    return capture(load_workload(a.model, batch=a.batch, seed=a.seed), optimizer=a.optimizer,
                   num_groups=a.groups, precision=a.precision).graph


def run_rank(a: WorkerArgs) -> dict:
    """Execute the plan on this rank; returns this rank's measurements."""
    import torch.distributed as dist

    from ..cost.host import demote_threads, pin_cores, tune_malloc
    from ..plan.format import Plan
    from ..topology import load_topology
    from ..workloads import load_workload
    from .comm import GLOO_CUDA, DistComm, all_gather_flat

    tune_malloc()  # the profiles were timed with the same allocator settings
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = a.threads or max(1, (os.cpu_count() or 1) // local_world)
    pinned = None
    if a.backend == "gloo":  # a CPU rank: its own cores, before any thread starts (gloo's inherit them)
        pinned = pin_cores(local_rank, local_world, threads)
    # Load the topology before changing the thread count: a "cpu" device spec is measured
    # (and cached) per thread count, and the plan's topology signature was made with the default.
    topology = load_topology(a.topology)
    torch.set_num_threads(threads)
    if world != topology.num_devices:
        raise ExecutionError(f"world size {world} != {topology.num_devices} devices of topology {topology.name!r}; "
                             "run one rank per device")
    if topology.devices[rank].local_index != local_rank:
        raise ExecutionError(f"rank {rank} has local rank {local_rank} but is device "
                             f"{topology.devices[rank].name}; start machines in topology order with "
                             "--nproc-per-node = their device count")
    graph = _load_graph(a)
    plan = Plan.load(a.plan)
    validate_plan(plan, graph, topology, source=a.plan)
    ex = execution_for(plan, graph)  # a strategy may run it otherwise (tp: a group's devices run its first one's schedule)
    sched = ex.schedule(graph, topology.machine_of, a.bucket_bytes)
    me = ex.lead.get(rank, rank)  # the schedule's device this rank runs as
    hook, members = ex.hook(rank), ex.group_of(rank)  # (members: this rank's group, None outside one)
    if a.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif a.backend == GLOO_CUDA:  # (several ranks may share a GPU)
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    wl = load_workload(a.model, batch=a.batch, seed=a.seed)
    t0 = time.perf_counter()
    joints = {b: export_at(wl.model, wl.make_inputs, b, a.precision) for b in sorted(local_batch_sizes(sched, me))}
    full = None
    if needs_global_joint(sched, me):  # SFB kernels run on the joint graph at the global batch
        full = joints.get(sched.batch_size) or export_at(wl.model, wl.make_inputs, sched.batch_size, a.precision)
    export_s = time.perf_counter() - t0
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in wl.inputs)
    slow = slowdown_factors(topology)[rank] if a.emulate_speed else 1.0
    from ..graph.precision import loss_scale

    # A CPU rank queues its gradient buckets until its compute is done (DistComm.defer_syncs): its
    # segments run on across them; a GPU rank issues each as soon as its gradients exist.
    rt = RankRuntime(me, sched, inputs, joints, a.optimizer, device, slow, global_joint=full,
                     loss_scale=loss_scale(a.precision), cut_at_sync=device.type != "cpu", hook=hook, seed=a.seed,
                     compiled=a.compile)
    comm = DistComm.init(rank, world, a.backend, a.timeout_s, sched, device, ex.shards, me)
    my_group = None
    for devs in ex.groups:  # every rank creates every process group, in the same order
        pg = dist.new_group(devs, timeout=timedelta(seconds=a.timeout_s))
        my_group = pg if rank in devs else my_group
    if hook is not None and members is not None:
        hook.reduce = lambda x: dist.all_reduce(x, group=my_group)
        hook.gather = lambda x: all_gather_flat(x, my_group, len(members))
        hook.machine_of = topology.machine_of
    if hook is not None:
        hook.start(rt)  # (a sharded rank's process groups and shards, before any transfer)
    if rt.scaler is not None and world > 1:  # fp16: every rank steps or none (tag.executor.scaling)
        from .scaling import all_finite

        rt.agree_finite = lambda ok: all_finite(ok, device)
    if pinned:
        demote_threads()  # gloo's threads exist now; only for a rank on cores of its own
    fault = _parse_fault(a.fault)
    if a.train is not None:  # tag run (tag.executor.train)
        from .train import RankContext, train_rank

        return train_rank(a, RankContext(rank, world, topology, graph, plan, sched, rt, comm, device, wl, hook,
                                         members, my_group, fault))
    rss0 = host_memory(reset_peak=True) if device.type == "cpu" else None
    from .adaptive import AdaptiveK, Throttle

    throttle = Throttle.parse(a.delay)
    ada = None if a.adaptive_k is None else AdaptiveK(a.adaptive_k, ex, graph, topology.machine_of, a.bucket_bytes,
                                                      rt, comm)
    iters: list[dict] = []
    timeline: list[list] = []  # [name, category, start s, end s] of the last iteration's steps
    n_iters = a.warmup + a.steps

    def iteration(it: int) -> dict:
        """Run iteration ``it``; its record (seconds, loss); the last timed one fills ``timeline``."""
        comm.barrier(device)  # every rank starts the iteration together
        t_start = time.perf_counter()
        cpu_start = time.thread_time()
        if fault and fault[0] == rank and fault[1] == it:
            _inject(fault[2])
        if throttle is not None:
            comm.link_delay_s = throttle.delay_at(rank, it)
        rt.begin_iteration()
        last = it == n_iters - 1
        walk_schedule(rt, comm, rt.schedule, (lambda st, i, t0: _record(timeline, rt, plan, st, i, t0 - t_start,
                                                                        time.perf_counter() - t_start)) if last else None,
                      ada)
        t0 = time.perf_counter()
        comm.finish_syncs(rt)
        t1 = time.perf_counter()
        rt.update()  # reads the loss: the iteration's one wait for the device
        t2 = time.perf_counter()
        if last:
            timeline.append(["wait syncs", "sync", t0 - t_start, t1 - t_start])
            timeline.append(["opt", "opt", t1 - t_start, t2 - t_start])
        # cpu_s: the main thread's CPU seconds over the iteration (a CPU rank's own work, apart
        # from waits and from time taken by other processes on a shared host)
        out = {"time_s": t2 - t_start, "cpu_s": time.thread_time() - cpu_start, **rt.timer.as_dict(),
               "loss": rt.loss}
        if ada is not None:  # the block size it ran, then the next one's choice (every rank)
            out["k"] = ada.k
            ada.next_k()
            out["next_k"] = ada.last
        return out

    try:  # noqa: SIM105 - see the except clause
        for it in range(n_iters):
            iters.append(iteration(it))
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        mine = {"rank": rank, "device": topology.devices[rank].name, "slowdown": slow, "export_s": export_s,
                "peak_memory_bytes": peak, "iterations": iters, "timeline": timeline,
                "host_peak_growth_bytes": None if rss0 is None else host_memory(peak=True) - rss0,
                "optimizer_state_bytes": optimizer_state_bytes(rt.optimizer),
                "held_state_bytes": held_state_bytes(rt),
                **(hook.state_bytes(rt) if hook is not None else {}),  # (offloaded state: device / host)
                # the last iteration's bytes handed out to send, per destination rank, and all-gathered
                "sent_bytes": {str(comm.peers.get(d, d)): n for d, n in sorted(rt.sent_bytes.items())},
                "gathered_bytes": rt.gathered_bytes,
                "median_time_s": statistics.median(x["time_s"] for x in iters[a.warmup:])}
        if a.save_params:
            save_rank_params(a, rt, hook, members, my_group, rank)
        table = table_path(rank, a.profile_ops)
        if table is not None:  # diagnostics: one more iteration, after every figure and the saved parameters
            with profiled() as probe:
                iteration(n_iters)
            write_json(Path(table), {"rank": rank, "device": str(device), **op_table(probe)})
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            write_json(Path(a.out_dir) / "ranks.json", everyone)
    except BaseException:
        # No orderly teardown: the error must be recorded (worker_entry) before peers notice
        # a closed connection, or theirs would look like the root cause. The process exits.
        raise
    comm.close()
    return mine


def save_rank_params(a: WorkerArgs, rt, hook, members, my_group, rank: int) -> None:
    """``out_dir/params-rank{rank}.pt``: the parameters this rank holds (a tensor-parallel rank:
    gathered from its group, in full)."""
    import torch.distributed as dist

    params = rt.named_params()
    if hook is not None:  # the full parameters, from every member of the rank's group
        parts: list = [(params, hook.param_state())]
        if members is not None:
            parts = [None] * len(members)
            dist.all_gather_object(parts, (params, hook.param_state()), group=my_group)
        params = hook.full_params(parts)
    torch.save(params, Path(a.out_dir) / f"params-rank{rank}.pt")


def walk_schedule(rt, comm, sched, done=None, measure=None) -> None:
    """Run this rank's part of one iteration's schedule steps (after ``rt.begin_iteration()``;
    the queued syncs and the update are the caller's). ``done(step, index, start perf_counter
    second)`` after each step this rank walks; ``measure.step_done`` too
    (:class:`tag.executor.adaptive.AdaptiveK`)."""
    if comm.pack_p2p:
        comm.prepost(rt)
    for i, st in enumerate(sched.steps):
        t0 = time.perf_counter()
        if rt.covers(i):  # a fused segment of local steps (runs at its first step)
            rt.run_segment(i)
        elif st.kind == "compute":
            continue  # not this rank's
        elif st.kind == "transfer":
            comm.transfer(rt, st, i)
        elif st.kind == "sfb":
            comm.sfb(rt, st)
        else:
            comm.sync(rt, st)
        if not rt.covers(i):
            rt.release(i)
        if done is not None:
            done(st, i, t0)
        if measure is not None:
            measure.step_done(st, i, t0)


def host_memory(peak: bool = False, reset_peak: bool = False) -> int:
    """This process's resident bytes (``VmRSS``), or its high-water mark (``VmHWM``) with ``peak``;
    ``reset_peak`` first resets the mark (``/proc/self/clear_refs``; Linux only, 0 elsewhere).

    With the allocator settings of :func:`tag.cost.host.tune_malloc` freed memory stays with the
    process, so the growth of the mark over the iterations is what they needed at their peak on
    top of what existed before (a CPU rank's analogue of ``torch.cuda.max_memory_allocated``)."""
    try:
        if reset_peak:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        field = "VmHWM:" if peak else "VmRSS:"
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith(field))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return 0


def optimizer_state_bytes(opt) -> int:
    """Bytes of the optimizer's state tensors (Adam's moments, SGD's momentum)."""
    if opt is None:
        return 0
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


def held_state_bytes(rt) -> int:
    """Bytes of parameters and gradients a rank holds between iterations: its parameters (a ZeRO-3
    rank's are freed after use: none) and the tensors its optimizer steps besides them (a sharded
    rank's shards, :mod:`tag.executor.sharded`) with their gradients; the optimizer state apart
    (:func:`optimizer_state_bytes`). A tensor in a parameter's storage (a ZeRO-1/2 shard, a view
    of its slice) is not counted twice."""
    held = {id(p) for p in rt.params.values()}
    storages = {p.untyped_storage().data_ptr() for p in rt.params.values() if p.numel()}
    n = sum(p.numel() * p.element_size() for p in rt.params.values())
    if rt.optimizer is not None:
        for group in rt.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in held:
                    own = p.untyped_storage().data_ptr() not in storages
                    n += p.numel() * p.element_size() * (int(own) + (p.grad is not None))
    return n


def _record(timeline: list, rt, plan, st, index: int, start: float, end: float) -> None:
    """Append step ``st`` (schedule index ``index``) to ``timeline`` if this rank took part (CPU
    wall-clock seconds since the iteration began; with CUDA, kernel launch times unless the step
    waited). A fused segment is one entry at its first step (e.g. ``fwd g0-g3 + bwd g3-g0``)."""
    r = rt.rank
    if rt.covers(index):
        name = rt.segment_name(index)
        if name is not None:
            timeline.append([name, "compute", start, end])
        return
    if st.kind in ("compute", "transfer"):
        g, j = st.unit
        name = f"{st.phase} g{g}" + (f".{j}" if rt.schedule.units[st.unit].positions is not None else "")
        if st.kind == "compute" and st.unit in rt.my_units and (st.unit, st.phase) in rt.stages:
            timeline.append([name, st.phase, start, end])
        elif st.kind == "transfer" and any(r in (m.src, m.dst) for m in st.moves):
            timeline.append([f"transfer -> {name}", "transfer", start, end])
    else:
        members = st.collective.members if st.collective is not None else rt.schedule.units[st.unit].devices
        if r in members:
            timeline.append([f"{st.kind} g{st.group}", st.kind, start, end])


def _parse_fault(spec: str | None) -> tuple[int, int, str] | None:
    if not spec:
        return None
    r, it, kind = spec.split(":")
    return int(r), int(it), kind


FAULT_MARK = "tag: injecting fault"
"""Start of the stderr line (in the rank's log) with the wall-clock time a fault was injected at."""


def _inject(kind: str) -> None:
    print(f"{FAULT_MARK} {kind} at {time.time():.3f}", file=sys.stderr, flush=True)
    if kind == "raise":
        raise RuntimeError("injected fault")
    if kind == "exit":
        os.kill(os.getpid(), signal.SIGKILL)  # dies without a word, like a crash or the OOM killer
    if kind == "hang":
        time.sleep(3600)


def worker_entry(args_path: str) -> dict:
    """Entry point of every rank: run, and on failure leave ONE line for the launcher.

    The message goes to the torchelastic error file (the launcher reports it with the rank)
    and to stderr; the full traceback only to stderr (the rank's log file).
    """
    try:
        args = WorkerArgs.load(args_path)
        from ..lifetime import die_with

        die_with(args.launcher_pid)  # no rank outlives a kill -9 of its launcher
        return run_rank(args)
    except BaseException as e:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        from ..cost.host import restore_threads
        from .launch import is_secondary

        ErrorHandler().record_exception(e)
        # The process (and its connections, which tell the peers) ends only once all its threads
        # have exited: gloo's demoted event thread would wait for an idle core on a busy host.
        restore_threads()
        if is_secondary(str(e)):
            # Only a consequence of a peer's failure: let the peer's exit reach the agent first
            # (it reports the first failed process it polls). The agent stops us meanwhile.
            time.sleep(SECONDARY_EXIT_DELAY_S)
        raise


def main(argv: list[str] | None = None) -> int:
    """``python -m tag.executor.worker ARGS.json`` (one rank; started by torchrun)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tag.executor.worker ARGS.json", file=sys.stderr)
        return 2
    worker_entry(argv[0])
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
