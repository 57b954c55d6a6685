"""LazyTrain-style offload planning with OR-Tools CP-SAT, baseline policies and one shared evaluator.

Timeline of one step (window index in brackets, L layers): P [0], F_k [1+k], T [L+1] (LM head),
B_k [2L+1-k] (backward of layer k, in the order k = L-1..0), E [2L+2]. Decisions:

- boundary k (input of layer k): `device`, `host` (offloaded to pinned host memory, fetched back) or
  `recompute`. Materialised boundaries form a path 0 = p_0 < p_1 < ... < L of edges (s, e), at most
  `max_segment` layers long; the backward of layer e-1 first re-runs layers s..e-2 (cost Σρ of those
  layers) to regenerate boundaries s+1..e-1, which then stay on device until their own backward.
  A segment is `nested` (each layer then recomputes its own block per its inner option, like a
  per-layer jax.checkpoint inside a segment checkpoint) or `flat` (Chen-style, one jax.checkpoint
  around the segment: the re-run keeps every tensor of layers s..e-2, so only layer e-1 recomputes its
  block; the segment's layers save nothing in the forward and its full activations sit on device
  during its backward).
- inner option of layer k: which named in-block tensors it saves on device (from F_k to B_k); the
  rest is recomputed in B_k (seconds from the cost model). `all` = no remat.
- parameter mode of layer k (`MODES`): `device`; `opt-host` (master + Adam on host, compute copy on
  device: params H2D before F_k, grads D2H after B_k); `host` (MegaTrain streaming: params H2D before
  F_k and again before B_k, grads D2H after B_k).
- the window of every transfer: offload of boundary k in F_{k+lag}; fetches `lead` windows before
  the window that needs them; gradient sends `lag` windows after B_k.

Cost model (`simulate`, shared by the CP-SAT model, baselines and the brute force): each window lasts
max(compute + recompute, H2D bytes / h2d rate, D2H bytes / d2h rate) (full-duplex link, transfers of a
window run under its compute); step = Σ windows. Objective = recompute + exposed transfer seconds.
Device memory is checked in every window (the data a transfer brings lives from the start of its
window; the device copy an offload reads is freed at the end of its window) against `budget_bytes`:
fixed bytes, device-resident parameter states, boundaries, saved in-block tensors (F_k+1..B_k-1),
regenerated boundaries, flat segments' full tensors, streamed buffers and each window's working set.
Host bytes (parameter states of host layers + offloaded boundaries) are checked against
`host_budget_bytes`. Not modelled: the CPU optimizer's own time (assumed to overlap), a step-to-step
overlap of the epilogue with the next prologue, NVMe.

Solving (`solve`): CP-SAT on integer microseconds and power-of-two byte units (memory rounded up,
so accepted plans fit exactly). Phase 1 solves a relaxation (B windows hide transfers under the
largest possible inner recompute) in which identical consecutive layers are interchangeable, so their
inner options are ordered (symmetry breaking); its optimum is a proven lower bound. Phase 2 solves the
exact model hinted with that solution and constrained by objective >= bound, which usually closes the
gap at once. `brute_force` enumerates tiny instances for the tests; `baseline_plan` scores the named
baselines with the same `simulate`.

NVMe: profiles may list a disk, but JAX has no disk memory kind (only `device`, `pinned_host`,
`unpinned_host`), so no placement puts tensors there.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

from ortools.sat.python import cp_model

from boostjax.offload.costmodel import ALL, BOUNDARY, MODES, PlanInstance

BOUNDARY_STATES: tuple[str, ...] = ("device", "host", "recompute")
BASELINES: tuple[str, ...] = ("no-offload", "full-remat", "megatrain")


class PlanInfeasible(ValueError):
    """No plan fits the budget; `min_budget_bytes` is the smallest budget for which one exists."""

    def __init__(self, message: str, min_budget_bytes: float):
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


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


# ----------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class Evaluation:
    step_s: float
    peak_bytes: float
    host_bytes: float
    recompute_s: float
    exposed_s: float
    window_s: tuple[float, ...]  # compute + recompute per window
    stall_s: tuple[float, ...]
    h2d_bytes: tuple[float, ...]
    d2h_bytes: tuple[float, ...]
    mem_bytes: tuple[float, ...]

    def feasible(self, inst: PlanInstance) -> bool:
        host_ok = inst.host_budget_bytes <= 0 or self.host_bytes <= inst.host_budget_bytes * (1 + 1e-12)
        return self.peak_bytes <= inst.budget_bytes * (1 + 1e-12) and host_ok


def transfers_of(inst: PlanInstance, d: Decisions) -> list[dict[str, Any]]:
    """Every transfer of the step: tensor, layer, direction, window index and label, bytes."""
    L, out = inst.n_layers, []

    def add(tensor: str, k: int, direction: str, w: int, nbytes: float) -> None:
        out.append({"tensor": tensor, "layer": k, "direction": direction, "window": w,
                    "window_label": window_label(L, w), "bytes": nbytes})

    for k in range(L):
        if d.boundary[k] == "host":
            add("boundary", k, "d2h", fwd_window(k) + d.offload_lag[k], inst.boundary_bytes[k])
            need = bwd_window(L, _next_materialised(d.boundary, k) - 1)
            add("boundary", k, "h2d", need - d.fetch_lead[k], inst.boundary_bytes[k])
        if d.mode[k] in ("opt-host", "host"):
            add("params", k, "h2d", fwd_window(k) - d.param_fwd_lead[k], inst.stream_bytes[k])
            add("grads", k, "d2h", bwd_window(L, k) + d.grad_lag[k], inst.stream_bytes[k])
        if d.mode[k] == "host":
            add("params", k, "h2d", bwd_window(L, k) - d.param_bwd_lead[k], inst.stream_bytes[k])
    return out


def simulate(inst: PlanInstance, d: Decisions) -> Evaluation:
    """The cost model: step time, device peak, host bytes and per-window detail of decisions `d`."""
    check_decisions(inst, d)
    L, W = inst.n_layers, n_windows(inst.n_layers)
    dur = base_durations(inst)
    rec = [0.0] * W
    diff = [0.0] * (W + 1)  # memory difference array

    def hold(a: int, b: int, nbytes: float) -> None:  # resident in windows a..b inclusive
        if nbytes and a <= b:
            diff[a] += nbytes
            diff[b + 1] -= nbytes

    opt_idx = {n: i for i, n in enumerate(inst.option_names)}
    static = inst.fixed_bytes + sum(inst.mode_device_bytes[k][MODES.index(d.mode[k])] for k in range(L))
    hold(0, W - 1, static)
    hold(head_window(L), head_window(L), inst.head_work_bytes)
    for k in range(L):
        F, B, A = fwd_window(k), bwd_window(L, k), inst.boundary_bytes[k]
        j = opt_idx[d.inner[k]]
        hold(F, F, A + inst.work_fwd_bytes[k])
        hold(B, B, inst.work_bwd_bytes[k])
        hold(F + 1, B - 1, inst.option_bytes[k][j])
        rec[B] += inst.option_recompute_s[k][j]
        e = _next_materialised(d.boundary, k)
        if d.boundary[k] == "device":
            hold(F + 1, B, A)
        elif d.boundary[k] == "host":
            hold(F + 1, F + d.offload_lag[k], A)
            hold(bwd_window(L, e - 1) - d.fetch_lead[k], B, A)
        else:
            hold(bwd_window(L, e - 1), B, A)
        if d.boundary[k] != "recompute" and e - k >= 2:  # regenerate k+1..e-1 in B_{e-1}
            rec[bwd_window(L, e - 1)] += sum(inst.fwd_s[k:e - 1])
            if d.flat[k]:  # the re-run kept every tensor of layers k..e-2: no block recompute there
                full = [inst.option_bytes[j][opt_idx[ALL]] for j in range(L)]
                for j in range(k, e - 1):
                    rec[bwd_window(L, j)] -= inst.option_recompute_s[j][opt_idx[BOUNDARY]]
                for m_ in range(k + 1, e):  # in B_m the full tensors of layers k..m-1 are resident
                    hold(bwd_window(L, m_), bwd_window(L, m_), sum(full[k:m_]))
        SM = inst.stream_mem_bytes[k]
        if d.mode[k] == "host":
            hold(F - d.param_fwd_lead[k], F, SM)
            hold(B - d.param_bwd_lead[k], B, SM)
        if d.mode[k] in ("opt-host", "host"):
            hold(B, B + d.grad_lag[k], SM)
    h2d, d2h = [0.0] * W, [0.0] * W
    for t in transfers_of(inst, d):
        (h2d if t["direction"] == "h2d" else d2h)[t["window"]] += t["bytes"]
    mem, acc = [], 0.0
    for w in range(W):
        acc += diff[w]
        mem.append(acc)
    window_s = [dur[w] + rec[w] for w in range(W)]
    stall = [max(0.0, h2d[w] / inst.h2d_bytes_per_s - window_s[w], d2h[w] / inst.d2h_bytes_per_s - window_s[w])
             for w in range(W)]
    host = sum(inst.mode_host_bytes[k][MODES.index(d.mode[k])] for k in range(L))
    host += sum(inst.boundary_bytes[k] for k in range(L) if d.boundary[k] == "host")
    return Evaluation(step_s=sum(window_s) + sum(stall), peak_bytes=max(mem), host_bytes=host,
                      recompute_s=sum(rec), exposed_s=sum(stall), window_s=tuple(window_s), stall_s=tuple(stall),
                      h2d_bytes=tuple(h2d), d2h_bytes=tuple(d2h), mem_bytes=tuple(mem))


def evaluate(inst: PlanInstance, decisions: "Decisions | Plan") -> tuple[float, float]:
    """(step seconds, device peak bytes) under the shared cost model."""
    d = decisions.decisions if isinstance(decisions, Plan) else decisions
    ev = simulate(inst, d)
    return ev.step_s, ev.peak_bytes


# ----------------------------------------------------------------------------- plans


@dataclass
class Plan:
    """A solved (or baseline) plan. `layer_policy(k)` says what to save / offload / recompute."""

    instance: str
    method: str
    status: str
    objective: float  # recompute + exposed transfer seconds (shared cost model)
    solve_s: float
    gap: float
    predicted_step_s: float
    predicted_peak_bytes: float
    predicted_host_bytes: float
    budget_bytes: float
    decisions: Decisions
    option_saves: dict[str, list[str]]
    activation_names: list[str]
    transfers: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    model_flops: float = 0.0

    @property
    def boundary(self) -> tuple[str, ...]:
        return self.decisions.boundary

    @property
    def param_place(self) -> tuple[str, ...]:
        return tuple("device" if m in ("device", "opt-host") else "host" for m in self.decisions.mode)

    @property
    def opt_place(self) -> tuple[str, ...]:
        return tuple("device" if m == "device" else "host" for m in self.decisions.mode)

    @property
    def segments(self) -> list[tuple[int, int]]:
        return self.decisions.segments()

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.predicted_step_s if self.predicted_step_s > 0 else 0.0

    @property
    def tflops(self) -> float:
        return self.model_flops / self.predicted_step_s / 1e12 if self.predicted_step_s > 0 else 0.0

    def layer_policy(self, k: int) -> dict[str, Any]:
        """Names for `jax.checkpoint_policies.save_and_offload_only_these_names` for layer k:
        `save` (device), `offload` (pinned_host), `recompute`; `remat=False` for the `all` option;
        `segment` = the recompute edge (s, e) containing layer k and `segment_kind`: `single` (e = s+1),
        `nested` (checkpoint around layers s..e-1 holding per-layer checkpoints) or `flat` (one
        checkpoint around the segment, nothing saved inside)."""
        inner, b = self.decisions.inner[k], self.decisions.boundary[k]
        inside = [n for n in self.activation_names if n != "boundary"]
        saved = inside if inner == ALL else [n for n in inside if n in self.option_saves.get(inner, [])]
        seg = next((s, e) for (s, e) in self.segments if s <= k < e)
        kind = "single" if seg[1] - seg[0] == 1 else ("flat" if self.decisions.flat[seg[0]] else "nested")
        return {"layer": k, "remat": inner != ALL, "inner_option": inner, "segment_kind": kind,
                "save": (["boundary"] if b == "device" else []) + saved,
                "offload": ["boundary"] if b == "host" else [],
                "recompute": (["boundary"] if b == "recompute" else []) + [n for n in inside if n not in saved],
                "segment": seg, "params": self.param_place[k], "opt_state": self.opt_place[k]}

    def to_json(self) -> str:
        d = asdict(self)
        d["gap"] = None if math.isinf(self.gap) else self.gap  # unknown gap (time-out fallback)
        return json.dumps(d, indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        d["gap"] = math.inf if d["gap"] is None else d["gap"]
        d["decisions"] = Decisions(**{k: tuple(v) for k, v in d["decisions"].items()})
        return cls(**d)

    def summary(self) -> str:
        c = {s: self.boundary.count(s) for s in BOUNDARY_STATES}
        return (f"{self.instance} [{self.method}] {self.status}: step {self.predicted_step_s:.4f} s "
                f"(recompute+exposed {self.objective:.4f} s), peak {self.predicted_peak_bytes / 2**30:.2f} GiB "
                f"of {self.budget_bytes / 2**30:.2f} GiB, boundaries {c}, solve {self.solve_s:.2f} s")


def make_plan(inst: PlanInstance, d: Decisions, method: str, status: str | None = None,
              solve_s: float = 0.0, gap: float = 0.0) -> Plan:
    ev = simulate(inst, d)
    if status is None:
        status = "FEASIBLE" if ev.feasible(inst) else "OVER_BUDGET"
    return Plan(instance=inst.name, method=method, status=status, objective=ev.step_s - inst.base_compute_s,
                solve_s=solve_s, gap=gap, predicted_step_s=ev.step_s, predicted_peak_bytes=ev.peak_bytes,
                predicted_host_bytes=ev.host_bytes, budget_bytes=inst.budget_bytes, decisions=d,
                option_saves={n: list(s) for n, s in zip(inst.option_names, inst.option_saves)},
                activation_names=list(inst.activation_names), transfers=transfers_of(inst, d),
                tokens=inst.tokens, model_flops=inst.model_flops)


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


# ----------------------------------------------------------------------------- CP-SAT model


def _mem_unit(inst: PlanInstance) -> int:
    """A power-of-two byte unit that keeps every memory number of the instance below ~2^26 units."""
    top = inst.fixed_bytes + inst.head_work_bytes + max(inst.work_fwd_bytes + inst.work_bwd_bytes) + sum(
        a + max(ob) + max(md) + 3 * sm for a, ob, md, sm in
        zip(inst.boundary_bytes, inst.option_bytes, inst.mode_device_bytes, inst.stream_mem_bytes))
    return 1 << max(0, int(math.floor(math.log2(max(top, 1.0) / 2 ** 26))))


class _Model:
    """The CP-SAT formulation. Time in integer microseconds, memory in `unit` bytes (rounded up, the
    budget rounded down, so a plan the model accepts fits exactly). Per-window traffic, recompute and
    memory are aggregated linear expressions over the decision literals (no per-tensor-per-window
    booleans beyond the few lead/lag choices); recompute segments are a path (unit flow) over
    boundary nodes 0..L whose edge literals carry the placement and fetch lead of the start boundary
    (yD, yH) and the flat flavour (yF). Stalls: stall_w >= traffic_w - duration_w per direction, plus
    the valid cut stall_w >= Σ (t_j - base_w)·x_j - recompute_w over single transfers longer than
    the window's base compute (tightens the LP where streamed layers overflow their windows)."""

    def __init__(self, inst: PlanInstance, min_peak: bool = False, relax: bool = False):
        """`relax=True`: every B_k window hides transfers under its largest possible inner recompute
        (a lower bound of the true objective), which makes identical consecutive layers swappable, so
        their inner options are ordered by saved bytes (symmetry breaking, valid for the relaxation)."""
        self.inst, self.m = inst, cp_model.CpModel()
        m, L, W = self.m, inst.n_layers, n_windows(inst.n_layers)
        T, unit = head_window(L), _mem_unit(inst)
        self.unit = unit
        us = lambda sec: int(round(sec * 1e6))  # noqa: E731
        mu = lambda b: int(math.ceil(b / unit - 1e-9))  # noqa: E731
        h2d = [[] for _ in range(W)]
        d2h = [[] for _ in range(W)]
        rec = [[] for _ in range(W)]  # inner recompute (objective, and hiding unless relaxed)
        regen_rec = [[] for _ in range(W)]  # boundary regeneration
        hide_extra = [0] * W  # relaxation: constant hiding capacity instead of the inner recompute
        mem = [[] for _ in range(W)]
        const = [0] * W

        def hold(a: int, b: int, coef: int, lit) -> None:
            for w in range(max(a, 0), min(b, W - 1) + 1):
                mem[w].append((coef, lit))

        # parameter modes and their transfers
        self.mode = [{md: m.NewBoolVar(f"mode{k}_{md}") for md in inst.param_modes} for k in range(L)]
        self.pf, self.pb, self.gs = [], [], []
        static = []
        for k in range(L):
            F, B, mv = fwd_window(k), bwd_window(L, k), self.mode[k]
            m.AddExactlyOne(mv.values())
            static += [(mu(inst.mode_device_bytes[k][MODES.index(md)]), v) for md, v in mv.items()]
            t_s, sm = us(inst.stream_bytes[k] / inst.h2d_bytes_per_s), mu(inst.stream_mem_bytes[k])
            t_g = us(inst.stream_bytes[k] / inst.d2h_bytes_per_s)
            pf = {(md, ld): m.NewBoolVar(f"pf{k}_{md}_{ld}") for md in ("opt-host", "host") if md in mv
                  for ld in range(1, min(inst.h2d_lead, k + 1) + 1)}
            pb = {ld: m.NewBoolVar(f"pb{k}_{ld}") for ld in range(1, inst.h2d_lead + 1)} if "host" in mv else {}
            gs = {lg: m.NewBoolVar(f"gs{k}_{lg}") for lg in range(1, min(inst.d2h_lag, k + 1) + 1)} \
                if set(mv) & {"opt-host", "host"} else {}
            for md in ("opt-host", "host"):
                if md in mv:
                    m.Add(sum(v for (mm, _), v in pf.items() if mm == md) == mv[md])
            if pb:
                m.Add(sum(pb.values()) == mv["host"])
            if gs:
                m.Add(sum(gs.values()) == sum(mv[md] for md in ("opt-host", "host") if md in mv))
            for (md, ld), v in pf.items():
                h2d[F - ld].append((t_s, v))
                if md == "host":
                    hold(F - ld, F, sm, v)
            for ld, v in pb.items():
                h2d[B - ld].append((t_s, v))
                hold(B - ld, B, sm, v)
            for lg, v in gs.items():
                d2h[B + lg].append((t_g, v))
                hold(B, B + lg, sm, v)
            self.pf.append(pf), self.pb.append(pb), self.gs.append(gs)
        static_var = m.NewIntVar(0, sum(c for c, _ in static), "static")
        m.Add(static_var == sum(c * v for c, v in static))

        # inner options: exactly one per layer, or none when a flat segment contains the layer (the
        # flat edge literal then carries the segment's recompute)
        flat_ok = flat_allowed(inst)
        i_all = inst.option_names.index(ALL) if flat_ok else -1
        i_bnd = inst.option_names.index(BOUNDARY) if flat_ok else -1
        self.opt, self.inner_bytes = [], []
        for k in range(L):
            ov = [m.NewBoolVar(f"opt{k}_{j}") for j in range(len(inst.option_names))]
            self.opt.append(ov)
            F, B = fwd_window(k), bwd_window(L, k)
            rec[B] += [(us(inst.option_recompute_s[k][j]), v) for j, v in enumerate(ov)]
            hide_extra[B] = max(us(x) for x in inst.option_recompute_s[k])
            ib = [mu(inst.option_bytes[k][j]) for j in range(len(ov))]
            iv = m.NewIntVar(0, max(ib), f"inner{k}")
            m.Add(iv == sum(c * v for c, v in zip(ib, ov)))
            hold(F + 1, B - 1, 1, iv)
            self.inner_bytes.append(iv)
            const[F] += mu(inst.boundary_bytes[k] + inst.work_fwd_bytes[k])
            const[B] += mu(inst.work_bwd_bytes[k])
        const[T] += mu(inst.head_work_bytes)
        const = [c + mu(inst.fixed_bytes) for c in const]

        # boundaries: path edges (s, e) with placement of s and the fetch lead on the edge
        self.yD, self.yH, self.ye, self.yF = {}, {}, {}, {}
        flat_cover: list[list] = [[] for _ in range(L)]  # flat edges containing layer k
        self.zD, self.zH, self.lag = [], [], []
        for s in range(L):
            A, tA = mu(inst.boundary_bytes[s]), us(inst.boundary_bytes[s] / inst.h2d_bytes_per_s)
            F, B = fwd_window(s), bwd_window(L, s)
            for e in range(s + 1, min(L, s + inst.max_segment) + 1):
                need = bwd_window(L, e - 1)
                yd = self.yD[s, e] = m.NewBoolVar(f"yD{s}_{e}")
                yh = self.yH[s, e] = {ld: m.NewBoolVar(f"yH{s}_{e}_{ld}") for ld in range(1, inst.h2d_lead + 1)
                                      if need - ld >= T}
                ye = self.ye[s, e] = m.NewBoolVar(f"y{s}_{e}")
                m.Add(ye == yd + sum(yh.values()))
                for ld, v in yh.items():
                    h2d[need - ld].append((tA, v))
                    hold(need - ld, B, A, v)
                regen = sum(inst.fwd_s[s:e - 1])
                if e - s >= 2:
                    regen_rec[need].append((us(regen), ye))
                    acc = 0
                    for mid in range(s + 1, e):  # regenerated boundaries s+1..mid resident in B_mid
                        acc += mu(inst.boundary_bytes[mid])
                        mem[bwd_window(L, mid)].append((acc, ye))
                    if flat_ok:  # flat flavour of the edge
                        yf = self.yF[s, e] = m.NewBoolVar(f"yF{s}_{e}")
                        m.Add(yf <= ye)
                        for k in range(s, e):
                            flat_cover[k].append(yf)
                        rec[need].append((us(inst.option_recompute_s[e - 1][i_bnd]), yf))  # last layer
                        acc = 0
                        for mid in range(s + 1, e):  # full tensors of layers s..mid-1 resident in B_mid
                            acc += mu(inst.option_bytes[mid - 1][i_all])
                            mem[bwd_window(L, mid)].append((acc, yf))
            zd, zh = m.NewBoolVar(f"zD{s}"), m.NewBoolVar(f"zH{s}")
            m.Add(zd == sum(self.yD[s, e] for e in range(s + 1, min(L, s + inst.max_segment) + 1)))
            m.Add(zh == sum(v for e in range(s + 1, min(L, s + inst.max_segment) + 1) for v in self.yH[s, e].values()))
            (m.Add(zd + zh == 1) if s == 0 else m.Add(zd + zh <= 1))
            self.zD.append(zd), self.zH.append(zh)
            hold(F + 1, B, A, zd)
            lags = {g: m.NewBoolVar(f"lag{s}_{g}") for g in range(inst.d2h_lag) if F + g <= fwd_window(L - 1)}
            m.Add(sum(lags.values()) == zh)
            self.lag.append(lags)
            t_d = us(inst.boundary_bytes[s] / inst.d2h_bytes_per_s)
            for g, v in lags.items():
                d2h[F + g].append((t_d, v))
                hold(F + 1, F + g, A, v)
        for v in range(1, L + 1):  # flow conservation: a node is materialised iff one edge enters it
            incoming = [self.ye[s, v] for s in range(max(0, v - inst.max_segment), v)]
            m.Add(sum(incoming) == (1 if v == L else self.zD[v] + self.zH[v]))
        for k in range(L):
            if flat_cover[k]:  # layer k in a flat segment: no option literal, the edge carries its cost
                cov = m.NewBoolVar(f"flat{k}")
                m.Add(cov == sum(flat_cover[k]))
                m.AddExactlyOne(self.opt[k] + [cov])
            else:
                m.AddExactlyOne(self.opt[k])
        if relax:  # identical consecutive layers outside flat segments: bigger saved sets later
            for k in range(1, L):
                if _same_layer(inst, k - 1, k):
                    c = m.Add(self.inner_bytes[k - 1] <= self.inner_bytes[k])
                    if flat_cover[k - 1] or flat_cover[k]:  # only between layers outside flat segments
                        nf = [m.NewBoolVar(f"nf{j}") for j in (k - 1, k)]
                        for lit, j in zip(nf, (k - 1, k)):
                            m.Add(lit == sum(self.opt[j]))
                        c.OnlyEnforceIf(nf)

        # windows: stalls, memory
        base = [us(x) for x in base_durations(inst)]
        self.stall = []
        obj = []
        for w in range(W):
            obj += rec[w] + regen_rec[w]
            hide = regen_rec[w] + ([] if relax else rec[w])
            rec_e = sum(c * v for c, v in hide) + (hide_extra[w] if relax else 0)
            if h2d[w] or d2h[w]:
                ub = max(sum(c for c, _ in h2d[w]), sum(c for c, _ in d2h[w]))
                st = m.NewIntVar(0, ub, f"stall{w}")
                for terms in (h2d[w], d2h[w]):
                    if terms:
                        m.Add(st >= sum(c * v for c, v in terms) - base[w] - rec_e)
                        big = [(c - base[w], v) for c, v in terms if c > base[w]]
                        if big:  # valid cut (superadditivity), tight where single transfers overflow
                            m.Add(st >= sum(c * v for c, v in big) - rec_e)
                self.stall.append(st)
                obj.append((1, st))
        self.mem_exprs = [const[w] + static_var + sum(c * v for c, v in mem[w]) for w in range(W)]
        if inst.host_budget_bytes > 0:
            host_terms = [(mu(inst.mode_host_bytes[k][MODES.index(md)]), v)
                          for k in range(L) for md, v in self.mode[k].items()]
            host_terms += [(mu(inst.boundary_bytes[k]), self.zH[k]) for k in range(L)]
            m.Add(sum(c * v for c, v in host_terms) <= int(math.floor(inst.host_budget_bytes / unit + 1e-9)))
        if min_peak:
            top = sum(const) + sum(c for c, _ in static) + sum(c for w in range(W) for c, _ in mem[w])
            self.peak = m.NewIntVar(0, top, "peak")
            for e in self.mem_exprs:
                m.Add(self.peak >= e)
            m.Minimize(self.peak)
        else:
            cap = int(math.floor(inst.budget_bytes / unit + 1e-9))
            for e in self.mem_exprs:
                m.Add(e <= cap)
            self.obj_expr = sum(c * v for c, v in obj)
            m.Minimize(self.obj_expr)

    def hint(self, d: Decisions) -> None:
        m, L = self.m, self.inst.n_layers
        m.ClearHints()
        segs = {s: e for s, e in d.segments()}
        for (s, e), v in self.yD.items():
            m.AddHint(v, int(segs.get(s) == e and d.boundary[s] == "device"))
        for (s, e), hs in self.yH.items():
            for ld, v in hs.items():
                m.AddHint(v, int(segs.get(s) == e and d.boundary[s] == "host" and d.fetch_lead[s] == ld))
        for (s, e), v in self.ye.items():
            m.AddHint(v, int(segs.get(s) == e))
        for (s, e), v in self.yF.items():
            m.AddHint(v, int(segs.get(s) == e and d.flat[s]))
        for k in range(L):
            m.AddHint(self.zD[k], int(d.boundary[k] == "device"))
            m.AddHint(self.zH[k], int(d.boundary[k] == "host"))
            for g, v in self.lag[k].items():
                m.AddHint(v, int(d.boundary[k] == "host" and d.offload_lag[k] == g))
            in_flat = any(d.flat[s] and s <= k < e for s, e in d.segments())
            for j, v in enumerate(self.opt[k]):
                m.AddHint(v, int(self.inst.option_names[j] == d.inner[k] and not in_flat))
            for md, v in self.mode[k].items():
                m.AddHint(v, int(d.mode[k] == md))
            for (md, ld), v in self.pf[k].items():
                m.AddHint(v, int(d.mode[k] == md and d.param_fwd_lead[k] == ld))
            for ld, v in self.pb[k].items():
                m.AddHint(v, int(d.mode[k] == "host" and d.param_bwd_lead[k] == ld))
            for lg, v in self.gs[k].items():
                m.AddHint(v, int(d.mode[k] != "device" and d.grad_lag[k] == lg))

    def decode(self, sol: cp_model.CpSolver) -> Decisions:
        inst, L = self.inst, self.inst.n_layers
        bnd, lag, lead = ["recompute"] * L, [0] * L, [0] * L
        for (s, e), v in self.yD.items():
            if sol.Value(v):
                bnd[s] = "device"
        for (s, e), hs in self.yH.items():
            for ld, v in hs.items():
                if sol.Value(v):
                    bnd[s], lead[s] = "host", ld
        for k in range(L):
            for g, v in self.lag[k].items():
                if sol.Value(v):
                    lag[k] = g
        inner = [next((inst.option_names[j] for j, v in enumerate(self.opt[k]) if sol.Value(v)), BOUNDARY)
                 for k in range(L)]
        mode = [next(md for md, v in self.mode[k].items() if sol.Value(v)) for k in range(L)]
        pfl = [next((ld for (_, ld), v in self.pf[k].items() if sol.Value(v)), 0) for k in range(L)]
        pbl = [next((ld for ld, v in self.pb[k].items() if sol.Value(v)), 0) for k in range(L)]
        gsl = [next((lg for lg, v in self.gs[k].items() if sol.Value(v)), 0) for k in range(L)]
        flat = [False] * L
        for (s, e), v in self.yF.items():
            if sol.Value(v):
                flat[s] = True
        return Decisions(tuple(bnd), tuple(inner), tuple(mode), tuple(lag), tuple(lead), tuple(pfl), tuple(pbl),
                         tuple(gsl), tuple(flat))


def _same_layer(inst: PlanInstance, j: int, k: int) -> bool:
    return all(getattr(inst, f)[j] == getattr(inst, f)[k] for f in (
        "boundary_bytes", "fwd_s", "bwd_s", "work_fwd_bytes", "work_bwd_bytes", "option_bytes",
        "option_recompute_s", "stream_bytes", "stream_mem_bytes", "mode_device_bytes", "mode_host_bytes"))


def _solver(time_limit_s: float, workers: int | None, seed: int) -> cp_model.CpSolver:
    sol = cp_model.CpSolver()
    sol.parameters.max_time_in_seconds = float(time_limit_s)
    sol.parameters.num_workers = int(workers) if workers else min(8, max(2, os.cpu_count() or 2))
    sol.parameters.random_seed = int(seed)
    return sol


def min_budget(inst: PlanInstance, time_limit_s: float = 30.0, workers: int | None = None,
               seed: int = 0) -> tuple[float, bool]:
    """(smallest device budget for which `solve` finds a plan, whether that is proven minimal)."""
    model = _Model(inst, min_peak=True, relax=True)  # the symmetry breaking only moves memory down
    sol = _solver(time_limit_s, workers, seed)
    st = sol.Solve(model.m)
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"min_budget: CP-SAT found no plan at all ({sol.StatusName(st)}); "
                           "fix: raise time_limit_s or check the host budget")
    return float(sol.Value(model.peak) * model.unit), st == cp_model.OPTIMAL


def _infeasible(inst: PlanInstance, time_limit_s: float, workers: int | None, seed: int) -> PlanInfeasible:
    need, proven = min_budget(inst, time_limit_s, workers, seed)
    return PlanInfeasible(
        f"plan: no plan fits the device budget of {inst.budget_bytes:.6g} B ({inst.budget_bytes / 2**30:.3f} GiB) "
        f"for {inst.name}; the smallest budget that works is {need:.6g} B ({need / 2**30:.3f} GiB)"
        f"{'' if proven else ' (best found, not proven minimal)'}; fix: raise the budget to at least that, "
        "or allow host placements / recompute", need)


def solve(inst: PlanInstance, time_limit_s: float = 60.0, workers: int | None = None, seed: int = 0) -> Plan:
    """The CP-SAT plan minimising recompute + exposed transfer time under the device budget.

    Two phases: (1) the relaxation (`_Model(relax=True)`, symmetry-broken) gives a proven lower
    bound LB and a candidate; (2) the exact model, hinted with that candidate and constrained by
    objective >= LB, finds (and proves) the optimum. Raises PlanInfeasible with the smallest working
    budget when no plan fits."""
    t0 = time.perf_counter()
    fits = [b for b in (baseline_plan(inst, n) for n in BASELINES) if b.status == "FEASIBLE"]
    relax = _Model(inst, relax=True)
    if fits:
        relax.hint(min(fits, key=lambda p: p.predicted_step_s).decisions)
    sol = _solver(time_limit_s / 2, workers, seed)
    # CP-SAT's presolve weakens this model's LP bound (measured: the 27B root bound drops from the
    # LP value 5.59 s to 2.9 s once flat edges exist), and phase 1 lives on that bound
    sol.parameters.cp_model_presolve = False
    st = sol.Solve(relax.m)
    if st == cp_model.INFEASIBLE:  # same constraints as the exact model: no plan fits
        raise _infeasible(inst, time_limit_s, workers, seed)
    found = st in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    cands = fits + ([make_plan(inst, relax.decode(sol), "cp-sat (relaxation)", "FEASIBLE")] if found else [])
    exact = _Model(inst)
    if st == cp_model.OPTIMAL:
        exact.m.Add(exact.obj_expr >= int(round(sol.ObjectiveValue())))
    if cands:
        exact.hint(min(cands, key=lambda p: p.predicted_step_s).decisions)
    sol = _solver(max(1.0, time_limit_s - (time.perf_counter() - t0)), workers, seed)
    st = sol.Solve(exact.m)
    solve_s = time.perf_counter() - t0
    if st in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        obj, bound = sol.ObjectiveValue(), sol.BestObjectiveBound()
        gap = 0.0 if st == cp_model.OPTIMAL else (obj - bound) / max(1.0, abs(obj))
        plan = make_plan(inst, exact.decode(sol), "cp-sat", sol.StatusName(st), solve_s, gap)
        better = [c for c in cands if c.predicted_step_s < plan.predicted_step_s]  # µs rounding, time limit
        if better:
            best = min(better, key=lambda p: p.predicted_step_s)
            plan = make_plan(inst, best.decisions, f"cp-sat ({best.method} kept)", plan.status, solve_s, gap)
        return plan
    if st == cp_model.INFEASIBLE:
        if found:  # phase 1 found plans, so only a wrong lower bound could do this
            raise RuntimeError("plan: internal error, the relaxation bound cut off every plan; please report")
        raise _infeasible(inst, time_limit_s, workers, seed)
    if cands:  # time limit without an exact-model solution: the best plan known, gap unknown
        best = min(cands, key=lambda p: p.predicted_step_s)
        return make_plan(inst, best.decisions, f"cp-sat timeout ({best.method})", "FEASIBLE", solve_s, math.inf)
    raise RuntimeError(f"plan: CP-SAT found no plan within {time_limit_s} s ({sol.StatusName(st)}); "
                       "fix: raise time_limit_s")


__all__ = ["BASELINES", "BOUNDARY_STATES", "Decisions", "Evaluation", "Plan", "PlanInfeasible",
           "base_durations", "baseline_decisions", "baseline_plan", "brute_force", "check_decisions",
           "evaluate", "flat_allowed", "make_plan", "min_budget", "simulate", "solve", "transfers_of",
           "window_label"]
