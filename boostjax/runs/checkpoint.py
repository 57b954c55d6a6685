"""Orbax checkpoints of a run that survive crashes, kills and damaged files.

A checkpoint `checkpoints/<step>/` holds the parameters, the optimizer state (Orbax `StandardSave`,
in the training layout: per layer, or with the layers stacked `[L, ...]` under a pipeline) and the
data iterator's position (`JsonSave`). On top of Orbax:

- **Checksums.** When a save has committed, `BLAKE3SUMS` (the `b3sum` format: `b3sum -c BLAKE3SUMS`
  checks it by hand) lists every file of the step with its BLAKE3 digest (`boostjax.runs.digest`:
  several GB/s per core, so the disk is the limit). Before a restore every listed file is hashed
  again; a missing, truncated or changed file makes the checkpoint *damaged*. In a multi-process job
  each process hashes only the files it wrote (`ocdbt.process_<i>/`, listed in its own
  `BLAKE3SUMS.process_<i>`; process 0 also the shared ones) and, before a restore, only those of its
  index; the processes then agree on the verdict. Steps written by an older boostjax carry
  `SHA256SUMS` instead, verified the same way.
- **Fallback.** `restore_latest` walks from the newest step to the oldest and restores the first one
  that verifies and that Orbax can read; the damaged ones it passed are reported (and, by the
  writer, moved aside to `checkpoints-aside/`, never deleted).
- **Atomic clean-up.** Old steps beyond `keep` are renamed into `checkpoints/.trash/` (one atomic
  step) and only then deleted, so a kill never leaves a half-deleted step where a restore looks.
  Orbax's own temporary folders of an interrupted save are removed when a writer opens the folder.

A step without checksums (written by an older boostjax, or the process died between the commit
and the checksums), or with files that no checksum file lists (a process of the job died before
writing its part), is restored unverified, with a note.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from boostjax.models.stacking import unstack_layers
from boostjax.runs import digest
from boostjax.runtime import multihost

MANIFEST = "BLAKE3SUMS"  # `b3sum` format; process i > 0 of a multi-process save writes BLAKE3SUMS.process_<i>
LEGACY_MANIFEST = "SHA256SUMS"  # what boostjax wrote before (`sha256sum` format): read, never written
_PART = re.compile(r"BLAKE3SUMS(?:\.process_\d+)?")
_PROCESS_DIR = re.compile(r"(?:ocdbt\.)?process_(\d+)")  # a folder or file Orbax writes from one process
TRASH = ".trash"
ASIDE = "checkpoints-aside"  # sibling of checkpoints/: damaged or non-finite steps, kept for inspection


class CheckpointError(ValueError):
    """No checkpoint of a run folder can be restored; the message names the folder and the fix."""


@dataclass
class Restored:
    step: int
    params: Any
    opt_state: Any
    data_state: dict
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (step, why) of newer, damaged steps
    verified: bool = True


def _quiet_closed_loop_callbacks() -> None:
    """Drop one harmless report. When Orbax's restore fails part-way (a damaged step), TensorStore
    still completes the other reads and calls back into the asyncio loop that Orbax has already
    closed; each callback's `RuntimeError: Event loop is closed` goes to `sys.unraisablehook` from
    C++, dozens of tracebacks for an error we have already handled. Only exceptions raised there,
    with no Python caller above `call_soon_threadsafe`, are dropped."""
    previous = sys.unraisablehook
    if getattr(previous, "_boostjax_quiet", False):
        return

    def hook(args) -> None:
        tb = args.exc_traceback
        if (args.exc_type is RuntimeError and str(args.exc_value) == "Event loop is closed" and tb is not None
                and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"):
            return
        previous(args)

    hook._boostjax_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _intify(tree: Any) -> Any:
    """Restored without a target, Orbax gives string keys; layer indices are ints in our dicts."""
    if isinstance(tree, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): _intify(v) for k, v in tree.items()}
    return tree


def owner(rel: str, count: int) -> int:
    """The process whose part of the manifest lists the file `rel` of a step saved by `count` processes:
    Orbax writes `ocdbt.process_<i>/` and `array_metadatas/process_<i>` from process i (taken modulo
    `count` when a job of another size reads them); every other file is process 0's."""
    for part in rel.split("/"):
        m = _PROCESS_DIR.fullmatch(part)
        if m:
            return int(m.group(1)) % count
    return 0


def _is_manifest(name: str) -> bool:
    return name.startswith(MANIFEST) or name.startswith(LEGACY_MANIFEST)


def _files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and not _is_manifest(p.name))


def manifest_name(process: int) -> str:
    """`BLAKE3SUMS` of process 0 (the only one of a single-process save), `BLAKE3SUMS.process_<i>` of the others."""
    return MANIFEST if process == 0 else f"{MANIFEST}.process_{process}"


def write_manifest(step_dir: pathlib.Path, process: int = 0, count: int = 1) -> None:
    """This process's part of the step's checksums: the BLAKE3 digest of every file under `step_dir`
    it wrote (`owner`), in the `b3sum` format, replaced in one step (never half written). A process
    that wrote nothing writes no part, except process 0, whose `BLAKE3SUMS` marks the step checksummed."""
    files = [p for p in _files(step_dir) if owner(p.relative_to(step_dir).as_posix(), count) == process]
    if not files and process != 0:
        return
    lines = digest.tree_lines(step_dir, files)
    name = manifest_name(process)
    tmp = step_dir / (name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(step_dir / name)


def _manifest_parts(step_dir: pathlib.Path) -> list[tuple[str, pathlib.Path]]:
    """(algorithm, path) of the step's checksum files: `BLAKE3SUMS` and its per-process parts, or the
    `SHA256SUMS` of an older boostjax."""
    parts = [(digest.BLAKE3, p) for p in sorted(step_dir.glob(MANIFEST + "*")) if _PART.fullmatch(p.name)]
    legacy = step_dir / LEGACY_MANIFEST
    return parts or ([(digest.SHA256, legacy)] if legacy.is_file() else [])


def read_manifest(step_dir: pathlib.Path) -> tuple[list[tuple[str, str, str]], str | None]:
    """((algorithm, digest, relative path) of every listed file, why the checksums cannot be read or None).
    Raises FileNotFoundError when the step has none (nothing to verify against)."""
    parts = _manifest_parts(step_dir)
    if not parts:
        raise FileNotFoundError(step_dir / MANIFEST)
    entries: list[tuple[str, str, str]] = []
    for algo, path in parts:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            return [], f"{path.name} unreadable ({e.__class__.__name__})"
        rows = [line.split("  ", 1) for line in text.splitlines() if line.strip()]
        if (path.name in (MANIFEST, LEGACY_MANIFEST) and not rows) or any(
                len(r) != 2 or len(r[0]) != digest.HEX_LEN[algo] for r in rows):
            return [], f"{path.name} is malformed"
        entries += [(algo, d, rel) for d, rel in rows]
    return entries, None


def verify_manifest(step_dir: pathlib.Path, process: int = 0, count: int = 1) -> tuple[str | None, bool]:
    """(why `step_dir` is damaged, a listed file missing or changed since its save, or None; whether
    its checksums cover every file). Process `process` of `count` hashes only the listed files it
    owns (`owner`): the processes of a job share the work. Raises FileNotFoundError when the step has
    no checksums."""
    entries, why = read_manifest(step_dir)
    if why is not None:
        return why, True
    listed = {rel for _, _, rel in entries}
    complete = all(p.relative_to(step_dir).as_posix() in listed for p in _files(step_dir))
    mine = [(algo, d, rel) for algo, d, rel in entries if owner(rel, count) == process]
    for algo in {a for a, _, _ in mine}:
        group = [(d, rel) for a, d, rel in mine if a == algo]
        for d, rel in group:  # a missing file is named before any hashing
            if not (step_dir / rel).is_file():
                return f"{rel}: missing", complete
        try:
            got = digest.file_digests([step_dir / rel for _, rel in group], algo)
        except OSError as e:
            rel = pathlib.Path(e.filename).relative_to(step_dir).as_posix() if e.filename else "a listed file"
            if isinstance(e, FileNotFoundError):
                return f"{rel}: missing", complete
            return f"{rel}: unreadable ({e.strerror or e.__class__.__name__})", complete
        for (d, rel), g in zip(group, got):
            if g != d:
                return f"{rel}: checksum mismatch", complete
    return None, complete


def _reason(e: BaseException) -> str:
    """A one-line, short account of why Orbax could not read a step."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{e.__class__.__name__}: {first[:160]}" if first else e.__class__.__name__


def step_dirs(directory: pathlib.Path) -> list[int]:
    """Committed steps under `directory` (folders named by an integer), oldest first."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


class Checkpointer:
    """Saves (asynchronously) and restores the checkpoints of one run folder.

    `writer=False` opens the folder for reading only: nothing is created, cleaned or moved.
    """

    def __init__(self, directory: str | pathlib.Path, *, keep: int = 3, async_save: bool = True,
                 writer: bool = True, primary: bool = True):
        self.directory = pathlib.Path(directory).absolute()
        self.keep, self.writer, self.primary = keep, writer, primary
        if writer and primary:
            shutil.rmtree(self.directory / TRASH, ignore_errors=True)  # a clean-up a kill interrupted
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None, create=writer, cleanup_tmp_directories=writer, lightweight_initialize=True,
            enable_async_checkpointing=async_save and writer,
        )
        self._mgr = ocp.CheckpointManager(self.directory, options=options)
        self._finishing: threading.Thread | None = None
        self._finish_error: BaseException | None = None

    # --------------------------------------------------------------------------------- listing

    def steps(self) -> list[int]:
        return step_dirs(self.directory)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def verify(self, step: int) -> tuple[str | None, bool]:
        """(why the step is damaged or None, whether checksums covered all its files). In a job of
        several processes each hashes its share and every process gets the same answer (a collective)."""
        try:
            why, complete = verify_manifest(self.directory / str(step), jax.process_index(), jax.process_count())
        except FileNotFoundError:
            why, complete = None, False
        return multihost.first_of_processes(why), complete

    # ---------------------------------------------------------------------------------- saving

    def save(self, step: int, params: Any, opt_state: Any, data_state: dict) -> None:
        """Start an asynchronous save of `step`; its checksums are written once it has committed."""
        self._join()
        state = {"params": params, "opt_state": opt_state}
        self._mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     data=ocp.args.JsonSave(data_state)), force=True)
        self._finishing = threading.Thread(target=self._finish, args=(step,), name=f"ckpt-finish-{step}",
                                           daemon=True)
        self._finishing.start()

    def _finish(self, step: int) -> None:
        try:
            self._mgr.wait_until_finished()  # committed, on every process (Orbax syncs them)
            write_manifest(self.directory / str(step), jax.process_index(), jax.process_count())
            if self.primary:
                self._prune(step)
        except BaseException as e:
            self._finish_error = e

    def _prune(self, newest: int) -> None:
        """Keep the newest `keep` steps up to `newest`; older ones go through `.trash/` (atomic)."""
        old = [s for s in self.steps() if s <= newest][:-self.keep]
        if not old:
            return
        trash = self.directory / TRASH
        trash.mkdir(exist_ok=True)
        for s in old:
            (self.directory / str(s)).rename(trash / str(s))
        shutil.rmtree(trash, ignore_errors=True)

    def _join(self) -> None:
        if self._finishing is not None:
            self._finishing.join()
            self._finishing = None
            self._mgr.reload()
        if self._finish_error is not None:
            err, self._finish_error = self._finish_error, None
            raise err

    def wait(self) -> None:
        """Block until the last save has committed and its checksums are written."""
        self._mgr.wait_until_finished()
        self._join()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._mgr.close()

    def set_aside(self, step: int, why: str) -> pathlib.Path:
        """Move step `step` out of the way (to `checkpoints-aside/`), keeping it for inspection."""
        self.wait()
        aside = self.directory.parent / ASIDE
        aside.mkdir(exist_ok=True)
        target = aside / f"{step}-{why}"
        n = 1
        while target.exists():
            n += 1
            target = aside / f"{step}-{why}-{n}"
        (self.directory / str(step)).rename(target)
        self._mgr.reload()
        return target

    # -------------------------------------------------------------------------------- restoring

    def _restore_state(self, step: int, params_like: Any, opt_state_like: Any) -> tuple[Any, Any, dict]:
        target = {"params": params_like, "opt_state": opt_state_like}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        out = self._mgr.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()),
        )
        state = out["state"]
        opt_state = jax.tree.unflatten(jax.tree.structure(opt_state_like), jax.tree.leaves(state["opt_state"]))
        data = out["data"]
        if not isinstance(data, dict) or "step" not in data:
            raise ValueError("the data item holds no iterator position")
        return state["params"], opt_state, dict(data)

    def _first_restorable(self, read: Callable[[int], Any], steps: list[int] | None = None,
                          ) -> tuple[int, Any, list[tuple[int, str]], bool] | None:
        """(step, what `read(step)` gave, damaged newer steps, verified) of the newest step that
        verifies and reads; None when the folder holds no step. CheckpointError if none reads."""
        steps = self.steps() if steps is None else steps
        skipped: list[tuple[int, str]] = []
        _quiet_closed_loop_callbacks()
        for step in reversed(steps):
            why, verified = self.verify(step)
            if why is None:
                try:
                    return step, read(step), skipped, verified
                except Exception as e:
                    why = _reason(e)
            skipped.append((step, why))
        if not skipped:
            return None
        detail = "; ".join(f"step {s}: {w}" for s, w in skipped)
        raise CheckpointError(
            f"checkpoints: no checkpoint in {self.directory} can be restored ({detail}); fix: move the "
            f"checkpoints folder aside to start the run afresh, or pass another run folder")

    def restore_latest(self, params_like: Any, opt_state_like: Any) -> Restored | None:
        """The newest restorable checkpoint into the structure (and shardings) of the `*_like`
        trees; None when there is no checkpoint. Damaged newer steps are listed in `skipped`."""
        self.wait()
        got = self._first_restorable(lambda s: self._restore_state(s, params_like, opt_state_like))
        if got is None:
            return None
        step, (params, opt_state, data_state), skipped, verified = got
        return Restored(step, params, opt_state, data_state, skipped, verified)

    def _restore_params(self, step: int) -> dict:
        """The parameters alone, onto this process's first device whatever mesh saved them (the
        optimizer state is not read)."""
        meta = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state")
        tree = dict(getattr(meta, "tree", meta))
        if "params" not in tree:
            raise ValueError("the state item holds no parameters")
        on = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=on),
                                           tree["params"])}
        args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(sharding=on), abstract)
        out = self._mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=abstract, restore_args=args, partial_restore=True)))
        return out["state"]["params"]

    def restore_params(self, step: int | None = None) -> tuple[int, dict, list[tuple[int, str]]]:
        """(step, parameters, damaged newer steps) without knowing the optimizer's state, for export
        and evaluation: the given step, or the newest restorable one. Always in the canonical
        per-layer layout (a pipeline run's stacked layers are unstacked)."""

        steps = self.steps()
        if step is not None and step not in steps:
            have = ", ".join(map(str, steps)) or "none"
            raise CheckpointError(f"step: no checkpoint {step} in {self.directory} (have: {have}); "
                                  f"fix: pass one of them or omit --step for the newest")
        got = self._first_restorable(self._restore_params, [step] if step is not None else steps)
        if got is None:
            raise CheckpointError(f"checkpoints: no checkpoint in {self.directory}; fix: train first "
                                  f"(boostjax train --out RUN) or pass another run folder")
        found, params, skipped, _ = got
        return found, unstack_layers(_intify(params)), skipped
