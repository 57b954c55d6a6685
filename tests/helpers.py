"""Shared test helpers: one version of each thing several test files need.

- `FAST_CPU` compiler options;
- comparisons: `rel` (‖a - b‖ / ‖b‖ over arrays or whole trees), `rel_by_path`, `assert_rel_close`
  (per leaf, relative to the leaf's norm), `assert_trees_allclose` (element-wise, for exact paths);
- inputs: `seed_of` (a seed fixed by a test's parameters), `random_tokens`, `random_params`;
- the CLI: `MICRO` (the tiny model of the CLI tests), `model_flags`, `one_error_line`, `cli_command`,
  `cli_env`;
- `load_experiment` (`experiments/` is not a package).

Tolerances follow the arithmetic: a norm-relative error is what rounding bounds (a reordered fp32 sum
moves ‖a - b‖ by ~1e-7 ‖b‖), an element-wise relative error near zero is not."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import zlib
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from boostjax.config import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- comparisons

def _flat(tree) -> np.ndarray:
    """Every leaf of an array or a tree, raveled and concatenated, in float64."""
    leaves = jax.tree.leaves(jax.device_get(tree))
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in leaves])


def rel(a, b) -> float:
    """‖a - b‖ / ‖b‖ (Frobenius, in float64) over every entry of `a` and `b`: two arrays, or two trees of
    the same structure taken as one vector. A zero `b` gives 0 when `a` equals it and a huge number
    otherwise (never NaN)."""
    x, y = _flat(a), _flat(b)
    assert x.shape == y.shape, (x.shape, y.shape)
    return float(np.linalg.norm(x - y) / max(float(np.linalg.norm(y)), 1e-30))


def rel_by_path(got, want) -> dict[str, float]:
    """`rel` of each leaf, keyed by its path (`jax.tree_util.keystr`); the trees must match."""
    assert jax.tree.structure(got) == jax.tree.structure(want), (jax.tree.structure(got), jax.tree.structure(want))
    flat = jax.tree_util.tree_flatten_with_path(want)[0]
    return {jax.tree_util.keystr(p): rel(x, y) for x, (p, y) in zip(jax.tree.leaves(got), flat, strict=True)}


def assert_rel_close(got, want, tol: float, *, ord=None) -> None:
    """Per leaf, ‖got - want‖ <= tol ‖want‖: an error bound on the scale of each quantity, not per
    element (reordered fp32 sums leave no relative guarantee on entries near zero). `ord=None` is the
    Frobenius norm; `ord=np.inf` the largest magnitude (max|got - want| <= tol max|want|)."""
    flat = jax.tree_util.tree_flatten_with_path(want)[0]
    for x, (path, y) in zip(jax.tree.leaves(got), flat, strict=True):
        x, y = np.ravel(np.asarray(x, np.float64)), np.ravel(np.asarray(y, np.float64))
        assert x.shape == y.shape, (jax.tree_util.keystr(path), x.shape, y.shape)
        err, scale = float(np.linalg.norm(x - y, ord)), float(np.linalg.norm(y, ord))
        assert err <= tol * scale, (jax.tree_util.keystr(path), err / max(scale, 1e-30), tol)


def assert_trees_allclose(got, want, *, atol: float, rtol: float = 0.0) -> None:
    """Per leaf, element-wise |got - want| <= atol + rtol |want| (`np.testing.assert_allclose`): for two
    paths that run the same arithmetic, where the bound is a few ulps, not a norm."""
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol)


# XLA's cheap CPU codegen (LLVM at -O0, no expensive passes) as compiler options: the optimised HLO is the
# same (the collectives and buffers a test reads from it too), a test's tiny program compiles in ~60 % of
# the time and runs a little slower
FAST_CPU = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


# ----------------------------------------------------------------------------- inputs

def seed_of(*names: str) -> int:
    """A seed fixed by the test's parameters (``hash`` of a str changes with every interpreter)."""
    return zlib.crc32("/".join(names).encode())


def random_tokens(vocab: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Uniform random token ids in [0, vocab), int32 (numpy: the same ids on every backend)."""
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def random_params(params_like, rng: np.random.Generator, scale: float, norm_scale: float | None = None):
    """Fresh float32 values for a tree of arrays or shapes, drawn from `rng` leaf by leaf in tree order:
    N(0, scale²) for matrices, 1 + N(0, norm_scale²) for 1-D leaves (norm gains away from 1, so a swapped
    norm shows; `norm_scale` defaults to `scale`)."""
    ns = scale if norm_scale is None else norm_scale
    return jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * (ns if p.ndim == 1 else scale) + (p.ndim == 1),
                                              jnp.float32), params_like)


# ----------------------------------------------------------------------------- the CLI

# the CLI tests' model: two layers of d=32 (fast to compile), CoLA at rank 8
MICRO = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, rank=8)
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "d_ff", "rank")


def model_flags(cfg: ModelConfig = MICRO, fields: tuple[str, ...] = SHAPE_FIELDS) -> list[str]:
    """`cfg`'s shape as CLI flags: ["--d-model", "32", "--n-layers", "2", ...] (the fields in order)."""
    return [x for f in fields for x in (f"--{f.replace('_', '-')}", str(getattr(cfg, f)))]


def one_error_line(err: str, *needles) -> str:
    """A refusal as the CLI prints it: stderr is ONE line `boostjax: error: field: what is wrong; fix: what
    to pass` holding every needle; returns that line."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("boostjax: error: ") and "; fix: " in line, line
    for n in needles:
        assert str(n) in line, (n, line)
    return line


def cli_command(*args) -> list[str]:
    """`boostjax <args>` run by this interpreter (`python -m boostjax.cli`)."""
    return [sys.executable, "-m", "boostjax.cli", *map(str, args)]


def cli_env(**overrides: str | None) -> dict[str, str]:
    """The environment for a CLI subprocess: this checkout first on PYTHONPATH, CPU devices, the session's
    compilation cache (set by conftest.py) inherited; `overrides` set variables, None removes one."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


# ----------------------------------------------------------------------------- experiments

def load_experiment(name: str) -> ModuleType:
    """`experiments/<name>.py` as a module (the folder is not a package). The folder goes on sys.path,
    as it does for `python experiments/<name>.py`, so that the script's sibling imports (gpu_suite's
    `import gpu_step`, the charts' `strategy_bars`) work."""
    folder = str(ROOT / "experiments")
    if folder not in sys.path:
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(f"experiment_{name}", ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod
