"""The LLaMA model: shapes, parameter count, causality, Online-RMSNorm, remat and GQA equivalences."""

import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from boostjax.config import ModelConfig
from boostjax.models import ops
from boostjax.models.flops import flops_per_token, param_count
from boostjax.models.llama import LLaMA, param_axes, param_shapes
from boostjax.models.collectives import LOCAL
from helpers import rel

SMALL = ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, rank=8, vocab_size=64)


def _model(kind: str, **kw) -> LLaMA:
    return LLaMA(replace(SMALL, kind=kind, **kw), rngs=nnx.Rngs(0))


def _tokens(b=2, t=12, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, SMALL.vocab_size)


@pytest.mark.parametrize("kind", ["llama", "cola", "svd", "lax"])
def test_shapes_and_param_count(kind):
    model = _model(kind)
    logits = model(_tokens())
    assert logits.shape == (2, 12, SMALL.vocab_size) and logits.dtype == jnp.float32
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == param_count(model.cfg)
    assert flops_per_token(model.cfg, 128) > 6 * (n - SMALL.vocab_size * SMALL.d_model)


@pytest.mark.parametrize("kind", ["llama", "cola", "svd", "lax"])
@pytest.mark.parametrize("tie", [False, True])
def test_param_shapes_are_the_models(kind, tie):
    """`param_shapes` (read from a one-layer abstract model, cached) names and shapes every parameter of
    the real model, with the axes it declares; a tied model has no head but still pays the logits GEMM
    in `flops_per_token`, and the embedding lookup pays nothing."""
    cfg = replace(SMALL, kind=kind, n_layers=3, tie_embeddings=tie)
    model = LLaMA(cfg, rngs=nnx.Rngs(0))
    flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert {k: tuple(v.shape) for k, v in flat.items()} == dict(param_shapes(cfg))
    assert {k: tuple(v.get_metadata()["out_sharding"]) for k, v in flat.items()} == dict(param_axes(cfg))
    assert ("head" in param_shapes(cfg)) is not tie
    block = param_shapes(cfg, block=True)
    assert {f"layers.2.{k}": v for k, v in block.items()} == {k: v for k, v in param_shapes(cfg).items()
                                                               if k.startswith("layers.2.")}
    assert param_shapes(cfg) is param_shapes(replace(cfg))  # cached on the frozen config
    d, v, seq = cfg.d_model, cfg.vocab_size, 16
    matmul = sum(int(np.prod(s)) for s in block.values() if len(s) > 1)
    attn = 12 * cfg.n_layers * seq * cfg.n_heads * cfg.head_dim
    assert flops_per_token(cfg, seq) == 6 * (cfg.n_layers * matmul + d * v) + attn
    assert flops_per_token(cfg, seq) == flops_per_token(replace(cfg, tie_embeddings=not tie), seq)


def test_low_rank_is_smaller_and_the_7b_preset_is_llama_7b():
    from boostjax.config import preset

    assert param_count(preset("7b", kind="cola")) < 0.5 * param_count(preset("7b", kind="llama"))
    # LLaMA-7B has 6.74B parameters with a 32000 vocabulary
    assert abs(param_count(preset("7b", kind="llama", vocab_size=32000)) - 6.74e9) < 0.01e9


@pytest.mark.parametrize("kind", ["llama", "cola", "lax"])
def test_causal(kind):
    model = _model(kind)
    a = _tokens(seed=1)
    b = a.at[:, 7:].set((a[:, 7:] + 5) % SMALL.vocab_size)
    la, lb = model(a), model(b)
    np.testing.assert_allclose(la[:, :7], lb[:, :7], rtol=1e-5, atol=1e-6)
    assert not np.allclose(la[:, 7:], lb[:, 7:])


def test_online_rms_norm_equals_norm_then_matmul():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (2, 5, 16)) * 3.0
    g = 1.0 + 0.1 * jax.random.normal(k2, (16,))
    a = jax.random.normal(k3, (16, 3, 4))
    ref = jnp.einsum("btd,dgr->btgr", ops.rms_norm(x, g, 1e-5), a)
    got = ops.online_norm_down(x, g, a, LOCAL, d_model=16, eps=1e-5, name="t")
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_gqa_equals_repeated_kv_heads():
    k = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(k[0], (1, 6, 4, 8))
    kv = jax.random.normal(k[1], (1, 6, 2, 8)), jax.random.normal(k[2], (1, 6, 2, 8))
    got = ops.causal_attention(q, *kv)
    rep = [jnp.repeat(t, 2, axis=2) for t in kv]
    ref = np.asarray(ops.causal_attention(q, *rep))
    # on the scale of the output (|ref| <= 2.9): grouped and repeated heads reduce in another order, and
    # 1-ulp input noise already moves entries by 4e-7 max|ref| (0.67 of the old atol = rtol = 1e-6);
    # 1e-5 max|ref| leaves 24x, while tiling the kv heads instead of repeating them is off by 0.84 max|ref|
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("kind,remat", [("cola", "lowrank"), ("cola", "full"), ("llama", "full"), ("lax", "lowrank")])
def test_remat_changes_nothing(kind, remat):
    model = _model(kind)
    graphdef, state = nnx.split(model)
    toks = _tokens(seed=3)

    def loss(state, remat):
        return nnx.merge(graphdef, state).loss(toks, toks, remat=remat)

    l0, g0 = jax.value_and_grad(loss)(state, "none")
    l1, g1 = jax.value_and_grad(loss)(state, remat)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    # per leaf on its own scale: some gradient leaves (b_q, norms) peak at 3e-6, where the former atol 1e-7
    # let a 3 % error pass; remat recomputes the same ops (bit-identical here), 1e-5 of the scale is ~100 ulps
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.abs(b).max())), g0, g1)


def test_svd_is_linear_in_the_bottleneck_and_cola_is_not():
    """SVD-style pairs compose linearly (B(Ax)) under SwiGLU; CoLA puts SiLU between the factors and
    multiplies gate and up directly (only_lr_act)."""
    x = jax.random.normal(jax.random.key(4), (1, 3, SMALL.d_model))
    cos, sin = ops.rope_tables(3, SMALL.head_dim, SMALL.rope_theta)
    for kind, linear in (("svd", True), ("cola", False)):
        mlp = _model(kind).layers[0].mlp
        a, bg = mlp.a_gate_up[...], mlp.b_gate_up[...]
        z = ops.online_norm_down(x, mlp.norm[...], a, LOCAL, d_model=SMALL.d_model, eps=SMALL.norm_eps, name="t")
        sig = z if linear else jax.nn.silu(z)
        gate = sig[:, :, 0] @ bg[0]
        up = sig[:, :, 1] @ bg[1]
        h = jax.nn.silu(gate) * up if linear else gate * up  # svd keeps SwiGLU; cola: CoLA's gate * up
        hd = h @ mlp.a_down[...]
        out = (hd if linear else jax.nn.silu(hd)) @ mlp.b_down[...]
        # on the scale of the output: max|out| is 1.6e-4 (svd) and 1e-5 (cola), so the former atol 1e-6
        # let a 10 % error pass; both sides run the same ops (bit-identical here), 1e-5 of the scale is ~100 ulps
        np.testing.assert_allclose(mlp(x, LOCAL), out, rtol=0, atol=1e-5 * float(jnp.abs(out).max()))
    del cos, sin


def test_bf16_compute_is_close_to_fp32():
    model = _model("cola")
    graphdef, state = nnx.split(model)
    toks = _tokens(seed=5)
    l32 = nnx.merge(graphdef, state).loss(toks, toks)
    s16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), state)
    l16 = nnx.merge(graphdef, s16).loss(toks, toks)
    assert l16.dtype == jnp.float32 and abs(float(l16 - l32)) < 0.05


def _stacked_grouped_up(hs, b_grk, coll):
    """The former layout of the grouped up-projection (group axis in the middle): the reference."""
    y_btgk = coll.reduce_up(jnp.einsum("btgr,grk->btgk", jnp.stack(hs, 2), b_grk))
    return tuple(y_btgk[:, :, i] for i in range(len(hs)))


@pytest.mark.parametrize("kind", ["cola", "svd", "lax"])
def test_group_major_up_projection_equals_stacked_reference(kind, monkeypatch):
    from boostjax.models import llama

    model = _model(kind)
    graphdef, params = nnx.split(model)
    params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(3), p.shape), params)  # LaX gates != 0
    tokens, targets = _tokens(seed=4), _tokens(seed=5)

    def loss_and_grads():
        return jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(tokens, targets))(params)

    loss, grads = loss_and_grads()
    monkeypatch.setattr(llama, "grouped_up", _stacked_grouped_up)
    ref_loss, ref_grads = loss_and_grads()
    assert abs(float(loss - ref_loss)) < 1e-5 * abs(float(ref_loss))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert rel(g, r) < 1e-5


def test_rope_tables_are_host_constants_equal_to_traced_ones():
    seq, e, theta = 64, 16, 10000.0
    inv = 1.0 / (theta ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))
    ang = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv[None, :]
    ang = jnp.concatenate([ang, ang], axis=-1)
    cos, sin = ops.rope_tables(seq, e, theta)
    assert cos.dtype == sin.dtype == jnp.float32 and cos.shape == (seq, e)
    np.testing.assert_allclose(cos, jnp.cos(ang), atol=2e-6)  # angles < 64: a few ulps of the angle
    np.testing.assert_allclose(sin, jnp.sin(ang), atol=2e-6)
    hlo = jax.jit(lambda: ops.rope_tables(seq, e, theta)).lower().as_text()
    assert "cosine" not in hlo and "sine" not in hlo


def test_matmul_is_tensordot_with_its_gradients():
    """`ops.matmul` (one 2-D GEMM over flattened leading axes) against `tensordot(x, w, 1)`: values,
    both gradients, a multi-axis weight and bf16 operands with fp32 accumulation."""
    k = jax.random.split(jax.random.key(7), 3)
    x, w, dy = jax.random.normal(k[0], (2, 5, 16)), jax.random.normal(k[1], (16, 3, 4)), jax.random.normal(k[2], (2, 5, 3, 4))
    got, vjp = jax.vjp(ops.matmul, x, w)
    ref, ref_vjp = jax.vjp(lambda a, b: jnp.tensordot(a, b, axes=1), x, w)
    assert got.shape == (2, 5, 3, 4)
    with jax.default_matmul_precision("highest"):
        for a, b in zip((got, *vjp(dy)), (ref, *ref_vjp(dy))):
            assert rel(a, b) < 1e-6
    xb, wb = x.astype(jnp.bfloat16), w[:, 0].astype(jnp.bfloat16)
    out = ops.matmul(xb, wb, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32 and rel(out, jnp.tensordot(xb, wb, 1, preferred_element_type=jnp.float32)) < 1e-6


def test_weight_gradient_reads_its_operands_in_place():
    """The reason for `ops.matmul` (XLA CPU): the weight gradient of `x_btd @ w` contracts b and t at
    once and gets a transposed copy of one operand; on the 2-D form the compiled gradient has none."""
    x, w = jnp.ones((4, 8, 16)), jnp.ones((16, 24))

    def ops_of(mm):  # the opcodes of the optimised module, fused computations included
        text = jax.jit(jax.grad(lambda w: jnp.sum(jax.nn.silu(mm(x, w)) ** 2))).lower(w).compile().as_text()
        return set(re.findall(r"= \S+ ([a-z\-]+)\(", text))

    assert not {"transpose", "copy"} & ops_of(ops.matmul)
    assert "transpose" in ops_of(lambda a, b: a @ b)  # the 3-D form still does (else the helper is moot)


def test_wide_matmul_is_matmul_with_its_gradient_read_from_a_copy():
    """`ops.wide_matmul` (the LM head): the values and both gradients of `ops.matmul`, fp32 and bf16 with
    fp32 logits; its weight gradient's dot reads a transposed copy of `x` (the copy is in the compiled
    gradient, and no dot contracts dimension 0 of its left operand)."""
    k = jax.random.split(jax.random.key(11), 3)
    x, w, dy = jax.random.normal(k[0], (2, 5, 16)), jax.random.normal(k[1], (16, 24)), jax.random.normal(k[2], (2, 5, 24))
    for dt, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
        a, b = x.astype(dt), w.astype(dt)
        got, vjp = jax.vjp(lambda u, v: ops.wide_matmul(u, v, preferred_element_type=jnp.float32), a, b)
        ref, ref_vjp = jax.vjp(lambda u, v: ops.matmul(u, v, preferred_element_type=jnp.float32), a, b)
        assert got.dtype == ref.dtype == jnp.float32
        with jax.default_matmul_precision("highest"):
            for u, v in zip((got, *vjp(dy)), (ref, *ref_vjp(dy))):
                assert u.dtype == v.dtype and rel(u.astype(jnp.float32), v.astype(jnp.float32)) < tol

    def dots(mm):  # contracting dimension of every dot's left operand in the compiled weight gradient
        text = jax.jit(jax.grad(lambda w: jnp.sum(jax.nn.silu(mm(x, w)) ** 2))).lower(w).compile().as_text()
        return re.findall(r" dot\(.*?lhs_contracting_dims=\{(\d+)\}", text)

    assert dots(ops.wide_matmul) and "0" not in dots(ops.wide_matmul)
    assert "0" in dots(ops.matmul)  # the plain form contracts the activations' rows (else the copy is moot)
    # only the CPU program copies: lowered for CUDA the gradient is autodiff's own (no barrier, no copy)
    from boostjax.offload.apply import lower_for_gpu
    grad = jax.grad(lambda w: jnp.sum(ops.wide_matmul(x, w) ** 2))
    assert "optimization_barrier" in jax.jit(grad).lower(w).as_text()
    assert "optimization_barrier" not in lower_for_gpu(grad, w)


def _attention_grouped_reference(q_bthe, k_btke, v_btke, segments_bt=None):
    """The former `xla` attention (`btkge,bske->bkgts`, scores `[b, k, g, t, s]`): the reference."""
    b, t, h, e = q_bthe.shape
    kv = k_btke.shape[2]
    s = jnp.einsum("btkge,bske->bkgts", q_bthe.reshape(b, t, kv, h // kv, e), k_btke,
                   preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(e))
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    if segments_bt is not None:
        mask = mask & (segments_bt[:, None, None, :, None] == segments_bt[:, None, None, None, :])
    p = jax.nn.softmax(jnp.where(mask, s, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.einsum("bkgts,bske->btkge", p, v_btke).reshape(b, t, h, e)


@pytest.mark.parametrize("heads,kv_heads,docs", [(4, 4, False), (4, 2, False), (6, 2, True), (4, 1, True)])
def test_attention_equals_grouped_reference(heads, kv_heads, docs):
    """The `xla` path (query heads of a kv head stacked along the rows, `[b, k, g·t, s]` scores) equals the
    former grouped einsum: output and the gradients of q, k, v, for MHA, GQA and packed documents."""
    k = jax.random.split(jax.random.key(heads * 10 + kv_heads), 4)
    q = jax.random.normal(k[0], (2, 9, heads, 8))
    kk, v = (jax.random.normal(key, (2, 9, kv_heads, 8)) for key in k[1:3])
    seg = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 3, 3, 3]]) if docs else None
    w = jax.random.normal(k[3], q.shape)

    def run(fn):
        return jax.value_and_grad(lambda a, b, c: jnp.sum(fn(a, b, c) * w), argnums=(0, 1, 2))(q, kk, v)

    with jax.default_matmul_precision("highest"):
        got = run(lambda a, b, c: ops.causal_attention(a, b, c, impl="xla", segments_bt=seg))
        ref = run(lambda a, b, c: _attention_grouped_reference(a, b, c, seg))
    assert abs(float(got[0] - ref[0])) < 1e-5 * abs(float(ref[0]))
    for a, b in zip(got[1], ref[1]):
        assert rel(a, b) < 1e-6
