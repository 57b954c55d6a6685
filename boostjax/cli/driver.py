"""The driver every `boostjax` command runs under: parse the command line (a bad one is reported in one
line, status 2), run the handler, and turn its `ConfigError` / `ValueError` / `OSError` into one line
`boostjax: error: <field>: <what>; fix: <how>` and status 2 (Ctrl-C before training: 130)."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import typing
from typing import Any, Callable, Sequence

from boostjax.config import ConfigError, ModelConfig, field_names


class Parser(argparse.ArgumentParser):
    """The parser of `boostjax` and of each subcommand (its subparsers are `Parser`s too): no prefix
    abbreviations (`--step` is not `--steps`), a bad command line in one line `boostjax: error: <field>:
    <what>; fix: see <prog> --help` and status 2, an unknown flag with the closest one named."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    @property
    def command(self) -> str | None:
        """The subcommand this parser reads (`train` for prog `boostjax train`); None for `boostjax` itself."""
        return self.prog.partition(" ")[2] or None

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: Any = None) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            sub = self._chosen(parsed)
            hint = suggest(unknown, option_strings(sub) | option_strings(self))
            sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
        return parsed

    def _chosen(self, parsed: argparse.Namespace) -> "Parser":
        """The subcommand's parser the command line chose (this parser when it has none)."""
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction) and getattr(parsed, a.dest, None) in a.choices:
                return a.choices[getattr(parsed, a.dest)]
        return self

    def error(self, message: str) -> typing.NoReturn:
        where, text = self._field(message)
        sys.stderr.write(f"boostjax: error: {where}: {text}; fix: see {self.prog} --help\n")
        sys.exit(2)

    def _field(self, message: str) -> tuple[str, str]:
        """(field, what) of an argparse message: `train.steps` for a bad `--steps` (`model.d_model` for
        a model field), the command for the rest; an invalid choice names the closest one."""
        command = self.command
        m = re.match(r"argument (\S+?)(?:/\S+)?: (.*)$", message, re.S)
        if not m:
            return command or "command", " ".join(message.split())
        name, text = m.group(1), " ".join(m.group(2).split())
        action = next((a for a in self._actions if name in a.option_strings or name in (a.dest, a.metavar)), None)
        dest = action.dest if action is not None else name.lstrip("-").replace("-", "_")
        choice = re.match(r"invalid choice: '?([^'\s]*)'?", text)
        if choice and action is not None and action.choices:
            close = difflib.get_close_matches(choice.group(1), [str(c) for c in action.choices], n=1)
            text += f" (did you mean {close[0]}?)" if close else ""
        if command is None or command == "train" and dest == "preset":
            return dest, text
        if command == "train":
            return f"{'model' if dest in _MODEL_FIELDS else 'train'}.{dest}", text
        return f"{command}.{dest}", text


_MODEL_FIELDS = frozenset(field_names(ModelConfig))


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """The flags a parser shows in its help (`--steps`, `--no-progress`, ...; hidden aliases left out)."""
    return {s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings}


def suggest(unknown: Sequence[str], known: set[str]) -> str:
    """` (did you mean --steps?)` for the unknown flags among `unknown` that start a known flag or are
    close to one (difflib, on the names without their dashes); '' when none is."""
    names = {k.lstrip("-"): k for k in known}
    hints = []
    for word in unknown:
        flag = word.partition("=")[0]
        if not flag.startswith("-") or flag in known:
            continue
        word = flag.lstrip("-")
        longer = sorted(n for n in names if n.startswith(word))  # an abbreviation: the flags it starts
        close = longer if 1 <= len(longer) <= 3 else difflib.get_close_matches(word, longer or names, n=1,
                                                                              cutoff=0.0 if longer else 0.6)
        if close:
            hints.append((flag, " or ".join(names[c] for c in close)))
    if not hints:
        return ""
    if len(hints) == 1:
        return f" (did you mean {hints[0][1]}?)"
    return " (" + ", ".join(f"{flag}: did you mean {near}?" for flag, near in hints) + ")"


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse `argv` (a bad command line: one line, status 2) and run the command's `func`: a `ConfigError`,
    `ValueError` or `OSError` becomes `boostjax: error: ...` and status 2, Ctrl-C before training 130."""
    def one_line(e: BaseException) -> str:
        return " ".join(str(e).split())

    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help and --version exit 0; a bad command line was reported in one line
        if e.code in (0, None):
            raise
        return 2
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:  # Ctrl-C before a run installs its own handler: nothing was saved
        what = ("before any training step; nothing was saved" if args.command in ("train", "launch")
                else "; the output is not finished: run the same command again" if args.command == "tokenize"
                else "")
        print(f"boostjax: {args.command}: interrupted {what}".rstrip().replace(" ;", ";"), file=sys.stderr)
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
