"""The fault campaign's processes: one start of the training command (`Attempt`), its stderr sorted
into boostjax's known lines and the rest, the uninterrupted reference run, and a helper process that
lists the arrays two checkpoints restore differently."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Callable

from experiments import common
from experiments.faults.folder import history_start, loss_records, read_records
from experiments.faults.plan import Settings

ROOT = common.ROOT

NONFINITE = re.compile(r"^boostjax: non-finite loss \S+ \(grad norm \S+\) at step (\d+); stopped; .*$")  # probes only

# Every stderr line boostjax may print in this campaign; anything else is reported.
KNOWN_LINES = {
    "stopped": re.compile(r"^boostjax: stopped by (SIGINT|SIGTERM) (?:after step (\d+); (?:checkpoint (\d+) is in \S+|"
                          r"no checkpoint was written yet); resume with the same command \(--out \S+\)|"
                          r"before the first step; nothing in \S+ changed; rerun the same command to train)$"),
    "again": re.compile(r"^boostjax: (SIGINT|SIGTERM) again: .*; wait for it \(SIGKILL would lose only this save, "
                        r"the previous checkpoint stays intact\)$"),
    "damaged": re.compile(r"^boostjax: checkpoint (\d+) in \S+ cannot be restored \((.*)\); moved to (\S+); "
                          r"resuming from step (\d+)$"),
    "unverified": re.compile(r"^boostjax: checkpoint (\d+) has no checksums \(.*\); restored without verification$"),
    # the run's progress under --no-progress: the compile, a phase that lasts, one line per metrics record
    "progress": re.compile(r"^boostjax: (compiling the training step .*|restoring checkpoint \d+ from .*|"
                           r"step \d+/\d+, loss \S+, \d+ tokens/s, elapsed [\d:]+)$"),
}


# ------------------------------------------------------------------------------------ processes


def subprocess_env(cache: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI sets the device count itself
    env.update({"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
    return env


class Attempt:
    """One start of the training command, its stdout/stderr in files under `logs`."""

    def __init__(self, cmd: list[str], env: dict, folder: pathlib.Path, logs: pathlib.Path, name: str):
        self.folder, self.name = folder, name
        self.err_path, self.out_path = logs / f"{name}.err", logs / f"{name}.out"
        self.t0 = time.monotonic()
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=ROOT)
        self.start_step: int | None = None
        self.first_record_s: float | None = None
        self._last_tick = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def poll_start(self) -> int | None:
        """The step this start resumed from, once it has restored (its config_history line)."""
        if self.start_step is None:
            self.start_step = history_start(self.folder, self.proc.pid)
        return self.start_step

    def new_steps(self) -> int:
        """Loss records this process wrote (steps past its start)."""
        start = self.poll_start()
        if start is None:
            return 0
        n = sum(1 for r in loss_records(read_records(self.folder)) if r["step"] > start)
        if n and self.first_record_s is None:
            self.first_record_s = round(self.elapsed(), 3)
        return n

    def tick(self) -> None:
        """Every 20 ms: look for the first new record (the restart's time to its first step)."""
        now = time.monotonic()
        if self.first_record_s is None and now - self._last_tick > 0.02:
            self._last_tick = now
            self.new_steps()

    def wait_until(self, pred: Callable[[], bool], timeout: float, poll: float = 0.01) -> str:
        """'fired', 'exited' or 'timeout'."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.tick()
            if pred():
                return "fired"
            if self.proc.poll() is not None:
                return "exited"
            time.sleep(poll)
        return "timeout"

    def finish(self, timeout: float) -> tuple[int | None, bool]:
        """(exit status, hung): waits; a process still alive after `timeout` is killed and reported."""
        try:
            return self.proc.wait(timeout=timeout), False
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(), True

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")


def traceback_summary(text: str) -> str:
    """'<exception line>; innermost boostjax frame ...; innermost frame ...' of the last traceback in `text`."""
    tb = text[text.rfind("Traceback (most recent call last)"):].splitlines()
    frames = [ln.strip() for ln in tb if ln.strip().startswith("File ")]
    ours = [f for f in frames if "/boostjax/" in f]
    last = next((ln.strip() for ln in tb[1:] if ln.strip() and not ln.startswith(" ")), "?")  # the exception line
    where = f"; innermost boostjax frame: {ours[-1]}" if ours else ""
    return f"{last}{where}; innermost frame: {frames[-1] if frames else '?'} ({len(frames)} frames)"


def classify_stderr(text: str) -> dict:
    """Known boostjax lines by kind, and everything else (a traceback is reported apart)."""
    known: dict[str, list[str]] = {k: [] for k in KNOWN_LINES}
    other = []
    for line in text.splitlines():
        if not line.strip():
            continue
        kind = next((k for k, rx in KNOWN_LINES.items() if rx.match(line)), None)
        (known[kind] if kind else other).append(line)
    return {"known": {k: v for k, v in known.items() if v}, "other": other[:40], "n_other": len(other),
            "traceback": "Traceback (most recent call last)" in text}



LEAF_DIFF = r"""
import json, pathlib, sys
import jax, numpy as np, orbax.checkpoint as ocp
def read(root, step):
    mgr = ocp.CheckpointManager(pathlib.Path(root), options=ocp.CheckpointManagerOptions(create=False))
    try:
        out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    finally:
        mgr.close()
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(out["state"])[0]}
a = read(sys.argv[1], int(sys.argv[3]))
try:
    b = read(sys.argv[2], int(sys.argv[3]))
except Exception as e:
    print(json.dumps({"read_error": f"{e.__class__.__name__}: {str(e).splitlines()[0][:200]}"}))
    sys.exit(0)
diff = []
for k in a:
    x, y = a[k], b[k]
    if x.tobytes() != y.tobytes():
        d = np.abs(x.astype(np.float64) - y.astype(np.float64))
        rows = sorted({int(i) for i in np.nonzero(x != y)[0]}) if x.ndim else []
        diff.append({"leaf": k, "shape": list(x.shape), "values_changed": int((x != y).sum()), "rows": rows[:32],
                     "max_abs_change": float(np.nanmax(d)) if np.isfinite(d).any() else None})
print(json.dumps({"leaves": len(a), "changed": diff}))
"""


def leaf_diff(a: pathlib.Path, b: pathlib.Path, step: int, env: dict) -> dict:
    """Which restored values differ between checkpoint `step` of two checkpoint folders (a subprocess
    with the 4 devices the checkpoint's shardings name)."""
    env = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    p = subprocess.run([sys.executable, "-c", LEAF_DIFF, str(a), str(b), str(step)], env=env, capture_output=True,
                       text=True, timeout=300)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"helper_failed": p.stderr[-500:]}



# ---------------------------------------------------------------------------------- reference


def run_reference(s: Settings, scratch: pathlib.Path, env: dict) -> dict:
    folder = scratch / "reference"
    a = Attempt(s.command(folder), env, folder, scratch / "logs", "reference")
    a.wait_until(lambda: a.new_steps() > 0, s.timeout_s * 3)
    rc, hung = a.finish(s.timeout_s * 3)
    recs = read_records(folder)
    losses = loss_records(recs)
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    steps = [r["step"] for r in losses]
    if rc != 0 or hung or steps != list(range(1, s.steps + 1)):
        raise RuntimeError(f"faults: the reference run failed (exit {rc}, {len(steps)} loss records); "
                           f"stderr: {a.stderr()[-1500:]}")
    return {"wall_s": round(a.elapsed(), 2), "first_record_s": a.first_record_s, "steps": len(steps),
            "first_loss": losses[0]["loss"], "final_loss": losses[-1]["loss"], "val_loss": val[-1] if val else None,
            "records": {r["step"]: r for r in losses}, "stderr": a.stderr()[-2000:]}
