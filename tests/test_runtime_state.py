"""Sharded training state as another runtime holds it (:data:`tag.sim.sharded.STATE_RUNTIMES`):
bytes a parameter of a small bf16 / fp16 GPT-2 on 4 H100s, Adam, read off the simulator's layouts
(held: the replicated layout's bytes less the sharded one's; transient: the sharded layout's
working set less the replicated one's)."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest

from tag.errors import TagError
from tag.parallel.layout import parse_layout
from tag.planner import layout_plan, model_graph
from tag.sim import Simulator
from tag.sim.sharded import deepspeed_zero3_transient, hold_state_as, sharded_layout
from tag.topology import load_topology

SPEC = "gpt2:n_layer=2,n_embd=64,n_head=2,vocab=256,seq=32"
S = 4  # devices a shard group


@functools.cache
def _graph(precision: str):
    return model_graph(SPEC, 8, precision=precision, num_groups=4, use_cache=False)[0]


def _sim(precision: str, runtime: str) -> Simulator:
    graph = copy.copy(_graph(precision))  # (the mark is the copy's own)
    return Simulator(hold_state_as(graph, runtime), load_topology("topologies/h100-8gpu.yaml"))


def _held_per_param(sim: Simulator, level: int) -> tuple[float, np.ndarray, object]:
    """Bytes a parameter the sharded groups hold for the whole iteration (casts apart), and the
    replicated and sharded layouts."""
    static = sim.static
    lay = sim.layout(tuple(range(S)), (2,) * S)
    zero = sharded_layout(sim, lay, level, S)
    p = static.grad_bytes
    o = np.array([float(x.sum()) for x in static.static_pos]) - 2 * p
    freed = lay.mem[:, 0] - zero.mem[:, 0]  # [K] (2 P + O) - state + the casts no longer held
    state = (2 * p + o) - freed + static.saved_casts * (level == 3 or sim.graph.state_runtime != "tag")
    numel = p.sum() / 4  # (TAG's parameters are fp32)
    return float(state.sum() / numel), lay, zero


@pytest.mark.parametrize("runtime,level,per_param", [
    ("megatron", 1, 6 + 12 / S),  # Megatron-LM's distributed optimizer, bf16 params, fp32 grads
    ("deepspeed", 3, 16 / S),  # DeepSpeed ZeRO-3: 2-byte weight and gradient, fp32 master and Adam
])
def test_sharded_state_per_parameter(runtime, level, per_param):
    """Megatron-LM's table (dist_optimizer.md, "float16 param, fp32 grads": 6 + 12/d bytes) and
    DeepSpeed ZeRO-3's 16/d; TAG's own zero=1 under bf16 holds its fp32 weights, gradients and
    a master shard besides (4 + 4 + 16/S where a group's weights are gathered in bf16)."""
    got, _, _ = _held_per_param(_sim("bf16" if runtime == "megatron" else "fp16", runtime), level)
    assert got == pytest.approx(per_param, rel=1e-9)
    if runtime == "megatron":
        tag, _, _ = _held_per_param(_sim("bf16", "tag"), level)
        assert 4 + 4 + 8 / S < tag <= 4 + 4 + 12 / S  # (the master shard: weights read only as casts)


def test_megatron_replicated_state_stays_tags():
    """zero=0 under runtime=megatron is held as TAG's replicated groups hold it (16 bytes a
    parameter and the casts): the same peak as the unmarked graph."""
    peaks = []
    for runtime in ("tag", "megatron"):
        sim = _sim("bf16", runtime)
        plan = layout_plan(sim.graph, sim.topology, parse_layout("dp=8,tp=1,pp=1,micro=1"), sim.costs)
        peaks.append(sim.run(plan.groups, pipeline=plan.pipeline).peak_memory_bytes)
    assert peaks[0] == peaks[1]
    static = _sim("bf16", "megatron").static
    assert sum(x.sum() for x in static.static_pos) == 16 * static.grad_bytes.sum() / 4


def test_deepspeed_zero3_working_set():
    """While a ZeRO-3 group runs DeepSpeed holds its 2-byte gathered weights, the neighbour's
    prefetched (below the 5e7-element bucket here: all of it) and its 2-byte gradients (below the
    5e8-element reduce bucket), no casts; TAG's account holds the fp32 gradient besides. A group
    of 4e9 fp32 bytes (1e9 elements) fills the reduce bucket: 1e9 bytes plus its largest
    parameter's gradient."""
    sim = _sim("fp16", "deepspeed")
    _, lay, zero = _held_per_param(sim, 3)
    p = sim.static.grad_bytes
    low = p / 2
    nb = np.maximum(np.r_[0.0, low[:-1]], np.r_[low[1:], 0.0])
    assert np.allclose(zero.work[:, 0] - lay.work[:, 0], np.where(p > 0, 2 * low + nb, 0.0))
    big = np.full_like(p, 4e9)
    largest = max(x.nbytes for x in sim.graph.params)
    got = deepspeed_zero3_transient(sim, big)
    assert got.max() <= 2e9 + 1e8 + 1e9 + largest / 2 and got.min() >= 2e9 + 1e8 + 1e9


def test_unknown_state_runtime_is_one_line():
    with pytest.raises(TagError, match="state runtime: expected one of"):
        hold_state_as(copy.copy(_graph("bf16")), "fsdp")
