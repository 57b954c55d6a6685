"""1F1B pipeline schedule over the mesh axis `stage` (PipeDream-flush, https://arxiv.org/abs/2006.09503;
Megatron-LM's interleaving-free 1F1B, https://arxiv.org/abs/2104.04473): activation memory bounded by
the number of stages instead of the number of micro-batches.

The stage layout, parameter specs and head split are GPipe's (`boostjax.sharding.pipeline`); only the
order of work differs. Every stage runs the same program in lockstep (SPMD) over ticks; an idle slot
is computed and masked with `where` (collectives stay unconditional: XLA's CPU runtime deadlocks on
collectives under a stage-dependent `cond`). Stage `s` runs

- the forward of micro-batch `i` at tick `i + s` (stage 0 embeds it; the others receive it from
  `s - 1` by `ppermute`), keeping the `jax.vjp` residuals of its layers in a ring of `2P - 1` slots
  indexed by `i mod (2P - 1)` (a remat policy decides what the residuals are; a residual an offload
  plan's policy moves to pinned host keeps its ring there too);
- on the last stage, in the same tick, the head and loss of micro-batch `i`: its features are
  `psum_scatter`-ed over `stage` so every stage computes the head on 1/P of the tokens, and the
  feature cotangents are `all_gather`-ed back;
- the backward of micro-batch `i` at tick `i + 2(P - 1) - s` from the ring and the cotangent sent by
  `s + 1` (the last stage's own from the head), accumulating fp32 parameter gradients in the carry.

Ticks `0 .. P-2` hold forwards only, `P-1 .. M+P-2` a forward and a backward, `M+P-1 .. M+2P-3`
backwards only, so a stage is busy `M (F + B)` out of `(M + P - 1)(F + B)`: the bubble is GPipe's
`(P - 1) / (M + P - 1)`. Micro-batch `i` stays in flight at stage `s` for `2(P - 1 - s)` ticks
(lockstep: a forward takes a whole tick to reach the next stage), so the ring holds `2P - 1` slots
(stage 0's count; SPMD sizes every stage alike) where GPipe's autodiff keeps all `M + P - 1` ticks.

`onef1b_loss_fn` is a `jax.custom_vjp`: its forward runs the whole schedule and returns the loss, its
backward the saved gradients times the incoming cotangent, so `jax.value_and_grad` of it is the
schedule's gradient. Evaluated without a gradient it is GPipe's forward. The schedule sums its
gradients over `stage`; the sum over `data` is `boostjax.sharding.zero`'s (all-reduced here, and in
`onef1b_grad_fn`, the train step's gradient on a `data` axis, reduce-scattered where ZeRO splits it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from boostjax.config import DATA, MODEL, STAGE, Config
from boostjax.models import ops
from boostjax.models.llama import LLaMA, Block, resolve_remat, run_schedule
from boostjax.models.ops import cast_params
from boostjax.models.collectives import vocab_parallel_cross_entropy
from boostjax.sharding import zero
from boostjax.sharding.mesh import loss_mesh
from boostjax.sharding.rules import STRATEGIES



def ring_slots(stages: int) -> int:
    """Micro-batches whose stage residuals 1F1B keeps per device: `2P - 1`."""
    return 2 * stages - 1


def _in_space(ring: jax.Array, res: jax.Array) -> jax.Array:
    """`ring` in the memory space of the residual it holds: an offload plan's residual lives in host
    memory (its remat policy moved it there), and its ring slots with it."""
    space = jax.typeof(res).memory_space
    return ring if space == jax.memory.Space.Device else jax.device_put(ring, space)


def _like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """`x` with the varying axes of `ref` (a scan carry keeps one type)."""
    return zero.vary(x, tuple(jax.typeof(ref).mat.varying))


def onef1b_loss_fn(cfg: Config, mesh: Mesh, specs: Any, n_micro: int,
                   forward: Callable[[Any, dict], jax.Array], remat: Any = None) -> Callable[[Any, dict], jax.Array]:
    """The mean loss over the global batch whose gradient runs the 1F1B schedule (`forward`: the same
    loss without a gradient, GPipe's forward; `remat` as in `pipeline.pipeline_loss_fn`); the
    gradient is all-reduced over `data`."""
    inner, rows = loss_mesh(mesh)  # without a data axis of size 1 (no all-reduce over one device)
    sharded = zero.reduced_value_and_grad(_local_schedule(cfg, mesh, n_micro, inner.axis_names, remat), inner,
                                          specs, specs, rows, gather=False)

    @jax.custom_vjp
    def loss_fn(params, batch):
        return forward(params, batch)

    def fwd(params, batch):
        loss, grads = sharded(params, batch["inputs"], batch["targets"])
        return loss, grads

    def bwd(grads, ct):
        return jax.tree.map(lambda g: (g * ct).astype(g.dtype), grads), None

    loss_fn.defvjp(fwd, bwd)
    return loss_fn


def onef1b_grad_fn(cfg: Config, mesh: Mesh, specs: Any, split: Any, n_micro: int, remat: Any = None
                   ) -> Callable[[Any, dict], tuple[jax.Array, Any]]:
    """`(params, batch) -> (loss, grads)` of the 1F1B schedule with ZeRO's gradient
    (`boostjax.sharding.zero`): every leaf's fp32 sum reduce-scattered over `data` onto its spec in
    `split` (all-reduced where `split` leaves it whole); the batch holds `grad_accum` micro-batches."""
    inner, rows = loss_mesh(mesh)
    f = zero.reduced_value_and_grad(_local_schedule(cfg, mesh, n_micro, inner.axis_names, remat), inner, specs,
                                    split, rows, gather=cfg.train.zero >= 3, accum=cfg.train.grad_accum,
                                    cast=lambda p: cast_params(p, cfg.train.dtype))
    return lambda params, batch: f(params, batch["inputs"], batch["targets"])


def _local_schedule(cfg: Config, mesh: Mesh, n_micro: int, axis_names: tuple[str, ...], remat: Any = None):
    """The per-device 1F1B program: `(params, inputs_bt, targets_bt) -> (loss, grads)` inside a
    shard_map over `axis_names` (the mesh's, less a `data` axis of size 1): the mean loss over this
    data shard's rows and this device's fp32 share of the global mean's gradient, summed over
    `stage` but not over `data` (`zero.reduced_value_and_grad` reduces it)."""
    mcfg, stages, tp, data = cfg.model, mesh.shape[STAGE], mesh.shape[MODEL], mesh.shape[DATA]
    coll = STRATEGIES[cfg.train.strategy if tp > 1 else "none"].collectives
    top_def, _ = nnx.split(nnx.eval_shape(lambda: LLaMA(replace(mcfg, n_layers=0), rngs=nnx.Rngs(0))))
    block_def, _ = nnx.split(nnx.eval_shape(lambda: Block(mcfg, rngs=nnx.Rngs(0))))
    per_stage, n_ring, last = mcfg.n_layers // stages, ring_slots(stages), stages - 1
    remat = cfg.train.remat if remat is None else remat
    schedule = remat if isinstance(remat, (list, tuple)) else None
    policy = None if schedule is not None else resolve_remat(remat)
    send_fwd = [(i, i + 1) for i in range(last)]
    send_bwd = [(i + 1, i) for i in range(last)]
    scale = 1.0 / (data * stages * n_micro)  # d loss / d (one stage's mean over its token share)
    f32 = jnp.float32
    dp = (DATA,) if DATA in axis_names else ()  # the data-parallel axis, when it has > 1 device

    def local(params, inputs_bt, targets_bt):
        params = cast_params(params, cfg.train.dtype)
        s = jax.lax.axis_index(STAGE)
        b, t = inputs_bt.shape
        mb, n = b // n_micro, b // n_micro * t // stages  # micro-batch rows; head tokens per stage
        tokens_mbt = inputs_bt.reshape(n_micro, mb, t)
        targets_mn = targets_bt.reshape(n_micro, mb * t)
        cos_te, sin_te = ops.model_rope_tables(mcfg, t)
        # local gradients (no per-tick all-reduce): varying over the axes they are summed over at the end
        top = {k: zero.vary(v, (*dp, STAGE)) for k, v in params.items() if k != "layers"}
        layers = [jax.tree.map(lambda a, j=j: zero.vary(a[j], dp), params["layers"]) for j in range(per_stage)]

        def block(p, x_btd):
            return nnx.merge(block_def, p)(x_btd, cos_te, sin_te, coll)

        if policy is not None:
            block = jax.checkpoint(block, policy=policy)

        def stage_fn(ps, x_btd):
            if schedule is not None:  # an offload plan's per-layer schedule of this stage's layers
                return run_schedule(block, ps, x_btd, schedule)
            for p in ps:
                x_btd = block(p, x_btd)
            return x_btd

        def embed(tokens):
            return nnx.merge(top_def, top).embed_tokens(tokens)

        def head_loss(tp_, y_nd, targets_n):
            model = nnx.merge(top_def, {**top, **tp_})
            return vocab_parallel_cross_entropy(model.logits(model.final_norm(y_nd[None], coll)), targets_n[None], coll)

        # one reference trace fixes the residuals' structure; leaves that are this stage's weights or
        # other tick-invariant values are reused, the rest live in the ring
        x0 = jnp.where(s == 0, embed(tokens_mbt[0]), 0)
        y0, vjp0 = jax.vjp(stage_fn, layers, x0)
        res0, res_def = jax.tree.flatten(vjp0)
        invariant = {id(v) for v in (*jax.tree.leaves(layers), cos_te, sin_te)}
        fixed = {k: v for k, v in enumerate(res0) if id(v) in invariant or not isinstance(v, jax.core.Tracer)}
        ringed = [k for k in range(len(res0)) if k not in fixed]

        def tick(carry, tick_t, *, fwd: bool, bwd: bool):
            x_in, g_in, ring, acc, loss_sum = carry
            if fwd:  # forward of micro-batch i = t - s
                i = tick_t - s
                x_btd = jnp.where(s == 0, embed(tokens_mbt[jnp.clip(i, 0, n_micro - 1)]), x_in)
                y_btd, vjp_fn = jax.vjp(stage_fn, layers, x_btd)
                res = jax.tree.leaves(vjp_fn)
                assert len(res) == len(res0) and all(res[k] is v for k, v in fixed.items()
                                                     if isinstance(v, jax.core.Tracer)), "residuals changed"
                slot = jnp.mod(i, n_ring)
                ring = [jax.lax.dynamic_update_index_in_dim(r, _like(res[k], r), slot, 0) for r, k in zip(ring, ringed)]
                x_in = _like(jax.lax.ppermute(y_btd, STAGE, send_fwd), x_in)
            g_head = None
            if fwd and bwd:  # the last stage's micro-batch t - (P - 1): head and loss, split over the stages
                y_nd = jnp.where(s == last, y_btd, 0).reshape(mb * t, -1)
                y_nd = jax.lax.psum_scatter(y_nd, STAGE, scatter_dimension=0, tiled=True)
                targets_n = jax.lax.dynamic_slice_in_dim(targets_mn[tick_t - last], s * n, n)
                head_p = {k: top[k] for k in ("norm", "head")}
                loss, head_vjp = jax.vjp(lambda hp, y: head_loss(hp, y, targets_n), head_p, y_nd)
                d_head, dy_nd = head_vjp(_like(jnp.asarray(scale, loss.dtype), loss))
                acc = {**acc, **{k: acc[k] + _like(d_head[k].astype(f32), acc[k]) for k in d_head}}
                loss_sum = loss_sum + _like(loss.astype(f32), loss_sum)
                g_head = jax.lax.all_gather(dy_nd, STAGE, axis=0, tiled=True).reshape(mb, t, -1)
            if bwd:  # backward of micro-batch j = t - 2(P - 1) + s
                j = tick_t - 2 * last + s
                ok = (j >= 0) & (j < n_micro)
                g_btd = g_in if g_head is None else jnp.where(s == last, g_head.astype(g_in.dtype), g_in)
                g_btd = jnp.where(ok, g_btd, 0)
                slot = jnp.mod(j, n_ring)
                leaves = [fixed.get(k) for k in range(len(res0))]
                for r, k in zip(ring, ringed):
                    leaves[k] = jax.lax.dynamic_index_in_dim(r, slot, 0, keepdims=False)
                d_layers, dx_btd = jax.tree.unflatten(res_def, leaves)(g_btd)
                acc = {**acc, "layers": jax.tree.map(lambda a, g: a + _like(jnp.where(ok, g, 0).astype(f32), a),
                                                     acc["layers"], d_layers)}
                dx_btd = jnp.where(ok, dx_btd, 0)
                emb_ct = jnp.where(s == 0, dx_btd, 0).astype(f32)  # stage 0: the embedding's transpose
                acc = {**acc, "embed": acc["embed"].at[tokens_mbt[jnp.clip(j, 0, n_micro - 1)]].add(
                    _like(emb_ct, acc["embed"]))}
                g_in = _like(jax.lax.ppermute(dx_btd, STAGE, send_bwd), g_in)
            return (x_in, g_in, ring, acc, loss_sum), None

        zeros = lambda like, shape=None, dtype=None: _like(  # noqa: E731
            jnp.zeros(like.shape if shape is None else shape, like.dtype if dtype is None else dtype), like)
        ring0 = [_in_space(zeros(res0[k], (n_ring, *res0[k].shape)), res0[k]) for k in ringed]
        acc0 = {k: zeros(v, dtype=f32) for k, v in top.items()}
        acc0["layers"] = [jax.tree.map(lambda a: zeros(a, dtype=f32), p) for p in layers]
        carry = (zeros(y0), zeros(y0), ring0, acc0, zero.vary(jnp.zeros((), f32), (*dp, STAGE)))
        phases = ((0, last, True, False), (last, n_micro, True, True), (n_micro + last, last, False, True))
        for start, length, fwd, bwd in phases:
            body = lambda c, tt, fwd=fwd, bwd=bwd: tick(c, tt, fwd=fwd, bwd=bwd)  # noqa: E731
            carry, _ = jax.lax.scan(body, carry, start + jnp.arange(length))
        _, _, _, acc, loss_sum = carry
        grads = {k: jax.lax.psum(v, STAGE) for k, v in acc.items() if k != "layers"}
        grads["layers"] = jax.tree.map(lambda *gs: jnp.stack(gs), *acc["layers"])
        return jax.lax.psum(loss_sum, STAGE) / (stages * n_micro), grads

    return local
