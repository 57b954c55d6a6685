"""Placing a training step on a mesh: the loss under `shard_map` for each TP strategy, plus data
parallelism over the `data` axis and pipeline stages over `stage` (`boostjax.sharding.pipeline`).

`placement(cfg, graphdef, params)` returns the loss function and how to put parameters and batches
on devices. With no mesh and strategy "none" it is the plain single-device reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boostjax.config import Config, ConfigError, MeshShape, ModelConfig
from boostjax.sharding.specs import COLLECTIVES, KINDS, param_specs


@dataclass(frozen=True)
class Placement:
    loss_fn: Callable[[Any, dict], jax.Array]
    put_params: Callable[[Any], Any]
    put_batch: Callable[[dict], dict]
    mesh: Mesh | None = None
    specs: Any = None
    batch_sharding: NamedSharding | None = None  # how put_batch lays out the global batch (multi-host)
    # the training state's layout when it is not the canonical per-layer one (a pipeline stacks layers):
    to_state: Callable[[Any], Any] | None = None  # canonical params -> state layout
    to_canonical: Callable[[Any], Any] | None = None  # state layout -> canonical params
    info: dict = field(default_factory=dict)  # e.g. the pipeline schedule and its bubble fraction


def check_strategy(model: ModelConfig, strategy: str, tp: int) -> None:
    """Raise `ConfigError` (one line: field and fix) when a strategy cannot shard this model."""
    if model.kind not in KINDS[strategy]:
        want = " or ".join(KINDS[strategy])
        raise ConfigError(f"train.strategy: {strategy} does not serve model kind {model.kind!r}; fix: use --model {want}"
                          f" or another --strategy")
    if strategy == "none" and tp > 1:
        raise ConfigError("train.mesh: a model axis > 1 needs a TP strategy; fix: pass --strategy btp, vanilla-tp or fullrank-tp")
    if tp == 1:
        return
    needs = {"d_model": model.d_model} if strategy == "btp" else {}
    if strategy in ("fullrank-tp", "btp"):
        needs |= {"n_heads": model.n_heads, "n_kv_heads": model.kv_heads, "d_ff": model.d_ff}
    if strategy == "vanilla-tp":
        needs |= {"rank": model.rank}
    needs["vocab_size"] = model.vocab_size
    for name, value in needs.items():
        if value % tp:
            raise ConfigError(f"model.{name}: {value} is not divisible by the TP size {tp} ({strategy}); "
                              f"fix: choose --{name.replace('_', '-')} a multiple of {tp} or a smaller model axis")


def make_mesh(shape: MeshShape | None) -> Mesh | None:
    """The mesh of `shape` over the first devices (None -> None: one device): `data x model`,
    or `data x stage x model` when stage > 1 (model innermost: TP groups on neighbouring devices)."""
    if shape is None:
        return None
    d, p, t = shape.data, shape.stage, shape.model
    n = jax.device_count()
    if d * p * t > n or (jax.process_count() > 1 and d * p * t != n):
        shown = f"data={d} x stage={p} x model={t}" if p > 1 else f"data={d} x model={t}"
        raise ConfigError(f"train.mesh: {shown} = {d * p * t} devices but {n} are visible; "
                          f"fix: pick sizes whose product is {n}")
    if p > 1:
        return Mesh(np.asarray(jax.devices()[: d * p * t]).reshape(d, p, t), ("data", "stage", "model"))
    return Mesh(np.asarray(jax.devices()[: d * t]).reshape(d, t), ("data", "model"))


def shard_loss_fn(cfg: Config, graphdef, mesh: Mesh, specs: Any) -> Callable[[Any, dict], jax.Array]:
    """The mean loss over the global batch, computed by `shard_map` with the strategy's collectives."""
    from boostjax.step import cast_params  # noqa: PLC0415

    coll = COLLECTIVES[cfg.train.strategy]
    if mesh.shape["model"] == 1:
        coll = COLLECTIVES["none"]
        specs = jax.tree.map(lambda _: P(), specs, is_leaf=lambda x: isinstance(x, P))

    inner, rows = loss_mesh(mesh)

    def local(params, inputs_bt, targets_bt, segments_bt=None):
        model = nnx.merge(graphdef, cast_params(params, cfg.train.dtype))
        loss = model.loss(inputs_bt, targets_bt, coll, cfg.train.remat, segments=segments_bt)
        return jax.lax.pmean(loss, "data") if "data" in inner.axis_names else loss

    sharded = jax.shard_map(local, mesh=inner, in_specs=(specs, rows, rows), out_specs=P())
    with_segments = jax.shard_map(local, mesh=inner, in_specs=(specs, rows, rows, rows), out_specs=P())

    def loss_fn(params, batch):  # packed documents (`doc_mask`) bring their segment ids, laid out as the rows
        if "segments" in batch:
            return with_segments(params, batch["inputs"], batch["targets"], batch["segments"])
        return sharded(params, batch["inputs"], batch["targets"])

    return loss_fn


def loss_mesh(mesh: Mesh) -> tuple[Mesh, P]:
    """The mesh a loss `shard_map` runs over, and the batch rows' spec inside it.

    A `data` axis of size 1 is dropped (same devices, same order): named in the shard_map, it puts
    an all-reduce over one device (moving nothing) on the loss and on every parameter's gradient
    (the transpose of the data-replicated parameters). Without it the batch enters whole (`P()`).
    """
    if mesh.shape.get("data", 1) > 1 or len(mesh.axis_names) == 1:
        return mesh, P("data")
    keep = [i for i, n in enumerate(mesh.axis_names) if n != "data"]
    devices = mesh.devices.reshape([mesh.devices.shape[i] for i in keep])
    return Mesh(devices, tuple(mesh.axis_names[i] for i in keep)), P()


def placement(cfg: Config, graphdef, params_like: Any) -> Placement:
    from boostjax.step import local_loss_fn  # noqa: PLC0415

    mesh = make_mesh(cfg.train.mesh)
    tp = mesh.shape["model"] if mesh is not None else 1
    check_strategy(cfg.model, cfg.train.strategy, tp)
    if mesh is None:
        if cfg.train.strategy != "none":
            raise ConfigError(f"train.mesh: strategy {cfg.train.strategy} needs a mesh; fix: pass --mesh data=1,model=2")
        return Placement(local_loss_fn(cfg, graphdef), lambda p: jax.device_put(p),
                         lambda b: jax.device_put(b))
    if cfg.train.batch % mesh.shape["data"]:
        raise ConfigError(f"train.batch: {cfg.train.batch} is not divisible by data={mesh.shape['data']}; "
                          f"fix: pass --batch a multiple of {mesh.shape['data']}")
    if "stage" in mesh.axis_names:
        from boostjax.sharding.pipeline import pipeline_placement  # noqa: PLC0415

        return pipeline_placement(cfg, params_like, mesh)
    specs = param_specs(cfg.train.strategy, params_like)
    p_shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    b_shard = NamedSharding(mesh, P("data"))
    return Placement(
        loss_fn=shard_loss_fn(cfg, graphdef, mesh, specs),
        put_params=lambda p: jax.device_put(p, p_shard),
        put_batch=lambda b: jax.device_put(b, b_shard),
        mesh=mesh,
        specs=specs,
        batch_sharding=b_shard,
    )
