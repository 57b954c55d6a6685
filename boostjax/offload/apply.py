"""Applying an offload plan to the training step: remat/offload policies per layer, recompute
segments, and host placement of parameters and optimizer states.

A `Plan` becomes (`schedule`, `layer_checkpoint`) per-layer `jax.checkpoint` policies
(`save_and_offload_only_these_names` from `Plan.layer_policy`), one outer checkpoint per recompute
segment (`RematSegment`), and `pinned_host` shardings for host-resident parameters and optimizer
states. Activation offload lowers only on GPU/TPU (`lower_for_gpu` checks it without a GPU); on CPU the
step uses XLA's memory-optimised scheduler. The placement layer applies it on any layout
(`boostjax.placement.offload.Offloaded`, its `compiler_options` too). Detail: docs/offload.md ("What a plan turns into").
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Callable

import jax

from boostjax.config import Config
from boostjax.runtime.hardware import HardwareProfile
from boostjax.models.llama import RematSegment, TiedLayer
from boostjax.offload.costmodel import PlanInstance, build_instance
from boostjax.offload.optstate import optimizer_bytes
from boostjax.offload.planfile import Plan, simulate

HOST, DEVICE = "pinned_host", "device"
_OFFLOAD = dict(offload_src=DEVICE, offload_dst=HOST)
# saved with their fp32 statistics: the latents' norm sums, the attention output's log-sum-exp (chunked path)
_HAS_STATS = ("qkv_latent", "o_latent", "gate_up_latent", "down_latent", "attn_out")


# ----------------------------------------------------------------------------- plan files


# ----------------------------------------------------------------------------- policies


def _with_stats(names: list[str]) -> list[str]:
    return list(names) + [n + "_stats" for n in names if n in _HAS_STATS]


def _save_all_but_offload(offloaded: list[str]) -> Callable:
    """Save every residual (no remat), except that the names in `offloaded` go to pinned host."""
    base = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=offloaded, **_OFFLOAD)

    def policy(prim, *avals, **params):
        if prim.name == "name" and params.get("name") in offloaded:
            return base(prim, *avals, **params)
        return True

    return policy


def layer_checkpoint(pol: dict[str, Any], *, in_segment: bool = False) -> Callable | None:
    """The `jax.checkpoint` policy of one layer from `Plan.layer_policy(k)` (None = no remat).
    `in_segment`: the layer runs inside a multi-layer segment's checkpoint, whose re-run brings its
    boundary to device; the boundary is then saved (never offloaded a second time)."""
    save = [n for n in pol["save"] if n != "boundary"]
    offload = [] if in_segment else list(pol["offload"])
    keep_boundary = "boundary" in pol["save"] or (in_segment and "boundary" in pol["offload"])
    if not pol["remat"]:  # inner option `all`
        return _save_all_but_offload(offload) if offload else None
    saved = (["boundary"] if keep_boundary else []) + _with_stats(save)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved, names_which_can_be_offloaded=offload, **_OFFLOAD)


def schedule(plan: Plan) -> list:
    """The per-layer remat schedule for `LLaMA.features(..., remat=schedule(plan))`. When the plan keeps
    any layer's parameters or optimizer state on the host, its checkpointed layers (alone or inside a
    segment) are `TiedLayer`s (their weight gradients computed before the next layer's backward)."""
    out: list = []
    host_state = any(m != "device" for m in plan.decisions.mode)
    for s, e in plan.segments:
        pols = [plan.layer_policy(k) for k in range(s, e)]
        if e - s == 1:
            out.append(_tied(layer_checkpoint(pols[0]), host_state))
            continue
        host = plan.decisions.boundary[s] == "host"
        outer = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=() if host else ("segment_boundary",),
            names_which_can_be_offloaded=("segment_boundary",) if host else (), **_OFFLOAD)
        flat = pols[0]["segment_kind"] == "flat"
        inner = tuple(None if flat else _tied(layer_checkpoint(p, in_segment=True), host_state) for p in pols)
        out.append(RematSegment(outer, inner))
    return out


def _tied(policy: Callable | None, tie: bool) -> Callable | TiedLayer | None:
    """`policy` as a `TiedLayer` when `tie` (the plan keeps state on the host) and it checkpoints at all."""
    return TiedLayer(policy) if tie and policy is not None else policy


SLOP_FLAG = "xla_gpu_memory_limit_slop_factor"


def gpu_scheduler_options(plan: Plan, device_bytes: float) -> dict[str, int]:
    """XLA GPU compile options for `plan` on a GPU of `device_bytes`: when the plan keeps anything on the
    host, the scheduler's memory limit at the plan's budget (`xla_gpu_memory_limit_slop_factor`, a percent
    of the GPU's memory, rounded, 1 to 95). At XLA's default (95) the scheduler orders such a step for
    latency and the compiled peak lands far above the plan (docs/gpu-program.md). Empty for a plan that
    keeps everything on the device."""
    if not any(plan.host_layers.values()):
        return {}
    if device_bytes <= 0:
        raise ValueError(f"device_bytes: must be positive, got {device_bytes}; fix: pass the GPU's memory in bytes")
    return {SLOP_FLAG: int(min(95, max(1, round(100 * plan.budget_bytes / device_bytes))))}


def describe(plan: Plan) -> list[str]:
    """One line per segment saying what `schedule` applies (for logs and reports)."""
    lines = []
    for s, e in plan.segments:
        b = plan.decisions.boundary[s]
        kind = "layer" if e - s == 1 else f"{plan.layer_policy(s)['segment_kind']} segment"
        inner = ",".join(plan.decisions.inner[s:e])
        lines.append(f"layers {s}-{e - 1}: {kind}, input boundary {b}, inner {inner}, "
                     f"params {plan.param_place[s]}, optimizer {plan.opt_place[s]}")
    return lines


# ----------------------------------------------------------------------------- checks


def instance_for(cfg: Config, hw: HardwareProfile | str, budget_bytes: float | None = None,
                 **kw: Any) -> PlanInstance:
    """The cost-model instance of this training configuration (what `boostjax plan` solves, and what
    `check_plan_for` checks a plan against): one device of its mesh, activations in the compute dtype,
    and the optimizer state the run's optimizer allocates (`boostjax.offload.optstate.optimizer_bytes`)."""
    t = cfg.train
    return build_instance(cfg.model, t.batch, t.seq, hw, budget_bytes=budget_bytes,
                          dtype_bytes=4 if t.dtype == "float32" else 2, eight_bit=t.optimizer == "adam8bit",
                          strategy=t.strategy, mesh=t.mesh, optimizer=optimizer_bytes(cfg.model, t), **kw)


def cpu_equivalent(inst: PlanInstance, plan: Plan) -> tuple[float, float]:
    """(device peak bytes, host bytes) the planner predicts for this schedule when nothing is
    offloaded: host boundaries kept on device and host parameters/optimizer states counted as
    device-resident — what the CPU backend does with the same step (it drops activation offload,
    and a pinned_host argument is counted in `memory_analysis().argument_size_in_bytes`)."""
    d = plan.decisions
    L = len(d.boundary)
    dev = replace(d, boundary=tuple("device" if b == "host" else b for b in d.boundary),
                  mode=("device",) * L, offload_lag=(0,) * L, fetch_lead=(0,) * L,
                  param_fwd_lead=(0,) * L, param_bwd_lead=(0,) * L, grad_lag=(0,) * L)
    inst = replace(inst, param_modes=tuple(dict.fromkeys(inst.param_modes + ("device",))))
    ev = simulate(inst, dev)
    return ev.peak_bytes, ev.host_bytes


def compiled_memory(compiled) -> dict[str, int]:
    """`memory_analysis()` of a compiled step; `total_bytes` = argument + output - alias + temp
    (donated outputs reuse their argument buffers, so aliased bytes are counted once)."""
    ma = compiled.memory_analysis()
    out = {f"{n}_bytes": int(getattr(ma, f"{n}_size_in_bytes", 0) or 0)
           for n in ("argument", "output", "alias", "temp", "host_argument", "host_output", "host_temp")}
    out["total_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    return out


_S5 = re.compile(r"\{[^{}]*S\(5\)[^{}]*\}")


def host_memory_report(hlo_text: str) -> dict[str, int]:
    """Counts of host memory space evidence in HLO / StableHLO text: layouts in memory space 5
    (`S(5)`, pinned host) in the entry computation layout and in the whole text,
    `annotate_device_placement` custom calls that place on `pinned_host`, and MoveToHost/Device."""
    entry = next((ln for ln in hlo_text.splitlines() if "entry_computation_layout" in ln), "")
    return {
        "entry_s5": len(_S5.findall(entry)),
        "s5": len(_S5.findall(hlo_text)),
        "annotate_pinned_host": len(re.findall(r'annotate_device_placement.*?_xla_buffer_placement\s*=\s*"pinned_host"',
                                               hlo_text)),
        "annotate_device": len(re.findall(r'annotate_device_placement.*?_xla_buffer_placement\s*=\s*"device"',
                                          hlo_text)),
        "move_to_host": hlo_text.count("MoveToHost"),
        "move_to_device": hlo_text.count("MoveToDevice"),
    }


def annotated_placements(hlo_text: str) -> list[tuple[str, str]]:
    """(placement, operand type) of every `annotate_device_placement` custom call in StableHLO
    text, e.g. `("pinned_host", "tensor<2x16x32xf32>")`: which tensors a lowering moves where."""
    pat = r'annotate_device_placement.*?_xla_buffer_placement\s*=\s*"(\w+)".*?:\s*\((tensor<[^>]*>)\)'
    return re.findall(pat, hlo_text)


def lower_for_gpu(fn: Callable, *args: Any) -> str:
    """StableHLO text of `jax.jit(fn)` cross-lowered for CUDA (no GPU needed): shows the
    `annotate_device_placement` custom calls the GPU compiler turns into host offloads."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


__all__ = ["DEVICE", "HOST", "annotated_placements", "compiled_memory", "cpu_equivalent", "describe",
           "gpu_scheduler_options", "host_memory_report", "instance_for", "layer_checkpoint", "lower_for_gpu", "schedule"]
