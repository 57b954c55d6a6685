"""Stateless pieces of the LLaMA block: RMSNorm, Online-RMSNorm down-projection, RoPE, attention.

Shape letters: b batch, t time (sequence), d model width, r rank, f feed-forward width, h query
heads, k kv heads, e head dim, g group (grouped projections), v vocabulary.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from boostjax.config import ModelConfig
from boostjax.models import attention
from boostjax.models.collectives import Collectives


def matmul(x: Float[Array, "... i"], w: Float[Array, "i ..."], *,
           preferred_element_type=None) -> Float[Array, "... o"]:
    """`tensordot(x, w, 1)` (x's last axis against w's first) as one 2-D GEMM `[rows, i] @ [i, cols]`,
    the leading axes of both flattened and restored.

    Written on `[b, t, i]`, the weight gradient `x^T dy` contracts b and t at once, and XLA's CPU dot
    decomposer makes such a dot canonical with a transposed copy of one operand (a `[o, t·b]` copy of
    `dy` in front of every weight-gradient GEMM of the backward, the logits' `[v, t·b]` included). On
    the 2-D form every gradient is a plain 2-D dot that reads both operands in place."""
    rows_i = x.reshape(-1, x.shape[-1])
    y = jnp.matmul(rows_i, w.reshape(w.shape[0], -1), preferred_element_type=preferred_element_type)
    return y.reshape(*x.shape[:-1], *w.shape[1:])


def wide_matmul(x: Float[Array, "... i"], w: Float[Array, "i o"], *,
                preferred_element_type=None) -> Float[Array, "... o"]:
    """`matmul` for a wide output (the LM head, `o` = the vocabulary), whose weight gradient `x^T dy`
    reads a transposed copy of `x` (`[i, rows]`, made once behind an optimization barrier).

    XLA's CPU backend runs a dot that contracts its left operand's rows as an Eigen GEMM; on the copy it
    is an XNNPACK (YNN) one. For the 60m head (`512 x 1024 x 8192`) that halves the weight gradient on an
    AVX2 CPU (`experiments.speed.gemm_peak`'s `grad head` row, `epyc_zen3/`) and is level on AVX-512;
    for the narrower projections the copy does not pay (docs/cpu-speed.md). Only the CPU program copies.
    Values and gradients are those of `matmul`, up to the GEMM kernels' rounding."""
    rows_i = x.reshape(-1, x.shape[-1])
    y = _copied_grad_matmul(rows_i, w, preferred_element_type)
    return y.reshape(*x.shape[:-1], w.shape[1])


def _plain_matmul(x_ni, w_io, preferred_element_type):
    return jnp.matmul(x_ni, w_io, preferred_element_type=preferred_element_type)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _copied_grad_matmul(x_ni, w_io, preferred_element_type):
    return _plain_matmul(x_ni, w_io, preferred_element_type)


def _copied_grad_fwd(x_ni, w_io, preferred_element_type):
    return _plain_matmul(x_ni, w_io, preferred_element_type), (x_ni, w_io)


def _copied_grad_bwd(preferred_element_type, res, dy_no):
    """Both cotangents as autodiff forms them (same dtypes and precision); on the CPU the weight's from
    `x` read through its transposed copy, so the dot contracts the copy's last axis. Elsewhere (a GPU's
    GEMMs read either layout) the program is autodiff's own: `platform_dependent` picks at lowering."""
    x_ni, w_io = res
    (dx_ni,) = jax.vjp(lambda x: _plain_matmul(x, w_io, preferred_element_type), x_ni)[1](dy_no)

    def weight_grad(x_ni, dy_no, copy: bool):
        x_read_ni = attention.materialised(x_ni.T).T if copy else x_ni
        return jax.vjp(lambda w: _plain_matmul(x_read_ni, w, preferred_element_type), w_io)[1](dy_no)[0]

    dw_io = jax.lax.platform_dependent(x_ni, dy_no, cpu=functools.partial(weight_grad, copy=True),
                                       default=functools.partial(weight_grad, copy=False))
    return dx_ni, dw_io


_copied_grad_matmul.defvjp(_copied_grad_fwd, _copied_grad_bwd)


def rms_norm(x_btd: Float[Array, "b t d"], g_d: Float[Array, " d"], eps: float) -> Float[Array, "b t d"]:
    """`g ⊙ x / rms(x)` with the statistics in fp32 (Hugging Face LLaMA's order of operations)."""
    xf = x_btd.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return g_d.astype(x_btd.dtype) * xf.astype(x_btd.dtype)


def online_norm_down(
    x_btd: Float[Array, "b t d"],
    g_d: Float[Array, " d"],
    a_dgr: Float[Array, "d g r"],
    coll: Collectives,
    *,
    d_model: int,
    eps: float,
    name: str,
) -> Float[Array, "b t g r"]:
    """`RMSNorm(x) @ A` computed as `((g ⊙ x) @ A) / rms(x)` (Online-RMSNorm).

    Under BTP, `x` and `g` hold this device's `d/TP` slice and `A` its rows: the partial products
    and the partial `Σ x²` are summed by one collective. The statistics stay in fp32.
    """
    (z_btgr,) = online_norm_many(x_btd, g_d, (a_dgr,), coll, d_model=d_model, eps=eps, name=name)
    return z_btgr


def online_norm_many(
    x_btd: Float[Array, "b t d"],
    g_d: Float[Array, " d"],
    mats: tuple[Float[Array, "d ..."], ...],
    coll: Collectives,
    *,
    d_model: int,
    eps: float,
    name: str,
) -> tuple[Float[Array, "b t ..."], ...]:
    """`RMSNorm(x) @ M` for each matrix `M [d, ...]` of `mats` (low-rank down-projections `[d, g, r]`
    or `[d, r]`, dense projections `[d, out]` kept in a low-rank model), Online-RMSNorm style: under
    BTP every partial product and the partial `Σ x²` ride in one collective."""
    ss_bt1 = jnp.sum(jnp.square(x_btd.astype(jnp.float32)), axis=-1, keepdims=True)
    xg_btd = x_btd * g_d.astype(x_btd.dtype)
    zs = tuple(matmul(xg_btd, m) for m in mats)
    zs, ss_bt1 = coll.reduce_latents(zs, ss_bt1, name=name)
    inv_bt1 = jax.lax.rsqrt(ss_bt1 / d_model + eps)
    return tuple((z.astype(jnp.float32) * inv_bt1.reshape(*inv_bt1.shape, *(1,) * (z.ndim - 3))).astype(x_btd.dtype)
                 for z in zs)


def rope_inv_freq(cfg: ModelConfig, seq: int) -> np.ndarray:
    """The `head_dim / 2` RoPE inverse frequencies of `cfg` (fp32, on the host) for a sequence of `seq`
    positions, scaled as `cfg.rope_type` says, in the order of operations of Hugging Face's
    `modeling_rope_utils`:

    - default: `theta^(-2i/e)`;
    - linear: divided by `rope_factor` (positions interpolated);
    - dynamic (NTK): the base becomes `theta · (factor·n/max_seq_len - (factor-1))^(e/(e-2))` with
      `n = max(seq, max_seq_len)`: plain RoPE up to `max_seq_len`, a larger base beyond. The base is a
      function of this call's length, so every position of a sequence longer than `max_seq_len` uses it
      (transformers does the same in one forward, but keeps the longest length seen for later, shorter
      calls that still exceed `max_position_embeddings`);
    - llama3 (https://arxiv.org/abs/2407.21783): wavelengths above `original/low_freq_factor` divided by
      the factor, below `original/high_freq_factor` kept, in between smoothly interpolated.
    """
    e, theta, factor = cfg.head_dim, np.float32(cfg.rope_theta), np.float32(cfg.rope_factor)
    if cfg.rope_type == "dynamic":
        n, m = np.float32(max(seq, cfg.max_seq_len)), np.float32(cfg.max_seq_len)
        theta = theta * (factor * n / m - (factor - np.float32(1))) ** np.float32(e / (e - 2))
    inv = (np.float32(1) / theta ** (np.arange(0, e, 2, dtype=np.float32) / np.float32(e))).astype(np.float32)
    if cfg.rope_type == "linear":
        inv = inv / factor
    elif cfg.rope_type == "llama3":
        old = np.float32(cfg.rope_original_max_len or cfg.max_seq_len)
        low, high = np.float32(cfg.rope_low_freq_factor), np.float32(cfg.rope_high_freq_factor)
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope_tables(seq: int, head_dim: int, theta: float,
                inv_freq: np.ndarray | None = None) -> tuple[Float[Array, "t e"], Float[Array, "t e"]]:
    """cos/sin tables for rotate-half RoPE (the Hugging Face LLaMA convention), in fp32.

    `inv_freq`: the `head_dim / 2` frequencies (`rope_inv_freq`; default: plain RoPE of `theta`).
    Computed on the host (the shapes are static) so they enter the compiled step as constants: traced
    `cos`/`sin` of an iota get fused into, and recomputed by, every consumer on XLA's CPU backend."""
    if inv_freq is None:
        inv_freq = 1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    ang_te = np.arange(seq, dtype=np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None, :]
    ang_te = np.concatenate([ang_te, ang_te], axis=-1)
    return jnp.asarray(np.cos(ang_te)), jnp.asarray(np.sin(ang_te))


def model_rope_tables(cfg: ModelConfig, seq: int) -> tuple[Float[Array, "t e"], Float[Array, "t e"]]:
    """`rope_tables` of positions `0..seq-1` with `cfg`'s head width, base and scaling (host constants)."""
    return rope_tables(seq, cfg.head_dim, cfg.rope_theta, rope_inv_freq(cfg, seq))


def apply_rope(x_bthe: Float[Array, "b t h e"], cos_te, sin_te) -> Float[Array, "b t h e"]:
    half = x_bthe.shape[-1] // 2
    rot = jnp.concatenate([-x_bthe[..., half:], x_bthe[..., :half]], axis=-1)
    out = x_bthe.astype(jnp.float32) * cos_te[:, None, :] + rot.astype(jnp.float32) * sin_te[:, None, :]
    return out.astype(x_bthe.dtype)


def causal_attention(
    q_bthe: Float[Array, "b t h e"], k_btke: Float[Array, "b t k e"], v_btke: Float[Array, "b t k e"],
    *, impl: str = "xla", block: int = 512, segments_bt: Int[Array, "b t"] | None = None,
) -> Float[Array, "b t h e"]:
    """Causal softmax attention with grouped-query heads (h a multiple of k); softmax in fp32.

    `impl` (`ModelConfig.attention`, resolved by `attention.resolve`): `xla` materialises the fp32
    scores `[b, k, g·t, t]` (the reference the others are tested against); `cudnn` is cuDNN's flash
    attention; `chunked` is blockwise attention with `block`-position tiles (`attention.chunked_attention`);
    for `t <= block` (one tile, the whole `t x t` anyway) it runs `attention.row_blocked_attention`:
    the exact softmax per block of query rows, the tiles above the diagonal skipped.
    The output is tagged `attn_out` for remat and offload policies.
    `segments_bt` (packed documents, `--doc-mask`): a query attends only to keys with its segment id;
    `auto` then runs `chunked` (cuDNN's kernel takes no segment ids), and `cudnn` is refused."""
    impl = attention.resolve(impl, q_bthe.dtype) if segments_bt is None else attention.resolve_segments(impl)
    b, t, h, e = q_bthe.shape
    if impl == "chunked":  # both tag attn_out themselves
        if t > block:
            return attention.chunked_attention(q_bthe, k_btke, v_btke, block, segments_bt)
        return attention.row_blocked_attention(q_bthe, k_btke, v_btke, attention.ROW_BLOCK, segments_bt)
    if impl == "cudnn":
        return checkpoint_name(attention.cudnn_attention(q_bthe, k_btke, v_btke), "attn_out")
    kv = k_btke.shape[2]
    g = h // kv
    # n = (g, t): the g query heads of a kv head stacked along the rows, so both products are batched
    # GEMMs over (b, k) whose outputs come out in the order the next step reads them (written as
    # `btkge,bske->bkgts`, the degenerate g = 1 axis made XLA CPU copy the scores through a transpose)
    q_bkne = q_bthe.reshape(b, t, kv, g, e).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, e)
    k_bkse, v_bkse = k_btke.transpose(0, 2, 1, 3), v_btke.transpose(0, 2, 1, 3)
    s_bkns = jnp.einsum("bkne,bkse->bkns", q_bkne, k_bkse, preferred_element_type=jnp.float32)
    s_bkns = s_bkns / jnp.sqrt(jnp.float32(e))
    mask_ts = jnp.tril(jnp.ones((t, t), dtype=bool))
    if segments_bt is not None:  # [b, 1, t, s]: same document and causal
        mask_ts = mask_ts & (segments_bt[:, None, :, None] == segments_bt[:, None, None, :])
    mask_ns = jnp.tile(mask_ts, (g, 1)) if g > 1 else mask_ts  # the same rows for each of the g heads
    s_bkns = jnp.where(mask_ns, s_bkns, jnp.finfo(jnp.float32).min)
    p_bkns = jax.nn.softmax(s_bkns, axis=-1).astype(v_btke.dtype)
    o_bkne = jnp.einsum("bkns,bkse->bkne", p_bkns, v_bkse)
    o_btx = o_bkne.reshape(b, kv, g, t, e).transpose(0, 3, 1, 2, 4).reshape(b, t, h * e)
    return checkpoint_name(o_btx, "attn_out").reshape(b, t, h, e)


def embed_lookup(table_vd: Float[Array, "v d"], tokens_bt: Int[Array, "b t"]) -> Float[Array, "b t d"]:
    return jnp.take(table_vd, tokens_bt, axis=0)


def cast_params(params, dtype: str):
    """Floating parameters in the compute dtype (fp32 master copies stay untouched)."""
    if dtype == "float32":
        return params
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda p: p.astype(dt) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
