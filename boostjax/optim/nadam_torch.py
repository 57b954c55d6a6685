"""NAdam with torch's momentum-decay schedule (`torch.optim.NAdam`), the Nesterov baseline of
asynchronous-pipeline training as AsyncPP ran it (https://github.com/PluralisResearch/AsyncPP:
`torch.optim.NAdam(betas=(0.99, 0.999), momentum_decay=0.004, decoupled_weight_decay=True)`).

Per step t = 1, 2, ... (torch's `_single_tensor_nadam`):

    mu_t  = b1 (1 - 0.5 * 0.96 ** (t psi)),   mu_{t+1} likewise,   P_t = P_{t-1} mu_t  (P_0 = 1)
    m     <- b1 m + (1-b1) g                  (the EMA keeps the constant b1)
    v     <- b2 v + (1-b2) g²
    d     = sqrt(v / (1 - b2^t)) + eps        (eps outside the square root)
    dir   = (1-mu_t)/(1-P_t) g/d + mu_{t+1}/(1-P_t mu_{t+1}) m/d

`scale_by_torch_nadam` is `dir`; `torch_nadamw` chains decoupled weight decay and the learning rate
as `optax.adamw` does, i.e. `W <- W (1 - lr wd) - lr dir`, torch's decoupled branch. Unlike
`optax.nadamw` (a constant mu = b1), mu_t starts near b1/2 and approaches b1 only after ~10^4 steps
(psi = 0.004), so over a short run this is a low-momentum NAdam.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int


class TorchNAdamState(NamedTuple):
    """`count`: steps taken; `mu_product`: prod of mu_1..mu_t; `mu`/`nu`: first/second moments."""

    count: Int[Array, ""]
    mu_product: Float[Array, ""]
    mu: optax.Updates
    nu: optax.Updates


def _momentum(b1: float, psi: float, t: Array) -> Array:
    return b1 * (1.0 - 0.5 * 0.96 ** (t.astype(jnp.float32) * psi))


def scale_by_torch_nadam(b1: float = 0.99, b2: float = 0.999, eps: float = 1e-8,
                         momentum_decay: float = 0.004) -> optax.GradientTransformation:
    """The NAdam direction with torch's mu_t schedule (no learning rate, no weight decay)."""
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0) or eps < 0 or momentum_decay < 0:
        raise ValueError(f"torch_nadam: b1={b1}, b2={b2}, eps={eps}, momentum_decay={momentum_decay}; "
                         "fix: betas in [0, 1), eps >= 0, momentum_decay >= 0 (e.g. 0.99, 0.999, 1e-8, 0.004)")

    def init_fn(params: Any) -> TorchNAdamState:
        return TorchNAdamState(count=jnp.zeros([], jnp.int32), mu_product=jnp.ones([], jnp.float32),
                               mu=jax.tree.map(jnp.zeros_like, params), nu=jax.tree.map(jnp.zeros_like, params))

    def update_fn(updates: Any, state: TorchNAdamState, params: Any = None):
        del params
        t = optax.safe_increment(state.count)
        mu_t, mu_next = _momentum(b1, momentum_decay, t), _momentum(b1, momentum_decay, t + 1)
        prod = state.mu_product * mu_t
        c_grad = (1.0 - mu_t) / (1.0 - prod)
        c_mom = mu_next / (1.0 - prod * mu_next)
        bc2 = 1.0 - b2 ** t.astype(jnp.float32)
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * (g * g), state.nu, updates)

        def direction(g, m, v):
            denom = jnp.sqrt(v / bc2.astype(v.dtype)) + eps
            return (c_grad.astype(g.dtype) * g / denom + c_mom.astype(m.dtype) * m / denom).astype(g.dtype)

        out = jax.tree.map(direction, updates, mu, nu)
        return out, TorchNAdamState(count=t, mu_product=prod, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def torch_nadamw(learning_rate: optax.ScalarOrSchedule, b1: float = 0.99, b2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 0.01, momentum_decay: float = 0.004) -> optax.GradientTransformation:
    """`torch.optim.NAdam(..., decoupled_weight_decay=True)`: the direction, then the decay, then -lr."""
    decay = [optax.add_decayed_weights(weight_decay)] if weight_decay else []
    return optax.chain(scale_by_torch_nadam(b1, b2, eps, momentum_decay), *decay,
                       optax.scale_by_learning_rate(learning_rate))
