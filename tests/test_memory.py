"""Per-device memory of the compiled step (`boostjax.analysis.memory`) and the tied remat that keeps it flat."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from boostjax.config import Config, TrainConfig, preset
from boostjax.training.checks import validate
from boostjax.models.llama import LLaMA
from boostjax.analysis import memory
from boostjax.training.step import build_step_fns
from helpers import random_params

TINY = preset("tiny", n_layers=2)


@pytest.mark.parametrize("mesh,strategy,extra", [("data=2,model=2", "btp", {"zero": 1, "grad_accum": 2})])
def test_report_is_the_train_step(mesh, strategy, extra):
    """The abstract compile is the step `boostjax train` compiles: the same memory_analysis() as
    `build_step_fns(...).compile` on real arrays, and its argument buffers are weights + optimizer + batch."""
    r = memory.memory_report(TINY, mesh, 4, 16, strategy, remat="lowrank", dtype="float32", **extra)
    cfg = validate(Config(TINY, TrainConfig(batch=4, seq=16, strategy=strategy, mesh=mesh, remat="lowrank",
                                            dtype="float32", **extra)))
    # weights drawn on the host (memory_analysis() reads shapes, dtypes and layouts, never values): an eager
    # init would compile a program per op and shape
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LLaMA(TINY, rngs=nnx.Rngs(0))))
    host = random_params(abstract.to_pure_dict(), np.random.default_rng(0), 0.02)
    fns = build_step_fns(cfg, graphdef, host)
    train_state = fns.init(host)
    rows = np.zeros((4 * extra.get("grad_accum", 1), 16), np.int32)
    real = memory.memory_fields(fns.compile(train_state, {"inputs": rows, "targets": rows}))
    assert {k: r[k] for k in real} == real
    assert r["argument_bytes"] == r["weight_bytes"] + r["optimizer_bytes"] + r["batch_bytes"]
    assert r["peak_bytes_per_device"] == r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"]
    assert r["peak_bytes_per_device"] == r["weight_bytes"] + r["optimizer_bytes"] + r["activation_bytes"]
    n_params = sum(int(np.prod(a.shape)) for a in __import__("jax").tree.leaves(host))
    tp = 2 if mesh else 1
    assert n_params * 4 / tp <= r["weight_bytes"] <= n_params * 4  # fp32 masters, this device's TP shard
    if extra.get("zero"):  # ZeRO-1: Adam's two moments split over data=2 -> about one weight's worth
        assert r["optimizer_bytes"] < 1.1 * r["weight_bytes"]
    else:
        assert r["optimizer_bytes"] >= 2 * r["weight_bytes"]


def test_lowrank_remat_peak_grows_by_the_saved_latents_not_the_scores():
    """With the materialised attention ([b, h, t, t] fp32 scores, 1 MiB per layer here) a layer more adds
    only what `--remat lowrank` saves (~0.6 MiB): no layer is recomputed before the backward reaches it
    (untied, XLA's CPU scheduler recomputed every layer first: +6.4 MiB per layer)."""
    temps = []
    for n in (1, 2):
        m = preset("tiny", n_layers=n, attention="xla", max_seq_len=256)
        temps.append(memory.memory_report(m, "data=1,model=2", 2, 256, "btp", remat="lowrank",
                                          dtype="float32")["temp_bytes"])
    scores = 2 * (TINY.n_heads // 2) * 256 * 256 * 4
    assert 0 < temps[1] - temps[0] < scores, temps
