"""A multi-host job on one machine: N `boostjax` processes joined over a loopback coordinator.

    boostjax launch --num-processes 2 -- train --mesh data=2,model=2 --strategy btp --out runs/mh

runs `boostjax train ... --coordinator 127.0.0.1:PORT --num-processes 2 --process-id I` for I = 0, 1
on a free port, each on its share of simulated CPU devices (JAX_PLATFORMS=cpu unless set), with
gloo collectives between them: the code path of a real multi-node job, testable without a cluster.
With `scheduler` ("slurm", "mpiexec", "k8s") no flags are passed: each process gets the variables that
scheduler's launcher would set instead (`boostjax.runtime.schedulers.emulated_env`, `nodes` loopback
nodes), and finds its place in the job from them as it would in the real job. Output lines are prefixed with the process id; if one process fails the others are stopped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from boostjax.runtime.schedulers import emulated_env, scheduler_variables


@dataclass(frozen=True)
class ProcessResult:
    process_id: int
    returncode: int
    output: str  # stdout and stderr, interleaved


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(args: Sequence[str], num_processes: int = 2, *, port: int | None = None,
                 env: dict[str, str] | None = None, timeout: float | None = None,
                 echo: bool = True, scheduler: str | None = None, nodes: int | None = None) -> list[ProcessResult]:
    """Run `python -m boostjax.cli *args` as `num_processes` processes of one job; wait for all.

    `args` is a `train` command line without the three multi-host flags, which are added here (or,
    with `scheduler`, that scheduler's variables on `nodes` nodes, default one process per node). A
    process that exits non-zero (or a `timeout` in seconds) stops the others. With `echo`, output
    lines are printed as they come, prefixed `[I]`.
    """
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"launch_local: num_processes must be an integer >= 1, got {num_processes!r}; "
                         "fix: pass e.g. num_processes=2")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise ValueError(f"launch_local: port {port!r} is not a TCP port; fix: pass 1..65535 or None (a free one)")
    port = port or free_port()
    base_env = {**os.environ, **(env or {})}
    base_env.setdefault("JAX_PLATFORMS", "cpu")
    with tempfile.TemporaryDirectory(prefix="boostjax-launch-") as folder:
        if scheduler is None:
            commands = [[*args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(num_processes),
                         "--process-id", str(i)] for i in range(num_processes)]
            envs = [base_env] * num_processes
        else:  # a real job's variables must not leak into the emulated one
            clean = {k: v for k, v in base_env.items() if k not in scheduler_variables()}
            commands = [list(args)] * num_processes
            envs = [{**clean, **emulated_env(scheduler, num_processes, i, nodes or num_processes, port, Path(folder))}
                    for i in range(num_processes)]
        return _run(commands, envs, timeout, echo)


def _run(commands: list[list[str]], envs: list[dict[str, str]], timeout: float | None,
         echo: bool) -> list[ProcessResult]:
    """Start `python -m boostjax.cli COMMAND` per process, wait for all (see `launch_local`)."""
    procs, outputs, readers = [], [], []
    for i, (args, env) in enumerate(zip(commands, envs)):
        cmd = [sys.executable, "-m", "boostjax.cli", *args]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=_pump, args=(proc, lines, f"[{i}] " if echo else None), daemon=True)
        reader.start()
        procs.append(proc)
        outputs.append(lines)
        readers.append(reader)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed or (deadline is not None and time.monotonic() > deadline):
                break
            time.sleep(0.05)
    finally:
        _stop(procs)
        for r in readers:
            r.join(timeout=5)
    return [ProcessResult(i, p.returncode, "".join(out)) for i, (p, out) in enumerate(zip(procs, outputs))]


def _pump(proc: subprocess.Popen, lines: list[str], prefix: str | None) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if prefix is not None:
            print(prefix + line, end="", flush=True)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the processes still running (then kill those that ignore it)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
