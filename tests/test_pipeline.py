"""Pipeline parallelism over the mesh axis `stage` (GPipe): the pipelined loss and every gradient
match the single-device reference, with DP and TP (BTP included); bad splits fail before compiling;
a stage-mesh run checkpoints, resumes bit-identically and loads back per layer."""

import re
import shutil
from dataclasses import replace

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import seed_of
from test_tp import TINY, _compare, assert_matches, put_params

import boostjax
from boostjax.config import Config, ConfigError, TrainConfig
from boostjax.training.checks import validate
from boostjax.placement import choose
from boostjax.runs.load import load_run
from boostjax.sharding.pipeline import bubble_fraction, microbatches, pipeline_info
from boostjax.models.llama import init_model
from boostjax.training.trainer import train


# P = 4 with DP (model axis 1: replicated blocks), and the full data x stage x model mesh with BTP
@pytest.mark.parametrize("mesh,strategy,kind,layers,micro,remat", [
    ("data=2,stage=4,model=1", "none", "svd", 4, 0, "none"),
    ("data=2,stage=2,model=2", "btp", "lax", 2, 2, "lowrank"),
])
def test_pipeline_matches_single_device(mesh, strategy, kind, layers, micro, remat):
    cfg = validate(Config(replace(TINY, kind=kind, n_layers=layers),
                          TrainConfig(strategy=strategy, mesh=mesh, microbatches=micro, remat=remat, batch=4, seq=16)))
    assert_matches(*_compare(cfg, seed=seed_of(mesh, kind)))


def test_stage_parameters_are_sharded_over_stage():
    cfg = Config(replace(TINY, n_layers=4), TrainConfig(strategy="btp", mesh="data=1,stage=2,model=2", batch=4))
    graphdef, params = init_model(cfg)
    placed = put_params(choose(cfg, graphdef, params), params)
    a_qkv = placed["layers"]["attn"]["a_qkv"]  # [L, d, 3, r]: layers over stage, d over model (BTP)
    assert a_qkv.shape == (4, *params["layers"][0]["attn"]["a_qkv"].shape)
    assert {s.data.shape for s in a_qkv.addressable_shards} == {(2, TINY.d_model // 2, 3, TINY.rank)}
    # stage s holds layers [2s, 2s+2) and nothing else
    mesh = a_qkv.sharding.mesh
    for shard in a_qkv.addressable_shards:
        stage = int(np.argwhere(mesh.devices == shard.device)[0][1])
        assert shard.index[0] == slice(2 * stage, 2 * stage + 2)


def test_each_stage_runs_the_head_on_its_share_of_the_tokens():
    """The last stage's features are scattered over the stages: every stage's logits cover b·t/P tokens
    (and V/T vocabulary entries), not the whole batch."""
    cfg = validate(Config(replace(TINY, n_layers=4), TrainConfig(strategy="btp", mesh="data=2,stage=2,model=2",
                                                                 batch=8, seq=8)))
    graphdef, params = init_model(cfg)
    pl = choose(cfg, graphdef, params)
    batch = {k: np.zeros((8, 8), np.int32) for k in ("inputs", "targets")}
    text = jax.jit(pl.loss_fn).lower(put_params(pl, params), jax.device_put(batch, pl.batch_sharding)).as_text()
    tokens, vocab = 8 // 2 * 8, TINY.vocab_size // 2  # per data shard; per model shard
    # leading sizes of every [..., V/T] f32 tensor (logits and their softmax terms; head weights are [d, V/T])
    rows = {int(np.prod([int(n) for n in dims.split("x")])) for dims in re.findall(rf"tensor<([0-9x]+)x{vocab}xf32>", text)}
    assert tokens // 2 in rows and tokens not in rows, rows  # half the shard's tokens per stage, never all


def test_bubble_fraction_and_microbatches():
    assert bubble_fraction(1, 4) == 0.0 and bubble_fraction(2, 4) == 0.2 and bubble_fraction(4, 8) == 3 / 11
    auto = TrainConfig(mesh="data=2,stage=2", batch=16)  # 8 per data shard, at most 4 x 2 micro-batches
    assert microbatches(auto) == 8 and microbatches(replace(auto, batch=12)) == 6
    info = pipeline_info(replace(auto, microbatches=2))
    assert info == {"schedule": "gpipe", "stages": 2, "microbatches": 2, "microbatch_size": 4,
                     "bubble_fraction": 1 / 3, "activation_slots": 3}


@pytest.mark.parametrize("model_kw,train_kw,field", [
    (dict(n_layers=3), dict(mesh="stage=2"), "model.n_layers"),
    (dict(n_layers=4), dict(mesh="data=2,stage=2", batch=8, microbatches=3), "train.microbatches"),
    (dict(n_layers=4), dict(mesh="data=2,stage=2", batch=7), "train.batch"),
    (dict(n_layers=4), dict(mesh="data=2", microbatches=2), "train.microbatches"),
    (dict(n_layers=4), dict(pipeline_schedule="1f1b"), "train.pipeline_schedule"),
    (dict(n_layers=4), dict(mesh="stage=2", doc_mask=True), "train.doc_mask"),
    (dict(n_layers=4), dict(mesh="stage=4", batch=1, seq=6, microbatches=1), "train.seq"),
])
def test_bad_pipeline_configs_fail_before_compile(model_kw, train_kw, field):
    """The placement's checks (`boostjax.validate`: the fields, then what the layout can run)."""
    cfg = Config(replace(TINY, **model_kw), TrainConfig(**train_kw))
    with pytest.raises(ConfigError, match=f"{field}: .*fix:"):
        boostjax.validate(cfg)


def test_placement_checks_split_without_validate():
    cfg = Config(replace(TINY, n_layers=3), TrainConfig(mesh="stage=2", batch=4))
    graphdef, params = init_model(cfg)
    with pytest.raises(ConfigError, match="model.n_layers: 3 layers do not split into stage=2.*fix:"):
        choose(cfg, graphdef, params)


def test_stage_mesh_trains_checkpoints_and_resumes(tmp_path):
    model = replace(TINY, kind="llama", n_layers=2)
    fast = TrainConfig(steps=6, batch=4, seq=16, log_every=1, eval_every=100, eval_batches=1, ckpt_every=2,
                       progress=False)
    pipe_cfg = replace(fast, strategy="fullrank-tp", mesh="stage=2,model=2", microbatches=2, out=str(tmp_path / "pp"))
    full = train(Config(model, pipe_cfg))
    assert full.metrics[0] == {"step": 0, "schedule": "gpipe", "stages": 2, "microbatches": 2,
                               "microbatch_size": 2, "bubble_fraction": 1 / 3, "activation_slots": 3}
    assert full.extra["bubble_fraction"] == 1 / 3 and "bubble 33.3%" in full.summary
    assert full.losses[-1] < full.losses[0]
    shutil.rmtree(tmp_path / "pp" / "checkpoints" / "6")  # as if killed after the step-4 checkpoint
    resumed = train(Config(model, pipe_cfg))
    assert resumed.resumed_from == 4
    assert resumed.losses == full.losses  # steps 1-4 kept from metrics.jsonl, 5-6 recomputed bit-identically
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(full.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # user-visible parameters are per layer: TrainResult, load_run (export) see the canonical layout
    _, loaded, step = load_run(tmp_path / "pp")
    assert step == 6
    canonical = nnx.state(loaded).to_pure_dict()
    assert jax.tree.structure(canonical) == jax.tree.structure(resumed.params)
    for a, b in zip(jax.tree.leaves(canonical), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # resumed without a stage axis: the stacked parameters and Adam moments are unstacked (boostjax.runs.relayout)
    shutil.rmtree(tmp_path / "pp" / "checkpoints" / "6")
    flat = train(Config(model, replace(pipe_cfg, mesh="model=2", microbatches=0)))
    assert flat.resumed_from == 4
    np.testing.assert_allclose(flat.losses, full.losses, rtol=1e-5)  # another program: fp32 sums in another order
    for a, b in zip(jax.tree.leaves(flat.params), jax.tree.leaves(full.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    # and back: its per-layer checkpoint 6 read into the stacked layout is the same state, exactly
    back = train(Config(model, pipe_cfg))
    assert back.resumed_from == 6
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(flat.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
