"""The branch and bound of `plan_auto` (docs/planning.md, "Pruning"):
compile keys in the order of their bounds, predict and place their candidates, then solve offload plans
for the candidates over the budget. `Search` holds what the steps share."""

from __future__ import annotations

import time
from typing import Any, Callable

from boostjax.config import ConfigError, ModelConfig
from boostjax.planning import cpu, offloading
from boostjax.planning.cluster import Cluster
from boostjax.planning.costs import Hardware
from boostjax.planning.measure import Key, is_cached, measure
from boostjax.planning.predict import predict
from boostjax.planning.space import Candidate, accepted, comm_lower_bound, time_lower_bound

REMAT_ORDER = ("none", "lowrank", "full")  # by recomputation: a heavier remat only where a lighter one overflows

Placed = tuple[Candidate, dict]  # a candidate and its prediction


def can_offload(c: Candidate, cl: Cluster, max_offloads: int) -> bool:
    """Whether `c`, over the budget, may still run with an offload plan (GPU clusters only)."""
    return max_offloads > 0 and not cl.is_cpu and offloading.eligible(c)


def offloaded(p: dict, got: dict, seq: int, c: Candidate) -> dict:
    """`predict`'s result with an offload plan's memory saving and added seconds (`offloading`)."""
    step = p["step_s"] + got["extra_s"]
    tokens = c.data * c.micro_batch * c.slots * seq
    saved = p["peak_bytes_per_device"] - got["peak_bytes_per_device"]
    return {**p, "step_s": step, "tokens_per_s": tokens / step, "mfu": p["mfu"] * p["step_s"] / step,
            "peak_bytes_per_device": got["peak_bytes_per_device"], "offload_saved_bytes": saved,
            "compiled_peak_bytes_per_device": p["peak_bytes_per_device"],
            "time_s": {**p["time_s"], "offload": got["extra_s"]}}


class Search:
    """One plan's compile-key search: `group` the fitting candidates by compile key, `run` the keys in
    bound order, then read `ranked` (fitting), `rejected` (over the budget), `plans` (offload plans),
    `included` and `counts`."""

    def __init__(self, model: ModelConfig, cl: Cluster, seq: int, global_batch: int, dtype: str, optimizer: str,
                 budget: float, hw: Hardware, eta: float, lb_mem: dict[Candidate, float], *, top: int,
                 max_compiles: int, max_offloads: int, offload_time_limit_s: float, compile_seconds: float | None,
                 cache_dir: str | None, include: tuple[Candidate, ...], log: Callable[[str], None] | None, t0: float):
        self.model, self.cl, self.seq, self.global_batch = model, cl, seq, global_batch
        self.dtype, self.optimizer, self.budget, self.hw, self.eta = dtype, optimizer, budget, hw, eta
        self.lb_mem, self.top, self.max_compiles, self.max_offloads = lb_mem, top, max_compiles, max_offloads
        self.offload_time_limit_s, self.compile_seconds = offload_time_limit_s, compile_seconds
        self.cache_dir, self.include, self.log, self.t0 = cache_dir, include, log, t0
        self.groups: dict[Key, list[Candidate]] = {}
        self.lb_t: dict[Candidate, float] = {}
        self.predicted: dict[Candidate, dict] = {}  # the included candidates' own predictions
        self.pending: list[Placed] = []  # over the budget, waiting for an offload plan
        self.ranked: list[Placed] = []
        self.rejected: list[Placed] = []
        self.plans: dict[Candidate, Any] = {}
        self.compiled = self.cached = self.refused = 0
        self.skipped = {"time_bound": 0, "remat_not_needed": 0, "compile_budget": 0}
        self.overflow: set[tuple] = set()  # (strategy, tp, micro_batch, remat) keys with a candidate over the budget
        self.offloads = {"tried": 0, "fitted": 0}

    # -- bounds and keys

    def device_hw(self, c: Candidate) -> Hardware:
        """The rates one device of `c` sees (the CPU's are shared by its simulated devices)."""
        return cpu.shared_rates(self.hw, c.data * c.stage * c.model) if self.cl.is_cpu else self.hw

    def lb_time(self, c: Candidate) -> float:
        """`c`'s step time bound: its GEMMs at peak plus its communication's lower bound."""
        hwc = self.device_hw(c)
        return (time_lower_bound(self.model, c, self.seq, self.global_batch, self.eta * hwc.peak_flops)
                + comm_lower_bound(self.model, c, self.seq, self.dtype, self.cl, hwc))

    def key_of(self, c: Candidate) -> Key:
        return Key(self.model, c.strategy, c.model, c.micro_batch, self.seq, c.remat, self.dtype, self.optimizer,
                   not self.cl.is_cpu)

    def group(self, fits: list[Candidate], space: list[Candidate]) -> None:
        """The fitting candidates and the included ones (each must be in `space`) by compile key."""
        self.lb_t = {c: self.lb_time(c) for c in fits}
        for c in fits:
            self.groups.setdefault(self.key_of(c), []).append(c)
        for c in self.include:
            if c not in space:
                raise ConfigError(f"plan.include: {c.label} is not a valid configuration of this model on "
                                  f"{self.cl.text}; fix: pass one of the enumerated candidates")
            self.lb_t.setdefault(c, self.lb_time(c))
            if c not in self.groups.setdefault(self.key_of(c), []):
                self.groups[self.key_of(c)].append(c)

    def order(self) -> list[Key]:
        """Keys by their candidates' best time bound (those needing an offload plan last), the best key of
        each TP size first."""
        groups, lb_mem, lb_t = self.groups, self.lb_mem, self.lb_t
        order = sorted(groups, key=lambda k: (all(lb_mem[c] > self.budget for c in groups[k]),
                                              min(lb_t[c] for c in groups[k]), REMAT_ORDER.index(k.remat),
                                              -k.micro_batch))
        firsts = list({k.tp: k for k in reversed(order)}.values())  # the best key of each TP size
        return sorted(firsts, key=order.index) + [k for k in order if k not in firsts]

    # -- the search

    def out_of_time(self) -> bool:
        return self.compile_seconds is not None and time.perf_counter() - self.t0 > self.compile_seconds

    def run(self) -> None:
        """Compile or skip every key in `order`, then solve the offload plans."""
        forced = {self.key_of(c) for c in self.include}
        for key in self.order():
            if key in forced:
                self.groups[key] = self.keep_accepted(key)
                self.compile_and_place(key, "included; ")
            elif self.skip(key) is None:
                self.groups[key] = self.keep_accepted(key)
                if self.groups[key]:
                    self.compile_and_place(key, "")
        self.try_offloads()

    def skip(self, key: Key) -> str | None:
        """Why `key` is not compiled (counted in `skipped`), or None: the time bound, a lighter remat that
        fits, the compile budget."""
        best = sorted(p["step_s"] for _, p in self.ranked)
        lesser = REMAT_ORDER[:REMAT_ORDER.index(key.remat)]
        lesser = [r for r in lesser if r != "lowrank" or self.model.low_rank]
        why = None
        if len(best) >= self.top and min(self.lb_t[c] for c in self.groups[key]) > best[self.top - 1]:
            why = "time_bound"
        elif lesser and (key.strategy, key.tp, key.micro_batch, lesser[-1]) not in self.overflow:
            why = "remat_not_needed"  # the lighter remat fits or was never compiled
        elif (self.compiled >= self.max_compiles or self.out_of_time()) and not is_cached(key, self.cache_dir):
            why = "compile_budget"
        if why:
            self.skipped[why] += len(self.groups[key])
        return why

    def keep_accepted(self, key: Key) -> list[Candidate]:
        """`key`'s candidates that train's full checks accept (the rest counted in `refused`)."""
        full = [c for c in self.groups[key] if accepted(self.model, c, self.seq, self.dtype, self.optimizer)]
        self.refused += len(self.groups[key]) - len(full)
        return full

    def compile_and_place(self, key: Key, note: str) -> None:
        """Measure `key` (compiled, or read from the cache), then predict and place its candidates."""
        m, fresh = measure(key, self.cache_dir)
        self.compiled, self.cached = self.compiled + fresh, self.cached + (not fresh)
        if self.log:
            self.log(f"{'compiled' if fresh else 'cached'} TP{key.tp} {key.strategy} mb{key.micro_batch} remat "
                     f"{key.remat} ({note}{time.perf_counter() - self.t0:.0f} s)")
        for c in self.groups[key]:
            p = predict(self.model, c, m, self.device_hw(c), self.eta, self.cl, self.seq, self.dtype)
            if p["peak_bytes_per_device"] > self.budget:
                self.overflow.add((key.strategy, key.tp, key.micro_batch, key.remat))
            self.place(c, p)

    def place(self, c: Candidate, p: dict) -> None:
        """Rank `c` where it fits; over the budget, keep it for an offload plan or reject it."""
        if c in self.include:
            self.predicted[c] = p
        if p["peak_bytes_per_device"] <= self.budget:
            self.ranked.append((c, p))
        elif can_offload(c, self.cl, self.max_offloads):
            self.pending.append((c, p))
        else:
            self.rejected.append((c, p))

    def try_offloads(self) -> None:
        """Offload plans for the candidates over the budget, fastest first (a plan only adds time, so the
        compiled prediction bounds the offloaded one): at most `max_offloads`, none for a candidate that
        cannot enter the `top` any more."""
        for c, p in sorted(self.pending, key=lambda cp: cp[1]["step_s"]):
            best = sorted(q["step_s"] for _, q in self.ranked)
            hopeless = len(best) >= self.top and p["step_s"] > best[self.top - 1]
            if hopeless or self.offloads["tried"] >= self.max_offloads or self.out_of_time():
                self.rejected.append((c, p))
                continue
            self.offloads["tried"] += 1
            got = offloading.offload(self.model, c, p, self.seq, self.dtype, self.optimizer, self.cl.hardware,
                                     self.budget, self.offload_time_limit_s)
            if self.log:
                self.log(f"offload plan for {c.label}: " + (f"fits, +{got['extra_s']:.3g} s" if got else "none fits"))
            if not got:
                self.rejected.append((c, p))
                continue
            self.offloads["fitted"] += 1
            self.plans[c] = got["plan"]
            self.ranked.append((c, offloaded(p, got, self.seq, c)))

    # -- the answer

    def included(self) -> dict[Candidate, dict]:
        """Each included candidate's prediction (its offloaded one where it got a plan)."""
        return {c: next((q for d, q in self.ranked if d == c), self.predicted[c]) for c in self.include}

    def counts(self) -> dict[str, int]:
        """The search's counts for `PlanResult.search`."""
        return {**{f"skipped_{k}": v for k, v in self.skipped.items()}, "refused_in_full": self.refused,
                "compile_keys": len(self.groups), "compiled": self.compiled, "cached": self.cached,
                "offload_plans_tried": self.offloads["tried"], "offload_plans_fitting": self.offloads["fitted"],
                "predicted": len(self.ranked) + len(self.rejected), "fitting": len(self.ranked)}
