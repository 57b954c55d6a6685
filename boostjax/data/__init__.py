"""Data: byte-level tokenizer, corpora and a deterministic, resumable, process-sharded batch iterator.

Corpora are 1-D token arrays (uint8/uint16/uint32, possibly memory-mapped):

- default (`--data ""`): the `*.py` sources of the running interpreter's standard library, read as
  bytes (byte-level tokens, vocab 256). No download. Files are sorted by relative POSIX path; each is
  followed by ``b"\\n\\n"``. File number ``i`` goes to validation iff ``i % 50 == 49`` (about 2%).
- a ``.bin`` file: pre-tokenised ids (``--data-dtype`` uint16/uint32), memory-mapped; the last
  ``val_fraction`` of the tokens is the validation split.
- any other file: plain text, byte-tokenised, split like a ``.bin`` file.
- a directory: every ``*.txt``/``*.md``/``*.py`` file under it, split by file like the stdlib corpus
  (falls back to the last ``val_fraction`` of tokens when that leaves a split empty, e.g. < 50 files).
- a tokenised folder written by ``boostjax tokenize`` (``meta.json`` with ``"format": "boostjax-tokens"``):
  its ``train.bin`` / ``val.bin`` memory-mapped with the dtype its metadata names, and the documents'
  start offsets (``*.docs.npy``) as ``Corpus.train_docs`` / ``val_docs``.

Where the document boundaries are known (``Corpus.train_docs``/``val_docs``: the files of the stdlib
corpus and of a folder, the documents of a tokenised folder), `DocumentIterator` packs documents: epoch
``e`` concatenates every document (each ends with its separator: EOS, or ``b"\\n\\n"`` at byte level)
in the order of a permutation seeded by ``(seed, e)`` and cuts that stream into rows of ``seq + 1``
tokens (stride ``seq``, so every next-token pair is trained once per epoch), visited in a second
permutation; ``segments`` gives each position its document's number in the row. Otherwise
`BatchIterator` draws random windows: global batch ``k``'s starts come from
``np.random.default_rng([seed, k])``. Either way batch ``k`` is a pure function of ``(seed, k)`` and each
process reads only its contiguous block of rows, so batches are deterministic, resumable from
``state()`` and independent of the process count.
"""

from __future__ import annotations

import json
import os
import pathlib
import stat
import sysconfig
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

TOKEN_DTYPES: tuple[str, ...] = ("uint8", "uint16", "uint32")
TEXT_SUFFIXES: tuple[str, ...] = (".txt", ".md", ".py")
VAL_EVERY: int = 50  # file i is a validation file iff i % VAL_EVERY == VAL_EVERY - 1
FILE_SEP: bytes = b"\n\n"
MIN_SPLIT_TOKENS: int = 2  # a split must hold at least one (input, target) pair
META_FILE: str = "meta.json"  # a tokenised data folder (boostjax.data.tokenize) is marked by this file
TOKENS_FORMAT: str = "boostjax-tokens"
TOKENS_VERSION: int = 1
SPLITS: tuple[str, ...] = ("train", "val")


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


@dataclass(frozen=True)
class Corpus:
    """Train and validation token streams (1-D; uint8/uint16/uint32; np.memmap allowed)."""

    train: np.ndarray
    val: np.ndarray
    name: str
    # start offsets (int64, ascending, first 0) of the documents in each split; None = not known
    train_docs: np.ndarray | None = None
    val_docs: np.ndarray | None = None

    def __post_init__(self) -> None:
        for split in ("train", "val"):
            arr = getattr(self, split)
            if arr.ndim != 1 or arr.dtype.name not in TOKEN_DTYPES:
                raise ValueError(
                    f"Corpus.{split}: need a 1-D array of {'/'.join(TOKEN_DTYPES)}, "
                    f"got shape {arr.shape} dtype {arr.dtype}"
                )


# ----------------------------------------------------------------------------- corpora


def _stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _unreadable(path: Any, e: OSError) -> ValueError:
    why = e.strerror or type(e).__name__
    return ValueError(
        f"data: cannot read {path}: {why}; fix: check that the file is readable (permissions, disk) "
        f"or pass another --data"
    )


def _read_bytes(path: pathlib.Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise _unreadable(path, e) from None


def _raise(e: OSError) -> None:
    raise _unreadable(e.filename, e)


def _walk_files(
    root: pathlib.Path, suffixes: tuple[str, ...], skip_dirs: tuple[str, ...] = (), strict: bool = False
) -> list[pathlib.Path]:
    """Regular files under ``root`` with one of ``suffixes``, sorted by relative POSIX path.

    Does not follow directory symlinks (no cycles, no files counted twice). ``strict``: a folder that
    cannot be listed is an error (ValueError naming it), not silently skipped.
    """
    found: list[tuple[str, pathlib.Path]] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise if strict else None):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        for fname in filenames:
            if fname.endswith(suffixes):
                path = pathlib.Path(dirpath, fname)
                if path.is_file():
                    found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def stdlib_sources() -> list[pathlib.Path]:
    """Every ``*.py`` under this interpreter's stdlib (no site/dist-packages), sorted by relative path."""
    return _walk_files(_stdlib_root(), (".py",), skip_dirs=("site-packages", "dist-packages"))


def _tail_split(tokens: np.ndarray, val_fraction: float, name: str) -> Corpus:
    """Last ``val_fraction`` of ``tokens`` is validation; both splits are views (no copy)."""
    n_val = int(round(len(tokens) * val_fraction))
    n_train = len(tokens) - n_val
    if n_val < MIN_SPLIT_TOKENS or n_train < MIN_SPLIT_TOKENS:
        raise ValueError(
            f"data: split too small for {name}: {len(tokens)} tokens with val_fraction={val_fraction} "
            f"gives train={n_train}, val={n_val} (need >= {MIN_SPLIT_TOKENS} each); "
            f"fix: use more data or a different val_fraction"
        )
    return Corpus(train=tokens[:n_train], val=tokens[n_train:], name=name)


def _files_corpus(files: list[pathlib.Path], name: str, val_fraction: float) -> Corpus:
    """Concatenate files (each followed by FILE_SEP); file i is validation iff i % 50 == 49."""
    chunks = [_read_bytes(path) + FILE_SEP for path in files]
    if all(len(c) == len(FILE_SEP) for c in chunks):
        raise ValueError(
            f"data: empty corpus {name}: {len(files)} files, all empty; fix: point --data at real text"
        )
    is_val = [i % VAL_EVERY == VAL_EVERY - 1 for i in range(len(chunks))]
    train = np.frombuffer(b"".join(c for c, v in zip(chunks, is_val) if not v), dtype=np.uint8)
    val = np.frombuffer(b"".join(c for c, v in zip(chunks, is_val) if v), dtype=np.uint8)
    if len(train) < MIN_SPLIT_TOKENS or len(val) < MIN_SPLIT_TOKENS:
        # Too few files for a per-file split (e.g. < 50): fall back to the tail of the stream.
        tail = _tail_split(np.frombuffer(b"".join(chunks), dtype=np.uint8), val_fraction, name)
        starts = _starts([len(c) for c in chunks])
        n_train = len(tail.train)  # the validation stream may begin inside a file: that piece is a document
        val_docs = np.unique(np.append(starts[starts >= n_train] - n_train, 0))
        return Corpus(tail.train, tail.val, name, starts[starts < n_train], val_docs)
    return Corpus(train=train, val=val, name=name,
                  train_docs=_starts([len(c) for c, v in zip(chunks, is_val) if not v]),
                  val_docs=_starts([len(c) for c, v in zip(chunks, is_val) if v]))


def _starts(lengths: Sequence[int]) -> np.ndarray:
    """Start offsets (int64) of consecutive documents of these lengths."""
    return np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]).astype(np.int64)


_STDLIB_CACHE: dict[str, Corpus] = {}


def stdlib_corpus() -> Corpus:
    """Byte-tokenised stdlib sources, split by file (cached per process; arrays are read-only)."""
    root = str(_stdlib_root())
    if root not in _STDLIB_CACHE:
        files = stdlib_sources()
        if not files:
            raise ValueError(
                f"data: empty corpus: no *.py files under the stdlib at {root}; "
                f"fix: pass --data with a text file, directory or .bin token file"
            )
        _STDLIB_CACHE[root] = _files_corpus(files, f"stdlib:{root}", val_fraction=0.02)
    return _STDLIB_CACHE[root]


def _missing(path: str) -> ValueError:
    return ValueError(
        f"data: no such file or directory: {path!r}; fix: pass --data with an existing text file, "
        f"directory or pre-tokenised .bin file, or --data '' for the built-in stdlib corpus"
    )


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def _stat(path: str) -> os.stat_result:
    """``os.stat`` of a ``--data`` path: ValueError (one line) when it is missing or cannot be read."""
    if "\0" in path:
        raise ValueError(f"data: {path!r} contains a NUL byte; fix: pass the path of a real file or folder")
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise _missing(path) from None
    except OSError as e:
        raise _unreadable(path, e) from None


def _check_kind(path: str, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
        return
    kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
    raise ValueError(
        f"data: {path} is {kind}, not a file or folder; fix: pass --data with a text file, a folder of text "
        f"files or a .bin token file (write the stream to a file first)"
    )


def _check_bin_size(path: str, size: int, dtype: str) -> int:
    if dtype not in TOKEN_DTYPES:
        raise ValueError(
            f"load_corpus: dtype must be one of {TOKEN_DTYPES}, got {dtype!r}; fix: --data-dtype uint16"
        )
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise ValueError(
            f"data: {path!r} has {size} bytes, not a multiple of {dtype} ({itemsize} bytes); "
            f"fix: pass the --data-dtype it was written with"
        )
    return itemsize


SCAN_BYTES: int = 1 << 26  # the token scan reads 64 MiB at a time
_MAX_CACHE: dict[tuple, int] = {}


def token_max(path: str | os.PathLike, dtype: str = "uint16") -> int:
    """The largest token id in a ``.bin`` file, read in ``SCAN_BYTES`` chunks (never the whole file
    at once, and with plain reads: an I/O error is an exception, not a SIGBUS of a memory map). Cached
    per file (path, inode, size and modification time), so `validate` and `load_corpus` scan once."""
    p = os.fspath(path)
    st = _stat(p)
    itemsize = _check_bin_size(p, st.st_size, dtype)
    key = (os.path.realpath(p), st.st_ino, st.st_size, st.st_mtime_ns, dtype)
    if key in _MAX_CACHE:
        return _MAX_CACHE[key]
    buf = np.empty(SCAN_BYTES // itemsize, dtype=dtype)
    view = memoryview(buf.view(np.uint8))
    top = 0
    try:
        with open(p, "rb") as f:
            while True:
                n = 0
                while n < len(view):  # fill the chunk (a read may return less than asked)
                    got = f.readinto(view[n:])
                    if not got:
                        break
                    n += got
                if n:
                    top = max(top, int(buf[: n // itemsize].max()))
                if n < len(view):
                    break
    except OSError as e:
        raise _unreadable(p, e) from None
    _MAX_CACHE[key] = top
    return top


def _vocab_error(path: str, top: int, vocab_size: int, binary: bool) -> ValueError:
    alt = "or the --data-dtype the file was written with" if binary else "(byte-level text needs 256)"
    return ValueError(
        f"data: {path} holds token id {top} but model.vocab_size is {vocab_size}; "
        f"fix: pass --vocab-size {top + 1} or more {alt}"
    )


def check_data(path: str, dtype: str, vocab_size: int) -> None:
    """Everything about ``--data`` that can be known before a run starts (no corpus is kept): it
    exists, is a readable file or folder, a ``.bin`` file holds whole ``dtype`` tokens, and every
    token id is below ``vocab_size`` (a ``.bin`` file is scanned once, in chunks; text is byte-level,
    ids < 256, so it is read only when ``vocab_size < 256``). ValueError (one line) otherwise."""
    if path == "":
        if vocab_size < ByteTokenizer.vocab_size:
            c = stdlib_corpus()
            top = max(int(c.train.max()), int(c.val.max()))
            if top >= vocab_size:
                raise _vocab_error("the built-in stdlib corpus", top, vocab_size, False)
        return
    st = _stat(path)
    _check_kind(path, st)
    if stat.S_ISDIR(st.st_mode) and is_token_folder(path):
        check_token_vocab(path, vocab_size)
        return
    if stat.S_ISDIR(st.st_mode):
        if vocab_size < ByteTokenizer.vocab_size:
            for f in _walk_files(pathlib.Path(path), TEXT_SUFFIXES, strict=True):
                raw = _read_bytes(f)
                top = max(raw) if raw else 0
                if top >= vocab_size:
                    raise _vocab_error(f, top, vocab_size, False)
        return
    if path.endswith(".bin"):
        top = token_max(path, dtype)
        if st.st_size and top >= vocab_size:
            raise _vocab_error(path, top, vocab_size, True)
    elif vocab_size < ByteTokenizer.vocab_size:
        raw = _read_bytes(pathlib.Path(path))
        top = max(raw) if raw else 0
        if top >= vocab_size:
            raise _vocab_error(path, top, vocab_size, False)


# ----------------------------------------------------------------------------- tokenised folders


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


def read_token_meta(folder: str | os.PathLike) -> dict:
    """The validated ``meta.json`` of a tokenised folder: format and version, dtype, vocabulary,
    the tokenizer file, and per split its files, whose sizes must match the token counts."""
    p = pathlib.Path(folder)
    try:
        d = json.loads((p / META_FILE).read_text())
    except OSError as e:
        raise _unreadable(p / META_FILE, e) from None
    except ValueError as e:
        raise _meta_error(p, f"not valid JSON ({' '.join(str(e).split())})") from None
    if not isinstance(d, dict) or d.get("format") != TOKENS_FORMAT:
        raise _meta_error(p, f"not a {TOKENS_FORMAT} metadata file")
    if d.get("incomplete"):
        raise _meta_error(p, "an interrupted boostjax tokenize left this folder incomplete")
    if d.get("version") != TOKENS_VERSION:
        raise _meta_error(p, f"version {d.get('version')!r}; this boostjax reads version {TOKENS_VERSION}")
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
    splits = d.get("splits")
    if not isinstance(splits, dict) or set(splits) != set(SPLITS):
        raise _meta_error(p, f"splits must name exactly {', '.join(SPLITS)}")
    itemsize = np.dtype(d["dtype"]).itemsize
    for name in SPLITS:
        s = splits[name]
        if not isinstance(s, dict) or s.get("file") != f"{name}.bin" or s.get("docs_file") != f"{name}.docs.npy":
            raise _meta_error(p, f"split {name} must name {name}.bin and {name}.docs.npy")
        tokens = _int_field(s, "tokens", p, MIN_SPLIT_TOKENS, f"splits.{name}.")
        _int_field(s, "documents", p, 1, f"splits.{name}.")
        _int_field(s, "bytes", p, 0, f"splits.{name}.")
        f = p / s["file"]
        try:
            size = os.stat(f).st_size
        except FileNotFoundError:
            raise _meta_error(p, f"{f} is missing") from None
        except OSError as e:
            raise _unreadable(f, e) from None
        if size != tokens * itemsize:
            raise _meta_error(p, f"{f} has {size} bytes but the metadata says {tokens} {d['dtype']} tokens "
                                 f"({tokens * itemsize} bytes)")
    return d


def _token_split(folder: pathlib.Path, meta: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(memory-mapped tokens, document start offsets) of one split of a tokenised folder."""
    s = meta["splits"][name]
    try:
        tokens = np.memmap(folder / s["file"], dtype=np.dtype(meta["dtype"]), mode="r")
        docs = np.load(folder / s["docs_file"], allow_pickle=False)
    except OSError as e:
        raise _unreadable(folder / s["file"], e) from None
    except ValueError as e:
        raise _meta_error(folder, f"{s['docs_file']} is not a numpy array file ({e})") from None
    n = s["documents"]
    if (docs.dtype != np.int64 or docs.shape != (n,) or docs[0] != 0 or docs[-1] >= len(tokens)
            or (n > 1 and np.any(np.diff(docs) <= 0))):
        raise _meta_error(folder, f"{s['docs_file']} must hold {n} ascending int64 start offsets from 0 "
                                  f"below {len(tokens)}, got {docs.dtype} {docs.shape}")
    return tokens, docs


def token_folder_corpus(folder: str | os.PathLike) -> Corpus:
    """The train/val streams and document offsets of a folder written by ``boostjax tokenize``."""
    p = pathlib.Path(folder)
    meta = read_token_meta(p)
    train, train_docs = _token_split(p, meta, "train")
    val, val_docs = _token_split(p, meta, "val")
    return Corpus(train=train, val=val, name=str(p), train_docs=train_docs, val_docs=val_docs)


def check_token_vocab(folder: str | os.PathLike, vocab_size: int) -> dict:
    """A tokenised folder whose tokenizer has more ids than the model's vocabulary is refused."""
    meta = read_token_meta(folder)
    if vocab_size < meta["vocab_size"]:
        raise ValueError(f"model.vocab_size: {vocab_size} is smaller than the vocabulary of the tokenizer of "
                         f"{folder} ({meta['vocab_size']} ids); fix: pass --vocab-size {meta['vocab_size']} (boostjax "
                         f"train takes it from {pathlib.Path(folder) / META_FILE} when --vocab-size is not given)")
    return meta


def load_corpus(path: str = "", dtype: str = "uint16", val_fraction: float = 0.02,
                vocab_size: int | None = None) -> Corpus:
    """Load ``""`` (stdlib), a ``.bin`` token file (memmap), a text file, a directory of text files or a
    tokenised folder (``boostjax tokenize``; its metadata gives the dtype, ``dtype`` is not used).

    With ``vocab_size``, a token id >= ``vocab_size`` anywhere in the data is an error here, at load
    (a ``.bin`` file is scanned once, in chunks), rather than at the step that reads it."""
    if not (isinstance(val_fraction, (int, float)) and 0.0 < val_fraction < 1.0):
        raise ValueError(f"load_corpus: val_fraction must be in (0, 1), got {val_fraction}; fix: e.g. 0.02")
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"data: need a path, got {path!r}; fix: pass --data PATH (or '' for the stdlib corpus)")
    path = os.fspath(path)
    if vocab_size is not None:
        check_data(path, dtype, vocab_size)
    if path == "":
        return stdlib_corpus()
    p = pathlib.Path(path)
    st = _stat(path)
    _check_kind(path, st)
    if stat.S_ISDIR(st.st_mode) and is_token_folder(p):
        return token_folder_corpus(p)
    if stat.S_ISDIR(st.st_mode):
        files = _walk_files(p, TEXT_SUFFIXES, strict=True)
        if not files:
            raise ValueError(
                f"data: empty corpus: no {'/'.join('*' + s for s in TEXT_SUFFIXES)} files under {path!r}; "
                f"fix: point --data at a directory with text files, a text file or a .bin token file"
            )
        return _files_corpus(files, str(p), val_fraction)
    size = st.st_size
    if size == 0:
        raise ValueError(f"data: empty corpus: {path!r} has 0 bytes; fix: point --data at a non-empty file")
    if p.suffix == ".bin":
        _check_bin_size(path, size, dtype)
        try:
            tokens = np.memmap(p, dtype=np.dtype(dtype), mode="r")
        except OSError as e:
            raise _unreadable(p, e) from None
        return _tail_split(tokens, val_fraction, str(p))
    return _tail_split(np.frombuffer(_read_bytes(p), dtype=np.uint8), val_fraction, str(p))


# ----------------------------------------------------------------------------- batches


def _check_int(name: str, value: Any, minimum: int, where: str = "BatchIterator") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class BatchIterator:
    """Random windows of ``seq + 1`` tokens; batch ``k`` depends only on ``(seed, k)``.

    ``next()`` returns ``{"inputs": int32[b, seq], "targets": int32[b, seq]}`` with
    ``b = batch // process_count`` (this process's rows of the global batch) and
    ``targets[:, t] == inputs[:, t + 1]`` along the window.
    """

    sampler = "windows"

    def __init__(
        self,
        tokens: np.ndarray,
        batch: int,
        seq: int,
        seed: int,
        *,
        step: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        vocab_size: int | None = None,
    ) -> None:
        tokens = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"BatchIterator: tokens must be 1-D, got shape {tokens.shape}")
        self.batch = _check_int("batch", batch, 1)
        self.seq = _check_int("seq", seq, 1)
        self._seed = _check_int("seed", seed, 0)
        self._step = _check_int("step", step, 0)
        self.process_count = _check_int("process_count", process_count, 1)
        self.process_index = _check_int("process_index", process_index, 0)
        if self.process_index >= self.process_count:
            raise ValueError(
                f"BatchIterator: process_index {process_index} must be < process_count {process_count}"
            )
        if self.batch % self.process_count:
            raise ValueError(
                f"BatchIterator: global batch {batch} is not divisible by process_count {process_count}; "
                f"fix: use a --batch that is a multiple of {process_count}"
            )
        if len(tokens) < self.seq + 1:
            raise ValueError(
                f"BatchIterator: {len(tokens)} tokens are fewer than seq + 1 = {self.seq + 1}; "
                f"fix: a smaller --seq or more data"
            )
        self.vocab_size = vocab_size
        # In-memory arrays are checked once; memmaps lazily per batch (never scan a huge file).
        self._lazy_vocab_check = vocab_size is not None and isinstance(tokens, np.memmap)
        if vocab_size is not None and not self._lazy_vocab_check:
            self._check_vocab(tokens)
        self.tokens = tokens
        self.local_batch = self.batch // self.process_count
        self._offsets = np.arange(self.seq + 1, dtype=np.int64)

    def _check_vocab(self, ids: np.ndarray) -> None:
        if ids.size and int(ids.max()) >= self.vocab_size:  # type: ignore[operator]
            where = getattr(self.tokens if hasattr(self, "tokens") else ids, "filename", None)
            raise ValueError(
                f"BatchIterator: token id {int(ids.max())} >= vocab_size {self.vocab_size}"
                f"{f' in {where}' if where else ''}; "
                f"fix: a --vocab-size > {int(ids.max())} or the --data-dtype the file was written with"
            )

    @property
    def step(self) -> int:
        return self._step

    @property
    def seed(self) -> int:
        return self._seed

    def global_starts(self, step: int) -> np.ndarray:
        """Window starts of global batch ``step``: int64[batch], uniform in [0, len - seq - 1]."""
        rng = np.random.default_rng([self._seed, step])
        return rng.integers(0, len(self.tokens) - self.seq, size=self.batch, dtype=np.int64)

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """This process's share of global batch ``step`` (does not move the iterator)."""
        lo = self.process_index * self.local_batch
        starts_b = self.global_starts(step)[lo : lo + self.local_batch]
        windows_bs = np.asarray(self.tokens[starts_b[:, None] + self._offsets[None, :]])
        if self._lazy_vocab_check:
            self._check_vocab(windows_bs)
        windows_bs = windows_bs.astype(np.int32)
        return {"inputs": windows_bs[:, :-1], "targets": windows_bs[:, 1:]}

    def next(self) -> dict[str, np.ndarray]:
        out = self.batch_at(self._step)
        self._step += 1
        return out

    def __next__(self) -> dict[str, np.ndarray]:
        return self.next()

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position: ``{"step": int, "seed": int, "sampler": "windows"|"documents"}``."""
        return {"step": self._step, "seed": self._seed, "sampler": self.sampler}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a saved ``state()`` (adopts its step and seed). A state without "sampler"
        (written before documents were packed) is accepted by either sampler."""
        if not isinstance(state, dict) or "step" not in state or "seed" not in state:
            raise ValueError(f"BatchIterator.restore: need a dict with 'step' and 'seed', got {state!r}")
        if state.get("sampler", self.sampler) != self.sampler:
            raise ValueError(
                f"BatchIterator.restore: the checkpoint's batches came from the {state['sampler']} sampler but this "
                f"data gives {self.sampler} (document boundaries are {'known' if self.sampler == 'documents' else 'unknown'}"
                f" now); fix: resume with the --data the run was trained on"
            )
        self._step = _check_int("step", state["step"], 0)
        self._seed = _check_int("seed", state["seed"], 0)


DOC_STREAM: int = 0x646F6373  # "docs": keeps the document sampler's random streams apart from the windows'


def check_docs(docs: Any, n_tokens: int, where: str = "DocumentIterator") -> np.ndarray:
    """``docs`` as int64 document start offsets: 1-D, first 0, strictly ascending, last < ``n_tokens``."""
    d = np.asarray(docs)
    if d.ndim != 1 or d.size == 0 or not np.issubdtype(d.dtype, np.integer):
        raise ValueError(f"{where}: document starts must be a non-empty 1-D integer array, got shape {d.shape} "
                         f"dtype {d.dtype}; fix: pass the start offset of every document (first 0)")
    d = d.astype(np.int64)
    if d[0] != 0 or (d.size > 1 and not bool(np.all(d[1:] > d[:-1]))) or d[-1] >= n_tokens:
        raise ValueError(f"{where}: document starts must begin at 0, ascend strictly and stay below the "
                         f"{n_tokens} tokens, got {d[:4].tolist()}{'...' if d.size > 4 else ''} (last {int(d[-1])}); "
                         f"fix: rebuild the data folder (boostjax tokenize)")
    return d


class DocumentIterator(BatchIterator):
    """Documents packed into rows of ``seq + 1`` tokens; batch ``k`` depends only on ``(seed, k)``.

    Global row ``g = k * batch + i`` is row ``g % R`` of epoch ``g // R`` (``R = (len - 1) // seq`` rows
    per epoch). Epoch ``e`` draws, from ``np.random.default_rng([seed, DOC_STREAM, e])``, an order of
    the documents (concatenated, each with its separator) and an order of the ``R`` rows; row ``j``
    covers stream positions ``[j * seq, j * seq + seq]``. Only the rows' tokens are read (a memmap
    stays on disk); the per-epoch state is two permutations and a cumulative sum (O(documents + R)).
    With ``segments``, ``next()`` also returns ``segments: int32[b, seq]``, the document number of each
    input position counted from 0 in its row (positions attend only within their document under
    ``--doc-mask``).
    """

    sampler = "documents"

    def __init__(self, tokens: np.ndarray, docs: np.ndarray, batch: int, seq: int, seed: int, *,
                 segments: bool = False, **kwargs: Any) -> None:
        super().__init__(tokens, batch, seq, seed, **kwargs)
        self.docs = check_docs(docs, len(self.tokens))
        self.lens = np.diff(np.append(self.docs, len(self.tokens)))
        self.rows_per_epoch = (len(self.tokens) - 1) // self.seq
        self.segments = bool(segments)
        self._epochs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order, cumulative lengths in that order [n + 1], row order) of epoch ``e``."""
        key = (self._seed, e)
        if key not in self._epochs:
            rng = np.random.default_rng([self._seed, DOC_STREAM, e])
            order = rng.permutation(len(self.docs))
            cum = np.zeros(len(order) + 1, np.int64)
            np.cumsum(self.lens[order], out=cum[1:])
            rows = rng.permutation(self.rows_per_epoch)
            while len(self._epochs) >= 2:  # a batch spans at most two epochs unless it is larger than one
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[key] = (order, cum, rows)
        return self._epochs[key]

    def positions(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(token index into ``tokens``, document index) of this process's rows of batch ``step``:
        int64[b, seq + 1] each."""
        lo = self.process_index * self.local_batch
        g_b = step * self.batch + lo + np.arange(self.local_batch, dtype=np.int64)
        src_bs = np.empty((self.local_batch, self.seq + 1), np.int64)
        doc_bs = np.empty_like(src_bs)
        for e in np.unique(g_b // self.rows_per_epoch):
            sel = g_b // self.rows_per_epoch == e
            order, cum, rows = self._epoch(int(e))
            pos = rows[g_b[sel] % self.rows_per_epoch][:, None] * self.seq + self._offsets[None, :]
            idx = np.searchsorted(cum, pos, side="right") - 1  # position -> place in this epoch's order
            src_bs[sel] = self.docs[order[idx]] + (pos - cum[idx])
            doc_bs[sel] = idx
        return src_bs, doc_bs

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        """This process's share of global batch ``step`` (does not move the iterator)."""
        src_bs, doc_bs = self.positions(step)
        windows_bs = np.asarray(self.tokens[src_bs])
        if self._lazy_vocab_check:
            self._check_vocab(windows_bs)
        windows_bs = windows_bs.astype(np.int32)
        out = {"inputs": windows_bs[:, :-1], "targets": windows_bs[:, 1:]}
        if self.segments:
            out["segments"] = (doc_bs[:, :-1] - doc_bs[:, :1]).astype(np.int32)
        return out


def batch_iterator(tokens: np.ndarray, docs: np.ndarray | None, batch: int, seq: int, seed: int, *,
                   segments: bool = False, **kwargs: Any) -> BatchIterator:
    """`DocumentIterator` when the document starts ``docs`` are known, else `BatchIterator` (random
    windows; ``segments`` then needs documents: ValueError)."""
    if docs is not None:
        return DocumentIterator(tokens, docs, batch, seq, seed, segments=segments, **kwargs)
    if segments:
        raise ValueError("batch_iterator: segments need document boundaries, and this data has none; "
                         "fix: pass the documents' start offsets (a data folder or a tokenised folder)")
    return BatchIterator(tokens, batch, seq, seed, **kwargs)


def eval_batches(
    tokens: np.ndarray,
    batch: int,
    seq: int,
    n: int,
    seed: int = 1234,
    *,
    process_index: int = 0,
    process_count: int = 1,
    vocab_size: int | None = None,
    docs: np.ndarray | None = None,
    segments: bool = False,
) -> list[dict[str, np.ndarray]]:
    """A fixed list of ``n`` validation batches (same format as `BatchIterator.next`; packed documents
    when their starts ``docs`` are known, see `batch_iterator`)."""
    n = _check_int("n", n, 0, where="eval_batches")
    it = batch_iterator(
        tokens, docs, batch, seq, seed, segments=segments,
        process_index=process_index, process_count=process_count, vocab_size=vocab_size,
    )
    return [it.next() for _ in range(n)]
