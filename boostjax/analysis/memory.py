"""Per-device memory of the compiled training step, read before any accelerator is rented.

`train_step_compiled(cfg)` compiles, abstractly (ShapeDtypeStructs carrying the shardings; nothing is
allocated), the same jitted step `boostjax train` compiles for `cfg`: the placement, optimizer,
state shardings, donation and output shardings come from `boostjax.training.step`. `memory_report` reads
`compiled.memory_analysis()` (per device) and splits its peak:

  peak_bytes_per_device = argument + output - alias + temp     (XLA's buffer assignment)
  weight_bytes      the parameters' argument buffers on one device (fp32 master copies, this
                    device's shard under TP / stage / parameter sharding)
  optimizer_bytes   the optimizer state's argument buffers on one device (AdamW mu/nu, rotation
                    bases, 8-bit moments and scales, delay histories, step counters)
  activation_bytes  everything else in the peak: the step's temporaries (saved activations and
                    recomputation, the compute-dtype copies of the parameters, gradients and their
                    reductions, attention scores, logits, optimizer workspace), the batch, the
                    metrics; the step donates params and optimizer state, so their updated
                    values reuse the argument buffers (output - alias = metrics only).

The split of `activation_bytes` is not in `memory_analysis()`; `gradient_bytes_estimate` is the
fp32 gradient of this device's parameter shard (= weight_bytes), one of its largest parts.
On the CPU backend the figures are XLA CPU's buffer assignment and scheduling; a GPU compile of the
same step (`memory_report` on a GPU machine) uses that backend's scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import jax
from flax import nnx

from boostjax.config import (
    Config,
    ConfigError,
    MeshShape,
    ModelConfig,
    TrainConfig,
    mesh_text,
    validate,
)
from boostjax.models.attention import check_backend
from boostjax.models.llama import LLaMA
from boostjax.runtime.profiles import GiB as GIB
from boostjax.training.step import jit_step, step_layout, train_state_shapes

# never executed: on CPU skip LLVM's expensive passes (the optimised HLO and its buffers are unchanged)
FAST_CPU = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
MEMORY_FIELDS = ("temp", "argument", "output", "alias", "generated_code")


@dataclass(frozen=True)
class AbstractStep:
    compiled: Any  # jax.stages.Compiled of the training step
    params: Any  # ShapeDtypeStructs with shardings (the training layout)
    opt_state: Any
    batch: dict
    loss_fn: Any  # the placement's loss(params, batch), for forward-only compiles
    mesh: Any
    grads: Any = None  # the gradients' shardings (`Layout.grads`: ZeRO's split over data; mesh only)


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs (its shard of each sharded leaf)."""

    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if getattr(a, "sharding", None) is not None else a.shape
        total += math.prod(shape) * a.dtype.itemsize
    return total


def memory_fields(compiled) -> dict[str, int]:
    """`compiled.memory_analysis()` as `{temp_bytes, argument_bytes, ...}` (per device)."""
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    return {f"{n}_bytes": int(getattr(ma, f"{n}_size_in_bytes", 0) or 0) for n in MEMORY_FIELDS}


def train_config(batch: int, seq: int, strategy: str, mesh: MeshShape | str | None, remat: str, dtype: str,
                 **train_fields) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(train_fields) - names)
    if unknown:
        raise ConfigError(f"train.{unknown[0]}: no such training field; fix: use one of TrainConfig's fields")
    return TrainConfig(batch=batch, seq=seq, strategy=strategy, mesh=mesh, remat=remat, dtype=dtype, **train_fields)


def train_step_compiled(cfg: Config, compiler_options: dict | None = None) -> AbstractStep:
    """The training step `boostjax train` compiles for `cfg`, compiled on abstract inputs: the state
    layout and step from `step.step_layout` / `step.layout_step` / `step.train_state_shapes`, with the
    same accumulation, donation and output shardings as `StepFns.compile`."""


    t = cfg.train
    if t.offload_plan:
        raise ConfigError("train.offload_plan: an offload plan places state in host memory, which this report "
                          "does not model; fix: read the plan's memory from `boostjax plan`, or drop --offload-plan")
    need, visible = t.sizes.devices, jax.device_count()
    if need > visible:
        raise ConfigError(f"train.mesh: {t.mesh} needs {need} devices but {visible} are visible; "
                          f"fix: pick sizes whose product is at most {visible}")
    check_backend(cfg.model, t.dtype)  # --attention cudnn compiles only for a CUDA GPU
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LLaMA(cfg.model, rngs=nnx.Rngs(0))))
    params_like = state.to_pure_dict()
    lay = step_layout(cfg, graphdef, params_like)
    state_sds, b_sds = train_state_shapes(cfg, graphdef, params_like)
    mesh = lay.placement.mesh
    lowered = jit_step(cfg, lay).lower(state_sds, b_sds)  # as StepFns.compile jits it
    if compiler_options is None and jax.default_backend() == "cpu":
        compiler_options = FAST_CPU
    opt_sds = (state_sds.step, state_sds.opt_state, state_sds.delay)
    return AbstractStep(lowered.compile(compiler_options), state_sds.params, opt_sds, b_sds, lay.placement.loss_fn, mesh,
                        lay.grads)


def memory_parts(step: AbstractStep) -> dict[str, int]:
    """The peak of a compiled step and its parts (see the module docstring), per device."""
    mem = memory_fields(step.compiled)
    peak = mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"]
    weights, opt = device_bytes(step.params), device_bytes(step.opt_state)
    return {"peak_bytes_per_device": peak, "weight_bytes": weights, "optimizer_bytes": opt,
            "activation_bytes": peak - weights - opt, "batch_bytes": device_bytes(step.batch),
            "gradient_bytes_estimate": weights, **mem}


def memory_report(model: ModelConfig, mesh: MeshShape | str | None, batch: int, seq: int, strategy: str,
                  remat: str = "none", dtype: str = "bfloat16", **train_fields) -> dict[str, Any]:
    """Per-device peak memory of the training step `boostjax train` compiles for this configuration.

    `model` is compiled as given (its kind is not changed); `mesh` is a MeshShape or a `--mesh` string
    ('' or None = one device, strategy "none"); `train_fields` are further `TrainConfig` fields (`optimizer`,
    `microbatches`, `pipeline_delay`, ...). Checked by `config.validate` first (ConfigError). JAX
    must see the mesh's devices (`boostjax.runtime.devices.simulate_for_mesh` before JAX starts on CPU).

    Keys: `peak_bytes_per_device` = `argument_bytes + output_bytes - alias_bytes + temp_bytes`
    (`compiled.memory_analysis()`), its parts `weight_bytes`, `optimizer_bytes`, `activation_bytes`
    (module docstring), `batch_bytes`, `gradient_bytes_estimate`, the raw `*_bytes` fields, `peak_gib`,
    and the configuration (`kind`, `strategy`, `mesh`, `batch`, `seq`, `remat`, `dtype`, `train`).
    """

    t = train_config(batch, seq, strategy, mesh, remat, dtype, **train_fields)
    cfg = validate(Config(model, t))
    parts = memory_parts(train_step_compiled(cfg))
    return {"kind": model.kind, "strategy": strategy, "mesh": mesh_text(t.mesh), "batch": batch, "seq": seq,
            "remat": remat, "dtype": dtype, "train": dict(train_fields), "backend": jax.default_backend(), **parts,
            "peak_gib": parts["peak_bytes_per_device"] / GIB}
