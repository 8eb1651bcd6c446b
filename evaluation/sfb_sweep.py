"""Where does Sufficient Factor Broadcasting pay? All-reduce vs SFB across links and batch sizes.

For a wide MLP and GPT-2, on 8 devices over slow (1 and 10 Gbit/s) and fast (100 Gbit/s,
NVSwitch) links, with small and large per-device batches, this builds the even data-parallel
plan, lets :func:`tag.compress.plan_sfb` choose SFB ops per op-group (MILP), and tabulates the
gradient-sync time of the candidate gradients with plain all-reduce against the time with the
chosen SFB ops (factor all-gathers + recompute), from the SFB cost model
(:mod:`tag.compress.cost`; one bucketed sync and one bucketed gather per group, no overlap with
compute). The last two columns are whole-iteration times of both plans from ``tag.sim``,
which runs SFB as the executor does: after each group's backward, the factor all-gathers, then
every replica's recompute, then the remaining gradients' sync (docs/design.md).

    python -m evaluation.sfb_sweep [--out runs/sfb_sweep] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from tag.compress import allreduce_time, find_candidates, plan_sfb, sync_time
from tag.cost.baselines import data_parallel
from tag.graph import capture
from tag.io import write_atomic
from tag.parallel import apply_sfb, sfb_syncs
from tag.sim import Simulator
from tag.topology import load_topology
from tag.workloads import load_workload

MODELS = {  # name -> (spec, (small, large) per-device batch)
    "mlp-wide": ("mlp:hidden=4096,layers=3,in_dim=1024,classes=1000", (2, 256)),
    "gpt2-768": ("gpt2:n_layer=2,n_embd=768,n_head=12,seq=128,vocab=8192", (1, 16)),
}
QUICK = {
    "mlp-wide": ("mlp:hidden=1024,layers=2,in_dim=256,classes=100", (2, 256)),
    "gpt2-256": ("gpt2:n_layer=1,n_embd=256,n_head=4,seq=64,vocab=2048", (1, 16)),
}


def _v100_boxes(inter: str) -> dict:
    """4 machines x 2 V100 (NVLink inside) joined by ``inter`` Ethernet."""
    machines = [{"name": f"n{k}", "gpu": "V100-SXM2-16GB", "count": 2, "intra_bandwidth": "150 GB/s"}
                for k in range(4)]
    return {"name": f"4x2-v100-{inter.replace(' ', '')}", "machines": machines,
            "network": {"bandwidth": inter, "latency": "20 us"}}


def topologies() -> dict:
    """label -> Topology: two slow and two fast 8-device clusters."""
    return {
        "4x2 V100, 1 Gbit/s": load_topology(_v100_boxes("1 Gbit/s")),
        "4x2 V100, 10 Gbit/s": load_topology(_v100_boxes("10 Gbit/s")),
        "2x4 V100, 100 Gbit/s": load_topology("homogeneous-2x4-v100"),
        "8 A100 NVSwitch": load_topology("homogeneous-8xa100"),
    }


@dataclass
class Row:
    """One (model, topology, batch) cell; times in milliseconds."""

    model: str
    topology: str
    batch_per_device: int
    candidates_mm: int
    candidates_sum: int
    chosen_mm: int
    chosen_sum: int
    sync_allreduce_ms: float
    """Bucketed all-reduce of every candidate gradient, summed over groups."""
    sync_with_sfb_ms: float
    """The same minus the MILP's predicted saving."""
    top_op: str
    """The largest weight-gradient op (by gradient bytes)."""
    top_allreduce_ms: float
    top_sfb_ms: float
    """Its standalone SFB time (its factors' gathers + recompute)."""
    top_chosen: bool
    iter_dp_ms: float
    """Whole iteration of the data-parallel plan, ``tag.sim``."""
    iter_sfb_ms: float
    """Whole iteration with the chosen SFB ops, ``tag.sim``."""


def sweep(models: dict, topos: dict, devices: int = 8) -> list[Row]:
    rows = []
    for label, (spec, batches) in models.items():
        for per_dev in batches:
            graph = capture(load_workload(spec, batch=per_dev * devices), num_groups=8).graph
            cands = find_candidates(graph)
            for tname, topo in topos.items():
                sim = Simulator(graph, topo)
                plan = data_parallel(graph, topo)
                sels = plan_sfb(graph, topo, plan, candidates=cands, syncs=sfb_syncs())
                base = 0.0
                for s in sels:
                    gp = plan.groups[s.group]
                    base += sync_time(sum(d.candidate.grad_bytes for d in s.decisions), gp.devices, topo,
                                      gp.sync, gp.server)
                saving = sum(s.saving_s for s in sels)
                decisions = [d for s in sels for d in s.decisions]
                top = max(decisions, key=lambda d: d.candidate.grad_bytes)
                row = Row(label, tname, per_dev,
                          sum(c.kind == "mm" for c in cands), sum(c.kind == "sum" for c in cands),
                          sum(d.chosen and d.candidate.kind == "mm" for d in decisions),
                          sum(d.chosen and d.candidate.kind == "sum" for d in decisions),
                          base * 1e3, (base - saving) * 1e3, top.candidate.param,
                          allreduce_time(top.candidate.grad_bytes, plan.groups[0].devices, topo) * 1e3,
                          top.sfb_s * 1e3, top.chosen,
                          _simulate(sim, graph, topo, plan), _simulate(sim, graph, topo, apply_sfb(graph, topo, plan)))
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _simulate(sim: Simulator, graph, topo, plan) -> float:
    """Simulated iteration time (ms) of a validated plan."""
    plan.validate(graph, topo)
    return sim.run(plan.groups).iteration_time_s * 1e3


HEADER = ("| model | topology | b/dev | mm / sum cand. | SFB mm / sum | sync AR ms | sync SFB ms | "
          "largest weight | its AR ms | its SFB ms | picked | iter dp ms | iter SFB ms |")


def _line(r: Row) -> str:
    return (f"| {r.model} | {r.topology} | {r.batch_per_device} | {r.candidates_mm} / {r.candidates_sum} | "
            f"{r.chosen_mm} / {r.chosen_sum} | {r.sync_allreduce_ms:.3f} | {r.sync_with_sfb_ms:.3f} | "
            f"{r.top_op.removeprefix('model.')} | {r.top_allreduce_ms:.3f} | {r.top_sfb_ms:.3f} | "
            f"{'yes' if r.top_chosen else 'no'} | {r.iter_dp_ms:.3f} | {r.iter_sfb_ms:.3f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/sfb_sweep", help="folder for sfb_sweep.md and .json")
    ap.add_argument("--quick", action="store_true", help="smaller models (a CI smoke run)")
    args = ap.parse_args(argv)
    print(HEADER)
    print("|" + "---|" * HEADER.count(" | ") + "---|")
    rows = sweep(QUICK if args.quick else MODELS, topologies())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    note = ("Sync times from the SFB cost model (tag.compress.cost): ring/hierarchical all-reduce vs ring/"
            "hierarchical factor all-gather + recompute at datasheet fp32 x 0.7. Iteration times: tag.sim "
            "(syncs overlap the earlier groups' backward; SFB all-gathers and recompute run after each "
            "group's backward, before its remaining sync).")
    table = "\n".join([HEADER, "|" + "---|" * (HEADER.count(" | ") + 1)] + [_line(r) for r in rows])
    write_atomic(out / "sfb_sweep.md", f"# SFB sweep\n\n{note}\n\n{table}\n")
    write_atomic(out / "sfb_sweep.json", json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    print(f"\n{note}\nwrote {out / 'sfb_sweep.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
