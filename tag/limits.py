"""Stated bounds of sizes that come from the user (arguments, plan files, workload specs),
checked wherever they enter: argparse (:mod:`tag.cli.common`), plan files
(:meth:`tag.plan.Plan.from_dict`) and :func:`tag.workloads.load_workload`. Imports nothing, so
that ``tag --help`` loads no torch or numpy."""

MAX_BATCH = 2**16
"""Largest global batch (samples): the batch is materialised as real example inputs on capture
(and by every rank of ``tag execute``); 2**16 samples of a GPT-2 sequence are already 512 MiB of
token ids."""

MAX_GROUPS = 4096
"""Most op-groups: at most the graph's costly ops; 4096 is beyond any zoo model's."""

MAX_SEED = 2**32 - 1
"""Largest random seed: seeds reach torch (int64), numpy and per-pair offsets (seed + 1000 * round);
2**70 overflowed torch's int64 (`tag plan --seed`, 2026-11-27)."""

MAX_BUDGET = 10**6
"""Most search playouts (``--budget``): a million is hours of simulator calls on a small graph
(gpt2 on 8 GPUs, ~1,000 playouts/s at best) and 500x the largest budget of the benchmarks
(2,000); a larger one would never end, and the tree it grows is held in memory."""
