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

from boostjax.cli.flags import add_train_flags
from boostjax.config import Config

EXAMPLES = """\
examples:
  # the tiny preset on this Python's standard library sources; the same command again resumes it
  boostjax train --steps 200 --out runs/first
  # a 60M CoLA model on a tokenised folder (boostjax tokenize), BOOST's bottleneck TP on 4 devices
  boostjax train --preset 60m --data data/my_texts --strategy btp --mesh data=2,model=2 --out runs/60m
  # a Hugging Face checkpoint factored at rank 179, fitted to its activations on --data
  boostjax train --init-from-hf smollm2/ --model svd --rank-attn 179 --rank-mlp 179 --init-factor whitened \\
      --data tok-smollm2/ --out runs/smollm2-svd
"""


def train_config(args: argparse.Namespace) -> Config:
    """The validated `Config` of a parsed `train` command line (`--init-from-hf` takes the checkpoint's shapes)."""
    from boostjax.training import checks  # JAX imported, its backend not started
    from boostjax.training.prepare import MODEL_FIELDS, TRAIN_FIELDS, resolve_config

    flags = {k: v for k, v in vars(args).items() if k in MODEL_FIELDS or k in TRAIN_FIELDS}
    return checks.validate(resolve_config(flags, args.preset))


def add_train_command(sub: Any) -> argparse.ArgumentParser:
    """Add `train` (its flags, no handler) to an argparse subparsers object; returns its parser."""
    p = sub.add_parser("train", help="train a model (resumes if --out holds a run)", epilog=EXAMPLES,
                       usage="%(prog)s [-h] [--preset NAME] [--data PATH] [--steps N] [--out DIR] [FLAG ...]",
                       description="Train a model, or resume the run in --out. Every configuration field is a flag.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_flags(p)
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
