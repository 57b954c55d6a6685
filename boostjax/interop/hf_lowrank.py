"""Low-rank boostjax models (svd, cola, lax) as Hugging Face folders.

`to_hf_lowrank` writes the factors as they are: `config.json` of model_type `boostjax_lowrank_llama`
(a `LlamaConfig` plus `lowrank_kind`, `lowrank_ranks`, `lowrank_mlp_silu`) whose `auto_map` names the
two Python files written beside it (`hf_remote/`): transformers' `LlamaForCausalLM` with each factored
projection replaced by `b(σ(a(x)))`, loaded with `trust_remote_code=True`. A factored projection `p`
is stored as `p.a.weight [r, in]` and `p.b.weight [out, r]` (boostjax's `A [in, r]`, `B [r, out]`
transposed, as torch stores linears); a group kept dense as `p.weight`; LaX's gates as
`self_attn.cross [3]` and `mlp.cross [2]`.

`densify`: an svd model as the dense LLaMA of the same function (`W = A B` per projection, exported by
`to_hf` with no remote code). cola and lax are refused: the SiLU between A and B makes each projection
a nonlinear function of its input, which no matrix equals.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import pathlib
from typing import Any, Mapping

import jax
import numpy as np

from boostjax.config import ConfigError, ModelConfig
from boostjax.interop import hf
from boostjax.interop.hf_config import REMOTE_CODE_FILES, hf_config
from boostjax.models.llama import projections

__all__ = ["densify", "lowrank_config", "lowrank_tensors", "to_hf_lowrank"]

MODEL_TYPE = "boostjax_lowrank_llama"
AUTO_MAP = {"AutoConfig": "configuration_boostjax_lowrank.BoostjaxLowRankLlamaConfig",
            "AutoModelForCausalLM": "modeling_boostjax_lowrank.BoostjaxLowRankLlamaForCausalLM"}
# our projection -> its module inside `model.layers.{i}.` of transformers' LLaMA
HF_PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
CROSS = {"attn": "self_attn.cross", "mlp": "mlp.cross"}
DENSIFY_REFUSED = ("the SiLU between A and B has no dense equivalent (silu(x A) B is not x W for any matrix W); "
                   "fix: export without --densify (the factors, loaded with trust_remote_code=True)")


def check_lowrank_exportable(cfg: ModelConfig, densified: bool = False) -> None:
    """ConfigError (one line) unless `cfg` is a low-rank kind this export writes (densified: svd only)."""
    if not cfg.low_rank:
        raise ConfigError(f"to_hf_lowrank: model kind {cfg.kind!r} is not low-rank; fix: export it with to_hf")
    if densified and cfg.kind != "svd":
        raise ConfigError(f"export.densify: a {cfg.kind} model (low-rank kind {cfg.kind!r}) cannot be "
                          f"densified: {DENSIFY_REFUSED}")


def _matrices(cfg: ModelConfig, layer: Mapping[str, Any]) -> dict[str, tuple[np.ndarray, ...]]:
    """Projection -> `(A [in, r], B [r, out])` when factored, `(W [in, out],)` when dense, fp32 numpy."""
    def get(blk: str, name: str) -> np.ndarray:
        value = layer.get(blk, {}).get(name)
        if value is None:
            raise ValueError(f"to_hf_lowrank: params have no {blk}.{name}; fix: pass the full pure dict of the "
                             f"{cfg.kind} model with its ModelConfig")
        return _np(value)

    out: dict[str, tuple[np.ndarray, ...]] = {}
    for p, proj in projections(cfg).items():
        if proj.a is None:
            out[p] = (get(proj.blk, proj.dense),)
            continue
        (a_name, a_i), (b_name, b_i) = proj.a, proj.b
        a, b = get(proj.blk, a_name), get(proj.blk, b_name)
        out[p] = (a if a_i is None else a[:, a_i], b if b_i is None else b[b_i])
    return out


def _np(value: Any) -> np.ndarray:
    return np.asarray(jax.device_get(value), dtype=np.float32)


def lowrank_tensors(cfg: ModelConfig, params: Mapping[str, Any], dtype: str = "float32") -> dict[str, np.ndarray]:
    """Pure params of a low-rank model -> {Hugging Face name: contiguous numpy array in `dtype`}."""
    check_lowrank_exportable(cfg)
    if dtype not in hf.EXPORT_DTYPES:
        raise ValueError(f"to_hf_lowrank: dtype={dtype!r} is not supported; fix: use one of {', '.join(hf.EXPORT_DTYPES)}")
    out = {name: _np(params[ours]).T if tr else _np(params[ours]) for ours, name, tr in hf.TOP_KEYS
           if ours in params and not (ours == "head" and cfg.tie_embeddings)}
    for i in range(cfg.n_layers):
        layer = hf._layer(params.get("layers", {}), i)
        out.update({f"model.layers.{i}.{name}": _np(layer[blk]["norm"])
                    for (blk, key), name, _ in hf.LAYER_KEYS if key == "norm"})
        for p, mats in _matrices(cfg, layer).items():
            base = f"model.layers.{i}.{HF_PROJ[p]}"
            if len(mats) == 1:
                out[f"{base}.weight"] = mats[0].T
            else:
                out[f"{base}.a.weight"], out[f"{base}.b.weight"] = mats[0].T, mats[1].T
        for blk, name in CROSS.items():
            if "cross" in layer.get(blk, {}):
                out[f"model.layers.{i}.{name}"] = _np(layer[blk]["cross"])
    np_dtype = hf.EXPORT_DTYPES[dtype]
    return {k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in out.items()}


def lowrank_config(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """`config.json` of a low-rank export: the dense LLaMA's, with our model_type, auto_map and factorisation."""
    check_lowrank_exportable(cfg)
    d = hf_config(dataclasses.replace(cfg, kind="llama"), dtype)
    d.update(architectures=["BoostjaxLowRankLlamaForCausalLM"], model_type=MODEL_TYPE, auto_map=dict(AUTO_MAP),
             lowrank_kind=cfg.kind, lowrank_mlp_silu=cfg.gated_silu,
             lowrank_ranks={g: cfg.group_rank(g) if cfg.group_low_rank(g) else 0 for g in ("attn", "kv", "mlp")})
    return d


def densify(cfg: ModelConfig, params: Mapping[str, Any]) -> tuple[ModelConfig, dict[str, Any]]:
    """(dense llama config, pure params) of an svd model: each factored projection's `W = A B`
    (multiplied in float64, rounded once to fp32). Other kinds: ConfigError."""
    check_lowrank_exportable(cfg, densified=True)
    dense: dict[str, Any] = {k: v for k, v in params.items() if k != "layers"}
    dense["layers"] = {}
    for i in range(cfg.n_layers):
        layer = hf._layer(params.get("layers", {}), i)
        new: dict[str, dict[str, Any]] = {"attn": {"norm": layer["attn"]["norm"]}, "mlp": {"norm": layer["mlp"]["norm"]}}
        for p, mats in _matrices(cfg, layer).items():
            w = mats[0] if len(mats) == 1 else (mats[0].astype(np.float64) @ mats[1].astype(np.float64))
            new[projections(cfg)[p].blk][projections(cfg)[p].dense] = w.astype(np.float32)
        dense["layers"][i] = new
    return dataclasses.replace(cfg, kind="llama"), dense


def to_hf_lowrank(model_or_params: Any, path: str | pathlib.Path, cfg: ModelConfig | None = None,
                  dtype: str = "float32", *, max_shard_size: int | str = 0,
                  source: str | pathlib.Path | None = None, densified: bool = False) -> pathlib.Path:
    """Write a low-rank model as a Hugging Face folder and return its path (arguments as `hf.to_hf`).

    The factors with `configuration_boostjax_lowrank.py` / `modeling_boostjax_lowrank.py` (load with
    `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`), or with `densified` (svd
    only) a plain LLaMA of `W = A B`. Everything is checked before anything is written."""
    cfg, params = hf._resolve(model_or_params, cfg)
    check_lowrank_exportable(cfg, densified)
    if densified:
        return hf.to_hf(densify(cfg, params), path, dtype=dtype, max_shard_size=max_shard_size, source=source)
    tensors = lowrank_tensors(cfg, params, dtype)
    files = {name: importlib.resources.files("boostjax.interop.hf_remote").joinpath(name).read_text()
             for name in REMOTE_CODE_FILES}
    out = hf.write_folder(tensors, path, lambda c: lowrank_config(c, dtype), cfg,
                          max_shard_size=max_shard_size, source=source)
    for name, text in files.items():
        (out / name).write_text(text)
    return out
