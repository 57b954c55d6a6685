"""Offload planning (cost model, CP-SAT planner, plan files) and applying a plan to the step."""

from boostjax.offload.fit import check_plan_for

__all__ = ["check_plan_for"]
