"""experiments/init/pretrain_lowrank.py --quick on a tiny self-made corpus: the result file's fields (corpus
counts, FLOPs per token against a count by hand, the perplexity ratios), and a resume from a partial JSON:
a run stopped after an evaluation is left unfinished in the JSON, and the rerun skips the finished run and
continues the other from its checkpoint to the same numbers it had reached."""

import json
import math

import numpy as np
import pytest

from experiments.init import pretrain_lowrank


WORDS = ["thou", "art", "def", "return", "self", "the", "king", "(", ")", ":", "\n", "    ", "import", "lord"]


def _texts(folder):
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(10):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS, 400)))
    return folder


def test_quick_run_fields_and_resume_from_partial_json(tmp_path, monkeypatch):
    pl = pretrain_lowrank
    texts = _texts(tmp_path / "texts")
    out, runs = tmp_path / "out", tmp_path / "runs"
    argv = ["--quick", "--texts", str(texts), "--out", str(out), "--runs", str(runs), "--kinds", "dense,cola"]

    real_saver = pl.saver
    stopped = {}

    def stop_at_last_eval(out_, name, base):  # the cola run stops at its last evaluation, before its checkpoint
        save = real_saver(out_, name, base)

        def guarded(row=None):
            if row is not None and row["kind"] == "cola" and not row["done"] and row["curve"][-1][0] == 4:
                stopped.update(curve=row["curve"][-1], loss=row["train_loss"][-1])
                raise KeyboardInterrupt("stopped by the test")
            return save(row)
        return guarded

    monkeypatch.setattr(pl, "saver", stop_at_last_eval)
    with pytest.raises(KeyboardInterrupt):
        pl.main(argv)
    path = out / "pretrain_lowrank_quick.json"
    partial = json.loads(path.read_text())
    assert partial["runs"]["dense-s0"]["done"] is True
    cola = partial["runs"]["cola-s0"]
    assert cola["done"] is False and [p[0] for p in cola["curve"]] == [0, 2]
    dense_before = partial["runs"]["dense-s0"]

    monkeypatch.setattr(pl, "saver", real_saver)
    pl.main(argv)
    res = json.loads(path.read_text())
    assert res["runs"]["dense-s0"] == dense_before  # finished earlier: skipped, unchanged
    cola = res["runs"]["cola-s0"]
    assert cola["done"] is True and cola["resumed_from"] == 2 and cola["earlier_wall_s"] > 0
    # the resumed run reaches exactly the step-4 numbers the stopped one had seen before it stopped
    assert stopped["curve"][0] == 4 and cola["curve"][-1] == stopped["curve"]
    assert stopped["loss"][0] == 4 and cola["train_loss"][-1] == stopped["loss"]

    s = res["settings"]
    assert (s["seq"], s["batch"], s["steps"], s["tokens"]) == (32, 2, 4, 256)
    corpus = res["corpus"]
    assert set(corpus["sources"]) == {"texts"}
    assert corpus["sources"]["texts"]["train"]["documents"] == 9 and corpus["sources"]["texts"]["val"]["documents"] == 1
    assert corpus["sources"]["texts"]["train"]["tokens"] == corpus["train_tokens"] > 0
    for name, kind in (("dense-s0", "llama"), ("cola-s0", "cola")):
        r = res["runs"][name]
        assert r["command"].startswith(f"boostjax train --model {kind} ") and "--seq 32" in r["command"]
        assert r["flops_per_token"] == r["flops_per_token_by_hand"]
        assert [p[0] for p in r["curve"]] == [0, 2, 4]
        assert r["tokens"] == 256 and r["train_flops"] == r["flops_per_token"] * 256
        assert r["val_ppl"] == math.exp(r["val_loss"])
        for key in ("params", "tokens_per_s", "wall_s", "compile_s", "lr", "train_loss"):
            assert key in r
    assert "--rank 8" in res["runs"]["cola-s0"]["command"]
    assert res["runs"]["cola-s0"]["flops_per_token"] < res["runs"]["dense-s0"]["flops_per_token"]
    comp = res["comparisons"]["cola-s0"]
    assert comp["step"] == 4
    assert comp["ppl_ratio_equal_tokens"] == math.exp(cola["val_loss"] - res["runs"]["dense-s0"]["val_loss"])
    assert "ppl_ratio_equal_flops" in comp
    assert (out / "pretrain_lowrank_quick.md").read_text().count("cola-s0") >= 2
    assert (out / "pretrain_lowrank_quick.png").stat().st_size > 0


def test_compare_interpolates_the_dense_curve():
    pl = pretrain_lowrank
    # curve points: [step, tokens, flops, loss]; dense costs 2 FLOPs per token, the low-rank run 1
    dense = {"curve": [[0, 0, 0, 9.0], [1, 10, 20, 6.0], [2, 20, 40, 4.0]]}
    low = {"curve": [[0, 0, 0, 9.0], [1, 10, 10, 7.0], [2, 20, 20, 5.0]]}
    c = pl.compare(low, dense)
    assert c["step"] == 2 and c["ppl_ratio_equal_tokens"] == math.exp(5.0 - 4.0)
    assert c["dense_loss_at_equal_flops"] == 6.0 and c["ppl_ratio_equal_flops"] == math.exp(5.0 - 6.0)
    assert c["dense_flops_to_reach"] == 30.0 and c["compute_ratio"] == 20 / 30
