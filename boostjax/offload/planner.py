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

Cost model (`simulate` in `boostjax.offload.planfile`, shared by the CP-SAT model, baselines and the
brute force): each window lasts max(compute + recompute, H2D time, D2H time); step = Σ windows.
Objective = recompute + exposed transfer seconds. Device memory is checked in every window against
`budget_bytes`, host bytes against `host_budget_bytes`. Not modelled: the CPU optimizer's own time
(assumed to overlap), a step-to-step overlap of the epilogue with the next prologue, NVMe.

Modules: `decisions` (windows, `Decisions`, checks), `planfile` (`simulate`, `Plan`, result types, plan files and `check_plan_for`),
`reference_policies` (the named baseline policies, brute force), `formulation` (the CP-SAT model), this one (`solve`,
`min_budget`; it re-exports the public names of the others).

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

import math
import os
import time

from ortools.sat.python import cp_model

from boostjax.offload.reference_policies import BASELINES, baseline_decisions, baseline_plan, brute_force
from boostjax.offload.costmodel import PlanInstance
from boostjax.offload.decisions import (BOUNDARY_STATES, Decisions, base_durations, check_decisions,
                                        flat_allowed, window_label)
from boostjax.offload.formulation import _Model
from boostjax.offload.planfile import Evaluation, Plan, PlanInfeasible, evaluate, make_plan, simulate, transfers_of


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
