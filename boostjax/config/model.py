"""`ModelConfig`: the shapes of a (low-rank) LLaMA, each field with its help, flag and resume policy."""

from __future__ import annotations

from dataclasses import dataclass

from boostjax.config.fields import option
from boostjax.config.names import LOW_RANK_KINDS, PROJECTION_GROUPS, Attention, ModelKind, RopeType


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a (low-rank) LLaMA. `rank` is ignored by the dense `llama` kind.

    Each field's help text, command-line flag and resume policy are its metadata (`option`)."""

    kind: ModelKind = option(
        "cola", "model kind: llama (dense, SwiGLU), cola (CoLA: SiLU between the two factors of every "
        "projection), svd (plain low-rank factors, no nonlinearity between them) or lax (CoLA with gated "
        "latent crossing); with --init-from-hf the default is llama", flag="--model")
    vocab_size: int = option(256, "vocabulary size (256 = the byte-level tokenizer; without this flag a "
                                  "tokenised --data folder's meta.json gives it)")
    d_model: int = option(128, "width d of the residual stream (the embedding dimension)")
    n_layers: int = option(4, "number of transformer blocks")
    n_heads: int = option(4, "attention (query) heads")
    n_kv_heads: int = option(0, "key/value heads for grouped-query attention; 0 = n_heads (no grouping); "
                                "must divide n_heads")
    d_ff: int = option(352, "hidden width of the gated MLP")
    rank: int = option(32, "rank r of every low-rank projection (cola, svd, lax; ignored by llama) unless "
                           "--rank-attn, --rank-kv or --rank-mlp overrides it for its group")
    rank_attn: int = option(0, "rank of the attention's q and o projections; 0 = --rank")
    rank_kv: int = option(0, "rank of the attention's k and v projections (narrow under grouped-query "
                             "attention); 0 = --rank")
    rank_mlp: int = option(0, "rank of the MLP's gate, up and down projections; 0 = --rank")
    auto_dense: bool = option(
        True, "a projection group whose rank-r factors would hold at least as many parameters as the dense "
              "matrix (r (in + out) >= in x out) stays dense; --no-auto-dense factorises every projection "
              "(runs of older boostjax, whose config.json lacks the field), r at most min(in, out); a resume "
              "without this flag keeps the run's stored value",
        resume="follow-stored", legacy=False)
    rope_theta: float = option(10000.0, "RoPE base theta: frequencies theta^(-2i/head_dim)")
    norm_eps: float = option(1e-5, "RMSNorm epsilon (the presets use 1e-6, as CoLA's and BOOST's configs); a "
                                   "resume without this flag keeps the run's stored value", resume="follow-stored")
    max_seq_len: int = option(4096, "longest sequence the model takes (RoPE tables, --seq, generation)")
    init_std: float = option(0.02, "std of the normal init of the dense kind's weights, the embedding and the "
                                   "LM head (low-rank factors use CoLA's init)")
    # the attention kernel (boostjax.models.attention) computes the same function, so a resume may change it
    attention: Attention = option(
        "auto", "attention kernel: auto (cudnn on a CUDA GPU in bf16/fp16, else chunked), xla (the "
                "materialised [t, t] reference), cudnn (cuDNN flash attention), chunked (blockwise, no t x t "
                "buffer); the math is the same, so a resumed run may change it", resume="mutable")
    attention_block: int = option(512, "with --attention chunked (or auto where it picks chunked): query/key "
                                       "positions per tile (a resumed run may change it)", resume="mutable")
    # Hugging Face interop. RoPE scaling (`boostjax.models.ops.rope_inv_freq`)
    rope_type: RopeType = option(
        "default", "RoPE scaling: default (plain), linear (positions / factor), dynamic (NTK: a larger base "
                   "beyond max_seq_len), llama3 (Llama 3.1 frequency bands)")
    rope_factor: float = option(1.0, "RoPE scaling factor; needs --rope-type linear, dynamic or llama3 (1 = none, "
                                     "the only value --rope-type default takes)")
    rope_low_freq_factor: float = option(1.0, "with --rope-type llama3: wavelengths beyond rope_original_max_len / "
                                              "this are divided by the factor")
    rope_high_freq_factor: float = option(4.0, "with --rope-type llama3: wavelengths below rope_original_max_len / "
                                               "this are kept")
    rope_original_max_len: int = option(0, "with --rope-type llama3: the pretraining context "
                                           "(original_max_position_embeddings); 0 = max_seq_len")
    attn_head_dim: int = option(0, "width of one attention head; 0 = d_model / n_heads")
    tie_embeddings: bool = option(False, "the LM head is the embedding transposed (no separate head "
                                         "parameter); not with a TP --strategy or a stage axis in --mesh")
    # special token ids: metadata carried to exports and generation, so a resumed run may change them
    bos_token_id: int = option(-1, "beginning-of-sequence token id written to exports; -1 = none",
                               resume="mutable")
    eos_token_ids: str = option("", "end-of-sequence token id(s), comma-separated (Llama 3 has several), "
                                    "written to exports and used by generation; '' = none", resume="mutable")
    pad_token_id: int = option(-1, "padding token id written to exports; -1 = none", resume="mutable")
    # The MLP's hidden state for the low-rank kinds with SiLU in the latents (cola, lax): True = CoLA's
    # published form `gate * up` (CoLA's only_lr_act=True, BOOST's both_act=False; the nonlinearity is
    # only the SiLU inside each factor pair); False = `silu(gate) * up` (CoLA's 60M/130M configs, and
    # older boostjax: a run folder whose config.json lacks the field reads it as False, `legacy`).
    # Dense llama and svd (linear latents: `gate * up` would make the MLP a pure quadratic) always use
    # `silu(gate) * up`.
    only_lr_act: bool = option(
        True, "cola/lax MLP hidden state = gate * up, the SiLU only inside each factor pair (CoLA's published "
              "form, BOOST's both_act=False); --no-only-lr-act: silu(gate) * up (CoLA's 60M/130M configs, and "
              "runs of older boostjax, whose config.json lacks the field). llama and svd always use "
              "silu(gate) * up. A resume without this flag keeps the run's stored value",
        resume="follow-stored", legacy=False)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_heads

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """`eos_token_ids` as integers (empty when none)."""
        return tuple(int(x) for x in self.eos_token_ids.split(",") if x.strip())

    @property
    def low_rank(self) -> bool:
        return self.kind in LOW_RANK_KINDS

    def group_shape(self, group: str) -> tuple[int, int]:
        """(in, out) of the dense matrix a projection group stands for: attn q [d, h·e] (o is its
        transpose), kv k/v [d, k·e], mlp gate/up [d, f] (down is its transpose)."""
        out = {"attn": self.n_heads * self.head_dim, "kv": self.kv_heads * self.head_dim, "mlp": self.d_ff}
        return self.d_model, out[group]

    def group_rank(self, group: str) -> int:
        """The rank of a projection group (`PROJECTION_GROUPS`): its override, else `rank`."""
        return getattr(self, f"rank_{group}") or self.rank

    def group_low_rank(self, group: str) -> bool:
        """Whether a projection group is factorised: a low-rank kind, and (with `auto_dense`) rank-r
        factors smaller than the dense matrix, `r (in + out) < in x out`."""
        i, o = self.group_shape(group)
        return self.low_rank and not (self.auto_dense and self.group_rank(group) * (i + o) >= i * o)

    @property
    def group_ranks(self) -> dict[str, int | str]:
        """Each projection group's rank, or "dense" for a group kept dense (what reports print)."""
        return {g: self.group_rank(g) if self.group_low_rank(g) else "dense" for g in PROJECTION_GROUPS}

    @property
    def dense_groups(self) -> tuple[str, ...]:
        """The projection groups of a low-rank kind that stay dense (empty for llama: nothing to report)."""
        return tuple(g for g in PROJECTION_GROUPS if self.low_rank and not self.group_low_rank(g))

    @property
    def gated_silu(self) -> bool:
        """Whether the MLP's hidden state is `silu(gate) * up` (else `gate * up`; see `only_lr_act`)."""
        return not (self.kind in ("cola", "lax") and self.only_lr_act)
