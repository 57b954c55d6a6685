"""Tokenizers: UTF-8 bytes (`ByteTokenizer`, the zero-setup default) or a Hugging Face `tokenizers`
`tokenizer.json` (`HFTokenizer`).

Both kinds answer the same questions: `encode(text) -> ids`, `decode(ids) -> text`, `vocab_size`,
`eos_id` / `bos_id` (None when the tokenizer has no such token) and `name`. A run folder, a tokenised
data folder and a Hugging Face export hold the tokenizer as `tokenizer.json`; a folder without one is
byte level. `train_tokenizer` trains a byte-level BPE (GPT-2 style: every byte is a base token, so
any text encodes) with `<|endoftext|>` as the end-of-document token.
"""

from __future__ import annotations

import pathlib
from typing import Iterable, Sequence, Union

import numpy as np
from tokenizers import Tokenizer as _Tok
from tokenizers import decoders, models, pre_tokenizers, trainers

from boostjax.config import ConfigError

TOKENIZER_FILE = "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"
# special-token spellings of the popular families (GPT-2, Llama 1/2, Llama 3, Gemma, SmolLM)
EOS_NAMES: tuple[str, ...] = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
BOS_NAMES: tuple[str, ...] = ("<s>", "<|begin_of_text|>", "<bos>")
MIN_TRAINED_VOCAB = 257  # 256 byte tokens + the end-of-document token


class ByteTokenizer:
    """UTF-8 bytes as token ids: ``vocab_size == 256``, lossless for any text."""

    vocab_size: int = 256

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> uint8 ids of its UTF-8 bytes."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Ids -> text; invalid UTF-8 sequences become U+FFFD."""
        ids_n = np.asarray(ids).reshape(-1)
        if ids_n.size and (ids_n.min() < 0 or ids_n.max() >= self.vocab_size):
            raise ValueError(
                f"ByteTokenizer.decode: ids must be in [0, 256), got range "
                f"[{ids_n.min()}, {ids_n.max()}]; fix: decode with the tokenizer that produced them"
            )
        return ids_n.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` with numpy ids and the end/begin-of-document ids found by name."""

    def __init__(self, tok, name: str = "tokenizer.json"):
        self.tok = tok
        self.name = name
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.eos_id: int | None = _first_id(tok, EOS_NAMES)
        self.bos_id: int | None = _first_id(tok, BOS_NAMES)

    @property
    def dtype(self) -> str:
        """The narrowest token-file element type that holds every id."""
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"

    def encode(self, text: str) -> np.ndarray:
        """Ids of `text`, without special tokens (documents get their EOS from the caller)."""
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encs = self.tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encs]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids_n = np.asarray(ids).reshape(-1)
        if ids_n.size and (ids_n.min() < 0 or ids_n.max() >= self.vocab_size):
            raise ValueError(f"{self.name}: ids must be in [0, {self.vocab_size}), got range "
                             f"[{ids_n.min()}, {ids_n.max()}]; fix: decode with the tokenizer that produced them")
        return self.tok.decode([int(i) for i in ids_n], skip_special_tokens=False)

    def save(self, folder: str | pathlib.Path) -> pathlib.Path:
        path = pathlib.Path(folder) / TOKENIZER_FILE
        self.tok.save(str(path))
        return path


Tokenizer = Union[ByteTokenizer, HFTokenizer]


def _first_id(tok, names: Iterable[str]) -> int | None:
    for n in names:
        i = tok.token_to_id(n)
        if i is not None:
            return int(i)
    return None


def tokenizer_kind(tok: Tokenizer) -> str:
    """'byte' or the file name of a `tokenizer.json`-backed tokenizer (for metadata and messages)."""
    return "byte" if isinstance(tok, ByteTokenizer) else tok.name


def load_tokenizer(path: str | pathlib.Path | None = None) -> Tokenizer:
    """None, '' or 'byte': byte level. A `tokenizer.json` file, or a folder (a run, a tokenised data
    folder, a Hugging Face checkpoint) holding one: that tokenizer; a folder without one: byte level."""
    if path is None or str(path) in ("", "byte"):
        return ByteTokenizer()
    p = pathlib.Path(path)
    if p.is_dir():
        p = p / TOKENIZER_FILE
        if not p.exists():
            return ByteTokenizer()
    elif not p.exists():
        raise ConfigError(f"tokenizer: {path} does not exist; fix: pass a tokenizer.json file, a folder holding "
                          f"one, or train:VOCAB to train one on the data")

    try:
        tok = _Tok.from_file(str(p))
    except Exception as e:  # the Rust side raises its own exception type with a JSON parse message
        raise ConfigError(f"tokenizer: {p} is not a Hugging Face tokenizers file ({' '.join(str(e).split())}); "
                          f"fix: pass the tokenizer.json saved by tokenizers or transformers") from e
    return HFTokenizer(tok, name=str(p))


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE with `vocab_size` tokens (including `<|endoftext|>`) trained on `texts`."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_TRAINED_VOCAB:
        raise ConfigError(f"tokenizer: train:{vocab_size} is too small; fix: train:VOCAB with VOCAB >= "
                          f"{MIN_TRAINED_VOCAB} (the 256 bytes and {EOS_TOKEN}), e.g. train:4096")

    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, name=f"train:{vocab_size}")


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers map text to the same ids (byte level, or equal serialised tokenizers)."""
    if isinstance(a, ByteTokenizer) or isinstance(b, ByteTokenizer):
        return isinstance(a, ByteTokenizer) and isinstance(b, ByteTokenizer)
    return a.tok.to_str() == b.tok.to_str()
