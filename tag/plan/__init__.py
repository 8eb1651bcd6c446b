"""Plan format (versioned JSON) and the data-parallel baseline builders."""

from .baselines import data_parallel, new_plan, proportional_shares, roofline_speeds
from .format import PLAN_VERSION, GroupPlan, Plan, group_positions, local_batches

__all__ = [
    "PLAN_VERSION", "GroupPlan", "Plan", "data_parallel", "group_positions", "local_batches",
    "new_plan", "proportional_shares", "roofline_speeds",
]
