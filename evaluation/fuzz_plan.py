"""Fuzz campaign: ``tag plan`` and ``tag simulate --layout`` over random model x batch x cluster
cases; every case must end in a plan (exit 0) or one line naming what cannot be done (exit 2),
never a traceback, another exit status or an exception out of ``tag.cli.main``.

A case: a small zoo model (GPT-2, BERT, Llama, ViT, MLP, ResNet, VGG; sizes that capture in
seconds), a batch (1, primes, fewer samples than devices, a device count plus or minus one), a
topology (a shipped one, or a generated one of 1-6 machines of 1-8 catalog GPUs of mixed kinds,
one machine or many, with a network, some zones), a precision and either ``tag plan`` (a budget of
2-12 playouts) or ``tag simulate --layout`` with a random layout (degrees that may not fit: a
one-line refusal is a pass). Cases run in this process (``tag.cli.main``), one after another.

    .venv/bin/python evaluation/fuzz_plan.py [--cases 200] [--seed 0] [--out FILE.json]

Prints one line per failure and the tally; ``--out`` writes the cases, their exit statuses and
the failures as JSON, every ``CHECKPOINT_CASES`` cases and at the end (``done`` of ``cases``). ``tests/test_issue_cases.py`` runs a few cases of it (hypothesis draws the
seeds).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import yaml

MODELS = ["gpt2:n_layer=2,n_embd=64,n_head=2,vocab=100,seq=16",
          "gpt2:n_layer=3,n_embd=32,n_head=2,vocab=64,seq=8,attn=sdpa",
          "bert:n_layer=2,n_embd=32,n_head=2,vocab=64,seq=16",
          "llama:n_layer=2,n_embd=32,n_head=2,n_kv_head=1,ffn=64,vocab=64,seq=16",
          "vit:n_layer=2,n_embd=32,n_head=2,image=16,patch=8", "mlp", "mlp:layers=5,hidden=64",
          "resnet:depth=18,width=8,image=16", "vgg:depth=11,width=8,image=32,hidden=32"]
SHIPPED = ["local-cpu2", "local-cpu4", "homogeneous-2x4-v100", "homogeneous-8xa100", "mixed-a100-v100",
           "cluster-16gpu-4m", "tag-testbed", "cloud-t4"]
KINDS = ["V100-SXM2-16GB", "A100-40GB", "A100-80GB", "T4", "H100-SXM", "L4", "P100-PCIe-16GB", "GTX-1080Ti"]
PRIMES = [2, 3, 5, 7, 11, 13, 17, 31]
CHECKPOINT_CASES = 10
"""``--out`` is rewritten after every this many cases (``done``: how many it holds)."""


@dataclass
class Case:
    """One run of the campaign."""

    command: str
    """``plan`` or ``layout`` (``tag simulate --layout``)."""
    model: str
    batch: int
    topology: str | dict
    """A shipped name, or a generated topology (the loader's mapping)."""
    devices: int
    precision: str
    budget: int = 0
    layout: str = ""
    seed: int = 0


def random_topology(rng: np.random.Generator) -> dict:
    """1-6 machines of 1-8 GPUs of catalog kinds (one kind or mixed), a network, some zones."""
    machines = []
    for m in range(int(rng.integers(1, 7))):
        count = int(rng.choice([1, 2, 3, 4, 8]))
        entry = {"name": f"m{m}", "gpu": str(rng.choice(KINDS)), "count": count}
        if count > 1:
            entry["intra_bandwidth"] = f"{int(rng.choice([10, 150, 300]))} GB/s"
        machines.append(entry)
    topo = {"name": "fuzz", "machines": machines}
    if len(machines) > 1:
        topo["network"] = {"bandwidth": f"{int(rng.choice([10, 25, 100, 400]))} Gbit/s"}
        if rng.random() < 0.3:  # the first two machines share a faster zone
            for entry in machines[:2]:
                entry["zone"] = "z"
            topo["network"]["zones"] = [{"name": "z", "bandwidth": "200 Gbit/s"}]
    return topo


def random_case(rng: np.random.Generator) -> Case:
    """A case drawn from ``rng`` (see the module docstring)."""
    from tag.topology import load_topology

    if rng.random() < 0.4:
        topology: str | dict = str(rng.choice(SHIPPED))
        devices = load_topology(topology).num_devices
    else:
        topology = random_topology(rng)
        devices = sum(m["count"] for m in topology["machines"])
    batch = int(rng.choice([1, *PRIMES, max(1, devices - 1), devices + 1, 2 * devices, 64]))
    case = Case("plan" if rng.random() < 0.6 else "layout", str(rng.choice(MODELS)), batch, topology, devices,
                str(rng.choice(["fp32", "fp32", "bf16"])), seed=int(rng.integers(0, 1000)))
    if case.command == "plan":
        case.budget = int(rng.integers(2, 13))
    else:
        tp = int(rng.choice([1, 1, 2, 4]))
        pp = int(rng.choice([1, 2, 3, 4]))
        dp = max(1, devices // (tp * pp)) if rng.random() < 0.8 else int(rng.integers(1, 9))
        case.layout = f"dp={dp},tp={tp},pp={pp},micro={int(rng.choice([1, 2, 4, 8]))}"
    return case


def argv_of(case: Case, folder: Path) -> list[str]:
    """The ``tag`` command line of ``case`` (a generated topology written into ``folder``)."""
    topo = case.topology
    if isinstance(topo, dict):
        path = folder / "topology.yaml"
        path.write_text(yaml.safe_dump(topo))
        topo = str(path)
    common = ["--model", case.model, "--batch", str(case.batch), "--topology", topo, "--precision", case.precision]
    if case.command == "plan":
        return ["plan", *common, "--budget", str(case.budget), "--seed", str(case.seed), "--groups", "6",
                "--compression", "off"]
    return ["simulate", *common, "--groups", "6", "--layout", case.layout]


def run_case(case: Case) -> tuple[int, str]:
    """``(exit status, stderr)`` of ``case`` run by ``tag.cli.main`` in this process; an exception
    out of it is status -1 with its type and message as stderr."""
    from tag.cli import main

    err = io.StringIO()
    with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(err):
        try:
            rc = main(argv_of(case, Path(d)))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 2
        except Exception as e:  # noqa: BLE001 - what the campaign looks for
            return -1, f"{type(e).__name__}: {e}"
    return rc, err.getvalue()


def failure(rc: int, err: str) -> str | None:
    """Why a case's outcome is not a plan or one line (None: it is)."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    if rc == 0:
        return None
    if rc != 2:
        return f"exit {rc}: {lines[-1] if lines else ''}"
    if "Traceback" in err or len([ln for ln in lines if ln.startswith("tag ")]) != 1:
        return f"not one line: {' | '.join(lines[-3:])}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the cases and failures as JSON here (rewritten every "
                   f"{CHECKPOINT_CASES} cases: a campaign stopped early keeps what it ran)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    t0, records, failures, statuses = time.perf_counter(), [], [], {}

    def write(done: int) -> None:
        if args.out:
            from tag.io import write_json

            write_json(args.out, {"cases": args.cases, "done": done, "seed": args.seed,
                                  "seconds": time.perf_counter() - t0, "statuses": statuses, "failures": failures,
                                  "records": records})

    for i in range(args.cases):
        case = random_case(rng)
        rc, err = run_case(case)
        why = failure(rc, err)
        statuses[rc] = statuses.get(rc, 0) + 1
        records.append({**asdict(case), "rc": rc, "failure": why})
        if why is not None:
            failures.append(records[-1])
            print(f"case {i}: {' '.join(argv_of(case, Path('T')))}: {why}", flush=True)
        if (i + 1) % CHECKPOINT_CASES == 0:
            write(i + 1)
    seconds = time.perf_counter() - t0
    print(f"{args.cases} cases (seed {args.seed}) in {seconds:.0f} s: {statuses.get(0, 0)} plans, "
          f"{statuses.get(2, 0)} one-line refusals, {len(failures)} failures")
    write(args.cases)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
