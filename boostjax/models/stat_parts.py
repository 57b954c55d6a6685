"""An fp32 sum of non-negative partial statistics carried exactly through a bf16 all-reduce.

BTP's Online-RMSNorm sums each device's `Σx²` in the same all-reduce as the bf16 latents. `split` cuts
it into `n_parts(P)` bf16 parts on an absolute grid of k-bit windows (`k = 8 - ceil(log2 P)`) whose
partial sums over P devices are exact in bf16, in any order; `join` adds them back in fp32, within
2⁻¹² of the exact sum, relative. `split` / `join` are a `custom_vjp` pair whose backward sends the
cotangent as hi + lo bf16 parts. The grid, the bound and why a plain hi + lo split fails:
docs/tensor-parallelism.md ("The statistic in one bf16 collective").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

_MIN_EXP = -126  # the smallest normal fp32/bf16 exponent: every window's grid stays normal
_BITS = 12  # the bound above: 2^-12 relative


def window_bits(n_shards: int) -> int:
    """`k`: bits per window, so that `n_shards` windows sum exactly within bf16's 8 significant bits."""
    return 8 - math.ceil(math.log2(max(n_shards, 1)))


def n_parts(n_shards: int) -> int:
    """`W`: bf16 parts per statistic, the fewest with `k (W - 1) ≥ 12 + log2 P`."""
    if not 1 <= n_shards <= 64:
        raise ValueError(f"train.mesh: model={n_shards}, but bf16 BTP carries its norm statistic for 1 to 64 "
                         "devices; fix: use at most 64 model devices or --dtype float32")
    k = window_bits(n_shards)
    return 1 + math.ceil((_BITS + math.ceil(math.log2(max(n_shards, 1)))) / k)


def _pow2(exp_i32):
    """`2^exp` in fp32, exactly, for normal exponents (the bits written directly)."""
    return jax.lax.bitcast_convert_type((exp_i32 + 127) << 23, jnp.float32)


def _split(s_n1, n_shards: int):
    k, w = window_bits(n_shards), n_parts(n_shards)
    _, e_n1 = jnp.frexp(s_n1)  # s = m · 2^e, m in [0.5, 1): the top bit has weight 2^(e - 1)
    top_n1 = jnp.maximum((e_n1 - 1) // k, -(-_MIN_EXP // k) + w - 1)  # lowest grid >= 2^-126
    rest_n1, parts = s_n1, []
    for i in range(w):
        grid_n1 = _pow2(k * (top_n1 - i))
        q_n1 = jnp.floor(rest_n1 / grid_n1) if i < w - 1 else jnp.round(rest_n1 / grid_n1)
        parts.append(q_n1 * grid_n1)  # at most 2^k · grid: exact in fp32 and in bf16
        rest_n1 = rest_n1 - parts[-1]
    slot_of = [(top_n1 - i) % w for i in range(w)]  # window top - i sits in slot (top - i) mod W
    slots = [sum(jnp.where(slot_of[i] == m, parts[i], 0.0) for i in range(w)) for m in range(w)]
    return jnp.concatenate(slots, axis=-1).astype(jnp.bfloat16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def split(s_n1, n_shards: int):
    """`[..., 1]` fp32 statistics (`>= 0`) -> `[..., n_parts(n_shards)]` bf16 slots to all-reduce."""
    return _split(s_n1, n_shards)


def _split_fwd(s_n1, n_shards):
    return _split(s_n1, n_shards), None


def _split_bwd(n_shards, _, ct_nw):
    return (jnp.sum(ct_nw.astype(jnp.float32), axis=-1, keepdims=True),)


split.defvjp(_split_fwd, _split_bwd)


@jax.custom_vjp
def join(slots_nw):
    """The all-reduced bf16 slots -> `[..., 1]` fp32 statistic (their sum)."""
    return jnp.sum(slots_nw.astype(jnp.float32), axis=-1, keepdims=True)


def _join_fwd(slots_nw):
    return join(slots_nw), slots_nw.shape[-1]


def _join_bwd(w, ct_n1):
    hi_n1 = ct_n1.astype(jnp.bfloat16)
    lo_n1 = (ct_n1 - hi_n1.astype(jnp.float32)).astype(jnp.bfloat16)
    zeros = jnp.zeros((*ct_n1.shape[:-1], w - 2), jnp.bfloat16)
    return (jnp.concatenate([hi_n1, lo_n1, zeros], axis=-1),)


join.defvjp(_join_fwd, _join_bwd)
