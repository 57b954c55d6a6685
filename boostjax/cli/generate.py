"""`boostjax generate --run DIR --prompt TEXT`: continue a prompt with a trained run's model.

The run's tokenizer (its `tokenizer.json`, byte level without one) encodes the prompt, `boostjax.generate`
decodes with a KV cache (greedy by default; `--temperature`, `--top-k`, `--top-p`, `--seed` sample), and
the prompt plus the continuation are printed (`--json`: one JSON object: `run`, `step`, `kind`, `prompt`,
`completion`, `prompt_ids`, `new_ids` (up to the eos), `stopped_at_eos`, `generate_seconds` (the compile
included) and `settings`). Generation stops at the tokenizer's end-of-document token and at the run's
`eos_token_ids` (an imported checkpoint's). Every argument is checked before the checkpoint is read or
anything compiles.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def register(sub) -> None:
    """Add `boostjax generate` to the CLI's subcommands."""
    p = sub.add_parser("generate", help="continue a prompt with a run's model (greedy or sampled)")
    p.add_argument("--run", required=True, help="run folder written by boostjax train (--out)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy; > 0 samples (and --top-k, --top-p, --seed take effect) (default: 0)")
    p.add_argument("--top-k", type=int, default=0,
                   help="with --temperature > 0: sample among the k most likely tokens (0 = all) (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="with --temperature > 0: nucleus, the most likely tokens holding this much probability, "
                        "in (0, 1] (1 = all) (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="with --temperature > 0: random seed of the sampling "
                                                       "(default: 0)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    import numpy as np

    from boostjax.config import ConfigError
    from boostjax.inference.generation import check_prompt, check_sampling, generate
    from boostjax.runs.load import load_run, read_config
    from boostjax.data.tokenizers import load_tokenizer

    check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    if args.step is not None and args.step < 0:
        raise ConfigError(f"generate: --step must be >= 0, got {args.step}; fix: pass a checkpoint step or omit it")
    if not args.prompt:
        raise ConfigError("generate: the prompt is empty; fix: pass a non-empty --prompt TEXT")
    model_cfg = read_config(args.run).model
    tok = load_tokenizer(args.run)
    ids = check_prompt(tok.encode(args.prompt), args.max_new_tokens, model_cfg.vocab_size, model_cfg.max_seq_len)[0]
    # the end-of-sequence ids: the run's (from an imported checkpoint) and its tokenizer's, those the model can produce
    eos = sorted({*model_cfg.eos_ids, *([tok.eos_id] if getattr(tok, "eos_id", None) is not None else [])})
    eos = [i for i in eos if i < model_cfg.vocab_size]

    cfg, model, step = load_run(args.run, args.step)
    t0 = time.perf_counter()
    out = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, eos_id=eos or None)
    seconds = time.perf_counter() - t0
    new = out[len(ids):]
    hit = np.isin(new, eos)
    stopped = bool(hit.any())
    if stopped:
        new = new[: int(np.argmax(hit))]
    unknown = new >= tok.vocab_size  # a model whose vocabulary is larger than its tokenizer's
    if unknown.any():
        print(f"boostjax: generate: dropped {int(unknown.sum())} ids >= the tokenizer's vocabulary "
              f"({tok.vocab_size}) from the text", file=sys.stderr)
    completion = tok.decode(new[~unknown])
    if args.json:
        print(json.dumps({"run": str(args.run), "step": step, "kind": cfg.model.kind, "prompt": args.prompt,
                          "completion": completion, "prompt_ids": ids.tolist(), "new_ids": new.tolist(),
                          "stopped_at_eos": stopped, "generate_seconds": round(seconds, 3),  # compile included
                          "settings": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                                       "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed}}))
    else:
        print(args.prompt + completion)
    return 0
