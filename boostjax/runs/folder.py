"""The run folder: one writer, one configuration, nothing of the user's overwritten.

    runs/x/config.json          the configuration in force (rewritten on every start)
    runs/x/config_history.jsonl one line per start: when, from which step, which fields changed
    runs/x/metrics.jsonl        one JSON object per logged step
    runs/x/checkpoints/         Orbax checkpoints with checksums (boostjax.runs.checkpoint)
    runs/x/checkpoints-aside/   damaged or non-finite checkpoints, moved out of the way, never deleted
    runs/x/tensorboard/         TensorBoard event files of the same scalars (boostjax.training.observe)
    runs/x/profile/             jax.profiler traces asked for with --profile START:STOP
    runs/x/.lock                held (fcntl) by the process that trains in the folder

`config.json` also carries `data_fingerprint`, the content of the run's `--data`
(`boostjax.data.fingerprint`; absent in runs of an older boostjax), and for a mixture of tokenised
folders `data_mixture`: each folder's name, path, weight and fingerprint (checked on resume by
`boostjax.training.prepare.check_mixture`).

`RunFolder.check_target` refuses, before anything is written, a path that is a file or lies under
one, a folder that holds something other than a boostjax run (an exported Hugging Face model, a
user's files), and a folder or `checkpoints/` that cannot be written. `lock` takes the folder for one
process. `check_resume` compares the stored configuration with the new one: a field that a resumed
run cannot change (`FIXED`) is refused with the old and new value; the others are recorded. The data
is compared by content where the run stored its fingerprint: the same data at another path is
accepted (the new path is recorded), other data at the same path is refused; a run without one
compares the `--data` paths as before.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import os
import pathlib
import re
from contextlib import contextmanager
from typing import Any, Iterator

from boostjax.config import (Config, ConfigError, ModelConfig, TrainConfig, fields_with, flag_of, legacy_values,
                             mesh_text, negated_flag_of)

CONFIG, HISTORY, METRICS, LOCK, CHECKPOINTS = "config.json", "config_history.jsonl", "metrics.jsonl", ".lock", "checkpoints"
TOKENIZER = "tokenizer.json"  # the run's tokenizer when it is not byte level (boostjax.data.tokenizers)
RUN_FILES: frozenset[str] = frozenset({CONFIG, HISTORY, METRICS, LOCK, CHECKPOINTS, "checkpoints-aside",
                                       CONFIG + ".tmp", METRICS + ".tmp", "tensorboard", "profile", TOKENIZER,
                                       TOKENIZER + ".tmp",
                                       "init_report.json", "init_report.json.tmp"})  # boostjax.interop.pretrained

# What a resumed run may do with each field is the field's metadata (`boostjax.config.option`, `resume`);
# these sets are derived from it. Training fields a resumed run may change (everything else, and every
# model field but MUTABLE_MODEL, is fixed: the checkpoint's shapes, the data order or the optimizer
# state's meaning depend on it).
MUTABLE: frozenset[str] = fields_with(TrainConfig, "mutable", "ignored")
# Model fields a resumed run may change: the attention kernel computes the same function; token ids are metadata.
MUTABLE_MODEL: frozenset[str] = fields_with(ModelConfig, "mutable", "ignored")
# Model fields added after runs existed, with the value a config.json without them means (e.g.
# the MLP was `silu(gate) * up` before `only_lr_act` existed).
LEGACY_MODEL: dict[str, Any] = legacy_values(ModelConfig)
# Model fields whose default or preset value changed: a CLI resume that does not give the flag keeps the
# run's stored value (`boostjax.training.prepare.resolve_config`); given, a differing value is refused as usual.
FOLLOW_STORED: frozenset[str] = fields_with(ModelConfig, "follow-stored")
# The same for training fields (PipeDream-LR's T_c and Nesterov's momentum decay became scaled to the run).
FOLLOW_STORED_TRAIN: frozenset[str] = fields_with(TrainConfig, "follow-stored")
LEGACY_TRAIN: dict[str, Any] = legacy_values(TrainConfig)
DATA_FINGERPRINT = "data_fingerprint"  # key of config.json beside "model" and "train"
DATA_MIXTURE = "data_mixture"  # a mixture's folders: [{"name", "path", "weight", "fingerprint"}] (also a key)
EXPORT_MARK = "boostjax_export"  # key of an exported config.json (transformers keeps unknown keys)
# Training fields a resume neither checks nor records (where the run is, how a process finds its job).
IGNORED: frozenset[str] = fields_with(TrainConfig, "ignored")


class RunFolderBusy(ConfigError):
    """Another process trains in this run folder."""


def _flag(name: str, value: Any) -> str:
    """The command-line flag that sets `name` to `value` (`--no-x` for a false boolean)."""
    if isinstance(value, bool):
        return flag_of(name) if value else negated_flag_of(name)
    return f"{flag_of(name)} {value}"


def read_json_file(path: pathlib.Path, what: str) -> Any:
    """A JSON file, or ConfigError naming it and the fix when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the {what} ({getattr(e, 'strerror', None) or e}); "
                          f"fix: check the file's permissions and disk") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: the {what} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                          f"fix: restore the file, or move it aside to start afresh") from None


def read_run_config(path: pathlib.Path) -> Config:
    d = read_json_file(path, "run configuration")
    try:
        if not (isinstance(d, dict) and isinstance(d.get("model"), dict) and isinstance(d.get("train"), dict)):
            raise TypeError("needs 'model' and 'train' objects")
        known_m = {f.name for f in dataclasses.fields(ModelConfig)}
        known_t = {f.name for f in dataclasses.fields(TrainConfig)}
        # fields of an older or newer boostjax that this version does not know are dropped; a model field
        # added later reads as the value that reproduces the older run (LEGACY_MODEL)
        return Config(ModelConfig(**{**LEGACY_MODEL, **{k: v for k, v in d["model"].items() if k in known_m}}),
                      TrainConfig(**{**LEGACY_TRAIN, **{k: v for k, v in d["train"].items() if k in known_t}}))
    except TypeError as e:
        raise ConfigError(f"{path}: not a boostjax run configuration ({e}); fix: restore the file, or pass "
                          f"another --out") from None


def read_jsonl(path: pathlib.Path) -> list[dict]:
    """Records of a `.jsonl` file. A partial last line (a process killed while appending) is
    dropped; any other unreadable line is a ConfigError naming the file and line."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e}); "
                          f"fix: check the file's permissions and disk") from None
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("not a record with a step")
        except ValueError as e:
            if i == len(lines) - 1:
                break  # cut short by a kill: the record is recomputed on resume
            raise ConfigError(f"{path}: line {i + 1} is not a metrics record ({e}); fix: delete that line "
                              f"or restore the file") from None
        out.append(rec)
    return out


def _nearest_existing(path: pathlib.Path) -> pathlib.Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_writable_dir(path: pathlib.Path, what: str) -> None:
    """`path` (existing) is a directory this process can create files in (probed, then cleaned)."""
    if not path.is_dir():
        raise ConfigError(f"{what}: {path} is a file, not a folder; fix: pass another --out or move the file")
    probe = path / f".boostjax-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise ConfigError(f"{what}: cannot write in {path} ({e.strerror}); fix: make it writable or pass "
                          f"another --out") from None


def check_folder_path(p: pathlib.Path, what: str) -> bool:
    """`p` is a folder or can be created as one by this process; returns whether it exists."""
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{what}: {p} is a file, not a folder; fix: pass a folder path to --out")
    base = _nearest_existing(p.absolute())
    if not base.is_dir():
        raise ConfigError(f"{what}: {p} lies under the file {base}; fix: pass a folder path to --out")
    _check_writable_dir(base, what)
    return p.is_dir()


def describe_foreign(folder: pathlib.Path) -> str | None:
    """What `folder` holds when it is not a boostjax run folder (None: empty, or a run folder)."""
    try:
        names = {p.name for p in folder.iterdir()}
    except OSError as e:
        return f"an unreadable folder ({e.strerror})"
    if not names:
        return None
    cfg = folder / CONFIG
    if cfg.is_file():
        try:
            d = json.loads(cfg.read_text())
        except (OSError, ValueError):
            d = None
        if isinstance(d, dict) and ("model_type" in d or "architectures" in d):
            return "an exported Hugging Face model (its config.json has model_type)"
        if isinstance(d, dict) and "model" in d and "train" in d:
            return None
        if d is not None:
            return "a config.json that is not a boostjax run configuration"
    if names & {"model.safetensors", "model.safetensors.index.json"}:
        return "a Hugging Face model (model.safetensors)"
    other = sorted(names - RUN_FILES)
    if other:
        return f"files that are not a boostjax run ({', '.join(other[:3])}{', ...' if len(other) > 3 else ''})"
    return None


class RunFolder:
    """The folder `--out` of one training run."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)

    config_path = property(lambda self: self.path / CONFIG)
    metrics_path = property(lambda self: self.path / METRICS)
    history_path = property(lambda self: self.path / HISTORY)
    checkpoints = property(lambda self: self.path / CHECKPOINTS)

    def check_target(self) -> None:
        """Refuse (ConfigError, nothing written) a path that cannot hold this run."""
        p = self.path
        if not check_folder_path(p, "train.out"):
            return
        foreign = describe_foreign(p)
        if foreign:
            raise ConfigError(f"train.out: {p} holds {foreign}; fix: pass a new or empty folder to --out "
                              f"(boostjax never writes into another artefact's folder)")
        ck = self.checkpoints
        if ck.exists():
            _check_writable_dir(ck, "train.out")
        if self.checkpoints.is_dir() and any(self.checkpoints.iterdir()) and not self.config_path.exists():
            raise ConfigError(f"train.out: {p} holds checkpoints but no {CONFIG}; fix: restore {self.config_path} "
                              f"or pass another --out")

    @contextmanager
    def lock(self) -> Iterator[None]:
        """Hold an exclusive lock on the folder (created if needed) for the block's duration; a
        second writer gets RunFolderBusy naming the holder's PID. Removes what it created on exit
        if the folder is still empty."""
        created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        lock_path = self.path / LOCK
        fd = None
        try:
            while True:  # the file may be unlinked by its previous holder between open and flock
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                    os.close(fd)
                    fd = None
                    raise RunFolderBusy(f"train.out: {self.path} is in use by another boostjax run (PID {holder}); "
                                        f"fix: wait for it to finish, stop it, or pass another --out") from None
                try:
                    same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
                except FileNotFoundError:
                    same = False
                if same:
                    break
                os.close(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            if fd is not None:
                try:
                    lock_path.unlink()
                except OSError:
                    pass
                os.close(fd)
            if created:
                try:
                    self.path.rmdir()  # only if nothing else was written
                except OSError:
                    pass

    def stored_config(self) -> Config | None:
        try:
            return read_run_config(self.config_path)
        except FileNotFoundError:
            return None

    def stored_data_fingerprint(self) -> str | None:
        """The `data_fingerprint` of config.json; None when the run stored none (an older boostjax)."""
        try:
            d = read_json_file(self.config_path, "run configuration")
        except FileNotFoundError:
            return None
        fp = d.get(DATA_FINGERPRINT) if isinstance(d, dict) else None
        return fp if isinstance(fp, str) and fp else None

    def stored_data_mixture(self) -> list[dict] | None:
        """The `data_mixture` of config.json (each folder's name, path, weight and fingerprint); None
        when the run's data is no mixture."""
        try:
            d = read_json_file(self.config_path, "run configuration")
        except FileNotFoundError:
            return None
        mix = d.get(DATA_MIXTURE) if isinstance(d, dict) else None
        keys = {"name", "path", "weight", "fingerprint"}
        if not (isinstance(mix, list) and mix and all(isinstance(p, dict) and keys <= set(p) for p in mix)):
            return None
        return mix

    def check_data(self, old: Config, new: Config, fingerprints: tuple[str | None, str], resuming: bool) -> bool | None:
        """Whether the new `--data` is the run's data by content (None: the run stored no fingerprint).
        Other data where the checkpoints' data was (at the same path or not) is refused (ConfigError)
        when resuming."""
        stored, now = fingerprints
        if stored is None:
            return None
        if stored != now and resuming:
            where = "the same path" if old.train.data == new.train.data else f"{old.train.data!r}"
            raise ConfigError(
                f"train.data: {new.train.data!r} holds other data than the checkpoints in {self.path} were "
                f"trained on (at {where}; content {now[:32]}..., the run's {stored[:32]}...); fix: pass "
                f"{flag_of('data')} with the run's data (any path), or another --out for a new run")
        return stored == now

    def check_resume(self, old: Config | None, new: Config, resuming: bool,
                     fingerprints: tuple[str | None, str] | None = None) -> dict[str, list]:
        """The fields that differ from the stored config ({"train.lr": [old, new], ...}); raises
        ConfigError for a field a resumed run cannot change. `fingerprints` (the stored and the new
        data's, `stored_data_fingerprint`) make `--data` compared by content (`check_data`)."""
        if old is None:
            return {}
        same_data = self.check_data(old, new, fingerprints, resuming) if fingerprints else None
        changes: dict[str, list] = {}
        for section, a, b in (("model", old.model, new.model), ("train", old.train, new.train)):
            for f in dataclasses.fields(a):
                va, vb = getattr(a, f.name), getattr(b, f.name)
                if va == vb or (section == "train" and f.name in IGNORED):
                    continue
                if section == "train" and f.name == "data" and same_data is not None:
                    changes["train.data"] = [va, vb]  # compared by content above: moved, or a new run's data
                    continue
                fixed = f.name not in (MUTABLE_MODEL if section == "model" else MUTABLE)
                if resuming and fixed:
                    raise ConfigError(
                        f"{section}.{f.name}: the checkpoints in {self.path} were trained with {f.name}={va!r}, "
                        f"this command asks for {vb!r}, and a resumed run cannot change it; fix: pass "
                        f"{_flag(f.name, va)}, or another --out for a new run")
                if isinstance(a, TrainConfig) and f.name == "mesh":  # compared as meshes, recorded as text
                    va, vb = mesh_text(va), mesh_text(vb)
                changes[f"{section}.{f.name}"] = [va, vb]
        return changes

    def write_config(self, cfg: Config, start_step: int, changes: dict[str, list],
                     data_fingerprint: str | None = None, data_mixture: list[dict] | None = None) -> None:
        """config.json (atomically, with the data's fingerprint and a mixture's folders) and one line of
        config_history.jsonl."""
        d = cfg.to_dict()
        if data_fingerprint:
            d[DATA_FINGERPRINT] = data_fingerprint
        if data_mixture:
            d[DATA_MIXTURE] = data_mixture
        tmp = self.path / (CONFIG + ".tmp")
        tmp.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.config_path)
        rec = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "start_step": start_step, "pid": os.getpid(), "changed": changes}
        with open(self.history_path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def trim_metrics(self, last_step: int, write: bool) -> list[dict]:
        """The metrics records up to `last_step` (later ones are recomputed); rewritten atomically."""
        kept = [m for m in read_jsonl(self.metrics_path) if m["step"] <= last_step]
        if write and (kept or self.metrics_path.exists()):
            tmp = self.path / (METRICS + ".tmp")
            tmp.write_text("".join(json.dumps(m) + "\n" for m in kept))
            tmp.replace(self.metrics_path)
        return kept


def check_export_target(path: str | pathlib.Path) -> None:
    """Refuse (ConfigError, nothing written) an export folder that is a file, lies under one, or
    holds anything but a previous Hugging Face export (a run folder, a user's files)."""
    p = pathlib.Path(path)
    if not check_folder_path(p, "export.out"):
        return
    names = {q.name for q in p.iterdir()}
    if not names:
        return
    if names & {CONFIG, METRICS, CHECKPOINTS} and describe_foreign(p) is None:
        raise ConfigError(f"export.out: {p} is a boostjax run folder; fix: export into a new folder, not a run's")
    export_files = {"config.json", "model.safetensors", "model.safetensors.index.json", "generation_config.json",
                    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "configuration_boostjax_lowrank.py", "modeling_boostjax_lowrank.py"}  # a low-rank export's code
    shards = {n for n in names if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", n)}
    weights = (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()
    ours = weights and _is_boostjax_export(p / CONFIG)
    if not ours or names - export_files - shards:
        raise ConfigError(f"export.out: {p} is not empty and is not an earlier boostjax export; fix: pass a new "
                          f"or empty folder to --out (boostjax never overwrites files it did not write)")


def _is_boostjax_export(cfg_path: pathlib.Path) -> bool:
    try:
        d = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and EXPORT_MARK in d
