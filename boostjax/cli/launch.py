"""`boostjax launch`: a multi-host job on one machine, N `boostjax train` processes joined over a loopback
coordinator (`boostjax.runtime.launch.launch_local`).

    boostjax launch --num-processes 2 -- train --mesh data=2,model=2 --strategy btp --out runs/mh
    boostjax launch -n 2 --scheduler slurm --nodes 1 -- train --mesh data=2,model=2 --out runs/mh

With --scheduler the processes get no multi-host flags but the variables of that scheduler's job
(SLURM tasks, mpiexec ranks under PBS, Kubernetes JobSet pods) and find their place from them.
"""

from __future__ import annotations

import argparse
import os
import sys


MULTIHOST_FLAGS = ("--coordinator", "--num-processes", "--process-id")


def check_launch(args: argparse.Namespace) -> list[str]:
    """Every launch flag and the train command line, checked once here before any process starts
    (`ConfigError`, one line); returns the train command line."""
    from boostjax.cli.driver import Parser
    from boostjax.cli.train import add_train_command, train_config
    from boostjax.config import ConfigError
    from boostjax.runtime.devices import simulated_device_cap
    from boostjax.runtime.multihost import port_in_use

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
    if args.scheduler is None and args.nodes is not None:
        raise ConfigError("launch.nodes: --nodes places the processes of an emulated job; fix: add --scheduler "
                          "slurm (or mpiexec), or drop --nodes")
    if args.nodes is not None and (args.nodes < 1 or n % args.nodes):
        raise ConfigError(f"launch.nodes: {n} processes do not split evenly over {args.nodes} nodes; fix: pass "
                          f"--nodes dividing {n}")
    if args.scheduler == "k8s" and args.nodes not in (None, n):
        raise ConfigError(f"launch.nodes: a Kubernetes job runs one process per pod; fix: drop --nodes (or pass "
                          f"--nodes {n})")
    rest = list(args.command_line)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest or rest[0] != "train":
        raise ConfigError("launch: no train command; fix: give it after --, e.g. "
                          "boostjax launch -n 2 -- train --mesh data=2,model=2")
    for flag in MULTIHOST_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in rest[1:]):
            raise ConfigError(f"launch: {flag} is set by launch for each process; fix: drop it from the train command")
    parser = Parser(prog="boostjax")  # train's flags as `boostjax train` parses them: no abbreviations
    add_train_command(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    train_args = parser.parse_args([*rest, "--coordinator", f"127.0.0.1:{args.port or 1}",
                                    "--num-processes", str(n), "--process-id", "0"])
    cfg = train_config(train_args)  # the whole train configuration, as each process will check it
    devices = cfg.train.sizes.devices
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
    from boostjax.runtime.launch import launch_local

    results = launch_local(rest, args.num_processes, port=args.port, scheduler=args.scheduler, nodes=args.nodes)
    bad = [r for r in results if r.returncode != 0]
    for r in bad:
        print(f"boostjax: process {r.process_id} exited with status {r.returncode}", file=sys.stderr)
    return bad[0].returncode if bad and bad[0].returncode > 0 else (1 if bad else 0)


def register(sub) -> None:
    """Add `boostjax launch` to the CLI's subcommands."""
    from boostjax.runtime.schedulers import BY_NAME  # imports no JAX
    p = sub.add_parser("launch", help="a multi-host job as N local CPU processes")
    p.add_argument("-n", "--num-processes", type=int, default=2, help="processes (default: 2)")
    p.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("--scheduler", choices=list(BY_NAME), default=None,
                   help="pass each process the variables of this scheduler's job instead of the multi-host flags "
                        "(emulates srun, PBS mpiexec, a Kubernetes JobSet; default: the flags)")
    p.add_argument("--nodes", type=int, default=None,
                   help="with --scheduler: emulated nodes (loopback addresses) the processes are spread over "
                        "(default: one process per node)")
    p.add_argument("command_line", nargs=argparse.REMAINDER, help="-- train FLAGS (without the multi-host flags)")
    p.set_defaults(func=_cmd_launch)
