"""`boostjax train`: its flags (every `ModelConfig` / `TrainConfig` field, `--model` for the kind and
`--preset` for the shapes), the configuration they give (also read by `boostjax launch` before it starts
any process), and the handler. Building the flags imports no JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from boostjax.cli.flags import MODEL_FIELDS, TRAIN_FIELDS, add_fields, add_preset, given, model_from, train_from
from boostjax.config import Config, ModelConfig, TrainConfig, fields_with

FOLLOW_STORED = fields_with(ModelConfig, "follow-stored")  # = boostjax.runs.folder.FOLLOW_STORED


def train_config(args: argparse.Namespace) -> Config:
    """The validated `Config` of a parsed `train` command line (`--init-from-hf` takes the checkpoint's shapes)."""
    from boostjax.training.checks import validate  # JAX imported, its backend not started

    flags = given(args, (*MODEL_FIELDS, *TRAIN_FIELDS))
    if flags.get("init_from_hf"):  # the shapes are the checkpoint's (boostjax.interop.pretrained)
        from boostjax.interop.pretrained import config_from_flags  # imports no JAX at module level

        return validate(config_from_flags(flags, preset_given=args.preset is not None))
    over = {}
    if "vocab_size" not in flags:  # a tokenised --data folder names its vocabulary (item 1)
        from boostjax.data.tokenize import vocab_from_data  # numpy only

        vocab = vocab_from_data(flags.get("data"))
        if vocab is not None:
            over["vocab_size"] = vocab
    model = model_from(args, MODEL_FIELDS, **over)
    train = train_from(args, TRAIN_FIELDS)
    return validate(Config(_follow_stored(model, {**flags, **over}, train.out), train))


def _follow_stored(model: ModelConfig, given: dict[str, Any], out: str) -> ModelConfig:
    """A run folder's stored values of the model fields whose default changed (`FOLLOW_STORED`) when the
    command line does not give them: the same command resumes a run of an older boostjax unchanged."""
    from boostjax.runs.folder import RunFolder  # the library: imported by the handler, not the parser

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
    add_preset(p)
    add_fields(p, ModelConfig, "model (override the preset)")
    add_fields(p, TrainConfig, "training")
    return p


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = train_config(args)
    from boostjax.runtime.devices import simulate_for_mesh
    from boostjax.runtime.multihost import is_main_process, setup  # imports no JAX at module level

    if setup(cfg.train) is None:  # a multi-host job simulates each process's share of the devices
        simulate_for_mesh(cfg.train.mesh)
    from boostjax.runtime.interrupt import TrainingInterrupted
    from boostjax.training.trainer import NonFiniteLoss, train  # after the device count is set

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


def register(sub: Any) -> None:
    add_train_command(sub).set_defaults(func=_cmd_train)
