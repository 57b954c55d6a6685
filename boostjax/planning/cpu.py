"""The CPU profile of `--cluster NxD:cpu`, measured by a micro-benchmark on this machine's simulated devices.

Three timings (best of a few repeats, after a warm-up run that compiles):
- GEMM FLOP/s: a jitted `[n, n] @ [n, n]` in the compute dtype on one device (XLA CPU spreads it over
  the machine's cores): `2 n^3 / t`.
- memory bandwidth: a jitted `x * a + b` over a 64 MiB array: `2 x bytes / t` (read + write).
- all-reduce: a `psum` over all the simulated devices (`shard_map`) at two sizes; the ring formula
  `t = alpha + 2 (T-1)/T * bytes / bus` through both points gives `alpha` and `bus`.

The simulated devices share the machine's cores, so one device's rate in a mesh of `n` devices is the
machine's rate / n (`shared_rates`). GEMM efficiency is 1: the measured rate is what a GEMM reaches.
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
REDUCE_BYTES = (1 << 18, 1 << 22)  # per device, fp32


def _best(fn, repeats: int) -> float:
    jax.block_until_ready(fn())  # compile, first touch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def _allreduce_s(nbytes: int, devices: list, repeats: int) -> float:
    mesh = Mesh(np.array(devices), ("d",))
    n = nbytes // 4
    x = jax.device_put(jnp.ones((len(devices) * n,), jnp.float32), NamedSharding(mesh, P("d")))
    f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    return _best(lambda: f(x), repeats)


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
        (b1, b2), (t1, t2) = REDUCE_BYTES, [_allreduce_s(b, devs, repeats) for b in REDUCE_BYTES]
        ring = 2 * (t - 1) / t
        bus = ring * (b2 - b1) / max(t2 - t1, 1e-9)
        alpha = max(t1 - ring * b1 / bus, 0.0)
    else:
        t1 = t2 = 0.0
        bus, alpha = hbm, 0.0
    hw = Hardware(f"cpu ({t} simulated devices, calibrated)", flops, hbm, 1.0, bus, alpha, bus, alpha)
    raw = {"gemm_n": GEMM_N, "gemm_s": gemm_s, "gemm_flops_per_s": flops, "stream_bytes": STREAM_BYTES,
           "stream_s": stream_s, "memory_bytes_per_s": hbm, "allreduce_devices": t,
           "allreduce_bytes": list(REDUCE_BYTES), "allreduce_s": [t1, t2], "allreduce_bus_bytes_per_s": bus,
           "allreduce_alpha_s": alpha, "dtype": dtype}
    return hw, raw


def shared_rates(hw: Hardware, devices: int) -> Hardware:
    """One device's share of the machine when `devices` simulated devices run at once."""
    n = max(devices, 1)
    return replace(hw, peak_flops=hw.peak_flops / n, hbm_bytes_per_s=hw.hbm_bytes_per_s / n)


__all__ = ["calibrate", "shared_rates"]
