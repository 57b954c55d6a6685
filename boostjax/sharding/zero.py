"""ZeRO's gradient (https://arxiv.org/abs/1910.02054): each data shard differentiates its own rows,
and the sum over `data` is reduce-scattered onto the shards that keep the leaf's optimizer state
(`jax.lax.psum_scatter`) instead of all-reduced and sliced: half the bytes an all-reduce moves, and
no device holds the whole reduced gradient. A leaf no dimension of which divides by `data`
(`rules.data_sharded` left it whole) stays all-reduced.

`zero_value_and_grad` is the step's `(loss, grads)` for a loss written per device inside
`shard_map` (`local(params, *rows)`: the mean over one data shard's rows, already reduced over
the other mesh axes); `reduced_value_and_grad` the same for a per-device `(loss, grads)` (a
pipeline schedule that sums its gradients itself, 1F1B). With ZeRO-3 (`gather`) the parameters enter split over `data` and are
all-gathered inside, before the gradient is taken. Gradient accumulation sums the micro-batches'
unreduced fp32 gradients on each device and reduces once.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from boostjax.config import DATA


def micro_batches(batch: Any, n: int, sharding: Any = None) -> Any:
    """A step's batch `[B·N, ...]` as N micro-batches `[N, B, ...]`: row `b·N + i` is row `b` of
    micro-batch `i`, so each data shard's contiguous rows stay on it (with `sharding` =
    `P(None, "data")` the split moves no data between devices; inside `shard_map`, one shard's rows
    split the same way give its share of every micro-batch)."""
    def split(x):
        x_nb = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
        return x_nb if sharding is None else jax.lax.with_sharding_constraint(x_nb, sharding)

    return jax.tree.map(split, batch)


def data_dim(spec: P) -> int | None:
    """The dimension `spec` splits over `data` (None: none)."""
    for i, s in enumerate(spec):
        if s == DATA or (isinstance(s, tuple) and DATA in s):
            return i
    return None


def with_data(spec: P, dim: int | None) -> P:
    """`spec` with dimension `dim` split over `data` (unchanged for None)."""
    if dim is None:
        return spec
    entries = list(spec) + [None] * (dim + 1 - len(spec))
    entries[dim] = DATA
    return P(*entries)


def vary(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`x` marked varying over `axes` (those it is not varying over already)."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def reduce_grad(g: jax.Array, dim: int | None) -> jax.Array:
    """One device's gradient summed over `data`: reduce-scattered along `dim`, or all-reduced."""
    if dim is None:
        return jax.lax.psum(g, DATA)
    return jax.lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True)


def _gather(p: jax.Array, dim: int | None) -> jax.Array:
    return p if dim is None else jax.lax.all_gather(p, DATA, axis=dim, tiled=True)


def loss_and_grad(local: Callable[..., jax.Array], data: int) -> Callable[..., tuple[jax.Array, Any]]:
    """`local_vg(params, *rows) -> (loss, grads)` for `reduced_value_and_grad` from a per-device loss
    `local` (the mean over one data shard's rows): d(pmean of the loss) / d(this shard's
    parameters), 1/D of the shard's own gradient."""
    def value_and_grad(params, *rows_arrays):
        loss, pullback = jax.vjp(lambda p: local(p, *rows_arrays), params)
        return loss, pullback(jnp.ones_like(loss) / data)[0]

    return value_and_grad


def reduced_value_and_grad(local_vg: Callable[..., tuple[jax.Array, Any]], mesh: Mesh, specs: Any, split: Any,
                           rows: P, *, gather: bool, accum: int = 1, cast: Callable[[Any], Any] = lambda p: p
                           ) -> Callable[..., tuple[jax.Array, Any]]:
    """`f(params, *rows_arrays) -> (loss, grads)`: the global batch's mean loss and its gradient, each
    leaf reduce-scattered over `data` along its ZeRO dimension in `split` (`data_dim`; none: all-reduced).

    `local_vg` runs per device in `shard_map`: its data shard's mean loss (reduced over the other axes),
    its unreduced gradient share (`loss_and_grad`, or a pipeline schedule's sums). `specs`: the params' specs
    without `data` (`gather`, ZeRO-3: split over `data` too). `accum` N: the rows hold N micro-batches,
    summed in fp32 before the one reduction. `cast`: to the compute dtype, before the gather (so the
    gradient crosses `data` in it); grads return in the parameters' dtype. No `data` axis: no reduction."""
    dp = DATA in mesh.axis_names
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    dims = jax.tree.map(lambda z: [data_dim(z) if dp else None], split, is_leaf=is_spec)  # [dim]: None stays a leaf
    inside = jax.tree.map(lambda s, d: with_data(s, d[0]), specs, dims, is_leaf=is_spec)

    def body(master, *rows_arrays):
        params = cast(master)
        if gather:
            params = jax.tree.map(lambda p, d: _gather(p, d[0]), params, dims)
        if dp:
            params = jax.tree.map(lambda p: vary(p, (DATA,)), params)

        if accum == 1:
            loss, grads = local_vg(params, *rows_arrays)
        else:
            def add(carry, mb):
                loss_sum, g_sum = carry
                loss, g = local_vg(params, *mb)
                return (loss_sum + loss.astype(jnp.float32),
                        jax.tree.map(lambda s, x: s + x.astype(jnp.float32), g_sum, g)), None

            mbs = micro_batches(rows_arrays, accum)
            # the sum starts at zeros varying over the mesh axes each gradient varies over (the scan's carry type)
            like = jax.eval_shape(lambda mb: local_vg(params, *mb), jax.tree.map(lambda x: x[0], mbs))
            start = jax.tree.map(lambda s: vary(jnp.zeros(s.shape, jnp.float32), tuple(s.manual_axis_type.varying)), like)
            (loss_sum, g_sum), _ = jax.lax.scan(add, start, mbs)
            loss, grads = loss_sum / accum, jax.tree.map(lambda s: s / accum, g_sum)
        if not dp:
            return loss, jax.tree.map(lambda g, m: g.astype(m.dtype), grads, master)
        grads = jax.tree.map(lambda g, d, m: reduce_grad(g, d[0]).astype(m.dtype), grads, dims, master)
        return jax.lax.pmean(loss, DATA), grads

    def value_and_grads(params, *rows_arrays):
        in_specs = (inside if gather else specs, *(rows for _ in rows_arrays))
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(), inside))(params, *rows_arrays)

    return value_and_grads


def zero_value_and_grad(local: Callable[..., jax.Array], mesh: Mesh, specs: Any, split: Any, rows: P, *,
                        gather: bool, accum: int = 1, cast: Callable[[Any], Any] = lambda p: p
                        ) -> Callable[..., tuple[jax.Array, Any]]:
    """`reduced_value_and_grad` of a per-device loss `local(params, *rows)` (`loss_and_grad`)."""
    return reduced_value_and_grad(loss_and_grad(local, mesh.shape.get(DATA, 1)), mesh, specs, split, rows,
                                  gather=gather, accum=accum, cast=cast)
