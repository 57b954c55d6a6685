"""`boostjax plan`: build the cost model for a model and hardware, solve the offload plan with CP-SAT,
and compare it with the baseline policies (no offload, full remat, MegaTrain-style streaming).

    boostjax plan --preset 7b --model llama --hardware H800-80GB --memory-cap 70 --batch 8 --seq 2048
    boostjax plan --instance lazytrain-27b --json
    boostjax plan --preset tiny --batch 4 --seq 32 --dtype float32 --optimizer adamw --memory-cap 0.01 --out plan.json
    boostjax train --preset tiny --batch 4 --seq 32 --offload-plan plan.json
    boostjax plan --preset 7b --strategy btp --mesh data=2,stage=2,model=2 --batch 16 --out plan.json

`--strategy` and `--mesh` plan ONE device's share of a mesh, as `boostjax train` with the same flags
lays it out: batch / data rows, one stage's n_layers / stage layers (the same plan serves every
stage; with stages, all layers share one parameter placement) and the device's shard of every layer
and activation under the TP strategy (BTP: the d/TP residual stream and replicated r-dim latents;
vanilla TP: r/TP latents beside replicated [b, t, d] residuals; fullrank-tp: heads and d_ff / TP).

`--out` writes the plan (`Plan.to_json`) that `boostjax train --offload-plan` applies; the file records
the model shapes, batch, seq, dtype, optimizer, strategy and mesh it was planned for, and train refuses a run that
differs. `--out` never replaces a file that is not a boostjax plan. A budget no plan fits exits with
status 2 and one line giving the smallest budget that works.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import stat
import sys
from dataclasses import replace
from typing import Any

from boostjax.config import MODEL_KINDS, check_batch_seq, PRESETS, ConfigError, as_mesh, preset, validate_model
from boostjax.runtime.hardware import PROFILES, get_profile
from boostjax.offload.costmodel import ATTENTION, STRATEGY_DIMS, PlanInstance, build_instance, lazytrain_27b
from boostjax.offload.planner import BASELINES, BOUNDARY_STATES, Plan, PlanInfeasible, baseline_plan, solve
from boostjax.offload.planfile import is_plan_file
from boostjax.sharding.rules import check_mesh_for

GB = 1e9
INSTANCES = ("lazytrain-27b",)
MAX_MEMORY_GB = 1e6  # a petabyte: anything larger is a typo (and 1e300 GB overflows to inf bytes)
MAX_TIME_LIMIT_S = 7 * 24 * 3600.0
MAX_PLAN_LAYERS = 1024  # the CP-SAT model grows with L^2 (512 layers: 11 s and 0.6 GB to build)
_SHAPE_FLAGS = ("n_layers", "d_model", "d_ff", "n_heads", "n_kv_heads", "rank", "vocab_size")


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `plan` subcommand to a `boostjax` argparse subparsers object."""
    p = subparsers.add_parser("plan", help="solve the offload plan (keep / offload / recompute) for a model and GPU")
    p.add_argument("--preset", default="tiny", help=f"model shapes: one of {', '.join(PRESETS)} (default: tiny)")
    p.add_argument("--model", default=None, choices=MODEL_KINDS, help="model kind (default: the preset's, cola)")
    for name in _SHAPE_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None,
                       help=f"override the preset's {name}")
    p.add_argument("--instance", default=None, choices=INSTANCES,
                   help="a fixed published instance instead of a model (lazytrain-27b: 64 layers, 0.703 GiB "
                        "boundaries, 21.55 GB activation budget, H800)")
    p.add_argument("--hardware", default="H800-80GB",
                   help=f"hardware profile: one of {', '.join(PROFILES)} or an alias (h800, a100, 3090) "
                        "(default: H800-80GB)")
    p.add_argument("--memory-cap", type=float, default=None, metavar="GB",
                   help="device memory budget in GB (1e9 bytes) (default: 90%% of the profile's memory)")
    p.add_argument("--batch", type=int, default=8, help="micro-batch (default: 8)")
    p.add_argument("--seq", type=int, default=1024, help="sequence length (default: 1024)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="activation/compute dtype (default: bfloat16; float32 for boostjax train's default)")
    p.add_argument("--optimizer", default="adam8bit", choices=("adam8bit", "adamw"),
                   help="optimizer-state sizes: hybrid 8-bit Adam or fp32 Adam (default: adam8bit)")
    p.add_argument("--attention", default="materialized", choices=ATTENTION,
                   help="attention memory in the cost model: materialized (boostjax's model keeps the fp32 "
                        "softmax probabilities) or flash (a fused kernel keeping only the log-sum-exp) "
                        "(default: materialized)")
    p.add_argument("--strategy", default="none",
                   help=f"TP strategy the run uses: one of {', '.join(STRATEGY_DIMS)} (default: none); the plan "
                        "sizes one device's shard")
    p.add_argument("--mesh", default="", metavar="data=D,stage=P,model=T",
                   help="the run's device mesh (default: one device); the plan covers one device: batch/D rows, "
                        "n_layers/P layers, a 1/T shard by --strategy")
    p.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT time limit in seconds (default: 60)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    p.add_argument("--out", default=None, metavar="PLAN_JSON", help="write the plan for boostjax train --offload-plan")
    p.set_defaults(func=_cmd_plan)
    return p


def _number(args: argparse.Namespace, name: str, low: float, high: float, example: str) -> float:
    """A finite float flag in (low, high]; NaN and inf are refused (NaN passes every comparison test)."""
    v = getattr(args, name)
    flag = "--" + name.replace("_", "-")
    if not (math.isfinite(v) and low < v <= high):
        raise ConfigError(f"plan.{name}: must be a finite number in ({low:g}, {high:g}], got {v}; "
                          f"fix: pass e.g. {flag} {example}")
    return v


def instance_from_args(args: argparse.Namespace) -> PlanInstance:
    """The plan instance the flags describe (raises ConfigError on bad shapes or numbers)."""
    cap = None
    if args.memory_cap is not None:
        cap = _number(args, "memory_cap", 0.0, MAX_MEMORY_GB, "70") * GB
    _number(args, "time_limit", 0.0, MAX_TIME_LIMIT_S, "60")
    try:
        hw = get_profile(args.hardware)
    except ValueError:
        raise ConfigError(f"plan.hardware: unknown profile {args.hardware!r}; fix: pass one of {', '.join(PROFILES)} "
                          "(or an alias: h800, h100, h200, a100, a100-40gb, 3090)") from None
    if args.instance == "lazytrain-27b":
        if args.strategy != "none" or args.mesh:
            raise ConfigError("plan.instance: lazytrain-27b is a fixed one-device instance; fix: drop --strategy and "
                              "--mesh, or plan a model (--preset ...) instead of --instance")
        inst = lazytrain_27b(hw)
        return inst if cap is None else inst.with_budget(cap)
    check_batch_seq(args.batch, args.seq, "plan")
    if args.n_layers is not None and args.n_layers > MAX_PLAN_LAYERS:
        raise ConfigError(f"plan.n_layers: {args.n_layers} layers exceed the planner's {MAX_PLAN_LAYERS}; "
                          f"fix: pass --n-layers <= {MAX_PLAN_LAYERS}")
    over = {k: getattr(args, k) for k in _SHAPE_FLAGS if getattr(args, k) is not None}
    if args.model:
        over["kind"] = args.model
    model = preset(args.preset, **over)
    model = replace(model, max_seq_len=max(model.max_seq_len, args.seq))
    validate_model(model)
    check_mesh_for(model, args.strategy, args.mesh, args.batch, args.seq, "plan")
    mesh = as_mesh(args.mesh, "plan.mesh")
    return build_instance(model, args.batch, args.seq, hw, budget_bytes=cap,
                          dtype_bytes=4 if args.dtype == "float32" else 2, eight_bit=args.optimizer == "adam8bit",
                          attention=args.attention, strategy=args.strategy, mesh=mesh)


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


def _cmd_plan(args: argparse.Namespace) -> int:
    inst = instance_from_args(args)
    out = check_out(args.out) if args.out else None  # before the solve: a bad --out costs nothing
    baselines = {n: baseline_plan(inst, n) for n in BASELINES}
    try:
        plan = solve(inst, time_limit_s=args.time_limit)
    except PlanInfeasible as e:
        need = e.min_budget_bytes
        raise ConfigError(f"plan.memory_cap: no plan fits {inst.budget_bytes / GB:.6g} GB for {inst.name}; "
                          f"the smallest budget that works is {need / GB:.6g} GB; "
                          f"fix: pass --memory-cap {math.ceil(need / GB * 1e4) / 1e4:g} or more") from None
    rep = report(inst, plan, baselines)
    if out is not None:
        write_plan(plan, out)
        rep["out"] = args.out
    print(json.dumps(rep, indent=1) if args.json else summary(rep))
    if args.out and not args.json:
        print(f"plan written to {args.out} (apply it with boostjax train --offload-plan {args.out})", file=sys.stderr)
    return 0


__all__ = ["INSTANCES", "check_out", "instance_from_args", "write_plan", "layer_runs", "register", "report", "schedule_shape", "summary"]
