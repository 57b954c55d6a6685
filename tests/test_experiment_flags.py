"""Every flag of every experiment script says what it does: each `experiments.<system>.<name>` module
that builds its command line in a `parser()` function is imported (importing runs nothing) and every
option of that parser but -h has non-empty help text (hidden ones, `argparse.SUPPRESS`, excepted) that
`--help` renders; a bad command line is one line and exit status 2."""

from __future__ import annotations

import argparse
import ast
import importlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _with_parser() -> list[str]:
    """The dotted names of the experiment modules that define a top-level `parser()`."""
    names = []
    for path in sorted((ROOT / "experiments").glob("*/*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "parser" for n in tree.body):
            names.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return names


MODULES = _with_parser()


def test_the_scripts_are_found():
    assert len(MODULES) >= 25 and "experiments.speed.gemm_peak" in MODULES


def test_every_script_builds_its_flags_in_parser():
    """A script (a top-level `main`) keeps its command line in `parser()`, so the test below reads it."""
    bare = []
    for path in sorted((ROOT / "experiments").glob("*/*.py")):
        names = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
        if "main" in names and "parser" not in names:
            bare.append(str(path.relative_to(ROOT)))
    assert not bare, f"scripts whose flags are built inside main(): {bare}"


def _parser(name: str) -> argparse.ArgumentParser:
    env = dict(os.environ)
    try:
        return importlib.import_module(name).parser()
    finally:  # a script may set its XLA flags or thread counts on import: not this process's
        os.environ.clear()
        os.environ.update(env)


@pytest.mark.parametrize("name", MODULES)
def test_a_bad_command_line_is_one_line(name, capsys):
    ap = _parser(name)
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--no-such-flag"])
    err = capsys.readouterr().err
    # (a script with required flags names those first)
    assert e.value.code == 2 and err.count("\n") == 1 and "fix:" in err, err
    assert "--no-such-flag" in err or "required" in err, err


@pytest.mark.parametrize("name", MODULES)
def test_every_flag_has_help(name):
    ap = _parser(name)
    assert isinstance(ap, argparse.ArgumentParser)
    flags = [a for a in ap._actions if not isinstance(a, argparse._HelpAction)]
    assert flags, f"{name}: parser() has no options"
    bare = [a.option_strings[0] if a.option_strings else a.dest for a in flags
            if a.help != argparse.SUPPRESS and not (a.help or "").strip()]
    assert not bare, f"{name}: these options have no help text: {bare}"
    assert all(a.option_strings[0] in ap.format_help() for a in flags if a.help != argparse.SUPPRESS)  # --help renders
