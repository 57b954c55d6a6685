"""`boostjax eval`: loss, perplexity and bits per byte of a run's checkpoint (``--run``), or of a start
built from a pretrained model without training (``--init-from-hf MODEL``: the checkpoint as it is, or
factored by ``--model svd|cola|lax --rank ... --init-factor ...`` as `boostjax train` factors it), on the
part of ``--data`` that ``--split`` names (by default the validation split the trainer holds out), and
which part that was."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np

from boostjax.cli.flags import add_field
from boostjax.config import CALIBRATED_FACTORS, ConfigError, check_batch_seq, field_default, flag_of
from boostjax.data.tokenize import TEXT_FIELD

EVAL_SPLITS: tuple[str, ...] = ("val", "train", "all")  # as boostjax.inference.evaluation.EVAL_SPLITS (no JAX here)
# the flags that build a start from --init-from-hf, as boostjax train has them (after the source itself)
START_FIELDS: tuple[str, ...] = ("init_from_hf", "kind", "rank", "rank_attn", "rank_kv", "rank_mlp", "auto_dense",
                                 "rank_budget", "rank_policy", "init_factor", "calib_tokens", "seed")


def _cmd_eval(args: argparse.Namespace) -> int:
    if args.run is None and not args.init_from_hf:
        raise ConfigError("eval.run: nothing to score; fix: pass --run RUN (a run folder) or --init-from-hf MODEL "
                          "(a Hugging Face folder or .gguf file, scored without training)")
    if args.run is not None and args.init_from_hf:
        raise ConfigError("eval.init_from_hf: --run and --init-from-hf both name a model; fix: pass one of them")
    stray = [n for n in START_FIELDS[1:] if getattr(args, n) is not None]
    if args.run is not None and stray:
        raise ConfigError(f"eval.{stray[0]}: {flag_of(stray[0])} builds a start from --init-from-hf, and the run "
                          f"folder's model is its own; fix: drop {flag_of(stray[0])}, or pass --init-from-hf MODEL "
                          "instead of --run")
    return _eval_run(args) if args.run is not None else _eval_start(args)


def _eval_run(args: argparse.Namespace) -> int:
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
    _print(args.json, res, f"{d.scored}{relation[1]}", f"step {step} of {args.run}")
    return 0


def _print(as_json: bool, res: dict, scored: str, what: str) -> None:
    if as_json:
        print(json.dumps(res))
        return
    bpb = f", {res['bits_per_byte']:.4f} bits/byte" if res["bits_per_byte"] is not None else ""
    nbytes = f", {res['bytes']} bytes" if res["bytes"] is not None else ""
    print(f"scored: {scored}")
    print(f"eval: {what} on {res['data']}: loss {res['loss']:.4f}, perplexity {res['perplexity']:.3f}{bpb} "
          f"({res['tokens']} tokens{nbytes}, seq {res['seq']})")


def _renamed(e: ConfigError) -> ConfigError:
    """A `train.`/`model.` error of the start's config as eval's (the same flags)."""
    msg = str(e)
    for prefix in ("train.", "model."):
        if msg.startswith(prefix):
            return ConfigError("eval." + msg.removeprefix(prefix))
    return e


def _eval_start(args: argparse.Namespace) -> int:
    """Score the start `boostjax train --init-from-hf MODEL` would begin from (step 0), built the same way:
    the checkpoint's weights, factored for a low-rank `--model` (`pretrained.initial_params`; a calibrated
    `--init-factor` fits the training split of `--data`, encoded with the model's tokenizer)."""
    from boostjax.config import validate as validate_fields
    from boostjax.data import tokenize as tz
    from boostjax.data.source import resolve_source
    from boostjax.inference.evaluation import eval_data
    from boostjax.interop import pretrained

    path = args.init_from_hf
    seq = args.seq if args.seq is not None else field_default("seq")
    batch = args.batch if args.batch is not None else field_default("batch")
    check_batch_seq(batch, seq, "eval")
    if args.doc_sep is not None and args.doc_sep not in tz.DOC_SEPS:
        raise ConfigError(f"eval.doc_sep: unknown {args.doc_sep!r}; fix: pass one of {', '.join(tz.DOC_SEPS)}")
    given = {n: getattr(args, n) for n in START_FIELDS if getattr(args, n) is not None}
    dtype = args.data_dtype if args.data_dtype is not None else field_default("data_dtype")
    try:
        cfg = pretrained.config_from_flags({**given, "seq": seq, "batch": batch, "data": args.data,
                                            "data_dtype": dtype, "out": os.devnull},  # no run folder
                                           preset_given=False)
        if seq > cfg.model.max_seq_len:  # the checkpoint's: not a flag to raise
            raise ConfigError(f"eval.seq: {seq} exceeds the model's max_seq_len {cfg.model.max_seq_len}; fix: pass "
                              f"--seq <= {cfg.model.max_seq_len}")
        validate_fields(cfg)
    except ConfigError as e:
        raise _renamed(e) from None
    try:
        tok = pretrained.checkpoint_tokenizer(path)
    except ConfigError as e:
        raise _renamed(e) from None
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"eval.init_from_hf: the tokenizer of {path} has {tok.vocab_size} ids but the model "
                          f"{cfg.model.vocab_size}; fix: restore the model's own tokenizer")
    try:
        src = resolve_source(args.data, dtype)
    except ValueError:  # records: encoded with the model's tokenizer by eval_data
        src = None
    if src is not None and src.kind == "tokens":
        try:
            pretrained.check_source_tokenizer(cfg, src)
        except ConfigError as e:
            raise ConfigError("eval.data: " + str(e).removeprefix(f"{pretrained.SOURCE_FIELD}: ")) from None
    d = eval_data(tok, args.data, args.split, args.doc_sep, dtype, args.text_field)
    corpus = _factoring_corpus(args, cfg, tok, d, dtype) if cfg.model.low_rank else None
    from boostjax.inference.evaluation import evaluate  # starts JAX
    from boostjax.interop.hf import build_model

    from boostjax.runtime.interrupt import StopSignals
    from boostjax.runtime.signals import TrainingInterrupted

    progress = args.progress if args.progress is not None else field_default("progress")
    try:  # reading and factoring a checkpoint takes minutes: its phases speak, and a signal stops them
        with StopSignals(bars=progress, early="before scoring; nothing was written"):
            params, report = pretrained.initial_params(cfg, corpus=corpus)
    except ConfigError as e:
        raise _renamed(e) from None
    except TrainingInterrupted as e:
        print(f"boostjax: {e}", file=sys.stderr)
        return e.exit_code
    print(f"boostjax: {pretrained.summary_line(report)}", file=sys.stderr)
    model = build_model(cfg.model, params)
    res = evaluate(model, d.tokens, seq=seq, batch=batch, n_bytes=d.n_bytes, progress=progress)
    m, t = cfg.model, cfg.train
    start = {"source": path, "kind": m.kind, **({"rank": m.rank, "init_factor": t.init_factor} if m.low_rank else {}),
             **{k: v for k, v in report.items() if k in ("ranks", "dense", "mean", "max", "format")}}
    res = {"run": None, "init_from_hf": path, "start": start, "step": 0, "data": f"{d.name} ({d.split} split)",
           "split": d.split, "scored": d.scored, "documents": d.documents, "training_data": None, "seq": seq, **res}
    what = (f"the {m.kind} rank {m.rank} start ({t.init_factor} factoring) of {path}" if m.low_rank
            else f"the pretrained start {path}")
    _print(args.json, res, d.scored, what)
    return 0


def _factoring_corpus(args: argparse.Namespace, cfg, tok, d, dtype: str):
    """The `Corpus` a low-rank start is factored on, as train factors it: a calibrated `--init-factor` fits
    the training split of `--data`; the output errors are measured on the scored tokens `d`."""
    from boostjax.data.corpus import Corpus
    from boostjax.inference.evaluation import eval_data

    train = d.tokens
    if cfg.train.init_factor in CALIBRATED_FACTORS:
        train = d.tokens if d.split == "train" else eval_data(tok, args.data, "train", args.doc_sep, dtype,
                                                                args.text_field).tokens
        if cfg.train.calib_tokens > len(train):
            raise ConfigError(f"eval.calib_tokens: {cfg.train.calib_tokens} calibration tokens exceed the "
                              f"{len(train)} tokens of the training split of {args.data}; fix: pass "
                              f"--calib-tokens {len(train)} or fewer (0 = the default or the whole split)")

    def as_ids(a):
        return a if a.dtype.name in ("uint8", "uint16", "uint32") else a.astype(np.uint32)

    return Corpus(as_ids(np.asarray(train)), as_ids(np.asarray(d.tokens)), d.name)


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
        "eval", help="loss, perplexity, bits/byte of a run (or of a pretrained start) on the validation split of "
                     "--data (--split all: all of it)",
        description="Score a run's checkpoint (--run), or the start boostjax train --init-from-hf would begin from "
                    "(--init-from-hf MODEL, with --model/--rank/--init-factor as train takes them; not trained), on "
                    "the part of --data that --split names: by default the validation split the trainer holds out "
                    "of that data (the same documents and tokens), also for a text file or folder; it prints which "
                    "part it scored.")
    p.add_argument("--run", default=None,
                   help="run folder written by boostjax train (--out); or --init-from-hf instead")
    add_field(p, "init_from_hf")  # train's, read the same way; scored at step 0, without training
    for name in START_FIELDS[1:]:  # train's flags that build the start, with train's defaults and choices
        add_field(p, name)
    p.add_argument("--data", required=True,
                   help="a folder written by boostjax tokenize (with the run's tokenizer), a text file or folder of "
                        "text files, JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet or Arrow files or a Hugging Face "
                        "datasets folder (encoded with the run's tokenizer; every 50th record is the validation "
                        "split), a .bin token file or '' (the built-in corpus); --split says which part is scored")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--seq", type=int, default=None,
                   help="predicted tokens per window (default: the run's --seq; with --init-from-hf train's default, "
                        f"{field_default('seq')})")
    p.add_argument("--batch", type=int, default=None,
                   help="windows per forward pass (default: the run's --batch; with --init-from-hf train's default, "
                        f"{field_default('batch')})")
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
