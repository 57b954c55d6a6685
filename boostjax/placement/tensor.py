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
from boostjax.placement.base import Canonical, Role, is_spec, named
from boostjax.sharding.mesh import loss_mesh_for
from boostjax.sharding import rules, zero


def _local_loss(cfg: Config, graphdef, mesh: Mesh, specs: Any, remat: Any, objective: Any = None
                ) -> tuple[Callable, Mesh, P, Any]:
    """`(local, inner mesh, rows spec, specs)`: the loss of one device's rows under the strategy's
    collectives (`local(params, inputs_bt, targets_bt, segments_bt=None, **extra)`), the mesh its `shard_map`
    runs over, and the parameters' specs there (all replicated on a `model` axis of size 1). With
    `objective`: `objective(logits_btv, rows, coll)` (the rows, targets included) instead of the cross-entropy."""
    coll = rules.STRATEGIES[cfg.train.strategy].collectives
    if mesh.shape[MODEL] == 1:
        coll = rules.STRATEGIES["none"].collectives
        specs = jax.tree.map(lambda _: P(), specs, is_leaf=is_spec)
    inner, rows = loss_mesh_for(cfg, mesh)

    def local(params, inputs_bt, targets_bt, segments_bt=None, **extra):
        model = nnx.merge(graphdef, cast_params(params, cfg.train.dtype))
        if objective is not None:
            logits_btv = model(inputs_bt, coll, remat, segments=segments_bt)
            return objective(logits_btv, {"targets": targets_bt, **extra}, coll)
        return model.loss(inputs_bt, targets_bt, coll, remat, segments=segments_bt)

    return local, inner, rows, specs


ROW_KEYS = ("inputs", "targets", "segments")  # the batch's token rows; any other key goes to the objective


def _rows(batch: dict) -> tuple:
    """The batch's row arrays in `local`'s order (packed documents, `doc_mask`, bring segment ids)."""
    return (batch["inputs"], batch["targets"]) + ((batch["segments"],) if "segments" in batch else ())


def shard_loss_fn(cfg: Config, graphdef, mesh: Mesh, specs: Any, remat: Any, objective: Any = None
                  ) -> Callable[[Any, dict], jax.Array]:
    """The mean loss over the global batch, computed by `shard_map` with the strategy's collectives
    (with `objective`: its loss, or its (loss, aux), each averaged over `data`; the batch's other
    rows, e.g. a teacher's logits, go to it split like the tokens)."""
    local, inner, rows, specs = _local_loss(cfg, graphdef, mesh, specs, remat, objective)

    def mean(*args, **extra):
        out = local(*args, **extra)
        return jax.tree.map(lambda x: jax.lax.pmean(x, DATA), out) if DATA in inner.axis_names else out

    sharded = jax.shard_map(mean, mesh=inner, in_specs=(specs, rows, rows), out_specs=P())
    with_segments = jax.shard_map(mean, mesh=inner, in_specs=(specs, rows, rows, rows), out_specs=P())

    def loss_fn(params, batch):
        extra = {k: v for k, v in batch.items() if k not in ROW_KEYS}
        if extra:
            n = len(_rows(batch))
            with_extra = jax.shard_map(lambda p, r, e: mean(p, *r, **e), mesh=inner,
                                       in_specs=(specs, (rows,) * n, {k: rows for k in extra}), out_specs=P())
            return with_extra(params, _rows(batch), extra)
        return (with_segments if "segments" in batch else sharded)(params, *_rows(batch))

    return loss_fn


def shard_grad_fn(cfg: Config, graphdef, mesh: Mesh, specs: Any, split: Any, remat: Any
                  ) -> Callable[[Any, dict], tuple[jax.Array, Any]]:
    """`(params, batch) -> (loss, grads)` with ZeRO's gradient (`boostjax.sharding.zero`): every leaf
    reduce-scattered over `data` onto its spec in `split` (the gradients' ZeRO specs); the batch holds
    `grad_accum` micro-batches."""
    local, inner, rows, specs = _local_loss(cfg, graphdef, mesh, specs, remat)
    f = zero.zero_value_and_grad(local, inner, specs, split, rows, gather=cfg.train.zero >= 3,
                                 accum=cfg.train.grad_accum, cast=lambda p: cast_params(p, cfg.train.dtype))
    return lambda params, batch: f(params, *_rows(batch))


@dataclass(frozen=True)
class TensorParallel(Canonical):
    """A `data x model` mesh (`model` may be 1: pure data parallelism)."""

    cfg: Config
    graphdef: Any
    mesh: Mesh
    params_like: Any  # canonical parameter shapes
    remat: Any = None  # None: `cfg.train.remat`
    objective: Any = None  # (logits_btv, rows, coll) -> loss or (loss, aux); None: cross-entropy

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

    def zero_specs(self, role: Role, specs: Any, like: Any) -> Any:
        """`specs` with ZeRO's split over `data` (`rules.data_sharded`): optimizer state and gradients
        at stage >= 1, parameters at stage 3."""
        zero = self.cfg.train.zero
        split = zero >= 3 if role == "params" else zero >= 1
        data = self.mesh.shape[DATA] if split else 1
        return jax.tree.map(lambda s, a: rules.data_sharded(s, a.shape, data), specs, like, is_leaf=is_spec)

    def place(self, role: Role, specs: Any, like: Any) -> Any:
        """NamedShardings of `specs` with ZeRO's split (`zero_specs`)."""
        return named(self.mesh, self.zero_specs(role, specs, like))

    @property
    def remat_schedule(self) -> Any:
        """What the step recomputes: an offload plan's per-layer schedule, else `--remat`."""
        return self.cfg.train.remat if self.remat is None else self.remat

    @cached_property
    def loss_fn(self):
        return self.make_loss_fn(self.param_specs(self.to_state_like), self.remat_schedule)

    @cached_property
    def grad_fn(self):
        """The data-parallel gradient, summed over `data` explicitly (`boostjax.sharding.zero`):
        reduce-scattered where ZeRO (stage >= 1) splits it, all-reduced otherwise. None without a
        `data` axis of more than one device, or with an `objective` (the step differentiates `loss_fn`)."""
        if self.mesh.shape[DATA] == 1 or self.objective is not None:
            return None
        like = self.to_state_like
        specs = self.param_specs(like)
        return self.make_grad_fn(specs, self.zero_specs("grads", specs, like), self.remat_schedule)

    def make_loss_fn(self, specs: Any, remat: Any) -> Callable:
        """The mean loss over the mesh of parameters laid out by `specs`."""
        return shard_loss_fn(self.cfg, self.graphdef, self.mesh, specs, remat, self.objective)

    def make_grad_fn(self, specs: Any, split: Any, remat: Any) -> Callable:
        """(loss, gradient) with the gradient summed over `data` into the layout `split`."""
        return shard_grad_fn(self.cfg, self.graphdef, self.mesh, specs, split, remat)

    @cached_property
    def to_state_like(self) -> Any:
        return jax.eval_shape(self.to_state, self.params_like)
