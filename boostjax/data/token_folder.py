"""Reading a tokenised folder, the format `boostjax tokenize` writes (`boostjax.data.tokenize`).

    meta.json          {"format": "boostjax-tokens", "version": 2, "tokenizer": "byte" | "tokenizer.json",
                        "dtype", "vocab_size", "eos_id", "bos_id", "source", "fingerprint": "blake3:<hex>",
                        "splits": {"train": {"shards": [{"file", "tokens"}, ...], "docs_file", "documents",
                                             "tokens", "bytes"}, "val": ...}}
    tokenizer.json     the tokenizer, unless byte level
    train-00000.bin .. the shards: raw token ids of that dtype, every document followed by its separator and
                       in exactly one shard; a split's stream is its shards in order
    train.docs.npy ... int64 start offsets of the documents in that stream

Version 1 (still read, never rewritten) has one ``train.bin`` / ``val.bin`` per split (``"file"``
instead of ``"shards"``) and may lack the fingerprint. `read_token_meta` checks the metadata against
the files; `token_folder_corpus` opens the splits as `boostjax.data.shards.TokenShards` (a batch reads
only its rows' bytes) with their documents' offsets; `token_fingerprint` is the data's identity
(`boostjax.data.fingerprint`). Every problem is a ValueError of one line naming the file and the fix.
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import numpy as np

from boostjax.data import fingerprint
from boostjax.data.corpus import MIN_SPLIT_TOKENS, TOKEN_DTYPES, Corpus, _unreadable
from boostjax.data.shards import TokenShards

META_FILE: str = "meta.json"  # a tokenised data folder is marked by this file
TOKENS_FORMAT: str = "boostjax-tokens"
TOKENS_VERSION: int = 2  # the version boostjax tokenize writes
READ_VERSIONS: tuple[int, ...] = (1, 2)
SPLITS: tuple[str, ...] = ("train", "val")
TOKENIZER_FILE: str = "tokenizer.json"  # as in boostjax.data.tokenizers
# a version 1 folder's files whose content is the data, in the order `fingerprint` names them
FINGERPRINT_FILES: tuple[str, ...] = tuple(f"{s}{ext}" for s in SPLITS for ext in (".bin", ".docs.npy"))
# every file of a tokenised folder but the shards (`is_folder_file`)
FOLDER_FILES: frozenset[str] = frozenset({META_FILE, TOKENIZER_FILE}
                                         | {f"{s}{ext}" for s in SPLITS for ext in (".bin", ".docs.npy")})
_SHARD = re.compile(r"(train|val)-[0-9]{5,}\.bin")


def shard_name(split: str, i: int) -> str:
    """The file of shard ``i`` of a split: ``train-00000.bin``, ``train-00001.bin``, ..."""
    return f"{split}-{i:05d}.bin"


def is_folder_file(name: str) -> bool:
    """Whether ``name`` is a file a tokenised folder holds (of either version)."""
    return name in FOLDER_FILES or _SHARD.fullmatch(name) is not None


def is_token_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder written by ``boostjax tokenize`` (its ``meta.json`` says so, or
    cannot be parsed: a damaged one is reported by `read_token_meta` rather than read as text)."""
    meta = pathlib.Path(path) / META_FILE
    if not (os.path.isdir(path) and meta.is_file()):
        return False
    try:
        d = json.loads(meta.read_text())
    except (OSError, ValueError):
        return True
    return isinstance(d, dict) and d.get("format") == TOKENS_FORMAT


def _meta_error(folder: pathlib.Path, what: str) -> ValueError:
    return ValueError(f"data: {folder / META_FILE}: {what}; fix: tokenise the text again with "
                      f"boostjax tokenize --out {folder} (or pass another --data)")


def _int_field(d: dict, key: str, folder: pathlib.Path, minimum: int = 0, where: str = "") -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _meta_error(folder, f"{where}{key} must be an integer >= {minimum}, got {v!r}")
    return v


def _parse_meta(p: pathlib.Path) -> object:
    try:
        return json.loads((p / META_FILE).read_text())
    except OSError as e:
        raise _unreadable(p / META_FILE, e) from None
    except ValueError as e:
        raise _meta_error(p, f"not valid JSON ({' '.join(str(e).split())})") from None


def read_token_meta(folder: str | os.PathLike) -> dict:
    """The validated ``meta.json`` of a tokenised folder: format and version, dtype, vocabulary,
    the tokenizer file, and per split its files, whose sizes must match the token counts."""
    p = pathlib.Path(folder)
    return check_token_meta(p, _parse_meta(p))


def token_meta(folder: str | os.PathLike) -> dict | None:
    """`read_token_meta` of a tokenised folder, None for any other folder (no ``meta.json``, or one of
    another format); ``meta.json`` is read once. A damaged one is an error, as in `is_token_folder`."""
    p = pathlib.Path(folder)
    if not (p / META_FILE).is_file():
        return None
    d = _parse_meta(p)
    if not isinstance(d, dict) or d.get("format") != TOKENS_FORMAT:
        return None
    return check_token_meta(p, d)


def check_token_meta(p: pathlib.Path, d: object) -> dict:
    """``d`` (the parsed ``meta.json`` of the folder ``p``), checked against the format and the files."""
    if not isinstance(d, dict) or d.get("format") != TOKENS_FORMAT:
        raise _meta_error(p, f"not a {TOKENS_FORMAT} metadata file")
    if d.get("incomplete"):
        raise _meta_error(p, "an interrupted boostjax tokenize left this folder incomplete")
    version = d.get("version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise _meta_error(p, f"version {version!r}; this boostjax reads versions "
                             f"{', '.join(map(str, READ_VERSIONS))}")
    if d.get("dtype") not in TOKEN_DTYPES:
        raise _meta_error(p, f"dtype must be one of {', '.join(TOKEN_DTYPES)}, got {d.get('dtype')!r}")
    vocab = _int_field(d, "vocab_size", p, 1)
    if vocab > 1 << (8 * np.dtype(d["dtype"]).itemsize):
        raise _meta_error(p, f"vocab_size {vocab} does not fit in {d['dtype']}")
    for key in ("eos_id", "bos_id"):
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab):
            raise _meta_error(p, f"{key} must be null or an id in [0, {vocab}), got {v!r}")
    tok = d.get("tokenizer")
    if tok not in ("byte", "tokenizer.json"):
        raise _meta_error(p, f"tokenizer must be 'byte' or 'tokenizer.json', got {tok!r}")
    if tok != "byte" and not (p / tok).is_file():
        raise _meta_error(p, f"names the tokenizer {tok} but {p / tok} is missing")
    fp = d.get("fingerprint")
    if (fp is not None or version > 1) and not (isinstance(fp, str) and fingerprint.PATTERN.fullmatch(fp)):
        raise _meta_error(p, f"fingerprint must be 'blake3:' and 64 hex digits, got {fp!r}")
    splits = d.get("splits")
    if not isinstance(splits, dict) or set(splits) != set(SPLITS):
        raise _meta_error(p, f"splits must name exactly {', '.join(SPLITS)}")
    for name in SPLITS:
        s = splits[name]
        if not isinstance(s, dict) or s.get("docs_file") != f"{name}.docs.npy":
            raise _meta_error(p, f"split {name} must name {name}.docs.npy")
        tokens = _int_field(s, "tokens", p, MIN_SPLIT_TOKENS, f"splits.{name}.")
        _int_field(s, "documents", p, 1, f"splits.{name}.")
        _int_field(s, "bytes", p, 0, f"splits.{name}.")
        shards = _shards(p, d, name, version)
        if sum(n for _, n in shards) != tokens:
            raise _meta_error(p, f"the shards of split {name} hold {sum(n for _, n in shards)} tokens but "
                                 f"splits.{name}.tokens says {tokens}")
        for f, n in shards:
            _check_size(p, p / f, n, d["dtype"])
    return d


def _shards(p: pathlib.Path, d: dict, name: str, version: int) -> list[tuple[str, int]]:
    """(file, tokens) of each shard of a split, as ``meta.json`` names them (version 1: its one file)."""
    s = d["splits"][name]
    if version == 1:
        if s.get("file") != f"{name}.bin":
            raise _meta_error(p, f"split {name} must name {name}.bin and {name}.docs.npy")
        return [(s["file"], s["tokens"])]
    shards = s.get("shards")
    if not isinstance(shards, list) or not shards:
        raise _meta_error(p, f"splits.{name}.shards must be a non-empty list of {{file, tokens}}")
    out = []
    for i, sh in enumerate(shards):
        if not isinstance(sh, dict) or sh.get("file") != shard_name(name, i):
            raise _meta_error(p, f"splits.{name}.shards[{i}] must name {shard_name(name, i)}, got "
                                 f"{sh.get('file') if isinstance(sh, dict) else sh!r}")
        out.append((sh["file"], _int_field(sh, "tokens", p, 1, f"splits.{name}.shards[{i}].")))
    return out


def _check_size(p: pathlib.Path, f: pathlib.Path, tokens: int, dtype: str) -> None:
    try:
        size = os.stat(f).st_size
    except FileNotFoundError:
        raise _meta_error(p, f"{f} is missing") from None
    except OSError as e:
        raise _unreadable(f, e) from None
    if size != tokens * np.dtype(dtype).itemsize:
        raise _meta_error(p, f"{f} has {size} bytes but the metadata says {tokens} {dtype} tokens "
                             f"({tokens * np.dtype(dtype).itemsize} bytes)")


def split_files(folder: str | os.PathLike, meta: dict, name: str) -> list[pathlib.Path]:
    """The token files of one split, in reading order (version 1: ``train.bin``; 2: the shards)."""
    s = meta["splits"][name]
    return [pathlib.Path(folder) / (sh["file"] if "shards" in s else sh) for sh in s.get("shards", [s.get("file")])]


def token_split(folder: str | os.PathLike, meta: dict, name: str) -> tuple[TokenShards, np.ndarray]:
    """(the tokens as `TokenShards`, document start offsets) of one split of a tokenised folder whose
    metadata `read_token_meta` gave. Only the offsets are read now; the tokens, as they are indexed."""
    folder = pathlib.Path(folder)
    s = meta["splits"][name]
    files = split_files(folder, meta, name)
    counts = [sh["tokens"] for sh in s["shards"]] if "shards" in s else [s["tokens"]]
    tokens = TokenShards(files, counts, meta["dtype"])
    try:
        docs = np.load(folder / s["docs_file"], allow_pickle=False)
    except OSError as e:
        raise _unreadable(folder / s["docs_file"], e) from None
    except ValueError as e:
        raise _meta_error(folder, f"{s['docs_file']} is not a numpy array file ({e})") from None
    n = s["documents"]
    if (docs.dtype != np.int64 or docs.shape != (n,) or docs[0] != 0 or docs[-1] >= len(tokens)
            or (n > 1 and np.any(np.diff(docs) <= 0))):
        raise _meta_error(folder, f"{s['docs_file']} must hold {n} ascending int64 start offsets from 0 "
                                  f"below {len(tokens)}, got {docs.dtype} {docs.shape}")
    return tokens, docs


def token_folder_corpus(folder: str | os.PathLike, meta: dict | None = None) -> Corpus:
    """The train/val streams and document offsets of a folder written by ``boostjax tokenize``
    (``meta``: its metadata when already read by `read_token_meta`)."""
    p = pathlib.Path(folder)
    meta = read_token_meta(p) if meta is None else meta
    train, train_docs = token_split(p, meta, "train")
    val, val_docs = token_split(p, meta, "val")
    return Corpus(train=train, val=val, name=str(p), train_docs=train_docs, val_docs=val_docs)


def vocab_error(folder: str | os.PathLike, meta: dict, vocab_size: int) -> ValueError | None:
    """The refusal of a model vocabulary smaller than the folder's tokenizer (None when it fits)."""
    if vocab_size >= meta["vocab_size"]:
        return None
    return ValueError(f"model.vocab_size: {vocab_size} is smaller than the vocabulary of the tokenizer of "
                      f"{folder} ({meta['vocab_size']} ids); fix: pass --vocab-size {meta['vocab_size']} (boostjax "
                      f"train takes it from {pathlib.Path(folder) / META_FILE} when --vocab-size is not given)")


def check_token_vocab(folder: str | os.PathLike, vocab_size: int) -> dict:
    """A tokenised folder whose tokenizer has more ids than the model's vocabulary is refused."""
    meta = read_token_meta(folder)
    err = vocab_error(folder, meta, vocab_size)
    if err is not None:
        raise err
    return meta


def token_fingerprint(folder: str | os.PathLike, meta: dict) -> str:
    """The content fingerprint of a tokenised folder: the one its ``meta.json`` carries (computed by
    ``boostjax tokenize`` as it wrote the files), or, for a folder written before fingerprints
    existed, its token files hashed now (``meta.json`` is not rewritten: the folder may be shared or
    read-only; tokenising again stores it)."""
    if meta.get("fingerprint"):
        return meta["fingerprint"]
    p = pathlib.Path(folder)
    files = [p / n for n in FINGERPRINT_FILES]
    try:
        return fingerprint.of_files(p, files)
    except OSError as e:
        raise _unreadable(pathlib.Path(e.filename or p), e) from None
