"""What a config field is: its dataclass metadata (`option`) holds the help text (what the CLI's help
shows), the flag (`flag_of`), what a resumed run may do with it (`boostjax.runs.folder` derives its sets
from `resume_of`) and, for a field added after runs existed, the value a config.json without it means
(`legacy`). `register` makes the ModelConfig and TrainConfig fields known here by name."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import field, fields
from typing import Any, Literal, get_args

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


_FIELDS: dict[str, dataclasses.Field] = {}


def register(*classes: type) -> tuple[type, ...]:
    """Make the fields of `classes` (ModelConfig, TrainConfig) the ones `config_field` knows; they share
    no name (one flag each). Returns `classes`."""
    named = [f for cls in classes for f in fields(cls)]
    twice = sorted(name for name, n in Counter(f.name for f in named).items() if n > 1)
    if twice:
        raise ValueError(f"register: the field {twice[0]!r} is in two config classes; fix: rename one "
                         "(every field has its own flag)")
    _FIELDS.clear()
    _FIELDS.update({f.name: f for f in named})
    return classes


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


def field_names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]
