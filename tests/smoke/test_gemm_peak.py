"""experiments/speed/gemm_peak.py: one pinned single-thread run writes its table; bad flags are one line, exit 2."""

from __future__ import annotations

import json

import pytest

from experiments.speed import gemm_peak


def test_one_thread_one_round_writes_the_table(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm_peak, "SQUARE", (64,))
    monkeypatch.setattr(gemm_peak, "STEP_SHAPES", {"small (32 x 16 x 8)": (32, 16, 8)})
    monkeypatch.setattr(gemm_peak, "GRAD_SHAPES", {"grad small (8 x 32 x 16)": (8, 32, 16)})
    monkeypatch.setattr(gemm_peak, "COPY_SHAPES", {"grad small, copy (8 x 32 x 16)": (8, 32, 16)})
    # the child process imports the module afresh: the shapes travel through the code it runs
    monkeypatch.setattr(gemm_peak, "_child_code", lambda cores, rounds: (
        "import os, json; os.sched_setaffinity(0, %r); from experiments.speed import gemm_peak as g; "
        "g.SQUARE = (64,); g.STEP_SHAPES = {'small (32 x 16 x 8)': (32, 16, 8)}; "
        "g.GRAD_SHAPES = {'grad small (8 x 32 x 16)': (8, 32, 16)}; "
        "g.COPY_SHAPES = {'grad small, copy (8 x 32 x 16)': (8, 32, 16)}; "
        "print('RESULT ' + json.dumps(g._measure_here(%d)))" % (cores, rounds)))
    assert gemm_peak.main(["--threads", "1", "--rounds", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gemm_peak.json").read_text())
    shapes = res["runs"][0]["shapes"]
    assert set(shapes) == {"square 64", "small (32 x 16 x 8)", "grad small (8 x 32 x 16)", "grad small, copy (8 x 32 x 16)"}
    assert all(v["gflops"] > 0 for v in shapes.values())
    assert shapes["grad small (8 x 32 x 16)"]["shape"] == shapes["grad small, copy (8 x 32 x 16)"]["shape"] == [8, 32, 16]
    assert res["peak_per_core"] == max(v["gflops"] for v in shapes.values())
    assert "Peak per core" in (tmp_path / "gemm_peak.md").read_text()


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--threads", "99"], ["--rounds", "0"]])
def test_bad_flags_are_one_line_exit_2(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gemm_peak.main([*argv, "--out", str(tmp_path)])
    assert e.value.code == 2 and "fix:" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
