"""experiments/init/real_finetune.py without its inputs: budgets -> per-group ranks against the model's own
parameter layout, the bits-per-byte table against `boostjax tokenize`'s byte counts, the held-out plays
landing in the validation split, the catch-up step, and the report rendered from a stored result."""

import dataclasses
import json
import math

import numpy as np
import pytest

from boostjax.config import ModelConfig
from boostjax.data.tokenizers import train_tokenizer
from boostjax.models.llama import param_shapes
from experiments.init import real_finetune


# SmolLM2-135M's shapes (the budgets' numbers are checked for them); no weights are built
SMOL = ModelConfig(kind="llama", vocab_size=512, d_model=576, n_layers=2, n_heads=9, n_kv_heads=3, d_ff=1536)
PROJ_KEYS = ("a_", "b_", "w_q", "w_k", "w_v", "w_o", "w_gate", "w_up", "w_down")


def _rf():
    return real_finetune


def _projection_params_of_model(m: ModelConfig) -> int:
    return sum(math.prod(s) for k, s in param_shapes(m).items()
               if k.startswith("layers.") and k.rsplit(".", 1)[-1].startswith(PROJ_KEYS))


def test_budgets_give_the_ranks_and_the_model_has_that_many_parameters():
    rf = _rf()
    want = {0.75: {"attn": 281, "kv": None, "mlp": 281}, 0.5: {"attn": 179, "kv": None, "mlp": 179},
            0.3: {"attn": 104, "kv": 104, "mlp": 104}}
    dense = rf.projection_params(SMOL, {})
    assert dense == _projection_params_of_model(SMOL)
    for budget, ranks in want.items():
        assert rf.ranks_for_budget(SMOL, budget) == ranks
        assert rf.projection_params(SMOL, ranks) <= budget * dense
        r = ranks["attn"] + 1  # the next rank no longer fits
        nxt = {g: (r if r * sum(SMOL.group_shape(g)) < math.prod(SMOL.group_shape(g)) else None) for g in ranks}
        assert rf.projection_params(SMOL, nxt) > budget * dense
        for kind in ("svd", "cola"):  # the flags build a model of exactly those groups and that many parameters
            m = dataclasses.replace(SMOL, kind=kind, **rf.rank_flags(SMOL, ranks))
            assert {g: (m.group_rank(g) if m.group_low_rank(g) else None) for g in ranks} == ranks
            assert _projection_params_of_model(m) == rf.projection_params(SMOL, ranks)
    shares = rf.ranks_for_budget(SMOL, 0.5, "fraction")
    assert shares == {"attn": 144, "kv": 72, "mlp": 209}
    assert abs(rf.projection_params(SMOL, shares) / dense - 0.5) < 0.002


def test_held_out_plays_are_the_val_split_and_bytes_per_token_are_exact(tmp_path, monkeypatch):
    rf = _rf()
    texts = tmp_path / "texts"
    texts.mkdir()
    names = [f"play_{i:02d}_gut.txt" for i in range(12)]
    held = (names[3], names[7])
    rng = np.random.default_rng(0)
    words = ["thou", "art", "Macb.", "naïve", "Ænobarbus", "o'er", "—", "well", "\n\n"]
    for n in names:
        (texts / n).write_text(" ".join(rng.choice(words, 300)) + "\n", encoding="utf-8")
    monkeypatch.setattr(rf, "HELD_OUT", held)
    monkeypatch.setattr(rf, "VAL_EVERY", 5)
    tok = train_tokenizer([(texts / n).read_text() for n in names], 300)
    (tmp_path / "tok").mkdir()
    tok.save(tmp_path / "tok")
    meta = rf.token_folder(texts, tmp_path / "tok", tmp_path / "data")
    assert meta["splits"]["val"]["documents"] == 2
    assert meta["splits"]["val"]["bytes"] == sum(len((texts / n).read_bytes()) for n in held)
    tb = rf.token_bytes(tmp_path / "data" / "tokenizer.json", tok.vocab_size)
    rf.check_bytes(tb, tmp_path / "data", meta)  # the table reproduces the split's byte count
    ids = np.fromfile(tmp_path / "data" / "train-00000.bin", dtype=meta["dtype"])
    assert int(tb[ids].sum()) == meta["splits"]["train"]["bytes"]
    val = np.fromfile(tmp_path / "data" / "val-00000.bin", dtype=meta["dtype"])
    with pytest.raises(SystemExit):  # one id's length off by one byte
        rf.check_bytes(tb + (np.arange(len(tb)) == val[0]), tmp_path / "data", meta)
    # the held-out split is exactly those two files, in order, each followed by the eos id
    want = np.concatenate([np.append(tok.encode((texts / n).read_text()), tok.eos_id) for n in held])
    np.testing.assert_array_equal(val, want)


def test_catch_up_step_and_report_render(tmp_path):
    rf = _rf()
    s = rf.Settings(steps=10, eval_every=5)
    held = rf.HeldOut([], 1000, 3000)
    dense = {"name": "dense", "label": "dense fine-tune", "kind": "llama", "budget": None,
             "after": held.scores(3.0), "curve": [[0, 3.5], [5, 3.2], [10, 3.0]]}
    low = {"curve": [[0, 9.0], [5, 3.05], [10, 3.01]]}
    assert rf.steps_within(low, dense) == 5  # exp(3.05) <= 1.1 exp(3.0)
    assert rf.steps_within({"curve": [[0, 9.0], [10, 3.2]]}, dense) is None
    assert held.scores(math.log(2))["bpb"] == pytest.approx(1000 / 3000)
    base = {"params": 100, "projection_fraction": 1.0, "before": held.scores(3.5), "generations": [],
            "wall_s": 1.0}
    rows = {"zero-shot": {**base, "name": "zero-shot", "label": "zero-shot", "kind": None,
                          "after": held.scores(3.5), "curve": [[0, 3.5]]},
            "dense": {**base, **dense, "tokens_per_s": 10.0, "peak_bytes": 2**30, "step_s": 1.0, "compile_s": 1.0,
                      "times_s": {"start": 1, "init": 1, "train": 1, "memory": 1, "generate": 1}},
            "svd50-white": {**base, **low, "name": "svd50-white", "label": "SVD 50%, whitened start", "kind": "svd",
                            "budget": 0.5, "init_factor": "whitened", "before": held.scores(9.0),
                            "after": held.scores(3.01), "ranks": {"attn": 179, "kv": None, "mlp": 179},
                            "init": {"mean": 0.6, "max": 0.8, "output": {"mean": 0.3}}}}
    res = {"settings": json.loads(json.dumps(dataclasses.asdict(s))), "rows": rows, "command": "x", "wall_s": 60,
           "platform": "cpu", "model": {"name": "m", "source": "s", "d_model": 576, "n_layers": 30, "n_heads": 9,
                                        "n_kv_heads": 3, "d_ff": 1536, "vocab_size": 49152, "params": 1,
                                        "projection_params": 1},
           "data": {"held_out": ["a"], "train_tokens": 1, "train_documents": 1, "val_tokens": 1, "val_bytes": 1},
           "held_out": {"targets": 1000, "bytes": 3000}, "budgets": [], "prompts": [],
           "failed": {"cola30-white": "non-finite loss"}}
    md = rf.markdown(res)
    assert "| SVD 50%, whitened start |" in md and "| 5 |" in md and "diverged: non-finite loss" in md
    fig = rf.chart(res)
    fig.savefig(tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 0
