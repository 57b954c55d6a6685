"""One training step: loss -> gradients -> optimizer update, jitted and compiled ahead of time.

`build_step_fns` is a straight line: the placement (`boostjax.placement.choose`) says where the
state lives and what loss to differentiate, the optimizer says how its state is laid out, and the
step (`train_step`) is the same for every placement. Parameters stay fp32; with `dtype="bfloat16"`
they are cast for the compute. With a teacher (`boostjax.training.distill`) the step takes its
parameters as a third argument and the placement's loss is the distillation objective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boostjax.config import Config, ConfigError
from boostjax.runtime.multihost import batch_share, put_global_batch
from boostjax.optim import build_optimizer, current_lr, delay, state_specs
from boostjax.optim.registry import has_lr
from boostjax.placement import Placement, choose, on_host, to_device, to_home
from boostjax.sharding import rules
from boostjax.sharding.zero import micro_batches
from boostjax.training import distill


class TrainState(NamedTuple):
    """Everything a step updates: the update count, the parameters (training layout), the optimizer
    state, and the asynchronous-pipeline emulation's weight history (None without `pipeline_delay`)."""

    step: jax.Array  # int32 scalar: updates applied so far
    params: Any
    opt_state: Any
    delay: delay.DelayState | None = None


@dataclass(frozen=True)
class StepFns:
    init: Callable[[Any], TrainState]  # canonical fp32 params -> the placed training state
    compile: Callable[[TrainState, dict], Callable]  # -> step(state, batch) -> (state, metrics)
    eval_loss: Callable[[Any, dict], jax.Array]  # (state.params, batch) -> loss
    put_batch: Callable[[dict], dict]  # this process's rows -> the global batch on the mesh
    loss_fn: Callable[[Any, dict], jax.Array]
    batch_share: tuple[int, int] = (0, 1)  # (index, count): the block of batch rows this process loads
    to_canonical: Callable[[Any], Any] = lambda p: p  # training-layout params -> per-layer params
    info: dict = field(default_factory=dict)  # the placement's facts (pipeline schedule, bubble fraction)
    # (state, batch) -> the step traced for them; calling it compiles (`compile` is both at once)
    lower: Callable[[TrainState, dict], Callable[[], Callable]] | None = None
    teacher: dict = field(default_factory=dict)  # the placed teacher's memory (`distill.memory`); {} without one


def optimizer_for(cfg: Config, pl: Placement, state_like: Any) -> optax.GradientTransformation:
    """The configured optimizer on the placement's training layout: the rotation mask from the
    parameters' logical axes, each leaf's pipeline stage for the delay emulation."""
    t = cfg.train
    stages = delay.assign_stages(state_like, cfg.model.n_layers, t.pipeline_delay)
    return build_optimizer(t, state_like, rotation_mask=rules.rotation_mask(pl.axes), stages=stages,
                           factor_roles=rules.factor_roles(pl.axes))


def train_step(loss_fn, tx: optax.GradientTransformation, *, accum: int = 1,
               micro_sharding: Any = None, accum_sharding: Any = None, homes: TrainState | None = None,
               grad_fn: Callable[[Any, dict], tuple[jax.Array, Any]] | None = None,
               teacher: Callable[[Any, dict], jax.Array] | None = None):
    """`step(state, batch) -> (state, metrics)`, the one step every placement trains with.

    With `state.delay` (asynchronous pipeline emulation) the gradient is taken at the per-stage
    stale weights and applied to the current ones. `homes` (the state's shardings): leaves placed in
    host memory move to device memory before the step and back after it, inside the jitted step.
    `accum` N > 1 (gradient accumulation): the batch holds N micro-batches (`micro_batches`); a
    `lax.scan` sums their losses and fp32 gradients (the running sum laid out by `accum_sharding`)
    and the optimizer applies the mean once. `grad_fn` (`Placement.grad_fn`, ZeRO's reduce-scattered
    gradient) replaces all of it: it takes the whole batch, micro-batches included. `teacher`
    (`distill.forward`): the step is `step(state, batch, teacher_params)`, the batch gets the
    teacher's logits (`"teacher"`, no gradient) and `loss_fn` returns `(loss, {"kl", "ce"})`, both
    in the metrics.
    """
    def one(at, mb):  # (loss, its parts, grads) of one (micro-)batch
        if teacher is None:
            loss, g = jax.value_and_grad(loss_fn)(at, mb)
            return loss, {}, g
        (loss, parts), g = jax.value_and_grad(loss_fn, has_aux=True)(at, mb)
        return loss, parts, g

    def value_and_grad(at, batch):
        if grad_fn is not None:
            loss, g = grad_fn(at, batch)
            return loss, {}, g
        if accum == 1:
            return one(at, batch)
        keep = (lambda t: t) if accum_sharding is None else (
            lambda t: jax.lax.with_sharding_constraint(t, accum_sharding))

        def add(carry, mb):
            loss_sum, parts_sum, g_sum = carry
            loss, parts, g = one(at, mb)
            g_sum = keep(jax.tree.map(lambda s, x: s + x.astype(jnp.float32), g_sum, g))
            parts_sum = jax.tree.map(lambda s, x: s + x.astype(jnp.float32), parts_sum, parts)
            return (loss_sum + loss.astype(jnp.float32), parts_sum, g_sum), None

        zeros = keep(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), at))
        no_parts = {} if teacher is None else {"kl": jnp.zeros((), jnp.float32), "ce": jnp.zeros((), jnp.float32)}
        (loss_sum, parts_sum, g_sum), _ = jax.lax.scan(add, (jnp.zeros((), jnp.float32), no_parts, zeros),
                                                       micro_batches(batch, accum, micro_sharding))
        return (loss_sum / accum, jax.tree.map(lambda s: s / accum, parts_sum),
                jax.tree.map(lambda s, p: (s / accum).astype(p.dtype), g_sum, at))

    def step(state: TrainState, batch, teacher_params=None):
        if homes is not None:
            state = to_device(state, homes)
        if teacher is not None:
            batch = {**batch, "teacher": teacher(teacher_params, batch)}
        at = state.params if state.delay is None else delay.delayed_params(state.delay)
        loss, parts, grads = value_and_grad(at, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, **parts, "grad_norm": optax.tree.norm(grads)}
        if has_lr(opt_state):  # `build_optimizer` injects it (optax.inject_hyperparams)
            metrics["lr"] = current_lr(opt_state)
        history = None if state.delay is None else delay.delay_push(state.delay, params)
        state = TrainState(state.step + 1, params, opt_state, history)
        return (state if homes is None else to_home(state, homes)), metrics

    return step


@dataclass(frozen=True)
class Layout:
    """Where the training state lives: one function (`step_layout`) for `StepFns` and
    `train_state_shapes`, so what is allocated and what is reported cannot disagree."""

    placement: Placement
    tx: optax.GradientTransformation
    init_state: Callable[[Any], TrainState]  # training-layout params -> the whole state
    like: TrainState  # the state's shapes
    homes: TrainState  # the state's shardings (memory kinds included)
    batch: Any  # sharding of the step's batch (rows: batch x grad_accum)
    grads: Any = None  # sharding of the accumulated gradients (mesh only)

    @property
    def hosted(self) -> bool:
        """Whether part of the state lives in host memory (an offload plan)."""
        return any(on_host(s) for s in jax.tree.leaves(self.homes))


def step_layout(cfg: Config, graphdef, params_like: Any, placement: Placement | None = None,
                objective: Callable | None = None) -> Layout:
    """The placement (`placement`, or the one `cfg` asks for), optimizer and the sharding of every
    leaf of the state and the batch. `objective`: the placement's loss (`distill.objective`)."""
    t = cfg.train
    pl = choose(cfg, graphdef, params_like) if placement is None else placement
    if objective is not None:  # `distill.check` refused the placements without one (pipeline, offload)
        pl = dataclasses.replace(pl, objective=objective)  # type: ignore[type-var]
    state_like = jax.eval_shape(pl.to_state, params_like)
    tx = optimizer_for(cfg, pl, state_like)
    pspecs = pl.param_specs(state_like)
    p_homes = pl.place("params", pspecs, state_like)

    def init_state(params) -> TrainState:
        params_dev = to_device(params, p_homes)
        history = None
        if t.pipeline_delay > 1:
            stages = delay.assign_stages(params, cfg.model.n_layers, t.pipeline_delay)
            history = delay.delay_init(params_dev, stages, t.pipeline_delay, t.delay_schedule)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params_dev), history)

    like = jax.eval_shape(init_state, state_like)
    rest = (like.step, like.opt_state, like.delay)
    step_h, opt_h, delay_h = pl.place("opt_state", state_specs(t, rest, state_like, pspecs), rest)
    homes = TrainState(step_h, p_homes, opt_h, delay_h)
    return Layout(pl, tx, init_state, like, homes, pl.batch_sharding, pl.place("grads", pspecs, state_like))


def _shapes(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def train_state_shapes(cfg: Config, graphdef, params_like: Any) -> tuple[TrainState, dict]:
    """(state, batch) as `jax.ShapeDtypeStruct`s carrying the shardings that `StepFns.init` and
    `StepFns.put_batch` give them (nothing is allocated): parameters in the training layout (a
    pipeline's stacked layers), the batch as the step receives it (`batch x grad_accum` rows of
    `seq` tokens, with `segments` under `doc_mask`)."""
    lay = step_layout(cfg, graphdef, params_like)
    t = cfg.train
    rows = jax.ShapeDtypeStruct((t.batch * t.grad_accum, t.seq), jnp.int32, sharding=lay.batch)
    batch = {"inputs": rows, "targets": rows} | ({"segments": rows} if t.doc_mask else {})
    return _shapes(lay.like, lay.homes), batch


def layout_step(cfg: Config, lay: Layout, teacher: Callable | None = None) -> Callable:
    """The (unjitted) training step on `lay`'s placement, as `StepFns.compile` jits it: lower it with
    `train_state_shapes` to compile the step abstractly. `teacher`: `distill.forward`."""
    pl = lay.placement
    return train_step(pl.loss_fn, lay.tx, accum=cfg.train.grad_accum, micro_sharding=pl.micro_sharding,
                      accum_sharding=lay.grads, homes=lay.homes if lay.hosted else None, grad_fn=pl.grad_fn,
                      teacher=teacher)


def jit_step(cfg: Config, lay: Layout, teacher: Callable | None = None) -> Callable:
    """`layout_step` jitted as `StepFns.compile` jits it: the state donated and returned in the layout (and
    memory) it came in, unused inputs kept. Compile it with `lay.placement.compiler_options`."""
    kw = {}
    if lay.placement.mesh is not None:
        kw["out_shardings"] = (lay.homes, NamedSharding(lay.placement.mesh, P()))
    return jax.jit(layout_step(cfg, lay, teacher), donate_argnums=(0,), keep_unused=True, **kw)


def build_step_fns(cfg: Config, graphdef, params_like: Any, placement: Placement | None = None,
                   teacher: distill.Teacher | None = None) -> StepFns:
    """Step functions for `placement`, or the placement `cfg` asks for (one device when no mesh is
    given); a placement built by hand (e.g. `Offloaded` with a `Plan` object) must pass `check`.
    `teacher` (`distill.load`): its params are placed here and every step distils from them."""
    t = cfg.train
    objective = None if teacher is None else distill.objective(t.distill_temperature, t.distill_weight)
    lay = step_layout(cfg, graphdef, params_like, placement, objective)
    pl, homes = lay.placement, lay.homes
    forward = tparams = None
    memory: dict = {}
    if teacher is not None:
        forward = distill.forward(teacher.model, pl.mesh)
        tparams = distill.place(teacher, pl.mesh, t.zero, t.dtype)
        memory = {"params": teacher.n_params,
                  **distill.memory(tparams, t.batch * t.grad_accum * t.seq * teacher.model.vocab_size * 4)}

    rest_homes = (homes.step, homes.opt_state, homes.delay)

    def rest_of(params):  # what init adds to the placed parameters
        s = lay.init_state(params)
        return s.step, s.opt_state, s.delay

    def init(params) -> TrainState:
        params = jax.device_put(pl.to_state(params), homes.params)
        if lay.hosted:  # host-memory outputs: placed after the jitted init
            rest = jax.device_put(jax.jit(rest_of)(params), rest_homes)
        else:
            rest = jax.jit(rest_of, out_shardings=rest_homes)(params)
        return TrainState(rest[0], params, rest[1], rest[2])

    put_batch, share = (lambda b: jax.device_put(b, lay.batch)), (0, 1)
    if jax.process_count() > 1:  # each process holds its rows only: assemble the global batch
        if pl.mesh is None:
            raise ConfigError("train.mesh: a multi-host job needs a mesh over all processes' devices; "
                              "fix: pass --mesh data=D,model=T")
        share = batch_share(lay.batch, t.batch * t.grad_accum, t.seq)

        def put_batch(batch):  # a step's rows, or an evaluation batch's (batch rows: no accumulation)
            local = len(next(iter(batch.values())))
            return put_global_batch(lay.batch, local * share[1])(batch)

    def lower_step(state: TrainState, batch) -> Callable[[], Callable]:
        if forward is None:
            lowered = jit_step(cfg, lay).lower(state, put_batch(batch))
            return lambda: lowered.compile(compiler_options=pl.compiler_options)
        lowered = jit_step(cfg, lay, forward).lower(state, put_batch(batch), tparams)

        def compile_with_teacher() -> Callable:
            compiled = lowered.compile(compiler_options=pl.compiler_options)
            return lambda s, b: compiled(s, b, tparams)

        return compile_with_teacher

    def compile_step(state: TrainState, batch):
        return lower_step(state, batch)()

    def eval_loss(params, batch):
        return pl.loss_fn(to_device(params, homes.params), batch)

    return StepFns(init=init, compile=compile_step, eval_loss=jax.jit(eval_loss), put_batch=put_batch,
                   loss_fn=pl.loss_fn, batch_share=share, to_canonical=pl.to_canonical, info=dict(pl.info),
                   lower=lower_step, teacher=memory)


def checkpoint_parts(state: TrainState) -> tuple[Any, Any]:
    """(params, optimizer part) as a checkpoint stores them: the optimizer part is the optimizer
    state, paired with the delay history when there is one (the update count is the checkpoint's step)."""
    return state.params, (state.opt_state if state.delay is None else (state.opt_state, state.delay))


def from_checkpoint(step: int, params: Any, opt_part: Any, like: TrainState) -> TrainState:
    """The `TrainState` of a restored checkpoint (`like`: a placed state whose layout it takes)."""
    opt_state, history = (opt_part, None) if like.delay is None else opt_part
    return TrainState(jax.device_put(jnp.asarray(step, jnp.int32), like.step.sharding), params, opt_state, history)
