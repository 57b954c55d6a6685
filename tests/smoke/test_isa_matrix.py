"""experiments/speed/isa_matrix.py without running a cell: a bad cell is one line and exit 2, recorded cells
are skipped (resume) and the table is rendered again from the JSON."""

from __future__ import annotations

import json

from helpers import one_error_line
from experiments.speed import isa_matrix as im



def _cell(isa: str, cores: int, failed: int = 0) -> dict:
    return {"isa": isa, "cores": cores, "openblas_coretype": None, "passed": 3 - failed, "failed": failed,
            "skipped": 0, "failures": ["tests/test_x.py::test_y"] if failed else [], "wall_s": 12.0,
            "load_before": 1.5, "exit": int(bool(failed)),
            "probe": {"fma": 0 if isa == "SSE4_2" else 18, "ymm": 0, "zmm": 0, "tanh_exp": "abcd1234",
                      "openblas_numpy": "SkylakeX", "openblas_scipy": "SkylakeX"}}


def test_a_bad_cell_is_one_line_before_anything_runs(tmp_path, capsys):
    assert im.main(["--cells", "AVX9/1", "--out", str(tmp_path)]) == 2
    one_error_line(capsys.readouterr().err, "--cells", "AVX9/1", "SSE4_2/1")
    assert not list(tmp_path.iterdir())


def test_recorded_cells_are_skipped_and_the_table_rewritten(tmp_path, capsys):
    files = ["tests/test_x.py"]
    (tmp_path / "isa_matrix.json").write_text(json.dumps(
        {"files": files, "cells": {"SSE4_2/1": _cell("SSE4_2", 1), "AVX2/2": _cell("AVX2", 2, failed=1)}}))
    assert im.main(["--cells", "SSE4_2/1,AVX2/2", "--files", *files, "--out", str(tmp_path)]) == 1  # a failure
    out = capsys.readouterr().out
    assert "SSE4_2/1: recorded, skipped" in out and "AVX2/2: recorded, skipped" in out
    md = (tmp_path / "isa_matrix.md").read_text()
    assert "| SSE4_2/1 | SSE4_2 | 1 | SkylakeX / SkylakeX | 0/0/0 | abcd1234 | 3 | 0 | 0 | 12 | 1.5 |" in md
    assert "AVX2/2: `tests/test_x.py::test_y`" in md
    assert json.loads((tmp_path / "isa_matrix.json").read_text())["cells"].keys() == {"SSE4_2/1", "AVX2/2"}
