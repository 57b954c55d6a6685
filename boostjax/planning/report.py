"""What `boostjax plan --auto` prints: the ranked table and the winner's command lines."""

from __future__ import annotations

from typing import Any

from boostjax.planning.search import PlanResult

GIB = float(1 << 30)
HEADER = ("#", "configuration", "s/step", "tokens/s", "MFU", "peak GiB (w/opt/act)", "comm GiB model/data/stage",
          "bubble", "vs the winner")


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
    lines = [head, "", table(res, rows), "", f"winner: {win['label']}{how}", f"  {win['train_command']}"]
    if "launch_command" in win:
        lines.append(f"  {win['launch_command']}")
    if res.cluster.nodes > 1 and not res.cluster.is_cpu:
        lines.append(f"  (on each of the {res.cluster.nodes} nodes, COORDINATOR = node 0's address, NODE_RANK = "
                     f"0..{res.cluster.nodes - 1})")
    return "\n".join(lines)


def plan_json(res: PlanResult, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**res.to_json(), **(extra or {})}


__all__ = ["plan_json", "summary", "table"]
