"""A run folder written by an older boostjax keeps resuming with the same command line.

The test writes the older format itself: a CoLA run trained through the CLI whose `config.json` is then
rewritten as an older boostjax wrote it, without the fields added since (`only_lr_act`: the MLP was
`silu(gate) * up` then, `boostjax.runs.folder.LEGACY_MODEL`; `doc_mask`, `tensorboard`, `profile`,
`hardware`, `nesterov_psi`: torch's 0.004 then, `LEGACY_TRAIN`; `clip_scope`), with `norm_eps` 1e-5 where
the CLI's preset now says 1e-6 and `delay_lr_tc` 1000, the default before it became 7/3 of the warmup. The same command (without
`--norm-eps` or `--only-lr-act`) resumes it from its step-2 checkpoint (the step-4 one is removed, as if
the run had stopped before writing it): the steps continue, the losses equal those the run logged the
first time, and the stored values of the fields whose default changed (`FOLLOW_STORED`) are kept.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from boostjax.cli import main
from boostjax.runs.folder import FOLLOW_STORED, FOLLOW_STORED_TRAIN, LEGACY_MODEL, LEGACY_TRAIN
from helpers import model_flags

FLAGS = [*model_flags(), "--seq", "32", "--batch", "4", "--no-progress", "--log-every", "1", "--eval-every", "1000",
         "--ckpt-every", "2"]
# what the older run was trained with: the MLP and the norm of boostjax before these fields changed
OLD_FLAGS = ["--no-only-lr-act", "--norm-eps", "1e-5", "--delay-lr-tc", "1000"]
ADDED_SINCE = {"model": ("only_lr_act",),
               "train": ("doc_mask", "tensorboard", "profile", "hardware", "nesterov_psi", "clip_scope")}


def _losses(folder) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def _write_older_config(folder) -> dict:
    """Rewrite `config.json` as an older boostjax wrote it; returns the stored dict."""
    d = json.loads((folder / "config.json").read_text())
    for section, names in ADDED_SINCE.items():
        for name in names:
            del d[section][name]
    (folder / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    return d


@pytest.mark.slow
def test_a_run_folder_of_an_older_boostjax_resumes(tmp_path):
    assert set(LEGACY_MODEL) <= FOLLOW_STORED  # a field added since is read as the older run's value and kept
    assert set(LEGACY_TRAIN) <= FOLLOW_STORED_TRAIN
    old = tmp_path / "old"
    assert main(["train", *FLAGS, *OLD_FLAGS, "--steps", "4", "--out", str(old)]) == 0
    first = _losses(old)
    shutil.rmtree(old / "checkpoints" / "4")
    stored = _write_older_config(old)
    assert "only_lr_act" not in stored["model"] and stored["model"]["norm_eps"] == 1e-5

    assert main(["train", *FLAGS, "--steps", "4", "--out", str(old)]) == 0  # the same command, no model flags

    history = [json.loads(x) for x in (old / "config_history.jsonl").read_text().splitlines()]
    assert [h["start_step"] for h in history] == [0, 2]
    assert history[1]["changed"] == {}  # the stored configuration, read with the older run's values
    model = json.loads((old / "config.json").read_text())["model"]
    assert model["only_lr_act"] is False and model["norm_eps"] == 1e-5
    train = json.loads((old / "config.json").read_text())["train"]  # T_c and psi as the older run had them
    assert train["delay_lr_tc"] == 1000 and train["nesterov_psi"] == 0.004
    assert sorted(int(p.name) for p in (old / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    again = _losses(old)
    assert sorted(again) == [1, 2, 3, 4] and all(math.isfinite(v) for v in again.values())
    for step in (3, 4):  # the resumed steps read the batches and the state the first run did
        assert again[step] == pytest.approx(first[step], rel=1e-6), (step, again, first)
