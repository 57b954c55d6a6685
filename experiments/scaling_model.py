"""Predicted iteration time of full-rank TP, vanilla low-rank TP and BTP at BOOST's configurations.

For each configuration (1B on 1 GPU, 3B TP2, 7B TP4, 13B TP4 PP2; micro-batch 4, sequence 4096, bf16,
CoLA for the low-rank strategies, LLaMA-2 vocabulary 32000) one training step (forward, backward, AdamW)
is compiled ABSTRACTLY (`ShapeDtypeStruct`s with the strategy's shardings, simulated CPU devices) with
1 and with 2 transformer layers (`boostjax.analysis.comm.compiled_step`); the 2-layer minus the
1-layer program is one layer, the rest (embedding, LM head, cross-entropy, non-layer optimizer work)
is the 1-layer program minus one layer, and an L-layer model is `rest + L x layer`. From each
compiled program (per device):

- FLOPs: `compiled.cost_analysis()["flops"]` (reported) and every dot's FLOPs from the HLO
  (`hlo.gemms`), which are within 2 % of it at BOOST's shapes and carry the shapes the roofline needs.
- GEMM time: per dot, `max(FLOPs / (eta * peak), bytes / (beta * HBM))` with operands and result in
  bf16 — a roofline, under which small-K GEMMs turn memory-bound (none does at BOOST's shapes on
  A100 with eta ~0.8: vanilla's smallest K = r/TP = 256 at 7B gives ~238 FLOP/byte, above the
  ~153 ridge; the utilisation loss BOOST measures for small K is not modelled). Attention's score-shaped
  dots (two dims equal to the sequence) count FLOPs only: FlashAttention keeps scores on chip.
- Other memory traffic: operand + result bytes of every other top-level HLO instruction (fusions,
  copies, reductions: norms, SiLU, RoPE, softmax, the AdamW update), at `beta * HBM`; score-shaped
  arrays (s x s) excluded (FlashAttention), and so are pure convert / transpose / copy fusions (CPU
  artefacts: the CPU backend upcasts bf16 dots to f32 and picks its own layouts).
  `cost_analysis()["bytes accessed"]` counts both and is only reported (JSON).
- Communication: every non-trivial collective in the HLO (`hlo.collectives`, bf16 payload even where
  the CPU backend widens it), ring all-reduce `alpha + 2(T-1)/T * bytes / BW`, all-gather
  `alpha + (T-1)/T * bytes / BW`, reduce-scatter `alpha + (T-1) * bytes / BW` (bytes = its result),
  not overlapped with compute (TP collectives sit on the critical path).
- Pipeline (PP = P stages, M micro-batches, GPipe): a stage runs `rest + (L/P) x layer` (the full
  `rest`: the last stage holds the head), the iteration takes `(M + P - 1)` stage slots — bubble
  fraction `(P-1)/(M+P-1)` — plus the activation and its gradient crossing each of the `P-1`
  boundaries once on the critical path: `2 (P-1) (alpha_p2p + bytes / BW_p2p)`, bytes = `b s d` bf16
  for full-rank and vanilla TP (replicated residual) and `b s d/T` for BTP (residual sharded on d).

ONE constant is calibrated: the GEMM efficiency eta (fraction of bf16 peak a compute-bound GEMM
reaches), chosen by bisection so the model reproduces the single configuration without any
communication: 1B full-rank on one A100 (0.85 s). Everything else is a stated, uncalibrated constant
(see `A100`, `H200`). The other eleven paper numbers are predictions; the table reports model/paper.

    python experiments/scaling_model.py            # paper configs, H200 projection, 30B/40B (~2 min CPU)
    python experiments/scaling_model.py --quick --out /tmp/q   # 1B and 7B only (~45 s CPU)
    python experiments/scaling_model.py --from-json experiments/results/scaling_model.json

Writes experiments/results/scaling_model.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from boostjax.config import ModelConfig, preset  # noqa: E402
from boostjax.hardware import get_profile  # noqa: E402
from boostjax.models.flops import flops_per_token, param_count  # noqa: E402
from boostjax.sharding import hlo  # noqa: E402
from boostjax.analysis.comm import STRATEGIES  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NAMES = {"fullrank-tp": "full-rank", "vanilla-tp": "vanilla TP", "btp": "BTP"}
BATCH, SEQ, VOCAB = 4, 4096, 32000  # micro-batch and sequence: BOOST's 7B configuration; LLaMA-2 vocabulary
PAPER = {  # BOOST iteration seconds (full / vanilla / BTP), A100 clusters
    "1b": {"fullrank-tp": 0.85, "vanilla-tp": 0.56, "btp": 0.59},
    "3b": {"fullrank-tp": 1.14, "vanilla-tp": 1.41, "btp": 0.78},
    "7b": {"fullrank-tp": 1.06, "vanilla-tp": 1.64, "btp": 0.72},
    "13b": {"fullrank-tp": 2.07, "vanilla-tp": 2.42, "btp": 1.30},
}
CALIBRATION = ("1b", "fullrank-tp")  # the one point eta is fitted to: no communication at all
# "40b": our choice (BOOST names no 40B shape): Code-Llama-34B widths with full multi-head attention, 39B.
SHAPES = {**{k: preset(k, vocab_size=VOCAB) for k in ("1b", "3b", "7b", "13b", "30b")},
          "40b": ModelConfig(d_model=8192, n_layers=48, n_heads=64, d_ff=22016, rank=2048, vocab_size=VOCAB)}


@dataclass(frozen=True)
class Hardware:
    """Per-GPU rates the time model charges. Stated assumptions, not fitted (except eta, passed in)."""

    name: str
    peak_flops: float  # dense bf16 tensor-core peak (boostjax.hardware profiles)
    hbm_bytes_per_s: float  # nominal HBM bandwidth
    hbm_efficiency: float  # fraction of it streaming kernels reach
    bus_bytes_per_s: float  # NCCL bus bandwidth of an intra-node all-reduce (large messages)
    alpha_s: float  # per-collective latency (launch + NCCL small-message time)
    p2p_bytes_per_s: float  # pipeline send/recv between nodes, per GPU
    p2p_alpha_s: float


A100 = Hardware("A100-80GB SXM, NVLink3 4-GPU node (Perlmutter-like), Slingshot 25 GB/s per GPU",
                get_profile("A100-80GB").bf16_flops, 2.039e12, 0.8, 200e9, 15e-6, 25e9, 10e-6)
H200 = Hardware("H200 SXM, NVLink4/NVSwitch 8-GPU node, InfiniBand NDR 50 GB/s per GPU",
                get_profile("H200-141GB").bf16_flops, 4.8e12, 0.8, 360e9, 15e-6, 50e9, 10e-6)


@dataclass(frozen=True)
class Setup:
    name: str  # shape key ("7b")
    tp: int
    pp: int = 1
    microbatches: int = 1  # M: the whole batch is one micro-batch (our choice; see the README)
    batch: int = BATCH
    seq: int = SEQ
    model: ModelConfig | None = None  # default: SHAPES[name]

    @property
    def shape(self) -> ModelConfig:
        return self.model or SHAPES[self.name]

    @property
    def label(self) -> str:
        return f"{self.name.upper()} TP{self.tp}" + (f" PP{self.pp}" if self.pp > 1 else "")


PAPER_SETUPS = (Setup("1b", 1), Setup("3b", 2), Setup("7b", 4), Setup("13b", 4, pp=2))
BIG_SETUPS = (Setup("30b", 8), Setup("40b", 8, pp=2))


# -- what one compiled program costs ------------------------------------------------------------------

def _score_shaped(arrays, seq: int) -> bool:
    return any(sum(1 for s in a.shape if s == seq) >= 2 for a in arrays)


_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
         "replica-id", "iota", "opt-barrier", "custom-call"}
# data movement only: the CPU backend upcasts bf16 dots to f32 and picks its own operand layouts, so
# its programs hold convert / transpose / copy passes a GPU's bf16 cuBLAS GEMMs do not need
_MOVE = {"parameter", "convert", "bitcast", "transpose", "copy", "reshape", "tuple", "get-tuple-element"}


def program_cost(text: str, seq: int) -> dict[str, Any]:
    """GEMMs (FLOPs, bf16 bytes, score-shaped?), other HBM traffic and collectives of one compiled program."""
    mod = hlo.parse_module(text)
    gemm_bodies = {c for c, instrs in mod.computations.items() if any(i.opcode in ("dot", "convolution")
                                                                     for i in instrs)}
    move_bodies = {c for c, instrs in mod.computations.items() if all(i.opcode in _MOVE for i in instrs)}
    gemms = [(g.flops, g.bytes_moved("bf16"), _score_shaped((g.lhs, g.rhs, g.out), seq)) for g in hlo.gemms(mod)]
    other = scores = moves = 0
    for comp, instrs in mod.computations.items():
        caller = mod.caller(comp)
        if caller is not None and caller.opcode == "fusion":
            continue  # counted at its fusion instruction
        for ins in instrs:
            if ins.opcode in _FREE or ins.opcode in ("dot", "convolution") or any(
                    ins.opcode.startswith(k) for k in hlo.COLLECTIVE_KINDS):
                continue
            if ins.opcode == "fusion" and (ins.attr("calls") or "").lstrip("%") in gemm_bodies:
                continue  # a dot with fused epilogue: the GEMM roofline charges it
            ops = [o for o in (mod.lookup(comp, n) for n in ins.operands) if o is not None]
            arrays = [*ins.results, *(a for o in ops for a in o.results[:1] if o.opcode != "tuple")]
            nbytes = sum(a.bytes() for a in arrays)
            if ins.opcode in _MOVE or (ins.opcode == "fusion" and (ins.attr("calls") or "").lstrip("%") in move_bodies):
                moves += nbytes
            elif _score_shaped(arrays, seq):
                scores += nbytes
            else:
                other += nbytes
    colls = [(c.kind, c.logical_bytes, c.group_size) for c in hlo.collectives(mod) if not c.trivial]
    return {"gemms": gemms, "other_bytes": other, "score_bytes_excluded": scores,
            "move_bytes_excluded": moves, "collectives": colls}


def _coll_time(kind: str, nbytes: int, t: int, hw: Hardware) -> float:
    if kind == "all-reduce":
        return hw.alpha_s + 2 * (t - 1) / t * nbytes / hw.bus_bytes_per_s
    if kind == "all-gather" or kind == "all-to-all":
        return hw.alpha_s + (t - 1) / t * nbytes / hw.bus_bytes_per_s
    if kind == "reduce-scatter":
        return hw.alpha_s + (t - 1) * nbytes / hw.bus_bytes_per_s
    return hw.alpha_s + nbytes / hw.bus_bytes_per_s  # collective-permute and the rest: one hop


def program_time(cost: dict[str, Any], hw: Hardware, eta: float) -> dict[str, float]:
    """Seconds per component of one program on `hw` with GEMM efficiency `eta`."""
    rate, bw = eta * hw.peak_flops, hw.hbm_efficiency * hw.hbm_bytes_per_s
    gemm = sum(f / rate if score else max(f / rate, b / bw) for f, b, score in cost["gemms"])
    bound = sum(1 for f, b, score in cost["gemms"] if not score and b / bw > f / rate)
    comm = sum(_coll_time(k, b, t, hw) for k, b, t in cost["collectives"])
    return {"gemm_s": gemm, "memory_s": cost["other_bytes"] / bw, "comm_s": comm,
            "gemm_flops": float(sum(f for f, _, _ in cost["gemms"])), "memory_bound_gemms": float(bound),
            "collectives": float(len(cost["collectives"])), "other_bytes": float(cost["other_bytes"]),
            "gemm_bytes": float(sum(b for _, b, score in cost["gemms"] if not score)),
            "score_bytes_excluded": float(cost["score_bytes_excluded"]),
            "move_bytes_excluded": float(cost["move_bytes_excluded"]),
            "comm_bytes": float(sum(b for _, b, _ in cost["collectives"]))}


def layer_costs(setup: Setup, strategy: str, dtype: str = "bfloat16") -> dict[str, Any]:
    """Compile the 1- and 2-layer steps of `setup` (abstractly, cached by comm) and cost both programs."""
    from boostjax.analysis import comm  # noqa: PLC0415

    mesh = f"data=1,model={setup.tp}"
    out = {}
    for n in (1, 2):
        c = comm.compiled_step(replace(setup.shape, n_layers=n, kind="cola"), mesh, setup.batch, setup.seq,
                               strategy, "none", dtype)
        out[n] = {**program_cost(c.step_text, setup.seq), "xla": c.step_cost}
    return out


def predict(setup: Setup, strategy: str, hw: Hardware, eta: float, costs: dict | None = None) -> dict[str, Any]:
    """Predicted iteration seconds of `setup` under `strategy` on `hw` (see the module docstring)."""
    costs = costs or layer_costs(setup, strategy)
    t1, t2 = program_time(costs[1], hw, eta), program_time(costs[2], hw, eta)
    layers = setup.shape.n_layers
    per_layer = {k: t2[k] - t1[k] for k in t1}
    rest = {k: t1[k] - per_layer[k] for k in t1}
    stage = {k: rest[k] + layers / setup.pp * per_layer[k] for k in t1}
    slots = setup.microbatches + setup.pp - 1
    m = setup.shape
    width = m.d_model // setup.tp if strategy == "btp" else m.d_model
    p2p_bytes = setup.batch // setup.microbatches * setup.seq * width * 2
    p2p_s = 2 * (setup.pp - 1) * (hw.p2p_alpha_s + p2p_bytes / hw.p2p_bytes_per_s)
    parts = {k: slots * stage[k] for k in ("gemm_s", "memory_s", "comm_s")}
    total = sum(parts.values()) + p2p_s
    x1, x2 = costs[1]["xla"], costs[2]["xla"]
    xla = {k: x1.get(k, 0.0) + (layers / setup.pp - 1) * (x2.get(k, 0.0) - x1.get(k, 0.0))
           for k in ("flops", "bytes accessed")}
    model_m = replace(m, kind="llama" if strategy == "fullrank-tp" else "cola")
    tokens = setup.batch * setup.seq
    useful = flops_per_token(model_m, setup.seq) * tokens / (setup.tp * setup.pp)  # per GPU, PaLM convention
    return {
        "setup": setup.label, "strategy": strategy, "hardware": hw.name, "eta": eta, "iteration_s": total,
        **parts, "p2p_s": p2p_s, "bubble_fraction": (setup.pp - 1) / slots,
        "per_layer_comm_bytes": per_layer["comm_bytes"], "per_layer_collectives": per_layer["collectives"],
        "stage_comm_bytes": stage["comm_bytes"], "stage_collectives": stage["collectives"],
        "stage_gemm_flops": stage["gemm_flops"], "xla_stage_flops": xla["flops"],
        "xla_stage_bytes_accessed": xla["bytes accessed"], "stage_other_bytes": stage["other_bytes"],
        "stage_gemm_bytes": stage["gemm_bytes"], "stage_score_bytes_excluded": stage["score_bytes_excluded"],
        "stage_move_bytes_excluded": stage["move_bytes_excluded"],
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

def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


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
            _log(f"compiled {s.label} {strategy} (1 and 2 layers, {time.perf_counter() - t0:.0f} s)")
    cal = next(s for s in setups if s.name == calibration[0])
    target = paper[calibration[0]][calibration[1]]
    eta = calibrate(costs[(cal.label, calibration[1])], A100, target, cal, calibration[1])
    _log(f"eta = {eta:.4f} (fitted to {cal.label} {calibration[1]} = {target} s)")
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
    return {"sensitivity": sens, "assumptions": {"batch": BATCH, "seq": SEQ, "vocab": VOCAB, "dtype": "bfloat16", "remat": "none",
                            "low_rank_kind": "cola", "calibration": f"{calibration[0]} {calibration[1]}",
                            "calibration_target_s": target,
                            "hardware": {"A100": asdict(A100), "H200": asdict(H200)}},
            "eta": eta, "rows": rows}


def sensitivity(setups: tuple[Setup, ...], costs: dict, paper: dict, calibration: tuple[str, str]) -> list[dict]:
    """model / paper on A100 when one stated constant changes (eta refitted each time)."""
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
    lines = ["# Scaling model: predicted iteration time vs BOOST", "",
             f"Micro-batch {a['batch']} x sequence {a['seq']} per iteration (one micro-batch, M = 1), bf16, "
             f"vocabulary {a['vocab']}, no remat, CoLA for vanilla TP and BTP; one data-parallel replica. "
             f"GEMM efficiency eta = {eta:.3f}, the ONE calibrated constant (fitted to {a['calibration']} "
             f"= {a['calibration_target_s']} s on one A100, the only configuration without communication); everything else is stated "
             "in `experiments/scaling_model.py`. Seconds per iteration.", "",
             "## A100 80GB (NVLink), BOOST's configurations", "",
             "| config | strategy | model s | paper s | model / paper | GEMM s | other memory s | comm s | p2p s | "
             "bubble | collectives/stage | comm GiB/stage | MFU (model) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["table"] == "paper"):
        lines.append(f"| {r['setup']} | {NAMES[r['strategy']]} | {r['iteration_s']:.2f} | {r['paper_s']:.2f} | "
                     f"{r['model_over_paper']:.2f} | {r['gemm_s']:.2f} | {r['memory_s']:.2f} | {r['comm_s']:.3f} | "
                     f"{r['p2p_s']:.4f} | {r['bubble_fraction']:.2f} | {r['stage_collectives']:.0f} | "
                     f"{r['stage_comm_bytes'] / 2**30:.2f} | {r['mfu']:.2f} |")
    ratios = [r["model_over_paper"] for r in rows if r["table"] == "paper" and r["model_over_paper"]]
    if ratios:
        gmean = float(np.exp(np.mean(np.log(ratios))))
        lines += ["", f"model / paper over the {len(ratios)} points: {min(ratios):.2f} to {max(ratios):.2f}, "
                      f"geometric mean {gmean:.2f} (one of them, the calibration point, is 1.00 by construction)."]
    if res.get("sensitivity"):
        lines += ["", "Sensitivity: one stated A100 constant changed, eta refitted on the calibration point:", "",
                  "| variant | eta | model / paper min | max | geometric mean |", "|---|---|---|---|---|"]
        for v in res["sensitivity"]:
            lines.append(f"| {v['variant']} | {v['eta']:.3f} | {v['min']:.2f} | {v['max']:.2f} | {v['gmean']:.2f} |")
    lines += ["", "Speed-ups (iteration-time ratios), model vs paper:", "",
              "| config | full / BTP model | full / BTP paper | vanilla / BTP model | vanilla / BTP paper |",
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


def chart(res: dict, path: str) -> None:
    from strategy_bars import save, strategy_bars, subplots  # noqa: PLC0415

    rows = res["rows"]
    fig, axes = subplots(2, (12, 4.2))
    for ax, table, title in ((axes[0], "paper", "A100: model (bars) vs BOOST (black ticks)"),
                             (axes[1], None, "H200 projection")):
        sel = [r for r in rows if (r["table"] == table if table else r["table"] in ("h200", "big"))]
        setups = list(dict.fromkeys(r["setup"] for r in sel))
        cell = {(r["setup"], r["strategy"]): r for r in sel}
        bars = {s: [cell[u, s]["iteration_s"] for u in setups] for s in STRATEGIES}
        ticks = {s: [cell[u, s]["paper_s"] for u in setups] for s in STRATEGIES} if table else None
        strategy_bars(ax, setups, bars, NAMES, ticks=ticks, tick_label="BOOST (paper)",
                      ylabel="seconds per iteration", title=title, label_size=8)
    save(fig, path, f"Latency-bandwidth + roofline model from compiled HLO (eta = {res['eta']:.3f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1B and 7B only, no 30B/40B projection")
    ap.add_argument("--out", default=RESULTS, help="results folder")
    ap.add_argument("--from-json", default=None, metavar="PATH", help="re-render md/png from a scaling_model.json")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.from_json:
        with open(args.from_json) as fh:
            res = json.load(fh)
    else:
        from boostjax.devices import exact_low_precision, simulate_devices  # noqa: PLC0415

        simulate_devices(8)  # before JAX starts: TP8 for the 30B/40B projection
        exact_low_precision()  # bf16 collectives stay bf16 in the HLO
        setups = tuple(s for s in PAPER_SETUPS if not args.quick or s.name in ("1b", "7b"))
        res = run(setups, () if args.quick else BIG_SETUPS)
        res["quick"] = args.quick
        with open(os.path.join(args.out, "scaling_model.json"), "w") as fh:
            json.dump(res, fh, indent=1)
    md = markdown(res)
    with open(os.path.join(args.out, "scaling_model.md"), "w") as fh:
        fh.write(md)
    chart(res, os.path.join(args.out, "scaling_model.png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
