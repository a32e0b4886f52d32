"""The paper's figures, redrawn from a reproduction's numbers: PNG, SVG and the CSV behind them.

Each panel is a small multiple laid out like the paper's (a grid of ``columns`` panels, lettered (a), (b), ...):

* ``sessions`` panels: x = the sessions, one line per series, measured values solid with filled markers
  and a ±std band over seeds, the paper's published values dashed with hollow markers in the same colour;
* ``bars`` panels: x = the series, one bar per session (e.g. session 0 and session 1), measured only (the
  paper prints no numbers for those figures).

Scores are fractions in [0, 1] (mIoU too); axes are fitted to the values drawn
(:func:`jascl.results.figure_style.fitted_range`). Sizes, fonts and PNG encoding follow
:mod:`jascl.results.figure_style`.
"""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure

from jascl.fileio import atomic_write_bytes, atomic_write_text
from jascl.results.figure_style import (
    DPI,
    EMBED_WIDTH_PX,
    LABEL_PT,
    MARKERS,
    TICK_PT,
    TITLE_PT,
    fitted_range,
    png_bytes,
)

#: a point of a series: (x label, measured mean, measured std, seeds measured, published or None)
Point = tuple[str, float, float, int, "float | None"]


@dataclasses.dataclass(frozen=True)
class SeriesData:
    label: str
    points: tuple[Point, ...]


@dataclasses.dataclass(frozen=True)
class PanelData:
    key: str
    title: str
    kind: str
    series: tuple[SeriesData, ...]
    ylabel: str = "Dice"


@dataclasses.dataclass(frozen=True)
class FigureData:
    name: str
    caption: str
    panels: tuple[PanelData, ...]
    columns: int = 2


def _finite(v: float | None) -> bool:
    return v is not None and not math.isnan(v)


def _sessions_panel(ax, panel: PanelData) -> list[float]:
    xs_labels = list(dict.fromkeys(p[0] for s in panel.series for p in s.points))
    ends: list[float] = []
    for i, s in enumerate(panel.series):
        colour, marker = f"C{i % 10}", MARKERS[i % len(MARKERS)]
        x = np.array([xs_labels.index(p[0]) for p in s.points], dtype=float)
        mean = np.array([p[1] for p in s.points], dtype=float)
        std = np.array([p[2] if p[3] > 1 else 0.0 for p in s.points], dtype=float)
        ax.plot(x, mean, marker=marker, color=colour, linewidth=2, markersize=6, label=f"{s.label} (jascl)")
        if np.any(std > 0):
            ax.fill_between(x, mean - std, mean + std, color=colour, alpha=0.18, linewidth=0)
        published = np.array([p[4] if _finite(p[4]) else np.nan for p in s.points], dtype=float)
        if np.any(np.isfinite(published)):
            ax.plot(x, published, marker=marker, color=colour, linestyle="--", linewidth=1.3, markersize=6,
                    markerfacecolor="white", label=f"{s.label} (paper)")  # fmt: skip
        ends += [*(mean - std), *(mean + std), *published]
    ax.set_xticks(range(len(xs_labels)), xs_labels, fontsize=TICK_PT)
    ax.set_xlim(-0.3, max(len(xs_labels) - 0.7, 0.3))
    ax.set_xlabel("session (the model after training on it)", fontsize=LABEL_PT)
    return ends


def _bars_panel(ax, panel: PanelData) -> list[float]:
    sessions = list(dict.fromkeys(p[0] for s in panel.series for p in s.points))
    width = 0.8 / max(len(sessions), 1)
    ends: list[float] = []
    for j, session in enumerate(sessions):
        means, stds = [], []
        for s in panel.series:
            point = next((p for p in s.points if p[0] == session), None)
            means.append(point[1] if point is not None else math.nan)
            stds.append(point[2] if point is not None and point[3] > 1 else 0.0)
        xs = np.arange(len(panel.series)) - 0.4 + width * (j + 0.5)
        drawn = np.nan_to_num(np.array(means, dtype=float))
        ax.bar(xs, drawn, width=width * 0.92, color=f"C{j % 10}", label=session)
        if any(v > 0 for v in stds):
            ax.errorbar(xs, drawn, yerr=stds, fmt="none", ecolor="black", elinewidth=1, capsize=2)
        ends += [*(np.array(means) - np.array(stds)), *(np.array(means) + np.array(stds)), 0.0]
    ax.set_xticks(range(len(panel.series)), [s.label for s in panel.series], fontsize=TICK_PT)
    return ends


def figure_of(data: FigureData) -> Figure:
    """The figure's panels on a grid of ``data.columns`` columns (the paper's layout), lettered (a), (b), ..."""
    n = max(len(data.panels), 1)
    cols = min(n, data.columns)
    rows = math.ceil(n / cols)
    width = min(4.4 * cols, EMBED_WIDTH_PX / DPI - 0.3)
    fig = Figure(figsize=(width, 3.3 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, panel in zip(axes, data.panels):
        ends = _bars_panel(ax, panel) if panel.kind == "bars" else _sessions_panel(ax, panel)
        ax.set_ylim(*fitted_range(ends))
        ax.set_title(f"({panel.key}) {panel.title}", fontsize=TITLE_PT if "\n" not in panel.title else LABEL_PT)
        ax.set_ylabel(panel.ylabel, fontsize=LABEL_PT)
        ax.tick_params(axis="y", labelsize=TICK_PT)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=TICK_PT - 1, loc="best")
    for ax in axes[len(data.panels) :]:
        ax.set_visible(False)
    return fig


def svg_bytes(fig: Figure) -> bytes:
    """``fig`` as SVG (an explicit SVG canvas, no metadata dates, so reruns give the same file)."""
    FigureCanvasSVG(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    return buf.getvalue()


def figure_csv(data: FigureData) -> str:
    """One row per drawn point: figure, panel, series, x, measured mean / std / seeds, published."""

    def num(v: float | None) -> str:
        return "" if not _finite(v) else f"{v:.6g}"

    lines = ["figure,panel,title,series,x,measured_mean,measured_std,seeds,published"]
    for panel in data.panels:
        for s in panel.series:
            for x, mean, std, seeds, published in s.points:
                fields = [
                    data.name,
                    panel.key,
                    panel.title,
                    s.label,
                    x,
                    num(mean),
                    num(std),
                    str(seeds),
                    num(published),
                ]
                lines.append(",".join(f'"{f}"' if "," in f else f for f in fields))
    return "\n".join(lines) + "\n"


def write_figure(data: FigureData, out: str | Path) -> dict[str, Path]:
    """Write ``figure.png``, ``figure.svg`` and ``figure.csv`` into ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"png": out / "figure.png", "svg": out / "figure.svg", "csv": out / "figure.csv"}
    atomic_write_bytes(paths["png"], png_bytes(figure_of(data)))
    atomic_write_bytes(paths["svg"], svg_bytes(figure_of(data)))
    atomic_write_text(paths["csv"], figure_csv(data))
    return paths
