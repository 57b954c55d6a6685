"""Named hardware profiles (the offload planner's costs, the MFU of `boostjax.training.observe`, `--hardware`), and
`measure()` for the device JAX runs on; `check_hardware` for `--hardware`. The table itself lives in
`boostjax.runtime.profiles` (no JAX: the command line lists it), re-exported here.

Numbers are per GPU. Sources and assumptions:
- `device_bytes`: the total that `nvidia-smi` reports (H100/H800 80GB 81559 MiB, H200 143771 MiB,
  A100 40GB 40960 MiB, A100 80GB 81920 MiB, RTX 3090 24576 MiB).
- `bf16_flops`: dense (no sparsity) BF16 tensor-core peak from the vendor data sheets: H100/H800 SXM
  989.4 TFLOPS, H200 SXM 989.4 TFLOPS (same GH100 compute as H100), A100 312 TFLOPS. RTX 3090: the
  GA102 whitepaper lists 71 TFLOPS dense FP16/BF16 with FP32 accumulate (GeForce runs FP32-accumulate
  tensor ops at half rate; 142 TFLOPS is the FP16-accumulate figure), and training accumulates in FP32.
- Host link: LazyTrain's setting takes PCIe Gen5 x16 at about 12 GB/s effective each way for H800/H200
  (LazyTrain's measured value, far below the 64 GB/s nominal). For the PCIe Gen4 x16 parts (A100,
  RTX 3090) we assume 20 GB/s each way, the usual pinned-memory `cudaMemcpy` measurement on Gen4 x16
  (nominal 32 GB/s; 12-25 GB/s is the range seen in practice).
- `host_bytes`: assumed host RAM available to the one training process (1 TiB on the data-centre
  servers, 2 TiB for H200 nodes, 128 GiB for an RTX 3090 workstation).
- NVMe: only the workstation profile lists one (2 TB PCIe Gen4 SSD, 5 GB/s). The planner does not place
  tensors on NVMe: JAX has no disk memory kind (`device`, `pinned_host`, `unpinned_host` only).
- `mfu`: the achievable fraction of `bf16_flops` that turns FLOPs into seconds in the cost model.
- The auto planner's links (`boostjax.planning`), nominal figures: HBM 3.35 TB/s (H800 SXM), 4.8 TB/s (H200),
  1.555 / 2.039 TB/s (A100 40 / 80 GB), 936 GB/s (RTX 3090); all-reduce bus bandwidth inside a node
  (NCCL's large-message figure) 200 GB/s on A100 NVLink3, 360 GB/s on H200 NVLink4/NVSwitch, 160 GB/s on
  H800 (its NVLink is cut to 400 GB/s), 16 GB/s over PCIe Gen4 between RTX 3090s; between nodes per GPU
  25 GB/s (A100: Slingshot/HDR-class), 50 GB/s (H800, H200: InfiniBand NDR), 12.5 GB/s (3090: 100 Gb/s
  Ethernet); collective latency 15 us; GEMM efficiency 0.8 (the scaling model fits 0.80 on BOOST's 1B
  A100 time). The planner's CPU profile is measured instead (`boostjax.planning.cpu`).
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
