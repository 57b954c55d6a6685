"""Hugging Face interop: dense boostjax LLaMA <-> `LlamaForCausalLM` checkpoint folders.

A folder holds `config.json` and `model.safetensors` (or shards `model-0000i-of-0000n.safetensors`
listed by `model.safetensors.index.json`), fp32 or bf16, and optionally `generation_config.json`,
`tokenizer.json` and `tokenizer_config.json`. Hugging Face stores linear weights `[out, in]`; boostjax
stores them `[in, out]`, so every projection and the head are transposed on the way. Both sides use
rotate-half RoPE and fp32 RMSNorm statistics, so logits agree to fp32 rounding. The config side
(RoPE scaling, head width, tied embeddings, token ids) is `boostjax.interop.hf_config`.

`read_hf` / `read_tensors` / `from_hf` also take a Llama `.gguf` file (`boostjax.interop.gguf_in`:
dequantized to fp32 by transformers' GGUF loader, the `gguf` extra).

Low-rank kinds (cola, svd, lax) have no Hugging Face LLaMA layout and are refused by `to_hf`;
`boostjax.interop.hf_lowrank.to_hf_lowrank` writes them (their factors with a modeling file, or an svd
model densified).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from boostjax.config import ConfigError, ModelConfig
from boostjax.data.tokenizers import load_tokenizer
from boostjax.interop import gguf_in
from boostjax.interop.hf_config import (
    GENERATION_NAME,
    REMOTE_CODE_FILES,
    TOKENIZER_CONFIG_NAME,
    check_exportable,
    config_from_hf,
    generation_config,
    hf_config,
    tokenizer_config,
    write_json,
)
from boostjax.models.llama import LLaMA, param_shapes
from boostjax.runs.folder import check_export_target

__all__ = [
    "build_model",
    "config_from_hf",
    "from_hf",
    "hf_config",
    "params_from_hf",
    "params_to_hf",
    "parse_size",
    "read_hf",
    "read_tensors",
    "to_hf",
    "write_folder",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
EXPORT_DTYPES: dict[str, Any] = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
TOKENIZER_NAME = "tokenizer.json"
SIZE_UNITS: dict[str, int] = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}

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


# ----------------------------------------------------------------------------------------- params


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> Hugging Face shape (`[out, in]` for linears) of the dense LLaMA of `cfg`'s
    shapes: the model's own shapes (`param_shapes`) under their Hugging Face names (`TOP_KEYS`,
    `LAYER_KEYS`), transposed where stored transposed. A tied model has no head: no lm_head.weight."""
    ours = param_shapes(cfg if cfg.kind == "llama" else dataclasses.replace(cfg, kind="llama"))
    out = {hf: ours[name][::-1] if tr else ours[name] for name, hf, tr in TOP_KEYS if name in ours}
    for i in range(cfg.n_layers):
        for (block, name), hf, tr in LAYER_KEYS:
            shape = ours[f"layers.{i}.{block}.{name}"]
            out[f"model.layers.{i}.{hf}"] = shape[::-1] if tr else shape
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
    check_exportable(cfg)
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
        if hf in shapes:
            put(ours, hf, tr, params.get(ours))
    for i in range(cfg.n_layers):
        layer = _layer(params.get("layers", {}), i)
        for (block, name), hf, tr in LAYER_KEYS:
            put(f"layers.{i}.{block}.{name}", f"model.layers.{i}.{hf}", tr, layer.get(block, {}).get(name))
    return out


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], tied: bool = False) -> dict[str, Any]:
    """{Hugging Face name: array} -> the pure fp32 params dict of a dense boostjax LLaMA.

    A tied `cfg` (`tie_embeddings`) gets no `head`; an `lm_head.weight` in `tensors` is ignored, as
    transformers ignores it for a tied model. `tied` (untied `cfg` only): the head is a copy of the
    embedding (`lm_head.weight` is then not needed).
    """
    shapes = _expected_shapes(cfg)
    tensors = dict(tensors)
    if cfg.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    elif tied:
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

    params: dict[str, Any] = {ours: get(hf, tr) for ours, hf, tr in TOP_KEYS if hf in shapes}
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


def parse_size(size: int | str) -> int:
    """Bytes of a shard size: an int, or a string like "5GB", "500MB", "2GiB" (Hugging Face's units)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif isinstance(size, str):
        text = size.strip().upper().replace(" ", "")
        unit = next((u for u in sorted(SIZE_UNITS, key=len, reverse=True) if text.endswith(u)), "")
        num = text[: len(text) - len(unit)] if unit else text
        try:
            n = int(float(num) * SIZE_UNITS[unit or "B"])
        except ValueError:
            n = -1
    else:
        n = -1
    if n < 1:
        raise ConfigError(f"export.max_shard_size: cannot read {size!r} as a positive size; "
                         "fix: pass e.g. --max-shard-size 5GB (units B, KB, MB, GB, KiB, MiB, GiB) or 0 for one file")
    return n


def _shard_groups(tensors: Mapping[str, np.ndarray], limit: int) -> list[list[str]]:
    """Tensor names in order, cut into consecutive groups of at most `limit` bytes (a larger tensor
    gets a shard of its own), as `save_pretrained(max_shard_size=...)` does."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, a in tensors.items():
        if groups[-1] and size + a.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += a.nbytes
    return groups


def _write_weights(out: pathlib.Path, tensors: Mapping[str, np.ndarray], max_shard_size: int | str) -> None:
    for old in [*out.glob("model-*-of-*.safetensors"), out / WEIGHTS_NAME, out / INDEX_NAME]:
        old.unlink(missing_ok=True)  # an earlier export's (check_export_target allowed replacing it)
    groups = _shard_groups(tensors, parse_size(max_shard_size)) if max_shard_size else [list(tensors)]
    if len(groups) == 1:
        save_file(dict(tensors), str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in names}, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in names})
    total = int(sum(a.nbytes for a in tensors.values()))
    write_json(out / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _side_files(cfg: ModelConfig, out: pathlib.Path, source: pathlib.Path | None) -> ModelConfig:
    """Tokenizer and generation config of `source` (a run folder or a Hugging Face folder) into `out`.
    Returns `cfg` with the eos/bos ids of the tokenizer where `cfg` has none."""

    tok_file = source / TOKENIZER_NAME if source is not None else None
    if tok_file is not None and tok_file.is_file():

        tok = load_tokenizer(tok_file)
        if not cfg.eos_ids and tok.eos_id is not None and tok.eos_id < cfg.vocab_size:
            cfg = dataclasses.replace(cfg, eos_token_ids=str(tok.eos_id))
        if cfg.bos_token_id < 0 and tok.bos_id is not None and tok.bos_id < cfg.vocab_size:
            cfg = dataclasses.replace(cfg, bos_token_id=tok.bos_id)
        shutil.copyfile(tok_file, out / TOKENIZER_NAME)
        for name in (TOKENIZER_CONFIG_NAME, "special_tokens_map.json"):
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
        if not (source / TOKENIZER_CONFIG_NAME).is_file():
            write_json(out / TOKENIZER_CONFIG_NAME, tokenizer_config(cfg, Tokenizer.from_file(str(tok_file))))
    gen_src = source / GENERATION_NAME if source is not None else None
    gen = generation_config(cfg, _read_json(gen_src) if gen_src is not None and gen_src.is_file() else None)
    if gen is not None:
        write_json(out / GENERATION_NAME, gen)
    return cfg


def to_hf(model_or_params: Any, path: str | pathlib.Path, cfg: ModelConfig | None = None,
          dtype: str = "float32", *, max_shard_size: int | str = 0,
          source: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write a Hugging Face LLaMA folder (`config.json`, weights, side files) and return its path.

    `model_or_params`: an `LLaMA` module, a `(ModelConfig, pure params dict)` pair, or a pure params
    dict together with `cfg`. `dtype`: "float32" (default) or "bfloat16". `max_shard_size` (bytes, or
    "5GB"-style; 0 = one file): split the weights into `model-0000i-of-0000n.safetensors` listed by
    `model.safetensors.index.json`. `source`: a run folder or Hugging Face folder whose `tokenizer.json`
    (with `tokenizer_config.json`, written when absent) and `generation_config.json` go along; the
    bos/eos/pad ids of the model config are written to config.json and generation_config.json.
    """
    cfg, params = _resolve(model_or_params, cfg)
    tensors = params_to_hf(cfg, params, dtype)
    return write_folder(tensors, path, lambda c: hf_config(c, dtype), cfg, max_shard_size=max_shard_size,
                        source=source)


def write_folder(tensors: Mapping[str, np.ndarray], path: str | pathlib.Path,
                 config: Callable[[ModelConfig], dict[str, Any]], cfg: ModelConfig, *,
                 max_shard_size: int | str = 0, source: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write an export folder: `tensors`, the side files of `source` and `config(cfg)` (cfg with the
    tokenizer's ids) as `config.json`. Every argument is checked before the first file is written."""
    if max_shard_size:
        parse_size(max_shard_size)
    src = pathlib.Path(source) if source is not None else None
    if src is not None and not src.is_dir():
        raise ValueError(f"to_hf: source {src} is not a folder; fix: pass the run folder or Hugging Face folder "
                         "holding tokenizer.json, or no source")
    out = pathlib.Path(path)
    check_export_target(out)  # never into a run folder or a folder of files boostjax did not write
    out.mkdir(parents=True, exist_ok=True)
    for name in REMOTE_CODE_FILES:
        (out / name).unlink(missing_ok=True)  # an earlier low-rank export's: the new config decides
    _write_weights(out, tensors, max_shard_size)
    cfg = _side_files(cfg, out, src)
    write_json(out / CONFIG_NAME, config(cfg))
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
    """Every tensor of a folder's `model.safetensors`, or of the shards its index lists (or of a Llama
    `.gguf`, dequantized to fp32, under the Hugging Face names)."""
    if gguf_in.is_gguf(path):
        return gguf_in.read_gguf(path)[1]
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
    """`(ModelConfig, pure fp32 params dict)` of a Hugging Face LLaMA / Mistral folder (fp32 or bf16 weights),
    or of a Llama `.gguf` file (any quantization, dequantized to fp32: `gguf_in`).

    bos/eos/pad ids come from config.json, or `generation_config.json` where config.json has none."""
    if gguf_in.is_gguf(path):
        cfg, tensors = gguf_in.read_gguf(path)
        return cfg, params_from_hf(cfg, tensors)
    folder = pathlib.Path(path)
    if not (folder / CONFIG_NAME).is_file():
        raise ValueError(f"from_hf: no {CONFIG_NAME} in {folder}; fix: pass a Hugging Face model folder")
    file = folder / CONFIG_NAME
    d = _read_json(file)
    if not isinstance(d, dict):
        raise ValueError(f"from_hf: {file} holds a JSON {type(d).__name__}, not a config object; "
                         "fix: restore it from the model's save_pretrained output")
    gen = _read_json(folder / GENERATION_NAME) if (folder / GENERATION_NAME).is_file() else None
    try:
        cfg = config_from_hf(d, gen if isinstance(gen, dict) else None)
    except ValueError as e:  # ConfigError included: name the file
        raise ValueError(f"from_hf: {file}: {str(e).removeprefix('config_from_hf: ')}") from None
    tensors = read_tensors(folder)
    if "lm_head.weight" not in tensors and not cfg.tie_embeddings:
        raise ValueError("from_hf: missing tensor 'lm_head.weight' and tie_word_embeddings is false; fix: use a "
                         "complete LlamaForCausalLM checkpoint, or set tie_word_embeddings true if the head "
                         "is the embedding")
    return cfg, params_from_hf(cfg, tensors)


def from_hf(path: str | pathlib.Path) -> LLaMA:
    """A dense fp32 boostjax `LLaMA` holding the weights of a Hugging Face LLaMA folder (or `.gguf` file)."""
    cfg, params = read_hf(path)
    return build_model(cfg, params)


def build_model(cfg: ModelConfig, params: Mapping[str, Any]) -> LLaMA:
    """An `LLaMA` of `cfg` filled with a pure params dict (no random init is materialised)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LLaMA(cfg, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
