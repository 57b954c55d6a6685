"""Key/value cache for autoregressive decoding: fixed-size buffers, so every step has static shapes.

A `KVCache` holds, per layer, the RoPE-rotated keys and the values of every position decoded so far in
`[b, s, k, e]` buffers of `s` = prompt + new tokens positions, and `pos`, the number of positions
already written (a traced int32 scalar, shared by the batch: prompts have equal length). A forward
over `t` new tokens writes their keys/values at `[pos, pos + t)` and lets each query attend to the
cached positions at or before its own (`cached_attention`); positions after `pos + t` are zeros
that the mask hides. Shape letters as in `boostjax.models.ops`; `s` counts cache positions.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from boostjax.config import ModelConfig


class KVCache(NamedTuple):
    """`layers[i] = (k_bske, v_bske)` of layer i; `pos`: positions already written."""

    layers: tuple[tuple[Float[Array, "b s k e"], Float[Array, "b s k e"]], ...]
    pos: Int[Array, ""]

    @property
    def length(self) -> int:
        """Positions the cache can hold (static)."""
        return self.layers[0][0].shape[1]


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> KVCache:
    """An empty cache for `batch` sequences of up to `length` positions."""
    shape = (batch, length, cfg.kv_heads, cfg.head_dim)
    zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    return KVCache(tuple((zeros(), zeros()) for _ in range(cfg.n_layers)), jnp.zeros((), jnp.int32))


def write(k_bske: Float[Array, "b s k e"], new_btke: Float[Array, "b t k e"], pos: Int[Array, ""]
          ) -> Float[Array, "b s k e"]:
    """The buffer with `new` written at positions `[pos, pos + t)`."""
    return lax.dynamic_update_slice(k_bske, new_btke.astype(k_bske.dtype), (0, pos, 0, 0))


def positions(table_se: Float[Array, "s e"], pos: Int[Array, ""], t: int) -> Float[Array, "t e"]:
    """Rows `[pos, pos + t)` of a per-position table (the RoPE cos/sin of the tokens being decoded)."""
    return lax.dynamic_slice_in_dim(table_se, pos, t, axis=0)


def cached_attention(q_bthe: Float[Array, "b t h e"], k_bske: Float[Array, "b s k e"],
                     v_bske: Float[Array, "b s k e"], pos: Int[Array, ""]) -> Float[Array, "b t h e"]:
    """Softmax attention of `t` queries at positions `pos, ..., pos + t - 1` to the cache positions at or
    before each (grouped-query heads; fp32 scores and softmax, in the order of `ops.causal_attention`'s
    reference path, so cached decoding reproduces the full forward)."""
    b, t, h, e = q_bthe.shape
    s, kv = k_bske.shape[1], k_bske.shape[2]
    q_btkge = q_bthe.reshape(b, t, kv, h // kv, e)
    s_bkgts = jnp.einsum("btkge,bske->bkgts", q_btkge, k_bske, preferred_element_type=jnp.float32)
    s_bkgts = s_bkgts / jnp.sqrt(jnp.float32(e))
    mask_ts = jnp.arange(s)[None, :] <= pos + jnp.arange(t)[:, None]
    s_bkgts = jnp.where(mask_ts, s_bkgts, jnp.finfo(jnp.float32).min)
    p_bkgts = jax.nn.softmax(s_bkgts, axis=-1).astype(v_bske.dtype)
    return jnp.einsum("bkgts,bske->btkge", p_bkgts, v_bske).reshape(b, t, h, e)
