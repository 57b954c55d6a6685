"""This CPU's fp32 GEMM peak through XLA, per core: the yardstick for the training step's GFLOP/s.

Each thread count runs in its own process (XLA reads its thread settings at import), pinned with
`os.sched_setaffinity` to that many cores: square GEMMs (512 to 2048) and the shapes the 60m step
multiplies (4 x 256 = 1024 rows against d 512, d_ff 1376, rank 128, vocabulary 8192), each jitted,
warmed up and timed as the median of interleaved rounds. The peak per core is the best shape on one
core; `lowrank_speed.json`'s step GFLOP/s, where present, are divided by the peak on that many cores.

    python -m experiments.speed.gemm_peak                 # 1 and 2 threads: gemm_peak.{json,md}
    python -m experiments.speed.gemm_peak --threads 1     # one core only
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

from experiments import common

NAME = "gemm_peak"
SQUARE = (512, 1024, 2048)
# (rows, inner, cols) of the 60m step at batch 4 x 256: projections, low-rank factors, the LM head
STEP_SHAPES = {"dense q/o (1024 x 512 x 512)": (1024, 512, 512), "dense up (1024 x 512 x 1376)": (1024, 512, 1376),
               "dense down (1024 x 1376 x 512)": (1024, 1376, 512), "factor A (1024 x 512 x 128)": (1024, 512, 128),
               "factor B (1024 x 128 x 1376)": (1024, 128, 1376), "head (1024 x 512 x 8192)": (1024, 512, 8192)}
# the weight gradients `x^T dy` of the same GEMMs (m x k x n with k = the 1024 rows, x stored [k, m]): XLA's CPU
# backend runs a dot that contracts its left operand's rows as an Eigen GEMM, not an XNNPACK (YNN) one
GRAD_SHAPES = {"grad dense q/o (512 x 1024 x 512)": (512, 1024, 512),
               "grad dense up (512 x 1024 x 1376)": (512, 1024, 1376),
               "grad factor A (512 x 1024 x 128)": (512, 1024, 128),
               "grad factor B (128 x 1024 x 512)": (128, 1024, 512),
               "grad factor A down (1376 x 1024 x 128)": (1376, 1024, 128),
               "grad head (512 x 1024 x 8192)": (512, 1024, 8192)}
# the LM head's weight gradient as `ops.wide_matmul` computes it: on a transposed copy of x (copy included)
COPY_SHAPES = {"grad head, transposed copy (512 x 1024 x 8192)": (512, 1024, 8192)}


def _measure_here(rounds: int) -> dict[str, Any]:
    """GFLOP/s of every shape in this process (its thread settings already fixed)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from boostjax.models.attention import materialised

    shapes = {f"square {n}": (n, n, n) for n in SQUARE} | STEP_SHAPES | GRAD_SHAPES | COPY_SHAPES
    fns = {}
    for name, (m, k, n) in shapes.items():
        rng = np.random.default_rng(0)
        grad = name in GRAD_SHAPES or name in COPY_SHAPES
        a = jnp.asarray(rng.standard_normal((k, m) if grad else (m, k)), jnp.float32)
        b = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        fn = (lambda x, y: materialised(x.T) @ y) if name in COPY_SHAPES else (lambda x, y: x.T @ y) if grad else jnp.dot
        f = jax.jit(fn).lower(a, b).compile()
        f(a, b).block_until_ready()
        fns[name] = (lambda f=f, a=a, b=b: f(a, b).block_until_ready())
    wall = common.interleaved(fns, rounds).wall
    med = {name: float(np.median(wall[name])) for name in shapes}
    return {name: {"shape": list(shapes[name]), "ms": 1e3 * med[name],
                   "gflops": 2 * float(np.prod(shapes[name])) / med[name] / 1e9} for name in shapes}


def _child_code(cores: list[int], rounds: int) -> str:
    return ("import os, json; os.sched_setaffinity(0, %r); from experiments.speed import gemm_peak as g; "
            "print('RESULT ' + json.dumps(g._measure_here(%d)))" % (cores, rounds))


def run_threads(threads: int, rounds: int) -> dict[str, Any]:
    """`_measure_here` in a child process pinned to `threads` cores with XLA's pool of that size."""
    env = common.with_root(dict(os.environ))
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'}"
                        ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    cores = sorted(os.sched_getaffinity(0))[:threads]
    out = subprocess.run([sys.executable, "-c", _child_code(cores, rounds)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"gemm_peak: the {threads}-thread run failed:\n{out.stderr[-2000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return {"threads": threads, "cores": cores, "shapes": json.loads(line[len("RESULT "):])}


def step_fractions(peak_per_core: float, folder: str | pathlib.Path) -> list[dict[str, Any]]:
    """The training steps' GFLOP/s in `folder`'s `lowrank_speed.json` over the peak of the cores they ran on; []
    when that file was measured on another CPU model (rerun `experiments.speed.lowrank_speed` here first)."""
    path = pathlib.Path(folder) / "lowrank_speed.json"
    if not path.is_file():
        return []
    res = json.loads(path.read_text())
    machine = res.get("machine", {})
    if machine.get("cpu_model") != common.cpu_info()[0]:
        return []
    cores = machine.get("cpus_usable") or common.cores_usable()
    return [{"size": block["shape"], "model": kind, "gflops": r["gflops_per_s"], "cores": cores,
             "fraction": r["gflops_per_s"] / (peak_per_core * cores), "x_dense": r.get("speedup"),
             "flop_ratio": r.get("flop_ratio")}
            for block in res.get("shapes", []) for kind, r in block.get("runs", {}).items() if "gflops_per_s" in r]


def markdown(res: dict) -> str:
    by_threads = {t["threads"]: t["shapes"] for t in res["runs"]}
    scaling = 1 in by_threads and 2 in by_threads and all(n in by_threads[1] for n in by_threads[2])
    lines = ["# fp32 GEMM peak of this CPU through XLA", "",
             f"Command: `{res['command']}` (wall time {res['wall_s']:.0f} s).  ",
             f"Machine: {res['machine_line']}.", "",
             "Each shape jitted (`jnp.dot`, fp32), warmed up, then timed as the median of "
             f"{res['rounds']} interleaved rounds in a process pinned to that many cores. GFLOP/s = 2 m k n / time.", "",
             "`grad` rows are weight gradients `x^T dy` (x stored `[k, m]`, contracted along its rows, as the "
             "backward does). `2 ÷ 1`: the speed-up from the second core.", "",
             "| shape (m x k x n) | " + " | ".join(f"{t['threads']} thread(s) GFLOP/s" for t in res["runs"])
             + (" | 2 ÷ 1 |" if scaling else " |"),
             "|---|" + "---:|" * (len(res["runs"]) + bool(scaling))]
    for name in res["runs"][0]["shapes"]:
        cells = [f"{t['shapes'][name]['gflops']:.1f}" for t in res["runs"]] + (
            [f"{by_threads[2][name]['gflops'] / by_threads[1][name]['gflops']:.2f}x"] if scaling else [])
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"**Peak per core** (the best shape on one thread): {res['peak_per_core']:.1f} GFLOP/s."]
    if res.get("steps"):
        lines += ["", "Training steps measured on this CPU model (`lowrank_speed.json`: batch 4 x 256, fp32) "
                  "against this peak times their cores:", "",
                  "| size | model | step GFLOP/s | cores | fraction of peak | x dense | FLOP ratio |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['size']} | {r['model']} | {r['gflops']:.0f} | {r['cores']} | {r['fraction']:.0%} | "
                  f"{r['x_dense']:.2f} | {r['flop_ratio']:.2f} |" for r in res["steps"]]
    else:
        lines += ["", "No training step of this CPU model in this folder's `lowrank_speed.json`: run "
                  "`python -m experiments.speed.lowrank_speed` here (the same `--out`), then this again."]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to measure, each in its "
                    "own pinned process (at most the usable cores)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds per thread count")
    common.add_out(ap, NAME)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    usable = common.cores_usable()
    if any(t < 1 or t > usable for t in args.threads) or args.rounds < 1:
        ap.error(f"--threads: each in 1..{usable} (the usable cores), --rounds >= 1; fix: e.g. --threads 1 2")
    if common.rerender(args, NAME, markdown) is not None:
        return 0
    t0 = time.time()
    runs = []
    for t in args.threads:
        common.log(f"{t} thread(s)")
        runs.append(run_threads(t, args.rounds))
    one = next((r for r in runs if r["threads"] == 1), runs[0])
    peak = max(v["gflops"] for v in one["shapes"].values()) / one["threads"]
    res = {"runs": runs, "rounds": args.rounds, "peak_per_core": peak, "steps": step_fractions(peak, args.out),
           "machine": common.machine_facts(), "machine_line": common.machine_line(),
           "command": common.command_line(NAME, argv), "wall_s": time.time() - t0}
    common.write(args.out, NAME, data=res, md=lambda: markdown(res), started=t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
