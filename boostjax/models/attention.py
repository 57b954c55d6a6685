"""Causal attention without a `[t, t]` buffer: cuDNN's fused kernel, or blockwise attention in JAX.

`chunked_attention` is FlashAttention-2 (https://arxiv.org/abs/2307.08691) written with `lax` loops:
the forward walks the query blocks and, for each, the key blocks at or before it (the blocks above
the causal diagonal are skipped), keeping the running row maximum and sum in fp32; it saves only
q, k, v, the output and the per-row log-sum-exp. The backward (`jax.custom_vjp`) walks the key
blocks and, for each, the query blocks at or after it, recomputing each tile's probabilities from
the saved log-sum-exp: `dS = P ⊙ (dP − D)` with `D = rowsum(dO ⊙ O)`. Every intermediate is a
`block x block` tile or has the size of an input (blocked copies, fp32 accumulators, row statistics);
the HLO does not grow with `t`. With segment ids (packed documents) each tile is also masked to
query/key pairs of the same segment, and a row whose keys so far are all masked contributes nothing.

`row_blocked_attention` is the single-tile case (`t <= block`): the exact softmax per block of query
rows against all of its keys, the tiles above the diagonal skipped, its exp-scores kept for the
backward (fast on CPU, where XLA runs each batched GEMM on one thread; docs/attention.md).

`resolve` turns a `ModelConfig.attention` choice into the path that runs (at trace time, from the
backend and the compute dtype); `check_backend` refuses, before anything compiles, a choice the
backend cannot run. Shape letters as in `boostjax.models.ops`; `n` counts blocks, `q`/`s` index the
query/key positions inside a block.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from boostjax.config import ATTENTION, ConfigError, ModelConfig

HALF_DTYPES = (jnp.bfloat16, jnp.float16)


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("attention_target", default=None)


@contextlib.contextmanager
def lowering_for(platform: str):
    """Resolve attention for `platform` ("cuda", "cpu", ...) instead of JAX's default backend while tracing
    a step that is lowered for it (`.lower(lowering_platforms=(platform,))`, no GPU needed)."""
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


def on_cuda_gpu() -> bool:
    """JAX's default backend is a CUDA GPU (cuDNN's flash attention is not built for ROCm or CPU), or the
    step is traced for a CUDA lowering (`lowering_for("cuda")`)."""
    if _TARGET.get() is not None:
        return _TARGET.get() == "cuda"
    if jax.default_backend() != "gpu":
        return False
    try:
        return "cuda" in jax.devices()[0].client.platform_version.lower()
    except AttributeError:  # a runtime that does not say; cuDNN itself will tell
        return True


def resolve(impl: str, dtype) -> str:
    """The attention path that runs: `auto` is cuDNN on a CUDA GPU in bf16/fp16, `chunked` otherwise.
    Raises ConfigError when `cudnn` is asked for where it cannot run."""
    if impl == "auto":
        return "cudnn" if jnp.dtype(dtype) in HALF_DTYPES and on_cuda_gpu() else "chunked"
    if impl == "cudnn":
        if not on_cuda_gpu():
            raise ConfigError(f"model.attention: cudnn (cuDNN flash attention) needs a CUDA GPU, but JAX's backend "
                              f"is {jax.default_backend()!r}; fix: pass --attention chunked (or auto)")
        if jnp.dtype(dtype) not in HALF_DTYPES:
            raise ConfigError(f"model.attention: cudnn runs in bfloat16/float16, the compute dtype is "
                              f"{jnp.dtype(dtype).name}; fix: pass --dtype bfloat16 or --attention chunked")
    elif impl not in ("xla", "chunked"):
        raise ConfigError(f"model.attention: unknown attention {impl!r}; fix: use one of {', '.join(ATTENTION)}")
    return impl


def needs_program_mesh(impl: str, dtype) -> bool:
    """Whether a `shard_map` around this attention must run over the program's whole mesh: cuDNN's is
    lowered through `custom_partitioning`, which reads the program's mesh and refuses a shard_map over a
    mesh without its size-1 `data` axis ("mesh should be the same across the entire program")."""
    return resolve(impl, dtype) == "cudnn"


def resolve_segments(impl: str) -> str:
    """The path that runs with segment ids (packed documents): `auto` -> `chunked`; `cudnn` refused."""
    if impl == "cudnn":
        raise ConfigError("model.attention: cudnn takes no segment ids, so it cannot mask documents (--doc-mask); "
                          "fix: pass --attention chunked (or auto)")
    return "chunked" if impl == "auto" else resolve(impl, jnp.float32)


def memory_kind(model: ModelConfig, seq: int, dtype: str) -> str:
    """What the offload cost model should assume for this attention: "materialized" when the step holds
    `[t, t]` probabilities (the xla path, or chunked with the whole sequence in one block), "flash" when
    it keeps only the per-row log-sum-exp (cuDNN, or chunked over several blocks)."""
    impl = resolve(model.attention, jnp.dtype(dtype))
    flash = impl == "cudnn" or (impl == "chunked" and seq > model.attention_block)
    return "flash" if flash else "materialized"


def check_backend(model: ModelConfig, dtype: str) -> None:
    """ConfigError, before anything compiles, when `model.attention` cannot run on this backend."""
    resolve(model.attention, jnp.dtype(dtype))


def cudnn_attention(q_bthe: Float[Array, "b t h e"], k_btke: Float[Array, "b t k e"],
                    v_btke: Float[Array, "b t k e"]) -> Float[Array, "b t h e"]:
    """cuDNN flash attention (grouped-query heads: k divides h), scale 1/sqrt(e)."""
    return jax.nn.dot_product_attention(q_bthe, k_btke, v_btke, is_causal=True, implementation="cudnn")


# ------------------------------------------------------------------------------ row-blocked

ROW_BLOCK = 64  # query positions per row block: the fastest of 32-256 at t = 256 on CPU (docs/attention.md)


def _row_blocks(t: int, rows: int) -> list[tuple[int, int]]:
    """Query position ranges [lo, hi) of `rows` positions (the last one shorter)."""
    return [(lo, min(t, lo + rows)) for lo in range(0, t, rows)]


def _by_kv_head(x_bthe: Array, kv: int) -> Array:
    """[b, t, h, e] -> [b, k, t·g, e]: the g query heads of a kv head as rows, position-major, so a block
    of positions is a contiguous block of rows."""
    b, t, h, e = x_bthe.shape
    return _grouped(x_bthe, kv).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * (h // kv), e)


def _from_kv_head(x_bkne: Array, h: int) -> Array:
    """[b, k, t·g, e] -> [b, t, h, e]."""
    b, kv, n, e = x_bkne.shape
    g = h // kv
    return x_bkne.reshape(b, kv, n // g, g, e).transpose(0, 2, 1, 3, 4).reshape(b, n // g, h, e)


def _row_tile(q_bkne, k_bkse, lo: int, hi: int, g: int, segments_bt=None):
    """exp(scale · (s − rowmax s)) [b, k, (hi−lo)·g, hi] of the query rows at positions [lo, hi) against
    keys 0..hi−1 (causal, and with segments same-document; a row always sees itself, so every row max is
    finite), and its row sums [b, k, rows, 1], both fp32."""
    s = jnp.einsum("bkne,bkse->bkns", q_bkne, k_bkse, preferred_element_type=jnp.float32)
    pos = np.repeat(np.arange(lo, hi), g)
    keep = jnp.asarray(pos[:, None] >= np.arange(hi)[None, :])
    if segments_bt is not None:
        seg_q = jnp.repeat(segments_bt[:, lo:hi], g, axis=1)
        keep = keep & (seg_q[:, None, :, None] == segments_bt[:, None, None, :hi])
    s = jnp.where(keep, s, -jnp.inf)
    e_bkns = jnp.exp((s - s.max(-1, keepdims=True)) / jnp.sqrt(jnp.float32(q_bkne.shape[-1])))
    return e_bkns, e_bkns.sum(-1, keepdims=True)


def _row_forward(q_bthe, k_btke, v_btke, rows: int, segments_bt=None):
    """Output [b, t, h, e] and the residuals: each block's unnormalised probabilities, transposed to
    [keys, rows] for the backward's key-side GEMMs, and row sums."""
    b, t, h, e = q_bthe.shape
    kv = k_btke.shape[2]
    g = h // kv
    q_bkne, k_bkse, v_bkse = _by_kv_head(q_bthe, kv), _by_kv_head(k_btke, kv), _by_kv_head(v_btke, kv)
    outs, tiles = [], []
    for lo, hi in _row_blocks(t, rows):
        e_bkns, l_bkn1 = _row_tile(q_bkne[:, :, lo * g:hi * g], k_bkse[:, :, :hi], lo, hi, g, segments_bt)
        acc = jnp.einsum("bkns,bkse->bkne", e_bkns.astype(v_btke.dtype), v_bkse[:, :, :hi],
                         preferred_element_type=jnp.float32)
        outs.append((acc / l_bkn1).astype(v_btke.dtype))  # the normalisation on [rows, e], not [rows, hi]
        tiles.append((materialised(jnp.swapaxes(e_bkns, -1, -2)), l_bkn1))
    return _from_kv_head(jnp.concatenate(outs, axis=2), h), tiles


def materialised(x: Array) -> Array:
    """`x` as its own buffer: XLA folds a transpose into the dot that reads it, and a dot whose left
    operand is contracted along its rows runs as a slower transposed GEMM on the CPU (measured in
    docs/attention.md); behind a barrier the transposed copy is made once and the dots read it row-major."""
    return jax.lax.optimization_barrier(x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def row_blocked_attention(q_bthe: Float[Array, "b t h e"], k_btke: Float[Array, "b t k e"],
                          v_btke: Float[Array, "b t k e"], rows: int,
                          segments_bt: Int[Array, "b t"] | None = None) -> Float[Array, "b t h e"]:
    """Exact causal attention, `rows` query positions per block, each block against all its keys at once
    (no running max): the tiles above the diagonal are skipped ((n+1)/2n of the [t, t] work for n blocks)
    and the blocks are independent GEMMs the executor can run side by side. The backward uses each
    block's saved exp-scores (`dS = E ⊙ (dP/l − rowsum(dO/l ⊙ O))`), the 1/l folded into the [rows, e]
    operands. With `segments_bt` a query attends only to keys of its segment."""
    return checkpoint_name(_row_forward(q_bthe, k_btke, v_btke, rows, segments_bt)[0], "attn_out")


def _row_fwd(q_bthe, k_btke, v_btke, rows, segments_bt=None):
    o_bthe, tiles = _row_forward(q_bthe, k_btke, v_btke, rows, segments_bt)
    o_bthe = checkpoint_name(o_bthe, "attn_out")
    return o_bthe, (q_bthe, k_btke, v_btke, o_bthe, tiles, segments_bt)


def _row_bwd(rows, res, do_bthe):
    q_bthe, k_btke, v_btke, o_bthe, tiles, segments_bt = res
    b, t, h, e = q_bthe.shape
    kv, dt = k_btke.shape[2], q_bthe.dtype
    g = h // kv
    scale = 1.0 / jnp.sqrt(jnp.float32(e))
    q_bkne, k_bkse, v_bkse = _by_kv_head(q_bthe, kv), _by_kv_head(k_btke, kv), _by_kv_head(v_btke, kv)
    do_bkne, o_bkne = _by_kv_head(do_bthe.astype(jnp.float32), kv), _by_kv_head(o_bthe.astype(jnp.float32), kv)
    dq, dk, dv = [], jnp.zeros(k_bkse.shape, jnp.float32), jnp.zeros(v_bkse.shape, jnp.float32)
    for (lo, hi), (e_bksn, l_bkn1) in zip(_row_blocks(t, rows), tiles):  # E saved transposed: [keys, rows]
        n = slice(lo * g, hi * g)
        dol = do_bkne[:, :, n] / l_bkn1  # dO / l: P = E / l never formed
        dv = _add_to_keys(dv, jnp.einsum("bksn,bkne->bkse", e_bksn.astype(dt), dol.astype(dt),
                                         preferred_element_type=jnp.float32))
        dp_bksn = jnp.einsum("bkse,bkne->bksn", v_bkse[:, :, :hi], dol.astype(dt), preferred_element_type=jnp.float32)
        delta_bk1n = jnp.swapaxes(jnp.sum(dol * o_bkne[:, :, n], -1, keepdims=True), -1, -2)
        ds_bksn = (e_bksn * (dp_bksn - delta_bk1n)).astype(dt)
        dq.append(jnp.einsum("bkns,bkse->bkne", materialised(jnp.swapaxes(ds_bksn, -1, -2)), k_bkse[:, :, :hi],
                             preferred_element_type=jnp.float32))
        dk = _add_to_keys(dk, jnp.einsum("bksn,bkne->bkse", ds_bksn, q_bkne[:, :, n],
                                         preferred_element_type=jnp.float32))
    dq_bthe = _from_kv_head(jnp.concatenate(dq, axis=2) * scale, h).astype(dt)
    dk_btke, dv_btke = _from_kv_head(dk * scale, kv).astype(k_btke.dtype), _from_kv_head(dv, kv).astype(v_btke.dtype)
    dseg = None if segments_bt is None else np.zeros(segments_bt.shape, jax.dtypes.float0)  # integer input
    return dq_bthe, dk_btke, dv_btke, dseg


row_blocked_attention.defvjp(_row_fwd, _row_bwd)


def _add_to_keys(acc_bkse: Array, x_bkse: Array) -> Array:
    """`acc` plus `x` on its first keys (`x` covers keys 0..hi-1). The block that covers every key is a
    plain add: as `acc.at[:, :, :t].add(x)` it lowers to a scatter with an empty index vector, on which
    jax 0.11.2's Shardy canonicalizer segfaults inside a `shard_map` (docs/gpu-program.md). The shorter
    blocks stay scatter-adds, which XLA's CPU backend runs faster than a zero-padded add."""
    hi = x_bkse.shape[2]
    return acc_bkse + x_bkse if hi == acc_bkse.shape[2] else acc_bkse.at[:, :, :hi].add(x_bkse)


# ------------------------------------------------------------------------------------ chunked


def _blocks(x_bt__: Array, block: int) -> Array:
    """[b, t, ...] -> [n, b, block, ...], zero-padded to n·block positions. Padded keys sit after
    every real query, so the causal mask hides them; padded query rows are sliced off."""
    b, t = x_bt__.shape[:2]
    n = -(-t // block)
    x = jnp.pad(x_bt__, [(0, 0), (0, n * block - t)] + [(0, 0)] * (x_bt__.ndim - 2))
    return jnp.moveaxis(x.reshape(b, n, block, *x_bt__.shape[2:]), 1, 0)


def _unblock(x_nbq__: Array, t: int) -> Array:
    """[n, b, block, ...] -> [b, t, ...]."""
    n, b, blk = x_nbq__.shape[:3]
    return jnp.moveaxis(x_nbq__, 0, 1).reshape(b, n * blk, *x_nbq__.shape[3:])[:, :t]


def _scores(q_bqkge, k_bske, i, j, seg=None) -> Float[Array, "b k g q s"]:
    """fp32 scores of tile (query block i, key block j) in the reference's order (dot, then / sqrt(e)),
    keys after the query masked (only the diagonal tile i == j has any), and with `seg` = (query
    segments [b, q], key segments [b, s]) keys of another segment."""
    s = jnp.einsum("bqkge,bske->bkgqs", q_bqkge, k_bske, preferred_element_type=jnp.float32)
    s = s / jnp.sqrt(jnp.float32(q_bqkge.shape[-1]))
    blk = s.shape[-1]
    pos = jnp.arange(blk)
    keep = (i - j) * blk + pos[:, None] >= pos[None, :]
    if seg is not None:
        keep = keep & (seg[0][:, None, None, :, None] == seg[1][:, None, None, None, :])
    return jnp.where(keep, s, -jnp.inf)


def _seg_blocks(segments_bt, block: int):
    """Segment ids as [n, b, block] (padding gets -1: padded queries see only padded keys), or None."""
    if segments_bt is None:
        return None
    b, t = segments_bt.shape
    n = -(-t // block)
    x = jnp.pad(segments_bt, [(0, 0), (0, n * block - t)], constant_values=-1)
    return jnp.moveaxis(x.reshape(b, n, block), 1, 0)


def _zero_like(*xs: Array) -> Float[Array, ""]:
    """An fp32 zero that varies over the manual mesh axes of every `x` (under shard_map, a loop carry must
    have the type of what the loop body makes of it, and the gradients mix all inputs)."""
    return sum(jnp.zeros_like(x, jnp.float32, shape=()) for x in xs)


def _grouped(q_bthe: Array, kv: int) -> Array:
    b, t, h, e = q_bthe.shape
    return q_bthe.reshape(b, t, kv, h // kv, e)


def _forward(q_bthe, k_btke, v_btke, block: int, segments_bt=None):
    """Output [b, t, h, e] and log-sum-exp [n, b, k, g, block] (fp32)."""
    b, t, h, e = q_bthe.shape
    kv = k_btke.shape[2]
    q_nbqkge = _blocks(_grouped(q_bthe, kv), block)
    k_nbske, v_nbske = _blocks(k_btke, block), _blocks(v_btke, block)
    seg_nbq = _seg_blocks(segments_bt, block)

    def pv(p_bkgqs, v_bske):
        return jnp.einsum("bkgqs,bske->bkgqe", p_bkgqs.astype(v_bske.dtype), v_bske,
                          preferred_element_type=jnp.float32)

    zero, rows = _zero_like(q_bthe, k_btke, v_btke), (b, kv, h // kv, block)  # [b, k, g, q]: per row and head
    init = (jnp.full(rows, -jnp.inf) + zero, jnp.broadcast_to(zero, rows), jnp.broadcast_to(zero, (*rows, e)))

    def query_block(i):
        q_bqkge = q_nbqkge[i]

        def key_block(j, carry):  # j <= i: the tiles above the diagonal are skipped
            m_old, l_old, acc = carry
            s = _scores(q_bqkge, k_nbske[j], i, j, None if seg_nbq is None else (seg_nbq[i], seg_nbq[j]))
            m_new = jnp.maximum(m_old, s.max(-1))  # finite from j = 0 on: key 0 precedes every query
            if seg_nbq is not None:  # ... unless segments mask every key so far: then p = alpha = 0
                m_new = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            alpha = jnp.exp(m_old - m_new)
            p = jnp.exp(s - m_new[..., None])
            return m_new, alpha * l_old + p.sum(-1), alpha[..., None] * acc + pv(p, v_nbske[j])

        m_bkgq, l_bkgq, acc_bkgqe = lax.fori_loop(0, i + 1, key_block, init)
        o_bqkge = jnp.einsum("bkgqe->bqkge", acc_bkgqe / l_bkgq[..., None]).astype(v_btke.dtype)
        return o_bqkge, m_bkgq + jnp.log(l_bkgq)

    o_nbqkge, lse_nbkgq = lax.map(query_block, jnp.arange(q_nbqkge.shape[0]))
    return _unblock(o_nbqkge, t).reshape(b, t, h, e), lse_nbkgq


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def chunked_attention(q_bthe: Float[Array, "b t h e"], k_btke: Float[Array, "b t k e"],
                      v_btke: Float[Array, "b t k e"], block: int,
                      segments_bt: Int[Array, "b t"] | None = None) -> Float[Array, "b t h e"]:
    """Blockwise causal attention (FlashAttention-2), `block` query/key positions per tile; with
    `segments_bt` a query attends only to keys of its segment."""
    return checkpoint_name(_forward(q_bthe, k_btke, v_btke, block, segments_bt)[0], "attn_out")


def _chunked_fwd(q_bthe, k_btke, v_btke, block, segments_bt=None):
    o_bthe, lse_nbkgq = _forward(q_bthe, k_btke, v_btke, block, segments_bt)
    # the residuals a remat/offload policy can keep by name: the output and its fp32 row statistics
    o_bthe, lse_nbkgq = checkpoint_name(o_bthe, "attn_out"), checkpoint_name(lse_nbkgq, "attn_out_stats")
    return o_bthe, (q_bthe, k_btke, v_btke, o_bthe, lse_nbkgq, segments_bt)


def _chunked_bwd(block, res, do_bthe):
    q_bthe, k_btke, v_btke, o_bthe, lse_nbkgq, segments_bt = res
    seg_nbq = _seg_blocks(segments_bt, block)
    t, kv, e = q_bthe.shape[1], k_btke.shape[2], q_bthe.shape[3]
    dt = q_bthe.dtype
    inv_scale = 1.0 / jnp.sqrt(jnp.float32(e))
    q_nbqkge, do_nbqkge = (_blocks(_grouped(x, kv), block) for x in (q_bthe, do_bthe))
    k_nbske, v_nbske = _blocks(k_btke, block), _blocks(v_btke, block)
    # D = rowsum(dO ⊙ O) = Σ_s P dP: the softmax's correction term, one number per query row and head
    d_nbkgq = jnp.einsum("nbqkge->nbkgq", (do_nbqkge.astype(jnp.float32) *
                                           _blocks(_grouped(o_bthe, kv), block).astype(jnp.float32)))
    n, zero = q_nbqkge.shape[0], _zero_like(*res[:5], do_bthe)

    def key_block(dq_nbqkge, j):
        k_bske, v_bske = k_nbske[j], v_nbske[j]

        def tile(i, carry):  # i >= j: the tiles above the diagonal are skipped
            dq, dk, dv = carry
            q_bqkge, do_bqkge = q_nbqkge[i], do_nbqkge[i]
            seg = None if seg_nbq is None else (seg_nbq[i], seg_nbq[j])
            p = jnp.exp(_scores(q_bqkge, k_bske, i, j, seg) - lse_nbkgq[i][..., None])
            dv = dv + jnp.einsum("bkgqs,bqkge->bske", p.astype(dt), do_bqkge, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkge,bske->bkgqs", do_bqkge, v_bske, preferred_element_type=jnp.float32)
            ds = (p * (dp - d_nbkgq[i][..., None]) * inv_scale).astype(dt)
            dk = dk + jnp.einsum("bkgqs,bqkge->bske", ds, q_bqkge, preferred_element_type=jnp.float32)
            dq_i = jnp.einsum("bkgqs,bske->bqkge", ds, k_bske, preferred_element_type=jnp.float32)
            return dq.at[i].add(dq_i), dk, dv

        dkv0 = jnp.broadcast_to(zero, k_bske.shape)
        dq, dk, dv = lax.fori_loop(j, n, tile, (dq_nbqkge, dkv0, dkv0))
        return dq, (dk, dv)

    dq_nbqkge, (dk_nbske, dv_nbske) = lax.scan(key_block, jnp.broadcast_to(zero, q_nbqkge.shape), jnp.arange(n))
    dq_bthe = _unblock(dq_nbqkge, t).reshape(q_bthe.shape).astype(dt)
    dseg = None if segments_bt is None else np.zeros(segments_bt.shape, jax.dtypes.float0)  # integer input
    return (dq_bthe, _unblock(dk_nbske, t).astype(k_btke.dtype), _unblock(dv_nbske, t).astype(v_btke.dtype),
            dseg)


chunked_attention.defvjp(_chunked_fwd, _chunked_bwd)
