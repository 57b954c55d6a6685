"""Held-out evaluation: loss, perplexity and bits per byte over every token of a stream, once.

    boostjax eval --run runs/x --data data/my_texts            # a tokenised folder: its val split
    boostjax eval --run runs/x --data my_texts/                # text: the val split the trainer holds out
    boostjax eval --run runs/x --data held_out.txt --split all --json   # all of it, with the run's tokenizer

`eval_data` picks what the command scores (`--split`: the trainer's own split of ``--data``, see there).

`evaluate` cuts the stream into non-overlapping windows of ``seq`` predicted tokens (window ``k`` reads
``tokens[k*seq : k*seq+seq]`` and predicts ``tokens[k*seq+1 : k*seq+seq+1]``), so every token after the
first is predicted exactly once, from the tokens before it in its window; the last window is padded and
its padding masked. Batches have one fixed shape, so the jitted forward compiles once.

Bits per byte = total nats / ln 2 / bytes, where bytes are the UTF-8 bytes the predicted tokens stand for
(https://arxiv.org/abs/2101.00027, section 3.3 "bits per UTF-8 encoded byte"). The command puts the
separator that precedes every document (the end-of-document id, or "\\n" at byte level) before the stream,
so that the first document is predicted like the others and the split's bytes (from its metadata, or the
text's UTF-8 length) are exactly the predicted ones; for byte-level data bits per byte is loss / ln 2.
"""

from __future__ import annotations

import codecs
import functools
import math
import pathlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from boostjax.config import ConfigError, check_batch_seq
from boostjax.data import records
from boostjax.data import tokenize as tz
from boostjax.data.corpus import FILE_SEP, files_stream, stdlib_sources, text_files
from boostjax.data.source import open_source, resolve_source
from boostjax.data.token_folder import is_token_folder, token_split
from boostjax.data.tokenizers import ByteTokenizer, same_tokenizer, tokenizer_kind


def _windows(tokens: np.ndarray, seq: int, first: int, rows: int,
             doc_starts: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Inputs, targets and mask (int32/int32/float32 [rows, seq]) of windows first..first+rows-1, and
    with `doc_starts` the segment ids (int32 [rows, seq]: documents started at or before each input)."""
    x_bs = np.zeros((rows, seq), np.int32)
    y_bs = np.zeros((rows, seq), np.int32)
    m_bs = np.zeros((rows, seq), np.float32)
    s_bs = np.zeros((rows, seq), np.int32)
    for r in range(rows):
        lo = (first + r) * seq
        chunk = np.asarray(tokens[lo:lo + seq + 1], dtype=np.int64)
        n = len(chunk) - 1
        if n <= 0:
            continue
        x_bs[r, :n], y_bs[r, :n], m_bs[r, :n] = chunk[:-1], chunk[1:], 1.0
        if doc_starts is not None:
            s_bs[r] = np.searchsorted(doc_starts, lo + np.arange(seq), side="right")
    return (x_bs, y_bs, m_bs) if doc_starts is None else (x_bs, y_bs, m_bs, s_bs)


@functools.cache
def _nll_sum():
    """The jitted summed negative log-likelihood of the masked targets of one batch (one compile per
    model structure and batch shape, shared by every `evaluate` call)."""

    @functools.partial(jax.jit, static_argnums=0)
    def nll_sum(graphdef, state, x_bs, y_bs, m_bs, s_bs=None):
        logits_bsv = nnx.merge(graphdef, state)(x_bs, segments=s_bs).astype(jnp.float32)
        lse_bs = jax.nn.logsumexp(logits_bsv, axis=-1)
        picked_bs = jnp.take_along_axis(logits_bsv, y_bs[..., None], axis=-1)[..., 0]
        return jnp.sum((lse_bs - picked_bs) * m_bs)

    return nll_sum


def evaluate(model, tokens, *, seq: int, batch: int, n_bytes: int | None = None,
             doc_starts: np.ndarray | None = None, progress: bool = False) -> dict[str, Any]:
    """Mean loss (nats per predicted token), perplexity and, when ``n_bytes`` (the UTF-8 bytes that
    ``tokens[1:]`` stand for) is given, bits per byte of ``model`` over the 1-D id stream ``tokens``
    (a numpy array or memmap): every token after the first is predicted once (see the module notes),
    in fp32 on the model's device. ``doc_starts`` (ascending stream offsets of the documents): attention
    is masked at document boundaries, as in a run trained with ``--doc-mask``.
    Returns {"loss", "perplexity", "tokens", "windows", "bits_per_byte", "bytes"} (the last two None
    without ``n_bytes``)."""

    check_batch_seq(batch, seq, "eval")
    tokens = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if tokens.ndim != 1 or len(tokens) < 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"eval.data: need a 1-D integer token stream of at least 2 ids, got shape {tokens.shape} "
                          f"{tokens.dtype}; fix: evaluate more text")
    vocab = model.cfg.vocab_size
    if n_bytes is not None and (isinstance(n_bytes, bool) or not isinstance(n_bytes, (int, np.integer))
                                or n_bytes <= 0):
        raise ConfigError(f"eval.n_bytes: must be a positive integer or None, got {n_bytes!r}; fix: pass the UTF-8 "
                          "byte count of the predicted text")
    graphdef, state = nnx.split(model)
    nll_sum = _nll_sum()
    n_windows = -(-(len(tokens) - 1) // seq)
    total = 0.0
    pending = []
    for first in tqdm(range(0, n_windows, batch), disable=not progress, desc="eval", unit="batch",
                      dynamic_ncols=True):
        x_bs, y_bs, m_bs, *s_bs = _windows(tokens, seq, first, batch, doc_starts)
        top = int(max(x_bs.max(), y_bs.max()))
        if top >= vocab:
            raise ConfigError(f"eval.data: token id {top} is outside the model's vocabulary ({vocab}); fix: evaluate "
                              "data tokenised with the run's tokenizer")
        pending.append(nll_sum(graphdef, state, x_bs, y_bs, m_bs, *s_bs))
        if len(pending) >= 8:  # keep a few batches in flight, not the whole stream's results
            total += float(np.sum(np.asarray(jax.device_get(pending), np.float64)))
            pending = []
    total += float(np.sum(np.asarray(jax.device_get(pending), np.float64))) if pending else 0.0
    count = len(tokens) - 1
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": count, "windows": n_windows,
            "bits_per_byte": total / math.log(2) / n_bytes if n_bytes else None,
            "bytes": int(n_bytes) if n_bytes else None}


# ----------------------------------------------------------------------------- eval command

EVAL_SPLITS: tuple[str, ...] = ("val", "train", "all")  # what `boostjax eval --split` scores; val first: the default
_SPLIT_WORDS = {"val": "the validation split", "train": "the training split", "all": "all"}


@dataclass(frozen=True)
class EvalData:
    """What `boostjax eval` scores of its ``--data``: ``tokens[1:]`` (``tokens[0]`` is the separator that
    precedes every document, or, for a ``.bin`` file, its first id), the UTF-8 bytes they stand for (None
    for token ids), the documents' start offsets in ``tokens`` (None: not known), which split, how many
    documents, how the split was cut (`boostjax.data.corpus.Corpus.split_rule`) and the data's name."""

    tokens: np.ndarray
    n_bytes: int | None
    doc_starts: np.ndarray | None
    split: str
    documents: int | None
    rule: str
    name: str

    @property
    def scored(self) -> str:
        """What was scored, in words: 'the validation split of X (every 50th file: 3 documents, 1,204 tokens)'."""
        rule = "" if self.split == "all" else self.rule if self.split == "val" else f"all but {self.rule}"
        counts = ([f"{self.documents:,} document{'s' * (self.documents != 1)}"] if self.documents is not None
                  else []) + [f"{len(self.tokens) - 1:,} tokens"]
        return (f"{_SPLIT_WORDS[self.split]} of {self.name} ({rule + ': ' if rule else ''}"
                f"{', '.join(counts)})")


def eval_data(tok, data: str, split: str | None = None, doc_sep: str | None = None,
              dtype: str = "uint16", text_field: str = tz.TEXT_FIELD) -> EvalData:
    """The part of ``--data`` that `boostjax eval` scores with the run's tokenizer ``tok``: ``split``
    'val' (the default) is the validation split the trainer holds out of that data, 'train' the rest,
    'all' all of it. The split is the trainer's own (`boostjax.data.source.open_source`): a tokenised
    folder's splits (its tokenizer must be ``tok``); for text, a folder or the built-in corpus ('') the
    held-out bytes. Those are scored as they are at byte level (exactly the trainer's validation tokens);
    with another tokenizer, or with ``doc_sep``, their text is split into documents (``doc_sep``, as in
    boostjax tokenize) and encoded with ``tok``. A ``.bin`` file's ids are scored as they are. Bad input
    is a `ConfigError` of one line naming the ``eval.`` field. Records (JSONL, Parquet, Arrow, a `datasets`
    folder: `boostjax.data.records`, each one document, its text ``text_field``) are split as boostjax
    tokenize splits them (every 50th record held out) and encoded with ``tok``."""
    try:
        if holds_records(data):
            return _records_data(tok, data, split or "val", doc_sep, text_field)
        return _eval_data(tok, data, split or "val", doc_sep, dtype)
    except ValueError as e:  # the data readers' `data:` and tokenize's `tokenize.data:` are eval's
        msg = " ".join(str(e).split())
        msg = "eval." + msg.removeprefix("tokenize.") if msg.startswith(("tokenize.", "data:")) else msg
        raise ConfigError(msg) from None


def holds_records(data: str) -> bool:
    """``data`` is read as records (`boostjax.data.records`), not by the trainer's readers."""
    p = pathlib.Path(data)
    if not data or not p.exists() or is_token_folder(p):
        return False
    if p.is_dir():
        return records.is_hf_folder(p) or bool(records.record_files(p))
    return p.is_file() and not data.endswith(".bin") and records.file_format(p) != "text"


def _records_data(tok, data: str, split: str, doc_sep: str | None, text_field: str) -> EvalData:
    """The records of ``data``, one document each, the split boostjax tokenize makes of them."""
    if split not in EVAL_SPLITS:
        raise ConfigError(f"eval.split: unknown {split!r}; fix: pass --split with one of {', '.join(EVAL_SPLITS)}")
    if doc_sep not in (None, "file"):
        raise ConfigError(f"eval.doc_sep: {data} holds records, and each record is one document; fix: drop "
                          f"--doc-sep {doc_sep}")
    found = tz.inputs(data)
    n = sum(1 for _ in tz.documents(found, "file", text_field, offer_skip=False))  # all checked before encoding
    keep = (lambda i: True) if split == "all" else (
        (lambda i: tz.is_val(i, n, tz.VAL_EVERY)) if split == "val" else (lambda i: not tz.is_val(i, n, tz.VAL_EVERY)))
    texts = (d for i, d in enumerate(tz.documents(found, "file", text_field, offer_skip=False)) if keep(i))
    stream, n_bytes, starts = _encode(tok, texts, tz.separator(tok))
    if len(starts) == 0:
        raise ConfigError(f"eval.data: {_SPLIT_WORDS[split]} of {data} holds no non-empty record; fix: pass records "
                          "with text" + (", or --split all" if split != "all" else ""))
    rule = f"every {tz.VAL_EVERY}th record, as boostjax tokenize holds out"
    return EvalData(stream, n_bytes, starts, split, len(starts), "" if split == "all" else rule, data)


def _eval_data(tok, data: str, split: str, doc_sep: str | None, dtype: str) -> EvalData:
    if split not in EVAL_SPLITS:
        raise ConfigError(f"eval.split: unknown {split!r}; fix: pass --split with one of {', '.join(EVAL_SPLITS)}")
    if doc_sep is not None and doc_sep not in tz.DOC_SEPS:
        raise ConfigError(f"eval.doc_sep: unknown {doc_sep!r}; fix: pass one of {', '.join(tz.DOC_SEPS)}")
    src = resolve_source(data, dtype)
    if src.kind == "tokens":
        return _token_folder_data(tok, src, split)
    if src.kind == "bin":
        if doc_sep is not None:
            raise ConfigError(f"eval.doc_sep: {data} holds token ids, with no documents to split; fix: drop --doc-sep")
        ids, _, rule = _split_of(src, split)
        return EvalData(ids, None, None, split, None, rule, src.name)
    sep = tz.separator(tok)
    if isinstance(tok, ByteTokenizer) and doc_sep is None:  # the trainer's bytes, as they are
        ids, docs, rule = _split_of(src, split)
        starts = None if docs is None else docs + 1
        return EvalData(np.concatenate([sep[-1:].astype(np.uint8), ids]), len(ids), starts, split,
                        None if docs is None else len(docs), rule, src.name)
    doc_sep = doc_sep or ("blank" if src.kind == "text" else "file")
    if split == "all":
        files = stdlib_sources() if src.kind == "builtin" else tz.input_files(data)
        texts: Iterable[str] = tz.documents(files, doc_sep)
        rule = ""
    else:
        ids, docs, rule = _split_of(src, split)
        texts = _split_texts(ids, docs, doc_sep, f"the {split} split of {src.name}")
    stream, n_bytes, starts = _encode(tok, texts, sep)
    if len(starts) == 0:
        raise ConfigError(f"eval.data: {_SPLIT_WORDS[split]} of {src.name} holds no non-empty document; fix: pass "
                          "text to evaluate" + (", or --split all" if split != "all" else ""))
    return EvalData(stream, n_bytes, starts, split, len(starts), rule, src.name)


def eval_stream(tok, data: str, split: str | None, doc_sep: str | None) -> tuple[np.ndarray, int, str, np.ndarray]:
    """`eval_data` as a tuple: (ids with the document separator in front, UTF-8 bytes of the predicted
    ids, the data and its split in words, the documents' start offsets in those ids)."""
    d = eval_data(tok, data, split, doc_sep)
    return d.tokens, d.n_bytes, f"{d.name} ({d.split} split)", d.doc_starts


def _split_of(src, split: str) -> tuple[np.ndarray, np.ndarray | None, str]:
    """(ids, documents' start offsets or None, how the validation split is cut) of one split of a text,
    folder, built-in or ``.bin`` source as the trainer reads it (`open_source`: the trainer's split, one
    place), or of all of it, in order ('' for the rule)."""
    c = open_source(src)  # also the trainer's checks: an empty or ragged file, a folder without text
    if split == "all":
        if src.kind == "bin":
            return np.memmap(src.path, dtype=np.dtype(src.dtype), mode="r"), None, ""
        if src.kind == "text":  # a file's splits are its head and tail: together, the file
            return np.concatenate([c.train, c.val]), None, ""
        return (*files_stream(stdlib_sources() if src.kind == "builtin" else text_files(src.path)), "")
    return (c.val, c.val_docs, c.split_rule) if split == "val" else (c.train, c.train_docs, c.split_rule)


def _token_folder_data(tok, src, split: str) -> EvalData:
    """One split, or both in turn, of a tokenised folder (written with ``tok``), led by its separator."""
    if not same_tokenizer(src.tokenizer, tok):
        raise ConfigError(f"eval.data: {src.path} was tokenised with {tokenizer_kind(src.tokenizer)}, not with the "
                          f"run's tokenizer ({tokenizer_kind(tok)}); fix: tokenise the text with the run's tokenizer "
                          "(boostjax tokenize --tokenizer RUN ...) or pass the text itself")
    names = ("train", "val") if split == "all" else (split,)
    parts = [token_split(src.path, src.meta, s) for s in names]
    ids = np.concatenate([tz.separator(tok)[-1:].astype(parts[0][0].dtype)] + [t for t, _ in parts])
    offsets = np.cumsum([1] + [len(t) for t, _ in parts[:-1]])
    starts = np.concatenate([d + o for (_, d), o in zip(parts, offsets)])
    n_bytes = sum(src.meta["splits"][s]["bytes"] for s in names)
    return EvalData(ids, n_bytes, starts, split, len(starts), "the documents boostjax tokenize held out", src.path)


def _utf8(piece: bytes, where: str) -> str:
    """A piece of text read as bytes, decoded; a character that a split cut in two is dropped."""
    lead = len(piece) - len(piece.lstrip(bytes(range(0x80, 0xC0))))  # continuation bytes of a cut character
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(piece[min(lead, 3):], final=False)
    except UnicodeDecodeError as e:
        raise ConfigError(f"eval.data: {where} is not UTF-8 text ({e.reason} at byte {e.start}); fix: convert it to "
                          "UTF-8 (e.g. iconv -t UTF-8)") from None


def _split_texts(ids: np.ndarray, docs: np.ndarray | None, doc_sep: str, where: str) -> Iterator[str]:
    """The documents of a split of text read as bytes: each of its pieces (a file, or the part of one that
    the split starts or ends in; the whole split when ``docs`` is None) without the separator the trainer
    put after it, decoded and split by ``doc_sep``."""
    raw = np.asarray(ids, np.uint8).tobytes()
    bounds = [0, len(raw)] if docs is None else [*map(int, docs), len(raw)]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        piece = raw[lo:hi]
        if docs is not None and piece.endswith(FILE_SEP):
            piece = piece[:-len(FILE_SEP)]
        yield from tz.split_documents(_utf8(piece, where), doc_sep)


def _encode(tok, texts: Iterable[str], sep: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    """(the separator, then every document encoded with ``tok`` and followed by the separator; the
    UTF-8 bytes the documents and separators stand for; the documents' start offsets)."""
    parts = [sep[-1:]]
    n_bytes, starts, at = 0, [], 1
    for batch in tz._batches(texts):
        for d, ids in zip(batch, tz.encode_documents(tok, batch)):
            parts += [ids.astype(np.uint32), sep]
            starts.append(at)
            at += len(ids) + len(sep)
            n_bytes += len(d.encode("utf-8")) + tz.separator_bytes(tok)
    return np.concatenate(parts), n_bytes, np.asarray(starts, np.int64)
