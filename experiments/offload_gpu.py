"""On a real CUDA GPU: train with the CP-SAT plan and with each baseline policy under a device memory
cap, and record tokens/s and peak device memory (`device.memory_stats()["peak_bytes_in_use"]`).

Every policy (plan, no-offload, full-remat, megatrain) is a `Plan` applied by the same code path
as `boostjax train --offload-plan` (`boostjax.offload.apply`): per-layer remat/offload policies,
recompute segments, parameters / optimizer states in pinned host memory. Each policy runs in its own
process, so its peak is its own and the memory cap (`XLA_PYTHON_CLIENT_MEM_FRACTION` = cap / total)
is enforced by the allocator; a policy that does not fit reports `oom`.

    python experiments/offload_gpu.py --preset 1b --model cola --batch 8 --seq 1024 --memory-cap 20

Writes experiments/results/offload_gpu.json and offload_gpu.md. Without a GPU it exits with status 2
and a one-line message (nothing is measured on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
POLICIES = ("plan", "no-offload", "full-remat", "megatrain")
GB = 1e9


def _probe() -> dict:
    """In a child process: is there a CUDA device, and how many bytes can the allocator use."""
    code = ("import json, jax\n"
            "try:\n    d = jax.devices('gpu')[0]\nexcept RuntimeError as e:\n"
            "    print(json.dumps({'gpu': False, 'why': str(e).splitlines()[0]})); raise SystemExit\n"
            "s = d.memory_stats() or {}\n"
            "print(json.dumps({'gpu': True, 'kind': d.device_kind, 'bytes_limit': int(s.get('bytes_limit', 0))}))\n")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_MEM_FRACTION="0.95")
    env.pop("JAX_PLATFORMS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"gpu": False, "why": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def _worker(args: argparse.Namespace) -> dict:
    """One policy in this process (the parent set the memory fraction before JAX started)."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from boostjax.config import Config, TrainConfig, preset  # noqa: PLC0415
    from boostjax.offload import apply  # noqa: PLC0415
    from boostjax.offload.hardware import get_profile, measure  # noqa: PLC0415
    from boostjax.offload.planner import PlanInfeasible, baseline_plan, solve  # noqa: PLC0415
    from boostjax.step import build_step_fns  # noqa: PLC0415
    from boostjax.train import init_model  # noqa: PLC0415

    dev = jax.devices()[0]
    if dev.platform != "gpu":
        raise SystemExit(f"offload_gpu: the worker found {dev.platform}, not a GPU")
    model = preset(args.preset, **({"kind": args.model} if args.model else {}))
    hw = measure(device=dev) if args.hardware == "measure" else get_profile(args.hardware)
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = os.path.join(tmp, "plan.json")
        cfg = Config(model, TrainConfig(batch=args.batch, seq=args.seq, dtype="bfloat16", optimizer=args.optimizer,
                                        clip=args.clip, steps=args.steps + args.warmup, out=tmp,
                                        offload_plan=plan_path))
        inst = apply.instance_for(cfg, hw, budget_bytes=args.memory_cap * GB * args.budget_fraction)
        rec: dict = {"policy": args.policy, "device": dev.device_kind, "instance": inst.name}
        try:
            plan = solve(inst, time_limit_s=args.time_limit) if args.policy == "plan" else baseline_plan(inst, args.policy)
        except PlanInfeasible as e:
            return {**rec, "status": "infeasible", "min_budget_gb": e.min_budget_bytes / GB}
        rec.update(predicted_step_s=plan.predicted_step_s, predicted_peak_bytes=plan.predicted_peak_bytes,
                   plan_status=plan.status, schedule=apply.describe(plan))
        with open(plan_path, "w") as f:
            f.write(plan.to_json())
        with jax.default_device(jax.devices("cpu")[0]):  # initialise on the host; the plan places it
            graphdef, params = init_model(cfg)
        try:
            fns = build_step_fns(cfg, graphdef, params)
            params, opt_state = fns.init(params)
            rng = np.random.default_rng(0)
            batch = lambda: fns.put_batch({k: rng.integers(0, model.vocab_size, (args.batch, args.seq),  # noqa: E731
                                                           dtype=np.int32) for k in ("inputs", "targets")})
            t0 = time.perf_counter()
            step = fns.compile(params, opt_state, batch())
            rec["compile_s"] = time.perf_counter() - t0
            for _ in range(args.warmup):
                params, opt_state, m = step(params, opt_state, batch())
            jax.block_until_ready(m)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                params, opt_state, m = step(params, opt_state, batch())
            jax.block_until_ready(m)
            dt = (time.perf_counter() - t0) / args.steps
        except Exception as e:  # noqa: BLE001 (an allocator failure is a result: the policy does not fit)
            msg = str(e)
            if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower():
                return {**rec, "status": "oom", "error": msg.splitlines()[0][:300]}
            raise
        stats = dev.memory_stats() or {}
        rec.update(status="ok", step_s=dt, tokens_per_s=args.batch * args.seq / dt, loss=float(m["loss"]),
                   peak_bytes_in_use=int(stats.get("peak_bytes_in_use", 0)),
                   bytes_limit=int(stats.get("bytes_limit", 0)))
        return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--model", default=None, help="model kind (default: the preset's)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--memory-cap", type=float, default=20.0, help="device memory cap in GB")
    ap.add_argument("--budget-fraction", type=float, default=0.85,
                    help="planner budget = cap x this (room for what the cost model does not see)")
    ap.add_argument("--hardware", default="measure", help="profile name, or 'measure' (time this GPU's link)")
    ap.add_argument("--optimizer", default="adam8bit", choices=("adam8bit", "adamw"))
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--policy", default=None, help=argparse.SUPPRESS)  # worker mode
    args = ap.parse_args(argv)
    if args.policy:
        print("RESULT " + json.dumps(_worker(args)), flush=True)
        return 0

    probe = _probe()
    if not probe.get("gpu"):
        print(f"offload_gpu: no CUDA GPU visible to JAX ({probe.get('why', 'unknown')}); this script measures "
              "tokens/s and peak memory on a real GPU only — run it where `jax.devices('gpu')` works "
              "(jax[cuda12]); nothing was measured", file=sys.stderr)
        return 2
    total = probe["bytes_limit"] / 0.95
    fraction = min(0.95, args.memory_cap * GB / total)
    print(f"{probe['kind']}: {total / GB:.1f} GB, cap {args.memory_cap} GB -> XLA_PYTHON_CLIENT_MEM_FRACTION="
          f"{fraction:.4f}", flush=True)
    runs = []
    for policy in args.policies.split(","):
        env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{fraction:.4f}", XLA_PYTHON_CLIENT_PREALLOCATE="false")
        env.pop("JAX_PLATFORMS", None)
        cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
               "--policy", policy]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [ln[7:] for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        rec = json.loads(lines[-1]) if lines else {"policy": policy, "status": "error",
                                                     "error": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
        runs.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "schedule"}), flush=True)
    os.makedirs(RESULTS, exist_ok=True)
    res = {"setup": vars(args) | {"device": probe["kind"], "total_bytes": total}, "runs": runs}
    with open(os.path.join(RESULTS, "offload_gpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# Offload plan vs baselines on {probe['kind']} (measured)", "",
             f"{args.preset} {args.model or ''} batch {args.batch} x seq {args.seq}, bf16, {args.optimizer}, "
             f"cap {args.memory_cap} GB", "",
             "| policy | status | tokens/s | step s | peak GB (memory_stats) | predicted step s | predicted peak GB |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['policy']} | {r['status']} | {r.get('tokens_per_s', float('nan')):.0f} | "
                     f"{r.get('step_s', float('nan')):.4f} | {r.get('peak_bytes_in_use', 0) / GB:.2f} | "
                     f"{r.get('predicted_step_s', float('nan')):.4f} | {r.get('predicted_peak_bytes', 0) / GB:.2f} |")
    with open(os.path.join(RESULTS, "offload_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
