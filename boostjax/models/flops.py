"""Parameter counts and training FLOPs per token (for MFU), computed from the config alone."""

from __future__ import annotations

from boostjax.config import ModelConfig


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one block that take part in GEMMs (norm scales and LaX gates excluded)."""
    d, f, r = cfg.d_model, cfg.d_ff, cfg.rank
    he, ke = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    if not cfg.low_rank:
        return d * he + 2 * d * ke + he * d + 3 * d * f
    attn = 3 * d * r + r * he + 2 * r * ke + he * r + r * d
    mlp = 2 * d * r + 2 * r * f + f * r + r * d
    return attn + mlp


def param_count(cfg: ModelConfig) -> int:
    """Every trainable parameter, as `LLaMA(cfg)` allocates them."""
    lax_gates = 5 if cfg.kind == "lax" else 0
    per_layer = layer_matmul_params(cfg) + 2 * cfg.d_model + lax_gates
    tables = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * cfg.d_model  # embedding (+ head unless tied)
    return cfg.n_layers * per_layer + tables + cfg.d_model


def flops_per_token(cfg: ModelConfig, seq: int) -> float:
    """Training FLOPs per token: `6 N_matmul + 12 L s (h e)` (forward + backward, PaLM convention).

    `N_matmul` counts every GEMM weight including the LM head (not the embedding lookup); the
    attention term counts `QKᵀ` and `PV` over the full sequence (the usual MFU convention, which
    ignores the causal mask's saving).
    """
    n_matmul = cfg.n_layers * layer_matmul_params(cfg) + cfg.d_model * cfg.vocab_size
    attn = 12 * cfg.n_layers * seq * cfg.n_heads * cfg.head_dim
    return float(6 * n_matmul + attn)
