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


# The layers, bottom to top: a package imports only packages of lower layers (and itself). Every
# top-level name of the package has a layer; the root's lazy exports import nothing when it loads.
LAYERS = {"boostjax": 0, "config": 0,
          "models": 1, "runtime": 1,
          "optim": 2, "sharding": 2,
          "offload": 3, "runs": 3,
          "placement": 4, "data": 4,
          "interop": 5, "inference": 5,
          "training": 6,
          "analysis": 7,
          "planning": 8,
          "cli": 9}


def _top(mod: str) -> str:
    return mod.removeprefix("boostjax.").split(".")[0]


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports that break the layering: a package importing one of the same or a higher layer (other
    than itself), and `config` importing anything of boostjax outside itself."""
    bad = []
    for mod, deps in sorted(graph.items()):
        for dep, line in sorted(deps.items()):
            a, b = _top(mod), _top(dep)
            if a == "config" and b != "config":
                bad.append(f"{mod} -> {dep} (line {line}): config is a leaf and imports nothing else of boostjax")
            elif a != b and LAYERS[b] >= LAYERS[a] and b != "boostjax":
                bad.append(f"{mod} -> {dep} (line {line}): layer {LAYERS[a]} ({a}) imports layer {LAYERS[b]} ({b})")
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


def test_every_package_has_a_layer():
    tops = {_top(m) for m in _module_files()}
    assert tops == set(LAYERS), f"without a layer: {sorted(tops - set(LAYERS))}; gone: {sorted(set(LAYERS) - tops)}"


def test_no_layer_imports_a_layer_above_it():
    bad = upward_imports(import_graph())
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_config_is_a_leaf_package():
    graph = {"boostjax.config": {"boostjax.config.fields": 1}, "boostjax.config.fields": {},
             "boostjax.config.mesh": {"boostjax.config.fields": 3, "boostjax.models.llama": 4},
             "boostjax.models.llama": {"boostjax.config": 2}}
    assert upward_imports(graph) == ["boostjax.config.mesh -> boostjax.models.llama (line 4): config is a leaf and "
                                     "imports nothing else of boostjax"]


def _modules() -> list[str]:
    """Every module of the package, dotted (`boostjax.models.llama`), packages included."""
    return sorted(m for m in _module_files() if m != "boostjax" and not m.endswith(".__main__"))


def test_no_submodule_shares_an_exported_name():
    top = {m.rpartition(".")[2] for m in _modules() if m.count(".") == 1}
    assert not top & set(boostjax.__all__), f"submodules named like exports: {sorted(top & set(boostjax.__all__))}"


def test_exported_functions_stay_functions_after_every_submodule_is_imported():
    for name in _modules():
        importlib.import_module(name)
    from boostjax import evaluate, generate, train

    for fn, home in ((train, "boostjax.training.trainer"), (evaluate, "boostjax.inference.evaluation"),
                     (generate, "boostjax.inference.generation")):
        assert not isinstance(fn, types.ModuleType) and callable(fn)
        assert fn is getattr(importlib.import_module(home), fn.__name__)
        assert getattr(boostjax, fn.__name__) is fn


if __name__ == "__main__":
    g = import_graph()
    print("\n".join(describe(g, c) for c in cycles(g)) or "no import cycle")
    print("\n".join(upward_imports(g)) or "no upward import")


# Optional packages (the `test` and `data` extras, not the package's dependencies) and JAX's optional plugin
# namespace: a library module imports them where they are used, and only there.
OPTIONAL = {"torch", "transformers", "gguf", "accelerate", "jax_plugins", "pyarrow", "zstandard"}


def deferred_imports() -> list[str]:
    """Import statements inside functions of library modules (everything but `boostjax.cli`, whose
    handlers import the library after the command line is read and the device count is set)."""
    out = []
    for mod, (path, _) in sorted(_module_files().items()):
        if _top(mod) == "cli":
            continue
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or "."]
                else:
                    continue
                if not all(n.split(".")[0] in OPTIONAL for n in names):
                    out.append(f"{mod} line {node.lineno}: {', '.join(names)}")
    return out


def test_library_modules_import_at_the_top():
    found = deferred_imports()
    assert not found, "imports inside functions (move them to the top of the module):\n" + "\n".join(found)
