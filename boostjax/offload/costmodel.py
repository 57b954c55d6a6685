"""Cost model for offload planning: bytes and seconds per layer of a (low-rank) LLaMA, and the
`PlanInstance` the planner consumes.

The block's tensors come from `boostjax.offload.blockgraph`; this module adds parameter, gradient and
optimizer-state bytes, per-layer costs (`layer_cost`) and the planner's input (`PlanInstance`,
`build_instance`, LazyTrain's 27B instance, the 3B-27B family). Its conventions (FLOPs, activation
dtypes, parameters, working sets, the LM head) and how it was checked against compiled steps:
docs/offload.md ("The cost model's conventions").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable

from boostjax.config import MODEL, MeshShape, ModelConfig, as_mesh, flag_of, preset
from boostjax.models.flops import flops_per_token
from boostjax.models.llama import param_axes, param_shapes
from boostjax.runtime.hardware import HardwareProfile, get_profile
from boostjax.offload.blockgraph import (ALL, ATTENTION, BOUNDARY, _bwd_needs, _saved_bytes, activation_names,
                                        block_graph, decisions, default_inner_options, recompute_cost)
from boostjax.offload.optstate import OptimizerBytes
from boostjax.sharding import rules

MODES: tuple[str, ...] = ("device", "opt-host", "host")
"""Where a layer's parameters / optimizer states live: both on device; fp32 master + optimizer states
on the host with a compute-dtype copy resident on device; both on the host (MegaTrain streaming)."""


# ----------------------------------------------------------------------------- one device of a mesh

# The block dimensions each TP strategy divides by the `model` axis size (`boostjax.sharding.rules`):
# BTP shards the residual stream (d) with the heads and d_ff and keeps the r-dim latents whole
# (replicated after their psum); vanilla TP splits every low-rank pair along r (the [b, t, d]
# residuals and all heads replicated); Megatron (fullrank-tp) splits heads and d_ff (the [b, t, d]
# residual replicated). A block of the model with these dimensions divided is one device's block:
# its tensor widths are the device's activations (its parameters: `device_param_shapes`).
STRATEGY_DIMS: dict[str, tuple[str, ...]] = {
    name: tuple(f for f in rules.split_fields(name) if f != "vocab_size") for name in rules.STRATEGIES}


def _mesh(mesh: MeshShape | str | None) -> MeshShape:
    """The `MeshShape` of a mesh given as a MeshShape, a `--mesh` string or None / '' (one device: all
    sizes 1)."""
    return as_mesh(mesh) or MeshShape()


def _mesh_key(mesh: MeshShape | str | None) -> str:
    """A mesh as plans record it (`planned_for`, instance names): its text, '' for one device."""
    sizes = _mesh(mesh)
    return "" if sizes.devices == 1 else str(sizes)


def local_model(cfg: ModelConfig, strategy: str = "none", tp: int = 1) -> ModelConfig:
    """One device's block under `strategy` on a `model` axis of size `tp`: the dimensions the strategy
    shards divided by tp (ValueError when one does not divide); the head width is kept."""
    if strategy not in STRATEGY_DIMS:
        raise ValueError(f"strategy: unknown strategy {strategy!r}; fix: one of {', '.join(STRATEGY_DIMS)}")
    if tp == 1 or not STRATEGY_DIMS[strategy]:
        return cfg
    values = {"d_model": cfg.d_model, "n_heads": cfg.n_heads, "n_kv_heads": cfg.kv_heads, "d_ff": cfg.d_ff,
              "rank": cfg.rank, **(rules.rank_sizes(cfg) if cfg.low_rank else {})}
    over: dict[str, int] = {"auto_dense": False} if cfg.low_rank else {}  # the global model's factorisation
    dims = [f for f in STRATEGY_DIMS[strategy] if f != "rank"]
    if "rank" in STRATEGY_DIMS[strategy]:  # every factorised group's rank
        dims += list(rules.rank_sizes(cfg)) if cfg.low_rank else ["rank"]
    for dim in dims:
        if values[dim] % tp:
            raise ValueError(f"model.{dim}: {values[dim]} is not divisible by the TP size {tp} ({strategy}); "
                             f"fix: choose {flag_of(dim)} a multiple of {tp} or a smaller model axis")
        over[dim] = values[dim] // tp
    return replace(cfg, attn_head_dim=cfg.head_dim, **over)


# ----------------------------------------------------------------------------- parameters


def device_param_shapes(cfg: ModelConfig, strategy: str = "none", tp: int = 1, *,
                        block: bool = False) -> dict[str, tuple[int, ...]]:
    """One device's shard of every parameter (`block`: of one block's) on a `model` axis of `tp`
    devices under `strategy`: the model's shapes (`boostjax.models.llama.param_shapes`) with each
    dimension whose logical axis the strategy maps to `model` (`boostjax.sharding.rules`) divided by
    `tp` (ValueError when it does not divide)."""
    if strategy not in rules.STRATEGIES:
        raise ValueError(f"strategy: unknown strategy {strategy!r}; fix: one of {', '.join(rules.STRATEGIES)}")
    split = rules.STRATEGIES[strategy].rules
    axes = param_axes(cfg, block=block)
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in param_shapes(cfg, block=block).items():
        dims = []
        for n, axis in zip(shape, axes[name] or (None,) * len(shape)):  # (every LLaMA parameter declares axes)
            if split.get(axis) == MODEL and tp > 1:
                if n % tp:
                    raise ValueError(f"{name}: its {axis} dimension {n} is not divisible by the TP size {tp} "
                                     f"({strategy}); fix: choose a dividing model axis")
                n //= tp
            dims.append(n)
        out[name] = tuple(dims)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    return int(math.prod(shape))


def param_count_per_layer(cfg: ModelConfig, strategy: str = "none", tp: int = 1) -> int:
    """Parameters of one block (on one device of a `model` axis of `tp` under `strategy`)."""
    return sum(_numel(s) for s in device_param_shapes(cfg, strategy, tp, block=True).values())


def adam_state_bytes(shapes: Iterable[tuple[int, ...]], eight_bit: bool = False, block: int = 256,
                     min_8bit_size: int = 4096) -> int:
    """Bytes of Adam m and v for these tensors: fp32 (8 B/param) or the hybrid 8-bit layout (uint8
    codes padded to whole blocks + one fp32 absmax per block, per moment; small tensors stay fp32)."""
    total = 0
    for s in shapes:
        n = _numel(s)
        if eight_bit and n >= min_8bit_size:
            nb = -(-n // block)
            total += 2 * (nb * block + 4 * nb)
        else:
            total += 8 * n
    return total


def opt_state_bytes_per_layer(cfg: ModelConfig, eight_bit: bool = False, strategy: str = "none", tp: int = 1) -> int:
    """Adam m and v of one block's parameters (as `boostjax.optim.adam8bit` keeps them: per tensor)."""
    return adam_state_bytes(device_param_shapes(cfg, strategy, tp, block=True).values(), eight_bit)


# ----------------------------------------------------------------------------- per-layer costs


@dataclass(frozen=True)
class LayerCost:
    """Everything the planner needs about one block at a given batch, sequence and device."""

    boundary_bytes: float
    fwd_flops: float
    fwd_s: float
    bwd_s: float
    activation_bytes: dict[str, float]  # every tensor of the block (named and not)
    full_bytes: float  # everything the backward reads, i.e. the no-remat saved set
    options: dict[str, tuple[tuple[str, ...], float, float]]  # name -> (saved names, bytes, recompute s)
    params: int
    param_bytes: float  # fp32 master
    grad_bytes: float  # fp32
    opt_bytes: float  # Adam m, v (fp32 or 8-bit)
    stream_bytes: float  # one parameter fetch / gradient send in the compute dtype
    work_fwd_bytes: float
    work_bwd_bytes: float


def layer_cost(cfg: ModelConfig, batch: int, seq: int, hw: HardwareProfile, dtype_bytes: int = 2,
               eight_bit: bool = False, options: dict[str, tuple[str, ...]] | None = None,
               attention: str = "materialized", strategy: str = "none", tp: int = 1,
               opt_bytes: float | None = None) -> LayerCost:
    """Bytes and seconds of one block on one device (`batch` = that device's rows; `strategy` and the
    TP size `tp` pick its shard of the block: `local_model`). `opt_bytes`: the block's optimizer state
    on the device when known (`boostjax.offload.optstate`), else Adam's (`eight_bit`: hybrid 8-bit). Working sets: the forward of a layer
    holds what its backward will read (`full`) and its output; its backward holds `full`, the
    output's cotangent and two cotangents of the largest tensor (the one arriving and the one passed on)."""
    if batch <= 0 or seq <= 0:
        raise ValueError(f"batch/seq: must be positive, got batch={batch} seq={seq}; fix: pass positive sizes")
    local, lowrank = local_model(cfg, strategy, tp), decisions(cfg)  # the whole model decides what is factorised
    n_params = param_count_per_layer(cfg, strategy, tp)
    if opt_bytes is None:
        opt_bytes = opt_state_bytes_per_layer(cfg, eight_bit, strategy, tp)
    cfg = local
    tokens = batch * seq
    g = block_graph(cfg, seq, attention, lowrank)
    rate = hw.flops_per_s
    fwd_flops = sum(n.flops for n in g.values()) * tokens
    act = {name: _saved_bytes(n, dtype_bytes) * tokens for name, n in g.items()}
    needs = _bwd_needs(g)
    full = recompute_cost(cfg, seq, None, dtype_bytes, attention, lowrank)[1] * tokens
    menu = default_inner_options(cfg, lowrank) if options is None else options
    opts: dict[str, tuple[tuple[str, ...], float, float]] = {}
    for name, saved in menu.items():
        if name == ALL:
            opts[name] = (activation_names(cfg, lowrank)[1:], full, 0.0)
            continue
        rc_flops, per_token = recompute_cost(cfg, seq, saved, dtype_bytes, attention, lowrank)
        opts[name] = (tuple(saved), per_token * tokens, rc_flops * tokens / rate)
    biggest = max(act[n] for n in needs)
    return LayerCost(
        boundary_bytes=act["boundary"], fwd_flops=fwd_flops, fwd_s=fwd_flops / rate, bwd_s=2.0 * fwd_flops / rate,
        activation_bytes=act, full_bytes=full, options=opts, params=n_params, param_bytes=4.0 * n_params,
        grad_bytes=4.0 * n_params, opt_bytes=float(opt_bytes),
        stream_bytes=float(dtype_bytes * n_params), work_fwd_bytes=full + act["out"],
        work_bwd_bytes=full + act["out"] + 2 * biggest)


# ----------------------------------------------------------------------------- the planner's input


@dataclass(frozen=True)
class PlanInstance:
    """Planner input: per-layer arrays (index k = layer k; boundary k = input of layer k), the
    inner-option menu, parameter-placement costs, the link, the budget and the compute windows.

    Windows of one step, in time order: P (prologue), F_0..F_{L-1}, T (LM head forward+backward),
    B_{L-1}..B_0, E (epilogue). Their base durations: `prologue_s`, `fwd_s`, `head_s`, `bwd_s`,
    `epilogue_s`.
    """

    name: str
    boundary_bytes: tuple[float, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    work_fwd_bytes: tuple[float, ...]
    work_bwd_bytes: tuple[float, ...]
    option_names: tuple[str, ...]
    option_saves: tuple[tuple[str, ...], ...]  # per option: named tensors saved on device
    option_bytes: tuple[tuple[float, ...], ...]  # [layer][option]
    option_recompute_s: tuple[tuple[float, ...], ...]  # [layer][option]
    stream_bytes: tuple[float, ...]  # link bytes of one parameter fetch / gradient send
    stream_mem_bytes: tuple[float, ...]  # device bytes one streamed buffer occupies (0 = outside budget)
    mode_device_bytes: tuple[tuple[float, ...], ...]  # [layer][MODES index]: resident device bytes
    mode_host_bytes: tuple[tuple[float, ...], ...]  # [layer][MODES index]: host bytes
    budget_bytes: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    param_modes: tuple[str, ...] = MODES
    head_s: float = 0.0
    head_work_bytes: float = 0.0
    prologue_s: float = 0.0
    epilogue_s: float = 0.0
    fixed_bytes: float = 0.0  # always resident, not decided by the plan (embedding, head, ...)
    host_budget_bytes: float = 0.0  # 0 = unlimited
    max_segment: int = 8  # longest recompute segment (layers between two materialised boundaries)
    h2d_lead: int = 2  # a fetch may run up to this many windows before the one that needs it
    d2h_lag: int = 2  # an offload may run in the producing window or up to lag-1 windows later
    flat_segments: bool = True  # allow Chen-style (flat) recompute segments (needs `all` and `boundary`)
    activation_names: tuple[str, ...] = ("boundary",)
    tokens: int = 0
    model_flops: float = 0.0  # one device's model FLOPs of a step (`flops_per_token`), for TFLOPS reporting
    notes: str = ""
    # per layer: the gradient of a `device`-mode layer, resident from its backward window B_k to the
    # epilogue E where the optimizer consumes it (empty: none beyond `mode_device_bytes`)
    grad_device_bytes: tuple[float, ...] = ()
    # what the instance models, as (field, value) pairs (`planned_for`): a plan applies only to a
    # run with these values (empty for hand-built instances)
    planned_for: tuple[tuple[str, object], ...] = ()
    # every layer in the same parameter mode: a pipeline stacks a stage's layers into one array per
    # parameter, which lives either on the host or on the device
    uniform_modes: bool = False

    def __post_init__(self) -> None:
        L = len(self.boundary_bytes)
        if L < 1:
            raise ValueError("boundary_bytes: an instance needs at least one layer; fix: pass L >= 1 entries")
        if not self.grad_device_bytes:
            object.__setattr__(self, "grad_device_bytes", (0.0,) * L)
        for fname in ("fwd_s", "bwd_s", "work_fwd_bytes", "work_bwd_bytes", "option_bytes",
                      "option_recompute_s", "stream_bytes", "stream_mem_bytes", "mode_device_bytes",
                      "mode_host_bytes", "grad_device_bytes"):
            if len(getattr(self, fname)) != L:
                raise ValueError(f"{fname}: has {len(getattr(self, fname))} entries for {L} layers; "
                                 "fix: give one entry per layer")
        n_opt = len(self.option_names)
        if n_opt < 1 or len(self.option_saves) != n_opt:
            raise ValueError("option_names/option_saves: need one saved-name tuple per option; fix: align them")
        for k in range(L):
            if len(self.option_bytes[k]) != n_opt or len(self.option_recompute_s[k]) != n_opt:
                raise ValueError(f"option_bytes/option_recompute_s[{k}]: need {n_opt} entries; fix: align them")
            if len(self.mode_device_bytes[k]) != len(MODES) or len(self.mode_host_bytes[k]) != len(MODES):
                raise ValueError(f"mode_*_bytes[{k}]: need {len(MODES)} entries (one per MODES); fix: align them")
        bad = [m for m in self.param_modes if m not in MODES]
        if bad or not self.param_modes:
            raise ValueError(f"param_modes: {self.param_modes!r}; fix: a non-empty subset of {MODES}")
        if min(self.max_segment, self.h2d_lead, self.d2h_lag) < 1:
            raise ValueError("max_segment/h2d_lead/d2h_lag: must be >= 1; fix: pass positive integers")
        if self.h2d_bytes_per_s <= 0 or self.d2h_bytes_per_s <= 0:
            raise ValueError("h2d_bytes_per_s/d2h_bytes_per_s: must be positive; fix: pass the link rates")
        if self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes: must be positive, got {self.budget_bytes}; fix: pass the device budget")

    @property
    def n_layers(self) -> int:
        return len(self.boundary_bytes)

    @property
    def base_compute_s(self) -> float:
        """Step time with no recompute and no exposed transfer."""
        return self.prologue_s + sum(self.fwd_s) + self.head_s + sum(self.bwd_s) + self.epilogue_s

    def with_budget(self, budget_bytes: float) -> "PlanInstance":
        return replace(self, budget_bytes=float(budget_bytes))


def build_instance(cfg: ModelConfig, batch: int, seq: int, hw: HardwareProfile | str,
                   budget_bytes: float | None = None, dtype_bytes: int = 2, eight_bit: bool = True,
                   param_modes: tuple[str, ...] = MODES, options: dict[str, tuple[str, ...]] | None = None,
                   logits_chunk: int | None = None, max_segment: int = 8, h2d_lead: int = 2, d2h_lag: int = 2,
                   attention: str = "materialized", name: str | None = None, strategy: str = "none",
                   mesh: object = None, optimizer: OptimizerBytes | None = None) -> PlanInstance:
    """A plan instance from model shapes for ONE device of `mesh` (a `MeshShape` or `--mesh` text; None: one device)
    under the TP `strategy`: its batch rows (`batch / data`), its stage's layers (`n_layers / stage`;
    the plan of one stage is applied to every stage's layers, and with stage > 1 all layers share one
    parameter mode) and its shard of each layer and activation (`local_model`). The embedding, LM head
    and final norm (weights, gradients and optimizer states, the head split by vocabulary under TP and
    the embedding by d under BTP; replicated over stages) stay on device in `fixed_bytes`, with the
    embedding lookup's rows (kept for the whole step). The LM head's window holds the fp32 logits,
    their `exp` (the cross-entropy's residual) and their gradient for `logits_chunk` tokens (None: all
    of its tokens at once, as `vocab_parallel_cross_entropy` does; a pipeline splits the head's tokens
    over the stages) plus the final features and their norm. `attention`: see `block_graph`. Default
    budget: 90 % of device memory. ValueError when the mesh does not divide the batch or layers.
    `optimizer`: the run's optimizer-state bytes (`boostjax.offload.optstate.optimizer_bytes`, read from
    the optimizer); without it, Adam's (`eight_bit`: the hybrid 8-bit layout, else fp32)."""
    hw = get_profile(hw) if isinstance(hw, str) else hw
    sizes = _mesh(mesh)
    if batch % sizes.data or cfg.n_layers % sizes.stage:
        raise ValueError(f"mesh: data={sizes.data} must divide batch={batch} and stage={sizes.stage} n_layers="
                         f"{cfg.n_layers}; fix: pick mesh sizes that divide them")
    tp = sizes.model
    if tp > 1 and (strategy == "none" or cfg.vocab_size % tp):
        raise ValueError(f"mesh: model={tp} needs a TP strategy whose vocabulary-parallel head divides vocab_size="
                         f"{cfg.vocab_size} (strategy={strategy}); fix: pass a TP strategy and a dividing model size")
    lc = layer_cost(cfg, batch // sizes.data, seq, hw, dtype_bytes, eight_bit, options, attention, strategy, tp,
                    opt_bytes=None if optimizer is None else optimizer.per_layer)
    L, tokens = cfg.n_layers // sizes.stage, batch // sizes.data * seq
    names = tuple(lc.options)
    vocab = cfg.vocab_size // tp if strategy != "none" else cfg.vocab_size  # the vocabulary-parallel logits
    # the parameters outside the blocks (embedding, final norm, the head unless tied), each as this
    # device's shard (BTP's embedding holds d/TP columns, the head V/TP rows): fp32 weight and gradient,
    # and the optimizer state the run allocates, or Adam's moments as adam8bit keeps them (the
    # embedding's stay fp32)
    outside = {k: v for k, v in device_param_shapes(cfg, strategy, tp).items() if not k.startswith("layers.")}
    moments = optimizer.fixed if optimizer is not None else \
        sum(adam_state_bytes([s], eight_bit and "embed" not in k) for k, s in outside.items())
    fixed = sum(8 * _numel(s) for s in outside.values()) + moments
    fixed += tokens * outside["embed"][1] * dtype_bytes  # the gathered embedding rows
    head_tokens = tokens // sizes.stage
    chunk = head_tokens if logits_chunk is None else min(head_tokens, logits_chunk)
    head_flops = 2.0 * cfg.d_model * vocab * head_tokens
    per_mode_dev = (lc.param_bytes + lc.opt_bytes, lc.stream_bytes, 0.0)  # + the gradient from B_k to E
    per_mode_host = (0.0, lc.param_bytes + lc.opt_bytes + lc.stream_bytes, lc.param_bytes + lc.opt_bytes + lc.stream_bytes)
    key = _mesh_key(sizes)
    where = "" if strategy == "none" and not key else f"-{strategy}" + (f"[{key}]" if key else "")
    return PlanInstance(
        name=name or f"{cfg.kind}-d{cfg.d_model}-L{cfg.n_layers}-b{batch}-s{seq}{where}@{hw.name}",
        boundary_bytes=(lc.boundary_bytes,) * L, fwd_s=(lc.fwd_s,) * L, bwd_s=(lc.bwd_s,) * L,
        work_fwd_bytes=(lc.work_fwd_bytes,) * L, work_bwd_bytes=(lc.work_bwd_bytes,) * L,
        option_names=names, option_saves=tuple(lc.options[n][0] for n in names),
        option_bytes=(tuple(lc.options[n][1] for n in names),) * L,
        option_recompute_s=(tuple(lc.options[n][2] for n in names),) * L,
        stream_bytes=(lc.stream_bytes,) * L, stream_mem_bytes=(lc.stream_bytes,) * L,
        mode_device_bytes=(per_mode_dev,) * L, mode_host_bytes=(per_mode_host,) * L,
        grad_device_bytes=(lc.grad_bytes,) * L,
        budget_bytes=float(budget_bytes if budget_bytes is not None else 0.9 * hw.device_bytes),
        h2d_bytes_per_s=hw.h2d_bytes_per_s, d2h_bytes_per_s=hw.d2h_bytes_per_s, param_modes=param_modes,
        head_s=3.0 * head_flops / hw.flops_per_s,
        head_work_bytes=3.0 * 4 * chunk * vocab + 2.0 * head_tokens * cfg.d_model * dtype_bytes,
        fixed_bytes=float(fixed), host_budget_bytes=float(hw.host_bytes), max_segment=max_segment,
        h2d_lead=h2d_lead, d2h_lag=d2h_lag, activation_names=activation_names(cfg), tokens=tokens,
        model_flops=flops_per_token(cfg, seq) * tokens / (sizes.stage * tp), uniform_modes=sizes.stage > 1,
        planned_for=planned_for(cfg, batch, seq, dtype_bytes, eight_bit, attention, strategy, sizes, optimizer))


PLAN_DTYPES: dict[int, str] = {4: "float32", 2: "bfloat16"}  # activation bytes -> compute dtype


def planned_for(cfg: ModelConfig, batch: int, seq: int, dtype_bytes: int, eight_bit: bool,
                attention: str, strategy: str = "none", mesh: object = None,
                optimizer: OptimizerBytes | None = None) -> tuple[tuple[str, object], ...]:
    """The run a plan of these inputs is valid for, as (field, value) pairs named like the config
    fields: the model shapes the cost model reads, batch (global), seq, compute dtype, optimizer-state
    sizes (`adam8bit` or fp32 `adamw`), the attention memory model, the TP strategy and the mesh
    (canonical text, '' for one device). Records without the last two are plans for one device
    (`PLANNED_FOR_DEFAULTS`). With `optimizer` (the run's optimizer-state bytes): its name, and the
    state bytes of one layer on one device (a record without them: an older plan, not compared)."""
    name = optimizer.name if optimizer is not None else "adam8bit" if eight_bit else "adamw"
    state = (("optimizer_state_bytes_per_layer", optimizer.per_layer),) if optimizer is not None else ()
    return (("model.kind", cfg.kind), ("model.vocab_size", cfg.vocab_size), ("model.d_model", cfg.d_model),
            ("model.n_layers", cfg.n_layers), ("model.n_heads", cfg.n_heads), ("model.n_kv_heads", cfg.kv_heads),
            ("model.d_ff", cfg.d_ff), ("model.rank", cfg.rank if cfg.low_rank else 0),
            *((f"model.rank_{g}", getattr(cfg, f"rank_{g}") if cfg.low_rank else 0) for g in ("attn", "kv", "mlp")),
            ("train.batch", batch), ("train.seq", seq),
            ("train.dtype", PLAN_DTYPES.get(dtype_bytes, f"{dtype_bytes}-byte")),
            ("train.optimizer", name), ("attention", attention),
            ("train.strategy", strategy), ("train.mesh", _mesh_key(mesh))) + state


PLANNED_FOR_DEFAULTS: dict[str, object] = {"train.strategy": "none", "train.mesh": "", "model.rank_attn": 0,
                                           "model.rank_kv": 0, "model.rank_mlp": 0}
"""What a `planned_for` record that predates a key means (plan files written before meshes)."""


# 27B LLaMA-like shape (assumption): d 5120, 64 layers, 40 heads with 8 KV heads (GQA), d_ff 22016,
# LLaMA-3 vocabulary 128256 -> 26.98 B parameters. At seq 1024 in bf16 one boundary [b, s, d] is
# 0.703125 GiB exactly for micro-batch b = 72, which is what LazyTrain reports.
LAZYTRAIN_27B = ModelConfig(kind="llama", vocab_size=128256, d_model=5120, n_layers=64, n_heads=40,
                            n_kv_heads=8, d_ff=22016, rank=1280, max_seq_len=4096)


def lazytrain_27b(hw: HardwareProfile | str = "H800-80GB", eight_bit: bool = True) -> PlanInstance:
    """LazyTrain's 27B instance: 64 layers, 0.703 GiB per boundary, 21.55 GB device activation budget,
    H800. Parameters and optimizer states live on the host (27 B fp32 + Adam cannot sit in 80 GB) and
    are streamed layer by layer; the budget covers the activations the plan decides (boundaries,
    saved in-block tensors, regenerated and prefetched boundaries). The transient block working set,
    the streamed weight buffers and the head live outside it (the rest of the 70 GB cap)."""
    seq, batch = 1024, 72
    inst = build_instance(LAZYTRAIN_27B, batch, seq, hw, budget_bytes=21.55e9, eight_bit=eight_bit,
                          param_modes=("host",), attention="flash", name="lazytrain-27b")
    L = inst.n_layers
    if abs(inst.boundary_bytes[0] - 0.703125 * (1 << 30)) >= 1:
        raise RuntimeError("lazytrain_27b: the boundary is not 0.703 GiB; the shape constants were changed")
    return replace(inst, work_fwd_bytes=(0.0,) * L, work_bwd_bytes=(0.0,) * L, stream_mem_bytes=(0.0,) * L,
                   head_work_bytes=0.0, fixed_bytes=0.0,
                   notes="LazyTrain 27B: seq 1024, micro-batch 72 (0.703 GiB boundaries), 21.55 GB activation budget")


def instance_family(hw: HardwareProfile | str = "H800-80GB", seq: int = 1024, batch: int = 64,
                    budget_bytes: float = 70e9, kind: str = "llama") -> dict[str, PlanInstance]:
    """Instances from 3B to 27B (presets 3b, 7b, 13b with a 32000 vocabulary, and the 27B shape) under
    LazyTrain's 70 GB device cap, every parameter mode allowed. The default micro-batch (64 x 1024
    tokens) is LazyTrain's regime, where a streamed layer's transfers can hide under its compute."""
    out: dict[str, PlanInstance] = {}
    for key in ("3b", "7b", "13b", "27b"):
        cfg = replace(LAZYTRAIN_27B, kind=kind) if key == "27b" else preset(key, kind=kind, vocab_size=32000)
        out[key] = build_instance(cfg, batch, seq, hw, budget_bytes=budget_bytes, logits_chunk=4096, attention="flash",
                                  name=f"{kind}-{key}-b{batch}-s{seq}")
    return out


__all__ = [
    "ALL", "ATTENTION", "BOUNDARY", "MODES", "LAZYTRAIN_27B", "PLANNED_FOR_DEFAULTS", "STRATEGY_DIMS", "LayerCost",
    "PlanInstance", "activation_names", "adam_state_bytes", "block_graph", "build_instance", "default_inner_options",
    "device_param_shapes", "instance_family", "layer_cost", "lazytrain_27b", "local_model",
    "opt_state_bytes_per_layer", "param_count_per_layer", "planned_for", "recompute_cost",
]
