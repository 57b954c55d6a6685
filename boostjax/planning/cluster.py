"""`--cluster NODESxDEVICES:HARDWARE`: the machines a plan is made for, and the rates its time model charges.

`parse_cluster("2x8:A100-80GB")` is two nodes of eight A100s; the hardware is a profile of
`boostjax.runtime.profiles` (or an alias), or `cpu`: this machine's simulated CPU devices, whose rates
are measured by `boostjax.planning.cpu.calibrate` (they share the machine's cores). Devices are laid
out as `boostjax train` builds its mesh: `model` innermost, then `stage`, then `data`, so an axis
stays inside a node while its span (size x the sizes inside it) is at most the devices per node.
"""

from __future__ import annotations

from dataclasses import dataclass

from boostjax.config import ConfigError
from boostjax.planning.costs import Hardware
from boostjax.runtime.profiles import ALIASES, PROFILES, HardwareProfile, get_profile

CPU = "cpu"
MAX_DEVICES = 1 << 16


@dataclass(frozen=True)
class Cluster:
    nodes: int
    per_node: int
    hardware: str  # a profile name, or "cpu"

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node

    @property
    def is_cpu(self) -> bool:
        return self.hardware == CPU

    @property
    def text(self) -> str:
        return f"{self.nodes}x{self.per_node}:{self.hardware}"

    def crosses_nodes(self, size: int, inner: int) -> bool:
        """An axis of `size` devices with `inner` devices inside each step spans more than one node."""
        return size > 1 and size * inner > self.per_node


def parse_cluster(text: str) -> Cluster:
    """`NODESxDEVICES:HARDWARE` -> Cluster; one-line ConfigError naming --cluster otherwise."""
    fix = "fix: pass --cluster NODESxDEVICES:HARDWARE, e.g. --cluster 2x8:A100-80GB or --cluster 1x8:cpu"
    shape, sep, hw = (text or "").strip().partition(":")
    nodes, x, per = shape.lower().partition("x")
    if not (sep and x and nodes.isdigit() and per.isdigit() and hw.strip()):
        raise ConfigError(f"plan.cluster: cannot read {text!r}; {fix}")
    n, d = int(nodes), int(per)
    if not (1 <= n and 1 <= d and n * d <= MAX_DEVICES):
        raise ConfigError(f"plan.cluster: {text!r} must have >= 1 node of >= 1 device and at most {MAX_DEVICES} "
                          f"devices; {fix}")
    hw = hw.strip()
    if hw.lower() == CPU:
        return Cluster(n, d, CPU)
    try:
        name = get_profile(hw).name
    except ValueError:
        raise ConfigError(f"plan.cluster: unknown hardware {hw!r}; fix: use one of {', '.join(PROFILES)}, an alias "
                          f"({', '.join(sorted(ALIASES))}) or cpu") from None
    return Cluster(n, d, name)


def profile_rates(p: HardwareProfile) -> Hardware:
    """The time model's rates of a named profile (its stated figures: `boostjax.runtime.hardware`)."""
    return Hardware(p.name, p.bf16_flops, p.hbm_bytes_per_s, 0.8, p.bus_bytes_per_s, p.alpha_s,
                    p.inter_bytes_per_s, 10e-6)


__all__ = ["CPU", "Cluster", "parse_cluster", "profile_rates"]
