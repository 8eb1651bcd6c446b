"""Plan format (versioned JSON). The baseline plans built on the cost model are in
:mod:`tag.cost.baselines`."""

from .format import (
    PLAN_VERSION,
    SYNCS,
    GroupPlan,
    Plan,
    group_positions,
    local_batches,
    new_plan,
    validate_group,
)

__all__ = ["PLAN_VERSION", "SYNCS", "GroupPlan", "Plan", "group_positions", "local_batches", "new_plan",
           "validate_group"]
