"""The loader's speed: the prefetch that reads a memory-mapped batch's pages at once changes no token
(batches from a memmap, a slice of one and an in-memory copy are equal), and a smoke run of
experiments/data/loader_speed.py (tiny shapes; the numbers mean nothing, the plumbing does)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from boostjax.data.batches import DocumentIterator, batch_iterator, file_range, runs
from experiments.data import loader_speed



def _memmap(tmp_path, n: int = 5000, offset: int = 6) -> np.memmap:
    path = tmp_path / "t.bin"
    head = np.arange(offset // 2, dtype=np.uint16)  # the stream starts `offset` bytes into the file
    np.concatenate([head, np.random.default_rng(0).integers(0, 300, n).astype(np.uint16)]).tofile(path)
    return np.memmap(path, dtype=np.uint16, mode="r", offset=offset)


def test_file_range_finds_a_slice_in_its_file(tmp_path):
    mm = _memmap(tmp_path)
    part = mm[1234:]
    path, start = file_range(part)
    assert path == str(tmp_path / "t.bin") and start == 6 + 1234 * 2
    assert np.array_equal(np.fromfile(path, np.uint16, count=16, offset=start), part[:16])
    assert file_range(np.asarray(part).copy()) is None and file_range(mm[::2]) is None


def test_runs_cover_exactly_the_positions_a_batch_reads():
    assert [a.tolist() for a in runs(np.array([[5, 6, 7, 20, 21], [22, 23, 3, 4, 9]]))] == [[5, 20, 22, 3, 9],
                                                                                          [3, 2, 2, 2, 1]]
    tokens = np.zeros(3000, np.uint16)
    it = DocumentIterator(tokens, np.arange(0, 3000, 50), 4, 128, 3)  # documents of 50 tokens
    src_bs, _ = it.positions(2)
    first, lengths = runs(src_bs)
    assert np.array_equal(np.concatenate([np.arange(f, f + n) for f, n in zip(first, lengths)]), src_bs.ravel())
    assert len(first) > len(src_bs)  # rows that cross documents read more than one piece


@pytest.mark.parametrize("documents", [True, False])
@pytest.mark.parametrize("processes", [1, 4])
def test_memmap_batches_equal_in_memory_batches(tmp_path, documents, processes):
    mm = _memmap(tmp_path)[100:]  # a split that is a slice of the file's memmap
    docs = np.array([0, 7, 300, 301, 900, 2500, 4000], np.int64) if documents else None
    kw = dict(segments=documents, process_count=processes, vocab_size=300)
    for index in range(processes):
        on_disk = batch_iterator(mm, docs, 8, 64, 5, process_index=index, **kw)
        in_memory = batch_iterator(np.array(mm), docs, 8, 64, 5, process_index=index, **kw)
        for step in (0, 1, 9, 40):  # 40 x 8 rows of 64: past the first epoch of the packed documents
            a, b = on_disk.batch_at(step), in_memory.batch_at(step)
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), (step, index)


@pytest.mark.experiment  # an experiment script's end-to-end smoke run (a few seconds): `pytest -m experiment`
def test_smoke_run_writes_the_table(tmp_path):
    ls = loader_speed
    args = ["--tokens", "200000", "--mean-doc", "50", "--batch", "8", "--seq", "64", "--warmup", "1",
            "--batches", "2", "--tmp", str(tmp_path), "--out", str(tmp_path / "out")]
    assert ls.main(args) == 0
    res = json.loads((tmp_path / "out" / "loader_speed.json").read_text())
    got = [(r["sampler"], r["segments"], r["processes"], r["cache"]) for r in res["rows"]]
    assert got == [("documents", False, 1, "warm"), ("documents", False, 8, "warm"), ("documents", True, 1, "warm"),
                   ("documents", True, 8, "warm"), ("windows", False, 1, "warm"), ("windows", False, 8, "warm"),
                   ("documents", False, 1, "cold"), ("documents", False, 8, "cold"), ("windows", False, 1, "cold")]
    assert all(r["tokens_per_s"] > 0 and r["tokens_per_batch"] == r["rows"] * 64 for r in res["rows"])
    assert [r["rows"] for r in res["rows"]] == [8, 1, 8, 1, 8, 1, 8, 1, 8]
    assert "| documents | yes | 8 | warm | 1 |" in (tmp_path / "out" / "loader_speed.md").read_text()
    assert list(tmp_path.iterdir()) == [tmp_path / "out"]  # the token folder is removed
