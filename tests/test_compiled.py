"""``tag execute --compile``: each rank's fused segments run through ``torch.compile`` (Inductor)
and train as the single-process reference does, within the executor's tolerance."""

from __future__ import annotations

import shutil

import pytest

from tag.cost.baselines import data_parallel
from tag.executor import reference_training, run_virtual
from tag.executor.equality import ATOL, RTOL, assert_params_equal
from tag.topology import load_topology
from tag.workloads import load_workload

MLP = "mlp"
B = 8


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor on CPU needs a C++ compiler")
def test_compiled_segments_train_as_the_reference(captured):
    """Inductor fuses and reorders fp32 reductions (a row's sum in other partial sums), as the
    ranks' gradient all-reduce already does; the executor's tolerance (RTOL 1e-4, ATOL 1e-6 after
    Adam steps) bounds both (gpt2 1x32 on 2 ranks, 3 Adam steps: 1.8e-6 largest difference from
    the eager executor, 2026-11-29)."""
    graph = captured(MLP, batch=B, groups=4).graph
    plan = data_parallel(graph, load_topology("topologies/local-cpu2.yaml"))
    rts = run_virtual(graph, plan, load_workload(MLP, batch=B), "adam", 2, compiled=True)
    assert all(not seg.boxed and hasattr(seg.module, "_orig_mod")  # compiled, arguments unpacked
               for rt in rts.values() for seg in rt.program.segments.values())
    ref, _ = reference_training(load_workload(MLP, batch=B), "adam", 2)
    assert_params_equal({r: rt.named_params() for r, rt in rts.items()}, ref, {p.name for p in graph.params},
                        rtol=RTOL, atol=ATOL, exact=True)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="Inductor on CPU needs a C++ compiler")
def test_a_compiled_profile_costs_compiled_runs(captured, tmp_path):
    """``tag profile --compile`` times every stage compiled and stores it beside the eager
    profile (device type ``cpu-1t-compiled``); ``CostModel.for_topology(compiled=True)``, which
    ``tag execute --compile`` predicts with, takes it, the eager costing does not."""
    import os

    import numpy as np
    import torch

    from tag.cost.model import CostModel
    from tag.cost.profiler import profile_model

    cap = captured(MLP, groups=2)
    threads = torch.get_num_threads()
    try:
        prof = profile_model(MLP, batches=[4], repeats=1, warmup=1, num_groups=2, threads=1, corun=0,
                             wake_gap_s=0.0, captured=cap, compiled=True, log=lambda m: None)
    finally:
        torch.set_num_threads(threads)
    assert prof.device_type == "cpu-1t-compiled" and prof.meta["compiled"] is True
    prof.save(tmp_path)
    n = os.cpu_count() or 1  # one device per core: device type cpu-1t
    topo = tmp_path / "one.yaml"
    topo.write_text(f"name: one\nmachines:\n  - {{name: m, gpu: cpu, count: {n}, intra_bandwidth: \"5 GB/s\"}}\n")
    from tag.topology import load_topology

    t = load_topology(str(topo))
    compiled = CostModel.for_topology(cap.graph, t, profile_dir=tmp_path, compiled=True)
    eager = CostModel.for_topology(cap.graph, t, profile_dir=tmp_path)
    assert compiled.source(0) == "profile:cpu-1t-compiled" and eager.source(0) != compiled.source(0)
    grid = np.arange(cap.graph.batch_size + 1, dtype=float)
    assert np.allclose([compiled.group_time(g, "fwd", 0, 4) for g in range(2)], prof.table(grid)[:, 0, 4], rtol=1e-3)  # (saved to 5 digits)
