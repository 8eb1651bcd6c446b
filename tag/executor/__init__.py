"""Run a plan for real on torch.distributed (gloo on CPUs, NCCL on GPUs).

* :func:`execute` / :class:`ExecuteConfig` -- launch one rank per topology device on this
  machine and measure iteration times next to the simulator's prediction;
* :func:`prepare_torchrun` / :func:`report_torchrun` -- the same across machines: the run folder
  and each machine's ``torchrun`` command of :mod:`tag.executor.worker`, then the result;
* :mod:`tag.executor.worker` -- one rank (also the ``torchrun`` entry point across machines);
* :func:`build_schedule` -- the global, deadlock-free order of compute and communication;
* :func:`run_virtual` / :func:`reference_training` -- all ranks in one process, and the
  single-process full-batch training the executor must reproduce;
* :func:`register_execution` (:mod:`tag.executor.strategies`) -- a strategy that runs otherwise
  than as its plan's own schedule (``tp``: :mod:`tag.executor.tensor_parallel`).
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
from . import sharded, tensor_parallel  # noqa: F401 - register zero*'s and tp's executions (tag.executor.strategies)
from .launch import ExecuteConfig, ExecuteResult, TorchrunLaunch, execute, prepare_torchrun, report_torchrun
from .runtime import ExecutionError, RankRuntime
from .strategies import Execution, RankHook, execution_for, register_execution, unregister_execution
from .virtual import reference_training, run_virtual

__all__ = [
    "ExecuteConfig", "ExecuteResult", "Execution", "ExecutionError", "Move", "RankHook", "RankRuntime", "Schedule",
    "SfbGroup", "Step", "Unit", "build_schedule", "execute", "execution_for", "gradient_tensors", "graph_structure",
    "TorchrunLaunch", "partial_sum_tensors", "prepare_torchrun", "reference_training", "register_execution",
    "report_torchrun", "run_virtual", "unregister_execution",
]
