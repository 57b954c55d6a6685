"""Token streams: the `Corpus` (a train and a validation split), read from the built-in corpus, text
files, a folder of text files or a ``.bin`` file of token ids (a tokenised folder:
`boostjax.data.token_folder`; which one ``--data`` names: `boostjax.data.source`).

- the built-in corpus: the `*.py` sources of the running interpreter's standard library, read as
  bytes (byte-level tokens, vocab 256). No download. Files are sorted by relative POSIX path; each is
  followed by ``b"\\n\\n"``. File number ``i`` goes to validation iff ``i % 50 == 49`` (about 2%).
- a ``.bin`` file: pre-tokenised ids (``--data-dtype`` uint16/uint32), memory-mapped; the last
  ``val_fraction`` of the tokens is the validation split.
- any other file: plain text, byte-tokenised, split like a ``.bin`` file.
- a directory: every ``*.txt``/``*.md``/``*.py`` file under it, split by file like the stdlib corpus
  (falls back to the last ``val_fraction`` of tokens when that leaves a split empty, e.g. < 50 files).

Every problem is a ValueError of one line naming the path and the fix.
"""

from __future__ import annotations

import os
import pathlib
import sysconfig
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

TOKEN_DTYPES: tuple[str, ...] = ("uint8", "uint16", "uint32")
TEXT_SUFFIXES: tuple[str, ...] = (".txt", ".md", ".py")
VAL_EVERY: int = 50  # file i is a validation file iff i % VAL_EVERY == VAL_EVERY - 1
FILE_SEP: bytes = b"\n\n"
MIN_SPLIT_TOKENS: int = 2  # a split must hold at least one (input, target) pair


@dataclass(frozen=True)
class Corpus:
    """Train and validation token streams (1-D; uint8/uint16/uint32; np.memmap allowed)."""

    train: np.ndarray
    val: np.ndarray
    name: str
    # start offsets (int64, ascending, first 0) of the documents in each split; None = not known
    train_docs: np.ndarray | None = None
    val_docs: np.ndarray | None = None
    # how the validation split was cut, in words ("every 50th file", "the last 2% of the tokens"); '' = not said
    split_rule: str = ""

    def __post_init__(self) -> None:
        for split in ("train", "val"):
            arr = getattr(self, split)
            if arr.ndim != 1 or arr.dtype.name not in TOKEN_DTYPES:
                raise ValueError(
                    f"Corpus.{split}: need a 1-D array of {'/'.join(TOKEN_DTYPES)}, "
                    f"got shape {arr.shape} dtype {arr.dtype}"
                )


@dataclass(frozen=True)
class Mixture:
    """The corpora of a mixture of tokenised folders (``--data A:0.7,B:0.3``): (name, weight, `Corpus`)
    per folder, in order, the weights summing to 1. Batches draw each row's folder by weight
    (`boostjax.data.batches.MixtureIterator`); validation scores each folder."""

    name: str
    parts: tuple[tuple[str, float, Corpus], ...]

    @property
    def train(self) -> np.ndarray:
        """The training split of the heaviest folder (the first of equal ones): what reads one stream,
        such as the calibration of ``--init-factor whitened``, reads it."""
        return max(self.parts, key=lambda p: p[1])[2].train


# ----------------------------------------------------------------------------- reading files


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


def _missing(path: str) -> ValueError:
    return ValueError(
        f"data: no such file or directory: {path!r}; fix: pass --data with an existing text file, "
        f"directory or pre-tokenised .bin file, or --data '' for the built-in stdlib corpus"
    )


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


def text_files(folder: str | os.PathLike) -> list[pathlib.Path]:
    """The text files (``*.txt``/``*.md``/``*.py``) under a folder, sorted; a folder that cannot be
    listed is a ValueError naming it."""
    return _walk_files(pathlib.Path(folder), TEXT_SUFFIXES, strict=True)


# ----------------------------------------------------------------------------- streams and splits


def _tail_split(tokens: np.ndarray, val_fraction: float, name: str, unit: str = "tokens") -> Corpus:
    """Last ``val_fraction`` of ``tokens`` is validation; both splits are views (no copy). ``unit``
    names the tokens in `Corpus.split_rule` ("bytes" for text)."""
    n_val = int(round(len(tokens) * val_fraction))
    n_train = len(tokens) - n_val
    if n_val < MIN_SPLIT_TOKENS or n_train < MIN_SPLIT_TOKENS:
        raise ValueError(
            f"data: split too small for {name}: {len(tokens)} tokens with val_fraction={val_fraction} "
            f"gives train={n_train}, val={n_val} (need >= {MIN_SPLIT_TOKENS} each); "
            f"fix: use more data or a different val_fraction"
        )
    return Corpus(train=tokens[:n_train], val=tokens[n_train:], name=name,
                  split_rule=f"the last {val_fraction:.0%} of the {unit}")


def _starts(lengths: Sequence[int]) -> np.ndarray:
    """Start offsets (int64) of consecutive documents of these lengths."""
    return np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]).astype(np.int64)


def _file_chunks(files: Sequence[pathlib.Path]) -> list[bytes]:
    """Each file's bytes followed by FILE_SEP: the documents of a folder or the built-in corpus."""
    return [_read_bytes(path) + FILE_SEP for path in files]


def files_stream(files: Sequence[pathlib.Path]) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 stream, int64 start offsets of the files) of every file in order, each followed by
    FILE_SEP: the whole of what `_files_corpus` splits."""
    chunks = _file_chunks(files)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8), _starts([len(c) for c in chunks])


def _files_corpus(files: list[pathlib.Path], name: str, val_fraction: float) -> Corpus:
    """Concatenate files (each followed by FILE_SEP); file i is validation iff i % 50 == 49."""
    chunks = _file_chunks(files)
    if all(len(c) == len(FILE_SEP) for c in chunks):
        raise ValueError(
            f"data: empty corpus {name}: {len(files)} files, all empty; fix: point --data at real text"
        )
    is_val = [i % VAL_EVERY == VAL_EVERY - 1 for i in range(len(chunks))]
    train = np.frombuffer(b"".join(c for c, v in zip(chunks, is_val) if not v), dtype=np.uint8)
    val = np.frombuffer(b"".join(c for c, v in zip(chunks, is_val) if v), dtype=np.uint8)
    if len(train) < MIN_SPLIT_TOKENS or len(val) < MIN_SPLIT_TOKENS:
        # Too few files for a per-file split (e.g. < 50): fall back to the tail of the stream.
        tail = _tail_split(np.frombuffer(b"".join(chunks), dtype=np.uint8), val_fraction, name, "bytes")
        starts = _starts([len(c) for c in chunks])
        n_train = len(tail.train)  # the validation stream may begin inside a file: that piece is a document
        val_docs = np.unique(np.append(starts[starts >= n_train] - n_train, 0))
        return Corpus(tail.train, tail.val, name, starts[starts < n_train], val_docs,
                      f"{tail.split_rule}, as {len(files)} files are too few to hold out every {VAL_EVERY}th")
    return Corpus(train=train, val=val, name=name,
                  train_docs=_starts([len(c) for c, v in zip(chunks, is_val) if not v]),
                  val_docs=_starts([len(c) for c, v in zip(chunks, is_val) if v]),
                  split_rule=f"every {VAL_EVERY}th file")


# ----------------------------------------------------------------------------- the built-in corpus


def _stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources() -> list[pathlib.Path]:
    """Every ``*.py`` under this interpreter's stdlib (no site/dist-packages), sorted by relative path."""
    return _walk_files(_stdlib_root(), (".py",), skip_dirs=("site-packages", "dist-packages"))


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


# ----------------------------------------------------------------------------- files and folders


def folder_corpus(folder: str, val_fraction: float) -> Corpus:
    """Every text file under ``folder``, one document each, split by file."""
    files = text_files(folder)
    if not files:
        raise ValueError(
            f"data: empty corpus: no {'/'.join('*' + s for s in TEXT_SUFFIXES)} files under {folder!r}; "
            f"fix: point --data at a directory with text files, a text file or a .bin token file"
        )
    return _files_corpus(files, str(pathlib.Path(folder)), val_fraction)


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


def _check_not_empty(path: str, size: int) -> None:
    if size == 0:
        raise ValueError(f"data: empty corpus: {path!r} has 0 bytes; fix: point --data at a non-empty file")


def bin_corpus(path: str, dtype: str, val_fraction: float) -> Corpus:
    """A ``.bin`` file of ``dtype`` token ids, memory-mapped; its last ``val_fraction`` validates."""
    size = _stat(path).st_size
    _check_not_empty(path, size)
    _check_bin_size(path, size, dtype)
    try:
        tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    except OSError as e:
        raise _unreadable(path, e) from None
    return _tail_split(tokens, val_fraction, str(pathlib.Path(path)))


def text_corpus(path: str, val_fraction: float) -> Corpus:
    """A text file as bytes; its last ``val_fraction`` validates."""
    _check_not_empty(path, _stat(path).st_size)
    p = pathlib.Path(path)
    return _tail_split(np.frombuffer(_read_bytes(p), dtype=np.uint8), val_fraction, str(p), "bytes")


SCAN_BYTES: int = 1 << 26  # the token scan reads 64 MiB at a time
_MAX_CACHE: dict[tuple, int] = {}


def token_max(path: str | os.PathLike, dtype: str = "uint16") -> int:
    """The largest token id in a ``.bin`` file, read in ``SCAN_BYTES`` chunks (never the whole file
    at once, and with plain reads: an I/O error is an exception, not a SIGBUS of a memory map). Cached
    per file (path, inode, size and modification time), so a file is scanned once per process."""
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


def text_max(path: pathlib.Path) -> int:
    """The largest byte of a text file (its largest token id at byte level); 0 when it is empty."""
    raw = _read_bytes(path)
    return max(raw) if raw else 0
