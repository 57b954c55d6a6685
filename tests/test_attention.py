"""Chunked (blockwise, FlashAttention-2) and row-blocked attention against the materialised reference:
the ops, the whole model on every strategy, a pipeline and the remat policies; no `[t, t]` buffer in
the compiled step; the choice's validation and what a resumed run or an export does with it."""

import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_CPU, rel as _rel, seed_of
from test_tp import TINY, _compare, assert_matches

from boostjax.interop import hf
from boostjax.config import Config, ConfigError, ModelConfig, TrainConfig, validate_model
from boostjax.training.checks import validate
from boostjax.models import attention, ops
from boostjax.placement import local_loss_fn
from boostjax.runs.folder import RunFolder
from boostjax.models.llama import abstract_model

BF16_EPS = 2.0**-8  # bfloat16's spacing at 1 (8 significand bits)


def _qkv(t: int, dtype, seed: int = 0):
    """q [2, t, 4, 8], k and v [2, t, 2, 8] (grouped-query heads, h=4, k=2), and a cotangent for q's shape."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(key, (2, t, n, 8), jnp.float32).astype(dtype) for key, n in zip(ks, (4, 2, 2)))
    return q, k, v, jax.random.normal(ks[3], (2, t, 4, 8), jnp.float32)


def _out_and_grads(impl: str, block: int, q, k, v, w, segments=None):
    """Attention output and the gradients of <out, w> for q, k, v (fp32 copies), jitted."""
    def f(q, k, v):
        o = ops.causal_attention(q, k, v, impl=impl, block=block, segments_bt=segments)
        return jnp.sum(o.astype(jnp.float32) * w), o

    (_, o), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float32) for x in (o, *grads)]


def test_chunked_op_matches_reference_fp32():
    """Four 32-position blocks over t = 100 (the last one padded), six of the sixteen tiles skipped."""
    q, k, v, w = _qkv(100, jnp.float32)
    with jax.default_matmul_precision("highest"):
        ref = _out_and_grads("xla", 32, q, k, v, w)
        got = _out_and_grads("chunked", 32, q, k, v, w)
    errs = [_rel(a, b) for a, b in zip(got, ref)]  # out, dq, dk, dv
    assert max(errs) < 1e-5, errs  # measured <= 3.2e-7


@pytest.mark.parametrize("block,rows", [(32, 64), (128, 32)])
def test_op_matches_reference_bf16(monkeypatch, block, rows):
    """t = 128 in bf16, chunked over 32-position tiles or row-blocked (one tile, 32-position rows): both
    paths round p before p·v and the gradients' operands, like the reference; their errors against the
    fp32 computation on the same (bf16) inputs are of one size, a few bf16 ulps."""
    monkeypatch.setattr(attention, "ROW_BLOCK", rows)
    q, k, v, w = _qkv(128, jnp.bfloat16, seed=block)
    with jax.default_matmul_precision("highest"):
        exact = _out_and_grads("xla", block, *(x.astype(jnp.float32) for x in (q, k, v)), w)
        ref = _out_and_grads("xla", block, q, k, v, w)
        got = _out_and_grads("chunked", block, q, k, v, w)
    for name, g, r, x in zip(("out", "dq", "dk", "dv"), got, ref, exact):
        err, ref_err = _rel(g, x), _rel(r, x)
        # measured: chunked 1.8e-3..3.2e-3, xla 2.2e-3..3.0e-3 (at most 1.1x the reference's error)
        assert err < 2 * BF16_EPS and err < 2 * ref_err + BF16_EPS / 4, (name, err, ref_err)


@pytest.mark.parametrize("t,rows,segments", [(100, 32, False), (64, 16, True), (20, 64, False)])
def test_row_blocked_op_matches_reference_fp32(monkeypatch, t, rows, segments):
    """The single-tile path (t <= block) in blocks of `rows` query positions (grouped-query heads): four
    blocks of 32 over t = 100 (the last one 4 positions), four of 16 with packed documents, and one block
    shorter than a row block; output and gradients against the materialised reference."""
    monkeypatch.setattr(attention, "ROW_BLOCK", rows)
    q, k, v, w = _qkv(t, jnp.float32, seed=t)
    seg = jnp.sort(jax.random.randint(jax.random.key(t + 1), (2, t), 0, 3), axis=1) if segments else None
    with jax.default_matmul_precision("highest"):
        got, ref = (_out_and_grads(impl, 128, q, k, v, w, seg) for impl in ("chunked", "xla"))
    errs = [_rel(a, b) for a, b in zip(got, ref)]  # out, dq, dk, dv
    assert max(errs) < 1e-5, errs  # measured <= 3.7e-7


def test_the_benchmarks_first_row_blocked_version_is_the_same_attention():
    """`attention_speed` times the row-blocked backward against its first version (E saved as computed):
    both give the reference's output and gradients, so the comparison is between equal computations."""
    from experiments.speed.attention_speed import first_row_blocked

    q, k, v, w = _qkv(40, jnp.float32, seed=5)
    first = first_row_blocked(16)

    def f(q, k, v):
        o = first(q, k, v)
        return jnp.sum(o * w), o

    with jax.default_matmul_precision("highest"):
        (_, o), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        ref = _out_and_grads("xla", 128, q, k, v, w)
    errs = [_rel(np.asarray(a), b) for a, b in zip((o, *grads), ref)]  # out, dq, dk, dv
    assert max(errs) < 1e-5, errs


def test_row_blocked_compiles_only_the_tiles_at_or_below_the_diagonal(monkeypatch):
    """t = 128 in 32-position blocks: the compiled forward holds score tiles [.., 32, 32·(i+1)] for i = 0..3
    (10 of the 16 [32, 32] tiles), and no [.., t, t] buffer."""
    monkeypatch.setattr(attention, "ROW_BLOCK", 32)
    q, k, v, _ = _qkv(128, jnp.float32)
    f = jax.jit(lambda q, k, v: ops.causal_attention(q, k, v, impl="chunked", block=128))
    hlo = f.lower(q, k, v).compile(FAST_CPU).as_text()
    # rows = 32 positions x g = 2 query heads per kv head
    assert {f"f32[2,2,64,{32 * (i + 1)}]" for i in range(4)} <= {m.group(0) for m in SHAPE.finditer(hlo)}
    assert not _square_buffers(hlo, 128)


def test_row_blocked_gradient_has_no_empty_index_scatter():
    """The backward adds each block's dk, dv into the keys it covers: the block that covers all of them
    (t = 100 in 32-position rows: keys 0..99) as a plain add, the shorter ones as scatter-adds. A scatter
    with an empty index vector (what `.at[:, :, :t].add` lowers to) segfaults jax 0.11.2's Shardy inside a
    `shard_map` (docs/gpu-program.md); the lowered gradient holds none."""
    q, k, v, _ = _qkv(100, jnp.float32)
    grad = jax.grad(lambda q, k, v: jnp.sum(attention.row_blocked_attention(q, k, v, 32)), argnums=(0, 1, 2))
    text = jax.jit(grad).lower(q, k, v).as_text()
    operands = re.findall(r"stablehlo\.scatter.*?: \((tensor<[^>]*>), (tensor<[^>]*>), (tensor<[^>]*>)\) ->",
                          text, re.S)
    index_shapes = sorted({index for _, index, _ in operands})
    assert len(operands) == 2 * 3 and index_shapes == ["tensor<1xi32>"], operands  # dk, dv of blocks 1-3


# TINY with seq 64 and 16-position tiles: four blocks, six of the sixteen tiles skipped as fully masked
ATTN = replace(TINY, attention="chunked", attention_block=16, max_seq_len=64)


@pytest.mark.parametrize("strategy,kind,mesh,remat,layers,block", [
    ("none", "cola", "", "none", 1, 16),
    ("btp", "cola", "data=1,model=2", "lowrank", 1, 16),
    ("vanilla-tp", "lax", "data=2,model=2", "none", 1, 16),
    ("fullrank-tp", "llama", "data=1,model=4", "full", 1, 16),
    ("btp", "svd", "data=1,stage=2,model=2", "none", 2, 16),
    ("btp", "cola", "data=2,model=2", "lowrank", 1, 64),
    ("none", "llama", "", "full", 1, 64),
])
def test_model_matches_the_reference_attention(monkeypatch, strategy, kind, mesh, remat, layers, block):
    """Loss and every gradient of the chunked model, on each strategy, against the one-device model
    with the materialised attention (fp32). Block 16: four tiles; block 64: the whole sequence in one
    tile, so the row-blocked path runs (in four 16-position row blocks)."""
    monkeypatch.setattr(attention, "ROW_BLOCK", 16)
    model = replace(ATTN, kind=kind, n_layers=layers, attention_block=block)
    cfg = validate(Config(model, TrainConfig(strategy=strategy, mesh=mesh, remat=remat, batch=4, seq=64)))
    ref = replace(cfg, model=replace(model, attention="xla"))
    # measured <= 7.8e-7 (loss <= 1.6e-7), LaX's scalar gates 1.7e-6 (their bound: test_tp.GATE_TOL)
    assert_matches(*_compare(cfg, seed=seed_of(strategy, kind, "attention", str(block)), ref=ref), tol=1e-5)


SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,]+)\]")


def _square_buffers(hlo: str, t: int) -> set[str]:
    """Shapes in an HLO text with two or more dimensions equal to `t`."""
    return {m.group(0) for m in SHAPE.finditer(hlo) if m.group(1).split(",").count(str(t)) >= 2}


@pytest.mark.parametrize("impl,remat", [("chunked", "none"), ("chunked", "lowrank"), ("xla", "none")])
def test_compiled_step_holds_no_sequence_squared_buffer(impl, remat):
    """The compiled loss-and-gradient of a seq-512 model, read from its HLO: no buffer has two
    sequence-length dimensions with chunked attention (64-position tiles); the reference has them."""
    t = 512
    model = ModelConfig(kind="cola", vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=48,
                        rank=8, max_seq_len=t, attention=impl, attention_block=64)
    cfg = Config(model, TrainConfig(batch=1, seq=t, remat=remat))
    graphdef, params = abstract_model(cfg)
    batch = {k: jax.ShapeDtypeStruct((1, t), jnp.int32) for k in ("inputs", "targets")}
    # FAST_CPU: the same optimised HLO (compared for these three cases) in ~60 % of the compile time
    hlo = jax.jit(jax.value_and_grad(local_loss_fn(cfg, graphdef))).lower(params, batch).compile(FAST_CPU).as_text()
    square = _square_buffers(hlo, t)
    if impl == "xla":
        assert square, "the reference materialises [.., t, t] scores"
    else:
        assert not square, sorted(square)
        assert _square_buffers(hlo, 64), "the tiles are there"


def test_auto_resolves_by_backend_and_dtype(monkeypatch):
    assert jax.default_backend() == "cpu"
    assert attention.resolve("auto", jnp.bfloat16) == "chunked"
    assert attention.resolve("auto", jnp.float32) == "chunked"
    assert attention.resolve("xla", jnp.float32) == "xla"
    with pytest.raises(ConfigError, match=r"^model.attention: cudnn .* CUDA GPU.*'cpu'; fix: pass --attention chunked"):
        attention.check_backend(replace(TINY, attention="cudnn"), "bfloat16")
    monkeypatch.setattr(attention, "on_cuda_gpu", lambda: True)  # what a CUDA machine decides
    assert attention.resolve("auto", jnp.bfloat16) == "cudnn" == attention.resolve("cudnn", jnp.float16)
    assert attention.resolve("auto", jnp.float32) == "chunked"
    with pytest.raises(ConfigError, match=r"^model.attention: cudnn runs in bfloat16/float16.*fix: pass --dtype"):
        attention.resolve("cudnn", jnp.float32)


def test_bad_choices_are_one_line_config_errors():
    for field, bad in (("attention", "bogus"), ("attention_block", 0)):
        with pytest.raises(ConfigError, match=rf"^model.{field}: [^\n]*; fix: "):
            validate_model(replace(TINY, **{field: bad}))
    with pytest.raises(ConfigError, match=r"^model.attention: cudnn runs in bfloat16/float16 .*fix: pass --dtype bf"):
        validate(Config(replace(TINY, attention="cudnn"), TrainConfig(dtype="float32")))


def test_resume_may_change_the_attention_but_not_the_shapes(tmp_path):
    old = Config(TINY, TrainConfig())
    folder = RunFolder(tmp_path / "run")
    new = replace(old, model=replace(TINY, attention="xla", attention_block=128))
    assert folder.check_resume(old, new, resuming=True) == {"model.attention": ["auto", "xla"],
                                                            "model.attention_block": [512, 128]}
    with pytest.raises(ConfigError, match="model.d_model: the checkpoints"):
        folder.check_resume(old, replace(new, model=replace(new.model, d_model=32)), resuming=True)


def test_hf_export_round_trip_gives_the_default_attention():
    cfg = replace(TINY, kind="llama", attention="chunked", attention_block=64)
    back = hf.config_from_hf(hf.hf_config(cfg))
    assert back.attention == "auto" and back.attention_block == 512
    assert replace(back, attention="chunked", attention_block=64, rank=cfg.rank) == cfg  # rank: unused by llama
