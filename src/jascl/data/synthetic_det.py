"""Embedded synthetic *detection* benchmark: the synthetic generator's scenes with one box per object.

The images are exactly those of :class:`jascl.data.synthetic.SyntheticRenderer` (same shapes, domains,
appearance and per-sample random streams ``(seed, session, split name, index)``); this module only records
each object's pixels while the scene is drawn and turns them into boxes. Protocols with ``task: detection``
and a ``synthetic`` section (the built-in ``synthetic-det``) are generated here; their splits are
:class:`~jascl.data.types.DetectionSplit`.

Boxes: every object instance gets the tight bounding box of its *visible* pixels, after the objects drawn
later have covered part of it, as ``[x1, y1, x2, y2]`` float32 pixels with x = column, y = row and
``x2 = last column + 1``, ``y2 = last row + 1`` (COCO-style pixel boxes: a one-pixel object at row r, column c
is ``[c, r, c + 1, r + 1]``). An object with fewer than :data:`MIN_BOX_PIXELS` visible pixels (hidden under
later objects, or a sliver) gets no box: nothing in the image shows it. Boxes are listed in drawing order;
``labels`` are global class ids (int64).

Splits, as the segmentation generator makes them (the session's loader keeps the boxes of the classes it
teaches; targets keep every box of the image, all classes):

* ``train``: base sessions (shots "all") draw 1..n objects of the session's classes; K-shot sessions draw K
  images per taught class, each showing that class (the *primary*: one or two instances, drawn last, so the
  last one is fully visible) over up to ``distractors`` objects of earlier sessions' classes. A K-shot image
  whose primary ends up without a box is refused (:class:`~jascl.errors.DataError`).
* ``unlabelled``: the session's pool, ``unlabelled`` images of 1..n objects of the session's classes, then
  ``unlabelled_per_class`` images per taught class showing it, all over distractors; its targets are the
  hidden ground truth, kept only to measure pseudo-label quality.
* ``test``: objects of the session's classes only. ``validation`` (``validation`` > 0): that many images per
  taught class, each showing it, no other class.

``unlabelled_sources`` (samples borrowed from earlier domains) are not supported for detection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jascl.data.synthetic import SyntheticRenderer, _stable_int, default_cache_dir, protocol_digest
from jascl.data.types import DetectionSplit, SessionData
from jascl.errors import DataError
from jascl.fileio import atomic_write
from jascl.protocols.schema import DomainSpec, Protocol, SessionSpec

__all__ = [
    "DETECTION_FORMAT",
    "MIN_BOX_PIXELS",
    "DetectionRenderer",
    "generate_detection",
    "load_or_generate_detection",
    "visible_boxes",
]

#: an object with fewer visible pixels than this gets no box
MIN_BOX_PIXELS = 12
#: version of the box rules and cache layout; part of the cache file name (``session<i>.det<v>.npz``), so a
#: segmentation cache (``session<i>.npz``) is never read as detection, nor a cache made under older rules
DETECTION_FORMAT = 1

_SPLITS = ("train", "test", "unlabelled", "validation")


def visible_boxes(
    masks: Sequence[np.ndarray], labels: Sequence[int], min_pixels: int = MIN_BOX_PIXELS
) -> dict[str, np.ndarray]:
    """Boxes of the visible part of objects drawn in order (later masks cover earlier ones).

    Args:
        masks: one (H, W) bool mask per object, in drawing order (the full shape, before occlusion).
        labels: the objects' global class ids, same order.
        min_pixels: objects with fewer visible pixels get no box.

    Returns:
        ``{"boxes": (M, 4) float32 [x1, y1, x2, y2], "labels": (M,) int64}`` for the M objects with at least
        ``min_pixels`` visible pixels, in drawing order; x = column, y = row, x2 / y2 exclusive (last + 1).
    """
    if len(masks) != len(labels):
        raise ValueError(f"{len(masks)} masks but {len(labels)} labels")
    kept: list[tuple[list[float], int]] = []
    covered: np.ndarray | None = None
    for mask, label in zip(reversed(masks), reversed(labels)):
        mask = np.asarray(mask, dtype=bool)
        visible = mask if covered is None else mask & ~covered
        covered = mask.copy() if covered is None else covered | mask
        if int(visible.sum()) < min_pixels:
            continue
        rows = np.flatnonzero(visible.any(axis=1))
        cols = np.flatnonzero(visible.any(axis=0))
        kept.append(([float(cols[0]), float(rows[0]), float(cols[-1] + 1), float(rows[-1] + 1)], int(label)))
    kept.reverse()
    return {
        "boxes": np.array([b for b, _ in kept], dtype=np.float32).reshape(-1, 4),
        "labels": np.array([c for _, c in kept], dtype=np.int64),
    }


class DetectionRenderer(SyntheticRenderer):
    """:class:`SyntheticRenderer` that also returns each sample's boxes. Pure function of (protocol,
    session, split, index); the images are bit-identical to the segmentation renderer's.

    Raises:
        DataError: the protocol is not ``task: detection``, has no ``synthetic`` section, or asks for
            ``unlabelled_sources``.
    """

    def __init__(self, protocol: Protocol) -> None:
        if protocol.task != "detection":
            raise DataError(
                f"{protocol.path}: task is {protocol.task!r}; synthetic detection data needs 'task: detection'"
            )
        if protocol.synthetic is None:
            raise DataError(f"{protocol.path}: protocol has no 'synthetic' section; it cannot be generated")
        borrowing = [s.name for s in protocol.sessions if s.unlabelled_sources]
        if borrowing:
            raise DataError(
                f"{protocol.path}: session(s) {', '.join(borrowing)} set unlabelled_sources, which synthetic "
                "detection data does not support; remove the key"
            )
        super().__init__(protocol)
        self._drawn: list[np.ndarray] | None = None

    def _object_mask(self, rng: np.random.Generator, shape: str) -> np.ndarray:
        mask = super()._object_mask(rng, shape)
        if self._drawn is not None:  # recording during render_boxes: the masks in drawing order
            self._drawn.append(mask)
        return mask

    def render_boxes(
        self, rng: np.random.Generator, domain: DomainSpec, objects: list[int]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Render one sample (:meth:`SyntheticRenderer.render`, same draws from ``rng``) and its boxes.

        Returns:
            image (C, H, W) float32 and target ``{"boxes": (M, 4) float32, "labels": (M,) int64}``
            (:func:`visible_boxes`).
        """
        self._drawn = []
        try:
            image, _ = self.render(rng, domain, objects)
            masks = self._drawn
        finally:
            self._drawn = None
        return image, visible_boxes(masks, objects)

    # The segmentation renderer's ``session`` builds the split plans (base draws, K per class, pools,
    # validation) and calls ``_split`` for each; here ``_split`` returns boxes instead of label maps.
    def _split(  # type: ignore[override]  # same plan and random streams; DetectionSplit instead of Split
        self, session: SessionSpec, split: str, plan: list[int | None], distractors: bool
    ) -> DetectionSplit:
        images, targets, ids = [], [], []
        domains = [self.protocol.domains[d] for d in session.domains]
        for i, primary in enumerate(plan):
            rng = np.random.default_rng([self.protocol.seed, session.index, _stable_int(split), i])
            domain = domains[i % len(domains)]
            image, target = self.render_boxes(rng, domain, self._sample_objects(rng, session, primary, distractors))
            sample_id = f"s{session.index}-{session.name}/{split}/{i:05d}"
            if primary is not None and primary not in target["labels"]:
                raise DataError(
                    f"{self.protocol.path}: {sample_id} should show class {primary} but it has fewer than "
                    f"{MIN_BOX_PIXELS} visible pixels; raise synthetic.object_radius"
                )
            images.append(image)
            targets.append(target)
            ids.append(sample_id)
        stacked = np.stack(images) if images else np.zeros((0, self.protocol.in_channels, *self.size), np.float32)
        return DetectionSplit(stacked, targets, ids)


def generate_detection(protocol: Protocol) -> list[SessionData]:
    """All sessions of a synthetic detection protocol, generated in memory (no cache).

    Raises:
        DataError: see :class:`DetectionRenderer`.
    """
    renderer = DetectionRenderer(protocol)
    return [renderer.session(s) for s in protocol.sessions]


# ----------------------------------------------------------------------- caching


def _save_npz(path: Path, data: SessionData) -> None:
    """Per split: images (N, C, H, W), ids, and every box flattened, ``offsets`` (N + 1,) marking sample i's
    boxes as rows ``offsets[i]:offsets[i + 1]`` (no object arrays, so the file loads without pickle)."""
    arrays: dict[str, Any] = {}  # Any: numpy's stubs type savez's keyword arguments as allow_pickle's bool
    for name in _SPLITS:
        split = getattr(data, name)
        if split is None:
            continue
        assert isinstance(split, DetectionSplit)
        counts = [len(t["labels"]) for t in split.targets]
        arrays[f"{name}_images"] = np.asarray(split.images, dtype=np.float32)
        arrays[f"{name}_ids"] = np.array(split.ids, dtype=str)
        arrays[f"{name}_offsets"] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        boxes = [t["boxes"] for t in split.targets]
        labels = [t["labels"] for t in split.targets]
        arrays[f"{name}_boxes"] = np.concatenate(boxes).astype(np.float32) if boxes else np.zeros((0, 4), np.float32)
        arrays[f"{name}_labels"] = np.concatenate(labels).astype(np.int64) if labels else np.zeros(0, np.int64)
    atomic_write(path, lambda tmp: np.savez_compressed(tmp, **arrays), suffix=".tmp.npz")


def _load_npz(path: Path, session: SessionSpec) -> SessionData:
    splits: dict[str, DetectionSplit] = {}
    try:
        with np.load(path, allow_pickle=False) as z:
            for name in _SPLITS:
                if f"{name}_images" not in z:
                    continue
                offsets, boxes, labels = z[f"{name}_offsets"], z[f"{name}_boxes"], z[f"{name}_labels"]
                targets = [{"boxes": boxes[a:b], "labels": labels[a:b]} for a, b in zip(offsets[:-1], offsets[1:])]
                ids = [str(i) for i in z[f"{name}_ids"]]
                splits[name] = DetectionSplit(z[f"{name}_images"], targets, ids)
    except (OSError, ValueError, KeyError) as exc:
        raise DataError(f"{path}: corrupt cache file ({exc}); delete it and rerun") from None
    return SessionData(session, splits["train"], splits["test"], splits.get("unlabelled"), splits.get("validation"))


def load_or_generate_detection(
    protocol: Protocol, cache_dir: str | Path | None = None, progress: Callable[[str], None] | None = None
) -> list[SessionData]:
    """All sessions of a synthetic detection protocol, generated once and cached on disk.

    Same folder as :func:`jascl.data.synthetic.load_or_generate` (``<cache>/synthetic/<name>-<digest>``,
    :func:`~jascl.data.synthetic.protocol_digest`), files ``session<i>.det<DETECTION_FORMAT>.npz``.

    Raises:
        DataError: see :class:`DetectionRenderer`; a corrupt cache file.
    """
    renderer = DetectionRenderer(protocol)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / "synthetic" / f"{protocol.name}-{protocol_digest(protocol)}"
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for session in protocol.sessions:
        path = folder / f"session{session.index}.det{DETECTION_FORMAT}.npz"
        if path.exists():
            out.append(_load_npz(path, session))
            continue
        if progress:
            progress(f"generating session {session.index} ({session.name}, boxes)")
        data = renderer.session(session)
        _save_npz(path, data)
        out.append(data)
    return out
