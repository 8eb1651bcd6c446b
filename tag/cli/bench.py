"""``tag bench``: TAG against every baseline on the same simulator, models and clusters."""

from __future__ import annotations

from .common import MAX_BUDGET, OUTSIDE, add_ray_arg, backend_of, int_in


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark TAG against the baselines and write a report",
                       description="Run a benchmark suite (models x topologies x methods) and write raw results "
                                   "(CSV, JSON), the config and library versions, a Markdown report and plots. "
                                   "Rerunning with the same --out resumes a killed run.")
    p.add_argument("--suite", choices=["quick", "full", "scale"], default="quick", help="benchmark suite")
    p.add_argument("--out", default=None, help=f"output folder (default: evaluation/results/<suite>-<date> {OUTSIDE})")
    p.add_argument("--methods", default=None, help="comma-separated subset of methods")
    p.add_argument("--topologies", default=None,
                   help="comma-separated subset of the suite's topologies (runs sharing --out fill one "
                        "cells.jsonl; a final run without filters writes the whole report)")
    p.add_argument("--model", dest="models", action="append", default=None, metavar="SPEC",
                   help="run only this model of the suite (its spec as the report names it; repeatable)")
    p.add_argument("--budget", type=int_in(1, MAX_BUDGET), default=None, metavar="N",
                   help="playouts of random / sa / tpe / mcts-uniform (default: the suite's; TAG's budget is in "
                        "its method name)")
    p.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"],
                   help="training precision of every model (default: the suite's)")
    p.add_argument("--workers", type=int_in(1, 256), default=1, metavar="N",
                   help="cells run at once in local processes (default 1: one after the other in this process)")
    add_ray_arg(p, "cells")
    p.set_defaults(func=run)


def run(args) -> int:
    import time
    from pathlib import Path

    from ..bench import METHODS, SUITES, environment, run_suite, save_results, write_report
    from ..errors import TagError
    from ..io import output_dir

    cfg = SUITES[args.suite]()
    if args.precision:
        cfg.precision = args.precision
    if args.budget is not None:  # (1..MAX_BUDGET: argparse)
        cfg.search_budget = args.budget
    if args.methods:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise TagError(f"--methods: unknown method {bad[0]!r}; expected some of {','.join(METHODS)}")
        cfg.methods = methods
    if args.topologies:
        want = [t.strip() for t in args.topologies.split(",") if t.strip()]
        known = cfg.topologies + cfg.execute_topologies
        bad = [t for t in want if t not in known]
        if bad:
            raise TagError(f"--topologies: {bad[0]!r} is not in suite {cfg.name!r}; expected some of {','.join(known)}")
        cfg.topologies = [t for t in cfg.topologies if t in want]
        cfg.execute_topologies = [t for t in cfg.execute_topologies if t in want]
    if args.models:
        want = [m.strip() for m in args.models]
        known = [m.spec for m in cfg.models]
        bad = [m for m in want if m not in known]
        if bad:
            raise TagError(f"--model: {bad[0]!r} is not in suite {cfg.name!r}; expected one of {known}")
        cfg.models = [m for m in cfg.models if m.spec in want]
    out = Path(args.out or output_dir(f"evaluation/results/{cfg.name}-{time.strftime('%Y-%m-%d')}"))
    t0 = time.perf_counter()
    cells, resumed = run_suite(cfg, out, backend_of(args, args.workers))
    save_results(cells, out)
    report = write_report(cells, out, cfg.name, environment(), time.perf_counter() - t0, resumed=resumed)
    print(f"wrote {report}")
    return 0
