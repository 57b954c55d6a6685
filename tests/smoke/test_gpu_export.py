"""The training step lowered for CUDA on this CPU (experiments/gpu/gpu_export.py's readers; no GPU, no CUDA
plugin): the attention path `auto` takes for a CUDA target, bf16 GEMM operands, the collectives one layer
adds (the same in the CUDA and the CPU lowering) and the pinned_host placements of an offload plan."""

from __future__ import annotations

from dataclasses import replace

import jax
import pytest

from boostjax.config import Config, ModelConfig, TrainConfig, validate
from boostjax.models import attention
from boostjax.offload.costmodel import build_instance
from boostjax.offload.planner import Decisions, make_plan
from experiments.gpu import gpu_export as gx


# t = 48 differs from every other dimension (d / TP = 32, vocabulary / TP = 64, heads, ranks), so a
# [.., t, t] tensor is an attention score matrix; attention_block 16: the chunked path runs 3 blocks
TINY = ModelConfig(d_model=128, n_layers=1, n_heads=4, d_ff=352, rank=32, max_seq_len=48, attention_block=16)
T = 48


def _btp(n_layers: int, attn: str = "auto", dtype: str = "bfloat16") -> Config:
    m = replace(TINY, n_layers=n_layers, attention=attn)
    return validate(Config(m, TrainConfig(batch=8, seq=T, strategy="btp", mesh="data=2,model=4", remat="lowrank",
                                          dtype=dtype)))


@pytest.fixture
def cudnn_version(monkeypatch):
    """JAX 0.10.2 asks the CUDA plugin for cuDNN's version while tracing cuDNN attention (to pick features);
    the custom call it lowers to does not depend on it. Without the plugin: a fixed cuDNN 9.1."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    from jax._src.lib import cuda_versions

    if cuda_versions is None:
        monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90100)


def test_lowering_for_sets_the_target_only_inside():
    assert not attention.on_cuda_gpu()  # the CPU backend
    with attention.lowering_for("cuda"):
        assert attention.on_cuda_gpu()
        assert attention.resolve("auto", "bfloat16") == "cudnn"
        assert attention.resolve("auto", "float32") == "chunked"
    assert attention.resolve("auto", "bfloat16") == "chunked"


def test_btp_step_for_cuda_attention_gemms_and_collectives(cudnn_version):
    """auto in bf16 -> cuDNN's fused attention (forward, its recomputation under remat lowrank, backward);
    every GEMM a layer adds reads bf16; the all-reduces a layer adds match the CPU lowering's exactly."""
    texts = {(n, p): gx.lower(_btp(n), p)[0].as_text() for n in (1, 2) for p in ("cuda", "cpu")}
    a = gx.attention_path(texts[1, "cuda"], T)
    assert a["path"] == "cudnn" and a["tt_tensor_mentions"] == 0, a
    assert a["cudnn_calls"] == {"__cudnn$fmhaSoftmax": 2, "__cudnn$fmhaSoftmaxBackward": 1}
    assert gx.attention_path(texts[1, "cpu"], T)["path"] == "chunked"  # auto on the CPU target
    one, two = (gx.dot_types(texts[n, "cuda"]) for n in (1, 2))
    added = {k: v - one.get(k, 0) for k, v in two.items() if v != one.get(k, 0)}
    assert added and all(k.startswith("bf16 x bf16 ->") for k in added), added
    per_layer = {p: gx.per_layer(gx.collective_summary(texts[1, p]), gx.collective_summary(texts[2, p]))
                 for p in ("cuda", "cpu")}
    assert per_layer["cuda"] == per_layer["cpu"], per_layer
    assert set(per_layer["cuda"]) == {"all_reduce"} and per_layer["cuda"]["all_reduce"]["count"] > 0
    # the same collectives, one by one (kind, result types, group size), in both lowerings
    layer = {p: gx.collective_multiset(texts[2, p]) - gx.collective_multiset(texts[1, p]) for p in ("cuda", "cpu")}
    assert layer["cuda"] == layer["cpu"] and sum(layer["cuda"].values()) == sum(
        v["count"] for v in per_layer["cuda"].values())


@pytest.mark.parametrize("mesh, strategy, extra", [
    ("data=1,model=4", "btp", {}),
    ("data=1,stage=2,model=2", "btp", {}),
    ("data=1,stage=2,model=2", "btp", {"pipeline_schedule": "1f1b", "microbatches": 2}),
])
def test_cudnn_lowers_on_a_mesh_with_one_data_row(cudnn_version, mesh, strategy, extra):
    """cuDNN attention goes through custom_partitioning, which refuses a loss shard_map over a mesh
    without the program's size-1 data axis: that axis is kept under cuDNN, and the step lowers."""
    m = replace(TINY, n_layers=2, attention="cudnn")
    cfg = validate(Config(m, TrainConfig(batch=8, seq=T, strategy=strategy, mesh=mesh, remat="lowrank",
                                         dtype="bfloat16", **extra)))
    a = gx.attention_path(gx.lower(cfg, "cuda")[0].as_text(), T)
    assert a["path"] == "cudnn" and a["cudnn_calls"].get("__cudnn$fmhaSoftmaxBackward", 0) >= 1, a


def test_auto_in_float32_lowers_the_chunked_loops():
    text = gx.lower(_btp(1, dtype="float32"), "cuda")[0].as_text()
    a = gx.attention_path(text, T)
    assert a["path"] == "chunked" and not a["cudnn_calls"] and a["while_loops"] > 0 and a["tt_tensor_mentions"] == 0
    assert set(gx.dot_types(text)) == {"f32 x f32 -> f32"}


def test_offload_plan_puts_state_and_boundaries_in_pinned_host(tmp_path):
    """A plan with host parameters (layer 0), host optimizer state (layers 0, 1) and an offloaded boundary
    (layer 1): those leaves are `pinned_host` arguments and results of the CUDA program, the boundary moves
    out and back by `annotate_device_placement`, and the layers' remat policies are read from the jaxpr."""
    m = replace(TINY, n_layers=2, attention="chunked")
    inst = build_instance(m, 2, T, "H800-80GB", budget_bytes=1e12, dtype_bytes=2, eight_bit=False, attention="flash")
    d = Decisions(boundary=("device", "host"), inner=("latents", "all"), mode=("host", "opt-host"),
                  offload_lag=(0, 0), fetch_lead=(0, 1), param_fwd_lead=(1, 1), param_bwd_lead=(1, 0),
                  grad_lag=(1, 1), flat=(False, False))
    path = tmp_path / "plan.json"
    path.write_text(make_plan(inst, d, "manual").to_json())
    cfg = validate(Config(m, TrainConfig(batch=2, seq=T, dtype="bfloat16", offload_plan=str(path))))
    _, s, b, lay = gx.abstract_step(cfg)
    on_host = lambda tree: sum(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(tree))  # noqa: E731
    hosted = on_host(s.params) + on_host(s.opt_state)
    assert on_host(s.params) > 0 and on_host(s.opt_state) > on_host(s.params)
    text = gx.lower(cfg, "cuda")[0].as_text()
    mk = gx.memory_kinds(text)
    assert mk["arguments"].get("pinned_host") == hosted and mk["results"].get("pinned_host") == hosted, mk
    boundary = f"tensor<2x{T}x{m.d_model}xbf16>"
    assert mk["moves"].get(f"pinned_host {boundary}") == 1 and mk["moves"].get(f"device {boundary}") == 1, mk
    # the CPU lowering keeps the state's placements but has no boundary move (jax 0.10.2 lowers an
    # activation's offload, `device_put` to a memory kind inside remat, only for GPU/TPU)
    cpu = gx.memory_kinds(gx.lower(cfg, "cpu")[0].as_text())
    assert cpu["arguments"].get("pinned_host") == hosted and cpu["results"].get("pinned_host") == hosted, cpu
    assert f"pinned_host {boundary}" not in cpu["moves"], cpu
    on_dev = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding.with_memory_kind("device")),
                          s.params)
    names = gx.remat_names(lay.placement.loss_fn, on_dev, b)
    assert names["boundary"].get("offloaded to pinned_host") == 1, names  # layer 1's boundary
    # layer 0 (inner `latents`) saves its latents and recomputes the rest; layer 1 (inner `all`) saves everything
    assert names["qkv_latent"] == {"saved": 2} and names["mlp_hidden"] == {"recomputed": 1, "saved": 1}, names
