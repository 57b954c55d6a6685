"""The `boostjax` command line: a thin layer over the Python API, one module per subcommand.

Each subcommand module has `register(subparsers)`; `build_parser` collects them in the order of a
workflow. Building the parser imports no JAX: every command imports the library inside its handler,
after the device count is set (`boostjax.runtime.devices.simulate_for_mesh`). Bad input exits with
status 2 and one line naming the field and the fix (`boostjax.cli.driver`), before anything is
compiled or written; no flag may be abbreviated.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from boostjax.runtime.signals import defer_signals

EPILOG = "Run boostjax COMMAND --help for a command's flags; flags are never abbreviated (--steps, not --step)."


def version_text() -> str:
    """`boostjax 0.1.0 (jax 0.10.2, Python 3.11.7)`: the installed versions, from package metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return f"boostjax {of('boostjax')} (jax {of('jax')}, Python {sys.version.split()[0]})"


class _Version(argparse.Action):
    """`--version`: print `version_text()` on stdout and exit 0 (read when asked, not when the parser is built)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_text())
        parser.exit()


class _OneLineHelp(argparse.HelpFormatter):
    """The command list of `boostjax --help`: each command's summary on its own line, never wrapped."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return [" ".join(text.split())]

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):  # argparse measures the commands 2 columns short
            widest = self._current_indent + 2 + max(map(len, action.choices))
            self._action_max_length = max(self._action_max_length, widest)


def build_parser() -> argparse.ArgumentParser:
    from boostjax.cli import comm, evaluate, export, generate, launch, plan, tokenize, train
    from boostjax.cli.driver import Parser

    parser = Parser(prog="boostjax", formatter_class=_OneLineHelp, epilog=EPILOG,
                    description="Train low-rank bottleneck LLMs (CoLA, SVD, LaX) and full-rank LLaMA in JAX.")
    parser.add_argument("--version", action=_Version, help="print the boostjax and jax versions and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (tokenize, train, evaluate, generate, export, plan, comm, launch):  # a workflow's order
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
