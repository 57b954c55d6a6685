"""Per-group ranks for a share of a model's projection parameters (`train --rank-budget F --rank-policy P`).

A projection group (`PROJECTION_GROUPS`: attn = q, o; kv = k, v; mlp = gate, up, down) of rank r holds
r (in + out) parameters per matrix and layer; a group whose factors would not be smaller than its dense
matrices (r (in + out) >= in x out) stays dense (`ModelConfig.auto_dense`).

- `uniform`: one rank r for every group (CoLA's single rank), the largest whose projections fit.
- `fraction`: every group keeps the same share of its own parameters, r = floor(f in out / (in + out)).
- `sensitivity`: the ranks (per group) that minimise the summed whitened truncation loss of all matrices
  under the budget (as SVD-LLM V2 and Dobi-SVD, https://arxiv.org/abs/2502.02723, allocate by measured loss):
  a matrix whose whitened spectrum `σ` falls slowly loses more per dropped rank and gets more of it.
  `truncation_loss` is one matrix's loss against the rank, `allocate` the exact search over the groups.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from boostjax.config import PROJECTION_GROUPS, ConfigError, ModelConfig

GROUP_MATRICES: dict[str, tuple[str, ...]] = {"attn": ("q", "o"), "kv": ("k", "v"), "mlp": ("gate", "up", "down")}
RANK_POLICIES: tuple[str, ...] = ("uniform", "sensitivity")  # what `train --rank-policy` offers

Ranks = dict[str, "int | None"]  # group -> rank, None = dense


def _dense_or(r: int, i: int, o: int) -> int | None:
    return r if r * (i + o) < i * o else None


def projection_params(m: ModelConfig, ranks: Mapping[str, int | None]) -> int:
    """Parameters of every layer's projections: a group of rank r holds r (in + out) per matrix, a dense
    one (rank None or absent) in x out."""
    total = 0
    for g, names in GROUP_MATRICES.items():
        (i, o), r = m.group_shape(g), ranks.get(g)
        total += len(names) * (i * o if r is None else r * (i + o))
    return total * m.n_layers


def check_fraction(fraction: Any, field: str = "train.rank_budget") -> float:
    """`fraction` as a float in (0, 1); ConfigError naming `field` otherwise."""
    ok = isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0.0 < float(fraction) < 1.0
    if not ok:
        raise ConfigError(f"{field}: {fraction!r} is not a share of the projection parameters; fix: pass "
                          "--rank-budget F with 0 < F < 1 (e.g. 0.5 for half)")
    return float(fraction)


def ranks_for_budget(m: ModelConfig, fraction: float, policy: str = "uniform") -> Ranks:
    """Per-group ranks (None: dense) for about `fraction` of the dense projection parameters of `m`
    (policy `uniform` or `fraction`, see the module docstring; `sensitivity` needs measured losses:
    `allocate`). ConfigError when no rank fits."""
    fraction = check_fraction(fraction)
    shapes = {g: m.group_shape(g) for g in GROUP_MATRICES}
    if policy == "fraction":
        return {g: _dense_or(max(1, int(fraction * i * o / (i + o))), i, o) for g, (i, o) in shapes.items()}
    if policy != "uniform":
        raise ConfigError(f"train.rank_policy: {policy!r} needs no measurement here; fix: pass uniform or fraction "
                          "(sensitivity: allocate)")
    budget = fraction * projection_params(m, {})
    best = None
    for r in range(1, max(min(s) for s in shapes.values()) + 1):  # the count is non-decreasing in r
        if projection_params(m, {g: _dense_or(r, i, o) for g, (i, o) in shapes.items()}) <= budget:
            best = r
    if best is None:
        raise ConfigError(f"train.rank_budget: no rank fits {fraction:.0%} of the projection parameters; fix: pass "
                          "a larger --rank-budget")
    return {g: _dense_or(best, i, o) for g, (i, o) in shapes.items()}


def rank_fields(m: ModelConfig, ranks: Mapping[str, int | None]) -> dict[str, int]:
    """ModelConfig fields for `ranks`: `rank` (the largest) and `rank_<group>`; a dense group gets its full
    rank min(in, out), which `auto_dense` keeps dense."""
    per = {f"rank_{g}": (r if r is not None else min(m.group_shape(g))) for g, r in ranks.items()}
    low = [r for r in ranks.values() if r is not None]
    return {"rank": max(low) if low else max(per.values()), **per}


def truncation_loss(sigma: Sequence[float]) -> np.ndarray:
    """loss[k] = Σ_{j>=k} σ_j² / Σ_j σ_j² for k = 0..len(σ): the relative squared output error of keeping
    the top k whitened singular values (`factor_whitened`'s spectrum; 0 at full rank)."""
    s2 = np.asarray(sigma, np.float64) ** 2
    total = float(s2.sum())
    tail = np.concatenate([np.cumsum(s2[::-1])[::-1], [0.0]])
    return tail / total if total > 0 else np.zeros(len(s2) + 1)


def allocate(m: ModelConfig, losses: Mapping[str, Sequence[np.ndarray]], fraction: float) -> Ranks:
    """The per-group ranks (None: dense) minimising Σ_groups Σ_matrices loss_m(r_g) with the projection
    parameters at most `fraction` of the dense ones: every (attn, kv) pair of ranks with the largest mlp
    rank that still fits (each loss falls with the rank), so the search is exact. `losses[g]`: the
    `truncation_loss` of each matrix of group g (all layers)."""
    fraction = check_fraction(fraction)
    budget = fraction * projection_params(m, {})
    per: dict[str, tuple[np.ndarray, np.ndarray, list[int | None]]] = {}
    for g in PROJECTION_GROUPS:
        (i, o) = m.group_shape(g)
        n = min(i, o)
        curve = np.sum([np.asarray(l_k, np.float64)[: n + 1] for l_k in losses[g]], axis=0)
        rs: list[int | None] = [r for r in range(1, n + 1) if _dense_or(r, i, o) is not None] + [None]
        cost = np.array([len(GROUP_MATRICES[g]) * m.n_layers * (i * o if r is None else r * (i + o)) for r in rs],
                        np.float64)
        loss = np.array([0.0 if r is None else curve[r] for r in rs])
        per[g] = (cost, loss, rs)
    best, choice = np.inf, None
    (ca, la, ra), (ck, lk, rk), (cm, lm, rm) = per["attn"], per["kv"], per["mlp"]
    for a in range(len(ra)):
        left = budget - ca[a] - ck  # [kv choices]
        # the largest mlp option within what is left (costs increase along rm)
        j = np.searchsorted(cm, left, side="right") - 1
        ok = j >= 0
        if not ok.any():
            continue
        total = la[a] + lk[ok] + lm[j[ok]]
        k = int(np.argmin(total))
        if total[k] < best:
            best, choice = float(total[k]), (ra[a], np.asarray(rk, object)[ok][k], rm[int(j[ok][k])])
    if choice is None:
        raise ConfigError(f"train.rank_budget: no ranks fit {fraction:.0%} of the projection parameters; fix: pass "
                          "a larger --rank-budget")
    return dict(zip(PROJECTION_GROUPS, choice))


def budget_report(m: ModelConfig, ranks: Mapping[str, int | None], fraction: float, policy: str,
                  losses: Mapping[str, Sequence[np.ndarray]] | None = None) -> dict[str, Any]:
    """Where the parameters went: per group its rank (or "dense"), parameters and share of the total, and
    for a measured policy its summed truncation loss; the budget and what was used of it."""
    dense = projection_params(m, {})
    groups = {}
    for g in PROJECTION_GROUPS:
        (i, o), r = m.group_shape(g), ranks.get(g)
        p = len(GROUP_MATRICES[g]) * m.n_layers * (i * o if r is None else r * (i + o))
        groups[g] = {"rank": "dense" if ranks.get(g) is None else ranks[g], "params": int(p)}
        if losses is not None:
            groups[g]["loss"] = 0.0 if r is None else float(sum(np.asarray(l_k)[r] for l_k in losses[g]))
    used = projection_params(m, ranks)
    for g in groups:
        groups[g]["share_of_used"] = groups[g]["params"] / used if used else 0.0
    return {"policy": policy, "fraction": fraction, "dense_projection_params": dense, "projection_params": used,
            "used_fraction": used / dense, "groups": groups}
