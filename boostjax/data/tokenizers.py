"""Tokenizers: UTF-8 bytes (`ByteTokenizer`, the zero-setup default) or a Hugging Face `tokenizers`
`tokenizer.json` (`HFTokenizer`), or the tokenizer a llama.cpp `.gguf` file describes (`gguf_tokenizer`).

Both kinds answer the same questions: `encode(text) -> ids`, `decode(ids) -> text`, `vocab_size`,
`eos_id` / `bos_id` (None when the tokenizer has no such token) and `name`. A run folder, a tokenised
data folder and a Hugging Face export hold the tokenizer as `tokenizer.json`; a folder without one is
byte level. `train_tokenizer` trains a byte-level BPE (GPT-2 style: every byte is a base token, so
any text encodes) with `<|endoftext|>` as the end-of-document token.

A `.gguf` file's tokenizer is built by transformers' GGUF support (`AutoTokenizer.from_pretrained(dir,
gguf_file=name)`, the optional gguf extra) once per file and process, and used as a `tokenizer.json`;
`gguf_side_files` gives what `save_pretrained` writes beside it (`tokenizer_config.json`, the chat
template), which a run folder started from the file keeps.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import tempfile
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
GGUF_SUFFIX = ".gguf"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# (resolved path, size, mtime) -> (the tokenizer's JSON, {side file name: its text}), or the ConfigError of a
# file transformers cannot build one from, of the last .gguf read
_GGUF: dict[tuple[str, int, int], tuple[str, dict[str, str]] | ConfigError] = {}


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
    folder, a Hugging Face checkpoint) holding one: that tokenizer; a folder without one: byte level;
    a `.gguf` file: the tokenizer it describes (`gguf_tokenizer`)."""
    if path is None or str(path) in ("", "byte"):
        return ByteTokenizer()
    p = pathlib.Path(path)
    if p.suffix.lower() == GGUF_SUFFIX:
        return gguf_tokenizer(p)
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
    """Whether two tokenizers map text to the same ids: both byte level, or equal in what encoding
    reads (`_content`: the model with its vocabulary and merges, the normaliser, the pre-tokeniser, the
    added tokens), wherever they were saved and whatever else their files say."""
    if isinstance(a, ByteTokenizer) or isinstance(b, ByteTokenizer):
        return isinstance(a, ByteTokenizer) and isinstance(b, ByteTokenizer)
    return _content(a.tok.to_str()) == _content(b.tok.to_str())


def _content(raw: str) -> tuple[str, ...]:
    """The parts of a serialised tokenizer that decide its ids, canonical: merges as pairs (the older
    "a b" strings and the newer ["a", "b"] lists alike), added tokens by id without their `special`
    flag (text is encoded without special-token handling), a model option that is off whether unset, empty
    or false; truncation, padding, the post-processor and
    the decoder left out."""
    d = json.loads(raw)
    model = {k: v for k, v in (d.get("model") or {}).items() if v not in (None, "", False)}  # unset = off
    if "merges" in model:
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else list(m) for m in model["merges"]]
    added = sorted(({k: v for k, v in t.items() if k != "special"} for t in d.get("added_tokens") or []),
                   key=lambda t: t.get("id", -1))
    return tuple(json.dumps(x, sort_keys=True) for x in (model, d.get("normalizer"), d.get("pre_tokenizer"), added))


# ------------------------------------------------------------------------------------ a .gguf file's


def _gguf_files(path: str | pathlib.Path) -> tuple[str, dict[str, str]]:
    """(tokenizer JSON, {file name: text} of `save_pretrained`'s other files) of a `.gguf`, built by
    transformers once per file and process; ConfigError (one line) when it cannot be built."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"tokenizer: {p} does not exist or is not a file; fix: pass the path of a .gguf file")
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _GGUF:
        _GGUF.clear()
        _GGUF[key] = _build_gguf(p)
    got = _GGUF[key]
    if isinstance(got, ConfigError):
        raise ConfigError(str(got))
    return got


def _build_gguf(p: pathlib.Path) -> tuple[str, dict[str, str]] | ConfigError:
    """`_gguf_files` of `p`, built now; the ConfigError is returned, to be kept with the file's key."""
    try:
        from transformers import AutoTokenizer  # noqa: PLC0415 (optional: the gguf extra)
    except ImportError:
        return ConfigError(f"tokenizer: reading the tokenizer of {p} needs the optional packages gguf and "
                           "transformers; fix: pip install 'boostjax[gguf]'")
    try:
        with contextlib.redirect_stderr(io.StringIO()), tempfile.TemporaryDirectory() as tmp:
            alone = pathlib.Path(tmp) / "in"  # the file alone: a tokenizer.json beside it would be read instead
            alone.mkdir()
            (alone / p.name).symlink_to(p.resolve())
            tok = AutoTokenizer.from_pretrained(str(alone), gguf_file=p.name)
            tok.save_pretrained(pathlib.Path(tmp) / "out")
            files = {f.name: f.read_text(encoding="utf-8") for f in (pathlib.Path(tmp) / "out").iterdir()
                     if f.is_file()}
    except Exception as e:  # the converter raises whatever a vocabulary it cannot read trips on
        why = " ".join(str(e).split())[:200] or type(e).__name__
        return ConfigError(f"tokenizer: transformers cannot build a tokenizer from {p} ({why}); fix: pass the "
                           "model's tokenizer.json (or a folder holding one) instead")
    if TOKENIZER_FILE not in files:
        return ConfigError(f"tokenizer: transformers built no fast tokenizer from {p}; fix: pass the model's "
                           "tokenizer.json instead")
    return files.pop(TOKENIZER_FILE), files


def gguf_tokenizer(path: str | pathlib.Path) -> HFTokenizer:
    """The tokenizer a `.gguf` file describes, as transformers builds it (the ids transformers'
    `AutoTokenizer.from_pretrained(dir, gguf_file=name)` gives)."""
    return HFTokenizer(_Tok.from_str(_gguf_files(path)[0]), name=str(path))


def gguf_side_files(path: str | pathlib.Path) -> dict[str, str]:
    """{file name: text} of what transformers saves beside the `.gguf`'s `tokenizer.json`:
    `tokenizer_config.json`, and `chat_template.jinja` where the file has a chat template (then also
    under `chat_template` in `tokenizer_config.json`, where older readers look)."""
    files = dict(_gguf_files(path)[1])
    template = files.get(CHAT_TEMPLATE_FILE)
    conf_name = "tokenizer_config.json"
    if template is not None and conf_name in files:
        conf = json.loads(files[conf_name])
        if isinstance(conf, dict) and "chat_template" not in conf:
            files[conf_name] = json.dumps({**conf, "chat_template": template}, indent=2, ensure_ascii=False) + "\n"
    return files
