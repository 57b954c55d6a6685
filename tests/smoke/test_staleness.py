"""Smoke test of experiments/rotation/staleness.py: a tiny run end to end, result files well-formed and finite;
the per-optimizer target rule by hand; resuming from the partial file; re-rendering a stored JSON."""

import json
import math

import numpy as np
import pytest

from experiments.rotation import staleness


def _load():
    return staleness


def test_helpers_and_per_optimizer_targets():
    st = _load()
    np.testing.assert_allclose(st.trailing_mean([4.0, 2.0, 6.0, 0.0], 2), [4.0, 3.0, 4.0, 3.0])
    assert st.steps_to_target(np.array([5.0, np.nan, 3.0, 2.0]), 3.0) == 3
    assert st.steps_to_target(np.array([5.0, np.nan]), 3.0) is None
    # two optimizers, S in {1, 4}, window 1: each gets its own L* = its S = 4 final loss
    s = st.Settings(optimizers=("adamw", "rotation"), stages=(1, 4), steps=6, window=1, extra_fracs=(0.5,),
                    eval_every=0)  # the smoothed-training-loss rule (results stored without held-out curves)
    run = lambda o, n, xs: {"optimizer": o, "stages": n, "losses": xs, "diverged": False,  # noqa: E731
                            "final_val_loss": 0.0, "compile_s": 0.0, "train_s": 0.0, "step_ms": 0.0}
    runs = [run("adamw", 1, [6, 5, 4, 3, 2, 1]), run("adamw", 4, [6, 6, 5, 5, 4, 4]),
            run("rotation", 1, [6, 3, 2, 1, 1, 1]), run("rotation", 4, [6, 4, 3, 2, 2, 2])]
    main = st.summarize(s, runs)
    assert main["targets"] == {"adamw": 4.0, "rotation": 2.0} and "target_set_by" not in main
    rows = {(r["optimizer"], r["stages"]): r for r in main["rows"]}
    assert rows[("adamw", 4)]["iters_to_target"] == 5 and rows[("adamw", 4)]["slowdown"] == 5 / 3
    assert rows[("rotation", 4)]["iters_to_target"] == 4 and rows[("rotation", 4)]["slowdown"] == 4 / 3
    assert rows[("rotation", 4)]["slowdown_vs_adamw_s1"] == 4 / 5  # adamw S = 1 reaches 2.0 at step 5
    half = st.summarize(s, runs, 0.5)  # own S = 1 loss at step 3: adamw 4.0, rotation 2.0
    rows = {(r["optimizer"], r["stages"]): r for r in half["rows"]}
    assert half["targets"] == {"adamw": 4.0, "rotation": 2.0}
    assert rows[("adamw", 4)]["slowdown"] == 5 / 3 and rows[("rotation", 1)]["slowdown"] == 1.0


def test_heldout_rule_and_budget_reading_by_hand():
    """Held-out losses every 2 steps of 8: L* = the S = 4 run's final held-out loss (3.0); S = 1 reaches
    it at its evaluation of step 4, S = 4 at step 6 (its step-8 value is the target itself): slowdown
    6 / 4; the budget reading counts S = 4 as needing all 8 steps: 8 / 4. The training losses do not
    enter (they say the opposite here)."""
    st = _load()
    s = st.Settings(optimizers=("adamw",), stages=(1, 4), steps=8, eval_every=2, extra_fracs=(0.5,))
    run = lambda n, val: {"optimizer": "adamw", "stages": n, "losses": [1.0] * 8, "diverged": False,  # noqa: E731
                          "val_steps": [2, 4, 6, 8], "val_losses": val, "final_val_loss": val[-1],
                          "compile_s": 0.0, "train_s": 0.0, "step_ms": 0.0}
    runs = [run(1, [4.0, 2.9, 2.5, 2.0]), run(4, [5.0, 4.0, 3.0, 3.0])]
    main = st.summarize(s, runs)
    rows = {r["stages"]: r for r in main["rows"]}
    assert main["targets"] == {"adamw": 3.0} and main["rule"] == "own S_max final held-out loss"
    assert rows[4]["iters_to_target"] == 6 and rows[4]["slowdown"] == 6 / 4 and rows[4]["slowdown_budget"] == 8 / 4
    assert rows[1]["slowdown_budget"] is None
    half = st.summarize(s, runs, 0.5)  # own S = 1 held-out loss at step 4: 2.9, S = 4 never gets there
    rows = {r["stages"]: r for r in half["rows"]}
    assert half["targets"] == {"adamw": 2.9} and rows[4]["lower_bound"] and rows[4]["slowdown"] == 8 / 4
    faster = st.summarize(s, [run(1, [4.0, 3.5, 3.2, 3.1]), run(4, [4.0, 3.0, 2.8, 2.6])])["rows"][1]
    assert faster["upper_bound"] and faster["slowdown"] == 8 / 8 and st._slow(faster) == "<1.00x"  # S = 1 never gets there
    diverged = [runs[0], {**run(4, [5.0, None]), "val_steps": [2, 4], "diverged": True}]
    assert st.summarize(s, diverged)["targets"] == {"adamw": None}  # no S_max final loss: no target


@pytest.mark.experiment  # `pytest -m experiment`
def test_quick_run_resumes_and_writes_finite_results(tmp_path, capsys):
    st = _load()
    flags = ["--quick", "--out", str(tmp_path), "--layers", "2", "--stages", "1,2", "--steps", "12",
             "--optimizers", "adamw,rotation-ref", "--window", "3", "--n-eval", "1", "--seq", "16", "--batch", "2",
             "--eval-every", "4",
             "--jobs", "1", "--extra-fracs", "0.5", "--lr", "1e-3", "--name", "staleness"]
    s = st.replace(st.QUICK, optimizers=("adamw", "rotation-ref"), stages=(1, 2), n_layers=2, steps=12, window=3,
                   n_eval=1, seq=16, batch=2, jobs=1, extra_fracs=(0.5,), lr=1e-3, eval_every=4)
    # as if an interrupted invocation had finished this run (made-up losses: one compile less)
    first = {"optimizer": "adamw", "stages": 1, "losses": [5.5 - 0.1 * k for k in range(12)], "diverged": False,
             "compile_s": 1.0, "train_s": 1.0, "step_ms": 80.0, "final_val_loss": 4.5,
             "val_steps": [4, 8, 12], "val_losses": [5.2, 4.9, 4.5]}
    (tmp_path / "staleness.partial.jsonl").write_text(
        json.dumps({"settings": st._settings_key(s)}) + "\n" + json.dumps(first) + "\n")
    res = st.main(flags)
    assert "resuming, 1 finished run(s)" in capsys.readouterr().out
    assert not (tmp_path / "staleness.partial.jsonl").exists() and res["resumed_runs"] == 1
    on_disk = json.loads((tmp_path / "staleness.json").read_text())
    assert on_disk["targets"] == res["targets"] and all(math.isfinite(v) for v in res["targets"].values())
    assert (tmp_path / "staleness.png").stat().st_size > 1000
    assert [e["target_frac"] for e in on_disk["extra_targets"]] == [0.5]
    md = (tmp_path / "staleness.md").read_text()
    assert "| PipeDream (AdamW + stashing) | 2 |" in md and "T_c = 2 steps" in md and "Gram EMA β 0.95" in md
    rows = {(r["optimizer"], r["stages"]): r for r in on_disk["rows"]}
    assert set(rows) == {("adamw", 1), ("adamw", 2), ("rotation-ref", 1), ("rotation-ref", 2)}
    for r in on_disk["rows"]:
        assert math.isfinite(r["final_train_loss"]) and math.isfinite(r["final_val_loss"])
    assert rows[("adamw", 2)]["reached"] and rows[("adamw", 1)]["slowdown"] == 1.0
    for run in on_disk["runs"]:
        assert len(run["losses"]) == 12 and all(math.isfinite(v) for v in run["losses"])
        assert run["val_steps"] == [4, 8, 12] and run["val_losses"][-1] == run["final_val_loss"]
        assert run["losses"][-1] < run["losses"][0]  # it trains
    assert on_disk["runs"][0] == json.loads(json.dumps(first))  # the resumed run, not a new one
    # invocations side by side: their results JSONs combined by --reuse (a list), nothing trained again
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "staleness.json").write_text(json.dumps(
        {**on_disk, "runs": [r for r in on_disk["runs"] if r["optimizer"] == "adamw"], "wall_s": 60.0}))
    both = st.main([*flags[:flags.index("--name")], "--name", "combined", "--reuse",
                    f"{tmp_path / 'a' / 'staleness.json'},{tmp_path / 'staleness.json'}"])
    assert both["runs"] == on_disk["runs"] and both["targets"] == on_disk["targets"]
    assert [src["optimizers"] for src in both["reused_from"]["files"]] == [["adamw"], ["rotation-ref"]]
    assert "wall time 1.0 min" in (tmp_path / "combined.md").read_text()
    # re-render the stored JSON as a result made with the earlier baselines: old baselines named, same runs
    old = {**on_disk, "settings": {k: v for k, v in on_disk["settings"].items() if k not in ("tc_frac", "warmup_frac")}}
    (tmp_path / "old" ).mkdir()
    (tmp_path / "old" / "staleness_x.json").write_text(json.dumps(old))
    st.main(["--render", str(tmp_path / "old" / "staleness_x.json"), "--out", str(tmp_path / "old")])
    again = json.loads((tmp_path / "old" / "staleness_x.json").read_text())
    assert again["runs"] == on_disk["runs"] and again["settings"]["legacy_baselines"] is True
    assert "**Old baselines.**" in (tmp_path / "old" / "staleness_x.md").read_text()
