"""Delay baselines and the optimizer factory.

- PipeDream:    AdamW; the staleness comes from the delay emulation (`boostjax.optim.delay`).
- PipeDream-LR: the update of a stage with delay τ is divided by `max(τ, 1) ^ (1 - min(t / T_c, 1))`,
                t = number of updates already applied (0 at the first step, as optax schedules count).
- Nesterov:     NAdam-style look-ahead, `optax.nadamw` with b1 = 0.99:
                m̂ = b1 m_t / (1 - b1^{t+1}) + (1 - b1) g_t / (1 - b1^t)  (Dozat 2016, no momentum schedule).
- Rotation:     `rotated_adam`, optionally with stage-aware refresh periods.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int

from boostjax.optim.delay import stage_delays
from boostjax.optim.rotation import rotated_adam

OPTIMIZERS: tuple[str, ...] = ("adamw", "pipedream", "rotation", "pipedream-lr", "nesterov")


class StageDelayScaleState(NamedTuple):
    count: Int[Array, ""]


def delay_lr_factor(tau: int, step: Any, t_c: int) -> Array:
    """`1 / max(τ, 1) ^ (1 - min(step / t_c, 1))` (float32)."""
    frac = jnp.minimum(jnp.asarray(step, jnp.float32) / t_c, 1.0)
    return jnp.power(jnp.float32(max(int(tau), 1)), -(1.0 - frac))


def scale_by_stage_delay(delays_tree: Any, t_c: int) -> optax.GradientTransformation:
    """PipeDream-LR: scale every leaf's update by `delay_lr_factor(τ_leaf, t, t_c)`."""
    if not isinstance(t_c, int) or t_c < 1:
        raise ValueError(f"scale_by_stage_delay: t_c={t_c!r} must be an int >= 1; fix: e.g. t_c=1000")

    def init_fn(params: Any) -> StageDelayScaleState:
        del params
        return StageDelayScaleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates: Any, state: StageDelayScaleState, params: Any = None):
        del params
        treedef = jax.tree.structure(updates)
        try:
            taus = treedef.flatten_up_to(delays_tree)
        except (ValueError, TypeError) as err:
            raise ValueError(f"scale_by_stage_delay: delays_tree does not match the params ({err}); "
                             "fix: build it with stage_delays(assign_stages(params, ...), n_stages)") from None
        leaves = [u * delay_lr_factor(tau, state.count, t_c).astype(u.dtype)
                  for u, tau in zip(jax.tree.leaves(updates), taus)]
        return jax.tree.unflatten(treedef, leaves), StageDelayScaleState(optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def stage_refresh_periods(stages_tree: Any, n_stages: int, base: int = 10) -> Any:
    """Refresh period per leaf, budget proportional to delay: refreshes per step ∝ (1 + τ_s).

    `T_s = max(1, round(base * (S + 1) / (2 * (1 + τ_s))))`: the mean refresh rate over stages
    stays `1 / base` (same total budget as a uniform period), the deepest-delayed stage 0
    refreshes about S times as often as the last stage. S = 1 gives `base` everywhere.
    """
    if not isinstance(base, int) or base < 1:
        raise ValueError(f"stage_refresh_periods: base={base!r} must be an int >= 1; fix: e.g. base=10")
    return jax.tree.map(lambda tau: max(1, int(base * (n_stages + 1) / (2 * (1 + tau)) + 0.5)),
                        stage_delays(stages_tree, n_stages))


def make_optimizer(
    name: str,
    *,
    lr: optax.ScalarOrSchedule = 1e-3,
    weight_decay: float = 0.01,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    clip: float = 0.0,
    stages_tree: Any = None,
    n_stages: int = 1,
    t_c: int = 1000,
    nesterov_b1: float = 0.99,
    source: str = "second",
    geometry: str = "bilateral",
    refresh_every: int = 10,
    stage_aware_refresh: bool = False,
    basis_beta: float = 0.95,
    max_dim: int = 4096,
    rotation_mask: Any = None,
) -> optax.GradientTransformation:
    """Build a named optimizer, with `clip_by_global_norm(clip)` first when `clip > 0`.

    "adamw" / "pipedream": AdamW. "pipedream-lr": AdamW then `scale_by_stage_delay` (needs
    `stages_tree`, `n_stages`, `t_c`). "nesterov": `optax.nadamw` with b1 = `nesterov_b1`.
    "rotation": `rotated_adam`; `stage_aware_refresh=True` (needs `stages_tree`) replaces
    `refresh_every` by `stage_refresh_periods(stages_tree, n_stages, base=refresh_every)`.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"make_optimizer: unknown optimizer {name!r}; fix: use one of {', '.join(OPTIMIZERS)}")
    if clip < 0:
        raise ValueError(f"make_optimizer: clip={clip} must be >= 0 (0 disables); fix: e.g. clip=1.0")
    needs_stages = name == "pipedream-lr" or (name == "rotation" and stage_aware_refresh)
    if needs_stages and stages_tree is None:
        raise ValueError(f"make_optimizer: {name!r} with stage information needs stages_tree; "
                         "fix: pass stages_tree=assign_stages(params, n_layers, n_stages) and n_stages")
    if name in ("adamw", "pipedream"):
        opt = optax.adamw(lr, b1, b2, eps, weight_decay=weight_decay)
    elif name == "pipedream-lr":
        opt = optax.chain(optax.adamw(lr, b1, b2, eps, weight_decay=weight_decay),
                          scale_by_stage_delay(stage_delays(stages_tree, n_stages), t_c))
    elif name == "nesterov":
        opt = optax.nadamw(lr, nesterov_b1, b2, eps, weight_decay=weight_decay)
    else:
        periods = stage_refresh_periods(stages_tree, n_stages, refresh_every) if stage_aware_refresh else refresh_every
        opt = rotated_adam(lr, b1, b2, eps, weight_decay, source=source, geometry=geometry,
                           refresh_every=periods, basis_beta=basis_beta, max_dim=max_dim, mask=rotation_mask)
    return optax.chain(optax.clip_by_global_norm(clip), opt) if clip > 0 else opt
