"""Causal attention's forward and backward on this CPU: the materialised reference, the row-blocked path
at several row-block sizes (and the default size's first version, `first_row_blocked`), the chunked
(flash) path and PyTorch's `scaled_dot_product_attention`.

The 60m step's attention (batch 4 x 256, 8 heads of 64, fp32): eight layers chained (each layer's
output, plus its input, is the next layer's queries, so the layers cannot run side by side; keys and
values are shared), the gradient of <out, w> for q, k and v, jitted (torch: autograd), warmed up and
timed as the median of interleaved rounds. GFLOP/s counts the full `t x t` products (4·b·h·t²·e per
layer forward, twice that backward) whatever a path skips, so it compares time.

    python -m experiments.speed.attention_speed                    # every path: attention_speed.{json,md}
    taskset -c 0 python -m experiments.speed.attention_speed --name attention_speed_1core
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

from experiments import common

ROWS = (32, 64, 128, 256)


def first_row_blocked(rows: int):
    """The row-blocked attention as first written: `E` saved as computed (`[rows, keys]`), so `dV = E^T dO/l`
    and `dK = dS^T Q` contract their left operand along its rows, which XLA's CPU backend runs as Eigen
    GEMMs. Kept here so the current backward is timed against it in the same rounds."""
    import jax
    import jax.numpy as jnp

    from boostjax.models import attention as A

    def forward(q, k, v):
        kv, g = k.shape[2], q.shape[2] // k.shape[2]
        q_, k_, v_ = A._by_kv_head(q, kv), A._by_kv_head(k, kv), A._by_kv_head(v, kv)
        outs, tiles = [], []
        for lo, hi in A._row_blocks(q.shape[1], rows):
            e_bkns, l_bkn1 = A._row_tile(q_[:, :, lo * g:hi * g], k_[:, :, :hi], lo, hi, g)
            outs.append(jnp.einsum("bkns,bkse->bkne", e_bkns, v_[:, :, :hi]) / l_bkn1)
            tiles.append((e_bkns, l_bkn1))
        return A._from_kv_head(jnp.concatenate(outs, axis=2), q.shape[2]), tiles

    @jax.custom_vjp
    def attend(q, k, v):
        return forward(q, k, v)[0]

    def fwd(q, k, v):
        o, tiles = forward(q, k, v)
        return o, (q, k, v, o, tiles)

    def bwd(res, do):
        q, k, v, o, tiles = res
        kv, g = k.shape[2], q.shape[2] // k.shape[2]
        q_, k_, v_, do_, o_ = (A._by_kv_head(x, kv) for x in (q, k, v, do, o))
        dq, dk, dv = [], jnp.zeros(k_.shape), jnp.zeros(v_.shape)
        for (lo, hi), (e_bkns, l_bkn1) in zip(A._row_blocks(q.shape[1], rows), tiles):
            n = slice(lo * g, hi * g)
            dol = do_[:, :, n] / l_bkn1
            dv = dv.at[:, :, :hi].add(jnp.einsum("bkns,bkne->bkse", e_bkns, dol))
            dp = jnp.einsum("bkne,bkse->bkns", dol, v_[:, :, :hi])
            ds = e_bkns * (dp - jnp.sum(dol * o_[:, :, n], -1, keepdims=True))
            dq.append(jnp.einsum("bkns,bkse->bkne", ds, k_[:, :, :hi]))
            dk = dk.at[:, :, :hi].add(jnp.einsum("bkns,bkne->bkse", ds, q_[:, :, n]))
        scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[3]))
        return (A._from_kv_head(jnp.concatenate(dq, axis=2) * scale, q.shape[2]), A._from_kv_head(dk * scale, kv),
                A._from_kv_head(dv, kv))

    attend.defvjp(fwd, bwd)
    return attend


def _jax_paths(b: int, t: int, h: int, e: int, layers: int, rows: tuple[int, ...]) -> dict[str, Callable[[], Any]]:
    import jax
    import jax.numpy as jnp

    from boostjax.models import attention, ops

    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, w = (jax.random.normal(key, (b, t, h, e), jnp.float32) for key in ks)

    def chain(impl: str, block: int, attend=None):
        attend = attend or (lambda q, k, v: ops.causal_attention(q, k, v, impl=impl, block=block))

        def loss(q, k, v):
            x = q
            for _ in range(layers):
                x = attend(x, k, v) + q
            return jnp.vdot(x, w)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    paths = {"xla (materialised reference)": chain("xla", t)}
    for r in rows:
        old, attention.ROW_BLOCK = attention.ROW_BLOCK, r  # read while tracing: compile now
        try:
            paths[f"row-blocked, {r}-position rows"] = chain("chunked", t).lower(q, k, v).compile()
        finally:
            attention.ROW_BLOCK = old
    if attention.ROW_BLOCK in rows:
        paths[f"row-blocked, {attention.ROW_BLOCK}-position rows, first version (E saved as computed)"] = chain(
            "chunked", t, first_row_blocked(attention.ROW_BLOCK))
    paths[f"chunked (flash), {t // 2}-position tiles"] = chain("chunked", t // 2)
    return {name: (lambda f=f: jax.block_until_ready(f(q, k, v))) for name, f in paths.items()}


def _torch_path(b: int, t: int, h: int, e: int, layers: int) -> dict[str, Callable[[], Any]]:
    try:
        import torch
    except ImportError:
        return {}
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    q, k, v, w = (torch.randn(b, h, t, e, requires_grad=True) for _ in range(4))

    def step():
        x = q
        for _ in range(layers):
            x = torch.nn.functional.scaled_dot_product_attention(x, k, v, is_causal=True) + q
        torch.autograd.grad((x * w).sum(), (q, k, v))

    return {f"torch {torch.__version__} scaled_dot_product_attention": step}


def markdown(res: dict) -> str:
    a, m = res["args"], res["machine"]
    flops = res["flops"]
    lines = ["# Causal attention, forward and backward, on this CPU", "",
             f"Command: `{res['command']}` (wall time {res['wall_s']:.0f} s).", "",
             f"Machine: {m['cpu_model'] or 'unknown CPU'}, {m['cpus_usable']} usable core(s), jax {m['jax']}; "
             f"load average at start {m['loadavg_start'][0]:.1f}.", "",
             f"Batch {a['batch']} x {a['seq']}, {a['heads']} heads of {a['head_dim']}, fp32, {a['layers']} layers "
             f"chained; gradient for q, k, v. Median of {a['rounds']} interleaved rounds; GFLOP/s counts the full "
             f"t x t products ({flops / 1e9:.2f} GFLOP per call) whatever a path skips.", "",
             "| path | ms per call | ms per layer | GFLOP/s (full t x t) | x reference |",
             "|---|---:|---:|---:|---:|"]
    ref = res["ms"]["xla (materialised reference)"]
    for name, ms in res["ms"].items():
        lines.append(f"| {name} | {ms:.1f} | {ms / a['layers']:.2f} | {flops / ms / 1e6:.0f} | {ref / ms:.2f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4, help="sequences (default: 4)")
    ap.add_argument("--seq", type=int, default=256, help="sequence length (default: 256)")
    ap.add_argument("--heads", type=int, default=8, help="attention heads (default: 8)")
    ap.add_argument("--head-dim", type=int, default=64, help="head width (default: 64)")
    ap.add_argument("--layers", type=int, default=8, help="layers chained (default: 8)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row-block sizes to time (default: 32,64,128,256)")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved timed rounds (default: 10)")
    ap.add_argument("--name", default="attention_speed", help="results file name (default: attention_speed)")
    common.add_out(ap, "attention_speed", from_json=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser()
    args = ap.parse_args(argv)
    try:
        rows = tuple(int(r) for r in args.rows.split(","))
    except ValueError:
        rows = ()
    if not rows or min(rows) < 1:
        ap.error("--rows: comma-separated positive integers, e.g. 32,64")
    if min(args.batch, args.seq, args.heads, args.head_dim, args.layers, args.rounds) < 1:
        ap.error("--batch, --seq, --heads, --head-dim, --layers, --rounds must be >= 1")
    common.keep_scratch()
    started = time.perf_counter()
    shape = (args.batch, args.seq, args.heads, args.head_dim, args.layers)
    calls = _jax_paths(*shape, rows) | _torch_path(*shape)
    for call in calls.values():  # compile, warm up
        call(), call()
    wall = common.interleaved(calls, args.rounds).wall
    b, t, h, e, layers = shape
    res = {"args": vars(args), "machine": common.machine_facts(), "command": common.command_line("attention_speed", argv),
           "flops": 3 * 4 * b * h * t * t * e * layers,
           "ms": {name: 1e3 * statistics.median(wall[name]) for name in calls},
           "wall_s": time.perf_counter() - started}
    common.write(args.out, args.name, data=res, md=lambda: markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
