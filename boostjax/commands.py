"""What the `boostjax` commands share: the `train` command's flags and configuration (also parsed by
`boostjax launch` before it starts any process), and the driver that runs a parsed command and turns
its errors into one line and an exit status (`boostjax.cli.main`, `python -m boostjax.analysis.comm`).

Every `ModelConfig` / `TrainConfig` field is a flag (`--d-model`, `--lr`, ...); `--model` selects the
model kind and `--preset` the shapes. This module imports no JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any, Callable, Sequence

from boostjax.config import (PRESETS, Config, ConfigError, ModelConfig, TrainConfig, mesh_text,
                             one_line_parse_errors, preset, validate)
from boostjax.runfolder import FOLLOW_STORED, RunFolder

_RENAMED = {"kind": "model"}  # config field -> flag name where they differ
_HELP = {
    "kind": "model kind: dense LLaMA or a low-rank variant (default with --init-from-hf: llama)",
    "n_kv_heads": "key/value heads for grouped-query attention (0 = n_heads)",
    "rank": "rank r of every low-rank projection",
    "only_lr_act": "cola/lax MLP hidden = gate * up, SiLU only inside the factor pairs (CoLA's published form); "
                   "--no-only-lr-act: silu(gate) * up (runs of boostjax before issue 15)",
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
    "rot_order": "rotation: 'previous' projects G_t on bases built from earlier gradients (SOAP); 'current' updates "
                 "the Gram EMA with G_t, refreshes if due (step 1, every rot_refresh steps), then projects (the "
                 "basis-rotation reference code)",
    "init_from_hf": "start a new run from a Hugging Face LLaMA folder (its shapes; --model svd/cola/lax --rank r "
                    "factors each projection by truncated SVD; init_report.json holds the errors)",
}


def add_fields(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """One flag per field of the config dataclass `cls` (`--d-model`, `--lr`, ...), in a group `title`: a bool
    is --x/--no-x, a `Literal` offers its values as choices, the mesh is text (TrainConfig parses it, once)."""
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


def train_config(args: argparse.Namespace) -> Config:
    """The validated `Config` of a parsed `train` command line (`--init-from-hf` takes the checkpoint's shapes)."""
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
    return validate(Config(_follow_stored(model, given, train.out), train))


def _follow_stored(model: ModelConfig, given: dict[str, Any], out: str) -> ModelConfig:
    """A run folder's stored values of the model fields whose default changed (`FOLLOW_STORED`) when the
    command line does not give them: the same command resumes a run of an older boostjax unchanged."""
    try:
        stored = RunFolder(out).stored_config() if isinstance(out, str) and out.strip() else None
    except (OSError, ValueError):  # an unreadable folder or config: the trainer names the problem
        stored = None
    if stored is None:
        return model
    keep = {k: getattr(stored.model, k) for k in FOLLOW_STORED if k not in given}
    return dataclasses.replace(model, **keep)


def add_train_command(sub: Any) -> argparse.ArgumentParser:
    """Add `train` (its flags, no handler) to an argparse subparsers object; returns its parser."""
    p = sub.add_parser("train", help="train a model (resumes if --out holds a run)")
    p.add_argument("--preset", default=None, help=f"model shapes: one of {', '.join(PRESETS)} (default: tiny)")
    add_fields(p, ModelConfig, "model (override the preset)")
    add_fields(p, TrainConfig, "training")
    return p


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse `argv` (a bad command line: one line, status 2) and run the command's `func`: a `ConfigError`,
    `ValueError` or `OSError` becomes `boostjax: error: ...` and status 2, Ctrl-C before training 130."""
    def one_line(e: BaseException) -> str:
        return " ".join(str(e).split())

    parser = one_line_parse_errors(parser)
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
