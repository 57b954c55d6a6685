"""The CPU profile of `--cluster NxD:cpu`, measured by a micro-benchmark on this machine's simulated devices.

The simulated devices are threads of one process sharing the machine's cores: what an instruction
costs a device depends on how many devices run at once and on the instruction's size (a small one
pays a fixed dispatch cost, small arrays stay in cache, small GEMMs reach a fraction of the peak).
So the curves below are timed on all `devices` devices at once (`shard_map`, each device the same
work), as seconds per instruction at a few sizes (best of a few repeats after a compiling warm-up):
- GEMM curve: chains of dependent `[n, n] @ [n, n]` at a few n, an `opt-barrier` between links so that
  XLA keeps one instruction per link; `(t(K2) - t(K1)) / (K2 - K1)` (fixed costs cancel) at `2 n^3` FLOPs.
- memory curve: chains of `x * a + b` at a few per-device sizes likewise, at `2 x bytes` per link.
  Each curve is made non-decreasing in size (a larger instruction is never cheaper).
- all-reduce: chains of `psum` at two sizes likewise; the ring formula `t = alpha + 2 (T-1)/T * bytes / bus`
  through both points gives `alpha` and `bus` (a collective inside a running program: the cost of
  launching a program on every device, which a single jitted `psum` would time too, cancels).
- the machine's peak: one `[768, 768]` matmul and one 64 MiB `x * a + b` on one device (XLA spreads them
  over the cores); a device of an n-device mesh gets 1/n of them (`shared_rates`: the time lower bound
  and MFU), never below the rates the curves reached.
The cost model (`costs.program_time`) charges a dot the GEMM curve at its FLOPs and every other
instruction the memory curve at its bytes (`costs.instruction_s`). Nothing is fitted to training runs:
every constant is one of these timings.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boostjax.planning.costs import Hardware

GEMM_N = 768
STREAM_BYTES = 64 << 20
REDUCE_BYTES = (1 << 12, 1 << 20)  # per device, fp32
CURVE_GEMM_N = (16, 48, 128, 384)
CURVE_STREAM_BYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 23)  # per device
SHORT = 4  # links of the short chain
LINK_WORK = 1 << 27  # FLOPs or bytes per device of a long chain: K2 = SHORT + 16 + LINK_WORK / work links, <= 256


def _best(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile, first touch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def _mesh(devices: list) -> Mesh:
    return Mesh(np.array(devices), ("d",))


def _link_s(step, x_shape: tuple[int, ...], work: float, devices: list, repeats: int) -> float:
    """Seconds one link of a chain `v = step(v, w)` costs each device, all devices running it at once:
    a chain of SHORT links and one of K2 (more for small links), the difference over the links between."""
    mesh = _mesh(devices)
    rows = (len(devices) * x_shape[0], *x_shape[1:])
    x = jax.device_put(jnp.full(rows, 0.5, jnp.float32), NamedSharding(mesh, P("d")))
    n = x_shape[-1] if len(x_shape) > 1 else 1  # the matmul's [n, n] (a scalar for the stream)
    w = jax.device_put(jnp.full((n, n), 1.0 / n, jnp.float32), NamedSharding(mesh, P()))

    def timed(k: int) -> float:
        def body(v, w):
            for _ in range(k):
                v = jax.lax.optimization_barrier(step(v, w))  # one instruction per link, none merged
            return v

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")))
        return _best(lambda: f(x, w), repeats)

    k2 = int(min(256, SHORT + 16 + LINK_WORK // max(work, 1)))
    return max(timed(k2) - timed(SHORT), 0.0) / (k2 - SHORT)


def _curve(times: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """(size, seconds) points made non-decreasing in size (a link measured faster than a smaller one
    is noise: it gets the smaller one's time)."""
    out, floor = [], 1e-9
    for size, t in times:
        floor = max(floor, t)
        out.append((size, floor))
    return tuple(out)


def _matmul(v, w):
    return v @ w


def _axpb(v, w):
    return v * 1.5 + 1.0


def _psum(v, w):
    return jax.lax.psum(v, "d")


@functools.lru_cache(maxsize=4)
def calibrate(devices: int, dtype: str = "float32", repeats: int = 5) -> tuple[Hardware, dict]:
    """This machine's rates (and the raw timings) from the micro-benchmark over `devices` simulated devices."""
    dt = jnp.dtype(dtype)
    a = jnp.ones((GEMM_N, GEMM_N), dt)
    mm = jax.jit(lambda x: x @ x)
    gemm_s = _best(lambda: mm(a), repeats)
    flops = 2 * GEMM_N ** 3 / gemm_s
    x = jnp.ones((STREAM_BYTES // 4,), jnp.float32)
    stream = jax.jit(lambda v: v * 1.5 + 1.0)
    stream_s = _best(lambda: stream(x), repeats)
    hbm = 2 * STREAM_BYTES / stream_s
    devs = jax.devices()[:devices]
    t = len(devs)
    if t > 1:
        (b1, b2), (t1, t2) = REDUCE_BYTES, [_link_s(_psum, (b // 4,), 8 * b, devs, repeats) for b in REDUCE_BYTES]
        ring = 2 * (t - 1) / t
        bus = ring * (b2 - b1) / max(t2 - t1, 1e-9)
        alpha = max(t1 - ring * b1 / bus, 0.0)
    else:
        t1 = t2 = 0.0
        bus, alpha = hbm, 0.0
    gemm_curve = _curve([(2.0 * n ** 3, _link_s(_matmul, (n, n), 2 * n ** 3, devs, repeats)) for n in CURVE_GEMM_N])
    stream_curve = _curve([(2.0 * b, _link_s(_axpb, (b // 4,), 2 * b, devs, repeats)) for b in CURVE_STREAM_BYTES])
    hw = Hardware(f"cpu ({t} simulated devices, calibrated)", flops, hbm, 1.0, bus, alpha, bus, alpha,
                  gemm_curve=gemm_curve, stream_curve=stream_curve)
    raw = {"gemm_n": GEMM_N, "gemm_s": gemm_s, "gemm_flops_per_s": flops, "stream_bytes": STREAM_BYTES,
           "stream_s": stream_s, "memory_bytes_per_s": hbm, "allreduce_devices": t,
           "allreduce_bytes": list(REDUCE_BYTES), "allreduce_s": [t1, t2], "allreduce_bus_bytes_per_s": bus,
           "allreduce_alpha_s": alpha, "dtype": dtype, "gemm_curve_n": list(CURVE_GEMM_N),
           "gemm_curve_s": [t for _, t in gemm_curve], "stream_curve_bytes": list(CURVE_STREAM_BYTES),
           "stream_curve_s": [t for _, t in stream_curve]}
    return hw, raw


def shared_rates(hw: Hardware, devices: int) -> Hardware:
    """One device's share of the machine when `devices` simulated devices run at once: the peaks over
    `devices` (never below what a device reached in the curves, which were measured shared already)."""
    n = max(devices, 1)
    peak = max([hw.peak_flops / n, *(f / t for f, t in hw.gemm_curve)])
    hbm = max([hw.hbm_bytes_per_s / n, *(b / t for b, t in hw.stream_curve)])
    return replace(hw, peak_flops=peak, hbm_bytes_per_s=hbm)


__all__ = ["calibrate", "shared_rates"]
