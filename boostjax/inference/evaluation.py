"""Held-out evaluation: loss, perplexity and bits per byte over every token of a stream, once.

    boostjax eval --run runs/x --data data/my_texts            # a tokenised folder: its val split
    boostjax eval --run runs/x --data held_out.txt --json      # text: encoded with the run's tokenizer

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

import functools
import math
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from boostjax.config import ConfigError, check_batch_seq
from boostjax.data import tokenize as tz
from boostjax.data.source import resolve_source
from boostjax.data.tokenizers import same_tokenizer, tokenizer_kind


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


def eval_stream(tok, data: str, split: str | None, doc_sep: str | None) -> tuple[np.ndarray, int, str, np.ndarray]:
    """(ids with the document separator in front, UTF-8 bytes of the predicted ids, what was read, the
    documents' start offsets in those ids) of ``--data``: a tokenised folder's split (its tokenizer must
    be ``tok``) or text encoded with ``tok``."""

    sep = tz.separator(tok)
    try:
        src = resolve_source(data) if data else None  # '' (the built-in corpus) is refused as no input below
    except ValueError as e:
        if not os.path.isdir(data):  # a missing or unreadable file: the text reader names it
            src = None
        else:
            raise ConfigError(str(e)) from None
    if src is not None and src.kind == "tokens":
        meta = src.meta
        folder_tok = src.tokenizer
        if not same_tokenizer(folder_tok, tok):
            raise ConfigError(f"eval.data: {data} was tokenised with {tokenizer_kind(folder_tok)}, not with the run's "
                              f"tokenizer ({tokenizer_kind(tok)}); fix: tokenise the text with the run's tokenizer "
                              "(boostjax tokenize --tokenizer RUN ...) or pass the text itself")
        split = split or "val"
        ids = np.memmap(pathlib.Path(data) / meta["splits"][split]["file"], dtype=meta["dtype"], mode="r")
        stream = np.concatenate([sep[-1:].astype(ids.dtype), ids])
        starts = np.load(pathlib.Path(data) / meta["splits"][split]["docs_file"]) + 1
        return stream, meta["splits"][split]["bytes"], f"{data} ({split} split)", starts
    if split is not None:
        raise ConfigError(f"eval.split: {data} is text, which is evaluated whole; fix: drop --split, or tokenise it "
                          "with boostjax tokenize and pass that folder")
    files = tz.input_files(data)
    doc_sep = doc_sep or ("file" if os.path.isdir(data) else "blank")
    parts = [sep[-1:]]
    n_bytes, starts, at = 0, [], 1
    for batch in tz._batches(tz.documents(files, doc_sep)):
        for d, ids in zip(batch, tz.encode_documents(tok, batch)):
            parts += [ids.astype(np.uint32), sep]
            starts.append(at)
            at += len(ids) + len(sep)
            n_bytes += len(d.encode("utf-8")) + tz.separator_bytes(tok)
    if len(parts) == 1:
        raise ConfigError(f"eval.data: {data} holds no non-empty document; fix: pass text to evaluate")
    return np.concatenate(parts), n_bytes, str(data), np.asarray(starts, np.int64)
