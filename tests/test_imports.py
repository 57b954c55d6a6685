"""The package's import structure, read from the source with `ast` (every import statement, including
function-local ones): no import cycle, the layers (config -> models -> optim / sharding / offload ->
placement -> step -> training loop / CLI) never import upwards, and no submodule shadows an exported
function. `python tests/test_imports.py` prints the cycles, the upward imports the tests refuse, and
every arrow to a higher layer."""

from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path

import boostjax

PACKAGE = Path(boostjax.__file__).parent


def _module_files() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package `__init__`), for every .py file of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {boostjax module it imports: first line}. `from boostjax import x` and
    `from boostjax.pkg import x` count as importing the submodule `x` when there is one."""
    files = _module_files()

    def known(name: str) -> str | None:  # the longest existing module prefix of a dotted name
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for mod, (path, is_pkg) in files.items():
        here = mod if is_pkg else mod.rpartition(".")[0]
        deps: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names if a.name.split(".")[0] == "boostjax"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from . import x / from ..pkg import x
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    full = ".".join(base + ([node.module] if node.module else []))
                else:
                    full = node.module or ""
                if full.split(".")[0] == "boostjax":
                    targets = [f"{full}.{a.name}" if f"{full}.{a.name}" in files else known(full) for a in node.names]
            for t in targets:
                if t is not None and t != mod:
                    deps.setdefault(t, node.lineno)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def describe(graph: dict[str, dict[str, int]], comp: list[str]) -> str:
    edges = [f"{a} -> {b} (line {ln})" for a in comp for b, ln in sorted(graph[a].items()) if b in comp]
    return "{" + ", ".join(comp) + "}: " + "; ".join(edges)


# the layers, bottom to top (top-level name -> rank); modules not named here sit beside them
LAYERS = {"config": 0, "models": 1, "optim": 2, "sharding": 2, "offload": 2, "placement": 3, "step": 4,
          "trainer": 5, "cli": 5, "commands": 5, "launch": 5, "analysis": 5}
ABOVE_MODELS = {name for name, rank in LAYERS.items() if rank > LAYERS["models"]}


def _top(mod: str) -> str:
    return mod.removeprefix("boostjax.").split(".")[0]


def upward_imports(graph: dict[str, dict[str, int]], every_layer: bool = False) -> list[str]:
    """Imports that break the layering. Asserted: `models` import nothing from optim / sharding /
    offload / placement / step / the loop, and `config` imports only boostjax modules that import
    nothing from boostjax. `every_layer=True` lists every arrow to a higher layer of `LAYERS`."""
    bad = []
    for mod, deps in sorted(graph.items()):
        for dep, line in sorted(deps.items()):
            lo, hi = LAYERS.get(_top(mod)), LAYERS.get(_top(dep))
            if every_layer and lo is not None and hi is not None and hi > lo:
                bad.append(f"{mod} -> {dep} (line {line}): layer {lo} imports layer {hi}")
            elif not every_layer and _top(mod) == "models" and _top(dep) in ABOVE_MODELS:
                bad.append(f"{mod} -> {dep} (line {line}): models import nothing above them")
            elif not every_layer and mod == "boostjax.config" and graph.get(dep):
                bad.append(f"{mod} -> {dep} (line {line}): config imports only modules that import nothing "
                           f"from boostjax ({dep} imports {', '.join(sorted(graph[dep]))})")
    return bad


def test_the_graph_reader_sees_every_kind_of_import(tmp_path, monkeypatch):
    pkg = tmp_path / "boostjax"
    (pkg / "sub").mkdir(parents=True)
    for name, src in {"__init__.py": "", "a.py": "def f():\n    from boostjax import b\n",
                      "b.py": "import boostjax.sub.c as c\n", "sub/__init__.py": "",
                      "sub/c.py": "from ..a import f\nfrom . import d\n", "sub/d.py": "import os\n"}.items():
        (pkg / name).write_text(src)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    graph = import_graph()
    assert graph["boostjax.a"] == {"boostjax.b": 2} and graph["boostjax.b"] == {"boostjax.sub.c": 1}
    assert graph["boostjax.sub.c"] == {"boostjax.a": 1, "boostjax.sub.d": 2} and graph["boostjax.sub.d"] == {}
    assert cycles(graph) == [["boostjax.a", "boostjax.b", "boostjax.sub.c"]]
    assert "boostjax.a -> boostjax.b (line 2)" in describe(graph, cycles(graph)[0])


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(graph, c) for c in found)


def test_no_layer_imports_a_layer_above_it():
    graph = import_graph()
    bad = upward_imports(graph) + upward_imports(graph, every_layer=True)
    assert not bad, "upward imports:\n" + "\n".join(bad)


def _modules() -> list[str]:
    """Every module of the package, dotted (`boostjax.models.llama`), packages included."""
    return sorted(m for m in _module_files() if m != "boostjax")


def test_no_submodule_shares_an_exported_name():
    top = {m.rpartition(".")[2] for m in _modules() if m.count(".") == 1}
    assert not top & set(boostjax.__all__), f"submodules named like exports: {sorted(top & set(boostjax.__all__))}"


def test_exported_functions_stay_functions_after_every_submodule_is_imported():
    for name in _modules():
        importlib.import_module(name)
    from boostjax import evaluate, generate, train  # noqa: PLC0415

    for fn, home in ((train, "boostjax.trainer"), (evaluate, "boostjax.evaluation"),
                     (generate, "boostjax.generation")):
        assert not isinstance(fn, types.ModuleType) and callable(fn)
        assert fn is getattr(importlib.import_module(home), fn.__name__)
        assert getattr(boostjax, fn.__name__) is fn


if __name__ == "__main__":
    g = import_graph()
    print("\n".join(describe(g, c) for c in cycles(g)) or "no import cycle")
    print("\n".join(upward_imports(g)) or "no upward import (asserted rules)")
    print("every arrow to a higher layer:\n" + ("\n".join(upward_imports(g, every_layer=True)) or "none"))
