"""Images of a run as PNG bytes: slices of volumes and label-map overlays (input, ground truth, predictions).

Every function takes numpy arrays and returns the encoded PNG (or the figure, for layout tests); sizes, fonts
and class colours follow :mod:`jascl.results.figure_style` (re-exported here: :func:`class_colours`, :data:`DPI`,
:data:`EMBED_WIDTH_PX`, :data:`MIN_FONT_PT`), the charts of numbers are in :mod:`jascl.results.charts`.

Conventions:

* Label maps hold *global* class ids (0 = background, 255 = ignore), each drawn in its
  :func:`class_colours` colour; wide overlay grids wrap into rows instead of shrinking.
* Volumes: a slice is chosen by :func:`choose_slices` (most ground-truth foreground)
  in an anatomical plane read from the axis codes of the array's affine
  (:func:`axis_codes`, nibabel's ``aff2axcodes``), or along an array axis when
  there is no affine (synthetic volumes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib import patheffects
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from jascl.results.figure_style import (
    DPI,
    EMBED_WIDTH_PX,
    LABEL_PT,
    MIN_FONT_PT,
    TICK_PT,
    TITLE_PT,
    class_colours,
    png_bytes,
)

__all__ = [
    "DPI",
    "EMBED_WIDTH_PX",
    "MIN_FONT_PT",
    "SliceView",
    "axis_codes",
    "choose_slices",
    "class_colours",
    "display_slice",
    "overlay_figure",
    "overlay_grid",
    "slice_axis",
]

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
            ax.set_title(column, fontsize=TICK_PT)
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
                    fontsize=TICK_PT,
                    color="white",
                    bbox={"facecolor": "black", "alpha": 0.6},
                )
                continue
            label = np.asarray(label)
            present.update(int(v) for v in np.unique(label) if int(v) in colours)
            ax.imshow(_label_rgba(label, colours, alpha), interpolation="nearest")
            if column != truth and outline is not None:
                _contours(ax, np.asarray(outline), colours)
        sub.suptitle(str(row.get("label", "")), fontsize=LABEL_PT, x=0.01, ha="left")
    handles: list[Patch | Line2D] = [
        Patch(facecolor=colours[c], label=f"{c} {names.get(c, '')}".strip()) for c in sorted(present)
    ]
    if handles:
        handles.append(Line2D([], [], color="0.3", linewidth=1.4, label=f"outline: {truth}"))
        fig.legend(
            handles=handles,
            loc="outside lower center",
            ncol=min(len(handles), max(3, grid_cols * 2)),
            fontsize=TICK_PT,
            frameon=False,
        )
    if title:
        fig.suptitle(title, fontsize=TITLE_PT)
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
    return png_bytes(overlay_figure(rows, columns, colours, names, title, truth, max_columns, alpha))
