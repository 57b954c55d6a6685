"""A run is prepared in one pass, each stage once and in this order (`boostjax.training.trainer.train`
runs them; `boostjax train` runs the first three itself, and `train` sees them done):

1. resolve the configuration: `resolve_config(flags, preset)` turns a command line's flags (or a
   notebook's dict of them) into a `Config`: the preset's shapes, or a Hugging Face checkpoint's
   (`--init-from-hf`), a stored run's `FOLLOW_STORED` fields, a tokenised folder's vocabulary. A
   `Config` built in Python gets the checkpoint's shapes in `configure`;
2. validate it all: `boostjax.training.checks.validate` (once per config object; `configure`);
3. set up the processes: join a multi-host job (`boostjax.runtime.multihost.setup`, once per job),
   then check what this host can run (`check_host`: memory without an accelerator, the attention
   kernel on this backend) (`setup_processes`);
4. open the run folder: the stored configuration, what a resume may change, the checkpoints' layer
   layout and the run's tokenizer (`open_run`);
5. open the data: the source `validate` resolved (`boostjax.data.source`: resolved once per process
   while its files are unchanged), read into its train and validation streams (`open_data`);
6. build the state (fresh, pretrained or restored) and 7. loop: `boostjax.training.trainer`.

Every refusal up to stage 5 is one line naming the field and the fix, before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping

import jax

from boostjax.config import CALIBRATED_FACTORS, Config, ConfigError, ModelConfig, TrainConfig, flag_of, is_validated
from boostjax.config import preset as preset_shapes
from boostjax.data.corpus import Corpus, Mixture
from boostjax.data.source import Source, check_run_tokenizer, open_source, resolve_source
from boostjax.data.token_folder import is_token_folder
from boostjax.interop import pretrained
from boostjax.models import attention
from boostjax.models.flops import param_count
from boostjax.models.llama import abstract_model
from boostjax.runs import relayout
from boostjax.runs.checkpoint import step_dirs
from boostjax.runs.folder import FOLLOW_STORED, FOLLOW_STORED_TRAIN, RunFolder
from boostjax.runtime import allocator, multihost
from boostjax.runtime.devices import simulate_for_mesh
from boostjax.training import checks

MODEL_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(ModelConfig))
TRAIN_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(TrainConfig))
DEFAULT_PRESET = "tiny"


def say(msg: str) -> None:
    """One line on stderr from process 0 (what happened to a checkpoint, where a run stopped)."""
    if multihost.is_main_process():
        print(f"boostjax: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- 1. the configuration


def resolve_config(flags: Mapping[str, Any], preset: str | None = None) -> Config:
    """The `Config` of `boostjax train`'s flags (not yet validated: `boostjax.training.checks.validate`).

    ``flags``: `ModelConfig` / `TrainConfig` field names and values (None: not given); ``preset``: the
    model shapes (default: tiny), which the model flags override. With ``init_from_hf`` the shapes are
    the checkpoint's (`boostjax.interop.pretrained.config_from_flags`). Otherwise a model field that
    is not given takes a tokenised ``data`` folder's vocabulary (``vocab_size``), and a stored run's
    value in ``out`` (`FOLLOW_STORED`: fields whose default changed), so the same command resumes a
    run of an older boostjax unchanged.

        cfg = validate(resolve_config({"d_model": 64, "data": "data/tok", "out": "runs/nb"}, "tiny"))
    """
    given = {k: v for k, v in flags.items() if v is not None}
    unknown = sorted(set(given) - MODEL_FIELDS - TRAIN_FIELDS)
    if unknown:
        raise ConfigError(f"config: {unknown[0]!r} is not a ModelConfig or TrainConfig field; fix: pass field names "
                          "(boostjax train --help lists them as flags)")
    if given.get("init_from_hf"):  # the shapes are the checkpoint's
        return pretrained.config_from_flags(given, preset_given=preset is not None)
    model_given = {k: v for k, v in given.items() if k in MODEL_FIELDS}
    if "vocab_size" not in given:  # a tokenised --data folder names its vocabulary
        vocab = data_vocab(given.get("data", ""), given.get("data_dtype", TrainConfig.data_dtype))
        if vocab is not None:
            model_given["vocab_size"] = vocab
    model = preset_shapes(preset or DEFAULT_PRESET, **model_given)
    train = TrainConfig(**{k: v for k, v in given.items() if k in TRAIN_FIELDS})
    return follow_stored(Config(model, train), given)


def data_vocab(data: Any, dtype: Any) -> int | None:
    """The vocabulary a tokenised ``--data`` folder names; None for any other data (and for data that
    cannot be read: `validate` names the problem in its turn, except a damaged tokenised folder's)."""
    if not isinstance(data, str):
        return None
    try:
        return resolve_source(data, dtype, mixtures=True).vocab
    except ValueError as e:
        if is_token_folder(data):
            raise ConfigError(str(e)) from None
        return None


def follow_stored(cfg: Config, given: Mapping[str, Any]) -> Config:
    """A run folder's stored values of the fields whose default changed (`FOLLOW_STORED`,
    `FOLLOW_STORED_TRAIN`) when the flags do not give them: the same command resumes a run of an older
    boostjax unchanged."""
    out = cfg.train.out
    try:
        stored = RunFolder(out).stored_config() if isinstance(out, str) and out.strip() else None
    except (OSError, ValueError):  # an unreadable folder or config: opening the run folder names the problem
        stored = None
    if stored is None:
        return cfg
    model = dataclasses.replace(cfg.model, **{k: getattr(stored.model, k) for k in FOLLOW_STORED if k not in given})
    train = dataclasses.replace(cfg.train, **{k: getattr(stored.train, k) for k in FOLLOW_STORED_TRAIN
                                              if k not in given})
    return Config(model, train)


# ----------------------------------------------------------------------------- 2. validate


def configure(cfg: Config, init: Any = None) -> Config:
    """`cfg` with a Hugging Face checkpoint's shapes (`boostjax.interop.pretrained.resolve_config`),
    validated unless it was already (the CLI validates once per job); `init` params and a checkpoint
    are not both given."""
    cfg = pretrained.resolve_config(cfg) if isinstance(cfg, Config) else cfg
    if not is_validated(cfg):
        cfg = checks.validate(cfg)
    if init is not None and cfg.train.init_from_hf:
        raise ConfigError("train.init: both init= params and init_from_hf are given; fix: pass one of them")
    if cfg.train.init_factor in CALIBRATED_FACTORS and init is None and not cfg.train.init_from_hf:
        raise ConfigError(f"train.init_factor: {cfg.train.init_factor} factors pretrained weights, and a random "
                          f"init has none; "
                          f"fix: pass {flag_of('init_from_hf')} PATH (or init= dense params), or drop "
                          f"{flag_of('init_factor')}")
    return cfg


# ----------------------------------------------------------------------------- 3. the processes


STATE_BYTES_PER_PARAM = 16  # fp32 weights, gradients and two Adam moments


def check_fits_host(cfg: Config) -> None:
    """On a machine without accelerators, refuse a model whose training state alone exceeds its memory."""
    if jax.default_backend() != "cpu":
        return
    need = param_count(cfg.model) * STATE_BYTES_PER_PARAM
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ConfigError(f"model: {param_count(cfg.model) / 1e9:.2f} B parameters need about {need / 1e9:.0f} GB "
                          f"for fp32 weights, gradients and Adam state, but this machine has {have / 1e9:.0f} GB and "
                          f"no accelerator; fix: a smaller --preset or shape flags, or a machine with accelerators")


def check_host(cfg: Config) -> None:
    """What this host's backend (started here) can run: the training state in memory without an
    accelerator, the attention kernel (`--attention cudnn` needs a CUDA GPU)."""
    check_fits_host(cfg)
    attention.check_backend(cfg.model, cfg.train.dtype)


def setup_processes(cfg: Config, simulate: bool = False) -> None:
    """Join the multi-host job `cfg` describes (a no-op for one process) before JAX starts, then
    `check_host`; once per job (a second call for the same config does nothing). ``simulate``: a
    single process simulates the mesh's CPU devices (the CLI; from Python, `boostjax.simulate_devices`).
    A process that starts JAX here keeps its steps' scratch memory (`boostjax.runtime.allocator`)."""
    t = cfg.train
    allocator.keep_scratch_memory()  # reads BOOSTJAX_KEEP_SCRATCH every time: a bad value is refused
    if multihost.is_set_up(t):
        return
    if multihost.setup(t) is None and simulate:
        simulate_for_mesh(t.mesh)
    check_host(cfg)


# ----------------------------------------------------------------------------- 4. the run folder


@dataclass(frozen=True)
class Resume:
    """What the run folder holds for this run."""

    old: Config | None  # the stored configuration (None: a new run folder)
    resuming: bool  # the folder holds checkpoints
    changes: dict[str, list]  # the fields that differ from the stored ones
    convert: bool  # the checkpoints' layer layout is converted (`boostjax.runs.relayout`)
    data_fingerprint: str  # the content of --data (`boostjax.data.fingerprint`), stored in config.json


def stacked_layers(t: TrainConfig) -> bool:
    """Whether a run's training state keeps its layers stacked (pipeline stages, `stage` > 1)."""
    return t.sizes.stage > 1


def check_layout(folder: RunFolder, old: Config, cfg: Config) -> bool:
    """Whether resuming converts the checkpoints' layer layout (stacked under a pipeline, per layer
    otherwise; `boostjax.runs.relayout`); a conversion the optimizer state cannot take is refused."""
    was, now = stacked_layers(old.train), stacked_layers(cfg.train)
    if was != now:
        relayout.check(cfg, abstract_model(cfg)[1], was, str(folder.path))
    return was != now


def open_run(folder: RunFolder, cfg: Config) -> Resume:
    """The stored configuration and checkpoints of `folder` (held by this process): a field a resumed run
    cannot change, a layout the optimizer state cannot be converted to, other data than the run's (by
    content, where the run stored its fingerprint) or a tokenised folder of another tokenizer than the
    run's is refused (ConfigError, nothing written). The run's data at another path is accepted, in one
    line."""
    old = folder.stored_config()
    resuming = bool(step_dirs(folder.checkpoints))
    src = data_source(cfg)
    fingerprint = src.fingerprint
    if resuming and old is not None:
        check_mixture(folder, src)
    changes = folder.check_resume(old, cfg, resuming, (folder.stored_data_fingerprint(), fingerprint))
    if resuming and old is not None and "train.data" in changes:
        say(f"the data at {src.name} is the data this run was trained on at {old.train.data or 'the stdlib'} "
            f"(the same content, {fingerprint.split(':', 1)[1][:24]}...); resuming with it")
    convert = resuming and old is not None and check_layout(folder, old, cfg)
    check_run_tokenizer(folder.path, src, resuming)  # a resumed run keeps its tokenizer
    return Resume(old, resuming, changes, convert, fingerprint)


def check_mixture(folder: RunFolder, src: Source) -> None:
    """A resumed run of a mixture keeps its folders' content, order and weights (config.json's
    `data_mixture`): the first difference is refused in one line naming it (ConfigError). A run
    without one, or data that is no mixture, is left to the fingerprint's check."""
    stored, now = folder.stored_data_mixture(), src.mixture_record()
    if stored is None or now is None:
        return
    run = ",".join(f"{p['path']}:{p['weight']}" for p in stored)
    fix = f"fix: pass {flag_of('data')} {run} (the run's folders and weights, any paths), or another --out for a new run"
    if len(stored) != len(now):
        raise ConfigError(f"train.data: the checkpoints in {folder.path} were trained on a mixture of {len(stored)} "
                          f"folders, this command mixes {len(now)}; {fix}")
    for i, (a, b) in enumerate(zip(stored, now)):
        if a["fingerprint"] != b["fingerprint"]:
            raise ConfigError(f"train.data: {b['path']} (folder {i + 1} of the mixture) holds other data than the run's "
                              f"{a['path']} (content {b['fingerprint'][:24]}..., the run's {a['fingerprint'][:24]}...); "
                              f"{fix}")
        if a["weight"] != b["weight"]:
            raise ConfigError(f"train.data: the weight of {b['name']} is {b['weight']:.6g} of the total, the run's "
                              f"{a['weight']:.6g} (a resumed run keeps its batches); {fix}")


# ----------------------------------------------------------------------------- 5. the data


def data_source(cfg: Config) -> Source:
    """The run's `--data`, resolved (by `validate` already: its files are not read again)."""
    return resolve_source(cfg.train.data, cfg.train.data_dtype, mixtures=True)


def open_data(cfg: Config) -> tuple[Source, Corpus | Mixture]:
    """The run's source and its train and validation streams (a mixture's: per folder)."""
    t = cfg.train
    src = data_source(cfg)
    if pretrained.has_tokenizer(t.init_from_hf) and pretrained.source_tokenizer(cfg, src) is None:
        say(f"the data is read as bytes, so the run's tokenizer is byte level, not {t.init_from_hf}'s "
            f"(tokenize the data with it: boostjax tokenize --tokenizer {t.init_from_hf})")
    return src, open_source(src)
