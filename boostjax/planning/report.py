"""What `boostjax plan --auto` prints: the model it planned, the ranked table with a legend of its labels,
the winner's command lines (complete: `--data`, `--out`, `--steps` given or as placeholders) and where
the compiled measurements are cached."""

from __future__ import annotations

import textwrap
from typing import Any

from boostjax.planning.search import PlanResult
from boostjax.runtime.profiles import GiB as GIB

HEADER = ("#", "configuration", "s/step", "tokens/s", "MFU", "peak GiB (w/opt/act)", "comm GiB model/data/stage",
          "bubble", "vs the winner")
# the labels' parts (`space.Candidate.label`), explained once under the table
LEGEND = ("labels: D = data-parallel replicas (the data axis); PP N SCHEDULE = N pipeline stages, gpipe or 1f1b; "
          "TP N STRATEGY = tensor-parallel devices per replica and how layers split (btp, vanilla-tp, fullrank-tp); "
          "mbAxB = A sequences per micro-batch on each data replica, B micro-batches per optimizer step "
          "(accumulated, or the pipeline's); remat = what the backward recomputes (none, lowrank: all but the "
          "r-dim latents, full: each block); ZeRO0/1/3 = nothing, the optimizer state, or it and the parameters "
          "sharded over the data axis; +offload = with an offload plan")
PLACEHOLDERS = {"DATA": "DATA = the corpus: a boostjax tokenize folder, a text file or folder",
                "RUN": "RUN = the run folder", "STEPS": "STEPS = optimizer steps"}


def table(res: PlanResult, rows: int = 10) -> str:
    """A fixed-width table of the best `rows` candidates (with a measured column where the top were timed)."""
    timed = res.measured is not None
    cells = [HEADER[:3] + ("measured s/step",) + HEADER[3:-1] + ("vs #1 predicted",) if timed else HEADER]
    for i, c in enumerate(res.candidates[:rows], 1):
        cb = c["comm_bytes"]
        meas = (f"{c['measured_step_s']:.4g}" if "measured_step_s" in c else "-",) if timed else ()
        cells.append((str(i), c["label"], f"{c['step_s']:.4g}", *meas, f"{c['tokens_per_s']:.4g}", f"{c['mfu']:.2f}",
                      f"{c['peak_bytes_per_device'] / GIB:.3g} ({c['weight_bytes'] / GIB:.3g}/"
                      f"{c['optimizer_bytes'] / GIB:.3g}/{c['activation_bytes'] / GIB:.3g})",
                      f"{cb['model'] / GIB:.3g}/{cb['data'] / GIB:.3g}/{cb['stage'] / GIB:.3g}",
                      f"{c['bubble_fraction']:.2f}", c.get("why_slower", "")))
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells)


def model_line(res: PlanResult) -> str:
    """The model the plan is for (`search.planned_model`), in one line."""
    m = res.model
    if not m:
        return ""
    vocab = {"preset": "the preset's default", "given": "as given"}.get(m["vocab_source"], m["vocab_source"])
    preset = f", preset {m['preset']}" if m.get("preset") else ""
    n = m["parameters"]
    count = f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M" if n >= 1e6 else f"{n:,}"
    return (f"model planned: {m['kind']}{preset}, {m['n_layers']} layers, d_model {m['d_model']}, vocabulary "
            f"{m['vocab_size']} ({vocab}), {count} parameters")


def cache_line(res: PlanResult) -> str:
    """Where the compiled measurements are kept, and how many this plan read from there."""
    s = res.search
    where = s.get("cache_dir")
    if not where:
        return "compiled measurements not kept (a later plan compiles them again; drop --no-cache to keep them)"
    return (f"compiled measurements kept in {where}: {s['cached']} read from it, {s['compiled']} compiled now "
            "(a later plan of this model reads them; --no-cache: keep none)")


def summary(res: PlanResult, rows: int = 10) -> str:
    s = res.search
    head = (f"{s['fitting']} configurations fit {res.budget_bytes / GIB:.3g} GiB per device on {res.cluster.text} "
            f"({s['valid']} valid of {s['enumerated']}; {s['pruned_memory_bound']} over memory by bound, "
            f"{s['skipped_time_bound']} slower by bound, {s['skipped_remat_not_needed']} with a remat not needed, "
            f"{s['skipped_compile_budget']} past the compile budget; {s['compiled']} measurements compiled, "
            f"{s['cached']} cached; {s['wall_s']} s); {s['global_batch']} x {s['seq']} tokens per step, {s['dtype']}:")
    win = res.winner
    how = ""
    if res.measured:
        m = res.measured
        how = (f" (measured fastest of the {len(m['timed'])} best predicted, median of {m['rounds']} interleaved "
               f"steps: {win['measured_step_s']:.4g} s" + ("" if win is res.candidates[0] else
                                                            f"; predicted first: {m['predicted_first']}") + ")")
    lines = [*filter(None, [model_line(res)]), *(f"warning: {w}" for w in res.warnings), head, "",
             table(res, rows), textwrap.fill(LEGEND, 118, subsequent_indent="  "), "", f"winner: {win['label']}{how}",
             f"  {win.get('run_command', win['train_command'])}"]
    if "launch_command" in win:
        lines.append(f"  {win.get('launch_run_command', win['launch_command'])}")
    words = set(win.get("run_command", "").split())
    fill = [text for word, text in PLACEHOLDERS.items() if word in words]
    if res.cluster.nodes > 1 and not res.cluster.is_cpu:
        fill.append(f"on each of the {res.cluster.nodes} nodes, COORDINATOR = node 0's address, NODE_RANK = "
                    f"0..{res.cluster.nodes - 1}")
    if fill:
        lines.append(f"  (fill in {'; '.join(fill)})")
    lines.append(cache_line(res))
    return "\n".join(lines)


def plan_json(res: PlanResult, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**res.to_json(), **(extra or {})}


__all__ = ["LEGEND", "cache_line", "model_line", "plan_json", "summary", "table"]
