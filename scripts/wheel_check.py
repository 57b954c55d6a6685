"""Build the boostjax wheel and install it the way the notebook does, in fresh virtual environments.

1. `python -m build --wheel --outdir dist/` from the repository root (setuptools in an isolated build
   environment), then the wheel is read back: every `boostjax/**/*.py` file git tracks is in it and
   nothing else but `*.dist-info/`; the `boostjax` console script points at `boostjax.cli:main`; name,
   version (= `boostjax.__version__`), Requires-Python, license and Requires-Dist equal pyproject.toml's.
2. For each scenario, a new virtual environment (`python -m venv`, nothing inherited: no PYTHONPATH, no
   system site-packages) gets IPython (a notebook kernel's shell: the cell's `%pip` is IPython's real
   magic, which runs this venv's `python -m pip`), and then, in a folder that stands for the notebook's
   (Colab: /content):
   a. the install cell of notebooks/quickstart.ipynb runs with no wheel there: it must raise
      FileNotFoundError with a one-line fix and install nothing;
   b. the wheel is copied there and the cell runs again: it must install boostjax;
   c. `import boostjax` must come from the venv's site-packages, `boostjax --help` must exit 0, and a
      2-step `boostjax train` (tiny CoLA, built-in corpus) must log two finite losses;
   d. the cell runs a third time: it must say "already importable" and call pip no more.
   Scenarios: `fresh` (a bare venv: a new machine); `preinstalled-jax` (jax/jaxlib at the oldest
   version pyproject.toml allows are installed first, as Colab preinstalls jax): the cell must keep
   them (same versions after the install) and the 2-step train must run on them (so the lower bounds
   in pyproject.toml are true); `old-jax` (jax/jaxlib 0.6.2 first): pip upgrades them and the cell's
   line lists the change.

    python scripts/wheel_check.py                        # all three scenarios (~10 min; downloads wheels)
    python scripts/wheel_check.py --scenarios fresh      # one
Writes experiments/results/wheel_check.json and wheel_check.md. Needs the `build` package and access to
the package index (or a pip cache) for the venvs' dependencies.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from email.parser import Parser
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"  # beside the experiments' results
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
SCENARIOS = ("fresh", "preinstalled-jax", "old-jax")
OLD_JAX = "0.6.2"  # older than pyproject.toml allows (the scenario `old-jax` installs this first)
TRAIN = ["train", "--steps", "2", "--batch", "2", "--seq", "32", "--d-model", "32", "--n-layers", "1",
         "--n-heads", "2", "--d-ff", "64", "--rank", "8", "--log-every", "1", "--eval-every", "2",
         "--ckpt-every", "2", "--no-progress"]

# Runs one notebook cell in a real IPython shell (what a kernel runs); writes the outcome as JSON.
DRIVER = r'''
import json, sys
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config
cfg = Config(); cfg.HistoryManager.hist_file = ":memory:"
result = InteractiveShell.instance(config=cfg).run_cell(open(sys.argv[1]).read())
err = result.error_in_exec
json.dump({"error": None if err is None else f"{type(err).__name__}: {err}"}, open(sys.argv[2], "w"))
'''


def run(cmd: list[str], *, cwd: pathlib.Path, env: dict[str, str] | None = None, check: bool = True,
        timeout: float = 1800) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def build_wheel() -> tuple[pathlib.Path, float]:
    t0 = time.time()
    dist = ROOT / "dist"
    version = pyproject()["version"]
    old = dist / f"boostjax-{version}-py3-none-any.whl"
    if old.exists():
        old.unlink()  # our own build output of this version (dist/ is ignored by git)
    run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist)], cwd=ROOT)
    return old, time.time() - t0


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def check_wheel(wheel: pathlib.Path) -> dict[str, Any]:
    """The wheel's files and metadata against the source tree and pyproject.toml."""
    proj = pyproject()
    names = zipfile.ZipFile(wheel).namelist()
    info = f"boostjax-{proj['version']}.dist-info/"
    tracked = run(["git", "ls-files", "boostjax"], cwd=ROOT).stdout.split()
    sources = {f for f in tracked if f.endswith(".py")}
    in_wheel = {n for n in names if not n.startswith(info)}
    z = zipfile.ZipFile(wheel)
    meta = Parser().parsestr(z.read(info + "METADATA").decode())
    entry = z.read(info + "entry_points.txt").decode()
    init = (ROOT / "boostjax" / "__init__.py").read_text()
    version = re.search(r'__version__ = "([^"]+)"', init).group(1)
    checks = {
        "every tracked boostjax/**/*.py is in the wheel": sorted(sources - in_wheel) == [],
        "nothing else but *.dist-info/ (no tests, no notebooks)": sorted(in_wheel - sources) == [],
        "console script boostjax = boostjax.cli:main":
            re.search(r"^\[console_scripts\]\s*\nboostjax = boostjax\.cli:main\s*$", entry, re.M) is not None,
        "name boostjax": meta["Name"] == "boostjax",
        "version = pyproject = boostjax.__version__": meta["Version"] == proj["version"] == version,
        "Requires-Python = pyproject": meta["Requires-Python"] == proj["requires-python"],
        "License-Expression = pyproject": meta["License-Expression"] == proj["license"],
        "Requires-Dist (no extra) = pyproject dependencies":
            sorted(d for d in meta.get_all("Requires-Dist") if "extra ==" not in d) == sorted(proj["dependencies"]),
        "tag py3-none-any": wheel.name.endswith("-py3-none-any.whl"),
    }
    return {"file": wheel.name, "bytes": wheel.stat().st_size, "files": len(names),
            "modules": len(in_wheel), "missing": sorted(sources - in_wheel), "extra": sorted(in_wheel - sources),
            "checks": checks, "ok": all(checks.values())}


def install_cell() -> str:
    nb = json.loads(NOTEBOOK.read_text())
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code" and "%pip install" in "".join(c["source"])]
    assert len(cells) == 1, "the notebook has one install cell"
    return cells[0]


def oldest_jax() -> str:
    """pyproject.toml's lower bound of jax (the scenario `preinstalled-jax` installs it first)."""
    from packaging.requirements import Requirement

    jax = next(Requirement(d) for d in pyproject()["dependencies"] if Requirement(d).name == "jax")
    return next(s.version for s in jax.specifier if s.operator == ">=")


def scenario(name: str, wheel: pathlib.Path, scratch: pathlib.Path) -> dict[str, Any]:
    t0 = time.time()
    home = scratch / name
    venv, nbdir = home / "venv", home / "notebook"
    nbdir.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS", "PYTHONHOME") and not k.startswith("JAX_")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["JAX_PLATFORMS"] = "cpu"
    py, bj = str(venv / "bin" / "python"), str(venv / "bin" / "boostjax")
    run([sys.executable, "-m", "venv", str(venv)], cwd=home)
    jax = {"fresh": None, "preinstalled-jax": oldest_jax(), "old-jax": OLD_JAX}[name]
    pre = ["ipython"] + ([f"jax=={jax}", f"jaxlib=={jax}"] if jax else [])
    run([py, "-m", "pip", "install", "-q", *pre], cwd=home, env=env)
    (home / "cell.py").write_text(install_cell())
    (home / "driver.py").write_text(DRIVER)

    def cell() -> tuple[str | None, str]:
        p = run([py, str(home / "driver.py"), str(home / "cell.py"), str(home / "out.json")], cwd=nbdir, env=env)
        return json.loads((home / "out.json").read_text())["error"], p.stdout + p.stderr

    def versions() -> dict[str, str]:
        out = run([py, "-m", "pip", "list", "--format", "json"], cwd=home, env=env).stdout
        return {d["name"].lower(): d["version"] for d in json.loads(out)}

    res: dict[str, Any] = {"scenario": name, "preinstalled": pre}
    before = versions()
    err, _ = cell()  # a: no wheel beside the notebook
    res["no_wheel_error"] = err
    res["no_wheel_installed_nothing"] = versions() == before
    shutil.copy2(wheel, nbdir / wheel.name)
    t1 = time.time()
    err, out = cell()  # b: installs
    res["install_s"] = round(time.time() - t1, 1)
    res["install_error"] = err
    res["install_said"] = [ln for ln in out.splitlines() if ln.startswith("installed ")]
    after = versions()
    res["jax_before_after"] = [before.get("jax"), after.get("jax")]
    res["jaxlib_before_after"] = [before.get("jaxlib"), after.get("jaxlib")]
    res["resolved"] = {k: after.get(k) for k in ("boostjax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint",
                                                 "chex", "numpy", "tokenizers")}
    imp = run([py, "-c", "import boostjax, sys; print(boostjax.__version__, boostjax.__file__, sys.version.split()[0])"],
              cwd=nbdir, env=env, check=False)
    res["import"] = (imp.stdout + imp.stderr).strip()
    res["import_from_venv"] = imp.returncode == 0 and str(venv) in imp.stdout
    hlp = run([bj, "--help"], cwd=nbdir, env=env, check=False)
    res["help_rc"], res["help_first_line"] = hlp.returncode, (hlp.stdout.splitlines() or [""])[0]
    t1 = time.time()
    tr = run([bj, *TRAIN, "--out", str(home / "run")], cwd=nbdir, env=env, check=False, timeout=900)
    res["train_s"] = round(time.time() - t1, 1)
    res["train_rc"] = tr.returncode
    res["train_tail"] = (tr.stdout + tr.stderr).strip().splitlines()[-3:]
    metrics = home / "run" / "metrics.jsonl"
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r] if metrics.exists() else []
    res["train_losses"] = losses
    err, out = cell()  # d: boostjax importable now: a no-op
    res["again_error"] = err
    res["again_noop"] = "already importable: nothing to install" in out and versions() == after
    res["checks"] = {
        "no wheel: FileNotFoundError, one line with a fix, nothing installed":
            bool(res["no_wheel_error"]) and res["no_wheel_error"].startswith("FileNotFoundError: install: no ")
            and "fix: upload exactly one boostjax wheel" in res["no_wheel_error"] and "\n" not in res["no_wheel_error"]
            and res["no_wheel_installed_nothing"],
        "the cell installs the wheel": res["install_error"] is None and after.get("boostjax") is not None,
        "import boostjax from the venv": res["import_from_venv"],
        "boostjax --help exits 0": res["help_rc"] == 0,
        "2-step train: exit 0, 2 finite losses": tr.returncode == 0 and len(losses) == 2
            and all(math.isfinite(x) for x in losses),
        "second run of the cell is a no-op": res["again_noop"] and res["again_error"] is None,
    }
    if name == "preinstalled-jax":
        res["checks"]["preinstalled jax/jaxlib kept"] = (before.get("jax") == after.get("jax") == jax
                                                          and before.get("jaxlib") == after.get("jaxlib") == jax)
    if name == "old-jax":
        res["checks"]["the too-old jax is upgraded and the cell says so"] = (
            after.get("jax") != jax and any(f"jax {jax} -> {after.get('jax')}" in ln for ln in res["install_said"]))
    res["ok"] = all(res["checks"].values())
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def markdown(r: dict[str, Any]) -> str:
    w = r["wheel"]
    lines = ["# Wheel check: build the wheel, install it with the notebook's install cell in fresh venvs", "",
             f"Command: `{r['command']}` -- {r['wall_s']:.0f} s wall on {r['machine']} (busy shared cores: times "
             "are noisy; pip downloads or reads its cache).", "",
             f"**In short:** {'all checks pass' if r['ok'] else 'SOME CHECKS FAIL'}: wheel `{w['file']}` "
             f"({w['bytes'] / 1024:.0f} KiB, {w['modules']} modules, built in {r['build_s']:.1f} s).", "",
             "## The wheel", "", "| check | |", "|---|---|"]
    lines += [f"| {k} | {'yes' if v else '**no**'} |" for k, v in w["checks"].items()]
    for s in r["scenarios"]:
        lines += ["", f"## Scenario `{s['scenario']}` (pip install first: {', '.join(s['preinstalled'])})", "",
                  "| check | |", "|---|---|"]
        lines += [f"| {k} | {'yes' if v else '**no**'} |" for k, v in s["checks"].items()]
        lines += ["", f"- no wheel: `{s['no_wheel_error']}`",
                  f"- install cell: {s['install_s']} s; said: `{' '.join(s['install_said'])}`",
                  f"- jax {s['jax_before_after'][0]} -> {s['jax_before_after'][1]}, jaxlib "
                  f"{s['jaxlib_before_after'][0]} -> {s['jaxlib_before_after'][1]}; resolved: "
                  + ", ".join(f"{k} {v}" for k, v in s["resolved"].items()),
                  f"- import: `{s['import']}`",
                  f"- `boostjax --help`: exit {s['help_rc']} (`{s['help_first_line']}`)",
                  f"- `boostjax {' '.join(TRAIN)} --out RUN`: exit {s['train_rc']} in {s['train_s']} s, losses "
                  f"{', '.join(f'{x:.4f}' for x in s['train_losses'])}",
                  f"- scenario wall time {s['wall_s']} s"]
        if s["train_rc"] != 0:
            lines += ["", "```", *s["train_tail"], "```"]
    lines += ["", "Not covered here: Python 3.12 (only 3.11 is on this machine), a real Colab runtime (its CUDA jax "
              "build and its other preinstalled packages; here a preinstalled jax is the CPU build from PyPI)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma-separated scenarios to run (default: all of {','.join(SCENARIOS)})")
    ap.add_argument("--out", default=str(RESULTS), help="folder for wheel_check.{json,md} (default: experiments/results)")
    ap.add_argument("--keep-scratch", action="store_true", help="keep the temporary folder of venvs and wheels")
    args = ap.parse_args()
    unknown = [n for n in args.scenarios.split(",") if n not in SCENARIOS]
    if unknown:
        ap.error(f"--scenarios: unknown {unknown[0]!r}; fix: pick from {','.join(SCENARIOS)}")
    t0 = time.time()
    wheel, build_s = build_wheel()
    report: dict[str, Any] = {"command": shlex.join(["python", "scripts/wheel_check.py", *sys.argv[1:]]),
        "machine": f"{platform.machine()} Linux, {os.cpu_count()} CPU cores, Python {platform.python_version()}",
        "build_s": round(build_s, 1), "wheel": check_wheel(wheel), "scenarios": []}
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="boostjax-wheel-check-"))
    try:
        for name in args.scenarios.split(","):
            print(f"scenario {name} ...", flush=True)
            report["scenarios"].append(scenario(name, wheel, scratch))
            print(json.dumps(report["scenarios"][-1]["checks"], indent=1), flush=True)
    finally:
        if not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    report["wall_s"] = round(time.time() - t0, 1)
    report["ok"] = report["wheel"]["ok"] and all(s["ok"] for s in report["scenarios"])
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "wheel_check.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "wheel_check.md").write_text(markdown(report))
    print(f"wheel_check: wrote wheel_check.json, wheel_check.md to {out}", flush=True)
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
