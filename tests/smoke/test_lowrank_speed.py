"""experiments/speed/lowrank_speed.py: a seconds-long smoke run of the interleaved benchmark and its
profiled op breakdown (tiny shapes; the numbers mean nothing, the plumbing does)."""

import json

import pytest

from experiments.speed import lowrank_speed as ls


@pytest.mark.experiment  # an experiment script's end-to-end smoke run (~10 s): `pytest -m experiment`
def test_smoke_run_writes_ratios_and_breakdown(tmp_path):
    args = ["--shapes", "tiny", "--kinds", "cola,llama", "--vocab", "256", "--layers", "1", "--batch", "2",
            "--seq", "16", "--warmup", "1", "--rounds", "2", "--profile-steps", "1", "--out", str(tmp_path)]
    assert ls.main(args) == 0
    res = json.loads((tmp_path / "lowrank_speed.json").read_text())
    (shape,) = res["shapes"]
    assert list(shape["runs"]) == ["llama", "cola"]  # dense first: the reference of every ratio
    for kind, r in shape["runs"].items():
        assert r["tokens_per_s"] > 0 and len(r["step_ms_all"]) == 2 and r["gflops_per_s"] > 0
        assert r["speedup_q1"] <= r["speedup"] <= r["speedup_q3"]
    assert shape["runs"]["llama"]["speedup"] == 1.0 and shape["runs"]["cola"]["flop_ratio"] > 1.0
    bd = res["breakdown"]
    assert bd["cola"]["by_part"]["low-rank grouped B (k,v / gate,up)"] > 0
    assert "low-rank grouped B (k,v / gate,up)" not in bd["llama"]["by_part"]
    for kind in ("llama", "cola"):
        assert bd[kind]["by_part"]["optimizer (clip + AdamW)"] > 0 and bd[kind]["by_part"]["LM head + loss"] > 0
        assert bd[kind]["hlo_counts"]["dot"] > 0
    md = (tmp_path / "lowrank_speed.md").read_text()
    assert "| CoLA |" in md and "Where the step time goes" in md and res["machine"]["cpus_usable"] >= 1
    assert (tmp_path / "lowrank_speed.png").stat().st_size > 0


@pytest.mark.parametrize("bad", [["--kinds", "cola,gpt"], ["--shapes", "huge"], ["--rounds", "-1"]])
def test_bad_flags_exit_2(bad, tmp_path):
    with pytest.raises(SystemExit) as e:
        ls.main([*bad, "--out", str(tmp_path)])
    assert e.value.code == 2
