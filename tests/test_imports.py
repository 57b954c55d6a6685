"""The package's import structure: exported functions are never shadowed by a submodule."""

from __future__ import annotations

import importlib
import pkgutil
import types
from pathlib import Path

import boostjax

PACKAGE = Path(boostjax.__file__).parent


def _modules() -> list[str]:
    """Every module of the package, dotted (`boostjax.models.llama`), packages included."""
    return sorted(m.name for m in pkgutil.walk_packages([str(PACKAGE)], prefix="boostjax."))


def test_no_submodule_shares_an_exported_name():
    top = {m.rpartition(".")[2] for m in _modules() if m.count(".") == 1}
    assert not top & set(boostjax.__all__), f"submodules named like exports: {sorted(top & set(boostjax.__all__))}"


def test_exported_functions_stay_functions_after_every_submodule_is_imported():
    for name in _modules():
        importlib.import_module(name)
    from boostjax import evaluate, generate, train  # noqa: PLC0415

    for fn, home in ((train, "boostjax.trainer"), (evaluate, "boostjax.evaluation"),
                     (generate, "boostjax.generation")):
        assert not isinstance(fn, types.ModuleType) and callable(fn)
        assert fn is getattr(importlib.import_module(home), fn.__name__)
        assert getattr(boostjax, fn.__name__) is fn
