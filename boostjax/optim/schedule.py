"""The learning-rate schedule shared by every optimizer: linear warmup, then cosine decay."""

from __future__ import annotations

import optax

from boostjax.config import TrainConfig, warmup_steps


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    """Linear warmup to `lr`, then cosine decay to `min_lr_ratio · lr` at the last step."""
    warmup = warmup_steps(t)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else t.lr,
        peak_value=t.lr,
        warmup_steps=warmup,
        decay_steps=t.steps,
        end_value=t.lr * t.min_lr_ratio,
    )
