"""Corpus records in, one document at a time: JSONL (plain, ``.gz``, ``.zst``), Parquet, Arrow files or a
Hugging Face `datasets` folder (``save_to_disk``), and text; `sniff` tells them apart by their first bytes.

Every reader is a streaming iterator (a JSONL file a line at a time, Parquet and Arrow a record batch at
a time, only the text column) of `Document` s carrying where they came from (file and line, or row), so
that an error names them. A record that cannot be read (bad JSON, a missing, null or non-string field) is
a `Document` with ``bad`` set; a damaged file (truncated, corrupt) is a `RecordError`.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import pathlib
import re
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from boostjax.data.corpus import TEXT_SUFFIXES

INSTALL_HINT = "pip install 'boostjax[data]'"
JSONL_SUFFIXES: tuple[str, ...] = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson")
PARQUET_SUFFIXES: tuple[str, ...] = (".parquet",)
ARROW_SUFFIXES: tuple[str, ...] = (".arrow",)
RECORD_SUFFIXES: tuple[str, ...] = JSONL_SUFFIXES + PARQUET_SUFFIXES + ARROW_SUFFIXES  # what a folder's records are
JSON_SUFFIXES: tuple[str, ...] = (".json",)  # a list of records in one JSON document: read when named, read whole
HF_STATE, HF_DICT = "state.json", "dataset_dict.json"  # a `datasets` folder, one split / several
READ_BYTES: int = 1 << 20  # compressed or plain bytes read at a time
BATCH_ROWS: int = 1024  # Parquet / Arrow rows decoded at a time
SNIFF_BYTES: int = 1 << 16

# what a file holds, by its first bytes, in words ("holds {}, not text")
KIND_WORDS = {"gzip": "gzip-compressed bytes", "zstd": "zstd-compressed bytes", "parquet": "a Parquet table",
              "arrow": "Arrow record batches", "jsonl": "JSON records", "json": "a JSON document",
              "binary": "binary bytes (NUL bytes)",
              "compressed": "compressed bytes (bzip2, xz or zip)"}
_OTHER_COMPRESSED = (b"BZh", b"\xfd7zXZ\x00", b"PK\x03\x04")
_BOM = b"\xef\xbb\xbf"
_DECODER = json.JSONDecoder()  # what json.loads uses, without its per-call checks
_SURROGATE = re.compile("[\ud800-\udfff]")  # a JSON escape such as \ud83d alone is no Unicode text


_JSON_OPENERS = (b"[", b"{")
_JSON_SECOND = (b'"', b"{", b"[", b"]", b"}")  # what follows a JSON document's opening bracket, blanks aside


class RecordError(ValueError):
    """A file that cannot be read as records (truncated, corrupt, no such column): one line."""


@dataclass(frozen=True)
class Input:
    """One input file and how it is read: 'text', 'jsonl', 'parquet' or 'arrow'."""

    path: pathlib.Path
    format: str


class Document:
    """One record's text and where it was (``docs.jsonl line 3``, ``part.parquet row 7``); ``bad`` says
    why a record was not read (its text is then ''), ``fix`` what to do where that is not the record's fault.

    ``where`` may be given as ``(file, unit, n)`` and is then written out only when asked for (an error,
    a skipped record): the reader makes one `Document` per record and most are never named."""

    __slots__ = ("text", "_where", "bad", "fix")

    def __init__(self, text: str, where: str | tuple[str, str, int], bad: str = "", fix: str = "") -> None:
        self.text, self._where, self.bad, self.fix = text, where, bad, fix

    @property
    def where(self) -> str:
        w = self._where
        return w if isinstance(w, str) else f"{w[0]} {w[1]} {w[2]}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Document) and (self.text, self.where, self.bad, self.fix) == (
            other.text, other.where, other.bad, other.fix)

    def __repr__(self) -> str:
        return f"Document(text={self.text!r}, where={self.where!r}, bad={self.bad!r}, fix={self.fix!r})"


def _needs(module: str, path) -> RecordError:
    return RecordError(f"data: reading {path} needs {module}, which is not installed; fix: {INSTALL_HINT}")


# ----------------------------------------------------------------------------- telling formats apart


def sniff(path: str | os.PathLike) -> str | None:
    """What a file holds when it is not plain text, by its first bytes: 'gzip', 'zstd', 'parquet', 'arrow'
    (the file format or the IPC stream), 'jsonl' (its first non-blank line is a JSON object), 'json' (a JSON
    document spread over lines: a bracket, then a quote or another bracket), 'compressed' (bzip2, xz, zip: not
    read) or 'binary' (NUL bytes); None for text (or an empty file)."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "zstd"
    if head[:4] == b"PAR1":
        return "parquet"
    if head[:6] == b"ARROW1" or head[:4] == b"\xff\xff\xff\xff":
        return "arrow"
    if head.startswith(_OTHER_COMPRESSED):
        return "compressed"
    if b"\0" in head:
        return "binary"
    first = next((ln for ln in head.splitlines() if ln.strip()), b"").strip()
    if first.startswith(b"{") and first.endswith(b"}"):
        try:
            if isinstance(json.loads(first), dict):
                return "jsonl"
        except ValueError:
            pass
    body = head.lstrip()
    if body[:1] in _JSON_OPENERS and body[1:].lstrip()[:1] in _JSON_SECOND:
        return "json"
    return None


def _sniff_named(path: pathlib.Path) -> str | None:
    """`sniff`, with the name deciding between text and a JSON document: a ``.json`` file is one, a file
    named as text (``.txt``, ``.md``, ``.py``) that merely starts with a bracket is not."""
    kind = sniff(path)
    name = path.name.lower()
    if kind is None and name.endswith(JSON_SUFFIXES):
        return "json"
    if kind == "json" and name.endswith(TEXT_SUFFIXES):
        return None
    return kind


def is_hf_folder(path: str | os.PathLike) -> bool:
    """A folder written by `datasets`' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    p = pathlib.Path(path)
    return p.is_dir() and ((p / HF_STATE).is_file() or (p / HF_DICT).is_file())


def _hf_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The ``.arrow`` files of a ``save_to_disk`` folder, in order: its ``train`` split for a DatasetDict."""
    if (folder / HF_DICT).is_file():
        try:
            splits = json.loads((folder / HF_DICT).read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RecordError(f"data: {folder / HF_DICT} cannot be read ({e}); fix: save the dataset again with "
                              "save_to_disk") from None
        if "train" not in splits:
            raise RecordError(f"data: {folder} is a DatasetDict without a 'train' split (splits: {', '.join(splits)});"
                              f" fix: pass the split's folder, e.g. --data {folder / splits[0]}")
        folder = folder / "train"
    try:
        names = [d["filename"] for d in json.loads((folder / HF_STATE).read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RecordError(f"data: {folder / HF_STATE} cannot be read ({e}); fix: save the dataset again with "
                          "save_to_disk") from None
    return [folder / n for n in names]


def file_format(path: pathlib.Path) -> str:
    """How a file is read: by its name, then by its first bytes (JSON records are never prose)."""
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if name.endswith(ARROW_SUFFIXES):
        return "arrow"
    kind = _sniff_named(path)
    if kind in ("gzip", "zstd", "jsonl"):
        return "jsonl"  # compressed input is read as JSONL: a line that is not JSON is named
    if kind == "json":
        return "json"
    if kind in ("parquet", "arrow"):
        return kind
    if kind in ("compressed", "binary"):
        raise RecordError(f"data: {path} holds {KIND_WORDS[kind]}, not text or records; fix: decompress or convert "
                          "it to UTF-8 text, JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet or Arrow, or leave it out")
    return "text"


def expand(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Input]:
    """The input files of ``--data PATH [PATH ...]``: files, folders (their text and record files, sorted by
    relative path; a ``save_to_disk`` folder's Arrow files) and globs. A missing path is a RecordError."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found: list[Input] = []
    for raw in paths:
        s = os.fspath(raw)
        if not os.path.lexists(s) and glob.has_magic(s):
            hits = sorted(glob.glob(s, recursive=True))
            if not hits:
                raise RecordError(f"data: no file matches {s!r}; fix: check the pattern (quote it so the shell "
                                  "leaves it to boostjax)")
        else:
            hits = [s]
        for h in hits:
            p = pathlib.Path(h)
            if is_hf_folder(p):
                found += [Input(f, "arrow") for f in _hf_files(p)]
            elif p.is_dir():
                found += [Input(f, file_format(f)) for f in folder_files(p)]
            else:
                found.append(Input(p, file_format(p)))
    return found


def folder_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """Text and record files under ``folder``, sorted by relative POSIX path (directory symlinks not followed)."""
    out = []
    for dirpath, _, filenames in os.walk(folder):
        for n in filenames:
            if n.lower().endswith(TEXT_SUFFIXES + RECORD_SUFFIXES) and os.path.isfile(os.path.join(dirpath, n)):
                p = pathlib.Path(dirpath, n)
                out.append((p.relative_to(folder).as_posix(), p))
    return [p for _, p in sorted(out)]


def record_files(folder: str | os.PathLike) -> list[pathlib.Path]:
    """The record files (JSONL, Parquet, Arrow) under a folder, sorted: what a text reader must not skip."""
    return [p for p in folder_files(pathlib.Path(folder)) if p.name.lower().endswith(RECORD_SUFFIXES)]


# ----------------------------------------------------------------------------- JSONL


def _zstd_chunks(f, path) -> Iterator[bytes]:
    """Decompressed chunks of a zstd file (frames one after another); a frame cut short is a RecordError."""
    try:
        import zstandard  # noqa: PLC0415 (optional: the data extra)
    except ImportError:
        raise _needs("zstandard", path) from None
    dctx = zstandard.ZstdDecompressor()
    d, fed = dctx.decompressobj(), False
    try:
        while chunk := f.read(READ_BYTES):
            while chunk:
                out = d.decompress(chunk)
                fed = True
                if out:
                    yield out
                chunk = b""
                if d.eof:
                    chunk, d, fed = d.unused_data, dctx.decompressobj(), False
    except zstandard.ZstdError as e:
        raise RecordError(f"data: {path} is not a valid zstd stream ({e}); fix: compress it again or leave it out") \
            from None
    if fed:
        raise RecordError(f"data: {path} ends in the middle of a zstd frame (truncated); fix: copy or download "
                          "it again, or leave it out")


def _byte_chunks(path: pathlib.Path, on_bytes: Callable[[int], None] | None = None) -> Iterator[bytes]:
    """The bytes of a plain, gzip or zstd file, decompressed, a chunk at a time; ``on_bytes`` is told how
    many bytes of the file each chunk took (for a progress bar)."""
    with open(path, "rb") as f:
        last = 0
        for chunk in _decoded(f, path):
            yield chunk
            if on_bytes is not None:
                pos = f.tell()
                on_bytes(pos - last)
                last = pos


def _decoded(f, path: pathlib.Path) -> Iterator[bytes]:
    """The decompressed bytes of the open file ``f`` (plain, gzip or zstd by its first bytes)."""
    kind = sniff(path)
    if kind == "zstd":
        yield from _zstd_chunks(f, path)
        return
    if kind != "gzip":
        while chunk := f.read(READ_BYTES):
            yield chunk
        return
    try:
        with gzip.GzipFile(fileobj=f) as g:
            while chunk := g.read(READ_BYTES):
                yield chunk
    except EOFError:
        raise RecordError(f"data: {path} ends in the middle of a gzip stream (truncated); fix: copy or "
                          "download it again, or leave it out") from None
    except (gzip.BadGzipFile, zlib.error) as e:
        raise RecordError(f"data: {path} is not a valid gzip stream ({e}); fix: compress it again or "
                          "leave it out") from None


def _lines(chunks: Iterator[bytes]) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its newline) of a byte stream."""
    rest, n = b"", 0
    for chunk in chunks:
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        for ln in parts:
            n += 1
            yield n, ln
    if rest:
        yield n + 1, rest


def _field(rec, field: str) -> str:
    """Why a record's ``field`` is not a document's text ('' when it is)."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    if field not in rec:
        keys = ", ".join(list(rec)[:8]) or "none"
        return f"no field {field!r} (keys: {keys})"
    if not isinstance(rec[field], str):
        return f"field {field!r} is {type(rec[field]).__name__}, not a string"
    return _unicode(rec[field], field)


def _unicode(text: str, field: str) -> str:
    """Why a decoded JSON string is not Unicode text ('' when it is): a lone surrogate escape."""
    if text.isascii():
        return ""
    bad = _SURROGATE.search(text)
    return f"a lone surrogate {bad.group()!r} in field {field!r} (not Unicode text)" if bad else ""


def jsonl_documents(path: pathlib.Path, field: str, on_bytes: Callable[[int], None] | None = None
                    ) -> Iterator[Document]:
    """One `Document` per non-blank line of a JSONL file (plain, gzip or zstd; ``on_bytes`` as in
    `_byte_chunks`)."""
    named = path.name.lower().endswith(JSONL_SUFFIXES)
    fix = "" if named else (f"{path.name} is read as JSONL by its first bytes; if it is compressed text, decompress "
                            "it and pass the text file")
    src, decode = str(path), _DECODER.decode
    for n, raw in _lines(_byte_chunks(path, on_bytes)):
        if not raw or raw.isspace():
            continue
        if raw[:3] == _BOM:  # json.loads reads a UTF-8 byte order mark as utf-8-sig
            raw = raw[3:]
        try:
            rec = decode(raw.decode("utf-8", "surrogatepass"))  # as json.loads(bytes)
        except UnicodeDecodeError as e:
            yield Document("", (src, "line", n), f"not UTF-8 ({e.reason} at byte {e.start})", fix)
            continue
        except ValueError as e:
            yield Document("", (src, "line", n), f"not valid JSON ({' '.join(str(e).split())})", fix)
            continue
        text = rec.get(field) if type(rec) is dict else None
        if type(text) is str and not _unicode(text, field):
            yield Document(text, (src, "line", n))
        else:
            why = _field(rec, field)
            yield Document("" if why else rec[field], (src, "line", n), why)


def json_documents(path: pathlib.Path, field: str, on_bytes: Callable[[int], None] | None = None
                   ) -> Iterator[Document]:
    """One `Document` per element (counted from 0) of a JSON file holding a list of records, read whole (as
    `datasets`' JSON reader does); anything else is a RecordError naming the fix (JSON lines stream)."""
    fix = "fix: write one record per line (JSONL), e.g. jq -c '.[]' in.json > out.jsonl"
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except UnicodeDecodeError as e:
        raise RecordError(f"data: {path} is not UTF-8 JSON ({e.reason} at byte {e.start}); {fix}") from None
    except ValueError as e:
        raise RecordError(f"data: {path} is not valid JSON ({' '.join(str(e).split())}); fix: correct it, or "
                          f"{fix[5:]}") from None
    if on_bytes is not None:
        on_bytes(path.stat().st_size)
    if not isinstance(data, list):
        lists = [k for k, v in data.items() if isinstance(v, list)] if isinstance(data, dict) else []
        under = f" with lists under {', '.join(map(repr, lists[:4]))}" if lists else ""
        key = lists[0] if lists else "KEY"
        what = {"dict": "object", "str": "string", "int": "number", "float": "number"}.get(type(data).__name__, "value")
        raise RecordError(f"data: {path} holds a JSON {what}{under}, not a list of records; fix: "
                          f"write its records one per line (JSONL), e.g. jq -c '.{key}[]' {path.name} > "
                          f"{path.stem}.jsonl")
    src = str(path)
    for i, rec in enumerate(data):
        why = _field(rec, field)
        yield Document("" if why else rec[field], (src, "record", i), why)


# ----------------------------------------------------------------------------- Parquet and Arrow


def _column_batches(path: pathlib.Path, fmt: str, field: str) -> Iterator[list]:
    """The ``field`` column of a Parquet or Arrow file, a record batch at a time, as Python lists."""
    try:
        import pyarrow as pa  # noqa: PLC0415 (optional: the data extra)
        import pyarrow.ipc  # noqa: PLC0415
        import pyarrow.parquet as pq  # noqa: PLC0415
    except ImportError:
        raise _needs("pyarrow", path) from None
    try:
        if fmt == "parquet":
            reader = pq.ParquetFile(path)
            schema = reader.schema_arrow
            batches = reader.iter_batches(batch_size=BATCH_ROWS, columns=[field]) if field in schema.names else None
        else:
            f = pa.memory_map(str(path))
            head = f.read(6)
            f.seek(0)
            ipc = pa.ipc.open_file(f) if head == b"ARROW1" else pa.ipc.open_stream(f)
            schema = ipc.schema
            batches = ((ipc.get_batch(i) for i in range(ipc.num_record_batches)) if head == b"ARROW1" else ipc)
        if batches is None:
            raise RecordError(f"data: {path} has no column {field!r} (columns: {', '.join(schema.names)}); fix: "
                              "pass --text-field with the column that holds the text")
        typ = schema.field(field).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
            raise RecordError(f"data: {path} column {field!r} is {typ}, not a string; fix: pass --text-field with "
                              "the column that holds the text")
        for b in batches:
            yield b.column(b.schema.get_field_index(field)).to_pylist()
    except RecordError:
        raise
    except (pa.ArrowException, OSError) as e:
        what = "Parquet" if fmt == "parquet" else "Arrow"
        raise RecordError(f"data: {path} is not a readable {what} file ({' '.join(str(e).split())[:200]}); fix: "
                          "write it again or leave it out") from None


def table_documents(path: pathlib.Path, fmt: str, field: str) -> Iterator[Document]:
    """One `Document` per row (0-based) of a Parquet or Arrow file."""
    row, src = 0, str(path)
    for col in _column_batches(path, fmt, field):
        for v in col:
            yield Document(v, (src, "row", row)) if isinstance(v, str) else \
                Document("", (src, "row", row), f"field {field!r} is null")
            row += 1


# ----------------------------------------------------------------------------- all of them


def documents(inp: Input, field: str, on_bytes: Callable[[int], None] | None = None) -> Iterator[Document]:
    """The records of one record input ('jsonl', 'json', 'parquet' or 'arrow'), each one document
    (``on_bytes``: the bytes of a JSON file read so far, a chunk at a time)."""
    if inp.format == "jsonl":
        return jsonl_documents(inp.path, field, on_bytes)
    if inp.format == "json":
        return json_documents(inp.path, field, on_bytes)
    if inp.format in ("parquet", "arrow"):
        return table_documents(inp.path, inp.format, field)
    raise ValueError(f"records.documents: {inp.path} is {inp.format}, not records")


def text_refusal(path: str | os.PathLike) -> str:
    """Why a file must not be read as text ('' when it may): what it holds, in words, for `resolve_source`."""
    p = pathlib.Path(path)
    kind = _sniff_named(p)
    if kind is None and p.name.lower().endswith(RECORD_SUFFIXES):
        kind = "jsonl" if p.name.lower().endswith(JSONL_SUFFIXES) else p.suffix.lstrip(".")
    return KIND_WORDS.get(kind, f"{kind} records") if kind else ""

