"""One registry of optimizers: name -> how to build it and how its state is laid out on a mesh.

`build_optimizer(t, params_like)` is the optimizer training uses: global-norm clipping first (fused
into adam8bit), then the named optimizer, the whole chain under `optax.inject_hyperparams` with
ONLY the learning rate injected (the warmup-cosine schedule of `lr_schedule`), so the learning rate
of the last step sits in the state (`current_lr`). `state_specs` gives each state leaf its
PartitionSpec: a leaf shaped like a parameter (a moment) follows that parameter's spec, a leaf that
stacks copies of it (a delay history) follows it behind replicated leading axes, and each optimizer
names the state it keeps replicated (rotation bases / Gram statistics, 8-bit blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import jax
import optax
from jax.sharding import PartitionSpec as P

from boostjax.config import TrainConfig, delay_lr_tc_steps, nesterov_psi
from boostjax.optim.adam8bit import QTensor, adam8bit
from boostjax.optim import rotation
from boostjax.optim.delay import stage_delays
from boostjax.optim.factor_lr import adamw_by_start
from boostjax.optim.muon import muon_adamw
from boostjax.optim.nadam_torch import torch_nadamw
from boostjax.optim.pipedream import clip_by_stage_norm, scale_by_stage_delay, stage_refresh_periods
from boostjax.optim.schedule import lr_schedule


@dataclass(frozen=True)
class Hyper:
    """Every optimizer's hyperparameters (one flat record; each optimizer reads what it uses).

    `stages`: stage id per leaf (`assign_stages`), needed by PipeDream-LR and stage-aware refresh
    when `n_stages > 1`; `rotation_mask`: per leaf False / True / int / tuple of group axes."""

    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip: float = 0.0
    clip_scope: str = "global"
    stages: Any = None
    n_stages: int = 1
    t_c: int = 1000
    nesterov_b1: float = 0.99
    momentum_decay: float = 0.004
    source: str = "second"
    geometry: str = "bilateral"
    refresh_every: int = 10
    stage_aware_refresh: bool = False
    order: str = "previous"
    basis_beta: float = 0.95
    damping: float = rotation.DAMPING
    max_dim: int = 4096
    rotation_mask: Any = None
    factor_roles: Any = None  # per leaf (role, matrix axes): AdamW's factors stepped by their start scale
    muon_beta: float = 0.95
    ns_steps: int = 5
    muon_nesterov: bool = True
    muon_rms: float = 0.2


def _adamw(lr: optax.ScalarOrSchedule, h: Hyper) -> optax.GradientTransformation:
    if h.factor_roles is not None:
        return adamw_by_start(lr, h.b1, h.b2, h.eps, h.weight_decay, h.factor_roles)
    return optax.adamw(lr, h.b1, h.b2, h.eps, weight_decay=h.weight_decay)


def _pipedream_lr(lr: optax.ScalarOrSchedule, h: Hyper) -> optax.GradientTransformation:
    return optax.chain(_adamw(lr, h), scale_by_stage_delay(stage_delays(h.stages, h.n_stages), h.t_c))


def _nesterov(lr: optax.ScalarOrSchedule, h: Hyper) -> optax.GradientTransformation:
    return torch_nadamw(lr, h.nesterov_b1, h.b2, h.eps, weight_decay=h.weight_decay, momentum_decay=h.momentum_decay)


def _rotation(lr: optax.ScalarOrSchedule, h: Hyper) -> optax.GradientTransformation:
    periods = (stage_refresh_periods(h.stages, h.n_stages, h.refresh_every) if h.stage_aware_refresh
               else h.refresh_every)
    return rotation.rotated_adam(lr, h.b1, h.b2, h.eps, h.weight_decay, source=h.source, geometry=h.geometry,
                                 refresh_every=periods, basis_beta=h.basis_beta, max_dim=h.max_dim,
                                 mask=h.rotation_mask, order=h.order, damping=h.damping)


def _adam8bit(lr: optax.ScalarOrSchedule, h: Hyper) -> optax.GradientTransformation:
    return adam8bit(lr, b1=h.b1, b2=h.b2, eps=h.eps, weight_decay=h.weight_decay, clip=h.clip)


def _muon(lr: optax.ScalarOrSchedule, h: Hyper) -> optax.GradientTransformation:
    return muon_adamw(lr, beta=h.muon_beta, ns_steps=h.ns_steps, nesterov=h.muon_nesterov, rms=h.muon_rms,
                      b1=h.b1, b2=h.b2, eps=h.eps, weight_decay=h.weight_decay, mask=h.rotation_mask)


@dataclass(frozen=True)
class OptimizerDef:
    """`make(lr, hyper)`: the optimizer after clipping; `fused_clip`: it clips itself (global norm,
    `hyper.clip`); `needs_stages(hyper)`: it reads `hyper.stages`; `replicated`: state field names
    (a key path entry `.name`) kept replicated on a mesh whatever their shape."""

    summary: str
    make: Callable[[optax.ScalarOrSchedule, Hyper], optax.GradientTransformation]
    fused_clip: bool = False
    needs_stages: Callable[[Hyper], bool] = lambda h: False
    replicated: frozenset[str] = field(default_factory=frozenset)


OPTIMIZERS: dict[str, OptimizerDef] = {
    "adamw": OptimizerDef("AdamW (optax.adamw); PipeDream under --pipeline-delay", _adamw),
    "rotation": OptimizerDef("Adam in a rotated Kronecker eigenbasis (rotated_adam)", _rotation,
                             needs_stages=lambda h: h.stage_aware_refresh, replicated=rotation.REPLICATED_FIELDS),
    "pipedream-lr": OptimizerDef("AdamW, update scaled down by the stage delay (PipeDream-LR)", _pipedream_lr,
                                 needs_stages=lambda h: True),
    "nesterov": OptimizerDef("Nesterov (torch NAdam, mu_t schedule): b1 0.99, decoupled weight decay", _nesterov),
    "adam8bit": OptimizerDef("AdamW with block-wise 8-bit moments and fused clipping", _adam8bit, fused_clip=True,
                             replicated=frozenset(QTensor._fields)),
    "muon": OptimizerDef("Muon (Newton-Schulz, AdamW-matched RMS) on hidden matrices, AdamW on the rest", _muon),
}
# names accepted by `make_optimizer` besides the registry keys (the name a user passed before)
ALIASES: dict[str, str] = {"pipedream": "adamw"}


def _zero_stages(params_like: Any) -> Any:
    return jax.tree.map(lambda _: 0, params_like)


def make(name: str, lr: optax.ScalarOrSchedule, h: Hyper, params_like: Any = None) -> optax.GradientTransformation:
    """The named optimizer with clipping first (when `h.clip > 0`), learning rate `lr` (not injected)."""
    spec = OPTIMIZERS.get(ALIASES.get(name, name))
    if spec is None:
        raise ValueError(f"make_optimizer: unknown optimizer {name!r}; "
                         f"fix: use one of {', '.join([*OPTIMIZERS, *ALIASES])}")
    if h.clip < 0:
        raise ValueError(f"make_optimizer: clip={h.clip} must be >= 0 (0 disables); fix: e.g. clip=1.0")
    stage_clip = h.clip > 0 and h.clip_scope == "stage"
    if h.clip_scope not in ("global", "stage") or (stage_clip and spec.fused_clip):
        raise ValueError(f"make_optimizer: clip_scope={h.clip_scope!r} with {name!r}; fix: 'global', or 'stage' "
                         "with an optimizer that does not fuse its clipping")
    if (spec.needs_stages(h) or stage_clip) and h.stages is None:
        if h.n_stages > 1 or params_like is None:
            raise ValueError(f"make_optimizer: {name!r} with stage information needs stages_tree; "
                             "fix: pass stages_tree=assign_stages(params, n_layers, n_stages) and n_stages")
        h = replace(h, stages=_zero_stages(params_like))  # one stage: every delay is 0
    opt = spec.make(lr, h)
    if h.clip <= 0 or spec.fused_clip:
        return opt
    clip = clip_by_stage_norm(h.stages, h.n_stages, h.clip) if stage_clip else optax.clip_by_global_norm(h.clip)
    return optax.chain(clip, opt)


def hyper(t: TrainConfig, *, rotation_mask: Any = None, stages: Any = None, factor_roles: Any = None) -> Hyper:
    """The hyperparameters of `t` (eps, Nesterov's b1, Muon's β, Newton–Schulz steps, Nesterov flag and RMS
    keep their defaults: not configurable; T_c and Nesterov's momentum decay resolved from the run's
    length, `delay_lr_tc_steps` / `nesterov_psi`)."""
    h0 = Hyper()
    return Hyper(b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, clip=t.clip, clip_scope=t.clip_scope, stages=stages,
                 n_stages=t.pipeline_delay, t_c=delay_lr_tc_steps(t),
                 momentum_decay=nesterov_psi(t, h0.nesterov_b1), source=t.rot_source, geometry=t.rot_geometry,
                 refresh_every=t.rot_refresh, stage_aware_refresh=t.stage_aware_refresh, order=t.rot_order, basis_beta=t.rot_beta,
                 damping=t.rot_damping,
                 max_dim=t.rot_max_dim, rotation_mask=rotation_mask,
                 factor_roles=factor_roles if t.factor_lr == "start-rms" else None)


def build_optimizer(t: TrainConfig, params_like: Any, *, rotation_mask: Any = None,
                    stages: Any = None, factor_roles: Any = None) -> optax.GradientTransformation:
    """The optimizer `t` configures, learning rate injected (`current_lr` reads it back).

    `params_like`: the parameters (or their shapes) in the training layout; `rotation_mask`: per
    leaf False / True / int / tuple of group axes (default: every 2-D leaf); `stages`: stage id per
    leaf (`assign_stages(params_like, n_layers, t.pipeline_delay)`), needed by pipedream-lr and
    stage-aware refresh when `t.pipeline_delay > 1` (one stage: all zero); `factor_roles`: per leaf
    `(role, matrix axes)` (`rules.factor_roles`), read under `t.factor_lr == "start-rms"`."""
    h = hyper(t, rotation_mask=rotation_mask, stages=stages, factor_roles=factor_roles)

    def chain(learning_rate: Any) -> optax.GradientTransformation:
        return make(t.optimizer, learning_rate, h, params_like)

    chain(0.0)  # raise bad names / missing stages now, not inside init
    return optax.inject_hyperparams(chain)(learning_rate=lr_schedule(t))


_INJECTED = tuple(c for c in (getattr(optax, "InjectHyperparamsState", None),
                              getattr(optax, "InjectStatefulHyperparamsState", None)) if c is not None)


def has_lr(opt_state: Any) -> bool:
    """Whether `opt_state` carries an injected learning rate (`current_lr` reads it)."""
    return any(isinstance(x, _INJECTED) for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, _INJECTED)))


def current_lr(opt_state: Any) -> jax.Array:
    """The learning rate of the last step taken (of step 0 right after init) from a state of
    `build_optimizer` (or a tuple holding one, as with the delay state)."""
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, _INJECTED))
             if isinstance(x, _INJECTED)]
    if not found:
        raise ValueError("current_lr: no inject_hyperparams state here; fix: build the optimizer with build_optimizer")
    return found[0].hyperparams["learning_rate"]


def make_optimizer(
    name: str,
    *,
    lr: optax.ScalarOrSchedule = 1e-3,
    stages_tree: Any = None,
    **kw: Any,
) -> optax.GradientTransformation:
    """A named optimizer from keyword hyperparameters (the fields of `Hyper`: b1, b2, eps,
    weight_decay, clip, clip_scope, n_stages, t_c, nesterov_b1, momentum_decay, source, geometry, refresh_every,
    stage_aware_refresh, order, basis_beta, max_dim, rotation_mask, muon_beta, ns_steps, muon_nesterov,
    muon_rms), clipping first when `clip > 0`.

    The Python-API counterpart of `build_optimizer` (which reads a `TrainConfig` and injects the
    learning rate). Names: the registry's, and "pipedream" (= "adamw", delays come from the
    emulation). "pipedream-lr" and stage-aware "rotation" need `stages_tree` and `n_stages`."""
    known = {f.name for f in fields(Hyper)} - {"stages"}
    bad = sorted(set(kw) - known)
    if bad:
        raise TypeError(f"make_optimizer: unknown keyword(s) {bad}; fix: use some of {sorted(known)}")
    return make(name, lr, Hyper(stages=stages_tree, **kw))


def _keys(path: tuple) -> tuple[str, ...]:
    return tuple(map(str, path))


def state_specs(t: TrainConfig, opt_like: Any, params_like: Any, param_specs: Any) -> Any:
    """PartitionSpec per leaf of `opt_like` (the optimizer state, or a tuple of it and a DelayState).

    A leaf whose key path ends with a parameter's path takes that parameter's spec when the shapes
    agree (moments), or that spec behind replicated leading axes when it stacks copies of it (delay
    histories); fields the optimizer names replicated (rotation bases and Gram statistics, 8-bit
    codes and scales), counters, learning rates and everything else get `P()`. ZeRO's split over
    `data` and the NamedShardings are the caller's."""
    spec_def = OPTIMIZERS[ALIASES.get(t.optimizer, t.optimizer)]
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    by_path = {_keys(path): (tuple(leaf.shape), spec) for (path, leaf), spec in zip(
        jax.tree_util.tree_flatten_with_path(params_like)[0], jax.tree.leaves(param_specs, is_leaf=is_spec),
        strict=True)}

    def spec_of(path: tuple, leaf: Any) -> P:
        keys = _keys(path)
        if any(k.lstrip(".") in spec_def.replicated for k in keys):
            return P()
        shape = tuple(leaf.shape)
        for n in range(len(keys), 0, -1):
            hit = by_path.get(keys[-n:])
            if hit is not None:
                p_shape, spec = hit
                extra = len(shape) - len(p_shape)
                if extra >= 0 and shape[extra:] == p_shape:
                    return P(*([None] * extra), *spec)
        return P()

    return jax.tree_util.tree_map_with_path(spec_of, opt_like)
