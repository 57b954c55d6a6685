"""Host offload as an overlay on any placement: an offload plan's remat schedule runs inside the
base placement's loss, and the parameters and optimizer states of the layers the plan sends to
host live in `pinned_host` memory, with the base placement's layout (`NamedSharding.with_memory_kind`).
The step moves them to device memory and back inside the jitted program (`base.to_device`/`to_home`).

On a `stage` mesh the plan covers one stage's layers (every stage applies it to its own), and a
pipeline stacks each parameter's layers into one array: that array lives on host when the plan puts
all of the stage's layers there (`boostjax plan --mesh ... stage=P` plans them alike, and
`boostjax.offload.check_plan_for` refuses a plan that does not).
See `boostjax.offload.apply` for what a plan's decisions turn into and what the CPU backend does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boostjax.config import DATA
from boostjax.offload.apply import SLOP_FLAG, gpu_scheduler_options
from boostjax.offload.planfile import Plan
from boostjax.placement.base import DEVICE, HOST, Placement, Role, on_host
from boostjax.runtime.profiles import profile_for_device


def _layer_key(path) -> int | str | None:
    """The layer a leaf belongs to: its index under `layers/<k>/...`, "stacked" for a pipeline's
    stacked layers (`layers/<module>/...`), None outside the layers."""
    keys = [getattr(p, "key", getattr(p, "idx", getattr(p, "name", None))) for p in path]
    for a, b in zip(keys, keys[1:]):
        if a == "layers":
            if isinstance(b, (int, np.integer)) or (isinstance(b, str) and b.isdigit()):
                return int(b)
            return "stacked"
    return None


def host_mask(tree: Any, places: tuple[str, ...]) -> Any:
    """Per leaf: True when it belongs to a layer whose place is `host` (a stacked leaf: when every
    layer of the stage is on host)."""
    def home(path, _):
        k = _layer_key(path)
        if k == "stacked":
            return all(p == "host" for p in places)
        return k is not None and places[k] == "host"

    return jax.tree_util.tree_map_with_path(home, tree)


@dataclass(frozen=True)
class Offloaded:
    """`base` with the plan's memory kinds (its loss already runs the plan's remat schedule)."""

    base: Placement
    plan: Plan

    @cached_property
    def mesh(self) -> Mesh:
        """The base's mesh, or a one-device mesh (memory kinds need a `NamedSharding`)."""
        return self.base.mesh if self.base.mesh is not None else Mesh(np.asarray(jax.devices()[:1]), (DATA,))

    @property
    def batch_sharding(self):
        if self.base.mesh is None:
            return NamedSharding(self.mesh, P(), memory_kind=DEVICE)
        return self.base.batch_sharding

    @property
    def micro_sharding(self):
        return self.base.micro_sharding

    @property
    def info(self) -> dict:
        return self.base.info

    @property
    def compiler_options(self) -> dict[str, Any] | None:
        """On CPU, XLA's memory-optimised scheduler: the default CPU scheduler optimises for
        concurrency and keeps recomputed activations alive, undoing remat. On a GPU with a hardware
        profile, when the plan keeps state on the host, the scheduler's memory limit at the plan's
        budget (`apply.gpu_scheduler_options`), unless XLA_FLAGS sets that limit itself."""
        dev = jax.devices()[0]
        if dev.platform == "cpu":
            return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
        prof = profile_for_device(dev.device_kind) if dev.platform == "gpu" else None
        if prof is None or SLOP_FLAG in os.environ.get("XLA_FLAGS", ""):
            return self.base.compiler_options
        return {**(self.base.compiler_options or {}), **gpu_scheduler_options(self.plan, prof.device_bytes)} or None

    def to_state(self, params: Any) -> Any:
        return self.base.to_state(params)

    def to_canonical(self, params: Any) -> Any:
        """The base's canonical params, each in the memory it lives in. Where the base re-lays them out
        (a pipeline's stacked layers indexed apart; a gather cannot read `pinned_host` memory), host
        leaves go through device memory and back: the re-layout runs on a tree of flags (zero-copy
        broadcast views) too, which says where each canonical leaf lives."""
        homes = jax.tree.map(lambda x: bool(getattr(x, "sharding", None) and on_host(x.sharding)), params)
        flags = jax.tree.map(lambda x, h: np.broadcast_to(np.bool_(h), np.shape(x)), params, homes)
        moved = self.base.to_canonical(flags)
        if moved is flags or not any(jax.tree.leaves(homes)):  # nothing re-laid out, or nothing on host
            return self.base.to_canonical(params)
        on_device = jax.tree.map(lambda x, h: jax.device_put(x, x.sharding.with_memory_kind(DEVICE)) if h else x,
                                 params, homes)
        return jax.tree.map(lambda x, f: jax.device_put(x, x.sharding.with_memory_kind(HOST)) if f.flat[0] else x,
                            self.base.to_canonical(on_device), moved)

    @property
    def axes(self) -> Any:
        return self.base.axes

    def param_specs(self, state_like: Any) -> Any:
        return self.base.param_specs(state_like)

    def place(self, role: Role, specs: Any, like: Any) -> Any:
        if role == "grads":
            return self.base.place(role, specs, like)
        if self.base.mesh is None:
            homes = jax.tree.map(lambda _: NamedSharding(self.mesh, P()), like)
        else:
            homes = self.base.place(role, specs, like)
        places = self.plan.param_place if role == "params" else self.plan.opt_place
        return jax.tree.map(lambda s, h: s.with_memory_kind(HOST if h else DEVICE), homes, host_mask(like, places))

    @property
    def loss_fn(self):
        return self.base.loss_fn

    @property
    def grad_fn(self):
        return self.base.grad_fn
