"""Simulated CPU devices: a mesh of N devices on a machine without accelerators.

XLA reads the device count once, when JAX's CPU backend starts, so this must run before any JAX
computation (the CLI calls it before importing JAX; in a notebook call it in the first cell).
"""

from __future__ import annotations

import os
import re
import sys

_FLAG = "--xla_force_host_platform_device_count"


def simulate_devices(n: int) -> int:
    """Ask for at least `n` CPU devices when no accelerator is present; returns the count in force.

    A no-op (returning the current count) once JAX's backend is running with enough devices; an
    error if it is running with too few, since the count can no longer change in this process.
    """
    if "jax" in sys.modules and _backend_started():
        import jax  # noqa: PLC0415

        have = jax.device_count()
        if have < n:
            raise RuntimeError(
                f"{n} devices needed but JAX already started with {have}; fix: call "
                f"boostjax.simulate_devices({n}) before any JAX computation (e.g. restart the kernel)"
            )
        return have
    flags = os.environ.get("XLA_FLAGS", "")
    m = re.search(_FLAG + r"=(\d+)", flags)
    if m and int(m.group(1)) >= n:
        return int(m.group(1))
    flags = re.sub(_FLAG + r"=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={n}".strip()
    return n


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge  # noqa: PLC0415

        return bool(xla_bridge._backends)  # noqa: SLF001
    except Exception:  # pragma: no cover - private API moved: assume started (safe direction)
        return True


def exact_low_precision() -> bool:
    """Keep bf16 values bf16 in compiled programs (`--xla_allow_excess_precision=false`).

    XLA may otherwise drop a bf16 rounding and keep f32 (the CPU backend also widens bf16
    all-reduces to f32), which hides the bf16 payload of a collective from HLO accounting. Like the
    device count, this only takes effect before JAX's backend starts; returns whether it is in force.
    """
    flag = "--xla_allow_excess_precision=false"
    flags = os.environ.get("XLA_FLAGS", "")
    if flag in flags:
        return True
    if "jax" in sys.modules and _backend_started():
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    return True


def simulate_for_mesh(spec: str) -> int:
    """`simulate_devices` for the product of a `--mesh` string's axis sizes ('' -> 1)."""
    from boostjax.config import parse_mesh  # noqa: PLC0415

    n = 1
    for size in parse_mesh(spec).values():
        n *= size
    return simulate_devices(n) if n > 1 else n
