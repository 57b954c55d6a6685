"""Where a training step runs: `choose` picks the one placement a configuration asks for.

- no mesh: `SingleDevice`;
- `data x model`: `TensorParallel` (a strategy's specs and collectives; `model=1` is data parallelism);
- `data x stage x model`: `Pipeline` (stacked layers split over `stage`, TP inside each stage);
- `--offload-plan`: `Offloaded`, an overlay on any of them (host memory kinds, the plan's remat).

`check(cfg)` raises the one-line `ConfigError` of anything a placement cannot run, from the
configuration alone (no device, nothing compiled): `boostjax.validate` runs it.
"""

from __future__ import annotations

from typing import Any

from boostjax.config import Config, ConfigError, parse_mesh, validate as validate_fields
from boostjax.offload.apply import check_plan, load_plan, schedule
from boostjax.placement.base import DEVICE, HOST, Placement, on_host, to_device, to_home
from boostjax.placement.offload import Offloaded, check_offload, host_mask
from boostjax.placement.pipeline import Pipeline, check_pipeline
from boostjax.placement.single import SingleDevice, local_loss_fn
from boostjax.placement.tensor import TensorParallel, check_strategy
from boostjax.sharding.mesh import make_mesh


def check(cfg: Config) -> None:
    """The placement's checks of `cfg` (strategy vs model and mesh, pipeline stages, offload plan)."""
    t, m = cfg.train, cfg.model
    sizes = parse_mesh(t.mesh)
    data, stages, tp = sizes.get("data", 1), sizes.get("stage", 1), sizes.get("model", 1)
    check_strategy(m, t.strategy, tp)
    if not sizes and t.strategy != "none":
        raise ConfigError(f"train.mesh: strategy {t.strategy} needs a mesh; fix: pass --mesh data=1,model=2")
    if t.batch % data:
        raise ConfigError(f"train.batch: {t.batch} is not divisible by data={data}; "
                          f"fix: pass --batch a multiple of {data}")
    if m.tie_embeddings and (tp > 1 or t.strategy != "none"):
        raise ConfigError(f"model.tie_embeddings: a tied LM head (the embedding) is not implemented under tensor "
                          f"parallelism (strategy={t.strategy}, mesh={t.mesh!r}); fix: pass --strategy none and a "
                          "data-only --mesh (e.g. data=8), or --no-tie-embeddings")
    if stages > 1:
        check_pipeline(cfg, stages, data)
    elif t.microbatches:
        raise ConfigError("train.microbatches: micro-batches need pipeline stages; "
                          "fix: add stage=P to --mesh or drop --microbatches")
    if t.offload_plan:
        plan = load_plan(t.offload_plan)
        check_offload(cfg, plan, stages)
        check_plan(plan, cfg)


def validate(cfg: Config) -> Config:
    """`boostjax.config.validate` (every field) and then `check` (what the placement can run)."""
    validate_fields(cfg)
    check(cfg)
    return cfg


def choose(cfg: Config, graphdef, params_like: Any) -> Placement:
    """The placement of `cfg` (`params_like`: the canonical parameter shapes)."""
    check(cfg)
    t = cfg.train
    plan = load_plan(t.offload_plan) if t.offload_plan else None
    remat = schedule(plan) if plan is not None else None
    mesh = make_mesh(t.mesh)
    if mesh is None:
        base: Placement = SingleDevice(cfg, graphdef, remat)
    elif "stage" in mesh.axis_names:
        base = Pipeline(cfg, graphdef, mesh, params_like, remat)
    else:
        base = TensorParallel(cfg, graphdef, mesh, params_like, remat)
    return Offloaded(base, plan) if plan is not None else base


__all__ = ["DEVICE", "HOST", "Offloaded", "Pipeline", "Placement", "SingleDevice", "TensorParallel", "check",
           "choose", "host_mask", "local_loss_fn", "on_host", "to_device", "to_home", "validate"]
