"""Does state on the host lower a GPU step's device memory? A small CoLA model compiled for one H100 without a GPU.

One plan per placement of every layer's parameters and optimizer state (all on the device, parameters and
state on the host, optimizer state only on the host), each with every boundary kept on the device, the
layers' inner checkpoints saving everything and the prefetch leads of 1. Each step is lowered for CUDA and
compiled against an XLA GPU target description (`gpu_export.gpu_compile`); the table gives the device
arguments, temporaries and peak, and the host arguments. Needs `jax-cuda12-plugin` with its CUDA libraries
and `JAX_PLATFORMS=cpu` (docs/gpu-program.md).

    JAX_PLATFORMS=cpu python -m experiments.gpu.host_state --target experiments/gpu/targets/h100_sxm.txtpb
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

from experiments import common

NAME = "host_state_gpu"
MODES = ("device", "host", "opt-host")
MiB = 2**20


INNER = {"all": "inner checkpoints save everything", "latents": "every layer checkpointed, saving its latents",
         "boundary": "every layer checkpointed, saving its input only"}


def measure(target: str, n_layers: int, inner: str = "all", d: int = 512, batch: int = 2, seq: int = 256,
            slop: int | None = None) -> list[dict]:
    from boostjax.config import Config, ModelConfig, TrainConfig, validate
    from boostjax.offload.costmodel import build_instance
    from boostjax.offload.planner import Decisions, make_plan
    from experiments.gpu import gpu_export as gx

    m = ModelConfig(d_model=d, n_layers=n_layers, n_heads=8, d_ff=11 * d // 4, rank=d // 4, max_seq_len=seq,
                    kind="cola", vocab_size=4096)
    inst = build_instance(m, batch, seq, "H800-80GB", budget_bytes=1e12, dtype_bytes=2, eight_bit=True, attention="flash")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            n = n_layers
            d = Decisions(boundary=("device",) * n, inner=(inner,) * n, mode=(mode,) * n, offload_lag=(0,) * n,
                          fetch_lead=(0,) * n, param_fwd_lead=(1,) * n, param_bwd_lead=(1,) * n, grad_lag=(1,) * n,
                          flat=(False,) * n)
            path = pathlib.Path(tmp) / f"{mode}.json"
            path.write_text(make_plan(inst, d, "manual").to_json())
            cfg = validate(Config(m, TrainConfig(batch=batch, seq=seq, dtype="bfloat16", optimizer="adam8bit",
                                                 offload_plan=str(path))))
            env = None if slop is None else {"xla_gpu_memory_limit_slop_factor": str(slop)}
            found = gx.compile_for_target(cfg, target, 1, common.log, mode, env)
            rows.append({"mode": mode, **({"error": found["error"]} if "error" in found else found["memory"])})
    return rows


def markdown(res: dict) -> str:
    lines = ["# State on the host against a GPU step's device memory", "",
             f"Command: `{res['command']}` (wall time {res['wall_s']:.0f} s).", "",
             f"CoLA d {res.get('d_model', 512)}, {res['n_layers']} layers, rank {res.get('d_model', 512) // 4}, batch "
             f"{res.get('batch', 2)} x {res.get('seq', 256)}, bf16, 8-bit Adam; every boundary on the "
             f"device, {INNER[res.get('inner', 'all')]}; compiled for one `{res['target']}` with no GPU"
             + ("." if res.get("slop") is None else f", XLA's scheduler memory limit at "
                f"`xla_gpu_memory_limit_slop_factor={res['slop']}`."), "",
             "| every layer's params / optimizer state | device arguments MiB | device temporaries MiB | device peak "
             "MiB | host arguments MiB |", "|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['mode']} | failed: `{r['error']}` | | | |")
            continue
        lines.append(f"| {r['mode']} | {r['argument_bytes'] / MiB:.1f} | {r['temp_bytes'] / MiB:.1f} | "
                     f"{r['peak_bytes_per_device'] / MiB:.1f} | {r['host_argument_bytes'] / MiB:.1f} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_gpu_target(ap)
    ap.add_argument("--layers", type=int, default=8, help="layers of the small CoLA model")
    ap.add_argument("--d-model", type=int, default=512, help="width of the small CoLA model (d_ff 11 d / 4, rank d / 4)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--inner", default="all", choices=tuple(INNER), help="every layer's inner option in the plans: "
                    "all (no remat; results host_state_gpu.*) or a checkpoint (results host_state_gpu_<inner>.*)")
    ap.add_argument("--slop", type=int, default=None, help="XLA's scheduler memory limit, percent of the device's "
                    "memory (xla_gpu_memory_limit_slop_factor; default: XLA's own); results get a _slop<N> suffix")
    common.add_out(ap, NAME)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    name = (NAME if args.inner == "all" else f"{NAME}_{args.inner}_d{args.d_model}") + (
        "" if args.slop is None else f"_slop{args.slop}")
    if common.rerender(args, name, markdown) is not None:
        return 0
    if not os.path.isfile(args.target):
        ap.error(f"--target {args.target} is not a file; fix: pass a GpuTargetConfigProto text file")
    if min(args.layers, args.batch, args.seq) < 1 or args.d_model < 64 or args.d_model % 64:
        ap.error("--layers, --batch, --seq must be >= 1 and --d-model a multiple of 64; fix: e.g. --d-model 512")
    if args.slop is not None and not 0 <= args.slop <= 100:
        ap.error(f"--slop {args.slop} is not a percentage; fix: an integer in 0..100, e.g. --slop 0")
    t0 = time.time()
    res = {"rows": measure(args.target, args.layers, args.inner, args.d_model, args.batch, args.seq, args.slop),
           "n_layers": args.layers, "inner": args.inner, "d_model": args.d_model, "batch": args.batch, "seq": args.seq,
           "slop": args.slop,
           "target": pathlib.Path(args.target).name,
           "command": "JAX_PLATFORMS=cpu " + common.command_line("gpu.host_state", argv)}
    res["wall_s"] = time.time() - t0
    common.write(args.out, name, data=res, md=lambda: markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
