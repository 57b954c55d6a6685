"""The named baseline policies (no offload, full remat, MegaTrain-style streaming) and a brute-force
search over tiny instances, both scored by the shared `simulate`."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Sequence

from boostjax.offload.costmodel import ALL, BOUNDARY, PlanInstance
from boostjax.offload.decisions import Decisions, flat_allowed, fwd_window
from boostjax.offload.planfile import Plan, PlanInfeasible, make_plan, simulate

BASELINES: tuple[str, ...] = ("no-offload", "full-remat", "megatrain")


# ----------------------------------------------------------------------------- baselines


def _pick_mode(inst: PlanInstance, order: Sequence[str]) -> str:
    return next(m for m in order if m in inst.param_modes)


def _uniform(inst: PlanInstance, boundary: Sequence[str], inner: str, mode: str, flat: bool = False) -> Decisions:
    L = inst.n_layers
    streams = mode in ("opt-host", "host")
    d = Decisions(boundary=tuple(boundary), inner=(inner,) * L, mode=(mode,) * L,
                  offload_lag=(0,) * L, fetch_lead=tuple(1 if b == "host" else 0 for b in boundary),
                  param_fwd_lead=(1 if streams else 0,) * L, param_bwd_lead=(1 if mode == "host" else 0,) * L,
                  grad_lag=(1 if streams else 0,) * L)
    if flat and flat_allowed(inst) and inner == BOUNDARY:
        f = [False] * L
        for s, e in d.segments():
            f[s] = e - s >= 2
        d = replace(d, flat=tuple(f))
    return d


def baseline_decisions(inst: PlanInstance, name: str) -> Decisions:
    """`no-offload`: every boundary on device, no remat (`all`), parameters/optimizer on device
    (or the most device-like mode the instance allows). `full-remat`: every boundary on device, each
    block recomputed from its boundary (`boundary` option), parameters as in no-offload.
    `megatrain`: parameters and optimizer states on the host and streamed per layer, a device
    checkpoint every 4 layers, each 4-layer segment re-run once in the backward (flat, Chen-style)."""
    L = inst.n_layers
    least = min(inst.option_names, key=lambda n: inst.option_recompute_s[0][inst.option_names.index(n)])
    most = max(inst.option_names, key=lambda n: inst.option_recompute_s[0][inst.option_names.index(n)])
    dev_mode = _pick_mode(inst, ("device", "opt-host", "host"))
    if name == "no-offload":
        return _uniform(inst, ["device"] * L, ALL if ALL in inst.option_names else least, dev_mode)
    if name == "full-remat":
        return _uniform(inst, ["device"] * L, BOUNDARY if BOUNDARY in inst.option_names else most, dev_mode)
    if name == "megatrain":
        every = min(4, inst.max_segment)
        bnd = ["device" if k % every == 0 else "recompute" for k in range(L)]
        return _uniform(inst, bnd, BOUNDARY if BOUNDARY in inst.option_names else most,
                        _pick_mode(inst, ("host", "opt-host", "device")), flat=True)
    raise ValueError(f"baseline: unknown policy {name!r}; fix: use one of {', '.join(BASELINES)}")


def baseline_plan(inst: PlanInstance, name: str) -> Plan:
    """A named baseline evaluated with the shared cost model (status OVER_BUDGET if it does not fit).
    For `megatrain`, when the flat segments do not fit (their full activations sit on device during
    the segment's backward) the nested variant is used: re-run to regenerate the boundaries, then
    recompute each block from its boundary."""
    plan = make_plan(inst, baseline_decisions(inst, name), method=name)
    if name == "megatrain" and plan.status != "FEASIBLE" and any(plan.decisions.flat):
        nested = make_plan(inst, replace(plan.decisions, flat=(False,) * inst.n_layers), method=name)
        if nested.status == "FEASIBLE" or nested.predicted_peak_bytes < plan.predicted_peak_bytes:
            plan = nested
    return plan


# ----------------------------------------------------------------------------- brute force


def _layer_choices(inst: PlanInstance, k: int) -> tuple[list, list]:
    L = inst.n_layers
    flats = (False, True) if flat_allowed(inst) and k < L - 1 else (False,)
    bnd = [("device", 0, 0, f) for f in flats]
    lags = [g for g in range(inst.d2h_lag) if fwd_window(k) + g <= fwd_window(L - 1)]
    bnd += [("host", g, lead, f) for g in lags for lead in range(1, inst.h2d_lead + 1) for f in flats]
    if k > 0:
        bnd.append(("recompute", 0, 0, False))
    par = []
    for m in inst.param_modes:
        fl = range(1, min(inst.h2d_lead, k + 1) + 1) if m != "device" else [0]
        bl = range(1, inst.h2d_lead + 1) if m == "host" else [0]
        gl = range(1, min(inst.d2h_lag, k + 1) + 1) if m != "device" else [0]
        par += [(m, a, b, c) for a in fl for b in bl for c in gl]
    return bnd, par


def brute_force(inst: PlanInstance, max_combos: int = 400_000) -> Plan:
    """Exhaustive search over every decision (tiny instances only); ties keep the first found."""
    L = inst.n_layers
    per_layer = []
    for k in range(L):
        bnd, par = _layer_choices(inst, k)
        per_layer.append([c for c in itertools.product(bnd, inst.option_names, par)
                          if not c[0][3] or c[1] == BOUNDARY])  # a flat segment's first layer saves nothing
    total = math.prod(len(c) for c in per_layer)
    if total > max_combos:
        raise ValueError(f"brute_force: {total} combinations exceed max_combos={max_combos}; fix: a smaller instance")
    best, best_d = math.inf, None
    for combo in itertools.product(*per_layer):
        d = Decisions(boundary=tuple(c[0][0] for c in combo), inner=tuple(c[1] for c in combo),
                      mode=tuple(c[2][0] for c in combo), offload_lag=tuple(c[0][1] for c in combo),
                      fetch_lead=tuple(c[0][2] for c in combo), param_fwd_lead=tuple(c[2][1] for c in combo),
                      param_bwd_lead=tuple(c[2][2] for c in combo), grad_lag=tuple(c[2][3] for c in combo),
                      flat=tuple(c[0][3] for c in combo))
        try:
            ev = simulate(inst, d)
        except ValueError:
            continue  # e.g. a fetch lead that would land before T, or a too-long segment
        if ev.feasible(inst) and ev.step_s < best - 1e-12:
            best, best_d = ev.step_s, d
    if best_d is None:
        raise PlanInfeasible(f"brute_force: no plan fits budget {inst.budget_bytes:.6g} B", math.nan)
    return make_plan(inst, best_d, method="brute-force", status="OPTIMAL")


__all__ = ["BASELINES", "baseline_decisions", "baseline_plan", "brute_force"]
