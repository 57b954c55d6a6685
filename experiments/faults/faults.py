"""Fault campaign: random kills, stop signals and damaged checkpoints against `boostjax train` on a
simulated 2x2 mesh (`--strategy btp --mesh data=2,model=2`, a tiny CoLA model). Every run that is
interrupted and resumed must end with the uninterrupted run's per-step losses, bit for bit.

1. Reference: the training command runs once, uninterrupted, in a fresh run folder; its
   metrics.jsonl gives the per-step loss (and grad norm, lr, final val loss) records.
2. Campaign runs: the same command in a fresh run folder, then, over and over: wait (a random time
   after the start, a random number of newly logged steps, or until a checkpoint save is in flight:
   an `*orbax-checkpoint-tmp*` folder or a step folder without BLAKE3SUMS), send SIGKILL, SIGINT or
   SIGTERM (SIGINT/SIGTERM sometimes twice), check the exit status (-9 / 130 / 143, or 0 when the
   run had already finished) and stderr, check the folder, maybe damage the newest checkpoint, and
   start the same command again, until the run finishes. The schedule (signals, triggers, damage
   kinds and the choice of files) is drawn from `--seed`; where a fault lands depends on timing.
3. Damage to the newest checkpoint (when it has BLAKE3SUMS and an older step exists): flip 64 bytes
   in the middle of its largest file, truncate a random file, delete a random file, delete its
   `data/` item. The next start must name it in one stderr line, move it to checkpoints-aside/ and
   resume from the next older step. "Delete BLAKE3SUMS and flip 64 bytes" is applied to a copy of
   the run folder (a *probe*): such a step is restored unverified by design, so the probe records
   what happened (which restored values changed, whether the losses still match) apart from the
   campaign's counts.
4. Checks after every stop: metrics.jsonl holds steps 1..k once each, every record identical to
   the reference; every checkpoint with BLAKE3SUMS verifies (hashed here, independently of
   boostjax); no checkpoint vanished except by pruning (`--keep-ckpts`) or being moved aside;
   nothing was moved aside that the campaign did not damage; Orbax temporary folders left by a kill
   are gone once the next start has begun a save. At the end of each campaign run the final
   metrics.jsonl is compared with the reference (every step 1..N exactly once, bit-identical), and so
   is its last checkpoint (every parameter and optimizer-state array, restored by Orbax in a helper
   process). A SIGINT/SIGTERM must give 130/143, or 0 only if the run was at its last steps.

    python -m experiments.faults.faults                # full: 50 signals, 14 damaged checkpoints (5-8 min on 2 busy cores)
    python -m experiments.faults.faults --quick        # smoke: 2 signals, 1 damaged checkpoint (30-50 s)
    python -m experiments.faults.faults --from-json experiments/results/faults.json   # re-render faults.md only
Writes <out>/faults.json (settings, counts, every event) and faults.md (default out: experiments/results).
The run folders, logs and JAX compilation cache go to --scratch (default: a new temporary folder,
removed at the end unless --keep-scratch).

This file is the entry point (`run_campaign`, `main`); the campaign lives in its siblings:
plan.py (settings, the schedule drawn from the seed), folder.py (reading, verifying and
damaging a run folder), process.py (starts of the training command, stderr, the reference run),
checks.py (the campaign's record and the checks after each stop), campaign.py (one
campaign run, the probes) and report.py (counts, faults.md).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import tempfile
import time
from dataclasses import asdict, replace
from typing import Sequence

import numpy as np

from experiments import common
from experiments.common import log
from experiments.faults.campaign import campaign_run
from experiments.faults.checks import Campaign
from experiments.faults.folder import MANIFEST, _blake3, compare, compare_ok, damage, verify
from experiments.faults.plan import DAMAGE_KINDS, QUICK, Settings, draw_damage_kinds
from experiments.faults.process import classify_stderr, run_reference, subprocess_env
from experiments.faults.report import markdown, summarize

# what tests and other scripts use through this module, defined in its siblings
__all__ = ["DAMAGE_KINDS", "MANIFEST", "QUICK", "Settings", "_blake3", "classify_stderr", "compare", "compare_ok",
           "damage", "draw_damage_kinds", "main", "markdown", "run_campaign", "verify"]


# --------------------------------------------------------------------------------------- main


def run_campaign(s: Settings, out: pathlib.Path, scratch: pathlib.Path | None = None, command: str = "",
                 keep_scratch: bool = False) -> dict:
    """Reference run, campaign runs until >= kills signals and >= corruptions damaged checkpoints;
    writes faults.{json,md} under `out` (and prints the report); returns the JSON object."""
    out.mkdir(parents=True, exist_ok=True)
    made = scratch is None
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="boostjax-faults-")) if made else scratch
    if scratch.exists() and any(scratch.iterdir()) and not (scratch / "jax-cache").is_dir():
        raise ValueError(f"faults: --scratch {scratch} is not empty; fix: pass a new or empty folder")
    for sub in ("logs",):
        (scratch / sub).mkdir(parents=True, exist_ok=True)
    for old in [p for p in scratch.iterdir() if p.name not in ("jax-cache", "logs")]:
        shutil.rmtree(old)  # a scratch folder of an earlier campaign: keep only its compilation cache
    env = subprocess_env(scratch / "jax-cache")
    t0 = time.perf_counter()
    log(f"reference run ({s.steps} steps) in {scratch}")
    ref = run_reference(s, scratch, env)
    log(f"reference: loss {ref['first_loss']:.4f} -> {ref['final_loss']:.4f}, {ref['wall_s']} s")
    plan_rng, fault_rng, damage_rng = (np.random.default_rng(x) for x in np.random.SeedSequence(s.seed).spawn(3))
    c = Campaign(s, scratch, env, ref, fault_rng, damage_rng, draw_damage_kinds(plan_rng, s.corruptions))
    per_run = -(-s.kills // s.runs)
    idx = 0
    while c.signals_sent < s.kills or c.damage_done < len(c.damage_plan):
        idx += 1
        if idx > 3 * s.runs + 2:
            c.anomaly("gave up", "campaign", f"{idx - 1} runs and still {c.signals_sent} signals, {c.damage_done} damages")
            break
        budget = max(1, min(per_run, s.kills - c.signals_sent)) if c.signals_sent < s.kills else per_run
        campaign_run(c, idx, budget)
    wall_s = time.perf_counter() - t0
    ref_public = {k: v for k, v in ref.items() if k != "records"}
    platform = f"{common.machine_line()} at the end, JAX on CPU"
    res = {"settings": json.loads(json.dumps(asdict(s))), "command": command, "wall_s": round(wall_s, 1),
           "platform": platform, "train_command": " ".join(["boostjax", *s.command(pathlib.Path("RUN"))[3:]]),
           "scratch": str(scratch) if keep_scratch or not made else None, "reference": ref_public,
           "damage_plan": c.damage_plan, "counts": summarize(c), "runs": c.runs, "probes": c.probes,
           "anomalies": c.anomalies, "events": c.events}
    common.write(out, "faults", data=res, md=lambda: markdown(res))
    if made and not keep_scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return res


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    p = common.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke version: 2 signals, 1 damaged checkpoint, 40 steps")
    common.add_out(p, "faults")
    p.add_argument("--scratch", type=pathlib.Path, help="folder for the run folders, logs and JAX cache (kept)")
    p.add_argument("--keep-scratch", action="store_true", help="keep the temporary scratch folder")
    p.add_argument("--seed", type=int, help="seed of the schedule: signals, their triggers, damage kinds and files "
                   "(default 0)")
    p.add_argument("--kills", type=int, help="signals to send, at least (SIGKILL/SIGINT/SIGTERM)")
    p.add_argument("--corruptions", type=int, help="checkpoints to damage, at least")
    for name, kind, what in (
            ("runs", int, "campaign runs the signals are spread over (more start if the counts are not reached)"),
            ("steps", int, "training steps of every run"), ("ckpt-every", int, "steps between checkpoints"),
            ("keep", int, "checkpoints each run keeps (--keep-ckpts)"),
            ("max-wait-s", float, "time trigger: a signal uniform(0.2, this) seconds after the start"),
            ("max-wait-steps", int, "steps trigger: a signal after 1..this newly logged steps"),
            ("p-double", float, "probability that a SIGINT/SIGTERM is sent twice"),
            ("timeout-s", float, "a process that neither stops nor finishes within this many seconds is a hang")):
        p.add_argument(f"--{name}", type=kind, help=f"{what} (default: experiments/faults/plan.py's Settings)")
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    res = common.rerender(args, "faults", markdown)
    if res is not None:
        return res
    over = {k: v for k, v in vars(args).items()
            if v is not None and k not in ("quick", "out", "scratch", "keep_scratch", "from_json")}
    s = replace(QUICK if args.quick else Settings(), **over)
    return run_campaign(s, pathlib.Path(args.out), args.scratch, common.command_line("faults", argv),
                        args.keep_scratch)


if __name__ == "__main__":
    main()
