"""Plan format (versioned JSON). The baseline plans built on the cost model are in
:mod:`tag.cost.baselines`."""

from .format import (
    PLAN_VERSION,
    GroupPlan,
    PipelinePlan,
    Plan,
    group_positions,
    local_batches,
    new_plan,
)

__all__ = ["PLAN_VERSION", "GroupPlan", "PipelinePlan", "Plan", "group_positions", "local_batches",
           "new_plan"]
