"""Launch a plan on one machine: one process per topology device, via torchrun's machinery.

``execute(cfg)`` captures the graph once, checks the plan (model, topology, memory), writes the
workers' arguments as JSON into a run folder, and starts one rank per device with
``elastic_launch`` (the library behind ``torchrun``): gloo on CPUs, NCCL with one GPU per rank.
When a rank raises or dies, the elastic agent stops the others and raises ``ChildFailedError``;
it becomes ONE line naming the rank and the cause (:class:`ExecutionError`).

Across machines, run the same worker under ``torchrun`` on every machine (docs/executor.md).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import Interrupted, OutOfMemoryError, PlanError, TagError
from ..io import check_folder, read_json, write_json
from ..parallel import validate_plan
from ..topology.catalog import CPU_NAME
from .adaptive import Throttle, allowed_ks
from .comm import GLOO_CUDA
from .profiling import ENV as PROFILE_ENV
from .runtime import ExecutionError
from .worker import WorkerArgs, worker_entry

log = logging.getLogger(__name__)


@dataclass
class ExecuteConfig:
    """What to run and how (CLI ``tag execute``)."""

    model: str
    topology: str
    plan: str
    batch: int | None = None
    """Global batch; default: the plan's."""
    optimizer: str = "adam"
    seed: int = 0
    groups: int | None = None
    """Op-groups; default: the plan's number of groups."""
    steps: int = 10
    warmup: int = 3
    backend: str = "auto"
    """``gloo``, ``nccl`` or ``auto`` (NCCL when there are GPUs for every rank, else gloo); from
    Python also ``gloo-cuda`` (:data:`tag.executor.comm.GLOO_CUDA`: every rank on this machine's
    GPUs, several to a GPU, over gloo; the GPU check's multi-rank plans on one GPU)."""
    emulate_speed: bool = False
    timeout_s: float = 120.0
    """Bound on any blocked communication and on rendezvous."""
    run_dir: str | None = None
    """Where workers write results, logs and trace.json (default: a fresh temporary folder, removed
    after a successful run and kept after a failure, for its logs)."""
    save_params: bool = False
    check_memory: bool = True
    compile: bool = False
    """Every rank runs its fused segments through ``torch.compile`` (Inductor; ``--compile``)."""
    profile_dir: str | None = None
    """Profile database the prediction is costed with (default: ``$TAG_PROFILE_DIR`` or
    ``data/profiles``). CPU profiles are only valid on the machine that measured them."""
    fault: str | None = None
    """Testing only (see :class:`WorkerArgs`)."""
    precision: str | None = None
    """fp32, or bf16 / fp16 autocast (:mod:`tag.graph.precision`; fp16 with loss scaling);
    None: the plan's."""
    threads: int | None = None
    """Intra-op threads per CPU rank (default: the machine's cores over its ranks; the prediction
    is costed for the default)."""
    bucket_bytes: int | None = None
    """Cap of the gradient buckets (:func:`tag.parallel.buckets.bucket_caps`; default DDP's); the
    prediction is costed with the same."""
    adaptive_k: bool = False
    """A pipelined plan's kFkB block size chosen between iterations from the measured transfers
    (:mod:`tag.executor.adaptive`; ``--adaptive-k``)."""
    delay: str | None = None
    """Testing only: one rank's sends throttled (:class:`tag.executor.adaptive.Throttle`)."""


@dataclass
class ExecuteResult:
    """Measured (and predicted) iteration times of one plan."""

    model: str
    topology: str
    plan: str
    backend: str
    world_size: int
    steps: int
    warmup: int
    measured_iteration_time_s: float
    """Median over post-warm-up iterations of the slowest rank's time (barrier to barrier)."""
    predicted_iteration_time_s: float | None
    """The simulator's prediction for the same plan (None if unavailable)."""
    per_rank_median_s: list[float]
    losses: list[float]
    """Full-batch loss per iteration (sum over loss-unit replicas of b_i/B x their mean)."""
    ranks: list[dict] = field(repr=False, default_factory=list)
    run_dir: str = ""
    """The run folder; empty when it was a temporary one, removed after success."""
    idle_machines: list[str] = field(default_factory=list)
    """Machines of the topology holding no device of the plan: no rank ran there
    (:func:`on_used_machines`)."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Prepared:
    """A checked plan's topology, backend and prediction, and the run folder's worker files."""

    topology: object
    """The machines the plan uses (:func:`on_used_machines`)."""
    backend: str
    sim_res: object
    run_dir: Path
    args_path: Path
    idle: list[str]
    """Names of the topology's machines the plan leaves idle."""


def on_used_machines(plan, topology):
    """``(plan, topology, idle machine names)``: where the plan leaves whole machines without a
    device (a sub-cluster's layout, :func:`tag.search.layouts.subcluster_search`; a search's plan on
    some machines), the plan moved onto the machines it uses
    (:meth:`tag.topology.Topology.restricted`, :meth:`tag.plan.Plan.on_topology`), so that ranks are
    launched there only: one machine runs locally, no torchrun command for the idle ones. The
    simulated iteration is the same. A plan naming a device the topology lacks is returned as it is
    (its validation says so)."""
    n = topology.num_devices
    if any(not (isinstance(d, int) and 0 <= d < n) for g in plan.groups for d in g.named_devices()):
        return plan, topology, []
    used = plan.used_machines(topology)
    if len(used) == topology.num_machines:
        return plan, topology, []
    sub, devices = topology.restricted(used)
    idle = [m.name for k, m in enumerate(topology.machines) if k not in used]
    return plan.on_topology(sub, {d: i for i, d in enumerate(devices)}), sub, idle


PLAN_GROUPS = 48
"""``tag plan``'s default ``--groups`` (:func:`tag.cli.common.add_model_args`)."""


def _planned_groups(graph, plan, groups: int) -> int:
    """The op-group count to ask for so that ``graph`` (captured) is grouped as ``plan``'s was: a
    model with fewer costly ops than ``tag plan`` asked for (48 by default) has fewer groups, and
    asking for that smaller count groups it otherwise (2026-11-29: README.md's 2-layer MLP factory
    asked for 48 has 8 groups, asked for 8 another 8). ``graph`` is regrouped in place; ``groups``
    when neither matches
    (:func:`tag.parallel.validate_plan` then names the mismatch)."""
    from ..graph.grouping import group_ops

    if groups < PLAN_GROUPS:
        group_ops(graph, PLAN_GROUPS)
        if graph.signature() == plan.graph_signature:
            return PLAN_GROUPS
        group_ops(graph, groups)
    return groups


def _prepare(cfg: ExecuteConfig, graph, *, machines: bool) -> _Prepared:
    """Check ``cfg`` (plan against model, topology and memory), capture the graph (unless given),
    predict, and write the workers' files into the run folder (``graph.json``, ``topology.json``,
    ``args.json``; with ``machines``, for ranks on several machines, also ``plan.json``, so that
    the run folder alone is what every machine needs)."""
    from ..graph import capture
    from ..plan.format import Plan
    from ..topology import load_topology
    from ..workloads import load_workload

    if not (isinstance(cfg.timeout_s, (int, float)) and 0 < cfg.timeout_s < math.inf):
        raise TagError(f"--timeout: expected a positive, finite number of seconds, got {cfg.timeout_s!r}")
    if cfg.steps < 1 or cfg.warmup < 0:
        raise TagError(f"--steps/--warmup: expected steps >= 1 and warmup >= 0, got {cfg.steps}/{cfg.warmup}")
    if cfg.run_dir is not None:
        check_folder(cfg.run_dir, TagError, "--run-dir")
    topology = load_topology(cfg.topology)
    plan = Plan.load(cfg.plan)
    if plan.model != cfg.model.strip() and load_workload(cfg.model, batch=1).name != plan.model:
        raise PlanError(f"{cfg.plan}: model: plan is for {plan.model!r}, not --model {cfg.model!r}")
    if plan.topology_signature != topology.signature():
        raise PlanError(f"{cfg.plan}: topology: plan is for topology {plan.topology!r} "
                        f"({plan.topology_signature}), not {cfg.topology} ({topology.name!r}, "
                        f"{topology.num_devices} devices)")
    plan, topology, idle = on_used_machines(plan, topology)
    backend = _machines_backend(cfg.backend, topology) if machines else _backend(cfg.backend, topology)
    batch = cfg.batch or plan.batch_size
    groups = cfg.groups or len(plan.groups)
    if graph is None:
        wl = load_workload(cfg.model, batch=batch, seed=cfg.seed)
        graph = capture(wl, optimizer=cfg.optimizer, num_groups=groups, precision=cfg.precision or plan.precision).graph
        if cfg.groups is None and graph.signature() != plan.graph_signature:
            groups = _planned_groups(graph, plan, groups)
    validate_plan(plan, graph, topology, source=cfg.plan)
    sim_res = _predict(graph, topology, plan, cfg.check_memory, cfg.profile_dir, cfg.bucket_bytes, cfg.compile)
    Throttle.parse(cfg.delay)  # (a bad spec refused here, in one line)
    ks = allowed_ks(graph, topology, plan, profile_dir=cfg.profile_dir, compiled=cfg.compile,
                    bucket_bytes=cfg.bucket_bytes, check_memory=cfg.check_memory) if cfg.adaptive_k else None
    if not machines:
        _check_devices_here(topology, backend, cfg.emulate_speed)

    run_dir = Path(cfg.run_dir or tempfile.mkdtemp(prefix="tag-execute-")).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "ranks.json").unlink(missing_ok=True)
    graph_path, args_path = run_dir / "graph.json", run_dir / "args.json"
    graph_path.write_text(graph.to_json())
    # Ranks read the resolved topology (shipped names work; a measured CPU spec stays identical).
    topo_path = run_dir / "topology.json"
    write_json(topo_path, topology.to_dict())
    plan_path = Path(cfg.plan).resolve()
    if machines or idle:  # (on the machines it uses: not the file given)
        plan_path = run_dir / "plan.json"
        plan.save(plan_path)
    wargs = WorkerArgs(model=cfg.model, batch=batch, optimizer=cfg.optimizer, seed=cfg.seed, groups=groups,
                       topology=str(topo_path), plan=str(plan_path),
                       out_dir=str(run_dir), steps=cfg.steps, warmup=cfg.warmup, backend=backend,
                       emulate_speed=cfg.emulate_speed, timeout_s=cfg.timeout_s, graph=str(graph_path),
                       save_params=cfg.save_params, fault=cfg.fault, threads=cfg.threads,
                       launcher_pid=None if machines else os.getpid(), precision=graph.precision,
                       bucket_bytes=cfg.bucket_bytes, profile_ops=os.environ.get(PROFILE_ENV), compile=cfg.compile,
                       adaptive_k=ks, delay=cfg.delay)
    write_json(args_path, asdict(wargs))
    return _Prepared(topology, backend, sim_res, run_dir, args_path, idle)


def execute(cfg: ExecuteConfig, graph=None) -> ExecuteResult:
    """Run ``cfg.plan`` for real; raises a one-line :class:`TagError` on bad input or failure.

    ``graph``: the captured :class:`OpGraph` of ``cfg.model`` if the caller has it (saves a capture).
    """
    pre = _prepare(cfg, graph, machines=False)
    _launch(pre.topology.num_devices, pre.args_path, pre.run_dir, cfg.timeout_s,
            "spawn" if pre.backend in ("nccl", GLOO_CUDA) else "forkserver")
    res = _result(cfg, pre.backend, pre.sim_res, pre.run_dir)
    res.idle_machines = pre.idle
    if cfg.run_dir is None:  # our temporary folder: removed after success (kept on failure: its logs)
        shutil.rmtree(pre.run_dir, ignore_errors=True)
        res.run_dir = ""
    return res


def _result(cfg: ExecuteConfig, backend: str, sim_res, run_dir: Path) -> ExecuteResult:
    """The finished run's result (``ranks.json``), and its trace beside it."""
    ranks = _read_ranks(run_dir)
    write_json(run_dir / "trace.json", chrome_trace(sim_res, ranks), indent=None)
    return summarize(cfg, backend, ranks, float(sim_res.iteration_time_s), run_dir)


@dataclass
class TorchrunLaunch:
    """A run prepared for ``torchrun`` on every machine of a topology (:func:`prepare_torchrun`)."""

    run_dir: str
    """The run folder: every machine needs a copy at this same path (or a shared file system)."""
    backend: str
    commands: list[tuple[str, str]]
    """``(machine name, command)`` in topology order of the machines the plan uses: the ``k``-th
    is torchrun's node ``k``."""
    idle_machines: list[str] = field(default_factory=list)
    """Machines holding no device of the plan: nothing to run there (:func:`on_used_machines`)."""


def prepare_torchrun(cfg: ExecuteConfig, endpoint: str, graph=None) -> TorchrunLaunch:
    """Check and predict ``cfg`` as :func:`execute` does, write the run folder ``cfg.run_dir``
    (required) for ranks on the topology's machines, and return the ``torchrun`` command of each
    machine: static rendezvous at ``endpoint`` (``HOST:PORT`` of machine 0, reachable from every
    machine), node rank = the machine's place in the topology, one process per device. After the
    run, :func:`report_torchrun` (``tag execute ... --report``) reads its results."""
    import shlex

    if cfg.run_dir is None:
        raise TagError("--torchrun: expected --run-dir too (the folder every machine runs from)")
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TagError(f"--torchrun: expected HOST:PORT of the first machine, got {endpoint!r}")
    pre = _prepare(cfg, graph, machines=True)
    topo = pre.topology
    cmds = [(m.name,
             f"torchrun --nnodes={topo.num_machines} --node-rank={k} --nproc-per-node={m.count} "
             f"--master-addr={shlex.quote(host)} --master-port={port} --max-restarts=0 "
             f"-m tag.executor.worker {shlex.quote(str(pre.args_path))}")
            for k, m in enumerate(topo.machines)]
    return TorchrunLaunch(str(pre.run_dir), pre.backend, cmds, pre.idle)


def report_torchrun(cfg: ExecuteConfig, graph=None) -> ExecuteResult:
    """The result of a finished ``torchrun`` run prepared by :func:`prepare_torchrun` with the
    same ``cfg`` (its run folder's ``ranks.json``, written by rank 0), with the prediction and
    ``trace.json`` of a local run."""
    if cfg.run_dir is None:
        raise TagError("--report: expected --run-dir (the folder of the torchrun run)")
    run_dir = Path(cfg.run_dir).absolute()
    args_path = run_dir / "args.json"
    if not args_path.exists():
        raise TagError(f"--report: {args_path} does not exist; expected the folder of a run prepared with --torchrun")
    ran = read_json(args_path, TagError, "run arguments")
    if not isinstance(ran, dict) or not {"plan", "topology", "graph", "steps", "warmup", "backend"} <= set(ran):
        raise TagError(f"--report: {args_path}: expected the run arguments --torchrun writes")
    from ..graph.ir import OpGraph
    from ..plan.format import Plan
    from ..topology import load_topology
    plan, topology, idle = on_used_machines(Plan.load(cfg.plan), load_topology(cfg.topology))
    if plan.to_dict() != Plan.load(ran["plan"]).to_dict() or topology.to_dict() != load_topology(ran["topology"]).to_dict():
        raise TagError(f"--report: {run_dir} ran another plan or topology than --plan {cfg.plan} "
                       f"--topology {cfg.topology}")
    graph = graph or OpGraph.from_json(Path(ran["graph"]).read_text())
    sim_res = _predict(graph, topology, plan, False, cfg.profile_dir, ran.get("bucket_bytes"), bool(ran.get("compile")))
    cfg = ExecuteConfig(**{**asdict(cfg), "steps": ran["steps"], "warmup": ran["warmup"]})
    res = _result(cfg, ran["backend"], sim_res, run_dir)
    res.idle_machines = idle
    return res


def summarize(cfg: ExecuteConfig, backend: str, ranks: list[dict], predicted: float | None,
              run_dir: Path) -> ExecuteResult:
    """Overall time per iteration = the slowest rank's; median over post-warm-up iterations."""
    n = len(ranks[0]["iterations"])
    overall = [max(r["iterations"][i]["time_s"] for r in ranks) for i in range(n)]
    losses = [sum(r["iterations"][i]["loss"] for r in ranks) for i in range(n)]
    return ExecuteResult(model=cfg.model, topology=cfg.topology, plan=cfg.plan, backend=backend,
                         world_size=len(ranks), steps=cfg.steps, warmup=cfg.warmup,
                         measured_iteration_time_s=statistics.median(overall[cfg.warmup:]),
                         predicted_iteration_time_s=predicted,
                         per_rank_median_s=[r["median_time_s"] for r in ranks], losses=losses,
                         ranks=ranks, run_dir=str(run_dir))


def _machines_backend(choice: str, topology) -> str:
    """The backend of ranks on the topology's machines: ``auto`` is NCCL when every device is a GPU
    (one per rank), else gloo."""
    if choice == "auto":
        return "gloo" if any(d.gpu.name == CPU_NAME for d in topology.devices) else "nccl"
    if choice not in ("gloo", "nccl"):
        raise TagError(f"--backend: expected gloo, nccl or auto, got {choice!r}")
    return choice


def _backend(choice: str, topology) -> str:
    import torch

    if topology.num_machines > 1:
        raise ExecutionError(f"topology {topology.name!r} spans {topology.num_machines} machines; "
                             "`tag execute` launches one machine -- give --run-dir DIR --torchrun HOST:PORT "
                             "for the torchrun command of each machine (docs/executor.md)")
    gpus = torch.cuda.device_count()
    if choice == "auto":
        choice = "nccl" if gpus >= topology.num_devices else "gloo"
    if choice == GLOO_CUDA and not gpus:
        raise ExecutionError(f"backend {GLOO_CUDA}: this machine has no GPU (torch.cuda.device_count() is 0)")
    if choice not in ("gloo", "nccl", GLOO_CUDA):
        raise TagError(f"--backend: expected gloo, nccl or auto, got {choice!r}")
    if choice == "nccl" and gpus < topology.num_devices:
        raise ExecutionError(f"--backend nccl: topology {topology.name!r} has {topology.num_devices} devices "
                             f"but this machine has {gpus} GPUs; one GPU per rank is needed")
    return choice


def _check_devices_here(topology, backend: str, emulate: bool) -> None:
    """ExecutionError (one line: what the plan needs, what this machine has) for a plan over GPUs
    run as gloo CPU ranks without ``--emulate-speed``: its ranks would be this machine's CPUs
    labelled as the GPUs, and their time set against the GPUs' prediction (`make demo`'s "run it:"
    line on a CPU-only machine: four CPU ranks as v100:0-3, "-99.3%", exit 0)."""
    gpus = [d for d in topology.devices if d.gpu.name != CPU_NAME]
    if backend != "gloo" or not gpus or emulate:
        return
    import torch

    kinds = ", ".join(sorted({d.gpu.name for d in gpus}))
    have = torch.cuda.device_count()
    raise ExecutionError(f"topology {topology.name!r}: the plan needs {len(gpus)} GPUs ({kinds}), one per rank; "
                         f"this machine has {have} GPU{'s' if have != 1 else ''} (its ranks would be CPUs labelled as "
                         "the GPUs); run it on the machine the topology describes, plan for this one "
                         "(`tag topology detect`, or local-cpu2), or pass --emulate-speed to run CPU ranks slowed to "
                         "the GPUs' relative speeds")


def _predict(graph, topology, plan, check_memory: bool, profile_dir: str | None = None,
             bucket_bytes: int | None = None, compiled: bool = False):
    """The simulated iteration (with its timeline; ``compiled``: from the profiles of compiled
    stages where they exist); refuses (OutOfMemoryError) a plan it says will not fit."""
    from ..cost.model import CostModel
    from ..sim import simulate

    costs = CostModel.for_topology(graph, topology, profile_dir=profile_dir, compiled=compiled)
    res = simulate(graph, topology, plan, costs=costs, trace=True, bucket_bytes=bucket_bytes)
    if check_memory and res.oom:
        raise OutOfMemoryError(f"plan would run out of memory: {res.memory_report(topology)}")
    return res


def chrome_trace(sim_res, ranks: list[dict]) -> dict:
    """Simulated and measured timelines side by side (Chrome/Perfetto trace, microseconds):
    processes ``0..n-1`` are the simulated devices, ``1000 + r`` rank ``r``'s last measured
    iteration (one thread: the rank's Python thread, which waits in transfers and syncs)."""
    tr = sim_res.chrome_trace()
    ev = tr["traceEvents"]
    for rk in ranks:
        pid = 1000 + rk["rank"]
        ev.append({"name": "process_name", "ph": "M", "pid": pid,
                   "args": {"name": f"measured rank {rk['rank']}: {rk['device']}"}})
        for name, cat, s, e in rk.get("timeline", ()):
            ev.append({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": 0, "ts": s * 1e6,
                       "dur": max(0.0, e - s) * 1e6})
    return tr


def _launch(world: int, args_path: Path, run_dir: Path, timeout_s: float, start_method: str) -> None:
    """Start ``world`` ranks with torchrun's agent; a failed rank becomes one ExecutionError line.

    ``forkserver`` on CPU: a clean single-threaded server process imports torch and the export
    machinery once (:data:`FORKSERVER_PRELOAD`) and forks the ranks (spawn costs every rank
    ~3 s of imports on a small machine; forking this possibly multi-threaded process is not
    safe). ``spawn`` for NCCL.
    """
    import multiprocessing

    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(forkserver_preload())
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from .loopback import loopback_env, loopback_launch_args

    # A failed rank becomes one ExecutionError line naming the rank, the cause and the log folder;
    # torchelastic's own multi-line error dump is only shown with --debug.
    debug = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
    quiet = logging.ERROR if debug else logging.CRITICAL
    # torch.multiprocessing: "Terminating process N via signal SIGTERM" when the agent stops the others.
    # (their children too where torch set a level of their own: the agent's "Received 15 death
    # signal, shutting down workers" is a WARNING of torch.distributed.elastic.agent.server.api)
    noisy = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    for name in [*noisy, *(n for n in list(logging.root.manager.loggerDict) if n.startswith(noisy))]:
        logging.getLogger(name).setLevel(quiet)
    # multiprocessing's resource tracker (a process of its own, started during the launch with this
    # environment) warns of the semaphores a killed rank could not release, then releases them.
    warn_env = os.environ.get("PYTHONWARNINGS")
    if not debug:
        os.environ["PYTHONWARNINGS"] = ",".join(
            filter(None, [warn_env, "ignore::UserWarning:multiprocessing.resource_tracker"]))
    run_id = f"tag-{uuid.uuid4().hex[:8]}"
    config = LaunchConfig(**supported_kwargs(LaunchConfig, dict(
        min_nodes=1, max_nodes=1, nproc_per_node=world, run_id=run_id,
        **loopback_launch_args(), rdzv_configs={"timeout": int(timeout_s)},
        max_restarts=0, monitor_interval=0.1, start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "logs"), redirects=Std.ALL),
    ), optional={"shutdown_timeout": 5}))
    # the agent turns SIGINT and SIGTERM into SignalException (and stops the ranks) from its start
    # on, and leaves its handlers installed: put back after the launch
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with loopback_env():
            elastic_launch(config, worker_entry)(str(args_path))
    except ChildFailedError as e:
        raise ExecutionError(failure_line(e, run_dir, run_id)) from None
    except (SignalException, KeyboardInterrupt) as e:  # Ctrl-C or SIGTERM with ranks running: one line, exit 130
        what = e.sigval.name if isinstance(e, SignalException) else "SIGINT"
        raise Interrupted(f"{what} with ranks running; they were stopped; run folder kept: {run_dir}") from None
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        if warn_env is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = warn_env


def supported_kwargs(fn, required: dict, optional: dict) -> dict:
    """``required`` plus those of ``optional`` that ``fn`` accepts (by signature inspection).

    torch's launcher grows arguments between releases (``LaunchConfig(shutdown_timeout=...)`` is in
    torch 2.13 but not 2.11, where passing it raised ``TypeError``); the supported torch range is
    in pyproject.toml. An optional argument the installed torch lacks is left out: its default
    behaviour applies (for ``shutdown_timeout``, the agent's own grace period before SIGKILL)."""
    import inspect

    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {**required, **{k: v for k, v in optional.items() if takes_any or k in params}}


# Imported once by the fork server, inherited by every CPU rank.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch.export", "torch.export.experimental", "torch.fx",
                      "tag.executor.worker", "tag.executor.comm", "tag.workloads", "tag.graph", "tag.topology",
                      "tag.plan"]
#: The transformers modules the zoo's GPT-2, BERT, ViT and Llama build on (tag/workloads/zoo.py):
#: each rank of such a model imports them when it builds its copy: 1.7 s CPU per rank, against
#: 1.8 s CPU once for all four in the fork server (load_workload("gpt2") / the four, timed by
#: getrusage in a process that had imported FORKSERVER_PRELOAD, load 10 on 2 cores, 2026-11-29).
HF_PRELOAD = ["transformers", "transformers.masking_utils", "transformers.models.gpt2.modeling_gpt2",
              "transformers.models.bert.modeling_bert", "transformers.models.vit.modeling_vit",
              "transformers.models.llama.modeling_llama"]


def forkserver_preload() -> list[str]:
    """:data:`FORKSERVER_PRELOAD`, plus :data:`HF_PRELOAD` where this process has imported
    transformers (it built or captured a zoo transformer, or the test suite did), so that a run
    of a model without transformers (mlp, resnet, vgg) pays no import for it.

    The fork server starts at the first forkserver launch of a process and keeps its preload for
    the later ones; it inherits this process's environment, with the ``HF_HUB_OFFLINE=1`` the
    zoo sets before importing transformers."""
    return FORKSERVER_PRELOAD + (HF_PRELOAD if "transformers" in sys.modules else [])


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out",
              "Timeout", "Socket Timeout", "SignalException", "got signal")


def is_secondary(cause: str) -> bool:
    """A rank that only saw a peer disappear (or was stopped by the agent) is not the cause."""
    return any(s in cause for s in _PEER_GONE)


def _error_files(run_dir: Path, run_id: str) -> dict[int, tuple[str, float]]:
    """rank -> (last line of its recorded exception, timestamp) from the agent's error files."""
    import json

    out = {}
    for f in (run_dir / "logs").glob(f"{run_id}*/attempt_*/*/error.json"):
        try:
            rec = json.loads(f.read_text())["message"]
            msg = rec["message"] if isinstance(rec, dict) else str(rec)
            ts = float(rec.get("extraInfo", {}).get("timestamp", 0)) if isinstance(rec, dict) else 0.0
            out[int(f.parent.name)] = (msg.strip().splitlines()[-1] if msg.strip() else "", ts)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def failure_line(e, run_dir: Path, run_id: str) -> str:
    """ONE line for the rank that caused the failure: ``rank R failed: <cause> (logs: DIR)``.

    The agent reports the first failed process it finds, which may be a peer that merely saw
    the connection drop; every rank's recorded exception is read to find the real cause.
    """
    causes: dict[int, tuple[str, float]] = {}
    for rank, f in e.failures.items():
        msg = f.message.get("message", "") if isinstance(f.message, dict) else f.message
        cause = str(msg).strip().splitlines()[-1] if str(msg).strip() else ""
        if not cause or cause.startswith("To enable traceback") or "Signal" in cause:
            cause = f"exit code {f.exitcode}" + (f" ({f.signal_name()})" if f.exitcode < 0 else "")
        causes[rank] = (cause, f.timestamp)
    for rank, (cause, ts) in _error_files(run_dir, run_id).items():
        if cause:
            causes[rank] = (cause, ts)
    rank, (cause, _) = min(causes.items(), key=lambda rc: (is_secondary(rc[1][0]), rc[1][1], rc[0]))
    logs = next((run_dir / "logs").glob(f"{run_id}*"), run_dir / "logs")
    return f"rank {rank} failed: {cause[:300]} (logs: {logs})"


def _read_ranks(run_dir: Path) -> list[dict]:
    import json

    path = run_dir / "ranks.json"
    if not path.exists():
        raise ExecutionError(f"{path}: the workers finished without writing their results")
    return json.loads(path.read_text())
