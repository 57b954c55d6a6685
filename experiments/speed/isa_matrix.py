"""The numeric test files under other CPU instruction sets, core counts and OpenBLAS kernels.

Each cell runs the chosen test files in one `pytest -p no:xdist` process with XLA's widest vector ISA
capped (`XLA_FLAGS=--xla_cpu_max_isa=...`; tests/conftest.py appends its own flags), pinned to 1 or 2
cores (`taskset -c 0` / `taskset -c 0,1`), or with OpenBLAS told another kernel family
(`OPENBLAS_CORETYPE`, read by NumPy's and SciPy's OpenBLAS; JAX's CPU eigh/svd call SciPy's LAPACK). It
records passed / failed / skipped counts, the failures' names and the wall time, and probes run under
the cell's environment with the suite's XLA flags: the FMA and vector instructions in the object code
XLA emits for `tanh(a) * exp(b)` (SSE4_2 has no FMA; the suite's -O0 codegen emits scalar code, so the
vector width does not change), a digest of its result (it differs where the code does), and the
kernel family each OpenBLAS reports.

    python -m experiments.speed.isa_matrix                      # every cell not yet in the results
    python -m experiments.speed.isa_matrix --cells AVX2/1,default/2 --files tests/test_rotation.py

Resumable: cells already in <out>/isa_matrix.json are skipped (`--redo` runs them again). Writes
<out>/isa_matrix.json and .md after every cell.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

from experiments import common

ROOT = common.ROOT
# the files that compare floats across programs (layouts, fusions, jit vs eager, another implementation)
FILES = ("tests/test_rotation.py", "tests/test_delay.py", "tests/test_optimizers.py", "tests/test_adam8bit.py",
         "tests/test_muon.py", "tests/test_zero.py", "tests/test_tp.py", "tests/test_pipeline.py",
         "tests/test_pipeline_1f1b.py", "tests/test_grad_accum.py", "tests/test_model.py", "tests/test_attention.py",
         "tests/test_generate.py", "tests/test_combinations.py")
ISAS = ("default", "AVX2", "SSE4_2")
# cell name: (max ISA, cores, OPENBLAS_CORETYPE or None)
CELLS = {f"{isa}/{cores}": (isa, cores, None) for isa in ISAS for cores in (1, 2)}
CELLS["default/2/openblas=Sandybridge"] = ("default", 2, "Sandybridge")

PROBE = r"""
import ctypes, hashlib, json, os, pathlib, shutil, subprocess, sys, tempfile
dump = tempfile.mkdtemp(prefix="isa-probe-")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
import numpy as np, scipy.linalg  # noqa: F401 (loads SciPy's OpenBLAS)
sys.path.insert(0, "tests")
import conftest  # noqa: F401 (the suite's XLA flags, appended to the cell's)
import jax, jax.numpy as jnp

rng = np.random.default_rng(0)
a, b = rng.standard_normal((32, 256)).astype(np.float32), rng.standard_normal((256, 32)).astype(np.float32)
y = np.asarray(jax.jit(lambda a, b: jnp.tanh(a) * jnp.exp(b.T))(a, b))
out = {"tanh_exp": hashlib.sha256(y.tobytes()).hexdigest()[:8]}
if shutil.which("objdump"):
    asm = "".join(subprocess.run(["objdump", "-d", str(o)], capture_output=True, text=True).stdout
                  for o in pathlib.Path(dump).glob("*.o"))
    out.update(fma=asm.count("vfmadd"), ymm=asm.count("%ymm"), zmm=asm.count("%zmm"))
shutil.rmtree(dump, ignore_errors=True)
for name, lib in (("numpy", "numpy.libs"), ("scipy", "scipy.libs")):
    for so in sorted((pathlib.Path(np.__file__).parents[1] / lib).glob("libscipy_openblas*.so")):
        dll = ctypes.CDLL(str(so))
        for sym in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
            if hasattr(dll, sym):
                getattr(dll, sym).restype = ctypes.c_char_p
                out[f"openblas_{name}"] = getattr(dll, sym)().decode()
                break
print(json.dumps(out))
"""


def cell_env(isa: str, coretype: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "OPENBLAS_CORETYPE", "PYTEST_ADDOPTS",
                                                                  "JAX_COMPILATION_CACHE_DIR")}
    if isa != "default":
        env["XLA_FLAGS"] = f"--xla_cpu_max_isa={isa}"
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    return env


def pinned(cores: int) -> list[str]:
    return ["taskset", "-c", ",".join(str(i) for i in range(cores))]


def run_cell(isa: str, cores: int, coretype: str | None, files: list[str]) -> dict:
    env = cell_env(isa, coretype)
    probe = subprocess.run([*pinned(cores), sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                           text=True)
    probe_out = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else {"error": probe.stderr[-500:]}
    with tempfile.TemporaryDirectory(prefix="isa-matrix-") as tmp:
        xml = pathlib.Path(tmp) / "junit.xml"
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        proc = subprocess.run([*pinned(cores), sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p",
                               "no:cacheprovider", f"--junitxml={xml}", *files], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        counts, failed = {"passed": 0, "failed": 0, "skipped": 0}, []
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
                if case.find("failure") is not None or case.find("error") is not None:
                    counts["failed"] += 1
                    failed.append(name)
                elif case.find("skipped") is not None:
                    counts["skipped"] += 1
                else:
                    counts["passed"] += 1
    return {"isa": isa, "cores": cores, "openblas_coretype": coretype, **counts, "failures": failed,
            "wall_s": round(wall, 1), "load_before": round(load0, 2), "exit": proc.returncode, "probe": probe_out,
            "tail": proc.stdout[-1500:] if proc.returncode else proc.stdout.strip().splitlines()[-1:]}


def markdown(res: dict) -> str:
    lines = ["# Numeric tests across CPU instruction sets, cores and OpenBLAS kernels", "",
             f"CPU: {res['cpu']}. Files ({len(res['files'])}): " + ", ".join(f"`{f}`" for f in res["files"]) + ".",
             "Probe (the suite's XLA flags): FMA / ymm / zmm instructions in the object code XLA emitted for",
             "`tanh(a) * exp(b)` and a digest of its result: a cap that takes effect changes them. Wall time on",
             "a machine shared with other jobs (load: the 1-minute load average when the cell started).", "",
             "| cell | XLA max ISA | cores | OpenBLAS (NumPy / SciPy) | FMA / ymm / zmm | digest | passed | failed | "
             "skipped | wall s | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in res["cells"].items():
        p = c["probe"]
        blas = f"{p.get('openblas_numpy', '?')} / {p.get('openblas_scipy', '?')}"
        code = "/".join(str(p.get(k, "?")) for k in ("fma", "ymm", "zmm"))
        lines.append(f"| {name} | {c['isa']} | {c['cores']} | {blas} | {code} | {p.get('tanh_exp', '?')} | "
                     f"{c['passed']} | {c['failed']} | {c['skipped']} | {c['wall_s']:.0f} | {c['load_before']:.1f} |")
    failures = [(n, f) for n, c in res["cells"].items() for f in c["failures"]]
    lines += ["", "Failures: " + ("none." if not failures else "; ".join(f"{n}: `{f}`" for n, f in failures))]
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = set((re.search(r"^flags\s*:\s*(.*)$", text, re.M) or [None, ""])[1].split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE/AVX"
    return f"{name.group(1) if name else 'unknown'} ({isa}, {os.cpu_count()} cores visible)"


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(common.RESULTS),
                    help="folder for isa_matrix.json and .md (default: experiments/results)")
    ap.add_argument("--cells", default=",".join(CELLS),
                    help="comma-separated cells to run, of: " + ", ".join(CELLS) + " (default: all)")
    ap.add_argument("--files", nargs="+", default=list(FILES), help="test files per cell (default: the numeric ones)")
    ap.add_argument("--redo", action="store_true", help="run cells already recorded again")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        print(f"boostjax: error: --cells: unknown cell {unknown[0]!r}; fix: use some of {', '.join(CELLS)}",
              file=sys.stderr)
        return 2
    if shutil.which("taskset") is None:
        print("boostjax: error: taskset: not found; fix: install util-linux", file=sys.stderr)
        return 2
    path = pathlib.Path(args.out) / "isa_matrix.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    if res.get("files") not in (None, args.files):
        res = {}  # another file list: the old cells do not compare
    res.update(files=args.files, cpu=cpu_name(), command=common.command_line("isa_matrix", argv))
    res.setdefault("cells", {})
    for name in cells:
        if name in res["cells"] and not args.redo:
            common.log(f"{name}: recorded, skipped")
            continue
        common.log(f"{name}: running {len(args.files)} files")
        res["cells"][name] = run_cell(*CELLS[name], args.files)
        c = res["cells"][name]
        common.log(f"{name}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped in {c['wall_s']:.0f} s")
        common.write(args.out, "isa_matrix", data=res, md=markdown(res), echo=False)
    common.write(args.out, "isa_matrix", data=res, md=markdown(res))
    return 1 if any(c["failed"] or c["exit"] not in (0, 5) for c in res["cells"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
