"""experiments/speed/vs_transformers.py: a seconds-long smoke run of the side-by-side benchmark on a tiny shape,
with `--real` on a tiny Hugging Face folder exported here (the numbers mean nothing, the plumbing and
the same-inputs checks do)."""

import json
from dataclasses import replace

import pytest
from flax import nnx

from boostjax.config import preset
from boostjax.interop.hf import to_hf
from boostjax.models.llama import LLaMA
from experiments.speed import vs_transformers as vt

SMOKE = ["--shape", "tiny", "--layers", "1", "--vocab", "256", "--batch", "2", "--seq", "16", "--prompt", "4",
         "--new", "3", "--warmup", "1", "--rounds", "2"]


@pytest.mark.experiment  # `pytest -m experiment`
def test_smoke_run_same_inputs_and_ratios(tmp_path):
    hf_dir = tmp_path / "hf"
    to_hf(LLaMA(replace(preset("tiny"), kind="llama", n_layers=1, vocab_size=256, max_seq_len=32, n_kv_heads=2), rngs=nnx.Rngs(1)),
          hf_dir)
    assert vt.main([*SMOKE, "--real", str(hf_dir), "--real-rounds", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "vs_transformers.json").read_text())
    for part, rounds in (("preset", 2), ("real", 1)):
        r = res[part]
        for what in vt.MEASURES:
            rows = r["results"][what]
            assert list(rows) == ["boostjax dense", "boostjax CoLA", "transformers"]
            for x in rows.values():
                assert x["tokens_per_s"] > 0 and len(x["ms_all"]) == rounds and x["x_q1"] <= x["x_transformers"] <= x["x_q3"]
            assert rows["transformers"]["x_transformers"] == 1.0
        assert "x_dense" in r["results"]["train"]["boostjax CoLA"]
        first, ev = r["checks"]["first_train_loss"], r["checks"]["eval_loss"]  # same weights, same tokens
        assert abs(first["boostjax dense"] - first["transformers"]) < 1e-4 * first["transformers"]
        assert abs(ev["boostjax dense"] - ev["transformers"]) < 1e-4 * ev["transformers"]
    assert res["real"]["shape"]["kv_heads"] == 2 and res["machine"]["torch_threads"] >= 1
    md = (tmp_path / "vs_transformers.md").read_text()
    assert "x transformers" in md and "Real model: hf" in md and res["machine"]["isa"] in md
    (tmp_path / "vs_transformers.md").unlink()  # --render rewrites the report from the JSON alone
    assert vt.main(["--render", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "vs_transformers.md").read_text() == md


@pytest.mark.experiment  # the whole smoke benchmark runs before the skip is reported (16 s): `pytest -m experiment`
def test_missing_real_folder_is_one_line_skip(tmp_path, capsys):
    assert vt.main([*SMOKE, "--rounds", "1", "--real", str(tmp_path / "absent"), "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "vs_transformers.json").read_text())
    assert "real" not in res and "config.json absent" in res["real_skipped"]
    assert "skipped: no Hugging Face folder" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--shape", "huge"], ["--rounds", "0"], ["--torch-adamw", "magic"]])
def test_bad_flags_exit_2(bad, tmp_path):
    with pytest.raises(SystemExit) as e:
        vt.main([*bad, "--out", str(tmp_path)])
    assert e.value.code == 2
