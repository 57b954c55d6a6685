"""One training step: loss -> gradients -> optimizer update, jitted and compiled ahead of time.

`build_step_fns` picks the loss function for the configured parallel strategy (one device, or a
`shard_map` TP strategy from `boostjax.sharding`) and the optimizer, and returns the pieces the
training loop needs. Parameters stay fp32; with `dtype="bfloat16"` they are cast for the compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boostjax.config import Config, ConfigError
from boostjax.optim import baselines, delay, rotation, schedule


@dataclass(frozen=True)
class StepFns:
    init: Callable[[Any], tuple[Any, Any]]  # fp32 params -> (placed params, optimizer state)
    compile: Callable[[Any, Any, dict], Callable]  # -> step(params, opt_state, batch) -> (p, s, metrics)
    eval_loss: Callable[[Any, dict], jax.Array]
    put_batch: Callable[[dict], dict]  # this process's rows -> the global batch on the mesh
    loss_fn: Callable[[Any, dict], jax.Array]
    batch_share: tuple[int, int] = (0, 1)  # (index, count): the block of batch rows this process loads
    to_canonical: Callable[[Any], Any] = lambda p: p  # training-layout params -> per-layer params
    info: dict = field(default_factory=dict)  # the placement's facts (pipeline schedule, bubble fraction)


def cast_params(params: Any, dtype: str) -> Any:
    """Floating parameters in the compute dtype (fp32 master copies stay untouched)."""
    if dtype == "float32":
        return params
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda p: p.astype(dt) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def local_loss_fn(cfg: Config, graphdef) -> Callable[[Any, dict], jax.Array]:
    """Mean next-token cross-entropy on one device (the reference every parallel path matches)."""

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, cast_params(params, cfg.train.dtype))
        return model.loss(batch["inputs"], batch["targets"], remat=cfg.train.remat)

    return loss_fn


# grouped low-rank tensors: the axis that stacks independent matrices (a_qkv [d, 3, r], b_kv [2, r, k·e], ...)
GROUP_AXIS: dict[str, int] = {"a_qkv": 1, "a_gate_up": 1, "b_kv": 0, "b_gate_up": 0}


def rotation_mask(params: Any) -> Any:
    """What the rotation optimizer rotates: every 2-D weight matrix (True) and each matrix of the
    grouped 3-D low-rank tensors (their group axis, an int); embeddings, head and norms use AdamW."""
    def rotate(path, p):
        name = str(getattr(path[-1], "key", path[-1]))
        if str(getattr(path[0], "key", path[0])) in ("embed", "head"):
            return False
        return GROUP_AXIS[name] if p.ndim == 3 and name in GROUP_AXIS else p.ndim == 2

    return jax.tree_util.tree_map_with_path(rotate, params)


def make_optimizer(cfg: Config, params_like: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The configured optimizer (with clipping) and its learning-rate schedule."""
    t = cfg.train
    lr_fn = schedule.lr_schedule(t)
    if t.optimizer == "adam8bit":
        from boostjax.optim.adam8bit import adam8bit  # noqa: PLC0415

        return adam8bit(lr_fn, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, clip=t.clip), lr_fn
    stages = delay.assign_stages(params_like, cfg.model.n_layers, t.pipeline_delay)
    tx = baselines.make_optimizer(
        t.optimizer, lr=lr_fn, weight_decay=t.weight_decay, b1=t.b1, b2=t.b2, clip=t.clip,
        stages_tree=stages, n_stages=t.pipeline_delay, t_c=t.delay_lr_tc, source=t.rot_source,
        geometry=t.rot_geometry, refresh_every=t.rot_refresh, stage_aware_refresh=t.stage_aware_refresh,
        basis_beta=t.rot_beta, max_dim=t.rot_max_dim, rotation_mask=rotation_mask(params_like),
    )
    return tx, lr_fn


def _step_count(opt_state) -> jax.Array:
    counts = [x for p, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]
              if getattr(p[-1], "name", None) == "count"]
    return counts[0] if counts else jnp.zeros((), jnp.int32)


def make_train_step(loss_fn, tx: optax.GradientTransformation, lr_fn: optax.Schedule, *, delayed: bool = False,
                    fetch: Callable | None = None, store: Callable | None = None):
    """`step(params, opt_state, batch) -> (params, opt_state, metrics)`.

    With `delayed`, `opt_state` is `(optimizer state, DelayState)`: the gradient is taken at the
    per-stage stale weights (asynchronous pipeline emulation) and applied to the current ones.
    `fetch(params, opt_state)` / `store(params, opt_state)` (an offload plan) move host-resident
    state to device memory before the step and back after it, inside the jitted step.
    """
    def step(params, opt_state, batch):
        if fetch is not None:
            params, opt_state = fetch(params, opt_state)
        tx_state, dstate = opt_state if delayed else (opt_state, None)
        lr = lr_fn(_step_count(tx_state))
        at = delay.delayed_params(dstate) if delayed else params
        loss, grads = jax.value_and_grad(loss_fn)(at, batch)
        updates, tx_state = tx.update(grads, tx_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr}
        opt_state = (tx_state, delay.delay_push(dstate, params)) if delayed else tx_state
        if store is not None:
            params, opt_state = store(params, opt_state)
        return params, opt_state, metrics

    return step


def state_shardings(abstract_state: Any, params: Any, specs: Any, mesh) -> Any:
    """Shardings for optimizer (and delay) state on the parameters' mesh.

    A state leaf whose key path ends with a parameter's path takes that parameter's spec when the
    shapes agree (Adam moments), or the spec behind leading replicated axes when it stacks copies of
    the parameter (delay histories); everything else (counters, rotation bases) is replicated.
    Fixing them at init keeps every step's output, and a restored checkpoint, on the same layout.
    """
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    by_path = {tuple(map(str, path)): (leaf.shape, spec) for (path, leaf), spec in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(specs, is_leaf=is_spec))}

    def sharding(path, leaf):
        keys = tuple(map(str, path))
        if any(k.lstrip(".") in rotation.REPLICATED_FIELDS for k in keys):
            return NamedSharding(mesh, P())
        for n in range(len(keys), 0, -1):
            hit = by_path.get(keys[-n:])
            if hit is not None:
                shape, spec = hit
                extra = len(leaf.shape) - len(shape)
                if extra >= 0 and tuple(leaf.shape[extra:]) == tuple(shape):
                    return NamedSharding(mesh, P(*([None] * extra), *spec))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(sharding, abstract_state)


def build_step_fns(cfg: Config, graphdef, params_like: Any) -> StepFns:
    """Step functions for `cfg.train.strategy` (one device when "none" and no mesh)."""
    from boostjax.sharding import strategies  # noqa: PLC0415 (sharding imports models)

    if cfg.train.offload_plan:  # one device; the plan places state in host memory and sets the remat
        from boostjax.offload.apply import offload_placement  # noqa: PLC0415

        plan: Any = offload_placement(cfg, graphdef)
        fetch, store, eval_fn = plan.fetch, plan.store, plan.eval_loss_fn
    else:
        plan = strategies.placement(cfg, graphdef, params_like)
        fetch = store = None
        eval_fn = plan.loss_fn
    to_state = getattr(plan, "to_state", None)  # a pipeline keeps its layers stacked
    state_like = jax.eval_shape(to_state, params_like) if to_state else params_like
    tx, lr_fn = make_optimizer(cfg, state_like)
    loss_fn = plan.loss_fn
    n_stages = cfg.train.pipeline_delay
    step = make_train_step(loss_fn, tx, lr_fn, delayed=n_stages > 1, fetch=fetch, store=store)

    on_device = (lambda p: fetch(p, ())[0]) if fetch else (lambda p: p)

    def init_state(params):
        opt_state = tx.init(on_device(params))
        if n_stages > 1:
            stages = delay.assign_stages(params, cfg.model.n_layers, n_stages)
            opt_state = (opt_state, delay.delay_init(on_device(params), stages, n_stages))
        return opt_state

    def init(params):
        params = plan.put_params(params)
        if fetch:
            return params, plan.put_opt_state(jax.jit(init_state)(params))
        if plan.mesh is None:
            return params, jax.jit(init_state)(params)
        out = state_shardings(jax.eval_shape(init_state, params), params, plan.specs, plan.mesh)
        return params, jax.jit(init_state, out_shardings=out)(params)

    put_batch, share = plan.put_batch, (0, 1)
    if jax.process_count() > 1:  # each process holds its rows only: assemble the global batch
        from boostjax import multihost  # noqa: PLC0415

        b_shard = getattr(plan, "batch_sharding", None)
        if b_shard is None:
            raise ConfigError("train.mesh: a multi-host job needs a mesh over all processes' devices; "
                              "fix: pass --mesh data=D,model=T")
        share = multihost.batch_share(b_shard, cfg.train.batch, cfg.train.seq)
        put_batch = multihost.put_global_batch(b_shard, cfg.train.batch)

    def compile_step(params, opt_state, batch):
        kw = {}
        if plan.mesh is not None and not fetch:  # every step returns the state in the layout it got it
            shardings = lambda tree: jax.tree.map(lambda a: a.sharding, tree)  # noqa: E731
            kw["out_shardings"] = (shardings(params), shardings(opt_state), NamedSharding(plan.mesh, P()))
        lowered = jax.jit(step, donate_argnums=(0, 1), **kw).lower(params, opt_state, put_batch(batch))
        return lowered.compile(compiler_options=getattr(plan, "compiler_options", None))

    return StepFns(init=init, compile=compile_step, eval_loss=jax.jit(eval_fn), put_batch=put_batch,
                   loss_fn=eval_fn, batch_share=share,
                   to_canonical=getattr(plan, "to_canonical", None) or (lambda p: p),
                   info=dict(getattr(plan, "info", {})))
