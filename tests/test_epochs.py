"""Epochs stated: `BatchIterator.epochs` counts what the sampler reads (rows of packed documents over
rows per epoch; windows' tokens over the stream's), a run that reads its data more than once says so
at the start (process 0, stderr), and the summary and `TrainResult.extra["epochs"]` carry it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from boostjax.config import Config, TrainConfig
from boostjax.data import BatchIterator, DocumentIterator
from boostjax.training.trainer import epochs_line, train
from helpers import MICRO

RUN = TrainConfig(batch=4, seq=16, lr=1e-3, log_every=2, eval_every=100, eval_batches=1, ckpt_every=100,
                  progress=False)


def _docs(n_docs: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, 64, rng.integers(3, 20)), 0) for _ in range(n_docs)]
    starts = np.concatenate([[0], np.cumsum([len(d) for d in docs[:-1]])]).astype(np.int64)
    return np.concatenate(docs).astype(np.uint16), starts


def test_document_epochs_count_rows_and_end_where_the_rows_repeat():
    tokens, starts = _docs()
    it = DocumentIterator(tokens, starts, 1, 8, seed=3)
    r = it.rows_per_epoch
    assert it.epochs(r) == 1.0 and it.epochs(3 * r) == 3.0 and it.epochs(r // 2) == (r // 2) / r
    # one epoch: every row of the stream once (the rows of batches 0..R-1 are R distinct windows);
    # the next batch starts epoch 1, whose rows come from a new document order
    rows = [tuple(it.batch_at(k)["inputs"][0]) for k in range(r)]
    assert len(set(rows)) == r
    pairs = sum(len(row) for row in rows)
    assert pairs == r * it.seq  # each row trains seq next-token pairs


def test_window_epochs_are_tokens_read_over_tokens_held():
    tokens = np.arange(1000, dtype=np.uint16) % 64
    it = BatchIterator(tokens, 4, 16, seed=0)
    assert it.epochs(25) == 25 * 4 * 16 / 1000
    assert it.epochs(0) == 0.0


def test_epochs_line_says_how_the_iterator_samples():
    tokens, starts = _docs()
    docs = DocumentIterator(tokens, starts, 4, 8, seed=0)
    line = epochs_line(docs, 600)
    assert line.startswith(f"600 steps x 32 tokens = 19.2K tokens over a training split of {len(tokens)} tokens: "
                           f"about {600 * 4 / docs.rows_per_epoch:.2f} epochs (packed documents"), line
    windows = BatchIterator(np.zeros(20_000, np.uint16), 64, 4096, seed=0)
    line = epochs_line(windows, 600)
    assert line.startswith("600 steps x 262K tokens = 157M tokens over a training split of 20.0K tokens: "
                           "about 7864.32 passes' worth of tokens (random windows drawn with replacement"), line


def _folder(tmp_path, n_files: int, size: int):
    """A folder of `n_files` text files of `size` bytes each (the folder corpus: every file a document)."""
    d = tmp_path / "texts"
    d.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n_files):
        (d / f"{i:02d}.txt").write_text("".join(rng.choice(list("abcdefgh \n"), size)))
    return d


def test_a_run_over_its_data_more_than_once_says_so(tmp_path, capsys):
    data = _folder(tmp_path, 8, 120)  # about 940 training bytes (each file and its separator), 1,920 read
    res = train(Config(replace(MICRO, vocab_size=256), replace(RUN, steps=30, data=str(data), out=str(tmp_path / "r"))))
    err = capsys.readouterr().err
    said = [ln for ln in err.splitlines() if "training split" in ln]
    assert len(said) == 1 and said[0].startswith("boostjax: 30 steps x 64 tokens = 1,920 tokens over"), err
    planned = res.extra["epochs"]
    assert planned > 1 and f"about {planned:.2f} epochs (packed documents" in said[0], said
    assert f"(val {res.metrics[-1]['val_loss']:.3f}), {planned:.2f} epochs, " in res.summary, res.summary


def test_a_run_within_one_pass_says_nothing_at_start(tmp_path, capsys):
    text = tmp_path / "one.txt"  # a single file: random windows
    text.write_text("".join(np.random.default_rng(1).choice(list("abcdefgh \n"), 20_000)))
    res = train(Config(replace(MICRO, vocab_size=256), replace(RUN, steps=2, data=str(text), out=str(tmp_path / "r"))))
    assert "training split" not in capsys.readouterr().err
    planned = res.extra["epochs"]
    assert 0 < planned < 1
    assert f", {planned:.2g} passes' worth of tokens, " in res.summary, res.summary
