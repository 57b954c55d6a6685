"""Pipeline stages on a `data x stage x model` mesh: layers stacked `[L, ...]` and split over
`stage`, the GPipe or 1F1B schedule (`boostjax.sharding.pipeline`, `pipeline_1f1b`), and the
tensor-parallel strategy inside each stage."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from boostjax.config import MODEL, Config, ConfigError
from boostjax.placement.tensor import TensorParallel
from boostjax.sharding import rules
from boostjax.models.stacking import stack_layers, unstack_layers
from boostjax.sharding.pipeline import microbatches, pipeline_grad_fn, pipeline_info, pipeline_loss_fn
from boostjax.sharding.pipeline_1f1b import onef1b_grad_fn, onef1b_loss_fn


def check_pipeline(cfg: Config) -> None:
    """Raise `ConfigError` for what pipeline stages cannot run (the mesh sizes themselves are checked
    by `rules.check_mesh_for`): micro-batches that do not divide a data shard's rows, segment ids,
    a tied head."""
    m, t = cfg.model, cfg.train
    data = t.sizes.data
    local = t.batch // data
    if t.microbatches and local % t.microbatches:
        raise ConfigError(f"train.microbatches: the batch per data shard ({t.batch}/data={data} = {local}) is not "
                          f"divisible by {t.microbatches} micro-batches; fix: pass --microbatches a divisor of "
                          f"{local} or 0 (auto)")
    if t.doc_mask:
        raise ConfigError("train.doc_mask: pipeline stages do not carry segment ids; "
                          "fix: drop stage= from --mesh or drop --doc-mask")
    if m.tie_embeddings:
        raise ConfigError("model.tie_embeddings: a tied LM head (the embedding) is not implemented across pipeline "
                          "stages; fix: drop stage= from --mesh or pass --no-tie-embeddings")


@dataclass(frozen=True)
class Pipeline(TensorParallel):
    """Stacked, stage-sharded layers; embedding, final norm and head replicated over `stage`."""

    def __post_init__(self) -> None:
        check_pipeline(self.cfg)

    def to_state(self, params: Any) -> Any:
        return stack_layers(params)

    def to_canonical(self, params: Any) -> Any:
        return unstack_layers(params)

    @cached_property
    def axes(self) -> Any:
        """The logical axes of the stacked layout: `layers` (-> `stage`) in front of every layer's."""
        return rules.stack_axes(rules.logical_axes(self.cfg.model))

    def param_specs(self, state_like: Any) -> Any:
        return rules.param_specs(self.cfg.train.strategy if self.mesh.shape[MODEL] > 1 else "none", self.axes)

    @property
    def info(self) -> dict:
        return pipeline_info(self.cfg.train)

    def make_loss_fn(self, specs: Any, remat: Any) -> Callable:
        """The schedule's mean loss over micro-batches (1F1B: the same loss, its gradient the 1F1B schedule)."""
        n_micro = microbatches(self.cfg.train)
        loss_fn = pipeline_loss_fn(self.cfg, self.mesh, specs, n_micro, remat)
        if self.cfg.train.pipeline_schedule == "1f1b":
            loss_fn = onef1b_loss_fn(self.cfg, self.mesh, specs, n_micro, forward=loss_fn, remat=remat)
        return loss_fn

    def make_grad_fn(self, specs: Any, split: Any, remat: Any) -> Callable:
        """The schedule's (loss, gradient), the gradient summed over `data` into `split`."""
        grad_fn = onef1b_grad_fn if self.cfg.train.pipeline_schedule == "1f1b" else pipeline_grad_fn
        return grad_fn(self.cfg, self.mesh, specs, split, microbatches(self.cfg.train), remat)


__all__ = ["Pipeline", "check_pipeline"]
