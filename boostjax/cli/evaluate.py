"""`boostjax eval`: loss, perplexity and bits per byte of a run's checkpoint on the part of ``--data``
that ``--split`` names (by default the validation split the trainer holds out), and which part that was."""

from __future__ import annotations

import argparse
import json
import pathlib

from boostjax.cli.flags import add_field
from boostjax.config import ConfigError, check_batch_seq, field_default
from boostjax.data.tokenize import TEXT_FIELD

EVAL_SPLITS: tuple[str, ...] = ("val", "train", "all")  # as boostjax.inference.evaluation.EVAL_SPLITS (no JAX here)


def _cmd_eval(args: argparse.Namespace) -> int:
    from boostjax.data import tokenize as tz
    from boostjax.inference.evaluation import eval_data, evaluate
    from boostjax.runs.load import read_config
    from boostjax.data.tokenizers import load_tokenizer

    cfg = read_config(args.run)
    seq = args.seq if args.seq is not None else cfg.train.seq
    batch = args.batch if args.batch is not None else cfg.train.batch
    check_batch_seq(batch, seq, "eval")
    if seq > cfg.model.max_seq_len:
        raise ConfigError(f"eval.seq: {seq} exceeds the model's max_seq_len {cfg.model.max_seq_len}; fix: pass "
                          f"--seq <= {cfg.model.max_seq_len}")
    if args.doc_sep is not None and args.doc_sep not in tz.DOC_SEPS:
        raise ConfigError(f"eval.doc_sep: unknown {args.doc_sep!r}; fix: pass one of {', '.join(tz.DOC_SEPS)}")
    try:
        tok = load_tokenizer(args.run)
    except ConfigError as e:
        raise ConfigError(f"eval.run: {e}") from None
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"eval.run: the tokenizer in {args.run} has {tok.vocab_size} ids but the model "
                          f"{cfg.model.vocab_size}; fix: restore the run's tokenizer.json")
    dtype = args.data_dtype if args.data_dtype is not None else field_default("data_dtype")
    d = eval_data(tok, args.data, args.split, args.doc_sep, dtype, args.text_field)
    relation = _relation(args.run, cfg, args.data, dtype, d.split)
    from boostjax.runs.load import load_run  # starts JAX

    cfg, model, step = load_run(args.run, args.step)
    progress = args.progress if args.progress is not None else field_default("progress")
    res = evaluate(model, d.tokens, seq=seq, batch=batch, n_bytes=d.n_bytes, progress=progress,
                   doc_starts=d.doc_starts if cfg.train.doc_mask else None)  # as the run was trained
    res = {"run": str(args.run), "step": step, "data": f"{d.name} ({d.split} split)", "split": d.split,
           "scored": d.scored, "documents": d.documents, "training_data": relation[0], "seq": seq, **res}
    if args.json:
        print(json.dumps(res))
    else:
        bpb = f", {res['bits_per_byte']:.4f} bits/byte" if res["bits_per_byte"] is not None else ""
        nbytes = f", {res['bytes']} bytes" if res["bytes"] is not None else ""
        print(f"scored: {d.scored}{relation[1]}")
        print(f"eval: step {step} of {args.run} on {res['data']}: loss {res['loss']:.4f}, perplexity "
              f"{res['perplexity']:.3f}{bpb} ({res['tokens']} tokens{nbytes}, seq {seq})")
    return 0


def _relation(run: str, cfg, data: str, dtype: str, split: str) -> tuple[bool | None, str]:
    """(whether ``data`` is the run's training data, by content; None where the run stored no
    fingerprint) and what that means for ``split``, in words, to follow the `scored:` line."""
    from boostjax.data.source import resolve_source
    from boostjax.runs.folder import RunFolder

    stored = RunFolder(run).stored_data_fingerprint()
    if stored is None:
        return None, ""
    try:
        src = resolve_source(data, dtype)
    except ValueError:  # records (JSONL, Parquet, Arrow): never the trainer's data as they are
        src = None
    mixed = {m.get("fingerprint"): m for m in RunFolder(run).stored_data_mixture() or []}
    if src is not None and (src.fingerprint == stored or src.fingerprint in mixed):
        m = mixed.get(src.fingerprint)
        whose = (f"folder {m.get('name')} of this run's mixture (weight {float(m.get('weight') or 0):.3g})" if m
                 else "this run's training data")
        return True, {"val": f"; {whose}: the trainer held this split out",
                      "train": f"; {whose}: the run trained on this split",
                      "all": f"; {whose}: the run trained on all but its validation split"}[split]
    try:  # the text that the run's tokenised folder was made from?
        run_src = resolve_source(cfg.train.data, cfg.train.data_dtype)
    except ValueError:
        run_src = None
    if (run_src is not None and run_src.kind == "tokens" and data
            and run_src.meta.get("source") == str(pathlib.Path(data).absolute())):
        return False, (f"; the text that this run's data {run_src.path} was tokenised from: the documents the run "
                       f"held out are that folder's validation split (--data {run_src.path})")
    return False, "; not this run's training data" + (" (--split all scores all of it)" if split == "val" else "")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="loss, perplexity, bits/byte of a run on the validation split of --data (--split all: all of it)",
        description="Score a run's checkpoint on the part of --data that --split names: by default the validation "
                    "split the trainer holds out of that data (the same documents and tokens), also for a text file "
                    "or folder; it prints which part it scored.")
    p.add_argument("--run", required=True, help="run folder written by boostjax train (--out)")
    p.add_argument("--data", required=True,
                   help="a folder written by boostjax tokenize (with the run's tokenizer), a text file or folder of "
                        "text files, JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet or Arrow files or a Hugging Face "
                        "datasets folder (encoded with the run's tokenizer; every 50th record is the validation "
                        "split), a .bin token file or '' (the built-in corpus); --split says which part is scored")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--seq", type=int, default=None, help="predicted tokens per window (default: the run's --seq)")
    p.add_argument("--batch", type=int, default=None, help="windows per forward pass (default: the run's --batch)")
    p.add_argument("--split", default=None, choices=EVAL_SPLITS,
                   help="what to score: val, the validation split boostjax train holds out of --data (for text: "
                        "every 50th file of a folder, or the last 2%% of a file or of a folder of fewer than 50 "
                        "files); train, the rest; all, all of it (default: val)")
    p.add_argument("--doc-sep", default=None, choices=("file", "blank", "line"),
                   help="documents of the text, as in boostjax tokenize (default: file for a folder, blank for a "
                        "single file; byte-level runs read the text as bytes, as they were trained, unless given)")
    p.add_argument("--text-field", default=TEXT_FIELD,
                   help="the JSONL key or Parquet/Arrow column that holds a record's text, as in boostjax tokenize "
                        "(default: %(default)s)")
    add_field(p, "data_dtype")  # train's --data-dtype, for a .bin file
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_field(p, "progress")  # train's --progress/--no-progress, with train's default
    p.set_defaults(func=_cmd_eval)
