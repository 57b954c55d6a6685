"""One campaign run of the fault campaign: start the training command, wait for the fault's moment,
send the signal(s), check the stop, maybe damage the newest checkpoint, start again, until the run
finishes; and the probes, copies whose newest checkpoint lost its BLAKE3SUMS and 64 bytes."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
from typing import Any

from experiments.faults.checks import Campaign, check_damage_report, check_folder, check_stop
from experiments.faults.folder import (TMP, aside, checkpoints, compare, compare_ok, damage, leftovers, loss_records, read_records,
                           same, saves_in_flight)
from experiments.faults.plan import PROBE, SIGNALS, draw_fault
from experiments.faults.process import NONFINITE, Attempt, classify_stderr, leaf_diff, traceback_summary
from experiments.common import log


def fire_trigger(a: Attempt, fault: dict, ignore_saves: set[str], timeout: float) -> dict:
    """Wait for the fault's moment; returns what happened ('fired', 'exited', 'timeout') and when."""
    t_from = time.monotonic()
    if fault["trigger"] == "time":
        res = a.wait_until(lambda: time.monotonic() - t_from >= fault["param"], timeout)
    elif fault["trigger"] == "steps":
        res = a.wait_until(lambda: a.new_steps() >= fault["param"], timeout)
    else:
        seen: set[int] = set()

        def caught() -> bool:
            seen.update(saves_in_flight(a.folder, ignore_saves))
            return len(seen) > fault["param"]

        res = a.wait_until(caught, timeout, poll=0.001)
    return {"result": res, "at_s": round(a.elapsed(), 3)}


def send(c: Campaign, a: Attempt, fault: dict, ignore_saves: set[str]) -> dict:
    """Send the fault's signal (twice for a double), noting what was in flight; returns the record."""
    in_flight = sorted(saves_in_flight(a.folder, ignore_saves))
    logged = loss_records(read_records(a.folder))
    restored = a.poll_start() is not None
    sent = []
    if a.proc.poll() is None:
        a.proc.send_signal(SIGNALS[fault["signal"]])
        t_sig = time.monotonic()
        sent.append(fault["signal"])
        c.signals_sent += 1
        if fault["double"]:
            time.sleep(fault["second_after_s"])
            if a.proc.poll() is None:
                a.proc.send_signal(SIGNALS[fault["signal"]])
                sent.append(fault["signal"])
    else:
        t_sig = time.monotonic()
    return {"sent": sent, "at_s": round(t_sig - a.t0, 3), "save_in_flight": in_flight, "restored": restored,
            "last_logged_step": logged[-1]["step"] if logged else 0, "t_sig": t_sig}


def maybe_damage(c: Campaign, folder: pathlib.Path, remaining_faults: int, where: str) -> dict | None:
    """After a stop: damage the newest checkpoint with probability (damage left / faults left) when it
    is eligible (it has BLAKE3SUMS, or for the probe kind at least exists, and an older step exists)."""
    if c.damage_done >= len(c.damage_plan):
        return None
    left = len(c.damage_plan) - c.damage_done
    p = min(1.0, left / max(1, remaining_faults))
    draw = float(c.damage_rng.random())
    if draw >= p:
        return None
    kind = c.damage_plan[c.damage_done]
    cks = checkpoints(folder)
    if len(cks) < 2 or (kind != PROBE and not cks[max(cks)]):
        return {"kind": kind, "skipped": f"not eligible now (checkpoints {sorted(cks)}, newest "
                                         f"{'with' if cks and cks[max(cks)] else 'without'} BLAKE3SUMS)"}
    newest = max(cks)
    expect_from = max(st for st in cks if st < newest)
    c.damage_done += 1
    if kind == PROBE:
        return {"kind": kind, "probe": probe_unverified(c, folder, newest, expect_from, where)}
    what = damage(folder / "checkpoints" / str(newest), kind, c.damage_rng)
    log(f"  damaged checkpoint {newest} ({kind}: {what})")
    return {"kind": kind, "step": newest, "what": what, "expect_from": expect_from}


def probe_unverified(c: Campaign, folder: pathlib.Path, step: int, older: int, where: str) -> dict:
    """Copy the run folder, delete the newest step's BLAKE3SUMS and flip 64 bytes, run the copy to the
    end: what the restore did (unverified by design), which values changed, whether the losses match."""
    fork = c.scratch / f"probe-{len(c.probes) + 1}"
    shutil.copytree(folder, fork, ignore=shutil.ignore_patterns(".lock"))
    what = damage(fork / "checkpoints" / str(step), PROBE, c.damage_rng)
    log(f"  probe {fork.name}: checkpoint {step} ({what})")
    diff = leaf_diff(folder / "checkpoints", fork / "checkpoints", step, c.env)
    starts = []
    for k in (1, 2):  # a second start (as a user would) only when the first stopped on a non-finite loss
        a = Attempt(c.s.command(fork), c.env, fork, c.scratch / "logs", f"{fork.name}-{k}")
        rc, hung = a.finish(c.s.timeout_s)
        lines = [ln for ln in a.stderr().splitlines() if ln.strip()]
        nonfinite = next((m for m in map(NONFINITE.match, lines) if m), None)
        starts.append({"rc": rc, "hung": hung, "resumed_from": a.poll_start(), "wall_s": round(a.elapsed(), 2),
                       "stderr": classify_stderr("\n".join(ln for ln in lines if not NONFINITE.match(ln))),
                       "nonfinite_step": int(nonfinite.group(1)) if nonfinite else None,
                       "nonfinite_line": nonfinite.group(0) if nonfinite else None})
        if not (rc == 1 and nonfinite):
            break
    recs = loss_records(read_records(fork))
    cmp = compare(recs, c.ref["records"], complete=starts[-1]["rc"] == 0)
    diffs = [abs(r["loss"] - c.ref["records"][r["step"]]["loss"]) for r in recs if r["step"] in cmp["different"]]
    final = (leaf_diff(c.scratch / "reference" / "checkpoints", fork / "checkpoints", c.s.steps, c.env)
             if starts[-1]["rc"] == 0 else {"not_finished": True})
    first = starts[0]
    res = {"where": where, "folder": str(fork), "step": step, "older_step": older, "what": what, "values": diff,
           "final_values": final, "starts": starts, "rc": starts[-1]["rc"], "resumed_from": first["resumed_from"],
           "stderr": first["stderr"], "compare": cmp, "losses_match": compare_ok(cmp),
           "first_different_step": cmp["different"][0] if cmp["different"] else None,
           "max_abs_loss_change": max(diffs) if diffs else 0.0, "last_step": recs[-1]["step"] if recs else 0}
    for k, st in enumerate(starts, 1):
        where_k = f"{fork.name}-{k}"
        if st["hung"] or (st["rc"] != 0 and not (st["rc"] == 1 and st["nonfinite_step"])):
            c.anomaly("probe run failed", where_k, f"exit {st['rc']}, hung {st['hung']}")
        if st["stderr"]["traceback"]:
            c.anomaly("traceback", where_k, traceback_summary((c.scratch / "logs" / f"{where_k}.err").read_text()))
        elif st["stderr"]["n_other"]:
            c.anomaly("unexpected stderr", where_k, "\n".join(st["stderr"]["other"]))
    c.probes.append(res)
    return res


def campaign_run(c: Campaign, idx: int, budget: int) -> dict:
    """One run folder: `budget` signal faults (fewer if the run finishes first), then run to the end."""
    s = c.s
    folder = c.scratch / f"run{idx}"
    run = {"run": idx, "folder": str(folder), "attempts": 0, "faults": 0}
    damaged: set[str] = set()  # names under checkpoints-aside/ the campaign is responsible for
    pending: dict | None = None  # damage not yet reported by a start
    t_run = time.monotonic()
    while True:
        run["attempts"] += 1
        name = f"run{idx}-{run['attempts']:02d}"
        where = name
        fault = draw_fault(c.fault_rng, s) if run["faults"] < budget else None
        before = checkpoints(folder)
        ignore = {n for n in (os.listdir(folder / "checkpoints") if (folder / "checkpoints").is_dir() else [])
                  if TMP in n or (n.isdigit() and not before.get(int(n), True))}
        left_over = leftovers(folder)  # a kill's tmp / trash folders: gone once this start has begun a save
        ev: dict[str, Any] = {"run": idx, "attempt": run["attempts"], "name": name, "fault": fault,
                              "before": {str(k): v for k, v in sorted(before.items())}, "leftovers": sorted(left_over)}
        a = Attempt(s.command(folder), c.env, folder, c.scratch / "logs", name)
        ev["pid"] = a.proc.pid
        if pending:  # the start after a damage must restore (and report) before the next fault
            a.wait_until(lambda: a.poll_start() is not None, s.timeout_s)
        if fault:
            ev["trigger"] = fire_trigger(a, fault, ignore, s.timeout_s)
            if ev["trigger"]["result"] == "timeout":
                c.anomaly("hang", where, f"the {fault['trigger']} trigger did not fire within {s.timeout_s:.0f} s")
            ev["signal"] = send(c, a, fault, ignore)
            t_sig = ev["signal"].pop("t_sig")
            rc, hung = a.finish(120.0)
            ev["stop_s"] = round(time.monotonic() - t_sig, 3)
        else:
            a.wait_until(lambda: False, s.timeout_s, poll=0.02)
            rc, hung = a.finish(1.0)
            ev["signal"] = {"sent": []}
        if hung:
            c.anomaly("hang", where, f"still running {120 if fault else s.timeout_s:.0f} s after "
                                     f"{'the signal' if fault else 'the start'}; killed")
        a.new_steps()
        ev["start_step"], ev["first_record_s"], ev["wall_s"] = a.poll_start(), a.first_record_s, round(a.elapsed(), 3)
        ev["stop"] = check_stop(c, a, fault or {}, ev["signal"], rc, where)
        if ev["signal"]["sent"]:
            run["faults"] += 1
        new = [r for r in loss_records(read_records(folder)) if ev["start_step"] is not None and r["step"] > ev["start_step"]]
        ev["new_records"] = len(new)
        ev["new_records_match"] = all(same(r["loss"], c.ref["records"][r["step"]]["loss"]) for r in new
                                      if r["step"] in c.ref["records"])
        last = new[-1]["step"] if new else None
        began_save = last is not None and any(k % s.ckpt_every == 0 for k in range(ev["start_step"] + 1, last))
        if left_over and began_save:  # Orbax removes them in the background and waits for that before a save
            now_left = leftovers(folder)
            still = sorted(n for n, ident in left_over.items() if now_left.get(n) == ident)
            ev["leftovers_cleaned"] = not still
            if still:
                c.anomaly("temporary folders not cleaned", where, f"{still} (the same folders a kill left) still in "
                                                                  f"checkpoints/ after this start began a save")
        if pending:
            rep = check_damage_report(c, a, pending, where)
            if rep is not None:
                ev["damage_report"] = rep
                pending["report"] = rep
                if rep.get("moved_to"):
                    damaged.add(pathlib.Path(rep["moved_to"]).name)
                pending = None
        ev["folder"] = check_folder(c, folder, before, damaged, where)
        c.events.append(ev)
        log(f"{name}: {fault['signal'] + (' x2' if fault['double'] else '') + ' on ' + fault['trigger'] + '=' + str(fault['param']) if fault else 'to the end'}"
            f" -> exit {rc}, start {ev['start_step']}, +{ev['new_records']} steps"
            f"{', save in flight ' + str(ev['signal']['save_in_flight']) if fault and ev['signal']['save_in_flight'] else ''}")
        if ev["stop"]["finished"] or (rc == 0 and not fault):
            break
        if run["attempts"] > 3 * budget + 10:
            c.anomaly("gave up", where, f"{run['attempts']} starts and the run has not finished")
            break
        if not pending:
            d = maybe_damage(c, folder, max(1, s.kills - c.signals_sent), where)
            if d:
                ev["damage"] = d
                if "expect_from" in d and "probe" not in d:
                    pending = d
    final = loss_records(read_records(folder))
    run["compare"] = compare(final, c.ref["records"], complete=True)
    vals = [r for r in read_records(folder) if "val_loss" in r]
    ref_val = c.ref["val_loss"]
    run["val_loss_match"] = bool(vals) and ref_val is not None and same(vals[-1]["val_loss"], ref_val)
    run["final_ok"] = compare_ok(run["compare"]) and run["val_loss_match"]
    if s.compare_state:
        run["final_state"] = leaf_diff(c.scratch / "reference" / "checkpoints", folder / "checkpoints", s.steps, c.env)
        if run["final_state"].get("changed") != []:
            c.anomaly("final checkpoint differs from the reference", f"run{idx}", json.dumps(run["final_state"])[:1500])
    run["aside"] = aside(folder)
    run["wall_s"] = round(time.monotonic() - t_run, 1)
    if pending:
        c.anomaly("damaged checkpoint not handled", f"run{idx}", f"no start reported the damage of step {pending['step']}")
    if not run["final_ok"]:
        c.anomaly("final records differ from the reference", f"run{idx}", json.dumps(run["compare"]))
    log(f"run{idx}: {run['attempts']} starts, {run['faults']} signal faults, final records "
        f"{'identical to the reference' if run['final_ok'] else 'DIFFER'}")
    c.runs.append(run)
    return run
