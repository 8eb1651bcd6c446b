"""The GPU cost model (tag.cost.gpu) and mixed-precision plumbing (capture, plan, costs, executor)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tag.cost.gpu import (
    Numerics,
    OpFeatures,
    fit_microbenchmarks,
    fitted_rates,
    gpu_rates,
    load_calibration,
    op_class,
    op_mode,
    op_seconds,
)
from tag.errors import PlanError
from tag.executor import reference_training, run_virtual
from tag.plan import GroupPlan, Plan, new_plan
from tag.topology.catalog import GPU_CATALOG
from tag.workloads import load_workload

GPT2 = "gpt2:n_layer=1,n_embd=32,n_head=2,vocab=64,seq=16"
B = 4
REPO = Path(__file__).resolve().parents[1]


def test_microbenchmark_fit_reproduces_its_measurements():
    """t = c + F / R passes through the two largest matmuls of each mode exactly; the convolution
    and the elementwise kernel are reproduced exactly with the same per-call intercept."""
    recs = load_calibration("H200")
    fit = fit_microbenchmarks(recs)
    for r in recs:
        if r["kind"] == "matmul" and r["n"] >= 1024:
            mode = "low" if r["dtype"] == "torch.bfloat16" else ("tf32" if r["tf32"] else "fp32")
            t = fit["matmul_call_s"][mode] + 2 * r["n"] ** 3 / fit["matmul"][mode]
            assert t == pytest.approx(r["s"], rel=1e-9)
        if r["kind"] == "conv3x3":
            mode = "low" if r["dtype"] == "torch.bfloat16" else "tf32"
            n, c, h, w = r["shape"]
            t = fit["matmul_call_s"][mode] + 18 * c * c * h * w * n / fit["conv"][mode]
            assert t == pytest.approx(r["s"], rel=1e-9)
        if r["kind"] == "elementwise":
            assert r["bytes"] / fit["bandwidth"] == pytest.approx(r["s"], rel=1e-9)
    # the asymptotic rates are the measured large-matmul rates or above (the intercept removed)
    assert 49.9e12 < fit["matmul"]["fp32"] < 60e12 and 660e12 < fit["matmul"]["low"] < 900e12


def test_step_fit_reproduces_the_measured_steps():
    """The committed leave-one-workload-out check (evaluation/gpu_cost_check.py) and the shipped
    fit agree; a regression guard at 25% (the issue's target is 20%: on the graphs captured since
    the backward kernels are kept the worst held-out error is 21.6%, reported in its README)."""
    res = json.loads((REPO / "evaluation/results/gpu-cost/results.json").read_text())
    assert len(res["cases"]) == 6
    for c in res["cases"]:
        assert abs(c["error"]) < 0.25 and abs(c["error_all"]) < 0.25, c["spec"]
    shipped = json.loads((REPO / "tag/cost/gpu_calib/H200-steps.json").read_text())
    assert shipped["host_s"] == pytest.approx(res["host_s_all"]) == fitted_rates("H200").host_s
    assert fitted_rates("H200").launch_s <= shipped["host_s"] < 1e-4


def test_unmeasured_gpu_types_derive_from_their_datasheet():
    h200, a100, v100 = (gpu_rates(GPU_CATALOG[n]) for n in ("H200", "A100-80GB", "V100-SXM2-16GB"))
    assert h200.source == "fitted:H200" and a100.source == "datasheet:A100-80GB"
    # H200's achieved / datasheet ratios on the A100's datasheet peaks
    assert a100.matmul["low"] == pytest.approx(h200.matmul["low"] / 989.5 * 312.0)
    assert a100.matmul["tf32"] == pytest.approx(h200.matmul["tf32"] / 494.5 * 156.0)
    assert a100.bandwidth == pytest.approx(h200.bandwidth / 4800 * 2039)
    assert v100.matmul["tf32"] == v100.matmul["fp32"] and v100.conv["tf32"] == v100.conv["fp32"]  # no TF32


def test_op_classes_and_pytorch_tf32_defaults():
    assert [op_class(t) for t in ("aten.mm.default", "aten.convolution_backward.default", "optim.adam",
                                  "aten._scaled_dot_product_flash_attention.default", "aten.add.Tensor")] == \
        ["matmul", "conv", "opt", "attention", "memory"]
    # the CPU flash kernels the graphs hold (F.scaled_dot_product_attention captured on the CPU)
    assert {op_class(f"aten._scaled_dot_product_flash_attention_for_cpu{b}.default") for b in ("", "_backward")} == \
        {"attention"}
    d = Numerics()
    assert (op_mode("matmul", "float32", d), op_mode("conv", "float32", d), op_mode("matmul", "bfloat16", d)) == \
        ("fp32", "tf32", "low")
    assert op_mode("matmul", "float32", Numerics(matmul_tf32=True)) == "tf32"
    assert op_mode("conv", "", Numerics(conv_tf32=False)) == "fp32"


@pytest.fixture(scope="module")
def graphs(captured):
    return {p: captured(GPT2, batch=B, groups=2, precision=p).graph for p in ("fp32", "bf16")}


def test_bf16_graph_has_bf16_ops_fp32_master_state_and_smaller_activations(graphs):
    g32, g16 = graphs["fp32"], graphs["bf16"]
    assert g16.precision == "bf16" and g32.precision == "fp32"
    assert {o.dtype for o in g16.ops if op_class(o.target) == "matmul"} == {"bfloat16"}
    assert {o.dtype for o in g32.ops if op_class(o.target) == "matmul"} == {"float32"}
    assert [p.nbytes for p in g16.params] == [p.nbytes for p in g32.params]  # fp32 master weights
    assert [p.opt_state_bytes for p in g16.params] == [p.opt_state_bytes for p in g32.params]
    per_sample = [sum(t.nbytes.per_sample for t in g.tensors if t.kind == "activation") for g in (g32, g16)]
    assert per_sample[1] < per_sample[0]
    assert g16.signature() != g32.signature()
    back = type(g16).from_json(g16.to_json())
    assert back.precision == "bf16" and [o.dtype for o in back.ops] == [o.dtype for o in g16.ops]
    d = json.loads(g32.to_json())  # fp32 graphs are written as before precisions existed
    assert "precision" not in d and "dtype" not in d["ops"][0]


def test_bf16_costs_less_gpu_time_than_fp32(graphs):
    for name in ("H200", "A100-80GB"):
        rates = gpu_rates(GPU_CATALOG[name])
        t = {p: op_seconds(OpFeatures.of(g, Numerics()), rates, [B]).sum() for p, g in graphs.items()}
        mm = {p: op_seconds(OpFeatures.of(g, Numerics()), rates, [B])[
            [op_class(o.target) == "matmul" for o in g.ops]].sum() for p, g in graphs.items()}
        assert mm["bf16"] < 0.6 * mm["fp32"] and t["bf16"] < t["fp32"], name  # memory-bound: bytes halve


def test_plan_records_precision_and_old_files_read_as_fp32(graphs, tmp_path, topo4):
    g = graphs["bf16"]
    plan = new_plan(g, topo4, [GroupPlan([0], [1.0]) for _ in range(g.num_groups)])
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path).precision == "bf16"
    d = json.loads(path.read_text())
    del d["precision"]
    old = Plan.from_dict(d)
    assert old.precision == "fp32"
    with pytest.raises(PlanError, match="precision: plan is for fp32.*pass --precision fp32"):
        old.validate(g, topo4)
    d["precision"] = "fp8"
    with pytest.raises(PlanError, match="precision: expected fp32, bf16 or fp16"):
        Plan.from_dict(d)


def test_bf16_data_parallel_training_equals_single_process_autocast(graphs, topo4):
    """Two replicas (2 samples each), K=3 Adam steps under bf16 autocast. Tolerance: each replica
    computes its bf16 matmuls over its own rows, so partial sums round differently than the full
    batch's (bf16 keeps 8 mantissa bits: relative 2^-8 per rounding); Adam normalises the step, so
    a parameter moves ~lr = 1e-3 per step whatever the gradient's rounding: after 3 steps the
    parameters agree to a few lr (atol 5e-3), far from fp32 equality (1e-6) and far below a wrong
    update (a missed or doubled step moves parameters by 1e-3 each, seen by the loss check)."""
    g = graphs["bf16"]
    plan = new_plan(g, topo4, [GroupPlan([0, 1], [0.5, 0.5]) for _ in range(g.num_groups)])
    rts = run_virtual(g, plan, load_workload(GPT2, batch=B), "adam", 3)
    ref, losses = reference_training(load_workload(GPT2, batch=B), "adam", 3, precision="bf16")
    ref32, _ = reference_training(load_workload(GPT2, batch=B), "adam", 3)
    far = 0
    for rt in rts.values():
        for name, value in rt.named_params().items():
            torch.testing.assert_close(value, ref[name], rtol=0, atol=5e-3)
            far += int(not torch.allclose(value, ref32[name], rtol=0, atol=1e-6))
    assert far > 0  # the run was mixed precision: it differs from fp32 training
    assert all(math.isfinite(x) for x in losses)


def test_held_out_check_splits_device_time_by_op_class(graphs):
    """evaluation/gpu_cost_check.py's per-class comparison: an op table's ATen rows (eager names,
    composite ops such as ``aten::linear`` included) fall in the rule's classes, multi-tensor
    optimizer ops in ``opt``; the rule's per-class seconds add up to its device total."""
    from evaluation.gpu_cost_check import measured_by_class, predicted_by_class

    rows = [["aten::linear", 4, 1e-4, 2e-3], ["aten::mm", 6, 1e-4, 1e-3], ["aten::native_layer_norm", 2, 1e-5, 5e-4],
            ["aten::_scaled_dot_product_efficient_attention", 1, 1e-5, 4e-4], ["aten::_foreach_addcdiv_", 1, 1e-5, 3e-4],
            ["aten::convolution_backward", 1, 1e-5, 2e-4]]
    got = measured_by_class(rows)
    assert got == pytest.approx({"matmul": 3e-3, "memory": 5e-4, "attention": 4e-4, "opt": 3e-4, "conv": 2e-4})
    assert measured_by_class([r[:3] for r in rows]) == {}  # tables without device seconds (before 32700af)
    rates = gpu_rates(GPU_CATALOG["H200"])
    g = graphs["bf16"]
    by_class = predicted_by_class(g, rates)
    assert set(by_class) <= {"matmul", "conv", "attention", "memory", "opt"} and by_class["matmul"] > 0
    assert sum(by_class.values()) == pytest.approx(op_seconds(OpFeatures.of(g, Numerics()), rates, [B]).sum())
