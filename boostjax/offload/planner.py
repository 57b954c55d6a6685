"""LazyTrain-style offload planning with OR-Tools CP-SAT, baseline policies and one shared evaluator.

Per layer the plan decides each boundary's place (device, host, recompute, in segments), the inner
tensors saved, the parameter mode (`MODES`) and every transfer's window; `simulate`
(`boostjax.offload.planfile`) scores it. `solve` runs CP-SAT in two phases (a relaxation's proven bound,
then the exact model hinted with it); `min_budget` finds the smallest budget that fits. This module
re-exports the public names of `decisions`, `planfile`, `reference_policies` and `formulation`. The
timeline, the decisions and the solver: docs/offload.md ("The planner's timeline, decisions and solver").
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
