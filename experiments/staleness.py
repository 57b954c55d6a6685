"""Staleness experiment: iterations to a target loss versus pipeline depth S.

A small deep dense LLaMA (32 layers, so S can reach 32 stages of one layer each) is trained on the
default corpus (stdlib sources, byte tokens) with every optimizer at S in {1, 2, 4, 8, 16, 32}, the
asynchronous pipeline emulated by `boostjax.optim.delay` (stage s computes its gradient on weights
S-1-s updates old, weight stashing). Every run sees the same initial weights and the same batches.

Measure: the per-step training loss (the loss the pipeline itself reports, i.e. at the stale weights
the gradient is computed on), smoothed by a trailing mean over `window` steps. The target loss is
the largest smoothed loss any optimizer's S = 1 run has at `target_frac` of the step budget (so
every S = 1 run reaches it; for AdamW alone this is "AdamW S = 1 at ~65 % of the budget").
Iterations to target = first step whose smoothed loss <= target; a run that never gets there (or
diverges) is reported as "> steps" with the slowdown as a lower bound steps / iters(S = 1).
The same count for a few easier targets (`extra_fracs`) is reported alongside.

    python experiments/staleness.py                 # full: 5 optimizers x 6 depths, 2 processes
    python experiments/staleness.py --quick         # minutes-long smoke version
Writes <out>/staleness.json, staleness.md and staleness.png (default out: experiments/results).
"""

from __future__ import annotations

import os

# Single-threaded LAPACK: with OpenBLAS's threads on a busy 2-core machine, a 96x96 QR/eigh (the
# rotation refresh) takes ~150 ms instead of ~0.4 ms. Must be set before numpy/jax load OpenBLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor, as_completed  # noqa: E402
from dataclasses import asdict, dataclass, field, replace  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from boostjax.config import Config, ModelConfig, TrainConfig, validate  # noqa: E402
from boostjax.data import BatchIterator, eval_batches, load_corpus  # noqa: E402
from boostjax.step import build_step_fns, local_loss_fn  # noqa: E402
from boostjax.models.llama import init_model  # noqa: E402

# name -> (label, TrainConfig overrides)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw": ("PipeDream (AdamW + stashing)", {"optimizer": "adamw"}),
    "pipedream-lr": ("PipeDream-LR", {"optimizer": "pipedream-lr"}),
    "nesterov": ("Nesterov (NAdam, b1=0.99)", {"optimizer": "nesterov"}),
    "rotation": ("Basis rotation (bilateral, 2nd-order)", {"optimizer": "rotation"}),
    "rotation-sa": ("Basis rotation + stage-aware refresh", {"optimizer": "rotation", "stage_aware_refresh": True}),
}
PAPER = {"baselines_slowdown_32": (4.24, 5.81), "rotation_slowdown_32": 1.27}


@dataclass(frozen=True)
class Settings:
    optimizers: tuple[str, ...] = ("adamw", "pipedream-lr", "nesterov", "rotation", "rotation-sa")
    stages: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    n_layers: int = 32
    d_model: int = 32
    n_heads: int = 4
    d_ff: int = 96
    steps: int = 1000
    batch: int = 8
    seq: int = 32
    lr: float = 1e-3
    seed: int = 0
    window: int = 20  # trailing-mean window of the smoothed loss
    target_frac: float = 0.65  # the target: S = 1 smoothed loss at this fraction of the budget
    extra_fracs: tuple[float, ...] = (0.2, 0.35, 0.5)  # easier targets, reported alongside
    fetch_every: int = 20
    n_eval: int = 4  # validation batches for the final loss
    jobs: int = 2  # runs in parallel processes (each XLA CPU step here is nearly single-threaded)
    extra: dict = field(default_factory=dict)  # other TrainConfig overrides shared by every run

    def config(self, opt: str, n_stages: int) -> Config:
        model = ModelConfig(kind="llama", d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                            d_ff=self.d_ff, max_seq_len=self.seq)
        # the basis-rotation paper's settings (https://arxiv.org/abs/2602.03515): lr, warmup (5 %) +
        # cosine to 0.1 lr, betas (0.9, 0.999), wd 0.01, clip 1, refresh 10, bilateral 2nd-order.
        # PipeDream-LR's rescaling fades out over the first half.
        train = TrainConfig(steps=self.steps, batch=self.batch, seq=self.seq, seed=self.seed, lr=self.lr,
                            b1=0.9, b2=0.999, weight_decay=0.01, clip=1.0, min_lr_ratio=0.1, warmup=-1,
                            rot_refresh=10, rot_source="second", rot_geometry="bilateral",
                            delay_lr_tc=max(1, self.steps // 2), pipeline_delay=n_stages, progress=False)
        train = replace(train, **{**OPTIMIZERS[opt][1], **self.extra})
        return validate(Config(model, train))


QUICK = Settings(optimizers=("adamw", "pipedream-lr", "nesterov", "rotation"), stages=(1, 4, 8), n_layers=8,
                 steps=120, window=10, n_eval=2)


def trailing_mean(x: Sequence[float], window: int) -> np.ndarray:
    """`out[i] = mean(x[max(0, i - window + 1) : i + 1])`."""
    x = np.asarray(x, np.float64)
    c = np.concatenate([[0.0], np.cumsum(x)])
    i = np.arange(1, len(x) + 1)
    lo = np.maximum(i - window, 0)
    return (c[i] - c[lo]) / (i - lo)


def steps_to_target(smoothed: np.ndarray, target: float) -> int | None:
    """1-indexed first step whose smoothed loss is <= target (None if never, NaN counts as never)."""
    hit = np.flatnonzero(np.nan_to_num(smoothed, nan=np.inf) <= target)
    return int(hit[0]) + 1 if hit.size else None


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
        val = [jax.device_put(b) for b in eval_batches(corpus.val, s.batch, s.seq, s.n_eval, vocab_size=256)]
        _CTX[key] = (corpus, graphdef, jax.device_get(params0), eval_fn, val)
    return _CTX[key]


def run_one(s: Settings, opt: str, n_stages: int) -> dict:
    """Train one (optimizer, S) configuration; returns its losses, timings and final losses."""
    corpus, graphdef, params0, eval_fn, val = _context(s)
    cfg = s.config(opt, n_stages)
    fns = build_step_fns(cfg, graphdef, params0)
    params, opt_state = fns.init(jax.tree.map(np.array, params0))  # copies: the step donates its inputs
    data = BatchIterator(corpus.train, s.batch, s.seq, s.seed, vocab_size=cfg.model.vocab_size)
    t0 = time.perf_counter()
    step = fns.compile(params, opt_state, data.batch_at(0))
    compile_s = time.perf_counter() - t0
    losses: list[float] = []
    pending: list[Any] = []
    diverged = False
    t0 = time.perf_counter()
    for k in range(1, s.steps + 1):
        params, opt_state, m = step(params, opt_state, fns.put_batch(data.next()))
        pending.append(m["loss"])
        if k % s.fetch_every == 0 or k == s.steps:
            fetched = [float(v) for v in jax.device_get(pending)]
            losses.extend(fetched)
            pending = []
            if not all(math.isfinite(v) for v in fetched):
                diverged = True  # recorded as never reaching the target
                break
    train_s = time.perf_counter() - t0
    final_val = float("nan") if diverged else float(np.mean([float(eval_fn(params, b)) for b in val]))
    return {"optimizer": opt, "stages": n_stages, "losses": [round(v, 5) for v in losses], "diverged": diverged,
            "compile_s": round(compile_s, 2), "train_s": round(train_s, 2),
            "step_ms": round(1000 * train_s / max(len(losses), 1), 1), "final_val_loss": final_val}


def _run_task(args: tuple[Settings, str, int]) -> dict:
    return run_one(*args)


def run_all(s: Settings, log=print) -> list[dict]:
    """Every (optimizer, S), S = 1 first; `s.jobs > 1` spreads them over spawned processes."""
    todo = [(o, n) for n in sorted(s.stages) for o in s.optimizers]
    runs: list[dict] = []
    t_start = time.perf_counter()

    def report(r: dict) -> None:
        runs.append(r)
        done, elapsed = len(runs), time.perf_counter() - t_start
        last = r["losses"][-1] if r["losses"] else float("nan")
        log(f"[{done}/{len(todo)}] {r['optimizer']:12s} S={r['stages']:<2d} compile {r['compile_s']:5.1f}s "
            f"{r['step_ms']:6.1f} ms/step  loss {last:.3f}{' DIVERGED' if r['diverged'] else ''}  "
            f"val {r['final_val_loss']:.3f}  elapsed {elapsed / 60:.1f} min, "
            f"eta {elapsed / done * (len(todo) - done) / 60:.1f} min")

    if s.jobs <= 1:
        for o, n in todo:
            report(run_one(s, o, n))
    else:
        with ProcessPoolExecutor(s.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_run_task, (s, o, n)) for o, n in todo]
            for f in as_completed(futures):
                report(f.result())
    order = {k: i for i, k in enumerate(todo)}
    return sorted(runs, key=lambda r: order[(r["optimizer"], r["stages"])])


# ----------------------------------------------------------------------------- analysis
def summarize(s: Settings, runs: list[dict], frac: float) -> dict:
    """Target loss at `frac` of the budget; iterations to it and slowdowns (vs own S = 1 and AdamW S = 1)."""
    at = max(1, round(frac * s.steps))
    sm = {(r["optimizer"], r["stages"]): trailing_mean(r["losses"], s.window) for r in runs}
    s1 = {o: c for (o, n), c in sm.items() if n == 1}
    candidates = {o: float(c[at - 1]) for o, c in s1.items() if len(c) >= at and math.isfinite(c[at - 1])}
    if not candidates:
        raise RuntimeError("staleness: every S = 1 run diverged before the target step; fix: lower --lr")
    set_by = max(candidates, key=candidates.get)
    target = candidates[set_by]
    first = {o: steps_to_target(c, target) for o, c in s1.items()}
    ref_adamw = first.get("adamw")
    rows = []
    for r in runs:
        curve = sm[(r["optimizer"], r["stages"])]
        n, own = steps_to_target(curve, target), first.get(r["optimizer"])
        iters = n if n is not None else s.steps  # lower bound when not reached
        rows.append({
            "optimizer": r["optimizer"], "label": OPTIMIZERS[r["optimizer"]][0], "stages": r["stages"],
            "iters_to_target": n, "reached": n is not None, "lower_bound": n is None, "diverged": r["diverged"],
            "slowdown": iters / own if own else None,
            "slowdown_vs_adamw_s1": iters / ref_adamw if ref_adamw else None,
            "final_train_loss": float(curve[-1]) if len(curve) and not r["diverged"] else float("nan"),
            "final_val_loss": r["final_val_loss"], "compile_s": r["compile_s"], "train_s": r["train_s"],
            "step_ms": r["step_ms"],
        })
    return {"target_frac": frac, "target_loss": target, "target_set_by": set_by, "adamw_s1_iters": ref_adamw,
            "rows": rows}


def _slow(row: dict, key: str = "slowdown") -> str:
    v = row[key]
    return "n/a" if v is None else (f">{v:.2f}x" if row["lower_bound"] else f"{v:.2f}x")


def markdown(s: Settings, main: dict, extras: list[dict], wall_s: float, command: str, platform: str,
             reused: Sequence[str] = ()) -> str:
    smax = max(s.stages)
    lines = [
        "# Staleness experiment: iterations to a target loss vs pipeline depth",
        "",
        f"Command: `{command}`  ",
        f"Wall time: {wall_s / 60:.1f} min ({platform}, {s.jobs} worker process(es))"
        + (f"; the runs of {', '.join(reused)} were reused from an earlier identical-settings run (`--reuse`)"
           if reused else "") + ".  ",
        f"Model: dense LLaMA, {s.n_layers} layers, d_model {s.d_model}, {s.n_heads} heads, d_ff {s.d_ff}; "
        f"batch {s.batch} x seq {s.seq} bytes of the stdlib corpus; {s.steps} steps; lr {s.lr:g} "
        "(5 % warmup, cosine to 0.1 lr), betas (0.9, 0.999), wd 0.01, clip 1.0; rotation refresh 10, bilateral, "
        f"2nd-order, Gram EMA β {s.config('rotation', 1).train.rot_beta:g}; PipeDream-LR T_c = {max(1, s.steps // 2)}; Nesterov b1 = 0.99; seed {s.seed}. "
        "Same init and batches for every run. Delay: stage s of S computes its gradient on weights S-1-s "
        "updates old (weight stashing).  ",
        f"Target loss {main['target_loss']:.4f}: the largest S = 1 smoothed training loss (trailing mean of "
        f"{s.window} steps) at {main['target_frac']:.0%} of the budget (set by {main['target_set_by']}"
        + (f"; AdamW S = 1 reaches it at step {main['adamw_s1_iters']}" if main["adamw_s1_iters"] else "")
        + "). Iterations = first step whose smoothed "
        "loss <= target; '> budget' marks runs that never reached it (the slowdown is then a lower bound, "
        "budget / iters(S = 1)); diverged runs count as never reaching it.",
        "",
        "| optimizer | S | iters to target | slowdown vs own S=1 | vs AdamW S=1 | final train loss | final val loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(main["rows"], key=lambda r: (s.optimizers.index(r["optimizer"]), r["stages"])):
        it = str(r["iters_to_target"]) if r["reached"] else f"> {s.steps}" + (" (diverged)" if r["diverged"] else "")
        lines.append(f"| {r['label']} | {r['stages']} | {it} | {_slow(r)} | {_slow(r, 'slowdown_vs_adamw_s1')} | "
                     f"{r['final_train_loss']:.4f} | {r['final_val_loss']:.4f} |")
    lo, hi = PAPER["baselines_slowdown_32"]
    lines += ["", f"## Slowdown from S = 1 to S = {smax}, beside the paper (32 stages)", "",
              "| optimizer | " + " | ".join(f"target @ {e['target_frac']:.0%} ({e['target_loss']:.3f})"
                                             for e in [main, *extras]) + " | paper |",
              "|---|" + "---:|" * (len(extras) + 2)]
    for opt in s.optimizers:
        cells = [_slow(next(r for r in e["rows"] if r["optimizer"] == opt and r["stages"] == smax))
                 for e in [main, *extras]]
        paper = f"{PAPER['rotation_slowdown_32']:.2f}x" if opt.startswith("rotation") else f"{lo}-{hi}x (baselines)"
        lines.append(f"| {OPTIMIZERS[opt][0]} | " + " | ".join(cells) + f" | {paper} |")
    lines += ["", "Easier targets (columns 2+) are the same rule at an earlier fraction of the budget; they "
              "measure larger slowdowns before the budget runs out. The first column is the headline number."]
    if "adamw" in s.optimizers and "pipedream-lr" in s.optimizers:
        lines += ["", "At S = 1 PipeDream-LR is mathematically AdamW (τ = 0); its S = 1 row differs from AdamW's only "
                  "through floating-point rounding in a differently compiled program, a gauge of run-to-run noise."]
    return "\n".join(lines) + "\n"


def plot(s: Settings, main: dict, runs: list[dict], path: pathlib.Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, opt in enumerate(s.optimizers):
        color = f"C{i}"
        rows = sorted((r for r in main["rows"] if r["optimizer"] == opt and r["slowdown"] is not None),
                      key=lambda r: r["stages"])
        ax1.plot([r["stages"] for r in rows], [r["slowdown"] for r in rows], "-", color=color, label=OPTIMIZERS[opt][0])
        for r in rows:
            ax1.plot(r["stages"], r["slowdown"], "^" if r["lower_bound"] else "o", color=color,
                     fillstyle="none" if r["lower_bound"] else "full")
        for r in runs:
            if r["optimizer"] == opt and r["stages"] in (1, max(s.stages)):
                sm = trailing_mean(r["losses"], s.window)
                ax2.plot(np.arange(1, len(sm) + 1), sm, "-" if r["stages"] > 1 else ":", color=color, lw=1.2,
                         label=f"{opt} S={r['stages']}")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(list(s.stages), [str(v) for v in s.stages])
    ax1.set_xlabel("pipeline stages S")
    ax1.set_ylabel("iterations to target / iterations at S=1")
    ax1.set_title(f"(a) slowdown vs S, target @ {main['target_frac']:.0%} (open triangles: lower bounds)", fontsize=10)
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.axhline(main["target_loss"], color="k", lw=0.8, ls="--", label="target")
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"training loss (trailing mean, {s.window} steps)")
    ax2.set_title(f"(b) loss curves, S=1 (dotted) and S={max(s.stages)} (solid)", fontsize=10)
    lows = [float(np.nanmin(trailing_mean(r["losses"], s.window))) for r in runs if r["losses"]]
    ax2.set_ylim(min(lows, default=main["target_loss"]) - 0.05, main["target_loss"] + 1.5)
    ax2.legend(fontsize=7, ncol=2)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _finite_or_none(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    return x


def reusable_runs(s: Settings, path: pathlib.Path, rerun: Sequence[str]) -> list[dict]:
    """Runs from an earlier staleness.json with the same settings, for optimizers not in `rerun`.

    The runs are deterministic (same init, batches and compiled step), so a baseline whose code did
    not change need not be recomputed when only other optimizers change. Every setting but the
    optimizer list and the worker count must match, else ValueError."""
    old = json.loads(pathlib.Path(path).read_text())
    mine = {k: v for k, v in json.loads(json.dumps(asdict(s))).items() if k not in ("optimizers", "jobs")}
    theirs = {k: v for k, v in old["settings"].items() if k not in ("optimizers", "jobs")}
    diff = sorted(k for k in mine if mine[k] != theirs.get(k))
    if diff:
        raise ValueError(f"staleness: --reuse {path} was run with other settings ({', '.join(diff)}); "
                         "fix: rerun everything, or pass the same settings")
    want = {(o, n) for o in s.optimizers if o not in rerun for n in s.stages}
    return [r for r in old["runs"] if (r["optimizer"], r["stages"]) in want]


def run_experiment(s: Settings, out: pathlib.Path, command: str = "", log=print,
                   reuse: pathlib.Path | None = None, rerun: Sequence[str] = ()) -> dict:
    """Run every (optimizer, S), write staleness.{json,md,png} under `out`; returns the JSON object.

    `reuse`: an earlier staleness.json with the same settings; its runs of optimizers not in `rerun`
    are taken as they are (recorded in the output as `reused_from`)."""
    unknown = [o for o in s.optimizers if o not in OPTIMIZERS]
    if unknown:
        raise ValueError(f"staleness: unknown optimizers {unknown}; fix: use some of {', '.join(OPTIMIZERS)}")
    if 1 not in s.stages:
        raise ValueError("staleness: --stages must include 1 (the reference); fix: e.g. --stages 1,4,32")
    bad = [n for n in s.stages if n < 1 or s.n_layers % n]
    if bad:
        raise ValueError(f"staleness: stages {bad} do not divide n_layers={s.n_layers}; fix: use divisors")
    out.mkdir(parents=True, exist_ok=True)
    kept = reusable_runs(s, reuse, rerun) if reuse else []
    have = {(r["optimizer"], r["stages"]) for r in kept}
    todo = tuple(o for o in s.optimizers if any((o, n) not in have for n in s.stages))
    t_start = time.perf_counter()
    fresh = run_all(replace(s, optimizers=todo), log) if todo else []
    wall_s = time.perf_counter() - t_start
    order = {(o, n): i for i, (o, n) in enumerate((o, n) for n in sorted(s.stages) for o in s.optimizers)}
    runs = sorted([*kept, *fresh], key=lambda r: order[(r["optimizer"], r["stages"])])
    main = summarize(s, runs, s.target_frac)
    extras = [summarize(s, runs, f) for f in s.extra_fracs]
    platform = f"{os.cpu_count()} CPU cores, jax {jax.__version__} on {jax.devices()[0].platform}"
    reused = sorted({r["optimizer"] for r in kept})
    result = {"settings": asdict(s), "command": command, "wall_s": round(wall_s, 1), "platform": platform,
              "paper": PAPER, "reused_from": {"file": str(reuse), "optimizers": reused} if kept else None,
              **main, "extra_targets": extras, "runs": runs}
    (out / "staleness.json").write_text(json.dumps(_finite_or_none(result), indent=1) + "\n")
    (out / "staleness.md").write_text(markdown(s, main, extras, wall_s, command, platform, reused))
    plot(s, main, runs, out / "staleness.png")
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="minutes-long smoke version (8 layers, S in 1,4,8, 120 steps)")
    p.add_argument("--out", default="experiments/results", help="folder for staleness.{json,md,png}")
    p.add_argument("--optimizers", help=f"comma list from {','.join(OPTIMIZERS)}")
    p.add_argument("--stages", help="comma list of stage counts (must include 1 and divide --layers)")
    p.add_argument("--extra-fracs", help="comma list of easier target fractions ('' for none)")
    p.add_argument("--reuse", type=pathlib.Path, help="earlier staleness.json (same settings) whose runs to keep")
    p.add_argument("--rerun", default="", help="with --reuse: comma list of optimizers to run again")
    for name, kind in (("layers", int), ("d-model", int), ("heads", int), ("d-ff", int), ("steps", int),
                       ("batch", int), ("seq", int), ("lr", float), ("seed", int), ("window", int),
                       ("target-frac", float), ("n-eval", int), ("jobs", int)):
        p.add_argument(f"--{name}", type=kind)
    args = p.parse_args(argv)
    names = {"layers": "n_layers", "heads": "n_heads"}
    lists = {"optimizers": str, "stages": int, "extra_fracs": float}
    over = {names.get(k, k): v for k, v in vars(args).items() if v is not None and k not in ("quick", "out", "reuse", "rerun", *lists)}
    for k, kind in lists.items():
        if getattr(args, k) is not None:
            over[k] = tuple(kind(x.strip()) for x in getattr(args, k).split(",") if x.strip())
    s = replace(QUICK if args.quick else Settings(), **over)
    command = " ".join(["python experiments/staleness.py", *(sys.argv[1:] if argv is None else argv)])
    rerun = tuple(x.strip() for x in args.rerun.split(",") if x.strip())
    result = run_experiment(s, pathlib.Path(args.out), command, reuse=args.reuse, rerun=rerun)
    print((pathlib.Path(args.out) / "staleness.md").read_text())
    return result


if __name__ == "__main__":
    main()
