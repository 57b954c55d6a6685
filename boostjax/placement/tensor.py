"""Tensor parallelism on a `data x model` mesh: the loss under `shard_map` with the strategy's
collectives, parameters laid out by the strategy's specs, batch rows split over `data`, and ZeRO's
split of optimizer state (stage 1) and parameters (stage 3) over `data`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boostjax.config import DATA, MODEL, Config
from boostjax.models.ops import cast_params
from boostjax.placement.base import Canonical, Role, is_spec
from boostjax.sharding.mesh import loss_mesh
from boostjax.sharding import rules


def shard_loss_fn(cfg: Config, graphdef, mesh: Mesh, specs: Any, remat: Any) -> Callable[[Any, dict], jax.Array]:
    """The mean loss over the global batch, computed by `shard_map` with the strategy's collectives."""
    coll = rules.STRATEGIES[cfg.train.strategy].collectives
    if mesh.shape[MODEL] == 1:
        coll = rules.STRATEGIES["none"].collectives
        specs = jax.tree.map(lambda _: P(), specs, is_leaf=is_spec)
    inner, rows = loss_mesh(mesh)

    def local(params, inputs_bt, targets_bt, segments_bt=None):
        model = nnx.merge(graphdef, cast_params(params, cfg.train.dtype))
        loss = model.loss(inputs_bt, targets_bt, coll, remat, segments=segments_bt)
        return jax.lax.pmean(loss, DATA) if DATA in inner.axis_names else loss

    sharded = jax.shard_map(local, mesh=inner, in_specs=(specs, rows, rows), out_specs=P())
    with_segments = jax.shard_map(local, mesh=inner, in_specs=(specs, rows, rows, rows), out_specs=P())

    def loss_fn(params, batch):  # packed documents (`doc_mask`) bring their segment ids, laid out as the rows
        if "segments" in batch:
            return with_segments(params, batch["inputs"], batch["targets"], batch["segments"])
        return sharded(params, batch["inputs"], batch["targets"])

    return loss_fn


@dataclass(frozen=True)
class TensorParallel(Canonical):
    """A `data x model` mesh (`model` may be 1: pure data parallelism)."""

    cfg: Config
    graphdef: Any
    mesh: Mesh
    params_like: Any  # canonical parameter shapes
    remat: Any = None  # None: `cfg.train.remat`

    @property
    def info(self) -> dict:
        return {}

    @property
    def compiler_options(self) -> dict | None:
        return None

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(DATA))

    @property
    def micro_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(None, DATA))

    def param_specs(self, state_like: Any) -> Any:
        return rules.param_specs(self.cfg.train.strategy, self.axes)

    def place(self, role: Role, specs: Any, like: Any) -> Any:
        """NamedShardings of `specs`; ZeRO adds `data` to optimizer state and gradients (stage >= 1)
        and parameters (stage 3): `rules.data_sharded`."""
        zero = self.cfg.train.zero
        split = zero >= 3 if role == "params" else zero >= 1
        data = self.mesh.shape[DATA] if split else 1
        return jax.tree.map(lambda s, a: NamedSharding(self.mesh, rules.data_sharded(s, a.shape, data)),
                            specs, like, is_leaf=is_spec)

    @cached_property
    def loss_fn(self):
        remat = self.cfg.train.remat if self.remat is None else self.remat
        specs = self.param_specs(self.to_state_like)
        return shard_loss_fn(self.cfg, self.graphdef, self.mesh, specs, remat)

    @cached_property
    def to_state_like(self) -> Any:
        return jax.eval_shape(self.to_state, self.params_like)
