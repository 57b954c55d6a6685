"""experiments/gpu/host_state.py without the CUDA plugin: its table from a JSON, and its bad flags."""

from __future__ import annotations

import json

import pytest

from experiments.gpu import host_state


def test_the_table_from_a_json(tmp_path):
    row = {"argument_bytes": 2**20, "temp_bytes": 3 * 2**20, "peak_bytes_per_device": 4 * 2**20, "host_argument_bytes": 0}
    res = {"rows": [{"mode": "device", **row}, {"mode": "host", "error": "RuntimeError: no"}], "n_layers": 2,
           "target": "h100_sxm.txtpb", "command": "JAX_PLATFORMS=cpu python -m experiments.gpu.host_state", "wall_s": 1.0}
    src = tmp_path / "in.json"
    src.write_text(json.dumps(res))
    assert host_state.main(["--target", "x", "--from-json", str(src), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "host_state_gpu.md").read_text()
    assert "| device | 1.0 | 3.0 | 4.0 | 0.0 |" in md and "failed: `RuntimeError: no`" in md


@pytest.mark.parametrize("argv", [["--target", "/no/such/file"], ["--target", __file__, "--layers", "0"]])
def test_bad_flags_are_one_line_exit_2(argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        host_state.main([*argv, "--out", str(tmp_path)])
    assert e.value.code == 2 and "fix:" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
