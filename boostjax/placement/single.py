"""One device: the plain reference every parallel placement is tested against."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import jax
from flax import nnx
from jax.sharding import SingleDeviceSharding

from boostjax.config import Config
from boostjax.models.collectives import LOCAL
from boostjax.models.ops import cast_params
from boostjax.placement.base import Canonical, Role
from boostjax.sharding import rules


def local_loss_fn(cfg: Config, graphdef, remat: Any = None, objective: Any = None):
    """Mean next-token cross-entropy on one device (`remat`: a policy name or an offload schedule);
    with `objective`, `objective(logits_btv, batch, coll)` instead (e.g. distillation's)."""
    remat = cfg.train.remat if remat is None else remat

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, cast_params(params, cfg.train.dtype))
        if objective is not None:
            return objective(model(batch["inputs"], remat=remat, segments=batch.get("segments")), batch, LOCAL)
        return model.loss(batch["inputs"], batch["targets"], remat=remat, segments=batch.get("segments"))

    return loss_fn


@dataclass(frozen=True)
class SingleDevice(Canonical):
    cfg: Config
    graphdef: Any
    remat: Any = None  # None: `cfg.train.remat`
    mesh: None = None
    micro_sharding: None = None
    info: dict = field(default_factory=dict)
    compiler_options: None = None
    grad_fn: None = None
    objective: Any = None  # (logits_btv, batch, coll) -> loss or (loss, aux); None: cross-entropy

    @property
    def batch_sharding(self) -> SingleDeviceSharding:
        return SingleDeviceSharding(jax.devices()[0])

    def param_specs(self, state_like: Any) -> Any:
        return rules.param_specs("none", self.axes)

    def place(self, role: Role, specs: Any, like: Any) -> Any:
        if role == "grads":
            return None
        return jax.tree.map(lambda _: self.batch_sharding, like)

    @cached_property
    def loss_fn(self):
        return local_loss_fn(self.cfg, self.graphdef, self.remat, self.objective)
