"""Hybrid 8-bit Adam(W) with fused global-norm clipping (LazyTrain's optimizer), as an Optax transform.

Moments of large tensors are stored block-wise quantised (bitsandbytes-style): blocks of `block`
elements, one fp32 absmax per block, uint8 codes into a 256-entry dynamic map (signed for `m`,
unsigned for `v`); a value is coded by the nearest map entry (searchsorted on the midpoints).
Tensors under `min_8bit_size` elements and embeddings keep fp32 moments. Clipping is fused: one pass
computes the global norm, and its scale multiplies each gradient inside the per-tensor update.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, UInt8


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """bitsandbytes' dynamic quantisation map (`create_dynamic_map`): 256 sorted float32 codes in
    [-1, 1] (signed) or [0, 1] (unsigned), dense near zero (one decade per exponent)."""
    non_sign_bits = total_bits - 1
    data: list[float] = []
    for i in range(max_exponent_bits):
        n_frac = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else \
            2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        bounds = np.linspace(0.1, 1.0, n_frac, dtype=np.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10.0 ** (-(max_exponent_bits - 1) + i)
        data += list(scale * means)
        if signed:
            data += list(-scale * means)
    data += [0.0, 1.0]
    data += [0.0] * (2 ** total_bits - len(data))
    if len(data) != 2 ** total_bits:
        raise ValueError(f"dynamic_map: {len(data)} codes for {total_bits} bits; fix: use the defaults")
    return np.sort(np.asarray(data, np.float32))


SIGNED_MAP = dynamic_map(signed=True)
UNSIGNED_MAP = dynamic_map(signed=False)


class QTensor(NamedTuple):
    """A block-quantised tensor: codes [n_blocks, block] (uint8) and the fp32 absmax of each block."""

    codes: UInt8[Array, "nb block"]
    absmax: Float[Array, " nb"]


def quantize(x: Array, table: np.ndarray, block: int = 256) -> QTensor:
    """Block-wise absmax scaling, then the nearest code of `table` (a sorted 256-entry map)."""
    flat = jnp.ravel(x).astype(jnp.float32)
    nb = -(-flat.size // block)
    x_nb = jnp.pad(flat, (0, nb * block - flat.size)).reshape(nb, block)
    absmax = jnp.max(jnp.abs(x_nb), axis=1)
    normed = x_nb / jnp.where(absmax > 0, absmax, 1.0)[:, None]
    mids = jnp.asarray((table[1:] + table[:-1]) / 2.0)
    return QTensor(jnp.searchsorted(mids, normed).astype(jnp.uint8), absmax)


def dequantize(q: QTensor, table: np.ndarray, shape: tuple[int, ...]) -> Array:
    vals = jnp.asarray(table)[q.codes.astype(jnp.int32)] * q.absmax[:, None]
    return vals.reshape(-1)[: int(np.prod(shape))].reshape(shape)


class Adam8bitState(NamedTuple):
    count: Array  # int32 scalar: steps taken
    mu: Any  # per leaf: fp32 array or QTensor (signed map)
    nu: Any  # per leaf: fp32 array or QTensor (unsigned map)


def default_fp32_mask(params: Any, min_8bit_size: int = 4096) -> Any:
    """True (keep fp32 moments) for leaves under `min_8bit_size` elements or with 'embed' in the path."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: bool(p.size < min_8bit_size or "embed" in jax.tree_util.keystr(path).lower()), params)


def adam8bit(learning_rate: float | optax.Schedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
             weight_decay: float = 0.0, clip: float | None = 1.0, block: int = 256, min_8bit_size: int = 4096,
             fp32_mask: Any | Callable[[Any], Any] | None = None) -> optax.GradientTransformation:
    """AdamW with block-wise 8-bit moments and fused global-norm clipping (`clip` <= 0 or None: off).

    `fp32_mask`: a pytree of bools like the params, or a callable params -> such a pytree; True keeps
    that leaf's moments in fp32. Default: `default_fp32_mask` (small tensors and embeddings).
    `update` needs `params` when `weight_decay` > 0 (decoupled decay, as `optax.adamw`)."""
    for name, v in (("b1", b1), ("b2", b2)):
        if not 0.0 <= v < 1.0:
            raise ValueError(f"adam8bit: {name}={v} outside [0, 1); fix: pass e.g. b1=0.9, b2=0.999")
    if eps <= 0 or weight_decay < 0:
        raise ValueError(f"adam8bit: eps={eps} must be > 0 and weight_decay={weight_decay} >= 0; fix: e.g. eps=1e-8")
    if block < 1 or min_8bit_size < 1:
        raise ValueError(f"adam8bit: block={block} and min_8bit_size={min_8bit_size} must be >= 1; fix: use 256 and 4096")

    def mask_of(params: Any) -> Any:
        if fp32_mask is None:
            return default_fp32_mask(params, min_8bit_size)
        return fp32_mask(params) if callable(fp32_mask) else fp32_mask

    def init_fn(params: Any) -> Adam8bitState:
        def zeros(p: Array, keep: bool, table: np.ndarray) -> Array | QTensor:
            if keep:
                return jnp.zeros(p.shape, jnp.float32)
            return quantize(jnp.zeros(p.shape, jnp.float32), table, block)

        mask = mask_of(params)
        return Adam8bitState(count=jnp.zeros([], jnp.int32),
                             mu=jax.tree.map(lambda p, k: zeros(p, k, SIGNED_MAP), params, mask),
                             nu=jax.tree.map(lambda p, k: zeros(p, k, UNSIGNED_MAP), params, mask))

    def update_fn(updates: Any, state: Adam8bitState, params: Any = None) -> tuple[Any, Adam8bitState]:
        if weight_decay > 0 and params is None:
            raise ValueError("adam8bit: weight_decay > 0 needs params; fix: call update(grads, state, params)")
        count = optax.safe_int32_increment(state.count)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        if clip is not None and clip > 0:  # one pass for the norm; the scale is folded in below
            g_norm = optax.tree.norm(updates)
            scale = jnp.where(g_norm < clip, 1.0, clip / g_norm)
        else:
            scale = jnp.float32(1.0)
        c1 = 1.0 - b1 ** count.astype(jnp.float32)
        c2 = 1.0 - b2 ** count.astype(jnp.float32)
        p_tree = params if params is not None else jax.tree.map(lambda _: None, updates)

        def leaf(g: Array, m_s: Array | QTensor, v_s: Array | QTensor, p: Array | None):
            quant = isinstance(m_s, QTensor)
            m_prev = dequantize(m_s, SIGNED_MAP, g.shape) if quant else m_s
            v_prev = dequantize(v_s, UNSIGNED_MAP, g.shape) if quant else v_s
            g32 = g.astype(jnp.float32) * scale
            m = b1 * m_prev + (1.0 - b1) * g32
            v = b2 * v_prev + (1.0 - b2) * g32 * g32
            u = (m / c1) / (jnp.sqrt(v / c2) + eps)
            if weight_decay > 0:
                u = u + weight_decay * p.astype(jnp.float32)
            u = (-lr * u).astype(g.dtype)
            if quant:
                return u, quantize(m, SIGNED_MAP, block), quantize(v, UNSIGNED_MAP, block)
            return u, m, v

        is_q = lambda x: isinstance(x, QTensor)  # noqa: E731
        out = jax.tree.map(leaf, updates, state.mu, state.nu, p_tree, is_leaf=lambda x: x is None or is_q(x))
        tdef = jax.tree.structure(updates)
        flat = tdef.flatten_up_to(out)
        new_u = tdef.unflatten([t[0] for t in flat])
        new_mu = tdef.unflatten([t[1] for t in flat])
        new_nu = tdef.unflatten([t[2] for t in flat])
        return new_u, Adam8bitState(count=count, mu=new_mu, nu=new_nu)

    return optax.GradientTransformation(init_fn, update_fn)


def state_bytes(opt_state: Any) -> int:
    """Bytes held by every array in an optimizer state (any Optax state pytree)."""
    return int(sum(np.asarray(x).nbytes if not hasattr(x, "nbytes") else x.nbytes
                   for x in jax.tree.leaves(opt_state)))


__all__ = ["Adam8bitState", "QTensor", "SIGNED_MAP", "UNSIGNED_MAP", "adam8bit", "default_fp32_mask",
           "dequantize", "dynamic_map", "quantize", "state_bytes"]
