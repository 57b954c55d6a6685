"""Device meshes: `data x model`, or `data x stage x model` with pipeline stages (model innermost,
so a TP group sits on neighbouring devices), and the mesh a loss `shard_map` runs over."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from boostjax.config import DATA, MODEL, STAGE, Config, ConfigError, MeshShape
from boostjax.models import attention


def make_mesh(shape: MeshShape | None) -> Mesh | None:
    """The mesh of `train.mesh` over the first devices (None -> None: one device)."""
    if shape is None:
        return None
    d, p, t = shape.data, shape.stage, shape.model
    n = jax.device_count()
    if d * p * t > n or (jax.process_count() > 1 and d * p * t != n):
        shown = f"data={d} x stage={p} x model={t}" if p > 1 else f"data={d} x model={t}"
        raise ConfigError(f"train.mesh: {shown} = {d * p * t} devices but {n} are visible; "
                          f"fix: pick sizes whose product is {n}")
    if p > 1:
        return Mesh(np.asarray(jax.devices()[: d * p * t]).reshape(d, p, t), (DATA, STAGE, MODEL))
    return Mesh(np.asarray(jax.devices()[: d * t]).reshape(d, t), (DATA, MODEL))


def loss_mesh_for(cfg: Config, mesh: Mesh) -> tuple[Mesh, P]:
    """`loss_mesh` for `cfg`'s step: the size-1 data axis kept where its attention needs the program's mesh."""
    return loss_mesh(mesh, attention.needs_program_mesh(cfg.model.attention, cfg.train.dtype))


def loss_mesh(mesh: Mesh, keep_data: bool = False) -> tuple[Mesh, P]:
    """The mesh a loss `shard_map` runs over, and the batch rows' spec inside it.

    A `data` axis of size 1 is dropped (same devices, same order): named in the shard_map, it puts
    an all-reduce over one device (moving nothing) on the loss and on every parameter's gradient
    (the transpose of the data-replicated parameters). Without it the batch enters whole (`P()`).
    `keep_data`: keep it anyway (`attention.needs_program_mesh`: cuDNN attention lowers through
    `custom_partitioning`, which refuses a shard_map mesh other than the program's).
    """
    if keep_data or mesh.shape.get(DATA, 1) > 1 or len(mesh.axis_names) == 1:
        return mesh, P(DATA)
    keep = [i for i, n in enumerate(mesh.axis_names) if n != DATA]
    devices = mesh.devices.reshape([mesh.devices.shape[i] for i in keep])
    return Mesh(devices, tuple(mesh.axis_names[i] for i in keep)), P()
