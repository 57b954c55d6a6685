"""`validate`: the field checks of a whole `Config`, the multi-host process group's, and the mark a
wholly checked config carries (`mark_validated`, `is_validated`); `check_batch_seq` for the commands
that take --batch and --seq without a TrainConfig."""

from __future__ import annotations

from boostjax.config.checking import need
from boostjax.config.fields import flag_of
from boostjax.config.job import Config
from boostjax.config.mesh import MeshShape
from boostjax.config.model_checks import validate_model
from boostjax.config.names import MAX_SEQ_LEN, MAX_TOKENS
from boostjax.config.train_checks import validate_train


def validate_processes(coordinator: str, num_processes: int, process_id: int, mesh: MeshShape | None,
                       names: tuple[str, str, str] = ("train.coordinator", "train.num_processes", "train.process_id"),
                       ) -> None:
    """A multi-host process group: all of coordinator/num_processes/process_id or none, and a mesh
    whose devices split evenly over the processes. `names` are the fields (or environment variables)
    the values came from, for the error message."""
    c_name, n_name, i_name = names
    c_flag, n_flag, i_flag = flag_of("coordinator"), flag_of("num_processes"), flag_of("process_id")
    flags = f"{c_flag}, {n_flag} and {i_flag}"
    need(num_processes >= 0, f"{n_name}: must be >= 1 (0 = from the environment), got {num_processes}; "
                             f"fix: pass {n_flag} N with N >= 1")
    need(process_id >= -1, f"{i_name}: must be >= 0 (-1 = from the environment), got {process_id}; "
                           f"fix: pass {i_flag} I with 0 <= I < num_processes")
    if num_processes == 1:
        need(not coordinator and process_id in (-1, 0),
             f"{n_name}: a single-process run takes no coordinator or other process id; fix: drop {flags}")
        return
    given = (bool(coordinator), num_processes > 0, process_id >= 0)
    if not any(given):
        return
    missing = [name for name, ok in zip(names, given) if not ok]
    need(not missing, f"{missing[0] if missing else ''}: a multi-host job needs {flags} together; "
                      "fix: pass all three (or none of them in a SLURM, mpiexec or Kubernetes job, which is read "
                      "from its variables)")
    host, sep, port = coordinator.rpartition(":")
    need(bool(sep and host and port.isdigit() and 0 < int(port) < 65536),
         f"{c_name}: {coordinator!r} is not HOST:PORT; fix: pass process 0's address and a free port, "
         f"e.g. {c_flag} 10.0.0.1:12355")
    need(process_id < num_processes, f"{i_name}: {process_id} is not in [0, {num_processes}); "
                                     f"fix: number the processes 0..{num_processes - 1}")
    validate_process_mesh(num_processes, mesh)


def validate_process_mesh(num_processes: int, mesh: MeshShape | None) -> None:
    """A job of several processes needs a mesh whose devices split evenly over them."""
    flag = flag_of("mesh")
    need(mesh is not None, f"train.mesh: a job of {num_processes} processes needs a device mesh over all of "
                           f"their devices; fix: pass e.g. {flag} data=D,model=T with D x T the job's device count")
    devices = mesh.devices
    need(devices % num_processes == 0,
         f"train.mesh: its {devices} devices do not split evenly over {num_processes} processes; "
         f"fix: make the product of the {flag} sizes a multiple of {num_processes} (devices per process x processes)")


def validate(cfg: Config) -> Config:
    """Raise `ConfigError` on the first invalid field; return the config unchanged otherwise. The
    fields only: `boostjax.training.checks.validate` checks the rest and marks the config."""
    need(isinstance(cfg, Config), f"config: need a Config, got {type(cfg).__name__}; fix: pass Config(model, train)")
    validate_model(cfg.model)
    validate_train(cfg.train, cfg.model)
    t = cfg.train
    validate_processes(t.coordinator, t.num_processes, t.process_id, t.mesh)
    return cfg


_VALIDATED = "_validated"


def mark_validated(cfg: Config) -> Config:
    """Mark `cfg` as wholly checked (not a field: equality, to_dict and replace() ignore it)."""
    object.__setattr__(cfg, _VALIDATED, True)
    return cfg


def is_validated(cfg: Config) -> bool:
    """Whether `mark_validated` ran on this very object (a changed copy, `dataclasses.replace`, is not)."""
    return bool(getattr(cfg, _VALIDATED, False))


def check_batch_seq(batch: int, seq: int, where: str) -> None:
    """A command's --batch and --seq: positive and within the sizes one step can hold."""
    b_flag, s_flag = flag_of("batch"), flag_of("seq")
    for name, v in (("batch", batch), ("seq", seq)):
        need(v >= 1, f"{where}.{name}: must be positive, got {v}; fix: pass {flag_of(name)} N with N >= 1")
    need(seq <= MAX_SEQ_LEN, f"{where}.seq: {seq} exceeds {MAX_SEQ_LEN}; fix: pass {s_flag} <= {MAX_SEQ_LEN}")
    need(batch * seq <= MAX_TOKENS, f"{where}.batch: batch x seq = {batch} x {seq} tokens exceeds {MAX_TOKENS}; "
                                    f"fix: lower {b_flag} or {s_flag}")
