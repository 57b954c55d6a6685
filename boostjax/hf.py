"""Hugging Face interop: dense boostjax LLaMA <-> `LlamaForCausalLM` checkpoint folders.

A folder holds `config.json` and `model.safetensors` (or shards `model-0000i-of-0000n.safetensors`
listed by `model.safetensors.index.json`). Hugging Face stores linear weights `[out, in]`; boostjax
stores them `[in, out]`, so every projection and the head are transposed on the way. Both sides use
rotate-half RoPE and fp32 RMSNorm statistics, so logits agree to fp32 rounding.

Low-rank kinds (cola, svd, lax) have no Hugging Face LLaMA layout and are refused by `to_hf`.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from boostjax import __version__
from boostjax.config import ModelConfig, validate_model
from boostjax.runfolder import EXPORT_MARK, check_export_target
from boostjax.models.llama import LLaMA

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
EXPORT_DTYPES: dict[str, Any] = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}

# (our path inside one layer, Hugging Face name inside `model.layers.{i}.`, stored transposed)
LAYER_KEYS: tuple[tuple[tuple[str, str], str, bool], ...] = (
    (("attn", "norm"), "input_layernorm.weight", False),
    (("attn", "w_q"), "self_attn.q_proj.weight", True),
    (("attn", "w_k"), "self_attn.k_proj.weight", True),
    (("attn", "w_v"), "self_attn.v_proj.weight", True),
    (("attn", "w_o"), "self_attn.o_proj.weight", True),
    (("mlp", "norm"), "post_attention_layernorm.weight", False),
    (("mlp", "w_gate"), "mlp.gate_proj.weight", True),
    (("mlp", "w_up"), "mlp.up_proj.weight", True),
    (("mlp", "w_down"), "mlp.down_proj.weight", True),
)
TOP_KEYS: tuple[tuple[str, str, bool], ...] = (
    ("embed", "model.embed_tokens.weight", False),
    ("norm", "model.norm.weight", False),
    ("head", "lm_head.weight", True),
)
# buffers some old checkpoints carry; recomputed from rope_theta, so safe to drop
IGNORED_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------------------- config


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The `config.json` of a dense `cfg` as a Hugging Face `LlamaConfig` dict (transformers 4 and 5)."""
    _check_exportable(cfg)
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
        "rope_theta": cfg.rope_theta,  # transformers 4 reads this ...
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},  # ... and 5 this
        "hidden_act": "silu",
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
        "bos_token_id": None,  # boostjax's byte-level tokenizer has no special tokens
        "eos_token_id": None,
        "pad_token_id": None,
        EXPORT_MARK: {"version": __version__},  # lets a later export replace this folder, and nothing else
    }


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    """A dense `ModelConfig` from a Hugging Face LLaMA `config.json` dict; ValueError if unsupported."""

    def bad(field: str, got: Any, fix: str) -> ValueError:
        return ValueError(f"config_from_hf: {field}={got!r} is not supported; fix: {fix}")

    def kind(field: str, want: str) -> ValueError:
        return ValueError(f"config_from_hf: {field} must be {want}, got {d.get(field)!r}; "
                          f"fix: write a complete LlamaConfig config.json")

    if not isinstance(d, Mapping):
        raise ValueError(f"config_from_hf: need a config object (dict), got a {type(d).__name__}; "
                         f"fix: pass the parsed config.json of a LlamaForCausalLM")
    if d.get("model_type", "llama") != "llama":
        raise bad("model_type", d.get("model_type"), "export a LLaMA-architecture model (model_type 'llama')")
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if not _is_int(d.get(name)):
            raise ValueError(f"config_from_hf: {name} is missing or not an int (got {d.get(name)!r}); "
                             f"fix: write a complete LlamaConfig config.json")
    for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
        if d.get(name) is not None and not _is_num(d[name]):
            raise kind(name, "a number")
    for name in ("max_position_embeddings", "head_dim", "num_key_value_heads"):
        if d.get(name) is not None and not _is_int(d[name]):
            raise kind(name, "an integer")
    for name in ("rope_parameters", "rope_scaling"):
        if d.get(name) is not None and not isinstance(d[name], Mapping):
            raise kind(name, "an object or null")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise bad("hidden_act", act, "boostjax LLaMA uses SwiGLU; only hidden_act 'silu' maps onto it")
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag, False):
            raise bad(flag, d[flag], "boostjax LLaMA has no biases; use a checkpoint trained without them")
    theta = d.get("rope_theta") if d.get("rope_theta") is not None else 10000.0
    rope_params = d.get("rope_parameters")
    if rope_params:
        if rope_params.get("rope_type", "default") != "default":
            raise bad("rope_parameters.rope_type", rope_params.get("rope_type"),
                      "boostjax implements plain RoPE only; use a checkpoint without RoPE scaling")
        if rope_params.get("partial_rotary_factor", 1.0) != 1.0:
            raise bad("rope_parameters.partial_rotary_factor", rope_params["partial_rotary_factor"],
                      "boostjax rotates the whole head; use partial_rotary_factor 1.0")
        theta = rope_params.get("rope_theta", theta)
        if not _is_num(theta):
            raise bad("rope_parameters.rope_theta", theta, "write rope_theta as a number, e.g. 10000.0")
    scaling = d.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise bad("rope_scaling", scaling,
                  "boostjax implements plain RoPE only; use a checkpoint with rope_scaling null")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    if hidden < 1 or heads < 1:
        raise bad("hidden_size/num_attention_heads", (hidden, heads), "write positive sizes")
    if hidden % heads:
        raise bad("hidden_size", hidden, f"hidden_size must be a multiple of num_attention_heads={heads}")
    head_dim = d.get("head_dim") or hidden // heads
    if head_dim != hidden // heads:
        raise bad("head_dim", head_dim,
                  f"boostjax needs head_dim == hidden_size / num_attention_heads = {hidden // heads}")
    kv = d.get("num_key_value_heads") or heads
    cfg = ModelConfig(
        kind="llama",
        vocab_size=d["vocab_size"],
        d_model=hidden,
        n_layers=d["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=0 if kv == heads else kv,
        d_ff=d["intermediate_size"],
        rope_theta=float(theta),
        norm_eps=float(d.get("rms_norm_eps") if d.get("rms_norm_eps") is not None else 1e-6),
        max_seq_len=int(d.get("max_position_embeddings") or 2048),
        init_std=float(d.get("initializer_range") if d.get("initializer_range") is not None else 0.02),
    )
    validate_model(cfg)
    return cfg


def _check_exportable(cfg: ModelConfig) -> None:
    if cfg.low_rank:
        raise ValueError(
            f"to_hf: model kind {cfg.kind!r} is low-rank; Hugging Face LLaMA layout holds full-rank models "
            f"only; fix: train/export a kind='llama' model, or materialise the dense weights into one first")
    if cfg.kind != "llama":
        raise ValueError(f"to_hf: unknown model kind {cfg.kind!r}; fix: export a kind='llama' model")


# ----------------------------------------------------------------------------------------- params


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> Hugging Face shape (`[out, in]` for linears) of a dense `cfg`."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    he, ke = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    per_layer = {
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (he, d), "self_attn.k_proj.weight": (ke, d),
        "self_attn.v_proj.weight": (ke, d), "self_attn.o_proj.weight": (d, he),
        "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
    }
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(cfg.n_layers):
        out.update({f"model.layers.{i}.{k}": s for k, s in per_layer.items()})
    return out


def _layer(layers: Any, i: int) -> Mapping[str, Any]:
    if isinstance(layers, (list, tuple)):
        return layers[i]
    if i in layers:
        return layers[i]
    if str(i) in layers:
        return layers[str(i)]
    raise ValueError(f"to_hf: params['layers'] has no layer {i}; fix: pass the full pure dict of the model")


def params_to_hf(cfg: ModelConfig, params: Mapping[str, Any], dtype: str = "float32") -> dict[str, np.ndarray]:
    """Pure boostjax params -> {Hugging Face name: contiguous numpy array in `dtype`}."""
    _check_exportable(cfg)
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"to_hf: dtype={dtype!r} is not supported; fix: use one of {', '.join(EXPORT_DTYPES)}")
    shapes, np_dtype = _expected_shapes(cfg), EXPORT_DTYPES[dtype]

    def put(ours: str, hf: str, transpose: bool, value: Any) -> None:
        if value is None:
            raise ValueError(f"to_hf: params has no {ours!r} (for {hf}); fix: pass the full pure dict of the model")
        a = np.asarray(jax.device_get(value), dtype=np.float32)
        need = shapes[hf][::-1] if transpose else shapes[hf]
        if a.shape != need:
            raise ValueError(f"to_hf: {ours!r} has shape {a.shape}, the config needs {need}; "
                             f"fix: pass the ModelConfig the params were built with")
        out[hf] = np.ascontiguousarray((a.T if transpose else a).astype(np_dtype))

    out: dict[str, np.ndarray] = {}
    for ours, hf, tr in TOP_KEYS:
        put(ours, hf, tr, params.get(ours))
    for i in range(cfg.n_layers):
        layer = _layer(params.get("layers", {}), i)
        for (block, name), hf, tr in LAYER_KEYS:
            put(f"layers.{i}.{block}.{name}", f"model.layers.{i}.{hf}", tr, layer.get(block, {}).get(name))
    return out


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], tied: bool = False) -> dict[str, Any]:
    """{Hugging Face name: array} -> the pure fp32 params dict of a dense boostjax LLaMA.

    `tied`: the head is the embedding (`tie_word_embeddings`); `lm_head.weight` is then not needed.
    """
    shapes = _expected_shapes(cfg)
    tensors = dict(tensors)
    if tied:
        tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")
    known = set(shapes)
    extra = sorted(k for k in tensors if k not in known and not k.endswith(IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"from_hf: unexpected tensor(s) {extra[:4]} for a {cfg.n_layers}-layer LLaMA; fix: "
                         f"check num_hidden_layers in config.json, or the checkpoint is not a plain LLaMA")

    def get(hf: str, transpose: bool) -> jax.Array:
        if tensors.get(hf) is None:
            raise ValueError(f"from_hf: missing tensor {hf!r}; fix: use a complete LlamaForCausalLM checkpoint "
                             f"(save_pretrained with safetensors)")
        a = np.asarray(tensors[hf])
        if a.shape != shapes[hf]:
            raise ValueError(f"from_hf: tensor {hf!r} has shape {a.shape}, config.json implies {shapes[hf]}; "
                             f"fix: the config and the weights disagree, re-export the checkpoint")
        a = a.astype(np.float32)
        return jnp.asarray(a.T if transpose else a)

    params: dict[str, Any] = {ours: get(hf, tr) for ours, hf, tr in TOP_KEYS}
    params["layers"] = {}
    for i in range(cfg.n_layers):
        layer: dict[str, dict[str, jax.Array]] = {"attn": {}, "mlp": {}}
        for (block, name), hf, tr in LAYER_KEYS:
            layer[block][name] = get(f"model.layers.{i}.{hf}", tr)
        params["layers"][i] = layer
    return params


# ----------------------------------------------------------------------------------------- files


def _resolve(model_or_params: Any, cfg: ModelConfig | None) -> tuple[ModelConfig, Mapping[str, Any]]:
    if isinstance(model_or_params, LLaMA):
        return model_or_params.cfg, nnx.to_pure_dict(nnx.state(model_or_params, nnx.Param))
    if isinstance(model_or_params, tuple) and len(model_or_params) == 2 and isinstance(model_or_params[0], ModelConfig):
        cfg, params = model_or_params
    else:
        params = model_or_params
    if cfg is None:
        raise ValueError("to_hf: a params dict needs its ModelConfig; fix: pass (cfg, params) or cfg=...")
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    if not isinstance(params, Mapping):
        raise ValueError(f"to_hf: cannot export a {type(params).__name__}; fix: pass an LLaMA module or (cfg, params)")
    return cfg, params


def to_hf(model_or_params: Any, path: str | pathlib.Path, cfg: ModelConfig | None = None,
          dtype: str = "float32") -> pathlib.Path:
    """Write a Hugging Face LLaMA folder (`config.json`, `model.safetensors`) and return its path.

    `model_or_params`: an `LLaMA` module, a `(ModelConfig, pure params dict)` pair, or a pure params
    dict together with `cfg`. `dtype`: "float32" (default) or "bfloat16".
    """
    cfg, params = _resolve(model_or_params, cfg)
    tensors = params_to_hf(cfg, params, dtype)
    out = pathlib.Path(path)
    check_export_target(out)  # never into a run folder or a folder of files boostjax did not write
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(hf_config(cfg, dtype), indent=2, sort_keys=True) + "\n")
    return out


def _read_json(file: pathlib.Path) -> Any:
    """A JSON file of a model folder; ValueError (one line naming the file) when it cannot be read."""
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise ValueError(f"from_hf: cannot read {file}: {e.strerror or type(e).__name__}; fix: check the file's "
                         "permissions and the disk") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"from_hf: {file} is not JSON text (not UTF-8); fix: restore it from the model's "
                         "save_pretrained output") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"from_hf: {file} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                         "fix: restore it from the model's save_pretrained output") from None


def _shards(folder: pathlib.Path) -> list[pathlib.Path]:
    index = folder / INDEX_NAME
    d = _read_json(index)
    weight_map = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(v, str) and v and pathlib.Path(v).name == v for v in weight_map.values()):
        raise ValueError(f"from_hf: {index} has no weight_map of tensor name -> shard file name; "
                         "fix: restore it from the model's save_pretrained output")
    files = [folder / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"from_hf: {INDEX_NAME} lists missing shard(s) {missing}; "
                         f"fix: copy every shard into {folder}")
    return files


def read_tensors(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a folder's `model.safetensors`, or of the shards its index lists."""
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise ValueError(f"from_hf: {folder} is not a folder; fix: pass a Hugging Face model folder "
                         "(config.json and model.safetensors)")
    if (folder / WEIGHTS_NAME).is_file():
        files = [folder / WEIGHTS_NAME]
    elif (folder / INDEX_NAME).is_file():
        files = _shards(folder)
    else:
        raise ValueError(f"from_hf: no {WEIGHTS_NAME} or {INDEX_NAME} in {folder}; fix: save the model with "
                         f"save_pretrained(..., safe_serialization=True) (pytorch .bin files are not read)")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="np") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError, ValueError, TypeError) as e:
            why = " ".join(str(e).split())[:200] or type(e).__name__
            raise ValueError(f"from_hf: {file} is not a readable safetensors file ({why}); fix: re-download or "
                             "re-export it (save_pretrained(..., safe_serialization=True))") from None
    if "embed_tokens.weight" in tensors and "model.embed_tokens.weight" not in tensors:  # bare LlamaModel
        tensors = {k if k.startswith("lm_head.") else f"model.{k}": v for k, v in tensors.items()}
    return tensors


def read_hf(path: str | pathlib.Path) -> tuple[ModelConfig, dict[str, Any]]:
    """`(ModelConfig, pure fp32 params dict)` of a Hugging Face LLaMA folder."""
    folder = pathlib.Path(path)
    if not (folder / CONFIG_NAME).is_file():
        raise ValueError(f"from_hf: no {CONFIG_NAME} in {folder}; fix: pass a Hugging Face model folder")
    file = folder / CONFIG_NAME
    d = _read_json(file)
    if not isinstance(d, dict):
        raise ValueError(f"from_hf: {file} holds a JSON {type(d).__name__}, not a config object; "
                         "fix: restore it from the model's save_pretrained output")
    try:
        cfg = config_from_hf(d)
    except ValueError as e:  # ConfigError included: name the file
        raise ValueError(f"from_hf: {file}: {str(e).removeprefix('config_from_hf: ')}") from None
    tensors = read_tensors(folder)
    tied = bool(d.get("tie_word_embeddings", False))
    if "lm_head.weight" not in tensors and not tied:
        raise ValueError("from_hf: missing tensor 'lm_head.weight' and tie_word_embeddings is false; fix: use a "
                         "complete LlamaForCausalLM checkpoint, or set tie_word_embeddings true if the head "
                         "is the embedding")
    return cfg, params_from_hf(cfg, tensors, tied=tied)


def from_hf(path: str | pathlib.Path) -> LLaMA:
    """A dense fp32 boostjax `LLaMA` holding the weights of a Hugging Face LLaMA folder."""
    cfg, params = read_hf(path)
    return build_model(cfg, params)


def build_model(cfg: ModelConfig, params: Mapping[str, Any]) -> LLaMA:
    """An `LLaMA` of `cfg` filled with a pure params dict (no random init is materialised)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LLaMA(cfg, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
