"""Corpora a user brings (`boostjax.data.records`): JSONL (plain, gzip, zstd), Parquet, Arrow and a `datasets`
folder tokenise to the same bytes as the same documents in text files; bad records and damaged files are one
line and nothing written (or counted with --skip-bad); train refuses records and compressed bytes as text;
an interrupted tokenize never looks finished."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from boostjax.cli import main
from boostjax.data import records
from boostjax.data import tokenize as tz
from boostjax.data.source import resolve_source
from boostjax.data.token_folder import is_token_folder
from helpers import one_error_line

pa = pytest.importorskip("pyarrow")  # the data extra, installed with the test extra
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

N_DOCS = 240


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """Documents with what a naive reader gets wrong: newlines, blank lines, quotes, non-ASCII, one of
    only whitespace (dropped, as an empty text file is)."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "\u00e9t\u00e9", "\u6f22\u5b57", 'say "hi"', "tab\there", "x\\y"]
    out = [" ".join(rng.choice(words, size=int(rng.integers(1, 12)))) + ("\n\nsecond block" if i % 7 == 0 else "")
           for i in range(N_DOCS)]
    out[5] = "   \n "
    return out


def _jsonl(docs, field="text") -> bytes:
    return b"".join(json.dumps({"id": i, field: d}).encode() + b"\n" for i, d in enumerate(docs))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, docs):
    """The same documents as text files, JSONL (plain, gz, zst), Parquet, Arrow (file and stream) and a
    `datasets` folder."""
    root = tmp_path_factory.mktemp("records")
    (root / "texts").mkdir()
    for i, d in enumerate(docs):
        (root / "texts" / f"{i:04d}.txt").write_text(d, encoding="utf-8")
    raw = _jsonl(docs)
    (root / "docs.jsonl").write_bytes(raw)
    (root / "docs.jsonl.gz").write_bytes(gzip.compress(raw))
    (root / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, root / "docs.parquet", row_group_size=64)  # several row groups
    with pa.OSFile(str(root / "docs.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=100)
    with pa.OSFile(str(root / "stream.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=100)
    half = len(docs) // 2
    (root / "part-0.jsonl").write_bytes(_jsonl(docs[:half]))
    pq.write_table(pa.table({"text": docs[half:]}), root / "part-1.parquet")
    return root


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory):
    """The documents tokenised from text files, one file each: what every format must give."""
    out = tmp_path_factory.mktemp("ref") / "tok"
    return out, tz.tokenize_corpus(inputs / "texts", out, "byte", val_every=10, progress=False)


def _same_tokens(a, b) -> None:
    names = sorted(p.name for p in a.iterdir() if p.suffix in (".bin", ".npy"))  # the shards and the offsets
    assert names == sorted(p.name for p in b.iterdir() if p.suffix in (".bin", ".npy"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("data", ["docs.jsonl", "docs.jsonl.gz", "docs.jsonl.zst", "docs.parquet", "docs.arrow",
                                  "stream.arrow", ["part-0.jsonl", "part-1.parquet"], ["part-*"]])
def test_every_format_tokenises_to_the_text_files_tokens(capsys, tmp_path, inputs, reference, data):
    paths = [str(inputs / d) for d in ([data] if isinstance(data, str) else data)]
    rc = main(["tokenize", "--data", *paths, "--out", str(tmp_path / "tok"), "--val-every", "10", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    ref, ref_meta = reference
    _same_tokens(tmp_path / "tok", ref)
    assert meta["fingerprint"] == ref_meta["fingerprint"] and meta["splits"] == ref_meta["splits"]
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == N_DOCS - 1
    assert meta["text_field"] == "text"


def test_a_datasets_folder_and_its_train_split(tmp_path, docs, reference):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": docs, "n": list(range(len(docs)))})
    ds.save_to_disk(str(tmp_path / "hf"), max_shard_size="4KB")  # several .arrow shards, in order
    assert len(list((tmp_path / "hf").glob("*.arrow"))) > 1
    tz.tokenize_corpus(tmp_path / "hf", tmp_path / "tok", val_every=10, progress=False)
    _same_tokens(tmp_path / "tok", reference[0])
    other = datasets.Dataset.from_dict({"text": ["not", "these"]})
    datasets.DatasetDict({"train": ds, "test": other}).save_to_disk(str(tmp_path / "dd"))
    tz.tokenize_corpus(tmp_path / "dd", tmp_path / "tok2", val_every=10, progress=False)
    _same_tokens(tmp_path / "tok2", reference[0])
    datasets.DatasetDict({"validation": other, "test": other}).save_to_disk(str(tmp_path / "nt"))
    with pytest.raises(ValueError, match="without a 'train' split.*validation, test"):
        tz.tokenize_corpus(tmp_path / "nt", tmp_path / "tok3", progress=False)
    with pytest.raises(ValueError, match="a Hugging Face datasets folder, not text.*boostjax tokenize"):
        resolve_source(tmp_path / "hf")


def _refused(capsys, argv, *needles) -> str:
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    return one_error_line(err, *needles)


def _damaged(tmp_path, docs):
    """name -> (bytes, what the error names): a bad record or a damaged file each."""
    raw = _jsonl(docs[:50])
    lines = raw.split(b"\n")
    zst = zstandard.ZstdCompressor().compress(raw)
    gz = gzip.compress(raw)
    pq.write_table(pa.table({"text": docs[:50]}), tmp_path / "good.parquet")
    good = (tmp_path / "good.parquet").read_bytes()
    return {
        "bad.jsonl": (b"\n".join(lines[:6] + [b'{"text": "cut sh'] + lines[7:]), ["bad.jsonl line 7", "not valid JSON"]),
        "missing.jsonl": (raw + b'{"body": "x"}\n', ["missing.jsonl line 51", "no field 'text'", "--text-field"]),
        "number.jsonl": (raw.replace(b'"text": "', b'"text": 3, "t": "', 1), ["number.jsonl line 1", "is int"]),
        "null.jsonl": (b'{"text": null}\n' + raw, ["null.jsonl line 1", "is NoneType"]),
        "cut.jsonl.zst": (zst[:len(zst) // 2], ["cut.jsonl.zst", "truncated"]),
        "cut.jsonl.gz": (gz[:len(gz) // 2], ["cut.jsonl.gz", "truncated"]),
        "corrupt.parquet": (good[:len(good) // 2], ["corrupt.parquet", "not a readable Parquet"]),
        "notes.gz": (gzip.compress(b"plain prose\n\nmore"), ["notes.gz line 1", "not valid JSON", "decompress it"]),
        "utf16.txt": ("prose".encode("utf-16"), ["utf16.txt holds binary bytes", "convert it to UTF-8"]),
        "old.bz2": (b"BZh91AY&SY" + bytes(range(1, 40)), ["old.bz2 holds compressed bytes (bzip2"]),
    }


def test_bad_records_and_damaged_files_are_one_line_and_nothing_written(capsys, tmp_path, docs):
    for name, (content, needles) in _damaged(tmp_path, docs).items():
        (tmp_path / name).write_bytes(content)
        out = tmp_path / f"out-{name}"
        line = _refused(capsys, ["tokenize", "--data", tmp_path / name, "--out", out, "--no-progress"],
                        "tokenize.data:", *needles)
        assert "iconv" not in line
        assert not out.exists(), name
    (tmp_path / "docs.jsonl").write_bytes(_jsonl(docs))
    _refused(capsys, ["tokenize", "--data", tmp_path / "docs.jsonl", "--out", tmp_path / "o", "--text-field", "body"],
             "docs.jsonl line 1", "no field 'body'", "keys: id, text")
    _refused(capsys, ["tokenize", "--data", tmp_path / "good.parquet", "--out", tmp_path / "o", "--text-field", "x"],
             "has no column 'x'", "columns: text")
    _refused(capsys, ["tokenize", "--data", tmp_path / "docs.jsonl", "--out", tmp_path / "o", "--doc-sep", "line"],
             "tokenize.doc_sep:", "each record is one document")
    _refused(capsys, ["tokenize", "--data", tmp_path / "nothing-*.jsonl", "--out", tmp_path / "o"], "no file matches")
    assert not (tmp_path / "o").exists()


def test_skip_bad_counts_and_reports_the_skipped_records(capsys, tmp_path, docs):
    lines = _jsonl(docs[:100]).split(b"\n")
    lines[3], lines[10], lines[20] = b"{oops", b'{"title": "no text"}', b'{"text": ["a", "list"]}'
    (tmp_path / "some-bad.jsonl").write_bytes(b"\n".join(lines))
    rc = main(["tokenize", "--data", str(tmp_path / "some-bad.jsonl"), "--out", str(tmp_path / "tok"),
               "--skip-bad", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "skipped 3 bad records" in err and "some-bad.jsonl line 4" in err
    meta = json.loads((tmp_path / "tok" / "meta.json").read_text())
    assert meta["skipped"]["records"] == 3
    assert [w.split(": ")[0].rsplit(" ", 2)[-2:] for w in meta["skipped"]["first"]] == [
        ["line", "4"], ["line", "11"], ["line", "21"]]
    assert sum(s["documents"] for s in meta["splits"].values()) == 100 - 3 - 1  # and docs[5], only whitespace
    zst = zstandard.ZstdCompressor().compress(_jsonl(docs))
    (tmp_path / "cut.jsonl.zst").write_bytes(zst[:len(zst) // 2])  # a damaged file is never skipped
    _refused(capsys, ["tokenize", "--data", tmp_path / "cut.jsonl.zst", "--out", tmp_path / "t2", "--skip-bad"],
             "truncated")


def test_train_refuses_records_and_compressed_bytes_as_text(capsys, tmp_path, inputs):
    for name in ("docs.jsonl", "docs.jsonl.gz", "docs.jsonl.zst", "docs.parquet", "docs.arrow", "stream.arrow"):
        (tmp_path / f"{name}.txt").write_bytes((inputs / name).read_bytes())
        for data in (inputs / name, tmp_path / f"{name}.txt"):  # by its bytes, whatever its name
            line = _refused(capsys, ["train", "--data", data, "--out", tmp_path / "run", "--steps", "1"],
                            f"{data} holds", "not text", f"boostjax tokenize --data {data}")
            assert "iconv" not in line
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("prose, as it should be\n")
    (folder / "b.jsonl").write_bytes((inputs / "docs.jsonl").read_bytes())
    _refused(capsys, ["train", "--data", folder, "--out", tmp_path / "run", "--steps", "1"],
             f"{folder / 'b.jsonl'} holds JSON records", f"boostjax tokenize --data {folder}")
    (folder / "b.jsonl").unlink()
    (folder / "c.txt").write_bytes(gzip.compress(b"hidden"))
    _refused(capsys, ["train", "--data", folder, "--out", tmp_path / "run", "--steps", "1"],
             f"{folder / 'c.txt'} holds gzip-compressed bytes")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text,kind", [
    (b'{"text": "a"}\n{"text": "b"}\n', "jsonl"), (b"\n\n  {\"a\": 1}\n", "jsonl"),
    (b"{not json} but prose\n", None), (b"[1, 2]\n", None), (b"plain words\n{\"a\": 1}\n", None),
    (b"", None), (b"ab\x00cd", "binary"), (b"PAR1....", "parquet"), (b"ARROW1\x00\x00", "arrow"),
    (b"\xff\xff\xff\xff\x10\x00", "arrow"), (b"\x1f\x8b\x08", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"BZh91AY&SY", "compressed"), (b"\xfd7zXZ\x00\x00", "compressed"), (b"PK\x03\x04", "compressed")])
def test_sniff_never_takes_json_or_compressed_bytes_for_prose(tmp_path, text, kind):
    (tmp_path / "f").write_bytes(text)
    assert records.sniff(tmp_path / "f") == kind


def test_an_interrupted_tokenize_never_looks_finished(monkeypatch, tmp_path, inputs, capsys):
    calls = []

    encoded = tz.encoded

    def interrupted(tok, batch, sep, dtype):
        calls.append(len(batch))
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the tokens
        return encoded(tok, batch, sep, dtype)

    monkeypatch.setattr(tz, "BATCH_DOCS", 16)
    monkeypatch.setattr(tz, "encoded", interrupted)
    out = tmp_path / "tok"
    with pytest.raises(KeyboardInterrupt):
        tz.tokenize_corpus(inputs / "docs.jsonl", out, progress=False)
    assert len(calls) == 2 and not out.exists()  # the temporary files and the folder it made are gone
    monkeypatch.undo()
    # killed outright (no cleanup): temporary files, no meta.json; never read as a tokenised folder
    out.mkdir()
    (out / f"{tz.TMP_PREFIX}4242-train.bin").write_bytes(b"\x00" * 64)
    assert not is_token_folder(out)
    _refused(capsys, ["train", "--data", out, "--out", tmp_path / "run", "--steps", "1"],
             "interrupted boostjax tokenize", f"--out {out}")
    logs = []
    tz.tokenize_corpus(inputs / "docs.jsonl", out, progress=False, log=logs.append)
    assert is_token_folder(out) and not list(out.glob(f"{tz.TMP_PREFIX}*"))
    assert any("interrupted earlier tokenize" in s and "4242-train.bin" in s for s in logs), logs


def test_a_missing_extra_is_one_line_naming_it(monkeypatch, capsys, tmp_path, inputs):
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)  # import pyarrow raises ImportError
    _refused(capsys, ["tokenize", "--data", inputs / "docs.parquet", "--out", tmp_path / "o"],
             "needs pyarrow", "pip install 'boostjax[data]'")
    monkeypatch.setitem(__import__("sys").modules, "zstandard", None)
    _refused(capsys, ["tokenize", "--data", inputs / "docs.jsonl.zst", "--out", tmp_path / "o"],
             "needs zstandard", "pip install 'boostjax[data]'")


@pytest.mark.parametrize("split", ["val", "train", "all"])
def test_eval_scores_records_as_their_tokenised_folder(tmp_path, inputs, split):
    from boostjax.data.tokenizers import ByteTokenizer
    from boostjax.inference.evaluation import eval_data

    tok = ByteTokenizer()
    tz.tokenize_corpus(inputs / "docs.parquet", tmp_path / "tok", tok, progress=False)  # every 50th held out
    want = eval_data(tok, str(tmp_path / "tok"), split)
    if split == "all":  # in record order: the text files, one document each (a folder's is train, then val)
        want = eval_data(tok, str(inputs / "texts"), split, "file")
    for name in ("docs.jsonl.zst", "docs.parquet"):
        got = eval_data(tok, str(inputs / name), split)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.doc_starts, want.doc_starts)
        assert (got.n_bytes, got.documents, got.split) == (want.n_bytes, want.documents, split)
    with pytest.raises(ValueError, match="eval.doc_sep: .*each record is one document"):
        eval_data(tok, str(inputs / "docs.jsonl"), split, "line")
    (tmp_path / "bad.jsonl").write_bytes((inputs / "docs.jsonl").read_bytes() + b"{cut\n")
    with pytest.raises(ValueError, match=f"^eval.data: {tmp_path / 'bad.jsonl'} line {N_DOCS + 1}: not valid JSON") as e:
        eval_data(tok, str(tmp_path / "bad.jsonl"), split)
    assert "--skip-bad" not in str(e.value)  # tokenize's flag, not eval's


def test_records_with_a_trained_tokenizer_match_the_text_files(tmp_path, inputs):
    """The end-of-document path (an EOS id, not "\\n\\n") and a BPE trained on the records' training documents."""
    ref = tmp_path / "ref"
    ref_meta = tz.tokenize_corpus(inputs / "texts", ref, "train:300", val_every=10, progress=False)
    got_meta = tz.tokenize_corpus(inputs / "docs.jsonl.zst", tmp_path / "got", "train:300", val_every=10,
                                  progress=False)
    assert ref_meta["eos_id"] is not None
    assert (tmp_path / "got" / "tokenizer.json").read_bytes() == (ref / "tokenizer.json").read_bytes()
    _same_tokens(tmp_path / "got", ref)
    assert got_meta["fingerprint"] == ref_meta["fingerprint"]


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.jsonl.gz", "docs.jsonl.zst"])
def test_the_reading_bar_counts_a_jsonl_file_as_it_is_read(monkeypatch, tmp_path, name):
    rng = np.random.default_rng(1)
    raw = _jsonl([rng.bytes(300).hex() for _ in range(1000)])  # 600 kB that compress to about half
    pack = {"docs.jsonl": bytes, "docs.jsonl.gz": gzip.compress,
            "docs.jsonl.zst": zstandard.ZstdCompressor().compress}[name]
    (tmp_path / name).write_bytes(pack(raw))
    bars = []

    class Bar:
        def __init__(self, total, desc, **_):
            self.total, self.desc, self.steps = total, desc, []
            bars.append(self)

        def update(self, n):
            self.steps.append(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(tz, "tqdm", Bar)
    monkeypatch.setattr(records, "READ_BYTES", 1 << 16)  # several chunks per file
    tz.tokenize_corpus(tmp_path / name, tmp_path / "tok", progress=True)
    reading = next(b for b in bars if b.desc == "reading")
    assert reading.total == (tmp_path / name).stat().st_size == sum(reading.steps)
    assert min(reading.steps) >= 0 and sum(1 for n in reading.steps if n) > 2  # counted while it is read
