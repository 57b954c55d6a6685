"""Named hardware profiles (the offload planner's costs, the MFU of `boostjax.training.observe`,
`--hardware`) and `check_hardware` for `--hardware`: plain numbers, no JAX, so the command line lists
them while building its parser. `boostjax.runtime.hardware` adds `measure()` for the device JAX runs on;
the sources of every number are in its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from boostjax.config import ConfigError

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator and its host link. Rates are bytes/s and FLOP/s; sizes are bytes."""

    name: str
    device_bytes: int
    bf16_flops: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    host_bytes: int
    nvme_bytes: int = 0
    nvme_bytes_per_s: float = 0.0
    mfu: float = 0.5
    # the auto planner's time model (`boostjax.planning`): stated datasheet / NCCL figures, not measured
    hbm_bytes_per_s: float = 0.0  # nominal device-memory bandwidth
    bus_bytes_per_s: float = 0.0  # all-reduce bus bandwidth inside a node (NVLink / PCIe, large messages)
    inter_bytes_per_s: float = 0.0  # per device between nodes (InfiniBand / Slingshot)
    alpha_s: float = 15e-6  # per-collective latency
    gemm_efficiency: float = 0.8  # fraction of bf16 peak a compute-bound GEMM reaches (the scaling model fits
    # 0.80 on BOOST's 1B A100 iteration time: experiments/tp/scaling_model.py)

    @property
    def flops_per_s(self) -> float:
        """The rate the cost model charges compute at: `bf16_flops * mfu`."""
        return self.bf16_flops * self.mfu

    def with_mfu(self, mfu: float) -> "HardwareProfile":
        if not 0.0 < mfu <= 1.0:
            raise ValueError(f"mfu: {mfu} outside (0, 1]; fix: pass the achievable fraction, e.g. 0.5")
        return replace(self, mfu=mfu)


_GEN5_EFFECTIVE = 12e9  # LazyTrain's effective PCIe Gen5 x16 rate
_GEN4_EFFECTIVE = 20e9  # assumption, see the module docstring

PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        HardwareProfile("H800-80GB", 81559 * MiB, 989.4e12, _GEN5_EFFECTIVE, _GEN5_EFFECTIVE, 1024 * GiB,
                        hbm_bytes_per_s=3.35e12, bus_bytes_per_s=160e9, inter_bytes_per_s=50e9),
        HardwareProfile("H200-141GB", 143771 * MiB, 989.4e12, _GEN5_EFFECTIVE, _GEN5_EFFECTIVE, 2048 * GiB,
                        hbm_bytes_per_s=4.8e12, bus_bytes_per_s=360e9, inter_bytes_per_s=50e9),
        HardwareProfile("A100-40GB", 40960 * MiB, 312e12, _GEN4_EFFECTIVE, _GEN4_EFFECTIVE, 1024 * GiB,
                        hbm_bytes_per_s=1.555e12, bus_bytes_per_s=200e9, inter_bytes_per_s=25e9),
        HardwareProfile("A100-80GB", 81920 * MiB, 312e12, _GEN4_EFFECTIVE, _GEN4_EFFECTIVE, 1024 * GiB,
                        hbm_bytes_per_s=2.039e12, bus_bytes_per_s=200e9, inter_bytes_per_s=25e9),
        HardwareProfile("RTX3090-24GB", 24576 * MiB, 71e12, _GEN4_EFFECTIVE, _GEN4_EFFECTIVE, 128 * GiB,
                        nvme_bytes=2_000_000_000_000, nvme_bytes_per_s=5e9, hbm_bytes_per_s=936e9,
                        bus_bytes_per_s=16e9, inter_bytes_per_s=12.5e9),
    )
}

ALIASES: dict[str, str] = {"h800": "H800-80GB", "h100": "H800-80GB", "h200": "H200-141GB", "a100": "A100-80GB",
            "a100-40gb": "A100-40GB", "a100-80gb": "A100-80GB", "3090": "RTX3090-24GB",
            "rtx3090": "RTX3090-24GB"}


def get_profile(name: str) -> HardwareProfile:
    """A profile by name (case-insensitive; short aliases like `h800`, `a100`, `3090` work)."""
    key = name.strip()
    by_lower = {k.lower(): v for k, v in PROFILES.items()}
    if key.lower() in by_lower:
        return by_lower[key.lower()]
    if key.lower() in ALIASES:
        return PROFILES[ALIASES[key.lower()]]
    raise ValueError(f"hardware: unknown profile {name!r}; fix: use one of {', '.join(PROFILES)} "
                     f"(aliases: {', '.join(sorted(ALIASES))}) or measure()")


# `jax.Device.device_kind` substrings (lower case) -> profile; checked in order (the 40GB A100 before the A100)
_DEVICE_KINDS = (("h200", "H200-141GB"), ("h100", "H800-80GB"), ("h800", "H800-80GB"),
                 ("a100-sxm4-40gb", "A100-40GB"), ("a100-pcie-40gb", "A100-40GB"), ("a100", "A100-80GB"),
                 ("rtx 3090", "RTX3090-24GB"))


def profile_for_device(device_kind: str) -> HardwareProfile | None:
    """The profile of a JAX device kind (`'NVIDIA H100 80GB HBM3'`, `'NVIDIA A100-SXM4-40GB'`, ...);
    None for a device without one (a CPU, a GPU or TPU not listed in `PROFILES`)."""
    kind = device_kind.lower()
    return next((PROFILES[name] for key, name in _DEVICE_KINDS if key in kind), None)


def check_hardware(name: str) -> None:
    """--hardware names a known profile (or an alias); '' (detect the device) is checked where it runs."""
    try:
        get_profile(name)
    except ValueError as e:
        why = str(e).split("; fix:")[0].removeprefix("hardware: ")
        raise ConfigError(f"train.hardware: {why}; fix: pass one of {', '.join(PROFILES)} (or an alias: "
                          f"{', '.join(sorted(ALIASES))}), or '' to detect the device") from None


__all__ = ["ALIASES", "GiB", "MiB", "PROFILES", "HardwareProfile", "check_hardware", "get_profile",
           "profile_for_device"]
