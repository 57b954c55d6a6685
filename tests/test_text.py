"""boostjax.data.tokenizers: byte level and Hugging Face tokenizers behind one interface."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers

from boostjax.config import ConfigError
from boostjax.data import ByteTokenizer
from boostjax.data.tokenizers import EOS_TOKEN, HFTokenizer, load_tokenizer, train_tokenizer

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 8, "déjà vu, naïve café — 北京 🚀\n" * 4,
         "def f(x):\n    return x * 2\n" * 6]


@pytest.fixture(scope="module")
def trained() -> HFTokenizer:
    return train_tokenizer(TEXTS, 320)


def test_trained_tokenizer_round_trips_any_text(trained):
    assert trained.eos_id == 0 and trained.vocab_size <= 320 and trained.dtype == "uint16"
    for text in TEXTS + ["never seen: Ω≈ç√∫ 😀 \t\r\n"]:  # byte-level BPE: every byte is a base token
        ids = trained.encode(text)
        assert ids.dtype == np.uint32 and ids.max() < trained.vocab_size
        assert trained.decode(ids) == text
    assert len(trained.encode(TEXTS[0])) < len(TEXTS[0].encode()) / 2  # merges were learned


def test_saved_tokenizer_loads_from_file_and_folder_and_in_transformers(trained, tmp_path):
    path = trained.save(tmp_path)
    for src in (path, tmp_path):
        tok = load_tokenizer(src)
        assert isinstance(tok, HFTokenizer) and tok.vocab_size == trained.vocab_size and tok.eos_id == 0
        np.testing.assert_array_equal(tok.encode(TEXTS[1]), trained.encode(TEXTS[1]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=EOS_TOKEN)
    assert fast.encode(TEXTS[2]) == trained.encode(TEXTS[2]).tolist()


def test_byte_level_is_the_default():
    for src in (None, "", "byte"):
        assert isinstance(load_tokenizer(src), ByteTokenizer)


def test_folder_without_tokenizer_is_byte_level(tmp_path):
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


def test_bad_tokenizers_are_one_line_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; fix"):
        load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(ConfigError, match="not a Hugging Face tokenizers file") as e:
        load_tokenizer(bad)
    assert "\n" not in str(e.value)
    for vocab in (0, 256, True):
        with pytest.raises(ConfigError, match="train:VOCAB with VOCAB >= 257"):
            train_tokenizer(TEXTS, vocab)


def test_decode_refuses_foreign_ids(trained):
    with pytest.raises(ValueError, match="fix: decode with the tokenizer"):
        trained.decode([trained.vocab_size])
