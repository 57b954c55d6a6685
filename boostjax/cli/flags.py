"""Flags made from the configuration fields: one per field, with its name, type, choices, default and help
all read from the field (`boostjax.config.option`). Every command that takes a field's flag (train,
plan, comm, ...) builds it here, so the commands that share a flag share its default, choices and help,
and `model_from` / `train_from` turn those flags into the same configuration whichever command parsed them.

Each flag's argparse default is None (so a command can tell a given flag from a default one: `train`
keeps a resumed run's stored value of a FOLLOW_STORED field it was not given); the effective default,
the field's, is shown in the help and kept on the action as `config_default`.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any, Iterable, Sequence

from boostjax.config import (CONFIG_CLASSES, DEFAULT_PRESET, PRESETS, Config, ModelConfig, TrainConfig, config_field,
                             field_default, field_names, flag_of, help_of, preset)

_HINTS: dict[str, Any] = {name: hint for cls in CONFIG_CLASSES for name, hint in typing.get_type_hints(cls).items()}
MODEL_FIELDS: tuple[str, ...] = tuple(field_names(ModelConfig))
TRAIN_FIELDS: tuple[str, ...] = tuple(field_names(TrainConfig))
PRESET_HELP = (f"model shapes: one of {', '.join(PRESETS)}; the model flags override single fields "
               f"(default: {DEFAULT_PRESET!r})")
MODEL_GROUP = "model (--preset, then single fields)"
# `boostjax train --help` by concern: every ModelConfig / TrainConfig field in exactly one group (checked
# when the parser is built, `add_train_flags`); --preset opens MODEL_GROUP.
TRAIN_GROUPS: dict[str, tuple[str, ...]] = {
    "run": ("out", "steps", "seed", "dtype"),
    "data and batch": ("data", "data_dtype", "doc_mask", "batch", "seq", "grad_accum"),
    MODEL_GROUP: ("kind", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "attn_head_dim",
                  "max_seq_len", "tie_embeddings", "norm_eps", "init_std", "only_lr_act"),
    "low-rank projections (cola, svd, lax)": ("rank", "rank_attn", "rank_kv", "rank_mlp", "auto_dense"),
    "attention and positions": ("attention", "attention_block", "rope_theta", "rope_type", "rope_factor",
                                "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len"),
    "special tokens (written to exports, read by generate)": ("bos_token_id", "eos_token_ids", "pad_token_id"),
    "optimisation": ("optimizer", "lr", "min_lr_ratio", "warmup", "weight_decay", "b1", "b2", "clip", "clip_scope", "factor_lr",
                     "nesterov_psi"),
    "rotation optimizer (--optimizer rotation)": ("rot_source", "rot_geometry", "rot_refresh", "rot_beta",
                                                  "rot_max_dim", "rot_order", "rot_damping", "stage_aware_refresh"),
    "asynchronous pipeline emulation (--pipeline-delay)": ("pipeline_delay", "delay_schedule", "delay_lr_tc"),
    "parallelism": ("mesh", "strategy", "zero", "microbatches", "pipeline_schedule"),
    "memory": ("remat", "offload_plan"),
    "multi-host": ("coordinator", "num_processes", "process_id", "init_timeout"),
    "checkpoints": ("ckpt_every", "keep_ckpts"),
    "observability": ("log_every", "eval_every", "eval_batches", "eval_at_start", "progress", "tensorboard", "profile",
                      "hardware"),
    "distillation (--distill-from)": ("distill_from", "distill_temperature", "distill_weight"),
    "initialisation from a pretrained checkpoint": ("init_from_hf", "init_factor", "calib_tokens", "rank_budget",
                                                    "rank_policy"),
}


def _shown_default(name: str) -> str:
    """The default a field's help shows: the field's, or the default preset's for a field presets set."""
    value = field_default(name)
    if name in MODEL_FIELDS:
        by_preset = getattr(PRESETS[DEFAULT_PRESET], name)
        if any(getattr(m, name) != value for m in PRESETS.values()):
            return f"the preset's; {by_preset!r} with {DEFAULT_PRESET}"
    return repr(value)


def field_help(name: str) -> str:
    """The help of a field's flag: the field's help text and its default (argparse-escaped)."""
    return f"{help_of(name)} (default: {_shown_default(name)})".replace("%", "%%")


def add_preset(parser: Any) -> argparse.Action:
    """`--preset`, as every command taking the model flags has it (default: `DEFAULT_PRESET`)."""
    action = parser.add_argument("--preset", default=None, help=PRESET_HELP)
    action.config_default = DEFAULT_PRESET
    return action


def add_field(parser: Any, name: str) -> argparse.Action:
    """The flag of one config field: a bool has its negated form too (`--no-...`), a `Literal` offers its values
    as choices, the mesh is text (TrainConfig parses it, once)."""
    config_field(name)  # an unknown name fails here, not as a missing flag
    kind = _HINTS[name]
    kw: dict[str, Any] = {"dest": name, "default": None, "help": field_help(name)}
    if kind is bool:
        kw["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is typing.Literal:
        kw["choices"] = typing.get_args(kind)
        kw["type"] = type(kw["choices"][0])
    else:
        kw["type"] = kind if kind in (int, float) else str
    action = parser.add_argument(flag_of(name), **kw)
    action.config_default = field_default(name)
    return action


def add_fields(parser: argparse.ArgumentParser, names: type | Iterable[str], title: str) -> list[str]:
    """One flag per field (`--d-model`, `--lr`, ...) in an argument group `title`: every field of a config
    dataclass, or the named fields. Returns the field names."""
    group = parser.add_argument_group(title)
    names = field_names(names) if isinstance(names, type) else list(names)
    for name in names:
        add_field(group, name)
    return names


def check_groups(groups: dict[str, tuple[str, ...]]) -> None:
    """Every ModelConfig / TrainConfig field in exactly one of `groups` (ValueError naming the first that is not)."""
    seen = [name for names in groups.values() for name in names]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    missing = [n for n in (*MODEL_FIELDS, *TRAIN_FIELDS) if n not in seen]
    unknown = [n for n in seen if n not in MODEL_FIELDS and n not in TRAIN_FIELDS]
    for bad, what in ((twice, "is in two groups"), (missing, "is in no group"), (unknown, "is not a field")):
        if bad:
            raise ValueError(f"TRAIN_GROUPS: {bad[0]} {what}; fix: list every config field once in "
                             "boostjax.cli.flags.TRAIN_GROUPS")


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """`--preset` and the flag of every config field, in `TRAIN_GROUPS`' groups (`boostjax train`)."""
    check_groups(TRAIN_GROUPS)
    for title, names in TRAIN_GROUPS.items():
        group = parser.add_argument_group(title)
        if title == MODEL_GROUP:
            add_preset(group)
        for name in names:
            add_field(group, name)


def add_run_flags(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """`--preset` and the flags of `names` (model fields first, in one group; then the training fields), as
    `boostjax train` has them: a command that models a run takes its flags with train's defaults."""
    model = [n for n in names if n in MODEL_FIELDS]
    train = [n for n in names if n in TRAIN_FIELDS]
    group = parser.add_argument_group("model (as boostjax train takes it: --preset, then single fields)")
    add_preset(group)
    for name in model:
        add_field(group, name)
    add_fields(parser, train, "run (as boostjax train takes it)")


def given(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The config fields among `names` that the command line gave (not None)."""
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


def model_from(args: argparse.Namespace, names: Iterable[str], **over: Any) -> ModelConfig:
    """The model `--preset` and the given model flags among `names` describe (`over` wins)."""
    fields = {k: v for k, v in given(args, names).items() if k in MODEL_FIELDS}
    return preset(getattr(args, "preset", None) or DEFAULT_PRESET, **{**fields, **over})


def train_from(args: argparse.Namespace, names: Iterable[str], **over: Any) -> TrainConfig:
    """The `TrainConfig` of the given training flags among `names` (`over` wins); the rest at train's defaults."""
    fields = {k: v for k, v in given(args, names).items() if k in TRAIN_FIELDS}
    return TrainConfig(**{**fields, **over})


def config_from(args: argparse.Namespace, names: Iterable[str], **over: Any) -> Config:
    """The `Config` `boostjax train` would make from the same flags (unvalidated; `over`: field values
    that win, model or training)."""
    names = list(names)
    m_over = {k: v for k, v in over.items() if k in MODEL_FIELDS}
    t_over = {k: v for k, v in over.items() if k in TRAIN_FIELDS}
    return Config(model_from(args, names, **m_over), train_from(args, names, **t_over))


def renamed(e: Exception, command: str) -> str:
    """A `train.*` message of the shared validation, renamed to the command whose flag it came from."""
    text = str(e)
    return f"{command}.{text[len('train.'):]}" if text.startswith("train.") else text
