"""Resuming a run in the other layer layout: a pipeline run (`stage` > 1 keeps the layers stacked
`[L, ...]`) resumed without a stage axis, or a per-layer run resumed on a pipeline mesh.

The checkpoint is read in the layout that wrote it, onto this process's first device, then every
parameter-shaped subtree of the parameters and of the optimizer state (a dict with a `layers` entry:
the parameters themselves, Adam's moments) is stacked or unstacked, and each leaf is placed with the
new mesh's sharding. That is exact only for optimizers whose state is elementwise per parameter
(`ELEMENTWISE`); the others (8-bit blocks, rotation bases) are refused before anything is written.
The whole training state passes through one device and the host once.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from boostjax.runs.checkpoint import Checkpointer, Restored
from boostjax.config import Config, ConfigError
from boostjax.models.stacking import stack_layers, unstack_layers
from boostjax.optim import build_optimizer, delay
from boostjax.sharding import rules

ELEMENTWISE = ("adamw", "nesterov", "pipedream-lr")  # optimizer state: one value per parameter element


def _is_params(x: Any) -> bool:
    return isinstance(x, dict) and "layers" in x


def convert(tree: Any, to_stacked: bool) -> Any:
    """Every parameter-shaped subtree of `tree` stacked (or unstacked); everything else unchanged."""
    fn = stack_layers if to_stacked else unstack_layers
    return jax.tree.map(lambda x: fn(x) if _is_params(x) else x, tree, is_leaf=_is_params)


def layout_shapes(cfg: Config, params_like: Any, stacked: bool) -> tuple[Any, Any]:
    """(parameters, optimizer state) as `ShapeDtypeStruct`s in one layout (no mesh, nothing allocated)."""
    state_like = jax.eval_shape(stack_layers if stacked else unstack_layers, params_like)
    axes = rules.logical_axes(cfg.model)
    mask = rules.rotation_mask(rules.stack_axes(axes) if stacked else axes)
    stages = delay.assign_stages(state_like, cfg.model.n_layers, cfg.train.pipeline_delay)
    tx = build_optimizer(cfg.train, state_like, rotation_mask=mask, stages=stages)
    return state_like, jax.eval_shape(tx.init, state_like)


def check(cfg: Config, params_like: Any, was_stacked: bool, where: str) -> None:
    """Refuse (ConfigError, nothing written) a layout change this run's optimizer state cannot take."""
    t = cfg.train
    layout = {True: "stacked layers (a stage mesh)", False: "per-layer parameters (no stage axis)"}
    why = (f"train.mesh: {where} holds checkpoints with {layout[was_stacked]} but this mesh trains "
           f"{layout[not was_stacked]}")
    keep = f"fix: resume {'with' if was_stacked else 'without'} stage > 1 in --mesh, or pass another --out"
    if t.optimizer not in ELEMENTWISE:
        raise ConfigError(f"{why}, and the {t.optimizer} optimizer's state cannot be re-laid out; {keep}")
    if jax.process_count() > 1:
        raise ConfigError(f"{why}, which a multi-host job does not convert; {keep} (or convert it in one process)")
    _, old_opt = layout_shapes(cfg, params_like, was_stacked)
    _, new_opt = layout_shapes(cfg, params_like, not was_stacked)
    got = jax.eval_shape(lambda o: convert(o, not was_stacked), old_opt)
    same = jax.tree.structure(got) == jax.tree.structure(new_opt) and all(
        a.shape == b.shape and a.dtype == b.dtype for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(new_opt)))
    if not same:
        raise ConfigError(f"{why}, and its optimizer state does not map onto the new layout; {keep}")


def restore_latest(ckpt: Checkpointer, cfg: Config, params_like: Any, was_stacked: bool, params: Any,
                   opt_state: Any) -> Restored | None:
    """`Checkpointer.restore_latest` of a checkpoint written in the other layout, returned in the layout
    (and on the shardings) of the live `params` / `opt_state`."""
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    on_one = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), tree)  # noqa: E731
    old_params, old_opt = layout_shapes(cfg, params_like, was_stacked)
    restored = ckpt.restore_latest(on_one(old_params), on_one(old_opt))
    if restored is None:
        return None
    host_p, host_o = jax.device_get((restored.params, restored.opt_state))
    host_p, host_o = convert(host_p, not was_stacked), convert(host_o, not was_stacked)

    def place(x, like):
        x = np.asarray(x)
        return jax.make_array_from_callback(like.shape, like.sharding, lambda idx: x[idx])

    restored.params = jax.tree.map(place, host_p, params)
    restored.opt_state = jax.tree.map(place, host_o, opt_state)
    return restored
