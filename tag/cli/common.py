"""Arguments and loaders shared by several commands."""

from __future__ import annotations

import argparse
import json
import sys


def add_model_args(p: argparse.ArgumentParser, *, groups: bool = True) -> None:
    p.add_argument("--model", required=True,
                   help="zoo name with overrides (e.g. gpt2:n_layer=4) or package.module:function factory")
    p.add_argument("--batch", type=int, default=None, help="global batch size (samples)")
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "sgd-plain"])
    p.add_argument("--seed", type=int, default=0, help="random seed for weights and inputs")
    if groups:
        p.add_argument("--groups", type=int, default=48, help="number of op-groups (default 48)")


def load_captured(args):
    """Workload + capture from ``--model/--batch/--optimizer/--groups/--seed``."""
    from ..graph import capture
    from ..workloads import load_workload

    if args.batch is not None and args.batch < 1:
        from ..errors import WorkloadError
        raise WorkloadError(f"--batch: expected a positive integer, got {args.batch}")
    wl = load_workload(args.model, batch=args.batch, seed=args.seed)
    return wl, capture(wl, optimizer=args.optimizer, num_groups=getattr(args, "groups", 48))


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=1)
    sys.stdout.write("\n")
