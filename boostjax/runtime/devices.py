"""Simulated CPU devices: a mesh of N devices on a machine without accelerators.

XLA reads the device count once, when JAX's CPU backend starts, so this must run before any JAX
computation (the CLI calls it before importing JAX; in a notebook call it in the first cell).
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import re
import sys
from importlib.metadata import entry_points

import jax
from jax._src import xla_bridge

from boostjax.config import ConfigError, MeshShape

_FLAG = "--xla_force_host_platform_device_count"
# Simulated CPU devices: tests and experiments use up to 8 (a TP8 projection, data x model = 2 x 4);
# each costs memory and a thread when JAX starts, and a typo (`data=100000`) would exhaust the host.
MAX_SIMULATED_DEVICES: int = 64
CAP_VAR = "BOOSTJAX_MAX_CPU_DEVICES"  # raises the cap for a deliberate larger simulation
_ACCELERATOR_MODULES = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")


def simulated_device_cap() -> int:
    """The most CPU devices `simulate_devices` creates: `MAX_SIMULATED_DEVICES`, or `$BOOSTJAX_MAX_CPU_DEVICES`."""
    raw = os.environ.get(CAP_VAR, "").strip()
    if not raw:
        return MAX_SIMULATED_DEVICES
    if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
        raise ConfigError(f"{CAP_VAR}: {raw!r} is not a positive integer; fix: export {CAP_VAR}=N or unset it")
    return int(raw)


def accelerator_installed() -> bool:
    """Whether JAX could start a GPU/TPU backend here, decided without starting JAX: `JAX_PLATFORMS`
    allows one and a PJRT plugin (the `jax_plugins` namespace or entry points, CUDA/ROCm plugin
    packages) or libtpu is installed."""
    platforms = [p.strip().lower() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms and all(p == "cpu" for p in platforms):
        return False
    if any(importlib.util.find_spec(m) is not None for m in _ACCELERATOR_MODULES):
        return True
    try:
        import jax_plugins  # noqa: PLC0415 (a namespace package: importing it starts nothing)

        if any(True for _ in pkgutil.iter_modules(jax_plugins.__path__)):
            return True
    except ImportError:
        pass

    return bool(list(entry_points(group="jax_plugins")))


def simulate_devices(n: int, name: str = "simulate_devices") -> int:
    """Ask for at least `n` CPU devices when no accelerator is present; returns the count in force.

    A no-op (returning the current count) once JAX's backend is running with enough devices; an
    error if it is running with too few, since the count can no longer change in this process.
    More than `simulated_device_cap()` devices are refused (`ConfigError` naming `name`) before JAX
    is touched, unless an accelerator backend is installed: then nothing is simulated and the mesh
    is checked against the devices JAX finds (`boostjax.sharding.mesh.make_mesh`).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{name}: need a device count >= 1, got {n!r}; fix: pass a positive integer")
    cap = simulated_device_cap()
    if n > cap:
        if accelerator_installed():
            return n  # the accelerator's own devices: the mesh is checked against them, nothing simulated
        raise ConfigError(f"{name}: {n} devices requested, but this machine has no accelerator and simulates at "
                          f"most {cap} CPU devices; fix: use a mesh of at most {cap} devices "
                          f"(or export {CAP_VAR}=N to simulate more)")
    if "jax" in sys.modules and _backend_started():
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
        return bool(xla_bridge._backends)
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


def simulate_for_mesh(mesh: MeshShape | None, name: str = "train.mesh") -> int:
    """`simulate_devices` for the mesh's device count (None: one device); errors name `name`."""
    n = mesh.devices if mesh is not None else 1
    return simulate_devices(n, name) if n > 1 else n
