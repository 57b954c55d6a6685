"""A Llama-architecture `.gguf` file (llama.cpp's format, any quantization) read as a Hugging Face folder.

transformers' GGUF loader does the reading: `AutoConfig.from_pretrained(folder, gguf_file=name)` builds
the config from the metadata, `load_gguf_checkpoint` dequantizes every tensor to fp32 under its Hugging
Face name and undoes llama.cpp's rotary permutation of the q/k rows (the model it maps names from is
built on the meta device: nothing is allocated). This module checks the file first (it exists, parses
whole, is of architecture llama, has no RoPE scaling the loader would drop and no tensor a LLaMA has no
place for), then hands `hf.read_hf` the `ModelConfig` (`config_from_hf` of the config's dict) and
`{Hugging Face name: fp32 array}`: tied embeddings, GQA, head width and RoPE come out as for a folder.

Needs the optional packages gguf, torch and transformers: `pip install 'boostjax[gguf]'`.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
from typing import Any

import numpy as np

from boostjax.config import ConfigError, ModelConfig
from boostjax.interop.hf_config import config_from_hf

SUFFIX = ".gguf"
INSTALL = "pip install 'boostjax[gguf]'"
# llama.cpp's names of a Llama's tensors: the whole model's, and one layer's (`blk.{i}.NAME.weight`)
TOP_TENSORS = ("token_embd", "output_norm", "output")
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")
# the last file's (transformers config, ModelConfig) by (path, size, mtime): `train --init-from-hf` reads the
# config three times (flags, configure, the weights), each a parse of the whole metadata (seconds on a vocabulary)
_LAST: dict[tuple[str, int, int], tuple[Any, ModelConfig]] = {}


def is_gguf(path: str | pathlib.Path) -> bool:
    """Whether `path` names a `.gguf` file (by its suffix; it need not exist)."""
    return pathlib.Path(path).suffix.lower() == SUFFIX


def _modules() -> tuple[Any, Any, Any]:
    """(gguf, torch, transformers), or a ConfigError naming the extra that installs them."""
    try:
        import gguf  # noqa: PLC0415 (optional: the gguf extra)
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415
    except ImportError as e:
        raise ConfigError(f"from_hf: reading a .gguf file needs the optional packages gguf, torch and transformers "
                          f"({e.name or e} is not installed); fix: {INSTALL}") from None
    return gguf, torch, transformers


def _why(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def _meta(reader: Any, key: str) -> Any:
    """One scalar or string metadata value of a `gguf.GGUFReader`, None when absent."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    part = field.parts[field.data[0]]
    return bytes(part).decode("utf-8", "replace") if field.types[0].name == "STRING" else part.tolist()[0]


def _check(file: pathlib.Path, gguf: Any) -> None:
    """ValueError (one line) unless `file` is a complete GGUF of a plain Llama."""
    if not file.exists():
        raise ValueError(f"from_hf: {file} does not exist; fix: pass the path of a .gguf file of a Llama model")
    if not file.is_file():
        raise ValueError(f"from_hf: {file} is not a file; fix: pass the .gguf file itself")
    try:
        reader = gguf.GGUFReader(str(file))
    except Exception as e:  # a damaged file raises whatever the parser trips on
        raise ValueError(f"from_hf: {file} is not a readable GGUF file ({_why(e)}); fix: re-download it "
                         "(a truncated or damaged copy)") from None
    arch = _meta(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"from_hf: {file} is a GGUF of architecture {arch!r}; only llama is read (boostjax "
                         "imports Llama-architecture models); fix: pass the .gguf of a Llama model "
                         "(general.architecture 'llama')")
    scaling = _meta(reader, "llama.rope.scaling.type")
    names = {t.name for t in reader.tensors}
    if scaling not in (None, "none") or "rope_freqs.weight" in names:
        raise ValueError(f"from_hf: {file} scales RoPE ({scaling or 'rope_freqs.weight'}), which transformers' "
                         "GGUF loader does not read, so the positions would be wrong; fix: import the model's "
                         "Hugging Face folder instead")
    n = _meta(reader, "llama.block_count")
    known = {f"{t}.weight" for t in TOP_TENSORS}
    known |= {f"blk.{i}.{t}.weight" for i in range(n if isinstance(n, int) else 0) for t in LAYER_TENSORS}
    extra = sorted(names - known)
    if extra:
        raise ValueError(f"from_hf: {file} holds tensor(s) {extra[:4]} that a {n}-layer Llama has no place for; "
                         "fix: pass the .gguf of a plain Llama model (no biases, no extra tensors)")


def _config(file: pathlib.Path) -> tuple[Any, ModelConfig]:
    """(transformers' config of the checked `file`, its `ModelConfig`)."""
    gguf, _, transformers = _modules()
    st = file.stat() if file.is_file() else None
    key = (str(file.resolve()), st.st_size, st.st_mtime_ns) if st is not None else None
    if key in _LAST:
        return _LAST[key]
    _check(file, gguf)
    try:
        conf = transformers.AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"from_hf: transformers cannot build a config from {file} ({_why(e)}); fix: pass the "
                         ".gguf of a Llama model as llama.cpp writes it") from None
    d = conf.to_dict()
    if isinstance(d.get("rms_norm_eps"), float):  # stored as float32: 1e-5 comes back as 9.99999975e-06
        d["rms_norm_eps"] = float(str(np.float32(d["rms_norm_eps"])))
    try:
        cfg = config_from_hf(d)
    except ValueError as e:
        raise ValueError(f"from_hf: {file}: {str(e).removeprefix('config_from_hf: ')}") from None
    _LAST.clear()
    if key is not None:
        _LAST[key] = (conf, cfg)
    return conf, cfg


def read_gguf_config(path: str | pathlib.Path) -> ModelConfig:
    """The dense `ModelConfig` of a Llama `.gguf`, from its metadata (no tensor is read)."""
    return _config(pathlib.Path(path))[1]


def read_gguf(path: str | pathlib.Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """(`ModelConfig`, {Hugging Face name: fp32 array}) of a Llama `.gguf`, dequantized by transformers."""
    file = pathlib.Path(path)
    conf, cfg = _config(file)
    _, torch, transformers = _modules()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: PLC0415 (optional)

    with torch.device("meta"):  # its parameter names are what the loader maps onto
        model = transformers.AutoModelForCausalLM.from_config(conf)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the loader's progress bar
            loaded = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=model)["tensors"]
    except Exception as e:  # a damaged block raises whatever dequantizing trips on
        raise ValueError(f"from_hf: transformers cannot read the tensors of {file} ({_why(e)}); fix: re-download "
                         "it, or convert it again with llama.cpp") from None
    return cfg, {k: v.to(torch.float32).numpy() for k, v in loaded.items()}
