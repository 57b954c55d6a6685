"""What ``--data`` names, decided in one place: `resolve_source(path, dtype) -> Source`.

    kind       --data                                         token ids            documents known
    "builtin"  ''                                             bytes of the stdlib  yes (one per file)
    "tokens"   a folder written by boostjax tokenize          its meta.json dtype  yes (*.docs.npy)
    "folder"   any other folder (its *.txt / *.md / *.py)     bytes                yes (one per file)
    "bin"      a file ending in .bin                          --data-dtype         no
    "text"     any other file                                 bytes                no
    "mixture"  tokenised folders with weights, A:0.7,B:0.3    the folders' dtype   yes (`parse_mixture`)

Every consumer asks it: the configuration's vocabulary (`boostjax.training.prepare.resolve_config`),
the data check of `boostjax.training.checks.validate` (`check_source`), the trainer (`open_source`, the
run's tokenizer), the tokenizer check of ``--init-from-hf`` (`boostjax.interop.pretrained`),
``boostjax eval`` and ``boostjax tokenize``. Resolving reads only what tells the kinds apart: one
``stat`` and, for a tokenised folder, its ``meta.json`` (checked against its files). A source is kept
per process while its files are unchanged (their ``stat`` is the key), so one run reads a tokenised
folder's metadata and tokenizer once however many stages ask.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import shutil
import stat
from dataclasses import dataclass, field
from typing import Any

from boostjax.config import ConfigError
from boostjax.data import fingerprint, records
from boostjax.data.corpus import (
    Corpus,
    Mixture,
    _stat,
    _stdlib_root,
    _unreadable,
    bin_corpus,
    folder_corpus,
    stdlib_corpus,
    stdlib_sources,
    text_corpus,
    text_files,
    text_max,
    token_max,
)
from boostjax.data.token_folder import (
    FOLDER_FILES,
    META_FILE,
    token_fingerprint,
    token_folder_corpus,
    token_meta,
    is_folder_file,
    is_token_folder,
    vocab_error,
)
from boostjax.data.tokenizers import (
    TOKENIZER_FILE,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    same_tokenizer,
    tokenizer_kind,
)

KINDS: tuple[str, ...] = ("builtin", "tokens", "folder", "bin", "text", "mixture")
TMP_PREFIX = ".tokenize-"  # the temporary files of boostjax tokenize (boostjax.data.tokenize)


@dataclass(frozen=True)
class Source:
    """One ``--data``, resolved: what it is, where, the element type of its token ids, the vocabulary it
    names (a tokenised folder's; None for the others, whose ids are bytes or unknown) and whether its
    document boundaries are known. `tokenizer` is a tokenised folder's tokenizer (loaded on first use)."""

    kind: str
    path: str
    dtype: str
    vocab: int | None
    documents: bool
    meta: dict | None = field(default=None, compare=False, repr=False)  # a tokenised folder's meta.json
    parts: tuple[Part, ...] = field(default=(), compare=False, repr=False)  # a mixture's folders

    @property
    def name(self) -> str:
        """The source as messages name it."""
        return "the built-in stdlib corpus" if self.kind == "builtin" else self.path

    @functools.cached_property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer a tokenised folder was written with (a mixture's: its folders' shared one);
        None for any other source."""
        if self.kind == "mixture":
            return self.parts[0].source.tokenizer
        if self.kind != "tokens":
            return None
        tok = self.meta["tokenizer"]
        return ByteTokenizer() if tok == "byte" else load_tokenizer(pathlib.Path(self.path) / tok)

    @functools.cached_property
    def fingerprint(self) -> str:
        """What the data is, by content (`boostjax.data.fingerprint`), prefixed by how it is read (the
        same bytes as a .bin token file and as text are other data): ``tokens:blake3:<hex>``. A
        tokenised folder's comes from its meta.json; the others are hashed on first use (once per
        process while the files are unchanged)."""
        try:
            if self.kind == "mixture":  # each folder's content and weight, in order (not where they are)
                fp = fingerprint.of_digests((repr(p.weight), p.source.fingerprint) for p in self.parts)
            elif self.kind == "tokens":
                fp = token_fingerprint(self.path, self.meta)
            elif self.kind == "builtin":
                fp = fingerprint.of_files(_stdlib_root(), stdlib_sources())
            elif self.kind == "folder":
                fp = fingerprint.of_files(pathlib.Path(self.path), text_files(self.path))
            else:
                fp = fingerprint.of_file(self.path)
        except OSError as e:
            raise _unreadable(e.filename or self.path, e) from None
        return f"{self.kind}:{fp}"

    def mixture_record(self) -> list[dict] | None:
        """What config.json keeps of a mixture (`data_mixture`): each folder's name, path, weight
        (normalised) and fingerprint, in order; None for any other source."""
        if self.kind != "mixture":
            return None
        return [{"name": p.name, "path": p.source.path, "weight": p.weight, "fingerprint": p.source.fingerprint}
                for p in self.parts]


@dataclass(frozen=True)
class Part:
    """One folder of a mixture: the name its metrics carry (``val_loss/<name>``), its weight (the
    weights sum to 1) and the folder, resolved."""

    name: str
    weight: float
    source: Source


def parse_mixture(data: str) -> list[tuple[str, str | None]] | None:
    """The (folder, weight as written) parts of ``--data A:0.7,B:0.3`` (or ``A,B``: equal weights),
    or None when ``data`` is not a mixture: an existing path (a colon or comma in a file's name keeps
    working), or a part that is not a tokenised folder. The weights are read by `resolve_mixture`."""
    if not data or ("," not in data and ":" not in data) or os.path.exists(data):
        return None
    parts: list[tuple[str, str | None]] = []
    for item in data.split(","):
        path, weight = item, None
        if not is_token_folder(item) and ":" in item:
            path, weight = item.rsplit(":", 1)
        if not path or not is_token_folder(path):
            return None
        parts.append((path, weight))
    return parts


def _weight(path: str, text: str) -> float:
    try:
        w = float(text)
    except ValueError:
        w = math.nan
    if not math.isfinite(w) or w < 0:
        raise ValueError(f"data: the weight of {path} is {text!r}, not a number >= 0; fix: write each folder as "
                         f"FOLDER:WEIGHT with a weight like 0.3 (e.g. --data A:0.7,B:0.3)")
    return w


def _part_names(paths: list[str]) -> list[str]:
    """Each folder's base name, or its path as given where two base names are the same."""
    base = [os.path.basename(os.path.normpath(p)) or p for p in paths]
    return [b if base.count(b) == 1 else os.path.normpath(p) for b, p in zip(base, paths)]


def resolve_mixture(data: str, parts: list[tuple[str, str | None]], dtype: str) -> Source:
    """The `Source` of a mixture `parse_mixture` found: weights that are numbers >= 0 with a sum > 0
    (all given, or none: equal), each folder once, one tokenizer for all (ValueError, one line)."""
    given = [w is not None for _, w in parts]
    if any(given) and not all(given):
        bare = next(p for p, w in parts if w is None)
        raise ValueError(f"data: {bare} has no weight but other folders of {data!r} have; fix: give every folder "
                         f"a weight (FOLDER:WEIGHT) or none (equal weights)")
    weights = [_weight(p, w) if w is not None else 1.0 for p, w in parts]
    total = sum(weights)
    if not total > 0:
        raise ValueError(f"data: the weights of {data!r} sum to {total:g}; fix: give at least one folder a weight "
                         f"> 0 (e.g. --data A:0.7,B:0.3)")
    paths = [p for p, _ in parts]
    real = [os.path.realpath(p) for p in paths]
    for i, r in enumerate(real):
        if real.index(r) != i:
            raise ValueError(f"data: {paths[i]} appears twice in {data!r}; fix: name each folder once and give it "
                             f"the sum of its weights")
    srcs = [resolve_source(p, dtype) for p in paths]
    first = srcs[0]
    for s in srcs[1:]:
        if s.vocab != first.vocab or not same_tokenizer(s.tokenizer, first.tokenizer):
            raise ValueError(f"data: {s.path} was tokenised with {tokenizer_kind(s.tokenizer)} ({s.vocab} ids) but "
                             f"{first.path} with {tokenizer_kind(first.tokenizer)} ({first.vocab} ids), and a mixture "
                             f"needs one tokenizer; fix: tokenise {s.path}'s text again with "
                             f"boostjax tokenize --tokenizer {first.path} ...")
    mix = tuple(Part(n, w / total, s) for n, w, s in zip(_part_names(paths), weights, srcs))
    return Source("mixture", data, first.dtype, first.vocab, True, None, mix)


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"))


def _check_kind(path: str, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
        return
    kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
    raise ValueError(
        f"data: {path} is {kind}, not a file or folder; fix: pass --data with a text file, a folder of text "
        f"files or a .bin token file (write the stream to a file first)"
    )


def _signature(path: str, st: os.stat_result) -> tuple:
    """What changes when the files a source is resolved from change (a folder: the files of a
    tokenised folder too, present or not, and its shards)."""
    def sig(s: os.stat_result) -> tuple:
        return s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns

    parts: list[Any] = [sig(st)]
    if stat.S_ISDIR(st.st_mode):
        try:
            shards = {n for n in os.listdir(path) if is_folder_file(n)}
        except OSError:
            shards = set()
        for name in sorted(FOLDER_FILES | shards):
            try:
                parts.append(sig(os.stat(os.path.join(path, name))))
            except OSError:
                parts.append(None)
    return tuple(parts)


def _tokenize_first(path: str, what: str, data: str) -> ValueError:
    return ValueError(f"data: {path} holds {what}, not text; fix: boostjax tokenize --data {data} --out FOLDER, "
                      "then --data FOLDER")


def _check_text_file(path: str | os.PathLike, data: str) -> None:
    """A file read as text holds no records, compressed or binary bytes (`records.sniff`): those would
    be trained on as bytes. ValueError naming ``boostjax tokenize`` otherwise."""
    try:
        what = records.text_refusal(path)
    except OSError as e:
        raise _unreadable(path, e) from None
    if what:
        raise _tokenize_first(os.fspath(path), what, data)


def _check_text_folder(path: str) -> None:
    """A folder read as text: no record files (JSONL, Parquet, Arrow, a `datasets` folder) that its
    text reader would pass over, none of its text files binary, no half-written tokenize output."""
    names = os.listdir(path)
    left = sorted(n for n in names if n.startswith(TMP_PREFIX))
    if left and META_FILE not in names:
        raise ValueError(f"data: {path} holds the temporary files of an interrupted boostjax tokenize ({left[0]}) "
                         f"and no {META_FILE}; fix: run boostjax tokenize again with --out {path}")
    if records.is_hf_folder(path):
        raise _tokenize_first(path, "a Hugging Face datasets folder", path)
    held = records.record_files(path)
    if held:
        raise _tokenize_first(str(held[0]), records.text_refusal(held[0]) or "records", path)
    for f in text_files(path):
        _check_text_file(f, path)


BUILTIN = Source("builtin", "", "uint8", None, True)
_SOURCES: dict[tuple, Source] = {}
KEPT_SOURCES: int = 8  # sources kept per process (the oldest is dropped first)


def resolve_source(path: str | os.PathLike = "", dtype: str = "uint16", *, mixtures: bool = False) -> Source:
    """The `Source` that ``--data path`` (``--data-dtype dtype``, used by a ``.bin`` file) names.

    A mixture of tokenised folders (``A:0.7,B:0.3``, `parse_mixture`) is read by training alone
    (``mixtures``); anywhere else it is refused, one folder at a time. A path that is missing, unreadable, not a file or folder (a FIFO, a device), or a tokenised folder
    whose metadata does not match its files is a ValueError of one line. Nothing but ``meta.json`` is
    read; the contents are checked by `check_source` and read by `open_source`."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"data: need a path, got {path!r}; fix: pass --data PATH (or '' for the stdlib corpus)")
    path = os.fspath(path)
    if path == "":
        return BUILTIN
    mixture = parse_mixture(path)
    if mixture is not None:
        if not mixtures:
            raise ValueError(f"data: {path!r} is a mixture of tokenised folders, which only boostjax train reads; "
                             f"fix: pass one folder at a time (--data {mixture[0][0]})")
        return resolve_mixture(path, mixture, dtype)
    st = _stat(path)
    _check_kind(path, st)
    key = (os.path.abspath(path), path, dtype, _signature(path, st))
    if key in _SOURCES:
        return _SOURCES[key]
    if stat.S_ISDIR(st.st_mode):
        meta = token_meta(path)
        if meta is None:
            _check_text_folder(path)
        src = (Source("tokens", path, meta["dtype"], meta["vocab_size"], True, meta) if meta is not None
               else Source("folder", path, "uint8", None, True))
    elif path.endswith(".bin"):
        src = Source("bin", path, dtype, None, False)
    else:
        _check_text_file(path, path)
        src = Source("text", path, "uint8", None, False)
    while len(_SOURCES) >= KEPT_SOURCES:
        _SOURCES.pop(next(iter(_SOURCES)))
    _SOURCES[key] = src
    return src


def _vocab_error(what: Any, top: int, vocab_size: int, binary: bool) -> ValueError:
    alt = "or the --data-dtype the file was written with" if binary else "(byte-level text needs 256)"
    return ValueError(
        f"data: {what} holds token id {top} but model.vocab_size is {vocab_size}; "
        f"fix: pass --vocab-size {top + 1} or more {alt}"
    )


def check_source(src: Source, vocab_size: int) -> None:
    """Every token id of ``src`` is below ``vocab_size`` (ValueError, one line, otherwise): a tokenised
    folder's vocabulary from its metadata, a ``.bin`` file scanned once in chunks (and its size a whole
    number of ``dtype`` tokens); text is bytes, ids < 256, so it is read only when ``vocab_size < 256``."""
    byte_level = vocab_size >= ByteTokenizer.vocab_size
    if src.kind == "mixture":
        for part in src.parts:
            check_source(part.source, vocab_size)
    elif src.kind == "builtin" and not byte_level:
        c = stdlib_corpus()
        top = max(int(c.train.max()), int(c.val.max()))
        if top >= vocab_size:
            raise _vocab_error(src.name, top, vocab_size, False)
    elif src.kind == "tokens":
        err = vocab_error(src.path, src.meta, vocab_size)
        if err is not None:
            raise err
    elif src.kind == "folder" and not byte_level:
        for f in text_files(src.path):
            top = text_max(f)
            if top >= vocab_size:
                raise _vocab_error(f, top, vocab_size, False)
    elif src.kind == "bin":
        top = token_max(src.path, src.dtype)
        if top >= vocab_size:
            raise _vocab_error(src.path, top, vocab_size, True)
    elif src.kind == "text" and not byte_level:
        top = text_max(pathlib.Path(src.path))
        if top >= vocab_size:
            raise _vocab_error(src.path, top, vocab_size, False)


def _check_val_fraction(val_fraction: Any) -> None:
    if not (isinstance(val_fraction, (int, float)) and 0.0 < val_fraction < 1.0):
        raise ValueError(f"load_corpus: val_fraction must be in (0, 1), got {val_fraction}; fix: e.g. 0.02")


def open_source(src: Source, val_fraction: float = 0.02) -> Corpus | Mixture:
    """The train and validation streams of ``src`` (memory-mapped token files; text read as bytes; a
    tokenised folder's splits and a folder's files with their documents' offsets; a mixture's, one
    `Corpus` per folder)."""
    _check_val_fraction(val_fraction)
    if src.kind == "mixture":
        return Mixture(src.path, tuple((p.name, p.weight, open_source(p.source)) for p in src.parts))
    if src.kind == "builtin":
        return stdlib_corpus()
    if src.kind == "tokens":
        return token_folder_corpus(src.path, src.meta)
    if src.kind == "folder":
        return folder_corpus(src.path, val_fraction)
    if src.kind == "bin":
        return bin_corpus(src.path, src.dtype, val_fraction)
    return text_corpus(src.path, val_fraction)


def check_data(path: str, dtype: str, vocab_size: int) -> None:
    """Everything about ``--data`` that can be known before a run starts (no corpus is kept): it
    exists, is a readable file or folder, a ``.bin`` file holds whole ``dtype`` tokens, and every
    token id is below ``vocab_size`` (`resolve_source`, then `check_source`). ValueError (one line)."""
    check_source(resolve_source(path, dtype), vocab_size)


def load_corpus(path: str = "", dtype: str = "uint16", val_fraction: float = 0.02,
                vocab_size: int | None = None) -> Corpus:
    """Load ``""`` (stdlib), a ``.bin`` token file (memmap), a text file, a directory of text files or a
    tokenised folder (``boostjax tokenize``; its metadata gives the dtype, ``dtype`` is not used).

    With ``vocab_size``, a token id >= ``vocab_size`` anywhere in the data is an error here, at load
    (a ``.bin`` file is scanned once, in chunks), rather than at the step that reads it."""
    _check_val_fraction(val_fraction)
    src = resolve_source(path, dtype)
    if vocab_size is not None:
        check_source(src, vocab_size)
    return open_source(src, val_fraction)


# ----------------------------------------------------------------------------- the run's tokenizer


def check_run_tokenizer(run_dir: str | os.PathLike, src: Source, resuming: bool) -> None:
    """A resumed run keeps its tokenizer: a tokenised folder whose tokenizer differs from the one in
    the run folder (``tokenizer.json``, or byte level without one) is refused."""
    if not resuming or src.tokenizer is None:
        return
    if src.kind == "mixture":
        src = src.parts[0].source
    tok = src.tokenizer
    run_tok = load_tokenizer(run_dir)
    if not same_tokenizer(tok, run_tok):
        raise ConfigError(f"train.data: {src.path} was tokenised with {tokenizer_kind(tok)} but the checkpoints in "
                          f"{run_dir} were trained with {tokenizer_kind(run_tok)}; fix: tokenise the text with the "
                          f"run's tokenizer (boostjax tokenize --tokenizer {run_dir} ...), or pass another --out for "
                          "a new run")


def install_run_tokenizer(run_dir: str | os.PathLike, src: Source) -> None:
    """Copy a tokenised folder's ``tokenizer.json`` into the run folder (atomically), so that
    ``load_tokenizer(run_dir)`` gives the run's tokenizer; byte-level data leaves none there (a
    mixture's folders share theirs)."""
    if src.kind == "mixture":
        src = src.parts[0].source
    if src.kind != "tokens":
        return
    dst = pathlib.Path(run_dir) / TOKENIZER_FILE
    if src.meta["tokenizer"] == "byte":
        dst.unlink(missing_ok=True)
        return
    tmp = dst.with_name(TOKENIZER_FILE + ".tmp")
    shutil.copyfile(pathlib.Path(src.path) / src.meta["tokenizer"], tmp)
    os.replace(tmp, dst)
