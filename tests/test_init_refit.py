"""Factored starts fitted to activations (`boostjax.interop.refit`), rank allocation by measured loss
(`boostjax.interop.ranks`), and the command line's ranks for a pretrained low-rank model (`--rank-budget`,
`--rank-policy`, a group without a rank stays dense)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import jax
import numpy as np
import pytest

from boostjax.cli import main
from boostjax.config import Config, ConfigError, ModelConfig
from boostjax.interop import pretrained, ranks, refit
from boostjax.models.llama import abstract_model
from helpers import TRAIN_ONE_STEP, one_error_line, random_ids_file, random_params, rel, tiny_hf_checkpoint

TINY = ModelConfig(kind="llama", vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=24, norm_eps=1e-5)


def _silu(z):
    return z / (1 + np.exp(-z))


def _out_err(x, w, a, b, kind):
    x, w, a, b = (np.asarray(v, np.float64) for v in (x, w, a, b))
    z = x @ a
    return float(np.linalg.norm(x @ w - (z if kind == "svd" else _silu(z)) @ b) / np.linalg.norm(x @ w))


def _inputs(seed, n=400, d=12):
    """Inputs whose scales span two decades in a random basis, and a weight."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(d, d)))[0]
    x = (rng.normal(size=(n, d)) * np.logspace(0, -2, d)) @ basis
    return x, rng.normal(size=(d, 20))


def test_linearised_cola_matches_a_numpy_transcription():
    """The linearised CoLA start: A = ε S⁻ᵀ U_r, B = (2/ε) Σ_r V_rᵀ from the whitened SVD (Sᵀ W = U Σ Vᵀ,
    S Sᵀ = XᵀX + ridge), ε_j = min(√(‖B₀_j‖ / ‖A₀_j‖), EPS_MAX) with B₀ = 2 Σ V: the same factors as a numpy
    transcription, an output error within 10 % of whitened SVD's at the same rank, and well below the ± pair
    start (which spends two latents per direction)."""
    x, w = _inputs(0)
    r = 6
    a, b = refit.fit(w, "cola", r, "linearised", x)
    g = x.T @ x
    s = np.linalg.cholesky(g + 1e-6 * np.mean(np.diag(g)) * np.eye(len(g)))
    u, sig, vt = np.linalg.svd(s.T @ w, full_matrices=False)
    a0 = np.linalg.solve(s.T, u[:, :r])
    eps = np.minimum(np.sqrt(2 * sig[:r] * np.linalg.norm(vt[:r], axis=1) / np.linalg.norm(a0, axis=0)),
                     refit.EPS_MAX)
    a_np, b_np = a0 * eps, (2 / eps)[:, None] * sig[:r, None] * vt[:r]
    assert rel(a, a_np) < 1e-5 and rel(b, b_np) < 1e-5
    lin = _out_err(x, w, a, b, "cola")
    assert abs(lin - _out_err(x, w, a_np, b_np, "cola")) < 1e-5
    svd_a, svd_b = refit.fit(w, "svd", r, "linearised", x)
    pairs_a, pairs_b, _ = pretrained.factor_whitened(w, g, "cola", r, np.random.default_rng(1))
    svd_err, pairs_err = _out_err(x, w, svd_a, svd_b, "svd"), _out_err(x, w, pairs_a, pairs_b, "cola")
    assert svd_err <= lin < 1.1 * svd_err, (lin, svd_err)
    assert lin < 0.8 * pairs_err, (lin, pairs_err)


@pytest.mark.parametrize("kind", ["svd", "cola"])
def test_ridge_refit_is_the_least_squares_solution(kind):
    """`ridge_refit` without ridge: B = argmin ‖σ(X A) B − Y‖ as numpy's lstsq gives it; with a ridge λ:
    (HᵀH + λ I)⁻¹ HᵀY by hand."""
    x, w = _inputs(1)
    a = np.random.default_rng(2).normal(size=(12, 5)) * 0.3
    y = x @ w
    h = x @ a if kind == "svd" else _silu(x @ a)
    want = np.linalg.lstsq(h, y, rcond=None)[0]
    assert rel(refit.ridge_refit(x, a, y, kind, ridge=0.0), want) < 1e-4
    lam = 0.1 * np.mean(np.diag(h.T @ h))
    assert rel(refit.ridge_refit(x, a, y, kind, ridge=0.1), np.linalg.solve(h.T @ h + lam * np.eye(5), h.T @ y)) < 1e-4


def test_ridge_refit_pull_by_hand():
    """With `pull` = (P, Q): (HᵀH + λ I + P)⁻¹ (HᵀY + Q) by hand."""
    x, w = _inputs(3)
    rng = np.random.default_rng(4)
    a, m = rng.normal(size=(12, 5)) * 0.3, rng.normal(size=(5, 5))
    p, q = m @ m.T, rng.normal(size=(5, 20))
    h = _silu(x @ a)
    lam = 0.01 * np.mean(np.diag(h.T @ h))
    want = np.linalg.solve(h.T @ h + lam * np.eye(5) + p, h.T @ (x @ w) + q)
    assert rel(refit.ridge_refit(x, a, x @ w, "cola", ridge=0.01, pull=(p, q)), want) < 1e-4


def test_sequential_cola_refit_keeps_the_svd_fit_pull():
    """The sequential cola refit pays the svd fit's pull towards W on its linear part, so in SiLU's
    small-signal regime it lands on the svd sequential fit's map: with A = S̃⁻ᵀU_r fixed, the minimiser of
    ‖X̃ A B − X W‖² + λ‖A B − W‖² is B = Σ_r V_rᵀ exactly (Aᵀ(G̃ + λI)A = I). Without the pull it fits the
    calibration inputs closer and moves away from that map."""
    x, w = _inputs(5, n=4000)  # z's per-token scale, the regime's ε, falls as 1/√n: 4,000 rows, ε ≈ 0.004
    xt = x + 0.05 * np.random.default_rng(6).normal(size=x.shape) * np.std(x, axis=0)  # the factored model's inputs
    r = 4
    lam = 0.1  # a pull strong enough that dropping it moves the map well past the small-signal error
    svd_a, svd_b = refit.fit(w, "svd", r, "sequential", x, xt, seq_ridge=lam)
    cola_a, cola_b = refit.fit(w, "cola", r, "sequential", x, xt, seq_ridge=lam)
    m_svd = np.asarray(svd_a, np.float64) @ np.asarray(svd_b, np.float64)
    h = _silu(xt @ np.asarray(cola_a, np.float64))
    map_err = np.linalg.norm(h @ cola_b - xt @ m_svd) / np.linalg.norm(xt @ m_svd)
    assert map_err < 5e-3, map_err  # O(ε) of the small-signal regime and the 1e-4 ridge
    free = refit.ridge_refit(xt, cola_a, x @ w, "cola")  # no pull: a different map
    assert np.linalg.norm(h @ free - xt @ m_svd) / np.linalg.norm(xt @ m_svd) > 5 * map_err


def _features(cfg, params, tokens_bt):
    from boostjax.interop.hf import build_model

    return np.asarray(build_model(cfg, params).features(tokens_bt), np.float64)


def _nearly_low_rank(params, rng, r=4, noise=0.1):
    """Each projection W = (rank-r matrix) + noise: a rank-r start loses a little per layer."""
    for layer in params["layers"].values():
        for blk in layer.values():
            for name, w in blk.items():
                if name.startswith("w_"):
                    i, o = w.shape
                    blk[name] = (rng.normal(size=(i, r)) @ rng.normal(size=(r, o)) / np.sqrt(r * i)
                                 + noise * rng.normal(size=(i, o)) / np.sqrt(i)).astype(np.float32)
    return params


@pytest.mark.parametrize("kind", ["svd", "cola"])
def test_sequential_fit_lowers_the_model_output_error(kind):
    """A 3-layer random model whose projections are nearly rank 4, factored at rank 4: fitting each layer on
    the inputs the factored layers below produce (`sequential`) gives final hidden states closer to the dense
    model's, on the calibration tokens, than fitting every layer on the dense model's inputs (`refit`)."""
    dense_cfg = replace(TINY, n_layers=3)
    dense = random_params(abstract_model(Config(dense_cfg))[1], np.random.default_rng(3), 0.4, norm_scale=0.5)
    dense = _nearly_low_rank(dense, np.random.default_rng(7))
    tokens = np.random.default_rng(4).integers(0, 64, 256)
    m = replace(dense_cfg, kind=kind, rank=4, only_lr_act=False)
    ref = _features(dense_cfg, dense, tokens.reshape(-1, 32))
    errs = {}
    for how in ("refit", "sequential"):
        params, report = pretrained.lowrank_from_dense(m, dense, factor=refit.LayerFit(m, dense, tokens, 32, how))
        errs[how] = rel(_features(m, params, tokens.reshape(-1, 32)), ref)
        assert len(report["matrices"]) == 21
    assert errs["sequential"] < 0.97 * errs["refit"], errs


def test_layer_fit_is_deterministic():
    """The same tokens and weights give the same sequential factors (the same programs twice)."""
    dense = random_params(abstract_model(Config(TINY))[1], np.random.default_rng(5), 0.3, norm_scale=0.5)
    tokens = np.random.default_rng(6).integers(0, 64, 64)
    m = replace(TINY, kind="cola", rank=5, only_lr_act=False)
    p1, _ = pretrained.lowrank_from_dense(m, dense, factor=refit.LayerFit(m, dense, tokens, 16, "sequential"))
    p2, _ = pretrained.lowrank_from_dense(m, dense, factor=refit.LayerFit(m, dense, tokens, 16, "sequential"))
    jax.tree.map(np.testing.assert_array_equal, p1, p2)


# ------------------------------------------------------------------------------ rank allocation

ALLOC = replace(TINY, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64)


def _brute(m, losses, fraction):
    """Every combination of group ranks (dense included): the least summed loss within the budget."""
    budget, best = fraction * ranks.projection_params(m, {}), (np.inf, None)
    options = {}
    for g in ("attn", "kv", "mlp"):
        (i, o) = m.group_shape(g)
        options[g] = [r for r in range(1, min(i, o) + 1) if r * (i + o) < i * o] + [None]
    for combo in itertools.product(*options.values()):
        chosen = dict(zip(options, combo))
        if ranks.projection_params(m, chosen) > budget:
            continue
        total = sum(0.0 if r is None else sum(c[r] for c in losses[g]) for g, r in chosen.items())
        if total < best[0]:
            best = (total, chosen)
    return best


def test_sensitivity_allocation_respects_the_budget_and_follows_the_loss():
    """Hand-built spectra: attention's matrices are nearly rank 2, the MLP's spectrum is flat. The allocation
    keeps within the budget, gives the MLP more rank than attention, and is the exhaustive search's optimum."""
    def flat(n):
        return ranks.truncation_loss(np.ones(n))

    def low(n):
        return ranks.truncation_loss(np.r_[10.0, 10.0, np.full(n - 2, 0.01)])

    losses = {"attn": [low(32)] * 4, "kv": [low(16)] * 4, "mlp": [flat(32)] * 6}
    for fraction in (0.3, 0.5):
        chosen = ranks.allocate(ALLOC, losses, fraction)
        assert ranks.projection_params(ALLOC, chosen) <= fraction * ranks.projection_params(ALLOC, {})
        assert chosen["mlp"] is None or chosen["mlp"] > chosen["attn"], chosen
        total = sum(0.0 if r is None else sum(c[r] for c in losses[g]) for g, r in chosen.items())
        assert abs(total - _brute(ALLOC, losses, fraction)[0]) < 1e-12
        uni = ranks.ranks_for_budget(ALLOC, fraction)
        uni_total = sum(0.0 if r is None else sum(c[r] for c in losses[g]) for g, r in uni.items())
        assert total <= uni_total
    report = ranks.budget_report(ALLOC, chosen, 0.5, "sensitivity", losses)
    assert sum(g["params"] for g in report["groups"].values()) == report["projection_params"]


def test_truncation_loss_is_the_tail_share():
    np.testing.assert_allclose(ranks.truncation_loss([2.0, 1.0]), [1.0, 0.2, 0.0])


# ------------------------------------------------------------------------------ the command line

RUN = TRAIN_ONE_STEP


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_hf_checkpoint(TINY, tmp_path_factory.mktemp("hf") / "model")


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    return random_ids_file(TINY.vocab_size, tmp_path_factory.mktemp("data") / "ids.bin")


@pytest.mark.parametrize("flags,needles", [
    (["--rank-budget", "1.5"], ["train.rank_budget: 1.5", "0 < F < 1"]),
    (["--rank-budget", "1"], ["train.rank_budget: 1.0", "0 < F < 1"]),
    (["--rank-budget", "-0.2"], ["train.rank_budget: -0.2", "0 < F < 1"]),
    (["--rank-budget", "0.5", "--rank", "4"], ["train.rank_budget", "--rank", "one of them"]),
    (["--rank-budget", "0.5", "--rank-policy", "biggest"], ["train.rank_policy", "biggest"]),
    ([], ["model.rank", "needs its ranks", "--rank-budget F"]),
])
def test_rank_flags_refused(capsys, tmp_path, checkpoint, ids, flags, needles):
    argv = [*RUN, "--init-from-hf", str(checkpoint), "--model", "svd", "--data", str(ids),
            "--out", str(tmp_path / "run"), *flags]
    assert main(argv) == 2
    one_error_line(capsys.readouterr().err, *needles)
    assert not (tmp_path / "run").exists()


def test_rank_budget_needs_a_checkpoint(capsys, tmp_path):
    argv = [*RUN, "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--d-ff", "24", "--model", "svd",
            "--rank", "4", "--rank-budget", "0.5", "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    one_error_line(capsys.readouterr().err, "train.rank_budget", "--init-from-hf")


def test_fitted_start_needs_pretrained_weights(capsys, tmp_path, ids):
    argv = [*RUN, "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--d-ff", "24", "--model", "cola",
            "--rank", "4", "--init-factor", "sequential", "--data", str(ids), "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    one_error_line(capsys.readouterr().err, "train.init_factor: sequential", "--init-from-hf")
    assert not (tmp_path / "run").exists()


def test_omitted_group_rank_stays_dense(checkpoint):
    """`--rank-attn 4 --rank-mlp 4` without `--rank`: k/v stay dense, not the preset's rank 32 (or any)."""
    cfg = pretrained.config_from_flags({"init_from_hf": str(checkpoint), "kind": "svd", "rank_attn": 4,
                                        "rank_mlp": 4}, preset_given=False)
    assert cfg.model.group_ranks == {"attn": 4, "kv": "dense", "mlp": 4}
    with pytest.raises(ConfigError, match=r"^model.rank_kv: not given"):
        pretrained.config_from_flags({"init_from_hf": str(checkpoint), "kind": "svd", "rank_attn": 4, "rank_mlp": 4,
                                      "auto_dense": False}, preset_given=False)
    both = pretrained.config_from_flags({"init_from_hf": str(checkpoint), "kind": "svd", "rank": 3, "rank_mlp": 4},
                                        preset_given=False)
    assert both.model.group_ranks == {"attn": 3, "kv": 3, "mlp": 4}


def test_train_sequential_with_a_measured_budget(capsys, tmp_path, checkpoint, ids):
    """`--rank-budget 0.5 --rank-policy sensitivity --init-factor sequential` trains from the checkpoint;
    init_report.json says where the parameters went (within the budget) and how the factors were fitted."""
    run = tmp_path / "run"
    argv = [*RUN, "--init-from-hf", str(checkpoint), "--model", "cola", "--rank-budget", "0.5", "--rank-policy",
            "sensitivity", "--init-factor", "sequential", "--calib-tokens", "480", "--data", str(ids), "--out", str(run)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    report = json.loads((run / pretrained.REPORT_FILE).read_text())
    assert report["init_factor"] == "sequential" and report["calibration"]["tokens"] == 480
    budget = report["budget"]
    assert budget["policy"] == "sensitivity" and budget["used_fraction"] <= 0.5
    assert set(budget["groups"]) == {"attn", "kv", "mlp"} and "budget 50% (sensitivity)" in err
