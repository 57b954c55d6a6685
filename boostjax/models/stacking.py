"""The two layouts of a model's parameters: canonical per-layer (`layers: {0: Block, 1: Block, ...}`,
what `TrainResult`, checkpoints read back, and `export-hf` see) and stacked (`layers` one Block tree
whose leaves carry a leading layer axis `[L, ...]`, what a pipeline trains and shards over `stage`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def is_stacked(params: Any) -> bool:
    """Whether `params["layers"]` is one stacked Block tree (not `{0: Block, 1: Block, ...}`)."""
    layers = params.get("layers") if isinstance(params, dict) else None
    return isinstance(layers, dict) and "attn" in layers


def stack_layers(params: dict) -> dict:
    """Canonical per-layer params -> one Block tree with a leading layer axis `[L, ...]`."""
    layers = params["layers"]
    blocks = [layers[i] for i in sorted(layers, key=int)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    return {**params, "layers": stacked}


def unstack_layers(params: dict) -> dict:
    """The inverse of `stack_layers` (canonical params unchanged)."""
    if not is_stacked(params):
        return params
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    return {**params, "layers": {i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)}}
