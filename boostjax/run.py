"""Reading a finished (or interrupted) run folder back: its config, metrics and latest weights."""

from __future__ import annotations

import json
import pathlib

from flax import nnx

from boostjax.checkpoint import Checkpointer
from boostjax.config import Config
from boostjax.models.llama import LLaMA


def read_config(run_dir: str | pathlib.Path) -> Config:
    path = pathlib.Path(run_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"run: no config.json in {run_dir}; fix: pass the --out folder of a boostjax train run")
    return Config.from_dict(json.loads(path.read_text()))


def read_metrics(run_dir: str | pathlib.Path) -> list[dict]:
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def load_run(run_dir: str | pathlib.Path, step: int | None = None) -> tuple[Config, LLaMA, int]:
    """(config, model with the checkpoint's weights, step) of a run folder (latest step by default)."""
    cfg = read_config(run_dir)
    ckpt = Checkpointer(pathlib.Path(run_dir) / "checkpoints", keep=cfg.train.keep_ckpts, async_save=False)
    try:
        step = ckpt.latest_step() if step is None else step
        params = ckpt.restore_params(step)
    finally:
        ckpt.close()
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: LLaMA(cfg.model, rngs=nnx.Rngs(0))))
    return cfg, nnx.merge(graphdef, params), step
