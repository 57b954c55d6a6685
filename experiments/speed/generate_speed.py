"""Greedy generation speed: `boostjax.generate` (KV cache) against re-running the full forward each step.

For each preset (random weights, `--kind`, fp32, batch 1, a `--prompt`-token prompt) and each number of
new tokens N, both programs are compiled ahead of time (the compile time is `lower` + `compile`) and run
three times (`block_until_ready`; the fastest run is reported):

- `cached`: `boostjax.generate`'s program: one prefill of the prompt, then N - 1 one-token steps that
  attend to the KV cache (a `lax.while_loop`).
- `full forward`: the model's plain forward over a fixed `[1, prompt + N]` token buffer, once per new
  token, taking the argmax at the last filled position (a `lax.fori_loop`: one compile; the causal mask
  makes the unfilled tail irrelevant). Every step costs the same, so with `--full-steps K` < N only K
  steps are run and the time is scaled by N / K (`full_steps_timed` in the JSON says so).

Both must produce the same greedy tokens over the steps they share (checked; `tokens_match`).

    python -m experiments.speed.generate_speed                        # tiny and 60m, N = 32 and 256
    python -m experiments.speed.generate_speed --presets tiny --new 32 --full-steps 8     # smoke run

Writes experiments/results/generate_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from experiments import common



def _best_of(fn, *args, repeat: int = 3):
    """(output, best wall time of `repeat` runs): the first run of a program pays one-time costs, and
    on a shared machine the minimum is the least disturbed run."""
    import jax

    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return out, best


def measure(preset: str, kind: str, prompt_len: int, new: int, full_steps: int, seed: int = 0) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from boostjax.config import preset as get_preset
    from boostjax.inference.generation import _generate
    from boostjax.models.llama import LLaMA
    from boostjax.models.flops import param_count

    cfg = get_preset(preset, kind=kind, attention="xla")
    model = LLaMA(cfg, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    prompt = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, prompt_len)), jnp.int32)
    total = prompt_len + new

    # cached: the package's own program, compiled ahead of time
    args = (graphdef, state, prompt, jax.random.key(0), jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0),
            jnp.asarray([-1], jnp.int32))
    t0 = time.perf_counter()
    compiled = _generate.lower(*args, max_new=new, greedy=True).compile()
    cached_compile = time.perf_counter() - t0
    cached_out, cached_run = _best_of(lambda: compiled(state, prompt, *args[3:]))  # graphdef is static

    # full forward each step over a fixed buffer
    k = min(full_steps, new) if full_steps > 0 else new

    def full(state, prompt):
        m = nnx.merge(graphdef, state)
        buf = jnp.concatenate([prompt, jnp.zeros((1, new), jnp.int32)], axis=1)

        def step(i, buf):
            logits = m(buf)
            pos = prompt_len + i - 1
            tok = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, pos, axis=1, keepdims=False), -1).astype(jnp.int32)
            return jax.lax.dynamic_update_slice(buf, tok[:, None], (0, pos + 1))

        return jax.lax.fori_loop(0, k, step, buf)

    t0 = time.perf_counter()
    full_c = jax.jit(full).lower(state, prompt).compile()
    full_compile = time.perf_counter() - t0
    full_out, full_run = _best_of(full_c, state, prompt)
    full_run_scaled = full_run * new / k
    match = bool(np.array_equal(np.asarray(cached_out)[:, : prompt_len + k], np.asarray(full_out)[:, : prompt_len + k]))
    return {
        "preset": preset, "kind": kind, "params": int(param_count(cfg)), "prompt": prompt_len, "new_tokens": new,
        "cached": {"compile_s": round(cached_compile, 3), "run_s": round(cached_run, 4),
                   "tokens_per_s": round(new / cached_run, 1)},
        "full_forward": {"compile_s": round(full_compile, 3), "run_s": round(full_run_scaled, 4),
                         "tokens_per_s": round(new / full_run_scaled, 1), "full_steps_timed": k,
                         "run_s_timed": round(full_run, 4)},
        "speedup": round(full_run_scaled / cached_run, 2), "tokens_match": match,
        "total_positions": total,
    }


def markdown(res: dict) -> str:
    lines = [
        "# Generation speed: KV cache vs full forward per token",
        "",
        f"`{res['command']}` on {res['machine']} ({res['note']}). Greedy, batch 1, fp32, random weights, "
        "`attention=xla`. Compile = `lower` + `compile` of the whole generation program; run = the fastest of "
        "three executions after it. `full forward` re-runs the model over a fixed `[1, prompt + N]` buffer for each new token "
        "(one compile); where fewer than N of its steps were timed, the time is scaled by N / steps "
        "(every step costs the same).",
        "",
        "| preset | kind | params | N new | cached tok/s | cached compile s | full-forward tok/s | "
        "full-forward compile s | full steps timed | speedup | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        c, f = r["cached"], r["full_forward"]
        lines.append(f"| {r['preset']} | {r['kind']} | {r['params'] / 1e6:.1f}M | {r['new_tokens']} | "
                     f"{c['tokens_per_s']} | {c['compile_s']} | {f['tokens_per_s']} | {f['compile_s']} | "
                     f"{f['full_steps_timed']}/{r['new_tokens']} | {r['speedup']}x | {r['tokens_match']} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """The command line's flags (`main` parses them)."""
    ap = common.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="tiny,60m", help="comma-separated presets (random weights; default: tiny,60m)")
    ap.add_argument("--kind", default="cola", choices=("llama", "cola", "svd", "lax"),
                    help="model kind of every preset (default: cola)")
    ap.add_argument("--new", default="32,256", help="numbers of new tokens, comma-separated")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--full-steps", type=int, default=32, help="full-forward steps timed (0 = all N)")
    ap.add_argument("--note", default="", help="conditions of the run, e.g. 'shared machine, 2 cores'")
    common.add_out(ap, "generate_speed", from_json=False)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for preset in args.presets.split(","):
        for new in (int(n) for n in args.new.split(",")):
            r = measure(preset, args.kind, args.prompt, new, args.full_steps)
            print(json.dumps(r), flush=True)
            rows.append(r)
    import jax

    res = {"command": common.command_line("generate_speed", argv),
           "machine": f"{common.machine_line()}, JAX {jax.__version__} {jax.default_backend()}",
           "note": args.note or "no conditions given", "rows": rows}
    common.write(args.out, "generate_speed", data=res, md=lambda: markdown(res), indent=2, started=t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
