"""One training step: loss -> gradients -> optimizer update, jitted and compiled ahead of time.

`build_step_fns` picks the loss function for the configured parallel strategy (one device, or a
`shard_map` TP strategy from `boostjax.sharding`) and the optimizer, and returns the pieces the
training loop needs. Parameters stay fp32; with `dtype="bfloat16"` they are cast for the compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from boostjax.config import Config
from boostjax.optim import schedule


@dataclass(frozen=True)
class StepFns:
    init: Callable[[Any], tuple[Any, Any]]  # fp32 params -> (placed params, optimizer state)
    compile: Callable[[Any, Any, dict], Callable]  # -> step(params, opt_state, batch) -> (p, s, metrics)
    eval_loss: Callable[[Any, dict], jax.Array]
    put_batch: Callable[[dict], dict]
    loss_fn: Callable[[Any, dict], jax.Array]


def cast_params(params: Any, dtype: str) -> Any:
    """Floating parameters in the compute dtype (fp32 master copies stay untouched)."""
    if dtype == "float32":
        return params
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda p: p.astype(dt) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def local_loss_fn(cfg: Config, graphdef) -> Callable[[Any, dict], jax.Array]:
    """Mean next-token cross-entropy on one device (the reference every parallel path matches)."""

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, cast_params(params, cfg.train.dtype))
        return model.loss(batch["inputs"], batch["targets"], remat=cfg.train.remat)

    return loss_fn


def make_optimizer(cfg: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
    return schedule.adamw(cfg.train), schedule.lr_schedule(cfg.train)


def _step_count(opt_state) -> jax.Array:
    counts = [x for p, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]
              if getattr(p[-1], "name", None) == "count"]
    return counts[0] if counts else jnp.zeros((), jnp.int32)


def make_train_step(loss_fn, tx: optax.GradientTransformation, lr_fn: optax.Schedule):
    def step(params, opt_state, batch):
        lr = lr_fn(_step_count(opt_state))
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.global_norm(grads), "lr": lr}

    return step


def build_step_fns(cfg: Config, graphdef, params_like: Any) -> StepFns:
    """Step functions for `cfg.train.strategy` (one device when "none" and no mesh)."""
    from boostjax.sharding import strategies  # noqa: PLC0415 (sharding imports models)

    tx, lr_fn = make_optimizer(cfg)
    plan = strategies.placement(cfg, graphdef, params_like)
    loss_fn = plan.loss_fn
    step = make_train_step(loss_fn, tx, lr_fn)

    def init(params):
        params = plan.put_params(params)
        return params, jax.jit(tx.init)(params)

    def compile_step(params, opt_state, batch):
        return jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, plan.put_batch(batch)).compile()

    return StepFns(init=init, compile=compile_step, eval_loss=jax.jit(loss_fn), put_batch=plan.put_batch,
                   loss_fn=loss_fn)
