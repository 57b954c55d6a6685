"""Config of a low-rank LLaMA exported by boostjax: a `LlamaConfig` plus the factorisation.

`lowrank_kind`: "svd" (`y = (x A) B`), "cola" (`y = silu(x A) B`) or "lax" (cola with scalar gates
crossing the latents). `lowrank_ranks`: the rank of each projection group, "attn" (q, o), "kv" (k, v)
and "mlp" (gate, up, down); 0 keeps the group's projections dense. `lowrank_mlp_silu`: the MLP's
hidden state is `silu(gate) * up` (SwiGLU) when true, CoLA's `gate * up` when false.
"""

from transformers import LlamaConfig


class BoostjaxLowRankLlamaConfig(LlamaConfig):
    model_type = "boostjax_lowrank_llama"

    def __init__(self, lowrank_kind="svd", lowrank_ranks=None, lowrank_mlp_silu=True, **kwargs):
        self.lowrank_kind = lowrank_kind
        self.lowrank_ranks = dict(lowrank_ranks or {"attn": 0, "kv": 0, "mlp": 0})
        self.lowrank_mlp_silu = lowrank_mlp_silu
        super().__init__(**kwargs)
