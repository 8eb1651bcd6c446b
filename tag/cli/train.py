"""``tag train``: train the planner's GNN predictor (AlphaZero-style generate -> train rounds)."""

from __future__ import annotations

from .common import (
    MAX_SEED,
    OUTSIDE,
    add_force_arg,
    add_ray_arg,
    backend_of,
    check_outputs,
    int_in,
    print_json,
)


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train the GNN predictor: MCTS-labelled data, then fit, for several rounds",
        description="AlphaZero-style loop: label random (model, topology) pairs with MCTS (round 0: uniform "
                    "prior; later rounds: the previous round's network), fit policy (cross-entropy against the "
                    "visit distribution) and value (final plan's log time ratio), repeat. Everything resumes "
                    "after an interruption. The defaults are the recipe of the shipped tag/gnn/predictor.pt (docs/training.md).")
    p.add_argument("--config", metavar="FILE.json", default=None,
                   help="LoopConfig JSON (fields as in tag/training/config.py); flags below override it")
    p.add_argument("--run-dir", default=None, help=f"run folder (default: runs/predictor {OUTSIDE})")
    p.add_argument("--rounds", type=int, default=None, help="generate/train rounds (default 3)")
    p.add_argument("--samples", type=int, nargs="+", default=None, metavar="N",
                   help="pairs labelled per round (last value repeats; default 240 80)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per round (default 6)")
    p.add_argument("--workers", type=int, default=None, help="labelling processes (default 2)")
    p.add_argument("--playouts", type=int, default=None, help="MCTS playouts per labelled decision (default 32)")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=None, help=f"seed of pairs, searches and training (0..{MAX_SEED}; default 0)")
    p.add_argument("--large-fraction", type=float, default=None, metavar="F",
                   help="share of the pairs drawn at scale, 48-256 GPUs (default 0.25)")
    p.add_argument("--large-inputs", choices=["zoo", "full"], default=None,
                   help="inputs of the models at scale: the zoo's small defaults, or 512 tokens / 224x224 "
                        "images (default full)")
    p.add_argument("--label-children", type=int, default=None, metavar="N",
                   help="at the first N labelled decisions of each pair simulate every action's own plan once, "
                        "not only the searched ones (default 8)")
    p.add_argument("--coarse-above", type=int, default=None, metavar="D",
                   help="encode clusters of more than D devices with one node per machine (default 32)")
    p.add_argument("--wandb", choices=["offline", "online", "disabled"], default=None,
                   help="wandb logging (default offline, files inside the run folder)")
    p.add_argument("--export", default=None, metavar="FILE",
                   help="copy the final checkpoint here (a file that exists only with --force)")
    p.add_argument("--no-plan-head", action="store_true",
                   help="skip fitting the plan head (the prior over pipeline decisions) after the last round")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume a run folder under a config other than the one it was started with (rounds "
                        "made under both are then mixed; without it such a resume is refused)")
    add_ray_arg(p, "pairs to label")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_force_arg(p)
    p.set_defaults(func=run)


def build_config(args):
    """The run's config: ``--config``'s, else the config the run folder was started with (resuming
    it), else the defaults; then the flags."""
    from ..training.config import LoopConfig
    from ..training.loop import started_config
    cfg = LoopConfig.load(args.config) if args.config else None
    if cfg is None:
        run_dir = args.run_dir if args.run_dir is not None else LoopConfig().run_dir
        cfg = started_config(run_dir) or LoopConfig()
    if args.run_dir is not None:
        cfg.run_dir = args.run_dir
    if args.no_plan_head:
        cfg.plan_head = False
    if args.rounds is not None:
        cfg.rounds = args.rounds
    if args.samples is not None:
        cfg.samples_per_round = list(args.samples)
    if args.epochs is not None:
        cfg.train.epochs = args.epochs
    if args.workers is not None:
        cfg.gen.workers = args.workers
    if args.playouts is not None:
        cfg.gen.playouts_per_step = args.playouts
    if args.seed is not None:
        cfg.gen.seed = cfg.train.seed = args.seed
    if args.large_fraction is not None:
        cfg.gen.large_fraction = args.large_fraction
    if args.large_inputs is not None:
        cfg.gen.large_inputs = args.large_inputs
    if args.label_children is not None:
        cfg.gen.label_children = args.label_children
    if args.coarse_above is not None:
        cfg.coarse_above = args.coarse_above
    if args.wandb is not None:
        cfg.wandb = args.wandb
    if args.export is not None:
        cfg.export = args.export
    # re-validate after the overrides (one-line errors): the file was valid, so a flag is at fault
    from ..training.config import ConfigError
    try:
        return LoopConfig.from_dict(cfg.to_dict(), source="")
    except ConfigError as e:
        field, _, rest = str(e).removeprefix(": ").partition(": ")
        flag = FLAG_OF.get(field)
        raise ConfigError(f"{flag}: {rest}" if flag else f"{args.config or 'tag train'}: {field}: {rest}") from None


FLAG_OF = {"rounds": "--rounds", "samples_per_round": "--samples", "train.epochs": "--epochs", "workers": "--workers",
           "playouts_per_step": "--playouts", "large_fraction": "--large-fraction", "large_inputs": "--large-inputs",
           "label_children": "--label-children", "coarse_above": "--coarse-above", "wandb": "--wandb"}
"""The flag that sets each field (as :class:`tag.training.config.ConfigError` names it), to name it in errors."""


def new_export(args, cfg) -> str | None:
    """The file ``--export`` (or ``--config``'s export) asks for, to be checked as a new output
    (one that exists only with --force: the shipped tag/gnn/predictor.pt was overwritten so), or
    None: none asked, the run's own export resumed with it (written by the run before), or the
    run's own final checkpoint (left as it is)."""
    from pathlib import Path

    from ..training.config import LoopConfig

    asked = args.export if args.export is not None else (LoopConfig.load(args.config).export if args.config else None)
    if not asked or Path(asked).resolve() == (Path(cfg.run_dir) / "predictor.pt").resolve():
        return None
    return asked


def run(args) -> int:
    import time

    from ..training.loop import run_loop
    cfg = build_config(args)
    check_outputs(args, export=new_export(args, cfg))
    t0 = time.perf_counter()
    final = run_loop(cfg, progress=not args.no_progress, allow_changed=args.allow_config_change,
                     backend=backend_of(args, cfg.gen.workers))
    print_json({"checkpoint": str(final), "run_dir": cfg.run_dir, "wall_seconds": time.perf_counter() - t0})
    return 0
