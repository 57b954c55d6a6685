"""`boostjax comm`: the communication and memory of a compiled step per TP strategy (`comm_report`),
as a table or JSON. Every flag is checked before JAX starts."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any, Sequence

from boostjax.config import (ATTENTION, DTYPES, LOW_RANK_KINDS, OPTIMIZERS, PIPELINE_SCHEDULES, PRESETS, REMAT,
                             TP_STRATEGIES, Config, ConfigError, MeshShape, ModelConfig, TrainConfig, check_batch_seq,
                             preset, validate)


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `comm` subcommand to a `boostjax` argparse subparsers object."""
    p = subparsers.add_parser("comm", help="all-reduce count and bytes, and peak memory per device, of the "
                              "compiled step, per TP strategy")
    p.add_argument("--preset", default="7b", help=f"model shapes: one of {', '.join(PRESETS)} (default: 7b)")
    p.add_argument("--model", default="cola", choices=LOW_RANK_KINDS,
                   help="low-rank kind for vanilla-tp and btp (fullrank-tp uses the dense llama) (default: cola)")
    p.add_argument("--mesh", default="data=1,model=4", help="device mesh (default: data=1,model=4)")
    p.add_argument("--batch", type=int, default=4, help="global batch (default: 4)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default: 4096)")
    p.add_argument("--strategy", default="all", choices=(*TP_STRATEGIES, "all"), help="TP strategy (default: all)")
    p.add_argument("--remat", default="none", choices=REMAT, help="rematerialisation policy (default: none)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="compute dtype (default: bfloat16)")
    p.add_argument("--attention", default="auto", choices=ATTENTION,
                   help="attention kernel (default: auto = chunked off a CUDA GPU, no [t, t] buffer)")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="optimizer (default: adamw)")
    p.add_argument("--zero", type=int, default=0, help="optimizer-state sharding over data: 0, 1 or 3 (default: 0)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches of --batch rows per step (default: 1)")
    p.add_argument("--pipeline-schedule", default="gpipe", choices=PIPELINE_SCHEDULES,
                   help="pipeline schedule with stage= in --mesh (default: gpipe)")
    p.add_argument("--microbatches", type=int, default=0,
                   help="pipeline micro-batches per data shard with stage= in --mesh (default: 0 = auto)")
    p.add_argument("--json", action="store_true", help="print one JSON object {strategy: report}")
    p.add_argument("--dump-hlo", default=None, metavar="DIR", help="write DIR/<strategy>.hlo.txt and .fwd.hlo.txt")
    p.set_defaults(func=_cmd_comm)
    return p


def _table(reports: dict[str, dict[str, Any]]) -> str:
    from boostjax.analysis.memory import GIB

    base = reports.get("fullrank-tp")
    head = (f"{'strategy':<12} {'fwd GiB/layer':>13} {'step GiB/layer':>14} {'fwd x full':>10} {'step x full':>11} "
            f"{'AR/layer fwd':>12} {'AR/layer step':>13} {'step GiB':>9} {'peak GiB':>9} {'weights':>8} "
            f"{'optim':>8} {'activ':>8} {'K (layer GEMMs)':<24}")
    lines = [head, "-" * len(head)]
    for name, r in reports.items():
        ratio = lambda k: f"{r[k] / base[k]:.3f}" if base and base[k] else "-"  # noqa: E731
        ks = sorted(set(r["gemms"]["projection_k"]))
        lines.append(f"{name:<12} {r['forward_allreduce_bytes_per_layer'] / GIB:>13.4f} "
                     f"{r['allreduce_bytes_per_layer'] / GIB:>14.4f} {ratio('forward_allreduce_bytes_per_layer'):>10} "
                     f"{ratio('allreduce_bytes_per_layer'):>11} {r['forward_allreduce_count_per_layer']:>12} "
                     f"{r['allreduce_count_per_layer']:>13} {r['allreduce_bytes'] / GIB:>9.3f} "
                     f"{r['peak_bytes_per_device'] / GIB:>9.3f} {r['weight_bytes'] / GIB:>8.3f} "
                     f"{r['optimizer_bytes'] / GIB:>8.3f} {r['activation_bytes'] / GIB:>8.3f} {','.join(map(str, ks)):<24}")
    r0 = next(iter(reports.values()))
    lines.append(f"({r0['dtype']}, mesh {r0['mesh']}, batch {r0['batch']}, seq {r0['seq']}, remat {r0['remat']}; "
                 "collective bytes per device, one direction; peak = memory_analysis() argument + output - alias + "
                 "temp per device = weights + optimizer state + activations (temporaries, gradients, batch); "
                 "GiB = 2^30)")
    return "\n".join(lines)


def _comm_error(e: ConfigError) -> ConfigError:
    """A `train.*` message from the shared validation, renamed to the `comm.*` flag it came from."""
    text = str(e)
    return ConfigError("comm." + text[len("train."):] if text.startswith("train.") else text)


def _check_args(args: argparse.Namespace, names: Sequence[str]) -> tuple[ModelConfig, MeshShape]:
    """Every flag of `boostjax comm`, checked before JAX starts; returns the model and the mesh (`--mesh`
    parsed here, once)."""
    from boostjax.analysis.comm import check_dump_dir, model_for

    check_batch_seq(args.batch, args.seq, "comm")
    mesh = MeshShape.parse(args.mesh, "comm.mesh")
    if mesh is None:
        raise ConfigError("comm.mesh: a mesh is required; fix: pass --mesh data=1,model=4")
    if args.batch % mesh.data:
        raise ConfigError(f"comm.batch: {args.batch} is not divisible by data={mesh.data}; "
                          f"fix: pass --batch a multiple of {mesh.data}")
    base = preset(args.preset, kind=args.model)
    base = replace(base, max_seq_len=max(base.max_seq_len, args.seq),  # comm has no --max-seq-len
                   attention=args.attention)
    for s in names:
        try:
            validate(Config(model_for(base, s), _train(args, s, mesh)))
        except ConfigError as e:
            raise _comm_error(e) from None
    if args.dump_hlo is not None:
        check_dump_dir(args.dump_hlo, names)
    return base, mesh


def _train(args: argparse.Namespace, strategy: str, mesh: MeshShape) -> TrainConfig:
    """The `TrainConfig` a strategy's step is compiled with."""
    return TrainConfig(batch=args.batch, seq=args.seq, strategy=strategy, mesh=mesh, remat=args.remat,
                       dtype=args.dtype, **_train_fields(args))


def _train_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The `TrainConfig` fields of `boostjax comm`'s flags beyond batch/seq/strategy/mesh/remat/dtype."""
    return {"optimizer": args.optimizer, "microbatches": args.microbatches, "zero": args.zero,
            "grad_accum": args.grad_accum, "pipeline_schedule": args.pipeline_schedule}


def _cmd_comm(args: argparse.Namespace) -> int:
    names = TP_STRATEGIES if args.strategy == "all" else (args.strategy,)
    base, mesh = _check_args(args, names)
    from boostjax.analysis.comm import comm_report, model_for
    from boostjax.runtime.devices import exact_low_precision, simulate_for_mesh

    exact_low_precision()
    try:
        simulate_for_mesh(mesh, "comm.mesh")
    except RuntimeError as e:  # JAX already started with fewer devices
        raise ConfigError(f"comm.mesh: {e}") from e
    import jax

    from boostjax.placement import check as check_run
    from boostjax.sharding.rules import check_strategy

    devices, visible = mesh.devices, jax.device_count()
    if devices > visible:  # e.g. an accelerator with fewer devices than the mesh (nothing simulated)
        raise ConfigError(f"comm.mesh: {mesh} needs {devices} devices but {visible} are visible; "
                          f"fix: pick sizes whose product is at most {visible}")

    for s in names:  # every strategy's shapes before the first (possibly long) compile
        try:
            check_strategy(model_for(base, s), s, mesh.model)
        except ConfigError as e:
            what = str(e).split("; fix:")[0]
            raise ConfigError(f"comm.mesh: {what}; fix: pass a --mesh model size that divides the {args.preset} "
                              "preset's shapes, or another --preset") from None
        try:  # what the placement needs of the configuration (pipeline micro-batches, ...)
            check_run(Config(model_for(base, s), _train(args, s, mesh)))
        except ConfigError as e:
            raise _comm_error(e) from None
    reports = {s: comm_report(base, mesh, args.batch, args.seq, s, args.remat, args.dtype, args.dump_hlo,
                              **_train_fields(args)) for s in names}
    print(json.dumps(reports, indent=1) if args.json else _table(reports))
    return 0
