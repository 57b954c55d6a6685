"""Start a run from pretrained weights: a Hugging Face LLaMA folder (or GGUF), dense or factored.

    train --init-from-hf PATH                                 # the dense LLaMA, its weights as they are
    train --init-from-hf PATH --model svd|cola|lax --rank r   # each projection a rank-r factorisation

The model's shapes come from the checkpoint; `--model`, the ranks, `--init-factor` and every training
flag apply. svd splits each projection's truncated SVD into balanced factors; cola / lax enter it as
± pairs (`silu(z) - silu(-z) = z`), keep the checkpoint's `silu(gate) * up` MLP and start LaX's gates
at zero; `whitened` truncates by output error on calibration tokens. The splits, the report's fields and
measured errors: docs/init_from_hf.md ("Factoring a dense projection", "The report").
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from boostjax.config import (CALIBRATED_FACTORS, DEFAULT_CALIB_TOKENS, PROJECTION_GROUPS, Config, ConfigError,
                             ModelConfig, TrainConfig, flag_of)
from boostjax.data.corpus import Corpus
from boostjax.data.source import Source, open_source, resolve_source
from boostjax.data.tokenizers import (TOKENIZER_FILE, ByteTokenizer, Tokenizer, gguf_side_files, gguf_tokenizer,
                                      load_tokenizer, same_tokenizer, tokenizer_kind)
from boostjax.interop import calibration, gguf_in, hf, ranks, refit
from boostjax.models.llama import LLaMA, param_shapes, projections
from boostjax.runs.folder import RunFolder
from boostjax.runtime.interrupt import Progress, phase

SOURCE_FIELD = "train.init_from_hf"
REPORT_FILE = "init_report.json"
# model fields a run from a checkpoint chooses itself; every other one is the checkpoint's
CHOSEN: frozenset[str] = frozenset({"kind", "rank", "rank_attn", "rank_kv", "rank_mlp", "auto_dense", "attention",
                                    "attention_block"})
def _err(msg: str) -> ConfigError:
    return ConfigError(f"{SOURCE_FIELD}: {msg}")


def source_config(path: str) -> ModelConfig:
    """The dense `ModelConfig` of a Hugging Face folder, from its `config.json` alone (no weights are
    read); ConfigError naming `train.init_from_hf` when the folder cannot be a checkpoint."""

    if gguf_in.is_gguf(path):  # a llama.cpp file: its metadata
        try:
            return gguf_in.read_gguf_config(path)
        except ValueError as e:
            raise _err(" ".join(str(e).removeprefix("from_hf: ").split())) from None
    folder = pathlib.Path(path)
    if not folder.exists():
        raise _err(f"{folder} does not exist; fix: pass a Hugging Face model folder (config.json, model.safetensors)")
    if not folder.is_dir():
        raise _err(f"{folder} is a file, not a folder; fix: pass the folder that holds config.json and "
                   "model.safetensors")
    if not (folder / hf.CONFIG_NAME).is_file():
        raise _err(f"no {hf.CONFIG_NAME} in {folder}; fix: pass a Hugging Face model folder (save_pretrained output)")
    if not ((folder / hf.WEIGHTS_NAME).is_file() or (folder / hf.INDEX_NAME).is_file()):
        raise _err(f"no {hf.WEIGHTS_NAME} or {hf.INDEX_NAME} in {folder}; fix: save the model with "
                   "save_pretrained(..., safe_serialization=True)")
    try:
        d = json.loads((folder / hf.CONFIG_NAME).read_text(encoding="utf-8"))
        if not isinstance(d, dict):
            raise ValueError(f"{folder / hf.CONFIG_NAME} is not a JSON object; fix: restore it from save_pretrained")
        gen_file = folder / hf.GENERATION_NAME  # token ids where config.json has none, as read_hf reads them
        gen = json.loads(gen_file.read_text(encoding="utf-8")) if gen_file.is_file() else None
        return hf.config_from_hf(d, gen if isinstance(gen, dict) else None)
    except OSError as e:
        raise _err(f"cannot read {folder / hf.CONFIG_NAME} ({e.strerror or type(e).__name__}); "
                   "fix: check its permissions") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _err(f"{folder / hf.CONFIG_NAME} is not valid JSON; fix: restore it from save_pretrained") from None
    except ValueError as e:
        raise _err(" ".join(str(e).split())) from None


def _source_or_stored(path: str, out: str) -> ModelConfig:
    """The checkpoint's shapes; when its folder is gone, those of a run in `out` that started from it
    (a resume needs the shapes, not the weights)."""
    try:
        return source_config(path)
    except ConfigError:
        try:
            stored = RunFolder(out).stored_config() if isinstance(out, str) and out.strip() else None
        except (OSError, ValueError):
            stored = None
        if stored is None or stored.train.init_from_hf != path or pathlib.Path(path).exists():
            raise
        return dataclasses.replace(stored.model, kind="llama")


def _as_source(src: ModelConfig) -> ModelConfig:
    """The model fields a run from checkpoint `src` takes: its shapes, and its MLP `silu(gate) * up`
    (a cola/lax factorisation reproduces the dense SwiGLU only with `only_lr_act=False`)."""
    return dataclasses.replace(src, only_lr_act=False)


def _check_rank(m: ModelConfig) -> None:
    """The group ranks against the checkpoint's shapes (`validate_model`'s rule, named for the checkpoint)."""
    if not m.low_rank or not all(isinstance(getattr(m, f), int) for f in ("rank", "rank_attn", "rank_kv", "rank_mlp")):
        return  # a rank of the wrong type: validate names it
    for g in PROJECTION_GROUPS:
        (i, o), r = m.group_shape(g), m.group_rank(g)
        name = f"rank_{g}" if getattr(m, f"rank_{g}") else "rank"
        if m.group_low_rank(g) and r > min(i, o):
            raise ConfigError(f"model.{name}: r={r} exceeds min(in, out)={min(i, o)} of the checkpoint's {g} "
                              f"projections [{i}, {o}]; fix: pass {flag_of(name)} <= {min(i, o)}")


def resolve_config(cfg: Config, explicit: Iterable[str] | None = None) -> Config:
    """`cfg` with the model shapes of `cfg.train.init_from_hf` (unchanged when it is empty).

    A shape field set to something else than the checkpoint's is refused: with `explicit` (the CLI's
    given flags) a field named there; without it (the Python API) a field that differs from the
    `ModelConfig` default. `kind`, `rank` and the attention kernel are the caller's."""
    if not (isinstance(cfg.model, ModelConfig) and isinstance(cfg.train, TrainConfig)):
        return cfg  # validate names what is wrong
    path = cfg.train.init_from_hf
    if not isinstance(path, str) or not path:
        return cfg
    src = _as_source(_source_or_stored(path, cfg.train.out))
    given = set(explicit) if explicit is not None else None
    default = ModelConfig()
    for f in dataclasses.fields(ModelConfig):
        if f.name in CHOSEN:
            continue
        mine, theirs = getattr(cfg.model, f.name), getattr(src, f.name)
        said = f.name in given if given is not None else mine != getattr(default, f.name)
        if said and mine != theirs:
            raise ConfigError(f"model.{f.name}: {mine!r} contradicts the checkpoint {path} ({f.name}={theirs!r}); "
                              f"fix: drop {flag_of(f.name)} (with --init-from-hf the shapes are the "
                              "checkpoint's)")
    m = dataclasses.replace(src, **{k: getattr(cfg.model, k) for k in CHOSEN})
    if given is None or "rank" in given:  # the CLI without --rank: `chosen_ranks` fills the ranks in and checks
        _check_rank(m)
    b = cfg.train.rank_budget
    ranks_unset = all(getattr(m, f) == getattr(default, f) for f in RANK_FIELDS)
    if given is None and m.low_rank and b and ranks_unset and isinstance(b, (int, float)) and 0 < b < 1:
        if cfg.train.rank_policy != "uniform":  # measured: the CLI's config_from_flags, or ranks.allocate
            raise ConfigError(f"train.rank_policy: {cfg.train.rank_policy} measures the checkpoint on --data, which "
                              "resolve_config does not; fix: pass the ranks (boostjax.interop.ranks.allocate, or "
                              "pretrained.budget_ranks), or use boostjax train")
        m = dataclasses.replace(m, **ranks.rank_fields(m, ranks.ranks_for_budget(m, b)))
    return cfg if m == cfg.model else dataclasses.replace(cfg, model=m)  # the same object: still validated


RANK_FIELDS: tuple[str, ...] = ("rank", "rank_attn", "rank_kv", "rank_mlp")


def config_from_flags(given: Mapping[str, Any], preset_given: bool) -> Config:
    """The CLI's config of `train --init-from-hf`: the checkpoint's shapes, `--model` (default: the dense
    llama), its ranks (`chosen_ranks`), and the training flags."""
    if preset_given:
        raise _err("--preset sets the model shapes, and with --init-from-hf they are the checkpoint's; "
                   "fix: drop --preset")
    names = lambda cls: {f.name for f in dataclasses.fields(cls)}  # noqa: E731
    model_given = {k: v for k, v in given.items() if k in names(ModelConfig)}
    model = ModelConfig(**{"kind": "llama", **model_given})
    train = TrainConfig(**{k: v for k, v in given.items() if k in names(TrainConfig)})
    return chosen_ranks(resolve_config(Config(model, train), explicit=model_given), model_given)


def chosen_ranks(cfg: Config, given: Iterable[str]) -> Config:
    """A low-rank model's ranks from what the command line gives (`given`: the model flags given), never the
    preset's: `--rank-budget F` (`--rank-policy`; not with a rank flag); else `--rank` for every group without
    its own `--rank-<group>`; else each group without a rank stays dense (`auto_dense`). No rank at all:
    ConfigError."""
    m, t = cfg.model, cfg.train
    if not (isinstance(m, ModelConfig) and isinstance(t, TrainConfig)) or not m.low_rank:
        return cfg
    said = [f for f in RANK_FIELDS if f in set(given)]
    if t.rank_budget:
        if said:
            raise ConfigError(f"train.rank_budget: {flag_of('rank_budget')} and {flag_of(said[0])} both set the "
                              f"ranks; fix: pass one of them")
        fraction = ranks.check_fraction(t.rank_budget)
        if t.rank_policy == "sensitivity":
            chosen = budget_ranks(cfg, fraction)
        else:
            chosen = ranks.ranks_for_budget(m, fraction)
        m = dataclasses.replace(m, **ranks.rank_fields(m, chosen))
        _check_rank(m)
        return dataclasses.replace(cfg, model=m)
    if not said:
        raise ConfigError(f"model.rank: --model {m.kind} from a checkpoint needs its ranks (a preset's rank means "
                          f"nothing for {t.init_from_hf}); fix: pass {flag_of('rank')} R, "
                          f"{flag_of('rank_attn')}/{flag_of('rank_kv')}/{flag_of('rank_mlp')} R (a group left out "
                          f"stays dense), or {flag_of('rank_budget')} F")
    if "rank" in said:
        return cfg
    fields: dict[str, int] = {}
    for g in PROJECTION_GROUPS:
        if f"rank_{g}" in said:
            continue
        if not m.auto_dense:
            raise ConfigError(f"model.rank_{g}: not given, and with --no-auto-dense a group without a rank cannot "
                              f"stay dense; fix: pass {flag_of(f'rank_{g}')} R or {flag_of('rank')} R")
        fields[f"rank_{g}"] = min(m.group_shape(g))  # auto_dense keeps a full-rank group dense
    low = [getattr(m, f"rank_{g}") for g in PROJECTION_GROUPS if f"rank_{g}" in said]
    m = dataclasses.replace(m, rank=max(low), **fields)
    _check_rank(m)
    return dataclasses.replace(cfg, model=m)


# (checkpoint, data, calibration tokens, seq) -> {(layer, input): Gram}; (checkpoint,) -> dense params:
# what `--rank-policy sensitivity` measured at configuration, for the factoring of the same process
_MEASURED: dict[tuple, Any] = {}


def _dense_params(path: str) -> Any:
    if (path,) not in _MEASURED:
        try:
            _MEASURED[path,] = phase(f"reading the weights of {path}", lambda _: hf.read_hf(pathlib.Path(path)))[1]
        except ValueError as e:
            raise _err(" ".join(str(e).split())) from None
    return _MEASURED[path,]


def _grams(dense_cfg: ModelConfig, dense: Any, t: TrainConfig, train_tokens: np.ndarray) -> tuple[dict, int]:
    """The mean input Grams of every projection on the first `calib_tokens` training tokens (once per process)."""
    n = calib_tokens(t, len(train_tokens))
    key = (t.init_from_hf, t.data, n, t.seq)
    if key not in _MEASURED or not t.init_from_hf:
        _MEASURED[key] = phase(f"calibrating: the dense model's projection inputs on {n} training tokens",
                               lambda pr: calibration.input_grams(dense_cfg, dense, train_tokens[:n], t.seq,
                                                                  pr.update),
                               total=calibration.row_batches(n, t.seq), unit="batch")
    return _MEASURED[key], n


def truncation_losses(m: ModelConfig, dense: Mapping[str, Any], grams: Mapping[tuple[int, str], Any]
                      ) -> dict[str, list[np.ndarray]]:
    """{group: [the `ranks.truncation_loss` of each matrix of the group, all layers]}: each matrix's relative
    output error against its rank, from the whitened spectrum of `Sᵀ W` (`factor_whitened`)."""
    out: dict[str, list[np.ndarray]] = {g: [] for g in PROJECTION_GROUPS}
    table = projections(dataclasses.replace(m, kind="llama"))
    layers = dense["layers"]
    for i in range(m.n_layers):
        layer = layers[i] if i in layers else layers[str(i)]
        for short, proj in table.items():
            s_ii = whitening(grams[i, calibration.INPUT_OF[short]])
            sig = np.linalg.svd(s_ii.T @ np.asarray(layer[proj.blk][proj.dense], np.float64), compute_uv=False)
            out[proj.group].append(ranks.truncation_loss(sig))
    return out


def budget_ranks(cfg: Config, fraction: float, dense: Any = None, train_tokens: np.ndarray | None = None
                 ) -> dict[str, int | None]:
    """`--rank-policy sensitivity`: the per-group ranks `ranks.allocate` chooses for `fraction` from the
    checkpoint's whitened truncation losses on the calibration tokens of `--data` (a run folder in `--out`
    that started from the same checkpoint and budget: its ranks, not measured again). `dense` and
    `train_tokens`: the dense params and training stream when the caller has them."""
    m, t = cfg.model, cfg.train
    try:
        stored = RunFolder(t.out).stored_config() if isinstance(t.out, str) and t.out.strip() else None
    except (OSError, ValueError):
        stored = None
    if stored is not None and (stored.train.init_from_hf, stored.train.rank_budget, stored.train.rank_policy) == (
            t.init_from_hf, t.rank_budget, t.rank_policy):
        sm = stored.model
        return {g: (sm.group_rank(g) if sm.group_low_rank(g) else None) for g in PROJECTION_GROUPS}
    if dense is None:
        dense = _dense_params(t.init_from_hf)
    if train_tokens is None:
        try:
            train_tokens = open_source(resolve_source(t.data, t.data_dtype)).train
        except ValueError as e:
            raise ConfigError(" ".join(str(e).split())) from None
    dense_cfg = dataclasses.replace(m, kind="llama")
    grams, _ = _grams(dense_cfg, dense, t, train_tokens)
    losses = phase("measuring each matrix's whitened truncation loss",
                   lambda _: truncation_losses(m, dense, grams))
    _MEASURED["losses", t.init_from_hf, t.data, t.rank_budget] = losses
    return ranks.allocate(m, losses, fraction)


# ------------------------------------------------------------------------------------ factoring


_SVD: dict[str, Any] = {}


def svd(w_io: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Thin SVD `U, σ, Vᵀ` of one matrix in fp32, on the default device (one compile per shape)."""

    if "fn" not in _SVD:
        _SVD["fn"] = jax.jit(lambda w: jax.numpy.linalg.svd(w, full_matrices=False))
    u, s, vt = jax.device_get(_SVD["fn"](jax.numpy.asarray(w_io, jax.numpy.float32)))
    return np.asarray(u), np.asarray(s), np.asarray(vt)


def _split(a_ik: np.ndarray, b_ko: np.ndarray, kind: str, r: int, rng: np.random.Generator
           ) -> tuple[np.ndarray, np.ndarray]:
    """The stored factors of the rank-k map `A_k B_k`: as they are for svd (k = r); for cola/lax (k = r // 2)
    the ± pairs `[A_k, -A_k]`, `[B_k; -B_k]` (silu(z) - silu(-z) = z), an odd r's free column a random
    A column and a zero B row (no effect at init)."""
    if kind == "svd":
        return a_ik.astype(np.float32), b_ko.astype(np.float32)
    a, b = np.concatenate([a_ik, -a_ik], axis=1), np.concatenate([b_ko, -b_ko], axis=0)
    if r % 2:  # one free column: a random A column and a zero B row change nothing at init
        col = rng.normal(size=(a.shape[0], 1)) * a.shape[0] ** -0.5
        a = np.concatenate([a, col], axis=1)
        b = np.concatenate([b, np.zeros((1, b.shape[1]))], axis=0)
    return a.astype(np.float32), b.astype(np.float32)


def _factor(w_io: Any, kind: str, r: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, float]:
    """(A [in, r], B [r, out], relative error of the map at init) of one matrix: truncated SVD."""
    u, s, vt = svd(w_io)
    k = r if kind == "svd" else r // 2
    root = np.sqrt(s[:k])
    a, b = _split(u[:, :k] * root, root[:, None] * vt[:k], kind, r, rng)
    s64 = s.astype(np.float64)
    total = float(np.sum(s64**2))
    err = float(np.sqrt(np.sum(s64[k:] ** 2) / total)) if total > 0 else 0.0
    return a, b, err


RIDGE, whitening = calibration.RIDGE, calibration.whitening  # (the whitening lives beside the Grams)


def factor_whitened(w_io: Any, gram_ii: Any, kind: str, r: int, rng: np.random.Generator
                    ) -> tuple[np.ndarray, np.ndarray, float]:
    """(A [in, r], B [r, out], relative weight error `‖W − A_k B_k‖_F / ‖W‖_F`) of one matrix, truncated
    where its OUTPUT error on inputs with Gram matrix `gram_ii` (XᵀX, any scale) is least (SVD-LLM's
    truncation-aware whitening, https://arxiv.org/abs/2403.07378): G = S Sᵀ (`whitening`), Sᵀ W = U Σ Vᵀ,
    `A_k B_k = S⁻ᵀ U_k Σ_k V_kᵀ`, the best rank-k approximation of x W in the norm `‖X ·‖_F`. Each column
    pair is scaled so `‖A_j‖ = ‖B_j‖` (the map unchanged; as the plain SVD's balanced split, which it
    equals when G ∝ I). svd takes k = r, cola/lax the ± pairs of k = r // 2 (`_split`). In float64."""
    w = np.asarray(w_io, np.float64)
    s_ii = whitening(gram_ii)
    u, sig, vt = np.linalg.svd(s_ii.T @ w, full_matrices=False)
    k = r if kind == "svd" else r // 2
    a = np.linalg.solve(s_ii.T, u[:, :k])  # S⁻ᵀ U_k
    b = sig[:k, None] * vt[:k]
    a_norm, b_norm = np.linalg.norm(a, axis=0), np.linalg.norm(b, axis=1)
    c = np.sqrt(np.divide(b_norm, a_norm, out=np.ones_like(b_norm), where=(a_norm > 0) & (b_norm > 0)))
    a, b = a * c, b / c[:, None]
    total = float(np.linalg.norm(w))
    err = float(np.linalg.norm(w - a @ b) / total) if total > 0 else 0.0
    a32, b32 = _split(a, b, kind, r, rng)
    return a32, b32, err


# (matrix name "layers.i.attn.q", W [in, out], kind, rank, rng) -> (A [in, r], B [r, out], weight error)
Factor = Callable[[str, Any, str, int, np.random.Generator], tuple[np.ndarray, np.ndarray, float]]


def plain_factor(name: str, w_io: Any, kind: str, r: int, rng: np.random.Generator
                 ) -> tuple[np.ndarray, np.ndarray, float]:
    """The `Factor` of `--init-factor svd`: each matrix's truncated SVD (`_factor`)."""
    return _factor(w_io, kind, r, rng)


def whitened_factor(grams: Mapping[tuple[int, str], Any]) -> Factor:
    """The `Factor` of `--init-factor whitened`: `factor_whitened` with the Gram matrix of the matrix's
    input, `grams[(layer, input)]` (`boostjax.interop.calibration.input_grams`)."""
    def factor(name: str, w_io: Any, kind: str, r: int, rng: np.random.Generator):
        _, i, _, short = name.split(".")
        return factor_whitened(w_io, grams[int(i), calibration.INPUT_OF[short]], kind, r, rng)
    return factor


def _summary(errs: Mapping[str, float]) -> dict[str, Any]:
    by: dict[str, list[float]] = {}
    for name, e in errs.items():
        by.setdefault(name.rsplit(".", 1)[-1], []).append(e)
    vals = list(errs.values())
    return {"mean": float(np.mean(vals)) if vals else 0.0, "max": float(np.max(vals)) if vals else 0.0,
            "by_projection": {p: float(np.mean(v)) for p, v in by.items()}}


def rank_report(m: ModelConfig) -> dict[str, Any]:
    """What a low-rank model factorises: `{"ranks": {group: r or "dense"}, "dense": [projections kept
    dense]}` (a group whose rank-r factors would not be smaller than its dense matrix stays dense)."""
    return {"ranks": m.group_ranks,
            "dense": [p for p, proj in projections(m).items() if proj.a is None]}


def lowrank_from_dense(cfg: ModelConfig, dense_params: Mapping[str, Any], seed: int = 0,
                       factor: Factor = plain_factor) -> tuple[dict, dict]:
    """Low-rank params of `cfg` (kind svd/cola/lax) factored from the pure params dict of the dense
    LLaMA of the same shapes, and the report: `{"kind", "rank", "ranks", "dense", "matrices":
    {"layers.i.attn.q": rel. error, ...}, "mean", "max", "by_projection"}` (see the module docstring
    for the split; projections of a group kept dense are copied, and listed under "dense"). `factor`
    factors one matrix: `plain_factor` (truncated SVD), `whitened_factor(grams)`, or a `refit.LayerFit`
    (its `start_layer(i, factored_layers)` is called before layer i, `finish()` after the last)."""
    if not isinstance(cfg, ModelConfig) or not cfg.low_rank:
        raise ConfigError(f"lowrank_from_dense: need a ModelConfig of kind svd, cola or lax, got "
                          f"{getattr(cfg, 'kind', type(cfg).__name__)!r}; fix: pass ModelConfig(kind='svd', rank=r, ...)")
    _check_rank(cfg)
    dense_cfg = dataclasses.replace(cfg, kind="llama")
    check_params(dense_cfg, dense_params, "lowrank_from_dense: dense_params")
    like, table = param_shapes(cfg), projections(cfg)
    rng = np.random.default_rng(seed)  # an odd cola rank's free column
    errs: dict[str, float] = {}
    out: dict[str, Any] = {k: dense_params[k] for k in like if "." not in k}
    out["layers"] = {}
    layers = dense_params["layers"]
    start_layer = getattr(factor, "start_layer", None)  # a factor fitted layer by layer (`refit.LayerFit`)
    for i in range(cfg.n_layers):
        if start_layer is not None:
            start_layer(i, out["layers"])
        dense = layers[i] if i in layers else layers[str(i)]
        fitted: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for short, proj in table.items():
            if proj.a is None:  # a group whose factors would not be smaller: kept dense (copied)
                continue
            matrix = f"layers.{i}.{proj.blk}.{short}"
            a, b, errs[matrix] = factor(matrix, dense[proj.blk][proj.dense], cfg.kind,
                                        cfg.group_rank(proj.group), rng)
            fitted[short] = (a, b)
        layer = refit.layer_params(cfg, dense, fitted)
        out["layers"][i] = layer
    if start_layer is not None:
        factor.finish()
    check_params(cfg, out, "lowrank_from_dense")  # the grouped layout is the model's
    out = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), out)
    return out, {"kind": cfg.kind, "rank": cfg.rank, **rank_report(cfg), "matrices": errs, **_summary(errs)}


def _leaves(tree: Any) -> dict[str, tuple[int, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(str(getattr(k, "key", k)) for k in path): tuple(np.shape(v)) for path, v in flat}


def check_params(m: ModelConfig, params: Any, what: str) -> None:
    """ConfigError unless `params` is a pure params dict with the names and shapes of the model `m`."""

    if not isinstance(params, Mapping):
        raise ConfigError(f"{what}: need a pure params dict (nnx.to_pure_dict), got {type(params).__name__}; "
                          "fix: pass nnx.to_pure_dict(nnx.state(model, nnx.Param))")
    need, have = param_shapes(m), _leaves(params)
    missing, extra = sorted(set(need) - set(have)), sorted(set(have) - set(need))
    if missing or extra:
        raise ConfigError(f"{what}: the params do not fit a {m.kind} model (missing {missing[:3]}, unexpected "
                          f"{extra[:3]}); fix: pass the params of a model with this ModelConfig")
    bad = [(k, have[k], need[k]) for k in need if have[k] != need[k]]
    if bad:
        k, h, n = bad[0]
        raise ConfigError(f"{what}: {k} has shape {h}, the model needs {n}; fix: pass the params of a model "
                          "with this ModelConfig")


# ------------------------------------------------------------------------------------ training


def initial_params(cfg: Config, init: Any = None, corpus: Corpus | None = None) -> tuple[dict, dict]:
    """The params a fresh run starts from, and the report to write beside it: the checkpoint of
    `cfg.train.init_from_hf` (dense, or factored for a low-rank kind), or `init` (a pure params dict
    or an `LLaMA` of `cfg.model`, or for a low-rank kind the dense params of the same shapes).
    `corpus`: the run's data; a factored start then reports each matrix's output error on held-out
    tokens (`factored`), and `--init-factor whitened` needs it (its calibration tokens)."""
    m = cfg.model
    if cfg.train.init_from_hf:
        path = pathlib.Path(cfg.train.init_from_hf)
        fmt = "gguf" if gguf_in.is_gguf(path) else "huggingface"
        what = f"reading and dequantizing the weights of {path}" if fmt == "gguf" else f"reading the weights of {path}"
        try:
            cached = _MEASURED.pop((str(cfg.train.init_from_hf),), None)  # read by --rank-policy sensitivity
            src_cfg, dense = (None, cached) if cached is not None else phase(what, lambda _: hf.read_hf(path))
        except ValueError as e:
            raise _err(" ".join(str(e).split())) from None
        src_cfg = src_cfg if src_cfg is not None else _source_or_stored(str(path), cfg.train.out)
        source: dict[str, Any] = {"source": str(path.resolve()), "format": fmt}
        if dataclasses.replace(_as_source(src_cfg), **{k: getattr(m, k) for k in CHOSEN}) != m:
            raise _err(f"the weights of {path} have other shapes than its config.json says; fix: re-export "
                       "the checkpoint")
    else:
        dense = _as_pure_dict(init)
        source = {"source": "python", "format": "params"}
    if not m.low_rank or _fits(m, dense):
        check_params(m, dense, "train.init")
        return dense, {**source, "kind": m.kind, **({"rank": m.rank, **rank_report(m)} if m.low_rank else {})}
    if not _fits(dataclasses.replace(m, kind="llama"), dense):
        raise ConfigError(f"train.init: the params fit neither this {m.kind} model nor the dense llama of its "
                          "shapes; fix: pass the params of a model with this ModelConfig (or its kind='llama' twin)")
    params, report = factored(cfg, dense, corpus)
    return params, {**source, **report}


HELDOUT_TOKENS = 4096  # the output errors' tokens: the start of the validation split


def calib_tokens(t: TrainConfig, train_tokens: int) -> int:
    """The calibration tokens a calibrated `--init-factor` reads: `--calib-tokens`, or for 0 the default
    (`DEFAULT_CALIB_TOKENS`, at most the training split)."""
    return t.calib_tokens or min(DEFAULT_CALIB_TOKENS, train_tokens)


def check_calibration(cfg: Config, data: Source) -> None:
    """`--calib-tokens` within `--data`'s training split (ConfigError otherwise; reads the split's size:
    memory-mapped token files, text read as bytes)."""
    t = cfg.train
    if (t.init_factor not in CALIBRATED_FACTORS and not (t.rank_budget and t.rank_policy == "sensitivity")
            or not t.calib_tokens):
        return
    n = len(open_source(data).train)
    if t.calib_tokens > n:
        raise ConfigError(f"train.calib_tokens: {t.calib_tokens} calibration tokens exceed the {n} tokens of the "
                          f"training split of {data.name}; fix: pass {flag_of('calib_tokens')} {n} or fewer "
                          f"(0 = {DEFAULT_CALIB_TOKENS} or the whole split)")


def factored(cfg: Config, dense: Mapping[str, Any], corpus: Corpus | None) -> tuple[dict, dict]:
    """`lowrank_from_dense` of `cfg.model` by `cfg.train.init_factor`, the report with, given `corpus`,
    `"output"`: each factored matrix's output error `‖X W − f(X)‖_F / ‖X W‖_F` on the first
    `HELDOUT_TOKENS` tokens of the validation split (`calibration.output_errors`); whitened fits the
    first `calib_tokens` tokens of the training split (rows of `cfg.train.seq`)."""
    m, t = cfg.model, cfg.train
    dense_cfg = dataclasses.replace(m, kind="llama")
    base: Any = plain_factor
    extra: dict[str, Any] = {"init_factor": t.init_factor}
    if t.rank_budget:
        key = ("losses", t.init_from_hf, t.data, t.rank_budget)
        chosen = {g: (m.group_rank(g) if m.group_low_rank(g) else None) for g in PROJECTION_GROUPS}
        extra["budget"] = ranks.budget_report(m, chosen, t.rank_budget, t.rank_policy, _MEASURED.pop(key, None))
    if t.init_factor in CALIBRATED_FACTORS:
        if corpus is None:
            raise ConfigError(f"train.init_factor: {t.init_factor} needs the run's data for its calibration tokens; "
                              "fix: pass the corpus (train() does), or init_factor='svd'")
        n = calib_tokens(t, len(corpus.train))
        extra["calibration"] = {"tokens": n, "seq": t.seq, "slice": f"training split, tokens [0, {n})"}
        if t.init_factor == "whitened":
            base = whitened_factor(_grams(dense_cfg, dense, t, corpus.train)[0])
        else:
            base = refit.LayerFit(m, dense, corpus.train[:n], t.seq, t.init_factor)
            extra["calibration"]["eps_max"] = refit.EPS_MAX
    factors: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def factoring(progress: Progress) -> tuple[dict, dict]:
        def factor(name: str, w_io: Any, kind: str, r: int, rng: np.random.Generator):
            a, b, err = base(name, w_io, kind, r, rng)
            factors[name] = (a, b)
            progress.update()
            return a, b, err

        if hasattr(base, "start_layer"):  # fitted layer by layer
            factor.start_layer, factor.finish = base.start_layer, base.finish  # type: ignore[attr-defined]
        return lowrank_from_dense(m, dense, seed=t.seed, factor=factor)

    count = m.n_layers * sum(proj.a is not None for proj in projections(m).values())
    params, report = phase(f"factoring {count} matrices ({t.init_factor}, {m.kind} rank {m.rank})", factoring,
                           total=count, unit="matrix")
    if corpus is not None:
        held = corpus.val[:HELDOUT_TOKENS]
        errs = phase(f"measuring the factored projections' output error on {len(held)} held-out tokens",
                     lambda pr: calibration.output_errors(dense_cfg, m.kind, dense, held, t.seq, factors, pr.update),
                     total=calibration.row_batches(len(held), t.seq), unit="batch")
        extra["output"] = {"tokens": len(held), "seq": t.seq, "slice": f"validation split, tokens [0, {len(held)})",
                           "matrices": errs, **_summary(errs)}
    return params, {**report, **extra}


def _fits(m: ModelConfig, params: Any) -> bool:
    try:
        check_params(m, params, "params")
    except ConfigError:
        return False
    return True


def _as_pure_dict(init: Any) -> Any:
    """`init` as a pure params dict: an `LLaMA`'s or an `nnx.State`'s parameters, else `init` itself."""
    if isinstance(init, LLaMA):
        return nnx.to_pure_dict(nnx.state(init, nnx.Param))
    if isinstance(init, nnx.State):
        return nnx.to_pure_dict(init)
    return init


def fresh_report(m: ModelConfig) -> dict[str, Any]:
    """The report of a random start of a low-rank model: its group ranks and the projections kept dense."""
    return {"source": "random init", "format": "init", "kind": m.kind, "rank": m.rank, **rank_report(m)}


def summary_line(report: Mapping[str, Any]) -> str:
    """One line: where the weights came from, the group ranks and the projections kept dense, and for a
    factored start the reconstruction errors."""
    head = f"initialised {report['kind']} from {report['source']}"
    if "ranks" in report:
        ranks = ", ".join(f"{g} {r}" for g, r in report["ranks"].items())
        dense = ", ".join(report["dense"])
        head += f" (ranks: {ranks}" + (f"; kept dense, their factors would not be smaller: {dense})" if dense else ")")
    if "budget" in report:
        b = report["budget"]
        went = ", ".join(f"{g} {v['share_of_used']:.0%}" for g, v in b["groups"].items())
        head += (f"; budget {b['fraction']:.0%} ({b['policy']}): {b['used_fraction']:.1%} of the dense projection "
                 f"parameters, of which {went}")
    if "matrices" not in report:
        return head
    by = " ".join(f"{p} {e:.3f}" for p, e in report["by_projection"].items())
    how = f", {report['init_factor']} factoring" if "init_factor" in report else ""
    line = (f"{head}{how}: relative reconstruction error over {len(report['matrices'])} "
            f"matrices mean {report['mean']:.4f} max {report['max']:.4f}; per projection {by}")
    if "output" not in report:
        return line
    out = report["output"]
    by = " ".join(f"{p} {e:.3f}" for p, e in out["by_projection"].items())
    return (f"{line}; output error on {out['tokens']} held-out tokens mean {out['mean']:.4f} max {out['max']:.4f}; "
            f"per projection {by}")


def write_report(folder: pathlib.Path, report: Mapping[str, Any]) -> pathlib.Path:
    path = folder / REPORT_FILE
    tmp = folder / (REPORT_FILE + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


# ------------------------------------------------------------------------------------ tokenizer


# what a run folder started from a Hugging Face folder keeps beside its tokenizer.json (the chat template too)
TOKENIZER_SIDE_FILES: tuple[str, ...] = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _gguf_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer of a `.gguf` file, None when transformers cannot build one from it."""
    try:
        return gguf_tokenizer(path)
    except ConfigError:
        return None


def has_tokenizer(folder: str) -> bool:
    """Whether checkpoint `folder` has its own tokenizer: a `tokenizer.json` in the folder, or a `.gguf`
    file whose tokenizer transformers can build (once per file and process)."""
    if not folder:
        return False
    if gguf_in.is_gguf(folder):
        return _gguf_tokenizer(folder) is not None
    return (pathlib.Path(folder) / TOKENIZER_FILE).is_file()


def checkpoint_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of checkpoint `path`: its `tokenizer.json`, a `.gguf` file's own (ConfigError
    naming `train.init_from_hf` when transformers cannot build it), byte level for a folder without one."""
    if gguf_in.is_gguf(path):
        try:
            return gguf_tokenizer(path)
        except ConfigError as e:
            raise _err(f"{str(e).removeprefix('tokenizer: ').split('; fix:')[0]}, so no token ids can be checked "
                       "against it; fix: use the model's Hugging Face folder with its tokenizer.json instead") from None
    try:
        return load_tokenizer(path)
    except ConfigError as e:
        raise _err(f"cannot load the tokenizer of {path} ({str(e).removeprefix('tokenizer: ').split('; fix:')[0]}); "
                   "fix: restore the checkpoint's tokenizer.json") from None


def source_tokenizer(cfg: Config, data: Source) -> pathlib.Path | None:
    """Where the run folder's tokenizer comes from (`copy_tokenizer`): the checkpoint folder's
    `tokenizer.json`, or the `.gguf` file itself, when the data holds token ids (a `.bin` file, or a
    tokenised folder, whose tokenizer must then be the same: `check_source_tokenizer`). None when the
    checkpoint has none or the data is read as bytes (the built-in corpus, text files): the run is then
    byte level. `data`: the run's `cfg.train.data`, resolved (`boostjax.data.source.resolve_source`)."""
    path = cfg.train.init_from_hf
    if not has_tokenizer(path) or data.kind not in ("bin", "tokens"):
        return None
    return pathlib.Path(path) if gguf_in.is_gguf(path) else pathlib.Path(path) / TOKENIZER_FILE


def check_source_tokenizer(cfg: Config, data: Source) -> None:
    """A tokenised folder given with a checkpoint must have been written with the checkpoint's own
    tokenizer (`checkpoint_tokenizer`: a folder's tokenizer.json, a `.gguf`'s, byte level for a folder
    without one), compared by content (`same_tokenizer`); ConfigError otherwise, naming both: the ids
    would mean other text. A `.bin` file's ids cannot be checked; text is encoded by the run itself."""
    path = cfg.train.init_from_hf
    if not path or data.kind != "tokens":
        return
    mine = checkpoint_tokenizer(path)
    if same_tokenizer(data.tokenizer, mine):
        return
    theirs = "byte level" if isinstance(mine, ByteTokenizer) else tokenizer_kind(mine)
    if isinstance(mine, ByteTokenizer):
        theirs += f": {path} holds no {TOKENIZER_FILE}"
    raise _err(f"{data.path} was tokenised with {tokenizer_kind(data.tokenizer)}, not the checkpoint's own tokenizer "
               f"({theirs}), so its token ids would mean other text; fix: tokenise the text with it (boostjax "
               f"tokenize --tokenizer {path} ...)" + (f", or save the model's tokenizer.json into {path}"
                                                     if isinstance(mine, ByteTokenizer) else ""))


def _write(dst: pathlib.Path, data: bytes) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(dst)


def copy_tokenizer(src: pathlib.Path | None, run_dir: pathlib.Path) -> None:
    """The checkpoint's tokenizer into the run folder (each file atomically): a folder's `tokenizer.json`
    with its `TOKENIZER_SIDE_FILES`; a `.gguf`'s, as transformers builds it, with its
    `tokenizer_config.json` and chat template (`gguf_side_files`). `load_tokenizer(run_dir)`, generate
    and export-hf then find them."""
    if src is None:
        return
    if gguf_in.is_gguf(src):
        _write(run_dir / TOKENIZER_FILE, gguf_tokenizer(src).tok.to_str().encode("utf-8"))
        for name, text in gguf_side_files(src).items():
            _write(run_dir / name, text.encode("utf-8"))
        return
    _write(run_dir / TOKENIZER_FILE, src.read_bytes())
    for name in TOKENIZER_SIDE_FILES:
        if (src.parent / name).is_file():
            _write(run_dir / name, (src.parent / name).read_bytes())
