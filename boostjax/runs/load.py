"""Reading a finished (or interrupted) run folder back: its config, metrics and newest good weights.

Readers never change the folder: a damaged checkpoint is reported (one line on stderr) and the
newest one that verifies is read instead; a folder with no restorable checkpoint is a
`CheckpointError` naming it and the fix.
"""

from __future__ import annotations

import pathlib
import sys

from flax import nnx

from boostjax.runs.checkpoint import Checkpointer
from boostjax.config import Config, ConfigError
from boostjax.models.llama import LLaMA
from boostjax.runs.folder import CONFIG, METRICS, read_jsonl, read_run_config


def _run_dir(run_dir: str | pathlib.Path) -> pathlib.Path:
    p = pathlib.Path(run_dir)
    if not p.is_dir():
        raise ConfigError(f"run: {p} is not a folder; fix: pass the --out folder of a boostjax train run")
    return p


def read_config(run_dir: str | pathlib.Path) -> Config:
    path = _run_dir(run_dir) / CONFIG
    if not path.exists():
        raise ConfigError(f"run: no {CONFIG} in {run_dir}; fix: pass the --out folder of a boostjax train run")
    return read_run_config(path)


def read_metrics(run_dir: str | pathlib.Path) -> list[dict]:
    """The run's metrics records (a record cut short by a kill at the end is skipped)."""
    return read_jsonl(_run_dir(run_dir) / METRICS)


def load_run(run_dir: str | pathlib.Path, step: int | None = None) -> tuple[Config, LLaMA, int]:
    """(config, model with the checkpoint's weights, step) of a run folder: the newest checkpoint
    that verifies and restores by default, or `step`."""
    cfg = read_config(run_dir)
    ckpt = Checkpointer(pathlib.Path(run_dir) / "checkpoints", async_save=False, writer=False)
    try:
        step, params, skipped = ckpt.restore_params(step)
    finally:
        ckpt.close()
    for s, why in skipped:
        print(f"boostjax: checkpoint {s} in {ckpt.directory} cannot be restored ({why}); read step {step} instead",
              file=sys.stderr)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: LLaMA(cfg.model, rngs=nnx.Rngs(0))))
    return cfg, nnx.merge(graphdef, params), step
