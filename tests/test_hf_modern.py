"""Hugging Face interop with today's checkpoint shapes: RoPE scaling (llama3, linear, dynamic), explicit
head_dim, tied embeddings, Mistral, GQA; export -> transformers reload; sharded and bf16 files;
tokenizer and generation config carried through. Small random transformers models on the CPU."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from boostjax.interop import hf
from boostjax import placement
from boostjax.config import Config, ConfigError, ModelConfig, TrainConfig, validate_model, validate_train
from boostjax.models import ops
from boostjax.models.flops import param_count
from boostjax.models.llama import LLaMA
from helpers import random_tokens, rel

torch.set_num_threads(1)

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.1,
            rope_theta=10000.0)
# head_dim 16, theta 1e4: wavelength 6.3 < 32/4 kept, 14.9 smoothed, 35 .. 2650 > 32/1 divided by the factor
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
SHAPES = {
    "llama3": dict(rope_scaling=LLAMA3),
    "linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "head_dim": dict(head_dim=24, num_key_value_heads=2),
    "tied": dict(tie_word_embeddings=True, num_key_value_heads=4),
}


def _ref(seed: int = 0, cls=transformers.LlamaForCausalLM, conf_cls=transformers.LlamaConfig, **kw):
    """A random transformers model (norm gains perturbed, so a swapped norm would show)."""
    torch.manual_seed(seed)
    kw = {k: dict(v) if isinstance(v, dict) else v for k, v in kw.items()}  # transformers edits rope dicts in place
    ref = cls(conf_cls(**{**BASE, **kw}, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return ref


def _theirs(ref, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


@nnx.jit
def _forward(model: LLaMA, tokens_bt: jax.Array) -> jax.Array:
    return model(tokens_bt)


def _ours(model: LLaMA, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(_forward(model, jnp.asarray(tokens)))  # one compile, not one per eager op


def _tokens(t: int, seed: int = 0) -> np.ndarray:
    return random_tokens(BASE["vocab_size"], (2, t), seed)


def _close(ours: np.ndarray, theirs: np.ndarray) -> None:
    # fp32 on both sides; other kernels and reduction orders: measured ~1e-7 (see test_hf.py)
    assert ours.shape == theirs.shape and rel(ours, theirs) < 1e-5, rel(ours, theirs)


def _reload(folder) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_import_export_matches_transformers(shape, tmp_path):
    ref = _ref(**SHAPES[shape])
    ref.save_pretrained(tmp_path / "src")
    model = hf.from_hf(tmp_path / "src")
    tokens = _tokens(48)  # past original_max_position_embeddings=32
    theirs = _theirs(ref, tokens)
    _close(_ours(model, tokens), theirs)
    if shape == "llama3":  # the scaling matters: plain RoPE (rope_scaling null) is far off
        plain = hf.build_model(dataclasses.replace(model.cfg, rope_type="default", rope_factor=1.0),
                               nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        assert rel(_ours(plain, tokens), theirs) > 1e-2
    if shape == "tied":
        assert model.cfg.tie_embeddings and not hasattr(model, "head")
        assert param_count(model.cfg) == sum(p.numel() for p in ref.parameters())
    if shape == "head_dim":
        assert model.cfg.head_dim == 24 and model.cfg.attn_head_dim == 24
    hf.to_hf(model, tmp_path / "out")
    back = _reload(tmp_path / "out")
    _close(_theirs(back, tokens), theirs)
    assert hf.from_hf(tmp_path / "out").cfg == model.cfg
    assert ("lm_head.weight" in load_file(str(tmp_path / "out" / hf.WEIGHTS_NAME))) == (shape != "tied")


def test_llama3_old_rope_scaling_and_new_rope_parameters(tmp_path):
    """transformers 4's `rope_scaling` + `rope_theta` and transformers 5's `rope_parameters` give one config."""
    ref = _ref(seed=1, rope_scaling=LLAMA3, rope_theta=50000.0)
    ref.save_pretrained(tmp_path)
    new = hf.from_hf(tmp_path)
    d = json.loads((tmp_path / hf.CONFIG_NAME).read_text())
    d.pop("rope_parameters", None)
    d.update(rope_scaling=dict(LLAMA3), rope_theta=50000.0)
    (tmp_path / hf.CONFIG_NAME).write_text(json.dumps(d))
    old = hf.from_hf(tmp_path)
    assert old.cfg == new.cfg and new.cfg.rope_type == "llama3" and new.cfg.rope_original_max_len == 32
    assert new.cfg.rope_theta == 50000.0 and new.cfg.rope_factor == 8.0
    assert np.allclose(ops.rope_inv_freq(new.cfg, 48), ref.model.rotary_emb.inv_freq.numpy(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {**LLAMA3, "factor": 32.0, "original_max_position_embeddings": 8192},
])
@pytest.mark.parametrize("seq", [64, 300])
def test_rope_inv_freq_matches_transformers(rope, seq):
    """Our host frequencies == transformers' for each type, within and beyond max_position_embeddings."""
    conf = transformers.LlamaConfig(**{**BASE, "head_dim": 32, "max_position_embeddings": 128 if rope.get(
        "original_max_position_embeddings", 0) < 128 else 16384}, rope_scaling=dict(rope))
    cfg = hf.config_from_hf(conf.to_dict())
    want, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](conf, "cpu", seq_len=seq)
    assert scale == 1.0
    got = ops.rope_inv_freq(cfg, seq)
    assert got.dtype == np.float32 and np.allclose(got, want.numpy(), rtol=1e-6, atol=0), (got, want)


def test_dynamic_within_and_beyond_max_position_embeddings(tmp_path):
    """Dynamic NTK: plain RoPE up to max_position_embeddings, a larger base beyond (one forward each,
    in increasing length: transformers keeps the longest length seen)."""
    ref = _ref(seed=3, max_position_embeddings=24, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    ref.save_pretrained(tmp_path)
    model = hf.from_hf(tmp_path)
    assert model.cfg.rope_type == "dynamic" and model.cfg.max_seq_len == 24
    plain = dataclasses.replace(model.cfg, rope_type="default", rope_factor=1.0)
    for t in (16, 48):
        tokens = _tokens(t, seed=t)
        _close(_ours(model, tokens), _theirs(ref, tokens))
        same = np.array_equal(ops.rope_inv_freq(model.cfg, t), ops.rope_inv_freq(plain, t))
        assert same == (t <= 24)


@pytest.mark.parametrize("window", [None, 4096])
def test_mistral_without_sliding_window(window, tmp_path):
    ref = _ref(seed=4, cls=transformers.MistralForCausalLM, conf_cls=transformers.MistralConfig,
               sliding_window=window)
    ref.save_pretrained(tmp_path / "src")
    model = hf.from_hf(tmp_path / "src")
    tokens = _tokens(48, seed=5)
    _close(_ours(model, tokens), _theirs(ref, tokens))
    hf.to_hf(model, tmp_path / "out")  # written as a LlamaForCausalLM: the same function
    _close(_theirs(_reload(tmp_path / "out"), tokens), _theirs(ref, tokens))


def test_sharded_and_bf16_export_round_trip(tmp_path):
    ref = _ref(seed=5, **SHAPES["head_dim"])
    ref.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")  # bf16 in
    assert load_file(str(tmp_path / "bf16" / hf.WEIGHTS_NAME))["model.norm.weight"].dtype == ml_dtypes.bfloat16
    model = hf.from_hf(tmp_path / "bf16")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    ref = _reload(tmp_path / "bf16")  # the bf16 weights read as fp32: the reference of our fp32 model
    tokens = _tokens(48, seed=6)  # the shapes of test_import_export_matches_transformers[head_dim]: no new compile
    _close(_ours(model, tokens), _theirs(ref, tokens))
    hf.to_hf(model, tmp_path / "sharded", max_shard_size="20KB")  # sharded out
    index = json.loads((tmp_path / "sharded" / hf.INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (tmp_path / "sharded" / hf.WEIGHTS_NAME).exists()
    assert all((tmp_path / "sharded" / f).stat().st_size < 20_000 + 26_000 for f in files)  # + one big tensor
    _close(_theirs(_reload(tmp_path / "sharded"), tokens), _theirs(ref, tokens))
    back = nnx.to_pure_dict(nnx.state(hf.from_hf(tmp_path / "sharded"), nnx.Param))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)))
    # bf16 out over the sharded folder (an earlier export: replaced, its shards removed)
    hf.to_hf(model, tmp_path / "sharded", dtype="bfloat16")
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == [hf.CONFIG_NAME, "generation_config.json",
                                                                          hf.WEIGHTS_NAME]
    back = _reload(tmp_path / "sharded")  # the bf16 weights are exactly the bf16 source's
    _close(_theirs(back, tokens), _theirs(ref, tokens))
    with pytest.raises(ConfigError, match="max_shard_size.*fix:"):
        hf.to_hf(model, tmp_path / "x", max_shard_size="lots")
    assert not (tmp_path / "x").exists()


def test_tokenizer_and_generation_config_carried(tmp_path):
    from boostjax.data.tokenizers import load_tokenizer, train_tokenizer

    tok = train_tokenizer(["hello world, the quick brown fox", "jumps over the lazy dog"] * 20, 300)
    ref = _ref(seed=6, vocab_size=320, bos_token_id=None, eos_token_id=[tok.eos_id, 5], pad_token_id=7)
    ref.save_pretrained(tmp_path / "src")
    ref.generation_config.temperature = 0.6
    ref.generation_config.do_sample = True
    ref.generation_config.save_pretrained(tmp_path / "src")
    tok.save(tmp_path / "src")
    model = hf.from_hf(tmp_path / "src")
    assert model.cfg.eos_ids == (tok.eos_id, 5) and model.cfg.pad_token_id == 7 and model.cfg.bos_token_id == -1
    hf.to_hf(model, tmp_path / "out", source=tmp_path / "src")
    conf = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert conf.eos_token_id == [tok.eos_id, 5] and conf.pad_token_id == 7 and conf.tie_word_embeddings is False
    gen = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert gen.eos_token_id == [tok.eos_id, 5] and gen.temperature == 0.6 and gen.do_sample
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "the lazy fox"
    assert theirs(text)["input_ids"] == load_tokenizer(tmp_path / "out").encode(text).tolist()
    assert theirs.eos_token == "<|endoftext|>" and theirs.pad_token_id == 7
    # a model with no ids of its own takes them from its tokenizer
    bare = hf.build_model(dataclasses.replace(model.cfg, eos_token_ids="", pad_token_id=-1),
                          nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    (tmp_path / "run").mkdir()
    tok.save(tmp_path / "run")
    hf.to_hf(bare, tmp_path / "out2", source=tmp_path / "run")
    assert json.loads((tmp_path / "out2" / hf.CONFIG_NAME).read_text())["eos_token_id"] == tok.eos_id
    assert json.loads((tmp_path / "out2" / "generation_config.json").read_text())["eos_token_id"] == tok.eos_id
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out2").eos_token_id == tok.eos_id


def test_tied_model_refused_under_tp_and_pipeline():
    cfg = ModelConfig(kind="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=2, d_ff=48, tie_embeddings=True)
    validate_model(cfg)
    validate_train(TrainConfig(mesh="data=2"), cfg)
    placement.check(Config(cfg, TrainConfig(mesh="data=2")))
    for t in (TrainConfig(strategy="fullrank-tp", mesh="model=2"), TrainConfig(mesh="stage=2", batch=4)):
        with pytest.raises(ConfigError, match="model.tie_embeddings:.*fix: .*--no-tie-embeddings"):
            placement.check(Config(cfg, t))


# one case in CI (the cheapest to compile); run by hand, also passing: ("none", "llama", "data=1,stage=2,model=1",
# "gpipe"), ("btp", "cola", "data=1,model=2", "gpipe"), ("fullrank-tp", "llama", "data=1,stage=2,model=2", "1f1b")
@pytest.mark.parametrize("strategy,kind,mesh,schedule", [("fullrank-tp", "llama", "data=1,model=2", "gpipe")])
def test_head_dim_and_rope_scaling_on_tp_and_pipeline(strategy, kind, mesh, schedule):
    """An explicit head width (8 x 12 != d_model 64) and llama3 RoPE give the single-device loss and
    gradients under TP and a pipeline (whose stages build their own RoPE tables)."""
    from test_tp import TINY, _compare, assert_matches

    from boostjax.config import Config
    from boostjax.training.checks import validate

    model = dataclasses.replace(TINY, kind=kind, n_layers=2, attn_head_dim=12, rope_type="llama3", rope_factor=8.0,
                                rope_original_max_len=8)
    assert param_count(model) == sum(p.size for p in jax.tree.leaves(nnx.state(
        nnx.eval_shape(lambda: LLaMA(model, rngs=nnx.Rngs(0))), nnx.Param)))
    cfg = validate(Config(model, TrainConfig(strategy=strategy, mesh=mesh, batch=4, seq=16,
                                             pipeline_schedule=schedule)))
    assert_matches(*_compare(cfg, seed=17))
