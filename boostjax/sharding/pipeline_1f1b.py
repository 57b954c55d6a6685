"""1F1B pipeline schedule over the mesh axis `stage` (PipeDream-flush, https://arxiv.org/abs/2006.09503;
Megatron-LM's interleaving-free 1F1B, https://arxiv.org/abs/2104.04473): activation memory bounded by
the number of stages instead of the number of micro-batches.

The stage layout is GPipe's (`boostjax.sharding.pipeline`); only the order of work differs. Every stage
runs the same program in lockstep over ticks (`_Device`): a forward, the last stage's head split over
the stages, and a backward from a ring of `2P - 1` residual slots. `onef1b_loss_fn` is a
`jax.custom_vjp` whose backward returns the schedule's gradient. The ticks, the ring and the bubble:
docs/pipelines.md ("How 1F1B runs").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
from boostjax.sharding.mesh import loss_mesh_for
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
    inner, rows = loss_mesh_for(cfg, mesh)
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
    inner, rows = loss_mesh_for(cfg, mesh)
    f = zero.reduced_value_and_grad(_local_schedule(cfg, mesh, n_micro, inner.axis_names, remat), inner, specs,
                                    split, rows, gather=cfg.train.zero >= 3, accum=cfg.train.grad_accum,
                                    cast=lambda p: cast_params(p, cfg.train.dtype))
    return lambda params, batch: f(params, batch["inputs"], batch["targets"])


def _local_schedule(cfg: Config, mesh: Mesh, n_micro: int, axis_names: tuple[str, ...], remat: Any = None):
    """The per-device 1F1B program: `(params, inputs_bt, targets_bt) -> (loss, grads)` inside a
    shard_map over `axis_names` (the mesh's, less a `data` axis of size 1): the mean loss over this
    data shard's rows and this device's fp32 share of the global mean's gradient, summed over
    `stage` but not over `data` (`zero.reduced_value_and_grad` reduces it)."""
    plan = _Plan.of(cfg, mesh, n_micro, axis_names, remat)

    def local(params, inputs_bt, targets_bt):
        return _Device(plan, params, inputs_bt, targets_bt).run()

    return local


@dataclass(frozen=True)
class _Plan:
    """What every trace of the schedule shares: the model's pieces, the mesh's sizes, the remat."""
    cfg: Config
    n_micro: int
    stages: int
    data: int
    coll: Any  # the TP strategy's collectives
    top_def: Any  # graph of the model without layers (embedding, final norm, head)
    block_def: Any  # graph of one layer
    per_stage: int  # layers per stage
    schedule: Any  # an offload plan's per-layer remat schedule, or None
    policy: Any  # the remat policy of every layer (None: no checkpoint, or a `schedule`)
    dp: tuple[str, ...]  # the data-parallel axis, when it has > 1 device

    @classmethod
    def of(cls, cfg: Config, mesh: Mesh, n_micro: int, axis_names: tuple[str, ...], remat: Any) -> "_Plan":
        mcfg, stages, tp, data = cfg.model, mesh.shape[STAGE], mesh.shape[MODEL], mesh.shape[DATA]
        coll = STRATEGIES[cfg.train.strategy if tp > 1 else "none"].collectives
        top_def, _ = nnx.split(nnx.eval_shape(lambda: LLaMA(replace(mcfg, n_layers=0), rngs=nnx.Rngs(0))))
        block_def, _ = nnx.split(nnx.eval_shape(lambda: Block(mcfg, rngs=nnx.Rngs(0))))
        remat = cfg.train.remat if remat is None else remat
        schedule = remat if isinstance(remat, (list, tuple)) else None
        policy = None if schedule is not None else resolve_remat(remat)
        return cls(cfg, n_micro, stages, data, coll, top_def, block_def, mcfg.n_layers // stages, schedule, policy,
                   (DATA,) if DATA in axis_names else ())

    @property
    def last(self) -> int:
        return self.stages - 1

    @property
    def n_ring(self) -> int:
        return ring_slots(self.stages)

    @property
    def send_fwd(self) -> list[tuple[int, int]]:
        return [(i, i + 1) for i in range(self.last)]

    @property
    def send_bwd(self) -> list[tuple[int, int]]:
        return [(i + 1, i) for i in range(self.last)]

    @property
    def scale(self) -> float:
        """d loss / d (one stage's mean over its token share)."""
        return 1.0 / (self.data * self.stages * self.n_micro)


def _zeros(like: jax.Array, shape: tuple[int, ...] | None = None, dtype: Any = None) -> jax.Array:
    """Zeros of `like`'s shape and dtype (or the given ones) with `like`'s varying axes."""
    return _like(jnp.zeros(like.shape if shape is None else shape, like.dtype if dtype is None else dtype), like)


class _Device:
    """One device's trace of the schedule: its stage's layers and micro-batches, the reference trace
    that fixes the residuals' structure, and the three kinds of tick work (forward, head, backward)."""

    def __init__(self, plan: _Plan, params: Any, inputs_bt: jax.Array, targets_bt: jax.Array):
        self.p = p = plan
        params = cast_params(params, p.cfg.train.dtype)
        self.s = jax.lax.axis_index(STAGE)
        b, t = inputs_bt.shape
        self.mb, self.n = b // p.n_micro, b // p.n_micro * t // p.stages  # micro-batch rows; head tokens per stage
        self.t = t
        self.tokens_mbt = inputs_bt.reshape(p.n_micro, self.mb, t)
        self.targets_mn = targets_bt.reshape(p.n_micro, self.mb * t)
        self.cos_te, self.sin_te = ops.model_rope_tables(p.cfg.model, t)
        # local gradients (no per-tick all-reduce): varying over the axes they are summed over at the end
        self.top = {k: zero.vary(v, (*p.dp, STAGE)) for k, v in params.items() if k != "layers"}
        self.layers = [jax.tree.map(lambda a, j=j: zero.vary(a[j], p.dp), params["layers"]) for j in range(p.per_stage)]
        self.block = self._block if p.policy is None else jax.checkpoint(self._block, policy=p.policy)
        self._reference()

    def _block(self, p, x_btd):
        return nnx.merge(self.p.block_def, p)(x_btd, self.cos_te, self.sin_te, self.p.coll)

    def stage_fn(self, ps, x_btd):
        if self.p.schedule is not None:  # an offload plan's per-layer schedule of this stage's layers
            return run_schedule(self.block, ps, x_btd, self.p.schedule)
        for p in ps:
            x_btd = self.block(p, x_btd)
        return x_btd

    def embed(self, tokens):
        return nnx.merge(self.p.top_def, self.top).embed_tokens(tokens)

    def head_loss(self, tp_, y_nd, targets_n):
        model = nnx.merge(self.p.top_def, {**self.top, **tp_})
        return vocab_parallel_cross_entropy(model.logits(model.final_norm(y_nd[None], self.p.coll)), targets_n[None],
                                            self.p.coll)

    def _reference(self) -> None:
        """One reference trace fixes the residuals' structure; leaves that are this stage's weights or
        other tick-invariant values are reused, the rest live in the ring."""
        x0 = jnp.where(self.s == 0, self.embed(self.tokens_mbt[0]), 0)
        self.y0, vjp0 = jax.vjp(self.stage_fn, self.layers, x0)
        self.res0, self.res_def = jax.tree.flatten(vjp0)
        invariant = {id(v) for v in (*jax.tree.leaves(self.layers), self.cos_te, self.sin_te)}
        self.fixed = {k: v for k, v in enumerate(self.res0)
                      if id(v) in invariant or not isinstance(v, jax.core.Tracer)}
        self.ringed = [k for k in range(len(self.res0)) if k not in self.fixed]

    def forward(self, x_in, ring, tick_t):
        """Forward of micro-batch i = t - s: its residuals into the ring, its output to stage s + 1."""
        p, s = self.p, self.s
        i = tick_t - s
        x_btd = jnp.where(s == 0, self.embed(self.tokens_mbt[jnp.clip(i, 0, p.n_micro - 1)]), x_in)
        y_btd, vjp_fn = jax.vjp(self.stage_fn, self.layers, x_btd)
        res = jax.tree.leaves(vjp_fn)
        assert len(res) == len(self.res0) and all(res[k] is v for k, v in self.fixed.items()
                                                  if isinstance(v, jax.core.Tracer)), "residuals changed"
        slot = jnp.mod(i, p.n_ring)
        ring = [jax.lax.dynamic_update_index_in_dim(r, _like(res[k], r), slot, 0) for r, k in zip(ring, self.ringed)]
        x_in = _like(jax.lax.ppermute(y_btd, STAGE, p.send_fwd), x_in)
        return x_in, ring, y_btd

    def head(self, y_btd, acc, loss_sum, tick_t):
        """The last stage's micro-batch t - (P - 1): head and loss, split over the stages; returns the
        feature cotangents gathered back."""
        p, s, mb, t, n = self.p, self.s, self.mb, self.t, self.n
        y_nd = jnp.where(s == p.last, y_btd, 0).reshape(mb * t, -1)
        y_nd = jax.lax.psum_scatter(y_nd, STAGE, scatter_dimension=0, tiled=True)
        targets_n = jax.lax.dynamic_slice_in_dim(self.targets_mn[tick_t - p.last], s * n, n)
        head_p = {k: self.top[k] for k in ("norm", "head")}
        loss, head_vjp = jax.vjp(lambda hp, y: self.head_loss(hp, y, targets_n), head_p, y_nd)
        d_head, dy_nd = head_vjp(_like(jnp.asarray(p.scale, loss.dtype), loss))
        acc = {**acc, **{k: acc[k] + _like(d_head[k].astype(jnp.float32), acc[k]) for k in d_head}}
        loss_sum = loss_sum + _like(loss.astype(jnp.float32), loss_sum)
        g_head = jax.lax.all_gather(dy_nd, STAGE, axis=0, tiled=True).reshape(mb, t, -1)
        return acc, loss_sum, g_head

    def backward(self, g_in, g_head, ring, acc, tick_t):
        """Backward of micro-batch j = t - 2(P - 1) + s from the ring: gradients accumulated, the input's
        cotangent to stage s - 1 (stage 0: into the embedding)."""
        p, s, f32 = self.p, self.s, jnp.float32
        j = tick_t - 2 * p.last + s
        ok = (j >= 0) & (j < p.n_micro)
        g_btd = g_in if g_head is None else jnp.where(s == p.last, g_head.astype(g_in.dtype), g_in)
        g_btd = jnp.where(ok, g_btd, 0)
        slot = jnp.mod(j, p.n_ring)
        leaves = [self.fixed.get(k) for k in range(len(self.res0))]
        for r, k in zip(ring, self.ringed):
            leaves[k] = jax.lax.dynamic_index_in_dim(r, slot, 0, keepdims=False)
        d_layers, dx_btd = jax.tree.unflatten(self.res_def, leaves)(g_btd)
        acc = {**acc, "layers": jax.tree.map(lambda a, g: a + _like(jnp.where(ok, g, 0).astype(f32), a),
                                             acc["layers"], d_layers)}
        dx_btd = jnp.where(ok, dx_btd, 0)
        emb_ct = jnp.where(s == 0, dx_btd, 0).astype(f32)  # stage 0: the embedding's transpose
        acc = {**acc, "embed": acc["embed"].at[self.tokens_mbt[jnp.clip(j, 0, p.n_micro - 1)]].add(
            _like(emb_ct, acc["embed"]))}
        g_in = _like(jax.lax.ppermute(dx_btd, STAGE, p.send_bwd), g_in)
        return g_in, acc

    def tick(self, carry, tick_t, *, fwd: bool, bwd: bool):
        x_in, g_in, ring, acc, loss_sum = carry
        if fwd:
            x_in, ring, y_btd = self.forward(x_in, ring, tick_t)
        g_head = None
        if fwd and bwd:
            acc, loss_sum, g_head = self.head(y_btd, acc, loss_sum, tick_t)
        if bwd:
            g_in, acc = self.backward(g_in, g_head, ring, acc, tick_t)
        return (x_in, g_in, ring, acc, loss_sum), None

    def run(self):
        """Ticks `0 .. P-2` forwards only, `P-1 .. M+P-2` both, the rest backwards only; then the loss
        and the gradients summed over `stage`."""
        p, f32, res0 = self.p, jnp.float32, self.res0
        ring0 = [_in_space(_zeros(res0[k], (p.n_ring, *res0[k].shape)), res0[k]) for k in self.ringed]
        acc0 = {k: _zeros(v, dtype=f32) for k, v in self.top.items()}
        acc0["layers"] = [jax.tree.map(lambda a: _zeros(a, dtype=f32), lp) for lp in self.layers]
        carry = (_zeros(self.y0), _zeros(self.y0), ring0, acc0, zero.vary(jnp.zeros((), f32), (*p.dp, STAGE)))
        phases = ((0, p.last, True, False), (p.last, p.n_micro, True, True), (p.n_micro + p.last, p.last, False, True))
        for start, length, fwd, bwd in phases:
            body = lambda c, tt, fwd=fwd, bwd=bwd: self.tick(c, tt, fwd=fwd, bwd=bwd)  # noqa: E731
            carry, _ = jax.lax.scan(body, carry, start + jnp.arange(length))
        _, _, _, acc, loss_sum = carry
        grads = {k: jax.lax.psum(v, STAGE) for k, v in acc.items() if k != "layers"}
        grads["layers"] = jax.tree.map(lambda *gs: jnp.stack(gs), *acc["layers"])
        return jax.lax.psum(loss_sum, STAGE) / (p.stages * p.n_micro), grads
