"""Where an offload plan's device memory goes on a GPU: the 1B offloaded step compiled for an H100 without a GPU.

`gpu_export.md` found the plan's step compiled for an H100 far above the plan's prediction. This compiles
the same step (1B CoLA, batch 8 x 1024, bf16, 8-bit Adam, one GPU) with a plan from `boostjax plan`, and
without a plan at `--remat none` and `full`, each at XLA's default scheduler memory limit and at a limit
near the plan's cap (`xla_gpu_memory_limit_slop_factor`, percent of the device's memory). From XLA's
dump of each compiled program it reads the buffers live at the program's peak (grouped by shape) and where
the peak sits in the instruction sequence, and when the host-to-device copies of host-resident state
are scheduled. Needs `jax-cuda12-plugin` with its CUDA libraries and `JAX_PLATFORMS=cpu` (docs/gpu-program.md).

    JAX_PLATFORMS=cpu python -m experiments.gpu.plan_memory --target experiments/gpu/targets/h100_sxm.txtpb
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import pathlib
import re
import sys
import tempfile
import time

from experiments import common

NAME = "plan_memory_gpu"
GiB = 2**30
_PEAK = re.compile(r"Live ranges at (\d+) \(peak\):")
_LIVE = re.compile(r"^\s+(\S+)\{([0-9,]*)\}: (\d+) bytes")
_SEQ = re.compile(r"^\s+(\d+):(\S+)$")
_SHAPE = re.compile(r"^\s*(?:ROOT )?%?(\S+) = (\(.*?\)|[a-z0-9]+\[[0-9,]*\])")
_ARRAY = re.compile(r"[a-z0-9]+\[[0-9,]*\]")


def peak_report(dump: str, top: int = 6) -> dict:
    """From XLA's `*live-range.txt` and optimised HLO dumps: the peak's position in the instruction sequence,
    the live buffers there grouped by shape (largest first), and the positions of the `copy-start`s."""
    live_file = glob.glob(os.path.join(dump, "*after_optimizations-live-range.txt"))[0]
    hlo_file = glob.glob(os.path.join(dump, "*after_optimizations.txt"))[0]
    shapes: dict[str, list[str]] = {}  # instruction -> its array shapes (a tuple's in order)
    for line in pathlib.Path(hlo_file).read_text().splitlines():
        m = _SHAPE.match(line)
        if m:
            shapes[m.group(1)] = _ARRAY.findall(m.group(2))
    order, at, live = {}, None, []
    for line in pathlib.Path(live_file).read_text().splitlines():
        if at is None and (m := _SEQ.match(line)):
            order[m.group(2)] = int(m.group(1))
        elif m := _PEAK.search(line):
            at = int(m.group(1))
        elif at is not None and (m := _LIVE.match(line)):
            live.append((m.group(1), m.group(2), int(m.group(3))))
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for name, index, size in live:
        arrays = shapes.get(name, [])
        i = int(index.split(",")[0]) if index else 0
        groups[arrays[i] if i < len(arrays) else "?"].append(size)
    biggest = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]
    copies = sorted(v for k, v in order.items() if k.startswith("copy-start"))
    n = max(order.values()) + 1 if order else 1
    return {"peak_at": at, "instructions": n, "live_bytes": sum(s for *_, s in live),
            "largest": [{"shape": s, "buffers": len(v), "bytes": sum(v)} for s, v in biggest],
            "copy_starts": len(copies), "copy_starts_median_at": copies[len(copies) // 2] / n if copies else None}


def compile_case(cfg, target: str, slop: int | None) -> dict:
    from experiments.gpu import gpu_export as gx

    low, _ = gx.lower(cfg, "cuda")
    with tempfile.TemporaryDirectory() as dump:
        env = {"xla_dump_to": dump, "xla_dump_hlo_pass_re": "^$"}
        if slop is not None:
            env["xla_gpu_memory_limit_slop_factor"] = str(slop)
        exe, secs = gx.gpu_compile(low, target, 1, env)
        found = gx.compiled_findings(exe.hlo_modules()[0].to_string(), exe.get_compiled_memory_stats())
        return {"memory": found["memory"], "compile_s": round(secs, 1), "peak": peak_report(dump)}


def measure(target: str, plan: str | None, time_limit: float, slop: int) -> dict:
    from experiments.gpu import gpu_export as gx

    with tempfile.TemporaryDirectory() as tmp:
        path, words = (plan, ["plan", "--out", plan]) if plan else gx.make_plan(tmp, time_limit, common.log)
        plan_json = json.loads(pathlib.Path(path).read_text())
        return _measure_plan(target, path, words, plan_json, slop)


def _measure_plan(target: str, path: str, words: list[str], plan_json: dict, slop: int) -> dict:
    from experiments.gpu import gpu_export as gx

    o = gx.ONE_B
    res = {"plan": {k: plan_json.get(k) for k in ("predicted_peak_bytes", "budget_bytes", "status")},
           "plan_command": "boostjax " + " ".join(words), "rows": []}
    cases = [("plan", dict(offload_plan=path)), ("remat none", dict(remat="none")), ("remat full", dict(remat="full"))]
    for what, kw in cases:
        cfg = gx.configs(o["preset"], 24, o["seq"], batch=o["batch"], optimizer=o["optimizer"], **kw)
        for s in (None, slop):
            r = compile_case(cfg, target, s)
            res["rows"].append({"case": what, "slop": s} | r)
            common.log(f"{what}, slop {s}: peak {r['memory']['peak_bytes_per_device'] / GiB:.2f} GiB")
    return res


def markdown(res: dict) -> str:
    p = res["plan"]
    lines = ["# Where an offload plan's device memory goes on a GPU", "",
             f"Command: `{res['command']}` (wall time {res['wall_s']:.0f} s).", "",
             f"1B CoLA, 24 layers, batch 8 x 1024, bf16, 8-bit Adam, attention auto (cuDNN), compiled for one "
             f"`{res['target']}` with no GPU. The plan (`{res['plan_command']}`) predicts "
             f"{(p.get('predicted_peak_bytes') or 0) / 1e9:.2f} GB. Scheduler limit: XLA's default, or "
             f"`xla_gpu_memory_limit_slop_factor={res['slop']}` ({res['slop']} % of the device's memory).", "",
             "| step | scheduler limit | device peak GiB | temporaries GiB | host arguments GiB | peak at (share of "
             "the program) | live at the peak GiB | largest live buffers at the peak | copy-starts (median at) |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in res["rows"]:
        m, k = r["memory"], r["peak"]
        big = "; ".join(f"{b['buffers']} x {b['shape']} ({b['bytes'] / GiB:.2f})" for b in k["largest"][:3])
        med = "-" if k["copy_starts_median_at"] is None else f"{k['copy_starts_median_at']:.0%}"
        lines.append(f"| {r['case']} | {'default' if r['slop'] is None else str(r['slop']) + ' %'} | "
                     f"{m['peak_bytes_per_device'] / GiB:.2f} | {m['temp_bytes'] / GiB:.2f} | "
                     f"{m['host_argument_bytes'] / GiB:.2f} | {k['peak_at'] / k['instructions']:.0%} | "
                     f"{k['live_bytes'] / GiB:.2f} | {big} | {k['copy_starts']} ({med}) |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_gpu_target(ap)
    ap.add_argument("--plan", default=None, help="a plan file from boostjax plan for the 1B step (default: make one)")
    ap.add_argument("--plan-time-limit", type=float, default=10.0, help="CP-SAT time limit when making the plan, s")
    ap.add_argument("--slop", type=int, default=6, help="the lower scheduler memory limit, percent of the device's "
                    "memory (6: about the plan's 5 GB cap on an 80 GB H100)")
    common.add_out(ap, NAME, from_json=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for flag, path in (("--target", args.target), ("--plan", args.plan)):
        if path is not None and not os.path.isfile(path):
            print(f"{NAME}: {flag} {path} is not a file; fix: pass an existing file", file=sys.stderr)
            return 2
    if not 1 <= args.slop <= 100 or args.plan_time_limit <= 0:
        print(f"{NAME}: --slop must lie in [1, 100] and --plan-time-limit be > 0; fix: e.g. --slop 6", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    res = measure(args.target, args.plan, args.plan_time_limit, args.slop)
    res |= {"target": pathlib.Path(args.target).name, "slop": args.slop, "wall_s": time.perf_counter() - t0,
            "command": "JAX_PLATFORMS=cpu python -m experiments.gpu.plan_memory " + " ".join(argv or sys.argv[1:])}
    common.write(args.out, NAME, data=res, md=lambda: markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
