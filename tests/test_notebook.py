"""notebooks/quickstart.ipynb: committed without outputs, uses only the public API, and runs top to
bottom in a fresh kernel (this interpreter) with every figure cell drawing an image."""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import sys

import nbformat
import pytest

import boostjax
from helpers import xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
ALLOWED_MAGICS = {"pip", "matplotlib"}  # `%pip install` (the Colab install cell), `%matplotlib inline`
FORBIDDEN_MODULES = {"subprocess", "pty", "multiprocessing"}
FORBIDDEN_CALLS = {"system", "popen", "spawnv", "spawnvp", "execv", "execvp", "getoutput", "run_cell_magic"}


def _python(src: str) -> str:
    """A cell's source with IPython syntax (`%pip`, `!cmd`, `%%bash`) turned into plain Python."""
    from IPython.core.inputtransformer2 import TransformerManager

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
        "from boostjax.analysis.comm import comm_report": "private submodule",
        "import boostjax.training.trainer": "private submodule",
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
    for name in ("simulate_devices", "train", "comm_report", "solve_plan", "build_instance", "get_profile",
                 "tokenize_corpus", "init_from_hf", "generate", "load_tokenizer"):
        assert name in used  # the five parts of the tour are still there


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for c in nb.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None, "strip outputs before committing"


def _figure_cell(src: str) -> bool:
    return "plt.show()" in src or "plt.subplots" in src


@pytest.mark.experiment  # ~2 min end to end (a fifth of the CI budget): `pytest -m experiment`
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    n = len(nb.cells)
    # appended check: the kernel runs this interpreter, and the notebook's simulate_devices(4) took effect
    nb.cells.append(nbformat.v4.new_code_cell("import sys, jax\nprint(sys.executable, jax.device_count())"))
    # a fresh process: our boostjax first on the path, no device count inherited from conftest's XLA_FLAGS,
    # but its cheap CPU codegen: the notebook's programs are tiny, so it saves more compile time than it
    # adds run time (its printed losses may move in the last digits)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("XLA_FLAGS", xla_flags(None))
    # 4 steps per training run instead of the notebook's 30 (its STEPS): every cell still trains, evaluates,
    # checkpoints and draws; the 30 steps (rotation's eigendecompositions at -O0) were about half of its run time
    monkeypatch.setenv("BOOSTJAX_QUICKSTART_STEPS", "4")
    monkeypatch.delenv("MPLBACKEND", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's run folders (tempfile.mkdtemp) land in tmp_path
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


# --- the install cell (section 0): its logic, with IPython's `%pip` magic replaced by a recorder ---------------------

WHEEL = "boostjax-0.1.0-py3-none-any.whl"
_FIND_SPEC = importlib.util.find_spec


def _install_cell() -> str:
    cells = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells
             if c.cell_type == "code" and "%pip install" in c.source]
    assert len(cells) == 1, "one install cell"
    return cells[0]


class _Dist:
    def __init__(self, name: str, version: str):
        self.metadata, self.version = {"Name": name}, version


def _run_install_cell(monkeypatch, *, importable: bool, pip_installs: bool = True, versions=None):
    """Runs the install cell in a real IPython shell; returns (pip command lines, the cell's exception).
    `importable`: boostjax already on the path; `versions`: fake (before, after) installed distributions."""
    import importlib.metadata

    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config as _TConfig

    calls: list[str] = []

    def find_spec(name, *a, **k):
        if name == "boostjax" and not importable and not (pip_installs and calls):
            return None
        return _FIND_SPEC(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    if versions is not None:
        owners = importlib.metadata.packages_distributions()  # the real module -> distribution map
        monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: owners)
        seen = iter([versions[0]] + [versions[1]] * 10)
        monkeypatch.setattr(importlib.metadata, "distributions",
                            lambda: [_Dist(n, v) for n, v in next(seen).items()])
    cfg = _TConfig()
    cfg.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell(config=cfg)
    shell.register_magic_function(calls.append, "line", "pip")
    result = shell.run_cell(_install_cell())
    return calls, result.error_in_exec


def test_install_cell_installs_the_one_wheel_beside_the_notebook_and_keeps_jax(tmp_path, monkeypatch, capsys):
    import importlib.metadata

    monkeypatch.chdir(tmp_path)
    (tmp_path / WHEEL).write_bytes(b"")
    (tmp_path / "other.whl").write_bytes(b"")
    calls, err = _run_install_cell(monkeypatch, importable=False)
    assert err is None, err
    jax_v, jaxlib_v = importlib.metadata.version("jax"), importlib.metadata.version("jaxlib")
    assert calls == [f'install -q "{tmp_path / WHEEL}" "jax=={jax_v}" "jaxlib=={jaxlib_v}"']
    assert f"installed {WHEEL}" in capsys.readouterr().out

    calls, err = _run_install_cell(monkeypatch, importable=True)  # a clone with `pip install -e .`: a no-op
    assert err is None and calls == []
    assert "already importable: nothing to install" in capsys.readouterr().out


@pytest.mark.parametrize("wheels, said", [([], "no boostjax-*-py3-none-any.whl in"),
                                           ([WHEEL, "boostjax-0.2.0-py3-none-any.whl"], "2 boostjax-*")])
def test_install_cell_refuses_without_exactly_one_wheel(tmp_path, monkeypatch, wheels, said):
    monkeypatch.chdir(tmp_path)
    for w in wheels:
        (tmp_path / w).write_bytes(b"")
    calls, err = _run_install_cell(monkeypatch, importable=False)
    assert calls == [] and isinstance(err, FileNotFoundError)
    msg = str(err)
    assert said in msg and str(tmp_path) in msg and "fix: upload exactly one boostjax wheel" in msg
    assert "\n" not in msg


def test_install_cell_says_when_pip_failed_or_a_restart_is_needed(tmp_path, monkeypatch, capsys):
    import jax  # noqa: F401 (imported in this process: a changed jax needs a restart)

    monkeypatch.chdir(tmp_path)
    (tmp_path / WHEEL).write_bytes(b"")
    calls, err = _run_install_cell(monkeypatch, importable=False, pip_installs=False)
    assert isinstance(err, RuntimeError) and "pip did not install" in str(err)
    capsys.readouterr()

    old = {"jax": "0.6.2", "jaxlib": "0.6.2", "numpy": "2.0.0"}  # older than jax>=0.7: not pinned, pip upgrades it
    new = {"jax": "0.10.2", "jaxlib": "0.10.2", "numpy": "2.0.0", "boostjax": "0.1.0"}
    calls, err = _run_install_cell(monkeypatch, importable=False, versions=(old, new))
    assert calls == [f'install -q "{tmp_path / WHEEL}" ']
    assert "pip changed: jax 0.6.2 -> 0.10.2, jaxlib 0.6.2 -> 0.10.2" in capsys.readouterr().out
    assert isinstance(err, RuntimeError) and "jax" in str(err) and "fix: restart the runtime" in str(err)


def test_install_cell_keeps_jax_in_the_range_the_wheel_requires():
    import tomllib

    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = {s.operator: s.version for s in next(Requirement(d) for d in deps if Requirement(d).name == "jax").specifier}
    cell = ast.parse(_python(_install_cell()))
    const = next(n.value for n in cell.body if isinstance(n, ast.Assign) and "JAX_MIN" in ast.unparse(n.targets[0]))
    low, end = ast.literal_eval(const)
    assert set(spec) == {">=", "<"}
    assert low == tuple(int(x) for x in spec[">="].split(".")) and end == tuple(int(x) for x in spec["<"].split("."))
