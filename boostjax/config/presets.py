"""The named model shapes (`--preset`): CoLA's LLaMA sizes, tiny to 30b."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from boostjax.config.model import ModelConfig
from boostjax.config.names import ConfigError

DEFAULT_PRESET = "tiny"  # the model shapes `boostjax train` (and every command sharing its flags) starts from


def _shape(d: int, layers: int, heads: int, d_ff: int, r: int, **kw: Any) -> ModelConfig:
    """A preset: RMSNorm eps 1e-6 (CoLA's json and BOOST's yaml both use it) and untied embeddings
    (CoLA never ties; BOOST ties at 1B/7B: pass --tie-embeddings for that)."""
    return ModelConfig(d_model=d, n_layers=layers, n_heads=heads, d_ff=d_ff, rank=r, norm_eps=1e-6,
                       tie_embeddings=False, **kw)


# CoLA's LLaMA shapes and ranks (one rank for attention and MLP as in every CoLA/BOOST config); d_ff
# 1376 at 60m is CoLA's (BOOST 1344), 5472 at 1b BOOST's (CoLA 5461); 3b/13b/30b have no reference
# config (docs/models.md, "Presets"). Vocabulary: the byte-level tokenizer unless overridden.
PRESETS: dict[str, ModelConfig] = {
    "tiny": _shape(128, 4, 4, 352, 32),
    "60m": _shape(512, 8, 8, 1376, 128),
    "130m": _shape(768, 12, 12, 2048, 256),
    "350m": _shape(1024, 24, 16, 2736, 256),
    "1b": _shape(2048, 24, 32, 5472, 512),
    "3b": _shape(3072, 28, 24, 8192, 768),
    "7b": _shape(4096, 32, 32, 11008, 1024),
    "13b": _shape(5120, 40, 40, 13824, 1280),
    "30b": _shape(8192, 36, 64, 22016, 2048),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The model shapes of a named preset, with field overrides (`kind="llama"`, ...)."""
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError(f"preset: unknown preset {name!r}; fix: use one of {', '.join(PRESETS)}")
    return replace(PRESETS[key], **overrides)
