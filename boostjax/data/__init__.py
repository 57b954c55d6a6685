"""Data: tokenizers, the corpora ``--data`` names, tokenised folders and deterministic batches.

    tokenizers.py    ByteTokenizer (UTF-8 bytes) and HFTokenizer (a tokenizer.json); load_tokenizer
    corpus.py        Corpus (train / val token streams) read from the built-in stdlib corpus, text files,
                     a folder of text files or a .bin token file
    token_folder.py  reading a tokenised folder (meta.json, the splits, the documents' offsets)
    records.py       JSONL (.gz, .zst), Parquet, Arrow and datasets folders as streams of located documents
    tokenize.py      writing one: boostjax tokenize, text and records in, a tokenised folder out
    source.py        what --data is, decided once (resolve_source -> Source), checked (check_source)
                     and opened (open_source); the run's tokenizer
    batches.py       BatchIterator (random windows), DocumentIterator (packed documents), eval_batches

The public names are importable from here (``from boostjax.data import BatchIterator, load_corpus``).
"""

from __future__ import annotations

from boostjax.data.batches import (
    DOC_STREAM,
    BatchIterator,
    DocumentIterator,
    batch_iterator,
    check_docs,
    eval_batches,
)
from boostjax.data.corpus import (
    FILE_SEP,
    MIN_SPLIT_TOKENS,
    TEXT_SUFFIXES,
    TOKEN_DTYPES,
    VAL_EVERY,
    Corpus,
    stdlib_corpus,
    stdlib_sources,
    token_max,
)
from boostjax.data.source import (
    Source,
    check_data,
    check_source,
    load_corpus,
    open_source,
    resolve_source,
)
from boostjax.data.token_folder import (
    META_FILE,
    SPLITS,
    TOKENS_FORMAT,
    TOKENS_VERSION,
    check_token_vocab,
    is_token_folder,
    read_token_meta,
    token_folder_corpus,
)
from boostjax.data.tokenizers import ByteTokenizer

__all__ = [
    "DOC_STREAM", "FILE_SEP", "META_FILE", "MIN_SPLIT_TOKENS", "SPLITS", "TEXT_SUFFIXES",
    "TOKENS_FORMAT", "TOKENS_VERSION", "TOKEN_DTYPES", "VAL_EVERY",
    "BatchIterator", "ByteTokenizer", "Corpus", "DocumentIterator", "Source",
    "batch_iterator", "check_data", "check_docs", "check_source", "check_token_vocab", "eval_batches",
    "is_token_folder", "load_corpus", "open_source", "read_token_meta", "resolve_source", "stdlib_corpus",
    "stdlib_sources", "token_folder_corpus", "token_max",
]
