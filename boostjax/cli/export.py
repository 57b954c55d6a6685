"""`boostjax export-hf`: a full-rank run's checkpoint in Hugging Face LLaMA layout."""

from __future__ import annotations

import argparse


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from boostjax.interop.hf import hf_config, parse_size, to_hf
    from boostjax.runs.load import load_run, read_config
    from boostjax.runs.folder import check_export_target

    check_export_target(args.out)
    shard = args.max_shard_size.strip()
    if shard not in ("", "0"):
        parse_size(shard)
    hf_config(read_config(args.run).model)  # a low-rank run is refused before its checkpoints are read
    cfg, model, step = load_run(args.run, args.step)
    # the run folder's tokenizer.json / generation_config.json (if any) go along
    path = to_hf(model, args.out, dtype=args.dtype, max_shard_size=0 if shard in ("", "0") else shard,
                 source=args.run)
    print(f"exported step {step} of {args.run} ({cfg.model.kind}) to {path} in Hugging Face LLaMA layout")
    return 0


def register(sub) -> None:
    p = sub.add_parser("export-hf", help="a full-rank run's checkpoint in Hugging Face LLaMA layout")
    p.add_argument("--run", required=True, help="run folder written by boostjax train (--out)")
    p.add_argument("--out", required=True, help="folder for model.safetensors and config.json")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weight dtype of the export (bfloat16 halves the files; boostjax reads either)")
    p.add_argument("--max-shard-size", default="0",
                   help="split the weights into shards of at most this size, e.g. 5GB or 500MB, listed by "
                        "model.safetensors.index.json (0 = one model.safetensors)")
    p.set_defaults(func=_cmd_export_hf)
