"""Pipeline parallelism over the mesh axis `stage` (GPipe here, 1F1B in `pipeline_1f1b`), composed with
`data` and every TP strategy.

Layout. The training state keeps the blocks *stacked*: `params["layers"]` is one Block-shaped tree
whose leaves carry a leading layer axis `[L, ...]`, sharded `P("stage", *tp_spec)` (`stage_specs`), so
stage `s` holds exactly its contiguous layers `[s·L/P, (s+1)·L/P)`. Embedding, final norm and LM head
keep their TP spec and are replicated over `stage`; only stage 0 uses the embedding (the others
contribute zero to its gradient), and every stage runs norm and head on its share of the tokens
(below). `stack_layers` / `unstack_layers` convert to and from the canonical
per-layer layout (`layers: {0: Block, 1: Block, ...}`) that `TrainResult`, `load_run` and
`export-hf` see; checkpoints hold the training (stacked) layout and `Checkpointer.restore_params`
unstacks them.

Schedule (GPipe). Each data shard's batch is cut into M micro-batches. At tick `t` (M + P - 1 ticks)
stage `s` runs its layers on micro-batch `t - s` (stage 0 reads it from the embedding, the others
receive it from stage `s - 1` by `ppermute`); the last stage's outputs of ticks `P-1 ... M+P-2` are
the M micro-batches' features. One `psum_scatter` over `stage` hands each stage 1/P of those tokens,
and every stage computes final norm, LM head and loss on its share: the head's GEMMs and fp32 logits
are split P ways instead of run by every stage (a stage-dependent `cond` around the head would idle
the others but puts collectives under a conditional, which XLA's CPU runtime deadlocks on).
The backward is the autodiff of this loop: all forwards, then all backwards in reverse tick order
(GPipe with a flush). Idle fraction of every stage: `bubble_fraction(P, M) = (P - 1) / (M + P - 1)`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boostjax.config import Config, ConfigError, TrainConfig
from boostjax.models import ops
from boostjax.models.llama import LLaMA, Block, resolve_remat
from boostjax.models.remat import tied_checkpoint
from boostjax.sharding.collectives import vocab_parallel_cross_entropy
from boostjax.sharding.pipeline_1f1b import onef1b_loss_fn, ring_slots
from boostjax.sharding.specs import COLLECTIVES, param_specs

STAGE = "stage"


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle fraction per stage of GPipe and of 1F1B (`pipeline_1f1b`): `(P - 1) / (M + P - 1)`
    (0 without a pipeline)."""
    return (stages - 1) / (microbatches + stages - 1)


def microbatches(t: TrainConfig) -> int:
    """`t.microbatches`, or (0 = auto) the largest divisor of the per-data-shard batch that is at most
    4·P: GPipe's bubble is small once M >= 4P ((P-1)/(5P-1) < 20 %), and more, smaller micro-batches
    only cost GEMM efficiency."""
    stages, local = t.sizes.stage, t.batch // t.sizes.data
    if t.microbatches:
        return t.microbatches
    return max(m for m in range(1, min(local, 4 * stages) + 1) if local % m == 0)


def activation_slots(schedule: str, stages: int, microbatches: int) -> int:
    """Micro-batches whose stage activations one device keeps for the backward: GPipe's autodiff saves
    every one of its `M + P - 1` ticks; 1F1B a ring of `2P - 1` (`pipeline_1f1b.ring_slots`)."""
    return ring_slots(stages) if schedule == "1f1b" else microbatches + stages - 1


def pipeline_info(t: TrainConfig) -> dict:
    """What the train loop logs at start and `StepFns.info` returns: schedule, stages, micro-batches,
    bubble (the same `(P-1)/(M+P-1)` for both schedules) and the activation slots per device."""
    stages, m = t.sizes.stage, microbatches(t)
    return {"schedule": t.pipeline_schedule, "stages": stages, "microbatches": m,
            "microbatch_size": t.batch // t.sizes.data // m,
            "bubble_fraction": bubble_fraction(stages, m),
            "activation_slots": activation_slots(t.pipeline_schedule, stages, m)}


# -- layouts ---------------------------------------------------------------------------------------
def is_stacked(params: Any) -> bool:
    """Whether `params["layers"]` is one stacked Block tree (not `{0: Block, 1: Block, ...}`)."""
    layers = params.get("layers") if isinstance(params, dict) else None
    return isinstance(layers, dict) and "attn" in layers


def stack_layers(params: dict) -> dict:
    """Canonical per-layer params -> one Block tree with a leading layer axis `[L, ...]`."""
    layers = params["layers"]
    blocks = [layers[i] for i in sorted(layers, key=int)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    return {**params, "layers": stacked}


def unstack_layers(params: dict) -> dict:
    """The inverse of `stack_layers` (canonical params unchanged)."""
    if not is_stacked(params):
        return params
    stacked = params["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    return {**params, "layers": {i: jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)}}


def stage_specs(strategy: str, stacked: Any, tp: int) -> Any:
    """The TP strategy's spec table with `stage` prepended to every stacked layer's spec (TP specs
    dropped when the model axis is 1)."""
    specs = param_specs(strategy if tp > 1 else "none", stacked)
    return {k: (jax.tree.map(lambda s: P(STAGE, *s), v, is_leaf=lambda x: isinstance(x, P)) if k == "layers" else v)
            for k, v in specs.items()}


# -- the pipelined loss ------------------------------------------------------------------------------
def pipeline_loss_fn(cfg: Config, mesh: Mesh, specs: Any, n_micro: int) -> Callable[[Any, dict], jax.Array]:
    """The mean loss over the global batch, GPipe-scheduled over `stage` inside `shard_map`."""
    from boostjax.sharding.strategies import loss_mesh  # noqa: PLC0415
    from boostjax.step import cast_params  # noqa: PLC0415

    mcfg, stages, tp = cfg.model, mesh.shape[STAGE], mesh.shape["model"]
    coll = COLLECTIVES[cfg.train.strategy] if tp > 1 else COLLECTIVES["none"]
    top_def, _ = nnx.split(nnx.eval_shape(lambda: LLaMA(replace(mcfg, n_layers=0), rngs=nnx.Rngs(0))))
    block_def, _ = nnx.split(nnx.eval_shape(lambda: Block(mcfg, rngs=nnx.Rngs(0))))
    per_stage = mcfg.n_layers // stages
    policy = resolve_remat(cfg.train.remat)
    forward = [(i, i + 1) for i in range(stages - 1)]

    def local(params, inputs_bt, targets_bt):
        params = cast_params(params, cfg.train.dtype)
        top = nnx.merge(top_def, {k: v for k, v in params.items() if k != "layers"})
        layers = params["layers"]  # leaves [L/P, ...]: this stage's blocks
        b, t = inputs_bt.shape
        s = jax.lax.axis_index(STAGE)
        cos_te, sin_te = ops.model_rope_tables(mcfg, t)

        def apply(p, x_btd, c_te, s_te):
            return nnx.merge(block_def, p)(x_btd, c_te, s_te, coll)

        if policy is not None:  # recomputed only once the backward reaches the layer
            apply = tied_checkpoint(apply, policy)

        def block(p, x_btd):
            return apply(p, x_btd, cos_te, sin_te)

        def tick(carry_btd, emb_btd):
            x_btd = jnp.where(s == 0, emb_btd, carry_btd)  # stage 0 reads the next micro-batch
            for j in range(per_stage):
                x_btd = block(jax.tree.map(lambda a, j=j: a[j], layers), x_btd)
            return jax.lax.ppermute(x_btd, STAGE, forward), x_btd

        emb_mbtd = top.embed_tokens(inputs_bt.reshape(n_micro, b // n_micro, t))
        fill = jnp.zeros((stages - 1, *emb_mbtd.shape[1:]), emb_mbtd.dtype)
        carry0 = jax.lax.pcast(jnp.zeros_like(emb_mbtd[0]), STAGE, to="varying")
        _, out_kbtd = jax.lax.scan(tick, carry0, jnp.concatenate([emb_mbtd, fill]))
        # on the last stage, ticks P-1 .. M+P-2 carry micro-batches 0 .. M-1 through all layers
        y_nd = jnp.where(s == stages - 1, out_kbtd[stages - 1:], 0).reshape(b * t, -1)
        # each stage gets tokens [s·n, (s+1)·n) of the last stage's features and their targets
        y_nd = jax.lax.psum_scatter(y_nd, STAGE, scatter_dimension=0, tiled=True)
        n = b * t // stages
        targets_n = jax.lax.dynamic_slice_in_dim(targets_bt.reshape(b * t), s * n, n)
        logits_1nv = top.logits(top.final_norm(y_nd[None], coll))
        loss = vocab_parallel_cross_entropy(logits_1nv, targets_n[None], coll)  # mean over the stage's share
        return jax.lax.pmean(loss, tuple(a for a in ("data", STAGE) if a in inner.axis_names))

    inner, rows = loss_mesh(mesh)  # without a data axis of size 1 (no all-reduce over one device)
    sharded = jax.shard_map(local, mesh=inner, in_specs=(specs, rows, rows), out_specs=P())
    return lambda params, batch: sharded(params, batch["inputs"], batch["targets"])


def pipeline_placement(cfg: Config, params_like: Any, mesh: Mesh):
    """A `Placement` for a `data x stage x model` mesh: stacked, stage-sharded parameters."""
    from boostjax.sharding.strategies import Placement  # noqa: PLC0415

    stages = mesh.shape[STAGE]
    if cfg.model.n_layers % stages:  # also checked by config.validate; placement may be called directly
        raise ConfigError(f"model.n_layers: {cfg.model.n_layers} layers do not split into stage={stages} "
                          f"equal contiguous stages; fix: pass --n-layers a multiple of {stages}")
    n_micro = microbatches(cfg.train)
    local = cfg.train.batch // mesh.shape["data"]
    if local % n_micro:
        raise ConfigError(f"train.microbatches: the batch per data shard ({local}) is not divisible by "
                          f"{n_micro} micro-batches; fix: pass --microbatches a divisor of {local} or 0 (auto)")
    if local * cfg.train.seq % stages:
        raise ConfigError(f"train.seq: the {local}x{cfg.train.seq} tokens per data shard do not split into "
                          f"stage={stages} equal parts for the head; fix: pass --seq a multiple of {stages}")
    stacked_like = jax.eval_shape(stack_layers, params_like)
    specs = stage_specs(cfg.train.strategy, stacked_like, mesh.shape["model"])
    p_shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    b_shard = NamedSharding(mesh, P("data"))
    loss_fn = pipeline_loss_fn(cfg, mesh, specs, n_micro)
    if cfg.train.pipeline_schedule == "1f1b":  # the same loss; its gradient runs the 1F1B schedule
        loss_fn = onef1b_loss_fn(cfg, mesh, specs, n_micro, forward=loss_fn)
    return Placement(
        loss_fn=loss_fn,
        put_params=lambda p: jax.device_put(stack_layers(p), p_shard),
        put_batch=lambda b: jax.device_put(b, b_shard),
        mesh=mesh,
        specs=specs,
        batch_sharding=b_shard,
        to_state=stack_layers,
        to_canonical=unstack_layers,
        info=pipeline_info(cfg.train),
    )
