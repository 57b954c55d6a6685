"""Low-rank factors stepped at a dense matrix's relative rate (`--factor-lr start-rms`).

Adam moves every entry by about the learning rate, whatever the entry's size. A factored start can
leave its factors far from the dense matrices' scale: CoLA's linearised start keeps the SiLU in its
small-signal range with A near 1e-3 and B near 1e2, so one step at a fine-tune's learning rate changes A
by a fifth and B by nothing. `scale_factors_by_start` multiplies each factor's Adam direction by its RMS
at initialisation over the median RMS of the model's other matrices (embeddings, dense projections)
at initialisation, fixed for the run: every matrix then moves by about the same fraction per step, as if
each factor were trained in units of its own start scale. Weight decay is not scaled (it is applied
after, as in `optax.adamw`). Background: docs/lowrank-init.md.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

FACTOR, MATRIX = "factor", "matrix"  # the roles `boostjax.sharding.rules.factor_roles` gives a leaf


class FactorScaleState(NamedTuple):
    """Per parameter: its multiplier, the matrix axes kept as size 1 (1.0 for every leaf that is not a
    factor)."""

    scale: Any


def _rms(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    return jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), axis=axes, keepdims=True))


def start_scales(params: Any, roles: Any) -> Any:
    """Each factor's multiplier `rms(factor) / median rms(other matrices)` (one per stacked or grouped
    matrix), 1.0 elsewhere. `roles`: per leaf `(role, matrix_axes)`."""
    leaves, tree = jax.tree.flatten(params)
    role_leaves = tree.flatten_up_to(roles)
    refs = [_rms(p, axes).reshape(-1) for p, (role, axes) in zip(leaves, role_leaves) if role == MATRIX]
    if not refs:
        raise ValueError("factor_lr: no dense matrix to take the reference scale from; fix: --factor-lr fixed")
    ref = jnp.median(jnp.concatenate(refs))
    return tree.unflatten([_rms(p, axes) / ref if role == FACTOR else jnp.ones((), jnp.float32)
                           for p, (role, axes) in zip(leaves, role_leaves)])


def scale_factors_by_start(roles: Any) -> optax.GradientTransformation:
    """Multiply each low-rank factor's update by `start_scales` of the parameters `init` sees."""

    def init(params: Any) -> FactorScaleState:
        return FactorScaleState(start_scales(params, roles))

    def update(updates: Any, state: FactorScaleState, params: Any = None) -> tuple[Any, FactorScaleState]:
        del params
        return jax.tree.map(lambda u, s: (u * s).astype(u.dtype), updates, state.scale), state

    return optax.GradientTransformation(init, update)


def adamw_by_start(lr: optax.ScalarOrSchedule, b1: float, b2: float, eps: float, weight_decay: float,
                   roles: Any) -> optax.GradientTransformation:
    """`optax.adamw`'s chain with each factor's Adam direction scaled by `scale_factors_by_start`."""
    return optax.chain(optax.scale_by_adam(b1, b2, eps), scale_factors_by_start(roles),
                       optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(lr))
