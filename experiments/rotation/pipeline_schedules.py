"""GPipe vs 1F1B: per-device activation memory of the compiled pipelined gradient, and the bubble.

Compiles `jax.value_and_grad` of the pipelined loss (abstract inputs: ShapeDtypeStructs with the
stage shardings, nothing allocated) for a mid-size model on P = 4 simulated CPU devices, micro-batch
size 1, M micro-batches per step, for both schedules, and reads `compiled.memory_analysis()`: the
temp bytes per device (activations, residuals, gradient accumulators; arguments = stage weights and
the batch are separate). GPipe's autodiff keeps the residuals of all `M + P - 1` ticks; 1F1B a ring
of `2P - 1` micro-batches, so its temp should stay flat in M. Writes

  experiments/results/pipeline_schedules.json   every measurement
  experiments/results/pipeline_schedules.md     the table
  experiments/results/pipeline_schedules.png    temp GiB per device vs M

Run: `python -m experiments.rotation.pipeline_schedules` (a few minutes on 2 CPU cores; `--micro 4 8` for fewer
points; `--from-json experiments/results/pipeline_schedules.json` re-renders without compiling; `--speed`
adds the time per value-and-grad of both schedules on a small model).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from boostjax.runtime.devices import simulate_devices

from experiments import common
from experiments.common import log

STAGES = 4
simulate_devices(STAGES)  # before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from boostjax.config import Config, ModelConfig, TrainConfig  # noqa: E402
from boostjax.training.checks import validate  # noqa: E402
from boostjax.models.llama import LLaMA  # noqa: E402
from boostjax.placement import choose  # noqa: E402
from boostjax.sharding.pipeline import pipeline_info  # noqa: E402
from boostjax.runtime.profiles import GiB as GIB  # noqa: E402

MODEL = ModelConfig(kind="cola", vocab_size=32000, d_model=1024, n_layers=8, n_heads=16, d_ff=2736, rank=256,
                    max_seq_len=1024)
SEQ, DTYPE, REMAT = 1024, "bfloat16", "none"
MICRO = (4, 8, 16, 32)
SCHEDULES = ("gpipe", "1f1b")
FAST_CPU = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}  # codegen only


def measure_one(schedule: str, micro: int) -> dict:
    """Compile the pipelined value-and-grad for one schedule and M; per-device memory and bubble."""
    t = TrainConfig(strategy="none", mesh=f"stage={STAGES}", batch=micro, seq=SEQ, microbatches=micro,
                    dtype=DTYPE, remat=REMAT, pipeline_schedule=schedule)
    cfg = validate(Config(MODEL, t))
    graphdef, params_like = nnx.split(nnx.eval_shape(lambda: LLaMA(MODEL, rngs=nnx.Rngs(0))))
    params_like = params_like.to_pure_dict()
    plan = choose(cfg, graphdef, params_like)
    state_like = jax.eval_shape(plan.to_state, params_like)
    shardings = plan.place("params", plan.param_specs(state_like), state_like)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state_like, shardings)
    batch = {k: jax.ShapeDtypeStruct((t.batch, SEQ), jnp.int32, sharding=plan.batch_sharding)
             for k in ("inputs", "targets")}
    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(plan.loss_fn)).lower(params, batch).compile(FAST_CPU)
    ma = compiled.memory_analysis()
    info = pipeline_info(t)
    return {"schedule": schedule, "microbatches": micro, "stages": STAGES, "microbatch_size": 1,
            "temp_bytes": int(ma.temp_size_in_bytes), "argument_bytes": int(ma.argument_size_in_bytes),
            "output_bytes": int(ma.output_size_in_bytes), "bubble_fraction": info["bubble_fraction"],
            "activation_slots": info["activation_slots"], "compile_s": round(time.perf_counter() - t0, 1)}


SPEED_MODEL = ModelConfig(kind="cola", vocab_size=1024, d_model=256, n_layers=4, n_heads=4, d_ff=688, rank=64)
SPEED_SEQ, SPEED_MICRO, SPEED_ROUNDS = 128, 16, 5


def measure_speed() -> dict:
    """Seconds per pipelined value-and-grad of a small fp32 model (P = 4 simulated CPU devices on the
    host's cores, M = 16): medians of interleaved rounds, run on real (random) inputs."""
    import numpy as np

    from boostjax.models.llama import init_model

    calls = {}
    for schedule in SCHEDULES:
        t = TrainConfig(mesh=f"stage={STAGES}", batch=SPEED_MICRO, seq=SPEED_SEQ, microbatches=SPEED_MICRO,
                        pipeline_schedule=schedule)
        cfg = validate(Config(SPEED_MODEL, t))
        graphdef, params = init_model(cfg)
        plan = choose(cfg, graphdef, params)
        rng = np.random.default_rng(0)
        batch = jax.device_put({k: rng.integers(0, SPEED_MODEL.vocab_size, (t.batch, t.seq)).astype(np.int32)
                                for k in ("inputs", "targets")}, plan.batch_sharding)
        like = jax.eval_shape(plan.to_state, params)
        placed = jax.device_put(plan.to_state(params), plan.place("params", plan.param_specs(like), like))
        fn = jax.jit(jax.value_and_grad(plan.loss_fn)).lower(placed, batch).compile()
        jax.block_until_ready(fn(placed, batch))  # warm-up
        calls[schedule] = (fn, placed, batch)
    times: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    for _ in range(SPEED_ROUNDS):
        for schedule, (fn, placed, batch) in calls.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(placed, batch))
            times[schedule].append(time.perf_counter() - t0)
    med = {s: float(np.median(v)) for s, v in times.items()}
    log(f"speed: {med}; 1F1B / GPipe {med['1f1b'] / med['gpipe']:.3f}")
    return {"model": {k: getattr(SPEED_MODEL, k) for k in ("kind", "vocab_size", "d_model", "n_layers", "n_heads",
                                                             "d_ff", "rank")},
            "seq": SPEED_SEQ, "microbatches": SPEED_MICRO, "stages": STAGES, "dtype": "float32",
            "rounds": SPEED_ROUNDS, "seconds": times, "median_s": med, "ratio_1f1b_over_gpipe": med["1f1b"] / med["gpipe"]}


def measure(micros: list[int]) -> dict:
    runs = []
    for m in micros:
        for schedule in SCHEDULES:
            r = measure_one(schedule, m)
            runs.append(r)
            log(f"{schedule:<5} M={m:<3} temp {r['temp_bytes'] / GIB:7.2f} GiB/device, "
                f"bubble {r['bubble_fraction']:.3f}, slots {r['activation_slots']} ({r['compile_s']} s)")
    setup = {"model": {k: getattr(MODEL, k) for k in ("kind", "vocab_size", "d_model", "n_layers", "n_heads",
                                                        "d_ff", "rank")},
             "seq": SEQ, "dtype": DTYPE, "remat": REMAT, "stages": STAGES, "microbatch_size": 1,
             "mesh": f"stage={STAGES}", "backend": jax.default_backend(),
             "compiled": "jax.value_and_grad(pipelined loss), abstract inputs; memory_analysis() per device"}
    return {"setup": setup, "runs": runs}


def markdown(data: dict) -> str:
    s = data["setup"]
    m = s["model"]
    by = {(r["schedule"], r["microbatches"]): r for r in data["runs"]}
    micros = sorted({r["microbatches"] for r in data["runs"]})
    lines = [
        "# Pipeline schedules: GPipe vs 1F1B",
        "",
        f"{m['kind']} d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} heads, d_ff {m['d_ff']}, "
        f"rank {m['rank']}, vocab {m['vocab_size']}; seq {s['seq']}, {s['dtype']}, remat {s['remat']}; "
        f"P = {s['stages']} stages (`--mesh {s['mesh']}`), micro-batch size 1, M micro-batches per step. "
        f"Per device: `memory_analysis()` of the compiled `jax.value_and_grad` of the pipelined loss "
        f"({s['backend']} backend, abstract inputs). Temp = everything but the arguments (stage weights, "
        "batch) and outputs (loss, gradients).",
        "",
        "| M | GPipe temp GiB | 1F1B temp GiB | 1F1B / GPipe | GPipe slots (M+P-1) | 1F1B slots (2P-1) "
        "| bubble (P-1)/(M+P-1) |",
        "|---|---|---|---|---|---|---|",
    ]
    for mm in micros:
        g, o = by.get(("gpipe", mm)), by.get(("1f1b", mm))
        if not (g and o):
            continue
        lines.append(f"| {mm} | {g['temp_bytes'] / GIB:.2f} | {o['temp_bytes'] / GIB:.2f} | "
                     f"{o['temp_bytes'] / g['temp_bytes']:.2f} | {g['activation_slots']} | {o['activation_slots']} | "
                     f"{g['bubble_fraction']:.3f} |")
    sp = data.get("speed")
    if sp:
        m2 = sp["model"]
        lines += ["", f"Time per value-and-grad (CPU, {sp['stages']} simulated devices sharing the host's cores, "
                      f"{m2['kind']} d_model {m2['d_model']}, {m2['n_layers']} layers, seq {sp['seq']}, M = "
                      f"{sp['microbatches']}, {sp['dtype']}; median of {sp['rounds']} interleaved rounds): GPipe "
                      f"{sp['median_s']['gpipe']:.3f} s, 1F1B {sp['median_s']['1f1b']:.3f} s "
                      f"(1F1B / GPipe = {sp['ratio_1f1b_over_gpipe']:.2f}; `--speed`)."]
    lines += [
        "",
        "Bubble: both schedules idle `(P-1)/(M+P-1)` of a stage's time. 1F1B here runs forward-only ticks "
        "`0..P-2`, one forward and one backward per tick for `M` ticks, then backward-only ticks, every "
        "stage in lockstep (SPMD; idle slots are computed and masked), so a stage is busy `M(F+B)` of "
        "`(M+P-1)(F+B)`. Memory: 1F1B keeps `2P-1` micro-batches' stage residuals (a lockstep forward "
        "needs a whole tick to reach the next stage, so micro-batch `i` is in flight at stage 0 for "
        "`2(P-1)` ticks); GPipe's autodiff keeps all `M+P-1` ticks'.",
        "",
        "Commands: `python -m experiments.rotation.pipeline_schedules` (memory), then `python -m experiments.rotation.pipeline_schedules "
        "--from-json experiments/results/pipeline_schedules.json --speed` (time; measured on a 2-core machine shared "
        "with other jobs, so noisy).",
    ]
    return "\n".join(lines) + "\n"


def plot(data: dict):
    """Temp GiB per device vs M, both schedules (a matplotlib Figure)."""
    fig, ax = common.subplots(1, (6, 4))
    for schedule, marker, label in zip(SCHEDULES, "os", ("GPipe", "1F1B")):
        rs = sorted((r for r in data["runs"] if r["schedule"] == schedule), key=lambda r: r["microbatches"])
        ax.plot([r["microbatches"] for r in rs], [r["temp_bytes"] / GIB for r in rs], marker=marker,
                label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches M (micro-batch size 1)")
    ax.set_ylabel("temp GiB per device (compiled)")
    ax.set_title(f"P={data['setup']['stages']} stages, d={data['setup']['model']['d_model']}, "
                 f"seq {data['setup']['seq']}, {data['setup']['dtype']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro", type=int, nargs="+", default=list(MICRO), help="micro-batch counts M to compile")
    ap.add_argument("--speed", action="store_true", help="also time both schedules on a small model (with "
                    "--from-json: added to that result, written to --out)")
    common.add_out(ap, "pipeline_schedules")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if not args.speed and common.rerender(args, "pipeline_schedules", markdown, plot) is not None:
        return 0
    fresh = not args.from_json
    data = measure(args.micro) if fresh else json.loads(pathlib.Path(args.from_json).read_text())
    if args.speed:
        data["speed"] = measure_speed()
    common.write(args.out, "pipeline_schedules", data=data, md=lambda: markdown(data), figure=lambda: plot(data),
                 indent=2, command=common.command_line("pipeline_schedules", argv) if fresh else None,
                 started=t0 if fresh else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
