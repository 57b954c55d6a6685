"""The low-rank block as published: one CoLA block (and LaX's crossing chain) computed by hand in
numpy against `Block`, CoLA's init statistics, the presets' eps/tie, and old run folders reading as
the old MLP form (CoLA https://arxiv.org/abs/2502.10940, LaX https://arxiv.org/abs/2505.21732)."""

import json
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from boostjax.config import PRESETS, Config, ModelConfig, TrainConfig, preset
from boostjax.models import ops
from boostjax.models.llama import LLaMA, Block

CFG = ModelConfig(kind="cola", vocab_size=64, d_model=32, n_layers=1, n_heads=4, d_ff=48, rank=8,
                  norm_eps=1e-6, rope_theta=500.0)
B, T = 2, 8


def _silu(z):
    return z / (1.0 + np.exp(-z))


def _rms(x, g, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g


def _rope(x_bthe, theta):
    """Rotate-half RoPE (Hugging Face LLaMA, as CoLA's modeling code), from its definition."""
    e = x_bthe.shape[-1]
    inv = theta ** (-np.arange(0, e, 2) / e)
    ang = np.arange(x_bthe.shape[1])[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x_bthe[..., e // 2:], x_bthe[..., :e // 2]], -1)
    return x_bthe * cos[:, None] + rot * sin[:, None]


def _hand_block(p, x, cfg, cross_attn=(0.0, 0.0, 0.0), cross_mlp=(0.0, 0.0), v_from_crossed_k=True):
    """`x + attn(x)`, then `+ mlp(.)`, in float64 from the published formulas: every projection
    `sigma(x A) B`, q/k/v/o and gate/up/down; MLP hidden `gate * up` (CoLA's only_lr_act) or
    `silu(gate) * up`; LaX: k <- q, v <- crossed k, o <- crossed v; up <- gate, down <- crossed up."""
    sig = (lambda z: z) if cfg.kind == "svd" else _silu
    a, m = p["attn"], p["mlp"]
    xn = _rms(x, a["norm"], cfg.norm_eps)
    hq, hk, hv = (sig(xn @ a["a_qkv"][:, i]) for i in range(3))
    hk_crossed = hk + cross_attn[0] * hq
    hv = hv + cross_attn[1] * (hk_crossed if v_from_crossed_k else hk)
    hk = hk_crossed
    e, nh = cfg.head_dim, cfg.n_heads
    q = _rope((hq @ a["b_q"]).reshape(B, T, nh, e), cfg.rope_theta)
    k = _rope((hk @ a["b_kv"][0]).reshape(B, T, nh, e), cfg.rope_theta)
    v = (hv @ a["b_kv"][1]).reshape(B, T, nh, e)
    s = np.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(e)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhe->bqhe", pr, v).reshape(B, T, nh * e)
    h = x + (sig(o @ a["a_o"]) + cross_attn[2] * hv) @ a["b_o"]
    hn = _rms(h, m["norm"], cfg.norm_eps)
    hg, hu = sig(hn @ m["a_gate_up"][:, 0]), sig(hn @ m["a_gate_up"][:, 1])
    hu = hu + cross_mlp[0] * hg
    gate, up = hg @ m["b_gate_up"][0], hu @ m["b_gate_up"][1]
    hid = gate * up if (cfg.only_lr_act and cfg.kind != "svd") else _silu(gate) * up
    return h + (sig(hid @ m["a_down"]) + cross_mlp[1] * hu) @ m["b_down"]


def _block_and_params(cfg, seed=0):
    """A `Block` with random numpy parameters (norm scales around 1, LaX gates 0): shapes from
    `nnx.eval_shape`, so no per-shape RNG program is compiled (the init has its own test)."""
    rng = np.random.default_rng(seed)

    def fill(path, s):
        name = str(path[-1].key) if hasattr(path[-1], "key") else str(path[-1])
        if name == "norm":
            return 1.0 + 0.3 * rng.standard_normal(s.shape).astype(np.float32)
        if name == "cross":
            return np.zeros(s.shape, np.float32)
        return 0.3 * rng.standard_normal(s.shape).astype(np.float32)

    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(seed))))
    params = jax.tree_util.tree_map_with_path(fill, shapes.to_pure_dict())
    blk = nnx.merge(graphdef, nnx.State(jax.tree.map(jnp.asarray, params)))
    return blk, {k: {n: np.asarray(v, np.float64) for n, v in d.items()} for k, d in params.items()}


def _run(blk, cfg, x):
    cos, sin = ops.model_rope_tables(cfg, T)
    return np.asarray(blk(x.astype(np.float32), cos, sin), np.float64)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kind,only_lr_act", [("cola", True), ("cola", False), ("svd", True)])
def test_one_block_equals_the_published_formula(kind, only_lr_act):
    """cola: `gate * up` (only_lr_act, CoLA's default) or `silu(gate) * up`; svd keeps SwiGLU either way.
    The residual is subtracted so that the comparison is on the block's own output."""
    cfg = replace(CFG, kind=kind, only_lr_act=only_lr_act)
    blk, p = _block_and_params(cfg)
    x = np.random.default_rng(1).standard_normal((B, T, cfg.d_model))
    got, want = _run(blk, cfg, x) - x, _hand_block(p, x, cfg) - x
    assert _rel(got, want) < 1e-5, _rel(got, want)
    other = _hand_block(p, x, replace(cfg, only_lr_act=not only_lr_act)) - x  # the test tells the forms apart
    assert kind == "svd" or _rel(other, want) > 1e-2


def test_lax_crossing_chain_uses_post_crossing_latents():
    """Non-zero gates: v crosses the already-crossed k, o the crossed v, down the crossed up."""
    cfg = replace(CFG, kind="lax")
    blk, p = _block_and_params(cfg)
    ca, cm = (0.7, -1.3, 0.9), (1.1, -0.8)
    blk.attn.cross[...] = np.array(ca, np.float32)
    blk.mlp.cross[...] = np.array(cm, np.float32)
    x = np.random.default_rng(2).standard_normal((B, T, cfg.d_model))
    got, want = _run(blk, cfg, x) - x, _hand_block(p, x, cfg, ca, cm) - x
    assert _rel(got, want) < 1e-5, _rel(got, want)
    pre = _hand_block(p, x, cfg, ca, cm, v_from_crossed_k=False) - x  # v <- PRE-crossing k (the former code)
    assert _rel(pre, want) > 1e-3, _rel(pre, want)


def test_init_is_colas_and_dense_keeps_init_std():
    """60m shapes (one layer, GQA 8/4 heads: k/v read as the dense [d, kv_heads * head_dim] layers):
    each factor's sample std within 3 % of `r^-1/4 (d_in + d_out)^-1/4`; dense, embedding and head
    keep `init_std`."""
    cfg = preset("60m", n_layers=1, vocab_size=256, n_kv_heads=4)
    d, f, r, he, ke = 512, 1376, 128, 512, 256
    std = lambda i, o: r ** -0.25 * (i + o) ** -0.25  # noqa: E731
    dense_cfg = replace(cfg, kind="llama", d_ff=256)
    m, dense = LLaMA(cfg, rngs=nnx.Rngs(0)), Block(dense_cfg, rngs=nnx.Rngs(0))
    a, mlp = m.layers[0].attn, m.layers[0].mlp
    want = {"a_q": (a.a_qkv[...][:, 0], std(d, he)), "a_k": (a.a_qkv[...][:, 1], std(d, ke)),
            "a_v": (a.a_qkv[...][:, 2], std(d, ke)), "b_q": (a.b_q[...], std(d, he)),
            "b_kv": (a.b_kv[...], std(d, ke)), "a_o": (a.a_o[...], std(he, d)), "b_o": (a.b_o[...], std(he, d)),
            "a_gate_up": (mlp.a_gate_up[...], std(d, f)), "b_gate_up": (mlp.b_gate_up[...], std(d, f)),
            "a_down": (mlp.a_down[...], std(f, d)), "b_down": (mlp.b_down[...], std(f, d)),
            "embed": (m.embed[...], 0.02), "head": (m.head[...], 0.02)}
    for name, (w, s) in want.items():
        assert abs(float(np.std(np.asarray(w))) / s - 1) < 0.03, (name, float(np.std(np.asarray(w))), s)
    for w in (dense.attn.w_q, dense.attn.w_k, dense.attn.w_o, dense.mlp.w_gate, dense.mlp.w_down):
        assert abs(float(np.std(np.asarray(w[...]))) / 0.02 - 1) < 0.03


def test_presets_follow_the_references():
    """RMSNorm eps 1e-6 (CoLA's json, BOOST's yaml), untied (CoLA), one rank, CoLA's only_lr_act; a
    preset-less ModelConfig keeps eps 1e-5."""
    for name, m in PRESETS.items():
        assert m.norm_eps == 1e-6 and not m.tie_embeddings and m.only_lr_act, name
    assert ModelConfig().norm_eps == 1e-5 and ModelConfig().only_lr_act


def test_an_old_run_folder_reads_and_resumes_as_the_old_mlp(tmp_path):
    """A config.json written before `only_lr_act` existed means `silu(gate) * up`; the same command line
    (no --only-lr-act, a preset whose eps changed since) resumes it unchanged; flags given still win."""
    from boostjax.cli import build_parser
    from boostjax.cli.train import train_config
    from boostjax.runs.folder import RunFolder

    out = tmp_path / "run"
    out.mkdir()
    old = Config(preset("tiny", norm_eps=1e-5), TrainConfig(out=str(out), steps=5)).to_dict()
    del old["model"]["only_lr_act"]
    (out / "config.json").write_text(json.dumps(old))
    folder = RunFolder(out)
    stored = folder.stored_config()
    assert stored.model.only_lr_act is False and stored.model.gated_silu

    def cli(*flags):
        return train_config(build_parser().parse_args(["train", "--out", str(out), "--steps", "9", *flags]))

    same = cli()
    assert same.model == stored.model
    assert set(folder.check_resume(stored, same, resuming=True)) == {"train.steps"}
    assert cli("--only-lr-act").model.only_lr_act is True and cli("--norm-eps", "1e-6").model.norm_eps == 1e-6
    with pytest.raises(ValueError, match="--no-only-lr-act"):
        folder.check_resume(stored, cli("--only-lr-act"), resuming=True)
    fresh = train_config(build_parser().parse_args(["train", "--out", str(tmp_path / "new")]))
    assert fresh.model.only_lr_act and fresh.model.norm_eps == 1e-6 and not fresh.model.gated_silu
