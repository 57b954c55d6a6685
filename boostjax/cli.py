"""`boostjax` command line: a thin layer over the Python API.

Every `ModelConfig` / `TrainConfig` field is a flag (`--d-model`, `--lr`, ...); `--model` selects the
model kind and `--preset` the shapes. Bad configurations exit with status 2 and one line naming
the field and the fix, before JAX compiles anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any, Callable, Sequence

from boostjax.config import (PRESETS, Config, ConfigError, ModelConfig, TrainConfig,
                             mesh_text, preset, validate)

_RENAMED = {"kind": "model"}  # config field -> flag name where they differ
_HELP = {
    "kind": "model kind: dense LLaMA or a low-rank variant (default with --init-from-hf: llama)",
    "n_kv_heads": "key/value heads for grouped-query attention (0 = n_heads)",
    "rank": "rank r of every low-rank projection",
    "attention": "attention kernel: auto (cudnn on a CUDA GPU in bf16, else chunked), xla (materialised scores), "
                 "cudnn (cuDNN flash attention), chunked (blockwise, no t x t buffer)",
    "attention_block": "query/key positions per tile of the chunked attention",
    "dtype": "compute dtype (parameters stay fp32)",
    "data": "corpus: '' = this Python's standard library sources; a folder written by boostjax tokenize (its "
            "meta.json gives the dtype and, without --vocab-size, the vocabulary), a .bin token file, a text file "
            "or a folder of text files",
    "strategy": "tensor-parallel strategy",
    "mesh": "device mesh, e.g. data=2,stage=2,model=4 ('' = one device; CPU devices are simulated as needed)",
    "microbatches": "pipeline micro-batches per data shard when the mesh has stage > 1 (0 = auto: the largest "
                    "divisor of the shard's batch that is <= 4 x stages)",
    "pipeline_schedule": "pipeline schedule when the mesh has stage > 1: gpipe (all forwards, then all backwards; "
                         "activations of every micro-batch) or 1f1b (one forward, one backward; activations of "
                         "2 x stages - 1 micro-batches); the same bubble (P-1)/(M+P-1)",
    "grad_accum": "micro-batches of --batch rows per optimizer step (a lax.scan sums their gradients); the "
                  "effective batch is batch x grad_accum",
    "zero": "data-parallel state sharding (ZeRO): 0 replicated, 1 optimizer state split over data, 3 parameters too",
    "remat": "rematerialisation: none, full (per block), lowrank (keep r-dim latents, no collective recomputed)",
    "out": "run folder (config.json, metrics.jsonl, checkpoints/); an existing run there is resumed",
    "offload_plan": "plan.json from boostjax plan: per-layer remat/offload policies, host-resident params/optimizer",
    "coordinator": "multi-host: HOST:PORT of process 0 ('' = from BOOSTJAX_COORDINATOR or SLURM/Open MPI)",
    "num_processes": "multi-host: processes in the job (0 = from the environment; 1 = one process)",
    "process_id": "multi-host: this process's index, 0..num_processes-1 (-1 = from the environment)",
    "init_timeout": "multi-host: seconds to wait for every process of the job to join before giving up",
    # item 3 (Hugging Face interop)
    "rope_type": "RoPE scaling: default (none), linear (positions / factor), dynamic (NTK: larger base beyond "
                 "max_seq_len), llama3 (Llama 3.1 frequency bands)",
    "rope_factor": "RoPE scaling factor of linear / dynamic / llama3 (1 = none)",
    "rope_low_freq_factor": "llama3 RoPE: wavelengths above original_max_len / this are divided by the factor",
    "rope_high_freq_factor": "llama3 RoPE: wavelengths below original_max_len / this are kept",
    "rope_original_max_len": "llama3 RoPE: the pretraining context (original_max_position_embeddings; 0 = max_seq_len)",
    "attn_head_dim": "width of one attention head (0 = d_model / n_heads)",
    "tie_embeddings": "the LM head is the embedding transposed (no separate head parameter; no TP or pipeline)",
    "bos_token_id": "beginning-of-sequence token id written to exports (-1 = none)",
    "eos_token_ids": "end-of-sequence token id(s), comma-separated, written to exports and used by generation",
    "pad_token_id": "padding token id written to exports (-1 = none)",
    "tensorboard": "write TensorBoard event files (the metrics.jsonl scalars) into OUT/tensorboard/",
    "profile": "START:STOP: a jax.profiler trace of steps START..STOP-1 (0-based) into OUT/profile/ ('' = none)",
    "hardware": "hardware profile for the MFU metric (peak BF16 FLOP/s per device), e.g. H800-80GB, A100-80GB, "
                "RTX3090-24GB; '' = detect from the device (none on a CPU)",
    "doc_mask": "mask attention at document boundaries: batches of packed documents carry a document id per "
                "token, and a token attends only to its own document (needs data with documents: the "
                "built-in corpus, a folder or a tokenised folder)",
    "init_from_hf": "start a new run from a Hugging Face LLaMA folder (its shapes; --model svd/cola/lax --rank r "
                    "factors each projection by truncated SVD; init_report.json holds the errors)",
}


def _add_fields(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One flag per field: a bool is --x/--no-x, a `Literal` offers its values as choices, the mesh is
    text (TrainConfig parses it, once)."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + _RENAMED.get(f.name, f.name).replace("_", "-")
        kind = hints[f.name]
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": _HELP.get(f.name, "")}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is typing.Literal:
            kw["choices"] = typing.get_args(kind)
            kw["type"] = type(kw["choices"][0])
        else:
            kw["type"] = kind if kind in (int, float) else str
        default = mesh_text(f.default) if f.name == "mesh" else f.default
        kw["help"] = (kw["help"] + f" (default: {default!r})").strip()
        group.add_argument(flag, **kw)


def _config(args: argparse.Namespace) -> Config:
    names = lambda cls: {f.name for f in dataclasses.fields(cls)}  # noqa: E731
    given = {k: v for k, v in vars(args).items() if v is not None}
    if given.get("init_from_hf"):  # the shapes are the checkpoint's (boostjax.pretrained)
        from boostjax.pretrained import config_from_flags  # noqa: PLC0415 (imports no JAX at module level)

        return validate(config_from_flags(given, preset_given=args.preset is not None))
    if "vocab_size" not in given:  # a tokenised --data folder names its vocabulary (item 1)
        from boostjax.tokenize import vocab_from_data  # noqa: PLC0415 (numpy only)

        vocab = vocab_from_data(given.get("data"))
        if vocab is not None:
            given["vocab_size"] = vocab
    model = preset(args.preset or "tiny", **{k: v for k, v in given.items() if k in names(ModelConfig)})
    train = TrainConfig(**{k: v for k, v in given.items() if k in names(TrainConfig)})
    return validate(Config(model, train))


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = _config(args)
    from boostjax.devices import simulate_for_mesh  # noqa: PLC0415
    from boostjax.multihost import is_main_process, setup  # noqa: PLC0415 (imports no JAX at module level)

    if setup(cfg.train) is None:  # a multi-host job simulates each process's share of the devices
        simulate_for_mesh(cfg.train.mesh)
    from boostjax.interrupt import TrainingInterrupted  # noqa: PLC0415
    from boostjax.train import NonFiniteLoss, train  # noqa: PLC0415 (after the device count is set)

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

    p = sub.add_parser("train", help="train a model (resumes if --out holds a run)")
    p.add_argument("--preset", default=None, help=f"model shapes: one of {', '.join(PRESETS)} (default: tiny)")
    _add_fields(p, ModelConfig, "model (override the preset)")
    _add_fields(p, TrainConfig, "training")
    p.set_defaults(func=_cmd_train)

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

    from boostjax.sharding import comm  # noqa: PLC0415 (imports no JAX at module level)

    comm.register(sub)
    from boostjax.offload import cli as plan_cli  # noqa: PLC0415 (imports no JAX at module level)

    plan_cli.register(sub)
    from boostjax import launch  # noqa: PLC0415 (imports no JAX at module level)

    launch.register(sub)
    from boostjax.evaluate import register as register_eval  # noqa: PLC0415 (imports no JAX at module level)
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
    from boostjax.config import one_line_parse_errors  # noqa: PLC0415

    def one_line(e: BaseException) -> str:
        return " ".join(str(e).split())

    parser = one_line_parse_errors(build_parser())
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help exits 0; a bad command line was reported in one line
        if e.code in (0, None):
            raise
        return 2
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:  # Ctrl-C before a run installs its own handler: nothing was saved
        print(f"boostjax: {args.command}: interrupted before any training step; nothing was saved",
              file=sys.stderr)
        return 130
    except ConfigError as e:
        print(f"boostjax: error: {one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:  # last resort: a file the command could not read or write, named
        if e.errno is None:  # raised with our own message (e.g. run: no config.json in ...)
            print(f"boostjax: error: {one_line(e)}", file=sys.stderr)
        else:
            where = e.filename if e.filename is not None else args.command
            print(f"boostjax: error: {where}: {e.strerror or type(e).__name__}; fix: check the path, its "
                  "permissions and the free disk space", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"boostjax: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
