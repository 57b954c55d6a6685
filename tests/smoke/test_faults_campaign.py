"""Smoke test of experiments/faults/faults.py: `--quick` (a reference run, 2 signals, 1 damaged checkpoint)
end to end; the result file's counts add up and nothing differs from the uninterrupted run."""

import json

import numpy as np
import pytest

from experiments.faults import faults


pytestmark = pytest.mark.xdist_group("faults")  # starts training subprocesses, like tests/test_faults.py


def _load():
    return faults


def test_helpers(tmp_path):
    fx = _load()
    ref = {1: {"loss": 1.5, "grad_norm": 2.0, "lr": 0.1}, 2: {"loss": 1.25, "grad_norm": 2.0, "lr": 0.1}}
    ok = fx.compare([{"step": 1, **ref[1]}, {"step": 2, **ref[2]}], ref, complete=True)
    assert fx.compare_ok(ok)
    bad = fx.compare([{"step": 1, **ref[1]}, {"step": 1, **ref[1]}, {"step": 2, **ref[2], "loss": 1.2500000000000002}],
                     ref, complete=True)
    assert bad["duplicates"] == [1] and bad["different"] == [2] and not fx.compare_ok(bad)
    assert fx.compare([{"step": 1, **ref[1]}], ref, complete=True)["missing"] == [2]
    kinds = fx.draw_damage_kinds(np.random.default_rng(0), 12)
    assert len(kinds) == 12 and all(kinds.count(k) >= 2 for k in fx.DAMAGE_KINDS)
    step = tmp_path / "7"
    (step / "data").mkdir(parents=True)
    (step / "data" / "x").write_bytes(bytes(range(200)))
    (step / "big").write_bytes(bytes(1000))
    (step / fx.MANIFEST).write_text("".join(f"{fx._blake3(step / r)}  {r}\n" for r in ("big", "data/x")))
    assert fx.verify(step) is None
    fx.damage(step, "flip", np.random.default_rng(0))
    assert fx.verify(step) == "big: checksum mismatch"
    assert fx.classify_stderr("boostjax: checkpoint 7 has no checksums (x); restored without verification\n")["n_other"] == 0
    assert fx.classify_stderr("Traceback (most recent call last):\nKeyboardInterrupt\n")["traceback"]


@pytest.mark.experiment  # ~60 s: `pytest -m experiment` (test_faults.py checks the behaviour in CI)
def test_quick_campaign_counts_add_up(tmp_path):
    fx = _load()
    res = fx.main(["--quick", "--out", str(tmp_path), "--scratch", str(tmp_path / "scratch")])
    on_disk = json.loads((tmp_path / "faults.json").read_text())
    n = on_disk["counts"]
    assert n == res["counts"]
    assert n["mismatches"] == 0 and n["data_lost"] == 0 and n["lost_records"] == 0
    assert n["signal_faults"] >= 2 and n["signal_faults"] == sum(n["by_signal"].values())
    assert n["damage"] >= 1 and n["damage"] == sum(n["by_damage"].values())
    assert n["damage_reported_correctly"] == n["damage_in_place"] == n["damage_reports"]
    assert n["starts"] == len(on_disk["events"]) == n["restarts"] + n["campaign_runs"]
    assert n["resumes_matched"] + n["resumes_without_new_steps"] + n["resumes_mismatched"] == n["resumes"]
    assert n["final_runs_identical"] == n["campaign_runs"] >= 1
    for run in on_disk["runs"]:
        assert run["compare"]["records"] == on_disk["settings"]["steps"] and fx.compare_ok(run["compare"])
    assert sum(1 for e in on_disk["events"] if e["signal"]["sent"]) == n["signal_faults"]
    md = (tmp_path / "faults.md").read_text()
    assert "| **mismatches** (loss / grad norm / lr / val loss records, or final checkpoints, that differ) | **0** |" in md
    assert "python -m experiments.faults.faults --quick" in md
    again = tmp_path / "again"
    again.mkdir()
    fx.main(["--from-json", str(tmp_path / "faults.json"), "--out", str(again)])
    assert (again / "faults.md").read_text() == md  # the report is a function of faults.json
