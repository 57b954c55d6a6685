"""`boostjax tokenize`: text, JSONL, Parquet or Arrow files into a tokenised folder that `boostjax train --data`
reads."""

from __future__ import annotations

import argparse
import sys

from boostjax.data.tokenize import DOC_SEPS, SHARD_TOKENS, TEXT_FIELD, VAL_EVERY, default_workers, tokenize_corpus


def _cmd_tokenize(args: argparse.Namespace) -> int:
    meta = tokenize_corpus(args.data, args.out, args.tokenizer, doc_sep=args.doc_sep, val_every=args.val_every,
                           progress=args.progress, log=lambda s: print(f"boostjax: {s}", file=sys.stderr),
                           text_field=args.text_field, skip_bad=args.skip_bad,
                           workers=args.workers, shard_tokens=args.shard_tokens)
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    print(f"tokenized {' '.join(args.data)} -> {args.out}: {meta['tokenizer']} (vocab {meta['vocab_size']}, {meta['dtype']}), "
          f"train {tr['documents']} documents / {tr['tokens']} tokens / {tr['bytes']} bytes, "
          f"val {va['documents']} documents / {va['tokens']} tokens / {va['bytes']} bytes")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("tokenize", help="text, JSONL, Parquet or Arrow files to a tokenised folder for boostjax "
                                                     "train --data")
    p.add_argument("--tokenizer", default="byte",
                   help="a tokenizer.json file or a folder holding one (a run, a Hugging Face model), a llama.cpp "
                        ".gguf file (its own tokenizer, built by transformers: the gguf extra), 'byte' for "
                        "UTF-8 bytes, or train:VOCAB to train a byte-level BPE on the training documents "
                        "(default: byte)")
    p.add_argument("--data", required=True, nargs="+", metavar="PATH",
                   help="files, folders or globs: text (*.txt/*.md/*.py), JSONL (.jsonl, .jsonl.gz, .jsonl.zst), "
                        "Parquet, Arrow files or a Hugging Face datasets folder (save_to_disk); each record is one "
                        "document")
    p.add_argument("--text-field", default=TEXT_FIELD,
                   help="the JSONL key or Parquet/Arrow column that holds a record's text (default: %(default)s)")
    p.add_argument("--skip-bad", action="store_true",
                   help="leave out bad records (bad JSON, a missing, null or non-string field), counted in "
                        "meta.json and on stderr, instead of refusing the input; a damaged file is refused either way")
    p.add_argument("--out", required=True, help="new folder for meta.json, train-00000.bin, val-00000.bin, ...")
    p.add_argument("--doc-sep", default=None, choices=DOC_SEPS,
                   help="documents of a text file: the whole file, blank-line-separated blocks, or lines "
                        "(default: file for a folder or several paths, blank for a single file; a record is always "
                        "one document)")
    p.add_argument("--val-every", type=int, default=VAL_EVERY,
                   help="document i is held out for validation iff i %% N == N-1 (default: %(default)s; the last "
                        "document when there are fewer)")
    p.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                   help="processes that encode with a tokenizer.json tokenizer, in parallel and in bounded memory; "
                        "the output is the same for any N (default: all cores, %(default)s here)")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, metavar="N",
                   help="a split's token file is cut into shards, each closed at the first document end from N "
                        "tokens on, so that each process of a multi-host run reads only its rows' bytes "
                        "(default: %(default)s)")
    p.add_argument("--progress", default=True, action=argparse.BooleanOptionalAction,
                   help="progress bars on large inputs")
    p.set_defaults(func=_cmd_tokenize)
