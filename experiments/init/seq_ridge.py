"""The sequential start's pull towards W, swept: SmolLM2-135M's SVD start at a budget, scored without training.

`--init-factor sequential` fits each projection in `‖X̃ M − X W‖² + λ‖M − W‖²` with λ = `SEQ_RIDGE` · mean
diag G̃ (`boostjax.interop.refit`). This factors the model at each value of that ratio (sensitivity ranks,
the calibration tokens given) and scores the start on the short fine-tune table's held-out batches
(`real_finetune.md`), beside that table's whitened start. Resumable: a finished value is kept.

    python -m experiments.init.seq_ridge --ridges 0.005,0.02,0.05,0.1
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
import time

from experiments import common

NAME = "seq_ridge"


def measure(kind: str, budget: float, ridges: list[float], calib: int, out: pathlib.Path, argv: list[str]) -> dict:
    from boostjax.interop import refit
    from experiments.init import real_finetune as rf

    s = dataclasses.replace(rf.Settings(), calib_tokens=calib)
    path = out / f"{NAME}.json"
    res = json.loads(path.read_text()) if path.is_file() else {}
    setup = {"kind": kind, "budget": budget, "calib_tokens": calib, "eval_batches": s.eval_batches}
    if res.get("setup") != setup:
        res = {"setup": setup, "rows": {}}
    res["command"] = common.command_line(NAME, argv)
    res["reference"] = rf.reference(out).get("before", {}).get(f"{kind}:{round(100 * budget)}")
    gguf, texts = rf.find_inputs()
    hf = rf.hf_folder(gguf, rf.CACHE / "smollm2-hf")
    data = rf.CACHE / "shakespeare-smollm2"
    runs = rf.CACHE / "runs" / f"{NAME}-{s.key()}"
    runs.mkdir(parents=True, exist_ok=True)
    ctx = rf.make_context(s, hf, data, rf.token_folder(texts, hf, data), runs)
    layer_fit = refit.LayerFit
    try:
        for lam in ridges:
            if f"{lam:g}" in res["rows"]:
                continue
            refit.LayerFit = functools.partial(layer_fit, seq_ridge=lam)  # what `lowrank_from_dense` builds
            t0 = time.perf_counter()
            r = rf.score_start(ctx, rf.Start(kind, budget, "seq", "sensitivity"))
            res["rows"][f"{lam:g}"] = {"ridge": lam, "before": r["before"], "ranks": r["ranks"],
                                       "start_s": r["start_s"], "wall_s": round(time.perf_counter() - t0, 1)}
            common.log(f"ridge {lam:g}: held-out ppl {r['before']['ppl']:.2f}")
            common.write(out, NAME, data=res, md=lambda: markdown(res), echo=False)
    finally:
        refit.LayerFit = layer_fit
    return res


def markdown(res: dict) -> str:
    st, ref = res["setup"], res.get("reference")
    lines = ["# The sequential start's pull towards W", "", f"Command: `{res['command']}`", "",
             f"SmolLM2-135M-Instruct, {st['kind'].upper()} {st['budget']:.0%} of the projection parameters, "
             f"`--init-factor sequential --rank-policy sensitivity`, {st['calib_tokens']:,} calibration tokens; "
             f"held-out: the short fine-tune table's {st['eval_batches']} batches (`real_finetune.md`), where the "
             "whitened start scores " + (f"{ref['ppl']:.2f}" if ref else "-") + ". λ = ratio · mean diag G̃.", "",
             "| ratio | held-out ppl | bits/byte | whitened / this | ranks | start s |", "|---:|---:|---:|---:|---|---:|"]
    for r in sorted(res["rows"].values(), key=lambda r: r["ridge"]):
        ranks = ", ".join(f"{g} {'dense' if v is None else v}" for g, v in r["ranks"].items())
        ratio = f"{ref['ppl'] / r['before']['ppl']:.2f}" if ref else "-"
        lines.append(f"| {r['ridge']:g} | {r['before']['ppl']:.2f} | {r['before']['bpb']:.3f} | {ratio} | {ranks} | "
                     f"{r['start_s']:.0f} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = common.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ridges", default="0.005,0.02,0.05,0.1", help="comma-separated values of λ / mean diag G̃")
    p.add_argument("--kind", default="svd", choices=("svd", "cola"), help="the factored model")
    p.add_argument("--budget", type=float, default=0.75, help="share of the dense projection parameters kept")
    p.add_argument("--calib-tokens", type=int, default=32768, help="calibration tokens of the sequential fit")
    p.add_argument("--out", default=str(common.RESULTS), help="results folder")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    try:
        ridges = [float(x) for x in args.ridges.split(",") if x]
    except ValueError:
        ridges = []
    if not ridges or min(ridges) < 0:
        print(f"{NAME}: --ridges {args.ridges!r} must list numbers >= 0; fix: e.g. --ridges 0.02,0.1", file=sys.stderr)
        return 2
    if not 0 < args.budget < 1 or args.calib_tokens < 256:
        print(f"{NAME}: --budget must lie in (0, 1) and --calib-tokens be >= 256; fix: e.g. --budget 0.75",
              file=sys.stderr)
        return 2
    res = measure(args.kind, args.budget, ridges, args.calib_tokens, pathlib.Path(args.out), argv)
    common.write(args.out, NAME, data=res, md=lambda: markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
