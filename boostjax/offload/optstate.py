"""One device's optimizer-state bytes as the planner prices them, read from the optimizer itself.

`optimizer_bytes(model, train)` runs `jax.eval_shape` of the `init` of the optimizer training builds on
the model's abstract parameters, in training's layout, and attributes each state leaf by its key path
(`per_layer`, `fixed`, `scalars`) and its shard on the mesh. Nothing here knows an optimizer's layout.
Detail: docs/offload.md ("How the state is attributed").
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import jax

from boostjax.config import Config, ConfigError, ModelConfig, TrainConfig, flag_of
from boostjax.models.llama import abstract_model
from boostjax.models.stacking import stack_layers
from boostjax.optim import build_optimizer, delay, state_specs
from boostjax.sharding import rules

# The TrainConfig fields (besides the model and the mesh) the optimizer state's shapes depend on, and so
# the flags `boostjax plan` takes to price it; a plan records the bytes themselves (`planned_for`), so a
# run whose state differs for any other reason is refused as well.
STATE_FIELDS: tuple[str, ...] = ("optimizer", "rot_source", "rot_geometry", "rot_max_dim")


@dataclass(frozen=True)
class OptimizerBytes:
    """Optimizer-state bytes on one device (docs/offload.md)."""

    name: str  # the optimizer (`TrainConfig.optimizer`)
    per_layer: int
    fixed: int
    scalars: int = 0


def _layer_leaf(path: tuple) -> bool:
    return any(getattr(k, "key", None) == "layers" for k in path)


def _local(leaf: Any, spec: Any, sizes: dict[str, int]) -> int:
    """Bytes of one device's shard of `leaf` laid out by the PartitionSpec `spec`."""
    split = 1
    for entry in tuple(spec):
        for axis in (entry if isinstance(entry, tuple) else (entry,)):
            split *= sizes.get(axis, 1) if axis is not None else 1
    nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
    return -(-nbytes // split)


@functools.lru_cache(maxsize=64)
def optimizer_bytes(model: ModelConfig, train: TrainConfig) -> OptimizerBytes:
    """The optimizer state of the run `model` x `train`, on one device of its mesh (docs/offload.md).
    Only the model's shapes, the mesh, the strategy and the optimizer fields matter."""
    sizes = train.sizes
    stacked = sizes.stage > 1
    # every block has the same shapes: a canonical tree of `pipeline_delay` blocks (the fewest the stage
    # assignment of the delay emulation accepts), or a pipeline's stacked tree of all n_layers
    n = model.n_layers if stacked else train.pipeline_delay
    block = replace(model, n_layers=1)
    _, one = abstract_model(Config(block))
    params = {**one, "layers": {i: one["layers"][0] for i in range(n)}}
    axes = rules.logical_axes(block)
    if stacked:
        params, axes = jax.eval_shape(stack_layers, params), rules.stack_axes(axes)
    t = replace(train, offload_plan="")
    try:
        tx = build_optimizer(t, params, rotation_mask=rules.rotation_mask(axes),
                             stages=delay.assign_stages(params, n, t.pipeline_delay))
    except ValueError as e:
        raise ConfigError(f"train.optimizer: {e}; fix: check {flag_of('optimizer')} and its flags") from None
    state = jax.eval_shape(tx.init, params)
    strategy = train.strategy if sizes.model > 1 else "none"
    specs = state_specs(t, state, params, rules.param_specs(strategy, axes))
    axis = {"data": 1, "stage": sizes.stage, "model": sizes.model}  # no ZeRO under a plan
    layer = fixed = scalars = 0
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for (path, leaf), spec in zip(flat, spec_leaves, strict=True):
        b = _local(leaf, spec, axis)
        if _layer_leaf(path):
            layer += b
        elif not leaf.shape:
            scalars += b
        else:
            fixed += b
    layers_here = n // sizes.stage if stacked else n  # layers of one device's stage in this tree
    return OptimizerBytes(train.optimizer, -(-layer // layers_here), fixed, scalars)


__all__ = ["STATE_FIELDS", "OptimizerBytes", "optimizer_bytes"]
