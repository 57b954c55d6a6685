"""`boostjax tokenize`: text in, a tokenised data folder out, which `boostjax train --data` reads.

    boostjax tokenize --tokenizer train:4096 --data my_texts/ --out data/my_texts

Documents: a folder gives one document per ``*.txt``/``*.md``/``*.py`` file (sorted by relative path,
as `boostjax.data` reads folders); a single file gives one document per blank-line-separated block
(``--doc-sep blank``, the default for a file), per non-empty line (``line``) or the whole file
(``file``). Documents that are empty or only whitespace are skipped; text must be UTF-8.

Split: document ``i`` (in that order) is held out for validation iff ``i % val_every == val_every - 1``
(every 50th by default, like the built-in corpus); with fewer than ``val_every`` documents the last one
is. A trained tokenizer (``train:VOCAB``) sees the training documents only.

The folder (read back by `boostjax.data.token_folder`): ``meta.json``, ``tokenizer.json`` (unless
byte level), ``train.bin`` / ``val.bin`` (raw ids; every document is followed by the tokenizer's
end-of-document id, or by the bytes ``"\\n\\n"`` at byte level) and ``train.docs.npy`` / ``val.docs.npy``
(int64 start offsets). ``bytes`` per split counts the UTF-8 bytes its tokens stand for (the documents and,
at byte level, their separators; an end-of-document token stands for none), so bits per byte are
comparable between tokenizers. ``fingerprint`` in ``meta.json`` is the content of the four token files
(`boostjax.data.fingerprint`), hashed as they are written. Everything is written under temporary names and renamed into place with
``meta.json`` last: a crash never leaves a ``meta.json`` describing incomplete files.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Callable, Iterable, Iterator

import blake3
import numpy as np
from tqdm.auto import tqdm

from boostjax.config import ConfigError
from boostjax.data import corpus, fingerprint
from boostjax.data.source import resolve_source
from boostjax.data.token_folder import (
    FINGERPRINT_FILES,
    FOLDER_FILES,
    META_FILE,
    SPLITS,
    TOKENS_FORMAT,
    TOKENS_VERSION,
    is_token_folder,
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
VAL_EVERY: int = corpus.VAL_EVERY
BATCH_CHARS: int = 1 << 22  # characters per encode_batch call (the Rust side encodes a batch in parallel)
BATCH_DOCS: int = 4096
PROGRESS_BYTES: int = 16 << 20  # a progress bar from this much input on
MAX_TRAINED_VOCAB: int = 1 << 20
BYTE_SEP: bytes = corpus.FILE_SEP  # b"\n\n" after every document at byte level
OUTPUT_FILES: frozenset[str] = FOLDER_FILES
TMP_PREFIX = ".tokenize-"
_BLANK = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")


def _err(what: str) -> ConfigError:
    return ConfigError(f"tokenize.{what}")


# ----------------------------------------------------------------------------- documents


def input_files(data: str | os.PathLike) -> list[pathlib.Path]:
    """The text files of ``--data`` (a file, or a folder's text files sorted); one line if none."""
    path = os.fspath(data)
    if path == "":
        raise _err("data: no input given; fix: pass --data with a text file or a folder of text files")
    if "\0" not in path and not os.path.lexists(path):
        raise _err(f"data: no such file or folder: {path!r}; fix: pass --data with a text file or a folder of text "
                   "files")
    try:
        src = resolve_source(path)  # the same one-line messages as boostjax train --data
        if src.kind == "folder":
            files = corpus.text_files(path)
    except ValueError as e:
        if is_token_folder(path):  # damaged, but a tokenised folder all the same
            raise _err(f"data: {path} is already a tokenised folder; fix: pass the text it was made from") from None
        raise ConfigError(str(e).replace("data:", "tokenize.data:", 1)) from None
    if src.kind == "tokens":
        raise _err(f"data: {path} is already a tokenised folder; fix: pass the text it was made from")
    if src.kind == "folder":
        if not files:
            raise _err(f"data: no {'/'.join('*' + s for s in corpus.TEXT_SUFFIXES)} files under {path}; "
                       "fix: pass a folder of text files or a text file")
    elif src.kind == "bin":
        raise _err(f"data: {path} looks like token ids (.bin), not text; fix: pass the text files, or train "
                   f"on it directly with boostjax train --data {path}")
    else:
        files = [pathlib.Path(path)]
    if not any(f.stat().st_size for f in files):
        raise _err(f"data: {path} holds no text ({len(files)} empty file{'s' * (len(files) > 1)}); "
                   "fix: pass a file or folder with text in it")
    return files


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


def documents(files: Iterable[pathlib.Path], doc_sep: str) -> Iterator[str]:
    for f in files:
        yield from split_documents(_read_text(f), doc_sep)


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
    if isinstance(tok, ByteTokenizer):
        return [tok.encode(d) for d in docs]
    return tok.encode_batch(docs)


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
    ours = (p / META_FILE).is_file() and is_token_folder(p) and not names - mine - OUTPUT_FILES
    if not ours:
        raise _err(f"out: {p} is not empty and is not an earlier boostjax tokenize output; fix: pass a new or empty "
                   "folder to --out (boostjax never overwrites files it did not write)")
    return True


class _Writer:
    """Token ids and document offsets of one split, appended to temporary files in the output folder
    and hashed as they are written (the folder's fingerprint costs no second read)."""

    def __init__(self, folder: pathlib.Path, name: str, dtype: str):
        self.name, self.dtype = name, np.dtype(dtype)
        self.tmp = folder / f"{TMP_PREFIX}{os.getpid()}-{name}.bin"
        self.f = open(self.tmp, "wb")
        self.starts: list[int] = []
        self.tokens = self.bytes = 0
        self.hash = blake3.blake3()

    def add(self, ids: np.ndarray, sep: np.ndarray, n_bytes: int) -> None:
        self.starts.append(self.tokens)
        for part in (ids.astype(self.dtype).tobytes(), sep.astype(self.dtype).tobytes()):
            self.f.write(part)
            self.hash.update(part)
        self.tokens += len(ids) + len(sep)
        self.bytes += n_bytes

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()

    def meta(self) -> dict:
        return {"file": f"{self.name}.bin", "docs_file": f"{self.name}.docs.npy", "documents": len(self.starts),
                "tokens": self.tokens, "bytes": self.bytes}


def _progress(total: int, show: bool, desc: str):
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, dynamic_ncols=True,
                disable=not show or total < PROGRESS_BYTES)


def tokenize_corpus(data: str | os.PathLike, out: str | os.PathLike, tokenizer: str | Tokenizer = "byte", *,
                    doc_sep: str | None = None, val_every: int = VAL_EVERY, progress: bool = True,
                    log: Callable[[str], None] | None = None) -> dict:
    """Tokenise the text at ``data`` into the folder ``out`` and return its metadata (``meta.json``).

    ``tokenizer``: 'byte' (UTF-8 bytes), a ``tokenizer.json`` file or a folder holding one, a tokenizer
    from `boostjax.data.tokenizers`, or 'train:VOCAB' (a byte-level BPE trained on the training documents).
    ``doc_sep``: how a file splits into documents, 'file', 'blank' or 'line' (default: 'file' for a
    folder, 'blank' for a single file). Bad input is refused (`ConfigError`, one line) before anything
    is written; ``out`` may be new, empty, or an earlier output of this function (replaced)."""
    if doc_sep is None:
        doc_sep = "file" if os.path.isdir(os.fspath(data)) else "blank"
    if doc_sep not in DOC_SEPS:
        raise _err(f"doc_sep: unknown {doc_sep!r}; fix: pass --doc-sep {', '.join(DOC_SEPS)}")
    if isinstance(val_every, bool) or not isinstance(val_every, int) or val_every < 2:
        raise _err(f"val_every: must be an integer >= 2, got {val_every!r}; fix: pass e.g. --val-every 50")
    tok, train_vocab = parse_tokenizer(tokenizer)
    files = input_files(data)
    replacing = check_out(out)
    say = log or (lambda s: None)

    total_bytes = sum(f.stat().st_size for f in files)
    n_docs = 0
    with _progress(total_bytes, progress, "reading") as bar:
        for f in files:
            n_docs += len(split_documents(_read_text(f), doc_sep))
            bar.update(f.stat().st_size)
    if n_docs < 2:
        raise _err(f"data: {data} holds {n_docs} non-empty document{'s' * (n_docs != 1)} (--doc-sep {doc_sep}) and "
                   "needs 2 or more (one is held out for validation); fix: pass more text"
                   + (", or --doc-sep line" if doc_sep != "line" else ""))
    if tok is None:
        say(f"training a {train_vocab}-token byte-level BPE on the training documents")
        tok = train_tokenizer((d for i, d in enumerate(documents(files, doc_sep)) if not is_val(i, n_docs, val_every)),
                              train_vocab)
    sep, sep_bytes, dtype = separator(tok), separator_bytes(tok), token_dtype(tok)

    folder = pathlib.Path(out)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    writers: dict[str, _Writer] = {}
    tmp_files: list[pathlib.Path] = []
    try:
        for s in SPLITS:
            tmp_files.append(folder / f"{TMP_PREFIX}{os.getpid()}-{s}.bin")
            writers[s] = _Writer(folder, s, dtype)
        i = 0
        with _progress(total_bytes, progress, "tokenizing") as bar:
            for batch in _batches(documents(files, doc_sep)):
                for d, ids in zip(batch, encode_documents(tok, batch)):
                    n = len(d.encode("utf-8"))
                    writers["val" if is_val(i, n_docs, val_every) else "train"].add(ids, sep, n + sep_bytes)
                    bar.update(n)
                    i += 1
        digests: dict[str, str] = {}
        for w in writers.values():
            w.close()
            docs_tmp = folder / f"{TMP_PREFIX}{os.getpid()}-{w.name}.docs.npy"
            tmp_files.append(docs_tmp)
            with open(docs_tmp, "wb") as f:
                np.save(f, np.asarray(w.starts, dtype=np.int64), allow_pickle=False)
            digests[f"{w.name}.bin"] = w.hash.hexdigest()
            digests[f"{w.name}.docs.npy"] = blake3.blake3(docs_tmp.read_bytes()).hexdigest()
        kind = "byte" if isinstance(tok, ByteTokenizer) else TOKENIZER_FILE
        meta = {"format": TOKENS_FORMAT, "version": TOKENS_VERSION, "tokenizer": kind, "dtype": dtype,
                "vocab_size": int(tok.vocab_size), "eos_id": getattr(tok, "eos_id", None),
                "bos_id": getattr(tok, "bos_id", None), "source": str(pathlib.Path(data).absolute()),
                "splits": {s: w.meta() for s, w in writers.items()},
                "fingerprint": fingerprint.of_digests((n, digests[n]) for n in FINGERPRINT_FILES)}
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
            os.replace(w.tmp, folder / f"{w.name}.bin")
            os.replace(folder / f"{TMP_PREFIX}{os.getpid()}-{w.name}.docs.npy", folder / f"{w.name}.docs.npy")
        if kind != "byte":
            os.replace(tok_tmp, folder / TOKENIZER_FILE)
        else:
            (folder / TOKENIZER_FILE).unlink(missing_ok=True)
        os.replace(meta_tmp, folder / META_FILE)
    except BaseException:
        for w in writers.values():
            w.close()
        for f in tmp_files:
            f.unlink(missing_ok=True)
        if created:
            try:
                folder.rmdir()  # only if nothing else is in it
            except OSError:
                pass
        raise
    for f in folder.iterdir():  # temporary files of an earlier, interrupted run
        if f.name.startswith(TMP_PREFIX):
            f.unlink(missing_ok=True)
    if replacing:
        say(f"replaced the earlier tokenize output in {folder}")
    return meta
