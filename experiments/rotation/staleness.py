"""Staleness experiment: iterations to a target loss versus pipeline depth S.

A small deep dense LLaMA (32 layers, so S can reach 32 stages of one layer each) is trained on the
default corpus (stdlib sources, byte tokens) with every optimizer at S in {1, 2, 4, 8, 16, 32}, the
asynchronous pipeline emulated by `boostjax.optim.delay` (stage s computes its gradient on weights
S-1-s updates old, weight stashing). Every run sees the same initial weights and the same batches.

Measure, as the paper's curves are drawn: the held-out loss on a fixed validation set (`n_eval`
batches) every `eval_every` steps and at the last step, at the current weights; the per-step training
loss (at the stale weights the gradient is computed on) stays in the JSON. Targets are per optimizer
(basis rotation, https://arxiv.org/abs/2602.03515, compares each method with its own synchronous run):
  headline: L* = the final held-out loss of the optimizer's own S_max run; slowdown(S) = first
            evaluation at which its S-run reaches L* / the same for its S = 1 run; beside it the budget
            reading, the S_max run counted as needing its whole budget (budget / S = 1's first step);
  also:     the optimizer's own S = 1 held-out loss at 50 % and 65 % of the budget (`extra_fracs`).
A run that never gets there (or diverges) is reported as "> steps" (slowdown: a lower bound). Results
stored without held-out curves (`eval_every` 0: older runs) are read with the earlier rule, a trailing
mean of `window` training losses.

Regimes: "default" (lr 3e-4, 3000 steps, 10 % warmup: AsyncPP's lr) and "harsh" (lr 1e-3, 1000
steps, 5 % warmup). The baselines at the authors' operating point, scaled to the run: PipeDream-LR's
correction fades over T_c = 7/3 of the warmup (the reference: 7 epochs of correction, 3 of warmup);
Nesterov's momentum decay psi makes mu_t reach 0.9 at 4 % of the run (torch's 0.004 does at ~10k of
the reference's ~250k steps); every stage clips its own gradients (`clip_scope` "stage"), as the
reference's pipeline stages do.

    python -m experiments.rotation.staleness --jobs 2                 # full: every optimizer x 6 depths (hours)
    python -m experiments.rotation.staleness --quick                  # minutes-long smoke version
    python -m experiments.rotation.staleness --regime harsh           # -> staleness_harsh.{json,md,png}
    python -m experiments.rotation.staleness --render experiments/results/staleness_harsh.json   # tables again
Writes <out>/<name>.{json,md,png} (default out: experiments/results; name: staleness, or
staleness_harsh for --regime harsh, with _quick appended for --quick). Every finished run is
appended to <out>/<name>.partial.jsonl; a rerun with the same settings resumes from it (deleted
once the results are written).
"""

from __future__ import annotations

import os

# Single-threaded LAPACK: with OpenBLAS's threads on a busy 2-core machine, a 96x96 QR/eigh (the
# rotation refresh) takes ~150 ms instead of ~0.4 ms. Must be set before numpy/jax load OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import math
import multiprocessing
import pathlib
import time
import functools
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Sequence

import jax
import numpy as np

from boostjax.config import DELAY_TC_PER_WARMUP, Config, ModelConfig, TrainConfig, nesterov_psi
from boostjax.training.checks import validate
from boostjax.data import BatchIterator, eval_batches, load_corpus
from boostjax.placement import local_loss_fn
from boostjax.training.step import build_step_fns
from boostjax.models.llama import init_model

from experiments import common

# name -> (label, TrainConfig overrides)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw": ("PipeDream (AdamW + stashing)", {"optimizer": "adamw"}),
    "pipedream-lr": ("PipeDream-LR", {"optimizer": "pipedream-lr"}),
    "nesterov": ("Nesterov (torch NAdam, mu_t schedule scaled to the run)", {"optimizer": "nesterov"}),
    "rotation": ("Basis rotation (bilateral, 2nd-order, damped refresh)", {"optimizer": "rotation"}),
    "rotation-eigh": ("Basis rotation, the paper's exact eigh refresh (--rot-damping 0)",
                      {"optimizer": "rotation", "rot_damping": 0.0}),
    "rotation-sa": ("Basis rotation + stage-aware refresh", {"optimizer": "rotation", "stage_aware_refresh": True}),
    "rotation-ref": ("Basis rotation, reference order (refresh with G_t first)",
                     {"optimizer": "rotation", "rot_order": "current"}),
    "2bw-muon": ("PipeDream-2BW + Muon (delay 1 at every depth)", {"optimizer": "muon", "delay_schedule": "2bw"}),
    "2bw-adamw": ("PipeDream-2BW + AdamW (delay 1 at every depth)", {"optimizer": "adamw", "delay_schedule": "2bw"}),
}
PAPER = {"baselines_slowdown_32": (4.24, 5.81), "rotation_slowdown_32": 1.27}
# rows that are not in the basis-rotation paper: what they are and where they come from
DEVIATIONS: dict[str, str] = {
    "2bw-muon": "PipeDream-2BW + Muon is not in the basis-rotation paper: it is the modern baseline of arXiv "
                "2606.30634 (https://arxiv.org/abs/2606.30634), a one-step delay at every depth (2BW's double-"
                "buffered weights) with Muon on the hidden matrices (update RMS matched to AdamW's, 0.2 sqrt(max "
                "dim), so the same lr) and AdamW elsewhere. That paper's error-feedback correction is not "
                "implemented: its update rule could not be read from the public text reachable here.",
    "2bw-adamw": "PipeDream-2BW + AdamW is not in the basis-rotation paper: the one-step-delay schedule of arXiv "
                 "2606.30634 with the optimizer that paper finds degrades under it.",
}
# the earlier baselines (Nesterov as optax.nadamw, PipeDream-LR's T_c = 50 %), which runs recorded without
# `tc_frac` in their settings used
LEGACY = {"warmup_frac": 0.05, "tc_frac": 0.5, "legacy_baselines": True, "nesterov_psi": 0.004,
          "clip_scope": "global", "eval_every": 0}
# what a results JSON written before these settings existed ran with: torch's psi, global clipping, no
# held-out curves (the smoothed-training-loss rule)
BEFORE_HELDOUT = {"nesterov_psi": 0.004, "clip_scope": "global", "eval_every": 0}
LEGACY_LABELS = {"nesterov": "Nesterov (old: optax.nadamw, constant b1 0.99)",
                 "pipedream-lr": "PipeDream-LR (old: T_c = 50 %)"}
REGIMES: dict[str, dict[str, Any]] = {
    "default": {"lr": 3e-4, "steps": 3000, "warmup_frac": 0.1},
    "harsh": {"lr": 1e-3, "steps": 1000, "warmup_frac": 0.05},
}


@dataclass(frozen=True)
class Settings:
    regime: str = "default"
    optimizers: tuple[str, ...] = ("adamw", "pipedream-lr", "nesterov", "rotation", "2bw-muon")
    stages: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    n_layers: int = 32
    d_model: int = 32
    n_heads: int = 4
    d_ff: int = 96
    steps: int = 3000
    batch: int = 8
    seq: int = 32
    lr: float = 3e-4
    warmup_frac: float = 0.1  # linear warmup over this fraction of the steps, then cosine to 0.1 lr
    tc_frac: float = 0.0  # PipeDream-LR: T_c as a fraction of the steps; 0 = 7/3 of the warmup
    nesterov_psi: float = -1.0  # torch NAdam's momentum decay; -1 = mu_t reaches 0.9 at 4 % of the run
    clip_scope: str = "stage"  # each stage clips its own gradients (the reference), or "global"
    eval_every: int = 50  # held-out loss every N steps (0: none, the smoothed-training-loss rule)
    seed: int = 0
    window: int = 20  # trailing-mean window of the smoothed loss
    extra_fracs: tuple[float, ...] = (0.5, 0.65)  # targets: own S = 1 smoothed loss at these fractions
    fetch_every: int = 20
    n_eval: int = 16  # validation batches (of batch x seq tokens) of every held-out loss
    jobs: int = 2  # runs in parallel processes (each XLA CPU step here is nearly single-threaded)
    legacy_baselines: bool = False  # runs made with the earlier Nesterov (optax.nadamw) and T_c = 50 %
    extra: dict = field(default_factory=dict)  # other TrainConfig overrides shared by every run

    @property
    def warmup(self) -> int:
        return max(1, round(self.steps * self.warmup_frac))

    @property
    def t_c(self) -> int:
        share = self.steps * self.tc_frac if self.tc_frac > 0 else DELAY_TC_PER_WARMUP * self.warmup
        return max(1, round(share))

    @property
    def psi(self) -> float:
        return nesterov_psi(TrainConfig(steps=self.steps, nesterov_psi=self.nesterov_psi))

    def config(self, opt: str, n_stages: int) -> Config:
        model = ModelConfig(kind="llama", d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                            d_ff=self.d_ff, max_seq_len=self.seq)
        # the references' settings: betas (0.9, 0.999), wd 0.01, clip 1 (basis-rotation README),
        # cosine to 0.1 lr, refresh 10, bilateral 2nd-order rotation; see the module docstring
        train = TrainConfig(steps=self.steps, batch=self.batch, seq=self.seq, seed=self.seed, lr=self.lr,
                            b1=0.9, b2=0.999, weight_decay=0.01, clip=1.0, min_lr_ratio=0.1, warmup=self.warmup,
                            rot_refresh=10, rot_source="second", rot_geometry="bilateral",
                            delay_lr_tc=self.t_c, nesterov_psi=self.psi, clip_scope=self.clip_scope,
                            pipeline_delay=n_stages, progress=False)
        train = replace(train, **{**self.extra, **OPTIMIZERS[opt][1]})  # an optimizer's own settings win
        return validate(Config(model, train))


QUICK = Settings(optimizers=("adamw", "pipedream-lr", "nesterov", "rotation", "rotation-ref"), stages=(1, 4, 8),
                 n_layers=8, steps=120, window=10, n_eval=2, eval_every=20)


def label(s: Settings, opt: str) -> str:
    """The optimizer's row label (runs made with the earlier baselines name them)."""
    if s.legacy_baselines:
        return LEGACY_LABELS.get(opt, OPTIMIZERS[opt][0])
    if opt == "nesterov" and s.nesterov_psi >= 0:
        return f"Nesterov (torch NAdam, psi {s.nesterov_psi:g})"
    return OPTIMIZERS[opt][0]


def settings_from_json(d: dict) -> Settings:
    """The `Settings` of a results JSON; runs recorded without `tc_frac` get `LEGACY`'s baselines."""
    known = {f.name for f in fields(Settings)}
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known}
    if "eval_every" not in d:
        kw = {**BEFORE_HELDOUT, **kw}
    if "tc_frac" not in d:
        kw = {**LEGACY, **kw, "legacy_baselines": True,
              "regime": "harsh" if kw.get("lr") == 1e-3 else kw.get("regime", "default")}
        kw.pop("extra_fracs", None)  # the old list (0.2, 0.35, 0.5) fed the dropped cross-optimizer rule
    return Settings(**kw)


def trailing_mean(x: Sequence[float], window: int) -> np.ndarray:
    """`out[i] = mean(x[max(0, i - window + 1) : i + 1])`."""
    x = np.asarray(x, np.float64)
    c = np.concatenate([[0.0], np.cumsum(x)])
    i = np.arange(1, len(x) + 1)
    lo = np.maximum(i - window, 0)
    return (c[i] - c[lo]) / (i - lo)


def steps_to_target(curve: "np.ndarray | tuple[np.ndarray, np.ndarray]", target: float) -> int | None:
    """First step at which `curve` is <= target (None if never, NaN counts as never). `curve`: (steps,
    losses), or losses at steps 1, 2, ... (a smoothed training curve)."""
    steps, values = curve if isinstance(curve, tuple) else (np.arange(1, len(curve) + 1), curve)
    hit = np.flatnonzero(np.nan_to_num(np.asarray(values, np.float64), nan=np.inf) <= target)
    return int(steps[hit[0]]) if hit.size else None


def heldout(s: Settings) -> bool:
    """Whether the rule reads held-out losses (else the trailing mean of the training losses)."""
    return s.eval_every > 0


def rule_curve(s: Settings, r: dict) -> tuple[np.ndarray, np.ndarray]:
    """(steps, losses) the rule reads: the held-out losses at their evaluation steps, or the trailing
    mean of `window` training losses at every step (results stored without held-out curves)."""
    if heldout(s):
        vals = [np.nan if v is None else v for v in r.get("val_losses", [])]
        return np.asarray(r.get("val_steps", []), np.int64), np.asarray(vals, np.float64)
    sm = trailing_mean(r["losses"], s.window)
    return np.arange(1, len(sm) + 1), sm


def value_at(curve: tuple[np.ndarray, np.ndarray], step: int) -> float:
    """The curve's value at its last point at or before `step` (NaN when there is none)."""
    steps, values = curve
    k = np.searchsorted(steps, step, side="right") - 1
    return float(values[k]) if k >= 0 else float("nan")


# ----------------------------------------------------------------------------- running
_CTX: dict[tuple, tuple] = {}


def _context(s: Settings) -> tuple:
    """(corpus, graphdef, initial params, jitted eval loss, validation batches), once per process."""
    key = (s.n_layers, s.d_model, s.n_heads, s.d_ff, s.batch, s.seq, s.seed, s.n_eval)
    if key not in _CTX:
        corpus = load_corpus("")
        ref = s.config("adamw", 1)
        graphdef, params0 = init_model(ref)
        eval_fn = jax.jit(local_loss_fn(ref, graphdef))
        parts = eval_batches(corpus.val, s.batch, s.seq, s.n_eval, vocab_size=256)
        val = jax.device_put({k: np.concatenate([b[k] for b in parts]) for k in parts[0]})  # one fixed set
        _CTX[key] = (corpus, graphdef, jax.device_get(params0), eval_fn, val)
    return _CTX[key]


def run_one(s: Settings, opt: str, n_stages: int) -> dict:
    """Train one (optimizer, S) configuration; returns its losses, timings and final losses."""
    corpus, graphdef, params0, eval_fn, val = _context(s)
    cfg = s.config(opt, n_stages)
    fns = build_step_fns(cfg, graphdef, params0)
    state = fns.init(jax.tree.map(np.array, params0))  # copies: the step donates its inputs
    data = BatchIterator(corpus.train, s.batch, s.seq, s.seed, vocab_size=cfg.model.vocab_size)
    t0 = time.perf_counter()
    step = fns.compile(state, data.batch_at(0))
    compile_s = time.perf_counter() - t0
    losses: list[float] = []
    val_steps: list[int] = []
    val_losses: list[float] = []
    pending: list[Any] = []
    diverged = False
    eval_s = 0.0
    t0 = time.perf_counter()
    for k in range(1, s.steps + 1):
        state, m = step(state, fns.put_batch(data.next()))
        pending.append(m["loss"])
        if s.eval_every and (k % s.eval_every == 0 or k == s.steps):
            t_eval = time.perf_counter()
            val_steps.append(k)
            val_losses.append(float(eval_fn(state.params, val)))
            eval_s += time.perf_counter() - t_eval
        if k % s.fetch_every == 0 or k == s.steps:
            fetched = [float(v) for v in jax.device_get(pending)]
            losses.extend(fetched)
            pending = []
            if not all(math.isfinite(v) for v in fetched):
                diverged = True  # recorded as never reaching the target
                break
    train_s = time.perf_counter() - t0 - eval_s
    if diverged or not val_losses:
        final_val = float("nan") if diverged else float(eval_fn(state.params, val))
    else:
        final_val = round(val_losses[-1], 6)
    return {"optimizer": opt, "stages": n_stages, "losses": [round(v, 5) for v in losses], "diverged": diverged,
            "val_steps": val_steps, "val_losses": [round(v, 6) if math.isfinite(v) else None for v in val_losses],
            "compile_s": round(compile_s, 2), "train_s": round(train_s, 2), "eval_s": round(eval_s, 2),
            "step_ms": round(1000 * train_s / max(len(losses), 1), 1), "final_val_loss": final_val}


def _run_task(args: tuple[Settings, str, int]) -> dict:
    return run_one(*args)


def _settings_key(s: Settings) -> dict:
    """The settings that decide what a run computes (not which runs, how many workers, or the analysis)."""
    d = json.loads(json.dumps(asdict(s)))
    return {k: v for k, v in d.items() if k not in ("optimizers", "jobs", "window", "extra_fracs", "regime")}


def load_partial(s: Settings, path: pathlib.Path, log=print) -> list[dict]:
    """Finished runs from an earlier interrupted run with the same settings (`<name>.partial.jsonl`)."""
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if not lines or lines[0].get("settings") != _settings_key(s):
        log(f"staleness: {path} holds runs of other settings; starting afresh")
        path.unlink()
        return []
    runs = [r for r in lines[1:] if r["optimizer"] in s.optimizers and r["stages"] in s.stages]
    log(f"staleness: resuming, {len(runs)} finished run(s) from {path}")
    return runs


def run_all(s: Settings, log=print, done: Sequence[dict] = (), partial: pathlib.Path | None = None) -> list[dict]:
    """Every (optimizer, S) not in `done`, S = 1 first; `s.jobs > 1` spreads them over spawned
    processes. Each finished run is printed and appended to `partial` (a JSON line) at once."""
    have = {(r["optimizer"], r["stages"]) for r in done}
    todo = [(o, n) for n in sorted(s.stages) for o in s.optimizers if (o, n) not in have]
    runs: list[dict] = []
    t_start = time.perf_counter()
    if partial is not None and not partial.exists():
        partial.write_text(json.dumps({"settings": _settings_key(s)}) + "\n")

    def report(r: dict) -> None:
        runs.append(r)
        if partial is not None:
            with partial.open("a") as f:
                f.write(json.dumps(r) + "\n")
        n_done, elapsed = len(runs), time.perf_counter() - t_start
        last = r["losses"][-1] if r["losses"] else float("nan")
        log(f"[{n_done}/{len(todo)}] {r['optimizer']:12s} S={r['stages']:<2d} compile {r['compile_s']:5.1f}s "
            f"{r['step_ms']:6.1f} ms/step  loss {last:.3f}{' DIVERGED' if r['diverged'] else ''}  "
            f"val {r['final_val_loss']:.3f}  elapsed {elapsed / 60:.1f} min, "
            f"eta {elapsed / n_done * (len(todo) - n_done) / 60:.1f} min")

    if s.jobs <= 1:
        for o, n in todo:
            report(run_one(s, o, n))
    elif todo:
        with ProcessPoolExecutor(s.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_run_task, (s, o, n)) for o, n in todo]
            for f in as_completed(futures):
                report(f.result())
    return runs


# ----------------------------------------------------------------------------- analysis
def _row(s: Settings, r: dict, curve: tuple[np.ndarray, np.ndarray], target: float | None, own: int | None,
         adamw_first: int | None) -> dict:
    n = steps_to_target(curve, target) if target is not None else None
    iters = n if n is not None else s.steps  # lower bound when not reached
    smax = r["stages"] == max(s.stages)
    train = trailing_mean(r["losses"], s.window)
    return {
        "optimizer": r["optimizer"], "label": label(s, r["optimizer"]), "stages": r["stages"],
        "target_loss": target, "iters_to_target": n, "reached": n is not None, "lower_bound": n is None,
        "diverged": r["diverged"],
        # the S = 1 run never reaches a target this run does: the slowdown is below n / budget
        "slowdown": (iters / own if own else n / s.steps if n is not None else None) if target is not None else None,
        "upper_bound": target is not None and not own and n is not None,
        # the budget reading: the S_max run counted as needing its whole budget to reach its own final loss
        "slowdown_budget": s.steps / own if smax and own and target is not None else None,
        "slowdown_vs_adamw_s1": iters / adamw_first if adamw_first and target is not None else None,
        "final_train_loss": float(train[-1]) if len(train) and not r["diverged"] else float("nan"),
        "final_val_loss": r["final_val_loss"], "compile_s": r["compile_s"], "train_s": r["train_s"],
        "step_ms": r["step_ms"],
    }


def summarize(s: Settings, runs: list[dict], frac: float | None = None) -> dict:
    """Per-optimizer targets and slowdowns vs the optimizer's own S = 1 run, on `rule_curve`.

    `frac=None` (headline): target = the final value of the optimizer's own S_max curve (None when that
    run diverged); else the own S = 1 curve at `frac` of the budget. "vs AdamW S = 1" divides by the
    first step AdamW's S = 1 run reaches the same target (extra information)."""
    smax = max(s.stages)
    curves = {(r["optimizer"], r["stages"]): rule_curve(s, r) for r in runs}
    at = max(1, round((frac or 1.0) * s.steps))
    targets: dict[str, float | None] = {}
    for o in dict.fromkeys(r["optimizer"] for r in runs):
        c = curves.get((o, smax)) if frac is None else curves.get((o, 1))
        ok = c is not None and len(c[0]) > 0 and c[0][-1] >= (s.steps if frac is None else at)
        value = (float(c[1][-1]) if frac is None else value_at(c, at)) if ok else float("nan")
        targets[o] = value if math.isfinite(value) else None
    rows = []
    for r in runs:
        o, target = r["optimizer"], targets[r["optimizer"]]
        own = steps_to_target(curves[(o, 1)], target) if target is not None and (o, 1) in curves else None
        adamw = (steps_to_target(curves[("adamw", 1)], target)
                 if target is not None and ("adamw", 1) in curves else None)
        rows.append(_row(s, r, curves[(o, r["stages"])], target, own, adamw))
    what = "held-out" if heldout(s) else "smoothed"
    return {"rule": f"own S_max final {what} loss" if frac is None else f"own S=1 {what} loss at {frac:.0%}",
            "target_frac": frac, "targets": targets, "rows": rows}


def _slow(row: dict | None, key: str = "slowdown") -> str:
    if row is None:
        return "-"
    v = row[key]
    if v is None:
        return "n/a"
    return f">{v:.2f}x" if row["lower_bound"] else f"<{v:.2f}x" if row.get("upper_bound") else f"{v:.2f}x"


def _find(summary: dict, opt: str, n: int) -> dict | None:
    return next((r for r in summary["rows"] if r["optimizer"] == opt and r["stages"] == n), None)


def settings_lines(s: Settings) -> list[str]:
    cfg = s.config("rotation", 1).train
    psi = s.psi
    reach = math.log(2 * (1 - 0.9 / 0.99)) / (math.log(0.96) * psi)  # the step mu_t reaches 0.9
    nesterov = ("optax.nadamw, constant b1 0.99 (the earlier definition)" if s.legacy_baselines else
                f"torch.optim.NAdam: b1 0.99, b2 0.999, momentum_decay psi {psi:.4g} (mu_t = 0.99(1 - 0.5*0.96^(psi t)) "
                f"reaches 0.9 at step {reach:.0f}, {reach / s.steps:.1%} of the run), decoupled weight decay")
    tc_note = ("the earlier setting" if s.legacy_baselines else
               f"{s.tc_frac:.1%} of the run" if s.tc_frac > 0 else
               f"7/3 of the {s.warmup}-step warmup, as the reference's 7 epochs of correction against 3 of warmup")
    clip = ("each stage clips its own gradients (the reference's per-stage `clip_grad_norm_`)"
            if s.clip_scope == "stage" else "one global norm")
    measure = (f"held-out loss on {s.n_eval} fixed validation batches ({s.n_eval * s.batch * s.seq} tokens) every "
               f"{s.eval_every} steps and at the last, at the current weights" if heldout(s) else
               f"trailing mean of {s.window} steps of the training loss the pipeline reports")
    return [
        f"- regime `{s.regime}`: {s.steps} steps, lr {s.lr:g}, linear warmup {s.warmup} steps "
        f"({s.warmup_frac:.0%}), cosine to 0.1 lr; betas (0.9, 0.999), eps 1e-8, weight decay 0.01, clip 1.0: {clip}",
        f"- model: dense LLaMA, {s.n_layers} layers, d_model {s.d_model}, {s.n_heads} heads, d_ff {s.d_ff}; "
        f"batch {s.batch} x seq {s.seq} bytes of the stdlib-sources corpus; seed {s.seed} (same init and batches "
        f"for every run)",
        f"- stages S: {', '.join(map(str, s.stages))}; stage s of S computes its gradient on weights S-1-s "
        "updates old (weight stashing, `boostjax.optim.delay`)",
        f"- PipeDream-LR: lr / τ^(1 - min(t/T_c, 1)) per stage (τ its delay), T_c = {s.t_c} steps ({tc_note})",
        f"- Nesterov: {nesterov}",
        f"- basis rotation: bilateral, 2nd-order (Gram) source, refresh every {cfg.rot_refresh} steps, "
        f"Gram EMA β {cfg.rot_beta:g}, refreshes damped by {cfg.rot_damping:g} x the mean eigenvalue (0 = the "
        "paper's exact eigh; rotation-eigh rows: 0); order 'previous' (project G_t on bases from G_<=t-1, SOAP) unless "
        "'reference order' (Gram EMA with G_t, refresh at step 1 and t % 10 == 0, then project, as the "
        "authors' `BasisRotation.step`); stage-aware: deeper-delayed stages refresh more often",
        f"- measured: {measure}" + (f"; extra targets at {', '.join(f'{f:.0%}' for f in s.extra_fracs)} of the budget"
                                    if s.extra_fracs else ""),
    ]


def rule_lines(s: Settings) -> list[str]:
    smax = max(s.stages)
    what = "held-out loss" if heldout(s) else "smoothed training loss"
    at = "first evaluation" if heldout(s) else "first step"
    return [
        f"Per optimizer (each compared with its own synchronous run): headline target L* = the final {what} of "
        f"its S = {smax} run; slowdown(S) = {at} at which its S-run's {what} <= L* / the same for its S = 1 run. "
        f"Budget reading: the S = {smax} run counted as needing its whole budget, {s.steps} / the S = 1 run's "
        f"{at} at L*. Extra targets: its own S = 1 {what} at a fraction of the budget. '> budget' marks runs "
        "that never reach the target (slowdown then a lower bound, budget / iters(S = 1)); diverged runs never "
        "reach it. 'vs AdamW S=1' divides by the step AdamW's S = 1 run reaches the same target (extra "
        "information only)."]


def _md_row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(s: Settings, main: dict, extras: list[dict], wall_s: float, command: str, platform: str,
             reused: Sequence[str] = (), rendered: str = "", resumed: int = 0, sources: Sequence[dict] = ()) -> str:
    smax = max(s.stages)
    lines = [f"# Staleness experiment ({s.regime} regime): iterations to a target loss vs pipeline depth", ""]
    if s.legacy_baselines:
        lines += ["**Old baselines.** These runs used the earlier baselines: their Nesterov rows are `optax.nadamw` with a "
                  "constant b1 0.99 (not torch's NAdam μ_t schedule) and their PipeDream-LR rows fade the "
                  "correction over T_c = 50 % of the run (not 7/250). The tables below are re-computed from the "
                  "stored loss curves with the per-optimizer target rule. (Today the command below runs the "
                  "default regime; this regime with today's baselines is `--regime harsh`.)", ""]
    lines += [
        f"Command: `{command}`  ",
        (f"Wall time: {wall_s / 60:.1f} min ({platform}, {s.jobs} worker process(es))" if not sources or wall_s > 60
         else f"This invocation trained nothing ({wall_s:.0f} s, {platform}): it combined the runs below")
        + (f"; the runs of {', '.join(reused)} were reused from an earlier identical-settings run (`--reuse`)"
           if reused else "")
        + (f"; {resumed} run(s) were finished by an interrupted earlier invocation (resumed from the partial "
           "file; their time is not in this wall time)" if resumed else "") + ".  ",
        *([f"Tables re-rendered by `{rendered}`.  "] if rendered else []),
        *(["", "The runs came from these invocations, side by side on the same machine:", "",
           *[f"- `{src['command']}`: {', '.join(src['optimizers'])}, wall time {src['wall_s'] / 60:.1f} min"
             for src in sources if src.get("wall_s") is not None]] if sources else []),
        "",
        "## Settings", "", *settings_lines(s), "",
        "## Deviations from the paper (https://arxiv.org/abs/2602.03515) and its code",
        "",
        "- Gram EMA β 0.95 (SOAP's value) vs the reference's 0.999 (= β2 through `shampoo_beta=-1`), which "
        "the authors use over 250-epoch runs (>= 25x longer than this one); with 0.999 the statistics average "
        "the whole short run and the basis lags the current curvature.",
        f"- model and corpus: a {s.n_layers}-layer d_model-{s.d_model} LLaMA on byte tokens of a small local "
        "corpus, vs the paper's 32-layer n_embd-384 GPT on OpenWebText (block 512), on many GPUs; the pipeline "
        "is emulated (exact stale gradients), not run.",
        f"- {s.steps} steps vs 250 epochs; warmup {s.warmup_frac:.0%} (reference: 3 of 250 epochs = 1.2 %; "
        "AsyncPP 3 of 50); clip 1.0 (reference README 1; AsyncPP 10)"
        + ("; global-norm clipping (the reference clips per stage)." if s.clip_scope == "global" else "."),
        *([f"- {DEVIATIONS[o]}" for o in s.optimizers if o in DEVIATIONS]),
        "",
        "## Rule",
        "",
        *rule_lines(s),
        "",
        f"## Slowdown from S = 1 to S = {smax}, beside the paper (32 stages)",
        "",
        _md_row(["optimizer", "L* (own S_max final)", "budget reading",
              *(f"own S=1 @ {e['target_frac']:.0%}" for e in extras), "paper (S = 32)"]),
        "|---|" + "---:|" * (len(extras) + 3),
    ]
    lo, hi = PAPER["baselines_slowdown_32"]
    for opt in s.optimizers:
        head = _find(main, opt, smax)
        cells = [_slow(head), _slow(head, "slowdown_budget"), *(_slow(_find(e, opt, smax)) for e in extras)]
        paper = (f"{PAPER['rotation_slowdown_32']:.2f}x" if opt.startswith("rotation") else
                 "not in the paper" if opt in DEVIATIONS else f"{lo}-{hi}x (baselines)")
        lines.append(_md_row([label(s, opt), *cells, paper]))
    lines += ["", "## Every run (headline rule)", "",
              _md_row(["optimizer", "S", "L*", "iters to L*", "slowdown vs own S=1", "vs AdamW S=1",
                    *(f"slowdown @ {e['target_frac']:.0%}" for e in extras), "final train loss", "final val loss",
                    "ms/step"]),
              "|---|---:|---:|---:|---:|---:|" + "---:|" * (len(extras) + 3)]
    for r in sorted(main["rows"], key=lambda r: (s.optimizers.index(r["optimizer"]), r["stages"])):
        it = str(r["iters_to_target"]) if r["reached"] else f"> {s.steps}" + (" (diverged)" if r["diverged"] else "")
        tl = "n/a" if r["target_loss"] is None else f"{r['target_loss']:.4f}"
        ex = [_slow(_find(e, r["optimizer"], r["stages"])) for e in extras]
        lines.append(_md_row([r["label"], r["stages"], tl, it, _slow(r), _slow(r, "slowdown_vs_adamw_s1"), *ex,
                           f"{r['final_train_loss']:.4f}", f"{r['final_val_loss']:.4f}", r["step_ms"]]))
    if "adamw" in s.optimizers and "pipedream-lr" in s.optimizers:
        lines += ["", "At S = 1 PipeDream-LR is mathematically AdamW (τ = 0); its S = 1 row differs from AdamW's only "
                  "through floating-point rounding in a differently compiled program, a gauge of run-to-run noise."]
    if "rotation-ref" in s.optimizers:
        lines += ["", "Reference order: at step 1 the gradient is projected onto the eigenbasis of its own Gram "
                  "matrices, so Uᵀ G₁ V is diagonal up to rounding and Adam (eps 1e-8) turns the rounding noise of "
                  "the off-diagonal entries into O(1) update entries; the authors' code does the same."]
    return "\n".join(lines) + "\n"


def plot(s: Settings, main: dict, runs: list[dict]):
    """(a) slowdown vs S, (b) the S = 1 and S_max loss curves (a matplotlib Figure)."""
    smax = max(s.stages)
    fig, (ax1, ax2) = common.subplots(2, (12, 4.5))
    for i, opt in enumerate(s.optimizers):
        color = f"C{i}"
        rows = sorted((r for r in main["rows"] if r["optimizer"] == opt and r["slowdown"] is not None),
                      key=lambda r: r["stages"])
        ax1.plot([r["stages"] for r in rows], [r["slowdown"] for r in rows], "-", color=color, label=label(s, opt))
        for r in rows:
            ax1.plot(r["stages"], r["slowdown"], "^" if r["lower_bound"] else "o", color=color,
                     fillstyle="none" if r["lower_bound"] else "full")
        for r in runs:
            if r["optimizer"] == opt and r["stages"] in (1, smax):
                x, y = rule_curve(s, r)
                ax2.plot(x, y, "-" if r["stages"] > 1 else ":", color=color, lw=1.2, label=f"{opt} S={r['stages']}")
        if main["targets"].get(opt) is not None:
            ax2.axhline(main["targets"][opt], color=color, lw=0.6, ls="--")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(list(s.stages), [str(v) for v in s.stages])
    ax1.set_xlabel("pipeline stages S")
    ax1.set_ylabel("iterations to L* / iterations at S=1")
    ax1.set_title(f"(a) slowdown vs S, L* = own S={smax} final loss (open: lower bounds)", fontsize=10)
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.set_xlabel("step")
    ax2.set_ylabel("held-out loss" if heldout(s) else f"training loss (trailing mean, {s.window} steps)")
    ax2.set_title(f"(b) loss curves, S=1 (dotted) and S={smax} (solid); dashed: L*", fontsize=10)
    lows = [float(np.nanmin(rule_curve(s, r)[1])) for r in runs if len(rule_curve(s, r)[1])]
    tops = [t for t in main["targets"].values() if t is not None]
    ax2.set_ylim(min(lows, default=0.0) - 0.05, max(tops, default=3.0) + 1.0)
    ax2.legend(fontsize=7, ncol=2)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _finite_or_none(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    return x


def reusable_runs(s: Settings, path: pathlib.Path, rerun: Sequence[str]) -> list[dict]:
    """Runs from an earlier results JSON with the same settings, for optimizers not in `rerun`.

    The runs are deterministic (same init, batches and compiled step), so a baseline whose code did
    not change need not be recomputed when only other optimizers change. Every setting that decides
    what a kept run computes must match (T_c only when PipeDream-LR runs are kept; runs made with the
    earlier Nesterov or PipeDream-LR are never kept), else ValueError."""
    old = json.loads(pathlib.Path(path).read_text())
    theirs_s = settings_from_json(old["settings"])
    keep = [o for o in s.optimizers if o not in rerun]
    mine, theirs = _settings_key(s), _settings_key(theirs_s)
    ignore = {"legacy_baselines", *(() if "pipedream-lr" in keep else ("tc_frac",))}
    diff = sorted(k for k in mine if k not in ignore and mine[k] != theirs.get(k))
    if theirs_s.legacy_baselines and {"nesterov", "pipedream-lr"} & set(keep):
        diff.append("legacy_baselines (rerun nesterov,pipedream-lr)")
    if diff:
        raise ValueError(f"staleness: --reuse {path} was run with other settings ({', '.join(diff)}); "
                         "fix: rerun those optimizers (--rerun), or pass the same settings")
    want = {(o, n) for o in keep for n in s.stages}
    return [r for r in old["runs"] if (r["optimizer"], r["stages"]) in want]


def _check(s: Settings) -> None:
    unknown = [o for o in s.optimizers if o not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"staleness: unknown optimizers {unknown}; fix: use some of {', '.join(OPTIMIZERS)}")
    if 1 not in s.stages:
        raise ValueError("staleness: --stages must include 1 (the reference); fix: e.g. --stages 1,4,32")
    bad = [n for n in s.stages if n < 1 or s.n_layers % n]
    if bad:
        raise ValueError(f"staleness: stages {bad} do not divide n_layers={s.n_layers}; fix: use divisors")
    for o in s.optimizers:  # bad TrainConfig combinations fail here, before anything runs
        s.config(o, max(s.stages))


def write_results(s: Settings, runs: list[dict], out: pathlib.Path, name: str, *, command: str, wall_s: float,
                  platform: str, reused_from: dict | None = None, rendered: str = "", resumed: int = 0) -> dict:
    """Analyse `runs` and write <out>/<name>.{json,md,png}; returns the JSON object."""
    main = summarize(s, runs)
    extras = [summarize(s, runs, f) for f in s.extra_fracs]
    reused = reused_from["optimizers"] if reused_from else []
    result = {"settings": asdict(s), "command": command, "wall_s": round(wall_s, 1), "platform": platform,
              "paper": PAPER, "reused_from": reused_from, "rendered_by": rendered or None, "resumed_runs": resumed,
              **main, "extra_targets": extras, "runs": runs}
    common.write(out, name, data=_finite_or_none(result), figure=lambda: plot(s, main, runs),
                     md=lambda: markdown(s, main, extras, wall_s, command, platform, reused, rendered, resumed,
                                         sources=(reused_from or {}).get("files", ())))
    return result


def run_experiment(s: Settings, out: pathlib.Path, command: str = "", log=print,
                   reuse: Sequence[pathlib.Path] = (), rerun: Sequence[str] = (), name: str = "staleness") -> dict:
    """Run every (optimizer, S), write <name>.{json,md,png} under `out`; returns the JSON object.

    `reuse`: earlier results JSONs with the same settings (e.g. invocations that ran some optimizers
    each, side by side); their runs of optimizers not in `rerun` are taken as they are (recorded as
    `reused_from`, with each file's command and wall time). Finished runs go to <name>.partial.jsonl as
    they come; a rerun with the same settings resumes from there."""
    _check(s)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(reuse, (str, pathlib.Path)):
        reuse = [pathlib.Path(reuse)]
    kept, sources = [], []
    for path in reuse:
        have = {(k["optimizer"], k["stages"]) for k in kept}
        runs_i = [r for r in reusable_runs(s, path, rerun) if (r["optimizer"], r["stages"]) not in have]
        kept += runs_i
        old = json.loads(pathlib.Path(path).read_text())
        sources.append({"file": str(path), "command": old.get("command"), "wall_s": old.get("wall_s"),
                        "optimizers": sorted({r["optimizer"] for r in runs_i})})
    partial = out / f"{name}.partial.jsonl"
    resumed = [r for r in load_partial(s, partial, log) if (r["optimizer"], r["stages"]) not in
               {(k["optimizer"], k["stages"]) for k in kept}]
    t_start = time.perf_counter()
    fresh = run_all(s, log, done=[*kept, *resumed], partial=partial)
    wall_s = time.perf_counter() - t_start
    order = {(o, n): i for i, (o, n) in enumerate((o, n) for n in sorted(s.stages) for o in s.optimizers)}
    runs = sorted([*kept, *resumed, *fresh], key=lambda r: order[(r["optimizer"], r["stages"])])
    platform = f"{common.machine_line()}, jax {jax.__version__} on {jax.devices()[0].platform}"
    reused = sorted({r["optimizer"] for r in kept})
    result = write_results(s, runs, out, name, command=command, wall_s=wall_s, platform=platform,
                           reused_from={"files": sources, "optimizers": reused} if kept else None,
                           resumed=len(resumed))
    partial.unlink(missing_ok=True)
    return result


def render(path: pathlib.Path, out: pathlib.Path, command: str) -> dict:
    """Re-analyse the runs stored in a results JSON (no training) into <out>/<stem>.{json,md,png}."""
    old = json.loads(path.read_text())
    s = settings_from_json(old["settings"])
    out.mkdir(parents=True, exist_ok=True)
    return write_results(s, old["runs"], out, path.stem, command=old["command"], wall_s=old["wall_s"],
                         platform=old["platform"], reused_from=old.get("reused_from"), rendered=command)


def _check_settings(p: argparse.ArgumentParser, s: Settings) -> None:
    """Refuse bad settings in one line (exit 2) before anything is written or compiled."""
    bad = [f"--{flag}: {value} must lie in {span}" for flag, value, ok, span in (
        ("warmup-frac", s.warmup_frac, 0 <= s.warmup_frac < 1, "[0, 1)"),
        ("tc-frac", s.tc_frac, 0 <= s.tc_frac <= 1, "[0, 1] (0 = 7/3 of the warmup)"),
        ("nesterov-psi", s.nesterov_psi, s.nesterov_psi == -1 or 0 <= s.nesterov_psi < 1e3, "-1 or [0, 1000)"),
        ("eval-every", s.eval_every, s.eval_every >= 0, "[0, ...) (0 = the smoothed-training-loss rule)"),
        ("n-eval", s.n_eval, s.n_eval >= 1, "[1, ...)"),
        ("extra-fracs", s.extra_fracs, all(0 < f <= 1 for f in s.extra_fracs), "(0, 1]"),
        ("steps", s.steps, s.steps >= 1, "[1, ...)")) if not ok]
    unknown = [o for o in s.optimizers if o not in OPTIMIZERS]
    if unknown:
        bad.append(f"--optimizers: unknown {','.join(unknown)} (known: {','.join(OPTIMIZERS)})")
    if 1 not in s.stages or any(n < 1 or s.n_layers % n for n in s.stages):
        bad.append(f"--stages: {s.stages} must include 1 and divide --layers {s.n_layers}")
    if bad:
        p.error(bad[0] + "; fix: pass a value in range")


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    p = common.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="minutes-long smoke version (8 layers, S in 1,4,8, 120 steps)")
    p.add_argument("--regime", choices=tuple(REGIMES), default="default",
                   help="default: lr 3e-4, 2000 steps, 10%% warmup; harsh: lr 1e-3, 1000 steps, 5%% warmup")
    p.add_argument("--out", default="experiments/results", help="folder for <name>.{json,md,png}")
    p.add_argument("--name", help="file stem (default: staleness, staleness_harsh for --regime harsh, "
                                  "+ _quick for --quick)")
    p.add_argument("--render", type=pathlib.Path, help="re-analyse this results JSON (no training) into --out")
    p.add_argument("--optimizers", help=f"comma list from {','.join(OPTIMIZERS)}")
    p.add_argument("--stages", help="comma list of stage counts (must include 1 and divide --layers)")
    p.add_argument("--extra-fracs", help="comma list of fractions of the budget for the own-S=1 targets ('' for none)")
    p.add_argument("--reuse", help="comma list of earlier results JSONs (same settings) whose runs to keep")
    p.add_argument("--rerun", default="", help="with --reuse: comma list of optimizers to run again")
    p.add_argument("--clip-scope", choices=("global", "stage"),
                   help="gradient clipping: each stage's own norm (the reference; default) or one global norm")
    for flag, kind, what in (
            ("layers", int, "model layers (32)"), ("d-model", int, "model width (32)"), ("heads", int, "heads (4)"),
            ("d-ff", int, "MLP width (96)"), ("steps", int, "the budget (regime default)"),
            ("batch", int, "sequences per step (8)"), ("seq", int, "tokens per sequence (32)"),
            ("lr", float, "peak learning rate (regime default)"),
            ("warmup-frac", float, "linear warmup as a fraction of the steps (regime default)"),
            ("tc-frac", float, "PipeDream-LR's T_c as a fraction of the steps (0 = 7/3 of the warmup)"),
            ("nesterov-psi", float, "torch NAdam's momentum decay (-1 = mu_t reaches 0.9 at 4 %% of the run)"),
            ("eval-every", int, "held-out loss every N steps (50; 0 = the smoothed-training-loss rule)"),
            ("seed", int, "seed of the init and the batch order (0)"),
            ("window", int, "trailing-mean window of the training-loss curve (20)"),
            ("n-eval", int, "validation batches of every held-out loss (16)"),
            ("jobs", int, "runs in parallel processes (2)")):
        p.add_argument(f"--{flag}", type=kind, help=what)
    p.add_argument("--rot-damping", type=float, help="rotation rows: the refreshes' damping (default: "
                                                     "--rot-damping's, 4; 0 = the paper's exact eigh)")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    command = common.command_line("staleness", argv)
    log = functools.partial(print, flush=True)
    reuse = [pathlib.Path(x.strip()) for x in (args.reuse or "").split(",") if x.strip()]
    for flag, path in [("render", args.render), *(("reuse", x) for x in reuse)]:
        if path is not None and not path.is_file():
            p.error(f"--{flag}: {path} is not a file; fix: pass a results JSON written by this script")
    if args.render is not None:
        return render(args.render, pathlib.Path(args.out), command)
    names = {"layers": "n_layers", "heads": "n_heads"}
    lists = {"optimizers": str, "stages": int, "extra_fracs": float}
    skip = ("quick", "out", "reuse", "rerun", "regime", "name", "render", "rot_damping", *lists)
    over = {names.get(k, k): v for k, v in vars(args).items() if v is not None and k not in skip}
    for k, kind in lists.items():
        if getattr(args, k) is not None:
            over[k] = tuple(kind(x.strip()) for x in getattr(args, k).split(",") if x.strip())
    if args.rot_damping is not None:
        if not (math.isfinite(args.rot_damping) and args.rot_damping >= 0):
            p.error(f"--rot-damping: {args.rot_damping} must be finite and >= 0; fix: e.g. 4 (0 = exact eigh)")
        over["extra"] = {"rot_damping": args.rot_damping}
    regime = {k: v for k, v in REGIMES[args.regime].items() if not (args.quick and k == "steps")}
    s = replace(QUICK if args.quick else Settings(), regime=args.regime, **{**regime, **over})
    _check_settings(p, s)
    name = args.name or "_".join(["staleness", *([args.regime] if args.regime != "default" else []),
                                  *(["quick"] if args.quick else [])])
    rerun = tuple(x.strip() for x in args.rerun.split(",") if x.strip())
    return run_experiment(s, pathlib.Path(args.out), command, log=log, reuse=reuse, rerun=rerun, name=name)


if __name__ == "__main__":
    main()
