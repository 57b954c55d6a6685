"""What every experiment shares: where things live, the results' files, the machine, timing.

Folders: `ROOT` (the repository), `RESULTS` (experiments/results, the committed results) and `CACHE`
(experiments/.cache, git-ignored: converted models, tokenised text, run folders).

    ap = argparse.ArgumentParser(...)
    common.add_out(ap, "comm_table")                 # --out, --from-json
    args = ap.parse_args(argv)
    if common.rerender(args, "comm_table", markdown, chart) is None:
        res = measure(...)
        common.write(args.out, "comm_table", data=res, md=lambda: markdown(res), figure=lambda: chart(res),
                     command=common.command_line("comm_table", argv), started=t0)

`write` writes each file it is given: the JSON first (with a trailing newline), then the markdown
(ending in a newline) and the figure (120 dpi, then closed); these two may be passed as functions,
called once the JSON is on disk, so that a bug in rendering loses no measurement. It prints the
markdown (unless `echo=False`) and one line naming the files. A JSON object records the command line
(`command`) and the wall time in seconds since `started` (`wall_s`) unless it holds those keys already
(a re-rendered result keeps its run's own); a JSON list is written as it is.

`command_line` spells a script's command line, `subplots` makes a headless (Agg) figure for the charts
and `log` prints a progress line stamped with the time of day. `machine_facts` / `machine_line` describe
the machine a result was measured on; `timed` and `interleaved` time calls (rounds of every contender
in turn, so that other jobs on a shared machine slow all of them alike); `others_running` counts the
runnable tasks of other processes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import sys
import time
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent  # the repository
RESULTS = HERE / "results"  # the committed results
CACHE = HERE / ".cache"  # git-ignored: converted models, tokenised text, run folders
DPI = 120

_SYSTEMS = ("tp", "rotation", "offload", "speed", "data", "init", "faults", "gpu")


def module_of(script: str) -> str:
    """`experiments.<system>.<script>` for the script of that name (`script` may be dotted already)."""
    if "." in script:
        return script if script.startswith("experiments.") else f"experiments.{script}"
    found = [s for s in _SYSTEMS if (HERE / s / f"{script}.py").is_file()]
    if len(found) != 1:
        raise ValueError(f"experiments: {script!r} names {len(found)} scripts; fix: pass system.name")
    return f"experiments.{found[0]}.{script}"


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """`python -m experiments.<system>.<script> ARGS` as a shell would take it (`argv`: default
    sys.argv[1:])."""
    return shlex.join(["python", "-m", module_of(script), *(sys.argv[1:] if argv is None else argv)])


def python_m(script: str) -> list[str]:
    """`python -m experiments.<system>.<script>`: the command line of a script's own worker process
    (give it `with_root(env)`, so that the package is found from any folder)."""
    return [sys.executable, "-m", module_of(script)]


def with_root(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the repository first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class ArgumentParser(argparse.ArgumentParser):
    """An experiment's command line: a bad one is one line (`<script>: <what>; fix: see <script> --help`)
    and exit status 2, before anything is read or written."""

    def error(self, message: str) -> typing.NoReturn:
        text = " ".join(message.split())
        sys.stderr.write(f"{self.prog}: {text}" + ("" if "fix:" in text else f"; fix: see {self.prog} --help") + "\n")
        sys.exit(2)


def add_gpu_target(ap: argparse.ArgumentParser) -> None:
    """`--target`: the XLA GPU target description a deviceless GPU compile is made for."""
    ap.add_argument("--target", required=True, help="an XLA GPU target description (GpuTargetConfigProto text), e.g. "
                    "experiments/gpu/targets/h100_sxm.txtpb")


def json_file(path: str) -> str:
    """An argparse `type`: `path` names a readable JSON file (a bad one is one line, exit 2)."""
    try:
        json.loads(pathlib.Path(path).read_text())
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path} ({e.strerror or e}); fix: pass an earlier result's .json")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{path} is not JSON; fix: pass an earlier result's .json")
    return path


def add_out(ap: argparse.ArgumentParser, name: str, *, from_json: bool = True) -> None:
    """`--out` (default experiments/results) and, when `from_json`, `--from-json PATH` (re-render
    <name>.md and .png from an earlier <name>.json without measuring)."""
    ap.add_argument("--out", default=str(RESULTS), help=f"results folder for {name}.* (default: experiments/results)")
    if from_json:
        ap.add_argument("--from-json", default=None, metavar="PATH", type=json_file,
                        help=f"re-render {name}.md (and .png) into --out from an earlier {name}.json; measures nothing")


def rerender(args: argparse.Namespace, name: str, md: Callable[[Any], str],
             figure: Callable[[Any], Any] | None = None) -> Any:
    """With `--from-json`: read it, write <out>/<name>.md (`md(res)`) and .png (`figure(res)`), return
    the result; without: None (measure)."""
    if not getattr(args, "from_json", None):
        return None
    res = json.loads(pathlib.Path(args.from_json).read_text())
    write(args.out, name, md=lambda: md(res), figure=None if figure is None else (lambda: figure(res)))
    return res


class Lines(list):
    """Markdown lines printed as they come (a long run shows its rows at once), kept for <name>.md:
    `md = Lines(); md("| a | b |"); write(out, name, md=str(md), echo=False)`."""

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.append(text)

    def __str__(self) -> str:
        return "\n".join(self)


def log(msg: str) -> None:
    """`[HH:MM:SS] msg`, flushed (progress of a long run)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def subplots(ncols: int = 1, figsize: tuple[float, float] = (6, 4)):
    """(figure, axes): `ncols` axes side by side on a headless (Agg) figure; one axes when ncols is 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize)


def write(out: str | pathlib.Path, name: str, *, data: Any = None, md: str | Callable[[], str] | None = None,
          figure=None, command: str | None = None, started: float | None = None, indent: int = 1,
          echo: bool = True) -> list[pathlib.Path]:
    """Write <out>/<name>.json (`data`), then <name>.md (`md`) and <name>.png (`figure`, a matplotlib
    Figure), each only when given, creating `out`; print `md` (when `echo`) and the files written.
    `md` and `figure` may be functions of nothing that return them. A dict `data` gets `command` and
    `wall_s` (seconds since `started`, a `time.perf_counter()`) where it lacks them. Returns the
    paths written."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if data is not None:
        if isinstance(data, dict):
            data = dict(data)
            if command is not None:
                data.setdefault("command", command)
            if started is not None:
                data.setdefault("wall_s", round(time.perf_counter() - started, 1))
        written.append(out / f"{name}.json")
        written[-1].write_text(json.dumps(data, indent=indent) + "\n")
    md = md() if callable(md) else md
    if md is not None:
        written.append(out / f"{name}.md")
        written[-1].write_text(md if md.endswith("\n") else md + "\n")
    figure = figure() if callable(figure) else figure
    if figure is not None:
        import matplotlib.pyplot as plt

        written.append(out / f"{name}.png")
        figure.savefig(written[-1], dpi=DPI)
        plt.close(figure)
    if echo and md is not None:
        print(md.rstrip("\n"))
    print(f"{name}: wrote {', '.join(p.name for p in written)} to {out}", flush=True)
    return written


# ---------------------------------------------------------------------------------------------
# the machine


def procs_running() -> int:
    """Runnable tasks (threads) on the machine right now (this process's included), from /proc/stat;
    -1 unknown."""
    try:
        with open("/proc/stat") as fh:
            return next(int(ln.split()[1]) for ln in fh if ln.startswith("procs_running"))
    except (OSError, StopIteration):
        return -1


def own_running() -> int:
    """This process's threads that are runnable right now (the caller's included): XLA's pool or torch's
    OpenMP workers still spinning after a call; 1 where /proc/self/task cannot be read."""
    n = 0
    try:
        for task in os.scandir("/proc/self/task"):
            try:
                with open(os.path.join(task.path, "stat")) as fh:
                    n += fh.read().rpartition(")")[2].split()[0] == "R"
            except (OSError, IndexError):
                continue  # the thread ended while we looked
    except OSError:
        return 1
    return max(n, 1)


def others_running() -> int:
    """Runnable tasks of other processes right now: `procs_running` less this process's own; -1 unknown."""
    total = procs_running()
    return -1 if total < 0 else max(total - own_running(), 0)


def was_shared(parts: Iterable[Mapping[str, Any]], machine: Mapping[str, Any]) -> bool:
    """Whether a timed run shared its machine: other processes were runnable in most rounds of one of its
    `parts` (their `other_runnable_tasks_median` is 1 or more), or the 1-minute load average was above 0.5
    when it started. A lone round that met a runnable kernel thread does not make a machine shared: the
    per-round ratios are medians."""
    return (any(p["other_runnable_tasks_median"] >= 1 for p in parts) or machine["loadavg_start"][0] > 0.5)


def cpu_info() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ("", set()) where there is none."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as fh:
            for ln in fh:
                if ln.startswith("model name") and not model:
                    model = ln.split(":", 1)[1].strip()
                elif ln.startswith("flags") and not flags:
                    flags = set(ln.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def cores_usable() -> int:
    """Cores this process may run on (its affinity), else every core."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def machine_facts() -> dict:
    """The machine as a result records it: CPU model, cores (all, usable), JAX and its device, XLA_FLAGS,
    the load average now (`loadavg_start`)."""
    import jax
    import jaxlib

    from boostjax.runtime.allocator import in_force

    return {"cpu_count": os.cpu_count(), "cpus_usable": cores_usable(), "cpu_model": cpu_info()[0],
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "platform": jax.devices()[0].platform,
            "device": jax.devices()[0].device_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "keep_scratch": in_force(), "loadavg_start": list(os.getloadavg())}


def keep_scratch() -> bool:
    """Set glibc's allocator up as a training process does (`boostjax.runtime.allocator`): call before
    JAX starts; `BOOSTJAX_KEEP_SCRATCH=0` measures glibc's defaults. Returns whether it is in force."""
    from boostjax.config import ConfigError
    from boostjax.runtime.allocator import keep_scratch_memory

    try:
        return keep_scratch_memory()
    except ConfigError as e:  # a bad BOOSTJAX_KEEP_SCRATCH: one line, exit 2, before anything is measured
        sys.stderr.write(f"{pathlib.Path(sys.argv[0]).name}: {e}\n")
        sys.exit(2)


def allocation_text(facts: dict) -> str:
    """How the steps' scratch memory was allocated, for a result's machine line."""
    if facts.get("keep_scratch"):
        return "scratch memory kept between steps (glibc, as `boostjax train` does)"
    return "glibc's default allocation (`BOOSTJAX_KEEP_SCRATCH=0` or not glibc)"


def machine_line() -> str:
    """`<cpu>, N cores, load average X`: the CPU model (else the architecture), the cores and the
    1-minute load average now."""
    cpu = cpu_info()[0] or platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"


# ---------------------------------------------------------------------------------------------
# timing


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall s, this process's CPU s) of `fn()`."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


@dataclass
class Rounds:
    """Interleaved timings: per key its wall and CPU seconds, one per round; per round the runnable
    tasks besides this process when it started."""
    wall: dict[Hashable, list[float]] = field(default_factory=dict)
    cpu: dict[Hashable, list[float]] = field(default_factory=dict)
    others: list[int] = field(default_factory=list)


def interleaved(calls: dict[Hashable, Callable[[], Any]], rounds: int,
                order: Callable[[int], Sequence[Hashable]] | None = None,
                after_round: Callable[[int, Rounds], None] | None = None) -> Rounds:
    """`rounds` rounds of every call in turn (A, B, C, A, B, C, ...; `order(k)`: round k's keys), each
    timed by `timed`; a call must wait for its own work (`block_until_ready`). `after_round(k, so_far)`
    runs after round k (progress lines)."""
    out = Rounds({k: [] for k in calls}, {k: [] for k in calls})
    for k in range(rounds):
        out.others.append(others_running())
        for key in (order(k) if order is not None else calls):
            wall_s, cpu_s = timed(calls[key])
            out.wall[key].append(wall_s)
            out.cpu[key].append(cpu_s)
        if after_round is not None:
            after_round(k, out)
    return out
