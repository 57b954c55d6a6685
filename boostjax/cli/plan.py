"""`boostjax plan`: build the cost model for a model and hardware, solve the offload plan with CP-SAT,
and compare it with the baseline policies (no offload, full remat, MegaTrain-style streaming).

    boostjax plan --preset tiny --optimizer rotation --out plan.json
    boostjax train --preset tiny --optimizer rotation --offload-plan plan.json

The run's flags are `boostjax train`'s, with train's defaults (`boostjax.cli.flags`): a plan made with
the same flags as a run is made for that run, and `--strategy` / `--mesh` plan one device's share of
that mesh. `--out` writes the plan `boostjax train --offload-plan` applies. More commands, the
vocabulary, the attention memory and what a plan file records: docs/offload.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from dataclasses import replace
from typing import Any

from boostjax.cli.flags import add_field, add_run_flags, model_from, renamed, train_from
from boostjax.cli.plan_auto import run_auto, vocab_from_args
from boostjax.config import (ATTENTION, ATTENTION_MEMORY, Config, ConfigError, MeshShape, check_batch_seq, field_default,
                             flag_of, mesh_text, validate, validate_model)
from boostjax.runtime.profiles import ALIASES, PROFILES, get_profile

GB = 1e9
DEFAULT_HARDWARE = "H800-80GB"
INSTANCES = ("lazytrain-27b",)
MAX_MEMORY_GB = 1e6  # a petabyte: anything larger is a typo (and 1e300 GB overflows to inf bytes)
MAX_TIME_LIMIT_S = 7 * 24 * 3600.0
MAX_PLAN_LAYERS = 1024  # the CP-SAT model grows with L^2 (512 layers: 11 s and 0.6 GB to build)
# the run's flags, as `boostjax train` takes them: the model, the batch, and what shapes the optimizer state
RUN_FLAGS = ("kind", "n_layers", "d_model", "d_ff", "n_heads", "n_kv_heads", "rank", "rank_attn", "rank_kv", "rank_mlp",
             "auto_dense", "vocab_size",
             "batch", "seq", "dtype", "optimizer", "rot_source", "rot_geometry", "rot_max_dim", "strategy", "mesh")


SUMMARY = "offload plan of one run, or with --auto the fastest configuration (mesh, TP, remat, ZeRO) on a cluster"
EXAMPLES = """examples:
  boostjax plan --preset 7b --hardware H800-80GB --memory-cap 70 --batch 8 --seq 2048 --dtype bfloat16 --out plan.json
  boostjax plan --auto --preset 60m --seq 256 --global-batch 16 --cluster 1x8:cpu
  boostjax plan --auto --preset 7b --vocab-size 32000 --seq 4096 --global-batch 64 --cluster 8x8:A100-80GB"""


def _wrap(text: str) -> str:
    """A help paragraph wrapped as argparse wraps (the raw description formatter keeps line breaks)."""
    return textwrap.fill(text, 76)


class _Choices(tuple):
    """train's `--attention` choices (shown, and equal to train's), also accepting `plan --attention`'s
    old values, the attention memory itself (`--attention-memory`'s choices)."""

    def __contains__(self, value: object) -> bool:
        return tuple.__contains__(self, value) or value in ATTENTION_MEMORY


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `plan` subcommand to a `boostjax` argparse subparsers object."""
    p = subparsers.add_parser("plan", help=SUMMARY, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
                              description=_wrap("The offload plan (keep / offload / recompute per layer) of one run on "
                                                "a GPU, or with --auto the whole configuration of a run on a cluster "
                                                "(mesh, TP strategy, micro-batches, pipeline schedule, remat, ZeRO), "
                                                "ranked by predicted step time."))
    add_run_flags(p, RUN_FLAGS)
    r = p.add_argument_group("the run's data and length (as boostjax train takes them)",
                             _wrap("--data gives the vocabulary as train takes it (a boostjax tokenize folder's "
                                   "meta.json, without --vocab-size); --auto writes --data and --steps into the train "
                                   "command it prints (placeholders DATA and STEPS when not given); --steps needs "
                                   "--auto"))
    add_field(r, "data")
    add_field(r, "steps")
    g = p.add_argument_group("planning", _wrap("--attention is train's, the kernel the run uses: the cost model "
                                               "assumes the attention memory it keeps on a CUDA GPU "
                                               "(--attention-memory says it directly)"))
    g.add_argument("--instance", default=None, choices=INSTANCES,
                   help="a fixed published instance instead of a model (lazytrain-27b: 64 layers, 0.703 GiB "
                        "boundaries, 21.55 GB activation budget, H800)")
    g.add_argument("--hardware", default=None,
                   help=f"the GPU the plan prices (its memory, FLOP/s and host link): one of {', '.join(PROFILES)} "
                        f"or an alias ({', '.join(sorted(ALIASES))}) (default: H800-80GB)")
    g.add_argument("--memory-cap", type=float, default=None, metavar="GB",
                   help="device memory budget in GB (1e9 bytes) (default: 90%% of the profile's memory)")
    kernel = add_field(g, "attention")  # train's flag: the kernel the run uses, which sets the attention memory
    kernel.choices = _Choices(ATTENTION)
    g.add_argument("--attention-memory", default=None, choices=ATTENTION_MEMORY,
                   help="attention memory in the cost model: materialized (the step keeps the fp32 [t, t] "
                        "probabilities: the xla kernel, or chunked with the whole sequence in one block) or flash "
                        "(only the log-sum-exp: cudnn, or chunked over several blocks); train checks it against "
                        "its --attention kernel (default: what --attention keeps on a CUDA GPU: auto is cudnn in "
                        "bfloat16/float16, else chunked; --attention materialized/flash, its old spelling, still "
                        "sets it) (not with --auto)")
    g.add_argument("--time-limit", type=float, default=60.0,
                   help="CP-SAT time limit in seconds; the best plan found by then is kept (default: 60)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of the summary")
    g.add_argument("--out", default=None, metavar="PLAN_JSON",
                   help="write the plan here for boostjax train --offload-plan (never replaces a file that is not "
                        "a boostjax plan) (default: not written)")
    a = p.add_argument_group("auto planning (--auto: the whole configuration on a cluster)")
    a.add_argument("--auto", action="store_true",
                   help="pick the mesh, TP strategy, micro-batching, pipeline schedule, remat and ZeRO stage for the "
                        "model on --cluster, ranked by predicted step time (boostjax.planning); needs --cluster and "
                        "--global-batch; takes the model flags, --seq, --dtype, --optimizer, --data, --steps, "
                        "--out, --json and the flags below")
    a.add_argument("--cluster", default=None, metavar="NODESxDEVICES:HARDWARE",
                   help="--auto (required with it): the machines, e.g. 2x8:A100-80GB (a hardware profile or alias) "
                        "or 1x8:cpu (this machine's simulated CPU devices, rates measured by a micro-benchmark)")
    a.add_argument("--global-batch", type=int, default=None, metavar="N",
                   help="--auto (required with it): sequences per optimizer step over the whole cluster")
    a.add_argument("--top", type=int, default=5,
                   help="--auto: candidates planned in full and shown; a configuration whose time bound is slower "
                        "than the TOP-th is not compiled (default: 5)")
    a.add_argument("--max-compiles", type=int, default=16, metavar="N",
                   help="--auto: compile at most N measurements (a TP size, strategy, micro-batch and remat each); "
                        "candidates past it are counted as skipped (default: 16)")
    a.add_argument("--compile-seconds", type=float, default=180.0, metavar="S",
                   help="--auto: start no compile (or offload solve) after S seconds of search; candidates past "
                        "it are counted as skipped, and a later plan with the same --cache-dir reads what was "
                        "compiled and goes further (default: 180)")
    a.add_argument("--measure-top", type=int, default=0, metavar="K",
                   help="--auto: compile and time the K best-predicted candidates' training steps on this "
                        "process's devices (a cpu cluster, or one node of the cluster the plan runs on), "
                        "interleaved, and make the measured fastest the winner; the ranking stays the "
                        "prediction's (default: 0, none timed)")
    a.add_argument("--measure-rounds", type=int, default=20, metavar="N",
                   help="--auto --measure-top: steps timed per candidate, one of each in turn (default: 20)")
    a.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="--auto: keep compiled measurements here as JSON, keyed by configuration (and the JAX "
                        "version and backend), for later plans (default: $XDG_CACHE_HOME/boostjax/plan-auto, "
                        "else ~/.cache/boostjax/plan-auto)")
    a.add_argument("--no-cache", action="store_true",
                   help="--auto: keep no compiled measurements on disk, read none (not with --cache-dir)")
    p.set_defaults(func=_cmd_plan)
    return p


def _number(args: argparse.Namespace, name: str, low: float, high: float, example: str) -> float:
    """A finite float flag in (low, high]; NaN and inf are refused (NaN passes every comparison test)."""
    v = getattr(args, name)
    flag = "--" + name.replace("_", "-")
    if not (math.isfinite(v) and low < v <= high):
        raise ConfigError(f"plan.{name}: must be a finite number in ({low:g}, {high:g}], got {v}; "
                          f"fix: pass e.g. {flag} {example}")
    return v


def attention_memory(args: argparse.Namespace, model: Any, seq: int, dtype: str) -> str:
    """What the cost model assumes attention keeps: `--attention-memory` (or `--attention materialized/flash`,
    its old spelling), else what `model.attention` (train's `--attention`, the kernel) keeps on a CUDA GPU
    (`planning.offloading.gpu_attention_memory`); a kernel and a memory that disagree are refused."""
    from boostjax.planning.offloading import gpu_attention_memory

    old = args.attention if args.attention in ATTENTION_MEMORY else None
    memory = args.attention_memory
    if old and memory and old != memory:
        raise ConfigError(f"plan.attention_memory: --attention {old} and --attention-memory {memory} disagree; "
                          f"fix: pass --attention-memory {memory} alone")
    memory = memory or old
    kept = gpu_attention_memory(model, seq, dtype)
    if memory and args.attention in ATTENTION and memory != kept:
        raise ConfigError(f"plan.attention_memory: --attention {args.attention} keeps {kept} attention memory "
                          f"(seq {seq}, {dtype}, block {model.attention_block}), not {memory}; fix: drop "
                          "--attention-memory, or pass the kernel the run uses")
    return memory or kept


def instance_from_args(args: argparse.Namespace) -> Any:
    """The plan instance (`boostjax.offload.costmodel.PlanInstance`) the flags describe: the instance of the
    run `boostjax train` makes from the same flags (`boostjax.offload.apply.instance_for`). Raises
    ConfigError on bad shapes or numbers, before anything is solved."""
    from boostjax.offload.apply import instance_for
    from boostjax.offload.costmodel import lazytrain_27b
    from boostjax.sharding.rules import check_mesh_for

    cap = None
    if args.memory_cap is not None:
        cap = _number(args, "memory_cap", 0.0, MAX_MEMORY_GB, "70") * GB
    _number(args, "time_limit", 0.0, MAX_TIME_LIMIT_S, "60")
    try:
        hw = get_profile(args.hardware or DEFAULT_HARDWARE)
    except ValueError:
        raise ConfigError(f"plan.hardware: unknown profile {args.hardware!r}; fix: pass one of {', '.join(PROFILES)} "
                          f"(or an alias: {', '.join(sorted(ALIASES))})") from None
    strategy = args.strategy or field_default("strategy")
    if args.instance == "lazytrain-27b":
        if strategy != "none" or args.mesh:
            raise ConfigError(f"plan.instance: lazytrain-27b is a fixed one-device instance; fix: drop "
                              f"{flag_of('strategy')} and {flag_of('mesh')}, or plan a model (--preset ...) instead "
                              "of --instance")
        inst = lazytrain_27b(hw)
        return inst if cap is None else inst.with_budget(cap)
    batch = args.batch if args.batch is not None else field_default("batch")
    seq = args.seq if args.seq is not None else field_default("seq")
    check_batch_seq(batch, seq, "plan")
    if args.n_layers is not None and args.n_layers > MAX_PLAN_LAYERS:
        raise ConfigError(f"plan.n_layers: {args.n_layers} layers exceed the planner's {MAX_PLAN_LAYERS}; "
                          f"fix: pass {flag_of('n_layers')} <= {MAX_PLAN_LAYERS}")
    mesh = MeshShape.parse(args.mesh, "plan.mesh") if args.mesh is not None else None
    vocab, _ = vocab_from_args(args)
    kernel = {"attention": args.attention} if args.attention in ATTENTION else {}
    model = model_from(args, RUN_FLAGS, **vocab, **kernel)
    model = replace(model, max_seq_len=max(model.max_seq_len, seq))  # plan has no --max-seq-len
    cfg = Config(model, train_from(args, RUN_FLAGS, mesh=mesh))
    validate_model(cfg.model)
    check_mesh_for(cfg.model, strategy, mesh_text(mesh), batch, seq, "plan")
    try:
        validate(cfg)
    except ConfigError as e:
        raise ConfigError(renamed(e, "plan")) from None
    return instance_for(cfg, hw, budget_bytes=cap, attention=attention_memory(args, model, seq, cfg.train.dtype))


def solve(inst: Any, time_limit_s: float) -> Any:
    """`boostjax.offload.planner.solve` (imported when the command runs: the parser imports no JAX)."""
    from boostjax.offload.planner import solve as solve_plan

    return solve_plan(inst, time_limit_s=time_limit_s)


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.auto:
        return run_auto(args, RUN_FLAGS)
    for flag, value in (("--cluster", args.cluster), ("--global-batch", args.global_batch),
                        ("--cache-dir", args.cache_dir), ("--no-cache", args.no_cache or None),
                        ("--measure-top", args.measure_top or None), ("--steps", args.steps)):
        if value is not None:
            raise ConfigError(f"plan: {flag} plans a whole configuration; fix: add --auto, or drop {flag}")
    inst = instance_from_args(args)
    from boostjax.offload.planner import BASELINES, PlanInfeasible, baseline_plan
    from boostjax.offload.report import check_out, gpu_host_note, report, summary, write_plan

    out = check_out(args.out) if args.out else None  # before the solve: a bad --out costs nothing
    baselines = {n: baseline_plan(inst, n) for n in BASELINES}
    try:
        plan = solve(inst, time_limit_s=args.time_limit)
    except PlanInfeasible as e:
        need = e.min_budget_bytes
        raise ConfigError(f"plan.memory_cap: no plan fits {inst.budget_bytes / GB:.6g} GB for {inst.name}; "
                          f"the smallest budget that works is {need / GB:.6g} GB; "
                          f"fix: pass --memory-cap {math.ceil(need / GB * 1e4) / 1e4:g} or more") from None
    rep = report(inst, plan, baselines)
    if out is not None:
        write_plan(plan, out)
        rep["out"] = args.out
    print(json.dumps(rep, indent=1) if args.json else summary(rep))
    if (note := gpu_host_note(plan)) is not None:
        print(note, file=sys.stderr)
    if args.out and not args.json:
        print(f"plan written to {args.out} (apply it with boostjax train --offload-plan {args.out})", file=sys.stderr)
    return 0


__all__ = ["INSTANCES", "RUN_FLAGS", "attention_memory", "instance_from_args", "register", "solve", "vocab_from_args"]
