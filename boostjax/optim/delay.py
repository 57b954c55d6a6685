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
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Int


class DelayState(NamedTuple):
    """`history`: params-shaped tree, leaf `[τ+1, *shape]` ring buffer; `step`: versions pushed so far."""

    history: Any
    step: Int[Array, ""]


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


def assign_stages(params: Any, n_layers: int, n_stages: int) -> Any:
    """Pytree of stage ids (python ints) shaped like `params`.

    Layer `i` (a path entry "layers" followed by the index) goes to stage `i // (n_layers / n_stages)`;
    outside the layers, paths whose top key contains "embed" go to stage 0, everything else (final
    norm, LM head) to stage `n_stages - 1`.
    """
    if n_stages < 1 or n_layers < 1:
        raise ValueError(f"assign_stages: n_layers={n_layers}, n_stages={n_stages} must be >= 1")
    if n_layers % n_stages:
        raise ValueError(f"assign_stages: n_layers={n_layers} is not divisible by n_stages={n_stages}; "
                         "fix: choose a stage count that divides the layer count")
    per_stage = n_layers // n_stages

    def stage(path: tuple, _: Any) -> int:
        idx = _layer_index(path)
        if idx is not None:
            if not 0 <= idx < n_layers:
                raise ValueError(f"assign_stages: layer index {idx} at {jax.tree_util.keystr(path)} is outside "
                                 f"[0, {n_layers}); fix: pass the model's real n_layers")
            return idx // per_stage
        top = str(_entry_name(path[0])).lower() if path else ""
        return 0 if "embed" in top else n_stages - 1

    return jax.tree_util.tree_map_with_path(stage, params)


def stage_delays(stages_tree: Any, n_stages: int) -> Any:
    """τ = n_stages - 1 - stage for every leaf (python ints)."""
    def delay(s: Any) -> int:
        s = int(s)
        if not 0 <= s < n_stages:
            raise ValueError(f"stage_delays: stage {s} outside [0, {n_stages}); fix: build stages with the same n_stages")
        return n_stages - 1 - s
    return jax.tree.map(delay, stages_tree)


def delay_init(params: Any, stages_tree: Any, n_stages: int) -> DelayState:
    """Every leaf's ring buffer filled with `θ_0` (depth τ+1 from its stage)."""
    delays = stage_delays(stages_tree, n_stages)
    history = jax.tree.map(lambda p, d: jnp.repeat(jnp.asarray(p)[None], d + 1, axis=0), params, delays)
    return DelayState(history=history, step=jnp.zeros([], jnp.int32))


def delayed_params(state: DelayState) -> Any:
    """The mixed vector: each leaf at version `max(step - τ, 0)` with τ = its buffer depth - 1."""
    def pick(h: Array) -> Array:
        depth = h.shape[0]
        version = jnp.maximum(state.step - (depth - 1), 0)
        return jax.lax.dynamic_index_in_dim(h, version % depth, axis=0, keepdims=False)
    return jax.tree.map(pick, state.history)


def delay_push(state: DelayState, new_params: Any) -> DelayState:
    """Record `θ_{step+1}`: it overwrites the oldest slot of every ring buffer."""
    step = state.step + 1

    def push(h: Array, p: Array) -> Array:
        return jax.lax.dynamic_update_index_in_dim(h, jnp.asarray(p, h.dtype), step % h.shape[0], axis=0)

    return DelayState(history=jax.tree.map(push, state.history, new_params), step=step)


def delayed_train_step(
    loss_fn: Callable[[Any, Any], Array], optimizer: optax.GradientTransformation
) -> Callable[[Any, Any, DelayState, Any], tuple[Any, Any, DelayState, Array]]:
    """A pure step `(params, opt_state, delay_state, batch) -> (params, opt_state, delay_state, loss)`.

    The gradient (and the returned loss) is taken at `delayed_params(delay_state)`; the update is
    applied to `params`, which must be the newest version in `delay_state` (as after `delay_init`
    with the same params). Wrap it in `jax.jit` (donating the states is safe).
    """
    def step(params: Any, opt_state: Any, delay_state: DelayState, batch: Any):
        loss, grads = jax.value_and_grad(loss_fn)(delayed_params(delay_state), batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, delay_push(delay_state, params), loss

    return step
