"""``tag run --adaptive-k``: Ada-Grouper's adaptive kFkB between optimizer steps of a training run
(tag.executor.train with tag.executor.adaptive.AdaptiveK): a throttled link on gloo makes the
ranks switch to a larger block size, every rank alike, and the trained parameters equal
single-process training."""

from __future__ import annotations

import json

import pytest
from test_executor_dist import cpu_topology
from test_pipeline_exec import assert_equal_params, two_stages

from tag.cli import main
from tag.executor import reference_training
from tag.executor.equality import saved_params
from tag.topology import load_topology
from tag.workloads import load_workload

WIDE = "mlp:in_dim=512,hidden=2048,layers=4"
"""Stages of some milliseconds (forward ~6 ms, backward ~15 ms per micro-batch of 16 samples on a
core of the development VM), for a link delay of the same order."""


def test_tag_run_adapts_k_between_steps(tmp_path, captured):
    """2 stages on 2 gloo ranks, B=64 in 4 micro-batches, 1F1B, ``tag run --adaptive-k`` for 3
    SGD steps; rank 0's link holds each message 20 ms: the first step runs the plan's k = 1, its
    measured crossings (>= 10 ms each) make every rank switch to a larger block for the next; the
    parameters after the steps across the switch equal single-process training."""
    graph = captured(WIDE, batch=64, groups=4, optimizer="sgd").graph
    topo_path = cpu_topology(tmp_path, 2)
    plan = two_stages(graph, load_topology(topo_path), [0], [1], 4, "1f1b")
    plan.save(tmp_path / "plan.json")
    run = tmp_path / "run"
    assert main(["run", "--model", WIDE, "--topology", topo_path, "--plan", str(tmp_path / "plan.json"),
                 "--batch", "64", "--optimizer", "sgd", "--groups", "4", "--steps", "3", "--lr-schedule", "constant",
                 "--run-dir", str(run), "--save-params", "--json", "--timeout", "60",
                 "--adaptive-k", "--inject-delay", "0:20"]) == 0
    records = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    ks = [r["k"] for r in records]
    assert len(ks) == 3 and ks[0] == 1 and ks[-1] > 1, ks
    assert records[0]["next_k"]["transfer_s"] >= 0.010, records[0]["next_k"]
    ref, losses = reference_training(load_workload(WIDE, batch=64), "sgd", 3)
    assert_equal_params(saved_params(run, 2), ref, graph)
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-5)


def test_tag_run_refuses_adaptive_k_without_a_pipeline(tmp_path, captured, capsys):
    """A plan without a pipeline: one line naming --adaptive-k, before any rank starts."""
    from tag.cost.baselines import data_parallel

    graph = captured(WIDE, batch=64, groups=4, optimizer="sgd").graph
    topo_path = cpu_topology(tmp_path, 2)
    data_parallel(graph, load_topology(topo_path)).save(tmp_path / "dp.json")
    assert main(["run", "--model", WIDE, "--topology", topo_path, "--plan", str(tmp_path / "dp.json"),
                 "--batch", "64", "--optimizer", "sgd", "--groups", "4", "--steps", "1",
                 "--run-dir", str(tmp_path / "run"), "--adaptive-k"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--adaptive-k: expected a plan pipelined with 1f1b, kfkb or gpipe" in err[0], err
