"""The offload planner on meshes: one device's share of a TP / pipeline mesh (its parameter shards
against the shardings the trainer uses, its activations against the traced step), one parameter
mode per pipeline stage, and `check_plan_for` on plans recording a strategy and mesh."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boostjax.cli import main
from boostjax.config import Config, ConfigError, MeshShape, ModelConfig, TrainConfig
from boostjax.models.llama import LLaMA
from boostjax.offload import check_plan_for
from boostjax.offload import costmodel as cm
from boostjax.offload.blockgraph import block_graph
from boostjax.offload.decisions import check_decisions
from boostjax.offload.planfile import Plan, read_plan
from boostjax.offload.planner import brute_force, min_budget, solve
from boostjax.placement.tensor import shard_loss_fn
from boostjax.sharding.rules import logical_axes, param_specs

CASES = [("cola", "btp"), ("lax", "btp"), ("svd", "vanilla-tp"), ("cola", "vanilla-tp"), ("llama", "fullrank-tp")]
DATA, TP, BATCH, SEQ = 2, 4, 4, 16


def _model(kind: str) -> ModelConfig:
    return ModelConfig(kind=kind, vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=128, rank=16)


def _params(cfg: ModelConfig):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LLaMA(cfg, rngs=nnx.Rngs(params=0))))
    return graphdef, state.to_pure_dict()


def _mesh() -> Mesh:
    return Mesh(np.asarray(jax.devices()[:DATA * TP]).reshape(DATA, TP), ("data", "model"))


@pytest.mark.parametrize("kind,strategy", CASES)
def test_per_device_parameters_are_the_shards_of_the_trainers_shardings(kind, strategy):
    """Per-layer parameter count and the fixed (embedding, head, norm) bytes of one device equal the
    shard shapes of `NamedSharding(mesh, spec)` over the strategy's specs."""
    cfg = _model(kind)
    _, params = _params(cfg)
    specs, mesh = param_specs(strategy, logical_axes(cfg)), _mesh()
    shard = lambda x, s: math.prod(NamedSharding(mesh, s).shard_shape(x.shape))  # noqa: E731
    numel = jax.tree.map(shard, params, specs, is_leaf=lambda x: isinstance(x, P))
    layer0 = sum(jax.tree.leaves(numel["layers"][0]))
    lc = cm.layer_cost(cfg, BATCH // DATA, SEQ, cm.get_profile("H800-80GB"), strategy=strategy, tp=TP)
    assert lc.params == layer0 and lc.param_bytes == 4 * layer0
    assert layer0 < cm.param_count_per_layer(cfg) / 2  # sharded, not replicated
    inst = cm.build_instance(cfg, BATCH, SEQ, "H800-80GB", dtype_bytes=4, eight_bit=False, strategy=strategy,
                             mesh=MeshShape(data=DATA, model=TP))
    rest = numel["embed"] + numel["head"] + numel["norm"]
    d_emb = params["embed"].shape[1] // (TP if strategy == "btp" else 1)
    # fp32 weight + gradient + Adam m, v; the embedding rows gathered for this device's tokens
    assert inst.fixed_bytes == 16 * rest + BATCH // DATA * SEQ * d_emb * 4
    assert inst.n_layers == cfg.n_layers
    assert inst.mode_device_bytes[0][0] == lc.param_bytes + lc.opt_bytes == 12 * layer0


def _named_shapes(jaxpr, out: dict) -> dict:
    """name -> shapes of every `checkpoint_name` tensor of a jaxpr (shard_map bodies: one device's)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            out.setdefault(eqn.params["name"], []).append(eqn.invars[0].aval.shape)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    _named_shapes(sub.jaxpr, out)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    _named_shapes(sub, out)
    return out


@pytest.mark.parametrize("kind,strategy", [c for c in CASES if c != ("cola", "vanilla-tp")])
def test_per_device_activations_are_the_traced_steps(kind, strategy):
    """Every named activation of one device's block (BTP: the [b, t, d/TP] residual and replicated
    r-dim latents; vanilla: [b, t, d] residuals, r/TP latents; Megatron: [b, t, d] residual, heads and
    d_ff / TP) has the bytes of the tensor the mesh step's shard_map body tags with that name."""
    cfg = Config(model=_model(kind), train=TrainConfig(batch=BATCH, seq=SEQ, strategy=strategy,
                                                       mesh=f"data={DATA},model={TP}"))
    graphdef, params = _params(cfg.model)
    loss = shard_loss_fn(cfg, graphdef, _mesh(), param_specs(strategy, logical_axes(cfg.model)), cfg.train.remat)
    rows = jax.ShapeDtypeStruct((BATCH, SEQ), np.int32)
    traced = _named_shapes(jax.make_jaxpr(loss)(params, {"inputs": rows, "targets": rows}).jaxpr, {})
    lc = cm.layer_cost(cfg.model, BATCH // DATA, SEQ, cm.get_profile("H800-80GB"), dtype_bytes=4,
                       strategy=strategy, tp=TP)
    graph = block_graph(cfg.model, SEQ)
    named = [n for n, node in graph.items() if node.named]
    assert set(named) <= set(traced), (named, traced)
    per_layer = lambda name: sum(4 * math.prod(s) for s in traced.get(name, [])) / cfg.model.n_layers  # noqa: E731
    for name in named:  # fp32 step: 4 bytes per element, the fp32 statistics saved with a latent included
        want = per_layer(name) + per_layer(name + "_stats")
        assert lc.activation_bytes[name] == want, (name, traced[name], lc.activation_bytes[name])
    d = cfg.model.d_model // (TP if strategy == "btp" else 1)
    assert traced["boundary"][0] == (BATCH // DATA, SEQ, d)


def _stage_instance(**kw) -> cm.PlanInstance:
    cfg = ModelConfig(kind="cola", vocab_size=256, d_model=64, n_layers=4, n_heads=4, d_ff=128, rank=16)
    return cm.build_instance(cfg, 8, 64, "H800-80GB", dtype_bytes=4, eight_bit=False, strategy="btp",
                             mesh=MeshShape(data=2, stage=2, model=2), max_segment=2, h2d_lead=1, d2h_lag=1, **kw)


def test_a_pipeline_stage_keeps_one_parameter_mode():
    """With stages, a plan covers one stage's layers and puts all of them in one parameter mode (a
    stage's layers are one stacked array per parameter); at a budget where the best free plan mixes
    modes, the planner returns the best uniform plan (brute force over uniform plans)."""
    inst = _stage_instance()
    assert inst.uniform_modes and inst.n_layers == 2
    rows, tokens = 8 // 2, 8 // 2 * 64  # batch 8 over data=2, seq 64; BTP on model=2: d 64 -> 32, vocab 256 -> 128
    assert inst.boundary_bytes[0] == rows * 64 * 32 * 4 and inst.tokens == tokens
    head_tokens = tokens // 2  # the pipeline splits the head's tokens over its 2 stages
    assert inst.head_work_bytes == 3 * 4 * head_tokens * 128 + 2 * head_tokens * 64 * 4
    free = replace(inst, uniform_modes=False)
    budget, _ = min_budget(free, 10)
    mixed = solve(free.with_budget(budget), time_limit_s=10)
    assert len(set(mixed.decisions.mode)) > 1  # the constraint binds here
    with pytest.raises(ValueError, match="decisions.mode"):
        check_decisions(inst, mixed.decisions)
    plan = solve(inst.with_budget(budget), time_limit_s=10)
    assert len(set(plan.decisions.mode)) == 1 and len(set(plan.param_place)) == 1 and len(set(plan.opt_place)) == 1
    best = brute_force(inst.with_budget(budget))
    assert best.predicted_step_s <= plan.predicted_step_s <= best.predicted_step_s * 1.05
    assert plan.predicted_step_s > mixed.predicted_step_s


def test_plan_cli_records_strategy_and_mesh_and_check_plan_for(tmp_path, capsys):
    out = tmp_path / "plan.json"
    shape = ["--d-model", "32", "--n-layers", "4", "--n-heads", "2", "--d-ff", "64", "--rank", "8"]
    assert main(["plan", *shape, "--batch", "4", "--seq", "32", "--dtype", "float32", "--optimizer", "adamw",
                 "--memory-cap", "0.01", "--time-limit", "5", "--strategy", "btp", "--mesh",
                 "data=2,stage=2,model=2", "--out", str(out)]) == 0
    assert "btp[data=2,stage=2,model=2]" in capsys.readouterr().out
    plan = read_plan(out)
    assert plan.planned_for["train.strategy"] == "btp" and plan.planned_for["train.mesh"] == "data=2,stage=2,model=2"
    assert len(plan.decisions.boundary) == 2  # one stage's layers
    model = ModelConfig(d_model=32, n_layers=4, n_heads=2, d_ff=64, rank=8)
    run = dict(batch=4, seq=32, dtype="float32", optimizer="adamw", offload_plan=str(out))
    cfg = Config(model=model, train=TrainConfig(strategy="btp", mesh="data=2,stage=2,model=2", **run))
    assert check_plan_for(str(out), cfg).planned_for == plan.planned_for
    for other, needle in ((dict(mesh="data=1,stage=2,model=2"), "train.mesh='data=2,stage=2,model=2'"),
                          (dict(strategy="vanilla-tp"), "train.strategy='btp'")):
        t = replace(cfg.train, **other)
        with pytest.raises(ConfigError, match="re-run boostjax plan") as e:
            check_plan_for(plan, replace(cfg, train=t))
        assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="one stacked array"):  # a plan mixing modes on a stage mesh
        d = json.loads(out.read_text())
        d["decisions"]["mode"] = ["device", "host"]
        d["decisions"]["param_fwd_lead"], d["decisions"]["param_bwd_lead"] = [0, 1], [0, 1]
        d["decisions"]["grad_lag"] = [0, 1]
        check_plan_for(Plan.from_dict(d), cfg)


def test_a_plan_without_strategy_and_mesh_is_a_one_device_plan():
    """Plan files written before meshes (no strategy/mesh in `planned_for`) still apply to one device."""
    model = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, rank=8)
    cfg = Config(model=model, train=TrainConfig(batch=4, seq=32, dtype="float32", optimizer="adamw"))
    inst = cm.build_instance(model, 4, 32, "H800-80GB", dtype_bytes=4, eight_bit=False)
    plan = brute_force(replace(inst, max_segment=1, h2d_lead=1, d2h_lag=1, param_modes=("device",)))
    assert plan.planned_for["train.strategy"] == "none" and plan.planned_for["train.mesh"] == ""
    for key in ("train.strategy", "train.mesh"):
        del plan.planned_for[key]
    check_plan_for(plan, cfg)
    with pytest.raises(ConfigError, match="train.strategy='none' but this run has train.strategy='btp'"):
        check_plan_for(plan, replace(cfg, train=replace(cfg.train, strategy="btp", mesh="data=1,model=2")))
