"""`boostjax.evaluate` against a hand computation with `model.loss`, bits per byte, and the whole path
tokenize -> train -> eval from the command line (vocabulary from meta.json, tokenizer in the run folder,
a resumed run keeps its tokenizer)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flax import nnx

from boostjax.cli import main
from boostjax.config import ConfigError, ModelConfig
from boostjax.data import ByteTokenizer
from boostjax.inference.evaluation import eval_stream, evaluate
from boostjax.models.llama import LLaMA
from boostjax.data.tokenizers import load_tokenizer
from boostjax.data.source import check_run_tokenizer, resolve_source
from boostjax.data.tokenize import tokenize_corpus

TINY = ModelConfig(kind="llama", vocab_size=256, d_model=32, n_layers=2, n_heads=2, d_ff=64)


@pytest.fixture(scope="module")
def model() -> LLaMA:
    return LLaMA(TINY, rngs=nnx.Rngs(params=0))


def test_evaluate_equals_model_loss_on_the_same_windows(model):
    seq, batch = 16, 3
    tokens = np.random.default_rng(0).integers(0, 64, size=5 * seq + 8, dtype=np.int64).astype(np.uint16)
    res = evaluate(model, tokens, seq=seq, batch=batch, n_bytes=1000)
    # the same non-overlapping windows by hand: five full ones and a short last one (7 targets)
    loss = nnx.jit(lambda m, x, y: m.loss(x, y))
    full = tokens[:5 * seq + 1].astype(np.int32)
    x_ws = np.stack([full[k * seq:(k + 1) * seq] for k in range(5)])
    y_ws = np.stack([full[k * seq + 1:(k + 1) * seq + 1] for k in range(5)])
    tail = tokens[5 * seq:].astype(np.int32)
    total = float(loss(model, x_ws, y_ws)) * x_ws.size + float(loss(model, tail[None, :-1], tail[None, 1:])) * 7
    count = x_ws.size + 7
    assert res["tokens"] == count == len(tokens) - 1 and res["windows"] == 6  # 2 batches of 3, none padded out
    assert abs(res["loss"] - total / count) <= 1e-6 * abs(total / count)
    assert res["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-6)
    assert res["bits_per_byte"] == pytest.approx(total / math.log(2) / 1000, rel=1e-6)
    assert evaluate(model, tokens, seq=seq, batch=batch)["bits_per_byte"] is None


def test_evaluate_with_documents_masks_attention_like_training(model):
    """With `doc_starts` (a --doc-mask run), each window's attention stops at document boundaries: the
    same as `model.loss(..., segments=)` with segment ids counted from the stream's document starts."""
    seq = 16
    tokens = np.random.default_rng(1).integers(0, 64, size=3 * seq + 1, dtype=np.int64).astype(np.uint16)
    starts = np.array([0, 5, 21, 22, 40])
    res = evaluate(model, tokens, seq=seq, batch=2, doc_starts=starts)
    full = tokens.astype(np.int32)
    x_ws = np.stack([full[k * seq:(k + 1) * seq] for k in range(3)])
    y_ws = np.stack([full[k * seq + 1:(k + 1) * seq + 1] for k in range(3)])
    seg_ws = np.searchsorted(starts, np.arange(3 * seq).reshape(3, seq), side="right").astype(np.int32)
    want = float(nnx.jit(lambda m, x, y, s: m.loss(x, y, segments=s))(model, x_ws, y_ws, seg_ws))
    assert abs(res["loss"] - want) <= 1e-6 * want
    assert abs(evaluate(model, tokens, seq=seq, batch=2)["loss"] - want) > 1e-4 * want  # the mask matters


def test_bits_per_byte_of_byte_level_data_is_loss_over_ln2(tmp_path, model):
    d = tmp_path / "texts"
    d.mkdir()
    for i in range(4):
        (d / f"{i}.txt").write_text(f"text number {i}, été. " * (3 + i))
    tokenize_corpus(d, tmp_path / "tok", "byte", val_every=2, progress=False)
    stream, n_bytes, _, starts = eval_stream(ByteTokenizer(), str(tmp_path / "tok"), None, None)
    val = np.fromfile(tmp_path / "tok" / "val-00000.bin", dtype=np.uint8)
    assert stream[0] == ord("\n") and (stream[1:] == val).all() and n_bytes == len(val)
    assert (starts == np.load(tmp_path / "tok" / "val.docs.npy") + 1).all()
    res = evaluate(model, stream, seq=32, batch=4, n_bytes=n_bytes)
    assert res["tokens"] == n_bytes
    assert res["bits_per_byte"] == pytest.approx(res["loss"] / math.log(2), rel=1e-12)


def test_tokenize_train_eval(tmp_path, capsys):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(6):
        (texts / f"doc{i}.txt").write_text(f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i + 2))
    tok_dir, run = tmp_path / "tok", tmp_path / "run"
    assert main(["tokenize", "--tokenizer", "train:300", "--data", str(texts), "--out", str(tok_dir),
                 "--val-every", "3"]) == 0
    meta = json.loads((tok_dir / "meta.json").read_text())
    rc = main(["train", "--data", str(tok_dir), "--out", str(run), "--model", "llama", "--d-model", "32",
               "--n-layers", "2", "--n-heads", "2", "--d-ff", "64", "--batch", "2", "--seq", "16", "--steps", "2",
               "--eval-batches", "1", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["vocab_size"] == meta["vocab_size"]  # no --vocab-size: taken from meta.json
    assert (run / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    tok = load_tokenizer(run)
    assert tok.tok.to_str() == load_tokenizer(tok_dir).tok.to_str()
    capsys.readouterr()

    assert main(["eval", "--run", str(run), "--data", str(tok_dir), "--json", "--batch", "3"]) == 0
    res = json.loads(capsys.readouterr().out)
    val = meta["splits"]["val"]
    assert (res["tokens"], res["bytes"], res["step"]) == (val["tokens"], val["bytes"], 2)
    assert res["bits_per_byte"] == pytest.approx(res["loss"] * res["tokens"] / math.log(2) / res["bytes"], rel=1e-12)
    # the same documents as text, all of it (--split all), encoded with the run's tokenizer: the same stream,
    # the same numbers
    held_out = tmp_path / "held_out"
    held_out.mkdir()
    for i in (2, 5):  # the validation documents (i % 3 == 2)
        (held_out / f"doc{i}.txt").write_text((texts / f"doc{i}.txt").read_text())
    assert main(["eval", "--run", str(run), "--data", str(held_out), "--json", "--batch", "3", "--split", "all"]) == 0
    res_text = json.loads(capsys.readouterr().out)
    assert (res_text["tokens"], res_text["bytes"]) == (res["tokens"], res["bytes"])
    assert res_text["loss"] == pytest.approx(res["loss"], rel=1e-6)

    # a resumed run keeps its tokenizer: the same data folder re-tokenised with another one is refused
    check_run_tokenizer(run, resolve_source(str(tok_dir)), resuming=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("zzzz yyyy xxxx " * 50)
    (other / "b.txt").write_text("wwww vvvv " * 50)
    tokenize_corpus(other, tok_dir, "train:300", progress=False)
    with pytest.raises(ConfigError, match="train.data: .* fix: tokenise the text with the run's tokenizer"):
        check_run_tokenizer(run, resolve_source(str(tok_dir)), resuming=True)
