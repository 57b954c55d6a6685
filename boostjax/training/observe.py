"""What a training run shows besides `metrics.jsonl`: TensorBoard event files, a `jax.profiler`
trace of chosen steps, the model FLOPs utilisation (MFU), and which dispatched steps have finished.

- **TensorBoard** (`<run>/tensorboard/`, written by process 0 with `tensorboardX`, no TensorFlow):
  every numeric field of every metrics record is a scalar under its JSON key (`loss`, `val_loss`,
  `lr`, `grad_norm`, `tokens_per_s`, `mfu`, ...) at the record's step. Every start writes a new
  event file whose first event is TensorBoard's "session start" at the step after the restored one
  (`purge_step`): TensorBoard then hides the earlier files' points from that step on, so the steps
  recomputed after a resume from an older checkpoint are shown once, as `metrics.jsonl` (trimmed to
  the restored step) holds them.
- **Profile** (`--profile START:STOP`): a trace of the steps START..STOP-1 (0-based: step k takes
  the state from k to k+1 updates, and is logged as step k+1), each step a `StepTraceAnnotation`
  named `step <k>`, in `<run>/profile/` (view it with TensorBoard's profile plugin or Perfetto).
- **MFU**: achieved model FLOPs/s (`flops_per_token` x tokens/s, the 6N + attention convention of
  `boostjax.models.flops`) over the peak BF16 FLOPs/s of the devices the mesh uses (the
  `--hardware` profile's `bf16_flops` x devices). Logged as a fraction in [0, 1] under `mfu`.
  Unknown hardware (a CPU, a GPU without a profile) gives no MFU.
- **Finished steps** (`FinishedSteps`): JAX returns from a step as soon as it is dispatched; the progress
  bar counts a step when its outputs are ready, and the loop runs at most `IN_FLIGHT` steps ahead of it.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import pathlib
import sys
import time
from collections import deque
from typing import Any, Callable

import jax

from boostjax.runtime.hardware import (
    HardwareProfile,
    check_hardware,
    get_profile,
    profile_for_device,
)

TENSORBOARD = "tensorboard"  # run-folder entries written here
PROFILE = "profile"


def _summary_writer_class() -> type:
    """tensorboardX's `SummaryWriter`, imported without PyTorch. tensorboardX imports torch whenever it
    is installed, only to name torch tensors in its type hints (2.2 s of every run's start on a 2-core
    machine); boostjax logs Python floats. A process that imported torch before keeps it."""
    absent = "torch" not in sys.modules
    if absent:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        return importlib.import_module("tensorboardX").SummaryWriter
    finally:
        if absent:
            del sys.modules["torch"]


SummaryWriter = _summary_writer_class()


def hardware_profile(name: str) -> HardwareProfile | None:
    """The named profile ('' = the one matching `jax.devices()[0].device_kind`, None when unknown)."""
    if name:
        check_hardware(name)  # ConfigError naming train.hardware
        return get_profile(name)

    return profile_for_device(jax.devices()[0].device_kind)


def mfu(flops_per_token: float, tokens_per_s: float, hw: HardwareProfile, devices: int) -> float:
    """Model FLOPs utilisation: achieved FLOPs/s over the devices' peak BF16 FLOPs/s (a fraction)."""
    return flops_per_token * tokens_per_s / (hw.bf16_flops * devices)


IN_FLIGHT = 2  # steps dispatched and not yet finished, at most: the device always has the next one queued


class FinishedSteps:
    """Counts dispatched steps once they have finished (an output of each is ready): `on_done(n)`
    (a progress bar's `update`) hears of steps done, not of steps dispatched."""

    def __init__(self, on_done: Callable[[int], Any]):
        self.running: deque[jax.Array] = deque()  # one output of each dispatched, unfinished step, oldest first
        self.on_done = on_done

    def dispatched(self, output: jax.Array) -> None:
        self.running.append(output)

    def wait(self, in_flight: int = IN_FLIGHT) -> int:
        """Count the steps that have finished, oldest first, waiting for them until at most `in_flight`
        are left running (0: all); returns how many were counted."""
        done = 0
        while self.running and (len(self.running) > in_flight or self.running[0].is_ready()):
            jax.block_until_ready(self.running.popleft())
            done += 1
        if done:
            self.on_done(done)
        return done


class TensorBoard:
    """The run's scalars as TensorBoard events (`<run>/tensorboard/`), one file per start."""

    def __init__(self, run_dir: pathlib.Path, start: int):
        # a unique, time-ordered file name (tensorboardX's own has whole seconds and the host name only)
        self._w = SummaryWriter(logdir=str(run_dir / TENSORBOARD), purge_step=start + 1, flush_secs=30,
                                filename_suffix=f".{time.time_ns()}")

    def log(self, record: dict) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                self._w.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        self._w.close()


class StepProfiler:
    """Traces the steps [start, stop) (0-based, see the module docstring) with `jax.profiler`."""

    def __init__(self, folder: pathlib.Path, span: tuple[int, int] | None, first_step: int):
        self.folder, self.active = folder, False
        # a resumed run traces what is left of the span (nothing when it lies before the resumed step)
        self.span = span if span and span[1] > first_step else None

    def before(self, step: int) -> Any:
        """Call before running step `step`; returns the context to run it in."""


        if self.span is None:
            return contextlib.nullcontext()
        a, b = self.span
        if not self.active and max(a, 0) <= step < b:
            self.folder.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.folder))
            self.active = True
        return jax.profiler.StepTraceAnnotation(f"step {step}", step_num=step) if self.active \
            else contextlib.nullcontext()

    def after(self, step: int, outputs: Any) -> None:
        """Call after step `step` has been dispatched; stops the trace once its last step is done."""

        if self.active and step + 1 >= self.span[1]:
            jax.block_until_ready(outputs)
            self.stop()

    def stop(self) -> None:
        if self.active:
            self.active = False
            self.span = None
            jax.profiler.stop_trace()
