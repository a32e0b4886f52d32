"""Figures of a run as PNG bytes (matplotlib's Agg canvas; no display, no pyplot global state).

Every function takes plain numbers / numpy arrays and returns the encoded PNG,
so the HTML report can embed it (base64) and the Markdown report can write it
next to itself. Figures are built on :class:`matplotlib.figure.Figure` with an
explicit Agg canvas instead of ``pyplot``, so nothing depends on (or changes)
the process-wide backend and no figure is ever left open.

Label conventions: label maps hold *global* class ids (0 = background, 255 =
ignore); :func:`class_colours` gives every class id one fixed colour across all
figures of a report.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

__all__ = ["class_colours", "display_slice", "session_curves", "class_heatmap", "overlay_grid", "pseudo_label_plot"]

#: dots per inch of every figure; figure sizes below are chosen for ~1200 px wide images
DPI = 110

# Class colours, indexed by class id - 1: the ten tab10 hues (mutually distinct; tab10's grey is
# replaced by yellow, which stands out on grey-scale images), then paired lighter / darker hues.
_PALETTE = [
    "#1F77B4",
    "#FF7F0E",
    "#2CA02C",
    "#D62728",
    "#9467BD",
    "#8C564B",
    "#E377C2",
    "#FFE119",
    "#17BECF",
    "#BCBD22",
    "#A6CEE3",
    "#FDBF6F",
    "#B2DF8A",
    "#FB9A99",
    "#CAB2D6",
    "#6A3D9A",
    "#B15928",
    "#00FF7F",
    "#FF00FF",
    "#000080",
]


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def class_colours(class_ids: Sequence[int]) -> dict[int, str]:
    """A fixed colour per foreground class id (background gets none: it is left transparent)."""
    return {int(c): _PALETTE[(int(c) - 1) % len(_PALETTE)] for c in class_ids if int(c) != 0}


def display_slice(array: np.ndarray, label: np.ndarray | None = None) -> tuple[np.ndarray, str]:
    """A 2D view of an image or label map for display.

    Args:
        array: (H, W) or (H, W, D) (a 3D volume; for images with channels pass one channel).
        label: optional ground truth of the same spatial shape; for volumes the
            slice along the last axis with the most foreground is chosen (the
            middle slice when there is no foreground), so that structures are visible.

    Returns:
        ``(slice (H, W), description)``, e.g. ``(…, "slice 7/16")`` for a volume, ``""`` for an image.
    """
    if array.ndim == 2:
        return array, ""
    if array.ndim != 3:
        raise ValueError(f"expected a 2D image or 3D volume, got shape {array.shape}")
    depth = array.shape[-1]
    index = depth // 2
    if label is not None:
        area = ((label > 0) & (label != 255)).reshape(-1, depth).sum(0)
        if area.max() > 0:
            index = int(area.argmax())
    return array[..., index], f"slice {index}/{depth}"


def session_curves(
    session_labels: Sequence[str], panels: Mapping[str, Mapping[str, Sequence[Sequence[float]]]], ylabel: str
) -> bytes:
    """Line plot(s) of a score per session, one line per method, with a ±std band when several seeds.

    Args:
        session_labels: x tick labels, one per session (e.g. ``"S0 base"``).
        panels: panel title -> method -> per-session list of per-seed values
            (``[[s0 seed a, s0 seed b], [s1 ...], ...]``); NaN / missing values are skipped.
        ylabel: y axis label (metric name).

    Returns:
        PNG bytes; one subplot per panel, side by side, sharing the y axis.
    """
    n = max(len(panels), 1)
    fig = Figure(figsize=(5.4 * n, 3.9), layout="constrained")
    axes = fig.subplots(1, n, sharey=True, squeeze=False)[0]
    x = np.arange(len(session_labels))
    for ax, (title, methods) in zip(axes, panels.items()):
        for i, (method, per_session) in enumerate(methods.items()):
            means, stds = [], []
            for values in per_session:
                valid = [float(v) for v in values if v is not None and not math.isnan(float(v))]
                means.append(float(np.mean(valid)) if valid else math.nan)
                stds.append(float(np.std(valid, ddof=1)) if len(valid) > 1 else 0.0)
            means_a, stds_a = np.asarray(means), np.asarray(stds)
            xs = x[: len(means_a)]
            colour = f"C{i % 10}"
            ax.plot(xs, means_a, marker="o", linewidth=2, markersize=6, color=colour, label=method)
            if np.any(stds_a > 0):
                ax.fill_between(xs, means_a - stds_a, means_a + stds_a, color=colour, alpha=0.18, linewidth=0)
        ax.set_title(title, fontsize=12)
        ax.set_xlim(-0.25, max(len(x) - 0.75, 0.25))
        ax.set_xticks(x, list(session_labels), rotation=20 if len(x) > 5 else 0, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(0.0, 1.02)
    axes[0].set_ylabel(ylabel, fontsize=11)
    axes[-1].legend(fontsize=10, loc="best")
    return _png(fig)


def class_heatmap(
    matrix: np.ndarray,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str,
    scale: float = 1.0,
    decimals: int = 2,
) -> bytes:
    """Per-class score by session as a heat map (the paper's class-wise tables as a picture).

    Args:
        matrix: (classes, sessions) scores in [0, 1]; NaN = class not seen yet / absent (grey, no number).
        row_labels: one label per class (row).
        col_labels: one label per session (column).
        title: figure title.
        scale: multiplier of the printed numbers (100 for mIoU ×100).
        decimals: decimals of the printed numbers.

    Returns:
        PNG bytes. Colours are fixed to [0, 1] so heat maps of different methods compare directly.
    """
    rows, cols = matrix.shape
    # about 600 px wide for 4 sessions, so two methods' heat maps sit side by side in the HTML page
    fig = Figure(figsize=(max(4.0, 0.8 * cols + 2.3), max(2.2, 0.36 * rows + 1.3)), layout="constrained")
    ax = fig.subplots()
    masked = np.ma.masked_invalid(matrix.astype(float))
    cmap = colormaps["viridis"].with_extremes(bad="#e6e6e6")
    image = ax.imshow(masked, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    for r in range(rows):
        for c in range(cols):
            v = matrix[r, c]
            if not math.isnan(float(v)):
                ax.text(
                    c,
                    r,
                    f"{scale * float(v):.{decimals}f}",
                    ha="center",
                    va="center",
                    fontsize=9,
                    color="black" if v > 0.55 else "white",
                )
    ax.set_xticks(range(cols), list(col_labels), fontsize=10)
    ax.set_yticks(range(rows), list(row_labels), fontsize=10)
    ax.set_title(title, fontsize=11)
    fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
    return _png(fig)


def _label_rgba(label: np.ndarray, colours: Mapping[int, str], alpha: float) -> np.ndarray:
    from matplotlib.colors import to_rgba

    rgba = np.zeros((*label.shape, 4), dtype=float)
    for cid, colour in colours.items():
        rgba[label == cid] = (*to_rgba(colour)[:3], alpha)
    return rgba


def overlay_grid(
    rows: Sequence[Mapping[str, object]],
    columns: Sequence[str],
    colours: Mapping[int, str],
    names: Mapping[int, str],
    title: str = "",
    alpha: float = 0.55,
) -> bytes:
    """Input, ground truth and predictions side by side, labels drawn over the input.

    Args:
        rows: one mapping per sample: ``"image"`` (H, W) float, ``"label"`` a row
            caption, and for every column title but the first a (H, W) global-id
            label map (``None`` draws "not available").
        columns: column titles; the first is the input image alone.
        colours: class id -> colour (:func:`class_colours`).
        names: class id -> name, for the legend.
        title: figure title.
        alpha: opacity of the label overlay.

    Returns:
        PNG bytes.
    """
    n_rows, n_cols = len(rows), len(columns)
    cell = 2.1
    fig = Figure(figsize=(cell * n_cols, cell * n_rows + 0.9), layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    present: set[int] = set()
    for r, row in enumerate(rows):
        image = np.asarray(row["image"], dtype=float)
        lo, hi = np.percentile(image, [1, 99]) if image.size else (0.0, 1.0)
        for c, column in enumerate(columns):
            ax = axes[r][c]
            ax.imshow(image, cmap="gray", vmin=lo, vmax=hi if hi > lo else lo + 1, interpolation="nearest")
            if c > 0:
                label = row.get(column)
                if label is None:
                    ax.text(
                        0.5,
                        0.5,
                        "not available",
                        ha="center",
                        va="center",
                        transform=ax.transAxes,
                        fontsize=9,
                        color="white",
                        bbox={"facecolor": "black", "alpha": 0.6},
                    )
                else:
                    label = np.asarray(label)
                    present.update(int(v) for v in np.unique(label) if v not in (0, 255))
                    ax.imshow(_label_rgba(label, colours, alpha), interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(column, fontsize=9)
            if c == 0:
                ax.set_ylabel(str(row.get("label", "")), fontsize=8)
    handles = [
        Patch(facecolor=colours[c], label=f"{c} {names.get(c, '')}".strip()) for c in sorted(present) if c in colours
    ]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 10), fontsize=9, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return _png(fig)


def pseudo_label_plot(
    session_labels: Sequence[str], series: Mapping[str, Mapping[str, Sequence[Sequence[float]]]]
) -> bytes:
    """Pseudo-label coverage and precision per session, one line per method (PAS vs confidence-only).

    Args:
        session_labels: x tick labels of the sessions that had an unlabelled phase.
        series: ``{"coverage": {method: per-session per-seed values}, "precision": {...}}``.

    Returns:
        PNG bytes with two panels.
    """
    return session_curves(
        session_labels,
        {
            "pseudo-label coverage (kept / all pixels)": series["coverage"],
            "pseudo-label precision (kept and correct / kept)": series["precision"],
        },
        "fraction",
    )
