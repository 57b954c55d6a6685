"""Offload planning: the CP-SAT planner, its baselines, `plan --auto`, and plans applied on a GPU."""
