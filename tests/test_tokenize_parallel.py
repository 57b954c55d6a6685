"""`boostjax tokenize --workers N`: one streaming pass, encoded by N processes, written in document order:
the folder is byte-identical for any N (and to encoding each document alone), the bar counts documents
written (not dispatched), and a bad record mid-stream is one line with nothing left behind."""

from __future__ import annotations

import concurrent.futures
import json

import numpy as np
import pytest

from boostjax.cli import main
from boostjax.data import tokenize as tz
from boostjax.data.tokenizers import load_tokenizer, train_tokenizer
from helpers import one_error_line

N_DOCS = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few hundred documents as JSONL and as one text file (blank-line blocks), and a small BPE."""
    root = tmp_path_factory.mktemp("parallel")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "\u00e9t\u00e9", "\u6f22\u5b57", 'say "hi"', "tab\there", "gamma delta"]
    docs = [" ".join(rng.choice(words, size=int(rng.integers(1, 40)))) for _ in range(N_DOCS)]
    lines = [json.dumps({"text": d}).encode() + b"\n" for d in docs]
    (root / "docs.jsonl").write_bytes(b"".join(lines))
    (root / "docs.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    (root / "tok").mkdir()
    train_tokenizer(docs[:100], 300).save(root / "tok")
    return root, docs, lines


def _folder(p) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(p.iterdir())}


@pytest.fixture
def small_batches(monkeypatch):
    """Many batches in flight at once, so their order matters."""
    monkeypatch.setattr(tz, "MIN_BATCH_CHARS", 64)
    monkeypatch.setattr(tz, "BATCH_DOCS", 7)


def test_workers_give_the_same_bytes_as_one(corpus, tmp_path, small_batches, monkeypatch):
    root, docs, _ = corpus
    pools = []

    class Pool(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, *a, **k):
            pools.append(a[0])
            super().__init__(*a, **k)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)
    for name in ("docs.jsonl", "docs.txt"):
        for tokenizer in (str(root / "tok" / "tokenizer.json"), "byte"):
            folders = []
            for workers in (1, 2):
                out = tmp_path / f"{name}-{tokenizer == 'byte'}-{workers}"
                tz.tokenize_corpus(root / name, out, tokenizer, val_every=10, progress=False, workers=workers,
                                   shard_tokens=2000)  # several shards: cut at the same documents
                folders.append(_folder(out))
            assert folders[0] == folders[1], (name, tokenizer)
    assert pools == [2, 2]  # the BPE runs used 2 processes; bytes are encoded in this process
    # and the same as encoding every document alone, its EOS after it, every 10th held out
    tok = load_tokenizer(str(root / "tok" / "tokenizer.json"))
    want = {s: [np.append(tok.encode(d), tok.eos_id) for i, d in enumerate(docs) if (i % 10 == 9) == (s == "val")]
            for s in ("train", "val")}
    got = tmp_path / "docs.jsonl-False-2"
    for s, parts in want.items():
        shards = sorted(got.glob(f"{s}-*.bin"))
        assert len(shards) > (s == "train")
        np.testing.assert_array_equal(np.concatenate([np.fromfile(f, np.uint16) for f in shards]), np.concatenate(parts))
        np.testing.assert_array_equal(np.load(got / f"{s}.docs.npy"), np.cumsum([0] + [len(p) for p in parts[:-1]]))


def test_fewer_documents_than_val_every_hold_out_the_last(corpus, tmp_path):
    root, docs, lines = corpus
    (tmp_path / "few.jsonl").write_bytes(b"".join(lines[:7]))
    meta = tz.tokenize_corpus(tmp_path / "few.jsonl", tmp_path / "out", "byte", progress=False, workers=2)
    assert (meta["splits"]["train"]["documents"], meta["splits"]["val"]["documents"]) == (6, 1)
    assert (tmp_path / "out" / "val-00000.bin").read_bytes() == docs[6].encode() + b"\n\n"


def test_the_bar_counts_documents_written(corpus, tmp_path, small_batches, monkeypatch):
    root, _, lines = corpus
    ends = np.cumsum([len(ln) for ln in lines])  # the input bytes up to the end of record k
    written = [0]
    add = tz._Splitter.add

    def counting(self, flat, n_tokens, n_bytes):
        add(self, flat, n_tokens, n_bytes)
        written[0] += len(n_tokens)

    bars = []

    class Bar:
        def __init__(self, total, desc, **_):
            self.total, self.n, self.seen, self.postfix = total, 0, [], ""
            bars.append(self)

        def update(self, n):
            assert n >= 0
            self.n += n
            self.seen.append((self.n, written[0]))

        def set_postfix_str(self, s, refresh=True):
            self.postfix = s

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(tz._Splitter, "add", counting)
    monkeypatch.setattr(tz, "tqdm", Bar)
    monkeypatch.setattr(tz.records, "READ_BYTES", 1 << 10)  # the file is read in many chunks
    tz.tokenize_corpus(root / "docs.jsonl", tmp_path / "out", str(root / "tok" / "tokenizer.json"),
                       progress=True, workers=2)
    (bar,) = bars
    assert bar.total == ends[-1] == bar.n and written[0] == N_DOCS
    assert sum(1 for n, _ in bar.seen if n < bar.total) > 5  # counted as it goes, not only at the end
    longest = max(len(ln) for ln in lines)  # the bar may count a record cut by a read chunk, no more
    for n, k in bar.seen:
        assert n <= (ends[k - 1] if k else 0) + longest, (n, k)
    assert bar.postfix.endswith("tokens/s")


def test_a_bad_record_mid_stream_is_one_line_and_leaves_nothing(corpus, tmp_path, capsys, small_batches):
    root, _, lines = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(lines[:250]) + b'{"text": 7}\n' + b"".join(lines[250:]))
    out = tmp_path / "out"
    rc = main(["tokenize", "--data", str(bad), "--out", str(out), "--tokenizer", str(root / "tok" / "tokenizer.json"),
               "--workers", "2", "--no-progress"])
    assert rc == 2
    one_error_line(capsys.readouterr().err, f"{bad} line 251", "--skip-bad")
    assert not out.exists()
    out.mkdir()  # an existing (empty) folder is left as it was
    assert main(["tokenize", "--data", str(bad), "--out", str(out), "--workers", "2", "--no-progress"]) == 2
    assert list(out.iterdir()) == []
    capsys.readouterr()
    assert main(["tokenize", "--data", str(bad), "--out", str(out), "--workers", "0"]) == 2
    one_error_line(capsys.readouterr().err, "tokenize.workers", "--workers")
