"""The parallelism layer: one module per deployment strategy, lowering plans into one schedule.

* :mod:`~tag.parallel.strategy`: the :class:`Strategy` interface, the registry
  (``GroupPlan.sync`` -> strategy), units, replicas, collectives, plan validation.
* :mod:`~tag.parallel.data_parallel` (``allreduce``), :mod:`~tag.parallel.parameter_server`
  (``ps``), :mod:`~tag.parallel.model_parallel` (``mp``), :mod:`~tag.parallel.tensor_parallel`
  (``tp``; executed as the same groups for the whole plan): the built-in strategies.
* :func:`sfb_syncs`: the strategies whose groups take SFB (:meth:`Strategy.sfb_op`), for
  :mod:`tag.compress` (below this layer); :func:`apply_sfb` the MILP's choice over them.
* :func:`execution_refusal`: the one rule of which plans the executor runs (each strategy judges
  its groups); ``tag execute`` refuses through it, ``find_plan`` with ``PlannerConfig(executable=True)`` searches within it.
* :mod:`~tag.parallel.moves`: which replica sends what to which when a tensor crosses units.
* :mod:`~tag.parallel.schedule`: the global schedule of one iteration that every executor rank
  walks; the simulator costs the same lowering (:mod:`tag.sim`).

docs/design.md "Adding a strategy" says what a new strategy touches.
"""

from __future__ import annotations

from .data_parallel import DataParallel
from .model_parallel import ModelParallel
from .moves import move_kind, move_pieces
from .parameter_server import ParameterServer
from .schedule import Move, Schedule, SfbGroup, Step, build_schedule, graph_structure
from .sharded import SHARDED, Sharded
from .strategy import (
    Collective,
    Replica,
    Strategy,
    Unit,
    UnitKey,
    apply_sfb,
    execution_refusal,
    get_strategy,
    register,
    sfb_syncs,
    strategy_names,
    strategy_of,
    unregister,
    validate_group,
    validate_plan,
)
from .tensor_parallel import TensorParallel

# The built-in strategies (a new one is a module plus a line here; error messages list them in
# this order).
for _s in (DataParallel(), ParameterServer(), ModelParallel(), TensorParallel(), *SHARDED):
    register(_s)

__all__ = [
    "Collective", "DataParallel", "ModelParallel", "Move", "ParameterServer", "Replica", "Schedule", "SfbGroup", "Sharded", "Step", "Strategy", "TensorParallel", "Unit", "UnitKey", "apply_sfb", "build_schedule",
    "execution_refusal", "get_strategy", "graph_structure", "move_kind", "move_pieces", "register", "sfb_syncs", "strategy_names", "strategy_of",
    "unregister", "validate_group", "validate_plan",
]
