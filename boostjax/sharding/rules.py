"""Sharding from logical axes: each TP strategy is a rule set mapping the model's logical axes to mesh axes.

Every parameter declares its logical axes once, where `boostjax.models.llama` creates it (`AXES`:
`embed`, `heads`, `kv`, `ff`, `rank`, `group`, `vocab`, ...), in the spirit of MaxText's logical axis
rules. A strategy (`STRATEGIES`) is the rule set, the `Collectives` the block runs with, and the model
kinds it serves:

- fullrank-tp (Megatron): `heads`/`kv`/`ff` split, so q/k/v/gate/up are column- and o/down
  row-parallel; psum after o and down.
- vanilla-tp: `rank` split: every A column-, every B row-parallel; psum of `[b, t, d_out]` after each
  pair. Attention runs replicated on all heads.
- btp (BOOST, https://arxiv.org/abs/2512.12131): `embed` split too, so the residual stream is sharded
  along d: every A row-parallel (psum of `[b, t, r]`, carrying the norm's Σx²), every B
  column-parallel (no communication), local heads, local embedding columns.

All strategies split `vocab` (a vocabulary-parallel LM head and cross-entropy) and map `layers` (the
leading axis of a pipeline's stacked layers) to the `stage` mesh axis. A logical axis without a rule,
or a parameter without declared axes, is an error that names the parameter, never a silent replica.
The rotation optimizer's mask (which leaves rotate, along which group axes) comes from the same
declaration (`rotation_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
from jax.sharding import PartitionSpec as P

from boostjax.config import (DATA, LOW_RANK_KINDS, MODEL, MODEL_KINDS, PROJECTION_GROUPS, STAGE, ConfigError, MeshShape, ModelConfig, as_mesh,
                             flag_of)
from boostjax.models.collectives import Collectives
from boostjax.models.llama import AXES, param_axes, param_shapes

GROUP_AXES = ("group", "layers")  # axes that stack independent matrices: rotated one matrix at a time
VOCAB_AXES = ("vocab", "embed_vocab")  # embeddings and the LM head: AdamW, never rotated

# the model dimension (ModelConfig field, its size) behind each logical axis a strategy may split
AXIS_SIZES: dict[str, tuple[str, Callable[[ModelConfig], int]]] = {
    "embed": ("d_model", lambda m: m.d_model), "heads": ("n_heads", lambda m: m.n_heads),
    "kv": ("n_kv_heads", lambda m: m.kv_heads), "ff": ("d_ff", lambda m: m.d_ff), "rank": ("rank", lambda m: m.rank),
    "vocab": ("vocab_size", lambda m: m.vocab_size)}


@dataclass(frozen=True)
class Strategy:
    """A TP strategy: logical axis -> mesh axis (None = replicated), the block's collectives, and the
    model kinds it serves."""

    rules: Mapping[str, str | None]
    collectives: Collectives
    kinds: tuple[str, ...]


def _rules(split: tuple[str, ...], axes: tuple[str, ...]) -> dict[str, str | None]:
    assert set(split) <= set(axes) <= set(AXES)
    return {a: MODEL if a in split else None for a in axes} | {"layers": STAGE}


_DENSE = ("embed", "heads", "kv", "ff", "vocab", "embed_vocab", "features")
_LOW_RANK = (*_DENSE, "rank", "group", "cross", "dense_out", "dense_in")

STRATEGIES: dict[str, Strategy] = {
    "none": Strategy(_rules((), tuple(AXES)), Collectives(), MODEL_KINDS),
    "fullrank-tp": Strategy(_rules(("heads", "kv", "ff", "vocab"), _DENSE), Collectives(MODEL, "row"), ("llama",)),
    "vanilla-tp": Strategy(_rules(("rank", "vocab"), _LOW_RANK), Collectives(MODEL, "up"), LOW_RANK_KINDS),
    "btp": Strategy(_rules(("embed", "heads", "kv", "ff", "vocab"), _LOW_RANK), Collectives(MODEL, "latent"),
                    LOW_RANK_KINDS),
}
TP_STRATEGIES: tuple[str, ...] = tuple(s for s in STRATEGIES if s != "none")


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(a, str) for a in x)


def _name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def logical_axes(model_cfg: ModelConfig) -> dict:
    """The logical axes of every parameter of `LLaMA(model_cfg)`: a pure dict shaped like the canonical
    params (`{"embed": ..., "layers": {0: {...}}, ...}`) whose leaves are tuples of axis names (the
    axes `boostjax.models.llama.param_axes` reads from the model)."""
    shapes = param_shapes(model_cfg)
    tree: dict = {}
    for name, axes in param_axes(model_cfg).items():
        if not axes or len(axes) != len(shapes[name]):
            raise ValueError(f"{name.replace('.', '/')}: a parameter of shape {shapes[name]} declares logical "
                             f"axes {axes or None}; fix: create it with one name of boostjax.models.llama.AXES per dim")
        *parents, leaf = (int(k) if k.isdigit() else k for k in name.split("."))
        node = tree
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = axes
    return tree


def stack_axes(axes_tree: dict) -> dict:
    """The axes of `stack_layers(params)` (a pipeline's state): one Block tree, `layers` in front."""
    layers = axes_tree["layers"]
    blocks = [layers[i] for i in sorted(layers, key=int)]
    if any(b != blocks[0] for b in blocks[1:]):
        raise ValueError("layers: the blocks declare different axes; fix: stack only identical blocks")
    return {**axes_tree, "layers": jax.tree.map(lambda a: ("layers", *a), blocks[0], is_leaf=_is_axes)}


def _spec(rules: Mapping[str, str | None], axes: tuple[str, ...], where: str, strategy: str) -> P:
    missing = [a for a in axes if a not in rules]
    if missing:
        raise ValueError(f"{where}: logical axis {missing[0]!r} has no rule in strategy {strategy!r}; fix: add it "
                         f"to the strategy's rules in boostjax.sharding.rules (or use a strategy serving this model)")
    if axes and axes[0] == "layers":  # a stacked leaf: the stage axis, then its layer's spec
        return P(rules["layers"], *_spec(rules, axes[1:], where, strategy))
    mesh = [rules[a] for a in axes]
    used = [m for m in mesh if m is not None]
    if len(used) != len(set(used)):
        raise ValueError(f"{where}: axes {axes} put mesh axis {used} twice under strategy {strategy!r}; "
                         "fix: map at most one of its axes to each mesh axis")
    return P(*mesh) if used else P()


def param_specs(strategy: str, axes_tree: Any) -> Any:
    """A `PartitionSpec` per leaf of `axes_tree` (from `logical_axes`, or `stack_axes` of it).

    A spec is `P()` when nothing is split, else one entry per dim; a stacked leaf's is the `stage` axis
    followed by its layer's spec. ValueError naming the path for an axis the strategy has no rule for."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; fix: use one of {', '.join(STRATEGIES)}")
    rules = STRATEGIES[strategy].rules
    return jax.tree_util.tree_map_with_path(lambda path, axes: _spec(rules, axes, _name(path), strategy),
                                            axes_tree, is_leaf=_is_axes)


def rotation_mask(axes_tree: Any) -> Any:
    """What the rotation optimizer rotates: False (AdamW) for embeddings, the head (a vocab axis) and
    vectors (norms, gates); else the tuple of the leaf's group axes (`group`, `layers`) along which
    independent matrices are stacked (`()` a plain matrix, `(1,)` a_qkv `[d, 3, r]`, `(0, 2)` a stacked
    a_qkv `[L, d, 3, r]`): the two remaining axes are the matrix that is rotated."""

    def mask(path, axes):
        if any(a in VOCAB_AXES for a in axes):
            return False
        groups = tuple(i for i, a in enumerate(axes) if a in GROUP_AXES)
        matrix = len(axes) - len(groups)
        if matrix > 2:
            raise ValueError(f"{_name(path)}: axes {axes} leave {matrix} matrix dims; fix: declare the stacking axes "
                             f"as one of {GROUP_AXES}")
        return groups if matrix == 2 else False

    return jax.tree_util.tree_map_with_path(mask, axes_tree, is_leaf=_is_axes)


def factor_roles(axes_tree: Any) -> Any:
    """Per leaf `(role, matrix_axes)` for `--factor-lr`: role "factor" (a low-rank factor: a `rank` axis),
    "matrix" (any other leaf with two matrix axes: embeddings, head, dense projections) or "" (vectors);
    `matrix_axes` the axes that are not stacking (`GROUP_AXES`), over which a matrix's RMS is taken."""

    def role(axes):
        matrix = tuple(i for i, a in enumerate(axes) if a not in GROUP_AXES)
        kind = "factor" if "rank" in axes else "matrix" if len(matrix) == 2 else ""
        return (kind, matrix)

    return jax.tree.map(role, axes_tree, is_leaf=_is_axes)


def split_fields(strategy: str) -> tuple[str, ...]:
    """The ModelConfig fields behind the logical axes the strategy splits over `model`, in
    `AXIS_SIZES` order (`vocab_size` last: every strategy splits the vocabulary)."""
    rules = STRATEGIES[strategy].rules
    return tuple(f for a, (f, _) in AXIS_SIZES.items() if rules.get(a) == MODEL)


def split_sizes(strategy: str, model_cfg: ModelConfig) -> dict[str, int]:
    """The model dimensions the strategy splits over the `model` mesh axis (each must divide by the TP
    size): {ModelConfig field: size}, in `AXIS_SIZES` order."""
    rules = STRATEGIES[strategy].rules
    out: dict[str, int] = {}
    for a, (f, size) in AXIS_SIZES.items():
        if rules.get(a) == MODEL:
            out.update(rank_sizes(model_cfg) if a == "rank" else {f: size(model_cfg)})
    return out


def rank_sizes(m: ModelConfig) -> dict[str, int]:
    """The ranks of the factorised projection groups by the field that sets each (`rank`, or an override
    `rank_attn` / `rank_kv` / `rank_mlp`): what a strategy splitting `rank` must divide."""
    out: dict[str, int] = {}
    for g in PROJECTION_GROUPS:
        if m.group_low_rank(g):
            out.setdefault(f"rank_{g}" if getattr(m, f"rank_{g}") else "rank", m.group_rank(g))
    return out


def check_strategy(model: ModelConfig, strategy: str, tp: int, where: str = "train") -> None:
    """`ConfigError` (one line) when `strategy` cannot split this model over a model axis of `tp`
    devices: a model kind it does not serve, a model axis without a TP strategy, a split dimension
    (or the vocabulary) that `tp` does not divide."""
    kinds = STRATEGIES[strategy].kinds
    if model.kind not in kinds:
        raise ConfigError(f"{where}.strategy: {strategy} does not serve model kind {model.kind!r}; fix: use --model "
                          f"{' or '.join(kinds)} or another --strategy")
    if strategy == "none" and tp > 1:
        raise ConfigError(f"{where}.mesh: a model axis > 1 needs a TP strategy; fix: pass --strategy btp, vanilla-tp "
                          "or fullrank-tp")
    for name, value in (split_sizes(strategy, model).items() if tp > 1 else ()):
        if value % tp:
            raise ConfigError(f"model.{name}: {value} is not divisible by the TP size {tp} ({strategy}); "
                              f"fix: choose {flag_of(name)} a multiple of {tp} or a smaller model axis")


def check_mesh_for(model: ModelConfig, strategy: str, mesh: MeshShape | str | None, batch: int, seq: int,
                   where: str = "train") -> None:
    """`ConfigError` (one line: field and fix) when `strategy` on `mesh` (a `MeshShape`, or a `--mesh`
    string, read here; None or '' = no mesh) cannot run this model, batch and seq: an unreadable mesh,
    an unknown strategy, a TP strategy without a mesh, a model kind it does not serve, a model axis
    without a TP strategy, TP sizes not dividing the split dimensions or the vocabulary, stages not
    dividing the layers, data not dividing the batch, a pipeline's tokens not splitting over its
    stages. `where` prefixes the batch/seq/strategy/mesh fields (`train` or `plan`). The trainer and
    the planner both run it."""
    mesh = as_mesh(mesh, f"{where}.mesh")
    if strategy not in STRATEGIES:
        raise ConfigError(f"{where}.strategy: unknown strategy {strategy!r}; fix: use one of {', '.join(STRATEGIES)}")
    if strategy != "none" and mesh is None:
        raise ConfigError(f"{where}.mesh: strategy {strategy} needs a mesh; fix: pass --mesh data=1,model=2")
    data, stage, tp = (1, 1, 1) if mesh is None else (mesh.data, mesh.stage, mesh.model)
    check_strategy(model, strategy, tp, where)
    if model.n_layers % stage:
        raise ConfigError(f"model.n_layers: {model.n_layers} layers do not split into stage={stage} equal "
                          f"contiguous stages; fix: pass --n-layers a multiple of {stage} or a stage count that "
                          f"divides {model.n_layers}")
    if batch % data:
        raise ConfigError(f"{where}.batch: {batch} is not divisible by data={data}; fix: pass --batch a multiple "
                          f"of {data}")
    if stage > 1 and (batch // data) * seq % stage:
        raise ConfigError(f"{where}.seq: the head and loss are split over the stages by tokens, and the "
                          f"{batch // data}x{seq} tokens per data shard do not split into stage={stage} equal "
                          f"parts; fix: pass --seq a multiple of {stage}")


def data_sharded(spec: P, shape: tuple[int, ...], data: int) -> P:
    """`spec` with the `data` axis added to the first dimension that is unsharded and divisible by
    `data` (ZeRO's partitioning of optimizer state and, at stage 3, parameters over data-parallel
    replicas: https://arxiv.org/abs/1910.02054); unchanged when no dimension qualifies, when the
    spec already uses `data`, or when `data` is 1."""
    used = {a for s in spec for a in (s if isinstance(s, tuple) else (s,)) if a is not None}
    if data <= 1 or DATA in used:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for i, (s, n) in enumerate(zip(entries, shape)):
        if s is None and n >= data and n % data == 0:
            entries[i] = DATA
            return P(*entries)
    return spec

