"""Timing the best-predicted candidates on this process's devices: `boostjax plan --auto --measure-top K`.

`time_steps` compiles each candidate's training step as `boostjax train` does, runs one step of each in
turn for `rounds` rounds (the order reversed every other round) and `plan_auto` keeps the smallest
median. Why, and what is not timed: docs/planning.md ("Measuring the best few").
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from boostjax.analysis.memory import train_config
from boostjax.config import Config, ConfigError, ModelConfig, validate
from boostjax.models.llama import LLaMA
from boostjax.planning.cluster import Cluster
from boostjax.planning.space import Candidate
from boostjax.training.step import jit_step, step_layout, train_state_shapes

WARMUP = 2  # steps of each candidate before timing: compile, first touch


def check_local(cluster: Cluster) -> None:
    """ConfigError (one line) unless the cluster's devices are this process's: a CPU cluster (simulated),
    or one node whose devices this process sees on an accelerator."""
    devs = jax.devices()
    if cluster.is_cpu:
        if len(devs) < cluster.devices:
            raise ConfigError(f"plan.measure_top: {cluster.text} needs {cluster.devices} simulated devices and JAX sees "
                              f"{len(devs)}; fix: call boostjax.runtime.devices.simulate_devices({cluster.devices}, ...) "
                              "before JAX starts, or drop --measure-top")
        return
    if cluster.nodes > 1 or devs[0].platform == "cpu" or len(devs) < cluster.devices:
        raise ConfigError(f"plan.measure_top: times candidates on the cluster's devices, but {cluster.text} is not "
                          f"this process's ({len(devs)} {devs[0].platform} device(s)); fix: run the plan on one node "
                          "of that cluster, or drop --measure-top")


def candidate_of(row: dict[str, Any]) -> Candidate:
    """The `Candidate` of one ranked row of `plan_auto`."""
    return Candidate(*(row[k] for k in ("data", "stage", "model", "strategy", "micro_batch", "slots", "schedule",
                                        "remat", "zero")))


def compiled_step(model: ModelConfig, c: Candidate, seq: int, dtype: str, optimizer: str, cpu: bool):
    """`(step, state, batch)`: `c`'s training step compiled as `boostjax train` compiles it (CPU: the
    materialised attention its `train_command` passes), and zero-filled state and batch in its layout."""
    t = c.train_fields(seq, dtype, optimizer)
    extra = {k: t[k] for k in ("grad_accum", "zero", "microbatches", "pipeline_schedule", "optimizer") if k in t}
    cfg = validate(Config(replace(model, attention="xla") if cpu else model,
                          train_config(t["batch"], seq, t["strategy"], t["mesh"], t["remat"], dtype, **extra)))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LLaMA(cfg.model, rngs=nnx.Rngs(0))))
    lay = step_layout(cfg, graphdef, state.to_pure_dict())
    sds, b_sds = train_state_shapes(cfg, graphdef, state.to_pure_dict())
    step = jit_step(cfg, lay).lower(sds, b_sds).compile(compiler_options=lay.placement.compiler_options)
    zeros = lambda s: jax.device_put(jnp.zeros(s.shape, s.dtype), s.sharding)  # noqa: E731
    return step, jax.tree.map(zeros, sds), jax.tree.map(zeros, b_sds)


def time_steps(model: ModelConfig, candidates: list[Candidate], seq: int, dtype: str, optimizer: str = "adamw",
               rounds: int = 20, cpu: bool = True, log: Callable[[str], None] | None = None) -> dict[Candidate, list[float]]:
    """Seconds of every step of each candidate, all compiled in this process and run one step each in turn,
    `rounds` times (docs/planning.md)."""
    if rounds < 1:
        raise ConfigError(f"plan.measure_rounds: must be >= 1, got {rounds}; fix: pass --measure-rounds 20")
    runs: dict[Candidate, list] = {}
    for c in candidates:
        step, state, batch = compiled_step(model, c, seq, dtype, optimizer, cpu)
        for _ in range(WARMUP):
            state, _ = jax.block_until_ready(step(state, batch))
        runs[c] = [step, state, batch, []]
        if log:
            log(f"compiled the step of {c.label}")
    for k in range(rounds):
        for c in list(runs) if k % 2 == 0 else list(runs)[::-1]:
            step, state, batch, times = runs[c]
            t0 = time.perf_counter()
            runs[c][1], _ = jax.block_until_ready(step(state, batch))
            times.append(time.perf_counter() - t0)
    return {c: v[3] for c, v in runs.items()}


__all__ = ["candidate_of", "check_local", "compiled_step", "time_steps"]
