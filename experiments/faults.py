"""Fault campaign: random kills, stop signals and damaged checkpoints against `boostjax train` on a
simulated 2x2 mesh (`--strategy btp --mesh data=2,model=2`, a tiny CoLA model). Every run that is
interrupted and resumed must end with the uninterrupted run's per-step losses, bit for bit.

1. Reference: the training command runs once, uninterrupted, in a fresh run folder; its
   metrics.jsonl gives the per-step loss (and grad norm, lr, final val loss) records.
2. Campaign runs: the same command in a fresh run folder, then, over and over: wait (a random time
   after the start, a random number of newly logged steps, or until a checkpoint save is in flight:
   an `*orbax-checkpoint-tmp*` folder or a step folder without SHA256SUMS), send SIGKILL, SIGINT or
   SIGTERM (SIGINT/SIGTERM sometimes twice), check the exit status (-9 / 130 / 143, or 0 when the
   run had already finished) and stderr, check the folder, maybe damage the newest checkpoint, and
   start the same command again, until the run finishes. The schedule (signals, triggers, damage
   kinds and the choice of files) is drawn from `--seed`; where a fault lands depends on timing.
3. Damage to the newest checkpoint (when it has SHA256SUMS and an older step exists): flip 64 bytes
   in the middle of its largest file, truncate a random file, delete a random file, delete its
   `data/` item. The next start must name it in one stderr line, move it to checkpoints-aside/ and
   resume from the next older step. "Delete SHA256SUMS and flip 64 bytes" is applied to a copy of
   the run folder (a *probe*): such a step is restored unverified by design, so the probe records
   what happened (which restored values changed, whether the losses still match) apart from the
   campaign's counts.
4. Checks after every stop: metrics.jsonl holds steps 1..k once each, every record identical to
   the reference; every checkpoint with SHA256SUMS verifies (hashed here, independently of
   boostjax); no checkpoint vanished except by pruning (`--keep-ckpts`) or being moved aside;
   nothing was moved aside that the campaign did not damage; Orbax temporary folders left by a kill
   are gone once the next start has begun a save. At the end of each campaign run the final
   metrics.jsonl is compared with the reference (every step 1..N exactly once, bit-identical), and so
   is its last checkpoint (every parameter and optimizer-state array, restored by Orbax in a helper
   process). A SIGINT/SIGTERM must give 130/143, or 0 only if the run was at its last steps.

    python experiments/faults.py                # full: 50 signals, 14 damaged checkpoints (5-8 min on 2 busy cores)
    python experiments/faults.py --quick        # smoke: 2 signals, 1 damaged checkpoint (30-50 s)
    python experiments/faults.py --from-json experiments/results/faults.json   # re-render faults.md only
Writes <out>/faults.json (settings, counts, every event) and faults.md (default out: experiments/results).
The run folders, logs and JAX compilation cache go to --scratch (default: a new temporary folder,
removed at the end unless --keep-scratch).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}
EXIT = {"SIGKILL": -9, "SIGINT": 130, "SIGTERM": 143}
IN_PLACE = ("flip", "truncate", "delete-file", "delete-data")  # damage the campaign run's newest checkpoint
PROBE = "nosums-flip"  # delete SHA256SUMS and flip: applied to a copy of the run folder
DAMAGE_KINDS = (*IN_PLACE, PROBE)
MANIFEST, TMP, ASIDE = "SHA256SUMS", "orbax-checkpoint-tmp", "checkpoints-aside"

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
}

EXPLAIN = {  # anomaly kind -> what it means (printed under the anomalies that occurred)
    "unexpected exit status": "A signal whose exit status was not the promised one (-9 after SIGKILL, 130 after "
        "SIGINT, 143 after SIGTERM, 0 only when the run had finished).",
    "traceback": "A Python traceback on stderr (its exception line and innermost frames are shown).",
    "signal lost": "A SIGINT/SIGTERM that changed nothing: the run did not stop, trained to the last step and exited 0 "
        "(and exit 0 was not a race with the end of the run: it had not logged step N - 2 when the signal was sent).",
    "temporary folders not cleaned": "An Orbax temporary folder a kill left (the same folder: inode and ctime) was "
        "still in checkpoints/ after the next start had begun a save (Orbax removes such folders in a background "
        "thread that it joins before its first save).",
    "unexpected stderr": "A stderr line that is none of boostjax's stop, 'again', damaged-checkpoint or "
        "no-checksums lines.",
}

FAULT_EXERCISES = {  # what each kind of fault exercises (for the report)
    "SIGKILL": "no clean-up at all: the previous committed checkpoint must be intact, Orbax temporary folders and "
               "metrics records past the checkpoint are dropped on the next start",
    "SIGINT": "Ctrl-C: stop after the current step, save a checkpoint whose parameters, optimizer state and data "
              "position agree, exit 130 with one line",
    "SIGTERM": "what SLURM / Kubernetes send first: same as SIGINT, exit 143",
    "double signal": "a second SIGINT/SIGTERM 0-0.3 s after the first, usually while the final checkpoint is written: "
                     "must change nothing (one extra 'again' line)",
    "kill during save": "any signal while an asynchronous save is in flight (an *orbax-checkpoint-tmp* folder, or a "
                        "committed step whose SHA256SUMS is not written yet)",
    "flip": "64 bytes inverted in the middle of the newest checkpoint's largest file (silent bit rot): only the "
            "checksums can see it",
    "truncate": "a random file of the newest checkpoint cut to a random shorter length (a partial copy)",
    "delete-file": "a random file of the newest checkpoint deleted",
    "delete-data": "the newest checkpoint's data/ item (the data iterator position) deleted",
    PROBE: "SHA256SUMS deleted and 64 bytes flipped (a copy of the run folder): the step is restored unverified "
           "by design; the probe records what the restore did",
}


@dataclass(frozen=True)
class Settings:
    seed: int = 0
    kills: int = 50  # signals sent (SIGKILL, SIGINT or SIGTERM), at least
    corruptions: int = 14  # damaged checkpoints, at least (each kind >= 2 with the default)
    runs: int = 5  # campaign runs the signals are spread over (more are started if the counts are not reached)
    steps: int = 300
    ckpt_every: int = 10
    keep: int = 3
    model: tuple[str, ...] = ("--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--d-ff", "64", "--rank", "8",
                              "--seq", "32", "--batch", "4")
    signal_weights: tuple[float, float, float] = (0.5, 0.25, 0.25)  # SIGKILL, SIGINT, SIGTERM
    p_double: float = 0.35  # SIGINT/SIGTERM sent twice
    trigger_weights: tuple[float, float, float] = (0.25, 0.45, 0.30)  # time, steps, save
    max_wait_s: float = 12.0  # time trigger: uniform(0.2, max_wait_s) s after the start
    max_wait_steps: int = 40  # steps trigger: 1..max_wait_steps newly logged steps
    max_skip_saves: int = 2  # save trigger: let 0..max_skip_saves saves pass, signal during the next
    timeout_s: float = 300.0  # a process that neither stops nor finishes within this is a hang
    compare_state: bool = True  # also compare each finished run's last checkpoint (all 77 arrays) with the reference's

    def command(self, out: pathlib.Path) -> list[str]:
        return [sys.executable, "-m", "boostjax.cli", "train", "--strategy", "btp", "--mesh", "data=2,model=2",
                *self.model, "--log-every", "1", "--eval-every", "1000", "--no-progress", "--steps", str(self.steps),
                "--ckpt-every", str(self.ckpt_every), "--keep-ckpts", str(self.keep), "--out", str(out)]


QUICK = Settings(kills=2, corruptions=1, runs=1, steps=40, ckpt_every=5, trigger_weights=(0.0, 0.6, 0.4),
                 max_wait_steps=8, max_skip_saves=1, timeout_s=120.0, compare_state=False)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------- run folder


def read_records(folder: pathlib.Path) -> list[dict]:
    """metrics.jsonl records; a last line cut short by a kill is skipped."""
    try:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except ValueError:
            if i != len(lines) - 1:
                raise
    return out


def loss_records(records: list[dict]) -> list[dict]:
    return [r for r in records if "loss" in r]


def history_start(folder: pathlib.Path, pid: int) -> int | None:
    """The step the process `pid` started from (its config_history.jsonl line), None before it got there."""
    try:
        lines = (folder / "config_history.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("pid") == pid:
            return rec["start_step"]
    return None


def checkpoints(folder: pathlib.Path) -> dict[int, bool]:
    """{step: has SHA256SUMS} of the committed steps."""
    ck = folder / "checkpoints"
    try:
        names = os.listdir(ck)
    except FileNotFoundError:
        return {}
    return {int(n): os.path.exists(ck / n / MANIFEST) for n in names if n.isdigit()}


def leftovers(folder: pathlib.Path) -> dict[str, tuple[int, int]]:
    """Orbax temporary folders and the trash folder a kill can leave in checkpoints/, with their identity
    (inode, ctime): a later save of the same step makes a new folder of the same name."""
    ck = folder / "checkpoints"
    out = {}
    try:
        for n in os.listdir(ck):
            if TMP in n or n == ".trash":
                st = os.stat(ck / n)
                out[n] = (st.st_ino, st.st_ctime_ns)
    except FileNotFoundError:
        pass
    return out


def aside(folder: pathlib.Path) -> list[str]:
    try:
        return sorted(os.listdir(folder / ASIDE))
    except FileNotFoundError:
        return []


def saves_in_flight(folder: pathlib.Path, ignore: set[str]) -> set[int]:
    """Steps being saved: an Orbax temporary folder, or a committed step without SHA256SUMS yet."""
    ck = folder / "checkpoints"
    try:
        names = os.listdir(ck)
    except FileNotFoundError:
        return set()
    out = set()
    for n in names:
        if n in ignore:
            continue
        if TMP in n and n.split(".")[0].isdigit():
            out.add(int(n.split(".")[0]))
        elif n.isdigit() and not os.path.exists(ck / n / MANIFEST):
            out.add(int(n))
    return out


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify(step_dir: pathlib.Path) -> str | None:
    """Why `step_dir` does not match its SHA256SUMS (None if it does); hashed here, not by boostjax."""
    try:
        entries = [line.split("  ", 1) for line in (step_dir / MANIFEST).read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return "no SHA256SUMS"
    listed = {rel for _, rel in entries}
    on_disk = {p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST}
    if on_disk - listed:
        return f"files not in SHA256SUMS: {sorted(on_disk - listed)[:3]}"
    for digest, rel in entries:
        p = step_dir / rel
        if not p.is_file():
            return f"{rel}: missing"
        if _sha256(p) != digest:
            return f"{rel}: checksum mismatch"
    return None


# ------------------------------------------------------------------------------------- damage


def _files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def _flip(p: pathlib.Path) -> int:
    """Invert 64 bytes in the middle of `p`; returns the offset."""
    b = bytearray(p.read_bytes())
    mid = max(0, len(b) // 2 - 32)
    b[mid:mid + 64] = bytes(x ^ 0xFF for x in b[mid:mid + 64])
    p.write_bytes(bytes(b))
    return mid


def damage(step_dir: pathlib.Path, kind: str, rng: np.random.Generator) -> str:
    """Damage one checkpoint in place; returns what was done."""
    rel = lambda p: p.relative_to(step_dir).as_posix()  # noqa: E731
    if kind in ("flip", PROBE):
        if kind == PROBE:
            (step_dir / MANIFEST).unlink(missing_ok=True)
        largest = max(_files(step_dir), key=lambda p: p.stat().st_size)
        size = largest.stat().st_size
        mid = _flip(largest)
        return f"{'deleted SHA256SUMS; ' if kind == PROBE else ''}inverted bytes {mid}..{mid + 64} of {rel(largest)} ({size} B)"
    if kind == "truncate":
        files = [p for p in _files(step_dir) if p.stat().st_size > 0]
        p = files[rng.integers(len(files))]
        size = p.stat().st_size
        new = int(rng.integers(0, size))
        os.truncate(p, new)
        return f"truncated {rel(p)} from {size} to {new} B"
    if kind == "delete-file":
        files = _files(step_dir)
        p = files[rng.integers(len(files))]
        p.unlink()
        return f"deleted {rel(p)}"
    if kind == "delete-data":
        shutil.rmtree(step_dir / "data")
        return "deleted data/"
    raise ValueError(kind)


# -------------------------------------------------------------------------------------- plan


def draw_fault(rng: np.random.Generator, s: Settings) -> dict:
    """One signal fault: which signal(s), and when (the schedule, drawn from the seed)."""
    sig = ("SIGKILL", "SIGINT", "SIGTERM")[rng.choice(3, p=np.asarray(s.signal_weights) / sum(s.signal_weights))]
    double = sig != "SIGKILL" and bool(rng.random() < s.p_double)
    trig = ("time", "steps", "save")[rng.choice(3, p=np.asarray(s.trigger_weights) / sum(s.trigger_weights))]
    param: float | int = {"time": lambda: round(float(rng.uniform(0.2, s.max_wait_s)), 3),
                          "steps": lambda: int(rng.integers(1, s.max_wait_steps + 1)),
                          "save": lambda: int(rng.integers(0, s.max_skip_saves + 1))}[trig]()
    return {"signal": sig, "double": double, "second_after_s": round(float(rng.uniform(0.0, 0.3)), 3),
            "trigger": trig, "param": param}


def draw_damage_kinds(rng: np.random.Generator, n: int) -> list[str]:
    """n damage kinds: every kind n // 5 times when n >= 5 (the rest from the in-place kinds), shuffled."""
    per = n // len(DAMAGE_KINDS)
    kinds = [k for k in DAMAGE_KINDS for _ in range(per)]
    kinds += [IN_PLACE[i] for i in rng.integers(0, len(IN_PLACE), n - len(kinds))]
    return [kinds[i] for i in rng.permutation(len(kinds))]


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


# ------------------------------------------------------------------------------------ checks


def same(a: float, b: float) -> bool:
    """Bit-identical (both parsed from the JSON the runs wrote)."""
    return struct.pack("<d", a) == struct.pack("<d", b)


def compare(records: list[dict], ref: dict[int, dict], complete: bool) -> dict:
    """Loss records against the reference: missing steps (all of 1..N when `complete`, else 1..last),
    duplicates, extra steps and steps whose loss / grad norm / lr differ."""
    steps = [r["step"] for r in records]
    seen = set(steps)
    last = max(ref) if complete else (max(steps) if steps else 0)
    different = [r["step"] for r in records if r["step"] in ref and not all(
        same(r[k], ref[r["step"]][k]) for k in ("loss", "grad_norm", "lr"))]
    return {"records": len(records), "missing": [s for s in range(1, last + 1) if s not in seen][:50],
            "duplicates": sorted({s for s in steps if steps.count(s) > 1})[:50],
            "extra": sorted(seen - set(ref))[:50], "different": different[:50], "n_different": len(different)}


def compare_ok(c: dict) -> bool:
    return not (c["missing"] or c["duplicates"] or c["extra"] or c["n_different"])


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


# ---------------------------------------------------------------------------------- campaign


@dataclass
class Campaign:
    """State shared by the campaign runs: the plan, the reference and everything that happened."""

    s: Settings
    scratch: pathlib.Path
    env: dict
    ref: dict
    fault_rng: np.random.Generator  # the k-th signal fault is fixed by the seed
    damage_rng: np.random.Generator  # so are the k-th damage decision and the files damaged
    damage_plan: list[str]
    events: list[dict] = field(default_factory=list)
    probes: list[dict] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    anomalies: list[dict] = field(default_factory=list)
    signals_sent: int = 0
    damage_done: int = 0

    def anomaly(self, kind: str, where: str, detail: str) -> None:
        self.anomalies.append({"kind": kind, "where": where, "detail": detail[:3000]})
        _log(f"ANOMALY {kind} at {where}: {detail[:300]}")


def fire_trigger(a: Attempt, fault: dict, ignore_saves: set[str], timeout: float) -> dict:
    """Wait for the fault's moment; returns what happened ('fired', 'exited', 'timeout') and when."""
    t_from = time.monotonic()
    if fault["trigger"] == "time":
        res = a.wait_until(lambda: time.monotonic() - t_from >= fault["param"], timeout)
    elif fault["trigger"] == "steps":
        res = a.wait_until(lambda: a.new_steps() >= fault["param"], timeout)
    else:
        seen: set[int] = set()

        def caught() -> bool:
            seen.update(saves_in_flight(a.folder, ignore_saves))
            return len(seen) > fault["param"]

        res = a.wait_until(caught, timeout, poll=0.001)
    return {"result": res, "at_s": round(a.elapsed(), 3)}


def send(c: Campaign, a: Attempt, fault: dict, ignore_saves: set[str]) -> dict:
    """Send the fault's signal (twice for a double), noting what was in flight; returns the record."""
    in_flight = sorted(saves_in_flight(a.folder, ignore_saves))
    logged = loss_records(read_records(a.folder))
    restored = a.poll_start() is not None
    sent = []
    if a.proc.poll() is None:
        a.proc.send_signal(SIGNALS[fault["signal"]])
        t_sig = time.monotonic()
        sent.append(fault["signal"])
        c.signals_sent += 1
        if fault["double"]:
            time.sleep(fault["second_after_s"])
            if a.proc.poll() is None:
                a.proc.send_signal(SIGNALS[fault["signal"]])
                sent.append(fault["signal"])
    else:
        t_sig = time.monotonic()
    return {"sent": sent, "at_s": round(t_sig - a.t0, 3), "save_in_flight": in_flight, "restored": restored,
            "last_logged_step": logged[-1]["step"] if logged else 0, "t_sig": t_sig}


def check_stop(c: Campaign, a: Attempt, fault: dict, sig: dict, rc: int | None, where: str) -> dict:
    """The exit status and the stop message against what the signal promises."""
    err = classify_stderr(a.stderr())
    finished = rc == 0 and bool(re.match(r"^done: ", a.stdout()))
    first = sig["sent"][0] if sig["sent"] else None
    # 0 after a signal only when the run was (almost) done when it was sent: one step may still finish
    done_at_signal = sig.get("last_logged_step", 0) >= c.s.steps - 2
    expected = ({EXIT[first], 0} if done_at_signal else {EXIT[first]}) if first else {0}
    out = {"rc": rc, "finished": finished, "stderr": err, "expected_rc": sorted(expected)}
    if rc not in expected:
        phase = ("before the start had restored (startup)" if not sig.get("restored") and a.start_step is None else
                 "before the start had restored (startup; it restored later)" if not sig.get("restored") else
                 "after the last step" if done_at_signal else "during training")
        out["phase"] = phase
        if rc == 0:
            out["signal_lost"] = True
            c.anomaly("signal lost", where, f"{first} sent {sig['at_s']:.2f} s after the start, {phase}, changed "
                                            f"nothing: the run trained on from step {sig.get('last_logged_step')} to "
                                            f"{c.s.steps} and exited 0")
        else:
            c.anomaly("unexpected exit status", where, f"{first} sent {sig['at_s']:.2f} s after the start gave exit "
                                                        f"{rc} (expected {' or '.join(map(str, sorted(expected)))}), {phase}")
    if rc not in expected or err["traceback"] or err["n_other"]:
        out["stderr_tail"] = a.stderr()[-4000:]
    if err["traceback"]:
        c.anomaly("traceback", where, traceback_summary(a.stderr()))
    elif err["n_other"]:
        c.anomaly("unexpected stderr", where, "\n".join(err["other"]))
    if first in ("SIGINT", "SIGTERM") and rc == EXIT[first]:
        stopped = err["known"].get("stopped", [])
        m = KNOWN_LINES["stopped"].match(stopped[-1]) if stopped else None
        lines = [x for x in a.stderr().splitlines() if x.startswith("boostjax: ")]  # others are reported apart
        if not m or lines[-1] != stopped[-1] or m.group(1) != first or len(stopped) != 1:
            c.anomaly("stop message", where, f"expected one last line 'boostjax: stopped by {first} after step N; ...'; "
                                             f"stderr: {a.stderr()[-1500:]}")
        elif m.group(2) is None:  # a signal during the imports: acted on before anything was written
            out["stopped_before_first_step"] = True
        else:
            n = int(m.group(2))
            out["stopped_after"] = n
            cks = checkpoints(a.folder)
            logged = loss_records(read_records(a.folder))
            problems = []
            if n > 0 and (not cks or max(cks) != n):
                problems.append(f"newest checkpoint is {max(cks) if cks else None}, not {n}")
            elif n > 0 and verify(a.folder / "checkpoints" / str(n)) is not None:
                problems.append(f"checkpoint {n} does not verify: {verify(a.folder / 'checkpoints' / str(n))}")
            if logged and logged[-1]["step"] > n:
                problems.append(f"records logged up to step {logged[-1]['step']}, past the saved step {n}")
            if problems:
                c.anomaly("stop state", where, "; ".join(problems))
        out["again_lines"] = len(err["known"].get("again", []))
    return out


def check_folder(c: Campaign, folder: pathlib.Path, before: dict[int, bool], damaged: set[str], where: str) -> dict:
    """After a stop: records so far identical to the reference, checksummed steps verify, nothing
    vanished except by pruning or being moved aside, nothing moved aside that the campaign did not damage."""
    recs = loss_records(read_records(folder))
    cmp = compare(recs, c.ref["records"], complete=False)
    if cmp["n_different"] or cmp["extra"]:
        c.anomaly("records differ from the reference", where, json.dumps(cmp))
    if cmp["missing"] or cmp["duplicates"]:
        c.anomaly("records missing or duplicated", where, json.dumps(cmp))
    now = checkpoints(folder)
    bad = {st: verify(folder / "checkpoints" / str(st)) for st, has in now.items() if has}
    bad = {st: why for st, why in bad.items() if why}
    if bad:
        c.anomaly("checksummed checkpoint does not verify", where, json.dumps(bad))
    gone = [st for st in before if st not in now and sum(1 for x in now if x > st) < c.s.keep
            and not any(n.split("-")[0] == str(st) for n in aside(folder))]
    if gone:
        c.anomaly("checkpoint deleted", where, f"steps {gone} vanished (before {sorted(before)}, now {sorted(now)})")
    wrongly_aside = sorted(set(aside(folder)) - damaged)
    if wrongly_aside:
        c.anomaly("intact checkpoint set aside", where, f"{wrongly_aside} in {ASIDE}/, not damaged by the campaign")
    return {"records_ok": compare_ok(cmp), "compare": cmp, "checkpoints": {str(k): v for k, v in sorted(now.items())},
            "unverifiable": {str(k): v for k, v in bad.items()}, "deleted": gone, "aside": aside(folder),
            "wrongly_aside": wrongly_aside}


def check_damage_report(c: Campaign, a: Attempt, pending: dict, where: str) -> dict | None:
    """Once the start after a damage has restored: one line naming the step, moved aside, resumed
    from the next older step. None while that start has not got that far (checked at the next one)."""
    start = a.poll_start()
    if start is None:
        return None
    lines = [ln for ln in classify_stderr(a.stderr())["known"].get("damaged", [])
             if KNOWN_LINES["damaged"].match(ln).group(1) == str(pending["step"])]
    res = {"step": pending["step"], "resumed_from": start, "expected_from": pending["expect_from"], "lines": lines}
    problems = []
    if len(lines) != 1:
        problems.append(f"{len(lines)} stderr lines name checkpoint {pending['step']} (expected 1)")
    else:
        m = KNOWN_LINES["damaged"].match(lines[0])
        moved = pathlib.Path(m.group(3))
        res["moved_to"], res["why"] = str(moved), m.group(2)
        if moved.parent.resolve() != (a.folder / ASIDE).resolve():
            problems.append(f"moved to {moved}, not into {ASIDE}/")
        elif not moved.is_dir() or not moved.name.startswith(f"{pending['step']}-damaged"):
            problems.append(f"{moved} is not a folder named {pending['step']}-damaged*")
        elif verify(moved) is None:
            problems.append(f"{moved} verifies: not the damaged copy")
        if int(m.group(4)) != start:
            problems.append(f"the line says resuming from {m.group(4)}, the run started from {start}")
    if start != pending["expect_from"]:
        problems.append(f"resumed from step {start}, expected {pending['expect_from']} (the newest older step)")
    res["ok"] = not problems
    if problems:
        c.anomaly("damaged checkpoint not handled", where, "; ".join(problems))
    return res


def maybe_damage(c: Campaign, folder: pathlib.Path, remaining_faults: int, where: str) -> dict | None:
    """After a stop: damage the newest checkpoint with probability (damage left / faults left) when it
    is eligible (it has SHA256SUMS, or for the probe kind at least exists, and an older step exists)."""
    if c.damage_done >= len(c.damage_plan):
        return None
    left = len(c.damage_plan) - c.damage_done
    p = min(1.0, left / max(1, remaining_faults))
    draw = float(c.damage_rng.random())
    if draw >= p:
        return None
    kind = c.damage_plan[c.damage_done]
    cks = checkpoints(folder)
    if len(cks) < 2 or (kind != PROBE and not cks[max(cks)]):
        return {"kind": kind, "skipped": f"not eligible now (checkpoints {sorted(cks)}, newest "
                                         f"{'with' if cks and cks[max(cks)] else 'without'} SHA256SUMS)"}
    newest = max(cks)
    expect_from = max(st for st in cks if st < newest)
    c.damage_done += 1
    if kind == PROBE:
        return {"kind": kind, "probe": probe_unverified(c, folder, newest, expect_from, where)}
    what = damage(folder / "checkpoints" / str(newest), kind, c.damage_rng)
    _log(f"  damaged checkpoint {newest} ({kind}: {what})")
    return {"kind": kind, "step": newest, "what": what, "expect_from": expect_from}


def probe_unverified(c: Campaign, folder: pathlib.Path, step: int, older: int, where: str) -> dict:
    """Copy the run folder, delete the newest step's SHA256SUMS and flip 64 bytes, run the copy to the
    end: what the restore did (unverified by design), which values changed, whether the losses match."""
    fork = c.scratch / f"probe-{len(c.probes) + 1}"
    shutil.copytree(folder, fork, ignore=shutil.ignore_patterns(".lock"))
    what = damage(fork / "checkpoints" / str(step), PROBE, c.damage_rng)
    _log(f"  probe {fork.name}: checkpoint {step} ({what})")
    diff = leaf_diff(folder / "checkpoints", fork / "checkpoints", step, c.env)
    starts = []
    for k in (1, 2):  # a second start (as a user would) only when the first stopped on a non-finite loss
        a = Attempt(c.s.command(fork), c.env, fork, c.scratch / "logs", f"{fork.name}-{k}")
        rc, hung = a.finish(c.s.timeout_s)
        lines = [ln for ln in a.stderr().splitlines() if ln.strip()]
        nonfinite = next((m for m in map(NONFINITE.match, lines) if m), None)
        starts.append({"rc": rc, "hung": hung, "resumed_from": a.poll_start(), "wall_s": round(a.elapsed(), 2),
                       "stderr": classify_stderr("\n".join(ln for ln in lines if not NONFINITE.match(ln))),
                       "nonfinite_step": int(nonfinite.group(1)) if nonfinite else None,
                       "nonfinite_line": nonfinite.group(0) if nonfinite else None})
        if not (rc == 1 and nonfinite):
            break
    recs = loss_records(read_records(fork))
    cmp = compare(recs, c.ref["records"], complete=starts[-1]["rc"] == 0)
    diffs = [abs(r["loss"] - c.ref["records"][r["step"]]["loss"]) for r in recs if r["step"] in cmp["different"]]
    final = (leaf_diff(c.scratch / "reference" / "checkpoints", fork / "checkpoints", c.s.steps, c.env)
             if starts[-1]["rc"] == 0 else {"not_finished": True})
    first = starts[0]
    res = {"where": where, "folder": str(fork), "step": step, "older_step": older, "what": what, "values": diff,
           "final_values": final, "starts": starts, "rc": starts[-1]["rc"], "resumed_from": first["resumed_from"],
           "stderr": first["stderr"], "compare": cmp, "losses_match": compare_ok(cmp),
           "first_different_step": cmp["different"][0] if cmp["different"] else None,
           "max_abs_loss_change": max(diffs) if diffs else 0.0, "last_step": recs[-1]["step"] if recs else 0}
    for k, st in enumerate(starts, 1):
        where_k = f"{fork.name}-{k}"
        if st["hung"] or (st["rc"] != 0 and not (st["rc"] == 1 and st["nonfinite_step"])):
            c.anomaly("probe run failed", where_k, f"exit {st['rc']}, hung {st['hung']}")
        if st["stderr"]["traceback"]:
            c.anomaly("traceback", where_k, traceback_summary((c.scratch / "logs" / f"{where_k}.err").read_text()))
        elif st["stderr"]["n_other"]:
            c.anomaly("unexpected stderr", where_k, "\n".join(st["stderr"]["other"]))
    c.probes.append(res)
    return res


def campaign_run(c: Campaign, idx: int, budget: int) -> dict:
    """One run folder: `budget` signal faults (fewer if the run finishes first), then run to the end."""
    s = c.s
    folder = c.scratch / f"run{idx}"
    run = {"run": idx, "folder": str(folder), "attempts": 0, "faults": 0}
    damaged: set[str] = set()  # names under checkpoints-aside/ the campaign is responsible for
    pending: dict | None = None  # damage not yet reported by a start
    t_run = time.monotonic()
    while True:
        run["attempts"] += 1
        name = f"run{idx}-{run['attempts']:02d}"
        where = name
        fault = draw_fault(c.fault_rng, s) if run["faults"] < budget else None
        before = checkpoints(folder)
        ignore = {n for n in (os.listdir(folder / "checkpoints") if (folder / "checkpoints").is_dir() else [])
                  if TMP in n or (n.isdigit() and not before.get(int(n), True))}
        left_over = leftovers(folder)  # a kill's tmp / trash folders: gone once this start has begun a save
        ev: dict[str, Any] = {"run": idx, "attempt": run["attempts"], "name": name, "fault": fault,
                              "before": {str(k): v for k, v in sorted(before.items())}, "leftovers": sorted(left_over)}
        a = Attempt(s.command(folder), c.env, folder, c.scratch / "logs", name)
        ev["pid"] = a.proc.pid
        if pending:  # the start after a damage must restore (and report) before the next fault
            a.wait_until(lambda: a.poll_start() is not None, s.timeout_s)
        if fault:
            ev["trigger"] = fire_trigger(a, fault, ignore, s.timeout_s)
            if ev["trigger"]["result"] == "timeout":
                c.anomaly("hang", where, f"the {fault['trigger']} trigger did not fire within {s.timeout_s:.0f} s")
            ev["signal"] = send(c, a, fault, ignore)
            t_sig = ev["signal"].pop("t_sig")
            rc, hung = a.finish(120.0)
            ev["stop_s"] = round(time.monotonic() - t_sig, 3)
        else:
            a.wait_until(lambda: False, s.timeout_s, poll=0.02)
            rc, hung = a.finish(1.0)
            ev["signal"] = {"sent": []}
        if hung:
            c.anomaly("hang", where, f"still running {120 if fault else s.timeout_s:.0f} s after "
                                     f"{'the signal' if fault else 'the start'}; killed")
        a.new_steps()
        ev["start_step"], ev["first_record_s"], ev["wall_s"] = a.poll_start(), a.first_record_s, round(a.elapsed(), 3)
        ev["stop"] = check_stop(c, a, fault or {}, ev["signal"], rc, where)
        if ev["signal"]["sent"]:
            run["faults"] += 1
        new = [r for r in loss_records(read_records(folder)) if ev["start_step"] is not None and r["step"] > ev["start_step"]]
        ev["new_records"] = len(new)
        ev["new_records_match"] = all(same(r["loss"], c.ref["records"][r["step"]]["loss"]) for r in new
                                      if r["step"] in c.ref["records"])
        last = new[-1]["step"] if new else None
        began_save = last is not None and any(k % s.ckpt_every == 0 for k in range(ev["start_step"] + 1, last))
        if left_over and began_save:  # Orbax removes them in the background and waits for that before a save
            now_left = leftovers(folder)
            still = sorted(n for n, ident in left_over.items() if now_left.get(n) == ident)
            ev["leftovers_cleaned"] = not still
            if still:
                c.anomaly("temporary folders not cleaned", where, f"{still} (the same folders a kill left) still in "
                                                                  f"checkpoints/ after this start began a save")
        if pending:
            rep = check_damage_report(c, a, pending, where)
            if rep is not None:
                ev["damage_report"] = rep
                pending["report"] = rep
                if rep.get("moved_to"):
                    damaged.add(pathlib.Path(rep["moved_to"]).name)
                pending = None
        ev["folder"] = check_folder(c, folder, before, damaged, where)
        c.events.append(ev)
        _log(f"{name}: {fault['signal'] + (' x2' if fault['double'] else '') + ' on ' + fault['trigger'] + '=' + str(fault['param']) if fault else 'to the end'}"
             f" -> exit {rc}, start {ev['start_step']}, +{ev['new_records']} steps"
             f"{', save in flight ' + str(ev['signal']['save_in_flight']) if fault and ev['signal']['save_in_flight'] else ''}")
        if ev["stop"]["finished"] or (rc == 0 and not fault):
            break
        if run["attempts"] > 3 * budget + 10:
            c.anomaly("gave up", where, f"{run['attempts']} starts and the run has not finished")
            break
        if not pending:
            d = maybe_damage(c, folder, max(1, s.kills - c.signals_sent), where)
            if d:
                ev["damage"] = d
                if "expect_from" in d and "probe" not in d:
                    pending = d
    final = loss_records(read_records(folder))
    run["compare"] = compare(final, c.ref["records"], complete=True)
    vals = [r for r in read_records(folder) if "val_loss" in r]
    ref_val = c.ref["val_loss"]
    run["val_loss_match"] = bool(vals) and ref_val is not None and same(vals[-1]["val_loss"], ref_val)
    run["final_ok"] = compare_ok(run["compare"]) and run["val_loss_match"]
    if s.compare_state:
        run["final_state"] = leaf_diff(c.scratch / "reference" / "checkpoints", folder / "checkpoints", s.steps, c.env)
        if run["final_state"].get("changed") != []:
            c.anomaly("final checkpoint differs from the reference", f"run{idx}", json.dumps(run["final_state"])[:1500])
    run["aside"] = aside(folder)
    run["wall_s"] = round(time.monotonic() - t_run, 1)
    if pending:
        c.anomaly("damaged checkpoint not handled", f"run{idx}", f"no start reported the damage of step {pending['step']}")
    if not run["final_ok"]:
        c.anomaly("final records differ from the reference", f"run{idx}", json.dumps(run["compare"]))
    _log(f"run{idx}: {run['attempts']} starts, {run['faults']} signal faults, final records "
         f"{'identical to the reference' if run['final_ok'] else 'DIFFER'}")
    c.runs.append(run)
    return run


# ------------------------------------------------------------------------------------ summary


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 2) if xs else None


def summarize(c: Campaign) -> dict:
    ev = c.events
    faults = [e for e in ev if e["signal"]["sent"]]
    by_sig = {k: sum(1 for e in faults if e["signal"]["sent"][0] == k) for k in SIGNALS}
    damage = [e["damage"] for e in ev if e.get("damage") and "skipped" not in e["damage"]]
    by_damage = {k: sum(1 for d in damage if d["kind"] == k) for k in DAMAGE_KINDS}
    reports = [e["damage_report"] for e in ev if "damage_report" in e]
    resumes = [e for e in ev if e["start_step"]]
    restarts = len(ev) - len(c.runs)
    kinds: dict[str, int] = {}
    for a in c.anomalies:
        kinds[a["kind"]] = kinds.get(a["kind"], 0) + 1
    mismatch_runs = [r["run"] for r in c.runs if r["compare"]["n_different"] or not r["val_loss_match"]]
    lost_records = sum(len(r["compare"]["missing"]) + len(r["compare"]["duplicates"]) for r in c.runs)
    first = [e["first_record_s"] for e in ev if e["first_record_s"] is not None and e["attempt"] > 1]
    stop = [e["stop_s"] for e in ev if "stop_s" in e and e["signal"]["sent"] and e["signal"]["sent"][0] != "SIGKILL"
            and e["stop"]["rc"] in (130, 143)]
    slow_cut = (statistics.median(first) * 2 + 5) if first else None
    return {
        "signal_faults": len(faults), "by_signal": by_sig,
        "double_signal": sum(1 for e in faults if len(e["signal"]["sent"]) == 2),
        "double_planned_but_exited_first": sum(1 for e in faults if e["fault"]["double"] and len(e["signal"]["sent"]) == 1),
        "again_lines": sum(e["stop"].get("again_lines", 0) for e in faults),
        "aimed_at_save": sum(1 for e in faults if e["fault"]["trigger"] == "save" and e["trigger"]["result"] == "fired"),
        "save_in_flight_at_signal": sum(1 for e in faults if e["signal"]["save_in_flight"]),
        "sigkill_during_save": sum(1 for e in faults if e["signal"]["save_in_flight"] and e["signal"]["sent"][0] == "SIGKILL"),
        "by_trigger": {t: sum(1 for e in faults if e["fault"]["trigger"] == t) for t in ("time", "steps", "save")},
        "signal_before_first_step": sum(1 for e in faults if e["start_step"] is None),
        "faults_planned_but_run_finished_first": sum(1 for e in ev if e["fault"] and not e["signal"]["sent"]),
        "damage": len(damage), "by_damage": by_damage,
        "damage_in_place": sum(by_damage[k] for k in IN_PLACE),
        "damage_reported_correctly": sum(1 for r in reports if r["ok"]), "damage_reports": len(reports),
        "damage_skipped_not_eligible": sum(1 for e in ev if e.get("damage", {}).get("skipped")),
        "probes": len(c.probes), "probes_losses_match": sum(1 for p in c.probes if p["losses_match"]),
        "leftovers_checked": sum(1 for e in ev if "leftovers_cleaned" in e),
        "leftovers_cleaned": sum(1 for e in ev if e.get("leftovers_cleaned")),
        "campaign_runs": len(c.runs), "starts": len(ev), "restarts": restarts, "resumes": len(resumes),
        "resumes_matched": sum(1 for e in resumes if e["new_records"] and e["new_records_match"]),
        "resumes_without_new_steps": sum(1 for e in resumes if not e["new_records"]),
        "resumes_mismatched": sum(1 for e in resumes if e["new_records"] and not e["new_records_match"]),
        "final_runs_identical": sum(1 for r in c.runs if r["final_ok"]),
        "final_states_compared": sum(1 for r in c.runs if "final_state" in r),
        "final_states_identical": sum(1 for r in c.runs if r.get("final_state", {}).get("changed") == []),
        "mismatches": sum(r["compare"]["n_different"] for r in c.runs) + len([r for r in c.runs if not r["val_loss_match"]])
                      + sum(1 for r in c.runs if "final_state" in r and r["final_state"].get("changed") != [])
                      + sum(1 for e in resumes if e["new_records"] and not e["new_records_match"]),
        "mismatch_runs": mismatch_runs,
        "data_lost": lost_records + kinds.get("checkpoint deleted", 0) + kinds.get("intact checkpoint set aside", 0)
                     + kinds.get("checksummed checkpoint does not verify", 0)
                     + kinds.get("records missing or duplicated", 0),
        "lost_records": lost_records,
        "unexpected_exit": kinds.get("unexpected exit status", 0), "tracebacks": kinds.get("traceback", 0),
        "signals_lost": kinds.get("signal lost", 0),
        "unexpected_stderr": kinds.get("unexpected stderr", 0), "hangs": kinds.get("hang", 0),
        "anomalies_by_kind": kinds,
        "restart_to_first_step_s": {"n": len(first), "median": _pct(first, 50), "p90": _pct(first, 90),
                                    "max": max(first) if first else None},
        "signal_to_exit_s": {"n": len(stop), "median": _pct(stop, 50), "p90": _pct(stop, 90),
                             "max": max(stop) if stop else None},
        "slow_restarts": [{"name": e["name"], "first_record_s": e["first_record_s"]} for e in ev
                          if slow_cut and e["first_record_s"] and e["attempt"] > 1 and e["first_record_s"] > slow_cut],
    }


def _ranges(xs: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out: list[str] = []
    for x in xs:
        if out and "-" not in out[-1] and int(out[-1]) == x - 1 or out and "-" in out[-1] and int(out[-1].split("-")[1]) == x - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{x}"
        else:
            out.append(str(x))
    return ", ".join(out) + (" ..." if len(xs) >= 32 else "")


def probe_story(p: dict) -> str:
    """What happened in one probe, in words."""
    v, name, starts = p["values"], pathlib.Path(p["folder"]).name, p.get("starts", [])
    changed = v.get("changed") or []
    what = "; ".join(f"{d['leaf']} rows {_ranges(d.get('rows', []))}, up to {d['max_abs_change']:.3g}" for d in changed)
    fv = p.get("final_values", {})
    final = ("its last checkpoint is bit-identical to the reference's" if fv.get("changed") == [] else
             "its last checkpoint differs from the reference's in " + "; ".join(
                 f"{d['leaf']} ({d['values_changed']} values)" for d in fv["changed"]) if fv.get("changed") else
             "the run did not finish")
    if starts and starts[0]["nonfinite_step"]:
        msg = starts[0]["nonfinite_line"][len("boostjax: "):]
        story = (f"Orbax restored the damaged values ({what or 'see faults.json'}) without complaint; the loss became "
                 f"non-finite at step {starts[0]['nonfinite_step']} and boostjax stopped with exit 1: `{msg}`")
        if p["rc"] == 0:
            return (f"\n{name}: {story}. The diverged-run rule moved a checkpoint aside and a second start resumed from "
                    f"step {starts[-1]['resumed_from']}; it finished with losses "
                    f"{'bit-identical to' if p['losses_match'] else 'different from'} the reference, and {final}. "
                    f"Here the rule happened to catch the damaged step; with SHA256SUMS the first start would have.")
        again = (f" A second start restored step {starts[1]['resumed_from']} again and stopped at step "
                 f"{starts[1]['nonfinite_step']}." if len(starts) > 1 and starts[1]["nonfinite_step"] else "")
        return (f"\n{name}: {story}. The damaged step {p['step']} is not the step before the non-finite one, so it is "
                f"kept as 'the last good checkpoint'.{again} With SHA256SUMS the first start would have set it aside "
                f"and resumed from step {p['older_step']}.")
    if not changed and p["losses_match"]:
        return (f"\n{name}: the 64 inverted bytes lie in a part of the file the restore does not read (all "
                f"{v.get('leaves')} restored arrays are bit-identical to the intact copy's), so the unverified resume "
                f"was exact and {final}.")
    if changed and not p["losses_match"]:
        return (f"\n{name}: Orbax restored the damaged values ({what}) without complaint; the run continued from them "
                f"and its losses differ from the reference from step {p['first_different_step']} on; {final}. The "
                f"only stderr line said the step was restored without verification.")
    if changed:
        return (f"\n{name}: Orbax restored the damaged values ({what}) without complaint and the run continued from "
                f"them; its losses are still bit-identical to the reference (the changed values did not enter any "
                f"later loss), but {final}. Equal losses do not prove equal parameters; only the checksums would "
                f"have caught this.")
    return f"\n{name}: {json.dumps(v)[:300]}"


def markdown(res: dict) -> str:
    s, n, ref = res["settings"], res["counts"], res["reference"]
    t = ["# Fault campaign: kills, stop signals and damaged checkpoints against `boostjax train`", "",
         f"Command: `{res['command']}` — wall time {res['wall_s'] / 60:.1f} min on {res['platform']}.", "",
         f"Training command (every run, reference and campaign): `{res['train_command']}`.",
         f"Uninterrupted reference: {ref['steps']} steps, loss {ref['first_loss']:.4f} -> {ref['final_loss']:.4f} "
         f"(val {ref['val_loss']:.4f}), {ref['wall_s']:.1f} s.", "",
         f"**In short:** {n['signal_faults']} signals ({n['by_signal']['SIGKILL']} SIGKILL, {n['by_signal']['SIGINT']} "
         f"SIGINT, {n['by_signal']['SIGTERM']} SIGTERM) and {n['damage']} damaged checkpoints over {n['campaign_runs']} "
         f"campaign runs ({n['starts']} starts): {n['mismatches']} mismatches, {n['data_lost']} data lost; every finished "
         f"run's {s['steps']} loss records were bit-identical to the uninterrupted run's in {n['final_runs_identical']} of "
         f"{n['campaign_runs']} runs. Failures: {n['unexpected_exit']} unexpected exit statuses, {n['signals_lost']} "
         f"signals lost, {n['tracebacks']} "
         f"tracebacks, {n['unexpected_stderr']} other unexpected stderr, {n['hangs']} hangs"
         + (" (see Anomalies)." if res["anomalies"] else "."), "",
         "## Result", "",
         "| | count |", "|---|---|",
         f"| signal faults injected | {n['signal_faults']} |",
         *[f"| &nbsp;&nbsp;{k} | {v} |" for k, v in n["by_signal"].items()],
         f"| &nbsp;&nbsp;double signal (SIGINT/SIGTERM sent twice) | {n['double_signal']} |",
         f"| &nbsp;&nbsp;signal while a checkpoint save was in flight | {n['save_in_flight_at_signal']} "
         f"(SIGKILL: {n['sigkill_during_save']}; aimed at a save and caught: {n['aimed_at_save']}) |",
         f"| &nbsp;&nbsp;signal before the start had restored (imports, restore; no config_history line yet) | {n['signal_before_first_step']} |",
         f"| damaged checkpoints | {n['damage']} |",
         *[f"| &nbsp;&nbsp;{k} | {v} |" for k, v in n["by_damage"].items()],
         f"| damaged in place, reported + moved aside + resumed from the older step | {n['damage_reported_correctly']} of {n['damage_in_place']} |",
         f"| starts that found a kill's Orbax temporary folder or .trash and had removed it by their first save | "
         f"{n['leftovers_cleaned']} of {n['leftovers_checked']} |",
         f"| campaign runs / starts / restarts | {n['campaign_runs']} / {n['starts']} / {n['restarts']} |",
         f"| resumes (started from a checkpoint) | {n['resumes']} |",
         f"| &nbsp;&nbsp;every step they logged bit-identical to the reference | {n['resumes_matched']} |",
         f"| &nbsp;&nbsp;stopped before logging a step | {n['resumes_without_new_steps']} |",
         f"| campaign runs whose final metrics.jsonl equals the reference (steps 1..{s['steps']} once each, bit-identical) | {n['final_runs_identical']} of {n['campaign_runs']} |",
         f"| campaign runs whose last checkpoint (parameters + optimizer state, every array) is bit-identical to the reference's | "
         f"{n['final_states_identical']} of {n['final_states_compared']} compared |",
         f"| **mismatches** (loss / grad norm / lr / val loss records, or final checkpoints, that differ) | **{n['mismatches']}** |",
         f"| **data lost** (see the definition) | **{n['data_lost']}** |",
         f"| unexpected exit status | {n['unexpected_exit']} |",
         f"| signals lost (SIGINT/SIGTERM, the run went on to the end and exited 0) | {n['signals_lost']} |",
         f"| Python tracebacks on stderr | {n['tracebacks']} |",
         f"| other unexpected stderr | {n['unexpected_stderr']} |",
         f"| hangs | {n['hangs']} |",
         f"| restart -> first new step, s (median / p90 / max) | {n['restart_to_first_step_s']['median']} / "
         f"{n['restart_to_first_step_s']['p90']} / {n['restart_to_first_step_s']['max']} |",
         f"| SIGINT/SIGTERM -> exit, s (median / p90 / max) | {n['signal_to_exit_s']['median']} / "
         f"{n['signal_to_exit_s']['p90']} / {n['signal_to_exit_s']['max']} |", ""]
    t += ["Triggers: " + ", ".join(f"{k} {v}" for k, v in n["by_trigger"].items()) +
          f" (time: uniform 0.2-{s['max_wait_s']} s after the start; steps: 1-{s['max_wait_steps']} newly logged steps; "
          f"save: let 0-{s['max_skip_saves']} saves pass, signal during the next, polled every 1 ms). "
          f"{n['faults_planned_but_run_finished_first']} planned faults found the run already finished. "
          f"{n['double_planned_but_exited_first']} double signals found the process gone before the second.", ""]
    t += ["## Definitions", "",
          "- **Mismatch**: a loss, grad-norm or lr record of a step (or the final val loss) that is not bit-identical "
          "(same 64-bit float as parsed from metrics.jsonl) to the uninterrupted run's; counted in each campaign "
          "run's final metrics.jsonl and in the records each resumed process wrote.",
          "- **Data lost**: (a) a step 1..N missing from, or present twice in, a finished campaign run's metrics.jsonl; "
          "(b) a committed checkpoint that vanished from checkpoints/ other than by pruning (fewer than "
          f"`--keep-ckpts` {s['keep']} newer steps exist) or being moved to checkpoints-aside/; (c) an intact "
          "checkpoint (one the campaign did not damage) moved to checkpoints-aside/; (d) a checkpoint with SHA256SUMS "
          "that no longer matches them, found after a stop (a kill that damaged a committed step).",
          "- **Unexpected exit status**: anything but -9 after SIGKILL, 130 after SIGINT, 143 after SIGTERM, 0 when the "
          "run had finished. **Unexpected stderr**: any line other than boostjax's stop, 'again', damaged-checkpoint "
          "and no-checksums lines; a Python traceback is counted apart. Both are failures.",
          "- **Restart -> first new step**: from starting the command to the first new loss record (imports, restore, "
          "compile from the persistent cache); **signal -> exit**: SIGINT/SIGTERM to the process exiting (the "
          "current step, the final save and the wait for it).", ""]
    t += ["## What each fault exercises", "", "| fault | exercises |", "|---|---|",
          *[f"| {k} | {v} |" for k, v in FAULT_EXERCISES.items()], ""]
    t += ["## Checkpoints without SHA256SUMS (probes)", "",
          "A step whose SHA256SUMS is missing is restored without verification by design (a kill between Orbax's "
          "commit and the checksums leaves such a step, and older boostjax versions wrote no checksums). Each probe "
          "copied the run folder at that moment, deleted the newest step's SHA256SUMS, inverted 64 bytes in the middle "
          "of its largest file and ran the same command in the copy to the end. 'Values changed' compares what Orbax "
          "restores from the damaged copy with the intact original. Without SHA256SUMS nothing checks the bytes: if "
          "the inverted bytes fall in array data, Orbax restores the changed values and the run continues from them "
          "with only the 'restored without verification' line on stderr; if they fall in a part of the file the "
          "restore does not read, nothing changes.", "",
          "| probe | step | damage | restore | values changed | losses vs reference | last checkpoint vs reference |",
          "|---|---|---|---|---|---|---|"]
    for p in res["probes"]:
        v = p["values"]
        if "read_error" in v:
            vals = f"Orbax cannot read it ({v['read_error'][:100]})"
        elif "changed" in v:
            vals = ("none of " + str(v["leaves"]) + " arrays") if not v["changed"] else "; ".join(
                f"{d['leaf']}: {d['values_changed']} values in rows {_ranges(d.get('rows', []))}, max change "
                f"{d['max_abs_change']:.3g}" for d in v["changed"])
        else:
            vals = "helper failed"
        known = p["stderr"]["known"]
        restore = ("restored unverified from step " + str(p["resumed_from"]) if known.get("unverified") else
                   "set aside (Orbax read error), resumed from " + str(p["resumed_from"]) if known.get("damaged") else
                   f"started from {p['resumed_from']}")
        starts = p.get("starts", [])
        if starts and starts[0]["nonfinite_step"]:
            restore += (f"; non-finite loss at step {starts[0]['nonfinite_step']}, exit 1" +
                        (f"; a second start: from {starts[1]['resumed_from']} again, non-finite at step "
                         f"{starts[1]['nonfinite_step']}, exit {starts[1]['rc']}" if len(starts) > 1 and
                         starts[1]["nonfinite_step"] else f"; a second start: exit {starts[-1]['rc']}" if len(starts) > 1 else ""))
        diverged = p["rc"] != 0
        loss = ((f"identical up to step {p['last_step']}, then non-finite" if diverged else "identical")
                if not p["compare"]["n_different"] else
                f"{p['compare']['n_different']} steps differ from step {p['first_different_step']} "
                f"(max |loss change| {p['max_abs_loss_change']:.3g})" + (", then non-finite" if diverged else ""))
        extra = f"; {p['stderr']['n_other']} other stderr lines" + (" incl. tracebacks" if p["stderr"]["traceback"] else "") \
            if p["stderr"]["n_other"] else ""
        fv = p.get("final_values", {})
        final = ("identical" if fv.get("changed") == [] else "; ".join(
            f"{d['leaf']}: {d['values_changed']} values differ" for d in fv["changed"]) if fv.get("changed")
            else "the run did not finish" if fv.get("not_finished") else "not compared")
        t.append(f"| {pathlib.Path(p['folder']).name} | {p['step']} | {p['what']} | {restore}{extra} | {vals} | {loss} "
                 f"| {final} |")
    if not res["probes"]:
        t.append("| (none in this campaign) | | | | | | |")
    t += [probe_story(p) for p in res["probes"]]
    t += ["", "## Anomalies", ""]
    if not res["anomalies"]:
        t.append("None: every exit status, stderr line, checkpoint and record was as expected.")
    for a in res["anomalies"]:
        detail = a["detail"].strip().splitlines()
        short = " / ".join(x.strip() for x in detail[-4:])[:600]
        t.append(f"- **{a['kind']}** ({a['where']}): {short}")
    seen = list(dict.fromkeys(a["kind"] for a in res["anomalies"]))
    if seen:
        t += ["", *[f"*{k}*: {EXPLAIN[k]}" for k in seen if k in EXPLAIN]]
    if n["slow_restarts"]:
        t += ["", "Slow restarts (first new step later than 2 x median + 5 s): " +
              ", ".join(f"{x['name']} {x['first_record_s']:.1f} s" for x in n["slow_restarts"])]
    t += ["", "## Settings", "", "```", json.dumps({k: v for k, v in s.items() if k != "model"}), "```", "",
          "Every event (fault drawn, trigger result, signals sent, exit status, stderr classification, checkpoints "
          "before and after, damage done and how the next start reported it, timings) is in faults.json.", ""]
    return "\n".join(t)


# --------------------------------------------------------------------------------------- main


def run_campaign(s: Settings, out: pathlib.Path, scratch: pathlib.Path | None = None, command: str = "",
                 keep_scratch: bool = False) -> dict:
    """Reference run, campaign runs until >= kills signals and >= corruptions damaged checkpoints;
    writes faults.{json,md} under `out`; returns the JSON object."""
    out.mkdir(parents=True, exist_ok=True)
    made = scratch is None
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="boostjax-faults-")) if made else scratch
    if scratch.exists() and any(scratch.iterdir()) and not (scratch / "jax-cache").is_dir():
        raise ValueError(f"faults: --scratch {scratch} is not empty; fix: pass a new or empty folder")
    for sub in ("logs",):
        (scratch / sub).mkdir(parents=True, exist_ok=True)
    for old in [p for p in scratch.iterdir() if p.name not in ("jax-cache", "logs")]:
        shutil.rmtree(old)  # a scratch folder of an earlier campaign: keep only its compilation cache
    env = subprocess_env(scratch / "jax-cache")
    t0 = time.perf_counter()
    _log(f"reference run ({s.steps} steps) in {scratch}")
    ref = run_reference(s, scratch, env)
    _log(f"reference: loss {ref['first_loss']:.4f} -> {ref['final_loss']:.4f}, {ref['wall_s']} s")
    plan_rng, fault_rng, damage_rng = (np.random.default_rng(x) for x in np.random.SeedSequence(s.seed).spawn(3))
    c = Campaign(s, scratch, env, ref, fault_rng, damage_rng, draw_damage_kinds(plan_rng, s.corruptions))
    per_run = -(-s.kills // s.runs)
    idx = 0
    while c.signals_sent < s.kills or c.damage_done < len(c.damage_plan):
        idx += 1
        if idx > 3 * s.runs + 2:
            c.anomaly("gave up", "campaign", f"{idx - 1} runs and still {c.signals_sent} signals, {c.damage_done} damages")
            break
        budget = max(1, min(per_run, s.kills - c.signals_sent)) if c.signals_sent < s.kills else per_run
        campaign_run(c, idx, budget)
    wall_s = time.perf_counter() - t0
    ref_public = {k: v for k, v in ref.items() if k != "records"}
    platform = f"{os.cpu_count()} CPU cores (load average at the end {os.getloadavg()[0]:.1f}), JAX on CPU"
    res = {"settings": json.loads(json.dumps(asdict(s))), "command": command, "wall_s": round(wall_s, 1),
           "platform": platform, "train_command": " ".join(["boostjax", *s.command(pathlib.Path("RUN"))[3:]]),
           "scratch": str(scratch) if keep_scratch or not made else None, "reference": ref_public,
           "damage_plan": c.damage_plan, "counts": summarize(c), "runs": c.runs, "probes": c.probes,
           "anomalies": c.anomalies, "events": c.events}
    (out / "faults.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "faults.md").write_text(markdown(res))
    if made and not keep_scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return res


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke version: 2 signals, 1 damaged checkpoint, 40 steps")
    p.add_argument("--out", default="experiments/results", help="folder for faults.{json,md}")
    p.add_argument("--scratch", type=pathlib.Path, help="folder for the run folders, logs and JAX cache (kept)")
    p.add_argument("--keep-scratch", action="store_true", help="keep the temporary scratch folder")
    p.add_argument("--from-json", type=pathlib.Path, help="re-render faults.md from an earlier faults.json (no runs)")
    p.add_argument("--seed", type=int)
    p.add_argument("--kills", type=int, help="signals to send, at least (SIGKILL/SIGINT/SIGTERM)")
    p.add_argument("--corruptions", type=int, help="checkpoints to damage, at least")
    for name, kind in (("runs", int), ("steps", int), ("ckpt-every", int), ("keep", int), ("max-wait-s", float),
                       ("max-wait-steps", int), ("p-double", float), ("timeout-s", float)):
        p.add_argument(f"--{name}", type=kind)
    args = p.parse_args(argv)
    if args.from_json:
        res = json.loads(args.from_json.read_text())
        (pathlib.Path(args.out) / "faults.md").write_text(markdown(res))
        print((pathlib.Path(args.out) / "faults.md").read_text())
        return res
    over = {k: v for k, v in vars(args).items()
            if v is not None and k not in ("quick", "out", "scratch", "keep_scratch", "from_json")}
    s = replace(QUICK if args.quick else Settings(), **over)
    command = " ".join(["python experiments/faults.py", *(sys.argv[1:] if argv is None else argv)])
    res = run_campaign(s, pathlib.Path(args.out), args.scratch, command, args.keep_scratch)
    print((pathlib.Path(args.out) / "faults.md").read_text())
    return res


if __name__ == "__main__":
    main()
