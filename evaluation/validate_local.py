"""Validate the simulator against real gloo executions on this machine.

    .venv/bin/python evaluation/validate_local.py [--model gpt2] [--batch 16] [--plans 12] [--rounds 3] [--steps 30]
    .venv/bin/python evaluation/validate_local.py --repredict   # re-cost the stored runs, execute nothing

Writes evaluation/results/validate-<topology>/{validation.json, scatter.png, plans/, runs/}.
Measurements are wall-clock times of real processes: run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tag.executor.validate import validate

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--topology", default=str(ROOT / "topologies" / "local-cpu2.yaml"))
    p.add_argument("--plans", type=int, default=12)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="interleaved executions per plan (median)")
    p.add_argument("--repredict", action="store_true",
                   help="only re-cost the finished validation with the current simulator (no execution)")
    a = p.parse_args(argv)
    out = ROOT / "evaluation" / "results" / f"validate-{Path(a.topology).stem}"
    if a.repredict:
        from tag.executor.validate import repredict

        print(repredict(out).table())
        return 0
    report = validate(a.model, a.topology, out, n_plans=a.plans, batch=a.batch, groups=a.groups,
                      steps=a.steps, warmup=a.warmup, rounds=a.rounds)
    print(report.table())
    print(f"load average during the run: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
