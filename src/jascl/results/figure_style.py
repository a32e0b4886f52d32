"""What every figure of jascl shares: sizes, fonts, class colours, fitted ranges and PNG encoding.

Conventions (every figure module follows them: :mod:`jascl.results.charts`, :mod:`jascl.results.plots`,
:mod:`jascl.results.box_overlays`, :mod:`jascl.results.paper_figures`):

* Label maps hold *global* class ids (0 = background, 255 = ignore);
  :func:`class_colours` gives every class id one fixed colour across all figures
  of a report (a list chosen for distinctness, then generated hues).
* Score axes and colour scales are fitted to the values shown (:func:`fitted_range`),
  never silently fixed to 0-1; the callers state the range in the caption.
* Sizes: figures are at most :data:`EMBED_WIDTH_PX` wide at :data:`DPI`, the width
  the HTML page shows them at without scaling, so the fonts (>= :data:`MIN_FONT_PT`)
  keep their size on the page.
* Figures are built on :class:`matplotlib.figure.Figure` and encoded by :func:`png_bytes` on an explicit
  Agg canvas instead of ``pyplot``, so nothing depends on (or changes) the process-wide backend.
"""

from __future__ import annotations

import colorsys
import io
import math
from collections.abc import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

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
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")

#: font sizes (points) of titles, axis labels, tick labels and small notes; all >= MIN_FONT_PT
TITLE_PT, LABEL_PT, TICK_PT, SMALL_PT = 11, 10, 9, 8


def png_bytes(fig: Figure) -> bytes:
    """``fig`` encoded as PNG at :data:`DPI` on an explicit Agg canvas (no pyplot state, no metadata)."""
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


# --- seeds and contrast ----------------------------------------------------------------------------------------


def mean_std_count(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, sample std, count) of the finite values; (NaN, 0, 0) without any."""
    valid = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not valid:
        return math.nan, 0.0, 0
    return float(np.mean(valid)), float(np.std(valid, ddof=1)) if len(valid) > 1 else 0.0, len(valid)


def band(per_x: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray, int]:
    """(means, sample stds, largest number of seeds) of per-x per-seed values."""
    stats = [mean_std_count(v) for v in per_x]
    return (
        np.asarray([s[0] for s in stats], dtype=float),
        np.asarray([s[1] for s in stats], dtype=float),
        max((s[2] for s in stats), default=0),
    )


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
