"""Plain SVD vs activation-aware (whitened, SVD-LLM) starts from a pretrained LLaMA (docs/init_from_hf.md).

    python -m experiments.init.init_whitened --hf PATH --data TOKENISED_FOLDER --rank 192   # -> <out>/init_whitened.md

For each low-rank kind and factoring (`boostjax.interop.pretrained.factored`, what `train --init-from-hf
--model KIND --rank R --init-factor F` starts from): the held-out loss (nats per token) and perplexity of
the factored model on the first --eval-tokens tokens of --data's validation split (`boostjax.evaluate`,
windows of --seq), the mean relative weight error and the mean held-out output error of its matrices
(init_report.json's "mean" and "output" "mean"); the dense checkpoint's loss first, and the uniform
guess ln(vocab). Whitened fits the first --calib-tokens tokens of the training split (rows of --seq).

CoLA's split of the whitened factors (--cola-split): boostjax's ± pairs (r // 2 directions, exact
through SiLU) against the linearised split, all r directions with `A_j · c_j`, `B_j · 2 / c_j` and
`c_j = EPS / rms_j` (rms_j: latent j's root mean square on the calibration inputs, from the Gram
matrix), `silu(c z) · 2 / c = z + c z² / 2 + ...`; with --finetune N each split is then trained N
AdamW steps (batch 4, lr 1e-3, no warmup; validation loss every 4 steps on 2 batches).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import tempfile
import time
from dataclasses import replace

import numpy as np

from boostjax.config import Config, TrainConfig
from boostjax.data import load_corpus
from boostjax.inference.evaluation import evaluate
from boostjax.interop import calibration, hf, pretrained
from boostjax.training.trainer import train
from experiments import common


def linearised(grams, eps: float) -> pretrained.Factor:
    """The whitened rank-r factors (all r directions) scaled into SiLU's near-linear range per column."""
    whitened = pretrained.whitened_factor(grams)

    def factor(name, w_io, kind, r, rng):
        a, b, err = whitened(name, w_io, "svd", r, rng)
        _, i, _, short = name.split(".")
        g = grams[int(i), calibration.INPUT_OF[short]]
        a64 = a.astype(np.float64)
        c = eps / np.maximum(np.sqrt(np.einsum("ij,ik,kj->j", a64, g, a64)), 1e-30)
        return (a * c).astype(np.float32), (b * (2 / c)[:, None]).astype(np.float32), err

    return factor


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, help="Hugging Face LLaMA folder")
    ap.add_argument("--data", required=True, help="data tokenised with the checkpoint's tokenizer")
    ap.add_argument("--rank", type=int, default=192, help="rank of every factored projection")
    ap.add_argument("--kinds", default="svd,cola", help="comma-separated low-rank kinds")
    ap.add_argument("--calib-tokens", default="8192", help="comma-separated calibration sizes of the whitened start")
    ap.add_argument("--seq", type=int, default=512, help="tokens per row (calibration and evaluation)")
    ap.add_argument("--eval-tokens", type=int, default=8192, help="validation tokens evaluated")
    ap.add_argument("--batch", type=int, default=4, help="evaluation rows per call")
    ap.add_argument("--cola-split", type=float, default=0.0, metavar="EPS",
                    help="compare CoLA's splits of the whitened start (first --calib-tokens), linearised at EPS")
    ap.add_argument("--finetune", type=int, default=0, metavar="N", help="with --cola-split: N training steps each")
    common.add_out(ap, "init_whitened", from_json=False)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    md = common.Lines()

    src_cfg, dense = hf.read_hf(args.hf)
    corpus = load_corpus(args.data)
    val = corpus.val[:args.eval_tokens]

    def loss(cfg, params) -> tuple[float, float]:
        r = evaluate(hf.build_model(cfg, params), val, seq=args.seq, batch=args.batch)
        return r["loss"], r["perplexity"]

    md(f"{args.hf}, rank {args.rank}; {len(val)} held-out tokens of {args.data} (validation split), "
          f"windows of {args.seq}; uniform guess ln({src_cfg.vocab_size}) = {math.log(src_cfg.vocab_size):.2f} nats\n")
    if args.cola_split:
        cola_split(args, src_cfg, dense, corpus, loss, md)
        common.write(args.out, "init_whitened_cola_split", md=str(md), echo=False)
        return
    md("| kind | factoring | calibration tokens | weight error (mean) | held-out output error (mean) | "
          "loss (nats) | perplexity | factoring s |\n|---|---|---|---|---|---|---|---|")
    dense_loss, dense_ppl = loss(src_cfg, dense)
    md(f"| dense | - | - | 0 | 0 | {dense_loss:.3f} | {dense_ppl:.1f} | - |")
    runs = [("svd", 0)] + [("whitened", int(n)) for n in args.calib_tokens.split(",")]
    for kind in args.kinds.split(","):
        m = replace(src_cfg, kind=kind, rank=args.rank, only_lr_act=False)
        for factor, n in runs:
            cfg = Config(m, TrainConfig(init_factor=factor, calib_tokens=n, seq=args.seq, data=args.data))
            t0 = time.perf_counter()
            params, report = pretrained.factored(cfg, dense, corpus)
            took = time.perf_counter() - t0
            lo, ppl = loss(m, params)
            md(f"| {kind} | {factor} | {n or '-'} | {report['mean']:.4f} | {report['output']['mean']:.4f} | "
                  f"{lo:.3f} | {ppl:.1f} | {took:.0f} |")
    common.write(args.out, "init_whitened", md=str(md), echo=False)


def cola_split(args, src_cfg, dense, corpus, loss, md: common.Lines) -> None:
    n = int(args.calib_tokens.split(",")[0])
    m = replace(src_cfg, kind="cola", rank=args.rank, only_lr_act=False)
    grams = calibration.input_grams(dataclasses.replace(src_cfg, kind="llama"), dense, corpus.train[:n], args.seq)
    held = corpus.val[:pretrained.HELDOUT_TOKENS]
    md(f"| CoLA split of the whitened start ({n} calibration tokens) | held-out output error (mean) | loss (nats) | "
          f"validation loss after steps 4, 8, ... of {args.finetune} |\n|---|---|---|---|")
    for name, factor in (("± pairs", pretrained.whitened_factor(grams)),
                         (f"linearised, eps {args.cola_split}", linearised(grams, args.cola_split))):
        factors = {}

        def keep(matrix, w_io, kind, r, rng, factor=factor):
            a, b, err = factor(matrix, w_io, kind, r, rng)
            factors[matrix] = (a, b)
            return a, b, err

        params, _ = pretrained.lowrank_from_dense(m, dense, factor=keep)
        errs = calibration.output_errors(dataclasses.replace(m, kind="llama"), "cola", dense, held, args.seq, factors)
        curve = ""
        if args.finetune:
            with tempfile.TemporaryDirectory() as out:
                t = TrainConfig(steps=args.finetune, batch=4, seq=args.seq, lr=1e-3, warmup=0, eval_every=4,
                                eval_batches=2, data=args.data, out=str(pathlib.Path(out) / "run"), progress=False,
                                tensorboard=False, ckpt_every=args.finetune)
                res = train(Config(m, t), init=params)
            curve = ", ".join(f"{r['val_loss']:.3f}" for r in res.metrics if "val_loss" in r)
        md(f"| {name} | {np.mean(list(errs.values())):.4f} | {loss(m, params)[0]:.3f} | {curve} |")


if __name__ == "__main__":
    main()
