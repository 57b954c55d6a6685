"""Hugging Face `config.json` / `generation_config.json` / `tokenizer_config.json` <-> `ModelConfig`.

Reads LLaMA-architecture configs of transformers 4 (`rope_theta` + `rope_scaling`) and 5
(`rope_parameters`), `model_type` llama or mistral (the latter without a sliding window), RoPE
scaling default / linear / dynamic / llama3, an explicit `head_dim`, `tie_word_embeddings` and the
bos/eos/pad ids. Writes a `LlamaConfig` both versions read. Anything else is refused (ValueError,
one line with a fix that keeps the logits right).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping

from boostjax import __version__
from boostjax.config import ModelConfig, validate_model
from boostjax.runs.folder import EXPORT_MARK

GENERATION_NAME = "generation_config.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
# the modeling code a low-rank export carries (boostjax/interop/hf_remote/, `auto_map` in its config.json)
REMOTE_CODE_FILES = ("configuration_boostjax_lowrank.py", "modeling_boostjax_lowrank.py")
ROPE_SCALED = ("linear", "dynamic", "llama3")  # rope types boostjax reproduces besides "default"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt_id(v: int) -> int | None:
    return None if v < 0 else v


def eos_value(cfg: ModelConfig) -> int | list[int] | None:
    """`eos_token_id` as Hugging Face writes it: one int, a list of several, or None."""
    ids = list(cfg.eos_ids)
    return None if not ids else ids[0] if len(ids) == 1 else ids


def rope_dicts(cfg: ModelConfig) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(`rope_scaling` for transformers 4, `rope_parameters` for transformers 5) of `cfg`."""
    if cfg.rope_type == "default":
        return None, {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling: dict[str, Any] = {"rope_type": cfg.rope_type, "factor": cfg.rope_factor}
    if cfg.rope_type == "llama3":
        scaling.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                       original_max_position_embeddings=cfg.rope_original_max_len or cfg.max_seq_len)
    return scaling, {**scaling, "rope_theta": cfg.rope_theta}


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` of a dense `cfg` as a Hugging Face `LlamaConfig` dict (transformers 4 and 5)."""
    check_exportable(cfg)
    scaling, params = rope_dicts(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "num_hidden_layers": cfg.n_layers,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4 reads this and rope_scaling ...
        "rope_scaling": scaling,
        "rope_parameters": params,  # ... and 5 this
        "hidden_act": "silu",
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
        "bos_token_id": _opt_id(cfg.bos_token_id),
        "eos_token_id": eos_value(cfg),
        "pad_token_id": _opt_id(cfg.pad_token_id),
        EXPORT_MARK: {"version": __version__},  # lets a later export replace this folder, and nothing else
    }


def check_exportable(cfg: ModelConfig) -> None:
    if cfg.low_rank:
        raise ValueError(
            f"to_hf: model kind {cfg.kind!r} is low-rank; Hugging Face LLaMA layout holds full-rank models "
            f"only; fix: export its factors with boostjax.interop.hf_lowrank.to_hf_lowrank (or boostjax export-hf)")
    if cfg.kind != "llama":
        raise ValueError(f"to_hf: unknown model kind {cfg.kind!r}; fix: export a kind='llama' model")


def _bad(field: str, got: Any, fix: str) -> ValueError:
    return ValueError(f"config_from_hf: {field}={got!r} is not supported; fix: {fix}")


def _rope_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig RoPE fields from `rope_parameters` / `rope_scaling` / `rope_theta` (transformers'
    priority: a `rope_scaling` dict wins over `rope_parameters`; `rope_theta` inside them over the top level)."""
    theta = d.get("rope_theta") if d.get("rope_theta") is not None else 10000.0
    params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    where = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    if any(isinstance(v, Mapping) for v in params.values()):
        raise _bad(where, "per-layer-type", "boostjax applies one RoPE to every layer; use a LLaMA checkpoint")
    theta = params.get("rope_theta", theta)
    if not _is_num(theta):
        raise _bad(f"{where}.rope_theta", theta, "write rope_theta as a number, e.g. 10000.0")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _bad(f"{where}.partial_rotary_factor", params["partial_rotary_factor"],
                   "boostjax rotates the whole head; use a checkpoint with partial_rotary_factor 1.0")
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind not in ROPE_SCALED:
        raise _bad(f"{where}.rope_type", kind, "boostjax reproduces RoPE types default, linear, dynamic and llama3 "
                                               "only; this checkpoint's positions cannot be imported correctly, use "
                                               "it with transformers or pick a checkpoint with one of those types")
    need = ("factor", "low_freq_factor", "high_freq_factor") if kind == "llama3" else ("factor",)
    for key in need:
        if not _is_num(params.get(key)):
            raise _bad(f"{where}.{key}", params.get(key), f"write the {kind} RoPE parameter {key} as a number "
                                                          "(as in the checkpoint's original config.json)")
    out.update(rope_type=kind, rope_factor=float(params["factor"]))
    if kind == "llama3":
        orig = params.get("original_max_position_embeddings", d.get("max_position_embeddings"))
        if not _is_int(orig):
            raise _bad(f"{where}.original_max_position_embeddings", orig,
                       "write the pretraining context length as an integer (8192 for Llama 3.1 / 3.2)")
        out.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                   rope_high_freq_factor=float(params["high_freq_factor"]), rope_original_max_len=orig)
    return out


def _token_ids(d: Mapping[str, Any]) -> dict[str, Any]:
    """bos/eos/pad ids of a config.json (or generation_config.json) dict as ModelConfig fields."""
    out: dict[str, Any] = {}
    for key, field in (("bos_token_id", "bos_token_id"), ("pad_token_id", "pad_token_id")):
        v = d.get(key)
        if v is not None:
            if not _is_int(v):
                raise ValueError(f"config_from_hf: {key} must be an integer or null, got {v!r}; "
                                 "fix: write the token id as in the checkpoint's tokenizer")
            out[field] = v
    eos = d.get("eos_token_id")
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"config_from_hf: eos_token_id must be an id or a list of ids, got {eos!r}; "
                             "fix: write the token id(s) as in the checkpoint's tokenizer")
        out["eos_token_ids"] = ",".join(str(i) for i in ids)
    return out


def config_from_hf(d: Mapping[str, Any], generation: Mapping[str, Any] | None = None) -> ModelConfig:
    """A dense `ModelConfig` from a Hugging Face LLaMA / Mistral `config.json` dict; ValueError if unsupported.

    `generation`: the folder's `generation_config.json`, whose bos/eos/pad ids fill those config.json lacks."""

    def kind(field: str, want: str) -> ValueError:
        return ValueError(f"config_from_hf: {field} must be {want}, got {d.get(field)!r}; "
                          f"fix: write a complete LlamaConfig config.json")

    if not isinstance(d, Mapping):
        raise ValueError(f"config_from_hf: need a config object (dict), got a {type(d).__name__}; "
                         f"fix: pass the parsed config.json of a LlamaForCausalLM")
    model_type = d.get("model_type", "llama")
    if model_type == "boostjax_lowrank_llama":
        raise _bad("model_type", model_type, "this is a low-rank boostjax export (factors, loaded by transformers "
                                             "with trust_remote_code=True); boostjax reads dense LLaMA folders: "
                                             "export an svd run with --densify, or start from the run folder")
    if model_type not in ("llama", "mistral"):
        raise _bad("model_type", model_type, "boostjax imports LLaMA-architecture models (model_type 'llama', or "
                                             "'mistral' without a sliding window)")
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if not _is_int(d.get(name)):
            raise ValueError(f"config_from_hf: {name} is missing or not an int (got {d.get(name)!r}); "
                             f"fix: write a complete LlamaConfig config.json")
    for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
        if d.get(name) is not None and not _is_num(d[name]):
            raise kind(name, "a number")
    for name in ("max_position_embeddings", "head_dim", "num_key_value_heads", "sliding_window"):
        if d.get(name) is not None and not _is_int(d[name]):
            raise kind(name, "an integer")
    for name in ("rope_parameters", "rope_scaling"):
        if d.get(name) is not None and not isinstance(d[name], Mapping):
            raise kind(name, "an object or null")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise _bad("hidden_act", act, "boostjax LLaMA uses SwiGLU; only hidden_act 'silu' maps onto it")
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag, False):
            raise _bad(flag, d[flag], "boostjax LLaMA has no biases; use a checkpoint trained without them")
    max_len = int(d.get("max_position_embeddings") or 2048)
    window = d.get("sliding_window")
    if model_type == "mistral" and window is not None and window < max_len:
        raise _bad("sliding_window", window,
                   f"boostjax attends to every earlier position, which equals a {window}-token window only on "
                   f"sequences of at most {window} tokens: set max_position_embeddings to {window} in config.json "
                   "(and use sequences no longer), or use a checkpoint with sliding_window null")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    if hidden < 1 or heads < 1:
        raise _bad("hidden_size/num_attention_heads", (hidden, heads), "write positive sizes")
    head_dim = d.get("head_dim") or 0
    if not head_dim and hidden % heads:
        raise _bad("hidden_size", hidden, f"hidden_size must be a multiple of num_attention_heads={heads}, "
                                          "or config.json must give head_dim")
    explicit = head_dim if head_dim and (hidden % heads or head_dim != hidden // heads) else 0
    kv = d.get("num_key_value_heads") or heads
    ids = {**_token_ids(generation or {}), **_token_ids(d)}
    cfg = ModelConfig(
        kind="llama",
        vocab_size=d["vocab_size"],
        d_model=hidden,
        n_layers=d["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=0 if kv == heads else kv,
        d_ff=d["intermediate_size"],
        norm_eps=float(d.get("rms_norm_eps") if d.get("rms_norm_eps") is not None else 1e-6),
        max_seq_len=max_len,
        init_std=float(d.get("initializer_range") if d.get("initializer_range") is not None else 0.02),
        attn_head_dim=explicit,
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        **_rope_fields(d),
        **ids,
    )
    validate_model(cfg)
    return cfg


# ----------------------------------------------------------------------------------------- side files


def generation_config(cfg: ModelConfig, source: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """`generation_config.json`: the source's (if any) with this model's bos/eos/pad ids; None when
    there is neither a source nor an id to write."""
    out = dict(source or {})
    for key, value in (("bos_token_id", _opt_id(cfg.bos_token_id)), ("eos_token_id", eos_value(cfg)),
                       ("pad_token_id", _opt_id(cfg.pad_token_id))):
        if value is not None:
            out[key] = value
    return out or None


def tokenizer_config(cfg: ModelConfig, tok: Any) -> dict[str, Any]:
    """A `tokenizer_config.json` for a `tokenizer.json` (`tok`: a `tokenizers.Tokenizer`) so that
    `transformers.AutoTokenizer.from_pretrained` loads it as a fast tokenizer with the model's
    special tokens."""

    def name(i: int) -> str | None:
        return tok.id_to_token(i) if 0 <= i < tok.get_vocab_size(with_added_tokens=True) else None

    eos = cfg.eos_ids[0] if cfg.eos_ids else -1
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.max_seq_len,
        "bos_token": name(cfg.bos_token_id),
        "eos_token": name(eos),
        "pad_token": name(cfg.pad_token_id),
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }


def write_json(path: pathlib.Path, d: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
