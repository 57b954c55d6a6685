"""experiments/common.py: the command line a result records, the folders, `--out`/`--from-json` and the
re-render, interleaved timing; and every script of experiments/ takes `--out` and runs as a module."""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import threading
import time

import pytest

from experiments import common

SCRIPTS = sorted(p for p in (common.HERE).glob("*/*.py") if "__main__" in p.read_text())


def test_command_line_spells_the_module():
    assert common.command_line("comm_table", ["--vocab", "256"]) == "python -m experiments.tp.comm_table --vocab 256"
    assert common.command_line("faults", ["--out", "a b"]) == "python -m experiments.faults.faults --out 'a b'"
    assert common.python_m("gpu_step")[1:] == ["-m", "experiments.gpu.gpu_step"]
    with pytest.raises(ValueError, match="no_such_script"):
        common.module_of("no_such_script")


def test_folders():
    assert common.ROOT / "experiments" == common.HERE
    assert common.CACHE == common.ROOT / "experiments" / ".cache"  # the cache of converted models and runs
    assert common.RESULTS == common.ROOT / "experiments" / "results"
    env = common.with_root({"PYTHONPATH": "elsewhere"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(common.ROOT), "elsewhere"]


def test_every_script_is_a_module_with_out():
    """Each script resolves to one module name (no two systems share a name) and defines `--out`."""
    assert len(SCRIPTS) >= 30
    for path in SCRIPTS:
        assert common.module_of(path.stem) == f"experiments.{path.parent.name}.{path.stem}"
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
        adds_out = any(isinstance(c.func, ast.Attribute) and c.func.attr == "add_out" for c in calls) or any(
            isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument" and c.args
            and isinstance(c.args[0], ast.Constant) and c.args[0].value == "--out" for c in calls)
        assert adds_out, f"{path.relative_to(common.ROOT)} has no --out"
        assert "sys.path.insert(0, str(" not in path.read_text()


def test_rerender_writes_only_with_from_json(tmp_path, capsys):
    ap = argparse.ArgumentParser()
    common.add_out(ap, "x")
    assert ap.parse_args([]).out == str(common.RESULTS) and ap.parse_args([]).from_json is None
    assert common.rerender(ap.parse_args(["--out", str(tmp_path / "none")]), "x", str) is None
    assert not (tmp_path / "none").exists()
    src = tmp_path / "x.json"
    src.write_text(json.dumps({"rows": [1, 2]}))
    res = common.rerender(ap.parse_args(["--from-json", str(src), "--out", str(tmp_path / "out")]), "x",
                          lambda r: f"rows {r['rows']}")
    assert res == {"rows": [1, 2]}
    assert (tmp_path / "out" / "x.md").read_text() == "rows [1, 2]\n"
    assert not (tmp_path / "out" / "x.json").exists()  # the measurement is not rewritten
    assert "rows [1, 2]" in capsys.readouterr().out


def test_a_busy_thread_of_this_process_is_not_another_process():
    """The rounds' `others` count other processes' runnable tasks: a thread of ours that computes (as
    XLA's pool or torch's OpenMP workers do after a call) is this process's, not a sign of a shared
    machine."""
    stop = threading.Event()

    def work():  # hashing a large buffer releases the GIL: the thread stays runnable
        while not stop.is_set():
            hashlib.sha256(bytes(1 << 24)).digest()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        seen, deadline = [], time.monotonic() + 10.0
        while time.monotonic() < deadline and max(seen, default=0) < 2:  # a few ms unless the machine is busy
            seen.append(common.own_running())
        total, others = common.procs_running(), common.others_running()
    finally:
        stop.set()
        thread.join()
    assert max(seen) >= 2, seen  # the worker and the caller
    assert min(seen) >= 1
    assert -1 <= others <= max(total - 1, 0)


def test_a_machine_is_shared_when_most_rounds_met_another_task_or_it_started_loaded():
    quiet = {"loadavg_start": [0.2, 0.5, 0.9]}
    assert not common.was_shared([{"other_runnable_tasks_median": 0, "other_runnable_tasks_max": 1}], quiet)
    assert common.was_shared([{"other_runnable_tasks_median": 0}, {"other_runnable_tasks_median": 1}], quiet)
    assert common.was_shared([{"other_runnable_tasks_median": 0}], {"loadavg_start": [0.6, 0.1, 0.1]})


def test_interleaved_rounds_and_order():
    seen = []
    calls = {k: (lambda k=k: seen.append(k)) for k in "abc"}
    r = common.interleaved(calls, 2)
    assert seen == list("abcabc")
    assert all(len(r.wall[k]) == len(r.cpu[k]) == 2 and min(r.wall[k]) >= 0 for k in "abc")
    assert len(r.others) == 2
    seen.clear()
    ticks = []
    common.interleaved(calls, 3, order=lambda k: "abc"[k:] + "abc"[:k], after_round=lambda k, so_far: ticks.append(
        (k, len(so_far.wall["a"]))))
    assert seen == list("abcbcacab") and ticks == [(0, 1), (1, 2), (2, 3)]


def test_lines_print_and_keep(capsys):
    md = common.Lines()
    md("| a |")
    md("| 1 |")
    assert str(md) == "| a |\n| 1 |" and capsys.readouterr().out == "| a |\n| 1 |\n"
