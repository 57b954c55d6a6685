"""Smoke test of experiments/staleness.py: a tiny run end to end, result files well-formed and finite."""

import json
import math

import numpy as np

from helpers import load_experiment



def _load():
    return load_experiment("staleness")


def test_helpers():
    st = _load()
    np.testing.assert_allclose(st.trailing_mean([4.0, 2.0, 6.0, 0.0], 2), [4.0, 3.0, 4.0, 3.0])
    assert st.steps_to_target(np.array([5.0, np.nan, 3.0, 2.0]), 3.0) == 3
    assert st.steps_to_target(np.array([5.0, np.nan]), 3.0) is None


def test_quick_run_writes_finite_results(tmp_path):
    st = _load()
    res = st.main(["--quick", "--out", str(tmp_path), "--layers", "2", "--stages", "1,2", "--steps", "12",
                   "--optimizers", "adamw,rotation", "--window", "3", "--n-eval", "1", "--seq", "16", "--batch", "2",
                   "--jobs", "1", "--extra-fracs", "0.3"])
    on_disk = json.loads((tmp_path / "staleness.json").read_text())
    assert on_disk["target_loss"] == res["target_loss"] and math.isfinite(res["target_loss"])
    assert (tmp_path / "staleness.png").stat().st_size > 1000
    assert [e["target_frac"] for e in on_disk["extra_targets"]] == [0.3]
    assert "| PipeDream (AdamW + stashing) | 2 |" in (tmp_path / "staleness.md").read_text()
    rows = {(r["optimizer"], r["stages"]): r for r in on_disk["rows"]}
    assert set(rows) == {("adamw", 1), ("adamw", 2), ("rotation", 1), ("rotation", 2)}
    for r in on_disk["rows"]:
        assert math.isfinite(r["final_train_loss"]) and math.isfinite(r["final_val_loss"])
        assert r["iters_to_target"] is None or 1 <= r["iters_to_target"] <= 12
    assert rows[("adamw", 1)]["slowdown"] == 1.0 and rows[("rotation", 1)]["slowdown"] == 1.0
    for run in on_disk["runs"]:
        assert len(run["losses"]) == 12 and all(math.isfinite(v) for v in run["losses"])
        assert run["losses"][-1] < run["losses"][0]  # it trains
