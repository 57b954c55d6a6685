"""The decisions of an offload plan and the step's compute windows.

Timeline of one step (window index in brackets, L layers): P [0], F_k [1+k], T [L+1] (LM head),
B_k [2L+1-k] (backward of layer k, in the order k = L-1..0), E [2L+2]. `Decisions` holds, per layer,
the boundary state, the inner option, the parameter mode, and the window offsets of its transfers
(see `boostjax.offload.planner` for their meaning); `check_decisions` validates them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from boostjax.offload.costmodel import ALL, BOUNDARY, PlanInstance

BOUNDARY_STATES: tuple[str, ...] = ("device", "host", "recompute")


# ----------------------------------------------------------------------------- windows


def n_windows(L: int) -> int:
    return 2 * L + 3


def fwd_window(k: int) -> int:
    return 1 + k


def head_window(L: int) -> int:
    return L + 1


def bwd_window(L: int, k: int) -> int:
    return 2 * L + 1 - k


def window_label(L: int, w: int) -> str:
    if w == 0:
        return "P"
    if w <= L:
        return f"F{w - 1}"
    if w == L + 1:
        return "T"
    if w <= 2 * L + 1:
        return f"B{2 * L + 1 - w}"
    return "E"


def base_durations(inst: PlanInstance) -> list[float]:
    L = inst.n_layers
    dur = [0.0] * n_windows(L)
    dur[0], dur[head_window(L)], dur[-1] = inst.prologue_s, inst.head_s, inst.epilogue_s
    for k in range(L):
        dur[fwd_window(k)] = inst.fwd_s[k]
        dur[bwd_window(L, k)] = inst.bwd_s[k]
    return dur


# ----------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Decisions:
    """Everything a plan decides. Lags/leads are 0 where the transfer does not exist."""

    boundary: tuple[str, ...]  # per layer: device / host / recompute
    inner: tuple[str, ...]  # per layer: inner option name
    mode: tuple[str, ...]  # per layer: MODES
    offload_lag: tuple[int, ...]  # boundary k D2H in F_{k+lag}, 0 <= lag < d2h_lag
    fetch_lead: tuple[int, ...]  # boundary k H2D `lead` windows before the window needing it
    param_fwd_lead: tuple[int, ...]  # params H2D in window F_k - lead (opt-host, host)
    param_bwd_lead: tuple[int, ...]  # params H2D in window B_k - lead (host)
    grad_lag: tuple[int, ...]  # grads D2H in window B_k + lag, 1 <= lag <= d2h_lag (opt-host, host)
    flat: tuple[bool, ...] = ()  # per layer: segment starting at this boundary is flat (empty: none)

    def __post_init__(self) -> None:
        if not self.flat:
            object.__setattr__(self, "flat", (False,) * len(self.boundary))
        object.__setattr__(self, "flat", tuple(bool(x) for x in self.flat))

    def segments(self) -> list[tuple[int, int]]:
        """Path of edges (s, e) between consecutive materialised boundaries (e = L at the end)."""
        mat = [k for k, b in enumerate(self.boundary) if b != "recompute"] + [len(self.boundary)]
        return list(zip(mat[:-1], mat[1:]))


def _next_materialised(boundary: Sequence[str], k: int) -> int:
    e = k + 1
    while e < len(boundary) and boundary[e] == "recompute":
        e += 1
    return e


def flat_allowed(inst: PlanInstance) -> bool:
    """Flat segments need the `all` (full tensors) and `boundary` (saves nothing) options."""
    if not (inst.flat_segments and ALL in inst.option_names and BOUNDARY in inst.option_names):
        return False
    i_bnd = inst.option_names.index(BOUNDARY)
    return all(row[i_bnd] == 0 for row in inst.option_bytes)


def check_decisions(inst: PlanInstance, d: Decisions) -> None:
    """Raise ValueError naming the first decision that the instance does not allow."""
    L = inst.n_layers
    for fname in ("boundary", "inner", "mode", "offload_lag", "fetch_lead", "param_fwd_lead",
                  "param_bwd_lead", "grad_lag", "flat"):
        if len(getattr(d, fname)) != L:
            raise ValueError(f"decisions.{fname}: needs {L} entries; fix: one per layer")
    if inst.uniform_modes and len(set(d.mode)) > 1:
        raise ValueError(f"decisions.mode: {sorted(set(d.mode))} differ between layers, and a pipeline stage keeps "
                         "its layers' parameters in one stacked array; fix: give every layer the same mode")
    if d.boundary[0] == "recompute":
        raise ValueError("decisions.boundary[0]: the first boundary cannot be recomputed; fix: device or host")
    for (s, e) in d.segments():
        if e - s > inst.max_segment:
            raise ValueError(f"decisions.boundary: segment ({s}, {e}) is longer than max_segment="
                             f"{inst.max_segment}; fix: materialise a boundary inside it")
        if d.flat[s] and (e - s < 2 or not flat_allowed(inst) or any(d.inner[k] != BOUNDARY for k in range(s, e))):
            raise ValueError(f"decisions.flat[{s}]: a flat segment needs >= 2 layers, all with inner option "
                             f"{BOUNDARY!r} (and {ALL!r}/{BOUNDARY!r} in the menu); fix: make it nested")
    if any(f and b == "recompute" for f, b in zip(d.flat, d.boundary)):
        raise ValueError("decisions.flat: only a materialised boundary starts a segment; fix: set it False")
    for k in range(L):
        b, m = d.boundary[k], d.mode[k]
        if b not in BOUNDARY_STATES:
            raise ValueError(f"decisions.boundary[{k}]: {b!r}; fix: one of {BOUNDARY_STATES}")
        if d.inner[k] not in inst.option_names:
            raise ValueError(f"decisions.inner[{k}]: {d.inner[k]!r}; fix: one of {inst.option_names}")
        if m not in inst.param_modes:
            raise ValueError(f"decisions.mode[{k}]: {m!r}; fix: one of {inst.param_modes}")
        if b == "host":
            lag, lead = d.offload_lag[k], d.fetch_lead[k]
            need = bwd_window(L, _next_materialised(d.boundary, k) - 1)
            if not (0 <= lag < inst.d2h_lag and fwd_window(k) + lag <= fwd_window(L - 1)):
                raise ValueError(f"decisions.offload_lag[{k}]: {lag} not allowed; fix: 0..{inst.d2h_lag - 1} within forward")
            if not (1 <= lead <= inst.h2d_lead and need - lead >= head_window(L)):
                raise ValueError(f"decisions.fetch_lead[{k}]: {lead} not allowed; fix: 1..{inst.h2d_lead}, not before T")
        streams = m in ("opt-host", "host")
        if streams and not (1 <= d.param_fwd_lead[k] <= min(inst.h2d_lead, k + 1)):
            raise ValueError(f"decisions.param_fwd_lead[{k}]: {d.param_fwd_lead[k]}; fix: 1..{min(inst.h2d_lead, k + 1)}")
        if m == "host" and not 1 <= d.param_bwd_lead[k] <= inst.h2d_lead:
            raise ValueError(f"decisions.param_bwd_lead[{k}]: {d.param_bwd_lead[k]}; fix: 1..{inst.h2d_lead}")
        if streams and not (1 <= d.grad_lag[k] <= min(inst.d2h_lag, k + 1)):
            raise ValueError(f"decisions.grad_lag[{k}]: {d.grad_lag[k]}; fix: 1..{min(inst.d2h_lag, k + 1)}")


__all__ = ["BOUNDARY_STATES", "Decisions", "base_durations", "bwd_window", "check_decisions", "flat_allowed",
           "fwd_window", "head_window", "n_windows", "window_label"]
