"""experiments/gpu/host_schedule.py without the CUDA plugin: its table from a JSON, and its bad flags."""

from __future__ import annotations

import json

import pytest

from experiments.gpu import host_schedule, host_state


def test_the_table_from_a_json(tmp_path):
    rows = [{"case": case, "remat": remat, "slop": slop, "temp_bytes": (1 + i) * 2**20, "argument_bytes": 0,
             "host_argument_bytes": 0}
            for i, (case, remat, slop) in enumerate((c, r, s) for c in host_schedule.CASES
                                                    for r in host_schedule.REMATS for s in host_schedule.SLOPS)]
    res = {"rows": rows, "args": {"layers": 2, "rows": 8, "d": 4}, "target": "h100_sxm.txtpb",
           "command": "JAX_PLATFORMS=cpu python -m experiments.gpu.host_schedule", "wall_s": 1.0}
    src = tmp_path / "in.json"
    src.write_text(json.dumps(res))
    assert host_schedule.main(["--target", "x", "--from-json", str(src), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "host_schedule_gpu.md").read_text()
    assert "| everything on the device | 1 | 2 | 3 | 4 | 5 | 6 |" in md  # checkpoints, tied, none; default, limit 0
    assert f"| {host_schedule.CASES['state-host']} | 19 | 20 | 21 | 22 | 23 | 24 |" in md


@pytest.mark.parametrize("main,argv", [
    (host_schedule.main, ["--target", "/no/such/file"]),
    (host_schedule.main, ["--target", __file__, "--rows", "0"]),
    (host_state.main, ["--target", __file__, "--slop", "101"]),
])
def test_bad_flags_are_one_line_exit_2(main, argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", str(tmp_path)])
    assert e.value.code == 2 and "fix:" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
