"""`boostjax eval`: loss, perplexity and bits per byte of a run's checkpoint on held-out text."""

from __future__ import annotations

import argparse
import json

from boostjax.cli.flags import add_field
from boostjax.config import ConfigError, check_batch_seq, field_default


def _cmd_eval(args: argparse.Namespace) -> int:
    from boostjax.inference.evaluation import eval_stream, evaluate
    from boostjax.data import tokenize as tz
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
    try:
        stream, n_bytes, what, starts = eval_stream(tok, args.data, args.split, args.doc_sep)
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg.replace("tokenize.", "eval.", 1) if msg.startswith("tokenize.") else msg) from None
    from boostjax.runs.load import load_run  # starts JAX

    cfg, model, step = load_run(args.run, args.step)
    progress = args.progress if args.progress is not None else field_default("progress")
    res = evaluate(model, stream, seq=seq, batch=batch, n_bytes=n_bytes, progress=progress,
                   doc_starts=starts if cfg.train.doc_mask else None)  # as the run was trained
    res = {"run": str(args.run), "step": step, "data": what, "seq": seq, **res}
    if args.json:
        print(json.dumps(res))
    else:
        bpb = f", {res['bits_per_byte']:.4f} bits/byte" if res["bits_per_byte"] is not None else ""
        print(f"eval: step {step} of {args.run} on {what}: loss {res['loss']:.4f}, perplexity "
              f"{res['perplexity']:.3f}{bpb} ({res['tokens']} tokens, {res['bytes']} bytes, seq {seq})")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="loss, perplexity and bits per byte of a run on held-out text")
    p.add_argument("--run", required=True, help="run folder written by boostjax train (--out)")
    p.add_argument("--data", required=True,
                   help="a folder written by boostjax tokenize (with the run's tokenizer), or a text file / folder "
                        "of text files (encoded with the run's tokenizer, evaluated whole)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--seq", type=int, default=None, help="predicted tokens per window (default: the run's --seq)")
    p.add_argument("--batch", type=int, default=None, help="windows per forward pass (default: the run's --batch)")
    p.add_argument("--split", default=None, choices=("train", "val"),
                   help="split of a tokenised folder (default: val)")
    p.add_argument("--doc-sep", default=None, choices=("file", "blank", "line"),
                   help="documents of a text file, as in boostjax tokenize (default: file for a folder, blank "
                        "for a single file)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_field(p, "progress")  # train's --progress/--no-progress, with train's default
    p.set_defaults(func=_cmd_eval)
