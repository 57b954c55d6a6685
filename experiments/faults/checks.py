"""The campaign's record (`Campaign`: the plan, the reference, every event and anomaly) and the
checks after each stop: the exit status and stop line, the run folder, and how the next start reported
a damaged checkpoint. A failed check is an anomaly in the record, not an exception."""

from __future__ import annotations

import json
import pathlib
import re
from dataclasses import dataclass, field

import numpy as np

from experiments.faults.folder import ASIDE, aside, checkpoints, compare, compare_ok, loss_records, read_records, verify
from experiments.faults.plan import EXIT, Settings
from experiments.faults.process import KNOWN_LINES, Attempt, classify_stderr, traceback_summary
from experiments.common import log


@dataclass
class Campaign:
    """State shared by the campaign runs: the plan, the reference and everything that happened."""

    s: Settings
    scratch: pathlib.Path
    env: dict
    ref: dict
    fault_rng: np.random.Generator  # the k-th signal fault is fixed by the seed
    damage_rng: np.random.Generator  # so are the k-th damage decision and the files damaged
    damage_plan: list[str]
    events: list[dict] = field(default_factory=list)
    probes: list[dict] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    anomalies: list[dict] = field(default_factory=list)
    signals_sent: int = 0
    damage_done: int = 0

    def anomaly(self, kind: str, where: str, detail: str) -> None:
        self.anomalies.append({"kind": kind, "where": where, "detail": detail[:3000]})
        log(f"ANOMALY {kind} at {where}: {detail[:300]}")


# ---------------------------------------------------------------------------- checks after a stop


def check_stop(c: Campaign, a: Attempt, fault: dict, sig: dict, rc: int | None, where: str) -> dict:
    """The exit status and the stop message against what the signal promises."""
    err = classify_stderr(a.stderr())
    finished = rc == 0 and bool(re.match(r"^done: ", a.stdout()))
    first = sig["sent"][0] if sig["sent"] else None
    # 0 after a signal only when the run was (almost) done when it was sent: one step may still finish
    done_at_signal = sig.get("last_logged_step", 0) >= c.s.steps - 2
    expected = ({EXIT[first], 0} if done_at_signal else {EXIT[first]}) if first else {0}
    out = {"rc": rc, "finished": finished, "stderr": err, "expected_rc": sorted(expected)}
    if rc not in expected:
        phase = ("before the start had restored (startup)" if not sig.get("restored") and a.start_step is None else
                 "before the start had restored (startup; it restored later)" if not sig.get("restored") else
                 "after the last step" if done_at_signal else "during training")
        out["phase"] = phase
        if rc == 0:
            out["signal_lost"] = True
            c.anomaly("signal lost", where, f"{first} sent {sig['at_s']:.2f} s after the start, {phase}, changed "
                                            f"nothing: the run trained on from step {sig.get('last_logged_step')} to "
                                            f"{c.s.steps} and exited 0")
        else:
            c.anomaly("unexpected exit status", where, f"{first} sent {sig['at_s']:.2f} s after the start gave exit "
                                                        f"{rc} (expected {' or '.join(map(str, sorted(expected)))}), {phase}")
    if rc not in expected or err["traceback"] or err["n_other"]:
        out["stderr_tail"] = a.stderr()[-4000:]
    if err["traceback"]:
        c.anomaly("traceback", where, traceback_summary(a.stderr()))
    elif err["n_other"]:
        c.anomaly("unexpected stderr", where, "\n".join(err["other"]))
    if first in ("SIGINT", "SIGTERM") and rc == EXIT[first]:
        stopped = err["known"].get("stopped", [])
        m = KNOWN_LINES["stopped"].match(stopped[-1]) if stopped else None
        lines = [x for x in a.stderr().splitlines() if x.startswith("boostjax: ")]  # others are reported apart
        if not m or lines[-1] != stopped[-1] or m.group(1) != first or len(stopped) != 1:
            c.anomaly("stop message", where, f"expected one last line 'boostjax: stopped by {first} after step N; ...'; "
                                             f"stderr: {a.stderr()[-1500:]}")
        elif m.group(2) is None:  # a signal during the imports: acted on before anything was written
            out["stopped_before_first_step"] = True
        else:
            n = int(m.group(2))
            out["stopped_after"] = n
            cks = checkpoints(a.folder)
            logged = loss_records(read_records(a.folder))
            problems = []
            if n > 0 and (not cks or max(cks) != n):
                problems.append(f"newest checkpoint is {max(cks) if cks else None}, not {n}")
            elif n > 0 and verify(a.folder / "checkpoints" / str(n)) is not None:
                problems.append(f"checkpoint {n} does not verify: {verify(a.folder / 'checkpoints' / str(n))}")
            if logged and logged[-1]["step"] > n:
                problems.append(f"records logged up to step {logged[-1]['step']}, past the saved step {n}")
            if problems:
                c.anomaly("stop state", where, "; ".join(problems))
        out["again_lines"] = len(err["known"].get("again", []))
    return out


def check_folder(c: Campaign, folder: pathlib.Path, before: dict[int, bool], damaged: set[str], where: str) -> dict:
    """After a stop: records so far identical to the reference, checksummed steps verify, nothing
    vanished except by pruning or being moved aside, nothing moved aside that the campaign did not damage."""
    recs = loss_records(read_records(folder))
    cmp = compare(recs, c.ref["records"], complete=False)
    if cmp["n_different"] or cmp["extra"]:
        c.anomaly("records differ from the reference", where, json.dumps(cmp))
    if cmp["missing"] or cmp["duplicates"]:
        c.anomaly("records missing or duplicated", where, json.dumps(cmp))
    now = checkpoints(folder)
    bad = {st: verify(folder / "checkpoints" / str(st)) for st, has in now.items() if has}
    bad = {st: why for st, why in bad.items() if why}
    if bad:
        c.anomaly("checksummed checkpoint does not verify", where, json.dumps(bad))
    gone = [st for st in before if st not in now and sum(1 for x in now if x > st) < c.s.keep
            and not any(n.split("-")[0] == str(st) for n in aside(folder))]
    if gone:
        c.anomaly("checkpoint deleted", where, f"steps {gone} vanished (before {sorted(before)}, now {sorted(now)})")
    wrongly_aside = sorted(set(aside(folder)) - damaged)
    if wrongly_aside:
        c.anomaly("intact checkpoint set aside", where, f"{wrongly_aside} in {ASIDE}/, not damaged by the campaign")
    return {"records_ok": compare_ok(cmp), "compare": cmp, "checkpoints": {str(k): v for k, v in sorted(now.items())},
            "unverifiable": {str(k): v for k, v in bad.items()}, "deleted": gone, "aside": aside(folder),
            "wrongly_aside": wrongly_aside}


def check_damage_report(c: Campaign, a: Attempt, pending: dict, where: str) -> dict | None:
    """Once the start after a damage has restored: one line naming the step, moved aside, resumed
    from the next older step. None while that start has not got that far (checked at the next one)."""
    start = a.poll_start()
    if start is None:
        return None
    lines = [ln for ln in classify_stderr(a.stderr())["known"].get("damaged", [])
             if KNOWN_LINES["damaged"].match(ln).group(1) == str(pending["step"])]
    res = {"step": pending["step"], "resumed_from": start, "expected_from": pending["expect_from"], "lines": lines}
    problems = []
    if len(lines) != 1:
        problems.append(f"{len(lines)} stderr lines name checkpoint {pending['step']} (expected 1)")
    else:
        m = KNOWN_LINES["damaged"].match(lines[0])
        moved = pathlib.Path(m.group(3))
        res["moved_to"], res["why"] = str(moved), m.group(2)
        if moved.parent.resolve() != (a.folder / ASIDE).resolve():
            problems.append(f"moved to {moved}, not into {ASIDE}/")
        elif not moved.is_dir() or not moved.name.startswith(f"{pending['step']}-damaged"):
            problems.append(f"{moved} is not a folder named {pending['step']}-damaged*")
        elif verify(moved) is None:
            problems.append(f"{moved} verifies: not the damaged copy")
        if int(m.group(4)) != start:
            problems.append(f"the line says resuming from {m.group(4)}, the run started from {start}")
    if start != pending["expect_from"]:
        problems.append(f"resumed from step {start}, expected {pending['expect_from']} (the newest older step)")
    res["ok"] = not problems
    if problems:
        c.anomaly("damaged checkpoint not handled", where, "; ".join(problems))
    return res
