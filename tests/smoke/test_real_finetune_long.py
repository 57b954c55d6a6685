"""experiments/init/real_finetune_long.py without its inputs: the 50 % row follows the better 75 % kind,
each row's `boostjax train` fields, the steps-to columns, and the report rendered from a stored result."""

import math
import pathlib

from experiments.init import real_finetune as rf
from experiments.init import real_finetune_long as rfl


def _row(name, kind, budget, distill, losses, ppl_after):
    return {"name": name, "label": rfl.low_row(kind, budget, distill).label if kind != "llama" else "dense fine-tune",
            "kind": kind, "budget": budget, "distill": distill, "params": 1e8, "projection_fraction": budget or 1.0,
            "ranks": {"attn": 198, "kv": None, "mlp": 312}, "before": {"ppl": math.exp(losses[0]), "bpb": 2.0},
            "after": {"ppl": ppl_after, "bpb": 1.8}, "curve": [[50 * i, v] for i, v in enumerate(losses)],
            "init": {"mean": 0.5, "max": 1.0}, "tokens_per_s": 150.0, "peak_bytes": 2**31, "wall_s": 1800.0,
            "generations": [], "teacher": {"param_bytes": 2**29, "logits_bytes": 2**20} if distill else None}


def test_best50_follows_the_better_75_row_and_its_teacher():
    assert rfl.best50({}) is None
    rows = {"svd75-kd": _row("svd75-kd", "svd", 0.75, True, [4.2, 3.6], 36.0),
            "cola75": _row("cola75", "cola", 0.75, False, [4.3, 3.5], 33.0)}
    assert rfl.best50(rows) == rfl.low_row("cola", 0.5, False)
    rows["cola75"]["after"]["ppl"] = 99.0
    assert rfl.best50(rows).name == "svd50-kd" and rfl.best50(rows).distill


def test_row_flags_name_the_start_budget_and_teacher():
    class Ctx:
        hf, data, runs = pathlib.Path("/m"), pathlib.Path("/d"), pathlib.Path("/r")

    f = rfl.row_flags(rfl.low_row("cola", 0.75, True), rfl.LONG, Ctx)
    assert f["kind"] == "cola" and f["rank_budget"] == 0.75 and f["rank_policy"] == "sensitivity"
    assert f["init_factor"] == "sequential" and f["calib_tokens"] == 32768 and f["distill_from"] == "/m"
    assert f["steps"] * f["batch"] * f["seq"] == 204800 and f["ckpt_every"] == rfl.LONG.eval_every
    plain = rfl.row_flags(rfl.low_row("svd", 0.75, False), rfl.LONG, Ctx)
    assert "distill_from" not in plain and plain["out"] == "/r/svd75"
    dense = rfl.row_flags(rfl.LongRow("dense", "llama"), rfl.LONG, Ctx)
    assert dense["kind"] == "llama" and "rank_budget" not in dense


def test_report_from_a_stored_result():
    zs = {"name": "zero-shot", "label": "zero-shot", "kind": None, "params": 1.3e8, "projection_fraction": 1.0,
          "ranks": {}, "before": {"ppl": 40.0, "bpb": 1.8}, "after": {"ppl": 40.0, "bpb": 1.8},
          "curve": [[0, math.log(40.0)]], "wall_s": 12.0, "generations": []}
    kd = _row("svd75-kd", "svd", 0.75, True, [math.log(67.0), math.log(47.0), math.log(43.0)], 43.0)
    res = {"settings": rfl.dataclasses.asdict(rfl.LONG), "command": "python -m experiments.init.real_finetune_long",
           "wall_s": 1812.0, "platform": "cpu", "held_out": {"targets": 4088, "bytes": 12000}, "prompts": [],
           "rows": {"zero-shot": zs, "svd75-kd": kd}}
    md = rfl.markdown(res)
    line = next(x for x in md.splitlines() if x.startswith("| SVD 75%, sequential start + distillation"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[5] == "43.00" and cells[6] == "1.075" and cells[7] == "<= 1.2x: met"
    assert cells[-2] == "50" and cells[-1] == "100"  # 47 <= 48 (goal) at step 50; 43 <= 44 (10 %) at 100
    assert "+ teacher 0.50 GiB params" in line
    assert "Not run yet" in md and "cola75-kd" in md
    assert rf._ppl({"ppl": 43.0}) == "43.00"


def test_bad_flags_one_line_exit_2(capsys, tmp_path):
    import pytest

    for argv, needle in ((["--tokens", "0"], "--tokens is 0"), (["--eval-every", "0"], "--eval-every is 0"),
                         (["--rows", "nope"], "no row 'nope'")):
        with pytest.raises(SystemExit) as e:
            rfl.main([*argv, "--out", str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and needle in err[0] and "fix:" in err[0], err
    assert not list(tmp_path.iterdir())
