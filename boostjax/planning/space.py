"""The search space of `boostjax plan --auto`: every configuration that divides a cluster, checked as
`boostjax train` would check it, with analytic lower bounds on its memory and time.

A `Candidate` uses every device (`data x stage x model`) and splits the global batch as
`data x micro_batch x slots`; `enumerate_space` keeps the splits train's checks accept, `accepted`
checks one candidate in full. `memory_lower_bound`, `time_lower_bound` and `comm_lower_bound` lie below
what the compiled model predicts, so the search drops by them without compiling. Detail:
docs/planning.md ("Search space", "Pruning").
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

from boostjax import placement
from boostjax.config import (DEFAULT_PRESET, PRESETS, REMAT, TP_STRATEGIES, Config, ConfigError, ModelConfig,
                             TrainConfig, flag_of, negated_flag_of, validate)
from boostjax.models.flops import flops_per_token, param_count
from boostjax.planning.cluster import Cluster
from boostjax.planning.costs import Hardware, coll_time
from boostjax.sharding.pipeline import activation_slots
from boostjax.sharding.rules import STRATEGIES

ITEMSIZE = {"float32": 4, "bfloat16": 2}
ADAM_STATE_BYTES = 8  # fp32 mu and nu per parameter (other optimizers: bounded by 0)


@dataclass(frozen=True)
class Candidate:
    data: int
    stage: int
    model: int
    strategy: str
    micro_batch: int  # rows per data shard in one micro-batch
    slots: int  # micro-batches per optimizer step (grad accumulation, or pipeline micro-batches)
    schedule: str  # gpipe / 1f1b with stages; "-" without
    remat: str
    zero: int

    @property
    def mesh(self) -> str:
        stage = f"stage={self.stage}," if self.stage > 1 else ""
        return f"data={self.data},{stage}model={self.model}"

    @property
    def label(self) -> str:
        parts = [f"D{self.data}", *([f"PP{self.stage} {self.schedule}"] if self.stage > 1 else []),
                 f"TP{self.model}" + (f" {self.strategy}" if self.model > 1 else ""),
                 f"mb{self.micro_batch}x{self.slots}", f"remat {self.remat}", f"ZeRO{self.zero}"]
        return " ".join(parts)

    def train_fields(self, seq: int, dtype: str, optimizer: str) -> dict[str, Any]:
        """The TrainConfig fields `boostjax train` takes for this candidate."""
        f: dict[str, Any] = {"seq": seq, "dtype": dtype, "optimizer": optimizer, "strategy": self.strategy,
                             "mesh": self.mesh, "remat": self.remat, "zero": self.zero}
        if self.stage > 1:
            f.update(batch=self.data * self.micro_batch * self.slots, microbatches=self.slots,
                     pipeline_schedule=self.schedule)
        else:
            f.update(batch=self.data * self.micro_batch, grad_accum=self.slots)
        return f


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def strategies_for(model: ModelConfig, tp: int) -> list[str]:
    if tp == 1:
        return ["none"]
    return [s for s in TP_STRATEGIES if model.kind in STRATEGIES[s].kinds]


def enumerate_space(model: ModelConfig, cluster: Cluster, global_batch: int, seq: int, dtype: str,
                    optimizer: str) -> tuple[list[Candidate], dict[str, int]]:
    """Every candidate `boostjax train` accepts, and counts (`enumerated`, `invalid`)."""
    remats = [r for r in REMAT if r != "lowrank" or model.low_rank]
    out, seen, invalid = [], 0, 0
    for tp in (t for t in divisors(cluster.devices) if t <= cluster.per_node):  # TP stays inside a node
        for stage in divisors(cluster.devices // tp):
            data = cluster.devices // (tp * stage)
            if global_batch % data:
                continue
            rows = global_batch // data
            for strategy in strategies_for(model, tp):
                for mb in divisors(rows):
                    base = Candidate(data, stage, tp, strategy, mb, rows // mb, "gpipe" if stage > 1 else "-",
                                     "none", 0)
                    ok = accepted(model, base, seq, dtype, optimizer)  # the shape checks: once per split
                    for sched in (("gpipe", "1f1b") if stage > 1 else ("-",)):
                        for remat in remats:
                            for zero in ((0, 1, 3) if data > 1 else (0,)):
                                seen += 1
                                if ok:
                                    out.append(replace(base, schedule=sched, remat=remat, zero=zero))
                                else:
                                    invalid += 1
    return out, {"enumerated": seen, "invalid": invalid}


def accepted(model: ModelConfig, c: Candidate, seq: int, dtype: str, optimizer: str) -> bool:
    """`boostjax train` accepts the candidate's Config (`config.validate`, `placement.check`)."""
    f = c.train_fields(seq, dtype, optimizer)
    try:
        cfg = validate(Config(model, TrainConfig(**f)))
        placement.check(cfg)
    except ConfigError:
        return False
    return True


def in_flight(c: Candidate) -> int:
    """Micro-batches whose activations a stage holds at once: 1 without stages, else the schedule's
    activation slots (`sharding.pipeline.activation_slots`: GPipe M + P - 1, 1F1B 2P - 1)."""
    return 1 if c.stage == 1 else activation_slots(c.schedule, c.stage, c.slots)


def memory_lower_bound(model: ModelConfig, c: Candidate, seq: int, dtype: str, optimizer: str) -> float:
    """Bytes one device holds at least (docs/planning.md)."""
    share = param_count(model) / (c.stage * c.model)
    opt = ADAM_STATE_BYTES if optimizer == "adamw" else 0
    state = share * (4 / (c.data if c.zero >= 3 else 1) + 4 / (c.data if c.zero >= 3 else 1)
                     + opt / (c.data if c.zero >= 1 else 1))
    residual = c.micro_batch * seq * model.d_model / c.model * ITEMSIZE.get(dtype, 4)
    return state + residual * (model.n_layers / c.stage) * in_flight(c)


def time_lower_bound(model: ModelConfig, c: Candidate, seq: int, global_batch: int, flops_per_s: float) -> float:
    """Seconds per optimizer step at least (docs/planning.md); `flops_per_s`: one device's eta x peak."""
    devices = c.data * c.stage * c.model
    work = flops_per_token(model, seq) * global_batch * seq / devices
    stretch = (c.slots + c.stage - 1) / c.slots
    return work * stretch / flops_per_s


def axis_bus(cluster: Cluster, hw: Hardware, size: int, inner: int) -> float:
    """Bandwidth of a collective over a mesh axis of `size` devices whose inner axes hold `inner`: the
    inter-node rate where the axis spans nodes, the node's bus otherwise."""
    return hw.p2p_bytes_per_s if cluster.crosses_nodes(size, inner) else hw.bus_bytes_per_s


def send_bytes(model: ModelConfig, c: Candidate, seq: int, dtype: str) -> float:
    """Bytes of one pipeline send: a micro-batch's `[micro_batch, seq, width]` stage output in the compute
    dtype (width d_model / model under BTP, whose residual is sharded; d_model otherwise)."""
    width = model.d_model // c.model if c.strategy == "btp" else model.d_model
    return c.micro_batch * seq * width * ITEMSIZE.get(dtype, 4)


def pipeline_collectives(c: Candidate, feature_bytes: float, top_bytes: float = 0.0) -> list[tuple[str, float, int]]:
    """(kind, result bytes, times per step) of a pipeline's collectives over `stage`, as its compiled step
    runs them (`feature_bytes`: one send, `send_bytes`; `top_bytes`: a device's fp32 embedding, norm and head):
    - the stages run in lockstep: each of the `slots + stage - 1` ticks ends in a `ppermute` of its output to
      the next stage and, in the backward (GPipe's transposed loop, 1F1B's own), one of its gradient back;
      the next tick waits for it (XLA drops a last send nothing reads where it unrolls a one-tick loop);
    - the last stage's features are reduce-scattered so every stage runs the head on 1/stage of the tokens,
      their cotangents all-gathered back: GPipe once for all micro-batches, 1F1B once per micro-batch;
    - GPipe's backward all-reduces the embedded micro-batch's cotangent over the stages in every tick;
    - the stage-replicated embedding, norm and head all-reduce their gradients once (GPipe's without the
      embedding, which those per-tick sums replace: `top_bytes` over-counts it there)."""
    if c.stage == 1:
        return []
    ticks = c.slots + c.stage - 1
    heads = c.slots if c.schedule == "1f1b" else 1
    feat = feature_bytes * c.slots / heads
    out = [("collective-permute", feature_bytes, 2 * ticks), ("reduce-scatter", feat / c.stage, heads),
           ("all-gather", feat, heads), ("all-reduce", top_bytes, 1)]
    return out + ([("all-reduce", feature_bytes, ticks)] if c.schedule == "gpipe" else [])


def pipeline_sends_s(c: Candidate, nbytes: float, cluster: Cluster, hw: Hardware) -> float:
    """Seconds per step of the pipeline's sends of `nbytes` each (`pipeline_collectives`' ppermutes), between
    nodes at the inter-node link or within a node at the bus."""
    sends = sum(n for kind, _, n in pipeline_collectives(c, nbytes) if kind == "collective-permute")
    if not sends:
        return 0.0
    if cluster.crosses_nodes(c.stage, c.model):
        return sends * (hw.p2p_alpha_s + nbytes / hw.p2p_bytes_per_s)
    return sends * coll_time("collective-permute", nbytes, c.stage, hw)


def comm_lower_bound(model: ModelConfig, c: Candidate, seq: int, dtype: str, cluster: Cluster, hw: Hardware) -> float:
    """Seconds per optimizer step of the data-axis gradient traffic and the pipeline sends at least:
    `predict.predict`'s formulas on the analytic fp32 parameter bytes of one device's share,
    `4 x param_count / (stage x model)` (the compiled step's parameter bytes, which `predict` uses,
    are at least that: a stage also holds the embedding and head, TP replicates the norms)."""
    d = c.data
    w = 4.0 * param_count(model) / (c.stage * c.model)
    dp_bus = axis_bus(cluster, hw, d, c.stage * c.model)
    if d == 1:
        dp = 0.0
    elif c.zero >= 1:  # gathered once per step and kept for every micro-batch (ZeRO 3 as its compiled step does)
        dp = coll_time("reduce-scatter", w / d, d, hw, dp_bus) + coll_time("all-gather", w, d, hw, dp_bus)
    else:
        dp = coll_time("all-reduce", w, d, hw, dp_bus)
    return dp + pipeline_sends_s(c, send_bytes(model, c, seq, dtype), cluster, hw)


def model_flags(model: ModelConfig, preset_name: str | None = None) -> list[str]:
    """`--preset NAME` and the model flags that differ from it: the model as `boostjax train` takes it."""
    name = preset_name or DEFAULT_PRESET
    base = PRESETS[name]
    out = ["--preset", name]
    for f in fields(ModelConfig):
        v = getattr(model, f.name)
        if v == getattr(base, f.name) or f.name == "max_seq_len":
            continue
        if isinstance(v, bool):
            out.append(flag_of(f.name) if v else negated_flag_of(f.name))
        else:
            out += [flag_of(f.name), str(v)]
    return out


def train_argv(model: ModelConfig, c: Candidate, seq: int, dtype: str, optimizer: str, cluster: Cluster,
               preset_name: str | None = None, offload_plan: str | None = None) -> list[str]:
    """`boostjax train ...` for this candidate on `cluster` (CPU: the materialised attention it was priced
    with; `offload_plan`: the path of its offload plan file)."""
    argv = ["boostjax", "train", *model_flags(model, preset_name)]
    for k, v in c.train_fields(seq, dtype, optimizer).items():
        default = TrainConfig.__dataclass_fields__[k].default
        if k in ("batch", "seq", "mesh", "strategy") or v != default:
            argv += [flag_of(k), str(v)]
    if seq > model.max_seq_len:
        argv += [flag_of("max_seq_len"), str(seq)]
    if cluster.is_cpu and model.attention != "xla":
        argv += [flag_of("attention"), "xla"]
    if offload_plan:
        argv += [flag_of("offload_plan"), offload_plan]
    return argv


# what a run needs beyond its configuration, as placeholders the user fills: the corpus, the run folder, the steps
RUN_PLACEHOLDERS: tuple[str, ...] = ("--data", "DATA", "--out", "RUN", "--steps", "STEPS")


def _shell(argv: list[str]) -> str:
    """A shell line; `$NAME` words (the node's address and rank) stay unquoted for the shell to fill."""
    return " ".join(a if a.startswith("$") else shlex.quote(a) for a in argv)


def commands(model: ModelConfig, c: Candidate, seq: int, dtype: str, optimizer: str, cluster: Cluster,
             preset_name: str | None = None, offload_plan: str | None = None,
             run_args: Sequence[str] = RUN_PLACEHOLDERS) -> dict[str, str]:
    """`train_command` (one node; with several nodes each runs it with its own process id) and
    `launch_command` (several processes on this machine: `boostjax launch`), as shell lines: the
    configuration, at train's defaults for the rest. `run_command` / `launch_run_command`: the same
    with `run_args` (`--data`, `--out`, `--steps`: placeholders or the values given) appended."""
    argv = train_argv(model, c, seq, dtype, optimizer, cluster, preset_name, offload_plan)
    run = list(run_args)
    if cluster.nodes > 1 and not cluster.is_cpu:
        argv += [flag_of("coordinator"), "$COORDINATOR:12355", flag_of("num_processes"), str(cluster.nodes),
                 flag_of("process_id"), "$NODE_RANK"]
        return {"train_command": _shell(argv), "run_command": _shell(argv + run)}
    out = {"train_command": shlex.join(argv), "run_command": shlex.join(argv + run)}
    if cluster.nodes > 1:
        launch = ["boostjax", "launch", "--num-processes", str(cluster.nodes), "--", *argv[1:]]
        out.update(launch_command=shlex.join(launch), launch_run_command=shlex.join(launch + run))
    return out


def with_seq(model: ModelConfig, seq: int) -> ModelConfig:
    return replace(model, max_seq_len=max(model.max_seq_len, seq))


__all__ = ["RUN_PLACEHOLDERS", "Candidate", "accepted", "axis_bus", "comm_lower_bound", "commands", "divisors", "enumerate_space", "in_flight", "memory_lower_bound",
           "model_flags", "pipeline_collectives", "pipeline_sends_s", "send_bytes", "strategies_for", "time_lower_bound", "train_argv", "with_seq"]
