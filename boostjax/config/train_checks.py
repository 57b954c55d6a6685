"""The checks of a `TrainConfig`'s fields (given the model: a few depend on its shapes), one small
named check per concern, in the order `validate_train` runs them."""

from __future__ import annotations

import math

from boostjax.config.checking import check_types, need
from boostjax.config.fields import flag_of
from boostjax.config.model import ModelConfig
from boostjax.config.names import (CALIBRATED_FACTORS, CLIP_SCOPES, DATA_DTYPES, DEFAULT_CALIB_TOKENS, DELAY_SCHEDULES,
                                   DTYPES, FACTOR_LRS, INIT_FACTORS, MAX_INIT_TIMEOUT, MAX_TOKENS, OPTIMIZERS, PIPELINE_SCHEDULES,
                                   RANK_POLICIES, REMAT, ROT_GEOMETRIES, ROT_ORDERS, ROT_SOURCES, STRATEGIES,
                                   ZERO_STAGES, ConfigError)
from boostjax.config.train import TrainConfig


def validate_train(t: TrainConfig, m: ModelConfig) -> None:
    """The training fields, given the model; raises `ConfigError` on the first invalid one."""
    need(isinstance(t, TrainConfig), f"train: need a TrainConfig, got {type(t).__name__}; fix: pass TrainConfig(...)")
    check_types(t, "train")
    _validate_sizes(t)
    _validate_schedule(t)
    _validate_choices(t, m)
    _validate_delays(t, m)
    _validate_rotation(t)
    _validate_optimizer_settings(t)
    need(1 <= t.init_timeout <= MAX_INIT_TIMEOUT,
         f"train.init_timeout: {t.init_timeout} s outside [1, {MAX_INIT_TIMEOUT}]; fix: pass e.g. "
         f"{flag_of('init_timeout')} 300")
    _validate_pipeline(t)
    _validate_observe(t)
    _validate_doc_mask(t, m)
    _validate_init_factor(t, m)
    _validate_factor_lr(t, m)


def _validate_sizes(t: TrainConfig) -> None:
    """Steps, batch, sequence and the intervals positive; a step's tokens within int32; the seed and the run folder."""
    for name in ("steps", "batch", "seq", "ckpt_every", "keep_ckpts", "log_every", "eval_every", "eval_batches"):
        v = getattr(t, name)
        need(v > 0, f"train.{name}: must be positive, got {v}; fix: pass {flag_of(name)} N with N >= 1")
    need(t.batch * t.seq <= MAX_TOKENS, f"train.batch: batch x seq = {t.batch} x {t.seq} tokens exceeds {MAX_TOKENS} "
                                        f"(int32 positions); fix: lower {flag_of('batch')} or {flag_of('seq')}")
    _validate_accum_zero(t)
    need(0 <= t.seed < 1 << 63, f"train.seed: must lie in [0, 2^63), got {t.seed}; fix: pass {flag_of('seed')} N "
                                "with N >= 0")
    need(bool(t.out.strip()) and "\0" not in t.out,
         f"train.out: {t.out!r} is not a folder name (an empty one would write into the current folder); "
         f"fix: pass {flag_of('out')} runs/NAME")


def _validate_schedule(t: TrainConfig) -> None:
    """The learning-rate schedule, Adam's betas, clipping and weight decay."""
    need(t.lr > 0, f"train.lr: must be positive, got {t.lr}; fix: pass e.g. {flag_of('lr')} 1e-3")
    need(t.warmup == -1 or 0 <= t.warmup < t.steps,
         f"train.warmup: {t.warmup} must lie in [0, steps={t.steps}) or be -1 (5 % of steps); "
         f"fix: lower {flag_of('warmup')}")
    need(0.0 <= t.min_lr_ratio <= 1.0, f"train.min_lr_ratio: {t.min_lr_ratio} outside [0, 1]; fix: pass e.g. "
                                       f"{flag_of('min_lr_ratio')} 0.1")
    need(0.0 <= t.b1 < 1.0, f"train.b1: {t.b1} outside [0, 1); fix: pass e.g. {flag_of('b1')} 0.9")
    need(0.0 <= t.b2 < 1.0, f"train.b2: {t.b2} outside [0, 1); fix: pass e.g. {flag_of('b2')} 0.95")
    need(t.clip >= 0, f"train.clip: must be >= 0 (0 disables), got {t.clip}; fix: pass e.g. {flag_of('clip')} 1.0")
    need(t.weight_decay >= 0, f"train.weight_decay: must be >= 0, got {t.weight_decay}; fix: pass e.g. "
                              f"{flag_of('weight_decay')} 0.01")


def _validate_choices(t: TrainConfig, m: ModelConfig) -> None:
    """The named choices (dtype, strategy, remat, optimizer), and what the compute dtype and --seq need of the model."""
    need(t.dtype in DTYPES, f"train.dtype: unknown dtype {t.dtype!r}; fix: pass {flag_of('dtype')} with one of "
                            f"{', '.join(DTYPES)}")
    need(t.data_dtype in DATA_DTYPES, f"train.data_dtype: {t.data_dtype!r}; fix: pass {flag_of('data_dtype')} "
                                      f"{' or '.join(DATA_DTYPES)}")
    need(m.attention != "cudnn" or t.dtype != "float32",
         "model.attention: cudnn runs in bfloat16/float16 and the compute dtype is float32; "
         f"fix: pass {flag_of('dtype')} bfloat16 or {flag_of('attention')} chunked")
    need(t.seq <= m.max_seq_len, f"train.seq: {t.seq} exceeds model.max_seq_len={m.max_seq_len}; fix: lower "
                                 f"{flag_of('seq')} or raise {flag_of('max_seq_len')}")
    need(t.strategy in STRATEGIES, f"train.strategy: unknown strategy {t.strategy!r}; fix: pass "
                                   f"{flag_of('strategy')} with one of {', '.join(STRATEGIES)}")
    need(t.remat in REMAT, f"train.remat: unknown remat {t.remat!r}; fix: pass {flag_of('remat')} with one of "
                           f"{', '.join(REMAT)}")
    need(t.optimizer in OPTIMIZERS,
         f"train.optimizer: unknown optimizer {t.optimizer!r}; fix: pass {flag_of('optimizer')} with one of "
         f"{', '.join(OPTIMIZERS)}")


def _validate_delays(t: TrainConfig, m: ModelConfig) -> None:
    """The asynchronous-pipeline emulation: stages that divide the layers, and their delays."""
    need(t.pipeline_delay >= 1, f"train.pipeline_delay: must be >= 1, got {t.pipeline_delay}; fix: pass "
                                f"{flag_of('pipeline_delay')} S >= 1")
    need(m.n_layers % t.pipeline_delay == 0,
         f"train.pipeline_delay: {t.pipeline_delay} stages do not divide n_layers={m.n_layers}; "
         f"fix: pass {flag_of('pipeline_delay')} with a divisor of {m.n_layers}")
    _validate_delay_schedule(t)


def _validate_rotation(t: TrainConfig) -> None:
    """The rotation optimizer's basis: its source, geometry, order and sizes."""
    need(t.rot_source in ROT_SOURCES, f"train.rot_source: {t.rot_source!r}; fix: pass {flag_of('rot_source')} "
                                      f"{' or '.join(ROT_SOURCES)}")
    need(t.rot_geometry in ROT_GEOMETRIES,
         f"train.rot_geometry: {t.rot_geometry!r}; fix: pass {flag_of('rot_geometry')} {' or '.join(ROT_GEOMETRIES)}")
    need(t.rot_order in ROT_ORDERS, f"train.rot_order: {t.rot_order!r}; fix: pass {flag_of('rot_order')} "
                                    f"{' or '.join(ROT_ORDERS)}")
    need(t.rot_order == "previous" or t.rot_source == "second",
         f"train.rot_order: 'current' needs rot_source 'second' (got {t.rot_source!r}); "
         f"fix: pass {flag_of('rot_source')} second or {flag_of('rot_order')} previous")
    for name in ("rot_refresh", "rot_max_dim"):
        v = getattr(t, name)
        need(v > 0, f"train.{name}: must be positive, got {v}; fix: pass {flag_of(name)} N with N >= 1")


def _validate_optimizer_settings(t: TrainConfig) -> None:
    """PipeDream-LR's T_c, NAdam's momentum decay, the clipping scope and the rotation's damping and EMA."""
    need(t.delay_lr_tc >= 0, f"train.delay_lr_tc: must be >= 0 (0 = 7/3 of the warmup), got {t.delay_lr_tc}; "
                             f"fix: pass {flag_of('delay_lr_tc')} 0 or N >= 1")
    need(t.nesterov_psi == -1 or 0 <= t.nesterov_psi < 1e3,
         f"train.nesterov_psi: {t.nesterov_psi} must be -1 (scaled to the run) or in [0, 1000); fix: pass "
         f"{flag_of('nesterov_psi')} -1 or e.g. 0.004")
    need(t.clip_scope in CLIP_SCOPES, f"train.clip_scope: {t.clip_scope!r}; fix: pass {flag_of('clip_scope')} "
                                      f"{' or '.join(CLIP_SCOPES)}")
    need(t.clip_scope == "global" or t.optimizer != "adam8bit",
         f"train.clip_scope: 'stage' with adam8bit, whose clipping is fused and global; fix: pass "
         f"{flag_of('clip_scope')} global or another {flag_of('optimizer')}")
    need(math.isfinite(t.rot_damping) and t.rot_damping >= 0,
         f"train.rot_damping: {t.rot_damping} must be finite and >= 0; fix: pass {flag_of('rot_damping')} 4.0 "
         "(0 = exact eigh)")
    need(0.0 <= t.rot_beta < 1.0, f"train.rot_beta: {t.rot_beta} outside [0, 1); fix: pass e.g. "
                                  f"{flag_of('rot_beta')} 0.95")


def _validate_delay_schedule(t: TrainConfig) -> None:
    """--delay-schedule: a known name; the baselines built on PipeDream's per-stage delays refuse 2bw."""
    flag = flag_of("delay_schedule")
    need(t.delay_schedule in DELAY_SCHEDULES, f"train.delay_schedule: {t.delay_schedule!r}; fix: pass {flag} "
                                              f"{' or '.join(DELAY_SCHEDULES)}")
    if t.delay_schedule == "2bw" and t.pipeline_delay > 1:
        need(t.optimizer != "pipedream-lr" and not t.stage_aware_refresh,
             f"train.delay_schedule: 2bw gives every stage delay 1, and pipedream-lr / "
             f"{flag_of('stage_aware_refresh')} scale by PipeDream's per-stage delays; fix: pass {flag} pipedream "
             f"or another {flag_of('optimizer')} without {flag_of('stage_aware_refresh')}")


def _validate_init_factor(t: TrainConfig, m: ModelConfig) -> None:
    """--init-factor / --calib-tokens (`boostjax.interop.pretrained`; the data's size: `check_calibration`
    there, whether anything is factored at all: `boostjax.training.prepare.configure`)."""
    flag, calib = flag_of("init_factor"), flag_of("calib_tokens")
    need(t.init_factor in INIT_FACTORS, f"train.init_factor: {t.init_factor!r}; fix: pass {flag} "
                                        f"{' or '.join(INIT_FACTORS)}")
    need(t.calib_tokens >= 0, f"train.calib_tokens: must be >= 0 (0 = {DEFAULT_CALIB_TOKENS}), got "
                              f"{t.calib_tokens}; fix: pass {calib} N with N >= 1")
    _validate_rank_budget(t, m)
    measured = t.rank_budget and t.rank_policy == "sensitivity"
    if t.init_factor not in CALIBRATED_FACTORS and not measured:
        need(t.calib_tokens == 0, f"train.calib_tokens: {t.calib_tokens} calibration tokens, but {flag} "
                                  f"{t.init_factor} reads no data; fix: drop {calib} or pass {flag} whitened")
        return
    what = t.init_factor if t.init_factor in CALIBRATED_FACTORS else "--rank-policy sensitivity"
    need(m.low_rank, f"train.init_factor: {what} factors pretrained weights for a low-rank model, and "
                     f"{flag_of('kind')} {m.kind} keeps them dense; fix: pass {flag_of('kind')} svd, cola or lax, "
                     f"or drop {flag}")
    need(bool(t.data), f"train.init_factor: {what} fits the factors to activations on {flag_of('data')}, and "
                       f"none is given (the built-in corpus is bytes, not the checkpoint's tokens); fix: pass "
                       f"{flag_of('data')} with text tokenised for the checkpoint, or {flag} svd")


def _validate_factor_lr(t: TrainConfig, m: ModelConfig) -> None:
    """--factor-lr a name; start-rms with AdamW's chain (adamw, pipedream-lr) and a low-rank kind."""
    flag = flag_of("factor_lr")
    need(t.factor_lr in FACTOR_LRS, f"train.factor_lr: {t.factor_lr!r}; fix: pass {flag} {' or '.join(FACTOR_LRS)}")
    if t.factor_lr == "fixed":
        return
    need(t.optimizer in ("adamw", "pipedream", "pipedream-lr"),
         f"train.factor_lr: start-rms scales AdamW's direction, and {flag_of('optimizer')} is {t.optimizer}; "
         f"fix: pass {flag_of('optimizer')} adamw, or {flag} fixed")
    need(m.low_rank, f"train.factor_lr: start-rms steps low-rank factors, and {flag_of('kind')} {m.kind} has none; "
                     f"fix: pass {flag_of('kind')} svd, cola or lax, or drop {flag}")


def _validate_rank_budget(t: TrainConfig, m: ModelConfig) -> None:
    """--rank-budget F in (0, 1) (0: unset), with --init-from-hf and a low-rank kind; --rank-policy a name."""
    flag = flag_of("rank_budget")
    need(t.rank_policy in RANK_POLICIES, f"train.rank_policy: {t.rank_policy!r}; fix: pass "
                                         f"{flag_of('rank_policy')} {' or '.join(RANK_POLICIES)}")
    b = t.rank_budget
    need(isinstance(b, (int, float)) and not isinstance(b, bool) and (b == 0 or 0 < b < 1),
         f"train.rank_budget: {b!r} is not a share of the projection parameters; fix: pass {flag} F with "
         f"0 < F < 1 (e.g. 0.5 for half)")
    if b:
        need(bool(t.init_from_hf), f"train.rank_budget: {flag} shares out a pretrained model's parameters, and "
                                   f"no {flag_of('init_from_hf')} is given; fix: pass {flag_of('init_from_hf')} "
                                   f"PATH, or --rank R")
        need(m.low_rank, f"train.rank_budget: {flag_of('kind')} {m.kind} keeps every projection dense; fix: pass "
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
    need(t.grad_accum >= 1, f"train.grad_accum: must be >= 1 (1 = no accumulation), got {t.grad_accum}; "
                            f"fix: pass {accum} N with N >= 1")
    need(t.batch * t.grad_accum * t.seq <= MAX_TOKENS,
         f"train.grad_accum: batch x grad_accum x seq = {t.batch} x {t.grad_accum} x {t.seq} tokens per step "
         f"exceeds {MAX_TOKENS}; fix: lower {accum}, {flag_of('batch')} or {flag_of('seq')}")
    need(t.zero in ZERO_STAGES, f"train.zero: unknown ZeRO stage {t.zero}; fix: pass {zero} 0 (replicated), "
                                "1 (optimizer state over data) or 3 (parameters too)")
    if t.offload_plan:
        need(t.grad_accum == 1, "train.grad_accum: an offload plan budgets one batch per step and no gradient "
                                f"accumulator; fix: drop {accum} or {plan}")
        need(t.zero == 0, "train.zero: an offload plan budgets each device's state unsplit over data (ZeRO is not "
                          f"planned); fix: drop {zero} or {plan}")


def _validate_doc_mask(t: TrainConfig, m: ModelConfig) -> None:
    """`doc_mask`: segment ids reach the chunked/xla attention (not cuDNN; a pipeline refuses them:
    `boostjax.placement.pipeline.check_pipeline`)."""
    if not t.doc_mask:
        return
    need(m.attention != "cudnn", "train.doc_mask: cuDNN attention takes no segment ids; "
                                 f"fix: pass {flag_of('attention')} chunked (or auto) or drop {flag_of('doc_mask')}")


def _validate_pipeline(t: TrainConfig) -> None:
    """The pipeline fields themselves (what a `stage` mesh needs of them: `boostjax.placement.check`)."""
    need(t.microbatches >= 0, f"train.microbatches: must be >= 0 (0 = auto), got {t.microbatches}; "
                              f"fix: pass {flag_of('microbatches')} M with M >= 1")
    need(t.pipeline_schedule in PIPELINE_SCHEDULES,
         f"train.pipeline_schedule: unknown schedule {t.pipeline_schedule!r}; fix: pass "
         f"{flag_of('pipeline_schedule')} with one of {', '.join(PIPELINE_SCHEDULES)}")
