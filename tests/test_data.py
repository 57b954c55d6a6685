"""Tests for boostjax.data: tokenizer, corpora, deterministic/resumable/sharded batches, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from boostjax import data
from boostjax.data import BatchIterator, ByteTokenizer, Corpus, eval_batches, load_corpus


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_non_ascii():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo wörld ✓ 日本語 🚀'\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 256
    assert ids.dtype == np.uint8 and ids.ndim == 1
    assert len(ids) == len(text.encode("utf-8")) > len(text)  # multi-byte characters
    np.testing.assert_array_equal(ids, np.frombuffer(text.encode("utf-8"), np.uint8))
    assert tok.decode(ids) == text
    assert tok.decode(ids.astype(np.int32).tolist()) == text
    # A cut multi-byte character is replaced, not an exception.
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"
    with pytest.raises(ValueError, match="ids must be in"):
        tok.decode([65, 300])


# ----------------------------------------------------------------------------- stdlib corpus


def test_stdlib_corpus_deterministic_and_split_by_file():
    files = data.stdlib_sources()
    assert len(files) > 100
    rels = [p.relative_to(data.corpus._stdlib_root()).as_posix() for p in files]
    assert rels == sorted(rels)
    assert not any("site-packages" in r.split("/") or "dist-packages" in r.split("/") for r in rels)
    assert "os.py" in rels

    corpus = data.stdlib_corpus()
    assert isinstance(corpus, Corpus)
    assert corpus.train.dtype == np.uint8 and corpus.val.dtype == np.uint8
    assert 0 < len(corpus.val) < len(corpus.train)
    # Split by construction: file i is validation iff i % 50 == 49; the sizes add up exactly.
    sizes = [p.stat().st_size + 2 for p in files]
    assert len(corpus.train) + len(corpus.val) == sum(sizes)
    assert len(corpus.val) == sum(s for i, s in enumerate(sizes) if i % 50 == 49)
    # The validation stream starts with file 49's bytes.
    first_val = files[49].read_bytes()
    assert corpus.val[: len(first_val)].tobytes() == first_val
    assert corpus.train[: len(files[0].read_bytes())].tobytes() == files[0].read_bytes()

    # Cached: same object; a fresh (uncached) load gives equal arrays.
    assert data.stdlib_corpus() is corpus
    assert load_corpus("") is corpus
    fresh = data.corpus._files_corpus(files, "again", 0.02)
    np.testing.assert_array_equal(fresh.train, corpus.train)
    np.testing.assert_array_equal(fresh.val, corpus.val)


# ----------------------------------------------------------------------------- batch iterator


def _reference_batch(tokens: np.ndarray, batch: int, seq: int, seed: int, step: int) -> dict[str, np.ndarray]:
    """Plain-loop reference for one global batch."""
    starts = np.random.default_rng([seed, step]).integers(0, len(tokens) - seq, size=batch)
    rows = [np.array([int(tokens[s + t]) for t in range(seq + 1)], np.int32) for s in starts]
    w = np.stack(rows)
    return {"inputs": w[:, :-1], "targets": w[:, 1:]}


@pytest.fixture(scope="module")
def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=5000).astype(np.uint8)


def test_batch_matches_reference_and_targets_shifted(tokens):
    it = BatchIterator(tokens, batch=6, seq=16, seed=3)
    for step in range(3):
        b = it.next()
        ref = _reference_batch(tokens, 6, 16, 3, step)
        assert b["inputs"].dtype == np.int32 and b["inputs"].shape == (6, 16)
        assert b["targets"].dtype == np.int32 and b["targets"].shape == (6, 16)
        np.testing.assert_array_equal(b["inputs"], ref["inputs"])
        np.testing.assert_array_equal(b["targets"], ref["targets"])
        np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
    assert it.step == 3


def test_targets_are_next_tokens_in_stream():
    stream = np.arange(1000, dtype=np.uint16)  # token value == position
    b = BatchIterator(stream, 4, 8, 0).next()
    np.testing.assert_array_equal(b["targets"], b["inputs"] + 1)
    np.testing.assert_array_equal(np.diff(b["inputs"], axis=1), 1)
    assert b["inputs"].min() >= 0 and b["targets"].max() <= 999


def test_windows_cover_range_endpoints():
    stream = np.arange(6, dtype=np.uint8)  # seq 4: starts in {0, 1}
    starts = set()
    it = BatchIterator(stream, 8, 4, 0)
    for _ in range(10):
        starts.update(it.next()["inputs"][:, 0].tolist())
    assert starts == {0, 1}


def test_determinism(tokens):
    a = BatchIterator(tokens, 4, 16, seed=7)
    b = BatchIterator(tokens, 4, 16, seed=7)
    ba, bb = a.next(), b.next()
    np.testing.assert_array_equal(ba["inputs"], bb["inputs"])
    bc = a.next()
    assert not np.array_equal(ba["inputs"], bc["inputs"])  # different step -> different batch
    other = BatchIterator(tokens, 4, 16, seed=8).next()
    assert not np.array_equal(ba["inputs"], other["inputs"])  # different seed -> different batch
    np.testing.assert_array_equal(BatchIterator(tokens, 4, 16, 7, step=1).next()["inputs"], bc["inputs"])
    np.testing.assert_array_equal(a.batch_at(0)["inputs"], ba["inputs"])


def test_resume_from_state(tokens):
    straight = BatchIterator(tokens, 4, 16, seed=5)
    expected = [straight.next() for _ in range(8)]

    first = BatchIterator(tokens, 4, 16, seed=5)
    for _ in range(5):
        next(first)
    state = json.loads(json.dumps(first.state()))  # survives a JSON round trip (checkpoint metadata)
    assert state == {"step": 5, "seed": 5, "sampler": "windows"}

    resumed = BatchIterator(tokens, 4, 16, seed=999)
    resumed.restore(state)
    assert resumed.step == 5 and resumed.seed == 5
    for want, got in zip(expected[5:], [resumed.next() for _ in range(3)]):
        np.testing.assert_array_equal(got["inputs"], want["inputs"])
        np.testing.assert_array_equal(got["targets"], want["targets"])

    with pytest.raises(ValueError, match="'step' and 'seed'"):
        resumed.restore({"step": 1})


def test_process_sharding_concatenates_to_global_batch(tokens):
    single = BatchIterator(tokens, 8, 12, seed=2)
    shards = [BatchIterator(tokens, 8, 12, seed=2, process_index=i, process_count=2) for i in range(2)]
    quads = [BatchIterator(tokens, 8, 12, seed=2, process_index=i, process_count=4) for i in range(4)]
    for _ in range(3):
        g = single.next()
        parts = [s.next() for s in shards]
        qparts = [q.next() for q in quads]
        assert parts[0]["inputs"].shape == (4, 12) and qparts[0]["inputs"].shape == (2, 12)
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), g[key])
            np.testing.assert_array_equal(np.concatenate([q[key] for q in qparts]), g[key])


def test_eval_batches_fixed(tokens):
    ev1 = eval_batches(tokens, 4, 16, n=3)
    ev2 = eval_batches(tokens, 4, 16, n=3)
    assert len(ev1) == 3
    for a, b in zip(ev1, ev2):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
        np.testing.assert_array_equal(a["targets"], b["targets"])
    assert not np.array_equal(ev1[0]["inputs"], ev1[1]["inputs"])
    ref = _reference_batch(tokens, 4, 16, 1234, 2)
    np.testing.assert_array_equal(ev1[2]["inputs"], ref["inputs"])
    assert eval_batches(tokens, 4, 16, n=0) == []


# ----------------------------------------------------------------------------- files


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_memmap(tmp_path, dtype):
    high = 60000 if dtype == "uint16" else 2_000_000_000  # > uint16, < 2**31
    ids = np.linspace(0, high, 1000).astype(dtype)
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    corpus = load_corpus(str(path), dtype=dtype, val_fraction=0.1)
    assert isinstance(corpus.train, np.memmap) and isinstance(corpus.val, np.memmap)
    assert corpus.train.dtype == np.dtype(dtype)
    assert len(corpus.train) == 900 and len(corpus.val) == 100
    np.testing.assert_array_equal(corpus.train, ids[:900])
    np.testing.assert_array_equal(corpus.val, ids[900:])

    it = BatchIterator(corpus.train, 4, 10, seed=1)
    b = it.next()
    ref = _reference_batch(ids[:900], 4, 10, 1, 0)
    np.testing.assert_array_equal(b["inputs"], ref["inputs"])
    np.testing.assert_array_equal(b["targets"], ref["targets"])
    assert b["inputs"].max() > 30000  # real large ids came through, not truncated
    # vocab check is lazy on memmaps and fires on the first batch that holds a too-large id.
    lazy = BatchIterator(corpus.train, 4, 10, seed=1, vocab_size=50)
    with pytest.raises(ValueError, match="vocab_size 50"):
        lazy.next()
    assert BatchIterator(corpus.train, 4, 10, seed=1, vocab_size=high + 1).next()["inputs"].shape == (4, 10)


def test_text_file(tmp_path):
    text = "hello wörld\n" * 50
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(path), val_fraction=0.1)
    raw = text.encode("utf-8")
    assert corpus.train.dtype == np.uint8
    assert len(corpus.train) + len(corpus.val) == len(raw)
    assert len(corpus.val) == round(len(raw) * 0.1)
    assert ByteTokenizer().decode(np.concatenate([corpus.train, corpus.val])) == text
    # Any non-.bin extension is text.
    other = tmp_path / "notes.log"
    other.write_text(text, encoding="utf-8")
    np.testing.assert_array_equal(load_corpus(str(other), val_fraction=0.1).val, corpus.val)


def test_directory(tmp_path):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    names = [f"f{i:03d}.txt" for i in range(60)]
    for i, n in enumerate(names):
        (root / n).write_text(f"file {i}\n", encoding="utf-8")
    (root / "sub" / "a.md").write_text("# markdown\n", encoding="utf-8")
    (root / "sub" / "b.py").write_text("x = 1\n", encoding="utf-8")
    (root / "ignored.bin").write_bytes(b"\x00\x01")
    (root / "ignored.json").write_text("{}", encoding="utf-8")

    corpus = load_corpus(str(root))
    order = sorted(names + ["sub/a.md", "sub/b.py"])
    chunks = [(root / r).read_bytes() + b"\n\n" for r in order]
    want_val = b"".join(c for i, c in enumerate(chunks) if i % 50 == 49)
    want_train = b"".join(c for i, c in enumerate(chunks) if i % 50 != 49)
    assert corpus.val.tobytes() == want_val == b"file 49\n\n\n"
    assert corpus.train.tobytes() == want_train

    # Fewer than 50 files: falls back to the tail split of the file-ordered stream.
    small = tmp_path / "small"
    small.mkdir()
    for n in ("b.txt", "a.txt"):
        (small / n).write_text(n * 20, encoding="utf-8")
    c2 = load_corpus(str(small), val_fraction=0.25)
    stream = ("a.txt" * 20 + "\n\n" + "b.txt" * 20 + "\n\n").encode()
    assert (c2.train.tobytes() + c2.val.tobytes()) == stream
    assert len(c2.val) == round(len(stream) * 0.25)


# ----------------------------------------------------------------------------- errors


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match=r"data: no such file.*fix:"):
        load_corpus(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty corpus"):
        load_corpus(str(empty))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="empty corpus"):
        load_corpus(str(tmp_path / "emptydir"))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="not a multiple of uint16"):
        load_corpus(str(odd), dtype="uint16")
    with pytest.raises(ValueError, match="not a multiple of uint32"):
        load_corpus(str(odd), dtype="uint32")
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_corpus(str(odd), dtype="float32")
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"abcdefghij")
    with pytest.raises(ValueError, match="split too small"):
        load_corpus(str(tiny), val_fraction=0.02)
    with pytest.raises(ValueError, match="val_fraction"):
        load_corpus(str(tiny), val_fraction=1.5)


def test_iterator_errors(tokens):
    with pytest.raises(ValueError, match=r"smaller --seq or more data"):
        BatchIterator(tokens[:16], 2, 16, 0)
    BatchIterator(tokens[:17], 2, 16, 0).next()  # exactly seq + 1 tokens is enough
    with pytest.raises(ValueError, match="not divisible by process_count 3"):
        BatchIterator(tokens, 8, 16, 0, process_count=3)
    with pytest.raises(ValueError, match="process_index 2 must be < process_count 2"):
        BatchIterator(tokens, 8, 16, 0, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="batch must be an integer >= 1"):
        BatchIterator(tokens, 0, 16, 0)
    with pytest.raises(ValueError, match="seed must be"):
        BatchIterator(tokens, 2, 16, -1)
    with pytest.raises(ValueError, match="1-D"):
        BatchIterator(tokens.reshape(50, 100), 2, 16, 0)
    # In-memory arrays: vocab is checked eagerly, at construction.
    with pytest.raises(ValueError, match="vocab_size 100"):
        BatchIterator(tokens, 2, 16, 0, vocab_size=100)
    BatchIterator(tokens, 2, 16, 0, vocab_size=256)
    with pytest.raises(ValueError, match="Corpus.train"):
        Corpus(train=np.zeros(4, np.float32), val=np.zeros(4, np.uint8), name="bad")
