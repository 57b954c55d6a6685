"""Sharding as data: one `PartitionSpec` table and one `Collectives` setting per TP strategy.

Keys are the last one or two path entries of a parameter (`attn/a_qkv`, `embed`, ...). Shapes are
stored `[in, out]`; grouped tensors carry their group axis (`a_qkv: [d, 3, r]`, `b_kv: [2, r, k·e]`).

- fullrank-tp (Megatron): q/k/v/gate/up column-parallel, o/down row-parallel; psum after o and down.
- vanilla-tp: every low-rank pair is one chunk: A splits r (column), B splits r (row); psum of
  `[b, t, d_out]` after each pair. Attention runs replicated on all heads.
- btp: residual stream sharded along d; every A row-parallel (psum of `[b, t, r]`, carrying the
  norm's Σx²), every B column-parallel (no communication), local heads, local embedding columns.
All strategies use a vocabulary-parallel LM head and cross-entropy.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from boostjax.sharding.collectives import Collectives

M = "model"

_HEAD = {"embed": P(), "norm": P(), "head": P(None, M)}

SPECS: dict[str, dict[str, P]] = {
    "none": {},
    "fullrank-tp": {
        **_HEAD,
        "attn/w_q": P(None, M), "attn/w_k": P(None, M), "attn/w_v": P(None, M), "attn/w_o": P(M, None),
        "mlp/w_gate": P(None, M), "mlp/w_up": P(None, M), "mlp/w_down": P(M, None),
    },
    "vanilla-tp": {
        **_HEAD,
        "attn/a_qkv": P(None, None, M), "attn/b_q": P(M, None), "attn/b_kv": P(None, M, None),
        "attn/a_o": P(None, M), "attn/b_o": P(M, None),
        "mlp/a_gate_up": P(None, None, M), "mlp/b_gate_up": P(None, M, None),
        "mlp/a_down": P(None, M), "mlp/b_down": P(M, None),
    },
    "btp": {
        **_HEAD, "embed": P(None, M),
        "attn/norm": P(M), "attn/a_qkv": P(M, None, None), "attn/b_q": P(None, M),
        "attn/b_kv": P(None, None, M), "attn/a_o": P(M, None), "attn/b_o": P(None, M),
        "mlp/norm": P(M), "mlp/a_gate_up": P(M, None, None), "mlp/b_gate_up": P(None, None, M),
        "mlp/a_down": P(M, None), "mlp/b_down": P(None, M),
    },
}

COLLECTIVES: dict[str, Collectives] = {
    "none": Collectives(),
    "fullrank-tp": Collectives(axis=M, row=True),
    "vanilla-tp": Collectives(axis=M, up=True),
    "btp": Collectives(axis=M, latent=True, features_sharded=True),
}

# which model kinds a strategy serves
KINDS: dict[str, tuple[str, ...]] = {
    "none": ("llama", "cola", "svd", "lax"),
    "fullrank-tp": ("llama",),
    "vanilla-tp": ("cola", "svd", "lax"),
    "btp": ("cola", "svd", "lax"),
}


def _key(path) -> tuple[str, str]:
    names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    return "/".join(names[-2:]), names[-1]


def param_specs(strategy: str, params: Any) -> Any:
    """A pytree of `PartitionSpec`s matching `params` (replicated where the table is silent)."""
    table = SPECS[strategy]

    def spec(path, _):
        two, one = _key(path)
        return table.get(two, table.get(one, P()))

    return jax.tree_util.tree_map_with_path(spec, params)


DATA = "data"


def data_sharded(spec: P, shape: tuple[int, ...], data: int) -> P:
    """`spec` with the `data` axis added to the first dimension that is unsharded and divisible by
    `data` (ZeRO's partitioning of optimizer state and, at stage 3, parameters over data-parallel
    replicas: https://arxiv.org/abs/1910.02054); unchanged when no dimension qualifies, when the
    spec already uses `data`, or when `data` is 1."""
    used = {a for s in spec for a in (s if isinstance(s, tuple) else (s,)) if a is not None}
    if data <= 1 or DATA in used:
        return spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for i, (s, n) in enumerate(zip(entries, shape)):
        if s is None and n >= data and n % data == 0:
            entries[i] = DATA
            return P(*entries)
    return spec
