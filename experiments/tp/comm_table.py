"""BOOST's communication table, measured from compiled HLO (no model is allocated).

For 1B (TP4), 3B (TP2), 7B (TP4) and 13B (TP4) — micro-batch 4, sequence 4096, bf16, the LLaMA-2
vocabulary of 32000 (BOOST's yamls; per-layer figures do not depend on it) — compiles one
training step and the forward loss of full-rank Megatron TP (dense LLaMA), vanilla low-rank TP and
BTP (CoLA) on simulated CPU devices, and writes

  experiments/results/comm_table.json   every `comm_report`
  experiments/results/comm_table.md     per-layer all-reduce volume beside BOOST's 7B figures,
                                        collectives per layer, GEMM reduction dims / intensity,
                                        and the remat check (7B BTP)
  experiments/results/comm_table.png    bar chart

Run: `python -m experiments.tp.comm_table` (several minutes on a laptop; over an hour on a shared 2-core
machine; `--presets 1b` for one; `--vocab 256` for the byte vocabulary of the committed results;
`--from-json experiments/results/comm_table.json` re-renders the table and chart without compiling).
"""

from __future__ import annotations

import argparse
import sys
import time

from boostjax.runtime.devices import exact_low_precision, simulate_devices

from experiments import common
from experiments.common import log
from experiments.tp.strategy_bars import strategy_bars

simulate_devices(4)  # before JAX starts: the largest model axis below
exact_low_precision()  # bf16 collectives stay bf16 in the HLO we count

from boostjax.config import preset  # noqa: E402
from boostjax.analysis.comm import STRATEGIES, comm_report  # noqa: E402
from boostjax.analysis.memory import GIB  # noqa: E402

SETUPS = {"1b": 4, "3b": 2, "7b": 4, "13b": 4}  # preset -> TP size
BATCH, SEQ, DTYPE, VOCAB = 4, 4096, "bfloat16", 32000
BYTE_VOCAB = 256  # what runs before the vocabulary was recorded used (the presets' byte-level default)
PAPER_7B = {"fullrank-tp": 0.25, "vanilla-tp": 1.32, "btp": 0.22}  # BOOST's README, GB per layer, forward, one direction
NAMES = {"fullrank-tp": "full-rank TP", "vanilla-tp": "vanilla low-rank TP", "btp": "BTP"}


def measure(presets: list[str], vocab: int = VOCAB) -> dict:
    out: dict = {"setup": {"batch": BATCH, "seq": SEQ, "dtype": DTYPE, "model": "cola", "vocab": vocab},
                 "runs": {}, "remat": {}}
    for name in presets:
        tp = SETUPS[name]
        mesh = f"data=1,model={tp}"
        runs = {}
        for strategy in STRATEGIES:
            t0 = time.perf_counter()
            runs[strategy] = comm_report(preset(name, kind="cola", vocab_size=vocab), mesh, BATCH, SEQ, strategy, dtype=DTYPE)
            r = runs[strategy]
            log(f"{name} TP{tp} {strategy:<12} fwd {r['forward_allreduce_bytes_per_layer'] / GIB:.4f} GiB/layer, "
                f"step {r['allreduce_bytes_per_layer'] / GIB:.4f} GiB/layer, "
                f"{r['forward_allreduce_count_per_layer']} AR/layer fwd ({time.perf_counter() - t0:.0f} s)")
        out["runs"][name] = runs
    if "7b" in presets:  # communication-free low-rank checkpointing vs none / full recompute
        for remat in ("lowrank", "full"):
            t0 = time.perf_counter()
            out["remat"][remat] = comm_report(preset("7b", kind="cola", vocab_size=vocab), "data=1,model=4", BATCH, SEQ, "btp",
                                              remat=remat, dtype=DTYPE)
            log(f"7b btp remat={remat} ({time.perf_counter() - t0:.0f} s)")
        out["remat"]["none"] = out["runs"]["7b"]["btp"]
    return out


def _gib(x: float) -> str:
    return f"{x / GIB:.4f}"


def markdown(res: dict) -> str:
    s = res["setup"]
    vocab = s.get("vocab", BYTE_VOCAB)
    vname = "the LLaMA-2 vocabulary" if vocab == 32000 else ("the BYTE vocabulary" if vocab == BYTE_VOCAB else "vocabulary")
    lines = [
        "# Communication per transformer layer, from compiled HLO",
        "",
        f"Micro-batch {s['batch']}, sequence {s['seq']}, {s['dtype']}, {vname} ({vocab} tokens; the per-layer "
        "figures do not depend on it, the whole-step rows do), one data-parallel replica (`data=1`); "
        "CoLA for the low-rank strategies, the dense LLaMA of the same shapes for full-rank TP. "
        "Bytes are per device and one direction (what each all-reduce carries), GiB = 2^30; bf16 "
        "collectives are counted at bf16 (the CPU backend widens them to f32 before the all-reduce: "
        "`*_bytes_compiled` in the JSON). Per-layer = exact difference of the 2-layer and 1-layer programs. "
        "BOOST's 7B column: the 'Communication Efficiency (LLaMA-7B, Batch Size = 4, Seq Length = 4096)' table of "
        "BOOST's README (https://github.com/Arcana-2236/BOOST; ~0.25 / ~1.32 / ~0.22 GB), read as forward GB per layer.",
        "",
        "| model | TP | strategy | fwd GiB/layer | BOOST README 7B fwd 'GB'/layer | step GiB/layer | fwd × full | "
        "step × full | vanilla ÷ this (fwd) | all-reduces/layer fwd | all-reduces/layer step | analytic fwd GiB/layer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in res["runs"].items():
        full, van = runs["fullrank-tp"], runs["vanilla-tp"]
        for strategy, r in runs.items():
            fwd, step = r["forward_allreduce_bytes_per_layer"], r["allreduce_bytes_per_layer"]
            paper = f"{PAPER_7B[strategy]:.2f}" if name == "7b" else ""
            lines.append(
                f"| {name} | {r['tp']} | {NAMES[strategy]} | {_gib(fwd)} | {paper} | {_gib(step)} | "
                f"{fwd / full['forward_allreduce_bytes_per_layer']:.3f} | {step / full['allreduce_bytes_per_layer']:.3f} | "
                f"{van['forward_allreduce_bytes_per_layer'] / fwd:.2f} | {r['forward_allreduce_count_per_layer']} | "
                f"{r['allreduce_count_per_layer']} | {_gib(r['expected_per_layer']['forward_bytes'])} |")
    if "7b" in res["runs"]:
        m = preset("7b")
        lines += ["", f"Check: BTP's 7r latents at 7B, 7·r·B·S·2 bytes = 7·{m.rank}·{BATCH}·{SEQ}·2 = "
                      f"{7 * m.rank * BATCH * SEQ * 2 / GIB:.4f} GiB (+ two fp32 norm statistics per token, "
                      f"{2 * 4 * BATCH * SEQ / GIB:.6f} GiB)."]
    lines += ["", f"## Whole step (all layers, embedding, LM head, cross-entropy, optimizer), vocabulary {vocab}", "",
              "| model | strategy | all-reduces | all-reduce GiB | fwd all-reduces | fwd GiB | other collectives | "
              "temp GiB (CPU) |", "|---|---|---|---|---|---|---|---|"]
    for name, runs in res["runs"].items():
        for strategy, r in runs.items():
            other = ", ".join(f"{k} ×{v['count']} ({_gib(v['bytes'])} GiB)" for k, v in r["other_collectives"].items())
            lines.append(f"| {name}, V={vocab} | {NAMES[strategy]} | {r['allreduce_count']} | {_gib(r['allreduce_bytes'])} | "
                         f"{r['forward_allreduce_count']} | {_gib(r['forward_allreduce_bytes'])} | {other or '-'} | "
                         f"{r['temp_bytes'] / GIB:.1f} |")
    lines += ["", "## Layer GEMMs (forward): reduction dimension K and arithmetic intensity", "",
              "Projection GEMMs of one block (attention's q·k and p·v excluded); intensity = 2·M·N·K / bytes of "
              "both operands and the result, in bf16.", "",
              "| model | strategy | K of the layer GEMMs | mean FLOP/byte | FLOP-weighted FLOP/byte |",
              "|---|---|---|---|---|"]
    for name, runs in res["runs"].items():
        for strategy, r in runs.items():
            g = r["gemms"]
            ks = ", ".join(f"{k}×{g['projection_k'].count(k)}" for k in sorted(set(g["projection_k"])))
            lines.append(f"| {name} | {NAMES[strategy]} | {ks} | {g['mean_intensity']:.0f} | "
                         f"{g['flop_weighted_intensity']:.0f} |")
    lines += ["", "## Backward all-reduce volume per layer (elements per token)", "",
              "Step minus forward, per token, in units of d (full-rank, vanilla) or r (BTP); the optimizer's "
              "global-norm scalars excluded. Megatron's full-rank backward is 2·d; the paper's targets per "
              "step are 4·d (full-rank), 2·(5d + 2f) (vanilla) and 2·7r (BTP).", "",
              "| model | strategy | backward elements / token | forward elements / token |", "|---|---|---|---|"]
    item = 2 if s["dtype"] == "bfloat16" else 4
    for name, runs in res["runs"].items():
        for strategy, r in runs.items():
            m = r["model"]
            tokens = r["batch"] * r["seq"]  # data=1
            unit, sym = (m["rank"], "r") if strategy == "btp" else (m["d_model"], "d")
            bwd = (r["backward_allreduce_bytes_per_layer"] - r["allreduce_scalar_bytes_per_layer"]) / tokens / item
            fwd = r["expected_per_layer"]["forward_elements_per_token"]
            lines.append(f"| {name} | {NAMES[strategy]} | {bwd / unit:.3f} {sym} | {fwd / unit:.3f} {sym} |")
    if res["remat"]:
        lines += ["", f"## Remat at 7B (BTP, TP4), whole step, vocabulary {vocab}", "",
                  "| remat | all-reduces | all-reduce GiB | all-reduces/layer | saved for backward GiB/device | "
                  "temp GiB (CPU) |", "|---|---|---|---|---|---|"]
        for remat in ("none", "lowrank", "full"):
            r = res["remat"][remat]
            lines.append(f"| {remat} | {r['allreduce_count']} | {_gib(r['allreduce_bytes'])} | "
                         f"{r['allreduce_count_per_layer']} | {r['residual_bytes'] / GIB:.2f} | "
                         f"{r['temp_bytes'] / GIB:.1f} |")
    return "\n".join(lines) + "\n"


def chart(res: dict):
    """The bar chart (a matplotlib Figure)."""
    names = list(res["runs"])
    labels = [f"{n.upper()} TP{res['runs'][n]['btp']['tp']}" for n in names]
    fig, axes = common.subplots(2, (11, 4))
    for ax, key, title in ((axes[0], "forward_allreduce_bytes_per_layer", "forward, per layer"),
                           (axes[1], "allreduce_bytes_per_layer", "forward + backward, per layer")):
        bars = {s: [res["runs"][n][s][key] / GIB for n in names] for s in STRATEGIES}
        ticks = ({s: [PAPER_7B[s] if n == "7b" else None for n in names] for s in STRATEGIES}
                 if key.startswith("forward") else None)
        strategy_bars(ax, labels, bars, NAMES, ticks=ticks, tick_label="BOOST 7B (README)",
                      ylabel="all-reduce GiB per device", title=title)
    fig.suptitle(f"All-reduce volume from compiled HLO (batch {BATCH}, seq {SEQ}, bf16)")
    fig.tight_layout()
    return fig


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="1b,3b,7b,13b", help="comma-separated subset of 1b,3b,7b,13b")
    ap.add_argument("--vocab", type=int, default=VOCAB,
                    help=f"vocabulary size (default {VOCAB}, BOOST's; the committed results used {BYTE_VOCAB})")
    common.add_out(ap, "comm_table")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    presets = [p.strip().lower() for p in args.presets.split(",") if p.strip()]
    bad = [p for p in presets if p not in SETUPS]
    if bad:
        ap.error(f"--presets: unknown {bad}; use a subset of {','.join(SETUPS)}")
    if args.vocab < 1:
        ap.error(f"--vocab: must be >= 1, got {args.vocab}; fix: pass e.g. --vocab 32000")
    if common.rerender(args, "comm_table", markdown, chart) is None:
        res = measure(presets, args.vocab)
        common.write(args.out, "comm_table", data=res, md=lambda: markdown(res), figure=lambda: chart(res),
                     command=common.command_line("comm_table", argv), started=t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
