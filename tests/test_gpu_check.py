"""The GPU check script's CPU-side parts: the one-GPU topology, the plan and prediction it makes,
the report, and a clear refusal without a GPU (the measurements themselves need CUDA)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from evaluation import gpu_check


def test_prediction_and_plan_for_one_gpu(tmp_path):
    topo = gpu_check.one_gpu_topology(tmp_path, "H200")
    rec = gpu_check.predicted_and_plan("mlp", 1024, "fp32", topo, tmp_path / "plan.json")
    assert rec["predicted_s"] > 0 and rec["cost_source"] == "fitted:H200"
    assert (tmp_path / "plan.json").exists()
    # at 1024 samples the activations dominate and bf16 halves them (at 8 samples the weights do:
    # bf16 adds 2-byte copies of fp32 masters, 3.10 against 2.73 MB, 2026-11-29)
    bf16 = gpu_check.predicted_and_plan("mlp", 1024, "bf16", topo, tmp_path / "plan16.json")
    assert bf16["predicted_peak_bytes"] < rec["predicted_peak_bytes"]


def test_report(tmp_path):
    records = [{"kind": "env", "device": "X", "torch": "t", "gpu": "H200", "date": "d"},
               {"kind": "matmul", "dtype": "torch.float32", "tf32": True, "n": 4096, "tflops": 400.0},
               {"kind": "check", "spec": "mlp", "batch": 8, "precision": "fp32", "s": 0.010, "execute_s": 0.011,
                "predicted_s": 0.009, "peak_bytes": 2e9, "execute_peak_bytes": 2.2e9, "eager_above_state_bytes": 1e9,
                "execute_above_state_bytes": 1.05e9, "eager_kernels": 10, "execute_kernels": 9, "eager_aten_ops": 20,
                "execute_aten_ops": 18},
               {"kind": "check", "spec": "gpt2", "batch": 8, "precision": "bf16", "note": "skipped: time budget"}]
    gpu_check.write_report(records, tmp_path, "cmd")
    text = (tmp_path / "README.md").read_text()
    assert "| mlp | 8 | fp32 | 10.00 | 11.00 | 1.10 | 9.00 | 0.90 | 2.00 | 2.20 | 1.00 / 1.05 | 10 / 9 | 20 / 18 |  |" in text
    assert "skipped: time budget" in text and "matmul n=4096 torch.float32 tf32 | 400.0" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_every_eager_step_comes_before_the_executes(tmp_path, monkeypatch):
    """The check's order without a GPU (the GPU parts replaced, the capture, plan and prediction
    real): all rows' eager steps first, then `tag execute` per row while the budget lasts, every
    row reported once, the report written."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def eager(spec, batch, precision, common, steps=20, profile=True):
        calls.append(("eager", precision))
        return {"kind": "step", "spec": spec, "batch": batch, "precision": precision, "params": 10, "s": 0.01,
                "peak_bytes": 1000, **common}

    def execute(spec, batch, precision, topo_path, plan_path, timeout):
        calls.append(("execute", precision))
        assert plan_path.exists()  # the row's own plan, written by its capture process
        return {"execute_s": 0.009, "execute_peak_bytes": 900, "execute_optimizer_state_bytes": 80}

    monkeypatch.setattr(gpu_check, "eager_step", eager)
    monkeypatch.setattr(gpu_check, "tag_execute", execute)
    monkeypatch.setattr(gpu_check, "dropout_replay", lambda *a, **k: calls.append(("dropout", None)) or
                        {"kind": "dropout_replay", "pass": True, "losses_plain": [1.0], "losses_recompute": [1.0]})
    deadlines = []
    monkeypatch.setattr(gpu_check, "shared_gpu", lambda deadline, emit: calls.append(("shared_gpu", None)) or
                        deadlines.append(deadline - time.perf_counter()) or [])
    assert gpu_check.main(["--out", str(tmp_path), "--skip-micro", "--workloads", "mlp@8"]) == 0
    assert calls == [("eager", "fp32"), ("eager", "bf16"), ("execute", "fp32"), ("execute", "bf16"), ("dropout", None),
                     ("shared_gpu", None)]
    assert 0 < deadlines[0] <= 420 - gpu_check.MULTI_GPU_MARGIN_S  # part 3 runs within --budget
    checks = [json.loads(x) for x in (tmp_path / "gpu-check.jsonl").read_text().splitlines()]
    checks = [r for r in checks if r["kind"] == "check"]
    assert [r["precision"] for r in checks] == ["fp32", "bf16"]
    assert all(r["execute_above_state_bytes"] == 900 - 40 - 80 and r["predicted_s"] > 0 for r in checks)
    assert "| mlp | 8 | fp32 | 10.00 | 9.00 | 0.90 |" in (tmp_path / "README.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report without a GPU")
def test_multi_rank_part_is_skipped_without_a_gpu(tmp_path, capsys):
    """``--only-multi-gpu`` without a GPU (the development VM): one record for each half of part 3
    (2 gloo ranks on one GPU, NCCL) saying why, in the JSON lines and the README table, and a zero
    exit status."""
    assert gpu_check.main(["--out", str(tmp_path), "--only-multi-gpu"]) == 0
    records = [json.loads(x) for x in (tmp_path / "gpu-check.jsonl").read_text().splitlines()]
    assert [(r["kind"], r.get("backend")) for r in records] == [("env", None), ("equality", "gloo-cuda"),
                                                                ("equality", "nccl")]
    notes = ["skipped: no GPU; gloo-cuda runs 2 ranks on one GPU", "skipped: 0 GPU(s); NCCL needs one GPU per rank"]
    assert [r["note"] for r in records[1:]] == notes and all(r["pass"] is None for r in records[1:])
    readme = (tmp_path / "README.md").read_text()
    assert all(f"| - | - | {b} | - | - | - | - | - | - | - | {n} |" in readme for b, n in zip(("gloo-cuda", "nccl"), notes))
    assert notes[1] in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_gloo_cuda_layout_is_refused_without_a_gpu():
    """The one-GPU gloo check's own path on a machine without a GPU: check_layouts captures the
    model, trains the reference and writes the plan, and `tag execute` on ``gloo-cuda`` refuses it
    before any rank starts, one line, recorded as that layout's failure."""
    from tag.executor.equality import MLP, SHARED_GPU_LAYOUTS, check_layouts

    assert {lay for _, lay in SHARED_GPU_LAYOUTS} >= {"dp=2", "tp=2", "dp=2,zero=3", "dp=2,zero=2,offload=optimizer"}
    (rec,) = check_layouts("gloo-cuda", 2, layouts=[(MLP, "dp=2")])
    assert (rec["backend"], rec["world_size"], rec["pass"]) == ("gloo-cuda", 2, False)
    assert rec["note"] == "failed: ExecutionError: backend gloo-cuda: this machine has no GPU (torch.cuda.device_count() is 0)"


def test_staged_receive_copies_the_host_message_to_its_buffer():
    """A gloo-cuda receive lands in host memory and its wait copies it to the device buffer whose
    views the pieces are (on the CPU: an unpinned host tensor, the copy the same)."""
    from tag.executor.comm import StagedRecv, packed_buffer, to_pinned_host

    class Done:  # a receive that has completed (the message already in ``host``)
        def wait(self):
            return True

    flat, (a, b) = packed_buffer([([2, 3], torch.float32), ([4], torch.int64)], torch.device("cpu"))
    host = to_pinned_host(flat, copy=False)
    assert host.shape == flat.shape and host.data_ptr() != flat.data_ptr() and not host.is_pinned()
    msg = torch.zeros_like(flat)
    msg[:24].view(torch.float32).copy_(torch.arange(6.0))
    msg[32:64].view(torch.int64).copy_(torch.tensor([7, 8, 9, 10]))
    host.copy_(msg)
    StagedRecv(Done(), host, flat).wait()
    assert torch.equal(a, torch.arange(6.0).view(2, 3)) and torch.equal(b, torch.tensor([7, 8, 9, 10]))
    assert torch.equal(to_pinned_host(a), a)


def test_passes_measure_every_eager_step_again_and_take_the_median(tmp_path, monkeypatch):
    """--passes 3: every row's eager step three times, in passes over all rows (the host's speed
    drifts between them, not within one row), only the first profiled; the row's seconds are the
    median pass, each pass listed in the row and the report; gpu_cost_check reads the file's
    steps back as one per row, the first pass's record with the median seconds."""
    from evaluation.gpu_cost_check import merged_passes

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    seconds = iter([0.010, 0.020, 0.014, 0.024, 0.012, 0.022])

    def eager(spec, batch, precision, common, steps=20, profile=True):
        calls.append((precision, profile))
        rec = {"kind": "step", "spec": spec, "batch": batch, "precision": precision, "params": 10,
               "s": next(seconds), "peak_bytes": 1000, **common}
        return {**rec, "ops": {"kernels": 3, "aten_ops": 5}} if profile else rec

    monkeypatch.setattr(gpu_check, "eager_step", eager)
    assert gpu_check.main(["--out", str(tmp_path), "--skip-micro", "--skip-execute", "--workloads", "mlp@8",
                           "--passes", "3"]) == 0
    assert calls == [("fp32", True), ("bf16", True), ("fp32", False), ("bf16", False), ("fp32", False),
                     ("bf16", False)]
    recs = [json.loads(x) for x in (tmp_path / "gpu-check.jsonl").read_text().splitlines()]
    checks = {r["precision"]: r for r in recs if r["kind"] == "check"}
    assert checks["fp32"]["s"] == 0.012 and checks["fp32"]["passes_s"] == [0.010, 0.014, 0.012]
    assert checks["bf16"]["s"] == 0.022 and checks["bf16"]["eager_kernels"] == 3
    assert [r["pass"] for r in recs if r["kind"] == "step"] == [0, 0, 1, 1, 2, 2]
    assert "eager passes 10.00 / 14.00 / 12.00 ms" in (tmp_path / "README.md").read_text()
    steps = merged_passes(recs)
    assert [(r["precision"], r["s"], r["ops"]["kernels"]) for r in steps] == [("fp32", 0.012, 3), ("bf16", 0.022, 3)]


def test_passes_out_of_range_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path), "--passes", "0"])
    assert e.value.code == 2 and "--passes: expected 1..10, got 0" in capsys.readouterr().err


def test_dropout_replay_on_a_cpu_rank(tmp_path):
    """The GPU check's dropout replay, run for real on one gloo rank: `tag execute` of the MLP
    with dropout, every group recomputed and none, gives the same losses to the bit; the report
    says so."""
    from test_executor_dist import cpu_topology

    rec = gpu_check.dropout_replay(Path(cpu_topology(tmp_path, 1)), tmp_path, timeout=60)
    assert rec["pass"] is True and len(rec["losses_plain"]) == 3 and rec["losses_plain"] == rec["losses_recompute"]
    gpu_check.write_report([{"kind": "env"}, rec], tmp_path, "cmd")
    assert "Dropout replay (evaluation/models/dropout.py:make, every group recomputed against none): pass" in \
        (tmp_path / "README.md").read_text()
