"""Every code reference in the README and docs/*.md points into the repository: file paths
(`boostjax/models/llama.py`, `tests/test_tp.py`, `boostjax/placement/`: a path ending in `/` must be a
folder), dotted names (`boostjax.analysis.comm.compiled_step`: the module exists and defines the name),
relative links, and `boostjax COMMAND` in code (a subcommand the CLI registers). Outputs that scripts
write (`experiments/results/...`) are not checked as paths; links to them are. The README's quickstart
holds its two commands verbatim, `.ci/run` runs the second, and the README links every docs/ note.
Everything is read from the working tree when the test runs: no path is listed here as an exception."""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import io
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w./-])((?:boostjax|tests|experiments|docs|notebooks)/[\w./{},*-]*[\w/}*])")
DOTTED = re.compile(r"(?<![\w./-])boostjax(?:\.[A-Za-z_]\w*)+")
LINK = re.compile(r"\]\(([^)\s]+)\)")
COMMAND = re.compile(r"(?<![\w.-])boostjax ([a-z][a-z0-9-]*)")
FENCE = re.compile(r"^```(\w*)")
INLINE = re.compile(r"`([^`\n]+)`")

# The quickstart, verbatim: the main training job, and the test suite (which `.ci/run` runs).
QUICKSTART_TRAIN = ("python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e . && .venv/bin/boostjax train "
                    "--strategy btp --mesh data=2,model=2 --out runs/quickstart")
QUICKSTART_TEST = ("python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e '.[test]' && "
                   ".venv/bin/python -m pytest -n 2")


def _expand(path: str) -> list[str]:
    """`a.{json,md}` -> [`a.json`, `a.md`]."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[: m.start()] + alt + path[m.end():])]


def _exists(path: str) -> bool:
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).is_dir() if path.endswith("/") else (ROOT / path).exists()


@functools.cache
def _names(module: str) -> frozenset[str]:
    """Top-level names a module defines or imports (for the package: also its lazy `_EXPORTS`)."""
    base = ROOT.joinpath(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    out: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
            if isinstance(node.value, ast.Dict) and any(getattr(t, "id", "") == "_EXPORTS" for t in
                                                        (node.targets if isinstance(node, ast.Assign) else [node.target])):
                out |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return frozenset(out)


def _dotted_ok(name: str) -> bool:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):  # the longest prefix that is a module or package
        base = ROOT.joinpath(*parts[:n])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return n == len(parts) or parts[n] in _names(".".join(parts[:n]))
    return False


@functools.cache
def subcommands() -> frozenset[str]:
    """The subcommands of the `boostjax` script, as its entry point registers them: the entry point is
    read from pyproject.toml and asked for `--help`, and every `add_parser` of a subparsers action is
    recorded (argparse's own method, wrapped for the call)."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["boostjax"]
    module, func = target.split(":")
    names: set[str] = set()
    add_parser = argparse._SubParsersAction.add_parser

    def recording(self, name, **kwargs):
        names.add(name)
        return add_parser(self, name, **kwargs)

    argparse._SubParsersAction.add_parser = recording
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            getattr(importlib.import_module(module), func)(["--help"])
    finally:
        argparse._SubParsersAction.add_parser = add_parser
    return frozenset(names)


def _code(text: str) -> list[tuple[int, str]]:
    """(line, code) for every line of a fenced block (not Python) and every inline code span."""
    out, lang = [], None
    for i, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line.strip())
        if m:
            lang = None if lang is not None else m.group(1)
            continue
        if lang is not None:
            if lang != "python":
                out.append((i, line))
        else:
            out += [(i, span) for span in INLINE.findall(line)]
    return out


def commands() -> list[tuple[str, int, str]]:
    """(file, line, subcommand) for every `boostjax COMMAND` written as code in the README and docs/."""
    out = []
    for doc in DOCS:
        where = doc.relative_to(ROOT).as_posix()
        for i, code in _code(doc.read_text()):
            for m in COMMAND.finditer(code):
                if not re.search(r"\b(from|import)\s+$", code[: m.start()]):
                    out.append((where, i, m.group(1)))
    return out


def references() -> list[tuple[str, int, str, bool]]:
    """(file, line, reference, exists) for every reference in the README and docs/."""
    out = []
    for doc in DOCS:
        text = re.sub(r"https?://\S+", "", doc.read_text())
        for i, line in enumerate(text.splitlines(), 1):
            where = doc.relative_to(ROOT).as_posix()
            for m in PATH.finditer(line):
                ref = m.group(1).rstrip(".,")
                if not ref.startswith("experiments/results/"):
                    out.append((where, i, ref, all(_exists(p) for p in _expand(ref))))
            for m in DOTTED.finditer(line):
                out.append((where, i, m.group(0), _dotted_ok(m.group(0))))
            for m in LINK.finditer(line):
                target, _, anchor = m.group(1).partition("#")
                if ":" in target:
                    continue
                path = doc.parent / target if target else doc
                if target:
                    out.append((where, i, target, path.exists()))
                if anchor and path.suffix == ".md" and path.exists():
                    out.append((where, i, m.group(1), anchor in _anchors(path)))
    return out


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation but `-` and `_`
    dropped, spaces to `-`."""
    heads = re.findall(r"^#+\s+(.*)$", re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no section '## {title}'"
    return m.group(1)


def test_the_reference_reader_finds_paths_names_links_and_commands():
    assert _expand("experiments/results/x.{json,md}") == ["experiments/results/x.json", "experiments/results/x.md"]
    assert _dotted_ok("boostjax.analysis.comm.compiled_step") and _dotted_ok("boostjax.train")
    assert not _dotted_ok("boostjax.analysis.comm.no_such_name") and not _dotted_ok("boostjax.no_such_module")
    assert _exists("boostjax/models/") and not _exists("boostjax/no_such_file.py")
    assert _exists("tests/test_docs.py") and not _exists("tests/test_docs.py/")  # a file is not a folder
    found = {ref for _, _, ref, _ in references()}
    assert {"boostjax/models/llama.py", "tests/test_imports.py", "data.md", "design.md#sharding-from-logical-axes"} <= found
    assert "hybrid-8-bit-adam---optimizer-adam8bit" in _anchors(ROOT / "docs" / "offload.md")
    assert {"train", "comm", "plan"} <= {c for _, _, c in commands()}
    code = dict(_code("a `boostjax train --x` b\n```python\nboostjax.train(cfg)\n```\n```bash\nboostjax eval\n```\n"))
    assert code == {1: "boostjax train --x", 6: "boostjax eval"}


def test_every_code_reference_in_the_docs_exists():
    missing = [f"{f}:{i}: {ref}" for f, i, ref, ok in references() if not ok]
    assert not missing, "references to nothing in the repository:\n" + "\n".join(missing)


def test_every_boostjax_command_in_the_docs_is_a_subcommand():
    known = subcommands()
    assert {"train", "eval", "generate", "tokenize", "plan", "comm", "launch", "export-hf"} <= known
    wrong = [f"{f}:{i}: boostjax {c}" for f, i, c in commands() if c not in known]
    assert not wrong, f"not subcommands of boostjax ({', '.join(sorted(known))}):\n" + "\n".join(wrong)


def test_the_quickstart_commands_are_verbatim_and_ci_runs_the_test_command():
    quickstart = _section((ROOT / "README.md").read_text(), "Quickstart")
    blocks = re.findall(r"^```bash\n(.*?)^```", quickstart, re.M | re.S)
    assert [b.strip() for b in blocks] == [QUICKSTART_TRAIN, QUICKSTART_TEST]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == QUICKSTART_TEST


def test_the_readme_links_every_docs_note():
    readme = (ROOT / "README.md").read_text()
    linked = {(ROOT / m.split("#")[0]).resolve() for m in LINK.findall(readme) if m.startswith("docs/")}
    unlinked = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, "docs notes the README does not link: " + ", ".join(unlinked)


def test_the_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
