"""`boostjax tokenize` and the tokenised folder: round trip, metadata, the split, replacing an earlier
output, crash safety, a model vocabulary smaller than the tokenizer's refused before compiling. Training
on a tokenised folder and evaluating the run: tests/test_eval.py."""

from __future__ import annotations

import json
import pathlib

import pytest

import boostjax.training.trainer  # the module, for monkeypatching
from boostjax.config import Config, ConfigError, ModelConfig, TrainConfig
from boostjax.data import load_corpus, read_token_meta
from boostjax.data.tokenizers import EOS_TOKEN, load_tokenizer
from boostjax.data.tokenize import split_documents, tokenize_corpus

TEXTS = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 3 + 1) + "\nÉté " * (i % 2)
         for i in range(7)]


@pytest.fixture
def text_dir(tmp_path) -> pathlib.Path:
    d = tmp_path / "texts"
    d.mkdir()
    for i, t in enumerate(TEXTS):
        (d / f"doc{i:02d}.txt").write_text(t)
    (d / "empty.txt").write_text("  \n")  # whitespace only: skipped
    (d / "notes.csv").write_text("not text")  # other suffixes are not read
    return d


def _split(n: int, val_every: int) -> tuple[list[int], list[int]]:
    val = [i for i in range(n) if i % val_every == val_every - 1] or [n - 1]
    return [i for i in range(n) if i not in val], val


@pytest.mark.parametrize("tokenizer", ["byte", "train:300"])
def test_round_trip_and_meta(text_dir, tmp_path, tokenizer):
    out = tmp_path / "tok"
    meta = tokenize_corpus(text_dir, out, tokenizer, val_every=3, progress=False)
    assert json.loads((out / "meta.json").read_text()) == meta == read_token_meta(out)
    tok = load_tokenizer(out)
    byte = tokenizer == "byte"
    assert meta["tokenizer"] == ("byte" if byte else "tokenizer.json")
    assert (out / "tokenizer.json").exists() != byte
    assert meta["dtype"] == ("uint8" if byte else "uint16") and meta["vocab_size"] == tok.vocab_size
    assert meta["eos_id"] == (None if byte else tok.tok.token_to_id(EOS_TOKEN))
    docs = [TEXTS[i] for i in range(7)]  # sorted file names; the empty file is skipped
    train_i, val_i = _split(7, 3)
    assert (train_i, val_i) == ([0, 1, 3, 4, 6], [2, 5])
    sep = "\n\n" if byte else EOS_TOKEN
    corpus = load_corpus(str(out))
    for name, idx, ids, starts in (("train", train_i, corpus.train, corpus.train_docs),
                                   ("val", val_i, corpus.val, corpus.val_docs)):
        s = meta["splits"][name]
        assert ids.dtype.name == meta["dtype"] and len(ids) == s["tokens"]
        assert tok.decode(ids) == "".join(docs[i] + sep for i in idx)
        assert s["documents"] == len(idx) == len(starts) and starts[0] == 0
        for k, i in enumerate(idx):  # every document starts where the offsets say, after its predecessor's EOS
            end = starts[k + 1] if k + 1 < len(starts) else len(ids)
            assert tok.decode(ids[starts[k]:end]) == docs[i] + sep
        assert s["bytes"] == sum(len(docs[i].encode()) + (2 if byte else 0) for i in idx)
        if byte:
            assert s["bytes"] == s["tokens"]
        else:
            assert int(ids[-1]) == meta["eos_id"]


def test_documents_of_a_single_file(tmp_path):
    text = "first block\nstill first\n\n\nsecond\n \t\nthird\n\n"
    assert split_documents(text, "blank") == ["first block\nstill first", "second", "third"]
    assert split_documents(text, "line") == ["first block", "still first", "second", "third"]
    assert split_documents(text, "file") == [text]
    f = tmp_path / "corpus.txt"
    f.write_text(text)
    meta = tokenize_corpus(f, tmp_path / "tok", "byte", progress=False)  # blank blocks by default for a file
    assert (meta["splits"]["train"]["documents"], meta["splits"]["val"]["documents"]) == (2, 1)
    assert load_corpus(str(tmp_path / "tok")).val.tobytes() == b"third\n\n"


def test_replacing_an_earlier_output_and_a_crash(text_dir, tmp_path, monkeypatch):
    out = tmp_path / "tok"
    tokenize_corpus(text_dir, out, "train:300", val_every=3, progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    import boostjax.data.tokenize as tz

    def crash(tok, docs, sep, dtype):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tz, "encoded", crash)
    with pytest.raises(RuntimeError):
        tokenize_corpus(text_dir, out, "byte", progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the earlier output is intact
    monkeypatch.undo()
    meta = tokenize_corpus(text_dir, out, "byte", val_every=3, progress=False)  # its own output may be replaced
    assert meta["tokenizer"] == "byte" and not (out / "tokenizer.json").exists()
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train-00000.bin", "train.docs.npy", "val-00000.bin",
                                                     "val.docs.npy"]


def test_python_api_refuses_a_vocabulary_smaller_than_the_tokenizers(text_dir, tmp_path, monkeypatch):
    tok_dir = tmp_path / "tok"
    meta = tokenize_corpus(text_dir, tok_dir, "train:300", val_every=3, progress=False)
    tr = boostjax.training.trainer
    monkeypatch.setattr(tr, "build_step_fns", lambda *a, **k: pytest.fail("compiled before refusing"))
    cfg = Config(ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, d_ff=64, rank=8),
                 TrainConfig(data=str(tok_dir), out=str(tmp_path / "run"), batch=2, seq=16, steps=2))
    with pytest.raises(ConfigError, match=f"model.vocab_size: 256 .* fix: pass --vocab-size {meta['vocab_size']}"):
        tr.train(cfg)
    assert not (tmp_path / "run").exists()
