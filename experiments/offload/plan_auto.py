"""Validating `boostjax plan --auto` three ways.

(a) BOOST's published configurations (1B TP1, 3B TP2, 7B TP4, 13B TP4 PP2; A100 80GB; 4 micro-batches of
    one 4096-token sequence per iteration, CoLA, vocabulary 32000): the planner plans each on BOOST's
    devices (1x1, 1x2, 1x4 and 2x4:A100-80GB, 4-GPU nodes) with the scaling model's GEMM efficiency (eta,
    `experiments/results/scaling_model.json`, fitted there on BOOST's 1B full-rank time), and BOOST's own
    configuration is predicted by the same code (`plan_auto(include=...)`): is the planner's choice
    predicted at least as fast? BOOST's README times (BTP) beside them.
(b) 8 simulated CPU devices, the tiny preset: >= 10 configurations spanning data / stage / model axes,
    TP strategies, accumulation, schedules, remat and ZeRO (plus the planner's own first choice), each
    predicted by the planner (CPU profile calibrated by `boostjax.planning.cpu`: seconds per GEMM and per
    memory-bound instruction at a few sizes and per all-reduce, all simulated devices at once) and measured
    by training 20 steps with its own `train_command` (interleaved rounds; the fastest of steps 3-20 of
    all rounds together, the median beside it, `summarize`; the load average is recorded). The even rounds
    against the odd ones (`split_half`) and every two rounds (`retest_spearman`) say how far the machine's
    noise lets any prediction go.
    Spearman rank correlation predicted vs measured (`spearman`), and whether the first choice is the
    measured fastest or within 10 % of it.
(c) memory for the same CPU configurations: the planner's peak per device vs the compiled step of the
    whole configuration (`analysis.memory.memory_report`: `memory_analysis()` of the mesh's program) and
    vs the training process's peak RSS (all 8 simulated devices and the runtime: divided by 8 for the
    per-device column, an upper bound).

    python -m experiments.offload.plan_auto --part boost       # (a)
    python -m experiments.offload.plan_auto --part cpu         # (b), (c)
    python -m experiments.offload.plan_auto --part memory      # (c) only, on the stored (b) rows: nothing trained
    python -m experiments.offload.plan_auto --part timing      # 7B on 8x8 A100s from an empty cache: wall time
    python -m experiments.offload.plan_auto --from-json experiments/results/plan_auto.json   # re-render

Each part updates experiments/results/plan_auto.json (the other part's results are kept) and rewrites
the md and png. Compiled measurements are cached under --cache (default /tmp/boostjax-plan-cache).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace

import numpy as np

from experiments import common
from experiments.common import log

RESULTS = common.RESULTS
ROOT = common.ROOT
# name, nodes, GPUs per node, stages, BOOST's TP (BOOST: 4-GPU A100 nodes)
BOOST = (("1b", 1, 1, 1, 1), ("3b", 1, 2, 1, 2), ("7b", 1, 4, 1, 4), ("13b", 2, 4, 2, 4))
CPU_PRESET, CPU_SEQ, CPU_BATCH = "tiny", 64, 16
# (data, stage, model, strategy, micro_batch, slots, schedule, remat, zero): every axis is varied (data 1-8,
# stages 1-4, TP 1-4, BTP and vanilla TP, 1-8 micro-batches, GPipe and 1F1B, every remat, every ZeRO)
CPU_CONFIGS = (
    (8, 1, 1, "none", 2, 1, "-", "none", 0),
    (8, 1, 1, "none", 2, 1, "-", "none", 3),
    (8, 1, 1, "none", 1, 2, "-", "none", 1),
    (4, 2, 1, "none", 2, 2, "gpipe", "none", 0),
    (4, 2, 1, "none", 1, 4, "1f1b", "none", 0),
    (2, 4, 1, "none", 2, 4, "gpipe", "none", 0),
    (4, 1, 2, "btp", 2, 2, "-", "none", 0),
    (2, 2, 2, "btp", 2, 4, "1f1b", "none", 0),
    (4, 1, 2, "vanilla-tp", 2, 2, "-", "none", 1),
    (4, 1, 2, "btp", 2, 2, "-", "full", 0),
    (2, 2, 2, "btp", 2, 4, "gpipe", "full", 3),
    # added with the recalibrated profile: TP over 4 devices, lowrank remat, 8 micro-batches, 4 stages with 1F1B
    (2, 1, 4, "btp", 2, 4, "-", "none", 0),
    (2, 2, 2, "btp", 1, 8, "1f1b", "lowrank", 1),
    (2, 1, 4, "vanilla-tp", 8, 1, "-", "none", 3),
    (1, 4, 2, "btp", 2, 8, "1f1b", "none", 0),
    (4, 1, 2, "btp", 4, 1, "-", "lowrank", 0),
    (1, 2, 4, "btp", 4, 4, "gpipe", "none", 0),
    (2, 4, 1, "none", 1, 8, "1f1b", "full", 1),
    (8, 1, 1, "none", 1, 2, "-", "none", 0),
)
MEASURE_TOP = 3  # the planner times its 3 best-predicted candidates (`plan --auto --measure-top 3`)
ORIGINAL = 11  # the first configurations, measured since the first validation run
MEASURE_STEPS = 20  # the median of steps 3..20 (18 steps) is one run's time
MEASURE_FLAGS = ["--steps", str(MEASURE_STEPS), "--log-every", "1", "--eval-every", "1000", "--eval-batches", "1",
                 "--ckpt-every", "1000", "--no-progress", "--no-tensorboard"]
_RSS = ("import resource, sys; from boostjax.cli import main; rc = main(sys.argv[1:]); "
        "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)")


def boost_part(cache: str, max_compiles: int, setups: tuple[str, ...], ignore_memory: bool) -> dict:
    import scaling_model
    from boostjax.planning.search import plan_auto
    from boostjax.planning.space import Candidate

    eta = json.loads((RESULTS / "scaling_model.json").read_text())["eta"]
    sm = {r["setup"]: r for r in json.loads((RESULTS / "scaling_model.json").read_text())["rows"]
          if r["table"] == "paper" and r["strategy"] == "btp"}
    rows = []
    for name, nodes, per, pp, tp in (b for b in BOOST if b[0] in setups):
        model = scaling_model.SHAPES[name]
        own = Candidate(1, pp, tp, "btp" if tp > 1 else "none", 1, 4, "1f1b" if pp > 1 else "-", "none", 0)
        t0 = time.perf_counter()
        res = plan_auto(model, f"{nodes}x{per}:A100-80GB", 4, 4096, dtype="bfloat16", eta=eta, top=3,
                        budget_bytes=1e18 if ignore_memory else None,
                        max_compiles=max_compiles, include=(own,), cache_dir=cache, preset_name=name, log=log)
        win, boost = res.candidates[0], res.included[0]
        plain = next((c for c in res.candidates if "offload_plan" not in c), None)  # the best without offload
        label = f"{name.upper()} TP{tp}" + (f" PP{pp}" if pp > 1 else "")
        rows.append({"setup": label, "cluster": res.cluster.text, "planner": win["label"],
                     "planner_s": win["step_s"], "planner_peak_gib": win["peak_bytes_per_device"] / 2**30,
                     "planner_command": win["train_command"], "boost_config": boost["label"],
                     "boost_s": boost["step_s"], "boost_fits": boost["fits"], "boost_rank": boost["rank"],
                     "boost_peak_gib": boost["peak_bytes_per_device"] / 2**30,
                     "scaling_model_btp_s": sm.get(label, {}).get("iteration_s"),
                     "readme_btp_s": scaling_model.PAPER[name]["btp"],
                     "planner_at_least_as_fast": win["step_s"] <= boost["step_s"] * (1 + 1e-9),
                     "planner_offloaded": "offload_plan" in win,
                     "no_offload": plain and {"label": plain["label"], "step_s": plain["step_s"],
                                              "peak_gib": plain["peak_bytes_per_device"] / 2**30},
                     "search": res.search, "wall_s": round(time.perf_counter() - t0, 1)})
        log(f"{label}: planner {win['label']} {win['step_s']:.3f} s vs BOOST {boost['step_s']:.3f} s")
    return {"eta": eta, "rows": rows, "memory_ignored": ignore_memory, "max_compiles": max_compiles}


TIMING_ARGV = ["plan", "--auto", "--preset", "7b", "--seq", "4096", "--global-batch", "64", "--cluster",
               "8x8:A100-80GB"]


def timing_part() -> dict:
    """`boostjax plan --auto` for 7B on 64 A100s (the goal: <= 5 minutes on 2 cores), as a separate
    process with an empty cache folder: wall time, peak RSS, the load average, the search counts and the winner."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [*TIMING_ARGV, "--out", f"{tmp}/p.json", "--cache-dir", f"{tmp}/cache"]
        env = common.with_root()
        load0 = os.getloadavg()
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", _RSS, *argv], env=env, capture_output=True, text=True,
                           timeout=1800)
        wall = time.perf_counter() - t0
        load1 = os.getloadavg()
        if p.returncode:
            raise SystemExit(f"plan_auto timing: boostjax {' '.join(argv)} failed: {p.stderr.strip()[-500:]}")
        doc = json.loads(pathlib.Path(tmp, "p.json").read_text())
    rss = next(int(x.split()[1]) for x in p.stderr.splitlines() if x.startswith("MAXRSS_KB"))
    win = doc["candidates"][0]
    log(f"7B on 8x8:A100-80GB: {wall:.0f} s, winner {win['label']} {win['step_s']:.3f} s")
    return {"command": "boostjax " + " ".join(TIMING_ARGV) + " --out P.json --cache-dir EMPTY_DIR",
            "wall_s": round(wall, 1), "max_rss_bytes": rss * 1024, "load_before": load0, "load_after": load1,
            "cpu_count": os.cpu_count(), "search": doc["search"], "winner": win["label"],
            "winner_step_s": win["step_s"], "winner_peak_gib": win["peak_bytes_per_device"] / 2**30,
            "winner_command": win["train_command"],
            "top": [{k: c[k] for k in ("label", "step_s", "peak_bytes_per_device")} for c in doc["candidates"][:5]],
            "within_300_s": wall <= 300}


def _measure(argv: list[str], out: str) -> dict:
    env = {**common.with_root(),
           "JAX_PLATFORMS": "cpu"}
    load = os.getloadavg()[0]
    p = subprocess.run([sys.executable, "-c", _RSS, *argv[1:], *MEASURE_FLAGS, "--out", out], env=env,
                       capture_output=True, text=True, timeout=1800)
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1:] or ["?"], "load": load}
    rss = next(int(x.split()[1]) for x in p.stderr.splitlines() if x.startswith("MAXRSS_KB"))
    recs = [json.loads(x) for x in pathlib.Path(out, "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r["step_s"] for r in recs if "step_s" in r and r.get("step", 0) >= 3]
    return {"step_s": statistics.median(steps), "steps": steps, "max_rss_bytes": rss * 1024, "load": load}


def step_times(model, rows: list[dict], rounds: int) -> dict[str, list[float]]:
    """Seconds of each row's compiled training step, all compiled in this process and run one step each in
    turn, `rounds` times (`planning.timing.time_steps`, what `plan --auto --measure-top` times): a change in
    the machine's load reaches every configuration alike."""
    from boostjax.planning.timing import time_steps

    got = time_steps(model, [_candidate(r) for r in rows], CPU_SEQ, "float32", "adamw", rounds, cpu=True, log=log)
    return {r["label"]: got[_candidate(r)] for r in rows}


def _candidate(r: dict):
    from boostjax.planning.timing import candidate_of

    return candidate_of(r)


def _compiled_peak(model, r: dict) -> None:
    """Sets `r["compiled_peak_bytes_per_device"]`: `memory_analysis()` of the whole configuration's step, the
    step its `train_command` compiles (every axis, accumulation, pipeline schedule, ZeRO)."""
    from boostjax.analysis.memory import memory_report

    t = _candidate(r).train_fields(CPU_SEQ, "float32", "adamw")
    extra = {k: t[k] for k in ("grad_accum", "zero", "microbatches", "pipeline_schedule") if k in t}
    rep = memory_report(replace(model, attention="xla"), t["mesh"], t["batch"], CPU_SEQ, t["strategy"],
                        t["remat"], "float32", **extra)
    r["compiled_peak_bytes_per_device"] = rep["peak_bytes_per_device"]
    log(f"memory {r['label']}: planned {r['peak_bytes_per_device'] / 2**20:.1f} MiB, compiled "
        f"{rep['peak_bytes_per_device'] / 2**20:.1f} MiB")


def memory_part(cache: str, cpu: dict) -> dict:
    """(c) again on the stored CPU rows, nothing trained: the planner's peak per device (its memory model as
    it is now) and the compiled whole-configuration peak; the rows' measured times are kept."""
    from boostjax.config import preset
    from boostjax.planning.search import plan_auto

    model = preset(CPU_PRESET)
    include = tuple(_candidate(r) for r in cpu["rows"])
    res = plan_auto(model, "1x8:cpu", CPU_BATCH, CPU_SEQ, include=include, top=3, max_compiles=1,
                    preset_name=CPU_PRESET, cache_dir=cache, log=log)
    planned = {r["label"]: r for r in res.included}
    keys = ("peak_bytes_per_device", "weight_bytes", "optimizer_bytes", "activation_bytes")
    for r in cpu["rows"]:
        r.update({k: planned[r["label"]][k] for k in keys})
        _compiled_peak(model, r)
    return cpu


def cpu_part(cache: str, rounds: int, step_rounds: int) -> dict:
    from boostjax.config import preset
    from boostjax.planning.search import plan_auto
    from boostjax.planning.space import Candidate

    model = preset(CPU_PRESET)
    include = tuple(Candidate(*c) for c in CPU_CONFIGS)
    res = plan_auto(model, "1x8:cpu", CPU_BATCH, CPU_SEQ, include=include, top=3, max_compiles=1,
                    preset_name=CPU_PRESET, cache_dir=cache, log=log, measure_top=MEASURE_TOP,
                    measure_rounds=step_rounds)
    timed = {r["label"]: r["measured_step_s"] for r in res.candidates if "measured_step_s" in r}
    rows = list(res.included)
    for extra in (res.candidates[0], res.winner):  # the planner's choices are always measured
        if extra["label"] not in {r["label"] for r in rows}:
            rank = next(i for i, c in enumerate(res.candidates, 1) if c["label"] == extra["label"])
            rows.append({k: v for k, v in extra.items() if not k.startswith("measured_")} | {"fits": True, "rank": rank})
    for r in rows:
        r["planner_first"] = r["label"] == res.candidates[0]["label"]
        r["planner_winner"] = r["label"] == res.winner["label"]
    load0 = os.getloadavg()[0]
    steps = step_times(model, rows, step_rounds)
    for r in rows:
        r["step_times_s"] = steps[r["label"]]
    runs: dict[str, list] = {r["label"]: [] for r in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(rounds):  # interleaved: every configuration once per round, the order reversed every other
            for i, r in (enumerate(rows) if k % 2 == 0 else reversed(list(enumerate(rows)))):
                got = _measure(r["train_command"].split(), f"{tmp}/r{k}_{i}")
                runs[r["label"]].append(got)
                log(f"round {k} {r['label']}: {got.get('step_s', got.get('error'))} (load {got['load']:.1f})")
    for r in rows:
        r["measured_runs"] = runs[r["label"]]
        _compiled_peak(model, r)
    old = [r["label"] for r in rows[:ORIGINAL]]  # include's order is CPU_CONFIGS'
    return {"model": CPU_PRESET, "seq": CPU_SEQ, "global_batch": CPU_BATCH, "rounds": rounds,
            "measure_top": {**res.measured, "timed_step_s": timed},
            "calibration": res.calibration, "hardware": asdict(res.hardware), "search": res.search,
            "rows": rows, "step_rounds": step_rounds, "step_rounds_load": load0,
            **summarize(rows, rounds, old)}


def _pooled(r: dict, stat, rounds=slice(None)) -> float | None:
    steps = [x for g in r["measured_runs"][rounds] if "step_s" in g for x in g["steps"]]
    return float(stat(steps)) if steps else None


def summarize(rows: list[dict], rounds: int, original: list[str]) -> dict:
    """The (b) statistics of measured rows (each with `measured_runs` and `step_times_s`); sets each row's
    measured columns.

    A run's steps are a fixed cost plus whatever the shared machine's other work adds, never less: the
    fastest step over all rounds (`min`, as `timeit` reports) is the measured time of a configuration, and the
    pooled median is kept beside it. The choice is the statistic whose halves agree best: the even rounds
    against the odd ones (`split_half`, model-free), 0.91 for the fastest step against 0.77 for the median in
    the 5-round run of 8d9d9e1, and at least as high in each of the four stored runs before it (0.81 / 0.77,
    0.98 / 0.97, 0.76 / 0.51, 0.89 / 0.81). In-process steps, one of each configuration in turn, share
    every change of load: their median is kept (its halves agreed 0.96-0.98 there, the fastest step's
    0.88-0.98)."""
    for r in rows:
        ok = [g for g in r["measured_runs"] if "step_s" in g]
        r["measured_step_s"] = _pooled(r, min)
        r["measured_median_s"] = _pooled(r, statistics.median)
        r["measured_best_run_s"] = min(g["step_s"] for g in ok) if ok else None
        r["measured_max_rss_bytes"] = max(g["max_rss_bytes"] for g in ok) if ok else None
        r["measured_in_process_s"] = statistics.median(r["step_times_s"])
    done = [r for r in rows if len([g for g in r["measured_runs"] if "step_s" in g]) == rounds]

    def rho(rs, key):
        pairs = [(r["step_s"], key(r)) for r in rs if key(r) is not None]
        return spearman([p for p, _ in pairs], [m for _, m in pairs])

    def split_half(stat):
        return spearman([_pooled(r, stat, slice(0, None, 2)) for r in done],
                        [_pooled(r, stat, slice(1, None, 2)) for r in done]) if rounds > 1 and len(done) > 2 else None

    retest = [spearman([min(r["measured_runs"][a]["steps"]) for r in done],
                       [min(r["measured_runs"][b]["steps"]) for r in done])
              for a in range(rounds) for b in range(a + 1, rounds)] if len(done) > 2 else []
    old = [r for r in rows if r["label"] in original and r["measured_step_s"]]
    fastest = min(r["measured_step_s"] for r in rows if r["measured_step_s"])
    fastest_median = min(r["measured_median_s"] for r in rows if r["measured_median_s"])
    fastest_steps = min(r["measured_in_process_s"] for r in rows)
    first = next(r for r in rows if r["planner_first"])
    win = next((r for r in rows if r.get("planner_winner")), None)  # --measure-top's (runs before it: none)

    def within(x, best):
        return bool(x is not None and x <= 1.1 * best)

    return {"spearman": rho(rows, lambda r: r["measured_step_s"]),
            "measured_statistic": f"fastest of steps 3-{MEASURE_STEPS} over all rounds",
            "spearman_median": rho(rows, lambda r: r["measured_median_s"]),
            "spearman_best_run": rho(rows, lambda r: r["measured_best_run_s"]),
            "split_half": {"fastest": split_half(min), "median": split_half(statistics.median)},
            "retest_spearman": retest, "first_choice": first["label"],
            "first_choice_measured_s": first["measured_step_s"], "measured_fastest_s": fastest,
            "first_choice_within_10pct": within(first["measured_step_s"], fastest),
            "first_choice_within_10pct_median": within(first["measured_median_s"], fastest_median),
            "spearman_in_process": rho(rows, lambda r: r["measured_in_process_s"]),
            "first_choice_in_process_s": first["measured_in_process_s"], "fastest_in_process_s": fastest_steps,
            "first_choice_within_10pct_in_process": within(first["measured_in_process_s"], fastest_steps),
            **({"winner": win["label"], "winner_measured_s": win["measured_step_s"],
                "winner_within_10pct": within(win["measured_step_s"], fastest),
                "winner_within_10pct_median": within(win["measured_median_s"], fastest_median)} if win else {}),
            "spearman_original": rho(old, lambda r: r["measured_step_s"]),
            "spearman_original_in_process": rho(old, lambda r: r["measured_in_process_s"]),
            "original_rows": len(old)}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho (average ranks for ties)."""
    def ranks(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in set(x):
            idx = [i for i, y in enumerate(x) if y == v]
            r[idx] = np.mean(r[idx])
        return r
    ra, rb = ranks(list(a)), ranks(list(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def markdown(res: dict) -> str:
    lines = ["# `boostjax plan --auto`: validation", ""]
    b = res.get("boost")
    if b:
        lines += ["## (a) BOOST's configurations on A100 80GB (4 x 1 x 4096 tokens per iteration, CoLA, bf16)", "",
                  f"GEMM efficiency eta = {b['eta']:.3f} (the scaling model's fit). Both columns are the planner's "
                  "own prediction (same code); `scaling model` is `experiments/tp/scaling_model.py`'s BTP row, "
                  "`README` BOOST's measured BTP time.", "",
                  "| setup | cluster | planner's choice | s | peak GiB | BOOST's config | s | peak GiB | fits | rank | "
                  "scaling model s | README s | choice <= BOOST |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in b["rows"]:
            lines.append(f"| {r['setup']} | {r['cluster']} | {r['planner']} | {r['planner_s']:.3f} | "
                         f"{r['planner_peak_gib']:.1f} | {r['boost_config']} | {r['boost_s']:.3f} | "
                         f"{r['boost_peak_gib']:.1f} | {r['boost_fits']} | "
                         f"{r['boost_rank']} | {r['scaling_model_btp_s'] or float('nan'):.3f} | {r['readme_btp_s']:.2f} | "
                         f"{r['planner_at_least_as_fast']} |")
        if b.get("memory_ignored"):
            lines += ["", "**Memory not applied** (`--ignore-memory`): the planner's peak for these setups comes from "
                          "a CPU compile of the step with materialised attention at seq 4096 (fp32 scores, the CPU's "
                          "buffer assignment) and is far above what a flash-attention GPU step holds (peak column), "
                          "so with the 72 GiB budget nothing fits, not even BOOST's own 1B TP1 configuration, which "
                          "BOOST runs on one A100. The comparison is of time only."]
        else:
            lines += ["", "Memory applied (budget 90 % of 80 GiB = 72 GiB per device). The peak is the compiled "
                          "step's `memory_analysis()` (CPU compile, bf16, abstract arrays) with attention compiled "
                          "`chunked` (blockwise, no [t, t] scores: the memory a flash kernel's step holds, plus "
                          "its 512 x 512 tiles); the time is read from the same step compiled with materialised "
                          "attention (`boostjax/planning/measure.py`). The planner's own compile budget is "
                          f"--max-compiles {b.get('max_compiles', '?')} per setup; BOOST's key is compiled "
                          "beside it."]
        if any(r.get("planner_offloaded") for r in b["rows"]):
            lines += ["", "`+offload`: the candidate runs with a CP-SAT offload plan (`boostjax/planning/offloading.py`); "
                          "its memory saving and added seconds come from the offload cost model "
                          "(`boostjax/offload`: transfers over the profile's host link overlap compute window by "
                          "window, the host-side optimizer's own time is not modelled), not from a compiled "
                          "program. The planner's best choice without an offload plan, by the same code:", "",
                      "| setup | best without offload | s | peak GiB | BOOST's s |", "|---|---|---|---|---|"]
            lines += [f"| {r['setup']} | {r['no_offload']['label']} | {r['no_offload']['step_s']:.3f} | "
                      f"{r['no_offload']['peak_gib']:.1f} | {r['boost_s']:.3f} |" for r in b["rows"] if r.get("no_offload")]
        lines += ["", "Search per setup (valid / compiled / wall s): " + "; ".join(
            f"{r['setup']}: {r['search']['valid']} / {r['search']['compiled']} / {r['wall_s']}" for r in b["rows"])]
    tm = res.get("timing_7b_64")
    if tm:
        s = tm["search"]
        lines += ["", "## 7B on 64 A100s from an empty cache (goal: <= 5 minutes on 2 CPU cores)", "",
                  f"`{tm['command']}`: **{tm['wall_s']:.0f} s** wall (within 300 s: {tm['within_300_s']}), peak RSS "
                  f"{tm['max_rss_bytes'] / 2**30:.1f} GiB, load average {tm['load_before'][0]:.1f} before / "
                  f"{tm['load_after'][0]:.1f} after (1-minute) on {tm['cpu_count']} cores shared with other "
                  f"jobs. Search: {s['enumerated']} enumerated, {s['valid']} valid, {s['pruned_memory_bound']} "
                  f"over memory by bound, {s['compile_keys']} compile keys, {s['compiled']} compiled, "
                  f"{s['skipped_time_bound']} slower by bound, {s['skipped_remat_not_needed']} remat not needed, "
                  f"{s['skipped_compile_budget']} past the compile budget, {s.get('offload_plans_tried', 0)} offload "
                  f"plans solved ({s.get('offload_plans_fitting', 0)} fit), {s['fitting']} fitting. "
                  f"Winner: {tm['winner']}, {tm['winner_step_s']:.3f} s/step, {tm['winner_peak_gib']:.1f} GiB.", "",
                  "| # | configuration | s/step | peak GiB |", "|---|---|---|---|"]
        lines += [f"| {i} | {c['label']} | {c['step_s']:.3f} | {c['peak_bytes_per_device'] / 2**30:.1f} |"
                  for i, c in enumerate(tm["top"], 1)]
    c = res.get("cpu")
    if c:
        cal = c["calibration"]
        lines += ["", f"## (b) {c['model']} on 8 simulated CPU devices ({c['global_batch']} x {c['seq']} tokens per "
                      "step, fp32)", "",
                  "CPU profile (micro-benchmark, `boostjax.planning.cpu`, all "
                  f"{cal['allreduce_devices']} simulated devices at once; seconds per instruction from chains of "
                  "instructions, the short chain's time subtracted): GEMM x w "
                  + ", ".join(f"{n}^3 {t * 1e6:.3g} us" for n, t in zip(cal["gemm_curve_n"], cal["gemm_curve_s"]))
                  + (("; GEMM x^T w " + ", ".join(f"{n}^3 {t * 1e6:.3g} us" for n, t in
                                                  zip(cal["gemm_curve_n"], cal["gemm_t_curve_s"])))
                     if "gemm_t_curve_s" in cal else "")
                  + ("; w / (1 + s) over " if cal.get("stream_link") == "divide" else
                     "; sum(w * s) over " if "gemm_t_curve_s" in cal else "; x*a+b over ")
                  + ", ".join(f"{b >> 10} KiB {t * 1e6:.3g} us" for b, t in
                              zip(cal["stream_curve_bytes"], cal["stream_curve_s"]))
                  + f" per device; all-reduce alpha {cal['allreduce_alpha_s'] * 1e6:.0f} us"
                  + ("".join(f", {g} devices {a * 1e6:.0f} us" if i else f" (by group: {g} devices {a * 1e6:.0f} us"
                             for i, (g, a) in enumerate(cal["allreduce_alpha_by_group"])) + ")"
                     if cal.get("allreduce_alpha_by_group") else "")
                  + f", bus {cal['allreduce_bus_bytes_per_s'] / 1e9:.2f} GB/s. Machine peaks (one device alone): GEMM "
                  f"{cal['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s ({cal['gemm_n']}^3), memory "
                  f"{cal['memory_bytes_per_s'] / 1e9:.2f} GB/s (64 MiB x*a+b).", "",
                  f"**Spearman (predicted vs measured step time) = {c['spearman']:.2f}** over "
                  f"{sum(1 for r in c['rows'] if r['measured_step_s'])} configurations. Planner's first choice: "
                  f"{c['first_choice']}, measured {c['first_choice_measured_s'] or float('nan'):.3f} s; measured "
                  f"fastest {c['measured_fastest_s']:.3f} s; within 10 %: {c['first_choice_within_10pct']}. "
                  + (f"Measured: the fastest of steps 3-{MEASURE_STEPS} of {c['rounds']} interleaved rounds together "
                     "(the shared machine's other work only ever adds time; `summarize` says why this statistic). "
                     f"With the median of the same steps instead: Spearman {c['spearman_median']:.2f}, first choice "
                     f"within 10 %: {c['first_choice_within_10pct_median']}; the best round's median: "
                     f"{c['spearman_best_run']:.2f}. Split halves (even rounds against odd, the noise ceiling): "
                     f"fastest step {c['split_half']['fastest']:.2f}, median {c['split_half']['median']:.2f}; "
                     "single rounds against each other: " + ", ".join(f"{x:.2f}" for x in c["retest_spearman"])
                     + "; load averages " if "split_half" in c else
                     f"Measured: the median of steps 3-{MEASURE_STEPS} of {c['rounds']} interleaved rounds together; "
                     "load averages ")
                  + f"{min(g['load'] for r in c['rows'] for g in r['measured_runs']):.1f}-"
                  f"{max(g['load'] for r in c['rows'] for g in r['measured_runs']):.1f} on 2 cores."
                  + (f" On the first {c['original_rows']} configurations alone (the earlier runs' set): "
                     f"{c['spearman_original']:.2f} (in-process {c['spearman_original_in_process']:.2f})."
                     if "spearman_original" in c else ""), "",
                  *([f"**In-process steps: Spearman = {c['spearman_in_process']:.2f}.** Every configuration's "
                     "compiled training step (the step `boostjax train` jits) in one process, one step of each in "
                     f"turn, {c['step_rounds']} rounds (the order reversed every other round), the median kept: a "
                     "change of the shared machine's load reaches all configurations alike, which separate "
                     "training runs a minute apart do not get (load average "
                     f"{c['step_rounds_load']:.1f} when they started). First choice "
                     f"{c['first_choice_in_process_s']:.3f} s, fastest {c['fastest_in_process_s']:.3f} s, within "
                     f"10 %: {c['first_choice_within_10pct_in_process']}.", ""] if "spearman_in_process" in c else []),
                  *([f"**The planner's winner with `--measure-top {c['measure_top']['top']}`: {c['winner']}.** "
                     f"The planner timed its {len(c['measure_top']['timed'])} best-predicted candidates "
                     f"({', '.join(c['measure_top']['timed'])}) in its own process, {c['measure_top']['rounds']} "
                     "interleaved steps each, and kept the fastest median (" + ", ".join(
                         f"{k} {v:.3f} s" for k, v in c["measure_top"]["timed_step_s"].items()) + "). In the training "
                     f"runs above the winner measured {c['winner_measured_s']:.3f} s against the fastest "
                     f"{c['measured_fastest_s']:.3f} s: within 10 %: {c['winner_within_10pct']} (by the runs' "
                     f"median: {c['winner_within_10pct_median']}).", ""] if "winner" in c else []),
                  "| configuration | predicted s | measured s (runs) | measured / predicted | runs' median s | "
                  "in-process step s | planned peak MiB/dev | compiled peak MiB/dev | process peak RSS MiB / 8 |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(c["rows"], key=lambda r: r["step_s"]):
            ms = r["measured_step_s"]
            rss = r["measured_max_rss_bytes"]
            tag = ", ".join(t for t, on in (("first choice", r["planner_first"]),
                                            ("winner, measured", r.get("planner_winner"))) if on)
            lines.append(f"| {r['label']}{f' ({tag})' if tag else ''} | {r['step_s']:.3f} | "
                         f"{ms if ms is not None else float('nan'):.3f} | "
                         f"{(ms / r['step_s']) if ms else float('nan'):.2f} | "
                         f"{r.get('measured_median_s') or float('nan'):.3f} | "
                         f"{r.get('measured_in_process_s', float('nan')):.3f} | {r['peak_bytes_per_device'] / 2**20:.1f} | "
                         f"{r['compiled_peak_bytes_per_device'] / 2**20:.1f} | "
                         f"{(rss / 8 / 2**20) if rss else float('nan'):.0f} |")
        ratio = [r["peak_bytes_per_device"] / r["compiled_peak_bytes_per_device"] for r in c["rows"]]
        rss = [r["measured_max_rss_bytes"] / 8 / 2**20 for r in c["rows"] if r["measured_max_rss_bytes"]]
        lines += ["", f"(c) Memory, three ways. Planned / compiled peak per device: {min(ratio):.2f}-{max(ratio):.2f} "
                      f"(median {statistics.median(ratio):.2f}). The planned peak is built from the 1- and 2-layer "
                      "compiled step of one micro-batch on a data=1 mesh, with stages the schedule's activation "
                      "slots times one layer's traced backward residuals (module docstring of "
                      "`boostjax.planning.predict`); the compiled column is `memory_analysis()` of the whole "
                      "configuration's step (every axis, accumulation, pipeline schedule, ZeRO), what "
                      "`boostjax train` compiles. The process's peak RSS over 8 "
                      + (f"({min(rss):.0f}-{max(rss):.0f} MiB) " if rss else "")
                      + "is an upper bound that the tiny model does not approach: it holds the Python "
                      "interpreter, JAX, XLA's compiler and its compiled code, the data pipeline and host "
                      "copies, shared by the 8 simulated devices, next to a few MiB of device buffers."]
        if res.get("memory_command"):
            lines += ["", f"Planned and compiled peaks recounted on these rows by `{res['memory_command']}` "
                          f"({res.get('memory_wall_s', '?')} s, nothing trained; the times above are from the cpu "
                          "part's run)."]
    return "\n".join(lines) + "\n"


def chart(res: dict):
    fig, axes = common.subplots(2, (11, 4.2))
    b, c = res.get("boost"), res.get("cpu")
    if b:
        x = np.arange(len(b["rows"]))
        axes[0].bar(x - 0.2, [r["planner_s"] for r in b["rows"]], 0.4, label="planner's choice (predicted)")
        axes[0].bar(x + 0.2, [r["boost_s"] for r in b["rows"]], 0.4, label="BOOST's config (predicted)")
        axes[0].scatter(x + 0.2, [r["readme_btp_s"] for r in b["rows"]], color="k", marker="_", s=300,
                        label="BOOST README (measured)", zorder=3)
        axes[0].set_xticks(x, [r["setup"] for r in b["rows"]])
        axes[0].set_ylabel("seconds per iteration")
        axes[0].set_title("A100: planner vs BOOST's configuration")
        axes[0].legend(fontsize=8)
    if c:
        pts = [(r["step_s"], r["measured_step_s"], r["planner_first"]) for r in c["rows"] if r["measured_step_s"]]
        axes[1].scatter([p for p, _, _ in pts], [m for _, m, _ in pts], c=["C3" if f else "C0" for _, _, f in pts],
                        label="training runs (fastest step)")
        inproc = [(r["step_s"], r["measured_in_process_s"]) for r in c["rows"] if "measured_in_process_s" in r]
        if inproc:
            axes[1].scatter([p for p, _ in inproc], [m for _, m in inproc], marker="x", color="C2",
                            label=f"in-process steps (Spearman {c['spearman_in_process']:.2f})")
            pts += [(p, m, False) for p, m in inproc]
        axes[1].legend(fontsize=8)
        lo, hi = min(min(p, m) for p, m, _ in pts), max(max(p, m) for p, m, _ in pts)
        axes[1].plot([lo, hi], [lo, hi], "k:", lw=1)
        axes[1].set_xscale("log")
        axes[1].set_yscale("log")
        axes[1].set_xlabel("predicted s/step")
        axes[1].set_ylabel("measured s/step")
        axes[1].set_title(f"8 CPU devices, {c['model']}: Spearman {c['spearman']:.2f} (red: first choice)")
    fig.tight_layout()
    return fig


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("boost", "cpu", "memory", "timing", "all"), default="all",
                    help="which validation to run (timing: 7B on 8x8 A100s, wall time from an empty cache; "
                         "memory: (c) again on the stored cpu rows, planned and compiled peaks, nothing trained)")
    ap.add_argument("--max-compiles", type=int, default=1,
                    help="the planner's own compile budget per BOOST setup, beside BOOST's configuration (boost part)")
    ap.add_argument("--setups", default="1b,3b,7b,13b", help="BOOST setups to plan, comma-separated (boost part)")
    ap.add_argument("--ignore-memory", action="store_true",
                    help="boost part: rank by time only (no device-memory budget)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved training runs per configuration (cpu part)")
    ap.add_argument("--step-rounds", type=int, default=40,
                    help="cpu part: in-process rounds of one compiled step per configuration in turn")
    ap.add_argument("--cache", default="/tmp/boostjax-plan-cache", help="compiled-measurement cache folder")
    common.add_out(ap, "plan_auto")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    path = pathlib.Path(args.out) / "plan_auto.json"
    if common.rerender(args, "plan_auto", markdown, chart) is not None:
        return 0
    from boostjax.runtime.devices import simulate_devices

    simulate_devices(8)
    res = json.loads(path.read_text()) if path.exists() else {}
    t0 = time.perf_counter()
    if args.part in ("boost", "all"):
        res["boost"] = boost_part(args.cache, args.max_compiles, tuple(args.setups.split(",")), args.ignore_memory)
    if args.part in ("timing", "all"):
        res["timing_7b_64"] = timing_part()
    if args.part == "memory":
        if "cpu" not in res:
            print(f"plan_auto: {path} has no cpu part to recount; fix: run --part cpu first", file=sys.stderr)
            return 2
        res["cpu"] = memory_part(args.cache, res["cpu"])
    if args.part in ("cpu", "all"):
        res["cpu"] = cpu_part(args.cache, args.rounds, args.step_rounds)
        res["spearman"] = res["cpu"]["spearman"]
        res["cpu_spearman_in_process"] = res["cpu"]["spearman_in_process"]
    res[f"{args.part}_command"] = common.command_line("plan_auto", argv)
    res[f"{args.part}_wall_s"] = round(time.perf_counter() - t0)
    common.write(args.out, "plan_auto", data=res, md=lambda: markdown(res), figure=lambda: chart(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
