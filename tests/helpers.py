"""Shared test helpers: one version of each thing several test files need.

- `FAST_CPU` compiler options;
- comparisons: `rel` (‖a - b‖ / ‖b‖ over arrays or whole trees), `rel_by_path`, `assert_rel_close`
  (per leaf, relative to the leaf's norm), `assert_close_ulps` / `ulps_apart` (element-wise, in ulps of
  each leaf's scale), `assert_trees_allclose` (element-wise, for exact paths);
  8-bit codes of two programs: `assert_codes_equal_off_midpoints`;
  8-bit Adam against a reference run: `adam8bit_code_flips` (the quantised moments to rounding's code
  flips), `beyond_code_flips` (the parameters less what those flips can move);
- inputs: `seed_of` (a seed fixed by a test's parameters), `random_tokens`, `random_params`;
- the CLI: `MICRO` (the tiny model of the CLI tests), `model_flags`, `one_error_line`, `cli_command`,
  `cli_env`.

Tolerances follow the arithmetic: a norm-relative error is what rounding bounds (a reordered fp32 sum
moves ‖a - b‖ by ~1e-7 ‖b‖), an element-wise relative error near zero is not. Exact equality only where
the math is exact: the same compiled program twice (a resume against the uninterrupted run), or integer,
copy, permutation and gather semantics; two different programs compare with a bound (docs/testing.md)."""

from __future__ import annotations

import os
import pathlib
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import cheap_codegen
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


def ulps_apart(got, want, dtype=None) -> float:
    """The largest max|got - want| over the leaves of two trees (or two arrays), each leaf's in ulps of
    its largest |want| (the spacing there of `dtype`, by default the leaf's); integer leaves count as 0
    when equal, inf when not."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(jax.device_get(got)), jax.tree.leaves(jax.device_get(want)), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, (x.shape, y.shape)
        if not jnp.issubdtype(y.dtype, jnp.floating):
            worst = max(worst, 0.0 if np.array_equal(x, y) else np.inf)
            continue
        x64, y64 = x.astype(np.float64), y.astype(np.float64)
        fi = jnp.finfo(dtype or y.dtype)
        scale = max(float(np.abs(y64).max(initial=0.0)), float(fi.smallest_normal))
        ulp = float(fi.eps) * 2.0 ** np.floor(np.log2(scale))
        worst = max(worst, float(np.abs(x64 - y64).max(initial=0.0)) / ulp)
    return worst


def assert_close_ulps(got, want, ulps: float) -> None:
    """Per leaf, max|got - want| <= `ulps` ulps of the leaf's largest |want| (`ulps_apart`): for two
    different programs over the same arithmetic (another fusion or vector width, FMA contraction, a short
    sum in another order), which round an entry apart by a few ulps of the quantity's scale (an entry
    near zero carries the rounding of the larger terms it came from). Integer leaves must be equal."""
    for (path, y), x in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got), strict=True):
        apart = ulps_apart(x, y)
        assert apart <= ulps, (jax.tree_util.keystr(path), f"{apart:.3g} ulps > {ulps}")


def assert_trees_allclose(got, want, *, atol: float, rtol: float = 0.0) -> None:
    """Per leaf, element-wise |got - want| <= atol + rtol |want| (`np.testing.assert_allclose`): for two
    paths that run the same arithmetic, where the bound is a few ulps, not a norm."""
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol)


def assert_codes_equal_off_midpoints(got, want, normed, table, ulps: float) -> None:
    """8-bit codes (`boostjax.optim.adam8bit.quantize`: the nearest entry of `table`) of the same values
    from two programs: equal, but where a normed value lies within `ulps` fp32 ulps of the midpoint
    between two entries, which the other program's rounding may put on the neighbouring code."""
    got, want = np.asarray(got, np.int64), np.asarray(want, np.int64)
    table = np.asarray(table, np.float64)
    mids = (table[1:] + table[:-1]) / 2
    x = np.asarray(normed, np.float64).reshape(want.shape)
    j = np.clip(np.searchsorted(mids, x), 1, mids.size - 1)
    to_mid = np.minimum(np.abs(x - mids[j - 1]), np.abs(x - mids[j]))
    near = to_mid <= ulps * np.spacing(np.abs(x).astype(np.float32)).astype(np.float64)
    off = np.argwhere((got != want) & ~(near & (np.abs(got - want) == 1)))
    assert off.size == 0, (f"{len(off)} codes differ away from a midpoint", off[:5])


# 8-bit Adam (`boostjax.optim.adam8bit`) run against a reference on another layout or batching: its
# moments are stored as codes of a 256-entry map, so an fp32 rounding difference that lands a moment on a
# midpoint between two entries becomes a whole map step (up to 30 % of a small moment), not an ulp.

def adam8bit_moments(opt_state) -> dict[str, tuple[tuple, tuple]]:
    """8-bit Adam's block-quantised moments by parameter path: {path: ((mu, SIGNED_MAP), (nu, UNSIGNED_MAP))}
    (empty for an optimizer without them)."""
    from boostjax.optim.adam8bit import SIGNED_MAP, UNSIGNED_MAP, Adam8bitState, QTensor

    def is_q(x):
        return isinstance(x, QTensor)

    out = {}
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, Adam8bitState)):
        if isinstance(s, Adam8bitState):
            for (path, mu), nu in zip(jax.tree_util.tree_flatten_with_path(s.mu, is_leaf=is_q)[0],
                                      jax.tree.leaves(s.nu, is_leaf=is_q), strict=True):
                if is_q(mu):
                    out[jax.tree_util.keystr(path)] = ((mu, SIGNED_MAP), (nu, UNSIGNED_MAP))
    return out


def adam8bit_code_flips(ref_states: list, got_states: list, grad_rtol: float) -> dict[str, np.ndarray]:
    """Asserts the 8-bit moments of two runs (optimizer states after each step) agree up to the rounding of
    gradients within `grad_rtol` of each other; returns per quantised parameter each element's largest
    relative change of its update factor m / sqrt(v) that differing codes cause (0 where they agreed).

    A stored moment is absmax x map[code], the code the map's nearest entry. absmax is a block's largest
    |m| (or v), so it carries the gradient's rounding: within grad_rtol, twice that for v = g^2 (a block
    quantised per shard, with a shard's absmax, is off by O(1)). A rounding error eps of a moment moves its
    normed value x by eps |x|: it changes the code only within eps |x| of a midpoint, and then to the
    neighbouring entry. Adjacent entries are >= r_min |x| apart (r_min: 0.70 % signed, 0.35 % unsigned), so at
    most a fraction 2 eps / r_min of the codes flips per step: with eps = 2 grad_rtol = 4e-5, 93 of 8192 m
    codes, 186 v codes (a wrong rounding rule flips half of them). Once two codes differ, the next step
    carries b x that difference (b1, b2 < 1) and rounds each fp32 moment to its nearest entry: the stored
    values then differ by at most the carried difference plus half the local gap on each side (the codes
    may drift more than one entry apart where the map is finer); equal codes are the same state again."""
    ratios, carried = {}, {}
    for t, (ref, got) in enumerate(zip(ref_states, got_states, strict=True)):
        ref_q, got_q = adam8bit_moments(ref), adam8bit_moments(got)
        assert ref_q.keys() == got_q.keys(), (ref_q.keys(), got_q.keys())
        for path, moments in ref_q.items():
            factor = 1.0
            for j, ((q_ref, table), (q_got, _)) in enumerate(zip(moments, got_q[path], strict=True)):
                where = f"step {t + 1} {path} {'mv'[j]}"
                np.testing.assert_allclose(q_got.absmax, q_ref.absmax, rtol=2 * grad_rtol, err_msg=where)
                table = np.asarray(table, np.float64)
                c_ref, c_got = (np.asarray(q.codes, np.int64) for q in (q_ref, q_got))
                scale = np.asarray(q_ref.absmax, np.float64)[:, None]
                a, b = table[c_ref], table[c_got]
                diff = np.abs(b * np.asarray(q_got.absmax, np.float64)[:, None] - a * scale)
                before = carried.get((path, j), np.zeros_like(diff))
                half_gap = np.maximum(np.diff(table, prepend=table[0]), np.diff(table, append=table[-1])) / 2
                rounding = 2 * grad_rtol * np.maximum(np.abs(a), np.abs(b))
                limit = before + (half_gap[c_ref] + half_gap[c_got] + rounding) * scale
                assert np.all(diff <= limit), (where, np.argwhere(diff > limit)[:5], float((diff - limit).max()))
                fresh = (c_got != c_ref) & (before == 0)
                assert np.abs(c_got - c_ref)[fresh].max(initial=0) <= 1, (where, np.abs(c_got - c_ref)[fresh].max())
                gaps = np.diff(table) / np.maximum(np.abs(table[1:]), np.abs(table[:-1]))
                assert np.count_nonzero(fresh) <= c_ref.size * 2 * (2 * grad_rtol) / gaps[gaps > 0].min(), (
                    where, np.count_nonzero(fresh))
                carried[path, j] = np.where(c_got != c_ref, diff, 0.0)
                with np.errstate(divide="ignore", invalid="ignore"):  # to or from the zero code: unbounded
                    if j == 0:  # m: the update is linear in m
                        change = np.where(a == b, 0.0, np.abs(b - a) / np.abs(a))
                    else:  # v: the update goes as 1 / sqrt(v)
                        change = np.where(a == b, 0.0, np.abs(np.sqrt(a / b) - 1.0))
                factor = factor * (1.0 + np.nan_to_num(np.ravel(change), nan=np.inf))
            ratios[path] = np.maximum(ratios.get(path, 0.0), factor - 1.0)
    return ratios


def beyond_code_flips(ref_weights: list, got_weights: list, flips: dict[str, np.ndarray]) -> dict[str, tuple]:
    """Per parameter path: (|w_got - w_ref| at the last step less what `flips` (`adam8bit_code_flips`)
    allows, w_ref), both flat float64. `*_weights`: the parameter trees before and after every step.

    A flip changes its element's update m^ / (sqrt(v^) + eps) at every later step by at most the fraction
    `flips` gives (a carried difference only shrinks by b1, b2 < 1), so |dw_i| <= flips_i sum_s |u_i(s)|, the
    reference's steps; what remains is the fp32 rounding of the updates, as for fp32 moments."""
    flat = [jax.tree_util.tree_flatten_with_path(w)[0] for w in ref_weights]
    out = {}
    for i, ((path, w), w_got) in enumerate(zip(flat[-1], jax.tree.leaves(got_weights[-1]), strict=True)):
        w = np.ravel(np.asarray(w, np.float64))
        dw = np.abs(np.ravel(np.asarray(w_got, np.float64)) - w)
        key = jax.tree_util.keystr(path)
        if key in flips:
            moved = sum(np.abs(np.ravel(np.asarray(a[i][1], np.float64)) - np.ravel(np.asarray(b[i][1], np.float64)))
                        for a, b in zip(flat[1:], flat[:-1]))
            with np.errstate(invalid="ignore"):  # inf x 0: a flip to or from the zero code allows anything
                dw = np.maximum(dw - np.nan_to_num(flips[key][: w.size] * moved, nan=np.inf), 0.0)
        out[key] = (dw, w)
    return out


# XLA's cheap CPU codegen as compiler options (tests/cheap_codegen.py); conftest.py sets the same for the
# whole session, these are for the compiles a test overrides. The optimised HLO has the same collectives and
# nearly the same buffers (see conftest.py); a test's tiny program compiles in about half the time and runs
# a little slower.
FAST_CPU = cheap_codegen.FAST_CPU


def compile_with(monkeypatch, options: dict) -> None:
    """Every `Lowered.compile` in the test (the trainer's and `build_step_fns`' compiles) with `options`
    on top of its own."""
    compile_ = jax.stages.Lowered.compile
    monkeypatch.setattr(jax.stages.Lowered, "compile",
                        lambda self, compiler_options=None: compile_(self, {**(compiler_options or {}), **options}))


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


def xla_flags(devices: int | None) -> str:
    """This session's XLA_FLAGS (conftest.py: the cheap CPU codegen) for a process with `devices`
    simulated CPU devices instead of 8 (None: the platform's own count, one)."""
    count = "--xla_force_host_platform_device_count="
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
    return " ".join(flags + ([f"{count}{devices}"] if devices is not None else []))


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


def random_model(cfg: ModelConfig, seed: int = 0):
    """A random `LLaMA` of ``cfg`` built on the host (eager initialisation would compile a program per op and
    shape): weights N(0, 0.1^2), the low-rank A factors N(0, 1/fan_in) (latents O(1), the SiLU far from
    linear), norm gains 1 + N(0, 0.1^2) (a swapped norm would show), LaX gates N(0, 0.3^2) (zero in training)."""
    from flax import nnx

    from boostjax.models.llama import LLaMA

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LLaMA(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def init(path, x):
        name = str(path[-1].key if hasattr(path[-1], "key") else path[-1])
        z = rng.standard_normal(x.shape).astype(np.float32)
        if name == "norm":
            return jnp.asarray(1 + 0.1 * z)
        if name == "cross":
            return jnp.asarray(0.3 * z)
        return jnp.asarray((x.shape[0] ** -0.5 if name.startswith("a_") else 0.1) * z)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(init, nnx.to_pure_dict(abstract)))


# the command line's smallest run from a pretrained start (tests/test_whitened.py, tests/test_init_refit.py)
TRAIN_ONE_STEP = ["train", "--batch", "2", "--seq", "16", "--steps", "1", "--eval-batches", "1", "--no-progress",
                  "--no-tensorboard"]


def tiny_hf_checkpoint(cfg: ModelConfig, folder: pathlib.Path) -> pathlib.Path:
    """A random dense checkpoint of ``cfg`` written as a Hugging Face folder (seed 10)."""
    from boostjax.config import Config
    from boostjax.interop import hf
    from boostjax.models.llama import abstract_model

    params = random_params(abstract_model(Config(cfg))[1], np.random.default_rng(10), 0.3, norm_scale=0.2)
    return hf.to_hf((cfg, params), folder)


def random_ids_file(vocab: int, path: pathlib.Path, n: int = 1000) -> pathlib.Path:
    """``n`` random uint16 token ids below ``vocab`` in a ``.bin`` file (seed 11; 1000 ids: 980 train, 20 val)."""
    np.random.default_rng(11).integers(0, vocab, n).astype(np.uint16).tofile(path)
    return path
