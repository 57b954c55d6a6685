"""`boostjax plan --auto`: the whole configuration of a run on a cluster (`boostjax.planning`).

    boostjax plan --auto --preset 60m --seq 256 --global-batch 16 --cluster 1x8:cpu --out plan.json
    boostjax plan --auto --preset 7b --seq 4096 --global-batch 64 --cluster 8x8:A100-80GB

Every input is checked before JAX starts (one line, exit 2, nothing written): the cluster string and its
hardware, the model flags, --global-batch and --seq, --data, --out, the cache folder. `--out` writes the
ranked candidates as JSON (each with `step_s`, `peak_bytes_per_device`, `train_command`: the configuration,
and `run_command`: it with `--data`, `--out`, `--steps`) and, beside it, the offload plan file of each
candidate that needs one (its commands pass `--offload-plan` with that path); the terminal shows the
model planned (a warning when its vocabulary is the preset's default), the table with a legend of its
labels, the winner's complete command lines and the cache. `--measure-top K` times the K best-predicted
candidates on this process's devices and makes the measured fastest the winner (`planning.timing`).

Compiled measurements are kept under the user's cache folder (`default_cache_dir`) unless `--cache-dir`
names another or `--no-cache` keeps none: a second plan of the same model reads them and compiles nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from dataclasses import replace

from boostjax.cli.flags import model_from
from boostjax.config import ConfigError, field_default, flag_of, validate_model

# flags of `boostjax plan` that describe one configuration, which --auto picks itself
PICKED = ("batch", "strategy", "mesh", "instance", "hardware", "memory_cap")
# what a run needs besides its configuration, in the printed train command: flag, `plan`'s argument, placeholder
RUN_ARGS = (("--data", "data", "DATA"), ("--out", None, "RUN"), ("--steps", "steps", "STEPS"))


def default_cache_dir() -> pathlib.Path:
    """Where `plan --auto` keeps compiled measurements: `$XDG_CACHE_HOME/boostjax/plan-auto`, else
    `~/.cache/boostjax/plan-auto`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "boostjax" / "plan-auto"


def cache_dir_of(args: argparse.Namespace) -> str | None:
    """The cache folder: `--cache-dir`, else `default_cache_dir()`; None with `--no-cache`, or (a warning)
    when the default cannot be made. A `--cache-dir` that cannot be made or written is refused. Nothing is
    made here (the first measurement written makes the folder)."""
    if args.no_cache:
        if args.cache_dir is not None:
            raise ConfigError("plan.cache_dir: --cache-dir keeps the measurements and --no-cache keeps none; fix: "
                              "pass one of them")
        return None
    path = pathlib.Path(args.cache_dir) if args.cache_dir is not None else default_cache_dir()
    made = next(q for q in (path, *path.parents) if q.exists())  # made when the first measurement is written
    if made.is_dir() and os.access(made, os.W_OK | os.X_OK):
        return str(path)
    if args.cache_dir is not None:
        raise ConfigError(f"plan.cache_dir: {args.cache_dir!r} is not a writable folder; fix: pass another "
                          "--cache-dir, or --no-cache")
    print(f"boostjax: warning: cannot write the cache folder {path}; compiled measurements are not kept (set "
          "XDG_CACHE_HOME or pass --cache-dir DIR)", file=sys.stderr)
    return None


def run_args(args: argparse.Namespace) -> list[str]:
    """`--data`, `--out`, `--steps` for the train command: the values `plan` was given, else placeholders."""
    out: list[str] = []
    for flag, name, placeholder in RUN_ARGS:
        value = getattr(args, name) if name else None
        out += [flag, placeholder if value is None else str(value)]
    return out


def check_auto_out(out: str) -> pathlib.Path:
    """--out: a file path in an existing writable folder, not a file other than an earlier auto plan."""
    p = pathlib.Path(out)
    if p.is_dir() or not p.parent.is_dir() or not os.access(p.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"plan.out: {out!r} is not a writable file path; fix: pass e.g. --out plan_auto.json in "
                          "an existing folder")
    if p.exists():
        try:
            ok = "candidates" in json.loads(p.read_text())
        except (OSError, ValueError, TypeError):
            ok = False
        if not ok:
            raise ConfigError(f"plan.out: {p} exists and is not an auto plan (left untouched); fix: pass another "
                              "--out")
    return p


def vocab_from_args(args: argparse.Namespace) -> tuple[dict[str, int], str]:
    """(model overrides, where the vocabulary comes from), as `boostjax train` takes it from the same flags:
    `--vocab-size`; else a tokenised `--data` folder's meta.json; else the preset's (`search.PRESET_VOCAB`),
    which is the byte-level tokenizer's, what a text or stdlib `--data` trains with."""
    from boostjax.data.source import resolve_source
    from boostjax.planning.search import PRESET_VOCAB

    if args.vocab_size is not None:
        return {}, "given by --vocab-size"
    if args.data is None:
        return {}, PRESET_VOCAB
    try:
        src = resolve_source(args.data)
    except ValueError as e:
        raise ConfigError(f"plan.{e}") from None
    if src.vocab is not None:
        return {"vocab_size": src.vocab}, f"from {src.name}'s meta.json"
    text = {"builtin": "the stdlib corpus", "folder": "a text folder", "text": "a text file"}
    return {}, f"byte-level: --data is {text[src.kind]}" if src.kind in text else PRESET_VOCAB  # a .bin names none


def _inputs(args: argparse.Namespace, run_flags: tuple[str, ...]):
    from boostjax.planning.cluster import parse_cluster

    for name in PICKED:
        if getattr(args, name, None) not in (None, False):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"plan.auto: {flag} is one configuration's, and --auto picks it; fix: drop {flag} "
                              "(--cluster names the hardware)")
    for name in ("attention", "attention_memory"):
        if getattr(args, name, None) is not None:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"plan.auto: --auto prices attention itself (a GPU cluster: cuDNN's flash kernel, "
                              f"a cpu cluster: xla, as its train command says); fix: drop {flag}")
    if args.cluster is None:
        raise ConfigError("plan.cluster: --auto needs the machines; fix: pass --cluster NODESxDEVICES:HARDWARE, "
                          "e.g. --cluster 1x8:cpu")
    cluster = parse_cluster(args.cluster)
    if args.global_batch is None or args.global_batch < 1:
        raise ConfigError(f"plan.global_batch: --auto needs a positive --global-batch (sequences per optimizer "
                          f"step), got {args.global_batch}; fix: pass e.g. --global-batch {8 * cluster.devices}")
    if args.top < 1:
        raise ConfigError(f"plan.top: must be >= 1, got {args.top}; fix: pass --top 5")
    if not args.compile_seconds > 0:
        raise ConfigError(f"plan.compile_seconds: must be > 0, got {args.compile_seconds}; fix: pass "
                          "--compile-seconds 180")
    if args.measure_top < 0:
        raise ConfigError(f"plan.measure_top: must be >= 0, got {args.measure_top}; fix: pass --measure-top 3")
    if args.measure_rounds < 1:
        raise ConfigError(f"plan.measure_rounds: must be >= 1, got {args.measure_rounds}; fix: pass "
                          "--measure-rounds 20")
    if args.measure_top and cluster.nodes > 1 and not cluster.is_cpu:
        raise ConfigError(f"plan.measure_top: times candidates on this process's devices, and {cluster.text} spans "
                          f"{cluster.nodes} nodes; fix: drop --measure-top (or plan one node's cluster on it)")
    if args.max_compiles < 1:
        raise ConfigError(f"plan.max_compiles: must be >= 1, got {args.max_compiles}; fix: pass --max-compiles 16")
    seq = args.seq if args.seq is not None else field_default("seq")
    if seq < 1:
        raise ConfigError(f"plan.seq: must be >= 1, got {seq}; fix: pass {flag_of('seq')} N")
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"plan.steps: must be >= 1, got {args.steps}; fix: pass e.g. {flag_of('steps')} 600")
    vocab, source = vocab_from_args(args)
    model = model_from(args, run_flags, **vocab)
    model = replace(model, max_seq_len=max(model.max_seq_len, seq))
    validate_model(model)
    out = check_auto_out(args.out) if args.out else None
    return cluster, model, seq, out, source, cache_dir_of(args)


def write_offload_plans(rows: list[dict]) -> None:
    """The offload plan file of every candidate that has one, where its `train_command` reads it (never
    replacing a file that is not a boostjax plan)."""
    from boostjax.offload.planfile import Plan
    from boostjax.offload.report import check_out, write_plan

    for r in rows:
        if "offload_plan" in r:
            write_plan(Plan.from_dict(r["offload_plan"]), check_out(r["offload_plan_file"]))


def run_auto(args: argparse.Namespace, run_flags: tuple[str, ...]) -> int:
    """`boostjax plan --auto` (`run_flags`: the model and run flags `boostjax plan` registered)."""
    cluster, model, seq, out, vocab_source, cache_dir = _inputs(args, run_flags)
    from boostjax.planning.search import checked_space

    dtype = args.dtype or ("float32" if cluster.is_cpu else "bfloat16")
    checked_space(model, cluster, args.global_batch, seq, dtype, args.optimizer or "adamw")  # before JAX starts
    from boostjax.runtime.devices import simulate_devices, simulated_device_cap

    # before JAX starts: the CPU cluster's devices (calibrated, trained on); else one node's (the model axis)
    simulate_devices(cluster.devices if cluster.is_cpu else min(cluster.per_node, simulated_device_cap()),
                     "plan.cluster")
    from boostjax.planning.report import plan_json, summary
    from boostjax.planning.search import plan_auto

    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.json else None
    res = plan_auto(model, cluster, args.global_batch, seq, dtype=dtype, optimizer=args.optimizer or "adamw",
                    top=args.top, max_compiles=args.max_compiles, compile_seconds=args.compile_seconds,
                    preset_name=args.preset, cache_dir=cache_dir, log=log,
                    offload_dir=str(out.parent) if out is not None else ".", measure_top=args.measure_top,
                    measure_rounds=args.measure_rounds, run_args=run_args(args), vocab_source=vocab_source)
    doc = plan_json(res, {"model": {k: v for k, v in vars(model).items()}, "preset": args.preset})
    if out is not None:
        write_offload_plans(res.candidates)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        os.replace(tmp, out)
    print(json.dumps(doc, indent=1, default=str) if args.json else summary(res))
    for w in res.warnings if args.json else ():  # (without --json: in the log, before the compiles, and the summary)
        print(f"boostjax: warning: {w}", file=sys.stderr)
    if out is not None and not args.json:
        print(f"plan written to {out}", file=sys.stderr)
    if out is None and any("offload_plan" in r for r in res.candidates):
        print("offload plans not written: pass --out to write them where the +offload train commands read them "
              "(they are in the JSON's offload_plan entries)", file=sys.stderr)
    return 0


__all__ = ["cache_dir_of", "check_auto_out", "default_cache_dir", "run_args", "run_auto", "write_offload_plans"]
