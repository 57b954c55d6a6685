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
from boostjax.optim import delay, registry, rotation, schedule
from boostjax.sharding.specs import data_sharded


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
        return model.loss(batch["inputs"], batch["targets"], remat=cfg.train.remat, segments=batch.get("segments"))

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
    tx = registry.make_optimizer(
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


def micro_batches(batch: dict, n: int, sharding: Any = None) -> dict:
    """A step's batch `[B·N, ...]` as N micro-batches `[N, B, ...]`: row `b·N + i` is row `b` of
    micro-batch `i`, so each data shard's contiguous rows stay on it (with `sharding` =
    `P(None, "data")` the split moves no data between devices)."""
    def split(x):
        x_nb = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
        return x_nb if sharding is None else jax.lax.with_sharding_constraint(x_nb, sharding)

    return jax.tree.map(split, batch)


def make_train_step(loss_fn, tx: optax.GradientTransformation, lr_fn: optax.Schedule, *, delayed: bool = False,
                    fetch: Callable | None = None, store: Callable | None = None, accum: int = 1,
                    micro_sharding: Any = None, accum_sharding: Any = None):
    """`step(params, opt_state, batch) -> (params, opt_state, metrics)`.

    With `delayed`, `opt_state` is `(optimizer state, DelayState)`: the gradient is taken at the
    per-stage stale weights (asynchronous pipeline emulation) and applied to the current ones.
    `fetch(params, opt_state)` / `store(params, opt_state)` (an offload plan) move host-resident
    state to device memory before the step and back after it, inside the jitted step.
    `accum` N > 1 (gradient accumulation): the batch holds N micro-batches (`micro_batches`); a
    `lax.scan` sums their losses and fp32 gradients (the running sum laid out by `accum_sharding`)
    and the optimizer applies the mean once.
    """
    def value_and_grad(at, batch):
        if accum == 1:
            return jax.value_and_grad(loss_fn)(at, batch)
        keep = (lambda t: t) if accum_sharding is None else (
            lambda t: jax.lax.with_sharding_constraint(t, accum_sharding))

        def add(carry, mb):
            loss_sum, g_sum = carry
            loss, g = jax.value_and_grad(loss_fn)(at, mb)
            g_sum = keep(jax.tree.map(lambda s, x: s + x.astype(jnp.float32), g_sum, g))
            return (loss_sum + loss.astype(jnp.float32), g_sum), None

        zeros = keep(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), at))
        (loss_sum, g_sum), _ = jax.lax.scan(add, (jnp.zeros((), jnp.float32), zeros),
                                            micro_batches(batch, accum, micro_sharding))
        return loss_sum / accum, jax.tree.map(lambda s, p: (s / accum).astype(p.dtype), g_sum, at)

    def step(params, opt_state, batch):
        if fetch is not None:
            params, opt_state = fetch(params, opt_state)
        tx_state, dstate = opt_state if delayed else (opt_state, None)
        lr = lr_fn(_step_count(tx_state))
        at = delay.delayed_params(dstate) if delayed else params
        loss, grads = value_and_grad(at, batch)
        updates, tx_state = tx.update(grads, tx_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr}
        opt_state = (tx_state, delay.delay_push(dstate, params)) if delayed else tx_state
        if store is not None:
            params, opt_state = store(params, opt_state)
        return params, opt_state, metrics

    return step


def state_shardings(abstract_state: Any, params: Any, specs: Any, mesh, zero: int = 0) -> Any:
    """Shardings for optimizer (and delay) state on the parameters' mesh.

    A state leaf whose key path ends with a parameter's path takes that parameter's spec when the
    shapes agree (Adam moments), or the spec behind leading replicated axes when it stacks copies of
    the parameter (delay histories); everything else (counters, rotation bases and Gram statistics,
    8-bit blocks and scales) is replicated. With `zero` >= 1 every leaf then also splits over `data`
    (`specs.data_sharded`): any layout computes the same update (XLA gathers what it needs), but a
    partitioned matmul rounds differently, and the rotation's `eigh` of a rank-deficient Gram matrix
    turns a 1e-7 difference into a different basis of its null space.
    Fixing them at init keeps every step's output, and a restored checkpoint, on the same layout.
    """
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    by_path = {tuple(map(str, path)): (leaf.shape, spec) for (path, leaf), spec in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(specs, is_leaf=is_spec))}
    data = mesh.shape.get("data", 1) if zero else 1

    def spec_of(keys, leaf):
        if any(k.lstrip(".") in rotation.REPLICATED_FIELDS for k in keys):
            return None
        for n in range(len(keys), 0, -1):
            hit = by_path.get(keys[-n:])
            if hit is not None:
                shape, spec = hit
                extra = len(leaf.shape) - len(shape)
                if extra >= 0 and tuple(leaf.shape[extra:]) == tuple(shape):
                    return P(*([None] * extra), *spec)
        return P()

    def sharding(path, leaf):
        spec = spec_of(tuple(map(str, path)), leaf)
        if spec is None:  # a rotation basis or Gram statistic: replicated over model, split over data
            spec = P()
        return NamedSharding(mesh, data_sharded(spec, leaf.shape, data))

    return jax.tree_util.tree_map_with_path(sharding, abstract_state)


@dataclass(frozen=True)
class Layout:
    """Where the training state lives: one function (`step_layout`) for `StepFns` and
    `train_state_shapes`, so what is allocated and what is reported cannot disagree."""

    plan: Any  # the strategy's `Placement`, or an offload plan's `OffloadPlacement`
    tx: optax.GradientTransformation
    lr_fn: optax.Schedule
    init_state: Callable[[Any], Any]  # placed params -> optimizer (and delay) state
    state_like: Any  # the parameters' shapes in the training layout (a pipeline stacks layers)
    opt_like: Any  # the optimizer state's shapes
    params: Any  # sharding per parameter leaf
    opt_state: Any  # sharding per optimizer-state leaf
    batch: Any  # sharding of the step's batch (rows: batch x grad_accum)
    grads: Any = None  # sharding of the accumulated gradients (mesh only)
    micro: Any = None  # sharding of the micro-batches [N, B, ...] (mesh only)


def step_layout(cfg: Config, graphdef, params_like: Any) -> Layout:
    """The placement, optimizer and the sharding of every leaf of params, optimizer state and batch."""
    from boostjax.sharding import strategies  # noqa: PLC0415 (sharding imports models)

    t = cfg.train
    if t.offload_plan:  # one device; the plan places state in host memory and sets the remat
        from boostjax.offload.apply import offload_placement  # noqa: PLC0415

        plan: Any = offload_placement(cfg, graphdef)
    else:
        plan = strategies.placement(cfg, graphdef, params_like)
    fetch = getattr(plan, "fetch", None)
    to_state = getattr(plan, "to_state", None)  # a pipeline keeps its layers stacked
    state_like = jax.eval_shape(to_state or (lambda p: p), params_like)
    tx, lr_fn = make_optimizer(cfg, state_like)
    n_stages = t.pipeline_delay
    on_device = (lambda p: fetch(p, ())[0]) if fetch else (lambda p: p)

    def init_state(params):
        opt_state = tx.init(on_device(params))
        if n_stages > 1:
            stages = delay.assign_stages(params, cfg.model.n_layers, n_stages)
            opt_state = (opt_state, delay.delay_init(on_device(params), stages, n_stages))
        return opt_state

    opt_like = jax.eval_shape(init_state, state_like)
    every = lambda tree, s: jax.tree.map(lambda _: s, tree)  # noqa: E731
    grads = micro = None
    if fetch:
        from boostjax.offload.apply import DEVICE, HOST, host_mask  # noqa: PLC0415

        def homes(tree, places):
            return jax.tree.map(lambda h: plan.sharding(HOST if h else DEVICE), host_mask(tree, places))

        p_shard = homes(state_like, plan.plan.param_place)
        o_shard = homes(opt_like, plan.plan.opt_place)
        b_shard = plan.sharding(DEVICE)
    elif plan.mesh is None:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        p_shard, o_shard, b_shard = every(state_like, one), every(opt_like, one), one
    else:
        mesh, data = plan.mesh, plan.mesh.shape["data"]
        is_spec = lambda x: isinstance(x, P)  # noqa: E731

        def placed(zeroed: bool):
            return jax.tree.map(lambda s, a: NamedSharding(mesh, data_sharded(s, a.shape, data if zeroed else 1)),
                                plan.specs, state_like, is_leaf=is_spec)

        p_shard = placed(t.zero >= 3)
        o_shard = state_shardings(opt_like, state_like, plan.specs, mesh, t.zero)
        b_shard = plan.batch_sharding
        grads, micro = placed(t.zero >= 1), NamedSharding(mesh, P(None, "data"))
    return Layout(plan, tx, lr_fn, init_state, state_like, opt_like, p_shard, o_shard, b_shard, grads, micro)


def _shapes(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def train_state_shapes(cfg: Config, graphdef, params_like: Any) -> tuple[Any, Any, dict]:
    """(params, optimizer state, batch) as `jax.ShapeDtypeStruct`s carrying the shardings that
    `StepFns.init` and `StepFns.put_batch` give them (nothing is allocated): parameters in the
    training layout (a pipeline's stacked layers), the batch as the step receives it
    (`batch x grad_accum` rows of `seq` tokens, with `segments` under `doc_mask`)."""
    lay = step_layout(cfg, graphdef, params_like)
    t = cfg.train
    rows = jax.ShapeDtypeStruct((t.batch * t.grad_accum, t.seq), jnp.int32, sharding=lay.batch)
    batch = {"inputs": rows, "targets": rows} | ({"segments": rows} if t.doc_mask else {})
    return _shapes(lay.state_like, lay.params), _shapes(lay.opt_like, lay.opt_state), batch


def layout_step(cfg: Config, lay: Layout) -> Callable:
    """The (unjitted) training step on `lay`'s placement, as `StepFns.compile` jits it: lower it with
    `train_state_shapes` to compile the step abstractly."""
    plan = lay.plan
    return make_train_step(plan.loss_fn, lay.tx, lay.lr_fn, delayed=cfg.train.pipeline_delay > 1,
                           fetch=getattr(plan, "fetch", None), store=getattr(plan, "store", None),
                           accum=cfg.train.grad_accum, micro_sharding=lay.micro, accum_sharding=lay.grads)


def build_step_fns(cfg: Config, graphdef, params_like: Any) -> StepFns:
    """Step functions for `cfg.train.strategy` (one device when "none" and no mesh)."""
    lay = step_layout(cfg, graphdef, params_like)
    plan, t = lay.plan, cfg.train
    fetch = getattr(plan, "fetch", None)
    eval_fn = plan.eval_loss_fn if fetch else plan.loss_fn
    step = layout_step(cfg, lay)
    to_state = getattr(plan, "to_state", None) or (lambda p: p)

    def init(params):
        params = jax.device_put(to_state(params), lay.params)
        if fetch:  # host-memory outputs: placed after the jitted init
            return params, jax.device_put(jax.jit(lay.init_state)(params), lay.opt_state)
        return params, jax.jit(lay.init_state, out_shardings=lay.opt_state)(params)

    rows = t.batch * t.grad_accum  # one optimizer step's global batch
    put_batch, share = (lambda b: jax.device_put(b, lay.batch)), (0, 1)
    if jax.process_count() > 1:  # each process holds its rows only: assemble the global batch
        from boostjax import multihost  # noqa: PLC0415

        b_shard = getattr(plan, "batch_sharding", None)
        if b_shard is None:
            raise ConfigError("train.mesh: a multi-host job needs a mesh over all processes' devices; "
                              "fix: pass --mesh data=D,model=T")
        share = multihost.batch_share(b_shard, rows, t.seq)

        def put_batch(batch):  # a step's rows, or an evaluation batch's (batch rows: no accumulation)
            local = len(next(iter(batch.values())))
            return multihost.put_global_batch(b_shard, local * share[1])(batch)

    def compile_step(params, opt_state, batch):
        kw = {}
        if plan.mesh is not None and not fetch:  # every step returns the state in the layout it got it
            kw["out_shardings"] = (lay.params, lay.opt_state, NamedSharding(plan.mesh, P()))
        lowered = jax.jit(step, donate_argnums=(0, 1), **kw).lower(params, opt_state, put_batch(batch))
        return lowered.compile(compiler_options=getattr(plan, "compiler_options", None))

    return StepFns(init=init, compile=compile_step, eval_loss=jax.jit(eval_fn), put_batch=put_batch,
                   loss_fn=eval_fn, batch_share=share,
                   to_canonical=getattr(plan, "to_canonical", None) or (lambda p: p),
                   info=dict(getattr(plan, "info", {})))
