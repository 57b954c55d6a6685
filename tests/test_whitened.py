"""Activation-aware factoring of pretrained weights (`--init-factor whitened`): the whitened factors
(`boostjax.interop.pretrained.factor_whitened`), the calibration Gram matrices and output errors
(`boostjax.interop.calibration`) against a hand-written forward, and the command line's refusals."""

from __future__ import annotations

import json
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boostjax.cli import main
from boostjax.config import Config, ModelConfig, TrainConfig
from boostjax.data.corpus import Corpus
from boostjax.interop import calibration, pretrained
from boostjax.models import ops
from boostjax.models.llama import abstract_model
from helpers import TRAIN_ONE_STEP, one_error_line, random_ids_file, random_params, rel, tiny_hf_checkpoint

TINY = ModelConfig(kind="llama", vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=24, norm_eps=1e-5)


def _silu(z):
    return z / (1 + np.exp(-z))


def _out_err(x, w, a, b, kind):
    """‖X W − f(X)‖ / ‖X W‖ of the factored map, in float64 (f = X A B, or silu(X A) B)."""
    x, w, a, b = (np.asarray(v, np.float64) for v in (x, w, a, b))
    z = x @ a
    f = (z if kind == "svd" else _silu(z)) @ b
    return float(np.linalg.norm(x @ w - f) / np.linalg.norm(x @ w))


def _anisotropic(rng, n, d, basis, scales):
    return (rng.normal(size=(n, d)) * scales) @ basis


@pytest.mark.parametrize("kind,r", [("svd", 5), ("cola", 10), ("cola", 11)])
def test_identity_gram_is_plain_svd(kind, r):
    """XᵀX ∝ I: every direction weighs the same, so the whitened factors are the plain SVD's (the same
    map, the same balanced column norms, the same weight error)."""
    w = np.random.default_rng(0).normal(size=(12, 20))
    a, b, err = pretrained.factor_whitened(w, 3.0 * np.eye(12), kind, r, np.random.default_rng(1))
    a0, b0, err0 = pretrained._factor(w, kind, r, np.random.default_rng(1))
    assert a.shape == a0.shape == (12, r) and b.shape == b0.shape == (r, 20)
    assert rel(a @ b, a0 @ b0) < 1e-5 and abs(err - err0) < 1e-6
    np.testing.assert_allclose(np.linalg.norm(a, axis=0), np.linalg.norm(a0, axis=0), rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(b, axis=1), np.linalg.norm(b0, axis=1), rtol=1e-5)
    x = np.random.default_rng(2).normal(size=(50, 12))
    assert abs(_out_err(x, w, a, b, kind) - _out_err(x, w, a0, b0, kind)) < 1e-5


@pytest.mark.parametrize("kind", ["svd", "cola"])
def test_whitened_beats_plain_svd_on_anisotropic_inputs(kind):
    """Inputs whose scales span three decades (a random basis): truncating by the weight's singular values
    keeps directions the inputs barely excite; the whitened start has a far smaller output error on
    held-out inputs of the same distribution (the real silu(XA)B map for cola)."""
    rng = np.random.default_rng(3)
    d, out, r = 24, 32, 8 if kind == "svd" else 16
    basis = np.linalg.qr(rng.normal(size=(d, d)))[0]
    scales = np.logspace(-2, 1, d)[rng.permutation(d)]
    w = rng.normal(size=(d, out))
    x_cal, x_held = (_anisotropic(rng, 2000, d, basis, scales) for _ in range(2))
    a, b, _ = pretrained.factor_whitened(w, x_cal.T @ x_cal, kind, r, np.random.default_rng(0))
    a0, b0, _ = pretrained._factor(w, kind, r, np.random.default_rng(0))
    whitened, plain = _out_err(x_held, w, a, b, kind), _out_err(x_held, w, a0, b0, kind)
    assert whitened < 0.5 * plain, (whitened, plain)
    # the rank-k optimum in the X-weighted norm: no other rank-k map does better on the calibration inputs
    k = r if kind == "svd" else r // 2
    s = np.linalg.svd(x_cal @ w, compute_uv=False)
    best = float(np.sqrt(np.sum(s[k:] ** 2) / np.sum(s**2)))
    assert abs(_out_err(x_cal, w, a, b, kind) - best) < 1e-4


def test_singular_gram_is_regularised():
    """Fewer calibration tokens than input channels: G is singular, the ridge keeps S⁻ᵀ finite and the
    factors exact on what the calibration saw."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(5, 12))
    w = rng.normal(size=(12, 9))
    a, b, err = pretrained.factor_whitened(w, x.T @ x, "svd", 6, rng)
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)) and np.isfinite(err)
    assert _out_err(x, w, a, b, "svd") < 1e-3  # rank 6 >= the 5 calibration rows


def _manual_inputs(cfg: ModelConfig, p, tokens_bt):
    """The one layer's four projection inputs by hand: embedding, rms_norm, RoPE, a softmax written out."""
    lay, e, b, t = p["layers"][0], cfg.head_dim, *tokens_bt.shape
    x = jnp.asarray(p["embed"])[tokens_bt]
    xn = ops.rms_norm(x, lay["attn"]["norm"], cfg.norm_eps)
    cos, sin = ops.model_rope_tables(cfg, t)
    q = ops.apply_rope((xn @ lay["attn"]["w_q"]).reshape(b, t, -1, e), cos, sin)
    k = ops.apply_rope((xn @ lay["attn"]["w_k"]).reshape(b, t, -1, e), cos, sin)
    v = (xn @ lay["attn"]["w_v"]).reshape(b, t, -1, e)
    scores = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(e)
    scores = jnp.where(np.tril(np.ones((t, t), bool)), scores, -jnp.inf)
    o = jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, -1)
    mid = x + o @ lay["attn"]["w_o"]
    xn2 = ops.rms_norm(mid, lay["mlp"]["norm"], cfg.norm_eps)
    hidden = jax.nn.silu(xn2 @ lay["mlp"]["w_gate"]) * (xn2 @ lay["mlp"]["w_up"])
    return {name: np.asarray(v.reshape(-1, v.shape[-1]), np.float64)
            for name, v in (("qkv", xn), ("o", o), ("gate_up", xn2), ("down", hidden))}


def test_grams_and_output_errors_match_a_manual_forward():
    """`input_grams` is XᵀX / n of each projection's input of a hand-computed one-layer forward (two rows of
    8 and a last row of 4: every token read once), and `output_errors` its ‖XW − f(X)‖ / ‖XW‖."""
    params = random_params(abstract_model(Config(TINY))[1], np.random.default_rng(5), 0.3, norm_scale=0.2)
    stream = np.random.default_rng(6).integers(0, TINY.vocab_size, 20)
    grams = calibration.input_grams(TINY, params, stream, seq=8)
    xs = {name: np.concatenate([m, _manual_inputs(TINY, params, stream[16:][None])[name]])
          for name, m in _manual_inputs(TINY, params, stream[:16].reshape(2, 8)).items()}
    assert sorted(grams) == [(0, "down"), (0, "gate_up"), (0, "o"), (0, "qkv")]
    for name, x in xs.items():
        assert rel(grams[0, name], x.T @ x / 20) < 1e-5, name
    rng = np.random.default_rng(7)
    lay = params["layers"][0]
    factors = {"layers.0.attn.q": (rng.normal(size=(16, 3)), rng.normal(size=(3, 16))),
               "layers.0.mlp.down": (rng.normal(size=(24, 4)), rng.normal(size=(4, 16)))}
    for kind in ("svd", "cola"):
        errs = calibration.output_errors(TINY, kind, params, stream, 8, factors)
        assert errs.keys() == factors.keys()
        assert abs(errs["layers.0.attn.q"] - _out_err(xs["qkv"], lay["attn"]["w_q"], *factors["layers.0.attn.q"],
                                                       kind)) < 1e-5
        assert abs(errs["layers.0.mlp.down"] - _out_err(xs["down"], lay["mlp"]["w_down"],
                                                         *factors["layers.0.mlp.down"], kind)) < 1e-5


def test_factored_start_deterministic_and_reported():
    """`factored`: the same seed and data give the same whitened params (an odd rank draws a free column);
    the report holds the weight errors, the held-out output errors and where the tokens came from; the
    whitened start's held-out output error is below the plain SVD's on this model."""
    dense_cfg = replace(TINY, n_layers=2)
    dense = random_params(abstract_model(Config(dense_cfg))[1], np.random.default_rng(8), 0.3, norm_scale=0.5)
    tok = np.random.default_rng(9).integers(0, 64, 700).astype(np.uint16)
    corpus = Corpus(train=tok[:600], val=tok[600:], name="t")
    cfg = Config(replace(dense_cfg, kind="cola", rank=7, only_lr_act=False),
                 TrainConfig(init_factor="whitened", calib_tokens=500, seq=16, data="x"))
    p1, r1 = pretrained.factored(cfg, dense, corpus)
    p2, r2 = pretrained.factored(cfg, dense, corpus)
    jax.tree.map(np.testing.assert_array_equal, p1, p2)
    assert r1 == r2
    assert r1["init_factor"] == "whitened" and r1["calibration"]["tokens"] == 500
    assert r1["output"]["tokens"] == 100 and len(r1["output"]["matrices"]) == 14
    assert r1["output"]["slice"].startswith("validation split")
    plain = pretrained.factored(replace(cfg, train=replace(cfg.train, init_factor="svd", calib_tokens=0)), dense,
                                corpus)[1]
    assert plain["init_factor"] == "svd" and "calibration" not in plain
    assert r1["output"]["mean"] < plain["output"]["mean"], (r1["output"]["mean"], plain["output"]["mean"])
    assert r1["mean"] >= plain["mean"]  # plain SVD is the best in the weight norm
    assert "output error on 100 held-out tokens" in pretrained.summary_line({"source": "x", **r1})
    # a group kept dense (kv at rank 16: its factors would not be smaller) is copied, not factored or reported
    kv_dense = replace(cfg, model=replace(cfg.model, rank_kv=16))
    p3, r3 = pretrained.factored(kv_dense, dense, corpus)
    assert r3["dense"] == ["k", "v"] and len(r3["output"]["matrices"]) == 10
    np.testing.assert_array_equal(p3["layers"][1]["attn"]["w_k"], dense["layers"][1]["attn"]["w_k"])


# ------------------------------------------------------------------------------ the command line

RUN = TRAIN_ONE_STEP


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_hf_checkpoint(TINY, tmp_path_factory.mktemp("hf") / "model")


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    return random_ids_file(TINY.vocab_size, tmp_path_factory.mktemp("data") / "ids.bin")


@pytest.mark.parametrize("flags,needles", [
    (["--init-factor", "whitened", "--calib-tokens", "981", "--data", "DATA"],
     ["train.calib_tokens: 981", "980 tokens", "--calib-tokens 980"]),
    (["--calib-tokens", "64", "--data", "DATA"], ["train.calib_tokens: 64", "drop --calib-tokens"]),
    (["--init-factor", "whitened"], ["train.init_factor: whitened", "pass --data"]),
    (["--init-factor", "whitened", "--model", "llama", "--data", "DATA"], ["train.init_factor", "--model svd"]),
    (["--init-factor", "whitened", "--calib-tokens", "-1", "--data", "DATA"], ["train.calib_tokens", ">= 0"]),
])
def test_refused(capsys, tmp_path, checkpoint, ids, flags, needles):
    flags = [str(ids) if f == "DATA" else f for f in flags]
    model = [] if "--model" in flags else ["--model", "svd", "--rank", "4"]
    argv = [*RUN, "--init-from-hf", str(checkpoint), *model, "--out", str(tmp_path / "run"), *flags]
    assert main(argv) == 2
    one_error_line(capsys.readouterr().err, *needles)
    assert not (tmp_path / "run").exists()


def test_refused_without_pretrained_weights(capsys, tmp_path, ids):
    argv = [*RUN, "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--d-ff", "24", "--rank", "4",
            "--init-factor", "whitened", "--data", str(ids), "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    one_error_line(capsys.readouterr().err, "train.init_factor", "--init-from-hf")
    assert not (tmp_path / "run").exists()


def test_train_whitened_from_hf(capsys, tmp_path, checkpoint, ids):
    """A run from the checkpoint with --init-factor whitened: init_report.json says how it was factored,
    from which tokens, and each matrix's held-out output error; the summary line says it."""
    run = tmp_path / "run"
    argv = [*RUN, "--init-from-hf", str(checkpoint), "--model", "svd", "--rank", "4", "--init-factor", "whitened",
            "--calib-tokens", "900", "--data", str(ids), "--out", str(run)]
    assert main(argv) == 0
    assert "whitened factoring: relative reconstruction error" in capsys.readouterr().err
    report = json.loads((run / pretrained.REPORT_FILE).read_text())
    assert report["init_factor"] == "whitened" and report["calibration"] == {
        "tokens": 900, "seq": 16, "slice": "training split, tokens [0, 900)"}
    out = report["output"]
    assert out["tokens"] == 20 and set(out["matrices"]) == set(report["matrices"])
    assert 0 < out["mean"] < 1
