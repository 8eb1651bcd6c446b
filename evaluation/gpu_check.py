"""The GPU check: what only a GPU can show, in one run of under 8 minutes on one GPU.

For a maintainer (or a lent machine) with one NVIDIA GPU and a CUDA build of torch:

    PYTHONPATH=. python -m evaluation.gpu_check --out DIR [--budget 420] [--workloads "spec@batch;spec@batch"]
    make gpu-check OUT=DIR
    PYTHONPATH=. python -m evaluation.gpu_check --out DIR --only-multi-gpu   # part 3 alone (2+ GPUs)
    make gpu-check OUT=DIR GPU_CHECK_ARGS=--only-multi-gpu

writes ``DIR/gpu-check.jsonl`` (one record per measurement, the format of
``tag/cost/gpu_calib/<GPU>.jsonl``, so a new GPU type's records can be added there and fitted) and
``DIR/README.md`` (the table). It measures, on ``cuda:0``:

1. microbenchmarks: matmul in fp32, TF32 and bf16 at n = 256 / 1024 / 4096; a 3x3 convolution
   (128 channels, 56x56, batch 32) in PyTorch's default numerics (cuDNN TF32) and bf16; elementwise
   bandwidth; the time per tiny kernel launch;
2. per workload and precision (fp32, bf16 autocast): the eager training step
   (``model(*inputs)``, ``backward``, ``torch.optim.Adam`` with its default foreach update) and
   its peak memory; ``tag execute`` of the single-device plan on a one-GPU topology (NCCL, world
   size 1); the simulator's prediction for that plan (``tag.cost``: the fitted rates of this GPU
   type, else datasheet-derived) -- so each row gives execute / eager and predicted / eager; then
   ``tag execute`` of an MLP with dropout with every group recomputed and with none, whose losses
   must agree to the bit (the recomputation replays the CUDA generator's draws: ``dropout_replay``);
3. multi-rank (``--only-multi-gpu`` runs this part alone): first two ranks on ``cuda:0`` over gloo
   (NCCL refuses two ranks on one GPU; gloo copies CUDA tensors through host memory):
   :func:`tag.executor.equality.check_layouts` on ``gloo-cuda`` of
   :data:`~tag.executor.equality.SHARED_GPU_LAYOUTS` -- ``dp=2``, ``pp=2,micro=2,schedule=1f1b``,
   ``tp=2``, ``dp=2,zero=3`` and ``dp=2,zero=2,offload=optimizer``: the CUDA paths of several
   ranks (streams, events, the pipeline's messages staged through pinned host memory, the
   offloaded shard's copies), every rank's parameters against single-process training as below
   (one ``equality`` record each, backend ``gloo-cuda``; the rows' part leaves it
   :data:`SHARED_GPU_S` of ``--budget``); then with ``torch.cuda.device_count() >= 2``,
   :func:`tag.executor.equality.check_layouts` on NCCL -- ``tag execute --save-params`` of
   ``dp=2``, ``pp=2,micro=2,schedule=1f1b``, ``pp=2,micro=4`` (GPipe and kFkB), ``tp=2`` and with 4+
   GPUs ``dp=2,tp=2``, ``dp=2,pp=2`` and ``tp=2,pp=2`` (a tiny GPT-2 and the zoo MLP, 2 SGD steps,
   fp32, one GPU per rank) -- and every rank's parameters against single-process training on the
   CPU (:func:`tag.executor.reference_training`) with the executor's tolerance (rtol 1e-4, atol
   1e-6): one ``equality`` record per layout (max abs / rel difference, difference over tolerance,
   pass, seconds); with fewer GPUs one record ``skipped: N GPU(s); NCCL needs one GPU per rank``
   (and without a GPU one for the gloo part). With ``--only-multi-gpu`` the exit status is 1 when
   a layout fails.

Each eager step and each ``tag execute`` also runs one more, untimed step under
``torch.profiler``: its aten-op and kernel counts and kernel time (:mod:`tag.executor.profiling`).
Every row's eager step runs first, with nothing else on the CPU (host-bound steps are slowed by a
busy one; ``--passes N`` measures them N times, in passes over all rows, the row taking the median:
the spread between passes is the host's); then the rows' captures, plans and predictions (CPU, meta-device models, parallel
processes) and, in row order, their ``tag execute`` runs; then part 3. Work past ``--budget``
seconds is skipped and says so (``--skip-execute``: eager steps only); nothing here needs optuna
or wandb. The workloads default to the real-size zoo, :data:`WORKLOADS`.
Results on an H200: ``evaluation/results/gpu-check/``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = [
    ("gpt2-small", 8), ("bert-base", 8), ("resnet50", 32), ("vit-b16", 32), ("llama-1b", 4),
    ("gpt2-medium", 8), ("bert-large", 8), ("vgg16", 32), ("vit-l16", 32), ("resnet101", 32),
    ("gpt2-large", 8), ("resnet152", 32), ("vgg19", 32), ("gpt2-xl", 8),
]
"""The real-size zoo (``tag inspect --list``) at its preset batches, in order of priority (the
budget skips the last): one model of each family first, then the larger sizes. Llama-7B/13B are
left out: fp32 weights, gradients and Adam state alone (16 bytes per parameter: 108 / 208 GB) leave
no room for a step's activations on one 141 GB H200."""
SMALL_WORKLOADS = [
    ("gpt2:n_layer=6,n_embd=512,n_head=8,vocab=8192,seq=256", 16),
    ("resnet:depth=50,width=64,image=64", 64),
    ("gpt2:n_layer=12,n_embd=768,n_head=12,vocab=50257,seq=512", 8),
    ("evaluation/models/unseen.py:encoder", 64),
    ("llama:n_layer=8,n_embd=1024,n_head=16,seq=512", 8),
    ("bert:n_layer=12,n_embd=768,n_head=12,vocab=30522,seq=512", 8),
    ("vit-b16:attn=eager", 32),
]
"""The workloads of the 2026-11-26 H200 runs (``--workloads`` takes them as
``"spec@batch;..."``): the three of ``../shared/gpu-measurements/``'s execute-vs-eager table,
GPT-2 small at sequence 512, an SDPA encoder from a user factory, a Llama shape, ViT-B/16 with
eager attention."""
PRECISIONS = ("fp32", "bf16")


def _timed(fn, reps: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` on the GPU (CUDA events around each call)."""
    return statistics.median(_times(fn, reps, warmup))


def _times(fn, reps: int, warmup: int = 3) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn()`` on the GPU (CUDA events around each call)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return times


def microbenchmarks(common: dict) -> list[dict]:
    """Matmul, convolution, bandwidth and launch records (units: seconds, TFLOP/s, GB/s)."""
    import torch

    out = []
    dev = torch.device("cuda")
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    try:
        for dtype, tf32 in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            for n in (256, 1024, 4096):
                a = torch.randn(n, n, device=dev, dtype=dtype)
                b = torch.randn(n, n, device=dev, dtype=dtype)
                s = _timed(lambda a=a, b=b: a @ b, reps=20)
                out.append({"kind": "matmul", "dtype": str(dtype), "tf32": tf32, "n": n, "s": s,
                            "tflops": 2 * n**3 / s / 1e12, **common})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
    shape = [32, 128, 56, 56]
    for dtype in (torch.float32, torch.bfloat16):  # fp32: cuDNN's default TF32 convolutions
        x = torch.randn(*shape, device=dev, dtype=dtype)
        conv = torch.nn.Conv2d(128, 128, 3, padding=1, bias=False).to(dev, dtype)
        with torch.no_grad():
            s = _timed(lambda conv=conv, x=x: conv(x), reps=20)
        flops = 2 * shape[0] * shape[2] * shape[3] * 128 * 128 * 9
        out.append({"kind": "conv3x3", "dtype": str(dtype), "shape": shape, "s": s, "tflops": flops / s / 1e12,
                    **common})
    n = 2**27  # 512 MiB of fp32
    x = torch.empty(n, device=dev)
    y = torch.empty(n, device=dev)
    s = _timed(lambda: y.copy_(x), reps=20)
    out.append({"kind": "elementwise", "bytes": 2 * 4 * n, "s": s, "gbps": 2 * 4 * n / s / 1e9, **common})
    tiny = torch.zeros(1, device=dev)
    k = 1000

    def launches():
        for _ in range(k):
            tiny.add_(1.0)

    out.append({"kind": "launch", "s_per_kernel": _timed(launches, reps=5) / k, **common})
    return out


STEP_SECONDS = 2.0
"""Seconds of timed steps per row at most (between 5 and 20 steps): a GPT-2 XL fp32 step takes
over a second, a ResNet-50 bf16 one tens of milliseconds."""


def eager_step(spec: str, batch: int, precision: str, common: dict, steps: int = 20, profile: bool = True) -> dict:
    """One eager training step: median seconds over at most ``steps`` (after 3 warm-up; fewer
    where ``STEP_SECONDS`` would be exceeded, at least 5; each in ``times_s``) and peak bytes, and
    with ``profile`` the op and kernel tables of one more step. The model is built on the CPU (the
    zoo's own initialisation) and moved to the GPU."""
    import torch

    from tag.workloads import load_workload

    wl = load_workload(spec, batch=batch)
    dev = torch.device("cuda")
    model = wl.model.to(dev)
    inputs = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in wl.inputs)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if precision == "bf16" else None

    def step():
        if ctx is None:
            loss = model(*inputs)
        else:
            with ctx():
                loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    first = _timed(step, reps=1, warmup=2)  # warm-up and a first estimate of one step
    reps = max(5, min(steps, int(STEP_SECONDS / max(first, 1e-6))))
    times = _times(step, reps=reps, warmup=1)
    rec = {"kind": "step", "spec": spec, "batch": batch, "precision": precision,
           "params": sum(p.numel() for p in model.parameters()), "s": statistics.median(times), "reps": reps,
           "times_s": [round(t, 7) for t in times], "peak_bytes": torch.cuda.max_memory_allocated(), **common}
    if not profile:
        return rec
    try:  # one more step under torch.profiler: its ops and kernels (see tag.executor.profiling)
        from tag.executor.profiling import op_table, profiled

        with profiled() as prof:
            step()
        rec["ops"] = op_table(prof)
    except Exception as e:  # noqa: BLE001 - a diagnostic; the step's figures stand without it
        rec["ops_error"] = f"{type(e).__name__}: {e}"[:200]
    return rec


def _release_gpu() -> None:
    """Give the last row's model, optimizer state and activations back (also after an OOM,
    whose traceback held them until its handler ended)."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def one_gpu_topology(folder: Path, gpu: str) -> Path:
    """A topology file of one machine with this one GPU (catalog name ``gpu``)."""
    from tag.executor.equality import one_machine_topology

    return one_machine_topology(folder, 1, gpu)


MULTI_GPU_MARGIN_S = 30.0
"""No layout of the multi-GPU part starts later than this before the end of ``--budget`` (one
2-rank NCCL layout: process spawn, CUDA and NCCL start, export, 2 steps)."""


SHARED_GPU_S = 120.0
"""Seconds at the end of ``--budget`` the rows' part leaves to part 3's two ranks on one GPU
(five 2-rank layouts, each a spawn, CUDA start and export per rank and 2 steps)."""


def shared_gpu(deadline: float, emit) -> list[dict]:
    """Part 3's first half (module docstring): :func:`tag.executor.equality.check_layouts` of
    :data:`~tag.executor.equality.SHARED_GPU_LAYOUTS` with both ranks on ``cuda:0`` over gloo,
    each record passed to ``emit`` when final; one skip record without a GPU."""
    import torch

    if not torch.cuda.is_available():
        rec = {"kind": "equality", "backend": "gloo-cuda", "gpus": 0, "pass": None,
               "note": "skipped: no GPU; gloo-cuda runs 2 ranks on one GPU"}
        emit(rec)
        return [rec]
    from tag.executor.equality import SHARED_GPU_LAYOUTS, check_layouts

    return check_layouts("gloo-cuda", 2, layouts=SHARED_GPU_LAYOUTS, deadline=deadline, log_fn=emit)


def multi_gpu(deadline: float, emit) -> list[dict]:
    """Part 3 (module docstring): :func:`tag.executor.equality.check_layouts` on NCCL over the
    visible GPUs, each record passed to ``emit`` when final; one skip record with fewer than 2."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        rec = {"kind": "equality", "backend": "nccl", "gpus": n, "pass": None,
               "note": f"skipped: {n} GPU(s); NCCL needs one GPU per rank"}
        emit(rec)
        return [rec]
    from tag.executor.equality import check_layouts

    return check_layouts("nccl", n, deadline=deadline, log_fn=emit)


def predicted_and_plan(spec: str, batch: int, precision: str, topo_path: Path, plan_path: Path) -> dict:
    """Capture (CPU), the single-device plan written to ``plan_path``, and its simulated step."""
    from tag.cost.baselines import data_parallel
    from tag.cost.model import CostModel
    from tag.graph import capture
    from tag.sim import simulate
    from tag.topology import load_topology
    from tag.workloads import load_workload

    t0 = time.perf_counter()
    graph = capture(load_workload(spec, batch=batch, abstract=True), num_groups=16, precision=precision).graph
    capture_s = time.perf_counter() - t0
    topo = load_topology(topo_path)
    costs = CostModel.for_topology(graph, topo)
    plan = data_parallel(graph, topo)
    plan.save(plan_path)
    res = simulate(graph, topo, plan, costs=costs)
    return {"predicted_s": res.iteration_time_s, "predicted_peak_bytes": res.peak_memory_bytes[0],
            "cost_source": costs.source(0), "capture_s": capture_s}


def tag_execute(spec: str, batch: int, precision: str, topo_path: Path, plan_path: Path, timeout: float) -> dict:
    """``tag execute`` of the plan (NCCL, world size 1): measured seconds and peak bytes."""
    cmd = [sys.executable, "-m", "tag", "execute", "--plan", str(plan_path), "--model", spec, "--batch", str(batch),
           "--topology", str(topo_path), "--precision", precision, "--steps", "10", "--warmup", "3", "--json",
           "--timeout", str(timeout)]
    from tag.executor.profiling import ENV

    prefix = plan_path.with_suffix(".ops")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), ENV: str(prefix)}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout + 60)
    if p.returncode != 0:
        return {"execute_error": (p.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    out = json.loads(p.stdout)
    rank = out["ranks"][0]
    rec = {"execute_s": out.get("measured_iteration_time_s"), "execute_peak_bytes": rank.get("peak_memory_bytes"),
           "execute_optimizer_state_bytes": rank.get("optimizer_state_bytes")}
    table = Path(f"{prefix}-rank0.json")
    if table.exists():
        ops = json.loads(table.read_text())
        rec.update(execute_kernels=ops["kernels"], execute_aten_ops=ops["aten_ops"], execute_ops=ops)
    return rec


DROPOUT_MODEL = "evaluation/models/dropout.py:make"
"""The model of :func:`dropout_replay` (an MLP with two dropouts), batch 8, 4 op-groups."""


def dropout_replay(topo_path: Path, folder: Path, timeout: float) -> dict:
    """``tag execute`` (3 Adam steps, no warm-up) of :data:`DROPOUT_MODEL` on the topology's first
    device with every group recomputed and with none: the executor replays a recomputed group's
    random draws (``RankRuntime._random_stream``, the CUDA generator on a GPU), so the losses
    agree to the bit. One ``dropout_replay`` record (both loss lists, ``pass``)."""
    from tag.graph import capture
    from tag.plan import GroupPlan, new_plan
    from tag.topology import load_topology
    from tag.workloads import load_workload

    spec = str(REPO / DROPOUT_MODEL)
    graph = capture(load_workload(spec, batch=8), num_groups=4).graph
    topo = load_topology(str(topo_path))
    rec: dict = {"kind": "dropout_replay", "model": DROPOUT_MODEL, "batch": 8, "steps": 3}
    for name, recompute in (("plain", False), ("recompute", True)):
        plan_path = folder / f"dropout-{name}.json"
        new_plan(graph, topo, [GroupPlan([0], [1.0], recompute=recompute) for _ in range(4)]).save(plan_path)
        cmd = [sys.executable, "-m", "tag", "execute", "--plan", str(plan_path), "--model", spec, "--batch", "8",
               "--groups", "4", "--topology", str(topo_path), "--steps", "3", "--warmup", "0", "--json",
               "--timeout", str(timeout)]
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout + 60)
        if p.returncode != 0:
            return {**rec, "pass": False, "note": (p.stderr.strip().splitlines() or ["no output"])[-1][:300]}
        rec[f"losses_{name}"] = json.loads(p.stdout)["losses"]
    rec["pass"] = len(rec["losses_plain"]) == 3 and rec["losses_plain"] == rec["losses_recompute"]
    return rec


def _failure(e: Exception) -> str:
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _capture_pool():
    """Processes for the CPU side of each row (fresh interpreters: no CUDA state inherited)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    workers = max(1, min(6, (os.cpu_count() or 2) // 2))
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_one_thread)


def _emitter(records: list[dict], log: Path):
    """``emit(record)``: appended to ``records``, to ``log`` (one JSON line; the file starts anew
    with ``records``' first) and printed."""
    log.write_text(json.dumps(records[0]) + "\n")

    def emit(rec: dict) -> None:
        records.append(rec)
        with log.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)

    return emit


def write_report(records: list[dict], out: Path, command: str) -> None:
    lines = ["# GPU check", "", f"Command: `{command}`", ""]
    env = next((r for r in records if r["kind"] == "env"), {})
    lines += [f"Device: {env.get('device')} ({env.get('gpus', '?')} GPU(s) visible), torch {env.get('torch')}, "
              f"catalog type {env.get('gpu', '-')}, {env.get('date')}.", ""]
    micro = [r for r in records if r["kind"] in ("matmul", "conv3x3")]
    if micro:
        lines += ["| microbenchmark | TFLOP/s |", "|---|---|"]
        for r in micro:
            what = f"matmul n={r['n']} {r['dtype']}{' tf32' if r.get('tf32') else ''}" if r["kind"] == "matmul" \
                else f"conv3x3 {r['dtype']}"
            lines.append(f"| {what} | {r['tflops']:.1f} |")
        lines.append("")
    rows = [r for r in records if r["kind"] == "check"]
    lines += equality_table([r for r in records if r["kind"] == "equality"])
    for r in (r for r in records if r["kind"] == "dropout_replay"):
        lines += [f"Dropout replay ({r.get('model', DROPOUT_MODEL)}, every group recomputed against none): "
                  f"{'pass' if r.get('pass') else 'FAIL'}; losses {r.get('losses_recompute', '-')} / "
                  f"{r.get('losses_plain', '-')}{'; ' + r['note'] if r.get('note') else ''}", ""]
    if not rows:
        (out / "README.md").write_text("\n".join(lines) + "\n")
        return
    lines += ["| workload | batch | precision | eager ms | execute ms | execute / eager | predicted ms | "
              "predicted / eager | eager peak GB | execute peak GB | above weights + Adam state, eager / execute GB | kernels eager / execute | aten ops eager / execute | "
              "note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(x):
        return f"{x * 1e3:.2f}" if isinstance(x, (int, float)) else "-"

    def ratio(a, b):
        return f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"

    def gb(x):
        return f"{x / 1e9:.2f}" if isinstance(x, (int, float)) else "-"

    for r in rows:
        lines.append(f"| {r['spec']} | {r['batch']} | {r['precision']} | {ms(r.get('s'))} | {ms(r.get('execute_s'))} | "
                     f"{ratio(r.get('execute_s'), r.get('s'))} | {ms(r.get('predicted_s'))} | "
                     f"{ratio(r.get('predicted_s'), r.get('s'))} | {gb(r.get('peak_bytes'))} | "
                     f"{gb(r.get('execute_peak_bytes'))} | {gb(r.get('eager_above_state_bytes'))} / "
                     f"{gb(r.get('execute_above_state_bytes'))} | {r.get('eager_kernels', '-')} / {r.get('execute_kernels', '-')} | "
                     f"{r.get('eager_aten_ops', '-')} / {r.get('execute_aten_ops', '-')} | {_row_note(r)} |")
    (out / "README.md").write_text("\n".join(lines) + "\n")


def _row_note(row: dict) -> str:
    """A check row's note, and its eager step's seconds per pass where it was measured in several."""
    passes = row.get("passes_s")
    spread = "eager passes " + " / ".join(f"{x * 1e3:.2f}" for x in passes) + " ms" if passes else ""
    return "; ".join(x for x in (row.get("note", ""), spread) if x)


def equality_table(records: list[dict]) -> list[str]:
    """The multi-GPU part's records as Markdown lines (none without records)."""
    if not records:
        return []

    def num(x, fmt):
        return format(x, fmt) if isinstance(x, (int, float)) else "-"

    lines = ["Executed parameters after the steps against single-process training (rtol 1e-4, atol 1e-6; "
             "diff / tolerance at most 1 passes):", "",
             "| layout | model | backend | ranks | max abs diff | max rel diff | diff / tolerance | loss rel diff | "
             "pass | s | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        ok = {True: "yes", False: "**no**"}.get(r.get("pass"), "-")
        lines.append(f"| {r.get('layout', '-')} | {r.get('model', '-')} | {r.get('backend', '-')} | "
                     f"{r.get('world_size', '-')} | {num(r.get('max_abs_diff'), '.2e')} | "
                     f"{num(r.get('max_rel_diff'), '.2e')} | {num(r.get('tol_ratio'), '.3f')} | "
                     f"{num(r.get('loss_rel_diff'), '.1e')} | {ok} | {num(r.get('seconds'), '.1f')} | "
                     f"{r.get('note', '')} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu-check.jsonl and README.md")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds after which remaining work is skipped")
    ap.add_argument("--skip-micro", action="store_true", help="no microbenchmarks (workloads only)")
    ap.add_argument("--skip-execute", action="store_true",
                    help="eager steps only: no capture, prediction or `tag execute` (the cost model's "
                         "calibration data; predictions are made afterwards by evaluation/gpu_cost_check.py)")
    ap.add_argument("--workloads", default=None, help="semicolon-separated spec@batch list (default: WORKLOADS)")
    ap.add_argument("--passes", type=int, default=1,
                    help="measure every row's eager step this many times, in passes over all rows (1..10; the "
                         "spread between passes is the host's, which a host-bound step shows: "
                         "evaluation/results/gpu-cost/README.md); the row takes the median pass, the "
                         "profiled op tables come from the first")
    ap.add_argument("--only-multi-gpu", action="store_true",
                    help="only part 3: training equality of 2 gloo ranks on one GPU (dp, pp, tp, ZeRO-3, "
                         "offload) and of NCCL dp/pp/tp layouts on 2+ GPUs (one 'skipped' record with fewer); "
                         "exit status 1 when a layout fails")
    a = ap.parse_args(argv)
    if not 1 <= a.passes <= 10:
        ap.error(f"--passes: expected 1..10, got {a.passes}")
    import torch

    if a.only_multi_gpu:
        return only_multi_gpu(a, argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing to measure", file=sys.stderr)
        return 2
    from tag.topology.catalog import match_gpu_name

    t_start = time.perf_counter()
    rows_budget = a.budget - (0.0 if a.skip_execute else SHARED_GPU_S)  # (the rest: part 3 on one GPU)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0)
    spec = match_gpu_name(name)
    gpu = spec.name if spec is not None else "H200"
    common = {"device": name, "torch": torch.__version__}
    records: list[dict] = [{"kind": "env", "gpu": gpu, "catalog_match": spec is not None, "gpus": torch.cuda.device_count(),
                            "date": time.strftime("%Y-%m-%d %H:%M:%S"), **common}]
    emit = _emitter(records, out / "gpu-check.jsonl")
    workloads = WORKLOADS if not a.workloads else [
        (w.rsplit("@", 1)[0], int(w.rsplit("@", 1)[1])) for w in a.workloads.split(";")]
    with tempfile.TemporaryDirectory() as tmp:
        topo_path = one_gpu_topology(Path(tmp), gpu)
        rows = [(spec_, batch, precision) for spec_, batch in workloads for precision in PRECISIONS]
        if not a.skip_micro:
            for rec in microbenchmarks(common):
                emit(rec)
        # Pass 1, every row's eager step (seconds each: the calibration data of the cost model),
        # with nothing else running: a host-bound eager step (bf16 autocast) measured beside six
        # capturing processes took 31.9 ms on the H200 (gpt2 6L, 2026-11-26; 16.6 ms in the
        # calibration run).
        checks = [{"kind": "check", "spec": spec_, "batch": batch, "precision": precision, **common}
                  for spec_, batch, precision in rows]
        passes: list[list[float]] = [[] for _ in rows]  # each row's step seconds, one per pass
        for p in range(a.passes):
            for (spec_, batch, precision), row, mine in zip(rows, checks, passes):
                if "note" in row and not mine:  # failed, or skipped by the budget, in an earlier pass
                    continue
                if rows_budget - (time.perf_counter() - t_start) < 20:
                    row.setdefault("note", "skipped: time budget")
                    continue
                try:
                    step = eager_step(spec_, batch, precision, common, profile=p == 0)
                    emit({**step, "pass": p} if a.passes > 1 else step)
                    mine.append(step["s"])
                    if p == 0:
                        row.update(peak_bytes=step["peak_bytes"], params=step["params"])
                        row["eager_above_state_bytes"] = step["peak_bytes"] - 12 * step["params"]  # weights, Adam m, v
                        if "ops" in step:
                            row.update(eager_kernels=step["ops"]["kernels"], eager_aten_ops=step["ops"]["aten_ops"])
                except Exception as e:  # noqa: BLE001 - one failed row is a result, the others still run
                    row["note"] = _failure(e)
                _release_gpu()
        for row, mine in zip(checks, passes):
            if mine:
                row["s"] = statistics.median(mine)
                if a.passes > 1:
                    row["passes_s"] = mine
        # Pass 2: each measured row's capture, plan and prediction (CPU, in parallel processes),
        # then its `tag execute` in order, while the budget lasts.
        pool = _capture_pool()
        todo = [i for i, row in enumerate(checks) if "note" not in row and "s" in row]
        planned = {i: pool.submit(predicted_and_plan, *rows[i], topo_path, Path(tmp) / f"plan-{i}.json")
                   for i in ([] if a.skip_execute else todo)}
        for i, row in enumerate(checks):
            if i in planned:
                left = rows_budget - (time.perf_counter() - t_start)
                try:
                    if left <= 30:
                        raise TimeoutError
                    row.update(planned[i].result(timeout=left - 30))
                    left = rows_budget - (time.perf_counter() - t_start)
                    if left > 30:
                        row.update(tag_execute(row["spec"], row["batch"], row["precision"], topo_path,
                                               Path(tmp) / f"plan-{i}.json", timeout=min(240, left)))
                        if row.get("execute_peak_bytes") and row.get("execute_optimizer_state_bytes") is not None:
                            row["execute_above_state_bytes"] = (row["execute_peak_bytes"] - 4 * row["params"]
                                                                - row["execute_optimizer_state_bytes"])
                    else:
                        row["note"] = "execute skipped: time budget"
                except (TimeoutError, concurrent.futures.TimeoutError):
                    row["note"] = "prediction and execute skipped: time budget"
                except Exception as e:  # noqa: BLE001
                    row["note"] = _failure(e)
            emit(row)
        pool.shutdown(wait=False, cancel_futures=True)  # rows skipped by the budget
        if not a.skip_execute and rows_budget - (time.perf_counter() - t_start) > MULTI_GPU_MARGIN_S + 60:
            try:
                emit(dropout_replay(topo_path, Path(tmp), timeout=60))
            except Exception as e:  # noqa: BLE001 - a diagnostic; the rows stand without it
                emit({"kind": "dropout_replay", "pass": False, "note": _failure(e)})
    if not a.skip_execute:
        shared_gpu(t_start + a.budget - MULTI_GPU_MARGIN_S, emit)
    multi_gpu(t_start + a.budget - MULTI_GPU_MARGIN_S, emit)
    write_report(records, out, " ".join(["python -m evaluation.gpu_check", *(argv or sys.argv[1:])]))
    print(f"gpu_check: {len(records)} records in {time.perf_counter() - t_start:.0f} s -> {out}")
    return 0


def only_multi_gpu(a, argv) -> int:
    """``--only-multi-gpu``: part 3 alone, into the same files (also without a GPU: the skip records)."""
    import torch

    t_start = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = {"kind": "env", "gpus": n, "device": torch.cuda.get_device_name(0) if n else None,
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    records = [env]
    emit = _emitter(records, out / "gpu-check.jsonl")

    got = shared_gpu(t_start + a.budget - MULTI_GPU_MARGIN_S, emit)
    got += multi_gpu(t_start + a.budget - MULTI_GPU_MARGIN_S, emit)
    write_report(records, out, " ".join(["python -m evaluation.gpu_check", *(argv or sys.argv[1:])]))
    failed = [r["layout"] for r in got if r.get("pass") is False]
    print(f"gpu_check --only-multi-gpu: {len(got)} records in {time.perf_counter() - t_start:.0f} s -> {out}"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
