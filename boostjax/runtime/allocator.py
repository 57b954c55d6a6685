"""Keep a CPU step's scratch memory from one step to the next (Linux, glibc).

XLA's CPU runtime allocates each execution's temporary buffer (for the 60m training step at batch
4 x 256: one block of 622 MiB) with `malloc` on a worker thread and frees it when the step ends.
glibc serves a request that large from a fresh `mmap` and returns it with `munmap`, so every step
faults the whole block in again, a page at a time, and the kernel zeroes each page: about 169,000
page faults and 0.25 s of system time per step on a 2-core Xeon, which is 10-15 % of the step
(`experiments/speed/lowrank_speed.py` measures the step both ways; see docs/cpu-speed.md).

`keep_scratch_memory` tells glibc to serve every thread from one heap (`M_ARENA_MAX` 1), never to
`mmap` a block of its own (`M_MMAP_MAX` 0) and not to hand freed memory back to the system
(`M_TRIM_THRESHOLD` at its maximum), so the next step reuses the same pages. The price: the process
keeps its peak memory, plus what the heap fragments (about 0.5 GB more resident memory for that
step). It only takes effect before JAX's backend starts (its thread pool's first allocations pick
their heaps), like `devices.simulate_devices`, and only on a CPU-only JAX (with a GPU/TPU plugin the
steps run on the accelerator). `BOOSTJAX_KEEP_SCRATCH=0` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import platform

from boostjax.config import ConfigError
from boostjax.runtime.devices import _backend_started, accelerator_installed

ENV = "BOOSTJAX_KEEP_SCRATCH"
# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
_INT_MAX = 2**31 - 1

_done: bool | None = None  # the outcome of the first call


def wanted() -> bool:
    """`BOOSTJAX_KEEP_SCRATCH`: unset or 1 keeps the scratch memory, 0 leaves glibc's defaults."""
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"{ENV}={value!r}: expected 0 (glibc's default allocation) or 1 (keep the step's "
                          f"scratch memory between steps); fix: export {ENV}=1 or unset it")
    return value == "1"


def keep_scratch_memory() -> bool:
    """Set glibc's allocator up to reuse the step's scratch memory; returns whether it is in force.

    A no-op (False) off glibc, with `BOOSTJAX_KEEP_SCRATCH=0`, where JAX could start a GPU/TPU backend
    (`devices.accelerator_installed`: the steps run there, not in host scratch), or once JAX's backend
    has started (then call it first, before any JAX computation, e.g. at the top of a notebook)."""
    global _done
    keep = wanted()  # read every time, so that a bad value is refused wherever it is read
    if _done is not None:
        return _done
    if (not keep or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or _backend_started()
            or accelerator_installed()):  # the steps run on the accelerator: the host keeps glibc's defaults
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # pragma: no cover - a glibc system without the usual soname
        return False
    # mallopt returns 1 on success; the arena limit first, before any thread picks a heap of its own
    _done = all(libc.mallopt(p, v) == 1 for p, v in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0),
                                                      (M_TRIM_THRESHOLD, _INT_MAX)))
    return _done


def in_force() -> bool:
    """Whether `keep_scratch_memory` has set the allocator up in this process."""
    return bool(_done)
