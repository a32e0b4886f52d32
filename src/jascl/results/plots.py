"""Figures of a run as PNG bytes (matplotlib's Agg canvas; no display, no pyplot global state).

Every function takes plain numbers / numpy arrays and returns the encoded PNG,
so the HTML report can embed it (base64) and the Markdown report can write it
next to itself. Figures are built on :class:`matplotlib.figure.Figure` with an
explicit Agg canvas instead of ``pyplot``, so nothing depends on (or changes)
the process-wide backend and no figure is ever left open.

Conventions:

* Label maps hold *global* class ids (0 = background, 255 = ignore);
  :func:`class_colours` gives every class id one fixed colour across all figures
  of a report (a list chosen for distinctness, then generated hues).
* Score axes and colour scales are fitted to the values shown (:func:`fitted_range`),
  never silently fixed to 0-1; the callers state the range in the caption.
* Sizes: figures are at most :data:`EMBED_WIDTH_PX` wide at :data:`DPI`, the width
  the HTML page shows them at without scaling, so the fonts (>= :data:`MIN_FONT_PT`)
  keep their size on the page; wide overlay grids wrap into rows instead of shrinking.
* Volumes: a slice is chosen by :func:`choose_slices` (most ground-truth foreground)
  in an anatomical plane read from the axis codes of the array's affine
  (:func:`axis_codes`, nibabel's ``aff2axcodes``), or along an array axis when
  there is no affine (synthetic volumes).
"""

from __future__ import annotations

import colorsys
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib import colormaps, patheffects
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Normalize, to_rgba
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

__all__ = [
    "DPI",
    "EMBED_WIDTH_PX",
    "MIN_FONT_PT",
    "SliceView",
    "axis_codes",
    "choose_slices",
    "class_colours",
    "class_heatmap",
    "display_slice",
    "fitted_range",
    "format_range",
    "loss_curves",
    "overlay_figure",
    "overlay_grid",
    "pseudo_label_plot",
    "session_curves",
    "slice_axis",
]

#: dots per inch of every figure
DPI = 110
#: widest figure (pixels) the HTML page shows unscaled (its 1360 px body less padding)
EMBED_WIDTH_PX = 1320
#: smallest font size (points) of any text in a figure, at the embedded size
MIN_FONT_PT = 8

# Class colours, indexed by class id - 1: a Glasbey-like list, Trubetskoy's "20 simple, distinct colours",
# ordered so that the first ids (the classes most protocols have) differ most (the first seven are at least
# 50 CIE76 Delta-E apart) and the pale ones that vanish on a grey-scale image come last; ids beyond the list
# get generated hues (golden-ratio steps).
_PALETTE = [
    "#E6194B",  # red
    "#3CB44B",  # green
    "#4363D8",  # blue
    "#FFE119",  # yellow
    "#42D4F4",  # cyan
    "#F032E6",  # magenta
    "#F58231",  # orange
    "#9A6324",  # brown
    "#BFEF45",  # lime
    "#469990",  # teal
    "#911EB4",  # purple
    "#000075",  # navy
    "#800000",  # maroon
    "#808000",  # olive
    "#FABED4",  # pink
    "#AAFFC3",  # mint
    "#DCBEFF",  # lavender
    "#FFD8B1",  # apricot
    "#FFFAC8",  # beige
    "#A9A9A9",  # grey
]

#: one marker shape per method (in the order of the curves)
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")

# font sizes (points); all >= MIN_FONT_PT
_TITLE, _LABEL, _TICK, _SMALL = 11, 10, 9, 8


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


def _colour(class_id: int) -> str:
    i = class_id - 1
    if i < len(_PALETTE):
        return _PALETTE[i]
    k = i - len(_PALETTE)
    hue = (0.11 + 0.618034 * k) % 1.0
    value = (0.95, 0.7, 0.5)[(k // 7) % 3]  # a second and third pass at darker values keep hues apart
    r, g, b = colorsys.hsv_to_rgb(hue, 0.85, value)
    return f"#{round(r * 255):02X}{round(g * 255):02X}{round(b * 255):02X}"


def class_colours(class_ids: Sequence[int]) -> dict[int, str]:
    """A fixed colour per foreground class id (background gets none: it is left transparent).

    The colour depends on the id alone, so a class has the same colour in every figure and report.
    """
    return {int(c): _colour(int(c)) for c in class_ids if int(c) not in (0, 255)}


# --- fitted ranges ---------------------------------------------------------------------------------------------


def fitted_range(
    values: Sequence[float] | np.ndarray,
    bounds: tuple[float, float] = (0.0, 1.0),
    margin: float = 0.08,
    min_span: float = 0.02,
) -> tuple[float, float]:
    """An axis or colour range fitted to ``values`` with a small margin.

    The range is ``[min - pad, max + pad]`` with ``pad = margin * (max - min)``, widened
    around the centre to ``min_span`` when the values are closer together than that (a
    flat line still gets an axis), then clipped to ``bounds`` (scores live in [0, 1]).
    NaN / inf are ignored; no finite value gives ``bounds`` (or (0, 1) if unbounded).

    Example: values 0.50 and 0.51 give (0.495, 0.515).
    """
    lo_bound, hi_bound = bounds
    a = np.asarray(values, dtype=float).ravel()
    a = a[np.isfinite(a)]
    if a.size == 0:
        return (lo_bound if math.isfinite(lo_bound) else 0.0, hi_bound if math.isfinite(hi_bound) else 1.0)
    lo, hi = float(a.min()), float(a.max())
    pad = margin * (hi - lo)
    if hi - lo + 2 * pad < min_span:
        pad = (min_span - (hi - lo)) / 2
    lo, hi = max(lo - pad, lo_bound), min(hi + pad, hi_bound)
    if hi - lo < min_span:  # clipped at a bound: extend away from it
        lo, hi = (lo, lo + min_span) if lo == lo_bound else (hi - min_span, hi)
    return lo, hi


def format_range(lo: float, hi: float, scale: float = 1.0) -> str:
    """``"0.49-0.52"`` with enough decimals to tell the ends apart (``scale`` = 100 for IoU ×100)."""
    lo, hi = lo * scale, hi * scale
    span = abs(hi - lo)
    decimals = max(0, min(4, (1 - math.floor(math.log10(span))) if span > 0 else 2))
    return f"{lo:.{decimals}f}–{hi:.{decimals}f}"


# --- session curves -------------------------------------------------------------------------------------------


def _mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    valid = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not valid:
        return math.nan, 0.0, 0
    return float(np.mean(valid)), float(np.std(valid, ddof=1)) if len(valid) > 1 else 0.0, len(valid)


def _band(per_x: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray, int]:
    """(means, sample stds, largest number of seeds) of per-x per-seed values."""
    stats = [_mean_std(v) for v in per_x]
    return (
        np.asarray([s[0] for s in stats], dtype=float),
        np.asarray([s[1] for s in stats], dtype=float),
        max((s[2] for s in stats), default=0),
    )


def curves_range(
    panels: Mapping[str, Mapping[str, Sequence[Sequence[float]]]], bounds: tuple[float, float] = (0.0, 1.0)
) -> tuple[float, float]:
    """The y range :func:`session_curves` uses: fitted to every mean ± std it draws."""
    ends: list[float] = []
    for methods in panels.values():
        for per_session in methods.values():
            means, stds, _ = _band(per_session)
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
            means, stds, seeds = _band(per_session)
            # methods side by side around each session (a small dodge) with their own marker, so equal
            # values (two methods on the same shared base model) stay visible as two lines
            xs = x[: len(means)] + 0.04 * (i - (len(methods) - 1) / 2)
            colour = f"C{i % 10}"
            label = method if seeds < 2 else f"{method} ({seeds} seeds)"
            marker = _MARKERS[i % len(_MARKERS)]
            # clip_on=False: a marker on the axis' end (a score of 0) is drawn whole
            ax.plot(xs, means, marker=marker, linewidth=2, markersize=6, color=colour, label=label, clip_on=False)
            if np.any(stds > 0):
                ax.fill_between(xs, means - stds, means + stds, color=colour, alpha=0.18, linewidth=0)
        ax.set_title(title, fontsize=_TITLE)
        ax.set_xlim(-0.25, max(len(x) - 0.75, 0.25))
        ax.set_xticks(x, list(session_labels), rotation=20 if len(x) > 5 else 0, fontsize=_TICK)
        ax.tick_params(axis="y", labelsize=_TICK)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(xlabel, fontsize=_LABEL)
        ax.set_ylabel(ylabel if isinstance(ylabel, str) else ylabel.get(title, ""), fontsize=_LABEL)
        ax.legend(fontsize=_TICK, loc="best")
    return _png(fig)


# --- heat maps ------------------------------------------------------------------------------------------------


def _luminance(rgba: Sequence[float]) -> float:
    """Relative luminance (sRGB, WCAG) of a colour."""

    def lin(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (lin(float(c)) for c in rgba[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def text_colour_on(rgba: Sequence[float]) -> str:
    """Black or white, whichever contrasts more with ``rgba`` (WCAG contrast ratio)."""
    lum = _luminance(rgba)
    return "black" if (lum + 0.05) / 0.05 >= 1.05 / (lum + 0.05) else "white"


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
                    fontsize=_TICK,
                    color=text_colour_on(cmap(norm(v))),
                )
    ax.set_xticks(range(cols), list(col_labels), fontsize=_TICK)
    ax.set_yticks(range(rows), list(row_labels), fontsize=_TICK)
    ax.set_xlabel("session (the model after training on it)", fontsize=_LABEL)
    ax.set_ylabel("class", fontsize=_LABEL)
    ax.set_title(title, fontsize=_TITLE)
    bar = fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
    bar.ax.tick_params(labelsize=_SMALL)
    scale_note = f"colour scale {format_range(lo, hi, scale)}"
    bar.set_label(f"{colour_label}, {scale_note}" if colour_label else scale_note, fontsize=_SMALL)
    return _png(fig)


# --- slices of volumes ----------------------------------------------------------------------------------------

#: the axis code pair each plane is perpendicular to
_PLANE_OF = {"S": "axial", "I": "axial", "A": "coronal", "P": "coronal", "L": "sagittal", "R": "sagittal"}


def axis_codes(affine: np.ndarray | None) -> tuple[str, str, str] | None:
    """The anatomical direction each array axis points to (``("R", "A", "S")`` for an identity affine), from a
    (4, 4) voxel-to-world affine in RAS+ world coordinates (NIfTI / nibabel); None without an affine."""
    if affine is None:
        return None
    from nibabel.orientations import aff2axcodes

    codes = aff2axcodes(np.asarray(affine, dtype=float))
    if any(c is None for c in codes):
        return None
    return (str(codes[0]), str(codes[1]), str(codes[2]))


def slice_axis(codes: Sequence[str] | None, plane: str = "axial") -> tuple[int, str]:
    """(array axis, plane name) of the slices of ``plane`` in an array with axis ``codes``.

    Axial slices are perpendicular to the S/I axis, coronal to A/P, sagittal to L/R. Without
    codes (an array without affine) the slices are taken along the last array axis and have no
    plane name (``""``).

    Raises:
        ValueError: ``plane`` is none of axial / coronal / sagittal.
    """
    if plane not in ("axial", "coronal", "sagittal"):
        raise ValueError(f"plane {plane!r}: choose axial, coronal or sagittal")
    if codes is None:
        return 2, ""
    for axis, code in enumerate(codes):
        if _PLANE_OF.get(str(code).upper()) == plane:
            return axis, plane
    raise ValueError(f"axis codes {tuple(codes)} have no {plane} direction")


@dataclass(frozen=True)
class SliceView:
    """One slice of a volume, and how it is displayed.

    Attributes:
        axis: the array axis sliced.
        index: the slice index along it.
        depth: the number of slices along it.
        plane: "axial" / "coronal" / "sagittal", or "" (no affine: an array axis).
        codes: the volume's axis codes (None without affine); the remaining two
            orient the displayed image (radiological convention: patient's right
            on the image's left; anterior, or superior, up).
    """

    axis: int
    index: int
    depth: int
    plane: str = ""
    codes: tuple[str, ...] | None = None

    def take(self, volume: np.ndarray) -> np.ndarray:
        """The (H, W) slice of a (X, Y, Z) array, oriented for display."""
        image = np.take(np.asarray(volume), self.index, axis=self.axis)
        if self.codes is None:
            return image
        rest = [str(c).upper() for i, c in enumerate(self.codes) if i != self.axis]
        vertical = {"A", "P"} if self.plane == "axial" else {"S", "I"}
        if rest[0] not in vertical:  # rows must run along the vertical direction
            image, rest = image.T, rest[::-1]
        if rest[0] in ("A", "S"):  # index grows towards anterior / superior: put that end on top
            image = image[::-1, :]
        # columns: R-L (axial, coronal), patient's right on the left; A-P (sagittal), anterior on the left
        if rest[1] in ("R", "A"):
            image = image[:, ::-1]
        return image

    def describe(self) -> str:
        """E.g. ``"axial slice 41/96"``, or ``"slice 7/16 along array axis 2"`` without affine."""
        if self.plane:
            return f"{self.plane} slice {self.index}/{self.depth}"
        return f"slice {self.index}/{self.depth} along array axis {self.axis}"


def choose_slices(
    label: np.ndarray | None,
    shape: Sequence[int],
    codes: Sequence[str] | None = None,
    count: int = 1,
    plane: str = "axial",
) -> list[SliceView]:
    """The slices of a volume to show: the one with the most ground-truth foreground first.

    Args:
        label: (X, Y, Z) ground truth (global ids; 0 background and 255 ignore are not foreground),
            or None (the middle slice).
        shape: the volume's spatial shape (X, Y, Z).
        codes: axis codes (:func:`axis_codes`); None = slices along the last array axis.
        count: how many slices: the centres of ``count`` equal parts of the range of slices that
            contain foreground (the whole volume when there is none), the one nearest the fullest
            replaced by it; the fullest first, the others in ascending order. With 2 slices over
            z = 5..15 the parts are 5..10.5 and 10.5..16, centred on z = 7 and 13: never an edge slice
            that shows a few voxels.
        plane: the anatomical plane when ``codes`` are given.

    Returns:
        ``count`` (or fewer, when the volume has fewer slices) :class:`SliceView`, the fullest first.
    """
    axis, plane_name = slice_axis(codes, plane)
    depth = int(shape[axis])
    codes_t = tuple(str(c) for c in codes) if codes is not None else None
    area = np.zeros(depth)
    if label is not None:
        fg = (np.asarray(label) > 0) & (np.asarray(label) != 255)
        area = np.moveaxis(fg, axis, 0).reshape(depth, -1).sum(1)
    if area.max() > 0:
        best = int(area.argmax())
        present = np.flatnonzero(area)
        lo, hi = int(present.min()), int(present.max())
    else:
        best, lo, hi = depth // 2, 0, depth - 1
    # the centres of ``count`` equal parts of the extent (never its edge slices, which may hold a few voxels),
    # the one nearest the fullest replaced by it
    parts = max(1, min(count, hi - lo + 1))
    width = (hi - lo + 1) / parts
    spread = sorted({int(np.floor(lo + (k + 0.5) * width)) for k in range(parts)})
    spread.pop(int(np.argmin([abs(i - best) for i in spread])))
    picks = [best, *spread]
    return [SliceView(axis, i, depth, plane_name, codes_t) for i in picks]


def display_slice(array: np.ndarray, label: np.ndarray | None = None) -> tuple[np.ndarray, str]:
    """A 2D view of an image or volume: the volume's slice along its last axis with the most foreground of
    ``label`` (:func:`choose_slices` without axis codes), with its description (``""`` for a 2D image)."""
    if array.ndim == 2:
        return array, ""
    if array.ndim != 3:
        raise ValueError(f"expected a 2D image or 3D volume, got shape {array.shape}")
    view = choose_slices(label, array.shape)[0]
    return view.take(array), view.describe()


# --- overlays -------------------------------------------------------------------------------------------------


def _label_rgba(label: np.ndarray, colours: Mapping[int, str], alpha: float) -> np.ndarray:
    rgba = np.zeros((*label.shape, 4), dtype=float)
    for cid, colour in colours.items():
        rgba[label == cid] = (*to_rgba(colour)[:3], alpha)
    return rgba


def _contours(ax, truth: np.ndarray, colours: Mapping[int, str]) -> None:
    """Ground-truth outlines in the class colours, with a dark halo so they stand out on any fill."""
    halo = [patheffects.withStroke(linewidth=2.6, foreground="black")]
    for cid in sorted(int(v) for v in np.unique(truth) if int(v) in colours):
        mask = (truth == cid).astype(float)
        if mask.any():
            lines = ax.contour(mask, levels=[0.5], colors=[colours[cid]], linewidths=1.4)
            lines.set_path_effects(halo)


def overlay_figure(
    rows: Sequence[Mapping[str, object]],
    columns: Sequence[str],
    colours: Mapping[int, str],
    names: Mapping[int, str],
    title: str = "",
    truth: str = "ground truth",
    max_columns: int = 4,
    alpha: float = 0.7,
) -> Figure:
    """The figure of :func:`overlay_grid` (for tests of its layout)."""
    n_cols = len(columns)
    # as few rows per sample as ``max_columns`` allows, the panels spread evenly over them (5 -> 3 + 2)
    per_sample = max(1, math.ceil(n_cols / max(1, max_columns)))
    grid_cols = max(1, math.ceil(n_cols / per_sample))
    cell = min(2.5, (EMBED_WIDTH_PX / DPI - 0.6) / grid_cols)
    height = len(rows) * (per_sample * (cell + 0.35) + 0.35) + 0.8
    fig = Figure(figsize=(grid_cols * cell + 0.4, height), layout="constrained")
    subfigs: list = list(fig.subfigures(len(rows), 1, squeeze=False)[:, 0]) if rows else []
    present: set[int] = set()
    for sub, row in zip(subfigs, rows):
        axes = sub.subplots(per_sample, grid_cols, squeeze=False).ravel()
        image = np.asarray(row["image"], dtype=float)
        lo, hi = np.percentile(image, [1, 99]) if image.size else (0.0, 1.0)
        outline = row.get(truth)
        for c, ax in enumerate(axes):
            ax.set_xticks([])
            ax.set_yticks([])
            if c >= n_cols:
                ax.set_axis_off()
                continue
            column = columns[c]
            # under a label map the image is faded towards white, so the class colours keep their hue
            ax.imshow(
                image,
                cmap="gray",
                vmin=lo,
                vmax=hi if hi > lo else lo + 1,
                interpolation="nearest",
                alpha=1.0 if c == 0 else 0.55,
            )
            ax.set_title(column, fontsize=_TICK)
            if c == 0:
                continue
            label = row.get(column)
            if label is None:
                ax.text(
                    0.5,
                    0.5,
                    "not available",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    fontsize=_TICK,
                    color="white",
                    bbox={"facecolor": "black", "alpha": 0.6},
                )
                continue
            label = np.asarray(label)
            present.update(int(v) for v in np.unique(label) if int(v) in colours)
            ax.imshow(_label_rgba(label, colours, alpha), interpolation="nearest")
            if column != truth and outline is not None:
                _contours(ax, np.asarray(outline), colours)
        sub.suptitle(str(row.get("label", "")), fontsize=_LABEL, x=0.01, ha="left")
    handles: list[Patch | Line2D] = [
        Patch(facecolor=colours[c], label=f"{c} {names.get(c, '')}".strip()) for c in sorted(present)
    ]
    if handles:
        handles.append(Line2D([], [], color="0.3", linewidth=1.4, label=f"outline: {truth}"))
        fig.legend(
            handles=handles,
            loc="outside lower center",
            ncol=min(len(handles), max(3, grid_cols * 2)),
            fontsize=_TICK,
            frameon=False,
        )
    if title:
        fig.suptitle(title, fontsize=_TITLE)
    return fig


def overlay_grid(
    rows: Sequence[Mapping[str, object]],
    columns: Sequence[str],
    colours: Mapping[int, str],
    names: Mapping[int, str],
    title: str = "",
    truth: str = "ground truth",
    max_columns: int = 4,
    alpha: float = 0.7,
) -> bytes:
    """Input, ground truth and predictions of a few samples: label maps filled over the input, the ground truth
    outlined on every prediction.

    Args:
        rows: one mapping per sample: ``"image"`` (H, W) float, ``"label"`` the sample's
            caption (id, slice), and for every column title but the first a (H, W)
            global-id label map (``None`` draws "not available").
        columns: panel titles; the first is the input image alone.
        colours: class id -> colour (:func:`class_colours`).
        names: class id -> name, for the legend.
        title: figure title.
        truth: the column holding the ground truth, outlined on the other label panels.
        max_columns: panels per row; a sample with more panels wraps onto further rows, so the
            figure keeps its width (and its fonts their size) however many methods there are.
        alpha: opacity of the label fill.

    Returns:
        PNG bytes.
    """
    return _png(overlay_figure(rows, columns, colours, names, title, truth, max_columns, alpha))


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
                means, stds, _ = _band(per_epoch)
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
                fontsize=_SMALL,
                color="0.25",
            )
            start += epochs
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=_SMALL, loc="best")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(*fitted_range(ends, (0.0, math.inf), margin=0.05, min_span=1e-3))
        ax.set_xlim(-0.5, max(start - 0.5, 0.5))
        ax.set_title(method, fontsize=_TITLE, pad=14)
        ax.set_xlabel("epoch (sessions in order, dotted line: next session)", fontsize=_LABEL)
        ax.set_ylabel("training loss", fontsize=_LABEL)
        ax.tick_params(labelsize=_TICK)
        ax.grid(True, alpha=0.3)
    return _png(fig)
