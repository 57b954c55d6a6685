"""All three systems in one mesh: BOOST's tensor parallelism (and pipeline stages), basis-rotation
Adam with emulated asynchronous-pipeline delays, and a LazyTrain-style offload plan, each
combination against the single-device reference (losses and parameters, fp32)."""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest

from boostjax.config import Config, ModelConfig, TrainConfig
from boostjax.data import BatchIterator, load_corpus
from boostjax.offload import apply
from boostjax.offload.planner import Decisions, make_plan
from boostjax.placement import on_host
from boostjax.training.step import build_step_fns
from boostjax.models.llama import init_model

MODEL = ModelConfig(kind="cola", d_model=32, n_layers=4, n_heads=2, d_ff=64, rank=16, max_seq_len=16)


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                 / max(np.linalg.norm(np.asarray(b, np.float64)), 1e-30))


def _plan_file(tmp_path, cfg: Config) -> str:
    """A plan for one device of `cfg`'s mesh (`apply.instance_for`: its batch rows, its stage's layers,
    its shard under the strategy): the first layer's input offloaded, then one nested recompute
    segment; the last layer's parameters and optimizer state on host, except on a stage of 2 layers
    (placed alike on every stage), where every layer's optimizer state is."""
    inst = apply.instance_for(cfg, "H800-80GB", budget_bytes=1e12)
    layers = inst.n_layers
    boundary = ("host",) + ("recompute",) * (layers - 1)
    mode = ("opt-host",) * layers if layers == 2 else ("device",) * (layers - 1) + ("host",)
    streams = tuple(int(m in ("opt-host", "host")) for m in mode)
    d = Decisions(boundary=boundary, inner=("latents",) + ("all",) * (layers - 1), mode=mode,
                  offload_lag=(0,) * layers, fetch_lead=tuple(int(b == "host") for b in boundary),
                  param_fwd_lead=streams, param_bwd_lead=tuple(int(m == "host") for m in mode), grad_lag=streams)
    path = tmp_path / "plan.json"
    path.write_text(make_plan(inst, d, "manual").to_json())
    return str(path)


def _steps(cfg: Config, steps: int):
    """Losses of `steps` steps on the built-in corpus, the final canonical parameters, and the state."""
    graphdef, params = init_model(cfg)
    fns = build_step_fns(cfg, graphdef, params)
    state = fns.init(params)
    t = cfg.train
    data = BatchIterator(load_corpus("").train, t.batch, t.seq, 0, vocab_size=cfg.model.vocab_size)
    step = fns.compile(state, data.batch_at(0))
    losses = []
    for _ in range(steps):
        state, m = step(state, fns.put_batch(data.next()))
        losses.append(float(m["loss"]))
    return losses, jax.device_get(fns.to_canonical(state.params)), state


def _against_one_device(tmp_path, train: TrainConfig, mesh: str, steps: int, model: ModelConfig = MODEL):
    """(one device's run, the BTP run on `mesh` under an offload plan made for it) of `steps` steps."""
    run = Config(model, replace(train, strategy="btp", mesh=mesh))
    planned = replace(run, train=replace(run.train, offload_plan=_plan_file(tmp_path, run)))
    return _steps(Config(model, train), steps), _steps(planned, steps)


def test_btp_with_an_offload_plan_matches_one_device(tmp_path):
    """BTP on data=2 x model=2 under an offload plan (host parameters and optimizer state, a nested
    recompute segment, an offloaded boundary): the single-device AdamW losses and parameters."""
    ref, got = _against_one_device(tmp_path, TrainConfig(batch=4, seq=16, progress=False), "data=2,model=2", 3)
    np.testing.assert_allclose(got[0], ref[0], rtol=5e-6)
    errs = jax.tree.map(_rel, got[1], ref[1])
    assert max(jax.tree.leaves(errs)) < 1e-6, errs
    homes = {k: on_host(x.sharding) for k, x in jax.tree_util.tree_flatten_with_path(got[2].params)[0]}
    assert any(homes.values()) and not all(homes.values())  # the last layer lives in host memory


def test_1f1b_stages_with_an_offload_plan_match_one_device(tmp_path):
    """`--strategy btp --mesh stage=2,model=2 --pipeline-schedule 1f1b --offload-plan` (two layers per stage,
    an offloaded boundary, a recompute segment, every layer's optimizer state in host memory), the plan
    `boostjax plan --auto` gives a 1F1B candidate: the single-device AdamW losses and parameters."""
    train = TrainConfig(batch=4, seq=16, progress=False)
    run = Config(MODEL, replace(train, strategy="btp", mesh="stage=2,model=2", pipeline_schedule="1f1b"))
    planned = replace(run, train=replace(run.train, offload_plan=_plan_file(tmp_path, run)))
    ref, got = _steps(Config(MODEL, train), 3), _steps(planned, 3)
    np.testing.assert_allclose(got[0], ref[0], rtol=5e-6)
    errs = jax.tree.map(_rel, got[1], ref[1])
    # measured: losses within 1.7e-7, parameters 4.0e-8 worst leaf
    assert max(jax.tree.leaves(errs)) < 1e-6, errs
    opt = {jax.tree_util.keystr(k): on_host(x.sharding)
           for k, x in jax.tree_util.tree_flatten_with_path(got[2].opt_state)[0] if "'layers'" in jax.tree_util.keystr(k)}
    assert opt and all(opt.values()), opt
    # the CUDA lowering (no GPU needed): the offloaded boundary [mb, t, d/TP] goes to pinned host in the two
    # scan phases that run forwards and back in the two that run backwards, and the 1F1B ring that keeps
    # it over the 2P - 1 = 3 slots lives in pinned host too
    graphdef, params = init_model(planned)
    fns = build_step_fns(planned, graphdef, params)
    on_device = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")),
                             fns.init(params).params)
    batch = fns.put_batch(BatchIterator(load_corpus("").train, 4, 16, 0, vocab_size=MODEL.vocab_size).batch_at(0))
    moves = apply.annotated_placements(apply.lower_for_gpu(jax.grad(fns.loss_fn), on_device, batch))
    boundary = "tensor<1x16x16xf32>"
    assert sorted(moves) == sorted([("pinned_host", boundary), ("device", boundary)] * 2
                                   + [("pinned_host", "tensor<3x1x16x16xf32>")]), moves


def test_btp_pipeline_rotation_delay_and_offload_in_one_mesh(tmp_path):
    """`--strategy btp --mesh data=2,stage=2,model=2 --optimizer rotation --pipeline-delay 2
    --offload-plan`, one layer per stage, its parameters and optimizer state in host memory: the
    single-device losses and parameters of rotation with delay 2 over 4 steps (the first refresh and a
    power-step refresh), close to rounding: the damped refreshes (rotation.py) no longer pick bases
    from rounding noise. It also covers rotation under BTP on its own; the 60-step run without a plan
    is the next test."""
    train = TrainConfig(batch=4, seq=16, optimizer="rotation", rot_refresh=2, pipeline_delay=2, progress=False)
    ref, got = _against_one_device(tmp_path, train, "data=2,stage=2,model=2", 4, replace(MODEL, n_layers=2))
    # measured with damping 4: losses within 1.7e-7, parameters 3.0e-7 (AVX-512) to 2.9e-6 (AVX, SSE4.2) worst
    # leaf; 5e-6 / 2e-4 leave 29x / 69x
    np.testing.assert_allclose(got[0], ref[0], rtol=5e-6)
    errs = jax.tree.map(_rel, got[1], ref[1])
    assert max(jax.tree.leaves(errs)) < 2e-4, errs
    for tree in (got[2].params, got[2].opt_state):  # the stacked layers live in host memory
        layers = {jax.tree_util.keystr(k): on_host(x.sharding)
                  for k, x in jax.tree_util.tree_flatten_with_path(tree)[0] if "'layers'" in jax.tree_util.keystr(k)}
        assert layers and all(layers.values()), layers


def _global_rel(got, ref) -> float:
    """‖got − ref‖ / ‖ref‖ over every parameter together (float64)."""
    pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
    num = sum(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2) for a, b in pairs)
    return float(np.sqrt(num / sum(np.sum(np.asarray(b, np.float64) ** 2) for _, b in pairs)))


def test_rotation_with_delay_on_a_pipeline_tp_mesh_matches_one_device_for_60_steps():
    """60 steps of `--optimizer rotation --pipeline-delay 2 --rot-refresh 2` under BTP on
    `data=2,stage=2,model=2` against one device: losses within 1e-4 relative, parameters within 1e-3
    overall (‖Δ‖ / ‖θ‖ over all leaves) and 5e-3 leaf by leaf. The damped refreshes (rotation.py) keep the
    bases nearly independent of rounding; with the paper's exact `eigh` (damping 0) this run is off by
    1.1e-3 on losses, 1.8e-2 overall and 0.12 in the worst leaf. AdamW (rotation off) from the same start
    must end far from the rotation reference, so the tolerances tell the two apart."""
    model = replace(MODEL, n_layers=2)  # one layer per stage: the three runs stay cheap
    train = TrainConfig(steps=60, batch=4, seq=16, optimizer="rotation", rot_refresh=2, pipeline_delay=2,
                        progress=False)
    ref_losses, ref, _ = _steps(Config(model, train), 60)
    losses, got, _ = _steps(Config(model, replace(train, strategy="btp", mesh="data=2,stage=2,model=2")), 60)
    # measured with conftest's XLA flags (losses / parameters overall / worst leaf), by instruction set
    # (--xla_cpu_max_isa), default damping 4: AVX-512 1.4e-6 / 2.7e-5 / 6.4e-4, AVX 1.3e-6 / 7.3e-5 / 2.1e-4, SSE4.2
    # 2.3e-6 / 7.8e-5 / 6.4e-4 (damping 1 gave up to 5.8e-5 / 1.8e-3 / 1.1e-2). The bounds are the issue's
    # goal (1e-4 / 1e-3), 13x or more over the worst ISA, and 7.8x on the worst leaf.
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert _global_rel(got, ref) < 1e-3, _global_rel(got, ref)
    errs = jax.tree.map(_rel, got, ref)
    assert max(jax.tree.leaves(errs)) < 5e-3, errs
    adamw_losses, adamw, _ = _steps(Config(model, replace(train, optimizer="adamw")), 60)
    loss_gap = float(np.max(np.abs(np.asarray(adamw_losses) / np.asarray(ref_losses) - 1)))
    # rotation off must fail the bounds above many times over: measured 2.8e-2 on losses and 0.14 overall
    assert loss_gap > 3e-3 and _global_rel(adamw, ref) > 6e-2, (loss_gap, _global_rel(adamw, ref))


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
