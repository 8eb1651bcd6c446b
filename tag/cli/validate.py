"""``tag validate``: execute a set of plans and compare the simulator's predictions with reality.

Reports per plan the predicted and measured (median) iteration time, the median absolute
percentage error, the Spearman rank correlation, and a scatter plot (PNG) in ``--out``.
"""

from __future__ import annotations

from pathlib import Path

from .common import (
    MAX_BATCH,
    MAX_GROUPS,
    MAX_SEED,
    OUTSIDE,
    RawDescriptionHelpFormatter,
    add_force_arg,
    add_precision_arg,
    int_in,
)


def register(sub) -> None:
    p = sub.add_parser("validate", help="execute plans and compare predicted vs measured iteration times",
                       description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="workload spec (e.g. gpt2 or mlp:hidden=512)")
    p.add_argument("--topology", required=True, help="topology of this machine (e.g. topologies/local-cpu2.yaml)")
    p.add_argument("--plans", type=int_in(1), default=12, help="number of plans: baselines first, then varied (default 12)")
    p.add_argument("--only", default=None, metavar="NAME[,NAME...]",
                   help="run only the plans (of those --plans gives) whose names start with one of these, e.g. "
                        "dp-even,single-0,inter-op,pp2,tp (pp2: the pipelines, tp: tensor parallelism)")
    p.add_argument("--batch", type=int_in(1, MAX_BATCH), default=None,
                   help=f"global batch (1..{MAX_BATCH}; default: the model's)")
    p.add_argument("--groups", type=int_in(1, MAX_GROUPS), default=8, help="op-groups (default 8)")
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "sgd-plain"],
                   help="optimizer of the training step")
    add_precision_arg(p)
    p.add_argument("--steps", type=int_in(1), default=10, help="timed iterations per plan (default 10)")
    p.add_argument("--warmup", type=int_in(0), default=3, help="warm-up iterations per plan (default 3)")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help=f"seed of the varied plans (0..{MAX_SEED})")
    p.add_argument("--rounds", type=int_in(1), default=1,
                   help="execute every plan this many times, interleaved, and report the median (default 1; "
                        "use 5+ on a shared machine whose speed drifts: the report gives the rounds' own "
                        "round-to-round Spearman)")
    p.add_argument("--no-profile", action="store_true",
                   help="do not profile missing op-group/communication costs first")
    p.add_argument("--profile-dir", default=None,
                   help="profile database to predict with (default: OUT/profiles, measured afresh "
                        "first: CPU costs are only valid on the machine, and in the state, that measured them)")
    p.add_argument("--out", default=None, help=f"output folder (default: evaluation/results/validate-<topology> {OUTSIDE}); "
                                               "one that holds files only with --force")
    add_force_arg(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ..errors import TagError
    from ..executor.validate import validate
    from ..io import output_dir

    if args.plans < 1:
        raise TagError(f"--plans: expected a positive integer, got {args.plans}")
    if args.rounds < 1:
        raise TagError(f"--rounds: expected a positive integer, got {args.rounds}")
    out = args.out or str(output_dir(f"evaluation/results/validate-{Path(args.topology).stem}"))
    check_out_folder(out, args.force)
    report = validate(args.model, args.topology, out, n_plans=args.plans, batch=args.batch, groups=args.groups,
                      optimizer=args.optimizer, steps=args.steps, warmup=args.warmup, seed=args.seed,
                      profile=not args.no_profile, profile_dir=args.profile_dir, rounds=args.rounds,
                      precision=args.precision,
                      only=[x.strip() for x in args.only.split(",") if x.strip()] if args.only is not None else None)
    print(report.table())
    print(f"results: {out}/validation.json, plot: {out}/scatter.png")
    return 0


def check_out_folder(out: str, force: bool) -> None:
    """One-line TagError before any work where ``out`` is a file, cannot be written, or holds
    files and ``force`` is off: a checkout's default folder holds the committed results
    (evaluation/results/validate-local-cpu2), which a run would mix with its own."""
    from ..errors import TagError
    from ..io import check_folder, check_writable

    check_folder(out, TagError, "--out")
    check_writable(out, TagError, "--out")
    held = sorted(p.name for p in Path(out).iterdir()) if Path(out).is_dir() else []
    if held and not force:
        raise TagError(f"--out: {out} holds {len(held)} entries ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}); "
                       "pass --force to write into it, or give --out a new folder")
