"""Per-layer rematerialisation whose recomputation cannot run ahead of the backward.

`jax.checkpoint` marks what the backward recomputes, but the recomputation depends only on the
forward's saved values, so the compiler may schedule it anywhere: XLA's CPU scheduler runs the
recomputed forward of every layer before the first layer's backward, so all layers' attention
scores (`[b, h, t, t]`) are live at once and the peak grows with depth (7B, TP4, seq 4096,
`--remat lowrank`: ~6 GiB per layer). `tied_checkpoint` gives the same values and gradients with
one extra data dependence: the saved values get `0·g` of the layer's output cotangent `g` added
(a zero XLA cannot fold away), so a layer is recomputed only once the backward reaches it.

`tie_grads=True` adds the mirror-image dependence on the way out: the layer's input cotangent leaves
its backward only together with its parameter gradients (one `optimization_barrier`), so the next layer's
backward starts only once this layer's weight gradients exist. Without it, XLA's GPU scheduler, when
the step also moves host-resident state in and out, put each layer's weight gradients several layers
later and kept every layer's recomputed activations live (docs/gpu-program.md).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def _zero_of(g: Any) -> jax.Array:
    """An fp32 zero that XLA cannot compute before `g` exists (0·g[0], and 0 where that is NaN)."""
    leaf = jax.tree.leaves(g)[0]
    m = leaf.reshape(-1)[0].astype(jnp.float32) * 0.0
    return jnp.where(jnp.isnan(m), 0.0, m)


def tied_checkpoint(fn: Callable[..., Any], policy: Callable | None, *, tie_grads: bool = False) -> Callable[..., Any]:
    """`jax.checkpoint(fn, policy=policy)` with its recomputation tied to the output cotangent.

    `fn(*args)` takes and returns pytrees of arrays; every argument is differentiable. Forward:
    `jax.vjp` of the checkpointed `fn` (the policy decides what is saved). Backward: the saved
    values are made to depend on the cotangent (`_zero_of`), then the saved `vjp` runs; with
    `tie_grads` its floating-point gradients leave through one `optimization_barrier`, all together.
    """
    ck = jax.checkpoint(fn, policy=policy)

    @jax.custom_vjp
    def tied(*args):
        return ck(*args)

    def fwd(*args):
        return jax.vjp(ck, *args)

    def bwd(vjp_fn, g):
        saved, tree = jax.tree.flatten(vjp_fn)
        zero = _zero_of(g)
        saved = [s + zero.astype(s.dtype) if jnp.issubdtype(s.dtype, jnp.floating) else s for s in saved]
        grads = jax.tree.unflatten(tree, saved)(g)
        return _released_together(grads) if tie_grads else grads

    tied.defvjp(fwd, bwd)
    return tied


def _released_together(grads: Any) -> Any:
    """`grads` with its floating-point leaves passed through an `optimization_barrier` (integer inputs'
    `float0` cotangents pass by), so none is available before all are computed. Under `shard_map` one
    barrier per set of varying mesh axes: a barrier gives all its operands the union of their axes, and
    a cotangent must keep its input's type (a replicated input's cotangent stays replicated)."""
    leaves, tree = jax.tree.flatten(grads)
    groups: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            groups.setdefault(getattr(jax.typeof(x), "vma", frozenset()), []).append(i)
    for idx in groups.values():
        for i, x in zip(idx, jax.lax.optimization_barrier([leaves[i] for i in idx])):
            leaves[i] = x
    return jax.tree.unflatten(tree, leaves)
