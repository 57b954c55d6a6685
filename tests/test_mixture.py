"""Mixtures of tokenised folders (``--data A:0.7,B:0.3``): parsing and refusals, rows drawn by weight
(binomial bound), each row from its folder, the same global batch for any process count, a resume
that continues exactly, per-folder validation losses, and the mixture kept in config.json and checked
on resume before anything compiles."""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import replace

import numpy as np
import pytest

from boostjax.config import Config, ConfigError, TrainConfig
from boostjax.data.batches import MixtureIterator
from boostjax.data.source import open_source, resolve_source
from boostjax.data.tokenize import tokenize_corpus
from boostjax.runtime.signals import TrainingInterrupted
from boostjax.training.trainer import epochs_line, train, train_iterator
from helpers import MICRO

RUN = TrainConfig(batch=4, seq=16, lr=1e-3, log_every=1, eval_every=2, eval_batches=1, ckpt_every=2,
                  progress=False)


def _folder(tmp_path, name: str, letter: str, n_files: int = 6, tokenizer: str = "byte") -> str:
    """A tokenised folder whose documents hold only ``letter`` and spaces (so a row tells its folder)."""
    texts = tmp_path / f"{name}-text"
    texts.mkdir()
    rng = np.random.default_rng(ord(letter))
    for i in range(n_files):
        (texts / f"{i}.txt").write_text("".join(rng.choice([letter, " "], int(rng.integers(60, 120)))))
    out = tmp_path / name
    tokenize_corpus(str(texts), str(out), tokenizer, val_every=3, progress=False)
    return str(out)


@pytest.fixture
def ab(tmp_path):
    return _folder(tmp_path, "a", "a"), _folder(tmp_path, "b", "b")


def _iterator(data: str, batch: int = 8, seq: int = 16, **kw) -> MixtureIterator:
    mix = open_source(resolve_source(data, mixtures=True))
    return MixtureIterator([(c.train, c.train_docs) for _, _, c in mix.parts], [w for _, w, _ in mix.parts],
                           batch, seq, seed=5, **kw)


def test_parsing_weights_names_and_plain_paths(ab, tmp_path):
    a, b = ab
    src = resolve_source(f"{a}:0.7,{b}:0.3", mixtures=True)
    assert src.kind == "mixture" and src.vocab == 256 and src.documents
    assert [(p.name, p.weight) for p in src.parts] == [("a", 0.7), ("b", 0.3)]
    assert [p.weight for p in resolve_source(f"{a},{b}", mixtures=True).parts] == [0.5, 0.5]  # no weights: equal
    assert resolve_source(f"{a}:7,{b}:3", mixtures=True).fingerprint == src.fingerprint  # the same mixture
    assert resolve_source(f"{a}:0.5,{b}:0.5", mixtures=True).fingerprint != src.fingerprint
    colon = tmp_path / "notes:0.7,x.txt"  # an existing path with a colon and a comma stays a path
    colon.write_text("plain text " * 20)
    assert resolve_source(str(colon), mixtures=True).kind == "text"


@pytest.mark.parametrize("weights, says", [
    ("A:-1,B:1", "the weight of A is '-1', not a number >= 0"),
    ("A:0,B:0", "sum to 0"),
    ("A:x,B:1", "the weight of A is 'x', not a number >= 0"),
    ("A:nan,B:1", "not a number >= 0"),
    ("A:1,B", "B has no weight but other folders"),
    ("A:1,A:1", "A appears twice"),
])
def test_bad_weights_are_one_line(ab, weights, says):
    a, b = ab
    data = weights.replace("A", a).replace("B", b)
    with pytest.raises(ValueError) as e:
        resolve_source(data, mixtures=True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data: ") and "; fix: " in msg and says.replace("A", a).replace(
        "B", b) in msg, msg


def test_other_tokenizers_and_other_commands_are_refused(ab, tmp_path):
    a, b = ab
    bpe = _folder(tmp_path, "c", "c", tokenizer="train:260")
    with pytest.raises(ValueError, match=r"^data: .*c was tokenised with .*a mixture needs one tokenizer; fix: .*"
                                         r"--tokenizer .*a ") as e:
        resolve_source(f"{a}:1,{bpe}:1", mixtures=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^data: .* is a mixture of tokenised folders, which only boostjax train "
                                         r"reads; fix: pass one folder at a time \(--data .*a\)$"):
        resolve_source(f"{a}:0.7,{b}:0.3")  # eval, tokenize, plan: one folder at a time


def test_rows_follow_the_weights_and_come_from_their_folder(ab):
    a, b = ab
    it = _iterator(f"{a}:0.7,{b}:0.3", batch=64)
    n, from_a = 0, 0
    for _ in range(40):
        src_b = it.choices(it.step)
        rows = it.next()["inputs"]
        letters = [set(bytes(r.astype(np.uint8).tolist()).decode()) - set(" \n") for r in rows]
        assert all(s <= {"ab"[c]} for s, c in zip(letters, src_b))  # each row holds its folder's letter only
        n, from_a = n + len(src_b), from_a + int(np.sum(src_b == 0))
    sd = math.sqrt(n * 0.7 * 0.3)
    assert abs(from_a - 0.7 * n) < 5 * sd, (from_a, n)  # binomial: 5 standard deviations
    rows = it.state()["rows"]
    assert rows == [from_a, n - from_a]  # each folder read its rows in its own order, none skipped


def test_the_epochs_line_names_each_folder(ab):
    a, b = ab
    it = train_iterator(open_source(resolve_source(f"{a}:0.7,{b}:0.3", mixtures=True)), 4, 16, 0)
    e = it.stream_epochs(30)
    assert e[0] == 0.7 * 30 * 4 / it.streams[0].rows_per_epoch and it.epochs(30) == max(e)
    line = epochs_line(it, 30)
    assert line.startswith(f"30 steps x 64 tokens = 1,920 tokens drawn from 2 training splits by weight: a (weight "
                           f"0.7, {len(it.streams[0].tokens)} tokens) about {e[0]:.2f} epochs, b (weight 0.3"), line


def test_process_halves_are_the_single_process_rows(ab):
    a, b = ab
    one = _iterator(f"{a}:0.6,{b}:0.4", segments=True)
    halves = [_iterator(f"{a}:0.6,{b}:0.4", segments=True, process_index=i, process_count=2) for i in range(2)]
    for _ in range(6):
        whole = one.next()
        parts = [h.next() for h in halves]
        for key in ("inputs", "targets", "segments"):
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])


def test_iterator_resume_and_batch_at_equal_the_uninterrupted(ab):
    a, b = ab
    data = f"{a}:0.5,{b}:0.5"
    ref = _iterator(data)
    want = [ref.next() for _ in range(7)]
    first = _iterator(data)
    for _ in range(3):
        first.next()
    again = _iterator(data)
    again.restore(json.loads(json.dumps(first.state())))  # as the checkpoint stores it
    got = [again.next() for _ in range(4)]
    counted = _iterator(data)
    counted.restore({k: v for k, v in first.state().items() if k != "rows"})  # rows counted again from batch 0
    for w, g, c, k in zip(want[3:], got, [counted.batch_at(s) for s in range(3, 7)], range(3, 7)):
        np.testing.assert_array_equal(g["inputs"], w["inputs"])
        np.testing.assert_array_equal(c["inputs"], w["inputs"])
        np.testing.assert_array_equal(_iterator(data).batch_at(k)["inputs"], w["inputs"])
    with pytest.raises(ValueError, match="not a mixture"):
        _iterator(data).restore({"step": 1, "seed": 5, "sampler": "documents"})


TIMING = {"step_s", "tokens_per_s", "tflops_per_s", "mfu"}


def _math(metrics: list[dict]) -> list[dict]:
    """The records after step 2 without their timings (a resumed run's metrics.jsonl holds steps 1-2 too)."""
    return [{k: v for k, v in m.items() if k not in TIMING} for m in metrics if m["step"] > 2]


def _cfg(data: str, out, steps: int) -> Config:
    return Config(replace(MICRO, vocab_size=256), replace(RUN, steps=steps, data=data, out=str(out)))


def test_a_resumed_mixture_run_equals_the_uninterrupted_one(ab, tmp_path):
    """Stopped by SIGINT after step 2 and resumed, a mixture run logs the losses and validation losses
    of 4 steps in one go; config.json keeps the weights and fingerprints, and a resume that changes them
    is refused."""
    a, b = ab
    data = f"{a}:0.7,{b}:0.3"
    whole = train(_cfg(data, tmp_path / "whole", 4))

    def stop_at_2(record):
        if record.get("step") == 2 and "loss" in record:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(TrainingInterrupted):
        train(_cfg(data, tmp_path / "split", 4), on_log=stop_at_2)
    resumed = train(_cfg(data, tmp_path / "split", 4))
    assert resumed.resumed_from == 2
    assert _math(resumed.metrics) == _math(whole.metrics)  # the same program: equal to the bit
    val = [m for m in whole.metrics if "val_loss" in m][-1]
    assert set(val) == {"step", "val_loss", "val_loss/a", "val_loss/b"}
    assert val["val_loss"] == pytest.approx(0.7 * val["val_loss/a"] + 0.3 * val["val_loss/b"], rel=1e-12)
    stored = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert [(p["name"], p["path"], p["weight"]) for p in stored["data_mixture"]] == [("a", a, 0.7), ("b", b, 0.3)]
    assert stored["data_fingerprint"].startswith("mixture:blake3:")

    # a changed weight, a changed folder: one line naming train.data, before anything is written or compiled
    before = {f.name: f.read_bytes() for f in (tmp_path / "whole").iterdir() if f.is_file()}
    with pytest.raises(ConfigError, match=r"^train\.data: the weight of a is 0\.5 of the total, the run's 0\.7 .*; "
                                          r"fix: pass --data .*a:0\.7,.*b:0\.3 ") as e:
        train(_cfg(f"{a}:0.5,{b}:0.5", tmp_path / "whole", 6))
    assert "\n" not in str(e.value)
    other = _folder(tmp_path, "b2", "c")
    with pytest.raises(ConfigError, match=r"^train\.data: .*b2 \(folder 2 of the mixture\) holds other data than "
                                          r"the run's .*b \(content"):
        train(_cfg(f"{a}:0.7,{other}:0.3", tmp_path / "whole", 6))
    assert {f.name: f.read_bytes() for f in (tmp_path / "whole").iterdir() if f.is_file()} == before

    # eval on one of the mixed folders knows it as the run's data (by each folder's fingerprint)
    from boostjax.cli.evaluate import _relation

    ours, said = _relation(str(tmp_path / "whole"), _cfg(data, tmp_path / "whole", 4), a, "uint16", "val")
    assert ours is True and said == "; folder a of this run's mixture (weight 0.7): the trainer held this split out"
    ours, said = _relation(str(tmp_path / "whole"), _cfg(data, tmp_path / "whole", 4), other, "uint16", "val")
    assert ours is False and "not this run's training data" in said
