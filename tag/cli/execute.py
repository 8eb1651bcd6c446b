"""``tag execute``: run a plan for real, one process per topology device, and time it.

On one machine without GPUs: one gloo process per device; with a GPU per device: NCCL.
Across machines: ``--run-dir DIR --torchrun HOST:PORT`` writes the run folder and prints the
torchrun command of each machine; ``--run-dir DIR --report`` reports the finished run
(docs/executor.md). Prints the measured median iteration time next to the
simulator's prediction (``--json``: the whole result; ``--out``: also written to a file).
"""

from __future__ import annotations

import argparse

from .common import (
    RawDescriptionHelpFormatter,
    add_compile_arg,
    add_force_arg,
    add_launch_args,
    check_outputs,
    int_in,
    print_json,
    print_torchrun,
    seconds,
)


def register(sub) -> None:
    p = sub.add_parser("execute", help="run a plan on torch.distributed and measure it",
                       description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    add_execute_args(p)
    p.add_argument("--plan", required=True, help="plan JSON (from `tag plan`)")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("--out", default=None, help="also write the result JSON here")
    add_force_arg(p)
    p.add_argument("--save-params", action="store_true", help="each rank saves its final parameters in the run dir")
    add_compile_arg(p, "during the warm-up iterations")
    p.add_argument("--bucket-bytes", type=int_in(1), default=None,
                   help="cap of the gradient buckets in bytes (default: DDP's, a first bucket of 1 MiB, "
                        "then 25 MiB); the prediction uses the same")
    p.add_argument("--torchrun", metavar="HOST:PORT", default=None,
                   help="a topology of several machines: check and predict the plan, write the run folder "
                        "(--run-dir, needed on every machine at the same path) and print each machine's torchrun "
                        "command, rendezvous at HOST:PORT of the first machine (the first the plan uses: machines it "
                        "leaves idle get no command); run them, then this command "
                        "again with --report in place of --torchrun")
    p.add_argument("--report", action="store_true",
                   help="report a finished --torchrun run of --run-dir (measured vs predicted, trace.json)")
    p.add_argument("--adaptive-k", action="store_true",
                   help="a pipelined plan (1f1b, kfkb, gpipe): choose kFkB's block size k between iterations from the "
                        "measured stage-to-stage transfer times, among 1, 2, 4, 8 that fit in memory (Ada-Grouper)")
    p.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)  # testing: RANK:ITER:raise|exit|hang
    p.add_argument("--inject-delay", default=None, help=argparse.SUPPRESS)  # testing: RANKS:MS[:FROM[:TO]]
    p.set_defaults(func=run)


def add_execute_args(p: argparse.ArgumentParser) -> None:
    """Options shared with ``tag validate``."""
    add_launch_args(p, "workload spec the plan was made for (e.g. gpt2:n_layer=2)")
    p.add_argument("--steps", type=int_in(1), default=10, help="timed iterations (default 10)")
    p.add_argument("--warmup", type=int_in(0), default=3, help="untimed warm-up iterations (default 3)")
    p.add_argument("--emulate-speed", action="store_true",
                   help="slow each rank down by (fastest device FP32 FLOP/s / its own) to emulate the "
                        "topology's heterogeneous devices on identical CPUs (off by default)")
    p.add_argument("--timeout", type=seconds, default=120.0,
                   help="seconds any rank may wait on a peer before the run fails (default 120)")
    p.add_argument("--run-dir", default=None, help="folder for worker results, logs and trace.json, kept (default: a temporary folder, "
                        "removed after success)")


def run(args) -> int:
    from ..errors import TagError
    from ..executor import ExecuteConfig, execute, prepare_torchrun, report_torchrun
    from ..io import write_json

    check_outputs(args, out=args.out)
    cfg = ExecuteConfig(model=args.model, topology=args.topology, plan=args.plan, batch=args.batch,
                        optimizer=args.optimizer, seed=args.seed, groups=args.groups, steps=args.steps,
                        warmup=args.warmup, backend=args.backend, emulate_speed=args.emulate_speed,
                        timeout_s=args.timeout, run_dir=args.run_dir, save_params=args.save_params,
                        fault=args.inject_fault, precision=args.precision, bucket_bytes=args.bucket_bytes,
                        compile=args.compile, adaptive_k=args.adaptive_k, delay=args.inject_delay)
    if args.torchrun is not None and args.report:
        raise TagError("--torchrun prepares a run, --report reads a finished one: expected one of them")
    if args.torchrun is not None:
        launch = prepare_torchrun(cfg, args.torchrun)
        print_torchrun(launch, args.json, "copy it to every machine at the same path (or share it), then run in "
                       "order of the topology's machines:", args.torchrun)
        if not args.json:
            print("then this command with --report in place of --torchrun on the first machine")
        return 0
    res = report_torchrun(cfg) if args.report else execute(cfg)
    d = res.to_dict()
    if args.out:
        write_json(args.out, d)
    if args.json:
        print_json(d)
        return 0
    pred = res.predicted_iteration_time_s
    from ..topology.units import format_count

    print(f"{res.model} on {res.topology} ({format_count(res.world_size, 'rank')}, {res.backend}): "
          f"measured {res.measured_iteration_time_s * 1e3:.2f} ms/iteration (median of {res.steps})"
          + (f", predicted {pred * 1e3:.2f} ms ({(pred / res.measured_iteration_time_s - 1) * 100:+.1f}%)"
             if pred else ""))
    for r in res.ranks:
        print(f"  rank {r['rank']} ({r['device']}): {r['median_time_s'] * 1e3:.2f} ms")
    if res.idle_machines:
        print(f"  not launched on {', '.join(res.idle_machines)}: the plan leaves them idle")
    print(f"  losses: {', '.join(f'{x:.4f}' for x in res.losses)}")
    ks = [it["k"] for it in res.ranks[0]["iterations"] if "k" in it] if res.ranks else []
    if ks:
        print(f"  kFkB block size per iteration: {', '.join(map(str, ks))}")
    return 0
