"""A tokenised folder in shards: the same batches as one file and as a version 1 folder (train.bin), for
any process count; each process reads exactly its own rows' bytes (counted by the reader, and by the
kernel in two real processes); damaged shards are one-line errors naming the file."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from boostjax.cli import main
from boostjax.config import Config, TrainConfig
from boostjax.data.batches import DocumentIterator, MixtureIterator
from boostjax.data.shards import TokenShards
from boostjax.data.source import open_source, resolve_source
from boostjax.data.token_folder import META_FILE, read_token_meta
from boostjax.data.tokenize import tokenize_corpus
from boostjax.runtime.signals import TrainingInterrupted
from boostjax.training.trainer import train
from helpers import MICRO, model_flags, one_error_line
from experiments.data import shard_reads

SEQ, BATCH = 24, 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The same documents tokenised in shards of ~40 tokens, in one shard, and as a version 1 folder."""
    root = tmp_path_factory.mktemp("shards")
    texts = root / "texts"
    texts.mkdir()
    rng = np.random.default_rng(0)
    for i in range(30):
        (texts / f"{i:02d}.txt").write_text(f"doc {i} " + "ab cd ef " * int(rng.integers(1, 12)))
    sharded, whole = root / "sharded", root / "whole"
    tokenize_corpus(texts, sharded, "byte", val_every=5, progress=False, shard_tokens=40)
    tokenize_corpus(texts, whole, "byte", val_every=5, progress=False)
    v1 = root / "v1"  # what boostjax wrote before shards: train.bin / val.bin, "file", version 1
    v1.mkdir()
    meta = json.loads((whole / META_FILE).read_text())
    for s in ("train", "val"):
        (v1 / f"{s}.bin").write_bytes((whole / f"{s}-00000.bin").read_bytes())
        (v1 / f"{s}.docs.npy").write_bytes((whole / f"{s}.docs.npy").read_bytes())
        sp = meta["splits"][s]
        meta["splits"][s] = {"file": f"{s}.bin", "docs_file": sp["docs_file"], "documents": sp["documents"],
                             "tokens": sp["tokens"], "bytes": sp["bytes"]}
    (v1 / META_FILE).write_text(json.dumps({**meta, "version": 1}))
    return sharded, whole, v1


def _iterator(folder, index=0, count=1):
    c = open_source(resolve_source(str(folder)))
    return DocumentIterator(c.train, c.train_docs, BATCH, SEQ, 3, segments=True, vocab_size=256,
                            process_index=index, process_count=count)


def test_the_writer_cuts_shards_at_document_ends(folders):
    sharded, whole, _ = folders
    meta = read_token_meta(sharded)
    shards = meta["splits"]["train"]["shards"]
    assert len(shards) > 3 and [s["file"] for s in shards] == [f"train-{i:05d}.bin" for i in range(len(shards))]
    docs = np.load(sharded / "train.docs.npy")
    ends = np.cumsum([s["tokens"] for s in shards])
    assert set(ends.tolist()) <= set(docs.tolist()) | {meta["splits"]["train"]["tokens"]}  # every shard ends a document
    starts = np.concatenate([[0], ends[:-1]])
    last_doc = docs[np.searchsorted(docs, ends, side="left") - 1]  # the start of each shard's last document
    assert np.all(ends[:-1] - starts[:-1] >= 40) and np.all(last_doc - starts < 40)  # closed at the first end >= 40
    stream = b"".join((sharded / s["file"]).read_bytes() for s in shards)
    assert stream == (whole / "train-00000.bin").read_bytes()
    assert resolve_source(str(sharded)).fingerprint == resolve_source(str(whole)).fingerprint


@pytest.mark.parametrize("count", [1, 2, 4])
def test_batches_equal_one_file_and_version_1_for_any_process_count(folders, count):
    its = {f: [_iterator(f, i, count) for i in range(count)] for f in folders}
    for step in (0, 1, 7, 30):  # 30 x 8 rows: past the first epoch
        glob = {}
        for f, per in its.items():
            parts = [it.batch_at(step) for it in per]
            glob[f] = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        ref = _iterator(folders[2]).batch_at(step)  # version 1, one process
        for f, got in glob.items():
            assert got.keys() == ref.keys() and all(np.array_equal(got[k], ref[k]) for k in ref), (f, step)


def test_the_fingerprint_of_a_version_1_folder_is_the_same(folders):
    sharded, _, v1 = folders
    assert resolve_source(str(v1)).fingerprint == resolve_source(str(sharded)).fingerprint
    meta = json.loads((v1 / META_FILE).read_text())  # a version 1 folder from before fingerprints: hashed now
    old = v1.parent / "v1-old"
    old.mkdir(exist_ok=True)
    for name in ("train.bin", "train.docs.npy", "val.bin", "val.docs.npy"):
        (old / name).write_bytes((v1 / name).read_bytes())
    (old / META_FILE).write_text(json.dumps({k: v for k, v in meta.items() if k != "fingerprint"}))
    assert resolve_source(str(old)).fingerprint == resolve_source(str(sharded)).fingerprint


def test_each_process_reads_exactly_its_rows(folders):
    sharded = folders[0]
    its = [_iterator(sharded, i, 2) for i in range(2)]
    for step in range(5):
        before = [it.tokens.bytes_read for it in its]
        rows = [it.positions(step)[0] for it in its]
        for it in its:
            it.next()
        # one byte per uint8 token of this process's rows (seq + 1 each), nothing more
        assert [it.tokens.bytes_read - b for it, b in zip(its, before)] == [BATCH // 2 * (SEQ + 1)] * 2
        glob = _iterator(sharded).positions(step)[0]
        assert np.array_equal(np.concatenate(rows), glob)  # together, the global batch's rows


def test_mixture_and_slices_read_through_the_shards(folders):
    sharded, whole, _ = folders
    a, b = (open_source(resolve_source(str(f))) for f in (sharded, whole))
    assert np.array_equal(np.asarray(a.train), np.asarray(b.train)) and len(a.train) == len(b.train)
    assert np.array_equal(a.train[35:130], np.asarray(b.train)[35:130]) and a.train[-1] == b.train[-1]
    assert np.array_equal(a.train[np.array([[39, 40, 41], [0, 5, 200]])], np.asarray(b.train)[[[39, 40, 41], [0, 5, 200]]])
    mix = [MixtureIterator([(c.train, c.train_docs), (c.val, c.val_docs)], [0.6, 0.4], BATCH, SEQ, 1) for c in (a, b)]
    for _ in range(4):
        x, y = (m.next() for m in mix)
        assert all(np.array_equal(x[k], y[k]) for k in x)


_CHILD = """
import sys
from boostjax.data.batches import DocumentIterator
from boostjax.data.source import open_source, resolve_source
c = open_source(resolve_source(sys.argv[1]))
it = DocumentIterator(c.train, c.train_docs, {batch}, {seq}, 3, process_index=int(sys.argv[2]), process_count=2)
def rchar():  # (bytes read so far, the length of this read of /proc/self/io, counted after it)
    text = open("/proc/self/io").read()
    return int(text.split("rchar:")[1].split()[0]), len(text)
it.next()  # the first batch imports what numpy loads lazily (files read too)
b0, (r0, own) = it.tokens.bytes_read, rchar()
for _ in range(6):
    it.next()
print(it.tokens.bytes_read - b0, rchar()[0] - r0 - own)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="the kernel's count of bytes read is Linux's")
def test_two_real_processes_read_their_own_rows(folders):
    """Two processes: the kernel counts, over six batches, the bytes the reader counted."""
    code = _CHILD.format(batch=BATCH, seq=SEQ)
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(folders[0]), str(i)], stdout=subprocess.PIPE,
                              text=True, env=env) for i in range(2)]
    got = [tuple(map(int, p.communicate(timeout=120)[0].split())) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert got == [(6 * BATCH // 2 * (SEQ + 1),) * 2] * 2  # reader == kernel == 6 batches of 4 rows of seq + 1


def _damaged(capsys, folder, *needles):
    """`boostjax train` refuses the folder in one line, before anything is written."""
    run = folder.parent / "run"
    rc = main(["train", *model_flags(), "--batch", "4", "--seq", "16", "--steps", "1", "--no-progress", "--out",
               str(run), "--data", str(folder)])
    err = capsys.readouterr().err
    assert rc == 2 and not run.exists(), err
    return one_error_line(err, *needles)


def test_damaged_shards_are_one_line_errors(folders, tmp_path, capsys):
    sharded = tmp_path / "tok"
    sharded.mkdir()
    for f in folders[0].iterdir():
        (sharded / f.name).write_bytes(f.read_bytes())
    meta = json.loads((sharded / META_FILE).read_text())
    (sharded / "train-00002.bin").rename(tmp_path / "kept.bin")
    line = _damaged(capsys, sharded, "train-00002.bin is missing", "fix: tokenise the text again")
    (tmp_path / "kept.bin").rename(sharded / "train-00002.bin")
    with open(sharded / "train-00001.bin", "ab") as f:
        f.write(b"x")
    _damaged(capsys, sharded, "train-00001.bin has", "the metadata says")
    (sharded / "train-00001.bin").write_bytes((folders[0] / "train-00001.bin").read_bytes())
    bad = json.loads(json.dumps(meta))
    bad["splits"]["val"]["shards"][0]["file"] = "val-00009.bin"  # a shard that is not there, out of order
    (sharded / META_FILE).write_text(json.dumps(bad))
    _damaged(capsys, sharded, "splits.val.shards[0] must name val-00000.bin")
    n = len(meta["splits"]["val"]["shards"])
    bad["splits"]["val"]["shards"] = [*meta["splits"]["val"]["shards"], {"file": f"val-{n:05d}.bin", "tokens": 5}]
    (sharded / META_FILE).write_text(json.dumps(bad))
    _damaged(capsys, sharded, "the shards of split val hold", f"splits.val.tokens says {meta['splits']['val']['tokens']}")
    bad["splits"]["val"]["tokens"] += 5  # a shard named in full that is not there
    (sharded / META_FILE).write_text(json.dumps(bad))
    _damaged(capsys, sharded, f"val-{n:05d}.bin is missing")
    (sharded / META_FILE).write_text(json.dumps(meta))
    assert len(TokenShards([sharded / "val-00000.bin"], [3], "uint8")) == 3 and "\n" not in line


def test_tokenize_replaces_an_earlier_output_and_refuses_a_bad_shard_size(folders, tmp_path, capsys):
    out = tmp_path / "tok"
    out.mkdir()
    for f in folders[2].iterdir():  # a version 1 output: train.bin, val.bin are replaced by shards
        (out / f.name).write_bytes(f.read_bytes())
    texts = folders[0].parent / "texts"
    assert main(["tokenize", "--data", str(texts), "--out", str(out), "--val-every", "5", "--shard-tokens", "40",
                 "--no-progress"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in folders[0].iterdir())
    assert main(["tokenize", "--data", str(texts), "--out", str(out), "--val-every", "5", "--no-progress"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in folders[1].iterdir())  # no stale shard
    capsys.readouterr()
    assert main(["tokenize", "--data", str(texts), "--out", str(tmp_path / "new"), "--shard-tokens", "0"]) == 2
    one_error_line(capsys.readouterr().err, "tokenize.shard_tokens: must be an integer >= 1, got 0", "--shard-tokens")
    assert not (tmp_path / "new").exists()


def test_a_version_1_run_resumes_on_its_folder_and_on_the_shards(folders, tmp_path, monkeypatch):
    """A run trained on a version 1 folder, stopped after step 2, resumes there or on the same tokens in
    shards (one fingerprint) with the losses of the run that went through in one go (exact: the same
    program and batches). No run reads a split whole: each read is at most a batch's rows."""
    sharded, _, v1 = folders
    reads, read_runs = [], TokenShards.read_runs

    def counted(self, first, lengths):
        reads.append(int(lengths.sum()))
        return read_runs(self, first, lengths)

    monkeypatch.setattr(TokenShards, "read_runs", counted)
    model = replace(MICRO, vocab_size=256, n_layers=1)
    t = TrainConfig(steps=4, batch=4, seq=16, data=str(v1), ckpt_every=2, log_every=1, eval_every=4, eval_batches=1,
                    progress=False)

    def stop_at_2(record):
        if record.get("step") == 2 and "loss" in record:
            os.kill(os.getpid(), signal.SIGINT)

    def losses(out):
        ms = [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        return [(m["step"], m[k]) for k in ("loss", "val_loss") for m in ms if k in m]

    train(Config(model, replace(t, out=str(tmp_path / "whole"))))
    with pytest.raises(TrainingInterrupted):
        train(Config(model, replace(t, out=str(tmp_path / "v1"))), on_log=stop_at_2)
    shutil.copytree(tmp_path / "v1", tmp_path / "moved")
    assert train(Config(model, replace(t, out=str(tmp_path / "v1")))).resumed_from == 2
    assert train(Config(model, replace(t, out=str(tmp_path / "moved"), data=str(sharded)))).resumed_from == 2
    assert len(losses("whole")) == 5 and losses("v1") == losses("whole") == losses("moved")
    assert reads and max(reads) <= 4 * 17  # batch x (seq + 1): the splits hold hundreds of tokens


@pytest.mark.experiment  # an experiment script's end-to-end smoke run (a few seconds): `pytest -m experiment`
@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="the kernel's count of bytes read is Linux's")
def test_shard_reads_smoke_run_writes_the_table(tmp_path):
    sr = shard_reads
    args = ["--tokens", "60000", "--shard-tokens", "9000", "--mean-doc", "300", "--batch", "8", "--seq", "64",
            "--processes", "1,2", "--tmp", str(tmp_path), "--out", str(tmp_path / "out")]
    assert sr.main(args) == 0
    res = json.loads((tmp_path / "out" / "shard_reads.json").read_text())
    assert res["shards"] > 3 and [(r["processes"], r["index"]) for r in res["rows"]] == [(1, 0), (2, 0), (2, 1)]
    assert all(r["reader_bytes"] == r["rows"] * 65 * 2 and r["kernel_bytes"] > r["reader_bytes"] for r in res["rows"])
    assert len({r["kernel_bytes"] - r["reader_bytes"] for r in res["rows"]}) == 1  # opening costs every process alike
    assert "| 2 | 1 |" in (tmp_path / "out" / "shard_reads.md").read_text()
    assert list(tmp_path.iterdir()) == [tmp_path / "out"]  # the token folder is removed
