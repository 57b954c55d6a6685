"""notebooks/quickstart.ipynb: committed without outputs, uses only the public API, and runs top to
bottom in a fresh kernel (this interpreter) with every figure cell drawing an image."""

from __future__ import annotations

import ast
import os
import pathlib
import sys
import types

import nbformat
import pytest

import boostjax

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
ALLOWED_MAGICS = {"pip", "matplotlib"}  # `%pip install` (the Colab install cell), `%matplotlib inline`
FORBIDDEN_MODULES = {"subprocess", "pty", "multiprocessing"}
FORBIDDEN_CALLS = {"system", "popen", "spawnv", "spawnvp", "execv", "execvp", "getoutput", "run_cell_magic"}


def _python(src: str) -> str:
    """A cell's source with IPython syntax (`%pip`, `!cmd`, `%%bash`) turned into plain Python."""
    from IPython.core.inputtransformer2 import TransformerManager  # noqa: PLC0415

    return TransformerManager().transform_cell(src)


def _code(nb) -> list[str]:
    return [_python(c.source) for c in nb.cells if c.cell_type == "code"]


def violations(src: str) -> list[str]:
    """Uses of non-public boostjax names, private submodules, shells or subprocesses in one cell."""
    tree = ast.parse(src)
    public = set(boostjax.__all__) | {"__version__"}
    aliases = {"boostjax"}
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("boostjax."):
                    out.append(f"import {a.name} (private submodule)")
                elif a.name == "boostjax":
                    aliases.add(a.asname or a.name)
                if a.name.split(".")[0] in FORBIDDEN_MODULES:
                    out.append(f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("boostjax."):
                out.append(f"from {node.module} import ... (private submodule)")
            elif node.module == "boostjax":
                out += [f"from boostjax import {a.name} (not in boostjax.__all__)" for a in node.names
                        if a.name not in public]
            if node.module.split(".")[0] in FORBIDDEN_MODULES:
                out.append(f"from {node.module} import ...")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr not in public:
                out.append(f"boostjax.{node.attr} (not in boostjax.__all__)")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name in FORBIDDEN_CALLS:
                out.append(f"{name}(...) (shell or subprocess)")
            if name == "run_line_magic":
                magic = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
                if magic not in ALLOWED_MAGICS:
                    out.append(f"%{magic} (only %pip / %matplotlib are allowed)")
    return out


def test_checker_catches_private_use():
    bad = {
        "from boostjax.sharding.comm import comm_report": "private submodule",
        "import boostjax.train": "private submodule",
        "import boostjax as bj\nbj.devices.simulate(4)": "not in boostjax.__all__",
        "from boostjax import STRATEGIES": "not in boostjax.__all__",
        "!boostjax train --steps 2": "shell or subprocess",
        "%%bash\nboostjax comm": "shell or subprocess",
        "%sx boostjax plan": "only %pip",
        "import subprocess": "import subprocess",
    }
    for src, why in bad.items():
        found = violations(_python(src))
        assert any(why in v for v in found), (src, found)
    ok = 'import boostjax\nboostjax.simulate_devices(4)\nfrom boostjax import train, comm_report\n%pip install -q x'
    assert violations(_python(ok)) == []


def test_notebook_uses_only_the_public_api():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for i, src in enumerate(_code(nb)):
        assert violations(src) == [], f"code cell {i}: {violations(src)}"
    used = " ".join(_code(nb))
    for name in ("simulate_devices", "train", "comm_report", "solve_plan", "build_instance", "get_profile"):
        assert name in used  # the four parts of the tour are still there


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, "strip outputs before committing"


def test_exported_train_is_the_function_even_after_its_module_is_imported():
    import importlib  # noqa: PLC0415

    mod = importlib.import_module("boostjax.train")
    from boostjax import train  # noqa: PLC0415

    assert boostjax.train is mod.train and train is mod.train
    assert not isinstance(boostjax.train, types.ModuleType)


def _figure_cell(src: str) -> bool:
    return "plt.show()" in src or "plt.subplots" in src


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    from nbclient import NotebookClient  # noqa: PLC0415

    nb = nbformat.read(NOTEBOOK, as_version=4)
    n = len(nb.cells)
    # appended check: the kernel runs this interpreter, and the notebook's simulate_devices(4) took effect
    nb.cells.append(nbformat.v4.new_code_cell("import sys, jax\nprint(sys.executable, jax.device_count())"))
    # a fresh process: our boostjax first on the path, no device count inherited from conftest's XLA_FLAGS
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("MPLBACKEND", raising=False)
    client = NotebookClient(nb, kernel_name="python3", timeout=600, allow_errors=False,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first failing cell

    code = [c for c in nb.cells[:n] if c.cell_type == "code"]
    assert all(o.output_type != "error" for c in code for o in c.outputs)
    figures = [c for c in code if _figure_cell(c.source)]
    assert len(figures) >= 4
    for c in figures:
        assert any("image/png" in o.get("data", {}) for o in c.outputs), f"no image from:\n{c.source[:200]}"
    tables = [c for c in code if "md_table(" in c.source and "def md_table" not in c.source]
    assert len(tables) >= 2
    for c in tables:
        assert any("text/markdown" in o.get("data", {}) for o in c.outputs), f"no table from:\n{c.source[:200]}"
    last = "".join(o.get("text", "") for o in nb.cells[-1].outputs).split()
    assert last == [sys.executable, "4"]
