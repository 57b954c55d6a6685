"""Where a training step runs: `choose` picks the one placement a configuration asks for.

- no mesh: `SingleDevice`;
- `data x model`: `TensorParallel` (a strategy's rules and collectives; `model=1` is data parallelism);
- `data x stage x model`: `Pipeline` (stacked layers split over `stage`, TP inside each stage);
- `--offload-plan`: `Offloaded`, an overlay on any of them (host memory kinds, the plan's remat).

`check(cfg)` raises the one-line `ConfigError` of anything a placement cannot run, from the
configuration alone (no device, nothing compiled, nothing written): `boostjax.training.checks.validate`
runs it after the field checks, before a run starts.
"""

from __future__ import annotations

from typing import Any

from boostjax.config import STAGE, Config, ConfigError, mesh_text
from boostjax.offload import check_plan_for
from boostjax.offload.apply import schedule
from boostjax.offload.planfile import read_plan
from boostjax.placement.base import DEVICE, HOST, Placement, on_host, to_device, to_home
from boostjax.placement.offload import Offloaded, host_mask
from boostjax.placement.pipeline import Pipeline, check_pipeline
from boostjax.placement.single import SingleDevice, local_loss_fn
from boostjax.placement.tensor import TensorParallel
from boostjax.sharding.mesh import make_mesh
from boostjax.sharding.rules import check_mesh_for


def check(cfg: Config) -> None:
    """The placements' checks of `cfg`: the strategy and mesh against the model and batch, pipeline
    stages, a tied head, and an offload plan against the run (`check_plan_for`)."""
    t, m = cfg.train, cfg.model
    check_mesh_for(m, t.strategy, t.mesh, t.batch, t.seq)
    tp, stages = t.sizes.model, t.sizes.stage
    if m.tie_embeddings and (tp > 1 or t.strategy != "none"):
        raise ConfigError(f"model.tie_embeddings: a tied LM head (the embedding) is not implemented under tensor "
                          f"parallelism (strategy={t.strategy}, mesh={mesh_text(t.mesh)!r}); fix: pass --strategy none "
                          "and a data-only --mesh (e.g. data=8), or --no-tie-embeddings")
    if stages > 1:
        check_pipeline(cfg)
    elif t.microbatches:
        raise ConfigError("train.microbatches: micro-batches need pipeline stages; "
                          "fix: add stage=P to --mesh or drop --microbatches")
    elif t.pipeline_schedule != "gpipe":
        raise ConfigError(f"train.pipeline_schedule: {t.pipeline_schedule} schedules pipeline stages, and the mesh has "
                          "none; fix: add stage=P (P >= 2) to --mesh or drop --pipeline-schedule")
    if t.offload_plan:
        check_plan_for(t.offload_plan, cfg)


def choose(cfg: Config, graphdef, params_like: Any) -> Placement:
    """The placement of `cfg` (`params_like`: the canonical parameter shapes)."""
    check(cfg)
    t = cfg.train
    plan = read_plan(t.offload_plan) if t.offload_plan else None
    remat = schedule(plan) if plan is not None else None
    mesh = make_mesh(t.mesh)
    if mesh is None:
        base: Placement = SingleDevice(cfg, graphdef, remat)
    elif STAGE in mesh.axis_names:
        base = Pipeline(cfg, graphdef, mesh, params_like, remat)
    else:
        base = TensorParallel(cfg, graphdef, mesh, params_like, remat)
    return Offloaded(base, plan) if plan is not None else base


__all__ = ["DEVICE", "HOST", "Offloaded", "Pipeline", "Placement", "SingleDevice", "TensorParallel", "check",
           "choose", "host_mask", "local_loss_fn", "on_host", "to_device", "to_home"]
