"""The driver every `boostjax` command runs under: parse the command line (a bad one is reported in one
line, status 2), run the handler, and turn its `ConfigError` / `ValueError` / `OSError` into one line
`boostjax: error: <field>: <what>; fix: <how>` and status 2 (Ctrl-C before training: 130)."""

from __future__ import annotations

import argparse
import re
import sys
import typing
from typing import Any, Callable, Sequence

from boostjax.config import ConfigError, ModelConfig, field_names


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


def one_line_parse_errors(parser: Any) -> Any:
    """Make an argparse parser (and its subcommands' parsers) report a bad command line as one line,
    `boostjax: error: <field>: <what>; fix: see <prog> --help`, and exit with status 2 (argparse
    prints its usage block and the message on separate lines). Returns the parser."""
    model_fields = set(field_names(ModelConfig))

    def install(p: argparse.ArgumentParser, command: str | None) -> None:
        def error(message: str) -> typing.NoReturn:
            where = command or "boostjax"
            m = re.match(r"argument (\S+?)(?:/\S+)?: (.*)$", message, re.S)
            if m:
                name = m.group(1)
                action = next((a for a in p._actions
                               if name in a.option_strings or name in (a.dest, a.metavar)), None)
                dest = action.dest if action is not None else name.lstrip("-").replace("-", "_")
                if command is None:
                    where = dest
                elif command == "train" and dest != "preset":
                    where = f"{'model' if dest in model_fields else 'train'}.{dest}"
                elif command == "train":
                    where = dest
                else:
                    where = f"{command}.{dest}"
                message = m.group(2)
            text = " ".join(message.split())
            sys.stderr.write(f"boostjax: error: {where}: {text}; fix: see {p.prog} --help\n")
            sys.exit(2)

        p.error = error  # type: ignore[method-assign]
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    install(sub, name)

    install(parser, None)
    return parser
