"""What every field check shares: `need` (raise `ConfigError` with the message unless `ok`) and
`check_types` (every field holds its declared type)."""

from __future__ import annotations

import math
import typing
from dataclasses import fields
from typing import Any, Literal, get_args

from boostjax.config.fields import flag_of, negated_flag_of
from boostjax.config.names import MESH_AXES, ConfigError


def need(ok: bool, msg: str) -> None:
    """Raise `ConfigError(msg)` unless `ok`."""
    if not ok:
        raise ConfigError(msg)


def check_types(obj: Any, prefix: str) -> None:
    """Every field holds its declared type (the Python API takes any object; the CLI parses flags).
    Floats must be finite: NaN slips through every comparison, and inf is never a setting."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        v, kind, flag = getattr(obj, f.name), hints[f.name], flag_of(f.name)
        if kind is bool:
            need(isinstance(v, bool), f"{prefix}.{f.name}: must be true or false, got {v!r}; fix: pass {flag} "
                                      f"or {negated_flag_of(f.name)}")
        elif kind is int:
            need(isinstance(v, int) and not isinstance(v, bool),
                 f"{prefix}.{f.name}: must be an integer, got {v!r}; fix: pass {flag} N")
        elif kind is float:
            need(isinstance(v, (int, float)) and not isinstance(v, bool),
                 f"{prefix}.{f.name}: must be a number, got {v!r}; fix: pass {flag} X")
            need(math.isfinite(v), f"{prefix}.{f.name}: must be a finite number, got {v}; "
                                   f"fix: pass {flag} with a finite value (default {f.default!r})")
        elif f.name == "mesh":  # a MeshShape or None (the constructor parsed a string); its sizes positive ints
            bad = v is not None and not all(type(getattr(v, a)) is int and getattr(v, a) >= 1 for a in MESH_AXES)
            need(not bad, f"{prefix}.mesh: {v!r} has a size that is not an integer >= 1; "
                          f"fix: pass e.g. {flag} data=2,model=4 or MeshShape(data=2, model=4)")
        elif typing.get_origin(kind) is Literal and all(isinstance(x, int) for x in get_args(kind)):
            need(isinstance(v, int) and not isinstance(v, bool),
                 f"{prefix}.{f.name}: must be an integer, got {v!r}; fix: pass {flag} N")
        else:  # str and Literal[str, ...]
            need(isinstance(v, str), f"{prefix}.{f.name}: must be a string, got {v!r}; fix: pass {flag} TEXT")
