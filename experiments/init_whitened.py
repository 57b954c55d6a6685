"""Plain SVD vs activation-aware (whitened, SVD-LLM) starts from a pretrained LLaMA (docs/init_from_hf.md).

    python experiments/init_whitened.py --hf PATH --data TOKENISED_FOLDER --rank 192 > experiments/results/init_whitened.md

For each low-rank kind and factoring (`boostjax.interop.pretrained.factored`, what `train --init-from-hf
--model KIND --rank R --init-factor F` starts from): the held-out loss (nats per token) and perplexity of
the factored model on the first --eval-tokens tokens of --data's validation split (`boostjax.evaluate`,
windows of --seq), the mean relative weight error and the mean held-out output error of its matrices
(init_report.json's "mean" and "output" "mean"); the dense checkpoint's loss first, and the uniform
guess ln(vocab). Whitened fits the first --calib-tokens tokens of the training split (rows of --seq).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace

from boostjax.config import Config, TrainConfig
from boostjax.data import load_corpus
from boostjax.inference.evaluation import evaluate
from boostjax.interop import hf, pretrained


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, help="Hugging Face LLaMA folder")
    ap.add_argument("--data", required=True, help="data tokenised with the checkpoint's tokenizer")
    ap.add_argument("--rank", type=int, default=192, help="rank of every factored projection")
    ap.add_argument("--kinds", default="svd,cola", help="comma-separated low-rank kinds")
    ap.add_argument("--calib-tokens", default="8192", help="comma-separated calibration sizes of the whitened start")
    ap.add_argument("--seq", type=int, default=512, help="tokens per row (calibration and evaluation)")
    ap.add_argument("--eval-tokens", type=int, default=8192, help="validation tokens evaluated")
    ap.add_argument("--batch", type=int, default=4, help="evaluation rows per call")
    args = ap.parse_args()

    src_cfg, dense = hf.read_hf(args.hf)
    corpus = load_corpus(args.data)
    val = corpus.val[:args.eval_tokens]

    def loss(cfg, params) -> tuple[float, float]:
        r = evaluate(hf.build_model(cfg, params), val, seq=args.seq, batch=args.batch)
        return r["loss"], r["perplexity"]

    print(f"{args.hf}, rank {args.rank}; {len(val)} held-out tokens of {args.data} (validation split), "
          f"windows of {args.seq}; uniform guess ln({src_cfg.vocab_size}) = {math.log(src_cfg.vocab_size):.2f} nats\n")
    print("| kind | factoring | calibration tokens | weight error (mean) | held-out output error (mean) | "
          "loss (nats) | perplexity | factoring s |\n|---|---|---|---|---|---|---|---|", flush=True)
    dense_loss, dense_ppl = loss(src_cfg, dense)
    print(f"| dense | - | - | 0 | 0 | {dense_loss:.3f} | {dense_ppl:.1f} | - |", flush=True)
    runs = [("svd", 0)] + [("whitened", int(n)) for n in args.calib_tokens.split(",")]
    for kind in args.kinds.split(","):
        m = replace(src_cfg, kind=kind, rank=args.rank, only_lr_act=False)
        for factor, n in runs:
            cfg = Config(m, TrainConfig(init_factor=factor, calib_tokens=n, seq=args.seq, data=args.data))
            t0 = time.perf_counter()
            params, report = pretrained.factored(cfg, dense, corpus)
            took = time.perf_counter() - t0
            lo, ppl = loss(m, params)
            print(f"| {kind} | {factor} | {n or '-'} | {report['mean']:.4f} | {report['output']['mean']:.4f} | "
                  f"{lo:.3f} | {ppl:.1f} | {took:.0f} |", flush=True)


if __name__ == "__main__":
    main()
