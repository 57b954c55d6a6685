"""The tail every experiment shares: write <out>/<name>.json, .md and .png, and say where they went.

    results_io.write(args.out, "comm_table", data=res, md=lambda: markdown(res), figure=lambda: chart(res),
                     command=results_io.command_line("comm_table", argv), started=t0)

`write` writes each file it is given: the JSON first (with a trailing newline), then the markdown
(ending in a newline) and the figure (120 dpi, then closed); these two may be passed as functions,
called once the JSON is on disk, so that a bug in rendering loses no measurement. It prints the
markdown (unless `echo=False`) and one line naming the files. A JSON object records the command line
(`command`) and the wall time in seconds since `started` (`wall_s`) unless it holds those keys already
(a re-rendered result keeps its run's own); a JSON list is written as it is.

`command_line` spells a script's command line, `subplots` makes a headless (Agg) figure for the charts
and `log` prints a progress line stamped with the time of day.
"""

from __future__ import annotations

import json
import pathlib
import shlex
import sys
import time
from typing import Any, Callable, Sequence

RESULTS = pathlib.Path(__file__).resolve().parent / "results"  # the committed results
DPI = 120


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """`python experiments/<script>.py ARGS` as a shell would take it (`argv`: default sys.argv[1:])."""
    return shlex.join(["python", f"experiments/{script}.py", *(sys.argv[1:] if argv is None else argv)])


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
