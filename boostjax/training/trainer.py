"""The training loop behind `boostjax train`, usable from Python and notebooks.

    from boostjax import Config, ModelConfig, TrainConfig, train
    result = train(Config(ModelConfig(kind="cola"), TrainConfig(steps=200, out="runs/nb")))
    result.metrics[-1]["loss"], result.model(tokens)

`train` prepares the run in one pass (`boostjax.training.prepare`), builds the state (fresh, pretrained
or restored from the newest checkpoint that verifies) and loops; SIGINT / SIGTERM stop it after a step
with a consistent checkpoint, and in a multi-host job process 0 writes the files. The run folder, resume
and signals: docs/training.md and docs/run-folders.md.
"""

from __future__ import annotations

import json
import math
import pathlib
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from boostjax.config import Config, ConfigError, TrainConfig, parse_profile, warmup_steps
from boostjax.data.batches import BatchIterator, MixtureIterator, batch_iterator, eval_batches
from boostjax.data.corpus import Corpus, Mixture
from boostjax.data.source import install_run_tokenizer
from boostjax.interop import pretrained
from boostjax.models.flops import flops_per_token, param_count
from boostjax.models.llama import LLaMA, abstract_model, init_model
from boostjax.runs import relayout
from boostjax.runs.checkpoint import CheckpointError, Checkpointer
from boostjax.runs.folder import RunFolder
from boostjax.runtime import multihost
from boostjax.runtime.hardware import HardwareProfile
from boostjax.runtime.interrupt import StopSignals, phase
from boostjax.runtime.signals import TrainingInterrupted
from boostjax.training import distill, prepare
from boostjax.training.observe import PROFILE, FinishedSteps, StepProfiler, TensorBoard, hardware_profile, mfu
from boostjax.training.prepare import say as _say
from boostjax.training.prepare import stacked_layers
from boostjax.training.step import StepFns, build_step_fns, checkpoint_parts, from_checkpoint


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


@contextmanager
def _lock_if_main(folder: RunFolder) -> Iterator[None]:
    """Process 0 holds the run folder's lock (the other processes of a job share its folder)."""
    if multihost.is_main_process():
        with folder.lock():
            yield
    else:
        yield


def _fixes(t: TrainConfig) -> str:
    """Remedies for a diverged run, none of them a value that is already set."""
    out = [f"lower --lr (now {t.lr:g}; e.g. --lr {t.lr / 10:g})"]
    if t.clip == 0:
        out.append("clip gradients with --clip 1.0")
    if warmup_steps(t) < min(1000, t.steps // 10):
        out.append(f"raise --warmup (now {warmup_steps(t)} steps)")
    return ", ".join(out[:-1]) + (" or " if len(out) > 1 else "") + out[-1]


def _evaluate(fns: StepFns, params, batches: list[dict]) -> float:
    losses = [fns.eval_loss(params, fns.put_batch(b)) for b in batches]
    return float(np.mean(jax.device_get(losses)))


def _restore(ckpt: Checkpointer, params, opt_state, data: BatchIterator,
             other_layout: Callable[[], Any] | None = None) -> tuple[int, Any, Any, bool]:
    """Resume from the newest checkpoint that verifies and restores (damaged newer ones are moved to
    `checkpoints-aside/` with one line each): (step, params, opt_state, verified); step 0 when there
    is none. The target shardings are those of the live `params` / `opt_state` (this process's mesh,
    whatever mesh and device count wrote the checkpoint); `other_layout` reads a checkpoint written
    in the other layer layout instead (`boostjax.runs.relayout`)."""
    # CheckpointError when none restores
    newest = ckpt.latest_step()
    restored = phase(f"restoring checkpoint {newest} from {ckpt.directory} (its checksums verified first)"
                     + (", converting its layer layout" if other_layout else ""),
                     lambda _: other_layout() if other_layout else ckpt.restore_latest(params, opt_state))
    if restored is None:
        return 0, params, opt_state, True
    for step, why in restored.skipped:
        where = ckpt.set_aside(step, "damaged") if multihost.is_main_process() else None
        _say(f"checkpoint {step} in {ckpt.directory} cannot be restored ({why}); "
             f"moved to {where}; resuming from step {restored.step}")
    multihost.barrier("boostjax-damaged-set-aside")
    if not restored.verified:
        _say(f"checkpoint {restored.step} has no checksums (the run stopped before they were written, or an "
             f"older boostjax wrote it); restored without verification")
    data.restore(restored.data_state)
    if data.step != restored.step:
        raise CheckpointError(f"checkpoints: step {restored.step} in {ckpt.directory} holds the data position "
                              f"{data.step}; fix: move that checkpoint aside")
    return restored.step, restored.params, restored.opt_state, restored.verified


def train(cfg: Config, *, on_log: Callable[[dict], None] | None = None, init: Any = None) -> TrainResult:
    """Train (or resume) the run described by `cfg`; returns the metrics and final parameters.

    A new run starts from `cfg.train.init_from_hf` (a Hugging Face LLaMA folder, whose shapes replace
    the model's) or from `init` (a pure params dict or an `LLaMA` of `cfg.model`; for a low-rank kind
    also the dense params of the same shapes, factored by SVD): see `boostjax.interop.pretrained`. A resumed
    run continues from its checkpoint and reads neither.

    Raises `TrainingInterrupted` (a KeyboardInterrupt) after SIGINT/SIGTERM once a consistent
    checkpoint is saved, `NonFiniteLoss` when the loss diverges, `ConfigError` / `CheckpointError`
    for what cannot run (before anything is written or compiled where the configuration is at fault).
    """
    cfg = prepare.configure(cfg, init)  # 1-2. the configuration, resolved and validated (once per job)
    prepare.setup_processes(cfg)  # 3. join the job (once per job); what this host can run
    t = cfg.train
    folder = RunFolder(t.out)  # 4. the run folder
    if multihost.is_main_process():
        folder.check_target()
    with StopSignals(multi_process=jax.process_count() > 1, where=str(folder.path), bars=t.progress) as stop, \
            _lock_if_main(folder):
        stop.check_early()
        run = prepare.open_run(folder, cfg)  # the stored config, what a resume may change, the layout
        source, corpus = prepare.open_data(cfg)  # 5. the data
        # 6. the state: fresh, from pretrained weights, or restored from the newest checkpoint
        start_from, report = _start_from(cfg, init, corpus, run, folder)
        teacher = None
        if t.distill_from:  # read before any compile; a resumed run keeps its teacher
            teacher = distill.load(t.distill_from)
            distill.check_resume(folder.path, teacher, run.resuming)
        graphdef, like = abstract_model(cfg)
        fns = build_step_fns(cfg, graphdef, like, teacher=teacher)  # checks strategy, mesh and shapes on shapes alone
        stop.check_early()
        if start_from is not None:
            # a copy: the step donates its params, and `init` arrays are the caller's
            params = jax.tree.map(lambda p: jax.numpy.array(p, jax.numpy.float32), start_from[0])
        else:
            graphdef, params = init_model(cfg)
        multihost.barrier("boostjax-out-dir-checked")  # every process read the old config before it changes
        state = fns.init(params)
        params, opt_state = checkpoint_parts(state)
        data, val_sets = _batches(cfg, corpus, fns)
        if data.epochs(t.steps) > 1:
            _say(epochs_line(data, t.steps))
        open_ckpt = lambda: Checkpointer(folder.checkpoints, keep=t.keep_ckpts,  # noqa: E731
                                         primary=multihost.is_main_process())
        ckpt = open_ckpt() if run.resuming else None  # a new run's checkpoints/ comes after the compile
        try:
            other = (lambda: relayout.restore_latest(ckpt, cfg, abstract_model(cfg)[1], stacked_layers(run.old.train),
                                                     params, opt_state)) if run.convert else None
            start, params, opt_state, verified = (_restore(ckpt, params, opt_state, data, other) if run.resuming
                                                  else (0, params, opt_state, True))
            state = from_checkpoint(start, params, opt_state, state)
            folder.trim_metrics(start, write=False)  # a damaged metrics.jsonl is refused before the compile
            if report is not None:
                _say(pretrained.summary_line(report))
            step_fn, compile_s = _compile(cfg, fns, state, data.batch_at(start))
            stop.check_early()  # a stop up to here changes nothing in the run folder
            if ckpt is None:
                ckpt = open_ckpt()
            if multihost.is_main_process():
                _write_run_files(cfg, folder, start, run, source, report, teacher, fns)
            metrics = folder.trim_metrics(start, write=multihost.is_main_process())
            # 7. the loop
            loop_run = _LoopRun(cfg, graphdef, fns, step_fn, compile_s, ckpt, folder, stop, data, val_sets, on_log,
                                unverified=None if verified else start)
            result = _loop(loop_run, state, start, metrics)
            if start_from is not None:
                result.extra["init"] = start_from[1]
            return result
        finally:
            if ckpt is not None:
                ckpt.close()


def _start_from(cfg: Config, init: Any, corpus: Corpus | Mixture, run: Any, folder: RunFolder) -> tuple[Any, Any]:
    """(the pretrained start `(params, report)` or None, the init report or None) of a new run; a resumed
    run reads neither (`init` is then named unused)."""
    t = cfg.train
    start_from = None
    if not run.resuming and (t.init_from_hf or init is not None):  # read (and factored) before any compile
        start_from = pretrained.initial_params(cfg, init, corpus)
    elif init is not None:
        _say(f"resuming from the checkpoints in {folder.checkpoints}; the init= params are not used")
    report = start_from[1] if start_from is not None else (
        pretrained.fresh_report(cfg.model) if not run.resuming and cfg.model.low_rank else None)
    return start_from, report


def _batches(cfg: Config, corpus: Corpus | Mixture, fns: Any) -> tuple[BatchIterator, Any]:
    """The training batches and the validation sets of this process's block of each global batch's rows."""
    t = cfg.train
    share, count = fns.batch_share  # the block of each global batch's rows this process loads
    # packed documents where their boundaries are known (segment ids with --doc-mask), else random windows
    data = train_iterator(corpus, t.batch * t.grad_accum, t.seq, t.seed, segments=t.doc_mask,
                          vocab_size=cfg.model.vocab_size, process_index=share, process_count=count)
    val_sets = validation_sets(corpus, t.batch, t.seq, t.eval_batches, vocab_size=cfg.model.vocab_size,
                               process_index=share, process_count=count, segments=t.doc_mask)
    return data, val_sets


def _write_run_files(cfg: Config, folder: RunFolder, start: int, run: Any, source: Any, report: Any, teacher: Any,
                     fns: Any) -> None:
    """The main process's files of the run folder once the step compiled: the config, the tokenizer, the
    init report and the teacher's record."""
    folder.write_config(cfg, start, run.changes, run.data_fingerprint, source.mixture_record())
    install_run_tokenizer(folder.path, source)  # load_tokenizer(run folder) gives the run's
    one = source.parts[0].source if source.kind == "mixture" else source  # a mixture's folders share it
    pretrained.copy_tokenizer(pretrained.source_tokenizer(cfg, one), folder.path)
    if report is not None:
        pretrained.write_report(folder.path, report)
    if teacher is not None:
        distill.write_record(folder.path, teacher, fns.teacher)


def train_iterator(corpus: Corpus | Mixture, batch: int, seq: int, seed: int, **kwargs: Any) -> BatchIterator:
    """The run's batches: a `MixtureIterator` over a mixture's folders, else packed documents where
    their boundaries are known (segment ids with ``segments``), else random windows (`batch_iterator`)."""
    if isinstance(corpus, Mixture):
        return MixtureIterator([(c.train, c.train_docs) for _, _, c in corpus.parts], [w for _, w, _ in corpus.parts],
                               batch, seq, seed, names=[n for n, _, _ in corpus.parts],
                               **kwargs)  # type: ignore[return-value]
    return batch_iterator(corpus.train, corpus.train_docs, batch, seq, seed, **kwargs)


def validation_sets(corpus: Corpus | Mixture, batch: int, seq: int, n: int, **kwargs: Any) -> dict[str, tuple]:
    """The fixed validation batches, by the metric that averages them: ``{"val_loss": (1.0, batches)}``,
    or for a mixture ``{"val_loss/<name>": (weight, batches)}`` per folder (`val_record` adds their
    weighted mean as ``val_loss``)."""
    parts = corpus.parts if isinstance(corpus, Mixture) else (("", 1.0, corpus),)
    for _, _, c in parts:
        if n and len(c.val) < seq + 1:
            raise ConfigError(f"data: the validation split of {c.name} holds {len(c.val)} tokens, fewer than --seq + 1 = "
                              f"{seq + 1}; fix: a --seq below {len(c.val)}, or hold out more text (boostjax tokenize "
                              "--val-every with a smaller value)")
    return {f"val_loss/{name}" if name else "val_loss": (weight, eval_batches(c.val, batch, seq, n, docs=c.val_docs,
                                                                               **kwargs))
            for name, weight, c in parts}


def val_record(losses: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The metrics of one evaluation from {metric: (weight, loss)}: a mixture's ``val_loss`` is its
    folders' losses weighted by the mixture's weights (the expected loss on rows drawn as training
    draws them), beside each ``val_loss/<name>``."""
    if "val_loss" in losses:
        return {"val_loss": losses["val_loss"][1]}
    return {"val_loss": float(sum(w * v for w, v in losses.values())), **{k: v for k, (_, v) in losses.items()}}


def _count(n: float) -> str:
    """A token count in a few digits: 8,192; 52.4K; 4.92M; 1.20B."""
    if n < 10_000:
        return f"{int(n):,}"
    unit, scale = next((u, s) for u, s in (("B", 1e9), ("M", 1e6), ("K", 1e3)) if n >= 0.9995 * s)
    v = n / scale
    return f"{v:.2f}{unit}" if v < 10 else f"{v:.1f}{unit}" if v < 100 else f"{v:,.0f}{unit}"


def _epochs(e: float) -> str:
    """0.0012, 0.04, 4.00, 123.45: two decimals, or two significant digits below 0.1."""
    return f"{e:.2f}" if e >= 0.1 else f"{e:.2g}"


def epochs_unit(data: BatchIterator) -> str:
    """What `BatchIterator.epochs` counts: epochs of packed documents (of a mixture's most-read
    folder), or passes' worth of tokens of random windows (drawn with replacement, so no epoch boundary)."""
    return "epochs" if data.sampler in ("documents", "mixture") else "passes' worth of tokens"


def epochs_line(data: BatchIterator, steps: int) -> str:
    """The run's tokens against its training split's, and how the iterator samples them (said at the
    start when a run reads its data more than once)."""
    step_tokens = data.batch * data.seq
    if isinstance(data, MixtureIterator):
        each = ", ".join(f"{name} (weight {w:.3g}, {_count(len(it.tokens))} tokens) about {_epochs(e)} epochs"
                         for name, w, it, e in zip(data.names, data.weights, data.streams, data.stream_epochs(steps)))
        return (f"{steps:,} steps x {_count(step_tokens)} tokens = {_count(steps * step_tokens)} tokens drawn from "
                f"{len(data.streams)} training splits by weight: {each} (packed documents, each folder in its own "
                "order)")
    how = ("packed documents: each epoch trains every next-token pair of the split once, in a new order"
           if data.sampler == "documents" else
           "random windows drawn with replacement: no epoch boundary, some tokens are read more often "
           "than others")
    return (f"{steps:,} steps x {_count(step_tokens)} tokens = {_count(steps * step_tokens)} tokens over a "
            f"training split of {_count(len(data.tokens))} tokens: about {_epochs(data.epochs(steps))} "
            f"{epochs_unit(data)} ({how})")


def _compile(cfg: Config, fns: StepFns, state, batch: dict) -> tuple[Callable, float]:
    """The step compiled for `state` and `batch`, and the seconds it took (traced here, compiled in a
    `phase`: a signal stops the run during a long compile)."""
    t = cfg.train
    t0 = time.perf_counter()
    mesh = f", mesh {t.mesh}" if t.mesh else ""
    what = f"compiling the training step ({cfg.model.kind} {t.strategy}{mesh})"
    if fns.lower is None:
        return phase(what, lambda _: fns.compile(state, batch), after=0), time.perf_counter() - t0
    _say(what)  # said at once (every run compiles); tracing runs here, on the main thread, XLA in the phase
    compile_now = fns.lower(state, batch)
    return phase(what, lambda _: compile_now(), after=None), time.perf_counter() - t0


@dataclass
class _LoopRun:
    """What the training loop runs with besides the state: the compiled step and its functions, the
    data, where records and checkpoints go, and the stop signals."""

    cfg: Config
    graphdef: Any
    fns: StepFns
    step_fn: Callable
    compile_s: float
    ckpt: Checkpointer
    folder: RunFolder
    stop: StopSignals
    data: BatchIterator
    val_sets: dict[str, tuple]
    on_log: Callable[[dict], None] | None
    unverified: int | None = None  # the step restored without checksums (None: verified, or a new run)


class _Records:
    """The metrics records: appended to `metrics`, and on the main process written to metrics.jsonl
    (and TensorBoard), then passed to `on_log`."""

    def __init__(self, run: _LoopRun, start: int, metrics: list[dict]):
        main = multihost.is_main_process()
        self.metrics, self.on_log = metrics, run.on_log
        self.writer = open(run.folder.metrics_path, "a") if main else None
        self.board = TensorBoard(run.folder.path, start) if main and run.cfg.train.tensorboard else None

    def log(self, record: dict) -> None:
        self.metrics.append(record)
        if self.writer:
            self.writer.write(json.dumps(record) + "\n")
            self.writer.flush()
        if self.board:
            self.board.log(record)
        if self.on_log:
            self.on_log(record)

    def close(self) -> None:
        if self.writer:
            self.writer.close()
        if self.board:
            self.board.close()


class _Meter:
    """The steps dispatched but not yet fetched, and the interval they ran in: `flush` fetches their
    metrics, stops on a non-finite one and logs the newest with its speed (and MFU)."""

    def __init__(self, run: _LoopRun, records: _Records, bar: tqdm, start: int, hw: HardwareProfile | None):
        t = run.cfg.train
        self.run, self.records, self.bar, self.start = run, records, bar, start
        self.tokens_per_step = t.batch * t.grad_accum * t.seq  # all micro-batches of one optimizer step
        self.flops_per_token = flops_per_token(run.cfg.model, t.seq)
        self.hw, self.devices = hw, t.sizes.devices  # hw None: no MFU (a CPU, an unknown GPU)
        self.lines = multihost.is_main_process() and not t.progress  # --no-progress: a plain line per record
        self.pending: list[tuple[int, Any]] = []  # (step, device metrics) not yet fetched
        self.loop_t0 = self.interval_t0 = time.perf_counter()
        self.interval_steps = 0
        self.first_loss: float | None = None  # of this invocation: step start + 1 (a resumed run's metrics hold older ones)
        self.finished = FinishedSteps(bar.update)  # the bar counts finished steps; the loop runs IN_FLIGHT ahead

    def dispatched(self, step: int, m: Any) -> None:
        self.interval_steps += 1
        self.pending.append((step, m))
        self.finished.dispatched(m["loss"])
        self.finished.wait()

    def flush(self, record: bool = True) -> None:
        """Fetch the pending steps' metrics, stop on a non-finite one, log the newest."""
        run, pending = self.run, self.pending
        fetched = jax.device_get([m for _, m in pending])
        self.finished.wait(0)
        for (s, _), m in zip(pending, fetched):
            if not (math.isfinite(float(m["loss"])) and math.isfinite(float(m["grad_norm"]))):
                raise _diverged(run.cfg, run.ckpt, s, float(m["loss"]), float(m["grad_norm"]), run.unverified)
        if pending and self.first_loss is None and pending[0][0] == self.start + 1:
            self.first_loss = float(fetched[0]["loss"])
        if pending and record:
            self._log(pending[-1][0], fetched[-1])
        self.pending = []
        self.interval_t0, self.interval_steps = time.perf_counter(), 0

    def _log(self, s: int, m: dict) -> None:
        """The record of step `s` (its metrics `m`): loss, learning rate and the interval's speed."""
        step_s = (time.perf_counter() - self.interval_t0) / max(self.interval_steps, 1)
        rec = {"step": s, "loss": float(m["loss"]), **{k: float(m[k]) for k in ("kl", "ce") if k in m},
               "grad_norm": float(m["grad_norm"]),
               "lr": float(m["lr"]), "step_s": step_s, "tokens_per_s": self.tokens_per_step / step_s,
               "tflops_per_s": self.flops_per_token * self.tokens_per_step / step_s / 1e12}
        if self.hw is not None:
            rec["mfu"] = mfu(self.flops_per_token, rec["tokens_per_s"], self.hw, self.devices)
        self.records.log(rec)
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}",
                             **({"mfu": f"{100 * rec['mfu']:.3g}%"} if "mfu" in rec else {}))
        if self.lines:
            print(f"boostjax: step {s}/{self.run.cfg.train.steps}, loss {rec['loss']:.4f}, "
                  f"{rec['tokens_per_s']:.0f} tokens/s, elapsed {tqdm.format_interval(time.perf_counter() - self.loop_t0)}",
                  file=sys.stderr, flush=True)


def _progress_bar(run: _LoopRun, start: int) -> tqdm:
    """The step bar (main process, `--progress`), named by model, strategy and pipeline bubble."""
    t, info = run.cfg.train, run.fns.info
    bubble = f" bubble {info['bubble_fraction']:.0%}" if "bubble_fraction" in info else ""
    return tqdm(total=t.steps, initial=start, disable=not t.progress or not multihost.is_main_process(),
                desc=f"{run.cfg.model.kind} {t.strategy}" + bubble, unit="step", dynamic_ncols=True)


def _evaluate_record(run: _LoopRun, state, at: int) -> dict:
    """The validation record of step `at`."""
    return {"step": at, **val_record({k: (w, _evaluate(run.fns, state.params, b)) for k, (w, b) in run.val_sets.items()})}


def _evaluate_at_start(run: _LoopRun, state, records: _Records, meter: _Meter) -> None:
    """The validation loss before the first update (a resume, or a restart of one, does not repeat it)."""
    records.log(_evaluate_record(run, state, 0))
    before = records.metrics[-1]["val_loss"]
    meter.bar.set_postfix(val=f"{before:.3f}")
    if meter.lines:
        print(f"boostjax: step 0/{run.cfg.train.steps}, val_loss {before:.4f}", file=sys.stderr, flush=True)
    meter.interval_t0 = time.perf_counter()


def _stop_on_signal(run: _LoopRun, state, step: int, saved: int, meter: _Meter) -> None:
    """After a stop signal: the checkpoint of `step` (unless diverged or saved), then TrainingInterrupted."""
    ckpt, stop = run.ckpt, run.stop
    stop.saving = f"saving the checkpoint of step {step}"
    meter.flush(record=False)  # a diverged step is never saved
    if step > saved:
        ckpt.save(step, *checkpoint_parts(state), run.data.state())
        saved = step
    ckpt.wait()
    name = signal.Signals(stop.signum).name
    where = (f"checkpoint {saved} is in {ckpt.directory}" if saved else "no checkpoint was written yet")
    raise TrainingInterrupted(f"stopped by {name} after step {step}; {where}; resume with the same "
                              f"command (--out {run.folder.path})", stop.signum, saved or None)


def _loop(run: _LoopRun, state, start: int, metrics: list[dict]) -> TrainResult:
    """Train from step `start` to `--steps`: log every `--log-every`, evaluate every `--eval-every`,
    checkpoint every `--ckpt-every` and at the end; `metrics` (the run's records so far) gains this
    invocation's. Raises TrainingInterrupted after a stop signal (its checkpoint saved) and
    NonFiniteLoss when the loss diverges."""
    t, fns, ckpt, data, stop = run.cfg.train, run.fns, run.ckpt, run.data, run.stop
    hw = hardware_profile(t.hardware)  # checked before anything is opened
    records = _Records(run, start, metrics)
    profiler = StepProfiler(run.folder.path / PROFILE if jax.process_count() == 1
                            else run.folder.path / PROFILE / f"process-{jax.process_index()}",
                            parse_profile(t.profile, t.steps), start)
    if fns.info:  # e.g. the pipeline's schedule and bubble fraction, logged once per (re)start
        records.log({"step": start, **fns.info})
    bar = _progress_bar(run, start)
    meter = _Meter(run, records, bar, start, hw)
    step = saved = start
    if t.eval_at_start and start == 0 and not any(m["step"] == 0 and "val_loss" in m for m in metrics):
        _evaluate_at_start(run, state, records, meter)
    try:
        while step < t.steps and not (stop.requested and not stop.multi_process):
            batch = fns.put_batch(data.next())
            with profiler.before(step):
                state, m = run.step_fn(state, batch)
            profiler.after(step, (state, m))
            step += 1
            meter.dispatched(step, m)
            if step % t.log_every == 0 or step % t.ckpt_every == 0 or step == t.steps:
                meter.flush()
            if step % t.eval_every == 0 or step == t.steps:
                records.log(_evaluate_record(run, state, step))
            if step % t.ckpt_every == 0 or step == t.steps:
                ckpt.save(step, *checkpoint_parts(state), data.state())
                saved = step
            if stop.should_stop(step):
                break
        if stop.requested and step < t.steps:
            _stop_on_signal(run, state, step, saved, meter)
    finally:
        profiler.stop()
        bar.close()
        records.close()

    read = f"{_epochs(data.epochs(step))} {epochs_unit(data)}"
    summary = _summary(run.cfg, fns, metrics, start, step, meter.first_loss, run.compile_s, ckpt, meter.hw,
                       meter.devices, read)
    return TrainResult(run.cfg, metrics, fns.to_canonical(state.params), run.graphdef, run.folder.path,
                       resumed_from=start or None, summary=summary,
                       extra={"compile_s": run.compile_s, "epochs": data.epochs(t.steps), **fns.info})


def _summary(cfg: Config, fns: StepFns, metrics: list[dict], start: int, step: int, first_loss: float | None,
             compile_s: float, ckpt: Checkpointer, hw, devices: int, read: str = "") -> str:
    """The run's one line: this invocation's steps (and the step it resumed from), its first and last
    loss, the last validation loss, how far the data has been read by the last step (`read`: "0.04
    epochs"), the median tokens/s (and MFU) of its records."""
    t = cfg.train
    mine = [m for m in metrics if m["step"] > start]  # this invocation's records
    final = next((m["loss"] for m in reversed(mine) if "loss" in m), float("nan"))
    val = next((m["val_loss"] for m in reversed(metrics) if "val_loss" in m), float("nan"))
    before = next((m["val_loss"] for m in metrics if m["step"] == 0 and "val_loss" in m), None)
    vals = f"val {before:.3f} -> {val:.3f}" if before is not None else f"val {val:.3f}"
    speed = [m["tokens_per_s"] for m in mine if "tokens_per_s" in m]
    mfus = [m["mfu"] for m in mine if "mfu" in m]
    mfu_note = f" (MFU {100 * np.median(mfus):.3g}% of {devices} x {hw.name})" if mfus else ""
    resumed = f" (resumed from {start})" if start else ""
    if step == start:  # a finished run started again: no step to report
        losses = "nothing left to train"
    else:
        losses = f"loss {first_loss if first_loss is not None else float('nan'):.3f} -> {final:.3f}"
    summary = (
        f"done: {cfg.model.kind} ({param_count(cfg.model) / 1e6:.2f}M params) {t.strategy}, "
        f"steps {start}->{step}{resumed}, {losses} ({vals}), {read + ', ' if read else ''}"
        f"{np.median(speed) if speed else float('nan'):.0f} tok/s{mfu_note}, compile {compile_s:.1f}s, "
        f"checkpoints in {ckpt.directory}"
    )
    if fns.teacher:
        steps_s = [m["step_s"] for m in mine if "step_s" in m]
        summary += (f"; teacher {cfg.train.distill_from}: {fns.teacher['params'] / 1e6:.2f}M params, "
                    f"{fns.teacher['param_bytes'] / 2**20:.1f} MiB ({fns.teacher['param_bytes_per_device'] / 2**20:.1f} "
                    f"MiB on the fullest device), logits {fns.teacher['logits_bytes'] / 2**20:.1f} MiB a step; "
                    f"step {np.median(steps_s) if steps_s else float('nan'):.3g} s with it")
    if "bubble_fraction" in fns.info:
        summary += (f"; pipeline {fns.info['schedule']} P={fns.info['stages']} M={fns.info['microbatches']}, "
                    f"bubble {fns.info['bubble_fraction']:.1%}")
    return summary


def _diverged(cfg: Config, ckpt: Checkpointer, step: int, loss: float, grad_norm: float,
              unverified: int | None) -> NonFiniteLoss:
    """The error for a non-finite loss at `step`. The parameters that produced it are those of step
    `step - 1`: if that step was checkpointed, the checkpoint is moved aside, so the newest one left
    is one whose parameters gave a finite loss and gradient."""
    ckpt.wait()
    bad = step - 1
    moved = ""
    if bad in ckpt.steps():
        where = ckpt.set_aside(bad, "nonfinite") if multihost.is_main_process() else None
        moved = f"checkpoint {bad} (whose parameters produced it) was moved to {where}; "
    good = ckpt.latest_step()
    kept = f"the last good checkpoint is step {good}" if good else "no good checkpoint is left (a rerun starts at step 0)"
    fix = _fixes(cfg.train)
    if unverified is not None and unverified == good:
        fix = (f"checkpoint {good} was restored without checksums and may be damaged: if a rerun diverges again, "
               f"move {ckpt.directory / str(good)} aside; otherwise {fix}")
    return NonFiniteLoss(f"non-finite loss {loss} (grad norm {grad_norm}) at step {step}; stopped; {moved}{kept}; "
                         f"fix: {fix}")
