"""An fp32 sum of non-negative partial statistics carried exactly through a bf16 all-reduce.

BTP's Online-RMSNorm sums each device's `Σx²` (fp32) in the same all-reduce as the bf16 latents. One
bf16 buffer means one collective, but a bf16 all-reduce rounds every partial sum to 8 significant
bits (a GPU ring adds in bf16; XLA's CPU backend adds in f32 and rounds the result), so a plain
`hi = bf16(s)`, `lo = bf16(s - hi)` split still loses `2⁻⁸` relative: the sum of the `hi` parts is
rounded, and the `lo` parts cannot repair it.

`split` cuts `s` into `n_parts(P)` bf16 parts on an absolute grid instead: part `j` holds the bits of
`s` with weights `2^(k·j) .. 2^(k·j + k - 1)` (`k = 8 - ceil(log2 P)` bits), the `W` highest windows
of `s`, the last one rounded. Window `j` goes to slot `j mod W`, so every device puts the same window
in the same slot. Any partial sum of one window over `P` devices is an integer multiple of `2^(k·j)`
below `2^(k·j + 8)`, exactly representable in bf16: the all-reduce adds the slots exactly, in any
order and at any precision. A device whose top window is `m` below another's sends its `m` lowest
windows into that device's top slots, `W` windows lower: with `k (W - 1) ≥ 12 + log2 P` they are below
half an ulp of the slot and dropped. `join` adds the slots in fp32. Bound:

    |join(psum(split(s))) - Σ s| ≤ (½ + (P - 1)) · 2^(-k (W - 1)) · Σ s  ≤  2⁻¹² · Σ s

(the rounded last window of each device, and what collisions drop), plus fp32 rounding. `W` is 3 at
TP 2, 4 at TP 4 and 8, 5 at TP 16: 6 to 10 bytes per token where the fp32 statistic takes 4.

Gradients: `split` and `join` are a `custom_vjp` pair whose composition's VJP is the identity. The
transpose of a `psum` with a replicated output moves no data and changes no value, so `join`'s
backward sends the fp32 cotangent as two bf16 parts (hi, lo) and `split`'s adds them back: the
statistic's cotangent reaches each device to `2⁻¹⁶` relative.
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
