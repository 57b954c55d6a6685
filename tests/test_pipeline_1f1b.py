"""The 1F1B pipeline schedule (`boostjax.sharding.pipeline_1f1b`): loss and every parameter gradient
equal GPipe's and the single-device reference for P = 2 and 4 stages, M = P and 2P micro-batches, BTP
(TP 2) and no TP, with remat; a training step through `build_step_fns` matches GPipe's."""

import json
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FAST_CPU, compile_with, rel as _rel, rel_by_path, seed_of  # FAST_CPU: ~40 % less compile
from experiments.rotation import pipeline_schedules
from test_tp import TINY, put_params

from boostjax.config import Config, TrainConfig
from boostjax.training.checks import validate
from boostjax.runs.folder import RunFolder
from boostjax.sharding.pipeline import pipeline_info
from boostjax.placement import choose, local_loss_fn
from boostjax.training.step import build_step_fns
from boostjax.models.llama import init_model

TOL = 1e-5  # norm-relative, fp32; measured <= 1e-6 on these cases


def _run(fn, *args):
    return jax.jit(fn).lower(*args).compile(FAST_CPU)(*args)


def _loss_and_grads(cfg: Config, params, batch):
    graphdef, _ = init_model(cfg)
    pl = choose(cfg, graphdef, params)
    loss, grads = _run(jax.value_and_grad(pl.loss_fn), put_params(pl, params), jax.device_put(batch, pl.batch_sharding))
    return float(loss), pl.to_canonical(grads)


# (mesh, strategy, kind, micro-batches, remat, also against GPipe): each P with M = P and M = 2P, each
# with BTP and without TP. Every case compiles two or three programs (~5 CPU-s each), so GPipe (itself
# checked against one device in test_pipeline.py) is compared directly on the two BTP cases only.
@pytest.mark.parametrize("mesh,strategy,kind,micro,remat,vs_gpipe", [
    ("data=2,stage=2,model=2", "btp", "cola", 2, "none", True),
    ("data=2,stage=2,model=1", "none", "svd", 4, "full", False),
    ("data=1,stage=4,model=2", "btp", "svd", 8, "lowrank", True),
    ("data=2,stage=4,model=1", "none", "llama", 4, "none", False),
])
def test_1f1b_matches_gpipe_and_one_device(mesh, strategy, kind, micro, remat, vs_gpipe):
    stages = int(mesh.split("stage=")[1][0])
    train = TrainConfig(strategy=strategy, mesh=mesh, microbatches=micro, remat=remat, batch=2 * micro, seq=8,
                        pipeline_schedule="1f1b")
    cfg = validate(Config(replace(TINY, kind=kind, n_layers=stages), train))
    graphdef, params = init_model(cfg)
    rng = np.random.default_rng(seed_of(mesh, kind))
    params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 0.1 + (p.ndim == 1), jnp.float32), params)
    batch = {k: jnp.asarray(rng.integers(0, TINY.vocab_size, (train.batch, train.seq)), jnp.int32)
             for k in ("inputs", "targets")}
    with jax.default_matmul_precision("highest"):
        ref_loss, ref = _run(jax.value_and_grad(local_loss_fn(cfg, graphdef)), params, batch)
        loss, grads = _loss_and_grads(cfg, params, batch)
        others = [(float(ref_loss), ref)]
        if vs_gpipe:
            others.append(_loss_and_grads(replace(cfg, train=replace(train, pipeline_schedule="gpipe")), params, batch))
    for other_loss, other in others:
        assert abs(loss - other_loss) < TOL * abs(other_loss)
        errs = rel_by_path(grads, other)
        assert len(errs) == len(jax.tree.leaves(params)) and max(errs.values()) < TOL, errs


def test_1f1b_train_step_matches_gpipe(monkeypatch):
    """Three optimizer steps (bf16 compute, fp32 masters) through `build_step_fns`."""
    compile_with(monkeypatch, FAST_CPU)
    model = replace(TINY, kind="cola", n_layers=2)
    runs = {}
    for schedule in ("gpipe", "1f1b"):
        cfg = validate(Config(model, TrainConfig(strategy="btp", mesh="data=2,stage=2,model=2", microbatches=2,
                                                 batch=4, seq=8, dtype="bfloat16", pipeline_schedule=schedule)))
        graphdef, params = init_model(cfg)
        fns = build_step_fns(cfg, graphdef, params)
        assert fns.info["schedule"] == schedule
        state = fns.init(params)
        rng = np.random.default_rng(5)
        batches = [{k: rng.integers(0, model.vocab_size, (4, 8)).astype(np.int32) for k in ("inputs", "targets")}
                   for _ in range(3)]
        step = fns.compile(state, batches[0])
        losses = []
        for b in batches:
            state, metrics = step(state, fns.put_batch(b))
            losses.append(float(metrics["loss"]))
        runs[schedule] = losses, fns.to_canonical(state.params)
    (l_gp, p_gp), (l_1f, p_1f) = runs["gpipe"], runs["1f1b"]
    # bf16 compute: the schedules sum the same bf16 products in a different order (1F1B accumulates
    # parameter gradients in fp32, GPipe's autodiff in bf16)
    np.testing.assert_allclose(l_1f, l_gp, rtol=2e-3)
    assert max(jax.tree.leaves(jax.tree.map(_rel, p_1f, p_gp))) < 1e-3


def test_1f1b_info():
    t = TrainConfig(mesh="data=2,stage=4", batch=32, microbatches=16, pipeline_schedule="1f1b")
    assert pipeline_info(t) == {"schedule": "1f1b", "stages": 4, "microbatches": 16, "microbatch_size": 1,
                                "bubble_fraction": 3 / 19, "activation_slots": 7}
    assert pipeline_info(replace(t, pipeline_schedule="gpipe"))["activation_slots"] == 19


def test_schedule_may_change_on_resume(tmp_path):
    """The same loss and gradients: a run may resume under the other schedule."""
    old = Config(replace(TINY, n_layers=2), TrainConfig(mesh="stage=2", batch=4))
    new = replace(old, train=replace(old.train, pipeline_schedule="1f1b"))
    changes = RunFolder(tmp_path / "run").check_resume(old, new, resuming=True)
    assert changes == {"train.pipeline_schedule": ["gpipe", "1f1b"]}


def test_schedules_experiment_renders_its_results(tmp_path):
    """experiments/rotation/pipeline_schedules.py re-renders its committed measurements (no compile): GPipe's
    compiled temp grows with M, 1F1B's stays flat."""
    from helpers import ROOT

    exp = pipeline_schedules
    src = ROOT / "experiments" / "results" / "pipeline_schedules.json"
    assert exp.main(["--from-json", str(src), "--out", str(tmp_path)]) == 0
    assert "| 32 |" in (tmp_path / "pipeline_schedules.md").read_text()
    runs = json.loads(src.read_text())["runs"]
    temp = {s: [r["temp_bytes"] for r in sorted(runs, key=lambda r: r["microbatches"]) if r["schedule"] == s]
            for s in ("gpipe", "1f1b")}
    assert all(a < b for a, b in zip(temp["gpipe"], temp["gpipe"][1:]))
    assert max(temp["1f1b"]) < 1.05 * min(temp["1f1b"]) and temp["1f1b"][-1] < 0.5 * temp["gpipe"][-1]
