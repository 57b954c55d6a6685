"""Named hardware profiles (the offload planner's costs, the MFU of `boostjax.training.observe`, `--hardware`), and
`measure()` for the device JAX runs on; `check_hardware` for `--hardware`. The table itself lives in
`boostjax.runtime.profiles` (no JAX: the command line lists it), re-exported here.

Numbers are per GPU; every figure's source and assumption (memory, BF16 peak, host link, host RAM,
NVMe, MFU, and the auto planner's HBM, bus, inter-node and latency figures): docs/planning.md
("Hardware profiles").
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from boostjax.runtime.profiles import (ALIASES, GiB, MiB, PROFILES, HardwareProfile, check_hardware, get_profile,
                                       profile_for_device)


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up (compilation, first-touch allocation)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _host_ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def measure(n_bytes: int = 64 << 20, matmul_n: int | None = None, repeats: int = 3,
            mfu: float = 0.5, device=None) -> HardwareProfile:
    """Time host->device, device->host and a bf16 matmul on the (default) JAX device.

    Transfers use `pinned_host` -> `device` memory kinds where the backend has both (GPU, recent CPU
    backends), else a plain numpy array -> device copy and back. On CPU the numbers are real but say
    nothing about an accelerator. `bf16_flops` is the measured matmul rate; `mfu` is applied on top.
    """

    if n_bytes < 4096:
        raise ValueError(f"n_bytes: {n_bytes} is too small to time; fix: pass at least 4096 (default 64 MiB)")
    dev = device if device is not None else jax.devices()[0]
    host_np = np.ones(n_bytes // 4, np.float32)
    kinds = {m.kind for m in dev.addressable_memories()}
    if {"pinned_host", "device"} <= kinds:
        to_host = SingleDeviceSharding(dev, memory_kind="pinned_host")
        to_dev = SingleDeviceSharding(dev, memory_kind="device")
        x_host = jax.device_put(host_np, to_host).block_until_ready()
        x_dev = jax.device_put(x_host, to_dev).block_until_ready()
        h2d = _best_time(lambda: jax.device_put(x_host, to_dev).block_until_ready(), repeats)
        d2h = _best_time(lambda: jax.device_put(x_dev, to_host).block_until_ready(), repeats)
    else:
        x_dev = jax.device_put(host_np, dev).block_until_ready()
        h2d = _best_time(lambda: jax.device_put(host_np, dev).block_until_ready(), repeats)
        d2h = _best_time(lambda: np.asarray(jax.device_put(x_dev, dev)), repeats)

    n = matmul_n or (4096 if dev.platform == "gpu" else 512)
    a = jnp.ones((n, n), jnp.bfloat16, device=dev)
    mm = jax.jit(lambda x: x @ x)
    rate = 2.0 * n ** 3 / _best_time(lambda: mm(a).block_until_ready(), repeats)

    stats = dev.memory_stats() or {}
    dev_bytes = int(stats.get("bytes_limit", 0)) or _host_ram_bytes()
    nbytes = host_np.nbytes
    return HardwareProfile(name=f"measured:{dev.device_kind}", device_bytes=dev_bytes, bf16_flops=rate,
                           h2d_bytes_per_s=nbytes / h2d, d2h_bytes_per_s=nbytes / d2h,
                           host_bytes=_host_ram_bytes(), mfu=mfu)


__all__ = ["ALIASES", "GiB", "MiB", "PROFILES", "HardwareProfile", "check_hardware", "get_profile", "measure",
           "profile_for_device"]
