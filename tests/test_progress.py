"""Progress and summaries that tell the truth: the bar counts finished steps, `--no-progress` logs a line
per metrics record, the phases before the first step say what they do and stop on a signal (a compile
included), and a resumed run's summary gives its own first loss and the step it resumed from."""

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import redirect_stderr
from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest

from boostjax.config import Config, ConfigError, TrainConfig
from boostjax.runs.load import read_metrics
from boostjax.runtime.interrupt import StopSignals, phase
from boostjax.runtime.signals import TrainingInterrupted
from boostjax.training.observe import IN_FLIGHT, FinishedSteps
from boostjax.training.trainer import train
from helpers import MICRO, cli_command, cli_env, model_flags

STOPPED = "stopped by SIGINT before the first step; nothing in {} changed; rerun the same command to train"


def test_finished_steps_counts_a_step_when_its_output_is_ready():
    """A dispatched step is not counted while it runs; once more than IN_FLIGHT run, the oldest are
    waited for; `wait(0)` counts them all."""

    @jax.jit
    def step(x):  # a few hundred ms on a CPU core: still running right after its dispatch
        return jax.lax.fori_loop(0, 60, lambda i, x: jnp.tanh(x @ x), x)

    x = jnp.ones((512, 512)) / 512
    step(x).block_until_ready()  # compiled
    counted: list[int] = []
    done = FinishedSteps(counted.append)
    outs = [step(x)]
    done.dispatched(outs[0])
    assert done.wait() == 0 and counted == []  # dispatched, not finished: the old bar counted it here
    for _ in range(IN_FLIGHT):
        outs.append(step(outs[-1]))
        done.dispatched(outs[-1])
    done.wait()
    assert len(done.running) <= IN_FLIGHT and outs[0].is_ready()
    assert sum(counted) + len(done.running) == len(outs)
    done.wait(0)
    assert sum(counted) == len(outs) and all(o.is_ready() for o in outs) and not done.running


def test_a_phase_returns_and_raises_as_a_call_and_says_what_it_does_once_it_lasts(capsys):
    """Outside a run a phase is a plain call; inside one it runs in a worker thread, says nothing when
    quick (a refusal stays one line) and its line and bar once it has run `after` seconds."""
    assert phase("x", lambda _: threading.current_thread()) is threading.main_thread()  # no run: inline
    with StopSignals(where="runs/x"):
        assert phase("quick", lambda _: threading.current_thread()) is not threading.main_thread()
        with pytest.raises(ConfigError, match="train.x: bad"):
            phase("failing", lambda _: (_ for _ in ()).throw(ConfigError("train.x: bad")))
        assert capsys.readouterr().err == ""

        def counting(progress):
            for _ in range(4):
                progress.update()
                time.sleep(0.1)
            return progress.n

        assert phase("lasting", counting, total=4, unit="matrix", after=0.05) == 4
    err = capsys.readouterr().err
    assert err.startswith("boostjax: lasting\n") and "/4 [" in err and "matrix/s" in err, err


def test_a_signal_stops_a_phase_whose_work_does_not_return(capsys):
    """SIGINT while a phase's work is blocked (as in an XLA compile, which holds its thread for its
    whole length): the run stops with the one line of a stop before the first step; work that checks
    in (`progress.update`) is cancelled and ends."""
    release = threading.Event()

    def blocked(progress):
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs on the main thread, which polls
        release.wait(30)  # (a phase run inline would return after 30 s, and the test fail)
        return "finished"

    def looping(progress):
        os.kill(os.getpid(), signal.SIGINT)
        while True:
            progress.update()
            release.wait(0.01)

    try:
        for work in (blocked, looping):
            with StopSignals(where="runs/x"), pytest.raises(TrainingInterrupted) as e:
                phase(f"working ({work.__name__})", work, total=10**9, after=0)
            assert str(e.value) == STOPPED.format("runs/x") and e.value.exit_code == 130
        worker = next(t for t in threading.enumerate() if t.name == "boostjax: working (looping)")
        worker.join(60)
        assert not worker.is_alive()  # cancelled by its next progress.update
    finally:
        release.set()
    assert "boostjax: working (blocked)" in capsys.readouterr().err


COMPILE_SCRIPT = """
import sys
import jax, jax.numpy as jnp
from boostjax.runtime.interrupt import StopSignals, phase
from boostjax.runtime.signals import TrainingInterrupted, defer_signals
defer_signals()
def f(x):
    for i in range(1000):
        x = jnp.sin(x @ x.T) + i
    return x
lowered = jax.jit(f).lower(jnp.ones((8, 8)))
try:
    with StopSignals(where="nowhere"):
        phase("compiling a long program", lambda _: lowered.compile())
    print("compiled")
except TrainingInterrupted as e:
    print(f"boostjax: {e}", file=sys.stderr)
    sys.exit(e.exit_code)
"""


def _signal_after(proc: subprocess.Popen, prefix: str, sig: int = signal.SIGINT) -> list[str]:
    """Read `proc`'s stderr up to the line starting with `prefix`, then send `sig`; the lines read."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith(prefix):
            proc.send_signal(sig)
            break
    return lines


def test_a_process_stopped_during_an_xla_compile_exits_with_the_signals_status():
    """The compile goes on in an abandoned thread: the process ends with status 130 and the one line,
    while it still compiles (no "compiled"), not with a C++ abort (134) when the interpreter exits."""
    env = cli_env(XLA_FLAGS="")  # XLA's full optimisation: a compile of several seconds
    proc = subprocess.Popen([sys.executable, "-c", COMPILE_SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    head = _signal_after(proc, "boostjax: compiling a long program")
    out, rest = proc.communicate(timeout=300)
    err = "".join(head) + rest
    assert proc.returncode == 130, err
    assert err.splitlines() == ["boostjax: compiling a long program", "boostjax: " + STOPPED.format("nowhere")], err
    assert "compiled" not in out


def test_ctrl_c_while_train_compiles_stops_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    cmd = cli_command("train", *model_flags(MICRO), "--strategy", "btp", "--mesh", "data=2,model=2", "--seq", "32",
                      "--batch", "4", "--steps", "5", "--no-progress", "--out", out)
    proc = subprocess.Popen(cmd, env=cli_env(JAX_ENABLE_COMPILATION_CACHE="false"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    head = _signal_after(proc, "boostjax: compiling the training step (cola btp, mesh data=2,model=2)")
    _, rest = proc.communicate(timeout=300)
    err = "".join(head) + rest
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch("boostjax: " + STOPPED.format(r"\S+"), last), err
    assert "Traceback" not in err and "terminate" not in err
    assert not out.exists()  # nothing written: the new run folder is removed with its lock


RUN = TrainConfig(steps=6, batch=2, seq=16, log_every=1, eval_every=1000, ckpt_every=3, progress=False)


def test_a_resumed_run_reports_its_own_first_loss_and_logs_plain_lines(tmp_path):
    """Stopped by SIGINT after step 3 and rerun: the summary says `steps 3->6 (resumed from 3)` and the
    loss of step 4 (not step 1's, which the earlier invocation logged); without progress bars every
    metrics record is one line on stderr."""
    cfg = Config(MICRO, replace(RUN, out=str(tmp_path / "run")))

    def stop_at_3(record):
        if record.get("step") == 3 and "loss" in record:
            os.kill(os.getpid(), signal.SIGINT)

    with redirect_stderr(io.StringIO()), pytest.raises(TrainingInterrupted) as e:
        train(cfg, on_log=stop_at_3)
    assert e.value.step == 3
    err = io.StringIO()
    with redirect_stderr(err):
        res = train(cfg)
    loss = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r}
    assert sorted(loss) == [1, 2, 3, 4, 5, 6]
    assert f"{loss[1]:.3f}" != f"{loss[4]:.3f}"  # the first loss of the earlier invocation would show
    assert f", steps 3->6 (resumed from 3), loss {loss[4]:.3f} -> {loss[6]:.3f} (val " in res.summary, res.summary
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("boostjax: step ")]
    pattern = r"boostjax: step (\d)/6, loss (\S+), \d+ tokens/s, elapsed \d\d:\d\d"
    assert [re.fullmatch(pattern, ln).groups() for ln in lines] == [(str(s), f"{loss[s]:.4f}") for s in (4, 5, 6)]
