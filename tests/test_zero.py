"""Optimizer state (ZeRO-1) and parameters (ZeRO-3) sharded over `data`: the same steps as the replicated
run, 1/D of the state per device, parameters gathered for the compute, and checkpoints that resume
across the layouts."""

from dataclasses import replace

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from boostjax.analysis import comm, hlo
from boostjax.config import Config, ModelConfig, TrainConfig
from boostjax.data import BatchIterator
from boostjax.sharding.rules import data_sharded
from boostjax.training.step import build_step_fns, train_state_shapes
from boostjax.models.llama import init_model
from boostjax.training.trainer import train
from helpers import adam8bit_code_flips, assert_close_ulps, beyond_code_flips, rel as _rel, ulps_apart

TOKENS = np.random.default_rng(1).integers(0, 256, 20_000).astype(np.uint16)
# the sharded and the replicated step compile apart: with FMA their gradients' sums round <= 2 ulps apart
# (0 without FMA: SSE4_2, AVX), Adam's m then by <= 2 ulps of its scale and v (their square) by <= 5, the
# parameters by <= 0.5 (three steps): bounds 4 and 32 ulps, and 8-bit Adam's codes to what a gradient
# rounding of 1e-6 (~8 ulps) can flip
ULPS_PARAMS, ULPS_STATE, GRAD_RTOL = 4, 32, 1e-6
MODEL = ModelConfig(kind="cola", d_model=32, n_layers=1, n_heads=2, d_ff=64, rank=16, vocab_size=256, max_seq_len=16)


def test_data_sharded_picks_the_first_free_divisible_dimension():
    assert data_sharded(P("model", None, None), (32, 3, 16), 2) == P("model", None, "data")
    assert data_sharded(P(), (6, 4), 4) == P(None, "data")
    assert data_sharded(P(), (3, 5), 2) == P()  # nothing divides: replicated
    assert data_sharded(P(None, "data"), (8, 8), 2) == P(None, "data")
    assert data_sharded(P(), (8,), 1) == P()


def _steps(cfg: Config, steps: int, state=None, start: int = 0):
    """`steps` optimizer steps from a fresh init (or from `state`, placed as `train_state_shapes` says):
    (losses, params, opt_state, the compiled step, put_batch, the whole TrainState, [(params, opt_state)]
    before and after every step, on the host)."""
    graphdef, params = init_model(cfg)
    fns = build_step_fns(cfg, graphdef, params)
    if state is None:
        state = fns.init(params)
    else:
        shapes = train_state_shapes(cfg, graphdef, params)[0]
        state = jax.device_put(state, jax.tree.map(lambda s: s.sharding, shapes))
    data = BatchIterator(TOKENS, cfg.train.batch * cfg.train.grad_accum, cfg.train.seq, 0, step=start,
                         vocab_size=cfg.model.vocab_size)
    step = fns.compile(state, data.batch_at(start))
    losses, history = [], [jax.device_get((state.params, state.opt_state))]
    for _ in range(steps):
        state, m = step(state, fns.put_batch(data.next()))
        losses.append(float(m["loss"]))
        history.append(jax.device_get((state.params, state.opt_state)))
    return losses, state.params, state.opt_state, step, fns.put_batch, state, history


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(jax.device_get(tree))])


def _per_device(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("mesh,strategy,optimizer,zero,accum,schedule", [
    ("data=2,model=2", "btp", "adamw", 1, 1, None),
    ("data=2,model=2", "btp", "rotation", 3, 1, None),
    ("data=2,model=2", "btp", "adam8bit", 3, 1, None),
    ("data=4", "none", "adamw", 3, 1, None),
    ("data=4", "none", "adam8bit", 1, 1, None),
    ("data=2", "none", "adamw", 1, 2, None),
    ("data=2,stage=2", "none", "adamw", 1, 1, "gpipe"),
    ("data=2,stage=2", "none", "adamw", 3, 2, "1f1b"),
    ("data=2,stage=2,model=2", "btp", "adamw", 1, 1, "1f1b"),
])
def test_sharded_state_steps_equal_the_replicated_steps(mesh, strategy, optimizer, zero, accum, schedule):
    """AdamW and 8-bit Adam: three steps from init equal the replicated run to a few ulps (the gradients
    reduce-scattered over data instead of all-reduced: the same sums; with `--grad-accum` each device
    sums its micro-batches' gradients and both layouts reduce once; the update is compiled for another
    shape, so its fusion may round an entry apart: 2.6e-10 after three steps with the element-wise
    emitter), 8-bit Adam's codes up to the flips that rounding can cause. Pipelines (two layers over
    `stage`, two micro-batches): GPipe's loss differentiated per device, 1F1B's own fp32 sums, then
    the same reduction over data; each layout compiles its own stage program, so they agree to rounding
    (on an AMD EPYC: parameters 1.2e-9 and state 7e-9 apart after three steps, under the 1e-6 bound).
    Rotation: its Gram statistics differ by rounding (1e-7) when a matmul is partitioned, and the exact
    `eigh` of these rank-deficient [m, m] statistics turns that into another basis of their null space
    (end to end 1.5e-4 on the parameters; the same sensitivity as test_tp's rotation test), so it is
    compared from one state: the replicated run's state after a refresh (step 3), placed in the sharded
    layout, and one more step (4, no refresh) in both layouts."""
    base = TrainConfig(batch=8 // accum, seq=16, strategy=strategy, mesh=mesh, optimizer=optimizer, lr=1e-3,
                       rot_refresh=2, grad_accum=accum, progress=False)
    model = MODEL
    if schedule:
        model, base = replace(MODEL, n_layers=2), replace(base, pipeline_schedule=schedule, microbatches=2)
    sharded = Config(model, replace(base, zero=zero))
    few_ulps = optimizer != "rotation" and not schedule
    ref = _steps(Config(model, base), 3)
    if optimizer == "rotation":
        state = jax.device_get(ref[5])
        got = _steps(sharded, 1, state, start=3)
        batch = BatchIterator(TOKENS, 8, 16, 0, vocab_size=MODEL.vocab_size).batch_at(3)
        state, m = ref[3](ref[5], ref[4](batch))
        ref = ([float(m["loss"])], state.params, state.opt_state)
    else:
        got = _steps(sharded, 3)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    print(f"{mesh} {optimizer} zero={zero}: params rel {_rel(got[1], ref[1]):.2e} ulps "
          f"{ulps_apart(got[1], ref[1]):.3g}, state rel {_rel(got[2], ref[2]):.2e}")
    assert _rel(got[1], ref[1]) < 1e-6 and _rel(got[2], ref[2]) < 1e-6
    if few_ulps:  # two programs (the sharded and the replicated step) over the same sums: a few ulps
        assert_close_ulps(np.float32(got[0]), np.float32(ref[0]), ulps=ULPS_PARAMS)
        if optimizer == "adam8bit":  # a moment within rounding of a map midpoint may take the next code
            params, states = ([h[i] for h in got[6]] for i in (0, 1))
            flips = adam8bit_code_flips([h[1] for h in ref[6]], states, grad_rtol=GRAD_RTOL)
            rest = beyond_code_flips([h[0] for h in ref[6]], params, flips)
            assert max(ulps_apart(w + d, w, np.float32) for d, w in rest.values()) <= ULPS_PARAMS, rest
        else:
            assert_close_ulps(got[1], ref[1], ulps=ULPS_PARAMS)
            assert_close_ulps(got[2], ref[2], ulps=ULPS_STATE)
    data = int(mesh.split(",")[0].split("=")[1])
    if schedule:  # the steps' reductions over data: zero 0 all-reduces, zero >= 1 reduce-scatters, half the bytes
        m = jax.tree.leaves(got[1])[0].sharding.mesh
        dp = [comm._data_parallel(hlo.collectives(r[3].as_text()), m.devices.shape, m.axis_names) for r in (got, ref)]
        assert "reduce-scatter" not in dp[1]["collectives"] and dp[0]["collectives"]["reduce-scatter"]["count"] > 0
        assert 0.5 <= dp[0]["reduce_ring_bytes"] / dp[1]["reduce_ring_bytes"] < 0.51
    # per device: the optimizer state (and with zero=3 the parameters) 1/D, but for leaves no dimension
    # of which divides by D (norm scales, step counters)
    assert _per_device(got[2]) < 1.1 * _per_device(ref[2]) / data + 2048
    if zero == 3:
        assert _per_device(got[1]) < 1.1 * _per_device(ref[1]) / data + 2048
        if strategy == "none" and not schedule:  # whole parameters, gathered over data (a pipeline gathers over stage)
            assert "all-gather" in got[3].as_text() and "all-gather" not in ref[3].as_text()


def test_checkpoints_resume_across_the_layouts(tmp_path):
    """A zero=0 checkpoint resumes with zero=1, whose checkpoint resumes with zero=0: the losses and
    parameters of the uninterrupted zero=0 run (a constant learning rate: the schedule depends on
    `steps`, which the resumed commands raise). With `--grad-accum 2` the data position (in optimizer
    steps of batch x 2 rows) resumes exactly, and tokens/s counts both micro-batches."""
    TOKENS.tofile(tmp_path / "tokens.bin")
    fast = TrainConfig(steps=6, batch=4, seq=16, mesh="data=2", lr=1e-3, warmup=0, min_lr_ratio=1.0, log_every=1,
                       eval_every=100, eval_batches=1, ckpt_every=2, data=str(tmp_path / "tokens.bin"), grad_accum=2,
                       progress=False)
    ref = train(Config(MODEL, replace(fast, out=str(tmp_path / "ref"))))
    out = str(tmp_path / "run")
    for steps, zero in ((2, 0), (4, 1), (6, 0)):
        res = train(Config(MODEL, replace(fast, steps=steps, zero=zero, out=out)))
        assert res.resumed_from == (steps - 2 or None)
    np.testing.assert_allclose(res.losses, ref.losses, rtol=1e-6)
    assert all(m["tokens_per_s"] * m["step_s"] == pytest.approx(4 * 2 * 16) for m in res.metrics if "step_s" in m)
    assert _rel(res.params, ref.params) < 1e-6
