"""Multi-host jobs: several processes (one per node, or per GPU) joined by `jax.distributed.initialize`.

`setup(train_cfg)` runs once, before any JAX computation: the CLI calls it first, and `train` calls it
only when it was not run for this config (`is_set_up`). It finds the process group, in this order:

1. the flags / `TrainConfig` fields `--coordinator HOST:PORT --num-processes N --process-id I`;
2. the variables `BOOSTJAX_COORDINATOR`, `BOOSTJAX_NUM_PROCESSES`, `BOOSTJAX_PROCESS_ID`;
3. the variables of a SLURM (`srun`), `mpiexec` (PBS / Cray PALS, MPICH, Open MPI) or Kubernetes
   JobSet job of more than one process (`boostjax.runtime.schedulers`, which also picks the GPUs of
   its node each process drives);

and otherwise runs as one process (`--num-processes 1` forces that). On CPU it simulates the
process's share of the mesh's devices and uses gloo for cross-process collectives.

In a job, each process loads only the batch rows its devices hold (`batch_share`) and the global
batch is assembled with `jax.make_array_from_process_local_data` (`put_global_batch`); Orbax saves
and restores the sharded checkpoint from every process (the run folder must be on a filesystem all
hosts share); only process 0 writes `config.json`, `metrics.jsonl`, the progress bar and the summary.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import sys
import threading
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from boostjax.config import (
    ConfigError,
    TrainConfig,
    validate_processes,
)
from boostjax.runtime.devices import _FLAG, _backend_started, simulate_devices
from boostjax.runtime.schedulers import ENV_VARS, ProcessGroup, detect


def _env_int(environ: Mapping[str, str], name: str, unset: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return unset
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not an integer; fix: export {name}=N or unset it") from None


def resolve(t: TrainConfig, environ: Mapping[str, str] | None = None) -> ProcessGroup | None:
    """The process group of this run, or None for a single-process run (reads no JAX state)."""
    environ = os.environ if environ is None else environ
    validate_processes(t.coordinator, t.num_processes, t.process_id, t.mesh)
    if t.num_processes == 1:
        return None
    if t.num_processes > 1:
        return ProcessGroup(t.num_processes, t.process_id, t.coordinator, "flags")
    coordinator = environ.get(ENV_VARS[0], "").strip()
    n, i = _env_int(environ, ENV_VARS[1], 0), _env_int(environ, ENV_VARS[2], -1)
    if coordinator or n > 0 or i >= 0:
        validate_processes(coordinator, n, i, t.mesh, names=ENV_VARS)
        return None if n == 1 else ProcessGroup(n, i, coordinator, "env")
    return detect(environ, t.mesh)


def local_device_count(t: TrainConfig, group: ProcessGroup | None) -> int:
    """Devices one process contributes to the mesh (the product of its sizes over the processes)."""
    return t.sizes.devices // (group.num_processes if group else 1)


def setup(t: TrainConfig) -> ProcessGroup | None:
    """Join the multi-host job `t` describes (see the module docstring); before any JAX computation.

    Simulates the process's CPU devices (ignored where an accelerator is present), selects gloo CPU
    collectives and calls `jax.distributed.initialize`. Idempotent; returns None for one process.
    """

    group = resolve(t)
    if group is None:
        _SET_UP[:] = [t]
        return None

    if jax.distributed.is_initialized():
        if jax.process_count() != group.num_processes or jax.process_index() != group.process_id:
            raise RuntimeError(f"JAX already runs as process {jax.process_index()} of {jax.process_count()}, "
                               f"not {group.process_id} of {group.num_processes}; fix: start a fresh process")
        _SET_UP[:] = [t]
        return group
    if _backend_started():
        raise RuntimeError("a multi-host job must join before JAX starts its backend; fix: call "
                           "boostjax.runtime.multihost.setup(cfg.train) (or train) first in a fresh process")
    local = local_device_count(t, group)
    # exactly `local` CPU devices per process (an inherited larger count would not add up to the mesh)
    os.environ["XLA_FLAGS"] = re.sub(_FLAG + r"=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    if local > 1:
        simulate_devices(local, "train.mesh")
    if group.process_id == 0:
        _check_port_free(group)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _initialize(group, t.init_timeout)
    _SET_UP[:] = [t]
    return group


_SET_UP: list[TrainConfig] = []  # the config `setup` last ran for (this process's job)


def is_set_up(t: TrainConfig) -> bool:
    """Whether `setup` already ran in this process for this very config object."""
    return bool(_SET_UP) and _SET_UP[0] is t


INIT_GRACE_S = 30  # JAX's own deadline runs this much after ours (it aborts the process from C++)


def _where(group: ProcessGroup) -> str:
    return f"process {group.process_id} of {group.num_processes} ({group.coordinator}, from {group.source})"


def _address_setting(group: ProcessGroup) -> str:
    """Where this group's coordinator address is set (a flag, or a variable of every process)."""
    if group.source == "flags":
        return "--coordinator HOST:PORT"
    if group.source == "env":
        return "BOOSTJAX_COORDINATOR=HOST:PORT"
    return "JAX_COORDINATOR_ADDRESS=HOST:PORT (or JAX_COORDINATOR_PORT=PORT)"


def port_in_use(port: int) -> str | None:
    """Why this host cannot serve a coordinator on `port` (every interface, as JAX binds it), or None."""
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # only a listener makes bind fail
            s.bind((addr, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "is in use"
            if e.errno == errno.EACCES:
                return "needs privileges"
            if e.errno == errno.EADDRNOTAVAIL:
                continue
            return e.strerror or "cannot be bound"
        finally:
            s.close()
        return None
    return None


def _check_port_free(group: ProcessGroup) -> None:
    """Process 0 serves the coordinator on every interface at the port of `--coordinator`; another
    program listening there would make JAX log a C++ error and fail, so say it in one line first."""
    port = int(str(group.coordinator).rpartition(":")[2])
    why = port_in_use(port)
    if why:
        raise ConfigError(f"train.coordinator: port {port} {why} on this host, where process 0 of "
                          f"{group.num_processes} must serve the coordinator; fix: pass a free port in "
                          f"{_address_setting(group)} to every process of the job")


def _initialize(group: ProcessGroup, timeout: int) -> None:
    """`jax.distributed.initialize` that gives up after `timeout` seconds with one line.

    When a peer never starts, jax 0.10.2 ends the wait by aborting the process from C++ (SIGABRT, a
    fatal log line and a stack trace; no Python exception). A watchdog thread therefore ends the
    process first, at `timeout`, with one `boostjax: error:` line and exit status 2; JAX's own
    deadline is set `INIT_GRACE_S` later as a backstop. Other failures (e.g. the coordinator's port
    cannot be served) raise, and become a `ConfigError`."""

    n = group.num_processes
    flags = f" (--process-id 0..{n - 1}, --num-processes {n})" if group.source == "flags" else ""
    msg = (f"train.coordinator: {_where(group)} waited {timeout} s for the job to assemble and gave up "
           f"(a process never started, or the coordinator is unreachable); fix: start all {n} processes{flags} "
           f"with the same {_address_setting(group)} within --init-timeout seconds, or raise --init-timeout")
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(timeout):
            sys.stderr.write(f"boostjax: error: {msg}\n")
            sys.stderr.flush()
            os._exit(2)  # the main thread is blocked inside JAX's C++ connect

    threading.Thread(target=watchdog, name="boostjax-init-watchdog", daemon=True).start()
    try:
        ids = list(group.local_device_ids) if group.local_device_ids is not None else None
        jax.distributed.initialize(group.coordinator, group.num_processes, group.process_id, local_device_ids=ids,
                                   initialization_timeout=timeout + INIT_GRACE_S)
    except Exception as e:
        why = " ".join(str(e).split())[:200]
        raise ConfigError(f"train.coordinator: {_where(group)} could not join the job ({why}); fix: check "
                          f"{_address_setting(group)} (process 0's node, reachable from every process) and "
                          f"the process count {group.num_processes}") from None
    finally:
        done.set()


def is_main_process() -> bool:
    """Process 0 writes the run folder's files and the console output."""

    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process gets here (nothing to do in a single-process run)."""

    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def batch_share(sharding: Any, global_batch: int, seq: int) -> tuple[int, int]:
    """`(index, count)`: this process loads rows `[index·b, (index+1)·b)` of the global batch, `b = batch/count`.

    The rows are those this process's devices hold under `sharding` (several processes load the same
    rows when the `data` axis is smaller than the process count). `(0, 1)` on one process.
    """
    rows = {idx[0].indices(global_batch)[:2] for idx in
            sharding.addressable_devices_indices_map((global_batch, seq)).values()}
    blocks = sorted(rows)
    lo, hi = blocks[0][0], blocks[-1][1]
    size = hi - lo
    if any(a[1] != b[0] for a, b in zip(blocks, blocks[1:])) or global_batch % size or lo % size:
        raise ConfigError(f"train.mesh: this process's devices hold batch rows {sorted(rows)}, not one aligned "
                          f"block of the batch of {global_batch}; fix: put the data axis first in --mesh")
    return lo // size, global_batch // size


def put_global_batch(sharding: Any, global_batch: int) -> Callable[[dict], dict]:
    """This process's rows (`batch_share`) -> the global batch as one `jax.Array` per field."""

    def put(batch: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(sharding, v, (global_batch, *v.shape[1:]))
                for k, v in batch.items()}

    return put


def host_copy(tree: Any) -> Any:
    """Numpy copies of `tree`'s arrays; gathered over the processes (a collective: every process calls it)."""

    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)

    return multihost_utils.process_allgather(tree, tiled=True)


TEXT_BYTES: int = 1024  # the longest text `first_of_processes` carries (UTF-8 bytes; longer is cut)


def first_of_processes(text: str | None) -> str | None:
    """The first `text` that is not None, in process order (e.g. why one process's share of a checkpoint
    failed its checksums), so that every process decides the same; a collective: every process calls it.
    `text` itself in a single-process run."""

    if jax.process_count() == 1:
        return text
    raw = (text or "").encode()[:TEXT_BYTES]
    row = np.zeros(TEXT_BYTES + 1, np.uint8)
    row[0] = text is not None
    row[1:1 + len(raw)] = np.frombuffer(raw, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(row))
    got = next((r for r in rows.reshape(-1, TEXT_BYTES + 1) if r[0]), None)
    return None if got is None else bytes(got[1:]).rstrip(b"\0").decode(errors="replace")
