"""Pipeline parallelism over the mesh axis `stage` (GPipe here, 1F1B in `pipeline_1f1b`), composed with
`data` and every TP strategy.

Layout. The training state keeps the blocks *stacked*: `params["layers"]` is one Block-shaped tree
whose leaves carry a leading layer axis `[L, ...]`, sharded `P("stage", *tp_spec)` (`boostjax.sharding.rules`: logical axis `layers` -> `stage`), so
stage `s` holds exactly its contiguous layers `[s·L/P, (s+1)·L/P)`. Embedding, final norm and LM head
keep their TP spec and are replicated over `stage`; only stage 0 uses the embedding (the others
contribute zero to its gradient), and every stage runs norm and head on its share of the tokens
(below). `boostjax.models.stacking` converts to and from the canonical
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
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from boostjax.config import DATA, MODEL, STAGE, Config, TrainConfig
from boostjax.models import ops
from boostjax.models.llama import LLaMA, Block, resolve_remat, run_schedule
from boostjax.models.ops import cast_params
from boostjax.models.remat import tied_checkpoint
from boostjax.models.collectives import vocab_parallel_cross_entropy
from boostjax.sharding import zero
from boostjax.sharding.mesh import loss_mesh_for
from boostjax.sharding.pipeline_1f1b import ring_slots
from boostjax.sharding.rules import STRATEGIES



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


# -- the pipelined loss ------------------------------------------------------------------------------
def stage_loss(cfg: Config, mesh: Mesh, n_micro: int, remat: Any = None) -> Callable[..., jax.Array]:
    """`local(params, inputs_bt, targets_bt)`: one device's GPipe-scheduled loss inside a `shard_map`
    over `mesh` (`data` may be absent), the mean over its data shard's rows (reduced over `stage`).
    `remat`: a policy name (default `cfg.train.remat`), or a per-layer schedule of one stage's
    layers (an offload plan's: every stage applies it to its own layers)."""
    mcfg, stages, tp = cfg.model, mesh.shape[STAGE], mesh.shape[MODEL]
    coll = STRATEGIES[cfg.train.strategy if tp > 1 else "none"].collectives
    top_def, _ = nnx.split(nnx.eval_shape(lambda: LLaMA(replace(mcfg, n_layers=0), rngs=nnx.Rngs(0))))
    block_def, _ = nnx.split(nnx.eval_shape(lambda: Block(mcfg, rngs=nnx.Rngs(0))))
    per_stage = mcfg.n_layers // stages
    remat = cfg.train.remat if remat is None else remat
    schedule = remat if isinstance(remat, (list, tuple)) else None
    policy = None if schedule is not None else resolve_remat(remat)
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
            mine = [jax.tree.map(lambda a, j=j: a[j], layers) for j in range(per_stage)]
            if schedule is not None:
                x_btd = run_schedule(block, mine, x_btd, schedule)
            for p in (mine if schedule is None else ()):
                x_btd = block(p, x_btd)
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
        return jax.lax.pmean(loss, STAGE)

    return local


def pipeline_loss_fn(cfg: Config, mesh: Mesh, specs: Any, n_micro: int, remat: Any = None
                     ) -> Callable[[Any, dict], jax.Array]:
    """The mean loss over the global batch, GPipe-scheduled over `stage` inside `shard_map`
    (`remat` as in `stage_loss`)."""
    inner, rows = loss_mesh_for(cfg, mesh)
    local = stage_loss(cfg, mesh, n_micro, remat)

    def mean(*args):
        loss = local(*args)
        return jax.lax.pmean(loss, DATA) if DATA in inner.axis_names else loss

    sharded = jax.shard_map(mean, mesh=inner, in_specs=(specs, rows, rows), out_specs=P())
    return lambda params, batch: sharded(params, batch["inputs"], batch["targets"])


def pipeline_grad_fn(cfg: Config, mesh: Mesh, specs: Any, split: Any, n_micro: int, remat: Any = None
                     ) -> Callable[[Any, dict], tuple[jax.Array, Any]]:
    """`(params, batch) -> (loss, grads)` of the GPipe loss with ZeRO's gradient
    (`boostjax.sharding.zero`): every leaf reduce-scattered over `data` onto its spec in `split`
    (all-reduced where `split` leaves it whole); the batch holds `grad_accum` micro-batches."""
    inner, rows = loss_mesh_for(cfg, mesh)
    f = zero.zero_value_and_grad(stage_loss(cfg, mesh, n_micro, remat), inner, specs, split, rows,
                                 gather=cfg.train.zero >= 3, accum=cfg.train.grad_accum,
                                 cast=lambda p: cast_params(p, cfg.train.dtype))
    return lambda params, batch: f(params, batch["inputs"], batch["targets"])
