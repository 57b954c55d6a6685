"""`boostjax comm`: the communication and memory of a compiled step per TP strategy (`comm_report`),
as a table or JSON. Every flag is checked before JAX starts."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace
from typing import Any, Sequence

from boostjax.cli.flags import add_run_flags, model_from, renamed, train_from
from boostjax.config import (LOW_RANK_KINDS, TP_STRATEGIES, Config, ConfigError, MeshShape, ModelConfig, TrainConfig,
                             DEFAULT_PRESET, check_batch_seq, flag_of, validate)

# the run's flags, as `boostjax train` takes them (with train's defaults); --compare is comm's own (below)
RUN_FLAGS = ("kind", "attention", "batch", "seq", "mesh", "remat", "dtype", "optimizer", "zero", "grad_accum",
             "pipeline_schedule", "microbatches")
COMPARED = (*TP_STRATEGIES, "all")


def register(subparsers) -> argparse.ArgumentParser:
    """Add the `comm` subcommand to a `boostjax` argparse subparsers object."""
    p = subparsers.add_parser("comm", help="all-reduces and peak memory of the compiled step per TP strategy",
                              description="Compile one training step per TP strategy on --mesh (required: its "
                                          "model axis is the TP size) and report its all-reduces and peak memory "
                                          "per device.")
    add_run_flags(p, RUN_FLAGS)
    g = p.add_argument_group("comparison")
    g.add_argument("--compare", default="all", choices=COMPARED,
                   help="the TP strategies to compile and compare: one, or all three (fullrank-tp runs the dense "
                        "llama, vanilla-tp and btp the low-rank --model); also spelled --strategy, its older "
                        "name (default: all)")
    # the older name: it kept comm's choices (no 'none', an 'all'), so it is left out of the help, where
    # --strategy is train's (one strategy of a run)
    g.add_argument("--strategy", default=None, choices=COMPARED, help=argparse.SUPPRESS)
    g.add_argument("--json", action="store_true", help="print one JSON object {strategy: report}")
    g.add_argument("--dump-hlo", default=None, metavar="DIR", help="write DIR/<strategy>.hlo.txt and .fwd.hlo.txt "
                                                                   "(default: not written)")
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
    lines += [_zero_line(name, r["data_parallel"]) for name, r in reports.items() if "reduce_vs_zero0" in r["data_parallel"]]
    return "\n".join(lines)


def _zero_line(name: str, dp: dict[str, Any]) -> str:
    """What ZeRO's reduce-scatter saves: the gradient's reduction over data against ZeRO 0's all-reduce."""
    names: dict[str, int] = {}
    for n in dp["unsplit_gradients"]:  # one entry per leaf of every layer: layers/*/attn/norm x L
        key = re.sub(r"^layers/\d+/", "layers/*/", n)
        names[key] = names.get(key, 0) + 1
    whole = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in names.items()) or "none"
    return (f"{name} zero {dp['zero']}: the gradient's reduction over data={dp['data']} sends "
            f"{dp['reduce_ring_bytes'] / 2**20:.3f} MiB per device (ring) = {dp['reduce_vs_zero0']:.4f} x zero 0's "
            f"all-reduce ({dp['zero0_reduce_ring_bytes'] / 2**20:.3f} MiB); leaves left whole (all-reduced): {whole}")


def _comm_error(e: ConfigError) -> ConfigError:
    """A `train.*` message from the shared validation, renamed to the `comm.*` flag it came from."""
    return ConfigError(renamed(e, "comm"))


def _check_args(args: argparse.Namespace, names: Sequence[str]) -> tuple[ModelConfig, MeshShape]:
    """Every flag of `boostjax comm`, checked before JAX starts; returns the model and the mesh (`--mesh`
    parsed here, once)."""
    from boostjax.analysis.comm import check_dump_dir, model_for

    t = train_from(args, RUN_FLAGS, mesh=None)
    check_batch_seq(t.batch, t.seq, "comm")
    base = model_from(args, RUN_FLAGS)
    mesh = MeshShape.parse(args.mesh, "comm.mesh") if args.mesh is not None else None
    if mesh is None:
        raise ConfigError(f"comm.mesh: comm compiles the step on a device mesh and none was given; fix: pass e.g. "
                          f"{flag_of('mesh')} data=1,model=4")
    if t.batch % mesh.data:
        raise ConfigError(f"comm.batch: {t.batch} is not divisible by data={mesh.data}; "
                          f"fix: pass {flag_of('batch')} a multiple of {mesh.data}")
    low_rank = [s for s in names if s != "fullrank-tp"]
    if low_rank and base.kind not in LOW_RANK_KINDS:
        raise ConfigError(f"comm.kind: {', '.join(low_rank)} split a low-rank model and {base.kind} is dense "
                          f"(fullrank-tp always runs the dense llama); fix: pass {flag_of('kind')} with one of "
                          f"{', '.join(LOW_RANK_KINDS)}, or --compare fullrank-tp")
    base = replace(base, max_seq_len=max(base.max_seq_len, t.seq))  # comm has no --max-seq-len
    for s in names:
        try:
            validate(Config(model_for(base, s), _train(args, s, mesh)))
        except ConfigError as e:
            raise _comm_error(e) from None
    if args.dump_hlo is not None:
        check_dump_dir(args.dump_hlo, names)
    return base, mesh


def _train(args: argparse.Namespace, strategy: str, mesh: MeshShape) -> TrainConfig:
    """The `TrainConfig` a strategy's step is compiled with: train's, from the same flags."""
    return train_from(args, RUN_FLAGS, strategy=strategy, mesh=mesh)


def _train_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The `TrainConfig` fields of `boostjax comm`'s flags beyond batch/seq/strategy/mesh/remat/dtype."""
    t = train_from(args, RUN_FLAGS, mesh=None)
    return {"optimizer": t.optimizer, "microbatches": t.microbatches, "zero": t.zero,
            "grad_accum": t.grad_accum, "pipeline_schedule": t.pipeline_schedule}


def _cmd_comm(args: argparse.Namespace) -> int:
    compare = args.strategy or args.compare  # --strategy: the older name of --compare
    names = TP_STRATEGIES if compare == "all" else (compare,)
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
            raise ConfigError(f"comm.mesh: {what}; fix: pass a {flag_of('mesh')} model size that divides the "
                              f"{args.preset or DEFAULT_PRESET} preset's shapes, or another --preset") from None
        try:  # what the placement needs of the configuration (pipeline micro-batches, ...)
            check_run(Config(model_for(base, s), _train(args, s, mesh)))
        except ConfigError as e:
            raise _comm_error(e) from None
    t = train_from(args, RUN_FLAGS, mesh=None)
    reports = {s: comm_report(base, mesh, t.batch, t.seq, s, t.remat, t.dtype, args.dump_hlo,
                              **_train_fields(args)) for s in names}
    print(json.dumps(reports, indent=1) if args.json else _table(reports))
    return 0
