"""The smallest program where host-resident state undoes remat on a GPU, compiled for an H100 without a GPU.

`host_state.md` found that any state on the host makes a CoLA step's GPU program keep what its checkpoints
were to drop. This reproduces the effect without boostjax's model or planner: `layers` residual MLP
blocks (`h + tanh(h W1) W2`, bf16, `rows x d` activations, `d x 4d` hidden), each under `jax.checkpoint`,
the gradient of `sum(h)`, jitted with explicit memory kinds. Cases: everything on the device; the
weights on the host, moved to the device in the step (`jax.device_put`) outside or inside the
checkpoint; momentum-style optimizer state on the host, moved in, updated with the gradient and moved
back. Each with plain checkpoints, with checkpoints tied both ways (`boostjax.models.remat.tied_checkpoint(...,
tie_grads=True)`: a block's weight gradients before the next block's backward), and without remat, at
XLA's default scheduler memory limit and at `xla_gpu_memory_limit_slop_factor=0`. Reported: the compiled
program's device temporaries. Needs
`jax-cuda12-plugin` with its CUDA libraries and `JAX_PLATFORMS=cpu` (docs/gpu-program.md).

    JAX_PLATFORMS=cpu python -m experiments.gpu.host_schedule --target experiments/gpu/targets/h100_sxm.txtpb
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

from experiments import common

NAME = "host_schedule_gpu"
MiB = 2**20
CASES = {"device": "everything on the device",
         "weights-host-outside": "weights on the host, moved in outside the checkpoint",
         "weights-host-inside": "weights on the host, moved in inside the checkpoint (again in the recompute)",
         "state-host": "weights on the device, optimizer state on the host (moved in, updated, moved out)"}
SLOPS = (None, 0)
REMATS = ("checkpoints", "tied", "none")


def program(case: str, remat: str, layers: int, rows: int, d: int):
    """(jitted step, its abstract arguments) for one case and one of `REMATS`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from boostjax.models.remat import tied_checkpoint

    dev = jax.devices()[0]
    on_dev, on_host = (SingleDeviceSharding(dev, memory_kind=k) for k in ("device", "pinned_host"))
    fetch_outside, fetch_inside = case == "weights-host-outside", case == "weights-host-inside"

    def block(h, w1, w2):
        if fetch_inside:
            w1, w2 = jax.device_put(w1, on_dev), jax.device_put(w2, on_dev)
        return h + jnp.tanh(h @ w1) @ w2

    def loss(ws, x):
        h = x
        for w1, w2 in ws:
            if fetch_outside:
                w1, w2 = jax.device_put(w1, on_dev), jax.device_put(w2, on_dev)
            wrap = {"checkpoints": jax.checkpoint, "tied": lambda f: tied_checkpoint(f, None, tie_grads=True),
                    "none": lambda f: f}[remat]
            h = wrap(block)(h, w1, w2)
        return jnp.sum(h.astype(jnp.float32))

    def step(ws, ms, x):
        gs = jax.grad(loss)(ws, x)
        if case != "state-host":
            return gs
        new = []
        for pair_m, pair_g in zip(ms, gs):
            moved = (0.9 * jax.device_put(m, on_dev) + g.astype(jnp.float32) for m, g in zip(pair_m, pair_g))
            new.append(tuple(jax.device_put(m, on_host) for m in moved))
        return gs, new

    w_kind = on_host if case.startswith("weights-host") else on_dev
    shapes = ((d, 4 * d), (4 * d, d))
    ws = [tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=w_kind) for s in shapes) for _ in range(layers)]
    ms = [tuple(jax.ShapeDtypeStruct(s, jnp.float32, sharding=on_host) for s in shapes) for _ in range(layers)]
    x = jax.ShapeDtypeStruct((rows, d), jnp.bfloat16, sharding=on_dev)
    grads = [(on_dev, on_dev)] * layers
    out = (grads, [(on_host, on_host)] * layers) if case == "state-host" else grads
    return jax.jit(step, out_shardings=out), (ws, ms, x)


def measure(target: str, layers: int, rows: int, d: int) -> list[dict]:
    from experiments.gpu import gpu_export as gx

    rows_out = []
    for case in CASES:
        for remat in REMATS:
            fn, args = program(case, remat, layers, rows, d)
            low = fn.trace(*args).lower(lowering_platforms=("cuda",))
            for slop in SLOPS:
                env = None if slop is None else {"xla_gpu_memory_limit_slop_factor": str(slop)}
                exe, _ = gx.gpu_compile(low, target, 1, env)
                m = exe.get_compiled_memory_stats()
                rows_out.append({"case": case, "remat": remat, "slop": slop, "temp_bytes": int(m.temp_size_in_bytes),
                                 "argument_bytes": int(m.argument_size_in_bytes),
                                 "host_argument_bytes": int(m.host_argument_size_in_bytes)})
                common.log(f"{case}, remat {remat}, slop {slop}: temporaries {m.temp_size_in_bytes / MiB:.0f} MiB")
    return rows_out


def markdown(res: dict) -> str:
    a = res["args"]
    lines = ["# Host-resident state against remat on a GPU: the smallest case", "",
             f"Command: `{res['command']}` (wall time {res['wall_s']:.0f} s).", "",
             f"{a['layers']} residual MLP blocks (`h + tanh(h W1) W2`), activations {a['rows']} x {a['d']}, hidden "
             f"{4 * a['d']}, bf16, the gradient of sum(h); compiled for one `{res['target']}` with no GPU. Device "
             "temporaries in MiB, at XLA's default scheduler memory limit and at "
             "`xla_gpu_memory_limit_slop_factor=0`; `tied`: `tied_checkpoint(..., tie_grads=True)`.", "",
             "| case | " + " | ".join(f"{r}: {lim}" for r in REMATS for lim in ("default", "limit 0")) + " |",
             "|---|" + "---:|" * (2 * len(REMATS))]
    temp = {(r["case"], r["remat"], r["slop"]): r["temp_bytes"] / MiB for r in res["rows"]}
    for case, words in CASES.items():
        cells = [f"{temp[(case, remat, slop)]:.0f}" for remat in REMATS for slop in SLOPS]
        lines.append(f"| {words} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_gpu_target(ap)
    ap.add_argument("--layers", type=int, default=8, help="residual blocks (default: 8)")
    ap.add_argument("--rows", type=int, default=8192, help="activation rows, batch x sequence (default: 8192)")
    ap.add_argument("--d-model", type=int, default=1024, help="activation width; the hidden layer is 4x (default: 1024)")
    common.add_out(ap, NAME)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if common.rerender(args, NAME, markdown) is not None:
        return 0
    if not os.path.isfile(args.target):
        ap.error(f"--target {args.target} is not a file; fix: pass a GpuTargetConfigProto text file")
    if min(args.layers, args.rows, args.d_model) < 1:
        ap.error("--layers, --rows and --d-model must be >= 1; fix: e.g. --layers 8 --rows 8192 --d-model 1024")
    t0 = time.time()
    res = {"rows": measure(args.target, args.layers, args.rows, args.d_model),
           "args": {"layers": args.layers, "rows": args.rows, "d": args.d_model},
           "target": pathlib.Path(args.target).name,
           "command": "JAX_PLATFORMS=cpu " + common.command_line("gpu.host_schedule", argv)}
    res["wall_s"] = time.time() - t0
    common.write(args.out, NAME, data=res, md=lambda: markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
