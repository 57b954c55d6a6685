"""Whether an offload plan fits a training run: `check_plan_for(plan, cfg)` is the one check (the
placement layer calls it before anything is compiled or written). A plan describes ONE device's
share of the run's mesh (`boostjax.offload.costmodel.build_instance`): that device's batch rows, its
stage's layers and its shard of each layer under the TP strategy. The mesh checks the planner shares
with the trainer (strategy serving the model kind, sizes dividing) are
`boostjax.sharding.rules.check_mesh_for`."""

from __future__ import annotations

import os
from typing import Any

from boostjax.config import Config, ConfigError, ModelConfig, flag_of
from boostjax.models.attention import memory_kind
from boostjax.offload.apply import instance_for
from boostjax.offload.costmodel import PLANNED_FOR_DEFAULTS, activation_names, planned_for
from boostjax.offload.decisions import check_decisions
from boostjax.offload.optstate import STATE_FIELDS, optimizer_bytes
from boostjax.offload.planfile import Plan, read_plan
from boostjax.sharding import rules

STATE_KEY = "optimizer_state_bytes_per_layer"  # `planned_for`'s record of the optimizer state (absent: older plans)


def check_planned_for(plan: Plan, model: ModelConfig, train: Any, path: Any = "the plan",
                      name: str = "train.offload_plan", require: bool = True) -> None:
    """`ConfigError` naming the first field where the run (`model`: ModelConfig, `train`: TrainConfig)
    differs from what the plan was made for, both values and the fix. `require`: refuse a plan that
    has no record (plan files of version 1). A record without strategy/mesh is a one-device plan."""
    redo = (f"re-run boostjax plan with this run's shape, {flag_of('batch')}, {flag_of('seq')}, {flag_of('dtype')} "
            f"and {flag_of('optimizer')} flags --out {path}")
    rec = plan.planned_for
    if not rec:
        if require:
            raise ConfigError(f"{name}: {path} does not record the model, batch, seq and dtype it was planned for "
                              f"(written by an older boostjax); fix: {redo}")
        return
    dtype_bytes = 4 if train.dtype == "float32" else 2
    attention = memory_kind(model, train.seq, train.dtype)
    want = dict(planned_for(model, train.batch, train.seq, dtype_bytes, train.optimizer == "adam8bit", attention,
                            train.strategy, train.mesh, optimizer_bytes(model, train)))
    for key, value in want.items():
        if key == STATE_KEY and key not in rec:  # a plan of an older boostjax: it recorded the optimizer only
            continue
        got = rec.get(key, PLANNED_FOR_DEFAULTS.get(key))
        if got != value:
            flag = flag_of(key.split(".")[-1]) if key != STATE_KEY else ""
            if key == STATE_KEY:
                flags = ", ".join(flag_of(f) for f in STATE_FIELDS)
                fix = (f"this run's optimizer state is not the one planned (per layer and device: {got} bytes "
                       f"planned, {value} in this run); re-run boostjax plan with this run's {flags} "
                       f"(and its other flags) --out {path}")
            elif key == "attention":
                fix = (f"this run's attention (--attention {model.attention}, seq {train.seq}, block "
                       f"{model.attention_block}) is {value}; re-run boostjax plan with --attention {value} --out {path}")
            elif key == "train.mesh" and not value:
                fix = f"re-run boostjax plan without --mesh (and this run's other flags) --out {path}"
            else:
                fix = f"re-run boostjax plan with {flag} {value} (and this run's other flags) --out {path}"
            raise ConfigError(f"{name}: {path} was planned for {key}={got!r} but this run has {key}={value!r}; "
                              f"fix: {fix}")


def check_plan_for(plan: Plan | str | os.PathLike, cfg: Config, *, require_record: bool = True) -> Plan:
    """THE check that an offload plan (a `Plan`, or the path of a plan.json) fits the training config
    `cfg`: no `--remat` beside it, the strategy and mesh runnable (`rules.check_mesh_for`), the plan made for
    this run (`planned_for`: model shapes, batch, seq, dtype, optimizer, attention, strategy, mesh),
    one decision per layer of a stage, the block's activation names, and decisions the per-device
    instance allows (with stages: one parameter mode for all layers). Returns the plan; raises a
    one-line `ConfigError` naming `train.offload_plan`. `require_record=False` accepts a plan object
    without a `planned_for` record (built in Python)."""
    t, m = cfg.train, cfg.model
    path = t.offload_plan or "the plan"
    if not isinstance(plan, Plan):
        path, plan = plan, read_plan(plan)
    if t.remat != "none":
        raise ConfigError("train.offload_plan: the plan sets the remat policy; fix: drop --remat")
    sizes = t.sizes
    rules.check_mesh_for(m, t.strategy, t.mesh, t.batch, t.seq)
    n, local = len(plan.decisions.boundary), m.n_layers // sizes.stage
    if n != local:
        held = f"n_layers={m.n_layers}" if sizes.stage == 1 else \
            f"a stage holds n_layers/stage = {m.n_layers}/{sizes.stage} = {local} layers"
        raise ConfigError(f"train.offload_plan: the plan has {n} layers but {held} ({path}); fix: re-run boostjax "
                          f"plan with --n-layers {m.n_layers} (and this run's other flags, --mesh included) --out {path}")
    check_planned_for(plan, m, t, path, require=require_record)
    names = activation_names(m)
    if tuple(plan.activation_names) != names:
        raise ConfigError(f"train.offload_plan: {path} tags {list(plan.activation_names)} but a {m.kind} block has "
                          f"{list(names)}; fix: re-run boostjax plan --model {m.kind} (and this run's other flags) "
                          f"--out {path}")
    inst = instance_for(cfg, "H800-80GB")
    try:
        check_decisions(inst, plan.decisions)
    except ValueError as e:
        why = str(e).split("; fix:")[0]
        raise ConfigError(f"train.offload_plan: {path} holds decisions this model does not allow ({why}); "
                          f"fix: re-run boostjax plan --out {path}") from None
    return plan


__all__ = ["check_plan_for", "check_planned_for"]
