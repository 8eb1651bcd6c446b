"""The GPU cost model (tag.cost.gpu) and mixed-precision plumbing (capture, plan, costs, executor)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tag.cost.gpu import (
    ATTENTION_MODES,
    COLUMNS,
    FIT_PARAMS,
    FIXED_PARAMS,
    MODES,
    OP_CLASSES,
    SECONDS,
    Numerics,
    OpFeatures,
    datasheet_rates,
    design,
    fit_device,
    fit_microbenchmarks,
    fitted_rates,
    gpu_rates,
    kernel_class,
    layer_seconds,
    load_calibration,
    load_published,
    microbenchmark_rates,
    op_class,
    op_mode,
    op_seconds,
    published_rates,
    published_value,
    theta_of,
)
from tag.errors import PlanError, TopologyError
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


def test_fit_device_recovers_known_rates():
    """Rows built from the design of known constants are fitted back exactly (non-negative least
    squares on noiseless data); a column no row exercises keeps the prior."""
    rng = np.random.default_rng(0)
    true = theta_of(microbenchmark_rates("H200"))
    true[0] = 5e-6  # 5 us per kernel
    true[COLUMNS.index("memory_bw")] *= 1.5  # a third slower than the microbenchmark
    X = np.zeros((30, len(COLUMNS)))
    X[:, 0] = rng.integers(1, 500, 30)  # kernels
    for name, scale in (("matmul:fp32", 1e12), ("matmul:low", 1e12), ("conv:tf32", 1e11), ("memory_bw", 1e9),
                        ("norm_bw", 1e8), ("opt_bw", 1e9), ("attention_eff:fp32", 1e-4), ("attention_eff:low", 1e-4)):
        X[:, COLUMNS.index(name)] = rng.uniform(0, scale, 30)
    theta = fit_device(X, X @ true, prior=true * 2.0)
    used = X.any(axis=0)
    np.testing.assert_allclose(theta[used], true[used], rtol=1e-6)
    np.testing.assert_allclose(theta[~used], 2.0 * true[~used])  # conv:fp32, conv:low, matmul:tf32: the prior
    # fixed columns keep the prior and their share comes off the measured seconds: the rest is exact
    fixed = np.isin(np.array(COLUMNS), FIXED_PARAMS)
    theta = fit_device(X, X @ true, prior=np.where(fixed, true, 2.0 * true), fixed=FIXED_PARAMS)
    np.testing.assert_allclose(theta[used], true[used], rtol=1e-6)
    # a wrong fixed rate is not fitted away: the matmul rates stay where they were put
    off = np.where(fixed, 1.3 * true, 2.0 * true)
    assert np.array_equal(fit_device(X, X @ true, prior=off, fixed=FIXED_PARAMS)[fixed], off[fixed])


def test_kernel_classes_of_real_profiler_names():
    """Names as the H200 GPU check recorded them (evaluation/results/gpu-check/2026-11-26-h200)."""
    names = {r[0] for line in (REPO / "evaluation/results/gpu-check/2026-11-26-h200/run1.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") == "step" for r in json.loads(line)["ops"]["top_kernels"]}

    def one(part: str) -> str:
        hits = {kernel_class(n) for n in names if part in n}
        assert len(hits) == 1, (part, hits)
        return hits.pop()

    assert one("Optimizer.step#Adam.step") is None  # an annotation overlapping the kernels it holds
    assert [one(p) for p in ("nvjet_sm90", "cutlass_80_simt_sgemm", "sm80_xmma_gemm_f32f32", "splitKreduce")] == \
        ["matmul"] * 4
    assert [one(p) for p in ("sm90_xmma_fprop_implicit_gemm", "sm90_xmma_dgrad", "sm90_xmma_wgrad", "nchwToNhwcKernel",
                             "implicit_convolve_sgemm")] == ["conv"] * 5
    assert [one(p) for p in ("fmha_cutlassF", "fmha_cutlassB", "native_sdpa_sm90_flash")] == ["attention"] * 3
    assert [one(p) for p in ("bn_bw_1C11", "batch_norm_backward_kernel", "layer_norm", "softmax_warp_forward",
                             "cunn_SoftMaxBackward", "native::reduce_kernel<")] == ["norm"] * 6
    assert one("multi_tensor_apply_kernel") == "opt"
    # elementwise kernels whose template names hold "#" (lambdas) are kernels, not annotations
    assert [one(p) for p in ("direct_copy_kernel_cuda", "bfloat16_copy_kernel_cuda", "CatArrayBatchedCopy",
                             "Memset (Device)")] == ["memory"] * 4


def test_stored_fit_gives_the_documented_figures():
    """tag/cost/gpu_calib/H200-fit.json (written by evaluation/gpu_cost_check.py --write) is what
    the rule loads, and the same constants as the committed report; the per-op rule is linear in
    the fitted unknowns (op_seconds == design @ theta_of)."""
    fit = json.loads((REPO / "tag/cost/gpu_calib/H200-fit.json").read_text())
    res = json.loads((REPO / "evaluation/results/gpu-cost/results.json").read_text())
    rates = fitted_rates("H200")
    assert rates.source == "fitted:H200"
    got = dict(zip(COLUMNS, theta_of(rates)))
    for name, value in fit["params"].items():
        assert (got[name] if name in SECONDS else 1.0 / got[name]) == pytest.approx(value, rel=1e-12)
        assert res["fitted"][name] == pytest.approx(value, rel=1e-12)
    assert rates.host_s == fit["host_s"] == res["fitted"]["host_s"]
    # the backward's ops are issued by autograd's C++ engine: fewer host seconds per launch
    assert 0 < rates.host_backward_s == fit["host_backward_s"] == res["fitted"]["host_backward_s"] < rates.host_s
    assert rates.step_host_s == fit["step_host_s"] == res["fitted"]["step_host_s"]
    assert rates.opt_host_s == fit["opt_host_s"] == res["fitted"]["opt_host_s"] > 0
    assert len(fit["params"]) + 3 <= 17  # few constants for 42 steps (21 workloads x fp32/bf16)
    assert all(fit["units"][n] == FIT_PARAMS[n][0] for n in fit["params"])


def test_stored_rule_keeps_the_microbenchmark_regime_for_large_ops():
    """The fitted rule times a large matmul as the microbenchmark measured it (the rate the steps'
    large GEMMs reach, within 15% of the microbenchmark's marginal rate, plus the fitted per-call
    seconds): the n=4096 square matmuls of gpu_calib/H200.jsonl within 12% (the isolated calls there also hold 28-40 us of per-call harness time, which an eager
    stream hides). Fused attention is fitted per mode where the steps identify it (the real-size
    zoo's attention kernels, 2026-11-27): a fraction of the matmul rate of its mode, below 1; in
    fp32 whatever the TF32 flag says (the fused kernels are not cuBLAS calls)."""
    rates, micro = fitted_rates("H200"), microbenchmark_rates("H200")
    assert rates.matmul["tf32"] == micro.matmul["tf32"]  # no step runs a TF32 matmul
    for mode in ("fp32", "low"):  # fitted on the steps' large GEMMs: near the microbenchmark's marginal rate
        assert 0.85 < rates.matmul[mode] / micro.matmul[mode] <= 1.0
    fit = json.loads((REPO / "tag/cost/gpu_calib/H200-fit.json").read_text())
    for mode in ATTENTION_MODES:
        assert f"attention_eff:{mode}" in fit["params"] and f"attention_eff:{mode}" not in fit["assumed"]
        assert 0.1 < rates.attention_eff[mode] < 1.0
        assert rates.attention_rate(mode) == pytest.approx(rates.attention_eff[mode] * micro.matmul[mode])
    assert op_mode("attention", "float32", Numerics(matmul_tf32=True)) == "fp32"
    assert op_mode("matmul", "float32", Numerics(matmul_tf32=True)) == "tf32"
    for r in load_calibration("H200"):
        if r["kind"] == "matmul" and r["n"] == 4096:
            mode = "low" if r["dtype"] == "torch.bfloat16" else ("tf32" if r["tf32"] else "fp32")
            t = rates.matmul_floor(mode) + 2 * r["n"] ** 3 / rates.matmul[mode]
            assert abs(t / r["s"] - 1) < 0.12, (mode, t, r["s"])


def test_unmeasured_gpu_types_derive_from_their_datasheet():
    h200, l4 = (gpu_rates(GPU_CATALOG[n]) for n in ("H200", "L4"))
    a100, v100 = (datasheet_rates(GPU_CATALOG[n]) for n in ("A100-80GB", "V100-SXM2-16GB"))
    assert h200.source == "fitted:H200" and l4.source == "datasheet:L4" and a100.source == "datasheet:A100-80GB"
    assert l4.matmul["low"] == pytest.approx(h200.matmul["low"] / 989.5 * 121.0)  # nothing published for the L4
    # H200's achieved / datasheet ratios on the A100's datasheet peaks
    assert a100.matmul["low"] == pytest.approx(h200.matmul["low"] / 989.5 * 312.0)
    assert a100.matmul["tf32"] == pytest.approx(h200.matmul["tf32"] / 494.5 * 156.0)
    assert a100.bandwidth == pytest.approx(h200.bandwidth / 4800 * 2039)
    assert v100.matmul["tf32"] == v100.matmul["fp32"] and v100.conv["tf32"] == v100.conv["fp32"]  # no TF32
    # the host's seconds are the host's, whatever GPU it drives
    assert (a100.host_s, a100.host_bwd, a100.opt_host_s) == (h200.host_s, h200.host_bwd, h200.opt_host_s)


def test_op_classes_and_pytorch_tf32_defaults():
    assert [op_class(t) for t in ("aten.mm.default", "aten.convolution_backward.default", "optim.adam",
                                  "aten._scaled_dot_product_flash_attention.default", "aten.add.Tensor",
                                  "aten.native_layer_norm_backward.default", "aten.sum.dim_IntList")] == \
        ["matmul", "conv", "opt", "attention", "memory", "norm", "norm"]
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
    """Beyond the per-kernel floors (``kernel_s`` and the matmuls' ``matmul_call_s``, which at
    this toy size are most of every kernel and about the same in both precisions), bf16 matmuls
    and memory-bound ops cost less."""
    import dataclasses

    for name in ("H200", "A100-80GB"):
        rates = dataclasses.replace(gpu_rates(GPU_CATALOG[name]), kernel_s=0.0, matmul_call_s=None)
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


def test_check_splits_kernel_time_by_class_and_the_rule_is_linear(graphs):
    """evaluation/gpu_cost_check.py's per-class comparison: kernel-table rows fall in the rule's
    classes, annotations left out; the rule's per-class seconds add up to its device total, and
    equal the design matrix times the unknowns."""
    from evaluation.gpu_cost_check import measured_by_class, predicted_by_class

    rows = [["nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 4, 2e-3], ["Optimizer.step#Adam.step", 1, 9e-3],
            ["void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", 6, 5e-4],
            ["void (anonymous namespace)::softmax_warp_forward<float, float, float, 9, false, false>", 2, 4e-4]]
    secs, count = measured_by_class(rows)
    assert secs == pytest.approx({"matmul": 2e-3, "memory": 5e-4, "norm": 4e-4}) and count["memory"] == 6
    rates = gpu_rates(GPU_CATALOG["H200"])
    g = graphs["bf16"]
    feat = OpFeatures.of(g, Numerics())
    by_class = predicted_by_class(g, rates)
    assert set(by_class) <= set(("matmul", "conv", "attention", "norm", "memory", "opt")) and by_class["matmul"] > 0
    t = op_seconds(feat, rates, [B, 2 * B])
    assert sum(by_class.values()) == pytest.approx(t[:, 0].sum())
    for j, b in enumerate((B, 2 * B)):
        np.testing.assert_allclose(design(feat, rates, b) @ theta_of(rates), t[:, j], rtol=1e-9, atol=1e-15)


def test_stage_table_is_the_eager_pipeline(graphs):
    """The stages of an eager step add up to the finish of its last kernel when the host issues
    every kernel in eager order (forward 0..K-1, backward K-1..0, updates) without waiting and
    the GPU runs them in order (checked against a loop over the kernels); with no host cost the
    step is the kernels' sum, with a slow host it is the host's launches and its walks over the
    parameters in the optimizer's multi-tensor kernels (7 per Adam step). The backward's
    launches cost ``host_backward_s``, the forward's ``host_s``."""
    import dataclasses

    from tag.cost.gpu import FOREACH_KERNELS, launches, stage_table
    from tag.graph.ir import PHASES

    g = graphs["bf16"]
    feat = OpFeatures.of(g, Numerics())
    K = g.num_groups
    rates = dataclasses.replace(gpu_rates(GPU_CATALOG["H200"]), host_s=7e-6, host_backward_s=3e-6, opt_host_s=2e-6)
    t = op_seconds(feat, rates, [B])[:, 0]
    n = launches(feat, [B])[:, 0]
    walks = np.array([o.phase == "opt" for o in g.ops]) * FOREACH_KERNELS["adam"]
    assert g.optimizer == "adam" and walks.sum() == 7 * len(g.params) > 0
    key = {("fwd", k): k for k in range(K)} | {("bwd", k): 2 * K - 1 - k for k in range(K)} | \
        {("opt", k): 2 * K + k for k in range(K)}
    host = finish = 0.0
    for i in sorted(range(len(g.ops)), key=lambda i: (key[g.ops[i].phase, g.ops[i].group], i)):
        host += n[i] * (rates.host_backward_s if g.ops[i].phase == "bwd" else rates.host_s) \
            + walks[i] * rates.opt_host_s
        finish = max(finish, host) + t[i]
    tab = stage_table(g, feat, rates, [B])
    assert tab.shape == (K, len(PHASES), 1) and (tab >= 0).all()
    assert tab.sum() == pytest.approx(finish, rel=1e-12)
    no_host = dataclasses.replace(rates, host_s=0.0, host_backward_s=0.0, opt_host_s=0.0)
    assert stage_table(g, feat, no_host, [B]).sum() == pytest.approx(t.sum())
    bwd = np.array([o.phase == "bwd" for o in g.ops])
    slow = dataclasses.replace(rates, host_s=1.0, host_backward_s=0.25, opt_host_s=0.5)  # the device's work is hidden
    assert stage_table(g, feat, slow, [B]).sum() == \
        pytest.approx(n[~bwd].sum() + 0.25 * n[bwd].sum() + 0.5 * walks.sum(), rel=1e-3)
    one = dataclasses.replace(slow, host_backward_s=None)  # unset: the forward's
    assert stage_table(g, feat, one, [B]).sum() == pytest.approx(n.sum() + 0.5 * walks.sum(), rel=1e-3)


@pytest.mark.parametrize("host_s", [1e-7, 2e-4])
def test_stage_parts_compose_into_the_eager_step(graphs, host_s):
    """A stage's device seconds, host seconds and lag (tag.cost.gpu.stage_parts), composed in
    eager order as two timelines (a stage ends at max(device free + device, host start + device +
    lag), the host moves on by its seconds), end every stage where stage_table's eager pipeline
    does, on a host that keeps ahead of the device (0.1 us a launch: the step is the device's work)
    and one that does not (200 us: the step is the host's launches); device and host seconds are
    the ops' sums."""
    import dataclasses

    from tag.cost.gpu import host_seconds, stage_parts, stage_table

    g = graphs["bf16"]
    feat = OpFeatures.of(g, Numerics())
    rates = dataclasses.replace(gpu_rates(GPU_CATALOG["H200"]), host_s=host_s, host_backward_s=host_s / 2,
                                opt_host_s=2e-6)
    parts = stage_parts(g, feat, rates, [1, B])
    tab = stage_table(g, feat, rates, [1, B])
    K = g.num_groups
    assert parts.device.sum(axis=(0, 1)) == pytest.approx(op_seconds(feat, rates, [1, B]).sum(axis=0), rel=1e-12)
    assert parts.host.sum(axis=(0, 1)) == pytest.approx(host_seconds(g, feat, rates, [1, B]).sum(axis=0), rel=1e-12)
    assert (parts.lag >= 0).all()
    order = [(k, 0) for k in range(K)] + [(k, 1) for k in range(K - 1, -1, -1)] + [(k, 2) for k in range(K)]
    dev_free = host = np.zeros(2)
    eager = np.zeros(2)
    for k, ph in order:
        dev_free = np.maximum(dev_free + parts.device[k, ph], host + parts.device[k, ph] + parts.lag[k, ph])
        host = host + parts.host[k, ph]
        eager = eager + tab[k, ph]
        assert dev_free == pytest.approx(eager, rel=1e-12)
    work = parts.device.sum(axis=(0, 1))
    if host_s < 1e-6:  # the device's work bounds the step, the host's hidden behind it
        assert (host < 0.5 * work).all() and (dev_free < 1.05 * work).all()
    else:  # the host's launches bound it
        assert (host > 2 * work).all() and (dev_free >= host * (1 - 1e-12)).all()


def test_host_constants_are_fitted_on_one_table_per_step(graphs):
    """The fit's grid prediction (one stage table with a column per (host_s, host_backward_s)
    pair) is the simulated step at each pair, and the grid search finds the pair a step was
    made with: steps simulated at 30 us forward / 12 us backward per launch are fitted back to it
    (both host-bound at those constants, so neither is free)."""
    import dataclasses

    from evaluation.gpu_cost_check import fit_host, predict, predict_grid

    rates = gpu_rates(GPU_CATALOG["H200"])
    pairs = np.array([(0.0, 0.0), (30e-6, 12e-6), (12e-6, 30e-6), (1e-4, 1e-4)])
    for g in graphs.values():
        grid = predict_grid(g, rates, pairs)
        direct = [predict(g, dataclasses.replace(rates, host_s=a, host_backward_s=b)) for a, b in pairs]
        np.testing.assert_allclose(grid, direct, rtol=1e-12)
    made = dataclasses.replace(rates, host_s=30e-6, host_backward_s=12e-6)
    cases = [(g, predict(g, made), 1.0) for g in graphs.values()]
    host, bwd, step = fit_host(cases, rates)
    assert (round(host * 1e6), round(bwd * 1e6), step) == (30, 12, 0.0)


def test_unaligned_lm_head_is_seen_in_the_graph_and_costs_more(captured):
    """The graph keeps no shapes, but a matmul's FLOPs and the sizes of its operands give its
    dimensions (gemm_dims); a vocabulary of 66 (= 2 x 33) makes the LM head's three bf16 GEMMs
    (forward, input and weight gradients) 2-element aligned, every other GEMM 8-aligned (the token
    count, 4 x 16, scales with the batch and is never a leading dimension). fp32 GEMMs are not
    checked (their FFMA kernels need no 16-byte access)."""
    from tag.cost.gpu import ALIGN_ELEMENTS, gemm_dims

    g = captured("gpt2:n_layer=1,n_embd=32,n_head=2,vocab=66,seq=16", batch=B, groups=2, precision="bf16").graph
    feat = OpFeatures.of(g, Numerics())
    mm = [i for i, o in enumerate(g.ops) if op_class(o.target) == "matmul"]
    head = [i for i in mm if 66.0 in gemm_dims(g, g.ops[i], B)]
    assert len(head) == 3 and all(sorted(gemm_dims(g, g.ops[i], B)) == [32.0, 64.0, 66.0] for i in head)
    assert [int(feat.align[i]) for i in head] == [2, 2, 2]
    assert all(feat.align[i] == ALIGN_ELEMENTS for i in mm if i not in head)
    assert set(OpFeatures.of(captured(GPT2, batch=B, groups=2, precision="bf16").graph, Numerics()).align) \
        == {ALIGN_ELEMENTS}
    g32 = captured("gpt2:n_layer=1,n_embd=32,n_head=2,vocab=66,seq=16", batch=B, groups=2).graph
    assert not OpFeatures.of(g32, Numerics()).unaligned().any()
    # the rule stays linear in its unknowns with unaligned GEMMs in the graph
    rates = fitted_rates("H200")
    np.testing.assert_allclose(design(feat, rates, B) @ theta_of(rates), op_seconds(feat, rates, [B])[:, 0],
                               rtol=1e-9, atol=1e-15)


def test_unaligned_bf16_gemm_costs_more_than_an_aligned_one_of_the_same_flops():
    """Same FLOPs, same per-call floor: aligned to a = 1, 2, 4 elements a bf16 GEMM runs at a/8 of
    the aligned rate (matmul_unaligned = matmul:low / 8, the width of its loads); fp32 GEMMs
    ignore alignment. The H200's LM-head kernels (evaluation/results/gpu-check/2026-11-26-h200
    run1.jsonl) measured 119 TFLOP/s at 1 element (GPT-2's 50257 vocabulary, 3 cutlass align1
    kernels, 7.94 ms) and 240 at 2 (BERT's 30522, 3 align2 kernels, 2.40 ms): the rule gives
    96 and 191, an eighth and a quarter of the aligned 765 it fits (since 2026-11-28; 97 and 195
    of the microbenchmark's 780 before): the load-width bound is 20-25% pessimistic for these
    kernels, which the 30% band below states."""
    gpt2, bert = (2.0 * 4096 * 768 * vocab for vocab in (50257, 30522))  # 8 x 512 tokens, width 768
    rates = fitted_rates("H200")

    def seconds(align: int, mode: str, flops: float = gpt2) -> float:
        feat = OpFeatures(np.array([OP_CLASSES.index("matmul")]), np.array([MODES.index(mode)]),
                          np.array([[flops, 0.0]]), np.zeros((1, 2)), 1.0, np.array([True]), np.array([align]))
        return float(op_seconds(feat, rates, [1])[0, 0])

    t = {a: seconds(a, "low") for a in (1, 2, 4, 8)}
    assert t[1] > t[2] > t[4] > t[8]
    floor = rates.matmul_floor("low")
    assert (t[1] - floor) == pytest.approx(8 * (t[8] - floor)) and (t[2] - floor) == pytest.approx(4 * (t[8] - floor))
    assert 3 * t[1] == pytest.approx(7.94e-3, rel=0.3) and 3 * seconds(2, "low", bert) == pytest.approx(2.40e-3, rel=0.3)
    assert 3 * t[1] > 7.94e-3 and 3 * seconds(2, "low", bert) > 2.40e-3  # the bound: never faster than measured
    assert seconds(1, "fp32") == seconds(8, "fp32")
    a100 = gpu_rates(GPU_CATALOG["A100-80GB"])  # derived types keep the ratio to their aligned rate
    assert float(a100.unaligned_rate(1)) == pytest.approx(a100.matmul["low"] / 8)


def test_optimizer_host_seconds_are_read_from_the_profiled_op_table(graphs):
    """opt_host_s of one profiled step: its _foreach_* calls and Adam's two item() per parameter
    (extra item() calls of the model are not counted), per parameter and multi-tensor kernel; the
    stored value is the median over the fit steps (GPT-2 6L fp32, run 1 of 2026-11-26: 76
    parameters, 1.22 ms of _foreach_* calls, 152 of its 153 item() calls: 2.76 us)."""
    from evaluation.gpu_cost_check import FIT_STEPS, optimizer_host_s

    g = graphs["fp32"]
    n = len(g.params)
    rows = [["aten::_foreach_sqrt", 1, 7e-4], ["aten::_foreach_add_", 2, 3e-4], ["aten::item", 2 * n + 3, 1e-6 * (2 * n + 3)],
            ["aten::mm", 10, 5e-4]]
    assert optimizer_host_s(rows, g) == pytest.approx((1e-3 + 2e-6 * n) / n / 7)
    assert optimizer_host_s([["aten::mm", 10, 5e-4]], g) is None
    rec = next(json.loads(line) for line in (REPO / FIT_STEPS[0]).read_text().splitlines()
               if '"kind": "step"' in line)
    assert rec["spec"].startswith("gpt2:n_layer=6") and rec["precision"] == "fp32"

    class Graph:  # the parameter count and optimizer of that step's graph (76 tensors, Adam)
        optimizer, params = "adam", [None] * 76

    assert optimizer_host_s(rec["ops"]["top_ops"], Graph()) == pytest.approx(2.76e-6, rel=0.01)


def test_bf16_batch_norm_runs_two_kernels_at_its_own_rate(captured):
    """A batch norm in bf16 (PyTorch's native kernels, two per direction on the H200; cuDNN's one
    in fp32) is marked in the features, costs ``BN_BF16_KERNELS`` per-kernel floors and its bytes
    at ``bn_bf16_bw``; the rule stays linear in the fitted unknowns; fp32 and fp16 batch norms
    (cuDNN's: PyTorch takes no bf16 there) are untouched."""
    import dataclasses

    rates = fitted_rates("H200")
    feats = {}
    for p in ("fp32", "fp16", "bf16"):
        g = captured("resnet:depth=18,width=8,image=16", batch=B, groups=2, precision=p).graph
        feat = feats[p] = OpFeatures.of(g, Numerics())
        bn = np.array(["batch_norm" in o.target for o in g.ops])
        assert bn.sum() >= 2 * 20  # forward and backward of every batch norm of ResNet-18
        np.testing.assert_array_equal(feat.bn_bf16_mask(), bn if p == "bf16" else np.zeros_like(bn))
        np.testing.assert_allclose(design(feat, rates, B) @ theta_of(rates), op_seconds(feat, rates, [B])[:, 0],
                                   rtol=1e-9, atol=1e-15)
    feat = feats["bf16"]
    k = np.flatnonzero(feat.bn_bf16_mask() & feat.kernel)[0]
    slow = dataclasses.replace(rates, bn_bf16_bandwidth=rates.bn_bf16_bandwidth / 2)
    extra = op_seconds(feat, slow, [B])[k, 0] - op_seconds(feat, rates, [B])[k, 0]
    assert extra == pytest.approx((feat.nbytes[k, 0] + feat.nbytes[k, 1] * B) / rates.bn_bf16_bandwidth)
    floor = dataclasses.replace(rates, kernel_s=rates.kernel_s + 1e-3)
    assert op_seconds(feat, floor, [B])[k, 0] - op_seconds(feat, rates, [B])[k, 0] == pytest.approx(2e-3)


def test_fused_attention_is_costed_in_whole_tiles():
    """A fused attention kernel computes whole tiles of query-key pairs (:data:`ATTENTION_TILES`,
    the H200's kernels): lengths that are multiples of the tile cost their FLOPs, ViT's 197 tokens
    cost 256's, a causal attention the tiles on and below the diagonal; the features carry the
    factor and nothing else moves."""
    import dataclasses

    from tag.cost.gpu import ATTENTION_TILES, attention_tile_fraction, tile_pairs

    assert tile_pairs(197, 197, False, (64, 64)) == 256 * 256
    assert tile_pairs(128, 128, True, (64, 128)) == 64 * 128 + 64 * 128  # both row tiles need the one key tile
    assert tile_pairs(256, 256, True, (64, 64)) == 64 * 64 * (1 + 2 + 3 + 4)
    assert tile_pairs(64, 256, True, (64, 64)) == 64 * 64  # top-left aligned: 64 rows see 64 keys
    assert attention_tile_fraction((512, 512, False), "low", "fwd") == 1.0
    assert attention_tile_fraction((197, 197, False), "fp32", "bwd") == pytest.approx((256 / 197) ** 2)
    assert attention_tile_fraction((1024, 1024, True), "low", "fwd") == pytest.approx(
        64 * 128 * sum(-(-(r + 64) // 128) for r in range(0, 1024, 64)) / (1024 * 1025 / 2))
    assert attention_tile_fraction(None, "low", "fwd") == 1.0
    assert set(ATTENTION_TILES) == set(ATTENTION_MODES)

    g = _gpt2_sdpa_graph()
    feat = OpFeatures.of(g, Numerics())
    att = np.array([op_class(o.target) == "attention" for o in g.ops])
    assert att.sum() == 4 and all(o.attention == (20, 20, True, 0.0) for o, a in zip(g.ops, att) if a)
    untiled = dataclasses.replace(g, ops=[dataclasses.replace(o, attention=None) for o in g.ops])
    plain = OpFeatures.of(untiled, Numerics())
    want = np.array([attention_tile_fraction(o.attention, "fp32", o.phase) if a else 1.0 for o, a in zip(g.ops, att)])
    assert (want[att] > 1).all()
    np.testing.assert_allclose(feat.flops, plain.flops * want[:, None])
    np.testing.assert_array_equal(feat.nbytes, plain.nbytes)


def _gpt2_sdpa_graph():
    from tag.graph import capture

    spec = "gpt2:n_layer=2,n_embd=32,n_head=2,seq=20,vocab=64,attn=sdpa"
    return capture(load_workload(spec, batch=2, abstract=True), num_groups=2).graph


# ------------------------------------------------------------------ published rates per GPU type
SAILOR_LAYER = "gpt2:n_layer={L},n_embd=1024,n_head=16,vocab=1024,seq=2048"
AMP_LAYER = "gpt2:n_layer={L},n_embd=1024,n_head=16,vocab=1024,seq=1024"


def test_published_rates_are_loaded_with_their_sources(tmp_path):
    """Every published rate names a source with a repository and commit (or an address), and a
    type with published rates is costed with them: the V100's fp16 matmul rate is the best FLOPs /
    seconds of the four GEMMs Aceso timed (94 TFLOP/s, where the H200's ratios on its datasheet
    give 97; the 32 GB part is the same chip), the T4's the 24 TFLOP/s cuBLAS run; bad input names
    its field."""
    data = load_published()
    for entry in data["rates"].values():
        for e in ([] if "same_as" in entry else entry.values()):
            src = data["sources"][e["source"]]
            assert ("repo" in src and len(src["commit"]) == 40) or src["url"].startswith("https://")
            assert published_value(e) > 0
    v100 = gpu_rates(GPU_CATALOG["V100-SXM2-16GB"])
    points = data["rates"]["V100-SXM2-16GB"]["matmul:low"]["points"]
    assert v100.source == "published:V100-SXM2-16GB"
    assert v100.matmul["low"] == max(f / s for _, f, s in points) == pytest.approx(94.2e12, rel=0.01)
    assert gpu_rates(GPU_CATALOG["V100-SXM2-32GB"]).matmul == v100.matmul  # same_as: the same part
    t4 = gpu_rates(GPU_CATALOG["T4"])
    assert (t4.source, t4.matmul["low"], t4.bandwidth) == ("published:T4", 24e12, 239.6e9)
    assert published_rates("L4") == {}
    bad = json.loads(json.dumps(data))
    bad["rates"]["T4"]["matmul:low"]["source"] = "nowhere"
    path = tmp_path / "published.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(TopologyError, match=r"rates\.T4\.matmul:low\.source: expected one of"):
        load_published(path)


def test_a_published_rate_replaces_its_constants_and_what_derives_from_them():
    """The T4's published fp16 matmul rate and bandwidth replace the datasheet-derived ones; the
    convolution and attention rates of that mode keep their ratio to the matmul rate, the norm and
    optimizer bandwidths theirs to the elementwise one; seconds (host, floors) stay the H200's;
    pre-Ampere, a tf32 op runs at the fp32 rate."""
    spec = GPU_CATALOG["T4"]
    base, pub = datasheet_rates(spec), gpu_rates(spec)
    f, bw = pub.matmul["low"] / base.matmul["low"], pub.bandwidth / base.bandwidth
    assert f == pytest.approx(24e12 / base.matmul["low"]) and f != 1.0
    assert pub.conv["low"] == pytest.approx(base.conv["low"] * f)
    assert pub.attention_rate("low") == pytest.approx(base.attention_rate("low") * f)
    assert pub.norm_bw == pytest.approx(base.norm_bw * bw) and pub.opt_bw == pytest.approx(base.opt_bw * bw)
    assert pub.matmul["fp32"] == base.matmul["fp32"] and pub.matmul["tf32"] == pub.matmul["fp32"]
    assert (pub.host_s, pub.host_bwd, pub.kernel_s, pub.matmul_call_s) == \
        (base.host_s, base.host_bwd, base.kernel_s, base.matmul_call_s)


def _amp_layer(gpu: str, rates):
    return layer_seconds(AMP_LAYER, "fp16", rates, Numerics(), [1])[0, 0]


def test_v100_to_t4_layer_ratio_is_within_the_published_range():
    """AMP's GPT-2 medium layers (fp16, micro-batch 1) ran 1.14-1.51x slower on a T4 than on a
    V100 although the V100's published GEMM rate is 3.9x the T4's: the V100 layer is host-bound
    (3.9 ms for 1.7 ms of device work). With one host launch cost fitted on the V100 layer alone
    (103 us, against the H200 host's 55), the T4's layer is predicted (GPU-bound, 5.25 ms against
    5.70) and the ratio lands in the published range (1.35)."""
    import dataclasses

    layers = {r["gpu"]: r for r in load_published()["layers"] if r["source"] == "amp-layers"}
    v100, t4 = (gpu_rates(GPU_CATALOG[n]) for n in ("V100-SXM2-16GB", "T4"))
    device = {n: _amp_layer(n, dataclasses.replace(r, host_s=0.0, host_backward_s=0.0))
              for n, r in (("V100-SXM2-16GB", v100), ("T4", t4))}
    assert device["T4"] / device["V100-SXM2-16GB"] > 2.5  # the GPUs alone: far from the published ratio
    lo, hi = 1e-6, 1e-3  # host seconds per launch: bisect the V100 layer onto its published time
    for _ in range(40):
        h = (lo * hi) ** 0.5
        t = _amp_layer("V100-SXM2-16GB", dataclasses.replace(v100, host_s=h, host_backward_s=h))
        lo, hi = (h, hi) if t < layers["V100-SXM2-16GB"]["forward_s"] else (lo, h)
    t4_pred = _amp_layer("T4", dataclasses.replace(t4, host_s=h, host_backward_s=h))
    (v_lo, v_hi), (t_lo, t_hi) = layers["V100-SXM2-16GB"]["forward_range_s"], layers["T4"]["forward_range_s"]
    assert t_lo / v_hi <= t4_pred / layers["V100-SXM2-16GB"]["forward_s"] <= t_hi / v_lo
    assert t4_pred == pytest.approx(layers["T4"]["forward_s"], rel=0.15)


def test_per_sample_layer_time_falls_with_the_micro_batch_to_the_large_batch_rate():
    """A layer's per-sample seconds never grow with the micro-batch and approach the large-batch
    rate (per-kernel floors and host launches are paid once per micro-batch). Against Sailor's
    OPT-350M profiles, per-sample forward at micro-batch 1 over the largest: where the host bounds
    micro-batch 1 (GH200, 1 over 8) the rule falls, 1.19x against the published 1.40x (the host's
    share is under-predicted); where the GPU does (V100, 1 over 4) it is flat, as published."""
    batches = np.array([1, 2, 4, 8, 16, 32, 64])
    for gpu, tf32 in (("V100-SXM2-16GB", False), ("GH200-96GB", True), ("T4", False)):
        t = layer_seconds(SAILOR_LAYER, "fp32", gpu_rates(GPU_CATALOG[gpu]), Numerics(matmul_tf32=tf32), batches)
        per = t.sum(axis=0) / batches
        assert np.all(np.diff(per) <= 1e-12 * per[0])
        assert per[-2] / per[-1] - 1 < 0.01
    fall = {}
    for gpu, tf32, last in (("GH200-96GB", True, 8), ("V100-SXM2-16GB", False, 4)):
        pub = {r["micro_batch"]: r["forward_s"] for r in load_published()["layers"] if r["gpu"] == gpu
               and r["source"] == "sailor-layers"}
        t = layer_seconds(SAILOR_LAYER, "fp32", gpu_rates(GPU_CATALOG[gpu]), Numerics(matmul_tf32=tf32), [1, last])
        fall[gpu] = (t[0, 0] / (t[0, 1] / last), pub[1] / (pub[last] / last))
    assert 1.1 < fall["GH200-96GB"][0] < fall["GH200-96GB"][1]
    assert fall["V100-SXM2-16GB"][0] == pytest.approx(fall["V100-SXM2-16GB"][1], abs=0.03)


def test_megatron_runtime_fuses_forward_elementwise_runs(captured):
    """``runtime="eager"`` is the default, op for op; ``megatron`` launches fewer forward kernels
    and moves fewer bytes, fuses a softmax into its run in bf16 only, and costs Sailor's
    Megatron-DeepSpeed OPT-350M layers (fp32) forward within 10% at the median on seven GPU types
    (6.0% measured; eager, TAG's executor: 0.97-1.51x the published, median 30%)."""
    from tag.cost.gpu import RUNTIMES, launches, layer_check
    from tag.cost.model import CostModel
    from tag.errors import TagError
    from tag.topology import load_topology

    assert set(RUNTIMES) == {"eager", "megatron"}
    g32, g16 = (captured(GPT2, batch=B, groups=2, precision=p).graph for p in ("fp32", "bf16"))
    for g in (g32, g16):
        eager, default, meg = OpFeatures.of(g, Numerics(), "eager"), OpFeatures.of(g, Numerics()), \
            OpFeatures.of(g, Numerics(), "megatron")
        assert np.array_equal(eager.kernel, default.kernel) and np.array_equal(eager.nbytes, default.nbytes)
        fwd = np.array([o.phase == "fwd" for o in g.ops])
        assert launches(meg, [B])[fwd].sum() < launches(eager, [B])[fwd].sum()
        assert (meg.nbytes[fwd] @ [1, B]).sum() < (eager.nbytes[fwd] @ [1, B]).sum()
    soft = [i for i, o in enumerate(g32.ops) if o.phase == "fwd" and "softmax" in o.target]
    assert soft and OpFeatures.of(g32, Numerics(), "megatron").kernel[soft].all()
    soft16 = [i for i, o in enumerate(g16.ops) if o.phase == "fwd" and "softmax" in o.target]
    assert not OpFeatures.of(g16, Numerics(), "megatron").kernel[soft16].all()
    with pytest.raises(TagError, match="runtime: expected one of"):
        OpFeatures.of(g32, Numerics(), "fsdp")
    topo = load_topology("topologies/homogeneous-2x4-v100.yaml")
    cm = CostModel.for_topology(g16, topo, profile_dir="/nonexistent", runtime="megatron")
    assert cm.source(0).endswith("+megatron")
    assert CostModel.for_topology(g16, topo, profile_dir="/nonexistent").table(0).sum() > cm.table(0).sum()
    rows = [r for r in layer_check(runtime="megatron") if r["source"] == "sailor-layers"]
    assert len({r["gpu"] for r in rows}) == 7
    err = np.median([abs(r["pred_forward_s"] / r["forward_s"] - 1) for r in rows])
    assert err < 0.10
