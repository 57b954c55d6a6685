"""A validation split too short for one row is refused before the run folder is written."""

from boostjax.cli import main
from boostjax.data.tokenize import tokenize_corpus
from helpers import one_error_line


def test_a_validation_split_shorter_than_a_row_is_refused_before_anything_is_written(capsys, tmp_path):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(12):
        (texts / f"{i:02d}.txt").write_text(f"text {i} " + "some words of a document " * (20 if i != 11 else 0))
    tokenize_corpus(texts, tmp_path / "tok", "byte", val_every=12, progress=False)  # val: the short last file
    run = tmp_path / "run"
    rc = main(["train", "--data", str(tmp_path / "tok"), "--steps", "1", "--seq", "32", "--out", str(run),
               "--no-progress"])
    one_error_line(capsys.readouterr().err, "the validation split of", "fewer than --seq + 1 = 33", "--val-every")
    assert rc == 2 and not run.exists()
