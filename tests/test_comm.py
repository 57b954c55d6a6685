"""Communication accounting from compiled HLO (`boostjax.analysis.hlo`, `boostjax.analysis.comm`).

The per-layer figures of the three TP strategies are checked EXACTLY against the analytic volumes
of BTP's analytic traffic, on tiny shapes compiled abstractly for simulated CPU devices.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
import io
import json
import math
import os

import pytest

from boostjax.config import ModelConfig, preset
from boostjax.analysis import comm
from boostjax.cli import main as cli_main
from boostjax.analysis import hlo
from boostjax.models import stat_parts

TINY = preset("tiny", n_layers=2)  # d=128, 4 heads, d_ff=352, r=32, vocab 256
D, F, R = TINY.d_model, TINY.d_ff, TINY.rank
TP4, B, S = "data=1,model=4", 4, 16
TOKENS = B * S


@pytest.fixture(scope="module")
def btp():
    return comm.comm_report(TINY, TP4, B, S, "btp", dtype="float32")


@pytest.fixture(scope="module")
def vanilla():
    return comm.comm_report(TINY, TP4, B, S, "vanilla-tp", dtype="float32")


@pytest.fixture(scope="module")
def fullrank():
    return comm.comm_report(TINY, TP4, B, S, "fullrank-tp", dtype="float32")


@pytest.fixture(scope="module")
def btp_lowrank():
    return comm.comm_report(TINY, TP4, B, S, "btp", remat="lowrank", dtype="float32")


CLI_ARGS = ["--preset", "tiny", "--strategy", "btp", "--mesh", "data=2,model=2", "--batch", "4", "--seq", "16",
            "--dtype", "bfloat16"]


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """`boostjax comm --json --dump-hlo` on bf16 BTP with data parallelism (data=2, model=2)."""
    out_dir = tmp_path_factory.mktemp("hlo")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli_main(["comm", *CLI_ARGS, "--json", "--dump-hlo", str(out_dir)])
    assert rc == 0
    return json.loads(buf.getvalue()), out_dir


# -- exact per-layer volumes --------------------------------------------------------------------------

def test_btp_forward_is_7r_plus_two_norm_statistics(btp):
    # qkv [b,s,3r] + o [b,s,r] + gate_up [b,s,2r] + down [b,s,r], fp32; plus Σx² of both norms [b,s,1] fp32
    assert btp["forward_allreduce_bytes_per_layer"] == TOKENS * (7 * R * 4 + 2 * 4)
    assert btp["forward_allreduce_bytes_per_layer"] == btp["expected_per_layer"]["forward_bytes"]
    assert btp["forward_allreduce_count_per_layer"] == 4
    assert btp["other_collectives_per_layer"] == {}  # no all-gather / reduce-scatter inside a block


def test_btp_norm_statistics_ride_with_the_latents(btp):
    """fp32: each Online-RMSNorm site is ONE all-reduce of one buffer, the latents and Σx² concatenated
    ([b, s, g·r + 1]); JAX emits exactly that one (no combiner needed), and nothing reduces over data=1."""
    ars = btp["forward_allreduces_per_layer"]
    assert len(ars) == 4 and btp["forward_allreduce_emitted_per_layer"] == 4
    assert sorted(a["shapes"][0] for a in ars if len(a["shapes"]) == 1) == sorted(
        [f"f32[{B},{S},{3 * R + 1}]", f"f32[{B},{S},{2 * R + 1}]", f"f32[{B},{S},{R}]", f"f32[{B},{S},{R}]"])
    assert all(len(a["shapes"]) == 1 for a in ars)  # single-operand: one collective per site on any backend


def test_bf16_statistics_ride_in_the_bf16_all_reduce(cli, btp):
    """bf16 latents: each norm site is still ONE all-reduce, the fp32 Σx² carried as `n_parts(TP)` exact
    bf16 parts (`boostjax.models.stat_parts`) in the latents' buffer: as many emitted as in fp32."""
    r = cli[0]["btp"]
    assert r["forward_allreduce_emitted_per_layer"] == btp["forward_allreduce_emitted_per_layer"] == 4
    ars = r["forward_allreduces_per_layer"]
    assert len(ars) == 4 and all(a["dtypes"] == ["bf16"] for a in ars)
    w = stat_parts.n_parts(2)
    dims = sorted(a["shapes"][0].split("[")[1] for a in ars)  # compiled: the CPU backend widens to f32
    assert dims == sorted([f"2,16,{3 * R + w}]", f"2,16,{2 * R + w}]", f"2,16,{R}]", f"2,16,{R}]"])


def test_no_all_reduce_over_a_data_axis_of_size_one(btp, btp_lowrank):
    """data=1: the loss shard_map is built without the data axis, so neither the loss nor any gradient
    has an all-reduce over one device (they moved nothing but were in the program)."""
    for r in (btp, btp_lowrank):
        step = comm._compile(comm.model_for(TINY, "btp"), TP4, B, S, "btp", r["remat"], "float32",
                             train=tuple(sorted(r["train"].items())))
        trivial = [c for c in hlo.collectives(step.step_text) if c.trivial]
        assert trivial == [], [c.name for c in trivial]
        assert set(r["allreduce_bytes_by_axis"]) == {"model"}


def test_btp_step_is_twice_7r_plus_statistics(btp):
    """Backward: the cotangents of the 7r latents; the statistics' cotangent is replicated (no collective)."""
    activations = TOKENS * (2 * 7 * R * 4 + 2 * 4)
    scalars = btp["allreduce_scalar_bytes_per_layer"]  # the optimizer's global-norm partial sums
    assert btp["allreduce_bytes_per_layer"] - scalars == activations
    assert 0 <= scalars <= 2 * 11 * 4  # at most two f32 per sharded tensor of a block (11 tensors)
    assert btp["allreduce_bytes_per_layer"] == pytest.approx(activations, rel=0.01)
    assert btp["backward_allreduce_bytes_per_layer"] - scalars == TOKENS * 7 * R * 4


def test_vanilla_and_fullrank_forward_volumes(vanilla, fullrank):
    assert vanilla["forward_allreduce_bytes_per_layer"] == TOKENS * (5 * D + 2 * F) * 4
    assert fullrank["forward_allreduce_bytes_per_layer"] == TOKENS * 2 * D * 4
    assert fullrank["forward_allreduce_count_per_layer"] == 2
    for r in (vanilla, fullrank):
        assert r["forward_vs_expected"] == 1.0
        assert r["other_collectives"] == {}  # all-reduce only: no gather/scatter anywhere


def test_fullrank_backward_is_one_psum_per_norm(fullrank):
    """Megatron: 2d per token backward (one psum per column-parallel group), not one per GEMM."""
    scalars = fullrank["allreduce_scalar_bytes_per_layer"]
    assert fullrank["backward_allreduce_bytes_per_layer"] - scalars == TOKENS * 2 * D * 4


def test_btp_forward_below_vanilla_by_the_expected_factor(btp, vanilla, fullrank):
    factor = vanilla["forward_allreduce_bytes_per_layer"] / btp["forward_allreduce_bytes_per_layer"]
    assert factor == pytest.approx((5 * D + 2 * F) * 4 / (7 * R * 4 + 2 * 4), rel=1e-12)
    assert factor > 4
    assert btp["allreduce_bytes_per_layer"] < fullrank["allreduce_bytes_per_layer"]
    assert btp["allreduce_bytes"] < vanilla["allreduce_bytes"]


def test_whole_step_counts_cover_the_layers(btp):
    # two layers plus the tail (final gather, vocabulary-parallel CE) and the optimizer
    assert btp["forward_allreduce_bytes"] >= 2 * btp["forward_allreduce_bytes_per_layer"]
    assert btp["allreduce_bytes"] >= 2 * btp["allreduce_bytes_per_layer"]
    ag, rs = btp["other_collectives"]["all-gather"], btp["other_collectives"]["reduce-scatter"]
    assert ag == {"count": 1, "bytes": TOKENS * D * 4, "bytes_compiled": TOKENS * D * 4}  # one gather of d
    assert rs["count"] == 1 and rs["bytes"] == TOKENS * D // 4 * 4  # its transpose in the backward


def test_gemm_reduction_dims(btp, vanilla):
    # vanilla: B up-projections reduce over r/TP; BTP: over d/TP (A, row-parallel) and r (B)
    assert R // 4 in vanilla["gemms"]["projection_k"]
    assert min(btp["gemms"]["projection_k"]) == min(D // 4, R)
    assert set(btp["gemms"]["projection_k"]) == {D // 4, F // 4, R}
    assert btp["gemms"]["mean_intensity"] > vanilla["gemms"]["mean_intensity"]
    cores = [g for g in btp["gemms"]["per_layer"] if g["attention_core"]]  # q·k over e, p·v over s
    assert sorted(g["k"] for g in cores) == sorted([TINY.head_dim, S])
    assert len(btp["gemms"]["per_layer"]) == 2 + 9  # and q, kv, o (A, B), gate_up (A, B), down (A, B)


def test_lowrank_remat_adds_no_collective_and_saves_less(btp, btp_lowrank):
    for key in ("allreduce_count", "allreduce_bytes", "allreduce_bytes_per_layer", "forward_allreduce_bytes"):
        assert btp_lowrank[key] == btp[key], key
    assert btp_lowrank["residual_bytes"] < 0.5 * btp["residual_bytes"]
    assert btp_lowrank["temp_bytes"] > 0 and btp["temp_bytes"] > 0


# -- CLI, bf16, data parallelism, dumps ----------------------------------------------------------------

def test_cli_json_bf16_with_data_parallel(cli):
    reports, _ = cli
    r = reports["btp"]
    for key in ("allreduce_count", "allreduce_bytes", "forward_allreduce_bytes"):
        assert isinstance(r[key], int) and r[key] > 0
    tokens = (4 // 2) * 16  # per data shard
    m = preset("tiny")
    # bf16 latents and statistics' parts (counted at bf16 although the CPU backend widens them to f32)
    w = stat_parts.n_parts(2)
    assert r["forward_allreduce_bytes_per_layer"] == tokens * (7 * m.rank + 2 * w) * 2
    assert r["forward_allreduce_bytes_per_layer"] == r["expected_per_layer"]["forward_bytes"]
    assert r["forward_allreduce_bytes_compiled_per_layer"] == tokens * (7 * m.rank + 2 * w) * 4
    # over `model` per layer: the latents both ways, and the gradient norm's partial sums of squares of the
    # layer's 11 model-sharded leaves (two f32 per leaf as compiled, in one tuple all-reduce per step)
    assert r["allreduce_scalar_bytes_per_layer"] == 2 * 11 * 4
    assert r["allreduce_bytes_per_layer_by_axis"]["model"] == tokens * (2 * 7 * m.rank + 2 * w) * 2 + 2 * 11 * 4
    # data parallelism: one gradient all-reduce of the block's local (d- or r-sharded) tensors, in bf16
    # because the parameters are cast to the compute dtype inside the shard_map
    d, f, r_, he = m.d_model, m.d_ff, m.rank, m.n_heads * m.head_dim
    block = 2 * d + 3 * d * r_ + r_ * he + 2 * r_ * he + he * r_ + r_ * d + 2 * d * r_ + 2 * r_ * f + f * r_ + r_ * d
    assert r["allreduce_bytes_per_layer_by_axis"]["data"] == block // 2 * 2
    assert "data" not in r["forward_allreduce_bytes_per_layer_by_axis"]


def test_cli_dump_hlo_reparses_to_the_same_figures(cli):
    reports, out_dir = cli
    r = reports["btp"]
    assert sorted(os.listdir(out_dir)) == ["btp.fwd.hlo.txt", "btp.hlo.txt"]
    for name, prefix in (("btp.hlo.txt", ""), ("btp.fwd.hlo.txt", "forward_")):
        with open(out_dir / name) as fh:
            summary = hlo.collective_summary(fh.read())
        assert summary["all-reduce"]["count"] == r[prefix + "allreduce_count"]
        assert summary["all-reduce"]["logical_bytes"] == r[prefix + "allreduce_bytes"]
        assert summary["all-reduce"]["bytes"] == r[prefix + "allreduce_bytes_compiled"]


def test_cli_table_and_errors(cli, capsys):
    assert cli_main(["comm", *CLI_ARGS]) == 0  # cached compiles: prints the table
    out = capsys.readouterr().out
    assert "btp" in out and "GiB/layer" in out
    assert cli_main(["comm", "--preset", "tiny", "--strategy", "btp", "--mesh", "data=1,model=3"]) == 2
    assert "not divisible by the TP size 3" in capsys.readouterr().err
    assert cli_main(["comm", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err


# -- the HLO text parser on a hand-written module ------------------------------------------------------

HLO_TEXT = """HloModule m, num_partitions=4

%fused_widen (param_0.1: f32[8,16]) -> f32[8,16] {
  %param_0.1 = f32[8,16]{1,0} parameter(0)
  %convert.1 = bf16[8,16]{1,0} convert(%param_0.1)
  ROOT %convert.2 = f32[8,16]{1,0} convert(%convert.1)
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

ENTRY %main (p0: f32[8,16], p1: f32[16,4], p2: f32[2,8,16], p3: f32[1,5,5,3], p4: f32[3,3,3,8], p5: f32[8,1]) -> f32[8,4] {
  %p0 = f32[8,16]{1,0} parameter(0)
  %p1 = f32[16,4]{1,0} parameter(1)
  %p2 = f32[2,8,16]{2,1,0} parameter(2)
  %p3 = f32[1,5,5,3]{3,2,1,0} parameter(3)
  %p4 = f32[3,3,3,8]{3,2,1,0} parameter(4)
  %p5 = f32[8,1]{1,0} parameter(5)
  %widened = f32[8,16]{1,0} fusion(%p0), kind=kLoop, calls=%fused_widen
  %ar = (f32[8,16]{1,0}, f32[8,1]{1,0}) all-reduce(%widened, %p5), channel_id=1, replica_groups={{0,1,2,3}}, use_global_device_ids=true, to_apply=%add
  %ars = f32[16,4]{1,0} all-reduce-start(%p1), channel_id=2, replica_groups=[2,2]<=[4], to_apply=%add
  %ard = f32[16,4]{1,0} all-reduce-done(%ars)
  %ags = (f32[8,16]{1,0}, f32[8,64]{1,0}) all-gather-start(%p0), channel_id=3, replica_groups=[2,2]<=[2,2]T(1,0), dimensions={1}
  %agd = f32[8,64]{1,0} all-gather-done(%ags)
  %rs = f32[2,16]{1,0} reduce-scatter(%p0), channel_id=4, replica_groups=mesh['data'=2,'model'=2] {'model'}, dimensions={0}, to_apply=%add
  %cp = f32[8,16]{1,0} collective-permute(%p0), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %one = f32[] all-reduce(%p0), channel_id=6, replica_groups={{0},{1},{2},{3}}, to_apply=%add
  %dot = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %bdot = f32[2,8,8]{2,1,0} dot(%p2, %p2), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={2}
  %conv = f32[1,3,3,8]{3,2,1,0} convolution(%p3, %p4), window={size=3x3}, dim_labels=b01f_01io->b01f
  ROOT %out = f32[8,4]{1,0} add(%dot, %dot)
}
"""


def test_hlo_collectives():
    cs = {c.name: c for c in hlo.collectives(HLO_TEXT)}
    assert set(cs) == {"ar", "ard", "agd", "rs", "cp", "one"}  # async pairs once, at the -done
    ar = cs["ar"]
    assert [str(a) for a in ar.results] == ["f32[8,16]", "f32[8,1]"]
    assert ar.logical_dtypes == ("bf16", "f32")  # rounded to bf16 then widened: counted at bf16
    assert ar.bytes == 8 * 16 * 4 + 8 * 4 and ar.logical_bytes == 8 * 16 * 2 + 8 * 4
    assert cs["ard"].is_async and cs["ard"].groups == ((0, 1), (2, 3))
    assert cs["agd"].kind == "all-gather" and cs["agd"].bytes == 8 * 64 * 4 and cs["agd"].groups == ((0, 2), (1, 3))
    assert cs["rs"].groups == ((0, 1), (2, 3))
    assert cs["cp"].kind == "collective-permute" and not cs["cp"].trivial
    assert cs["one"].trivial and cs["one"].group_size == 1
    summary = hlo.collective_summary(HLO_TEXT)
    assert summary["all-reduce"]["count"] == 2  # the single-device one moves nothing
    assert summary["all-reduce"]["bytes"] == ar.bytes + 16 * 4 * 4
    assert hlo.collective_summary(HLO_TEXT, include_trivial=True)["all-reduce"]["count"] == 3
    assert set(summary) == {"all-reduce", "all-gather", "reduce-scatter", "collective-permute"}


@pytest.mark.parametrize("groups,want", [
    ("mesh['data'=2,'model'=2] {'model'}", [[0, 1], [2, 3]]),
    ("mesh['data'=2,'model'=2] {'data'}", [[0, 2], [1, 3]]),
    # jax 0.10's CPU compile of a BTP step wrote its clip-norm all-reduce over `model` this way: the
    # ids as an iota transposed, [[0, 2], [1, 3]], read before as the listed ids 2, 2, 1, 0
    ("mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_0'}", [[0, 1], [2, 3]]),
    ("mesh['axis_0'=2,'axis_1'=2], device_ids=(0,2,1,3) {'axis_0'}", [[0, 1], [2, 3]]),
    ("mesh['a'=2,'b'=4], device_ids=([8]<=[4,2]T(1,0)) {'a'}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
])
def test_mesh_replica_groups_with_device_ids_listed_or_as_an_iota(groups, want):
    assert hlo.comms._mesh_groups(groups) == want


def test_hlo_gemms():
    gs = {g.name: g for g in hlo.gemms(HLO_TEXT)}
    dot, bdot, conv = gs["dot"], gs["bdot"], gs["conv"]
    assert (dot.m, dot.n, dot.k, dot.batch, dot.flops) == (8, 4, 16, 1, 2 * 8 * 4 * 16)
    assert dot.intensity() == pytest.approx(2 * 8 * 4 * 16 / ((8 * 16 + 16 * 4 + 8 * 4) * 4))
    assert dot.intensity("bf16") == pytest.approx(2 * dot.intensity())
    assert (bdot.m, bdot.n, bdot.k, bdot.batch) == (8, 8, 16, 2)
    assert conv.k == 3 * 3 * 3 and conv.flops == 2 * (3 * 3 * 8) * 27
    assert hlo.multiset_difference(hlo.gemms(HLO_TEXT), [dot]) == [bdot, conv]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_no_all_reduce_over_one_device_in_a_pipeline(schedule):
    """A data=1 pipeline mesh: no gradient or activation crosses a collective over a group of one device.
    GPipe's step holds none at all; 1F1B's keeps one variadic all-reduce of scalars (a reduce_sum the
    partitioner places outside its shard_map; it had three before the data axis was dropped)."""
    step = comm._compile(comm.model_for(TINY, "btp"), "data=1,stage=2,model=2", B, S, "btp", "none", "float32",
                         train=(("pipeline_schedule", schedule),))
    cs = hlo.collectives(step.step_text)
    assert any(c.kind == "all-reduce" for c in cs)  # the model-axis latents and gradients are there
    trivial = [c for c in cs if c.trivial]
    if schedule == "gpipe":
        assert trivial == [], [c.name for c in trivial]
    else:
        assert len(trivial) <= 1 and all(a.shape == () for c in trivial for a in c.results), trivial


@pytest.mark.parametrize("heads", [dict(), dict(n_kv_heads=2), dict(n_kv_heads=1, attn_head_dim=48)])
def test_expected_volume_is_read_from_the_blocks_parameters(heads):
    """The analytic volume comes from the block's parameters and the strategy's rules (every GEMM whose
    input dimension is split is row-parallel): full-rank `2d`, vanilla `he + 2·ke + 2d + 2f`, BTP `7r`."""
    from dataclasses import replace

    from boostjax.config import ModelConfig

    m = ModelConfig(kind="cola", **heads)
    d, f, r = m.d_model, m.d_ff, m.rank
    he, ke = m.n_heads * m.head_dim, m.kv_heads * m.head_dim
    want = {"fullrank-tp": 2 * d, "vanilla-tp": he + 2 * ke + 2 * d + 2 * f, "btp": 7 * r}
    for strategy, n in want.items():
        got = comm.expected_per_layer(comm.model_for(m, strategy), strategy, 10, "bfloat16")
        assert got["forward_elements_per_token"] == n, strategy
    assert comm.expected_per_layer(replace(m, kind="lax"), "btp", 10, "bfloat16")["forward_elements_per_token"] == 7 * r


@pytest.mark.parametrize("ranks,dense", [(dict(rank_kv=64), ("kv",)), (dict(rank_attn=64, rank_kv=64), ("attn", "kv"))])
def test_btp_with_projections_kept_dense(ranks, dense):
    """Projection groups kept dense under BTP (k/v: 64 x (128 + 128) >= 128 x 128) join the block's one
    Online-RMSNorm all-reduce with their full outputs (the q/o rank r, plus k/v's 2·ke and the MLP's 3r);
    a dense o gathers all heads instead (an all-gather of he per token). Read from the compiled program,
    equal to the analytic volume of the block's parameters."""
    from dataclasses import replace

    m = replace(TINY, **ranks)
    assert m.dense_groups == dense
    r = comm.comm_report(m, TP4, B, S, "btp", dtype="float32")
    he = ke = D  # tiny: 4 heads of 32, no GQA
    want = 3 * R + 2 * ke + (0 if "attn" in dense else 2 * R) + (he if "attn" in dense else 0)
    assert r["ranks"] == {g: "dense" if g in dense else R for g in ("attn", "kv", "mlp")}
    assert r["expected_per_layer"]["forward_elements_per_token"] == want
    assert r["forward_allreduce_bytes_per_layer"] == r["expected_per_layer"]["forward_bytes"] == TOKENS * (4 * want + 8)
    gathered = r["other_collectives_per_layer"].get("all-gather", {}).get("bytes", 0)
    assert gathered == r["expected_per_layer"]["forward_allgather_bytes"] == (TOKENS * he * 4 if "attn" in dense else 0)


SMALL = ModelConfig(kind="cola", d_model=32, n_layers=1, n_heads=2, d_ff=64, rank=16, vocab_size=256, max_seq_len=16)


# data=2 alone (0.5022, measured) is the same check; a pipeline's steps (GPipe and 1F1B, 0.5003) are
# checked in tests/test_zero.py on their compiled steps' HLO (~30 s each saved here)
@pytest.mark.parametrize("mesh,schedule,zeros", [("data=2,model=2", None, (1, 3))])
def test_zero_reduce_scatters_the_gradient_over_data(mesh, schedule, zeros):
    """ZeRO 1 and 3: every gradient a dimension of which splits over data is reduce-scattered there
    (the HLO's reduce-scatters over `data` carry 1/2 of the fp32 gradient), and the only all-reduce over
    data is of the leaves left whole and the scalars (loss, gradient norm). The reduction's ring bytes
    are half of ZeRO 0's all-reduce plus half the whole leaves' and the scalars (measured 0.5022 on data=2,
    0.5031 on data=2,model=2: the norm scales, whose one dimension btp keeps for `model`, stay whole).
    A pipeline (two layers over `stage`, GPipe's per-device loss): 0.5003, the stacked layers' norm
    scales [2, d] split too (1F1B: the same 0.5003, measured once; its report compiles ~3 min on 2 busy
    cores, so tests/test_zero.py checks its steps' HLO instead)."""
    g = None
    model, pipe = (replace(SMALL, n_layers=2), {"pipeline_schedule": schedule}) if schedule else (SMALL, {})
    for zero in zeros:
        r = comm.comm_report(model, mesh, B, S, "btp", dtype="float32", zero=zero, **pipe)
        dp = r["data_parallel"]
        g = r["weight_bytes"] if g is None else g  # ZeRO 1: the gradient's bytes per device before the split
        whole = sum(4 * math.prod(s) for s in dp["unsplit_gradients"].values())
        scattered, reduced = dp["collectives"]["reduce-scatter"]["bytes"], dp["collectives"]["all-reduce"]["bytes"]
        print(f"{mesh} {schedule} zero={zero}: reduce {dp['reduce_ring_bytes']} B vs zero 0 "
              f"{dp['zero0_reduce_ring_bytes']} B = {dp['reduce_vs_zero0']:.4f}; reduce-scatter {scattered} B, "
              f"all-reduce {reduced} B")
        assert g - whole <= 2 * scattered <= g
        assert reduced <= whole + 512
        assert 0.5 <= dp["reduce_vs_zero0"] <= 0.5 + (whole + 512) / dp["zero0_reduce_ring_bytes"]
