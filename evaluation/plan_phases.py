"""Wall seconds of the phases of one ``tag plan`` run: wraps the planner's stages (the GNN
context, MCTS, the layout grid and its bounds, simulator runs, ...) with timers, runs the CLI with
the arguments given, and prints each timer's seconds and calls to stderr (nested timers overlap:
``Simulator.run`` falls within ``mcts_search`` and ``grid_search``).

    PYTHONPATH=. HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python evaluation/plan_phases.py plan \\
        --model llama-7b --precision bf16 --batch 512 --groups 128 --topology h100-512gpu --budget 50 \\
        --out /tmp/p.json --force

Run from another tree with ``PYTHONPATH=.`` there and this file's path: the timers wrap that
tree's ``tag``. Results: ``evaluation/results/sim-speed/scale.md`` (2026-11-27).
"""

from __future__ import annotations

import atexit
import functools
import importlib
import sys
import time

TIMERS = (  # (module, attribute, label)
    ("tag.search.space", "ActionSpace.__init__", "ActionSpace"),
    ("tag.search.evaluate", "Evaluator.__init__", "Evaluator()"),
    ("tag.planner", "_predictor", "load predictor"),
    ("tag.gnn.features", "JointContext.__init__", "JointContext"),
    ("tag.gnn.predictor", "Predictor.predict", "gnn.predict"),
    ("tag.planner", "mcts_search", "mcts_search"),
    ("tag.search.space", "ActionSpace._estimated_fit", "_estimated_fit"),
    ("tag.search.space", "ActionSpace.default_pipeline_key", "default_pipeline_key"),
    ("tag.search.layouts", "grid_search", "grid_search"),
    ("tag.search.layouts", "refine", "refine"),
    ("tag.sim.bounds", "static_bound", "static_bound"),
    ("tag.sim.bounds", "plan_bound", "plan_bound"),
    ("tag.sim.bounds", "_transfer_load", "_transfer_load"),
    ("tag.sim.engine", "Simulator.run", "Simulator.run"),
    ("tag.sim.engine", "Simulator.deploy", "sim.deploy"),
    ("tag.sim.engine", "build_program", "build_program"),
    ("tag.sim.event_loop", "Run.__init__", "Run.__init__"),
    ("tag.sim.event_loop", "Run.execute", "Run.execute"),
    ("tag.sim.units", "PairTemplate.__init__", "PairTemplate()"),
    ("tag.sim.tensor_parallel", "tp_layout", "tp_layout"),
    ("tag.planner", "_compress", "compress"),
)


def wrap(module: str, attr: str, label: str, seconds: dict) -> None:
    """Replace ``module.attr`` by a timer adding its wall seconds and calls to ``seconds[label]``
    (``functools.wraps``: the wrapped method keeps its name and signature)."""
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            x = seconds.setdefault(label, [0.0, 0])
            x[0] += time.perf_counter() - t
            x[1] += 1

    setattr(owner, name, timed)


def main() -> int:
    t0 = time.perf_counter()
    seconds: dict[str, list] = {}
    for module, attr, label in TIMERS:
        wrap(module, attr, label, seconds)

    def report() -> None:
        print(f"total {time.perf_counter() - t0:.2f}", file=sys.stderr)
        for label, (s, n) in seconds.items():
            print(f"{label:22s} {s:8.2f} s {n:6d} calls", file=sys.stderr)

    atexit.register(report)
    from tag.cli import entry

    sys.argv = ["tag"] + sys.argv[1:]
    return entry()


if __name__ == "__main__":
    sys.exit(main())
