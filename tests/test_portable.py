"""Runs are portable: a run trained on a 2x2 (data=2,model=2, ZeRO-1) or a 1x4 (data=1,model=4) mesh
of this process's 8 simulated devices is read back, exported and resumed in a fresh process that has
ONE device (`XLA_FLAGS` set before JAX starts there). The one-device reads equal this process's reads
bit for bit; the resumed run continues with the checkpoint's optimizer state and data position."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from boostjax.interop import hf
from boostjax.config import Config, ModelConfig, TrainConfig
from boostjax.runs.load import load_run
from boostjax.training.trainer import train
from helpers import xla_flags

MODEL = ModelConfig(kind="llama", vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=64, rank=8)
MESHES = {"2x2": dict(mesh="data=2,model=2", strategy="fullrank-tp", zero=1),
          "1x4": dict(mesh="data=1,model=4", strategy="fullrank-tp")}
STEPS, CKPT = 6, 3

READER = textwrap.dedent("""
    import json, pathlib, shutil, sys
    import jax, numpy as np
    from boostjax.cli import main
    from boostjax.runs.load import load_run, read_config
    from boostjax.training.trainer import train
    out = pathlib.Path(sys.argv[1])
    report = {"devices": jax.device_count()}
    for name in sys.argv[2:]:
        _, model, step = load_run(out / name)
        from flax import nnx
        flat = jax.tree_util.tree_flatten_with_path(nnx.state(model).to_pure_dict())[0]
        np.savez(out / f"{name}.npz", **{jax.tree_util.keystr(p): np.asarray(x) for p, x in flat})
        report[name] = {"step": step, "export_rc": main(["export-hf", "--run", str(out / name),
                                                         "--out", str(out / f"{name}-hf")])}
    # resume the 2x2 run from its step-3 checkpoint on one device (no mesh, no strategy, no ZeRO)
    shutil.copytree(out / "2x2", out / "resumed")
    shutil.move(str(out / "resumed" / "checkpoints" / "6"), str(out / "aside-6"))
    cfg = read_config(out / "resumed")
    cfg = type(cfg)(cfg.model, cfg.train.__class__(**{**cfg.train.__dict__, "mesh": "", "strategy": "none",
                                                       "zero": 0, "out": str(out / "resumed")}))
    result = train(cfg)
    report["resumed"] = {"from": result.resumed_from, "metrics": [m for m in result.metrics if "loss" in m]}
    print(json.dumps(report))
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("portable")
    for name, mesh in MESHES.items():
        t = TrainConfig(steps=STEPS, batch=4, seq=16, ckpt_every=CKPT, log_every=1, eval_every=1000,
                        eval_batches=1, progress=False, out=str(out / name), **mesh)
        train(Config(MODEL, t))
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    proc = subprocess.run([sys.executable, "-c", READER, str(out), *MESHES], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads(proc.stdout.strip().splitlines()[-1])


def _flat(model) -> dict[str, np.ndarray]:
    from flax import nnx

    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model).to_pure_dict())[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}


@pytest.mark.parametrize("name", list(MESHES))
def test_one_device_read_equals_the_eight_device_read(runs, name):
    out, report = runs
    assert report["devices"] == 1
    assert report[name]["step"] == STEPS
    _, model, step = load_run(out / name)
    assert step == STEPS
    here, there = _flat(model), dict(np.load(out / f"{name}.npz"))
    assert here.keys() == there.keys() and len(here) > 10
    for k in here:
        assert here[k].dtype == there[k].dtype and np.array_equal(here[k], there[k]), k


@pytest.mark.parametrize("name", list(MESHES))
def test_export_from_one_device(runs, name):
    out, report = runs
    assert report[name]["export_rc"] == 0
    _, params = hf.read_hf(out / f"{name}-hf")
    there = dict(np.load(out / f"{name}.npz"))
    flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert flat.keys() == there.keys()
    for k in flat:
        assert np.array_equal(flat[k], there[k]), k


def test_resume_on_one_device_continues_the_mesh_run(runs):
    out, report = runs
    resumed = report["resumed"]
    assert resumed["from"] == CKPT
    got = {m["step"]: m for m in resumed["metrics"] if m["step"] > CKPT}
    assert sorted(got) == list(range(CKPT + 1, STEPS + 1))
    original = {m["step"]: m for m in map(json.loads, (out / "2x2" / "metrics.jsonl").read_text().splitlines())
                if "loss" in m}
    for s, m in got.items():
        assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
        # the same state and batches on another device layout: equal up to the order of fp32 sums
        assert abs(m["loss"] - original[s]["loss"]) < 1e-5 * abs(original[s]["loss"]), (s, m, original[s])
        # the same scalar schedule compiled into two programs: its few scalar ops may contract to FMAs
        # differently (an ulp each); 1e-7 relative was under one ulp for mantissas below 1.19. 4 ulps; a
        # schedule one step off moves the rate by O(1 / STEPS)
        assert abs(m["lr"] - original[s]["lr"]) <= 4 * np.spacing(np.float32(original[s]["lr"]))
    # the resumed metrics.jsonl holds each step once, and the folder's checkpoints continue to STEPS
    steps = [m["step"] for m in map(json.loads, (out / "resumed" / "metrics.jsonl").read_text().splitlines())
             if "loss" in m]
    assert steps == list(range(1, STEPS + 1))
    assert (out / "resumed" / "checkpoints" / str(STEPS)).is_dir()
    shutil.rmtree(out / "resumed")


@pytest.mark.parametrize("optimizer", ["adam8bit", "rotation"])
def test_layout_change_refused_where_the_optimizer_state_is_not_elementwise(optimizer):
    """Stacked <-> per-layer conversion is exact for elementwise optimizer state only (boostjax.runs.relayout)."""
    from boostjax.config import ConfigError
    from boostjax.runs.relayout import check
    from boostjax.models.llama import abstract_model

    cfg = Config(MODEL, TrainConfig(optimizer=optimizer))
    with pytest.raises(ConfigError, match=f"train.mesh: .*stacked layers.*{optimizer}.*fix: resume with stage > 1"):
        check(cfg, abstract_model(cfg)[1], True, "runs/x")
    check(Config(MODEL, TrainConfig(optimizer="adamw")), abstract_model(cfg)[1], True, "runs/x")  # converts
