"""experiments/gpu/gpu_suite.py: without a GPU it stops at once (exit 2, one line, nothing written, JAX
not imported); `--smoke` runs every section on CPU at tiny shapes and writes the JSON with each one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT
from experiments import common
from experiments.gpu import gpu_suite as suite


def test_no_gpu_fails_fast_with_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "results"
    code = ("import sys; from experiments.gpu import gpu_suite; "
            f"rc = gpu_suite.main(['--out', {str(out)!r}]); "
            "assert 'jax' not in sys.modules, 'JAX was imported before the GPU check'; sys.exit(rc)")
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # what a machine without a GPU (and this test) runs with
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_suite: ") and "fix:" in lines[0], p.stderr
    assert p.stdout == "" and not out.exists()


def test_no_gpu_reasons(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert "JAX_PLATFORMS=cpu" in suite.no_gpu_reason()
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(suite, "nvidia_present", lambda: False)
    assert "no NVIDIA GPU" in suite.no_gpu_reason() and "--smoke" in suite.no_gpu_reason()
    monkeypatch.setattr(suite, "nvidia_present", lambda: True)
    assert suite.no_gpu_reason() is None  # the JAX probe decides then


def test_bad_flags_exit_2_before_anything(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert suite.main(["--smoke", "--out", str(f / "sub")]) == 2
    assert suite.main(["--smoke", "--policies", "plan,nope", "--out", str(tmp_path / "o")]) == 2
    assert suite.main(["--smoke", "--budget-s", "0", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("gpu_suite: ") and "fix:" in e for e in err)
    assert not (tmp_path / "o").exists()
    assert suite.out_folder(suite.parser().parse_args(["--smoke"])) is None  # a temp folder, never results/
    assert suite.out_folder(suite.parser().parse_args([])) == str(common.RESULTS)


def test_spent_budget_skips_every_run_with_a_reason(tmp_path):
    assert suite.main(["--smoke", "--budget-s", "1", "--out", str(tmp_path)]) == 1  # nothing started
    res = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert list(res["sections"]) == list(suite.SECTIONS)
    runs = res["sections"]["throughput"]["runs"] + res["sections"]["offload"]["runs"]
    assert len(runs) == 6 and all(r["status"] == "skipped" and "--budget-s" in r["reason"] for r in runs)
    assert res["sections"]["collectives"]["status"] == "skipped"
    assert res["sections"]["memory"]["prediction"]["status"] == "skipped"


@pytest.mark.experiment  # ~40 s: `pytest -m experiment`, before a GPU session
def test_smoke_runs_every_section(tmp_path, monkeypatch):
    # the baselines run the same code as the plan (only the policy differs): one policy keeps CI short
    rc = suite.main(["--smoke", "--policies", "plan", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert rc == 0, json.dumps(res["sections"], indent=1)[:3000]
    assert res["smoke"] and list(res["sections"]) == list(suite.SECTIONS)
    secs = res["sections"]
    assert all(s["status"] == "ok" and s["smoke"] for s in secs.values())
    t = secs["throughput"]
    assert [r["kind"] for r in t["runs"]] == ["llama", "cola"]
    for r in t["runs"]:
        assert r["platform"] == "cpu" and r["tokens_per_s"] > 0 and r["compiled_memory"]["total_bytes"] > 0
    assert t["runs"][1]["params"] < t["runs"][0]["params"] and t["speedup_cola_over_dense"] > 0
    rows = {r["kind"]: r for r in secs["memory"]["rows"]}
    assert set(rows) == {"llama", "cola"} and rows["cola"]["compiled_total_bytes"] > 0
    assert secs["memory"]["prediction"]["status"] in ("ok", "unavailable")
    c = secs["collectives"]
    assert c["platform"] == "cpu" and c["mesh"] == "data=1,model=1" and c["cannot_show"]
    pl = c["allreduce_per_layer"]
    assert 0 <= pl["trivial_count"] <= pl["count"] and 0 <= pl["trivial_bytes"] <= pl["bytes"]
    # a one-device mesh: the step holds no all-reduce over one device (the size-1 data axis is dropped)
    assert c["expected_btp_step_bytes_per_layer"] > 0 and pl["trivial_count"] == 0 and pl["trivial_bytes"] == 0
    (plan,) = secs["offload"]["runs"]
    assert plan["policy"] == "plan" and plan["status"] == "ok" and plan["tokens_per_s"] > 0
    md = (tmp_path / "gpu_suite.md").read_text()
    assert "SMOKE RUN ON CPU" in md and all(f"## ({x})" in md for x in "abcd")


def test_prediction_reads_memory_report_and_falls_back_to_a_one_device_tp_mesh(monkeypatch):
    from boostjax.config import ConfigError
    from boostjax.analysis import memory

    calls = []

    def fake(model, mesh, batch, seq, strategy, remat="none", dtype="bfloat16", **train_fields):
        calls.append((model.kind, mesh, batch, seq, strategy, remat, dtype))
        if strategy == "none":
            raise ConfigError("comm.strategy: 'none' is not a TP strategy; fix: pass btp")
        return {"peak_bytes_per_device": 300, "weight_bytes": 100, "optimizer_bytes": 150, "activation_bytes": 50,
                "memory": {"temp_bytes": 7}}

    monkeypatch.setattr(memory, "memory_report", fake)
    big = suite.dataclasses.replace(suite.SMOKE, preset="60m")  # not the smoke preset: both models
    rec = suite.predict_worker(big, "")
    assert rec["status"] == "ok"
    assert [c[4] for c in calls] == ["none", "fullrank-tp", "none", "btp"]
    assert all(c[1:4] in (("", 2, 16), ("data=1,model=1", 2, 16)) and c[5:] == ("none", "bfloat16") for c in calls)
    cola = rec["models"]["cola"]
    assert cola["strategy"] == "btp" and cola["peak_bytes_per_device"] == 300 and "memory" not in cola
    assert "not a TP strategy" in cola["refused"][0]
    json.dumps(rec)  # what the worker prints
