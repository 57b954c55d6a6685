"""`tied_checkpoint(..., tie_grads=True)`: the same gradients as `jax.checkpoint`, with a layer's input
cotangent released only together with its parameter gradients; an offload plan's layers use it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from boostjax.config import preset
from boostjax.models.llama import LLaMA, REMAT_POLICIES, TiedLayer, run_schedule
from boostjax.models.remat import tied_checkpoint
from helpers import rel


def _block(params, h, seg):
    """A residual MLP block; `seg` (int) only masks rows, so its cotangent is float0."""
    w1, w2 = params
    y = h + jnp.tanh(h @ w1) @ w2
    return jnp.where((seg >= 0)[:, None], y, h)


def _loss(block, n_layers=3):
    def loss(layers, x, seg):
        h = x
        for p in layers:
            h = block(p, h, seg)
        return jnp.sum(jnp.sin(h))
    return loss


def _inputs(seed=0):
    ks = jax.random.split(jax.random.key(seed), 7)
    layers = [(0.3 * jax.random.normal(ks[2 * i], (8, 16)), 0.3 * jax.random.normal(ks[2 * i + 1], (16, 8)))
              for i in range(3)]
    x = jax.random.normal(ks[6], (5, 8))
    seg = jnp.array([0, 1, -1, 2, 0], jnp.int32)
    return layers, x, seg


def _barriers(jaxpr) -> int:
    """optimization_barrier equations anywhere in a (closed) jaxpr, nested ones included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "optimization_barrier"
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    n += _barriers(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    n += _barriers(sub)
    return n


def test_tied_gradients_match_plain_checkpoint_and_integer_inputs_pass():
    layers, x, seg = _inputs()
    policy = REMAT_POLICIES["full"]
    plain = jax.jit(jax.value_and_grad(_loss(jax.checkpoint(_block, policy=policy)), argnums=(0, 1)))
    tied = jax.jit(jax.value_and_grad(_loss(tied_checkpoint(_block, policy, tie_grads=True)), argnums=(0, 1)))
    (v0, g0), (v1, g1) = plain(layers, x, seg), tied(layers, x, seg)
    # two programs (the barriers change what XLA may fuse): ulps apart at most, here fp32 on ~1e2 entries
    assert abs(float(v1) - float(v0)) <= 1e-6 * abs(float(v0))
    assert rel(g1, g0) < 1e-6, rel(g1, g0)


def test_each_layer_releases_its_cotangent_with_its_weight_gradients():
    """`tie_grads` adds one barrier per layer on the way out, holding the input cotangent and both weight
    gradients (the recomputation's tie to the output cotangent is a data dependence, no barrier)."""
    layers, x, seg = _inputs()
    policy = REMAT_POLICIES["full"]
    counts = {}
    for tie in (False, True):
        grad = jax.grad(_loss(tied_checkpoint(_block, policy, tie_grads=tie)), argnums=(0, 1))
        counts[tie] = _barriers(jax.make_jaxpr(grad)(layers, x, seg).jaxpr)
    assert counts[True] - counts[False] == len(layers), counts
    grad = jax.grad(_loss(tied_checkpoint(_block, policy, tie_grads=True)), argnums=(0, 1))
    outs = [eqn for eqn in jax.make_jaxpr(grad)(layers, x, seg).jaxpr.eqns
            if eqn.primitive.name == "optimization_barrier"]
    shapes = {tuple(tuple(v.aval.shape) for v in eqn.outvars) for eqn in outs}
    assert ((8, 16), (16, 8), (5, 8)) in shapes, shapes  # w1, w2 and the input cotangent, together


def test_a_tied_layer_in_a_schedule_releases_its_weight_gradients_first():
    """`LLaMA.features` runs a schedule's `TiedLayer` (what an offload plan with host state gives its
    single layers) through `tie_grads`: one barrier per such layer, none for a plain policy or an
    unchecked layer (materialised attention: the row-blocked path has barriers of its own)."""
    cfg = preset("tiny", n_layers=2, max_seq_len=16, attention="xla")
    model = LLaMA(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = np.zeros((2, 16), np.int32)

    def count(remat):
        def loss(s):
            return jnp.sum(nnx.merge(graphdef, s).features(tokens, remat=remat))
        return _barriers(jax.make_jaxpr(jax.grad(loss))(state).jaxpr)

    policy = REMAT_POLICIES["full"]
    plain, tied, mixed = count([policy, policy]), count([TiedLayer(policy)] * 2), count([TiedLayer(policy), None])
    assert tied == plain + cfg.n_layers and mixed == plain + 1, (plain, tied, mixed)
    # the same loss and gradients as the plain schedule
    def grads(remat):
        def loss(s):
            return jnp.sum(jnp.sin(nnx.merge(graphdef, s).features(tokens + 3, remat=remat)))
        return jax.jit(jax.value_and_grad(loss))(state)
    (v0, g0), (v1, g1) = grads([policy, policy]), grads([TiedLayer(policy)] * 2)
    assert abs(float(v1) - float(v0)) <= 1e-6 * abs(float(v0)) and rel(g1, g0) < 1e-6, rel(g1, g0)


def test_a_pipeline_stage_runs_tied_layers_like_plain_ones():
    """`run_schedule` (a pipeline stage's layers under an offload plan) accepts `TiedLayer` entries: the
    same loss and gradients as the plain policies, one barrier per tied layer more."""
    layers, x, seg = _inputs()
    policy = REMAT_POLICIES["full"]

    def apply(p, h):
        return _block(p, h, seg)

    def loss(schedule):
        return lambda ps, h: jnp.sum(jnp.sin(run_schedule(apply, ps, h, schedule)))

    plain, tied = [policy] * 3, [TiedLayer(policy), None, TiedLayer(policy)]
    (v0, g0), (v1, g1) = (jax.jit(jax.value_and_grad(loss(s), argnums=(0, 1)))(layers, x) for s in (plain, tied))
    assert abs(float(v1) - float(v0)) <= 1e-6 * abs(float(v0)) and rel(g1, g0) < 1e-6, rel(g1, g0)
    counts = [_barriers(jax.make_jaxpr(jax.grad(loss(s), argnums=(0, 1)))(layers, x).jaxpr) for s in (plain, tied)]
    assert counts[1] - counts[0] == 2, counts
