"""``tag run``: train a model with a plan on TAG's executor, on the factory's data, with
checkpoints, resumption, the usual training controls and metrics.

The launcher (:func:`train`) checks the plan as ``tag execute`` does, resolves ``--resume`` to a
verified checkpoint (:mod:`tag.executor.checkpoint`) before anything starts, and launches one
rank per device (:func:`tag.executor.launch._launch`); each rank (:func:`train_rank`, from
:func:`tag.executor.worker.run_rank`) runs the plan's schedule once per global batch:

* data: its own rows of every global batch (:mod:`tag.executor.data`); without a data source, the
  factory's example inputs every step (``TrainResult.data`` False; ``tag run`` says so at the end);
* an optimizer step every ``accumulate`` global batches: each rank sums the batches' gradients
  unsynced (the buckets' in :attr:`DistComm.carried <tag.executor.comm.DistComm.carried>`, as DDP's
  ``no_sync``), the step's last batch syncs the sum once (all-reduce, or a sharded bucket's
  reduce-scatter), and the sum is divided by ``accumulate`` (each batch's gradient is its mean's);
* learning rate of optimizer step ``n`` (0-based, :func:`lr_at`): linear warm-up
  ``lr * (n + 1) / W`` over ``W`` steps, then constant or cosine to ``min_lr`` at ``--steps``;
* gradient clipping by the global norm: every rank sums the squares of the gradients it is
  responsible for (:func:`responsible`: each parameter, tensor-parallel shard or sharded bucket's
  slice once, whatever the replicas, stages and tied copies holding it), one all-reduce sums them, and every rank
  multiplies its gradients by ``min(1, max_norm / (norm + 1e-6))`` (``clip_grad_norm_``'s rule);
  the norm is reported whether or not ``--clip`` is given;
* after each step one all-gather of (loss, stop, memory) per rank: rank 0 writes the step's
  record to ``metrics.jsonl`` (and TensorBoard / wandb when asked) and stops everyone at
  ``--time``; checkpoints every ``--checkpoint-every`` steps and at the end;
* ``--adaptive-k`` (a pipeline of 1f1b, kfkb or gpipe, gloo ranks): after each optimizer step
  every rank takes the next step's kFkB block size from the step's measured stage and transfer
  seconds (:class:`tag.executor.adaptive.AdaptiveK`, as ``tag execute --adaptive-k`` between
  iterations; a step's batches all run one block size, so the gradients accumulated unsynced stay
  those of one schedule's buckets); the record says which (``k``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import TagError
from ..io import write_atomic, write_json
from . import checkpoint as ckpt
from .data import RankFeeder, rank_rows, rows_reader
from .sharded import ShardedRank

log = logging.getLogger(__name__)
METRICS = "metrics.jsonl"
SCHEDULES = ("cosine", "constant")


@dataclass
class TrainSpec:
    """A training run's settings as every rank reads them (``WorkerArgs.train``)."""

    steps: int | None = None
    """Optimizer steps the run ends at (counted from the first run, not from the resumed step);
    None: until ``time_s``."""
    time_s: float | None = None
    """Wall-clock seconds of this launch after which the run stops (at the end of a step)."""
    accumulate: int = 1
    """Global batches per optimizer step."""
    lr: float | None = None
    """Peak learning rate (None: the optimizer's, :data:`tag.cost.optim.ADAM_LR` / ``SGD_LR``)."""
    warmup_steps: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    """The cosine ends at ``lr * min_lr_ratio``."""
    clip: float | None = None
    """Max global gradient norm (None: no clipping)."""
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    """Steps between checkpoints (None: only the run's last step's, with ``checkpoint_dir``)."""
    keep: int = 3
    """Committed checkpoints kept (the latest)."""
    resume: str | None = None
    """A verified checkpoint folder to start from."""
    log_every: int = 1
    metrics: str = ""
    """The JSONL file of the step records."""
    tensorboard: str | None = None
    wandb: str | None = None
    """wandb project (offline unless ``WANDB_MODE`` says otherwise)."""
    plan_id: str = ""
    """SHA-256 of the plan and topology: a checkpoint's random streams are read back under the same."""

    def __post_init__(self) -> None:
        if self.steps is None and self.time_s is None:
            raise TagError("tag run: expected --steps N, --time SECONDS or both (when to stop)")
        if self.schedule not in SCHEDULES:
            raise TagError(f"--lr-schedule: expected one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule == "cosine" and self.steps is None:
            raise TagError("--lr-schedule cosine: expected --steps (the step the cosine ends at); "
                           "with --time alone use --lr-schedule constant")
        if self.clip is not None and not (0 < self.clip < math.inf):
            raise TagError(f"--clip: expected a positive, finite global norm, got {self.clip!r}")
        if self.lr is not None and not (0 < self.lr < math.inf):
            raise TagError(f"--lr: expected a positive, finite learning rate, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise TagError(f"--min-lr-ratio: expected a ratio in [0, 1], got {self.min_lr_ratio!r}")
        if self.time_s is not None and not (0 < self.time_s < math.inf):
            raise TagError(f"--time: expected a positive, finite number of seconds, got {self.time_s!r}")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise TagError("--checkpoint-every: expected --checkpoint-dir too (where the checkpoints go)")


def lr_at(step: int, base: float, spec: TrainSpec) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up over
    ``spec.warmup_steps`` steps, then ``base`` (constant) or a cosine from ``base`` to
    ``base * min_lr_ratio`` at step ``spec.steps``."""
    w = spec.warmup_steps
    if step < w:
        return base * (step + 1) / w
    if spec.schedule == "constant" or spec.steps is None or spec.steps <= w:
        return base
    t = min(1.0, (step - w) / (spec.steps - w))
    low = base * spec.min_lr_ratio
    return low + 0.5 * (base - low) * (1.0 + math.cos(math.pi * t))


# ---- the ranks ----------------------------------------------------------------------------
@dataclass
class RankContext:
    """What :func:`tag.executor.worker.run_rank` set up for this rank."""

    rank: int
    world: int
    topology: object
    graph: object
    plan: object
    sched: object
    rt: object
    comm: object
    device: torch.device
    wl: object
    hook: object
    members: list | None
    my_group: object
    fault: tuple | None


def responsible(ctx: RankContext) -> list[torch.Tensor]:
    """The tensors whose gradients this rank counts in the global norm: of the ranks holding the
    same gradient (a parameter's replicas, pipeline stages holding a tied copy, a tensor-parallel
    group's members for a replicated parameter), the lowest; a tensor-parallel shard is its own
    tensor; a sharded bucket's gradient is its shards' (:func:`sharded_counted`). Collective (one
    all-gather of names)."""
    import torch.distributed as dist

    rt = ctx.rt
    sharded = ctx.hook if isinstance(ctx.hook, ShardedRank) else None
    held, counted = sharded_counted(sharded)
    split = ctx.hook.param_state() if ctx.hook is not None and sharded is None else None
    split = split if isinstance(split, dict) else {}
    index = getattr(ctx.hook, "index", 0)
    mine = {}
    for ph, p in rt.params.items():
        fqn = rt.schedule.param_target[ph]
        if id(p) not in held:
            mine[f"{fqn}#{index if fqn in split else 0}"] = p
    everyone: list = [None] * ctx.world
    dist.all_gather_object(everyone, sorted(mine))
    owner: dict[str, int] = {}
    for r, names in enumerate(everyone):
        for n in names:
            owner.setdefault(n, r)
    return [p for n, p in mine.items() if owner[n] == ctx.rank] + counted


def sharded_counted(hook: ShardedRank | None) -> tuple[set[int], list[torch.Tensor]]:
    """A sharded rank's (ids of the parameters of its sharded buckets, whose gradients are its
    shards', and the shards it counts in the norm): every shard group's members hold disjoint
    slices of a bucket, counted by each; hybrid sharding's replicas of a slice (the same index in
    the other shard groups) are counted by the first shard group's member only. A shard's padding
    holds zeros."""
    if hook is None:
        return set(), []
    held = {id(p) for bk in hook.buckets.values() for p in bk.params}
    counted = [bk.shard for bk in hook.buckets.values()
               if bk.cross_members is None or bk.cross_members[0] == hook.rank]
    return held, counted


def carried(rt) -> set[int]:
    """Ids of the parameters whose gradients :class:`tag.executor.comm.DistComm` carries across an
    accumulated step's batches (those of the buckets this rank syncs, :attr:`DistComm.carried`)."""
    s = rt.schedule
    return {id(rt.params[ph]) for b in s.buckets if rt.rank in b.collective.members
            for g in b.groups for ph in rt._synced(g) if ph in rt.params}


@dataclass
class StepControl:
    """:attr:`RankRuntime.before_step`: gradient accumulation, the global norm and clipping.

    The step's batches before its last run with ``comm.accumulating``: the buckets' gradients are
    summed unsynced by the comm (:attr:`DistComm.carried`) and synced once, with the last batch
    (DDP's ``no_sync``); the gradients no bucket syncs (a parameter of one rank, SFB's recomputed
    ones) are summed here. At the last batch every gradient the optimizer steps (a sharded rank's:
    its shards') is the sum over the batches, divided by ``accumulate``."""

    rt: object
    comm: object
    counted: list[torch.Tensor]
    """Tensors whose gradients this rank counts in the norm (:func:`responsible`)."""
    accumulate: int
    clip: float | None
    device: torch.device
    k: int = 0
    """Batches accumulated so far towards the next step."""
    acc: dict[int, torch.Tensor] = field(default_factory=dict)
    """id(parameter) -> its gradient summed over the step's batches so far (not the comm's)."""
    finite: bool = True
    norm: float = float("nan")
    """The last step's global gradient norm (before clipping)."""

    def __post_init__(self) -> None:
        self.by_comm = carried(self.rt)
        self.comm.accumulating = self.accumulate > 1

    def _stepped(self) -> list[torch.Tensor]:
        opt = self.rt.optimizer
        return [p for g in opt.param_groups for p in g["params"] if p.grad is not None] if opt is not None else []

    def __call__(self, ok: bool) -> bool:
        import torch.distributed as dist

        self.finite = self.finite and ok
        last = self.k == self.accumulate - 1
        if self.accumulate > 1:
            for p, _ in self.rt._grad_keys:  # (each call: a sharded rank's are its unsharded groups')
                if id(p) not in self.by_comm and p.grad is not None:
                    held = self.acc.get(id(p))
                    self.acc[id(p)] = p.grad.clone() if held is None else held.add_(p.grad)
        if not last:
            self.k += 1
            self.comm.accumulating = self.k < self.accumulate - 1
            return False
        params = self._stepped()
        if self.accumulate > 1:
            for p in params:
                p.grad = self.acc.pop(id(p), p.grad) / self.accumulate
        self.k, self.acc = 0, {}
        self.comm.accumulating = self.accumulate > 1
        counted = [p.grad for p in self.counted if p.grad is not None]
        sq = (torch.stack(torch._foreach_norm(counted)).double().square().sum() if counted
              else torch.zeros((), dtype=torch.float64, device=self.device))
        sq = sq.to(self.device)
        dist.all_reduce(sq)
        self.norm = float(sq.sqrt())
        ok, self.finite = self.finite and math.isfinite(self.norm), True
        if ok and self.clip is not None and params:
            coef = self.clip / (self.norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_([p.grad for p in params], coef)
        return ok


def _shards(ctx: RankContext) -> ckpt.Shards | None:
    """How this rank's parts of parameters are checkpointed (a tensor-parallel member's:
    :class:`tag.executor.checkpoint.Shards`); None when it holds whole parameters. A strategy whose
    ranks hold parts without saying where (:meth:`RankHook.param_state` not a dict) is refused."""
    import torch.distributed as dist

    hook = ctx.hook
    if hook is None or isinstance(hook, ShardedRank):  # (whole parameters, or written by checkpoint.sharded_state)
        return None
    kept = hook.param_state()
    if not isinstance(kept, dict):
        raise TagError(f"rank {ctx.rank}: its {type(hook).__name__} does not say which parts of the parameters it "
                       "holds; tag run does not checkpoint it")

    def gather(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        parts: list = [(named, kept)]
        if ctx.members is not None:
            parts = [None] * len(ctx.members)
            dist.all_gather_object(parts, (named, kept), group=ctx.my_group)
        return hook.full_params(parts)
    return ckpt.Shards(kept, gather)


def _memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU, resident bytes of the process on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    from .worker import host_memory

    return host_memory()


def _peak_flops(ctx: RankContext) -> float:
    """FLOP/s of every device of the plan at its precision (fp32's or the 16-bit rate)."""
    fp32 = ctx.graph.precision == "fp32"
    return sum(d.gpu.fp32_flops if fp32 else d.gpu.fp16_flops for d in ctx.topology.devices)


def _tokens(inputs: tuple) -> int | None:
    """Tokens per global batch: the first input's elements when it is integer token ids ``[B, L]``."""
    x = inputs[0] if inputs else None
    if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.is_floating_point():
        return int(x.numel())
    return None


def train_rank(a, ctx: RankContext) -> dict:
    """This rank's training run (see the module docstring); rank 0 returns the run's summary."""
    import torch.distributed as dist

    from .worker import _inject

    spec = TrainSpec(**a.train)
    rt, sched, rank = ctx.rt, ctx.sched, ctx.rank
    shards = _shards(ctx) if spec.checkpoint_dir or spec.resume else None
    B = sched.batch_size
    feeder = None
    if ctx.wl.data is not None:
        feeder = RankFeeder(rows_reader(ctx.wl.data, a.seed, a.model), rt.inputs, rank_rows(rt), a.model)
    control = StepControl(rt, ctx.comm, responsible(ctx), spec.accumulate, spec.clip, ctx.device)
    rt.before_step = control
    ada, throttle = _adaptive(a, ctx)
    base_lr = spec.lr or (rt.optimizer.defaults["lr"] if rt.optimizer is not None else 0.0)
    step, batches, samples = 0, 0, 0
    if spec.resume:
        state = json.loads((Path(spec.resume) / ckpt.STATE).read_text())
        ckpt.load(Path(spec.resume), rt, rank, same_plan=state.get("plan_id") == spec.plan_id, shards=shards)
        step, batches, samples = state["step"], state["batches"], state["samples"]
    records = Metrics(spec, a, ctx, step) if rank == 0 else None
    flops = ctx.graph.flops() * spec.accumulate
    peak = _peak_flops(ctx)
    tokens = _tokens(rt.inputs)
    t_launch = time.perf_counter()
    first, stop = step, False
    summary: dict = {"start_step": step}
    while not stop and (spec.steps is None or step < spec.steps):
        f = ctx.fault
        if f and f[0] == rank and f[1] == step and f[2] != "exit-in-checkpoint":
            _inject(f[2])
        lr = lr_at(step, base_lr, spec)
        if rt.optimizer is not None:
            for g in rt.optimizer.param_groups:
                g["lr"] = lr
        t0 = time.perf_counter()
        loss = 0.0
        k = None if ada is None else ada.k
        for _ in range(spec.accumulate):
            if throttle is not None:
                ctx.comm.link_delay_s = throttle.delay_at(rank, batches)
            loss += _batch(ctx, feeder, batches, samples, ada) / spec.accumulate
            batches, samples = batches + 1, samples + B
        if ada is not None:  # the next step's block size (every rank at once)
            ada.next_k(spec.accumulate)
        step += 1
        late = spec.time_s is not None and time.perf_counter() - t_launch >= spec.time_s
        parts = _gathered(ctx, loss, late)
        stop = bool(parts[0][1])  # rank 0's clock decides
        dt = time.perf_counter() - t0
        record = {"step": step, "loss": sum(float(p[0]) for p in parts), "lr": lr, "grad_norm": control.norm,
                  "loss_scale": None if rt.scaler is None else float(rt.scaler.scale),
                  "step_time_s": dt, "samples_per_s": B * spec.accumulate / dt,
                  "tokens_per_s": tokens * spec.accumulate / dt if tokens else None,
                  "mfu": flops / dt / peak if peak else None,
                  "memory_bytes": [int(p[2]) for p in parts], "samples": samples,
                  "elapsed_s": time.perf_counter() - t_launch}
        record["eta_s"] = _eta(spec, step, first, record["elapsed_s"])
        if ada is not None:  # the block size the step ran, and the measurements choosing the next
            record["k"], record["next_k"] = k, ada.last
        last = record["last"] = stop or step == spec.steps
        if records is not None:
            records.write(record)
        if spec.checkpoint_dir and (last or spec.checkpoint_every and step % spec.checkpoint_every == 0):
            state = {"step": step, "batches": batches, "samples": samples, "plan_id": spec.plan_id,
                     "model": a.model, "seed": a.seed, "world": ctx.world, "global_batch": B,
                     "lr_schedule": {"lr": base_lr, "warmup_steps": spec.warmup_steps, "schedule": spec.schedule,
                                     "min_lr_ratio": spec.min_lr_ratio, "steps": spec.steps},
                     "accumulate": spec.accumulate, "loss": record["loss"]}
            kill = f is not None and f[0] == rank and f[1] == step and f[2] == "exit-in-checkpoint"
            ckpt.save(Path(spec.checkpoint_dir), step, rt, rank, ctx.world, state,
                      before_commit=(lambda: _inject("exit")) if kill else None, shards=shards)
            if rank == 0:
                ckpt.prune(Path(spec.checkpoint_dir), spec.keep)
    if records is not None:
        records.close()
    summary.update(rank=rank, step=step, batches=batches, samples=samples, data=feeder is not None,
                   syncs=ctx.comm.started,
                   compiled_segments=sum(hasattr(seg.module, "_orig_mod") for seg in rt.program.segments.values()),
                   rows_read=feeder.read if feeder else 0,
                   data_rows=feeder.ranges if feeder else [])
    if a.save_params:
        from .worker import save_rank_params

        save_rank_params(a, rt, ctx.hook, ctx.members, ctx.my_group, rank)
    everyone: list = [None] * ctx.world
    dist.all_gather_object(everyone, summary)
    if rank == 0:
        write_json(Path(a.out_dir) / "train.json", everyone)
    ctx.comm.close()
    return summary


def _adaptive(a, ctx: RankContext) -> tuple:
    """``(AdaptiveK or None, Throttle or None)`` of ``--adaptive-k`` (``a.adaptive_k``: the block
    sizes that fit, :func:`tag.executor.adaptive.allowed_ks`) and ``--inject-delay``."""
    from .adaptive import AdaptiveK, Throttle
    from .strategies import execution_for

    ada = None if a.adaptive_k is None else AdaptiveK(a.adaptive_k, execution_for(ctx.plan, ctx.graph), ctx.graph,
                                                      ctx.topology.machine_of, a.bucket_bytes, ctx.rt, ctx.comm)
    return ada, Throttle.parse(a.delay)


def _batch(ctx: RankContext, feeder: RankFeeder | None, batches: int, samples: int, ada=None) -> float:
    """Run one global batch (the ``batches``-th, from stream sample ``samples``) through the
    schedule the runtime walks (the plan's, or ``ada``'s block size), its syncs and
    :meth:`RankRuntime.update`; this rank's part of its loss."""
    from .worker import walk_schedule

    rt = ctx.rt
    if feeder is not None:
        feeder.feed(batches, samples)
    rt.begin_iteration()
    walk_schedule(rt, ctx.comm, rt.schedule, None, ada)
    ctx.comm.finish_syncs(rt)
    rt.update()
    return rt.loss


def _gathered(ctx: RankContext, loss: float, late: bool) -> list[torch.Tensor]:
    """Every rank's (loss part, past ``--time``, memory bytes), by one all-gather."""
    import torch.distributed as dist

    stats = torch.tensor([loss, float(late), float(_memory_bytes(ctx.device))], dtype=torch.float64,
                         device=ctx.device)
    parts = [torch.empty_like(stats) for _ in range(ctx.world)]
    dist.all_gather(parts, stats)
    return parts


def _eta(spec: TrainSpec, step: int, first: int, elapsed: float) -> float | None:
    """Seconds to the end: the steps left at this launch's mean step time, or the time left."""
    left = []
    if spec.steps is not None:
        left.append((spec.steps - step) * elapsed / max(1, step - first))
    if spec.time_s is not None:
        left.append(max(0.0, spec.time_s - elapsed))
    return min(left) if left else None


def _wandb_run(run_dir: Path, spec: TrainSpec, config: dict):
    """A wandb run of project ``spec.wandb``, its files in ``RUN_DIR/wandb`` (offline unless
    ``WANDB_MODE`` says otherwise), the same run id across resumptions (``RUN_DIR/wandb_id.txt``);
    None, with a warning, when wandb fails (logging never stops training)."""
    import uuid

    wdir = run_dir / "wandb"
    wdir.mkdir(parents=True, exist_ok=True)
    for var, sub in (("WANDB_DIR", ""), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config")):
        os.environ[var] = str(wdir / sub)
    os.environ.setdefault("WANDB_SILENT", "true")
    rid_file = run_dir / "wandb_id.txt"
    rid = rid_file.read_text().strip() if rid_file.exists() else uuid.uuid4().hex[:8]
    write_atomic(rid_file, rid)
    try:
        import wandb

        return wandb.init(project=spec.wandb, mode=os.environ.get("WANDB_MODE", "offline"), dir=str(wdir), id=rid,
                          resume="allow", name=run_dir.name, config=config)
    except Exception as e:  # noqa: BLE001 - logging must never stop training
        log.warning("wandb off for this run: %s", " ".join(str(e).split())[:200])
        return None


def keep_records(path: Path, upto: int) -> None:
    """Keep the records of steps ``<= upto`` of the JSONL ``path`` (a resumed run drops the killed
    run's records after its checkpoint's step; a fresh run, ``upto`` 0, starts it empty)."""
    lines = path.read_text().splitlines() if upto and path.exists() else []
    kept = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] <= upto]
    if not path.exists() or len(kept) != len(lines) or not upto:
        write_atomic(path, "".join(ln + "\n" for ln in kept))


class Metrics:
    """Rank 0's step records: ``metrics.jsonl`` (:func:`keep_records` first), one progress line
    every ``log_every`` steps on stdout, TensorBoard and wandb when asked."""

    def __init__(self, spec: TrainSpec, a, ctx: RankContext, start: int) -> None:
        self.spec, self.path = spec, Path(spec.metrics)
        keep_records(self.path, start)
        self.file = open(self.path, "a")  # noqa: SIM115 - open for the run
        self.tb = self.wandb = None
        if spec.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(spec.tensorboard)
        if spec.wandb:
            self.wandb = _wandb_run(self.path.parent, spec, {"model": a.model, "plan": a.plan, **asdict(spec)})

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = record["step"]
        if self.tb is not None:
            for k in ("loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s", "mfu"):
                if record[k] is not None:
                    self.tb.add_scalar(k, record[k], step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "memory_bytes"}, step=step)
        if shown(record, self.spec):
            print(progress_line(record, self.spec.steps), flush=True)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def shown(record: dict, spec: TrainSpec) -> bool:
    """Whether a step's record gets a progress line: every ``log_every`` steps and the run's last."""
    return record["step"] % spec.log_every == 0 or record["last"]


def progress_line(r: dict, steps: int | None) -> str:
    """``step 30/60  loss 2.1234  lr 1.0e-03  |g| 0.52  812 samples/s  MFU 3.1%  mem 0.31-0.32 GiB  ETA 0:00:12``."""
    parts = [f"step {r['step']}" + (f"/{steps}" if steps else ""), f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}",
             f"|g| {r['grad_norm']:.3g}", f"{r['samples_per_s']:.1f} samples/s"]
    if r.get("tokens_per_s"):
        parts.append(f"{r['tokens_per_s']:.0f} tokens/s")
    if r.get("mfu") is not None:
        parts.append(f"MFU {r['mfu'] * 100:.3g}%")
    mem = [m / 2**30 for m in r["memory_bytes"]]
    parts.append(f"mem {min(mem):.2f}-{max(mem):.2f} GiB" if len(mem) > 1 else f"mem {mem[0]:.2f} GiB")
    if r.get("eta_s") is not None:
        s = int(r["eta_s"])
        parts.append(f"ETA {s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}")
    return "  ".join(parts)


# ---- the launcher -------------------------------------------------------------------------
@dataclass
class TrainResult:
    """A finished (or stopped) training run."""

    run_dir: str
    metrics: str
    start_step: int
    """The step the run started from (a resumed checkpoint's, else 0)."""
    step: int
    """The last step done."""
    losses: list[float]
    """Loss of every step of the run from step 1 (``metrics.jsonl``; a resumed run's too)."""
    checkpoint: str | None
    """The latest committed checkpoint (None without ``--checkpoint-dir``)."""
    data: bool = True
    """Whether the steps read the factory's training data (else its example inputs, every step)."""
    ranks: list[dict] = field(default_factory=list, repr=False)


def _plan_id(plan_path: Path, topology_path: Path) -> str:
    import hashlib

    return hashlib.sha256(plan_path.read_bytes() + b"\0" + topology_path.read_bytes()).hexdigest()


def train(cfg, spec: TrainSpec, echo=None, graph=None) -> TrainResult:
    """Launch ``cfg`` (an :class:`tag.executor.ExecuteConfig`: model, topology, plan, seed, run
    folder...) as a training run of ``spec`` on this machine; ``echo(line)`` gets each progress
    line as rank 0 writes it (``tag run`` prints them). A one-line TagError on bad input, a
    checkpoint it cannot resume from, or a failed rank. ``graph``: the captured graph of
    ``cfg.model``, if the caller has it (saves a capture)."""
    from .launch import _launch, _prepare

    resume, start = _resumed(cfg, spec)
    pre = _prepare(cfg, graph, machines=False)
    spec = _write_run(pre.run_dir, spec, resume, start)
    metrics = Path(spec.metrics)
    tail = _Tail(metrics, spec, echo) if echo else None
    try:
        _launch(pre.topology.num_devices, pre.args_path, pre.run_dir, cfg.timeout_s,
                "spawn" if pre.backend == "nccl" else "forkserver")
    finally:
        if tail is not None:
            tail.stop()
    records = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()]
    last = ckpt.latest(spec.checkpoint_dir) if spec.checkpoint_dir else None
    ranks = json.loads((pre.run_dir / "train.json").read_text())
    return TrainResult(str(pre.run_dir), str(metrics), start, ranks[0]["step"], [r["loss"] for r in records],
                       str(last) if last else None, ranks[0]["data"], ranks)


def prepare_train_torchrun(cfg, spec: TrainSpec, endpoint: str, graph=None):
    """:func:`tag.executor.prepare_torchrun` for a training run: the run folder (``cfg.run_dir``,
    the same path on every machine) and each machine's ``torchrun`` command
    (:class:`tag.executor.TorchrunLaunch`); rank 0 prints the progress lines and writes
    ``metrics.jsonl`` there. ``--checkpoint-dir`` must be one folder every machine writes (a shared
    file system: each rank writes its part, rank 0 the metadata and the commit)."""
    from .launch import prepare_torchrun

    resume, start = _resumed(cfg, spec)
    launch = prepare_torchrun(cfg, endpoint, graph)
    _write_run(Path(launch.run_dir), spec, resume, start)
    return launch


def _resumed(cfg, spec: TrainSpec) -> tuple[Path | None, int]:
    """The verified checkpoint ``spec.resume`` names (None: a fresh run) and its step; refuses
    in one line what the run cannot do (TensorBoard without its package, another model's checkpoint)."""
    if spec.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise TagError("--tensorboard: the tensorboard package is not installed (pip install tensorboard)")
    if cfg.run_dir is None:
        raise TagError("tag run: expected --run-dir (where metrics.jsonl and the logs go)")
    if spec.checkpoint_dir or spec.resume:
        _check_checkpointable(cfg.plan)
    found = ckpt.resolve_resume(spec.checkpoint_dir, spec.resume)
    if found is None:
        return None, 0
    resume, state = found
    if state.get("model") != cfg.model:
        raise ckpt.CheckpointError(f"{resume}: a checkpoint of {state.get('model')!r}, not --model {cfg.model!r}")
    was = state.get("lr_schedule", {})
    now = {"warmup_steps": spec.warmup_steps, "schedule": spec.schedule, "min_lr_ratio": spec.min_lr_ratio,
           "steps": spec.steps, **({"lr": spec.lr} if spec.lr else {})}
    changed = [f"{k} {was[k]} -> {v}" for k, v in now.items() if k in was and was[k] != v]
    if changed:  # (extending --steps stretches the cosine: the user's call)
        log.warning("resuming %s with another learning-rate schedule: %s", resume, ", ".join(changed))
    return resume, state["step"]


CHECKPOINTED = ("allreduce", "ps", "mp", "tp", "zero1", "zero2", "zero3")
"""Strategies ``tag run`` checkpoints: ranks holding whole parameters, tensor-parallel shards
(written whole, :class:`tag.executor.checkpoint.Shards`) and sharded buckets (written whole,
:func:`tag.executor.checkpoint.sharded_state`)."""


def _check_checkpointable(plan_path: str) -> None:
    """TagError (one line naming the group) for a plan with a group of another strategy (one whose
    ranks may hold parts of parameters ``tag run`` does not know how to write whole)."""
    from ..plan.format import Plan

    plan = Plan.load(plan_path)
    g = next((g for g, gp in enumerate(plan.groups) if gp.sync not in CHECKPOINTED), None)
    if g is not None:
        raise TagError(f"{plan_path}: groups[{g}].sync: tag run does not checkpoint {plan.groups[g].sync!r} groups; "
                       f"expected --checkpoint-dir with groups of {', '.join(CHECKPOINTED)}")


def _write_run(run_dir: Path, spec: TrainSpec, resume: Path | None, start: int) -> TrainSpec:
    """The run's spec with its paths resolved, added to the ranks' ``args.json``; ``metrics.jsonl``
    cut to the resumed step's records (:func:`keep_records`)."""
    args_path = run_dir / "args.json"
    args = json.loads(args_path.read_text())
    metrics = run_dir / METRICS
    spec = TrainSpec(**{**asdict(spec), "resume": str(resume) if resume else None, "metrics": str(metrics),
                        "checkpoint_dir": str(Path(spec.checkpoint_dir).absolute()) if spec.checkpoint_dir else None,
                        "plan_id": _plan_id(Path(args["plan"]), Path(args["topology"]))})
    write_json(args_path, {**args, "train": asdict(spec)})
    keep_records(metrics, start)
    return spec


class _Tail:
    """Follows ``metrics.jsonl`` while the ranks run, passing each new record's progress line to
    ``echo`` (the ranks' own output goes to their log files)."""

    def __init__(self, path: Path, spec: TrainSpec, echo) -> None:
        self.path, self.spec, self.echo = path, spec, echo
        self.pos = path.stat().st_size if path.exists() else 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.5):
            self._read()
        self._read()

    def _read(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self.pos)
                chunk = f.read()
        except OSError:
            return
        lines = chunk.split("\n")
        for ln in lines[:-1]:  # (a line without its newline is still being written)
            r = json.loads(ln) if ln.strip() else None
            if r is not None and shown(r, self.spec):
                self.echo(progress_line(r, self.spec.steps))
        self.pos += len(chunk) - len(lines[-1])

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def print_line(line: str) -> None:
    print(line, file=sys.stdout, flush=True)
