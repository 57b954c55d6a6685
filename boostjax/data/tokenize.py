"""`boostjax tokenize`: text and records in, a tokenised data folder out, which `boostjax train --data` reads.

    boostjax tokenize --tokenizer train:4096 --data my_texts/ --out data/my_texts

Documents (files of a folder, blocks or lines of a file, records of JSONL / Parquet / Arrow) are read
once as a stream, checked, encoded by `workers` processes and written in order, so memory stays flat
and the output does not depend on the worker count. Document `i` is held out for validation iff
`i % val_every == val_every - 1`. The folder (`meta.json`, `tokenizer.json`, the split's shards and
document offsets, a content `fingerprint`) is written under temporary names, `meta.json` last. Detail:
docs/tokenised-data.md ("Speed", "The folder `boostjax tokenize` writes").
"""

from __future__ import annotations

import collections
import concurrent.futures
import glob
import json
import multiprocessing
import os
import pathlib
import re
import time
from typing import Any, Callable, Iterable, Iterator

import blake3
import numpy as np
from tokenizers import Tokenizer as _HFTok
from tqdm.auto import tqdm

from boostjax.config import ConfigError
from boostjax.data import corpus, fingerprint, records
from boostjax.data.source import TMP_PREFIX, _check_kind
from boostjax.data.token_folder import (
    FINGERPRINT_FILES,
    FOLDER_FILES,
    META_FILE,
    SPLITS,
    TOKENS_FORMAT,
    TOKENS_VERSION,
    is_folder_file,
    is_token_folder,
    shard_name,
)
from boostjax.data.tokenizers import (
    MIN_TRAINED_VOCAB,
    TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    train_tokenizer,
)
from boostjax.runs.folder import CONFIG, check_folder_path, describe_foreign

DOC_SEPS: tuple[str, ...] = ("file", "blank", "line")
TEXT_FIELD: str = "text"  # the JSONL key / Parquet, Arrow column of a record's text
VAL_EVERY: int = corpus.VAL_EVERY
BATCH_CHARS: int = 1 << 22  # characters per encode_batch call (the Rust side encodes a batch in parallel)
BATCH_DOCS: int = 4096
MIN_BATCH_CHARS: int = 1 << 17  # a batch is cut once the input has moved on and it holds this much
IN_FLIGHT: int = 2  # batches per worker dispatched and not yet written
PROGRESS_BYTES: int = 16 << 20  # a progress bar from this much input on
MAX_TRAINED_VOCAB: int = 1 << 20
BYTE_SEP: bytes = corpus.FILE_SEP  # b"\n\n" after every document at byte level
OUTPUT_FILES: frozenset[str] = FOLDER_FILES  # and the shards, train-00000.bin ... (`is_folder_file`)
SHARD_TOKENS: int = 1 << 27  # a shard is closed at the first document end from this many tokens on
_BLANK = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")


def _err(what: str) -> ConfigError:
    return ConfigError(f"tokenize.{what}")


# ----------------------------------------------------------------------------- documents


def _one_path(path: str) -> None:
    """What ``--data`` must not be for tokenize (a tokenised folder, token ids, a FIFO), in one line."""
    if path == "":
        raise _err("data: no input given; fix: pass --data with text, JSONL, Parquet or Arrow files or folders")
    if "\0" in path:
        raise _err(f"data: {path!r} contains a NUL byte; fix: pass the path of a real file or folder")
    if not os.path.lexists(path):
        if glob.has_magic(path):
            return  # a glob, expanded by records.expand
        items = path.split(",")
        if len(items) > 1 and all(os.path.lexists(p) for p in items):
            raise _err(f"data: {path!r} is a comma-separated list; fix: give the paths separated by spaces, "
                       f"--data {' '.join(items)}")
        parts = [item.rsplit(":", 1)[0] for item in items]
        if ":" in path and all(p and os.path.lexists(p) for p in parts):
            name = pathlib.Path(parts[0]).name.split(".")[0] or "source"
            raise _err(f"data: {path!r} is a weighted mixture, which boostjax train reads from tokenised folders; fix: "
                       f"tokenise each source into its own folder (boostjax tokenize --data {parts[0]} --out "
                       f"{name}_tok, ...), then train --data {name}_tok:W1,...")
        raise _err(f"data: no such file or folder: {path!r}; fix: pass --data with a text file or a folder of text "
                   "files (or JSONL, Parquet, Arrow files)")
    if is_token_folder(path):
        raise _err(f"data: {path} is already a tokenised folder; fix: pass the text it was made from")
    try:
        _check_kind(path, os.stat(path))
    except OSError as e:
        raise _err(f"data: cannot read {path} ({e.strerror}); fix: check the file's permissions") from None
    except ValueError as e:
        raise ConfigError(str(e).replace("data:", "tokenize.data:", 1)) from None
    if os.path.isfile(path) and path.endswith(".bin"):
        raise _err(f"data: {path} looks like token ids (.bin), not text; fix: pass the text files, or train "
                   f"on it directly with boostjax train --data {path}")


def _paths(data) -> list[str]:
    if isinstance(data, (str, os.PathLike)):
        return [os.fspath(data)]
    return [os.fspath(d) for d in data] or [""]


def inputs(data) -> list[records.Input]:
    """The input files of ``--data PATH [PATH ...]`` (files, folders, globs) and how each is read (text,
    JSONL, Parquet, Arrow: `boostjax.data.records`); one line if there are none or they hold nothing."""
    paths = _paths(data)
    for path in paths:
        _one_path(path)
    try:
        found = records.expand(paths)
    except ValueError as e:
        raise ConfigError(str(e).replace("data:", "tokenize.data:", 1)) from None
    name = " ".join(paths)
    if not found:
        kinds = "/".join("*" + s for s in corpus.TEXT_SUFFIXES + records.RECORD_SUFFIXES)
        raise _err(f"data: no {kinds} files under {name}; fix: pass a folder of text or record files, or a file")
    if not any(i.path.stat().st_size for i in found):
        raise _err(f"data: {name} holds no text ({len(found)} empty file{'s' * (len(found) > 1)}); "
                   "fix: pass a file or folder with text in it")
    return found


def input_files(data: str | os.PathLike) -> list[pathlib.Path]:
    """The files of ``--data`` (a file, or a folder's text and record files sorted); one line if none."""
    return [i.path for i in inputs(data)]


def _read_text(f: pathlib.Path) -> str:
    try:
        raw = f.read_bytes()
    except OSError as e:
        raise _err(f"data: cannot read {f} ({e.strerror}); fix: check the file's permissions") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _err(f"data: {f} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}); fix: convert it "
                   "to UTF-8 (e.g. iconv -t UTF-8) or leave it out") from None


def split_documents(text: str, doc_sep: str) -> list[str]:
    """The documents of one file's text: whole, per blank-line-separated block, or per line;
    empty and whitespace-only ones dropped."""
    if doc_sep == "file":
        parts = [text]
    elif doc_sep == "blank":
        parts = _BLANK.split(text)
    else:
        parts = text.splitlines()
    return [d for d in parts if d.strip()]


def stream(found: Iterable[records.Input | pathlib.Path], doc_sep: str, text_field: str = TEXT_FIELD,
           on_bytes: Callable[[int], None] | None = None) -> Iterator[records.Document]:
    """Every document of the inputs in order, with where it is: a text file split by ``doc_sep``, a
    record file one document per record (`boostjax.data.records`; bad records carry ``bad``;
    ``on_bytes``: a JSONL file's bytes read so far, a chunk at a time)."""
    for inp in found:
        if isinstance(inp, pathlib.Path):
            inp = records.Input(inp, "text")
        if inp.format == "text":
            for k, d in enumerate(split_documents(_read_text(inp.path), doc_sep)):
                yield records.Document(d, f"{inp.path} document {k}")
        else:
            yield from records.documents(inp, text_field, on_bytes)


class Skipped:
    """The bad records ``--skip-bad`` left out: how many, and where the first few were."""

    SHOWN = 5

    def __init__(self) -> None:
        self.count, self.first = 0, []

    def add(self, doc: records.Document) -> None:
        self.count += 1
        if len(self.first) < self.SHOWN:
            self.first.append(f"{doc.where}: {doc.bad}")

    def meta(self) -> dict:
        return {"records": self.count, "first": self.first}


def _bad(doc: records.Document, offer_skip: bool) -> ConfigError:
    fix = doc.fix or ("pass --text-field with the key that holds the text" if doc.bad.startswith(("no field", "field"))
                      else "correct or remove that record")
    return _err(f"data: {doc.where}: {doc.bad}; fix: {fix}"
                + (", or pass --skip-bad to leave bad records out" if offer_skip else ""))


def texts(docs: Iterable[records.Document], skip_bad: bool = False, skipped: Skipped | None = None,
          offer_skip: bool = True) -> Iterator[str]:
    """The non-empty documents' text; a bad record is an error (one line; ``offer_skip``: naming
    ``--skip-bad``) or, with ``skip_bad``, counted in ``skipped``; a damaged file is an error either way."""
    try:
        for doc in docs:
            if doc.bad:
                if not skip_bad:
                    raise _bad(doc, offer_skip)
                if skipped is not None:
                    skipped.add(doc)
            elif doc.text and not doc.text.isspace():  # what strip() would leave non-empty, without the copy
                yield doc.text
    except ConfigError:
        raise
    except records.RecordError as e:
        raise ConfigError(str(e).replace("data:", "tokenize.data:", 1)) from None


def documents(files: Iterable[records.Input | pathlib.Path], doc_sep: str, text_field: str = TEXT_FIELD,
              skip_bad: bool = False, offer_skip: bool = True) -> Iterator[str]:
    """The non-empty documents of the inputs, in order (`stream`, then `texts`)."""
    yield from texts(stream(files, doc_sep, text_field), skip_bad, offer_skip=offer_skip)


def is_val(i: int, n_docs: int, val_every: int) -> bool:
    """Document ``i`` of ``n_docs`` is held out for validation (deterministic, by index)."""
    return i % val_every == val_every - 1 or (n_docs < val_every and i == n_docs - 1)


# ----------------------------------------------------------------------------- tokenizer and encoding


def parse_tokenizer(spec: str | Tokenizer) -> tuple[Tokenizer | None, int]:
    """(tokenizer, 0) for 'byte', a path or a tokenizer object; (None, VOCAB) for 'train:VOCAB'."""
    if isinstance(spec, (ByteTokenizer, HFTokenizer)):
        return spec, 0
    if not isinstance(spec, str):
        raise _err(f"tokenizer: need a path, 'byte' or 'train:VOCAB', got {spec!r}; fix: e.g. --tokenizer train:4096")
    if spec.startswith("train:"):
        v = spec[len("train:"):]
        if not (v.isascii() and v.isdigit()) or not MIN_TRAINED_VOCAB <= int(v) <= MAX_TRAINED_VOCAB:
            raise _err(f"tokenizer: cannot train a vocabulary of {v!r} tokens; fix: train:VOCAB with VOCAB an integer "
                       f"in [{MIN_TRAINED_VOCAB}, {MAX_TRAINED_VOCAB}], e.g. train:4096")
        return None, int(v)
    p = pathlib.Path(spec)
    if spec not in ("", "byte") and p.is_dir() and not (p / TOKENIZER_FILE).exists() and not _byte_level_folder(p):
        raise _err(f"tokenizer: {p} holds no {TOKENIZER_FILE}; fix: pass a tokenizer.json file or a folder holding one "
                   "(save a transformers tokenizer with save_pretrained), 'byte', or train:VOCAB")
    try:
        return load_tokenizer(spec), 0
    except ConfigError as e:
        raise ConfigError("tokenize." + str(e)) from None


def _byte_level_folder(p: pathlib.Path) -> bool:
    """A boostjax run folder or tokenised folder without tokenizer.json: byte level by construction."""

    return is_token_folder(p) or ((p / CONFIG).is_file() and describe_foreign(p) is None)


def separator(tok: Tokenizer) -> np.ndarray:
    """The ids that follow every document: the end-of-document id, or the encoding of "\\n\\n"."""
    eos = getattr(tok, "eos_id", None)
    if eos is not None:
        return np.asarray([eos], dtype=np.uint32)
    sep = np.asarray(tok.encode(BYTE_SEP.decode()), dtype=np.uint32)
    if not sep.size:
        raise _err(f"tokenizer: {tok.name} has no end-of-document token and encodes a blank line as nothing; fix: "
                   "use a tokenizer with an EOS token such as <|endoftext|> or </s>, or --tokenizer train:VOCAB")
    return sep


def separator_bytes(tok: Tokenizer) -> int:
    """UTF-8 bytes the separator stands for (0 for an end-of-document token)."""
    return 0 if getattr(tok, "eos_id", None) is not None else len(BYTE_SEP)


def token_dtype(tok: Tokenizer) -> str:
    return "uint8" if isinstance(tok, ByteTokenizer) else tok.dtype


def encode_documents(tok: Tokenizer, docs: list[str]) -> list[np.ndarray]:
    """The ids of each document (the `tokenizers` batch API's ``encode_batch_fast`` where it has it: the same
    ids, without the character offsets nothing here needs)."""
    if isinstance(tok, ByteTokenizer):
        return [tok.encode(d) for d in docs]
    fast = getattr(getattr(tok, "tok", None), "encode_batch_fast", None)
    if fast is None:
        return tok.encode_batch(docs)
    return [np.asarray(e.ids, dtype=np.uint32) for e in fast(docs, add_special_tokens=False)]


def _batches(docs: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for d in docs:
        batch.append(d)
        chars += len(d)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def default_workers() -> int:
    """All the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def encoded(tok: Tokenizer, batch: list[str], sep: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One batch of documents as written: the ids with ``sep`` after every document, each document's
    token count (its separator included) and UTF-8 byte count."""
    if isinstance(tok, ByteTokenizer) and batch:  # the batch's bytes in one encode, separators included
        sep_text = sep.astype(np.uint8).tobytes().decode("utf-8")
        flat = np.frombuffer((sep_text.join(batch) + sep_text).encode("utf-8"), np.uint8)
        n_bytes = np.fromiter((len(d) if d.isascii() else len(d.encode("utf-8")) for d in batch), np.int64, len(batch))
        return flat, n_bytes + len(sep), n_bytes
    ids = encode_documents(tok, batch)
    n_bytes = (np.fromiter((len(a) for a in ids), np.int64, len(ids)) if isinstance(tok, ByteTokenizer)
               else np.fromiter((len(d.encode("utf-8")) for d in batch), np.int64, len(batch)))
    n_tokens = np.fromiter((len(a) for a in ids), np.int64, len(ids)) + len(sep)
    flat = np.concatenate([x for a in ids for x in (a, sep)]).astype(dtype, copy=False) if ids else np.zeros(0, dtype)
    return flat, n_tokens, n_bytes


_WORKER: dict = {}


def _start_worker(tok_json: str, name: str, sep: np.ndarray, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _WORKER.update(tok=HFTokenizer(_HFTok.from_str(tok_json), name), sep=sep, dtype=dtype)


def _encode_in_worker(batch: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return encoded(_WORKER["tok"], batch, _WORKER["sep"], _WORKER["dtype"])


class _Encoder:
    """Batches encoded in order: in this process, or by ``workers`` processes with at most ``IN_FLIGHT``
    batches each dispatched and not yet collected (bounded memory whatever the corpus size)."""

    def __init__(self, tok: Tokenizer, sep: np.ndarray, dtype: str, workers: int):
        self.tok, self.sep, self.dtype = tok, sep, dtype
        self.pool = None
        self.pending: collections.deque = collections.deque()
        if workers > 1 and isinstance(tok, HFTokenizer):  # bytes encode faster than they can be shipped
            self.pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                initargs=(tok.tok.to_str(), tok.name, sep, dtype))
        self.limit = IN_FLIGHT * workers

    def put(self, batch: list[str], tag) -> Iterator[tuple]:
        """Dispatch a batch; yield ``(tag, encoded)`` of the batches done, in the order they were put."""
        if self.pool is None:
            yield tag, encoded(self.tok, batch, self.sep, self.dtype)
            return
        self.pending.append((tag, self.pool.submit(_encode_in_worker, batch)))
        while len(self.pending) >= self.limit:
            tag0, fut = self.pending.popleft()
            yield tag0, fut.result()

    def drain(self) -> Iterator[tuple]:
        while self.pending:
            tag0, fut = self.pending.popleft()
            yield tag0, fut.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


# ----------------------------------------------------------------------------- output folder


def check_out(out: str | os.PathLike) -> bool:
    """``--out`` may be written: new, empty, or a previous tokenize output (True: it will be replaced).
    Anything else (a user's files, a run folder) is refused."""

    p = pathlib.Path(out)
    if not str(out).strip():
        raise _err("out: no output folder given; fix: pass --out DIR")
    if not check_folder_path(p, "tokenize.out"):
        return False
    names = {q.name for q in p.iterdir()}
    mine = {n for n in names if n.startswith(TMP_PREFIX)}
    if not names - mine:
        return False
    ours = (p / META_FILE).is_file() and is_token_folder(p) and all(is_folder_file(n) for n in names - mine)
    if not ours:
        raise _err(f"out: {p} is not empty and is not an earlier boostjax tokenize output; fix: pass a new or empty "
                   "folder to --out (boostjax never overwrites files it did not write)")
    return True


class _Writer:
    """Token ids and document offsets of one split, appended to temporary shard files in the output
    folder (a shard is closed after the document that brings it to ``shard_tokens`` tokens) and hashed
    as one stream as they are written (the folder's fingerprint costs no second read)."""

    def __init__(self, folder: pathlib.Path, name: str, dtype: str, shard_tokens: int):
        self.folder, self.name, self.dtype, self.shard_tokens = folder, name, np.dtype(dtype), shard_tokens
        self.tmps: list[pathlib.Path] = []  # the shards' temporary files, in order
        self.counts: list[int] = []  # their tokens
        self.f = None
        self.starts: list[np.ndarray] = []
        self.tokens = self.bytes = self.docs = 0
        self.hash = blake3.blake3()

    def add(self, flat: np.ndarray, n_tokens: np.ndarray, n_bytes: np.ndarray) -> None:
        """Documents as `encoded` gives them (ids and separators, per-document token and byte counts)."""
        if not len(n_tokens):
            return
        self.starts.append(self.tokens + np.concatenate(([0], np.cumsum(n_tokens[:-1]))))
        self.docs += len(n_tokens)
        data = np.ascontiguousarray(flat, dtype=self.dtype)
        self.hash.update(data.view(np.uint8))
        ends = np.cumsum(n_tokens)  # where each document ends in `data`
        lo = 0
        while lo < len(data):
            if self.f is None:
                self.tmps.append(self.folder / f"{TMP_PREFIX}{os.getpid()}-{shard_name(self.name, len(self.tmps))}")
                self.counts.append(0)
                self.f = open(self.tmps[-1], "wb")
            j = int(np.searchsorted(ends, lo + self.shard_tokens - self.counts[-1]))  # the document that fills it
            hi = int(ends[min(j, len(ends) - 1)])
            self.f.write(data[lo:hi])
            self.counts[-1] += hi - lo
            if j < len(ends):
                self.f.close()
                self.f = None
            lo = hi
        self.tokens += int(n_tokens.sum())
        self.bytes += int(n_bytes.sum())

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None

    def meta(self) -> dict:
        return {"shards": [{"file": shard_name(self.name, i), "tokens": n} for i, n in enumerate(self.counts)],
                "docs_file": f"{self.name}.docs.npy", "documents": self.docs, "tokens": self.tokens,
                "bytes": self.bytes}


def _source(paths: list[str]) -> str | list[str]:
    """``meta.json``'s ``source``: the input's absolute path (a list for several)."""
    full = [str(pathlib.Path(p).absolute()) for p in paths]
    return full[0] if len(full) == 1 else full


def _progress(total: int, show: bool, desc: str):
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, dynamic_ncols=True,
                disable=not show or total < PROGRESS_BYTES)


def _enough(n_docs: int, name: str, held: list, doc_sep: str) -> None:
    if n_docs < 2:
        raise _err(f"data: {name} holds {n_docs} non-empty document{'s' * (n_docs != 1)}"
                   + ("" if held else f" (--doc-sep {doc_sep})") + " and needs 2 or more (one is held out for "
                   "validation); fix: pass more text" + (", or --doc-sep line" if doc_sep != "line" and not held
                                                         else ""))


def _read_all(files: list[records.Input], doc_sep: str, text_field: str, skip_bad: bool, skipped: Skipped,
              bar) -> int:
    """Count the non-empty documents, checking every record (a bar of the input bytes read)."""
    n_docs = 0
    with bar:
        for inp in files:
            done = [0]  # the bytes of this file the bar has counted (a JSONL file's while it is read)

            def count(n: int) -> None:
                done[0] += n
                bar.update(n)

            for _ in texts(stream([inp], doc_sep, text_field, count), skip_bad, skipped):
                n_docs += 1
            bar.update(inp.path.stat().st_size - done[0])
    return n_docs


class _Splitter:
    """Documents in order to the train or val writer: document ``i`` is held out iff `is_val`. The total is
    not known while streaming, so among the first ``val_every`` the latest is kept back until the next
    arrives: the last of fewer than ``val_every`` documents goes to val."""

    def __init__(self, train: _Writer, val: _Writer, val_every: int, sep_bytes: int):
        self.train, self.val, self.every, self.sep_bytes = train, val, val_every, sep_bytes
        self.i, self.kept = 0, None

    def add(self, flat: np.ndarray, n_tokens: np.ndarray, n_bytes: np.ndarray) -> None:
        n_bytes = n_bytes + self.sep_bytes
        ends = np.cumsum(n_tokens)
        k = 0
        while k < len(n_tokens) and self.i < self.every:
            one = (flat[ends[k] - n_tokens[k]:ends[k]], n_tokens[k:k + 1], n_bytes[k:k + 1])
            if self.kept is not None:
                self.train.add(*self.kept)
                self.kept = None
            if self.i == self.every - 1:
                self.val.add(*one)
            else:
                self.kept = one
            self.i, k = self.i + 1, k + 1
        if k == len(n_tokens):
            return
        val = (self.i + np.arange(len(n_tokens) - k)) % self.every == self.every - 1
        rest = flat[ends[k - 1] if k else 0:]
        per_token = np.repeat(val, n_tokens[k:])
        self.train.add(rest[~per_token], n_tokens[k:][~val], n_bytes[k:][~val])
        self.val.add(rest[per_token], n_tokens[k:][val], n_bytes[k:][val])
        self.i += len(n_tokens) - k

    def finish(self) -> None:
        if self.kept is not None:
            self.val.add(*self.kept)
            self.kept = None


def _encode_all(files: list[records.Input], doc_sep: str, text_field: str, skip_bad: bool, skipped: Skipped,
                encoder: _Encoder, splitter: _Splitter, bar, total_bytes: int) -> int:
    """Stream, check, encode and write every document in order; the bar counts the input bytes whose
    documents are written, with tokens/s. Returns the number of documents."""
    read = [0]  # input bytes whose complete documents have been handed out
    shown, tokens, t0 = [0], [0], time.perf_counter()

    def write(done: Iterator[tuple]) -> None:
        for pos, (flat, n_tokens, n_bytes) in done:
            splitter.add(flat, n_tokens, n_bytes)
            tokens[0] += len(flat)
            bar.update(pos - shown[0])
            shown[0] = pos
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(f"{tokens[0] / max(time.perf_counter() - t0, 1e-9) / 1e6:.2f}M tokens/s",
                                    refresh=False)

    def count(n: int) -> None:
        read[0] += n

    n_docs, batch, chars, mark = 0, [], 0, 0
    for inp in files:
        start = read[0]
        for d in texts(stream([inp], doc_sep, text_field, count), skip_bad, skipped):
            if batch and ((read[0] > mark and chars >= MIN_BATCH_CHARS) or chars >= BATCH_CHARS
                          or len(batch) >= BATCH_DOCS):
                write(encoder.put(batch, read[0]))
                batch, chars = [], 0
            if not batch:
                mark = read[0]
            batch.append(d)
            chars += len(d)
            n_docs += 1
        read[0] = start + inp.path.stat().st_size
    if batch:
        write(encoder.put(batch, total_bytes))
    write(encoder.drain())
    bar.update(total_bytes - shown[0])
    return n_docs


def tokenize_corpus(data, out: str | os.PathLike, tokenizer: str | Tokenizer = "byte", *,
                    doc_sep: str | None = None, val_every: int = VAL_EVERY, progress: bool = True,
                    log: Callable[[str], None] | None = None, text_field: str = TEXT_FIELD,
                    skip_bad: bool = False, workers: int | None = None, shard_tokens: int = SHARD_TOKENS) -> dict:
    """Tokenise ``data`` (a path or a list of paths, folders or globs: text, JSONL, Parquet, Arrow,
    `boostjax.data.records`) into the folder ``out`` and return its metadata (``meta.json``).

    ``tokenizer``: 'byte' (UTF-8 bytes), a ``tokenizer.json`` file or a folder holding one, a tokenizer
    from `boostjax.data.tokenizers`, or 'train:VOCAB' (a byte-level BPE trained on the training documents).
    ``doc_sep``: how a text file splits into documents, 'file', 'blank' or 'line' (default: 'file' for a
    folder or several paths, 'blank' for a single file); a record is always one document, its text the
    ``text_field`` key or column. Bad input is refused (`ConfigError`, one line): arguments and files before
    anything is written, a bad record (unless ``skip_bad``: then counted in ``meta["skipped"]``) when the
    single streaming pass meets it, removing what it wrote; ``out`` may be new, empty, or an earlier output
    of this function (replaced). ``workers``: processes that encode with a `tokenizers` tokenizer (default:
    all cores); the output is the same for any number. ``shard_tokens``: a split's shard file is closed
    at the first document end from this many tokens on (`_Writer`). The workers are started with multiprocessing's
    ``spawn`` (no fork of a process that may run JAX threads), so a script calling this at its top level
    needs the usual ``if __name__ == "__main__":`` guard."""
    paths = _paths(data)
    _check_args(doc_sep, val_every, text_field, workers, shard_tokens)
    tok, train_vocab = parse_tokenizer(tokenizer)
    files = inputs(paths)
    held = [i.path for i in files if i.format != "text"]
    doc_sep = _doc_sep(doc_sep, paths, files, held)
    replacing = check_out(out)
    say = log or (lambda s: None)

    total_bytes = sum(i.path.stat().st_size for i in files)
    name = " ".join(paths)
    skipped = Skipped()
    if tok is None:  # a first pass: the documents counted and checked, then the tokenizer trained on them
        n_docs = _read_all(files, doc_sep, text_field, skip_bad, skipped, _progress(total_bytes, progress, "checking"))
        _enough(n_docs, name, held, doc_sep)
        say(f"training a {train_vocab}-token byte-level BPE on the training documents")
        tok = train_tokenizer((d for i, d in enumerate(texts(stream(files, doc_sep, text_field), skip_bad))
                               if not is_val(i, n_docs, val_every)), train_vocab)
        skipped = Skipped()  # counted again as they are encoded
    sep, sep_bytes, dtype = separator(tok), separator_bytes(tok), token_dtype(tok)

    folder = pathlib.Path(out)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    writers: dict[str, _Writer] = {}
    tmp_files: list[pathlib.Path] = []
    try:
        for s in SPLITS:
            writers[s] = _Writer(folder, s, dtype, shard_tokens)
        splitter = _Splitter(writers["train"], writers["val"], val_every, sep_bytes)
        encoder = _Encoder(tok, sep, dtype, default_workers() if workers is None else workers)
        try:  # one pass: every record checked as it is encoded and written (a bad one removes the files)
            with _progress(total_bytes, progress, "reading") as bar:
                n_docs = _encode_all(files, doc_sep, text_field, skip_bad, skipped, encoder, splitter, bar,
                                     total_bytes)
        finally:
            encoder.close()
        splitter.finish()
        _enough(n_docs, name, held, doc_sep)
        if skipped.count:
            say(f"skipped {skipped.count} bad record{'s' * (skipped.count > 1)} (--skip-bad), the first: "
                + "; ".join(skipped.first))
        digests = _close_splits(folder, writers, tmp_files)
        kind = "byte" if isinstance(tok, ByteTokenizer) else TOKENIZER_FILE
        meta = {"format": TOKENS_FORMAT, "version": TOKENS_VERSION, "tokenizer": kind, "dtype": dtype,
                "vocab_size": int(tok.vocab_size), "eos_id": getattr(tok, "eos_id", None),
                "bos_id": getattr(tok, "bos_id", None), "source": _source(paths),
                "splits": {s: w.meta() for s, w in writers.items()},
                "fingerprint": fingerprint.of_digests((n, digests[n]) for n in FINGERPRINT_FILES),
                **({"text_field": text_field} if held else {}), **({"skipped": skipped.meta()} if skip_bad else {})}
        _commit(folder, writers, tok, kind, meta, tmp_files)
    except BaseException:
        _abort(folder, writers, tmp_files, created)
        raise
    _remove_left(folder, say)
    if replacing:
        say(f"replaced the earlier tokenize output in {folder}")
    return meta


def _check_args(doc_sep: str | None, val_every: Any, text_field: Any, workers: Any, shard_tokens: Any) -> None:
    """One-line `ConfigError`s for `tokenize_corpus`'s arguments, before any file is read."""
    if doc_sep is not None and doc_sep not in DOC_SEPS:
        raise _err(f"doc_sep: unknown {doc_sep!r}; fix: pass --doc-sep {', '.join(DOC_SEPS)}")
    if isinstance(val_every, bool) or not isinstance(val_every, int) or val_every < 2:
        raise _err(f"val_every: must be an integer >= 2, got {val_every!r}; fix: pass e.g. --val-every 50")
    if not isinstance(text_field, str) or not text_field:
        raise _err(f"text_field: need a key or column name, got {text_field!r}; fix: pass e.g. --text-field text")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise _err(f"workers: must be an integer >= 1, got {workers!r}; fix: pass e.g. --workers "
                   f"{default_workers()} (all cores)")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise _err(f"shard_tokens: must be an integer >= 1, got {shard_tokens!r}; fix: pass e.g. --shard-tokens "
                   f"{SHARD_TOKENS} (the default)")


def _doc_sep(doc_sep: str | None, paths: list[str], files: list, held: list[pathlib.Path]) -> str:
    """The document separator of text files: the given one (refused where the input holds records), else
    'file' for a folder or several paths, 'blank' for a single file."""
    if held and doc_sep in ("blank", "line"):
        raise _err(f"doc_sep: {held[0]} holds records, and each record is one document; fix: drop --doc-sep "
                   f"{doc_sep} (it splits text files only)")
    if doc_sep is None:
        doc_sep = "file" if len(paths) > 1 or os.path.isdir(paths[0]) or len(files) > 1 else "blank"
    return doc_sep


def _close_splits(folder: pathlib.Path, writers: dict[str, _Writer], tmp_files: list[pathlib.Path]) -> dict[str, str]:
    """Close every split's writer, save its document offsets under a temporary name (added to
    `tmp_files`) and return the digests of each split's stream and offsets."""
    digests: dict[str, str] = {}
    for w in writers.values():
        w.close()
        docs_tmp = folder / f"{TMP_PREFIX}{os.getpid()}-{w.name}.docs.npy"
        tmp_files.append(docs_tmp)
        with open(docs_tmp, "wb") as f:
            np.save(f, np.concatenate(w.starts or [np.zeros(0, np.int64)]).astype(np.int64), allow_pickle=False)
        digests[f"{w.name}.bin"] = w.hash.hexdigest()
        digests[f"{w.name}.docs.npy"] = blake3.blake3(docs_tmp.read_bytes()).hexdigest()
    return digests


def _commit(folder: pathlib.Path, writers: dict[str, _Writer], tok: Any, kind: str, meta: dict,
            tmp_files: list[pathlib.Path]) -> None:
    """Rename the temporary files into place, `meta.json` last (the old one first marked incomplete),
    and remove an earlier output's token files this one has not."""
    tok_tmp = folder / f"{TMP_PREFIX}{os.getpid()}-{TOKENIZER_FILE}"
    if kind != "byte":
        tmp_files.append(tok_tmp)
        tok.tok.save(str(tok_tmp))
    meta_tmp = folder / f"{TMP_PREFIX}{os.getpid()}-{META_FILE}"
    tmp_files.append(meta_tmp)
    meta_tmp.write_text(json.dumps(meta, indent=2) + "\n")
    # commit: the old metadata is first marked incomplete, the new one comes last
    if (folder / META_FILE).exists():
        stub = folder / f"{TMP_PREFIX}{os.getpid()}-stub.json"
        tmp_files.append(stub)
        stub.write_text(json.dumps({"format": TOKENS_FORMAT, "version": TOKENS_VERSION, "incomplete": True}))
        os.replace(stub, folder / META_FILE)
    for w in writers.values():
        for i, tmp in enumerate(w.tmps):
            os.replace(tmp, folder / shard_name(w.name, i))
        os.replace(folder / f"{TMP_PREFIX}{os.getpid()}-{w.name}.docs.npy", folder / f"{w.name}.docs.npy")
    written = {shard_name(w.name, i) for w in writers.values() for i in range(len(w.tmps))}
    for f in folder.iterdir():  # an earlier output's token files this one has not (more shards, a train.bin)
        if f.name.endswith(".bin") and is_folder_file(f.name) and f.name not in written:
            f.unlink()
    if kind != "byte":
        os.replace(tok_tmp, folder / TOKENIZER_FILE)
    else:
        (folder / TOKENIZER_FILE).unlink(missing_ok=True)
    os.replace(meta_tmp, folder / META_FILE)


def _abort(folder: pathlib.Path, writers: dict[str, _Writer], tmp_files: list[pathlib.Path], created: bool) -> None:
    """After a failure: close the writers, remove every temporary file, and the folder if this call made it
    and nothing else is in it."""
    for w in writers.values():
        w.close()
    for f in tmp_files + [t for w in writers.values() for t in w.tmps]:
        f.unlink(missing_ok=True)
    if created:
        try:
            folder.rmdir()  # only if nothing else is in it
        except OSError:
            pass


def _remove_left(folder: pathlib.Path, say: Callable[[str], None]) -> None:
    """Remove the temporary files an earlier, interrupted run left in `folder`."""
    left = [f for f in folder.iterdir() if f.name.startswith(TMP_PREFIX)]
    for f in left:
        f.unlink(missing_ok=True)
    if left:
        say(f"removed {len(left)} temporary file{'s' * (len(left) > 1)} an interrupted earlier tokenize left in "
            f"{folder} ({left[0].name}{', ...' if len(left) > 1 else ''})")
