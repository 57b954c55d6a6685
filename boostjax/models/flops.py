"""Parameter counts and training FLOPs per token (for MFU), from the model's parameter shapes
(`boostjax.models.llama.param_shapes`)."""

from __future__ import annotations

import math

from boostjax.config import ModelConfig
from boostjax.models.llama import param_shapes


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one block that take part in GEMMs: its matrices (norm scales and LaX gates, vectors,
    excluded; a grouped `a_qkv [d, 3, r]` counts its three matrices)."""
    return sum(math.prod(s) for s in param_shapes(cfg, block=True).values() if len(s) >= 2)


def param_count(cfg: ModelConfig) -> int:
    """Every trainable parameter, as `LLaMA(cfg)` allocates them (a tied model has no head)."""
    return sum(math.prod(s) for s in param_shapes(cfg).values())


def flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """Training FLOPs per token: `6 N_matmul + 12 L s (h e)` (forward + backward, PaLM convention).

    `N_matmul` counts every GEMM weight including the LM head's logits matmul (`d x V`, also for a tied
    model, whose logits use the embedding table) and not the embedding lookup (a gather, no FLOPs); the
    attention term counts `QKᵀ` and `PV` over the full sequence (the usual MFU convention, which
    ignores the causal mask's saving).
    """
    shapes = param_shapes(cfg)
    logits = math.prod(shapes["head"] if "head" in shapes else shapes["embed"])
    n_matmul = cfg.n_layers * layer_matmul_params(cfg) + logits
    attn = 12 * cfg.n_layers * seq * cfg.n_heads * cfg.head_dim
    return float(6 * n_matmul + attn)
