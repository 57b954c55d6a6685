"""A multi-host job on one machine: N `boostjax` processes joined over a loopback coordinator.

    boostjax launch --num-processes 2 -- train --mesh data=2,model=2 --strategy btp --out runs/mh

runs `boostjax train ... --coordinator 127.0.0.1:PORT --num-processes 2 --process-id I` for I = 0, 1
on a free port, each on its share of simulated CPU devices (JAX_PLATFORMS=cpu unless set), with
gloo collectives between them: the code path of a real multi-node job, testable without a cluster.
Output lines are prefixed with the process id; if one process fails the others are stopped.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence


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
                 echo: bool = True) -> list[ProcessResult]:
    """Run `python -m boostjax.cli *args` as `num_processes` processes of one job; wait for all.

    `args` is a `train` command line without the three multi-host flags, which are added here. A
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
    procs, outputs, readers = [], [], []
    for i in range(num_processes):
        cmd = [sys.executable, "-m", "boostjax.cli", *args, "--coordinator", f"127.0.0.1:{port}",
               "--num-processes", str(num_processes), "--process-id", str(i)]
        proc = subprocess.Popen(cmd, env=base_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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


MULTIHOST_FLAGS = ("--coordinator", "--num-processes", "--process-id")


def check_launch(args: argparse.Namespace) -> list[str]:
    """Every launch flag and the train command line, checked once here before any process starts
    (`ConfigError`, one line); returns the train command line."""
    from boostjax.commands import add_train_command, train_config  # noqa: PLC0415
    from boostjax.config import ConfigError, mesh_devices, one_line_parse_errors  # noqa: PLC0415
    from boostjax.devices import simulated_device_cap  # noqa: PLC0415
    from boostjax.multihost import port_in_use  # noqa: PLC0415

    n = args.num_processes
    if n < 2:
        raise ConfigError(f"launch.num_processes: a job needs 2 or more processes, got {n}; fix: pass -n 2 or "
                          "more (one process is a plain boostjax train)")
    cap = simulated_device_cap()
    if n > cap:
        raise ConfigError(f"launch.num_processes: {n} processes on one machine exceed the {cap} simulated CPU "
                          f"devices they share; fix: pass -n {cap} or fewer")
    if args.port is not None:
        if not 0 < args.port < 65536:
            raise ConfigError(f"launch.port: {args.port} is not a TCP port; fix: pass --port in 1..65535, or drop "
                              "it to use a free one")
        why = port_in_use(args.port)
        if why:
            raise ConfigError(f"launch.port: port {args.port} {why} on this host; fix: pass another --port, or drop "
                              "it to use a free one")
    rest = list(args.command_line)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest or rest[0] != "train":
        raise ConfigError("launch: no train command; fix: give it after --, e.g. "
                          "boostjax launch -n 2 -- train --mesh data=2,model=2")
    for flag in MULTIHOST_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in rest[1:]):
            raise ConfigError(f"launch: {flag} is set by launch for each process; fix: drop it from the train command")
    parser = argparse.ArgumentParser(prog="boostjax")
    add_train_command(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    parser = one_line_parse_errors(parser)
    train_args = parser.parse_args([*rest, "--coordinator", f"127.0.0.1:{args.port or 1}",
                                    "--num-processes", str(n), "--process-id", "0"])
    cfg = train_config(train_args)  # the whole train configuration, as each process will check it
    devices = mesh_devices(cfg.train.mesh)
    cpu_only = os.environ.get("JAX_PLATFORMS", "cpu").strip().lower() == "cpu"
    if cpu_only and devices > cap:
        raise ConfigError(f"train.mesh: {devices} devices are simulated on this machine by {n} processes, more "
                          f"than {cap}; fix: use a mesh of at most {cap} devices")
    return rest


def _cmd_launch(args: argparse.Namespace) -> int:
    try:
        rest = check_launch(args)
    except SystemExit as e:  # the train command line did not parse (reported in one line)
        return 2 if e.code not in (0, None) else 0
    results = launch_local(rest, args.num_processes, port=args.port)
    bad = [r for r in results if r.returncode != 0]
    for r in bad:
        print(f"boostjax: process {r.process_id} exited with status {r.returncode}", file=sys.stderr)
    return bad[0].returncode if bad and bad[0].returncode > 0 else (1 if bad else 0)


def register(sub) -> None:
    """Add `boostjax launch` to the CLI's subcommands."""
    p = sub.add_parser("launch", help="run a multi-host job as N local CPU processes (loopback coordinator)")
    p.add_argument("-n", "--num-processes", type=int, default=2, help="processes (default: 2)")
    p.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("command_line", nargs=argparse.REMAINDER, help="-- train FLAGS (without the multi-host flags)")
    p.set_defaults(func=_cmd_launch)
