"""The JSONL reader agrees with ``json.loads`` line by line, on the lines where a faster path could differ."""

import json

from boostjax.cli import main
from boostjax.data import records
from helpers import one_error_line

LINES = [
    b'{"text": "plain"}',
    b'\xef\xbb\xbf{"text": "after a byte order mark"}',  # json.loads(bytes) reads it as utf-8-sig
    b'  {"text": "leading blanks"}  ',
    b'{"text": "lone surrogate \\ud83d"}',
    b'{"text": "encoded surrogate \xed\xa0\xbd"}',  # json.loads(bytes) decodes with surrogatepass
    b'{"text": "\xff not utf-8"}',
    b'{"text": "a"} {"text": "b"}',
    b'[1, 2]',
    b'{"text": 3}',
    b'{"other": "x"}',
    b'{"text": null}',
    b'{"text": "d\\u00e9j\\u00e0", "text": "last key wins"}',
    b'NaN',
]


def _reference(raw: bytes) -> tuple[str, str]:
    """(text, '' or the kind of failure) as ``json.loads`` on the line's bytes gives them."""
    try:
        rec = json.loads(raw)
    except UnicodeDecodeError:
        return "", "not UTF-8"
    except ValueError:
        return "", "not valid JSON"
    if not isinstance(rec, dict):
        return "", "a JSON"
    if "text" not in rec:
        return "", "no field"
    if not isinstance(rec["text"], str):
        return "", "field"
    if any(0xD800 <= ord(c) <= 0xDFFF for c in rec["text"]):
        return "", "a lone surrogate"  # json.loads gives it, but it is no text: UTF-8 cannot encode it
    return rec["text"], ""


def test_jsonl_lines_read_as_json_loads_reads_them(tmp_path):
    f = tmp_path / "edge.jsonl"
    f.write_bytes(b"\n".join(LINES) + b"\n\n   \n")
    got = list(records.jsonl_documents(f, "text"))
    assert len(got) == len(LINES)  # blank lines are no records
    for n, (raw, doc) in enumerate(zip(LINES, got), start=1):
        text, bad = _reference(raw)
        assert doc.where == f"{f} line {n}"
        assert doc.text == text, raw
        assert doc.bad.startswith(bad) if bad else doc.bad == "", (raw, doc.bad)


def test_a_document_names_its_place_only_when_asked(tmp_path):
    lazy = records.Document("t", (str(tmp_path / "a.jsonl"), "line", 7))
    assert lazy.where == f"{tmp_path / 'a.jsonl'} line 7"
    assert lazy == records.Document("t", f"{tmp_path / 'a.jsonl'} line 7")
    assert lazy != records.Document("t", f"{tmp_path / 'a.jsonl'} line 8")


def _records(n: int) -> list[dict]:
    return [{"text": f"record {i}: " + "some words here " * (i % 5 + 1), "id": i} for i in range(n)]


def test_a_json_list_of_records_tokenises_as_its_jsonl_does(tmp_path):
    from boostjax.data.tokenize import tokenize_corpus

    recs = _records(40)
    (tmp_path / "a.json").write_text(json.dumps(recs, indent=2))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    pretty = tokenize_corpus(tmp_path / "a.json", tmp_path / "from_json", "byte", progress=False, workers=1)
    lines = tokenize_corpus(tmp_path / "a.jsonl", tmp_path / "from_jsonl", "byte", progress=False, workers=1)
    assert pretty["fingerprint"] == lines["fingerprint"]  # the same token files, byte for byte
    assert pretty["splits"] == lines["splits"]


def _refused(capsys, argv, *needles) -> str:
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    return one_error_line(err, *needles)


def test_a_json_document_is_never_prose_and_other_json_is_one_line(capsys, tmp_path):
    recs = _records(30)
    (tmp_path / "obj.json").write_text(json.dumps({"data": recs, "version": 1}, indent=2))
    (tmp_path / "unnamed.dat").write_text(json.dumps(recs, indent=2))
    (tmp_path / "notes.txt").write_text(json.dumps(recs, indent=2))  # named as text: read as text
    assert records.file_format(tmp_path / "unnamed.dat") == "json"
    assert records.file_format(tmp_path / "notes.txt") == "text"
    _refused(capsys, ["tokenize", "--data", tmp_path / "obj.json", "--out", tmp_path / "t", "--no-progress"],
             "holds a JSON object with lists under 'data'", "jq -c '.data[]'")
    _refused(capsys, ["train", "--data", tmp_path / "unnamed.dat", "--steps", "1", "--out", tmp_path / "run"],
             "holds a JSON document, not text; fix: boostjax tokenize")
    assert not (tmp_path / "t").exists() and not (tmp_path / "run").exists()


def test_bytes_of_a_batch_are_each_documents_utf8_and_its_blank_line(tmp_path):
    from boostjax.data.tokenize import tokenize_corpus

    texts = [f"doc {i} " + ["plain ascii", "été à Noël", "数据 🙂 mix", "  padded  "][i % 4] * (i % 3 + 1) for i in range(23)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    meta = tokenize_corpus(tmp_path / "d.jsonl", tmp_path / "out", "byte", val_every=5, progress=False, workers=1)
    for split in ("train", "val"):
        mine = [t for i, t in enumerate(texts) if (i % 5 == 4) == (split == "val")]
        got = b"".join(f.read_bytes() for f in sorted((tmp_path / "out").glob(f"{split}-*.bin")))
        assert got == b"".join(t.encode("utf-8") + b"\n\n" for t in mine)
        assert meta["splits"][split]["bytes"] == sum(len(t.encode("utf-8")) + 2 for t in mine)


def test_tokenize_names_a_mixture_and_a_comma_list_for_what_they_are(capsys, tmp_path):
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in _records(12)))
    a, b, out = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "t"
    _refused(capsys, ["tokenize", "--data", f"{a}:0.7,{b}:0.3", "--out", out], "is a weighted mixture",
             f"--data {a} --out a_tok", "train --data a_tok:W1")
    _refused(capsys, ["tokenize", "--data", f"{a},{b}", "--out", out], "comma-separated list", f"--data {a} {b}")
    _refused(capsys, ["tokenize", "--data", f"{a}:0.7,{tmp_path / 'none'}:0.3", "--out", out], "no such file")
    assert not out.exists()
