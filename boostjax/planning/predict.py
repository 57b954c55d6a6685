"""Predicted step time and per-device memory of a candidate, from its compiled measurement.

Time: `slots + stage - 1` slots of one micro-batch's forward + backward, the gradient accumulation
(`accumulation_s`), the update once (split under ZeRO), the data-parallel gradient traffic and a
pipeline's collectives over `stage`; nothing overlaps. Memory: the compiled step's parts at L/stage
layers, with ZeRO's splits, the accumulator, and with stages what the schedule keeps per activation
slot. Every term: docs/planning.md ("Cost model").
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import jax
from flax import nnx

from boostjax.config import ModelConfig
from boostjax.models.flops import flops_per_token
from boostjax.models.llama import LLaMA
from boostjax.planning.cluster import Cluster
from boostjax.planning.costs import Hardware, coll_time, program_time, scaled, split_layers
from boostjax.planning.space import Candidate, axis_bus, in_flight, pipeline_collectives, pipeline_sends_s, send_bytes

TIME_KEYS = ("gemm_s", "memory_s", "comm_s", "gemm_flops", "comm_bytes", "other_bytes")
MEM_KEYS = ("weight_bytes", "optimizer_bytes", "activation_bytes", "peak_bytes_per_device")


@functools.lru_cache(maxsize=64)
def param_arrays(model: ModelConfig, layers: float) -> float:
    """Parameter arrays of a stage of `layers` layers (`rest + layers x layer`, from the 1- and 2-layer model)."""
    one, two = (len(jax.tree.leaves(nnx.state(nnx.eval_shape(lambda k=k: LLaMA(replace(model, n_layers=k),
                                                                                 rngs=nnx.Rngs(0))), nnx.Param)))
                for k in (1, 2))
    return one + (layers - 1) * (two - one)


def top_weight_bytes(m: dict[str, Any]) -> float:
    """fp32 bytes of a device's parameters outside the layers (embedding, final norm, head): the compiled
    1- and 2-layer steps' parameter bytes taken to 0 layers."""
    one, two = (float(m[n]["memory"]["weight_bytes"]) for n in ("1", "2"))
    return max(2 * one - two, 0.0)


def accumulations(c: Candidate) -> int:
    """Times per step a micro-batch's gradients are added into the accumulator: every micro-batch under
    `--grad-accum`, every tick of a pipeline's schedule, never with one micro-batch and no stages."""
    if c.stage > 1:
        return c.slots + c.stage - 1
    return c.slots if c.slots > 1 else 0


def accumulation_s(w: float, arrays: float, adds: int, hw: Hardware, eta: float) -> float:
    """Seconds per step of adding `adds` micro-batches' fp32 gradients into the accumulator: one element-wise
    add per parameter array each time (both read, one written), `arrays` arrays of `w / arrays` bytes, priced
    as the compiled program's other instructions (`costs.program_time`)."""
    if adds == 0:
        return 0.0
    size = 3 * w / arrays
    add = {"gemms": [], "collectives": [], "other_sizes": [size] * round(arrays), "other_bytes": 3 * w,
           "score_bytes_excluded": 0, "move_bytes_excluded": 0}
    return adds * program_time(add, hw, eta)["memory_s"]


def _stage_collectives(c: Candidate, feature_bytes: float, top_bytes: float, cluster: Cluster,
                       hw: Hardware) -> tuple[float, float]:
    """(seconds, bytes) per step of a pipeline's collectives over `stage` besides its sends
    (`space.pipeline_collectives`)."""
    bw = axis_bus(cluster, hw, c.stage, c.model)
    ops = [op for op in pipeline_collectives(c, feature_bytes, top_bytes) if op[0] != "collective-permute"]
    return (sum(n * coll_time(kind, b, c.stage, hw, bw) for kind, b, n in ops),
            sum(n * b for _, b, n in ops))


def predict(model: ModelConfig, c: Candidate, m: dict[str, Any], hw: Hardware, eta: float, cluster: Cluster,
            seq: int, dtype: str) -> dict[str, Any]:
    """Seconds per step and bytes per device of `c` (docs/planning.md); `m` from `measure.measure`,
    `hw` one device's rates."""
    layers = model.n_layers / c.stage
    tp_bus = axis_bus(cluster, hw, c.model, 1)
    shard = c.data if c.zero >= 1 else 1
    t = {(n, p): program_time(m[n][p], hw, eta, tp_bus) for n in ("1", "2") for p in ("step", "opt")}
    t.update({(n, "shard"): program_time(scaled(m[n]["opt"], 1 / shard), hw, eta, tp_bus) for n in ("1", "2")})
    step, opt, opt_shard = (split_layers({k: t["1", p][k] for k in TIME_KEYS}, {k: t["2", p][k] for k in TIME_KEYS},
                                         layers) for p in ("step", "opt", "shard"))
    fb = {k: step[k] - opt[k] for k in TIME_KEYS}
    mem = split_layers({k: float(m["1"]["memory"][k]) for k in MEM_KEYS},
                       {k: float(m["2"]["memory"][k]) for k in MEM_KEYS}, layers)
    per_layer_act = (m["2"]["memory"]["activation_bytes"] - m["2"]["memory"]["weight_bytes"]) - (
        m["1"]["memory"]["activation_bytes"] - m["1"]["memory"]["weight_bytes"])
    w, o = mem["weight_bytes"], mem["optimizer_bytes"]
    d = c.data
    slots = c.slots + c.stage - 1
    opt_s = opt_shard["gemm_s"] + opt_shard["memory_s"] + opt["comm_s"]
    data_bus = axis_bus(cluster, hw, d, c.stage * c.model)
    arrays = param_arrays(model, 1.0 if c.stage > 1 else layers)  # a pipeline's stage stacks its layers
    # collectives per gather / scatter on the CPU (one per parameter array)
    n = arrays if cluster.is_cpu and c.zero >= 1 else 1
    if d == 1:
        dp_s, dp_bytes = 0.0, 0.0
    elif c.zero >= 1:  # gathered once per step, every micro-batch uses them (ZeRO 3: before, ZeRO 1: after the update)
        dp_s = n * (coll_time("reduce-scatter", w / d / n, d, hw, data_bus) + coll_time("all-gather", w / n, d, hw,
                                                                                         data_bus))
        dp_bytes = 2 * w
    else:
        dp_s, dp_bytes = coll_time("all-reduce", w, d, hw, data_bus), w
    p2p_bytes = send_bytes(model, c, seq, dtype)
    p2p_s = pipeline_sends_s(c, p2p_bytes, cluster, hw)
    stage_s, stage_bytes = _stage_collectives(c, p2p_bytes, top_weight_bytes(m), cluster, hw)
    fb_s = fb["gemm_s"] + fb["memory_s"] + fb["comm_s"]
    acc_s = accumulation_s(w, arrays, accumulations(c), hw, eta)
    total = slots * fb_s + acc_s + opt_s + dp_s + p2p_s + stage_s
    # memory
    other = mem["activation_bytes"] - w  # the step's buffers besides its fp32 gradient
    if c.stage == 1:
        extra_flight = (in_flight(c) - 1) * max(per_layer_act, 0.0) * layers
    else:  # the schedule's residuals replace the one micro-batch's layer activations (docs/planning.md)
        streams = 2 * in_flight(c) * p2p_bytes if c.schedule == "gpipe" else 0.0
        extra_flight = (in_flight(c) * m["layer_residual_bytes"] - max(per_layer_act, 0.0)) * layers + streams
    weights = w / (d if c.zero >= 3 else 1)
    optim = o / shard
    accum = w if c.slots > 1 or c.stage > 1 else 0.0
    gathered = (w - w / d) if c.zero >= 3 else 0.0
    activations = other + extra_flight + w + accum + gathered
    devices = c.data * c.stage * c.model
    tokens = c.data * c.micro_batch * c.slots * seq
    useful = flops_per_token(model, seq) * tokens / devices
    return {
        "step_s": total, "tokens_per_s": tokens / total, "mfu": useful / (total * hw.peak_flops),
        "peak_bytes_per_device": weights + optim + activations, "weight_bytes": weights, "optimizer_bytes": optim,
        "activation_bytes": activations,
        "time_s": {"compute": slots * fb["gemm_s"], "memory": slots * fb["memory_s"], "model_comm": slots * fb["comm_s"],
                   "accumulate": acc_s, "optimizer": opt_s, "data_comm": dp_s, "stage_p2p": p2p_s, "stage_comm": stage_s,
                   "bubble": (c.stage - 1) * fb_s},
        "comm_bytes": {"model": slots * fb["comm_bytes"] + opt["comm_bytes"], "data": dp_bytes,
                       "stage": 2 * slots * p2p_bytes + stage_bytes if c.stage > 1 else 0.0},
        "bubble_fraction": (c.stage - 1) / slots, "fwd_bwd_s_per_slot": fb_s,
        "gemm_flops_per_device": slots * fb["gemm_flops"] + opt["gemm_flops"],
    }


__all__ = ["predict"]
