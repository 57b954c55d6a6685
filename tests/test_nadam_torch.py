"""The "nesterov" optimizer = torch.optim.NAdam(decoupled_weight_decay=True) (AsyncPP's baseline):
against a float64 NumPy transcription of torch's `_single_tensor_nadam`, and its state's sharding rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from boostjax.config import TrainConfig
from boostjax.optim import build_optimizer, make_optimizer, state_specs
from boostjax.optim.nadam_torch import TorchNAdamState

B1, B2, EPS, PSI, WD = 0.99, 0.999, 1e-8, 0.004, 0.1


def _torch_nadam(params, grads, lrs):
    """torch/optim/nadam.py `_single_tensor_nadam` (decoupled weight decay), one tensor, float64."""
    exp_avg, exp_avg_sq, mu_product, out = np.zeros_like(params), np.zeros_like(params), 1.0, []
    param = params.copy()
    for step, (grad, lr) in enumerate(zip(grads, lrs), start=1):
        param = param * (1 - lr * WD)
        bias_correction2 = 1 - B2**step
        mu = B1 * (1.0 - 0.5 * (0.96 ** (step * PSI)))
        mu_next = B1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * PSI)))
        mu_product *= mu
        exp_avg = exp_avg + (grad - exp_avg) * (1 - B1)  # lerp_(grad, 1 - beta1)
        exp_avg_sq = exp_avg_sq * B2 + (1 - B2) * grad * grad
        denom = np.sqrt(exp_avg_sq / bias_correction2) + EPS
        param = param - lr * (1.0 - mu) / (1.0 - mu_product) * grad / denom
        param = param - lr * mu_next / (1.0 - mu_product * mu_next) * exp_avg / denom
        out.append(param.copy())
    return out


def test_matches_torch_nadam_formula_with_weight_decay_and_schedule():
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(5, 3))
    grads = [rng.normal(size=(5, 3)) * s for s in (1.0, 0.3, 2.0, 0.01, 1.0)]  # one tiny step: eps matters less
    sched = optax.linear_schedule(1e-2, 3e-3, 5)
    ref = _torch_nadam(w0, grads, [float(sched(t)) for t in range(5)])
    opt = make_optimizer("nesterov", lr=sched, weight_decay=WD)
    step = jax.jit(lambda g, s, w: opt.update(g, s, w))
    w = jnp.asarray(w0, jnp.float32)
    s = opt.init(w)
    for g, w_ref in zip(grads, ref):
        u, s = step(jnp.asarray(g, jnp.float32), s, w)
        w = optax.apply_updates(w, u)
        # fp32 vs float64: measured <= 9.4e-8 of |w| and <= 7.4e-6 of the distance moved |w - w0|
        assert np.linalg.norm(np.asarray(w) - w_ref) <= 1e-5 * np.linalg.norm(w_ref)
        assert np.linalg.norm(np.asarray(w) - w_ref) <= 1e-4 * np.linalg.norm(w_ref - w0)
    # the schedule matters: optax.nadamw with a constant b1 ends elsewhere
    const = optax.nadamw(sched, B1, B2, EPS, weight_decay=WD)
    wc, sc = jnp.asarray(w0, jnp.float32), const.init(jnp.asarray(w0, jnp.float32))
    for g in grads:
        u, sc = const.update(jnp.asarray(g, jnp.float32), sc, wc)
        wc = optax.apply_updates(wc, u)
    assert np.linalg.norm(np.asarray(wc) - ref[-1]) > 0.1 * np.linalg.norm(ref[-1] - w0)


def test_state_specs_moments_follow_params_counters_replicated():
    params = {"sq": jnp.zeros((4, 4)), "b": jnp.zeros((4,))}
    specs = {"sq": P("model", None), "b": P(None)}
    t = TrainConfig(optimizer="nesterov", steps=10, warmup=1, clip=1.0)
    tx = build_optimizer(t, params)
    opt_like = jax.eval_shape(tx.init, params)
    got = state_specs(t, opt_like, params, specs)
    inner = [x for x in jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, TorchNAdamState))
             if isinstance(x, TorchNAdamState)]
    assert len(inner) == 1
    st = inner[0]
    assert st.mu == specs and st.nu == specs and st.count == P() and st.mu_product == P()


def test_run_scaled_momentum_decay_and_pipedream_lr_tc():
    """psi -1: mu_t = 0.99 (1 - 0.96^(psi t) / 2) reaches 0.9 at 4 % of the run (t = 120 of 3000), as
    torch's 0.004 does at step ~10.4k of the reference's ~250k; T_c 0 = 7/3 of the warmup."""
    from boostjax.config import delay_lr_tc_steps, nesterov_psi
    from boostjax.optim.registry import hyper

    t = TrainConfig(steps=3000, warmup=300)
    psi = nesterov_psi(t)
    assert 0.99 * (1 - 0.5 * 0.96 ** (psi * 120)) == pytest.approx(0.9, rel=1e-9)
    assert 0.99 * (1 - 0.5 * 0.96 ** (0.004 * 10440)) == pytest.approx(0.9, abs=2e-5)
    assert nesterov_psi(TrainConfig(nesterov_psi=0.004)) == 0.004
    assert delay_lr_tc_steps(t) == 700 and delay_lr_tc_steps(TrainConfig(delay_lr_tc=56)) == 56
    assert hyper(t).momentum_decay == psi and hyper(t).t_c == 700
