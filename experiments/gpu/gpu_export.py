"""The training step as a CUDA GPU receives it, read on a CPU machine: lowered for ("cuda",), no GPU.

`boostjax train`'s jitted step (`boostjax.training.step.jit_step` on `step_layout` / `train_state_shapes`,
as `boostjax.analysis.memory` builds it: ShapeDtypeStructs with shardings on simulated CPU devices, nothing
allocated) is traced and lowered with `lowering_platforms=("cuda",)` under `attention.lowering_for("cuda")`
(so `--attention auto` resolves as it would on a CUDA GPU), for

  (a) 7B CoLA, BTP, TP 4 (`data=1,model=4`), micro-batch 4 x 4096, bf16, `--remat lowrank`, AdamW: the goal
      row of experiments/results/memory_table.md; per-layer figures from the 1- and 2-layer programs
      (`--full-depth` lowers the 32-layer program too);
  (b) 1B CoLA on one GPU with the offload plan `boostjax plan` makes for an H100 at a 5 GB cap (8-bit
      Adam, batch 8 x 1024, bf16): pinned_host state, recompute segments, per-layer remat policies.

From the StableHLO text: the attention path (cuDNN custom calls, or the chunked loops, and whether any
[t, t] tensor exists), the dot_general operand types, the collectives (per layer: 2-layer minus 1-layer
program) beside `boostjax comm`'s figures for the CPU compile of the same configuration, memory kinds of
the arguments and the `annotate_device_placement` moves, and the optimization barriers of the
rematerialised layers; the remat policies' decisions per checkpoint_name come from the traced jaxpr (names
do not survive lowering). `--deviceless` (needs `jax-cuda12-plugin` with CUDA libraries, in a separate
environment) also tries to compile the lowered module for an H100 target description without a device.

    python -m experiments.gpu.gpu_export               # ~10 min on a shared 2-core CPU
    python -m experiments.gpu.gpu_export --quick       # (a) at seq 2048, no CPU compile comparison

Writes experiments/results/gpu_export.{json,md} (or `--out DIR`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from experiments import common

from boostjax.runtime.devices import exact_low_precision, simulate_devices

simulate_devices(8)  # before JAX starts
exact_low_precision()

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from boostjax.analysis import memory  # noqa: E402
from boostjax.analysis.comm import expected_per_layer  # noqa: E402
from boostjax.config import Config, preset, validate  # noqa: E402
from boostjax.models import attention  # noqa: E402
from boostjax.models.llama import LLaMA  # noqa: E402
from boostjax.offload import apply  # noqa: E402
from boostjax.training.step import jit_step, step_layout, train_state_shapes  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "i32": 4, "i64": 8, "ui32": 4, "i8": 1, "ui8": 1, "i1": 1}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "collective_permute", "all_to_all")
SEVEN_B = dict(preset="7b", mesh="data=1,model=4", batch=4, seq=4096, remat="lowrank", strategy="btp")
ONE_B = dict(preset="1b", batch=8, seq=1024, optimizer="adam8bit", hardware="h100", cap_gb=5.0)


# ----------------------------------------------------------------------------- the step, lowered

def abstract_step(cfg: Config):
    """(jitted step, state ShapeDtypeStructs, batch ShapeDtypeStructs, layout) as `boostjax train` compiles
    it for `cfg` (`boostjax.analysis.memory.train_step_compiled` builds the same, then compiles)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LLaMA(cfg.model, rngs=nnx.Rngs(0))))
    params_like = state.to_pure_dict()
    lay = step_layout(cfg, graphdef, params_like)
    state_sds, batch_sds = train_state_shapes(cfg, graphdef, params_like)
    return jit_step(cfg, lay), state_sds, batch_sds, lay


def lower(cfg: Config, platform: str = "cuda"):
    """The step traced for `platform` (attention resolved for it) and lowered: (jax Lowered, seconds)."""
    t0 = time.perf_counter()
    with attention.lowering_for(platform):  # the step built and traced for the target (its attention path)
        step, state_sds, batch_sds, _ = abstract_step(cfg)
        traced = step.trace(state_sds, batch_sds)
    return traced.lower(lowering_platforms=(platform,)), time.perf_counter() - t0


def lower_text(cfg: Config, platform: str = "cuda") -> tuple[str, float, str | None]:
    """(StableHLO text, seconds, note): `lower`, except that where `auto` picks cuDNN and the lowering
    fails (no CUDA plugin: JAX reads cuDNN's version from it while tracing; BTP on `data=1`: see
    docs/gpu-program.md) the step is lowered with `chunked` and the note says why."""
    try:
        low, secs = lower(cfg, platform)
        return low.as_text(), secs, None
    except (RuntimeError, ValueError) as e:
        if cfg.model.attention != "auto":
            raise
        why = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    low, secs = lower(replace(cfg, model=replace(cfg.model, attention="chunked")), platform)
    return low.as_text(), secs, (f"`auto` resolved to cudnn for the CUDA lowering, which failed (`{why}`); "
                                 "lowered with `--attention chunked` instead")


# ----------------------------------------------------------------------------- reading StableHLO text

_TENSOR = re.compile(r"tensor<([0-9x]*)(bf16|f16|f32|f64|i1|i8|ui8|i32|ui32|i64)>")


def tensor_bytes(t: str) -> int:
    """Bytes of one `tensor<AxBxdtype>` type (a scalar `tensor<f32>` too)."""
    m = _TENSOR.fullmatch(t.strip())
    if not m:
        return 0
    n = 1
    for d in filter(None, m.group(1).split("x")):
        n *= int(d)
    return n * ITEMSIZE[m.group(2)]


def _signature(lines: list[str], i: int) -> tuple[list[str], list[str]]:
    """(operand types, result types) of the op starting on line i (its region, if any, skipped)."""
    j = i
    if lines[i].rstrip().endswith("({"):
        j = next(k for k in range(i + 1, len(lines)) if lines[k].lstrip().startswith("})"))
    sig = lines[j].rsplit(" : ", 1)[-1]
    ins, _, outs = sig.partition(" -> ")
    return _tensors(ins), _tensors(outs)


def _tensors(text: str) -> list[str]:
    return [m.group(0) for m in _TENSOR.finditer(text)]


def collectives(text: str) -> list[dict[str, Any]]:
    """Every collective op of a StableHLO module: kind, result types, bytes (results, per device) and
    the size of its device groups; ops over single-device groups are marked `trivial` (they move nothing)."""
    lines = text.splitlines()
    out = []
    for i, ln in enumerate(lines):
        m = re.search(r'"stablehlo\.(' + "|".join(COLLECTIVES) + r')"', ln)
        if not m:
            continue
        _, results = _signature(lines, i)
        g = re.search(r"replica_groups = dense<.*?> : tensor<(\d+)x(\d+)xi64>", ln)
        size = int(g.group(2)) if g else 0
        out.append({"kind": m.group(1), "results": results, "bytes": sum(tensor_bytes(t) for t in results),
                    "group_size": size, "trivial": m.group(1) != "collective_permute" and 0 < size <= 1})
    return out


def collective_summary(text: str) -> dict[str, dict[str, int]]:
    """{kind: {count, bytes}} over the non-trivial collectives (`collectives`)."""
    out: dict[str, dict[str, int]] = {}
    for c in collectives(text):
        if c["trivial"]:
            continue
        s = out.setdefault(c["kind"], {"count": 0, "bytes": 0})
        s["count"] += 1
        s["bytes"] += c["bytes"]
    return out


def collective_multiset(text: str) -> Counter:
    """The non-trivial collectives as a multiset of (kind, result types, group size)."""
    return Counter((c["kind"], tuple(c["results"]), c["group_size"]) for c in collectives(text) if not c["trivial"])


def dot_types(text: str) -> dict[str, int]:
    """Count of `stablehlo.dot_general` ops per `lhs x rhs -> result` element type."""
    out: Counter = Counter()
    for ln in text.splitlines():
        if "stablehlo.dot_general" not in ln:
            continue
        ins, outs = _signature([ln], 0)
        dt = lambda t: _TENSOR.fullmatch(t).group(2)  # noqa: E731
        out[f"{dt(ins[0])} x {dt(ins[1])} -> {dt(outs[0])}"] += 1
    return dict(sorted(out.items()))


def custom_calls(text: str) -> dict[str, int]:
    """Count of custom calls per target (`@__cudnn$fmhaSoftmax`, `@annotate_device_placement`, ...)."""
    return dict(sorted(Counter(re.findall(r"custom_call @([\w$.\-]+)", text)).items()))


def attention_path(text: str, seq: int) -> dict[str, Any]:
    """What computes attention: cuDNN's fused-attention custom calls, the chunked path's loops, and
    whether any tensor holds a [t, t] score matrix (the materialised path does; cuDNN and chunked with
    several blocks do not)."""
    calls = custom_calls(text)
    cudnn = {k: v for k, v in calls.items() if "cudnn" in k.lower()}
    dims = lambda m: m.group(1).split("x")[:-1]  # noqa: E731 - the shape (the last split is empty)
    tt = sum(1 for m in _TENSOR.finditer(text) if len(dims(m)) >= 4 and dims(m)[-2:] == [str(seq), str(seq)])
    path = "cudnn" if cudnn else ("chunked" if "stablehlo.while" in text and not tt else "materialised")
    return {"path": path, "cudnn_calls": cudnn, "while_loops": text.count("stablehlo.while"),
            "tt_tensor_mentions": tt}


def memory_kinds(text: str) -> dict[str, Any]:
    """Arguments / results of the entry function per memory kind (`mhlo.memory_kind`), and the
    `annotate_device_placement` moves inside (`boostjax.offload.apply.annotated_placements`)."""
    main = next((ln for ln in text.splitlines() if "func.func public @main" in ln), "")
    args, _, results = main.partition(") -> (")
    kinds = lambda s: dict(Counter(re.findall(r'mhlo\.memory_kind = "(\w+)"', s)))  # noqa: E731
    moves = Counter(f"{p} {t}" for p, t in apply.annotated_placements(text))
    return {"arguments": kinds(args), "results": kinds(results), "moves": dict(sorted(moves.items())),
            **apply.host_memory_report(text)}


def barriers(text: str) -> dict[str, Any]:
    """`stablehlo.optimization_barrier` ops (the rematerialised layers' saved values meet the output
    cotangent there, `boostjax.models.remat.tied_checkpoint`; the row-blocked attention adds its own,
    for the transposed tiles, where a step runs it): count, operands and their bytes."""
    ops = [ln for ln in text.splitlines() if "stablehlo.optimization_barrier" in ln]
    types = [t for ln in ops for t in _tensors(ln.rsplit(" : ", 1)[-1])]
    return {"count": len(ops), "operands": len(types), "bytes": sum(tensor_bytes(t) for t in types),
            "first": _tensors(ops[0].rsplit(" : ", 1)[-1]) if ops else []}


# ----------------------------------------------------------------------------- remat names (jaxpr)

def _subjaxprs(eqn):
    for v in eqn.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def _decide(policy, eqn) -> str:
    if policy is None:
        return "recomputed"
    d = policy(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params)
    kind = type(d).__name__  # jax's policies return pe.Saveable / pe.Recompute (singletons) or pe.Offloadable
    if d is True or kind in ("Saveable", "SaveableType"):
        return "saved"
    if kind == "Offloadable":
        return f"offloaded to {d.dst}"
    return "recomputed"


def remat_names(fn, *args) -> dict[str, dict[str, int]]:
    """{checkpoint_name: {decision: count}} over every `jax.checkpoint` in `fn`'s jaxpr: what the
    checkpoint's policy does with each named value inside it (saved / offloaded to pinned_host /
    recomputed). A name inside nested checkpoints is decided by the innermost."""
    out: dict[str, Counter] = {}

    def walk(jaxpr, policy, inside):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("checkpoint", "remat2"):  # jax.checkpoint (remat_p)
                for sub in _subjaxprs(eqn):
                    walk(sub, eqn.params.get("policy"), True)
                continue
            if eqn.primitive.name == "name" and inside:
                out.setdefault(eqn.params["name"], Counter())[_decide(policy, eqn)] += 1
            for sub in _subjaxprs(eqn):
                walk(sub, policy, inside)

    walk(jax.make_jaxpr(fn)(*args).jaxpr, None, False)
    return {k: dict(v) for k, v in sorted(out.items())}


# ----------------------------------------------------------------------------- findings

def read(text: str, seq: int) -> dict[str, Any]:
    """Everything this experiment reads from one StableHLO module."""
    return {"chars": len(text), "attention": attention_path(text, seq), "dot_general": dot_types(text),
            "custom_calls": custom_calls(text), "collectives": collective_summary(text),
            "memory_kinds": memory_kinds(text), "optimization_barriers": barriers(text)}


def per_layer(one: dict[str, dict[str, int]], two: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Collectives one layer adds: the 2-layer program's minus the 1-layer program's."""
    out = {}
    for k in sorted(set(one) | set(two)):
        d = {f: two.get(k, {}).get(f, 0) - one.get(k, {}).get(f, 0) for f in ("count", "bytes")}
        if any(d.values()):
            out[k] = d
    return out


def configs(preset_name: str, n_layers: int, seq: int, attention: str = "auto", **train) -> Config:
    m = preset(preset_name, kind="cola", max_seq_len=max(seq, 1), n_layers=n_layers, attention=attention)
    t = memory.train_config(train.pop("batch"), seq, train.pop("strategy", "none"), train.pop("mesh", None),
                            train.pop("remat", "none"), "bfloat16", **train)
    return validate(Config(m, t))


def seven_b(seq: int, full_depth: bool, compare: bool, log) -> dict[str, Any]:
    """(a): 7B BTP TP4, lowered for CUDA at 1, 2 (and 32) layers; CPU lowering and `boostjax comm` beside."""
    p = dict(SEVEN_B, seq=seq)
    res: dict[str, Any] = {"setup": {**p, "dtype": "bfloat16", "optimizer": "adamw", "model": "cola"}}
    texts, cpu = {}, {}
    for n in (1, 2):
        cfg = configs(p["preset"], n, seq, batch=p["batch"], strategy=p["strategy"], mesh=p["mesh"], remat=p["remat"])
        texts[n], secs, note = lower_text(cfg, "cuda")
        if note:
            res["attention_note"], cfg = note, replace(cfg, model=replace(cfg.model, attention="chunked"))
        cpu[n] = lower(cfg, "cpu")[0].as_text()
        log(f"7b {n} layer(s): lowered for cuda in {secs:.1f} s, {len(texts[n]) / 1e6:.1f} MB of StableHLO")
        if n == 1:  # the saved names of one layer (per-layer policies are alike)
            step, s, b, lay = abstract_step(cfg)
            with attention.lowering_for("cuda"):
                res["remat_names_per_layer"] = remat_names(lay.placement.loss_fn, s.params, b)
    res["one_layer"], res["two_layers"] = read(texts[1], seq), read(texts[2], seq)
    res["collectives_per_layer"] = per_layer(res["one_layer"]["collectives"], res["two_layers"]["collectives"])
    res["cpu_lowering_collectives_per_layer"] = per_layer(collective_summary(cpu[1]), collective_summary(cpu[2]))
    res["dot_general_per_layer"] = {k: v - res["one_layer"]["dot_general"].get(k, 0)
                                    for k, v in res["two_layers"]["dot_general"].items()
                                    if v != res["one_layer"]["dot_general"].get(k, 0)}
    if full_depth:
        cfg = configs(p["preset"], preset("7b").n_layers, seq, batch=p["batch"], strategy=p["strategy"],
                      mesh=p["mesh"], remat=p["remat"])
        text, secs, _ = lower_text(cfg, "cuda")
        res["full_depth"] = {"n_layers": cfg.model.n_layers, "lower_s": round(secs, 1), "chars": len(text),
                             "collectives": collective_summary(text), "attention": attention_path(text, seq)}
        log(f"7b {cfg.model.n_layers} layers: lowered for cuda in {secs:.1f} s")
    if compare:  # the CPU compile of the same steps, read as `boostjax comm` reads it (boostjax.analysis.hlo)
        t0 = time.perf_counter()
        cpu_c = {}
        for n in (1, 2):
            cfg = configs(p["preset"], n, seq, batch=p["batch"], strategy=p["strategy"], mesh=p["mesh"],
                          remat=p["remat"], attention="chunked")
            cpu_c[n] = memory.train_step_compiled(cfg).compiled
        found = {n: compiled_findings(cpu_c[n].as_text(), cpu_c[n].memory_analysis()) for n in (1, 2)}
        res["cpu_compile_collectives_per_layer"] = {
            k: {f: v[f] - found[1]["collectives"].get(k, {}).get(f, 0) for f in ("count", "bytes")}
            for k, v in found[2]["collectives"].items()
            if v["count"] != found[1]["collectives"].get(k, {}).get("count", 0)
            or v["bytes"] != found[1]["collectives"].get(k, {}).get("bytes", 0)}
        res["cpu_compile_two_layers"] = found[2] | {"compile_s": round(time.perf_counter() - t0, 1)}
        res["expected_per_layer"] = expected_per_layer(cfg.model, p["strategy"], p["batch"] * seq, "bfloat16",
                                                       cfg.train.mesh.model)
        log(f"CPU compile, 1 and 2 layers: {time.perf_counter() - t0:.0f} s")
    return res


def make_plan(out_dir: str, time_limit: float, log) -> tuple[str, list[str]]:
    """`boostjax plan` for (b), written to `out_dir/plan.json`; returns (path, the command's words)."""
    from boostjax.cli import main as cli

    o = ONE_B
    path = os.path.join(out_dir, "plan.json")
    words = ["plan", "--preset", o["preset"], "--model", "cola", "--batch", str(o["batch"]), "--seq", str(o["seq"]),
             "--dtype", "bfloat16", "--optimizer", o["optimizer"], "--hardware", o["hardware"],
             "--memory-cap", str(o["cap_gb"]), "--time-limit", str(time_limit), "--out", path]
    t0 = time.perf_counter()
    rc = cli(words)
    if rc != 0:
        raise RuntimeError(f"boostjax {' '.join(words)} exited with {rc}")
    log(f"boostjax plan: {time.perf_counter() - t0:.0f} s")
    return path, words


def offloaded(plan_path: str, plan_words: list[str], log) -> dict[str, Any]:
    """(b): 1B CoLA on one device with the plan: lowered for CUDA, and the same lowered for CPU."""
    o = ONE_B
    plan = json.loads(pathlib.Path(plan_path).read_text())
    cfg = configs(o["preset"], preset(o["preset"]).n_layers, o["seq"], batch=o["batch"], optimizer=o["optimizer"],
                  offload_plan=plan_path)
    text, secs, note = lower_text(cfg, "cuda")
    if note:
        cfg = replace(cfg, model=replace(cfg.model, attention="chunked"))
    log(f"1b offloaded: lowered for cuda in {secs:.1f} s")
    res = {"setup": {k: v for k, v in o.items()} | {"dtype": "bfloat16", "model": "cola",
                                                     "n_layers": cfg.model.n_layers},
           "plan_command": "boostjax " + shlex.join(plan_words[:-2]) + " --out plan.json",
           "plan": {k: plan.get(k) for k in ("status", "predicted_peak_bytes", "predicted_host_bytes",
                                              "budget_bytes")} | {"decisions": plan["decisions"]},
           "lower_s": round(secs, 1), "attention_note": note, **read(text, o["seq"])}
    res["cpu_lowering_memory_kinds"] = memory_kinds(lower(cfg, "cpu")[0].as_text())
    _, s, b, lay = abstract_step(cfg)
    hosted = lambda tree: sum(1 for x in jax.tree.leaves(tree) if x.sharding.memory_kind == "pinned_host")  # noqa: E731
    res["state_leaves_on_host"] = {"params": hosted(s.params), "opt_state": hosted(s.opt_state),
                                   "params_total": len(jax.tree.leaves(s.params)),
                                   "opt_state_total": len(jax.tree.leaves(s.opt_state))}
    on_dev = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding.with_memory_kind("device")),
                          s.params)
    with attention.lowering_for("cuda"):
        res["remat_names"] = remat_names(lay.placement.loss_fn, on_dev, b)
    return res


# ----------------------------------------------------------------------------- deviceless GPU compile

def gpu_topology(spec_path: str, n: int):
    """`n` compile-only CUDA devices described by an XLA GPU target config (a `GpuTargetConfigProto` text
    file, e.g. XLA's xla/backends/gpu/target_config/specs/h100_sxm.txtpb): needs `jax-cuda12-plugin` and
    its CUDA libraries, and `JAX_PLATFORMS=cpu` without a GPU (the plugin then skips its device check)."""
    from jax.experimental import topologies

    spec = pathlib.Path(spec_path).read_text()
    return topologies.get_topology_desc(platform="cuda", topology=f"1x1x{n}", target_config=spec)


def gpu_compile(lowered, spec_path: str, n: int, env: dict[str, str] | None = None):
    """Compile a step lowered for CUDA (on simulated CPU devices) for `n` target GPUs, with no GPU:
    (executable, seconds). `env`: XLA debug options for this compile (e.g. `xla_dump_to`)."""
    import numpy as np
    from jax._src import compiler
    from jax._src.lib import _jax

    devices = np.asarray(gpu_topology(spec_path, n).devices[:n])
    opts = compiler.get_compile_options(num_replicas=1, num_partitions=n, device_assignment=devices.reshape(1, n),
                                        env_options_overrides=env)
    t0 = time.perf_counter()
    exe = devices[0].client.compile(lowered.compiler_ir("stablehlo"), executable_devices=_jax.DeviceList(tuple(devices)),
                                    compile_options=opts)
    return exe, time.perf_counter() - t0


def compiled_findings(hlo_text: str, mem) -> dict[str, Any]:
    """Per-device memory (argument + output - alias + temp) and the optimised HLO's collectives (per kind:
    count, async start/done pairs, combined = several operands in one op, bytes) and fusions."""
    from boostjax.analysis import hlo

    fields = ("argument", "output", "alias", "temp", "host_argument", "host_output", "host_temp", "generated_code")
    m = {f"{f}_bytes": int(getattr(mem, f"{f}_size_in_bytes", 0) or 0) for f in fields}
    m["peak_bytes_per_device"] = m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]
    mod = hlo.parse_module(hlo_text)
    kinds: dict[str, dict[str, int]] = {}
    for c in hlo.collectives(mod):
        if c.trivial:
            continue
        k = kinds.setdefault(c.kind, {"count": 0, "async": 0, "combined": 0, "bytes": 0})
        k["count"] += 1
        k["async"] += int(c.is_async)
        k["combined"] += int(len(c.results) > 1)
        k["bytes"] += c.logical_bytes
    ops = Counter(i.opcode for instrs in mod.computations.values() for i in instrs)
    return {"memory": m, "collectives": kinds, "fusions": ops.get("fusion", 0),
            "custom_calls": ops.get("custom-call", 0), "instructions": sum(ops.values())}


def compile_for_target(cfg: Config, spec_path: str, n: int, log, what: str,
                       env: dict[str, str] | None = None) -> dict[str, Any]:
    """`cfg`'s step lowered for CUDA and compiled for `n` target GPUs (`env`: XLA options for the compile):
    the findings, the custom calls of the optimised program (cuDNN's attention among them) and the seconds,
    or the error as the finding."""
    low, _ = lower(cfg, "cuda")
    try:
        exe, secs = gpu_compile(low, spec_path, n, env)
    except Exception as e:  # recorded as the finding
        log(f"deviceless compile of {what} failed: {type(e).__name__}")
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    text = exe.hlo_modules()[0].to_string()
    out = compiled_findings(text, exe.get_compiled_memory_stats())
    out["custom_call_targets"] = dict(Counter(re.findall(r'custom_call_target="([^"]+)"', text)))
    out["compile_s"] = round(secs, 1)
    log(f"deviceless GPU compile of {what}: {secs:.0f} s")
    return out


def deviceless(spec_path: str, log, cpu_two: dict | None = None) -> dict[str, Any]:
    """(a) at 2 layers compiled for 4 target GPUs (attention `auto`: cuDNN in bf16), beside `cpu_two` (the
    same step with chunked attention compiled for the 4 simulated CPU devices: `seven_b`'s
    `cpu_compile_two_layers`)."""
    p = SEVEN_B
    cfg = configs(p["preset"], 2, p["seq"], batch=p["batch"], strategy=p["strategy"], mesh=p["mesh"], remat=p["remat"])
    out: dict[str, Any] = {"target": pathlib.Path(spec_path).name,
                           "config": "7b BTP TP4, 2 layers, attention auto (cuDNN for the GPU, chunked on the CPU)"}
    found = compile_for_target(cfg, spec_path, 4, log, "(a)")
    if "error" in found:
        out["error"] = found["error"]
        return out
    out["gpu"] = found
    if cpu_two is not None:
        out["cpu"] = cpu_two
    return out


def deviceless_offloaded(spec_path: str, plan_path: str, log) -> dict[str, Any]:
    """(b) at full depth with its plan, compiled for one target GPU (pinned_host state, cuDNN attention)."""
    o = ONE_B
    cfg = configs(o["preset"], preset(o["preset"]).n_layers, o["seq"], batch=o["batch"], optimizer=o["optimizer"],
                  offload_plan=plan_path)
    found = compile_for_target(cfg, spec_path, 1, log, "(b)")
    out = {"target": pathlib.Path(spec_path).name, "config": f"1b CoLA, {cfg.model.n_layers} layers, the plan's "
           "placements, attention auto", **found, "without_plan": {}}
    for remat in ("none", "full"):  # the same model and batch without a plan, for scale
        plain = configs(o["preset"], preset(o["preset"]).n_layers, o["seq"], batch=o["batch"], optimizer=o["optimizer"],
                        remat=remat)
        got = compile_for_target(plain, spec_path, 1, log, f"(b) without a plan, remat {remat}")
        out["without_plan"][remat] = got.get("memory", got)
    return out


# ----------------------------------------------------------------------------- report

def _cc(d: dict) -> str:
    return ", ".join(f"{k}: {v['count']} ({v['bytes'] / 2**20:.2f} MiB)" for k, v in d.items()) or "none"


def _kv(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "none"


def _names(d: dict) -> str:
    return "; ".join(f"{k}: " + ", ".join(f"{dd} {n}" for dd, n in v.items()) for k, v in d.items()) or "none"


def deviceless_lines(d: dict) -> list[str]:
    out = ["## Deviceless compile for a GPU target", "",
           f"{d['config']}, compiled for 4 x `{d['target']}` (compile-only devices from a PJRT topology; no GPU)."]
    if "error" in d:
        return out + ["", f"Failed: `{d['error']}`", ""]
    g, c = d["gpu"], d.get("cpu", {})
    row = lambda name, f: f"| {name} | {f(g)} | {f(c) if c else '-'} |"  # noqa: E731
    gib = lambda x: f"{x / 2**30:.2f}"  # noqa: E731
    coll = lambda x: "; ".join(f"{k} {v['count']} (async {v['async']}, combined {v['combined']}, "  # noqa: E731
                               f"{v['bytes'] / 2**20:.1f} MiB)" for k, v in x["collectives"].items())
    return out + ["", "| per device | GPU (deviceless) | CPU (simulated devices) |", "|---|---|---|",
                  row("peak GiB (argument + output - alias + temp)", lambda x: gib(x["memory"]["peak_bytes_per_device"])),
                  row("argument / temp GiB", lambda x: f"{gib(x['memory']['argument_bytes'])} / "
                                                       f"{gib(x['memory']['temp_bytes'])}"),
                  row("collectives after optimisation", coll),
                  row("fusions / instructions", lambda x: f"{x['fusions']} / {x['instructions']}"),
                  row("cuDNN custom calls", lambda x: _kv({k: v for k, v in x.get("custom_call_targets", {}).items()
                                                           if "cudnn" in k}) if "custom_call_targets" in x else "-"),
                  row("compile s", lambda x: x.get("compile_s", "-")), ""]


def deviceless_offloaded_lines(d: dict) -> list[str]:
    out = ["### (b) compiled for one GPU", "", f"{d['config']}, compiled for 1 x `{d['target']}` (no GPU)."]
    if "error" in d:
        return out + ["", f"Failed: `{d['error']}`", ""]
    m = d["memory"]
    gib = lambda x: f"{x / 2**30:.2f}"  # noqa: E731
    return out + ["", "| | |", "|---|---|",
                  f"| peak GiB on the device (argument + output - alias + temp) | {gib(m['peak_bytes_per_device'])} |",
                  f"| device argument / temp GiB | {gib(m['argument_bytes'])} / {gib(m['temp_bytes'])} |",
                  f"| host argument / output / temp GiB | {gib(m['host_argument_bytes'])} / "
                  f"{gib(m['host_output_bytes'])} / {gib(m['host_temp_bytes'])} |",
                  f"| fusions / instructions | {d['fusions']} / {d['instructions']} |",
                  f"| cuDNN custom calls | {_kv({k: v for k, v in d['custom_call_targets'].items() if 'cudnn' in k})} |",
                  f"| compile s | {d['compile_s']} |"] + [
                  f"| without a plan, `--remat {r}`: peak GiB on the device | "
                  + (gib(m2["peak_bytes_per_device"]) if "peak_bytes_per_device" in m2 else f"failed: {m2.get('error')}")
                  + " |" for r, m2 in d.get("without_plan", {}).items()] + [""]


def markdown(res: dict) -> str:
    a, b = res.get("seven_b"), res.get("offloaded")
    lines = ["# The training step lowered for CUDA on a CPU machine", "",
             "The jitted step `boostjax train` compiles, traced on abstract inputs (nothing allocated) and "
             "lowered with `lowering_platforms=(\"cuda\",)`; attention resolved for CUDA "
             "(`boostjax.models.attention.lowering_for`). Read from the StableHLO text unless said otherwise.", ""]
    if a:
        s = a["setup"]
        one, two = a["one_layer"], a["two_layers"]
        lines += [f"## (a) 7B CoLA, BTP, `{s['mesh']}`, micro-batch {s['batch']} x {s['seq']}, bf16, "
                  f"remat {s['remat']}, AdamW", "",
                  "| finding | value |", "|---|---|",
                  f"| attention (`auto`, bf16, cuda) | {one['attention']['path']}: custom calls "
                  f"{_kv(one['attention']['cudnn_calls'])}; while loops {one['attention']['while_loops']}; "
                  f"[t, t] tensors {one['attention']['tt_tensor_mentions']} |",
                  *([f"| attention note | {a['attention_note']} |"] if a.get("attention_note") else []),
                  f"| dot_general operand types (1 layer program) | {_kv(one['dot_general'])} |",
                  f"| dot_general added per layer | {_kv(a['dot_general_per_layer'])} |",
                  f"| collectives per layer (CUDA lowering, 2 - 1 layers) | {_cc(a['collectives_per_layer'])} |",
                  f"| collectives per layer (CPU lowering) | {_cc(a['cpu_lowering_collectives_per_layer'])} |"]
        if "cpu_compile_collectives_per_layer" in a:
            e = a["expected_per_layer"]
            lines += [f"| collectives per layer (CPU compile, read as `boostjax comm` reads it) | "
                      f"{_cc(a['cpu_compile_collectives_per_layer'])} |",
                      f"| `boostjax comm`'s analytic all-reduce bytes per layer | forward "
                      f"{e['forward_bytes'] / 2**20:.2f} MiB, step {e['step_bytes'] / 2**20:.2f} MiB |"]
        lines += [f"| collectives, whole 2-layer program | {_cc(two['collectives'])} |",
                  f"| custom calls | {_kv(one['custom_calls'])} |",
                  f"| memory kinds of the arguments | {_kv(one['memory_kinds']['arguments']) or 'none (all device)'} |",
                  f"| optimization barriers (1 layer) | {one['optimization_barriers']['count']}, "
                  f"{one['optimization_barriers']['operands']} operands, "
                  f"{one['optimization_barriers']['bytes'] / 2**20:.1f} MiB |",
                  f"| remat policy per checkpoint_name (1 layer, jaxpr) | {_names(a['remat_names_per_layer'])} |"]
        if "full_depth" in a:
            f = a["full_depth"]
            lines += [f"| full depth ({f['n_layers']} layers) | lowered in {f['lower_s']} s, "
                      f"{f['chars'] / 1e6:.1f} MB of text; collectives {_cc(f['collectives'])} |"]
        lines.append("")
    if b:
        s, mk = b["setup"], b["memory_kinds"]
        lines += [f"## (b) 1B CoLA on one GPU with an offload plan ({s['hardware']}, cap {s['cap_gb']} GB, "
                  f"{s['optimizer']}, batch {s['batch']} x {s['seq']}, bf16)", "",
                  f"Plan: `{b['plan_command']}` (status {b['plan']['status']}, predicted peak "
                  f"{b['plan']['predicted_peak_bytes'] / 1e9:.2f} GB, host {b['plan']['predicted_host_bytes'] / 1e9:.2f} GB).",
                  "", "| finding | value |", "|---|---|",
                  f"| attention (`auto`, bf16, cuda) | {b['attention']['path']}: {_kv(b['attention']['cudnn_calls'])} |",
                  *([f"| attention note | {b['attention_note']} |"] if b.get("attention_note") else []),
                  f"| dot_general operand types | {_kv(b['dot_general'])} |",
                  f"| state leaves in pinned_host | params {b['state_leaves_on_host']['params']} of "
                  f"{b['state_leaves_on_host']['params_total']}, optimizer state "
                  f"{b['state_leaves_on_host']['opt_state']} of {b['state_leaves_on_host']['opt_state_total']} |",
                  f"| entry arguments / results by memory kind | {_kv(mk['arguments'])} / {_kv(mk['results'])} |",
                  f"| annotate_device_placement (CUDA lowering) | pinned_host {mk['annotate_pinned_host']}, "
                  f"device {mk['annotate_device']} |",
                  f"| annotate_device_placement (CPU lowering) | pinned_host "
                  f"{b['cpu_lowering_memory_kinds']['annotate_pinned_host']}, device "
                  f"{b['cpu_lowering_memory_kinds']['annotate_device']} |",
                  f"| activation moves (CUDA) | {_kv(mk['moves'])} |",
                  f"| optimization barriers | {b['optimization_barriers']['count']} |",
                  f"| remat policy per checkpoint_name (24 layers, jaxpr) | {_names(b['remat_names'])} |",
                  f"| custom calls | {_kv(b['custom_calls'])} |", ""]
    if res.get("cudnn"):
        c = res["cudnn"]
        note = c["note"] if c.get("ok") else (f"Lowering `--attention cudnn` for CUDA fails while tracing: `{c['error']}`"
                                              + (" (JAX asks the CUDA plugin for cuDNN's version before it emits the "
                                                 "custom call)." if "cuDNN is not detected" in c["error"]
                                                 else " (docs/gpu-program.md)."))
        lines += ["## `--attention cudnn` (a), 1 layer", "", note, ""]
    if res.get("deviceless"):
        lines += deviceless_lines(res["deviceless"])
    if res.get("deviceless_offloaded"):
        lines += deviceless_offloaded_lines(res["deviceless_offloaded"])
    lines += [f"Environment: jax {res['jax']}, backend {res['backend']}; took {res['wall_s']} s on a shared "
              "2-core CPU.", "", f"Reproduce: `{res['command']}`"]
    return "\n".join(lines) + "\n"


def write(out: str, name: str, data: dict, md: str) -> None:
    d = pathlib.Path(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    (d / f"{name}.md").write_text(md)


def cudnn_probe(seq: int) -> dict[str, Any]:
    """`--attention cudnn` lowered for CUDA at 1 layer (7B shapes): the custom calls, or why not."""
    p = SEVEN_B
    m = preset(p["preset"], kind="cola", max_seq_len=seq, n_layers=1, attention="cudnn")
    t = memory.train_config(p["batch"], seq, p["strategy"], p["mesh"], p["remat"], "bfloat16")
    try:
        text = lower(validate(Config(m, t)), "cuda")[0].as_text()
    except Exception as e:  # recorded as the finding
        why = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        return {"ok": False, "error": why, "note": f"Lowering `--attention cudnn` for CUDA fails while tracing: `{why}`"
                + (" (JAX asks the CUDA plugin for cuDNN's version before it emits the custom call)."
                   if "cuDNN is not detected" in why else " (docs/gpu-program.md).")}
    a = attention_path(text, seq)
    return {"ok": True, "attention": a,
            "note": f"`--attention cudnn` lowers to the custom calls {_kv(a['cudnn_calls'])}; [t, t] tensors: "
                    f"{a['tt_tensor_mentions']}."}


def parser() -> argparse.ArgumentParser:
    ap = common.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="(a) at sequence 2048 and without the CPU compile "
                    "comparison or the full-depth lowering (a smoke run)")
    ap.add_argument("--full-depth", action="store_true", help="also lower (a) at the preset's 32 layers (slow: "
                    "the per-layer figures come from 1 and 2 layers either way)")
    ap.add_argument("--no-offload", action="store_true", help="skip (b), the offloaded 1B step and its plan")
    ap.add_argument("--plan", default=None, help="use this plan file for (b) instead of running boostjax plan")
    ap.add_argument("--plan-time-limit", type=float, default=10.0, help="CP-SAT time limit for (b)'s plan, seconds")
    ap.add_argument("--deviceless", default=None, metavar="TARGET_TXTPB",
                    help="also compile (a) at 2 layers for 4 GPUs and (b) for one, described by this XLA GPU target "
                         "config, with no GPU (needs jax-cuda12-plugin with its CUDA libraries and JAX_PLATFORMS=cpu)")
    ap.add_argument("--from-json", default=None, help="re-render the markdown of an earlier gpu_export.json")
    ap.add_argument("--out", default=str(RESULTS), help="folder for gpu_export.{json,md}")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.plan is not None and not os.path.isfile(args.plan):
        print(f"gpu_export: --plan {args.plan} is not a file; fix: pass a plan written by boostjax plan --out",
              file=sys.stderr)
        return 2
    if args.deviceless is not None and not os.path.isfile(args.deviceless):
        print(f"gpu_export: --deviceless {args.deviceless} is not a file; fix: pass a GpuTargetConfigProto text file",
              file=sys.stderr)
        return 2
    if args.plan_time_limit <= 0:
        print("gpu_export: --plan-time-limit must be > 0; fix: pass e.g. --plan-time-limit 30", file=sys.stderr)
        return 2
    if args.from_json:
        res = json.loads(pathlib.Path(args.from_json).read_text())
        write(args.out, "gpu_export", res, markdown(res))
        return 0
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    seq = 2048 if args.quick else SEVEN_B["seq"]
    res: dict[str, Any] = {"jax": jax.__version__, "backend": jax.default_backend()}
    res["seven_b"] = seven_b(seq, full_depth=args.full_depth, compare=not args.quick, log=log)
    res["cudnn"] = cudnn_probe(seq)
    log(f"--attention cudnn: {res['cudnn']['note']}")
    if args.deviceless:
        res["deviceless"] = deviceless(args.deviceless, log, res["seven_b"].get("cpu_compile_two_layers"))
    if not args.no_offload:
        with tempfile.TemporaryDirectory() as tmp:
            path, words = (args.plan, ["plan", "--out", args.plan]) if args.plan else make_plan(tmp, args.plan_time_limit, log)
            res["offloaded"] = offloaded(path, words, log)
            if args.deviceless:
                res["deviceless_offloaded"] = deviceless_offloaded(args.deviceless, path, log)
    res["wall_s"] = round(time.perf_counter() - t0)
    res["command"] = "python -m experiments.gpu.gpu_export" + ("".join(f" {shlex.quote(a)}" for a in argv or sys.argv[1:]))
    write(args.out, "gpu_export", res, markdown(res))
    log(f"wrote {args.out}/gpu_export.json and .md ({res['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
