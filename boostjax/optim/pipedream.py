"""Delay-aware baselines around the asynchronous-pipeline emulation (`boostjax.optim.delay`).

- PipeDream-LR: the update of a stage with delay τ is divided by `max(τ, 1) ^ (1 - min(t / T_c, 1))`,
                t = number of updates already applied (0 at the first step, as optax schedules count).
- Stage-aware refresh: basis-rotation refresh periods proportional to a stage's delay budget.
- Per-stage clipping: every stage clips the norm of its own gradients, as each device of an
                asynchronous pipeline does with its parameters (the reference's `clip_grad_norm_` per stage).

A stacked leaf (a pipeline's layers `[L, ...]`) carries a tuple of per-layer stage ids (see
`assign_stages`): its scale / period is per index of axis 0. PipeDream itself is plain AdamW under
the delay emulation; Nesterov is torch's NAdam (`boostjax.optim.nadam_torch`; all built by
`boostjax.optim.registry`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int

from boostjax.optim.delay import stage_delays


class StageDelayScaleState(NamedTuple):
    count: Int[Array, ""]


def delay_lr_factor(tau: Any, step: Any, t_c: int) -> Array:
    """`1 / max(τ, 1) ^ (1 - min(step / t_c, 1))` (float32); τ an int, or a tuple of ints (one per layer)."""
    frac = jnp.minimum(jnp.asarray(step, jnp.float32) / t_c, 1.0)
    if isinstance(tau, (tuple, list)):
        return jnp.power(jnp.asarray([max(int(x), 1) for x in tau], jnp.float32), -(1.0 - frac))
    return jnp.power(jnp.float32(max(int(tau), 1)), -(1.0 - frac))


def scale_by_stage_delay(delays_tree: Any, t_c: int) -> optax.GradientTransformation:
    """PipeDream-LR: scale every leaf's update by `delay_lr_factor(τ_leaf, t, t_c)` (per layer along
    axis 0 for a stacked leaf whose τ is a tuple)."""
    if not isinstance(t_c, int) or t_c < 1:
        raise ValueError(f"scale_by_stage_delay: t_c={t_c!r} must be an int >= 1; fix: e.g. t_c=1000")

    def init_fn(params: Any) -> StageDelayScaleState:
        del params
        return StageDelayScaleState(count=jnp.zeros([], jnp.int32))

    def scale(u: Array, tau: Any, count: Array) -> Array:
        f = delay_lr_factor(tau, count, t_c).astype(u.dtype)
        if isinstance(tau, (tuple, list)):
            if u.ndim < 1 or u.shape[0] != len(tau):
                raise ValueError(f"scale_by_stage_delay: {len(tau)} per-layer delays for a leaf of shape {u.shape}; "
                                 "fix: a stacked leaf needs one delay per index of axis 0")
            f = f.reshape(-1, *([1] * (u.ndim - 1)))
        return u * f

    def update_fn(updates: Any, state: StageDelayScaleState, params: Any = None):
        del params
        treedef = jax.tree.structure(updates)
        try:
            taus = treedef.flatten_up_to(delays_tree)
        except (ValueError, TypeError) as err:
            raise ValueError(f"scale_by_stage_delay: delays_tree does not match the params ({err}); "
                             "fix: build it with stage_delays(assign_stages(params, ...), n_stages)") from None
        leaves = [scale(u, tau, state.count) for u, tau in zip(jax.tree.leaves(updates), taus)]
        return jax.tree.unflatten(treedef, leaves), StageDelayScaleState(optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def stage_refresh_periods(stages_tree: Any, n_stages: int, base: int = 10) -> Any:
    """Refresh period per leaf, budget proportional to delay: refreshes per step ∝ (1 + τ_s).

    `T_s = max(1, round(base * (S + 1) / (2 * (1 + τ_s))))`: the mean refresh rate over stages
    stays `1 / base` (same total budget as a uniform period), the deepest-delayed stage 0
    refreshes about S times as often as the last stage. S = 1 gives `base` everywhere. A stacked
    leaf (a tuple of per-layer stages) gets a tuple of per-layer periods.
    """
    if not isinstance(base, int) or base < 1:
        raise ValueError(f"stage_refresh_periods: base={base!r} must be an int >= 1; fix: e.g. base=10")
    return jax.tree.map(lambda tau: max(1, int(base * (n_stages + 1) / (2 * (1 + tau)) + 0.5)),
                        stage_delays(stages_tree, n_stages))


class ClipByStageNormState(NamedTuple):
    """No state: the per-stage norms are computed from each step's gradients."""


def clip_by_stage_norm(stages_tree: Any, n_stages: int, max_norm: float) -> optax.GradientTransformation:
    """Scale each stage's gradients by `min(1, max_norm / ‖g_stage‖)` (`optax.clip_by_global_norm`'s rule,
    per stage). `stages_tree`: stage id per leaf (`assign_stages`), a tuple of per-layer ids along axis 0
    for a stacked leaf. One stage is exactly global-norm clipping."""
    if not max_norm > 0:
        raise ValueError(f"clip_by_stage_norm: max_norm={max_norm!r} must be > 0; fix: e.g. 1.0")

    def init_fn(params: Any) -> ClipByStageNormState:
        del params
        return ClipByStageNormState()

    def update_fn(updates: Any, state: ClipByStageNormState, params: Any = None):
        del params
        treedef = jax.tree.structure(updates)
        try:
            ids = treedef.flatten_up_to(stages_tree)
        except (ValueError, TypeError) as err:
            raise ValueError(f"clip_by_stage_norm: stages_tree does not match the params ({err}); "
                             "fix: build it with assign_stages(params, n_layers, n_stages)") from None
        leaves = jax.tree.leaves(updates)
        sq_s = jnp.zeros([n_stages], jnp.float32)
        for u, sid in zip(leaves, ids):
            if isinstance(sid, (tuple, list)):  # a stacked leaf: one row per layer
                rows = jnp.sum(jnp.square(u.astype(jnp.float32)).reshape(u.shape[0], -1), axis=1)
                sq_s = sq_s.at[jnp.asarray(sid, jnp.int32)].add(rows)
            else:
                sq_s = sq_s.at[int(sid)].add(jnp.sum(jnp.square(u.astype(jnp.float32))))
        norm_s = jnp.sqrt(sq_s)
        scale_s = jnp.where(norm_s < max_norm, 1.0, max_norm / jnp.maximum(norm_s, 1e-30))

        def clip(u: Array, sid: Any) -> Array:
            if isinstance(sid, (tuple, list)):
                f = scale_s[jnp.asarray(sid, jnp.int32)].reshape(-1, *([1] * (u.ndim - 1)))
            else:
                f = scale_s[int(sid)]
            return (u * f.astype(u.dtype)).astype(u.dtype)

        return jax.tree.unflatten(treedef, [clip(u, sid) for u, sid in zip(leaves, ids)]), state

    return optax.GradientTransformation(init_fn, update_fn)
