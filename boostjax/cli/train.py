"""`boostjax train`: its flags (every `ModelConfig` / `TrainConfig` field, `--model` for the kind and
`--preset` for the shapes), the configuration they give (also read by `boostjax launch` before it starts
any process), and the handler. Building the flags imports no JAX.

The configuration is resolved and the run prepared by the library (`boostjax.training.prepare`): the
command line only parses the flags, and runs the preparation's first stages (resolve, validate, set up
the processes) before `boostjax.training.trainer.train` opens the run folder and the data.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from boostjax.cli.flags import add_fields, add_preset
from boostjax.config import Config, ModelConfig, TrainConfig


def train_config(args: argparse.Namespace) -> Config:
    """The validated `Config` of a parsed `train` command line (`--init-from-hf` takes the checkpoint's shapes)."""
    from boostjax.training import checks  # JAX imported, its backend not started
    from boostjax.training.prepare import MODEL_FIELDS, TRAIN_FIELDS, resolve_config

    flags = {k: v for k, v in vars(args).items() if k in MODEL_FIELDS or k in TRAIN_FIELDS}
    return checks.validate(resolve_config(flags, args.preset))


def add_train_command(sub: Any) -> argparse.ArgumentParser:
    """Add `train` (its flags, no handler) to an argparse subparsers object; returns its parser."""
    p = sub.add_parser("train", help="train a model (resumes if --out holds a run)")
    add_preset(p)
    add_fields(p, ModelConfig, "model (override the preset)")
    add_fields(p, TrainConfig, "training")
    return p


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = train_config(args)
    from boostjax.runtime.multihost import is_main_process
    from boostjax.training.prepare import setup_processes

    setup_processes(cfg, simulate=True)  # a single process simulates the mesh's devices; before JAX starts
    from boostjax.runtime.signals import TrainingInterrupted
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
