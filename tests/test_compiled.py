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
