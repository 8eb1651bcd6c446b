"""Optimizer offload (issue 52): models whose training state fits no GPU set of the machine:
``tag plan``'s plan (``tag plan --budget 50 --seed 0 --json --out``, the plan then simulated as
``tag simulate --plan``), and layouts with and without ``offload=optimizer`` simulated as
``tag simulate --layout L --allow-oom --json``.

    python -m evaluation.offload_figures [--out evaluation/results/offload] [--budget 50]

Cases: a Llama-2 13B shape in bf16 (seq 2048, batch 8) on one machine of 4 x A10 (24 GB) with
256 GB of host memory and 25 GB/s of host bandwidth (``a10-4gpu-256g.yaml``), and PatrickStar's
``GPT3_12B`` (60 layers of width 4096, 16 heads, seq 1024; GPT-2's vocabulary) in fp16, batch 128
(16 a GPU, its benchmark script's default), on 8 x V100-SXM2-32GB with 240 GB of host memory
(``v100-8gpu-240g.yaml``). Writes ``results.json``: per layout the iteration seconds, whether it
is out of memory, the largest device peak and the host's bytes; ``params`` per model (the
captured graph's) for the FLOP rates (``8 N`` a token, PatrickStar's count with recomputation).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tag.io import write_json
from tag.planner import model_graph

HERE = Path(__file__).resolve().parent / "results" / "offload"
GPT12B = "gpt2:n_layer=60,n_embd=4096,n_head=16,seq=1024"
CASES = {
    "llama-13b": ("llama-13b", "bf16", 8, "a10-4gpu-256g.yaml",
                  ["dp=4,zero=3,recompute=1", "dp=4,zero=3,recompute=1,offload=optimizer", "dp=1,tp=4,recompute=1",
                   "dp=1,pp=4,micro=8,recompute=1,stages=9+11+10+10",
                   "dp=1,pp=4,micro=8,recompute=1,stages=9+11+10+10,zero=2,offload=optimizer"]),
    "gpt3-12b": (GPT12B, "fp16", 128, "v100-8gpu-240g.yaml",
                 ["dp=8,zero=3,recompute=1", "dp=8,zero=3,recompute=1,offload=optimizer",
                  "dp=2,pp=4,micro=16,zero=3,recompute=1,offload=optimizer",
                  "dp=1,pp=8,micro=16,zero=2,recompute=1,offload=optimizer", "dp=1,pp=8,micro=128,recompute=1"]),
}


TAG = [sys.executable, "-c", "import sys; from tag.cli import entry; sys.exit(entry())"]


def simulate(model: str, precision: str, batch: int, topology: Path, layout: str, plan: Path | None = None) -> dict:
    what = ["--plan", str(plan)] if plan is not None else ["--layout", layout]
    cmd = [*TAG, "simulate", "--model", model, "--precision", precision, "--batch",
           str(batch), "--topology", str(topology), *what, "--allow-oom", "--json"]
    d = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {"layout": layout, "iteration_time_s": d["iteration_time_s"], "oom": d["oom"],
            "peak_memory_bytes": max(d["peak_memory_bytes"]), "memory_capacity_bytes": d["devices"][0]["memory_capacity_bytes"],
            "host_memory_bytes": d.get("host_memory_bytes", []), "host_oom": d.get("host_oom", [])}


def plan(model: str, precision: str, batch: int, topology: Path, budget: int, out: Path) -> dict:
    """``tag plan``'s plan (the executable ones, its default) and the plan simulated again."""
    cmd = [*TAG, "plan", "--model", model, "--precision", precision, "--batch", str(batch), "--topology",
           str(topology), "--budget", str(budget), "--seed", "0", "--json", "--out", str(out)]
    t0 = time.perf_counter()
    d = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    wall = time.perf_counter() - t0
    with open(out) as f:
        groups = json.load(f)["groups"]
    sim = simulate(model, precision, batch, topology, d.get("layout") or "", plan=out)
    keep = ("predicted_iteration_time_s", "source", "layout", "refinement", "pipeline", "fsdp_time_s", "best_layout",
            "best_layout_time_s", "layouts", "layouts_tried", "playouts", "sim_calls")
    shown = [x.replace(str(HERE.parents[2]) + "/", "") for x in cmd[3:-2]] + ["--out", "PLAN.json"]
    return {"command": " ".join(["tag", *shown]), "wall_s": wall, **{k: d.get(k) for k in keep},
            "offloaded_groups": sum(bool(g.get("offload")) for g in groups), "groups": len(groups),
            "syncs": sorted({g["sync"] for g in groups}), "simulated": sim}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--budget", type=int, default=50, help="tag plan's playouts (default 50)")
    args = ap.parse_args(argv)
    out: dict = {}
    for name, (model, precision, batch, topo, layouts) in CASES.items():
        graph = model_graph(model, batch, optimizer="adam", precision=precision, seed=0, num_groups=48)[0]
        tokens = batch * int(model.split("seq=")[1]) if "seq=" in model else batch * 2048
        with tempfile.TemporaryDirectory() as tmp:
            planned = plan(model, precision, batch, HERE / topo, args.budget, Path(tmp) / "plan.json")
        print(f"{name} tag plan: {planned['predicted_iteration_time_s']} s, {planned['layout']} "
              f"({planned['offloaded_groups']} of {planned['groups']} groups offloaded)", flush=True)
        out[name] = {"model": model, "precision": precision, "batch": batch, "topology": topo, "tokens": tokens,
                     "params": sum(p.numel for p in graph.params), "plan": planned,
                     "runs": [simulate(model, precision, batch, HERE / topo, lay) for lay in layouts]}
        for r in out[name]["runs"]:
            print(f"{name} {r['layout']}: {r['iteration_time_s']:.3f} s, oom {r['oom']}, "
                  f"peak {r['peak_memory_bytes'] / 2**30:.1f} GiB", flush=True)
    write_json(args.out / "results.json", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
