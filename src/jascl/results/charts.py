"""Charts of a run's numbers as PNG bytes: scores per session, per-class heat maps, pseudo-label quality and
training losses (the report's figures other than images; those are in :mod:`jascl.results.plots`).

Every function takes plain numbers and returns the encoded PNG, so the HTML report can embed it (base64) and the
Markdown report can write it next to itself; sizes, fonts, colours and fitted ranges follow
:mod:`jascl.results.figure_style`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from jascl.results.figure_style import (
    DPI,
    EMBED_WIDTH_PX,
    LABEL_PT,
    MARKERS,
    SMALL_PT,
    TICK_PT,
    TITLE_PT,
    band,
    fitted_range,
    format_range,
    png_bytes,
    text_colour_on,
)

__all__ = ["class_heatmap", "curves_range", "loss_curves", "pseudo_label_plot", "session_curves"]


def curves_range(
    panels: Mapping[str, Mapping[str, Sequence[Sequence[float]]]], bounds: tuple[float, float] = (0.0, 1.0)
) -> tuple[float, float]:
    """The y range :func:`session_curves` uses: fitted to every mean ± std it draws."""
    ends: list[float] = []
    for methods in panels.values():
        for per_session in methods.values():
            means, stds, _ = band(per_session)
            ends += [*(means - stds), *(means + stds)]
    return fitted_range(ends, bounds)


def session_curves(
    session_labels: Sequence[str],
    panels: Mapping[str, Mapping[str, Sequence[Sequence[float]]]],
    ylabel: str | Mapping[str, str],
    y_range: tuple[float, float] | None = None,
    xlabel: str = "session (the model after training on it)",
) -> bytes:
    """Line plot(s) of a score per session: one line per method with a marker per session, a ±std band
    over seeds where there are several.

    Args:
        session_labels: x tick labels, one per session (e.g. ``"S0 base"``).
        panels: panel title -> method -> per-session list of per-seed values
            (``[[s0 seed a, s0 seed b], [s1 ...], ...]``); NaN / missing values are skipped.
        ylabel: y axis title, one for all panels or one per panel title.
        y_range: the y limits of every panel; default :func:`curves_range` (fitted to the data).
        xlabel: x axis title.

    Returns:
        PNG bytes; one subplot per panel, side by side, with the same y limits.
    """
    n = max(len(panels), 1)
    lo, hi = y_range if y_range is not None else curves_range(panels)
    fig = Figure(figsize=(min(5.4 * n, EMBED_WIDTH_PX / DPI - 0.3), 3.9), layout="constrained")
    axes = fig.subplots(1, n, squeeze=False)[0]
    x = np.arange(len(session_labels))
    for ax, (title, methods) in zip(axes, panels.items()):
        for i, (method, per_session) in enumerate(methods.items()):
            means, stds, seeds = band(per_session)
            # methods side by side around each session (a small dodge) with their own marker, so equal
            # values (two methods on the same shared base model) stay visible as two lines
            xs = x[: len(means)] + 0.04 * (i - (len(methods) - 1) / 2)
            colour = f"C{i % 10}"
            label = method if seeds < 2 else f"{method} ({seeds} seeds)"
            marker = MARKERS[i % len(MARKERS)]
            # clip_on=False: a marker on the axis' end (a score of 0) is drawn whole
            ax.plot(xs, means, marker=marker, linewidth=2, markersize=6, color=colour, label=label, clip_on=False)
            if np.any(stds > 0):
                ax.fill_between(xs, means - stds, means + stds, color=colour, alpha=0.18, linewidth=0)
        ax.set_title(title, fontsize=TITLE_PT)
        ax.set_xlim(-0.25, max(len(x) - 0.75, 0.25))
        ax.set_xticks(x, list(session_labels), rotation=20 if len(x) > 5 else 0, fontsize=TICK_PT)
        ax.tick_params(axis="y", labelsize=TICK_PT)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(xlabel, fontsize=LABEL_PT)
        ax.set_ylabel(ylabel if isinstance(ylabel, str) else ylabel.get(title, ""), fontsize=LABEL_PT)
        ax.legend(fontsize=TICK_PT, loc="best")
    return png_bytes(fig)


# --- heat maps ------------------------------------------------------------------------------------------------


def class_heatmap(
    matrix: np.ndarray,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str,
    scale: float = 1.0,
    decimals: int = 2,
    value_range: tuple[float, float] | None = None,
    colour_label: str = "",
) -> bytes:
    """Per-class score by session as a heat map (the paper's class-wise tables as a picture), each cell's value
    printed in it.

    Args:
        matrix: (classes, sessions) scores in [0, 1]; NaN = class not seen yet / absent (grey, no number).
        row_labels: one label per class (row).
        col_labels: one label per session (column).
        title: figure title.
        scale: multiplier of the printed numbers (100 for mIoU ×100).
        decimals: decimals of the printed numbers.
        value_range: the colour scale's ends; default :func:`fitted_range` of the matrix. Pass
            one range to several heat maps to make their colours comparable.
        colour_label: title of the colour bar (the metric); the range is appended.

    Returns:
        PNG bytes.
    """
    rows, cols = matrix.shape
    lo, hi = value_range if value_range is not None else fitted_range(matrix)
    # about 600 px wide for 4 sessions, so two methods' heat maps sit side by side in the HTML page
    fig = Figure(figsize=(max(4.4, 0.85 * cols + 2.8), max(2.4, 0.36 * rows + 1.6)), layout="constrained")
    ax = fig.subplots()
    masked = np.ma.masked_invalid(matrix.astype(float))
    cmap = colormaps["viridis"].with_extremes(bad="#e6e6e6")
    norm = Normalize(vmin=lo, vmax=hi, clip=True)
    image = ax.imshow(masked, cmap=cmap, norm=norm, aspect="auto")
    for r in range(rows):
        for c in range(cols):
            v = float(matrix[r, c])
            if not math.isnan(v):
                ax.text(
                    c,
                    r,
                    f"{scale * v:.{decimals}f}",
                    ha="center",
                    va="center",
                    fontsize=TICK_PT,
                    color=text_colour_on(cmap(norm(v))),
                )
    ax.set_xticks(range(cols), list(col_labels), fontsize=TICK_PT)
    ax.set_yticks(range(rows), list(row_labels), fontsize=TICK_PT)
    ax.set_xlabel("session (the model after training on it)", fontsize=LABEL_PT)
    ax.set_ylabel("class", fontsize=LABEL_PT)
    ax.set_title(title, fontsize=TITLE_PT)
    bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
    bar.ax.tick_params(labelsize=SMALL_PT)
    scale_note = f"colour scale {format_range(lo, hi, scale)}"
    bar.set_label(f"{colour_label}, {scale_note}" if colour_label else scale_note, fontsize=SMALL_PT)
    return png_bytes(fig)


# --- pseudo-labels and losses ---------------------------------------------------------------------------------


def pseudo_label_plot(
    session_labels: Sequence[str],
    series: Mapping[str, Mapping[str, Sequence[Sequence[float]]]],
    y_range: tuple[float, float] | None = None,
    ylabels: Mapping[str, str] | None = None,
) -> bytes:
    """Pseudo-label coverage and precision per session, one line per method (PAS vs confidence-only).

    Args:
        session_labels: x tick labels of the sessions that had an unlabelled phase.
        series: ``{"coverage": {method: per-session per-seed values}, "precision": {...}}``.
        y_range: the y limits of both panels; default fitted to the values (:func:`curves_range`).
        ylabels: the two panels' y labels (``"coverage"``, ``"precision"``); default the pixel ones (dense
            pseudo-labels; a detection run passes box ones).

    Returns:
        PNG bytes with two panels.
    """
    return session_curves(
        session_labels,
        {"coverage": series["coverage"], "precision": series["precision"]},
        dict(ylabels)
        if ylabels is not None
        else {"coverage": "coverage (kept / all unlabelled pixels)", "precision": "precision (correct / kept pixels)"},
        y_range,
        xlabel="session (its unlabelled phase)",
    )


def loss_curves(
    methods: Mapping[str, Sequence[tuple[str, Mapping[str, Sequence[Sequence[float]]]]]], total: str = "total"
) -> bytes:
    """Training loss against epoch, one panel per method, the sessions one after another with a dotted line
    between them.

    Args:
        methods: method -> its sessions in order, each ``(label, {series name: per-epoch per-seed values})``;
            the ``total`` series is drawn solid (with a ±std band over seeds), the others dashed.
        total: the name of the main series.

    Returns:
        PNG bytes; each panel's y axis fitted to its values.
    """
    n = max(len(methods), 1)
    fig = Figure(figsize=(min(10.5, EMBED_WIDTH_PX / DPI - 0.3), 2.7 * n + 0.4), layout="constrained")
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    for ax, (method, sessions) in zip(axes, methods.items()):
        start, names, ends = 0, [], []
        for s, (label, series) in enumerate(sessions):
            epochs = max((len(v) for v in series.values()), default=0)
            for name, per_epoch in series.items():
                if name not in names:
                    names.append(name)
                colour = f"C{names.index(name) % 10}"
                means, stds, _ = band(per_epoch)
                xs = start + np.arange(len(means))
                main = name == total
                ax.plot(
                    xs,
                    means,
                    color=colour,
                    linewidth=1.8 if main else 1.1,
                    linestyle="-" if main else "--",
                    marker="o" if len(means) <= 30 else None,
                    markersize=3 if main else 2,
                    label=name,
                )
                if main and np.any(stds > 0):
                    ax.fill_between(xs, means - stds, means + stds, color=colour, alpha=0.18, linewidth=0)
                ends += [*(means - stds), *(means + stds)]
            if s > 0:
                ax.axvline(start - 0.5, color="0.4", linestyle=":", linewidth=1)
            ax.text(
                start - 0.4,
                1.0,
                label,
                transform=ax.get_xaxis_transform(),
                ha="left",
                va="bottom",
                fontsize=SMALL_PT,
                color="0.25",
            )
            start += epochs
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=SMALL_PT, loc="best")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(*fitted_range(ends, (0.0, math.inf), margin=0.05, min_span=1e-3))
        ax.set_xlim(-0.5, max(start - 0.5, 0.5))
        ax.set_title(method, fontsize=TITLE_PT, pad=14)
        ax.set_xlabel("epoch (sessions in order, dotted line: next session)", fontsize=LABEL_PT)
        ax.set_ylabel("training loss", fontsize=LABEL_PT)
        ax.tick_params(labelsize=TICK_PT)
        ax.grid(True, alpha=0.3)
    return png_bytes(fig)
