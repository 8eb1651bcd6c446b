"""Ada-Grouper's adaptive kFkB on the executor (tag.executor.adaptive): a throttled link on gloo
makes the ranks switch to a larger block size between iterations, and the parameters after the
switch equal single-process training."""

from __future__ import annotations

import pytest
from test_executor import MLP
from test_executor_dist import cpu_topology
from test_pipeline_exec import assert_equal_params, two_stages

from tag.errors import TagError
from tag.executor import ExecuteConfig, execute, reference_training
from tag.executor.adaptive import Throttle, allowed_ks
from tag.executor.equality import saved_params
from tag.topology import load_topology
from tag.workloads import load_workload


def test_throttle_spec():
    t = Throttle.parse("1:40:2:5")
    assert (t.ranks, t.delay_s, t.start, t.stop) == ({1}, 0.04, 2, 5)
    assert Throttle.parse("0,1:5").delay_at(0, 9) == Throttle.parse("0,1:5").delay_at(1, 0) == 0.005
    assert [t.delay_at(1, i) for i in range(7)] == [0, 0, 0.04, 0.04, 0.04, 0, 0]
    assert t.delay_at(0, 3) == 0 and Throttle.parse(None) is None
    for bad in ("1", "a:3", "1:-2", "1:2:3:4:5", "-1:5"):
        with pytest.raises(TagError, match=r"^--inject-delay: expected RANKS:MS\[:FROM\[:TO\]\]"):
            Throttle.parse(bad)


def test_adaptive_k_needs_a_blocked_pipeline(captured, topo4):
    """The block sizes offered: 1, 2, 4, 8 up to the micro-batches, where the simulator finds they
    fit; a plan without a kFkB-family pipeline refused in one line."""
    graph = captured(MLP, batch=8, groups=4).graph
    plan = two_stages(graph, topo4, [0], [1], 4, "1f1b")
    assert allowed_ks(graph, topo4, plan) == [1, 2, 4]
    plan.pipeline = None
    with pytest.raises(TagError, match="^--adaptive-k: expected a plan pipelined with 1f1b, kfkb or gpipe, got no "
                                       "pipeline$"):
        allowed_ks(graph, topo4, plan)


WIDE = "mlp:in_dim=512,hidden=2048,layers=4"
"""Stages of some milliseconds (forward ~6 ms, backward ~15 ms per micro-batch of 16 samples on a
core of the development VM), for a link delay of the same order."""


@pytest.mark.slow
def test_a_throttled_link_grows_k_and_training_stays_exact(tmp_path, captured):
    """2 stages on 2 gloo ranks, B=64 in 4 micro-batches, 1F1B, --adaptive-k; rank 0's link holds
    each message 20 ms: the ranks start at the plan's k = 1, measure the delay (10 ms per boundary
    crossing, both directions averaged) and switch to a larger block, all at once (the rule
    predicts k = 2 ahead of 1F1B by 8-10% for forward / backward seconds from 6 / 15 to 30 / 65 ms:
    an idle or a loaded VM); the parameters after 3 steps across the switch equal single-process
    training."""
    graph = captured(WIDE, batch=64, groups=4, optimizer="sgd").graph
    topo_path = cpu_topology(tmp_path, 2)
    plan = two_stages(graph, load_topology(topo_path), [0], [1], 4, "1f1b")
    plan.save(tmp_path / "plan.json")
    cfg = ExecuteConfig(WIDE, topo_path, str(tmp_path / "plan.json"), steps=3, warmup=0, save_params=True,
                        optimizer="sgd", run_dir=str(tmp_path / "run"), timeout_s=60.0, adaptive_k=True,
                        delay="0:20")
    res = execute(cfg, graph=graph)
    params = saved_params(tmp_path / "run", res.world_size)
    ks = [[it["k"] for it in r["iterations"]] for r in res.ranks]
    assert ks[0] == ks[1], ks  # every rank runs the same block size
    assert ks[0][0] == 1 and ks[0][-1] > 1, ks
    x = res.ranks[0]["iterations"][0]["next_k"]["transfer_s"]
    assert x >= 0.010, x  # 4 messages of >= 20 ms over 2 x 4 crossings
    ref, losses = reference_training(load_workload(WIDE, batch=64), "sgd", 3)
    assert_equal_params(params, ref, graph)
    assert res.losses == pytest.approx(losses, rel=1e-5)
