"""Run a plan for real on torch.distributed (gloo on CPUs, NCCL on GPUs).

* :func:`execute` / :class:`ExecuteConfig` -- launch one rank per topology device on this
  machine and measure iteration times next to the simulator's prediction;
* :mod:`tag.executor.worker` -- one rank (also the ``torchrun`` entry point across machines);
* :func:`build_schedule` -- the global, deadlock-free order of compute and communication;
* :func:`run_virtual` / :func:`reference_training` -- all ranks in one process, and the
  single-process full-batch training the executor must reproduce.
"""

from ..parallel.schedule import (
    Move,
    Schedule,
    SfbGroup,
    Step,
    Unit,
    build_schedule,
    gradient_tensors,
    graph_structure,
    partial_sum_tensors,
)
from .launch import ExecuteConfig, ExecuteResult, execute
from .runtime import ExecutionError, RankRuntime
from .virtual import reference_training, run_virtual

__all__ = [
    "ExecuteConfig", "ExecuteResult", "ExecutionError", "Move", "RankRuntime", "Schedule", "SfbGroup", "Step", "Unit",
    "build_schedule", "execute", "gradient_tensors", "graph_structure", "partial_sum_tensors", "reference_training",
    "run_virtual",
]
