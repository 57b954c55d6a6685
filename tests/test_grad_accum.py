"""Gradient accumulation (`--grad-accum N`): the step on N micro-batches of B rows equals the step on
the batch of N·B rows (the same rows), on one device (8-bit Adam, delayed weights), a BTP mesh and a
pipeline mesh (AdamW); `experiments/tp/accum_zero.py` covers the other strategies and optimizers."""

from dataclasses import replace

import jax
import numpy as np
import pytest

from boostjax.config import Config, ModelConfig, TrainConfig
from boostjax.data import BatchIterator
from boostjax.training.step import build_step_fns, train_state_shapes
from boostjax.models.llama import init_model
from helpers import adam8bit_code_flips, beyond_code_flips

TOKENS = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16)
MODEL = ModelConfig(kind="cola", d_model=32, n_layers=2, n_heads=2, d_ff=64, rank=16, vocab_size=256, max_seq_len=16)


def run_steps(cfg: Config, batches: list[dict]) -> tuple[list[float], list[dict], str, list]:
    """Losses of one optimizer step per batch, the per-layer parameters before and after every step, the
    compiled step, the optimizer state after every step."""
    graphdef, params = init_model(cfg)
    fns = build_step_fns(cfg, graphdef, params)
    state = fns.init(params)
    step = fns.compile(state, batches[0])
    losses, weights, opt_states = [], [jax.device_get(fns.to_canonical(state.params))], []
    for b in batches:
        state, m = step(state, fns.put_batch(b))
        losses.append(float(m["loss"]))
        weights.append(jax.device_get(fns.to_canonical(state.params)))
        opt_states.append(jax.device_get(state.opt_state))
    return losses, weights, step.as_text(), opt_states


@pytest.mark.parametrize("mesh,strategy,optimizer", [
    ("", "none", "adam8bit"),  # with the delayed-weights emulation (--pipeline-delay 2)
    ("data=2,model=2", "btp", "adamw"),
    ("data=2,stage=2,model=1", "none", "adamw"),
])
def test_accumulated_step_equals_the_large_batch_step(mesh, strategy, optimizer):
    n, b, delay = 3, 4, 2 if optimizer == "adam8bit" else 1
    data = BatchIterator(TOKENS, n * b, 16, 0, vocab_size=MODEL.vocab_size)
    batches = [data.next() for _ in range(3)]
    big = TrainConfig(batch=n * b, seq=16, strategy=strategy, mesh=mesh, optimizer=optimizer, lr=1e-3,
                      pipeline_delay=delay, progress=False)
    ref = run_steps(Config(MODEL, big), batches)
    got = run_steps(Config(MODEL, replace(big, batch=b, grad_accum=n)), batches)
    # A loss is a mean of 192 per-token losses near 5.5, summed as one batch or as 3 micro-batch means:
    # a reordered fp32 sum may differ by ~log2(192) ulps and each token's logsumexp by its own ulps
    # (another program): measured 1 to 3 ulps (<= 2.6e-7, 0.26 of the old bound 1e-6) on SSE4_2, AVX2
    # and AVX-512; 5e-6 (test_tp's bound) leaves 19x. A repeated micro-batch moves it by 2e-3.
    loss_err = max(abs(x - y) / abs(y) for x, y in zip(got[0], ref[0]))
    # 8-bit Adam's codes equal but where rounding lands a moment on a map midpoint (helpers; grad_rtol
    # 2e-5, the suite's fp32 gradient bound: absmax measured within 1.8e-6), the parameters less what
    # those flips can move: none measured here on the three ISAs, but one flip moves the head by
    # ~2e-6 of its norm (test_tp). The rest is the updates' rounding: measured <= 3.8e-9 of the norm, so
    # 1e-6 leaves 260x. 1.01 x one micro-batch's gradient moves AdamW's parameters by 2.4e-6 (1.001:
    # 2.6e-7, under the bound); 8-bit Adam's absmax check fails from 1.0001 x.
    rest = beyond_code_flips(ref[1], got[1], adam8bit_code_flips(ref[3], got[3], grad_rtol=2e-5)).values()
    d, w = (np.concatenate([x[i] for x in rest]) for i in (0, 1))
    err = float(np.linalg.norm(d) / np.linalg.norm(w))
    assert loss_err < 5e-6 and err < 1e-6, (loss_err, err)
    # the micro-batches are cut where each data shard's rows already are: no collective moves the batch
    for op in ("all-gather", "all-to-all", "collective-permute"):
        assert got[2].count(f" {op}(") == ref[2].count(f" {op}("), op


@pytest.mark.parametrize("mesh,strategy,zero", [("", "none", 0), ("data=2,model=2", "btp", 1),
                                                ("data=2,stage=2,model=1", "none", 3)])
def test_train_state_shapes_are_what_init_and_put_batch_place(mesh, strategy, zero):
    """`train_state_shapes` (nothing allocated) reports the shapes and shardings `StepFns` produces."""
    cfg = Config(MODEL, TrainConfig(batch=4, seq=16, strategy=strategy, mesh=mesh, zero=zero, grad_accum=3,
                                    optimizer="adam8bit", progress=False))
    graphdef, params = init_model(cfg)
    shapes = train_state_shapes(cfg, graphdef, jax.eval_shape(lambda: params))
    fns = build_step_fns(cfg, graphdef, params)
    placed = fns.init(params)
    batch = fns.put_batch({k: np.zeros((12, 16), np.int32) for k in ("inputs", "targets")})
    assert jax.tree.structure(shapes) == jax.tree.structure((placed, batch))
    for want, got in zip(jax.tree.leaves(shapes), jax.tree.leaves((placed, batch))):
        assert (want.shape, want.dtype) == (got.shape, got.dtype)
        assert want.sharding.is_equivalent_to(got.sharding, len(got.shape)), (want.sharding, got.sharding)
