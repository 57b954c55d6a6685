"""A low-rank LLaMA exported by boostjax, as a transformers `LlamaForCausalLM` whose projections are
replaced by factor pairs: attention, RoPE, the KV cache and `generate` are transformers' own.

Each factored projection `p` holds `p.a.weight [r, in]` and `p.b.weight [out, r]` (torch's `[out, in]`
layout of boostjax's `A [in, r]` and `B [r, out]`) and computes `b(σ(a(x)))`, σ the identity for svd
and SiLU for cola and lax. LaX adds scalar gates that cross the latents inside a block
(`self_attn.cross [3]`: k += c0 q, v += c1 k, o += c2 v; `mlp.cross [2]`: up += c0 gate,
down += c1 up), each adding the source projection's latent after its own crossing.
"""

import torch
from torch import nn
from transformers import LlamaForCausalLM

from .configuration_boostjax_lowrank import BoostjaxLowRankLlamaConfig


class LowRankLinear(nn.Module):
    """`b(σ(a(x)))`, optionally plus `gate * (the latent of another LowRankLinear)` before `b`."""

    def __init__(self, d_in, d_out, rank, silu):
        super().__init__()
        self.a = nn.Linear(d_in, rank, bias=False)
        self.b = nn.Linear(rank, d_out, bias=False)
        self.act = nn.SiLU() if silu else nn.Identity()
        self.cross = None  # LaX: (owner module, index into owner.cross, source LowRankLinear)
        self.latent = None  # this call's latent, read by the projection that crosses from it

    def forward(self, x):
        h = self.act(self.a(x))
        if self.cross is not None:
            owner, i, source = self.cross
            h = h + owner.cross[i].to(h.dtype) * source.latent
        self.latent = h
        return self.b(h)


def _cross(owner, pairs):
    """Let each (target, source) projection pair of `owner` cross, gate `owner.cross[i]`."""
    owner.cross = nn.Parameter(torch.zeros(len(pairs)))
    for i, (target, source) in enumerate(pairs):
        object.__setattr__(target, "cross", (owner, i, source))  # plain references: no submodules


class BoostjaxLowRankLlamaForCausalLM(LlamaForCausalLM):
    config_class = BoostjaxLowRankLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        ranks, silu = config.lowrank_ranks, config.lowrank_kind != "svd"
        d, f = config.hidden_size, config.intermediate_size
        e = getattr(config, "head_dim", None) or d // config.num_attention_heads
        he, ke = config.num_attention_heads * e, config.num_key_value_heads * e
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            shapes = {"q_proj": (attn, "attn", d, he), "k_proj": (attn, "kv", d, ke), "v_proj": (attn, "kv", d, ke),
                      "o_proj": (attn, "attn", he, d), "gate_proj": (mlp, "mlp", d, f),
                      "up_proj": (mlp, "mlp", d, f), "down_proj": (mlp, "mlp", f, d)}
            for name, (owner, group, d_in, d_out) in shapes.items():
                if ranks.get(group):
                    setattr(owner, name, LowRankLinear(d_in, d_out, ranks[group], silu))
            if not config.lowrank_mlp_silu:
                mlp.act_fn = nn.Identity()  # CoLA's MLP: hidden = gate * up
            if config.lowrank_kind == "lax":  # q, k, v run in that order in LlamaAttention.forward, then o
                if ranks.get("attn"):
                    _cross(attn, [(attn.k_proj, attn.q_proj), (attn.v_proj, attn.k_proj), (attn.o_proj, attn.v_proj)])
                if ranks.get("mlp"):
                    _cross(mlp, [(mlp.up_proj, mlp.gate_proj), (mlp.down_proj, mlp.up_proj)])
        self.post_init()
