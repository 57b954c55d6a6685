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
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from jax.experimental import multihost_utils

from boostjax.runtime.signals import SIGNALS, _Deferred


class StopSignals:
    """Context manager: SIGINT/SIGTERM set `requested` instead of raising or killing."""

    def __init__(self, *, multi_process: bool = False):
        self.multi_process = multi_process
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
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
