"""LLaMA with dense or low-rank (CoLA, SVD, LaX) projections, written once for every TP strategy.

Parameters are stored `[in, out]`. Low-rank projections that share an input are grouped: the
attention's q/k/v down-projections are one `a_qkv: [d, 3, r]` tensor (one GEMM, one collective),
the MLP's gate/up are `a_gate_up: [d, 2, r]`; up-projections with distinct inputs and equal shapes
(`b_kv`, `b_gate_up`) run as one batched GEMM. A TP strategy only changes how these tensors are
sliced and which `Collectives` hook communicates.

Every parameter declares its logical axes where it is created (`out_sharding` metadata, `AXES`);
`boostjax.sharding.rules` maps them to mesh axes per strategy and derives the rotation mask from them.

Activations tagged with `checkpoint_name` (remat and offload policies select them by name):
`boundary` (block input), `qkv_latent`/`qkv`, `attn_out`, `o_latent`, `mid`,
`gate_up_latent`/`gate_up`, `mlp_hidden`, `down_latent` (and `*_latent_stats` for the norm);
`segment_boundary` is the input of a `RematSegment` (a recompute segment of several layers).
"""

from __future__ import annotations

import dataclasses
import functools
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from boostjax.config import Config, ModelConfig
from boostjax.models import kvcache, ops
from boostjax.models.remat import tied_checkpoint
from boostjax.models.collectives import LOCAL, Collectives, vocab_parallel_cross_entropy

LATENT_NAMES = ("qkv_latent", "o_latent", "gate_up_latent", "down_latent")
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # communication-free low-rank checkpointing: keep what crossed a collective (the r-dim latents
    # and the norm statistics), recompute every d-dim activation locally.
    "lowrank": jax.checkpoint_policies.save_only_these_names(
        *LATENT_NAMES, *(n + "_stats" for n in LATENT_NAMES)
    ),
}


class RematSegment(NamedTuple):
    """Consecutive layers under one outer `jax.checkpoint` with `policy` (an offload plan's recompute
    segment): the forward keeps only what `policy` selects (the segment input is tagged
    `segment_boundary`), the backward re-runs the segment. `inner[i]` is the per-layer policy of
    the segment's i-th layer, or a `TiedLayer` (None = no per-layer checkpoint: a flat, Chen-style
    segment)."""

    policy: Callable
    inner: tuple[Callable | TiedLayer | None, ...]


class TiedLayer(NamedTuple):
    """One layer checkpointed with `policy` and tied both ways (`remat.tied_checkpoint(...,
    tie_grads=True)`): its recomputation waits for its output cotangent, and its input cotangent leaves
    with its weight gradients. An offload plan that keeps state on the host gives its checkpointed
    layers this form, alone or inside a segment (`offload.apply.schedule`): XLA's GPU scheduler
    otherwise left the weight gradients for later and kept every layer's recomputed activations live
    (docs/gpu-program.md)."""

    policy: Callable


RematSchedule = Sequence["Callable | None | RematSegment | TiedLayer"]


def run_schedule(apply: Callable[[Any, Array], Array], params: Sequence[Any], x: Array,
                 schedule: RematSchedule) -> Array:
    """`x` through the layers `apply(params[k], x)` in order under a per-layer remat schedule (entries
    as in `LLaMA.features`): what a pipeline stage runs on its own layers under an offload plan."""
    def one(p, y, policy):
        if isinstance(policy, TiedLayer):
            return tied_checkpoint(apply, policy.policy, tie_grads=True)(p, y)
        return apply(p, y) if policy is None else jax.checkpoint(apply, policy=policy)(p, y)

    def segment(inner):
        def run(ps, y):
            y = checkpoint_name(y, "segment_boundary")
            for p, pol in zip(ps, inner):
                y = one(p, y, pol)
            return y
        return run

    k = 0
    for entry in _check_schedule(schedule, len(params)):
        if isinstance(entry, RematSegment):
            n = len(entry.inner)
            x = jax.checkpoint(segment(entry.inner), policy=entry.policy)(list(params[k:k + n]), x)
            k += n
        else:
            x = one(params[k], x, entry)
            k += 1
    return x


# the logical axes a parameter's dimensions may carry (MaxText-style names; `boostjax.sharding.rules`)
AXES: dict[str, str] = {
    "embed": "d_model of the residual stream (block norms, the A's input, the B's output, the embedding's columns)",
    "heads": "query heads x head_dim",
    "kv": "kv heads x head_dim",
    "ff": "d_ff",
    "rank": "r, the low-rank latent",
    "group": "independent matrices stacked in one grouped tensor (a_qkv [d, 3, r], b_kv [2, r, k·e], ...)",
    "vocab": "the LM head's vocabulary (vocab-parallel logits)",
    "embed_vocab": "the embedding table's rows (looked up by token id)",
    "features": "d_model of the final-normed features (full width: gathered before the head)",
    "cross": "LaX's latent-crossing gates",
    "dense_out": "the output of a projection kept dense in a low-rank model (never split)",
    "dense_in": "the input of a dense o / down kept in a low-rank model (never split)",
    "layers": "the leading layer axis of stacked layers (a pipeline's state)",
}


def _declared(value: Array, axes: tuple[str, ...]) -> nnx.Param:
    """A parameter with its logical axes (flax's `out_sharding` metadata; never sharded eagerly:
    the names are logical, a placement maps them to mesh axes)."""
    if value.ndim != len(axes) or any(a not in AXES for a in axes):
        raise ValueError(f"logical axes {axes} do not fit a parameter of shape {value.shape}; fix: one name of AXES per dim")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], std: float | Array, axes: tuple[str, ...]) -> nnx.Param:
    """Normal(0, std) (`std` a number, or an array broadcast against `shape`: per-slice stds)."""
    return _declared(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes)


def cola_std(rank: int, d_in: int, d_out: int) -> float:
    """CoLA's std for BOTH factors of a low-rank projection standing for a dense `[d_in, d_out]` layer:
    `r^-1/4 (d_in + d_out)^-1/4`, so the product `A B` has the Xavier-like per-entry std
    `(d_in + d_out)^-1/2` (CoLA https://arxiv.org/abs/2502.10940, `ColaLayer`; BOOST
    https://arxiv.org/abs/2512.12131 `get_cola_std` is the same). Independent of `init_std`, which
    initialises the dense kind, the embedding and the head."""
    return rank ** -0.25 * (d_in + d_out) ** -0.25


def _sigma(kind: str) -> Callable[[Array], Array]:
    """The nonlinearity between the factors: SiLU for CoLA and LaX, none for SVD-style."""
    return (lambda h: h) if kind == "svd" else jax.nn.silu


def mlp_hidden(cfg: ModelConfig, gate: Array, up: Array) -> Array:
    """The MLP's hidden state: `gate * up` for cola/lax with `only_lr_act` (CoLA's published form:
    the SiLU inside each factor pair is the only nonlinearity), else `silu(gate) * up` (SwiGLU)."""
    return jax.nn.silu(gate) * up if cfg.gated_silu else gate * up


def grouped_up(hs: Sequence[Float[Array, "b t r"]], b_grk: Float[Array, "g r k"],
               coll: Collectives) -> tuple[Float[Array, "b t k"], ...]:
    """`(hs[i] @ b_grk[i] for i)` as one batched GEMM (one `reduce_up` collective for the group).

    The group axis leads (`gbtr,grk->gbtk`): a dot's batch axes must be the major ones, so with the
    group in the middle (`btgr,grk->btgk`) XLA transposes the latents, the outputs and both of their
    gradients around every GEMM; leading, the stack and the unstack are contiguous copies. b and t are
    flattened into one row axis (`gnr,grk->gnk`), so each weight gradient contracts one axis (see
    `ops.matmul`)."""
    b, t, r = hs[0].shape
    h_gnr = jnp.stack(hs, 0).reshape(len(hs), b * t, r)
    y_gnk = coll.reduce_up(jnp.einsum("gnr,grk->gnk", h_gnr, b_grk))
    return tuple(y_gnk[i].reshape(b, t, -1) for i in range(len(hs)))


def _dense_axes(cfg: ModelConfig, out: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """Logical axes of a dense (input-side, output-side) projection pair with hidden axis `out`: the
    llama kind's Megatron layout, or for a group kept dense in a low-rank model `dense_out`/`dense_in`
    (never split: under BTP the input side is row-parallel like an A, the output side column-parallel
    like a B, so the residual stream stays sharded along d)."""
    if cfg.low_rank:
        return ("embed", "dense_out"), ("dense_in", "embed")
    return ("embed", out), (out, "embed")


class Attention(nnx.Module):
    """Pre-norm causal self-attention (RoPE, optional grouped-query heads).

    Each projection group (`ModelConfig.group_low_rank`: q and o, k and v) is low-rank or dense. The
    down-projections of the low-rank groups share the block's one Online-RMSNorm collective (`a_qkv
    [d, 3, r]` when q and k/v have one rank, else `a_q [d, r]` and `a_kv [d, 2, r_kv]`); in a low-rank
    model a dense k/v (or q) joins that collective too and keeps its local heads.

    LaX (https://arxiv.org/abs/2505.21732, `kind="lax"`): zero-initialised scalar gates cross the
    latents inside the block, `h_k += c0 h_q`, `h_v += c1 h_k`, `h_o += c2 h_v` (MLP: `h_up += c0 h_gate`,
    `h_down += c1 h_up`), each adding its source's post-crossing latent, as the authors' code hands on
    post-crossing latents. Their released code (ViT, K1seki221/Latent_Crossing) is inter-layer instead:
    each projection crosses the same projection's latent of the previous block through an r x r gate
    and a LayerNorm; this intra-layer, scalar-gated chain is our variant."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, std = cfg.d_model, cfg.init_std
        he, ke = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.cfg = cfg
        self.lr_q, self.lr_kv = cfg.group_low_rank("attn"), cfg.group_low_rank("kv")
        r, r_kv = cfg.group_rank("attn"), cfg.group_rank("kv")
        self.norm = _declared(jnp.ones((d,), jnp.float32), ("embed",))
        # CoLA's init (`cola_std`); k/v read as the dense [d, kv_heads*head_dim] projections
        s_q, s_kv, s_o = cola_std(r, d, he), cola_std(r_kv, d, ke), cola_std(r, he, d)
        (q_in, q_out), (kv_in, _) = _dense_axes(cfg, "heads"), _dense_axes(cfg, "kv")
        if self.lr_q and self.lr_kv and r == r_kv:
            self.a_qkv = _param(rngs, (d, 3, r), jnp.array([s_q, s_kv, s_kv])[:, None], ("embed", "group", "rank"))
        else:
            if self.lr_q:
                self.a_q = _param(rngs, (d, r), s_q, ("embed", "rank"))
            else:
                self.w_q = _param(rngs, (d, he), std, q_in)
            if self.lr_kv:
                self.a_kv = _param(rngs, (d, 2, r_kv), s_kv, ("embed", "group", "rank"))
            else:
                self.w_k = _param(rngs, (d, ke), std, kv_in)
                self.w_v = _param(rngs, (d, ke), std, kv_in)
        # creation order = the order of the random draws: b_q, b_kv, then o (older runs' inits unchanged)
        if self.lr_q:
            self.b_q = _param(rngs, (r, he), s_q, ("rank", "heads"))
        if self.lr_kv:
            self.b_kv = _param(rngs, (2, r_kv, ke), s_kv, ("group", "rank", "kv"))
        if self.lr_q:
            self.a_o = _param(rngs, (he, r), s_o, ("heads", "rank"))
            self.b_o = _param(rngs, (r, d), s_o, ("rank", "embed"))
        else:
            self.w_o = _param(rngs, (he, d), std, q_out)
        if cfg.kind == "lax" and self.lr_q:  # latent crossing gates: k <- q, v <- k, o <- v (one rank: validated)
            self.cross = _declared(jnp.zeros((3,), jnp.float32), ("cross",))

    def _qkv(self, x_btd, coll: Collectives):
        """q, k, v `[b, t, local heads x e]` of the block input, and (LaX) the v latent `o` crosses from."""
        cfg = self.cfg
        if not cfg.low_rank:  # the llama kind: Megatron column-parallel GEMMs
            xn_btd = coll.to_column_parallel(ops.rms_norm(x_btd, self.norm[...], cfg.norm_eps))
            return (*(checkpoint_name(ops.matmul(xn_btd, w[...]), "qkv") for w in (self.w_q, self.w_k, self.w_v)), None)
        grouped = hasattr(self, "a_qkv")
        mats = ((self.a_qkv[...],) if grouped else
                (self.a_q[...] if self.lr_q else self.w_q[...],
                 *((self.a_kv[...],) if self.lr_kv else (self.w_k[...], self.w_v[...]))))
        zs = ops.online_norm_many(x_btd, self.norm[...], mats, coll, d_model=cfg.d_model, eps=cfg.norm_eps,
                                  name="qkv_latent")
        sigma = _sigma(cfg.kind)
        if grouped:
            hq, hk, hv = (sigma(zs[0][:, :, i]) for i in range(3))
        else:
            hq = sigma(zs[0]) if self.lr_q else None
            hk, hv = (sigma(zs[1][:, :, i]) for i in range(2)) if self.lr_kv else (None, None)
        if cfg.kind == "lax" and hq is not None:  # each crossing adds its source's POST-crossing latent
            c = self.cross[...].astype(x_btd.dtype)
            hk = hk + c[0] * hq
            hv = hv + c[1] * hk
        q = coll.reduce_up(ops.matmul(hq, self.b_q[...])) if self.lr_q else coll.local_columns(zs[0])
        if self.lr_kv:
            k, v = grouped_up((hk, hv), self.b_kv[...], coll)
        else:
            k, v = (coll.local_columns(z) for z in zs[-2:])
        return q, k, v, hv

    def __call__(self, x_btd, cos_te, sin_te, coll: Collectives, segments_bt=None, *,
                 cache=None) -> Float[Array, "b t d"]:
        """`cache=(k_bske, v_bske, pos)` when decoding (`boostjax.models.kvcache`): `x` holds positions
        `pos..pos+t-1` and `cos`/`sin` are theirs; returns `(y, (k_bske, v_bske))`, the buffers with this
        step's keys and values written in (one sequence per row: `segments_bt` must be None)."""
        cfg, e = self.cfg, self.cfg.head_dim
        b, t, _ = x_btd.shape
        q, k, v, hv = self._qkv(x_btd, coll)
        q_bthe = ops.apply_rope(q.reshape(b, t, -1, e), cos_te, sin_te)
        k_btke = ops.apply_rope(k.reshape(b, t, -1, e), cos_te, sin_te)
        if cache is not None:
            k_bske, v_bske, pos = cache
            cache = kvcache.write(k_bske, k_btke, pos), kvcache.write(v_bske, v.reshape(b, t, -1, e), pos)
            o_btx = kvcache.cached_attention(q_bthe, *cache, pos).reshape(b, t, -1)
        else:
            o_btx = ops.causal_attention(q_bthe, k_btke, v.reshape(b, t, -1, e), impl=cfg.attention,
                                         block=cfg.attention_block, segments_bt=segments_bt).reshape(b, t, -1)
        if self.lr_q:
            h_btr = coll.reduce_latent(ops.matmul(o_btx, self.a_o[...]), name="o_latent")
            h_btr = _sigma(cfg.kind)(h_btr)
            if cfg.kind == "lax":
                h_btr = h_btr + self.cross[...].astype(x_btd.dtype)[2] * hv
            y_btd = coll.reduce_up(ops.matmul(h_btr, self.b_o[...]))
        elif cfg.low_rank:  # a dense o in a low-rank model: all heads in, this device's d columns out
            y_btd = ops.matmul(coll.gather_columns(o_btx), self.w_o[...])
        else:
            y_btd = coll.reduce_row(ops.matmul(o_btx, self.w_o[...]))
        return y_btd if cache is None else (y_btd, cache)


class MLP(nnx.Module):
    """Pre-norm gated MLP: `down(hidden)`, `hidden = mlp_hidden(cfg, gate(x), up(x))`: SwiGLU
    `silu(gate) * up` for dense llama and svd, CoLA's `gate * up` for cola/lax (σ in the latents).
    Low-rank unless `ModelConfig.group_low_rank("mlp")` keeps it dense."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, r, std = cfg.d_model, cfg.d_ff, cfg.group_rank("mlp"), cfg.init_std
        self.cfg = cfg
        self.low_rank = cfg.group_low_rank("mlp")
        self.norm = _declared(jnp.ones((d,), jnp.float32), ("embed",))
        if self.low_rank:  # CoLA's init (`cola_std`) with the dense layers' (d_in, d_out)
            s_gu, s_down = cola_std(r, d, f), cola_std(r, f, d)
            self.a_gate_up = _param(rngs, (d, 2, r), s_gu, ("embed", "group", "rank"))
            self.b_gate_up = _param(rngs, (2, r, f), s_gu, ("group", "rank", "ff"))
            self.a_down = _param(rngs, (f, r), s_down, ("ff", "rank"))
            self.b_down = _param(rngs, (r, d), s_down, ("rank", "embed"))
            if cfg.kind == "lax":  # up <- gate, down <- up
                self.cross = _declared(jnp.zeros((2,), jnp.float32), ("cross",))
        else:
            ax_in, ax_out = _dense_axes(cfg, "ff")
            self.w_gate = _param(rngs, (d, f), std, ax_in)
            self.w_up = _param(rngs, (d, f), std, ax_in)
            self.w_down = _param(rngs, (f, d), std, ax_out)

    def __call__(self, x_btd, coll: Collectives) -> Float[Array, "b t d"]:
        cfg = self.cfg
        if self.low_rank:
            sigma = _sigma(cfg.kind)
            z_btgr = ops.online_norm_down(x_btd, self.norm[...], self.a_gate_up[...], coll,
                                          d_model=cfg.d_model, eps=cfg.norm_eps, name="gate_up_latent")
            hg, hu = sigma(z_btgr[:, :, 0]), sigma(z_btgr[:, :, 1])
            if cfg.kind == "lax":
                hu = hu + self.cross[...].astype(x_btd.dtype)[0] * hg
            gate, up = grouped_up((hg, hu), self.b_gate_up[...], coll)
        elif cfg.low_rank:  # dense in a low-rank model: row-parallel like an A (one collective), local columns
            zs = ops.online_norm_many(x_btd, self.norm[...], (self.w_gate[...], self.w_up[...]), coll,
                                      d_model=cfg.d_model, eps=cfg.norm_eps, name="gate_up_latent")
            gate, up = (coll.local_columns(z) for z in zs)
        else:
            xn_btd = coll.to_column_parallel(ops.rms_norm(x_btd, self.norm[...], cfg.norm_eps))
            gate = checkpoint_name(ops.matmul(xn_btd, self.w_gate[...]), "gate_up")
            up = checkpoint_name(ops.matmul(xn_btd, self.w_up[...]), "gate_up")
        hidden_btf = checkpoint_name(mlp_hidden(cfg, gate, up), "mlp_hidden")
        if self.low_rank:
            h_btr = _sigma(cfg.kind)(coll.reduce_latent(ops.matmul(hidden_btf, self.a_down[...]), name="down_latent"))
            if cfg.kind == "lax":
                h_btr = h_btr + self.cross[...].astype(x_btd.dtype)[1] * hu
            return coll.reduce_up(ops.matmul(h_btr, self.b_down[...]))
        if cfg.low_rank:
            return ops.matmul(coll.gather_columns(hidden_btf), self.w_down[...])
        return coll.reduce_row(ops.matmul(hidden_btf, self.w_down[...]))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_btd, cos_te, sin_te, coll: Collectives = LOCAL, segments_bt=None, *, cache=None):
        """`cache=(k_bske, v_bske, pos)`: decoding; returns `(y, (k_bske, v_bske))` (see `Attention`)."""
        if cache is not None:
            a_btd, cache = self.attn(x_btd, cos_te, sin_te, coll, cache=cache)
            h_btd = x_btd + a_btd
            return h_btd + self.mlp(h_btd, coll), cache
        x_btd = checkpoint_name(x_btd, "boundary")
        h_btd = checkpoint_name(x_btd + self.attn(x_btd, cos_te, sin_te, coll, segments_bt), "mid")
        return h_btd + self.mlp(h_btd, coll)


class LLaMA(nnx.Module):
    """Decoder-only LLaMA. `model(tokens)` gives logits; `model.loss(tokens, targets)` the mean CE.
    With `cfg.tie_embeddings` there is no `head` parameter: the logits use the embedding transposed.

    `segments` (int32 [b, t], optional, keyword): a document id per position; a token attends only to
    earlier tokens of its own document (packed documents, `--doc-mask`). Positions stay absolute."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std, ("embed_vocab", "embed"))
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = _declared(jnp.ones((cfg.d_model,), jnp.float32), ("features",))
        if not cfg.tie_embeddings:  # tied: the head is `embed` transposed (`logits`)
            self.head = _param(rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std, ("features", "vocab"))

    def features(self, tokens_bt: Int[Array, "b t"], coll: Collectives = LOCAL,
                 remat: str | Callable | None | RematSchedule = "none", *,
                 segments: Int[Array, "b t"] | None = None) -> Float[Array, "b t d"]:
        """Final-normed hidden states (full width, after the one BTP gather).

        `remat`: a name from `REMAT_POLICIES` or one policy for every block, or a per-layer schedule
        (a list or tuple): each entry is a policy or None (no remat) for one layer, a `TiedLayer`, or
        a `RematSegment` covering `len(inner)` consecutive layers; entries cover all layers in order."""
        cfg = self.cfg
        cos_te, sin_te = ops.model_rope_tables(cfg, tokens_bt.shape[1])
        x_btd = self.embed_tokens(tokens_bt)

        def run(blk, x, policy, tied=False, seg=segments):
            if policy is None:
                return blk(x, cos_te, sin_te, coll, seg)
            if isinstance(policy, TiedLayer):  # weight gradients before the next layer's backward; the RoPE
                block_def, state = nnx.split(blk)  # tables closed over (a cotangent's mesh-axis type could differ)
                fn = lambda s, y, sg: nnx.merge(block_def, s)(y, cos_te, sin_te, coll, sg)  # noqa: E731
                return tied_checkpoint(fn, policy.policy, tie_grads=True)(state, x, seg)
            if tied:  # the recomputation waits for this layer's cotangent (boostjax.models.remat)
                block_def, state = nnx.split(blk)
                fn = lambda s, y, c, si, sg: nnx.merge(block_def, s)(y, c, si, coll, sg)  # noqa: E731
                return tied_checkpoint(fn, policy)(state, x, cos_te, sin_te, seg)
            return nnx.remat(lambda b, y, sg: b(y, cos_te, sin_te, coll, sg), policy=policy)(blk, x, seg)

        def segment_fn(inner):
            def segment(blks, x, seg):
                x = checkpoint_name(x, "segment_boundary")
                for blk, pol in zip(blks, inner):
                    x = run(blk, x, pol, seg=seg)
                return x
            return segment

        if isinstance(remat, (list, tuple)):
            k = 0
            for entry in _check_schedule(remat, len(self.layers)):
                if isinstance(entry, RematSegment):
                    blks = nnx.List([self.layers[j] for j in range(k, k + len(entry.inner))])
                    x_btd = nnx.remat(segment_fn(entry.inner), policy=entry.policy)(blks, x_btd, segments)
                    k += len(entry.inner)
                else:
                    x_btd = run(self.layers[k], x_btd, entry)
                    k += 1
        else:
            policy = resolve_remat(remat)
            for layer in self.layers:
                x_btd = run(layer, x_btd, policy, tied=True)
        return self.final_norm(x_btd, coll)

    def features_cached(self, tokens_bt: Int[Array, "b t"], cache: kvcache.KVCache
                        ) -> tuple[Float[Array, "b t d"], kvcache.KVCache]:
        """`features` of `t` tokens at positions `cache.pos..cache.pos+t-1` that attend to the cached
        positions before them (decoding; one device, no remat); returns the advanced cache."""
        cfg, t = self.cfg, tokens_bt.shape[1]
        cos_se, sin_se = ops.model_rope_tables(cfg, cache.length)  # the full forward's tables (length <= max_seq_len)
        cos_te, sin_te = kvcache.positions(cos_se, cache.pos, t), kvcache.positions(sin_se, cache.pos, t)
        x_btd, layers = self.embed_tokens(tokens_bt), []
        for layer, (k_bske, v_bske) in zip(self.layers, cache.layers):
            x_btd, kv = layer(x_btd, cos_te, sin_te, cache=(k_bske, v_bske, cache.pos))
            layers.append(kv)
        return self.final_norm(x_btd), kvcache.KVCache(tuple(layers), cache.pos + t)

    # the pieces around the blocks, shared with the pipelined loss (`boostjax.sharding.pipeline`)
    def embed_tokens(self, tokens: Int[Array, "..."]) -> Float[Array, "... d"]:
        return ops.embed_lookup(self.embed[...], tokens)

    def final_norm(self, x_btd: Float[Array, "b t d"], coll: Collectives = LOCAL) -> Float[Array, "b t d"]:
        """Gather the residual stream (once, under BTP) and apply the final RMSNorm."""
        return ops.rms_norm(coll.gather_features(x_btd), self.norm[...], self.cfg.norm_eps)

    def logits(self, xn_btd: Float[Array, "b t d"]) -> Float[Array, "b t v"]:
        """fp32 logits, one 2-D GEMM (`ops.wide_matmul`); tied: against the embedding transposed."""
        w_dv = self.embed[...].T if self.cfg.tie_embeddings else self.head[...]
        return ops.wide_matmul(xn_btd, w_dv, preferred_element_type=jnp.float32)

    def __call__(self, tokens_bt: Int[Array, "b t"], coll: Collectives = LOCAL,
                 remat: str | Callable | None | RematSchedule = "none", *,
                 segments: Int[Array, "b t"] | None = None) -> Float[Array, "b t v"]:
        return self.logits(self.features(tokens_bt, coll, remat, segments=segments))

    def loss(self, tokens_bt: Int[Array, "b t"], targets_bt: Int[Array, "b t"],
             coll: Collectives = LOCAL, remat: str | Callable | None | RematSchedule = "none", *,
             segments: Int[Array, "b t"] | None = None) -> Float[Array, ""]:
        return vocab_parallel_cross_entropy(self(tokens_bt, coll, remat, segments=segments), targets_bt, coll)


class Projection(NamedTuple):
    """Where one dense projection of a block lives in the parameters of `LLaMA(cfg)`: block `blk`, the
    dense weight `dense` `[in, out]`, and when factorised its `a` `[in, r]` and `b` `[r, out]`, each a
    name and, in a grouped tensor, its index along the group axis (`a_qkv [d, 3, r]`: 1 of the
    second axis; `b_kv [2, r, ke]`: 0 of the first)."""

    blk: str
    dense: str
    group: str
    a: tuple[str, int | None] | None
    b: tuple[str, int | None] | None


def projections(cfg: ModelConfig) -> dict[str, Projection]:
    """Every projection of a block (q, k, v, o, gate, up, down) and where `LLaMA(cfg)` keeps it: the
    layout `Attention` and `MLP` create (`Projection.a` None = kept dense)."""
    grouped = cfg.group_low_rank("attn") and cfg.group_low_rank("kv") and cfg.group_rank("attn") == cfg.group_rank("kv")
    rows = {"q": ("attn", "w_q", "attn", ("a_qkv", 0) if grouped else ("a_q", None), ("b_q", None)),
            "k": ("attn", "w_k", "kv", ("a_qkv", 1) if grouped else ("a_kv", 0), ("b_kv", 0)),
            "v": ("attn", "w_v", "kv", ("a_qkv", 2) if grouped else ("a_kv", 1), ("b_kv", 1)),
            "o": ("attn", "w_o", "attn", ("a_o", None), ("b_o", None)),
            "gate": ("mlp", "w_gate", "mlp", ("a_gate_up", 0), ("b_gate_up", 0)),
            "up": ("mlp", "w_up", "mlp", ("a_gate_up", 1), ("b_gate_up", 1)),
            "down": ("mlp", "w_down", "mlp", ("a_down", None), ("b_down", None))}
    return {p: Projection(blk, w, g, *((a, b) if cfg.group_low_rank(g) else (None, None)))
            for p, (blk, w, g, a, b) in rows.items()}


def resolve_remat(remat: Any) -> Callable | None:
    """A remat name from `REMAT_POLICIES`, a `jax.checkpoint` policy callable, or None."""
    return REMAT_POLICIES[remat] if isinstance(remat, str) else remat


def _check_schedule(schedule: RematSchedule, n_layers: int) -> RematSchedule:
    """Raise ValueError unless the per-layer schedule covers exactly `n_layers` layers."""
    n = sum(len(e.inner) if isinstance(e, RematSegment) else 1 for e in schedule)
    if n != n_layers:
        raise ValueError(f"remat: the schedule covers {n} layers but the model has {n_layers}; "
                         "fix: one entry per layer (a RematSegment counts len(inner) layers)")
    return schedule


def init_model(cfg: Config) -> tuple[Any, dict]:
    """(graphdef, fp32 parameter dict) of a freshly initialised model."""
    model = LLaMA(cfg.model, rngs=nnx.Rngs(params=cfg.train.seed))
    graphdef, state = nnx.split(model)
    return graphdef, state.to_pure_dict()


def abstract_model(cfg: Config) -> tuple[Any, dict]:
    """(graphdef, parameter shapes) of the model, without allocating it."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LLaMA(cfg.model, rngs=nnx.Rngs(params=cfg.train.seed))))
    return graphdef, state.to_pure_dict()


# ----------------------------------------------------------------------------- parameter facts


@functools.lru_cache(maxsize=256)
def _one_layer(cfg: ModelConfig) -> tuple[tuple[tuple[str | int, ...], tuple[int, ...], tuple[str, ...]], ...]:
    """(path, shape, declared logical axes) of every parameter of `LLaMA(cfg)`, `cfg` a one-layer
    model, read from an abstract model (`nnx.eval_shape`: nothing is allocated)."""
    model = nnx.eval_shape(lambda: LLaMA(cfg, rngs=nnx.Rngs(params=0)))
    return tuple((tuple(path), tuple(var.shape), tuple(var.get_metadata().get("out_sharding") or ()))
                 for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)))


@functools.lru_cache(maxsize=256)
def _param_facts(cfg: ModelConfig, block: bool) -> tuple[Mapping[str, tuple[int, ...]], Mapping[str, tuple[str, ...]]]:
    """(shapes, logical axes) by dotted path: of the whole model, or (`block`) of one block with paths
    inside it. `LLaMA` builds `n_layers` identical `Block`s, so the model is traced with one layer
    (a few ms at any size) and that layer's entries stand for every layer."""
    entries = _one_layer(dataclasses.replace(cfg, n_layers=1))
    first = next((k for k, e in enumerate(entries) if e[0][0] == "layers"), len(entries))
    layer = [(path[2:], shape, ax) for path, shape, ax in entries if path[0] == "layers"]
    if block:
        named = layer
    else:  # in the model's order, the one layer's place taken by all of them
        top = [e for e in entries if e[0][0] != "layers"]
        named = top[:first] + [(("layers", i, *sub), shape, ax) for i in range(cfg.n_layers)
                               for sub, shape, ax in layer] + top[first:]
    shapes = {".".join(map(str, path)): shape for path, shape, _ in named}
    axes = {".".join(map(str, path)): ax for path, _, ax in named}
    return MappingProxyType(shapes), MappingProxyType(axes)


def param_shapes(cfg: ModelConfig, *, block: bool = False) -> Mapping[str, tuple[int, ...]]:
    """THE parameter shapes: every parameter of `LLaMA(cfg)` by dotted path (`embed`,
    `layers.0.attn.a_qkv`, ..., `norm`, and `head` unless `tie_embeddings`) -> its shape; with
    `block=True` one block's, by path inside it (`attn.a_qkv`, `mlp.norm`, ...). Read from the
    model itself (an abstract `nnx.eval_shape`, cached per config: no array is allocated), so parameter
    counts, FLOPs, the offload cost model and the Hugging Face layouts cannot drift from it."""
    return _param_facts(cfg, block)[0]


def param_axes(cfg: ModelConfig, *, block: bool = False) -> Mapping[str, tuple[str, ...]]:
    """The logical axes (`AXES`) each parameter declares, keyed like `param_shapes` (empty for a
    parameter that declares none)."""
    return _param_facts(cfg, block)[1]
