"""One-GPU training-step throughput of full-rank LLaMA vs CoLA (tokens/s, MFU, peak memory).

Each model runs in its own process (so each peak is its own) through the package's real training
step: `boostjax.training.step.build_step_fns` (jitted forward, backward, clipped AdamW update, fp32 master
weights, bf16 compute), compiled ahead of time, `--warmup` untimed steps, then `--steps` timed steps,
each ended by `block_until_ready`. Reports the median step time, tokens/s, MFU = model FLOPs per
token (`boostjax.models.flops.flops_per_token`, PaLM convention, no remat recompute counted) x
tokens/s / the device's dense bf16 peak (the `boostjax.runtime.hardware` profile matching the device
name, or `--peak-tflops`), and `device.memory_stats()["peak_bytes_in_use"]`. Tokens are random ids:
step time does not depend on the data.

    python -m experiments.gpu.gpu_step                      # 1B, full-rank vs CoLA, bf16, on the GPU
    python -m experiments.gpu.gpu_step --allow-cpu --preset tiny --steps 2 --warmup 1   # CPU smoke run
    python -m experiments.gpu.gpu_step --attention cudnn    # cuDNN flash attention (ModelConfig.attention)

BOOST reports CoLA 1.44x faster than full-rank at 1B on one A100 (its iteration times 0.85 s vs
0.59 s). Writes experiments/results/gpu_step.{json,md}. Without a GPU it exits with status 2 and a
one-line message, unless `--allow-cpu --preset tiny` (a smoke mode whose numbers mean nothing).
Each run also records `compiled.memory_analysis()` of the very executable it times (`compiled_memory`:
argument + output - alias + temp = `total_bytes`), beside the measured peak.

Importable pieces (experiments/gpu/gpu_suite.py uses them): `parser`, `measure`, `run_worker`,
`worker_cmd`, `peak_flops_for`, `attention_field`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from experiments import common

KINDS = ("llama", "cola")
NAMES = {"llama": "full-rank", "cola": "CoLA"}
PAPER_SPEEDUP = 0.85 / 0.59  # BOOST, 1B on one A100: full-rank / CoLA (BTP) iteration time


def peak_flops_for(device_kind: str) -> float | None:
    """Dense bf16 peak of a GPU from its JAX `device_kind` via the hardware profiles (None: unknown)."""
    from boostjax.runtime.hardware import get_profile

    k = device_kind.lower()
    for needle, name in (("h200", "h200"), ("h100", "h100"), ("h800", "h800"), ("3090", "3090")):
        if needle in k:
            return get_profile(name).bf16_flops
    if "a100" in k:
        return get_profile("a100-40gb" if "40gb" in k.replace(" ", "") else "a100-80gb").bf16_flops
    return None


def attention_field() -> bool:
    """Whether this boostjax's `ModelConfig` has the `attention` field (auto/xla/cudnn/chunked)."""
    import dataclasses

    from boostjax.config import ModelConfig

    return "attention" in {f.name for f in dataclasses.fields(ModelConfig)}


def measure(kind: str, args: argparse.Namespace) -> dict:
    """Compile and time the real training step for one model kind on this process's first device."""
    import jax
    import numpy as np

    from boostjax.config import Config, TrainConfig, preset
    from boostjax.training.checks import validate
    from boostjax.models.flops import flops_per_token, param_count
    from boostjax.offload.apply import compiled_memory
    from boostjax.training.step import build_step_fns
    from boostjax.models.llama import init_model

    dev = jax.devices()[0]
    overrides = {"kind": kind, "max_seq_len": max(args.seq, 1)}
    if args.vocab:
        overrides["vocab_size"] = args.vocab
    if args.layers:
        overrides["n_layers"] = args.layers
    has_attention = attention_field()
    if args.attention and has_attention:
        overrides["attention"] = args.attention
    model = preset(args.preset, **overrides)
    # without the field (an older boostjax) the step runs the materialising reference attention
    attention = getattr(model, "attention", None) if has_attention else "reference (no ModelConfig.attention)"
    cfg = validate(Config(model, TrainConfig(batch=args.batch, seq=args.seq, dtype="bfloat16", remat=args.remat,
                                             steps=args.warmup + args.steps + 1, warmup=0, out="unused")))
    graphdef, params = init_model(cfg)
    fns = build_step_fns(cfg, graphdef, params)
    state = fns.init(params)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.vocab_size, (args.batch, args.seq + 1), dtype=np.int32)
    batch = fns.put_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    t0 = time.perf_counter()
    step = fns.compile(state, batch)
    compile_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        state, m = step(state, batch)
    jax.block_until_ready((state, m) if args.warmup else state)
    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t0)
        losses.append(float(m["loss"]))
    step_s = statistics.median(times)
    tokens_per_step = args.batch * args.seq
    fpt = flops_per_token(model, args.seq)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops_for(dev.device_kind)
    stats = dev.memory_stats() or {}
    return {"kind": kind, "device": dev.device_kind, "platform": dev.platform, "params": param_count(model),
            "attention": attention, "attention_requested": args.attention or None,
            "compiled_memory": compiled_memory(step), "compile_s": compile_s, "step_s": step_s, "step_s_all": times, "tokens_per_s": tokens_per_step / step_s,
            "flops_per_token": fpt, "model_tflops_per_s": fpt * tokens_per_step / step_s / 1e12,
            "peak_bf16_tflops": peak / 1e12 if peak else None,
            "mfu": fpt * tokens_per_step / step_s / peak if peak else None,
            "peak_bytes_in_use": int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else None,
            "losses": losses}


def worker_cmd(kind: str, argv: list[str]) -> list[str]:
    """The command line of one measuring process (this script in worker mode)."""
    return [*common.python_m("gpu_step"), *argv, "--worker", kind]


def run_worker(cmd: list[str], env: dict[str, str], timeout: float | None = None, **tag) -> dict:
    """Run one worker process and read its result (`worker_result`); running past `timeout` seconds
    gives `status: timeout` (the process is killed)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=common.with_root(env), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**tag, "status": "timeout", "error": f"killed after the {timeout:.0f} s limit"}
    return worker_result(out.returncode, out.stdout, out.stderr, **tag)


def worker_result(returncode: int, stdout: str, stderr: str, **tag) -> dict:
    """A worker's result: the last stdout line that is a JSON object (optionally prefixed `RESULT `),
    with `tag` and `status` (default ok). A crash or a missing result gives `status: failed` with the
    last stderr line."""
    lines = [ln.removeprefix("RESULT ") for ln in stdout.splitlines()
             if ln.startswith("{") or ln.startswith("RESULT {")]
    if returncode or not lines:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        return {**tag, "status": "failed", "error": tail[:500]}
    rec = json.loads(lines[-1])
    return {**tag, **rec, "status": rec.get("status", "ok")}


def _child(kind: str, argv: list[str], env: dict[str, str]) -> dict:
    return run_worker(worker_cmd(kind, argv), env, kind=kind)


def run_row(r: dict) -> str:
    """One table row of a successful run (the columns of `markdown`'s table)."""
    mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "n/a"
    mem = f"{r['peak_bytes_in_use'] / 2**30:.2f}" if r["peak_bytes_in_use"] is not None else "n/a"
    compiled = r.get("compiled_memory", {}).get("total_bytes")
    cmem = f"{compiled / 2**30:.2f}" if compiled is not None else "n/a"
    return (f"| {NAMES[r['kind']]} | {r['device']} | {r.get('attention')} | {r['params'] / 1e6:.1f}M | "
            f"{r['step_s']:.4f} | {r['tokens_per_s']:.0f} | {r['model_tflops_per_s']:.2f} | {mfu} | {mem} | "
            f"{cmem} | {r['compile_s']:.1f} |")


def markdown(res: dict) -> str:
    a = res["args"]
    lines = ["# One-GPU training step: full-rank vs CoLA", "",
             f"Preset {a['preset']} (vocabulary {a['vocab'] or 'preset'}, layers {a['layers'] or 'preset'}), batch {a['batch']} x sequence {a['seq']}, "
             f"bf16 compute, fp32 master weights, AdamW, remat {a['remat']}; {a['warmup']} warm-up steps, median of "
             f"{a['steps']} timed steps. Command: `{res['command']}`", "",
             "| model | device | attention | params | step s | tokens/s | model TFLOP/s | MFU | peak memory GiB "
             "| compiled GiB | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        if r.get("status") != "ok":
            lines.append(f"| {NAMES[r['kind']]} | {r.get('status')}: {r.get('error', '')} | | | | | | | | | |")
            continue
        lines.append(run_row(r))
    if res.get("speedup"):
        lines += ["", f"CoLA / full-rank tokens/s: {res['speedup']:.2f}x (BOOST, 1B on one A100: {PAPER_SPEEDUP:.2f}x)."]
    if res["runs"] and res["runs"][0].get("platform") == "cpu":
        lines += ["", "SMOKE RUN ON CPU: these numbers say nothing about a GPU."]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """The command-line flags (also the settings `measure` reads)."""
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1b", help="model shapes (default: 1b)")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary size, 0 = the preset's (default: 32000)")
    ap.add_argument("--layers", type=int, default=0, help="transformer layers, 0 = the preset's (default: 0)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    ap.add_argument("--seq", type=int, default=1024, help="sequence length (default: 1024)")
    ap.add_argument("--remat", default="none", choices=("none", "full", "lowrank"), help="remat policy (default: none)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling (default: 3)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="device dense bf16 peak in TFLOP/s (default: from the hardware profile of the device name)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of llama,cola")
    ap.add_argument("--allow-cpu", action="store_true", help="smoke mode on CPU (only with --preset tiny)")
    common.add_out(ap, "gpu_step", from_json=False)
    ap.add_argument("--attention", default="", choices=("", "auto", "xla", "cudnn", "chunked"),
                    help="ModelConfig.attention (default: the config's own default)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser()
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.batch < 1 or args.seq < 1 or args.steps < 1 or args.warmup < 0 or args.layers < 0 or args.vocab < 0:
        ap.error("--batch, --seq and --steps must be >= 1; --warmup, --layers and --vocab >= 0")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds: use a subset of {','.join(KINDS)}")
    if args.worker:
        print(json.dumps(measure(args.worker, args)))
        return 0

    child_env = dict(os.environ)  # the workers allocate as the user configured; this process only looks
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax

    platform = jax.devices()[0].platform
    if platform != "gpu" and not (args.allow_cpu and args.preset == "tiny"):
        print(f"gpu_step: no GPU (JAX's default device is {platform}); this measures GPU throughput and will "
              "not report CPU numbers as such. fix: run on a CUDA GPU (pip install 'jax[cuda12]'), or smoke-test "
              "with --allow-cpu --preset tiny", file=sys.stderr)
        return 2
    if platform == "gpu" and args.peak_tflops <= 0 and peak_flops_for(jax.devices()[0].device_kind) is None:
        print(f"gpu_step: no bf16 peak known for {jax.devices()[0].device_kind!r}; fix: pass --peak-tflops",
              file=sys.stderr)
        return 2
    runs = [_child(k, argv, child_env) for k in kinds]
    ok = {r["kind"]: r for r in runs if r.get("status") == "ok"}
    speedup = ok["cola"]["tokens_per_s"] / ok["llama"]["tokens_per_s"] if len(ok) == 2 else None
    res = {"args": vars(args), "command": common.command_line("gpu_step", argv), "runs": runs,
           "speedup": speedup, "paper_speedup_1b_a100": PAPER_SPEEDUP}
    common.write(args.out, "gpu_step", data=res, md=lambda: markdown(res), started=t0)
    return 0 if len(ok) == len(kinds) else 1


if __name__ == "__main__":
    sys.exit(main())
