"""``tag tune``: optuna search over the predictor's hyperparameters (resumable SQLite study)."""

from __future__ import annotations

from .common import MAX_SEED, OUTSIDE, add_ray_arg, backend_of, int_in, print_json, seconds


def register(sub) -> None:
    p = sub.add_parser(
        "tune", help="tune the GNN predictor's hyperparameters with optuna (resumable)",
        description="TPE over network width/depth/heads/dropout and optimiser settings, each trial trained on "
                    "labelled datasets (e.g. runs/predictor/round0) and scored by validation policy loss. Trials "
                    "are kept in <study-dir>/optuna.db, so re-running the command resumes the study.")
    p.add_argument("--data", nargs="+", required=True, metavar="DIR", help="labelled dataset folders")
    p.add_argument("--study-dir", default=None,
                   help=f"study folder (default: runs/tune {OUTSIDE})")
    p.add_argument("--trials", type=int, default=20, help="total trials to reach (default 20)")
    p.add_argument("--epochs", type=int, default=6, help="epochs per trial (default 6)")
    p.add_argument("--timeout", type=seconds, default=None, help="stop starting trials after S seconds (positive, finite)")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help=f"seed of the sampler and of training (0..{MAX_SEED})")
    p.add_argument("--wandb", choices=["offline", "online", "disabled"], default="offline",
                   help="wandb logging of the trials")
    p.add_argument("--parallel", type=int_in(1, 256), default=1, metavar="N",
                   help="trials asked at once and trained side by side, in N local processes or as Ray tasks "
                        "(default 1; the study depends on N, not on where its trials run)")
    add_ray_arg(p, "trials")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..training.tune import TuneConfig, tune
    where = {"study_dir": args.study_dir} if args.study_dir else {}
    cfg = TuneConfig(data=list(args.data), trials=args.trials, epochs=args.epochs, timeout=args.timeout,
                     seed=args.seed, wandb=args.wandb, parallel=args.parallel, **where)
    print_json(tune(cfg, backend_of(args, args.parallel)))
    return 0
