"""The placement protocol: how a training step's parameters, optimizer state and batches are laid
out on devices (and in which memory), and the loss to differentiate there.

One implementation per kind of layout: `SingleDevice`, `TensorParallel` (a `data x model` mesh),
`Pipeline` (`data x stage x model`), and `Offloaded`, an overlay that puts an offload plan's
memory kinds and remat schedule on top of any of them. `boostjax.placement.choose` picks one.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Callable, Literal, Protocol

import jax
from jax.sharding import Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from boostjax.offload.apply import DEVICE, HOST
from boostjax.sharding import rules

Role = Literal["params", "opt_state", "grads"]


class Placement(Protocol):
    """Where the training state lives and what the step differentiates.

    `params`/`opt_state` trees are in the *training layout* (`to_state` of the canonical per-layer
    params; a pipeline stacks its layers). `place` turns a tree of `PartitionSpec`s (the
    parameters' from `param_specs`, the optimizer state's from its optimizer) into shardings for
    one role of the state: ZeRO's split over `data` and host memory kinds are the placement's call.
    """

    mesh: Mesh | None
    batch_sharding: Sharding  # the step's global batch (rows: batch x grad_accum)
    micro_sharding: Sharding | None  # gradient accumulation's micro-batches [N, B, ...] (mesh only)
    info: dict  # facts the loop logs (pipeline schedule, bubble fraction)
    compiler_options: dict | None  # XLA options the step is compiled with

    def to_state(self, params: Any) -> Any: ...  # canonical params -> training layout

    def to_canonical(self, params: Any) -> Any: ...  # training layout -> canonical params

    @property
    def axes(self) -> Any: ...  # logical axes per parameter leaf, in the training layout

    def param_specs(self, state_like: Any) -> Any: ...  # PartitionSpec per parameter leaf (from `axes`)

    def place(self, role: Role, specs: Any, like: Any) -> Any: ...  # sharding per leaf (None: unconstrained)

    def loss_fn(self, params: Any, batch: dict) -> jax.Array: ...  # mean loss; params in device memory

    # (params, batch) -> (loss, grads), the gradient already reduced over `data` onto the "grads"
    # shardings and the batch's `grad_accum` micro-batches summed (ZeRO's reduce-scatter), or None:
    # the step differentiates `loss_fn`
    grad_fn: Callable[[Any, dict], tuple[jax.Array, Any]] | None


class Canonical:
    """Mixin of the placements that train the canonical per-layer layout (all but a pipeline's)."""

    cfg: Any

    def to_state(self, params: Any) -> Any:
        return params

    def to_canonical(self, params: Any) -> Any:
        return params

    @cached_property
    def axes(self) -> Any:
        """The logical axes of every parameter, as the model declares them."""
        return rules.logical_axes(self.cfg.model)


def is_spec(x: Any) -> bool:
    return isinstance(x, P)


def on_host(sharding: Any) -> bool:
    return getattr(sharding, "memory_kind", None) == HOST


def to_device(tree: Any, shardings: Any) -> Any:
    """Inside jit: the leaves that live in host memory, moved to device memory (same layout)."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind(DEVICE)) if on_host(s) else x,
                        tree, shardings)


def to_home(tree: Any, shardings: Any) -> Any:
    """Inside jit: the leaves that live in host memory, written back there."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s) if on_host(s) else x, tree, shardings)


def named(mesh: Mesh, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)
