"""One GPU suite: throughput, memory, offload and collectives of the real training step on one GPU.

    python -m experiments.gpu.gpu_suite                  # on a CUDA GPU, <= 8 minutes (--budget-s 480)
    python -m experiments.gpu.gpu_suite --smoke          # every section on CPU at tiny shapes (CI)
    python -m experiments.gpu.gpu_suite --budget-s 900 --attention auto --policies plan,no-offload

Sections (each measuring run in its own process, so each peak is its own; a run that fails or runs
past its time limit records why and the suite goes on; when the budget runs low the remaining runs
are skipped with the reason):

(a) throughput: dense LLaMA vs CoLA at 1B (vocabulary 32000, batch 8 x 1024, bf16 compute, AdamW,
    `ModelConfig.attention="cudnn"`): tokens/s and MFU, through `experiments/gpu/gpu_step.py`'s worker.
(b) memory: per model, `device.memory_stats()["peak_bytes_in_use"]` of (a)'s process beside the
    prediction of the very executable it ran (`compiled.memory_analysis()`: argument + output - alias
    + temp) and, where boostjax has `memory_report`, the CPU-compiled (abstract) prediction of the
    same step (its `peak_bytes_per_device` and weight / optimizer / activation parts). That CPU compile
    starts first and runs on the host CPU beside the GPU runs (it touches no GPU).
(c) offload: the CP-SAT offload plan vs no-offload / full-remat / MegaTrain-style streaming at a
    device memory cap (1B CoLA, 8-bit Adam): tokens/s and peak, through `experiments/offload/offload_gpu.py`.
(d) collectives: the BTP step of the 1B CoLA compiled for this GPU on a data=1,model=1 mesh; the
    all-reduces one layer adds (2-layer minus 1-layer program): count, bytes, how many act on one
    device only. A 1-GPU mesh cannot show TP traffic (see the `cannot_show` key).

JSON: `device` (the probe: kind, bytes_limit), `attention`, `settings` (shapes, steps, cap, per-run time
limits), `budget_s`, `elapsed_s`, and `sections.{throughput,memory,collectives,offload}`, each with
`status` (ok / partial / failed / skipped), `smoke`, and its runs (`status` ok / failed / timeout /
skipped / oom / infeasible, with `error` or `reason`).

Writes experiments/results/gpu_suite.{json,md} (`--out` elsewhere). Without a GPU it exits with status
2 and one line, before importing JAX or writing anything. `--smoke` runs every section on CPU at tiny
shapes (numbers mean nothing) into a fresh temporary folder unless `--out` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from boostjax.runtime.profiles import GiB as GIB
from experiments import common
from experiments.gpu import gpu_step as gs
from experiments.offload import offload_gpu as og

SECTIONS = ("throughput", "memory", "collectives", "offload")
MIN_START_S = 15.0  # a run is not started with less time than this left in the budget
CPU_FAST = " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
CANNOT_SHOW = ("On one device every collective's group holds one device: nothing crosses a link, so this "
               "cannot show TP bytes on the wire, NCCL time, overlap of communication with compute, or what "
               "XLA's all-reduce combiner does with groups of several devices (it may drop one-device "
               "all-reduces altogether). What it shows: which all-reduces the GPU-compiled BTP step still "
               "holds per layer, their shapes and element types (BTP's all-reduced latents are [b, s, r] "
               "whatever the TP degree, so their bytes are the per-device TP payload), and whether the "
               "norm statistics ride in the same (variadic) all-reduce. Multi-device traffic: `boostjax comm`.")


@dataclass(frozen=True)
class Shapes:
    """What the suite runs: the GPU settings, or the tiny CPU smoke settings."""

    preset: str
    vocab: int  # 0 = the preset's
    layers: int  # 0 = the preset's
    batch: int
    seq: int
    warmup: int
    steps: int
    offload_warmup: int
    offload_steps: int
    memory_cap_gb: float
    plan_time_limit_s: float
    hardware: str  # offload planner's hardware profile, or "measure"
    limits_s: tuple[tuple[str, float], ...]  # per run of each section

    def limit(self, section: str) -> float:
        return dict(self.limits_s)[section]


# GPU seconds are estimates (no GPU was reachable when this was written): the budget skips what does not fit
GPU = Shapes("1b", 32000, 0, 8, 1024, 2, 5, 1, 3, 20.0, 15.0, "measure",
             (("throughput", 150.0), ("memory", 300.0), ("collectives", 120.0), ("offload", 110.0)))
SMOKE = Shapes("tiny", 0, 2, 2, 16, 1, 1, 1, 1, 1.0, 5.0, "3090",
               (("throughput", 120.0), ("memory", 120.0), ("collectives", 120.0), ("offload", 120.0)))


# ----------------------------------------------------------------------------- fail fast


def nvidia_present() -> bool:
    """An NVIDIA device node (or WSL's /dev/dxg) or nvidia-smi exists."""
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/dxg") or shutil.which("nvidia-smi"))


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the suite, from cheap checks only (no JAX import); None: maybe it can."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return (f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']} hides every GPU from JAX; fix: unset JAX_PLATFORMS "
                "(or set it to cuda) on a CUDA GPU machine, or pass --smoke for a CPU run at tiny shapes")
    if not nvidia_present():
        return ("no NVIDIA GPU on this machine (no /dev/nvidia* device, no nvidia-smi); fix: run it on a CUDA "
                "GPU machine with jax[cuda12], or pass --smoke for a CPU run of every section at tiny shapes")
    return None


def check_out(path: str) -> str | None:
    """Why `--out` cannot take the results (None: it can); nothing is created here."""
    p = os.path.abspath(path)
    probe = p
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"--out {path}: {probe} is a file, not a folder; fix: pass a folder for gpu_suite.json and .md"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"--out {path}: the folder {probe} is not writable; fix: pass another --out"
    return None


# ----------------------------------------------------------------------------- workers (child processes)


def _model(kind: str, sh: Shapes, attention: str):
    from boostjax.config import preset

    over = {"kind": kind, "max_seq_len": sh.seq}
    if sh.vocab:
        over["vocab_size"] = sh.vocab
    if sh.layers:
        over["n_layers"] = sh.layers
    if attention:
        over["attention"] = attention
    return preset(sh.preset, **over)


def _numbers(d: dict) -> dict:
    """The JSON-safe scalar entries of a report."""
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool)) or v is None}


def predict_worker(sh: Shapes, attention: str) -> dict:
    """(b) The CPU-compiled (abstract) per-device peak of each model's step, via `memory_report`."""
    try:
        from boostjax.analysis.memory import memory_report
    except ImportError:
        return {"status": "unavailable", "reason": "this boostjax has no boostjax.analysis.memory.memory_report; the "
                                                   "CPU-compiled prediction is left out"}
    # cuDNN attention exists only on CUDA; its CPU stand-in without a [t, t] buffer is the chunked one
    cpu_attention = "chunked" if attention == "cudnn" else attention
    rows = {}
    for kind in ("llama", "cola"):
        model = _model(kind, sh, cpu_attention)
        if sh.preset == SMOKE.preset and kind == "llama":  # smoke: one model proves the path (CI time)
            rows[kind] = {"status": "skipped", "reason": "smoke run: the prediction is compiled for CoLA only"}
            continue
        errors = []
        # the measured program is the plain one-device step; a one-device TP mesh is the fallback
        for mesh, strategy in (("", "none"), ("data=1,model=1", "fullrank-tp" if kind == "llama" else "btp")):
            try:
                rep = memory_report(model, mesh, sh.batch, sh.seq, strategy, remat="none", dtype="bfloat16")
            except Exception as e:
                first = str(e).splitlines()[0][:200] if str(e) else ""
                errors.append(f"{strategy}@{mesh or 'one device'}: {type(e).__name__}: {first}")
                continue
            rows[kind] = {"status": "ok", "mesh": mesh, "strategy": strategy, "attention": cpu_attention or None,
                          **_numbers(rep), **({"refused": errors} if errors else {})}
            break
        else:
            rows[kind] = {"status": "failed", "error": " | ".join(errors)}
    return {"status": "ok" if all(r["status"] in ("ok", "skipped") for r in rows.values()) else "failed",
            "models": rows}


def _allreduce_summary(cs: list, batch: int, seq: int) -> dict:
    """All-reduce instructions, their operands and bytes (logical element types); an operand whose
    leading dims are [batch, seq] is an activation (a TP latent or norm statistic), any other a
    parameter's gradient (the data-parallel mean)."""
    ar = [c for c in cs if c.kind == "all-reduce"]
    ops = [(a, dt, c.trivial) for c in ar for a, dt in zip(c.results, c.logical_dtypes)]
    act = [(a, dt, t) for a, dt, t in ops if tuple(a.shape[:2]) == (batch, seq)]
    others: dict[str, int] = {}
    for c in cs:
        if c.kind != "all-reduce":
            others[c.kind] = others.get(c.kind, 0) + 1
    return {"count": len(ar), "trivial_count": sum(c.trivial for c in ar),
            "variadic_count": sum(len(c.results) > 1 for c in ar), "operands": len(ops),
            "bytes": sum(a.bytes(dt) for a, dt, _ in ops), "trivial_bytes": sum(a.bytes(dt) for a, dt, t in ops if t),
            "activation_operands": len(act), "activation_bytes": sum(a.bytes(dt) for a, dt, _ in act),
            "other_collectives": others}


def _layer_allreduces(two: list, one: list) -> list[dict]:
    """All-reduce operands of the 2-layer program without a same-shaped match in the 1-layer one."""
    key = lambda a, dt, t: (str(a), dt, t)  # noqa: E731
    ops = lambda cs: [(a, dt, c.trivial) for c in cs if c.kind == "all-reduce"  # noqa: E731
                      for a, dt in zip(c.results, c.logical_dtypes)]
    left: dict = {}
    for o in ops(one):
        left[key(*o)] = left.get(key(*o), 0) + 1
    out = []
    for a, dt, t in ops(two):
        if left.get(key(a, dt, t), 0):
            left[key(a, dt, t)] -= 1
        else:
            out.append({"shape": str(a), "dtype": dt, "bytes": a.bytes(dt), "trivial": t})
    return out


def collectives_worker(sh: Shapes, attention: str) -> dict:
    """(d) The all-reduces one BTP layer adds to the step compiled for this process's device."""
    import jax

    from boostjax.analysis import comm
    from boostjax.analysis import hlo

    model = _model("cola", sh, attention)
    mesh = "data=1,model=1"
    dev = jax.devices()[0]
    progs, t0 = {}, time.perf_counter()
    for n in (2, 1):
        c = comm.compiled_step(dataclasses.replace(model, n_layers=n), mesh, sh.batch, sh.seq, "btp", "none",
                               "bfloat16")
        progs[n] = hlo.collectives(c.step_text)
    two, one = (_allreduce_summary(progs[n], sh.batch, sh.seq) for n in (2, 1))
    per_layer = {k: v - one[k] for k, v in two.items() if k != "other_collectives"}
    expected = comm.expected_per_layer(model, "btp", sh.batch * sh.seq, "bfloat16")
    return {"status": "ok", "platform": dev.platform, "device": dev.device_kind, "mesh": mesh, "strategy": "btp",
            "attention": getattr(model, "attention", None), "compile_s": time.perf_counter() - t0,
            "allreduce_per_layer": per_layer, "allreduce_operands_per_layer": _layer_allreduces(progs[2], progs[1]),
            "two_layer": two, "one_layer": one, "expected_btp_step_bytes_per_layer": expected["step_bytes"],
            "expected_btp_forward_bytes_per_layer": expected["forward_bytes"], "cannot_show": CANNOT_SHOW}


def throughput_args(sh: Shapes, smoke: bool, attention: str, peak_tflops: float) -> list[str]:
    """`experiments/gpu/gpu_step.py` flags of (a)'s runs."""
    a = ["--preset", sh.preset, "--vocab", str(sh.vocab), "--layers", str(sh.layers), "--batch", str(sh.batch),
         "--seq", str(sh.seq), "--warmup", str(sh.warmup), "--steps", str(sh.steps), "--remat", "none"]
    a += ["--attention", attention] if attention else []
    a += ["--peak-tflops", str(peak_tflops)] if peak_tflops else []
    return a + (["--allow-cpu"] if smoke else [])


def offload_args(sh: Shapes, smoke: bool, attention: str) -> list[str]:
    """`experiments/offload/offload_gpu.py` flags of (c)'s runs."""
    a = ["--preset", sh.preset, "--model", "cola", "--vocab", str(sh.vocab), "--layers", str(sh.layers),
         "--batch", str(sh.batch), "--seq", str(sh.seq), "--memory-cap", str(sh.memory_cap_gb), "--hardware",
         sh.hardware, "--optimizer", "adam8bit", "--warmup", str(sh.offload_warmup), "--steps",
         str(sh.offload_steps), "--time-limit", str(sh.plan_time_limit_s)]
    a += ["--attention", attention] if attention else []
    return a + (["--allow-cpu"] if smoke else [])


def runs_worker(section: str, runs: list[str], sh: Shapes, smoke: bool, attention: str, peak_tflops: float) -> dict:
    """(a) or (c): the given runs one after the other in this process (the parent gives each run its own
    process on a GPU, so each peak is its own; a smoke run on CPU, which has no peak, shares one)."""
    out = []
    for run in runs:
        tag = {"kind": run} if section == "throughput" else {"policy": run}
        try:
            if section == "throughput":
                rec = gs.measure(run, gs.parser().parse_args(throughput_args(sh, smoke, attention, peak_tflops)))
            else:
                rec = og.worker(og.parser().parse_args([*offload_args(sh, smoke, attention), "--policy", run]))
            out.append({**tag, "status": "ok", **rec})
        except Exception as e:
            out.append({**tag, "status": "failed", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
                        if str(e) else type(e).__name__})
    return {"status": "ok", "runs": out}


# ----------------------------------------------------------------------------- the parent


class Clock:
    """The suite's time budget: each run gets min(its own limit, what is left)."""

    def __init__(self, budget_s: float):
        self.t0, self.budget_s = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def _skip(self, **tag) -> dict | None:
        left = self.left()
        if left >= MIN_START_S:
            return None
        return {**tag, "status": "skipped", "reason": f"time budget spent ({left:.0f} s of {self.budget_s:.0f} s left); "
                                                      "fix: raise --budget-s"}

    def run(self, cmd: list[str], env: dict[str, str], limit_s: float, **tag) -> dict:
        """Run a worker to its end, for at most min(limit_s, what is left of the budget)."""
        skipped = self._skip(**tag)
        if skipped:
            return skipped
        t0 = time.perf_counter()
        rec = gs.run_worker(cmd, env, timeout=min(limit_s, self.left()), **tag)
        return {**rec, "wall_s": round(time.perf_counter() - t0, 2)}

    def start(self, cmd: list[str], env: dict[str, str], limit_s: float) -> "Background | dict":
        """Start a worker in the background (`Background.result` waits for it), or say why not."""
        return self._skip() or Background(cmd, env, time.perf_counter() + min(limit_s, self.left()), self)


class Background:
    """A worker process running beside the others (the CPU-compiled memory prediction), its output in
    temporary files (a pipe could fill up and stall it)."""

    def __init__(self, cmd: list[str], env: dict[str, str], deadline: float, clock: Clock):
        self.t0, self.deadline, self.clock = time.perf_counter(), deadline, clock
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=self.err, text=True, env=common.with_root(env))

    def result(self) -> dict:
        wait = max(0.0, min(self.deadline, self.clock.t0 + self.clock.budget_s) - time.perf_counter())
        try:
            rc = self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rec = {"status": "timeout", "error": "killed at its time limit (or the end of the budget)"}
        else:
            self.out.seek(0)
            self.err.seek(0)
            rec = gs.worker_result(rc, self.out.read(), self.err.read())
        self.out.close()
        self.err.close()
        return {**rec, "wall_s": round(time.perf_counter() - self.t0, 2)}


def _status(recs: list[dict]) -> str:
    st = {r.get("status") for r in recs}
    if st <= {"ok", "oom", "infeasible"}:  # a policy that does not fit the cap is a measured result
        return "ok"
    if st & {"ok", "oom", "infeasible"}:
        return "partial"
    return "skipped" if st == {"skipped"} else "failed"


def _env(smoke: bool, **extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    if smoke:  # CPU only, cheap XLA passes: a smoke run proves code paths, not speed
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + CPU_FAST
    return env


def _suite_cmd(section: str, argv: list[str]) -> list[str]:
    return [*common.python_m("gpu_suite"), *argv, "--section", section]


def _grouped(clock: Clock, section: str, runs: tuple[str, ...], args, sh: Shapes, attention: str,
             env: dict[str, str], key: str) -> list[dict]:
    """Each run in its own process on a GPU; all in one process in a smoke run (CPU has no peak)."""
    groups = [list(runs)] if args.smoke else [[r] for r in runs]
    out: list[dict] = []
    for g in groups:
        extra = ["--runs", ",".join(g)] + (["--peak-tflops", str(args.peak_tflops)] if args.peak_tflops else [])
        rec = clock.run(_suite_cmd(section, _worker_argv(args, attention) + extra), env, sh.limit(section) * len(g))
        got = {r[key]: r for r in rec.get("runs", [])}
        for r in g:  # a process that died, timed out or was skipped: each of its runs says so
            out.append(got.get(r) or {key: r, **{k: v for k, v in rec.items() if k in ("status", "error", "reason")}})
            out[-1].setdefault("wall_s", rec.get("wall_s"))
    return out


def throughput(clock: Clock, sh: Shapes, args, attention: str) -> dict:
    runs = _grouped(clock, "throughput", gs.KINDS, args, sh, attention, _env(args.smoke), "kind")
    ok = {r["kind"]: r for r in runs if r.get("status") == "ok"}
    speedup = ok["cola"]["tokens_per_s"] / ok["llama"]["tokens_per_s"] if len(ok) == 2 else None
    return {"status": _status(runs), "gpu_step_args": throughput_args(sh, args.smoke, attention, args.peak_tflops),
            "runs": runs, "speedup_cola_over_dense": speedup, "paper_speedup_1b_a100": gs.PAPER_SPEEDUP}


def start_prediction(clock: Clock, sh: Shapes, args, attention: str) -> "Background | dict":
    """(b)'s CPU-compiled prediction, started first: it runs on the host CPU beside the GPU runs."""
    env = _env(args.smoke, JAX_PLATFORMS="cpu")  # the prediction is the CPU compile, on any machine
    return clock.start(_suite_cmd("memory", _worker_argv(args, attention)), env, sh.limit("memory"))


def memory(pending: "Background | dict", tput: dict) -> dict:
    pred = pending.result() if isinstance(pending, Background) else pending
    rows = []
    for r in tput["runs"]:
        k = r["kind"]
        cm = r.get("compiled_memory") or {}
        p = (pred.get("models") or {}).get(k, {})
        row = {"kind": k, "throughput_status": r.get("status"), "measured_peak_bytes": r.get("peak_bytes_in_use"),
               "compiled_total_bytes": cm.get("total_bytes"), "compiled": cm or None,
               "predicted_cpu_peak_bytes": p.get("peak_bytes_per_device"), "predicted_cpu": p or None}
        m, c, q = row["measured_peak_bytes"], row["compiled_total_bytes"], row["predicted_cpu_peak_bytes"]
        row["measured_over_compiled"] = m / c if m and c else None
        row["measured_over_predicted_cpu"] = m / q if m and q else None
        rows.append(row)
    status = "ok" if pred.get("status") in ("ok", "unavailable") and tput["status"] == "ok" else (
        "skipped" if pred.get("status") == "skipped" and tput["status"] == "skipped" else "partial")
    return {"status": status, "prediction": pred, "rows": rows}


def collectives(clock: Clock, sh: Shapes, args, attention: str) -> dict:
    env = _env(args.smoke, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    rec = clock.run(_suite_cmd("collectives", _worker_argv(args, attention)), env, sh.limit("collectives"))
    return {**rec, "cannot_show": CANNOT_SHOW}


def offload(clock: Clock, sh: Shapes, args, attention: str, probe: dict) -> dict:
    fraction = None if args.smoke else og.cap_fraction(probe, sh.memory_cap_gb)[1]
    env = og.policy_env(fraction)
    if args.smoke:
        env = _env(True, **{k: v for k, v in env.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")})
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    runs = _grouped(clock, "offload", policies, args, sh, attention, env, "policy")
    return {"status": _status(runs), "offload_gpu_args": offload_args(sh, args.smoke, attention),
            "memory_cap_gb": sh.memory_cap_gb, "mem_fraction": fraction, "runs": runs}


def _worker_argv(args, attention: str) -> list[str]:
    return (["--smoke"] if args.smoke else []) + ["--attention-used", attention or "-"]


# ----------------------------------------------------------------------------- report


def _gib(x) -> str:
    return f"{x / GIB:.2f}" if isinstance(x, (int, float)) and x else "n/a"


def _ratio(x) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) else "n/a"


def _why(sec: dict) -> str:
    return sec.get("reason") or sec.get("error") or ""


def markdown(res: dict) -> str:
    sh, secs = res["settings"], res["sections"]
    out = [f"# One-GPU suite on {res['device'].get('kind')}", "",
           f"Command: `{res['command']}`; {res['elapsed_s']:.0f} s of a {res['budget_s']:.0f} s budget; "
           f"{res['started_utc']}. Attention: {res['attention']}.", ""]
    if res["smoke"]:
        out += ["SMOKE RUN ON CPU at tiny shapes: these numbers say nothing about a GPU.", ""]
    t = secs["throughput"]
    out += [f"## (a) Dense vs CoLA: tokens/s and MFU ({t['status']})", "",
            f"Preset {sh['preset']}, vocabulary {sh['vocab'] or 'preset'}, batch {sh['batch']} x {sh['seq']}, bf16 "
            f"compute, fp32 master weights, AdamW, no remat; median of {sh['steps']} steps after {sh['warmup']}.", "",
            "| model | device | attention | params | step s | tokens/s | model TFLOP/s | MFU | peak memory GiB "
            "| compiled GiB | compile s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in t["runs"]:
        out.append(gs.run_row(r) if r.get("status") == "ok"
                   else f"| {gs.NAMES[r['kind']]} | {r.get('status')}: {_why(r)} | | | | | | | | | |")
    if t.get("speedup_cola_over_dense"):
        out += ["", f"CoLA / dense tokens/s: {t['speedup_cola_over_dense']:.2f}x (BOOST, 1B on one A100: "
                    f"{gs.PAPER_SPEEDUP:.2f}x)."]
    m = secs["memory"]
    pred = m["prediction"]
    out += ["", f"## (b) Peak memory: measured vs predicted ({m['status']})", "",
            "Measured: `memory_stats()['peak_bytes_in_use']` of (a)'s process (initialisation included). Compiled: "
            "`memory_analysis()` of the executable (a) ran (argument + output - alias + temp). CPU prediction: "
            "`memory_report` compiled abstractly on the host CPU while the GPU runs ran "
            f"({pred.get('status')}{': ' + _why(pred) if _why(pred) else ''}).", "",
            "| model | measured GiB | compiled GiB | of which temp GiB | CPU-predicted GiB (program) | weights / "
            "optimizer / activations GiB | measured / compiled | measured / CPU-predicted |",
            "|---|---|---|---|---|---|---|---|"]
    for r in m["rows"]:
        p = r.get("predicted_cpu") or {}
        parts = " / ".join(_gib(p.get(k)) for k in ("weight_bytes", "optimizer_bytes", "activation_bytes"))
        prog = f" ({p['strategy']}, {p['mesh'] or 'one device'})" if p.get("status") == "ok" else ""
        out.append(f"| {gs.NAMES[r['kind']]} | {_gib(r['measured_peak_bytes'])} | {_gib(r['compiled_total_bytes'])} | "
                   f"{_gib((r.get('compiled') or {}).get('temp_bytes'))} | {_gib(r['predicted_cpu_peak_bytes'])}{prog} | "
                   f"{parts} | {_ratio(r['measured_over_compiled'])} | {_ratio(r['measured_over_predicted_cpu'])} |")
    o = secs["offload"]
    out += ["", f"## (c) Offload plan vs baselines at a {o['memory_cap_gb']} GB cap ({o['status']})", "",
            f"{sh['preset']} CoLA, 8-bit Adam, the same batch; "
            + ("smoke: the policies share one CPU process, no allocator cap." if res["smoke"] else
               "each policy in its own process with the allocator capped "
               f"(XLA_PYTHON_CLIENT_MEM_FRACTION={o['mem_fraction']:.4f}); the planner's budget is 0.85 x the cap."),
            "", *og.table(o["runs"])]
    why = [f"{r['policy']}: {_why(r)}" for r in o["runs"] if _why(r)]
    out += (["", "Why: " + "; ".join(why)] if why else [])
    c = secs["collectives"]
    out += ["", f"## (d) All-reduces per layer of the BTP step compiled for this device ({c['status']})", ""]
    if c.get("status") == "ok":
        pl = c["allreduce_per_layer"]
        out += [f"Mesh {c['mesh']}, {c['device']} ({c['platform']}), compiled in {c['compile_s']:.1f} s; one layer = "
                "the 2-layer program minus the 1-layer program. Counts are static HLO instructions and XLA combines "
                "all-reduces into variadic ones, so read operands and bytes. Activation operands ([batch, seq, ...]) "
                "are BTP's latents and norm statistics; the rest are parameter gradients (the data-axis mean).", "",
                "| per layer: all-reduces | one-device | variadic | operands | bytes | one-device bytes "
                "| activation operands | activation bytes | BTP expected step bytes |",
                "|---|---|---|---|---|---|---|---|---|",
                f"| {pl['count']} | {pl['trivial_count']} | {pl['variadic_count']} | {pl['operands']} | {pl['bytes']} "
                f"| {pl['trivial_bytes']} | {pl['activation_operands']} | {pl['activation_bytes']} "
                f"| {c['expected_btp_step_bytes_per_layer']} |"]
    else:
        out.append(f"{c.get('status')}: {_why(c)}")
    out += ["", f"What it cannot show: {CANNOT_SHOW}"]
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="every section on CPU at tiny shapes (numbers mean nothing)")
    ap.add_argument("--out", default=None, help="results folder (default: experiments/results; with --smoke a new "
                                                "temporary folder)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole suite (default: 480)")
    ap.add_argument("--attention", default="cudnn", choices=("auto", "xla", "cudnn", "chunked"),
                    help="ModelConfig.attention of the GPU runs (default: cudnn; --smoke uses the config default)")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="device dense bf16 peak in TFLOP/s (default: from the hardware profile of the device name)")
    ap.add_argument("--policies", default=",".join(og.POLICIES),
                    help=f"offload policies of (c), a subset of {','.join(og.POLICIES)} (default: all)")
    ap.add_argument("--section", default=None, choices=SECTIONS, help=argparse.SUPPRESS)
    ap.add_argument("--runs", default="", help=argparse.SUPPRESS)
    ap.add_argument("--attention-used", default="-", help=argparse.SUPPRESS)
    return ap


def out_folder(args: argparse.Namespace) -> str | None:
    """`--out`, else experiments/results on a GPU; a smoke run never writes there unless asked (None: a
    new temporary folder, made when the results are written)."""
    if args.out is not None:
        return args.out
    return None if args.smoke else str(common.RESULTS)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    sh = SMOKE if args.smoke else GPU
    if args.section:  # worker mode
        attention = "" if args.attention_used == "-" else args.attention_used
        if args.section in ("throughput", "offload"):
            rec = runs_worker(args.section, args.runs.split(","), sh, args.smoke, attention, args.peak_tflops)
        else:
            rec = predict_worker(sh, attention) if args.section == "memory" else collectives_worker(sh, attention)
        print("RESULT " + json.dumps(rec), flush=True)
        return 0
    if args.budget_s <= 0 or args.peak_tflops < 0:
        print("gpu_suite: --budget-s must be > 0 and --peak-tflops >= 0; fix: pass e.g. --budget-s 480",
              file=sys.stderr)
        return 2
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or any(p not in og.POLICIES for p in policies):
        print(f"gpu_suite: --policies {args.policies!r}; fix: pass a subset of {','.join(og.POLICIES)}",
              file=sys.stderr)
        return 2
    out = out_folder(args)
    problem = check_out(out) if out else None
    if problem:
        print(f"gpu_suite: {problem}", file=sys.stderr)
        return 2
    clock = Clock(args.budget_s)
    if args.smoke:
        probe = {"gpu": False, "kind": "cpu (smoke run)", "bytes_limit": 0}
    else:
        why = no_gpu_reason()
        probe = og.probe() if why is None else {}
        if why is None and not probe.get("gpu"):
            why = (f"no CUDA GPU visible to JAX ({probe.get('why', 'unknown')}); fix: install jax[cuda12] and run "
                   "where jax.devices('gpu') works, or pass --smoke for a CPU run at tiny shapes")
        if why:
            print(f"gpu_suite: {why}", file=sys.stderr)
            return 2
        if not args.peak_tflops and gs.peak_flops_for(probe["kind"]) is None:
            print(f"gpu_suite: no bf16 peak known for {probe['kind']!r} (MFU needs one); fix: pass --peak-tflops",
                  file=sys.stderr)
            return 2
    # the GPU runs use cuDNN attention where boostjax has the field; smoke runs the config's default
    has_field = gs.attention_field()
    attention = "" if args.smoke or not has_field else args.attention
    attention_note = (attention or "config default") if has_field else (
        "reference (this boostjax has no ModelConfig.attention; the materialising XLA attention ran)")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    pending = start_prediction(clock, sh, args, attention)
    try:
        tput = throughput(clock, sh, args, attention)
        secs = {"throughput": tput, "collectives": collectives(clock, sh, args, attention),
                "offload": offload(clock, sh, args, attention, probe)}
        secs["memory"] = memory(pending, tput)
    finally:  # interrupted: do not leave the background prediction running
        if isinstance(pending, Background) and pending.proc.poll() is None:
            pending.proc.kill()
    for s in secs.values():
        s["smoke"] = args.smoke
    res = {"suite": "gpu_suite", "smoke": args.smoke, "command": common.command_line("gpu_suite", argv),
           "started_utc": started, "budget_s": args.budget_s, "elapsed_s": clock.budget_s - clock.left(),
           "device": probe, "attention": attention_note, "settings": dataclasses.asdict(sh),
           "sections": {k: secs[k] for k in SECTIONS}}
    common.write(out or tempfile.mkdtemp(prefix="gpu_suite_smoke_"), "gpu_suite", data=res,
                     md=lambda: markdown(res))
    return 0 if all(s["status"] == "ok" for s in secs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
