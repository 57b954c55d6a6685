"""Multi-host jobs: several processes (one per node, or per GPU) joined by `jax.distributed.initialize`.

`setup(train_cfg)` runs before any JAX computation (the CLI calls it first; `train` calls it too, a
no-op once done). It finds the process group, in this order:

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

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from boostjax.config import ConfigError, TrainConfig, parse_mesh, validate_process_mesh, validate_processes

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


def _cluster_group(mesh: str) -> ProcessGroup | None:
    """A SLURM / Open MPI job of > 1 tasks, as JAX's own auto-detection sees it."""
    try:
        from jax._src import clusters  # noqa: PLC0415 (JAX's detection: importing it starts no backend)
    except ImportError:  # pragma: no cover - private module moved
        return None
    for env in clusters.ClusterEnv._cluster_types:  # noqa: SLF001
        if env.name in AUTO_CLUSTERS and env.is_env_present():
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
    n = 1
    for size in parse_mesh(t.mesh).values():
        n *= size
    return n // (group.num_processes if group else 1)


def setup(t: TrainConfig) -> ProcessGroup | None:
    """Join the multi-host job `t` describes (see the module docstring); before any JAX computation.

    Simulates the process's CPU devices (ignored where an accelerator is present), selects gloo CPU
    collectives and calls `jax.distributed.initialize`. Idempotent; returns None for one process.
    """
    from boostjax.devices import _FLAG, _backend_started, simulate_devices  # noqa: PLC0415

    group = resolve(t)
    if group is None:
        return None
    import jax  # noqa: PLC0415 (importing JAX starts no backend)

    if jax.distributed.is_initialized():
        if jax.process_count() != group.num_processes or jax.process_index() != group.process_id:
            raise RuntimeError(f"JAX already runs as process {jax.process_index()} of {jax.process_count()}, "
                               f"not {group.process_id} of {group.num_processes}; fix: start a fresh process")
        return group
    if _backend_started():
        raise RuntimeError("a multi-host job must join before JAX starts its backend; fix: call "
                           "boostjax.multihost.setup(cfg.train) (or train) first in a fresh process")
    local = local_device_count(t, group)
    # exactly `local` CPU devices per process (an inherited larger count would not add up to the mesh)
    os.environ["XLA_FLAGS"] = re.sub(_FLAG + r"=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    if local > 1:
        simulate_devices(local)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if group.coordinator is None:  # JAX reads the SLURM / Open MPI environment itself
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(group.coordinator, group.num_processes, group.process_id)
    return group


def is_main_process() -> bool:
    """Process 0 writes the run folder's files and the console output."""
    import jax  # noqa: PLC0415

    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process gets here (nothing to do in a single-process run)."""
    import jax  # noqa: PLC0415

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # noqa: PLC0415

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
    import jax  # noqa: PLC0415

    def put(batch: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(sharding, v, (global_batch, *v.shape[1:]))
                for k, v in batch.items()}

    return put


def host_copy(tree: Any) -> Any:
    """Numpy copies of `tree`'s arrays; gathered over the processes (a collective: every process calls it)."""
    import jax  # noqa: PLC0415

    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return multihost_utils.process_allgather(tree, tiled=True)
