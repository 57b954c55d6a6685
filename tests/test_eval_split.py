"""`boostjax eval` scores the split it says: by default the validation split the trainer holds out of
`--data` (the trainer's own tokens, for text too), `--split train` / `--split all`, and the `scored:` line
and JSON fields that name it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from boostjax.cli import evaluate as cli_evaluate
from boostjax.cli import main
from boostjax.config import Config, ConfigError, TrainConfig
from boostjax.data import ByteTokenizer
from boostjax.data.corpus import VAL_EVERY
from boostjax.data.source import resolve_source
from boostjax.data.tokenize import split_documents, tokenize_corpus
from boostjax.data.tokenizers import train_tokenizer
from boostjax.inference import evaluation
from boostjax.inference.evaluation import eval_data
from boostjax.training.prepare import open_data


def _folder(path, n: int, reps: int = 2):
    path.mkdir()
    for i in range(n):
        (path / f"{i:03d}.txt").write_text(f"file {i}: " + "the quick brown fox. " * (reps + i % 3))
    return path


def _trainer_val(data: str):
    """The validation stream and documents the trainer evaluates (`boostjax.training.prepare.open_data`)."""
    corpus = open_data(Config(train=TrainConfig(data=data)))[1]
    return corpus.val, corpus.val_docs


@pytest.mark.parametrize("n_files", [3, VAL_EVERY + 2])  # the tail of the bytes; every 50th file
def test_the_default_scores_exactly_the_trainers_validation_tokens_of_a_text_folder(tmp_path, n_files):
    folder = str(_folder(tmp_path / "texts", n_files))
    val, val_docs = _trainer_val(folder)
    d = eval_data(ByteTokenizer(), folder)
    assert d.split == "val" and d.tokens[0] == ord("\n")
    np.testing.assert_array_equal(d.tokens[1:], val)  # copy semantics: the same bytes
    np.testing.assert_array_equal(d.doc_starts, val_docs + 1)
    assert d.n_bytes == len(val) and d.documents == len(val_docs)
    rule = "every 50th file" if n_files > VAL_EVERY else "the last 2% of the bytes, as 3 files are too few"
    assert d.scored.startswith(f"the validation split of {folder} ({rule}")
    assert d.scored.endswith(f"{len(val_docs)} document{'s' * (len(val_docs) > 1)}, {len(val):,} tokens)")
    if n_files > VAL_EVERY:  # file 49 alone
        assert d.tokens[1:].tobytes() == (tmp_path / "texts" / "049.txt").read_bytes() + b"\n\n"


def test_train_and_all_of_a_text_file_and_a_bin_file(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("0123456789" * 30)
    raw = text.read_bytes()
    whole = eval_data(ByteTokenizer(), str(text), "all")
    assert whole.tokens[1:].tobytes() == raw and whole.documents is None and "all of" in whole.scored
    val, train = eval_data(ByteTokenizer(), str(text), "val"), eval_data(ByteTokenizer(), str(text), "train")
    assert train.tokens[1:].tobytes() + val.tokens[1:].tobytes() == raw and len(val.tokens) - 1 == 6  # 2% of 300
    assert "(the last 2% of the bytes: 6 tokens)" in val.scored and "(all but the last 2%" in train.scored
    ids = np.arange(400, dtype=np.uint16)
    ids.tofile(tmp_path / "ids.bin")
    d = eval_data(ByteTokenizer(), str(tmp_path / "ids.bin"))
    np.testing.assert_array_equal(d.tokens, ids[-8:])  # no separator: ids of an unknown tokenizer
    assert d.n_bytes is None and "the last 2% of the tokens" in d.scored
    with pytest.raises(ConfigError, match=r"^eval\.doc_sep: .* fix: drop --doc-sep"):
        eval_data(ByteTokenizer(), str(tmp_path / "ids.bin"), doc_sep="line")
    with pytest.raises(ConfigError, match=r"^eval\.split: unknown 'test'; fix: pass --split with one of val"):
        eval_data(ByteTokenizer(), str(text), "test")
    assert cli_evaluate.EVAL_SPLITS == evaluation.EVAL_SPLITS


def test_another_tokenizer_encodes_the_text_of_the_same_split(tmp_path):
    """The split is cut in bytes, as the trainer cuts it; a character cut in two at its edge is dropped."""
    text = tmp_path / "a.txt"
    text.write_text("héllo wörld, " * 20 + "\n\nétéé" * 2)  # 318 bytes: the last 6 start inside an 'é'
    raw = text.read_bytes()
    n_val = round(len(raw) * 0.02)
    assert raw[-n_val] & 0xC0 == 0x80  # the cut falls inside a character
    tok = train_tokenizer(["héllo wörld, été"] * 5, 300)
    d = eval_data(tok, str(text))
    want = split_documents(raw[-n_val + 1:].decode(), "blank")
    assert d.documents == len(want) and d.n_bytes == sum(len(w.encode()) for w in want)
    np.testing.assert_array_equal(d.tokens[1:], np.concatenate([np.append(tok.encode(w), tok.eos_id) for w in want]))


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_eval_of_the_runs_text_folder_says_what_it_scored(tmp_path, capsys):
    folder = _folder(tmp_path / "texts", 4, reps=12)  # 1,111 bytes: the trainer holds out the last 22
    run = tmp_path / "run"
    rc, _, err = _run(capsys, "train", "--data", folder, "--out", run, "--model", "llama", "--d-model", "16",
                      "--n-layers", "1", "--n-heads", "2", "--d-ff", "32", "--batch", "2", "--seq", "16",
                      "--steps", "1", "--eval-batches", "1", "--no-progress")
    assert rc == 0, err
    val, _ = _trainer_val(str(folder))
    ev = ["eval", "--run", run, "--data", folder, "--batch", "2", "--no-progress"]
    rc, out, _ = _run(capsys, *ev, "--json")
    res = json.loads(out)
    assert rc == 0 and (res["split"], res["tokens"], res["bytes"], res["training_data"]) == ("val", len(val),
                                                                                          len(val), True)
    assert res["data"] == f"{folder} (val split)" and res["scored"].startswith(f"the validation split of {folder}")
    rc, out, _ = _run(capsys, *ev)
    scored, line = out.splitlines()
    assert scored == (f"scored: {res['scored']}; this run's training data: the trainer held this split out")
    assert line.startswith(f"eval: step 1 of {run} on {folder} (val split): loss {res['loss']:.4f}")
    rc, out, _ = _run(capsys, *ev, "--split", "all", "--json")
    res_all = json.loads(out)
    total = sum(len(f.read_bytes()) + 2 for f in folder.iterdir())
    assert rc == 0 and (res_all["split"], res_all["tokens"], res_all["documents"]) == ("all", total, 4)
    other = tmp_path / "other.txt"
    other.write_text("a held-out text, not the run's. " * 20)
    rc, out, _ = _run(capsys, *ev[:4], other, "--batch", "2", "--no-progress")
    assert out.splitlines()[0].endswith("; not this run's training data (--split all scores all of it)")
    rc, _, err = _run(capsys, *ev, "--split", "everything")
    assert rc == 2 and err.count("\n") == 1 and err.startswith("boostjax: error: eval.split: invalid choice")


def test_the_scored_line_names_the_text_a_runs_tokenised_data_was_made_from(tmp_path):
    folder = _folder(tmp_path / "texts", 4)
    tokenize_corpus(folder, tmp_path / "tok", "byte", val_every=2, progress=False)
    run = tmp_path / "run"
    run.mkdir()
    cfg = Config(train=TrainConfig(data=str(tmp_path / "tok")))
    assert cli_evaluate._relation(str(run), cfg, str(folder), "uint16", "val") == (None, "")  # no fingerprint
    (run / "config.json").write_text(json.dumps({"data_fingerprint": resolve_source(str(tmp_path / "tok")).fingerprint}))
    known, words = cli_evaluate._relation(str(run), cfg, str(folder), "uint16", "val")
    assert known is False and words == (f"; the text that this run's data {tmp_path / 'tok'} was tokenised from: the "
                                         f"documents the run held out are that folder's validation split (--data "
                                         f"{tmp_path / 'tok'})")
    assert cli_evaluate._relation(str(run), cfg, str(tmp_path / "tok"), "uint16", "train")[0] is True
