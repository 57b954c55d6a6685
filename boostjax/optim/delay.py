"""One-process emulation of asynchronous pipeline delays with weight stashing (PipeDream-style).

S stages, contiguous layer groups; stage s (0 = input side) computes its gradient on weights that are
`τ_s = S - 1 - s` updates old. With weight stashing, forward and backward of one micro-batch use the
same stashed version, so the gradient of micro-batch t is the gradient of the loss at the *mixed*
parameter vector in which every stage j holds its version `θ_{t - τ_j}`. The emulation computes that
gradient once and applies it (for all stages) to the current weights `θ_t`.

Before enough history exists (`t < τ_j`) stage j uses the oldest version there is, `θ_0` (the
pipeline fill phase: a stage that has seen no update yet computes on the initial weights).

Storage: each leaf keeps a ring buffer of its last `τ + 1` versions (leading axis `τ + 1`), so the
delay of a leaf is encoded in its buffer depth and the last stage stores a single copy. Version `u`
of a leaf with depth D sits in slot `u mod D`. A "no stashing" variant is not implemented.

Stacked layers (a pipeline's `layers` as one Block tree with leaves `[L, ...]`): such a leaf's stage
is a tuple of per-layer stages; its ring is `max τ + 1` deep and `DelayState.lags` holds its
per-layer delays (`int32[L]`), so layer l reads version `max(step - τ_l, 0)` of its own row.
PipeDream-2BW (`schedule="2bw"`, https://arxiv.org/abs/2006.09503): every stage computes on the
weights one update old whatever S (`θ_{t+1} = θ_t - η·u(∇f(θ_{t-1}))`), so every ring holds 2 versions;
S = 1 stays synchronous. Paper (delays and weight stashing): https://arxiv.org/abs/2602.03515.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from boostjax.config import DELAY_SCHEDULES


class DelayState(NamedTuple):
    """`history`: params-shaped tree, leaf `[τ+1, *shape]` ring buffer; `step`: versions pushed so far;
    `lags`: None, or (stacked layers) a params-shaped tree with `int32[L]` per-layer delays at the
    stacked leaves and None elsewhere."""

    history: Any
    step: Int[Array, ""]
    lags: Any = None


def _entry_name(entry: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return str(entry)


def _layer_index(path: tuple) -> int | None:
    names = [_entry_name(e) for e in path]
    for a, b in zip(names, names[1:]):
        if a == "layers":
            if isinstance(b, int) and not isinstance(b, bool):
                return b
            if isinstance(b, str) and b.isdigit():
                return int(b)
    return None


def _is_int_key(name: Any) -> bool:
    return (isinstance(name, int) and not isinstance(name, bool)) or (isinstance(name, str) and name.isdigit())


def _stacked(path: tuple) -> bool:
    """A leaf of stacked layers: "layers" followed by a non-index key (or "layers" is the leaf)."""
    names = [_entry_name(e) for e in path]
    for i, a in enumerate(names):
        if a == "layers":
            return i + 1 == len(names) or not _is_int_key(names[i + 1])
    return False


def assign_stages(params: Any, n_layers: int, n_stages: int) -> Any:
    """Pytree of stage ids (python ints) shaped like `params`.

    Layer `i` (a path entry "layers" followed by the index) goes to stage `i // (n_layers / n_stages)`;
    outside the layers, paths whose top key contains "embed" go to stage 0, everything else (final
    norm, LM head) to stage `n_stages - 1`. A stacked leaf (under "layers" without an index, axis 0
    = the layer, as a pipeline keeps them) gets the tuple of its L layers' stages.
    """
    if n_stages < 1 or n_layers < 1:
        raise ValueError(f"assign_stages: n_layers={n_layers}, n_stages={n_stages} must be >= 1")
    if n_layers % n_stages:
        raise ValueError(f"assign_stages: n_layers={n_layers} is not divisible by n_stages={n_stages}; "
                         "fix: choose a stage count that divides the layer count")
    per_stage = n_layers // n_stages

    def stage(path: tuple, leaf: Any) -> Any:
        idx = _layer_index(path)
        if idx is not None:
            if not 0 <= idx < n_layers:
                raise ValueError(f"assign_stages: layer index {idx} at {jax.tree_util.keystr(path)} is outside "
                                 f"[0, {n_layers}); fix: pass the model's real n_layers")
            return idx // per_stage
        if _stacked(path):
            shape = tuple(getattr(leaf, "shape", None) or np.shape(leaf))
            if not shape or shape[0] != n_layers:
                raise ValueError(f"assign_stages: stacked layer leaf {jax.tree_util.keystr(path)} has shape {shape}; "
                                 f"fix: stacked layers need axis 0 of size n_layers={n_layers}")
            return tuple(i // per_stage for i in range(n_layers))
        top = str(_entry_name(path[0])).lower() if path else ""
        return 0 if "embed" in top else n_stages - 1

    return jax.tree_util.tree_map_with_path(stage, params)


def stage_delays(stages_tree: Any, n_stages: int, schedule: str = "pipedream") -> Any:
    """Every leaf's delay τ (python ints; a tuple of them for a stacked leaf): `n_stages - 1 - stage`
    (pipedream), or `min(1, n_stages - 1)` for every stage (2bw: PipeDream-2BW's one-step delay)."""
    if schedule not in DELAY_SCHEDULES:
        raise ValueError(f"stage_delays: schedule {schedule!r}; fix: one of {', '.join(DELAY_SCHEDULES)}")

    def delay(s: Any) -> int:
        s = int(s)
        if not 0 <= s < n_stages:
            raise ValueError(f"stage_delays: stage {s} outside [0, {n_stages}); fix: build stages with the same n_stages")
        return min(1, n_stages - 1) if schedule == "2bw" else n_stages - 1 - s
    return jax.tree.map(delay, stages_tree)


def delay_init(params: Any, stages_tree: Any, n_stages: int, schedule: str = "pipedream") -> DelayState:
    """Every leaf's ring buffer filled with `θ_0` (depth τ+1 from its stage and `schedule`, max τ + 1
    when stacked)."""
    treedef = jax.tree.structure(params)
    delays = treedef.flatten_up_to(stage_delays(stages_tree, n_stages, schedule))
    depth = [max(d) + 1 if isinstance(d, tuple) else d + 1 for d in delays]
    history = treedef.unflatten([jnp.repeat(jnp.asarray(p)[None], k, axis=0)
                                 for p, k in zip(jax.tree.leaves(params), depth)])
    lags = None
    if any(isinstance(d, tuple) for d in delays):
        for p, d in zip(jax.tree.leaves(params), delays):
            if isinstance(d, tuple) and (jnp.ndim(p) < 1 or jnp.shape(p)[0] != len(d)):
                raise ValueError(f"delay_init: {len(d)} per-layer stages for a leaf of shape {jnp.shape(p)}; "
                                 "fix: a stacked leaf needs one stage per index of axis 0")
        lags = treedef.unflatten([jnp.asarray(d, jnp.int32) if isinstance(d, tuple) else None for d in delays])
    return DelayState(history=history, step=jnp.zeros([], jnp.int32), lags=lags)


def delayed_params(state: DelayState) -> Any:
    """The mixed vector: each leaf at version `max(step - τ, 0)` with τ = its buffer depth - 1 (per
    layer, from `state.lags`, for a stacked leaf)."""
    def pick(h: Array, lag: Array | None = None) -> Array:
        depth = h.shape[0]
        if lag is None:
            version = jnp.maximum(state.step - (depth - 1), 0)
            return jax.lax.dynamic_index_in_dim(h, version % depth, axis=0, keepdims=False)
        slot_l = jnp.maximum(state.step - lag, 0) % depth
        return h[slot_l, jnp.arange(h.shape[1])]

    if state.lags is None:
        return jax.tree.map(pick, state.history)
    return jax.tree.map(pick, state.history, state.lags)


def delay_push(state: DelayState, new_params: Any) -> DelayState:
    """Record `θ_{step+1}`: it overwrites the oldest slot of every ring buffer."""
    step = state.step + 1

    def push(h: Array, p: Array) -> Array:
        return jax.lax.dynamic_update_index_in_dim(h, jnp.asarray(p, h.dtype), step % h.shape[0], axis=0)

    return DelayState(history=jax.tree.map(push, state.history, new_params), step=step, lags=state.lags)
