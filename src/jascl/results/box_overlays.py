"""Qualitative overlays of a detection run: test images with their ground-truth boxes and each method's detections
(score >= :data:`SCORE_THRESHOLD`) after a session, the detectors read from the run folder's checkpoints.

The detection counterpart of :mod:`jascl.results.overlays` (which loads the run's protocol and data and hands a
``task: detection`` protocol over to :func:`box_qualitative`). Conventions are those of
:mod:`jascl.results.figure_style`: one fixed colour per class id (:func:`~jascl.results.style.class_colours`), figures
at most :data:`~jascl.results.style.EMBED_WIDTH_PX` wide that wrap into rows, PNG bytes from an explicit Agg
canvas. A box is an unfilled rectangle in its class colour with a dark halo, labelled with the class name
(and the detection score on predictions); crowd / ignore boxes of the ground truth (``iscrowd`` 1, neither
rewarded nor penalised by mAP) are dashed.

Each model is built by the run's own trainer (:meth:`jascl.engine.loop.ContinualTrainer.load_session`, so the
detector the protocol's task trains) and never trained again; a detection's classifier row becomes a global
class id through the session's seen classes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import patheffects
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from jascl.results import figure_style as style
from jascl.results.blocks import ReportBlock, _figure
from jascl.results.records import RunResults
from jascl.results.runs import _session_folder

__all__ = [
    "SCORE_THRESHOLD",
    "DrawnBox",
    "SessionOverlay",
    "box_overlay_figure",
    "box_overlay_grid",
    "box_qualitative",
    "overlay_sessions",
    "predicted_boxes",
    "truth_boxes",
]

#: detections drawn: those scoring at least this
SCORE_THRESHOLD = 0.5
#: boxes drawn per panel at most (the highest-scoring; the panel title says how many there are)
MAX_BOXES = 20

_TRUTH = "ground truth"


@dataclass(frozen=True)
class DrawnBox:
    """One box as an overlay draws it.

    Attributes:
        box: ``(x1, y1, x2, y2)`` in image pixels.
        class_id: the global class id (its colour and name).
        score: the detection score; None for a ground-truth box.
        ignored: a ground-truth crowd / ignore region (drawn dashed).
    """

    box: tuple[float, float, float, float]
    class_id: int
    score: float | None = None
    ignored: bool = False


@dataclass(frozen=True)
class SessionOverlay:
    """The overlay figure of one session: its panel titles and one row per test image.

    ``rows``: per image ``{"image": (C, H, W) array, "label": caption, "ground truth": [DrawnBox], and per
    method column a list of :class:`DrawnBox`}``.
    """

    session: int
    title: str
    columns: list[str]
    rows: list[dict[str, Any]]


def truth_boxes(target: Mapping[str, np.ndarray]) -> list[DrawnBox]:
    """Every ground-truth box of a :class:`~jascl.data.types.DetectionSplit` target, in its order."""
    boxes = np.asarray(target["boxes"], dtype=float).reshape(-1, 4)
    labels = np.asarray(target["labels"]).reshape(-1)
    crowd = np.asarray(target.get("iscrowd", np.zeros(len(labels))), dtype=int).reshape(-1)
    return [
        DrawnBox((float(b[0]), float(b[1]), float(b[2]), float(b[3])), int(c), None, bool(k))
        for b, c, k in zip(boxes, labels, crowd)
    ]


def predicted_boxes(
    model: Any, image: np.ndarray, seen: Sequence[int], device: Any = "cpu", threshold: float = SCORE_THRESHOLD
) -> list[DrawnBox]:
    """The detections of ``model`` (a :class:`~jascl.networks.detector.Detector`) on one ``(C, H, W)`` image
    scoring at least ``threshold``, highest score first; classifier row r is class ``seen[r]``."""
    import torch

    from jascl.networks.base import eval_mode

    x = torch.as_tensor(np.asarray(image, dtype=np.float32)).to(device)
    with eval_mode(model), torch.no_grad():
        pred = model.predict([x])[0]
    ids = np.asarray(seen)[pred["labels"].cpu().numpy()]
    scores = pred["scores"].float().cpu().numpy()
    boxes = pred["boxes"].float().cpu().numpy().reshape(-1, 4)
    out = []
    for i in np.argsort(-scores, kind="stable"):
        if scores[i] >= threshold:
            x1, y1, x2, y2 = (float(v) for v in boxes[i])
            out.append(DrawnBox((x1, y1, x2, y2), int(ids[i]), float(scores[i])))
    return out


def _display(image: np.ndarray) -> tuple[np.ndarray, str | None]:
    """An image as shown: (H, W, 3) in [0, 1] for three channels, else the first channel in grey (its 1st-99th
    percentile range), with the colour map (None for RGB)."""
    image = np.asarray(image, dtype=float)
    if image.ndim == 2:
        image = image[None]
    if image.shape[0] == 3:
        rgb = np.moveaxis(image, 0, -1)
        lo, hi = np.percentile(rgb, [1, 99]) if rgb.size else (0.0, 1.0)
        return np.clip((rgb - lo) / (hi - lo if hi > lo else 1.0), 0.0, 1.0), None
    grey = image[0]
    lo, hi = np.percentile(grey, [1, 99]) if grey.size else (0.0, 1.0)
    return np.clip((grey - lo) / (hi - lo if hi > lo else 1.0), 0.0, 1.0), "gray"


def _draw_boxes(
    ax: Any, boxes: Sequence[DrawnBox], colours: Mapping[int, str], names: Mapping[int, str], height: int
) -> None:
    halo: list[patheffects.AbstractPathEffect] = [patheffects.withStroke(linewidth=2.6, foreground="black")]
    for b in boxes:
        x1, y1, x2, y2 = b.box
        colour = colours.get(b.class_id, "white")
        rect = Rectangle(
            (x1, y1),
            x2 - x1,
            y2 - y1,
            fill=False,
            edgecolor=colour,
            linewidth=1.4,
            linestyle="--" if b.ignored else "-",
        )
        rect.set_path_effects(halo)
        ax.add_patch(rect)
        text = names.get(b.class_id, str(b.class_id)) + ("" if b.score is None else f" {b.score:.2f}")
        top = y1 < 0.08 * height  # a label above a box at the image's top edge would be cut off: inside it
        ax.text(
            x1,
            y1,
            text,
            fontsize=style.SMALL_PT,
            color=style.text_colour_on(to_rgba(colour)),
            va="top" if top else "bottom",
            ha="left",
            clip_on=True,
            bbox={"facecolor": colour, "edgecolor": "none", "pad": 0.8, "alpha": 0.85},
        )


def box_overlay_figure(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    colours: Mapping[int, str],
    names: Mapping[int, str],
    title: str = "",
    max_columns: int = 4,
    max_boxes: int = MAX_BOXES,
) -> Figure:
    """The figure of :func:`box_overlay_grid` (for tests: each panel's title starts with its column, its
    :class:`~matplotlib.patches.Rectangle` patches are the boxes drawn)."""
    n_cols = len(columns)
    per_sample = max(1, math.ceil(n_cols / max(1, max_columns)))
    grid_cols = max(1, math.ceil(n_cols / per_sample))
    cell = min(2.5, (style.EMBED_WIDTH_PX / style.DPI - 0.6) / grid_cols)
    height = len(rows) * (per_sample * (cell + 0.35) + 0.35) + 0.8
    fig = Figure(figsize=(grid_cols * cell + 0.4, height), layout="constrained")
    subfigs: list = list(fig.subfigures(len(rows), 1, squeeze=False)[:, 0]) if rows else []
    present: set[int] = set()
    for sub, row in zip(subfigs, rows):
        axes = sub.subplots(per_sample, grid_cols, squeeze=False).ravel()
        shown, cmap = _display(row["image"])
        for c, ax in enumerate(axes):
            ax.set_xticks([])
            ax.set_yticks([])
            if c >= n_cols:
                ax.set_axis_off()
                continue
            ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
            boxes = row.get(columns[c]) if c > 0 else None
            many = boxes is not None and len(boxes) > max_boxes
            ax.set_title(
                f"{columns[c]} ({max_boxes} of {len(boxes)})" if many and boxes is not None else columns[c],
                fontsize=style.TICK_PT,
            )
            if c == 0:
                continue
            if boxes is None:
                ax.text(
                    0.5,
                    0.5,
                    "not available",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    fontsize=style.TICK_PT,
                    color="white",
                    bbox={"facecolor": "black", "alpha": 0.6},
                )
                continue
            boxes = list(boxes)[:max_boxes]
            present.update(b.class_id for b in boxes if b.class_id in colours)
            _draw_boxes(ax, boxes, colours, names, shown.shape[0])
            ax.set_xlim(-0.5, shown.shape[1] - 0.5)
            ax.set_ylim(shown.shape[0] - 0.5, -0.5)
        sub.suptitle(str(row.get("label", "")), fontsize=style.LABEL_PT, x=0.01, ha="left")
    handles = [Patch(facecolor=colours[c], label=f"{c} {names.get(c, '')}".strip()) for c in sorted(present)]
    if handles:
        fig.legend(
            handles=handles,
            loc="outside lower center",
            ncol=min(len(handles), max(3, grid_cols * 2)),
            fontsize=style.TICK_PT,
            frameon=False,
        )
    if title:
        fig.suptitle(title, fontsize=style.TITLE_PT)
    return fig


def box_overlay_grid(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[str],
    colours: Mapping[int, str],
    names: Mapping[int, str],
    title: str = "",
    max_columns: int = 4,
    max_boxes: int = MAX_BOXES,
) -> bytes:
    """Input, ground-truth boxes and each method's detections of a few test images, as PNG bytes.

    Args:
        rows: one mapping per image: ``"image"`` (C, H, W) (three channels shown in colour, otherwise the first
            in grey), ``"label"`` its caption, and for every column but the first a list of :class:`DrawnBox`
            (``None`` draws "not available").
        columns: panel titles; the first is the input image alone.
        colours: class id -> colour (:func:`jascl.results.style.class_colours`).
        names: class id -> name (box labels and legend).
        title: figure title.
        max_columns: panels per row; more wrap onto further rows.
        max_boxes: boxes drawn per panel at most, the first of its list (detections: the highest-scoring); the
            panel's title then says "(max_boxes of n)".
    """
    return style.png_bytes(box_overlay_figure(rows, columns, colours, names, title, max_columns, max_boxes))


def overlay_sessions(
    run: Path,
    results: RunResults,
    methods: Sequence[str],
    samples: int,
    protocol: Any,
    config: Any,
    data: Sequence[Any],
    device: Any,
    threshold: float = SCORE_THRESHOLD,
) -> list[SessionOverlay]:
    """What the overlays of a detection run draw, per session up to the longest method's last: ``samples`` test
    images spread over the session's test split, their ground truth, and per method the detections of its model
    after that session and after its last one.

    Raises:
        CheckpointError, OSError: a session model that cannot be read.
    """
    from jascl.engine.loop import ContinualTrainer
    from jascl.engine.plugin import Method

    trainer = ContinualTrainer(protocol, config, Method("report"), list(data), progress=False)
    cache: dict[tuple[str, int], Any] = {}

    def model_after(method: str, t: int) -> Any:
        if (method, t) not in cache:
            record = results.methods[method].sessions[0] if t == 0 else None
            folder = _session_folder(run, method, t, protocol.sessions[t].name, record)
            cache[(method, t)] = trainer.load_session(folder, t)[0].to(device)
        return cache[(method, t)]

    last = {m: len(results.methods[m].sessions) - 1 for m in methods}
    out: list[SessionOverlay] = []
    for t, session in enumerate(protocol.sessions):
        if all(t > last[m] for m in methods):
            break
        test = data[t].test
        if len(test) == 0:
            continue
        picks = sorted(set(np.linspace(0, len(test) - 1, min(samples, len(test))).round().astype(int).tolist()))
        columns = ["input", _TRUTH]
        for m in methods:
            if t <= last[m]:
                columns.append(f"{m} after S{t}")
            if t < last[m]:
                columns.append(f"{m} after S{last[m]}")
        rows = []
        for i in picks:
            row: dict[str, Any] = {"image": np.asarray(test.images[i]), "label": test.ids[i]}
            row[_TRUTH] = truth_boxes(test.targets[i])
            for m in methods:
                for s in sorted({t, last[m]}):
                    if t <= s <= last[m]:
                        model, seen = model_after(m, s), protocol.seen_classes(s)
                        row[f"{m} after S{s}"] = predicted_boxes(model, test.images[i], seen, device, threshold)
            rows.append(row)
        title = f"S{t} {session.name} (domain {', '.join(session.domains)}): test images"
        out.append(SessionOverlay(t, title, columns, rows))
    return out


def box_qualitative(
    run: Path,
    results: RunResults,
    methods: Sequence[str],
    samples: int,
    protocol: Any,
    config: Any,
    data: Sequence[Any],
    device: Any,
    prefix: str,
    echo: Callable[[str], None] = print,
) -> list[ReportBlock]:
    """The report's qualitative figures of a detection run, one per session (:func:`overlay_sessions`)."""
    names = {c.id: c.name for c in protocol.classes}
    colours = style.class_colours([c.id for c in protocol.classes])
    blocks = []
    for overlay in overlay_sessions(run, results, methods, samples, protocol, config, data, device):
        t, session = overlay.session, protocol.sessions[overlay.session]
        blocks.append(
            _figure(
                f"{prefix}-qualitative-s{t}",
                box_overlay_grid(overlay.rows, overlay.columns, colours, names, overlay.title),
                f"Session {t} ({session.name}) test images: the input, its ground-truth boxes (dashed: ignore "
                f"regions) and each method's detections with score ≥ {SCORE_THRESHOLD:g} (class name and score on "
                f"each box; the {MAX_BOXES} highest-scoring where there are more, as the panel's title says) after that "
                "session and after its last one; one colour per class in every figure",
            )
        )
    echo(f"[report] detection overlays: {len(blocks)} session figure(s)")
    return blocks
