"""Attention kernels on this machine: compiled memory of a training step, and time of the op.

1. Memory: the loss-and-gradient of one layer of a preset (default 13B's shapes: d 5120, 40 heads; bf16
   compute, batch 1) compiled abstractly on one CPU device for `--attention xla` and `chunked`, at
   several sequence lengths: `memory_analysis()` temp bytes, and the largest HLO buffer with two
   sequence-length dimensions (none for chunked).
2. Time: `causal_attention` forward + backward (fp32, b 1, h 8, k 8, e 64), jitted, xla vs chunked,
   interleaved rounds (median of each), on the CPU this runs on.

Writes experiments/results/attention_memory.{json,md}. Run: `python -m experiments.speed.attention_memory`
(about a minute; `--preset 1b --seqs 1024,4096` for others).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from dataclasses import replace

import jax
import jax.numpy as jnp

from boostjax.config import Config, TrainConfig, preset
from boostjax.models import ops
from boostjax.placement import local_loss_fn
from boostjax.models.llama import abstract_model

from experiments import common

SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]+)\]")
MIB = 2**20
BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def largest_square(hlo: str, t: int) -> tuple[str, int]:
    """The largest buffer (by bytes) of the HLO text with two dimensions equal to `t`, or ('', 0)."""
    best = ("", 0)
    for m in SHAPE.finditer(hlo):
        dims = [int(x) for x in m.group(2).split(",")]
        if dims.count(t) >= 2:
            n = BYTES.get(m.group(1), 4)
            for d in dims:
                n *= d
            best = max(best, (m.group(0), n), key=lambda x: x[1])
    return best


def step_memory(name: str, seq: int, attention: str, block: int) -> dict:
    model = replace(preset(name, kind="cola", vocab_size=256), n_layers=1, max_seq_len=seq, attention=attention,
                    attention_block=block)
    cfg = Config(model, TrainConfig(batch=1, seq=seq, dtype="bfloat16"))
    graphdef, params = abstract_model(cfg)
    batch = {k: jax.ShapeDtypeStruct((1, seq), jnp.int32) for k in ("inputs", "targets")}
    t0 = time.perf_counter()
    c = jax.jit(jax.value_and_grad(local_loss_fn(cfg, graphdef))).lower(params, batch).compile()
    mem = c.memory_analysis()
    buf, nbytes = largest_square(c.as_text(), seq)
    return {"preset": name, "seq": seq, "attention": attention, "block": block,
            "temp_mib": round(mem.temp_size_in_bytes / MIB, 1), "largest_t_by_t_buffer": buf,
            "largest_t_by_t_mib": round(nbytes / MIB, 1), "compile_s": round(time.perf_counter() - t0, 1)}


def op_time(t: int, block: int, rounds: int) -> dict:
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, t, 8, 64), jnp.float32) for key in ks)
    fns = {impl: jax.jit(jax.grad(lambda q, k, v, impl=impl: jnp.sum(
        ops.causal_attention(q, k, v, impl=impl, block=block) ** 2), argnums=(0, 1, 2))) for impl in ("xla", "chunked")}
    for f in fns.values():
        jax.block_until_ready(f(q, k, v))
    times: dict[str, list[float]] = {impl: [] for impl in fns}
    for _ in range(rounds):
        for impl, f in fns.items():  # interleaved: xla, chunked, xla, chunked, ...
            t0 = time.perf_counter()
            jax.block_until_ready(f(q, k, v))
            times[impl].append(time.perf_counter() - t0)
    med = {impl: statistics.median(x) for impl, x in times.items()}
    return {"seq": t, "block": block, "rounds": rounds, "xla_ms": round(1e3 * med["xla"], 1),
            "chunked_ms": round(1e3 * med["chunked"], 1), "chunked_over_xla": round(med["chunked"] / med["xla"], 2)}


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="13b",  # d_model 5120: no width equals a seq below
                    help="preset whose layer is compiled for the memory table (default: 13b)")
    ap.add_argument("--seqs", default="2048,4096", help="comma-separated sequence lengths of the memory table "
                    "(default: 2048,4096)")
    ap.add_argument("--block", type=int, default=512, help="chunked attention's block size (default: 512)")
    ap.add_argument("--time-seqs", default="1024,2048", help="comma-separated sequence lengths the op is timed at "
                    "(default: 1024,2048)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds, the median kept (default: 5)")
    common.add_out(ap, "attention_memory", from_json=False)
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    t0 = time.perf_counter()
    seqs = [int(s) for s in args.seqs.split(",")]
    memory = [step_memory(args.preset, s, a, args.block) for s in seqs for a in ("xla", "chunked")]
    timing = [op_time(int(s), args.block, args.rounds) for s in args.time_seqs.split(",")]
    out = {"command": common.command_line("attention_memory"),
           "backend": jax.default_backend(), "cpu_count": os.cpu_count(), "machine": common.machine_line(),
           "memory": memory, "op_time": timing}
    lines = [f"# Attention kernels: memory and time ({jax.default_backend()}; {out['machine']})", "",
             f"`{out['command']}`", "",
             f"One {args.preset} layer (CoLA), bf16 compute, batch 1, loss and gradient compiled on one device:", "",
             "| seq | attention | temp MiB | largest buffer with two seq dims | its MiB |", "|---|---|---|---|---|"]
    lines += [f"| {m['seq']} | {m['attention']} | {m['temp_mib']} | `{m['largest_t_by_t_buffer'] or 'none'}` | "
              f"{m['largest_t_by_t_mib']} |" for m in memory]
    lines += ["", f"`causal_attention` forward + backward, fp32, b 1, h 8, e 64, block {args.block}, "
              "median of interleaved rounds (read the ratio: other jobs may share the machine):", "", "| seq | xla ms | chunked ms | chunked / xla |", "|---|---|---|---|"]
    lines += [f"| {r['seq']} | {r['xla_ms']} | {r['chunked_ms']} | {r['chunked_over_xla']} |" for r in timing]
    common.write(args.out, "attention_memory", data=out, md="\n".join(lines), indent=2, started=t0)


if __name__ == "__main__":
    main()
