"""Data known by its content: a tokenised folder's meta.json carries the fingerprint of its token files
(hashed as they were written), a run stores its data's fingerprint, and a resumed run accepts the same
data at another path (one line) and refuses other data at the same path (one line naming --data, exit 2,
nothing written). A run of an older boostjax, with no fingerprint, compares the paths as before."""

import json
import pathlib
import shutil

import blake3

from boostjax.cli import main
from boostjax.data import fingerprint
from boostjax.data.source import resolve_source
from boostjax.data.tokenize import tokenize_corpus
from boostjax.data.token_folder import FINGERPRINT_FILES, META_FILE
from helpers import model_flags, one_error_line

FLAGS = [*model_flags(), "--seq", "16", "--batch", "4", "--no-progress", "--log-every", "5", "--eval-every", "1000",
         "--ckpt-every", "5", "--vocab-size", "256"]


def _texts(folder: pathlib.Path, seed: int) -> pathlib.Path:
    folder.mkdir(parents=True)
    for i in range(6):
        (folder / f"doc{i}.txt").write_text(f"document {i} of corpus {seed}: " + "lorem ipsum dolor " * (20 + i + seed))
    return folder


def _snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _train(out, data, steps) -> int:
    return main(["train", *FLAGS, "--steps", str(steps), "--out", str(out), "--data", str(data)])


def test_tokenize_writes_the_fingerprint_of_its_token_files(tmp_path):
    tok = tmp_path / "tok"
    meta = tokenize_corpus(_texts(tmp_path / "a", 0), tok, "byte", val_every=3, progress=False)
    # by hand: b3sum of train.bin (the stream: its shards, one here), train.docs.npy, val.bin, val.docs.npy | b3sum
    files = {n: n.replace(".bin", "-00000.bin") for n in FINGERPRINT_FILES}
    lines = "".join(f"{blake3.blake3((tok / f).read_bytes()).hexdigest()}  {n}\n" for n, f in files.items())
    assert meta["fingerprint"] == "blake3:" + blake3.blake3(lines.encode()).hexdigest()
    assert json.loads((tok / META_FILE).read_text())["fingerprint"] == meta["fingerprint"]
    assert resolve_source(tok).fingerprint == "tokens:" + meta["fingerprint"]
    # a version 1 folder (train.bin, val.bin) written before fingerprints existed: hashed, to the same value
    old = tmp_path / "old"
    shutil.copytree(tok, old)
    d = json.loads((old / META_FILE).read_text())
    del d["fingerprint"]
    for s in ("train", "val"):
        (old / f"{s}-00000.bin").rename(old / f"{s}.bin")
        d["splits"][s] = {"file": f"{s}.bin", **{k: v for k, v in d["splits"][s].items() if k != "shards"}}
    (old / META_FILE).write_text(json.dumps({**d, "version": 1}))
    assert resolve_source(old).fingerprint == "tokens:" + meta["fingerprint"]
    assert "fingerprint" not in json.loads((old / META_FILE).read_text())  # the data folder is not rewritten
    # text, a folder of text, a .bin: by content, whatever the path; the kind is part of it
    (tmp_path / "t.txt").write_text("same bytes")
    (tmp_path / "u.txt").write_text("same bytes")
    (tmp_path / "t.bin").write_text("same bytes")
    assert resolve_source(tmp_path / "t.txt").fingerprint == resolve_source(tmp_path / "u.txt").fingerprint
    assert resolve_source(tmp_path / "t.bin", "uint8").fingerprint != resolve_source(tmp_path / "t.txt").fingerprint
    assert resolve_source(tmp_path / "a").fingerprint == "folder:" + fingerprint.of_files(
        tmp_path / "a", sorted((tmp_path / "a").glob("*.txt")))


def test_resume_accepts_the_same_data_moved_and_refuses_other_data_at_the_same_path(tmp_path, capsys):
    data = tmp_path / "tok"
    tokenize_corpus(_texts(tmp_path / "a", 0), data, "byte", val_every=3, progress=False)
    out = tmp_path / "run"
    assert _train(out, data, 5) == 0
    stored = json.loads((out / "config.json").read_text())["data_fingerprint"]
    assert stored == resolve_source(data).fingerprint
    # moved to another mount: accepted, in one line, the new path recorded
    moved = tmp_path / "elsewhere" / "tok"
    moved.parent.mkdir()
    data.rename(moved)
    capsys.readouterr()
    assert _train(out, moved, 10) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "is the data this run was trained on" in line]
    assert len(said) == 1 and str(moved) in said[0] and str(data) in said[0]
    history = [json.loads(line) for line in (out / "config_history.jsonl").read_text().splitlines()]
    assert history[-1]["changed"]["train.data"] == [str(data), str(moved)]
    # other data written where the run's data is now: refused, nothing written
    tokenize_corpus(_texts(tmp_path / "b", 1), moved, "byte", val_every=3, progress=False)
    before = _snapshot(out)
    capsys.readouterr()
    assert _train(out, moved, 15) == 2
    line = one_error_line(capsys.readouterr().err, "train.data: ", "holds other data than the checkpoints",
                          "at the same path", "fix: pass --data with the run's data")
    assert str(moved) in line
    assert _snapshot(out) == before


def test_a_run_without_a_fingerprint_compares_paths(tmp_path, capsys):
    """An older boostjax's run: the same path is accepted (its fingerprint is stored from then on), another
    path is refused as before."""
    text = tmp_path / "t.txt"
    text.write_text("some training text. " * 200)
    out = tmp_path / "run"
    assert _train(out, text, 5) == 0
    cfg = json.loads((out / "config.json").read_text())
    del cfg["data_fingerprint"]
    (out / "config.json").write_text(json.dumps(cfg))
    copy = tmp_path / "copy.txt"
    shutil.copyfile(text, copy)
    capsys.readouterr()
    assert _train(out, copy, 10) == 2
    one_error_line(capsys.readouterr().err, "train.data: ", "cannot change it")
    assert _train(out, text, 10) == 0
    assert json.loads((out / "config.json").read_text())["data_fingerprint"] == resolve_source(text).fingerprint
