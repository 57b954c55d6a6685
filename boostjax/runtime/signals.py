"""A stop signal during start-up is recorded, not raised: `defer_signals` is the first thing a
`boostjax train` process does, before it imports anything heavy (this module imports only the
standard library), and `boostjax.runtime.interrupt.StopSignals` acts on what it recorded once the
run can save a consistent checkpoint."""

from __future__ import annotations

import signal
from types import FrameType
from typing import Callable


SIGNALS: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)


EXIT_CODES: dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + signal number


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on a signal after saving a consistent checkpoint.

    `step`: the step the run can resume from (None when no checkpoint exists yet); `exit_code`:
    130 for SIGINT, 143 for SIGTERM.
    """

    def __init__(self, message: str, signum: int, step: int | None):
        super().__init__(message)
        self.signum, self.step = signum, step
        self.exit_code = EXIT_CODES.get(signum, 128 + signum)


class _Deferred:
    """Signals that arrived before `StopSignals` took over (the CLI defers them from its first line)."""

    signum: int | None = None

    @classmethod
    def handle(cls, signum: int, frame: FrameType | None) -> None:
        if cls.signum is None:
            cls.signum = signum


def defer_signals() -> Callable[[], None]:
    """From now on SIGINT / SIGTERM are recorded, not raised, until a `StopSignals` block acts on
    them: a `boostjax train` process never dies in its imports or its final print. Returns a
    function that puts the previous handlers back (for in-process callers such as tests)."""
    old = {s: signal.signal(s, _Deferred.handle) for s in SIGNALS}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)
        _Deferred.signum = None

    return restore
