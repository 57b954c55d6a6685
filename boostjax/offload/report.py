"""What `boostjax plan` reports and writes: the JSON report of a solved plan beside its baselines
(`report`), its readable summary (`summary`), the per-layer decisions as runs of identical layers
(`layer_runs`), the checkpoint counts (`schedule_shape`), and the plan file (`check_out` before the
solve, `write_plan` after it: never a half-written file, never a file that is not a plan replaced).
"""

from __future__ import annotations

import math
import os
import pathlib
import stat
from typing import Any

from boostjax.config import ConfigError
from boostjax.offload.costmodel import PlanInstance
from boostjax.offload.decisions import BOUNDARY_STATES
from boostjax.offload.planfile import Plan, is_plan_file

GB = 1e9


def gpu_host_note(plan: Plan) -> str | None:
    """A warning when `plan` keeps anything in pinned host memory: on a GPU, XLA (jax 0.10's CUDA plugin)
    schedules such a step for latency, not memory, so even with its layers tied (`offload.apply.schedule`)
    the compiled peak can be above the prediction there (docs/gpu-program.md). None when the plan only
    keeps and recomputes."""
    hosted = plan.host_layers
    if not any(hosted.values()):
        return None
    return (f"note: this plan keeps in pinned host memory the input boundary of {hosted['boundary']} layers, the "
            f"parameters of {hosted['params']} and the optimizer state of {hosted['opt_state']}; on a GPU the "
            "compiled step can peak "
            "above the prediction (docs/gpu-program.md); `boostjax train` gives XLA's GPU scheduler the plan's "
            "budget as its memory limit (xla_gpu_memory_limit_slop_factor, unless XLA_FLAGS sets it), which brings "
            "it closer; a larger --memory-cap keeps more on the device")


def layer_runs(plan: Plan) -> list[dict[str, Any]]:
    """Per-layer decisions compressed into runs of consecutive identical layers."""
    d = plan.decisions
    rows = []
    for k in range(len(d.boundary)):
        pol = plan.layer_policy(k)
        key = (d.boundary[k], d.inner[k], pol["params"], pol["opt_state"], pol["segment_kind"])
        if rows and rows[-1]["key"] == key:
            rows[-1]["last"] = k
        else:
            rows.append({"key": key, "first": k, "last": k})
    return [{"first": r["first"], "last": r["last"], "boundary": r["key"][0], "inner": r["key"][1],
             "params": r["key"][2], "opt_state": r["key"][3], "segment_kind": r["key"][4]} for r in rows]


def schedule_shape(plan: Plan) -> dict[str, int]:
    """Checkpoint counts: boundaries kept on device / offloaded to host / recomputed, and layers
    that recompute inside their block (inner option other than `all`)."""
    d = plan.decisions
    out = {f"{s}_checkpoints" if s != "recompute" else "recomputed_boundaries": d.boundary.count(s)
           for s in BOUNDARY_STATES}
    out["layers_with_inner_recompute"] = sum(i != "all" for i in d.inner)
    out["layers_in_flat_segments"] = sum(e - s for s, e in plan.segments if e - s > 1 and d.flat[s])
    out["params_on_host_layers"] = plan.param_place.count("host")
    out["opt_state_on_host_layers"] = plan.opt_place.count("host")
    return out


def report(inst: PlanInstance, plan: Plan, baselines: dict[str, Plan]) -> dict[str, Any]:
    """The JSON object `boostjax plan --json` prints."""
    mega = baselines.get("megatrain")
    return {
        "instance": inst.name, "status": plan.status, "method": plan.method, "solve_s": plan.solve_s,
        "gap": None if math.isinf(plan.gap) else plan.gap, "objective_s": plan.objective,
        "predicted_step_s": plan.predicted_step_s, "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_host_bytes": plan.predicted_host_bytes, "budget_bytes": inst.budget_bytes,
        "base_compute_s": inst.base_compute_s, "tokens_per_s": plan.tokens_per_s, "tflops": plan.tflops,
        "n_layers": inst.n_layers, "schedule": schedule_shape(plan), "layers": layer_runs(plan),
        "speedup_vs_megatrain": (mega.predicted_step_s / plan.predicted_step_s) if mega else None,
        "baselines": {n: {"predicted_step_s": b.predicted_step_s, "predicted_peak_bytes": b.predicted_peak_bytes,
                          "fits": b.status == "FEASIBLE", "tokens_per_s": b.tokens_per_s, "tflops": b.tflops}
                      for n, b in baselines.items()},
    }


def summary(rep: dict[str, Any]) -> str:
    lines = [f"{rep['instance']}: {rep['status']} ({rep['method']}), solved in {rep['solve_s']:.2f} s"
             + (f", gap {rep['gap']:.2%}" if rep["gap"] else ""),
             f"predicted step {rep['predicted_step_s']:.4g} s ({rep['tokens_per_s']:.4g} tokens/s, "
             f"{rep['tflops']:.4g} TFLOPS), peak {rep['predicted_peak_bytes'] / GB:.4g} GB of "
             f"{rep['budget_bytes'] / GB:.4g} GB, host {rep['predicted_host_bytes'] / GB:.4g} GB"]
    s = rep["schedule"]
    lines.append(f"checkpoints: {s['device_checkpoints']} device, {s['host_checkpoints']} host, "
                 f"{s['recomputed_boundaries']} recomputed; {s['layers_with_inner_recompute']} layers recompute "
                 f"inside the block; params on host for {s['params_on_host_layers']} layers, optimizer states "
                 f"for {s['opt_state_on_host_layers']}")
    for r in rep["layers"]:
        span = f"layer {r['first']}" if r["first"] == r["last"] else f"layers {r['first']}-{r['last']}"
        seg = "" if r["segment_kind"] == "single" else f" ({r['segment_kind']} segment)"
        lines.append(f"  {span}: boundary {r['boundary']}, inner {r['inner']}, params {r['params']}, "
                     f"optimizer {r['opt_state']}{seg}")
    lines.append(f"  {'baseline':<11} {'step s':>10} {'peak GB':>10} {'fits':>5} {'plan speedup':>12}")
    for n, b in rep["baselines"].items():
        lines.append(f"  {n:<11} {b['predicted_step_s']:>10.4g} {b['predicted_peak_bytes'] / GB:>10.4g} "
                     f"{'yes' if b['fits'] else 'no':>5} {b['predicted_step_s'] / rep['predicted_step_s']:>11.3f}x")
    return "\n".join(lines)


def check_out(out: str) -> pathlib.Path:
    """`--out` can take the plan: not a folder, its folder exists and is writable, and it is not an
    existing file other than a boostjax plan (which is replaced). Checked before solving."""
    if "\0" in out:
        raise ConfigError(f"plan.out: {out!r} contains a NUL byte; fix: pass a file path such as plan.json")
    p = pathlib.Path(out)
    if p.is_dir():
        raise ConfigError(f"plan.out: {p} is a folder; fix: pass a file path such as {p / 'plan.json'}")
    parent = p.parent
    try:
        st = os.stat(parent)
    except FileNotFoundError:
        raise ConfigError(f"plan.out: the folder {parent} does not exist; fix: create it (mkdir -p {parent}) "
                          "or pass another --out") from None
    except NotADirectoryError:
        raise ConfigError(f"plan.out: {parent} is not a folder (a file is on the path); fix: pass another --out") \
            from None
    except OSError as e:
        raise ConfigError(f"plan.out: cannot reach the folder {parent} ({e.strerror}); fix: pass another --out") \
            from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"plan.out: {parent} is a file, not a folder; fix: pass another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"plan.out: the folder {parent} is not writable; fix: pass another --out")
    if (p.exists() or p.is_symlink()) and not is_plan_file(p):
        raise ConfigError(f"plan.out: {p} exists and is not a boostjax plan (left untouched); fix: pass another "
                          "--out, or move that file away yourself")
    return p


def write_plan(plan: Plan, path: pathlib.Path) -> None:
    """Write the plan through a temporary file in the same folder, so a failed write leaves no half file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(plan.to_json() + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"plan.out: cannot write {path} ({e.strerror}); fix: check the folder's free space and "
                          "permissions, or pass another --out") from None


__all__ = ["GB", "check_out", "layer_runs", "report", "schedule_shape", "summary", "write_plan"]
