"""One grouped bar chart per TP strategy, shared by the experiments that compare full-rank TP,
vanilla low-rank TP and BTP (`comm_table.py`, `scaling_model.py`): bars for our numbers, black
ticks for the paper's where it has them. Figures come from `common.subplots` and are written by
`common.write`."""

from __future__ import annotations

from typing import Sequence

import numpy as np

WIDTH = 0.27


def strategy_bars(ax, labels: Sequence[str], bars: dict[str, Sequence[float]], names: dict[str, str], *,
                  ticks: dict[str, Sequence[float | None]] | None = None, tick_label: str = "paper",
                  ylabel: str = "", title: str = "", label_size: float | None = None) -> None:
    """`bars[strategy][i]` at x = i (one bar per strategy, side by side); `ticks[strategy][i]`, where
    not None, as a black tick over the same bar."""
    x = np.arange(len(labels))
    for i, (strategy, vals) in enumerate(bars.items()):
        pos = x + (i - (len(bars) - 1) / 2) * WIDTH
        ax.bar(pos, vals, WIDTH, label=names[strategy])
        marks = [(p, t) for p, t in zip(pos, (ticks or {}).get(strategy, ())) if t is not None]
        if marks:
            ax.plot(*zip(*marks), "k_", markersize=14, label=tick_label if i == 0 else None)
    ax.set_xticks(x, labels, fontsize=label_size)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)

