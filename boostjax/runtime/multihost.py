"""Multi-host jobs: several processes (one per node, or per GPU) joined by `jax.distributed.initialize`.

`setup(train_cfg)` runs once, before any JAX computation: the CLI calls it first, and `train` calls it
only when it was not run for this config (`is_set_up`). It finds the process group, in this order:

1. the flags / `TrainConfig` fields `--coordinator HOST:PORT --num-processes N --process-id I`;
2. the variables `BOOSTJAX_COORDINATOR`, `BOOSTJAX_NUM_PROCESSES`, `BOOSTJAX_PROCESS_ID`;
3. a SLURM (`srun`) or Open MPI (`mpirun`) job of more than one task, detected by JAX itself;

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
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax._src import (
    clusters,  # JAX's own cluster detection (importing it starts no backend)
)
from jax.experimental import multihost_utils

from boostjax.config import (
    ConfigError,
    MeshShape,
    TrainConfig,
    validate_process_mesh,
    validate_processes,
)
from boostjax.runtime.devices import _FLAG, _backend_started, simulate_devices

ENV_VARS: tuple[str, str, str] = ("BOOSTJAX_COORDINATOR", "BOOSTJAX_NUM_PROCESSES", "BOOSTJAX_PROCESS_ID")
AUTO_CLUSTERS: tuple[str, ...] = ("slurm", "ompi")  # JAX cluster environments read from variables only


@dataclass(frozen=True)
class ProcessGroup:
    """Where this process sits in a multi-host job."""

    num_processes: int
    process_id: int
    coordinator: str | None  # None: JAX reads it from the cluster environment
    source: str  # "flags", "env", or the JAX cluster name ("slurm", "ompi")


def _env_int(environ: Mapping[str, str], name: str, unset: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return unset
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not an integer; fix: export {name}=N or unset it") from None


def _cluster_group(mesh: MeshShape | None) -> ProcessGroup | None:
    """A SLURM / Open MPI job of > 1 tasks, as JAX's own auto-detection sees it."""
    for env in clusters.ClusterEnv._cluster_types:
        # getattr: jax 0.7's K8sCluster has no `name` (nor a default on the base class)
        if getattr(env, "name", "") in AUTO_CLUSTERS and env.is_env_present():
            n, i = env.get_process_count(), env.get_process_id()
            if n > 1:
                validate_process_mesh(n, mesh)
                return ProcessGroup(n, i, None, env.name)
    return None


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
    return _cluster_group(t.mesh)


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
    if group.coordinator is not None and group.process_id == 0:
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
    at = group.coordinator or f"the {group.source} job's coordinator"
    return f"process {group.process_id} of {group.num_processes} ({at})"


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
                          f"--coordinator HOST:PORT to every process of the job")


def _initialize(group: ProcessGroup, timeout: int) -> None:
    """`jax.distributed.initialize` that gives up after `timeout` seconds with one line.

    When a peer never starts, jax 0.10.2 ends the wait by aborting the process from C++ (SIGABRT, a
    fatal log line and a stack trace; no Python exception). A watchdog thread therefore ends the
    process first, at `timeout`, with one `boostjax: error:` line and exit status 2; JAX's own
    deadline is set `INIT_GRACE_S` later as a backstop. Other failures (e.g. the coordinator's port
    cannot be served) raise, and become a `ConfigError`."""

    msg = (f"train.coordinator: {_where(group)} waited {timeout} s for the job to assemble and gave up "
           f"(a process never started, or the coordinator is unreachable); fix: start all {group.num_processes} "
           f"processes (--process-id 0..{group.num_processes - 1}) with the same --coordinator and "
           f"--num-processes {group.num_processes} within --init-timeout seconds, or raise --init-timeout")
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(timeout):
            sys.stderr.write(f"boostjax: error: {msg}\n")
            sys.stderr.flush()
            os._exit(2)  # the main thread is blocked inside JAX's C++ connect

    threading.Thread(target=watchdog, name="boostjax-init-watchdog", daemon=True).start()
    try:
        if group.coordinator is None:  # JAX reads the SLURM / Open MPI environment itself
            jax.distributed.initialize(initialization_timeout=timeout + INIT_GRACE_S)
        else:
            jax.distributed.initialize(group.coordinator, group.num_processes, group.process_id,
                                       initialization_timeout=timeout + INIT_GRACE_S)
    except Exception as e:
        why = " ".join(str(e).split())[:200]
        raise ConfigError(f"train.coordinator: {_where(group)} could not join the job ({why}); fix: check "
                          f"--coordinator (process 0's HOST:PORT, reachable from every process) and "
                          f"--num-processes {group.num_processes}") from None
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
