"""Gradient accumulation and ZeRO over the combinations the unit tests leave out (tests/test_grad_accum.py
and tests/test_zero.py cover one device, BTP, a pipeline, AdamW, 8-bit Adam, rotation).

Per case: 3 optimizer steps of the variant against its reference on the same rows (`--grad-accum N`
on batch B vs batch N·B; `--zero Z` vs `--zero 0`), fp32, on simulated CPU devices; the relative
error of the losses and of the parameters, and whether they are bitwise equal.

    python -m experiments.tp.accum_zero       # writes experiments/results/accum_zero.{json,md}
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
from dataclasses import replace

import jax
import numpy as np

from boostjax.config import Config, ModelConfig, TrainConfig
from boostjax.data import BatchIterator
from boostjax.training.step import build_step_fns
from boostjax.models.llama import init_model

from experiments import common

TOKENS = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16)
COLA = ModelConfig(kind="cola", d_model=32, n_layers=2, n_heads=2, d_ff=64, rank=16, vocab_size=256, max_seq_len=16)
LLAMA = replace(COLA, kind="llama")
# (name, model, reference train config, variant's changes)
B = TrainConfig(batch=4, seq=16, lr=1e-3, progress=False)
CASES = [
    ("accum 3, vanilla-tp data=2,model=2, adamw", COLA, replace(B, batch=12, strategy="vanilla-tp", mesh="data=2,model=2"),
     dict(batch=4, grad_accum=3)),
    ("accum 3, fullrank-tp data=2,model=2, llama, nesterov", LLAMA,
     replace(B, batch=12, strategy="fullrank-tp", mesh="data=2,model=2", optimizer="nesterov"), dict(batch=4, grad_accum=3)),
    ("accum 2, one device, pipedream-lr, pipeline-delay 2", COLA, replace(B, batch=8, optimizer="pipedream-lr",
                                                                           pipeline_delay=2), dict(batch=4, grad_accum=2)),
    ("accum 2, btp data=1,stage=2,model=2, adamw", COLA, replace(B, batch=8, strategy="btp", mesh="data=1,stage=2,model=2"),
     dict(batch=4, grad_accum=2)),
    ("zero 3, btp data=2,stage=2,model=2, adamw", COLA, replace(B, strategy="btp", mesh="data=2,stage=2,model=2"),
     dict(zero=3)),
    ("zero 1 + accum 2, vanilla-tp data=2,model=2, adam8bit", COLA,
     replace(B, batch=8, strategy="vanilla-tp", mesh="data=2,model=2", optimizer="adam8bit"), dict(batch=4, grad_accum=2, zero=1)),
    ("zero 3, data=4, pipedream-lr, pipeline-delay 2", COLA, replace(B, mesh="data=4", optimizer="pipedream-lr",
                                                                      pipeline_delay=2), dict(zero=3)),
]


def run(model: ModelConfig, t: TrainConfig, steps: int = 3):
    cfg = Config(model, t)
    graphdef, params = init_model(cfg)
    fns = build_step_fns(cfg, graphdef, params)
    state = fns.init(params)
    data = BatchIterator(TOKENS, t.batch * t.grad_accum, t.seq, 0, vocab_size=model.vocab_size)
    step = fns.compile(state, data.batch_at(0))
    losses = []
    for _ in range(steps):
        state, m = step(state, fns.put_batch(data.next()))
        losses.append(float(m["loss"]))
    flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(fns.to_canonical(state.params)))])
    return np.asarray(losses), flat


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_out(ap, "accum_zero", from_json=False)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    rows = []
    for name, model, ref_t, change in CASES:
        (l0, p0), (l1, p1) = run(model, ref_t), run(model, replace(ref_t, **change))
        row = {"case": name, "loss_rel": float(np.max(np.abs(l1 - l0) / np.abs(l0))),
               "param_rel": float(np.linalg.norm(p1 - p0) / np.linalg.norm(p0)),
               "bitwise": bool(np.array_equal(p0, p1) and np.array_equal(l0, l1))}
        print(json.dumps(row), flush=True)
        rows.append(row)
    md = ["| case | max loss rel. error | params rel. error (3 steps) | bitwise |", "|---|---|---|---|"]
    md += [f"| {r['case']} | {r['loss_rel']:.1e} | {r['param_rel']:.1e} | {r['bitwise']} |" for r in rows]
    md += ["", f"`{common.command_line('accum_zero')}`"]
    common.write(args.out, "accum_zero", data=rows, md="\n".join(md), indent=2)


if __name__ == "__main__":
    main()
