"""What one layer keeps for its backward per micro-batch: the bytes a pipeline tick stores.

A pipeline stage keeps its layers' `jax.vjp` residuals for every micro-batch in flight: 1F1B in an
explicit ring (`sharding.pipeline_1f1b`), GPipe as the stacked outputs of its scan's autodiff. Those
residuals are materialised buffers, whole, where the step of one micro-batch without stages lets XLA
fuse and free some of them (its per-layer activation, the 2- minus 1-layer compile, is smaller).
`layer_residual_bytes` traces the residuals of one Block, on one device of the key's `model` axis,
under its strategy's collectives and remat policy, without compiling (`jax.eval_shape`).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from boostjax.models import ops
from boostjax.models.llama import LLaMA, Block, abstract_model, resolve_remat
from boostjax.models.ops import cast_params
from boostjax.sharding import rules
from boostjax.sharding.mesh import make_mesh
from boostjax.sharding.rules import STRATEGIES


def _nbytes(x: Any) -> int:
    return int(x.size) * jnp.dtype(x.dtype).itemsize


@functools.lru_cache(maxsize=256)
def layer_residual_bytes(key: Any) -> int:
    """Bytes per device of one layer's vjp residuals for one micro-batch of `key` (a
    `planning.measure.Key`), less the layer's weights and the rope tables (what every tick shares)."""
    cfg = key.config(1, key.memory_attention)
    mcfg, strategy = cfg.model, cfg.train.strategy
    mesh = make_mesh(cfg.train.mesh) if key.tp > 1 else None
    coll = STRATEGIES[strategy if key.tp > 1 else "none"].collectives
    top_def, _ = nnx.split(nnx.eval_shape(lambda: LLaMA(replace(mcfg, n_layers=0), rngs=nnx.Rngs(0))))
    block_def, _ = nnx.split(nnx.eval_shape(lambda: Block(mcfg, rngs=nnx.Rngs(0))))
    policy = resolve_remat(cfg.train.remat)
    found: list[int] = []

    def local(params, tokens_bt):
        params = cast_params(params, cfg.train.dtype)
        layer = params["layers"][0]
        x_btd = nnx.merge(top_def, {k: v for k, v in params.items() if k != "layers"}).embed_tokens(tokens_bt)
        cos_te, sin_te = ops.model_rope_tables(mcfg, tokens_bt.shape[1])

        def block(p, x):
            return nnx.merge(block_def, p)(x, cos_te, sin_te, coll)

        fn = block if policy is None else jax.checkpoint(block, policy=policy)
        y_btd, vjp = jax.vjp(fn, layer, x_btd)
        shared = {id(v) for v in (*jax.tree.leaves(layer), cos_te, sin_te)}
        kept = {id(r): r for r in jax.tree.leaves(vjp) if id(r) not in shared and isinstance(r, jax.core.Tracer)}
        found.append(sum(_nbytes(r) for r in kept.values()))  # each buffer once, however often it is read
        return jnp.zeros((), jnp.float32)

    _, params = abstract_model(cfg)
    tokens = jax.ShapeDtypeStruct((key.micro_batch, key.seq), jnp.int32)
    if mesh is None:
        jax.eval_shape(local, params, tokens)
    else:
        specs = rules.param_specs(strategy, rules.logical_axes(mcfg))
        run = jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False)
        jax.eval_shape(run, params, tokens)
    return found[0]


__all__ = ["layer_residual_bytes"]
