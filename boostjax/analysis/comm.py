"""Communication accounting from compiled HLO: `comm_report` and the `boostjax comm` subcommand.

One training step (forward, backward, AdamW update) and the forward loss alone are compiled
abstractly — `jax.jit(f).lower(ShapeDtypeStructs with shardings).compile()` — so nothing is
allocated and 7B/13B shapes compile on a laptop with simulated CPU devices. Everything reported
is read from the compiled HLO text (`boostjax.analysis.hlo`) and `compiled.memory_analysis()`.

Per-layer figures are exact differences: the same model, mesh, batch, sequence, dtype and remat
compiled with `n_layers=2` and with `n_layers=1`. Everything outside the blocks (embedding, final
gather, LM head, vocabulary-parallel cross-entropy, optimizer, data-parallel means) is identical
in both programs and cancels, leaving the collectives and GEMMs of one block.

Bytes: `*_bytes` count each collective's result in the element type the program communicates.
The CPU backend has no bf16 all-reduce: it rounds to bf16 and widens to f32 first; such widened
collectives are counted at bf16 (what a GPU/TPU moves). `*_bytes_compiled` is what this CPU
executable moves. Collectives over single-device groups (a mesh axis of size 1) move nothing and
are not counted. Counts are static HLO instructions; XLA may combine independent all-reduces into
one variadic all-reduce, so compare bytes rather than counts.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Sequence

import jax
import numpy as np

from boostjax.analysis import hlo, memory
from boostjax.config import (
    DATA,
    LOW_RANK_KINDS,
    MODEL,
    REMAT,
    TP_STRATEGIES,
    Config,
    ConfigError,
    MeshShape,
    ModelConfig,
    as_mesh,
)
from boostjax.models import stat_parts
from boostjax.models.llama import param_axes, param_shapes
from boostjax.sharding import rules
from boostjax.training.checks import validate as validate_run

STRATEGIES = TP_STRATEGIES  # the TP strategies a report compares
MEMORY_KEYS = ("peak_bytes_per_device", "weight_bytes", "optimizer_bytes", "activation_bytes", "batch_bytes",
               "gradient_bytes_estimate")
_ITEMSIZE = {"float32": 4, "bfloat16": 2}
_HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class _Compiled:
    step_text: str
    fwd_text: str
    step_memory: dict[str, int]
    fwd_memory: dict[str, int]
    residual_bytes: int | None = None
    step_cost: dict[str, float] | None = None  # `compiled.cost_analysis()` of the step (per device)
    parts: dict[str, int] | None = None  # `memory.memory_parts` of the step: peak and its parts
    fwd_emitted: int = 0  # all-reduces JAX emits in the forward loss (StableHLO, before XLA combines any)
    unsplit: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (name, shape) of the gradients left whole over data


def model_for(model: ModelConfig, strategy: str) -> ModelConfig:
    """Full-rank TP compiles the dense LLaMA of the same shapes; the low-rank strategies the given kind."""
    if strategy == "fullrank-tp":
        return replace(model, kind="llama")
    if strategy not in STRATEGIES:
        raise ConfigError(f"comm.strategy: unknown strategy {strategy!r}; fix: use one of {', '.join(STRATEGIES)}")
    if model.kind not in LOW_RANK_KINDS:
        raise ConfigError(f"comm.model: {strategy} needs a low-rank kind, got {model.kind!r}; "
                          f"fix: pass --model {' or '.join(LOW_RANK_KINDS)}")
    return model


def _cost(compiled) -> dict[str, float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):  # older JAX: one dict per program
        ca = ca[0] if ca else {}
    return {k: float(v) for k, v in (ca or {}).items() if isinstance(v, (int, float))}


Train = tuple[tuple[str, Any], ...]  # further TrainConfig fields, hashable (the compiles are cached)


def _build(model: ModelConfig, mesh: MeshShape | None, batch: int, seq: int, strategy: str, remat: str, dtype: str, *,
           step: bool, with_residuals: bool, forward: bool = True, train: Train = ()) -> _Compiled:
    """Compile (abstractly) the training step exactly as `boostjax train` does
    (`memory.train_step_compiled`), the forward loss, and/or the residual-returning forward."""


    if mesh is None:
        raise ConfigError("comm.mesh: a mesh is required; fix: pass --mesh data=1,model=4")
    cfg = validate_run(Config(model, memory.train_config(batch, seq, strategy, mesh, remat, dtype, **dict(train))))
    abstract = memory.train_step_compiled(cfg)
    p_sds, b_sds = abstract.params, abstract.batch
    opts = memory.FAST_CPU if jax.default_backend() == "cpu" else None
    out = _Compiled("", "", {}, {})
    if step:
        step_c = abstract.compiled
        fwd_l = jax.jit(abstract.loss_fn).lower(p_sds, b_sds) if forward else None
        fwd_c = fwd_l.compile(opts) if fwd_l else None
        out = _Compiled(step_c.as_text(), fwd_c.as_text() if fwd_c else "", memory.memory_fields(step_c),
                        memory.memory_fields(fwd_c) if fwd_c else {}, step_cost=_cost(step_c),
                        parts=memory.memory_parts(abstract),
                        fwd_emitted=fwd_l.as_text().count('"stablehlo.all_reduce"') if fwd_l else 0,
                        unsplit=_unsplit(abstract.params, abstract.grads))
    if with_residuals:  # what the forward keeps for the backward (the remat policy decides it)
        loss_fn = abstract.loss_fn
        res_c = jax.jit(lambda p, b: jax.vjp(loss_fn, p, b)[1]).lower(p_sds, b_sds).compile(opts)
        out = replace(out, residual_bytes=memory.memory_fields(res_c).get("output_bytes"))
    return out


def _compile(model: ModelConfig, mesh: MeshShape, batch: int, seq: int, strategy: str, remat: str, dtype: str,
             with_residuals: bool = False, train: Train = ()) -> _Compiled:
    """Compile one training step and the forward loss on abstract, sharded inputs (cached).

    With `with_residuals`, also the forward that returns the backward's residuals (`jax.vjp`'s
    saved values): its per-device output bytes measure what the remat policy keeps.
    """
    if with_residuals:
        return _compile_residuals(model, mesh, batch, seq, strategy, remat, dtype, train)
    return _compile_step(model, mesh, batch, seq, strategy, remat, dtype, train)


@functools.lru_cache(maxsize=32)
def _compile_residuals(model: ModelConfig, mesh: MeshShape, batch: int, seq: int, strategy: str, remat: str,
                       dtype: str, train: Train = ()) -> _Compiled:
    base = _compile_step(model, mesh, batch, seq, strategy, remat, dtype, train)
    res = _build(model, mesh, batch, seq, strategy, remat, dtype, step=False, with_residuals=True, train=train)
    return replace(base, residual_bytes=res.residual_bytes)


@functools.lru_cache(maxsize=32)
def _compile_step(model: ModelConfig, mesh: MeshShape, batch: int, seq: int, strategy: str, remat: str,
                  dtype: str, train: Train = ()) -> _Compiled:
    return _build(model, mesh, batch, seq, strategy, remat, dtype, step=True, with_residuals=False, train=train)


@functools.lru_cache(maxsize=64)
def compiled_step(model: ModelConfig, mesh: MeshShape | str, batch: int, seq: int, strategy: str,
                  remat: str = "none", dtype: str = "bfloat16") -> _Compiled:
    """One training step of `model` (its kind mapped by `model_for`), compiled abstractly (cached):
    `.step_text` (HLO), `.step_cost` (`cost_analysis()`: per-device `flops`, `bytes accessed`, ...) and
    `.step_memory`. The forward loss alone is not compiled (`.fwd_text` is empty)."""
    return _build(model_for(model, strategy), as_mesh(mesh, "comm.mesh"), batch, seq, strategy, remat, dtype,
                  step=True, with_residuals=False, forward=False)


def _unsplit(params: Any, grads: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of every gradient whose sharding does not split it over `data`."""
    if grads is None:
        return ()
    out = []
    for (path, a), g in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(grads)):
        if not any(DATA in (s if isinstance(s, tuple) else (s,)) for s in g.spec):
            out.append(("/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path), tuple(a.shape)))
    return tuple(out)


def ring_bytes(c: hlo.Collective) -> float:
    """Bytes one device sends for collective `c` in a ring over its group of n devices: an all-reduce
    `2(n-1)/n` x its result, a reduce-scatter `(n-1)` x its result (`(n-1)/n` x its input, half an
    all-reduce of the same input), an all-gather or all-to-all `(n-1)/n` x its result, a permute its result."""
    n = c.group_size
    factor = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1, "all-gather": (n - 1) / n,
              "all-to-all": (n - 1) / n}.get(c.kind, 1.0)
    return factor * c.logical_bytes


def _data_parallel(cs: list[hlo.Collective], mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, Any]:
    """The collectives over `data` alone, per kind (count, result bytes, `ring_bytes`), and the ring
    bytes of the reductions among them (all-reduce + reduce-scatter: the data-parallel gradient)."""
    kinds: dict[str, dict[str, int]] = {}
    for c in cs:
        if c.trivial or _axes(c, mesh_shape, names) != DATA:
            continue
        s = kinds.setdefault(c.kind, {"count": 0, "bytes": 0, "ring_bytes": 0})
        s["count"] += 1
        s["bytes"] += c.logical_bytes
        s["ring_bytes"] += round(ring_bytes(c))
    reduce = sum(kinds.get(k, {}).get("ring_bytes", 0) for k in ("all-reduce", "reduce-scatter"))
    return {"reduce_ring_bytes": reduce, "collectives": dict(sorted(kinds.items()))}


def _axes(c: hlo.Collective, mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> str:
    """The mesh axes a collective's groups span ("model", "data", "data+model"; "all" if unstated)."""
    if not c.groups:
        return "all"
    n = int(np.prod(mesh_shape))
    varying = set()
    for g in c.groups:
        if any(i >= n for i in g):
            return "?"
        coords = np.array(np.unravel_index(list(g), mesh_shape))
        varying |= {names[a] for a in range(len(mesh_shape)) if len(set(coords[a])) > 1}
    return "+".join(sorted(varying)) or "none"


def _allreduce_stats(cs: list[hlo.Collective], mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, Any]:
    ar = [c for c in cs if c.kind == "all-reduce" and not c.trivial]
    by_axis: dict[str, int] = {}
    for c in ar:
        key = _axes(c, mesh_shape, names)
        by_axis[key] = by_axis.get(key, 0) + c.logical_bytes
    scalar = sum(a.bytes(dt) for c in ar for a, dt in zip(c.results, c.logical_dtypes) if not a.shape)
    return {"count": len(ar), "bytes": sum(c.logical_bytes for c in ar), "bytes_compiled": sum(c.bytes for c in ar),
            "elements": sum(c.elements for c in ar), "scalar_bytes": scalar, "by_axis": by_axis}


def _sub_axes(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = {k: a.get(k, 0) - b.get(k, 0) for k in sorted(set(a) | set(b))}
    return {k: v for k, v in out.items() if v}


def _non_allreduce_collectives(cs: list[hlo.Collective]) -> dict[str, dict[str, int]]:
    """Per collective kind other than all-reduce (trivial ones skipped): count, logical and compiled bytes."""
    out: dict[str, dict[str, int]] = {}
    for c in cs:
        if c.kind == "all-reduce" or c.trivial:
            continue
        s = out.setdefault(c.kind, {"count": 0, "bytes": 0, "bytes_compiled": 0})
        s["count"] += 1
        s["bytes"] += c.logical_bytes
        s["bytes_compiled"] += c.bytes
    return out


def _collectives_added(a: dict, b: dict) -> dict[str, dict[str, int]]:
    """`a - b` per kind and field (e.g. a 2-layer program's collectives less a 1-layer one's: one layer's)."""
    out = {}
    for kind in sorted(set(a) | set(b)):
        d = {k: a.get(kind, {}).get(k, 0) - b.get(kind, {}).get(k, 0) for k in ("count", "bytes", "bytes_compiled")}
        if any(d.values()):
            out[kind] = d
    return out


def _describe(c: hlo.Collective) -> dict[str, Any]:
    return {"shapes": [str(a) for a in c.results], "dtypes": list(c.logical_dtypes), "bytes": c.logical_bytes,
            "group_size": c.group_size}


def _layer_collectives(two: list[hlo.Collective], one: list[hlo.Collective]) -> list[dict[str, Any]]:
    """The all-reduces of the 2-layer program without a match (same shapes and types) in the 1-layer one."""
    key = lambda c: (tuple(str(a) for a in c.results), c.logical_dtypes)  # noqa: E731
    left: dict[Any, int] = {}
    for c in one:
        if c.kind == "all-reduce" and not c.trivial:
            left[key(c)] = left.get(key(c), 0) + 1
    out = []
    for c in two:
        if c.kind != "all-reduce" or c.trivial:
            continue
        if left.get(key(c), 0):
            left[key(c)] -= 1
        else:
            out.append(_describe(c))
    return out


def _gemm_summary(fwd_two: hlo.Module, fwd_one: hlo.Module, dtype: str) -> dict[str, Any]:
    """The GEMMs of one block (forward): where, shapes, reduction size K and arithmetic intensity."""
    layer = hlo.multiset_difference(hlo.gemms(fwd_two), hlo.gemms(fwd_one))
    dt = _HLO_DTYPE[dtype]
    rows, proj = [], []
    for g in layer:
        core = g.weight_operand is None  # no operand is a weight: attention's q·k and p·v
        if g.source:
            fn, path, line = g.source[0]
            where = f"{os.path.basename(path)}:{line} {fn}"
        else:
            where = "/".join(g.op_name.split("/")[-2:]) or "(no metadata)"
        rows.append({"where": where, "lhs": str(g.lhs), "rhs": str(g.rhs),
                     "out": str(g.out), "k": g.k, "m": g.m, "n": g.n, "batch": g.batch, "flops": g.flops,
                     "intensity": round(g.intensity(dt), 2), "attention_core": core})
        if not core:
            proj.append(g)
    flops = sum(g.flops for g in proj)
    moved = sum(g.bytes_moved(dt) for g in proj)
    return {
        "per_layer": sorted(rows, key=lambda r: (r["attention_core"], r["where"])),
        "projection_k": sorted(g.k for g in proj),
        "mean_intensity": round(sum(g.intensity(dt) for g in proj) / len(proj), 2) if proj else 0.0,
        "flop_weighted_intensity": round(flops / moved, 2) if moved else 0.0,
        "intensity_dtype": dt,
    }


def expected_per_layer(model: ModelConfig, strategy: str, tokens: int, dtype: str, tp: int = 1) -> dict[str, Any]:
    """Analytic all-reduce volume of one block (from the shapes alone), for comparison.

    Forward elements per token: full-rank `2d`; vanilla `he + 2·ke + 2d + 2f` (= `5d + 2f` without
    GQA); BTP `7r` plus two fp32 norm statistics (`Σx²` of each pre-norm, `[b, s, 1]`, riding in the
    qkv and gate_up all-reduces). BOOST's step figure (https://arxiv.org/abs/2512.12131) doubles the
    forward (BTP's statistics need no backward collective: their cotangent is replicated). With bf16
    latents each statistic travels as `stat_parts.n_parts(tp)` bf16 parts.
    """
    per_token = _psum_elements_per_token(model, strategy)
    stats = 2 if strategy == "btp" else 0
    item = _ITEMSIZE[dtype]
    stat_bytes = 2 * stat_parts.n_parts(tp) if dtype == "bfloat16" else 4
    fwd = tokens * (per_token * item + stats * stat_bytes)
    gathered = _gathered_elements_per_token(model, strategy)
    return {"forward_elements_per_token": per_token, "stats_per_token": stats,
            "forward_bytes": fwd, "step_bytes": fwd + tokens * per_token * item,
            "forward_allgather_elements_per_token": gathered, "forward_allgather_bytes": tokens * gathered * item}


def _psum_elements_per_token(model: ModelConfig, strategy: str) -> int:
    """Elements per token the forward of one block all-reduces: every GEMM whose contracted (input)
    dimension the strategy splits over `model` is row-parallel, its output a partial sum. Read from the
    block's parameters (`param_shapes`, stored `[in, out]`, group axes aside) and their logical axes
    under the strategy's rules (`boostjax.sharding.rules`)."""
    split = rules.STRATEGIES[strategy].rules
    axes = param_axes(model, block=True)
    total = 0
    for name, shape in param_shapes(model, block=True).items():
        matrix = [i for i, a in enumerate(axes[name]) if a not in rules.GROUP_AXES]
        if len(matrix) == 2 and split.get(axes[name][matrix[0]]) == MODEL:
            total += math.prod(shape) // shape[matrix[0]]
    return total


def _gathered_elements_per_token(model: ModelConfig, strategy: str) -> int:
    """Elements per token the forward of one block all-gathers: under BTP (the residual stream split
    along d) a dense o / down kept in a low-rank model (`dense_in` axes) reads all heads or d_ff columns."""
    split = rules.STRATEGIES[strategy].rules
    if split.get("embed") != MODEL:
        return 0
    axes = param_axes(model, block=True)
    return sum(shape[0] for name, shape in param_shapes(model, block=True).items() if axes[name][0] == "dense_in")


def _checked_mesh(mesh: MeshShape | str, dtype: str, remat: str) -> MeshShape:
    """The mesh of `comm_report` (a `--mesh` string read here, once), after its dtype and remat are checked."""
    mesh = as_mesh(mesh, "comm.mesh")
    if mesh is None:
        raise ConfigError("comm.mesh: a mesh is required; fix: pass --mesh data=1,model=4")
    if dtype not in _ITEMSIZE:
        raise ConfigError(f"comm.dtype: unknown dtype {dtype!r}; fix: use float32 or bfloat16")
    if remat not in REMAT:
        raise ConfigError(f"comm.remat: unknown remat {remat!r}; fix: use one of {', '.join(REMAT)}")
    return mesh


def _write_hlo(folder: str, strategy: str, full) -> None:
    """`<folder>/<strategy>.hlo.txt` (the step) and `<strategy>.fwd.hlo.txt` (the forward loss)."""
    os.makedirs(folder, exist_ok=True)
    for suffix, text in ((".hlo.txt", full.step_text), (".fwd.hlo.txt", full.fwd_text)):
        with open(os.path.join(folder, strategy + suffix), "w") as fh:
            fh.write(text)


def _against_zero0(dp: dict, ref: dict, unsplit) -> dict[str, Any]:
    """A ZeRO step's data-parallel reductions against the same step replicated (`ref`, ZeRO 0)."""
    ratio = dp["reduce_ring_bytes"] / ref["reduce_ring_bytes"] if ref["reduce_ring_bytes"] else 0.0
    return {"zero0_reduce_ring_bytes": ref["reduce_ring_bytes"], "reduce_vs_zero0": ratio,
            "unsplit_gradients": {name: list(s) for name, s in unsplit}}


def _layer_diff(ar: dict):
    """(a, b, field) -> ar[a][field] - ar[b][field]: one layer's share, from a 2- and a 1-layer program."""
    return lambda a, b, k: ar[a][k] - ar[b][k]


def _allreduce_fields(ar: dict, cs: dict, emitted_per_layer: int) -> dict[str, Any]:
    """The report's all-reduce fields: whole step and forward, per layer (2-layer minus 1-layer programs),
    by mesh axis, and the per-layer all-reduces themselves. `emitted_per_layer`: what JAX emits per layer."""
    lay = _layer_diff(ar)
    fwd_layer, step_layer = lay("fwd2", "fwd1", "bytes"), lay("step2", "step1", "bytes")
    return {
        "allreduce_count": ar["step"]["count"],
        "allreduce_bytes": ar["step"]["bytes"],
        "allreduce_bytes_compiled": ar["step"]["bytes_compiled"],
        "forward_allreduce_count": ar["fwd"]["count"],
        "forward_allreduce_bytes": ar["fwd"]["bytes"],
        "forward_allreduce_bytes_compiled": ar["fwd"]["bytes_compiled"],
        "allreduce_count_per_layer": lay("step2", "step1", "count"),
        "allreduce_bytes_per_layer": step_layer,
        "allreduce_bytes_compiled_per_layer": lay("step2", "step1", "bytes_compiled"),
        "forward_allreduce_count_per_layer": lay("fwd2", "fwd1", "count"),
        "forward_allreduce_emitted_per_layer": emitted_per_layer,
        "forward_allreduce_bytes_per_layer": fwd_layer,
        "forward_allreduce_bytes_compiled_per_layer": lay("fwd2", "fwd1", "bytes_compiled"),
        "backward_allreduce_bytes_per_layer": step_layer - fwd_layer,
        "allreduce_scalar_bytes_per_layer": lay("step2", "step1", "scalar_bytes"),
        "allreduce_bytes_by_axis": ar["step"]["by_axis"],
        "forward_allreduce_bytes_by_axis": ar["fwd"]["by_axis"],
        "allreduce_bytes_per_layer_by_axis": _sub_axes(ar["step2"]["by_axis"], ar["step1"]["by_axis"]),
        "forward_allreduce_bytes_per_layer_by_axis": _sub_axes(ar["fwd2"]["by_axis"], ar["fwd1"]["by_axis"]),
        "forward_allreduces_per_layer": _layer_collectives(cs["fwd2"], cs["fwd1"]),
        "allreduces_per_layer": _layer_collectives(cs["step2"], cs["step1"]),
    }


def comm_report(model: ModelConfig, mesh: MeshShape | str, batch: int, seq: int, strategy: str, remat: str = "none",
                dtype: str = "bfloat16", dump_hlo: str | None = None, **train_fields) -> dict[str, Any]:
    """All-reduce count and bytes of one training step and of the forward, whole model and per layer.

    `model` gives the shapes (fullrank-tp compiles it as the dense `llama` kind, vanilla-tp / btp as its
    low-rank kind); the step is the one `boostjax train` compiles (`memory.train_step_compiled`), compiled
    abstractly; `train_fields` are further `TrainConfig` fields. Per-layer values are exact differences
    between the 2-layer and the 1-layer programs; memory, other collectives, the data-parallel comparison
    with ZeRO 0 and the analytic volume come with them. Every field, and `dump_hlo=DIR`'s files:
    docs/tensor-parallelism.md, "The fields of comm_report".
    """
    mesh = _checked_mesh(mesh, dtype, remat)
    m = model_for(model, strategy)
    if dump_hlo:
        check_dump_dir(dump_hlo, (strategy,))
    train = tuple(sorted(train_fields.items()))
    unit = mesh.stage  # a pipeline: one layer more on every stage
    full = _compile(m, mesh, batch, seq, strategy, remat, dtype, True, train)
    two = _compile(replace(m, n_layers=2 * unit), mesh, batch, seq, strategy, remat, dtype, train=train)
    one = _compile(replace(m, n_layers=unit), mesh, batch, seq, strategy, remat, dtype, train=train)
    if dump_hlo:
        _write_hlo(dump_hlo, strategy, full)
    texts = {"step": full.step_text, "fwd": full.fwd_text, "step2": two.step_text, "step1": one.step_text,
             "fwd2": two.fwd_text, "fwd1": one.fwd_text}
    parsed = {t: hlo.parse_module(t) for t in set(texts.values())}
    mods = {k: parsed[t] for k, t in texts.items()}
    cs = {k: hlo.collectives(v) for k, v in mods.items()}
    names = mesh.axes
    shape = tuple(getattr(mesh, n) for n in names)
    ar = {k: _allreduce_stats(v, shape, names) for k, v in cs.items()}
    tokens = batch // mesh.data * seq  # tokens in one device's all-reduce
    exp = expected_per_layer(m, strategy, tokens, dtype, mesh.model)
    lay = _layer_diff(ar)
    dp = _data_parallel(cs["step"], shape, names) | {"zero": train_fields.get("zero", 0), "data": mesh.data}
    if dp["zero"] >= 1 and mesh.data > 1:  # the same step replicated (ZeRO 0), for the comparison
        zero0 = tuple(sorted({**train_fields, "zero": 0}.items()))
        step0 = _compile(m, mesh, batch, seq, strategy, remat, dtype, train=zero0).step_text
        dp |= _against_zero0(dp, _data_parallel(hlo.collectives(step0), shape, names), full.unsplit)
    fwd_layer, step_layer = lay("fwd2", "fwd1", "bytes"), lay("step2", "step1", "bytes")
    return {
        "strategy": strategy, "kind": m.kind, "mesh": str(mesh), "tp": mesh.model, "batch": batch,
        "seq": seq, "dtype": dtype, "remat": remat, "n_layers": m.n_layers,
        "model": {k: getattr(m, k) for k in ("d_model", "n_layers", "n_heads", "kv_heads", "d_ff", "rank",
                                              "vocab_size")},
        # per projection group: its rank, or "dense" (a group whose factors would not be smaller)
        "ranks": m.group_ranks if m.low_rank else {},
        **_allreduce_fields(ar, cs, two.fwd_emitted - one.fwd_emitted),
        "other_collectives": _non_allreduce_collectives(cs["step"]),
        "forward_other_collectives": _non_allreduce_collectives(cs["fwd"]),
        "other_collectives_per_layer": _collectives_added(_non_allreduce_collectives(cs["step2"]),
                                                          _non_allreduce_collectives(cs["step1"])),
        "data_parallel": dp,
        **{k: full.parts[k] for k in MEMORY_KEYS},
        "train": dict(train_fields),
        "temp_bytes": full.step_memory.get("temp_bytes", 0),
        "forward_temp_bytes": full.fwd_memory.get("temp_bytes", 0),
        "residual_bytes": full.residual_bytes,
        "memory": full.step_memory,
        "gemms": _gemm_summary(mods["fwd2"], mods["fwd1"], dtype),
        "expected_per_layer": exp,
        "forward_vs_expected": fwd_layer / exp["forward_bytes"] if exp["forward_bytes"] else 0.0,
        "step_vs_expected": step_layer / exp["step_bytes"] if exp["step_bytes"] else 0.0,
    }


# -- CLI ------------------------------------------------------------------------------------------


def check_dump_dir(path: str, strategies: Sequence[str]) -> None:
    """`--dump-hlo DIR` can take `DIR/<strategy>.hlo.txt` and `.fwd.hlo.txt`: DIR is a folder or can be
    made one (no file on its path), and files already there are HLO dumps (replaced), never anything
    else. Checked before anything is compiled."""
    if "\0" in path:
        raise ConfigError(f"comm.dump_hlo: {path!r} contains a NUL byte; fix: pass a folder path")
    p = os.path.abspath(path)
    probe = p
    while not os.path.exists(probe):  # the nearest existing folder on the path must be a folder
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        what = "is a file" if probe == p else f"lies under the file {probe}"
        raise ConfigError(f"comm.dump_hlo: {path} {what}, not a folder; fix: pass a folder for the HLO dumps, "
                          "e.g. --dump-hlo hlo")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"comm.dump_hlo: the folder {probe} is not writable; fix: pass another --dump-hlo")
    for s in strategies:
        for name in (f"{s}.hlo.txt", f"{s}.fwd.hlo.txt"):
            f = os.path.join(p, name)
            if os.path.lexists(f) and not _is_hlo_dump(f):
                raise ConfigError(f"comm.dump_hlo: {f} exists and is not an HLO dump (left untouched); "
                                  "fix: pass another --dump-hlo folder, or move that file away yourself")


def _is_hlo_dump(path: str) -> bool:
    try:
        if not os.path.isfile(path):
            return False
        if os.path.getsize(path) == 0:
            return True  # an empty forward dump (compiled_step writes none)
        with open(path, "rb") as fh:
            return fh.read(9) == b"HloModule"
    except OSError:
        return False
