"""Compatibility names over `boostjax.sharding.rules` (the strategy registry and the logical-axis
rules), kept until the pipeline and strategy modules call `rules` directly."""

from __future__ import annotations

import functools
from typing import Any

import jax

from boostjax.models.collectives import Collectives
from boostjax.sharding import rules
from boostjax.sharding.rules import data_sharded

__all__ = ["COLLECTIVES", "KINDS", "data_sharded", "param_specs"]

COLLECTIVES: dict[str, Collectives] = {k: s.collectives for k, s in rules.STRATEGIES.items()}
KINDS: dict[str, tuple[str, ...]] = {k: s.kinds for k, s in rules.STRATEGIES.items()}

_by_name = functools.cache(rules.axes_by_name)


def param_specs(strategy: str, params: Any) -> Any:
    """A `PartitionSpec` per leaf of `params` (canonical, or stacked: then each layer's spec, without the
    layer axis), from the axes its parameter declares (found by the last one or two path entries)."""
    table = _by_name()

    def axes(path, leaf):
        names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        key = "/".join(names[-2:])
        if key not in table:
            raise ValueError(f"{'/'.join(names)}: no parameter of the model is named {key!r}; fix: pass the model's params")
        return table[key]

    return rules.param_specs(strategy, jax.tree_util.tree_map_with_path(axes, params))
