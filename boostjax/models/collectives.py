"""Where a tensor-parallel strategy puts its collectives.

The LLaMA block (`boostjax.models.llama`) is written once. It calls the hooks below at the three
places a TP strategy may need a collective; `psum_at` names the one a strategy uses:

- `"latent"` after every low-rank down-projection `A` (d -> r): BTP's psum of `[b, t, r]`, carrying
             the Online-RMSNorm sum of squares in the same collective; the residual stream is then
             sharded along d (`features_sharded`), gathered once before the LM head;
- `"up"`     after every low-rank up-projection `B` (r -> d_out): vanilla low-rank TP;
- `"row"`    after the row-parallel dense projections `o` and `down`: Megatron full-rank TP;
- `"none"`   no psum in the block (one device, or no TP).

Which parameters a strategy shards is not here: `boostjax.sharding.rules` maps the logical axes the
model declares to mesh axes.

On one device (`LOCAL`) every hook is the identity, so the same code is the single-device
reference. Outputs of the hooks are tagged with `checkpoint_name`, so remat policies can save
exactly what crossed a collective and recompute the rest without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from boostjax.models import stat_parts


PsumAt = Literal["none", "latent", "up", "row"]
PSUM_AT: tuple[str, ...] = get_args(PsumAt)


@dataclass(frozen=True)
class Collectives:
    axis: str | None = None  # the tensor-parallel mesh axis inside shard_map; None on one device
    psum_at: PsumAt = "none"  # where the block's psum sits (module docstring)

    def __post_init__(self):
        if self.psum_at not in PSUM_AT:
            raise ValueError(f"Collectives.psum_at: {self.psum_at!r}; fix: use one of {', '.join(PSUM_AT)}")

    @property
    def features_sharded(self) -> bool:
        """The residual stream is sharded along d (BTP: a psum of the latents implies a d-split input)."""
        return self.psum_at == "latent"

    def _psum(self, at: PsumAt, *xs):
        if self.psum_at == at and self.axis is not None:
            return jax.lax.psum(xs, self.axis)
        return xs

    def reduce_latent(self, z, ss=None, *, name: str):
        """Sum partial down-projections and the norm's Σx² (`[..., 1]`, fp32) in one collective.

        `z` (flattened per token) and `ss` are concatenated into one buffer, summed by one all-reduce
        and split: one collective on every backend. fp32 latents carry `ss` as it is; bf16 latents
        carry it as a few bf16 parts on an absolute grid that any bf16 all-reduce adds exactly
        (`boostjax.models.stat_parts`: the statistic to 2⁻¹² relative, the latents not widened).
        Other dtypes: `psum((z, ss))`, one all-reduce per element type.
        """
        if ss is None:
            (z,) = self._psum("latent", z)
            return checkpoint_name(z, name)
        (z,), ss = self.reduce_latents((z,), ss, name=name)
        return z, ss

    def reduce_latents(self, zs, ss, *, name: str):
        """`reduce_latent` of several partial down-projections of one normed input (`zs`: arrays
        `[..., *]` of one leading shape, e.g. a block's low-rank latents and the outputs of the
        projections that stay dense) and their common Σx²: still one collective under BTP, the
        buffers flattened per token and concatenated. Returns `(zs, ss)`, each tagged `name`."""
        zs = tuple(zs)
        dts = {z.dtype for z in zs}
        if self.psum_at == "latent" and self.axis is not None and dts in ({ss.dtype}, {jnp.dtype(jnp.bfloat16)}):
            narrow = ss.dtype not in dts  # bf16 latents: the fp32 statistic as exact bf16 parts
            lead = ss.shape[:-1]
            flat = [z.reshape(*lead, -1) for z in zs]
            stat = stat_parts.split(ss, jax.lax.axis_size(self.axis)) if narrow else ss
            both = jax.lax.psum(jnp.concatenate([*flat, stat], axis=-1), self.axis)
            cuts = [sum(f.shape[-1] for f in flat[:k]) for k in range(1, len(flat) + 1)]
            parts = jnp.split(both, cuts, axis=-1)
            zs = tuple(p.reshape(z.shape) for p, z in zip(parts, zs))
            ss = stat_parts.join(parts[-1]) if narrow else parts[-1]
        else:
            *zs, ss = self._psum("latent", *zs, ss)
        return tuple(checkpoint_name(z, name) for z in zs), checkpoint_name(ss, name + "_stats")

    def reduce_up(self, y):
        (y,) = self._psum("up", y)
        return y

    def to_column_parallel(self, x):
        """Megatron TP: mark the replicated normed input varying once, before the column-parallel
        GEMMs (q, k, v / gate, up) use it, so the backward sums their input gradients in one
        all-reduce instead of one per GEMM."""
        if self.psum_at == "row" and self.axis is not None:
            return jax.lax.pcast(x, self.axis, to="varying")
        return x

    def reduce_row(self, y):
        (y,) = self._psum("row", y)
        return y

    def local_columns(self, y):
        """BTP: this device's contiguous `1/TP` slice of the last axis of a replicated `y` (a projection
        kept dense in a low-rank model: its psum'd output, cut to the local heads or d_ff columns)."""
        if self.features_sharded and self.axis is not None:
            n = y.shape[-1] // jax.lax.axis_size(self.axis)
            return jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index(self.axis) * n, n, axis=y.ndim - 1)
        return y

    def gather_columns(self, x):
        """BTP: the full last axis of a column-sharded `x` (the local heads or d_ff columns), the input
        of a dense `o` or `down` kept in a low-rank model, whose columns are this device's `d/TP`."""
        if self.features_sharded and self.axis is not None:
            return jax.lax.all_gather(x, self.axis, axis=x.ndim - 1, tiled=True)
        return x

    def gather_features(self, x_btd):
        """Gather the d-sharded residual stream once, before the LM head."""
        if self.features_sharded and self.axis is not None:
            return jax.lax.all_gather(x_btd, self.axis, axis=x_btd.ndim - 1, tiled=True)
        return x_btd

    # -- vocabulary-parallel cross-entropy --------------------------------------------------------
    def vocab_offset(self, v_local: int):
        if self.axis is None:
            return 0
        return jax.lax.axis_index(self.axis) * v_local

    def vocab_max(self, x):
        return jax.lax.pmax(x, self.axis) if self.axis is not None else x

    def vocab_sum(self, x):
        return jax.lax.psum(x, self.axis) if self.axis is not None else x


LOCAL = Collectives()


def vocab_parallel_cross_entropy(logits_btv, targets_bt, coll: Collectives = LOCAL):
    """Mean token cross-entropy when each device holds a slice of the vocabulary.

    No device ever materialises the full `[b, t, vocab]` logits: max, log-sum-exp and the target
    logit are each reduced over the model axis as `[b, t]` tensors.
    """
    logits_btv = logits_btv.astype(jnp.float32)
    v_local = logits_btv.shape[-1]
    m_bt = coll.vocab_max(jax.lax.stop_gradient(jnp.max(logits_btv, axis=-1)))
    sumexp_bt = coll.vocab_sum(jnp.sum(jnp.exp(logits_btv - m_bt[..., None]), axis=-1))
    lse_bt = jnp.log(sumexp_bt) + m_bt
    local_t = targets_bt - coll.vocab_offset(v_local)
    mine = (local_t >= 0) & (local_t < v_local)
    picked = jnp.take_along_axis(logits_btv, jnp.clip(local_t, 0, v_local - 1)[..., None], axis=-1)[..., 0]
    target_bt = coll.vocab_sum(jnp.where(mine, picked, 0.0))
    return jnp.mean(lse_bt - target_bt)
