"""Stopping a run cleanly on SIGINT (Ctrl-C) and SIGTERM (what SLURM and Kubernetes send first).

While `StopSignals` is active a signal only *records* a stop request; the training loop looks at
`requested` between steps, so the step in flight finishes, the parameters, optimizer state and
data position that are saved belong together, and no donated buffer is touched. Further signals
while the final checkpoint is written are acknowledged and ignored (SIGKILL still ends the process;
the previous checkpoint is then intact). The old handlers come back when the block exits. The CLI
calls `boostjax.runtime.signals.defer_signals` first, so a signal during the imports, or after the run while the process
prints its summary and exits, is recorded instead of raised (no traceback, never lost).

In a multi-host job a stop must happen at the same step on every process: SIGTERM is left to JAX's
preemption notifier (which shares the notice over the coordination service) and SIGINT is turned
into a SIGTERM to this process; `should_stop(step)` then asks `reached_preemption_sync_point`.

Before the first step a run goes through phases that can each take minutes (reading weights, calibration,
factoring, restoring a checkpoint, compiling). `phase` runs each in a worker thread while the main thread
polls the stop flag: a signal stops the run within `POLL_S` with the line of `StopSignals.check_early`,
whatever the phase is doing (an XLA compile would hold the main thread for its whole length, and Python
runs signal handlers only between bytecodes). A phase that lasts says what it does (one line on stderr,
process 0, a progress bar where it has a count). The abandoned worker is a daemon thread; if it is still
running when the process exits, the process ends with `os._exit` and the signal's exit status, before
C++ destructors run under it.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable, TypeVar

from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from boostjax.runtime import multihost
from boostjax.runtime.signals import EXIT_CODES, SIGNALS, TrainingInterrupted, _Deferred

T = TypeVar("T")
POLL_S = 0.05  # how often the main thread looks at the stop flag while a phase runs
ANNOUNCE_S = 2.0  # a phase that runs longer says what it is doing


class StopSignals:
    """Context manager: SIGINT/SIGTERM set `requested` instead of raising or killing."""

    def __init__(self, *, multi_process: bool = False, where: str = "", bars: bool = True, early: str = ""):
        self.multi_process = multi_process
        self.where = where  # the run folder, named when a stop comes before the first step
        self.early = early  # what a stop before the first step says after "stopped by SIG..." ("": a run's text)
        self.bars = bars  # progress bars for the phases before the first step (False: their lines only)
        self.signum: int | None = None
        self.saving: str | None = None  # set while the final checkpoint is written (for the message)
        self._old: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            if self.multi_process and signum == signal.SIGINT:
                os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption notifier tells the other processes
            return
        what = self.saving or "stopping after the current step"
        print(f"boostjax: {signal.Signals(signum).name} again: {what}; wait for it (SIGKILL would lose only "
              f"this save, the previous checkpoint stays intact)", file=sys.stderr, flush=True)

    def check_early(self) -> None:
        """Raise `TrainingInterrupted` if a signal came before the first step (one process: a job's
        processes must stop at the same step, so they go on to it). Nothing new to save."""
        if self.requested and not self.multi_process:
            name = signal.Signals(self.signum).name
            what = self.early or (f"before the first step; nothing in {self.where} changed; rerun the same "
                                  "command to train")
            raise TrainingInterrupted(f"stopped by {name} {what}", self.signum, None)

    def should_stop(self, step: int) -> bool:
        """Whether to stop after `step` (in a multi-host job: all processes agree on the step)."""
        if not self.multi_process:
            return self.requested

        try:
            reached = multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # the preemption service is off: stop on this process's own signal
            return self.requested
        if reached and self.signum is None:
            self.signum = signal.SIGTERM
        return reached

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            sigs = (signal.SIGINT,) if self.multi_process else SIGNALS
            for s in sigs:
                self._old[s] = signal.signal(s, self._handle)
            if _Deferred.signum is not None:  # arrived during the imports: act on it now
                early, _Deferred.signum = _Deferred.signum, None
                self._handle(early, None)
                if self.multi_process and early == signal.SIGTERM:
                    os.kill(os.getpid(), signal.SIGTERM)  # now JAX's preemption notifier hears it
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
        if self in _ACTIVE:
            _ACTIVE.remove(self)


_ACTIVE: list[StopSignals] = []  # the run being prepared in this process (main thread), at most one
_ABANDONED: list[tuple[threading.Thread, int]] = []  # phases left running after a stop, with the exit status


class Progress:
    """What a phase's work reports: `update(n)` advances its bar (shown once the phase is announced);
    after a stop it raises `Cancelled`, so work that checks in (a loop over layers) ends soon after."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.n, self.bar = 0, None
        self._lock = threading.Lock()

    def update(self, n: int = 1) -> None:
        if self.cancelled.is_set():
            raise Cancelled()
        with self._lock:
            self.n += n
            if self.bar is not None:
                self.bar.update(n)

    def show(self, total: int, unit: str) -> None:
        """A bar of `total` `unit`s from here on (under the phase's line, which names it)."""
        with self._lock:
            self.bar = tqdm(total=total, initial=self.n, unit=unit, dynamic_ncols=True, leave=False)

    def close(self) -> None:
        with self._lock:
            if self.bar is not None:
                self.bar.close()
                self.bar = None


class Cancelled(Exception):
    """Raised inside an abandoned phase's worker by `Progress.update`; never seen by the caller."""


def _exit_if_abandoned() -> None:
    """At exit: a phase's worker still inside XLA would abort the process when the interpreter tears
    down under it (`terminate called ...`, status 134), so end now with the signal's status."""
    alive = [code for th, code in _ABANDONED if th.is_alive()]
    if alive:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(alive[0])


def _run_polling(fn: Callable[[], T], stop: StopSignals, progress: Progress, what: str,
                 announce: Callable[[], None], after: float | None) -> T:
    """`fn()` in a daemon thread; the main thread calls `announce()` once `after` seconds passed (None:
    never) and raises `check_early`'s interruption on a stop."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the main thread, or dropped after a stop
            box["error"] = e

    t0 = time.monotonic()
    worker = threading.Thread(target=work, name=f"boostjax: {what}", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(POLL_S)
        if after is not None and worker.is_alive() and time.monotonic() - t0 >= after:
            announce()
            after = None
        if worker.is_alive() and stop.requested:
            progress.cancelled.set()
            if not _ABANDONED:
                atexit.register(_exit_if_abandoned)
            _ABANDONED.append((worker, EXIT_CODES.get(stop.signum, 128 + stop.signum)))
            stop.check_early()
    if "error" in box:
        raise box["error"]
    return box["value"]


def phase(what: str, fn: Callable[[Progress], T], *, total: int | None = None, unit: str = "it",
          after: float | None = ANNOUNCE_S) -> T:
    """`fn(progress)`, one phase of a run's start (reading weights, factoring, compiling, ...).

    Inside `boostjax.train` (a `StopSignals` block on the main thread of a single process) `fn` runs in
    a worker thread, so that a signal stops the run within `POLL_S` (`StopSignals.check_early`'s
    `TrainingInterrupted`); once it has run `after` seconds (0: at once; None: never, the caller said
    it) the phase says `boostjax: <what>` on stderr (process 0) and shows a bar of `total` `unit`s that
    `progress.update()` advances (unless the run has no progress bars). A quick phase says nothing, so
    a refusal stays one line. In a multi-host job `fn` runs here and the line comes first; anywhere
    else (a library call, a worker thread) `fn` runs here, silently."""
    stop = _ACTIVE[-1] if _ACTIVE else None
    if stop is None or threading.current_thread() is not threading.main_thread():
        return fn(Progress())
    progress = Progress()

    def announce() -> None:
        if multihost.is_main_process():
            print(f"boostjax: {what}", file=sys.stderr, flush=True)
            if stop.bars and total is not None:
                progress.show(total, unit)

    try:
        if stop.multi_process:  # the processes stop together, at a step: nothing to poll for here
            if after is not None:
                announce()
            return fn(progress)
        stop.check_early()
        if after is not None and after <= 0:
            announce()
            after = None
        return _run_polling(lambda: fn(progress), stop, progress, what, announce, after)
    finally:
        progress.close()
