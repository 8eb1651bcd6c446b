"""Hand-built op graphs, topologies and cost models for simulator tests (no torch capture)."""

from __future__ import annotations

import numpy as np

from tag.cost.model import CommModel, CostModel, DeviceCost
from tag.graph.ir import Affine, Group, Op, OpGraph, Param, Tensor
from tag.topology import load_topology

A0 = Affine(0.0, 0.0)


def chain_graph(num_groups: int = 2, *, act_bytes: float = 400.0, param_bytes: int = 1000,
                positions: int = 1, batch: int = 8) -> OpGraph:
    """A chain: group g has ``positions`` forward ops (the first reads param ``w<g>``), each
    producing a batch activation of ``act_bytes`` per sample; the last forward op makes the loss.
    Backward mirrors it (each op reads its output's gradient and its saved input), gradients of
    activations are batch tensors, the weight gradient is made at the group's first position."""
    ops: list[Op] = []
    tensors: list[Tensor] = []
    params: list[Param] = []

    def tensor(name, kind, nbytes, bdim, producer):
        tensors.append(Tensor(name, kind, nbytes, bdim, producer))
        return len(tensors) - 1

    def op(name, phase, ins, out_name, out_kind, out_bytes, bdim, group, anchor, flops=1.0):
        i = len(ops)
        out = tensor(out_name, out_kind, out_bytes, bdim, i)
        for t in ins:
            tensors[t].consumers.append(i)
        ops.append(Op(name, "aten.mm.default", phase, Affine(0, flops), Affine(0, 8), Affine(0, 8), list(ins), [out],
                      bdim is not None, group, anchor))
        return out

    x = tensor("x", "input", Affine(0, 16), 0, -1)
    w = [tensor(f"w{g}", "param", Affine(param_bytes, 0), None, -1) for g in range(num_groups)]
    n = num_groups * positions
    acts = [x]
    for p in range(n):
        g = p // positions
        ins = [acts[-1]] + ([w[g]] if p % positions == 0 else [])
        last = p == n - 1
        acts.append(op(f"f{p}", "fwd", ins, "loss" if last else f"a{p}", "activation",
                       Affine(4, 0) if last else Affine(0, act_bytes), None if last else 0, g, p))
    loss = acts[-1]
    grad = loss  # gradient flowing back (the loss itself seeds the backward)
    wgrad = {}
    for p in reversed(range(n)):
        g = p // positions
        if p % positions == 0:
            wgrad[g] = op(f"gw{g}", "bwd", [grad, acts[p]], f"gw{g}", "grad", Affine(param_bytes, 0), None, g, p)
        if p > 0:
            grad = op(f"b{p}", "bwd", [grad, acts[p]], f"ga{p}", "grad", Affine(0, act_bytes), 0, g, p)
    for g in range(num_groups):
        i = len(ops)
        out = tensor(f"adam::w{g}", "opt", Affine(param_bytes, 0), None, i)
        tensors[w[g]].consumers.append(i)
        tensors[wgrad[g]].consumers.append(i)
        ops.append(Op(f"adam::w{g}", "optim.adam", "opt", Affine(1.0, 0), Affine(8, 0), Affine(8, 0),
                      [w[g], wgrad[g]], [out], False, g, g * positions))
        params.append(Param(f"w{g}", w[g], wgrad[g], i, param_bytes // 4, param_bytes, 2 * param_bytes, g))
    groups = [Group(g, [i for i, o in enumerate(ops) if o.group == g], [g]) for g in range(num_groups)]
    return OpGraph("chain", batch, "adam", ops, tensors, params, groups, loss)


def topology(machines: list[tuple[str, int, float, float]], net_bw: float = 1e6, net_lat: float = 1e-3,
             memory: str = "16 GB", gpu: str = "G"):
    """``machines``: (name, devices, intra bandwidth B/s, intra latency s). Inline 1 TFLOP/s GPUs
    named ``gpu`` (``cpu``: CPU devices, whose communication shares the compute cores)."""
    return load_topology({
        "name": "test",
        "machines": [{"name": n, "gpu": {"name": gpu, "tflops": 1.0, "memory": memory,
                                         "memory_bandwidth": "100 GB/s"},
                      "count": c, "intra_bandwidth": bw, "intra_latency": lat} for n, c, bw, lat in machines],
        "network": {"bandwidth": net_bw, "latency": net_lat},
    })


def hand_costs(graph: OpGraph, topo, fwd: list[float], bwd: list[float], opt: list[float],
               speed: list[float] | None = None, step_overhead: float = 0.0,
               wake: tuple[float, float, float] | None = None) -> CostModel:
    """Group ``g`` takes ``fwd[g] * b`` / ``bwd[g] * b`` seconds at batch ``b`` and ``opt[g]`` seconds,
    divided by ``speed[d]`` on device ``d`` (default 1). ``wake = (seconds, gap_s, tau_s)``: every
    fwd/bwd stage at a batch > 0 has that wake penalty after ``gap_s`` idle, on every device."""
    nb = graph.batch_size + 1
    b = np.arange(nb, dtype=float)
    base = np.zeros((graph.num_groups, 3, nb))
    base[:, 0, :] = np.asarray(fwd)[:, None] * b
    base[:, 1, :] = np.asarray(bwd)[:, None] * b
    base[:, 2, :] = np.asarray(opt)[:, None]
    speed = speed or [1.0] * topo.num_devices
    devs = []
    for d in range(topo.num_devices):
        tab = base / speed[d]
        w = None
        if wake is not None:
            w = np.zeros((graph.num_groups, 2, nb))
            w[:, :, 1:] = wake[0]
        devs.append(DeviceCost("G", "test", tab, step_overhead, lambda q, tab=tab: tab[:, :, [int(x) for x in q]],
                               w, *(wake[1:] if wake is not None else (0.0, 0.0))))
    return CostModel(graph, topo, devs, CommModel.build(topo, {}))
