"""`--init-from-hf` under every placement: the imported (or SVD-factored) weights must land on the mesh
exactly as a fresh init does, for each strategy, ZeRO stage and a pipeline (tests/test_init_from_hf.py
covers one device and BTP on data=1,model=2).

Per case: one training step started from a small random Hugging Face checkpoint (2 layers, d 32, GQA),
its logged loss against the single-device loss of the same initial weights on the same rows (fp32,
simulated CPU devices), and the mean reconstruction error the run reported.

    python -m experiments.init.init_layouts     # writes experiments/results/init_layouts.{json,md}
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import pathlib
import tempfile
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from boostjax.interop import hf
from boostjax.interop import pretrained
from boostjax.config import Config, ModelConfig, TrainConfig
from boostjax.data import batch_iterator, load_corpus
from boostjax.models.llama import LLaMA
from boostjax.training.trainer import train

from experiments import common

DENSE = ModelConfig(kind="llama", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                    init_std=0.2)  # logits of O(1): a misplaced shard changes the loss visibly
CASES = [  # (kind, rank, strategy, mesh, zero)
    ("llama", 0, "none", "", 0),
    ("llama", 0, "fullrank-tp", "data=2,model=2", 3),
    ("llama", 0, "none", "stage=2", 0),
    ("svd", 8, "btp", "data=2,model=2", 1),
    ("svd", 8, "btp", "data=2,model=2", 3),
    ("cola", 8, "vanilla-tp", "model=2", 0),
    ("lax", 8, "btp", "model=2", 0),
    ("lax", 9, "none", "data=2", 1),
    ("cola", 8, "btp", "data=2,stage=2,model=2", 0),
]


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_out(ap, "init_layouts", from_json=False)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="init-layouts-"))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda p: jnp.asarray(p + (0.2 * rng.normal(size=p.shape) if p.ndim == 1 else 0),
                                                jnp.float32),
                          nnx.to_pure_dict(nnx.state(LLaMA(DENSE, rngs=nnx.Rngs(params=1)), nnx.Param)))
    folder = hf.to_hf((DENSE, params), tmp / "hf")
    rows = []
    for kind, rank, strategy, mesh, zero in CASES:
        model = replace(DENSE, kind=kind, rank=rank or DENSE.rank)
        t = TrainConfig(init_from_hf=str(folder), strategy=strategy, mesh=mesh, zero=zero, steps=1, batch=4,
                        seq=16, eval_batches=1, progress=False, out=str(tmp / f"run{len(rows)}"))
        res = train(Config(model, t))
        start = params if kind == "llama" else pretrained.lowrank_from_dense(res.config.model, params)[0]
        corpus = load_corpus()  # the rows train's first step reads
        b = batch_iterator(corpus.train, corpus.train_docs, t.batch, t.seq, t.seed, vocab_size=256).batch_at(0)
        with jax.default_matmul_precision("highest"):
            want = float(hf.build_model(res.config.model, start).loss(jnp.asarray(b["inputs"]),
                                                                      jnp.asarray(b["targets"])))
        got = next(m["loss"] for m in res.metrics if "loss" in m)
        rows.append({"kind": kind, "rank": rank, "strategy": strategy, "mesh": mesh or "1 device", "zero": zero,
                     "loss": got, "single_device_loss": want, "rel_err": abs(got - want) / want,
                     "mean_recon_err": res.extra["init"].get("mean")})
        print(rows[-1], flush=True)
    lines = ["| kind | rank | strategy | mesh | zero | step-1 loss | 1-device loss | rel. err | mean recon. err |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['rank'] or '-'} | {r['strategy']} | {r['mesh']} | {r['zero']} | {r['loss']:.6f} | "
              f"{r['single_device_loss']:.6f} | {r['rel_err']:.1e} | "
              f"{'-' if r['mean_recon_err'] is None else format(r['mean_recon_err'], '.4f')} |" for r in rows]
    common.write(args.out, "init_layouts", data=rows, md="\n".join(lines), indent=2)


if __name__ == "__main__":
    main()
