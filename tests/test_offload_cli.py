"""`boostjax plan`: JSON fields, the readable summary, an infeasible budget (exit 2 with the smallest
budget that works), LazyTrain's 27B instance, `boostjax train --offload-plan` end to end, and a plan
made with a run's flags (train's defaults, any optimizer) accepted by that run."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest

from boostjax.cli import main
from boostjax.config import ConfigError
from boostjax.offload.planfile import read_plan
from boostjax.runs.load import read_metrics
from helpers import MICRO, model_flags

SHAPE = model_flags(replace(MICRO, n_layers=4))
PLAN = ["plan", "--preset", "tiny", *SHAPE, "--batch", "4", "--seq", "32", "--dtype", "float32",
        "--optimizer", "adamw", "--time-limit", "10"]


def test_plan_json_fields_and_train_with_the_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    # 1.0 MB: below the full-remat peak (1.14 MB), above the smallest working budget (0.94 MB)
    assert main([*PLAN, "--memory-cap", "0.001", "--json", "--out", str(out)]) == 0
    rep = json.loads(capsys.readouterr().out)
    for key in ("status", "solve_s", "predicted_step_s", "predicted_peak_bytes", "budget_bytes", "schedule",
                "layers", "baselines", "speedup_vs_megatrain"):
        assert key in rep, key
    assert rep["status"] in ("OPTIMAL", "FEASIBLE") and rep["predicted_peak_bytes"] <= 0.001e9
    assert set(rep["baselines"]) == {"no-offload", "full-remat", "megatrain"}
    for b in rep["baselines"].values():
        assert {"predicted_step_s", "predicted_peak_bytes", "fits"} <= b.keys()
    assert not rep["baselines"]["no-offload"]["fits"]
    assert rep["predicted_step_s"] <= min(b["predicted_step_s"] for b in rep["baselines"].values() if b["fits"])
    assert sum(r["last"] - r["first"] + 1 for r in rep["layers"]) == 4
    plan = read_plan(out)
    assert len(plan.decisions.boundary) == 4 and plan.predicted_peak_bytes == rep["predicted_peak_bytes"]
    # full remat with everything on device does not fit: something lives on the host or is recomputed
    assert set(plan.boundary) != {"device"} or "host" in plan.opt_place

    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", *SHAPE, "--batch", "4", "--seq", "32", "--steps", "12",
                 "--log-every", "4", "--eval-every", "12", "--eval-batches", "1", "--offload-plan", str(out),
                 "--out", str(run), "--no-progress"]) == 0
    losses = [m["loss"] for m in read_metrics(run) if "loss" in m]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_plan_summary_and_infeasible_budget(capsys):
    assert main([*PLAN, "--memory-cap", "0.1"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"layers 0-3: boundary device, inner all", text) and "megatrain" in text
    assert main([*PLAN, "--memory-cap", "0.0001"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "smallest budget that works" in err
    need = float(re.search(r"fix: pass --memory-cap ([0-9.e-]+)", err).group(1))
    assert main([*PLAN, "--memory-cap", str(need), "--json"]) == 0  # the suggested budget works
    assert json.loads(capsys.readouterr().out)["predicted_peak_bytes"] <= need * 1e9


def test_lazytrain_27b_instance(capsys):
    # solve time is measured by experiments/offload/offload.py (~4 s here); the time limit is wall-clock, so it
    # only bounds a stuck solve and leaves room for a machine busy with other tests
    assert main(["plan", "--instance", "lazytrain-27b", "--json", "--time-limit", "120"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["status"] == "OPTIMAL" and rep["n_layers"] == 64
    assert rep["predicted_peak_bytes"] <= 21.55e9
    mega = rep["baselines"]["megatrain"]
    assert mega["fits"] and rep["speedup_vs_megatrain"] > 1.1
    assert not rep["baselines"]["no-offload"]["fits"]


# ----------------------------------------------------------------------------- the same flags, the same run

def _train_config(*flags):
    """The validated config `boostjax train FLAGS` runs (the offload plan checked against it), nothing run."""
    from boostjax.cli import build_parser
    from boostjax.cli.train import train_config

    return train_config(build_parser().parse_args(["train", *map(str, flags)]))


# rotation trains under an offload plan in test_combinations (BTP, stages, delay): here it is only accepted
@pytest.mark.parametrize("optimizer,steps", [("adamw", 0), ("adam8bit", 2), ("rotation", 0)])
def test_a_plan_made_with_a_runs_flags_is_accepted_by_that_run(tmp_path, capsys, optimizer, steps):
    """`boostjax plan` with train's defaults (tiny, batch 16, seq 128, float32) and an optimizer, then
    `boostjax train` with the same flags and the plan: accepted (8-bit Adam trained two steps)."""
    plan = tmp_path / "plan.json"
    flags = ["--optimizer", optimizer, "--n-layers", "2"]  # two layers of the tiny preset: a quicker compile
    assert main(["plan", *flags, "--time-limit", "10", "--out", str(plan)]) == 0
    rec = read_plan(plan).planned_for
    assert (rec["train.optimizer"], rec["train.batch"], rec["train.seq"], rec["train.dtype"], rec["model.d_model"],
            rec["model.n_layers"]) == (optimizer, 16, 128, "float32", 128, 2)
    run = ["--offload-plan", plan, "--out", tmp_path / "run"]
    cfg = _train_config(*flags, *run)
    assert cfg.train.offload_plan == str(plan) and cfg.train.optimizer == optimizer
    if optimizer == "rotation":  # the plan priced this optimizer's state: a differently shaped state is refused
        with pytest.raises(ConfigError, match="optimizer_state_bytes_per_layer.*--rot-geometry"):
            _train_config(*flags, "--rot-geometry", "unilateral", *run)
        with pytest.raises(ConfigError, match="train.optimizer='rotation' but this run has train.optimizer='adamw'"):
            _train_config("--n-layers", "2", *run)
    if optimizer == "adamw":  # a plan of an older boostjax records the optimizer's name only
        old = json.loads(plan.read_text())
        del old["planned_for"]["optimizer_state_bytes_per_layer"]
        plan.write_text(json.dumps(old))
        _train_config(*flags, *run)
    if steps:
        text = tmp_path / "text.txt"
        text.write_text("the same flags make the same run. " * 400)
        assert main(["train", *flags, *map(str, run), "--steps", str(steps), "--data", str(text), "--eval-batches",
                     "1", "--no-progress", "--no-tensorboard"]) == 0, capsys.readouterr().err
        losses = [m["loss"] for m in read_metrics(tmp_path / "run") if "loss" in m]
        assert len(losses) >= 1 and all(math.isfinite(x) for x in losses)
