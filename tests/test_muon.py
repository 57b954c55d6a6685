"""Muon (`boostjax.optim.muon`) against a numpy transcription of its update: Newton–Schulz by hand
(and its relation to the SVD polar factor U Vᵀ), Nesterov momentum with optax's bias correction,
the AdamW-matched RMS scale and weight decay; the non-matrix leaves against optax.adamw; stacked
matrices one by one; which leaves of a LLaMA get Muon; PipeDream-2BW + Muon on a stage mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dataclasses import replace

from boostjax.config import Config, ModelConfig, TrainConfig
from boostjax.data import BatchIterator, load_corpus
from boostjax.models.llama import init_model
from boostjax.optim.muon import matrix_dims, muon_adamw, muon_labels
from boostjax.sharding import rules
from boostjax.training.step import build_step_fns

NS = (3.4445, -4.7750, 2.0315)  # optax's (and Keller Jordan's) quintic coefficients
LR, WD, BETA, B1, B2, EPS, RMS = 0.05, 0.1, 0.95, 0.9, 0.95, 1e-8, 0.2


def _ns(g: np.ndarray, steps: int = 5) -> np.ndarray:
    """Newton–Schulz in float64: X = G/‖G‖_F (the wide orientation), X <- aX + (b A + c A²) X, A = X Xᵀ."""
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (np.linalg.norm(x) + EPS)
    a, b, c = NS
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def _quintic(s: np.ndarray, steps: int = 5) -> np.ndarray:
    a, b, c = NS
    for _ in range(steps):
        s = a * s + b * s ** 3 + c * s ** 5
    return s


def test_newton_schulz_by_hand_and_the_polar_factor():
    """Newton–Schulz acts on the singular values only: NS(G) = U p(Σ/‖G‖_F) Vᵀ with p the scalar
    quintic iterated 5 times, whose values here lie in [0.68, 1.13] (not 1: the coefficients trade
    exactness for speed), so NS(G) is the polar factor U Vᵀ to ~30 % per direction."""
    g = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (4, 6)), np.float64)
    by_hand = _ns(g)
    u, s, vt = np.linalg.svd(g, full_matrices=False)
    p = _quintic(s / np.linalg.norm(g))
    np.testing.assert_allclose(by_hand, u @ np.diag(p) @ vt, atol=1e-12)
    assert 0.6 < p.min() and p.max() < 1.2, p
    polar = u @ vt
    assert np.linalg.norm(by_hand - polar) / np.linalg.norm(polar) < 0.3
    # one Muon step on a fresh state is NS of the gradient (momentum only rescales it), to fp32
    tx = muon_adamw(1.0, rms=1.0, mask={"w": True})
    u1, _ = tx.update({"w": jnp.asarray(g, jnp.float32)}, tx.init({"w": jnp.zeros((4, 6))}), {"w": jnp.zeros((4, 6))})
    np.testing.assert_allclose(-np.asarray(u1["w"]) / np.sqrt(6), by_hand, atol=3e-6)


def _tree(seed: int) -> dict:
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return {"w": jax.random.normal(ks[0], (4, 6)), "b": jax.random.normal(ks[1], (6,)),
            "embed": jax.random.normal(ks[2], (5, 4))}


MASK = {"w": (), "b": False, "embed": False}  # how rules.rotation_mask marks a matrix, a vector, an embedding


def test_two_steps_against_a_numpy_transcription_and_adamw():
    params, grads = _tree(0), [_tree(1), _tree(2)]
    tx = muon_adamw(LR, beta=BETA, b1=B1, b2=B2, eps=EPS, weight_decay=WD, mask=MASK)
    adamw = optax.adamw(LR, B1, B2, EPS, weight_decay=WD)
    rest = lambda t: {k: t[k] for k in ("b", "embed")}  # noqa: E731
    p, s = params, tx.init(params)
    q, sa = rest(params), adamw.init(rest(params))
    w, mu = np.asarray(params["w"], np.float64), np.zeros((4, 6))
    for t, g in enumerate(grads, 1):
        u, s = jax.jit(tx.update)(g, s, p)
        p = optax.apply_updates(p, u)
        # matrix: m_t = β m + (1-β) g; Nesterov with optax's bias correction; NS; RMS scale; decay; -lr
        g_w = np.asarray(g["w"], np.float64)
        mu = BETA * mu + (1 - BETA) * g_w
        m_hat = BETA * mu / (1 - BETA ** (t + 1)) + (1 - BETA) * g_w / (1 - BETA ** t)
        w = w - LR * (RMS * np.sqrt(6) * _ns(m_hat) + WD * w)
        np.testing.assert_allclose(np.asarray(p["w"]), w, atol=2e-6)
        # every other leaf: AdamW, the same learning rate, betas and weight decay
        ua, sa = adamw.update(rest(g), sa, q)
        q = optax.apply_updates(q, ua)
        for k in q:
            np.testing.assert_allclose(np.asarray(p[k]), np.asarray(q[k]), rtol=1e-6, atol=1e-7)
    # the RMS match: the matrix update (less decay) has RMS ~ rms · mean p(σ) (exactly rms if orthogonal)
    step = (np.asarray(params["w"]) - np.asarray(p["w"])) / (2 * LR)
    assert 0.1 < np.sqrt(np.mean(step ** 2)) < 0.3


def test_stacked_matrices_are_orthogonalised_one_by_one():
    """A pipeline's stacked leaf [L, d, h] (mask: group axis 0) = each [d, h] on its own, and a_qkv's
    [d, 3, r] (group axis 1) = its three [d, r] matrices."""
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    stacked = {"w": jax.random.normal(ks[0], (2, 4, 6)), "qkv": jax.random.normal(ks[1], (4, 3, 2))}
    g = {"w": jax.random.normal(ks[2], (2, 4, 6)), "qkv": jax.random.normal(ks[3], (4, 3, 2))}
    tx = muon_adamw(LR, weight_decay=WD, mask={"w": 0, "qkv": (1,)})
    u, _ = tx.update(g, tx.init(stacked), stacked)
    split = {f"w{i}": stacked["w"][i] for i in range(2)} | {f"q{j}": stacked["qkv"][:, j] for j in range(3)}
    g_split = {f"w{i}": g["w"][i] for i in range(2)} | {f"q{j}": g["qkv"][:, j] for j in range(3)}
    one = muon_adamw(LR, weight_decay=WD, mask=jax.tree.map(lambda _: True, split))
    u1, _ = one.update(g_split, one.init(split), split)
    for i in range(2):
        np.testing.assert_allclose(u["w"][i], u1[f"w{i}"], rtol=1e-5, atol=1e-7)
    for j in range(3):
        np.testing.assert_allclose(u["qkv"][:, j], u1[f"q{j}"], rtol=1e-5, atol=1e-7)
    assert matrix_dims((0, 2), (2, 4, 3, 5)) == (1, 3)  # a stacked a_qkv [L, d, 3, r]: the [d, r] matrices
    with pytest.raises(ValueError, match="exactly 2 matrix axes"):
        matrix_dims((), (2, 4, 6))


def test_llama_embeddings_head_and_norms_take_adamw():
    m = ModelConfig(kind="llama", d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=16, vocab_size=32)
    axes = rules.logical_axes(m)
    for tree in (axes, rules.stack_axes(axes)):  # per-layer, and a pipeline's stacked layers
        mask = rules.rotation_mask(tree)
        shapes = jax.tree.map(lambda a: jnp.zeros((2,) * len(a)), tree, is_leaf=lambda x: isinstance(x, tuple))
        labels = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(muon_labels(mask)(shapes))[0]}
        adamw = sorted(k for k, v in labels.items() if v == "adamw")
        assert all(("embed" in k or "head" in k or "norm" in k) for k in adamw), adamw
        assert any("embed" in k for k in adamw) and any("head" in k for k in adamw)
        assert sum(v == "muon" for v in labels.values()) == (14 if tree is axes else 7), labels


def _steps(cfg: Config, steps: int):
    """Losses of `steps` steps on the built-in corpus, the final canonical parameters, and the state."""
    graphdef, params = init_model(cfg)
    fns = build_step_fns(cfg, graphdef, params)
    state, t = fns.init(params), cfg.train
    data = BatchIterator(load_corpus("").train, t.batch, t.seq, 0, vocab_size=cfg.model.vocab_size)
    step, losses = fns.compile(state, data.batch_at(0)), []
    for _ in range(steps):
        state, m = step(state, fns.put_batch(data.next()))
        losses.append(float(m["loss"]))
    return losses, jax.device_get(fns.to_canonical(state.params)), state


def test_2bw_muon_on_a_stage_mesh_matches_one_device():
    """`--optimizer muon --pipeline-delay 4 --delay-schedule 2bw --mesh stage=2` (stacked layers, Muon
    per layer's matrix, 2-deep rings) gives the single-device losses and parameters to fp32 rounding
    (measured: losses to 1 ulp, parameters 4.3e-8 relative)."""
    model = ModelConfig(kind="llama", d_model=32, n_layers=4, n_heads=2, d_ff=64, max_seq_len=16)
    train = TrainConfig(batch=4, seq=16, lr=3e-3, optimizer="muon", pipeline_delay=4, delay_schedule="2bw",
                        progress=False)
    ref, got = _steps(Config(model, train), 4), _steps(Config(model, replace(train, mesh="stage=2")), 4)
    assert {x.shape[0] for x in jax.tree.leaves(got[2].delay.history)} == {2}
    np.testing.assert_allclose(got[0], ref[0], rtol=5e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1]), strict=True):
        assert np.linalg.norm(np.asarray(a) - np.asarray(b)) <= 1e-6 * np.linalg.norm(np.asarray(b))
