"""The training loop behind `boostjax train`, usable from Python and notebooks.

    from boostjax import Config, ModelConfig, TrainConfig, train
    result = train(Config(ModelConfig(kind="cola"), TrainConfig(steps=200, out="runs/nb")))
    result.metrics[-1]["loss"], result.model(tokens)

A run folder holds `config.json`, `metrics.jsonl` (one JSON object per logged step) and Orbax
`checkpoints/`. Starting a run in a folder that has checkpoints resumes from the latest one; the
data iterator's position is part of the checkpoint, so the resumed losses equal an uninterrupted run's.
In a multi-host job (`boostjax.multihost`) every process runs `train`; process 0 writes the files.
"""

from __future__ import annotations

import json
import math
import pathlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from boostjax import multihost
from boostjax.checkpoint import Checkpointer
from boostjax.config import Config, ConfigError, TrainConfig, parse_mesh, validate
from boostjax.data import BatchIterator, eval_batches, load_corpus
from boostjax.models.flops import flops_per_token, param_count
from boostjax.models.llama import LLaMA
from boostjax.step import StepFns, build_step_fns


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


@dataclass
class TrainResult:
    config: Config
    metrics: list[dict]
    params: Any
    graphdef: Any
    out_dir: pathlib.Path
    resumed_from: int | None = None
    summary: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def model(self) -> LLaMA:
        """The trained model (fp32 parameters on the host's default device; in a multi-host job every
        process must ask for it, since the parameters are gathered from all of them)."""
        return nnx.merge(self.graphdef, multihost.host_copy(self.params))

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics if "loss" in m]


def init_model(cfg: Config) -> tuple[Any, dict]:
    """(graphdef, fp32 parameter dict) of a freshly initialised model."""
    model = LLaMA(cfg.model, rngs=nnx.Rngs(params=cfg.train.seed))
    graphdef, state = nnx.split(model)
    return graphdef, state.to_pure_dict()


def _write_atomic(path: pathlib.Path, text: str) -> None:
    """Replace `path` in one step, so other processes never read half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def stacked_layers(t: TrainConfig) -> bool:
    """Whether a run's training state keeps its layers stacked (pipeline stages, `stage` > 1)."""
    return parse_mesh(t.mesh).get("stage", 1) > 1


def _prepare_out_dir(cfg: Config) -> pathlib.Path:
    out = pathlib.Path(cfg.train.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.json"
    if cfg_path.exists() and (out / "checkpoints").exists():
        old = Config.from_dict(json.loads(cfg_path.read_text()))
        if old.model != cfg.model:
            raise ConfigError(
                f"out: {out} holds a run of a different model; fix: pass another --out or the same model flags"
            )
        was, now = stacked_layers(old.train), stacked_layers(cfg.train)
        if was != now:
            layout = {True: "stacked layers (a stage mesh)", False: "per-layer parameters (no stage axis)"}
            raise ConfigError(f"train.mesh: {out} holds checkpoints with {layout[was]} but this mesh trains "
                              f"{layout[now]}; fix: resume {'with' if was else 'without'} stage > 1 in --mesh, "
                              f"or pass another --out")
    multihost.barrier("boostjax-out-dir-checked")  # every process read the old config before it changes
    if multihost.is_main_process():
        _write_atomic(cfg_path, cfg.to_json() + "\n")
    return out


def _trim_metrics(path: pathlib.Path, last_step: int) -> list[dict]:
    """Keep the records up to the checkpoint we resume from (later ones are recomputed)."""
    if not path.exists():
        return []
    kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [m for m in kept if m["step"] <= last_step]
    if multihost.is_main_process():
        _write_atomic(path, "".join(json.dumps(m) + "\n" for m in kept))
    return kept


def _evaluate(fns: StepFns, params, batches: list[dict]) -> float:
    losses = [fns.eval_loss(params, fns.put_batch(b)) for b in batches]
    return float(np.mean(jax.device_get(losses)))


def train(cfg: Config, *, on_log: Callable[[dict], None] | None = None) -> TrainResult:
    """Train (or resume) the run described by `cfg`; returns the metrics and final parameters."""
    validate(cfg)
    t = cfg.train
    multihost.setup(t)  # joins a multi-host job before JAX starts (a no-op for one process or if done)
    corpus = load_corpus(t.data, t.data_dtype)
    graphdef, params = init_model(cfg)
    fns = build_step_fns(cfg, graphdef, params)  # checks strategy, mesh and shapes: nothing written yet
    out = _prepare_out_dir(cfg)
    params, opt_state = fns.init(params)

    ckpt = Checkpointer(out / "checkpoints", keep=t.keep_ckpts)
    start = ckpt.latest_step() or 0
    share, count = fns.batch_share  # the block of each global batch's rows this process loads
    data = BatchIterator(corpus.train, t.batch, t.seq, t.seed, vocab_size=cfg.model.vocab_size,
                         process_index=share, process_count=count)
    if start:
        params, opt_state, data_state = ckpt.restore(start, params, opt_state)
        data.restore(data_state)
    metrics_path = out / "metrics.jsonl"
    metrics = _trim_metrics(metrics_path, start)
    val_batches = eval_batches(corpus.val, t.batch, t.seq, t.eval_batches, vocab_size=cfg.model.vocab_size,
                               process_index=share, process_count=count)

    t0 = time.perf_counter()
    step_fn = fns.compile(params, opt_state, data.batch_at(start))
    compile_s = time.perf_counter() - t0
    tokens_per_step = t.batch * t.seq
    fpt = flops_per_token(cfg.model, t.seq)
    writer = open(metrics_path, "a") if multihost.is_main_process() else None

    def log(record: dict) -> None:
        metrics.append(record)
        if writer:
            writer.write(json.dumps(record) + "\n")
            writer.flush()
        if on_log:
            on_log(record)

    if fns.info:  # e.g. the pipeline's schedule and bubble fraction, logged once per (re)start
        log({"step": start, **fns.info})
    pending: list[tuple[int, Any]] = []  # (step, device metrics) not yet fetched
    last_good = start
    bar = tqdm(total=t.steps, initial=start, disable=not t.progress or not multihost.is_main_process(),
               desc=f"{cfg.model.kind} {t.strategy}" + (f" bubble {fns.info['bubble_fraction']:.0%}"
                                                         if "bubble_fraction" in fns.info else ""),
               unit="step", dynamic_ncols=True)
    interval_t0, interval_steps = time.perf_counter(), 0
    step = start
    first_loss = next((m["loss"] for m in metrics if "loss" in m), None)

    def flush_pending() -> None:
        nonlocal pending, last_good, interval_t0, interval_steps, first_loss
        fetched = jax.device_get([m for _, m in pending])
        for (s, _), m in zip(pending, fetched):
            if not (math.isfinite(float(m["loss"])) and math.isfinite(float(m["grad_norm"]))):
                raise NonFiniteLoss(
                    f"non-finite loss {float(m['loss'])} (grad norm {float(m['grad_norm'])}) at step {s}; "
                    f"stopped, the last good checkpoint "
                    f"(step {ckpt.latest_step()}) is kept; fix: lower --lr, raise --warmup or use --clip 1.0"
                )
        if pending:
            elapsed = time.perf_counter() - interval_t0
            s, m = pending[-1][0], fetched[-1]
            step_s = elapsed / max(interval_steps, 1)
            rec = {"step": s, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                   "lr": float(m["lr"]), "step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
                   "tflops_per_s": fpt * tokens_per_step / step_s / 1e12}
            first_loss = first_loss if first_loss is not None else float(fetched[0]["loss"])
            log(rec)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
            last_good = s
        pending = []
        interval_t0, interval_steps = time.perf_counter(), 0

    try:
        while step < t.steps:
            batch = fns.put_batch(data.next())
            params, opt_state, m = step_fn(params, opt_state, batch)
            step += 1
            interval_steps += 1
            pending.append((step, m))
            bar.update(1)
            if step % t.log_every == 0 or step % t.ckpt_every == 0 or step == t.steps:
                flush_pending()
            if step % t.eval_every == 0 or step == t.steps:
                log({"step": step, "val_loss": _evaluate(fns, params, val_batches)})
            if step % t.ckpt_every == 0 or step == t.steps:
                ckpt.save(step, params, opt_state, data.state())
    except KeyboardInterrupt:
        flush_pending()
        if last_good == step and step > (ckpt.latest_step() or 0):
            ckpt.save(step, params, opt_state, data.state())
        raise
    finally:
        bar.close()
        ckpt.wait()
        ckpt.close()
        if writer:
            writer.close()

    final = next(m for m in reversed(metrics) if "loss" in m) if metrics else {}
    val = next((m["val_loss"] for m in reversed(metrics) if "val_loss" in m), float("nan"))
    speed = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m and m["step"] > start]
    summary = (
        f"done: {cfg.model.kind} ({param_count(cfg.model) / 1e6:.2f}M params) {t.strategy}, "
        f"steps {start}->{step}, loss {first_loss if first_loss is not None else float('nan'):.3f} -> "
        f"{final.get('loss', float('nan')):.3f} (val {val:.3f}), "
        f"{np.median(speed) if speed else float('nan'):.0f} tok/s, compile {compile_s:.1f}s, "
        f"checkpoints in {out / 'checkpoints'}"
    )
    if "bubble_fraction" in fns.info:
        summary += (f"; pipeline {fns.info['schedule']} P={fns.info['stages']} M={fns.info['microbatches']}, "
                    f"bubble {fns.info['bubble_fraction']:.1%}")
    return TrainResult(cfg, metrics, fns.to_canonical(params), graphdef, out, resumed_from=start or None,
                       summary=summary, extra={"compile_s": compile_s, **fns.info})
