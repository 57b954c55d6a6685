"""An offload plan for a candidate whose compiled peak exceeds the device budget (GPU clusters).

`eligible`: what `boostjax train --offload-plan` accepts (no gradient accumulation, ZeRO 0, no
`--remat`). `offload` solves the CP-SAT plan of one device of the mesh for the budget the cost model
and the compiled step agree on (`credit`: the share `g` of the plan's saving credited to the compiled
peak) and adds the plan's seconds (`pipeline_factor` with stages). Not on the CPU. The arithmetic and
why: docs/planning.md ("Search space", the offload paragraph).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from boostjax.config import Config, ModelConfig, TrainConfig, validate
from boostjax.offload.apply import instance_for
from boostjax.offload.planfile import PlanInfeasible
from boostjax.offload.planner import baseline_plan, solve
from boostjax.planning.space import Candidate, in_flight
from boostjax.runtime.profiles import get_profile


def eligible(c: Candidate) -> bool:
    """`boostjax train` takes an offload plan with this candidate (docs/planning.md)."""
    return (c.slots == 1 or c.stage > 1) and c.zero == 0 and c.remat == "none"


def credit(c: Candidate) -> float:
    """The share `g` of the cost model's saving credited to the compiled peak (docs/planning.md)."""
    return min(1.0, in_flight(c) / c.slots) if c.stage > 1 else 1.0


def pipeline_factor(c: Candidate) -> float:
    """A stage's added seconds per step over its added seconds for all its micro-batches: the schedule
    runs `slots + stage - 1` slots of one micro-batch each (1 without stages)."""
    return (c.slots + c.stage - 1) / c.slots if c.stage > 1 else 1.0


def gpu_attention_memory(model: ModelConfig, seq: int, dtype: str) -> str:
    """`models.attention.memory_kind` as a CUDA GPU resolves it (the planner itself runs on a CPU):
    `auto` / `cudnn` in bf16/fp16 run cuDNN (flash), chunked over several blocks keeps no [t, t]."""
    half = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    if model.attention in ("auto", "cudnn") and half:
        return "flash"
    if model.attention in ("auto", "chunked") and seq > model.attention_block:
        return "flash"
    return "materialized"


def offload(model: ModelConfig, c: Candidate, pred: dict[str, Any], seq: int, dtype: str, optimizer: str,
            hardware: str, budget: float, time_limit_s: float) -> dict[str, Any] | None:
    """`{"plan": Plan, "peak_bytes_per_device", "extra_s", "none_peak_bytes", "solve_s"}` for an eligible
    candidate over `budget` (its `predict` result `pred`), or None when no plan fits (docs/planning.md)."""
    cfg = validate(Config(model, TrainConfig(**c.train_fields(seq, dtype, optimizer))))
    inst = instance_for(cfg, get_profile(hardware), attention=gpu_attention_memory(model, seq, dtype))
    none = baseline_plan(inst, "no-offload")
    compiled, g = pred["peak_bytes_per_device"], credit(c)
    shifted = none.predicted_peak_bytes - (compiled - budget) / g
    if shifted <= 0:
        return None
    try:
        plan = solve(inst.with_budget(shifted), time_limit_s=time_limit_s, workers=1)
    except PlanInfeasible:
        return None
    return {"plan": plan, "peak_bytes_per_device": compiled - g * (none.predicted_peak_bytes - plan.predicted_peak_bytes),
            "extra_s": max(0.0, plan.predicted_step_s - none.predicted_step_s) * pipeline_factor(c),
            "none_peak_bytes": none.predicted_peak_bytes, "solve_s": plan.solve_s}


__all__ = ["credit", "eligible", "gpu_attention_memory", "offload", "pipeline_factor"]
