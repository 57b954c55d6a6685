"""`plan_auto`: enumerate, prune by bounds, compile the survivors, rank by predicted step time.

1. `space.enumerate_space`: every configuration of the cluster `boostjax train` accepts.
2. Memory bound: a candidate whose `memory_lower_bound` exceeds the device budget is dropped.
3. Branch and bound over compile keys (`planning.branch`): best time bound first, remat only where a
   lighter one overflows, within `max_compiles` and `compile_seconds`.
4. `predict.predict` for every candidate of a compiled key; one over the budget is dropped unless an
   offload plan fits (`offloading`). The result is ranked by predicted step time, then peak memory.
5. With `measure_top` K, the K best-predicted candidates are timed (`planning.timing`).
Every rule, and why: docs/planning.md ("Pruning", "Search space").
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from boostjax.config import DEFAULT_PRESET, ConfigError, ModelConfig, validate_model
from boostjax.models.flops import param_count
from boostjax.planning import cpu, timing
from boostjax.planning.branch import Search, can_offload
from boostjax.planning.cluster import Cluster, parse_cluster, profile_rates
from boostjax.planning.costs import Hardware
from boostjax.planning.space import (RUN_PLACEHOLDERS, Candidate, commands, enumerate_space, memory_lower_bound,
                                     with_seq)
from boostjax.runtime.profiles import GiB as GIB, get_profile

MEMORY_FRACTION = 0.9  # of the device's memory: the rest for the runtime, fragmentation, the input pipeline


class NothingFits(ConfigError):
    """No configuration fits the devices' memory (one line: the smallest shortfall and what would fix it)."""


@dataclass
class PlanResult:
    cluster: Cluster
    hardware: Hardware
    eta: float
    budget_bytes: float
    candidates: list[dict[str, Any]]  # fitting, ranked
    search: dict[str, Any]
    calibration: dict[str, Any] | None = None
    rejected: list[dict[str, Any]] = field(default_factory=list)  # compiled but over the budget
    included: list[dict[str, Any]] = field(default_factory=list)  # plan_auto(include=...): always predicted
    measured: dict[str, Any] | None = None  # plan_auto(measure_top=K): how the top K were timed
    model: dict[str, Any] = field(default_factory=dict)  # what was planned (`planned_model`)
    warnings: list[str] = field(default_factory=list)  # what the answer rests on that the user did not give

    @property
    def winner(self) -> dict[str, Any]:
        """The candidate to run: the measured fastest of the timed top candidates, else the predicted first."""
        if self.measured:
            return next(r for r in self.candidates if r["label"] == self.measured["winner"])
        return self.candidates[0]

    def to_json(self) -> dict[str, Any]:
        return {"cluster": self.cluster.text, "hardware": asdict(self.hardware), "eta": self.eta,
                "budget_bytes_per_device": self.budget_bytes, "search": self.search,
                "calibration": self.calibration, "candidates": self.candidates, "rejected": self.rejected[:10],
                "winner": self.winner["label"], "winner_by": "measured" if self.measured else "predicted",
                **({"measured": self.measured} if self.measured else {}),
                **({"included": self.included} if self.included else {}),
                "planned_model": self.model, "warnings": self.warnings}


def cpu_memory_bytes() -> float:
    """This machine's memory (the budget of all its simulated devices together)."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_budget(cluster: Cluster) -> float:
    """Bytes a device may hold: MEMORY_FRACTION of its memory (the CPU: of this machine's, over its devices)."""
    if cluster.is_cpu:
        return MEMORY_FRACTION * cpu_memory_bytes() / cluster.devices
    return MEMORY_FRACTION * get_profile(cluster.hardware).device_bytes


def rates(cluster: Cluster, dtype: str) -> tuple[Hardware, float, dict | None]:
    """(machine rates, GEMM efficiency eta, the CPU calibration or None)."""
    if cluster.is_cpu:
        hw, raw = cpu.calibrate(cluster.devices, dtype)
        return hw, 1.0, raw
    p = get_profile(cluster.hardware)
    return profile_rates(p), p.gemm_efficiency, None


def checked_space(model: ModelConfig, cluster: Cluster, global_batch: int, seq: int, dtype: str,
                  optimizer: str) -> tuple[list[Candidate], dict[str, int]]:
    """`space.enumerate_space`, refusing (one line) a global batch no data axis of the cluster divides."""
    space, counts = enumerate_space(with_seq(model, seq), cluster, global_batch, seq, dtype, optimizer)
    if not space:
        n = cluster.devices
        some, _ = enumerate_space(with_seq(model, seq), cluster, n * global_batch, seq, dtype, optimizer)
        datas = sorted({c.data for c in some})
        if not datas:
            raise ConfigError(f"plan.cluster: no data x stage x model split of {n} devices runs this model (its "
                              "heads, ranks, layers or vocabulary do not divide); fix: pick a device count that "
                              "divides them, e.g. --cluster 1x1:...")
        d = datas[0]
        raise ConfigError(f"plan.global_batch: {global_batch} sequences do not split over any data axis this model "
                          f"allows on {n} devices (data {datas}); fix: pass --global-batch a multiple of {d}, "
                          f"e.g. {-(-global_batch // d) * d}")
    return space, counts


PRESET_VOCAB = "preset"  # `vocab_source` of a vocabulary nobody gave: the preset's default (the byte tokenizer's)


def planned_model(model: ModelConfig, preset_name: str | None, vocab_source: str | None) -> dict[str, Any]:
    """The model a plan is for, as the answer shows it: kind, preset, shape, vocabulary and where it came
    from (`vocab_source`: a flag, a data folder, `PRESET_VOCAB`; None: the caller's ModelConfig), parameters."""
    return {"kind": model.kind, "preset": preset_name, "n_layers": model.n_layers, "d_model": model.d_model,
            "vocab_size": model.vocab_size, "vocab_source": vocab_source or "given", "parameters": param_count(model)}


def vocab_warning(vocab_size: int, preset_name: str | None) -> str:
    """The warning of a plan made with the preset's vocabulary: its embedding and head are not the run's."""
    return (f"vocabulary {vocab_size} is the {preset_name or DEFAULT_PRESET} preset's default (the byte-level "
            "tokenizer), given by neither --vocab-size nor a tokenised --data folder: a run with another "
            "tokenizer has another embedding and LM head (their memory and time); fix: pass --vocab-size V "
            "(the tokenizer's) or --data FOLDER (a boostjax tokenize folder names it)")


def check_inputs(model: ModelConfig, cluster: Cluster | str, global_batch: int, seq: int) -> Cluster:
    """One-line ConfigErrors for the inputs, before anything is compiled."""
    cl = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    if not (isinstance(global_batch, int) and global_batch >= 1):
        raise ConfigError(f"plan.global_batch: must be a positive integer, got {global_batch!r}; "
                          "fix: pass --global-batch N (sequences per optimizer step)")
    if not (isinstance(seq, int) and seq >= 1):
        raise ConfigError(f"plan.seq: must be a positive integer, got {seq!r}; fix: pass --seq N")
    validate_model(model)
    return cl


def plan_auto(model: ModelConfig, cluster: Cluster | str, global_batch: int, seq: int, dtype: str | None = None,
              optimizer: str = "adamw", top: int = 5, preset_name: str | None = None, cache_dir: str | None = None,
              hardware: Hardware | None = None, eta: float | None = None, budget_bytes: float | None = None,
              max_compiles: int = 8, include: tuple[Candidate, ...] = (), log=None, max_offloads: int = 4,
              offload_time_limit_s: float = 10.0, offload_dir: str = ".",
              compile_seconds: float | None = None, measure_top: int = 0, measure_rounds: int = 20,
              run_args: Sequence[str] = RUN_PLACEHOLDERS, vocab_source: str | None = None) -> PlanResult:
    """Rank the configurations of `model` on `cluster` (`"2x8:A100-80GB"`, `"1x8:cpu"`) for `global_batch`
    sequences of `seq` tokens per optimizer step (docs/planning.md). `dtype`: bfloat16 on GPUs, float32
    on the CPU by default. `hardware` / `eta` / `budget_bytes` override the cluster's rates (machine
    rates: on the CPU they are shared by the devices). JAX must see at least the largest model axis's
    devices (simulated on the CPU: `boostjax.runtime.devices.simulate_devices`). Raises ConfigError
    (one line) on bad input, `NothingFits` when no configuration fits. `include`: candidates measured and
    predicted whatever the bounds and the budget say (`PlanResult.included`; ranked too where they fit).
    `max_offloads` / `offload_time_limit_s`: offload plans solved at most / CP-SAT seconds each;
    `offload_dir`: the folder an offloaded candidate's `train_command` reads its plan file from;
    `compile_seconds`: no compile or offload solve starts after that many seconds (None: no limit).
    `measure_top`: time the K best-predicted candidates' training steps on this process's devices,
    `measure_rounds` steps each, interleaved (`planning.timing`), and make the fastest the winner.
    `run_args`: appended to each row's configuration as its `run_command` (`space.commands`; default the
    placeholders `--data DATA --out RUN --steps STEPS`); `vocab_source`: where `model.vocab_size` came
    from (`planned_model`; `PRESET_VOCAB` adds `vocab_warning` to the result's `warnings`, and to `log`
    once the space is known to fit, before anything is compiled)."""
    t0 = time.perf_counter()
    cl = check_inputs(model, cluster, global_batch, seq)
    _check_measure(cl, measure_top, measure_rounds)
    dtype = dtype or ("float32" if cl.is_cpu else "bfloat16")
    model = with_seq(model, seq)
    space, counts = checked_space(model, cl, global_batch, seq, dtype, optimizer)
    budget = budget_bytes or device_budget(cl)
    lb_mem = {c: memory_lower_bound(model, c, seq, dtype, optimizer) for c in space}
    fits = _fitting(space, lb_mem, budget, cl, max_offloads)
    warnings = [vocab_warning(model.vocab_size, preset_name)] if vocab_source == PRESET_VOCAB else []
    if log:  # before the compiles: the user may stop and give what is missing
        for w in warnings:
            log(f"boostjax: warning: {w}")
        log(f"compiled measurements: {f'read from and kept in {cache_dir}' if cache_dir else 'not kept on disk'}")
    calib = None
    if hardware is None:
        hardware, eta0, calib = rates(cl, dtype)
        eta = eta0 if eta is None else eta
    hw, eta = hardware, 1.0 if eta is None else eta
    s = Search(model, cl, seq, global_batch, dtype, optimizer, budget, hw, eta, lb_mem, top=top,
               max_compiles=max_compiles, max_offloads=max_offloads, offload_time_limit_s=offload_time_limit_s,
               compile_seconds=compile_seconds, cache_dir=cache_dir, include=tuple(include), log=log, t0=t0)
    s.group(fits, space)
    s.run()
    included = s.included()
    search = {**counts, "valid": len(space), "pruned_memory_bound": len(space) - len(fits), **s.counts(),
              "devices": cl.devices, "global_batch": global_batch, "seq": seq, "dtype": dtype,
              "optimizer": optimizer, "cache_dir": cache_dir, "wall_s": round(time.perf_counter() - t0, 1)}
    if not s.ranked:
        c, p = min(s.rejected, key=lambda cp: cp[1]["peak_bytes_per_device"])
        raise NothingFits(_shortfall(c, p["peak_bytes_per_device"], budget, cl, "a predicted"))
    s.ranked.sort(key=lambda cp: (cp[1]["step_s"], cp[1]["peak_bytes_per_device"]))
    rows, inc, rej = _rows(s, included, preset_name, offload_dir, run_args)
    measured = _measure_top(model, rows, measure_top, measure_rounds, seq, dtype, optimizer, cl, log) \
        if measure_top else None
    return PlanResult(cl, hw, eta, budget, rows, search, calib, rej, inc, measured,
                      planned_model(model, preset_name, vocab_source), warnings)


def _check_measure(cl: Cluster, measure_top: int, measure_rounds: int) -> None:
    """One-line ConfigErrors for `measure_top` / `measure_rounds` (and a cluster this process cannot time)."""
    if measure_top < 0:
        raise ConfigError(f"plan.measure_top: must be >= 0, got {measure_top}; fix: pass --measure-top 3")
    if measure_top:
        timing.check_local(cl)
        if measure_rounds < 1:
            raise ConfigError(f"plan.measure_rounds: must be >= 1, got {measure_rounds}; fix: pass --measure-rounds 20")


def _fitting(space: list[Candidate], lb_mem: dict[Candidate, float], budget: float, cl: Cluster,
             max_offloads: int) -> list[Candidate]:
    """The candidates whose memory bound fits the budget (plus the host's memory where an offload plan may
    move state there); `NothingFits` when none does."""
    host = 0.0 if cl.is_cpu else float(get_profile(cl.hardware).host_bytes)
    fits = [c for c in space
            if lb_mem[c] <= budget or (can_offload(c, cl, max_offloads) and lb_mem[c] <= budget + host)]
    if not fits:
        c = min(space, key=lambda c: lb_mem[c])
        raise NothingFits(_shortfall(c, lb_mem[c], budget, cl, "at least"))
    return fits


def _rows(s: Search, included: dict[Candidate, dict], preset_name: str | None, offload_dir: str,
          run_args: Sequence[str]) -> tuple[list[dict], list[dict], list[dict]]:
    """The answer's rows of the ranked (with `why_slower`), the included and the first 10 rejected candidates."""
    def row(c: Candidate, p: dict, plan: Any = None) -> dict[str, Any]:
        return _candidate_row(s.model, c, p, s.seq, s.dtype, s.optimizer, s.cl, preset_name, plan, offload_dir,
                              run_args)

    rows = [row(c, p, s.plans.get(c)) for c, p in s.ranked]
    _why(rows)
    inc = [{**row(c, included[c], s.plans.get(c)),
            "fits": included[c]["peak_bytes_per_device"] <= s.budget,
            "rank": next((i for i, (d, _) in enumerate(s.ranked, 1) if d == c), None)} for c in s.include]
    rej = [row(c, p) for c, p in sorted(s.rejected, key=lambda cp: cp[1]["step_s"])[:10]]
    return rows, inc, rej


def _measure_top(model, rows: list[dict], k: int, rounds: int, seq: int, dtype: str, optimizer: str, cl: Cluster,
                 log) -> dict[str, Any] | None:
    """Times the `k` best-predicted rows without an offload plan (`timing.time_steps`), sets each one's
    `measured_step_s` (median) and `measured_steps_s`, and returns how, with the fastest as `winner`."""
    chosen = [r for r in rows if "offload_plan" not in r][:k]
    if not chosen:
        if log:
            log("measure-top: every candidate needs an offload plan, which is not timed; the predicted first wins")
        return None
    times = timing.time_steps(model, [timing.candidate_of(r) for r in chosen], seq, dtype, optimizer, rounds,
                              cpu=cl.is_cpu, log=log)
    for r in chosen:
        steps = times[timing.candidate_of(r)]
        r["measured_step_s"], r["measured_steps_s"] = statistics.median(steps), steps
    best = min(chosen, key=lambda r: r["measured_step_s"])
    return {"top": k, "rounds": rounds, "statistic": "median of interleaved steps", "timed": [r["label"] for r in chosen],
            "winner": best["label"], "predicted_first": rows[0]["label"]}


def _candidate_row(model, c: Candidate, p: dict, seq, dtype, optimizer, cl, preset_name, plan=None,
                   offload_dir: str = ".", run_args: Sequence[str] = RUN_PLACEHOLDERS) -> dict[str, Any]:
    """One table row of the plan: the candidate, its prediction `p`, its offload plan (written to
    `offload_dir`) and the commands that run it."""
    row = {"label": c.label + (" +offload" if plan is not None else ""), **asdict(c), **p}
    if plan is None:
        return {**row, **commands(model, c, seq, dtype, optimizer, cl, preset_name, run_args=run_args)}
    path = os.path.join(offload_dir, offload_file(c))
    return {**row, "offload_plan": json.loads(plan.to_json()), "offload_plan_file": path,
            **commands(model, c, seq, dtype, optimizer, cl, preset_name, offload_plan=path, run_args=run_args)}


def offload_file(c: Candidate) -> str:
    """The file name of a candidate's offload plan."""
    stages = f"_PP{c.stage}_{c.schedule}x{c.slots}" if c.stage > 1 else ""
    return f"offload_D{c.data}{stages}_TP{c.model}_{c.strategy}_mb{c.micro_batch}.json"


_PART_NAMES = {"compute": "more GEMM time", "memory": "more memory traffic", "model_comm": "more TP communication",
               "accumulate": "more gradient accumulation", "optimizer": "a slower optimizer step", "data_comm": "more data-parallel communication",
               "stage_p2p": "more pipeline sends",
               "stage_comm": "more pipeline collectives (head split, gradients over the stages)", "bubble": "a larger pipeline bubble",
               "offload": "an offload plan's recomputation and transfers"}


def _percent(x: float) -> str:
    """A positive fraction as a percentage: one decimal, or two significant digits below 0.1 % (never +0.0 %)."""
    return f"+{x:.1%}" if x >= 1e-3 else f"+{x * 100:.2g}%"


def _why(rows: list[dict]) -> None:
    """`why_slower` of every runner-up against the winner (the first row): its largest time part over the
    winner's, or `tie` where the predicted step time is the same (ranked behind for its memory)."""
    first = rows[0]
    win = first["time_s"]
    for r in rows[1:]:
        slower = r["step_s"] / first["step_s"] - 1
        if not slower > 0:  # the same predicted time: ranked by peak memory
            more = r["peak_bytes_per_device"] - first["peak_bytes_per_device"]
            r["why_slower"] = ("tie: same predicted time" + (f", {more / GIB:.3g} GiB more peak memory" if more > 0
                                                             else ""))
            continue
        delta = {k: r["time_s"].get(k, 0.0) - win.get(k, 0.0) for k in {**win, **r["time_s"]}}
        k = max(delta, key=delta.get)
        part = f"{_PART_NAMES[k]} (+{delta[k] * 1e3:.3g} ms)" if delta[k] > 0 else "more time over several parts"
        r["why_slower"] = f"{_percent(slower)}: {part}"
    first["why_slower"] = "fastest"


def _shortfall(c: Candidate, need: float, budget: float, cl: Cluster, what: str) -> str:
    over = need - budget
    more = max(2, math.ceil(need / budget)) * cl.devices
    fix = (f"more devices (e.g. {max(1, more // cl.per_node)}x{cl.per_node}:{cl.hardware} shards the state "
           f"further), a smaller --global-batch or --seq (smaller micro-batches), or an offload plan "
           f"(boostjax plan --mesh {c.mesh} --strategy {c.strategy} ...)")
    return (f"plan.cluster: no configuration fits {budget / GIB:.3g} GiB per device on {cl.text}; the closest, "
            f"{c.label}, needs {what} {need / GIB:.3g} GiB ({over / GIB:.3g} GiB short); fix: {fix}")


__all__ = ["MEMORY_FRACTION", "PRESET_VOCAB", "NothingFits", "PlanResult", "check_inputs", "checked_space",
           "device_budget", "offload_file", "plan_auto", "planned_model", "rates", "vocab_warning"]
