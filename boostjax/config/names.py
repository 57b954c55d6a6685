"""The names a config field may take, written once as a `Literal` (the field's type, the CLI's
choices) with the tuple of its values beside it; the device mesh's axis names; the sizes past which a
number is a typo; and `ConfigError`, which every check raises."""

from __future__ import annotations

from typing import Literal, get_args

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
# how AdamW steps the low-rank factors (`boostjax.optim.factor_lr`): as every parameter, or by their start scale
FactorLr = Literal["fixed", "start-rms"]
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
FACTOR_LRS: tuple[str, ...] = get_args(FactorLr)
DEFAULT_CALIB_TOKENS: int = 32768  # --calib-tokens 0
# Sizes past which a number is a typo, not a run: token positions and ids are int32 in the step, and a
# materialised attention of a longer sequence has more than 2^40 scores per head and sequence.
MAX_SEQ_LEN: int = 1 << 20
MAX_TOKENS: int = (1 << 31) - 1  # batch x seq of one step
MAX_VOCAB: int = 1 << 32  # uint32 token files
MAX_INIT_TIMEOUT: int = 24 * 3600


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the field and the fix."""
