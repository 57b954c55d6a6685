"""Every optimizer of the registry through one conformance suite (as optax tests its aliases):
jit, finite updates shaped like the params, a stable state tree, a decreasing quadratic, clipping;
plus the registry itself (names = config's Literal, the injected learning rate, the sharding rule
of each optimizer's state)."""

from __future__ import annotations

import typing
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from boostjax.config import OPTIMIZERS as CONFIG_OPTIMIZERS
from boostjax.config import TrainConfig
from boostjax.optim import (OPTIMIZERS, assign_stages, build_optimizer, current_lr, delay_init, lr_schedule,
                            make_optimizer, state_specs)
from boostjax.optim.registry import hyper, make
from helpers import assert_close_ulps

# the same chain compiled two ways (clipping inside or before it, the rate injected or inside, the
# schedule alone): measured equal on SSE4_2, AVX, AVX2 and AVX-512; 4 ulps allow another fusion's FMAs
ULPS_PROGRAMS = 4


def _params() -> dict:
    ks = iter(jax.random.split(jax.random.PRNGKey(0), 8))
    layer = {"w": jax.random.normal(next(ks), (4, 6)), "a_qkv": jax.random.normal(next(ks), (4, 3, 2)),
             "norm": jnp.ones((4,))}
    return {"embed": jax.random.normal(next(ks), (8, 4)), "layers": {0: layer}, "head": jax.random.normal(next(ks), (4, 8))}


# one rotated matrix keeps the suite cheap (grouped leaves: test_rotation); `()` is how
# boostjax.sharding.rules.rotation_mask names a plain matrix
MASK = {"embed": False, "layers": {0: {"w": (), "a_qkv": False, "norm": False}}, "head": False}  # () = True
TARGET = jax.tree.map(lambda p: 3.0 + jnp.zeros_like(p), _params())


def _loss(p: dict) -> jax.Array:
    """A quadratic whose gradient norm (~60) is far above the clip (1.0)."""
    return sum(jnp.sum((x - t) ** 2) for x, t in zip(jax.tree.leaves(p), jax.tree.leaves(TARGET)))


def _config(name: str, clip: float) -> TrainConfig:
    return TrainConfig(optimizer=name, steps=20, warmup=2, lr=0.05, clip=clip, rot_refresh=2)


def _run(tx: optax.GradientTransformation, grads_of, steps: int = 3, jit_init: bool = True):
    """[(params, state, update, loss before the step)] after init and each of `steps` jitted steps."""
    @jax.jit
    def step(p, s):
        u, s = tx.update(grads_of(p), s, p)
        return optax.apply_updates(p, u), s, u, _loss(p)

    p = _params()
    s = (jax.jit(tx.init) if jit_init else tx.init)(p)
    out = [(p, s, None, None)]
    for _ in range(steps):
        p, s, u, loss = step(p, s)
        out.append(jax.device_get((p, s, u, loss)))
    return out


def _clipped_grad(p: dict) -> dict:
    """The gradient through optax's own clip: the same ops as the chain's first link."""
    return optax.clip_by_global_norm(1.0).update(jax.grad(_loss)(p), optax.EmptyState())[0]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_conforms(name):
    params = _params()
    tx = build_optimizer(_config(name, 1.0), params, rotation_mask=MASK)
    run = _run(tx, jax.grad(_loss))
    s0_def = jax.tree.structure(run[0][1])
    s0_shapes = [(x.shape, x.dtype) for x in jax.tree.leaves(run[0][1])]
    lr = jax.jit(lr_schedule(_config(name, 1.0)))  # as the step computes it (eager rounds differently)
    for t, (p, s, u, _) in enumerate(run[1:], 1):
        assert jax.tree.structure(s) == s0_def, (name, t)  # the state tree never changes shape or dtype
        assert [(x.shape, x.dtype) for x in jax.tree.leaves(s)] == s0_shapes, (name, t)
        assert jax.tree.structure(u) == jax.tree.structure(params)
        for x, q in zip(jax.tree.leaves(u), jax.tree.leaves(params)):
            assert x.shape == q.shape and x.dtype == q.dtype and np.all(np.isfinite(x)), (name, t)
        # the rate the step used; the same scalar schedule in two programs: FMA contraction may differ by an ulp
        assert_close_ulps(current_lr(s), lr(jnp.int32(t - 1)), ulps=ULPS_PROGRAMS)
    losses = [float(r[3]) for r in run[1:]]
    assert losses[-1] < losses[0], (name, losses)
    # clipping first: the clipped optimizer on the raw gradient = the unclipped one on the clipped
    # gradient; to a few ulps when clipping is the chain's first link (the same ops in another program),
    # to rounding where adam8bit folds the scale into its update (measured <= 1e-7 relative)
    ref = _run(build_optimizer(_config(name, 0.0), params, rotation_mask=MASK), _clipped_grad, jit_init=False)
    for x, y in zip(jax.tree.leaves(run[-1][0]), jax.tree.leaves(ref[-1][0])):
        if OPTIMIZERS[name].fused_clip:
            assert np.linalg.norm(x - y) <= 1e-5 * np.linalg.norm(y), name
        else:  # two programs (clip inside the chain vs before it), the same arithmetic
            assert_close_ulps(x, y, ulps=ULPS_PROGRAMS)
    moved = max(float(np.linalg.norm(a - b)) for a, b in zip(jax.tree.leaves(run[-1][0]), jax.tree.leaves(params)))
    assert moved > 1e-3, name


def test_registry_names_equal_config_literal_and_the_old_names_still_build():
    hints = typing.get_type_hints(TrainConfig)
    assert tuple(OPTIMIZERS) == typing.get_args(hints["optimizer"]) == CONFIG_OPTIMIZERS
    assert isinstance(make_optimizer("pipedream", lr=1e-2), optax.GradientTransformation)  # = adamw
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        make_optimizer("sgd")
    with pytest.raises(ValueError, match="stages"):
        build_optimizer(replace(_config("pipedream-lr", 1.0), pipeline_delay=2), _params())
    for name, kw in (("pipedream-lr", {}), ("rotation", {"stage_aware_refresh": True})):
        with pytest.raises(ValueError, match="stages_tree"):
            make_optimizer(name, **kw)
    with pytest.raises(ValueError, match="clip"):
        make_optimizer("adamw", clip=-1.0)
    with pytest.raises(TypeError, match="lrr"):
        make_optimizer("adamw", lrr=1.0)


def test_injected_learning_rate_equals_the_schedule():
    """build_optimizer (learning rate injected) = the same chain with the schedule inside, to a few ulps
    (PipeDream-LR: clipping, AdamW and a per-stage scale under the injection)."""
    params, name = _params(), "pipedream-lr"
    t = replace(_config(name, 1.0), pipeline_delay=2, stage_aware_refresh=True)
    stages = {"embed": 0, "layers": {0: {"w": 0, "a_qkv": 0, "norm": 1}}, "head": 1}
    injected = _run(build_optimizer(t, params, rotation_mask=MASK, stages=stages), jax.grad(_loss), 4)
    plain = _run(make(name, lr_schedule(t), hyper(t, rotation_mask=MASK, stages=stages)), jax.grad(_loss), 4)
    for (p1, *_), (p2, *_) in zip(injected, plain):  # two programs (injected vs inner rate), the same arithmetic
        assert_close_ulps(p1, p2, ulps=ULPS_PROGRAMS)


def test_state_specs_follow_params_and_each_optimizers_replicated_fields():
    params = {"sq": jnp.zeros((4, 4)), "big": jnp.zeros((64, 64)), "b": jnp.zeros((4,))}
    specs = {"sq": P("model", None), "big": P(None, "model"), "b": P(None)}
    stages = {"sq": 0, "big": 1, "b": 1}
    for name, fields in (("rotation", ("basis_l", "basis_r", "stat_l", "stat_r")), ("adam8bit", ("codes", "absmax"))):
        t = replace(_config(name, 1.0), pipeline_delay=2)
        tx = build_optimizer(t, params, stages=stages)
        opt_like = jax.eval_shape(lambda p: (tx.init(p), delay_init(p, stages, 2)), params)
        got = state_specs(t, opt_like, params, specs)
        flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(
            got, is_leaf=lambda x: isinstance(x, P))[0]}
        for key, spec in flat.items():
            if ".history" in key:  # the delay ring buffer: the parameter's spec behind its depth axis
                leaf = key.rsplit("'", 2)[-2]
                assert spec == P(None, *specs[leaf]), key
            elif any(f".{f}" in key for f in fields) or "count" in key or "learning_rate" in key:
                assert spec == P(), key
            elif ".mu" in key or ".nu" in key:  # moments: the parameter's own spec
                assert spec == P(*specs[key.rsplit("'", 2)[-2]]), key
        assert sum(f".{fields[0]}" in k for k in flat), name  # the replicated fields are there (a 4x4 basis too)
    assert flat["[0].inner_state.mu['sq']"] == P("model", None) and flat["[0].inner_state.mu['big'].codes"] == P()
    assert flat["[1].history['sq']"] == P(None, "model", None) and flat["[0].hyperparams['learning_rate']"] == P()
    # a pipeline's stacked layers: the ring stacks copies in front of [L, ...]; per-layer delays replicated
    stacked, st_specs = {"layers": {"w": jnp.zeros((2, 4, 4))}}, {"layers": {"w": P("stage", "model", None)}}
    t = replace(_config("adamw", 1.0), pipeline_delay=2)
    stages = assign_stages(stacked, 2, 2)
    opt_like = jax.eval_shape(lambda p: (build_optimizer(t, p).init(p), delay_init(p, stages, 2)), stacked)
    got = state_specs(t, opt_like, stacked, st_specs)
    assert got[1].history["layers"]["w"] == P(None, "stage", "model", None) and got[1].lags["layers"]["w"] == P()
    assert got[0].inner_state[1][0].mu["layers"]["w"] == P("stage", "model", None)  # (clip, adamw(adam, ...))
