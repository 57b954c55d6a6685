"""Applying an offload plan: loss/gradients equal to the plan-free step, host memory space in the
compiled (CPU) and cross-lowered (CUDA) programs, training with a plan, config checks, the planner's
memory prediction against `memory_analysis()`, and hybrid 8-bit Adam against AdamW."""

from __future__ import annotations

import json
from dataclasses import replace

import jax
import numpy as np
import pytest

from boostjax.config import Config, ConfigError, ModelConfig, TrainConfig, preset
from boostjax.training.checks import validate
from boostjax.runtime.hardware import HardwareProfile
from boostjax.models.llama import RematSegment, TiedLayer
from boostjax.offload import apply, check_plan_for
from boostjax.offload.costmodel import build_instance
from boostjax.offload.planner import Decisions, baseline_plan, make_plan
from boostjax.placement import Offloaded, SingleDevice, host_mask, local_loss_fn
from boostjax.optim import build_optimizer
from boostjax.training.step import build_step_fns, step_layout, train_step
from boostjax.models.llama import init_model
from boostjax.training.trainer import train
from helpers import assert_rel_close

MICRO = ModelConfig(d_model=32, n_layers=4, n_heads=2, d_ff=64, rank=8)
B, T = 2, 16
INST = build_instance(MICRO, B, T, "H800-80GB", budget_bytes=1e12, dtype_bytes=4, eight_bit=False)


def _decisions(boundary, inner, mode, flat=(False,) * 4) -> Decisions:
    host_b = [b == "host" for b in boundary]
    streams = [m in ("opt-host", "host") for m in mode]
    return Decisions(boundary=tuple(boundary), inner=tuple(inner), mode=tuple(mode), offload_lag=(0,) * 4,
                     fetch_lead=tuple(int(h) for h in host_b), param_fwd_lead=tuple(int(s) for s in streams),
                     param_bwd_lead=tuple(int(m == "host") for m in mode), grad_lag=tuple(int(s) for s in streams),
                     flat=tuple(flat))


PLANS = {
    # nested segment 0-1 starting from a host boundary; host-streamed and opt-host layers
    "nested": make_plan(INST, _decisions(("host", "recompute", "host", "device"),
                                         ("latents", "latents_attn", "all", "boundary"),
                                         ("host", "device", "opt-host", "device")), "manual"),
    # Chen-style flat segment over layers 0-2, then a host boundary with no remat inside
    "flat": make_plan(INST, _decisions(("device", "recompute", "recompute", "host"),
                                       ("boundary", "boundary", "boundary", "all"),
                                       ("device", "host", "device", "opt-host"), flat=(True, False, False, False)),
                      "manual"),
    # one checkpoint per layer, every inner option, one offloaded boundary
    "single": make_plan(INST, _decisions(("device", "host", "device", "device"), ("all", "all", "latents", "boundary"),
                                         ("device",) * 4), "manual"),
}


def _cfg(**kw) -> Config:
    return Config(MICRO, TrainConfig(batch=B, seq=T, **kw))


def _close_on_scale(got, want, rel: float = 1e-5) -> None:
    """Per leaf, max|got - want| <= rel * max|want|. A fixed atol is no bound for Adam's v: after two
    steps 95 % of its entries lie below 1e-7. Both sides run the same arithmetic here (bit-identical on
    CPU); a reordered fp32 sum would give ~1e-7 of the scale, so rel = 1e-5 leaves ~100x."""
    assert_rel_close(got, want, rel, ord=np.inf)


def _offloaded(cfg: Config, graphdef, plan) -> Offloaded:
    """The placement `boostjax.placement.choose` gives `cfg` with `plan` (a `Plan` object, not a file)."""
    check_plan_for(plan, cfg, require_record=False)
    return Offloaded(SingleDevice(cfg, graphdef, remat=apply.schedule(plan)), plan)


@pytest.fixture(scope="module")
def model():
    graphdef, params = init_model(_cfg())
    params = jax.tree.map(np.asarray, params)  # host copies: the donating steps below cannot delete them
    rng = np.random.default_rng(0)
    batch = {k: rng.integers(0, 256, (B, T), dtype=np.int32) for k in ("inputs", "targets")}
    return graphdef, params, batch


@pytest.fixture(scope="module")
def reference(model):
    graphdef, params, batch = model
    return jax.jit(jax.value_and_grad(local_loss_fn(_cfg(), graphdef)))(params, batch)


def test_schedule_follows_the_plan():
    sched = apply.schedule(PLANS["nested"])
    assert isinstance(sched[0], RematSegment) and len(sched[0].inner) == 2 and len(sched) == 3
    assert all(isinstance(p, TiedLayer) for p in sched[0].inner)  # nested: per-layer checkpoints, tied
    flat = apply.schedule(PLANS["flat"])
    assert isinstance(flat[0], RematSegment) and flat[0].inner == (None, None, None)
    # state on the host: the checkpointed single layers are tied both ways (weight gradients first)
    assert [type(e) for e in sched[1:]] == [TiedLayer, TiedLayer] and all(callable(e.policy) for e in sched[1:])
    single = apply.schedule(PLANS["single"])
    assert single[0] is None and all(callable(p) for p in single[1:])  # `all` on a device boundary: no remat
    assert not any(isinstance(e, TiedLayer) for e in single)  # every layer's state on the device: untied
    assert apply.describe(PLANS["nested"])[0].startswith("layers 0-1: nested segment, input boundary host")


@pytest.mark.parametrize("name", list(PLANS))
def test_loss_and_gradients_equal_plan_free(model, reference, name):
    graphdef, params, batch = model
    ref_loss, ref_g = reference
    placed = _offloaded(_cfg(offload_plan="unused"), graphdef, PLANS[name])
    loss, grads = jax.jit(jax.value_and_grad(placed.loss_fn))(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    _close_on_scale(grads, ref_g)
    # CUDA lowering: the boundaries the plan offloads are the only host placements (and fetches)
    # (on CPU, jax 0.10.2 lowers device_put to a memory kind only for GPU/TPU: the CPU program has
    # no trace of activation offload, so the check runs on the CUDA lowering, which needs no GPU)
    n_host = PLANS[name].boundary.count("host")
    text = apply.lower_for_gpu(jax.grad(placed.loss_fn), params, batch)
    gpu = apply.host_memory_report(text)
    assert gpu["annotate_pinned_host"] == n_host and gpu["annotate_device"] == n_host
    # what moves is the boundary [b, t, d] (the only offloaded name), out to pinned host and back
    boundary = f"tensor<{B}x{T}x{MICRO.d_model}xf32>"
    want = [("device", boundary)] * n_host + [("pinned_host", boundary)] * n_host
    assert sorted(apply.annotated_placements(text)) == want


def test_step_with_host_state_matches_plan_free(model, tmp_path):
    graphdef, params, batch = model
    path = tmp_path / "plan.json"
    path.write_text(PLANS["nested"].to_json())
    cfg_ref, cfg = _cfg(), _cfg(offload_plan=str(path))
    validate(cfg)
    out = {}
    for key, c in (("ref", cfg_ref), ("plan", cfg)):
        fns = build_step_fns(c, graphdef, params)
        state = fns.init(params)
        step = fns.compile(state, batch)
        for _ in range(2):
            state, m = step(state, fns.put_batch(batch))
        out[key] = (state.params, state.opt_state, float(m["loss"]), step, fns, state)
    p, o, loss, step, fns, state = out["plan"]
    np.testing.assert_allclose(loss, out["ref"][2], rtol=1e-6)
    _close_on_scale(p, out["ref"][0])
    _close_on_scale(o, out["ref"][1])
    # layer 0 streams its parameters, layers 0 and 2 keep optimizer states on the host
    mask_p = host_mask(p, PLANS["nested"].param_place)
    mask_o = host_mask(o, PLANS["nested"].opt_place)
    kinds = [x.sharding.memory_kind for x in jax.tree.leaves(p)]
    assert kinds == ["pinned_host" if h else "device" for h in jax.tree.leaves(mask_p)]
    assert {x.sharding.memory_kind for x, h in zip(jax.tree.leaves(o), jax.tree.leaves(mask_o)) if h} == {"pinned_host"}
    n_host = sum(jax.tree.leaves(mask_p)) + sum(jax.tree.leaves(mask_o))
    assert 0 < sum(jax.tree.leaves(mask_p)) < len(kinds)
    # compiled CPU program: every host-resident input and output in memory space 5 (pinned host)
    assert apply.host_memory_report(step.as_text())["entry_s5"] == 2 * n_host
    # CUDA lowering of the same step: host<->device moves of that state and the 2 offloaded boundaries
    lay = step_layout(cfg, graphdef, params)
    gpu = apply.host_memory_report(apply.lower_for_gpu(
        train_step(lay.placement.loss_fn, lay.tx, homes=lay.homes), state, fns.put_batch(batch)))
    assert gpu["annotate_pinned_host"] == n_host + 2 and gpu["annotate_device"] == n_host + 2
    # eval on host-resident parameters
    np.testing.assert_allclose(fns.eval_loss(p, fns.put_batch(batch)),
                               out["ref"][4].eval_loss(out["ref"][0], batch), rtol=1e-6)


def test_check_plan_for(tmp_path):
    """`check_plan_for` (the one check that a plan fits a run; `validate` no longer reads plans)."""
    with pytest.raises(ConfigError, match="does not exist"):
        check_plan_for(str(tmp_path / "missing.json"), _cfg())
    path = tmp_path / "plan.json"
    path.write_text(PLANS["single"].to_json())
    with pytest.raises(ConfigError, match="the plan has 4 layers but n_layers=2"):
        check_plan_for(str(path), Config(replace(MICRO, n_layers=2), TrainConfig(batch=B, seq=T)))
    with pytest.raises(ConfigError, match="planned for train.strategy='none' but this run has train.strategy='btp'"):
        check_plan_for(str(path), _cfg(offload_plan=str(path), strategy="btp", mesh="data=1,model=2"))
    with pytest.raises(ConfigError, match="remat"):
        check_plan_for(str(path), _cfg(offload_plan=str(path), remat="full"))
    check_plan_for(str(path), validate(_cfg(offload_plan=str(path))))
    dense = Config(replace(MICRO, kind="llama"), TrainConfig(batch=B, seq=T, offload_plan=str(path)))
    graphdef, params = init_model(dense)
    with pytest.raises(ConfigError, match="planned for model.kind='cola' but this run has model.kind='llama'"):
        build_step_fns(dense, graphdef, params)
    (tmp_path / "bad.json").write_text(json.dumps({"x": 1}))
    with pytest.raises(ConfigError, match="not a plan file"):
        check_plan_for(str(tmp_path / "bad.json"), _cfg())


def test_train_with_offload_plan_loss_falls(tmp_path):
    path = tmp_path / "plan.json"  # the flat plan's decisions, planned for this run's batch and seq
    inst = build_instance(MICRO, 8, 32, "H800-80GB", budget_bytes=1e12, dtype_bytes=4, eight_bit=False)
    path.write_text(make_plan(inst, PLANS["flat"].decisions, "manual").to_json())
    res = train(Config(MICRO, TrainConfig(steps=40, batch=8, seq=32, log_every=5, eval_every=40, eval_batches=1,
                                          ckpt_every=40, progress=False, out=str(tmp_path / "run"),
                                          offload_plan=str(path))))
    assert res.losses[-1] < 0.75 * res.losses[0], res.losses
    assert {x.sharding.memory_kind for x in jax.tree.leaves(res.params["layers"][1])} == {"pinned_host"}
    assert np.isfinite(np.asarray(res.model(np.zeros((1, 8), np.int32)))).all()  # host params come back


def _manual(boundary: tuple[str, ...], inner: tuple[str, ...]) -> Decisions:
    L = len(boundary)
    return Decisions(boundary=boundary, inner=inner, mode=("device",) * L, offload_lag=(0,) * L,
                     fetch_lead=tuple(int(b == "host") for b in boundary), param_fwd_lead=(0,) * L,
                     param_bwd_lead=(0,) * L, grad_lag=(0,) * L)


@pytest.mark.parametrize("kind,batch,seq,mixed,baselines", [
    ("cola", 8, 64, _manual(("host", "device"), ("latents", "all")), ("no-offload", "full-remat")),
    ("llama", 16, 32, _manual(("device", "host", "recompute"), ("attn", "attn_out", "boundary")), ("full-remat",)),
])
def test_memory_prediction_against_compiled_step(kind, batch, seq, mixed, baselines):
    """memory_analysis() of the compiled step (argument + output - alias + temp; CPU memory-optimised
    scheduler; clip 0, see `experiments/offload/offload.py`) is within 15 % of the planner's device peak for
    the same schedule (`cpu_equivalent`: on CPU nothing is really offloaded), for no remat, full remat
    and a plan mixing keep / offload / recompute (llama: with a nested two-layer segment)."""
    L = len(mixed.boundary)
    cfg = Config(preset("tiny", kind=kind, n_layers=L),
                 TrainConfig(batch=batch, seq=seq, clip=0.0, offload_plan="unused"))
    inst = apply.instance_for(cfg, HardwareProfile("slow", 64 << 30, 2e11, 2e10, 2e10, 256 << 30), budget_bytes=1e12)
    graphdef, params = init_model(cfg)
    batch_ = {k: np.zeros((batch, seq), np.int32) for k in ("inputs", "targets")}
    ratios, measured = [], []
    for plan in (make_plan(inst, mixed, "manual"), *(baseline_plan(inst, b) for b in baselines)):
        fns = build_step_fns(cfg, graphdef, params, placement=_offloaded(cfg, graphdef, plan))
        c = fns.compile(fns.init(params), batch_)
        measured.append(apply.compiled_memory(c)["total_bytes"])
        ratios.append(measured[-1] / apply.cpu_equivalent(inst, plan)[0])
    if "no-offload" in baselines:
        assert measured[1] > max(measured[0], measured[2]), measured  # remat saves memory
    assert all(0.85 <= r <= 1.15 for r in ratios), ratios


def test_adam8bit_short_run_close_to_adamw(tmp_path):
    """Same model, data and schedule: the final training and validation losses of hybrid 8-bit Adam
    lie within 2 % of AdamW's, and the 8-bit path really quantises this model's large tensors."""
    from boostjax.optim.adam8bit import QTensor

    model = preset("tiny", n_layers=1)
    runs = {}
    for opt in ("adamw", "adam8bit"):
        cfg = Config(model, TrainConfig(steps=20, batch=8, seq=32, log_every=5, eval_every=20, eval_batches=2,
                                        ckpt_every=20, progress=False, optimizer=opt, out=str(tmp_path / opt)))
        runs[opt] = train(cfg)
    tx = build_optimizer(cfg.train, runs["adam8bit"].params)
    leaves = jax.tree.leaves(tx.init(runs["adam8bit"].params), is_leaf=lambda x: isinstance(x, QTensor))
    assert sum(isinstance(x, QTensor) for x in leaves) >= 4
    a, b = runs["adamw"], runs["adam8bit"]
    # 0.81 with CoLA's init (Xavier-scale products start slower on 20 steps than the former 0.02 B's)
    assert a.losses[-1] < 0.85 * a.losses[0] and b.losses != a.losses  # the 8-bit moments change the run
    val = lambda r: next(m["val_loss"] for m in reversed(r.metrics) if "val_loss" in m)  # noqa: E731
    assert abs(b.losses[-1] - a.losses[-1]) / a.losses[-1] < 0.02, (a.losses, b.losses)
    assert abs(val(b) - val(a)) / val(a) < 0.02, (val(a), val(b))
