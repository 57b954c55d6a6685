"""`--factor-lr start-rms` (`boostjax.optim.factor_lr`): each low-rank factor's AdamW direction scaled by its
start RMS over the median RMS of the other matrices, weight decay not scaled; against a numpy transcription
of AdamW, on a tiny model's real leaves and roles, and through training."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import optax
import pytest

from boostjax.config import Config, ConfigError, TrainConfig, validate
from boostjax.models.llama import init_model
from boostjax.optim.factor_lr import FactorScaleState, adamw_by_start, start_scales
from boostjax.optim.registry import build_optimizer
from boostjax.sharding import rules

from helpers import MICRO

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.95, 1e-8, 0.1


def _cola_params(seed: int = 0):
    cfg = replace(MICRO, kind="cola")
    _, params = init_model(Config(cfg, TrainConfig(seed=seed)))
    return cfg, params, rules.logical_axes(cfg)


def _rms(x, axes):
    return np.sqrt(np.mean(np.square(np.asarray(x, np.float64)), axis=axes, keepdims=True))


def test_roles_name_factors_matrices_and_vectors():
    _, params, axes = _cola_params()
    roles = rules.factor_roles(axes)
    flat = {jax.tree_util.keystr(p): r for p, r in jax.tree_util.tree_flatten_with_path(
        roles, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str))[0]}
    kinds = {k: v[0] for k, v in flat.items()}
    assert kinds["['embed']"] == "matrix"
    assert all(v == "factor" for k, v in kinds.items() if "['a_" in k or "['b_" in k), kinds
    assert all(v == "" for k, v in kinds.items() if k.endswith("['norm']")), kinds
    assert any(v == "factor" for v in kinds.values())


def test_update_is_adamw_with_the_factor_direction_scaled():
    """Two steps against numpy: AdamW's bias-corrected direction times rms(p0)/median rms, then + wd·p, × −lr."""
    _, params, axes = _cola_params()
    roles = rules.factor_roles(axes)
    rng = np.random.default_rng(3)
    # factors far from the dense scale, as a linearised CoLA start leaves them
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: p * (1e-3 if "a_" in jax.tree_util.keystr(path) else 1e2 if "b_" in jax.tree_util.keystr(path)
                             else 1.0), params)
    tx = adamw_by_start(LR, B1, B2, EPS, WD, roles)
    state = tx.init(params)
    scales = start_scales(params, roles)
    leaves, tree = jax.tree.flatten(params)
    role_leaves = tree.flatten_up_to(roles)
    ref = np.median(np.concatenate([_rms(p, a).reshape(-1) for p, (r, a) in zip(leaves, role_leaves) if r == "matrix"]))
    for p, s, (r, a) in zip(leaves, jax.tree.leaves(scales), role_leaves):
        want = _rms(p, a) / ref if r == "factor" else 1.0
        np.testing.assert_allclose(np.asarray(s), want, rtol=1e-5)
    p_np = [np.asarray(x, np.float64) for x in leaves]
    m = [np.zeros_like(x) for x in p_np]
    v = [np.zeros_like(x) for x in p_np]
    p_jx = params
    for t in (1, 2):
        g = [rng.standard_normal(x.shape) for x in p_np]
        upd, state = tx.update(tree.unflatten([x.astype(np.float32) for x in g]), state, p_jx)
        p_jx = optax.apply_updates(p_jx, upd)
        for i, (got, s) in enumerate(zip(jax.tree.leaves(upd), jax.tree.leaves(scales))):
            m[i] = B1 * m[i] + (1 - B1) * g[i]
            v[i] = B2 * v[i] + (1 - B2) * g[i] ** 2
            d = (m[i] / (1 - B1 ** t)) / (np.sqrt(v[i] / (1 - B2 ** t)) + EPS)
            want = -LR * (d * np.asarray(s, np.float64) + WD * p_np[i])
            p_np[i] = p_np[i] + want
            err = np.linalg.norm(np.asarray(got, np.float64) - want)
            assert err <= 1e-5 * np.linalg.norm(want), (t, i, err, np.linalg.norm(want))
    assert isinstance(state[1], FactorScaleState)


def test_equal_scales_give_adamw():
    """Factors already at the median matrix scale: the chain is optax.adamw (ulps: a multiply by ~1)."""
    _, params, axes = _cola_params()
    roles = rules.factor_roles(axes)
    leaves, tree = jax.tree.flatten(params)
    role_leaves = tree.flatten_up_to(roles)
    ref = np.median(np.concatenate([_rms(p, a).reshape(-1) for p, (r, a) in zip(leaves, role_leaves) if r == "matrix"]))
    params = tree.unflatten([p / _rms(p, a).astype(np.float32) * np.float32(ref) if r == "factor" else p
                             for p, (r, a) in zip(leaves, role_leaves)])
    g = jax.tree.map(lambda p: np.random.default_rng(p.size).standard_normal(p.shape).astype(np.float32), params)
    got, _ = adamw_by_start(LR, B1, B2, EPS, WD, roles).update(g, adamw_by_start(LR, B1, B2, EPS, WD, roles).init(params), params)
    want, _ = optax.adamw(LR, B1, B2, EPS, weight_decay=WD).update(g, optax.adamw(LR, B1, B2, EPS, weight_decay=WD).init(params), params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_build_optimizer_follows_the_field():
    cfg, params, axes = _cola_params()
    roles = rules.factor_roles(axes)
    fixed = build_optimizer(TrainConfig(), params, factor_roles=roles).init(params)
    scaled = build_optimizer(TrainConfig(factor_lr="start-rms"), params, factor_roles=roles).init(params)
    has = lambda s: any(isinstance(x, FactorScaleState) for x in jax.tree.leaves(  # noqa: E731
        s, is_leaf=lambda x: isinstance(x, FactorScaleState)))
    assert not has(fixed) and has(scaled)


@pytest.mark.parametrize("train_kw, model_kw, needle", [
    ({"factor_lr": "start-rms", "optimizer": "muon"}, {"kind": "cola"}, "--optimizer adamw"),
    ({"factor_lr": "start-rms"}, {"kind": "llama"}, "--model svd, cola or lax"),
    ({"factor_lr": "sometimes"}, {"kind": "cola"}, "--factor-lr fixed or start-rms"),
])
def test_bad_settings_are_refused_naming_the_fix(train_kw, model_kw, needle):
    with pytest.raises(ConfigError, match="train.factor_lr") as err:
        validate(Config(replace(MICRO, **model_kw), TrainConfig(**train_kw)))
    assert needle in str(err.value)


def test_a_start_with_factors_off_scale_trains_with_start_rms(tmp_path):
    """Wiring: a CoLA model whose A is 100x small and B 100x large (as a linearised start leaves them) trains
    through `train` with start-rms (the payoff at SmolLM2's scale is measured in real_finetune_long)."""
    from boostjax import train

    cfg, params, _ = _cola_params()
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: p * (1e-2 if "['a_" in jax.tree_util.keystr(path) else 1e2 if "['b_" in jax.tree_util.keystr(path)
                             else 1.0), params)
    t = TrainConfig(steps=20, batch=8, seq=32, lr=3e-3, log_every=5, eval_every=20, eval_batches=1, ckpt_every=20,
                    progress=False, factor_lr="start-rms", out=str(tmp_path / "run"))
    res = train(Config(cfg, t), init=params)
    assert res.losses[-1] < 0.92 * res.losses[0], res.losses
