"""`boostjax export-hf`: a run's checkpoint as a Hugging Face folder: a dense run in LLaMA layout, a
low-rank run as its factors with the modeling code transformers loads (or, svd with `--densify`, as
the dense LLaMA of `W = A B`)."""

from __future__ import annotations

import argparse


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from boostjax.interop.hf import hf_config, parse_size, to_hf
    from boostjax.interop.hf_lowrank import check_lowrank_exportable, to_hf_lowrank
    from boostjax.runs.load import load_run, read_config
    from boostjax.runs.folder import check_export_target

    check_export_target(args.out)
    shard = args.max_shard_size.strip()
    if shard not in ("", "0"):
        parse_size(shard)
    # refused before any checkpoint is read: a kind with no export, or a densify that has no dense form
    stored = read_config(args.run).model
    if stored.low_rank:
        check_lowrank_exportable(stored, args.densify)
    else:
        hf_config(stored)
    cfg, model, step = load_run(args.run, args.step)
    # the run folder's tokenizer.json / generation_config.json (if any) go along
    size = 0 if shard in ("", "0") else shard
    if cfg.model.low_rank:
        path = to_hf_lowrank(model, args.out, dtype=args.dtype, max_shard_size=size, source=args.run,
                             densified=args.densify)
        layout = ("Hugging Face LLaMA layout (densified: W = A B)" if args.densify else
                  "its factors (load with trust_remote_code=True)")
    else:
        path = to_hf(model, args.out, dtype=args.dtype, max_shard_size=size, source=args.run)
        layout = "Hugging Face LLaMA layout"
    print(f"exported step {step} of {args.run} ({cfg.model.kind}) to {path} as {layout}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("export-hf", help="a run's checkpoint as a Hugging Face folder (LLaMA layout, or a "
                                         "low-rank model's factors with their modeling code)")
    p.add_argument("--run", required=True, help="run folder written by boostjax train (--out)")
    p.add_argument("--out", required=True, help="folder for model.safetensors and config.json (new, empty, or an "
                                                "earlier export: nothing else is overwritten)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weight dtype of the export (bfloat16 halves the files; boostjax reads either)")
    p.add_argument("--max-shard-size", default="0",
                   help="split the weights into shards of at most this size, e.g. 5GB or 500MB, listed by "
                        "model.safetensors.index.json (0 = one model.safetensors)")
    p.add_argument("--densify", action="store_true",
                   help="an svd run as a plain LLaMA (each projection W = A B; loads without remote code); "
                        "cola and lax are refused (the SiLU between A and B has no dense equivalent); a dense "
                        "run is exported as without it")
    p.set_defaults(func=_cmd_export_hf)
