"""On a real CUDA GPU: train with the CP-SAT plan and with each baseline policy under a device memory
cap, and record tokens/s and peak device memory (`device.memory_stats()["peak_bytes_in_use"]`).

Every policy (plan, no-offload, full-remat, megatrain) is a `Plan` applied by the same code path
as `boostjax train --offload-plan` (`boostjax.offload.apply`): per-layer remat/offload policies,
recompute segments, parameters / optimizer states in pinned host memory. Each policy runs in its own
process, so its peak is its own and the memory cap (`XLA_PYTHON_CLIENT_MEM_FRACTION` = cap / total)
is enforced by the allocator; a policy that does not fit reports `oom`.

    python -m experiments.offload.offload_gpu --preset 1b --model cola --batch 8 --seq 1024 --memory-cap 20

Writes experiments/results/offload_gpu.json and offload_gpu.md (or `--out`). Without a GPU it exits
with status 2 and a one-line message (nothing is measured on CPU), unless `--allow-cpu --preset tiny`
(a smoke run of the code path: no memory cap, no host offload of activations, numbers mean nothing).

Importable pieces (experiments/gpu/gpu_suite.py uses them): `parser`, `probe`, `cap_fraction`,
`policy_env`, `worker_cmd`, `worker`, `markdown`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from experiments import common

POLICIES = ("plan", "no-offload", "full-remat", "megatrain")
GB = 1e9


def probe() -> dict:
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


def cap_fraction(probe_rec: dict, cap_gb: float) -> tuple[float, float]:
    """(total device bytes, XLA_PYTHON_CLIENT_MEM_FRACTION for a cap of `cap_gb` GB) from `probe()`."""
    total = probe_rec["bytes_limit"] / 0.95
    return total, min(0.95, cap_gb * GB / total)


def policy_env(fraction: float | None) -> dict[str, str]:
    """The environment of one policy's process: the allocator capped at `fraction` (None: no cap)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"
        env.pop("JAX_PLATFORMS", None)
    return env


def worker_cmd(argv: list[str], policy: str) -> list[str]:
    """The command line of one policy's process (this script in worker mode)."""
    return [*common.python_m("offload_gpu"), *argv, "--policy", policy]


def worker(args: argparse.Namespace) -> dict:
    """One policy in this process (the parent set the memory fraction before JAX started)."""
    import jax
    import numpy as np

    from boostjax.config import Config, TrainConfig, preset
    from boostjax.offload import apply
    from boostjax.runtime.hardware import get_profile, measure, profile_for_device
    from boostjax.models.attention import memory_kind
    from boostjax.offload.planner import PlanInfeasible, baseline_plan, solve
    from boostjax.training.step import build_step_fns
    from boostjax.models.llama import init_model

    dev = jax.devices()[0]
    if dev.platform != "gpu" and not (args.allow_cpu and args.preset == "tiny"):
        raise SystemExit(f"offload_gpu: the worker found {dev.platform}, not a GPU")
    overrides = {"kind": args.model} if args.model else {}
    if args.vocab:
        overrides["vocab_size"] = args.vocab
    if args.layers:
        overrides["n_layers"] = args.layers
    if args.attention:
        overrides["attention"] = args.attention  # ModelConfig.attention (the caller checked it exists)
    model = preset(args.preset, **overrides)
    hw = measure(device=dev) if args.hardware == "measure" else get_profile(args.hardware)
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = os.path.join(tmp, "plan.json")
        cfg = Config(model, TrainConfig(batch=args.batch, seq=args.seq, dtype="bfloat16", optimizer=args.optimizer,
                                        clip=args.clip, steps=args.steps + args.warmup, out=tmp,
                                        offload_plan=plan_path))
        inst = apply.instance_for(cfg, hw, budget_bytes=args.memory_cap * GB * args.budget_fraction,
                                  attention=memory_kind(model, args.seq, "bfloat16"))  # what this run keeps
        rec: dict = {"policy": args.policy, "device": dev.device_kind, "platform": dev.platform, "instance": inst.name}
        try:
            plan = solve(inst, time_limit_s=args.time_limit) if args.policy == "plan" else baseline_plan(inst, args.policy)
        except PlanInfeasible as e:
            return {**rec, "status": "infeasible", "min_budget_gb": e.min_budget_bytes / GB}
        prof = profile_for_device(dev.device_kind) if dev.platform == "gpu" else None
        rec.update(predicted_step_s=plan.predicted_step_s, predicted_peak_bytes=plan.predicted_peak_bytes,
                   plan_status=plan.status, schedule=apply.describe(plan),
                   # what the printed line keeps of the schedule: layers with anything on the host, and the
                   # GPU scheduler limit `Offloaded.compiler_options` compiles such a plan with (unless XLA_FLAGS)
                   host_layers=plan.host_layers,
                   scheduler_options=apply.gpu_scheduler_options(plan, prof.device_bytes) if prof else None)
        with open(plan_path, "w") as f:
            f.write(plan.to_json())
        with jax.default_device(jax.devices("cpu")[0]):  # initialise on the host; the plan places it
            graphdef, params = init_model(cfg)
        try:
            fns = build_step_fns(cfg, graphdef, params)
            state = fns.init(params)
            rng = np.random.default_rng(0)
            batch = lambda: fns.put_batch({k: rng.integers(0, model.vocab_size, (args.batch, args.seq),  # noqa: E731
                                                           dtype=np.int32) for k in ("inputs", "targets")})
            t0 = time.perf_counter()
            step = fns.compile(state, batch())
            rec["compile_s"] = time.perf_counter() - t0
            for _ in range(args.warmup):
                state, m = step(state, batch())
            jax.block_until_ready(m)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, m = step(state, batch())
            jax.block_until_ready(m)
            dt = (time.perf_counter() - t0) / args.steps
        except Exception as e:
            msg = str(e)
            if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower():
                return {**rec, "status": "oom", "error": msg.splitlines()[0][:300]}
            raise
        stats = dev.memory_stats() or {}
        rec.update(status="ok", step_s=dt, tokens_per_s=args.batch * args.seq / dt, loss=float(m["loss"]),
                   compiled_total_bytes=_compiled_total(step), peak_bytes_in_use=int(stats.get("peak_bytes_in_use", 0)),
                   bytes_limit=int(stats.get("bytes_limit", 0)))
        return rec


def _compiled_total(step) -> int | None:
    from boostjax.offload.apply import compiled_memory

    try:
        return compiled_memory(step)["total_bytes"]
    except Exception:
        return None


def markdown(res: dict) -> str:
    s = res["setup"]
    lines = [f"# Offload plan vs baselines on {s['device']} (measured)", "",
             f"{s['preset']} {s['model'] or ''} batch {s['batch']} x seq {s['seq']}, bf16, {s['optimizer']}, "
             f"cap {s['memory_cap']} GB", "", *table(res["runs"])]
    return "\n".join(lines) + "\n"


def table(runs: list[dict]) -> list[str]:
    """The markdown table of the policies' records."""
    nan = float("nan")
    lines = ["| policy | status | tokens/s | step s | peak GB (memory_stats) | predicted step s | predicted peak GB |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['policy']} | {r['status']} | {r.get('tokens_per_s', nan):.0f} | "
                     f"{r.get('step_s', nan):.4f} | {(r.get('peak_bytes_in_use') or 0) / GB:.2f} | "
                     f"{r.get('predicted_step_s', nan):.4f} | {(r.get('predicted_peak_bytes') or 0) / GB:.2f} |")
    return lines


def parser() -> argparse.ArgumentParser:
    """The command-line flags (also the settings `worker` reads)."""
    ap = common.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="1b", help="model preset whose shapes are trained (default: 1b)")
    ap.add_argument("--model", default=None, help="model kind (default: the preset's)")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size, 0 = the preset's (default: 0)")
    ap.add_argument("--layers", type=int, default=0, help="transformer layers, 0 = the preset's (default: 0)")
    ap.add_argument("--attention", default="", choices=("", "auto", "xla", "cudnn", "chunked"),
                    help="ModelConfig.attention (default: the config's own default)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default: 1024)")
    ap.add_argument("--memory-cap", type=float, default=20.0, help="device memory cap in GB")
    ap.add_argument("--budget-fraction", type=float, default=0.85,
                    help="planner budget = cap x this (room for what the cost model does not see)")
    ap.add_argument("--hardware", default="measure", help="profile name, or 'measure' (time this GPU's link)")
    ap.add_argument("--optimizer", default="adam8bit", choices=("adam8bit", "adamw"), help="optimizer (default: adam8bit)")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping norm (default: 1.0)")
    ap.add_argument("--steps", type=int, default=10, help="timed training steps per policy (default: 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per policy first (default: 2)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT time limit of the plan, seconds (default: 60)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated policies to run, of {', '.join(POLICIES)} (default: all)")
    ap.add_argument("--allow-cpu", action="store_true", help="smoke mode on CPU (only with --preset tiny)")
    common.add_out(ap, "offload_gpu", from_json=False)
    ap.add_argument("--policy", default=None, help=argparse.SUPPRESS)  # worker mode
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    t0 = time.perf_counter()
    if args.policy:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0

    smoke = args.allow_cpu and args.preset == "tiny"
    probe_rec = probe()
    if not probe_rec.get("gpu") and smoke:
        probe_rec = {"gpu": False, "kind": "cpu (smoke run, no memory cap)", "bytes_limit": 0}
    elif not probe_rec.get("gpu"):
        print(f"offload_gpu: no CUDA GPU visible to JAX ({probe_rec.get('why', 'unknown')}); this script measures "
              "tokens/s and peak memory on a real GPU only — run it where `jax.devices('gpu')` works "
              "(jax[cuda12]); nothing was measured", file=sys.stderr)
        return 2
    total, fraction = cap_fraction(probe_rec, args.memory_cap) if probe_rec["gpu"] else (0.0, None)
    print(f"{probe_rec['kind']}: {total / GB:.1f} GB, cap {args.memory_cap} GB -> XLA_PYTHON_CLIENT_MEM_FRACTION="
          f"{fraction}", flush=True)
    runs = []
    argv = list(sys.argv[1:] if argv is None else argv)
    for policy in args.policies.split(","):
        cmd = worker_cmd(argv, policy)
        out = subprocess.run(cmd, capture_output=True, text=True, env=common.with_root(policy_env(fraction)))
        lines = [ln[7:] for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        rec = json.loads(lines[-1]) if lines else {"policy": policy, "status": "error",
                                                     "error": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
        runs.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "schedule"}), flush=True)
    res = {"setup": vars(args) | {"device": probe_rec["kind"], "total_bytes": total}, "runs": runs}
    common.write(args.out, "offload_gpu", data=res, md=lambda: markdown(res),
                     command=common.command_line("offload_gpu", argv), started=t0, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
