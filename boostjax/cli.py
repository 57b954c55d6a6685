"""`boostjax` command line: a thin layer over the Python API.

Every `ModelConfig` / `TrainConfig` field is a flag (`--d-model`, `--lr`, ...); `--model` selects the
model kind and `--preset` the shapes (`boostjax.commands`). Bad configurations exit with status 2 and
one line naming the field and the fix, before JAX compiles anything. Each command registers itself
(`register(subparsers)` in its module); none imports this module back.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from boostjax.commands import add_train_command, run, train_config


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = train_config(args)
    from boostjax.devices import simulate_for_mesh  # noqa: PLC0415
    from boostjax.multihost import is_main_process, setup  # noqa: PLC0415 (imports no JAX at module level)

    if setup(cfg.train) is None:  # a multi-host job simulates each process's share of the devices
        simulate_for_mesh(cfg.train.mesh)
    from boostjax.interrupt import TrainingInterrupted  # noqa: PLC0415
    from boostjax.trainer import NonFiniteLoss, train  # noqa: PLC0415 (after the device count is set)

    try:
        result = train(cfg)
    except NonFiniteLoss as e:
        print(f"boostjax: {e}", file=sys.stderr)
        return 1
    except TrainingInterrupted as e:
        if is_main_process():
            print(f"boostjax: {e}", file=sys.stderr)
        return e.exit_code
    if is_main_process():
        print(result.summary)
    return 0


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from boostjax.hf import hf_config, parse_size, to_hf  # noqa: PLC0415
    from boostjax.run import load_run, read_config  # noqa: PLC0415
    from boostjax.runfolder import check_export_target  # noqa: PLC0415

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="boostjax", description="Train low-rank bottleneck LLMs (CoLA, SVD, LaX) and full-rank LLaMA in JAX."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_train_command(sub).set_defaults(func=_cmd_train)

    p = sub.add_parser("export-hf", help="write a full-rank run's latest checkpoint in Hugging Face LLaMA layout")
    p.add_argument("--run", required=True, help="run folder written by boostjax train (--out)")
    p.add_argument("--out", required=True, help="folder for model.safetensors and config.json")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weight dtype of the export (bfloat16 halves the files; boostjax reads either)")
    p.add_argument("--max-shard-size", default="0",
                   help="split the weights into shards of at most this size, e.g. 5GB or 500MB, listed by "
                        "model.safetensors.index.json (0 = one model.safetensors)")
    p.set_defaults(func=_cmd_export_hf)

    from boostjax.analysis import comm  # noqa: PLC0415 (imports no JAX at module level)

    comm.register(sub)
    from boostjax.offload import cli as plan_cli  # noqa: PLC0415 (imports no JAX at module level)

    plan_cli.register(sub)
    from boostjax import launch  # noqa: PLC0415 (imports no JAX at module level)

    launch.register(sub)
    from boostjax.evaluation import register as register_eval  # noqa: PLC0415 (imports no JAX at module level)
    from boostjax.generate_cli import register as register_generate  # noqa: PLC0415
    from boostjax.tokenize import register as register_tokenize  # noqa: PLC0415

    register_tokenize(sub)
    register_eval(sub)
    register_generate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["train"]:  # before the slow imports: a signal is recorded, and acted on by the run
        from boostjax.interrupt import defer_signals  # noqa: PLC0415 (imports no JAX)

        restore = defer_signals()
        try:
            return _main(argv)
        finally:
            if argv is not None:  # in-process caller: its handlers come back (a process keeps deferring
                restore()         # until it exits, so its final print and shutdown are never interrupted)
    return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
