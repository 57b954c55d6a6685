"""Smoke tests of experiments/tp/scaling_model.py (the time model on tiny compiled programs) and of
experiments/gpu/gpu_step.py: it refuses the CPU, and (marked experiment) its CPU smoke mode (the real
training step, 1 warm-up + 1 timed step)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest

from boostjax.config import preset
from experiments.gpu import gpu_step as gs
from experiments.tp import scaling_model as sm


TINY = preset("tiny", n_heads=8)  # d=128, 4 layers, 8 heads (2 per device: score arrays), d_ff=352, r=32, vocab 256
SETUP = sm.Setup("tiny", 4, pp=2, microbatches=2, micro_batch=4, seq=16, model=TINY)  # TP4 x PP2, M = 2 of 4


@pytest.fixture(scope="module")
def costs():
    return {s: sm.layer_costs(SETUP, s) for s in sm.STRATEGIES}  # 6 abstract compiles


@pytest.fixture(scope="module")
def rows(costs):
    return {s: sm.predict(SETUP, s, sm.A100, 0.5, costs[s]) for s in sm.STRATEGIES}


def test_predicted_times_are_positive_and_add_up(rows):
    for r in rows.values():
        assert r["iteration_s"] > 0 and r["gemm_s"] > 0 and r["memory_s"] > 0 and r["comm_s"] > 0 and r["p2p_s"] > 0
        assert r["iteration_s"] == pytest.approx(r["gemm_s"] + r["memory_s"] + r["comm_s"] + r["p2p_s"])
        assert r["bubble_fraction"] == pytest.approx(1 / 3)  # 1F1B / GPipe (P-1)/(M+P-1), P=2, M=2
        assert r["optimizer_s"] > 0 and r["optimizer_memory_s"] > 0 and r["fwd_bwd_s_per_slot"] > r["optimizer_s"]
        assert 0 < r["mfu"] < 1
        assert 0 < r["stage_gemm_flops"] <= r["xla_stage_flops"]  # HLO dots within cost_analysis()


def test_btp_moves_fewer_bytes_than_vanilla(costs, rows):
    btp, van, full = rows["btp"], rows["vanilla-tp"], rows["fullrank-tp"]
    assert btp["per_layer_comm_bytes"] < van["per_layer_comm_bytes"]
    assert btp["stage_comm_bytes"] < van["stage_comm_bytes"]
    # the bandwidth term follows the bytes (at these tiny shapes alpha x collectives dominates comm_s)
    no_alpha = replace(sm.A100, alpha_s=0.0)
    assert (sm.predict(SETUP, "btp", no_alpha, 0.5, costs["btp"])["comm_s"]
            < sm.predict(SETUP, "vanilla-tp", no_alpha, 0.5, costs["vanilla-tp"])["comm_s"])
    assert btp["p2p_s"] < full["p2p_s"]  # BTP's residual stream is sharded on d
    # Megatron: per layer, 2 all-reduces of [b, s, d] forward and 2 backward (bf16), + optimizer-norm scalars
    megatron = 4 * SETUP.micro_batch * 16 * TINY.d_model * 2  # one micro-batch's step
    assert megatron <= full["per_layer_comm_bytes"] < megatron + 1024


def test_iteration_is_slots_of_forward_backward_plus_one_optimizer_step(costs, rows):
    more = replace(SETUP, microbatches=5)  # same compiled programs (one micro-batch), 3 more slots
    for s, r in rows.items():
        r5 = sm.predict(more, s, sm.A100, 0.5, costs[s])
        assert r5["bubble_fraction"] == pytest.approx(1 / 6)
        assert r5["iteration_s"] - r["iteration_s"] == pytest.approx(3 * r["fwd_bwd_s_per_slot"], rel=1e-9)
        assert r["iteration_s"] == pytest.approx(3 * r["fwd_bwd_s_per_slot"] + r["optimizer_s"] + r["p2p_s"])


def test_score_arrays_are_told_from_activations_with_d_equal_to_seq():
    from boostjax.analysis.hlo import parse_shapes as arr
    from boostjax.planning.costs import _score_shaped  # the scaling model's, now the planner's

    scores, resid = arr("bf16[1,8,4096,4096]"), arr("bf16[1,4096,4096]")  # 7B: d = s = 4096
    assert _score_shaped(scores, 4096, 1) and not _score_shaped(resid, 4096, 1)
    assert not _score_shaped(arr("f32[4,4096,4096]"), 4096, 4)


def test_calibration_recovers_eta_and_table_has_every_row(costs, rows):
    t = rows["fullrank-tp"]["iteration_s"]
    assert sm.calibrate(costs["fullrank-tp"], sm.A100, t, SETUP, "fullrank-tp") == pytest.approx(0.5, rel=1e-6)
    paper = {"tiny": {s: r["iteration_s"] for s, r in rows.items()}}  # inputs: the model's own eta=0.5 times
    res = sm.run((SETUP,), (), paper=paper, calibration=("tiny", "fullrank-tp"))
    assert res["eta"] == pytest.approx(0.5, rel=1e-6)
    for r in res["rows"]:
        if r["table"] == "paper":
            assert r["model_over_paper"] == pytest.approx(1.0, rel=1e-6)
    md = sm.markdown(res)
    for name in sm.NAMES.values():
        # beside the paper (A100), in the implied-slots table of pipelined rows, and in the H200 projection
        assert md.count(f"| TINY TP4 PP2 | {name} |") == 3
    assert "M = 2 micro-batches of 4 sequence(s) of 16 tokens" in md  # the setups' own micro-batching
    h200 = {r["strategy"]: r["iteration_s"] for r in res["rows"] if r["table"] == "h200"}
    assert all(h200[s] < rows[s]["iteration_s"] for s in sm.STRATEGIES)  # faster hardware, same programs


def test_gpu_step_refuses_cpu(tmp_path, capsys):
    assert gs.main(["--out", str(tmp_path)]) == 2  # this process runs JAX on CPU
    assert "no GPU" in capsys.readouterr().err and not os.listdir(tmp_path)


@pytest.mark.experiment  # an experiment script's end-to-end smoke run (~15 s): `pytest -m experiment`
def test_gpu_step_smoke_runs_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # main() sets it; restored afterwards
    # the two workers (subprocesses) inherit conftest's cheap CPU codegen: a smoke run, not a benchmark
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored afterwards, whatever main() sets
    args = ["--allow-cpu", "--preset", "tiny", "--vocab", "0", "--layers", "2", "--batch", "2", "--seq", "16",
            "--warmup", "1", "--steps", "1", "--out", str(tmp_path)]
    assert gs.main(args) == 0, capsys.readouterr()
    res = json.loads((tmp_path / "gpu_step.json").read_text())
    assert [r["kind"] for r in res["runs"]] == ["llama", "cola"]
    for r in res["runs"]:
        assert r["status"] == "ok" and r["platform"] == "cpu" and r["tokens_per_s"] > 0
        assert len(r["step_s_all"]) == 1 and all(math.isfinite(x) for x in r["losses"])
    assert res["runs"][1]["params"] < res["runs"][0]["params"]  # CoLA is smaller
    assert "SMOKE RUN ON CPU" in (tmp_path / "gpu_step.md").read_text()
