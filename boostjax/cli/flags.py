"""Flags made from the configuration fields: one per field, with its name, type, choices, default and help
all read from the field (`boostjax.config.option`). Every command that takes a field's flag (train,
plan, comm, ...) builds it here, so the commands that share a flag share its default, choices and help,
and `config_from` turns those flags into the same `Config` whichever command parsed them.

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
