"""Every code reference in the README and docs/*.md points into the repository: file paths
(`boostjax/training/step.py`, `tests/test_tp.py`, `boostjax/placement/`), dotted names
(`boostjax.analysis.comm.compiled_step`: the module exists and defines the name) and relative links.
Outputs that scripts write (`experiments/results/...`) are not checked."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w./-])((?:boostjax|tests|experiments|docs|notebooks)/[\w./{},*-]*[\w/}*])")
DOTTED = re.compile(r"(?<![\w./-])boostjax(?:\.[A-Za-z_]\w*)+")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _expand(path: str) -> list[str]:
    """`a.{json,md}` -> [`a.json`, `a.md`]."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[: m.start()] + alt + path[m.end():])]


def _exists(path: str) -> bool:
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


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
                target = m.group(1).split("#")[0]
                if target and ":" not in target:
                    out.append((where, i, target, (doc.parent / target).exists()))
    return out


def test_the_reference_reader_finds_paths_names_and_links():
    assert _expand("experiments/results/x.{json,md}") == ["experiments/results/x.json", "experiments/results/x.md"]
    assert _dotted_ok("boostjax.analysis.comm.compiled_step") and _dotted_ok("boostjax.train")
    assert not _dotted_ok("boostjax.analysis.comm.no_such_name") and not _dotted_ok("boostjax.no_such_module")
    assert _exists("boostjax/models/") and not _exists("boostjax/no_such_file.py")
    found = {ref for _, _, ref, _ in references()}
    assert {"boostjax/training/step.py", "tests/test_imports.py", "data.md"} <= found


def test_every_code_reference_in_the_docs_exists():
    missing = [f"{f}:{i}: {ref}" for f, i, ref, ok in references() if not ok]
    assert not missing, "references to nothing in the repository:\n" + "\n".join(missing)
