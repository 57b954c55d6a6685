"""The run folder: one writer at a time, a resumed run cannot change what its checkpoints depend on,
writers never touch another artefact's folder, and damaged run files are one clear line. Every
refusal is exit status 2 with one line, before anything is written or compiled."""

import json
import os
import pathlib

import pytest

from boostjax.cli import main
from boostjax.runs.folder import RunFolder
from helpers import model_flags, one_error_line

FLAGS = [*model_flags(), "--seq", "32", "--batch", "4", "--no-progress", "--log-every", "5", "--eval-every", "1000",
         "--ckpt-every", "5"]


def _train(out, *extra, steps=5) -> int:
    return main(["train", *FLAGS, "--steps", str(steps), "--out", str(out), *extra])


def _snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_error_line(capsys, needle: str) -> str:
    return one_error_line(capsys.readouterr().err, needle)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 5-step run (one checkpoint) that the refusals below must leave byte-identical."""
    out = tmp_path_factory.mktemp("runs") / "run"
    assert _train(out) == 0
    return out


@pytest.mark.parametrize("extra,needle", [
    (["--batch", "8"], "train.batch: the checkpoints in "),
    (["--seq", "16"], "train.seq: "),
    (["--seed", "3"], "train.seed: "),
    (["--optimizer", "adam8bit"], "train.optimizer: "),
    (["--grad-accum", "2"], "train.grad_accum: "),  # the effective batch: the data position counts its rows
    (["--d-model", "64"], "model.d_model: "),
    (["--model", "llama"], "model.kind: "),
    (["--data", __file__], "train.data: "),
])
def test_resume_refuses_fields_the_checkpoints_depend_on(run, capsys, extra, needle):
    before = _snapshot(run)
    capsys.readouterr()
    assert _train(run, *extra, steps=10) == 2
    line = _one_error_line(capsys, needle)
    assert "fix: pass --" in line
    assert _snapshot(run) == before


def test_resume_accepts_and_records_changes_that_are_safe(tmp_path):
    out = tmp_path / "run"
    assert _train(out) == 0
    assert _train(out, "--lr", "1e-3", "--log-every", "1", "--attention", "xla", steps=8) == 0
    history = [json.loads(x) for x in (out / "config_history.jsonl").read_text().splitlines()]
    assert [h["start_step"] for h in history] == [0, 5]
    assert history[1]["changed"] == {"train.steps": [5, 8], "train.lr": [3e-3, 1e-3], "train.log_every": [5, 1],
                                     "model.attention": ["auto", "xla"]}
    assert json.loads((out / "config.json").read_text())["train"]["lr"] == 1e-3


def test_a_second_writer_is_refused_naming_the_holder(run, capsys):
    before = _snapshot(run)
    with RunFolder(run).lock():
        capsys.readouterr()
        assert _train(run, steps=10) == 2
        _one_error_line(capsys, f"is in use by another boostjax run (PID {os.getpid()})")
    assert not (run / ".lock").exists()
    assert _snapshot(run) == before


def test_lock_is_exclusive_between_processes(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "f"
    code = ("import sys, time; from boostjax.runs.folder import RunFolder\n"
            "with RunFolder(sys.argv[1]).lock():\n    print('locked', flush=True); time.sleep(30)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        from boostjax.runs.folder import RunFolderBusy

        with pytest.raises(RunFolderBusy, match=f"PID {holder.pid}"):
            with RunFolder(folder).lock():
                pass
    finally:
        holder.kill()
        holder.wait()
    with RunFolder(folder).lock():  # a dead holder's lock is free again
        pass


def _hf_export(folder: pathlib.Path) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (folder / "model.safetensors").write_bytes(b"weights")


def test_writers_never_touch_another_artefacts_folder(run, tmp_path, capsys):
    hf = tmp_path / "hf"
    _hf_export(hf)
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("my notes")
    for folder, needle in ((hf, "holds an exported Hugging Face model"), (user, "holds files that are not a boostjax run")):
        before = _snapshot(folder)
        capsys.readouterr()
        assert _train(folder) == 2
        _one_error_line(capsys, needle)
        assert _snapshot(folder) == before
    before = _snapshot(run)
    for target, needle in ((run, "is a boostjax run folder"), (hf, "is not an earlier boostjax export"),
                           (user, "is not an earlier boostjax export")):
        capsys.readouterr()
        assert main(["export-hf", "--run", str(run), "--out", str(target)]) == 2
        _one_error_line(capsys, needle)
    assert _snapshot(run) == before and (user / "notes.txt").read_text() == "my notes"


def test_out_paths_that_cannot_hold_a_run(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for out, needle in ((a_file, "is a file, not a folder"), (a_file / "run", "lies under the file")):
        capsys.readouterr()
        assert _train(out) == 2
        _one_error_line(capsys, needle)
    assert a_file.read_text() == "x"
    ck_file = tmp_path / "ckfile"
    ck_file.mkdir()
    (ck_file / "checkpoints").write_text("not a folder")
    capsys.readouterr()
    assert _train(ck_file) == 2
    _one_error_line(capsys, "is a file, not a folder")


def test_unwritable_run_folder_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """Tests run as root, where permissions do not stop writes: the probe's failure is simulated."""
    real_mkdir = pathlib.Path.mkdir

    def no_write(self, *a, **kw):
        if self.name.startswith(".boostjax-probe"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "mkdir", no_write)
    out = tmp_path / "ro"
    capsys.readouterr()
    assert _train(out) == 2
    _one_error_line(capsys, "cannot write in ")
    assert not out.exists()


def test_damaged_run_files_name_the_file(run, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    (broken / "config.json").write_text((run / "config.json").read_text()[:40])
    capsys.readouterr()
    assert _train(broken, steps=10) == 2
    _one_error_line(capsys, f"{broken / 'config.json'}: the run configuration is not valid JSON")

    shutil.copyfile(run / "config.json", broken / "config.json")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (broken / "metrics.jsonl").write_text("\n".join(["{garbage", *lines]) + "\n")
    capsys.readouterr()
    assert _train(broken, steps=10) == 2
    _one_error_line(capsys, f"{broken / 'metrics.jsonl'}: line 1 is not a metrics record")

    # a record cut short at the end (a kill while appending) is dropped, and the run resumes
    (broken / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "lo')
    assert _train(broken, steps=10) == 0
    recs = [json.loads(x) for x in (broken / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "loss" in r) for r in recs] == [(5, True), (5, False), (10, True), (10, False)]
