"""An offload plan for a candidate whose compiled peak exceeds the device budget (GPU clusters).

`boostjax train --offload-plan` takes a plan of `boostjax.offload` (the CP-SAT keep / offload /
recompute plan of one device of the mesh, `boostjax plan --mesh ... --strategy ...`), and accepts it
only with no gradient accumulation, ZeRO 0 and no `--remat` (the plan sets the policy): `eligible`.

The offload cost model and the compiled step count memory differently. With `compiled` the
candidate's predicted peak and `none` / `plan` the cost model's peaks of the same step with nothing
offloaded (its `no-offload` baseline) / with the plan, the candidate is credited `g x (none - plan)`
(what the plan saves by the cost model, `credit`) off its compiled peak, so the plan is solved for the
budget `none - (compiled - budget) / g`. Without stages g = 1. With stages the instance is one stage's
layers over all of the data shard's rows, its M micro-batches together, while the compiled stage keeps
S activation slots (`space.in_flight`: GPipe's M + P - 1 ticks, 1F1B's ring of 2P - 1), each under the
plan's per-layer policy: the plan's activation saving applies S / M times over, its parameter and
optimizer-state saving once. `g = min(1, S / M)` never credits more than either: the whole saving once
where S >= M, all of it scaled down where S < M. The instance also prices each layer's transient work
over all rows at once, more than one micro-batch's (a larger peak, never a smaller one).

Its time is the compiled prediction plus what the plan adds by the cost model: `plan - no-offload`
predicted step seconds (recomputation and transfers not hidden under compute, at the profile's host
link), over all micro-batches of a stage; a pipeline's step adds it once per micro-batch slot of the
schedule, bubble included: times `(M + P - 1) / M` (`pipeline_factor`).
Not on the CPU: its backend does not apply activation offload (`boostjax.offload.apply`).
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
    """`boostjax train` takes an offload plan with this candidate (module docstring)."""
    return (c.slots == 1 or c.stage > 1) and c.zero == 0 and c.remat == "none"


def credit(c: Candidate) -> float:
    """The share `g` of the cost model's saving credited to the compiled peak (module docstring)."""
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
    candidate over `budget` (its `predict` result `pred`), or None when no plan fits (module docstring)."""
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
