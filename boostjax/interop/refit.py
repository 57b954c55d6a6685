"""Factored starts fitted to activations: CoLA at its full rank, ridge refits, layer-wise (sequential) fits.

One projection `x ↦ x W` (W [in, out]) becomes `x ↦ σ(x A) B` (σ = identity for svd, SiLU for cola/lax).
On calibration inputs X̃ [n, in] (what the factored model feeds the projection) with targets `Y = X W`
(X: what the dense model feeds it), G̃ = X̃ᵀX̃, C = X̃ᵀX, S̃ S̃ᵀ = G̃ (+ a small ridge, `calibration.whitening`):

- `fit_linear`: the best rank-r linear map in ‖X̃ M − Y‖_F: `T = S̃⁻¹ C W = U Σ Vᵀ`, `M = S̃⁻ᵀ U_r Σ_r V_rᵀ`
  (with X̃ = X, T = S̃ᵀ W: SVD-LLM's whitened truncation). The svd start: `A = S̃⁻ᵀ U_r`, `B = Σ_r V_rᵀ`,
  each column pair balanced.
- `linearise`: CoLA with all r latents. `silu(ε z) / ε = z/2 + ε z²/4 + O(ε³)`, and the whitened latents
  `z = x S̃⁻ᵀ U_r` have unit norm over the calibration tokens, so `A = ε S̃⁻ᵀ U_r`, `B = (2/ε) Σ_r V_rᵀ` computes the rank-r map up
  to a relative error of order ε. ε per column balances ‖A_j‖ and ‖B_j‖ (Adam moves both at the same
  relative rate), capped at `EPS_MAX` to keep the small-signal regime (the factors end far from the dense
  scale: train them with `--factor-lr start-rms`).
- `ridge_refit`: B again, in closed form, on the real activations `H = σ(X̃ A)`:
  `B = (HᵀH + λ I)⁻¹ Hᵀ Y` (λ = `REFIT_RIDGE` · mean diag HᵀH): whatever the nonlinearity does, B is the
  least-squares best for this A.

`LayerFit` walks the layers on calibration tokens: per layer, the inputs of each projection from the
dense model (X) and, `sequential`, from the factored model (X̃): its layers below as fitted, and within
the layer the projections before this one (o reads the fitted q, k, v; gate and up the residual after
the fitted o; down the fitted gate and up); each matrix is then fitted as its `--init-factor` says. `boostjax.interop.pretrained.lowrank_from_dense`
calls `LayerFit.start_layer(i, layers)` before it factors layer i.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from boostjax.config import ModelConfig
from boostjax.interop import calibration
from boostjax.models import ops
from boostjax.models.llama import Block, param_shapes, projections

EPS_MAX = 0.25  # the largest scale ε of the linearised CoLA start (on latents of unit norm over the tokens)
REFIT_RIDGE = 1e-4  # relative ridge of the refit's normal equations
SEQ_RIDGE = 0.02  # relative ridge pulling a sequential fit towards W (`fit_linear`; chosen: seq_ridge.md)
STARTS = ("linearised", "refit", "sequential")  # the --init-factor values this module fits


# ------------------------------------------------------------------------------------ one matrix


def fit_linear(gram_ii: Any, w_io: Any, r: int, cross_ii: Any = None, ridge: float = 0.0
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A0 [in, r] = S̃⁻ᵀ U_r, σ [r], Vᵀ [r, out]) of the best rank-r `M = A0 diag(σ) Vᵀ` in ‖X̃ M − X W‖_F
    + λ‖M − W‖ (λ = `ridge` · mean diag G̃: a correction the calibration tokens cannot pin down is shrunk
    to W), from G̃ = X̃ᵀX̃ and C = X̃ᵀX (`cross_ii`; None: X̃ = X, T = S̃ᵀ W). float64."""
    w = np.asarray(w_io, np.float64)
    g = np.asarray(gram_ii, np.float64)
    lam = ridge * (float(np.mean(np.diag(g))) or 1.0)
    s_ii = calibration.whitening(g + lam * np.eye(len(g)))
    t = s_ii.T @ w if cross_ii is None else np.linalg.solve(
        s_ii, (np.asarray(cross_ii, np.float64) + lam * np.eye(len(g))) @ w)
    u, sig, vt = np.linalg.svd(t, full_matrices=False)
    return np.linalg.solve(s_ii.T, u[:, :r]), sig[:r], vt[:r]


def balanced(a0: np.ndarray, sig: np.ndarray, vt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The svd split of `A0 diag(σ) Vᵀ` with ‖A_j‖ = ‖B_j‖ per column pair."""
    b = sig[:, None] * vt
    a_norm, b_norm = np.linalg.norm(a0, axis=0), np.linalg.norm(b, axis=1)
    c = np.sqrt(np.divide(b_norm, a_norm, out=np.ones_like(b_norm), where=(a_norm > 0) & (b_norm > 0)))
    return a0 * c, b / c[:, None]


def linearise(a0: np.ndarray, sig: np.ndarray, vt: np.ndarray, eps_max: float = EPS_MAX
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A, B, ε) of CoLA's `silu(x A) B ≈ x A0 diag(σ) Vᵀ`: A = A0 ε, B = (2/ε) σ Vᵀ, ε_j = min(the ε that
    balances ‖A_j‖ and ‖B_j‖, `eps_max`)."""
    a_norm, b_norm = np.linalg.norm(a0, axis=0), 2 * sig * np.linalg.norm(vt, axis=1)
    eps = np.sqrt(np.divide(b_norm, a_norm, out=np.full_like(b_norm, eps_max), where=a_norm > 0))
    eps = np.minimum(np.where(eps > 0, eps, eps_max), eps_max)
    return a0 * eps, (2 / eps)[:, None] * sig[:, None] * vt, eps


def activation(kind: str) -> Callable[[Any], Any]:
    """σ of a factored projection: identity for svd, SiLU for cola/lax."""
    return (lambda h: h) if kind == "svd" else jax.nn.silu


def ridge_refit(x_ni: Any, a_ir: Any, y_no: Any, kind: str, ridge: float = REFIT_RIDGE,
                pull: tuple[Any, Any] | None = None) -> np.ndarray:
    """B [r, out] = argmin ‖σ(X A) B − Y‖² + λ‖B‖² (+ a quadratic pull with `pull` = (P [r, r], Q [r, out]):
    + tr(Bᵀ P B) − 2 tr(Bᵀ Q)), that is (HᵀH + λ I + P)⁻¹ (HᵀY + Q), H = σ(X A), λ = ridge · mean diag HᵀH;
    the products in fp32 at full precision, the solve in float64."""
    hth, hty = _normal(kind, jnp.asarray(x_ni, jnp.float32), jnp.asarray(a_ir, jnp.float32),
                       jnp.asarray(y_no, jnp.float32))
    hth, hty = np.asarray(hth, np.float64), np.asarray(hty, np.float64)
    lam = ridge * (float(np.mean(np.diag(hth))) or 1.0)
    lhs = hth + lam * np.eye(len(hth))
    if pull is not None:
        p_rr, q_ro = (np.asarray(v, np.float64) for v in pull)
        lhs, hty = lhs + p_rr, hty + q_ro
    return np.linalg.solve(lhs, hty)


HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnums=0)
def _normal(kind: str, x_ni, a_ir, y_no):
    h = activation(kind)(jnp.dot(x_ni, a_ir, precision=HIGHEST))
    return jnp.dot(h.T, h, precision=HIGHEST), jnp.dot(h.T, y_no, precision=HIGHEST)


def fit(w_io: Any, kind: str, r: int, how: str, x_ni: Any, xt_ni: Any | None = None,
        eps_max: float = EPS_MAX, seq_ridge: float = SEQ_RIDGE) -> tuple[np.ndarray, np.ndarray]:
    """(A [in, r], B [r, out]) of one matrix on calibration inputs: X (the dense model's) and X̃ (`xt_ni`, the
    factored model's; None: X). `how`: `linearised` (the whitened rank-r map; cola linearised), `refit`
    and `sequential` (then B refitted on σ(X̃ A) against X W; sequential is `refit` with X̃ given)."""
    x = jnp.asarray(x_ni, jnp.float32)
    xt = x if xt_ni is None else jnp.asarray(xt_ni, jnp.float32)
    gram, cross = _grams(xt, x)
    gram = np.asarray(gram, np.float64)
    seq = xt_ni is not None
    a0, sig, vt = fit_linear(gram, w_io, r, np.asarray(cross, np.float64) if seq else None, seq_ridge if seq else 0.0)
    a, b = balanced(a0, sig, vt) if kind == "svd" else linearise(a0, sig, vt, eps_max)[:2]
    if how != "linearised" and not (kind == "svd" and seq):  # svd: the sequential fit is already B's best
        y = jnp.dot(x, jnp.asarray(w_io, jnp.float32), precision=HIGHEST)
        b = ridge_refit(xt, a, y, kind, pull=_seq_pull(gram, a, w_io, seq_ridge) if seq else None)
        if kind == "svd":  # keep the pairs balanced (the map unchanged)
            a, b = balanced(a, np.ones(r), b)
    return a.astype(np.float32), b.astype(np.float32)


def _seq_pull(gram_ii: np.ndarray, a_ir: np.ndarray, w_io: Any, seq_ridge: float) -> tuple[np.ndarray, np.ndarray]:
    """The sequential fit's pull towards W, λ‖M − W‖² (λ = `seq_ridge` · mean diag G̃), in a refit of B with A
    fixed: the map's linear part is M = (A/2) B (silu'(0) = 1/2), so (P, Q) = λ ((A/2)ᵀ(A/2), (A/2)ᵀ W)."""
    lam = seq_ridge * (float(np.mean(np.diag(gram_ii))) or 1.0)
    half = np.asarray(a_ir, np.float64) / 2
    return lam * half.T @ half, lam * half.T @ np.asarray(w_io, np.float64)


@jax.jit
def _grams(xt_ni, x_ni):
    return jnp.dot(xt_ni.T, xt_ni, precision=HIGHEST), jnp.dot(xt_ni.T, x_ni, precision=HIGHEST)


# ------------------------------------------------------------------------------------ the layer walk


def block(cfg: ModelConfig, layer: Mapping[str, Any]) -> Block:
    """An nnx `Block` of `cfg` filled with one layer's pure params dict."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, layer)
    return nnx.merge(graphdef, state)


@functools.partial(jax.jit, static_argnums=0)
def _io(cfg: ModelConfig, layer: Any, x_btd):
    """(the block's output, {input: X [b*t, in]}) of the block `layer` of `cfg` on x (`calibration.INPUTS`)."""
    cos, sin = ops.model_rope_tables(cfg, x_btd.shape[1])
    fn = lambda p, x: block(cfg, p)(x, cos, sin)  # noqa: E731
    seen = calibration.tagged(fn, tuple(tag for tag, _ in calibration.INPUTS.values()))(layer, x_btd)
    out = {}
    for name, (tag, norm) in calibration.INPUTS.items():
        x = seen[tag][0]
        x = x if norm is None else ops.rms_norm(x, layer[norm]["norm"], cfg.norm_eps)
        out[name] = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return fn(layer, x_btd), out


@functools.partial(jax.jit, static_argnums=0)
def _run(cfg: ModelConfig, layer: Any, x_btd):
    cos, sin = ops.model_rope_tables(cfg, x_btd.shape[1])
    return block(cfg, layer)(x_btd, cos, sin)


def layer_params(cfg: ModelConfig, dense_layer: Mapping[str, Any], factors: Mapping[str, tuple[Any, Any]]
                 ) -> dict[str, dict[str, Any]]:
    """One layer's pure params of the low-rank `cfg` (numpy float32): `factors[short] = (A, B)` of each
    factored projection (q, k, ..., down) in the model's grouped layout (`llama.projections`), a factored
    projection absent from `factors` zeros, a group kept dense copied from `dense_layer`, LaX's gates zero."""
    like = {k.split(".", 2)[2]: v for k, v in param_shapes(cfg).items() if k.startswith("layers.0.")}
    layer: dict[str, dict[str, Any]] = {blk: {"norm": np.asarray(dense_layer[blk]["norm"], np.float32)}
                                        for blk in ("attn", "mlp")}
    for short, proj in projections(cfg).items():
        w = dense_layer[proj.blk][proj.dense]
        if proj.a is None:
            layer[proj.blk][proj.dense] = np.asarray(w, np.float32)
            continue
        r = cfg.group_rank(proj.group)
        a, b = factors.get(short, (np.zeros((w.shape[0], r), np.float32), np.zeros((r, w.shape[1]), np.float32)))
        for (name, idx), val, axis in ((proj.a, a, 1), (proj.b, b, 0)):
            if idx is None:
                layer[proj.blk][name] = np.asarray(val, np.float32)
            else:  # grouped tensors: a_qkv [d, 3, r] / a_kv / a_gate_up [d, 2, r] / b_kv [2, r, ke] / b_gate_up
                layer[proj.blk].setdefault(name, {})[idx] = (np.asarray(val, np.float32), axis)
    for blk in ("attn", "mlp"):
        for name, v in list(layer[blk].items()):
            if isinstance(v, dict):
                layer[blk][name] = np.stack([v[j][0] for j in sorted(v)], axis=v[0][1])
        if f"{blk}.cross" in like:
            layer[blk]["cross"] = np.zeros(like[f"{blk}.cross"], np.float32)
    return layer


class LayerFit:
    """The `Factor` of `--init-factor linearised|refit|sequential` (`pretrained.lowrank_from_dense`): the
    calibration tokens `tokens` (rows of `seq`; whole rows only) walked layer by layer through the dense
    model and, for `sequential`, the factored one. `done()` after each layer (a progress bar)."""

    def __init__(self, m: ModelConfig, dense: Mapping[str, Any], tokens: np.ndarray, seq: int, how: str,
                 done: Callable[[], None] = lambda: None, eps_max: float = EPS_MAX, seq_ridge: float = SEQ_RIDGE):
        if how not in STARTS:
            raise ValueError(f"LayerFit: how={how!r}; fix: one of {', '.join(STARTS)}")
        self.m, self.how, self.done, self.eps_max, self.seq_ridge = m, how, done, eps_max, seq_ridge
        self.dense_cfg = dataclasses.replace(m, kind="llama", attention="xla")
        self.low_cfg = dataclasses.replace(m, attention="xla")
        self.dense = dense
        tokens = np.asarray(tokens)
        n = len(tokens) // seq * seq
        if n == 0:
            raise ValueError(f"LayerFit: {len(tokens)} calibration tokens hold no row of {seq}; fix: more tokens")
        rows = jnp.asarray(tokens[:n].astype(np.int32).reshape(-1, seq))
        self.h = ops.embed_lookup(jnp.asarray(dense["embed"], jnp.float32), rows)  # the dense stream
        self.ht = self.h  # the factored model's stream
        self.xs: dict[str, Any] = {}
        self.xts: dict[str, Any] | None = None
        self.layer = -1

    def _dense_layer(self, i: int) -> Any:
        layers = self.dense["layers"]
        d = layers[i] if i in layers else layers[str(i)]
        return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), d)

    def start_layer(self, i: int, factored: Mapping[int, Any]) -> None:
        """Before layer i is factored: its inputs from the dense stream, and (sequential) the factored
        stream advanced through layer i - 1 as `factored[i - 1]` holds it."""
        if self.layer >= 0:
            self.done()
        if self.how == "sequential" and i > 0:
            prev = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), factored[i - 1])
            self.ht = _run(self.low_cfg, prev, self.ht)
        layer = self._dense_layer(i)
        h_next, self.xs = _io(self.dense_cfg, layer, self.h)
        self.xts = _io(self.dense_cfg, layer, self.ht)[1] if self.how == "sequential" else None
        self.h, self.layer, self.fitted, self.fresh = h_next, i, {}, {"qkv"}

    def _factored_input(self, inp: str) -> Any:
        """X̃ of input `inp` of the current layer with the projections before it factored as fitted (o reads
        the factored q, k, v; gate and up the residual after the factored o; down the factored gate and up)."""
        if inp not in self.fresh:
            dense_layer = jax.tree.map(np.asarray, self._dense_layer(self.layer))
            layer = jax.tree.map(jnp.asarray, layer_params(self.low_cfg, dense_layer, self.fitted))
            self.xts[inp] = _io(self.low_cfg, layer, self.ht)[1][inp]
            self.fresh.add(inp)
        return self.xts[inp]

    def finish(self) -> None:
        if self.layer >= 0:
            self.done()

    def __call__(self, name: str, w_io: Any, kind: str, r: int, rng: np.random.Generator
                 ) -> tuple[np.ndarray, np.ndarray, float]:
        _, i, _, short = name.split(".")
        if int(i) != self.layer:
            raise ValueError(f"LayerFit: {name} asked while layer {self.layer} is calibrated")
        inp = calibration.INPUT_OF[short]
        xt = None if self.xts is None else self._factored_input(inp)
        a, b = fit(w_io, kind, r, self.how, self.xs[inp], xt, self.eps_max, self.seq_ridge)
        self.fitted[short] = (a, b)
        return a, b, weight_error(w_io, a, b, kind)


def weight_error(w_io: Any, a: np.ndarray, b: np.ndarray, kind: str) -> float:
    """‖W − W₀‖_F / ‖W‖_F, W₀ the linear part of the factored map at 0: A B (svd), A B / 2 (cola: silu'(0) = ½)."""
    w = np.asarray(w_io, np.float64)
    w0 = (a.astype(np.float64) @ b.astype(np.float64)) * (1.0 if kind == "svd" else 0.5)
    total = float(np.linalg.norm(w))
    return float(np.linalg.norm(w - w0) / total) if total > 0 else 0.0
