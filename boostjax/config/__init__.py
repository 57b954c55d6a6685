"""Typed configuration: model shapes, training hyperparameters, the device mesh, presets and validation.

Every field is overridable from the CLI (`--d-model 256`, `--lr 3e-4`, ...); a `Literal` field's values
are the flag's choices. What a field is lives here once, as its metadata (`option`): its help text,
its flag (`flag_of`: `--model` for `kind`) and what a resumed run may do with it (`resume_of`); the
CLI (`boostjax.cli.flags`), the run folder's resume check and every message naming a flag read it.
The mesh is parsed once, into a `MeshShape`, when a `TrainConfig` is made. `validate` runs before
anything is compiled and raises `ConfigError` with one line naming the field and the fix; it marks the
config it checked, so a job validates once (`is_validated`).

A leaf: this module imports nothing of boostjax, so every other module may import it. What needs more
than the fields (the data, the hardware profiles, what a placement can run) is checked by
`boostjax.training.checks.validate`, which marks the config it passed (`is_validated`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, get_args


# Each set of names is written once, as a Literal (the field's type; the CLI's choices); the tuples follow.
ModelKind = Literal["llama", "cola", "svd", "lax"]
Attention = Literal["auto", "xla", "cudnn", "chunked"]
RopeType = Literal["default", "linear", "dynamic", "llama3"]
Strategy = Literal["none", "fullrank-tp", "vanilla-tp", "btp"]
Dtype = Literal["float32", "bfloat16"]
DataDtype = Literal["uint16", "uint32"]
Remat = Literal["none", "full", "lowrank"]
Optimizer = Literal["adamw", "rotation", "pipedream-lr", "nesterov", "adam8bit", "muon"]
ZeroStage = Literal[0, 1, 3]
PipelineSchedule = Literal["gpipe", "1f1b"]
# the delays of the asynchronous-pipeline emulation (`boostjax.optim.delay.stage_delays`)
DelaySchedule = Literal["pipedream", "2bw"]
RotSource = Literal["second", "first"]
RotOrder = Literal["previous", "current"]
RotGeometry = Literal["bilateral", "unilateral"]
# what one gradient-clipping norm covers: every parameter, or (an asynchronous pipeline) each stage's own
ClipScope = Literal["global", "stage"]
# what the offload cost model assumes attention keeps (`boostjax plan --attention`, boostjax.offload.blockgraph):
# the [t, t] probabilities, or a fused kernel's per-row log-sum-exp only
AttentionMemory = Literal["materialized", "flash"]
# how --init-from-hf factors a dense projection for a low-rank kind (`boostjax.interop.pretrained`)
InitFactor = Literal["svd", "whitened", "linearised", "refit", "sequential"]
# how `train --rank-budget` turns a share of the projection parameters into ranks (`boostjax.interop.ranks`)
RankPolicy = Literal["uniform", "sensitivity"]
ROPE_TYPES: tuple[str, ...] = get_args(RopeType)
ATTENTION: tuple[str, ...] = get_args(Attention)
MODEL_KINDS: tuple[str, ...] = get_args(ModelKind)
LOW_RANK_KINDS: tuple[str, ...] = ("cola", "svd", "lax")
# projection groups sharing one rank: attn = q and o, kv = k and v, mlp = gate, up and down
PROJECTION_GROUPS: tuple[str, ...] = ("attn", "kv", "mlp")
STRATEGIES: tuple[str, ...] = get_args(Strategy)
TP_STRATEGIES: tuple[str, ...] = tuple(s for s in STRATEGIES if s != "none")  # what `boostjax comm` compares
DTYPES: tuple[str, ...] = get_args(Dtype)
DATA_DTYPES: tuple[str, ...] = get_args(DataDtype)
REMAT: tuple[str, ...] = get_args(Remat)
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
DATA, STAGE, MODEL = "data", "stage", "model"  # the device mesh's axis names: batch rows, pipeline stages, TP
MESH_AXES: tuple[str, ...] = (DATA, STAGE, MODEL)
ZERO_STAGES: tuple[int, ...] = get_args(ZeroStage)
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)
DELAY_SCHEDULES: tuple[str, ...] = get_args(DelaySchedule)
ROT_SOURCES: tuple[str, ...] = get_args(RotSource)
ROT_ORDERS: tuple[str, ...] = get_args(RotOrder)
ROT_GEOMETRIES: tuple[str, ...] = get_args(RotGeometry)
CLIP_SCOPES: tuple[str, ...] = get_args(ClipScope)
# PipeDream-LR's correction outlives the warmup by this factor (the reference: 7 epochs against 3 of warmup)
DELAY_TC_PER_WARMUP: float = 7 / 3
ATTENTION_MEMORY: tuple[str, ...] = get_args(AttentionMemory)
INIT_FACTORS: tuple[str, ...] = get_args(InitFactor)
CALIBRATED_FACTORS: tuple[str, ...] = ("whitened", "linearised", "refit", "sequential")  # read --data
RANK_POLICIES: tuple[str, ...] = get_args(RankPolicy)
DEFAULT_CALIB_TOKENS: int = 32768  # --calib-tokens 0
# Sizes past which a number is a typo, not a run: token positions and ids are int32 in the step, and a
# materialised attention of a longer sequence has more than 2^40 scores per head and sequence.
MAX_SEQ_LEN: int = 1 << 20
MAX_TOKENS: int = (1 << 31) - 1  # batch x seq of one step
MAX_VOCAB: int = 1 << 32  # uint32 token files
MAX_INIT_TIMEOUT: int = 24 * 3600


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the field and the fix."""


# ----------------------------------------------------------------------------- what a field is
# One place says what each ModelConfig / TrainConfig field is: its dataclass metadata (`option`) holds
# the help text (the CLI's --help), the flag (`flag_of`), what a resumed run may do with it
# (`boostjax.runs.folder` derives its sets from `resume_of`) and, for a field added after runs
# existed, the value a config.json without it means (`legacy`).

# What a resumed run (`boostjax.runs.folder.RunFolder.check_resume`) may do with a field:
# - fixed: refused when it differs from the stored value (the checkpoint's shapes, the data order or
#   the optimizer state's meaning depend on it);
# - mutable: may change; the change is recorded in config_history.jsonl;
# - ignored: may change and is not recorded (where the run is, how a process finds its job);
# - follow-stored: fixed, and a `boostjax train` resume that does not give the flag keeps the run's
#   stored value (the field's default or preset value changed after runs were written).
Resume = Literal["fixed", "mutable", "ignored", "follow-stored"]
RESUME_POLICIES: tuple[str, ...] = get_args(Resume)
_NO_LEGACY = object()


def option(default: Any, help: str, *, resume: Resume = "fixed", flag: str = "",
           legacy: Any = _NO_LEGACY) -> Any:
    """A config field with its metadata: `help` (one or more clauses, no trailing default: the CLI adds
    it), `resume` (a `Resume` policy), `flag` (the command-line flag when it is not `--` + the name with
    dashes) and `legacy` (the value a stored config.json that lacks the field means)."""
    if resume not in RESUME_POLICIES:
        raise ValueError(f"option: resume={resume!r}; fix: one of {', '.join(RESUME_POLICIES)}")
    if not help.strip():
        raise ValueError("option: every field needs its help text; fix: say what the field is")
    meta: dict[str, Any] = {"help": help, "resume": resume}
    if flag:
        meta["flag"] = flag
    if legacy is not _NO_LEGACY:
        meta["legacy"] = legacy
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class MeshShape:
    """The sizes of the device mesh's axes: `data` (batch rows), `stage` (pipeline stages), `model` (TP)."""

    data: int = 1
    stage: int = 1
    model: int = 1

    @classmethod
    def parse(cls, text: str, field: str = "train.mesh") -> "MeshShape | None":
        """'data=2,model=4' -> MeshShape(2, 1, 4); '' -> None (one device, no mesh). Errors name `field`."""
        if not isinstance(text, str):
            raise ConfigError(f"{field}: must be a string like 'data=2,model=4', got {text!r}; "
                              f"fix: pass e.g. {flag_of('mesh')} data=2,model=4")
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            axis, sep, size = (x.strip() for x in part.partition("="))
            if not sep or not (size.isascii() and size.isdigit()) or int(size) < 1:
                raise ConfigError(f"{field}: cannot read {part!r}; fix: write it like data=2,model=4 (sizes >= 1)")
            if axis not in MESH_AXES:
                raise ConfigError(f"{field}: unknown axis {axis!r}; fix: use the axes data, stage and model")
            if axis in sizes:
                raise ConfigError(f"{field}: axis {axis!r} appears twice in {text!r}; fix: give each axis once, "
                                  "e.g. data=4,model=2")
            sizes[axis] = int(size)
        return cls(**sizes) if sizes else None

    def __str__(self) -> str:
        """The canonical text: `data=2,model=4`, or `data=2,stage=2,model=2` (stage shown when > 1)."""
        return ",".join(f"{axis}={getattr(self, axis)}" for axis in self.axes)

    @property
    def devices(self) -> int:
        return self.data * self.stage * self.model

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's axis names: `("data", "model")`, or `("data", "stage", "model")` when stage > 1."""
        return MESH_AXES if self.stage > 1 else (DATA, MODEL)


def as_mesh(value: "MeshShape | str | None", field: str = "train.mesh") -> MeshShape | None:
    """A mesh given as a MeshShape, None or its text (parsed here: the one place a mesh string is read)."""
    if value is None or isinstance(value, MeshShape):
        return value
    return MeshShape.parse(value, field)


def mesh_text(mesh: MeshShape | None) -> str:
    """The text of a mesh as config.json and `--mesh` write it ('' = one device, no mesh)."""
    return "" if mesh is None else str(mesh)


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


@dataclass(frozen=True)
class TrainConfig:
    """Everything `boostjax train` needs besides the model shapes.

    Each field's help text, command-line flag and resume policy are its metadata (`option`)."""

    steps: int = option(600, "optimizer steps of the whole run (a resumed run may raise it)", resume="mutable")
    batch: int = option(16, "sequences (rows) per optimizer step, over all devices (per micro-batch with "
                            "--grad-accum)")
    seq: int = option(128, "tokens per sequence; at most the model's max_seq_len")
    seed: int = option(0, "seed of the parameter init and of the data order (batch k is a pure function of "
                          "the seed and k)")
    lr: float = option(3e-3, "peak learning rate (after warmup; cosine decay to min_lr_ratio x lr at the last "
                             "step)", resume="mutable")
    min_lr_ratio: float = option(0.1, "final learning rate of the cosine decay, as a fraction of --lr, in [0, 1]",
                                 resume="mutable")
    warmup: int = option(-1, "linear warmup steps from 0 to --lr; -1 = 5 % of the run (steps // 20)",
                         resume="mutable")
    weight_decay: float = option(0.01, "decoupled (AdamW-style) weight decay", resume="mutable")
    b1: float = option(0.9, "Adam beta1: EMA factor of the first moment, in [0, 1)", resume="mutable")
    b2: float = option(0.95, "Adam beta2: EMA factor of the second moment, in [0, 1)", resume="mutable")
    clip: float = option(1.0, "gradient clipping threshold (global norm, or each stage's with --clip-scope "
                              "stage); 0 disables it", resume="mutable")
    clip_scope: ClipScope = option("global", "what one clipping norm covers: global (every parameter) or stage "
                                             "(with --pipeline-delay: each stage clips its own parameters, as "
                                             "every device of an asynchronous pipeline does; not with --optimizer "
                                             "adam8bit)", resume="mutable")
    dtype: Dtype = option("float32", "compute dtype; parameters and optimizer state stay fp32", resume="mutable")
    out: str = option("runs/default", "run folder (config.json, metrics.jsonl, checkpoints/); an existing run "
                                      "there is resumed", resume="ignored")
    data: str = option("", "corpus: '' = this Python's standard library sources; a folder written by boostjax "
                           "tokenize (its meta.json gives the dtype and, without --vocab-size, the vocabulary), a "
                           ".bin token file, a text file or a folder of text files; tokenised folders mixed by weight: "
                           "A:0.7,B:0.3 (A,B: equal weights; docs/data.md, Mixtures)")
    data_dtype: DataDtype = option("uint16", "with a .bin token file as --data: its element type")
    ckpt_every: int = option(100, "save a checkpoint every N steps (and at the last step)", resume="mutable")
    keep_ckpts: int = option(3, "checkpoints kept in OUT/checkpoints/ (older ones are deleted)", resume="mutable")
    log_every: int = option(10, "write a metrics.jsonl record (loss, grad_norm, lr, throughput) every N steps",
                            resume="mutable")
    eval_every: int = option(100, "validation loss every N steps (and at the last step)", resume="mutable")
    eval_batches: int = option(4, "held-out batches averaged for each validation loss", resume="mutable")
    eval_at_start: bool = option(False, "validation loss at step 0 too, before the first update (the 'before' of a "
                                        "fine-tune; a resumed run does not repeat it)", resume="mutable")
    # distillation (boostjax.training.distill): loss = W T^2 KL(teacher || student at temperature T) + (1 - W) CE
    distill_from: str = option("", "train on KL to a frozen teacher's logits: a Hugging Face LLaMA folder, a Llama "
                                   ".gguf file or a boostjax run folder (its newest checkpoint) of the student's "
                                   "vocabulary and the data's tokenizer; '' = no teacher")
    distill_temperature: float = option(1.0, "with --distill-from: temperature T of both softmaxes in the KL term "
                                             "(the term is scaled by T^2); > 0", resume="mutable")
    distill_weight: float = option(0.5, "with --distill-from: W, the KL term's share of the loss (1 - W on the "
                                        "cross-entropy to the data), in [0, 1]", resume="mutable")
    strategy: Strategy = option("none", "tensor-parallel strategy over the mesh's model axis: none, fullrank-tp "
                                        "(Megatron, llama only), vanilla-tp (low-rank factors split along r), "
                                        "btp (BOOST's bottleneck TP, low-rank kinds); all but none need --mesh",
                                resume="mutable")
    # "data=D,stage=P,model=T" or a MeshShape (parsed in __post_init__); None (or "") = one device, no mesh
    mesh: MeshShape | None = option(None, "device mesh, e.g. data=2,stage=2,model=4 ('' = one device, no mesh; "
                                          "CPU devices are simulated as needed); a model axis > 1 needs --strategy",
                                    resume="mutable")
    microbatches: int = option(0, "pipeline micro-batches per data shard; needs stage=P (P >= 2) in --mesh (0 = "
                                  "auto: the largest divisor of the shard's batch that is <= 4 x stages; see "
                                  "boostjax.sharding.pipeline)", resume="mutable")
    grad_accum: int = option(1, "micro-batches of --batch rows per optimizer step (a lax.scan sums their "
                                "gradients); the effective batch is batch x grad_accum; not with --offload-plan")
    zero: ZeroStage = option(0, "data-parallel state sharding (ZeRO) over the --mesh data axis: 0 replicated, 1 "
                                "optimizer state split over data, 3 parameters too; not with --offload-plan",
                             resume="mutable")
    pipeline_schedule: PipelineSchedule = option(
        "gpipe", "pipeline schedule; needs stage=P (P >= 2) in --mesh: gpipe (all forwards, then all backwards; "
                 "activations of every micro-batch) or 1f1b (one forward, one backward; activations of about "
                 "2 x stages micro-batches, not M + P - 1); the same bubble (P-1)/(M+P-1)", resume="mutable")
    remat: Remat = option("none", "rematerialisation: none, full (recompute each block in the backward), "
                                  "lowrank (keep the r-dim latents, recompute the rest; no collective "
                                  "recomputed)", resume="mutable")
    optimizer: Optimizer = option(
        "adamw", "optimizer: adamw (optax AdamW; PipeDream under --pipeline-delay), rotation (Adam in a rotated "
                 "Kronecker eigenbasis), pipedream-lr (AdamW, update scaled down by the stage delay), nesterov "
                 "(torch NAdam), adam8bit (AdamW with block-wise 8-bit moments and fused clipping), muon (Muon on "
                 "the hidden matrices, update RMS matched to AdamW's so --lr carries over; AdamW on embeddings, "
                 "head and vectors)")
    pipeline_delay: int = option(1, "emulate an asynchronous pipeline of S stages (PipeDream's weight "
                                    "stashing): stage s takes its gradient at weights S-1-s updates old; stages "
                                    "are contiguous layer groups (1 = no delay)")
    delay_schedule: DelaySchedule = option(
        "pipedream", "with --pipeline-delay S > 1, the stages' delays: pipedream (stage s is S-1-s updates "
                     "behind) or 2bw (PipeDream-2BW: every stage one update behind whatever S; double-buffered "
                     "weights)")
    rot_source: RotSource = option("second", "with --optimizer rotation: the basis from the second moment (EMA of "
                                             "G G^T / G^T G) or the first (the momentum's singular vectors)")
    rot_geometry: RotGeometry = option("bilateral", "with --optimizer rotation: rotate both sides of each matrix, "
                                                    "or only the smaller one (unilateral)")
    rot_refresh: int = option(10, "with --optimizer rotation: refresh the basis every T steps", resume="mutable")
    rot_beta: float = option(0.95, "with --optimizer rotation: EMA factor of G G^T / G^T G (SOAP's 0.95: the basis "
                                   "must follow the current curvature)", resume="mutable")
    rot_max_dim: int = option(4096, "with --optimizer rotation: a matrix side larger than this is not rotated")
    rot_order: RotOrder = option(
        "previous", "with --optimizer rotation: 'previous' projects G_t on bases built from earlier gradients "
                    "(SOAP); 'current' updates the Gram EMA with G_t, refreshes if due (step 1, every rot_refresh "
                    "steps), then projects (the basis-rotation reference code)")
    rot_damping: float = option(4.0, "with --optimizer rotation: the refreshes iterate on the Gram statistic plus "
                                     "this times its mean eigenvalue (bases far less sensitive to rounding, so a "
                                     "mesh run follows one device); 0 = the paper's exact eigh and undamped power "
                                     "steps", resume="follow-stored", legacy=0.0)
    stage_aware_refresh: bool = option(False, "with --optimizer rotation and --pipeline-delay: stages with a "
                                              "larger delay refresh their basis more often", resume="mutable")
    delay_lr_tc: int = option(0, "with --optimizer pipedream-lr: steps T_c until the delay-scaled learning rate "
                                 "reaches lr; 0 = 7/3 of the warmup (the reference: 7 epochs of correction, 3 of "
                                 "warmup)", resume="follow-stored")
    nesterov_psi: float = option(-1.0, "with --optimizer nesterov: torch NAdam's momentum_decay psi (mu_t = b1 (1 - "
                                       "0.96^(psi t) / 2)); -1 = scaled to the run so mu_t reaches 0.9 at 4 % of "
                                       "--steps, as torch's 0.004 does in the reference's ~250k-step run",
                                 resume="follow-stored", legacy=0.004)
    offload_plan: str = option("", "plan.json from boostjax plan (made with this run's flags): per-layer "
                                   "remat/offload policies, host-resident parameters and optimizer states; not "
                                   "with --grad-accum or --zero; '' = none", resume="mutable")
    progress: bool = option(True, "progress bars on stderr (--no-progress: none, e.g. in log files)",
                            resume="ignored")
    # multi-host (boostjax.runtime.multihost): all three, or none to read BOOSTJAX_* or a scheduler's variables
    coordinator: str = option("", "multi-host, with --num-processes and --process-id (all three or none): "
                                  "HOST:PORT of process 0's coordination service ('' = from BOOSTJAX_COORDINATOR "
                                  "or a SLURM / mpiexec / Kubernetes job)", resume="ignored")
    num_processes: int = option(0, "multi-host, with --coordinator, --process-id and a --mesh over every "
                                   "process's devices: processes in the job (0 = from the environment, 1 process "
                                   "if none; 1 = force one)", resume="ignored")
    process_id: int = option(-1, "multi-host, with --coordinator and --num-processes: this process's index, "
                                 "0..num_processes-1 (-1 = from the environment)", resume="ignored")
    init_timeout: int = option(300, "multi-host: seconds a process waits for the whole job to join before it "
                                    "gives up", resume="mutable")
    # observability (boostjax.training.observe): what a run shows, not what it computes
    tensorboard: bool = option(True, "write TensorBoard event files (the metrics.jsonl scalars) into "
                                     "OUT/tensorboard/ (process 0)", resume="mutable")
    profile: str = option("", "START:STOP: a jax.profiler trace of steps START..STOP-1 (0-based) into "
                              "OUT/profile/ ('' = none)", resume="mutable")
    hardware: str = option("", "hardware profile for the MFU metric (peak BF16 FLOP/s per device), a name or "
                               "alias of boostjax.runtime.profiles, e.g. H800-80GB, A100-80GB, RTX3090-24GB; '' = "
                               "detect from the device (none on a CPU)", resume="mutable")
    # documents: batches carry segment ids and attention never crosses a document boundary
    doc_mask: bool = option(False, "mask attention at document boundaries: packed documents carry a document id "
                                   "per token and a token attends only to its own document (needs --data with "
                                   "documents: the built-in corpus, a folder or a tokenised folder; not with "
                                   "--attention cudnn or a stage axis in --mesh)")
    # boostjax.interop.pretrained: a Hugging Face LLaMA folder a new run starts from ("" = random init)
    init_from_hf: str = option("", "start a new run from a Hugging Face LLaMA folder or a Llama .gguf file "
                                   "(needs boostjax[gguf]) (its shapes; --model "
                                   "svd/cola/lax --rank r factors each projection by truncated SVD, or see "
                                   "--init-factor; init_report.json holds the errors); '' = random init")
    init_factor: InitFactor = option(
        "svd", "with --init-from-hf: how a low-rank --model factors the pretrained weights: svd (truncated SVD of each "
               "weight), whitened (SVD-LLM's truncation-aware whitening: the truncation that least changes each "
               "projection's output on the model's own activations on --calib-tokens tokens of --data; cola at "
               "half its rank), linearised (whitened at the full rank; cola through SiLU's small-signal "
               "linearisation), refit (linearised, then each B refitted by ridge least squares on the real "
               "activations) or sequential (refit, each layer on the inputs the already factored layers below "
               "produce); all but svd need --data")
    calib_tokens: int = option(
        0, f"needs --init-factor whitened: the tokens at the start of --data's training split whose activations the "
           f"factors are fitted to; 0 = {DEFAULT_CALIB_TOKENS} (or the whole split when it is shorter); "
           "--init-factor svd reads none")
    rank_budget: float = option(
        0.0, "with --init-from-hf and a low-rank --model: the share F of the dense projection parameters the "
             "factors may hold (0 < F < 1), turned into --rank-attn/--rank-kv/--rank-mlp by --rank-policy; "
             "0 = the ranks are given")
    rank_policy: RankPolicy = option(
        "uniform", "how --rank-budget becomes ranks: uniform (one rank for every group, the largest that fits; a "
                   "group whose factors would not be smaller stays dense) or sensitivity (per group, the ranks "
                   "that least raise the whitened truncation loss, measured on --calib-tokens tokens of --data)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh", as_mesh(self.mesh))  # the one parse of a mesh string

    @property
    def sizes(self) -> MeshShape:
        """The mesh's axis sizes; all ones for one device (`mesh` None)."""
        return self.mesh or MeshShape()


CONFIG_CLASSES: tuple[type, ...] = (ModelConfig, TrainConfig)
_FIELDS: dict[str, dataclasses.Field] = {f.name: f for cls in CONFIG_CLASSES for f in fields(cls)}
DEFAULT_PRESET = "tiny"  # the model shapes `boostjax train` (and every command sharing its flags) starts from


def config_field(name: str) -> dataclasses.Field:
    """The ModelConfig or TrainConfig field `name` (the two share no name: one flag each)."""
    try:
        return _FIELDS[name]
    except KeyError:
        raise ValueError(f"config_field: no ModelConfig or TrainConfig field {name!r}; fix: use one of "
                         f"{', '.join(_FIELDS)}") from None


def flag_of(name: str) -> str:
    """The command-line flag of a ModelConfig / TrainConfig field: `flag_of("kind") == "--model"`,
    `flag_of("d_model") == "--d-model"`. Every message that names a field's flag asks here."""
    return config_field(name).metadata.get("flag") or "--" + name.replace("_", "-")


def negated_flag_of(name: str) -> str:
    """The `--no-...` flag that sets a boolean field to False."""
    return "--no-" + flag_of(name)[2:]


def help_of(name: str) -> str:
    """The help text of a ModelConfig / TrainConfig field (without its default)."""
    return config_field(name).metadata["help"]


def resume_of(name: str) -> str:
    """What a resumed run may do with the field: one of `RESUME_POLICIES`."""
    return config_field(name).metadata["resume"]


def fields_with(cls: type, *policies: str) -> frozenset[str]:
    """The names of `cls`'s fields whose resume policy is one of `policies`."""
    return frozenset(f.name for f in fields(cls) if f.metadata["resume"] in policies)


def legacy_values(cls: type) -> dict[str, Any]:
    """{field: the value a stored config.json without it means} for the fields added after runs existed."""
    return {f.name: f.metadata["legacy"] for f in fields(cls) if "legacy" in f.metadata}


def field_default(name: str) -> Any:
    """The default of a field as the command line writes it (the mesh as its text)."""
    f = config_field(name)
    return mesh_text(f.default) if name == "mesh" else f.default


def warmup_steps(t: TrainConfig) -> int:
    return t.warmup if t.warmup >= 0 else t.steps // 20


def delay_lr_tc_steps(t: TrainConfig) -> int:
    """PipeDream-LR's T_c: `--delay-lr-tc`, or (0) 7/3 of the warmup, at least 1 step."""
    return t.delay_lr_tc if t.delay_lr_tc > 0 else max(1, round(DELAY_TC_PER_WARMUP * warmup_steps(t)))


def nesterov_psi(t: TrainConfig, b1: float = 0.99, mu: float = 0.9, at: float = 0.04) -> float:
    """torch NAdam's momentum_decay: `--nesterov-psi`, or (-1) the psi with which mu_t = b1 (1 - 0.96^(psi t)
    / 2) reaches `mu` at `at` x steps (torch's 0.004 reaches 0.9 at step ~10.4k, 4 % of a 250k-step run)."""
    if t.nesterov_psi >= 0:
        return t.nesterov_psi
    return math.log(2 * (1 - mu / b1)) / (math.log(0.96) * max(1.0, at * t.steps))


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: the mesh as its text (config.json), '' for one device."""
        d = dataclasses.asdict(self)
        d["train"]["mesh"] = mesh_text(self.train.mesh)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        return cls(model=ModelConfig(**d.get("model", {})), train=TrainConfig(**d.get("train", {})))


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


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _check_types(obj: Any, prefix: str) -> None:
    """Every field holds its declared type (the Python API takes any object; the CLI parses flags).
    Floats must be finite: NaN slips through every comparison, and inf is never a setting."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        v, kind, flag = getattr(obj, f.name), hints[f.name], flag_of(f.name)
        if kind is bool:
            _need(isinstance(v, bool), f"{prefix}.{f.name}: must be true or false, got {v!r}; fix: pass {flag} "
                                       f"or {negated_flag_of(f.name)}")
        elif kind is int:
            _need(isinstance(v, int) and not isinstance(v, bool),
                  f"{prefix}.{f.name}: must be an integer, got {v!r}; fix: pass {flag} N")
        elif kind is float:
            _need(isinstance(v, (int, float)) and not isinstance(v, bool),
                  f"{prefix}.{f.name}: must be a number, got {v!r}; fix: pass {flag} X")
            _need(math.isfinite(v), f"{prefix}.{f.name}: must be a finite number, got {v}; "
                                    f"fix: pass {flag} with a finite value (default {f.default!r})")
        elif f.name == "mesh":  # a MeshShape or None (the constructor parsed a string); its sizes positive ints
            bad = v is not None and not all(type(getattr(v, a)) is int and getattr(v, a) >= 1 for a in MESH_AXES)
            _need(not bad, f"{prefix}.mesh: {v!r} has a size that is not an integer >= 1; "
                           f"fix: pass e.g. {flag} data=2,model=4 or MeshShape(data=2, model=4)")
        elif typing.get_origin(kind) is Literal and all(isinstance(x, int) for x in get_args(kind)):
            _need(isinstance(v, int) and not isinstance(v, bool),
                  f"{prefix}.{f.name}: must be an integer, got {v!r}; fix: pass {flag} N")
        else:  # str and Literal[str, ...]
            _need(isinstance(v, str), f"{prefix}.{f.name}: must be a string, got {v!r}; fix: pass {flag} TEXT")


def validate_model(m: ModelConfig) -> None:
    _need(isinstance(m, ModelConfig), f"model: need a ModelConfig, got {type(m).__name__}; fix: pass ModelConfig(...)")
    _check_types(m, "model")
    _need(m.kind in MODEL_KINDS, f"model.kind: unknown kind {m.kind!r}; fix: pass {flag_of('kind')} with one of "
                                 f"{', '.join(MODEL_KINDS)}")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "rank", "max_seq_len"):
        v = getattr(m, name)
        _need(v > 0, f"model.{name}: must be positive, got {v}; fix: pass {flag_of(name)} N with N >= 1")
    _need(m.vocab_size <= MAX_VOCAB, f"model.vocab_size: {m.vocab_size} exceeds {MAX_VOCAB} (uint32 token ids); "
                                     f"fix: pass {flag_of('vocab_size')} <= {MAX_VOCAB}")
    _need(m.max_seq_len <= MAX_SEQ_LEN, f"model.max_seq_len: {m.max_seq_len} exceeds {MAX_SEQ_LEN}; "
                                        f"fix: pass {flag_of('max_seq_len')} <= {MAX_SEQ_LEN}")
    _need(m.n_kv_heads >= 0, f"model.n_kv_heads: must be >= 0, got {m.n_kv_heads}; fix: pass {flag_of('n_kv_heads')} "
                             "0 (= n_heads) or a divisor of n_heads")
    _need(m.attn_head_dim >= 0, f"model.attn_head_dim: must be >= 0 (0 = d_model / n_heads), got {m.attn_head_dim}; "
                                f"fix: pass {flag_of('attn_head_dim')} 0 or an even width")
    _need(m.attn_head_dim > 0 or m.d_model % m.n_heads == 0,
          f"model.d_model: {m.d_model} is not divisible by n_heads={m.n_heads}; fix: choose d_model a multiple of "
          f"n_heads, or pass {flag_of('attn_head_dim')}")
    _need(m.head_dim % 2 == 0, f"model.{'attn_head_dim' if m.attn_head_dim else 'd_model'}: head_dim={m.head_dim} "
                               f"must be even for RoPE; fix: make the head width ({flag_of('attn_head_dim')}, or "
                               "d_model/n_heads) even")
    _need(m.n_heads % m.kv_heads == 0,
          f"model.n_kv_heads: n_heads={m.n_heads} is not divisible by n_kv_heads={m.kv_heads}; fix: pass "
          f"{flag_of('n_kv_heads')} with a divisor of n_heads")
    _validate_ranks(m)
    _need(m.rope_theta > 1, f"model.rope_theta: must be > 1 (RoPE's frequencies theta^(-2i/d) must fall), "
                            f"got {m.rope_theta}; fix: pass e.g. {flag_of('rope_theta')} 10000")
    _need(0 < m.norm_eps < 1, f"model.norm_eps: must lie in (0, 1), got {m.norm_eps}; fix: pass e.g. "
                              f"{flag_of('norm_eps')} 1e-5")
    _need(m.init_std > 0, f"model.init_std: must be positive, got {m.init_std}; fix: pass e.g. "
                          f"{flag_of('init_std')} 0.02")
    _need(m.attention in ATTENTION, f"model.attention: unknown attention {m.attention!r}; "
                                    f"fix: pass {flag_of('attention')} with one of {', '.join(ATTENTION)}")
    _need(1 <= m.attention_block <= MAX_SEQ_LEN, f"model.attention_block: must lie in [1, {MAX_SEQ_LEN}], got "
                                                 f"{m.attention_block}; fix: pass e.g. "
                                                 f"{flag_of('attention_block')} 512")
    _validate_rope_scaling(m)
    _validate_token_ids(m)


def _validate_ranks(m: ModelConfig) -> None:
    """Group ranks: overrides >= 0; a factorised group's rank at most min(in, out) (with `auto_dense`
    a group that would exceed it stays dense instead); LaX's crossings need its latents at one width."""
    for g in PROJECTION_GROUPS:
        name = f"rank_{g}"
        v = getattr(m, name)
        _need(v >= 0, f"model.{name}: must be >= 0 (0 = {flag_of('rank')}), got {v}; fix: pass {flag_of(name)} N "
                      f"with N >= 1, or drop it")
    if not m.low_rank:
        return
    for g in PROJECTION_GROUPS:
        i, o = m.group_shape(g)
        r, name = m.group_rank(g), f"rank_{g}" if getattr(m, f"rank_{g}") else "rank"
        _need(not m.group_low_rank(g) or r <= min(i, o),
              f"model.{name}: r={r} exceeds min(in, out)={min(i, o)} of the {g} projections [{i}, {o}]; fix: pass "
              f"{flag_of(name)} <= {min(i, o)}, or drop {negated_flag_of('auto_dense')} to keep them dense")
    if m.auto_dense and len(m.dense_groups) == len(PROJECTION_GROUPS):
        most = max(PROJECTION_GROUPS, key=lambda g: _break_even(m, g))
        _need(False, f"model.rank: at these ranks no projection's factors are smaller than its dense matrix, so "
                     f"every projection would stay dense; fix: pass {flag_of('rank')} below "
                     f"{_break_even(m, most)} (the {most} projections' break-even), or {flag_of('kind')} llama")
    attn, kv = m.group_low_rank("attn"), m.group_low_rank("kv")
    _need(m.kind != "lax" or attn == kv and (not attn or m.group_rank("attn") == m.group_rank("kv")),
          f"model.rank_kv: LaX crosses the q, k, v and o latents, so they need one width, but q/o are "
          f"{'rank ' + str(m.group_rank('attn')) if attn else 'dense'} and k/v "
          f"{'rank ' + str(m.group_rank('kv')) if kv else 'dense'}; fix: pass {flag_of('rank_kv')} equal to the "
          f"q/o rank (below k/v's break-even), or --model cola")


def _break_even(m: ModelConfig, group: str) -> int:
    """The smallest rank at which a group's factors hold as many parameters as its dense matrix."""
    i, o = m.group_shape(group)
    return -(-i * o // (i + o))


def _validate_rope_scaling(m: ModelConfig) -> None:
    """RoPE scaling fields: a known type, and factors that type reads."""
    _need(m.rope_type in ROPE_TYPES, f"model.rope_type: unknown RoPE type {m.rope_type!r}; "
                                     f"fix: pass {flag_of('rope_type')} with one of {', '.join(ROPE_TYPES)}")
    _need(m.rope_factor >= 1, f"model.rope_factor: must be >= 1 (it stretches the context), got {m.rope_factor}; "
                              f"fix: pass e.g. {flag_of('rope_factor')} 8 (1 = no scaling)")
    _need(m.rope_type != "default" or m.rope_factor == 1,
          f"model.rope_factor: {m.rope_factor} has no effect with rope_type default; "
          f"fix: pass {flag_of('rope_type')} linear, dynamic or llama3, or drop {flag_of('rope_factor')}")
    _need(m.rope_type != "dynamic" or m.head_dim > 2, f"model.rope_type: dynamic NTK scaling needs head_dim > 2, got "
                                                      f"{m.head_dim}; fix: pass {flag_of('rope_type')} linear or a "
                                                      "wider head")
    _need(m.rope_original_max_len >= 0, f"model.rope_original_max_len: must be >= 0 (0 = max_seq_len), got "
                                        f"{m.rope_original_max_len}; fix: pass e.g. "
                                        f"{flag_of('rope_original_max_len')} 8192")
    if m.rope_type == "llama3":
        lo, hi = m.rope_low_freq_factor, m.rope_high_freq_factor
        _need(0 < lo < hi, f"model.rope_high_freq_factor: llama3 needs 0 < low_freq_factor < high_freq_factor, got "
                           f"{lo} and {hi}; fix: pass e.g. {flag_of('rope_low_freq_factor')} 1 "
                           f"{flag_of('rope_high_freq_factor')} 4")


def _validate_token_ids(m: ModelConfig) -> None:
    """Special token ids: -1 (none) or an id of the vocabulary."""
    for name in ("bos_token_id", "pad_token_id"):
        v = getattr(m, name)
        _need(-1 <= v < m.vocab_size, f"model.{name}: {v} is not a token id of the {m.vocab_size}-token vocabulary "
                                      f"(-1 = none); fix: pass {flag_of(name)} in [0, {m.vocab_size}) or -1")
    parts = [x.strip() for x in m.eos_token_ids.split(",")] if m.eos_token_ids.strip() else []
    ok = all(x.isascii() and x.isdigit() and int(x) < m.vocab_size for x in parts)
    flag = flag_of("eos_token_ids")
    _need(ok, f"model.eos_token_ids: {m.eos_token_ids!r} is not a comma-separated list of token ids below "
              f"vocab_size={m.vocab_size}; fix: pass e.g. {flag} 2 or {flag} 128001,128009 ('' = none)")


def validate_train(t: TrainConfig, m: ModelConfig) -> None:
    _need(isinstance(t, TrainConfig), f"train: need a TrainConfig, got {type(t).__name__}; fix: pass TrainConfig(...)")
    _check_types(t, "train")
    for name in ("steps", "batch", "seq", "ckpt_every", "keep_ckpts", "log_every", "eval_every", "eval_batches"):
        v = getattr(t, name)
        _need(v > 0, f"train.{name}: must be positive, got {v}; fix: pass {flag_of(name)} N with N >= 1")
    _need(t.batch * t.seq <= MAX_TOKENS, f"train.batch: batch x seq = {t.batch} x {t.seq} tokens exceeds {MAX_TOKENS} "
                                         f"(int32 positions); fix: lower {flag_of('batch')} or {flag_of('seq')}")
    _validate_accum_zero(t)
    _need(0 <= t.seed < 1 << 63, f"train.seed: must lie in [0, 2^63), got {t.seed}; fix: pass {flag_of('seed')} N "
                                 "with N >= 0")
    _need(bool(t.out.strip()) and "\0" not in t.out,
          f"train.out: {t.out!r} is not a folder name (an empty one would write into the current folder); "
          f"fix: pass {flag_of('out')} runs/NAME")
    _need(t.lr > 0, f"train.lr: must be positive, got {t.lr}; fix: pass e.g. {flag_of('lr')} 1e-3")
    _need(t.warmup == -1 or 0 <= t.warmup < t.steps,
          f"train.warmup: {t.warmup} must lie in [0, steps={t.steps}) or be -1 (5 % of steps); "
          f"fix: lower {flag_of('warmup')}")
    _need(0.0 <= t.min_lr_ratio <= 1.0, f"train.min_lr_ratio: {t.min_lr_ratio} outside [0, 1]; fix: pass e.g. "
                                        f"{flag_of('min_lr_ratio')} 0.1")
    _need(0.0 <= t.b1 < 1.0, f"train.b1: {t.b1} outside [0, 1); fix: pass e.g. {flag_of('b1')} 0.9")
    _need(0.0 <= t.b2 < 1.0, f"train.b2: {t.b2} outside [0, 1); fix: pass e.g. {flag_of('b2')} 0.95")
    _need(t.clip >= 0, f"train.clip: must be >= 0 (0 disables), got {t.clip}; fix: pass e.g. {flag_of('clip')} 1.0")
    _need(t.weight_decay >= 0, f"train.weight_decay: must be >= 0, got {t.weight_decay}; fix: pass e.g. "
                               f"{flag_of('weight_decay')} 0.01")
    _need(t.dtype in DTYPES, f"train.dtype: unknown dtype {t.dtype!r}; fix: pass {flag_of('dtype')} with one of "
                             f"{', '.join(DTYPES)}")
    _need(t.data_dtype in DATA_DTYPES, f"train.data_dtype: {t.data_dtype!r}; fix: pass {flag_of('data_dtype')} "
                                       f"{' or '.join(DATA_DTYPES)}")
    _need(m.attention != "cudnn" or t.dtype != "float32",
          "model.attention: cudnn runs in bfloat16/float16 and the compute dtype is float32; "
          f"fix: pass {flag_of('dtype')} bfloat16 or {flag_of('attention')} chunked")
    _need(t.seq <= m.max_seq_len, f"train.seq: {t.seq} exceeds model.max_seq_len={m.max_seq_len}; fix: lower "
                                  f"{flag_of('seq')} or raise {flag_of('max_seq_len')}")
    _need(t.strategy in STRATEGIES, f"train.strategy: unknown strategy {t.strategy!r}; fix: pass "
                                    f"{flag_of('strategy')} with one of {', '.join(STRATEGIES)}")
    _need(t.remat in REMAT, f"train.remat: unknown remat {t.remat!r}; fix: pass {flag_of('remat')} with one of "
                            f"{', '.join(REMAT)}")
    _need(t.optimizer in OPTIMIZERS,
          f"train.optimizer: unknown optimizer {t.optimizer!r}; fix: pass {flag_of('optimizer')} with one of "
          f"{', '.join(OPTIMIZERS)}")
    _need(t.pipeline_delay >= 1, f"train.pipeline_delay: must be >= 1, got {t.pipeline_delay}; fix: pass "
                                 f"{flag_of('pipeline_delay')} S >= 1")
    _need(m.n_layers % t.pipeline_delay == 0,
          f"train.pipeline_delay: {t.pipeline_delay} stages do not divide n_layers={m.n_layers}; "
          f"fix: pass {flag_of('pipeline_delay')} with a divisor of {m.n_layers}")
    _validate_delay_schedule(t)
    _need(t.rot_source in ROT_SOURCES, f"train.rot_source: {t.rot_source!r}; fix: pass {flag_of('rot_source')} "
                                       f"{' or '.join(ROT_SOURCES)}")
    _need(t.rot_geometry in ROT_GEOMETRIES,
          f"train.rot_geometry: {t.rot_geometry!r}; fix: pass {flag_of('rot_geometry')} {' or '.join(ROT_GEOMETRIES)}")
    _need(t.rot_order in ROT_ORDERS, f"train.rot_order: {t.rot_order!r}; fix: pass {flag_of('rot_order')} "
                                     f"{' or '.join(ROT_ORDERS)}")
    _need(t.rot_order == "previous" or t.rot_source == "second",
          f"train.rot_order: 'current' needs rot_source 'second' (got {t.rot_source!r}); "
          f"fix: pass {flag_of('rot_source')} second or {flag_of('rot_order')} previous")
    for name in ("rot_refresh", "rot_max_dim"):
        v = getattr(t, name)
        _need(v > 0, f"train.{name}: must be positive, got {v}; fix: pass {flag_of(name)} N with N >= 1")
    _need(t.delay_lr_tc >= 0, f"train.delay_lr_tc: must be >= 0 (0 = 7/3 of the warmup), got {t.delay_lr_tc}; "
                              f"fix: pass {flag_of('delay_lr_tc')} 0 or N >= 1")
    _need(t.nesterov_psi == -1 or 0 <= t.nesterov_psi < 1e3,
          f"train.nesterov_psi: {t.nesterov_psi} must be -1 (scaled to the run) or in [0, 1000); fix: pass "
          f"{flag_of('nesterov_psi')} -1 or e.g. 0.004")
    _need(t.clip_scope in CLIP_SCOPES, f"train.clip_scope: {t.clip_scope!r}; fix: pass {flag_of('clip_scope')} "
                                       f"{' or '.join(CLIP_SCOPES)}")
    _need(t.clip_scope == "global" or t.optimizer != "adam8bit",
          f"train.clip_scope: 'stage' with adam8bit, whose clipping is fused and global; fix: pass "
          f"{flag_of('clip_scope')} global or another {flag_of('optimizer')}")
    _need(math.isfinite(t.rot_damping) and t.rot_damping >= 0,
          f"train.rot_damping: {t.rot_damping} must be finite and >= 0; fix: pass {flag_of('rot_damping')} 4.0 "
          "(0 = exact eigh)")
    _need(0.0 <= t.rot_beta < 1.0, f"train.rot_beta: {t.rot_beta} outside [0, 1); fix: pass e.g. "
                                   f"{flag_of('rot_beta')} 0.95")
    _need(1 <= t.init_timeout <= MAX_INIT_TIMEOUT,
          f"train.init_timeout: {t.init_timeout} s outside [1, {MAX_INIT_TIMEOUT}]; fix: pass e.g. "
          f"{flag_of('init_timeout')} 300")
    _validate_pipeline(t)
    _validate_observe(t)
    _validate_doc_mask(t, m)
    _validate_init_factor(t, m)


def _validate_delay_schedule(t: TrainConfig) -> None:
    """--delay-schedule: a known name; the baselines built on PipeDream's per-stage delays refuse 2bw."""
    flag = flag_of("delay_schedule")
    _need(t.delay_schedule in DELAY_SCHEDULES, f"train.delay_schedule: {t.delay_schedule!r}; fix: pass {flag} "
                                               f"{' or '.join(DELAY_SCHEDULES)}")
    if t.delay_schedule == "2bw" and t.pipeline_delay > 1:
        _need(t.optimizer != "pipedream-lr" and not t.stage_aware_refresh,
              f"train.delay_schedule: 2bw gives every stage delay 1, and pipedream-lr / "
              f"{flag_of('stage_aware_refresh')} scale by PipeDream's per-stage delays; fix: pass {flag} pipedream "
              f"or another {flag_of('optimizer')} without {flag_of('stage_aware_refresh')}")


def _validate_init_factor(t: TrainConfig, m: ModelConfig) -> None:
    """--init-factor / --calib-tokens (`boostjax.interop.pretrained`; the data's size: `check_calibration`
    there, whether anything is factored at all: `boostjax.training.prepare.configure`)."""
    flag, calib = flag_of("init_factor"), flag_of("calib_tokens")
    _need(t.init_factor in INIT_FACTORS, f"train.init_factor: {t.init_factor!r}; fix: pass {flag} "
                                         f"{' or '.join(INIT_FACTORS)}")
    _need(t.calib_tokens >= 0, f"train.calib_tokens: must be >= 0 (0 = {DEFAULT_CALIB_TOKENS}), got "
                               f"{t.calib_tokens}; fix: pass {calib} N with N >= 1")
    _validate_rank_budget(t, m)
    measured = t.rank_budget and t.rank_policy == "sensitivity"
    if t.init_factor not in CALIBRATED_FACTORS and not measured:
        _need(t.calib_tokens == 0, f"train.calib_tokens: {t.calib_tokens} calibration tokens, but {flag} "
                                   f"{t.init_factor} reads no data; fix: drop {calib} or pass {flag} whitened")
        return
    what = t.init_factor if t.init_factor in CALIBRATED_FACTORS else "--rank-policy sensitivity"
    _need(m.low_rank, f"train.init_factor: {what} factors pretrained weights for a low-rank model, and "
                      f"{flag_of('kind')} {m.kind} keeps them dense; fix: pass {flag_of('kind')} svd, cola or lax, "
                      f"or drop {flag}")
    _need(bool(t.data), f"train.init_factor: {what} fits the factors to activations on {flag_of('data')}, and "
                        f"none is given (the built-in corpus is bytes, not the checkpoint's tokens); fix: pass "
                        f"{flag_of('data')} with text tokenised for the checkpoint, or {flag} svd")


def _validate_rank_budget(t: TrainConfig, m: ModelConfig) -> None:
    """--rank-budget F in (0, 1) (0: unset), with --init-from-hf and a low-rank kind; --rank-policy a name."""
    flag = flag_of("rank_budget")
    _need(t.rank_policy in RANK_POLICIES, f"train.rank_policy: {t.rank_policy!r}; fix: pass "
                                          f"{flag_of('rank_policy')} {' or '.join(RANK_POLICIES)}")
    b = t.rank_budget
    _need(isinstance(b, (int, float)) and not isinstance(b, bool) and (b == 0 or 0 < b < 1),
          f"train.rank_budget: {b!r} is not a share of the projection parameters; fix: pass {flag} F with "
          f"0 < F < 1 (e.g. 0.5 for half)")
    if b:
        _need(bool(t.init_from_hf), f"train.rank_budget: {flag} shares out a pretrained model's parameters, and "
                                    f"no {flag_of('init_from_hf')} is given; fix: pass {flag_of('init_from_hf')} "
                                    f"PATH, or --rank R")
        _need(m.low_rank, f"train.rank_budget: {flag_of('kind')} {m.kind} keeps every projection dense; fix: pass "
                          f"{flag_of('kind')} svd, cola or lax, or drop {flag}")


def _validate_observe(t: TrainConfig) -> None:
    """--profile START:STOP within the run (`boostjax.training.observe`; --hardware names a profile:
    `boostjax.runtime.hardware.check_hardware`)."""
    parse_profile(t.profile, t.steps)


def parse_profile(spec: str, steps: int) -> tuple[int, int] | None:
    """--profile 'START:STOP' -> (START, STOP) with 0 <= START < STOP <= steps; '' -> None."""
    if not spec:
        return None
    flag = flag_of("profile")
    start, sep, stop = spec.partition(":")
    ok = bool(sep) and all(x.strip().isascii() and x.strip().isdigit() for x in (start, stop))
    if not ok:
        raise ConfigError(f"train.profile: cannot read {spec!r}; fix: pass {flag} START:STOP with two "
                          f"step numbers, e.g. {flag} 10:15")
    a, b = int(start), int(stop)
    if not a < b <= steps:
        raise ConfigError(f"train.profile: steps {a}:{b} must satisfy START < STOP <= steps={steps}; fix: pass "
                          f"e.g. {flag} {min(10, max(steps - 1, 0))}:{min(15, steps)}")
    return a, b


def _validate_accum_zero(t: TrainConfig) -> None:
    """Gradient accumulation and ZeRO stages (`boostjax.training.step`)."""
    accum, zero, plan = flag_of("grad_accum"), flag_of("zero"), flag_of("offload_plan")
    _need(t.grad_accum >= 1, f"train.grad_accum: must be >= 1 (1 = no accumulation), got {t.grad_accum}; "
                             f"fix: pass {accum} N with N >= 1")
    _need(t.batch * t.grad_accum * t.seq <= MAX_TOKENS,
          f"train.grad_accum: batch x grad_accum x seq = {t.batch} x {t.grad_accum} x {t.seq} tokens per step "
          f"exceeds {MAX_TOKENS}; fix: lower {accum}, {flag_of('batch')} or {flag_of('seq')}")
    _need(t.zero in ZERO_STAGES, f"train.zero: unknown ZeRO stage {t.zero}; fix: pass {zero} 0 (replicated), "
                                 "1 (optimizer state over data) or 3 (parameters too)")
    if t.offload_plan:
        _need(t.grad_accum == 1, "train.grad_accum: an offload plan budgets one batch per step and no gradient "
                                 f"accumulator; fix: drop {accum} or {plan}")
        _need(t.zero == 0, "train.zero: an offload plan budgets each device's state unsplit over data (ZeRO is not "
                           f"planned); fix: drop {zero} or {plan}")


def _validate_doc_mask(t: TrainConfig, m: ModelConfig) -> None:
    """`doc_mask`: segment ids reach the chunked/xla attention (not cuDNN; a pipeline refuses them:
    `boostjax.placement.pipeline.check_pipeline`)."""
    if not t.doc_mask:
        return
    _need(m.attention != "cudnn", "train.doc_mask: cuDNN attention takes no segment ids; "
                                  f"fix: pass {flag_of('attention')} chunked (or auto) or drop {flag_of('doc_mask')}")


def _validate_pipeline(t: TrainConfig) -> None:
    """The pipeline fields themselves (what a `stage` mesh needs of them: `boostjax.placement.check`)."""
    _need(t.microbatches >= 0, f"train.microbatches: must be >= 0 (0 = auto), got {t.microbatches}; "
                               f"fix: pass {flag_of('microbatches')} M with M >= 1")
    _need(t.pipeline_schedule in PIPELINE_SCHEDULES,
          f"train.pipeline_schedule: unknown schedule {t.pipeline_schedule!r}; fix: pass "
          f"{flag_of('pipeline_schedule')} with one of {', '.join(PIPELINE_SCHEDULES)}")


def validate_processes(coordinator: str, num_processes: int, process_id: int, mesh: MeshShape | None,
                       names: tuple[str, str, str] = ("train.coordinator", "train.num_processes", "train.process_id"),
                       ) -> None:
    """A multi-host process group: all of coordinator/num_processes/process_id or none, and a mesh
    whose devices split evenly over the processes. `names` are the fields (or environment variables)
    the values came from, for the error message."""
    c_name, n_name, i_name = names
    c_flag, n_flag, i_flag = flag_of("coordinator"), flag_of("num_processes"), flag_of("process_id")
    flags = f"{c_flag}, {n_flag} and {i_flag}"
    _need(num_processes >= 0, f"{n_name}: must be >= 1 (0 = from the environment), got {num_processes}; "
                              f"fix: pass {n_flag} N with N >= 1")
    _need(process_id >= -1, f"{i_name}: must be >= 0 (-1 = from the environment), got {process_id}; "
                            f"fix: pass {i_flag} I with 0 <= I < num_processes")
    if num_processes == 1:
        _need(not coordinator and process_id in (-1, 0),
              f"{n_name}: a single-process run takes no coordinator or other process id; fix: drop {flags}")
        return
    given = (bool(coordinator), num_processes > 0, process_id >= 0)
    if not any(given):
        return
    missing = [name for name, ok in zip(names, given) if not ok]
    _need(not missing, f"{missing[0] if missing else ''}: a multi-host job needs {flags} together; "
                       "fix: pass all three (or none of them in a SLURM, mpiexec or Kubernetes job, which is read from its variables)")
    host, sep, port = coordinator.rpartition(":")
    _need(bool(sep and host and port.isdigit() and 0 < int(port) < 65536),
          f"{c_name}: {coordinator!r} is not HOST:PORT; fix: pass process 0's address and a free port, "
          f"e.g. {c_flag} 10.0.0.1:12355")
    _need(process_id < num_processes, f"{i_name}: {process_id} is not in [0, {num_processes}); "
                                      f"fix: number the processes 0..{num_processes - 1}")
    validate_process_mesh(num_processes, mesh)


def validate_process_mesh(num_processes: int, mesh: MeshShape | None) -> None:
    """A job of several processes needs a mesh whose devices split evenly over them."""
    flag = flag_of("mesh")
    _need(mesh is not None, f"train.mesh: a job of {num_processes} processes needs a device mesh over all of "
                            f"their devices; fix: pass e.g. {flag} data=D,model=T with D x T the job's device count")
    devices = mesh.devices
    _need(devices % num_processes == 0,
          f"train.mesh: its {devices} devices do not split evenly over {num_processes} processes; "
          f"fix: make the product of the {flag} sizes a multiple of {num_processes} (devices per process x processes)")


def validate(cfg: Config) -> Config:
    """Raise `ConfigError` on the first invalid field; return the config unchanged otherwise. The
    fields only: `boostjax.training.checks.validate` checks the rest and marks the config."""
    _need(isinstance(cfg, Config), f"config: need a Config, got {type(cfg).__name__}; fix: pass Config(model, train)")
    validate_model(cfg.model)
    validate_train(cfg.train, cfg.model)
    t = cfg.train
    validate_processes(t.coordinator, t.num_processes, t.process_id, t.mesh)
    return cfg


_VALIDATED = "_validated"


def mark_validated(cfg: Config) -> Config:
    """Mark `cfg` as wholly checked (not a field: equality, to_dict and replace() ignore it)."""
    object.__setattr__(cfg, _VALIDATED, True)
    return cfg


def is_validated(cfg: Config) -> bool:
    """Whether `mark_validated` ran on this very object (a changed copy, `dataclasses.replace`, is not)."""
    return bool(getattr(cfg, _VALIDATED, False))


def field_names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def check_batch_seq(batch: int, seq: int, where: str) -> None:
    """A command's --batch and --seq: positive and within the sizes one step can hold."""
    b_flag, s_flag = flag_of("batch"), flag_of("seq")
    for name, v in (("batch", batch), ("seq", seq)):
        _need(v >= 1, f"{where}.{name}: must be positive, got {v}; fix: pass {flag_of(name)} N with N >= 1")
    _need(seq <= MAX_SEQ_LEN, f"{where}.seq: {seq} exceeds {MAX_SEQ_LEN}; fix: pass {s_flag} <= {MAX_SEQ_LEN}")
    _need(batch * seq <= MAX_TOKENS, f"{where}.batch: batch x seq = {batch} x {seq} tokens exceeds {MAX_TOKENS}; "
                                     f"fix: lower {b_flag} or {s_flag}")
