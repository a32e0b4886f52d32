"""COCO-format detection data: an instances JSON beside an image folder.

The on-disk layout (COCO 2017 validation, and each COCO-O domain, :mod:`jascl.data.coco_o`)::

    <split root>/
        annotations/instances_val2017.json   the instances JSON (any name: it is given as a path)
        val2017/<file_name>                  the images the JSON's "images" entries name

The JSON holds three lists (``info`` / ``licenses`` are not read):

* ``images``: ``{"id": int, "file_name": str, "width": int, "height": int}``;
* ``annotations``: ``{"id": int, "image_id": int, "category_id": int, "bbox": [x, y, w, h], "iscrowd": 0 | 1}``
  with ``bbox`` in pixels, ``(x, y)`` its top-left corner (COCO's ``xywh``);
* ``categories``: ``{"id": int, "name": str}``; COCO's 80 classes use ids 1..90 with gaps.

Boxes are read as ``xyxy`` (``x1 = x, y1 = y, x2 = x + w, y2 = y + h``), the format torchvision's detection
models and :class:`jascl.evaluation.detection.DetectionMetrics` take.

:func:`check_coco` reports every defect of a split as one line naming the file (``jascl data check --coco``):
malformed JSON or missing keys, image files missing or unreadable or of another size than the JSON says, boxes
outside the image (beyond :data:`BOX_TOLERANCE` pixels) or with a non-positive width / height, annotations
whose category or image id is unknown, duplicate ids, and images without annotations where every image is
expected to show objects. :class:`CocoDetection` serves a split as ``(image, target)`` pairs for torchvision
detection models.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jascl.data.layouts.base import Problem
from jascl.errors import DataError

__all__ = [
    "BOX_TOLERANCE",
    "CocoBox",
    "CocoDetection",
    "CocoImage",
    "CocoSplit",
    "check_coco",
    "load_coco",
    "xywh_to_xyxy",
]

#: how far (pixels) a box may reach past the image border before the check reports it: COCO's own boxes come
#: from float polygon extents and some end a fraction of a pixel outside their image
BOX_TOLERANCE = 1.0

_IMAGE_KEYS = ("id", "file_name", "width", "height")
_ANNOTATION_KEYS = ("id", "image_id", "category_id", "bbox")
_CATEGORY_KEYS = ("id", "name")


def xywh_to_xyxy(bbox: Iterable[float]) -> tuple[float, float, float, float]:
    """COCO's ``[x, y, width, height]`` as ``(x1, y1, x2, y2)`` (top-left and bottom-right corners)."""
    x, y, w, h = (float(v) for v in bbox)
    return x, y, x + w, y + h


@dataclass(frozen=True)
class CocoImage:
    """One ``images`` entry: its id, file (resolved under the image folder) and size from the JSON."""

    id: int
    file_name: str
    path: Path
    width: int
    height: int


@dataclass(frozen=True)
class CocoBox:
    """One ``annotations`` entry: ``box`` is ``(x1, y1, x2, y2)`` in pixels."""

    id: int
    image_id: int
    category_id: int
    box: tuple[float, float, float, float]
    iscrowd: bool = False


@dataclass
class CocoSplit:
    """A COCO-format split as read by :func:`load_coco`.

    Attributes:
        json_path: the instances JSON.
        image_dir: the folder the ``file_name`` entries are relative to.
        categories: category id -> name, in the JSON's order.
        images: the ``images`` entries, in the JSON's order.
        boxes: image id -> its annotations (every image id of ``images`` is a key, maybe with no boxes).
    """

    json_path: Path
    image_dir: Path
    categories: dict[int, str]
    images: list[CocoImage]
    boxes: dict[int, list[CocoBox]] = field(default_factory=dict)

    def annotation_counts(self) -> dict[int, int]:
        """Category id -> number of annotations (crowd ones included), every category listed (0 if none)."""
        counts = dict.fromkeys(self.categories, 0)
        for boxes in self.boxes.values():
            for b in boxes:
                if b.category_id in counts:
                    counts[b.category_id] += 1
        return counts


def _read_json(json_path: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The parsed JSON, or None and the one line saying why not."""
    if not json_path.is_file():
        return None, [str(Problem(json_path, "instances JSON not found", "give the path of the annotations file"))]
    try:
        data = json.loads(json_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, [str(Problem(json_path, f"not valid JSON ({exc})", "re-download or re-export the file"))]
    if not isinstance(data, dict):
        return None, [str(Problem(json_path, f"holds a {type(data).__name__}, not a COCO object", "re-export it"))]
    missing = [k for k in ("images", "annotations", "categories") if not isinstance(data.get(k), list)]
    if missing:
        return None, [
            str(
                Problem(
                    json_path,
                    f"key(s) {', '.join(missing)} missing or not lists",
                    "a COCO instances file has 'images', 'annotations' and 'categories' lists",
                )
            )
        ]
    return data, []


def _entry_problem(json_path: Path, what: str, index: int, entry: Any, keys: tuple[str, ...]) -> str | None:
    if not isinstance(entry, dict):
        return str(Problem(json_path, f"{what}[{index}] is not an object", "fix the entry"))
    missing = [k for k in keys if k not in entry]
    if missing:
        ident = f" (id {entry['id']!r})" if "id" in entry else ""
        return str(Problem(json_path, f"{what}[{index}]{ident} lacks key(s) {', '.join(missing)}", "fix the entry"))
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _parse(
    json_path: Path, image_dir: Path, data: dict[str, Any], problems: list[str]
) -> tuple[dict[int, str], list[CocoImage], dict[int, list[CocoBox]], dict[int, int]]:
    """Categories, images and boxes of the well-formed entries; a line in ``problems`` for each other one.

    Also returns annotation id -> its index, for messages."""
    categories: dict[int, str] = {}
    for i, c in enumerate(data["categories"]):
        bad = _entry_problem(json_path, "categories", i, c, _CATEGORY_KEYS)
        if bad is None and c["id"] in categories:
            bad = str(Problem(json_path, f"categories[{i}]: category id {c['id']} listed twice", "keep one entry"))
        if bad:
            problems.append(bad)
            continue
        categories[int(c["id"])] = str(c["name"])
    images: list[CocoImage] = []
    seen: set[int] = set()
    for i, im in enumerate(data["images"]):
        bad = _entry_problem(json_path, "images", i, im, _IMAGE_KEYS)
        if bad is None and not (_number(im["width"]) and _number(im["height"]) and im["width"] > 0 < im["height"]):
            bad = str(
                Problem(
                    json_path,
                    f"images[{i}] (id {im['id']}): width / height {im['width']!r} x {im['height']!r} are not positive "
                    "numbers",
                    "fix the entry",
                )
            )
        if bad is None and im["id"] in seen:
            bad = str(Problem(json_path, f"images[{i}]: image id {im['id']} listed twice", "keep one entry"))
        if bad:
            problems.append(bad)
            continue
        seen.add(int(im["id"]))
        images.append(
            CocoImage(
                int(im["id"]),
                str(im["file_name"]),
                image_dir / str(im["file_name"]),
                int(im["width"]),
                int(im["height"]),
            )
        )
    boxes: dict[int, list[CocoBox]] = {im.id: [] for im in images}
    index: dict[int, int] = {}
    for i, a in enumerate(data["annotations"]):
        bad = _entry_problem(json_path, "annotations", i, a, _ANNOTATION_KEYS)
        if bad is None and a["id"] in index:
            bad = str(Problem(json_path, f"annotations[{i}]: annotation id {a['id']} listed twice", "keep one entry"))
        if bad is None and not (
            isinstance(a["bbox"], list) and len(a["bbox"]) == 4 and all(_number(v) for v in a["bbox"])
        ):
            bad = str(
                Problem(
                    json_path,
                    f"annotations[{i}] (id {a['id']}): bbox {a['bbox']!r} is not four finite numbers [x, y, w, h]",
                    "fix the entry",
                )
            )
        if bad:
            problems.append(bad)
            continue
        index[int(a["id"])] = i
        box = CocoBox(
            int(a["id"]), int(a["image_id"]), int(a["category_id"]), xywh_to_xyxy(a["bbox"]), bool(a.get("iscrowd", 0))
        )
        boxes.setdefault(box.image_id, []).append(box)
    return categories, images, boxes, index


def load_coco(json_path: str | Path, image_dir: str | Path) -> CocoSplit:
    """Read a COCO-format split (the images are not opened).

    Raises:
        DataError: the JSON is missing, malformed, lacks a key, or an entry is malformed (the first problem's
            line; :func:`check_coco` lists them all).
    """
    json_path, image_dir = Path(json_path), Path(image_dir)
    data, problems = _read_json(json_path)
    if data is None:
        raise DataError(problems[0])
    categories, images, boxes, _ = _parse(json_path, image_dir, data, problems)
    if problems:
        raise DataError(
            problems[0] + (f" (and {len(problems) - 1} more; see jascl data check)" if problems[1:] else "")
        )
    return CocoSplit(json_path, image_dir, categories, images, boxes)


def _image_problem(image: CocoImage) -> str | None:
    """Missing / unreadable file, or a size other than the JSON's (only the header is read)."""
    from PIL import Image, UnidentifiedImageError

    if not image.path.is_file():
        return str(
            Problem(
                image.path,
                f"image file missing (image id {image.id} of the instances JSON)",
                "copy the image into the image folder or drop its entry",
            )
        )
    try:
        with Image.open(image.path) as im:
            size = im.size
    except (OSError, UnidentifiedImageError) as exc:
        return str(Problem(image.path, f"image file unreadable ({exc})", "re-download the file"))
    if size != (image.width, image.height):
        return str(
            Problem(
                image.path,
                f"image is {size[0]} x {size[1]} pixels but the JSON says {image.width} x {image.height} "
                f"(image id {image.id})",
                "fix width / height in the JSON; boxes are checked against them",
            )
        )
    return None


def check_coco(json_path: str | Path, image_dir: str | Path, expect_annotations: bool = True) -> list[str]:
    """Every defect of a COCO-format split, one line each naming the file (``path: what; fix``).

    Args:
        json_path: the instances JSON.
        image_dir: the folder its ``file_name`` entries are relative to.
        expect_annotations: report images that have no annotation (every image of a detection training or
            test split should show an object; COCO's own val2017 has 48 that do not, so pass False for it).

    Returns:
        The lines; empty for a sound split. A malformed JSON gives one line and nothing else is checked.
        Box and annotation lines name the JSON (and the annotation / image id); image lines name the image.
    """
    json_path, image_dir = Path(json_path), Path(image_dir)
    data, problems = _read_json(json_path)
    if data is None:
        return problems
    categories, images, boxes, _ = _parse(json_path, image_dir, data, problems)
    if not image_dir.is_dir():
        problems.append(str(Problem(image_dir, "image folder not found", "give the folder the JSON's images are in")))
    else:
        problems += [p for p in (_image_problem(im) for im in images) if p is not None]
    by_id = {im.id: im for im in images}
    for image_id, image_boxes in boxes.items():
        for b in image_boxes:
            where = f"annotation id {b.id} (image id {b.image_id})"
            if b.category_id not in categories:
                problems.append(
                    str(
                        Problem(
                            json_path,
                            f"{where}: category id {b.category_id} is not in 'categories' "
                            f"({', '.join(map(str, sorted(categories))) or 'none'})",
                            "fix category_id or add the category",
                        )
                    )
                )
            im = by_id.get(image_id)
            if im is None:
                problems.append(
                    str(Problem(json_path, f"{where}: image id {image_id} is not in 'images'", "fix image_id"))
                )
                continue
            x1, y1, x2, y2 = b.box
            tol = BOX_TOLERANCE
            outside = x1 < -tol or y1 < -tol or x2 > im.width + tol or y2 > im.height + tol
            if x2 <= x1 or y2 <= y1:
                problems.append(
                    str(
                        Problem(
                            json_path,
                            f"{where}: box has non-positive size (w {x2 - x1:g}, h {y2 - y1:g})",
                            "fix or drop the annotation",
                        )
                    )
                )
            elif outside:
                problems.append(
                    str(
                        Problem(
                            json_path,
                            f"{where}: box (x1 {x1:g}, y1 {y1:g}, x2 {x2:g}, y2 {y2:g}) lies outside the "
                            f"{im.width} x {im.height} image {im.file_name}",
                            "fix the bbox or the image size",
                        )
                    )
                )
    if expect_annotations:
        for im in images:
            if not boxes.get(im.id):
                problems.append(
                    str(
                        Problem(
                            json_path,
                            f"image id {im.id} ({im.file_name}) has no annotation",
                            "annotate it or drop it (or pass --allow-unannotated if empty images are intended)",
                        )
                    )
                )
    return problems


class CocoDetection(torch.utils.data.Dataset):
    """A COCO-format split as ``(image, target)`` pairs, as torchvision's detection models take them.

    ``image`` is ``(3, H, W)`` float32 RGB in ``[0, 1]``; ``target`` is ``{"boxes": (N, 4) float32 xyxy pixels,
    "labels": (N,) int64}`` (plus ``"iscrowd": (N,) int64`` with ``keep_crowd``). As in torchvision's COCO
    detection reference, boxes are clipped to the image and those left without area are dropped, and crowd
    annotations are dropped unless ``keep_crowd`` (pycocotools' evaluation treats them as ignore regions).

    Args:
        json_path: the instances JSON.
        image_dir: the image folder.
        label_of: COCO category id -> model label (0 is the detector's background, so labels start at 1);
            annotations of a category not in it are dropped. Default: the category id itself (torchvision's COCO
            models use the raw ids 1..90).
        image_ids: keep only these images, in this order (e.g. a K-shot selection); default all, JSON order.
        keep_crowd: keep crowd annotations and add ``"iscrowd"`` to the target.

    Raises:
        DataError: the JSON is malformed (see :func:`load_coco`), or ``image_ids`` names an unknown image.
    """

    def __init__(
        self,
        json_path: str | Path,
        image_dir: str | Path,
        label_of: Mapping[int, int] | None = None,
        image_ids: Iterable[int] | None = None,
        keep_crowd: bool = False,
    ) -> None:
        self.split = load_coco(json_path, image_dir)
        self.label_of = dict(label_of) if label_of is not None else {c: c for c in self.split.categories}
        by_id = {im.id: im for im in self.split.images}
        if image_ids is None:
            self.images = list(self.split.images)
        else:
            unknown = [i for i in image_ids if i not in by_id]
            if unknown:
                raise DataError(f"{self.split.json_path}: image id(s) {unknown[:5]} are not in 'images'")
            self.images = [by_id[i] for i in image_ids]
        self.keep_crowd = keep_crowd

    def __len__(self) -> int:
        return len(self.images)

    def target(self, index: int) -> dict[str, torch.Tensor]:
        """The target of image ``index`` without decoding the image."""
        im = self.images[index]
        rows, labels, crowd = [], [], []
        for b in self.split.boxes.get(im.id, []):
            if b.category_id not in self.label_of or (b.iscrowd and not self.keep_crowd):
                continue
            x1, y1, x2, y2 = b.box
            x1, x2 = min(max(x1, 0.0), im.width), min(max(x2, 0.0), im.width)
            y1, y2 = min(max(y1, 0.0), im.height), min(max(y2, 0.0), im.height)
            if x2 <= x1 or y2 <= y1:
                continue
            rows.append((x1, y1, x2, y2))
            labels.append(self.label_of[b.category_id])
            crowd.append(int(b.iscrowd))
        out = {
            "boxes": torch.tensor(rows, dtype=torch.float32).reshape(-1, 4),
            "labels": torch.tensor(labels, dtype=torch.int64),
        }
        if self.keep_crowd:
            out["iscrowd"] = torch.tensor(crowd, dtype=torch.int64)
        return out

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from PIL import Image

        im = self.images[index]
        try:
            with Image.open(im.path) as f:
                rgb = np.asarray(f.convert("RGB"), dtype=np.float32) / 255.0
        except OSError as exc:
            raise DataError(
                f"{im.path}: image file missing or unreadable ({exc}); run jascl data check --coco"
            ) from exc
        return torch.from_numpy(rgb).permute(2, 0, 1).contiguous(), self.target(index)
