"""Predicted iteration time of full-rank TP, vanilla low-rank TP and BTP at BOOST's configurations.

For each configuration (1B on 1 GPU, 3B TP2, 7B TP4, 13B TP4 PP2; bf16, CoLA for the low-rank
strategies, LLaMA-2 vocabulary 32000, untied LM head) an iteration is M = 4 micro-batches of ONE
sequence of 4096 tokens and one AdamW update, as in BOOST's only pinned configuration (the 7B yamls:
`micro_batch_size: 1`, `batch_accumulation_per_replica: 4`, `pp_engine: 1f1b`). Two programs per
strategy are compiled ABSTRACTLY (`ShapeDtypeStruct`s with the strategy's shardings, simulated CPU
devices) for one micro-batch, each with 1 and with 2 transformer layers: the training step
(`boostjax.analysis.memory.train_step_compiled`: forward, backward, clipping, AdamW) and its optimizer
update alone (`tx.update` + `apply_updates` + the gradient norm, same layout, gradients shaped as the
parameters); step minus update is one micro-batch's forward + backward.
The 2-layer minus the 1-layer program is one layer, the rest (embedding, LM head, cross-entropy,
non-layer optimizer work) is the 1-layer program minus one layer, and an L-layer model is
`rest + L x layer`. From each compiled program (per device):

- FLOPs: every dot's FLOPs from the HLO (`hlo.gemms`), with the shapes the roofline needs;
  `compiled.cost_analysis()["flops"]` is reported beside them (JSON). Attention is compiled
  materialised (`attention="xla"`) so that every score dot is in the HLO once (the chunked path's
  loops would hide the tiles inside `while` bodies).
- GEMM time: per dot, `max(FLOPs / (eta * peak), bytes / (beta * HBM))` with operands and result in
  bf16 — a roofline, under which small-K GEMMs turn memory-bound (none does at BOOST's shapes on
  A100 with eta ~0.8); the utilisation loss BOOST measures for small K is not modelled. Attention's
  score dots count FLOPs only: BOOST runs `flash_attn_varlen_func`, which keeps scores on chip.
- Other memory traffic: operand + result bytes of every other top-level HLO instruction (fusions,
  copies, reductions: norms, SiLU, RoPE, softmax, cross-entropy, the AdamW update), at `beta * HBM`;
  score arrays (two sequence-sized dims and at least 2 x micro-batch x seq^2 elements, so that 7B's
  [b, s, d] with d = s = 4096 is not mistaken for one) excluded (FlashAttention), and so are pure
  convert / transpose / copy fusions (CPU artefacts: the CPU backend upcasts bf16 dots to f32 and
  picks its own layouts). `cost_analysis()["bytes accessed"]` counts both and is only reported.
- Communication: every non-trivial collective in the HLO (`hlo.collectives`, bf16 payload even where
  the CPU backend widens it), ring all-reduce `alpha + 2(T-1)/T * bytes / BW`, all-gather
  `alpha + (T-1)/T * bytes / BW`, reduce-scatter `alpha + (T-1) * bytes / BW` (bytes = its result),
  not overlapped with compute (BOOST's yamls: `tp_linear_async_communication: false`).
- Iteration: `(M + P - 1)` slots of one micro-batch's forward + backward on a stage (`rest + (L/P) x
  layer`, the full `rest` on every slot: the last stage holds the head and sets the pace), then the
  stage's optimizer once. 1F1B and GPipe have the same bubble `(P-1)/(M+P-1)` (= 1/5 at P = 2, M = 4);
  1F1B only lowers peak activation memory (not modelled here). Pipeline sends: the activation and its
  gradient cross each of the `P-1` boundaries once on the critical path (fill and drain; the other
  sends are taken as hidden behind compute): `2 (P-1) (alpha_p2p + bytes / BW_p2p)`, bytes = `1 s d`
  bf16 for full-rank and vanilla TP (replicated residual) and `1 s d/T` for BTP (residual sharded).

ONE constant is calibrated: the GEMM efficiency eta (fraction of bf16 peak a compute-bound GEMM
reaches), chosen by bisection so the model reproduces the single configuration without any
communication: 1B full-rank on one A100 (0.85 s, BOOST's README). Everything else is a stated,
uncalibrated constant (see `A100`, `H200`). The other eleven README numbers are predictions; the
table reports model / README. Every assumption is listed in the results md (`ASSUMPTIONS`).

    python -m experiments.tp.scaling_model            # paper configs, H200 projection, 30B/40B
    python -m experiments.tp.scaling_model --quick --out /tmp/q   # 1B and 7B only
    python -m experiments.tp.scaling_model --from-json experiments/results/scaling_model.json

Writes experiments/results/scaling_model.{json,md,png}.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from boostjax.config import Config, ModelConfig, preset
from boostjax.runtime.hardware import get_profile
from boostjax.models.flops import flops_per_token, param_count
from boostjax.analysis.comm import STRATEGIES
from boostjax.planning.costs import Hardware, program_cost, program_time, split_layers

from experiments import common
from experiments.common import log
from experiments.tp.strategy_bars import strategy_bars

NAMES = {"fullrank-tp": "full-rank", "vanilla-tp": "vanilla TP", "btp": "BTP"}
# BOOST's 7B yamls (examples/config_llama_7b.yaml, examples/cola/config_cola_llama_7b.yaml, https://github.com/Arcana-2236/BOOST):
# micro_batch_size 1, batch_accumulation_per_replica 4, sequence_length 4096, vocab_size 32000, tie_word_embeddings true
# (boostjax ties no LM head under tensor parallelism, so the head stays a parameter of its own: see ASSUMPTIONS)
MICRO_BATCH, MICROBATCHES, SEQ, VOCAB, TIE = 1, 4, 4096, 32000, False
PAPER = {  # BOOST's README results table (run_iter_compare.sh): iteration seconds (full / vanilla / BTP), A100
    "1b": {"fullrank-tp": 0.85, "vanilla-tp": 0.56, "btp": 0.59},
    "3b": {"fullrank-tp": 1.14, "vanilla-tp": 1.41, "btp": 0.78},
    "7b": {"fullrank-tp": 1.06, "vanilla-tp": 1.64, "btp": 0.72},
    "13b": {"fullrank-tp": 2.07, "vanilla-tp": 2.42, "btp": 1.30},
}
# the paper's abstract (https://arxiv.org/abs/2512.12131): speed-up ranges, no per-size seconds
PAPER_ABSTRACT = {"vs_fullrank": (1.46, 1.91), "vs_vanilla": (1.87, 2.27)}
CALIBRATION = ("1b", "fullrank-tp")  # the one point eta is fitted to: no communication at all
# "40b": our choice (BOOST names no 40B shape): Code-Llama-34B widths with full multi-head attention, 39B.
SHAPES = {**{k: preset(k, vocab_size=VOCAB, tie_embeddings=TIE) for k in ("1b", "3b", "7b", "13b", "30b")},
          "40b": ModelConfig(d_model=8192, n_layers=48, n_heads=64, d_ff=22016, rank=2048, vocab_size=VOCAB,
                             tie_embeddings=TIE)}


A100 = Hardware("A100-80GB SXM, NVLink3 4-GPU node (Perlmutter-like), Slingshot 25 GB/s per GPU",
                get_profile("A100-80GB").bf16_flops, 2.039e12, 0.8, 200e9, 15e-6, 25e9, 10e-6)
H200 = Hardware("H200 SXM, NVLink4/NVSwitch 8-GPU node, InfiniBand NDR 50 GB/s per GPU",
                get_profile("H200-141GB").bf16_flops, 4.8e12, 0.8, 360e9, 15e-6, 50e9, 10e-6)


@dataclass(frozen=True)
class Setup:
    name: str  # shape key ("7b")
    tp: int
    pp: int = 1
    microbatches: int = MICROBATCHES  # M micro-batches per iteration (BOOST's batch_accumulation_per_replica)
    micro_batch: int = MICRO_BATCH  # sequences per micro-batch (BOOST's micro_batch_size)
    seq: int = SEQ
    schedule: str = "1f1b"  # BOOST's pp_engine; same bubble as GPipe, so only a label here
    model: ModelConfig | None = None  # default: SHAPES[name]

    @property
    def shape(self) -> ModelConfig:
        return self.model or SHAPES[self.name]

    @property
    def batch(self) -> int:
        """Sequences per iteration."""
        return self.microbatches * self.micro_batch

    @property
    def label(self) -> str:
        return f"{self.name.upper()} TP{self.tp}" + (f" PP{self.pp}" if self.pp > 1 else "")


PAPER_SETUPS = (Setup("1b", 1), Setup("3b", 2), Setup("7b", 4), Setup("13b", 4, pp=2))
BIG_SETUPS = (Setup("30b", 8), Setup("40b", 8, pp=2))


# -- what one compiled program costs: boostjax.planning.costs (program_cost, program_time) ----------

@functools.lru_cache(maxsize=128)
def _compiled_pair(model: ModelConfig, tp: int, batch: int, seq: int, strategy: str) -> dict[str, Any]:
    """Cost of the training step for `batch` sequences and of its optimizer update alone (same
    layout, gradients shaped as the parameters): the step minus the update is the forward + backward."""
    from boostjax.analysis import memory
    from boostjax.analysis.comm import model_for
    from boostjax.config import as_mesh
    from boostjax.planning.measure import update_program
    from boostjax.training.checks import validate

    mesh = as_mesh(f"data=1,model={tp}", "scaling_model.mesh")
    cfg = validate(Config(model_for(model, strategy),
                          memory.train_config(batch, seq, strategy, mesh, "none", "bfloat16")))
    step = memory.train_step_compiled(cfg)
    opt = update_program(cfg)
    return {"step": program_cost(step.compiled.as_text(), seq, batch), "opt": program_cost(opt.as_text(), seq, batch),
            "xla": _xla_cost(step.compiled), "xla_opt": _xla_cost(opt)}


def _xla_cost(compiled) -> dict[str, float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):  # older JAX: one dict per program
        ca = ca[0] if ca else {}
    return {k: float(v) for k, v in (ca or {}).items() if k in ("flops", "bytes accessed")}


def layer_costs(setup: Setup, strategy: str) -> dict[int, dict[str, Any]]:
    """Compile one micro-batch's step and its optimizer update of `setup` with 1 and 2 layers (abstractly,
    cached), materialised attention (every score dot once in the HLO), and cost all four programs."""
    return {n: _compiled_pair(replace(setup.shape, n_layers=n, kind="cola", attention="xla"), setup.tp,
                              setup.micro_batch, setup.seq, strategy) for n in (1, 2)}


def predict(setup: Setup, strategy: str, hw: Hardware, eta: float, costs: dict | None = None) -> dict[str, Any]:
    """Predicted iteration seconds of `setup` under `strategy` on `hw` (see the module docstring)."""
    costs = costs or layer_costs(setup, strategy)
    per_stage = setup.shape.n_layers / setup.pp
    t = {(n, p): program_time(costs[n][p], hw, eta) for n in (1, 2) for p in ("step", "opt")}
    step, opt = (split_layers(t[1, p], t[2, p], per_stage) for p in ("step", "opt"))
    fb = {k: step[k] - opt[k] for k in step}  # one micro-batch's forward + backward: the step minus its update
    per_layer = {k: t[2, "step"][k] - t[1, "step"][k] for k in ("comm_bytes", "collectives", "memory_bound_gemms")}
    slots = setup.microbatches + setup.pp - 1
    m = setup.shape
    width = m.d_model // setup.tp if strategy == "btp" else m.d_model
    p2p_bytes = setup.micro_batch * setup.seq * width * 2
    p2p_s = 2 * (setup.pp - 1) * (hw.p2p_alpha_s + p2p_bytes / hw.p2p_bytes_per_s)
    parts = {k: slots * fb[k] + opt[k] for k in ("gemm_s", "memory_s", "comm_s")}
    total = sum(parts.values()) + p2p_s
    xla_opt, xla_step = (split_layers(costs[1][k], costs[2][k], per_stage) for k in ("xla_opt", "xla"))
    xla = {k: slots * (xla_step.get(k, 0.0) - xla_opt.get(k, 0.0)) + xla_opt.get(k, 0.0)
           for k in ("flops", "bytes accessed")}
    model_m = replace(m, kind="llama" if strategy == "fullrank-tp" else "cola")
    tokens = setup.batch * setup.seq
    useful = flops_per_token(model_m, setup.seq) * tokens / (setup.tp * setup.pp)  # per GPU, PaLM convention
    return {
        "setup": setup.label, "strategy": strategy, "hardware": hw.name, "eta": eta, "iteration_s": total,
        **parts, "p2p_s": p2p_s, "bubble_fraction": (setup.pp - 1) / slots,
        "microbatches": setup.microbatches, "micro_batch": setup.micro_batch, "schedule": setup.schedule,
        "fwd_bwd_s_per_slot": sum(fb[k] for k in ("gemm_s", "memory_s", "comm_s")),
        "optimizer_s": sum(opt[k] for k in ("gemm_s", "memory_s", "comm_s")),
        "optimizer_memory_s": opt["memory_s"], "optimizer_comm_s": opt["comm_s"],
        "per_layer_comm_bytes": per_layer["comm_bytes"], "per_layer_collectives": per_layer["collectives"],
        # per iteration on one stage: M + P - 1 micro-batch slots of forward + backward, one optimizer step
        "stage_comm_bytes": slots * fb["comm_bytes"] + opt["comm_bytes"],
        "stage_collectives": slots * fb["collectives"] + opt["collectives"],
        "stage_gemm_flops": slots * fb["gemm_flops"] + opt["gemm_flops"], "xla_stage_flops": xla["flops"],
        "xla_stage_bytes_accessed": xla["bytes accessed"],
        "stage_other_bytes": slots * fb["other_bytes"] + opt["other_bytes"],
        "stage_gemm_bytes": slots * fb["gemm_bytes"] + opt["gemm_bytes"],
        "stage_score_bytes_excluded": slots * fb["score_bytes_excluded"] + opt["score_bytes_excluded"],
        "stage_move_bytes_excluded": slots * fb["move_bytes_excluded"] + opt["move_bytes_excluded"],
        "memory_bound_gemms_per_layer": per_layer["memory_bound_gemms"],
        "mfu": useful / (total * hw.peak_flops), "params": param_count(model_m),
        "state_gib_per_gpu": param_count(model_m) * 16 / (setup.tp * setup.pp) / 2**30,
    }


def calibrate(costs: dict, hw: Hardware, target_s: float, setup: Setup, strategy: str) -> float:
    """The eta in (0, 1] at which `predict` gives `target_s` (bisection; time falls as eta rises).
    Returns 1.0 when even a perfect GEMM is slower than the target."""
    lo, hi = 1e-4, 1.0
    if predict(setup, strategy, hw, hi, costs)["iteration_s"] > target_s:
        return hi
    if predict(setup, strategy, hw, lo, costs)["iteration_s"] < target_s:
        raise ValueError(f"calibrate: {target_s} s is slower than the model at eta={lo}; fix: check the setup")
    for _ in range(60):
        mid = (lo + hi) / 2
        if predict(setup, strategy, hw, mid, costs)["iteration_s"] > target_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# -- the experiment -----------------------------------------------------------------------------------

def run(setups: tuple[Setup, ...], big: tuple[Setup, ...], paper: dict = PAPER,
        calibration: tuple[str, str] = CALIBRATION) -> dict[str, Any]:
    """Compile and cost every setup, fit eta on `calibration` (a setup name and strategy with a `paper`
    time), predict `setups` on A100 (beside `paper`) and on H200, and `big` on H200."""
    costs: dict[tuple[str, str], dict] = {}
    for s in (*setups, *big):
        for strategy in STRATEGIES:
            t0 = time.perf_counter()
            if s.tp == 1 and strategy == "btp":  # without a model axis BTP and vanilla TP are one program
                costs[(s.label, strategy)] = costs[(s.label, "vanilla-tp")]
                continue
            costs[(s.label, strategy)] = layer_costs(s, strategy)
            log(f"compiled {s.label} {strategy} (1 and 2 layers, {time.perf_counter() - t0:.0f} s)")
    cal = next(s for s in setups if s.name == calibration[0])
    target = paper[calibration[0]][calibration[1]]
    eta = calibrate(costs[(cal.label, calibration[1])], A100, target, cal, calibration[1])
    log(f"eta = {eta:.4f} (fitted to {cal.label} {calibration[1]} = {target} s)")
    rows = []
    for hw, group in ((A100, setups), (H200, setups), (H200, big)):
        for s in group:
            for strategy in STRATEGIES:
                r = predict(s, strategy, hw, eta, costs[(s.label, strategy)])
                paper_s = paper.get(s.name, {}).get(strategy) if hw is A100 else None
                r.update(paper_s=paper_s, model_over_paper=r["iteration_s"] / paper_s if paper_s else None,
                         table="paper" if hw is A100 else ("h200" if group is setups else "big"))
                rows.append(r)
    sens = sensitivity(setups, costs, paper, calibration)
    return {"sensitivity": sens, "assumptions": {
        "micro_batch": cal.micro_batch, "microbatches": cal.microbatches, "batch": cal.batch, "seq": cal.seq,
        "vocab": cal.shape.vocab_size, "tie_embeddings": cal.shape.tie_embeddings, "schedule": cal.schedule, "dtype": "bfloat16", "remat": "none",
        "attention": "fused (FlashAttention): score FLOPs counted, score traffic not", "low_rank_kind": "cola",
        "overlap": "none: TP collectives and the pipeline fill/drain sends on the critical path",
        "calibration": f"{calibration[0]} {calibration[1]}", "calibration_target_s": target,
        "paper_abstract": PAPER_ABSTRACT, "hardware": {"A100": asdict(A100), "H200": asdict(H200)}},
        "eta": eta, "rows": rows}


ASSUMPTIONS = (
    "**Measured** (from XLA's compiled HLO of boostjax's own training step, per device): GEMM shapes and FLOPs, "
    "collective kinds, counts and bf16 payloads, the bytes every other top-level instruction reads and writes. "
    "**Modelled**: everything that turns these into seconds (the roofline, the ring formulas, the pipeline "
    "slots, the constants below). Nothing here ran on a GPU.",
    "**Micro-batching**: an iteration is M = {microbatches} micro-batches of {micro_batch} sequence(s) of {seq} "
    "tokens ({batch} sequences) and one AdamW update. This is BOOST's only pinned configuration: both 7B yamls "
    "(`examples/config_llama_7b.yaml`, `examples/cola/config_cola_llama_7b.yaml`, run by `run_iter_compare.sh`) set "
    "`micro_batch_size: 1`, `batch_accumulation_per_replica: 4`, `sequence_length: 4096`. We apply it to every row. "
    "BOOST ships no 3B or 13B config; its 1B yaml (TP4, 16 x 2 sequences) does not match the README's 1-GPU 1B row. "
    "**13B TP4 PP2 = 4 micro-batches of 1 sequence with 1F1B is an inference** from the 7B yamls and nanotron's "
    "semantics (with pp > 1 the accumulation count is the number of pipeline micro-batches), not a published "
    "13B configuration.",
    "**Schedule**: 1F1B (`pp_engine: 1f1b` in every BOOST yaml). Time per iteration = (M + P - 1) slots of one "
    "micro-batch's forward + backward on a stage + the stage's optimizer step once; bubble (P - 1)/(M + P - 1) = "
    "1/5 at P = 2, M = 4, the same as GPipe (1F1B only lowers peak activation memory, not modelled). Every slot "
    "is charged the stage with the LM head (the slowest). Pipeline sends: 2 (P - 1) transfers of one "
    "micro-batch's activation on the critical path (fill and drain), the others hidden behind compute.",
    "**Optimizer**: compiled separately (the step's `tx.update` + `apply_updates` + gradient norm on the step's "
    "state layout: global-norm clipping and AdamW with fp32 moments and master weights) and charged once per "
    "iteration; one micro-batch's forward + backward = compiled step minus that update (same shardings).",
    "**Attention**: fused (BOOST calls `flash_attn_varlen_func`): the score GEMMs' FLOPs are charged at eta x "
    "peak, the [s, s] scores' memory traffic is not. The step is compiled with materialised attention "
    "(`attention='xla'`) so that every score dot appears once in the HLO.",
    "**Overlap**: none. TP collectives are on the critical path (BOOST's yamls: "
    "`tp_linear_async_communication: false`); compute, memory traffic and communication add up.",
    "**Model**: vocabulary {vocab} (LLaMA-2, as BOOST's yamls); tied embeddings: {tie}. BOOST's 7B yamls tie "
    "(`tie_word_embeddings: true`), but boostjax implements no tied LM head under tensor parallelism, so the head "
    "is a [V, d] parameter of its own: the same GEMMs, one more matrix in the optimizer update; bf16 compute with fp32 master weights, no remat, CoLA (sigma in every latent) "
    "for vanilla TP and BTP, the dense LLaMA of the same shapes for full-rank TP, boostjax's 1b/3b/7b/13b presets "
    "(1B FFN 5472 = BOOST's 1B yaml; 3B and 13B shapes are ours: BOOST publishes none). One data-parallel replica.",
    "**Hardware**: the A100 constants below are nominal datasheet / NCCL figures for an 80 GB SXM node; BOOST does "
    "not state its cluster in the README (its yamls' checkpoint path /eagle/... suggests ALCF, whose Polaris nodes "
    "carry A100 40 GB with 1.56 TB/s HBM: about the 'HBM efficiency 0.6' sensitivity row). The H200 and "
    "30B/40B rows are projections with no measurement behind them.",
    "**Sources of the comparison columns**: the per-size seconds (`README s`) and the speed-ups derived from them "
    "are BOOST's README (results table, `run_iter_compare.sh`; README speed-ups vs full-rank 1.44 / 1.46 / 1.47 / "
    "1.59, vs vanilla TP 0.95 / 1.81 / 2.28 / 1.86). The paper (https://arxiv.org/abs/2512.12131) gives, in its "
    "abstract, only ranges: {fr_lo:.2f}-{fr_hi:.2f}x over full-rank and {va_lo:.2f}-{va_hi:.2f}x over vanilla TP; "
    "they are not the README's per-size numbers (e.g. the README's 1.44x and 0.95x at 1B fall outside them) and "
    "are quoted for reference only.",
)


def assumption_lines(a: dict) -> list[str]:
    fr, va = a.get("paper_abstract", PAPER_ABSTRACT).values()
    fields = {"microbatches": a.get("microbatches", 1), "micro_batch": a.get("micro_batch", a["batch"]),
              "seq": a["seq"], "batch": a["batch"], "vocab": a["vocab"], "tie": a.get("tie_embeddings", False),
              "fr_lo": fr[0], "fr_hi": fr[1], "va_lo": va[0], "va_hi": va[1]}
    return [f"- {t.format(**fields)}" for t in ASSUMPTIONS]


def sensitivity(setups: tuple[Setup, ...], costs: dict, paper: dict, calibration: tuple[str, str]) -> list[dict]:
    """model / README on A100 when one stated constant changes (eta refitted each time)."""
    cal = next(s for s in setups if s.name == calibration[0])
    variants = (("as stated", A100), ("all-reduce bus 100 GB/s", replace(A100, bus_bytes_per_s=100e9)),
                ("all-reduce bus 300 GB/s", replace(A100, bus_bytes_per_s=300e9)),
                ("alpha 50 us", replace(A100, alpha_s=50e-6)),
                ("HBM efficiency 0.6", replace(A100, hbm_efficiency=0.6)),
                ("HBM efficiency 1.0", replace(A100, hbm_efficiency=1.0)))
    out = []
    for label, hw in variants:
        eta = calibrate(costs[(cal.label, calibration[1])], hw, paper[calibration[0]][calibration[1]], cal,
                        calibration[1])
        ratios = [predict(s, st, hw, eta, costs[(s.label, st)])["iteration_s"] / paper[s.name][st]
                  for s in setups if s.name in paper for st in STRATEGIES]
        gmean = float(np.exp(np.mean(np.log(ratios))))
        out.append({"variant": label, "eta": eta, "min": min(ratios), "max": max(ratios), "gmean": gmean})
    return out


def _row(rows: list[dict], setup: str, strategy: str, table: str) -> dict:
    return next(r for r in rows if r["setup"] == setup and r["strategy"] == strategy and r["table"] == table)


def markdown(res: dict) -> str:
    rows, eta, a = res["rows"], res["eta"], res["assumptions"]
    mb = f"{a.get('microbatches', 1)} micro-batch(es) of {a.get('micro_batch', a['batch'])} sequence(s)"
    lines = ["# Scaling model: predicted iteration time vs BOOST", "",
             f"{mb} x {a['seq']} tokens per iteration ({a.get('schedule', 'gpipe')} with PP > 1), bf16, "
             f"vocabulary {a['vocab']}, no remat, CoLA for vanilla TP and BTP; one data-parallel replica. "
             f"GEMM efficiency eta = {eta:.3f}, the ONE calibrated constant (fitted to {a['calibration']} "
             f"= {a['calibration_target_s']} s on one A100, the only configuration without communication); everything "
             "else is stated below and in `experiments/tp/scaling_model.py`. Seconds per iteration. "
             "`README s` = BOOST's README results table (https://github.com/Arcana-2236/BOOST).", "",
             *([f"Run: `{res['command'].strip()}`, {res['wall_s']} s wall on a shared 2-core CPU (abstract compiles "
                "only; no GPU)."] if res.get("command") else []), "",
             "## Assumptions", "", *assumption_lines(a), "",
             "## A100 80GB (NVLink), BOOST's configurations", "",
             "| config | strategy | model s | README s | model / README | GEMM s | other memory s | comm s | p2p s | "
             "optimizer s (in the total) | bubble | collectives/stage | comm GiB/stage | MFU (model) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["table"] == "paper"):
        lines.append(f"| {r['setup']} | {NAMES[r['strategy']]} | {r['iteration_s']:.2f} | {r['paper_s']:.2f} | "
                     f"{r['model_over_paper']:.2f} | {r['gemm_s']:.2f} | {r['memory_s']:.2f} | {r['comm_s']:.3f} | "
                     f"{r['p2p_s']:.4f} | {r.get('optimizer_s', float('nan')):.3f} | {r['bubble_fraction']:.2f} | "
                     f"{r['stage_collectives']:.0f} | "
                     f"{r['stage_comm_bytes'] / 2**30:.2f} | {r['mfu']:.2f} |")
    ratios = [r["model_over_paper"] for r in rows if r["table"] == "paper" and r["model_over_paper"]]
    if ratios:
        gmean = float(np.exp(np.mean(np.log(ratios))))
        lines += ["", f"model / README over the {len(ratios)} points: {min(ratios):.2f} to {max(ratios):.2f}, "
                      f"geometric mean {gmean:.2f} (one of them, the calibration point, is 1.00 by construction)."]
    piped = [r for r in rows if r["table"] == "paper" and r["bubble_fraction"] > 0 and r.get("paper_s")
             and "fwd_bwd_s_per_slot" in r]
    if piped:
        lines += ["", "Pipelined rows: how many one-micro-batch slots the README time would hold at the model's per-slot "
                      "time, `(README s - optimizer s - p2p s) / forward+backward s per slot` (the model charges "
                      "M + P - 1):", "",
                  "| config | strategy | forward+backward s / slot | slots charged | slots implied by README |",
                  "|---|---|---|---|---|"]
        for r in piped:
            implied = (r["paper_s"] - r["optimizer_s"] - r["p2p_s"]) / r["fwd_bwd_s_per_slot"]
            charged = round(r["microbatches"] / (1 - r["bubble_fraction"]))  # M + P - 1
            lines.append(f"| {r['setup']} | {NAMES[r['strategy']]} | {r['fwd_bwd_s_per_slot']:.3f} | {charged} | "
                         f"{implied:.1f} |")
    if res.get("sensitivity"):
        lines += ["", "Sensitivity: one stated A100 constant changed, eta refitted on the calibration point:", "",
                  "| variant | eta | model / README min | max | geometric mean |", "|---|---|---|---|---|"]
        for v in res["sensitivity"]:
            lines.append(f"| {v['variant']} | {v['eta']:.3f} | {v['min']:.2f} | {v['max']:.2f} | {v['gmean']:.2f} |")
    fr, va = a.get("paper_abstract", PAPER_ABSTRACT).values()
    lines += ["", "Speed-ups (iteration-time ratios), model vs BOOST's README (the paper's abstract gives only the ranges "
              f"{fr[0]:.2f}-{fr[1]:.2f}x over full-rank and {va[0]:.2f}-{va[1]:.2f}x over vanilla TP):", "",
              "| config | full / BTP model | full / BTP README | vanilla / BTP model | vanilla / BTP README |",
              "|---|---|---|---|---|"]
    for setup in dict.fromkeys(r["setup"] for r in rows if r["table"] == "paper"):
        f, v, b = (_row(rows, setup, s, "paper") for s in STRATEGIES)
        lines.append(f"| {setup} | {f['iteration_s'] / b['iteration_s']:.2f} | {f['paper_s'] / b['paper_s']:.2f} | "
                     f"{v['iteration_s'] / b['iteration_s']:.2f} | {v['paper_s'] / b['paper_s']:.2f} |")
    for table, title in (("h200", "## Projection: the same configurations on H200 nodes"),
                         ("big", "## Projection: 30B (TP8, one H200 node) and 40B (TP8 PP2, two nodes)")):
        sel = [r for r in rows if r["table"] == table]
        if not sel:
            continue
        lines += ["", title, "", "| config | strategy | params | model s | GEMM s | other memory s | comm s | p2p s | "
                  "MFU (model) | fp32 state GiB/GPU | vs full-rank |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sel:
            full = _row(rows, r["setup"], "fullrank-tp", table)
            lines.append(f"| {r['setup']} | {NAMES[r['strategy']]} | {r['params'] / 1e9:.1f}B | {r['iteration_s']:.2f} | "
                         f"{r['gemm_s']:.2f} | {r['memory_s']:.2f} | {r['comm_s']:.3f} | {r['p2p_s']:.4f} | "
                         f"{r['mfu']:.2f} | {r['state_gib_per_gpu']:.1f} | "
                         f"{full['iteration_s'] / r['iteration_s']:.2f}x |")
    lines += ["", "fp32 state = parameters, gradients and AdamW moments (16 bytes/parameter) over TP x PP; "
              "activations not included. MFU = PaLM-convention model FLOPs / (time x bf16 peak).", "",
              "## Constants (stated, not fitted)", "",
              "| hardware | bf16 peak TFLOP/s | HBM TB/s x efficiency | all-reduce bus GB/s | alpha us | "
              "p2p GB/s | p2p alpha us |", "|---|---|---|---|---|---|---|"]
    for h in a["hardware"].values():
        lines.append(f"| {h['name']} | {h['peak_flops'] / 1e12:.0f} | {h['hbm_bytes_per_s'] / 1e12:.2f} x "
                     f"{h['hbm_efficiency']} | {h['bus_bytes_per_s'] / 1e9:.0f} | {h['alpha_s'] * 1e6:.0f} | "
                     f"{h['p2p_bytes_per_s'] / 1e9:.0f} | {h['p2p_alpha_s'] * 1e6:.0f} |")
    return "\n".join(lines) + "\n"


def chart(res: dict):
    """Model vs README iteration times, and the H200 projection (a matplotlib Figure)."""
    rows = res["rows"]
    fig, axes = common.subplots(2, (12, 4.2))
    for ax, table, title in ((axes[0], "paper", "A100: model (bars) vs BOOST README (black ticks)"),
                             (axes[1], None, "H200 projection")):
        sel = [r for r in rows if (r["table"] == table if table else r["table"] in ("h200", "big"))]
        setups = list(dict.fromkeys(r["setup"] for r in sel))
        cell = {(r["setup"], r["strategy"]): r for r in sel}
        bars = {s: [cell[u, s]["iteration_s"] for u in setups] for s in STRATEGIES}
        ticks = {s: [cell[u, s]["paper_s"] for u in setups] for s in STRATEGIES} if table else None
        strategy_bars(ax, setups, bars, NAMES, ticks=ticks, tick_label="BOOST (README)",
                      ylabel="seconds per iteration", title=title, label_size=8)
    fig.suptitle(f"Latency-bandwidth + roofline model from compiled HLO (eta = {res['eta']:.3f})")
    fig.tight_layout()
    return fig


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1B and 7B only, no 30B/40B projection")
    common.add_out(ap, "scaling_model")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if common.rerender(args, "scaling_model", markdown, chart) is None:
        from boostjax.runtime.devices import exact_low_precision, simulate_devices

        simulate_devices(8)  # before JAX starts: TP8 for the 30B/40B projection
        exact_low_precision()  # bf16 collectives stay bf16 in the HLO
        setups = tuple(s for s in PAPER_SETUPS if not args.quick or s.name in ("1b", "7b"))
        t0 = time.perf_counter()
        res = run(setups, () if args.quick else BIG_SETUPS)
        res.update(quick=args.quick, command=common.command_line("scaling_model", argv),
                   wall_s=round(time.perf_counter() - t0))
        common.write(args.out, "scaling_model", data=res, md=lambda: markdown(res), figure=lambda: chart(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
