"""The component study's Seen / New / HM figure: per incremental session, grouped bars per variant.

As the paper's ablation figures show it: after each incremental session, the score on the seen (old)
classes, on the session's new classes and their harmonic mean, one bar per variant, here with the 95 %
confidence interval over seeds as an error bar (:mod:`jascl.evaluation.intervals`). Built on an Agg
canvas like every figure of jascl (:mod:`jascl.results.figure_style`, no pyplot state).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from jascl.results.figure_style import DPI, EMBED_WIDTH_PX, png_bytes

#: the measures of each panel, in bar-group order, with their axis labels
MEASURES = (("seen", "Seen"), ("new", "New"), ("hm", "HM"))

_TITLE, _LABEL, _TICK = 11, 10, 9


def seen_new_hm_figure(
    sessions: Sequence[str], bars: Mapping[str, Sequence[Mapping[str, tuple[float, float]]]], ylabel: str
) -> bytes:
    """Grouped bars of Seen / New / HM per incremental session, one bar per variant, with interval bars.

    Args:
        sessions: panel titles, one per incremental session (e.g. ``"S1 (inc)"``).
        bars: variant label -> per session (same order as ``sessions``) ``{"seen" | "new" | "hm":
            (mean, half-width)}``; a NaN mean draws no bar, a NaN half-width no error bar.
        ylabel: the score's name (e.g. ``"Dice"``).

    Returns:
        PNG bytes: one panel per session side by side (wrapped into rows of three), sharing the y axis.
    """
    n = max(len(sessions), 1)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    width = min(4.6 * cols, EMBED_WIDTH_PX / DPI - 0.3)
    fig = Figure(figsize=(width, 3.6 * rows + 0.5), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True).ravel()
    variants = list(bars)
    group = np.arange(len(MEASURES))
    step = 0.8 / max(len(variants), 1)
    tops = [0.0]
    for i, title in enumerate(sessions):
        ax = axes[i]
        for j, variant in enumerate(variants):
            cells = bars[variant][i] if i < len(bars[variant]) else {}
            means = np.array([cells.get(key, (math.nan, math.nan))[0] for key, _ in MEASURES], dtype=float)
            halves = np.array([cells.get(key, (math.nan, math.nan))[1] for key, _ in MEASURES], dtype=float)
            xs = group - 0.4 + step * (j + 0.5)
            drawn = np.nan_to_num(means)
            ax.bar(xs, drawn, width=step * 0.92, color=f"C{j % 10}", label=variant if i == 0 else None)
            err = np.where(np.isnan(halves) | np.isnan(means), 0.0, halves)
            if np.any(err > 0):
                ax.errorbar(xs, drawn, yerr=err, fmt="none", ecolor="black", elinewidth=1, capsize=2)
            tops.append(float(np.nanmax(np.append(drawn + err, 0.0))))
        ax.set_title(title, fontsize=_TITLE)
        ax.set_xticks(group, [label for _, label in MEASURES], fontsize=_TICK)
        ax.tick_params(axis="y", labelsize=_TICK)
        ax.grid(True, axis="y", alpha=0.3)
        if i % cols == 0:
            ax.set_ylabel(ylabel, fontsize=_LABEL)
    for ax in axes[len(sessions) :]:
        ax.set_visible(False)
    axes[0].set_ylim(0.0, max(max(tops) * 1.08, 0.05))
    fig.legend(loc="outside lower center", ncols=min(len(variants), 5), fontsize=_TICK)
    return png_bytes(fig)
