"""The fault campaign's counts (`summarize`) and its report (`markdown`: a function of faults.json
alone, so `--from-json` re-renders it)."""

from __future__ import annotations

import json
import pathlib
import statistics

import numpy as np

from experiments.faults.checks import Campaign
from experiments.faults.plan import DAMAGE_KINDS, IN_PLACE, PROBE, SIGNALS


EXPLAIN = {  # anomaly kind -> what it means (printed under the anomalies that occurred)
    "unexpected exit status": "A signal whose exit status was not the promised one (-9 after SIGKILL, 130 after "
        "SIGINT, 143 after SIGTERM, 0 only when the run had finished).",
    "traceback": "A Python traceback on stderr (its exception line and innermost frames are shown).",
    "signal lost": "A SIGINT/SIGTERM that changed nothing: the run did not stop, trained to the last step and exited 0 "
        "(and exit 0 was not a race with the end of the run: it had not logged step N - 2 when the signal was sent).",
    "temporary folders not cleaned": "An Orbax temporary folder a kill left (the same folder: inode and ctime) was "
        "still in checkpoints/ after the next start had begun a save (Orbax removes such folders in a background "
        "thread that it joins before its first save).",
    "unexpected stderr": "A stderr line that is none of boostjax's stop, 'again', damaged-checkpoint or "
        "no-checksums lines.",
}

FAULT_EXERCISES = {  # what each kind of fault exercises (for the report)
    "SIGKILL": "no clean-up at all: the previous committed checkpoint must be intact, Orbax temporary folders and "
               "metrics records past the checkpoint are dropped on the next start",
    "SIGINT": "Ctrl-C: stop after the current step, save a checkpoint whose parameters, optimizer state and data "
              "position agree, exit 130 with one line",
    "SIGTERM": "what SLURM / Kubernetes send first: same as SIGINT, exit 143",
    "double signal": "a second SIGINT/SIGTERM 0-0.3 s after the first, usually while the final checkpoint is written: "
                     "must change nothing (one extra 'again' line)",
    "kill during save": "any signal while an asynchronous save is in flight (an *orbax-checkpoint-tmp* folder, or a "
                        "committed step whose checksums are not written yet)",
    "flip": "64 bytes inverted in the middle of the newest checkpoint's largest file (silent bit rot): only the "
            "checksums can see it",
    "truncate": "a random file of the newest checkpoint cut to a random shorter length (a partial copy)",
    "delete-file": "a random file of the newest checkpoint deleted",
    "delete-data": "the newest checkpoint's data/ item (the data iterator position) deleted",
    PROBE: "SHA256SUMS deleted and 64 bytes flipped (a copy of the run folder): the step is restored unverified "
           "by design; the probe records what the restore did",
}


# ------------------------------------------------------------------------------------ summary


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 2) if xs else None


def summarize(c: Campaign) -> dict:
    ev = c.events
    faults = [e for e in ev if e["signal"]["sent"]]
    by_sig = {k: sum(1 for e in faults if e["signal"]["sent"][0] == k) for k in SIGNALS}
    damage = [e["damage"] for e in ev if e.get("damage") and "skipped" not in e["damage"]]
    by_damage = {k: sum(1 for d in damage if d["kind"] == k) for k in DAMAGE_KINDS}
    reports = [e["damage_report"] for e in ev if "damage_report" in e]
    resumes = [e for e in ev if e["start_step"]]
    restarts = len(ev) - len(c.runs)
    kinds: dict[str, int] = {}
    for a in c.anomalies:
        kinds[a["kind"]] = kinds.get(a["kind"], 0) + 1
    mismatch_runs = [r["run"] for r in c.runs if r["compare"]["n_different"] or not r["val_loss_match"]]
    lost_records = sum(len(r["compare"]["missing"]) + len(r["compare"]["duplicates"]) for r in c.runs)
    first = [e["first_record_s"] for e in ev if e["first_record_s"] is not None and e["attempt"] > 1]
    stop = [e["stop_s"] for e in ev if "stop_s" in e and e["signal"]["sent"] and e["signal"]["sent"][0] != "SIGKILL"
            and e["stop"]["rc"] in (130, 143)]
    slow_cut = (statistics.median(first) * 2 + 5) if first else None
    return {
        "signal_faults": len(faults), "by_signal": by_sig,
        "double_signal": sum(1 for e in faults if len(e["signal"]["sent"]) == 2),
        "double_planned_but_exited_first": sum(1 for e in faults if e["fault"]["double"] and len(e["signal"]["sent"]) == 1),
        "again_lines": sum(e["stop"].get("again_lines", 0) for e in faults),
        "aimed_at_save": sum(1 for e in faults if e["fault"]["trigger"] == "save" and e["trigger"]["result"] == "fired"),
        "save_in_flight_at_signal": sum(1 for e in faults if e["signal"]["save_in_flight"]),
        "sigkill_during_save": sum(1 for e in faults if e["signal"]["save_in_flight"] and e["signal"]["sent"][0] == "SIGKILL"),
        "by_trigger": {t: sum(1 for e in faults if e["fault"]["trigger"] == t) for t in ("time", "steps", "save")},
        "signal_before_first_step": sum(1 for e in faults if e["start_step"] is None),
        "faults_planned_but_run_finished_first": sum(1 for e in ev if e["fault"] and not e["signal"]["sent"]),
        "damage": len(damage), "by_damage": by_damage,
        "damage_in_place": sum(by_damage[k] for k in IN_PLACE),
        "damage_reported_correctly": sum(1 for r in reports if r["ok"]), "damage_reports": len(reports),
        "damage_skipped_not_eligible": sum(1 for e in ev if e.get("damage", {}).get("skipped")),
        "probes": len(c.probes), "probes_losses_match": sum(1 for p in c.probes if p["losses_match"]),
        "leftovers_checked": sum(1 for e in ev if "leftovers_cleaned" in e),
        "leftovers_cleaned": sum(1 for e in ev if e.get("leftovers_cleaned")),
        "campaign_runs": len(c.runs), "starts": len(ev), "restarts": restarts, "resumes": len(resumes),
        "resumes_matched": sum(1 for e in resumes if e["new_records"] and e["new_records_match"]),
        "resumes_without_new_steps": sum(1 for e in resumes if not e["new_records"]),
        "resumes_mismatched": sum(1 for e in resumes if e["new_records"] and not e["new_records_match"]),
        "final_runs_identical": sum(1 for r in c.runs if r["final_ok"]),
        "final_states_compared": sum(1 for r in c.runs if "final_state" in r),
        "final_states_identical": sum(1 for r in c.runs if r.get("final_state", {}).get("changed") == []),
        "mismatches": sum(r["compare"]["n_different"] for r in c.runs) + len([r for r in c.runs if not r["val_loss_match"]])
                      + sum(1 for r in c.runs if "final_state" in r and r["final_state"].get("changed") != [])
                      + sum(1 for e in resumes if e["new_records"] and not e["new_records_match"]),
        "mismatch_runs": mismatch_runs,
        "data_lost": lost_records + kinds.get("checkpoint deleted", 0) + kinds.get("intact checkpoint set aside", 0)
                     + kinds.get("checksummed checkpoint does not verify", 0)
                     + kinds.get("records missing or duplicated", 0),
        "lost_records": lost_records,
        "unexpected_exit": kinds.get("unexpected exit status", 0), "tracebacks": kinds.get("traceback", 0),
        "signals_lost": kinds.get("signal lost", 0),
        "unexpected_stderr": kinds.get("unexpected stderr", 0), "hangs": kinds.get("hang", 0),
        "anomalies_by_kind": kinds,
        "restart_to_first_step_s": {"n": len(first), "median": _pct(first, 50), "p90": _pct(first, 90),
                                    "max": max(first) if first else None},
        "signal_to_exit_s": {"n": len(stop), "median": _pct(stop, 50), "p90": _pct(stop, 90),
                             "max": max(stop) if stop else None},
        "slow_restarts": [{"name": e["name"], "first_record_s": e["first_record_s"]} for e in ev
                          if slow_cut and e["first_record_s"] and e["attempt"] > 1 and e["first_record_s"] > slow_cut],
    }


def _ranges(xs: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out: list[str] = []
    for x in xs:
        if out and "-" not in out[-1] and int(out[-1]) == x - 1 or out and "-" in out[-1] and int(out[-1].split("-")[1]) == x - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{x}"
        else:
            out.append(str(x))
    return ", ".join(out) + (" ..." if len(xs) >= 32 else "")


def probe_story(p: dict) -> str:
    """What happened in one probe, in words."""
    v, name, starts = p["values"], pathlib.Path(p["folder"]).name, p.get("starts", [])
    changed = v.get("changed") or []
    what = "; ".join(f"{d['leaf']} rows {_ranges(d.get('rows', []))}, up to {d['max_abs_change']:.3g}" for d in changed)
    fv = p.get("final_values", {})
    final = ("its last checkpoint is bit-identical to the reference's" if fv.get("changed") == [] else
             "its last checkpoint differs from the reference's in " + "; ".join(
                 f"{d['leaf']} ({d['values_changed']} values)" for d in fv["changed"]) if fv.get("changed") else
             "the run did not finish")
    if starts and starts[0]["nonfinite_step"]:
        msg = starts[0]["nonfinite_line"][len("boostjax: "):]
        story = (f"Orbax restored the damaged values ({what or 'see faults.json'}) without complaint; the loss became "
                 f"non-finite at step {starts[0]['nonfinite_step']} and boostjax stopped with exit 1: `{msg}`")
        if p["rc"] == 0:
            return (f"\n{name}: {story}. The diverged-run rule moved a checkpoint aside and a second start resumed from "
                    f"step {starts[-1]['resumed_from']}; it finished with losses "
                    f"{'bit-identical to' if p['losses_match'] else 'different from'} the reference, and {final}. "
                    f"Here the rule happened to catch the damaged step; with SHA256SUMS the first start would have.")
        again = (f" A second start restored step {starts[1]['resumed_from']} again and stopped at step "
                 f"{starts[1]['nonfinite_step']}." if len(starts) > 1 and starts[1]["nonfinite_step"] else "")
        return (f"\n{name}: {story}. The damaged step {p['step']} is not the step before the non-finite one, so it is "
                f"kept as 'the last good checkpoint'.{again} With SHA256SUMS the first start would have set it aside "
                f"and resumed from step {p['older_step']}.")
    if not changed and p["losses_match"]:
        return (f"\n{name}: the 64 inverted bytes lie in a part of the file the restore does not read (all "
                f"{v.get('leaves')} restored arrays are bit-identical to the intact copy's), so the unverified resume "
                f"was exact and {final}.")
    if changed and not p["losses_match"]:
        return (f"\n{name}: Orbax restored the damaged values ({what}) without complaint; the run continued from them "
                f"and its losses differ from the reference from step {p['first_different_step']} on; {final}. The "
                f"only stderr line said the step was restored without verification.")
    if changed:
        return (f"\n{name}: Orbax restored the damaged values ({what}) without complaint and the run continued from "
                f"them; its losses are still bit-identical to the reference (the changed values did not enter any "
                f"later loss), but {final}. Equal losses do not prove equal parameters; only the checksums would "
                f"have caught this.")
    return f"\n{name}: {json.dumps(v)[:300]}"


def markdown(res: dict) -> str:
    s, n, ref = res["settings"], res["counts"], res["reference"]
    t = ["# Fault campaign: kills, stop signals and damaged checkpoints against `boostjax train`", "",
         f"Command: `{res['command']}` — wall time {res['wall_s'] / 60:.1f} min on {res['platform']}.", "",
         f"Training command (every run, reference and campaign): `{res['train_command']}`.",
         f"Uninterrupted reference: {ref['steps']} steps, loss {ref['first_loss']:.4f} -> {ref['final_loss']:.4f} "
         f"(val {ref['val_loss']:.4f}), {ref['wall_s']:.1f} s.", "",
         f"**In short:** {n['signal_faults']} signals ({n['by_signal']['SIGKILL']} SIGKILL, {n['by_signal']['SIGINT']} "
         f"SIGINT, {n['by_signal']['SIGTERM']} SIGTERM) and {n['damage']} damaged checkpoints over {n['campaign_runs']} "
         f"campaign runs ({n['starts']} starts): {n['mismatches']} mismatches, {n['data_lost']} data lost; every finished "
         f"run's {s['steps']} loss records were bit-identical to the uninterrupted run's in {n['final_runs_identical']} of "
         f"{n['campaign_runs']} runs. Failures: {n['unexpected_exit']} unexpected exit statuses, {n['signals_lost']} "
         f"signals lost, {n['tracebacks']} "
         f"tracebacks, {n['unexpected_stderr']} other unexpected stderr, {n['hangs']} hangs"
         + (" (see Anomalies)." if res["anomalies"] else "."), "",
         "## Result", "",
         "| | count |", "|---|---|",
         f"| signal faults injected | {n['signal_faults']} |",
         *[f"| &nbsp;&nbsp;{k} | {v} |" for k, v in n["by_signal"].items()],
         f"| &nbsp;&nbsp;double signal (SIGINT/SIGTERM sent twice) | {n['double_signal']} |",
         f"| &nbsp;&nbsp;signal while a checkpoint save was in flight | {n['save_in_flight_at_signal']} "
         f"(SIGKILL: {n['sigkill_during_save']}; aimed at a save and caught: {n['aimed_at_save']}) |",
         f"| &nbsp;&nbsp;signal before the start had restored (imports, restore; no config_history line yet) | {n['signal_before_first_step']} |",
         f"| damaged checkpoints | {n['damage']} |",
         *[f"| &nbsp;&nbsp;{k} | {v} |" for k, v in n["by_damage"].items()],
         f"| damaged in place, reported + moved aside + resumed from the older step | {n['damage_reported_correctly']} of {n['damage_in_place']} |",
         f"| starts that found a kill's Orbax temporary folder or .trash and had removed it by their first save | "
         f"{n['leftovers_cleaned']} of {n['leftovers_checked']} |",
         f"| campaign runs / starts / restarts | {n['campaign_runs']} / {n['starts']} / {n['restarts']} |",
         f"| resumes (started from a checkpoint) | {n['resumes']} |",
         f"| &nbsp;&nbsp;every step they logged bit-identical to the reference | {n['resumes_matched']} |",
         f"| &nbsp;&nbsp;stopped before logging a step | {n['resumes_without_new_steps']} |",
         f"| campaign runs whose final metrics.jsonl equals the reference (steps 1..{s['steps']} once each, bit-identical) | {n['final_runs_identical']} of {n['campaign_runs']} |",
         f"| campaign runs whose last checkpoint (parameters + optimizer state, every array) is bit-identical to the reference's | "
         f"{n['final_states_identical']} of {n['final_states_compared']} compared |",
         f"| **mismatches** (loss / grad norm / lr / val loss records, or final checkpoints, that differ) | **{n['mismatches']}** |",
         f"| **data lost** (see the definition) | **{n['data_lost']}** |",
         f"| unexpected exit status | {n['unexpected_exit']} |",
         f"| signals lost (SIGINT/SIGTERM, the run went on to the end and exited 0) | {n['signals_lost']} |",
         f"| Python tracebacks on stderr | {n['tracebacks']} |",
         f"| other unexpected stderr | {n['unexpected_stderr']} |",
         f"| hangs | {n['hangs']} |",
         f"| restart -> first new step, s (median / p90 / max) | {n['restart_to_first_step_s']['median']} / "
         f"{n['restart_to_first_step_s']['p90']} / {n['restart_to_first_step_s']['max']} |",
         f"| SIGINT/SIGTERM -> exit, s (median / p90 / max) | {n['signal_to_exit_s']['median']} / "
         f"{n['signal_to_exit_s']['p90']} / {n['signal_to_exit_s']['max']} |", ""]
    t += ["Triggers: " + ", ".join(f"{k} {v}" for k, v in n["by_trigger"].items()) +
          f" (time: uniform 0.2-{s['max_wait_s']} s after the start; steps: 1-{s['max_wait_steps']} newly logged steps; "
          f"save: let 0-{s['max_skip_saves']} saves pass, signal during the next, polled every 1 ms). "
          f"{n['faults_planned_but_run_finished_first']} planned faults found the run already finished. "
          f"{n['double_planned_but_exited_first']} double signals found the process gone before the second.", ""]
    t += ["## Definitions", "",
          "- **Mismatch**: a loss, grad-norm or lr record of a step (or the final val loss) that is not bit-identical "
          "(same 64-bit float as parsed from metrics.jsonl) to the uninterrupted run's; counted in each campaign "
          "run's final metrics.jsonl and in the records each resumed process wrote.",
          "- **Data lost**: (a) a step 1..N missing from, or present twice in, a finished campaign run's metrics.jsonl; "
          "(b) a committed checkpoint that vanished from checkpoints/ other than by pruning (fewer than "
          f"`--keep-ckpts` {s['keep']} newer steps exist) or being moved to checkpoints-aside/; (c) an intact "
          "checkpoint (one the campaign did not damage) moved to checkpoints-aside/; (d) a checkpoint with SHA256SUMS "
          "that no longer matches them, found after a stop (a kill that damaged a committed step).",
          "- **Unexpected exit status**: anything but -9 after SIGKILL, 130 after SIGINT, 143 after SIGTERM, 0 when the "
          "run had finished. **Unexpected stderr**: any line other than boostjax's stop, 'again', damaged-checkpoint "
          "and no-checksums lines; a Python traceback is counted apart. Both are failures.",
          "- **Restart -> first new step**: from starting the command to the first new loss record (imports, restore, "
          "compile from the persistent cache); **signal -> exit**: SIGINT/SIGTERM to the process exiting (the "
          "current step, the final save and the wait for it).", ""]
    t += ["## What each fault exercises", "", "| fault | exercises |", "|---|---|",
          *[f"| {k} | {v} |" for k, v in FAULT_EXERCISES.items()], ""]
    t += ["## Checkpoints without SHA256SUMS (probes)", "",
          "A step whose SHA256SUMS is missing is restored without verification by design (a kill between Orbax's "
          "commit and the checksums leaves such a step, and older boostjax versions wrote no checksums). Each probe "
          "copied the run folder at that moment, deleted the newest step's SHA256SUMS, inverted 64 bytes in the middle "
          "of its largest file and ran the same command in the copy to the end. 'Values changed' compares what Orbax "
          "restores from the damaged copy with the intact original. Without SHA256SUMS nothing checks the bytes: if "
          "the inverted bytes fall in array data, Orbax restores the changed values and the run continues from them "
          "with only the 'restored without verification' line on stderr; if they fall in a part of the file the "
          "restore does not read, nothing changes.", "",
          "| probe | step | damage | restore | values changed | losses vs reference | last checkpoint vs reference |",
          "|---|---|---|---|---|---|---|"]
    for p in res["probes"]:
        v = p["values"]
        if "read_error" in v:
            vals = f"Orbax cannot read it ({v['read_error'][:100]})"
        elif "changed" in v:
            vals = ("none of " + str(v["leaves"]) + " arrays") if not v["changed"] else "; ".join(
                f"{d['leaf']}: {d['values_changed']} values in rows {_ranges(d.get('rows', []))}, max change "
                f"{d['max_abs_change']:.3g}" for d in v["changed"])
        else:
            vals = "helper failed"
        known = p["stderr"]["known"]
        restore = ("restored unverified from step " + str(p["resumed_from"]) if known.get("unverified") else
                   "set aside (Orbax read error), resumed from " + str(p["resumed_from"]) if known.get("damaged") else
                   f"started from {p['resumed_from']}")
        starts = p.get("starts", [])
        if starts and starts[0]["nonfinite_step"]:
            restore += (f"; non-finite loss at step {starts[0]['nonfinite_step']}, exit 1" +
                        (f"; a second start: from {starts[1]['resumed_from']} again, non-finite at step "
                         f"{starts[1]['nonfinite_step']}, exit {starts[1]['rc']}" if len(starts) > 1 and
                         starts[1]["nonfinite_step"] else f"; a second start: exit {starts[-1]['rc']}" if len(starts) > 1 else ""))
        diverged = p["rc"] != 0
        loss = ((f"identical up to step {p['last_step']}, then non-finite" if diverged else "identical")
                if not p["compare"]["n_different"] else
                f"{p['compare']['n_different']} steps differ from step {p['first_different_step']} "
                f"(max |loss change| {p['max_abs_loss_change']:.3g})" + (", then non-finite" if diverged else ""))
        extra = f"; {p['stderr']['n_other']} other stderr lines" + (" incl. tracebacks" if p["stderr"]["traceback"] else "") \
            if p["stderr"]["n_other"] else ""
        fv = p.get("final_values", {})
        final = ("identical" if fv.get("changed") == [] else "; ".join(
            f"{d['leaf']}: {d['values_changed']} values differ" for d in fv["changed"]) if fv.get("changed")
            else "the run did not finish" if fv.get("not_finished") else "not compared")
        t.append(f"| {pathlib.Path(p['folder']).name} | {p['step']} | {p['what']} | {restore}{extra} | {vals} | {loss} "
                 f"| {final} |")
    if not res["probes"]:
        t.append("| (none in this campaign) | | | | | | |")
    t += [probe_story(p) for p in res["probes"]]
    t += ["", "## Anomalies", ""]
    if not res["anomalies"]:
        t.append("None: every exit status, stderr line, checkpoint and record was as expected.")
    for a in res["anomalies"]:
        detail = a["detail"].strip().splitlines()
        short = " / ".join(x.strip() for x in detail[-4:])[:600]
        t.append(f"- **{a['kind']}** ({a['where']}): {short}")
    seen = list(dict.fromkeys(a["kind"] for a in res["anomalies"]))
    if seen:
        t += ["", *[f"*{k}*: {EXPLAIN[k]}" for k in seen if k in EXPLAIN]]
    if n["slow_restarts"]:
        t += ["", "Slow restarts (first new step later than 2 x median + 5 s): " +
              ", ".join(f"{x['name']} {x['first_record_s']:.1f} s" for x in n["slow_restarts"])]
    t += ["", "## Settings", "", "```", json.dumps({k: v for k, v in s.items() if k != "model"}), "```", "",
          "Every event (fault drawn, trigger result, signals sent, exit status, stderr classification, checkpoints "
          "before and after, damage done and how the next start reported it, timings) is in faults.json.", ""]
    return "\n".join(t)
