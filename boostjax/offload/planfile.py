"""The shared cost model of a plan (`simulate`), the result types (`Evaluation`, `Plan`,
`PlanInfeasible`) and plan files (`Plan.to_json`/`from_json`, `read_plan`, `is_plan_file`); whether a
plan fits a training run is `boostjax.offload.fit.check_plan_for`. What `simulate` charges and
checks in every window: docs/offload.md ("The shared evaluator").
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import stat
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from boostjax.config import ConfigError
from boostjax.offload.costmodel import ALL, BOUNDARY, MODES, PlanInstance
from boostjax.offload.decisions import (BOUNDARY_STATES, Decisions, _next_materialised, base_durations,
                                        bwd_window, check_decisions, fwd_window, head_window, n_windows,
                                        window_label)


class PlanInfeasible(ValueError):
    """No plan fits the budget; `min_budget_bytes` is the smallest budget for which one exists."""

    def __init__(self, message: str, min_budget_bytes: float):
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


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
        if d.mode[k] == "device":
            hold(B, W - 1, inst.grad_device_bytes[k])
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
    # the run this plan is for (`costmodel.planned_for`: model shapes, batch, seq, dtype, optimizer,
    # attention, strategy, mesh); `boostjax train --offload-plan` refuses a run that differs (`check_plan_for`)
    planned_for: dict[str, Any] = field(default_factory=dict)

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
    def host_layers(self) -> dict[str, int]:
        """How many layers keep their input boundary, parameters and optimizer state in pinned host memory."""
        return {"boundary": self.boundary.count("host"), "params": self.param_place.count("host"),
                "opt_state": self.opt_place.count("host")}

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
        d = {"format": PLAN_FORMAT, "version": PLAN_VERSION, **asdict(self)}
        d["gap"] = None if math.isinf(self.gap) else self.gap  # unknown gap (time-out fallback)
        return json.dumps(d, indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """A plan from `to_json` text; ValueError (one line, what is wrong) for anything else."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: Any) -> "Plan":
        if not isinstance(d, dict):
            raise ValueError(f"a JSON {type(d).__name__}, not a plan object")
        d = dict(d)
        if d.pop("format", PLAN_FORMAT) != PLAN_FORMAT:
            raise ValueError("its 'format' is not a boostjax plan")
        d.pop("version", None)
        names = {f.name for f in fields(cls)}
        missing = sorted(n for n in names if n not in d and n not in _OPTIONAL)
        if missing:
            raise ValueError(f"no {', '.join(repr(m) for m in missing[:3])} entry")
        extra = sorted(k for k in d if k not in names)
        if extra:
            raise ValueError(f"unknown entry {extra[0]!r}")
        for name in ("instance", "method", "status"):
            if not isinstance(d[name], str):
                raise ValueError(f"{name!r} is not a string")
        for name in ("objective", "solve_s", "predicted_step_s", "predicted_peak_bytes", "predicted_host_bytes",
                     "budget_bytes", "model_flops", "tokens"):
            v = d.get(name, 0)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{name!r} is not a number")
        gap = d["gap"]
        if gap is not None and (isinstance(gap, bool) or not isinstance(gap, (int, float))):
            raise ValueError("'gap' is not a number")
        d["gap"] = math.inf if gap is None else gap
        d["decisions"] = _decisions_from(d["decisions"])
        saves = d["option_saves"]
        if not (isinstance(saves, dict) and all(isinstance(v, list) and all(isinstance(x, str) for x in v)
                                                for v in saves.values())):
            raise ValueError("'option_saves' is not a map of name lists")
        acts = d["activation_names"]
        if not (isinstance(acts, list) and all(isinstance(x, str) for x in acts)):
            raise ValueError("'activation_names' is not a list of names")
        if not isinstance(d.get("transfers", []), list):
            raise ValueError("'transfers' is not a list")
        if not isinstance(d.get("planned_for", {}), dict):
            raise ValueError("'planned_for' is not an object")
        return cls(**d)

    def summary(self) -> str:
        c = {s: self.boundary.count(s) for s in BOUNDARY_STATES}
        return (f"{self.instance} [{self.method}] {self.status}: step {self.predicted_step_s:.4f} s "
                f"(recompute+exposed {self.objective:.4f} s), peak {self.predicted_peak_bytes / 2**30:.2f} GiB "
                f"of {self.budget_bytes / 2**30:.2f} GiB, boundaries {c}, solve {self.solve_s:.2f} s")


PLAN_FORMAT = "boostjax-plan"
PLAN_VERSION = 2  # 2: records `planned_for`; version 1 files (no "format" key) have no record
MAX_PLAN_BYTES = 64 << 20  # a plan of 1000 layers is a few MB
_OPTIONAL = {"transfers", "tokens", "model_flops", "planned_for"}
_DECISION_KINDS = {"boundary": str, "inner": str, "mode": str, "offload_lag": int, "fetch_lead": int,
                   "param_fwd_lead": int, "param_bwd_lead": int, "grad_lag": int, "flat": bool}


def _decisions_from(raw: Any) -> Decisions:
    if not isinstance(raw, dict):
        raise ValueError("'decisions' is not an object")
    extra = sorted(set(raw) - set(_DECISION_KINDS))
    if extra:
        raise ValueError(f"unknown decision {extra[0]!r}")
    missing = [k for k in _DECISION_KINDS if k != "flat" and k not in raw]
    if missing:
        raise ValueError(f"no decision {missing[0]!r}")
    n = None
    for name, kind in _DECISION_KINDS.items():
        v = raw.get(name, [])
        ok = isinstance(v, list) and all(isinstance(x, kind) and (kind is bool or not isinstance(x, bool)) for x in v)
        if not ok:
            raise ValueError(f"decisions.{name} is not a list of {kind.__name__}")
        if name != "flat" or v:
            if n is not None and len(v) != n:
                raise ValueError(f"decisions.{name} has {len(v)} entries, decisions.boundary {n}")
            n = len(v) if n is None else n
    if not n:
        raise ValueError("decisions for 0 layers")
    return Decisions(**{k: tuple(v) for k, v in raw.items()})


def _plan_error(path: Any, what: str, fix: str, name: str) -> Exception:
    return ConfigError(f"{name}: {path} {what}; fix: {fix}")


def read_plan(path: str | os.PathLike, name: str = "train.offload_plan") -> Plan:
    """The `Plan` in a plan.json written by `boostjax plan --out`; `ConfigError` (one line naming
    `name`, the file and the fix) for a missing, unreadable or foreign file. Never blocks on a FIFO."""
    p = pathlib.Path(path)
    again = f"write it with boostjax plan ... --out {p}"
    try:
        st = p.stat()
    except FileNotFoundError:
        raise _plan_error(p, "does not exist", again, name) from None
    except OSError as e:
        raise _plan_error(p, f"cannot be read ({e.strerror or e})", f"check the path and its permissions, or {again}",
                          name) from None
    if stat.S_ISDIR(st.st_mode):
        raise _plan_error(p, "is a directory", f"pass the plan file inside it, or {again}", name)
    if not stat.S_ISREG(st.st_mode):
        raise _plan_error(p, "is not a regular file", f"pass a plan.json file; {again}", name)
    if st.st_size > MAX_PLAN_BYTES:
        raise _plan_error(p, f"is not a plan file ({st.st_size} bytes, a plan is far smaller)", again, name)
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise _plan_error(p, "is not a plan file (not UTF-8 text)", again, name) from None
    except OSError as e:
        raise _plan_error(p, f"cannot be read ({e.strerror or e})", f"check the file and its permissions, or {again}",
                          name) from None
    try:
        return Plan.from_json(text)
    except (ValueError, TypeError) as e:
        reason = " ".join(str(e).split())[:160]
        raise _plan_error(p, f"is not a plan file ({reason})", again, name) from None


def is_plan_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a plan file `boostjax plan --out` may replace (a regular file holding a plan,
    of this or the previous format version)."""
    p = pathlib.Path(path)
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_PLAN_BYTES:
            return False
        d = json.loads(p.read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(d, dict) or d.get("format", PLAN_FORMAT) != PLAN_FORMAT:
        return False
    return {"instance", "method", "decisions", "option_saves", "activation_names"} <= d.keys()


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
                tokens=inst.tokens, model_flops=inst.model_flops, planned_for=dict(inst.planned_for))


__all__ = ["PLAN_FORMAT", "PLAN_VERSION", "Evaluation", "Plan", "PlanInfeasible", "evaluate",
           "is_plan_file", "make_plan", "read_plan", "simulate", "transfers_of"]
