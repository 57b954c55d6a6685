"""The job environments a multi-host run is read from: one table, `SCHEDULERS`.

Each entry (`slurm`, `mpiexec`, `k8s`) reads the variables its launcher sets in every process: the
coordinator, the process count, this process's id and its rank on its node. `detect` turns the first
entry present into a `ProcessGroup` (with the `local_device_ids` the process drives); `emulated_env`
gives an entry's variables for N local processes (`boostjax launch --scheduler`). The variables, the
port and the GPUs each process drives: docs/multihost.md ("Where the process group comes from").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from boostjax.config import ConfigError, MeshShape, validate_process_mesh

# read before any entry (boostjax.runtime.multihost.resolve): a group given by hand
ENV_VARS: tuple[str, str, str] = ("BOOSTJAX_COORDINATOR", "BOOSTJAX_NUM_PROCESSES", "BOOSTJAX_PROCESS_ID")
DEFAULT_PORT = 61440
ADDRESS, PORT = "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT"  # JAX's own overrides, honoured by every entry


@dataclass(frozen=True)
class ProcessGroup:
    """Where this process sits in a multi-host job."""

    num_processes: int
    process_id: int
    coordinator: str  # HOST:PORT of process 0's coordination service
    source: str  # "flags", "env", or the `SCHEDULERS` entry ("slurm", "mpiexec", "k8s")
    local_device_ids: tuple[int, ...] | None = None  # this node's GPUs it drives (None: JAX decides)


@dataclass(frozen=True)
class Placement:
    """What a launcher's variables say about this process."""

    host: str  # process 0's node ("" when JAX_COORDINATOR_ADDRESS gives it)
    port: int  # the default port of this job
    num_processes: int
    process_id: int
    local_rank: int  # this process's index among the job's processes on its node


@dataclass(frozen=True)
class Scheduler:
    """One job environment: whether it is present, how to read it, how to emulate it."""

    name: str
    present: Callable[[Mapping[str, str]], bool]
    read: Callable[[Mapping[str, str]], Placement]
    emulate: Callable[[int, int, int, int, Path], dict[str, str]]  # (n, i, nodes, port, folder) -> variables
    variables: tuple[str, ...]  # every variable `read` looks at
    fix: str  # how a process of this job is started, for error messages


def _int(environ: Mapping[str, str], names: tuple[str, ...], what: str, fix: str) -> tuple[str, int]:
    """The first of `names` that is set, as an integer: (name, value)."""
    for name in names:
        raw = environ.get(name, "").strip()
        if raw:
            if not (raw.isascii() and raw.isdigit()):
                raise ConfigError(f"{name}: {raw!r} is not a non-negative integer; fix: {fix}")
            return name, int(raw)
    nor = f" (nor {', '.join(names[1:])})" if len(names) > 1 else ""
    raise ConfigError(f"{names[0]}: not set{nor}, so {what} is unknown; fix: {fix}")


def job_port(job_id: str) -> int:
    """A port in 61440..65535 from the digits a job id starts with (the same in every process)."""
    digits = re.match(r"\d+", job_id.strip())
    return DEFAULT_PORT + int(digits.group()) % 4096 if digits else DEFAULT_PORT


def first_host(node_list: str) -> str:
    """The first node of a SLURM node list: 'gpu[01-04],cpu7' -> 'gpu01', 'a,b' -> 'a'."""
    m = re.match(r"([^,\[]*)(?:\[([^\],-]*))?", node_list.strip())
    return (m.group(1) + (m.group(2) or "")) if m else ""


# ----------------------------------------------------------------------------- SLURM (srun)

SLURM_FIX = "start boostjax with srun inside the allocation (srun sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID)"


def _slurm_present(environ: Mapping[str, str]) -> bool:
    return "SLURM_STEP_NODELIST" in environ and "SLURM_PROCID" in environ  # an srun task, not the batch script


def _slurm(environ: Mapping[str, str]) -> Placement:
    names = ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    n, i, local = (_int(environ, (name,), what, SLURM_FIX)[1] for name, what in
                   zip(names, ("the process count", "this process's id", "its rank on its node")))
    host = first_host(environ["SLURM_STEP_NODELIST"])
    if not host and n > 1 and not environ.get(ADDRESS, "").strip():
        raise ConfigError(f"SLURM_STEP_NODELIST: {environ['SLURM_STEP_NODELIST']!r} names no node; fix: {SLURM_FIX}")
    return Placement(host, job_port(environ.get("SLURM_JOB_ID", "")), n, i, local)


def _slurm_emulate(n: int, i: int, nodes: int, port: int, folder: Path) -> dict[str, str]:
    per = n // nodes
    return {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": ",".join(_loopback(nodes)), "SLURM_NTASKS": str(n),
            "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i % per), "SLURM_NODEID": str(i // per),
            "SLURM_STEP_NUM_NODES": str(nodes), PORT: str(port)}


# ----------------------------------------------------------------------------- mpiexec (PBS, PALS)

RANKS = ("PALS_RANKID", "PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")
SIZES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
LOCAL_RANKS = ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
MPI_FIX = "start boostjax with mpiexec (Cray PALS, MPICH or Open MPI), which sets the rank variables"


def _mpi_present(environ: Mapping[str, str]) -> bool:
    return any(name in environ for name in RANKS)


def _mpi(environ: Mapping[str, str]) -> Placement:
    _, n = _int(environ, SIZES, "the process count", MPI_FIX)
    _, i = _int(environ, RANKS, "this process's id", MPI_FIX)
    _, local = _int(environ, LOCAL_RANKS, "its rank on its node", MPI_FIX)
    if n == 1 or environ.get(ADDRESS, "").strip():
        return Placement("", DEFAULT_PORT, n, i, local)
    nodefile, uri = environ.get("PBS_NODEFILE", "").strip(), environ.get("OMPI_MCA_orte_hnp_uri", "")
    if nodefile:
        try:
            host = next((line.strip() for line in Path(nodefile).read_text().splitlines() if line.strip()), "")
        except OSError as e:
            raise ConfigError(f"PBS_NODEFILE: cannot read {nodefile} ({e.strerror}); fix: run inside the PBS job "
                              f"(qsub), or export {ADDRESS}=HOST:PORT of the first node") from None
        if not host:
            raise ConfigError(f"PBS_NODEFILE: {nodefile} lists no node; fix: run inside the PBS job (qsub), or "
                              f"export {ADDRESS}=HOST:PORT of the first node")
        return Placement(host, job_port(environ.get("PBS_JOBID", "")), n, i, local)
    m = re.search(r"tcp://([^,:/]+)|tcp6://\[([^,\]]+)", uri)
    if m:  # Open MPI 4's mpirun: its launcher node
        return Placement(m.group(1) or m.group(2), job_port(uri), n, i, local)
    raise ConfigError(f"PBS_NODEFILE: not set, so process 0's node is unknown to this mpiexec job; fix: run inside "
                      f"a PBS job (qsub), or export {ADDRESS}=HOST:PORT of the first node to every process")


def _mpi_emulate(n: int, i: int, nodes: int, port: int, folder: Path) -> dict[str, str]:
    """Cray PALS mpiexec under PBS (ALCF Polaris): N ranks, N/nodes of them per node."""
    per = n // nodes
    nodefile = folder / "pbs_nodefile"
    nodefile.write_text("".join(f"{h}\n" for h in _loopback(nodes)))
    return {"PBS_JOBID": "1.emulated", "PBS_NODEFILE": str(nodefile), "PALS_RANKID": str(i),
            "PALS_LOCAL_RANKID": str(i % per), "PALS_NODEID": str(i // per), "PMI_RANK": str(i),
            "PMI_SIZE": str(n), "PMI_LOCAL_RANK": str(i % per), "PMI_LOCAL_SIZE": str(per), PORT: str(port)}


# ----------------------------------------------------------------------------- Kubernetes (JobSet)

K8S_PROCESSES = "BOOSTJAX_K8S_PROCESSES"  # set in the JobSet YAML: the Job's parallelism
K8S_NAMES = ("JOBSET_NAME", "REPLICATED_JOB_NAME")  # set in the YAML from the pod's JobSet annotations
K8S_FIX = "set it in the pod template as docs/k8s/jobset.yaml does"


def _k8s_present(environ: Mapping[str, str]) -> bool:
    return K8S_PROCESSES in environ


def _k8s(environ: Mapping[str, str]) -> Placement:
    _, n = _int(environ, (K8S_PROCESSES,), "the process count", K8S_FIX)
    _, i = _int(environ, ("JOB_COMPLETION_INDEX",), "this pod's id",
                "run the pods as an Indexed Job (a JobSet's replicated job), which sets JOB_COMPLETION_INDEX")
    if n == 1 or environ.get(ADDRESS, "").strip():
        return Placement("", DEFAULT_PORT, n, i, 0)
    jobset, job = (environ.get(name, "").strip() for name in K8S_NAMES)
    for name, value in zip(K8S_NAMES, (jobset, job)):
        if not value:
            raise ConfigError(f"{name}: not set, so process 0's pod is unknown; fix: {K8S_FIX}, or export "
                              f"{ADDRESS}=HOST:PORT of pod 0")
    return Placement(f"{jobset}-{job}-0-0.{jobset}", DEFAULT_PORT, n, i, 0)  # pod 0 of job 0, headless service


def _k8s_emulate(n: int, i: int, nodes: int, port: int, folder: Path) -> dict[str, str]:
    """One pod per process; pod 0's DNS name cannot be served on loopback, so the address is given."""
    return {K8S_PROCESSES: str(n), "JOB_COMPLETION_INDEX": str(i), "JOBSET_NAME": "boostjax",
            "REPLICATED_JOB_NAME": "workers", ADDRESS: f"127.0.0.1:{port}"}


def _loopback(nodes: int) -> list[str]:
    return [f"127.0.0.{j + 1}" for j in range(nodes)]  # emulated nodes: 127.0.0.1 serves the coordinator


SCHEDULERS: tuple[Scheduler, ...] = (
    Scheduler("slurm", _slurm_present, _slurm, _slurm_emulate,
              ("SLURM_STEP_NODELIST", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"), SLURM_FIX),
    Scheduler("mpiexec", _mpi_present, _mpi, _mpi_emulate,
              (*RANKS, *SIZES, *LOCAL_RANKS, "PBS_NODEFILE", "PBS_JOBID", "OMPI_MCA_orte_hnp_uri"), MPI_FIX),
    Scheduler("k8s", _k8s_present, _k8s, _k8s_emulate,
              (K8S_PROCESSES, "JOB_COMPLETION_INDEX", *K8S_NAMES), K8S_FIX),
)
BY_NAME: dict[str, Scheduler] = {s.name: s for s in SCHEDULERS}


def coordinator(environ: Mapping[str, str], where: Placement) -> str:
    """HOST:PORT: JAX_COORDINATOR_ADDRESS, else the placement's host with JAX_COORDINATOR_PORT or its port."""
    address = environ.get(ADDRESS, "").strip()
    if address:
        host, sep, port = address.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"{ADDRESS}: {address!r} is not HOST:PORT; fix: export {ADDRESS}=HOST:PORT of "
                              "process 0's node, or unset it")
        return address
    port = environ.get(PORT, "").strip()
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"{PORT}: {port!r} is not a TCP port; fix: export {PORT}=P with 1 <= P <= 65535, or unset it")
    return f"{where.host}:{port or where.port}"


def local_device_ids(environ: Mapping[str, str], local_rank: int, per_process: int) -> tuple[int, ...]:
    """The GPUs of this node that local rank `local_rank` drives (`per_process` of them, see the module)."""
    visible = [d for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if len(visible) == per_process:
        return tuple(range(per_process))
    first = local_rank * per_process
    if visible and first + per_process > len(visible):
        gpus = f"GPU {first}" if per_process == 1 else f"GPUs {first}..{first + per_process - 1}"
        raise ConfigError(f"CUDA_VISIBLE_DEVICES: local rank {local_rank} drives {gpus} ({per_process} per process) "
                          f"but this process sees {len(visible)}; fix: start "
                          f"{len(visible) // per_process or 1} processes per node, or make --mesh's device count "
                          "match the GPUs of the job")
    return tuple(range(first, first + per_process))


def detect(environ: Mapping[str, str], mesh: MeshShape | None) -> ProcessGroup | None:
    """The group of the first `SCHEDULERS` entry present in `environ`; None without one, or for one process."""
    for s in SCHEDULERS:
        if not s.present(environ):
            continue
        where = s.read(environ)
        n, i = where.num_processes, where.process_id
        if n < 1 or i >= n:
            raise ConfigError(f"{s.name}: this process's id {i} is not in [0, {n}) ({n} processes); fix: {s.fix}")
        if n == 1:
            return None
        validate_process_mesh(n, mesh)
        per_process = mesh.devices // n if mesh is not None else 1
        return ProcessGroup(n, i, coordinator(environ, where), s.name,
                            local_device_ids(environ, where.local_rank, per_process))
    return None


def emulated_env(name: str, num_processes: int, process_id: int, nodes: int, port: int,
                 folder: Path) -> dict[str, str]:
    """The variables `name`'s launcher would set for process `process_id` of `num_processes`, on `nodes`
    loopback nodes (127.0.0.1 ... holding `num_processes / nodes` processes each; 127.0.0.1 is process 0's)."""
    if name not in BY_NAME:
        raise ConfigError(f"launch.scheduler: unknown scheduler {name!r}; fix: pass one of {', '.join(BY_NAME)}")
    if not 1 <= nodes <= num_processes or num_processes % nodes:
        raise ConfigError(f"launch.nodes: {num_processes} processes do not split evenly over {nodes} nodes; "
                          f"fix: pass --nodes dividing {num_processes}")
    return BY_NAME[name].emulate(num_processes, process_id, nodes, port, folder)


def scheduler_variables() -> frozenset[str]:
    """Every variable that places a process in a job (`ENV_VARS`, every entry's, JAX's address and
    port): what an emulated process must not inherit from a real job."""
    return frozenset(v for s in SCHEDULERS for v in s.variables) | frozenset((*ENV_VARS, ADDRESS, PORT))
