"""The default training optimizer: AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import optax

from boostjax.config import TrainConfig


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    """Linear warmup to `lr`, then cosine decay to `min_lr_ratio · lr` at the last step."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if t.warmup else t.lr,
        peak_value=t.lr,
        warmup_steps=t.warmup,
        decay_steps=t.steps,
        end_value=t.lr * t.min_lr_ratio,
    )


def decay_mask(params):
    """Weight decay on matrices only (not on norm scales or LaX gates)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def adamw(t: TrainConfig) -> optax.GradientTransformation:
    parts = [optax.clip_by_global_norm(t.clip)] if t.clip > 0 else []
    parts.append(
        optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=1e-8, weight_decay=t.weight_decay, mask=decay_mask)
    )
    return optax.chain(*parts)
