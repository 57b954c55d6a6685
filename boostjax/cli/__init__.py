"""The `boostjax` command line: a thin layer over the Python API, one module per subcommand.

Each subcommand module has `register(subparsers)`; `build_parser` collects them. Building the parser
imports no JAX: every command imports the library inside its handler, after the device count is set
(`boostjax.runtime.devices.simulate_for_mesh`). Bad input exits with status 2 and one line naming
the field and the fix (`boostjax.cli.driver`), before anything is compiled or written.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from boostjax.runtime.signals import defer_signals


def build_parser() -> argparse.ArgumentParser:
    from boostjax.cli import comm, evaluate, export, generate, launch, plan, tokenize, train

    parser = argparse.ArgumentParser(
        prog="boostjax", description="Train low-rank bottleneck LLMs (CoLA, SVD, LaX) and full-rank LLaMA in JAX."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (train, export, comm, plan, launch, tokenize, evaluate, generate):
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from boostjax.cli.driver import run

    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["train"]:  # before the slow imports: a signal is recorded, and acted on by the run
        restore = defer_signals()
        try:
            return run(build_parser(), argv)
        finally:
            if argv is not None:  # in-process caller: its handlers come back (a process keeps deferring
                restore()         # until it exits, so its final print and shutdown are never interrupted)
    return run(build_parser(), argv)
