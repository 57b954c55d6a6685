"""Low-rank models out to Hugging Face: the factors load in transformers through the exported modeling
code (`trust_remote_code=True`) with boostjax's logits and greedy tokens; an svd model densified is a
plain LlamaForCausalLM of the same function; cola / lax refuse to densify; export-hf's refusals."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

import boostjax
from boostjax.cli import main
from boostjax.config import ConfigError, ModelConfig
from boostjax.interop import hf
from boostjax.interop.hf_config import REMOTE_CODE_FILES
from boostjax.interop.hf_lowrank import densify, to_hf_lowrank
from boostjax.models.llama import LLaMA
from boostjax.runs.load import load_run
from helpers import assert_close_ulps, one_error_line, random_model, random_tokens, rel

torch.set_num_threads(1)

SHAPE = dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, rank=8, max_seq_len=64)
PROMPT = random_tokens(96, (2, 5), seed=7)
NEW = 6  # greedy tokens compared
TIE = 1e-5  # two implementations may pick differently only where the top two logits tie to their rounding


def _model(seed: int = 0, **kw) -> LLaMA:
    """A random model (`helpers.random_model`)."""
    return random_model(ModelConfig(**{**SHAPE, **kw}), seed)


def _theirs(ref, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def _greedy_agree(model: LLaMA, ref) -> None:
    """boostjax's greedy continuation of PROMPT equals transformers' `generate` (its KV cache), token
    for token, except where the top two logits tie within TIE of the logits' scale."""
    ours = np.asarray(boostjax.generate(model, PROMPT, NEW))
    with torch.no_grad():
        theirs = ref.generate(torch.from_numpy(PROMPT.astype(np.int64)), max_new_tokens=NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=0).numpy()
    assert ours.shape == theirs.shape == (2, PROMPT.shape[1] + NEW)
    for got, want in zip(ours, theirs, strict=True):
        apart = np.flatnonzero(got != want)
        if apart.size:
            logits_v = np.asarray(model(jnp.asarray(want[None, :apart[0]])))[0, -1]
            top2 = np.sort(logits_v)[-2:]
            assert top2[1] - top2[0] <= TIE * np.abs(logits_v).max(), (got, want, top2)
    assert len(set(ours[:, PROMPT.shape[1]:].ravel().tolist())) > 2  # not one token repeated


@pytest.mark.parametrize("kw,greedy", [
    (dict(kind="svd"), True),
    (dict(kind="cola"), True),  # CoLA's MLP: gate * up
    (dict(kind="cola", only_lr_act=False, rank_kv=16), False),  # silu(gate) * up; k/v kept dense
    (dict(kind="lax", tie_embeddings=True), False),  # gates crossing the latents; no lm_head
], ids=["svd", "cola", "cola-swiglu-dense-kv", "lax-tied"])
def test_factors_load_in_transformers(tmp_path, kw, greedy):
    model = _model(**kw)
    cfg = model.cfg
    to_hf_lowrank(model, tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["model_type"] == "boostjax_lowrank_llama" and conf["lowrank_kind"] == cfg.kind
    assert conf["lowrank_ranks"] == {g: 0 if r == "dense" else r for g, r in cfg.group_ranks.items()}
    assert sorted(conf["auto_map"]) == ["AutoConfig", "AutoModelForCausalLM"]
    assert all((tmp_path / name).is_file() for name in REMOTE_CODE_FILES)
    tensors = load_file(str(tmp_path / hf.WEIGHTS_NAME))
    q = "model.layers.1.self_attn.q_proj"
    assert tensors[f"{q}.a.weight"].shape == (8, 32) and tensors[f"{q}.b.weight"].shape == (32, 8)
    if "rank_kv" in kw:  # a group kept dense is a plain linear
        assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)
    assert ("lm_head.weight" in tensors) == (not cfg.tie_embeddings)
    with pytest.raises(ValueError, match="low-rank boostjax export.*--densify"):  # not read back as a LLaMA
        hf.read_hf(tmp_path)

    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32)
    ref.eval()
    assert type(ref).__name__ == "BoostjaxLowRankLlamaForCausalLM"
    tokens = random_tokens(cfg.vocab_size, (2, 12), seed=1)
    ours, theirs = np.asarray(model(jnp.asarray(tokens))), _theirs(ref, tokens)
    # two programs (XLA against ATen), relative to the logits' norm: measured <= 2.3e-7; the same export with
    # the SiLU between the factors dropped from the modeling code is 0.37 (cola) to 0.62 (lax) away
    print(f"{cfg.kind}: logits {rel(ours, theirs):.2g} apart (relative to their norm)")
    assert rel(ours, theirs) < 1e-5, rel(ours, theirs)
    if greedy:
        _greedy_agree(model, ref)


def test_densify_writes_a_plain_llama(tmp_path):
    model = _model(seed=2, kind="svd")
    to_hf_lowrank(model, tmp_path, densified=True)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["model_type"] == "llama" and "auto_map" not in conf
    assert not any((tmp_path / name).exists() for name in REMOTE_CODE_FILES)
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = random_tokens(96, (2, 12), seed=3)
    ours = np.asarray(model(jnp.asarray(tokens)))
    assert rel(_theirs(ref, tokens), ours) < 1e-5
    assert rel(np.asarray(hf.from_hf(tmp_path)(jnp.asarray(tokens))), ours) < 1e-5  # and back into boostjax
    _greedy_agree(model, ref)
    # W = A B per projection, the grouped tensors split by their group index
    cfg, dense = densify(model.cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    attn = nnx.to_pure_dict(nnx.state(model, nnx.Param))["layers"][0]["attn"]
    want = np.asarray(attn["a_qkv"][:, 2], np.float64) @ np.asarray(attn["b_kv"][1], np.float64)
    assert cfg.kind == "llama"  # the float64 product rounded once; another BLAS kernel may round 1 ulp apart
    assert_close_ulps(dense["layers"][0]["attn"]["w_v"], want.astype(np.float32), 1)


@pytest.mark.parametrize("kind", ["cola", "lax"])
def test_densify_refuses_a_silu_between_the_factors(tmp_path, kind):
    model = nnx.eval_shape(lambda: LLaMA(ModelConfig(kind=kind, **SHAPE), rngs=nnx.Rngs(0)))  # shapes suffice
    with pytest.raises(ConfigError, match="no dense equivalent.*; fix: export without --densify"):
        to_hf_lowrank(model, tmp_path / "out", densified=True)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def svd_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "svd"
    assert main(["train", "--model", "svd", "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64",
                 "--rank", "8", "--steps", "2", "--batch", "2", "--seq", "16", "--no-progress",
                 "--out", str(out)]) == 0
    return out


def test_export_hf_cli_factors_then_densified(svd_run, tmp_path, capsys):
    _, model, _ = load_run(svd_run)
    tokens = random_tokens(256, (2, 10), seed=4)
    ours = np.asarray(model(jnp.asarray(tokens)))
    out = tmp_path / "hf"
    assert main(["export-hf", "--run", str(svd_run), "--out", str(out)]) == 0
    assert "trust_remote_code=True" in capsys.readouterr().out
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32)
    assert rel(_theirs(ref.eval(), tokens), ours) < 1e-5
    # an earlier export is replaced, its modeling code included
    assert main(["export-hf", "--run", str(svd_run), "--out", str(out), "--densify"]) == 0
    assert not any((out / name).exists() for name in REMOTE_CODE_FILES)
    ref = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert rel(_theirs(ref.eval(), tokens), ours) < 1e-5


def test_export_hf_cli_refusals(svd_run, tmp_path, capsys):
    cola = tmp_path / "cola"  # a cola run's config (the refusal reads nothing else: no checkpoint needed)
    cola.mkdir()
    conf = json.loads((svd_run / "config.json").read_text())
    conf["model"]["kind"] = "cola"
    (cola / "config.json").write_text(json.dumps(conf))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    for argv, needle in (
        (["--run", str(cola), "--out", str(tmp_path / "x"), "--densify"], "the SiLU between A and B has no dense"),
        (["--run", str(svd_run), "--out", str(mine)], "is not an earlier boostjax export"),
        (["--run", str(tmp_path / "missing"), "--out", str(tmp_path / "x")], "missing"),
        (["--run", str(svd_run), "--out", str(svd_run)], "is a boostjax run folder"),
    ):
        capsys.readouterr()
        assert main(["export-hf", *argv]) == 2
        one_error_line(capsys.readouterr().err, needle)
    assert not (tmp_path / "x").exists() and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    shutil.rmtree(cola)
