"""Faults: signals and kills at several points of a run, damaged checkpoints, diverged runs. After each,
resuming reproduces the uninterrupted run's per-step losses bit for bit and nothing is lost.

The kill tests run `boostjax train` in a subprocess (a real signal to a real process) and share one
uninterrupted reference run; the corruption tests run in this process. The longer randomised
campaign is `experiments/faults/faults.py`.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import time
from dataclasses import replace

import jax
import numpy as np
import pytest
from flax import nnx

from boostjax.runs.checkpoint import ASIDE, MANIFEST, CheckpointError, Checkpointer
from boostjax.cli import main
from boostjax.config import Config, TrainConfig
from boostjax.runs.load import load_run, read_metrics
from boostjax.training.trainer import NonFiniteLoss, train
from helpers import MICRO, cli_command, cli_env, model_flags, one_error_line

pytestmark = pytest.mark.xdist_group("faults")  # one worker: the subprocess tests share a reference run

FLAGS = [*model_flags(MICRO), "--seq", "32", "--batch", "4", "--no-progress", "--log-every", "1", "--eval-every",
         "1000", "--ckpt-every", "10"]
# long enough (15 ms a step on a 2-core AMD EPYC, a few ms on faster machines) that a signal sent after
# 5 steps lands mid-run, with a checkpoint save every 10 steps for the kill to catch in flight
STEPS = 120


def _cmd(out, steps=STEPS):
    return cli_command("train", *FLAGS, "--steps", steps, "--out", out)


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(out) if "loss" in r}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jax-cache")  # later runs reuse the first one's compiled programs
    # its own cache: these processes are killed mid-run, the session's cache stays out of their way
    return cli_env(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
    out = tmp_path_factory.mktemp("faults") / "reference"
    subprocess.run(_cmd(out), env=env, check=True, capture_output=True)
    losses = _losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _wait_for(pred, proc, timeout=180.0, poll=0.002) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


def _records(out) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _resume_and_compare(out, env, reference) -> str:
    done = subprocess.run(_cmd(out), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _losses(out) == reference  # every step, bit for bit
    assert not list((out / "checkpoints").glob("*orbax-checkpoint-tmp*"))
    return done.stderr


def test_signal_saves_a_consistent_checkpoint_and_resume_is_exact(tmp_path, env, reference):
    """Ctrl-C (SIGINT), then a scheduler's SIGTERM while the checkpoint is written: the first signal
    decides (exit 130), the second changes nothing. (SIGTERM's own exit 143: the startup test below.)"""
    sig = signal.SIGINT
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert _wait_for(lambda: _records(out) >= 5, proc), "the run ended before the signal"
    proc.send_signal(sig)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"boostjax: stopped by {signal.Signals(sig).name} after step "), err
    stop = int(last.split("after step ")[1].split(";")[0])
    assert 5 <= stop < STEPS
    ck = Checkpointer(out / "checkpoints", writer=False)
    assert ck.latest_step() == stop and ck.verify(stop) == (None, True)  # saved, complete, checksummed
    ck.close()
    assert max(_losses(out)) <= stop  # nothing logged beyond the saved state
    _resume_and_compare(out, env, reference)


def test_a_signal_during_startup_is_one_line(tmp_path, env):
    """SIGTERM while the process still imports: recorded, acted on when the run starts (exit 143)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # not a fixed 1 s: on a loaded machine the interpreter had not reached `main` by then and SIGTERM's
    # default action killed it (-15). The signal goes once the process catches SIGTERM (its SigCgt mask),
    # which `main` arranges before the slow imports, so it still arrives during startup.
    status, deadline = pathlib.Path(f"/proc/{proc.pid}/status"), time.monotonic() + 60
    while status.exists() and time.monotonic() < deadline and proc.poll() is None:
        caught = [ln for ln in status.read_text().splitlines() if ln.startswith("SigCgt:")]
        if caught and int(caught[0].split()[1], 16) >> (signal.SIGTERM - 1) & 1:
            break
        time.sleep(0.01)
    else:
        time.sleep(1.0)  # no /proc: the old wait
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("boostjax: stopped by SIGTERM "), err


def test_sigkill_during_a_checkpoint_save_loses_nothing(tmp_path, env, reference):
    out = tmp_path / "run"
    ckdir = out / "checkpoints"

    def saving() -> bool:  # an Orbax temporary folder, or a committed step still without checksums
        try:
            names = [p.name for p in ckdir.iterdir()]
        except FileNotFoundError:
            return False
        return any("tmp" in n for n in names) or any(n.isdigit() and not (ckdir / n / MANIFEST).exists()
                                                     for n in names)

    proc = subprocess.Popen(_cmd(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    caught = _wait_for(saving, proc)
    proc.kill()
    proc.wait()
    assert caught, "no checkpoint save was caught in flight"
    _resume_and_compare(out, env, reference)


# ----------------------------------------------------------------------------- in-process faults

RUN = TrainConfig(steps=30, batch=4, seq=32, log_every=1, eval_every=1000, ckpt_every=10, progress=False)


def _train(out, **kw):
    return train(Config(MICRO, replace(RUN, out=str(out), **kw)))


def _trained(tmp_path_factory, steps: int):
    """One run of `steps` steps (checkpoints every 10) and its losses, trained once per module: each test
    damages its own copy (`_copy`), so the tests that share it stay independent."""
    out = tmp_path_factory.mktemp("faults") / f"run{steps}"
    return out, _losses(_train(out, steps=steps).out_dir)


@pytest.fixture(scope="module")
def run30(tmp_path_factory):
    return _trained(tmp_path_factory, 30)


@pytest.fixture(scope="module")
def run20(tmp_path_factory):
    return _trained(tmp_path_factory, 20)


def _copy(run, tmp_path, name: str = "run") -> tuple[pathlib.Path, dict[int, float]]:
    """A fresh copy of a fixture's run folder (its `train.out` differs: ignored on resume) and its losses."""
    src, losses = run
    shutil.copytree(src, tmp_path / name)
    return tmp_path / name, losses


def _largest_file(step_dir: pathlib.Path) -> pathlib.Path:
    return max((p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST), key=lambda p: p.stat().st_size)


def _flip(p):
    b = bytearray(p.read_bytes())
    mid = len(b) // 2
    b[mid:mid + 64] = bytes(x ^ 0xFF for x in b[mid:mid + 64])
    p.write_bytes(bytes(b))


CORRUPTIONS = {
    "flip 64 bytes": lambda d: _flip(_largest_file(d)),
    "truncate": lambda d: os.truncate(_largest_file(d), 7),
    "delete a blob": lambda d: _largest_file(d).unlink(),
    "remove the data item": lambda d: shutil.rmtree(d / "data"),
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_damaged_latest_checkpoint_falls_back_and_resumes_exactly(run30, tmp_path, capsys, how):
    out, reference = _copy(run30, tmp_path)
    CORRUPTIONS[how](out / "checkpoints" / "30")
    capsys.readouterr()
    res = _train(out)  # the same command again: steps 21..30 are recomputed
    assert res.resumed_from == 20
    err = capsys.readouterr().err
    assert "checkpoint 30" in err and "cannot be restored" in err and "resuming from step 20" in err
    assert (out / ASIDE / "30-damaged").is_dir()  # moved aside, not deleted
    assert _losses(out) == reference


def test_unverified_step_that_orbax_cannot_read_is_one_line(run20, tmp_path, capfd):
    """No SHA256SUMS (a kill before they were written) and a damaged blob: Orbax's failure is the
    one line, without TensorStore's late callbacks printing tracebacks."""
    out, reference = _copy(run20, tmp_path)
    step = out / "checkpoints" / "20"
    (step / MANIFEST).unlink()
    os.truncate(_largest_file(step), 7)
    capfd.readouterr()
    res = _train(out, steps=20)
    time.sleep(0.5)  # late callbacks, if any, would print by now
    err = capfd.readouterr().err
    assert res.resumed_from == 10 and _losses(out) == reference
    assert "Traceback" not in err and "Event loop is closed" not in err, err
    progress = ("boostjax: compiling the training step", "boostjax: step ")  # the run's own progress lines
    assert [line for line in err.splitlines() if line.strip() and not line.startswith(progress)] == [next(
        line for line in err.splitlines() if line.startswith("boostjax: checkpoint 20 "))]


def test_no_restorable_checkpoint_is_one_line_and_moves_nothing(run20, tmp_path, capsys):
    out, _ = _copy(run20, tmp_path)
    for s in ("10", "20"):
        _flip(_largest_file(out / "checkpoints" / s))
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    args = ["train", *FLAGS, "--steps", "30", "--out", str(out)]
    capsys.readouterr()
    assert main(args) == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("boostjax: error: checkpoints: no checkpoint in "), line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before and not (out / ASIDE).exists()


def test_readers_fall_back_without_changing_the_folder(run20, tmp_path, capsys):
    out, _ = _copy(run20, tmp_path, "dense")  # cola: load_run is the reader under test
    _flip(_largest_file(out / "checkpoints" / "20"))
    capsys.readouterr()
    _, _, step = load_run(out)
    assert step == 10
    assert "checkpoint 20" in capsys.readouterr().err
    assert (out / "checkpoints" / "20").is_dir() and not (out / ASIDE).exists()  # readers only read
    with pytest.raises(CheckpointError, match="no checkpoint 7"):
        load_run(out, step=7)


def test_leftovers_of_kills_are_cleaned_or_skipped(tmp_path):
    """What a kill can leave: an Orbax temporary folder (kill during the save), a committed step
    without checksums (kill before they were written), a half-deleted old step in `.trash/`."""
    out = tmp_path / "run"
    reference = _losses(_train(out, steps=40).out_dir)
    ck = out / "checkpoints"
    shutil.rmtree(ck / "40")
    shutil.copytree(ck / "30", ck / "40.orbax-checkpoint-tmp-1234")
    (ck / "30" / MANIFEST).unlink()
    shutil.copytree(ck / "20", ck / ".trash" / "20")
    _largest_file(ck / ".trash" / "20").unlink()
    res = _train(out, steps=40)
    assert res.resumed_from == 30  # complete, just unverified
    assert not (ck / ".trash").exists() and not list(ck.glob("*tmp*"))
    assert _losses(out) == reference


def test_non_finite_loss_keeps_only_checkpoints_whose_parameters_gave_a_finite_loss(tmp_path, capsys):
    out = tmp_path / "nan"
    with pytest.raises(NonFiniteLoss) as e:
        _train(out, lr=1e4, ckpt_every=3, steps=30)
    msg = str(e.value)
    step = int(msg.split(" at step ")[1].split(";")[0])
    assert "--clip 1.0" not in msg  # already set: never suggested
    assert f"checkpoint {step - 1}" in msg and (out / ASIDE / f"{step - 1}-nonfinite").is_dir()
    kept = Checkpointer(out / "checkpoints", writer=False).steps()
    assert all(s < step - 1 for s in kept)
    if kept:  # every kept checkpoint's parameters give a finite loss and gradient
        cfg, model, _ = load_run(out)
        batch = np.random.default_rng(0).integers(0, 256, (2, 33)).astype(np.int32)
        loss, grads = nnx.value_and_grad(lambda m: m.loss(batch[:, :-1], batch[:, 1:]))(model)
        assert np.isfinite(float(loss)) and all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    res = _train(out, lr=1e-3, steps=6, ckpt_every=3)  # a lower lr resumes from the last good one
    assert np.isfinite(res.losses).all()
    history = [json.loads(x) for x in (out / "config_history.jsonl").read_text().splitlines()]
    assert history[-1]["changed"]["train.lr"] == [1e4, 1e-3]
