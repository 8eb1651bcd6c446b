"""``tag run``: train a model with a plan on TAG's executor (one rank per topology device).

Reads the factory's training data (each rank its own rows of every global batch), steps the
optimizer with a learning-rate schedule, gradient clipping and accumulation, prints a progress
line per step (loss, samples/s, MFU, memory, ETA), writes every step's record to
RUN_DIR/metrics.jsonl, and checkpoints with torch.distributed.checkpoint; --resume continues from
the latest complete checkpoint (docs/executor.md, "Training runs"). `tag execute` times a plan,
`tag train` trains TAG's GNN cost predictor.

  tag run --model my_model.py:make --topology local-cpu2 --plan plan.json --steps 1000 \\
          --lr 3e-4 --warmup-steps 100 --clip 1.0 --checkpoint-dir ckpt --checkpoint-every 100
  tag run ... --resume            # after a crash: on from ckpt's latest complete checkpoint
"""

from __future__ import annotations

import argparse
import math
import re

from .common import (
    RawDescriptionHelpFormatter,
    add_compile_arg,
    add_launch_args,
    int_in,
    print_json,
    print_torchrun,
    seconds,
)

_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """argparse ``type``: seconds from ``3600``, ``90m``, ``2h``, ``1.5d``."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-z]*)\s*", text)
    try:
        value = float(m.group(1)) * _UNITS[m.group(2)] if m else math.nan
    except (ValueError, KeyError):
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive duration such as 3600, 90m, 2h or 1.5d, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number, got {text!r}")
    return value


def register(sub) -> None:
    p = sub.add_parser("run", help="train a model with a plan: data, checkpoints, resume, metrics",
                       description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    add_launch_args(p, "workload spec the plan was made for; a factory may return (model, inputs, data): the "
                    "training data (docs/user-guide.md)")
    p.add_argument("--plan", required=True, help="plan JSON (from `tag plan`)")
    add_compile_arg(p, "at the first step")
    p.add_argument("--run-dir", default="tag-run", help="folder of metrics.jsonl, train.json and the ranks' logs")
    p.add_argument("--timeout", type=seconds, default=300.0,
                   help="seconds any rank may wait on a peer before the run fails")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int_in(1), default=None, help="optimizer steps the run ends at (a resumed "
                   "run counts from its first start)")
    t.add_argument("--time", type=duration, default=None, help="stop after this long (3600, 90m, 2h), at the end "
                   "of a step, with a checkpoint")
    t.add_argument("--accumulate", type=int_in(1), default=1, help="global batches per optimizer step")
    t.add_argument("--lr", type=positive_float, default=None, help="peak learning rate (default: the optimizer's, "
                   "1e-3 Adam, 1e-2 SGD)")
    t.add_argument("--warmup-steps", type=int_in(0), default=0, help="linear learning-rate warm-up steps")
    t.add_argument("--lr-schedule", default=None, choices=["cosine", "constant"],
                   help="after the warm-up: cosine to lr x --min-lr-ratio at --steps, or constant (default: cosine "
                        "with --steps, constant with --time alone)")
    t.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine's final learning rate over --lr")
    t.add_argument("--clip", type=positive_float, default=None,
                   help="clip the gradients to this global norm (over every shard, stage and replica)")
    c = p.add_argument_group("checkpoints and metrics")
    c.add_argument("--checkpoint-dir", default=None, help="folder of the checkpoints (step-NNNNNNNN)")
    c.add_argument("--checkpoint-every", type=int_in(1), default=None, help="steps between checkpoints "
                   "(one is also written at the end, the only one without this option)")
    c.add_argument("--keep-checkpoints", type=int_in(1), default=3, help="complete checkpoints kept (the latest)")
    c.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="continue from the latest complete checkpoint of --checkpoint-dir (none yet: start afresh), "
                        "or from the checkpoint folder given")
    c.add_argument("--log-every", type=int_in(1), default=1, help="steps between progress lines")
    c.add_argument("--tensorboard", default=None, metavar="DIR", help="also log to TensorBoard in DIR "
                   "(needs the tensorboard package)")
    c.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to wandb (offline unless WANDB_MODE "
                   "says otherwise)")
    c.add_argument("--save-params", action="store_true", help="each rank saves its final parameters in the run dir")
    c.add_argument("--json", action="store_true", help="print the result as JSON instead of progress lines")
    p.add_argument("--torchrun", metavar="HOST:PORT", default=None,
                   help="a topology of several machines: write the run folder (--run-dir, the same path on every "
                        "machine) and print each machine's torchrun command, rendezvous at HOST:PORT of the first; "
                        "--checkpoint-dir must be shared by every machine")
    p.add_argument("--adaptive-k", action="store_true",
                   help="a pipelined plan (1f1b, kfkb, gpipe), gloo ranks: choose kFkB's block size k between "
                        "optimizer steps from the measured stage-to-stage transfer times, among 1, 2, 4, 8 that fit "
                        "in memory (Ada-Grouper; as tag execute --adaptive-k)")
    p.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)  # testing: RANK:STEP:exit|exit-in-checkpoint
    p.add_argument("--inject-delay", default=None, help=argparse.SUPPRESS)  # testing: RANKS:MS[:FROM[:TO]] (batches)
    p.set_defaults(func=run)


def run(args) -> int:
    from dataclasses import asdict

    from ..executor import ExecuteConfig
    from ..executor.train import TrainSpec, prepare_train_torchrun, print_line, train

    spec = TrainSpec(steps=args.steps, time_s=args.time, accumulate=args.accumulate, lr=args.lr,
                     warmup_steps=args.warmup_steps,
                     schedule=args.lr_schedule or ("cosine" if args.steps else "constant"), min_lr_ratio=args.min_lr_ratio,
                     clip=args.clip, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                     keep=args.keep_checkpoints, resume=args.resume, log_every=args.log_every,
                     tensorboard=args.tensorboard, wandb=args.wandb)
    cfg = ExecuteConfig(model=args.model, topology=args.topology, plan=args.plan, batch=args.batch,
                        optimizer=args.optimizer, seed=args.seed, groups=args.groups, steps=1, warmup=0,
                        backend=args.backend, timeout_s=args.timeout, run_dir=args.run_dir,
                        save_params=args.save_params, fault=args.inject_fault, precision=args.precision,
                        compile=args.compile, adaptive_k=args.adaptive_k, delay=args.inject_delay)
    if args.torchrun is not None:
        launch = prepare_train_torchrun(cfg, spec, args.torchrun)
        print_torchrun(launch, args.json, "the same path on every machine; run in order of the topology's "
                       "machines (rank 0 prints the progress lines):", args.torchrun)
        return 0
    res = train(cfg, spec, echo=None if args.json else print_line)
    if args.json:
        print_json({k: v for k, v in asdict(res).items() if k != "ranks"})
        return 0
    where = f"; latest checkpoint {res.checkpoint}" if res.checkpoint else ""
    if not res.data:
        where += "; no training data (a zoo model, or a factory returning none): every step ran on its example inputs"
    if res.step <= res.start_step:
        print(f"nothing to train: the checkpoint is at step {res.start_step}, where --steps ends")
        return 0
    print(f"trained steps {res.start_step + 1}..{res.step} ({'resumed' if res.start_step else 'from scratch'}); "
          f"metrics {res.metrics}{where}")
    return 0
