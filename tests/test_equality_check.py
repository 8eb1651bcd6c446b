"""Executed training equals single-process training, as the NCCL check measures it
(:mod:`tag.executor.equality`): the parameter comparison, and :func:`check_layouts` on 2 gloo
ranks for the smallest layouts (data parallel, a 1F1B pipeline, tensor parallel). The same
function on NCCL is ``evaluation/gpu_check.py --only-multi-gpu`` (2+ GPUs)."""

from __future__ import annotations

import math

import pytest
import torch

from tag.errors import TagError
from tag.executor.equality import (
    ATOL,
    GPT2,
    MLP,
    RTOL,
    assert_params_equal,
    check_layouts,
    compare_params,
    saved_params,
)


def test_saved_params_reads_tensors_only(tmp_path):
    """A rank's parameter file is read as every .pt file (tag.io.load_tensors, SECURITY.md): tensors
    come back; a file naming any other Python object is refused in one line before it runs."""
    torch.save({"w": torch.arange(3.0)}, tmp_path / "params-rank0.pt")
    assert torch.equal(saved_params(tmp_path, 1)[0]["w"], torch.arange(3.0))
    torch.save({"w": math.sqrt}, tmp_path / "params-rank1.pt")
    with pytest.raises(TagError, match=r"params-rank1\.pt: not a parameter file: it holds Python objects"):
        saved_params(tmp_path, 2)

def test_compare_params_measures_against_the_tolerance():
    ref = {"a": torch.tensor([1.0, -2.0, 0.0]), "b": torch.tensor([[0.5]])}
    same = {0: {"a": ref["a"].clone()}, 1: {"b": ref["b"].clone()}}
    d = assert_params_equal(same, ref, {"a", "b"}, exact=True)
    assert (d.max_abs, d.max_rel, d.tol_ratio) == (0.0, 0.0, 0.0)

    near = {0: {"a": ref["a"] + torch.tensor([0.0, 0.0, 0.5 * ATOL])}, 1: {"b": ref["b"] * (1 + 0.5 * RTOL)}}
    d = compare_params(near, ref, {"a", "b"})
    # (float32: 0.5 * (1 + 5e-5) rounds to a relative step of 4.995e-5)
    assert d.ok and d.tol_ratio == pytest.approx(0.5, rel=1e-2) and d.max_rel == pytest.approx(0.5 * RTOL, rel=1e-2)

    far = {0: {"a": ref["a"] + torch.tensor([0.0, 3 * RTOL * 2.0, 0.0])}, 1: {"b": ref["b"].clone()}}
    d = compare_params(far, ref, {"a", "b"})
    assert not d.ok and d.worst == "rank 0 a" and d.tol_ratio == pytest.approx(3 * 2.0 * RTOL / (ATOL + 2.0 * RTOL),
                                                                                 rel=1e-3)
    with pytest.raises(AssertionError, match=r"x the tolerance \(rtol 0.0001, atol 1e-06\) at rank 0 a$"):
        assert_params_equal(far, ref, {"a", "b"})

    nan = {0: {"a": torch.tensor([1.0, math.nan, 0.0]), "b": ref["b"]}}
    assert not compare_params(nan, ref).ok and compare_params(nan, ref).tol_ratio == math.inf
    assert compare_params({0: {"a": ref["a"]}}, ref, {"a", "b"}).problems == ["held by no rank: b"]
    assert compare_params(same, ref, {"a"}, exact=True).problems == ["held but not expected: b"]
    assert compare_params({0: {"c": ref["a"]}}, ref).problems == ["rank 0 c: not a parameter of the reference"]
    assert compare_params({0: {"a": ref["a"][:2]}}, ref).problems == ["rank 0 a: shape (2,), reference (3,)"]


@pytest.mark.slow
def test_two_gloo_ranks_train_as_one_process():
    """``tag execute --save-params`` of each layout on 2 gloo ranks, 2 SGD steps: every rank's
    parameters within the executor's tolerance of single-process training, the losses too."""
    layouts = [(MLP, "dp=2"), (MLP, "pp=2,micro=2,schedule=1f1b"), (GPT2, "tp=2")]
    records = check_layouts("gloo", 2, layouts=layouts, timeout_s=60.0)
    assert [(r["model"], r["layout"]) for r in records] == layouts
    for r in records:
        assert r["pass"] is True, r
        assert (r["backend"], r["world_size"], r["steps"]) == ("gloo", 2, 2)
        assert 0 <= r["tol_ratio"] <= 1 and r["max_abs_diff"] < 1e-6 and r["loss_rel_diff"] <= 1e-4
        assert r["seconds"] > 0 and "note" not in r
    # A layout needing more devices than given is left out; a past deadline skips the rest.
    assert check_layouts("gloo", 2, layouts=[(GPT2, "dp=2,tp=2")]) == []
    (skipped,) = check_layouts("gloo", 2, layouts=[(MLP, "dp=2")], deadline=0.0)
    assert skipped["pass"] is None and skipped["note"] == "skipped: time budget"
