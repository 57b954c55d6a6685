"""The JSONL reader agrees with ``json.loads`` line by line, on the lines where a faster path could differ."""

import json

from boostjax.data import records

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
