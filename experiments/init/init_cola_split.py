"""How to split a dense projection's SVD over CoLA's `silu(x A) B` (docs/init_from_hf.md).

On a random 2-layer LLaMA (d 32, d_ff 64, norms away from 1), the relative logits error against the
dense model of: the svd kind (`x A B`, the rank-r truncation), CoLA with the exact ± pairs that
`boostjax.interop.pretrained` uses (rank r carries r/2 singular triplets), and CoLA with the SVD factors
scaled into SiLU's near-linear range (`A·c`, `B·2/c`).

    python -m experiments.init.init_cola_split      # prints the table, writes <out>/init_cola_split.md; about 30 s on a laptop CPU
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from boostjax.interop import hf
from boostjax.interop import pretrained
from boostjax.config import ModelConfig
from boostjax.models.llama import LLaMA
from experiments import common

DENSE = ModelConfig(kind="llama", vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=64)


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_out(ap, "init_cola_split", from_json=False)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    md = common.Lines()
    rng = np.random.default_rng(0)
    dense = jax.tree.map(lambda p: jnp.asarray(p + (0.2 * rng.normal(size=p.shape) if p.ndim == 1 else 0),
                                               jnp.float32),
                         nnx.to_pure_dict(nnx.state(LLaMA(DENSE, rngs=nnx.Rngs(params=1)), nnx.Param)))
    tokens = jnp.asarray(rng.integers(0, 256, (2, 16)), jnp.int32)
    ref = hf.build_model(DENSE, dense)(tokens)

    def err(cfg, params) -> float:
        out = hf.build_model(cfg, params)(tokens)
        return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))

    md("| rank | svd | cola ± pairs | cola linearised c=1 | c=0.3 | c=0.1 | c=0.01 |\n|---|---|---|---|---|---|---|")
    for r in (8, 16, 32):
        svd = replace(DENSE, kind="svd", rank=r)
        cola = replace(DENSE, kind="cola", rank=r, only_lr_act=False)  # the dense SwiGLU, as --init-from-hf
        p_svd = pretrained.lowrank_from_dense(svd, dense)[0]
        row = [err(svd, p_svd), err(cola, pretrained.lowrank_from_dense(cola, dense)[0])]
        for c in (1.0, 0.3, 0.1, 0.01):
            def scale(path, x, c=c):
                name = str(path[-1].key)
                return x * c if name.startswith("a_") else x * 2 / c if name.startswith("b_") else x
            row.append(err(cola, jax.tree_util.tree_map_with_path(scale, p_svd)))
        md(f"| {r} | " + " | ".join(f"{e:.4f}" for e in row) + " |")
    common.write(args.out, "init_cola_split", md=str(md), echo=False)


if __name__ == "__main__":
    main()
