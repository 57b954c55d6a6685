"""All three systems in one mesh, through the command line: an offload plan for one device of a
`data=2,stage=2,model=2` BTP mesh (`boostjax plan --strategy btp --mesh ...`), then

    boostjax train --strategy btp --mesh data=2,stage=2,model=2 --optimizer rotation --pipeline-delay 4
                   --offload-plan plan.json

beside the same training on one device (`--optimizer rotation --pipeline-delay 4`, no mesh, no plan):
the logged losses step by step, the final validation loss, and what the plan put on host.
fp32 on 8 simulated CPU devices, the built-in corpus, the tiny preset (4 layers, 2 per stage).

    python -m experiments.tp.all_three      # writes experiments/results/all_three.{json,md}
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from experiments import common

ROOT = common.ROOT
MESH = "data=2,stage=2,model=2"
STEPS, BATCH, SEQ = 60, 16, 128
COMMON = ["--preset", "tiny", "--batch", str(BATCH), "--seq", str(SEQ)]
TRAIN = [*COMMON, "--steps", str(STEPS), "--log-every", "5", "--eval-every", str(STEPS), "--ckpt-every", str(STEPS),
         "--optimizer", "rotation", "--pipeline-delay", "4", "--no-progress", "--no-tensorboard"]
# near the smallest budget the planner can meet (13.8 MB for one device's share with the rotation state priced;
# keeping everything needs 41.3 MB): it sends optimizer states to host and recomputes. A plan records its
# optimizer (and its state's bytes), so the plan takes train's --optimizer
PLAN = [*COMMON, "--dtype", "float32", "--optimizer", "rotation", "--strategy", "btp", "--mesh", MESH,
        "--memory-cap", "0.0145", "--time-limit", "20"]


def _run(args: list[str]) -> tuple[str, float]:
    env = common.with_root()
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "boostjax.cli", *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"boostjax {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr, time.perf_counter() - t0


def _losses(run: pathlib.Path) -> tuple[dict[int, float], float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return ({r["step"]: r["loss"] for r in records if "loss" in r},
            next(r["val_loss"] for r in reversed(records) if "val_loss" in r))


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_out(ap, "all_three", from_json=False)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    t0 = time.perf_counter()
    work = pathlib.Path(tempfile.mkdtemp(prefix="all_three_"))
    try:
        plan_file = work / "plan.json"
        plan_out, plan_s = _run(["plan", *PLAN, "--out", str(plan_file)])
        plan = json.loads(plan_file.read_text())
        mesh_out, mesh_s = _run(["train", *TRAIN, "--strategy", "btp", "--mesh", MESH,
                                 "--offload-plan", str(plan_file), "--out", str(work / "mesh")])
        one_out, one_s = _run(["train", *TRAIN, "--out", str(work / "one")])
        mesh, one = _losses(work / "mesh"), _losses(work / "one")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    steps = sorted(one[0])
    rel = max(abs(mesh[0][s] - one[0][s]) / abs(one[0][s]) for s in steps)
    result = {
        "mesh": MESH, "steps": STEPS, "batch": BATCH, "seq": SEQ,
        "plan": {"decisions": plan["decisions"], "predicted_peak_bytes": plan["predicted_peak_bytes"],
                 "budget_bytes": plan["budget_bytes"], "planned_for": plan.get("planned_for"), "seconds": plan_s},
        "losses": {str(s): {"one_device": one[0][s], "mesh": mesh[0][s]} for s in steps},
        "val_loss": {"one_device": one[1], "mesh": mesh[1]}, "max_rel_loss_diff": rel,
        "train_seconds": {"one_device": one_s, "mesh": mesh_s},
        "summaries": {"one_device": one_out.strip().splitlines()[-1], "mesh": mesh_out.strip().splitlines()[-1]},
    }
    lines = [f"# All three systems in one mesh ({MESH}, tiny CoLA, {STEPS} steps of {BATCH}x{SEQ}, fp32, CPU)", "",
             "`python -m experiments.tp.all_three`: `boostjax plan --strategy btp --mesh " + MESH + " ...`, then",
             "`boostjax train --strategy btp --mesh " + MESH + " --optimizer rotation --pipeline-delay 4 "
             "--offload-plan plan.json` beside the same run on one device.", "",
             f"Plan (one device's share: 2 layers, budget {plan['budget_bytes'] / 1e6:.1f} MB, predicted peak "
             f"{plan['predicted_peak_bytes'] / 1e6:.1f} MB): parameter modes {plan['decisions']['mode']}, boundaries "
             f"{plan['decisions']['boundary']}, inner options {plan['decisions']['inner']}.",
             "", "| step | one device | BTP x pipeline x rotation x delay x offload |", "|---|---|---|"]
    lines += [f"| {s} | {one[0][s]:.6f} | {mesh[0][s]:.6f} |" for s in steps]
    lines += [f"| val | {one[1]:.6f} | {mesh[1]:.6f} |", "",
              f"Largest relative difference of the logged losses: {rel:.2e}. Wall time: one device {one_s:.0f} s, "
              f"mesh {mesh_s:.0f} s (8 simulated devices on a shared CPU)."]
    common.write(args.out, "all_three", data=result, md="\n".join(lines), indent=2,
                     command=common.command_line("all_three"), started=t0)


if __name__ == "__main__":
    main()
