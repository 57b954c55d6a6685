"""Single-device training-step speed of dense LLaMA vs CoLA, SVD and LaX, and where the time goes.

Every model runs the package's real training step (`boostjax.training.step.build_step_fns`: forward,
backward, clipped AdamW, fp32 parameters, `--dtype` compute), compiled ahead of time. After
`--warmup` untimed steps per model, `--rounds` interleaved rounds run one step of every model in
turn (A, B, C, D, A, B, ...), each ended by `block_until_ready`; per model the median step time
gives tokens/s and achieved model GFLOP/s (`boostjax.models.flops.flops_per_token`, PaLM
convention), and the ratio to dense is taken per round (neighbouring steps see the same load) and
summarised by its median and quartiles.

The breakdown (on unless `--no-breakdown`) profiles a few steps of every model of the first shape with
`jax.profiler` and attributes each executed HLO op (thunk) to the part of the model that emitted
it (from the compiled HLO's stack frames): the table says where dense and CoLA spend their time.
`cola-btgr` is CoLA compiled with the grouped up-projection's former layout (`stacked_grouped_up`),
timed in the same rounds: the before/after of the layout fix. `llama-head-inplace` / `cola-head-inplace`
compute the LM head with `ops.matmul`, whose weight gradient reads the activations in place (an Eigen GEMM
on XLA's CPU backend), where `ops.wide_matmul` reads a transposed copy (a YNN one).

    python -m experiments.speed.lowrank_speed                          # the definitive run (~4 min quiet)
    python -m experiments.speed.lowrank_speed --shapes 60m --rounds 2 --warmup 1 --no-breakdown --layers 2
                                                                 # smoke run (seconds)

Writes experiments/results/lowrank_speed.{json,md,png}.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time

from experiments import common

KINDS = ("llama", "cola", "svd", "lax", "cola-btgr", "llama-head-inplace", "cola-head-inplace")
NAMES = {"llama": "dense", "cola": "CoLA", "svd": "SVD", "lax": "LaX", "cola-btgr": "CoLA, former layout",
         "llama-head-inplace": "dense, former head gradient", "cola-head-inplace": "CoLA, former head gradient"}

NOTES = [
    "- **Grouped up-projections (CoLA-specific, fixed).** `b_kv` and `b_gate_up` ran as `btgr,grk->btgk` with "
    "the group axis in the middle of the stacked latents. A dot's batch axes must be its major ones, so XLA "
    "transposed the stacked latents, the outputs and both gradients around every one of these GEMMs: the former "
    "program's top element-wise ops are `[4,256,2,1376]` pad+transpose fusions (gradients of the `gu[:, :, i]` "
    "slices) and `[2,1376,1024]` copy+transpose fusions. `boostjax.models.llama.grouped_up` now stacks along a "
    "leading group axis (`gbtr,grk->gbtk`): no transposes, the unstack is a contiguous slice. The stored "
    "layout (`b_kv [2, r, k*e]`, `b_gate_up [2, r, f]`), hence checkpoints, HF export, TP specs and the rotation "
    "optimizer's GROUP_AXIS, is unchanged, and every strategy still sends one `reduce_up` per group. "
    "The `CoLA, former layout` row is that old program, timed in the same rounds.",
    "- **RoPE tables (shared, fixed).** `cos`/`sin` of a traced angle table were fused into, and recomputed by, "
    "every consumer (XLA CPU fusions with `cosine`/`sine` around each q/k transpose, forward and backward). "
    "`ops.rope_tables` now computes them on the host (static shapes), so they are constants of the program; "
    "this helps dense and low-rank alike.",
    "- **Tried, not kept** (CPU time per step, interleaved, shared machine): the group split into separate 2-D "
    "GEMMs (slower than the leading-group batched GEMM), scaling `A`'s rows by the norm gain instead of the "
    "activations in `online_norm_down` (about 1 %, within the noise), and XLA CPU without its YNNPACK dot "
    "fusions (`xla_cpu_experimental_ynn_fusion_type=''`: CoLA about 5 % slower). Probes in one process with "
    "interleaved rounds (ms per step, dense / CoLA, against the unchanged step in the same rounds): every "
    "weight gradient as a plain GEMM on a transposed copy of the activations (906 / 580 against 899 / 556), "
    "XLA's concurrency-optimised scheduler (906 / 557 against 919 / 566: both about 1.5 % faster, the ratio "
    "unchanged), a fused cross-entropy with its own backward (the loss's element-wise work costs the step "
    "under 10 ms: replacing it by a mean changed dense 909 -> 912 and CoLA 588 -> 580), and the LM head "
    "stored `[vocab, d]` (1.4x faster alone, no change in the step).",
    "- **Scratch memory kept (shared, fixed).** XLA's CPU runtime mallocs each step's temporary buffer "
    "(622 MiB at 60m) on a worker thread and frees it after the step; glibc served it with a fresh `mmap`, so "
    "every step faulted it in again (169,000 page faults, 0.25 s of system time per step). A training process "
    "keeps it (`boostjax.runtime.allocator`); this script sets it up as training does. With glibc's default "
    "(`BOOSTJAX_KEEP_SCRATCH=0 ... --shapes 60m --no-breakdown --out experiments/results/glibc_default`): "
    "dense 1018 ms, CoLA 681 ms, 1.50x (the same day as the table above). It helps CoLA more: its "
    "element-wise ops and small GEMMs wrote "
    "fresh pages at a higher rate.",
    "- **Row-blocked attention (shared, fixed).** At t <= `--attention-block` the chunked path ran the "
    "materialised reference; `attention.row_blocked_attention` skips the tiles above the diagonal and has "
    "its own backward, which reads the exp-scores saved transposed so that every backward GEMM reads its "
    "left operand row-major (XLA's CPU backend runs a dot contracting its left operand's rows as an Eigen "
    "GEMM, not a YNN one): the attention core 1.85x faster than the reference on two cores "
    "(`attention_speed.md`).",
    "- **The LM head's weight gradient from a transposed copy (shared, fixed).** `x^T dy` for the head "
    "(`512 x 1024 x 8192` at 60m) ran as an Eigen GEMM: on an AVX2 CPU (AMD EPYC, Zen 3) at about half the speed "
    "of the head's forward YNN GEMM (`gemm_peak.md`'s `grad head` rows). `ops.wide_matmul` computes it on a "
    "transposed copy of the activations, a YNN GEMM; the `former head gradient` rows are the previous program "
    "in the same rounds. Only the head: for the narrower weight gradients the copy does not pay.",
    "- **What is left** is in the table above: the attention core and the LM head + loss cost dense and "
    "low-rank the same; the low-rank GEMMs (inner or outer dimension r = 128) reach fewer GFLOP/s than the "
    "dense ones; on two cores XLA runs independent GEMMs side by side, each with half the pool, and CoLA has "
    "more, smaller ops, so CoLA gains less from the second core (1 core: see `vs_transformers_1core.md`). "
    "The weight gradients (`x^T dy`, Eigen GEMMs here) gain least from it, dense and low-rank alike, the "
    "128-row factor-B gradient least of all (the `grad` rows of `gemm_peak.md`).",
]


def stacked_grouped_up(hs, b_grk, coll):
    """The grouped up-projection as it was before this benchmark (group axis in the middle,
    `btgr,grk->btgk`): compiled for the `cola-btgr` row, so before and after share the rounds."""
    import jax.numpy as jnp

    y_btgk = coll.reduce_up(jnp.einsum("btgr,grk->btgk", jnp.stack(hs, 2), b_grk))
    return tuple(y_btgk[:, :, i] for i in range(len(hs)))


# ---------------------------------------------------------------------------------------------
# building and timing the real training step


def build(kind: str, shape: str, args: argparse.Namespace):
    """(compiled step, training state, batch, model config, compile seconds) for one model kind."""
    import numpy as np

    from boostjax.config import Config, TrainConfig, preset
    from boostjax.training.checks import validate
    from boostjax.models import llama
    from boostjax.training.step import build_step_fns
    from boostjax.models.llama import init_model

    from boostjax.models import ops

    former = {"cola-btgr": ("cola", llama, "grouped_up", stacked_grouped_up),
              "llama-head-inplace": ("llama", ops, "wide_matmul", ops.matmul),
              "cola-head-inplace": ("cola", ops, "wide_matmul", ops.matmul)}
    if kind in former:  # the model compiled with a former implementation, for before/after in the same rounds
        base, module, attr, old = former[kind]
        fast = getattr(module, attr)
        setattr(module, attr, old)
        try:
            return build(base, shape, args)
        finally:
            setattr(module, attr, fast)
    overrides = {"kind": kind, "max_seq_len": args.seq, "vocab_size": args.vocab}
    if args.layers:
        overrides["n_layers"] = args.layers
    model = preset(shape, **overrides)
    cfg = validate(Config(model, TrainConfig(batch=args.batch, seq=args.seq, dtype=args.dtype, steps=1000,
                                             warmup=0, out="unused")))
    graphdef, params = init_model(cfg)
    fns = build_step_fns(cfg, graphdef, params)
    train_state = fns.init(params)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, (args.batch, args.seq + 1), dtype=np.int32)
    batch = fns.put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    t0 = time.perf_counter()
    step = fns.compile(train_state, batch)
    return step, train_state, batch, model, time.perf_counter() - t0


def run_shape(shape: str, kinds: list[str], args: argparse.Namespace) -> dict:
    """Interleaved timed rounds of every kind on one preset shape."""
    import jax

    from boostjax.models.flops import flops_per_token, param_count

    state, info = {}, {}
    for kind in kinds:
        step, ts, batch, model, compile_s = build(kind, shape, args)
        for _ in range(args.warmup):
            ts, m = step(ts, batch)
        jax.block_until_ready(ts)
        state[kind] = [step, ts, batch]
        info[kind] = {"params": param_count(model), "flops_per_token": flops_per_token(model, args.seq),
                      "compile_s": compile_s, "model": {k: getattr(model, k) for k in (
                          "d_model", "n_layers", "n_heads", "d_ff", "rank", "vocab_size")}}

    def one_step(entry: list) -> None:  # [step, train state, batch]: the state advances
        step, ts, batch = entry
        entry[1] = jax.block_until_ready(step(ts, batch))[0]

    rounds = common.interleaved({k: functools.partial(one_step, state[k]) for k in kinds}, args.rounds)
    wall, cpu, others = rounds.wall, rounds.cpu, rounds.others
    tokens = args.batch * args.seq
    runs = {}
    for kind in kinds:
        step_s = statistics.median(wall[kind])
        r = {**info[kind], "step_ms": 1e3 * step_s, "step_ms_all": [1e3 * t for t in wall[kind]],
             "cpu_ms": 1e3 * statistics.median(cpu[kind]), "tokens_per_s": tokens / step_s,
             "gflops_per_s": info[kind]["flops_per_token"] * tokens / step_s / 1e9}
        if "llama" in kinds:
            per_round = sorted(d / t for d, t in zip(wall["llama"], wall[kind]))
            q = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else per_round * 3
            r.update(speedup=statistics.median(per_round), speedup_q1=q[0], speedup_q3=q[2],
                     speedup_of_medians=statistics.median(wall["llama"]) / step_s,
                     flop_ratio=info["llama"]["flops_per_token"] / info[kind]["flops_per_token"])
        runs[kind] = r
    bd = None
    if args.breakdown_here:
        bd = {kind: op_breakdown(*state[kind], args.profile_steps) for kind in kinds}
    del state
    return {"shape": shape, "rounds": args.rounds, "runs": runs, "other_runnable_tasks_median": statistics.median(others),
            "other_runnable_tasks_max": max(others), "breakdown": bd}


# ---------------------------------------------------------------------------------------------
# where the time goes: profiler events attributed to model parts through the HLO's stack frames

# (function name in the stack, part) — the innermost match wins
PARTS = (
    ("causal_attention", "attention core (scores, softmax, PV)"),
    ("apply_rope", "RoPE"), ("rope_tables", "RoPE"),
    ("online_norm_down", "low-rank A (Online-RMSNorm down-projection)"),
    ("grouped_up", "low-rank grouped B (k,v / gate,up)"),
    ("stacked_grouped_up", "low-rank grouped B (k,v / gate,up)"),
    ("embed_lookup", "embedding"),
    ("vocab_parallel_cross_entropy", "LM head + loss"), ("LLaMA.logits", "LM head + loss"),
    ("rms_norm", "RMSNorm"),
    ("MLP.__call__", "MLP other (projections, SiLU·up)"),
    ("Attention.__call__", "attention other (projections)"),
    ("Block.__call__", "residual adds"),
)


def _hlo_tables(text: str):
    """(instruction -> (opcode, shape, op_name, stack frame id, called computation),
    computation -> opcodes, frame id -> (function names innermost first, files))."""
    files, funcs, locs, frames = {}, {}, {}, {}
    section = None
    insts, comps, cur = {}, {}, None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if section and line and line[0].isdigit():
            idx, rest = line.split(" ", 1)
            if section == "FileNames":
                files[int(idx)] = rest.strip('"')
            elif section == "FunctionNames":
                funcs[int(idx)] = rest.strip('"')
            elif section == "FileLocations":
                m = re.search(r"file_name_id=(\d+) function_name_id=(\d+)", rest)
                locs[int(idx)] = (int(m.group(1)), int(m.group(2)))
            else:
                m = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", rest)
                frames[int(idx)] = (int(m.group(1)), int(m.group(2)))
            continue
        section = None
        if line and not line.startswith(" ") and line.endswith("{"):
            cur = line.split(" ", 2)[1 if line.startswith("ENTRY") else 0].lstrip("%")
            comps[cur] = []
            continue
        m = re.match(r"\s+(?:ROOT )?%([\w.\-]+) = (\S+) ([\w\-]+)\(", line)
        if m:
            name, shape, op = m.groups()
            opn = re.search(r'op_name="([^"]*)"', line)
            sf = re.search(r"stack_frame_id=(\d+)", line)
            called = re.search(r"calls=%([\w.\-]+)", line)
            insts[name] = (op, shape, opn.group(1) if opn else "", int(sf.group(1)) if sf else 0,
                           called.group(1) if called else None)
            if cur is not None:
                comps[cur].append(op)

    def chain(fid: int) -> tuple[list[str], list[str]]:
        names, fnames, seen = [], [], set()
        while fid in frames and fid not in seen:
            seen.add(fid)
            loc, parent = frames[fid]
            f, fn = locs.get(loc, (0, 0))
            names.append(funcs.get(fn, ""))
            fnames.append(files.get(f, ""))
            fid = parent
        return names, fnames

    return insts, comps, chain


def _part(names: list[str], fnames: list[str]) -> str:
    if any("optax" in f for f in fnames):
        return "optimizer (clip + AdamW)"
    for fn in names:  # innermost first
        for key, part in PARTS:
            if fn == key or fn.startswith(key + ".<locals>"):
                return part
    return "other"


def _kind_of(op: str, called: str | None, comps: dict) -> str:
    body = comps.get(called, []) if op == "fusion" else [op]
    if any(o in ("dot", "convolution") for o in body):
        return "GEMM"
    if any(o in ("transpose", "copy") for o in body) and not any(
            o in ("exponential", "multiply", "add", "divide", "subtract", "reduce") for o in body):
        return "copy/transpose"
    if any(o in ("transpose", "copy") for o in body):
        return "elementwise+transpose"
    return "elementwise/other"


def op_breakdown(step, ts, batch, n_steps: int) -> dict:
    """Per model part and op kind: ms of op time per step (summed over the executor's threads)."""
    import jax
    from jax.profiler import ProfileData

    insts, comps, chain = _hlo_tables(step.as_text())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(n_steps):
                ts, m = step(ts, batch)
                jax.block_until_ready((ts, m))
        pd = ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
        events = [(ev.name, ev.duration_ns) for plane in pd.planes for line in plane.lines
                  for ev in line.events if ev.name in insts]
    by_part = collections.Counter()
    by_kind = collections.Counter()
    by_op = collections.Counter()
    for name, ns in events:
        op, shape, op_name, sf, called = insts[name]
        ms = ns / 1e6 / n_steps
        part = _part(*chain(sf))
        kind = _kind_of(op, called, comps)
        direction = "bwd" if "transpose(" in op_name else "fwd"
        by_part[part] += ms
        by_kind[(part, kind)] += ms
        by_op[(name, shape, part, kind, direction)] += ms
    counts = collections.Counter(o for body in comps.values() for o in body)
    return {"total_ms": sum(by_part.values()),
            "by_part": dict(by_part.most_common()),
            "by_part_kind": [{"part": p, "kind": k, "ms": v} for (p, k), v in by_kind.most_common()],
            "top_ops": [{"op": n, "shape": s, "part": p, "kind": k, "dir": dr, "ms": v}
                        for (n, s, p, k, dr), v in by_op.most_common(15)],
            "hlo_counts": {o: counts[o] for o in ("dot", "transpose", "copy", "fusion", "pad", "concatenate")}}


# ---------------------------------------------------------------------------------------------
# report


def markdown(res: dict) -> str:
    a, mf = res["args"], res["machine"]
    lines = ["# Low-rank training-step speed on one device: dense vs CoLA, SVD, LaX", "",
             f"Command: `{res['command']}` (wall time {res['runtime_s']:.0f} s).", "",
             f"Real training step (`boostjax.training.step.build_step_fns`: forward, backward, clip 1.0 + AdamW, fp32 "
             f"parameters, {a['dtype']} compute), batch {a['batch']} x sequence {a['seq']}, vocabulary {a['vocab']}, "
             f"compiled ahead of time; {a['warmup']} untimed warm-up step(s) per model, then interleaved rounds ("
             + ", ".join(f"{x['shape']}: {x['rounds']}" for x in res["shapes"]) + "; one step of every model per "
             "round, each ended by `block_until_ready`). Step ms and tokens/s "
             "are medians over rounds; `x dense` is the median (and quartiles) of the per-round ratio "
             "dense step time / model step time; GFLOP/s counts model FLOPs (PaLM convention, `flops.py`).", "",
             f"Machine: {mf['cpu_model'] or 'unknown CPU'}, {mf['cpus_usable']} usable CPUs, {mf['platform']}, "
             f"jax {mf['jax']}, {common.allocation_text(mf)}; load average at start {mf['loadavg_start'][0]:.1f}, at end "
             f"{mf['loadavg_end'][0]:.1f}; other runnable tasks per round (median / max): "
             + ", ".join(f"{s['shape']} {s['other_runnable_tasks_median']:.0f} / {s['other_runnable_tasks_max']}"
                         for s in res["shapes"]) + ".", ""]
    if common.was_shared(res["shapes"], mf):
        lines += ["**The machine was shared** (other processes were runnable while this ran): absolute "
                  "times are inflated and noisy; the per-round ratios are the more robust figures.", ""]
    for s in res["shapes"]:
        m0 = next(iter(s["runs"].values()))["model"]
        lines += [f"## {s['shape']} (d {m0['d_model']}, {m0['n_layers']} layers, {m0['n_heads']} heads, "
                  f"d_ff {m0['d_ff']}, r {m0['rank']}, vocab {m0['vocab_size']})", "",
                  "| model | params | MFLOP/token | step ms | tokens/s | GFLOP/s | x dense (q1-q3) | FLOP ratio | "
                  "CPU ms/step | compile s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for kind, r in s["runs"].items():
            sp = (f"{r['speedup']:.2f} ({r['speedup_q1']:.2f}-{r['speedup_q3']:.2f})" if "speedup" in r else "")
            fr = f"{r['flop_ratio']:.2f}" if "flop_ratio" in r else ""
            lines.append(f"| {NAMES[kind]} | {r['params'] / 1e6:.1f}M | {r['flops_per_token'] / 1e6:.1f} | "
                         f"{r['step_ms']:.0f} | {r['tokens_per_s']:.0f} | {r['gflops_per_s']:.0f} | {sp} | {fr} | "
                         f"{r['cpu_ms']:.0f} | {r['compile_s']:.1f} |")
        lines.append("")
    if res.get("breakdown"):
        bd = res["breakdown"]
        kinds = list(bd)
        lines += [f"## Where the step time goes ({res['shapes'][0]['shape']}, profiled)", "",
                  f"`jax.profiler` trace of {a['profile_steps']} steps per model; every executed HLO op is "
                  "attributed to the model part that emitted it (the compiled HLO's stack frames). ms = op time "
                  "per step summed over the executor's threads (so it can exceed the wall step time).", "",
                  "| part | " + " | ".join(f"{NAMES[k]} ms" for k in kinds) + " |",
                  "|---|" + "---|" * len(kinds)]
        parts = sorted({p for k in kinds for p in bd[k]["by_part"]}, key=lambda p: -bd[kinds[0]]["by_part"].get(p, 0))
        for p in parts:
            lines.append(f"| {p} | " + " | ".join(f"{bd[k]['by_part'].get(p, 0):.1f}" for k in kinds) + " |")
        lines.append("| **total** | " + " | ".join(f"**{bd[k]['total_ms']:.1f}**" for k in kinds) + " |")
        lines += ["", "HLO op counts in the compiled step: " + "; ".join(
            f"{NAMES[k]} " + ", ".join(f"{o} {n}" for o, n in bd[k]["hlo_counts"].items()) for k in kinds) + ".", ""]
        for k in kinds:
            lines += [f"Top ops, {NAMES[k]}:", "", "| op | shape | part | kind | dir | ms |", "|---|---|---|---|---|---|"]
            lines += [f"| {o['op']} | `{o['shape']}` | {o['part']} | {o['kind']} | {o['dir']} | {o['ms']:.1f} |"
                      for o in bd[k]["top_ops"][:8]]
            lines.append("")
    if res.get("notes"):
        lines += ["## Findings (written when the fix was made; this run does not recompute them)", "", *res["notes"], ""]
    return "\n".join(lines) + "\n"


def plot(res: dict):
    """Tokens/s per model and shape (a matplotlib Figure)."""
    shapes = res["shapes"]
    fig, axes = common.subplots(len(shapes), (4.5 * len(shapes), 3.6))
    axes = axes if len(shapes) > 1 else [axes]
    for ax, s in zip(axes, shapes):
        kinds = list(s["runs"])
        vals = [s["runs"][k]["tokens_per_s"] for k in kinds]
        bars = ax.bar([NAMES[k].replace(", ", "\n") for k in kinds], vals, color=["0.5"] + ["C0"] * (len(kinds) - 1))
        for b, k in zip(bars, kinds):
            r = s["runs"][k]
            if "speedup" in r and k != "llama":
                ax.annotate(f"{r['speedup']:.2f}x\n(FLOPs {r['flop_ratio']:.2f}x)", (b.get_x() + b.get_width() / 2,
                            b.get_height()), ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, max(vals) * 1.3)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylabel("tokens/s (median)")
        ax.set_title(s["shape"])
    fig.suptitle("Training step on one device" + (" (shared machine)" if common.was_shared(res["shapes"], res["machine"]) else ""))
    fig.tight_layout()
    return fig


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="60m,130m", help="comma-separated presets (default: 60m,130m)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)} (default: all)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default: 8192)")
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (default: 4)")
    ap.add_argument("--seq", type=int, default=256, help="sequence length (default: 256)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per model after compiling (default: 1)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="timed rounds per shape (default 0: 10 for the first shape, 3 for the others)")
    ap.add_argument("--profile-steps", type=int, default=2, help="steps traced for the breakdown (default: 2)")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the profiled op breakdown")
    common.add_out(ap, "lowrank_speed")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser()
    args = ap.parse_args(argv)
    if args.from_json:  # the findings are this script's, not the run's
        common.rerender(args, "lowrank_speed", md=lambda res: markdown({**res, "notes": NOTES}),
                        figure=lambda res: plot(res))
        return 0
    if min(args.batch, args.seq, args.vocab, args.profile_steps) < 1 or min(args.warmup, args.rounds, args.layers) < 0:
        ap.error("--batch, --seq, --vocab, --profile-steps must be >= 1; --warmup, --rounds, --layers >= 0")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds) or len(set(kinds)) != len(kinds):
        ap.error(f"--kinds: use a subset of {','.join(KINDS)}")
    if "llama" in kinds:  # dense first: it is the reference of every ratio
        kinds = ["llama"] + [k for k in kinds if k != "llama"]
    from boostjax.config import PRESETS

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if not shapes or any(s not in PRESETS for s in shapes):
        ap.error(f"--shapes: use presets from {','.join(PRESETS)}")

    common.keep_scratch()  # as a training process does, before JAX starts
    t_start = time.perf_counter()
    machine = common.machine_facts()
    results = []
    for i, shape in enumerate(shapes):
        a = argparse.Namespace(**vars(args))
        a.rounds = args.rounds or (10 if i == 0 else 3)
        a.breakdown_here = i == 0 and not args.no_breakdown
        results.append(run_shape(shape, kinds, a))
        print(json.dumps({s: round(r["tokens_per_s"]) for s, r in results[-1]["runs"].items()}), shape, flush=True)
    bd = results[0].pop("breakdown")
    for r in results[1:]:
        r.pop("breakdown")
    machine["loadavg_end"] = list(os.getloadavg())
    res = {"args": vars(args), "command": common.command_line("lowrank_speed", argv),
           "machine": machine, "shapes": results, "breakdown": bd,
           "notes": NOTES, "runtime_s": time.perf_counter() - t_start}
    common.write(args.out, "lowrank_speed", data=res, md=lambda: markdown(res), figure=lambda: plot(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
