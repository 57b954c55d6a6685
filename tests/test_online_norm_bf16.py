"""BTP's Online-RMSNorm in bf16: the fp32 statistic rides in the latents' bf16 all-reduce
(`boostjax.models.stat_parts`), one collective per norm site, within the stated bound of the version
that all-reduces the statistic in fp32 (a second collective)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from boostjax.models import ops, stat_parts
from boostjax.models.collectives import Collectives

BF16 = ml_dtypes.bfloat16


def bound(n_shards: int) -> float:
    """The split's relative bound (`stat_parts` docstring): (½ + P - 1) · 2^(-k (W - 1)) <= 2^-12."""
    k, w = stat_parts.window_bits(n_shards), stat_parts.n_parts(n_shards)
    return (0.5 + n_shards - 1) * 2.0 ** (-k * (w - 1))


def shard_stats(rng, n: int, p: int, spread: float) -> np.ndarray:
    """`[p, n]` non-negative fp32 partial Σx²: a chi-square-like value per shard times 10^U(-spread, spread)."""
    s = rng.standard_normal((p, n)) ** 2 * 10.0 ** rng.uniform(-spread, spread, (p, n))
    return s.astype(np.float32)


def split_shards(s_pn: np.ndarray, p: int) -> np.ndarray:
    """`[p, n, n_parts(p)]` bf16: `stat_parts.split` of each shard's statistics."""
    return np.asarray(jax.jit(jax.vmap(lambda s_n: stat_parts.split(s_n[:, None], p)))(s_pn))


def all_reduce_bf16(parts_pnw: np.ndarray, order: str) -> np.ndarray:
    """A bf16 all-reduce: `ring` rounds every partial sum to bf16 (a GPU ring), `wide` adds in f32 and
    rounds once (XLA's CPU backend), `reversed` is a ring in the other order."""
    if order == "wide":
        return parts_pnw.astype(np.float32).sum(0).astype(BF16)
    seq = parts_pnw[::-1] if order == "reversed" else parts_pnw
    acc = seq[0].astype(BF16)
    for p in seq[1:]:
        acc = (acc.astype(np.float32) + p.astype(np.float32)).astype(BF16)
    return acc


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("spread", [0.5, 6.0])  # similar shards; shards 10^12 apart (window collisions)
def test_statistic_bound_under_bf16_accumulation(p, spread):
    assert bound(p) <= 2.0 ** -12
    rng = np.random.default_rng(p)
    s_pn = shard_stats(rng, 4000, p, spread)
    s_pn[:, :3] = 0.0
    s_pn[0, 3:6] = 1e-30  # below the lowest window grid's reach of precision: absolute error only
    parts_pnw = split_shards(s_pn, p)
    assert parts_pnw.dtype == BF16 and parts_pnw.shape == (p, 4000, stat_parts.n_parts(p))
    exact = s_pn.astype(np.float64).sum(0)
    for order in ("ring", "reversed", "wide"):
        got = np.asarray(stat_parts.join(jnp.asarray(all_reduce_bf16(parts_pnw, order))))[:, 0]
        err = np.abs(got - exact)
        assert np.all(err <= bound(p) * exact + 1e-36), (order, float(np.max(err / np.maximum(exact, 1e-300))))
        assert np.all(got[:3] == 0.0)


def test_slot_sums_are_exact_in_bf16():
    """Shards whose statistics share the top window (here `[1, 2^k)`) put the same window in every slot:
    each partial sum of the all-reduce is exactly representable, so the order and precision of the adds
    do not matter and only the rounded last window is lost."""
    rng = np.random.default_rng(0)
    for p in (2, 4, 8):
        k = stat_parts.window_bits(p)
        s_pn = np.exp2(rng.uniform(0, k, (p, 2000))).astype(np.float32)
        parts_pnw = split_shards(s_pn, p)
        wide = parts_pnw.astype(np.float32).sum(0)
        np.testing.assert_array_equal(wide.astype(BF16).astype(np.float32), wide)
        for order in ("ring", "reversed"):
            np.testing.assert_array_equal(all_reduce_bf16(parts_pnw, order).astype(np.float32), wide)
        exact = s_pn.astype(np.float64).sum(0)
        got = wide.astype(np.float64).sum(-1)
        assert np.all(np.abs(got - exact) <= p * 0.5 * 2.0 ** (-k * (stat_parts.n_parts(p) - 1)))


def test_plain_hi_lo_split_misses_the_bound():
    """Why the grid: `hi = bf16(s)`, `lo = bf16(s - hi)` summed by a bf16 all-reduce rounds the sum of
    the `hi` parts, about 2^-8 relative, far outside 2^-12."""
    rng = np.random.default_rng(1)
    s_pn = shard_stats(rng, 2000, 4, 0.5)
    hi = s_pn.astype(BF16)
    lo = (s_pn - hi.astype(np.float32)).astype(BF16)
    got = (all_reduce_bf16(hi, "wide").astype(np.float32) + all_reduce_bf16(lo, "wide").astype(np.float32))
    exact = s_pn.astype(np.float64).sum(0)
    assert np.max(np.abs(got - exact) / exact) > 2.0 ** -10


class Fp32Stats(Collectives):
    """The reference: `psum((z..., Σx²))`, the statistic summed in fp32 in a second all-reduce."""

    def reduce_latents(self, zs, ss, *, name: str):
        *zs, ss = jax.lax.psum((*zs, ss), self.axis)
        return tuple(zs), ss


D, R, DENSE = 32, 8, 16


def inputs(dtype):
    rng = np.random.default_rng(7)
    x_btd = rng.standard_normal((2, 8, D)) * np.linspace(0.2, 3.0, D)  # uneven shards
    g_d = 1.0 + 0.1 * rng.standard_normal(D)
    a_dgr = rng.standard_normal((D, 3, R)) / np.sqrt(D)
    w_df = rng.standard_normal((D, DENSE)) / np.sqrt(D)
    c = [rng.standard_normal((2, 8, 3, R)), rng.standard_normal((2, 8, DENSE))]
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return (cast(x_btd), cast(g_d), cast(a_dgr), cast(w_df)), [jnp.asarray(ci, jnp.float32) for ci in c]


def norm_fn(tp: int, coll_cls, stat: bool = True):
    """`(x, g, a, w, c) -> (loss, Σx²)` of one Online-RMSNorm site on a `model=tp` mesh: x, g and the
    rows of a, w sharded along d; the loss `Σ c ⊙ RMSNorm(x) @ M` over both outputs. `stat`: Σx² from
    a second site (`reduce_latents` of zeros and Σx²) to read it; else the loss alone."""
    mesh = Mesh(np.array(jax.devices()[:tp]), ("model",))
    coll = coll_cls(axis="model", psum_at="latent")

    def local(x_btd, g_d, a_dgr, w_df, c0, c1):
        zs = ops.online_norm_many(x_btd, g_d, (a_dgr, w_df), coll, d_model=D, eps=1e-6, name="t")
        loss = sum(jnp.sum(z.astype(jnp.float32) * c) for z, c in zip(zs, (c0, c1)))
        if not stat:
            return loss, None
        ss = jnp.sum(jnp.square(x_btd.astype(jnp.float32)), axis=-1, keepdims=True)
        _, ss = coll.reduce_latents((jnp.zeros((*ss.shape[:-1], R), x_btd.dtype),), ss, name="s")
        return loss, ss

    d = P(None, None, "model")
    specs = (d, P("model"), P("model"), P("model"), P(), P())
    if not stat:
        return jax.shard_map(lambda *args: local(*args)[0], mesh=mesh, in_specs=specs, out_specs=P())
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(), P()))


def all_reduces(tp, coll_cls, dtype, grad: bool) -> tuple[int, int]:
    """(all-reduces JAX emits, all-reduces in the compiled CPU program) of one norm site."""
    (x, g, a, w), c = inputs(dtype)
    fn = norm_fn(tp, coll_cls, stat=False)
    f = jax.jit(jax.grad(fn, argnums=(0, 1, 2, 3)) if grad else fn)
    lowered = f.lower(x, g, a, w, *c)
    compiled = lowered.compile().as_text()
    return lowered.as_text().count("stablehlo.all_reduce"), len(re.findall(r"all-reduce(-start)?\(", compiled))


@pytest.mark.parametrize("tp", [2, 4])
def test_one_all_reduce_per_norm_site(tp):
    """One all-reduce per norm site in bf16 as in fp32, emitted by JAX and compiled, forward and with
    gradients (the statistic's cotangent is replicated: no collective). The fp32-statistic reference
    `psum((z_a, z_w, Σx²))` emits one per operand in bf16 (XLA's CPU backend combines them into one)."""
    for dtype in (jnp.bfloat16, jnp.float32):
        for grad in (False, True):
            assert all_reduces(tp, Collectives, dtype, grad) == (1, 1), (dtype, grad)
    assert all_reduces(tp, Fp32Stats, jnp.bfloat16, False) == (3, 1)


@pytest.mark.parametrize("tp", [2, 4])
def test_bf16_norm_within_bound_of_fp32_statistic(tp):
    """Loss, Σx² and every gradient of bf16 Online-RMSNorm against the fp32-statistic reference.

    Σx²: within `bound(tp)` (<= 2^-12) relative of the exact sum. The scale `rsqrt(Σx²/d + ε)` then
    moves by at most half that, so a bf16 output rounds to the same value or one bf16 ulp (2^-8 relative)
    apart; the loss (a sum of outputs) and the gradients (computed in bf16 from them) agree to the
    bf16 rounding of their terms: 2^-8 of the terms' norm, an ulp of headroom."""
    (x, g, a, w), c = inputs(jnp.bfloat16)
    got_fn, ref_fn = jax.jit(norm_fn(tp, Collectives)), jax.jit(norm_fn(tp, Fp32Stats))
    (loss, ss), (ref_loss, ref_ss) = got_fn(x, g, a, w, *c), ref_fn(x, g, a, w, *c)
    exact = np.sum(np.asarray(x, np.float64) ** 2, axis=-1, keepdims=True)
    assert np.all(np.abs(np.asarray(ss) - exact) <= bound(tp) * exact)
    assert np.all(np.abs(np.asarray(ref_ss) - exact) <= 1e-6 * exact)
    scale = sum(float(jnp.sum(jnp.abs(ci))) for ci in c) * float(jnp.max(jnp.abs(x)))  # bounds Σ|c ⊙ out|
    assert abs(float(loss) - float(ref_loss)) <= 2.0 ** -8 * scale

    grads = lambda fn: jax.jit(jax.grad(lambda *args: fn(*args, *c)[0], argnums=(0, 1, 2, 3)))(x, g, a, w)  # noqa: E731
    for name, got, ref in zip("xgaw", grads(got_fn), grads(ref_fn)):
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        assert got.dtype == ref.dtype
        assert np.linalg.norm(got - ref) <= 2.0 ** -8 * np.linalg.norm(ref), name


def test_statistic_gradient_crosses_as_two_parts():
    """The cotangent of the summed Σx² reaches each shard's fp32 Σx² to 2^-16 relative (hi + lo parts),
    not rounded to bf16: d/dx Σ_t c_t Σ_d x² = 2 c x."""
    tp = 4
    mesh = Mesh(np.array(jax.devices()[:tp]), ("model",))
    coll = Collectives(axis="model", psum_at="latent")

    def local(x_btd, c_bt):
        ss = jnp.sum(jnp.square(x_btd), axis=-1, keepdims=True)
        z = jnp.zeros((*ss.shape[:-1], R), jnp.bfloat16)
        _, ss = coll.reduce_latents((z,), ss, name="s")
        return jnp.sum(ss[..., 0] * c_bt)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(None, None, "model"), P()), out_specs=P())
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 8, D)), jnp.float32)
    c = jnp.asarray(1.0 + rng.uniform(size=(2, 8)) / 3, jnp.float32)  # not bf16-representable
    got = np.asarray(jax.jit(jax.grad(fn))(x, c))
    want = 2 * np.asarray(c, np.float64)[..., None] * np.asarray(x, np.float64)
    np.testing.assert_allclose(got, want, rtol=2.0 ** -15)  # a bf16 cotangent would be 2^-9 off
