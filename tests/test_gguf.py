"""A Llama `.gguf` file in (`boostjax.interop.gguf_in`): `read_hf` of it equals `read_hf` of a Hugging Face
folder of the same weights, its logits equal transformers' model loaded from it, `train --init-from-hf`
starts from it, and bad files are refused in one line before anything is written. The files are written
here with the `gguf` package's `GGUFWriter`, as llama.cpp's converter lays them out (q/k rows permuted
for its rotary convention, the head left out when it is the embedding)."""

from __future__ import annotations

import json
import pathlib
import sys
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from boostjax.cli import main  # noqa: E402
from boostjax.config import Config, ModelConfig  # noqa: E402
from boostjax.data import batch_iterator, load_corpus  # noqa: E402
from boostjax.interop import gguf_in, hf, pretrained  # noqa: E402
from boostjax.models.llama import abstract_model  # noqa: E402
from helpers import one_error_line, random_params, random_tokens, rel  # noqa: E402

# GQA (4 query heads on 2 key/value heads), norm epsilon 1e-5 (a float32 in the file), bos/eos ids
CFG = ModelConfig(kind="llama", vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                  norm_eps=1e-5, rope_theta=10000.0, max_seq_len=128, bos_token_id=1, eos_token_ids="2")
# Hugging Face name inside `model.layers.{i}.` -> llama.cpp's inside `blk.{i}.`
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
RUN = ["--batch", "2", "--seq", "16", "--eval-batches", "1", "--log-every", "1", "--no-progress", "--no-tensorboard"]


def _permute(w_oi: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's two rotate-half halves interleaved (convert_hf_to_gguf)."""
    return w_oi.reshape(heads, 2, w_oi.shape[0] // heads // 2, *w_oi.shape[1:]).swapaxes(1, 2).reshape(w_oi.shape)


def write_gguf(path: pathlib.Path, cfg: ModelConfig, params, arch: str = "llama", f16: bool = False,
               rope_scaling: str | None = None) -> pathlib.Path:
    """A GGUF of `cfg` and its params as llama.cpp writes one: matrices in F16 or F32, norms in F32, a
    vocabulary of placeholder tokens (transformers takes the vocabulary size from it)."""
    tensors = hf.params_to_hf(cfg, params)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
        w.add_rope_scaling_factor(2.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_ids[0])

    def put(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, a.astype(np.float16) if f16 and a.ndim == 2 else a)

    put("token_embd.weight", tensors["model.embed_tokens.weight"])
    put("output_norm.weight", tensors["model.norm.weight"])
    if "lm_head.weight" in tensors:
        put("output.weight", tensors["lm_head.weight"])
    for i in range(cfg.n_layers):
        for ours, theirs in LAYER_NAMES.items():
            a = tensors[f"model.layers.{i}.{ours}.weight"]
            a = _permute(a, cfg.n_heads) if theirs == "attn_q" else _permute(a, cfg.kv_heads) if theirs == "attn_k" else a
            put(f"blk.{i}.{theirs}.weight", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _params(cfg: ModelConfig, f16: bool = False):
    """Random params (std 0.2: logits of O(1)); with `f16` the matrices rounded to float16, as stored."""
    params = random_params(abstract_model(Config(cfg))[1], np.random.default_rng(0), 0.2)
    if f16:
        params = jax.tree.map(lambda a: a.astype(jnp.float16).astype(jnp.float32) if a.ndim == 2 else a, params)
    return params


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(params, .gguf file) of CFG, tied embeddings, F32."""
    params = _params(CFG)
    return params, write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", CFG, params)


@pytest.mark.parametrize("tied,f16", [(True, False), (False, True)])
def test_gguf_reads_as_the_folder_of_the_same_weights(tmp_path, tied, f16):
    cfg = replace(CFG, tie_embeddings=tied)
    params = _params(cfg, f16)
    file = write_gguf(tmp_path / "m.gguf", cfg, params, f16=f16)
    folder = hf.to_hf((cfg, params), tmp_path / "folder")
    got_cfg, got = hf.read_hf(file)
    want_cfg, want = hf.read_hf(folder)
    assert got_cfg == want_cfg == cfg
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # F16 -> fp32 and the unpermute are exact
    assert pretrained.source_config(str(file)) == cfg  # the metadata alone gives the same shapes
    assert set(hf.read_tensors(file)) == set(hf.read_tensors(folder))


def test_logits_equal_transformers_loaded_from_the_gguf(tiny):
    pytest.importorskip("accelerate")  # transformers' from_pretrained needs it for a GGUF
    _, file = tiny
    tokens = random_tokens(CFG.vocab_size, (2, 12), seed=1)
    ours = np.asarray(hf.from_hf(file)(jnp.asarray(tokens)), np.float64)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens, dtype=torch.long)).logits.double().numpy()
    assert np.linalg.norm(theirs) > 1.0  # not a degenerate model
    assert rel(ours, theirs) < 1e-5, rel(ours, theirs)


def test_train_from_gguf(tiny, tmp_path, capsys):
    params, file = tiny
    run, data = tmp_path / "run", tmp_path / "ids.bin"
    np.random.default_rng(0).integers(0, CFG.vocab_size, 4096).astype(np.uint16).tofile(data)
    assert main(["train", "--init-from-hf", str(file), "--out", str(run), "--data", str(data), *RUN,
                 "--steps", "2"]) == 0
    assert "initialised llama from" in capsys.readouterr().err
    cfg = Config.from_dict(json.loads((run / "config.json").read_text()))
    assert cfg.model == replace(CFG, only_lr_act=False) and cfg.train.init_from_hf == str(file)
    report = json.loads((run / pretrained.REPORT_FILE).read_text())
    assert report["format"] == "gguf" and report["source"] == str(file.resolve())
    corpus = load_corpus(cfg.train.data, cfg.train.data_dtype)  # the rows of the first step
    b = batch_iterator(corpus.train, corpus.train_docs, cfg.train.batch, cfg.train.seq, cfg.train.seed,
                       vocab_size=CFG.vocab_size).batch_at(0)
    want = float(hf.build_model(CFG, params).loss(jnp.asarray(b["inputs"]), jnp.asarray(b["targets"])))
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 2 and abs(losses[0] - want) / want < 1e-5, (losses, want)


def _refused(capsys, tmp_path, src, *needles) -> str:
    out = tmp_path / "run"
    rc = main(["train", "--init-from-hf", str(src), "--out", str(out), "--steps", "1", *RUN])
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert "Traceback" not in err and not out.exists()
    return one_error_line(err, "train.init_from_hf", *needles)


@pytest.mark.parametrize("case,needles", [
    ("missing", ["does not exist"]),
    ("truncated", ["is not a readable GGUF file", "re-download"]),
    ("qwen2", ["architecture 'qwen2'", "only llama is read"]),
    ("rope-scaling", ["scales RoPE (linear)"]),
])
def test_bad_gguf_refused(capsys, tmp_path, tiny, case, needles):
    params, good = tiny
    src = tmp_path / "m.gguf"
    if case == "truncated":
        data = good.read_bytes()
        src.write_bytes(data[: len(data) // 2])
    if case == "qwen2":  # a file transformers reads (as a Qwen2 config), of another architecture
        write_gguf(src, CFG, params, arch="qwen2")
        conf = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file=src.name)
        assert conf.model_type == "qwen2" and conf.num_hidden_layers == CFG.n_layers
    if case == "rope-scaling":
        write_gguf(src, CFG, params, rope_scaling="linear")
    _refused(capsys, tmp_path, src, *needles)


def test_missing_extra_refused(capsys, tmp_path, tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` fails as if it were not installed
    line = _refused(capsys, tmp_path, tiny[1], "gguf", "pip install 'boostjax[gguf]'")
    assert "is not installed" in line
    assert gguf_in.is_gguf(tiny[1]) and not gguf_in.is_gguf(tiny[1].parent)
